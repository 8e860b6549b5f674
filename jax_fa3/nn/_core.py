"""What the Flax and Equinox attention modules share: default key/value inputs, optional RoPE,
learnable attention sinks, and the call into jax_fa3.flash_attention. Framework-free (JAX
only)."""

from __future__ import annotations

import math
from typing import Literal

import jax
import jax.numpy as jnp

import jax_fa3
from jax_fa3.nn.rope import apply_rope, default_positions

Implementation = Literal["cuda", "xla"] | None


# The attention options every module carries as fields, passed to `attend` by name.
OPTION_FIELDS = ("causal", "window_size", "softcap", "softmax_scale", "rope", "rope_base",
                 "implementation")


def module_options(module) -> dict:
    """The attention options of a module (NNX, Linen or Equinox) as `attend` keywords."""
    return {name: getattr(module, name) for name in OPTION_FIELDS}


def initial_sinks(num_heads: int) -> jax.Array:
    """The modules' learnable attention sinks at creation: one float32 logit per query head,
    zero (each row's softmax denominator starts with exp(0) = 1 of weight on no value)."""
    return jnp.zeros((num_heads,), jnp.float32)


def self_attention_defaults(inputs_q, inputs_k, inputs_v):
    """(inputs_k, inputs_v) with Flax's defaults: keys from the queries, values from the keys."""
    if inputs_k is None:
        if inputs_v is not None:
            raise ValueError("inputs_k cannot be None when inputs_v is given")
        inputs_k = inputs_q
    if inputs_v is None:
        inputs_v = inputs_k
    return inputs_k, inputs_v


def _per_batch(name: str, x, batch_shape: tuple[int, ...], seqlen: int):
    """A (batch..., seqlen) or (seqlen,) array as (prod(batch), seqlen) for flash_attention."""
    x = jnp.asarray(x)
    if x.shape[-1:] != (seqlen,) or x.ndim > len(batch_shape) + 1:
        raise ValueError(f"{name} must have shape {batch_shape + (seqlen,)} (or ({seqlen},)), "
                         f"got {x.shape}")
    x = jnp.broadcast_to(x, batch_shape + (seqlen,))
    return x.reshape((math.prod(batch_shape), seqlen))


def attend(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    causal: bool,
    window_size: tuple[int, int],
    softcap: float,
    softmax_scale: float | None,
    rope: bool,
    rope_base: float,
    positions: jax.Array | None,
    kv_positions: jax.Array | None,
    implementation: Implementation,
    sinks: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
) -> jax.Array:
    """RoPE (optional) + jax_fa3.flash_attention on ``(batch..., seqlen, heads, head_dim)``
    (value: ``head_dim_v``, which the result takes); ``sinks`` ``(heads,)`` or None.

    Packed sequences: ``segment_ids`` ``(batch..., seqlen_q)`` (or ``(seqlen_q,)``) and
    ``kv_segment_ids`` (default: ``segment_ids``, self-attention) go to flash_attention's
    ``q_segment_ids`` / ``kv_segment_ids`` (0 = padding). With segment ids, ``positions`` /
    ``kv_positions`` (integers, each token's position in its document) also go to
    flash_attention, so that causal/window follow the documents; they are allowed without
    RoPE then."""
    batch_shape = query.shape[:-3]
    if key.shape[:-3] != batch_shape or value.shape[:-3] != batch_shape:
        raise ValueError(
            f"query, key and value need the same batch axes, got shapes {query.shape}, "
            f"{key.shape}, {value.shape}"
        )
    seq_q, seq_k = query.shape[-3], key.shape[-3]
    packed = segment_ids is not None
    if kv_segment_ids is not None and not packed:
        raise ValueError("kv_segment_ids needs segment_ids (the queries' segment ids) too")
    if rope:
        default_q, default_k = default_positions(seq_q, seq_k)
        q_pos = default_q if positions is None else positions
        if kv_positions is not None:
            k_pos = kv_positions
        elif positions is not None and seq_k == seq_q:
            k_pos = positions  # self-attention: keys sit where the queries do
        else:
            k_pos = default_k
        query = apply_rope(query, jnp.broadcast_to(q_pos, batch_shape + query.shape[-3:-2]), base=rope_base)
        key = apply_rope(key, jnp.broadcast_to(k_pos, batch_shape + key.shape[-3:-2]), base=rope_base)
    elif (positions is not None or kv_positions is not None) and not packed:
        raise ValueError("positions/kv_positions are only used with rope=True or with segment_ids")

    documents = {}
    if packed:
        documents["q_segment_ids"] = _per_batch("segment_ids", segment_ids, batch_shape, seq_q)
        if kv_segment_ids is not None:
            documents["kv_segment_ids"] = _per_batch("kv_segment_ids", kv_segment_ids,
                                                     batch_shape, seq_k)
        elif seq_k != seq_q:
            raise ValueError(f"segment_ids alone stands for the keys' too, which needs as many "
                             f"keys as queries; got {seq_q} queries and {seq_k} keys: pass "
                             f"kv_segment_ids")
        if positions is not None:
            documents["q_positions"] = _per_batch("positions", positions, batch_shape, seq_q)
        if kv_positions is not None:
            documents["kv_positions"] = _per_batch("kv_positions", kv_positions, batch_shape,
                                                   seq_k)
        elif positions is not None and "kv_segment_ids" in documents:
            if seq_k != seq_q:
                raise ValueError("with kv_segment_ids and positions, pass kv_positions too")
            documents["kv_positions"] = documents["q_positions"]  # keys where the queries are

    q, k, v = (x.reshape((math.prod(batch_shape),) + x.shape[-3:]) for x in (query, key, value))
    out = jax_fa3.flash_attention(
        q,
        k,
        v,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=tuple(window_size),
        softcap=softcap,
        sinks=sinks,
        implementation=implementation,
        **documents,
    )
    return out.reshape(query.shape[:-1] + value.shape[-1:])
