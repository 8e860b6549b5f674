"""Public attention API: `flash_attention`, `dot_product_attention`, and the dispatch between
the Hopper kernels (jax_fa3/_ops.py) and the portable path (jax_fa3/portable.py).

Dispatch is decided at trace time from static facts (dtype, head dim, options, whether the
extension is built and the device is Hopper). `implementation=None` takes the kernel when it
can run the call and the portable path otherwise; "cuda" demands the kernel (else an error
giving the reason); "xla" forces the portable path.

Gradients come from one `jax.custom_vjp` whose residuals are (q, k, v, out, lse). Its backward
uses the kernel when the forward ran on the kernel and a backward kernel is built for the
call; otherwise the portable backward, which accepts the kernel's out/lse. An LSE cotangent
(when the caller differentiates through `lse`) is exact on the portable backward; the kernel
backward is used only when that cotangent is zero (detected symbolically, at trace time).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from jax_fa3 import _ffi, _masks, _validate, portable, sharding
from jax_fa3._masks import UNBOUNDED

__all__ = [
    "flash_attention",
    "dot_product_attention",
    "attention_fwd",
    "attention_bwd",
    "resolve_implementation",
    "unavailable_reason",
    "kernel_available",
]


# ----------------------------------------------------------------------------- dispatch

def unavailable_reason(direction: str = "fwd", dtype=jnp.bfloat16, head_dim: int = 128,
                       shapes=()) -> str | None:
    """None when the Hopper kernel for `direction` ('fwd' or 'bwd') can run inputs of this
    dtype, head dim (and optionally these shapes) here; otherwise a sentence saying why."""
    return (_validate.kernel_input_reason(dtype, head_dim, shapes)
            or _ffi.unavailable_reason(direction, dtype, head_dim))


def kernel_available(direction: str = "fwd", dtype=jnp.bfloat16, head_dim: int = 128) -> bool:
    """True when the Hopper kernel for `direction` can run this dtype and head dim here."""
    return unavailable_reason(direction, dtype, head_dim) is None


def resolve_implementation(implementation, q, k, direction: str = "fwd") -> str:
    """'cuda' (the kernel) or 'xla' (the portable path) for inputs like q and k.

    For the forward, `implementation="cuda"` raises when the kernel cannot run: ValueError when
    the inputs are unsupported, RuntimeError when the kernel is not built or the device is not
    Hopper. For the backward, an unavailable kernel always means the portable path (a build may
    hold forward kernels only)."""
    _validate.check_implementation(implementation)
    if implementation == "xla":
        return "xla"
    shapes = (q.shape, k.shape)
    reason = unavailable_reason(direction, q.dtype, q.shape[-1], shapes)
    if reason is None:
        return "cuda"
    if implementation == "cuda" and direction == "fwd":
        input_reason = _validate.kernel_input_reason(q.dtype, q.shape[-1], shapes)
        error = ValueError if input_reason else RuntimeError
        raise error(f"implementation='cuda' cannot run this call: {reason}. "
                    f"Use implementation=None to fall back to the portable path.")
    return "xla"


def attention_fwd(q, k, v, *, softmax_scale: float, softcap: float, left: int, right: int,
                  implementation):
    """Attention forward without autodiff rules: returns (out, lse).

    q (b, sq, hq, d); k, v (b, sk, hkv, d); out like q; lse (b, hq, sq) float32 (natural log;
    -inf where a query row sees no key, whose out is 0). The mask is the band (left, right):
    query i sees key j iff -left <= j - i - (sk - sq) <= right; any ints, e.g. shifted bands
    for ring attention (see jax_fa3/_masks.py). `implementation`: None, "cuda" or "xla" as in
    `flash_attention`. Stable internal API (used by ring attention)."""
    q, k, v = _validate.check_qkv(q, k, v)
    left, right = _masks.clamp(left), _masks.clamp(right)
    if resolve_implementation(implementation, q, k, "fwd") == "cuda":
        from jax_fa3 import _ops  # the only module with ffi_call sites
        return _ops.fwd(q, k, v, softmax_scale=softmax_scale, softcap=softcap,
                        window_left=left, window_right=right)
    return portable.forward(q, k, v, softmax_scale=softmax_scale, softcap=softcap,
                            left=left, right=right)


def attention_bwd(q, k, v, out, lse, dout, *, softmax_scale: float, softcap: float, left: int,
                  right: int, deterministic: bool, implementation, dlse=None):
    """Attention backward without autodiff rules: returns (dq, dk, dv) in the dtypes of q, k, v.

    The standard FlashAttention backward: P = exp(S - lse), D = rowsum(dout * out),
    dS = P * (dP - D). Given the FINAL out/lse of a merged attention (e.g. over ring chunks)
    it returns the exact partial gradients for this chunk's q, k, v. `dlse` is an optional LSE
    cotangent (b, hq, sq); with it, or with implementation="xla", or when no backward kernel
    is built for the call, the portable backward runs. `deterministic` orders the kernel's dQ
    accumulation (the portable backward is always deterministic). Stable internal API."""
    q, k, v = _validate.check_qkv(q, k, v)
    left, right = _masks.clamp(left), _masks.clamp(right)
    use_kernel = dlse is None and resolve_implementation(implementation, q, k, "bwd") == "cuda"
    if use_kernel:
        from jax_fa3 import _ops
        return _ops.bwd(q, k, v, out, lse, dout, softmax_scale=softmax_scale, softcap=softcap,
                        window_left=left, window_right=right, deterministic=deterministic)
    return portable.backward(q, k, v, out, lse, dout, softmax_scale=softmax_scale,
                             softcap=softcap, left=left, right=right, dlse=dlse)


# ----------------------------------------------------------------------------- custom_vjp

@dataclasses.dataclass(frozen=True)
class _Config:
    """Static options of one attention call (hashable: a nondiff argument of the custom_vjp)."""
    softmax_scale: float
    softcap: float
    left: int
    right: int
    deterministic: bool
    fwd_impl: str  # "cuda" or "xla", resolved
    bwd_impl: str | None  # the requested implementation, resolved again for the backward


def _unwrap(x):
    """custom_vjp with symbolic_zeros hands the fwd rule CustomVJPPrimal wrappers."""
    return getattr(x, "value", x)


def _forward(q, k, v, kv_lengths, cfg: _Config):
    if kv_lengths is None:  # sharded inputs: one local call per device, a ring if seq-sharded
        return sharding.partitioned_attention_fwd(
            q, k, v, softmax_scale=cfg.softmax_scale, softcap=cfg.softcap, left=cfg.left,
            right=cfg.right, implementation=cfg.fwd_impl)
    return portable.forward(q, k, v, softmax_scale=cfg.softmax_scale, softcap=cfg.softcap,
                            left=cfg.left, right=cfg.right, kv_lengths=kv_lengths)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, kv_lengths, cfg: _Config):
    """(out, lse) with FlashAttention gradients; kv_lengths (b,) int or None (portable only)."""
    return _forward(q, k, v, kv_lengths, cfg)


def _attention_fwd_rule(q, k, v, kv_lengths, cfg):
    q, k, v, kv_lengths = map(_unwrap, (q, k, v, kv_lengths))
    out, lse = _forward(q, k, v, kv_lengths, cfg)
    return (out, lse), (q, k, v, kv_lengths, out, lse)


def _attention_bwd_rule(cfg, residuals, cotangents):
    q, k, v, kv_lengths, out, lse = residuals
    dout, dlse = cotangents
    if isinstance(dout, SymbolicZero):  # only lse is differentiated
        dout = jnp.zeros(out.shape, out.dtype)
    dlse = None if isinstance(dlse, SymbolicZero) else dlse
    opts = dict(softmax_scale=cfg.softmax_scale, softcap=cfg.softcap, left=cfg.left,
                right=cfg.right)
    if kv_lengths is None:  # attention_bwd per device (see jax_fa3/sharding.py)
        impl = cfg.bwd_impl if cfg.fwd_impl == "cuda" else "xla"
        dq, dk, dv = sharding.partitioned_attention_bwd(
            q, k, v, out, lse, dout, deterministic=cfg.deterministic, implementation=impl,
            dlse=dlse, **opts)
    else:
        dq, dk, dv = portable.backward(q, k, v, out, lse, dout, kv_lengths=kv_lengths,
                                       dlse=dlse, **opts)
    return dq, dk, dv, None


_attention.defvjp(_attention_fwd_rule, _attention_bwd_rule, symbolic_zeros=True)


# ----------------------------------------------------------------------------- public API

def flash_attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, return_lse=False, deterministic=False, implementation=None):
    """FlashAttention: softmax(q kᵀ * softmax_scale) v, differentiable, jit/vmap-able.

    Args:
      q: (batch, seqlen_q, heads_q, head_dim), bfloat16/float16 (kernel or portable) or
        float32 (portable).
      k, v: (batch, seqlen_k, heads_kv, head_dim), same dtype; heads_q % heads_kv == 0 gives
        GQA/MQA (query head h reads key/value head h // (heads_q // heads_kv)).
      softmax_scale: scale of the scores; default 1/sqrt(head_dim).
      causal: query i sees keys j <= i + (seqlen_k - seqlen_q) (bottom-right aligned).
      window_size: (left, right) local window around that diagonal; -1 = unbounded.
      softcap: scores -> softcap * tanh(scores / softcap) before masking; 0 = off.
      return_lse: also return the log-sum-exp (batch, heads_q, seqlen_q) float32.
      deterministic: deterministic backward on the kernel (the portable one always is).
      implementation: None (kernel if it can run, else portable), "cuda" (kernel or error),
        "xla" (portable).

    Returns:
      out (like q), or (out, lse). A query row that sees no key gets out 0 and lse -inf.
    """
    q, k, v = _validate.check_qkv(q, k, v)
    scale = _validate.check_softmax_scale(softmax_scale, q.shape[-1])
    cap = _validate.check_softcap(softcap)
    window = _validate.check_window(window_size)
    causal = _validate.check_bool("causal", causal)
    return_lse = _validate.check_bool("return_lse", return_lse)
    deterministic = _validate.check_bool("deterministic", deterministic)
    impl = resolve_implementation(implementation, q, k, "fwd")
    left, right = _masks.band(causal, window)
    cfg = _Config(scale, cap, left, right, deterministic, impl, implementation)
    out, lse = _attention(q, k, v, None, cfg)
    return (out, lse) if return_lse else out


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


def _check_lengths(name, x, batch):
    if x is None:
        return None
    x = _validate.as_array(name, x)
    if not jnp.issubdtype(x.dtype, jnp.integer) or x.shape != (batch,):
        raise ValueError(f"{name} must be an int32 array of shape ({batch},) (one length per "
                         f"batch row), got dtype {x.dtype} and shape {x.shape}")
    return x.astype(jnp.int32)


def _top_left_band(is_causal, local_window_size, seqlen_q, seqlen_k):
    """jax.nn's masks are top-left aligned (query i sees key j iff
    -left_window <= j - i <= right_window, and j <= i when causal); as our bottom-right band."""
    left = right = UNBOUNDED
    if local_window_size is not None:
        if isinstance(local_window_size, (tuple, list)):
            if len(local_window_size) != 2:
                raise ValueError(f"local_window_size must be an int or a pair (left, right), "
                                 f"got {local_window_size!r}")
            wl, wr = (_validate.static_int("local_window_size", w) for w in local_window_size)
        else:
            wl = wr = _validate.static_int("local_window_size", local_window_size)
        left, right = wl, wr
    if is_causal:
        right = min(right, 0)
    shift = seqlen_k - seqlen_q  # our diagonal sits `shift` keys right of jax.nn's
    left = left if left >= UNBOUNDED else left + shift
    right = right if right >= UNBOUNDED else right - shift
    return _masks.clamp(left), _masks.clamp(right)


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
    those raises (the kernel cannot take them); "xla" forces the portable path.

    One deliberate difference from jax.nn: a query row that sees no key returns 0 (and LSE
    -inf), where jax.nn averages all values (it masks with a large finite negative).
    `return_residual=True` also returns the LSE in (B, T, N) (or (T, N)) in key's dtype.
    """
    query = _validate.as_array("query", query)
    out_shape = query.shape
    if query.ndim not in (3, 4):
        raise ValueError(f"query must have shape (B, T, N, H) or (T, N, H), got {query.shape}")
    key, value = _validate.as_array("key", key), _validate.as_array("value", value)
    for name, x in (("key", key), ("value", value)):
        if x.ndim != query.ndim:
            raise ValueError(f"{name} must have the rank of query ({query.ndim}: "
                             f"{'(B, S, K, H)' if query.ndim == 4 else '(S, K, H)'}), "
                             f"got shape {x.shape}")
    if query.ndim == 3:
        query, key, value = query[None], key[None], value[None]
    q, k, v = _validate.check_qkv(query, key, value, names=("query", "key", "value"))
    b, t, n, h = q.shape
    s = k.shape[1]
    sm_scale = _validate.check_softmax_scale(scale, h)
    is_causal = _validate.check_bool("is_causal", is_causal)
    _validate.check_implementation(implementation)
    if bias is not None:
        bias = _ensure_4d("bias", _validate.as_array("bias", bias))
        _check_broadcast("bias", bias, (b, n, t, s))
    if mask is not None:
        mask = _ensure_4d("mask", _validate.as_array("mask", mask))
        if mask.dtype != jnp.bool_:
            raise TypeError(f"mask must be boolean (True = attend; pass additive masks as "
                            f"bias), got dtype {mask.dtype} with shape {mask.shape}")
        _check_broadcast("mask", mask, (b, n, t, s))
    q_lengths = _check_lengths("query_seq_lengths", query_seq_lengths, b)
    kv_lengths = _check_lengths("key_value_seq_lengths", key_value_seq_lengths, b)
    left, right = _top_left_band(is_causal, local_window_size, t, s)

    needs_portable = [n_ for n_, x in (("bias", bias), ("mask", mask),
                                       ("key_value_seq_lengths", kv_lengths)) if x is not None]
    if needs_portable and implementation == "cuda":
        raise ValueError(f"implementation='cuda' cannot take {', '.join(needs_portable)}: the "
                         f"kernels support only causal/local-window masks; use "
                         f"implementation=None to run this call on the portable path")
    if bias is not None or mask is not None:
        out, lse = portable.dense(q, k, v, softmax_scale=sm_scale, left=left, right=right,
                                  bias=bias, mask=mask, kv_lengths=kv_lengths)
    else:
        impl = "xla" if kv_lengths is not None else resolve_implementation(implementation, q, k)
        cfg = _Config(sm_scale, 0.0, left, right, False, impl, implementation)
        out, lse = _attention(q, k, v, kv_lengths, cfg)
    if q_lengths is not None:
        valid = jnp.arange(t)[None, :] < q_lengths[:, None]  # (B, T)
        out = out * valid[:, :, None, None].astype(out.dtype)
        lse = jnp.where(valid[:, None, :], lse, -jnp.inf)
    out = out.reshape(out_shape)
    if return_residual:
        residual = jnp.swapaxes(lse, 1, 2).astype(key.dtype).reshape(out_shape[:-1])
        return out, residual
    return out
