"""The core of one attention call: its options record, whether the Hopper kernel can run it,
and the local forward/backward that dispatch to the kernel (jax_fa3/_ops.py) or the portable
path (jax_fa3/portable.py).

User input is validated once, at the public entry points (jax_fa3/attention.py,
jax_fa3/compat.py, jax_fa3/ring.py), which build an `Options` (`flash_options` for the
arguments flash_attention and ring_attention share); the local calls below trust it. Nothing
here has autodiff rules or knows about meshes: the public API's custom_vjp calls
`attention_fwd` / `attention_bwd` directly on one device, and through jax_fa3/sharding.py (one
local call per device, a ring over a sharded sequence) when the inputs may be partitioned.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jax_fa3 import _ffi, _masks, _ops, _validate, portable, portable_fp8, segments as _segments
from jax_fa3._masks import UNBOUNDED


@dataclasses.dataclass(frozen=True)
class Options:
    """Static options of one attention call, validated and normalised.

    The mask is the band (left, right) of jax_fa3/_masks.py. `implementation` is resolved for
    the forward: "cuda" (the kernel) or "xla" (the portable path); the backward takes the
    kernel when the forward did and a backward kernel is built for the call. Hashable: a
    nondiff argument of custom_vjp and a static closure of custom_partitioning."""
    softmax_scale: float
    softcap: float = 0.0
    left: int = UNBOUNDED
    right: int = UNBOUNDED
    deterministic: bool = False
    implementation: str = "xla"

    def with_band(self, left: int, right: int) -> "Options":
        """The same options on another band (ring attention's shifted chunks), clamped to what
        the kernels accept."""
        return dataclasses.replace(self, left=_masks.clamp(left), right=_masks.clamp(right))


def flash_options(q, *, softmax_scale, causal, window_size, softcap, deterministic,
                  implementation, head_dim_v=None) -> Options:
    """The Options of flash_attention's keyword arguments (shared by ring_attention),
    validated: errors name the argument. q is a validated (b, sq, hq, d) array, `head_dim_v`
    v's head dim (default q's). The default scale is 1/sqrt(d), q's head dim."""
    _validate.check_implementation(implementation)
    left, right = _masks.band(_validate.check_bool("causal", causal),
                              _validate.check_window(window_size))
    scale = _validate.check_softmax_scale(softmax_scale, q.shape[-1])
    return Options(softmax_scale=scale, softcap=_validate.check_softcap(softcap), left=left,
                   right=right, deterministic=_validate.check_bool("deterministic", deterministic),
                   implementation=resolve_implementation(
                       implementation, q, unsupported=scale_reasons(scale, "softmax_scale"),
                       head_dim_v=head_dim_v))


def scale_reasons(scale: float, name: str) -> list[str]:
    """The kernels take the scale into the exponent after masking, where a masked score times
    a zero scale is -inf * 0 = NaN: scale 0 (uniform weights) runs on the portable path."""
    return [f"the kernels cannot take {name}=0"] if scale == 0 else []


# ----------------------------------------------------------------------------- availability

def unavailable_reason(direction: str = "fwd", dtype=jnp.bfloat16, head_dim: int = 128,
                       head_dim_v: int | None = None) -> str | None:
    """None when the Hopper kernel for `direction` ('fwd' or 'bwd') can run inputs of this
    dtype and head dims (q/k's `head_dim`, v's `head_dim_v`, default the same) here;
    otherwise a sentence saying why. The first reason is the one that matters most: no build
    or no Hopper GPU, then what the kernels cannot take (dtype, a head dim that is not a
    multiple of 8 up to 256), then a build without a kernel head dim that holds these (a call
    runs on the smallest compiled head dim >= both)."""
    return (_ffi.extension_reason()
            or _validate.kernel_input_reason(dtype, head_dim, head_dim_v)
            or _ffi.compiled_reason(direction, dtype, head_dim, head_dim_v))


def kernel_available(direction: str = "fwd", dtype=jnp.bfloat16, head_dim: int = 128,
                     head_dim_v: int | None = None) -> bool:
    """True when the Hopper kernel for `direction` can run this dtype and head dims here."""
    return unavailable_reason(direction, dtype, head_dim, head_dim_v) is None


def require_kernel(dtype, head_dim: int, unsupported=(), head_dim_v: int | None = None) -> None:
    """Raise when implementation='cuda' cannot run a call: RuntimeError when the cause is this
    machine or build (no extension, no Hopper GPU, no kernel compiled that holds the dtype and
    head dims), ValueError when it is the input (dtype, head dims, or an option in
    `unsupported`, a list of sentences). Every reason is named, the machine's first."""
    machine = _ffi.extension_reason()
    inputs = [r for r in (_validate.kernel_input_reason(dtype, head_dim, head_dim_v),
                          *unsupported) if r]
    compiled = None if machine or inputs else _ffi.compiled_reason("fwd", dtype, head_dim,
                                                                   head_dim_v)
    reasons = [r for r in (machine, *inputs, compiled) if r]
    if not reasons:
        return
    error = ValueError if inputs and not machine else RuntimeError
    raise error(f"implementation='cuda' cannot run this call: {'; '.join(reasons)}. "
                f"Use implementation=None to fall back to the portable path.")


def resolve_implementation(implementation, q, direction: str = "fwd", unsupported=(),
                           head_dim_v: int | None = None) -> str:
    """'cuda' (the kernel) or 'xla' (the portable path) for inputs like q (and a v of head
    dim `head_dim_v`, default q's).

    `unsupported`: sentences naming options of the call the kernels cannot take. For the
    forward, implementation='cuda' raises when the kernel cannot run (see `require_kernel`).
    For the backward an unavailable kernel means the portable path (a build may hold forward
    kernels only)."""
    if implementation == "xla":
        return "xla"
    if implementation == "cuda" and direction == "fwd":
        require_kernel(q.dtype, q.shape[-1], unsupported, head_dim_v)
        return "cuda"
    if unsupported or unavailable_reason(direction, q.dtype, q.shape[-1], head_dim_v) is not None:
        return "xla"
    return "cuda"


def _backward_on_kernel(q, v, opts: Options, dlse, segments=None) -> bool:
    """The kernel backward runs when the forward ran on the kernel, a backward kernel is built
    for the call, and there is no LSE cotangent (only the portable backward takes one); with
    segments, not deterministic (the deterministic kernel backward takes no document bands)."""
    return (opts.implementation == "cuda" and dlse is None
            and not (segments is not None and opts.deterministic)
            and unavailable_reason("bwd", q.dtype, q.shape[-1], v.shape[-1]) is None)


# ----------------------------------------------------------------------------- local calls

def is_empty(q, k) -> bool:
    """Nothing to compute: no batch row, query row, head or key."""
    return 0 in q.shape or 0 in k.shape


def _on_kernel(q, k, kv_lengths) -> bool:
    """Calls the kernel can take once the implementation is 'cuda': no per-batch key lengths,
    and something to compute (an empty call has the portable path's trivial result)."""
    return kv_lengths is None and not is_empty(q, k)


def attention_fwd(q, k, v, opts: Options, sinks=None, kv_lengths=None, segments=None):
    """(out, lse) of attention on local arrays, without autodiff rules.

    q (b, sq, hq, d); k (b, sk, hkv, d); v (b, sk, hkv, dv); out (b, sq, hq, dv) in q's
    dtype; lse (b, hq, sq) float32 (natural log; -inf where a query row sees no key, whose
    out is 0). `sinks` None or (hq,) float32 attention-sink logits: each row's softmax
    denominator gains exp(sinks[h]), lse includes it (a row that sees no key: lse sinks[h]).
    `kv_lengths` (b,) int32 (the number of valid keys per batch row) runs the portable path.
    `segments` None or a `jax_fa3.segments.Segments` (packed documents, id 0 = padding): on
    the kernel they become document bands (`segments.kernel_bands`; a batch row that breaks
    the kernel contract gets NaN), on the portable path the exact equality rule.
    An empty call (seqlen_q, seqlen_k or batch 0) needs no kernel: out 0, lse -inf (or the
    sink), gradients 0, whatever the implementation."""
    if opts.implementation == "cuda" and _on_kernel(q, k, kv_lengths):
        bands, left, right = _kernel_bands(segments, opts, q, k)
        return _ops.fwd(q, k, v, sinks, bands, softmax_scale=opts.softmax_scale,
                        softcap=opts.softcap, window_left=left, window_right=right)
    return portable.forward(q, k, v, sinks, softmax_scale=opts.softmax_scale,
                            softcap=opts.softcap, left=opts.left, right=opts.right,
                            kv_lengths=kv_lengths, segments=segments)


def _kernel_bands(segments, opts: Options, q, k):
    """(bands, left, right) for the kernels: no bands and the options' band without
    segments; with them, `segments.kernel_bands` (unbounded band with positions)."""
    if segments is None:
        return None, opts.left, opts.right
    return _segments.kernel_bands(segments, opts.left, opts.right, q.shape[1], k.shape[1])


def attention_bwd(q, k, v, out, lse, dout, opts: Options, dlse=None, sinks=None,
                  kv_lengths=None, segments=None):
    """(dq, dk, dv, dsinks): dq, dk, dv in the dtypes of q, k, v, and the float32 (hq,)
    gradient of `sinks` (None without sinks), without autodiff rules.

    The FlashAttention backward: P = exp(S - lse), D = rowsum(dout * out), dS = P * (dP - D).
    Given the FINAL out/lse of a merged attention (ring chunks) it returns the exact partial
    gradients of this chunk's q, k, v; lse includes the sinks, so dq, dk, dv need nothing
    else of them, and dsinks comes from lse and D (`portable.sinks_grad`). `dlse` is an
    optional LSE cotangent (b, hq, sq), taken by the portable backward; `deterministic`
    orders the kernel's dQ accumulation (the portable backward always is deterministic).
    `segments` as for `attention_fwd` (padding rows and keys get zero gradients); with
    `deterministic` they take the portable backward (the deterministic kernel backward takes
    no document bands)."""
    with_d = sinks is not None
    if _on_kernel(q, k, kv_lengths) and _backward_on_kernel(q, v, opts, dlse, segments):
        bands, left, right = _kernel_bands(segments, opts, q, k)
        grads = _ops.bwd(q, k, v, out, lse, dout, bands, softmax_scale=opts.softmax_scale,
                         softcap=opts.softcap, window_left=left, window_right=right,
                         deterministic=opts.deterministic, return_dpsum=with_d)
    else:
        grads = portable.backward(q, k, v, out, lse, dout, softmax_scale=opts.softmax_scale,
                                  softcap=opts.softcap, left=opts.left, right=opts.right,
                                  kv_lengths=kv_lengths, segments=segments, dlse=dlse,
                                  return_dpsum=with_d)
    if not with_d:
        return (*grads, None)
    dq, dk, dv, dpsum = grads
    return dq, dk, dv, portable.sinks_grad(sinks, lse, dpsum, dlse)


# ----------------------------------------------------------------------------- FP8 forward

def fp8_unsupported(descales, descale_block_rows, sinks, segments, softmax_scale) -> list[str]:
    """Sentences naming what of an FP8 call the FP8 kernel cannot take (empty: it can)."""
    reasons = scale_reasons(softmax_scale, "softmax_scale")
    if descale_block_rows is not None and any(d is not None and d.ndim == 3 for d in descales):
        reasons.append("the FP8 kernel takes per-tensor or per-head descales, not per-block ones "
                       "(descale_block_rows)")
    if sinks is not None:
        reasons.append("the FP8 kernel takes no attention sinks")
    if segments is not None:
        reasons.append("the FP8 kernel takes no segment ids or positions (packed documents)")
    return reasons


def resolve_fp8_implementation(implementation, q, v, unsupported=()) -> str:
    """'cuda' (the FP8 kernel) or 'xla' (the portable FP8 emulation, jax_fa3/portable_fp8.py;
    never the bf16/fp16 kernels, whose numerics differ) for float8_e4m3fn q and v.
    "cuda" takes the kernel or raises saying why it cannot (`unsupported`: `fp8_unsupported`).
    None takes the kernel where it can run the call, as `resolve_implementation` does for the
    other dtypes (sharded calls partition through jax_fa3/sharding.py,
    `partitioned_attention_fwd_fp8`)."""
    _validate.check_implementation(implementation)
    return resolve_implementation(implementation, q, unsupported=unsupported,
                                  head_dim_v=v.shape[-1])


def kernel_descales(descales, b, hq, hkv):
    """The FP8 kernel's descale operands, float32: q (b, hq), k and v (b, hkv) (None is 1, a
    per-tensor one broadcast, a q descale per kv head repeated over its query heads)."""
    g = hq // hkv
    return tuple(jnp.broadcast_to(portable_fp8.descale_rows(x, b, hkv, n, 1, None),
                                  (b, hkv, n, 1)).reshape(b, hkv * n)
                 for x, n in zip(descales, (g, 1, 1)))


def attention_fwd_fp8(q, k, v, descales, opts: Options, sinks=None, segments=None,
                      descale_block_rows=None, out_dtype=jnp.bfloat16):
    """(out, lse) of FP8 attention on local arrays: float8_e4m3fn q, k, v with their validated
    descales (None = 1), out in `out_dtype`, lse float32. On the FP8 kernel when
    `opts.implementation` is "cuda" (its bfloat16 out converted to float16 when asked), else
    on jax_fa3/portable_fp8.py, which emulates the kernel's numerics."""
    if opts.implementation == "cuda" and not is_empty(q, k):
        b, hq, hkv = q.shape[0], q.shape[2], k.shape[2]
        out, lse = _ops.fwd_fp8(q, k, v, *kernel_descales(descales, b, hq, hkv),
                                softmax_scale=opts.softmax_scale, softcap=opts.softcap,
                                window_left=opts.left, window_right=opts.right)
        return out.astype(out_dtype), lse
    return portable_fp8.forward(q, k, v, descales, sinks, softmax_scale=opts.softmax_scale,
                                softcap=opts.softcap, left=opts.left, right=opts.right,
                                segments=segments, descale_block_rows=descale_block_rows,
                                out_dtype=out_dtype)
