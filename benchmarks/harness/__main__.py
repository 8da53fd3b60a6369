"""`python -m benchmarks.harness [--parts ...]` from the repository root (see bench.py)."""

from __future__ import annotations

import argparse
import sys

from benchmarks.harness import bench


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.harness")
    bench.add_arguments(parser)
    return bench.run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
