"""JAX transformations over flash_attention: jit, grad, value_and_grad, vmap (equal to a
Python loop), checkpoint, nested vmap(grad), scan; and on Hopper, that vmap folds into one
kernel call."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import random_like, random_qkv, random_sinks, skip_unless_kernel
from jax_fa3 import flash_attention

F32, BF16 = jnp.float32, jnp.bfloat16
OPTS = dict(causal=True, window_size=(6, -1), softcap=4.0)


def attn(q, k, v, **kw):
    return flash_attention(q, k, v, **{**OPTS, **kw})


def loss(q, k, v, dout):
    return (attn(q, k, v).astype(F32) * dout).sum()


# Jitted once per module: the loops below reuse one compile instead of eager op-by-op runs.
attn_jit = jax.jit(attn)
grad_jit = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


@pytest.fixture(scope="module")
def inputs():
    q, k, v = random_qkv(30, 2, 12, 16, 4, 2, 16, F32)
    return q, k, v, random_like(31, q)


def close(a, b, atol=2e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x, F32), np.asarray(y, F32), rtol=1e-5, atol=atol)


def test_jit_matches_eager(inputs):
    q, k, v, _ = inputs
    close(attn_jit(q, k, v), attn(q, k, v))


def test_value_and_grad_matches_grad(inputs):
    q, k, v, dout = inputs
    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v, dout)
    close(value, loss(q, k, v, dout), atol=1e-5)
    close(grads, grad_jit(q, k, v, dout))


def test_grad_of_one_argument(inputs):
    q, k, v, dout = inputs
    close(jax.jit(jax.grad(loss, argnums=1))(q, k, v, dout), grad_jit(q, k, v, dout)[1])


def test_grad_through_lse_only(inputs):
    q, k, v, _ = inputs
    f = lambda q: flash_attention(q, k, v, return_lse=True, **OPTS)[1].sum()
    g = jax.jit(jax.grad(f))(q)
    eps = 1e-2  # central difference along a random direction, float32
    d = random_like(32, q)
    f = jax.jit(f)
    fd = (f(q + eps * d) - f(q - eps * d)) / (2 * eps)
    np.testing.assert_allclose((g * d).sum(), fd, rtol=2e-3)


def test_vmap_equals_loop(inputs):
    q, k, v, _ = inputs
    qs = jnp.stack([q, 2 * q, -q])
    got = jax.jit(jax.vmap(attn))(qs, jnp.stack([k] * 3), jnp.stack([v] * 3))
    close(got, jnp.stack([attn_jit(x, k, v) for x in qs]))
    # shared k/v (in_axes None) and a non-leading mapped axis
    close(jax.jit(jax.vmap(attn, in_axes=(0, None, None)))(qs, k, v), got)
    q_ax1 = jnp.moveaxis(qs, 0, 1)
    close(jax.jit(jax.vmap(attn, in_axes=(1, None, None), out_axes=1))(q_ax1, k, v),
          jnp.moveaxis(got, 0, 1))


def test_vmap_of_grad_equals_loop(inputs):
    q, k, v, dout = inputs
    qs, ks = jnp.stack([q, 0.5 * q]), jnp.stack([k, -k])
    g = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2)), in_axes=(0, 0, None, None)))
    got = g(qs, ks, v, dout)
    for i in range(2):
        close([x[i] for x in got], grad_jit(qs[i], ks[i], v, dout))


def test_nested_vmap_of_grad(inputs):
    q, k, v, dout = inputs
    qs = jnp.stack([jnp.stack([q, 2 * q]), jnp.stack([-q, q / 3])])  # (2, 2, ...)
    grad_q = jax.grad(loss)
    got = jax.jit(jax.vmap(jax.vmap(grad_q, in_axes=(0, None, None, None)),
                           in_axes=(0, None, None, None)))(qs, k, v, dout)
    for i in range(2):
        for j in range(2):
            close(got[i, j], grad_jit(qs[i, j], k, v, dout)[0])


def test_checkpoint_matches_plain_grad(inputs):
    q, k, v, dout = inputs
    remat = jax.checkpoint(loss)
    want = grad_jit(q, k, v, dout)
    close(jax.jit(jax.grad(remat, argnums=(0, 1, 2)))(q, k, v, dout), want)
    remat2 = jax.checkpoint(loss, policy=jax.checkpoint_policies.nothing_saveable)
    close(jax.jit(jax.grad(remat2))(q, k, v, dout), want[0])


def test_scan_over_layers(inputs):
    """A layer stack under lax.scan, differentiated: the pattern of a transformer."""
    q, k, v, dout = inputs
    ws = jnp.stack([jnp.eye(16), 0.5 * jnp.eye(16), -jnp.eye(16)])

    def model(q, ws):
        def layer(x, w):
            return attn(x @ w, k, v) + x, None
        return (jax.lax.scan(layer, q, ws)[0] * dout).sum()

    def unrolled(q, ws):
        x = q
        for w in ws:
            x = attn(x @ w, k, v) + x
        return (x * dout).sum()

    close(jax.jit(jax.grad(model, argnums=(0, 1)))(q, ws),
          jax.jit(jax.grad(unrolled, argnums=(0, 1)))(q, ws), atol=1e-5)


@pytest.fixture(scope="module")
def sink_inputs():
    """q, k, v (v of head dim 8, q/k 16), three stacked sets of sinks, dout."""
    q, k, v = random_qkv(35, 2, 12, 16, 4, 2, 16, F32, head_dim_v=8)
    sinks = jnp.stack([random_sinks(36 + i, 4) for i in range(3)])
    return q, k, v, sinks, random_like(39, jnp.zeros((2, 12, 4, 8)))


def sink_loss(q, k, v, s, dout):
    return (attn(q, k, v, sinks=s) * dout).sum()


sink_grad_jit = jax.jit(jax.grad(sink_loss, argnums=(0, 1, 2, 3)))


def test_vmap_with_shared_and_batched_sinks(sink_inputs):
    """vmap over the whole call: sinks shared by the stack (in_axes None) or one set per
    element, with q, k, v batched or shared; equal to a loop."""
    q, k, v, sinks, _ = sink_inputs
    qs = jnp.stack([q, 2 * q, -q])
    loop = lambda ss: jnp.stack([attn_jit(x, k, v, sinks=s) for x, s in zip(qs, ss)])
    shared = jax.jit(jax.vmap(lambda q, s: attn(q, k, v, sinks=s), in_axes=(0, None)))
    close(shared(qs, sinks[0]), loop([sinks[0]] * 3))
    batched = jax.jit(jax.vmap(lambda q, s: attn(q, k, v, sinks=s)))
    close(batched(qs, sinks), loop(sinks))
    only_sinks = jax.jit(jax.vmap(lambda s: attn(q, k, v, sinks=s)))
    close(only_sinks(sinks), jnp.stack([attn_jit(q, k, v, sinks=s) for s in sinks]))


def test_vmap_of_grad_with_sinks(sink_inputs):
    """Gradients in q, k, v and sinks under vmap, sinks shared or batched; and the gradient
    of shared sinks through a vmapped loss is the sum of the per-element ones."""
    q, k, v, sinks, dout = sink_inputs
    qs = jnp.stack([q, 0.5 * q, -q])
    per_elem = [sink_grad_jit(qs[i], k, v, sinks[i], dout) for i in range(3)]
    g = jax.jit(jax.vmap(jax.grad(sink_loss, argnums=(0, 1, 2, 3)),
                         in_axes=(0, None, None, 0, None)))
    for i, want in enumerate(per_elem):
        close([x[i] for x in g(qs, k, v, sinks, dout)], want, atol=1e-5)
    shared = jax.jit(jax.grad(lambda s: jax.vmap(sink_loss, in_axes=(0, None, None, None, None))(
        qs, k, v, s, dout).sum()))
    want = sum(sink_grad_jit(qs[i], k, v, sinks[0], dout)[3] for i in range(3))
    close(shared(sinks[0]), want, atol=1e-5)


def test_sinks_under_checkpoint_and_scan(sink_inputs):
    q, k, v, sinks, dout = sink_inputs
    want = sink_grad_jit(q, k, v, sinks[0], dout)
    remat = jax.checkpoint(sink_loss)
    close(jax.jit(jax.grad(remat, argnums=(0, 1, 2, 3)))(q, k, v, sinks[0], dout), want)

    def layers(s_stack):  # sinks per layer, as a model with one set per layer has them
        def layer(x, s):
            return x + attn(x, k, k, sinks=s), None
        return (jax.lax.scan(layer, q, s_stack)[0] ** 2).sum()

    def unrolled(s_stack):
        x = q
        for s in s_stack:
            x = x + attn(x, k, k, sinks=s)
        return (x ** 2).sum()

    close(jax.jit(jax.grad(layers))(sinks), jax.jit(jax.grad(unrolled))(sinks), atol=1e-4)


def test_bf16_grads_keep_dtypes():
    q, k, v = random_qkv(33, 1, 8, 8, 2, 1, 32, BF16)
    grads = jax.jit(jax.grad(lambda q, k, v: attn(q, k, v).astype(F32).sum(),
                             argnums=(0, 1, 2)))(q, k, v)
    assert [g.dtype for g in grads] == [BF16] * 3
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


# ----------------------------------------------------------------------------- on Hopper

def _ffi_calls(jaxpr):
    """Count ffi_call equations, descending into sub-jaxprs."""
    n = 0
    for eqn in jaxpr.eqns:
        n += "ffi" in eqn.primitive.name
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    n += _ffi_calls(inner)
    return n


@pytest.mark.gpu
def test_vmap_with_sinks_on_the_kernel():
    """Shared sinks fold the stack into one kernel call; batched sinks run one call per
    element (the kernel takes one set of sinks per launch). Equal to a loop either way."""
    skip_unless_kernel("fwd", BF16, 128)
    q, k, v = random_qkv(37, 2, 128, 128, 4, 2, 128, BF16)
    qs = jnp.stack([q, -q])
    sinks = jnp.stack([random_sinks(38, 4), random_sinks(39, 4)])
    call = functools.partial(flash_attention, causal=True, implementation="cuda")
    shared = jax.vmap(lambda q, s: call(q, k, v, sinks=s), in_axes=(0, None))
    assert _ffi_calls(jax.make_jaxpr(shared)(qs, sinks[0]).jaxpr) == 1
    batched = jax.vmap(lambda q, s: call(q, k, v, sinks=s))
    for got, ss in ((shared(qs, sinks[0]), [sinks[0]] * 2), (batched(qs, sinks), sinks)):
        want = jnp.stack([call(x, k, v, sinks=s) for x, s in zip(qs, ss)])
        np.testing.assert_array_equal(np.asarray(got, F32), np.asarray(want, F32))


@pytest.mark.gpu
def test_vmap_folds_into_one_kernel_call():
    skip_unless_kernel("fwd", BF16, 128)
    q, k, v = random_qkv(34, 2, 128, 128, 4, 2, 128, BF16)
    qs = jnp.stack([q, q])
    fwd = jax.make_jaxpr(jax.vmap(functools.partial(flash_attention, causal=True,
                                                    implementation="cuda")))(qs, qs, qs)
    assert _ffi_calls(fwd.jaxpr) == 1
    got = jax.vmap(functools.partial(flash_attention, implementation="cuda"))(qs, qs, qs)
    want = jnp.stack([flash_attention(x, x, x, implementation="cuda") for x in qs])
    np.testing.assert_array_equal(np.asarray(got, F32), np.asarray(want, F32))
