"""`dot_product_attention`: a drop-in for `jax.nn.dot_product_attention` on jax_fa3.

It validates jax.nn's arguments (errors name them as the caller wrote them), turns jax.nn's
top-left-aligned masks into our band (jax_fa3/_masks.py) and runs the call like
`flash_attention` (jax_fa3/attention.py), or on the portable path for what the kernels cannot
take (a bias, a boolean mask, per-batch key lengths).
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_fa3 import _core, _masks, _validate, portable
from jax_fa3.attention import attention

__all__ = ["dot_product_attention"]


def _ensure_4d(name, x):
    """jax.nn's convention: lower-rank arrays get leading unit axes."""
    if x.ndim > 4:
        raise ValueError(f"{name} must have at most 4 dims (broadcastable to (B, N, T, S)), "
                         f"got shape {x.shape}")
    return x.reshape((1,) * (4 - x.ndim) + x.shape)


def _check_broadcast(name, x, full):
    for have, want in zip(x.shape, full):
        if have not in (1, want):
            raise ValueError(f"{name} has shape {x.shape}, which does not broadcast to "
                             f"(batch, heads, seqlen_q, seqlen_k) = {full}")


def _check_bias(bias, full):
    if bias is None:
        return None
    bias = _ensure_4d("bias", _validate.as_array("bias", bias))
    _check_broadcast("bias", bias, full)
    return bias


def _check_mask(mask, full):
    if mask is None:
        return None
    mask = _ensure_4d("mask", _validate.as_array("mask", mask))
    if mask.dtype != jnp.bool_:
        raise TypeError(f"mask must be boolean (True = attend; pass additive masks as "
                        f"bias), got dtype {mask.dtype} with shape {mask.shape}")
    _check_broadcast("mask", mask, full)
    return mask


def _check_lengths(name, x, batch):
    if x is None:
        return None
    x = _validate.as_array(name, x)
    if not jnp.issubdtype(x.dtype, jnp.integer) or x.shape != (batch,):
        raise ValueError(f"{name} must be an int32 array of shape ({batch},) (one length per "
                         f"batch row), got dtype {x.dtype} and shape {x.shape}")
    return x.astype(jnp.int32)


def _check_window(local_window_size) -> tuple[int, int] | None:
    """jax.nn's local_window_size: None, an int for both sides, or a pair (left, right)."""
    if local_window_size is None:
        return None
    if isinstance(local_window_size, (tuple, list)):
        if len(local_window_size) != 2:
            raise ValueError(f"local_window_size must be an int or a pair (left, right), "
                             f"got {local_window_size!r}")
        left, right = (_validate.static_int("local_window_size", w) for w in local_window_size)
        return left, right
    size = _validate.static_int("local_window_size", local_window_size)
    return size, size


def _as_batched(query, key, value):
    """(query, key, value) as (B, T, N, H) arrays, and the shape of the result."""
    query = _validate.as_array("query", query)
    if query.ndim not in (3, 4):
        raise ValueError(f"query must have shape (B, T, N, H) or (T, N, H), got {query.shape}")
    key, value = _validate.as_array("key", key), _validate.as_array("value", value)
    for name, x in (("key", key), ("value", value)):
        if x.ndim != query.ndim:
            raise ValueError(f"{name} must have the rank of query ({query.ndim}: "
                             f"{'(B, S, K, H)' if query.ndim == 4 else '(S, K, H)'}), "
                             f"got shape {x.shape}")
    out_shape = query.shape
    if query.ndim == 3:
        query, key, value = query[None], key[None], value[None]
    q, k, v = _validate.check_qkv(query, key, value, names=("query", "key", "value"))
    if v.shape != k.shape:  # jax.nn takes one head dim for key and value; so do we here
        raise ValueError(f"value has shape {v.shape}, expected the shape of key {k.shape}: "
                         f"the drop-in takes key and value of one head dim, as jax.nn does "
                         f"(jax_fa3.flash_attention takes a value head dim of its own)")
    return q, k, v, out_shape


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None,
                          is_causal=False, query_seq_lengths=None, key_value_seq_lengths=None,
                          local_window_size=None, implementation=None, return_residual=False):
    """Drop-in for `jax.nn.dot_product_attention` (same arguments and semantics).

    Shapes: query (B, T, N, H) or (T, N, H); key/value (B, S, K, H) or (S, K, H), N % K == 0;
    bias/mask broadcastable to (B, N, T, S) (lower ranks get leading unit axes); mask is
    boolean, True = attend; seq lengths int32 (B,). Masks are aligned as in jax.nn: top-left,
    i.e. with T != S causal means key j <= query i (NOT FlashAttention's bottom-right
    convention of `flash_attention`), and `local_window_size=(l, r)` (or an int for both)
    admits keys i - l <= j <= i + r, the values taken literally.

    Dispatch: without bias, mask and key_value_seq_lengths the call runs like
    `flash_attention` (kernel when possible); query_seq_lengths only zeroes padded rows.
    With a bias or mask the dense portable variant runs (the bias is differentiable); with
    key_value_seq_lengths the blockwise portable path. implementation="cuda" with any of
    those raises (the kernel cannot take them); "xla" forces the portable path. Errors name
    the argument as passed here (`scale`, `is_causal`, ...).

    One deliberate difference from jax.nn: a query row that sees no key returns 0 (and LSE
    -inf), where jax.nn averages all values (it masks with a large finite negative).
    Degenerate inputs (T or S = 0, scale=0, NaN in query/key/value) behave as documented in
    `jax_fa3.flash_attention`; NaN rows of the output are those of jax.nn.
    `return_residual=True` also returns the LSE in (B, T, N) (or (T, N)) in key's dtype.
    """
    q, k, v, out_shape = _as_batched(query, key, value)
    b, t, n, h = q.shape
    s = k.shape[1]
    full = (b, n, t, s)
    bias, mask = _check_bias(bias, full), _check_mask(mask, full)
    q_lengths = _check_lengths("query_seq_lengths", query_seq_lengths, b)
    kv_lengths = _check_lengths("key_value_seq_lengths", key_value_seq_lengths, b)
    left, right = _masks.top_left_band(_validate.check_bool("is_causal", is_causal),
                                       _check_window(local_window_size), t, s)
    sm_scale = _validate.check_softmax_scale(scale, h, name="scale")
    return_residual = _validate.check_bool("return_residual", return_residual)
    _validate.check_implementation(implementation)

    unsupported = [f"the kernels cannot take {name}" for name, x in (
        ("bias", bias), ("mask", mask), ("key_value_seq_lengths", kv_lengths)) if x is not None]
    unsupported += _core.scale_reasons(sm_scale, "scale")
    impl = _core.resolve_implementation(implementation, q, unsupported=unsupported)
    if bias is not None or mask is not None:
        out, lse = portable.dense(q, k, v, softmax_scale=sm_scale, left=left, right=right,
                                  bias=bias, mask=mask, kv_lengths=kv_lengths)
    else:
        opts = _core.Options(softmax_scale=sm_scale, left=left, right=right,
                             implementation=impl)
        out, lse = attention(q, k, v, opts, kv_lengths)
    if q_lengths is not None:
        valid = jnp.arange(t)[None, :] < q_lengths[:, None]  # (B, T)
        out = out * valid[:, :, None, None].astype(out.dtype)
        lse = jnp.where(valid[:, None, :], lse, -jnp.inf)
    out = out.reshape(out_shape)
    if return_residual:
        residual = jnp.swapaxes(lse, 1, 2).astype(k.dtype).reshape(out_shape[:-1])
        return out, residual
    return out
