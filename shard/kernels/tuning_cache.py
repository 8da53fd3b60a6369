"""A persistent cache of kernel tuning results, shared by the ranks of a deployment and by later
deployments (the decode-linear dispatcher's GEMV-vs-cuBLAS records, shard/layers/decode_linear.py;
the fp8 GEMV's tuned configs, shard/kernels/gemv.py).

Why: tuning a GEMV shape compiles and times every candidate config, batch 1 back to back in CUDA
graphs: seconds per shape on a warm Triton cache, ~20 s on a cold one (a 0.3 MiB model's warm-up
took 86 s, benchmarks/MULTI_GPU.md). Every rank of every deployment paid it again, for the same
answer: the answer depends only on what the key below holds.

Layout: one JSON file per key in `directory`, named by the SHA-256 of the key's canonical JSON, and
holding the key itself next to the value. A file is written whole to a temporary file in the same
directory and renamed over the name (atomic on POSIX), so a reader sees the old file, the new one
or none, never half of one; two writers of one key both write a full answer and the last rename
wins. A file that cannot be read, parsed or decoded, or whose stored key is not the key asked for
(a hash collision, a file copied from elsewhere), is ignored with a warning and retuned: a cache
is never a reason to fail.

Sharing: `get_or_tune` reads first; on a miss it takes an exclusive lock on the key's `.lock`
file (fcntl.flock: released by the kernel if the holder dies), reads again (a peer may have tuned
it meanwhile), and only then tunes and writes. So the TP ranks of one deployment, which meet the
same shapes at the same time, tune each shape once: the first to arrive tunes, the others wait
for its file and read it (the wait costs them nothing: they would have spent as long tuning).
Tuning never waits on a collective, so a lock holder always finishes. A lock not granted within
`lock_timeout_s` (a hung peer) is given up with a warning and the shape tuned anyway.

Nothing here is configured at import: the shard's start-up (`--tuning-cache-dir`) or a test calls
`configure`; with none configured every shape is tuned in-process, as before. Standard library
only at import (torch inside device_key, no Triton): the dispatcher imports it on CPU.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

T = TypeVar("T")
# A key's values: JSON scalars only, so that its canonical JSON (and so its file name) is stable.
Key = Mapping[str, str | int | float | bool | None]

# Bump when the file layout changes (old files are then foreign and retuned).
FORMAT = 1


@dataclass(frozen=True)
class TuningStats:
    """What this process's tuning cost so far (the start-up log's line)."""

    tuned: int = 0  # shapes measured here
    read: int = 0  # shapes read from the cache (written by a peer rank or an earlier run)
    seconds: float = 0.0  # wall time of both, kernel loading included
    directory: Path | None = None  # the cache in use, None: off

    def describe(self) -> str:
        where = f"cache {self.directory}" if self.directory is not None else "no tuning cache"
        return (f"kernel tuning: {self.tuned} shapes tuned, {self.read} read from the cache in "
                f"{self.seconds:.1f} s ({where})")


@dataclass(frozen=True)
class TuningCache:
    """A directory of tuning results; see the module docstring."""

    directory: Path
    lock_timeout_s: float = 600.0

    def path_of(self, key: Key) -> Path:
        return self.directory / f"{_digest(key)}.json"

    def load(self, key: Key) -> dict[str, Any] | None:
        """The stored value of `key`, or None (missing; unreadable or foreign: warned)."""
        path = self.path_of(key)
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("tuning cache: cannot read %s (%s); tuning again", path, exc)
            return None
        try:
            stored = json.loads(text)
            if not isinstance(stored, dict) or not isinstance(stored.get("value"), dict):
                raise TypeError("not a {key, value} object")
        except (ValueError, TypeError) as exc:
            log.warning("tuning cache: ignoring corrupt %s (%s); tuning again", path, exc)
            return None
        if stored.get("key") != _canonical(key):
            log.warning("tuning cache: ignoring %s: it holds another key; tuning again", path)
            return None
        return stored["value"]

    def store(self, key: Key, value: Mapping[str, Any]) -> None:
        """Writes `value` for `key` atomically (temporary file + rename); a failure to write
        (read-only or full disk) is warned about, never raised: the tuned value is still used."""
        path = self.path_of(key)
        text = json.dumps({"key": _canonical(key), "value": value}, indent=1, sort_keys=True)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{path.stem}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(text)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as exc:
            log.warning("tuning cache: cannot write %s (%s); the result is used but not kept",
                        path, exc)

    @contextlib.contextmanager
    def locked(self, key: Key) -> Iterator[bool]:
        """Holds the key's exclusive lock for the block; yields whether it got it (False: the
        directory is not writable, or lock_timeout_s passed: the caller tunes unlocked)."""
        lock_path = self.directory / f"{_digest(key)}.lock"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            log.warning("tuning cache: cannot lock %s (%s); tuning unlocked", lock_path, exc)
            yield False
            return
        try:
            deadline = time.monotonic() + self.lock_timeout_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    got = True
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        log.warning("tuning cache: %s still locked after %.0f s (a hung peer?); "
                                    "tuning without it", lock_path, self.lock_timeout_s)
                        got = False
                        break
                    time.sleep(0.05)
            yield got
        finally:
            os.close(fd)  # releases the lock

    def get_or_tune(
        self,
        key: Key,
        tune: Callable[[], T],
        encode: Callable[[T], Mapping[str, Any]],
        decode: Callable[[Mapping[str, Any]], T],
    ) -> tuple[T, bool]:
        """(value, whether it was read from the cache): the stored value of `key` if there is a
        valid one, else tune() under the key's lock (unless a peer stored it while this process
        waited), stored for the next reader. `decode` raises (any Exception) on a value that no
        longer fits (e.g. a config that is not a candidate any more): then the key is retuned."""
        value = self._decoded(key, decode)
        if value is not None:
            return value, True
        with self.locked(key):
            value = self._decoded(key, decode)
            if value is not None:
                return value, True
            value = tune()
            self.store(key, encode(value))
        return value, False

    def _decoded(self, key: Key, decode: Callable[[Mapping[str, Any]], T]) -> T | None:
        raw = self.load(key)
        if raw is None:
            return None
        try:
            return decode(raw)
        except Exception as exc:  # noqa: BLE001 - any stale or foreign value: tune again
            log.warning("tuning cache: ignoring %s (%s: %s); tuning again", self.path_of(key),
                        type(exc).__name__, exc)
            return None


# ----------------------------------------------------------------- the process's cache and stats


@dataclass
class _State:
    cache: TuningCache | None = None
    stats: TuningStats = field(default_factory=TuningStats)
    lock: threading.Lock = field(default_factory=threading.Lock)


_STATE = _State()


def configure(cache: TuningCache | None) -> None:
    """Sets the cache this process's tuning reads and writes (None: off, tune in-process)."""
    with _STATE.lock:
        _STATE.cache = cache
        _STATE.stats = replace(_STATE.stats, directory=None if cache is None else cache.directory)


def active() -> TuningCache | None:
    return _STATE.cache


def stats() -> TuningStats:
    return _STATE.stats


def reset_stats() -> None:
    with _STATE.lock:
        _STATE.stats = TuningStats(directory=_STATE.stats.directory)


def cached_tuning(
    key: Key,
    tune: Callable[[], T],
    encode: Callable[[T], Mapping[str, Any]],
    decode: Callable[[Mapping[str, Any]], T],
) -> T:
    """tune(), or its stored result through the configured cache; counted in stats()."""
    cache = _STATE.cache
    t0 = time.perf_counter()
    if cache is None:
        value, read = tune(), False
    else:
        value, read = cache.get_or_tune(key, tune, encode, decode)
    seconds = time.perf_counter() - t0
    with _STATE.lock:
        s = _STATE.stats
        _STATE.stats = replace(s, tuned=s.tuned + (not read), read=s.read + read,
                               seconds=s.seconds + seconds)
    return value


def device_key(device: torch.device) -> dict[str, str | int]:
    """What a timing on `device` depends on besides the shape: the GPU model (name, compute
    capability, SM count), and the torch, CUDA and Triton builds (compiler and cuBLAS)."""
    import torch

    props = torch.cuda.get_device_properties(device)
    try:
        triton_version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton_version = "none"
    return {"gpu": props.name, "capability": f"{props.major}.{props.minor}",
            "sms": props.multi_processor_count, "torch": torch.__version__,
            "cuda": str(torch.version.cuda), "triton": triton_version}


def default_directory(cache_root: Path) -> Path:
    """The cache's place under tokenwire's cache directory (shard.tools.cache.cache_dir())."""
    return cache_root / "gemv_tuning"


def _canonical(key: Key) -> dict[str, Any]:
    # Through JSON and back: what the file holds compares equal to what a reader asks for.
    return json.loads(json.dumps({"format": FORMAT, **key}, sort_keys=True))


def _digest(key: Key) -> str:
    return hashlib.sha256(json.dumps(_canonical(key), sort_keys=True).encode()).hexdigest()[:32]
