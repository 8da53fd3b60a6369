"""Acceptance of the Python SDK: build the `tokenwire-client` wheel, install it into a fresh
virtualenv (nothing else from this repository), and run python_cases.py there against a live
`tokenwire launch`, directly and through Envoy's port."""

from __future__ import annotations

import json
import re
import shutil
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.helpers.processes import Deployment, run_checked
from tests.helpers.python_sdk import SDK, sdk_venv, shared_wheel
from tests.helpers.raw_grpc import RawClient

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CASES_SCRIPT = Path(__file__).with_name("python_cases.py")
PROMPT = "The quick brown fox"  # python_cases.PROMPT (that script runs in the SDK's venv)

# The cases python_cases.py runs (it reports each by name); README examples come on top.
CASES = [
    "sync_generate",
    "sync_stream_cancel",
    "sync_validation_error",
    "sync_deadline",
    "sync_info",
    "sync_health",
    "sync_chat",
    "sync_agents",
    "async_generate",
    "async_stream_cancel",
    "async_validation_error",
    "async_deadline",
    "async_info",
    "async_health",
    "async_chat",
    "async_agents",
    "packaging",
]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_wheel(tmp_path_factory)


@pytest.fixture(scope="module")
def venv_python(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sdk_venv(wheel, tmp_path_factory.mktemp("sdk-py-venv"))


def test_wheel_holds_only_tokenwire_client(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names}
    assert {t for t in top_level if not t.endswith(".dist-info")} == {"tokenwire_client"}
    assert "tokenwire_client/py.typed" in names
    assert "tokenwire_client/_generated/google/protobuf/__init__.py" in names


def test_sdk_versions_match_the_server() -> None:
    server = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    python_sdk = tomllib.loads((SDK / "pyproject.toml").read_text())["project"]["version"]
    typescript_sdk = json.loads((REPO / "clients/typescript/package.json").read_text())["version"]
    assert python_sdk == typescript_sdk == server


@pytest.fixture(scope="module", params=["direct", "envoy"])
def run(
    request: pytest.FixtureRequest,
    venv_python: Path,
    live_server: Deployment,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, dict[str, object]]:
    """python_cases.py's report, run in the fresh venv from an empty folder so that nothing of
    this repository is importable: "outcomes" (None: passed; else the traceback) and
    "observed" (what the SDK returned and what the README examples printed)."""
    target = live_server.target if request.param == "direct" else live_server.envoy_target
    work = tmp_path_factory.mktemp(f"sdk-py-{request.param}")
    out = work / "results.json"
    run_checked(
        [venv_python, CASES_SCRIPT, target, SDK / "README.md", out],
        cwd=work,
        env={"PATH": "/usr/bin:/bin"},
        timeout=240,
    )
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def results(run: dict[str, dict[str, object]]) -> dict[str, str | None]:
    return run["outcomes"]  # type: ignore[return-value]


@pytest.fixture(scope="module")
def observed(run: dict[str, dict[str, object]]) -> dict[str, object]:
    return run["observed"]


@pytest.fixture(scope="module")
def raw(live_server: Deployment) -> RawClient:
    return RawClient(live_server.target)


@pytest.mark.parametrize("case", CASES)
def test_case(results: dict[str, str | None], case: str) -> None:
    assert case in results, sorted(results)
    assert results[case] is None, results[case]


def test_readme_examples(results: dict[str, str | None]) -> None:
    examples = {name: outcome for name, outcome in results.items() if name.startswith("readme_")}
    assert len(examples) >= 4
    failed = {name: outcome for name, outcome in examples.items() if outcome is not None}
    assert not failed, "\n".join(f"{name}:\n{outcome}" for name, outcome in failed.items())


def test_sdk_results_equal_raw_grpc(observed: dict[str, object], raw: RawClient) -> None:
    """The SDK's greedy results are the server's: text, token ids and finish reason equal a raw
    gRPC call's (generated stubs, no SDK) for the same request."""
    greedy = {"max_new_tokens": 5, "details": True, "temperature": 0.0}
    assert observed["sync_generate"] == raw.generate(PROMPT, **greedy)
    assert observed["async_generate"] == raw.generate(PROMPT, **greedy)
    assert observed["async_concurrent_texts"] == [
        raw.generate(PROMPT, max_new_tokens=n)["text"] for n in (2, 3)
    ]
    assert observed["sync_stream"] == raw.stream(PROMPT, max_new_tokens=3, temperature=0.0)


def test_readme_examples_print_what_the_server_answers(
    observed: dict[str, object], raw: RawClient
) -> None:
    """Each README example's printed output, from the same requests made over raw gRPC."""
    first = raw.generate("The capital of France is", max_new_tokens=8, details=True)
    assert observed["readme_example_0"] == (
        f"{first['text']}\n{first['finish_reason']} {first['ids']}\n"
    )
    # The stream example prints token texts as they come and cancels after index 3.
    texts = raw.token_texts("Once upon a time", max_new_tokens=64)
    assert observed["readme_example_1"] == "".join(texts[:4])
    info = raw.info()
    hello = raw.generate("Hello", max_new_tokens=4)["text"]
    assert observed["readme_example_2"] == (f"{info.model_id} {info.max_total_tokens}\n{hello}\n")
    # The chat example prints the reply and its token count, then the same reply streamed (greedy:
    # equal), then a completion.
    chat = re.fullmatch(r"(.*) (\d+)\n\1(.*)\n", str(observed["readme_example_3"]), re.DOTALL)
    assert chat is not None and int(chat[2]) > 0, observed["readme_example_3"]
    rejected = raw.validation_message("Hi", top_p=1.5)
    assert observed["readme_example_4"] == f"rejected: {rejected}\ntoo slow\nhealthy: True\n"


def test_sdk_unit_tests_pass_in_the_fresh_venv(venv_python: Path, tmp_path: Path) -> None:
    """clients/python/tests (a fake in-process server: API key, in-band errors, overload, cancel
    reaching the server) against the installed wheel; only pytest is added to the venv."""
    run_checked(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            venv_python,
            "install",
            "-q",
            "--disable-pip-version-check",
            "pytest>=8",
        ],
        timeout=300,
    )
    tests = tmp_path / "tests"
    shutil.copytree(SDK / "tests", tests, ignore=shutil.ignore_patterns("__pycache__"))
    result = run_checked(
        [
            venv_python,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-c",
            "/dev/null",
            "--rootdir",
            tmp_path,
            tests,
        ],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin"},
        timeout=240,
    )
    assert " passed" in result.stdout and "failed" not in result.stdout, result.stdout
