"""Tests that need an external tool (buf, hadolint, node, triton, bitsandbytes, ...) skip where it
is missing on a developer machine, but FAIL under `CI=true`: the CI image installs every tool
(`make setup`), so a missing one there is a broken environment, not a reason to stay green."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def in_ci() -> bool:
    """True when the CI variable says so (GitHub Actions and most CI systems set CI=true)."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def tool_missing(reason: str) -> NoReturn:
    """Skips the running test, or fails it under CI=true."""
    if in_ci():
        pytest.fail(f"{reason} (CI=true: a missing tool fails the test)", pytrace=False)
    pytest.skip(reason)


def require(available: bool, reason: str) -> None:
    """Calls tool_missing(reason) unless `available`."""
    if not available:
        tool_missing(reason)


def needs(available: bool, reason: str) -> pytest.MarkDecorator:
    """A mark for tests (or a module's pytestmark) that need a tool; tests/conftest.py applies
    it before each test: a skip without the tool, a failure under CI=true."""
    return pytest.mark.needs_tool(available=available, reason=reason)


def check_needs_tool(item: pytest.Item) -> None:
    """The setup hook of the `needs_tool` mark (called from tests/conftest.py)."""
    for mark in item.iter_markers("needs_tool"):
        require(mark.kwargs["available"], mark.kwargs["reason"])
