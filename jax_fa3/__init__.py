"""jax-fa3: FlashAttention-3 for JAX on Hopper, with a portable pure-JAX path.

    from jax_fa3 import flash_attention, dot_product_attention
    out = flash_attention(q, k, v, causal=True)          # (batch, seqlen, heads, head_dim)
    out = flash_attention(q, k, v, causal=True, q_segment_ids=ids)   # packed documents
    out = flash_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k)  # (tokens, heads, dim)
    out = flash_attention_fp8(q, k, v, granularity="block", incoherent=True)  # FP8 forward

`build_info()` says what the CUDA extension holds (None when it is not built);
`unavailable_reason(direction, dtype, head_dim, head_dim_v=None)` says why a kernel cannot run
here (the missing Hopper GPU or build first). docs/architecture.md describes the layers.
"""

from jax_fa3._ffi import build_info, is_built
from jax_fa3.attention import (flash_attention, flash_attention_varlen, kernel_available,
                               unavailable_reason)
from jax_fa3.compat import dot_product_attention
from jax_fa3.fp8 import dequantize_fp8, flash_attention_fp8, hadamard_rotate, quantize_fp8

__all__ = [
    "flash_attention",
    "flash_attention_varlen",
    "dot_product_attention",
    "flash_attention_fp8",
    "quantize_fp8",
    "dequantize_fp8",
    "hadamard_rotate",
    "build_info",
    "is_built",
    "kernel_available",
    "unavailable_reason",
]
