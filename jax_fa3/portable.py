"""Portable attention in pure JAX: the same semantics as the Hopper kernels, on any backend.

`forward` / `backward` are blockwise FlashAttention: a `lax.scan` over blocks of keys/values
with an online softmax, so memory is O(seqlen_q * block_k) per (batch, head), never the full
seqlen_q x seqlen_k matrix. Accumulation is float32 (or float64 for float64 inputs); products
take their operands in the input dtype with float32 results, as the kernels do. The backward
recomputes the probabilities from the saved LSE (P = exp(S - lse)) and uses D = rowsum(dO * O),
so given the *final* out/lse of a merged (e.g. ring) attention it returns the exact partial
gradients of the keys/values it sees.

`dense` is the masked/biased variant for what the band cannot express (a bias, a dense boolean
mask): plain differentiable JAX, the score matrix materialised (the bias/mask already is).

Masks are a band (left, right) (see jax_fa3/_masks.py): query i sees key j iff
-left <= j - i - (seqlen_k - seqlen_q) <= right; any ints, negative allowed. Optionally a
per-batch number of valid keys `kv_lengths` (b,). A query row that sees no key gets out = 0 and
lse = -inf, and zero gradients; no NaN anywhere.

v may have its own head dim dv (out takes it). Attention sinks (`sinks`, (hq,) float32, as in
gpt-oss): each row's softmax denominator gains exp(sinks[h]), like one more key with logit
sinks[h] and value 0; lse includes it, and a row that sees no key gets out 0 and lse
sinks[h]. The backward needs no sinks: P = exp(S - lse) with the sink-including lse is exact.
Their own gradient is `sinks_grad`. A sink of -inf takes no weight (the same as none).

Packed documents (`segments`, a jax_fa3.segments.Segments): query i sees key j only when their
segment ids are equal and not 0 (padding), for ANY ids (no contract here); with positions the
band follows them (-left <= kv_pos[j] - q_pos[i] <= right) instead of the row index. Padding
rows see nothing: out 0, lse -inf (or the sink), zero gradients.

GQA/MQA: q is viewed as (b, sq, heads_kv, group, d); K/V are never repeated.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jax_fa3 import segments as _segments
from jax_fa3._masks import UNBOUNDED, band_mask
from jax_fa3._vma import varying_like

DEFAULT_BLOCK_K = 128


# ----------------------------------------------------------------------------- small pieces

def _acc_dtype(dtype):
    """float32 accumulation, float64 for float64 inputs."""
    return jnp.promote_types(dtype, jnp.float32)


def _mm(spec, a, b, dtype):
    """einsum with operands cast to the compute `dtype` and results in its accumulation dtype;
    full precision for 32/64-bit so GPUs do not drop to TF32."""
    acc = _acc_dtype(dtype)
    precision = lax.Precision.HIGHEST if jnp.dtype(dtype).itemsize >= 4 else None
    return jnp.einsum(spec, a.astype(dtype), b.astype(dtype), precision=precision,
                      preferred_element_type=acc)


def _scores(qg, kb, scale, softcap, dtype):
    """Scores (b, hkv, g, sq, bk) and tanh(raw / softcap) (None when softcap is off)."""
    s = _mm("bqhgd,bkhd->bhgqk", qg, kb, dtype) * scale
    if softcap:
        t = jnp.tanh(s / softcap)
        return softcap * t, t
    return s, None


def _visible(qpos, kpos, seqlen_q, seqlen_k, left, right, kv_lengths, segments=None):
    """Boolean mask broadcastable to (b, hkv, g, sq, bk): inside the band, a real key (not
    padding), below the batch's kv length, and in the query's document (`segments`, its kv
    arrays this block's). With positions the documents' band replaces the row-index band.
    Bounds that cannot bind are left out."""
    rel = kpos[None, :] - qpos[:, None] - (seqlen_k - seqlen_q)  # (sq, bk)
    ok = kpos[None, :] < seqlen_k
    positional = segments is not None and segments.has_positions
    if left < seqlen_k and not positional:  # rel >= -(seqlen_k - 1), so larger left never binds
        ok = ok & (rel >= -left)
    if right < seqlen_q and not positional:  # rel <= seqlen_q - 1 always
        ok = ok & (rel <= right)
    ok = ok[None, None, None]
    if kv_lengths is not None:
        ok = ok & (kpos < kv_lengths[:, None])[:, None, None, None, :]
    if segments is not None:
        ok = ok & _segments.visibility(segments, left, right)[:, None, None]
    return ok


def key_range(seqlen_q: int, seqlen_k: int, left: int, right: int,
              positional: bool = False) -> tuple[int, int]:
    """[start, stop) of the keys any query row can see under the band; empty when none. A
    band over positions (`positional`) is either empty or may reach every key."""
    if left + right < 0:
        return 0, 0
    if positional:
        return (0, seqlen_k) if seqlen_k else (0, 0)
    offset = seqlen_k - seqlen_q
    start = max(0, offset - left)
    stop = min(seqlen_k, seqlen_q + offset + right)
    return (start, stop) if start < stop else (0, 0)


def _blocks(x, start, stop, block_k):
    """Keys [start, stop) of x (b, sk, h, d) as (n_blocks, b, block_k, h, d), zero-padded."""
    x = x[:, start:stop]
    n = -(-(stop - start) // block_k)
    pad = n * block_k - (stop - start)
    x = jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)))
    return jnp.moveaxis(x.reshape(x.shape[0], n, block_k, *x.shape[2:]), 1, 0)


def _segment_blocks(segments, start, stop, block_k):
    """The kv arrays of `segments` as (n_blocks, b, block_k) blocks like `_blocks` (padding
    id 0 past the end), or None without segments."""
    if segments is None:
        return None

    def blocks(x):
        x = x[:, start:stop]
        n = -(-(stop - start) // block_k)
        x = jnp.pad(x, ((0, 0), (0, n * block_k - (stop - start))))
        return jnp.moveaxis(x.reshape(x.shape[0], n, block_k), 1, 0)

    kv_pos = None if segments.kv_pos is None else blocks(segments.kv_pos)
    return blocks(segments.kv_ids), kv_pos


def _block_segments(segments, kv_block):
    """`segments` with this block's kv ids and positions."""
    if segments is None:
        return None
    kv_ids, kv_pos = kv_block
    return segments._replace(kv_ids=kv_ids, kv_pos=kv_pos)


def _block_size(start, stop, block_k):
    """Blocks no longer than the visible range (one block for short inputs)."""
    return max(1, min(block_k, stop - start))


def _grouped_sinks(sinks, hkv, g):
    """(hq,) sinks as (1, hkv, g, 1), to broadcast over (b, hkv, g, sq)."""
    return sinks.astype(jnp.float32).reshape(1, hkv, g, 1)


def row_dot(dout, out):
    """D = rowsum(dout * out) (b, hq, sq) float32, from (b, sq, hq, dv) arrays: the term the
    backward subtracts from dP, and with the sinks' probabilities their gradient."""
    acc = jnp.promote_types(out.dtype, jnp.float32)
    return jnp.einsum("bqhd,bqhd->bhq", dout.astype(acc), out.astype(acc))


def sinks_grad(sinks, lse, dpsum, dlse=None):
    """Gradient of the (hq,) sinks: with p = exp(sinks[h] - lse), the sink's probability in
    each row, d out/d sink = -p * out and d lse/d sink = p, so

        dsinks[h] = sum over batch and rows of p * (dlse - D),   D = rowsum(dout * out).

    lse (b, hq, sq) is the forward's (sinks included), dpsum = D, dlse the LSE cotangent or
    None. A sink of -inf has p = 0 (also where lse is -inf); returns float32 (hq,)."""
    lse = lse.astype(jnp.float32)
    s = sinks.astype(jnp.float32)[None, :, None]
    p = jnp.where(s == -jnp.inf, 0.0, jnp.exp(s - jnp.where(s == -jnp.inf, 0.0, lse)))
    g = -dpsum.astype(jnp.float32)
    if dlse is not None:
        g = g + dlse.astype(jnp.float32)
    return (p * g).sum(axis=(0, 2))


# ----------------------------------------------------------------------------- forward

def _initial_state(sinks, b, hkv, g, sq, acc):
    """The online softmax's running (max, sum) before any key: (-inf, 0), or with sinks the
    sink's own term, (sinks[h], 1) ((-inf, 0) for a sink of -inf). Starting from the sink
    puts it in the denominator and the lse, and leaves out 0 for a row that sees no key."""
    shape = (b, hkv, g, sq)
    if sinks is None:
        return jnp.full(shape, -jnp.inf, acc), jnp.zeros(shape, acc)
    m = jnp.broadcast_to(_grouped_sinks(sinks, hkv, g).astype(acc), shape)
    return m, jnp.where(m == -jnp.inf, 0.0, 1.0).astype(acc)


def _finish(m, l, o, out_shape, dtype, lse_dtype):
    """out = o / l and lse = m + log(l) from the running state (b, hkv, g, sq[, dv]); rows
    with l = 0 (no key, no sink) get out 0 and lse -inf."""
    b, sq, hq, dv = out_shape
    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    out = o / l_safe[..., None]
    lse = jnp.where(seen, m + jnp.log(l_safe), -jnp.inf)
    out = jnp.moveaxis(out, 3, 1).reshape(out_shape).astype(dtype)  # (b,h,g,q,d) -> (b,q,h*g,d)
    return out, lse.reshape(b, hq, sq).astype(lse_dtype)


def forward(q, k, v, sinks=None, *, softmax_scale: float, softcap: float = 0.0,
            left: int = UNBOUNDED, right: int = UNBOUNDED, kv_lengths=None, segments=None,
            block_k: int = DEFAULT_BLOCK_K):
    """Blockwise attention forward.

    q (b, sq, hq, d); k (b, sk, hkv, d); v (b, sk, hkv, dv), hq % hkv == 0; sinks None or
    (hq,) float32. Returns out (b, sq, hq, dv) in q.dtype and lse (b, hq, sq) float32
    (natural log; -inf for rows that see no key, or sinks[h] with sinks). `segments`: None or
    a jax_fa3.segments.Segments (module docstring)."""
    b, sq, hq, d = q.shape
    sk, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    g = hq // hkv
    dtype, acc = q.dtype, _acc_dtype(q.dtype)
    lse_dtype = jnp.promote_types(jnp.float32, acc)
    out_shape = (b, sq, hq, dv)
    refs = (q, k, v) + (() if sinks is None else (sinks,))
    m, l = _initial_state(sinks, b, hkv, g, sq, acc)
    o = jnp.zeros((b, hkv, g, sq, dv), acc)
    positional = segments is not None and segments.has_positions
    start, stop = key_range(sq, sk, left, right, positional)
    if stop == start or 0 in (b, sq, hq, d, dv):
        return _finish(m, l, o, out_shape, dtype, lse_dtype)
    bk = _block_size(start, stop, block_k)
    qg = q.reshape(b, sq, hkv, g, d)
    qpos = jnp.arange(sq)

    def step(carry, xs):
        m, l, o = carry
        kb, vb, kstart, seg = xs
        s, _ = _scores(qg, kb, softmax_scale, softcap, dtype)
        ok = _visible(qpos, kstart + jnp.arange(bk), sq, sk, left, right, kv_lengths,
                      _block_segments(segments, seg))
        s = jnp.where(ok, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=-1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows with nothing seen yet
        p = jnp.exp(s - m_safe[..., None])
        alpha = jnp.exp(m - m_safe)
        l = alpha * l + p.sum(axis=-1)
        o = alpha[..., None] * o + _mm("bhgqk,bkhd->bhgqd", p, vb, dtype)
        return (m_new, l, o), None

    init = tuple(varying_like(x, *refs) for x in (m, l, o))  # inside shard_map with check_vma
    kstarts = start + bk * jnp.arange(-(-(stop - start) // bk))
    (m, l, o), _ = lax.scan(step, init, (_blocks(k, start, stop, bk), _blocks(v, start, stop, bk),
                                         kstarts, _segment_blocks(segments, start, stop, bk)))
    return _finish(m, l, o, out_shape, dtype, lse_dtype)


# ----------------------------------------------------------------------------- backward

def backward(q, k, v, out, lse, dout, *, softmax_scale: float, softcap: float = 0.0,
             left: int = UNBOUNDED, right: int = UNBOUNDED, kv_lengths=None, segments=None,
             dlse=None, return_dpsum: bool = False, block_k: int = DEFAULT_BLOCK_K):
    """Blockwise attention backward (FlashAttention-2 style, recomputing P per key block).

    out/lse are the forward's (or a merged attention's final) results, sinks included: the
    backward needs no other sign of them. dout the output cotangent; dlse an optional LSE
    cotangent (b, hq, sq) (d lse / d s = P, so it enters as dS = P * (dP - D + dlse)).
    Returns (dq, dk, dv) in the dtypes of (q, k, v), and with `return_dpsum` also
    D = rowsum(dout * out) (b, hq, sq), as the kernel does (for `sinks_grad`)."""
    b, sq, hq, d = q.shape
    sk, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    g = hq // hkv
    dtype, acc = q.dtype, _acc_dtype(q.dtype)
    dpsum = row_dot(dout, out)
    done = (lambda *grads: (*grads, dpsum)) if return_dpsum else (lambda *grads: grads)
    positional = segments is not None and segments.has_positions
    start, stop = key_range(sq, sk, left, right, positional)
    if stop == start or 0 in (b, sq, hq, d, dv):
        return done(jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v))
    bk = _block_size(start, stop, block_k)
    qg = q.reshape(b, sq, hkv, g, d)
    dog = dout.reshape(b, sq, hkv, g, dv)
    delta = dpsum.reshape(b, hkv, g, sq)
    if dlse is not None:
        delta = delta - dlse.reshape(b, hkv, g, sq).astype(acc)
    lse = lse.reshape(b, hkv, g, sq).astype(acc)
    lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)  # rows that saw nothing: P = exp(-inf) = 0
    qpos = jnp.arange(sq)

    def step(dq, xs):
        kb, vb, kstart, seg = xs
        s, t = _scores(qg, kb, softmax_scale, softcap, dtype)
        ok = _visible(qpos, kstart + jnp.arange(bk), sq, sk, left, right, kv_lengths,
                      _block_segments(segments, seg))
        p = jnp.where(ok, jnp.exp(s - lse[..., None]), 0.0)
        dv = _mm("bhgqk,bqhgd->bkhd", p, dog, dtype)
        dp = _mm("bqhgd,bkhd->bhgqk", dog, vb, dtype)
        ds = p * (dp - delta[..., None])
        if t is not None:
            ds = ds * (1.0 - t * t)  # d/ds of softcap * tanh(s / softcap)
        ds = ds * softmax_scale
        dq = dq + _mm("bhgqk,bkhd->bqhgd", ds, kb, dtype)
        dk = _mm("bhgqk,bqhgd->bkhd", ds, qg, dtype)
        return dq, (dk, dv)

    kstarts = start + bk * jnp.arange(-(-(stop - start) // bk))
    dq0 = varying_like(jnp.zeros(qg.shape, acc), q, k, v, out, lse, dout)
    dq, (dk, dv) = lax.scan(step, dq0,
                            (_blocks(k, start, stop, bk), _blocks(v, start, stop, bk), kstarts,
                             _segment_blocks(segments, start, stop, bk)))

    def unblock(x, like):  # (n, b, bk, hkv, e) -> (b, sk, hkv, e), zeros outside [start, stop)
        x = jnp.moveaxis(x, 0, 1).reshape(b, -1, hkv, like.shape[3])[:, : stop - start]
        return jnp.pad(x, ((0, 0), (start, sk - stop), (0, 0), (0, 0))).astype(like.dtype)

    return done(dq.reshape(q.shape).astype(q.dtype), unblock(dk, k), unblock(dv, v))


# ----------------------------------------------------------------------------- dense variant

def _grouped(x, b, hkv, g):
    """A 4-D bias/mask broadcastable to (b, hq, sq, sk) as (b|1, hkv|1, g|1, sq|1, sk|1)."""
    if x.shape[1] == 1:
        return x[:, :, None]
    return x.reshape(x.shape[0], hkv, g, *x.shape[2:])


def dense(q, k, v, sinks=None, *, softmax_scale: float, softcap: float = 0.0,
          left: int = UNBOUNDED, right: int = UNBOUNDED, bias=None, mask=None, kv_lengths=None,
          segments=None):
    """Dense attention with an additive `bias` and a boolean `mask` (each 4-D, broadcastable
    to (b, hq, sq, sk)), on top of the band, kv_lengths and `segments`, and optional `sinks`.
    Differentiable by JAX autodiff (including the bias and the sinks). Returns (out, lse) like
    `forward`. The bias is added after the softcap; masked entries are excluded, not just
    pushed to a large negative number."""
    b, sq, hq, d = q.shape
    sk, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    g = hq // hkv
    dtype, acc = q.dtype, _acc_dtype(q.dtype)
    qg = q.reshape(b, sq, hkv, g, d)
    s, _ = _scores(qg, k, softmax_scale, softcap, dtype)
    if bias is not None:
        s = s + _grouped(bias, b, hkv, g).astype(acc)
    if segments is None:
        ok = jnp.asarray(band_mask(sq, sk, left, right))[None, None, None]
    else:
        ok = _segments.dense_mask(segments, left, right)[:, None, None]
    if mask is not None:
        ok = ok & _grouped(mask, b, hkv, g)
    if kv_lengths is not None:
        ok = ok & (jnp.arange(sk) < kv_lengths[:, None])[:, None, None, None, :]
    s = jnp.where(ok, s, -jnp.inf)
    m = s.max(axis=-1, keepdims=True)
    if sinks is not None:  # one more logit per row, whose value is 0
        sink = _grouped_sinks(sinks, hkv, g)[..., None].astype(acc)  # (1, hkv, g, 1, 1)
        m = jnp.maximum(m, sink)
    m = lax.stop_gradient(jnp.where(m == -jnp.inf, 0.0, m))  # softmax is shift invariant
    p = jnp.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    if sinks is not None:
        l = l + jnp.exp(sink - m)
    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    out = _mm("bhgqk,bkhd->bhgqd", p / l_safe, v, dtype)
    lse = jnp.where(seen, m + jnp.log(l_safe), -jnp.inf)[..., 0]
    out = jnp.moveaxis(out, 3, 1).reshape(b, sq, hq, dv).astype(dtype)
    return out, lse.reshape(b, hq, sq).astype(jnp.promote_types(jnp.float32, acc))
