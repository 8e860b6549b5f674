"""The public API: flash_attention through its dispatch and route, implementation selection
and the reasons given, exports, and dot_product_attention against jax.nn.

Every test asserts on a machine with the kernels and on one without: where the two differ,
each side has its own assertion (the kernel's result against the oracle, the kernel's
custom call in the lowered program, or the error that names the missing GPU)."""

from __future__ import annotations

import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa3
from helpers import check_against_oracle, random_like, random_qkv, random_sinks
from jax_fa3 import _core, _ffi, attention, portable, sharding
from jax_fa3 import dot_product_attention, flash_attention

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
MACHINE = _ffi.extension_reason()  # no Hopper GPU or no build: None on the H200 with the kernels


def _fwd_and_grads(q, k, v, dout, **opts):
    @jax.jit
    def run(q, k, v):
        (out, lse), vjp = jax.vjp(lambda q, k, v: flash_attention(q, k, v, return_lse=True,
                                                                   **opts), q, k, v)
        return out, lse, vjp((dout, jnp.zeros_like(lse)))

    return run(q, k, v)


def _calls_kernel(f, *args) -> bool:
    """Whether the lowered program of f(*args) holds the forward kernel's custom call."""
    return f"@{_ffi.FWD_TARGET}(" in jax.jit(f).lower(*args).as_text()


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


@pytest.mark.parametrize("case", [
    (BF16, 2, 40, 70, 8, 2, 192, 128, dict(causal=True)),
    (F16, 1, 70, 40, 4, 4, 80, 80, dict(window_size=(9, 3), softcap=6.0)),
    (BF16, 1, 129, 129, 4, 2, 64, 128, dict(causal=True, window_size=(16, -1))),
    (F32, 2, 33, 17, 4, 1, 36, 20, dict(causal=True, window_size=(5, -1))),
], ids=["bf16-mla-gqa-causal", "f16-hd80-window-softcap", "bf16-64/128-sliding-window",
        "f32-36/20-mqa"])
def test_flash_attention_with_sinks_and_value_head_dim_matches_oracle(case):
    """Through the public API (the kernel where it can run the call): out, lse and the
    gradients of q, k, v and sinks by the error-ratio rule."""
    dtype, b, sq, sk, hq, hkv, d, dv, opts = case
    q, k, v = random_qkv(41, b, sq, sk, hq, hkv, d, dtype, head_dim_v=dv)
    sinks = random_sinks(42, hq, loc=2.0)
    dout = random_like(43, jnp.zeros((b, sq, hq, dv), dtype))

    @jax.jit
    def run(q, k, v, sinks):  # lse as aux: no LSE cotangent, so the kernel backward can run
        out, vjp, lse = jax.vjp(lambda q, k, v, s: flash_attention(
            q, k, v, sinks=s, return_lse=True, **opts), q, k, v, sinks, has_aux=True)
        return out, lse, vjp(dout)

    out, lse, grads = run(q, k, v, sinks)
    assert out.shape == (b, sq, hq, dv) and grads[3].dtype == F32
    check_against_oracle("flash_attention", q, k, v, out, lse, grads, dout, sinks=sinks, **opts)


@pytest.mark.parametrize("d,dv", [(80, 80), (192, 128), (64, 36), (36, 64)])
def test_dispatch_with_head_dims_of_their_own(d, dv):
    """Any head dims that are multiples of 8 up to 256 are the kernel's when it is here
    (implementation=None picks it, the lowered program calls it); others name the head dim
    that is not, and run on the portable path."""
    q, k, v = random_qkv(44, 1, 16, 16, 2, 2, d, BF16, head_dim_v=dv)
    reason = jax_fa3.unavailable_reason("fwd", BF16, d, dv)
    assert jax_fa3.kernel_available("fwd", BF16, d, dv) == (reason is None)
    if MACHINE is not None:
        assert reason == MACHINE
    elif 36 in (d, dv):
        which = "head_dim of v" if dv == 36 else "head_dim"
        assert f"{which} a multiple of 8" in reason and "36" in reason
        with pytest.raises(ValueError, match="multiple of 8"):
            flash_attention(q, k, v, implementation="cuda")
    else:  # the H200 with the kernels: every compiled dtype rounds 80 and 192/128 up
        assert reason is None or "no fwd kernel compiled" in reason
    impl = attention.resolve_implementation(None, q, head_dim_v=dv)
    assert impl == ("cuda" if reason is None else "xla")
    f = lambda q, k, v: flash_attention(q, k, v, causal=True)
    assert _calls_kernel(f, q, k, v) == (reason is None)
    assert f(q, k, v).shape == (1, 16, 2, dv)


def test_default_dispatch_takes_the_kernel_where_it_can():
    """implementation=None: the kernel's custom call where the kernel runs (and its result
    meets the oracle), else exactly the portable forward."""
    q, k, v = random_qkv(13, 2, 16, 24, 4, 2, 64, BF16)
    can_run = attention.kernel_available("fwd", BF16, 64)
    f = lambda q, k, v: flash_attention(q, k, v, causal=True, return_lse=True)
    assert attention.resolve_implementation(None, q) == ("cuda" if can_run else "xla")
    assert _calls_kernel(f, q, k, v) == can_run
    got = f(q, k, v)
    if can_run:
        check_against_oracle("kernel", q, k, v, *got, causal=True)
    else:
        want = portable.forward(q, k, v, softmax_scale=1 / math.sqrt(64), right=0)
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
    fwd_ok = attention.kernel_available("fwd", BF16, 64)
    bwd_ok = attention.kernel_available("bwd", BF16, 64)
    assert attention.resolve_implementation("xla", q) == "xla"
    assert attention.resolve_implementation(None, q) == ("cuda" if fwd_ok else "xla")
    assert attention.resolve_implementation("cuda", q, "bwd") == ("cuda" if bwd_ok else "xla")
    if fwd_ok:
        assert attention.resolve_implementation("cuda", q) == "cuda"
        assert _calls_kernel(lambda q: flash_attention(q, q, q, implementation="cuda"), q)
    else:
        with pytest.raises(RuntimeError, match="implementation='cuda'") as err:
            flash_attention(q, k, k, implementation="cuda")
        assert attention.unavailable_reason("fwd", BF16, 64) in str(err.value)


@pytest.mark.parametrize("dtype,head_dim", [(BF16, 64), (F16, 128), (F32, 64), (BF16, 36)])
def test_the_machine_is_the_first_reason(dtype, head_dim):
    """Issue 30: without a Hopper GPU or a build, that is the first reason whatever the
    input, and implementation='cuda' raises the same RuntimeError for it whatever the dtype;
    on the H200 the input is the reason (a ValueError) or the kernel runs."""
    reason = attention.unavailable_reason("fwd", dtype, head_dim)
    q, k, v = random_qkv(17, 1, 4, 4, 2, 2, head_dim, dtype)
    input_reason = {F32: "bfloat16 or float16", 36: "multiple of 8"}.get(
        dtype if dtype == F32 else head_dim)
    if MACHINE is not None:
        assert reason == MACHINE
        with pytest.raises(RuntimeError) as err:
            flash_attention(q, k, v, implementation="cuda")
        assert str(err.value).startswith(f"implementation='cuda' cannot run this call: {MACHINE}")
        if input_reason:  # named too, after the machine
            assert input_reason in str(err.value).split(MACHINE)[1]
    elif input_reason:
        assert input_reason in reason
        with pytest.raises(ValueError, match=input_reason):
            flash_attention(q, k, v, implementation="cuda")
    else:  # a compiled (dtype, head dim) on the H200: the kernel runs, or the build lacks it
        assert reason is None or "no fwd kernel compiled" in reason
    assert flash_attention(q, k, v).shape == q.shape  # None falls back to the portable path


def test_exports_and_availability():
    for name in ("flash_attention", "dot_product_attention", "build_info", "kernel_available",
                 "unavailable_reason"):
        assert name in jax_fa3.__all__ and callable(getattr(jax_fa3, name))
    for fn in (jax_fa3.unavailable_reason, jax_fa3.kernel_available):
        assert list(inspect.signature(fn).parameters) == ["direction", "dtype", "head_dim",
                                                          "head_dim_v"]
    assert "sinks" in inspect.signature(flash_attention).parameters
    reason = jax_fa3.unavailable_reason("fwd", BF16, 128)
    assert jax_fa3.kernel_available("fwd", BF16, 128) == (reason is None)
    assert (jax_fa3.build_info() is None) == (not jax_fa3.is_built())
    if jax_fa3.is_built():
        assert reason is None or "not built" not in reason
        assert ("bfloat16", 128) in jax_fa3.build_info()["fwd"] or reason is not None
    else:
        assert "not built" in reason


def test_partitioned_calls_are_drop_ins_for_the_core():
    """The sharding layer runs the core's local calls: the same parameters, one Options."""
    for core_fn, partitioned in ((_core.attention_fwd, sharding.partitioned_attention_fwd),
                                 (_core.attention_bwd, sharding.partitioned_attention_bwd)):
        core = list(inspect.signature(core_fn).parameters)
        assert list(inspect.signature(partitioned).parameters) == [
            p for p in core if p != "kv_lengths"]


def _has_partitioning(f, *args) -> bool:
    return "custom_partitioning" in str(jax.make_jaxpr(f)(*args))


def test_one_device_goes_straight_to_the_core(monkeypatch):
    """API -> core -> ops on one device: no custom_partitioning in the program (forward or
    backward); with several devices (this suite simulates 8) the sharding layer is in; inside
    a shard_map over every mesh axis the arrays are local, so it is not."""
    q, k, v = random_qkv(18, 2, 8, 8, 2, 2, 16, F32)
    # A new function per trace: JAX caches traces by function.
    grad = lambda: jax.grad(lambda q, k, v: flash_attention(q, k, v, causal=True).sum(),
                            argnums=(0, 1, 2))
    assert _has_partitioning(grad(), q, k, v) == (jax.device_count() > 1)
    mesh = jax.make_mesh((jax.device_count(),), ("x",), devices=jax.devices())
    spec = jax.sharding.PartitionSpec()
    local = jax.shard_map(grad(), mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec,) * 3)
    assert not _has_partitioning(local, q, k, v)
    sharded = jax.jit(grad())(q, k, v)
    monkeypatch.setattr(jax, "device_count", lambda *a: 1)
    assert not _has_partitioning(grad(), q, k, v)
    for a, b, c in zip(jax.jit(grad())(q, k, v), jax.jit(local)(q, k, v), sharded):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(a, c, rtol=1e-6, atol=1e-6)


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
    """A bias, a mask or key lengths with implementation='cuda': a ValueError naming them on
    the H200; without a GPU or build the machine is named first (a RuntimeError), then them."""
    q, k, v, mask, bias = _nn_inputs()
    qb, kb, vb = (x.astype(BF16) for x in (q, k, v))
    lengths = jnp.array([3, 4], jnp.int32)
    for kw, name in ((dict(bias=bias), "bias"), (dict(mask=mask), "mask"),
                     (dict(key_value_seq_lengths=lengths), "key_value_seq_lengths")):
        error = RuntimeError if MACHINE else ValueError
        with pytest.raises(error) as err:
            dot_product_attention(qb, kb, vb, implementation="cuda", **kw)
        message = str(err.value)
        assert f"cannot take {name}" in message
        assert MACHINE is None or message.index(MACHINE) < message.index(name)
    xla = dot_product_attention(q, k, v, mask=mask, implementation="xla")
    np.testing.assert_array_equal(xla, dot_product_attention(q, k, v, mask=mask))
