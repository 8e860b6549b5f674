"""GPU tests of the FP8 (e4m3) forward kernel (cpp/kernels/fwd with an e4m3 element, issue 28),
through jax_fa3.flash_attention(..., implementation="cuda"), against

  * its oracle, jax_fa3/portable_fp8.py on the kernel's key blocks (`kernel_blocks`, with the
    FP8 tile table's kBlockN): both round the same P_j = exp2(s_j - m + 8) to e4m3 under the
    same running max;
  * the float64 reference of the dequantized inputs, within tests/test_fp8.py's FP8 bound.

Tolerances, from e4m3's and bf16's precision (p_j: the exact probabilities, v_j the values):
  * kernel vs oracle. Both round O to bf16 (one bf16 step apart at most: 2^-7 |oracle|). P_j
    differs only where noise in the scores (WGMMA's FP8 accumulation order and width, the
    descales folded into the scale) moves P_j across an e4m3 rounding boundary, which moves it by
    one e4m3 step, at most 2^-3 P_j. Every element: within 2^-7 |oracle| + 2^-3 w, w =
    sum_j p_j |v_j| (each of the two within e4m3's 2^-4 w of the exact P v). Tight, since flips
    are rare: 98% of the elements within 2^-7 |oracle| + noise(d) w, and the mean of the excess
    over 2^-7 |oracle|, in units of w, at most 2^-10.
    The scores' noise is the FP8 WGMMA's, not float32's: each K = 32 step adds its products to
    the accumulator with about 13 bits kept after aligning them to the largest exponent
    (truncated), so the noise grows with the d / 32 steps, and flips with it; rows with few keys
    (each P_j a large share of w) show most of them. noise(d) = 2^-8 d / 64, from
    scripts/fp8_accum_model.py, a model of the kernel with that accumulation (13 bits): it gives
    the H200's outcome of this test at 2^-8 everywhere (session 22: every hd64 / hd128 case
    passed, in the model 98.2% of the elements or more; the six hd256 cases that failed are the
    model's six lowest, 97.7-98.0%, and the seven that passed 98.2% or more), and at noise(d)
    98.9% or more in every case of test_head_dims_and_seqlens (with 14 bits: 99.5% at hd128 and
    hd256).
  * kernel vs float64: fp8_bound (P rounded to e4m3: 2^-4 w and its subnormal term, out's half
    ulp) plus 2^-4 w (the oracle's own share of the difference above).
  * lse: the log of the unrounded row sums, float32 but for the scores' accumulation:
    |lse - oracle's| <= 2^-10 (1 + |lse|).
Every element must be finite (outputs are poisoned first: an unwritten element would surface
as NaN); rows that see no key give out 0 and lse -inf exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from test_fp8 import _dequant, _fp8_inputs, _weight, fp8_bound
from jax_fa3 import _ffi, _masks, flash_attention, portable_fp8

pytestmark = pytest.mark.gpu

F8, BF16, F16 = jnp.float8_e4m3fn, jnp.bfloat16, jnp.float16
HEAD_DIMS = (64, 128, 256)
FLIP = 2.0 ** -3      # kernel vs oracle, every element: both within e4m3's 2^-4 w of exact
MEAN = 2.0 ** -10     # kernel vs oracle: the mean excess over one bf16 step, in units of w
OUT_STEP = 2.0 ** -7  # one bf16 step of |out|
LSE_TOL = 2.0 ** -10


def noise(d):
    """Kernel vs oracle, 98% of the elements (rare rounding flips), for the kernel head dim d:
    2^-8 at d = 64, growing with the FP8 WGMMA's K = 32 steps of Q K^T (module docstring)."""
    return 2.0 ** -8 * max(d, 64) / 64


def _need(d, dv=None):
    helpers.skip_unless_kernel("fwd", F8, d, dv)


def _run(q8, qd, k8, kd, v8, vd, *, out_dtype=BF16, implementation="cuda", **opts):
    helpers.poison_heap(jnp.zeros((*q8.shape[:3], v8.shape[3]), out_dtype),
                        jnp.zeros((q8.shape[0], q8.shape[2], q8.shape[1]), jnp.float32))
    run = jax.jit(lambda *a: flash_attention(
        a[0], a[2], a[4], q_descale=a[1], k_descale=a[3], v_descale=a[5], return_lse=True,
        out_dtype=out_dtype, implementation=implementation, **opts))
    return jax.device_get(run(q8, qd, k8, kd, v8, vd))


def _oracle(q8, qd, k8, kd, v8, vd, *, out_dtype=BF16, causal=False, window_size=(-1, -1),
            softcap=0.0, softmax_scale=None):
    d, dv = q8.shape[3], v8.shape[3]
    left, right = _masks.band(causal, window_size)
    # The oracle runs on the kernel's key blocks: those of the tile the launcher picks for this
    # problem (cpp/kernels/fwd/fwd_launch.cuh, with_fwd_tile), as this build compiled it.
    block_n = _ffi.fwd_key_block(F8, d, dv, q8.shape[1], k8.shape[1], left, right)
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    return jax.device_get(portable_fp8.forward(
        q8, k8, v8, (qd, kd, vd), softmax_scale=scale, softcap=softcap, left=left, right=right,
        out_dtype=out_dtype, block_k=block_n, kernel_blocks=True))


def _check(name, inputs, out_dtype=BF16, **opts):
    q8, qd, k8, kd, v8, vd = inputs
    out, lse = _run(*inputs, out_dtype=out_dtype, **opts)
    b, sq, hq, _ = q8.shape
    assert out.shape == (b, sq, hq, v8.shape[3]) and out.dtype == out_dtype, name
    assert lse.shape == (b, hq, sq) and lse.dtype == np.float32, name
    helpers.assert_finite(f"{name} out", out)
    helpers.assert_finite(f"{name} lse", lse, allow_neg_inf=True)
    o_out, o_lse = _oracle(*inputs, out_dtype=out_dtype, **opts)
    if qd is not None and np.ndim(qd) == 2 and qd.shape[1] != hq:  # per kv head: per query head
        qd = np.repeat(np.asarray(qd), hq // qd.shape[1], axis=1)
    q, k, v = (_dequant(x, 1.0 if x_descale is None else x_descale)
               for x, x_descale in ((q8, qd), (k8, kd), (v8, vd)))
    weight = _weight(q, k, v, **opts)
    got = np.asarray(out).astype(np.float64)
    oracle = np.asarray(o_out).astype(np.float64)
    err = np.abs(got - oracle)
    step = OUT_STEP * np.abs(oracle) + 1e-6 * (1 + np.abs(oracle))
    worst = np.unravel_index(np.argmax(err - step - FLIP * weight), err.shape)
    assert (err <= step + FLIP * weight).all(), (
        f"{name}: kernel vs oracle {err[worst]:.3e} at {worst}, weight {weight[worst]:.3e}")
    kernel_d = _ffi.kernel_head_dim("fwd", F8, q8.shape[3], v8.shape[3])
    close = (err <= step + noise(kernel_d) * weight).mean()
    assert close >= 0.98, f"{name}: only {close:.4f} of the elements agree with the oracle to noise"
    excess = (np.maximum(err - step, 0) / np.maximum(weight, 1e-30)).mean()
    assert excess <= MEAN, f"{name}: mean excess over the oracle {excess:.2e} of the weight"
    bound, ref = fp8_bound(q, k, v, out_dtype, **opts)
    err_ref = np.abs(got - ref)
    slack = bound + FLIP / 2 * weight
    worst = np.unravel_index(np.argmax(err_ref - slack), err.shape)
    assert (err_ref <= slack).all(), (
        f"{name}: kernel vs float64 {err_ref[worst]:.3e} > {slack[worst]:.3e} at {worst}")
    lse, o_lse = np.asarray(lse, np.float64), np.asarray(o_lse, np.float64)
    assert (np.isneginf(lse) == np.isneginf(o_lse)).all(), f"{name}: -inf rows of lse differ"
    fin = np.isfinite(o_lse)
    np.testing.assert_array_less(np.abs(lse[fin] - o_lse[fin]), LSE_TOL * (1 + np.abs(o_lse[fin])),
                                 err_msg=f"{name}: lse")
    empty = np.isneginf(o_lse)  # rows that see no key: out exactly 0
    if empty.any():
        assert (got.transpose(0, 2, 1, 3)[empty] == 0).all(), f"{name}: fully masked rows"
    return out, lse


SEQLENS = [(1, 1), (17, 17), (128, 128), (129, 129), (1000, 1000), (17, 1000), (1000, 129)]


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("sq,sk", SEQLENS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_head_dims_and_seqlens(d, sq, sk, causal):
    _need(d)
    b, hq, hkv = (1, 2, 1) if max(sq, sk) >= 1000 else (2, 4, 2)
    inputs = _fp8_inputs(sq * 7 + sk + d, b, sq, sk, hq, hkv, d)
    _check(f"d{d} {sq}x{sk} causal={causal}", inputs, causal=causal)


OPTIONS = [  # (name, (b, sq, sk, hq, hkv, d, dv), granularity, options)
    ("window", (2, 300, 300, 4, 2, 128, 128), "head", dict(window_size=(37, 5))),
    ("window left only", (1, 200, 500, 2, 2, 64, 64), "head", dict(window_size=(50, -1))),
    ("causal window", (1, 257, 257, 2, 1, 256, 256), "head", dict(causal=True, window_size=(100, 0))),
    ("softcap", (2, 129, 300, 4, 2, 128, 128), "head", dict(softcap=5.0)),
    ("softcap causal", (1, 300, 129, 2, 1, 64, 64), "tensor", dict(causal=True, softcap=2.0)),
    ("empty rows", (2, 300, 100, 2, 1, 128, 128), "head", dict(causal=True)),  # rows < 200 see none
    ("diagonal only", (1, 64, 64, 2, 1, 64, 64), "head", dict(window_size=(0, 0))),
    ("gqa 8", (1, 200, 333, 8, 1, 128, 128), "head", {}),
    ("gqa 2 causal", (2, 333, 200, 4, 2, 256, 256), "head", dict(causal=True)),
    ("per tensor", (2, 129, 129, 2, 2, 128, 128), "tensor", {}),
    ("dv < d", (1, 100, 150, 2, 1, 64, 32), "head", dict(causal=True)),
    ("scale", (1, 64, 200, 2, 2, 128, 128), "head", dict(softmax_scale=0.02)),
    ("fp16 out", (1, 129, 129, 2, 1, 128, 128), "head", dict(out_dtype=F16)),
    ("batch 3 head 96 -> 128", (3, 65, 77, 2, 1, 96, 96), "head", dict(causal=True)),
    # Bands of at least 4096 rows and keys: hd128's long-band tile (192 keys, band mask), hd64's
    # (192 x 160, three warpgroups; 8 heads: more tiles than SMs).
    ("long band causal", (1, 4097, 4097, 2, 1, 128, 128), "head", dict(causal=True)),
    ("long band window", (1, 4500, 4300, 2, 1, 128, 128), "head", dict(window_size=(4200, 30))),
    ("long band causal hd64", (1, 4097, 4097, 8, 2, 64, 64), "head", dict(causal=True)),
    ("long band window hd64", (1, 4500, 4300, 2, 1, 64, 64), "head", dict(window_size=(4200, 30))),
    # More tiles than an H100/H200 has SMs, so CTAs run several tiles: the banded kernels' dynamic
    # schedule (Q buffers by turns, tiles without keys among them) and, banded or not, the V
    # transposers running across tiles up to the V ring's end marker.
    ("many tiles causal", (2, 300, 300, 36, 12, 64, 64), "head", dict(causal=True)),
    ("many tiles causal sq>sk", (2, 400, 260, 36, 12, 128, 128), "head", dict(causal=True)),
    ("many tiles window", (2, 300, 500, 36, 12, 256, 256), "head", dict(window_size=(100, 20))),
    ("many tiles full", (2, 400, 1100, 36, 12, 128, 128), "head", {}),  # past hd128's narrow tile
    ("many tiles narrow", (2, 400, 700, 36, 12, 128, 128), "head", {}),  # hd128's narrow tile (up to 1k keys)
    ("full 2100 keys", (1, 333, 2100, 4, 2, 128, 128), "head", dict(softcap=3.0)),
]


@pytest.mark.parametrize("case", OPTIONS, ids=[c[0] for c in OPTIONS])
def test_options(case):
    name, (b, sq, sk, hq, hkv, d, dv), granularity, opts = case
    _need(d, dv)
    inputs = _fp8_inputs(len(name) + sq, b, sq, sk, hq, hkv, d, dv, granularity=granularity)
    _check(name, inputs, **opts)


def test_descale_forms():
    """q_descale per kv head (FA3's rule) or per query head, v_descale None, large logits."""
    _need(128)
    b, sq, sk, hq, hkv, d = 2, 150, 150, 4, 2, 128
    q8, qd, k8, kd, v8, vd = _fp8_inputs(11, b, sq, sk, hq, hkv, d, q_scale=6.0)
    _check("per q head", (q8, qd, k8, kd, v8, vd), causal=True)
    qd_kv = qd.reshape(b, hkv, hq // hkv)[..., 0]
    _check("q per kv head, no v descale", (q8, qd_kv, k8, kd, v8, None))


def test_zero_descale_gives_uniform_weights():
    """A k descale of 0 (every score 0): uniform weights over the visible keys, as on the
    portable path, and no NaN from the masked ones (the kernel keeps a positive scale)."""
    _need(64)
    q8, qd, k8, kd, v8, vd = _fp8_inputs(5, 1, 100, 100, 2, 1, 64)
    _check("zero k descale", (q8, qd, k8, jnp.zeros_like(kd), v8, vd), causal=True)


def test_none_and_cuda_take_the_kernel():
    """implementation=None takes the FP8 kernel where it can run the call, as "cuda" does
    (jax_fa3/_core.py resolve_fp8_implementation); per-block descales cannot go to the kernel:
    None runs them on the portable path and "cuda" says why."""
    _need(64)
    q8, qd, k8, kd, v8, vd = _fp8_inputs(3, 1, 64, 64, 2, 1, 64)
    for implementation in (None, "cuda"):
        fn = lambda q, k, v: flash_attention(q, k, v, implementation=implementation)  # noqa: E731
        assert "jax_fa3_fwd_fp8" in jax.jit(fn).lower(q8, k8, v8).as_text(), implementation
    q8, qd, k8, kd, v8, vd = _fp8_inputs(3, 1, 64, 64, 2, 1, 64, granularity="block", rows=16)
    fn = lambda q, k, v, kd: flash_attention(q, k, v, k_descale=kd, descale_block_rows=16)
    assert "jax_fa3_fwd_fp8" not in jax.jit(fn).lower(q8, k8, v8, kd).as_text()
    with pytest.raises(ValueError, match="descale_block_rows"):
        flash_attention(q8, k8, v8, k_descale=kd, descale_block_rows=16, implementation="cuda")


def test_vmap_folds_into_one_launch():
    _need(128)
    stack = [_fp8_inputs(40 + i, 1, 129, 200, 2, 1, 128) for i in range(3)]
    args = [jnp.stack([s[j] for s in stack]) for j in range(6)]
    fn = lambda q, qd, k, kd, v, vd: flash_attention(q, k, v, q_descale=qd, k_descale=kd,
                                                     v_descale=vd, causal=True,
                                                     implementation="cuda", return_lse=True)
    out, lse = jax.device_get(jax.jit(jax.vmap(fn))(*args))
    for i, s in enumerate(stack):
        o1, l1 = jax.device_get(jax.jit(fn)(*s))
        np.testing.assert_array_equal(np.asarray(out[i], np.float32), np.asarray(o1, np.float32))
        np.testing.assert_array_equal(lse[i], l1)
