"""Sharding rules of the attention calls on 8 simulated CPU devices.

`partitioned_attention_fwd/bwd` under jax.jit with NamedSharding inputs, through
custom_partitioning (Auto axes; Shardy, and the GSPMD callbacks) and through shard_map
(Explicit axes): results equal the unsharded call, come back with the query's sharding, and
batch/head sharding compiles to local calls with no all-gather.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import helpers
import segment_helpers
from jax_fa3 import _core, attention, sharding
from jax_fa3._masks import band
from jax_fa3.segments import Segments

NDEV = 8


# conftest.py gives the CPU backend 8 devices; elsewhere (a 1-GPU machine) this module skips.
pytestmark = pytest.mark.skipif(
    jax.device_count() < NDEV, reason=f"needs {NDEV} devices (the CPU suite simulates them)")


# ----------------------------------------------------------------------------- the plan (pure)

def test_plan_shardings():
    """The decisions the callbacks make, on their own (custom_partitioning would hide an
    exception raised in them)."""
    mesh = {"data": 2, "model": 4, "x": 2, "sp": 4}
    plan = sharding.plan_shardings
    # Batch and heads pass through; head_dim is never sharded; k/v follow q.
    p = plan(mesh, P("data", None, "model", "x"), (4, 8, 8, 64), (4, 8, 8, 64))
    assert (p.q, p.kv, p.lse) == (P("data", None, "model", None), P("data", None, "model", None),
                                  P("data", "model", None))
    # GQA: 4-way head sharding divides heads_kv = 4: kv heads sharded alike.
    p = plan(mesh, P(None, None, "model"), (1, 8, 16, 8), (1, 8, 4, 8))
    assert p.kv == P(None, None, "model", None) and p.kv_shared == ()
    # Finer than heads_kv = 2: kv replicated over the axis, one kv head picked per device.
    p = plan(mesh, P(None, None, "model"), (1, 8, 8, 8), (1, 8, 2, 8))
    assert p.heads == ("model",) and p.kv_heads == () and p.kv_shared == ("model",)
    # Two axes: the prefix of size 2 = heads_kv shards kv, the rest shares.
    p = plan(mesh, P(None, None, ("data", "model")), (1, 8, 8, 8), (1, 8, 2, 8))
    assert p.kv_heads == ("data",) and p.kv_shared == ("model",)
    # 2 devices divide heads_kv = 4: kv sharded like q.
    p = plan(mesh, P(None, None, "x"), (1, 8, 12, 8), (1, 8, 4, 8))
    assert p.heads == ("x",) and p.kv_heads == ("x",)
    # 3 query heads per device inside a group of 6: one kv head each, picked locally.
    p = plan(mesh, P(None, None, "model"), (1, 8, 12, 8), (1, 8, 2, 8))
    assert p.kv_shared == ("model",)
    # MQA: every device shares the one kv head.
    p = plan({"m": 4}, P(None, None, "m"), (1, 8, 8, 8), (1, 8, 1, 8))
    assert p.kv_shared == ("m",)
    # 3 query heads per device would straddle groups of 2: head sharding dropped rather than
    # a wrong head mapping.
    p = plan({"m": 4}, P(None, None, "m"), (1, 8, 12, 8), (1, 8, 6, 8))
    assert p.heads == () and p.kv_heads == ()
    # Sequence sharding: kept (ring) when it divides seq_k too, dropped otherwise.
    p = plan(mesh, P("data", "sp"), (2, 16, 4, 8), (2, 8, 4, 8))
    assert p.seq == ("sp",) and p.lse == P("data", None, "sp")
    assert plan(mesh, P(None, "sp"), (2, 16, 4, 8), (2, 6, 4, 8)).seq == ()


def test_sharding_rule_strings():
    rule = sharding._sharding_rule
    mha = rule((1, 8, 4, 8), (1, 8, 4, 8), False)[0]
    assert mha == "b s h d, b s h d, b s h d -> b s h d, b h s"
    fwd, kw = rule((1, 8, 8, 8), (1, 16, 2, 8), False)
    assert fwd == "b s h d, b t k d, b t k d -> b s h d, b h s"
    assert kw == {"need_replication_factors": ("d",)}
    bwd = rule((1, 8, 8, 8), (1, 8, 2, 8), True)[0]
    assert bwd.split(" -> ")[1] == "b s h d, b s k d, b s k d"
    with_dlse = rule((1, 8, 8, 8), (1, 8, 2, 8), True, with_dlse=True)[0]
    assert with_dlse.split(" -> ")[0].endswith("b s h d, b h s, b s h d, b h s")
    # v of its own head dim (factor e, never sharded either) and the forward's sinks (h)
    mla, kw = rule((1, 8, 8, 192), (1, 8, 2, 192), False, with_sinks=True, v_shape=(1, 8, 2, 128))
    assert mla == "b s h d, b s k d, b s k e, h -> b s h e, b h s"
    assert kw == {"need_replication_factors": ("d", "e")}
    bwd = rule((1, 8, 8, 192), (1, 8, 2, 192), True, v_shape=(1, 8, 2, 128))[0]
    assert bwd == "b s h d, b s k d, b s k e, b s h e, b h s, b s h e -> b s h d, b s k d, b s k e"
    # Segment ids and positions follow the tokens: the queries' (b s), the keys' (b t),
    # after the other operands and before the sinks.
    fwd = rule((1, 8, 8, 8), (1, 16, 2, 8), False, with_sinks=True,
               segment_layout=(True, True, True, True))[0]
    assert fwd == "b s h d, b t k d, b t k d, b s, b t, b s, b t, h -> b s h d, b h s"
    bwd = rule((1, 8, 4, 8), (1, 8, 4, 8), True, with_dlse=True,
               segment_layout=(True, True, False, False))[0]
    assert bwd.split(" -> ")[0].endswith("b h s, b s h d, b h s, b s, b s")


# ----------------------------------------------------------------------------- partitioned calls

MESHES = {  # name: (mesh shape, axis names, q spec, hq, hkv, causal)
    "batch": ((8,), ("data",), P("data"), 4, 4, False),
    "heads": ((4,), ("model",), P(None, None, "model"), 4, 4, True),
    "batch-heads-gqa": ((2, 4), ("data", "model"), P("data", None, "model"), 8, 4, True),
    "heads-finer-than-kv": ((2, 4), ("data", "model"), P("data", None, "model"), 8, 2, False),
    "seq-ring": ((4,), ("sp",), P(None, "sp"), 4, 2, True),
    "batch-seq": ((2, 4), ("data", "sp"), P("data", "sp"), 4, 4, True),
}


def _mesh(shape, names, types):
    n = int(np.prod(shape))
    return jax.make_mesh(shape, names, axis_types=(types,) * len(names), devices=jax.devices()[:n])


def _inputs(b, s, hq, hkv, d=16, seed=0):
    q, k, v = helpers.random_qkv(jax.random.key(seed), b, s, s, hq, hkv, d, jnp.float32, scale=2.0)
    return q, k, v, helpers.random_like(jax.random.key(seed + 1), q)


def _opts(causal, window_size=(-1, -1), softcap=0.0):
    left, right = band(causal, window_size)
    return _core.Options(softmax_scale=0.3, softcap=softcap, left=left, right=right)


def _fwd_bwd(f_fwd, f_bwd, q, k, v, dout, opts, dlse=None):
    """(out, lse, dq, dk, dv) and the jitted forward and backward (no sinks: the backward's
    dsinks is None and left out)."""
    fwd = jax.jit(lambda q, k, v: f_fwd(q, k, v, opts))
    bwd = jax.jit(lambda *a, dlse=None: f_bwd(*a, opts, dlse=dlse)[:3])
    out, lse = fwd(q, k, v)
    return (out, lse) + tuple(bwd(q, k, v, out, lse, dout, dlse=dlse)), fwd, bwd


def _unsharded(q, k, v, dout, opts, dlse=None):
    return _fwd_bwd(_core.attention_fwd, _core.attention_bwd, q, k, v, dout, opts, dlse)[0]


def _put(mesh, spec, *xs):
    return tuple(jax.device_put(x, NamedSharding(mesh, spec)) for x in xs)


def _kv_input_spec(mesh, spec, hkv):
    """k/v given sharded like q where that divides heads_kv, else replicated over heads."""
    heads = spec[2] if len(spec) > 2 else None
    if heads is None or hkv % mesh.shape[heads] == 0:
        return spec
    return P(*spec[:2])


def _same_spec(got, want):
    """PartitionSpecs equal up to trailing Nones."""
    norm = lambda s: tuple(s) + (None,) * (4 - len(tuple(s)))
    return norm(got) == norm(want)


@pytest.mark.parametrize("types", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
@pytest.mark.parametrize("name", list(MESHES))
def test_partitioned_equals_unsharded(name, types):
    """out, lse, dq, dk, dv (with an LSE cotangent) equal the single-device call; outputs
    carry the query's sharding (lse (b, h, s) the matching one, dk/dv the planned one)."""
    shape, names, spec, hq, hkv, causal = MESHES[name]
    mesh = _mesh(shape, names, types)
    q, k, v, dout = _inputs(8, 16, hq, hkv)
    dlse = jax.random.normal(jax.random.key(5), (8, hq, 16), jnp.float32)  # an LSE cotangent
    opts = _opts(causal)
    want = _unsharded(q, k, v, dout, opts, dlse)
    kv_spec = _kv_input_spec(mesh, spec, hkv)
    qs, dos = _put(mesh, spec, q, dout)
    ks, vs = _put(mesh, kv_spec, k, v)
    plan = sharding.plan_shardings(dict(mesh.shape), spec, q.shape, k.shape)
    (dlses,) = _put(mesh, plan.lse, dlse)
    got, _, _ = _fwd_bwd(sharding.partitioned_attention_fwd, sharding.partitioned_attention_bwd,
                         qs, ks, vs, dos, opts, dlses)
    for label, a, r in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-5, err_msg=f"{name}: {label}")
    out, lse, dq, dk, dv = got
    assert _same_spec(out.sharding.spec, spec) and _same_spec(dq.sharding.spec, spec)
    assert _same_spec(lse.sharding.spec, plan.lse), lse.sharding.spec
    if types == AxisType.Explicit:  # Auto leaves dk/dv to propagation (may follow k's input)
        assert _same_spec(dk.sharding.spec, plan.kv), dk.sharding.spec


SINK_MESHES = ["batch", "batch-heads-gqa", "heads-finer-than-kv", "seq-ring", "batch-seq"]


@pytest.mark.parametrize("types", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
@pytest.mark.parametrize("name", SINK_MESHES)
def test_partitioned_with_sinks_and_value_head_dim(name, types):
    """Sinks (sharded like the query heads) and a v head dim of its own: out, lse, dq, dk,
    dv and dsinks (with an LSE cotangent) equal the single-device call."""
    shape, names, spec, hq, hkv, causal = MESHES[name]
    mesh = _mesh(shape, names, types)
    q, k, v = helpers.random_qkv(jax.random.key(11), 8, 16, 16, hq, hkv, 16, jnp.float32,
                                 scale=2.0, head_dim_v=8)
    dout = helpers.random_like(jax.random.key(12), jnp.zeros((8, 16, hq, 8)))
    dlse = jax.random.normal(jax.random.key(13), (8, hq, 16), jnp.float32)
    sinks = helpers.random_sinks(14, hq)
    opts = _opts(causal, window_size=(5, -1), softcap=3.0)

    def run(f_fwd, f_bwd, q, k, v, dout, dlse, sinks):
        out, lse = jax.jit(lambda q, k, v, s: f_fwd(q, k, v, opts, sinks=s))(q, k, v, sinks)
        grads = jax.jit(lambda *a: f_bwd(*a[:6], opts, dlse=a[6], sinks=a[7]))(
            q, k, v, out, lse, dout, dlse, sinks)
        return (out, lse) + tuple(grads)

    want = run(_core.attention_fwd, _core.attention_bwd, q, k, v, dout, dlse, sinks)
    plan = sharding.plan_shardings(dict(mesh.shape), spec, q.shape, k.shape)
    qs, = _put(mesh, spec, q)
    ks, vs = _put(mesh, _kv_input_spec(mesh, spec, hkv), k, v)
    dos, = _put(mesh, spec, dout)
    dlses, = _put(mesh, plan.lse, dlse)
    sinks_s, = _put(mesh, plan.sinks, sinks)
    got = run(sharding.partitioned_attention_fwd, sharding.partitioned_attention_bwd,
              qs, ks, vs, dos, dlses, sinks_s)
    for label, a, r in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), got, want):
        np.testing.assert_allclose(a, r, rtol=1e-5, atol=2e-5, err_msg=f"{name}: {label}")
    assert _same_spec(got[0].sharding.spec, spec)


# ----------------------------------------------------------------------------- the FP8 forward

FP8_MESHES = ["batch", "heads", "batch-heads-gqa", "heads-finer-than-kv", "seq-ring", "batch-seq"]


@pytest.mark.parametrize("types", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
@pytest.mark.parametrize("name", FP8_MESHES)
def test_partitioned_fp8_equals_unsharded(name, types):
    """The FP8 kernel's partitioned call (`partitioned_attention_fwd_fp8`), its local bodies on
    the portable FP8 path here (the kernel's numerics, on CPU), with the kernel-form descales
    ((b, hq) for q, (b, hkv) for k and v; each device takes its heads' and, where kv heads are
    shared, its kv head's). Batch / head meshes: out and lse equal the single-device call. A
    sharded sequence runs the ring with FP8 local calls, whose P roundings follow each shard's
    own running max and whose bf16 outs merge in float32: within the FP8 bound of the float64
    oracle (tests/test_fp8.py) plus 2^-8 of the weight sum_j p_j |v_j| for those bf16 outs."""
    from test_fp8 import _dequant, _fp8_inputs, _weight, fp8_bound
    shape, names, spec, hq, hkv, causal = MESHES[name]
    mesh = _mesh(shape, names, types)
    q8, qd, k8, kd, v8, vd = _fp8_inputs(21, 8, 16, 16, hq, hkv, 16)
    descales = _core.kernel_descales((qd, kd, vd), 8, hq, hkv)
    window = (6, -1)
    opts = dataclasses.replace(_opts(causal, window_size=window), implementation="xla")
    plan = sharding.plan_shardings(dict(mesh.shape), spec, q8.shape, k8.shape)
    qs, = _put(mesh, spec, q8)
    ks, vs = _put(mesh, _kv_input_spec(mesh, spec, hkv), k8, v8)
    specs = sharding._fp8_in_specs(plan)[3:]
    ds = tuple(jax.device_put(x, NamedSharding(mesh, sp)) for x, sp in zip(descales, specs))
    got = jax.jit(lambda q, k, v, d: sharding.partitioned_attention_fwd_fp8(
        q, k, v, d, opts, jnp.bfloat16))(qs, ks, vs, ds)
    if types == AxisType.Explicit or not plan.seq:  # Auto: XLA may reshard out
        assert _same_spec(got[0].sharding.spec, plan.q), got[0].sharding.spec
    if not plan.seq:
        # The same local computation, fused differently: lse within float32 rounding, out
        # within one bf16 step (a wrong head or descale would be off by far more).
        local = jax.jit(lambda q, k, v, d: _core.attention_fwd_fp8(q, k, v, d, opts))
        want = local(q8, k8, v8, descales)
        for label, a, r, rtol in zip(("out", "lse"), got, want, (2.0 ** -7, 1e-6)):
            np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(r, np.float32),
                                       rtol=rtol, atol=1e-6, err_msg=f"{name}: {label}")
        return
    q, k, v = _dequant(q8, qd), _dequant(k8, kd), _dequant(v8, vd)
    ref_opts = dict(softmax_scale=0.3, causal=causal, window_size=window)
    bound, ref = fp8_bound(q, k, v, jnp.bfloat16, **ref_opts)
    weight = _weight(q, k, v, **ref_opts)
    err = np.abs(np.asarray(got[0]).astype(np.float64) - ref)
    assert (err <= bound + 2.0 ** -8 * weight).all(), f"{name}: {(err - bound).max():.3e}"


def test_flash_attention_fp8_kernel_route_partitions(monkeypatch):
    """flash_attention routes an FP8 kernel call (implementation resolved to "cuda") on sharded
    inputs through `partitioned_attention_fwd_fp8`: one custom partitioning, local calls of the
    kernel's op on (batch, heads) shards, the result of the unsharded call. The kernel's op is
    stood in for by the portable FP8 path on the same kernel-form descales (CPU)."""
    from test_fp8 import _fp8_inputs
    from jax_fa3 import _ops, portable_fp8

    calls = []

    def fake_fwd_fp8(q, k, v, qd, kd, vd, *, softmax_scale, softcap, window_left, window_right):
        calls.append(q.shape)
        return portable_fp8.forward(q, k, v, (qd, kd, vd), softmax_scale=softmax_scale,
                                    softcap=softcap, left=window_left, right=window_right)

    monkeypatch.setattr(_ops, "fwd_fp8", fake_fwd_fp8)
    monkeypatch.setattr(_core, "require_kernel", lambda *a, **kw: None)
    mesh = _mesh((2, 4), ("data", "model"), AxisType.Auto)
    spec = P("data", None, "model")
    q8, qd, k8, kd, v8, vd = _fp8_inputs(31, 4, 16, 16, 8, 4, 16)
    fn = lambda q, k, v, qd, kd, vd: attention.flash_attention(
        q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, causal=True, return_lse=True,
        implementation="cuda")
    want = jax.jit(fn)(q8, k8, v8, qd, kd, vd)
    assert calls == [q8.shape]  # unsharded: one call on the whole arrays
    qs, = _put(mesh, spec, q8)
    ks, vs = _put(mesh, spec, k8, v8)
    ds = tuple(jax.device_put(x, NamedSharding(mesh, P("data", "model"))) for x in (qd, kd, vd))
    run = jax.jit(fn)
    assert "CustomSPMDPartitioning" in run.lower(qs, ks, vs, *ds).as_text()
    got = run(qs, ks, vs, *ds)
    assert (2, 16, 2, 16) in calls  # a local call on a (batch, heads) shard
    for label, a, r, rtol in zip(("out", "lse"), got, want, (2.0 ** -7, 1e-6)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(r, np.float32),
                                   rtol=rtol, atol=1e-6, err_msg=label)
    assert _same_spec(got[0].sharding.spec, spec)


def test_fp8_sharding_rule_and_specs():
    """The FP8 rule ends with the descales; the descales shard with their batch and heads."""
    rule, kw = sharding._sharding_rule((1, 8, 8, 64), (1, 16, 2, 64), False, fp8=True)
    assert rule == "b s h d, b t k d, b t k d, b h, b k, b k -> b s h d, b h s"
    assert kw == {"need_replication_factors": ("d",)}
    mesh = {"data": 2, "model": 4, "sp": 2}
    plan = sharding.plan_shardings(mesh, P("data", "sp", "model"), (2, 8, 8, 64), (2, 8, 2, 64))
    assert plan.seq == ("sp",) and plan.kv_shared == ("model",)
    assert sharding._fp8_in_specs(plan)[3:] == (P("data", "model"), P("data", None), P("data", None))


def _collectives(text):
    return sorted(set(re.findall(r"\b(all-gather|all-reduce|all-to-all|collective-permute|"
                                 r"reduce-scatter)\b", text)))


@pytest.mark.parametrize("shardy", [True, False], ids=["shardy", "gspmd"])
def test_batch_head_sharding_compiles_to_local_calls(shardy):
    """(batch, heads) with GQA: the compiled forward and backward have no collective at all
    (no all-gather of q/k/v); heads sharded finer than heads_kv need only the all-reduce of
    dK/dV. Checked with Shardy and with the GSPMD callbacks."""
    previous = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", shardy)
    try:
        mesh = _mesh((2, 4), ("data", "model"), AxisType.Auto)
        spec = P("data", None, "model")
        for hkv, allowed_bwd in ((4, []), (2, ["all-reduce"])):
            q, k, v, dout = _inputs(4, 16, 8, hkv)
            opts = _opts(True)
            qs, dos = _put(mesh, spec, q, dout)
            ks, vs = _put(mesh, _kv_input_spec(mesh, spec, hkv), k, v)
            got, fwd, bwd = _fwd_bwd(sharding.partitioned_attention_fwd,
                                     sharding.partitioned_attention_bwd, qs, ks, vs, dos, opts)
            out, lse = got[:2]
            assert _collectives(fwd.lower(qs, ks, vs).compile().as_text()) == []
            bwd_text = bwd.lower(qs, ks, vs, out, lse, dos).compile().as_text()
            assert _collectives(bwd_text) == allowed_bwd, _collectives(bwd_text)
            assert _same_spec(out.sharding.spec, spec)
            want = _unsharded(q, k, v, dout, opts)
            for a, r in zip(got, want):
                np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-5)
    finally:
        jax.config.update("jax_use_shardy_partitioner", previous)


def test_gspmd_sequence_sharding_runs_the_ring():
    """With Shardy off the GSPMD callbacks route a sharded sequence to the ring too: only
    collective-permutes, results equal the unsharded call (sliding window + softcap)."""
    previous = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        mesh = _mesh((2, 4), ("data", "sp"), AxisType.Auto)
        spec = P("data", "sp")
        q, k, v, dout = _inputs(2, 32, 4, 2)
        opts = _opts(True, window_size=(7, -1), softcap=5.0)
        qs, ks, vs, dos = _put(mesh, spec, q, k, v, dout)
        got, fwd, _ = _fwd_bwd(sharding.partitioned_attention_fwd,
                               sharding.partitioned_attention_bwd, qs, ks, vs, dos, opts)
        assert _collectives(fwd.lower(qs, ks, vs).compile().as_text()) == ["collective-permute"]
        assert _same_spec(got[1].sharding.spec, P("data", None, "sp"))
        for a, r in zip(got, _unsharded(q, k, v, dout, opts)):
            np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-5)
    finally:
        jax.config.update("jax_use_shardy_partitioner", previous)


def test_inside_shard_map_and_vmap():
    """Inside a shard_map over all axes the call is plain local attention on the shard; under
    vmap the extra axis folds into the batch."""
    mesh = _mesh((4,), ("model",), AxisType.Auto)
    q, k, v, dout = _inputs(2, 16, 8, 4)
    opts = _opts(True)
    spec = P(None, None, "model")
    f = jax.shard_map(lambda q, k, v: sharding.partitioned_attention_fwd(q, k, v, opts),
                      mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec, P(None, "model")))
    out, lse = jax.jit(f)(q, k, v)
    want_out, want_lse = _core.attention_fwd(q, k, v, opts)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)

    stack = lambda x: jnp.stack([x, x[::-1]])  # (2, b, ...): a vmapped leading axis
    vf = jax.jit(jax.vmap(lambda q, k, v: sharding.partitioned_attention_fwd(q, k, v, opts)))
    out, lse = vf(stack(q), stack(k), stack(v))
    for i, sl in enumerate((slice(None), slice(None, None, -1))):
        o, l = _core.attention_fwd(q[sl], k[sl], v[sl], opts)
        np.testing.assert_allclose(out[i], o, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(lse[i], l, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["batch", "heads-finer-than-kv", "batch-seq"])
def test_vmap_of_grad_on_sharded_inputs(name):
    """jax.vmap(jax.grad(loss)) of flash_attention on NamedSharding inputs: the stack folds
    into the batch of the partitioned calls (n * b rows, batch sharded 2 or 8 ways), with
    segment ids mapped with q and k/v shared by the stack (in_axes None). Every element's
    dq, dk, dv equal the float64 oracle for stacks of 2, 3 (reported wrong once, never
    reproduced) and 4, on the batch, heads and ring routes."""
    shape, names, spec, hq, hkv, causal = MESHES[name]
    mesh = _mesh(shape, names, AxisType.Auto)
    b, s = 8, 16
    q_all, k, v = helpers.random_qkv(jax.random.key(71), 4 * b, s, s, hq, hkv, 16, jnp.float32,
                                     scale=2.0)
    k, v = k[:b], v[:b]
    dout = helpers.random_like(jax.random.key(72), q_all[:b])
    ids_all = np.stack([segment_helpers.packed_ids(73 + i, b, s, docs=3) for i in range(4)])

    def loss(q, k, v, ids):
        out = attention.flash_attention(q, k, v, softmax_scale=0.3, causal=causal,
                                        q_segment_ids=ids)
        return jnp.sum(out * dout)

    grad = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2)), in_axes=(0, None, None, 0)))
    ks, vs = _put(mesh, _kv_input_spec(mesh, spec, hkv), k, v)
    for n in (2, 3, 4):
        q = q_all[:n * b].reshape(n, b, s, hq, 16)
        ids = jnp.asarray(ids_all[:n])
        (qs,) = _put(mesh, P(None, *spec), q)
        (ids_s,) = _put(mesh, P(None, *spec[:2]), ids)
        got = grad(qs, ks, vs, ids_s)
        for i in range(n):
            want = helpers.reference_grads_f64(
                q[i], k, v, dout, softmax_scale=0.3, causal=causal,
                segments=(ids_all[i], ids_all[i], None, None))
            for label, g, r in zip(("dq", "dk", "dv"), got, want):
                np.testing.assert_allclose(g[i], r, rtol=1e-4, atol=1e-4,
                                           err_msg=f"{name}: stack {n}, element {i}, {label}")


def test_flash_attention_under_sharded_jit():
    """The public flash_attention, differentiated under jit with (batch, heads)-sharded GQA
    inputs: equal to the unsharded result, output keeps the query's sharding."""
    mesh = _mesh((2, 4), ("data", "model"), AxisType.Auto)
    spec = P("data", None, "model")
    q, k, v, dout = _inputs(4, 16, 8, 4)

    def loss(q, k, v):
        out = attention.flash_attention(q, k, v, causal=True, softcap=3.0)
        return jnp.sum(out * dout), out

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
    (dq, dk, dv), out = grad(*_put(mesh, spec, q, k, v))
    (rq, rk, rv), rout = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    assert _same_spec(out.sharding.spec, spec) and _same_spec(dq.sharding.spec, spec)
    for a, r in zip((out, dq, dk, dv), (rout, rq, rk, rv)):
        np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("types", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_flash_attention_sequence_sharded_runs_the_ring(types):
    """flash_attention on (batch, seq)-sharded inputs routes to ring attention (the route in
    jax_fa3/attention.py): only collective-permutes in the compiled grad, no all-gather of
    q/k/v, results and gradient shardings as unsharded / as the inputs."""
    mesh = _mesh((2, 2), ("data", "sp"), types)
    spec = P("data", "sp")
    q, k, v, _ = _inputs(2, 32, 4, 2)

    def loss(q, k, v):
        out = attention.flash_attention(q, k, v, causal=True, window_size=(9, -1))
        return jnp.sum(out ** 2)

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    qs, ks, vs = _put(mesh, spec, q, k, v)
    text = grad.lower(qs, ks, vs).compile().as_text()
    assert "collective-permute" in _collectives(text) and "all-gather" not in _collectives(text)
    value, grads = grad(qs, ks, vs)
    want_value, want_grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)
    np.testing.assert_allclose(value, want_value, rtol=1e-5)
    for g, w in zip(grads, want_grads):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
        assert _same_spec(g.sharding.spec, spec)


def test_flash_attention_sharded_with_sinks():
    """flash_attention with sinks and a v head dim of its own, differentiated under jit on
    (batch, heads) and on (batch, seq) meshes: equal to the unsharded result, the sinks'
    gradient included."""
    q, k, v = helpers.random_qkv(jax.random.key(15), 2, 32, 32, 4, 2, 16, jnp.float32,
                                 head_dim_v=24)
    sinks = helpers.random_sinks(16, 4)

    def loss(q, k, v, s):
        out = attention.flash_attention(q, k, v, sinks=s, causal=True, window_size=(9, -1))
        return jnp.sum(out ** 2)

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
    want_value, want = grad(q, k, v, sinks)
    for shape, names, spec in (((2, 2), ("data", "model"), P("data", None, "model")),
                               ((2, 2), ("data", "sp"), P("data", "sp"))):
        mesh = _mesh(shape, names, AxisType.Auto)
        sinks_spec = P(spec[2]) if len(spec) > 2 else P()
        value, got = grad(*_put(mesh, spec, q, k, v), *_put(mesh, sinks_spec, sinks))
        np.testing.assert_allclose(value, want_value, rtol=1e-5)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_user_shard_map_with_check_vma():
    """flash_attention inside a user's shard_map (check_vma on): the portable path's scan
    carries are typed as varying, forward and backward, also when seqlen_q != seqlen_k."""
    import jax_fa3
    mesh = _mesh((4,), ("data",), AxisType.Auto)
    q, k, v = helpers.random_qkv(jax.random.key(3), 4, 32, 8, 2, 1, 16, jnp.float32)
    spec = P("data")

    def loss(q, k, v):
        out = jax_fa3.flash_attention(q, k, v, causal=True, implementation="xla")
        return jax.lax.psum((out ** 2).sum(), "data")

    f = jax.shard_map(jax.value_and_grad(loss, argnums=(0, 1, 2)), mesh=mesh,
                      in_specs=(spec,) * 3, out_specs=(P(), (spec,) * 3))
    val, grads = jax.jit(f)(q, k, v)
    want_val, want_grads = jax.value_and_grad(
        lambda q, k, v: (jax_fa3.flash_attention(q, k, v, causal=True, implementation="xla") ** 2).sum(),
        argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(val, want_val, rtol=1e-5)
    for got, want in zip(grads, want_grads):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)

    # With sinks shared by every device (invariant) and a v head dim of its own: the sinks'
    # gradient is typed like the sinks (invariant), the sum of every device's share, which
    # is the gradient of the whole batch's loss.
    v8 = helpers.random_like(jax.random.key(4), jnp.zeros((4, 8, 1, 8)))
    sinks = helpers.random_sinks(5, 2)

    def sink_loss(q, k, v, s):
        out = jax_fa3.flash_attention(q, k, v, sinks=s, causal=True, implementation="xla")
        return (out ** 2).sum()

    f = jax.shard_map(jax.grad(sink_loss, argnums=3), mesh=mesh,
                      in_specs=(spec, spec, spec, P()), out_specs=P())
    want = jax.grad(sink_loss, argnums=3)(q, k, v8, sinks)
    np.testing.assert_allclose(jax.jit(f)(q, k, v8, sinks), want, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- packed sequences

def _segments(b, sq, sk, positions: bool, seed=0, empty_rows=(1,)):
    """Packed segment ids (row `empty_rows` all padding, padding tails, a one-token
    document) and, with `positions`, positions restarting at each document."""
    q_ids = segment_helpers.packed_ids(seed, b, sq, docs=4, empty_rows=empty_rows)
    kv_ids = q_ids if sq == sk else segment_helpers.packed_ids(seed + 1, b, sk, docs=4,
                                                               empty_rows=empty_rows)
    q_pos = kv_pos = None
    if positions:
        q_pos, kv_pos = (segment_helpers.restart_positions(x) for x in (q_ids, kv_ids))
    return Segments(*(None if x is None else jnp.asarray(x) for x in (q_ids, kv_ids, q_pos,
                                                                       kv_pos)))


def _with_segments(f, segments):
    """f(q, k, v, opts, ...) with `segments` bound."""
    return lambda *a, **kw: f(*a, **kw, segments=segments)


SEGMENT_MESHES = ["batch", "heads", "batch-heads-gqa", "heads-finer-than-kv", "seq-ring",
                  "batch-seq"]


@pytest.mark.parametrize("types,positions", [(AxisType.Auto, False), (AxisType.Auto, True),
                                             (AxisType.Explicit, True)],
                         ids=["auto-ids", "auto-positions", "explicit-positions"])
@pytest.mark.parametrize("name", SEGMENT_MESHES)
def test_partitioned_with_segments(name, types, positions):
    """Segment ids (and positions) sharded with the tokens' batch and sequence axes: out,
    lse, dq, dk, dv (with an LSE cotangent) equal the single-device call with the same
    segments, an all-padding batch row included (out 0, lse -inf, zero gradients)."""
    shape, names, spec, hq, hkv, causal = MESHES[name]
    mesh = _mesh(shape, names, types)
    q, k, v, dout = _inputs(8, 16, hq, hkv, seed=21)
    dlse = jax.random.normal(jax.random.key(22), (8, hq, 16), jnp.float32)
    opts = _opts(causal, window_size=(6, -1) if positions else (-1, -1))
    segments = _segments(8, 16, 16, positions)
    want = _fwd_bwd(_with_segments(_core.attention_fwd, segments),
                    _with_segments(_core.attention_bwd, segments), q, k, v, dout, opts, dlse)[0]
    plan = sharding.plan_shardings(dict(mesh.shape), spec, q.shape, k.shape)
    qs, dos = _put(mesh, spec, q, dout)
    ks, vs = _put(mesh, _kv_input_spec(mesh, spec, hkv), k, v)
    (dlses,) = _put(mesh, plan.lse, dlse)
    seg_s = Segments(*(None if x is None else _put(mesh, plan.tokens, x)[0] for x in segments))
    got, _, _ = _fwd_bwd(_with_segments(sharding.partitioned_attention_fwd, seg_s),
                         _with_segments(sharding.partitioned_attention_bwd, seg_s),
                         qs, ks, vs, dos, opts, dlses)
    for label, a, r in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-5, err_msg=f"{name}: {label}")
    out, lse, dq, dk, dv = got
    assert not np.asarray(out)[1].any() and np.isneginf(np.asarray(lse)[1]).all()
    assert not np.asarray(dq)[1].any() and not np.asarray(dk)[1].any()
    assert _same_spec(out.sharding.spec, spec)


def test_partitioned_segments_oracle_and_sq_ne_sk():
    """A (batch, seq) mesh with seq_q != seq_k (keys' ids of their own), sinks and an LSE
    cotangent: the ring route with segments vs the float64 oracle of the dense mask."""
    mesh = _mesh((2, 4), ("data", "sp"), AxisType.Auto)
    b, sq, sk, hq, hkv = 2, 16, 32, 4, 2
    q, k, v = helpers.random_qkv(jax.random.key(31), b, sq, sk, hq, hkv, 16, jnp.float32,
                                 scale=2.0, head_dim_v=8)
    dout = helpers.random_like(jax.random.key(32), jnp.zeros((b, sq, hq, 8)))
    dlse = jax.random.normal(jax.random.key(33), (b, hq, sq), jnp.float32)
    sinks = helpers.random_sinks(34, hq)
    segments = _segments(b, sq, sk, False, seed=35, empty_rows=())
    opts = _opts(True, window_size=(9, -1))
    spec = P("data", "sp")
    plan = sharding.plan_shardings(dict(mesh.shape), spec, q.shape, k.shape)
    assert plan.seq == ("sp",)
    seg_s = Segments(*(_put(mesh, plan.tokens, x)[0] for x in segments[:2]))
    fwd = jax.jit(lambda q, k, v, s: sharding.partitioned_attention_fwd(
        q, k, v, opts, sinks=s, segments=seg_s))
    bwd = jax.jit(lambda *a: sharding.partitioned_attention_bwd(
        *a[:6], opts, dlse=a[6], sinks=a[7], segments=seg_s))
    qs, ks, vs, dos = _put(mesh, spec, q, k, v, dout)
    out, lse = fwd(qs, ks, vs, sinks)
    grads = bwd(qs, ks, vs, out, lse, dos, _put(mesh, plan.lse, dlse)[0], sinks)
    kw = dict(softmax_scale=opts.softmax_scale, left=opts.left, right=opts.right, sinks=sinks,
              segments=segments)
    ref_out, ref_lse = helpers.reference_f64(q, k, v, **kw)
    ref_grads = helpers.reference_grads_f64(q, k, v, dout, dlse=dlse, **kw)
    np.testing.assert_allclose(out, ref_out, atol=2e-5)
    np.testing.assert_allclose(lse, ref_lse, atol=2e-5)
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads):
        np.testing.assert_allclose(g, r, atol=1e-4, rtol=1e-4, err_msg=name)


def test_partitioned_segments_under_vmap():
    """vmap over a stack of (q, k, v, segment ids) folds into the batch of the partitioned
    call; unbatched segments are shared by the stack."""
    mesh = _mesh((4,), ("data",), AxisType.Auto)
    q, k, v, _ = _inputs(4, 16, 4, 2, seed=41)
    opts = _opts(True)
    seg = _segments(4, 16, 16, True, seed=42)
    other = _segments(4, 16, 16, True, seed=43)
    stack = lambda a, b_: jnp.stack([a, b_])
    qs, ks, vs = (jax.device_put(stack(x, x[::-1]), NamedSharding(mesh, P(None, "data")))
                  for x in (q, k, v))
    batched = Segments(*(stack(a, b_) for a, b_ in zip(seg, other)))

    f = jax.jit(jax.vmap(lambda q, k, v, s: sharding.partitioned_attention_fwd(
        q, k, v, opts, segments=s)))
    out, lse = f(qs, ks, vs, batched)
    shared = jax.jit(jax.vmap(lambda q, k, v: sharding.partitioned_attention_fwd(
        q, k, v, opts, segments=seg)))(qs, ks, vs)
    for i, (sl, s) in enumerate(((slice(None), seg), (slice(None, None, -1), other))):
        o, l = _core.attention_fwd(q[sl], k[sl], v[sl], opts, segments=s)
        np.testing.assert_allclose(out[i], o, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(lse[i], l, rtol=1e-5, atol=1e-5)
        o, l = _core.attention_fwd(q[sl], k[sl], v[sl], opts, segments=seg)
        np.testing.assert_allclose(shared[0][i], o, rtol=1e-5, atol=1e-5)


def test_flash_attention_with_segments_under_sharded_jit():
    """flash_attention with segment ids and positions, differentiated under jit on (batch,
    heads) and on (batch, seq) meshes: equal to the unsharded result; the sequence-sharded
    grad compiles to a ring (collective-permutes, no all-gather of q/k/v)."""
    b, s, hq, hkv = 2, 32, 4, 2
    q, k, v = helpers.random_qkv(jax.random.key(51), b, s, s, hq, hkv, 16, jnp.float32)
    ids = jnp.asarray(segment_helpers.packed_ids(52, b, s, docs=5))
    pos = jnp.asarray(segment_helpers.restart_positions(ids))

    def loss(q, k, v, ids, pos):
        out = attention.flash_attention(q, k, v, causal=True, window_size=(9, -1),
                                        q_segment_ids=ids, q_positions=pos)
        return jnp.sum(out ** 2)

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    want_value, want = grad(q, k, v, ids, pos)
    for shape, names, spec in (((2, 2), ("data", "model"), P("data", None, "model")),
                               ((2, 2), ("data", "sp"), P("data", "sp"))):
        mesh = _mesh(shape, names, AxisType.Auto)
        args = _put(mesh, spec, q, k, v) + _put(mesh, P(*spec[:2]), ids, pos)
        value, got = grad(*args)
        np.testing.assert_allclose(value, want_value, rtol=1e-5)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
            assert _same_spec(g.sharding.spec, spec)
        if "sp" in names:
            found = _collectives(grad.lower(*args).compile().as_text())
            assert "collective-permute" in found and "all-gather" not in found, found


def test_partitioned_segments_with_kernel_bands_constants(monkeypatch):
    """The kernel path builds document bands (`segments.kernel_bands`), whose code closes
    over constant arrays; custom_partitioning asserts on a body with constants, so the local
    bodies are traced inside a jit. Simulated on CPU: the core builds the bands first, as the
    kernel path does, then runs the portable path."""
    from jax_fa3 import segments as segments_lib
    real_fwd, real_bwd = _core.attention_fwd, _core.attention_bwd

    def with_bands(real):
        def call(q, k, *args, segments=None, **kw):
            out = real(q, k, *args, segments=segments, **kw)
            if segments is not None:
                bands, _, _ = segments_lib.kernel_bands(segments, 0, 0, q.shape[1], k.shape[1])
                out = (out[0] + 0 * bands[0].sum().astype(out[0].dtype),) + tuple(out[1:])
            return out
        return call

    monkeypatch.setattr(_core, "attention_fwd", with_bands(real_fwd))
    monkeypatch.setattr(_core, "attention_bwd", with_bands(real_bwd))
    mesh = _mesh((4,), ("data",), AxisType.Auto)
    q, k, v, dout = _inputs(4, 16, 4, 2, seed=61)
    opts = _opts(True)
    seg = _segments(4, 16, 16, False, seed=62)
    want = _fwd_bwd(_with_segments(real_fwd, seg), _with_segments(real_bwd, seg), q, k, v, dout,
                    opts)[0]
    qs, ks, vs, dos = _put(mesh, P("data"), q, k, v, dout)
    seg_s = Segments(*(_put(mesh, P("data"), x)[0] for x in seg[:2]))
    got = _fwd_bwd(_with_segments(sharding.partitioned_attention_fwd, seg_s),
                   _with_segments(sharding.partitioned_attention_bwd, seg_s),
                   qs, ks, vs, dos, opts)[0]
    for label, a, r in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-5, err_msg=label)
