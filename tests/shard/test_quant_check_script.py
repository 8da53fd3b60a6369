"""benchmarks/quant_check.py's main path at a tiny shape on CPU: the report's fields and values,
and the depth-scaled init (a broken benchmark would otherwise show up only on the device)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("q", "k", "v", "o", "gate", "up", "down")


@pytest.fixture(scope="module")
def quant_check():
    spec = importlib.util.spec_from_file_location(
        "quant_check_script", ROOT / "benchmarks" / "quant_check.py"
    )
    module = importlib.util.module_from_spec(spec)
    # dataclasses resolve the script's string annotations through sys.modules.
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def cpu_methods() -> list[str]:
    """fp8 runs everywhere (dequantized or torch._scaled_mm on CPU); bitsandbytes only where it
    is installed (the script reports the others as skipped)."""
    methods = ["bf16", "fp8"]
    if importlib.util.find_spec("bitsandbytes") is not None:
        methods += ["bitsandbytes", "bitsandbytes-nf4"]
    return methods


def finite_nonneg(x) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x >= 0


def check_summary(summary: dict, layers: list[int]) -> None:
    assert finite_nonneg(summary["median"]) and finite_nonneg(summary["max"])
    assert summary["median"] <= summary["max"]
    assert set(summary["by_kind"]) == set(KINDS)
    for kind in KINDS:
        entry = summary["by_kind"][kind]
        assert set(entry["layers"]) == {str(li) for li in layers}
        assert all(finite_nonneg(e) for e in entry["layers"].values())
        assert entry["median"] <= entry["max"] <= summary["max"]


@pytest.mark.parametrize("fp8_path", ["auto", "w8a8"])
def test_report_fields_and_values(quant_check, tmp_path, fp8_path):
    out = tmp_path / "q.json"
    methods = cpu_methods()
    report = quant_check.main(
        [
            "--device=cpu",
            "--shape=tiny",
            "--layers=2",
            "--prompt-batch=2",
            "--prompt-len=8",
            f"--methods={','.join(methods)}",
            f"--fp8-path={fp8_path}",
            f"--out={out}",
        ]
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    # The old keys stay.
    for key in ("device", "torch", "shape", "prompt", "context", "results", "bf16_step_bytes"):
        assert key in report
    assert report["shape"]["hidden"] == 64 and report["shape"]["layers"] == 2
    assert report["init"] == "hf" and report["sample_layers"] == [0, 1]
    assert report["methods"] == methods

    # The tolerance floor: nonzero (bf16 does round) but small at this depth.
    assert 0 < report["bf16_vs_fp32_rel_err"] < 0.05
    assert 0 <= report["bf16_vs_fp32_top1_agree"] <= 1
    check_summary(report["bf16_vs_fp32_per_linear"], [0, 1])
    assert 0 < report["bf16_vs_fp32_per_linear"]["median"] < 0.01  # bf16 output rounding

    results = report["results"]
    assert set(results) == set(methods)
    base = results["bf16"]
    assert base["weight_bytes"] > 0
    # bf16 vs itself: exactly 0, logits and every linear.
    assert base["rel_logit_err"] == 0.0 and base["top1_agree"] == 1.0
    check_summary(base["per_linear"], [0, 1])
    assert base["per_linear"]["max"] == 0.0
    assert base["rel_logit_err_vs_fp32"] == report["bf16_vs_fp32_rel_err"]

    for value in methods[1:]:
        entry = results[value]
        assert "error" not in entry and "skipped" not in entry, entry
        for key in ("rel_logit_err", "rel_logit_err_vs_fp32", "top1_agree", "amplification"):
            assert finite_nonneg(entry[key]), (value, key)
        assert entry["rel_logit_err"] > 0  # quantization does change the logits
        assert 0 <= entry["top1_agree"] <= 1
        assert entry["memory_reduction"] > 1.5
        check_summary(entry["per_linear"], [0, 1])
        check_summary(entry["per_linear_vs_fp32"], [0, 1])
        assert 0 < entry["per_linear"]["median"] < 0.2
    fp8 = results["fp8"]
    assert ("_scaled_mm" in fp8["path"]) == (fp8_path == "w8a8")


def test_depth_scaled_init_scales_only_o_and_down(quant_check, tmp_path):
    shape = quant_check.SHAPES["tiny"]
    std = 0.02
    hf = quant_check.init_stds(shape, "hf", std)
    ds = quant_check.init_stds(shape, "depth-scaled", std)
    scale = 1 / math.sqrt(2 * shape.layers)
    assert hf == dict.fromkeys(KINDS, std)
    assert ds == {k: std * scale if k in ("o", "down") else std for k in KINDS}

    cpu = torch.device("cpu")
    layers_hf, embed_hf, head_hf = quant_check.make_float_weights(shape, cpu, 0, std, "hf")
    layers_ds, embed_ds, head_ds = quant_check.make_float_weights(
        shape, cpu, 0, std, "depth-scaled"
    )
    assert torch.equal(embed_hf, embed_ds) and torch.equal(head_hf, head_ds)
    for lh, ld in zip(layers_hf, layers_ds, strict=True):
        for kind in KINDS:
            if kind in ("o", "down"):
                # Same draws, scaled: equal up to bf16 rounding of each side.
                torch.testing.assert_close(
                    ld[kind].float(), lh[kind].float() * scale, rtol=2**-7, atol=0
                )
                assert ld[kind].float().std().item() == pytest.approx(std * scale, rel=0.05)
            else:
                assert torch.equal(lh[kind], ld[kind])

    # And the report says which init ran.
    report = quant_check.main(
        [
            "--device=cpu",
            "--shape=tiny",
            "--init=depth-scaled",
            "--methods=bf16",
            "--prompt-batch=1",
            "--prompt-len=4",
            f"--out={tmp_path / 'q.json'}",
        ]
    )
    assert report["init"] == "depth-scaled" and report["init_stds"] == ds
    assert set(report["results"]) == {"bf16"}
