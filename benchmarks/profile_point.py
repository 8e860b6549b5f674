"""One grid point of bench_attention.py, run a few times, for a profiler to look at.

    python3 -P benchmarks/profile_point.py --impl jax_fa3 --direction bwd --head-dim 256 --seqlen 8192 --causal 1
    scripts/ncu_point.sh OUT_DIR <the same arguments>      # Nsight Compute on the device

Same shapes as bench_attention.py (batch * seqlen = --tokens, heads * head_dim = --hidden),
random inputs, --calls jitted calls of the forward or the backward after one warm-up call.
Prints the median wall time of the calls (for orientation only: the benchmark is the figure).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import attention_fn, grid_shape, make_loop  # noqa: E402


def add_point_arguments(p: argparse.ArgumentParser, seqlen: int = 8192) -> None:
    """The grid point's arguments (shared with timeline_point.py)."""
    p.add_argument("--impl", default="jax_fa3",
                   help="jax_fa3, jax_fa3_det, cudnn, xla or fa3 (float8_e4m3fn: jax_fa3 or cudnn)")
    p.add_argument("--direction", default="fwd", choices=("fwd", "bwd"))
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=seqlen)
    p.add_argument("--causal", type=int, default=0, choices=(0, 1))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float8_e4m3fn"),
                   help="float8_e4m3fn: the FP8 forward as bench_fp8.py calls it (jax_fa3: inputs "
                        "quantized per head; cudnn: per tensor, e4m3 out)")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=2048)


def point_loop(p: argparse.ArgumentParser, args) -> tuple:
    """(run, shape): the benchmark's loop of the point (bench_attention.make_loop) on random
    inputs of its shape; p.error on arguments that do not make a point."""
    if args.hidden % args.head_dim:
        p.error(f"--hidden {args.hidden} is not a multiple of --head-dim {args.head_dim}")
    shape = grid_shape(args.head_dim, args.seqlen, args.tokens, args.hidden)
    keys = jax.random.split(jax.random.key(0), 3)
    if args.dtype == "float8_e4m3fn":
        fp8_impl = {"jax_fa3": "jax_fa3_fp8", "cudnn": "cudnn_fp8"}.get(args.impl)
        if fp8_impl is None or args.direction != "fwd":
            p.error("--dtype float8_e4m3fn profiles the forward of jax_fa3 or cudnn")
        from bench_fp8 import point_fns  # the benchmark's FP8 calls and quantization
        from jax_fa3.fp8 import quantize_fp8
        x = [jax.random.normal(key, shape, jnp.float32) for key in keys]
        fp8_inputs = [quantize_fp8(t, granularity="head") for t in x]
        fn, (q, k, v), _ = point_fns(fp8_impl, bool(args.causal), fp8_inputs,
                                     tuple(t.astype(jnp.bfloat16) for t in x))
    else:
        q, k, v = (jax.random.normal(key, shape, jnp.dtype(args.dtype)) for key in keys)
        fn = attention_fn(args.impl, bool(args.causal), args.direction)
    run, _ = make_loop(fn, args.direction, q, k, v)
    return run, shape


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_point_arguments(p)
    p.add_argument("--calls", type=int, default=3)
    args = p.parse_args(argv)
    run, shape = point_loop(p, args)
    batch, _, heads, _ = shape
    jax.block_until_ready(run(1))  # compile and warm up
    times = []
    for _ in range(args.calls):
        t0 = time.perf_counter()
        jax.block_until_ready(run(1))
        times.append(time.perf_counter() - t0)
    print(f"{args.impl} {args.direction} hd{args.head_dim} s{args.seqlen} b{batch} h{heads} "
          f"causal={bool(args.causal)}: median {np.median(times) * 1e3:.3f} ms per call "
          f"(wall, incl. dispatch)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
