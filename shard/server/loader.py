"""Builds one rank's shard from its configuration: model directory, tokenizer, model, runner,
engine and the static Info."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from shard.attention import get_backend
from shard.distributed.groups import Dist
from shard.engine.batches import BatchState
from shard.errors import FailedPreconditionError
from shard.kernels import tuning_cache
from shard.lora import (
    AdapterFacts,
    AdapterSource,
    HostAdapter,
    LoraLimits,
    LoraManager,
    attach_lora,
    parse_adapters_flag,
)
from shard.models import LoadContext, load_model, parse_model_impl
from shard.quantization import (
    parse_kv_cache_dtype,
    parse_kv_cache_rotation,
    parse_quantize,
    with_quantize_config,
)
from shard.runner.model_runner import ModelRunner
from shard.runner.warmup import WarmupResult, WarmupSpec, run_warmup
from shard.runtime import KernelCompileWatch
from shard.tools.download import model_sha, resolve_model
from shard.tools.tokenizer_files import load_tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankInfo:
    """The static facts of one rank that Info reports (model, dtype, KV block size, ...)."""

    dtype: str
    device_type: str
    block_size: int
    max_position_embeddings: int
    eos_token_ids: list[int]
    model_type: str
    vocab_size: int
    world_size: int
    sliding_window: int | None
    attention_backend: str
    model_sha: str | None
    # "native" | "transformers": which code serves the model
    model_impl: str
    cuda_graphs: bool  # decode steps replay CUDA graphs (else eager)
    model_id: str
    max_loras: int = 0
    max_lora_rank: int = 0


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ShardConfig:
    model_id: str
    revision: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    cuda_memory_fraction: float = 0.9
    kv_cache_memory_mb: int | None = None
    max_batch_total_tokens: int | None = None
    attention_backend: str = "auto"
    # --model-impl: auto (native code where tokenwire has it, else the transformers backend) |
    # native | transformers (forced, e.g. to compare with the native path)
    model_impl: str = "auto"
    quantize: str | None = None  # --quantize: bitsandbytes | bitsandbytes-nf4 | fp8
    kv_cache_dtype: str = "auto"  # --kv-cache-dtype: auto | fp8_e4m3fn | fp8_e5m2
    kv_cache_rotation: str = "hadamard"  # --kv-cache-rotation: hadamard | none (fp8 caches)
    # LoRA: device slots (--max-loras; None: 4 with --lora-adapters, else 0 = off), the largest
    # rank (--max-lora-rank) and the adapters loaded at start-up (--lora-adapters).
    max_loras: int | None = None
    max_lora_rank: int = 16
    lora_adapters: str | None = None


def eos_token_ids(model_dir: Path, config: dict) -> set[int]:
    ids: set[int] = set()
    sources = [config]
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        sources.append(json.loads(gen.read_text()))
    for source in sources:
        value = source.get("eos_token_id")
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    return ids


class Shard:
    """One rank: engine + static facts. Methods run on the single model worker thread."""

    def __init__(self, cfg: ShardConfig, dist: Dist):
        self.cfg = cfg
        self.dist = dist
        self.device = torch.device(cfg.device)
        # Set by the serving process (CUDA): told when warm-up is over, so that a kernel variant
        # compiled after it is logged as the warm-up gap it is.
        self.compile_watch: KernelCompileWatch | None = None
        if cfg.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}")
        model_dir = resolve_model(cfg.model_id, cfg.revision)
        config = with_quantize_config(model_dir, json.loads((model_dir / "config.json").read_text()))
        attention = get_backend(cfg.attention_backend, self.device)
        ctx = LoadContext(
            model_dir, config, self.device, DTYPES[cfg.dtype], dist, attention,
            quantize=parse_quantize(cfg.quantize),
            kv_cache_dtype=parse_kv_cache_dtype(cfg.kv_cache_dtype),
            kv_cache_rotation=parse_kv_cache_rotation(cfg.kv_cache_rotation),
        )
        model = load_model(ctx, parse_model_impl(cfg.model_impl))
        self.runner = ModelRunner(model, attention, cfg.block_size, self.device)
        log.info("model_type %r served by %s code (attention %s), decode %s",
                 config.get("model_type", ""),
                 "the transformers backend's" if model.model_impl == "transformers" else "native",
                 model.attention_name,
                 "with CUDA graphs" if self.runner.uses_cuda_graphs else "eager")
        startup_adapters = parse_adapters_flag(cfg.lora_adapters)
        max_loras = cfg.max_loras
        if max_loras is None:
            max_loras = max(4, len(startup_adapters)) if startup_adapters else 0
        limits = LoraLimits(max_loras, cfg.max_lora_rank)
        self.lora: LoraManager | None = None
        if limits.max_loras > 0:
            if not model.supports_lora:
                raise ValueError(
                    f"--max-loras / --lora-adapters: model_type {config.get('model_type', '')!r} "
                    f"({model.model_impl}) has no tokenwire linears for adapters to target"
                )
            # The slots take their device memory now: warmup sizes the KV cache from what is left.
            self.lora = attach_lora(model, limits, self.device, DTYPES[cfg.dtype])  # type: ignore[arg-type]
            self.runner.lora = self.lora.batch
        eos = eos_token_ids(model_dir, config)
        tokenizer = load_tokenizer(model_dir)
        self.engine = BatchState(
            self.runner, tokenizer, eos, model.max_position_embeddings, lora=self.lora
        )
        for source in startup_adapters:
            self.register_adapter(self.read_adapter(source))
        self.info = RankInfo(
            dtype=cfg.dtype,
            device_type=self.device.type,
            block_size=cfg.block_size,
            max_position_embeddings=model.max_position_embeddings,
            eos_token_ids=sorted(eos),
            model_type=config.get("model_type", ""),
            vocab_size=model.vocab_size,
            world_size=dist.world_size,
            sliding_window=model.sliding_window,
            attention_backend=model.attention_name,
            model_sha=model_sha(model_dir),
            model_impl=model.model_impl,
            cuda_graphs=self.runner.uses_cuda_graphs,
            model_id=cfg.model_id,
            max_loras=limits.max_loras,
            max_lora_rank=limits.max_lora_rank if limits.max_loras else 0,
        )

    def warmup(self, spec: WarmupSpec) -> WarmupResult:
        self.engine.clear_cache(None)
        self.engine.grammars.prepare()
        result = run_warmup(
            self.runner,
            spec,
            self.dist,
            self.info.max_position_embeddings,
            self.cfg.cuda_memory_fraction,
            self.cfg.kv_cache_memory_mb,
            self.cfg.max_batch_total_tokens,
        )
        self.runner.model.take_expert_counts()  # warmup's routing is not served traffic
        if self.compile_watch is not None:
            self.compile_watch.serving()
        # So far in this process (the warm-up's eager prefill tunes every decode-linear shape).
        log.info("warmup: %s", tuning_cache.stats().describe())
        return result

    # ---- LoRA adapters ------------------------------------------------------------------------

    def _lora(self) -> LoraManager:
        if self.lora is None:
            raise FailedPreconditionError(
                "LoRA adapters are off on this shard: start it with --max-loras N (adapter slots "
                "are reserved before the KV cache is sized)"
            )
        return self.lora

    def read_adapter(self, source: AdapterSource) -> HostAdapter:
        """Reads and validates an adapter; any thread (file I/O off the model worker)."""
        return self._lora().read(source)

    def register_adapter(self, adapter: HostAdapter) -> AdapterFacts:
        """Makes a read adapter available to requests; model worker thread."""
        return self._lora().register(adapter)

    def unload_adapter(self, name: str) -> None:
        """Forgets an adapter no request on this rank uses; model worker thread."""
        self._lora().unregister(name, self.engine.adapters_in_use())

    def adapters(self) -> list[AdapterFacts]:
        return self.lora.facts() if self.lora is not None else []

    def bind_thread(self) -> None:
        """Makes this shard's GPU the calling thread's current device. CUDA's current device is
        per thread, and Triton kernels launch on it: on rank 1 (cuda:1) a worker thread left
        on cuda:0 fails every Triton launch. A no-op on CPU."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def health(self) -> None:
        """A tiny computation on the device; raises if the device is gone."""
        x = torch.ones(8, device=self.device)
        if float((x * 2).sum().item()) != 16.0:
            raise RuntimeError("device returned a wrong result")
