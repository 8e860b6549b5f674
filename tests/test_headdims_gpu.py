"""GPU tests of the kernels at every head dim that is a multiple of 8 up to 256, and at
head dims of their own for q/k and v (MLA's 192/128 and other pairs), forward and backward.

A call whose head dims are not compiled runs on the smallest compiled kernel head dim that
holds both (the loads zero-fill the columns past them, the stores clip): these tests hold
each such call to the error-ratio rule of docs/architecture.md (tests/helpers.py) against the
float64 oracle, through jax_fa3._ops (the FFI calls: the backward is given the oracle's
out/lse, so it is checked alone) and through flash_attention(..., implementation="cuda")
with jax.grad. Shapes are small, one per head dim: the indexing of the tiles is the business
of test_fwd_gpu.py and test_bwd_gpu.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from jax_fa3 import _ffi, _masks, _ops, flash_attention

pytestmark = pytest.mark.gpu

UNB = _masks.UNBOUNDED
BF16, F16 = jnp.bfloat16, jnp.float16

_next_key = helpers.key_stream(26_2026_1208)

EVERY_HEAD_DIM = tuple(range(8, 257, 8))
# Not compiled in the default build: they run on the next compiled head dim up.
ROUNDED_UP = (40, 80, 112, 160, 224)


def _oracle_residuals(q, k, v, dtype, **opts):
    """The oracle's out (rounded to `dtype`, as a forward would store it) and lse (float32):
    the backward's inputs, so that the backward is checked on its own."""
    out64, lse64 = helpers.reference_f64(q, k, v, **opts)
    return (jnp.asarray(np.asarray(out64, np.float32)).astype(dtype),
            jnp.asarray(np.asarray(lse64, np.float32)))


def _check_ops(b, sq, sk, hq, hkv, d, dv, dtype, *, left=UNB, right=UNB, softcap=0.0,
               deterministic=False, logit_scale=1.0):
    """_ops.fwd and _ops.bwd of one shape against the oracle: out (v's head dim, q's dtype)
    and lse, then dq, dk, dv (their shapes and dtypes those of q, k, v); rows that see no
    key give out 0 exactly. Deterministic: a second backward is bitwise equal."""
    helpers.skip_unless_kernels(dtype, d, dv)
    q, k, v = helpers.random_qkv(_next_key(), b, sq, sk, hq, hkv, d, dtype, scale=logit_scale,
                                 head_dim_v=dv)
    opts = dict(left=left, right=right, softcap=softcap)
    attrs = dict(softmax_scale=1.0 / np.sqrt(d), softcap=softcap, window_left=left,
                 window_right=right)
    helpers.poison_heap(jnp.zeros((b, sq, hq, dv), dtype))
    out, lse = jax.device_get(_ops.fwd(q, k, v, **attrs))
    assert out.shape == (b, sq, hq, dv) and out.dtype == dtype
    assert lse.shape == (b, hq, sq) and lse.dtype == np.float32
    tag = f"d={d} dv={dv} {jnp.dtype(dtype).name} band=({left}, {right}) softcap={softcap}"
    helpers.check_against_oracle(f"fwd {tag}", q, k, v, out=out, lse=lse, **opts)
    empty = np.isneginf(helpers.reference_f64(q, k, v, **opts)[1])  # (b, hq, sq)
    assert (np.asarray(out, np.float32).transpose(0, 2, 1, 3)[empty] == 0).all()

    out_in, lse_in = _oracle_residuals(q, k, v, dtype, **opts)
    dout = helpers.random_like(_next_key(), out_in)

    def backward():
        helpers.poison_heap(q, k, v)
        return jax.device_get(_ops.bwd(q, k, v, out_in, lse_in, dout,
                                       deterministic=deterministic, **attrs))

    grads = backward()
    for g, x in zip(grads, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype
    helpers.check_against_oracle(f"bwd {tag}", q, k, v, grads=grads, dout=dout, **opts)
    if deterministic:
        for name, a, c in zip(("dq", "dk", "dv"), grads, backward()):
            assert np.array_equal(np.asarray(a).view(np.uint16), np.asarray(c).view(np.uint16)), name


# --------------------------------------------------------------------------- every head dim

@pytest.mark.parametrize("d", EVERY_HEAD_DIM)
def test_every_head_dim_bf16(d):
    """Every multiple of 8 up to 256, forward and backward, GQA 2, seqlen_q != seqlen_k;
    causal at every other head dim (so each mask kind meets every compiled tile)."""
    causal = (d // 8) % 2 == 0
    _check_ops(2, 129, 200, 4, 2, d, d, BF16, right=0 if causal else UNB)


@pytest.mark.parametrize("d", (8, 24, 80, 120, 152, 208, 248, 256))
def test_head_dims_fp16(d):
    _check_ops(2, 200, 129, 4, 2, d, d, F16, right=0 if d % 16 else UNB)


# Every option the kernels take, on head dims that are rounded up to a compiled one.
OPTIONS = {
    "window": dict(sq=300, sk=300, hq=4, hkv=4, left=32, right=16),
    "softcap-mqa": dict(sq=257, sk=200, hq=8, hkv=1, softcap=5.0, logit_scale=4.0),
    "deterministic-gqa-causal": dict(sq=257, sk=513, hq=8, hkv=2, right=0, deterministic=True),
    "shifted-band": dict(sq=200, sk=300, hq=2, hkv=1, left=-20, right=150),
}


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("d", ROUNDED_UP)
def test_rounded_up_head_dims_with_options(d, option):
    kw = dict(OPTIONS[option])
    sq, sk, hq, hkv = (kw.pop(n) for n in ("sq", "sk", "hq", "hkv"))
    _check_ops(1, sq, sk, hq, hkv, d, d, BF16, **kw)


# --------------------------------------------------------------------------- v's own head dim

@pytest.mark.parametrize("sq,sk", [(300, 513), (513, 300), (1, 129)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
def test_mla_192_128(sq, sk, causal, dtype):
    """MLA's head dims (q/k 192, v 128): GQA 4, seqlen_q != seqlen_k both ways (causal with
    seqlen_q > seqlen_k leaves rows without keys), forward and backward."""
    _check_ops(2, sq, sk, 8, 2, 192, 128, dtype, right=0 if causal else UNB)


@pytest.mark.parametrize("d,dv", [(64, 128), (128, 64), (256, 192), (80, 48), (8, 256),
                                  (192, 64)])
def test_value_head_dim_pairs(d, dv):
    _check_ops(1, 200, 333, 4, 1, d, dv, BF16, right=0)


def test_mla_deterministic_window_softcap():
    _check_ops(2, 400, 400, 8, 1, 192, 128, BF16, left=64, right=0, softcap=20.0,
               deterministic=True, logit_scale=3.0)


# --------------------------------------------------------------------------- public API

def _programs_use_the_kernels(f, *args):
    """The lowered value-and-grad program calls both kernels and pads nothing (the kernels
    zero-fill rounded-up head dims in their loads: no extra copy in HBM)."""
    text = jax.jit(f).lower(*args).as_text()
    assert f"@{_ffi.FWD_TARGET}(" in text and f"@{_ffi.BWD_TARGET}(" in text
    assert "stablehlo.pad" not in text


@pytest.mark.parametrize("d,dv", [(192, 128), (80, 80), (40, 200), (256, 192), (112, 112)])
def test_flash_attention_grad(d, dv):
    """flash_attention(implementation="cuda") under jax.jit(jax.vjp): out, lse, dq, dk, dv
    by the error-ratio rule, with GQA, causal and seqlen_q != seqlen_k."""
    helpers.skip_unless_kernels(BF16, d, dv)
    q, k, v = helpers.random_qkv(_next_key(), 2, 257, 300, 8, 2, d, BF16, head_dim_v=dv)
    dout = helpers.random_like(_next_key(), jnp.zeros((2, 257, 8, dv), BF16))

    def run(q, k, v):  # lse as aux: its cotangent is a symbolic zero (the kernel backward)
        out, vjp, lse = jax.vjp(lambda q, k, v: flash_attention(
            q, k, v, causal=True, return_lse=True, implementation="cuda"), q, k, v,
            has_aux=True)
        return out, lse, vjp(dout)

    _programs_use_the_kernels(run, q, k, v)
    out, lse, grads = jax.device_get(jax.jit(run)(q, k, v))
    assert out.shape == (2, 257, 8, dv)
    helpers.check_against_oracle(f"flash_attention d={d} dv={dv}", q, k, v, out, lse, grads,
                                 dout, causal=True)


def test_rounded_up_head_dim_is_the_kernel_not_the_portable_path():
    """implementation=None takes the kernel for an uncompiled head dim that rounds up (the
    issue's report: head dim 80 fell back to the portable path)."""
    helpers.skip_unless_kernels(BF16, 80)
    q, k, v = helpers.random_qkv(_next_key(), 1, 64, 64, 2, 2, 80, BF16)
    loss = lambda q, k, v: flash_attention(q, k, v, causal=True).astype(jnp.float32).sum()
    _programs_use_the_kernels(jax.value_and_grad(loss, argnums=(0, 1, 2)), q, k, v)
