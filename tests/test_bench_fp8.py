"""benchmarks/bench_fp8.py's bookkeeping on CPU: our FP8 and bf16 forwards on the portable paths
(its timings mean something only on the H200), the peers that cannot run reported as n/a with
their reason, the FP8 result checked against bf16 on the same dequantized inputs, and the table
and JSON written."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_fp8  # noqa: E402


def test_bench_fp8_runs_and_reports(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_fp8, "IMPLEMENTATION", "xla")
    assert bench_fp8.main(["--out", str(tmp_path), "--tag", "t", "--head-dims", "64",
                           "--seqlens", "128", "--causal", "0", "1", "--tokens", "256",
                           "--hidden", "128", "--target-ms", "1", "--repeats", "1",
                           "--no-gemm"]) == 0
    [js] = tmp_path.glob("*-fp8-t.json")
    data = json.loads(js.read_text())
    records = {(r["impl"], r["causal"]): r for r in data["records"]}
    for causal in (False, True):
        fp8, bf16 = records[("jax_fa3_fp8", causal)], records[("jax_fa3_bf16", causal)]
        assert fp8["ms"] > 0 and bf16["ms"] > 0 and "tflops" in fp8
        # e4m3 P against bf16 on the same inputs: a few percent, never a wrong answer's ~100%.
        assert 0 < fp8["rel_err_vs_bf16"] < 0.1
        assert "head dim 128 only" in records[("fa3_fp8", causal)]["skipped"]
        # cuDNN's FP8 attention needs the GPU's cuDNN: off it, n/a with JAX's reason.
        assert "cuDNN is not detected" in records[("cudnn_fp8", causal)]["skipped"]
    assert data["gemm"] == {"skipped": "--no-gemm"}
    md = js.with_suffix(".md").read_text()
    assert md.splitlines()[0].endswith("heads*head_dim=128, t (TFLOP/s)")  # the tag: ab_compare's variant
    assert "| 64 | yes | 128 |" in md and "| 64 | no | 128 |" in md
    assert "Not run (n/a):" in md and "fp8 / bf16" in md
    assert md.count("x | - | - |") == 2  # fp8 / bf16 given per point; no fa3, no cuDNN ratios
