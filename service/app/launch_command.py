"""`tokenwire launch`: one replica (service.app.launcher) or, with --replicas N > 1, N replicas
behind one gateway (service.app.replicas). Same flags either way."""

from __future__ import annotations

import argparse

from service.app.launcher import add_arguments
from service.app.launcher import run as run_one
from service.app.replicas import run_replicas

__all__ = ["add_arguments", "run"]


def run(args: argparse.Namespace) -> int:
    if args.replicas > 1:
        return run_replicas(args)
    return run_one(args)
