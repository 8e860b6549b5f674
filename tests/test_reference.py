"""The oracle itself (tests/helpers.py, one dense reference over numpy or jax.numpy): its JAX
form in float64 against its numpy form, the numpy gradients against JAX autodiff in float64,
the float32 form against float64, and the oracle against jax.nn.dot_product_attention where
their semantics coincide."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import (check_against_oracle, plain_grads_in_dtype, plain_in_dtype, random_like,
                     random_qkv, random_sinks, reference_f64, reference_grads_f64,
                     reference_grads_jax, reference_jax, resolve_band)
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


SINK_OPTIONS = [
    dict(causal=True),
    dict(causal=True, window_size=(3, -1), softcap=2.0),  # sliding window + sink
    dict(left=-3, right=9),  # a shifted band: rows that see no key
]


@pytest.mark.parametrize("opts", SINK_OPTIONS, ids=str)
def test_sinks_and_value_head_dim_float64(x64, opts):
    """With sinks and v of its own head dim: the JAX form (float64) equals the numpy form,
    and the numpy gradients (dq, dk, dv and the analytic dsinks) equal float64 autodiff of
    the JAX form, with an LSE cotangent."""
    q, k, v = random_qkv(12, 2, 23, 17, 4, 2, 16, jnp.float64, head_dim_v=8)
    sinks = random_sinks(13, 4).astype(jnp.float64).at[1].set(-jnp.inf)  # one head: no sink
    dout = random_like(14, jnp.zeros(q.shape[:-1] + (8,), jnp.float64))
    dlse = jnp.asarray(np.random.default_rng(15).standard_normal((2, 4, 23)))
    out, lse = reference_jax(q, k, v, sinks=sinks, **opts)
    ref_out, ref_lse = reference_f64(q, k, v, sinks=sinks, **opts)
    assert ref_out.shape == (2, 23, 4, 8)
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(np.asarray(lse)[fin], ref_lse[fin], rtol=1e-12)

    def loss(q, k, v, s):
        out, lse = reference_jax(q, k, v, sinks=s, **opts)
        return (out * dout).sum() + jnp.where(jnp.isfinite(lse), lse * dlse, 0).sum()

    want = jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, sinks)
    got = reference_grads_f64(q, k, v, dout, dlse=dlse, sinks=sinks, **opts)
    assert len(got) == 4 and got[3].shape == (4,) and got[3][1] == 0
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)
    # reference_grads_jax returns dsinks last, the same
    *_, dsinks = reference_grads_jax(q, k, v, dout, sinks=sinks, **opts)
    np.testing.assert_allclose(dsinks, reference_grads_f64(q, k, v, dout, sinks=sinks, **opts)[3],
                               rtol=1e-10, atol=1e-12)


def test_sink_semantics():
    """A row that sees no key: out 0 and lse the sink; a sink of -inf is no sink; the sink
    is one more key of value 0 (the oracle with sinks equals it without, on keys extended by
    one key whose score is the sink and whose value is 0)."""
    q, k, v = random_qkv(16, 1, 6, 5, 2, 1, 8, jnp.float32)
    sinks = jnp.asarray([0.5, -1.0], jnp.float32)
    out, lse = reference_f64(q, k, v, sinks=sinks, causal=True)  # rows 0..0: sq > sk
    np.testing.assert_array_equal(out[:, 0], 0)
    np.testing.assert_allclose(lse[:, :, 0], np.broadcast_to(sinks, (1, 2)))
    no_sink = reference_f64(q, k, v, causal=True)
    minus_inf = reference_f64(q, k, v, sinks=jnp.full((2,), -jnp.inf), causal=True)
    for a, b in zip(no_sink, minus_inf):
        np.testing.assert_array_equal(a, b)
    # The sink as an extra key: bias that key's score to the sink (per head), value 0.
    scale = 1 / np.sqrt(8)
    k1 = jnp.concatenate([jnp.zeros((1, 1, 1, 8)), k], axis=1)
    v1 = jnp.concatenate([jnp.zeros((1, 1, 1, 8)), v], axis=1)
    bias = np.zeros((1, 2, 6, 6))
    bias[:, :, :, 0] = np.asarray(sinks)[:, None]
    mask = np.ones((6, 6), bool)  # the sink key always; real key j iff j <= i - 1 (causal)
    mask[:, 1:] = np.arange(5)[None, :] <= np.arange(6)[:, None] - 1
    ext_out, ext_lse = reference_f64(q, k1, v1, softmax_scale=scale, bias=bias, mask=mask)
    np.testing.assert_allclose(out, ext_out, atol=1e-12)
    np.testing.assert_allclose(lse, ext_lse, atol=1e-12)


def test_sinks_in_the_checks():
    """check_against_oracle with sinks: the plain baseline passes against itself, and a
    result that ignores the sinks (or gets their gradient's sign wrong) fails."""
    q, k, v = random_qkv(17, 2, 40, 40, 4, 2, 32, jnp.bfloat16, head_dim_v=16)
    sinks = random_sinks(18, 4, loc=3.0)
    dout = random_like(19, jnp.zeros(q.shape[:-1] + (16,), jnp.bfloat16))
    out, lse = plain_in_dtype(q, k, v, return_lse=True, sinks=sinks, causal=True)
    grads = plain_grads_in_dtype(q, k, v, dout, sinks=sinks, causal=True)
    check_against_oracle("baseline", q, k, v, out, lse, grads, dout, sinks=sinks, causal=True)
    wrong_out, wrong_lse = plain_in_dtype(q, k, v, return_lse=True, causal=True)
    with pytest.raises(AssertionError, match="baseline error"):
        check_against_oracle("no sinks", q, k, v, out=wrong_out, sinks=sinks, causal=True)
    with pytest.raises(AssertionError, match="baseline error"):
        check_against_oracle("no sinks", q, k, v, lse=wrong_lse, sinks=sinks, causal=True)
    flipped = grads[:3] + (-grads[3],)
    with pytest.raises(AssertionError, match="dsinks"):
        check_against_oracle("flipped", q, k, v, grads=flipped, dout=dout, sinks=sinks,
                             causal=True)


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
