"""Public attention API: `flash_attention`, and `attention`, the differentiable op under it and
under `jax_fa3.dot_product_attention` (jax_fa3/compat.py).

`flash_attention` validates its arguments once and builds the call's `Options`
(jax_fa3/_core.py), which settles the implementation at trace time from static facts (dtype,
head dim, whether the extension is built and the device is Hopper): `implementation=None`
takes the kernel when it can run the call and the portable path otherwise; "cuda" demands
the kernel (else an error giving the reason); "xla" forces the portable path.

Gradients come from one `jax.custom_vjp` whose residuals are (q, k, v, sinks, out, lse). Both rules
call the core (jax_fa3/_core.py) directly on one device, and through jax_fa3/sharding.py
(one local call per device, a ring over a sharded sequence) when the inputs may be
partitioned. The backward runs on the kernel when the forward did and a backward kernel is
built; an LSE cotangent (when the caller differentiates through `lse`) is exact on the
portable backward, which then runs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from jax_fa3 import _core, _validate, sharding
from jax_fa3._core import Options, kernel_available, resolve_implementation, unavailable_reason
from jax_fa3._vma import sum_like

__all__ = ["flash_attention", "attention", "unavailable_reason", "kernel_available",
           "resolve_implementation"]


# ----------------------------------------------------------------------------- custom_vjp

def _partitioned(q, k, kv_lengths) -> bool:
    """Through the sharding layer only when the inputs may be sharded and there is work to
    split (per-batch key lengths and empty calls stay local)."""
    return kv_lengths is None and not _core.is_empty(q, k) and sharding.may_partition()


def _forward(q, k, v, sinks, kv_lengths, opts: Options):
    if _partitioned(q, k, kv_lengths):
        return sharding.partitioned_attention_fwd(q, k, v, opts, sinks=sinks)
    return _core.attention_fwd(q, k, v, opts, sinks=sinks, kv_lengths=kv_lengths)


def _unwrap(x):
    """custom_vjp with symbolic_zeros hands the fwd rule CustomVJPPrimal wrappers."""
    return getattr(x, "value", x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attention(q, k, v, sinks, kv_lengths, opts: Options):
    return _forward(q, k, v, sinks, kv_lengths, opts)


def _attention_fwd_rule(q, k, v, sinks, kv_lengths, opts):
    q, k, v, sinks, kv_lengths = map(_unwrap, (q, k, v, sinks, kv_lengths))
    out, lse = _forward(q, k, v, sinks, kv_lengths, opts)
    return (out, lse), (q, k, v, sinks, kv_lengths, out, lse)


def _attention_bwd_rule(opts, residuals, cotangents):
    q, k, v, sinks, kv_lengths, out, lse = residuals
    dout, dlse = cotangents
    if isinstance(dout, SymbolicZero):  # only lse is differentiated
        dout = jnp.zeros(out.shape, out.dtype)
    dlse = None if isinstance(dlse, SymbolicZero) else dlse
    if _partitioned(q, k, kv_lengths):
        dq, dk, dv, dsinks = sharding.partitioned_attention_bwd(
            q, k, v, out, lse, dout, opts, dlse=dlse, sinks=sinks)
    else:
        dq, dk, dv, dsinks = _core.attention_bwd(q, k, v, out, lse, dout, opts, dlse=dlse,
                                                 sinks=sinks, kv_lengths=kv_lengths)
    if dsinks is not None:  # inside a shard_map: shared sinks get every device's rows' share
        dsinks = sum_like(dsinks, sinks)
    return dq, dk, dv, dsinks, None


_attention.defvjp(_attention_fwd_rule, _attention_bwd_rule, symbolic_zeros=True)


def attention(q, k, v, opts: Options, kv_lengths=None, sinks=None):
    """(out, lse), differentiable in q, k, v and sinks (through out and lse), for validated
    arrays and options. `kv_lengths` (b,) int32 limits the keys of each batch row (portable
    path only: build `opts` with implementation "xla"); `sinks` None or (hq,) float32."""
    return _attention(q, k, v, sinks, kv_lengths, opts)


# ----------------------------------------------------------------------------- public API

def flash_attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, sinks=None, return_lse=False, deterministic=False,
                    implementation=None):
    """FlashAttention: softmax(q kᵀ * softmax_scale) v, differentiable, jit/vmap-able.

    Args:
      q: (batch, seqlen_q, heads_q, head_dim), bfloat16/float16 (kernel or portable) or
        float32 (portable).
      k: (batch, seqlen_k, heads_kv, head_dim), same dtype; heads_q % heads_kv == 0 gives
        GQA/MQA (query head h reads key/value head h // (heads_q // heads_kv)).
      v: (batch, seqlen_k, heads_kv, head_dim_v), same dtype; head_dim_v may differ from
        head_dim (MLA's 192/128, say); out takes it. The kernels take any head dims that are
        multiples of 8 up to 256.
      softmax_scale: scale of the scores; default 1/sqrt(head_dim) (q's head dim).
      causal: query i sees keys j <= i + (seqlen_k - seqlen_q) (bottom-right aligned).
      window_size: (left, right) local window around that diagonal; -1 = unbounded.
      softcap: scores -> softcap * tanh(scores / softcap) before masking; 0 = off.
      sinks: None, or (heads_q,) attention-sink logits (as in gpt-oss), any float dtype,
        used as float32: each row's softmax denominator gains exp(sinks[h]), in the units of
        the scaled (and capped) scores, like one more key whose value is 0. Differentiable;
        the gradient comes back in sinks' dtype. A sink of -inf is the same as none.
      return_lse: also return the log-sum-exp (batch, heads_q, seqlen_q) float32 (it
        includes the sinks).
      deterministic: deterministic backward on the kernel (the portable one always is).
      implementation: None (kernel if it can run, else portable), "cuda" (kernel, else a
        RuntimeError when this machine or build cannot run it, a ValueError when the input
        is what it cannot take), "xla" (portable).

    Returns:
      out (batch, seqlen_q, heads_q, head_dim_v) in q's dtype, or (out, lse). A query row
      that sees no key gets out 0 and lse -inf (lse sinks[h] with sinks), and contributes
      zero gradients to q, k and v.

    Degenerate inputs, the same on both paths:
      * seqlen_q, seqlen_k or batch 0: an empty out (or, for seqlen_k 0, out 0 with lse
        -inf, or sinks[h]: no row sees a key), zero gradients to q, k and v, no kernel
        launch.
      * softmax_scale=0: every visible key has the same weight (out is the mean of the
        visible values, lse the log of their number); dq and dk are 0. The kernels cannot
        take it (a masked score times 0 is NaN there): None runs it on the portable path,
        "cuda" raises.
      * NaN in q, k or v spreads as in jax.nn.dot_product_attention, and never leaves its
        batch row and kv head group: a NaN in q row i makes out row i NaN; a NaN in k at key
        j makes NaN the rows that see key j; a NaN in v at key j makes NaN at least the rows
        that see key j (on the portable path, as in jax.nn, every row of those heads, since a
        zero probability times NaN is NaN). A row whose scores are NaN has lse -inf (it
        counts as seeing no key; its out is NaN). Gradients are NaN where they depend on
        the NaN, and possibly elsewhere in the same batch row and head group.
    """
    q, k, v = _validate.check_qkv(q, k, v)
    sinks = _validate.check_sinks(sinks, q.shape[2])
    opts = _core.flash_options(q, softmax_scale=softmax_scale, causal=causal,
                               window_size=window_size, softcap=softcap,
                               deterministic=deterministic, implementation=implementation,
                               head_dim_v=v.shape[-1])
    return_lse = _validate.check_bool("return_lse", return_lse)
    out, lse = attention(q, k, v, opts, sinks=sinks)
    return (out, lse) if return_lse else out
