"""Issue 43: a Llama-3-70B-shaped model (random bf16) served with tensor parallelism on one host
(`python -m benchmarks.tp_scale`, called by benchmarks/run_tp4_70b_device.sh).

1. checkpoint: random bf16 weights written by one process per GPU (generated on its GPU, saved
   with safetensors in files of LAYERS_PER_FILE layers; the embedding and the LM head in files of
   their own), into a store directory, under a time budget: the model has as many layers as were
   written contiguously from layer 0. Model directories of fewer layers link the same files, so
   per-layer scaling costs no writing.
2. decode (`scale_rank`, one rank per GPU through shard.testing.ranks): per model, the shard's own
   loader (rank r on cuda:r), a first eager step (it tunes the decode GEMVs), decode CUDA graphs
   for the asked batches at a fixed context over random K/V, their replay time; each rank's load
   seconds, host memory while loading (anonymous RSS sampled every 0.1 s: a host copy of the
   weights would show here), graph-capture seconds, and the group join (NCCL + symmetric memory).
   Then the per-call costs of the reduction a decode step issues 2 x layers + 1 times at
   [batch, hidden] (the fused all-reduce + add + RMSNorm up to 16 rows, else the layers'
   all-reduce: one-shot symmetric memory up to 1 MiB, else NCCL), and of the logits' all-gather.
3. the per-GPU roofline of a decode step: the bytes this rank reads (its weights but the
   embedding table, plus its share of the K/V) over the measured copy bandwidth, plus those
   measured collective costs.
Works on CPU with gloo (`--fake`: a small model of the same structure; no graphs, eager
wall-clock steps), which is how the script is checked without a GPU.
"""

from __future__ import annotations

import gc
import json
import math
import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Self

from shard.testing.checkpoint import BOS_ID, EOS_ID, EOS_IDS, LLAMA3_8B, write_tokenizer

LLAMA3_70B = dict(LLAMA3_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                  num_attention_heads=64, num_key_value_heads=8)
# The --fake shape: Llama's structure (GQA, 4 KV heads split over 4 ranks), small enough for CPU.
FAKE_SHAPE = dict(LLAMA3_8B, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4)
LAYERS_PER_FILE = 4


@dataclass(frozen=True)
class CheckpointFile:
    """One safetensors file of the store: the embedding, the LM head (+ final norm), or
    `num_layers` decoder layers from `first_layer`."""

    name: str
    kind: str  # "embed" | "head" | "layers"
    first_layer: int = 0
    num_layers: int = 0


def checkpoint_files(num_layers: int, per_file: int = LAYERS_PER_FILE) -> list[CheckpointFile]:
    files = [CheckpointFile("embed.safetensors", "embed"), CheckpointFile("head.safetensors", "head")]
    for first in range(0, num_layers, per_file):
        n = min(per_file, num_layers - first)
        files.append(CheckpointFile(f"layers-{first:03d}-{first + n - 1:03d}.safetensors",
                                    "layers", first, n))
    return files


def _file_tensors(cfg: dict, f: CheckpointFile, gen: Any, device: str) -> dict[str, Any]:
    """The file's tensors on the host (bf16; generated on `device`)."""
    import torch

    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kvh = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = h // heads

    def rnd(*shape: int, std: float = 0.02) -> torch.Tensor:
        t = torch.empty(shape, dtype=torch.bfloat16, device=device)
        t.normal_(0.0, std, generator=gen)
        return t.cpu()

    if f.kind == "embed":
        return {"model.embed_tokens.weight": rnd(v, h)}
    if f.kind == "head":
        head = rnd(v, h)
        head[list(EOS_IDS)] = 0  # greedy never selects EOS: every request runs to its length
        return {"lm_head.weight": head, "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    out: dict[str, torch.Tensor] = {}
    for i in range(f.first_layer, f.first_layer + f.num_layers):
        p = f"model.layers.{i}."
        out.update({
            p + "self_attn.q_proj.weight": rnd(heads * hd, h),
            p + "self_attn.k_proj.weight": rnd(kvh * hd, h),
            p + "self_attn.v_proj.weight": rnd(kvh * hd, h),
            p + "self_attn.o_proj.weight": rnd(h, heads * hd),
            p + "mlp.gate_proj.weight": rnd(inter, h),
            p + "mlp.up_proj.weight": rnd(inter, h),
            p + "mlp.down_proj.weight": rnd(h, inter),
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        })
    return out


def _write_files(index: int, files: list[CheckpointFile], cfg: dict, store: str, device: str,
                 deadline: float, queue: Any) -> None:
    """One writer process: its files in order, each only if started before `deadline` (wall
    clock); reports (name, seconds or None when skipped, bytes, error)."""
    import torch
    from safetensors.torch import save_file

    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    gen = torch.Generator(device=device).manual_seed(1000 + index)
    for f in files:
        path = Path(store) / f.name
        if path.is_file():  # written by an earlier call on this machine
            queue.put((f.name, 0.0, path.stat().st_size, None))
            continue
        if time.time() > deadline:
            queue.put((f.name, None, 0, None))
            continue
        t0 = time.perf_counter()
        try:
            tensors = _file_tensors(cfg, f, gen, device)
            tmp = path.with_suffix(".tmp")
            save_file(tensors, str(tmp), metadata={"format": "pt"})
            tmp.rename(path)  # complete files only: a killed writer leaves no half file
            size = sum(t.numel() * t.element_size() for t in tensors.values())
            del tensors
            queue.put((f.name, time.perf_counter() - t0, size, None))
        except Exception as exc:  # noqa: BLE001 - reported; the layers written so far still serve
            queue.put((f.name, None, 0, f"{type(exc).__name__}: {exc}"))


def write_store(store: Path, cfg: dict, num_layers: int, devices: list[str],
                budget_s: float) -> dict[str, Any]:
    """Writes the checkpoint files of `num_layers` layers into `store` with one process per
    device (layer files round-robin, in layer order), starting no file after `budget_s`.
    Returns what was written, incl. `layers`: decoder layers complete from layer 0."""
    import torch.multiprocessing as mp

    store.mkdir(parents=True, exist_ok=True)
    files = checkpoint_files(num_layers)
    t0 = time.time()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    parts: list[list[CheckpointFile]] = [[] for _ in devices]
    for i, f in enumerate(files):
        parts[i % len(devices)].append(f)
    procs = [ctx.Process(target=_write_files, args=(i, part, cfg, str(store), dev,
                                                    t0 + budget_s, queue))
             for i, (part, dev) in enumerate(zip(parts, devices)) if part]
    for p in procs:
        p.start()
    done: dict[str, dict[str, Any]] = {}
    while len(done) < len(files):
        try:
            name, seconds, size, error = queue.get(timeout=30)
        except Exception:  # noqa: BLE001 - queue.Empty: a writer died?
            if all(p.exitcode is not None for p in procs):
                break
            continue
        done[name] = {"seconds": seconds, "bytes": size, "error": error}
    for p in procs:
        p.join(timeout=60)
    written = {n for n, d in done.items() if d["seconds"] is not None}
    layers = 0
    for f in files:
        if f.kind == "layers":
            if f.name not in written:
                break
            layers = f.first_layer + f.num_layers
    complete = {"embed.safetensors", "head.safetensors"} <= written
    return {"store": str(store), "seconds": time.time() - t0, "writers": len(procs),
            "layers": layers if complete else 0, "asked_layers": num_layers,
            "bytes": sum(d["bytes"] for d in done.values()),
            "errors": {n: d["error"] for n, d in done.items() if d["error"]}}


def model_dir(store: Path, workdir: Path, cfg: dict, layers: int) -> Path:
    """A model directory of the first `layers` layers: config, tokenizer, and links to the
    store's files that hold them."""
    out = workdir / f"llama3-70b-shape-{layers}l"
    out.mkdir(parents=True, exist_ok=True)
    for f in checkpoint_files(layers):
        link = out / f.name
        if not link.exists():
            link.symlink_to(store / f.name)
    heads = cfg["num_attention_heads"]
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False, "bos_token_id": BOS_ID, "eos_token_id": list(EOS_IDS),
        "initializer_range": 0.02, "head_dim": cfg["hidden_size"] // heads,
        **dict(cfg, num_hidden_layers=layers),
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": BOS_ID, "eos_token_id": list(EOS_IDS), "do_sample": False}))
    if not (out / "tokenizer.json").is_file():
        write_tokenizer(out, cfg["vocab_size"])
    assert EOS_ID in EOS_IDS
    return out


# ---- ranks ----------------------------------------------------------------------------------


class AnonPeak:
    """Samples this process's anonymous RSS every `interval_s` on a thread, keeping the peak."""

    def __init__(self, interval_s: float = 0.1):
        from shard.server.host_memory import read_host_memory

        self._read = read_host_memory
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            m = self._read()
            if m is not None:
                self.peak = max(self.peak, m.anon)
            self._stop.wait(self.interval_s)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        m = self._read()
        if m is not None:
            self.peak = max(self.peak, m.anon)


def _decode_timings(runner, batches: list[int], context: int, cuda: bool) -> dict[str, Any]:
    """Graph replay (CUDA) or eager wall (CPU) ms per decode step of each batch."""
    import torch

    from benchmarks.harness.timing import cuda_time_ms, decode_step, wall_time_ms

    bs = runner.block_size
    per = math.ceil(context / bs)
    out: dict[str, Any] = {"decode": []}
    if not cuda:
        for b in batches:
            step = decode_step(b, context, bs)
            runner.execute(step)
            t0 = time.perf_counter()
            runner.execute(step)
            out["decode"].append({"batch": b, "eager_wall_ms": (time.perf_counter() - t0) * 1e3})
        return out
    from shard.runner.cuda_graphs import CudaGraphDecodeRunner

    graphs = CudaGraphDecodeRunner(runner.forward, runner.device, bs, max(batches), per,
                                   buckets=sorted(batches))
    out["graph_capture_s"] = graphs.capture()
    for b in batches:
        step = decode_step(b, context, bs)

        def graph_step(step=step, graphs=graphs):
            return graphs.run(step.token_ids, step.positions, step.seq_lens, step.block_tables)

        wall = wall_time_ms(graph_step, iters=20)  # also fills the graph's inputs with `step`
        replay = cuda_time_ms(graphs.graphs[graphs.bucket(b)].replay, iters=20)
        out["decode"].append({"batch": b, "graph_replay_ms": replay, "graph_step_wall_ms": wall})
    del graphs
    gc.collect()
    torch.cuda.empty_cache()
    return out


def _measure_model(model_dir_: Path, job: dict, dist, device: str, init_s: float) -> dict:
    """One model on this rank: load, first eager step, decode timings; every rank's facts."""
    import torch
    import torch.distributed as tdist

    from benchmarks.harness.tp import prefill_logits_8b
    from shard.layers.weights import parameter_bytes
    from shard.server.host_memory import read_host_memory
    from shard.server.loader import Shard, ShardConfig

    cuda = device.startswith("cuda")
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    dist.barrier()
    t0 = time.perf_counter()
    with AnonPeak() as anon:
        shard = Shard(ShardConfig(model_id=str(model_dir_), dtype="bfloat16" if cuda else "float32",
                                  device=device), dist)
    load_s = time.perf_counter() - t0
    runner = shard.runner
    model = runner.model
    weight_bytes = parameter_bytes(model)
    embed_bytes = parameter_bytes(model.model.embed_tokens)
    batches, context = job["batches"], job["context"]
    per = math.ceil(context / runner.block_size)
    runner.allocate_kv_cache(max(batches) * per + 1)
    gen = torch.Generator(device=device).manual_seed(1 + dist.rank)
    for k, v in runner.kv_cache:  # random K/V: never time on zeros
        for cache in (k, v):
            cache.copy_(torch.randn(cache.shape, dtype=cache.dtype, device=device, generator=gen))
    t1 = time.perf_counter()
    logits = prefill_logits_8b(runner, length=64, keep=4)  # first eager step: tunes the GEMVs
    first_step_s = time.perf_counter() - t1
    timings = _decode_timings(runner, batches, context, cuda)
    host = read_host_memory()
    facts = {"rank": dist.rank, "device": device, "init_distributed_s": init_s, "load_s": load_s,
             "host_anon_peak_gib_while_loading": anon.peak / 2**30,
             "host_after_load": asdict(host) if host else None,
             "first_eager_step_s": first_step_s,
             "graph_capture_s": timings.get("graph_capture_s"),
             "weights_gib": weight_bytes / 2**30,
             "device_max_allocated_gib": (torch.cuda.max_memory_allocated(device) / 2**30
                                          if cuda else None)}
    every: list[Any] = [None] * dist.world_size
    if dist.world_size > 1:
        tdist.all_gather_object(every, facts)
    else:
        every = [facts]
    out = {"layers": json.loads((model_dir_ / "config.json").read_text())["num_hidden_layers"],
           "model_dir": str(model_dir_), "ranks": every, "logits_finite":
           bool(torch.isfinite(logits).all()), "weights_read_bytes": weight_bytes - embed_bytes,
           "kv_bytes_per_token": runner.kv_bytes_per_block() // runner.block_size,
           "context": context, **timings}
    runner.kv_cache = None
    runner.graphs = None
    del shard, runner, model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return out


def _gather_cost(dist, hidden_vocab: int, batches: list[int]) -> dict[int, float]:
    """In-graph microseconds of the logits' all-gather ([batch, vocab / world] bf16 per rank)."""
    import torch

    from benchmarks.harness.timing import cuda_time_ms

    out = {}
    for b in batches:
        x = torch.randn(b, hidden_vocab, dtype=torch.bfloat16, device="cuda")
        dist.all_gather_last_dim(x)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(8):
                dist.all_gather_last_dim(x)
        out[b] = cuda_time_ms(g.replay, iters=10, warmup=2) / 8 * 1e3
    return out


def scale_rank(dist, device: str, job: dict, res: dict) -> None:
    """One rank (shard.testing.ranks.run_ranks's rank_fn): on CUDA first the collectives' costs at
    job["hidden"] (a clean GPU, and a model that fails to fit cannot lose them), then
    job["models"] [[layers, dir], ...] in turn (a model that fails is recorded with its error
    and the next one still runs)."""
    import torch

    init_s = res.get("init_distributed_s", float("nan"))
    if device.startswith("cuda"):
        from benchmarks.harness.tp import _allreduce_cost, _fused_norm_cost

        hidden, batches = job["hidden"], job["batches"]
        res["allreduce"] = _allreduce_cost(dist, hidden, batches)
        small = [b for b in batches if b <= 16]
        res["fused_norm"] = (_fused_norm_cost(dist, hidden, small, sweep_warps=False)
                             if small and dist.fused_all_reduce_norm is not None else [])
        res["gather_us"] = _gather_cost(dist, math.ceil(job["vocab"] / dist.world_size), batches)
        gc.collect()
        torch.cuda.empty_cache()
    res["models"] = []
    for layers, path in job["models"]:
        try:
            m = _measure_model(Path(path), job, dist, device, init_s)
        except Exception as exc:  # noqa: BLE001 - recorded; the next model may still fit
            import traceback

            traceback.print_exc()
            res["models"].append({"layers": layers, "error": f"{type(exc).__name__}: {exc}"})
            gc.collect()
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
            continue
        res["models"].append(m)
        if dist.rank == 0:
            print(f"TP={dist.world_size} {m['layers']} layers: " + ", ".join(
                f"b={d['batch']} {step_ms(d):.2f} ms" for d in m["decode"])
                + f"; load {m['ranks'][0]['load_s']:.1f} s", flush=True)


# ---- analysis -------------------------------------------------------------------------------


def reduce_us(tp: dict, batch: int) -> float | None:
    """Per-call microseconds of the reduction a decode layer issues at `batch` rows: the fused
    all-reduce + add + RMSNorm where it serves the rows, else the layers' all-reduce."""
    for row in tp.get("fused_norm") or []:
        if row["batch"] == batch and row.get("fused_path"):
            return row["fused_in_graph_us"]
    for row in tp.get("allreduce") or []:
        if row["batch"] == batch:
            return row["in_graph_us"]
    return None


def roofline(tp: dict, model: dict, batch: int, copy_bytes_per_s: float) -> dict[str, float]:
    """Per-GPU decode roofline ms: this rank's bytes per step / copy bandwidth, plus the measured
    collectives ((2 x layers + 1) reductions and one all-gather per step)."""
    bytes_ = model["weights_read_bytes"] + batch * model["context"] * model["kv_bytes_per_token"]
    memory_ms = bytes_ / copy_bytes_per_s * 1e3
    per_call = reduce_us(tp, batch)
    gather = (tp.get("gather_us") or {}).get(batch) or (tp.get("gather_us") or {}).get(str(batch))
    comm_ms = ((2 * model["layers"] + 1) * per_call + (gather or 0.0)) / 1e3 \
        if per_call is not None else float("nan")
    return {"bytes_per_gpu": bytes_, "memory_ms": memory_ms, "comm_ms": comm_ms,
            "roofline_ms": memory_ms + comm_ms}


def fit_layers(points: list[tuple[int, float]]) -> tuple[float, float] | None:
    """Least-squares (fixed ms, ms per layer) of step time against layer count."""
    if len({x for x, _ in points}) < 2:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - slope * mx, slope


def step_ms(d: dict) -> float:
    return d.get("graph_replay_ms", d.get("eager_wall_ms", float("nan")))


def analyse(res: dict, target_layers: int) -> dict:
    """Rooflines, per-layer fits (extrapolated to target_layers) and the TP=4 / TP=2 speed-up."""
    bw = (res.get("ceilings") or {}).get("copy_bytes_per_s")
    out: dict[str, Any] = {"target_layers": target_layers, "tp": {}}
    fits: dict[int, dict[int, tuple[float, float]]] = {}
    for key in ("tp4", "tp2"):
        tp = res.get(key) or {}
        if not tp.get("models"):
            continue
        world = tp["num_shard"]
        rows = []
        by_batch: dict[int, list[tuple[int, float]]] = {}
        for m in tp["models"]:
            for d in m.get("decode", []):
                b = d["batch"]
                by_batch.setdefault(b, []).append((m["layers"], step_ms(d)))
                row = {"layers": m["layers"], "batch": b, "step_ms": step_ms(d)}
                if bw:
                    row.update(roofline(tp, m, b, bw))
                    row["pct_of_roofline"] = row["roofline_ms"] / row["step_ms"] * 100
                rows.append(row)
        fits[world] = {b: f for b, pts in by_batch.items() if (f := fit_layers(pts))}
        out["tp"][world] = {
            "rows": rows,
            "fits": {b: {"fixed_ms": f[0], "ms_per_layer": f[1],
                         f"extrapolated_{target_layers}_layers_ms": f[0] + f[1] * target_layers}
                     for b, f in fits[world].items()}}
    speedup: dict[str, Any] = {}
    t4 = {(m["layers"], d["batch"]): step_ms(d) for m in (res.get("tp4") or {}).get("models", [])
          for d in m.get("decode", [])}
    t2 = {(m["layers"], d["batch"]): step_ms(d) for m in (res.get("tp2") or {}).get("models", [])
          for d in m.get("decode", [])}
    for (layers, b), ms2 in sorted(t2.items()):
        if (layers, b) in t4:
            speedup[f"{layers} layers, batch {b}"] = ms2 / t4[(layers, b)]
    if 4 in fits and 2 in fits and 1 in fits[4] and 1 in fits[2]:
        f4, f2 = fits[4][1], fits[2][1]
        speedup[f"{target_layers} layers, batch 1 (fits)"] = \
            (f2[0] + f2[1] * target_layers) / (f4[0] + f4[1] * target_layers)
    out["speedup_tp4_over_tp2"] = speedup
    return out


# ---- host memory of the serving shards -------------------------------------------------------


class ShardMemorySampler:
    """Samples every `interval_s` the host memory of this host's `tokenwire shard` processes
    (their /proc status) and the host's used memory (MemTotal - MemAvailable); `summary(until)`
    gives the peaks up to a time (e.g. the end of start-up)."""

    def __init__(self, model_dir: Path, interval_s: float = 0.5):
        self.interval_s = interval_s
        # Only the shards serving this model (other deployments may share the host).
        self.model_arg = str(Path(model_dir).resolve()).encode()
        # (time, host used bytes, {pid: (anon, file, shmem)})
        self.samples: list[tuple[float, int, dict[int, tuple[int, int, int]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def shard_pids(self) -> list[int]:
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"service.app.cli" in cmd and b"shard" in cmd and self.model_arg in cmd:
                pids.append(int(entry))
        return pids

    @staticmethod
    def host_used() -> int:
        info = {}
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            info[key] = int(rest.split()[0]) * 1024
        return info.get("MemTotal", 0) - info.get("MemAvailable", 0)

    def _run(self) -> None:
        from shard.server.host_memory import read_host_memory

        while not self._stop.is_set():
            per: dict[int, tuple[int, int, int]] = {}
            for pid in self.shard_pids():
                m = read_host_memory(pid)
                if m is not None:
                    per[pid] = (m.anon, m.file, m.shmem)
            self.samples.append((time.time(), self.host_used(), per))
            self._stop.wait(self.interval_s)

    def start(self) -> Self:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self, until: float | None = None) -> dict[str, Any]:
        s = [x for x in self.samples if until is None or x[0] <= until]
        gib = 2**30
        peaks: dict[int, list[int]] = {}
        for _, _, per in s:
            for pid, values in per.items():
                p = peaks.setdefault(pid, [0, 0, 0])
                for i, v in enumerate(values):
                    p[i] = max(p[i], v)
        return {"samples": len(s),
                "shards_anon_sum_peak_gib": max((sum(v[0] for v in per.values())
                                                 for _, _, per in s), default=0) / gib,
                "host_used_peak_gib": max((x[1] for x in s), default=0) / gib,
                "host_used_first_gib": (s[0][1] / gib) if s else None,
                "per_shard_peak_gib": {str(pid): {"anon": p[0] / gib, "file": p[1] / gib,
                                                  "shmem": p[2] / gib}
                                       for pid, p in sorted(peaks.items())}}
