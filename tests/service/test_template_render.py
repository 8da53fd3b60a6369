"""service/generation/template_render.py renders exactly what transformers' apply_chat_template
renders (the reference the model authors test against), without importing transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from service.generation.template_render import ModelTemplates, TemplateRejected, TemplateRenderer

# Templates exercising what Hub templates use: tools + tojson(indent), loop controls, the
# generation tag, raise_exception, special tokens, whitespace control.
TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<tools>{% for t in tools %}{{ t | tojson(indent=2) }}\n"
    "{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' and not loop.first %}{{ raise_exception('system only first') }}"
    "{% endif %}"
    "{% if m['role'] == 'skip' %}{% continue %}{% endif %}"
    "<|{{ m['role'] }}|>\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | trim }}{% endgeneration %}"
    "{% else %}{{ m['content'] }}{% endif %}"
    "{% if m.tool_calls is defined %}{% for c in m.tool_calls %}"
    "<call>{{ c.function | tojson }}</call>{% endfor %}{% endif %}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "héllo ünïcode 東京"},
        {"role": "skip", "content": "never shown"},
        {"role": "assistant", "content": "  Hi  ",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "f", "arguments": {"x": "é", "n": 1}}}]},
        {"role": "tool", "content": "{\"ok\": true}", "tool_call_id": "c1"},
        {"role": "user", "content": "again"},
    ],
]
TOOLS = [{"type": "function", "function": {"name": "f", "description": "ünïcode",
                                           "parameters": {"type": "object"}}}]


def write_model_dir(tmp: Path, template: str) -> Path:
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>", "lstrip": False},
              "chat_template": template}
    (tmp / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp


def transformers_render(model_dir: Path, cases: list[dict]) -> list[str]:
    """The reference, in a subprocess (importing transformers here would hide an import of it
    by the code under test)."""
    script = (
        "import json, sys\n"
        "from transformers.utils.chat_template_utils import render_jinja_template\n"
        "cases = json.load(sys.stdin)\n"
        "out = []\n"
        "for c in cases:\n"
        "    rendered, _ = render_jinja_template(conversations=[c['messages']], tools=c['tools'],\n"
        "        chat_template=c['template'], add_generation_prompt=True, **c['special'])\n"
        "    out.append(rendered[0])\n"
        "print(json.dumps(out))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], input=json.dumps(cases), text=True,
                          capture_output=True, check=True, timeout=300)
    return json.loads(done.stdout)


def test_renders_like_transformers_with_tools_and_tags(tmp_path: Path) -> None:
    templates = ModelTemplates.read(write_model_dir(tmp_path, TOOLS_TEMPLATE))
    assert templates.special_tokens == {"bos_token": "<s>", "eos_token": "</s>"}
    renderer = TemplateRenderer(templates.pick(with_tools=True), templates.special_tokens)
    cases = [
        {"messages": c, "tools": t, "template": TOOLS_TEMPLATE, "special": templates.special_tokens}
        for c in CONVERSATIONS for t in (None, TOOLS)
    ]
    expected = transformers_render(tmp_path, cases)
    got = [renderer.render(c["messages"], c["tools"]) for c in cases]
    assert got == expected
    assert "東京" in got[2] and "\"ünïcode\"" in got[3]  # tojson keeps non-ASCII text


def test_template_errors_are_rejections_not_crashes(tmp_path: Path) -> None:
    renderer = TemplateRenderer(TOOLS_TEMPLATE, {"bos_token": "<s>", "eos_token": "</s>"})
    with pytest.raises(TemplateRejected, match="system only first"):
        renderer.render([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])
    with pytest.raises(TemplateRejected):  # a template reading a key the message lacks
        TemplateRenderer("{{ messages[0]['content'].missing() }}", {}).render(
            [{"role": "user", "content": "a"}]
        )
    with pytest.raises(TemplateRejected, match="does not compile"):
        TemplateRenderer("{% for m in messages %}", {})


def test_sandbox_blocks_attribute_escapes() -> None:
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(TemplateRejected):
        TemplateRenderer(escape, {}).render([{"role": "user", "content": "a"}])


def test_named_templates_and_jinja_file(tmp_path: Path) -> None:
    config = {"chat_template": [{"name": "default", "template": "D{{ messages | length }}"},
                                {"name": "tool_use", "template": "T{{ tools | length }}"}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    templates = ModelTemplates.read(tmp_path)
    assert TemplateRenderer(templates.pick(False), {}).render([{}]) == "D1"
    assert TemplateRenderer(templates.pick(True), {}).render([{}], TOOLS) == "T1"
    (tmp_path / "chat_template.jinja").write_text("J")  # transformers' newer place wins
    assert ModelTemplates.read(tmp_path).pick(False) == "J"
