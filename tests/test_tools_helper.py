"""tests/helpers/tools.py: a missing tool skips on a developer machine and fails under CI=true."""

from __future__ import annotations

import pytest

from tests.helpers.tools import require


def test_missing_tool_skips_outside_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no frobnicator"):
        require(False, "no frobnicator")
    require(True, "unused")


@pytest.mark.parametrize("value", ["true", "1", "TRUE"])
def test_missing_tool_fails_under_ci(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("CI", value)
    with pytest.raises(pytest.fail.Exception, match="no frobnicator.*CI=true"):
        require(False, "no frobnicator")
