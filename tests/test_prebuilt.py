"""Prebuilt wheels (scripts/prebuild_wheel.sh): the fingerprint that ties a wheel to its sources,
and scripts/gpu_cycle.sh refusing a wheel built from other sources or with other defines."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FINGERPRINT = ROOT / "scripts" / "source_fingerprint.sh"
BUILD_INPUTS = ("cpp", "jax_fa3", "CMakeLists.txt", "pyproject.toml")

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("sha1sum") is None,
                                reason="needs bash and sha1sum")


def fingerprint(tree: Path) -> str:
    out = subprocess.run(["bash", str(FINGERPRINT), str(tree)], check=True, capture_output=True, text=True)
    return out.stdout.strip()


@pytest.fixture
def tree_copy(tmp_path):
    """The build's inputs copied into a tree of their own."""
    dst = tmp_path / "tree"
    dst.mkdir()
    for name in BUILD_INPUTS:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dst / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"))
        else:
            shutil.copy2(src, dst / name)
    return dst


def test_fingerprint_is_the_sources(tree_copy):
    base = fingerprint(tree_copy)
    assert len(base) == 40 and base == fingerprint(ROOT)
    # Bytecode caches are not sources.
    cache = tree_copy / "jax_fa3" / "__pycache__"
    cache.mkdir(exist_ok=True)
    (cache / "x.cpython-312.pyc").write_bytes(b"\0")
    assert fingerprint(tree_copy) == base
    # One byte of one kernel header is a different build.
    header = next((tree_copy / "cpp").rglob("*.cuh"))
    header.write_text(header.read_text() + " ")
    assert fingerprint(tree_copy) != base


def run_cycle(tmp_path, prebuilt: Path, defines: str = ""):
    env = dict(os.environ, WHEELS=str(tmp_path / "no-wheels"), PREBUILT=str(prebuilt), FA3_KERNEL_DEFINES=defines,
               INSTALL_TARGET=str(tmp_path / "target"), SKIP_SANITIZE="1", SKIP_TESTS="1", SKIP_BENCH="1")
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_cycle.sh"), str(tmp_path / "out")], env=env,
                          capture_output=True, text=True, timeout=120)


def fake_prebuilt(tmp_path, fp: str, defines: str) -> Path:
    d = tmp_path / "prebuilt"
    d.mkdir()
    (d / "source.txt").write_text(f"fingerprint {fp}\ndefines {defines}\nbuild dims=64 dtypes=bf16 dirs=fwd\n")
    return d


def test_cycle_refuses_a_wheel_of_other_sources(tmp_path):
    r = run_cycle(tmp_path, fake_prebuilt(tmp_path, "0" * 40, ""))
    assert r.returncode == 1
    assert "was built from other sources" in r.stdout
    assert not (tmp_path / "target").exists()


def test_cycle_refuses_a_wheel_of_other_defines(tmp_path):
    r = run_cycle(tmp_path, fake_prebuilt(tmp_path, fingerprint(ROOT), "FA3_X=1"), defines="")
    assert r.returncode == 1
    assert "has defines 'FA3_X=1', this call asks ''" in r.stdout
    assert not (tmp_path / "target").exists()


def test_cycle_refuses_a_folder_without_source_txt(tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    r = run_cycle(tmp_path, d)
    assert r.returncode == 1 and "no source.txt" in r.stdout
