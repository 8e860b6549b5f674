"""The sanitizer gate's case list (scripts/sanitize_cases.py), on CPU.

The gate itself needs a Hopper GPU (scripts/sanitize.sh); what can rot unseen is the case list
and the case runner: here the list must keep every option the kernels branch on for every head
dim, the parts must split it without loss, and a case must run (on the portable path, which
stands in for the kernel) and fail on a non-finite result.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import sanitize_cases  # noqa: E402

import jax_fa3  # noqa: E402

HEAD_DIMS = (64, 96, 128, 192, 256)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_cases_cover_every_option(dtype, d):
    """cases_for(dtype, d) are the calls that run on the kernel of head dim d: head dims
    above the previous compiled one and up to d (q/k's or v's, whichever is larger), with
    every option the kernels branch on, head dims that the kernel clips, v's own head dim,
    and sinks."""
    cases = sanitize_cases.cases_for(dtype, d)
    below = max((x for x in HEAD_DIMS if x < d), default=0)
    assert all(c.dtype == dtype and below < max(c.d, c.head_dim_v) <= d for c in cases)
    assert any(c.d == d and c.head_dim_v == d for c in cases)  # the kernel's own head dim
    assert any(c.d < d for c in cases) and any(c.head_dim_v != c.d for c in cases)
    assert any(c.sinks for c in cases)
    if d == 192:
        assert any(c.d == 192 and c.head_dim_v == 128 for c in cases)  # MLA
    assert any(c.causal for c in cases) and any(c.window != (-1, -1) for c in cases)
    assert any(not c.causal and c.window == (-1, -1) for c in cases)  # the unmasked tile
    assert any(c.softcap for c in cases) and any(c.deterministic for c in cases)
    assert any(c.deterministic and c.causal for c in cases)
    assert any(c.hkv == 1 and c.hq > 1 for c in cases)  # MQA
    assert any(1 < c.hkv < c.hq for c in cases)  # GQA
    assert any(c.sq != c.sk for c in cases)
    assert any(c.sq % 64 and c.sk % 16 for c in cases)  # no multiple of any tile
    if d <= 128 and dtype == "bfloat16":  # a full wave of whole backward units, then split ones
        assert any(c.name == "tail-split" for c in cases)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_fp8_cases(d, portable):
    """Forward-only FP8 cases on the FP8 kernel's own head dim: both tiles, causal with rows
    that see no key, window + softcap, GQA and MQA, v's own head dim (a multiple of 16), more tiles
    than SMs; one runs."""
    cases = sanitize_cases.fp8_cases_for(d)
    assert all(c.dtype == "float8_e4m3fn" and c.d == d and c.head_dim_v % 16 == 0 for c in cases)
    assert any(not c.causal and c.window == (-1, -1) for c in cases)
    assert any(c.causal and c.sq > c.sk for c in cases) and any(c.window != (-1, -1) for c in cases)
    assert any(c.softcap for c in cases) and any(c.hkv == 1 < c.hq for c in cases)
    assert any(c.head_dim_v != c.d for c in cases)
    # CTAs that run several tiles: more 192-row tiles than an H200 has SMs, banded and not
    assert any(c.causal and c.b * c.hq * -(-c.sq // 192) > 132 for c in cases)
    assert any(not c.causal and c.b * c.hq * -(-c.sq // 192) > 132 for c in cases)
    if d == 64:
        assert sanitize_cases.run_case(sanitize_cases.Case("fp8", "float8_e4m3fn", 64, 1, 37, 50, 4, 2,
                                                           causal=True)) >= 0.0


def test_parts_split_the_set_without_loss():
    cases = [c for d in HEAD_DIMS for c in sanitize_cases.cases_for("bfloat16", d)]
    parts = [cases[i::3] for i in range(3)]
    assert sorted(map(repr, sum(parts, []))) == sorted(map(repr, cases))


@pytest.fixture
def portable(monkeypatch):
    real = jax_fa3.flash_attention
    monkeypatch.setattr(jax_fa3, "flash_attention",
                        lambda *a, **k: real(*a, **{**k, "implementation": "xla"}))


def test_a_case_runs(portable):
    case = sanitize_cases.Case("causal", "bfloat16", 64, 1, 37, 50, 4, 2, causal=True, softcap=5.0)
    assert sanitize_cases.run_case(case) >= 0.0


def test_a_non_finite_result_fails(monkeypatch):
    real = jax_fa3.flash_attention
    monkeypatch.setattr(jax_fa3, "flash_attention",
                        lambda *a, **k: real(*a, **{**k, "implementation": "xla"}) * jnp.nan)
    case = sanitize_cases.Case("full", "bfloat16", 64, 1, 9, 9, 2, 2)
    with pytest.raises(AssertionError, match="non-finite"):
        sanitize_cases.run_case(case)


def test_sets_by_build(monkeypatch):
    """The sets a build gives: every case of the (dtype, head dim)s compiled both ways plus the
    FP8 forward's (`all`), or the FP8 forward's alone (`fp8`, SANITIZE_SET=fp8)."""
    info = {"fwd": [("bfloat16", 128), ("float8_e4m3fn", 64), ("float8_e4m3fn", 128)],
            "bwd": [("bfloat16", 128)]}
    monkeypatch.setattr(sanitize_cases.jax_fa3, "build_info", lambda: info)
    fp8 = sanitize_cases.compiled_cases("fp8")
    assert fp8 == sanitize_cases.fp8_cases_for(64) + sanitize_cases.fp8_cases_for(128)
    every = sanitize_cases.compiled_cases("all")
    assert every == sanitize_cases.cases_for("bfloat16", 128) + fp8
