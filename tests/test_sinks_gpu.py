"""GPU tests of attention sinks on the kernels (gpt-oss style: each row's softmax
denominator gains exp(sinks[h]), like one more key whose value is 0).

Forward through jax_fa3._ops.fwd(..., sinks): out and lse (which includes the sinks) by the
error-ratio rule of docs/architecture.md against the float64 oracle; a row that sees no key
gives out 0 and lse = its head's sink. Backward through jax_fa3._ops.bwd given the oracle's
out/lse with the sinks (the kernel needs no other sign of them): dq, dk, dv, and D =
rowsum(dout * out) when asked for. The sinks' own gradient through
flash_attention(..., sinks, implementation="cuda") and jax.vjp against the oracle's exact
float64 dsinks. Options: GQA/MQA, causal, sliding window + sink, softcap, deterministic,
seqlen_q != seqlen_k, MLA head dims; and sinks of -inf are no sinks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from jax_fa3 import _ffi, _masks, _ops, flash_attention, portable

pytestmark = pytest.mark.gpu

UNB = _masks.UNBOUNDED
BF16, F16 = jnp.bfloat16, jnp.float16

_next_key = helpers.key_stream(26_2026_1209)


def _attrs(d, left, right, softcap):
    return dict(softmax_scale=1.0 / np.sqrt(d), softcap=softcap, window_left=left,
                window_right=right)


def _inputs(b, sq, sk, hq, hkv, d, dv, dtype, logit_scale=1.0, sink_loc=2.0):
    q, k, v = helpers.random_qkv(_next_key(), b, sq, sk, hq, hkv, d, dtype, scale=logit_scale,
                                 head_dim_v=dv)
    sinks = helpers.random_sinks(_next_key(), hq, loc=sink_loc)
    return q, k, v, sinks


# Shapes and options: (b, sq, sk, hq, hkv, d, dv, dtype, left, right, softcap, logit scale)
CASES = {
    "gqa-causal": (2, 300, 257, 8, 2, 128, 128, BF16, UNB, 0, 0.0, 1.0),
    "mqa-full-sq<sk": (1, 129, 700, 4, 1, 128, 128, BF16, UNB, UNB, 0.0, 1.0),
    "sliding-window": (2, 500, 500, 4, 2, 64, 64, BF16, 64, 0, 0.0, 1.0),
    "softcap-large-logits": (1, 257, 300, 4, 4, 128, 128, F16, UNB, 0, 20.0, 6.0),
    "mla-causal": (2, 257, 400, 8, 2, 192, 128, BF16, UNB, 0, 0.0, 1.0),
    "rounded-up-hd80-window": (1, 300, 300, 4, 2, 80, 80, BF16, 32, 8, 0.0, 1.0),
    "rows-without-keys": (2, 400, 150, 4, 2, 128, 128, BF16, UNB, 0, 0.0, 1.0),
    "shifted-band": (1, 200, 300, 2, 1, 64, 64, F16, -20, 150, 0.0, 1.0),
}


@pytest.mark.parametrize("name", list(CASES))
def test_forward_with_sinks(name):
    b, sq, sk, hq, hkv, d, dv, dtype, left, right, softcap, scale = CASES[name]
    helpers.skip_unless_kernels(dtype, d, dv, directions=("fwd",))
    q, k, v, sinks = _inputs(b, sq, sk, hq, hkv, d, dv, dtype, scale)
    out, lse = jax.device_get(_ops.fwd(q, k, v, sinks, **_attrs(d, left, right, softcap)))
    assert out.shape == (b, sq, hq, dv) and out.dtype == dtype and lse.dtype == np.float32
    opts = dict(left=left, right=right, softcap=softcap)
    helpers.check_against_oracle(f"fwd {name}", q, k, v, out=out, lse=lse, sinks=sinks, **opts)
    # Rows that see no key: out exactly 0, lse the head's sink (to float32 rounding).
    empty = ~helpers.band_mask(sq, sk, left, right).any(axis=1)  # (sq,)
    assert (np.asarray(out, np.float32)[:, empty] == 0).all()
    want = np.broadcast_to(np.asarray(sinks)[None, :, None], (b, hq, int(empty.sum())))
    np.testing.assert_allclose(lse[:, :, empty], want, rtol=4e-7, atol=1e-6)
    if name in ("rows-without-keys", "shifted-band"):
        assert empty.any(), "the case is meant to have rows without keys"


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("name", list(CASES))
def test_backward_with_sinks(name, deterministic):
    """dq, dk, dv given the oracle's sink-including out and lse, and D (with the dsinks the
    core forms from it); deterministic: a second call is bitwise equal."""
    b, sq, sk, hq, hkv, d, dv, dtype, left, right, softcap, scale = CASES[name]
    helpers.skip_unless_kernels(dtype, d, dv, directions=("bwd",))
    q, k, v, sinks = _inputs(b, sq, sk, hq, hkv, d, dv, dtype, scale)
    opts = dict(left=left, right=right, softcap=softcap)
    out64, lse64 = helpers.reference_f64(q, k, v, sinks=sinks, **opts)
    out = jnp.asarray(np.asarray(out64, np.float32)).astype(dtype)
    lse = jnp.asarray(np.asarray(lse64, np.float32))
    dout = helpers.random_like(_next_key(), out)

    def backward():
        return jax.device_get(_ops.bwd(q, k, v, out, lse, dout, deterministic=deterministic,
                                       return_dpsum=True, **_attrs(d, left, right, softcap)))

    dq, dk, dv_, dpsum = backward()
    # dsinks as the core forms it from the kernel's D: -sum over rows of exp(sink - lse) * D
    dsinks = jax.device_get(portable.sinks_grad(sinks, lse, dpsum))
    helpers.check_against_oracle(f"bwd {name}", q, k, v, grads=(dq, dk, dv_, dsinks),
                                 dout=dout, sinks=sinks, **opts)
    # D of the very arrays the kernel read (out rounded to the dtype), summed in float32.
    terms = np.asarray(dout, np.float64) * np.asarray(out, np.float64)
    want = terms.sum(axis=-1).transpose(0, 2, 1)
    # float32 products and sums: a few ulps of sum|dout * out| per row whatever the order
    bound = 16 * np.finfo(np.float32).eps * np.abs(terms).sum(axis=-1).transpose(0, 2, 1)
    assert dpsum.shape == (b, hq, sq) and dpsum.dtype == np.float32
    assert (np.abs(dpsum - want) <= bound + 1e-30).all(), "D = rowsum(dout * out)"
    if deterministic:
        again = backward()
        for label, a, c in zip(("dq", "dk", "dv"), (dq, dk, dv_), again):
            assert np.array_equal(np.asarray(a).view(np.uint16), np.asarray(c).view(np.uint16)), label


def _flash_vjp(q, k, v, sinks, dout, dlse, **kw):
    """flash_attention with sinks on the kernel, under jit: out, lse and the gradients of q,
    k, v and sinks for the cotangents (dout, dlse). Also checks the program calls both
    kernels (an LSE cotangent would take the portable backward: dlse None here)."""
    def attend(q, k, v, s):
        return flash_attention(q, k, v, sinks=s, return_lse=True, implementation="cuda", **kw)

    def run(q, k, v, sinks):
        if dlse is None:  # lse as aux: its cotangent is a symbolic zero (the kernel backward)
            out, vjp, lse = jax.vjp(attend, q, k, v, sinks, has_aux=True)
            return out, lse, vjp(dout)
        (out, lse), vjp = jax.vjp(attend, q, k, v, sinks)
        return out, lse, vjp((dout, dlse))

    _programs_use_the_kernels(run, q, k, v, sinks, backward=dlse is None)
    return jax.device_get(jax.jit(run)(q, k, v, sinks))


def _programs_use_the_kernels(f, *args, backward=True):
    """The lowered program calls the forward kernel, and the backward kernel iff
    `backward`."""
    text = jax.jit(f).lower(*args).as_text()
    assert f"@{_ffi.FWD_TARGET}(" in text
    assert (f"@{_ffi.BWD_TARGET}(" in text) == backward


PUBLIC = {  # name: (b, sq, sk, hq, hkv, d, dv, dtype, options)
    "gqa-causal": (2, 300, 257, 8, 2, 128, 128, BF16, dict(causal=True)),
    "sliding-window-sink": (2, 600, 600, 4, 1, 64, 64, BF16,
                            dict(causal=True, window_size=(128, -1))),
    "softcap-deterministic": (1, 257, 400, 4, 2, 128, 128, F16,
                              dict(causal=True, softcap=30.0, deterministic=True)),
    "mla": (2, 200, 333, 8, 2, 192, 128, BF16, dict(causal=True)),
    "rows-without-keys": (1, 300, 100, 4, 4, 96, 96, BF16, dict(causal=True)),
}


@pytest.mark.parametrize("name", list(PUBLIC))
def test_sinks_gradient_through_the_api(name):
    """out, lse, dq, dk, dv and dsinks of flash_attention(..., sinks) on the kernels against
    the oracle's exact float64 values (dsinks = sum over rows of p0 * (dlse - D))."""
    b, sq, sk, hq, hkv, d, dv, dtype, opts = PUBLIC[name]
    helpers.skip_unless_kernels(dtype, d, dv)
    q, k, v, sinks = _inputs(b, sq, sk, hq, hkv, d, dv, dtype)
    dout = helpers.random_like(_next_key(), jnp.zeros((b, sq, hq, dv), dtype))
    out, lse, grads = _flash_vjp(q, k, v, sinks, dout, None, **opts)
    assert grads[3].shape == (hq,) and grads[3].dtype == np.float32
    oracle_opts = {key: val for key, val in opts.items() if key != "deterministic"}
    helpers.check_against_oracle(f"api {name}", q, k, v, out, lse, grads, dout, sinks=sinks,
                                 **oracle_opts)


def test_sinks_gradient_with_an_lse_cotangent():
    """Differentiating through lse too: the portable backward runs after the kernel forward,
    and dsinks gains sum p0 * dlse; all by the error-ratio rule with the oracle's dlse."""
    helpers.skip_unless_kernels(BF16, 128, directions=("fwd",))
    q, k, v, sinks = _inputs(1, 257, 300, 4, 2, 128, 128, BF16)
    dout = helpers.random_like(_next_key(), q)
    dlse = jnp.asarray(np.random.default_rng(5).standard_normal((1, 4, 257)), jnp.float32)
    out, lse, grads = _flash_vjp(q, k, v, sinks, dout, dlse, causal=True)
    helpers.check_against_oracle("api dlse", q, k, v, out, lse, grads, dout, dlse=dlse,
                                 sinks=sinks, causal=True)
    # The LSE term moves dsinks by far more than the error allowed: a result without it fails.
    without = helpers.reference_grads_f64(q, k, v, dout, sinks=sinks, causal=True)[3]
    with_it = helpers.reference_grads_f64(q, k, v, dout, dlse=dlse, sinks=sinks, causal=True)[3]
    assert np.abs(with_it - without).max() > 10 * np.abs(np.asarray(grads[3]) - with_it).max()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_minus_inf_sinks_are_no_sinks(causal):
    """sinks = -inf: the same out and lse as without sinks (to one unit in the last place),
    the same dq, dk, dv, and a zero sinks gradient."""
    helpers.skip_unless_kernels(BF16, 128)
    q, k, v = helpers.random_qkv(_next_key(), 2, 300, 257, 4, 2, 128, BF16)
    dout = helpers.random_like(_next_key(), q)
    kw = dict(causal=causal, deterministic=True)
    minus_inf = _flash_vjp(q, k, v, jnp.full((4,), -jnp.inf, jnp.float32), dout, None, **kw)

    def run(q, k, v):
        out, vjp, lse = jax.vjp(lambda q, k, v: flash_attention(
            q, k, v, return_lse=True, implementation="cuda", **kw), q, k, v, has_aux=True)
        return out, lse, vjp(dout)

    none = jax.device_get(jax.jit(run)(q, k, v))
    eps = float(jnp.finfo(BF16).eps)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"),
                          minus_inf[:2] + tuple(minus_inf[2][:3]), none[:2] + tuple(none[2])):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        np.testing.assert_array_equal(np.isneginf(a), np.isneginf(b), err_msg=name)
        fin = np.isfinite(b)
        tol = (eps if name != "lse" else 4 * np.finfo(np.float32).eps) * max(np.abs(b[fin]).max(), 1)
        np.testing.assert_allclose(a[fin], b[fin], rtol=0, atol=tol, err_msg=name)
    assert (np.asarray(minus_inf[2][3]) == 0).all()


def test_sinks_change_the_result():
    """A test that cannot fail is a defect: with sinks that take real weight, the kernel's
    out differs from the call without sinks by far more than the rounding (so the checks
    above see the sinks)."""
    helpers.skip_unless_kernels(BF16, 128, directions=("fwd",))
    q, k, v, sinks = _inputs(1, 200, 200, 4, 2, 128, 128, BF16, sink_loc=4.0)
    attrs = _attrs(128, UNB, 0, 0.0)
    with_sinks = np.asarray(_ops.fwd(q, k, v, sinks, **attrs)[0], np.float32)
    without = np.asarray(_ops.fwd(q, k, v, **attrs)[0], np.float32)
    assert np.abs(with_sinks - without).max() > 0.1 * np.abs(without).max()
