"""Packed-sequence inputs for the sharding, ring and module tests: segment ids that keep the
kernel contract (each nonzero id one contiguous run, ids increasing along the row, 0 =
padding) and positions that restart at each document, or random packed rows with empty
segments, one-token documents and padding between documents (`random_packed`). Numpy only;
the oracle that takes them is tests/helpers.py's (`segments=`)."""

from __future__ import annotations

import numpy as np


def packed_ids(seed, batch: int, seqlen: int, docs: int = 4, pad_tail: int = 3,
               empty_rows=(), short_docs: bool = True) -> np.ndarray:
    """int32 (batch, seqlen) segment ids: each row cut into up to `docs` documents of random
    lengths (ids 1, 2, ... in order; with `short_docs` some are one token long), then its
    last `pad_tail` tokens padding (0); rows in `empty_rows` all padding."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((batch, seqlen), np.int32)
    for r in range(batch):
        body = seqlen - pad_tail
        n = min(docs, body)
        cuts = np.sort(rng.choice(np.arange(1, body), n - 1, replace=False)) if n > 1 else []
        if short_docs and n > 2:  # a one-token document
            cuts = np.sort(np.unique(np.r_[cuts, cuts[0] + 1]))
            cuts = cuts[cuts < body]
        row = np.zeros(seqlen, np.int32)
        row[:body] = 1 + np.searchsorted(cuts, np.arange(body), side="right")
        ids[r] = row
    for r in empty_rows:
        ids[r] = 0
    return ids


def restart_positions(ids: np.ndarray) -> np.ndarray:
    """int32 positions counting from 0 at the start of each run of equal ids."""
    ids = np.asarray(ids)
    pos = np.zeros(ids.shape, np.int32)
    for i in range(1, ids.shape[1]):
        pos[:, i] = np.where(ids[:, i] == ids[:, i - 1], pos[:, i - 1] + 1, 0)
    return pos


def _random_side(rng, seqlen, doc_ids, *, pad_prob, empty_prob, one_prob, max_len, pad_gap,
                 min_len, offset):
    """(ids, positions) of one batch row of `seqlen` tokens holding the documents `doc_ids`
    (increasing) in order, each a run of random length (0 with `empty_prob`: an empty
    segment; 1 with `one_prob`; else min_len .. twice the mean), a padding run of pad_gap
    tokens before some of them (`pad_prob`) and padding after the last. Positions step by 1
    inside a run from 0, or from a random start in the range `offset`."""
    ids = np.zeros(seqlen, np.int32)
    pos = np.zeros(seqlen, np.int32)
    t, mean = 0, max(1, seqlen // max(1, len(doc_ids)))
    for doc in doc_ids:
        if rng.random() < pad_prob:
            t += int(rng.integers(*pad_gap))
        u = rng.random()
        n = 0 if u < empty_prob else 1 if u < empty_prob + one_prob else int(
            rng.integers(min_len, 2 * mean + 1))
        n = max(0, min(n, seqlen - t) if max_len is None else min(n, max_len, seqlen - t))
        ids[t:t + n] = doc
        pos[t:t + n] = (0 if offset is None else int(rng.integers(*offset))) + np.arange(n)
        t += n
    return ids, pos


def random_packed(seed, batch, seqlen_q, seqlen_k=None, docs=4, *, all_padding_rows=(),
                  shared=None, pad_prob=0.3, empty_prob=0.15, one_prob=0.15, max_len=None,
                  pad_gap=(1, 4), min_len=1, offset=None):
    """(q_ids, kv_ids, q_pos, kv_pos) numpy (batch, seqlen) int32 arrays that keep the kernel
    contract: per row `docs` documents with ids increasing with gaps (1, 2, 5, ...), drawn by
    _random_side; rows in `all_padding_rows` all padding. `shared` (default: seqlen_k is
    None): the keys are the queries (self-attention)."""
    rng = np.random.default_rng(seed)
    shared = seqlen_k is None if shared is None else shared
    seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
    out = [np.zeros((batch, s), np.int32) for s in (seqlen_q, seqlen_k, seqlen_q, seqlen_k)]
    kw = dict(pad_prob=pad_prob, empty_prob=empty_prob, one_prob=one_prob, max_len=max_len,
              pad_gap=pad_gap, min_len=min_len, offset=offset)
    for r in range(batch):
        if r in all_padding_rows:
            continue
        doc_ids = np.cumsum(rng.integers(1, 3, size=docs))
        out[0][r], out[2][r] = _random_side(rng, seqlen_q, doc_ids, **kw)
        out[1][r], out[3][r] = ((out[0][r], out[2][r]) if shared
                                else _random_side(rng, seqlen_k, doc_ids, **kw))
    return tuple(out)
