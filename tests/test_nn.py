"""jax_fa3.nn: Flax NNX/Linen and Equinox attention modules and the Flax attention_fn adapter.

Each module is checked against a plain computation with the same weights (Flax's and
Equinox's own attention modules where they can express the configuration, the oracle of
tests/helpers.py in float32 otherwise), forward and gradients; under jit/grad/vmap; and through a state
round trip. Shapes are small: these tests check wiring, the kernels have their own tests.
"""

from __future__ import annotations

import importlib
import io
import sys

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import jax_fa3.nn
import segment_helpers
from jax_fa3.nn.rope import apply_rope

flax = pytest.importorskip("flax")
eqx = pytest.importorskip("equinox")
from flax import linen, nnx  # noqa: E402
from flax import serialization  # noqa: E402

from jax_fa3.nn.equinox import MultiheadAttention as EqxAttention  # noqa: E402
from jax_fa3.nn.flax import (  # noqa: E402
    LinenMultiHeadAttention,
    MultiHeadAttention,
    attention_fn,
    make_attention_fn,
)

HIGHEST = jax.lax.Precision.HIGHEST
F, H = 32, 4  # model width and query heads; head_dim = 8


def assert_close(got, want, tol=2e-5, name="", scale=None):
    """Max abs error relative to the largest reference magnitude (float32 wiring checks)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    scale = max(float(np.abs(want).max()) if scale is None else scale, 1e-6)
    err = float(np.abs(got - want).max()) / scale
    assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e}"


def assert_trees_close(got, want, tol=2e-5):
    """Leaf by leaf, relative to the largest magnitude in the whole tree: some gradients are
    zero up to rounding (a key bias cannot change a softmax), so a per-leaf scale is noise."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    scale = max(float(jnp.abs(w).max()) for w in jax.tree.leaves(want))
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        assert_close(g, w, tol, jax.tree_util.keystr(path), scale=scale)


def inputs(seed, *shape):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def out_and_grad(f, params, dy):
    """f(params) and the vjp of dy, in one jit (eager autodiff would compile op by op)."""

    @jax.jit
    def run(params):
        out, vjp = jax.vjp(f, params)
        return out, vjp(dy)[0]

    return run(params)


def nnx_out_and_grad(module, call, dy):
    """call(module) and its parameter gradient (as a pure dict) for the cotangent dy."""
    graphdef, state = nnx.split(module)
    out, grad = out_and_grad(lambda s: call(nnx.merge(graphdef, s)), state, dy)
    return out, nnx.to_pure_dict(grad)


# ------------------------------------------------------------------ plain reference computation


def ref_mha(p, xq, xkv, *, rope=False, q_pos=None, k_pos=None, **opts):
    """Multi-head attention from a Flax-layout params dict {query,key,value,out: {kernel,bias}}
    (and "sinks" (heads,) when the module has them)."""

    def proj(name, x):
        y = jnp.einsum("...f,fhd->...hd", x, p[name]["kernel"], precision=HIGHEST)
        return y + p[name]["bias"] if "bias" in p[name] else y

    q, k, v = proj("query", xq), proj("key", xkv), proj("value", xkv)
    if rope:
        q, k = apply_rope(q, q_pos), apply_rope(k, k_pos)
    o = helpers.reference_jax(q, k, v, sinks=p.get("sinks"), **opts)[0]
    y = jnp.einsum("...hd,hdf->...f", o, p["out"]["kernel"], precision=HIGHEST)
    return y + p["out"]["bias"] if "bias" in p["out"] else y


def nnx_params(module):
    return nnx.to_pure_dict(nnx.state(module, nnx.Param))


# ------------------------------------------------------------------ Flax NNX module


@pytest.mark.parametrize("causal, num_kv_heads", [(False, 4), (True, 2), (True, 1)])
def test_nnx_matches_flax_mha(causal, num_kv_heads):
    ours = MultiHeadAttention(H, F, num_kv_heads=num_kv_heads, causal=causal, rngs=nnx.Rngs(0))
    stock = nnx.MultiHeadAttention(H, F, num_kv_heads=num_kv_heads, decode=False, rngs=nnx.Rngs(1))
    nnx.update(stock, nnx.state(ours, nnx.Param))  # the layouts agree: weights port as is
    x, dy = inputs(2, 2, 13, F), inputs(3, 2, 13, F)
    y, g = nnx_out_and_grad(ours, lambda m: m(x), dy)
    y_ref, g_ref = nnx_out_and_grad(stock, lambda m: m(x, is_causal=causal), dy)
    assert_close(y, y_ref, name="forward")
    assert_trees_close(g, g_ref, 1e-4)


@pytest.mark.parametrize(
    "opts",
    [
        dict(causal=True, rope=True),
        dict(window_size=(3, 2), softcap=5.0),
        dict(causal=True, window_size=(4, -1), rope=True),
    ],
)
def test_nnx_options_match_reference(opts):
    opts = dict(opts)
    rope = opts.pop("rope", False)
    m = MultiHeadAttention(H, F, num_kv_heads=2, rope=rope, rngs=nnx.Rngs(0), **opts)
    xq, xkv = inputs(1, 2, 7, F), inputs(2, 2, 11, F)  # cross-attention, seqlen_q != seqlen_k
    q_pos, k_pos = jnp.arange(7) + 4, jnp.arange(11)  # the documented RoPE defaults

    dy = inputs(3, 2, 7, F)
    y, g = nnx_out_and_grad(m, lambda m: m(xq, xkv), dy)
    y_ref, g_ref = out_and_grad(
        lambda p: ref_mha(p, xq, xkv, rope=rope, q_pos=q_pos, k_pos=k_pos, **opts), nnx_params(m), dy)
    assert_close(y, y_ref, name="forward")
    assert_trees_close(g, g_ref, 1e-4)


def test_nnx_rope_positions():
    """Explicit positions are used for queries and (in self-attention) keys; shifting all
    positions together leaves RoPE attention unchanged."""
    m = MultiHeadAttention(H, F, causal=True, rope=True, rngs=nnx.Rngs(0))
    x = inputs(1, 2, 9, F)
    pos = jnp.arange(9)
    call = nnx.jit(lambda m, x, pos: m(x, positions=pos))
    y = nnx.jit(lambda m, x: m(x))(m, x)
    assert_close(call(m, x, pos), y, name="default positions")
    assert_close(call(m, x, pos + 100), y, tol=1e-4, name="shift invariance")
    want = jax.jit(lambda p: ref_mha(p, x, x, rope=True, q_pos=pos * 2, k_pos=pos * 2, causal=True))
    assert_close(call(m, x, pos * 2), want(nnx_params(m)), name="custom positions")
    with pytest.raises(ValueError, match="rope=True"):
        MultiHeadAttention(H, F, rngs=nnx.Rngs(0))(x, positions=pos)


def test_nnx_jit_grad_vmap():
    m = MultiHeadAttention(H, F, num_kv_heads=2, causal=True, rope=True, rngs=nnx.Rngs(0))
    x = inputs(1, 3, 10, F)
    y = nnx.jit(lambda m, x: m(x))(m, x)
    # Unbatched inputs under vmap: the module sees (seqlen, features).
    assert_close(jax.jit(jax.vmap(lambda x: m(x)))(x), y, name="vmap")
    assert_close(nnx.jit(nnx.vmap(lambda m, x: m(x), in_axes=(None, 0)))(m, x), y, name="nnx.vmap")
    g = nnx.jit(nnx.grad(lambda m, x: jnp.mean(m(x) ** 2)))(m, x)
    assert all(bool(jnp.isfinite(a).all()) and float(jnp.abs(a).max()) > 0 for a in jax.tree.leaves(g))


def test_nnx_state_roundtrip():
    m = MultiHeadAttention(H, F, num_kv_heads=2, causal=True, rngs=nnx.Rngs(0))
    x = inputs(1, 2, 6, F)
    call = nnx.jit(lambda m, x: m(x))
    y = call(m, x)
    graphdef, state = nnx.split(m)
    assert_close(call(nnx.merge(graphdef, state), x), y, 0, "split/merge")
    # Through a plain dict of numpy arrays (what a checkpoint holds) into a fresh module.
    saved = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(m)))
    fresh = MultiHeadAttention(H, F, num_kv_heads=2, causal=True, rngs=nnx.Rngs(7))
    state = nnx.state(fresh)
    nnx.replace_by_pure_dict(state, saved)
    nnx.update(fresh, state)
    assert_close(call(fresh, x), y, 0, "pure dict")


def test_nnx_bf16_compute():
    m = MultiHeadAttention(H, F, causal=True, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    x = inputs(1, 2, 16, F)
    y = nnx.jit(lambda m, x: m(x))(m, x)
    assert y.dtype == jnp.bfloat16
    want = jax.jit(lambda p: ref_mha(p, x, x, causal=True))(nnx_params(m))
    assert_close(y.astype(jnp.float32), want, tol=3e-2)


def test_module_rejects_bad_config():
    with pytest.raises(ValueError, match="num_kv_heads"):
        MultiHeadAttention(4, F, num_kv_heads=3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="num_heads"):
        MultiHeadAttention(5, F, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="in_features|features"):
        MultiHeadAttention(H, F, rngs=nnx.Rngs(0))(inputs(0, 2, 4, F + 1))
    with pytest.raises(ValueError, match="num_kv_heads"):
        EqxAttention(4, F, num_kv_heads=3, key=jax.random.key(0))
    with pytest.raises(ValueError, match="unbatched"):
        EqxAttention(H, F, key=jax.random.key(0))(inputs(0, 2, 4, F))


def test_nnx_learnable_sinks():
    """use_sinks: a (num_heads,) float32 parameter, zero at creation; forward and every
    gradient (the sinks' included, nonzero) match the reference with the same sinks."""
    m = MultiHeadAttention(H, F, num_kv_heads=2, causal=True, window_size=(3, -1),
                           use_sinks=True, rngs=nnx.Rngs(0))
    assert m.sinks[...].shape == (H,) and m.sinks[...].dtype == jnp.float32
    assert not m.sinks[...].any()
    assert MultiHeadAttention(H, F, rngs=nnx.Rngs(0)).sinks is None
    m.sinks[...] = jnp.array([0.5, -1.0, 2.0, 0.0])  # trained values, not the zero start
    xq, xkv, dy = inputs(1, 2, 7, F), inputs(2, 2, 11, F), inputs(3, 2, 7, F)
    y, g = nnx_out_and_grad(m, lambda m: m(xq, xkv), dy)
    y_ref, g_ref = out_and_grad(
        lambda p: ref_mha(p, xq, xkv, causal=True, window_size=(3, -1)), nnx_params(m), dy)
    assert_close(y, y_ref, name="forward")
    assert_trees_close(g, g_ref, 1e-4)
    assert float(jnp.abs(g["sinks"]).min()) > 0


def _packed_inputs(batch, seqlen, seed, empty_rows=(1,)):
    """Segment ids (a one-token document, padding tails, `empty_rows` all padding) and
    positions restarting at each document, as jnp int32."""
    ids = segment_helpers.packed_ids(seed, batch, seqlen, docs=4, empty_rows=empty_rows)
    return jnp.asarray(ids), jnp.asarray(segment_helpers.restart_positions(ids))


def test_nnx_segment_ids_match_reference():
    """Packed self-attention (GQA, causal + window, RoPE): segment ids with positions that
    restart at each document, forward and gradients against the reference with the dense
    document mask; the same without positions (row-index band: equal for contiguous
    documents, and RoPE only sees differences); an all-padding row gives the out bias."""
    m = MultiHeadAttention(H, F, num_kv_heads=2, causal=True, window_size=(5, -1), rope=True,
                           rngs=nnx.Rngs(0))
    x, dy = inputs(1, 3, 14, F), inputs(2, 3, 14, F)
    ids, pos = _packed_inputs(3, 14, seed=3)
    opts = dict(causal=True, window_size=(5, -1))
    y, g = nnx_out_and_grad(m, lambda m: m(x, segment_ids=ids, positions=pos), dy)
    seg = (np.asarray(ids), None, np.asarray(pos), None)
    y_ref, g_ref = out_and_grad(
        lambda p: ref_mha(p, x, x, rope=True, q_pos=pos, k_pos=pos, segments=seg, **opts),
        nnx_params(m), dy)
    assert_close(y, y_ref, name="forward")
    assert_trees_close(g, g_ref, 1e-4)
    assert_close(y[1], jnp.broadcast_to(m.out.bias[...], y[1].shape), 0, "all-padding row")
    y_rows = nnx.jit(lambda m, x, ids: m(x, segment_ids=ids))(m, x, ids)
    assert_close(y_rows, y, 1e-5, "row positions")
    # Without segment ids the documents see each other: a different result.
    assert float(jnp.abs(nnx.jit(lambda m, x: m(x))(m, x) - y).max()) > 1e-3


def test_nnx_cross_attention_kv_segment_ids_and_errors():
    """Cross-attention with the keys' own segment ids (seqlen_q != seqlen_k, no RoPE,
    positions for the mask only); bad combinations raise naming the argument."""
    m = MultiHeadAttention(H, F, num_kv_heads=1, causal=True, rngs=nnx.Rngs(0))
    xq, xkv, dy = inputs(1, 2, 8, F), inputs(2, 2, 12, F), inputs(3, 2, 8, F)
    q_ids, q_pos = _packed_inputs(2, 8, seed=5, empty_rows=())
    kv_ids, kv_pos = _packed_inputs(2, 12, seed=6, empty_rows=())
    call = lambda m: m(xq, xkv, segment_ids=q_ids, kv_segment_ids=kv_ids, positions=q_pos,
                       kv_positions=kv_pos)
    y, g = nnx_out_and_grad(m, call, dy)
    seg = tuple(np.asarray(a) for a in (q_ids, kv_ids, q_pos, kv_pos))
    y_ref, g_ref = out_and_grad(lambda p: ref_mha(p, xq, xkv, causal=True, segments=seg),
                                nnx_params(m), dy)
    assert_close(y, y_ref, name="forward")
    assert_trees_close(g, g_ref, 1e-4)
    with pytest.raises(ValueError, match="kv_segment_ids"):
        m(xq, xkv, segment_ids=q_ids)  # the keys' ids cannot default to the queries'
    with pytest.raises(ValueError, match="segment_ids"):
        m(xq, xkv, kv_segment_ids=kv_ids)
    with pytest.raises(ValueError, match="rope=True or with segment_ids"):
        m(xq, xkv, positions=q_pos)
    with pytest.raises(ValueError, match="segment_ids must have shape"):
        m(xq, xkv, segment_ids=q_ids[:, :5], kv_segment_ids=kv_ids)


# ------------------------------------------------------------------ attention_fn adapter


def _padding_mask(batch_shape, sq, sk, seed):
    lengths = jax.random.randint(jax.random.key(seed), batch_shape, sk // 2, sk + 1)
    valid_k = jnp.arange(sk) < lengths[..., None]
    return nnx.make_attention_mask(jnp.ones(batch_shape + (sq,)), valid_k)  # float 0/1 mask


@pytest.mark.parametrize("num_kv_heads", [4, 2])
def test_attention_fn_in_stock_nnx_mha(num_kv_heads):
    kwargs = dict(num_kv_heads=num_kv_heads, decode=False)
    stock = nnx.MultiHeadAttention(H, F, rngs=nnx.Rngs(0), **kwargs)
    ours = nnx.MultiHeadAttention(H, F, attention_fn=attention_fn, rngs=nnx.Rngs(0), **kwargs)
    x = inputs(1, 2, 3, 9, F)  # two batch axes
    mask = _padding_mask((2, 3), 9, 9, seed=2)
    calls = (dict(), dict(is_causal=True), dict(mask=mask), dict(mask=mask, is_causal=True))
    run = nnx.jit(lambda m: [m(x, **c) for c in calls])
    for c, got, want in zip(calls, run(ours), run(stock)):
        assert_close(got, want, name=str(list(c)))
    dy = inputs(4, 2, 3, 9, F)
    y, g = nnx_out_and_grad(ours, lambda m: m(x, mask=mask, is_causal=True), dy)
    y_ref, g_ref = nnx_out_and_grad(stock, lambda m: m(x, mask=mask, is_causal=True), dy)
    assert_trees_close(g, g_ref, 1e-4)


def test_attention_fn_nnx_decode_cache():
    """Decoding token by token with Flax's KV cache (which passes a mask) matches the causal
    forward over the whole sequence."""
    m = nnx.MultiHeadAttention(H, F, num_kv_heads=2, decode=False, attention_fn=attention_fn,
                               rngs=nnx.Rngs(0))
    x = inputs(1, 2, 6, F)
    full = nnx.jit(lambda m, x: m(x, is_causal=True))(m, x)
    m.init_cache(x.shape)
    step = nnx.jit(lambda m, x: m(x, decode=True))
    steps = [step(m, x[:, i : i + 1]) for i in range(x.shape[1])]
    assert_close(jnp.concatenate(steps, axis=1), full, name="decode")


def test_attention_fn_unbatched_bias_and_top_left_causal():
    q, k, v = inputs(1, 5, H, 8), inputs(2, 7, 2, 8), inputs(3, 7, 2, 8)
    bias = inputs(4, H, 5, 7)
    for kw in (dict(bias=bias), dict(is_causal=True)):  # Flax's is_causal: top-left when 5 != 7
        want = jax.jit(lambda q, k, v: nnx.dot_product_attention(q, k, v, **kw))(q, k, v)
        got = jax.jit(lambda q, k, v: attention_fn(q, k, v, **kw))(q, k, v)
        assert_close(got, want, name=str(list(kw)))
    # A (q, k) mask for batched inputs broadcasts over batch and heads.
    q, k, v = q[None].repeat(2, 0), k[None].repeat(2, 0), v[None].repeat(2, 0)
    mask = jax.random.bernoulli(jax.random.key(5), 0.7, (5, 7)).at[:, 0].set(True)
    want = jax.jit(nnx.dot_product_attention)(q, k, v, mask=mask)
    assert_close(jax.jit(attention_fn)(q, k, v, mask=mask), want, name="2-D mask")


def test_attention_fn_handles_or_rejects_every_flax_argument():
    stock_args = ("mask", "dropout_rng", "dropout_rate", "broadcast_dropout", "deterministic",
                  "dtype", "precision", "module", "is_causal", "bias", "promote_dtype")
    params = importlib.import_module("inspect").signature(attention_fn).parameters
    assert all(a in params for a in stock_args)

    x = inputs(1, 2, 5, F)
    # Dropout configured but off (deterministic) is fine; on, it is an error.
    m = nnx.MultiHeadAttention(H, F, dropout_rate=0.1, decode=False, attention_fn=attention_fn,
                               rngs=nnx.Rngs(0, dropout=1))
    m(x, deterministic=True)
    with pytest.raises(NotImplementedError, match="dropout"):
        m(x, deterministic=False)
    m = nnx.MultiHeadAttention(H, F, decode=False, attention_fn=attention_fn, rngs=nnx.Rngs(0))
    with pytest.raises(NotImplementedError, match="sow_weights"):
        m(x, sow_weights=True)
    with pytest.raises(ValueError, match="precision"):
        nnx.MultiHeadAttention(H, F, decode=False, precision=HIGHEST, attention_fn=attention_fn,
                               rngs=nnx.Rngs(0))(x)
    lenient = make_attention_fn(ignore_precision=True)
    nnx.MultiHeadAttention(H, F, decode=False, precision=HIGHEST, attention_fn=lenient,
                           rngs=nnx.Rngs(0))(x)
    q = inputs(2, 2, 5, H, 8)
    with pytest.raises(NotImplementedError, match="einsum"):
        attention_fn(q, q, q, qk_attn_weights_einsum=jnp.einsum)


def test_attention_fn_in_linen_mha():
    x = inputs(1, 2, 8, F)
    mask = _padding_mask((2,), 8, 8, seed=3) * linen.make_causal_mask(jnp.ones((2, 8)))
    stock = linen.MultiHeadDotProductAttention(num_heads=H)
    ours = linen.MultiHeadDotProductAttention(num_heads=H, attention_fn=attention_fn)
    params = stock.init(jax.random.key(0), x)
    assert_close(jax.jit(ours.apply)(params, x, mask=mask), jax.jit(stock.apply)(params, x, mask=mask))
    with pytest.raises(NotImplementedError, match="dropout"):
        linen.MultiHeadDotProductAttention(num_heads=H, dropout_rate=0.5, attention_fn=attention_fn
                                           ).apply(params, x, deterministic=False,
                                                   rngs={"dropout": jax.random.key(1)})


# ------------------------------------------------------------------ Flax Linen module


@pytest.mark.parametrize("causal", [False, True])
def test_linen_matches_flax_mha(causal):
    ours = LinenMultiHeadAttention(num_heads=H, causal=causal)
    stock = linen.MultiHeadDotProductAttention(num_heads=H)
    x, dy = inputs(1, 2, 10, F), inputs(2, 2, 10, F)
    params = ours.init(jax.random.key(0), x)
    assert jax.tree.structure(params) == jax.tree.structure(stock.init(jax.random.key(0), x))
    mask = linen.make_causal_mask(jnp.ones((2, 10))) if causal else None
    y, g = out_and_grad(lambda p: ours.apply(p, x), params, dy)
    y_ref, g_ref = out_and_grad(lambda p: stock.apply(p, x, mask=mask), params, dy)
    assert_close(y, y_ref, name="forward")
    assert_trees_close(g, g_ref, 1e-4)


def test_linen_gqa_rope_matches_reference_and_roundtrips():
    m = LinenMultiHeadAttention(num_heads=H, num_kv_heads=2, causal=True, rope=True, softcap=8.0)
    x = inputs(1, 2, 12, F)
    params = jax.jit(m.init)(jax.random.key(0), x)
    pos, dy = jnp.arange(12), inputs(2, 2, 12, F)
    y, g = out_and_grad(lambda p: m.apply({"params": p}, x), params["params"], dy)
    y_ref, g_ref = out_and_grad(
        lambda p: ref_mha(p, x, x, rope=True, q_pos=pos, k_pos=pos, causal=True, softcap=8.0),
        params["params"], dy)
    assert_close(y, y_ref, name="forward")
    assert_trees_close(g, g_ref, 1e-4)
    assert_close(jax.jit(jax.vmap(lambda x: m.apply(params, x)))(x), y, name="vmap")
    restored = serialization.from_bytes(jax.jit(m.init)(jax.random.key(5), x),
                                        serialization.to_bytes(params))
    assert_close(jax.jit(m.apply)(restored, x), y, 0, "serialization round trip")


def test_linen_learnable_sinks():
    m = LinenMultiHeadAttention(num_heads=H, num_kv_heads=2, causal=True, use_sinks=True)
    x, dy = inputs(1, 2, 9, F), inputs(2, 2, 9, F)
    params = jax.jit(m.init)(jax.random.key(0), x)["params"]
    assert params["sinks"].shape == (H,) and params["sinks"].dtype == jnp.float32
    assert not params["sinks"].any()
    params = {**params, "sinks": jnp.array([1.0, -0.5, 0.0, 3.0])}
    y, g = out_and_grad(lambda p: m.apply({"params": p}, x), params, dy)
    y_ref, g_ref = out_and_grad(lambda p: ref_mha(p, x, x, causal=True), params, dy)
    assert_close(y, y_ref, name="forward")
    assert_trees_close(g, g_ref, 1e-4)
    assert float(jnp.abs(g["sinks"]).min()) > 0
    plain = LinenMultiHeadAttention(num_heads=H).init(jax.random.key(0), x)["params"]
    assert "sinks" not in plain


def test_linen_segment_ids_match_reference():
    """Linen with segment ids (and positions), under jit and vmap over unbatched rows."""
    m = LinenMultiHeadAttention(num_heads=H, num_kv_heads=2, causal=True, rope=True)
    x, dy = inputs(1, 2, 11, F), inputs(2, 2, 11, F)
    ids, pos = _packed_inputs(2, 11, seed=7)
    params = jax.jit(m.init)(jax.random.key(0), x)["params"]
    y, g = out_and_grad(lambda p: m.apply({"params": p}, x, segment_ids=ids, positions=pos),
                        params, dy)
    seg = (np.asarray(ids), None, np.asarray(pos), None)
    y_ref, g_ref = out_and_grad(
        lambda p: ref_mha(p, x, x, rope=True, q_pos=pos, k_pos=pos, causal=True, segments=seg),
        params, dy)
    assert_close(y, y_ref, name="forward")
    assert_trees_close(g, g_ref, 1e-4)
    vmapped = jax.jit(jax.vmap(lambda x, i, p_: m.apply({"params": params}, x, segment_ids=i,
                                                        positions=p_)))(x, ids, pos)
    assert_close(vmapped, y, name="vmap")


# ------------------------------------------------------------------ Equinox module


def eqx_as_flax_params(m, head_dim=8, vo_size=None):
    """The Equinox projections (and sinks) as a Flax-layout dict, for ref_mha."""
    vo_size = head_dim if vo_size is None else vo_size

    def proj(lin, size):
        w = lin.weight.T  # (in, heads * size)
        p = {"kernel": w.reshape(w.shape[0], -1, size)}
        if lin.bias is not None:
            p["bias"] = lin.bias.reshape(-1, size)
        return p

    out = {"kernel": m.output_proj.weight.T.reshape(-1, vo_size, m.output_proj.weight.shape[0])}
    if m.output_proj.bias is not None:
        out["bias"] = m.output_proj.bias
    params = {"query": proj(m.query_proj, head_dim), "key": proj(m.key_proj, head_dim),
              "value": proj(m.value_proj, vo_size), "out": out}
    if m.sinks is not None:
        params["sinks"] = m.sinks
    return params


def eqx_out_and_grad(module, call, dy):
    """call(module) and its gradient (a module-shaped tree) for the cotangent dy."""
    params, static = eqx.partition(module, eqx.is_array)
    return out_and_grad(lambda p: call(eqx.combine(p, static)), params, dy)


def test_eqx_matches_equinox_mha():
    ours = EqxAttention(H, F, use_query_bias=True, use_output_bias=True, key=jax.random.key(0))
    stock = eqx.nn.MultiheadAttention(H, F, use_query_bias=True, use_output_bias=True,
                                      key=jax.random.key(0))
    for name in ("query_proj", "key_proj", "value_proj", "output_proj"):  # same layout, same init
        assert_close(getattr(ours, name).weight, getattr(stock, name).weight, 0, name)
    x, dy = inputs(1, 9, F), inputs(2, 9, F)
    y, g = eqx_out_and_grad(ours, lambda m: m(x), dy)
    y_ref, g_ref = eqx_out_and_grad(stock, lambda m: m(x, x, x), dy)
    assert_close(y, y_ref, name="forward")
    projs = ("query_proj", "key_proj", "value_proj", "output_proj")
    assert_trees_close([getattr(g, n) for n in projs], [getattr(g_ref, n) for n in projs], 1e-4)


@pytest.mark.parametrize("opts", [dict(causal=True, rope=True), dict(window_size=(2, 1), softcap=4.0)])
def test_eqx_gqa_options_match_reference(opts):
    m = EqxAttention(H, F, num_kv_heads=2, use_query_bias=True, key=jax.random.key(0), **opts)
    opts = dict(opts)
    rope = opts.pop("rope", False)
    xq, xkv, dy = inputs(1, 6, F), inputs(2, 10, F), inputs(3, 6, F)
    q_pos, k_pos = jnp.arange(6) + 4, jnp.arange(10)
    y, g = eqx_out_and_grad(m, lambda m: m(xq, xkv), dy)
    y_ref, g_ref = out_and_grad(
        lambda p: ref_mha(p, xq, xkv, rope=rope, q_pos=q_pos, k_pos=k_pos, **opts),
        eqx_as_flax_params(m), dy)
    assert_close(y, y_ref, name="forward")
    assert_trees_close(eqx_as_flax_params(g), g_ref, 1e-4)


def test_eqx_learnable_sinks_and_value_head_dim():
    """use_sinks and vo_size != qk_size (each head's values and outputs): forward and every
    gradient, the sinks' included, match the reference."""
    m = EqxAttention(H, F, num_kv_heads=2, qk_size=8, vo_size=12, causal=True, use_sinks=True,
                     key=jax.random.key(0))
    assert m.sinks.shape == (H,) and m.sinks.dtype == jnp.float32 and not m.sinks.any()
    assert EqxAttention(H, F, key=jax.random.key(0)).sinks is None
    m = eqx.tree_at(lambda m: m.sinks, m, jnp.array([0.5, 2.0, -1.0, 0.0]))
    x, dy = inputs(1, 10, F), inputs(2, 10, F)
    y, g = eqx_out_and_grad(m, lambda m: m(x), dy)
    y_ref, g_ref = out_and_grad(lambda p: ref_mha(p, x, x, causal=True),
                                eqx_as_flax_params(m, 8, 12), dy)
    assert_close(y, y_ref, name="forward")
    assert_trees_close(eqx_as_flax_params(g, 8, 12), g_ref, 1e-4)
    assert float(jnp.abs(g.sinks).min()) > 0
    batched = eqx.filter_jit(lambda m, x: jax.vmap(m)(x))(m, jnp.stack([x, -x]))
    assert_close(batched[0], y, name="vmap")


def test_eqx_segment_ids_under_vmap():
    """Equinox takes unbatched (seqlen,) segment ids and positions and batches them with the
    sequence under jax.vmap (one batched attention call, no loop); forward and gradients
    match the reference with the dense document mask."""
    m = EqxAttention(H, F, num_kv_heads=2, causal=True, rope=True, use_query_bias=True,
                     key=jax.random.key(0))
    x, dy = inputs(1, 3, 10, F), inputs(2, 3, 10, F)
    ids, pos = _packed_inputs(3, 10, seed=9)
    call = lambda m: jax.vmap(lambda x, i, p: m(x, segment_ids=i, positions=p))(x, ids, pos)
    y, g = eqx_out_and_grad(m, call, dy)
    seg = (np.asarray(ids), None, np.asarray(pos), None)
    y_ref, g_ref = out_and_grad(
        lambda p: ref_mha(p, x, x, rope=True, q_pos=pos, k_pos=pos, causal=True, segments=seg),
        eqx_as_flax_params(m), dy)
    assert_close(y, y_ref, name="forward")
    assert_trees_close(eqx_as_flax_params(g), g_ref, 1e-4)
    assert_close(m(x[0], segment_ids=ids[0], positions=pos[0]), y[0], name="one row")
    assert not _loops_of_length(jax.make_jaxpr(call)(m).jaxpr, 3)


def _loops_of_length(jaxpr, n):
    """scan/while equations (at any depth) that could iterate over n items."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "while" or (eqn.primitive.name == "scan" and eqn.params["length"] == n):
            found.append(eqn.primitive.name)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _loops_of_length(sub, n)
    return found


def test_eqx_vmap_jit_grad_and_serialisation():
    m = EqxAttention(H, F, num_kv_heads=1, causal=True, rope=True, key=jax.random.key(0))
    x = inputs(1, 3, 10, F)
    run = eqx.filter_jit(lambda m, x: jax.vmap(m)(x))
    batched = run(m, x)
    assert_close(batched, jnp.stack([m(xi) for xi in x]), name="vmap vs loop")
    # Batched by the attention's batching rule, not by a loop over the 3 examples.
    assert not _loops_of_length(jax.make_jaxpr(jax.vmap(m))(x).jaxpr, 3)
    # vmap over the model too (an ensemble of attention layers), as Equinox users do.
    keys = jax.random.split(jax.random.key(1), 2)
    ensemble = eqx.filter_vmap(lambda k: EqxAttention(H, F, causal=True, key=k))(keys)
    ys = eqx.filter_vmap(lambda mod, x: jax.vmap(mod)(x))(ensemble, jnp.stack([x, x]))
    assert ys.shape == (2, 3, 10, F)

    g = eqx.filter_jit(eqx.filter_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2)))(m)
    assert all(float(jnp.abs(a).max()) > 0 for a in jax.tree.leaves(eqx.filter(g, eqx.is_array)))

    buf = io.BytesIO()
    eqx.tree_serialise_leaves(buf, m)
    buf.seek(0)
    like = EqxAttention(H, F, num_kv_heads=1, causal=True, rope=True, key=jax.random.key(9))
    restored = eqx.tree_deserialise_leaves(buf, like)
    assert_close(run(restored, x), batched, 0, "serialise")
    leaves, treedef = jax.tree_util.tree_flatten(m)
    assert_close(run(jax.tree_util.tree_unflatten(treedef, leaves), x), batched, 0, "flatten")


# ------------------------------------------------------------------ RoPE and optional imports


def test_rope_is_relative():
    q, k = inputs(1, 1, 8, 8), inputs(2, 1, 8, 8)  # (seq=1, heads, dim)
    def score(m, n):
        return jnp.sum(apply_rope(q, jnp.array([m])) * apply_rope(k, jnp.array([n])), -1)
    assert_close(score(3, 1), score(10, 8), 1e-5)
    assert_close(jnp.linalg.norm(apply_rope(q, jnp.array([5])), axis=-1), jnp.linalg.norm(q, axis=-1))
    with pytest.raises(ValueError, match="even"):
        apply_rope(inputs(0, 1, 1, 7), jnp.array([0]))


@pytest.mark.parametrize("extra, package", [("flax", "flax"), ("equinox", "equinox")])
def test_missing_optional_dependency_names_the_extra(monkeypatch, extra, package):
    for name in list(sys.modules):
        if name == package or name.startswith(package + "."):
            monkeypatch.setitem(sys.modules, name, None)  # None makes `import` raise ImportError
    monkeypatch.delitem(sys.modules, f"jax_fa3.nn.{extra}")
    monkeypatch.delattr(jax_fa3.nn, extra)
    with pytest.raises(ImportError, match=rf"pip install 'jax-fa3\[{extra}\]'"):
        importlib.import_module(f"jax_fa3.nn.{extra}")
    with pytest.raises(ImportError, match=rf"jax-fa3\[{extra}\]"):
        getattr(jax_fa3.nn, extra)
