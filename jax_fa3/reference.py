"""Dense reference attention: the oracle for tests and for the kernels.

Straightforward on purpose: K/V heads are repeated, the full score matrix is formed, softmax in
the promoted dtype (float32, or float64 when the inputs are float64 under `jax_enable_x64`),
matmuls at `Precision.HIGHEST`. Same semantics as `jax_fa3.flash_attention` (band masks with
the bottom-right-aligned diagonal, softcap, GQA) plus an optional bias and boolean mask.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from jax_fa3._masks import UNBOUNDED, band, band_mask


def attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
              left=None, right=None, bias=None, mask=None, precision=lax.Precision.HIGHEST):
    """Returns (out, lse) in the compute dtype (promote(q.dtype, float32)).

    q (b, sq, hq, d); k, v (b, sk, hkv, d). The band is `band(causal, window_size)` unless
    `left`/`right` are given (any ints; None = unbounded). `bias` (added after the softcap) and
    `mask` (True = attend) broadcast to (b, hq, sq, sk). Rows that see no key: out 0, lse -inf.
    """
    dtype = jnp.promote_types(q.dtype, jnp.float32)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    k = jnp.repeat(k, hq // hkv, axis=2)
    v = jnp.repeat(v, hq // hkv, axis=2)
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale

    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=precision) * scale
    if softcap:
        s = softcap * jnp.tanh(s / softcap)
    if bias is not None:
        s = s + bias.astype(dtype)

    if left is None and right is None:
        left, right = band(causal, window_size)
    left = UNBOUNDED if left is None else left
    right = UNBOUNDED if right is None else right
    allowed = jnp.asarray(band_mask(sq, sk, left, right))
    if mask is not None:
        allowed = allowed & mask
    allowed = jnp.broadcast_to(allowed, s.shape)

    s = jnp.where(allowed, s, -jnp.inf)
    m = s.max(axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(allowed, jnp.exp(s - m), 0.0)
    l = p.sum(axis=-1, keepdims=True)
    l_safe = jnp.where(l > 0, l, 1.0)
    out = jnp.einsum("bhqk,bkhd->bqhd", p / l_safe, v, precision=precision)
    lse = jnp.where(l > 0, m + jnp.log(l_safe), -jnp.inf)[..., 0]
    return out, lse
