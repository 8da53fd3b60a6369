"""Fixtures of the SDK acceptance tests: one real `tokenwire launch` (embedded tiny model, with
Envoy) shared by the Python and TypeScript SDK tests of a session."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

from tests.helpers.processes import Deployment, launch


# A plain ChatML template: one `<|im_start|>role\ncontent<|im_end|>\n` block per message.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="session")
def live_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """`tokenwire launch --port P --http-port H` serving the embedded tiny model, with a ChatML
    chat template given by --chat-template (the tiny model has none) for the chat calls."""
    work = tmp_path_factory.mktemp("sdk-launch")
    template = work / "chatml.jinja"
    template.write_text(CHATML)
    deployment = launch(work, "--chat-template", str(template), http=True)
    try:
        yield deployment
    finally:
        if deployment.stop() not in (0, -signal.SIGTERM):
            print(deployment.log())
