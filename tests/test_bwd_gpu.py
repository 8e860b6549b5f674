"""GPU tests of the Hopper backward kernel (cpp/kernels/bwd) against exact gradients.

The kernel is reached through jax_fa3._ops.bwd (the FFI call, masks as normalised bands) with
out/lse of the float64 oracle, so these tests check the backward alone. Every gradient uses the
error-ratio rule of docs/architecture.md (tests/helpers.py): max error against the exact
gradient at most 2x that of the same gradient computed plainly by XLA in the input dtype, plus
one ulp of slack. Oracle (tests/helpers.py): its float64 numpy form for small shapes; for long
sequences (where numpy is too slow) its JAX form, float32 on the GPU with Precision.HIGHEST,
whose error is negligible next to bf16/fp16 rounding.

XLA allocates the outputs and the kernel's workspace; before each kernel call NaN-filled buffers
of the outputs' size and of the workspace's size are allocated and freed so that unwritten
elements would likely surface as NaN. The workspace matters: the fp32 dQ accumulator of the head
dims with the dQ writer is never cleared (its first key block stores), so a query block that the
postprocess read without any store would give NaN dQ.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from jax_fa3 import _ffi, _masks, _ops

pytestmark = pytest.mark.gpu

UNB = _masks.UNBOUNDED

_next_key = helpers.key_stream(4_2026_1130)


def _need(dtype, head_dim):
    helpers.skip_unless_kernel("bwd", dtype, head_dim)


def _first_compiled(dtype=jnp.bfloat16):
    for d in (128, 64, 96, 192, 256):
        if _ffi.unavailable_reason("bwd", dtype, d) is None:
            return d
    pytest.skip(f"no backward kernel compiled for {jnp.dtype(dtype).name}")


def _workspace_like(q):
    """float32 (batch, heads, seqlen_q + 128, head_dim + 2): about the backward's workspace (LSE,
    D and the dQ accumulator per query row, padded to any tile's rows)."""
    b, sq, h, d = q.shape
    return jax.ShapeDtypeStruct((b, h, sq + 128, d + 2), jnp.float32)


def _kernel_bwd(q, k, v, out, lse, dout, left, right, softcap, scale, deterministic=False):
    helpers.poison_heap(q, k, v, _workspace_like(q))
    grads = _ops.bwd(q, k, v, out, lse, dout, softmax_scale=scale, softcap=softcap,
                     window_left=left, window_right=right, deterministic=deterministic)
    return jax.device_get(grads)


def _baseline(q, k, v, dout, opts):
    """Plain XLA gradients in the input dtype, jitted (one compile instead of one per op)."""
    f = jax.jit(lambda q, k, v, do: helpers.plain_grads_in_dtype(q, k, v, do, **opts))
    return jax.device_get(f(q, k, v, dout))


def _check(b, sq, sk, hq, hkv, d, dtype, left=UNB, right=UNB, softcap=0.0, scale=None,
           logit_scale=1.0, oracle="f64"):
    _need(dtype, d)
    scale = 1.0 / np.sqrt(d) if scale is None else float(scale)
    q, k, v = helpers.random_qkv(_next_key(), b, sq, sk, hq, hkv, d, dtype, scale=logit_scale)
    dout = helpers.random_like(_next_key(), q)
    opts = dict(left=left, right=right, softcap=softcap, softmax_scale=scale)
    if oracle == "f64":
        out64, lse64 = helpers.reference_f64(q, k, v, **opts)
        ref = helpers.reference_grads_f64(q, k, v, dout, **opts)
    else:
        out64, lse64, *ref = jax.device_get(helpers.reference_grads_jax(q, k, v, dout, **opts))
    out = jnp.asarray(np.asarray(out64, np.float32)).astype(dtype)
    lse = jnp.asarray(np.asarray(lse64, np.float32))
    dq, dk, dv = _kernel_bwd(q, k, v, out, lse, dout, left, right, softcap, scale)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert dq.dtype == q.dtype and dk.dtype == k.dtype and dv.dtype == v.dtype
    base = _baseline(q, k, v, dout, opts)
    for name, got, r, bl in zip(("dq", "dk", "dv"), (dq, dk, dv), ref, base):
        helpers.assert_finite(name, got)
        helpers.assert_error_ratio(name, got, r, bl)
    return (q, k, v, out, lse, dout), (dq, dk, dv)


# --------------------------------------------------------------------------- head dim x dtype

@pytest.mark.parametrize("d", helpers.KERNEL_HEAD_DIMS)
@pytest.mark.parametrize("dtype", helpers.KERNEL_DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_head_dims(d, dtype, causal):
    _check(2, 129, 129, 2, 2, d, dtype, right=0 if causal else UNB)


@pytest.mark.parametrize("d", helpers.KERNEL_HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_head_dims_many_steps(d, causal):
    """Every head dim over enough query blocks (11 per head, 2 heads per kv head) that the
    Q/dO ring wraps several times (3 stages at hd64/96, 2 at hd128/192, 1 at hd256) and the dQ
    writer walks several query blocks and heads."""
    _check(1, 700, 650, 4, 2, d, jnp.bfloat16, right=0 if causal else UNB)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq,sk", [(1, 1), (17, 17), (127, 127), (128, 128), (1000, 1000),
                                   (17, 1000), (1000, 17), (129, 64), (1, 300)])
def test_seqlens(sq, sk, causal):
    d = _first_compiled()
    _check(1, sq, sk, 2, 1, d, jnp.bfloat16, right=0 if causal else UNB)


@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 4), (8, 1)], ids=["mha", "gqa2", "mqa8"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gqa(hq, hkv, causal):
    d = _first_compiled()
    _check(2, 257, 257, hq, hkv, d, jnp.bfloat16, right=0 if causal else UNB)


@pytest.mark.parametrize("left,right", [(32, 16), (64, 0), (0, 0), (200, -50), (-40, 100),
                                        (5, UNB), (UNB, -300)])
def test_windows(left, right):
    d = _first_compiled()
    _check(1, 600, 700, 2, 2, d, jnp.bfloat16, left=left, right=right)


# Steps in which one consumer warpgroup's 64 keys see none of the step's rows, which it skips
# (kSkipMaskedWg, bwd_main.cuh; d 96 and 128): the causal diagonal (warpgroup 1), a narrow
# window (either warpgroup), keys past seqlen_k (sk = 900: warpgroup 1 of the last key block
# has none).
@pytest.mark.parametrize("d", [96, 128])
@pytest.mark.parametrize("sq,sk,left,right", [(700, 900, UNB, 0), (900, 700, 40, 0), (640, 640, 32, 16)],
                         ids=["causal-sk900", "window40", "window32-16"])
def test_masked_warpgroup_steps(d, sq, sk, left, right):
    _check(1, sq, sk, 2, 1, d, jnp.bfloat16, left=left, right=right)


def test_fully_masked_rows_are_zero():
    """sq > sk causal: the first sq - sk query rows see no key (lse = -inf): zero dq, no NaN."""
    d = _first_compiled()
    (q, *_), (dq, dk, dv) = _check(1, 300, 100, 2, 2, d, jnp.bfloat16, right=0)
    assert (np.asarray(dq, np.float32)[:, :200] == 0).all()


def test_empty_band_all_zero():
    d = _first_compiled()
    (q, *_), (dq, dk, dv) = _check(1, 200, 200, 2, 1, d, jnp.bfloat16, left=3, right=-5)
    for g in (dq, dk, dv):
        assert (np.asarray(g, np.float32) == 0).all()


@pytest.mark.parametrize("dtype", helpers.KERNEL_DTYPES, ids=["bf16", "fp16"])
def test_softcap(dtype):
    d = _first_compiled(dtype)
    _check(2, 300, 300, 4, 2, d, dtype, softcap=20.0, logit_scale=4.0)
    _check(1, 257, 200, 2, 2, d, dtype, softcap=5.0, logit_scale=8.0, right=0)


def test_softmax_scale_and_large_logits():
    d = _first_compiled()
    _check(2, 200, 333, 2, 2, d, jnp.bfloat16, scale=0.3, logit_scale=3.0)
    _check(1, 200, 200, 2, 2, d, jnp.float16, logit_scale=6.0, right=0)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_long_sequence(causal):
    d = _first_compiled()
    _check(1, 4097, 4097, 2, 1, d, jnp.bfloat16, right=0 if causal else UNB, oracle="f32")


# Long bands: keys seen by up to 2101-2200 query rows, ragged last blocks, GQA. At hd128 these
# run the out-of-lockstep ping-pong tiles (keys seen by >= 2048 rows, bwd_traits.cuh), which
# short shapes never reach.
@pytest.mark.parametrize("dtype,left,right,softcap", [
    (jnp.bfloat16, UNB, 0, 0.0), (jnp.float16, UNB, 0, 0.0), (jnp.bfloat16, 1500, 600, 0.0),
    (jnp.bfloat16, UNB, 0, 30.0), (jnp.bfloat16, UNB, UNB, 0.0), (jnp.float16, UNB, UNB, 0.0),
], ids=["causal-bf16", "causal-fp16", "window-bf16", "causal-softcap", "full-bf16", "full-fp16"])
def test_long_bands(dtype, left, right, softcap):
    _check(1, 2200, 2200, 4, 2, 128, dtype, left=left, right=right, softcap=softcap, oracle="f32")


def test_long_band_deterministic_bitwise():
    _check_deterministic(2200, 2200, 4, 2, UNB, 0, runs=2)


def test_long_rows_deterministic_bitwise():
    """The unbanded hd128 ping-pong tile (2200 rows per key) in deterministic mode."""
    _check_deterministic(2200, 2200, 4, 2, UNB, UNB, runs=2)


def _tail_split_shape():
    """Kv heads for 2 key blocks per head (seqlen_k 256) and 2 more units than the device has
    SMs: the main kernel then runs one full wave of whole units and splits the last 2 units'
    query blocks over several CTAs each (bwd_order.cuh BwdTailSplit), so one call checks both
    kinds of CTA and the dK/dV tail kernel."""
    sms = getattr(jax.devices()[0], "core_count", None)
    assert sms, "the device reports no SM count (jax Device.core_count)"
    return sms // 2 + 1


@pytest.mark.parametrize("d", [d for d in helpers.KERNEL_HEAD_DIMS if d <= 128])
@pytest.mark.parametrize("group", [1, 2], ids=["mha", "gqa2"])
def test_tail_split(d, group):
    hkv = _tail_split_shape()
    _check(1, 700, 256, hkv * group, hkv, d, jnp.bfloat16)


def test_long_rows_tail_split():
    """The unbanded hd128 ping-pong tile (>= 2048 rows per key) with the tail split, as
    test_tail_split at 2100 rows."""
    hkv = _tail_split_shape()
    _check(1, 2100, 256, hkv, hkv, 128, jnp.bfloat16, oracle="f32")


def _check_deterministic(sq, sk, hq, hkv, left, right, runs):
    """`runs` deterministic kernel backward calls give bitwise equal dq/dk/dv, and the first
    passes the error-ratio check."""
    d = _first_compiled()
    q, k, v = helpers.random_qkv(_next_key(), 1, sq, sk, hq, hkv, d, jnp.bfloat16)
    dout = helpers.random_like(_next_key(), q)
    scale = 1.0 / np.sqrt(d)
    out64, lse64 = helpers.reference_f64(q, k, v, left=left, right=right)
    out = jnp.asarray(np.asarray(out64, np.float32)).astype(q.dtype)
    lse = jnp.asarray(np.asarray(lse64, np.float32))
    grads = [_kernel_bwd(q, k, v, out, lse, dout, left, right, 0.0, scale, deterministic=True)
             for _ in range(runs)]
    for other in grads[1:]:
        for name, a, b in zip(("dq", "dk", "dv"), grads[0], other):
            assert np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16)), name
    ref = helpers.reference_grads_f64(q, k, v, dout, left=left, right=right)
    base = _baseline(q, k, v, dout, dict(left=left, right=right))
    for name, got, r, bl in zip(("dq", "dk", "dv"), grads[0], ref, base):
        helpers.assert_error_ratio(name, got, r, bl)


def test_tail_split_deterministic_bitwise():
    hkv = _tail_split_shape()
    _check_deterministic(700, 256, hkv, hkv, UNB, UNB, runs=2)


@pytest.mark.parametrize("left,right,hkv", [
    (UNB, UNB, 4), (UNB, 0, 2), (100, 50, 4),
])
def test_deterministic_bitwise(left, right, hkv):
    _check_deterministic(700, 800, 4, hkv, left, right, runs=3)


def test_jit_and_vmap():
    """The op under jit and vmap (the batching rule folds the mapped axis into batch)."""
    d = _first_compiled()
    q, k, v = helpers.random_qkv(_next_key(), 3, 130, 130, 2, 2, d, jnp.bfloat16)
    dout = helpers.random_like(_next_key(), q)
    scale = 1.0 / np.sqrt(d)
    out64, lse64 = helpers.reference_f64(q, k, v, right=0)
    out = jnp.asarray(np.asarray(out64, np.float32)).astype(q.dtype)
    lse = jnp.asarray(np.asarray(lse64, np.float32))
    f = jax.jit(lambda *a: _ops.bwd(*a, softmax_scale=scale, softcap=0.0, window_left=UNB,
                                    window_right=0, deterministic=True))
    full = jax.device_get(f(q, k, v, out, lse, dout))
    split = [x[:, None] for x in (q, k, v, out, lse, dout)]
    mapped = jax.device_get(jax.vmap(f)(*split))
    for a, b in zip(full, mapped):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32)[:, 0])


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_gqa_window_many_steps(deterministic):
    """(Last in the file: a deterministic hang would end the suite here, not earlier.)
    GQA group of 4 with a window: each CTA walks a partial query-block range per head, so the
    dQ writer's pointer steps (next query block, next head of the group) and, deterministic, its
    turn taking are all exercised; the kernel is called directly."""
    d = _first_compiled()
    b, sq, sk, hq, hkv, left, right = 2, 1000, 1100, 8, 2, 150, 60
    q, k, v = helpers.random_qkv(_next_key(), b, sq, sk, hq, hkv, d, jnp.bfloat16)
    dout = helpers.random_like(_next_key(), q)
    scale = 1.0 / np.sqrt(d)
    out64, lse64 = helpers.reference_f64(q, k, v, left=left, right=right)
    out = jnp.asarray(np.asarray(out64, np.float32)).astype(q.dtype)
    lse = jnp.asarray(np.asarray(lse64, np.float32))
    got = _kernel_bwd(q, k, v, out, lse, dout, left, right, 0.0, scale, deterministic=deterministic)
    if deterministic:
        again = _kernel_bwd(q, k, v, out, lse, dout, left, right, 0.0, scale, deterministic=True)
        for name, a, c in zip(("dq", "dk", "dv"), got, again):
            assert np.array_equal(np.asarray(a).view(np.uint16), np.asarray(c).view(np.uint16)), name
    ref = helpers.reference_grads_f64(q, k, v, dout, left=left, right=right)
    base = _baseline(q, k, v, dout, dict(left=left, right=right))
    for name, g, r, bl in zip(("dq", "dk", "dv"), got, ref, base):
        helpers.assert_finite(name, g)
        helpers.assert_error_ratio(name, g, r, bl)


def _train_losses(impl, dtype, d, steps=12):
    """Loss per step of a tiny causal GQA attention layer trained with SGD (float32 params,
    attention in `dtype`): impl "cuda" / "xla" through jax_fa3's public API, "plain" through
    jax.nn.dot_product_attention (XLA, dense, in `dtype`)."""
    from jax_fa3 import flash_attention

    def attention(q, k, v):
        if impl == "plain":
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
        return flash_attention(q, k, v, causal=True, implementation=impl)

    b, s, hq, hkv, width = 2, 200, 4, 2, 64
    keys = jax.random.split(jax.random.key(7), 3)
    x = jax.random.normal(keys[0], (b, s, width), jnp.float32)

    def init(key):
        kq, kk, kv, ko = jax.random.split(key, 4)
        w = lambda k, n, m: jax.random.normal(k, (n, m), jnp.float32) / np.sqrt(n)
        return dict(wq=w(kq, width, hq * d), wk=w(kk, width, hkv * d), wv=w(kv, width, hkv * d),
                    wo=w(ko, hq * d, width))

    def forward(p):
        heads = lambda w, h: (x @ w).reshape(b, s, h, d).astype(dtype)
        o = attention(heads(p["wq"], hq), heads(p["wk"], hkv), heads(p["wv"], hkv))
        return o.astype(jnp.float32).reshape(b, s, hq * d) @ p["wo"]

    target = forward(init(keys[1]))  # a teacher of the same shape: the loss can fall far
    params = init(keys[2])
    loss = lambda p: jnp.mean((forward(p) - target) ** 2)

    @jax.jit
    def step(p):
        value, grads = jax.value_and_grad(loss)(p)
        return jax.tree.map(lambda w, g: w - 5.0 * g, p, grads), value

    losses = []
    for _ in range(steps):
        params, value = step(params)
        losses.append(float(value))
    return np.array(losses)


def test_training_steps_match_portable():
    """A few SGD steps of a tiny attention model: the loss curve with the kernels (forward and
    backward, bf16) follows the float32 portable run at least as closely as plain XLA attention
    in bf16 does (the error-ratio rule, applied to losses; slack 1e-3 relative), the bf16
    portable run does too, and the loss falls."""
    d = _first_compiled()
    helpers.skip_unless_kernel("fwd", jnp.bfloat16, d)  # a backward-only build has no forward
    exact = _train_losses("xla", jnp.float32, d)
    plain = _train_losses("plain", jnp.bfloat16, d)
    assert exact[-1] < 0.5 * exact[0], exact
    budget = 2 * np.abs(plain - exact) + 1e-3 * np.abs(exact)
    for impl in ("cuda", "xla"):
        got = _train_losses(impl, jnp.bfloat16, d)
        assert np.all(np.abs(got - exact) <= budget), (impl, got, plain, exact)


def test_checkpoint_recomputes_through_the_kernel():
    """jax.checkpoint around attention: value_and_grad runs the forward kernel once more (the
    recomputation in the backward; one backward call either way) and the gradients equal the
    un-rematerialised ones. (Lowered StableHLO names targets as `@name(`.)"""
    from jax_fa3 import flash_attention
    d = _first_compiled()
    helpers.skip_unless_kernel("fwd", jnp.bfloat16, d)
    q, k, v = helpers.random_qkv(_next_key(), 1, 300, 300, 4, 2, d, jnp.bfloat16)
    # deterministic: the two runs' dQ sums must come out in the same order to compare bitwise.
    loss = lambda q, k, v: flash_attention(q, k, v, causal=True, deterministic=True,
                                           implementation="cuda").astype(jnp.float32).sum()
    plain = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    remat = jax.jit(jax.value_and_grad(jax.checkpoint(loss), argnums=(0, 1, 2)))
    calls = lambda f, target: f.lower(q, k, v).as_text().count(f"@{target}(")
    assert (calls(plain, _ffi.FWD_TARGET), calls(plain, _ffi.BWD_TARGET)) == (1, 1)
    assert (calls(remat, _ffi.FWD_TARGET), calls(remat, _ffi.BWD_TARGET)) == (2, 1)
    (value, grads), (value_r, grads_r) = plain(q, k, v), remat(q, k, v)
    assert float(value) == float(value_r)
    for a, b in zip(grads, grads_r):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
