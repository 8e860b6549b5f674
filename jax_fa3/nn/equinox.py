"""Equinox multi-head attention whose attention runs on jax_fa3.

Equinox style: the module takes one unbatched sequence, ``(seqlen, features)``, and batches
with ``jax.vmap``. Inside, the sequence gets a batch axis of one and goes to
:func:`jax_fa3.flash_attention`; under ``jax.vmap`` that call is batched by jax_fa3's own
batching rule into one kernel launch over the whole batch, not a loop.

Equinox is an optional dependency: ``pip install 'jax-fa3[equinox]'``.
"""

from __future__ import annotations

from typing import Any, Literal

try:
    import equinox as eqx
except ImportError as err:  # pragma: no cover - exercised by a monkeypatched test
    raise ImportError(
        "jax_fa3.nn.equinox needs Equinox, which is not installed. "
        "Install the extra with: pip install 'jax-fa3[equinox]'"
    ) from err

import jax

from jax_fa3.nn._core import attend, initial_sinks, module_options

__all__ = ["MultiheadAttention"]


class MultiheadAttention(eqx.Module):
    """Multi-head attention with GQA, causal/window/softcap options and optional RoPE.

    The projections are named and shaped as in ``eqx.nn.MultiheadAttention``
    (``query_proj``, ``key_proj``, ``value_proj``, ``output_proj``, heads laid out
    head-major in the projected features), so weights move over with ``eqx.tree_at``. With
    ``num_kv_heads < num_heads`` the key/value projections are narrower (GQA); ``vo_size``
    may differ from ``qk_size`` (each head's values and outputs, MLA-style 192/128, say).
    ``use_sinks`` adds learnable attention sinks, ``sinks`` ``(num_heads,)`` float32, zero at
    creation (``None`` without). No dropout.

    Example::

        attn = MultiheadAttention(8, 512, num_kv_heads=2, causal=True, rope=True,
                                  key=jax.random.key(0))
        y = jax.vmap(attn)(x)  # x: (batch, seqlen, 512)
    """

    query_proj: eqx.nn.Linear
    key_proj: eqx.nn.Linear
    value_proj: eqx.nn.Linear
    output_proj: eqx.nn.Linear
    sinks: jax.Array | None

    num_heads: int = eqx.field(static=True)
    num_kv_heads: int = eqx.field(static=True)
    causal: bool = eqx.field(static=True)
    window_size: tuple[int, int] = eqx.field(static=True)
    softcap: float = eqx.field(static=True)
    softmax_scale: float | None = eqx.field(static=True)
    rope: bool = eqx.field(static=True)
    rope_base: float = eqx.field(static=True)
    implementation: Literal["cuda", "xla"] | None = eqx.field(static=True)

    def __init__(
        self,
        num_heads: int,
        query_size: int,
        key_size: int | None = None,
        value_size: int | None = None,
        output_size: int | None = None,
        qk_size: int | None = None,
        vo_size: int | None = None,
        num_kv_heads: int | None = None,
        use_query_bias: bool = False,
        use_key_bias: bool = False,
        use_value_bias: bool = False,
        use_output_bias: bool = False,
        *,
        causal: bool = False,
        window_size: tuple[int, int] = (-1, -1),
        softcap: float = 0.0,
        softmax_scale: float | None = None,
        rope: bool = False,
        rope_base: float = 10000.0,
        use_sinks: bool = False,
        implementation: Literal["cuda", "xla"] | None = None,
        dtype: Any = None,
        key: jax.Array,
    ) -> None:
        """Sizes and biases as in ``eqx.nn.MultiheadAttention``; ``num_kv_heads`` for GQA.

        Args:
          causal: bottom-right aligned causal mask (top-left equal for self-attention).
          window_size: ``(left, right)`` sliding window, ``-1`` = unbounded.
          softcap: tanh soft-capping of the logits, ``0`` = off.
          softmax_scale: defaults to ``1 / sqrt(qk_size)``.
          rope: rotate queries and keys by their positions (see ``__call__``).
          use_sinks: learnable attention sinks (gpt-oss style): ``sinks``, one float32 logit
            per query head, zero at creation, passed as :func:`jax_fa3.flash_attention`'s
            ``sinks``.
          implementation: ``None``, ``"cuda"`` or ``"xla"`` (see :func:`jax_fa3.flash_attention`).
          key: PRNG key for the initial weights.
        """
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        key_size = query_size if key_size is None else key_size
        value_size = query_size if value_size is None else value_size
        output_size = query_size if output_size is None else output_size
        qk_size = query_size // num_heads if qk_size is None else qk_size
        vo_size = query_size // num_heads if vo_size is None else vo_size
        qkey, kkey, vkey, okey = jax.random.split(key, 4)

        def linear(n_in: int, n_out: int, bias: bool, k: jax.Array) -> eqx.nn.Linear:
            return eqx.nn.Linear(n_in, n_out, use_bias=bias, dtype=dtype, key=k)

        self.query_proj = linear(query_size, num_heads * qk_size, use_query_bias, qkey)
        self.key_proj = linear(key_size, num_kv_heads * qk_size, use_key_bias, kkey)
        self.value_proj = linear(value_size, num_kv_heads * vo_size, use_value_bias, vkey)
        self.output_proj = linear(num_heads * vo_size, output_size, use_output_bias, okey)
        self.sinks = initial_sinks(num_heads) if use_sinks else None
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.causal = causal
        self.window_size = tuple(window_size)
        self.softcap = softcap
        self.softmax_scale = softmax_scale
        self.rope = rope
        self.rope_base = rope_base
        self.implementation = implementation

    def __call__(
        self,
        query: jax.Array,
        key_: jax.Array | None = None,
        value: jax.Array | None = None,
        *,
        positions: jax.Array | None = None,
        kv_positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        kv_segment_ids: jax.Array | None = None,
        key: jax.Array | None = None,
    ) -> jax.Array:
        """Attends ``query`` ``(seqlen_q, query_size)`` to ``key_``/``value`` ``(seqlen_k, ...)``.

        Self-attention when ``key_``/``value`` are omitted. With ``rope``, ``positions``
        ``(seqlen_q,)`` defaults to the last ``seqlen_q`` of ``0..seqlen_k-1`` and
        ``kv_positions`` to ``positions`` (self-attention) or ``0..seqlen_k-1``. ``key`` (a PRNG
        key, in Equinox's calling convention) is unused: there is no dropout.

        Packed sequences: ``segment_ids`` ``(seqlen_q,)`` (int, 0 = padding) and
        ``kv_segment_ids`` ``(seqlen_k,)`` (default ``segment_ids``), batched by ``jax.vmap``
        with the sequence; a query sees only keys of its own segment. With segment ids,
        integer ``positions`` / ``kv_positions`` also drive causal/window (see
        :meth:`jax_fa3.nn.flax.MultiHeadAttention.__call__`).
        """
        del key
        if query.ndim != 2:
            raise ValueError(
                f"query must be unbatched (seqlen, features), got shape {query.shape}; "
                "use jax.vmap over the batch"
            )
        key_ = query if key_ is None else key_
        value = key_ if value is None else value
        if key_.shape[0] != value.shape[0]:
            raise ValueError(f"key_ and value need equal lengths, got {key_.shape} and {value.shape}")

        def heads(proj: eqx.nn.Linear, x: jax.Array, n: int) -> jax.Array:
            return jax.vmap(proj)(x).reshape(x.shape[0], n, -1)

        q = heads(self.query_proj, query, self.num_heads)
        k = heads(self.key_proj, key_, self.num_kv_heads)
        v = heads(self.value_proj, value, self.num_kv_heads)
        out = attend(q[None], k[None], v[None], positions=positions, kv_positions=kv_positions,
                     segment_ids=segment_ids, kv_segment_ids=kv_segment_ids, sinks=self.sinks,
                     **module_options(self))[0]
        return jax.vmap(self.output_proj)(out.reshape(out.shape[0], -1))
