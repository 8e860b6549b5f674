"""Two or more Hopper GPUs: the sharding rules and ring attention with the kernels.

Marked `multigpu` (tests/conftest.py skips them, with the reason, without two GPUs and the
built kernels). The long-sequence measurement is benchmarks/ring_scaling.py; these are the quick
checks: the kernels under custom_partitioning and inside the ring (shifted, negative bands),
against the float64 oracle by the error-ratio rule of docs/architecture.md.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import helpers
import segment_helpers
from jax_fa3 import _core, _ffi, ring, sharding
from jax_fa3._masks import band
from jax_fa3.segments import Segments

pytestmark = pytest.mark.multigpu


def _mesh(names=("sp",)):
    return jax.make_mesh((2,), names, axis_types=(AxisType.Auto,), devices=jax.devices()[:2])


@pytest.mark.parametrize("layout,opts,hkv", [
    ("zigzag", dict(causal=True), 4),
    ("zigzag", dict(causal=True, window_size=(300, -1), softcap=20.0), 2),
    ("contiguous", dict(window_size=(200, 100)), 1),
])
def test_ring_with_kernels_matches_oracle(layout, opts, hkv):
    """Ring attention over 2 GPUs, kernels demanded: out and lse (and dq, dk, dv when the
    backward kernel is built) meet the error-ratio rule against float64."""
    mesh = _mesh()
    b, s, hq, d = 1, 2048, 4, 128
    q, k, v = helpers.random_qkv(jax.random.key(0), b, s, s, hq, hkv, d, jnp.bfloat16, scale=2.0)
    dout = helpers.random_like(jax.random.key(1), q)
    perm = lambda x, a=1: ring.zigzag_permute(x, 2, a) if layout == "zigzag" else x
    unperm = lambda x, a=1: ring.zigzag_unpermute(x, 2, a) if layout == "zigzag" else x

    def f(q, k, v):
        return sharding.context_parallel_attention(q, k, v, mesh=mesh, seq_axis="sp",
                                                   layout=layout, return_lse=True,
                                                   implementation="cuda", **opts)

    put = lambda x: jax.device_put(perm(x), NamedSharding(mesh, P(None, "sp")))
    (out, lse), vjp = jax.vjp(jax.jit(f), put(q), put(k), put(v))
    out, lse = unperm(out), unperm(lse, 2)
    grads = None
    if _ffi.unavailable_reason("bwd", jnp.bfloat16, d) is None:
        grads = [unperm(g) for g in vjp((put(dout), jnp.zeros_like(lse)))]
    helpers.check_against_oracle(f"ring-{layout}", q, k, v, out=out, lse=lse, grads=grads,
                                 dout=dout if grads else None, **opts)


@pytest.mark.parametrize("d,dv,opts", [
    (192, 128, dict(causal=True)),
    (128, 128, dict(causal=True, window_size=(256, -1))),  # sliding window + sink
])
def test_ring_with_kernels_sinks_and_value_head_dim(d, dv, opts):
    """Ring attention over 2 GPUs with sinks (merged once, after the last block) and MLA's
    head dims, kernels demanded: out, lse and (with a backward kernel) dq, dk, dv, dsinks by
    the error-ratio rule against float64."""
    helpers.skip_unless_kernel("fwd", jnp.bfloat16, d, dv)
    mesh = _mesh()
    b, s, hq, hkv = 1, 1024, 4, 2
    q, k, v = helpers.random_qkv(jax.random.key(3), b, s, s, hq, hkv, d, jnp.bfloat16,
                                 head_dim_v=dv)
    sinks = helpers.random_sinks(4, hq, loc=3.0)
    dout = helpers.random_like(jax.random.key(5), jnp.zeros((b, s, hq, dv), jnp.bfloat16))
    perm = lambda x, a=1: ring.zigzag_permute(x, 2, a)
    unperm = lambda x, a=1: ring.zigzag_unpermute(x, 2, a)

    def f(q, k, v, sinks):
        return sharding.context_parallel_attention(q, k, v, mesh=mesh, seq_axis="sp",
                                                   layout="zigzag", sinks=sinks,
                                                   return_lse=True, implementation="cuda",
                                                   **opts)

    put = lambda x: jax.device_put(perm(x), NamedSharding(mesh, P(None, "sp")))
    (out, lse), vjp = jax.vjp(jax.jit(f), put(q), put(k), put(v), sinks)
    grads = None
    if _ffi.unavailable_reason("bwd", jnp.bfloat16, d, dv) is None:
        *qkv_grads, dsinks = vjp((put(dout), jnp.zeros_like(lse)))
        grads = [unperm(g) for g in qkv_grads] + [dsinks]
    helpers.check_against_oracle(f"ring-sinks-{d}/{dv}", q, k, v, out=unperm(out),
                                 lse=unperm(lse, 2), grads=grads,
                                 dout=dout if grads else None, sinks=sinks, **opts)


def test_batch_head_partition_runs_one_kernel_per_device():
    """(batch, heads) sharding over 2 GPUs: the kernel's custom call, no all-gather, results
    equal to one GPU."""
    mesh = jax.make_mesh((1, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2,
                         devices=jax.devices()[:2])
    q, k, v = helpers.random_qkv(jax.random.key(2), 2, 1024, 1024, 8, 2, 128, jnp.bfloat16)
    left, right = band(True, (-1, -1))
    opts = _core.Options(softmax_scale=128 ** -0.5, left=left, right=right,
                         implementation=_core.resolve_implementation("cuda", q))
    spec = NamedSharding(mesh, P("data", None, "model"))
    fwd = jax.jit(lambda q, k, v: sharding.partitioned_attention_fwd(q, k, v, opts))
    qs, ks, vs = (jax.device_put(x, spec) for x in (q, k, v))
    text = fwd.lower(qs, ks, vs).compile().as_text()
    assert _ffi.FWD_TARGET in text and not re.search(r"\ball-gather\b", text)
    out, lse = fwd(qs, ks, vs)
    want_out, want_lse = jax.jit(lambda q, k, v: _core.attention_fwd(q, k, v, opts))(q, k, v)
    want = np.asarray(want_out, np.float32)  # the same per-head work: equal up to one ulp
    np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=0,
                               atol=float(jnp.finfo(jnp.bfloat16).eps) * np.abs(want).max())
    np.testing.assert_allclose(lse, want_lse, rtol=0, atol=1e-5)

    # With sinks sharded like the query heads: the same as one GPU.
    sinks = helpers.random_sinks(6, 8)
    fwd = jax.jit(lambda q, k, v, s: sharding.partitioned_attention_fwd(q, k, v, opts, sinks=s))
    out, lse = fwd(qs, ks, vs, jax.device_put(sinks, NamedSharding(mesh, P("model"))))
    want_out, want_lse = jax.jit(lambda q, k, v, s: _core.attention_fwd(q, k, v, opts, sinks=s))(
        q, k, v, sinks)
    want = np.asarray(want_out, np.float32)
    np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=0,
                               atol=float(jnp.finfo(jnp.bfloat16).eps) * np.abs(want).max())
    np.testing.assert_allclose(lse, want_lse, rtol=0, atol=1e-5)


@pytest.mark.parametrize("layout,positions,opts", [
    ("zigzag", False, dict(causal=True)),
    ("zigzag", True, dict(causal=True, window_size=(300, -1))),
    ("contiguous", True, dict(window_size=(200, 100), softcap=20.0)),
])
def test_ring_with_kernels_and_segments(layout, positions, opts):
    """Ring attention over 2 GPUs with packed segment ids (many documents, some shorter than
    a tile, one of one token; padding tails; an all-padding row) and positions, kernels
    demanded (document bands per call): out, lse and (with a backward kernel) dq, dk, dv by
    the error-ratio rule against the float64 oracle of the dense document mask."""
    mesh = _mesh()
    b, s, hq, hkv, d = 2, 2048, 4, 2, 128
    q, k, v = helpers.random_qkv(jax.random.key(7), b, s, s, hq, hkv, d, jnp.bfloat16, scale=2.0)
    dout = helpers.random_like(jax.random.key(8), q)
    ids = segment_helpers.packed_ids(9, b, s, docs=12, pad_tail=40, empty_rows=(1,))
    pos = segment_helpers.restart_positions(ids) if positions else None
    perm = lambda x, a=1: ring.zigzag_permute(x, 2, a) if layout == "zigzag" else x
    unperm = lambda x, a=1: ring.zigzag_unpermute(x, 2, a) if layout == "zigzag" else x

    def f(q, k, v, ids, pos):
        return sharding.context_parallel_attention(
            q, k, v, mesh=mesh, seq_axis="sp", layout=layout, return_lse=True,
            implementation="cuda", q_segment_ids=ids, q_positions=pos, **opts)

    put = lambda x: jax.device_put(perm(jnp.asarray(x)), NamedSharding(mesh, P(None, "sp")))
    seg = (put(ids), None if pos is None else put(pos))
    (out, lse), vjp = jax.vjp(lambda q, k, v: jax.jit(f)(q, k, v, *seg), put(q), put(k), put(v))
    out, lse = unperm(out), unperm(lse, 2)
    grads = None
    if _ffi.unavailable_reason("bwd", jnp.bfloat16, d) is None:
        grads = [unperm(g) for g in vjp((put(dout), jnp.zeros_like(lse)))]
    helpers.check_against_oracle(f"ring-segments-{layout}", q, k, v, out=out, lse=lse,
                                 grads=grads, dout=dout if grads else None,
                                 segments=(ids, None, pos, None), **opts)
    assert not np.asarray(out)[1].any()


def test_batch_head_partition_with_segments():
    """(batch, heads) sharding over 2 GPUs with segment ids: one kernel call per device (no
    all-gather), results equal to one GPU."""
    mesh = jax.make_mesh((1, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2,
                         devices=jax.devices()[:2])
    q, k, v = helpers.random_qkv(jax.random.key(10), 2, 1024, 1024, 8, 2, 128, jnp.bfloat16)
    ids = jnp.asarray(segment_helpers.packed_ids(11, 2, 1024, docs=9))
    segments = Segments(ids, ids)
    left, right = band(True, (-1, -1))
    opts = _core.Options(softmax_scale=128 ** -0.5, left=left, right=right,
                         implementation=_core.resolve_implementation("cuda", q))
    spec = NamedSharding(mesh, P("data", None, "model"))
    fwd = jax.jit(lambda q, k, v, s: sharding.partitioned_attention_fwd(q, k, v, opts,
                                                                       segments=s))
    qs, ks, vs = (jax.device_put(x, spec) for x in (q, k, v))
    text = fwd.lower(qs, ks, vs, segments).compile().as_text()
    assert not re.search(r"\ball-gather\b", text)
    if opts.implementation == "cuda":
        assert _ffi.FWD_TARGET in text
    out, lse = fwd(qs, ks, vs, segments)
    want_out, want_lse = jax.jit(lambda q, k, v, s: _core.attention_fwd(q, k, v, opts,
                                                                      segments=s))(
        q, k, v, segments)
    want = np.asarray(want_out, np.float32)  # the same per-head work: equal up to one ulp
    np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=0,
                               atol=float(jnp.finfo(jnp.bfloat16).eps) * np.abs(want).max())
    np.testing.assert_allclose(lse, want_lse, rtol=0, atol=1e-5)
