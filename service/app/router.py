"""`tokenwire router`: serve the public gRPC API in front of running shards.

Startup: connect to rank 0 (which names the other ranks), read Info, Warmup with the budgets,
build the engine, then serve `tokenwire.v1.TextGeneration`, `grpc.health.v1.Health` (NOT_SERVING
until warm) and server reflection. SIGTERM/SIGINT: NOT_SERVING, drain up to --graceful-timeout,
stop. Flags fall back to the environment variables TGI users know (PORT, MAX_INPUT_TOKENS, ...).

Pieces: the flags and the settings resolved from them (service.app.router_flags), where the
engine comes from (service.app.engine_source), serving and draining (service.app.serve).
`--frontends N` (N >= 2) runs the same public router in N front-end processes sharing the port
(SO_REUSEPORT) beside one scheduler process that owns the engine (service.app.scheduler_process);
the default, `--frontends auto`, picks N from the CPUs this process may use
(router_flags.resolve_frontends: 1 below 8 CPUs).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from service.app.ports import port_in_use
from service.app.router_flags import (
    FlagError,
    add_arguments,
    resolve_frontends,
    resolve_router_detokenize,
    usable_cpus,
)
from service.app.scheduler_process import run_multiprocess
from service.app.serve import serve
from service.observability.logs import setup_logging

__all__ = ["FLAG_ERROR_EXIT_CODE", "add_arguments", "run"]

# The exit code of a flag the model cannot serve (as argparse's usage errors): the launcher
# recognises it and adds nothing to the router's one-line message.
FLAG_ERROR_EXIT_CODE = 2

_log = logging.getLogger("tokenwire.router")


def run(args: argparse.Namespace) -> int:
    requested = args.frontends
    args.frontends = resolve_frontends(requested)
    if args.frontends < 1:
        raise SystemExit(f"--frontends must be >= 1 (got {args.frontends})")
    if args.frontend_backlog_steps <= 0:
        raise SystemExit(
            f"--frontend-backlog-steps must be > 0 (got {args.frontend_backlog_steps})"
        )
    args.router_detokenize = resolve_router_detokenize(args.router_detokenize, args.frontends)
    setup_logging(json_output=args.json_output, level=args.log_level)
    _log.info(
        "front ends: %d (--frontends %s, %d usable CPUs)%s; text made by the %s",
        args.frontends,
        requested,
        usable_cpus(),
        "" if args.frontends > 1 else ": one process serves the API and runs the engine",
        "router" if args.router_detokenize else "shard",
    )
    try:
        if args.frontends > 1:
            # The front ends share --port through SO_REUSEPORT, which would as quietly share it
            # with another server already listening there (a second deployment on the same port
            # would take part of this one's traffic): refuse before loading anything.
            if args.port and port_in_use(args.hostname, args.port):
                raise FlagError(f"--port {args.port}: {args.hostname}:{args.port} is already in "
                                "use by another process")
            return run_multiprocess(args)
        return asyncio.run(serve(args))
    except KeyboardInterrupt:
        return 130
    except FlagError as error:
        print(f"tokenwire router: error: {error}", file=sys.stderr, flush=True)
        return FLAG_ERROR_EXIT_CODE
