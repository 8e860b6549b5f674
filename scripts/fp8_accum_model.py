"""A numpy model of the FP8 forward kernel's numerics with the QGMMA's accumulation, scored by
tests/test_fp8_gpu.py's criteria on that test's own inputs: where its tolerances come from.

    python3 -P scripts/fp8_accum_model.py [BITS] [HEAD_DIMS]     # defaults: 13 64,128,256

The model follows cpp/kernels/fwd step by step (key blocks of the FP8 tile table's kBlockN, the
last first; the running max, P = exp2(x - max + 8) in float32 rounded to e4m3, the unrounded
row sums, O rescaled by alpha, O / l times v's descale, bf16), except for one thing the oracle
(jax_fa3/portable_fp8.py) leaves out: each FP8 WGMMA step (K = 32) adds its 32 exact products to
the accumulator with all 33 terms aligned to the largest exponent and BITS bits kept below its
leading bit, the rest truncated, a published description of Hopper's FP8 tensor cores (about
13 bits). That makes the scores' relative noise grow with the head dim (d / 32 steps), far above
float32's, and moves some P_j across e4m3 rounding boundaries, which the oracle cannot follow.

With BITS = 13 and the former criterion (98% of the elements within 2^-8 w at every head dim)
it gives the H200 run of session 22 (close8 below): every hd64 / hd128 case of
test_head_dims_and_seqlens at 98.2% or more (all passed), the six hd256 cases that failed at
97.7-98.0% (the model's six lowest), the seven that passed at 98.2% or more; hence the test's
noise(d), at which every case has 98.9% or more.
Prints, per case, each criterion's value against its limit: every (worst excess over one bf16
step, in units of FLIP w; <= 1), close (share within noise(d) w; >= 0.98), close8 (within
2^-8 w), excess (mean, in units of MEAN; <= 1), ref (vs float64, <= 1), lse (<= 1).
"""

from __future__ import annotations

import pathlib
import sys

import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]  # the tests' helpers; jax_fa3 from this tree
import test_fp8_gpu as T  # noqa: E402
from test_fp8 import _dequant, _weight, fp8_bound  # noqa: E402

# The model runs without the extension: the head dims here are the kernels', and the key blocks
# those of the FP8 tile table as landed (cpp/kernels/fwd/fwd_launch.cuh; a build reports its own
# through jax_fa3._ffi.fwd_key_block). Its shapes stay below the long bands (4096).
KEY_BLOCKS = {"full": {64: 160, 128: 192, 256: 64}, "banded": {64: 128, 128: 128, 256: 64}}
T._ffi.kernel_head_dim = lambda direction, dtype, d, dv: d
T._ffi.fwd_key_block = lambda dtype, d, dv, sq, sk, left, right: KEY_BLOCKS[
    "banded" if min(left, right) < sq + sk else "full"][d]
F32 = np.float32


def _truncate(x, step):
    return np.trunc(x / step) * step


def qgmma(c, a, b, bits):
    """c + a b^T (float64 arrays of exact values) as the FP8 WGMMA steps of K = 32 add it."""
    for k0 in range(0, a.shape[1], 32):
        terms = np.concatenate([c[..., None], a[:, None, k0:k0 + 32] * b[None, :, k0:k0 + 32]], -1)
        top = np.frexp(np.abs(terms).max(-1, keepdims=True))[1]  # leading bit 2^(top - 1)
        c = _truncate(terms, 2.0 ** (top - 1 - bits)).sum(-1).astype(F32).astype(np.float64)
    return c


def kernel(q8, qd, k8, kd, v8, vd, causal, block_n, bits):
    """out (bf16 values) and lse of the kernel's algorithm; e4m3 inputs as float64 arrays."""
    b, sq, hq, d = q8.shape
    sk, hkv = k8.shape[1], k8.shape[2]
    out = np.zeros((b, sq, hq, v8.shape[3]), F32)
    lse = np.zeros((b, hq, sq))
    row = np.arange(sq)[:, None]
    for bb in range(b):
        for h in range(hq):
            hk = h // (hq // hkv)
            scale = max(F32(d ** -0.5 * np.log2(np.e)) * F32(F32(qd[bb, h]) * F32(kd[bb, hk])),
                        np.finfo(F32).tiny)  # the kernel's scale_log2 with the descales
            m = np.full(sq, -np.inf, F32)
            l = np.zeros(sq, F32)
            o = np.zeros((sq, v8.shape[3]))
            for n in reversed(range(-(-sk // block_n))):
                keys = slice(n * block_n, min((n + 1) * block_n, sk))  # TMA's zero fill: padding
                kb = np.zeros((block_n, d)); vb = np.zeros((block_n, v8.shape[3]))
                kb[:keys.stop - keys.start] = k8[bb, keys, hk]
                vb[:keys.stop - keys.start] = v8[bb, keys, hk]
                s = qgmma(np.zeros((sq, block_n)), q8[bb, :, h], kb, bits).astype(F32)
                col = n * block_n + np.arange(block_n)[None, :]
                s = np.where((col < sk) & ((col <= row + sk - sq) if causal else True), s, -np.inf)
                m_new = np.maximum(m, s.max(1))
                m_scaled = np.where(m_new == -np.inf, 0, m_new * scale).astype(F32)
                with np.errstate(invalid="ignore"):
                    alpha = np.where(m_new == m, 1, np.exp2(m * scale - m_scaled)).astype(F32)
                x = (s * np.float64(scale) - (m_scaled - 8)[:, None]).astype(F32)  # one fma
                p = np.exp2(x).astype(F32)
                l = (l * alpha + p.sum(1, dtype=np.float64)).astype(F32)
                m = m_new
                p8 = np.asarray(jnp.asarray(p).astype(jnp.float8_e4m3fn), np.float64)
                o = qgmma((o * alpha[:, None]).astype(F32).astype(np.float64), p8, vb.T, bits)
            empty = ~(l > 0)
            inv = np.where(empty, 0, (1 / np.where(empty, 1, l)).astype(F32) * F32(vd[bb, hk]))
            out[bb, :, h] = o.astype(F32) * inv[:, None].astype(F32)
            log2_l = np.log2(np.where(empty, 1, l))
            lse[bb, h] = np.where(empty, -np.inf, (m * scale - 8 + log2_l) * np.log(2))
    return np.asarray(jnp.asarray(out).astype(jnp.bfloat16).astype(jnp.float32), np.float64), lse


def score(d, sq, sk, causal, bits):
    """test_head_dims_and_seqlens's inputs and criteria, the model in the kernel's place."""
    b, hq, hkv = (1, 2, 1) if max(sq, sk) >= 1000 else (2, 4, 2)
    inputs = T._fp8_inputs(sq * 7 + sk + d, b, sq, sk, hq, hkv, d)
    q8, qd, k8, kd, v8, vd = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in inputs)
    o_out, o_lse = T._oracle(*inputs, causal=causal)
    block_n = KEY_BLOCKS["banded" if causal else "full"][d]  # causal: the banded tile
    got, lse = kernel(q8, qd, k8, kd, v8, vd, causal, block_n, bits)
    q, k, v = (_dequant(x, xd) for x, xd in ((q8, qd), (k8, kd), (v8, vd)))
    w = np.maximum(_weight(q, k, v, causal=causal), 1e-30)
    oracle = np.asarray(o_out).astype(np.float64)
    excess = np.abs(got - oracle) - (T.OUT_STEP * np.abs(oracle) + 1e-6 * (1 + np.abs(oracle)))
    bound, ref = fp8_bound(q, k, v, jnp.bfloat16, causal=causal)
    fin = np.isfinite(o_lse)
    lse_err = np.abs(lse[fin] - o_lse[fin]) / (T.LSE_TOL * (1 + np.abs(o_lse[fin])))
    return dict(every=(excess / w).max() / T.FLIP, close=(excess <= T.noise(d) * w).mean(),
                close8=(excess <= 2.0 ** -8 * w).mean(),
                excess=(np.maximum(excess, 0) / w).mean() / T.MEAN,
                ref=(np.abs(got - ref) / (bound + T.FLIP / 2 * w)).max(),
                lse=lse_err.max() if fin.any() else 0.0)


def main():
    bits = int(sys.argv[1]) if len(sys.argv) > 1 else 13
    dims = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [64, 128, 256]
    for d in dims:
        for causal in (False, True):
            for sq, sk in T.SEQLENS:
                r = score(d, sq, sk, causal, bits)
                ok = (r["every"] <= 1 and r["close"] >= 0.98 and r["excess"] <= 1 and r["ref"] <= 1
                      and r["lse"] < 1)
                name = f"{'causal' if causal else 'full'}-{sq}-{sk}-{d}"
                print(f"bits {bits} {name:20s} {'ok  ' if ok else 'FAIL'} "
                      + " ".join(f"{k} {x:.4f}" for k, x in r.items()), flush=True)


if __name__ == "__main__":
    main()
