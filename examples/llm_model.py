"""A small decoder-only language model in Flax NNX: RMSNorm, RoPE, SwiGLU and GQA attention.

The attention kernel is a plain function ``attend(q, k, v, segment_ids) -> out`` on
``(batch, seqlen, heads, head_dim)`` arrays (causal; ``segment_ids`` ``(batch, seqlen)`` or
None: packed documents, a token sees only its own document, 0 = padding), chosen by
:func:`make_attend`: ``jax_fa3.flash_attention`` for ``"fa3"``, ``jax.nn.dot_product_attention``
with cuDNN or XLA for comparison (packed documents as a dense mask). The parameters do not
depend on that choice, so runs are comparable step for step and checkpoints move between
them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

import jax_fa3
from jax_fa3.nn.rope import apply_rope

Attend = Callable[[jax.Array, jax.Array, jax.Array, jax.Array | None], jax.Array]
ATTENTION_CHOICES = ("fa3", "cudnn", "xla")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape of the model. ``dtype`` is the compute dtype; parameters are always float32."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    mlp_hidden: int
    dtype: str
    remat: bool = False
    rope_base: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def validate(self) -> None:
        """Raises ValueError naming the field that does not fit."""
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim = d_model / n_heads = {self.head_dim} must be even for RoPE")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")


def document_mask(segment_ids: jax.Array) -> jax.Array:
    """(batch, 1, seqlen, seqlen) bool for jax.nn.dot_product_attention: equal segment ids.
    Padding (id 0) sees padding, so that no row is fully masked (its output is never used:
    real tokens do not see padding, and the loss skips it)."""
    return (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]


def make_attend(name: str) -> Attend:
    """The causal attention function for ``--attention``: fa3, cudnn or xla."""
    if name == "fa3":
        return lambda q, k, v, segment_ids=None: jax_fa3.flash_attention(
            q, k, v, causal=True, q_segment_ids=segment_ids)
    if name in ("cudnn", "xla"):
        def attend(q, k, v, segment_ids=None):
            mask = None if segment_ids is None else document_mask(segment_ids)
            return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True,
                                                implementation=name)
        return attend
    raise ValueError(f"attention must be one of {ATTENTION_CHOICES}, got {name!r}")


def _normal(std: float) -> Callable[..., jax.Array]:
    return nnx.initializers.normal(stddev=std)


class RMSNorm(nnx.Module):
    """x / rms(x) * scale, computed in float32 whatever the compute dtype."""

    def __init__(self, dim: int, *, eps: float = 1e-6):
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...]).astype(x.dtype)


class Attention(nnx.Module):
    """GQA self-attention with RoPE; projections laid out as in ``nnx.MultiHeadAttention``."""

    def __init__(self, cfg: ModelConfig, attend: Attend, *, rngs: nnx.Rngs):
        dtype, hd, std = jnp.dtype(cfg.dtype), cfg.head_dim, 0.02
        kw = dict(use_bias=False, dtype=dtype, rngs=rngs)
        self.query = nnx.LinearGeneral(cfg.d_model, (cfg.n_heads, hd), kernel_init=_normal(std), **kw)
        self.key = nnx.LinearGeneral(cfg.d_model, (cfg.n_kv_heads, hd), kernel_init=_normal(std), **kw)
        self.value = nnx.LinearGeneral(cfg.d_model, (cfg.n_kv_heads, hd), kernel_init=_normal(std), **kw)
        # Residual-branch outputs start smaller so the residual stream's scale does not grow
        # with depth (GPT-2's 1/sqrt(2 * n_layers)).
        out_std = std / math.sqrt(2 * cfg.n_layers)
        self.out = nnx.LinearGeneral((cfg.n_heads, hd), cfg.d_model, axis=(-2, -1),
                                     kernel_init=_normal(out_std), **kw)
        self.attend = attend
        self.rope_base = cfg.rope_base

    def __call__(self, x: jax.Array, positions: jax.Array,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        q = apply_rope(self.query(x), positions, base=self.rope_base)
        k = apply_rope(self.key(x), positions, base=self.rope_base)
        return self.out(self.attend(q, k, self.value(x), segment_ids))


class SwiGLU(nnx.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        kw = dict(use_bias=False, dtype=jnp.dtype(cfg.dtype), rngs=rngs)
        self.gate = nnx.Linear(cfg.d_model, cfg.mlp_hidden, kernel_init=_normal(0.02), **kw)
        self.up = nnx.Linear(cfg.d_model, cfg.mlp_hidden, kernel_init=_normal(0.02), **kw)
        self.down = nnx.Linear(cfg.mlp_hidden, cfg.d_model,
                               kernel_init=_normal(0.02 / math.sqrt(2 * cfg.n_layers)), **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: ModelConfig, attend: Attend, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.d_model)
        self.attn = Attention(cfg, attend, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model)
        self.mlp = SwiGLU(cfg, rngs=rngs)

    def __call__(self, x: jax.Array, positions: jax.Array,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        x = x + self.attn(self.attn_norm(x), positions, segment_ids)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nnx.Module):
    """Token ids ``(batch, seqlen)`` -> float32 logits ``(batch, seqlen, vocab_size)``.

    Packed rows: ``segment_ids`` ``(batch, seqlen)`` (documents 1, 2, ..., 0 = padding) keep
    attention inside each document, and ``positions`` (RoPE; default ``0..seqlen-1``) may
    restart at each document."""

    def __init__(self, cfg: ModelConfig, attend: Attend, *, rngs: nnx.Rngs):
        cfg.validate()
        dtype = jnp.dtype(cfg.dtype)
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=dtype,
                               embedding_init=_normal(0.02), rngs=rngs)
        self.blocks = nnx.List([Block(cfg, attend, rngs=rngs) for _ in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.d_model)
        self.lm_head = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False, dtype=dtype,
                                  kernel_init=_normal(0.02), rngs=rngs)
        self.remat = cfg.remat

    def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None) -> jax.Array:
        if positions is None:
            positions = jnp.arange(tokens.shape[-1], dtype=jnp.int32)
        x = self.embed(tokens)
        for block in self.blocks:
            if self.remat:  # recompute the block in the backward pass instead of storing it
                x = nnx.remat(lambda b, x: b(x, positions, segment_ids))(block, x)
            else:
                x = block(x, positions, segment_ids)
        return self.lm_head(self.norm(x)).astype(jnp.float32)


def count_params(state: nnx.State) -> tuple[int, int]:
    """(all parameters, parameters that take part in matmuls: all but the embedding table and
    the norm scales), for the FLOP count."""
    total = matmul = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        total += leaf.size
        if leaf.ndim >= 2 and "embed" not in jax.tree_util.keystr(path):
            matmul += leaf.size
    return total, matmul


def train_flops_per_token(cfg: ModelConfig, matmul_params: int, seq_len: int,
                          mean_keys: float | None = None) -> float:
    """Model FLOPs per trained token: 6 * matmul params (forward 2, backward 4) plus causal
    attention, 3x its forward 4 * heads * head_dim * (mean keys seen: (seq_len + 1) / 2 for a
    whole row, `mean_keys` for packed documents) per layer. Recomputation (remat, flash
    attention's backward) is not model work."""
    keys = (seq_len + 1) / 2 if mean_keys is None else mean_keys
    attention = 3 * 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim * keys
    return 6.0 * matmul_params + attention
