"""The public API: flash_attention through its dispatch, implementation selection, exports,
the internal ring entry points, and dot_product_attention against jax.nn."""

from __future__ import annotations

import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa3
from helpers import check_against_oracle, random_like, random_qkv
from jax_fa3 import _ffi, attention, portable
from jax_fa3.attention import dot_product_attention, flash_attention

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
NOT_BUILT = _ffi.unavailable_reason("fwd", BF16, 128) is not None


def _fwd_and_grads(q, k, v, dout, **opts):
    @jax.jit
    def run(q, k, v):
        (out, lse), vjp = jax.vjp(lambda q, k, v: flash_attention(q, k, v, return_lse=True,
                                                                   **opts), q, k, v)
        return out, lse, vjp((dout, jnp.zeros_like(lse)))

    return run(q, k, v)


@pytest.mark.parametrize("case", [
    (BF16, 2, 40, 70, 8, 2, 64, dict(causal=True)),
    (F16, 1, 70, 40, 4, 4, 128, dict(window_size=(9, 3), softcap=6.0)),
    (F32, 3, 33, 33, 4, 1, 32, dict(causal=True, window_size=(5, -1), softmax_scale=0.5)),
], ids=["bf16-gqa-causal", "f16-window-softcap", "f32-mqa-window"])
def test_flash_attention_matches_oracle(case):
    dtype, b, sq, sk, hq, hkv, d, opts = case
    q, k, v = random_qkv(11, b, sq, sk, hq, hkv, d, dtype)
    dout = random_like(12, q)
    out, lse, grads = _fwd_and_grads(q, k, v, dout, **opts)
    check_against_oracle("flash_attention", q, k, v, out, lse, grads, dout, **opts)


def test_default_dispatch_is_portable_without_kernel():
    q, k, v = random_qkv(13, 2, 16, 24, 4, 2, 32, BF16)
    got = flash_attention(q, k, v, causal=True, return_lse=True)
    want = portable.forward(q, k, v, softmax_scale=1 / math.sqrt(32), left=1 << 30,
                            right=0)
    if NOT_BUILT:
        assert attention.resolve_implementation(None, q, k) == "xla"
        for a, b in zip(got, want):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_outputs_shapes_dtypes_and_default_scale():
    q, k, v = random_qkv(14, 3, 5, 9, 6, 3, 16, F16)
    out, lse = flash_attention(q, k, v, return_lse=True)
    assert out.shape == q.shape and out.dtype == F16
    assert lse.shape == (3, 6, 5) and lse.dtype == F32
    explicit = flash_attention(q, k, v, softmax_scale=0.25)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(explicit, np.float32))
    assert flash_attention(q, k, v, implementation="xla").shape == q.shape


def test_accepts_numpy_inputs():
    q, k, v = (np.asarray(x) for x in random_qkv(15, 1, 4, 4, 2, 2, 8, F32))
    out = flash_attention(q, k, v)
    assert isinstance(out, jax.Array) and out.shape == q.shape


def test_implementation_selection_on_this_machine():
    q, k, _ = random_qkv(16, 1, 4, 4, 2, 2, 64, BF16)
    assert attention.resolve_implementation("xla", q, k) == "xla"
    if NOT_BUILT:
        reason = _ffi.unavailable_reason("fwd", BF16, 64)
        assert attention.resolve_implementation(None, q, k) == "xla"
        assert attention.resolve_implementation("cuda", q, k, "bwd") == "xla"
        with pytest.raises(RuntimeError, match="implementation='cuda'") as err:
            flash_attention(q, k, k, implementation="cuda")
        assert reason in str(err.value)


@pytest.mark.parametrize("dtype,head_dim,match", [(F32, 64, "bfloat16 or float16"),
                                                  (BF16, 36, "multiple of 8")])
def test_cuda_rejects_what_the_kernel_cannot_take(dtype, head_dim, match):
    q, k, v = random_qkv(17, 1, 4, 4, 2, 2, head_dim, dtype)
    with pytest.raises(ValueError, match=match):
        flash_attention(q, k, v, implementation="cuda")
    assert flash_attention(q, k, v).shape == q.shape  # None falls back to the portable path
    assert attention.unavailable_reason("fwd", dtype, head_dim) is not None


def test_exports_and_availability():
    for name in ("flash_attention", "dot_product_attention", "build_info", "kernel_available",
                 "unavailable_reason"):
        assert name in jax_fa3.__all__ and callable(getattr(jax_fa3, name))
    reason = jax_fa3.unavailable_reason("fwd", BF16, 128)
    assert jax_fa3.kernel_available("fwd", BF16, 128) == (reason is None)
    assert (jax_fa3.build_info() is None) == (not jax_fa3.is_built())
    if not jax_fa3.is_built():
        assert "not built" in reason


def test_internal_entry_points_keep_their_signatures():
    fwd = inspect.signature(attention.attention_fwd)
    assert list(fwd.parameters) == ["q", "k", "v", "softmax_scale", "softcap", "left", "right",
                                    "implementation"]
    bwd = inspect.signature(attention.attention_bwd)
    assert list(bwd.parameters)[:12] == ["q", "k", "v", "out", "lse", "dout", "softmax_scale",
                                         "softcap", "left", "right", "deterministic",
                                         "implementation"]
    for sig, first_kw in ((fwd, "softmax_scale"), (bwd, "softmax_scale")):
        assert sig.parameters[first_kw].kind is inspect.Parameter.KEYWORD_ONLY


# ----------------------------------------------------------------------------- jax.nn parity

def _nn_inputs(b=2, t=12, s=20, n=4, kh=2, h=16, seed=20):
    q, k, v = random_qkv(seed, b, t, s, n, kh, h, F32)
    rng = np.random.default_rng(seed)
    mask = rng.random((b, 1, t, s)) < 0.6
    mask[..., 0] = True  # every row keeps a key: jax.nn differs on fully masked rows by design
    bias = jnp.asarray(rng.standard_normal((1, n, t, s)), F32)
    return q, k, v, jnp.asarray(mask), bias


NN_OPTIONS = {
    "plain": lambda m, bias: {},
    "causal": lambda m, bias: dict(is_causal=True),
    "window-int": lambda m, bias: dict(local_window_size=3),
    "window-pair-causal": lambda m, bias: dict(local_window_size=(4, 2), is_causal=True),
    "scale": lambda m, bias: dict(scale=0.3),
    "bias": lambda m, bias: dict(bias=bias),
    "bias-row-broadcast": lambda m, bias: dict(bias=bias[:, :, :1]),
    "mask": lambda m, bias: dict(mask=m),
    "q-lengths": lambda m, bias: dict(query_seq_lengths=jnp.array([12, 5], jnp.int32)),
    "kv-lengths-causal": lambda m, bias: dict(key_value_seq_lengths=jnp.array([20, 7], jnp.int32),
                                             is_causal=True),
    "everything": lambda m, bias: dict(
        bias=bias, mask=m, is_causal=True, local_window_size=(6, 0),
        query_seq_lengths=jnp.array([9, 12], jnp.int32),
        key_value_seq_lengths=jnp.array([20, 15], jnp.int32)),
}


@pytest.mark.parametrize("name", list(NN_OPTIONS))
@pytest.mark.parametrize("t,s", [(12, 20), (20, 12)], ids=["T<S", "T>S"])
def test_dot_product_attention_matches_jax_nn(name, t, s):
    q, k, v, mask, bias = _nn_inputs(t=t, s=s)
    kw = NN_OPTIONS[name](mask, bias)
    if t > s and "local_window_size" in kw:  # keep every query row non-empty (see docstring)
        kw["local_window_size"] = (t, kw["local_window_size"][1]) if isinstance(
            kw["local_window_size"], tuple) else t
    dout = random_like(21, q)

    def run(fn):
        loss = lambda q, k, v: (fn(q, k, v, **kw) * dout).sum()
        return jax.jit(lambda q, k, v: (fn(q, k, v, **kw), jax.value_and_grad(
            loss, argnums=(0, 1, 2))(q, k, v)))(q, k, v)

    got_out, (got_loss, got) = run(dot_product_attention)
    want_out, (want_loss, want) = run(jax.nn.dot_product_attention)
    np.testing.assert_allclose(got_out, want_out, atol=3e-6)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5, atol=1e-5)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, atol=2e-5)


def test_dot_product_attention_bias_gradient_and_bf16():
    q, k, v, mask, bias = _nn_inputs()
    loss = lambda fn: lambda bias: (fn(q, k, v, bias=bias, mask=mask) ** 2).sum()
    np.testing.assert_allclose(jax.jit(jax.grad(loss(dot_product_attention)))(bias),
                               jax.jit(jax.grad(loss(jax.nn.dot_product_attention)))(bias),
                               atol=2e-5)
    qb, kb, vb = (x.astype(BF16) for x in (q, k, v))
    causal = lambda fn: jax.jit(lambda q, k, v: fn(q, k, v, is_causal=True))
    got = causal(dot_product_attention)(qb, kb, vb)
    want = causal(jax.nn.dot_product_attention)(qb, kb, vb)
    assert got.dtype == BF16
    np.testing.assert_allclose(np.asarray(got, F32), np.asarray(want, F32), atol=2e-2)


def test_dot_product_attention_unbatched_and_residual():
    q, k, v, mask, bias = _nn_inputs()
    q3, k3, v3 = q[0], k[0], v[0]
    run = lambda fn: jax.jit(lambda q, k, v: fn(q, k, v, is_causal=True, return_residual=True))
    got, res = run(dot_product_attention)(q3, k3, v3)
    want, want_res = run(jax.nn.dot_product_attention)(q3, k3, v3)
    assert got.shape == q3.shape and res.shape == want_res.shape == q3.shape[:-1]
    np.testing.assert_allclose(got, want, atol=3e-6)
    np.testing.assert_allclose(res, want_res, atol=3e-6)
    run = lambda fn: jax.jit(lambda q, k, v: fn(q, k, v, bias=bias[0], mask=mask[0]))
    np.testing.assert_allclose(run(dot_product_attention)(q3, k3, v3),
                               run(jax.nn.dot_product_attention)(q3, k3, v3), atol=3e-6)


def test_dot_product_attention_fully_masked_row_is_zero():
    """The one documented difference: jax.nn averages all values for a row that sees no key;
    we return 0 (and no NaN in gradients)."""
    q, k, v, mask, _ = _nn_inputs()
    mask = mask.at[0, 0, 3].set(False)
    out = dot_product_attention(q, k, v, mask=mask)
    assert (np.asarray(out)[0, 3] == 0).all()
    g = jax.grad(lambda q: dot_product_attention(q, k, v, mask=mask).sum())(q)
    assert np.isfinite(np.asarray(g)).all() and (np.asarray(g)[0, 3] == 0).all()


def test_dot_product_attention_cuda_refuses_what_the_kernel_cannot_do():
    q, k, v, mask, bias = _nn_inputs()
    qb, kb, vb = (x.astype(BF16) for x in (q, k, v))
    with pytest.raises(ValueError, match="bias"):
        dot_product_attention(qb, kb, vb, bias=bias, implementation="cuda")
    with pytest.raises(ValueError, match="key_value_seq_lengths"):
        dot_product_attention(qb, kb, vb, implementation="cuda",
                              key_value_seq_lengths=jnp.array([3, 4], jnp.int32))
    xla = dot_product_attention(q, k, v, mask=mask, implementation="xla")
    np.testing.assert_array_equal(xla, dot_product_attention(q, k, v, mask=mask))
