"""Context-parallel (ring / all-gather) attention on 8 simulated CPU devices.

The block-pair planner is checked exhaustively against the global mask in numpy; the ring
itself against the float64 oracle (tests/helpers.py) and against unsharded attention.
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
from jax_fa3 import ring
from jax_fa3._masks import band
from jax_fa3.attention import flash_attention
from jax_fa3.sharding import context_parallel_attention

NDEV = 8


# conftest.py gives the CPU backend 8 devices; elsewhere (a 1-GPU machine) this module skips.
pytestmark = pytest.mark.skipif(
    jax.device_count() < NDEV, reason=f"needs {NDEV} devices (the CPU suite simulates them)")


# ----------------------------------------------------------------------------- planner (numpy)

def _positions(layout, n, rank, length):
    """Global position of each local index under `layout`."""
    pos = np.empty(length, np.int64)
    for seg in ring.layout_segments(layout, n, rank, length):
        pos[seg.local:seg.local + seg.length] = np.arange(seg.glob, seg.glob + seg.length)
    return pos


def _coverage(calls, sq, sk):
    """How many calls cover each (local query, local key) cell, with their local bands."""
    cover = np.zeros((sq, sk), np.int64)
    for c in calls:
        cover[c.q0:c.q1, c.k0:c.k1] += helpers.band_mask(c.q1 - c.q0, c.k1 - c.k0, c.left,
                                                         c.right)
    return cover


def _global_visible(qpos, kpos, seq_q, seq_k, left, right):
    rel = kpos[None, :] - qpos[:, None] - (seq_k - seq_q)
    return (rel >= -left) & (rel <= right)


@pytest.mark.parametrize("layout", ring.LAYOUTS)
@pytest.mark.parametrize("causal,window,sq,sk", [
    (True, (-1, -1), 8, 8), (False, (-1, -1), 8, 8), (True, (5, -1), 8, 8),
    (False, (3, 9), 8, 8), (True, (-1, -1), 4, 8), (True, (-1, -1), 8, 4), (False, (0, 0), 6, 6)])
def test_planner_covers_exactly_the_mask(layout, causal, window, sq, sk):
    """Every visible (query, key) pair of every block is computed exactly once, nothing else;
    fully masked blocks produce no call."""
    n = 4
    left, right = band(causal, window)
    seq_q, seq_k = n * sq, n * sk
    for r in range(n):
        qpos = _positions(layout, n, r, sq)
        for step in range(n):
            src = (r - step) % n
            calls = ring.ring_step_plans(layout, n, step, sq, sk, left, right)[r]
            want = _global_visible(qpos, _positions(layout, n, src, sk), seq_q, seq_k, left, right)
            np.testing.assert_array_equal(_coverage(calls, sq, sk), want.astype(np.int64))
            assert all(_coverage([c], sq, sk).any() for c in calls), "a call with no work"
        calls = ring.allgather_plans(layout, n, sq, sk, left, right)[r]
        want = _global_visible(qpos, np.arange(seq_k), seq_q, seq_k, left, right)
        np.testing.assert_array_equal(_coverage(calls, sq, seq_k), want.astype(np.int64))


def test_zigzag_balances_causal_work():
    """Causal zig-zag: after the diagonal step, each device does the same work per step in ONE
    unmasked call; the contiguous layout leaves device 0 idle after step 0."""
    n, s = 8, 16
    left, right = band(True, (-1, -1))
    for step in range(1, n):
        plans = ring.ring_step_plans("zigzag", n, step, s, s, left, right)
        for calls in plans:
            assert len(calls) == 1 and calls[0].full
            assert (calls[0].q1 - calls[0].q0) * (calls[0].k1 - calls[0].k0) == s * s // 2
        contiguous = ring.ring_step_plans("contiguous", n, step, s, s, left, right)
        assert contiguous[0] == () and len(contiguous[n - 1]) == 1


@pytest.mark.parametrize("layout", ring.LAYOUTS)
def test_pair_plans_cover_each_piece_pair_once(layout):
    """With positions (data, not rows) every (query piece, key piece) is one call with the
    band as given, none merged: positions stay consecutive inside each call."""
    n, s = 4, 8
    for r in range(n):
        q_segs = ring.layout_segments(layout, n, r, s)
        for src in range(n):
            k_segs = ring.layout_segments(layout, n, src, s)
            calls = ring.pair_plans(q_segs, k_segs, 3, 0)
            assert len(calls) == len(q_segs) * len(k_segs)
            assert all((c.left, c.right) == (3, 0) for c in calls)
            cover = np.zeros((s, s), np.int64)
            for c in calls:
                cover[c.q0:c.q1, c.k0:c.k1] += 1
            assert (cover == 1).all()


def test_zigzag_helpers_round_trip():
    n, s = 4, 24
    x = jnp.arange(2 * s * 3).reshape(2, s, 3)
    y = ring.zigzag_permute(x, n)
    np.testing.assert_array_equal(ring.zigzag_unpermute(y, n), x)
    pos = np.asarray(ring.zigzag_positions(s, n))
    np.testing.assert_array_equal(np.asarray(y[0, :, 0]) // 3, pos)
    c = s // (2 * n)
    for r in range(n):  # device r holds chunks r and 2n-1-r
        local = pos[r * 2 * c:(r + 1) * 2 * c]
        np.testing.assert_array_equal(local, np.r_[r * c:(r + 1) * c,
                                                   (2 * n - 1 - r) * c:(2 * n - r) * c])
    lse = jnp.arange(2 * 3 * s, dtype=jnp.float32).reshape(2, 3, s)
    np.testing.assert_array_equal(ring.zigzag_unpermute(ring.zigzag_permute(lse, n, 2), n, 2), lse)
    with pytest.raises(ValueError, match="divisible"):
        ring.zigzag_permute(jnp.zeros((1, 10, 1)), n)


# ----------------------------------------------------------------------------- ring on devices

def _mesh(shape, names, types=AxisType.Auto):
    n = int(np.prod(shape))
    return jax.make_mesh(shape, names, axis_types=(types,) * len(names),
                         devices=jax.devices()[:n])


SEGMENT_ARGS = ("q_segment_ids", "kv_segment_ids", "q_positions", "kv_positions")


def _run_cp(q, k, v, dout, dlse, *, mesh, seq_axis, layout, sinks=None, segments=None, **kw):
    """context_parallel_attention on natural-order global arrays: (out, lse, dq, dk, dv) in
    natural order, and dsinks last with `sinks`. Zig-zag inputs (segment ids and positions
    too: `segments` = (q_ids, kv_ids, q_pos, kv_pos), None entries left out) are permuted in
    and the results permuted back."""
    n = mesh.shape[seq_axis]
    zz = layout == "zigzag"
    perm = (lambda x, a=1: ring.zigzag_permute(x, n, a)) if zz else (lambda x, a=1: x)
    unperm = (lambda x, a=1: ring.zigzag_unpermute(x, n, a)) if zz else (lambda x, a=1: x)
    segments = (None,) * 4 if segments is None else tuple(
        None if x is None else jnp.asarray(x) for x in segments)

    @jax.jit
    def run(q, k, v, dout, dlse, sinks, segments):
        seg_kw = {name: perm(x) for name, x in zip(SEGMENT_ARGS, segments) if x is not None}
        f = lambda q, k, v, *s: context_parallel_attention(
            q, k, v, mesh=mesh, seq_axis=seq_axis, layout=layout, return_lse=True,
            sinks=s[0] if s else None, **seg_kw, **kw)
        extra = () if sinks is None else (sinks,)
        (out, lse), vjp = jax.vjp(f, perm(q), perm(k), perm(v), *extra)
        grads = vjp((perm(dout), perm(dlse, 2)))
        return (unperm(out), unperm(lse, 2)) + tuple(unperm(g) for g in grads[:3]) + grads[3:]

    return run(q, k, v, dout, dlse, sinks, segments)


CASES = {  # name: (devices, layout, strategy, sq_local, sk_local, hq, hkv, options)
    "zigzag-causal-gqa-8dev": (8, "zigzag", "ring", 4, 4, 4, 2, dict(causal=True)),
    "contiguous-noncausal-mqa-8dev": (8, "contiguous", "ring", 4, 4, 4, 1, dict()),
    "zigzag-window-softcap": (4, "zigzag", "ring", 4, 4, 4, 2,
                              dict(causal=True, window_size=(5, -1), softcap=3.0)),
    "contiguous-window-both": (4, "contiguous", "ring", 4, 4, 2, 2, dict(window_size=(6, 3))),
    "zigzag-causal-sq<sk": (4, "zigzag", "ring", 2, 4, 2, 1, dict(causal=True)),
    "allgather-zigzag-window": (4, "zigzag", "allgather", 4, 4, 4, 2,
                                dict(causal=True, window_size=(9, -1))),
}


@pytest.mark.parametrize("name", list(CASES))
def test_ring_matches_oracle(name):
    """Ring (and all-gather) attention on a (seq) mesh vs the float64 oracle: out, lse, dq,
    dk, dv by the error-ratio rule of docs/architecture.md, with bf16 inputs and large logits."""
    n, layout, strategy, sq, sk, hq, hkv, opts = CASES[name]
    b, d = 2, 16
    mesh = _mesh((n,), ("sp",))
    key = jax.random.key(sum(map(ord, name)))
    q, k, v = helpers.random_qkv(key, b, n * sq, n * sk, hq, hkv, d, jnp.bfloat16, scale=2.0)
    dout = helpers.random_like(jax.random.fold_in(key, 1), q)
    dlse = jnp.zeros((b, hq, n * sq), jnp.float32)
    out, lse, *grads = _run_cp(q, k, v, dout, dlse, mesh=mesh, seq_axis="sp", layout=layout,
                               strategy=strategy, **opts)
    helpers.check_against_oracle(name, q, k, v, out=out, lse=lse, grads=grads, dout=dout, **opts)


SINK_CASES = {  # name: (devices, layout, strategy, sq_local, sk_local, hq, hkv, dv, options)
    "zigzag-causal-gqa-dv8": (4, "zigzag", "ring", 4, 4, 4, 2, 8, dict(causal=True)),
    "contiguous-sliding-window-sink": (4, "contiguous", "ring", 4, 4, 4, 1, 16,
                                       dict(causal=True, window_size=(3, -1))),
    "zigzag-causal-sq>sk-dv24": (4, "zigzag", "ring", 4, 2, 2, 1, 24, dict(causal=True)),
    "allgather-window-softcap": (4, "zigzag", "allgather", 4, 4, 4, 2, 8,
                                 dict(causal=True, window_size=(5, -1), softcap=3.0)),
}


@pytest.mark.parametrize("name", list(SINK_CASES))
def test_ring_with_sinks_matches_oracle(name):
    """Ring (and all-gather) attention with sinks and a v head dim of its own vs the float64
    oracle: out, lse, dq, dk, dv and dsinks by the error-ratio rule (bf16, large logits;
    seq_q > seq_k leaves rows without keys, whose lse is the sink)."""
    n, layout, strategy, sq, sk, hq, hkv, dv, opts = SINK_CASES[name]
    b, d = 2, 16
    mesh = _mesh((n,), ("sp",))
    key = jax.random.key(sum(map(ord, name)))
    q, k, v = helpers.random_qkv(key, b, n * sq, n * sk, hq, hkv, d, jnp.bfloat16, scale=2.0,
                                 head_dim_v=dv)
    sinks = helpers.random_sinks(jax.random.fold_in(key, 2), hq, loc=2.0)
    dout = helpers.random_like(jax.random.fold_in(key, 1), jnp.zeros((b, n * sq, hq, dv),
                                                                    jnp.bfloat16))
    dlse = jnp.zeros((b, hq, n * sq), jnp.float32)
    out, lse, *grads = _run_cp(q, k, v, dout, dlse, mesh=mesh, seq_axis="sp", layout=layout,
                               strategy=strategy, sinks=sinks, **opts)
    assert out.shape == (b, n * sq, hq, dv) and grads[3].shape == (hq,)
    helpers.check_against_oracle(name, q, k, v, out=out, lse=lse, grads=grads, dout=dout,
                                 sinks=sinks, **opts)


def test_allgather_equals_ring_and_unsharded():
    """float32 with an LSE cotangent: ring, all-gather and unsharded flash_attention agree to
    float32 rounding (the LSE cotangent path included)."""
    b, s, hq, hkv, d = 2, 4 * 8, 4, 2, 16
    opts = dict(causal=True, window_size=(11, -1), softcap=4.0)
    q, k, v = helpers.random_qkv(jax.random.key(7), b, s, s, hq, hkv, d, jnp.float32)
    dout = helpers.random_like(jax.random.key(8), q)
    dlse = jax.random.normal(jax.random.key(9), (b, hq, s), jnp.float32)
    mesh = _mesh((4,), ("sp",))
    results = [_run_cp(q, k, v, dout, dlse, mesh=mesh, seq_axis="sp", layout="zigzag",
                       strategy=strategy, **opts) for strategy in ("ring", "allgather")]
    (out, lse), vjp = jax.vjp(lambda q, k, v: flash_attention(q, k, v, return_lse=True, **opts),
                              q, k, v)
    unsharded = (out, lse) + vjp((dout, dlse))
    for got in results:
        for name, a, r in zip(("out", "lse", "dq", "dk", "dv"), got, unsharded):
            np.testing.assert_allclose(a, r, rtol=2e-5, atol=2e-5, err_msg=name)


def test_batch_and_seq_mesh_with_heads():
    """Mesh (batch=2, seq=2, heads=2): ring over 'seq' while batch and heads stay local;
    output shardings follow the inputs."""
    mesh = _mesh((2, 2, 2), ("data", "seq", "heads"))
    b, s, hq, hkv, d = 2, 16, 4, 2, 16
    opts = dict(causal=True)
    q, k, v = helpers.random_qkv(jax.random.key(3), b, s, s, hq, hkv, d, jnp.float32)
    dout = helpers.random_like(jax.random.key(4), q)
    spec = P("data", "seq", "heads", None)
    put = lambda x: jax.device_put(x, NamedSharding(mesh, spec))
    kw = dict(mesh=mesh, seq_axis="seq", batch_axis="data", head_axis="heads", layout="zigzag",
              **opts)
    f = jax.jit(lambda q, k, v: context_parallel_attention(q, k, v, return_lse=True, **kw))
    perm = lambda x, a=1: ring.zigzag_permute(x, 2, a)
    (out, lse), vjp = jax.vjp(f, *(put(perm(x)) for x in (q, k, v)))
    assert out.sharding.spec == spec
    assert lse.sharding.spec == P("data", "heads", "seq")
    dq, dk, dv = vjp((put(perm(dout)), jnp.zeros_like(lse)))
    assert dk.sharding.spec == spec
    unperm = lambda x, a=1: ring.zigzag_unpermute(x, 2, a)
    ref_out, ref_lse = helpers.reference_f64(q, k, v, **opts)
    ref_grads = helpers.reference_grads_f64(q, k, v, dout, **opts)
    np.testing.assert_allclose(unperm(out), ref_out, atol=2e-5)
    np.testing.assert_allclose(unperm(lse, 2), ref_lse, atol=2e-5)
    for g, r in zip((dq, dk, dv), ref_grads):
        np.testing.assert_allclose(unperm(g), r, atol=5e-5)


def test_fully_masked_rows_and_explicit_mesh():
    """seq_q > seq_k with a causal mask: the first queries see no key at all (out 0, lse
    -inf, zero and finite gradients). Uses an Explicit-axes mesh and ring_attention directly
    inside a user shard_map."""
    mesh = _mesh((4,), ("sp",), AxisType.Explicit)
    b, sq, sk, h, d = 1, 32, 8, 2, 8
    q, k, v = helpers.random_qkv(jax.random.key(5), b, sq, sk, h, h, d, jnp.float32)

    def local(q, k, v):
        return ring.ring_attention(q, k, v, axis_name="sp", causal=True, return_lse=True)

    spec = P(None, "sp")
    f = jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec),
                      out_specs=(spec, P(None, None, "sp")))  # check_vma on
    q, k, v = (jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v))
    out, lse = jax.jit(f)(q, k, v)
    assert lse.sharding.spec == P(None, None, "sp")
    grads = jax.jit(jax.grad(lambda q, k, v: f(q, k, v)[0].sum(), argnums=(0, 1, 2)))(q, k, v)
    ref_out, ref_lse = helpers.reference_f64(q, k, v, causal=True)
    assert np.isneginf(ref_lse).sum() == b * h * (sq - sk)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    np.testing.assert_allclose(out, ref_out, atol=2e-6)
    assert not np.asarray(out)[:, :sq - sk].any()
    ref_grads = helpers.reference_grads_f64(q, k, v, jnp.ones_like(q), causal=True)
    for g, r in zip(grads, ref_grads):
        helpers.assert_finite("grad", g)
        np.testing.assert_allclose(g, r, atol=2e-5)

    # With sinks shared by every device (check_vma: invariant) and an LSE cotangent: rows
    # without keys get lse = the sink, and the sinks' gradient is the whole sequence's.
    sinks = jnp.asarray([0.5, -1.0], jnp.float32)
    dlse = jax.random.normal(jax.random.key(6), (b, h, sq), jnp.float32)
    g = jax.shard_map(
        lambda q, k, v, s: ring.ring_attention(q, k, v, axis_name="sp", causal=True, sinks=s,
                                               return_lse=True),
        mesh=mesh, in_specs=(spec, spec, spec, P()), out_specs=(spec, P(None, None, "sp")))
    out, lse = jax.jit(g)(q, k, v, sinks)
    np.testing.assert_array_equal(np.asarray(lse)[:, :, :sq - sk],
                                  np.broadcast_to(np.asarray(sinks)[:, None], (b, h, sq - sk)))
    dlse_s = jax.device_put(dlse, NamedSharding(mesh, P(None, None, "sp")))
    grads = jax.jit(lambda *a: jax.vjp(g, *a)[1]((jnp.ones_like(q), dlse_s)))(q, k, v, sinks)
    ref = helpers.reference_grads_f64(q, k, v, jnp.ones_like(q), dlse=dlse, sinks=sinks,
                                      causal=True)
    for g_, r in zip(grads, ref):
        helpers.assert_finite("grad with sinks", g_)
        np.testing.assert_allclose(g_, r, atol=5e-5)


def test_ring_hlo_permutes_one_dtype_and_never_gathers():
    """The ring sends each K/V block with its own collective-permute in its own dtype (bf16)
    and the dK/dV accumulators in float32 (JAX >= 0.7.1 rejects mixed-dtype permutes); it
    never all-gathers, while the all-gather strategy does. (The lowered module is checked:
    XLA:CPU itself later upcasts bf16 collectives.)"""
    mesh = _mesh((4,), ("sp",))
    q, k, v = helpers.random_qkv(jax.random.key(9), 1, 16, 16, 2, 2, 8, jnp.bfloat16)

    def grad_fn(strategy):
        f = lambda q, k, v: context_parallel_attention(
            q, k, v, mesh=mesh, seq_axis="sp", causal=True, layout="zigzag", strategy=strategy)
        return jax.jit(jax.grad(lambda *a: f(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2)))

    ring_fn = grad_fn("ring")
    lowered = ring_fn.lower(q, k, v).as_text()
    permutes = re.findall(r"collective_permute.*: \((.*?)\) ->", lowered)
    assert sorted(set(permutes)) == ["tensor<1x4x2x8xbf16>", "tensor<1x4x2x8xf32>"], permutes
    assert "all-gather" not in ring_fn.lower(q, k, v).compile().as_text()
    assert "all-gather" in grad_fn("allgather").lower(q, k, v).compile().as_text()


# ----------------------------------------------------------------------------- packed sequences

def _packed(seed, b, seq_q, seq_k, positions, empty_rows=()):
    """(q_ids, kv_ids, q_pos, kv_pos) in natural order: several documents per row (one of
    them one token long), padding tails, `empty_rows` all padding; kv ids of their own when
    the lengths differ (None otherwise); with `positions`, positions restarting at each
    document (None otherwise)."""
    q_ids = segment_helpers.packed_ids(seed, b, seq_q, docs=5, empty_rows=empty_rows)
    kv_ids = q_ids if seq_q == seq_k else segment_helpers.packed_ids(
        seed + 1, b, seq_k, docs=5, empty_rows=empty_rows)
    if not positions:
        return q_ids, (None if seq_q == seq_k else kv_ids), None, None
    q_pos = segment_helpers.restart_positions(q_ids)
    return q_ids, kv_ids, q_pos, segment_helpers.restart_positions(kv_ids)


SEGMENT_CASES = {  # name: (devices, layout, strategy, sq_local, sk_local, hq, hkv, positions,
    #                    options)
    "zigzag-causal-gqa-8dev": (8, "zigzag", "ring", 4, 4, 4, 2, False, dict(causal=True)),
    "zigzag-causal-positions": (4, "zigzag", "ring", 8, 8, 4, 2, True, dict(causal=True)),
    "contiguous-noncausal-mqa": (4, "contiguous", "ring", 8, 8, 4, 1, False, dict()),
    "contiguous-window-positions": (4, "contiguous", "ring", 8, 8, 2, 2, True,
                                    dict(causal=True, window_size=(5, -1), softcap=3.0)),
    "zigzag-causal-sq<sk-own-kv-ids": (4, "zigzag", "ring", 4, 8, 2, 1, False,
                                       dict(causal=True)),
    "allgather-zigzag-window": (4, "zigzag", "allgather", 8, 8, 4, 2, False,
                                dict(causal=True, window_size=(9, -1))),
    "allgather-zigzag-positions": (4, "zigzag", "allgather", 8, 8, 4, 2, True,
                                   dict(causal=True)),
}


@pytest.mark.parametrize("name", list(SEGMENT_CASES))
def test_ring_with_segments_matches_oracle(name):
    """Ring (and all-gather) attention with packed segment ids (and positions), ids
    permuted with the tokens under zig-zag, vs the float64 oracle of the dense document mask:
    out, lse, dq, dk, dv by the error-ratio rule (bf16, large logits); an all-padding batch
    row gives out 0, lse -inf, zero gradients."""
    n, layout, strategy, sq, sk, hq, hkv, positions, opts = SEGMENT_CASES[name]
    b, d = 3, 16
    mesh = _mesh((n,), ("sp",))
    key = jax.random.key(sum(map(ord, name)))
    q, k, v = helpers.random_qkv(key, b, n * sq, n * sk, hq, hkv, d, jnp.bfloat16, scale=2.0)
    dout = helpers.random_like(jax.random.fold_in(key, 1), q)
    dlse = jnp.zeros((b, hq, n * sq), jnp.float32)
    segments = _packed(sum(map(ord, name)), b, n * sq, n * sk, positions, empty_rows=(2,))
    out, lse, *grads = _run_cp(q, k, v, dout, dlse, mesh=mesh, seq_axis="sp", layout=layout,
                               strategy=strategy, segments=segments, **opts)
    helpers.check_against_oracle(name, q, k, v, out=out, lse=lse, grads=grads, dout=dout,
                                 segments=segments, **opts)
    assert not np.asarray(out)[2].any() and np.isneginf(np.asarray(lse)[2]).all()
    for g in grads:
        assert not np.asarray(g)[2].any()


def test_ring_segments_equal_unsharded_with_sinks():
    """float32, sinks and an LSE cotangent: ring and all-gather attention with segment ids
    and positions equal the single-device flash_attention (the portable path), dsinks
    included."""
    b, s, hq, hkv, d = 2, 4 * 8, 4, 2, 16
    opts = dict(causal=True, window_size=(11, -1), softcap=4.0)
    q, k, v = helpers.random_qkv(jax.random.key(17), b, s, s, hq, hkv, d, jnp.float32)
    dout = helpers.random_like(jax.random.key(18), q)
    dlse = jax.random.normal(jax.random.key(19), (b, hq, s), jnp.float32)
    sinks = helpers.random_sinks(20, hq)
    q_ids, _, q_pos, _ = _packed(21, b, s, s, True)
    mesh = _mesh((4,), ("sp",))
    seg = dict(q_segment_ids=jnp.asarray(q_ids), q_positions=jnp.asarray(q_pos))
    (out, lse), vjp = jax.vjp(lambda q, k, v, sk: flash_attention(
        q, k, v, sinks=sk, return_lse=True, implementation="xla", **seg, **opts), q, k, v, sinks)
    unsharded = (out, lse) + vjp((dout, dlse))
    for strategy in ("ring", "allgather"):
        got = _run_cp(q, k, v, dout, dlse, mesh=mesh, seq_axis="sp", layout="zigzag",
                      strategy=strategy, sinks=sinks, segments=(q_ids, None, q_pos, None),
                      **opts)
        for label, a, r in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), got, unsharded):
            np.testing.assert_allclose(a, r, rtol=2e-5, atol=2e-5, err_msg=f"{strategy} {label}")


def test_ring_segments_in_user_shard_map_with_check_vma():
    """ring_attention with segment ids inside a user shard_map on an Explicit mesh (check_vma
    on): the ids ride the ring with their K/V blocks; forward and gradients equal the oracle.
    Only kv ids without q ids is an error naming the argument."""
    mesh = _mesh((4,), ("sp",), AxisType.Explicit)
    b, s, h, d = 2, 32, 2, 8
    q, k, v = helpers.random_qkv(jax.random.key(23), b, s, s, h, h, d, jnp.float32)
    ids = segment_helpers.packed_ids(24, b, s, docs=6)
    spec = P(None, "sp")

    def local(q, k, v, ids):
        return ring.ring_attention(q, k, v, axis_name="sp", causal=True, return_lse=True,
                                   q_segment_ids=ids)

    f = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 4,
                      out_specs=(spec, P(None, None, "sp")))
    args = tuple(jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v, ids))
    out, lse = jax.jit(f)(*args)
    ref_out, ref_lse = helpers.reference_f64(q, k, v, causal=True, segments=(ids, None))
    np.testing.assert_allclose(out, ref_out, atol=2e-6)
    np.testing.assert_allclose(lse, ref_lse, atol=2e-6)
    grads = jax.jit(jax.grad(lambda *a: f(*a)[0].sum(), argnums=(0, 1, 2)))(*args)
    ref = helpers.reference_grads_f64(q, k, v, jnp.ones_like(q), causal=True,
                                      segments=(ids, None))
    for g, r in zip(grads, ref):
        np.testing.assert_allclose(g, r, atol=2e-5)

    g = jax.shard_map(lambda q, k, v, ids: ring.ring_attention(q, k, v, axis_name="sp",
                                                               kv_segment_ids=ids),
                      mesh=mesh, in_specs=(spec,) * 4, out_specs=spec)
    with pytest.raises(ValueError, match="kv_segment_ids"):
        jax.jit(g)(*args)
    with pytest.raises(ValueError, match="q_segment_ids"):
        context_parallel_attention(q, k, v, mesh=mesh, seq_axis="sp",
                                   q_segment_ids=jnp.zeros((b, s + 1), jnp.int32))
