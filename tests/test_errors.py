"""Bad input: a ValueError/TypeError at trace time naming the argument as the caller spelled
it, what it got and what was expected. Checked while tracing (jax.eval_shape, or jax.jit for
an argument passed as a tracer), so nothing is compiled or run."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from jax_fa3 import dot_product_attention, flash_attention, unavailable_reason

BF16, F32 = jnp.bfloat16, jnp.float32


def sds(shape, dtype=BF16):
    return jax.ShapeDtypeStruct(shape, dtype)


Q = sds((2, 16, 8, 64))
KV = sds((2, 32, 2, 64))


def trace(fn, q=Q, k=KV, v=KV, **kw):
    """Trace only: errors must come from the Python-level checks."""
    return jax.eval_shape(lambda q, k, v: fn(q, k, v, **kw), q, k, v)


# (what, q, k, v, options, exception, fragments the message must contain)
FLASH_CASES = [
    ("q rank 3", sds((16, 8, 64)), KV, KV, {}, ValueError, ["q", "rank 4", "(16, 8, 64)"]),
    ("k rank 5", Q, sds((2, 32, 2, 64, 1)), KV, {}, ValueError, ["k", "rank 4", "(2, 32, 2, 64, 1)"]),
    ("dtype mismatch", Q, sds((2, 32, 2, 64), F32), KV, {}, TypeError, ["k", "float32", "bfloat16"]),
    ("integer inputs", sds((2, 16, 8, 64), jnp.int32), sds((2, 32, 2, 64), jnp.int32),
     sds((2, 32, 2, 64), jnp.int32), {}, TypeError, ["q", "floating", "int32"]),
    ("head_dim mismatch", Q, sds((2, 32, 2, 32)), sds((2, 32, 2, 32)), {}, ValueError,
     ["head_dim", "(2, 16, 8, 64)", "(2, 32, 2, 32)"]),
    ("heads not divisible", sds((2, 16, 6, 64)), sds((2, 32, 4, 64)), sds((2, 32, 4, 64)), {},
     ValueError, ["multiple", "6", "4"]),
    ("head_dim > 256", sds((1, 4, 2, 320)), sds((1, 4, 2, 320)), sds((1, 4, 2, 320)), {},
     ValueError, ["head_dim 320", "256"]),
    ("batch mismatch", Q, sds((3, 32, 2, 64)), sds((3, 32, 2, 64)), {}, ValueError,
     ["batch", "(2, 16, 8, 64)", "(3, 32, 2, 64)"]),
    ("k/v seqlen mismatch", Q, KV, sds((2, 31, 2, 64)), {}, ValueError,
     ["v", "(2, 31, 2, 64)", "(2, 32, 2, 64)"]),
    ("k/v heads mismatch", Q, KV, sds((2, 32, 4, 64)), {}, ValueError,
     ["v", "(2, 32, 4, 64)", "(2, 32, 2, 64)", "heads_kv"]),
    ("v head_dim > 256", Q, KV, sds((2, 32, 2, 264)), {}, ValueError,
     ["head_dim 264", "v", "256"]),
    ("v rank 3", Q, KV, sds((2, 32, 64)), {}, ValueError, ["v", "rank 4", "(2, 32, 64)"]),
    ("sinks shape", Q, KV, KV, dict(sinks=jnp.zeros((2,))), ValueError,
     ["sinks", "(8,)", "(2,)"]),
    ("sinks rank 2", Q, KV, KV, dict(sinks=jnp.zeros((1, 8))), ValueError,
     ["sinks", "(8,)", "(1, 8)"]),
    ("sinks integer", Q, KV, KV, dict(sinks=jnp.zeros((8,), jnp.int32)), TypeError,
     ["sinks", "floating", "int32"]),
    ("sinks not an array", Q, KV, KV, dict(sinks="none"), TypeError, ["sinks"]),
    ("window too small", Q, KV, KV, dict(window_size=(-2, 0)), ValueError, ["window_size", "-2"]),
    ("window wrong length", Q, KV, KV, dict(window_size=(3,)), ValueError, ["window_size", "(3,)"]),
    ("window not ints", Q, KV, KV, dict(window_size=(1.5, 2)), TypeError, ["window_size", "1.5"]),
    ("negative softcap", Q, KV, KV, dict(softcap=-1.0), ValueError, ["softcap", "-1.0"]),
    ("infinite scale", Q, KV, KV, dict(softmax_scale=float("inf")), ValueError, ["softmax_scale"]),
    ("unknown implementation", Q, KV, KV, dict(implementation="cudnn"), ValueError,
     ["implementation", "'cudnn'"]),
    ("causal not bool", Q, KV, KV, dict(causal="yes"), TypeError, ["causal"]),
]


@pytest.mark.parametrize("case", FLASH_CASES, ids=[c[0] for c in FLASH_CASES])
def test_flash_attention_rejects(case):
    _, q, k, v, kw, exc, fragments = case
    with pytest.raises(exc) as err:
        trace(flash_attention, q, k, v, **kw)
    for fragment in fragments:
        assert fragment in str(err.value), f"{fragment!r} not in: {err.value}"


def test_value_head_dim_of_its_own_is_accepted():
    """v's head dim may differ from q's and k's: out takes it; the default scale is q's."""
    v = sds((2, 32, 2, 48))
    out, lse = trace(flash_attention, v=v, return_lse=True, sinks=jnp.zeros((8,), BF16))
    assert out.shape == (2, 16, 8, 48) and out.dtype == BF16 and lse.shape == (2, 8, 16)


def test_sinks_as_a_traced_argument():
    """sinks are data: a traced array of any float dtype is fine."""
    q = jnp.ones((1, 4, 2, 8), F32)
    out = jax.jit(lambda q, s: flash_attention(q, q, q, sinks=s))(q, jnp.zeros((2,), BF16))
    assert out.shape == q.shape


def test_traced_softcap_and_scale_are_type_errors():
    q = jnp.ones((1, 4, 2, 8), F32)
    with pytest.raises(TypeError, match="softcap must be a static Python number"):
        jax.jit(lambda q, c: flash_attention(q, q, q, softcap=c))(q, 1.0)
    with pytest.raises(TypeError, match="softmax_scale must be a static"):
        jax.jit(lambda q, s: flash_attention(q, q, q, softmax_scale=s))(q, 0.5)


def test_non_array_input_is_a_type_error():
    with pytest.raises(TypeError, match="q must be an array"):
        flash_attention("not an array", jnp.ones((1, 2, 1, 8)), jnp.ones((1, 2, 1, 8)))


def test_cuda_runs_or_says_why_not():
    reason = unavailable_reason("fwd", BF16, 64)
    if reason is None:
        assert trace(flash_attention, implementation="cuda").shape == Q.shape
    else:
        with pytest.raises(RuntimeError) as err:
            trace(flash_attention, implementation="cuda")
        assert reason in str(err.value)


NQ = sds((2, 16, 8, 64), F32)
NKV = sds((2, 32, 2, 64), F32)
NN_CASES = [
    ("query rank 5", dict(query=sds((1, 2, 16, 8, 64), F32)), {}, ValueError, ["query", "(1, 2, 16, 8, 64)"]),
    ("key rank differs", dict(key=sds((32, 2, 64), F32)), {}, ValueError, ["key", "(32, 2, 64)"]),
    ("dtype mismatch", dict(value=sds((2, 32, 2, 64), BF16)), {}, TypeError, ["value", "bfloat16"]),
    ("heads", dict(query=sds((2, 16, 3, 64), F32)), {}, ValueError, ["multiple", "3", "2"]),
    # jax.nn.dot_product_attention takes one head dim for key and value: so does the drop-in.
    ("value head dim", dict(value=sds((2, 32, 2, 32), F32)), {}, ValueError,
     ["value", "(2, 32, 2, 32)", "key", "(2, 32, 2, 64)"]),
    ("mask not bool", {}, dict(mask=jnp.ones((2, 1, 16, 32), jnp.int32)), TypeError,
     ["mask", "boolean", "int32"]),
    ("mask bad shape", {}, dict(mask=jnp.ones((2, 1, 16, 31), bool)), ValueError,
     ["mask", "(2, 1, 16, 31)", "(2, 8, 16, 32)"]),
    ("bias rank 5", {}, dict(bias=jnp.ones((1, 2, 1, 16, 32))), ValueError, ["bias", "4 dims"]),
    ("bias bad shape", {}, dict(bias=jnp.ones((3, 8, 16, 32))), ValueError, ["bias", "(3, 8, 16, 32)"]),
    ("seq lengths shape", {}, dict(query_seq_lengths=jnp.ones((3,), jnp.int32)), ValueError,
     ["query_seq_lengths", "(2,)", "(3,)"]),
    ("seq lengths dtype", {}, dict(key_value_seq_lengths=jnp.ones((2,), F32)), ValueError,
     ["key_value_seq_lengths", "int32", "float32"]),
    ("window triple", {}, dict(local_window_size=(1, 2, 3)), ValueError, ["local_window_size"]),
    ("implementation", {}, dict(implementation="cudnn"), ValueError, ["implementation"]),
]


@pytest.mark.parametrize("case", NN_CASES, ids=[c[0] for c in NN_CASES])
def test_dot_product_attention_rejects(case):
    _, arrays, kw, exc, fragments = case
    arrays = {"query": NQ, "key": NKV, "value": NKV, **arrays}
    with pytest.raises(exc) as err:
        jax.eval_shape(lambda q, k, v: dot_product_attention(q, k, v, **kw),
                       arrays["query"], arrays["key"], arrays["value"])
    for fragment in fragments:
        assert fragment in str(err.value), f"{fragment!r} not in: {err.value}"


# ----------------------------------------------------------------------------- argument names

def _error(fn, arrays, kwargs, traced=None):
    """The message of the TypeError/ValueError of fn(**arrays, **kwargs); the argument named
    `traced` is passed as a tracer (under jax.jit), the rest as they are."""
    kwargs = {**arrays, **kwargs}
    with pytest.raises((TypeError, ValueError)) as err:
        if traced is None:
            fn(**kwargs)
        else:
            value = kwargs.pop(traced)
            jax.jit(lambda x: fn(**kwargs, **{traced: x}))(value)
    return str(err.value)


NN_ARRAYS = dict(query=jnp.ones((2, 16, 8, 64), F32), key=jnp.ones((2, 32, 2, 64), F32),
                 value=jnp.ones((2, 32, 2, 64), F32))

# Every argument of the drop-in, wrong: (argument, keyword arguments, the one traced or None).
NN_ARGUMENTS = [
    ("query", dict(query=jnp.ones((2, 16, 8, 64), jnp.int32)), None),
    ("key", dict(key=jnp.ones((32, 2, 64), F32)), None),
    ("value", dict(value=jnp.ones((2, 31, 2, 64), F32)), None),
    ("bias", dict(bias=jnp.ones((2, 8, 16, 31), F32)), "bias"),
    ("mask", dict(mask=jnp.ones((2, 1, 16, 32), jnp.int32)), "mask"),
    ("scale", dict(scale=0.5), "scale"),
    ("scale", dict(scale=float("nan")), None),
    ("is_causal", dict(is_causal=True), "is_causal"),
    ("query_seq_lengths", dict(query_seq_lengths=jnp.ones((2,), F32)), "query_seq_lengths"),
    ("key_value_seq_lengths", dict(key_value_seq_lengths=jnp.ones((3,), jnp.int32)), None),
    ("local_window_size", dict(local_window_size=4), "local_window_size"),
    ("local_window_size", dict(local_window_size=(1, 2, 3)), None),
    ("implementation", dict(implementation="cudnn"), None),
    ("return_residual", dict(return_residual=True), "return_residual"),
]

# flash_attention's spellings, which a drop-in error must not use (q/k/v as whole words).
FLASH_NAMES = re.compile(r"(?<!\w)(softmax_scale|window_size|causal|return_lse|q|k|v)(?!\w)")


@pytest.mark.parametrize("case", NN_ARGUMENTS, ids=[f"{c[0]}-{'traced' if c[2] else i}"
                                                    for i, c in enumerate(NN_ARGUMENTS)])
def test_dot_product_attention_errors_name_the_callers_argument(case):
    """Issue 30: `scale=<traced>` says `scale`, not `softmax_scale`; so for every argument."""
    name, kwargs, traced = case
    message = _error(dot_product_attention, NN_ARRAYS, kwargs, traced)
    assert name in message, message
    assert not FLASH_NAMES.search(message), f"{FLASH_NAMES.search(message)[0]!r} in: {message}"


FLASH_ARRAYS = dict(q=jnp.ones((2, 16, 8, 64), BF16), k=jnp.ones((2, 32, 2, 64), BF16),
                    v=jnp.ones((2, 32, 2, 64), BF16))

FLASH_ARGUMENTS = [
    ("q", dict(q=jnp.ones((2, 16, 8), BF16)), None),
    ("k", dict(k=jnp.ones((2, 32, 2, 64), F32)), None),
    ("v", dict(v=jnp.ones((2, 31, 2, 32), BF16)), None),
    ("sinks", dict(sinks=jnp.ones((3,), F32)), None),
    ("sinks", dict(sinks=jnp.ones((8,), jnp.int32)), "sinks"),
    ("softmax_scale", dict(softmax_scale=0.5), "softmax_scale"),
    ("causal", dict(causal=True), "causal"),
    ("window_size", dict(window_size=(4, 0)), "window_size"),
    ("softcap", dict(softcap=1.0), "softcap"),
    ("return_lse", dict(return_lse="yes"), None),
    ("deterministic", dict(deterministic=True), "deterministic"),
    ("implementation", dict(implementation="cudnn"), None),
]


@pytest.mark.parametrize("case", FLASH_ARGUMENTS, ids=[c[0] for c in FLASH_ARGUMENTS])
def test_flash_attention_errors_name_the_argument(case):
    name, kwargs, traced = case
    assert name in _error(flash_attention, FLASH_ARRAYS, kwargs, traced)
