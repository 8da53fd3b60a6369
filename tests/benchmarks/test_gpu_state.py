"""benchmarks/harness/timing.gpu_state: nvidia-smi's answer parsed into named fields, and {}
where nvidia-smi is missing or fails (the benchmark goes on without it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.harness.timing import gpu_state


def _fake_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> None:
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\n{body}\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}")


def test_fields_are_named_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_smi(tmp_path, monkeypatch, 'echo "1980, 3201, 47, 512.31, 0x0000000000000004"')
    assert gpu_state() == {"clocks.sm": "1980", "clocks.mem": "3201", "temperature.gpu": "47",
                           "power.draw": "512.31",
                           "clocks_throttle_reasons.active": "0x0000000000000004"}


def test_no_answer_is_empty(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_smi(tmp_path, monkeypatch, "exit 9")
    assert gpu_state() == {}
    _fake_smi(tmp_path, monkeypatch, 'echo "1980, 3201"')  # fields missing: not guessed
    assert gpu_state() == {}
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    assert gpu_state() == {}
