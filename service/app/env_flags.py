"""Environment fallbacks for command-line flags (TGI users set MODEL_ID, PORT, ...).

Read when a parser is built or flags are resolved, never at import time."""

from __future__ import annotations

import os


def env_value(*names: str) -> str | None:
    """The first of the variables that is set and not empty."""
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            return value
    return None


def env_bool(*names: str) -> bool:
    """True when the first set variable reads 1, true, yes or on (any case)."""
    value = env_value(*names)
    return value is not None and value.lower() in ("1", "true", "yes", "on")
