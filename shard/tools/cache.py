"""tokenwire's own cache directory (generated tiny models, converted GGUF snapshots)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(explicit: Path | None = None) -> Path:
    """`explicit`, else $TOKENWIRE_CACHE, else $XDG_CACHE_HOME/tokenwire, else ~/.cache/tokenwire.
    Read at call time, so tests and launches can point it elsewhere through the environment."""
    if explicit is not None:
        return explicit
    if os.environ.get("TOKENWIRE_CACHE"):
        return Path(os.environ["TOKENWIRE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tokenwire"
