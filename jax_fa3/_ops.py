"""The only `jax.ffi.ffi_call` sites: the Hopper forward and backward kernels.

Each op has a batching rule (`custom_vmap`) that folds the mapped axis into the batch axis, so
`vmap` runs one kernel launch over the whole stack instead of a loop. Inputs follow the layout
of `jax_fa3.params.h`: q/out/dout (b, sq, hq, d); k/v (b, sk, hkv, d); lse (b, hq, sq) float32.
Masks arrive normalised: causal is window_right == 0, -1 means unbounded.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap

from jax_fa3 import _ffi


def _fold_batch_rule(op):
    """Batching rule for an op whose every operand and result leads with the batch axis:
    (n, b, ...) -> (n * b, ...) on the way in, back on the way out. Unbatched operands are
    broadcast over n first. Calls `op` again, so nested vmaps fold repeatedly."""

    def rule(axis_size, in_batched, *args):
        flat = []
        for arg, batched in zip(args, in_batched):
            if not batched:
                arg = jnp.broadcast_to(arg, (axis_size, *arg.shape))
            flat.append(arg.reshape((axis_size * arg.shape[1], *arg.shape[2:])))
        outs = op(*flat)
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


def fwd(q, k, v, *, softmax_scale: float, softcap: float, window_left: int, window_right: int):
    """Kernel forward: returns (out, lse)."""
    attrs = _options(softmax_scale, softcap, window_left, window_right)

    @custom_vmap
    def op(q, k, v):
        b, sq, hq, _ = q.shape
        call = jax.ffi.ffi_call(
            _ffi.FWD_TARGET,
            (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, hq, sq), jnp.float32),
             _FWD_WORKSPACE),
            vmap_method="sequential",  # never reached: custom_vmap folds vmap into the batch axis
        )
        out, lse, _ = call(q, k, v, **attrs)
        return out, lse

    return _fold_batch_rule(op)(q, k, v)


def bwd(q, k, v, out, lse, dout, *, softmax_scale: float, softcap: float, window_left: int,
        window_right: int, deterministic: bool):
    """Kernel backward: returns (dq, dk, dv) in the dtypes of (q, k, v)."""
    attrs = _options(softmax_scale, softcap, window_left, window_right)

    @custom_vmap
    def op(q, k, v, out, lse, dout):
        call = jax.ffi.ffi_call(
            _ffi.BWD_TARGET,
            (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
             jax.ShapeDtypeStruct(v.shape, v.dtype)),
            vmap_method="sequential",  # never reached: custom_vmap folds vmap into the batch axis
        )
        return tuple(call(q, k, v, out, dout, lse, deterministic=bool(deterministic), **attrs))

    return _fold_batch_rule(op)(q, k, v, out, lse, dout)
