"""Pytest setup: the `gpu` and `multigpu` markers skip with the reason the kernels cannot run.

x64 stays off globally: the float64 oracle in tests/helpers.py is numpy. Tests that need JAX
float64 (the JAX reference in float64) use the `x64` fixture, which enables it only for them.
"""

from __future__ import annotations

import os
import sys

import jax
import pytest

# Eight CPU devices for the sharding and ring tests (simulated meshes), set before JAX starts a
# backend; GPUs are unaffected.
jax.config.update("jax_num_cpu_devices", 8)

# `import helpers` from any test module, wherever pytest is started.
sys.path.insert(0, os.path.dirname(__file__))


def _gpu_reason() -> str | None:
    """Why no kernel can run here. Not one head dim's kernel: a build narrowed to other head
    dims (FA3_HEAD_DIMS) still runs its tests, and each test skips the dims not compiled."""
    from jax_fa3 import _ffi
    return _ffi.extension_reason()


def _multigpu_reason() -> str | None:
    reason = _gpu_reason()
    if reason is not None:
        return reason
    n = len(jax.devices())
    return None if n >= 2 else f"needs 2 or more GPUs, found {n}"


def _keep_shard(config, items):
    """FA3_TEST_SHARD="k/n" keeps every n-th collected test starting at k (0-based), so n pytest
    processes can share one GPU (scripts/gpu_cycle.sh TEST_SHARDS); the rest are deselected."""
    spec = os.environ.get("FA3_TEST_SHARD")
    if not spec:
        return
    k, n = (int(x) for x in spec.split("/"))
    if not 0 <= k < n:
        raise ValueError(f"FA3_TEST_SHARD={spec!r}: expected k/n with 0 <= k < n")
    kept = [item for i, item in enumerate(items) if i % n == k]
    config.hook.pytest_deselected(items=[item for i, item in enumerate(items) if i % n != k])
    items[:] = kept


def pytest_collection_finish(session):
    """FA3_TEST_SHARD_LIST=path: the shard's selected tests, one node id a line, so that
    scripts/gpu_cycle.sh can name the tests a shard cut at its time limit never reached."""
    path = os.environ.get("FA3_TEST_SHARD_LIST")
    if path:
        with open(path, "w") as f:
            f.writelines(f"{item.nodeid}\n" for item in session.items)


def pytest_runtest_logreport(report):
    """In a sharded device run (FA3_TEST_SHARD), print a failure's report the moment it happens:
    scripts/gpu_cycle.sh cuts a shard at its time limit, and a cut pytest prints no summary (the
    first FP8 kernel run lost every failure message that way)."""
    if report.failed and os.environ.get("FA3_TEST_SHARD"):
        text = f"\n==== FAILED {report.nodeid} ({report.when})\n{report.longreprtext}\n"
        os.write(2, text.encode(errors="replace"))  # below pytest's capture


def pytest_collection_modifyitems(config, items):
    _keep_shard(config, items)
    reasons = {}
    for item in items:
        for marker, check in (("multigpu", _multigpu_reason), ("gpu", _gpu_reason)):
            if item.get_closest_marker(marker) is None:
                continue
            if marker not in reasons:
                reasons[marker] = check()
            if reasons[marker] is not None:
                item.add_marker(pytest.mark.skip(reason=f"{marker}: {reasons[marker]}"))
                break


@pytest.fixture
def x64():
    """Enable float64 in JAX for one test only."""
    enable = getattr(jax, "enable_x64", None)
    if enable is None:  # older JAX spells it jax.experimental.enable_x64
        from jax.experimental import enable_x64 as enable
    with enable(True):
        yield
