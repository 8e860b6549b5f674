"""Packed sequences on the CPU: segment ids, positions and varlen (jax_fa3/segments.py).

* `kernel_bands` against the dense rule it encodes: for random segments that keep the kernel
  contract, [lo, hi) of each query row AND the band passed to the kernel reproduce the dense
  mask exactly, k_rows is its transpose, empty intervals are (2**30, 0), the group summaries
  are right; batch rows that break the contract are marked invalid (and only those); the
  cost stays small (no sort, nothing of size seqlen_q x seqlen_k).
* The portable path with segments against the float64 oracle (tests/helpers.py, whose mask is
  written independently), forward and gradients, by the error-ratio rule: ragged lengths,
  many documents per row, one-token documents, documents shorter than a block, empty
  segments, all-padding rows, GQA, causal + window, positions, sinks, any ids.
* flash_attention and flash_attention_varlen: varlen equals separate calls per sequence;
  jit, grad, vmap, remat; the kernel path's plumbing with a kernel emulator standing in for
  the FFI calls (bands in, the window the kernel gets, vmap folding); errors for bad input.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from segment_helpers import random_packed
from helpers import check_against_oracle, random_like, random_qkv, random_sinks
from jax_fa3 import _core, _ops, flash_attention, flash_attention_varlen, portable, segments
from jax_fa3._masks import UNBOUNDED, band
from jax_fa3.segments import Segments, kernel_bands, varlen_segments

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
NONE = (UNBOUNDED, 0)  # an empty interval


# ----------------------------------------------------------------------------- inputs

def packed(seed, batch, seqlen_q, seqlen_k=None, docs=4, *, positions="restart", **kw):
    """segment_helpers.random_packed; positions "restart" at 0 per document or start at a
    random "offset"."""
    return random_packed(seed, batch, seqlen_q, seqlen_k, docs,
                         offset=None if positions == "restart" else (-5, 40), **kw)


def as_segments(ids, with_positions):
    q_ids, kv_ids, q_pos, kv_pos = (jnp.asarray(x) for x in ids)
    return Segments(q_ids, kv_ids, q_pos, kv_pos) if with_positions else Segments(q_ids, kv_ids)


def oracle_segments(ids, with_positions):
    return ids if with_positions else ids[:2]


# ----------------------------------------------------------------------------- kernel bands

def _bands_np(segs, left, right, sq, sk):
    """kernel_bands op by op (each op compiles once per shape: faster here than a jit per
    band; test_kernel_bands_are_cheap compiles it)."""
    (q_rows, q_groups, k_rows, k_groups), kl, kr = kernel_bands(segs, left, right, sq, sk)
    return tuple(np.asarray(x) for x in (q_rows, q_groups, k_rows, k_groups)), kl, kr


def _interval_mask(rows, n_other):
    """(b, n, n_other) bool of per-row intervals [lo, hi)."""
    j = np.arange(n_other)[None, None, :]
    return (rows[..., :1] <= j) & (j < rows[..., 1:])


def _check_groups(rows, groups):
    b, s, _ = rows.shape
    n = segments.GROUP
    g = -(-s // n)
    assert groups.shape == (b, g, 4)
    padded = np.concatenate([rows, np.repeat(rows[:, -1:], g * n - s, axis=1)], axis=1)
    lo, hi = padded[..., 0].reshape(b, g, n), padded[..., 1].reshape(b, g, n)
    want = np.stack([lo.min(-1), lo.max(-1), hi.min(-1), hi.max(-1)], -1)
    np.testing.assert_array_equal(groups, want)


def check_bands(ids, left, right, with_positions, valid_rows=None):
    """The kernel's view (intervals AND the band it is passed) is the dense rule exactly, on
    the batch rows in `valid_rows` (default all); the others are marked invalid."""
    q_ids, kv_ids = ids[:2]
    b, sq = q_ids.shape
    sk = kv_ids.shape[1]
    (q_rows, q_groups, k_rows, k_groups), kl, kr = _bands_np(
        as_segments(ids, with_positions), left, right, sq, sk)
    assert (kl, kr) == ((UNBOUNDED, UNBOUNDED) if with_positions else (left, right))
    for x in (q_rows, q_groups, k_rows, k_groups):
        assert x.dtype == np.int32
    assert q_rows.shape == (b, sq, 2) and k_rows.shape == (b, sk, 2)
    valid = np.ones(b, bool) if valid_rows is None else np.isin(np.arange(b), valid_rows)
    kernel = _interval_mask(q_rows, sk) & helpers.band_mask(sq, sk, kl, kr)[None]
    want = helpers.segment_mask(oracle_segments(ids, with_positions), sq, sk, left, right)[:, 0]
    np.testing.assert_array_equal(kernel[valid], want[valid])
    # the transpose, as a relation on the intervals alone
    np.testing.assert_array_equal(_interval_mask(k_rows, sq).transpose(0, 2, 1),
                                  _interval_mask(q_rows, sk) & valid[:, None, None])
    # canonical empties; invalid rows
    for rows in (q_rows[valid], k_rows):
        empty = rows[..., 0] >= rows[..., 1]
        assert (rows[empty] == NONE).all() or (rows[empty][:, 1] == -1).all()
    assert (q_rows[valid][..., 1] >= 0).all()
    assert (q_rows[~valid] == (UNBOUNDED, -1)).all() and (k_rows[~valid] == NONE).all()
    _check_groups(q_rows, q_groups)
    _check_groups(k_rows, k_groups)
    return q_rows, k_rows


BANDS = [(UNBOUNDED, UNBOUNDED), (UNBOUNDED, 0), (5, 0), (3, 2), (0, 0), (-2, 6), (4, -1),
         (UNBOUNDED, -3), (-4, UNBOUNDED), (1 << 29, 7)]


@pytest.mark.parametrize("with_positions", [False, True], ids=["rows", "positions"])
@pytest.mark.parametrize("shape", [(3, 37, None, 5), (2, 64, 80, 9), (2, 50, 23, 3),
                                   (1, 17, 17, 17), (2, 100, 100, 1), (3, 1, 9, 2),
                                   (2, 33, 1, 2)],
                         ids=lambda s: f"b{s[0]}-q{s[1]}-k{s[2]}-docs{s[3]}")
def test_kernel_bands_reproduce_the_dense_rule(shape, with_positions):
    """Random contract-keeping segments (gaps in the ids, empty segments, one-token docs,
    padding between and after documents, all-padding rows, queries and keys with documents
    of their own lengths), every kind of band."""
    b, sq, sk, docs = shape
    for seed, (left, right) in enumerate(BANDS):
        ids = packed(seed * 31 + sq, b, sq, sk, docs, all_padding_rows=(b - 1,) if b > 2 else (),
                     positions="offset" if seed % 2 else "restart")
        check_bands(ids, left, right, with_positions)


def test_kernel_bands_many_documents_and_positions_across_them():
    """Self-attention rows of 64 one- and few-token documents; positions that continue
    across documents (not restarting) are fine too: only steps inside a run matter."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 4, size=60)
    ids = np.repeat(np.arange(1, 61), lengths)[None, :128].astype(np.int32)
    ids = np.pad(ids, ((0, 0), (0, 128 - ids.shape[1])))
    pos = np.arange(128, dtype=np.int32)[None]
    for left, right in BANDS:
        check_bands((ids, ids, pos, pos), left, right, True)
        check_bands((ids, ids, pos, pos), left, right, False)


def _break(kind, ids, pos):
    ids, pos = ids.copy(), pos.copy()
    if kind == "split-run":  # 1,1,0,1: one id in two runs
        ids[5:9] = [3, 3, 0, 3]
        ids[9:] = np.where(ids[9:] != 0, ids[9:] + 10, 0)
    elif kind == "decreasing":  # 2,2,1
        ids[:] = np.where(ids != 0, 10, 0)
        ids[20:] = np.where(ids[20:] != 0, 4, 0)
    elif kind == "two-runs-adjacent-ids":  # 1,2,1
        ids[10:12], ids[12:14], ids[14:16] = 7, 8, 7
        ids[16:] = np.where(ids[16:] != 0, ids[16:] + 20, 0)
    elif kind == "position-jump":
        run = np.flatnonzero((ids[1:] == ids[:-1]) & (ids[1:] != 0))[0] + 1
        pos[run:] += 1
    elif kind == "position-repeat":
        run = np.flatnonzero((ids[1:] == ids[:-1]) & (ids[1:] != 0))[0] + 1
        pos[run] = pos[run - 1]
    return ids, pos


@pytest.mark.parametrize("side", ["q", "kv"])
@pytest.mark.parametrize("kind", ["split-run", "decreasing", "two-runs-adjacent-ids",
                                  "position-jump", "position-repeat"])
def test_contract_violations_mark_the_batch_row_invalid(kind, side):
    """A batch row whose ids (or, with positions, their steps) break the contract gets hi = -1
    on every query row and no query on every key; the other batch rows are untouched."""
    b, sq, sk = 3, 40, 48
    q_ids, kv_ids, q_pos, kv_pos = packed(7, b, sq, sk, 4, pad_prob=0, empty_prob=0, one_prob=0)
    if side == "q":
        q_ids[1], q_pos[1] = _break(kind, q_ids[1], q_pos[1])
    else:
        kv_ids[1], kv_pos[1] = _break(kind, kv_ids[1], kv_pos[1])
    ids = (q_ids, kv_ids, q_pos, kv_pos)
    with_positions = kind.startswith("position")
    segs = as_segments(ids, with_positions)
    assert np.asarray(segments.contract_ok(segs)).tolist() == [True, False, True]
    check_bands(ids, UNBOUNDED, 0, with_positions, valid_rows=(0, 2))
    if with_positions:  # without positions, any positions keep the contract
        assert np.asarray(segments.contract_ok(Segments(*segs[:2]))).all()


def test_kernel_bands_with_saturating_positions_do_not_overflow():
    """Positions near the saturation limit and windows near UNBOUNDED: exact, the intervals
    inside the keys (int32 arithmetic never wraps). Positions past the limit saturate, so
    their runs stop stepping by 1: the batch row is invalid (never a wrapped interval)."""
    ids = np.array([[1] * 6 + [2] * 6], np.int32)
    for base in (2**31 - 100, -(2**31) + 5, segments.POS_LIMIT - 5, -segments.POS_LIMIT):
        pos = (base + np.arange(12)).astype(np.int32)[None]
        pos[0, 6:] = base + np.arange(6)
        for left, right in ((UNBOUNDED - 1, 0), (0, UNBOUNDED - 1), (-(UNBOUNDED - 1), 3),
                            (UNBOUNDED, -UNBOUNDED), (2, 2)):
            (q_rows, _, k_rows, _), _, _ = _bands_np(Segments(*map(jnp.asarray, (ids, ids, pos, pos))),
                                                     left, right, 12, 12)
            nonempty = q_rows[..., 0] < q_rows[..., 1]
            assert (q_rows[nonempty] >= 0).all() and (q_rows[nonempty] <= 12).all()
            kernel = _interval_mask(q_rows, 12)
            np.testing.assert_array_equal(kernel.transpose(0, 2, 1), _interval_mask(k_rows, 12))
            if abs(base) < 2**29:  # inside the limit: exact
                want = helpers.segment_mask((ids, ids, pos, pos), 12, 12, left, right)[:, 0]
                np.testing.assert_array_equal(kernel, want)
            else:
                assert (q_rows[..., 1] == -1).all()


def _all_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _all_eqns(inner)


@pytest.mark.parametrize("with_positions", [False, True], ids=["rows", "positions"])
def test_kernel_bands_are_cheap(with_positions):
    """No sort, no loop, nothing of size seqlen_q x seqlen_k, and a bounded number of
    operations (the binary search unrolls into log2(seqlen) steps per side)."""
    b, sq, sk = 4, 8192, 4096
    ids = jax.ShapeDtypeStruct((b, sq), jnp.int32)
    kv = jax.ShapeDtypeStruct((b, sk), jnp.int32)
    segs = Segments(ids, kv, ids, kv) if with_positions else Segments(ids, kv)
    jaxpr = jax.make_jaxpr(lambda s: kernel_bands(s, 100, 0, sq, sk))(segs).jaxpr
    eqns = list(_all_eqns(jaxpr))
    names = {e.primitive.name for e in eqns}
    assert not names & {"sort", "while"}, names
    for e in eqns:  # the binary search: a scan unrolled in full, no loop in the program
        if e.primitive.name == "scan":
            assert e.params["unroll"] >= e.params["length"] <= 14
    biggest = max(int(np.prod(v.aval.shape)) for e in eqns for v in e.outvars)
    assert biggest <= 4 * b * max(sq, sk), biggest
    hlo = jax.jit(lambda s: kernel_bands(s, 100, 0, sq, sk)).lower(segs).as_text()
    assert "stablehlo.sort" not in hlo and "stablehlo.while" not in hlo
    assert len(eqns) < 400, len(eqns)


# ----------------------------------------------------------------------------- exact rule

def test_visibility_is_the_equality_rule_for_any_ids():
    """The portable path's rule takes any ids (repeated runs, decreasing, negative) and
    matches the oracle's mask."""
    rng = np.random.default_rng(3)
    q_ids = rng.integers(-2, 4, size=(2, 30)).astype(np.int32)
    kv_ids = rng.integers(-2, 4, size=(2, 45)).astype(np.int32)
    q_pos = rng.integers(0, 50, size=(2, 30)).astype(np.int32)
    kv_pos = rng.integers(0, 50, size=(2, 45)).astype(np.int32)
    for left, right in BANDS:
        for segs, ids in ((Segments(*map(jnp.asarray, (q_ids, kv_ids))), (q_ids, kv_ids)),
                          (Segments(*map(jnp.asarray, (q_ids, kv_ids, q_pos, kv_pos))),
                           (q_ids, kv_ids, q_pos, kv_pos))):
            got = np.asarray(segments.dense_mask(segs, left, right))
            np.testing.assert_array_equal(got, helpers.segment_mask(ids, 30, 45, left,
                                                                    right)[:, 0])


# ----------------------------------------------------------------------------- portable path

def _opts(q, causal=False, window_size=(-1, -1), softcap=0.0, softmax_scale=None,
          implementation="xla"):
    left, right = band(causal, window_size)
    scale = 1.0 / np.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    return _core.Options(softmax_scale=scale, softcap=softcap, left=left, right=right,
                         implementation=implementation)


def core_fwd_bwd(q, k, v, dout, segs, sinks=None, dlse=None, block_k=None, **opts):
    """(out, lse, grads) of the core's local calls (portable), under jit."""
    o = _opts(q, **opts)

    @jax.jit
    def run(q, k, v, dout, segs, sinks, dlse):
        out, lse = _core.attention_fwd(q, k, v, o, sinks=sinks, segments=segs)
        *grads, dsinks = _core.attention_bwd(q, k, v, out, lse, dout, o, dlse=dlse,
                                             sinks=sinks, segments=segs)
        return out, lse, tuple(grads) + (() if sinks is None else (dsinks,))

    return run(q, k, v, dout, segs, sinks, dlse)


# (batch, seqlen_q, seqlen_k or None (self), heads_q, heads_kv, head_dim, head_dim_v, dtype,
#  docs, positions, sinks, all-padding rows, options, generator keywords)
CASES = {
    "many-docs-causal": (2, 200, None, 4, 2, 32, 32, BF16, 24, False, False, (),
                         dict(causal=True), {}),
    "one-token-docs": (1, 64, None, 2, 1, 16, 16, F32, 40, False, False, (), {},
                       dict(one_prob=0.8, pad_prob=0.1)),
    "short-docs-window-positions": (2, 300, None, 4, 4, 64, 64, F16, 12, True, False, (),
                                    dict(causal=True, window_size=(7, -1)), dict(max_len=40)),
    "cross-ragged-gqa8": (3, 129, 200, 8, 1, 32, 32, BF16, 5, False, False, (1,),
                          dict(causal=True), dict(empty_prob=0.3)),
    "cross-positions-sinks": (2, 100, 170, 4, 2, 32, 24, F32, 6, True, True, (),
                              dict(causal=True), {}),
    "all-padding-row-sinks": (3, 50, None, 2, 2, 16, 16, BF16, 3, False, True, (0, 2),
                              dict(window_size=(5, 5)), {}),
    "softcap-large-logits": (1, 257, None, 4, 2, 64, 64, F16, 6, True, False, (),
                             dict(causal=True, softcap=5.0), {}),
    "mla-192-128": (1, 130, None, 4, 2, 192, 128, BF16, 4, False, True, (),
                    dict(causal=True), {}),
    "window-both-sides-no-causal": (2, 90, 60, 2, 1, 32, 32, F32, 3, True, False, (),
                                    dict(window_size=(3, 9)), dict(positions="offset")),
}


@pytest.mark.parametrize("name", list(CASES))
def test_portable_matches_oracle(name):
    (b, sq, sk, hq, hkv, d, dv, dtype, docs, with_positions, with_sinks, pad_rows, opts,
     gen) = CASES[name]
    ids = packed(sq + docs, b, sq, sk, docs, all_padding_rows=pad_rows, **gen)
    sk = sq if sk is None else sk
    q, k, v = random_qkv(sq + 3 * docs, b, sq, sk, hq, hkv, d, dtype,
                         scale=4.0 if "large" in name else 1.0, head_dim_v=dv)
    sinks = random_sinks(docs, hq, loc=1.0) if with_sinks else None
    dout = random_like(5, jnp.zeros((b, sq, hq, dv), dtype))
    out, lse, grads = core_fwd_bwd(q, k, v, dout, as_segments(ids, with_positions), sinks,
                                   **opts)
    seg = oracle_segments(ids, with_positions)
    check_against_oracle(name, q, k, v, out, lse, grads, dout, sinks=sinks, segments=seg,
                         **opts)
    # padding query rows: out exactly 0, lse -inf (the sink), dq exactly 0
    pad = np.asarray(ids[0]) == 0
    assert (np.asarray(out, np.float32)[pad] == 0).all()
    assert (np.asarray(grads[0], np.float32)[pad] == 0).all()
    lse_pad = np.asarray(lse).transpose(0, 2, 1)[pad]
    if with_sinks:
        np.testing.assert_allclose(lse_pad, np.broadcast_to(np.asarray(sinks), lse_pad.shape),
                                   rtol=1e-6)
    else:
        assert np.isneginf(lse_pad).all()
    # keys nobody sees (padding): zero dk, dv
    kpad = np.asarray(ids[1]) == 0
    assert (np.asarray(grads[1], np.float32)[kpad] == 0).all()
    assert (np.asarray(grads[2], np.float32)[kpad] == 0).all()


@pytest.mark.parametrize("block_k", [1, 5, 16, 128])
def test_portable_block_size_does_not_change_result(block_k):
    """Documents shorter than, equal to and straddling the blocks."""
    ids = packed(11, 2, 70, 90, 8)
    q, k, v = random_qkv(12, 2, 70, 90, 4, 2, 16, F32)
    segs = as_segments(ids, True)
    kw = dict(softmax_scale=0.25, left=3, right=0, segments=segs)
    run = jax.jit(lambda q, k, v, s, bk: portable.forward(q, k, v, block_k=bk, **{
        **kw, "segments": s}), static_argnums=4)
    want = run(q, k, v, segs, 128)
    for a, b in zip(run(q, k, v, segs, block_k), want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_portable_takes_any_ids():
    """Ids that break the kernel contract (repeats, decreasing, negative) get the exact
    equality rule on the portable path."""
    rng = np.random.default_rng(8)
    q_ids = rng.integers(-1, 3, size=(2, 40)).astype(np.int32)
    kv_ids = rng.integers(-1, 3, size=(2, 33)).astype(np.int32)
    q, k, v = random_qkv(9, 2, 40, 33, 4, 2, 16, F32)
    dout = random_like(10, q)
    out, lse, grads = core_fwd_bwd(q, k, v, dout, Segments(jnp.asarray(q_ids),
                                                           jnp.asarray(kv_ids)))
    check_against_oracle("any ids", q, k, v, out, lse, grads, dout, segments=(q_ids, kv_ids))


def test_dense_variant_takes_segments():
    ids = packed(13, 2, 40, None, 5)
    q, k, v = random_qkv(14, 2, 40, 40, 4, 2, 16, F32)
    segs = as_segments(ids, True)
    out, lse = jax.jit(lambda q, k, v, s: portable.dense(
        q, k, v, softmax_scale=0.25, left=UNBOUNDED, right=0, segments=s))(q, k, v, segs)
    ref_out, ref_lse = helpers.reference_f64(q, k, v, softmax_scale=0.25, causal=True,
                                             segments=ids)
    np.testing.assert_allclose(out, ref_out, atol=2e-6)
    np.testing.assert_allclose(lse, ref_lse, atol=2e-6)


# ----------------------------------------------------------------------------- public API

def api_fwd_bwd(q, k, v, dout, sinks=None, **kw):
    """flash_attention's out, lse and gradients (q, k, v[, sinks]) under jit."""
    def f(q, k, v, *s):
        return flash_attention(q, k, v, sinks=s[0] if s else None, return_lse=True, **kw)

    @jax.jit
    def run(q, k, v, *s):
        out, vjp, lse = jax.vjp(f, q, k, v, *s, has_aux=True)
        return out, lse, vjp(dout)

    return run(q, k, v, *(() if sinks is None else (sinks,)))


def test_flash_attention_with_segment_ids_and_positions():
    ids = packed(20, 2, 96, None, 6)
    q, k, v = random_qkv(21, 2, 96, 96, 4, 2, 32, BF16)
    sinks = random_sinks(22, 4)
    dout = random_like(23, q)
    out, lse, grads = api_fwd_bwd(q, k, v, dout, sinks, causal=True, window_size=(9, -1),
                                  q_segment_ids=ids[0], q_positions=ids[2],
                                  implementation="xla")
    check_against_oracle("api", q, k, v, out, lse, grads, dout, sinks=sinks, causal=True,
                         window_size=(9, -1), segments=ids)


def test_flash_attention_cross_segments_without_positions():
    ids = packed(24, 2, 50, 77, 4)
    q, k, v = random_qkv(25, 2, 50, 77, 4, 4, 16, F32)
    dout = random_like(26, q)
    out, lse, grads = api_fwd_bwd(q, k, v, dout, q_segment_ids=ids[0],
                                  kv_segment_ids=jnp.asarray(ids[1], jnp.int64)
                                  if jax.config.jax_enable_x64 else ids[1].astype(np.int16))
    check_against_oracle("api cross", q, k, v, out, lse, grads, dout, segments=ids[:2])


def test_segments_without_ids_equal_the_plain_call():
    """One document covering every row (ids all 1, positions 0..s-1): the same results as no
    segments at all."""
    q, k, v = random_qkv(27, 2, 40, 40, 4, 2, 16, F32)
    ones = jnp.ones((2, 40), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(40), (2, 40))
    plain = flash_attention(q, k, v, causal=True, window_size=(5, -1), return_lse=True)
    for kw in (dict(q_segment_ids=ones), dict(q_segment_ids=ones, q_positions=pos)):
        got = flash_attention(q, k, v, causal=True, window_size=(5, -1), return_lse=True, **kw)
        for a, b in zip(got, plain):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def _varlen_case(seed, lengths_q, lengths_k, hq=4, hkv=2, d=32, dtype=F32, pad_q=3, pad_k=2):
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    tq, tk = int(cu_q[-1]) + pad_q, int(cu_k[-1]) + pad_k
    q, k, v = (x[0] for x in random_qkv(seed, 1, tq, tk, hq, hkv, d, dtype))
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("opts", [dict(causal=True), dict(), dict(window_size=(4, 2)),
                                  dict(causal=True, window_size=(3, -1), softcap=4.0)],
                         ids=["causal", "full", "window", "causal-window-softcap"])
def test_varlen_equals_separate_calls(opts):
    """Each sequence of the packed call (query lengths != key lengths, empty sequences, a
    one-token one, padding after the last) equals its own flash_attention call; out, lse
    and the gradients."""
    lengths_q = [5, 0, 17, 1, 9, 30]
    lengths_k = [8, 3, 12, 1, 9, 0]
    q, k, v, cu_q, cu_k = _varlen_case(30, lengths_q, lengths_k)
    sinks = random_sinks(31, 4)
    dout = random_like(32, q)

    @jax.jit
    def packed_call(q, k, v, sinks):
        f = lambda q, k, v, s: flash_attention_varlen(q, k, v, cu_q, cu_k, 30, 12, sinks=s,
                                                      return_lse=True, **opts)
        out, vjp, lse = jax.vjp(f, q, k, v, sinks, has_aux=True)
        return out, lse, vjp(dout)

    out, lse, (dq, dk, dv, dsinks) = packed_call(q, k, v, sinks)
    assert out.shape == q.shape and lse.shape == (4, q.shape[0])
    want_dsinks = np.zeros(4)
    for r in range(len(lengths_q)):
        qs, ks = slice(cu_q[r], cu_q[r + 1]), slice(cu_k[r], cu_k[r + 1])
        if lengths_q[r] == 0:
            continue
        f = lambda q, k, v, s: flash_attention(q[None], k[None], v[None], sinks=s,
                                               return_lse=True, **opts)
        (o_r, l_r), vjp = jax.vjp(f, q[qs], k[ks], v[ks], sinks)
        g_r = vjp((dout[qs][None], jnp.zeros_like(l_r)))
        np.testing.assert_allclose(out[qs], o_r[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(lse[:, qs], l_r[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(dq[qs], g_r[0], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(dk[ks], g_r[1], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(dv[ks], g_r[2], rtol=1e-4, atol=1e-5)
        want_dsinks += np.asarray(g_r[3])
    np.testing.assert_allclose(dsinks, want_dsinks, rtol=1e-4, atol=1e-5)
    # padding tokens: out 0, lse = the sink, zero gradients; keys of an empty query sequence
    # and padding keys get zero gradients
    tail = slice(int(cu_q[-1]), None)
    assert (np.asarray(out[tail]) == 0).all() and (np.asarray(dq[tail]) == 0).all()
    np.testing.assert_allclose(lse[:, tail], np.broadcast_to(np.asarray(sinks)[:, None],
                                                             lse[:, tail].shape), rtol=1e-6)
    for ks in (slice(cu_k[1], cu_k[2]), slice(int(cu_k[-1]), None)):
        assert (np.asarray(dk[ks]) == 0).all() and (np.asarray(dv[ks]) == 0).all()


def test_varlen_segments_layout():
    segs = varlen_segments(jnp.array([0, 3, 3, 5]), jnp.array([0, 1, 4, 8]), 7, 9)
    np.testing.assert_array_equal(segs.q_ids[0], [1, 1, 1, 3, 3, 0, 0])
    np.testing.assert_array_equal(segs.kv_ids[0], [1, 2, 2, 2, 3, 3, 3, 3, 0])
    # bottom-right alignment: q_pos = t - cu_q + (len_k - len_q)
    np.testing.assert_array_equal(segs.q_pos[0], [-2, -1, 0, 2, 3, 0, 0])
    np.testing.assert_array_equal(segs.kv_pos[0], [0, 0, 1, 2, 0, 1, 2, 3, 0])
    assert np.asarray(segments.contract_ok(segs)).all()


def test_varlen_with_traced_offsets_and_no_sequences():
    q, k, v, cu_q, cu_k = _varlen_case(33, [4, 6], [5, 5])
    f = jax.jit(lambda cq, ck: flash_attention_varlen(q, k, v, cq, ck, 6, 5, causal=True))
    np.testing.assert_allclose(f(cu_q, cu_k), flash_attention_varlen(q, k, v, cu_q, cu_k, 6, 5,
                                                                     causal=True), atol=1e-6)
    none = flash_attention_varlen(q, k, v, np.array([0]), np.array([0]), 0, 0)
    assert (np.asarray(none) == 0).all()


# ----------------------------------------------------------------------------- transforms

def test_vmap_over_segments_and_inputs():
    """vmap over a leading axis of q, k, v and the segment ids equals the per-element calls;
    also with the ids shared (not mapped)."""
    ids = np.stack([packed(40 + i, 2, 30, None, 3)[0] for i in range(3)])  # (3, 2, 30)
    q, k, v = (x.reshape(3, 2, 30, 2, 16) for x in random_qkv(41, 6, 30, 30, 2, 2, 16, F32))
    f = lambda q, k, v, ids: flash_attention(q, k, v, causal=True, q_segment_ids=ids)
    got = jax.jit(jax.vmap(f))(q, k, v, ids)
    shared = jax.jit(jax.vmap(f, in_axes=(0, 0, 0, None)))(q, k, v, ids[0])
    for i in range(3):
        np.testing.assert_allclose(got[i], f(q[i], k[i], v[i], ids[i]), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(shared[i], f(q[i], k[i], v[i], ids[0]), rtol=1e-6, atol=1e-6)
    # vmap(grad) over the whole stack of 3 (with 8 CPU devices, through the sharding route;
    # tests/test_sharding.py checks sharded stacks against the oracle)
    dout = random_like(42, q[0])
    loss = lambda q, ids: (f(q, k[0], v[0], ids) * dout).sum()
    g = jax.jit(jax.vmap(jax.grad(loss)))(q, ids)
    for i in range(3):
        np.testing.assert_allclose(g[i], jax.grad(loss)(q[i], ids[i]), rtol=1e-5, atol=1e-6)


def test_remat_and_grad_of_grad_free_path():
    """jax.checkpoint around the call recomputes the same gradients; the ids are not
    differentiated (integer inputs)."""
    ids = packed(50, 2, 40, None, 4)
    q, k, v = random_qkv(51, 2, 40, 40, 2, 1, 16, F32)
    f = lambda q, k, v: (flash_attention(q, k, v, causal=True, q_segment_ids=ids[0],
                                         q_positions=ids[2]) ** 2).sum()
    want = jax.grad(f, argnums=(0, 1, 2))(q, k, v)
    got = jax.jit(jax.grad(jax.checkpoint(f), argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # int inputs get float0 cotangents through jax.vjp
    _, vjp = jax.vjp(lambda q, i: flash_attention(q, k, v, q_segment_ids=i), q,
                     jnp.asarray(ids[0]))
    dq, dids = vjp(jnp.ones_like(q))
    assert dids.dtype == jax.dtypes.float0


# ----------------------------------------------------------------------------- kernel plumbing

def _emulated_kernel_fwd(calls):
    """A stand-in for _ops.fwd: the kernel's semantics from its operands (the document bands
    AND the band it is passed, NaN on invalid rows), on the portable dense path."""
    def fwd(q, k, v, sinks=None, bands=None, *, softmax_scale, softcap, window_left,
            window_right):
        calls.append(dict(bands=bands, left=window_left, right=window_right))
        sq, sk = q.shape[1], k.shape[1]
        q_rows = bands[0]
        j = jnp.arange(sk)
        mask = (q_rows[..., :1] <= j) & (j < q_rows[..., 1:])  # (b, sq, sk)
        out, lse = portable.dense(q, k, v, sinks, softmax_scale=softmax_scale, softcap=softcap,
                                  left=window_left, right=window_right, mask=mask[:, None])
        bad = q_rows[..., 1] < 0  # (b, sq)
        out = jnp.where(bad[:, :, None, None], jnp.nan, out)
        lse = jnp.where(bad[:, None, :], jnp.nan, lse)
        return out, lse
    return fwd


@pytest.mark.parametrize("with_positions", [False, True], ids=["rows", "positions"])
def test_kernel_route_passes_bands_and_window(monkeypatch, with_positions):
    """On the kernel route the core builds the bands and passes the kernel the window (the
    unbounded one with positions); an emulated kernel then matches the oracle, under vmap
    too; invalid batch rows come back NaN."""
    calls = []
    monkeypatch.setattr(_ops, "fwd", _emulated_kernel_fwd(calls))
    ids = packed(60, 3, 48, 64, 5)
    q_ids, kv_ids = ids[:2]
    q_ids = q_ids.copy()
    q_ids[2, :4] = [1, 2, 1, 2]  # breaks the contract: batch row 2 is invalid
    ids = (q_ids, kv_ids) + ids[2:]
    q, k, v = random_qkv(61, 3, 48, 64, 4, 2, 16, F32)
    o = _opts(q, causal=True, window_size=(6, -1), implementation="cuda")
    segs = as_segments(ids, with_positions)
    out, lse = jax.jit(lambda q, k, v, s: _core.attention_fwd(q, k, v, o, segments=s))(
        q, k, v, segs)
    assert (calls[-1]["left"], calls[-1]["right"]) == (
        (UNBOUNDED, UNBOUNDED) if with_positions else (6, 0))
    n = segments.GROUP
    assert [x.shape for x in calls[-1]["bands"]] == [(3, 48, 2), (3, -(-48 // n), 4), (3, 64, 2),
                                                      (3, -(-64 // n), 4)]
    ref_out, ref_lse = helpers.reference_f64(q[:2], k[:2], v[:2], causal=True,
                                             window_size=(6, -1), segments=tuple(
                                                 x[:2] for x in oracle_segments(ids,
                                                                                with_positions)))
    np.testing.assert_allclose(out[:2], ref_out, atol=2e-6)
    np.testing.assert_allclose(lse[:2], ref_lse, atol=2e-6)
    assert np.isnan(np.asarray(out[2])).all() and np.isnan(np.asarray(lse[2])).all()


def test_deterministic_backward_with_segments_takes_the_portable_path(monkeypatch):
    """The deterministic kernel backward takes no document bands: with segments the core
    runs the portable backward; without deterministic, the kernel backward gets the bands."""
    seen = []

    def bwd(q, k, v, out, lse, dout, bands=None, **kw):
        seen.append(bands)
        return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)

    monkeypatch.setattr(_ops, "bwd", bwd)
    monkeypatch.setattr(_core, "unavailable_reason", lambda *a, **k: None)
    ids = packed(62, 2, 32, None, 3)
    q, k, v = random_qkv(63, 2, 32, 32, 2, 2, 16, F32)
    segs = as_segments(ids, False)
    out, lse = _core.attention_fwd(q, k, v, _opts(q, causal=True), segments=segs)
    for deterministic, kernel in ((True, False), (False, True)):
        o = _core.Options(softmax_scale=0.25, right=0, deterministic=deterministic,
                          implementation="cuda")
        seen.clear()
        _core.attention_bwd(q, k, v, out, lse, q, o, segments=segs)
        assert bool(seen) == kernel
        if kernel:
            assert seen[0] is not None and len(seen[0]) == 4


# ----------------------------------------------------------------------------- errors

def _qkv(sq=10, sk=10):
    return random_qkv(70, 2, sq, sk, 2, 2, 16, F32)


@pytest.mark.parametrize("kwargs,error,words", [
    (dict(kv_segment_ids=np.ones((2, 10), np.int32)), ValueError, "without q_segment_ids"),
    (dict(q_positions=np.ones((2, 10), np.int32)), ValueError, "without q_segment_ids"),
    (dict(q_segment_ids=np.ones((2, 9), np.int32)), ValueError, "q_segment_ids must have shape (2, 10)"),
    (dict(q_segment_ids=np.ones((2, 10), np.float32)), TypeError, "float32"),
    (dict(q_segment_ids=np.ones((2, 10), bool)), TypeError, "integer"),
    (dict(q_segment_ids=np.ones((2, 10), np.int32), kv_segment_ids=np.ones((2, 10, 1),
                                                                            np.int32)),
     ValueError, "kv_segment_ids must have shape (2, 10)"),
    (dict(q_segment_ids=np.ones((2, 10), np.int32), kv_segment_ids=np.ones((2, 10), np.int32),
          q_positions=np.ones((2, 10), np.int32)), ValueError, "without kv_positions"),
    (dict(q_segment_ids=np.ones((2, 10), np.int32), q_positions=np.ones((10,), np.int32)),
     ValueError, "q_positions must have shape (2, 10)"),
])
def test_bad_segment_arguments(kwargs, error, words):
    q, k, v = _qkv()
    with pytest.raises(error, match=None) as info:
        flash_attention(q, k, v, **kwargs)
    assert words in str(info.value), str(info.value)


def test_q_ids_alone_need_equal_lengths():
    q, k, v = _qkv(10, 12)
    with pytest.raises(ValueError, match="seqlen_q == seqlen_k"):
        flash_attention(q, k, v, q_segment_ids=np.ones((2, 10), np.int32))


@pytest.mark.parametrize("cu_q,cu_k,max_q,error,words", [
    (np.array([1, 5]), np.array([0, 5]), 8, ValueError, "from 0"),
    (np.array([0, 6, 5]), np.array([0, 5, 6]), 8, ValueError, "non-decreasing"),
    (np.array([0, 5, 99]), np.array([0, 5, 6]), 99, ValueError, "at most 13"),
    (np.array([0, 9]), np.array([0, 5]), 4, ValueError, "max_seqlen_q=4"),
    (np.array([0, 5, 7]), np.array([0, 5]), 8, ValueError, "one length"),
    (np.array([[0, 5]]), np.array([0, 5]), 8, TypeError, "1-D integer"),
    (np.array([0.0, 5.0]), np.array([0, 5]), 8, TypeError, "1-D integer"),
])
def test_bad_varlen_arguments(cu_q, cu_k, max_q, error, words):
    q, k, v = (x[0] for x in random_qkv(71, 1, 13, 11, 2, 2, 16, F32))
    with pytest.raises(error) as info:
        flash_attention_varlen(q, k, v, cu_q, cu_k, max_q, 11)
    assert words in str(info.value), str(info.value)


def test_varlen_needs_rank_3():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="rank 3"):
        flash_attention_varlen(q, k, v, np.array([0, 5]), np.array([0, 5]), 5, 5)
    with pytest.raises(TypeError, match="max_seqlen_k"):
        flash_attention_varlen(q[0], k[0], v[0], np.array([0, 5]), np.array([0, 5]), 5, 5.5)
