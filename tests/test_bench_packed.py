"""benchmarks/bench_packed.py (issue 27's packed-sequence benchmark) on CPU: its layouts, FLOP
count and ratios, and a tiny end-to-end run with the jax_fa3 calls on the portable path (the
timings mean nothing here; the layout mapping, the cross-check and the report do)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_packed  # noqa: E402


def _args(**kw):
    base = dict(tokens=16384, mixed_median=512.0, mixed_sigma=1.5, mixed_min=16, mixed_max=8192,
                seed=0)
    return argparse.Namespace(**{**base, **kw})


def test_layouts_fill_the_row_and_map_tokens_both_ways():
    assert bench_packed.layout_lengths("8x2k", _args()) == [2048] * 8
    assert bench_packed.layout_lengths("32x512", _args()) == [512] * 32
    with pytest.raises(SystemExit):
        bench_packed.layout_lengths("4x2k", _args())
    mixed = bench_packed.layout_lengths("mixed", _args())
    assert sum(mixed) == 16384 and max(mixed) <= 8192 and min(mixed[:-1]) >= 16
    assert len(set(mixed)) > 3 and mixed == bench_packed.layout_lengths("mixed", _args())
    assert mixed != bench_packed.layout_lengths("mixed", _args(seed=1))

    lay = bench_packed.Layout("m", [3, 1, 4])
    assert lay.segment_ids.tolist() == [1, 1, 1, 2, 3, 3, 3, 3] and lay.cu.tolist() == [0, 3, 4, 8]
    assert lay.valid.tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]]
    x = jnp.arange(8 * 2, dtype=jnp.float32).reshape(8, 2) + 1
    padded = lay.pad(x)
    assert padded.shape == (3, 4, 2) and float(padded[1, 1:].sum()) == 0  # zeros after a document
    assert padded[2, 3].tolist() == x[7].tolist()
    np.testing.assert_array_equal(lay.unpad(padded), x)
    equal = bench_packed.Layout("e", [2, 2])
    np.testing.assert_array_equal(equal.unpad(equal.pad(x[:4])), x[:4])


def test_ratios_and_done_when():
    lay = bench_packed.Layout("8x2k", [4, 4])
    assert bench_packed.useful_pairs(lay, causal=False) == 32
    assert bench_packed.useful_pairs(lay, causal=True) == 20

    def rec(impl, ms, **kw):
        return dict(impl=impl, layout="8x2k", head_dim=128, direction="fwd", causal=True, ms=ms,
                    tflops=1.0 / ms, ms_rounds=[ms, ms * 1.02], **kw)
    records = [rec("packed", 1.0), rec("dense", 0.95), rec("fa3_varlen", 1.2),
               rec("cudnn_mask", 2.0, suspect=True),
               dict(impl="cudnn_seqlens", layout="8x2k", head_dim=128, direction="fwd",
                    causal=True, unsupported="RuntimeError: no")]
    at = {r["impl"]: r for r in records}
    # a suspect time is no figure
    assert bench_packed.ratios(at) == dict(packed_over_dense_time=1.053, speedup_vs_fa3_varlen=1.2,
                                           speedup_vs_cudnn_mask=None)
    checks = {c["check"]: c for c in bench_packed.done_when(records)}
    assert checks["packed / dense time <= 1.1"]["passed"] is True
    assert checks["packed vs fa3_varlen >= 1.05x"]["passed"] is True
    assert checks["packed vs cudnn_mask >= 3x"]["passed"] is None
    table = bench_packed.markdown(records, [lay.summary()], "# t")
    # columns in IMPLS order; ratios: packed/dense time, speed over fa3_varlen and cudnn_mask
    assert ("| 8x2k | 2 | 1.0 (1.000) | 1.1 (0.950) | 0.8 (1.200) | 0.5 (2.000) (wrong result) "
            "| n/a | 1.05 | 1.20x | - |") in table
    assert "cudnn_seqlens (1 points, e.g. hd128 fwd c1 8x2k): RuntimeError: no" in table
    assert "largest 2.0%" in table


def test_smoke_run_on_the_portable_path(tmp_path):
    """End to end at a tiny size: packed and the padded dense batch agree (fwd out, bwd dq),
    peers that cannot run here are recorded with their reason (about 20 s, mostly compiles)."""
    rc = bench_packed.main(
        ["--out", str(tmp_path), "--tokens", "128", "--hidden", "64", "--head-dims", "32",
         "--layouts", "mixed", "--mixed-median", "24", "--mixed-max", "64", "--causal", "1",
         "--impls", "packed", "dense", "fa3_varlen", "cudnn_mask", "--implementation", "xla",
         "--target-ms", "1", "--repeats", "2", "--tag", "smoke"])
    assert rc == 0
    (path,) = tmp_path.glob("*-packed-smoke.json")
    report = json.loads(path.read_text())
    recs = {(r["impl"], r["direction"]): r for r in report["records"]}
    for direction in ("fwd", "bwd"):
        assert recs["packed", direction]["ms"] > 0
        dense = recs["dense", direction]
        assert not dense.get("suspect") and dense["rel_err_vs_packed"] < 1e-2
        assert len(dense["ms_rounds"]) == 2
        assert "head dim 128" in recs["fa3_varlen", direction]["unsupported"]
        assert recs["cudnn_mask", direction]["unsupported"]  # no cuDNN on CPU: a reason, no figure
    assert report["layouts"][0]["tokens"] == 128 and report["layouts"][0]["documents"] > 1
    assert {r["direction"] for r in report["ratios"]} == {"fwd", "bwd"}
    md = path.with_suffix(".md").read_text()
    assert "## hd32 fwd causal" in md and "## hd32 bwd causal" in md and "Not run" in md


def test_wrong_and_nonfinite_results_are_flagged(monkeypatch):
    """Stand-ins (cheap elementwise functions) replace the implementations: a wrong or NaN
    result is flagged and never the yardstick; results go back to packed order before the
    comparison (the padded dense batch included). The backward: dq of the pullback, with the
    output cotangent mapped into each layout like q."""
    real_build = bench_packed.build

    def build(impl, layout, causal, head_dim, args):
        _, extras, to_layout, from_layout = real_build(impl, layout, causal, head_dim, args)
        scale = {"varlen": 1.5, "dense": 1.0, "packed": 1.0, "cudnn_seqlens": jnp.nan}[impl]
        return (lambda q, k, v, e: q * k * v * scale), extras, to_layout, from_layout
    monkeypatch.setattr(bench_packed, "build", build)
    args = argparse.Namespace(impls=["cudnn_seqlens", "dense", "varlen", "packed"],
                              implementation="xla", target_ms=0.5, repeats=2, max_rel_err=0.02)
    lay = bench_packed.Layout("mixed", [5, 2, 9])
    data = [jax.random.normal(jax.random.key(i), (16, 2, 8), jnp.float32) for i in range(4)]
    point = dict(layout="mixed", head_dim=8, heads=2, causal=True, direction="bwd")
    recs = {r["impl"]: r for r in bench_packed.time_point(args, point, lay, data[:3], data[3])}
    assert recs["cudnn_seqlens"]["suspect"] and recs["cudnn_seqlens"]["nonfinite"] > 0
    assert "rel_err_vs_cudnn_seqlens" not in recs["dense"]  # packed is the reference
    assert not recs["dense"].get("suspect") and recs["dense"]["rel_err_vs_packed"] < 1e-6
    assert recs["varlen"]["suspect"] and recs["varlen"]["rel_err_vs_packed"] > 0.1
    for rec in recs.values():
        assert rec["ms"] > 0 and len(rec["ms_rounds"]) == 2
