"""Packed-sequence inputs for the sharding, ring and module tests: segment ids that keep the
kernel contract (each nonzero id one contiguous run, ids increasing along the row, 0 =
padding) and positions that restart at each document. Numpy only; the oracle that takes
them is tests/helpers.py's (`segments=`)."""

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
