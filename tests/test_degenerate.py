"""Degenerate but legal inputs (issue 30), as flash_attention's docstring defines them:
seqlen (or batch) 0, softmax_scale=0, a NaN in q, k or v; forward and gradient.

Each test runs on the portable path here, and on the kernel (implementation="cuda") where it
is marked gpu (the H200; skipped with the reason elsewhere). The portable path is also held
to jax.nn.dot_product_attention's NaN rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import check_against_oracle, random_like, random_qkv, skip_unless_kernel
from jax_fa3 import _ffi, dot_product_attention, flash_attention

BF16, F32 = jnp.bfloat16, jnp.float32
D = 128  # a head dim every kernel build has (CI compiles hd128 bf16)

PATHS = [pytest.param("xla", id="portable"),
         pytest.param("cuda", id="kernel", marks=pytest.mark.gpu)]


def _need(impl):
    if impl == "cuda":
        skip_unless_kernel("fwd", BF16, D)
        skip_unless_kernel("bwd", BF16, D)


def _run(q, k, v, dout, impl, **opts):
    """(out, lse, (dq, dk, dv)) of flash_attention under jit, and whether the lowered
    program launches the forward kernel."""
    def f(q, k, v):
        (out, lse), vjp = jax.vjp(lambda q, k, v: flash_attention(
            q, k, v, return_lse=True, implementation=impl, **opts), q, k, v)
        return out, lse, vjp((dout, jnp.zeros_like(lse)))

    launches = f"@{_ffi.FWD_TARGET}(" in jax.jit(f).lower(q, k, v).as_text()
    return jax.device_get(jax.jit(f)(q, k, v)), launches


def _f32(x):
    return np.asarray(x, np.float32)


# ----------------------------------------------------------------------------- empty

@pytest.mark.parametrize("impl", PATHS)
@pytest.mark.parametrize("b,sq,sk", [(2, 0, 9), (2, 9, 0), (2, 0, 0), (0, 9, 9)],
                         ids=["seqlen_q=0", "seqlen_k=0", "both=0", "batch=0"])
def test_empty(impl, b, sq, sk):
    """An empty out of the right shape (or, with keys 0, out 0 and lse -inf: no row sees a
    key), zero gradients, and no kernel launch: nothing to compute."""
    _need(impl)
    q, k, v = random_qkv(1, b, sq, sk, 4, 2, D, BF16)
    (out, lse, grads), launches = _run(q, k, v, random_like(2, q), impl, causal=True)
    assert out.shape == q.shape and out.dtype == BF16
    assert lse.shape == (b, 4, sq) and lse.dtype == F32
    assert (_f32(out) == 0).all() and np.isneginf(lse).all()
    for g, x in zip(grads, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype and (_f32(g) == 0).all()
    assert not launches
    nn = dot_product_attention(q, k, v, is_causal=True, implementation=impl)
    assert nn.shape == q.shape and (_f32(nn) == 0).all()


@pytest.mark.parametrize("impl", PATHS)
def test_empty_keys_with_sinks(impl):
    """seqlen_k 0 with sinks: no row sees a key, so out is 0 and lse the head's sink; the
    sinks' gradient is the LSE cotangent's sum (p0 = 1, D = 0), the rest zero, no launch."""
    _need(impl)
    q, k, v = random_qkv(1, 2, 9, 0, 4, 2, D, BF16)
    sinks = jnp.asarray([0.5, -1.0, -jnp.inf, 2.0], F32)
    dout = random_like(2, q)
    dlse = jnp.asarray(np.random.default_rng(3).standard_normal((2, 4, 9)), F32)

    def f(q, k, v, s):
        (out, lse), vjp = jax.vjp(lambda q, k, v, s: flash_attention(
            q, k, v, sinks=s, return_lse=True, implementation=impl), q, k, v, s)
        return out, lse, vjp((dout, dlse))

    assert f"@{_ffi.FWD_TARGET}(" not in jax.jit(f).lower(q, k, v, sinks).as_text()
    out, lse, (dq, dk, dv, dsinks) = jax.device_get(jax.jit(f)(q, k, v, sinks))
    assert (_f32(out) == 0).all() and (_f32(dq) == 0).all()
    np.testing.assert_array_equal(lse, np.broadcast_to(np.asarray(sinks)[None, :, None], lse.shape))
    want = np.where(np.isfinite(sinks), np.asarray(dlse).sum(axis=(0, 2)), 0.0)
    np.testing.assert_allclose(dsinks, want, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- scale 0

@pytest.mark.parametrize("impl", [None, "xla"])
def test_softmax_scale_zero_is_uniform(impl):
    """Every visible key weighs the same: out is the mean of the visible values (the oracle,
    by the error-ratio rule), lse the log of their number, dq and dk exactly 0. Never on the
    kernel, which cannot take a zero scale (-inf * 0 = NaN at its masked scores): with
    implementation=None the H200 runs it on the portable path too."""
    opts = dict(softmax_scale=0.0, causal=True, window_size=(50, -1))
    q, k, v = random_qkv(3, 2, 60, 90, 4, 2, D, BF16, scale=4.0)
    dout = random_like(4, q)
    (out, lse, grads), launches = _run(q, k, v, dout, impl, **opts)
    assert not launches
    check_against_oracle("scale 0", q, k, v, out, lse, grads, dout, **opts)
    visible = np.arange(90)[None, :] - np.arange(60)[:, None] - 30  # key - diagonal
    count = ((visible >= -50) & (visible <= 0)).sum(axis=1)  # (sq,)
    np.testing.assert_allclose(lse, np.broadcast_to(np.log(count), lse.shape), rtol=1e-6)
    assert (_f32(grads[0]) == 0).all() and (_f32(grads[1]) == 0).all()


def test_softmax_scale_zero_on_cuda_says_why():
    """implementation='cuda' with a zero scale: a ValueError naming the argument as the
    caller spelled it; where there is no Hopper GPU or build, that comes first (RuntimeError)."""
    q, k, v = random_qkv(3, 1, 8, 8, 2, 2, D, BF16)
    machine = _ffi.extension_reason()
    for fn, kw, name in ((flash_attention, dict(softmax_scale=0.0), "softmax_scale=0"),
                         (dot_product_attention, dict(scale=0.0), "scale=0")):
        with pytest.raises(RuntimeError if machine else ValueError) as err:
            fn(q, k, v, implementation="cuda", **kw)
        message = str(err.value)
        assert f"the kernels cannot take {name}" in message
        assert machine is None or message.index(machine) < message.index(name)


def test_scale_zero_matches_jax_nn():
    q, k, v = random_qkv(5, 2, 12, 20, 4, 2, 16, F32)
    for kw in (dict(), dict(is_causal=True), dict(local_window_size=(3, 2))):
        np.testing.assert_allclose(dot_product_attention(q, k, v, scale=0.0, **kw),
                                   jax.nn.dot_product_attention(q, k, v, scale=0.0, **kw),
                                   atol=2e-6)


# ----------------------------------------------------------------------------- NaN

B, S, HQ, HKV = 2, 40, 4, 2
GROUP = HQ // HKV
AT = 17  # the poisoned query row / key, in batch row 1, kv head 0 (query heads 0 and 1)


def _poison(which):
    """Inputs with one NaN in `which` (q: batch 1, row AT, head 1; k or v: batch 1, key AT,
    kv head 0), and the clean inputs."""
    q, k, v = random_qkv(6, B, S, S, HQ, HKV, D, BF16)
    clean = (q, k, v)
    arrays = dict(q=q, k=k, v=v)
    index = (1, AT, 1, 3) if which == "q" else (1, AT, 0, 3)
    arrays[which] = arrays[which].at[index].set(jnp.nan)
    return (arrays["q"], arrays["k"], arrays["v"]), clean


def _rows(x):
    """NaN per (batch, row, head) of a (b, s, h, d) array."""
    return np.isnan(_f32(x)).any(axis=-1)


def _sees_at():
    """(rows, heads) that see key AT of kv head 0 under the causal mask: rows >= AT."""
    sees = np.zeros((S, HQ), bool)
    sees[AT:, :GROUP] = True
    return sees


def _expected(which):
    """What the contract guarantees: (out rows surely NaN, out rows NaN on the portable path,
    gradient (name, batch, row, head) surely NaN) in batch row 1."""
    if which == "q":
        exact = np.zeros((S, HQ), bool)
        exact[AT, 1] = True
        return exact, exact, ("dq", AT, 1)
    if which == "k":
        return _sees_at(), _sees_at(), ("dk", AT, 0)
    everything = np.zeros((S, HQ), bool)
    everything[:, :GROUP] = True
    return _sees_at(), everything, ("dq", AT, 0)


def _outside(name):
    """Mask of the (batch, row, head) entries of `name` outside batch row 1's kv group 0,
    which a NaN there must not reach."""
    heads = HQ if name in ("out", "dq") else HKV
    mask = np.ones((B, S, heads), bool)
    mask[1, :, :GROUP if heads == HQ else 1] = False
    return mask


@pytest.mark.parametrize("impl", PATHS)
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_nan_stays_where_the_contract_says(impl, which):
    _need(impl)
    (q, k, v), clean = _poison(which)
    dout = random_like(7, q)
    (out, lse, grads), _ = _run(q, k, v, dout, impl, causal=True)
    (out0, lse0, grads0), _ = _run(*clean, dout, impl, causal=True)
    surely, portable_rows, (gname, grow, ghead) = _expected(which)
    nan = _rows(out)[1]
    if impl == "xla":
        np.testing.assert_array_equal(nan, portable_rows)
    else:
        assert nan[surely].all()
        if which != "v":  # only a NaN in v may reach rows that do not see it
            np.testing.assert_array_equal(nan, surely)
    # A row whose scores are NaN counts as seeing no key: lse -inf; a NaN in v leaves lse.
    scores_nan = surely if which != "v" else np.zeros_like(surely)
    assert np.isneginf(np.swapaxes(lse[1], 0, 1)[scores_nan]).all()
    assert np.isfinite(np.swapaxes(lse[1], 0, 1)[~scores_nan]).all()
    grads = dict(zip(("dq", "dk", "dv"), grads))
    assert _rows(grads[gname])[1, grow, ghead], f"{gname} does not depend on the NaN"
    for name, got, want in (("out", out, out0), *zip(("dq", "dk", "dv"), grads.values(),
                                                     grads0)):
        keep = _outside(name)
        assert not _rows(got)[keep].any(), f"the NaN left its batch row and group in {name}"
        np.testing.assert_allclose(_f32(got)[keep], _f32(want)[keep], rtol=2e-2, atol=2e-2,
                                   err_msg=name)


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_nan_rows_as_jax_nn(which):
    """The portable path's NaN rows are jax.nn's in the output, and its gradients are NaN
    nowhere jax.nn's are not."""
    (q, k, v), _ = _poison(which)
    dout = random_like(8, q)

    def run(fn):
        loss = lambda q, k, v: (fn(q, k, v, is_causal=True) * dout).astype(F32).sum()
        return jax.jit(lambda q, k, v: (fn(q, k, v, is_causal=True),
                                        jax.grad(loss, argnums=(0, 1, 2))(q, k, v)))(q, k, v)

    ours, our_grads = run(dot_product_attention)
    theirs, their_grads = run(jax.nn.dot_product_attention)
    np.testing.assert_array_equal(_rows(ours), _rows(theirs))
    for name, a, b in zip(("dq", "dk", "dv"), our_grads, their_grads):
        extra = _rows(a) & ~_rows(b)
        assert not extra.any(), f"{name} NaN where jax.nn's is not: {np.argwhere(extra)[:5]}"
