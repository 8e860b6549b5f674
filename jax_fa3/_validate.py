"""Input validation for the public API, in one place.

Everything here looks only at static shapes, dtypes and Python values, so errors are raised at
trace time, before anything is lowered. Messages name the argument, what it got and what was
expected.
"""

from __future__ import annotations

import math
import operator

import jax
import jax.numpy as jnp
import numpy as np

MAX_HEAD_DIM = 256
KERNEL_DTYPES = ("bfloat16", "float16")
FP8_DTYPE = jnp.float8_e4m3fn
FP8_OUT_DTYPES = ("bfloat16", "float16")
IMPLEMENTATIONS = (None, "cuda", "xla")


def as_array(name: str, x):
    """`x` as a JAX array, or a TypeError naming `name`."""
    if isinstance(x, jax.Array):
        return x
    try:
        return jnp.asarray(x)
    except (TypeError, ValueError) as err:
        raise TypeError(f"{name} must be an array, got {type(x).__name__}") from err


def _floating(name: str, x):
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating-point array (bfloat16, float16 or float32), "
                        f"got dtype {x.dtype} with shape {x.shape}")


def is_fp8(dtype) -> bool:
    """A one-byte float (float8_e4m3fn, e5m2, ...)."""
    return jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize == 1


def _check_fp8_dtype(name: str, x, fp8: bool):
    """One-byte floats: float8_e4m3fn where the caller takes FP8 (`fp8`), nowhere else."""
    if not is_fp8(x.dtype):
        return
    if not fp8:
        raise TypeError(f"{name} has dtype {x.dtype}: FP8 inputs are taken by "
                        f"jax_fa3.flash_attention only (with q_descale, k_descale, v_descale)")
    if jnp.dtype(x.dtype) != jnp.dtype(FP8_DTYPE):
        raise TypeError(f"{name} has dtype {x.dtype}: the FP8 path takes float8_e4m3fn (e4m3) "
                        f"only")


def check_qkv(q, k, v, names=("q", "k", "v"), fp8=False):
    """Arrays q (b, sq, hq, d), k (b, sk, hkv, d) and v (b, sk, hkv, dv) with one float dtype,
    hq % hkv == 0 and 1 <= d, dv <= 256. v's head dim may differ from q's and k's (the output
    takes v's). float8_e4m3fn only when `fp8` (flash_attention). Returns them as arrays."""
    nq, nk, nv = names
    q, k, v = as_array(nq, q), as_array(nk, k), as_array(nv, v)
    for name, x, seq in ((nq, q, "seqlen_q"), (nk, k, "seqlen_k"), (nv, v, "seqlen_k")):
        heads = "heads_q" if name == nq else "heads_kv"
        if x.ndim != 4:
            raise ValueError(f"{name} must have rank 4 (batch, {seq}, {heads}, head_dim), "
                             f"got shape {x.shape}")
        _floating(name, x)
        _check_fp8_dtype(name, x, fp8)
    for name, x in ((nk, k), (nv, v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {x.dtype} but {nq} has dtype {q.dtype}; "
                            f"{nq}, {nk} and {nv} must share one dtype")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"{nv} has shape {v.shape}, expected the batch, seqlen_k and heads_kv "
                         f"of {nk} {k.shape} (batch, seqlen_k, heads_kv, head_dim_v)")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"batch mismatch: {nq} has shape {q.shape} (batch {q.shape[0]}) but "
                         f"{nk} has shape {k.shape} (batch {k.shape[0]})")
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"head_dim mismatch: {nq} has shape {q.shape} (head_dim {q.shape[3]}) "
                         f"but {nk} has shape {k.shape} (head_dim {k.shape[3]})")
    hq, hkv = q.shape[2], k.shape[2]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"heads of {nq} (shape {q.shape}: {hq} heads) must be a multiple of "
                         f"heads of {nk}/{nv} (shape {k.shape}: {hkv} heads) for GQA/MQA")
    for name, x in ((nq, q), (nv, v)):
        if not 1 <= x.shape[3] <= MAX_HEAD_DIM:
            raise ValueError(f"head_dim {x.shape[3]} of {name} (shape {x.shape}) is not "
                             f"supported: expected 1 <= head_dim <= {MAX_HEAD_DIM}")
    return q, k, v


def check_sinks(sinks, heads_q: int, name: str = "sinks"):
    """None, or the attention-sink logits as a float32 (heads_q,) array (any float dtype is
    accepted; the cast is differentiable, so the cotangent comes back in the caller's dtype).
    Values are data, not checked: -inf is a sink that takes no weight."""
    if sinks is None:
        return None
    sinks = as_array(name, sinks)
    if not jnp.issubdtype(sinks.dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating-point array of shape ({heads_q},) (one "
                        f"logit per query head), got dtype {sinks.dtype} with shape "
                        f"{sinks.shape}")
    if sinks.shape != (heads_q,):
        raise ValueError(f"{name} must have shape ({heads_q},) (one logit per query head, "
                         f"heads_q = {heads_q}), got shape {sinks.shape}")
    return sinks.astype(jnp.float32)


def static_float(name: str, x) -> float:
    """A Python float from a static scalar; traced values are a TypeError (the kernels take
    these as compile-time attributes)."""
    try:
        value = float(x)
    except (TypeError, jax.errors.ConcretizationTypeError) as err:
        raise TypeError(f"{name} must be a static Python number (not a traced array), "
                        f"got {type(x).__name__}") from err
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def static_int(name: str, x) -> int:
    if isinstance(x, bool):
        raise TypeError(f"{name} must be an int, got bool {x}")
    try:
        return operator.index(x)
    except TypeError as err:
        raise TypeError(f"{name} must be a static Python int, got {type(x).__name__} "
                        f"{x!r}") from err


def check_softmax_scale(softmax_scale, head_dim: int, name: str = "softmax_scale") -> float:
    """The scale, 1/sqrt(head_dim) when None; errors call it `name` (the caller's argument).
    0 is legal: every visible key gets the same weight."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    return static_float(name, softmax_scale)


def check_softcap(softcap) -> float:
    value = static_float("softcap", softcap)
    if value < 0:
        raise ValueError(f"softcap must be >= 0 (0 turns it off), got {value}")
    return value


def check_window(window_size) -> tuple[int, int]:
    """(left, right) ints >= -1, -1 meaning unbounded."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise ValueError(f"window_size must be a pair (left, right) of ints >= -1 (-1 = "
                         f"unbounded), got {window_size!r}")
    left, right = (static_int("window_size", w) for w in window_size)
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= -1 (-1 = unbounded), got {window_size!r}")
    return left, right


def check_bool(name: str, x) -> bool:
    """A static bool (Python or numpy); traced values and other types are a TypeError."""
    if not isinstance(x, (bool, int, np.bool_)):
        raise TypeError(f"{name} must be a Python bool, got {type(x).__name__} {x!r}")
    return bool(x)


def check_implementation(implementation):
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be None, 'cuda' or 'xla', got {implementation!r}")
    return implementation


def kernel_input_reason(dtype, head_dim: int, head_dim_v: int | None = None) -> str | None:
    """Why the Hopper kernels cannot take inputs of this dtype and head dims (q/k's
    `head_dim`, v's `head_dim_v`, default the same), or None. Any multiple of 8 up to 256
    runs, on the smallest compiled kernel head dim that holds both (jax_fa3/_ffi.py); for FP8
    (float8_e4m3fn, forward only) a multiple of 16 (TMA's 16-byte rows)."""
    name = jnp.dtype(dtype).name
    fp8 = is_fp8(dtype)
    if fp8 and jnp.dtype(dtype) != jnp.dtype(FP8_DTYPE):
        return f"the FP8 kernel takes float8_e4m3fn inputs, got {name}"
    if not fp8 and name not in KERNEL_DTYPES:
        return f"the kernels take bfloat16 or float16 inputs, got {name}"
    multiple, kind = (16, "the FP8 kernel needs") if fp8 else (8, "the kernels need")
    for label, d in (("head_dim", head_dim), ("head_dim of v", head_dim_v)):
        if d is not None and (d % multiple != 0 or d > MAX_HEAD_DIM):
            return f"{kind} {label} a multiple of {multiple} up to {MAX_HEAD_DIM}, got {d}"
    return None


# ----------------------------------------------------------------------------- packed sequences

def _int_array(name: str, x, shape: tuple, expected: str):
    """x as an int32 array of `shape`; any integer dtype is accepted (and cast), bool is not."""
    x = as_array(name, x)
    if x.dtype == jnp.bool_ or not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array (int32) of shape {shape} "
                        f"({expected}), got dtype {x.dtype} with shape {x.shape}")
    if x.shape != shape:
        raise ValueError(f"{name} must have shape {shape} ({expected}), got shape {x.shape} "
                         f"(dtype {x.dtype})")
    return x.astype(jnp.int32)


def check_segments(q_segment_ids, kv_segment_ids, q_positions, kv_positions, q_shape, k_shape):
    """None, or the (q_ids, kv_ids, q_pos, kv_pos) int32 arrays of a packed call (positions
    both None or both arrays), for q of shape (b, sq, ...) and k of shape (b, sk, ...).

    Only q ids: the kv ids are the same (seqlen_q == seqlen_k). Only kv ids: an error.
    Positions need segment ids; one side's positions alone stand for the other side's too when
    the two sides share their ids (kv_segment_ids None, or the very same array)."""
    b, sq, sk = q_shape[0], q_shape[1], k_shape[1]
    if q_segment_ids is None:
        for name, x in (("kv_segment_ids", kv_segment_ids), ("q_positions", q_positions),
                        ("kv_positions", kv_positions)):
            if x is not None:
                raise ValueError(f"{name} was given without q_segment_ids: pass q_segment_ids "
                                 f"(batch, seqlen_q) too (positions and key ids need the "
                                 f"query ids)")
        return None
    shared = kv_segment_ids is None or kv_segment_ids is q_segment_ids
    if kv_segment_ids is None and sq != sk:
        raise ValueError(f"q_segment_ids alone stands for the keys' ids too, which needs "
                         f"seqlen_q == seqlen_k; got seqlen_q {sq} and seqlen_k {sk}: pass "
                         f"kv_segment_ids of shape ({b}, {sk})")
    q_ids = _int_array("q_segment_ids", q_segment_ids, (b, sq),
                       "(batch, seqlen_q) of the query q, 0 = padding")
    kv_ids = q_ids if kv_segment_ids is None else _int_array(
        "kv_segment_ids", kv_segment_ids, (b, sk), "(batch, seqlen_k) of the key k, 0 = padding")
    if (q_positions is None) != (kv_positions is None) and not shared:
        given = "q_positions" if kv_positions is None else "kv_positions"
        missing = "kv_positions" if kv_positions is None else "q_positions"
        raise ValueError(f"{given} was given without {missing}: one side's positions stand "
                         f"for both only when the sides share their segment ids "
                         f"(kv_segment_ids None or the same array); pass {missing} too")
    q_pos = kv_pos = None
    if q_positions is not None:
        q_pos = _int_array("q_positions", q_positions, (b, sq),
                           "(batch, seqlen_q), the position of each query in its document")
    if kv_positions is not None:
        kv_pos = _int_array("kv_positions", kv_positions, (b, sk),
                            "(batch, seqlen_k), the position of each key in its document")
    if q_pos is None and kv_pos is not None:
        q_pos = kv_pos
    elif kv_pos is None and q_pos is not None:
        kv_pos = q_pos
    return q_ids, kv_ids, q_pos, kv_pos


def _concrete(x):
    """x's values as numpy when known at trace time, else None."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, total_q: int,
                     total_k: int):
    """The varlen offsets as int32 (n + 1,) arrays of one length n + 1 >= 1. max_seqlen_* are
    static ints >= 0. Offsets known at trace time are checked too: non-decreasing from 0, the
    last at most the number of tokens, no sequence longer than its max_seqlen."""
    max_q = static_int("max_seqlen_q", max_seqlen_q)
    max_k = static_int("max_seqlen_k", max_seqlen_k)
    out = []
    for name, cu, total, most, side in (
            ("cu_seqlens_q", cu_seqlens_q, total_q, max_q, "q"),
            ("cu_seqlens_k", cu_seqlens_k, total_k, max_k, "k")):
        if most < 0:
            raise ValueError(f"max_seqlen_{side} must be >= 0, got {most}")
        cu = as_array(name, cu)
        if (cu.dtype == jnp.bool_ or not jnp.issubdtype(cu.dtype, jnp.integer)
                or cu.ndim != 1 or cu.shape[0] < 1):
            raise TypeError(f"{name} must be a 1-D integer array (int32) of shape (n + 1,) "
                            f"(the offsets of n sequences, from 0), got dtype {cu.dtype} with "
                            f"shape {cu.shape}")
        values = _concrete(cu)
        if values is not None:
            lengths = np.diff(values.astype(np.int64))
            if values[0] != 0 or (lengths < 0).any() or values[-1] > total:
                raise ValueError(f"{name} must be non-decreasing offsets from 0 to at most "
                                 f"{total} (the tokens of {side}), got {values.tolist()}")
            if lengths.size and lengths.max() > most:
                raise ValueError(f"{name} holds a sequence of length {int(lengths.max())}, "
                                 f"longer than max_seqlen_{side}={most}")
        out.append(cu.astype(jnp.int32))
    if out[0].shape != out[1].shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have one length (n + 1 for n "
                         f"sequences), got shapes {out[0].shape} and {out[1].shape}")
    return tuple(out)


# ----------------------------------------------------------------------------- FP8

def check_out_dtype(out_dtype):
    """The output dtype of an FP8 call: bfloat16 (None, the default) or float16, given as a
    name or a dtype."""
    if out_dtype is None:
        return jnp.dtype(jnp.bfloat16)
    try:
        dtype = jnp.dtype(out_dtype)
    except TypeError as err:
        raise TypeError(f"out_dtype must be 'bfloat16' or 'float16' (or those jnp dtypes), "
                        f"got {out_dtype!r}") from err
    if dtype.name not in FP8_OUT_DTYPES:
        raise ValueError(f"out_dtype must be 'bfloat16' or 'float16' for FP8 inputs, got "
                         f"{dtype.name}")
    return dtype


def _descale(name, x, shapes: dict):
    """x as a float32 array whose shape is one of `shapes` ({shape: meaning})."""
    x = as_array(name, x)
    expected = ", ".join(f"{shape} ({meaning})" for shape, meaning in shapes.items())
    if not jnp.issubdtype(x.dtype, jnp.floating) or is_fp8(x.dtype):
        raise TypeError(f"{name} must be a float32 array of shape {expected}; got dtype "
                        f"{x.dtype} with shape {x.shape}")
    if x.shape not in shapes:
        raise ValueError(f"{name} must have shape {expected}; got shape {x.shape}")
    return x.astype(jnp.float32)


def check_fp8_args(q, k, q_descale, k_descale, v_descale, descale_block_rows, out_dtype):
    """The FP8 arguments of flash_attention for validated q (b, sq, hq, d) and k (b, sk, hkv, d).

    Non-FP8 inputs take none of them (an error names the one given) and get None back. FP8
    inputs get ((q_descale, k_descale, v_descale), descale_block_rows, out_dtype): each
    descale None (= 1) or float32 of shape () (per tensor), (b, hkv) (per batch row and kv
    head, FA3's), for q also (b, hq) (per query head), and with descale_block_rows r
    (b, hkv, ceil(sk / r)) for k and v, (b, hq or hkv, ceil(sq / r)) for q (per block of r
    tokens of one head)."""
    args = dict(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                descale_block_rows=descale_block_rows, out_dtype=out_dtype)
    if not is_fp8(q.dtype):
        for name, x in args.items():
            if x is not None:
                raise ValueError(f"{name} is for float8_e4m3fn inputs only, but q has dtype "
                                 f"{q.dtype} (quantize with jax_fa3.quantize_fp8, or call "
                                 f"jax_fa3.flash_attention_fp8)")
        return None
    b, sq, hq = q.shape[:3]
    sk, hkv = k.shape[1:3]
    rows = None if descale_block_rows is None else static_int("descale_block_rows",
                                                              descale_block_rows)
    if rows is not None and rows < 1:
        raise ValueError(f"descale_block_rows must be >= 1, got {rows}")
    descales = []
    for name, x, seqlen in (("q_descale", q_descale, sq), ("k_descale", k_descale, sk),
                            ("v_descale", v_descale, sk)):
        if x is None:
            descales.append(None)
            continue
        shapes = {(): "per tensor", (b, hkv): "per batch row and kv head"}
        if name == "q_descale":
            shapes[(b, hq)] = "per batch row and query head"
        block = f"per block of descale_block_rows={rows} tokens"
        if rows is not None:
            n = -(-seqlen // rows)
            shapes[(b, hkv, n)] = block
            if name == "q_descale":
                shapes[(b, hq, n)] = block
        elif getattr(x, "ndim", jnp.ndim(x)) == 3:
            raise ValueError(f"{name} of shape {jnp.shape(x)} holds per-block descales: pass "
                             f"descale_block_rows, the tokens per block (quantize_fp8's "
                             f"block_rows)")
        descales.append(_descale(name, x, shapes))
    return tuple(descales), rows, check_out_dtype(out_dtype)
