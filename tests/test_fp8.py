"""FP8 (e4m3) forward (issue 28), CPU: quantization round trips, the Hadamard rotation, descale
validation, and flash_attention with float8_e4m3fn inputs on the portable path against the
float64 oracle of the DEQUANTIZED inputs (tests/helpers.py), with a bound derived from e4m3's
precision (`fp8_bound`).

The FP8 kernel's GPU tests are tests/test_fp8_gpu.py; here, what implementation="cuda" says
where it cannot run, and the portable emulation of the kernel's key blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa3
from helpers import assert_finite, reference_f64, resolve_band, segment_mask, band_mask
from jax_fa3 import flash_attention, flash_attention_fp8, quantize_fp8

F8, BF16, F16, F32 = jnp.float8_e4m3fn, jnp.bfloat16, jnp.float16, jnp.float32
# e4m3: 3 mantissa bits, so round-to-nearest is off by at most half an ulp, 2^-4 of the value,
# down to the smallest normal 2^-6; below it the spacing is 2^-9, half of it 2^-10.
E4M3_REL, E4M3_SUBNORMAL_ABS = 2.0 ** -4, 2.0 ** -10


def _normal(seed, shape, scale=1.0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * scale


def _expand(descale, shape, block_rows):
    """numpy: a descale of any granularity broadcast to x's (b, s, h, d) (written here, not
    taken from jax_fa3)."""
    b, s, h, _ = shape
    descale = np.asarray(descale, np.float64)
    if descale.ndim == 0:
        return descale
    if descale.ndim == 2:
        return np.broadcast_to(descale[:, None, :, None], (b, 1, h, 1))
    return np.repeat(descale, block_rows, axis=2)[:, :, :s].transpose(0, 2, 1)[..., None]


def _dequant(x8, descale, block_rows=64):
    return np.asarray(x8).astype(np.float64) * _expand(descale, x8.shape, block_rows)


# ----------------------------------------------------------------------------- quantization

@pytest.mark.parametrize("granularity", ["tensor", "head", "block"])
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_quantize_round_trip(granularity, dtype):
    shape, rows = (2, 100, 3, 32), 16  # 100 tokens: a ragged last block of 4
    x = jnp.asarray(_normal(0, shape, 3.0), dtype)
    x8, descale = jax.jit(lambda x: quantize_fp8(x, granularity=granularity,
                                                 block_rows=rows))(x)
    expected = {"tensor": (), "head": (2, 3), "block": (2, 3, 7)}[granularity]
    assert x8.dtype == F8 and x8.shape == shape
    assert descale.dtype == F32 and descale.shape == expected
    x64 = np.asarray(x).astype(np.float64)
    d = _expand(descale, shape, rows)
    # Per element: |x - deq| <= 2^-4 |x| in e4m3's normal range, else 2^-10 * descale.
    err = np.abs(_dequant(x8, descale, rows) - x64)
    bound = np.maximum(E4M3_REL * np.abs(x64), E4M3_SUBNORMAL_ABS * d) * (1 + 1e-6)
    assert (err <= bound).all(), float((err / bound).max())
    # Each slice's amax lands on 448, e4m3's largest finite value.
    assert float(np.abs(np.asarray(x8).astype(np.float32)).max()) == 448.0
    np.testing.assert_allclose(_dequant(x8, descale, rows), x64, rtol=0.07, atol=0.01)
    dq = jax_fa3.dequantize_fp8(x8, descale, block_rows=rows)
    np.testing.assert_allclose(np.asarray(dq), _dequant(x8, descale, rows), rtol=1e-6)


@pytest.mark.parametrize("granularity", ["tensor", "head", "block"])
def test_quantize_zero_slices_and_saturation(granularity):
    x = np.zeros((1, 8, 2, 16), np.float32)
    x[0, 0, 0, 0] = 1e30  # head 0 / block 0 holds a huge value: no inf, no NaN
    x[0, 1, 0, 1] = -3.0
    x8, descale = quantize_fp8(jnp.asarray(x), granularity=granularity, block_rows=4)
    x8 = np.asarray(x8).astype(np.float32)
    descale = np.asarray(descale)
    assert np.isfinite(x8).all() and np.isfinite(descale).all() and (descale > 0).all()
    assert x8[0, 0, 0, 0] == 448.0
    if granularity != "tensor":  # head 1 (and block 1) is all zero: descale 1, zeros
        assert (descale.reshape(-1) == 1.0).sum() >= 1
        assert (x8[0, :, 1] == 0).all()
    zero8, zero_descale = quantize_fp8(jnp.zeros((1, 4, 1, 8)), granularity=granularity)
    assert (np.asarray(zero_descale) == 1.0).all()
    assert (np.asarray(zero8).astype(np.float32) == 0).all()


def test_quantize_rejects_bad_input():
    x = jnp.ones((1, 4, 2, 8))
    with pytest.raises(ValueError, match="granularity"):
        quantize_fp8(x, granularity="row")
    with pytest.raises(ValueError, match="block_rows"):
        quantize_fp8(x, granularity="block", block_rows=0)
    with pytest.raises(ValueError, match="x must have rank 4"):
        quantize_fp8(jnp.ones((4, 2, 8)))
    with pytest.raises(TypeError, match="x must be a bfloat16, float16 or float32"):
        quantize_fp8(x.astype(F8))
    with pytest.raises(ValueError, match="power of two"):
        quantize_fp8(jnp.ones((1, 4, 2, 48)), hadamard_key=jax.random.key(0))
    with pytest.raises(TypeError, match="hadamard_key"):
        quantize_fp8(x, hadamard_key=3)


# ----------------------------------------------------------------------------- Hadamard

def _sylvester(d):
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h


@pytest.mark.parametrize("d", [1, 2, 64, 128, 256])
def test_hadamard_is_orthogonal_and_keeps_qk(d):
    key = jax.random.key(7)
    eye = jnp.eye(d, dtype=F32).reshape(1, d, 1, d)  # rows e_i: the rotation's matrix M
    m = np.asarray(jax_fa3.hadamard_rotate(eye, key)).reshape(d, d).astype(np.float64)
    np.testing.assert_allclose(m @ m.T, np.eye(d), atol=1e-6)
    # M = diag(s) H / sqrt(d) with H the Sylvester-Hadamard matrix and s = +-1
    signs = np.round(m[:, 0] * np.sqrt(d))
    assert set(np.unique(signs)) <= {-1.0, 1.0}
    np.testing.assert_allclose(m, signs[:, None] * _sylvester(d) / np.sqrt(d), atol=1e-6)
    q, k = jnp.asarray(_normal(1, (2, 9, 3, d))), jnp.asarray(_normal(2, (2, 11, 3, d)))
    qr, kr = jax_fa3.hadamard_rotate(q, key), jax_fa3.hadamard_rotate(k, key)
    hi = jax.lax.Precision.HIGHEST
    before = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=hi)
    after = jnp.einsum("bqhd,bkhd->bhqk", qr, kr, precision=hi)
    np.testing.assert_allclose(np.asarray(after), np.asarray(before), rtol=0,
                               atol=2e-6 * np.sqrt(d) * 4)


def test_hadamard_spreads_an_outlier_channel():
    """The reason for incoherent processing: one huge channel becomes d moderate ones."""
    x = np.zeros((1, 1, 1, 128), np.float32)
    x[..., 5] = 100.0
    r = np.asarray(jax_fa3.hadamard_rotate(jnp.asarray(x), jax.random.key(0)))
    np.testing.assert_allclose(np.abs(r), 100.0 / np.sqrt(128), rtol=1e-6)


def test_quantize_with_hadamard_key_describes_the_rotated_input():
    key = jax.random.key(3)
    x = jnp.asarray(_normal(4, (1, 20, 2, 64)))
    x8, descale = quantize_fp8(x, granularity="head", hadamard_key=key)
    rotated = np.asarray(jax_fa3.hadamard_rotate(x, key)).astype(np.float64)
    err = np.abs(_dequant(x8, descale) - rotated)
    bound = np.maximum(E4M3_REL * np.abs(rotated), E4M3_SUBNORMAL_ABS * _expand(
        descale, x.shape, 64)) * (1 + 1e-6)
    assert (err <= bound).all()


# ----------------------------------------------------------------------------- the forward

def fp8_bound(q, k, v, out_dtype, sinks=None, **opts):
    """Per-element bound of |out - oracle| for the FP8 path, the oracle being float64 attention
    of the dequantized inputs (numpy float64 arrays here).

    The scores and the row sums are float32 (the products of e4m3 values are exact), so the
    one coarse rounding is P to e4m3 before P v. With p_j the exact probabilities and the
    kernel's P_j = c p_j, c >= 2^8 (the max offset: the row max maps to 256, and a running max
    is never above the final one), e4m3 rounds each P_j within 2^-4 P_j (normal range) or
    2^-10 absolute (subnormals), i.e. p_j within 2^-4 p_j + 2^-18. Since out = sum_j P~_j v_j
    / sum_j P_j with the UNquantized sum:

        |out - ref| <= 2^-4 sum_j p_j |v_j| + 2^-18 sum_{j visible} |v_j| + ulp(out dtype)/2 |ref|

    plus float32 slack. Returns that bound (b, sq, hq, dv)."""
    hq = q.shape[2]
    vv = np.repeat(np.abs(v), hq // v.shape[2], axis=2)  # (b, sk, hq, dv)
    ref, _ = reference_f64(q, k, v, sinks=sinks, **opts)
    # probabilities: the oracle with one-hot values would be costly; recompute them here
    p = _probs(q, k, sinks=sinks, **opts)  # (b, hq, sq, sk)
    visible = (p > 0).astype(np.float64)
    bound = (E4M3_REL * np.einsum("bhqk,bkhd->bqhd", p, vv)
             + 2.0 ** -18 * np.einsum("bhqk,bkhd->bqhd", visible, vv))
    out_half_ulp = float(jnp.finfo(out_dtype).eps) / 2
    return bound + out_half_ulp * np.abs(ref) + 1e-5 * (1 + vv.max()), ref


def _weight(q, k, v, **opts):
    """sum_j p_j |v_j| per output element (b, sq, hq, dv), float64: the scale of the FP8
    path's errors (P rounded to e4m3 moves each term by a fraction of p_j |v_j|)."""
    hq = q.shape[2]
    p = _probs(q, k, **opts)
    return np.einsum("bhqk,bkhd->bqhd", p, np.repeat(np.abs(v), hq // v.shape[2], axis=2))


def _probs(q, k, sinks=None, softmax_scale=None, causal=False, window_size=(-1, -1),
           softcap=0.0, segments=None):
    """float64 softmax probabilities (b, hq, sq, sk) of the oracle's rule."""
    hq, d = q.shape[2], q.shape[3]
    kk = np.repeat(k, hq // k.shape[2], axis=2)
    scale = 1 / np.sqrt(d) if softmax_scale is None else softmax_scale
    s = np.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    if softcap:
        s = softcap * np.tanh(s / softcap)
    left, right = resolve_band(causal=causal, window_size=window_size)
    if segments is None:
        ok = band_mask(q.shape[1], k.shape[1], left, right)[None, None]
    else:
        ok = segment_mask(segments, q.shape[1], k.shape[1], left, right)
    s = np.where(ok, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    if sinks is not None:
        m = np.maximum(m, np.asarray(sinks, np.float64)[None, :, None, None])
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.where(ok, np.exp(s - m), 0.0)
    l = e.sum(-1, keepdims=True)
    if sinks is not None:
        l = l + np.exp(np.asarray(sinks, np.float64)[None, :, None, None] - m)
    return e / np.where(l > 0, l, 1.0)


def _fp8_inputs(seed, b, sq, sk, hq, hkv, d, dv=None, q_scale=2.0, granularity="head",
                rows=16):
    """Quantized q, k, v (with varied magnitudes: per-head scales spread over 1e-2..1e2, so
    the descales matter) and their descales."""
    dv = d if dv is None else dv
    mags = lambda s, h: 10.0 ** np.random.default_rng(s).uniform(-2, 2, (1, 1, h, 1))
    q = _normal(seed, (b, sq, hq, d), q_scale)
    k = _normal(seed + 1, (b, sk, hkv, d))
    v = _normal(seed + 2, (b, sk, hkv, dv)) * mags(seed + 3, hkv)
    out = []
    for x in (q, k, v):
        out += list(quantize_fp8(jnp.asarray(x), granularity=granularity, block_rows=rows))
    return out  # q8, qd, k8, kd, v8, vd


def _check_fp8(name, q8, qd, k8, kd, v8, vd, rows, out, lse, out_dtype=BF16, sinks=None,
               **opts):
    q, k, v = _dequant(q8, qd, rows), _dequant(k8, kd, rows), _dequant(v8, vd, rows)
    assert out.dtype == out_dtype
    assert_finite(f"{name} out", out)
    assert_finite(f"{name} lse", lse, allow_neg_inf=True)
    bound, ref = fp8_bound(q, k, v, out_dtype, sinks=sinks, **opts)
    err = np.abs(np.asarray(out).astype(np.float64) - ref)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound).all(), (f"{name}: error {err[worst]:.3e} > bound {bound[worst]:.3e} "
                                  f"at {worst}")
    _, ref_lse = reference_f64(q, k, v, sinks=sinks, **opts)
    lse = np.asarray(lse).astype(np.float64)
    assert (np.isneginf(lse) == np.isneginf(ref_lse)).all(), f"{name}: -inf rows of lse differ"
    fin = np.isfinite(ref_lse)
    # The lse takes the unquantized row sums: float32 rounding only.
    np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=0, atol=1e-5 * (1 + np.abs(
        ref_lse[fin]).max()), err_msg=name)
    return float(err.max())


CASES = [  # (name, (b, sq, sk, hq, hkv, d, dv), granularity, options)
    ("plain", (2, 17, 17, 2, 2, 64, 64), "head", {}),
    ("causal gqa sq<sk", (2, 40, 70, 8, 2, 64, 64), "head", dict(causal=True)),
    ("causal sq>sk", (1, 70, 40, 4, 4, 32, 32), "tensor", dict(causal=True)),
    ("window softcap", (1, 129, 129, 4, 2, 64, 64), "block", dict(window_size=(9, 3),
                                                                   softcap=6.0)),
    ("mqa window-left", (2, 33, 100, 4, 1, 128, 128), "block", dict(causal=True,
                                                                     window_size=(5, -1))),
    ("scale fp16 out", (1, 1, 127, 2, 1, 64, 32), "head", dict(softmax_scale=0.3,
                                                                out_dtype=F16)),
    ("sinks", (2, 30, 50, 4, 2, 64, 64), "block", dict(causal=True, sinks="random")),
    ("segments", (2, 48, 48, 4, 2, 64, 64), "head", dict(causal=True, segments="random")),
]


def _options(opts, b, sq, sk, hq):
    opts = dict(opts)
    if opts.get("sinks") == "random":
        opts["sinks"] = jnp.asarray(_normal(9, (hq,), 2.0) + 1.0)
    if opts.get("segments") == "random":
        ids = np.sort(np.random.default_rng(5).integers(0, 4, (b, sq)), axis=1).astype(np.int32)
        opts["segments"] = (ids, ids)
    return opts


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_fp8_forward_matches_oracle(case):
    name, (b, sq, sk, hq, hkv, d, dv), granularity, opts = case
    rows = 16
    q8, qd, k8, kd, v8, vd = _fp8_inputs(1, b, sq, sk, hq, hkv, d, dv, granularity=granularity,
                                         rows=rows)
    opts = _options(opts, b, sq, sk, hq)
    out_dtype = opts.pop("out_dtype", BF16)
    segments = opts.pop("segments", None)
    seg_kw = {} if segments is None else dict(q_segment_ids=segments[0],
                                              kv_segment_ids=segments[1])
    block_kw = dict(descale_block_rows=rows) if granularity == "block" else {}
    run = jax.jit(lambda *a: flash_attention(
        a[0], a[2], a[4], q_descale=a[1], k_descale=a[3], v_descale=a[5], return_lse=True,
        out_dtype=out_dtype, **block_kw, **seg_kw, **opts))
    out, lse = run(q8, qd, k8, kd, v8, vd)
    assert out.shape == (b, sq, hq, dv) and lse.shape == (b, hq, sq) and lse.dtype == F32
    _check_fp8(name, q8, qd, k8, kd, v8, vd, rows, out, lse, out_dtype,
               segments=segments, **opts)


def test_descale_shapes_per_query_head_and_fa3_kv_head():
    """q_descale per query head (quantize_fp8's "head" on q) or per kv head (FA3's rule); per
    block over kv heads too; a missing descale is 1."""
    b, sq, sk, hq, hkv, d = 2, 20, 30, 4, 2, 64
    q8, qd, k8, kd, v8, vd = _fp8_inputs(2, b, sq, sk, hq, hkv, d)
    assert qd.shape == (b, hq)
    out, lse = flash_attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                               return_lse=True)
    _check_fp8("per q head", q8, qd, k8, kd, v8, vd, 64, out, lse)
    qd_kv = qd.reshape(b, hkv, hq // hkv)[..., 0]  # one factor per kv head group
    out, lse = flash_attention(q8, k8, v8, q_descale=qd_kv, k_descale=kd, return_lse=True)
    _check_fp8("per kv head, no v_descale", q8, np.repeat(qd_kv, 2, axis=1), k8, kd, v8, 1.0,
               64, out, lse)
    qb = jnp.asarray(np.random.default_rng(0).uniform(0.5, 2, (b, hkv, 3)), F32)
    out, lse = flash_attention(q8, k8, v8, q_descale=qb, descale_block_rows=8, return_lse=True)
    _check_fp8("q per block per kv head", q8, np.repeat(qb, 2, axis=1), k8, 1.0, v8, 1.0, 8,
               out, lse)


def test_fully_masked_rows_are_zero_without_nan():
    b, sq, sk, hq, hkv, d = 1, 12, 12, 2, 1, 32
    q8, qd, k8, kd, v8, vd = _fp8_inputs(3, b, sq, sk, hq, hkv, d)
    ids = np.array([[1, 1, 0, 0, 2, 2, 2, 0, 3, 3, 0, 0]], np.int32)  # 0 = padding
    out, lse = flash_attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                               q_segment_ids=ids, return_lse=True)
    assert_finite("out", out)
    pad = ids[0] == 0
    assert (np.asarray(out, np.float32)[0, pad] == 0).all()
    assert np.isneginf(np.asarray(lse)[0][:, pad]).all()
    assert np.isfinite(np.asarray(lse)[0][:, ~pad]).all()
    sinks = jnp.array([0.5, -jnp.inf], F32)  # a sink row: lse = the sink; -inf: no sink
    out, lse = flash_attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                               q_segment_ids=ids, sinks=sinks, return_lse=True)
    assert_finite("out with sinks", out)
    np.testing.assert_allclose(np.asarray(lse)[0, 0, pad], 0.5, rtol=1e-6)
    assert np.isneginf(np.asarray(lse)[0, 1, pad]).all()
    # sq > sk with causal: the first rows see no key
    out, lse = flash_attention(q8, k8[:, :5], v8[:, :5], causal=True, return_lse=True)
    assert_finite("causal out", out)
    assert (np.asarray(out, np.float32)[0, :7] == 0).all()
    assert np.isneginf(np.asarray(lse)[0][:, :7]).all()


def test_empty_inputs():
    q8 = jnp.zeros((1, 0, 2, 32), F8)
    k8 = jnp.zeros((1, 5, 2, 32), F8)
    out = flash_attention(q8, k8, k8, q_descale=jnp.ones((1, 2)))
    assert out.shape == (1, 0, 2, 32) and out.dtype == BF16
    out, lse = flash_attention(k8, q8, q8, return_lse=True)
    assert (np.asarray(out, np.float32) == 0).all() and np.isneginf(np.asarray(lse)).all()


def test_jit_and_vmap():
    b, sq, sk, hq, hkv, d = 2, 16, 24, 2, 1, 32
    stacks = [_fp8_inputs(10 + i, b, sq, sk, hq, hkv, d) for i in range(3)]
    stacked = [jnp.stack(xs) for xs in zip(*stacks)]

    def f(q8, qd, k8, kd, v8, vd):
        return flash_attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                               causal=True, return_lse=True)

    out, lse = jax.jit(jax.vmap(f))(*stacked)
    for i, xs in enumerate(stacks):
        o, l = jax.jit(f)(*xs)
        np.testing.assert_array_equal(np.asarray(out[i], np.float32), np.asarray(o, np.float32))
        np.testing.assert_allclose(np.asarray(lse[i]), np.asarray(l), rtol=1e-6)
    # the descales alone batched (one tensor, several scales): out is linear in v's descale
    vds = jnp.asarray([1.0, 2.0], F32)
    outs = jax.vmap(lambda vd: flash_attention(stacks[0][0], stacks[0][2], stacks[0][4],
                                               v_descale=vd, out_dtype="float16"))(vds)
    np.testing.assert_allclose(np.asarray(outs[1], np.float32),
                               2 * np.asarray(outs[0], np.float32), rtol=2e-3, atol=1e-6)


@pytest.mark.parametrize("granularity", ["tensor", "head", "block"])
@pytest.mark.parametrize("incoherent", [False, True])
def test_flash_attention_fp8_convenience(granularity, incoherent):
    """Quantize-inside equals quantize_fp8 + flash_attention, and is close to bf16 attention."""
    b, sq, sk, hq, hkv, d = 1, 40, 40, 4, 2, 64
    q, k, v = (jnp.asarray(_normal(20 + i, (b, s, h, d)), BF16)
               for i, (s, h) in enumerate(((sq, hq), (sk, hkv), (sk, hkv))))
    key = jax.random.key(1)
    kw = dict(granularity=granularity, block_rows=16)
    run = jax.jit(lambda q, k, v: flash_attention_fp8(q, k, v, incoherent=incoherent,
                                                      key=key if incoherent else None,
                                                      causal=True, return_lse=True, **kw))
    out, lse = run(q, k, v)
    hk = key if incoherent else None
    q8, qd = quantize_fp8(q, hadamard_key=hk, **kw)
    k8, kd = quantize_fp8(k, hadamard_key=hk, **kw)
    v8, vd = quantize_fp8(v, **kw)
    rows = 16 if granularity == "block" else None
    o2, l2 = flash_attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                             descale_block_rows=rows, causal=True, return_lse=True)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(o2, np.float32),
                               atol=1e-2)
    _check_fp8("fp8 convenience", q8, qd, k8, kd, v8, vd, 16, out, lse, causal=True)
    ref = flash_attention(q, k, v, causal=True).astype(F32)
    rmse = float(jnp.sqrt(jnp.mean((out.astype(F32) - ref) ** 2)))
    assert rmse < 0.03, rmse  # FP8 on N(0, 1) inputs: RMSE ~1e-2


# ----------------------------------------------------------------------------- errors

Q8, K8 = jnp.zeros((2, 16, 4, 32), F8), jnp.zeros((2, 24, 2, 32), F8)


@pytest.mark.parametrize("case", [
    ("q_descale", dict(q_descale=jnp.ones((2, 3))), ValueError, ["q_descale", "(2, 3)", "(2, 2)",
                                                                 "(2, 4)"]),
    ("k_descale per q head", dict(k_descale=jnp.ones((2, 4))), ValueError,
     ["k_descale", "(2, 4)"]),
    ("v_descale rank 1", dict(v_descale=jnp.ones((2,))), ValueError, ["v_descale", "(2,)"]),
    ("block without rows", dict(k_descale=jnp.ones((2, 2, 3))), ValueError,
     ["k_descale", "descale_block_rows"]),
    ("block count", dict(k_descale=jnp.ones((2, 2, 3)), descale_block_rows=16), ValueError,
     ["k_descale", "(2, 2, 2)", "(2, 2, 3)"]),
    ("integer descale", dict(q_descale=jnp.ones((), jnp.int32)), TypeError,
     ["q_descale", "float32", "int32"]),
    ("out_dtype f32", dict(out_dtype=F32), ValueError, ["out_dtype", "float32"]),
    ("out_dtype junk", dict(out_dtype="bf16x"), TypeError, ["out_dtype", "bf16x"]),
    ("rows 0", dict(descale_block_rows=0), ValueError, ["descale_block_rows", "0"]),
], ids=lambda c: c[0])
def test_fp8_argument_errors(case):
    _, kw, exc, fragments = case
    with pytest.raises(exc) as err:
        jax.eval_shape(lambda q, k: flash_attention(q, k, k, **kw), Q8, K8)
    for fragment in fragments:
        assert fragment in str(err.value), f"{fragment!r} not in: {err.value}"


@pytest.mark.parametrize("name", ["q_descale", "k_descale", "v_descale", "out_dtype",
                                  "descale_block_rows"])
def test_fp8_arguments_need_fp8_inputs(name):
    x = jnp.zeros((1, 8, 2, 32), BF16)
    value = {"out_dtype": "bfloat16", "descale_block_rows": 8}.get(name, jnp.ones(()))
    with pytest.raises(ValueError, match=f"{name} is for float8_e4m3fn inputs only"):
        flash_attention(x, x, x, **{name: value})


def test_fp8_dtype_errors():
    x8, xb = jnp.zeros((1, 8, 2, 32), F8), jnp.zeros((1, 8, 2, 32), BF16)
    with pytest.raises(TypeError, match="k has dtype bfloat16 but q has dtype float8_e4m3fn"):
        flash_attention(x8, xb, x8)
    e5 = x8.astype(jnp.float8_e5m2)
    with pytest.raises(TypeError, match="float8_e4m3fn .e4m3. only"):
        flash_attention(e5, e5, e5)
    with pytest.raises(TypeError, match="query has dtype float8_e4m3fn"):
        jax_fa3.dot_product_attention(x8, x8, x8)
    with pytest.raises(TypeError, match="already float8_e4m3fn"):
        flash_attention_fp8(x8, x8, x8)
    with pytest.raises(TypeError, match="computes .*q_descale"):
        flash_attention_fp8(xb, xb, xb, q_descale=jnp.ones(()))
    with pytest.raises(ValueError, match="incoherent=True"):
        flash_attention_fp8(xb, xb, xb, key=jax.random.key(0))
    with pytest.raises(ValueError, match="power of two"):
        y = jnp.zeros((1, 8, 2, 48), BF16)
        flash_attention_fp8(y, y, y, incoherent=True)


def test_fp8_cuda_names_what_the_kernel_cannot_take():
    """implementation='cuda' raises naming each reason: the machine (no GPU or build here), and
    what the FP8 kernel does not take (per-block descales, sinks, segment ids, head dims that
    are not multiples of 16); None runs those on the portable path."""
    blocks = jnp.ones((2, 2, 2))
    cases = [
        (dict(k_descale=blocks, descale_block_rows=16), "descale_block_rows"),
        (dict(sinks=jnp.zeros((4,))), "sinks"),
        (dict(q_segment_ids=jnp.ones((2, 16), jnp.int32),
              kv_segment_ids=jnp.ones((2, 24), jnp.int32)), "segment ids"),
    ]
    for kw, fragment in cases:
        with pytest.raises((RuntimeError, ValueError)) as err:
            jax.eval_shape(lambda q, k: flash_attention(q, k, k, implementation="cuda", **kw),
                           Q8, K8)
        assert "implementation='cuda'" in str(err.value) and fragment in str(err.value)
        text = jax.jit(lambda q, k: flash_attention(q, k, k, **kw)).lower(Q8, K8).as_text()
        assert "jax_fa3_fwd" not in text  # neither kernel target: the portable FP8 path
    assert jax_fa3._validate.kernel_input_reason(F8, 128) is None
    assert "multiple of 16" in jax_fa3._validate.kernel_input_reason(F8, 40)
    if jax_fa3._ffi.extension_reason() is not None:  # no kernel here: "cuda" says why
        with pytest.raises(RuntimeError, match="implementation='cuda'"):
            jax.eval_shape(lambda q, k: flash_attention(q, k, k, implementation="cuda"), Q8, K8)
    for impl in (None, "xla"):  # never the bf16 kernels' custom call
        text = jax.jit(lambda q, k: flash_attention(q, k, k, implementation=impl)).lower(
            Q8, K8).as_text()
        assert "@jax_fa3_fwd(" not in text
        if impl == "xla" or jax_fa3._ffi.extension_reason() is not None:
            assert "jax_fa3_fwd_fp8" not in text


@pytest.mark.parametrize("causal", [False, True])
def test_kernel_blocks_emulation_is_the_same_attention(causal):
    """portable_fp8 on the kernel's key blocks (aligned, last to first) computes the same
    attention, within the FP8 bound; only where P is rounded moves."""
    from jax_fa3 import portable_fp8
    b, sq, sk, hq, hkv, d = 1, 50, 200, 2, 1, 64
    q8, qd, k8, kd, v8, vd = _fp8_inputs(6, b, sq, sk, hq, hkv, d)
    kw = dict(softmax_scale=d ** -0.5, right=0 if causal else jax_fa3._masks.UNBOUNDED)
    out, lse = portable_fp8.forward(q8, k8, v8, (qd, kd, vd), block_k=64, kernel_blocks=True,
                                    **kw)
    opts = dict(causal=causal)
    _check_fp8("kernel blocks", q8, qd, k8, kd, v8, vd, 64, out, lse, **opts)


def test_fp8_is_not_differentiable():
    b, s, h, d = 1, 8, 2, 32
    x = jnp.asarray(_normal(0, (b, s, h, d)), BF16)
    loss = lambda q: flash_attention_fp8(q, x, x).astype(F32).sum()
    with pytest.raises(NotImplementedError, match="forward-only"):
        jax.grad(loss)(x)
    with pytest.raises(NotImplementedError, match="forward-only"):
        jax.jvp(loss, (x,), (x,))
    q8, qd = quantize_fp8(x)
    with pytest.raises(NotImplementedError, match="forward-only"):  # through a descale
        jax.grad(lambda qd: flash_attention(q8, q8, q8, q_descale=qd).astype(F32).sum())(qd)
    with pytest.raises(NotImplementedError, match="forward-only"):  # through the sinks
        jax.grad(lambda s: flash_attention(q8, q8, q8, sinks=s).astype(F32).sum())(
            jnp.zeros((h,)))
    # Stopping the gradient at the inputs is fine: the FP8 call is then a constant.
    grad = jax.grad(lambda q: flash_attention_fp8(jax.lax.stop_gradient(q), x, x)
                    .astype(F32).sum() + q.astype(F32).sum())(x)
    assert (np.asarray(grad, np.float32) == 1).all()


def test_accuracy_script_smoke(tmp_path):
    """benchmarks/fp8_accuracy.py on a tiny problem: every variant, files written, and the
    ordering the study is about (bf16 < block + incoherent < per-tensor)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import fp8_accuracy
    rows = fp8_accuracy.main(["--seqlen", "128", "--heads", "2", "--head-dim", "64",
                              "--outlier-frac", "0.01", "--out", str(tmp_path), "--name", "t"])
    assert set(rows) == set(fp8_accuracy.VARIANTS)
    assert rows["bf16"]["rmse"] < rows["fp8 block + incoherent"]["rmse"] < \
        rows["fp8 per-tensor"]["rmse"]
    assert (tmp_path / "t.json").exists() and "| fp8 block |" in (tmp_path / "t.md").read_text()
