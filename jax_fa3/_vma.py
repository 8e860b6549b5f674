"""Varying-manual-axes typing inside `shard_map` (check_vma): a zeros-initialised scan carry
must be marked as varying over the same mesh axes as the values that update it."""

from __future__ import annotations

import jax
from jax import lax


def vma(x) -> frozenset:
    """Manual mesh axes over which x varies (empty outside shard_map or with check_vma off).
    JAX 0.10 calls it manual_axis_type.varying, JAX 0.7-0.9 `vma`."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(mat.varying) if mat is not None else frozenset(getattr(aval, "vma", ()))


def varying_like(x, *refs):
    """x marked as varying over the manual mesh axes the refs vary over."""
    axes = tuple(sorted(frozenset().union(*map(vma, refs)) - vma(x), key=str))
    if not axes:
        return x
    if hasattr(lax, "pcast"):
        return lax.pcast(x, axes, to="varying")
    return lax.pvary(x, axes)  # JAX < 0.8


def sum_like(ct, primal):
    """A cotangent summed over the manual mesh axes it varies over and its primal does not:
    the transpose of the implicit broadcast of an invariant value (shared sinks, say) into
    per-device work, so that a custom_vjp rule returns the type of its primal."""
    axes = tuple(sorted(vma(ct) - vma(primal), key=str))
    return lax.psum(ct, axes) if axes else ct
