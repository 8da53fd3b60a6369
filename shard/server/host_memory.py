"""This process's host memory, for the start-up log: what a rank holds while it loads a model.

Why: a tensor-parallel rank must read only its slice of each weight, straight to its GPU; a
loader that kept a host copy of the checkpoint (per rank!) would need N x the model in RAM. The
anonymous resident set is that private memory; pages of the memory-mapped checkpoint files show
up as file-backed (or shmem, for files on a tmpfs) and are the page cache's, shared and
reclaimable. Linux /proc only; elsewhere nothing is reported.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

_FIELDS = {"VmHWM": "peak_rss", "RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem"}


@dataclass(frozen=True)
class HostMemory:
    """Bytes, as /proc/<pid>/status reports them."""

    peak_rss: int  # VmHWM: the largest resident set so far (all kinds)
    anon: int  # RssAnon: private memory (heap, host copies of tensors)
    file: int  # RssFile: mapped file pages (the checkpoint, shared libraries)
    shmem: int  # RssShmem: mapped tmpfs/shared pages (a checkpoint on /dev/shm)

    def describe(self) -> str:
        gib = 2**30
        return (f"host RSS anon {self.anon / gib:.2f} GiB, file {self.file / gib:.2f} GiB, "
                f"shmem {self.shmem / gib:.2f} GiB, peak RSS {self.peak_rss / gib:.2f} GiB")


def read_host_memory(pid: int | str = "self") -> HostMemory | None:
    """The memory of process `pid` (this one by default); None where /proc is missing."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    values = dict.fromkeys(_FIELDS.values(), 0)
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in _FIELDS:
            values[_FIELDS[key]] = int(rest.split()[0]) * 1024  # "123 kB"
    return HostMemory(**values)
