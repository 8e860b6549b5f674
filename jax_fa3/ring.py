"""Context parallelism: attention over a sequence sharded across a mesh axis.

Call `ring_attention` inside `jax.shard_map` on the local sequence shards; outside, use
`jax_fa3.sharding.context_parallel_attention` on global arrays.

Two strategies:
  * 'ring': K/V blocks travel around the ring with `ppermute`; each device attends its local
    queries to the block it holds and merges the partial (out, lse) exactly. The transfer of
    the next block is issued before the current block is computed, so the two can overlap.
    The backward is a ring too: dK/dV accumulators (float32) travel with their K/V block and
    arrive back at their owner after a full turn.
  * 'allgather': gather all of K/V once (cheap when heads_kv is small), attend, and
    reduce-scatter dK/dV in the backward.

Layouts (how the global sequence is split over the N devices of the axis):
  * 'contiguous': device r holds tokens [r*s, (r+1)*s). Correct for any mask, but under a
    causal mask device N-1 does N times the work of device 0.
  * 'zigzag': the sequence is cut into 2N chunks and device r holds chunks r and 2N-1-r, so
    causal work is equal on every device. Permute global arrays with `zigzag_permute` before
    sharding (and `zigzag_unpermute` the result); `zigzag_positions` gives RoPE positions.

Attention sinks enter once, after the last block: the sink is one more partial, with out 0
and lse sinks[h], merged like the others. The backward needs them only for their own
gradient, formed once from the final lse and D = rowsum(dout * out); every ring step uses the
final lse (which includes the sinks) and is exact without them. v may have its own head dim.

Packed sequences (segment ids, optional positions; see jax_fa3/segments.py) travel with their
tokens: the query's ids and positions stay with the local queries, the keys' ride the ring
(or are all-gathered) with their K/V block, and zig-zag permutes them with the tokens (permute
global id arrays with `zigzag_permute` like q, k, v). Each local call gets the ids (and
positions) of its chunks. Without positions the band is the row-index band of the global
sequence, so the planner below shifts it per chunk as for plain attention and the document
rule (equal ids, id 0 is padding) is applied on top. With positions the band follows the
positions, which are data: every (query piece, key piece) pair is called with the call's own
band (no static skipping; the kernels skip tiles whose documents or positions do not meet),
one call per piece so that positions stay consecutive inside each call.

Which block pairs need work is decided statically: for each ring step and each device a small
planner lists the kernel calls on (query chunk, key chunk) pairs with their shifted mask band
(see jax_fa3/_masks.py; bounds may be negative), skipping fully masked pairs and calling
unmasked pairs with unbounded bands. Devices with different plans pick theirs with
`lax.switch` on the axis index, so skipped pairs cost nothing at run time.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero

from jax_fa3 import _core, _validate, portable
from jax_fa3._core import Options
from jax_fa3._masks import UNBOUNDED
from jax_fa3.segments import Segments
from jax_fa3._vma import sum_like, varying_like

__all__ = ["ring_attention", "zigzag_permute", "zigzag_unpermute", "zigzag_positions",
           "ring_attention_fwd", "ring_attention_bwd", "Ring", "STRATEGIES", "LAYOUTS"]

STRATEGIES = ("ring", "allgather")
LAYOUTS = ("contiguous", "zigzag")


# ----------------------------------------------------------------------------- zig-zag helpers

def _zigzag_order(seq_len: int, num_devices: int) -> np.ndarray:
    """Global token index stored at each position of the zig-zag (permuted) order."""
    n2 = 2 * num_devices
    if seq_len % n2:
        raise ValueError(f"zig-zag needs the sequence length ({seq_len}) to be divisible by "
                         f"2 * num_devices = {n2}")
    c = seq_len // n2
    chunks = [i for r in range(num_devices) for i in (r, n2 - 1 - r)]
    return np.concatenate([np.arange(i * c, (i + 1) * c) for i in chunks])


def zigzag_permute(x, num_devices: int, axis: int = 1):
    """Reorder the sequence `axis` of a global array into zig-zag order: after sharding it
    contiguously over `num_devices`, device r holds chunks r and 2N-1-r of the original."""
    return jnp.take(x, _zigzag_order(x.shape[axis], num_devices), axis=axis)


def zigzag_unpermute(x, num_devices: int, axis: int = 1):
    """Inverse of `zigzag_permute`: back to the natural sequence order."""
    inverse = np.argsort(_zigzag_order(x.shape[axis], num_devices))
    return jnp.take(x, inverse, axis=axis)


def zigzag_positions(seq_len: int, num_devices: int):
    """int32 (seq_len,): the original position of each token in zig-zag order (for RoPE)."""
    return jnp.asarray(_zigzag_order(seq_len, num_devices), jnp.int32)


# ----------------------------------------------------------------------------- static planner

@dataclasses.dataclass(frozen=True)
class Segment:
    """A run of tokens that is contiguous both in local memory and in the global sequence."""
    local: int   # start in the local array
    glob: int    # start in the global sequence
    length: int


@dataclasses.dataclass(frozen=True)
class Call:
    """One local attention call: queries [q0, q1) against keys [k0, k1) of the local arrays,
    with the band (left, right) in the local convention of jax_fa3/_masks.py."""
    q0: int
    q1: int
    k0: int
    k1: int
    left: int
    right: int

    @property
    def full(self) -> bool:
        return self.left == UNBOUNDED and self.right == UNBOUNDED


def layout_segments(layout: str, num_devices: int, rank: int, local_len: int) -> list[Segment]:
    """The global pieces that device `rank` holds under `layout`."""
    if layout == "contiguous":
        return [Segment(0, rank * local_len, local_len)]
    c = local_len // 2
    return [Segment(0, rank * c, c), Segment(c, (2 * num_devices - 1 - rank) * c, c)]


def _pair_call(qs: Segment, ks: Segment, seq_q: int, seq_k: int, left: int, right: int):
    """The call for one segment pair, trimmed to the keys some query sees; None if no query
    sees any key. Bands are bottom-right aligned on the GLOBAL lengths."""
    diag = seq_k - seq_q
    # Key j is visible to query i iff lo <= j - i <= hi (global positions).
    lo = -math.inf if left >= UNBOUNDED else diag - left
    hi = math.inf if right >= UNBOUNDED else diag + right
    q_first, q_last = qs.glob, qs.glob + qs.length - 1
    # Keys that at least one query of the segment sees.
    j0 = max(ks.glob, q_first + lo)
    j1 = min(ks.glob + ks.length - 1, q_last + hi)
    if j0 > j1 or lo > hi:
        return None
    j0, j1 = int(j0), int(j1)
    lq, lk = qs.length, j1 - j0 + 1
    # With local i', j' (i = q_first + i', j = j0 + j') the condition lo <= j - i <= hi reads
    # -L' <= j' - i' - (lk - lq) <= R' in the local convention, where
    #   L' = (j0 - q_first) + (lk - lq) - lo   and   R' = hi - (j0 - q_first) - (lk - lq).
    # A side that no pair of the block violates is left unbounded (no mask work there).
    off = (j0 - q_first) + (lk - lq)
    new_left = UNBOUNDED if j0 - q_last >= lo else off - int(lo)
    new_right = UNBOUNDED if j1 - q_first <= hi else int(hi) - off
    k0 = ks.local + (j0 - ks.glob)
    return Call(qs.local, qs.local + qs.length, k0, k0 + lk, new_left, new_right)


def plan_calls(q_segs: Sequence[Segment], k_segs: Sequence[Segment], seq_q: int, seq_k: int,
               left: int, right: int) -> tuple[Call, ...]:
    """All calls needed for local queries `q_segs` against the held keys `k_segs`.

    Unmasked calls on adjacent keys merge into one call; query segments whose unmasked calls
    are identical merge too, so a zig-zag ring step needs one call where it can."""
    per_q = []
    for qs in q_segs:
        calls = [c for ks in k_segs if (c := _pair_call(qs, ks, seq_q, seq_k, left, right))]
        merged: list[Call] = []
        for c in calls:
            p = merged[-1] if merged else None
            if p is not None and p.full and c.full and p.k1 == c.k0:
                merged[-1] = dataclasses.replace(p, k1=c.k1)
            else:
                merged.append(c)
        per_q.append(merged)
    out: list[list[Call]] = []
    for calls in per_q:
        prev = out[-1] if out else None
        if (prev and calls and len(prev) == len(calls) and all(c.full for c in prev + calls)
                and all((a.k0, a.k1) == (b.k0, b.k1) for a, b in zip(prev, calls))
                and prev[0].q1 == calls[0].q0):
            out[-1] = [dataclasses.replace(a, q1=b.q1) for a, b in zip(prev, calls)]
        else:
            out.append(calls)
    return tuple(c for calls in out for c in calls)


def ring_step_plans(layout: str, n: int, step: int, sq_local: int, sk_local: int, left: int,
                    right: int) -> list[tuple[Call, ...]]:
    """Per device r: the calls of ring step `step`, when r holds the K/V block of r - step."""
    plans = []
    for r in range(n):
        src = (r - step) % n
        plans.append(plan_calls(layout_segments(layout, n, r, sq_local),
                                layout_segments(layout, n, src, sk_local),
                                n * sq_local, n * sk_local, left, right))
    return plans


def allgather_plans(layout: str, n: int, sq_local: int, sk_local: int, left: int,
                    right: int) -> list[tuple[Call, ...]]:
    """Per device r: the calls against the whole K/V in natural order."""
    seq_k = n * sk_local
    return [plan_calls(layout_segments(layout, n, r, sq_local), [Segment(0, 0, seq_k)],
                       n * sq_local, seq_k, left, right) for r in range(n)]


def pair_plans(q_segs: Sequence[Segment], k_segs: Sequence[Segment], left: int,
               right: int) -> tuple[Call, ...]:
    """One call per (query piece, key piece), every one with the band (left, right) as is:
    the plan when positions (data, not row indices) decide the band. Pieces are never
    merged, so that inside a call the positions of a document stay consecutive (a zig-zag
    device holds two pieces of the sequence far apart)."""
    return tuple(Call(qs.local, qs.local + qs.length, ks.local, ks.local + ks.length, left, right)
                 for qs in q_segs for ks in k_segs if qs.length and ks.length)


def natural_order(x, n: int, layout: str, axis: int = 1):
    """Gathered K/V (device-major order) -> natural sequence order (a static permutation)."""
    if layout == "contiguous":
        return x
    return zigzag_unpermute(x, n, axis)


def gathered_order(x, n: int, layout: str, axis: int = 1):
    """Inverse of `natural_order`."""
    if layout == "contiguous":
        return x
    return zigzag_permute(x, n, axis)


# ----------------------------------------------------------------------------- local math

@dataclasses.dataclass(frozen=True)
class Ring:
    """How the sequence is spread (hashable: a custom_vjp nondiff argument): the mesh axis
    (a name or a tuple of names), the strategy and the layout. The attention options
    themselves are the `jax_fa3._core.Options` of the call, with the GLOBAL band."""
    axis_name: object
    strategy: str = "ring"
    layout: str = "contiguous"


def _lse_weights(lse):
    """(b, h, s) -> (b, s, h, 1), to scale an (b, s, h, d) output."""
    return jnp.swapaxes(lse, 1, 2)[..., None]


def merge_partials(o_a, lse_a, o_b, lse_b):
    """Exact merge of two normalised partial attentions over disjoint key sets.

    o: (b, s, h, d) float32, lse: (b, h, s) float32 with -inf for rows that saw no key
    (their o is 0). A row that saw nothing in both stays 0 with lse -inf, no NaN."""
    m = jnp.maximum(lse_a, lse_b)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    wa, wb = jnp.exp(lse_a - m), jnp.exp(lse_b - m)  # exp(-inf) = 0 for empty rows
    total = wa + wb
    seen = total > 0
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)
    inv = jnp.where(seen, 1.0 / jnp.where(seen, total, 1.0), 0.0)
    o = o_a * _lse_weights(wa * inv) + o_b * _lse_weights(wb * inv)
    return o, lse


def merge_sinks(o, lse, sinks):
    """(o, lse) with the attention sinks merged in: one more partial per row, with out 0
    (a scalar: nothing the size of o is made) and lse sinks[h] of the row's head."""
    sink_lse = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None], lse.shape)
    return merge_partials(o, lse, jnp.zeros((), o.dtype), sink_lse)


def _slice_segments(segments, q0: int, q1: int, k0: int, k1: int):
    """The segment ids and positions of queries [q0, q1) and keys [k0, k1) (None stays None;
    no segments: None)."""
    if segments is None:
        return None
    q_ids, kv_ids, q_pos, kv_pos = segments
    cut = lambda x, a, b: None if x is None else x[:, a:b]
    return type(segments)(cut(q_ids, q0, q1), cut(kv_ids, k0, k1), cut(q_pos, q0, q1),
                          cut(kv_pos, k0, k1))


def _kv_side(segments):
    """(kv_ids, kv_pos): what travels with the K/V blocks (None without segments)."""
    return None if segments is None else (segments[1], segments[3])


def _with_kv_side(segments, kv_side):
    """segments with the keys' ids and positions replaced by `kv_side`."""
    if segments is None:
        return None
    return type(segments)(segments[0], kv_side[0], segments[2], kv_side[1])


def _has_positions(segments) -> bool:
    """Whether the band follows positions (given with the segment ids) rather than rows."""
    if segments is None or (segments[2] is None and segments[3] is None):
        return False
    if segments[2] is None or segments[3] is None:
        raise ValueError("ring attention needs both query and key positions, or neither")
    return True


def _fwd_calls(calls, opts: Options, q, k, v, acc, segments=None, local_fwd=None):
    """Run `calls` on (q, k, v) (and the segment ids / positions of the same tokens) and merge
    each into the accumulator (o f32, lse). `local_fwd(q, k, v, opts, segments)`: the local
    attention, `_core.attention_fwd` by default.

    Updates are dynamic_update_slice, not `.at[...].set`: see `_add_rows`."""
    o_acc, lse_acc = acc
    local_fwd = local_fwd or (lambda q, k, v, opts, segments: _core.attention_fwd(
        q, k, v, opts, segments=segments))
    for c in calls:
        o, lse = local_fwd(q[:, c.q0:c.q1], k[:, c.k0:c.k1], v[:, c.k0:c.k1],
                           opts.with_band(c.left, c.right),
                           _slice_segments(segments, c.q0, c.q1, c.k0, c.k1))
        o, lse = merge_partials(o_acc[:, c.q0:c.q1], lse_acc[:, :, c.q0:c.q1],
                                o.astype(jnp.float32), lse.astype(jnp.float32))
        o_acc = lax.dynamic_update_slice_in_dim(o_acc, o, c.q0, axis=1)
        lse_acc = lax.dynamic_update_slice_in_dim(lse_acc, lse, c.q0, axis=2)
    return o_acc, lse_acc


def _add_rows(acc, x, start):
    """acc[:, start:start + x.shape[1]] += x (float32), as a static slice and update.

    Not `acc.at[...].add`: a slice spanning the whole axis makes a scatter whose index is an
    empty int32[0] constant, which JAX 0.11 hoists into shard_map as an operand; XLA's
    Shardy partitioner then segfaults on it (JAX 0.11.2, CPU and GPU)."""
    part = lax.slice_in_dim(acc, start, start + x.shape[1], axis=1) + x.astype(jnp.float32)
    return lax.dynamic_update_slice_in_dim(acc, part, start, axis=1)


def _bwd_calls(calls, opts: Options, q, k, v, out, lse, dout, dlse, acc, segments=None):
    """Add the partial (dq, dk, dv) of `calls` into float32 accumulators. The LSE cotangent
    `dlse` (or None) adds p * dlse to dS, which splits over key blocks like the rest."""
    dq, dk, dv = acc
    for c in calls:
        gq, gk, gv, _ = _core.attention_bwd(
            q[:, c.q0:c.q1], k[:, c.k0:c.k1], v[:, c.k0:c.k1], out[:, c.q0:c.q1],
            lse[:, :, c.q0:c.q1], dout[:, c.q0:c.q1], opts.with_band(c.left, c.right),
            dlse=None if dlse is None else dlse[:, :, c.q0:c.q1],
            segments=_slice_segments(segments, c.q0, c.q1, c.k0, c.k1))
        dq = _add_rows(dq, gq, c.q0)
        dk = _add_rows(dk, gk, c.k0)
        dv = _add_rows(dv, gv, c.k0)
    return dq, dk, dv


def _switch(axis_name, plans, run, operands, step=0):
    """Run this device's plan: `run(calls, *operands)` with calls = plans[step][rank].

    `step` may be traced (inside a scan over ring steps). Plans shared by several devices or
    steps are traced once, and a device whose plan is empty runs nothing."""
    distinct = list(dict.fromkeys(p for row in plans for p in row))
    if len(distinct) == 1:
        return run(distinct[0], *operands)
    table = jnp.asarray([[distinct.index(p) for p in row] for row in plans], jnp.int32)
    branches = [lambda ops, p=p: run(p, *ops) for p in distinct]
    return lax.switch(table[step, lax.axis_index(axis_name)], branches, operands)


def _ring_perm(n: int):
    """Each device sends to the next one."""
    return [(i, (i + 1) % n) for i in range(n)]


# ----------------------------------------------------------------------------- fwd / bwd

def _ring_plans(ring: Ring, n: int, sq: int, sk: int, opts: Options, positions: bool):
    """Per ring step, per device: the calls (see `ring_step_plans`; `pair_plans` with
    positions)."""
    if positions:
        return [[pair_plans(layout_segments(ring.layout, n, r, sq),
                            layout_segments(ring.layout, n, (r - t) % n, sk), opts.left,
                            opts.right) for r in range(n)] for t in range(n)]
    return [ring_step_plans(ring.layout, n, t, sq, sk, opts.left, opts.right) for t in range(n)]


def _allgather_plans(ring: Ring, n: int, sq: int, sk: int, opts: Options, positions: bool):
    """Per device: the calls against the gathered K/V in natural order."""
    if positions:
        return [[pair_plans(layout_segments(ring.layout, n, r, sq), [Segment(0, 0, n * sk)],
                            opts.left, opts.right) for r in range(n)]]
    return [allgather_plans(ring.layout, n, sq, sk, opts.left, opts.right)]


def _gather_natural(x, ring: Ring, n: int):
    """All of a sequence-sharded array (K, V, the keys' ids or positions) in natural order."""
    if x is None:
        return None
    return natural_order(lax.all_gather(x, ring.axis_name, axis=1, tiled=True), n, ring.layout)


def _send(tree, ring: Ring, perm):
    """ppermute every array of `tree` (None leaves stay None) to the next device."""
    return jax.tree.map(lambda x: lax.ppermute(x, ring.axis_name, perm), tree)


def ring_attention_fwd(q, k, v, opts: Options, ring: Ring, sinks=None, segments=None,
                       local_fwd=None, out_dtype=None):
    """Local shards in, local (out (b, sq_local, hq, dv) in q.dtype, lse float32 (b, hq,
    sq_local)) out; `sinks` None or (hq,) float32, merged once at the end; `segments` None
    or a `jax_fa3.segments.Segments` of the local tokens (ids (b, sq_local) / (b, sk_local),
    positions likewise or None), in the layout of q and k. `local_fwd(q, k, v, opts,
    segments)` -> (out, lse) replaces the local attention (the FP8 forward, with its
    descales, which belong to heads, not tokens), and `out_dtype` q.dtype.

    The building block of `ring_attention` and of the sharding rules; not differentiable
    (use `ring_attention`)."""
    n = lax.axis_size(ring.axis_name)
    sq, sk = q.shape[1], k.shape[1]
    b, _, hq, _ = q.shape
    positions = _has_positions(segments)
    acc = (jnp.zeros((b, sq, hq, v.shape[3]), jnp.float32),
           jnp.full((b, hq, sq), -jnp.inf, jnp.float32))
    acc = tuple(varying_like(a, q, k, v) for a in acc)

    def run(calls, acc, q, k, v, kv_side):
        return _fwd_calls(calls, opts, q, k, v, acc, _with_kv_side(segments, kv_side),
                          local_fwd)

    kv_side = _kv_side(segments)
    if ring.strategy == "allgather":
        kf, vf = (_gather_natural(x, ring, n) for x in (k, v))
        kv_side = jax.tree.map(lambda x: _gather_natural(x, ring, n), kv_side)
        plans = _allgather_plans(ring, n, sq, sk, opts, positions)
        acc = _switch(ring.axis_name, plans, run, (acc, q, kf, vf, kv_side))
    else:
        plans = _ring_plans(ring, n, sq, sk, opts, positions)
        perm = _ring_perm(n)

        def step(carry, t):
            k, v, kv_side, acc = carry
            # Issue the next block's transfer before this block's compute: they overlap.
            k_next, v_next, kv_next = _send((k, v, kv_side), ring, perm)
            acc = _switch(ring.axis_name, plans[:-1], run, (acc, q, k, v, kv_side), t)
            return (k_next, v_next, kv_next, acc), None

        # A scan, not an unrolled loop: the plans repeat across steps, so each is compiled once.
        if n > 1:
            (k, v, kv_side, acc), _ = lax.scan(step, (k, v, kv_side, acc), jnp.arange(n - 1))
        # last block: no send
        acc = _switch(ring.axis_name, plans[-1:], run, (acc, q, k, v, kv_side))
    o, lse = acc
    if sinks is not None:
        o, lse = merge_sinks(o, lse, sinks)
    return o.astype(q.dtype if out_dtype is None else out_dtype), lse


def ring_attention_bwd(q, k, v, out, lse, dout, opts: Options, ring: Ring, dlse=None,
                       segments=None):
    """(dq, dk, dv) of the local shards, given the final local out/lse (sinks included,
    when there are sinks: nothing else of them is needed here), dout, optionally an LSE
    cotangent dlse (b, hq, sq_local), and the local `segments` as in `ring_attention_fwd`."""
    n = lax.axis_size(ring.axis_name)
    sq, sk = q.shape[1], k.shape[1]
    f32 = jnp.float32
    positions = _has_positions(segments)

    def run(calls, acc, q, k, v, out, lse, dout, kv_side):
        return _bwd_calls(calls, opts, q, k, v, out, lse, dout, dlse, acc,
                          _with_kv_side(segments, kv_side))

    kv_side = _kv_side(segments)
    if ring.strategy == "allgather":
        kf, vf = (_gather_natural(x, ring, n) for x in (k, v))
        kv_side = jax.tree.map(lambda x: _gather_natural(x, ring, n), kv_side)
        acc = (jnp.zeros(q.shape, f32), jnp.zeros(kf.shape, f32), jnp.zeros(vf.shape, f32))
        acc = tuple(varying_like(a, q, k, v, out, lse, dout) for a in acc)
        plans = _allgather_plans(ring, n, sq, sk, opts, positions)
        dq, dk, dv = _switch(ring.axis_name, plans, run,
                             (acc, q, kf, vf, out, lse, dout, kv_side))
        # Every device holds partial dK/dV for the whole sequence: sum them onto the owners.
        dk = lax.psum_scatter(gathered_order(dk, n, ring.layout), ring.axis_name,
                              scatter_dimension=1, tiled=True)
        dv = lax.psum_scatter(gathered_order(dv, n, ring.layout), ring.axis_name,
                              scatter_dimension=1, tiled=True)
    else:
        plans = _ring_plans(ring, n, sq, sk, opts, positions)
        perm = _ring_perm(n)

        def compute(k, v, kv_side, grads, step_plans, t=0):
            return _switch(ring.axis_name, step_plans, run,
                           (grads, q, k, v, out, lse, dout, kv_side), t)

        def step(carry, t):
            k, v, kv_side, dq, dk, dv = carry
            k_next, v_next, kv_next = _send((k, v, kv_side), ring, perm)
            dq, dk, dv = compute(k, v, kv_side, (dq, dk, dv), plans[:-1], t)
            # The float32 dK/dV accumulators follow their block around the ring.
            dk, dv = _send((dk, dv), ring, perm)
            return (k_next, v_next, kv_next, dq, dk, dv), None

        dq, dk, dv = (varying_like(jnp.zeros(x.shape, f32), q, k, v, out, lse, dout)
                      for x in (q, k, v))
        if n > 1:
            (k, v, kv_side, dq, dk, dv), _ = lax.scan(step, (k, v, kv_side, dq, dk, dv),
                                                      jnp.arange(n - 1))
        dq, dk, dv = compute(k, v, kv_side, (dq, dk, dv), plans[-1:])
        # Device r now holds the accumulators of block r + 1: one more hop takes them home.
        dk, dv = _send((dk, dv), ring, perm)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


# ----------------------------------------------------------------------------- public entry

def _check_inputs(q, k, v, strategy, layout):
    """Shapes, dtypes and options of ring_attention (q, k, v checks shared with the public
    API); errors name the argument and what was expected. Returns q, k, v as arrays."""
    q, k, v = _validate.check_qkv(q, k, v)
    if strategy not in STRATEGIES:
        raise ValueError(f"ring_attention: strategy must be one of {STRATEGIES}, got {strategy!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"ring_attention: layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "zigzag" and (q.shape[1] % 2 or k.shape[1] % 2):
        raise ValueError(f"ring_attention: the zig-zag layout needs even local sequence lengths, "
                         f"got q {q.shape[1]} and k {k.shape[1]}")
    return q, k, v


def _check_segments(q, k, q_segment_ids, kv_segment_ids, q_positions, kv_positions):
    """The local segment ids and positions, validated as flash_attention validates them
    (a `jax_fa3.segments.Segments`, or None without segment ids)."""
    fields = _validate.check_segments(q_segment_ids, kv_segment_ids, q_positions, kv_positions,
                                      q.shape, k.shape)
    return None if fields is None else Segments(*fields)


def ring_attention(q, k, v, *, axis_name, causal: bool = False, window_size=(-1, -1),
                   softcap: float = 0.0, softmax_scale: float | None = None, sinks=None,
                   strategy: str = "ring", layout: str = "contiguous", return_lse: bool = False,
                   deterministic: bool = False, implementation: str | None = None,
                   q_segment_ids=None, kv_segment_ids=None, q_positions=None,
                   kv_positions=None):
    """Attention over a sequence sharded along mesh axis `axis_name`; call inside shard_map.

    q: (batch, seq_q_local, heads_q, head_dim); k: (batch, seq_k_local, heads_kv, head_dim);
    v: (batch, seq_k_local, heads_kv, head_dim_v) are this device's shards; `sinks` None or
    (heads_q,) attention-sink logits as in `jax_fa3.flash_attention` (the same on every
    device of the ring). Masks (`causal`, `window_size`, bottom-right aligned) refer to
    the GLOBAL sequence, whose order across devices is `layout` ('contiguous' or 'zigzag',
    see the module docstring; the default 'contiguous' is what sharding a naturally ordered
    array gives). `strategy` is 'ring' or 'allgather'.

    Packed sequences as in `jax_fa3.flash_attention`: `q_segment_ids` (batch, seq_q_local)
    and `kv_segment_ids` (batch, seq_k_local) are this device's shards of the global ids, in
    the same layout as q and k (zig-zag: permute them with `zigzag_permute` like q, k, v);
    `q_positions` / `kv_positions` likewise. Without positions the band refers to the global
    row index, as without segment ids; with positions it follows the positions (which then
    need no layout: they are data).

    Returns out (and lse (batch, heads_q, seq_q_local) float32 when `return_lse`);
    differentiable in q, k, v (and sinks), through out and lse.
    """
    q, k, v = _check_inputs(q, k, v, strategy, layout)
    sinks = _validate.check_sinks(sinks, q.shape[2])
    segments = _check_segments(q, k, q_segment_ids, kv_segment_ids, q_positions, kv_positions)
    opts = _core.flash_options(q, softmax_scale=softmax_scale, causal=causal,
                               window_size=window_size, softcap=softcap,
                               deterministic=deterministic, implementation=implementation,
                               head_dim_v=v.shape[-1])
    return_lse = _validate.check_bool("return_lse", return_lse)
    ring = Ring(axis_name if isinstance(axis_name, str) else tuple(axis_name), strategy, layout)
    out, lse = _ring(q, k, v, sinks, segments, opts, ring)
    return (out, lse) if return_lse else out


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _ring(q, k, v, sinks, segments, opts, ring):
    return ring_attention_fwd(q, k, v, opts, ring, sinks=sinks, segments=segments)


def _unwrap(x):
    """custom_vjp with symbolic_zeros hands the fwd rule CustomVJPPrimal wrappers."""
    return getattr(x, "value", x)


def _ring_vjp_fwd(q, k, v, sinks, segments, opts, ring):
    q, k, v, sinks = map(_unwrap, (q, k, v, sinks))
    if segments is not None:
        segments = type(segments)(*map(_unwrap, segments))
    out, lse = ring_attention_fwd(q, k, v, opts, ring, sinks=sinks, segments=segments)
    return (out, lse), (q, k, v, sinks, segments, out, lse)


def _sinks_grad(sinks, out, lse, dout, dlse):
    """The sinks' gradient from the final local lse and D: this device's rows' share, summed
    over the mesh axes it varies over and the sinks do not (shared sinks, rows spread over
    the ring), so that its type matches the sinks' inside shard_map."""
    return sum_like(portable.sinks_grad(sinks, lse, portable.row_dot(dout, out), dlse), sinks)


def _ring_vjp_bwd(opts, ring, res, cts):
    q, k, v, sinks, segments, out, lse = res
    dout, dlse = cts
    if isinstance(dout, SymbolicZero):  # only the lse is differentiated
        dout = jnp.zeros(out.shape, out.dtype)
    dlse = None if isinstance(dlse, SymbolicZero) else dlse
    grads = ring_attention_bwd(q, k, v, out, lse, dout, opts, ring, dlse=dlse, segments=segments)
    dsinks = None if sinks is None else _sinks_grad(sinks, out, lse, dout, dlse)
    return (*grads, dsinks, None)  # integer ids and positions have no gradient


_ring.defvjp(_ring_vjp_fwd, _ring_vjp_bwd, symbolic_zeros=True)
