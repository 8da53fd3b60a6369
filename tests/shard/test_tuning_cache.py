"""The GEMV tuning cache (shard/kernels/tuning_cache.py) on CPU: round trip, a changed key or a
corrupt / foreign / stale file means tuning again (never a crash), concurrent writers never leave
a torn file, two processes meeting one missing key tune it once, and the decode-linear dispatcher
reads and writes through it (its measuring and kernel loading, which need a GPU, replaced at that
boundary; tests/gpu/test_decode_linear_cuda.py runs the real thing).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from shard.kernels.tuning_cache import TuningCache

REPO = Path(__file__).resolve().parents[2]
KEY = {"op": "test", "gpu": "NVIDIA H100 80GB HBM3", "rows": 4096, "k": 4096, "bias": False}


class Tuner:
    """A stand-in for a shape's measurement: counts its calls, returns a fresh value."""

    def __init__(self, value: dict[str, Any]) -> None:
        self.value, self.calls = value, 0

    def __call__(self) -> dict[str, Any]:
        self.calls += 1
        return dict(self.value)


def get(cache: TuningCache, key: dict[str, Any], tuner: Tuner) -> tuple[dict[str, Any], bool]:
    return cache.get_or_tune(key, tuner, lambda v: v, dict)


def test_round_trip_tunes_once_then_reads(tmp_path: Path) -> None:
    cache = TuningCache(tmp_path / "tuning")
    tuner = Tuner({"buckets": {"1": {"backend": "triton", "us": 3.25}}})
    assert get(cache, KEY, tuner) == (tuner.value, False)
    assert get(cache, KEY, tuner) == (tuner.value, True)
    # a new cache object on the same directory (another process, a later run)
    assert get(TuningCache(tmp_path / "tuning"), dict(KEY), tuner) == (tuner.value, True)
    assert tuner.calls == 1
    stored = json.loads(cache.path_of(KEY).read_text())
    assert stored["value"] == tuner.value and stored["key"]["gpu"] == KEY["gpu"]
    assert not list((tmp_path / "tuning").glob("*.tmp"))  # no temporary file left behind


@pytest.mark.parametrize("field,value", [("gpu", "NVIDIA H200"), ("rows", 2048), ("bias", True)])
def test_a_changed_key_field_is_tuned_again(tmp_path: Path, field: str, value: Any) -> None:
    cache = TuningCache(tmp_path)
    tuner = Tuner({"choice": "a"})
    get(cache, KEY, tuner)
    other = {**KEY, field: value}
    assert cache.path_of(other) != cache.path_of(KEY)
    assert get(cache, other, tuner) == ({"choice": "a"}, False)
    assert tuner.calls == 2


@pytest.mark.parametrize("text", ["", "{not json", "[1, 2]", '{"key": {}, "value": 3}'])
def test_a_corrupt_file_is_ignored_with_a_warning(tmp_path: Path, caplog, text: str) -> None:
    cache = TuningCache(tmp_path)
    cache.path_of(KEY).write_text(text)
    tuner = Tuner({"choice": "b"})
    with caplog.at_level(logging.WARNING, "shard.kernels.tuning_cache"):
        assert get(cache, KEY, tuner) == ({"choice": "b"}, False)
    assert "corrupt" in caplog.text
    assert get(cache, KEY, tuner) == ({"choice": "b"}, True)  # rewritten whole
    assert tuner.calls == 1


def test_a_file_holding_another_key_is_ignored(tmp_path: Path, caplog) -> None:
    """A file under this key's name whose stored key differs (copied from another machine, a
    hash collision) is never served."""
    cache = TuningCache(tmp_path)
    h200 = {**KEY, "gpu": "NVIDIA H200"}
    get(cache, h200, Tuner({"choice": "h200"}))
    cache.path_of(h200).rename(cache.path_of(KEY))
    tuner = Tuner({"choice": "h100"})
    with caplog.at_level(logging.WARNING, "shard.kernels.tuning_cache"):
        assert get(cache, KEY, tuner) == ({"choice": "h100"}, False)
    assert "another key" in caplog.text


def test_a_stale_value_that_does_not_decode_is_tuned_again(tmp_path: Path, caplog) -> None:
    cache = TuningCache(tmp_path)
    get(cache, KEY, Tuner({"config": "gone"}))

    def decode(raw: Any) -> dict[str, Any]:
        if raw["config"] == "gone":
            raise KeyError("no such candidate")
        return dict(raw)

    tuner = Tuner({"config": "current"})
    with caplog.at_level(logging.WARNING, "shard.kernels.tuning_cache"):
        assert cache.get_or_tune(KEY, tuner, lambda v: v, decode) == ({"config": "current"}, False)
    assert "no such candidate" in caplog.text
    assert cache.get_or_tune(KEY, tuner, lambda v: v, decode) == ({"config": "current"}, True)


def test_an_unusable_directory_warns_and_still_returns_the_tuned_value(tmp_path: Path,
                                                                       caplog) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    cache = TuningCache(blocker / "tuning")
    tuner = Tuner({"choice": "c"})
    with caplog.at_level(logging.WARNING, "shard.kernels.tuning_cache"):
        assert get(cache, KEY, tuner) == ({"choice": "c"}, False)
        assert get(cache, KEY, tuner) == ({"choice": "c"}, False)
    assert tuner.calls == 2 and "cannot" in caplog.text


# Processes import only the cache module (standard library at import): they start in well under
# a second, so the races below are real races, not start-up staggering.
_PROCESS = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    sys.path.insert(0, {repo!r})
    from shard.kernels.tuning_cache import TuningCache
    mode, directory, start, ident = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
    key = json.loads(sys.argv[5])
    cache = TuningCache(directory)
    while not start.exists():  # every process waits here, then all go at once
        time.sleep(0.002)
    if mode == "write":  # many full rewrites of one key with this writer's own value
        for i in range(150):
            cache.store(key, {{"writer": ident, "i": i, "pad": "x" * 20000}})
    else:  # "tune": one rank meeting a missing shape
        def tune():
            with open(directory / "tune_calls", "a") as f:
                f.write(ident + "\\n")
            time.sleep(0.5)  # a measurement takes a while: the other rank arrives meanwhile
            return {{"tuned_by": ident}}
        value, read = cache.get_or_tune(key, tune, lambda v: v, dict)
        print(json.dumps({{"value": value, "read": read}}))
""")


def _spawn(mode: str, directory: Path, start: Path, ident: str) -> subprocess.Popen:
    script = _PROCESS.format(repo=str(REPO))
    return subprocess.Popen([sys.executable, "-c", script, mode, str(directory), str(start), ident,
                             json.dumps(KEY)], stdout=subprocess.PIPE, text=True)


def test_concurrent_writers_never_leave_a_torn_file(tmp_path: Path) -> None:
    directory, start = tmp_path / "tuning", tmp_path / "start"
    cache = TuningCache(directory)
    cache.store(KEY, {"writer": "seed", "i": -1, "pad": ""})
    writers = [_spawn("write", directory, start, f"w{n}") for n in range(3)]
    start.touch()
    seen = set()
    while any(w.poll() is None for w in writers):
        value = cache.load(KEY)  # None would mean a torn or missing file
        assert value is not None and set(value) == {"writer", "i", "pad"}
        seen.add(value["writer"])
    assert [w.wait() for w in writers] == [0, 0, 0]
    final = cache.load(KEY)
    assert final is not None and final["i"] == 149
    assert len(seen) >= 2  # the reader did see rewrites happen
    assert not list(directory.glob("*.tmp"))


def test_two_ranks_meeting_a_missing_shape_tune_it_once(tmp_path: Path) -> None:
    """TP ranks reach the same shape at the same moment: one tunes, the other waits on the
    key's lock and reads the result."""
    directory, start = tmp_path / "tuning", tmp_path / "start"
    ranks = [_spawn("tune", directory, start, f"rank{r}") for r in range(2)]
    time.sleep(0.3)  # both started and waiting
    start.touch()
    outs = [json.loads(r.communicate(timeout=60)[0]) for r in ranks]
    assert [r.returncode for r in ranks] == [0, 0]
    calls = (directory / "tune_calls").read_text().split()
    assert len(calls) == 1
    assert outs[0]["value"] == outs[1]["value"] == {"tuned_by": calls[0]}
    assert sorted(o["read"] for o in outs) == [False, True]


# ------------------------------------------------------------------ the decode-linear dispatcher


@pytest.fixture
def dispatcher(tmp_path: Path, monkeypatch):
    """decode_linear with the process's cache on tmp_path/tuning, a fake device identity, and
    its GPU-only boundary (_measure: timing; _load_kernels: compiling) replaced by recorders."""
    pytest.importorskip("triton")
    import torch

    from shard.kernels import gemv, tuning_cache
    from shard.layers import decode_linear as dl

    calls: dict[str, list] = {"measure": [], "load": []}
    fma, dot = gemv.configs_for(1, torch.bfloat16), gemv.configs_for(2, torch.bfloat16)

    def measure(weight, dtype, bias, silu_mul):
        calls["measure"].append(tuple(weight.shape))
        return {b: dl.BucketChoice(dl.Backend.TRITON if b == 1 else dl.Backend.CUBLAS,
                                   fma[2] if b == 1 else dot[b % len(dot)], 1.5 * b, 2.0 * b)
                for b in gemv.M_BUCKETS}

    def load(weight, dtype, bias, silu_mul, record):
        calls["load"].append(record)

    gpu = {"gpu": "NVIDIA H100 80GB HBM3", "capability": "9.0", "sms": 132}
    monkeypatch.setattr(tuning_cache, "device_key", lambda device: dict(gpu))
    monkeypatch.setattr(dl, "_measure", measure)
    monkeypatch.setattr(dl, "_load_kernels", load)
    tuning_cache.configure(TuningCache(tmp_path / "tuning"))
    tuning_cache.reset_stats()
    yield dl, calls, gpu
    tuning_cache.configure(None)
    tuning_cache.reset_stats()


def test_the_dispatcher_reads_a_record_another_process_measured(dispatcher, tmp_path) -> None:
    import torch

    from shard.kernels import tuning_cache

    dl, calls, gpu = dispatcher
    weight = torch.zeros(96, 64, dtype=torch.bfloat16)  # [N, K]
    first = dl._cached_record(weight, torch.bfloat16, None, False)
    assert calls["measure"] == [(96, 64)] and calls["load"] == []
    assert len(list((tmp_path / "tuning").glob("*.json"))) == 1
    # What the next process (a peer rank, a later deployment) gets: no measuring, the same
    # choices, whose kernels are then loaded.
    again = dl._cached_record(weight, torch.bfloat16, None, False)
    assert calls["measure"] == [(96, 64)]
    assert again == first and calls["load"] == [first]
    assert (tuning_cache.stats().tuned, tuning_cache.stats().read) == (1, 1)
    # Another shape, epilogue or GPU model is measured afresh.
    dl._cached_record(weight, torch.bfloat16, None, True)
    gpu["gpu"] = "NVIDIA H200"
    dl._cached_record(weight, torch.bfloat16, None, False)
    assert calls["measure"] == [(96, 64)] * 3
    assert "3 shapes tuned, 1 read from the cache" in tuning_cache.stats().describe()


def test_the_dispatcher_retunes_a_record_whose_config_left_the_candidates(dispatcher,
                                                                          tmp_path) -> None:
    import torch

    dl, calls, _ = dispatcher
    weight = torch.zeros(96, 64, dtype=torch.bfloat16)
    dl._cached_record(weight, torch.bfloat16, None, False)
    path = next((tmp_path / "tuning").glob("*.json"))
    stored = json.loads(path.read_text())
    stored["value"]["buckets"]["1"]["config"]["kwargs"]["BLOCK_K"] = 12345
    path.write_text(json.dumps(stored))
    dl._cached_record(weight, torch.bfloat16, None, False)
    assert len(calls["measure"]) == 2 and calls["load"] == []


def test_bucket_configs_round_trip_and_reject_a_misplaced_config() -> None:
    pytest.importorskip("triton")
    import torch

    from shard.kernels import gemv

    for dtype in (torch.bfloat16, gemv.FP8_DTYPE):
        chosen = {b: gemv.configs_for(b, dtype)[-1] for b in gemv.M_BUCKETS}
        raw = json.loads(json.dumps({"buckets": {str(b): gemv.config_dict(c)
                                                 for b, c in chosen.items()}}))
        assert gemv.decode_bucket_configs(raw, dtype) == chosen
    cuda_core = gemv.config_dict(gemv.configs_for(1, torch.bfloat16)[0])  # batch 1 only
    raw["buckets"]["4"] = cuda_core
    with pytest.raises(Exception, match="not a candidate|no GEMV candidate"):
        gemv.decode_bucket_configs(raw, gemv.FP8_DTYPE)


def test_flags_name_the_cache_and_the_launcher_passes_it(tmp_path: Path, monkeypatch) -> None:
    from service.app import launcher
    from service.app.cli import build_parser
    from shard.server.main import tuning_cache_of

    monkeypatch.delenv("TOKENWIRE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    default = tuning_cache_of(None)
    assert default is not None
    assert default.directory == tmp_path / "xdg" / "tokenwire" / "gemv_tuning"
    assert tuning_cache_of("none") is None
    assert tuning_cache_of(str(tmp_path / "t")).directory == tmp_path / "t"
    argv = ["launch", "--tuning-cache-dir", str(tmp_path / "t")]
    cmd = launcher.shard_command(build_parser(argv).parse_args(argv), Path("/m"), 0, "/u", 1)
    assert cmd[cmd.index("--tuning-cache-dir") + 1] == str(tmp_path / "t")
