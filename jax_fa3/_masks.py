"""The one place where the public mask options become the kernels' band: `band` for
flash_attention's (causal, window_size), `top_left_band` for jax.nn's (is_causal,
local_window_size), `band_mask` for the dense boolean form.

Internally a mask is a pair of ints (left, right): query i sees key j iff
    -left <= j - i - (seqlen_k - seqlen_q) <= right
(the diagonal is bottom-right aligned, as in FlashAttention 2.1+). An unbounded side is
UNBOUNDED; bounds may be negative (ring attention shifts the diagonal between chunks).
"""

from __future__ import annotations

import numpy as np

UNBOUNDED = 1 << 30  # fa3::kUnbounded in cpp/include/fa3/params.h


def band(causal: bool, window_size: tuple[int, int]) -> tuple[int, int]:
    """(left, right) of the public `causal` and `window_size=(left, right)` (-1 = unbounded)."""
    left, right = window_size
    left = UNBOUNDED if left < 0 else min(int(left), UNBOUNDED)
    right = UNBOUNDED if right < 0 else min(int(right), UNBOUNDED)
    if causal:
        right = min(right, 0)
    return left, right


def clamp(bound: int) -> int:
    """A band bound as the kernels accept it: within [-UNBOUNDED, UNBOUNDED]."""
    return max(-UNBOUNDED, min(UNBOUNDED, int(bound)))


def band_mask(seqlen_q: int, seqlen_k: int, left: int, right: int) -> np.ndarray:
    """Boolean (seqlen_q, seqlen_k) of the band (a numpy constant)."""
    rel = np.arange(seqlen_k)[None, :] - np.arange(seqlen_q)[:, None] - (seqlen_k - seqlen_q)
    return (rel >= -left) & (rel <= right)


def top_left_band(is_causal: bool, window: tuple[int, int] | None, seqlen_q: int,
                  seqlen_k: int) -> tuple[int, int]:
    """(left, right) of jax.nn's masks, which are top-left aligned: query i sees key j iff
    -window_left <= j - i <= window_right (window None = unbounded) and, when causal, j <= i.
    Our diagonal sits seqlen_k - seqlen_q keys to the right of jax.nn's, hence the shift."""
    left, right = (UNBOUNDED, UNBOUNDED) if window is None else window
    if is_causal:
        right = min(right, 0)
    shift = seqlen_k - seqlen_q
    left = left if left >= UNBOUNDED else left + shift
    right = right if right >= UNBOUNDED else right - shift
    return clamp(left), clamp(right)
