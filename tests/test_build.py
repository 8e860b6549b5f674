"""The compiled extension: what build_info() and registrations() report. Skips (with the
import error) where the package was installed without CUDA; the availability logic itself is
checked everywhere."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jax_fa3 import _ffi

built = pytest.mark.skipif(not _ffi.is_built(),
                           reason=f"CUDA extension not built: {_ffi._IMPORT_ERROR}")


def test_build_info_and_reasons_agree_with_the_build():
    """Built: build_info() describes it and a reason never says "not built"; not built:
    build_info() is None and every reason says so. The missing GPU, where it is missing, comes
    first either way (issue 30)."""
    for direction in ("fwd", "bwd"):
        reason = _ffi.unavailable_reason(direction, jnp.bfloat16, 128)
        if _ffi.is_built():
            assert _ffi.build_info() is not None
            assert reason is None or "not built" not in reason
        else:
            assert _ffi.build_info() is None
            assert reason is not None and "not built" in reason
        if jax.default_backend() != "gpu":
            assert reason.startswith("no Hopper GPU")


@built
def test_build_info_lists_sane_instantiations():
    info = _ffi.build_info()
    assert info["arch"] == "sm_90a"
    assert info["fwd"], "no forward kernel compiled"
    for direction in ("fwd", "bwd"):
        entries = info[direction]
        assert len(set(entries)) == len(entries), f"duplicate {direction} entries: {entries}"
        for dtype, head_dim in entries:
            assert dtype in ("bfloat16", "float16", "float8_e4m3fn")
            assert head_dim in (64, 96, 128, 192, 256)
            if dtype == "float8_e4m3fn":  # FP8: forward only, at 64, 128, 256
                assert direction == "fwd" and head_dim in (64, 128, 256), (direction, head_dim)
    for key in ("cuda_version", "cutlass_version"):
        assert str(info[key]).strip(), f"{key} is empty"


@built
def test_build_info_key_blocks_cover_the_forward_kernels():
    """One (dtype, head_dim, full, banded) entry per compiled forward kernel, with key blocks a
    WGMMA takes (multiples of 16 up to 256; FP8's P V steps K by 32), as fwd_table_key_block
    reports them."""
    info = _ffi.build_info()
    assert [(n, d) for n, d, _, _ in info["fwd_key_blocks"]] == info["fwd"]
    for name, head_dim, full, banded in info["fwd_key_blocks"]:
        for n in (full, banded):
            assert 16 <= n <= 256 and n % (32 if name == "float8_e4m3fn" else 16) == 0, (name, head_dim, n)
        assert _ffi.fwd_table_key_block(name, head_dim, banded=False) == full
        assert _ffi.fwd_table_key_block(name, head_dim, banded=True) == banded
    assert _ffi.fwd_table_key_block("bfloat16", 100, banded=False) is None  # no such kernel


@built
def test_registrations_hold_capsules():
    regs = _ffi._fa3_cuda.registrations()
    assert set(regs) >= {_ffi.FWD_TARGET, _ffi.BWD_TARGET} == {"jax_fa3_fwd", "jax_fa3_bwd"}
    assert _ffi.FWD_FP8_TARGET == "jax_fa3_fwd_fp8" in regs
    for name, capsule in regs.items():
        assert type(capsule).__name__ == "PyCapsule", f"{name}: {type(capsule)}"


@built
def test_compiled_reason_names_missing_instantiations():
    """Every head dim that is a multiple of 8 up to 256 (q/k's and v's apart) runs on the
    smallest compiled kernel head dim of its dtype that holds both; the reason names the
    head dims only where no compiled one does."""
    for direction in ("fwd", "bwd"):
        compiled = set(_ffi.build_info()[direction])
        for dtype in ("bfloat16", "float16"):
            dims = sorted(hd for name, hd in compiled if name == dtype)
            for head_dim, head_dim_v in [(d, d) for d in range(8, 257, 8)] + [
                    (192, 128), (64, 128), (128, 64), (256, 192), (40, 200)]:
                need = max(head_dim, head_dim_v)
                want = min((hd for hd in dims if hd >= need), default=None)
                got = _ffi.kernel_head_dim(direction, jnp.dtype(dtype), head_dim, head_dim_v)
                assert got == want, (direction, dtype, head_dim, head_dim_v, got, want)
                reason = _ffi.compiled_reason(direction, jnp.dtype(dtype), head_dim, head_dim_v)
                if want is not None:
                    assert reason is None
                else:
                    assert f"no {direction} kernel compiled" in reason and str(head_dim) in reason


def test_extension_present_when_expected():
    """CI builds the extension (.ci/run sets FA3_EXPECT_EXTENSION=1): a missing or shadowed
    module must fail there, not skip."""
    import os
    if os.environ.get("FA3_EXPECT_EXTENSION") != "1":
        pytest.skip("FA3_EXPECT_EXTENSION is not set: the extension is optional here")
    assert _ffi.is_built(), f"the CUDA extension was expected but did not import: {_ffi._IMPORT_ERROR}"


def test_fwd_table_key_block_reads_the_build(monkeypatch):
    """fwd_table_key_block looks the (dtype, head dim) up in build_info's fwd_key_blocks (here a
    stand-in extension, so it runs without a build), and is None without a build."""
    import jax.numpy as jnp

    class Extension:
        @staticmethod
        def build_info():
            return {"fwd": [("float8_e4m3fn", 128)], "bwd": [], "arch": "sm_90a",
                    "fwd_key_blocks": [("float8_e4m3fn", 128, 224, 128)]}

    monkeypatch.setattr(_ffi, "_fa3_cuda", Extension)
    assert _ffi.fwd_table_key_block(jnp.float8_e4m3fn, 128, banded=False) == 224
    assert _ffi.fwd_table_key_block("float8_e4m3fn", 128, banded=True) == 128
    assert _ffi.fwd_table_key_block(jnp.float8_e4m3fn, 256, banded=False) is None
    assert _ffi.fwd_table_key_block(jnp.bfloat16, 128, banded=False) is None
    monkeypatch.setattr(_ffi, "_fa3_cuda", None)
    assert _ffi.fwd_table_key_block(jnp.float8_e4m3fn, 128, banded=False) is None
