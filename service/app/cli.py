"""The `tokenwire` command: one entry point whose subcommands live in their own modules.

Each subcommand module exposes `add_arguments(parser)` and `run(args) -> int`; it is imported only
when chosen, so `tokenwire router` never imports torch and `tokenwire --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# subcommand -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "launch": (
        "service.app.launch_command",
        "start shards, the router and (with --http-port) Envoy; or N replicas behind a gateway",
    ),
    "router": ("service.app.router", "serve the public gRPC API in front of running shards"),
    "gateway": (
        "service.app.gateway_command",
        "Envoy and the endpoint picker in front of many replicas",
    ),
    "shard": ("shard.server.main", "serve one tensor-parallel rank of a model"),
    "download": ("shard.tools.download", "fetch a model snapshot from the Hugging Face Hub"),
    "make-tiny-model": ("shard.tools.tiny_model", "write a tiny random-weight model and tokenizer"),
    "quantize": ("shard.tools.quantize", "calibrated (GPTQ) fp8 / nf4 weights and fp8 KV scales"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """Builds the top-level parser, importing only the chosen subcommand's module."""
    parser = argparse.ArgumentParser(prog="tokenwire", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text)
        if name == chosen:
            module = importlib.import_module(module_name)
            module.add_arguments(sub_parser)
            sub_parser.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if next((a for a in argv if not a.startswith("-")), None) == "launch":
        # The launcher starts its children through fork + a pre-exec hook (own session, parent-
        # death signal) after it has used gRPC (health checks). gRPC's fork handlers restart its
        # pollers in the child before the exec, and about 2 % of children died there ("Check
        # failed: wakeup_fd_->Wakeup().ok()", exit -6; grpc/grpc#43055). The children exec at
        # once and never use gRPC across the fork, so the launcher needs no fork support. Set
        # before the subcommand's module imports grpc.
        os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    args = build_parser(argv).parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
