"""Portable FP8 (e4m3) attention forward: the numerics of FA3's FP8 kernel, emulated in pure
JAX, so that it runs anywhere and is the oracle of our FP8 kernel (issue 28;
cpp/kernels/fwd with an e4m3 element).

Per block of keys (the portable path's blocks, masks and online softmax, in the exp2 domain):

    S   = (q_fp8 k_fp8^T in float32) * q_descale[row] * k_descale[key] * softmax_scale
          (then softcap, masks; the product of two e4m3 values is exact in float32)
    m   = running row max of S * log2(e)
    P   = exp2(S * log2(e) - m + 8)       FA3's "max offset": P in [0, 256], not [0, 1], so
                                          small probabilities stay in e4m3's normal range
    l  += rowsum(P)                       from the UNquantized P, as FA3 does
    O  += P.astype(e4m3) (v_fp8 * v_descale[key])   in float32
    out = O / l,  lse = (m - 8) ln 2 + ln l

The one rounding of consequence is P to e4m3: 3 mantissa bits, a relative error of at most
2^-4 per probability (for P >= 2^-6, e4m3's smallest normal; below that an absolute error of
at most 2^-10, i.e. 2^-18 of the row's largest P). Descales are applied per query row and per
key, which is how per-tensor, per-head and per-block descales all look from inside a tile; v's
is folded into v (one float32 rounding, as if the kernel applied it per key block). A row
that sees no key gets out 0 and lse -inf (lse sinks[h] with sinks), no NaN.

P is rounded under the running max of the blocks seen so far, so the rounding depends on the
blocking. With `kernel_blocks` the key blocks are the kernel's: `block_k` keys aligned at
multiples of block_k, visited from the last to the first; the kernel and this emulation then
round the same P, up to float32 noise in the scores.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from jax_fa3 import portable
from jax_fa3._masks import UNBOUNDED
from jax_fa3._vma import varying_like

FP8 = jnp.float8_e4m3fn
MAX_OFFSET = 8.0  # FA3's Max_offset for FP8: P = exp2(s - max + 8) lies in [0, 2^8]
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


def descale_rows(descale, b, h, g, seqlen, block_rows):
    """A descale (None, (), (b, hkv), (b, hq), or per block (b, hkv|hq, n)) as a float32 array
    broadcastable to (b, hkv, g, seqlen): one factor per (batch, kv head, group member, token).
    For k and v, g = 1. The one reading of the descale shapes (also the FP8 kernel's operands,
    jax_fa3/_core.py, and quantization, jax_fa3/fp8.py)."""
    if descale is None:
        return jnp.ones((1, 1, 1, 1), jnp.float32)
    if descale.ndim == 0:
        return descale.reshape(1, 1, 1, 1)
    if descale.ndim == 3:
        descale = jnp.repeat(descale, block_rows, axis=2)[:, :, :seqlen]  # per token
    else:
        descale = descale[..., None]
    heads = descale.shape[1]
    if heads == h * g:  # per query head: split the group
        return descale.reshape(b, h, g, descale.shape[-1])
    return descale[:, :, None]  # per kv head: shared by the group


def _key_blocks(x, sk, start, stop, bk):
    """Per-key factors (b|1, hkv|1, sk|1) as (n_blocks, b|1, hkv|1, bk) like portable._blocks
    (keys [start, stop), padded with ones)."""
    x = jnp.broadcast_to(x, (*x.shape[:2], sk))[..., start:stop]
    n = -(-(stop - start) // bk)
    x = jnp.pad(x, ((0, 0), (0, 0), (0, n * bk - (stop - start))), constant_values=1.0)
    return jnp.moveaxis(x.reshape(*x.shape[:2], n, bk), 2, 0)


def forward(q, k, v, descales=(None, None, None), sinks=None, *, softmax_scale: float,
            softcap: float = 0.0, left: int = UNBOUNDED, right: int = UNBOUNDED, segments=None,
            descale_block_rows=None, out_dtype=jnp.bfloat16,
            block_k: int = portable.DEFAULT_BLOCK_K, kernel_blocks: bool = False):
    """FP8 attention forward (module docstring).

    q (b, sq, hq, d), k (b, sk, hkv, d), v (b, sk, hkv, dv) float8_e4m3fn; `descales` the
    validated (q_descale, k_descale, v_descale) (None = 1; shapes in
    jax_fa3._validate.check_fp8_args; per-block ones cover `descale_block_rows` tokens);
    sinks None or (hq,) float32; segments as in jax_fa3.portable; `kernel_blocks`: the FP8
    kernel's blocking of the keys (module docstring), `block_k` its kBlockN. Returns out
    (b, sq, hq, dv) in `out_dtype` and lse (b, hq, sq) float32."""
    b, sq, hq, d = q.shape
    sk, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    g = hq // hkv
    f32 = jnp.float32
    out_shape = (b, sq, hq, dv)
    refs = (q, k, v) + tuple(x for x in (*descales, sinks) if x is not None)
    m, l = _initial_state(sinks, b, hkv, g, sq)
    o = jnp.zeros((b, hkv, g, sq, dv), f32)
    positional = segments is not None and segments.has_positions
    start, stop = portable.key_range(sq, sk, left, right, positional)
    if stop == start or 0 in (b, sq, hq, d, dv):
        return _finish(m, l, o, out_shape, out_dtype)
    if kernel_blocks:
        bk, start = block_k, start // block_k * block_k
    else:
        bk = portable._block_size(start, stop, block_k)
    q_scale, k_scale, v_scale = (
        descale_rows(x, b, hkv, n, s, descale_block_rows)
        for x, n, s in zip(descales, (g, 1, 1), (sq, sk, sk)))
    # the per-row query factor and the softmax scale in log2 units, folded into one (as FA3)
    row_factor = jnp.broadcast_to(q_scale * (softmax_scale * (1.0 if softcap else LOG2E)),
                                  (b, hkv, g, sq))
    qg = q.reshape(b, sq, hkv, g, d).astype(f32)  # e4m3 -> float32 is exact
    qpos = jnp.arange(sq)

    def step(carry, xs):
        m, l, o = carry
        kb, vb, ksc, vsc, kstart, seg = xs
        s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, kb.astype(f32), precision=lax.Precision.HIGHEST)
        s = s * row_factor[..., None] * ksc[:, :, None, None, :]
        if softcap:  # on the scores in natural units, then to log2 units
            s = softcap * jnp.tanh(s / softcap) * LOG2E
        ok = portable._visible(qpos, kstart + jnp.arange(bk), sq, sk, left, right, None,
                               portable._block_segments(segments, seg))
        s = jnp.where(ok, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=-1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows with nothing seen yet
        p = jnp.exp2(s - m_safe[..., None] + MAX_OFFSET)  # in [0, 256]
        alpha = jnp.exp2(m - m_safe)
        l = alpha * l + p.sum(axis=-1)  # the unquantized P
        v_deq = vb.astype(f32) * jnp.moveaxis(vsc, 1, 2)[..., None]  # (b, bk, hkv, dv)
        pv = jnp.einsum("bhgqk,bkhd->bhgqd", p.astype(FP8).astype(f32), v_deq,
                        precision=lax.Precision.HIGHEST)
        o = alpha[..., None] * o + pv
        return (m_new, l, o), None

    init = tuple(varying_like(x, *refs) for x in (m, l, o))  # inside shard_map with check_vma
    kstarts = start + bk * jnp.arange(-(-(stop - start) // bk))
    xs = (portable._blocks(k, start, stop, bk), portable._blocks(v, start, stop, bk),
          _key_blocks(k_scale[:, :, 0], sk, start, stop, bk),
          _key_blocks(v_scale[:, :, 0], sk, start, stop, bk),
          kstarts, portable._segment_blocks(segments, start, stop, bk))
    (m, l, o), _ = lax.scan(step, init, xs, reverse=kernel_blocks)
    return _finish(m, l, o, out_shape, out_dtype)


def _initial_state(sinks, b, hkv, g, sq):
    """(m, l) before any key, in log2 units with the max offset: (-inf, 0), or with sinks the
    sink's own term, (sinks[h] log2 e, 2^8) ((-inf, 0) for a sink of -inf)."""
    shape = (b, hkv, g, sq)
    if sinks is None:
        return jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32)
    m = jnp.broadcast_to(portable._grouped_sinks(sinks, hkv, g) * LOG2E, shape)
    return m, jnp.where(m == -jnp.inf, 0.0, 2.0 ** MAX_OFFSET).astype(jnp.float32)


def _finish(m, l, o, out_shape, out_dtype):
    """out = O / l and the natural-log lse from the log2-domain state: lse = (m - 8) ln 2 +
    ln l (portable._finish does the division, the layout and the rows with l = 0)."""
    return portable._finish((m - MAX_OFFSET) * LN2, l, o, out_shape, out_dtype, jnp.float32)
