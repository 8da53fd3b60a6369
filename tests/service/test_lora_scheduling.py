"""LoRA adapters in the router's plain-Python layers: the scheduler admits requests of at most
max_adapters distinct adapters at once (the shards' device slots), prefix-cache blocks never
cross adapters (or loads of one), and the adapter registry's rules."""

from __future__ import annotations

import pytest
from tests.service._sched_helpers import fake_output, make_seq

from service.engine.adapters import (
    AdapterExistsError,
    AdapterInfo,
    AdapterNotFoundError,
    AdapterRegistry,
    AdaptersDisabledError,
    AdapterSource,
)
from service.scheduler import BlockManager, Scheduler, SchedulerConfig


def _scheduler(max_adapters: int, num_blocks: int = 64) -> Scheduler:
    cfg = SchedulerConfig(max_batch_prefill_tokens=64, max_batch_size=16,
                          waiting_served_ratio=0.0, max_adapters=max_adapters)
    return Scheduler(cfg, BlockManager(num_blocks, 4))


def _seq(seq_id: int, adapter: str, prompt: list[int] | None = None):
    seq = make_seq(seq_id, prompt or [1, 2, 3, 4, 5])
    seq.adapter = adapter
    seq.cache_salt = f"lora:1:{adapter}".encode() if adapter else b""
    return seq


def test_at_most_max_adapters_distinct_adapters_run_at_once() -> None:
    sched = _scheduler(max_adapters=2)
    for i, adapter in enumerate(["a", "b", "a", "c", ""], start=1):
        sched.add(_seq(i, adapter))
    plan = sched.schedule()
    # a, b, a admitted; c needs a third slot: it waits, and (first come, first served) so does
    # the base request behind it.
    assert [c.seq_id for c in plan.chunks] == [1, 2, 3]
    sched.apply_output(plan, fake_output(sched, plan, finish_after={2: 1}))
    plan = sched.schedule()  # b finished: c takes its slot, the base request follows
    assert [c.seq_id for c in plan.chunks] == [4, 5]
    assert {sched.seqs[i].adapter for i in plan.decode_ids} == {"a"}


def test_prefix_cache_blocks_do_not_cross_adapters() -> None:
    bm = BlockManager(32, 4)
    prompt = list(range(1, 14))  # 3 full blocks + 1
    blocks = bm.allocate(4)
    assert blocks is not None
    keys: list[bytes] = []
    bm.register_full_blocks(prompt, blocks, keys, 12, b"lora:1:a")
    assert bm.match_prefix(prompt, b"lora:1:a")[0] == blocks[:3]
    assert bm.match_prefix(prompt)[0] == []  # the base model
    assert bm.match_prefix(prompt, b"lora:1:b")[0] == []  # another adapter
    assert bm.match_prefix(prompt, b"lora:2:a")[0] == []  # a later load of the same name


def test_registry_rules() -> None:
    reg = AdapterRegistry(max_loras=2, max_lora_rank=8, base_model_id="base")
    info = AdapterInfo("a", "/x", 4, 8.0, ("q_proj",))
    reg.add(info)
    with pytest.raises(AdapterExistsError):
        reg.check_new(AdapterSource("a", "/y"))
    salt = reg.cache_salt("a")
    reg.begin_unload("a")  # new requests: not found, while in-flight ones finish
    with pytest.raises(AdapterNotFoundError, match="adapter 'a' is not loaded"):
        reg.cache_salt("a")
    assert reg.names() == []
    reg.remove("a")
    reg.add(info)
    assert reg.cache_salt("a") != salt  # a new load never shares cached K/V with the old one
    with pytest.raises(AdapterNotFoundError, match=r"loaded adapters: 'a'"):
        reg.cache_salt("zzz")
    off = AdapterRegistry(max_loras=0, max_lora_rank=0)
    with pytest.raises(AdaptersDisabledError, match="--max-loras"):
        off.check_new(AdapterSource("a", "/x"))
