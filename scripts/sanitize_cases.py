"""Small attention calls that launch every compiled jax_fa3 kernel, for compute-sanitizer.

    python3 -P scripts/sanitize_cases.py [--set all|issue24] [--part I/N] [--list]
    python3 -P scripts/sanitize_cases.py --coverage   # no sanitizer: which kernels ran

Each case runs forward and backward (`jax.value_and_grad` of `flash_attention(...,
implementation="cuda")` under `jax.jit`, with a random output cotangent) and checks that the
output and gradients are finite. The cases cover, for each compiled (dtype, head dim): the
unmasked and the banded forward tiles (causal, local window, the hd64 long-band tile, the hd128
short-band tile (the window and the deterministic causal case), the hd128 / hd256 narrow
tiles), softcap, GQA and MQA, seqlen_q != seqlen_k, lengths that are no multiple of any tile,
the deterministic backward, the backward tail split (d <= 128: every unmasked call with fewer
key blocks than SMs runs split, and one bf16 call per head dim has a full wave of whole
units before its split ones), the split-D backward (d = 256), head dims below the compiled one
(loads zero-filled past them, stores clipped), v's own head dim (MLA's 192/128 on the 192
kernel) and attention sinks (with their gradient). FP8 (float8_e4m3fn, forward only: its V
transpose ring and P operand) has forward-only cases per compiled FP8 head dim (`fp8_cases_for`).
`--coverage` runs them under the JAX profiler and fails unless every fa3 kernel in the extension
was launched at least once.

scripts/sanitize.sh runs this under memcheck, racecheck, initcheck and synccheck.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np

import jax_fa3
from jax_fa3 import _ffi


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    dtype: str
    d: int
    b: int
    sq: int
    sk: int
    hq: int
    hkv: int
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    deterministic: bool = False
    dv: int = 0  # v's head dim (0: d)
    sinks: bool = False
    docs: bool = False  # packed documents (segment ids with padding): the kernels' document bands

    @property
    def head_dim_v(self) -> int:
        return self.dv or self.d

    def label(self) -> str:
        opts = ["causal" if self.causal else "", f"window={self.window}" if self.window != (-1, -1) else "",
                f"softcap={self.softcap:g}" if self.softcap else "", "deterministic" if self.deterministic else "",
                f"dv={self.dv}" if self.dv else "", "sinks" if self.sinks else "", "docs" if self.docs else ""]
        return (f"{self.name} {self.dtype} d={self.d} b={self.b} sq={self.sq} sk={self.sk} "
                f"hq={self.hq} hkv={self.hkv} {' '.join(o for o in opts if o)}").rstrip()


def _tail_heads() -> int:
    """kv heads for which 2 key blocks per head leave a short last wave: the backward then runs
    its tail units split over several CTAs (cpp/kernels/bwd/bwd_order.cuh)."""
    sms = getattr(jax.devices()[0], "core_count", None) or 132
    return sms // 2 + 1


def cases_for(dtype: str, d: int) -> list[Case]:
    c = [
        Case("full", dtype, d, 2, 200, 513, 4, 2),                      # unmasked tile, GQA 2, sk ragged
        Case("full-narrow", dtype, d, 1, 130, 512, 2, 2),               # hd128/256: narrow unmasked tile
        Case("causal", dtype, d, 1, 777, 777, 4, 2, causal=True),       # banded tile, dynamic schedule
        Case("causal-sq<sk", dtype, d, 1, 129, 1000, 2, 2, causal=True),
        Case("window", dtype, d, 2, 300, 1100, 6, 3, window=(100, 20)),
        Case("softcap-mqa", dtype, d, 1, 513, 513, 4, 1, causal=True, softcap=30.0),
        Case("softcap-full", dtype, d, 1, 200, 200, 2, 2, softcap=5.0),
        Case("deterministic", dtype, d, 1, 300, 400, 4, 2, deterministic=True),
        Case("deterministic-causal", dtype, d, 1, 257, 257, 2, 1, causal=True, deterministic=True),
        Case("seqlen-1", dtype, d, 2, 1, 17, 2, 2),
    ]
    if d <= 128 and dtype == "bfloat16":  # a full wave of whole units, then split tail units
        hkv = _tail_heads()
        c.append(Case("tail-split", dtype, d, 1, 700, 256, hkv, hkv))
    if d == 64:  # the 192-row banded tile for long bands (FwdTileTable<64>::long_banded)
        c.append(Case("long-band", dtype, d, 1, 4100, 4100, 1, 1, causal=True))
    if d == 128:  # keys seen by 2100 rows: the backward's ping-pong tile (from 2048 rows,
        # bwd_traits.cuh BwdTileHd128PingPong), with and without softcap
        c.append(Case("long-band", dtype, d, 1, 2100, 2100, 2, 1, causal=True))
        c.append(Case("long-band-softcap", dtype, d, 1, 2100, 2100, 2, 1, causal=True, softcap=30.0))
        # unbanded, 2100 rows per key, 17 key blocks on more SMs: the 80-row ping-pong tile
        # with the tail split
        c.append(Case("long-rows", dtype, d, 1, 2100, 2100, 2, 1))
    # Head dims below d run on this kernel (the next compiled one is d's predecessor in
    # 64/96/128/192/256, which d - 8 exceeds): q/k/v narrower, then only v narrower.
    c.append(Case("head-dim-clipped", dtype, d - 8, 2, 200, 513, 4, 2, causal=True))
    c.append(Case("head-dim-clipped-full", dtype, d - 8, 1, 130, 300, 2, 2))
    c.append(Case("value-dim", dtype, d, 1, 300, 400, 4, 2, dv=d - 16, deterministic=True))
    c.append(Case("sinks-window", dtype, d, 2, 300, 700, 4, 2, window=(100, 0), sinks=True))
    c.append(Case("docs-causal", dtype, d, 2, 700, 700, 4, 2, causal=True, docs=True))
    c.append(Case("docs-softcap", dtype, d, 1, 513, 513, 4, 1, softcap=20.0, docs=True))
    if d == 192:  # MLA: q/k 192, v 128
        c.append(Case("mla", dtype, d, 1, 257, 513, 4, 1, causal=True, dv=128, sinks=True))
    return c


ISSUE24 = [  # the shapes of issue 24's racecheck report (bf16)
    Case("issue24", "bfloat16", 128, 1, 777, 777, 4, 2, causal=True),
    Case("issue24", "bfloat16", 64, 2, 300, 1100, 6, 3, window=(100, 20)),
    Case("issue24", "bfloat16", 256, 1, 513, 513, 2, 1, causal=True, softcap=30.0),
    Case("issue24", "bfloat16", 128, 1, 129, 4000, 2, 2, causal=True),
    Case("issue24", "bfloat16", 64, 1, 200, 200, 2, 2, softcap=5.0),
]


FP8 = "float8_e4m3fn"


def fp8_cases_for(d: int) -> list[Case]:
    """Forward-only FP8 calls on the FP8 kernel of head dim d (64, 128, 256): both tiles, the
    options the FP8 forward branches on, ragged lengths, rows without keys."""
    c = [
        Case("fp8-full", FP8, d, 2, 200, 513, 4, 2),
        Case("fp8-full-512", FP8, d, 1, 130, 512, 2, 2),  # a table's narrow unbanded tile, where it has one
        Case("fp8-causal", FP8, d, 1, 777, 777, 4, 2, causal=True),
        Case("fp8-causal-sq>sk", FP8, d, 1, 300, 129, 2, 1, causal=True),  # rows without keys
        Case("fp8-window-softcap", FP8, d, 2, 300, 700, 6, 3, window=(100, 20), softcap=5.0),
        Case("fp8-seqlen-1", FP8, d, 2, 1, 17, 2, 2),
        Case("fp8-value-dim", FP8, d, 1, 130, 300, 2, 1, dv=d // 2),
        # more tiles than SMs: CTAs run several (the dynamic schedule, the V transposers across tiles)
        Case("fp8-causal-many-tiles", FP8, d, 2, 300, 300, 36, 12, causal=True),
        Case("fp8-full-many-tiles", FP8, d, 2, 400, 1100, 36, 12),  # past hd128's narrow tile (1k keys)
    ]
    if d in (64, 128):  # the tile for long bands (FwdTileTable<Fp8, d>::long_banded)
        c.append(Case("fp8-long-band", FP8, d, 1, 4100, 4100, 1, 1, causal=True))
    if d == 128:
        # the banded kernel running unbanded problems up to 1k keys (narrow), more tiles than SMs
        c.append(Case("fp8-narrow-many-tiles", FP8, d, 2, 400, 700, 36, 12))
    return c


def compiled_cases(which: str) -> list[Case]:
    info = jax_fa3.build_info()
    if info is None:
        raise SystemExit("sanitize_cases: the jax_fa3 CUDA extension is not built")
    both = sorted(set(info["fwd"]) & set(info["bwd"]))
    if which == "issue24":
        return [c for c in ISSUE24 if (c.dtype, c.d) in both]
    fp8 = [c for d in sorted(d for dt, d in info["fwd"] if dt == FP8) for c in fp8_cases_for(d)]
    if which == "fp8":  # the FP8 forward alone (a change that touches only its kernels or tiles)
        return fp8
    return [c for dt, d in both for c in cases_for(dt, d)] + fp8


def run_case(c: Case) -> float:
    """Forward + backward of one case; returns the seconds it took (compile included). The
    inputs depend on the case alone (not on which process runs it), so that every run of a case
    compiles the same program: scripts/sanitize.sh compiles each once, into JAX's persistent
    cache, before the sanitizer runs."""
    if c.dtype == FP8:
        return run_fp8_case(c)
    rng = np.random.default_rng(zlib.crc32(c.label().encode()))
    dt = jnp.dtype(c.dtype)
    shape_q, shape_k = (c.b, c.sq, c.hq, c.d), (c.b, c.sk, c.hkv, c.d)
    shape_v, shape_o = (c.b, c.sk, c.hkv, c.head_dim_v), (c.b, c.sq, c.hq, c.head_dim_v)
    # Host-made inputs: a host-to-device copy initialises them in initcheck's eyes.
    q, k, v = (jax.device_put(rng.standard_normal(s).astype(dt)) for s in (shape_q, shape_k, shape_v))
    w = jax.device_put(rng.standard_normal(shape_o).astype(np.float32))
    sinks = jax.device_put(rng.standard_normal(c.hq).astype(np.float32)) if c.sinks else None
    # Documents of random lengths (some shorter than a tile, one token long) and trailing padding.
    seg = None
    if c.docs:
        lengths = rng.integers(1, 200, size=(c.b, c.sq))
        ends = np.cumsum(lengths, axis=1)
        seg = np.stack([np.searchsorted(e, np.arange(c.sq), side="right") + 1 for e in ends])
        seg[:, c.sq - c.sq // 8:] = 0  # padding
        seg = jax.device_put(seg.astype(np.int32))

    def loss(q, k, v, sinks, w):
        out = jax_fa3.flash_attention(q, k, v, causal=c.causal, window_size=c.window, softcap=c.softcap,
                                      deterministic=c.deterministic, sinks=sinks, implementation="cuda",
                                      q_segment_ids=seg)
        return (out.astype(jnp.float32) * w).sum(), out

    t0 = time.perf_counter()
    argnums = (0, 1, 2, 3) if c.sinks else (0, 1, 2)
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))(q, k, v, sinks, w)
    for name, x in zip(("out", "dq", "dk", "dv", "dsinks"), (out, *grads)):
        x = np.asarray(x, np.float32)
        if not np.isfinite(x).all():
            raise AssertionError(f"{c.label()}: {name} has non-finite values")
    return time.perf_counter() - t0


def run_fp8_case(c: Case) -> float:
    """The forward of one FP8 case (FP8 is forward-only), inputs quantized per head on the host
    side of the call; out and lse must be finite where the rows see keys (lse -inf elsewhere)."""
    rng = np.random.default_rng(zlib.crc32(c.label().encode()))
    shapes = ((c.b, c.sq, c.hq, c.d), (c.b, c.sk, c.hkv, c.d), (c.b, c.sk, c.hkv, c.head_dim_v))
    (q, qd), (k, kd), (v, vd) = (jax_fa3.quantize_fp8(jax.device_put(rng.standard_normal(s).astype(np.float32)),
                                                      granularity="head") for s in shapes)
    t0 = time.perf_counter()
    fwd = jax.jit(lambda q, k, v, qd, kd, vd: jax_fa3.flash_attention(
        q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, causal=c.causal, window_size=c.window,
        softcap=c.softcap, implementation="cuda", return_lse=True))
    out, lse = fwd(q, k, v, qd, kd, vd)
    if not np.isfinite(np.asarray(out, np.float32)).all():
        raise AssertionError(f"{c.label()}: out has non-finite values")
    if np.isnan(np.asarray(lse)).any() or np.isposinf(np.asarray(lse)).any():
        raise AssertionError(f"{c.label()}: lse has NaN or +inf")
    return time.perf_counter() - t0


def run(cases: list[Case]) -> None:
    t0 = time.perf_counter()
    for i, c in enumerate(cases):
        dt = run_case(c)
        print(f"[{i + 1}/{len(cases)}] {c.label()}: ok ({dt:.1f} s)", flush=True)
    print(f"sanitize_cases: {len(cases)} cases ran in {time.perf_counter() - t0:.0f} s", flush=True)


def _demangle(names: list[str]) -> list[str]:
    tool = shutil.which("cu++filt") or shutil.which("c++filt")
    if tool is None and os.path.exists("/usr/local/cuda/bin/cu++filt"):
        tool = "/usr/local/cuda/bin/cu++filt"
    if tool is None:
        return names
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True, check=True).stdout
    return out.splitlines()


def compiled_kernels() -> list[str]:
    """Mangled names of the fa3 kernels in the extension (cuobjdump's SASS function list)."""
    from jax_fa3 import _fa3_cuda
    cuobjdump = shutil.which("cuobjdump") or "/usr/local/cuda/bin/cuobjdump"
    sass = subprocess.run([cuobjdump, "--dump-sass", _fa3_cuda.__file__], capture_output=True, text=True,
                          check=True).stdout
    names = {line.split("Function :", 1)[1].strip() for line in sass.splitlines() if "Function :" in line}
    return sorted(n for n in names if "3fa3" in n)


def coverage(cases: list[Case], fp8_only: bool = False) -> int:
    """Run the cases under the JAX profiler; 0 when every compiled fa3 kernel (fp8_only: every
    FP8 one) was launched."""
    trace_dir = tempfile.mkdtemp(prefix="fa3_cov_")
    with jax.profiler.trace(trace_dir):
        run(cases)
    launched: set[str] = set()
    for path in glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True):
        data = jax.profiler.ProfileData.from_file(path)
        for plane in data.planes:
            if plane.name.startswith("/device:GPU"):
                launched.update(ev.name for line in plane.lines for ev in line.events)
    mangled = [m for m in compiled_kernels() if not fp8_only or "float_e4m3" in m]
    readable = _demangle(mangled)
    # A kernel counts as launched when the trace names it mangled or demangled (compared without
    # whitespace and parameter list: demanglers format template arguments differently).
    def key(name: str) -> str:
        return "".join(name.split("(")[0].split()).replace("(bool)1", "true").replace("(bool)0", "false")
    flat = "\n".join(launched)
    keys = "\n".join(key(n) for n in launched)
    missing = [r for m, r in zip(mangled, readable) if m not in flat and key(r) not in keys]
    what = "FP8 kernels" if fp8_only else "kernels"
    print(f"coverage: {len(mangled) - len(missing)} of {len(mangled)} compiled fa3 {what} launched")
    for r in missing:
        print(f"  NOT LAUNCHED: {r}")
    if missing:  # how the trace spells kernel names, to see why a name did not match
        print("  (trace names with fa3:", *sorted(n for n in launched if "fa3" in n)[:6], sep="\n    ")
    if not launched:
        print("coverage: the profiler recorded no GPU events, so coverage is unknown")
        return 1
    return 1 if missing else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", choices=["all", "issue24", "fp8"], default="all")
    ap.add_argument("--part", default="0/1", help="run cases I, I+N, I+2N, ... (I/N): one sanitizer "
                    "process per part, side by side")
    ap.add_argument("--list", action="store_true", help="print the cases and exit")
    ap.add_argument("--coverage", action="store_true", help="run under the JAX profiler and check that "
                    "every compiled fa3 kernel was launched")
    args = ap.parse_args()
    cases = compiled_cases(args.set)
    part, parts = (int(x) for x in args.part.split("/"))
    cases = cases[part::parts]
    if args.list:
        for c in cases:
            print(c.label())
        return 0
    if not cases:
        print("sanitize_cases: no (dtype, head dim) is compiled for both directions", file=sys.stderr)
        return 1
    reason = _ffi.extension_reason()
    if reason is not None:
        print(f"sanitize_cases: the kernels cannot run here: {reason}", file=sys.stderr)
        return 1
    if args.coverage:
        return coverage(cases, fp8_only=args.set == "fp8")
    run(cases)
    return 0


if __name__ == "__main__":
    sys.exit(main())
