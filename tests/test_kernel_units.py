"""Host unit tests of the kernels' index logic (tests/kernels/*.cu): masks and block ranges,
CTA orders and the tail split, register/shared-memory layouts. Each file includes the kernel
headers, checks their host-callable logic against brute force on random shapes, and exits 0
when every check passes. They need nvcc and the CuTe headers (the `nvidia-cutlass` wheel of the
test extra), not a GPU."""

from __future__ import annotations

import concurrent.futures
import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "tests" / "kernels").glob("*.cu"))


def _cutlass_include() -> str | None:
    if os.environ.get("CUTLASS_DIR"):
        return os.environ["CUTLASS_DIR"]
    spec = importlib.util.find_spec("cutlass_library")  # finds the headers without importing
    if spec is None:
        return None
    inc = Path(spec.submodule_search_locations[0]) / "source" / "include"
    return str(inc) if (inc / "cute" / "tensor.hpp").exists() else None


NVCC = shutil.which("nvcc")
CUTLASS = _cutlass_include()
needs_tools = pytest.mark.skipif(
    NVCC is None or CUTLASS is None,
    reason="the kernels' host unit tests need nvcc and the CuTe headers (pip install nvidia-cutlass)")


def test_sources_found():
    assert len(SOURCES) >= 5, f"tests/kernels/*.cu: found {[s.name for s in SOURCES]}"


def _compile(source: Path, out_dir: Path) -> tuple[Path, subprocess.CompletedProcess]:
    exe = out_dir / source.stem
    return exe, subprocess.run(
        [NVCC, "-std=c++17", "-O1", "--expt-relaxed-constexpr", "-gencode=arch=compute_90a,code=sm_90a",
         f"-I{ROOT / 'cpp' / 'include'}", f"-I{ROOT / 'cpp' / 'kernels'}", "-isystem", CUTLASS,
         str(source), "-o", str(exe)],
        capture_output=True, text=True)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Every unit test compiled at once, one nvcc per core (each takes about a minute)."""
    out_dir = tmp_path_factory.mktemp("kernel_units")
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return dict(zip(SOURCES, pool.map(lambda s: _compile(s, out_dir), SOURCES)))


@needs_tools
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_kernel_unit(source, built):
    exe, build = built[source]
    assert build.returncode == 0, f"{source.name} does not compile:\n{build.stderr[-4000:]}"
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"{source.name} failed:\n{run.stdout[-4000:]}\n{run.stderr[-2000:]}"
