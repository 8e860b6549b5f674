"""The oracle itself (tests/helpers.py, one dense reference over numpy or jax.numpy): its JAX
form in float64 against its numpy form, the numpy gradients against JAX autodiff in float64,
the float32 form against float64, and the oracle against jax.nn.dot_product_attention where
their semantics coincide."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import (plain_in_dtype, random_like, random_qkv, reference_f64,
                     reference_grads_f64, reference_grads_jax, reference_jax, resolve_band)
from jax_fa3 import _masks

OPTIONS = [
    {},
    dict(causal=True),
    dict(window_size=(4, 2)),
    dict(causal=True, window_size=(7, -1), softcap=2.5),
    dict(softmax_scale=0.7, softcap=1.0),
    dict(left=-3, right=9),  # a shifted band, as ring attention uses
]


@pytest.mark.parametrize("opts", OPTIONS, ids=str)
def test_jax_form_float64_matches_numpy(x64, opts):
    q, k, v = random_qkv(0, 2, 19, 33, 4, 2, 16, jnp.float64)
    out, lse = reference_jax(q, k, v, **opts)
    assert out.dtype == jnp.float64
    ref_out, ref_lse = reference_f64(q, k, v, **opts)
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(np.asarray(lse)[fin], ref_lse[fin], rtol=1e-12)


@pytest.mark.parametrize("opts", OPTIONS[1:4], ids=str)
def test_numpy_gradients_match_autodiff_float64(x64, opts):
    q, k, v = random_qkv(1, 1, 23, 17, 4, 1, 16, jnp.float64)
    dout = random_like(2, q)
    dlse = jnp.asarray(np.random.default_rng(3).standard_normal((1, 4, 23)))

    def loss(q, k, v):
        out, lse = reference_jax(q, k, v, **opts)
        return (out * dout).sum() + jnp.where(jnp.isfinite(lse), lse * dlse, 0).sum()

    want = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    got = reference_grads_f64(q, k, v, dout, dlse=dlse, **opts)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


def test_float32_highest_is_close_to_float64():
    """The JAX form in float32 (the long-sequence oracle of the GPU tests) is within float32
    rounding of float64, forward and gradients."""
    q, k, v = random_qkv(4, 2, 64, 64, 2, 2, 64, jnp.float32, scale=4.0)
    out, lse = jax.jit(lambda q, k, v: reference_jax(q, k, v, causal=True))(q, k, v)
    ref_out, ref_lse = reference_f64(q, k, v, causal=True)
    np.testing.assert_allclose(out, ref_out, atol=2e-5)
    np.testing.assert_allclose(lse, ref_lse, atol=2e-5)
    dout = random_like(10, q)
    *_, dq, dk, dv = jax.jit(lambda *a: reference_grads_jax(*a, causal=True))(q, k, v, dout)
    for got, want in zip((dq, dk, dv), reference_grads_f64(q, k, v, dout, causal=True)):
        np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max())


def test_leading_axes_are_batch_axes():
    """(seqlen, heads, head_dim) and (a, b, seqlen, heads, head_dim) work like batch 1 and a*b
    (the module tests call the oracle on unbatched and vmapped shapes)."""
    q, k, v = random_qkv(11, 6, 9, 12, 4, 2, 8, jnp.float32)
    want_out, want_lse = reference_f64(q, k, v, causal=True)
    out, lse = reference_f64(q[0], k[0], v[0], causal=True)
    np.testing.assert_allclose(out, want_out[0])
    np.testing.assert_allclose(lse, want_lse[0])
    split = lambda x: x.reshape(2, 3, *x.shape[1:])
    out, lse = reference_jax(split(q), split(k), split(v), causal=True)
    np.testing.assert_allclose(out, split(want_out), atol=2e-6)
    np.testing.assert_allclose(lse, split(want_lse), atol=2e-6)


def test_bias_and_mask(x64):
    q, k, v = random_qkv(5, 2, 8, 12, 2, 1, 8, jnp.float64)
    rng = np.random.default_rng(6)
    bias = rng.standard_normal((2, 1, 8, 12))
    mask = rng.random((1, 2, 8, 12)) < 0.7
    mask[0, 1, 2] = False
    out, lse = reference_jax(q, k, v, bias=jnp.asarray(bias), mask=jnp.asarray(mask))
    ref_out, ref_lse = reference_f64(q, k, v, bias=bias, mask=mask)
    np.testing.assert_allclose(out, ref_out, atol=1e-12)
    assert np.isneginf(np.asarray(lse)[:, 1, 2]).all() and (np.asarray(out)[:, 2, 1] == 0).all()


def test_oracles_match_jax_nn_for_square_causal():
    """Equal lengths: bottom-right and top-left causal coincide, so jax.nn is a third witness."""
    q, k, v = random_qkv(7, 2, 31, 31, 4, 2, 32, jnp.float32)
    want = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(reference_f64(q, k, v, causal=True)[0], want, atol=2e-6)
    np.testing.assert_allclose(plain_in_dtype(q, k, v, causal=True), want, atol=2e-6)


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (3, 0)),
                                           (True, (5, 9)), (False, (-1, 2))])
def test_band_matches_masks_module(causal, window):
    assert resolve_band(causal=causal, window_size=window) == _masks.band(causal, window)


def test_checks_catch_bad_results():
    """The helpers fail loudly: poisoned (unwritten) elements, and an answer that is wrong by
    more than the baseline's rounding."""
    from helpers import assert_error_ratio, assert_finite, poison_like
    q, k, v = random_qkv(8, 1, 16, 16, 2, 2, 32, jnp.bfloat16)
    out = plain_in_dtype(q, k, v)
    with pytest.raises(AssertionError, match="NaN"):
        assert_finite("poisoned", poison_like(out).at[0, :8].set(out[0, :8]))
    assert_finite("lse", jnp.array([0.0, -jnp.inf]), allow_neg_inf=True)
    ref = reference_f64(q, k, v)[0]
    assert_error_ratio("baseline vs itself", out, ref, out)
    wrong = plain_in_dtype(q, k, v, softmax_scale=1.05 / np.sqrt(32))
    with pytest.raises(AssertionError, match="baseline error"):
        assert_error_ratio("wrong scale", wrong, ref, out)
