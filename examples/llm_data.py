"""Data for the example: a token stream, a held-out split, and packed fixed-length batches.

Sources (no download needed for the default):

* nothing given: the Python standard library's own ``.py`` files, as bytes (vocab 256);
* a text file: its bytes;
* ``.npy``: a 1-D integer array of token ids (any tokenizer);
* ``.bin``: raw token ids (``uint16`` by default, as written by nanoGPT-style scripts).

The stream is cut into non-overlapping windows of ``seq_len + 1`` tokens (documents packed
back to back, inputs and shifted targets from one window). Which windows form batch ``step``
is a pure function of ``(seed, step)``, so a resumed run sees exactly the batches the
original run would have.
"""

from __future__ import annotations

import dataclasses
import os
import random
import sysconfig

import numpy as np

BYTE_VOCAB = 256
STDLIB_SOURCE = "python stdlib sources"


@dataclasses.dataclass
class TokenData:
    """Train and eval token streams (1-D integer arrays, possibly memory-mapped)."""

    train: np.ndarray
    eval: np.ndarray
    vocab_size: int
    is_bytes: bool  # tokens are raw bytes, so samples decode as text
    source: str

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
    chunks = []
    for path in stdlib_files():
        try:
            with open(path, "rb") as f:
                chunks.append(f.read())
        except OSError:  # unreadable file in an odd installation: skip it
            continue
    if not chunks:
        raise RuntimeError(f"no .py files found under {sysconfig.get_paths()['stdlib']}; pass --data")
    return b"\n\n".join(chunks)


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


def load_tokens(path: str | None, *, seq_len: int, eval_fraction: float = 0.01,
                vocab_size: int | None = None, bin_dtype: str = "uint16") -> TokenData:
    """Loads the stream and splits off the last ``eval_fraction`` (at least one window) for eval.

    Raises ValueError with the offending flag when the file is missing, malformed or too short
    for ``seq_len``, or a token id does not fit ``vocab_size``.
    """
    if path is None:
        tokens, is_bytes, source = np.frombuffer(stdlib_corpus(), np.uint8), True, STDLIB_SOURCE
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
    n_eval = max(int(tokens.size * eval_fraction), window)
    return TokenData(tokens[:-n_eval], tokens[-n_eval:], vocab_size, is_bytes, source)


def num_windows(tokens: np.ndarray, seq_len: int) -> int:
    return (tokens.size - 1) // seq_len


def window_batch(tokens: np.ndarray, indices: np.ndarray, seq_len: int) -> np.ndarray:
    """int32 ``(len(indices), seq_len + 1)``: window ``i`` is ``tokens[i*seq_len : (i+1)*seq_len + 1]``."""
    starts = np.asarray(indices, np.int64) * seq_len
    return np.stack([np.asarray(tokens[s : s + seq_len + 1], np.int32) for s in starts])


def train_batch(data: TokenData, step: int, batch_size: int, seq_len: int, seed: int) -> np.ndarray:
    """Batch ``step`` of the epoch-wise shuffled windows of the train stream."""
    n = num_windows(data.train, seq_len)
    flat = np.arange(step * batch_size, (step + 1) * batch_size)
    epochs, slots = np.divmod(flat, n)
    idx = np.empty(batch_size, np.int64)
    for epoch in np.unique(epochs):  # one permutation per epoch, derived from (seed, epoch)
        perm = np.random.default_rng([seed, int(epoch)]).permutation(n)
        idx[epochs == epoch] = perm[slots[epochs == epoch]]
    return window_batch(data.train, idx, seq_len)


def eval_batches(data: TokenData, n_batches: int, batch_size: int, seq_len: int) -> list[np.ndarray]:
    """The same ``n_batches`` eval batches every time (windows in order, wrapping if the
    held-out stream is short)."""
    n = num_windows(data.eval, seq_len)
    idx = np.arange(n_batches * batch_size) % n
    return [window_batch(data.eval, idx[i * batch_size : (i + 1) * batch_size], seq_len)
            for i in range(n_batches)]
