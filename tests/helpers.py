"""Shared test helpers: random inputs, THE oracle (one dense reference: numpy float64, or JAX
float32 at HIGHEST precision), the plain-XLA baseline and the error-ratio check of
docs/architecture.md ("error vs the oracle <= 2x the error of plain attention computed in the
input dtype, plus a small slack").

The oracle's numpy form is float64 so no test needs `jax_enable_x64`. v may have its own head
dim (out takes it). Attention sinks (`sinks`, one logit per query head, gpt-oss style) add
exp(sinks[h]) to each row's softmax denominator, like one more key with value 0: every helper
takes them as the keyword `sinks` (an array; None = none). Mask options follow
jax_fa3/_masks.py: a band (left, right) around the bottom-right-aligned diagonal, where query i
sees key j iff  -left <= j - i - (seqlen_k - seqlen_q) <= right.  Every helper takes either the
public options (`causal`, `window_size`) or the normalised `left`/`right` directly (ring tests
use shifted bands with negative bounds).

Packed documents: every helper also takes `segments=(q_ids, kv_ids, q_pos, kv_pos)` (numpy or
jax (batch, seqlen) ints; kv_ids None = q_ids; positions None or both): query i sees key j
only when the ids are equal and not 0 (padding) and the band allows it, the band over the
row index without positions, over the positions with them (-left <= kv_pos[j] - q_pos[i] <=
right). `segment_mask` is that rule, written here on its own (not jax_fa3/segments.py's).

GPU kernel tests import this module; keep its signatures stable.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

UNBOUNDED = 1 << 30  # jax_fa3._masks.UNBOUNDED; repeated so the helpers import nothing of ours


# ----------------------------------------------------------------------------- inputs

def _rng(key):
    """A numpy Generator seeded from a JAX PRNG key (typed or raw) or an int. Inputs are drawn
    with numpy: jax.random compiles per shape, which dominates a CPU test's time."""
    if isinstance(key, (int, np.integer)):
        return np.random.default_rng(int(key))
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return np.random.default_rng(np.asarray(key).astype(np.uint32).ravel().tolist())


def key_stream(seed):
    """A function returning a fresh PRNG key on each call (one reproducible stream per module)."""
    state = [jax.random.PRNGKey(seed)]

    def next_key():
        state[0], key = jax.random.split(state[0])
        return key
    return next_key


# What the kernels are built for (the CMake default set): the GPU tests' parameter grid.
KERNEL_HEAD_DIMS = (64, 96, 128, 192, 256)
KERNEL_DTYPES = (jnp.bfloat16, jnp.float16)


def skip_unless_kernel(direction, dtype, head_dim, head_dim_v=None):
    """Skip the calling test, with the reason, when the `direction` kernel cannot run this
    dtype and head dims (q/k's, v's: default the same) here (the one helper that asks
    jax_fa3: availability, not numerics)."""
    import pytest
    from jax_fa3 import _ffi
    reason = _ffi.unavailable_reason(direction, dtype, head_dim, head_dim_v)
    if reason is not None:
        pytest.skip(reason)


def skip_unless_kernels(dtype, head_dim, head_dim_v=None, directions=("fwd", "bwd")):
    """skip_unless_kernel for each of `directions`."""
    for direction in directions:
        skip_unless_kernel(direction, dtype, head_dim, head_dim_v)


def random_qkv(key, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype, scale=1.0,
               head_dim_v=None):
    """Fresh standard-normal (q, k, v) in `dtype`; q is multiplied by `scale`, so logits
    (with the default softmax scale) have standard deviation about `scale`: scale > 1 gives
    large logits and peaked softmaxes. v's head dim is `head_dim_v` (default head_dim).
    `key`: a JAX PRNG key or an int seed."""
    rng = _rng(key)
    dv = head_dim if head_dim_v is None else head_dim_v
    q = rng.standard_normal((batch, seqlen_q, heads_q, head_dim), np.float32) * scale
    k = rng.standard_normal((batch, seqlen_k, heads_kv, head_dim), np.float32)
    v = rng.standard_normal((batch, seqlen_k, heads_kv, dv), np.float32)
    return tuple(jnp.asarray(x.astype(jnp.dtype(dtype))) for x in (q, k, v))


def random_sinks(key, heads_q, loc=1.0, scale=2.0):
    """Fresh float32 (heads_q,) sink logits, normal with mean `loc` and standard deviation
    `scale`: next to standard-normal logits over tens to hundreds of keys, some sinks take
    little weight and some most of it."""
    values = loc + scale * _rng(key).standard_normal((heads_q,), np.float32)
    return jnp.asarray(values, jnp.float32)


def random_like(key, x, scale=1.0):
    """Standard-normal array with the shape and dtype of `x` (e.g. an output cotangent)."""
    values = _rng(key).standard_normal(tuple(x.shape), np.float32) * scale
    return jnp.asarray(values.astype(jnp.dtype(x.dtype)))


def poison_heap(*arrays):
    """Allocate and free NaN buffers the size of `arrays` (a kernel's outputs), so that elements
    a kernel leaves unwritten would likely surface as NaN."""
    junk = [jnp.full(a.shape, jnp.nan, a.dtype) for a in arrays]
    jax.block_until_ready(junk)
    del junk


def poison_like(x):
    """An array shaped like `x` filled with NaN: use it where a buffer must be fully
    overwritten, then `assert_finite` the result."""
    return jnp.full(x.shape, jnp.nan, dtype=x.dtype)


def assert_finite(name, x, allow_neg_inf=False):
    """Every element of `x` is finite (or -inf where allowed, as in the LSE of fully masked
    rows): catches unwritten poisoned elements and NaN/Inf leaks."""
    a = _f64(x)
    bad = np.isnan(a) | (np.isposinf(a)) | (np.isneginf(a) & (not allow_neg_inf))
    if bad.any():
        idx = np.argwhere(bad)[:5].tolist()
        raise AssertionError(f"{name}: {int(bad.sum())} of {a.size} elements are NaN/Inf "
                             f"(first at {idx}); shape {a.shape}")


# ----------------------------------------------------------------------------- masks

def resolve_band(seqlen_q=None, seqlen_k=None, *, causal=False, window_size=(-1, -1),
                 left=None, right=None):
    """(left, right) from the public options, or the given left/right when set."""
    if left is not None or right is not None:
        return (UNBOUNDED if left is None else int(left)), (UNBOUNDED if right is None else int(right))
    wl, wr = window_size
    wl = UNBOUNDED if wl < 0 else int(wl)
    wr = UNBOUNDED if wr < 0 else int(wr)
    if causal:
        wr = min(wr, 0)
    return wl, wr


def band_mask(seqlen_q, seqlen_k, left, right):
    """Boolean (seqlen_q, seqlen_k): True where query i may see key j."""
    i = np.arange(seqlen_q)[:, None]
    j = np.arange(seqlen_k)[None, :]
    rel = j - i - (seqlen_k - seqlen_q)
    return (rel >= -left) & (rel <= right)


def segment_mask(segments, seqlen_q, seqlen_k, left, right):
    """Boolean (batch, 1, seqlen_q, seqlen_k) of `segments` = (q_ids, kv_ids, q_pos, kv_pos)
    with the band (left, right) (module docstring): equal nonzero ids and the band, over the
    row index without positions and over the positions with them."""
    q_ids, kv_ids, q_pos, kv_pos = (tuple(segments) + (None,) * 4)[:4]
    q_ids = np.asarray(q_ids, np.int64)
    kv_ids = q_ids if kv_ids is None else np.asarray(kv_ids, np.int64)
    if (q_pos is None) != (kv_pos is None):
        q_pos = kv_pos if q_pos is None else q_pos
        kv_pos = q_pos if kv_pos is None else kv_pos
    same = (q_ids[:, :, None] == kv_ids[:, None, :]) & (q_ids[:, :, None] != 0)
    if q_pos is None:
        band = band_mask(seqlen_q, seqlen_k, left, right)[None]
    else:
        rel = np.asarray(kv_pos, np.int64)[:, None, :] - np.asarray(q_pos, np.int64)[:, :, None]
        band = (rel >= -left) & (rel <= right)
    return (same & band)[:, None]


def _f64(x):
    """Any array (jax, numpy, bf16 via ml_dtypes) as numpy float64, without going through
    jnp (which would drop float64 to float32 when x64 is off)."""
    return np.asarray(x).astype(np.float64)


# ----------------------------------------------------------------------------- oracle
#
# One dense reference, written once over an array module `xp`: numpy in float64
# (`reference_f64`, the oracle of every numerics check) or jax.numpy in float32 at
# Precision.HIGHEST (`reference_jax`: jittable and differentiable, for sequences too long for
# numpy and for gradients through model weights; float64 for float64 inputs under x64).
# Arrays are (..., seqlen, heads, head_dim); K/V heads are repeated, the score matrix formed.

def _compute(xp, x):
    """x in the oracle's compute dtype: numpy float64, or JAX float32 (float64 stays)."""
    if xp is np:
        return _f64(x)
    return jnp.asarray(x).astype(jnp.promote_types(jnp.asarray(x).dtype, jnp.float32))


def _einsum(xp, spec, a, b):
    if xp is np:
        return np.einsum(spec, a, b)
    return jnp.einsum(spec, a, b, precision=jax.lax.Precision.HIGHEST)


def _expand_kv(xp, x, heads_q):
    """(..., s, hkv, d) -> (..., s, hq, d): query head h reads kv head h // (hq // hkv)."""
    return xp.repeat(x, heads_q // x.shape[-2], axis=-2)


def _sum_groups(x, heads_kv):
    """(..., s, hq, d) -> (..., s, hkv, d): sum the query heads of each kv group."""
    *lead, s, hq, d = x.shape
    return x.reshape(*lead, s, heads_kv, hq // heads_kv, d).sum(axis=-2)


def _scores(xp, q, k, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
            left=None, right=None, bias=None, mask=None, segments=None):
    """Scores (..., hq, sq, sk) in the compute dtype, the allowed mask, tanh(raw/softcap) or
    None, and the scale."""
    q = _compute(xp, q)
    k = _expand_kv(xp, _compute(xp, k), q.shape[-2])
    sq, sk, d = q.shape[-3], k.shape[-3], q.shape[-1]
    scale = 1.0 / np.sqrt(d) if softmax_scale is None else float(softmax_scale)
    s = _einsum(xp, "...qhd,...khd->...hqk", q, k) * scale
    t = None
    if softcap:
        t = xp.tanh(s / softcap)
        s = softcap * t
    if bias is not None:
        s = s + _compute(xp, bias)
    lo, hi = resolve_band(causal=causal, window_size=window_size, left=left, right=right)
    if segments is None:
        allowed = xp.asarray(band_mask(sq, sk, lo, hi))
    else:  # (b, 1, sq, sk): heads broadcast
        allowed = xp.asarray(segment_mask(segments, sq, sk, lo, hi))
    if mask is not None:
        allowed = allowed & xp.asarray(mask, bool)
    return s, xp.broadcast_to(allowed, s.shape), t, scale


def _sink_column(xp, sinks, like):
    """(hq,) sinks as (hq, 1), in the compute dtype of `like` (scores (..., hq, sq, sk)):
    each row's extra logit."""
    return _compute(xp, sinks).astype(like.dtype)[:, None]


def _probabilities(xp, s, allowed, sinks=None):
    """Softmax over the allowed keys (and the sink, whose value is 0) and the LSE; rows that
    see no key: p 0, lse -inf (lse = the sink with sinks). Also the sink's probability
    (..., hq, sq) (0 without sinks)."""
    s = xp.where(allowed, s, -np.inf)
    m = s.max(axis=-1)
    if sinks is not None:
        sink = _sink_column(xp, sinks, s)  # (hq, 1)
        m = xp.maximum(m, sink)
    m = xp.where(xp.isfinite(m), m, 0.0)[..., None]
    if xp is not np:
        m = jax.lax.stop_gradient(m)  # softmax is shift invariant
    p = xp.where(allowed, xp.exp(s - m), 0.0)
    l = p.sum(axis=-1)
    p_sink = xp.zeros_like(l)
    if sinks is not None:
        p_sink = xp.exp(sink - m[..., 0])
        l = l + p_sink
    l_safe = xp.where(l > 0, l, 1.0)
    lse = xp.where(l > 0, m[..., 0] + xp.log(l_safe), -np.inf)
    return p / l_safe[..., None], lse, p_sink / l_safe


def _reference(xp, q, k, v, sinks=None, **opts):
    s, allowed, _, _ = _scores(xp, q, k, **opts)
    p, lse, _ = _probabilities(xp, s, allowed, sinks)
    out = _einsum(xp, "...hqk,...khd->...qhd", p, _expand_kv(xp, _compute(xp, v), q.shape[-2]))
    return out, lse


def reference_f64(q, k, v, **opts):
    """Dense attention in numpy float64: (out (..., sq, hq, dv), lse (..., hq, sq)).

    opts: softmax_scale, causal, window_size, softcap, left, right (override the band),
    bias and mask (broadcastable to (..., hq, sq, sk), added/applied after softcap), sinks
    ((hq,) logits, in the units of the scaled, capped scores), segments ((q_ids, kv_ids,
    q_pos, kv_pos): packed documents, module docstring). Fully masked rows give out 0 and
    lse -inf (the sink with sinks)."""
    return _reference(np, q, k, v, **opts)


def reference_jax(q, k, v, **opts):
    """`reference_f64` in JAX: float32 at Precision.HIGHEST (float64 for float64 inputs under
    x64), jittable and differentiable; for long sequences and gradients through weights."""
    return _reference(jnp, q, k, v, **opts)


def reference_grads_jax(q, k, v, dout, sinks=None, **opts):
    """(out, lse, dq, dk, dv) of `reference_jax`, the gradients by autodiff, on the default
    device (the backward oracle for sequences too long for numpy); with `sinks`, dsinks
    too, last."""
    args = tuple(_compute(jnp, x) for x in (q, k, v)) + (
        () if sinks is None else (_compute(jnp, sinks),))
    f = lambda q, k, v, *s: reference_jax(q, k, v, sinks=s[0] if s else None, **opts)
    (out, lse), vjp = jax.vjp(f, *args)
    return (out, lse) + vjp((_compute(jnp, dout), jnp.zeros_like(lse)))


def reference_grads_f64(q, k, v, dout, dlse=None, sinks=None, **opts):
    """Exact float64 gradients (dq, dk, dv) of `reference_f64` for the output cotangent
    `dout` (and optionally an LSE cotangent `dlse` (..., hq, sq)); with `sinks`, (dq, dk,
    dv, dsinks).

    Derivation: with P the probabilities (sink included in the denominator), out = P v and
    lse = log(sum exp(s) + exp(sink)): dS = P * (dP - D + dlse) with D = rowsum(dout * out);
    the sink's probability p0 = exp(sink - lse) gives d out/d sink = -p0 * out and
    d lse/d sink = p0, so dsinks[h] = sum over rows (and leading axes) of p0 * (dlse - D)."""
    s, allowed, t, scale = _scores(np, q, k, **opts)
    hq, hkv = q.shape[-2], k.shape[-2]
    q64, k64 = _f64(q), _expand_kv(np, _f64(k), hq)
    v64, do = _expand_kv(np, _f64(v), hq), _f64(dout)
    p, _, p_sink = _probabilities(np, s, allowed, sinks)
    out = np.einsum("...hqk,...khd->...qhd", p, v64)
    dv = np.einsum("...hqk,...qhd->...khd", p, do)
    dp = np.einsum("...qhd,...khd->...hqk", do, v64)
    g_row = -np.einsum("...qhd,...qhd->...hq", do, out)  # -D (+ dlse)
    if dlse is not None:
        g_row = g_row + _f64(dlse)
    ds = p * (dp + g_row[..., None])
    if t is not None:
        ds = ds * (1.0 - t * t)
    dq = np.einsum("...hqk,...khd->...qhd", ds, k64) * scale
    dk = np.einsum("...hqk,...qhd->...khd", ds, q64) * scale
    grads = (dq, _sum_groups(dk, hkv), _sum_groups(dv, hkv))
    if sinks is None:
        return grads
    per_head = (p_sink * g_row).reshape(-1, hq, p_sink.shape[-1])  # (lead, hq, sq)
    return grads + (per_head.sum(axis=(0, 2)),)


# ----------------------------------------------------------------------------- baseline

def _plain(q, k, v, sinks=None, allowed=None, *, softmax_scale=None, causal=False,
           window_size=(-1, -1), softcap=0.0, left=None, right=None):
    """Dense attention done naively in the input dtype (scores, softmax and products all
    rounded to q.dtype; the sinks too): the baseline whose error sets the tolerance.
    `allowed`: None (the band), or the whole boolean mask (b, 1, sq, sk) (segments)."""
    dtype = q.dtype
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    k = jnp.repeat(k, hq // k.shape[2], axis=2)
    v = jnp.repeat(v, hq // v.shape[2], axis=2)
    scale = 1.0 / np.sqrt(d) if softmax_scale is None else float(softmax_scale)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(dtype) * jnp.asarray(scale, dtype)
    if softcap:
        s = jnp.asarray(softcap, dtype) * jnp.tanh(s / jnp.asarray(softcap, dtype))
    lo, hi = resolve_band(causal=causal, window_size=window_size, left=left, right=right)
    if allowed is None:
        allowed = jnp.asarray(band_mask(sq, sk, lo, hi))
    s = jnp.where(allowed, s, -jnp.inf)
    m = s.max(axis=-1, keepdims=True)
    if sinks is not None:
        sink = sinks.astype(dtype)[:, None, None]  # (hq, 1, 1)
        m = jnp.maximum(m, sink)
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0).astype(dtype))
    p = jnp.where(allowed, jnp.exp(s - m), 0).astype(dtype)
    l = p.sum(axis=-1, keepdims=True).astype(dtype)
    if sinks is not None:
        l = (l + jnp.exp(sink - m)).astype(dtype)
    lse = jnp.where(l[..., 0] > 0, m[..., 0] + jnp.log(jnp.where(l > 0, l, 1)[..., 0]), -jnp.inf)
    p = (p / jnp.where(l > 0, l, 1)).astype(dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", p, v).astype(dtype)
    return out, lse.astype(jnp.float32)


_OPTS = ("softmax_scale", "causal", "window_size", "softcap", "left", "right")


def _static(opts):
    """Options as a hashable tuple (for jit's static arguments)."""
    unknown = set(opts) - set(_OPTS)
    if unknown:
        raise TypeError(f"unknown options {sorted(unknown)}; expected some of {_OPTS} "
                        f"(and segments)")
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in opts.items()))


def _plain_args(q, k, opts):
    """(allowed, static options) of the baseline: segments become its whole mask."""
    opts = dict(opts)
    segments = opts.pop("segments", None)
    if segments is None:
        return None, _static(opts)
    lo, hi = resolve_band(causal=opts.get("causal", False),
                          window_size=opts.get("window_size", (-1, -1)),
                          left=opts.get("left"), right=opts.get("right"))
    return jnp.asarray(segment_mask(segments, q.shape[1], k.shape[1], lo, hi)), _static(opts)


@functools.partial(jax.jit, static_argnums=5)
def _plain_jit(q, k, v, sinks, allowed, opts):
    return _plain(q, k, v, sinks, allowed, **dict(opts))


@functools.partial(jax.jit, static_argnums=7)
def _plain_fwd_bwd_jit(q, k, v, sinks, dout, dlse, allowed, opts):
    """out, lse and the gradients (dq, dk, dv[, dsinks]) of the baseline, in the input
    dtype (the sinks, float32 in, rounded to it: dsinks comes back in it too), for the
    cotangents dout and dlse (None: zero)."""
    args = (q, k, v) + (() if sinks is None else (sinks.astype(q.dtype),))
    f = lambda q, k, v, *s: _plain(q, k, v, s[0] if s else None, allowed, **dict(opts))
    (out, lse), vjp = jax.vjp(f, *args)
    dlse = jnp.zeros_like(lse) if dlse is None else dlse.astype(lse.dtype)
    return out, lse, vjp((dout.astype(q.dtype), dlse))


def plain_in_dtype(q, k, v, return_lse=False, sinks=None, **opts):
    """The baseline output (and its LSE as float32 when `return_lse`)."""
    out, lse = _plain_jit(q, k, v, sinks, *_plain_args(q, k, opts))
    return (out, lse) if return_lse else out


def plain_grads_in_dtype(q, k, v, dout, sinks=None, **opts):
    """Gradients (dq, dk, dv) of the baseline, by autodiff in the input dtype; with
    `sinks`, (dq, dk, dv, dsinks)."""
    return _plain_fwd_bwd_jit(q, k, v, sinks, dout, None, *_plain_args(q, k, opts))[2]


# ----------------------------------------------------------------------------- the check

def error_of(got, ref):
    """max |got - ref| over the elements where ref is finite (float64)."""
    got, ref = _f64(got), _f64(ref)
    fin = np.isfinite(ref)
    return float(np.abs(got[fin] - ref[fin]).max()) if fin.any() else 0.0


def assert_error_ratio(name, got, ref, baseline, ratio=2.0, slack=None):
    """err(got) <= ratio * err(baseline) + slack, errors measured as max abs deviation from
    the float64 `ref`. Non-finite entries of `ref` (LSE -inf of fully masked rows) must be
    matched exactly by `got`. Default slack: one unit in the last place of the output dtype
    at the largest reference magnitude."""
    ref64 = _f64(ref)
    got64 = _f64(got)
    if got64.shape != ref64.shape:
        raise AssertionError(f"{name}: shape {got64.shape}, expected {ref64.shape}")
    nonfinite = ~np.isfinite(ref64)
    if (got64[nonfinite] != ref64[nonfinite]).any() or np.isnan(got64).any():
        raise AssertionError(f"{name}: non-finite entries differ from the reference "
                             f"(NaN in got: {int(np.isnan(got64).sum())}, "
                             f"ref non-finite: {int(nonfinite.sum())})")
    if not np.isfinite(got64[~nonfinite]).all():
        raise AssertionError(f"{name}: Inf where the reference is finite")
    scale = float(np.abs(ref64[~nonfinite]).max()) if (~nonfinite).any() else 0.0
    if slack is None:
        slack = float(jnp.finfo(np.asarray(got).dtype).eps) * max(scale, 1e-3)
    err, base = error_of(got64, ref64), error_of(baseline, ref64)
    bound = ratio * base + slack
    assert err <= bound, (f"{name}: error {err:.3e} > {ratio} x baseline error {base:.3e} "
                          f"+ slack {slack:.1e} (= {bound:.3e}); max |ref| = {scale:.3e}")
    return err, base


def check_against_oracle(name, q, k, v, out=None, lse=None, grads=None, dout=None, ratio=2.0,
                         sinks=None, dlse=None, **opts):
    """Assert the error-ratio rule for whichever of out, lse and grads (dq, dk, dv for the
    output cotangent `dout` and the LSE cotangent `dlse` (None: none), and dsinks after them
    when there are `sinks`) are given, against the float64 oracle and the plain baseline
    with the same `opts`. Also checks that nothing is NaN (lse may be -inf where the oracle
    is). Returns {quantity: (error, baseline error)}."""
    errors = {}
    if grads is not None:  # one compile for the whole baseline
        base_out, base_lse, base_grads = _plain_fwd_bwd_jit(q, k, v, sinks, dout, dlse,
                                                            *_plain_args(q, k, opts))
    else:
        base_out, base_lse = plain_in_dtype(q, k, v, return_lse=True, sinks=sinks, **opts)
    ref_out, ref_lse = reference_f64(q, k, v, sinks=sinks, **opts)
    if out is not None:
        assert_finite(f"{name} out", out)
        errors["out"] = assert_error_ratio(f"{name} out", out, ref_out, base_out, ratio)
    if lse is not None:
        assert_finite(f"{name} lse", lse, allow_neg_inf=True)
        errors["lse"] = assert_error_ratio(f"{name} lse", lse, ref_lse, base_lse, ratio)
    if grads is not None:
        names = ("dq", "dk", "dv") + (() if sinks is None else ("dsinks",))
        if len(grads) != len(names):
            raise AssertionError(f"{name}: {len(grads)} gradients, expected {names}")
        ref_grads = reference_grads_f64(q, k, v, dout, dlse=dlse, sinks=sinks, **opts)
        # The FlashAttention backward forms dS = P * (dP - D) with D = rowsum(dout * out): a
        # cancellation whose float32 rounding is of order eps32 * sum|dout * out| per row even
        # where the exact gradient vanishes (one key: dq = dk = 0); dk sums it over the query
        # rows (sqrt(seqlen_q) for independent roundings). That floors the slack.
        eps = float(jnp.finfo(np.asarray(grads[0]).dtype).eps)
        d_abs = np.abs(_f64(dout) * ref_out).sum(axis=-1)  # (..., sq, hq)
        scale = opts.get("softmax_scale") or 1.0 / np.sqrt(q.shape[-1])
        qk = scale * max(np.abs(_f64(q)).max(), np.abs(_f64(k)).max())
        floor = float(np.finfo(np.float32).eps) * d_abs.max() * max(1.0, qk) * np.sqrt(q.shape[1])
        slacks = [eps * max(np.abs(ref).max(), 1e-3) + floor for ref in ref_grads[:3]]
        if sinks is not None:
            slacks.append(_sinks_grad_slack(q, sinks, ref_lse, d_abs, ref_grads[3]))
        for gname, got, ref, base, slack in zip(names, grads, ref_grads, base_grads, slacks):
            assert_finite(f"{name} {gname}", got)
            errors[gname] = assert_error_ratio(f"{name} {gname}", got, ref, base, ratio, slack)
    return errors


def _sinks_grad_slack(q, sinks, ref_lse, d_abs, ref_dsinks):
    """Slack of dsinks = sum over rows of p0 * (dlse - D), p0 = exp(sink - lse): the rows' D
    come from the forward's output rounded to q's dtype (relative error eps_q per element)
    and are summed in float32, so a correct backward is off by up to about
    (eps_q + eps32) * sum over rows of p0 * sum|dout * out|; plus one float32 ulp."""
    lse = _f64(ref_lse)  # (..., hq, sq)
    p0 = np.exp(np.minimum(_f64(sinks)[:, None] - np.where(np.isfinite(lse), lse, np.inf), 0.0))
    rows = (p0 * np.swapaxes(d_abs, -1, -2)).reshape(-1, lse.shape[-2], lse.shape[-1])
    eps_q, eps32 = float(jnp.finfo(q.dtype).eps), float(np.finfo(np.float32).eps)
    return ((eps_q + eps32) * rows.sum(axis=(0, 2)).max()
            + eps32 * max(np.abs(_f64(ref_dsinks)).max(), 1e-3))
