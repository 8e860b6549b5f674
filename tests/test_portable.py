"""The portable path against the float64 oracle, by the error-ratio rule of docs/architecture.md.

Cases are a hand-picked spread (not a cartesian product): every dtype, every head dim the
kernels compile, causal/window/softcap, seqlen_q != seqlen_k both ways, GQA 1/2/8 and MQA,
the block-boundary seqlens, batch 1 and 3, large logits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import (assert_finite, band_mask, check_against_oracle, random_like, random_qkv,
                     random_sinks, reference_f64, reference_grads_f64)
from jax_fa3 import _core, attention, portable
from jax_fa3._masks import UNBOUNDED, band

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32


def _fwd_bwd(q, k, v, dout, **kw):
    """Portable forward + backward under jit with the internal keyword options."""
    @jax.jit
    def run(q, k, v, dout, kv_lengths):
        out, lse = portable.forward(q, k, v, kv_lengths=kv_lengths, **kw)
        return out, lse, portable.backward(q, k, v, out, lse, dout, kv_lengths=kv_lengths, **kw)

    kv_lengths = kw.pop("kv_lengths", None)
    return run(q, k, v, dout, kv_lengths)


def _run(q, k, v, dout, block_k=portable.DEFAULT_BLOCK_K, **opts):
    """Portable forward + backward under jit, with the public options."""
    scale = opts.get("softmax_scale") or 1.0 / np.sqrt(q.shape[-1])
    left, right = band(opts.get("causal", False), opts.get("window_size", (-1, -1)))
    kw = dict(softmax_scale=scale, softcap=opts.get("softcap", 0.0), left=left, right=right,
              block_k=block_k)

    @jax.jit
    def run(q, k, v, dout):
        out, lse = portable.forward(q, k, v, **kw)
        return out, lse, portable.backward(q, k, v, out, lse, dout, **kw)

    return run(q, k, v, dout)


# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype, logit scale, options)
CASES = [
    (1, 1, 1, 2, 2, 32, F32, 1.0, {}),
    (3, 17, 17, 4, 2, 64, BF16, 1.0, dict(causal=True)),
    (1, 127, 129, 8, 1, 96, F16, 1.0, dict(causal=True)),
    (2, 128, 128, 8, 8, 128, BF16, 1.0, dict(window_size=(16, 0))),
    (1, 129, 127, 8, 1, 128, F16, 1.0, dict(causal=True, window_size=(40, -1))),
    (3, 17, 129, 2, 1, 192, F32, 1.0, dict(softcap=5.0)),
    (1, 65, 33, 4, 2, 256, BF16, 1.0, dict(causal=True)),
    (1, 33, 65, 2, 2, 256, F16, 1.0, dict(window_size=(5, 7), softcap=3.0)),
    (2, 1, 129, 8, 2, 64, BF16, 1.0, dict(causal=True)),
    (1, 129, 1, 2, 1, 64, F32, 1.0, {}),
    (1, 1000, 1000, 2, 1, 64, BF16, 1.0, dict(causal=True)),
    (1, 1000, 17, 2, 2, 32, F16, 1.0, dict(window_size=(-1, 3))),
    (1, 17, 1000, 8, 1, 32, F32, 1.0, dict(causal=True, softcap=10.0)),
    (2, 127, 127, 4, 4, 64, BF16, 8.0, {}),
    (1, 128, 200, 4, 1, 128, F16, 8.0, dict(causal=True)),
    (1, 100, 100, 2, 1, 64, F32, 8.0, dict(window_size=(10, 10), softcap=4.0)),
    (2, 64, 64, 4, 2, 32, BF16, 1.0, dict(softmax_scale=0.3)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}-q{c[1]}-k{c[2]}-h{c[3]}/{c[4]}"
                         f"-d{c[5]}-{jnp.dtype(c[6]).name}-x{c[7]}-{c[8]}")
def test_matches_oracle(case):
    b, sq, sk, hq, hkv, d, dtype, scale, opts = case
    q, k, v = random_qkv(jax.random.key(sq * 7 + sk), b, sq, sk, hq, hkv, d, dtype, scale)
    dout = random_like(jax.random.key(1), q)
    out, lse, grads = _run(q, k, v, dout, **opts)
    assert out.dtype == dtype and lse.dtype == jnp.float32 and lse.shape == (b, hq, sq)
    assert [g.dtype for g in grads] == [dtype] * 3
    check_against_oracle("portable", q, k, v, out, lse, grads, dout, **opts)


@pytest.mark.parametrize("block_k", [1, 7, 64, 1024])
def test_block_size_does_not_change_result(block_k):
    q, k, v = random_qkv(jax.random.key(3), 2, 50, 130, 4, 2, 32, F32)
    dout = random_like(jax.random.key(4), q)
    opts = dict(causal=True, window_size=(30, -1), softcap=2.0)
    got = _run(q, k, v, dout, block_k=block_k, **opts)
    want = _run(q, k, v, dout, block_k=128, **opts)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5)


# Shifted bands as ring attention produces them: negative bounds, partial visibility.
@pytest.mark.parametrize("left,right", [(-5, 20), (40, -10), (3, -3), (UNBOUNDED, -60),
                                        (-70, UNBOUNDED)])
def test_shifted_bands(left, right):
    sq, sk = 48, 80
    q, k, v = random_qkv(jax.random.key(5), 2, sq, sk, 4, 1, 32, F32)
    dout = random_like(jax.random.key(6), q)
    kw = dict(softmax_scale=0.2, softcap=0.0, left=left, right=right, block_k=16)
    out, lse, grads = _fwd_bwd(q, k, v, dout, **kw)
    check_against_oracle("shifted", q, k, v, out, lse, grads, dout, softmax_scale=0.2,
                         left=left, right=right)
    empty = ~band_mask(sq, sk, left, right).any(axis=1)  # rows that see no key
    assert (np.asarray(out)[:, empty] == 0).all()
    assert np.isneginf(np.asarray(lse)[:, :, empty]).all()


def test_fully_masked_everything_is_zero_not_nan():
    q, k, v = random_qkv(jax.random.key(7), 2, 16, 16, 2, 2, 32, BF16)
    f = lambda q, k, v: portable.forward(q, k, v, softmax_scale=0.1, left=-3, right=-1)
    out, lse = jax.jit(f)(q, k, v)
    assert (np.asarray(out, np.float32) == 0).all() and np.isneginf(np.asarray(lse)).all()
    grads = portable.backward(q, k, v, out, lse, random_like(jax.random.key(8), q),
                              softmax_scale=0.1, left=-3, right=-1)
    for g in grads:
        assert (np.asarray(g, np.float32) == 0).all()


def test_partly_masked_rows_gradients_are_finite_and_zero():
    """Rows of a window that lie outside every key (seqlen_q > seqlen_k, causal): 0 out, -inf
    lse, and those rows' dq exactly 0, with jax.grad through the public API."""
    q, k, v = random_qkv(jax.random.key(9), 1, 40, 8, 2, 1, 16, F32)
    attn = functools.partial(attention.flash_attention, causal=True, implementation="xla")
    loss = lambda q, k, v: attn(q, k, v).sum()
    dq, dk, dv = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for g in (dq, dk, dv):
        assert_finite("grad", g)
    assert (np.asarray(dq)[:, :32] == 0).all()  # the first 32 query rows see no key
    out, lse = attn(q, k, v, return_lse=True)
    assert (np.asarray(out)[:, :32] == 0).all() and np.isneginf(np.asarray(lse)[:, :, :32]).all()


def test_kv_lengths_match_masked_oracle():
    q, k, v = random_qkv(jax.random.key(10), 3, 20, 70, 4, 2, 32, F32)
    lengths = jnp.array([70, 33, 0], jnp.int32)
    dout = random_like(jax.random.key(11), q)
    kw = dict(softmax_scale=0.2, left=UNBOUNDED, right=UNBOUNDED, kv_lengths=lengths, block_k=32)
    out, lse, (dq, dk, dv) = _fwd_bwd(q, k, v, dout, **kw)
    mask = (np.arange(70)[None, :] < np.asarray(lengths)[:, None])[:, None, None, :]
    ref_out, ref_lse = reference_f64(q, k, v, softmax_scale=0.2, mask=mask)
    ref_grads = reference_grads_f64(q, k, v, dout, softmax_scale=0.2, mask=mask)
    np.testing.assert_allclose(out, ref_out, atol=2e-6)
    np.testing.assert_allclose(lse, ref_lse, atol=2e-6)
    assert np.isneginf(np.asarray(lse)[2]).all() and (np.asarray(out)[2] == 0).all()
    for got, ref in zip((dq, dk, dv), ref_grads):
        np.testing.assert_allclose(got, ref, atol=1e-5)
    assert (np.asarray(dk)[1, 33:] == 0).all()


def test_dense_variant_with_bias_and_mask():
    q, k, v = random_qkv(jax.random.key(12), 2, 24, 40, 4, 2, 32, F32)
    rng = np.random.default_rng(13)
    bias = jnp.asarray(rng.standard_normal((1, 4, 24, 40)), jnp.float32)
    mask = rng.random((2, 1, 24, 40)) < 0.6
    mask[0, 0, 3] = False  # a fully masked row
    mask = jnp.asarray(mask)
    dense = functools.partial(portable.dense, softmax_scale=0.2, softcap=2.0, mask=mask)
    out, lse = jax.jit(lambda q, k, v, b: dense(q, k, v, bias=b))(q, k, v, bias)
    ref_out, ref_lse = reference_f64(q, k, v, softmax_scale=0.2, softcap=2.0, bias=bias, mask=mask)
    np.testing.assert_allclose(out, ref_out, atol=2e-6)
    np.testing.assert_allclose(lse, ref_lse, atol=2e-6)
    assert np.isneginf(np.asarray(lse)[0, :, 3]).all()
    dout = random_like(jax.random.key(15), q)
    loss = lambda q, k, v, b: (dense(q, k, v, bias=b)[0] * dout).sum()
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, bias)
    for got, ref in zip(grads[:3], reference_grads_f64(q, k, v, dout, softmax_scale=0.2,
                                                        softcap=2.0, bias=bias, mask=mask)):
        assert_finite("dense grad", got)
        np.testing.assert_allclose(got, ref, atol=1e-5)
    assert_finite("dbias", grads[3])


def test_backward_from_merged_out_lse_gives_exact_partial_gradients():
    """The ring-attention contract of _core.attention_bwd: split the keys in two chunks, merge the
    chunk results by their LSE, then each chunk's backward with the FINAL out/lse returns
    that chunk's share of the full gradients."""
    sq, sk = 32, 64
    q, k, v = random_qkv(jax.random.key(16), 2, sq, sk, 4, 2, 32, F32)
    dout = random_like(jax.random.key(17), q)
    opts = _core.Options(softmax_scale=0.25, implementation="xla")
    chunks = [(0, 40), (40, 64)]

    def right_of(start, stop):
        """The full causal band (right = 0) in the coordinates of keys [start, stop)."""
        return (sk - sq) - start - ((stop - start) - sq)

    @jax.jit
    def ring_like(q, k, v, dout):
        parts = [_core.attention_fwd(q, k[:, a:b], v[:, a:b],
                                     opts.with_band(UNBOUNDED, right_of(a, b)))
                 for a, b in chunks]
        lse = jnp.logaddexp(parts[0][1], parts[1][1])
        out = sum(jnp.exp(lse_c - lse).transpose(0, 2, 1)[..., None] * out_c
                  for out_c, lse_c in parts)
        grads = [_core.attention_bwd(q, k[:, a:b], v[:, a:b], out, lse, dout,
                                     opts.with_band(UNBOUNDED, right_of(a, b)))
                 for a, b in chunks]
        dq = grads[0][0] + grads[1][0]
        return out, dq, jnp.concatenate([g[1] for g in grads], 1), jnp.concatenate(
            [g[2] for g in grads], 1)

    out, dq, dk, dv = ring_like(q, k, v, dout)
    ref_out, _ = reference_f64(q, k, v, softmax_scale=0.25, causal=True)
    np.testing.assert_allclose(out, ref_out, atol=2e-6)
    ref = reference_grads_f64(q, k, v, dout, softmax_scale=0.25, causal=True)
    for got, want in zip((dq, dk, dv), ref):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_lse_cotangent_is_exact():
    q, k, v = random_qkv(jax.random.key(18), 2, 30, 50, 4, 1, 32, F32)
    dout = random_like(jax.random.key(19), q)
    dlse = jnp.asarray(np.random.default_rng(20).standard_normal((2, 4, 30)), jnp.float32)
    f = lambda q, k, v: attention.flash_attention(q, k, v, causal=True, softcap=3.0,
                                                  return_lse=True, implementation="xla")
    grads = jax.jit(lambda q, k, v: jax.vjp(f, q, k, v)[1]((dout, dlse)))(q, k, v)
    ref = reference_grads_f64(q, k, v, dout, dlse=dlse, causal=True, softcap=3.0)
    for got, want in zip(grads, ref):
        np.testing.assert_allclose(got, want, atol=1e-5)


# ----------------------------------------------------------------------------- sinks, dv != d

def _core_fwd_bwd(q, k, v, dout, sinks=None, dlse=None, **opts):
    """(out, lse, (dq, dk, dv[, dsinks])) of the core's local calls on the portable path
    (what flash_attention runs on one device), under jit, with the public options."""
    scale = opts.get("softmax_scale") or 1.0 / np.sqrt(q.shape[-1])
    left, right = band(opts.get("causal", False), opts.get("window_size", (-1, -1)))
    o = _core.Options(softmax_scale=scale, softcap=opts.get("softcap", 0.0), left=left,
                      right=right, implementation="xla")

    @jax.jit
    def run(q, k, v, dout, sinks, dlse):
        out, lse = _core.attention_fwd(q, k, v, o, sinks=sinks)
        *grads, dsinks = _core.attention_bwd(q, k, v, out, lse, dout, o, dlse=dlse, sinks=sinks)
        return out, lse, tuple(grads) + (() if sinks is None else (dsinks,))

    return run(q, k, v, dout, sinks, dlse)


# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, head_dim_v, dtype, logit scale,
#  sinks, options): ragged lengths, GQA/MQA, causal, sliding window + sink, softcap, v of
# its own head dim (MLA's 192/128 among them), rows that see no key (seqlen_q > seqlen_k).
SINK_CASES = [
    (2, 1, 129, 8, 2, 64, 32, BF16, 1.0, True, dict(causal=True)),
    (1, 17, 17, 4, 4, 128, 128, F16, 1.0, True, dict(causal=True, window_size=(8, -1))),
    (1, 127, 1000, 4, 1, 64, 64, BF16, 1.0, True, dict(causal=True, window_size=(100, -1))),
    (1, 1000, 129, 2, 1, 32, 16, F32, 1.0, True, dict(causal=True)),
    (2, 129, 127, 4, 2, 192, 128, BF16, 1.0, False, dict(causal=True)),
    (1, 129, 17, 2, 2, 80, 80, F16, 8.0, True, dict(softcap=5.0)),
    (1, 1000, 1000, 2, 1, 40, 24, BF16, 1.0, False, {}),
    (3, 17, 129, 8, 1, 16, 48, F32, 1.0, True, dict(window_size=(5, 7), softcap=3.0)),
    (1, 200, 300, 4, 2, 96, 64, BF16, 4.0, True, dict(window_size=(16, 0))),
]


@pytest.mark.parametrize("case", SINK_CASES, ids=lambda c: f"b{c[0]}-q{c[1]}-k{c[2]}-h{c[3]}/"
                         f"{c[4]}-d{c[5]}/{c[6]}-{jnp.dtype(c[7]).name}-x{c[8]}-"
                         f"{'sinks' if c[9] else 'nosinks'}-{c[10]}")
def test_sinks_and_value_head_dim_match_oracle(case):
    """out, lse, dq, dk, dv and dsinks of the portable path (through the core) by the
    error-ratio rule against the float64 oracle."""
    b, sq, sk, hq, hkv, d, dv, dtype, scale, with_sinks, opts = case
    q, k, v = random_qkv(sq * 3 + sk + d, b, sq, sk, hq, hkv, d, dtype, scale, head_dim_v=dv)
    sinks = random_sinks(sq + dv, hq, loc=2.0) if with_sinks else None
    dout = random_like(2, jnp.zeros((b, sq, hq, dv), dtype))
    out, lse, grads = _core_fwd_bwd(q, k, v, dout, sinks, **opts)
    assert out.shape == (b, sq, hq, dv) and out.dtype == dtype
    assert [g.shape for g in grads[:3]] == [q.shape, k.shape, v.shape]
    if with_sinks:
        assert grads[3].shape == (hq,) and grads[3].dtype == jnp.float32
    check_against_oracle("portable", q, k, v, out, lse, grads, dout, sinks=sinks, **opts)


def test_sinks_rows_without_keys_and_minus_inf():
    """A row that sees no key: out 0, lse = its head's sink, dq 0, its dsinks share from the
    LSE cotangent alone (p0 = 1, D = 0). A sink of -inf is no sink: bitwise the same results
    as without, and a zero gradient."""
    q, k, v = random_qkv(22, 2, 40, 8, 4, 2, 16, F32, head_dim_v=24)
    sinks = jnp.asarray([0.5, -jnp.inf, 2.0, -1.0], jnp.float32)
    dout = random_like(23, jnp.zeros((2, 40, 4, 24)))
    dlse = jnp.asarray(np.random.default_rng(24).standard_normal((2, 4, 40)), jnp.float32)
    out, lse, (dq, dk, dv, dsinks) = _core_fwd_bwd(q, k, v, dout, sinks, dlse=dlse, causal=True)
    empty = slice(0, 32)  # the first 32 query rows see no key
    assert (np.asarray(out)[:, empty] == 0).all() and (np.asarray(dq)[:, empty] == 0).all()
    want = np.broadcast_to(np.asarray(sinks)[None, :, None], (2, 4, 32))
    np.testing.assert_array_equal(np.asarray(lse)[:, :, empty], want)
    assert dsinks[1] == 0
    ref = reference_grads_f64(q, k, v, dout, dlse=dlse, sinks=sinks, causal=True)
    for got, r in zip((dq, dk, dv, dsinks), ref):
        np.testing.assert_allclose(got, r, rtol=1e-5, atol=1e-5)
    none = _core_fwd_bwd(q, k, v, dout, None, causal=True)
    minus_inf = _core_fwd_bwd(q, k, v, dout, jnp.full((4,), -jnp.inf), causal=True)
    for a, b in zip(jax.tree.leaves(none), jax.tree.leaves(minus_inf)[:-1]):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(minus_inf[2][3], 0)


def test_sinks_block_size_does_not_change_result():
    q, k, v = random_qkv(25, 2, 50, 130, 4, 2, 32, F32, head_dim_v=8)
    sinks = random_sinks(26, 4)
    kw = dict(softmax_scale=0.2, softcap=2.0, left=30, right=0)
    run = jax.jit(lambda q, k, v, s, block_k: portable.forward(q, k, v, s, block_k=block_k, **kw),
                  static_argnums=4)
    want = run(q, k, v, sinks, 128)
    for block_k in (1, 7, 64):
        for a, b in zip(run(q, k, v, sinks, block_k), want):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)


def test_dense_variant_with_sinks_and_value_head_dim():
    """portable.dense takes sinks and a v head dim of its own; its autodiff gradients
    (dsinks included) are the oracle's."""
    q, k, v = random_qkv(27, 2, 24, 40, 4, 2, 32, F32, head_dim_v=16)
    sinks = random_sinks(28, 4)
    mask = jnp.asarray(np.random.default_rng(29).random((2, 1, 24, 40)) < 0.6).at[0, 0, 3].set(False)
    dense = functools.partial(portable.dense, softmax_scale=0.2, softcap=2.0, mask=mask)
    out, lse = jax.jit(dense)(q, k, v, sinks)
    ref_out, ref_lse = reference_f64(q, k, v, softmax_scale=0.2, softcap=2.0, mask=mask,
                                     sinks=sinks)
    np.testing.assert_allclose(out, ref_out, atol=2e-6)
    np.testing.assert_allclose(lse, ref_lse, atol=2e-6)
    np.testing.assert_allclose(np.asarray(lse)[0, :, 3], sinks, rtol=1e-6)  # no key: the sink
    dout = random_like(30, out)
    loss = lambda q, k, v, s: (dense(q, k, v, s)[0] * dout).sum()
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, sinks)
    ref = reference_grads_f64(q, k, v, dout, softmax_scale=0.2, softcap=2.0, mask=mask,
                              sinks=sinks)
    for got, want in zip(grads, ref):
        assert_finite("dense grad", got)
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_lse_cotangent_with_sinks_is_exact():
    """flash_attention on the portable path, differentiated through out and lse with sinks in
    bfloat16 (the cotangent comes back in the sinks' dtype) and float32."""
    q, k, v = random_qkv(31, 2, 30, 50, 4, 1, 32, F32, head_dim_v=16)
    dout = random_like(32, jnp.zeros((2, 30, 4, 16)))
    dlse = jnp.asarray(np.random.default_rng(33).standard_normal((2, 4, 30)), jnp.float32)
    for sinks in (random_sinks(34, 4), random_sinks(34, 4).astype(BF16)):
        f = lambda q, k, v, s: attention.flash_attention(q, k, v, causal=True, softcap=3.0,
                                                         sinks=s, return_lse=True,
                                                         implementation="xla")
        grads = jax.jit(lambda *a: jax.vjp(f, *a)[1]((dout, dlse)))(q, k, v, sinks)
        assert grads[3].dtype == sinks.dtype and grads[3].shape == (4,)
        ref = reference_grads_f64(q, k, v, dout, dlse=dlse, causal=True, softcap=3.0,
                                  sinks=sinks.astype(F32))
        for got, want in zip(grads, ref):
            tol = 1e-5 if got.dtype == F32 else 2e-2 * np.abs(want).max()
            np.testing.assert_allclose(np.asarray(got, F32), want, atol=tol)


def _all_avals(jaxpr):
    """Abstract values of every equation output, descending into scans, jits, etc."""
    for eqn in jaxpr.eqns:
        yield from (var.aval for var in eqn.outvars)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
                if hasattr(inner, "eqns"):
                    yield from _all_avals(inner)


def test_memory_is_blockwise():
    """No intermediate of the forward or backward jaxpr holds a seqlen_q x seqlen_k matrix."""
    s = 2048
    q = jax.ShapeDtypeStruct((1, s, 2, 64), BF16)
    kw = dict(softmax_scale=0.125, left=UNBOUNDED, right=0)

    def fwd_bwd(q, k, v):
        out, lse = portable.forward(q, k, v, **kw)
        return portable.backward(q, k, v, out, lse, out, **kw)

    jaxpr = jax.make_jaxpr(fwd_bwd)(q, q, q).jaxpr
    biggest = max(int(np.prod(aval.shape)) for aval in _all_avals(jaxpr))
    assert biggest < s * s, f"an intermediate has {biggest} elements (>= {s}x{s})"


def test_empty_inputs():
    q, k, v = random_qkv(jax.random.key(21), 2, 5, 0, 2, 1, 16, F32)
    out, lse = attention.flash_attention(q, k, v, return_lse=True)
    assert out.shape == q.shape and (np.asarray(out) == 0).all()
    assert np.isneginf(np.asarray(lse)).all()
    dq = jax.grad(lambda q: attention.flash_attention(q, k, v).sum())(q)
    assert (np.asarray(dq) == 0).all()
