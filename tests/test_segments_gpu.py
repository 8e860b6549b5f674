"""GPU tests of packed sequences on the kernels: segment ids, positions and varlen.

The kernels take document bands (jax_fa3/segments.py `kernel_bands`: per query row the keys
it may see, per key the query rows that see it, and their summaries per 64 rows) on top of
the band they are passed (the unbounded one with positions). Checked by the error-ratio rule
of docs/architecture.md against the float64 oracle, whose segment mask tests/helpers.py writes
on its own:

* _ops.fwd / _ops.bwd with the bands directly (the backward given the oracle's out and lse):
  many documents per row, documents shorter than a tile, one-token documents, empty segments,
  all-padding rows, GQA/MQA, causal + window, positions, sinks, softcap, head dims 64, 96, 128,
  192/128 (MLA), 256 and a rounded-up 80; padding rows give out 0 and lse -inf (or the sink)
  and zero gradients;
* flash_attention(..., q_segment_ids, ..., implementation="cuda") and flash_attention_varlen
  forward and backward through jax.vjp, both kernels in the program; the deterministic
  backward with segments (the portable one: the deterministic kernel takes no bands);
* a batch row that breaks the kernel contract comes back NaN, the others right; vmap folds
  into one kernel call.

XLA allocates the outputs, so "poisoned outputs" is as in tests/test_bwd_gpu.py: NaN buffers
of the outputs' size are allocated and freed before each call, and every element must then
be finite and agree with the oracle.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from segment_helpers import random_packed
from jax_fa3 import _ffi, _ops, flash_attention, flash_attention_varlen, portable
from jax_fa3._masks import UNBOUNDED as UNB
from jax_fa3.segments import Segments, kernel_bands

pytestmark = pytest.mark.gpu

BF16, F16 = jnp.bfloat16, jnp.float16

_next_key = helpers.key_stream(27_2026_1203)


# ----------------------------------------------------------------------------- inputs

def packed(seed, b, sq, sk=None, docs=8, *, offset=False, **kw):
    """segment_helpers.random_packed with longer padding runs and documents (a random
    position offset with `offset`)."""
    gen = dict(empty_prob=0.1, one_prob=0.1, pad_gap=(1, 20), min_len=2,
               offset=(-20, 60) if offset else None)
    return random_packed(seed, b, sq, sk, docs, **{**gen, **kw})


def _segments(ids, positions):
    arrays = tuple(jnp.asarray(x) for x in (ids if positions else ids[:2]))
    return Segments(*arrays)


_bands = jax.jit(kernel_bands, static_argnums=(1, 2, 3, 4))


def _attrs(d, left, right, softcap):
    return dict(softmax_scale=1.0 / np.sqrt(d), softcap=softcap, window_left=left,
                window_right=right)


# name: (b, sq, sk (None: self), hq, hkv, d, dv, dtype, docs, positions, sinks, all-padding
#        rows, (left, right), softcap, logit scale, generator keywords)
CASES = {
    "many-docs-causal": (1, 1024, None, 4, 2, 128, 128, BF16, 32, False, False, (), (UNB, 0),
                         0.0, 1.0, {}),
    "docs-shorter-than-a-tile": (2, 1000, None, 4, 4, 64, 64, BF16, 60, False, False, (),
                                 (UNB, UNB), 0.0, 1.0, dict(max_len=40)),
    "one-token-docs": (1, 300, None, 4, 1, 128, 128, F16, 150, False, False, (), (UNB, 0),
                       0.0, 1.0, dict(one_prob=0.8, pad_prob=0.05)),
    "empty-segments-cross-mqa": (3, 500, 700, 8, 1, 128, 128, BF16, 10, False, False, (),
                                 (UNB, 0), 0.0, 1.0, dict(empty_prob=0.4)),
    "all-padding-rows-sinks-hd96": (3, 400, None, 4, 2, 96, 96, BF16, 6, False, True, (0, 2),
                                    (UNB, 0), 0.0, 1.0, {}),
    "causal-window-positions": (1, 1024, None, 4, 2, 128, 128, BF16, 12, True, False, (),
                                (64, 0), 0.0, 1.0, {}),
    "positions-cross-offsets": (1, 777, 1200, 4, 2, 128, 128, F16, 9, True, True, (), (UNB, 0),
                                0.0, 1.0, dict(offset=True)),
    "hd256-causal": (2, 600, None, 4, 2, 256, 256, BF16, 8, False, False, (), (UNB, 0), 0.0,
                     1.0, {}),
    "rounded-up-hd80-window": (2, 500, None, 4, 2, 80, 80, BF16, 10, False, False, (),
                               (32, 8), 0.0, 1.0, {}),
    "mla-192-128-sinks": (2, 400, None, 8, 2, 192, 128, BF16, 6, True, True, (), (UNB, 0),
                          0.0, 1.0, {}),
    "softcap-large-logits": (1, 513, None, 4, 4, 128, 128, F16, 7, False, False, (), (UNB, 0),
                             20.0, 6.0, {}),
    "hd64-window-both-sides": (2, 700, 500, 4, 2, 64, 64, BF16, 5, True, False, (), (20, 30),
                               0.0, 1.0, {}),
}


def _case(name):
    (b, sq, sk, hq, hkv, d, dv, dtype, docs, positions, with_sinks, pad_rows, (left, right),
     softcap, scale, gen) = CASES[name]
    ids = packed(zlib.crc32(name.encode()) % 1000, b, sq, sk, docs, all_padding_rows=pad_rows, **gen)
    sk = sq if sk is None else sk
    q, k, v = helpers.random_qkv(_next_key(), b, sq, sk, hq, hkv, d, dtype, scale=scale,
                                 head_dim_v=dv)
    sinks = helpers.random_sinks(_next_key(), hq, loc=1.0) if with_sinks else None
    oracle = dict(left=left, right=right, softcap=softcap,
                  segments=ids if positions else ids[:2])
    return ids, positions, q, k, v, sinks, oracle


@pytest.mark.parametrize("name", list(CASES))
def test_forward_with_bands(name):
    ids, positions, q, k, v, sinks, oracle = _case(name)
    d, dv = q.shape[-1], v.shape[-1]
    helpers.skip_unless_kernels(q.dtype, d, dv, directions=("fwd",))
    b, sq, hq = q.shape[:3]
    bands, kl, kr = _bands(_segments(ids, positions), oracle["left"], oracle["right"], sq,
                           k.shape[1])
    helpers.poison_heap(jnp.zeros((b, sq, hq, dv), q.dtype))
    out, lse = jax.device_get(_ops.fwd(q, k, v, sinks, bands,
                                       **_attrs(d, kl, kr, oracle["softcap"])))
    assert out.shape == (b, sq, hq, dv) and out.dtype == q.dtype and lse.dtype == np.float32
    helpers.check_against_oracle(f"fwd {name}", q, k, v, out=out, lse=lse, sinks=sinks,
                                 **oracle)
    # rows that see no key (padding among them): out exactly 0, lse -inf or the head's sink
    empty = np.isneginf(helpers.reference_f64(q, k, v, **oracle)[1])  # (b, hq, sq)
    assert empty.any() or not (ids[0] == 0).any()
    assert (np.asarray(out, np.float32).transpose(0, 2, 1, 3)[empty] == 0).all()
    want = -np.inf if sinks is None else np.broadcast_to(np.asarray(sinks)[None, :, None],
                                                         empty.shape)[empty]
    np.testing.assert_allclose(lse[empty], want, rtol=4e-7, atol=1e-6)


@pytest.mark.parametrize("name", list(CASES))
def test_backward_with_bands(name):
    """dq, dk, dv given the oracle's out and lse (the backward on its own), and D; padding
    rows and keys get exactly zero gradients."""
    ids, positions, q, k, v, sinks, oracle = _case(name)
    d, dv = q.shape[-1], v.shape[-1]
    helpers.skip_unless_kernels(q.dtype, d, dv, directions=("bwd",))
    bands, kl, kr = _bands(_segments(ids, positions), oracle["left"], oracle["right"],
                           q.shape[1], k.shape[1])
    out64, lse64 = helpers.reference_f64(q, k, v, sinks=sinks, **oracle)
    out = jnp.asarray(np.asarray(out64, np.float32)).astype(q.dtype)
    lse = jnp.asarray(np.asarray(lse64, np.float32))
    dout = helpers.random_like(_next_key(), out)
    helpers.poison_heap(q, k, v)
    dq, dk, dv_, dpsum = jax.device_get(_ops.bwd(
        q, k, v, out, lse, dout, bands, deterministic=False, return_dpsum=True,
        **_attrs(d, kl, kr, oracle["softcap"])))
    grads = (dq, dk, dv_)
    if sinks is not None:
        grads += (jax.device_get(portable.sinks_grad(sinks, lse, dpsum)),)
    helpers.check_against_oracle(f"bwd {name}", q, k, v, grads=grads, dout=dout, sinks=sinks,
                                 **oracle)
    q_pad, k_pad = ids[0] == 0, ids[1] == 0
    assert (np.asarray(dq, np.float32)[q_pad] == 0).all()
    assert (np.asarray(dk, np.float32)[k_pad] == 0).all()
    assert (np.asarray(dv_, np.float32)[k_pad] == 0).all()


# ----------------------------------------------------------------------------- public API

def _programs_use_the_kernels(f, *args, backward=True):
    text = jax.jit(f).lower(*args).as_text()
    assert f"@{_ffi.FWD_TARGET}(" in text
    assert (f"@{_ffi.BWD_TARGET}(" in text) == backward


def _vjp(attend, q, k, v, sinks, dout, backward=True):
    """out, lse and the gradients of attend(q, k, v, sinks) -> (out, lse) under jit (lse as
    aux: no LSE cotangent, so the kernel backward can run)."""
    args = (q, k, v) + (() if sinks is None else (sinks,))

    def run(*args):
        out, vjp, lse = jax.vjp(attend, *args, has_aux=True)
        return out, lse, vjp(dout)

    _programs_use_the_kernels(run, *args, backward=backward)
    return jax.device_get(jax.jit(run)(*args))


PUBLIC = {  # name: (b, s, hq, hkv, d, dtype, docs, positions, sinks, options)
    "gqa-causal-docs": (2, 700, 8, 2, 128, BF16, 16, False, False, dict(causal=True)),
    "positions-window-sinks": (2, 800, 4, 1, 64, BF16, 10, True, True,
                               dict(causal=True, window_size=(48, -1))),
    "softcap-fp16": (1, 600, 4, 2, 128, F16, 5, False, False, dict(causal=True, softcap=30.0)),
    "full-hd256": (1, 500, 4, 4, 256, BF16, 6, True, False, {}),
}


@pytest.mark.parametrize("name", list(PUBLIC))
def test_flash_attention_with_segment_ids(name):
    b, s, hq, hkv, d, dtype, docs, positions, with_sinks, opts = PUBLIC[name]
    helpers.skip_unless_kernels(dtype, d)
    ids = packed(zlib.crc32(name.encode()) % 1000, b, s, None, docs, all_padding_rows=(1,) if b > 1 else ())
    q, k, v = helpers.random_qkv(_next_key(), b, s, s, hq, hkv, d, dtype)
    sinks = helpers.random_sinks(_next_key(), hq) if with_sinks else None
    dout = helpers.random_like(_next_key(), q)
    seg = dict(q_segment_ids=ids[0], q_positions=ids[2] if positions else None)

    def attend(q, k, v, *s):
        return flash_attention(q, k, v, sinks=s[0] if s else None, return_lse=True,
                               implementation="cuda", **seg, **opts)

    out, lse, grads = _vjp(attend, q, k, v, sinks, dout)
    helpers.check_against_oracle(f"api {name}", q, k, v, out, lse, grads, dout, sinks=sinks,
                                 segments=ids if positions else ids[:2], **opts)


@pytest.mark.parametrize("opts", [dict(causal=True), dict(window_size=(32, 16))],
                         ids=["causal", "window"])
def test_varlen(opts):
    """flash_attention_varlen on the kernels: sequences of ragged lengths (query lengths !=
    key lengths, an empty one, a one-token one, padding after the last), GQA, against the
    oracle of the packed row (each sequence bottom-right aligned)."""
    helpers.skip_unless_kernels(BF16, 128)
    lengths_q = [300, 0, 1, 129, 500, 64]
    lengths_k = [280, 17, 1, 400, 500, 0]
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    tq, tk = int(cu_q[-1]) + 40, int(cu_k[-1]) + 5
    q, k, v = (x[0] for x in helpers.random_qkv(_next_key(), 1, tq, tk, 8, 2, 128, BF16))
    dout = helpers.random_like(_next_key(), q)

    def attend(q, k, v):
        return flash_attention_varlen(q, k, v, cu_q, cu_k, 500, 500, return_lse=True,
                                      implementation="cuda", **opts)

    out, lse, grads = _vjp(attend, q, k, v, None, dout)
    # the oracle: one batch row, ids r + 1, positions aligning each sequence's diagonal
    q_ids = np.zeros(tq, np.int32)
    q_pos = np.zeros(tq, np.int32)
    kv_ids = np.zeros(tk, np.int32)
    kv_pos = np.zeros(tk, np.int32)
    for r, (lq, lk) in enumerate(zip(lengths_q, lengths_k)):
        q_ids[cu_q[r]:cu_q[r + 1]] = r + 1
        q_pos[cu_q[r]:cu_q[r + 1]] = np.arange(lq) + lk - lq
        kv_ids[cu_k[r]:cu_k[r + 1]] = r + 1
        kv_pos[cu_k[r]:cu_k[r + 1]] = np.arange(lk)
    segments = tuple(x[None] for x in (q_ids, kv_ids, q_pos, kv_pos))
    helpers.check_against_oracle("varlen", q[None], k[None], v[None], out[None], lse[None],
                                 tuple(g[None] for g in grads), dout[None], segments=segments,
                                 **opts)
    assert (np.asarray(out[cu_q[-1]:], np.float32) == 0).all()


def test_deterministic_backward_with_segments():
    """deterministic=True with segments: the kernel forward and the portable backward (the
    deterministic kernel backward takes no bands), right and bitwise repeatable."""
    helpers.skip_unless_kernels(BF16, 128, directions=("fwd",))
    ids = packed(5, 2, 700, None, 9)
    q, k, v = helpers.random_qkv(_next_key(), 2, 700, 700, 4, 2, 128, BF16)
    dout = helpers.random_like(_next_key(), q)

    def attend(q, k, v):
        return flash_attention(q, k, v, causal=True, deterministic=True, return_lse=True,
                               q_segment_ids=ids[0], implementation="cuda")

    out, lse, grads = _vjp(attend, q, k, v, None, dout, backward=False)
    helpers.check_against_oracle("deterministic", q, k, v, out, lse, grads, dout,
                                 causal=True, segments=ids[:2])
    again = _vjp(attend, q, k, v, None, dout, backward=False)[2]
    for a, c in zip(grads, again):
        assert np.array_equal(np.asarray(a).view(np.uint16), np.asarray(c).view(np.uint16))


# ----------------------------------------------------------------------------- contract, vmap

def test_contract_violation_gives_nan_rows():
    """A batch row whose ids break the contract (an id in two runs) is NaN, out and lse; the
    other batch rows are right."""
    helpers.skip_unless_kernels(BF16, 128, directions=("fwd",))
    ids = packed(6, 3, 300, None, 5, pad_prob=0.0, empty_prob=0.0)
    q_ids = ids[0].copy()
    q_ids[1, 10:14] = [1, 2, 1, 2]
    q_ids[1, 14:] = np.where(q_ids[1, 14:] != 0, q_ids[1, 14:] + 10, 0)
    q, k, v = helpers.random_qkv(_next_key(), 3, 300, 300, 4, 2, 128, BF16)
    out, lse = jax.device_get(flash_attention(q, k, v, causal=True, q_segment_ids=q_ids,
                                              return_lse=True, implementation="cuda"))
    assert np.isnan(np.asarray(out[1], np.float32)).all() and np.isnan(lse[1]).all()
    keep = np.array([0, 2])
    helpers.check_against_oracle("valid rows", q[keep], k[keep], v[keep], out=out[keep],
                                 lse=lse[keep], causal=True, segments=(q_ids[keep],))


def test_vmap_folds_into_one_kernel_call():
    """vmap over q, k, v and the ids: one forward kernel call in the program (the batching
    rule folds the bands' leading axes too), equal to the per-element calls."""
    helpers.skip_unless_kernels(BF16, 128, directions=("fwd",))
    ids = np.stack([packed(7 + i, 2, 256, None, 4)[0] for i in range(3)])
    q, k, v = (x.reshape(3, 2, 256, 4, 128) for x in
               helpers.random_qkv(_next_key(), 6, 256, 256, 4, 4, 128, BF16))
    f = lambda q, k, v, i: flash_attention(q, k, v, causal=True, q_segment_ids=i,
                                           implementation="cuda")
    text = jax.jit(jax.vmap(f)).lower(q, k, v, ids).as_text()
    assert text.count(f"@{_ffi.FWD_TARGET}(") == 1
    got = jax.device_get(jax.jit(jax.vmap(f))(q, k, v, ids))
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(got[i], np.float32),
                                      np.asarray(jax.jit(f)(q[i], k[i], v[i], ids[i]),
                                                 np.float32))


def test_segments_change_the_result():
    """A test that cannot fail is a defect: packing changes the kernel's output by far more
    than the rounding (the checks above see the documents)."""
    helpers.skip_unless_kernels(BF16, 128, directions=("fwd",))
    ids = packed(8, 1, 512, None, 8, pad_prob=0.0, empty_prob=0.0, one_prob=0.0)
    q, k, v = helpers.random_qkv(_next_key(), 1, 512, 512, 4, 2, 128, BF16)
    with_ids = np.asarray(flash_attention(q, k, v, causal=True, q_segment_ids=ids[0],
                                          implementation="cuda"), np.float32)
    without = np.asarray(flash_attention(q, k, v, causal=True, implementation="cuda"),
                         np.float32)
    assert np.abs(with_ids - without).max() > 0.1 * np.abs(without).max()
