"""Rotary position embeddings (RoPE), in pure JAX.

Shared by the Flax and Equinox modules and the example model, so that every path rotates
queries and keys the same way. The rotation pairs dimension ``i`` with ``i + head_dim // 2``
(the "rotate half" layout of GPT-NeoX and Llama), which keeps both halves contiguous.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["apply_rope", "default_positions", "rope_angles"]


def rope_angles(positions: jax.Array, head_dim: int, base: float = 10000.0) -> jax.Array:
    """Rotation angles ``positions[..., None] * base ** (-2i / head_dim)``, float32.

    Args:
      positions: integer or float positions, any shape ``(...)``.
      head_dim: the (even) size of the rotated feature axis.
      base: the RoPE base wavelength (``theta``).

    Returns:
      float32 array of shape ``(..., head_dim // 2)``.
    """
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got head_dim={head_dim}.")
    inv_freq = base ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    return jnp.asarray(positions, jnp.float32)[..., None] * inv_freq


def apply_rope(x: jax.Array, positions: jax.Array, *, base: float = 10000.0) -> jax.Array:
    """Rotates ``x`` of shape ``(..., seqlen, heads, head_dim)`` by its positions.

    Args:
      x: queries or keys, ``(..., seqlen, heads, head_dim)``.
      positions: ``(seqlen,)`` or ``(..., seqlen)`` positions, broadcast against the leading
        axes of ``x``.
      base: the RoPE base wavelength.

    Returns:
      An array of the shape and dtype of ``x``. The rotation itself runs in float32 so that
      bf16 inputs do not lose the low bits of large angles.
    """
    head_dim = x.shape[-1]
    angles = rope_angles(positions, head_dim, base)[..., None, :]  # (..., seqlen, 1, head_dim/2)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


def default_positions(seqlen_q: int, seqlen_k: int) -> tuple[jax.Array, jax.Array]:
    """Positions used when the caller gives none.

    Keys sit at ``0 .. seqlen_k - 1`` and queries are the *last* ``seqlen_q`` of them, which
    matches the bottom-right alignment of ``causal`` in jax_fa3 (a query block that continues
    a longer key sequence, as in chunked prefill).
    """
    q_pos = jnp.arange(seqlen_q, dtype=jnp.int32) + (seqlen_k - seqlen_q)
    return q_pos, jnp.arange(seqlen_k, dtype=jnp.int32)
