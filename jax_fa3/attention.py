"""Public attention API: `flash_attention`, `flash_attention_varlen` (packed tokens cut by
cu_seqlens), and `attention`, the differentiable op under them and under
`jax_fa3.dot_product_attention` (jax_fa3/compat.py).

`flash_attention` validates its arguments once and builds the call's `Options`
(jax_fa3/_core.py), which settles the implementation at trace time from static facts (dtype,
head dim, whether the extension is built and the device is Hopper): `implementation=None`
takes the kernel when it can run the call and the portable path otherwise; "cuda" demands
the kernel (else an error giving the reason); "xla" forces the portable path.

Gradients come from one `jax.custom_vjp` whose residuals are (q, k, v, sinks, out, lse)
(and the non-differentiable key lengths and segments). Both rules
call the core (jax_fa3/_core.py) directly on one device, and through jax_fa3/sharding.py
(one local call per device, a ring over a sharded sequence) when the inputs may be
partitioned. The backward runs on the kernel when the forward did and a backward kernel is
built; an LSE cotangent (when the caller differentiates through `lse`) is exact on the
portable backward, which then runs.

FP8 (float8_e4m3fn q, k, v with descales, issue 28) is forward-only: `_attention_fp8`, a
custom_jvp whose rule raises, runs the FP8 kernel where it can run the call (as for the other
dtypes; partitioned through the sharding layer) and otherwise the portable
FP8 path (jax_fa3/portable_fp8.py, the kernel's numerics emulated).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from jax_fa3 import _core, _validate, sharding
from jax_fa3.segments import Segments, varlen_segments
from jax_fa3._core import Options, kernel_available, resolve_implementation, unavailable_reason
from jax_fa3._vma import sum_like

__all__ = ["flash_attention", "flash_attention_varlen", "attention", "unavailable_reason",
           "kernel_available", "resolve_implementation", "Segments"]


# ----------------------------------------------------------------------------- custom_vjp

def _partitioned(q, k, kv_lengths) -> bool:
    """Through the sharding layer only when the inputs may be sharded and there is work to
    split (per-batch key lengths and empty calls stay local)."""
    return kv_lengths is None and not _core.is_empty(q, k) and sharding.may_partition()


def _forward(q, k, v, sinks, kv_lengths, segments, opts: Options):
    if _partitioned(q, k, kv_lengths):
        return sharding.partitioned_attention_fwd(q, k, v, opts, sinks=sinks,
                                                  segments=segments)
    return _core.attention_fwd(q, k, v, opts, sinks=sinks, kv_lengths=kv_lengths,
                               segments=segments)


def _unwrap(x):
    """custom_vjp with symbolic_zeros hands the fwd rule CustomVJPPrimal wrappers."""
    return getattr(x, "value", x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _attention(q, k, v, sinks, kv_lengths, segments, opts: Options):
    return _forward(q, k, v, sinks, kv_lengths, segments, opts)


def _attention_fwd_rule(q, k, v, sinks, kv_lengths, segments, opts):
    q, k, v, sinks, kv_lengths = map(_unwrap, (q, k, v, sinks, kv_lengths))
    segments = jax.tree.map(_unwrap, segments)
    out, lse = _forward(q, k, v, sinks, kv_lengths, segments, opts)
    return (out, lse), (q, k, v, sinks, kv_lengths, segments, out, lse)


def _attention_bwd_rule(opts, residuals, cotangents):
    q, k, v, sinks, kv_lengths, segments, out, lse = residuals
    dout, dlse = cotangents
    if isinstance(dout, SymbolicZero):  # only lse is differentiated
        dout = jnp.zeros(out.shape, out.dtype)
    dlse = None if isinstance(dlse, SymbolicZero) else dlse
    if _partitioned(q, k, kv_lengths):
        dq, dk, dv, dsinks = sharding.partitioned_attention_bwd(
            q, k, v, out, lse, dout, opts, dlse=dlse, sinks=sinks, segments=segments)
    else:
        dq, dk, dv, dsinks = _core.attention_bwd(q, k, v, out, lse, dout, opts, dlse=dlse,
                                                 sinks=sinks, kv_lengths=kv_lengths,
                                                 segments=segments)
    if dsinks is not None:  # inside a shard_map: shared sinks get every device's rows' share
        dsinks = sum_like(dsinks, sinks)
    # integer key lengths and segments have no gradient
    return dq, dk, dv, dsinks, None, None


_attention.defvjp(_attention_fwd_rule, _attention_bwd_rule, symbolic_zeros=True)


def attention(q, k, v, opts: Options, kv_lengths=None, sinks=None, segments=None):
    """(out, lse), differentiable in q, k, v and sinks (through out and lse), for validated
    arrays and options. `kv_lengths` (b,) int32 limits the keys of each batch row (portable
    path only: build `opts` with implementation "xla"); `sinks` None or (hq,) float32;
    `segments` None or a validated `Segments` (packed documents)."""
    return _attention(q, k, v, sinks, kv_lengths, segments, opts)


# ----------------------------------------------------------------------------- FP8 forward

FP8_NOT_DIFFERENTIABLE = (
    "FP8 attention is forward-only (issue 28: no FP8 backward yet), so it cannot be "
    "differentiated: jax.grad/jvp reached flash_attention's FP8 path through q, k, v, their "
    "descales or sinks (also through flash_attention_fp8's quantization of bf16/fp16/f32 "
    "inputs). Train with bf16/fp16 flash_attention and use FP8 for inference, or wrap the "
    "inputs in jax.lax.stop_gradient.")


@functools.partial(jax.custom_jvp, nondiff_argnums=(6, 7, 8))
def _attention_fp8(q, k, v, descales, sinks, segments, opts: Options, block_rows, out_dtype):
    # The kernel's calls partition through the sharding layer (batch, heads, sequence); the
    # portable FP8 path is plain XLA, which partitions it itself.
    if opts.implementation == "cuda" and _partitioned(q, k, None):
        b, hq, hkv = q.shape[0], q.shape[2], k.shape[2]
        return sharding.partitioned_attention_fwd_fp8(
            q, k, v, _core.kernel_descales(descales, b, hq, hkv), opts, out_dtype)
    return _core.attention_fwd_fp8(q, k, v, descales, opts, sinks=sinks, segments=segments,
                                   descale_block_rows=block_rows, out_dtype=out_dtype)


@_attention_fp8.defjvp
def _attention_fp8_jvp(opts, block_rows, out_dtype, primals, tangents):
    # Any derivative (not a silent zero or a straight-through one) is an error at trace time.
    raise NotImplementedError(FP8_NOT_DIFFERENTIABLE)


# ----------------------------------------------------------------------------- public API

def flash_attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, sinks=None, return_lse=False, deterministic=False,
                    implementation=None, q_segment_ids=None, kv_segment_ids=None,
                    q_positions=None, kv_positions=None, q_descale=None, k_descale=None,
                    v_descale=None, descale_block_rows=None, out_dtype=None):
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
      q_segment_ids, kv_segment_ids: packed documents (MaxText / splash-attention
        convention): (batch, seqlen_q) and (batch, seqlen_k) integer arrays (used as int32).
        Query i sees key j only when their ids are equal AND the band (causal/window) allows
        it. Id 0 is PADDING: a padding query row sees nothing (out 0, lse -inf or its sink,
        zero gradients), a padding key is seen by nobody. Only q_segment_ids: the keys have
        the same ids (needs seqlen_q == seqlen_k); only kv_segment_ids is an error. The
        portable path takes any ids. The kernels need each batch row to keep a contract:
        every nonzero id occupies ONE contiguous run and the nonzero ids increase along the
        row (1,1,2,2,0,0,3 is fine; 2,2,1 or 1,0,1 is not), and with positions these step by
        exactly 1 inside a run; a batch row that breaks it comes back NaN (out and lse) from
        the kernels, never silently wrong. Not differentiable.
      q_positions, kv_positions: optional (batch, seqlen) integer positions of each token in
        its document (only with segment ids), so that causal/window follow the documents:
        query i sees key j iff -left <= kv_positions[j] - q_positions[i] <= right (causal:
        kv_positions[j] <= q_positions[i]), with no seqlen_k - seqlen_q shift. Without them
        the band is the row-index one above. One side's positions alone stand for the
        other's when the sides share their ids (kv_segment_ids None or the same array).
        Positions saturate to +-(2**29 - 1).
      q_descale, k_descale, v_descale: FP8 only (q, k, v all float8_e4m3fn, e.g. from
        `jax_fa3.quantize_fp8`): float32 factors such that x = x_fp8 * x_descale (None = 1).
        Shapes: () per tensor; (batch, heads_kv) per batch row and kv head (FA3's rule, for
        all three); q_descale also (batch, heads_q) per query head; and with
        `descale_block_rows` r, per block of r consecutive tokens of one head: (batch,
        heads_kv, ceil(seqlen_k / r)) for k and v, (batch, heads_q or heads_kv,
        ceil(seqlen_q / r)) for q. Scores are (q_fp8 k_fp8ᵀ) * q_descale * k_descale *
        softmax_scale; the probabilities are rounded to e4m3 (scaled into [0, 256] first, as
        FA3 does) before P v. FP8 is FORWARD-ONLY: differentiating raises
        NotImplementedError. The FP8 kernel (head dims multiples of 16 up to 256) takes
        per-tensor and per-head descales, causal, windows, softcap, GQA, any seqlens; sharded
        inputs partition by batch, heads and sequence (the ring, with FP8 local calls). Per-block
        descales, sinks and segment ids run on the portable FP8 path, which emulates the
        kernel's numerics (with implementation=None; "cuda" raises naming them).
        `deterministic` (a backward option) has no effect.
      descale_block_rows: tokens per descale block, needed for 3-D (per-block) descales
        (quantize_fp8's `block_rows`).
      out_dtype: FP8 only: "bfloat16" (default) or "float16" (or those jnp dtypes).

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
    q, k, v = _validate.check_qkv(q, k, v, fp8=True)
    fp8 = _validate.check_fp8_args(q, k, q_descale, k_descale, v_descale, descale_block_rows,
                                   out_dtype)
    sinks = _validate.check_sinks(sinks, q.shape[2])
    segments = _validate.check_segments(q_segment_ids, kv_segment_ids, q_positions,
                                        kv_positions, q.shape, k.shape)
    # FP8 settles its implementation below; the options' own resolution is the bf16/fp16 one.
    opts = _core.flash_options(q, softmax_scale=softmax_scale, causal=causal,
                               window_size=window_size, softcap=softcap,
                               deterministic=deterministic,
                               implementation="xla" if fp8 is not None else implementation,
                               head_dim_v=v.shape[-1])
    return_lse = _validate.check_bool("return_lse", return_lse)
    segments = None if segments is None else Segments(*segments)
    # FP8 is forward-only and local: XLA partitions the portable FP8 path itself; the FP8
    # kernel's call has no sharding rule (XLA gathers sharded operands for it).
    if fp8 is not None:
        descales, block_rows, out_dtype = fp8
        unsupported = _core.fp8_unsupported(descales, block_rows, sinks, segments,
                                            opts.softmax_scale)
        opts = dataclasses.replace(opts, implementation=_core.resolve_fp8_implementation(
            implementation, q, v, unsupported))
        out, lse = _attention_fp8(q, k, v, descales, sinks, segments, opts, block_rows,
                                  out_dtype)
    else:
        out, lse = attention(q, k, v, opts, sinks=sinks, segments=segments)
    return (out, lse) if return_lse else out


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                           sinks=None, return_lse=False, deterministic=False,
                           implementation=None):
    """FlashAttention over variable-length sequences packed without padding (FlashAttention's
    varlen, the THD layout): sequence r is queries [cu_seqlens_q[r], cu_seqlens_q[r + 1]) and
    keys [cu_seqlens_k[r], cu_seqlens_k[r + 1]); no token sees another sequence's.

    Args:
      q: (total_q, heads_q, head_dim); k: (total_k, heads_kv, head_dim); v: (total_k,
        heads_kv, head_dim_v); dtypes and head dims as in `flash_attention`.
      cu_seqlens_q, cu_seqlens_k: (n + 1,) integer offsets (used as int32), non-decreasing
        from 0, one per sequence boundary (both of the same length n + 1). Tokens past the
        last offset are padding: their out is 0 (lse -inf, or the sink) and they get zero
        gradients. Traced offsets are not checked (the result is undefined for offsets that
        break these rules); concrete ones are, at trace time.
      max_seqlen_q, max_seqlen_k: static ints, upper bounds of the sequences' lengths, used
        for validation only (checked against concrete offsets; the kernels do not need them).
      causal, window_size: per sequence, bottom-right aligned as in `flash_attention`: within
        sequence r, query t sees key u iff -left <= (u - cu_k[r]) - (t - cu_q[r]) -
        (len_k[r] - len_q[r]) <= right.
      softmax_scale, softcap, sinks, deterministic, implementation: as in `flash_attention`.
      return_lse: also return the lse (heads_q, total_q) float32.

    Returns:
      out (total_q, heads_q, head_dim_v) in q's dtype, or (out, lse).

    It runs as one packed batch row with segment ids r + 1 and per-sequence positions
    (`jax_fa3.segments.varlen_segments`), on the kernel when it can run the call.
    """
    for name, x, seq in (("q", q, "total_q"), ("k", k, "total_k"), ("v", v, "total_k")):
        x = _validate.as_array(name, x)
        if x.ndim != 3:
            raise ValueError(f"{name} must have rank 3 ({seq}, heads, head_dim) in "
                             f"flash_attention_varlen, got shape {x.shape}")
    q, k, v = _validate.check_qkv(*(_validate.as_array(n, x)[None] for n, x in
                                    (("q", q), ("k", k), ("v", v))))
    cu_q, cu_k = _validate.check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                            max_seqlen_k, q.shape[1], k.shape[1])
    segments = varlen_segments(cu_q, cu_k, q.shape[1], k.shape[1])
    out, lse = flash_attention(
        q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
        softcap=softcap, sinks=sinks, return_lse=True, deterministic=deterministic,
        implementation=implementation, q_segment_ids=segments.q_ids,
        kv_segment_ids=segments.kv_ids, q_positions=segments.q_pos,
        kv_positions=segments.kv_pos)
    return (out[0], lse[0]) if _validate.check_bool("return_lse", return_lse) else out[0]
