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


def test_cudnn_fp8_call_lowers_for_cuda(monkeypatch):
    """The cudnn_fp8 peer's call, lowered for CUDA here (cuDNN's presence and the GPU's compute
    capability stubbed): JAX's private FP8 binding still takes what bench_fp8 passes, and the
    mask follows `causal`."""
    import jax
    import jax.numpy as jnp
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_sdpa

    monkeypatch.setattr(cudnn_sdpa, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(cudnn_sdpa, "is_cuda_compute_capability_equal", lambda *_: False)
    shape = (1, 256, 2, 128)
    xs = [jax.random.normal(jax.random.key(i), shape, jnp.float32) for i in range(3)]
    fp8 = [bench_fp8.quantize_fp8(x, granularity="head") for x in xs]
    bf16 = tuple(bench_fp8.dequantize_fp8(x8, d).astype(jnp.bfloat16) for x8, d in fp8)
    configs = set()
    for causal in (False, True):
        fn, inputs, _ = bench_fp8.point_fns("cudnn_fp8", causal, fp8, bf16)
        assert all(x.dtype == jnp.float8_e4m3fn for x in inputs)
        text = jax.jit(fn).trace(*inputs).lower(lowering_platforms=("cuda",)).as_text()
        [call] = [line for line in text.splitlines() if "stablehlo.custom_call @__cudnn$fmha" in line]
        assert "F8" in call
        configs.add(call.split("backend_config", 1)[1])
        assert jax.eval_shape(fn, *inputs).shape == shape
    assert len(configs) == 2  # causal and not lower to different cuDNN configurations

def test_profile_point_runs_the_fp8_forward(monkeypatch, capsys):
    """benchmarks/profile_point.py (what scripts/ncu_point.sh runs) on the FP8 forward: ours on the
    portable path here; cuDNN's reaches JAX's binding, which off the GPU says why it cannot run."""
    import profile_point
    import pytest

    monkeypatch.setattr(bench_fp8, "IMPLEMENTATION", "xla")
    small = ["--dtype", "float8_e4m3fn", "--head-dim", "64", "--seqlen", "128", "--tokens", "256",
             "--hidden", "128", "--calls", "1"]
    assert profile_point.main(["--impl", "jax_fa3", "--causal", "1", *small]) == 0
    assert "jax_fa3 fwd hd64 s128 b2 h2 causal=True: median" in capsys.readouterr().out
    with pytest.raises(Exception, match="cuDNN is not detected"):
        profile_point.main(["--impl", "cudnn", *small])
    with pytest.raises(SystemExit):  # the FP8 backward and other peers: a usage error
        profile_point.main(["--impl", "jax_fa3", "--direction", "bwd", *small])
