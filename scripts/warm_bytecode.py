"""Imports the named modules so that Python writes their bytecode, and exits 0 whatever happens.

The Makefile installs with pip's --no-compile (byte-compiling every file torch ships cost two
minutes), so the first processes that import torch, transformers or anthropic compile the modules
they use: at `make test`'s start both pytest-xdist workers compiled the same ones while collecting
(~45 s until collection ended on this 2-core host instead of ~17 s with the bytecode written).
The Makefile runs this in the background on packages already installed while pip works on the
next step (pip keeps one core busy), so that work lands on the idle core. A module that fails to
import only leaves its bytecode to the first process that needs it.

Usage: python scripts/warm_bytecode.py MODULE...
"""

from __future__ import annotations

import importlib
import sys


def main(names: list[str]) -> int:
    for name in names:
        try:
            importlib.import_module(name)
        except BaseException:  # noqa: BLE001 - a head start only; never fail the caller
            continue
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
