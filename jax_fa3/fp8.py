"""FP8 (e4m3) helpers: quantization with descale factors, incoherent processing (a random-sign
Hadamard rotation of q and k), and `flash_attention_fp8`, which quantizes bf16/fp16/f32 inputs
inside the (jittable) call and runs `flash_attention` on the FP8 tensors (issue 28).

Quantization: x ≈ x_fp8.astype(float32) * descale (broadcast back over the slice it covers),
descale = amax / 448 per slice (448 is e4m3's largest finite value), so each slice uses the
whole e4m3 range. An all-zero slice gets descale 1. Values are clipped to +-448 before the
cast: e4m3fn has no infinity, and an out-of-range cast would give NaN.

Granularities (x of shape (batch, seqlen, heads, head_dim)):
  "tensor": one descale, shape ().
  "head":   one per batch row and head, shape (batch, heads) (FA3's convention for k and v,
            whose heads are the kv heads).
  "block":  one per `block_rows` consecutive tokens of one head, shape
            (batch, heads, ceil(seqlen / block_rows)): the FA3 paper's block quantization.
            Pass the same `block_rows` to flash_attention as `descale_block_rows`.

Incoherent processing (FA3 paper, section 3.3): outliers concentrated in a few head-dim
channels blow up a slice's amax and crush its other values into e4m3's few low codes.
Rotating q and k along head_dim by M = H diag(s) / sqrt(d) (H the Walsh-Hadamard matrix, s
random signs) spreads each outlier over all channels; M is orthogonal, so (q M)(k M)^T = q k^T
in exact arithmetic. Use it for q and k only, with the SAME key: v is not rotated (P v would
come out rotated).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jax_fa3 import _validate, portable_fp8

__all__ = ["quantize_fp8", "dequantize_fp8", "hadamard_rotate", "flash_attention_fp8",
           "FP8_DTYPE", "FP8_MAX", "GRANULARITIES"]

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
GRANULARITIES = ("tensor", "head", "block")
_DEFAULT_KEY_SEED = 0  # flash_attention_fp8's signs when no key is given (any fixed key will do)


# ----------------------------------------------------------------------------- Hadamard

def _fwht(x):
    """Unnormalised Walsh-Hadamard transform along the last axis (a power of two): log2(d)
    butterfly stages, each pairing entries h apart as (a + b, a - b)."""
    d = x.shape[-1]
    lead = x.shape[:-1]
    h = 1
    while h < d:
        pairs = x.reshape(*lead, d // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = jnp.stack([a + b, a - b], axis=-2).reshape(*lead, d)
        h *= 2
    return x


def _random_signs(key, d):
    key = _check_key("hadamard_key", key)
    return jax.random.rademacher(key, (d,), dtype=jnp.float32)


def _check_key(name, key):
    """A JAX PRNG key (typed, or a raw uint32 key of shape (2,))."""
    if not isinstance(key, jax.Array) or not (
            jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
            or (key.dtype == jnp.uint32 and key.shape == (2,))):
        raise TypeError(f"{name} must be a JAX PRNG key (jax.random.key(seed) or "
                        f"jax.random.PRNGKey(seed)), got {type(key).__name__} "
                        f"{getattr(key, 'dtype', '')}{getattr(key, 'shape', '')}")
    return key


def hadamard_rotate(x, key, *, name="x"):
    """x rotated along its last axis (head_dim) by H diag(s) / sqrt(d), in float32: the same
    key gives the same orthogonal rotation, so rotating q and k with one key keeps q k^T
    (up to float32 rounding). head_dim must be a power of two."""
    x = _validate.as_array(name, x)
    d = x.shape[-1] if x.ndim else 0
    if d < 1 or d & (d - 1):
        raise ValueError(f"the Hadamard rotation of {name} needs head_dim (its last axis) a "
                         f"power of two, got shape {x.shape}")
    return _rotate(x, _random_signs(key, d))


@jax.jit  # one compile for the log2(d) stages, also when called eagerly
def _rotate(x, signs):
    return _fwht(x.astype(jnp.float32) * signs) / math.sqrt(x.shape[-1])


# ----------------------------------------------------------------------------- quantization

def _check_granularity(granularity, block_rows):
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    block_rows = _validate.static_int("block_rows", block_rows)
    if block_rows < 1:
        raise ValueError(f"block_rows must be >= 1, got {block_rows}")
    return block_rows


def _amax(x, granularity, block_rows):
    """max |x| per slice: () / (b, h) / (b, h, n_blocks), float32."""
    a = jnp.abs(x)
    if granularity == "tensor":
        return a.max(initial=0.0)
    if granularity == "head":
        return a.max(axis=(1, 3), initial=0.0)
    b, s, h, d = x.shape
    n = -(-s // block_rows)
    a = jnp.pad(a, ((0, 0), (0, n * block_rows - s), (0, 0), (0, 0)))  # zeros: no effect
    return a.reshape(b, n, block_rows, h, d).max(axis=(2, 4), initial=0.0).transpose(0, 2, 1)


def expand_descale(descale, shape, block_rows=None):
    """A descale of any granularity broadcastable to (b, s, h, 1) for x of `shape`
    (portable_fp8.descale_rows reads its shape, every head its own group)."""
    b, s, h, _ = shape
    rows = portable_fp8.descale_rows(descale, b, h, 1, s, block_rows)[:, :, 0]  # (b|1, h|1, s|1)
    return jnp.moveaxis(rows, 2, 1)[..., None]


def _quantize(name, x, granularity, block_rows, hadamard_key):
    x = _validate.as_array(name, x)
    if x.ndim != 4:
        raise ValueError(f"{name} must have rank 4 (batch, seqlen, heads, head_dim), got shape "
                         f"{x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating) or _validate.is_fp8(x.dtype):
        raise TypeError(f"{name} must be a bfloat16, float16 or float32 array to quantize, got "
                        f"dtype {x.dtype}")
    block_rows = _check_granularity(granularity, block_rows)
    x = (x.astype(jnp.float32) if hadamard_key is None
         else hadamard_rotate(x, hadamard_key, name=name))
    amax = _amax(x, granularity, block_rows)
    # amax 0 (an all-zero slice): descale 1, never 0 or NaN; the slice quantizes to zeros.
    descale = jnp.where(amax > 0, amax / FP8_MAX, 1.0).astype(jnp.float32)
    scaled = x / expand_descale(descale, x.shape, block_rows)
    # Clip: x / (amax / 448) may round a hair above 448, and e4m3fn has no inf (NaN instead).
    x_fp8 = jnp.clip(scaled, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
    return x_fp8, descale


def quantize_fp8(x, *, granularity="head", block_rows=64, hadamard_key=None):
    """Quantize x (batch, seqlen, heads, head_dim), any float dtype, to float8_e4m3fn.

    Returns (x_fp8, descale): descale float32 of shape () ("tensor"), (batch, heads) ("head",
    the default) or (batch, heads, ceil(seqlen / block_rows)) ("block"), such that
    x ≈ x_fp8.astype(float32) * descale broadcast (`dequantize_fp8`). Per element the error
    is at most 2^-4 of |x| (e4m3 keeps 3 mantissa bits) for values in e4m3's normal range,
    else half the subnormal spacing, 2^-10 * descale.

    hadamard_key: None, or a PRNG key: rotate x along head_dim (a power of two) by the
    random-sign Hadamard matrix of that key BEFORE quantizing (incoherent processing). For q
    and k only, with the same key for both; the descale then describes the rotated x.
    """
    return _quantize("x", x, granularity, block_rows, hadamard_key)


def dequantize_fp8(x_fp8, descale, *, block_rows=64):
    """x_fp8.astype(float32) times its descale broadcast back (any granularity)."""
    x_fp8 = _validate.as_array("x_fp8", x_fp8)
    return x_fp8.astype(jnp.float32) * expand_descale(jnp.asarray(descale, jnp.float32),
                                                      x_fp8.shape, block_rows)


# ----------------------------------------------------------------------------- attention

def flash_attention_fp8(q, k, v, *, granularity="head", block_rows=64, incoherent=False,
                        key=None, **flash_attention_kwargs):
    """`flash_attention` in FP8: quantize bf16/fp16/f32 q, k, v to float8_e4m3fn (`quantize_fp8`
    with `granularity` and `block_rows`) inside the call, then attend with their descales.
    Jittable and vmappable.

    incoherent: rotate q and k by one random-sign Hadamard matrix before quantizing (head_dim
    a power of two); `key` the PRNG key of its signs (default a fixed key: the signs need only
    be independent of the data). v is never rotated.
    flash_attention_kwargs: the other options of `flash_attention` (causal, window_size,
    softcap, sinks, return_lse, segment ids, out_dtype, ...). Descales come from the
    quantization and cannot be passed.

    FP8 attention is forward-only: differentiating through this call raises
    NotImplementedError (train with bf16 `flash_attention`; this is for inference).
    """
    from jax_fa3.attention import flash_attention  # attention does not import this module

    given = sorted(set(flash_attention_kwargs) & {"q_descale", "k_descale", "v_descale",
                                                  "descale_block_rows"})
    if given:
        raise TypeError(f"flash_attention_fp8 computes {given} itself from the quantization; "
                        f"to pass your own, quantize with quantize_fp8 and call "
                        f"flash_attention")
    q, k, v = _validate.check_qkv(q, k, v, fp8=True)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if _validate.is_fp8(x.dtype):
            raise TypeError(f"flash_attention_fp8 quantizes bfloat16/float16/float32 inputs; "
                            f"{name} is already {x.dtype}: call flash_attention with its "
                            f"descales")
    incoherent = _validate.check_bool("incoherent", incoherent)
    rotation = None
    if incoherent:
        rotation = jax.random.key(_DEFAULT_KEY_SEED) if key is None else _check_key("key", key)
    elif key is not None:
        raise ValueError("key is the PRNG key of the Hadamard signs: pass incoherent=True "
                         "with it (or no key)")
    q8, q_descale = _quantize("q", q, granularity, block_rows, rotation)
    k8, k_descale = _quantize("k", k, granularity, block_rows, rotation)
    v8, v_descale = _quantize("v", v, granularity, block_rows, None)
    return flash_attention(q8, k8, v8, q_descale=q_descale, k_descale=k_descale,
                           v_descale=v_descale,
                           descale_block_rows=block_rows if granularity == "block" else None,
                           **flash_attention_kwargs)
