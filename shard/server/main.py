"""`tokenwire shard`: serve one tensor-parallel rank of a model over tokenwire.shard.v1.

Rank r listens on unix://PREFIX-r (--uds-path PREFIX) or 127.0.0.1:BASE+r (--port BASE), with
grpc.health.v1 and server reflection. Every rank receives every RPC; rank 0's answer counts.
Exit status: 0 after SIGTERM/SIGINT, 1 after a fatal device error (so the launcher sees it).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shard.kernels.tuning_cache import TuningCache

log = logging.getLogger("tokenwire.shard")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-id", required=True, help="local directory or hub id")
    parser.add_argument("--revision", default=None, help="hub branch, tag or commit")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                        help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help="default: cuda when available")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=1)
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--uds-path", default=None, help="rank r listens on unix://PREFIX-r")
    where.add_argument("--port", type=int, default=None, help="rank r listens on 127.0.0.1:PORT+r")
    parser.add_argument("--master-addr", default="127.0.0.1", help="torch.distributed rendezvous")
    parser.add_argument("--master-port", type=int, default=29500)
    parser.add_argument("--all-reduce", choices=["auto", "nccl"], default="auto",
                        help="tensor parallel on CUDA: auto = one-shot symmetric-memory "
                        "all-reduce for small (decode) tensors where P2P works, else NCCL")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--cuda-memory-fraction", type=float, default=0.9)
    parser.add_argument("--kv-cache-memory-mb", type=int, default=None,
                        help="KV cache budget on CPU (default: 10%% of available RAM)")
    parser.add_argument("--max-batch-total-tokens", type=int, default=None,
                        help="cap on the KV cache size in tokens")
    parser.add_argument("--attention-backend", default="auto", help="auto | torch | triton")
    parser.add_argument("--model-impl", default="auto", choices=["auto", "native", "transformers"],
                        help="which code serves the model: auto = tokenwire's native code where "
                        "it exists for the model type, else the transformers backend; "
                        "transformers forces the backend (for comparison)")
    parser.add_argument("--quantize", default=None,
                        choices=["bitsandbytes", "bitsandbytes-nf4", "fp8"],
                        help="quantize the linear layers at load time (fp8 checkpoints are "
                        "detected from config.json without it)")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        choices=["auto", "fp8_e4m3fn", "fp8_e5m2"],
                        help="KV cache storage; fp8 halves the bytes per token")
    parser.add_argument("--kv-cache-rotation", default="hadamard", choices=["hadamard", "none"],
                        help="fp8 KV caches: store keys rotated by an orthogonal matrix (queries "
                        "too; scores unchanged, fp8 rounding error of the scores ~3x lower); none "
                        "stores them as they are. Ignored for model-dtype caches")
    parser.add_argument("--max-loras", type=int, default=None,
                        help="LoRA adapters resident on the device at once; their slots are "
                        "reserved before the KV cache is sized (default: 4 with --lora-adapters, "
                        "else 0 = LoRA off)")
    parser.add_argument("--max-lora-rank", type=int, default=16,
                        help="largest LoRA rank accepted (slot size)")
    parser.add_argument("--lora-adapters", default=None,
                        help="adapters to load at start-up: name=path,... (path: a PEFT adapter "
                        "directory or a hub id)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="not supported; present so that a request for it fails clearly")
    parser.add_argument("--profile-from-step", type=int, default=None,
                        help="record the device's timeline (torch.profiler trace of CUDA "
                        "activity + each step's device time) from this step (counted from 0 "
                        "after warm-up) to shutdown; written to --profile-dir at shutdown "
                        "(shard.server.step_profile)")
    parser.add_argument("--profile-dir", type=Path, default=None,
                        help="where --profile-from-step writes (rank r: DIR/rank<r>)")
    parser.add_argument("--tuning-cache-dir", default=None,
                        help="where measured GEMV tuning choices are kept, shared by the ranks "
                        "and by later runs on the same GPU model and software (default: "
                        "gemv_tuning under $TOKENWIRE_CACHE, $XDG_CACHE_HOME/tokenwire or "
                        "~/.cache/tokenwire; 'none': off, every process tunes)")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--otlp-endpoint", default=None,
                        help="OpenTelemetry collector (OTLP/gRPC): rank 0 records Prefill/Decode "
                        "step spans under the requests the router traces (default: off)")
    parser.add_argument("--otlp-service-name", default="tokenwire",
                        help="service name prefix: the shard reports as NAME.shard")


def listen_url(args: argparse.Namespace, rank: int) -> str:
    if args.uds_path:
        return f"unix://{args.uds_path}-{rank}"
    port = args.port if args.port is not None else 5001
    return f"127.0.0.1:{port + rank}"


async def start_server(
    shard, urls: list[str], rank: int, on_fatal: Callable[[str], None], tracer=None,
    profiler=None, gc_pacer=None,
):
    """Builds and starts the grpc.aio server of one rank; returns (server, servicer, health)."""
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection
    from tokenwire.shard.v1 import shard_pb2, shard_pb2_grpc

    from shard.server.servicer import ShardServicer

    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", 256 * 2**20),
            ("grpc.max_send_message_length", 256 * 2**20),
        ]
    )
    servicer = ShardServicer(shard, urls, on_fatal, tracer, profiler, gc_pacer)
    shard_pb2_grpc.add_ShardServiceServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    service_name = shard_pb2.DESCRIPTOR.services_by_name["ShardService"].full_name
    reflection.enable_server_reflection(
        [service_name, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    url = urls[rank]
    if url.startswith("unix://"):
        Path(url.removeprefix("unix://")).unlink(missing_ok=True)
    if server.add_insecure_port(url) == 0:
        raise OSError(f"cannot listen on {url}")
    await server.start()
    for name in ("", service_name):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, servicer, health_servicer


async def serve(args: argparse.Namespace, shard) -> int:
    urls = [listen_url(args, r) for r in range(args.world_size)]
    exit_code = 0
    stop = asyncio.Event()

    def on_fatal(message: str) -> None:
        nonlocal exit_code
        log.error("fatal device error, shutting down: %s", message)
        exit_code = 1
        stop.set()

    from shard.server.tracing import setup_step_tracer

    tracer = (
        setup_step_tracer(args.otlp_endpoint, f"{args.otlp_service_name}.shard")
        if args.rank == 0
        else None
    )
    profiler = None
    if args.profile_from_step is not None:
        from shard.server.step_profile import ProfileWindow, StepProfiler

        window = ProfileWindow(args.profile_from_step, args.profile_dir / f"rank{args.rank}")
        profiler = StepProfiler(window, shard.engine, shard.runner.device)
    from shard.runtime import GcPacer, KernelCompileWatch

    if shard.runner.device.type == "cuda":
        watch = KernelCompileWatch()
        if watch.install():
            shard.compile_watch = watch
    gc_pacer = GcPacer()  # this process serves the model: no full collection inside a step
    gc_pacer.install()
    server, servicer, health_servicer = await start_server(
        shard, urls, args.rank, on_fatal, tracer, profiler, gc_pacer
    )
    log.info("rank %d/%d serving %s on %s", args.rank, args.world_size, args.model_id,
             urls[args.rank])
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    stopping = time.monotonic()
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace=1.0 if exit_code == 0 else 0)
    await servicer.close_profiler()
    servicer.close()
    if tracer is not None:
        tracer.shutdown()
    log.info("stop: gRPC server stopped in %.1f s", time.monotonic() - stopping)
    return exit_code


def _host_memory_line() -> str:
    from shard.server.host_memory import read_host_memory

    memory = read_host_memory()
    return memory.describe() if memory is not None else "host memory not readable"


def tuning_cache_of(flag: str | None) -> TuningCache | None:
    """--tuning-cache-dir's cache (None for 'none'); the default resolved at run time."""
    from shard.kernels.tuning_cache import TuningCache, default_directory
    from shard.tools.cache import cache_dir

    if flag is not None and flag.strip().lower() == "none":
        return None
    return TuningCache(Path(flag) if flag else default_directory(cache_dir()))


def run(args: argparse.Namespace) -> int:
    if (args.profile_from_step is None) != (args.profile_dir is None):
        raise SystemExit("--profile-from-step and --profile-dir go together")
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s rank{args.rank} %(levelname)s %(name)s: %(message)s",
    )
    if args.trust_remote_code:
        log.error("--trust-remote-code is not supported")
        return 2
    import torch

    from shard.distributed.groups import init_distributed, shutdown_distributed
    from shard.kernels import tuning_cache
    from shard.server.loader import Shard, ShardConfig

    tuning_cache.configure(tuning_cache_of(args.tuning_cache_dir))

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        torch.cuda.set_device(args.rank % torch.cuda.device_count())
        device = f"cuda:{torch.cuda.current_device()}"
    dtype = args.dtype or ("float32" if device == "cpu" else "bfloat16")
    if device == "cpu" and "OMP_NUM_THREADS" not in os.environ and args.world_size > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world_size))
    t0 = time.monotonic()
    dist = init_distributed(
        args.rank, args.world_size, args.master_addr, args.master_port, torch.device(device),
        all_reduce=args.all_reduce,
    )
    exit_code = 1  # until serve() returns one: an exception below is a failed shard
    if args.world_size > 1:
        # Every rank waits here for the slowest to start: a long join is a peer's start-up.
        log.info("start-up: process group of %d joined in %.1f s (one-shot all-reduce: %s, fused "
                 "all-reduce + norm: %s)", args.world_size, time.monotonic() - t0,
                 dist.small_all_reduce is not None, dist.fused_all_reduce_norm is not None)
    try:
        cfg = ShardConfig(
            model_id=args.model_id,
            revision=args.revision,
            dtype=dtype,
            device=device,
            block_size=args.block_size,
            cuda_memory_fraction=args.cuda_memory_fraction,
            kv_cache_memory_mb=args.kv_cache_memory_mb,
            max_batch_total_tokens=args.max_batch_total_tokens,
            attention_backend=args.attention_backend,
            model_impl=args.model_impl,
            quantize=args.quantize,
            kv_cache_dtype=args.kv_cache_dtype,
            kv_cache_rotation=args.kv_cache_rotation,
            max_loras=args.max_loras,
            max_lora_rank=args.max_lora_rank,
            lora_adapters=args.lora_adapters,
        )
        t1 = time.monotonic()
        shard = Shard(cfg, dist)
        log.info("start-up: model ready in %.1f s (%.1f s since launch of this rank); %s",
                 time.monotonic() - t1, time.monotonic() - t0, _host_memory_line())
        exit_code = asyncio.run(serve(args, shard))
    finally:
        if args.world_size > 1:
            _tear_down_process_group(shutdown_distributed, exit_code)
    return exit_code


# Seconds a stopping shard waits for its process group's teardown (NCCL communicators, symmetric
# memory) before exiting without it; well inside the launcher's 30 s stop allowance.
_TEARDOWN_S = 5.0


def _tear_down_process_group(shutdown: Callable[[float | None], bool], exit_code: int) -> None:
    """Destroys the process group within _TEARDOWN_S; past that, the process exits at once
    (os._exit: the interpreter's own exit would wait for the same stuck threads), since every
    peer is stopping too and nothing waits for this rank's collectives any more."""
    began = time.monotonic()
    if shutdown(_TEARDOWN_S):
        log.info("stop: process group torn down in %.1f s", time.monotonic() - began)
        return
    log.warning("stop: process group teardown still waiting after %.0f s: exiting without it",
                _TEARDOWN_S)
    logging.shutdown()
    os._exit(exit_code)
