"""Packed sequences: segment ids, positions and varlen, in one place.

A `Segments` record carries a call's documents: query i (of batch row b) sees key j only when
`q_ids[b, i] == kv_ids[b, j]`, the id is not 0 (id 0 is PADDING: a padding query sees nothing,
a padding key is seen by nobody), and the band allows it. Without positions the band is the
usual row-index band of jax_fa3/_masks.py (bottom-right aligned over the whole row); with
positions it follows them: query i sees key j iff `-left <= kv_pos[j] - q_pos[i] <= right`
(no seqlen_k - seqlen_q shift). Positions are used saturated to [-POS_LIMIT, POS_LIMIT], so
their differences and the band's sums stay inside int32.

Two consumers:

* the portable path (and the dense variant) take the exact rule for ANY ids through
  `visibility` / `dense_mask`;
* the Hopper kernels take "document bands" built by `kernel_bands`: per query row the
  interval [lo, hi) of keys it may see, per key the interval of query rows that see it, and
  per group of 64 rows (min lo, max lo, min hi, max hi). Intervals exist only under the
  kernel contract: along each batch row every nonzero id occupies ONE contiguous run and the
  nonzero ids increase (1,1,2,2,0,0,3 is fine; 2,2,1 and 1,0,1 are not), and with positions
  they step by exactly 1 from token to token inside a run. A batch row that breaks it (on
  the query or the key side) is marked invalid (every query row's hi = -1), and the kernels
  return NaN there: never a silently wrong answer.

`varlen_segments` turns FlashAttention's cu_seqlens (varlen, THD layout) into the segments of
one packed batch row.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from jax_fa3._masks import UNBOUNDED

PADDING = 0  # the segment id of padding tokens
POS_LIMIT = (1 << 29) - 1  # positions saturate to [-POS_LIMIT, POS_LIMIT]
GROUP = 64  # rows per group summary (q_groups, k_groups; cpp/include/fa3/params.h)
NONE_LO = UNBOUNDED  # lo of an empty interval (NONE_LO, 0): it never widens a group's range
INVALID_HI = -1  # hi of an invalid row (NONE_LO, -1): its batch row breaks the kernel contract

_INT_MIN = -(1 << 31)

__all__ = ["Segments", "PADDING", "visibility", "dense_mask", "kernel_bands", "varlen_segments",
           "contract_ok"]


class Segments(NamedTuple):
    """The documents of one attention call (a pytree; validated by jax_fa3/_validate.py).

    q_ids (b, sq) and kv_ids (b, sk) int32 segment ids, 0 = padding; q_pos (b, sq) and kv_pos
    (b, sk) int32 positions, both None or both arrays."""
    q_ids: jax.Array
    kv_ids: jax.Array
    q_pos: Optional[jax.Array] = None
    kv_pos: Optional[jax.Array] = None

    @property
    def has_positions(self) -> bool:
        return self.q_pos is not None


def _clip_pos(pos):
    return jnp.clip(pos, -POS_LIMIT, POS_LIMIT)


# ----------------------------------------------------------------------------- exact rule

def visibility(segments: Segments, left: int, right: int):
    """Boolean (b, sq, sk): the documents rule (equal nonzero ids) and, with positions, the
    positional band. Without positions the row-index band is the caller's to apply
    (`dense_mask` does). Works for any ids (no contract); kv arrays may be a block of keys."""
    q, kv = segments.q_ids[:, :, None], segments.kv_ids[:, None, :]
    ok = (q == kv) & (q != PADDING)
    if segments.has_positions:
        rel = _clip_pos(segments.kv_pos)[:, None, :] - _clip_pos(segments.q_pos)[:, :, None]
        if left < UNBOUNDED:
            ok = ok & (rel >= -left)
        if right < UNBOUNDED:
            ok = ok & (rel <= right)
    return ok


def dense_mask(segments: Segments, left: int, right: int):
    """Boolean (b, sq, sk): what query i may see, all rules together (the row-index band when
    there are no positions)."""
    ok = visibility(segments, left, right)
    if not segments.has_positions:
        sq, sk = ok.shape[1:]
        rel = jnp.arange(sk)[None, :] - jnp.arange(sq)[:, None] - (sk - sq)
        ok = ok & ((rel >= -left) & (rel <= right))[None]
    return ok


# ----------------------------------------------------------------------------- kernel bands

class _Side(NamedTuple):
    """One side (queries or keys) of a batch of segment ids, prepared for lookups."""
    ids: jax.Array  # (b, n)
    key: jax.Array  # (b, n) cummax of the nonzero ids so far: non-decreasing under the contract
    run_end: jax.Array  # (b, n) one past the end of the run of equal ids holding each token
    ok: jax.Array  # (b,) the batch row keeps the contract on this side


def _side(ids, pos):
    n = ids.shape[1]
    real = ids != PADDING
    key = lax.cummax(jnp.where(real, ids, _INT_MIN), axis=1)
    prev_key = jnp.pad(key[:, :-1], ((0, 0), (1, 0)), constant_values=_INT_MIN)
    prev_id = jnp.pad(ids[:, :-1], ((0, 0), (1, 0)), constant_values=PADDING)
    continues = real & (ids == prev_id)  # the run of the token before goes on
    token_ok = ~real | (ids > prev_key) | continues  # padding, a new larger id, or a run going on
    if pos is not None:
        pos = _clip_pos(pos)
        prev_pos = jnp.pad(pos[:, :-1], ((0, 0), (1, 0)))
        token_ok = token_ok & (~continues | (pos == prev_pos + 1))
    idx = jnp.arange(n, dtype=jnp.int32)
    next_id = jnp.pad(ids[:, 1:], ((0, 0), (0, 1)), constant_values=PADDING)
    last = jnp.where((ids != next_id) | (idx == n - 1), idx + 1, n)  # run ends after the token
    run_end = lax.cummin(last, axis=1, reverse=True)
    return _Side(ids, key, run_end, token_ok.all(axis=1))


def _intervals(mine, mine_pos, other: _Side, other_pos, below: int, above: int,
               positions: bool):
    """For each token of one side ((b, n) ids `mine`), the [lo, hi) of the other side's
    tokens it may see: the run of its own id there, cut by the positional band
    `-below <= other_pos - mine_pos <= above` when there are positions. Empty: (NONE_LO, 0)."""
    m = other.ids.shape[1]
    search = jax.vmap(lambda keys, x: jnp.searchsorted(keys, x, side="left",
                                                       method="scan_unrolled"))
    lo = search(other.key, mine).astype(jnp.int32)
    at = jnp.minimum(lo, m - 1)
    found = (mine != PADDING) & (lo < m) & (jnp.take_along_axis(other.ids, at, axis=1) == mine)
    hi = jnp.take_along_axis(other.run_end, at, axis=1)
    if positions:
        size = hi - lo
        # offset of the band's diagonal from the run's start, in tokens (the run steps by 1)
        off = _clip_pos(mine_pos) - jnp.take_along_axis(_clip_pos(other_pos), at, axis=1)
        start, stop = lo, hi
        if below < UNBOUNDED:
            start = lo + jnp.clip(off - below, 0, size)
        if above < UNBOUNDED:
            stop = lo + jnp.clip(off + above + 1, 0, size)
        lo, hi = start, stop
    empty = ~found | (lo >= hi)
    return jnp.stack([jnp.where(empty, NONE_LO, lo), jnp.where(empty, 0, hi)], axis=-1)


def _groups(rows):
    """(b, s, 2) intervals -> (b, ceil(s / 64), 4): (min lo, max lo, min hi, max hi) per 64
    rows, the rows past s replicating the last one."""
    b, s, _ = rows.shape
    g = -(-s // GROUP)
    padded = jnp.pad(rows, ((0, 0), (0, g * GROUP - s), (0, 0)), mode="edge")
    lo, hi = (padded[..., i].reshape(b, g, GROUP) for i in (0, 1))
    return jnp.stack([lo.min(-1), lo.max(-1), hi.min(-1), hi.max(-1)], axis=-1)


def kernel_bands(segments: Segments, left: int, right: int, seqlen_q: int, seqlen_k: int):
    """The document bands of the kernel contract, and the band (left, right) to pass on.

    Returns ((q_rows, q_groups, k_rows, k_groups), kernel_left, kernel_right), all int32:

    * q_rows (b, sq, 2): [lo, hi), the keys query row i may see by the documents rule (with
      positions, the positional band folded in). A row that sees no key has (2**30, 0)
      (NONE_LO = UNBOUNDED), so it never widens a group's [min lo, max hi). A row whose
      batch row breaks the contract has (2**30, -1): hi = -1 marks it INVALID (the kernels
      write NaN out and lse).
    * q_groups (b, ceil(sq / 64), 4): per 64 query rows (min lo, max lo, min hi, max hi);
      the rows past sq replicate the last row. min hi == -1 iff the group holds an invalid row.
    * k_rows (b, sk, 2): [lo, hi), the query rows that see key j (the same relation
      transposed: lo_i <= j < hi_i  <=>  klo_j <= i < khi_j); a key seen by none: (2**30,
      0), every key of an invalid batch row included.
    * k_groups (b, ceil(sk / 64), 4): the same summaries of k_rows.

    The kernels apply the row-index band (kernel_left, kernel_right) on top: it is (left,
    right) without positions, and (UNBOUNDED, UNBOUNDED) with them (the positional band is in
    the intervals). Cost: a few scans and one unrolled binary search (log2 of the length)
    per side; no sort and nothing of size sq x sk."""
    q_ids, kv_ids = segments.q_ids, segments.kv_ids
    b = q_ids.shape[0]
    if q_ids.shape != (b, seqlen_q) or kv_ids.shape != (b, seqlen_k):
        raise ValueError(f"segment ids of shapes {q_ids.shape} and {kv_ids.shape}, expected "
                         f"({b}, {seqlen_q}) and ({b}, {seqlen_k})")
    positions = segments.has_positions
    q_side, kv_side = _side(q_ids, segments.q_pos), _side(kv_ids, segments.kv_pos)
    valid = (q_side.ok & kv_side.ok)[:, None]
    q_rows = _intervals(q_ids, segments.q_pos, kv_side, segments.kv_pos, left, right, positions)
    # a key j sees query i iff -left <= kv_pos[j] - q_pos[i] <= right, i.e. with the roles
    # swapped, -right <= q_pos[i] - kv_pos[j] <= left
    k_rows = _intervals(kv_ids, segments.kv_pos, q_side, segments.q_pos, right, left, positions)
    invalid_q = jnp.array([NONE_LO, INVALID_HI], jnp.int32)
    no_query = jnp.array([NONE_LO, 0], jnp.int32)
    q_rows = jnp.where(valid[..., None], q_rows, invalid_q)
    k_rows = jnp.where(valid[..., None], k_rows, no_query)
    bands = (q_rows, _groups(q_rows), k_rows, _groups(k_rows))
    if positions:
        return bands, UNBOUNDED, UNBOUNDED
    return bands, left, right


def contract_ok(segments: Segments):
    """(b,) bool: whether each batch row keeps the kernel contract (module docstring)."""
    return _side(segments.q_ids, segments.q_pos).ok & _side(segments.kv_ids, segments.kv_pos).ok


# ----------------------------------------------------------------------------- varlen

def _varlen_side(cu, total: int, other_cu=None):
    """(ids, positions) of `total` packed tokens cut by cu (n + 1,): sequence r is tokens
    [cu[r], cu[r + 1]) with id r + 1; tokens outside [cu[0], cu[-1]) are padding. Positions
    count from each sequence's start, plus (len_other - len_own) when `other_cu` is given
    (the queries' shift that bottom-right aligns causal/window per sequence)."""
    n = cu.shape[0] - 1
    t = jnp.arange(total, dtype=jnp.int32)
    if n < 1 or total == 0:
        zeros = jnp.zeros((total,), jnp.int32)
        return zeros, zeros
    r = jnp.clip(jnp.searchsorted(cu, t, side="right", method="scan_unrolled") - 1, 0, n - 1)
    inside = (t >= cu[0]) & (t < cu[n])
    pos = t - cu[r]
    if other_cu is not None:
        lengths = cu[1:] - cu[:-1]
        other = other_cu[1:] - other_cu[:-1]
        pos = pos + (other - lengths)[r]
    return (jnp.where(inside, r + 1, PADDING).astype(jnp.int32),
            jnp.where(inside, pos, 0).astype(jnp.int32))


def varlen_segments(cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int) -> Segments:
    """The segments of FlashAttention's varlen layout as one packed batch row (batch 1).

    cu_seqlens_q / cu_seqlens_k (n + 1,) int, non-decreasing from 0: sequence r is queries
    [cu_q[r], cu_q[r + 1]) and keys [cu_k[r], cu_k[r + 1]), segment id r + 1; tokens past the
    last offset are padding (id 0). Positions bottom-right align causal/window inside each
    sequence: q_pos = t - cu_q[r] + (len_k[r] - len_q[r]), kv_pos = u - cu_k[r]."""
    cu_q = jnp.asarray(cu_seqlens_q).astype(jnp.int32)
    cu_k = jnp.asarray(cu_seqlens_k).astype(jnp.int32)
    q_ids, q_pos = _varlen_side(cu_q, total_q, cu_k)
    kv_ids, kv_pos = _varlen_side(cu_k, total_k)
    return Segments(q_ids[None], kv_ids[None], q_pos[None], kv_pos[None])
