"""Sharding rules for the attention calls, and context parallelism over a Mesh.

`partitioned_attention_fwd` / `partitioned_attention_bwd` have the signatures of
`jax_fa3._core.attention_fwd` / `attention_bwd` and run them as ONE local call per device
when the inputs are sharded under `jax.jit`:

  * batch and heads shard freely; with GQA the kv heads follow the query heads (a query-head
    sharding finer than heads_kv keeps one kv head per device, and the backward sums dK/dV
    over the devices that share it); head_dim is never split;
  * out and dq come back with the query's sharding, lse (b, hq, sq) with the matching one;
  * attention sinks (hq,) follow the query's head sharding; their gradient is formed from
    the global lse and D = rowsum(dout * out) outside the local calls (XLA partitions it);
  * v's head dim may differ from q's (it is never split either);
  * packed sequences (a `jax_fa3.segments.Segments`: segment ids and optional positions,
    (b, sq) / (b, sk)) follow the batch and sequence axes of q / k and are replicated over
    heads; each device's call gets the ids (and positions) of its own tokens;
  * a sharded sequence axis becomes ring attention (jax_fa3.ring, contiguous layout) over
    that mesh axis;
  * the FP8 kernel's forward (`partitioned_attention_fwd_fp8`) shards the same way, its
    descales with the batch and the heads they scale (a sharded sequence: the ring, with FP8
    local calls).

`jax_fa3.flash_attention` calls these two when its inputs may be partitioned
(`may_partition`: more than one device and not inside a shard_map over every mesh axis), so
the public API partitions this way under jit; on one device it calls the core directly. The
automatic sequence route keeps the natural token order, so a causal mask loads the last
device most; for balanced causal work, permute tokens with
`jax_fa3.ring.zigzag_permute` and call `context_parallel_attention(..., layout="zigzag")`.

How: with mesh axes of type Auto (and no sharding in the types) through
`jax.experimental.custom_partitioning` with a Shardy `sharding_rule` plus the GSPMD callbacks;
with Explicit axes the shardings are known while tracing, so the same plan runs in a
`jax.shard_map`. Inside a `shard_map` over all axes the call is simply local. Every decision
lives in `plan_shardings`, a pure function tested on its own, because custom_partitioning
hides Python errors raised in its callbacks.

`context_parallel_attention` is the explicit entry for sequence-sharded global arrays: it runs
`jax_fa3.ring.ring_attention` in a shard_map, with the zig-zag layout or the all-gather
strategy on request.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jax_fa3 import _core, _validate, portable, ring
from jax_fa3._core import Options
from jax_fa3._ops import _fold_batch_rule
from jax_fa3.segments import Segments

__all__ = ["context_parallel_attention", "partitioned_attention_fwd", "partitioned_attention_bwd",
           "partitioned_attention_fwd_fp8",
           "may_partition", "plan_shardings", "AttentionShardings"]

Axes = tuple  # a tuple of mesh axis names sharding one array dimension


# ----------------------------------------------------------------------------- the plan

def _axes(entry) -> Axes:
    """A PartitionSpec entry (None, a name, or a tuple of names) as a tuple of names."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _entry(axes: Axes):
    """Inverse of `_axes`, in the shortest PartitionSpec spelling."""
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def _size(mesh_shape, axes: Axes) -> int:
    return math.prod(mesh_shape[a] for a in axes)


@dataclasses.dataclass(frozen=True)
class AttentionShardings:
    """Mesh axes chosen for each factor of one attention call.

    batch / seq / heads shard q, out, dq and lse. kv_heads (a prefix of heads) shards the
    heads of k, v, dk, dv; over the remaining head axes (kv_shared) k/v are replicated, each
    device picks the one kv head its query heads read, and dK/dV are summed over them."""
    batch: Axes = ()
    seq: Axes = ()
    heads: Axes = ()
    kv_heads: Axes = ()

    @property
    def kv_shared(self) -> Axes:
        return self.heads[len(self.kv_heads):]

    @property
    def q(self) -> P:  # also out, dout, dq
        return P(_entry(self.batch), _entry(self.seq), _entry(self.heads), None)

    @property
    def kv(self) -> P:  # also dk, dv
        return P(_entry(self.batch), _entry(self.seq), _entry(self.kv_heads), None)

    @property
    def lse(self) -> P:
        return P(_entry(self.batch), _entry(self.heads), _entry(self.seq))

    @property
    def sinks(self) -> P:  # (hq,): the query heads' sharding
        return P(_entry(self.heads))

    @property
    def tokens(self) -> P:  # (b, s): segment ids and positions, of queries or of keys
        return P(_entry(self.batch), _entry(self.seq))


def _head_axes(mesh_shape, axes: Axes, heads_q: int, heads_kv: int) -> tuple[Axes, Axes]:
    """(query-head axes, kv-head axes): the longest usable prefix of the query's head axes.

    Device t of P holds query heads [t*hq/P, (t+1)*hq/P). K/V are sharded by the longest
    prefix whose size divides heads_kv; if that is not all of the axes, the device's query
    heads must fall in ONE kv group (hq/P divides the group size hq/hkv) so that it can take
    that kv head from its replicated block."""
    group = heads_q // heads_kv
    for n in range(len(axes), -1, -1):
        heads = axes[:n]
        size = _size(mesh_shape, heads)
        if heads_q % size:
            continue
        kv = heads
        while heads_kv % _size(mesh_shape, kv):
            kv = kv[:-1]
        if kv == heads or group % (heads_q // size) == 0:
            return heads, kv
    return (), ()


def plan_shardings(mesh_shape: dict, q_spec, q_shape, k_shape) -> AttentionShardings:
    """The shardings of one attention call, decided from the query's PartitionSpec.

    mesh_shape: {axis name: size}; q_shape (b, sq, hq, d); k_shape (b, sk, hkv, d) (v's
    head dim plays no part). The query is the authority (outputs come back with its
    sharding); k/v are resharded to match. Head dims are never sharded. A sequence sharding
    is kept only if it also divides seq_k."""
    spec = tuple(q_spec) + (None,) * (4 - len(tuple(q_spec)))
    batch, seq, heads = _axes(spec[0]), _axes(spec[1]), _axes(spec[2])
    if k_shape[1] % _size(mesh_shape, seq):
        seq = ()
    heads, kv_heads = _head_axes(mesh_shape, heads, q_shape[2], k_shape[2])
    return AttentionShardings(batch=batch, seq=seq, heads=heads, kv_heads=kv_heads)


# ----------------------------------------------------------------------------- local bodies

def _ring(axes: Axes) -> ring.Ring:
    """A sequence sharded over `axes` is contiguous: the ring of that layout."""
    return ring.Ring(axis_name=axes[0] if len(axes) == 1 else tuple(axes), layout="contiguous")


def _kv_head_index(plan: AttentionShardings, heads_kv_local: int):
    """Which local kv head this device's query heads read, when k/v are replicated over
    plan.kv_shared (device r of those Pr devices holds query heads of kv head r*hk/Pr)."""
    shared = plan.kv_shared
    return lax.axis_index(shared) * heads_kv_local // lax.axis_size(shared)


def _own_kv_head(plan: AttentionShardings, k, v, *per_head):
    """With k/v replicated over plan.kv_shared: (i, k, v, *per_head) cut to kv head i, the one
    this device's query heads read (k, v along axis 2; `per_head`, e.g. descales (b, hkv),
    along axis 1); otherwise (None, k, v, *per_head) as they are."""
    if not plan.kv_shared:
        return (None, k, v) + per_head
    i = _kv_head_index(plan, k.shape[2])
    cut = lambda x, axis: lax.dynamic_slice_in_dim(x, i, 1, axis=axis)
    return (i, cut(k, 2), cut(v, 2)) + tuple(cut(x, 1) for x in per_head)


# Packed sequences cross the custom_partitioning and shard_map boundaries as plain operands:
# the fields of a Segments that are not None, in order, and a static tuple of which fields
# they are ("layout"), from which the local bodies rebuild the record.

def _segment_layout(segments) -> tuple[bool, ...]:
    """Which fields of `segments` (q_ids, kv_ids, q_pos, kv_pos) are arrays; () for None."""
    return () if segments is None else tuple(x is not None for x in segments)


def _segment_operands(segments) -> tuple:
    return () if segments is None else tuple(x for x in segments if x is not None)


def _segments_of(layout: tuple[bool, ...], operands):
    """Inverse of `_segment_operands` for a `_segment_layout`."""
    if not layout:
        return None
    it = iter(operands)
    return Segments(*(next(it) if present else None for present in layout))


def _segment_specs(plan: "AttentionShardings", layout: tuple[bool, ...]) -> tuple:
    """Specs of the segment operands: the tokens' batch and sequence axes, on either side."""
    return (plan.tokens,) * sum(layout)


def _local_fwd(opts: Options, plan: AttentionShardings, layout, q, k, v, *rest):
    """Per-device forward on local shards (a ring over the sequence axes if sharded). `rest`:
    the segment operands of `layout`, then this device's query heads' sinks (if any)."""
    n = sum(layout)
    segments = _segments_of(layout, rest[:n])
    sinks = rest[n] if len(rest) > n else None
    _, k, v = _own_kv_head(plan, k, v)
    if plan.seq:
        return ring.ring_attention_fwd(q, k, v, opts, _ring(plan.seq), sinks=sinks,
                                       segments=segments)
    return _core.attention_fwd(q, k, v, opts, sinks=sinks, segments=segments)


def _local_bwd(opts: Options, plan: AttentionShardings, layout, with_dlse: bool, q, k, v, out,
               lse, dout, *rest):
    """Per-device backward. `rest`: the LSE cotangent (sharded like lse) when `with_dlse`,
    then the segment operands of `layout`. dK/dV partials are summed over devices sharing a
    kv head."""
    dlse = rest[0] if with_dlse else None
    segments = _segments_of(layout, rest[int(with_dlse):])
    k_all, v_all = k, v
    i, k, v = _own_kv_head(plan, k, v)
    if plan.seq:
        dq, dk, dv = ring.ring_attention_bwd(q, k, v, out, lse, dout, opts, _ring(plan.seq),
                                             dlse=dlse, segments=segments)
    else:
        dq, dk, dv, _ = _core.attention_bwd(q, k, v, out, lse, dout, opts, dlse=dlse,
                                            segments=segments)
    if plan.kv_shared:
        def gather(d, full):  # put this device's kv-head gradient in place, sum over sharers
            d = lax.dynamic_update_slice_in_dim(jnp.zeros(full.shape, jnp.float32),
                                                d.astype(jnp.float32), i, axis=2)
            return lax.psum(d, plan.kv_shared).astype(full.dtype)
        dk, dv = gather(dk, k_all), gather(dv, v_all)
    return dq, dk, dv


# ----------------------------------------------------------------------------- custom_partitioning

def _sharding_rule(q_shape, k_shape, backward: bool, with_dlse: bool = False,
                   with_sinks: bool = False, v_shape=None,
                   segment_layout: tuple[bool, ...] = (), fp8: bool = False) -> tuple[str, dict]:
    """Shardy rule: batch b, seq s (t for keys if the lengths differ), query heads h, kv heads
    k, head dims d (q, k) and e (v, out; d again when they are equal) never sharded; the
    forward's sinks (h); segment ids and positions "b s" (queries') or "b t" (keys'), after
    the other operands (before the sinks). `fp8`: the FP8 kernel's forward, whose operands end
    with the descales "b h" (q) and "b k" (k, v).

    Query and kv heads are separate factors rather than the compound "(k g)": when the
    query-head sharding is finer than heads_kv, Shardy would split the mesh axis into
    sub-axes for k, which custom_partitioning cannot decode into a NamedSharding (it fails
    before our callback runs). `plan_shardings` keeps the two consistent instead."""
    hk = "h" if q_shape[2] == k_shape[2] else "k"
    t = "s" if q_shape[1] == k_shape[1] else "t"
    e = "d" if v_shape is None or v_shape[3] == q_shape[3] else "e"
    q, kv, lse = "b s h d", f"b {t} {hk} d", "b h s"
    o, vv = f"b s h {e}", f"b {t} {hk} {e}"
    sides = ("b s", f"b {t}", "b s", f"b {t}")  # q_ids, kv_ids, q_pos, kv_pos
    seg = "".join(f", {side}" for side, present in zip(sides, segment_layout) if present)
    if backward:
        dlse = f", {lse}" if with_dlse else ""
        rule = f"{q}, {kv}, {vv}, {o}, {lse}, {o}{dlse}{seg} -> {q}, {kv}, {vv}"
    else:
        sinks = ", h" if with_sinks else ""
        descales = f", b h, b {hk}, b {hk}" if fp8 else ""
        rule = f"{q}, {kv}, {vv}{seg}{sinks}{descales} -> {o}, {lse}"
    return rule, dict(need_replication_factors=tuple(dict.fromkeys(("d", e))))


def _mesh_shape(mesh) -> dict:
    return dict(zip(mesh.axis_names, mesh.axis_sizes))


def _spec_of(sharding) -> Sequence:
    """PartitionSpec of a callback's argument sharding (replicated if it has none)."""
    return sharding.spec if isinstance(sharding, NamedSharding) else P()


def _callback_plan(mesh, arg_shapes) -> AttentionShardings:
    q, k = arg_shapes[0], arg_shapes[1]
    return plan_shardings(_mesh_shape(mesh), _spec_of(q.sharding), q.shape, k.shape)


def _named(mesh, specs):
    return tuple(NamedSharding(mesh, s) for s in specs)


def _no_consts(body, *static):
    """`body(*static, *args)` as a jitted function: custom_partitioning traces its callable
    and refuses one that closes over constant arrays (an assertion, not a message), which a
    local body may well do (a numpy mask, a jnp.array of literals); inside a jit the
    constants stay in the inner function."""
    return jax.jit(functools.partial(body, *static))


def _cp_forward(local, opts: Options, static, in_specs, rule_and_kwargs):
    """custom_partitioning of a forward body `local(opts, plan, static, *operands)` that
    returns (out, lse) with the query's sharding; `in_specs(plan)`: the operands' specs."""

    @custom_partitioning
    def op(*args):
        return _no_consts(local, opts, AttentionShardings(), static)(*args)

    def infer(mesh, arg_shapes, result_shape):
        plan = _callback_plan(mesh, arg_shapes)
        return _named(mesh, (plan.q, plan.lse))

    def partition(mesh, arg_shapes, result_shape):
        plan = _callback_plan(mesh, arg_shapes)
        lower = lambda *args: local(opts, plan, static, *args)
        return mesh, lower, _named(mesh, (plan.q, plan.lse)), _named(mesh, in_specs(plan))

    rule, kwargs = rule_and_kwargs
    op.def_partition(partition, infer_sharding_from_operands=infer, sharding_rule=rule, **kwargs)
    return op


def _cp_fwd(opts: Options, q_shape, k_shape, v_shape, with_sinks: bool, layout=()):
    """custom_partitioning forward for one set of static options (operands q, k, v, the
    segment operands of `layout` and, when with_sinks, the sinks)."""
    return _cp_forward(_local_fwd, opts, layout,
                       lambda plan: _fwd_in_specs(plan, with_sinks, layout),
                       _sharding_rule(q_shape, k_shape, backward=False, with_sinks=with_sinks,
                                      v_shape=v_shape, segment_layout=layout))


def _fwd_in_specs(plan: AttentionShardings, with_sinks: bool, layout=()):
    """Specs of (q, k, v, segment operands...[, sinks])."""
    return ((plan.q, plan.kv, plan.kv) + _segment_specs(plan, layout)
            + ((plan.sinks,) if with_sinks else ()))


def _cp_bwd(opts: Options, q_shape, k_shape, v_shape, with_dlse: bool, layout=()):
    """custom_partitioning backward for one set of static options (operands q, k, v, out,
    lse, dout, when with_dlse the LSE cotangent, then the segment operands of `layout`)."""

    @custom_partitioning
    def op(*args):
        return _no_consts(_local_bwd, opts, AttentionShardings(), layout, with_dlse)(*args)

    def infer(mesh, arg_shapes, result_shape):
        plan = _callback_plan(mesh, arg_shapes)
        return _named(mesh, (plan.q, plan.kv, plan.kv))

    def partition(mesh, arg_shapes, result_shape):
        plan = _callback_plan(mesh, arg_shapes)
        lower = lambda *args: _local_bwd(opts, plan, layout, with_dlse, *args)
        return (mesh, lower, _named(mesh, (plan.q, plan.kv, plan.kv)),
                _named(mesh, _bwd_in_specs(plan, with_dlse, layout)))

    rule, kwargs = _sharding_rule(q_shape, k_shape, backward=True, with_dlse=with_dlse,
                                  v_shape=v_shape, segment_layout=layout)
    op.def_partition(partition, infer_sharding_from_operands=infer, sharding_rule=rule, **kwargs)
    return op


def _bwd_in_specs(plan: AttentionShardings, with_dlse: bool, layout=()):
    """Specs of (q, k, v, out, lse, dout[, dlse], segment operands...)."""
    return ((plan.q, plan.kv, plan.kv, plan.q, plan.lse, plan.q)
            + ((plan.lse,) if with_dlse else ()) + _segment_specs(plan, layout))


def _local_fwd_fp8(opts: Options, plan: AttentionShardings, out_dtype, q, k, v, q_descale,
                   k_descale, v_descale):
    """Per-device FP8 forward: the device's kv head picked as in `_local_fwd`, with its k/v
    descales; a sharded sequence runs the ring with FP8 local calls (the descales belong to
    heads, so they stay while k and v travel; each call's bf16 out is merged in float32)."""
    _, k, v, k_descale, v_descale = _own_kv_head(plan, k, v, k_descale, v_descale)
    descales = (q_descale, k_descale, v_descale)
    if plan.seq:
        local = lambda q, k, v, opts, segments: _core.attention_fwd_fp8(q, k, v, descales, opts)
        return ring.ring_attention_fwd(q, k, v, opts, _ring(plan.seq), local_fwd=local,
                                       out_dtype=out_dtype)
    return _core.attention_fwd_fp8(q, k, v, descales, opts, out_dtype=out_dtype)


def _fp8_in_specs(plan: AttentionShardings):
    """Specs of (q, k, v, q_descale (b, hq), k_descale, v_descale (b, hkv))."""
    descale_q = P(_entry(plan.batch), _entry(plan.heads))
    descale_kv = P(_entry(plan.batch), _entry(plan.kv_heads))
    return (plan.q, plan.kv, plan.kv, descale_q, descale_kv, descale_kv)


def _cp_fwd_fp8(opts: Options, out_dtype, q_shape, k_shape, v_shape):
    """custom_partitioning of the FP8 forward (operands q, k, v and the kernel's descales)."""
    return _cp_forward(_local_fwd_fp8, opts, out_dtype, _fp8_in_specs,
                       _sharding_rule(q_shape, k_shape, backward=False, v_shape=v_shape, fp8=True))


# ----------------------------------------------------------------------------- explicit axes

def _explicit_mesh(x):
    """The abstract mesh when x's type carries Explicit mesh axes (sharding in types)."""
    mesh = jax.typeof(x).sharding.mesh
    return mesh if (not mesh.empty and mesh.explicit_axes) else None


def _shard_map_call(mesh, body, plan: AttentionShardings, args, in_specs, out_specs):
    """Run `body(plan, *local args)` in a shard_map over the Explicit axes of `mesh`."""
    args = [jax.sharding.reshard(a, NamedSharding(mesh, s)) for a, s in zip(args, in_specs)]
    fn = jax.shard_map(lambda *xs: body(plan, *xs), mesh=mesh, in_specs=tuple(in_specs),
                       out_specs=tuple(out_specs), axis_names=set(mesh.explicit_axes),
                       check_vma=False)
    return fn(*args)


def _explicit_plan(mesh, q, k) -> AttentionShardings:
    sizes = {a: mesh.shape[a] for a in mesh.explicit_axes}
    spec = tuple(jax.typeof(q).sharding.spec)
    spec = tuple(_entry(tuple(a for a in _axes(e) if a in sizes)) for e in spec)
    return plan_shardings(sizes, spec, q.shape, k.shape)


# ----------------------------------------------------------------------------- public wrappers

def may_partition() -> bool:
    """Whether an attention call traced now may run on sharded inputs: False with one device,
    and inside a shard_map over every mesh axis (the arrays there are local shards)."""
    if jax.device_count() == 1:
        return False
    mesh = jax.sharding.get_abstract_mesh()
    return mesh.empty or any(t != AxisType.Manual for t in mesh.axis_types)


def partitioned_attention_fwd(q, k, v, opts: Options, sinks=None, segments=None):
    """`jax_fa3._core.attention_fwd` that partitions as one local call per device;
    `segments` (a `jax_fa3.segments.Segments` or None) follows the tokens."""
    layout = _segment_layout(segments)
    args = (q, k, v) + _segment_operands(segments) + (() if sinks is None else (sinks,))
    with_sinks = sinks is not None
    mesh = _explicit_mesh(q)
    if mesh is not None:
        plan = _explicit_plan(mesh, q, k)
        body = lambda plan, *xs: _local_fwd(opts, plan, layout, *xs)
        return _shard_map_call(mesh, body, plan, args, _fwd_in_specs(plan, with_sinks, layout),
                               (plan.q, plan.lse))
    op = jax.custom_batching.custom_vmap(lambda *xs: tuple(
        _cp_fwd(opts, xs[0].shape, xs[1].shape, xs[2].shape, with_sinks, layout)(*xs)))
    return _fold_batch_rule(op, num_shared=int(with_sinks))(*args)


def partitioned_attention_fwd_fp8(q, k, v, descales, opts: Options, out_dtype):
    """`jax_fa3._core.attention_fwd_fp8` for the FP8 kernel's calls, as one local call per
    device: batch, heads and sequence shard as for the other dtypes (a sharded sequence runs
    the ring with FP8 local calls). `descales`: the kernel's (q (b, hq), k and v (b, hkv)) float32
    (`_core.kernel_descales`), sharded with the batch and the heads they scale."""
    args = (q, k, v) + tuple(descales)
    mesh = _explicit_mesh(q)
    if mesh is not None:
        plan = _explicit_plan(mesh, q, k)
        body = lambda plan, *xs: _local_fwd_fp8(opts, plan, out_dtype, *xs)
        return _shard_map_call(mesh, body, plan, args, _fp8_in_specs(plan), (plan.q, plan.lse))
    op = jax.custom_batching.custom_vmap(lambda *xs: tuple(
        _cp_fwd_fp8(opts, out_dtype, xs[0].shape, xs[1].shape, xs[2].shape)(*xs)))
    return _fold_batch_rule(op)(*args)


def partitioned_attention_bwd(q, k, v, out, lse, dout, opts: Options, dlse=None, sinks=None,
                              segments=None):
    """`jax_fa3._core.attention_bwd` that partitions as one local call per device: returns
    (dq, dk, dv, dsinks). The sinks' gradient, a sum over batch and rows, is formed here on
    the global arrays (XLA partitions it along lse's sharding), not in the local calls.
    `segments` as in `partitioned_attention_fwd`."""
    layout = _segment_layout(segments)
    args = ((q, k, v, out, lse, dout) + ((dlse,) if dlse is not None else ())
            + _segment_operands(segments))
    with_dlse = dlse is not None
    mesh = _explicit_mesh(q)
    if mesh is not None:
        plan = _explicit_plan(mesh, q, k)
        body = lambda plan, *xs: _local_bwd(opts, plan, layout, with_dlse, *xs)
        dq, dk, dv = _shard_map_call(mesh, body, plan, args,
                                     _bwd_in_specs(plan, with_dlse, layout),
                                     (plan.q, plan.kv, plan.kv))
    else:
        op = jax.custom_batching.custom_vmap(lambda *xs: tuple(
            _cp_bwd(opts, xs[0].shape, xs[1].shape, xs[2].shape, with_dlse, layout)(*xs)))
        dq, dk, dv = _fold_batch_rule(op)(*args)
    dsinks = None if sinks is None else portable.sinks_grad(
        sinks, lse, portable.row_dot(dout, out), dlse)
    return dq, dk, dv, dsinks


def context_parallel_attention(q, k, v, *, mesh, seq_axis, batch_axis=None, head_axis=None,
                               causal: bool = False, window_size=(-1, -1), softcap: float = 0.0,
                               softmax_scale: float | None = None, sinks=None,
                               strategy: str = "ring", layout: str = "contiguous",
                               return_lse: bool = False, deterministic: bool = False,
                               implementation=None, q_segment_ids=None, kv_segment_ids=None,
                               q_positions=None, kv_positions=None):
    """Attention on global arrays whose sequence is sharded over `seq_axis` of `mesh`.

    q: (batch, seq_q, heads_q, head_dim), k: (batch, seq_k, heads_kv, head_dim), v: (batch,
    seq_k, heads_kv, head_dim_v), laid out as P(batch_axis, seq_axis, head_axis, None)
    (inputs are resharded to that if needed); `sinks` None or (heads_q,) attention-sink
    logits, laid out as P(head_axis).
    With layout='zigzag' the arrays must already be in zig-zag order
    (`jax_fa3.ring.zigzag_permute(x, mesh.shape[seq_axis])`), and so is the result.
    Packed sequences as in `jax_fa3.flash_attention`: `q_segment_ids` / `q_positions`
    (batch, seq_q) and `kv_segment_ids` / `kv_positions` (batch, seq_k), in the same order
    as q and k (zig-zag permuted with them), laid out as P(batch_axis, seq_axis).
    Differentiable; usable inside or outside `jax.jit`. Returns out, or (out, lse).
    """
    n = _size(dict(mesh.shape), _axes(seq_axis))
    for name, x in (("q", q), ("k", k)):
        if x.ndim != 4 or x.shape[1] % n:
            raise ValueError(f"context_parallel_attention: {name} must be (batch, seq, heads, "
                             f"head_dim) with seq divisible by the {n} devices of "
                             f"{seq_axis!r}; got shape {x.shape}")
    if head_axis is not None and k.shape[2] % _size(dict(mesh.shape), _axes(head_axis)):
        raise ValueError(f"context_parallel_attention: heads_kv = {k.shape[2]} must be "
                         f"divisible by the size of head_axis {head_axis!r}")
    qs = P(batch_axis, seq_axis, head_axis, None)
    lse_spec = P(batch_axis, head_axis, seq_axis)
    args, specs = (q, k, v), (qs, qs, qs)
    # Checked here on the global shapes, so that shard_map's errors are ours.
    segments = _validate.check_segments(q_segment_ids, kv_segment_ids, q_positions,
                                        kv_positions, q.shape, k.shape)
    seg_layout = _segment_layout(segments)
    args = args + _segment_operands(segments)
    specs = specs + (P(batch_axis, seq_axis),) * sum(seg_layout)
    with_sinks = sinks is not None
    if with_sinks:
        sinks = _validate.check_sinks(sinks, q.shape[2])
        args, specs = args + (sinks,), specs + (P(head_axis),)

    def body(q, k, v, *rest):
        n = sum(seg_layout)
        seg = _segments_of(seg_layout, rest[:n]) or (None,) * 4
        return ring.ring_attention(q, k, v, axis_name=seq_axis, causal=causal,
                                   window_size=window_size, softcap=softcap,
                                   softmax_scale=softmax_scale,
                                   sinks=rest[n] if with_sinks else None, strategy=strategy,
                                   layout=layout, return_lse=return_lse,
                                   deterministic=deterministic, implementation=implementation,
                                   q_segment_ids=seg[0], kv_segment_ids=seg[1],
                                   q_positions=seg[2], kv_positions=seg[3])

    if mesh.explicit_axes:  # shard_map wants inputs typed with exactly these shardings
        args = tuple(jax.sharding.reshard(x, NamedSharding(mesh, s)) for x, s in zip(args, specs))
    out_specs = (qs, lse_spec) if return_lse else qs
    return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out_specs,
                         check_vma=False)(*args)
