"""Flax modules whose attention runs on jax_fa3: NNX, Linen, and an ``attention_fn`` adapter.

Three ways in, from least to most change to an existing model:

* :func:`make_attention_fn` / :data:`attention_fn`: pass to a stock
  ``flax.nnx.MultiHeadAttention(..., attention_fn=...)`` or
  ``flax.linen.MultiHeadDotProductAttention(attention_fn=...)``; parameters stay as they are.
* :class:`MultiHeadAttention` (NNX) and :class:`LinenMultiHeadAttention`: the same parameter
  layout as Flax's multi-head attention (``query``/``key``/``value``/``out`` linear maps), plus
  what flash attention does natively: GQA (``num_kv_heads``), bottom-right aligned causal masks,
  sliding windows, logit soft-capping, optional RoPE and optional learnable attention sinks
  (``use_sinks``: a ``sinks`` parameter of shape ``(num_heads,)``, float32, zero at creation),
  and packed sequences (``segment_ids`` in the call). No dropout.

Flax is an optional dependency: ``pip install 'jax-fa3[flax]'``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

try:
    from flax import linen, nnx
except ImportError as err:  # pragma: no cover - exercised by a monkeypatched test
    raise ImportError(
        "jax_fa3.nn.flax needs Flax, which is not installed. "
        "Install the extra with: pip install 'jax-fa3[flax]'"
    ) from err

import jax
import jax.numpy as jnp

import jax_fa3
from jax_fa3.nn._core import (Implementation, attend, initial_sinks, module_options,
                              self_attention_defaults)

__all__ = [
    "LinenMultiHeadAttention",
    "MultiHeadAttention",
    "attention_fn",
    "make_attention_fn",
]

Dtype = Any  # a jnp dtype or anything jnp.dtype accepts

_default_kernel_init = nnx.initializers.lecun_normal()
_zeros_init = nnx.initializers.zeros_init()


# --------------------------------------------------------------------------------------------
# attention_fn adapter for stock Flax MultiHeadAttention
# --------------------------------------------------------------------------------------------


def _flatten_batch(x: jax.Array | None, batch_shape: tuple[int, ...]) -> jax.Array | None:
    """Broadcasts the leading axes of a mask/bias to ``batch_shape`` and merges them into one."""
    if x is None:
        return None
    x = jnp.asarray(x)
    x = x.reshape((1,) * (3 - x.ndim) + x.shape)  # (q, k) -> (1, q, k): heads axis first
    lead = x.shape[:-3]
    if len(lead) > len(batch_shape):
        raise ValueError(
            f"mask/bias of shape {x.shape} has more batch axes than the query "
            f"(batch shape {batch_shape})"
        )
    x = jnp.broadcast_to(x, batch_shape + x.shape[-3:]) if lead != batch_shape else x
    return x.reshape((math.prod(batch_shape),) + x.shape[-3:])


def make_attention_fn(
    *, implementation: Implementation = None, ignore_precision: bool = False
) -> Callable[..., jax.Array]:
    """Builds an ``attention_fn`` for Flax's stock multi-head attention modules.

    The returned function takes every keyword that ``flax.nnx.MultiHeadAttention`` and
    ``flax.linen.MultiHeadDotProductAttention`` pass to their ``attention_fn`` and runs the
    attention through :func:`jax_fa3.dot_product_attention`. Arguments that jax_fa3 cannot honour
    raise an error instead of being dropped:

    * dropout (``dropout_rate > 0`` while not ``deterministic``): ``NotImplementedError``;
    * ``sow_weights=True`` (``module`` given): flash attention never forms the weights;
    * the AQT einsum hooks (``qk_attn_weights_einsum``, ``attn_weights_value_einsum``);
    * a ``precision`` other than ``None``/``DEFAULT``, unless ``ignore_precision=True`` (then the
      module's precision still applies to its projections, and attention keeps its fixed
      precision: fp32 softmax and accumulation).

    ``mask`` (boolean or 0/1 float, broadcastable to ``[batch..., heads, q, k]``), ``bias``,
    ``is_causal`` (top-left aligned, as in Flax) and GQA key/value heads are supported.
    ``force_fp32_for_softmax`` is always satisfied: the softmax runs in float32.

    Args:
      implementation: ``None`` (Hopper kernel when available, else the portable path),
        ``"cuda"`` or ``"xla"``; see :func:`jax_fa3.dot_product_attention`.
      ignore_precision: accept a non-default ``precision`` (see above).
    """

    def jax_fa3_attention_fn(
        query: jax.Array,
        key: jax.Array,
        value: jax.Array,
        bias: jax.Array | None = None,
        mask: jax.Array | None = None,
        broadcast_dropout: bool = True,
        dropout_rng: jax.Array | None = None,
        dropout_rate: float = 0.0,
        deterministic: bool = False,
        dtype: Dtype | None = None,
        precision: Any = None,
        module: Any = None,
        promote_dtype: Callable[..., Any] | None = None,
        is_causal: bool = False,
        force_fp32_for_softmax: bool = False,
        qk_attn_weights_einsum: Callable[..., jax.Array] | None = None,
        attn_weights_value_einsum: Callable[..., jax.Array] | None = None,
    ) -> jax.Array:
        del broadcast_dropout, dropout_rng, force_fp32_for_softmax  # see the checks below
        if dropout_rate > 0.0 and not deterministic:
            raise NotImplementedError(
                f"jax_fa3 attention has no dropout (got dropout_rate={dropout_rate} with "
                "deterministic=False). Use dropout_rate=0.0, or deterministic=True."
            )
        if module is not None:
            raise NotImplementedError(
                "sow_weights=True needs the attention weights, which jax_fa3 never forms. "
                "Use Flax's default attention_fn to inspect attention weights."
            )
        if qk_attn_weights_einsum is not None or attn_weights_value_einsum is not None:
            raise NotImplementedError(
                "custom attention einsums (qk_attn_weights_einsum / attn_weights_value_einsum, "
                "e.g. AQT quantisation) are not supported by jax_fa3."
            )
        if precision not in (None, jax.lax.Precision.DEFAULT, "default") and not ignore_precision:
            raise ValueError(
                f"jax_fa3 attention has a fixed precision, got precision={precision!r}. Use "
                "precision=None, or make_attention_fn(ignore_precision=True) to apply it to "
                "the projections only."
            )
        if promote_dtype is not None:
            query, key, value = promote_dtype((query, key, value), dtype=dtype)
        else:
            common = dtype if dtype is not None else jnp.result_type(query, key, value)
            query, key, value = (jnp.asarray(x, common) for x in (query, key, value))

        # jax_fa3 takes exactly one batch axis: merge several, or add one for unbatched input.
        batch_shape = query.shape[:-3]
        out_shape = query.shape[:-1] + value.shape[-1:]
        q, k, v = (x.reshape((math.prod(batch_shape),) + x.shape[-3:]) for x in (query, key, value))
        if mask is not None:
            mask = jnp.asarray(mask).astype(jnp.bool_)
        out = jax_fa3.dot_product_attention(
            q,
            k,
            v,
            bias=_flatten_batch(bias, batch_shape),
            mask=_flatten_batch(mask, batch_shape),
            is_causal=is_causal,
            implementation=implementation,
        )
        return out.reshape(out_shape)

    return jax_fa3_attention_fn


#: Ready-made adapter with ``implementation=None``:
#: ``flax.nnx.MultiHeadAttention(..., attention_fn=jax_fa3.nn.flax.attention_fn)``.
attention_fn = make_attention_fn()


# --------------------------------------------------------------------------------------------
# shared core of the NNX and Linen modules
# --------------------------------------------------------------------------------------------


def _check_heads(num_heads: int, num_kv_heads: int, qkv_features: int) -> int:
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if qkv_features % num_heads:
        raise ValueError(f"qkv_features ({qkv_features}) must be divisible by num_heads ({num_heads})")
    return qkv_features // num_heads


# --------------------------------------------------------------------------------------------
# Flax NNX
# --------------------------------------------------------------------------------------------


class MultiHeadAttention(nnx.Module):
    """Multi-head attention (NNX) with jax_fa3 inside; the layout of ``nnx.MultiHeadAttention``.

    Parameters live in ``query``, ``key``, ``value`` (``nnx.LinearGeneral`` to
    ``(heads, head_dim)``) and ``out`` (from ``(num_heads, head_dim)``), exactly as in
    ``flax.nnx.MultiHeadAttention``, so ``nnx.update(ours, nnx.state(theirs, nnx.Param))``
    ports weights either way (with ``normalize_qk=False`` there).

    Example::

        attn = MultiHeadAttention(8, 512, num_kv_heads=2, causal=True, rope=True,
                                  rngs=nnx.Rngs(0))
        y = attn(x)  # x: (batch, seqlen, 512)
    """

    def __init__(
        self,
        num_heads: int,
        in_features: int,
        qkv_features: int | None = None,
        out_features: int | None = None,
        num_kv_heads: int | None = None,
        in_kv_features: int | None = None,
        *,
        causal: bool = False,
        window_size: tuple[int, int] = (-1, -1),
        softcap: float = 0.0,
        softmax_scale: float | None = None,
        rope: bool = False,
        rope_base: float = 10000.0,
        use_sinks: bool = False,
        implementation: Implementation = None,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        precision: Any = None,
        kernel_init: Callable[..., jax.Array] = _default_kernel_init,
        out_kernel_init: Callable[..., jax.Array] | None = None,
        bias_init: Callable[..., jax.Array] = _zeros_init,
        out_bias_init: Callable[..., jax.Array] | None = None,
        use_bias: bool = True,
        rngs: nnx.Rngs,
    ) -> None:
        """Args mirror ``flax.nnx.MultiHeadAttention``; the attention options are:

        Args:
          causal: bottom-right aligned causal mask (identical to top-left for self-attention).
          window_size: ``(left, right)`` sliding window, ``-1`` = unbounded.
          softcap: tanh soft-capping of the logits, ``0`` = off.
          softmax_scale: defaults to ``1 / sqrt(head_dim)``, as in Flax.
          rope: rotate queries and keys by their positions (see ``__call__``).
          rope_base: RoPE base wavelength.
          use_sinks: learnable attention sinks (gpt-oss style): a ``sinks`` parameter, one
            float32 logit per query head, zero at creation, passed as
            :func:`jax_fa3.flash_attention`'s ``sinks``. ``None`` (no parameter) otherwise.
          implementation: ``None``, ``"cuda"`` or ``"xla"``, passed to
            :func:`jax_fa3.flash_attention`.
          precision: precision of the four projections (attention has a fixed one).
        """
        self.num_heads = num_heads
        self.in_features = in_features
        self.qkv_features = qkv_features if qkv_features is not None else in_features
        self.out_features = out_features if out_features is not None else in_features
        self.in_kv_features = in_kv_features if in_kv_features is not None else in_features
        self.num_kv_heads = num_kv_heads if num_kv_heads is not None else num_heads
        self.head_dim = _check_heads(self.num_heads, self.num_kv_heads, self.qkv_features)
        self.causal = causal
        self.window_size = tuple(window_size)
        self.softcap = softcap
        self.softmax_scale = softmax_scale
        self.rope = rope
        self.rope_base = rope_base
        self.implementation = implementation
        self.dtype = dtype

        def linear(in_features: Any, out_features: Any, **kw: Any) -> nnx.LinearGeneral:
            return nnx.LinearGeneral(
                in_features,
                out_features,
                use_bias=use_bias,
                dtype=dtype,
                param_dtype=param_dtype,
                precision=precision,
                rngs=rngs,
                **kw,
            )

        qkv_init = dict(kernel_init=kernel_init, bias_init=bias_init)
        # Same order as nnx.MultiHeadAttention so equal seeds give equal weights.
        self.query = linear(in_features, (num_heads, self.head_dim), **qkv_init)
        self.key = linear(self.in_kv_features, (self.num_kv_heads, self.head_dim), **qkv_init)
        self.value = linear(self.in_kv_features, (self.num_kv_heads, self.head_dim), **qkv_init)
        self.out = linear(
            (num_heads, self.head_dim),
            self.out_features,
            axis=(-2, -1),
            kernel_init=out_kernel_init or kernel_init,
            bias_init=out_bias_init or bias_init,
        )
        self.sinks = nnx.Param(initial_sinks(num_heads)) if use_sinks else None

    def __call__(
        self,
        inputs_q: jax.Array,
        inputs_k: jax.Array | None = None,
        inputs_v: jax.Array | None = None,
        *,
        positions: jax.Array | None = None,
        kv_positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        kv_segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        """Attends ``inputs_q`` (``[batch..., seqlen_q, in_features]``) to the keys/values.

        Self-attention when ``inputs_k``/``inputs_v`` are omitted (as in Flax). With ``rope``,
        ``positions`` (``[batch..., seqlen_q]`` or ``[seqlen_q]``) defaults to the last
        ``seqlen_q`` of ``0..seqlen_k-1``; ``kv_positions`` defaults to ``positions`` for
        self-attention and to ``0..seqlen_k-1`` otherwise.

        Packed sequences: ``segment_ids`` (``[batch..., seqlen_q]`` or ``[seqlen_q]``, int;
        0 = padding) lets a query see only keys of its own segment; ``kv_segment_ids`` (the
        keys', ``[batch..., seqlen_k]``) defaults to ``segment_ids``. Passed to
        :func:`jax_fa3.flash_attention` as ``q_segment_ids`` / ``kv_segment_ids``; padding
        rows give 0. With segment ids, integer ``positions`` / ``kv_positions`` (each
        token's position in its document, e.g. restarting at 0) also drive causal/window
        (``q_positions`` / ``kv_positions`` there), with or without RoPE. Without positions
        the mask follows the row index, which is the same for documents laid out
        contiguously; RoPE only sees position differences, so restarting positions change
        nothing inside a document.
        """
        inputs_k, inputs_v = self_attention_defaults(inputs_q, inputs_k, inputs_v)
        if inputs_q.shape[-1] != self.in_features:
            raise ValueError(
                f"inputs_q has {inputs_q.shape[-1]} features, the module expects {self.in_features}"
            )
        query, key, value = self.query(inputs_q), self.key(inputs_k), self.value(inputs_v)
        sinks = None if self.sinks is None else self.sinks[...]
        x = attend(query, key, value, positions=positions, kv_positions=kv_positions,
                   segment_ids=segment_ids, kv_segment_ids=kv_segment_ids, sinks=sinks,
                   **module_options(self))
        return self.out(x)


# --------------------------------------------------------------------------------------------
# Flax Linen
# --------------------------------------------------------------------------------------------


class LinenMultiHeadAttention(linen.Module):
    """Linen twin of :class:`MultiHeadAttention`; parameters as in ``linen.MultiHeadDotProductAttention``.

    The params tree is ``{"query", "key", "value", "out"}`` of ``DenseGeneral`` kernels/biases,
    so a ``MultiHeadDotProductAttention`` params dict loads as is (``num_kv_heads`` equal to
    ``num_heads``). ``key``/``value`` project to ``num_kv_heads`` heads for GQA. With
    ``use_sinks`` the tree also holds ``"sinks"``, ``(num_heads,)`` float32, zero at creation.
    """

    num_heads: int
    qkv_features: int | None = None
    out_features: int | None = None
    num_kv_heads: int | None = None
    causal: bool = False
    window_size: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    softmax_scale: float | None = None
    rope: bool = False
    rope_base: float = 10000.0
    use_sinks: bool = False
    implementation: Implementation = None
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    precision: Any = None
    kernel_init: Callable[..., jax.Array] = _default_kernel_init
    out_kernel_init: Callable[..., jax.Array] | None = None
    bias_init: Callable[..., jax.Array] = _zeros_init
    out_bias_init: Callable[..., jax.Array] | None = None
    use_bias: bool = True

    @linen.compact
    def __call__(
        self,
        inputs_q: jax.Array,
        inputs_k: jax.Array | None = None,
        inputs_v: jax.Array | None = None,
        *,
        positions: jax.Array | None = None,
        kv_positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        kv_segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        """Same arguments and defaults as :meth:`MultiHeadAttention.__call__` (segment ids
        included)."""
        inputs_k, inputs_v = self_attention_defaults(inputs_q, inputs_k, inputs_v)
        qkv_features = self.qkv_features or inputs_q.shape[-1]
        out_features = self.out_features or inputs_q.shape[-1]
        num_kv_heads = self.num_kv_heads or self.num_heads
        head_dim = _check_heads(self.num_heads, num_kv_heads, qkv_features)

        def dense(features: Sequence[int] | int, name: str, **kw: Any) -> linen.DenseGeneral:
            return linen.DenseGeneral(
                features=features,
                use_bias=self.use_bias,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                precision=self.precision,
                name=name,
                **kw,
            )

        init = dict(kernel_init=self.kernel_init, bias_init=self.bias_init)
        query = dense((self.num_heads, head_dim), "query", **init)(inputs_q)
        key = dense((num_kv_heads, head_dim), "key", **init)(inputs_k)
        value = dense((num_kv_heads, head_dim), "value", **init)(inputs_v)
        sinks = None
        if self.use_sinks:
            sinks = self.param("sinks", lambda _, n: initial_sinks(n), self.num_heads)
        x = attend(query, key, value, positions=positions, kv_positions=kv_positions,
                   segment_ids=segment_ids, kv_segment_ids=kv_segment_ids, sinks=sinks,
                   **module_options(self))
        return dense(
            out_features,
            "out",
            axis=(-2, -1),
            kernel_init=self.out_kernel_init or self.kernel_init,
            bias_init=self.out_bias_init or self.bias_init,
        )(x)
