"""Registration of the Hopper kernels' FFI targets, and whether they can run here.

The compiled module `jax_fa3._fa3_cuda` exists only when the package was built with a CUDA
toolkit; without it everything runs on the portable path and `unavailable_reason` says why.
Targets are registered once, at import.
"""

from __future__ import annotations

import functools

import jax

try:
    import jax_fa3._fa3_cuda as _fa3_cuda
except ImportError as _err:  # built without CUDA, or the import failed
    _fa3_cuda = None
    _IMPORT_ERROR: str | None = f"{type(_err).__name__}: {_err}"
else:
    _IMPORT_ERROR = None
    for _name, _capsule in _fa3_cuda.registrations().items():
        jax.ffi.register_ffi_target(_name, _capsule, platform="CUDA")

FWD_TARGET = "jax_fa3_fwd"
FWD_FP8_TARGET = "jax_fa3_fwd_fp8"  # float8_e4m3fn q, k, v with descales; bfloat16 out
BWD_TARGET = "jax_fa3_bwd"


def is_built() -> bool:
    """True when the CUDA extension was compiled and imported."""
    return _fa3_cuda is not None


def build_info() -> dict | None:
    """What the extension holds: compiled `(dtype, head_dim)` per direction, CUDA and CUTLASS
    versions, arch. None when it was not built."""
    if _fa3_cuda is None:
        return None
    info = dict(_fa3_cuda.build_info())
    info["fwd"] = [tuple(c) for c in info["fwd"]]
    info["bwd"] = [tuple(c) for c in info["bwd"]]
    return info


def fwd_key_block(dtype, head_dim: int, head_dim_v: int, seqlen_q: int, seqlen_k: int, left: int,
                  right: int) -> int | None:
    """Keys per block of the forward tile the launcher picks for this problem (no documents;
    `left` / `right`: the band as `_masks.band` normalises it, clamped by the extension); None
    without a build or a kernel. The FP8 numerics depend on it (P is rounded against each
    block's running max), so the FP8 oracle takes its blocks from here."""
    if _fa3_cuda is None:
        return None
    n = _fa3_cuda.fwd_key_block(jax.numpy.dtype(dtype).name, head_dim, head_dim_v, seqlen_q, seqlen_k,
                                int(left), int(right))
    return n or None


@functools.lru_cache(maxsize=None)
def _compiled(direction: str) -> tuple:
    """The (dtype name, head_dim) pairs compiled for `direction` (fixed for the process)."""
    return tuple(build_info()[direction])


@functools.lru_cache(maxsize=None)
def _device_reason() -> str | None:
    """Why the default device cannot run sm_90a kernels, or None if it can."""
    if jax.default_backend() != "gpu":
        return f"no Hopper GPU: the default JAX backend is {jax.default_backend()!r}"
    device = jax.devices()[0]
    if getattr(device, "platform", "") != "gpu" or "NVIDIA" not in getattr(device, "device_kind", "NVIDIA"):
        return f"no Hopper GPU: device {device} is not an NVIDIA GPU"
    cc = getattr(device, "compute_capability", None)
    if cc is not None and str(cc) != "9.0":
        return (f"no Hopper GPU: device {device.device_kind} has compute capability {cc}; the "
                f"kernels need 9.0")
    return None


def extension_reason() -> str | None:
    """None when the extension is built and the default device runs sm_90a kernels (whichever
    head dims were compiled); otherwise why not: the missing GPU first, then the missing build."""
    build = None if _fa3_cuda is not None else (
        f"the jax_fa3 CUDA extension is not built ({_IMPORT_ERROR})")
    return "; ".join(r for r in (_device_reason(), build) if r) or None


def kernel_head_dim(direction: str, dtype, head_dim: int, head_dim_v: int | None = None) -> int | None:
    """The compiled head dim a `direction` call with these head dims runs on: the smallest one
    of this dtype that holds both q/k's `head_dim` and v's `head_dim_v` (the kernels' loads
    zero-fill the columns past them and their stores clip). None when no compiled one does (or
    there is no build)."""
    if _fa3_cuda is None:
        return None
    need = max(int(head_dim), int(head_dim if head_dim_v is None else head_dim_v))
    name = jax.numpy.dtype(dtype).name
    fits = [d for n, d in _compiled(direction) if n == name and d >= need]
    return min(fits) if fits else None


def compiled_reason(direction: str, dtype, head_dim: int, head_dim_v: int | None = None) -> str | None:
    """None when the build holds a `direction` kernel for this dtype that holds these head
    dims (or there is no build: `extension_reason` says so); otherwise a sentence saying what
    it holds."""
    if _fa3_cuda is None or kernel_head_dim(direction, dtype, head_dim, head_dim_v) is not None:
        return None
    name = jax.numpy.dtype(dtype).name
    dims = f"head_dim {head_dim}" if head_dim_v in (None, head_dim) else \
        f"head dims {head_dim} (q, k) and {head_dim_v} (v)"
    return (f"no {direction} kernel compiled for dtype {name} and {dims} (compiled: "
            f"{list(_compiled(direction)) or 'none'}; a call runs on the smallest compiled "
            f"head dim that holds its own)")


def unavailable_reason(direction: str, dtype, head_dim: int, head_dim_v: int | None = None) -> str | None:
    """None when the kernel for `direction` ('fwd' or 'bwd') can run this dtype and head dims
    on the default device; otherwise a sentence saying why not (the machine first)."""
    return extension_reason() or compiled_reason(direction, dtype, head_dim, head_dim_v)
