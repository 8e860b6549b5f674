"""The only `jax.ffi.ffi_call` sites: the Hopper forward (bf16/fp16 and FP8) and backward kernels.

Each op has a batching rule (`custom_vmap`) that folds the mapped axis into the batch axis, so
`vmap` runs one kernel launch over the whole stack instead of a loop. Inputs follow the layout
of `cpp/include/fa3/params.h`: q/dq (b, sq, hq, d); k/dk (b, sk, hkv, d); v/dv (b, sk, hkv, dv);
out/dout (b, sq, hq, dv); lse (b, hq, sq) float32. Any head dims that are multiples of 8 up to
256 run on the smallest compiled kernel that holds them (jax_fa3/_ffi.py, kernel_head_dim).
Masks arrive normalised: causal is window_right == 0, -1 means unbounded.

Packed documents (segment ids, varlen) arrive as `bands`, the four int32 arrays of
cpp/include/fa3/params.h's DocBands that jax_fa3/segments.py builds: q_rows (b, sq, 2), the
[lo, hi) keys each query row may see; q_groups (b, ceil(sq / 64), 4), their (min lo, max lo,
min hi, max hi) per 64 rows; k_rows (b, sk, 2) and k_groups (b, ceil(sk / 64), 4), the same
for the query rows that see each key. The band (window) still applies on top.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap

from jax_fa3 import _ffi


def _fold_batch_rule(op, num_shared: int = 0):
    """Batching rule for an op whose every operand and result leads with the batch axis:
    (n, b, ...) -> (n * b, ...) on the way in, back on the way out. Unbatched operands are
    broadcast over n first. Calls `op` again, so nested vmaps fold repeatedly.

    The last `num_shared` operands (the per-head sinks) have no batch axis: unbatched, every
    element of the vmapped stack shares them; batched (their own sinks per element), the stack
    runs one element at a time (lax.map), since one launch takes one set of sinks."""

    def rule(axis_size, in_batched, *args):
        n_lead = len(args) - num_shared

        def stacked(arg, batched):
            return arg if batched else jnp.broadcast_to(arg, (axis_size, *arg.shape))

        if any(in_batched[n_lead:]):
            outs = jax.lax.map(lambda xs: op(*xs), tuple(map(stacked, args, in_batched)))
            return tuple(outs), (True,) * len(outs)
        lead = map(stacked, args[:n_lead], in_batched)
        outs = op(*(a.reshape((axis_size * a.shape[1], *a.shape[2:])) for a in lead),
                  *args[n_lead:])
        outs = tuple(o.reshape((axis_size, o.shape[0] // axis_size, *o.shape[1:])) for o in outs)
        return outs, (True,) * len(outs)

    op.def_vmap(rule)
    return op


def _options(softmax_scale: float, softcap: float, window_left: int, window_right: int) -> dict:
    return dict(softmax_scale=np.float32(softmax_scale), softcap=np.float32(softcap),
                window_left=np.int32(window_left), window_right=np.int32(window_right))


# The forward's third result: device memory for its dynamic tile schedule's counter (16 bytes,
# kFwdWorkspaceBytes in cpp/include/fa3/launch.h). A result rather than FFI scratch keeps the
# call command-buffer compatible; it is dropped here.
_FWD_WORKSPACE = jax.ShapeDtypeStruct((4,), jnp.int32)


def _no_sinks():
    """The sinks operand of a call without sinks: empty (the handler reads none)."""
    return jnp.zeros((0,), jnp.float32)


def _no_bands(b):
    """The bands operands of a call without documents: empty per batch row (the handler reads
    none), so that the batching rule folds them like any batched operand."""
    rows = jnp.zeros((b, 0, 2), jnp.int32)
    groups = jnp.zeros((b, 0, 4), jnp.int32)
    return rows, groups, rows, groups


def _fwd_call(target: str, q, v, out_dtype):
    """The ffi_call of a forward target for inputs like q (b, sq, hq, d) and v: its results are
    out (b, sq, hq, dv) in `out_dtype`, lse (b, hq, sq) float32 and the workspace."""
    b, sq, hq, _ = q.shape
    return jax.ffi.ffi_call(
        target,
        (jax.ShapeDtypeStruct((b, sq, hq, v.shape[-1]), out_dtype),
         jax.ShapeDtypeStruct((b, hq, sq), jnp.float32), _FWD_WORKSPACE),
        vmap_method="sequential",  # never reached: custom_vmap folds vmap into the batch axis
    )


def fwd(q, k, v, sinks=None, bands=None, *, softmax_scale: float, softcap: float, window_left: int,
        window_right: int):
    """Kernel forward: returns (out, lse); out (b, sq, hq, dv) takes v's head dim.

    `sinks`: None, or (hq,) float32 attention-sink logits, one per query head: a row's softmax
    denominator gains exp(sinks[h]) (in the units of the scaled scores) and its lse includes it.
    A row that sees no key then has out 0 and lse = sinks[h].

    `bands`: None, or the (q_rows, q_groups, k_rows, k_groups) of packed documents (module
    docstring); the forward reads the first two."""
    attrs = _options(softmax_scale, softcap, window_left, window_right)

    @custom_vmap
    def op(q, k, v, q_rows, q_groups, sinks):
        out, lse, _ = _fwd_call(_ffi.FWD_TARGET, q, v, q.dtype)(q, k, v, sinks, q_rows, q_groups,
                                                                **attrs)
        return out, lse

    sinks = _no_sinks() if sinks is None else sinks.astype(jnp.float32)
    q_rows, q_groups, _, _ = _no_bands(q.shape[0]) if bands is None else bands
    return _fold_batch_rule(op, num_shared=1)(q, k, v, q_rows, q_groups, sinks)


def fwd_fp8(q, k, v, q_descale, k_descale, v_descale, *, softmax_scale: float, softcap: float,
            window_left: int, window_right: int):
    """FP8 kernel forward: float8_e4m3fn q, k, v and float32 descales q_descale (b, hq),
    k_descale and v_descale (b, hkv) (x = x_fp8 * descale); returns (out, lse) with out
    (b, sq, hq, dv) bfloat16. No sinks, no documents, no per-block descales (jax_fa3/_core.py
    sends those to the portable FP8 path)."""
    attrs = _options(softmax_scale, softcap, window_left, window_right)

    @custom_vmap
    def op(q, k, v, q_descale, k_descale, v_descale):
        out, lse, _ = _fwd_call(_ffi.FWD_FP8_TARGET, q, v, jnp.bfloat16)(
            q, k, v, q_descale, k_descale, v_descale, **attrs)
        return out, lse

    return _fold_batch_rule(op)(q, k, v, q_descale, k_descale, v_descale)


def bwd(q, k, v, out, lse, dout, bands=None, *, softmax_scale: float, softcap: float, window_left: int,
        window_right: int, deterministic: bool, return_dpsum: bool = False):
    """Kernel backward: returns (dq, dk, dv) in the dtypes of (q, k, v), and with
    `return_dpsum` also D = rowsum(dout * out) (b, hq, sq) float32, the row sums the kernel
    computes anyway (the sinks' gradient is -sum over rows of exp(sinks - lse) * D).

    `lse` is the forward's (with the sinks in it, when there are sinks): the kernel needs no
    other sign of them. `bands`: as for `fwd` (all four arrays are read)."""
    attrs = _options(softmax_scale, softcap, window_left, window_right)

    @custom_vmap
    def op(q, k, v, out, lse, dout, q_rows, q_groups, k_rows, k_groups):
        b, sq, hq, _ = q.shape
        dpsum_shape = (b, hq, sq) if return_dpsum else (b, 0)  # (b, 0): not written
        call = jax.ffi.ffi_call(
            _ffi.BWD_TARGET,
            (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
             jax.ShapeDtypeStruct(v.shape, v.dtype),
             jax.ShapeDtypeStruct(dpsum_shape, jnp.float32)),
            vmap_method="sequential",  # never reached: custom_vmap folds vmap into the batch axis
        )
        return tuple(call(q, k, v, out, dout, lse, q_rows, q_groups, k_rows, k_groups,
                          deterministic=bool(deterministic), **attrs))

    bands = _no_bands(q.shape[0]) if bands is None else bands
    dq, dk, dv, dpsum = _fold_batch_rule(op)(q, k, v, out, lse, dout, *bands)
    return (dq, dk, dv, dpsum) if return_dpsum else (dq, dk, dv)
