"""Tensor-parallel ranks as spawned processes on one host, for tests and benchmarks.

`run_ranks(world, job, rank_fn)` starts `world` processes (rank r on cuda:r for CUDA jobs, gloo on
CPU), joins them into one process group over a free loopback port, runs `rank_fn` on every rank in
lockstep (its collectives pair up) and returns rank 0's results. `rank_fn` must be a module-level
function (the processes are spawned, so it is pickled by name).
"""

from __future__ import annotations

import os
import queue as queue_mod
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shard.distributed.groups import Dist
from shard.testing.ports import free_port
from shard.testing.tiny import greedy_tokens, load_tiny

# What the CPU ranks' forkserver imports before it forks them (a module that fails to import
# is skipped by multiprocessing; the rank then imports what it needs itself).
_FORKSERVER_PRELOAD = ["torch", "transformers", "shard.testing.ranks"]

# (dist, device, job, results): fills this rank's results in place, so that what it measured
# before a failure is still reported.
RankFn = Callable[[Dist, str, dict[str, Any], dict[str, Any]], None]


def greedy_rank(dist: Dist, device: str, job: dict[str, Any], res: dict[str, Any]) -> None:
    """job["tiny_dirs"] {name: model dir}: per tiny model, its greedy tokens
    (res["tiny_tokens"][name]) and whether decode ran from CUDA graphs (res["tiny_graphs"])."""
    for name, tiny_dir in (job.get("tiny_dirs") or {}).items():
        tiny = load_tiny(Path(tiny_dir), device, dist)
        res.setdefault("tiny_tokens", {})[name] = greedy_tokens(tiny)
        res.setdefault("tiny_graphs", {})[name] = tiny.runner.graphs is not None
        tiny.runner.kv_cache = None
        tiny.runner.graphs = None
        del tiny


def _rank_main(rank: int, world: int, port: int, rank_fn: RankFn, job: dict[str, Any],
               queue: Any) -> None:
    """One rank (a spawned process): joins the group, runs rank_fn, rank 0 reports."""
    import torch

    from shard.distributed.groups import init_distributed, shutdown_distributed

    if job.get("tuning_cache_dir"):  # the ranks share measured GEMV choices (tuning_cache)
        from shard.kernels.tuning_cache import TuningCache, configure

        configure(TuningCache(Path(job["tuning_cache_dir"])))
    cuda = job["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    device = f"cuda:{rank}" if cuda else "cpu"
    t0 = time.perf_counter()
    dist = init_distributed(rank, world, "127.0.0.1", port, torch.device(device),
                            all_reduce=job.get("all_reduce", "auto"))
    # The group join (NCCL, symmetric-memory rendezvous and the collectives' self-checks).
    res: dict[str, Any] = {"init_distributed_s": time.perf_counter() - t0}
    try:
        rank_fn(dist, device, job, res)
    except Exception as exc:  # noqa: BLE001 - report, do not hang the other rank silently
        traceback.print_exc()
        res["error"] = f"rank {rank}: {type(exc).__name__}: {exc}"
    if rank == 0:
        queue.put(res)
    shutdown_distributed()


def run_ranks(world: int, job: dict[str, Any], rank_fn: RankFn = greedy_rank,
              timeout_s: float = 900.0) -> dict[str, Any]:
    """Spawns `world` ranks running `rank_fn` on `job` (job["device"]: "cuda" or "cpu",
    job.get("all_reduce"): `tokenwire shard --all-reduce`, job.get("tuning_cache_dir"): the
    ranks' shared tuning cache, as `--tuning-cache-dir`); returns rank 0's results, or
    {"error": ...} when a rank died or none reported within timeout_s."""
    import torch.multiprocessing as mp

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast (shared hosts)
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    if job["device"] == "cpu":
        # CPU ranks fork from one forkserver that has imported torch and transformers once
        # (~5 CPU-seconds a process on the 2-core CI host): a spawned rank paid that import
        # itself, twice per call. The server runs no torch op before forking (no OpenMP pool to
        # inherit); it inherits the environment as it is when first started. CUDA jobs keep
        # "spawn", the start method the GPU runs were measured with.
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_FORKSERVER_PRELOAD)
    else:
        ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, rank_fn, job, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.time() + timeout_s
    res = None
    try:
        while res is None:
            try:
                res = queue.get(timeout=5.0)
            except queue_mod.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead or time.time() > deadline:
                    return {"error": f"ranks exited {dead} or timed out before reporting"}
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
    return res
