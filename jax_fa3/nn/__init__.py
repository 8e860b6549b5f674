"""Neural-network building blocks on top of jax_fa3.

* :mod:`jax_fa3.nn.flax`: Flax NNX and Linen attention modules and an ``attention_fn``
  adapter for Flax's stock ``MultiHeadAttention`` (needs ``pip install 'jax-fa3[flax]'``).
* :mod:`jax_fa3.nn.equinox`: an Equinox attention module (needs ``'jax-fa3[equinox]'``).
* :mod:`jax_fa3.nn.rope`: rotary position embeddings in plain JAX.

The Flax and Equinox submodules load on first access, so ``import jax_fa3.nn`` never needs
either library.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from jax_fa3.nn import rope
from jax_fa3.nn.rope import apply_rope

__all__ = ["apply_rope", "equinox", "flax", "rope"]

_OPTIONAL = ("flax", "equinox")


def __getattr__(name: str) -> ModuleType:
    # Lazy: `jax_fa3.nn.flax` imports Flax only when someone asks for it.
    if name in _OPTIONAL:
        return importlib.import_module(f"jax_fa3.nn.{name}")
    raise AttributeError(f"module 'jax_fa3.nn' has no attribute {name!r}")
