"""FP8 attention accuracy, the FA3 paper's way (section 4.3): q, k, v drawn from N(0, 1) with a
small fraction of entries (0.1%) replaced by N(0, 10^2) samples ("outliers"); the RMSE of the
output against a float64 reference of the UNQUANTIZED inputs, for

  * bf16 attention (the reference point),
  * FP8 with one scale per tensor (the paper's baseline),
  * FP8 with one scale per (batch, head) (FA3's kernel convention),
  * FP8 with block quantization (one scale per `--block-rows` tokens of a head),
  * FP8 with block quantization + incoherent processing (random-sign Hadamard on q and k).

Runs on CPU through the portable path (the FP8 kernel's numerics, jax_fa3/portable_fp8.py):

    python benchmarks/fp8_accuracy.py                      # batch 1, seqlen 2048, 4 heads, hd 128
    python benchmarks/fp8_accuracy.py --out benchmarks/results --name 2026-12-04-cpu-fp8-accuracy

prints a markdown table; `--out DIR` also writes DIR/NAME.json and DIR/NAME.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_fa3

VARIANTS = {  # name: how the output is computed from float32 q, k, v
    "bf16": dict(kind="bf16"),
    "fp8 per-tensor": dict(granularity="tensor"),
    "fp8 per-head": dict(granularity="head"),
    "fp8 block": dict(granularity="block"),
    "fp8 block + incoherent": dict(granularity="block", incoherent=True),
}
BASELINE, BEST = "fp8 per-tensor", "fp8 block + incoherent"


def outlier_inputs(seed, shape, frac, outlier_std):
    """N(0, 1) with a fraction `frac` of the entries replaced by N(0, outlier_std^2) samples."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    mask = rng.random(shape) < frac
    x[mask] = outlier_std * rng.standard_normal(int(mask.sum()))
    return x.astype(np.float32)


def reference(q, k, v, causal):
    """Dense float64 attention, one head at a time (the score matrix of one head at a time)."""
    b, sq, h, d = q.shape
    sk = k.shape[1]
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    out = np.empty(q.shape)
    allowed = np.arange(sk)[None, :] <= np.arange(sq)[:, None] + (sk - sq)
    for i in range(b):
        for j in range(h):
            s = q[i, :, j] @ k[i, :, j].T / np.sqrt(d)
            if causal:
                s = np.where(allowed, s, -np.inf)
            p = np.exp(s - s.max(axis=-1, keepdims=True))
            out[i, :, j] = (p / p.sum(axis=-1, keepdims=True)) @ v[i, :, j]
    return out


def run_variant(spec, q, k, v, causal, block_rows, key):
    if spec.get("kind") == "bf16":
        f = lambda q, k, v: jax_fa3.flash_attention(
            *(x.astype(jnp.bfloat16) for x in (q, k, v)), causal=causal)
    else:
        incoherent = spec.get("incoherent", False)
        f = lambda q, k, v: jax_fa3.flash_attention_fp8(
            q, k, v, granularity=spec["granularity"], block_rows=block_rows,
            incoherent=incoherent, key=key if incoherent else None, causal=causal)
    out = jax.jit(f)(q, k, v)
    return np.asarray(out.astype(jnp.float32)).astype(np.float64)


def _rmse(out, ref):
    return float(np.sqrt(np.mean((out - ref) ** 2)))


def _sources(spec, q, k, v, ref, args, key):
    """Where the error comes from: float64 attention of the dequantized q and k only, and of
    the dequantized v only (no FP8 rounding of the probabilities in either)."""
    def dequant(x, rotate):
        x8, descale = jax_fa3.quantize_fp8(
            jnp.asarray(x), granularity=spec["granularity"], block_rows=args.block_rows,
            hadamard_key=key if rotate and spec.get("incoherent") else None)
        return np.asarray(jax_fa3.dequantize_fp8(x8, descale, block_rows=args.block_rows),
                          np.float64)
    q_k = reference(dequant(q, True), dequant(k, True), v, args.causal)
    v_only = reference(q, k, dequant(v, False), args.causal)
    return dict(rmse_qk_only=_rmse(q_k, ref), rmse_v_only=_rmse(v_only, ref))


def measure(args):
    shape_q = (args.batch, args.seqlen, args.heads, args.head_dim)
    q, k, v = (outlier_inputs(args.seed + i, shape_q, args.outlier_frac, args.outlier_std)
               for i in range(3))
    ref = reference(q, k, v, args.causal)
    key = jax.random.key(args.seed)
    rows = {}
    for name, spec in VARIANTS.items():
        start = time.perf_counter()
        out = run_variant(spec, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), args.causal,
                          args.block_rows, key)
        rows[name] = dict(rmse=_rmse(out, ref), seconds=round(time.perf_counter() - start, 2))
        if "granularity" in spec:
            rows[name].update(_sources(spec, q, k, v, ref, args, key))
    for row in rows.values():
        row["vs_per_tensor"] = rows[BASELINE]["rmse"] / row["rmse"]
    return rows, float(np.sqrt(np.mean(ref ** 2)))


def markdown(args, rows, ref_rms):
    config = (f"batch {args.batch}, seqlen {args.seqlen}, heads {args.heads}, head_dim "
              f"{args.head_dim}, {'causal' if args.causal else 'non-causal'}; q, k, v from "
              f"N(0, 1) with {args.outlier_frac:.1%} of entries from N(0, {args.outlier_std:g}^2); "
              f"block quantization {args.block_rows} tokens; seed {args.seed}; "
              f"RMS of the reference output {ref_rms:.3e}")
    lines = ["# FP8 attention accuracy (FA3 paper's method)", "", config, "",
             "| variant | RMSE vs float64 | per-tensor RMSE / this | q, k quantized only | "
             "v quantized only |", "| --- | --- | --- | --- | --- |"]
    for name, row in rows.items():
        parts = [f"{row[c]:.2e}" if c in row else "" for c in ("rmse_qk_only", "rmse_v_only")]
        lines.append(f"| {name} | {row['rmse']:.2e} | {row['vs_per_tensor']:.2f}x | "
                     f"{' | '.join(parts)} |")
    gain = rows[BEST]["vs_per_tensor"]
    lines += ["", f"Block quantization + incoherent processing: {gain:.2f}x lower RMSE than "
              f"per-tensor FP8 (issue 28's done-when: at least 2x; the FA3 paper: 2.4e-2 -> "
              f"9.1e-3, 2.6x). Computed on {platform.machine()} CPU through the portable FP8 "
              f"path (jax_fa3/portable_fp8.py, the kernel's numerics), jax {jax.__version__}.",
              "", "The last two columns are float64 attention of the dequantized q and k alone "
              "(v exact) and of the dequantized v alone: no FP8 rounding of the probabilities. "
              "Block scales and the Hadamard rotation act on q and k; v (not rotated) keeps "
              "e4m3's relative error at any scale granularity and sets a floor."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--block-rows", type=int, default=64)
    p.add_argument("--outlier-frac", type=float, default=1e-3)
    p.add_argument("--outlier-std", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="folder for NAME.json and NAME.md")
    p.add_argument("--name", default=f"{datetime.date.today()}-cpu-fp8-accuracy")
    args = p.parse_args(argv)
    rows, ref_rms = measure(args)
    text = markdown(args, rows, ref_rms)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"{args.name}.md"), "w") as f:
            f.write(text)
        with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
            json.dump(dict(config=vars(args), reference_rms=ref_rms, results=rows,
                           jax=jax.__version__), f, indent=2)
    return rows


if __name__ == "__main__":
    main()
