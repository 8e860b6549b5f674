"""GPU tests of the Hopper forward kernel (cpp/kernels/fwd) against the float64 oracle.

Every check uses the error-ratio rule of docs/architecture.md (tests/helpers.py): the kernel's max error
against float64 must be at most 2x that of plain attention computed in the input dtype, plus
one ulp of slack; LSE likewise (fp32 in both). Fully masked rows must give out == 0 exactly and
lse == -inf. XLA allocates the outputs, so "poisoned outputs" is checked as: no NaN/Inf
anywhere and agreement with the oracle on fresh random data for every element.

The kernel is reached through jax_fa3._ops.fwd (the FFI call, masks as normalised bands) and
through the public jax_fa3.flash_attention(..., implementation="cuda").
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from jax_fa3 import _ffi, _masks, _ops

pytestmark = pytest.mark.gpu

UNB = _masks.UNBOUNDED

_next_key = helpers.key_stream(20261130)


def _need(dtype, head_dim):
    helpers.skip_unless_kernel("fwd", dtype, head_dim)


def _kernel(q, k, v, left, right, softcap=0.0, scale=None):
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    return _ops.fwd(q, k, v, softmax_scale=scale, softcap=softcap, window_left=left,
                    window_right=right)


def _check(b, sq, sk, hq, hkv, d, dtype, left=UNB, right=UNB, softcap=0.0, scale=None,
           logit_scale=1.0):
    _need(dtype, d)
    q, k, v = helpers.random_qkv(_next_key(), b, sq, sk, hq, hkv, d, dtype, scale=logit_scale)
    out, lse = _kernel(q, k, v, left, right, softcap, scale)
    out, lse = jax.device_get((out, lse))
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (b, hq, sq) and lse.dtype == np.float32
    opts = dict(left=left, right=right, softcap=softcap, softmax_scale=scale)
    ref_out, ref_lse = helpers.reference_f64(q, k, v, **opts)
    base_out, base_lse = helpers.plain_in_dtype(q, k, v, return_lse=True, **opts)
    helpers.assert_finite("out", out)
    helpers.assert_finite("lse", lse, allow_neg_inf=True)
    helpers.assert_error_ratio("out", out, ref_out, base_out)
    helpers.assert_error_ratio("lse", lse, ref_lse, base_lse)
    # Rows that see no key: exactly zero output.
    empty = ~np.isfinite(ref_lse)  # (b, hq, sq)
    if empty.any():
        o = np.asarray(out, np.float32).transpose(0, 2, 1, 3)[empty]
        assert (o == 0).all(), "fully masked rows must give out == 0"
    return out, lse


# --------------------------------------------------------------------------- head dim x dtype

@pytest.mark.parametrize("d", helpers.KERNEL_HEAD_DIMS)
@pytest.mark.parametrize("dtype", helpers.KERNEL_DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq,sk", [(129, 129), (1000, 127), (17, 1000)])
def test_head_dims(d, dtype, causal, sq, sk):
    left, right = _masks.band(causal, (-1, -1))
    _check(2, sq, sk, 2, 1, d, dtype, left, right)


# --------------------------------------------------------------------------- seqlens (hd 128)

SEQLENS = (1, 17, 127, 128, 129, 1000)


# 176 and 353: the unmasked d=128 tile is 128 x 176 (exact and ragged key blocks).
@pytest.mark.parametrize("sq,sk", [(s, s) for s in SEQLENS] + [(1, 1000), (1000, 1), (129, 17),
                                                                 (127, 1000), (1000, 129),
                                                                 (176, 176), (300, 353)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_seqlens(sq, sk, causal):
    left, right = _masks.band(causal, (-1, -1))
    _check(1, sq, sk, 3, 3, 128, jnp.bfloat16, left, right)


# d = 64 unmasked problems run 192 x 128 tiles with three consumer warpgroups (round-robin
# turn order): query lengths around the 64-row slabs and the 192-row tile (fully out-of-range
# slabs at 1 and 65, ragged last tiles at 193 and 577), key lengths at 1, 2 and 3+ key blocks
# of 128 (the rotated main loop: tail of block n+1, then head of block n). Causal cases run the
# banded 128 x 128 tile of the same head dim.
@pytest.mark.parametrize("sq,sk", [(1, 1), (65, 65), (191, 191), (192, 192), (193, 193),
                                   (577, 577), (193, 129), (1, 385), (577, 64), (384, 257)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_seqlens_d64(sq, sk, causal):
    left, right = _masks.band(causal, (-1, -1))
    _check(2, sq, sk, 4, 2, 64, jnp.bfloat16, left, right)


@pytest.mark.parametrize("softcap", [0.0, 5.0])
@pytest.mark.parametrize("hq,hkv", [(6, 6), (8, 1)], ids=["mha", "mqa"])
def test_d64_softcap_gqa(softcap, hq, hkv):
    _check(2, 400, 333, hq, hkv, 64, jnp.float16, softcap=softcap, logit_scale=8.0)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_long_ragged(causal):
    left, right = _masks.band(causal, (-1, -1))
    _check(1, 4097, 4097, 1, 1, 64 if _ffi.unavailable_reason("fwd", jnp.bfloat16, 64) is None
           else 128, jnp.bfloat16, left, right)


# --------------------------------------------------------------------------- GQA / MQA / batch

@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (16, 2), (8, 1)], ids=["mha", "gqa2", "gqa8", "mqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gqa(hq, hkv, causal):
    left, right = _masks.band(causal, (-1, -1))
    _check(3, 200, 333, hq, hkv, 128, jnp.bfloat16, left, right)


# --------------------------------------------------------------------------- bands

@pytest.mark.parametrize("window", [(32, 0), (64, 16), (-1, 40), (100, -1), (0, 0)])
@pytest.mark.parametrize("sq,sk", [(300, 300), (130, 515), (515, 130)])
def test_windows(window, sq, sk):
    left, right = _masks.band(False, window)
    _check(2, sq, sk, 2, 2, 128, jnp.bfloat16, left, right)


# Shifted bands as ring attention produces them: negative bounds, bands wholly outside the key
# range (every row empty), bands beyond the seqlens, rows with and without keys in one tile.
@pytest.mark.parametrize("left,right", [
    (-10, 50), (100, -50), (-200, -150), (300, 290), (UNB, -140), (-140, UNB), (5, -3),
    (UNB, -1000), (-1000, UNB), (0, UNB), (UNB, 0), (2000, 2000)])
def test_shifted_bands(left, right):
    _check(1, 257, 300, 2, 1, 128, jnp.bfloat16, left, right)


# More tiles than SMs under a band, so that a persistent CTA runs several tiles (the dynamic
# schedule of banded problems, kFwdDynamicBanded), including tiles without any key (the band
# shifted past the start of the key range leaves the first query blocks empty).
@pytest.mark.parametrize("left,right", [(UNB, 0), (256, 0), (UNB, -700)], ids=["causal", "local", "shifted"])
@pytest.mark.parametrize("d", [64, 128])
def test_many_tiles_banded(left, right, d):
    _check(2, 1100, 1100, 16, 4, d, jnp.bfloat16, left, right)


# --------------------------------------------------------------------------- softcap, scales

@pytest.mark.parametrize("softcap", [0.0, 5.0, 30.0])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_softcap_large_logits(softcap, causal):
    left, right = _masks.band(causal, (-1, -1))
    _check(2, 300, 300, 2, 2, 128, jnp.bfloat16, left, right, softcap=softcap, logit_scale=8.0)


@pytest.mark.parametrize("dtype", helpers.KERNEL_DTYPES, ids=["bf16", "fp16"])
def test_custom_scale(dtype):
    _check(1, 190, 190, 2, 2, 128, dtype, scale=0.3)


# --------------------------------------------------------------------------- determinism, jit, vmap

def test_deterministic_and_jit():
    _need(jnp.bfloat16, 128)
    q, k, v = helpers.random_qkv(_next_key(), 2, 777, 777, 4, 2, 128, jnp.bfloat16)
    f = jax.jit(lambda q, k, v: _kernel(q, k, v, UNB, 0))
    o1, l1 = jax.device_get(f(q, k, v))
    o2, l2 = jax.device_get(f(q, k, v))
    o3, l3 = jax.device_get(_kernel(q, k, v, UNB, 0))
    np.testing.assert_array_equal(np.asarray(o1, np.float32), np.asarray(o2, np.float32))
    np.testing.assert_array_equal(l1, l2)
    np.testing.assert_array_equal(np.asarray(o1, np.float32), np.asarray(o3, np.float32))
    np.testing.assert_array_equal(l1, l3)


def test_vmap():
    _need(jnp.bfloat16, 128)
    n, b, s, h, d = 3, 2, 150, 2, 128
    qs, ks, vs = zip(*[helpers.random_qkv(_next_key(), b, s, s, h, h, d, jnp.bfloat16)
                       for _ in range(n)])
    q, k, v = jnp.stack(qs), jnp.stack(ks), jnp.stack(vs)
    out, lse = jax.jit(jax.vmap(lambda q, k, v: _kernel(q, k, v, UNB, 0)))(q, k, v)
    for i in range(n):
        o_i, l_i = _kernel(qs[i], ks[i], vs[i], UNB, 0)
        np.testing.assert_array_equal(np.asarray(out[i], np.float32), np.asarray(o_i, np.float32))
        np.testing.assert_array_equal(np.asarray(lse[i]), np.asarray(l_i))


def test_public_api_cuda():
    _need(jnp.bfloat16, 128)
    import jax_fa3
    q, k, v = helpers.random_qkv(_next_key(), 2, 300, 400, 4, 2, 128, jnp.bfloat16)
    out, lse = jax.jit(lambda q, k, v: jax_fa3.flash_attention(
        q, k, v, causal=True, window_size=(64, -1), return_lse=True, implementation="cuda"))(q, k, v)
    ref_out, ref_lse = helpers.reference_f64(q, k, v, causal=True, window_size=(64, -1))
    base_out, base_lse = helpers.plain_in_dtype(q, k, v, return_lse=True, causal=True,
                                                window_size=(64, -1))
    helpers.assert_error_ratio("out", out, ref_out, base_out)
    helpers.assert_error_ratio("lse", lse, ref_lse, base_lse)


def test_value_and_grad_runs():
    """The kernel forward under value_and_grad (backward may be the portable one)."""
    _need(jnp.bfloat16, 128)
    import jax_fa3
    q, k, v = helpers.random_qkv(_next_key(), 1, 130, 130, 2, 2, 128, jnp.bfloat16)
    loss = lambda q, k, v: jax_fa3.flash_attention(q, k, v, causal=True, implementation="cuda"
                                                   ).astype(jnp.float32).sum()
    val, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)
    assert np.isfinite(float(val))
    for g in grads:
        helpers.assert_finite("grad", g)
