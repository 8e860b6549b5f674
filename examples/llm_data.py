"""Data for the example: a token stream, a held-out split, and packed fixed-length batches.

Sources (no download needed for the default):

* nothing given: the Python standard library's own ``.py`` files, as bytes (vocab 256);
* a text file: its bytes;
* ``.npy``: a 1-D integer array of token ids (any tokenizer);
* ``.bin``: raw token ids (``uint16`` by default, as written by nanoGPT-style scripts).

The stream is a sequence of documents: the standard library's files, or a user file cut
after each ``--doc-sep`` token (one document without it). Two ways to make rows of
``seq_len + 1`` tokens (inputs and shifted targets from one row):

* packed (the default, :func:`pack_documents`): each document is cut into pieces of at most a
  row, and the pieces are placed into rows (longest first, each into the fullest row that
  still holds it), every piece a segment of its own: segment ids 1, 2, ... along the row, 0
  for the padding at its end, positions restarting at 0 in each piece. Attention then stays
  inside a document, and the loss skips targets in another segment or in padding;
* windows (``--no-pack``): non-overlapping windows of the concatenated stream, documents
  back to back.

Which rows form batch ``step`` is a pure function of ``(seed, step)``, so a resumed run sees
exactly the batches the original run would have.
"""

from __future__ import annotations

import bisect
import dataclasses
import os
import random
import sysconfig

import numpy as np

BYTE_VOCAB = 256
STDLIB_SOURCE = "python stdlib sources"


@dataclasses.dataclass
class TokenData:
    """Train and eval token streams (1-D integer arrays, possibly memory-mapped) and where
    their documents start (sorted int64 offsets into each stream, the first 0)."""

    train: np.ndarray
    eval: np.ndarray
    vocab_size: int
    is_bytes: bool  # tokens are raw bytes, so samples decode as text
    source: str
    train_starts: np.ndarray | None = None  # None: one document
    eval_starts: np.ndarray | None = None

    def describe(self) -> str:
        return (f"{self.source}: {self.train.size:,} train / {self.eval.size:,} eval tokens, "
                f"vocab {self.vocab_size}")


def stdlib_files() -> list[str]:
    """The standard library's ``.py`` files (no site-packages), in a fixed shuffled order
    so the held-out tail is a mix of modules rather than the last directory alphabetically."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        files += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    random.Random(0).shuffle(files)
    return files


def stdlib_corpus() -> bytes:
    """All of :func:`stdlib_files`, joined by blank lines."""
    return stdlib_documents()[0]


def stdlib_documents() -> tuple[bytes, np.ndarray]:
    """:func:`stdlib_corpus` and where each file starts in it (each document is a file and
    the blank line after it)."""
    chunks = []
    for path in stdlib_files():
        try:
            with open(path, "rb") as f:
                chunks.append(f.read())
        except OSError:  # unreadable file in an odd installation: skip it
            continue
    if not chunks:
        raise RuntimeError(f"no .py files found under {sysconfig.get_paths()['stdlib']}; pass --data")
    lengths = np.asarray([len(c) + 2 for c in chunks], np.int64)  # + the b"\n\n" after it
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return b"\n\n".join(chunks), starts


def _read_tokens(path: str, bin_dtype: str) -> tuple[np.ndarray, bool]:
    """Tokens of a user file and whether they are bytes."""
    if not os.path.isfile(path):
        raise ValueError(f"--data {path!r}: no such file")
    ext = os.path.splitext(path)[1].lower()
    if ext == ".npy":
        tokens = np.load(path, mmap_mode="r")
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"--data {path!r}: expected a 1-D integer array of token ids, "
                             f"got shape {tokens.shape} and dtype {tokens.dtype}")
        return tokens, False
    if ext == ".bin":
        try:
            dtype = np.dtype(bin_dtype)
        except TypeError as err:
            raise ValueError(f"--bin-dtype {bin_dtype!r} is not a numpy dtype") from err
        if not np.issubdtype(dtype, np.integer):
            raise ValueError(f"--bin-dtype must be an integer dtype, got {bin_dtype!r}")
        if os.path.getsize(path) % dtype.itemsize:
            raise ValueError(f"--data {path!r}: size {os.path.getsize(path)} is not a multiple of "
                             f"{dtype.itemsize} bytes ({bin_dtype} tokens)")
        return np.memmap(path, dtype=dtype, mode="r"), False
    with open(path, "rb") as f:
        return np.frombuffer(f.read(), dtype=np.uint8), True


def _split_starts(starts: np.ndarray, at: int) -> tuple[np.ndarray, np.ndarray]:
    """Document starts of the streams [0, at) and [at, end): a document cut by the split
    continues as the first document of the second stream."""
    train = starts[starts < at]
    tail = starts[starts >= at] - at
    if not tail.size or tail[0] != 0:
        tail = np.concatenate([[0], tail])
    return train, tail


def load_tokens(path: str | None, *, seq_len: int, eval_fraction: float = 0.01,
                vocab_size: int | None = None, bin_dtype: str = "uint16",
                doc_sep: int | None = None) -> TokenData:
    """Loads the stream and splits off the last ``eval_fraction`` (at least one window) for eval.

    Documents: the standard library's files; in a user file, a document ends after each
    ``doc_sep`` token (the whole file is one document without it).

    Raises ValueError with the offending flag when the file is missing, malformed or too short
    for ``seq_len``, or a token id does not fit ``vocab_size``.
    """
    starts = None
    if path is None:
        corpus, starts = stdlib_documents()
        tokens, is_bytes, source = np.frombuffer(corpus, np.uint8), True, STDLIB_SOURCE
    else:
        tokens, is_bytes = _read_tokens(path, bin_dtype)
        source = path
    window = seq_len + 1
    if tokens.size < 2 * window:
        raise ValueError(f"{source} has {tokens.size} tokens: too few for --seq-len {seq_len} "
                         f"(needs at least {2 * window} for one train and one eval sequence)")
    if tokens.size and int(tokens.min()) < 0:
        raise ValueError(f"{source}: token ids must be non-negative")
    max_id = BYTE_VOCAB - 1 if is_bytes else int(tokens.max())
    if vocab_size is None:
        vocab_size = BYTE_VOCAB if is_bytes else max_id + 1
    elif max_id >= vocab_size:
        raise ValueError(f"{source} holds token id {max_id}, which does not fit --vocab-size {vocab_size}")
    if doc_sep is not None and path is not None:
        if not 0 <= doc_sep <= max_id and not (is_bytes and 0 <= doc_sep < BYTE_VOCAB):
            raise ValueError(f"--doc-sep {doc_sep} is not a token id of {source} (0..{max_id})")
        ends = np.flatnonzero(np.asarray(tokens) == doc_sep) + 1  # a document ends after it
        starts = np.concatenate([[0], ends[ends < tokens.size]]).astype(np.int64)
    if starts is None:
        starts = np.zeros(1, np.int64)
    n_eval = max(int(tokens.size * eval_fraction), window)
    train_starts, eval_starts = _split_starts(starts, tokens.size - n_eval)
    return TokenData(tokens[:-n_eval], tokens[-n_eval:], vocab_size, is_bytes, source,
                     train_starts, eval_starts)


def num_windows(tokens: np.ndarray, seq_len: int) -> int:
    return (tokens.size - 1) // seq_len


def window_batch(tokens: np.ndarray, indices: np.ndarray, seq_len: int) -> np.ndarray:
    """int32 ``(len(indices), seq_len + 1)``: window ``i`` is ``tokens[i*seq_len : (i+1)*seq_len + 1]``."""
    starts = np.asarray(indices, np.int64) * seq_len
    return np.stack([np.asarray(tokens[s : s + seq_len + 1], np.int32) for s in starts])


def train_batch(data: TokenData, step: int, batch_size: int, seq_len: int, seed: int) -> np.ndarray:
    """Batch ``step`` of the epoch-wise shuffled windows of the train stream."""
    idx = _epoch_indices(num_windows(data.train, seq_len), step, batch_size, seed)
    return window_batch(data.train, idx, seq_len)


def eval_batches(data: TokenData, n_batches: int, batch_size: int, seq_len: int) -> list[np.ndarray]:
    """The same ``n_batches`` eval batches every time (windows in order, wrapping if the
    held-out stream is short)."""
    n = num_windows(data.eval, seq_len)
    idx = np.arange(n_batches * batch_size) % n
    return [window_batch(data.eval, idx[i * batch_size : (i + 1) * batch_size], seq_len)
            for i in range(n_batches)]


# ----------------------------------------------------------------------------- packing


@dataclasses.dataclass
class Packing:
    """Documents of one stream cut into pieces and packed into rows of ``row_len`` tokens.

    Row ``r`` holds pieces ``row_ptr[r]:row_ptr[r + 1]`` of ``piece_start`` / ``piece_len``
    (offsets into the stream), back to back from the row's start, padding after them."""

    row_len: int
    piece_start: np.ndarray  # int64 (pieces,), ordered by row
    piece_len: np.ndarray  # int64 (pieces,)
    row_ptr: np.ndarray  # int64 (rows + 1,)

    @property
    def num_rows(self) -> int:
        return self.row_ptr.size - 1

    @property
    def padding_fraction(self) -> float:
        """The fraction of all row tokens that are padding."""
        return 1.0 - float(self.piece_len.sum()) / (self.num_rows * self.row_len)

    def mean_keys(self) -> float:
        """Causal attention inside the pieces: the mean number of keys a token of a row sees
        (padding counts as a token that sees none), for the FLOP count."""
        n = self.piece_len.astype(np.float64)
        return float((n * (n + 1) / 2).sum()) / (self.num_rows * self.row_len)


def pack_documents(starts: np.ndarray, total: int, row_len: int) -> Packing:
    """Packs the documents of a stream of ``total`` tokens (starting at ``starts``) into rows
    of ``row_len`` tokens.

    Each document is cut into pieces of ``row_len`` tokens and a shorter rest; a piece of one
    token has no target inside its segment and is dropped. Full pieces fill rows of their
    own; the rests go longest first into the row with the least room that still holds them
    (best fit decreasing), so padding is what no rest fits into. Deterministic."""
    starts = np.asarray(starts, np.int64)
    lengths = np.diff(np.concatenate([starts, [total]]))
    full = lengths // row_len
    full_starts = np.repeat(starts, full) + row_len * (
        np.arange(full.sum()) - np.repeat(np.cumsum(full) - full, full))
    rest_len = lengths - full * row_len
    rest_start = starts + full * row_len
    keep = rest_len >= 2
    rest_len, rest_start = rest_len[keep], rest_start[keep]

    rows: list[list[int]] = []  # rests per row, by index
    room: list[tuple[int, int]] = []  # (free tokens, row) sorted
    for i in np.argsort(-rest_len, kind="stable"):
        n = int(rest_len[i])
        at = bisect.bisect_left(room, (n, -1))
        if at == len(room):  # no row holds it: a new one
            rows.append([int(i)])
            bisect.insort(room, (row_len - n, len(rows) - 1))
        else:
            free, r = room.pop(at)
            rows[r].append(int(i))
            bisect.insort(room, (free - n, r))
    order = np.asarray([i for row in rows for i in row], np.int64)
    piece_start = np.concatenate([full_starts, rest_start[order]])
    piece_len = np.concatenate([np.full(full_starts.size, row_len), rest_len[order]])
    counts = np.concatenate([np.ones(full_starts.size, np.int64),
                             np.asarray([len(row) for row in rows], np.int64)])
    row_ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return Packing(row_len, piece_start.astype(np.int64), piece_len.astype(np.int64), row_ptr)


def packed_rows(tokens: np.ndarray, packing: Packing, rows: np.ndarray) -> dict[str, np.ndarray]:
    """int32 ``tokens``, ``segment_ids`` (1, 2, ... per piece, 0 = padding) and
    ``positions`` (restarting at 0 in each piece), each ``(len(rows), row_len)``."""
    shape = (len(rows), packing.row_len)
    out = {name: np.zeros(shape, np.int32) for name in ("tokens", "segment_ids", "positions")}
    for b, r in enumerate(np.asarray(rows, np.int64)):
        at = 0
        for seg, p in enumerate(range(packing.row_ptr[r], packing.row_ptr[r + 1]), start=1):
            s, n = int(packing.piece_start[p]), int(packing.piece_len[p])
            out["tokens"][b, at:at + n] = tokens[s:s + n]
            out["segment_ids"][b, at:at + n] = seg
            out["positions"][b, at:at + n] = np.arange(n)
            at += n
    return out


def _epoch_indices(n: int, step: int, batch_size: int, seed: int) -> np.ndarray:
    """Items of batch ``step`` when each epoch visits all ``n`` in an order derived from
    ``(seed, epoch)``."""
    flat = np.arange(step * batch_size, (step + 1) * batch_size)
    epochs, slots = np.divmod(flat, n)
    idx = np.empty(batch_size, np.int64)
    for epoch in np.unique(epochs):  # one permutation per epoch, derived from (seed, epoch)
        perm = np.random.default_rng([seed, int(epoch)]).permutation(n)
        idx[epochs == epoch] = perm[slots[epochs == epoch]]
    return idx


def packed_train_batch(data: TokenData, packing: Packing, step: int, batch_size: int,
                       seed: int) -> dict[str, np.ndarray]:
    """Batch ``step`` of the epoch-wise shuffled packed rows of the train stream."""
    return packed_rows(data.train, packing, _epoch_indices(packing.num_rows, step, batch_size,
                                                           seed))


def packed_eval_batches(data: TokenData, packing: Packing, n_batches: int,
                        batch_size: int) -> list[dict[str, np.ndarray]]:
    """The same ``n_batches`` packed eval batches every time (rows in order, wrapping)."""
    idx = np.arange(n_batches * batch_size) % packing.num_rows
    return [packed_rows(data.eval, packing, idx[i * batch_size:(i + 1) * batch_size])
            for i in range(n_batches)]
