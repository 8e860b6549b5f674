"""The side-by-side benchmark's bookkeeping (benchmarks/bench_attention.py), on CPU.

Its timings only mean something on the H200, but which figure it calls valid does not: a
result that is wrong, or not finite, must be flagged and must never become the yardstick the
other implementations are checked against. Stand-in implementations replace the real ones.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_attention  # noqa: E402


def _stand_in(impl: str, causal: bool, direction: str = "fwd"):
    def exact(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")
    if impl in ("exact", "exact_again"):
        return exact
    if impl == "wrong":
        return lambda q, k, v: exact(q, k, v) * 1.5
    if impl == "nan":
        return lambda q, k, v: exact(q, k, v) * jnp.nan
    raise RuntimeError(f"{impl} is not available here")


@pytest.fixture
def point_inputs(monkeypatch):
    monkeypatch.setattr(bench_attention, "attention_fn", _stand_in)
    shape = (2, 64, 2, 32)
    q, k, v = (jax.random.normal(jax.random.key(i), shape, jnp.float32) for i in range(3))
    return q, k, v


def _time_point(impls, direction, q, k, v):
    args = argparse.Namespace(impls=impls, xla_max_seqlen=0, target_ms=0.5, repeats=2,
                              max_rel_err=0.02)
    point = dict(dtype="float32", head_dim=32, head_dim_v=32, seqlen=64, batch=2, heads=2,
                 causal=True, direction=direction)
    return {r["impl"]: r for r in bench_attention.time_point(args, point, q, k, v)}


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_wrong_and_nonfinite_results_are_flagged(point_inputs, direction):
    recs = _time_point(["nan", "exact", "wrong", "exact_again", "missing"], direction,
                       *point_inputs)
    assert set(recs) == {"nan", "exact", "wrong", "exact_again"}  # "missing" cannot run: no record
    assert recs["nan"]["suspect"] and recs["nan"]["nonfinite"] > 0
    assert "rel_err_vs_nan" not in recs["exact"]  # the NaN result is never the reference
    assert not recs["exact"].get("suspect")
    assert recs["wrong"]["suspect"] and recs["wrong"]["rel_err_vs_exact"] > 0.02
    assert not recs["exact_again"].get("suspect") and recs["exact_again"]["rel_err_vs_exact"] < 1e-6
    for rec in recs.values():
        assert rec["ms"] > 0 and rec["tflops"] >= 0 and rec["direction"] == direction
        assert len(rec["ms_rounds"]) == 2 and min(rec["ms_rounds"]) <= rec["ms"] <= max(rec["ms_rounds"])


def test_markdown_reports_the_spread_between_rounds():
    recs = [dict(impl="jax_fa3", direction="fwd", head_dim=128, seqlen=512, causal=True,
                 tflops=100.0, ms=1.0, ms_rounds=[1.0, 1.1, 0.95]),
            dict(impl="cudnn", direction="fwd", head_dim=128, seqlen=512, causal=True,
                 tflops=50.0, ms=2.0, ms_rounds=[2.0, 2.02])]
    table = bench_attention.markdown(recs, "# t")
    assert "| fwd | 128 | yes | 512 | 100.0 | 50.0 | 2.00x |" in table
    assert "largest 15.8% (jax_fa3 fwd hd128 s512 causal=1)" in table and "median 8.4%" in table
    assert "not recorded" in bench_attention.markdown([dict(recs[0], ms_rounds=[1.0])], "# t")


def test_unmasked_pairs_and_grid_shape():
    assert bench_attention.unmasked_pairs(4, causal=False) == 16
    assert bench_attention.unmasked_pairs(4, causal=True) == 10
    assert bench_attention.grid_shape(128, 8192, 16384, 2048) == (2, 8192, 16, 128)


def test_ring_scaling_smoke(tmp_path):
    """benchmarks/ring_scaling.py end to end on simulated CPU devices (portable path, tiny
    sizes): the correctness checks pass and the report carries efficiency and speedup."""
    import json
    import os
    import subprocess
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-P", str(root / "benchmarks" / "ring_scaling.py"), "--out", str(tmp_path),
         "--smoke", "--gpus", "1,2", "--strategies", "ring", "--heads-kv", "1",
         "--full-length-baseline"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (report_path,) = tmp_path.glob("*-ring-scaling.json")
    report = json.loads(report_path.read_text())
    assert report["pass"] and report["config"]["gpu_counts"] == [1, 2]
    assert report["correctness"]["2"]["ring"]["grads_pass"]
    ring = [r for r in report["timings"] if r["gpus"] == 2]
    assert {r["direction"] for r in ring} == {"fwd", "bwd"}
    assert all(r["efficiency"] > 0 and r["speedup_vs_one_gpu"] > 0 for r in ring)
    assert report_path.with_suffix(".png").stat().st_size > 0


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_timing_loop_does_not_copy_its_input_per_call(point_inputs, direction):
    # The loop's data dependence once cost a copy of all of q per call (q.at[...].add); the
    # chain through an optimization barrier must not, and the call must stay in the loop body.
    q, k, v = (x.astype(jnp.bfloat16) for x in point_inputs)  # as benchmarked (bf16)
    run, _ = bench_attention.make_loop(bench_attention.attention_fn("exact", True), direction, q, k, v)
    cells = dict(zip(run.__code__.co_freevars, (c.cell_contents for c in run.__closure__)))
    loop = cells["loop"]
    args = (q, k, v) if direction == "fwd" else (cells["pullback"], cells["dout"])
    hlo = loop.lower(4, *args).compile().as_text()
    body_name = re.search(r"while\(.*body=%?([\w.\-]+)", hlo).group(1)
    body = hlo[hlo.index(f"%{body_name} ("):]
    body = body[:body.index("\n}\n")]
    shape = "bf16[" + ",".join(map(str, q.shape)) + "]"
    assert not [line for line in body.splitlines() if " copy(" in line and shape in line]
    assert "fusion" in body or "dot(" in body  # the attention itself is computed in the body


def test_ab_compare_takes_geometric_means_per_variant(tmp_path):
    import ab_compare
    def table(tag, tflops):
        return (f"# Attention benchmark, x, heads*head_dim=2048, {tag} (TFLOP/s; ratios)\n\n"
                "| dir | hd | causal | seqlen | jax_fa3 |\n|---|---|---|---|---|\n"
                f"| fwd | 128 | yes | 512 | {tflops} |\n\n")
    path = tmp_path / "ab_tables.md"
    path.write_text(table("base", 100.0) + table("x", 120.0) + table("x", 130.0) + table("base", 110.0))
    runs = ab_compare.read_runs([path])
    assert [len(runs[n]) for n in ("base", "x")] == [2, 2]
    row = ab_compare.summary(runs).splitlines()[2]
    base, x = (100.0 * 110.0) ** 0.5, (120.0 * 130.0) ** 0.5
    assert f"{base:.1f}" in row and f"{x:.1f}" in row and f"{x / base:.3f}" in row


def test_ab_compare_reads_fp8_tables(tmp_path):
    """bench_fp8.py's tables (scripts/ab_variants.sh AB_BENCH=fp8): the variant from the title,
    jax_fa3_fp8 (the first column after the point) per (hd, causal, seqlen)."""
    import ab_compare
    def table(tag, tflops):
        return (f"# FP8 attention forward, x, batch*seqlen=16384, heads*head_dim=2048, {tag} (TFLOP/s)\n\n"
                "FP8 matmul ceiling (8192^3 e4m3 GEMM through XLA, bf16 out): n/a (--no-gemm)\n\n"
                "| hd | causal | seqlen | jax_fa3_fp8 | fp8 / bf16 | fp8 / fa3_fp8 |\n|---|---|---|---|---|---|\n"
                f"| 256 | no | 16384 | {tflops} | - | - |\n\n")
    path = tmp_path / "ab_tables.md"
    path.write_text(table("base", 800.0) + table("pp", 900.0))
    runs = ab_compare.read_runs([path])
    assert runs == {"base": [{("fp8", 256, "no", 16384): 800.0}], "pp": [{("fp8", 256, "no", 16384): 900.0}]}
    assert "| 1.125 |" in ab_compare.summary(runs)


def test_ab_variants_names_a_benchmark_cut_at_its_limit(tmp_path):
    """scripts/ab_variants.sh: a variant whose benchmark never finishes (session 29: a hung FP8
    tile) is named as cut at BENCH_TIMEOUT, and with no table there is no summary, said so."""
    import os
    import subprocess

    root = Path(__file__).resolve().parents[1]
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python3").write_text(  # the benchmark hangs; every other python3 call is the real one
        f'#!/bin/bash\nfor a in "$@"; do case $a in *bench_attention.py) sleep 30; exit 0;; esac; done\n'
        f'exec {sys.executable} "$@"\n')
    (fake / "python3").chmod(0o755)
    name = f"pytest_cut_{os.getpid()}"
    rc_file, log_file = Path(f"/tmp/ab_{name}.rc"), Path(f"/tmp/ab_{name}.log")
    rc_file.write_text("0\n")  # AB_REUSE: a build that "succeeded"
    log_file.write_text("")
    try:
        env = dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}", AB_REUSE="1", BENCH_TIMEOUT="1")
        out = subprocess.run(["bash", str(root / "scripts" / "ab_variants.sh"), str(tmp_path / "ab"), f"{name}="],
                             env=env, capture_output=True, text=True, timeout=60)
    finally:
        rc_file.unlink(missing_ok=True)
        log_file.unlink(missing_ok=True)
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"variant {name}: the benchmark was cut at its 1 s limit" in out.stdout
    assert "no variant's benchmark timed a point" in out.stdout
