"""Context-parallel attention on 1..N GPUs (ring / all-gather): correctness and scaling.

    python3 -P benchmarks/ring_scaling.py --out OUT --gpus 1,2,4,8   # a machine with 8 Hopper GPUs
    python3 -P benchmarks/ring_scaling.py --out OUT --gpus 1,2 --seq-per-gpu 65536 \
        --full-length-baseline                                      # the two-GPU run (issue 5)
    python3 -P benchmarks/ring_scaling.py --out /tmp/r --smoke        # tiny sizes, 8 CPU devices

The tokens per GPU are fixed (--seq-per-gpu, default 32768): on N GPUs one sequence of
N x seq-per-gpu tokens is split over a 1D mesh ('sp'), head dim 128, bf16, causal, zig-zag
layout, the Hopper kernels demanded (implementation="cuda"; the JSON says which path ran).
GQA: --heads-kv (e.g. 8 of 16).

Correctness, at every N >= 2 and strategy
  * the context-parallel result vs flash_attention on one GPU at the same full length: max
    |difference| of out and lse (and dq, dk, dv with the backward), relative to the largest;
  * both against a float32 dense oracle on --oracle-rows sampled query rows (all keys), so a
    shared error cannot hide: the sharded error must be at most 2x the single GPU's plus one
    ulp (the error-ratio rule of docs/architecture.md with the single-GPU kernel as baseline).

Scaling (FLOPs: forward 4 * batch * heads * unmasked pairs * head_dim, backward 2.5x)
  * one GPU at seq-per-gpu (N = 1, the baseline), each strategy at N x seq-per-gpu on N GPUs,
    as TFLOP/s per GPU; efficiency = per-GPU TFLOP/s at N / at N = 1 (the same tokens per GPU);
  * with --full-length-baseline also one GPU at each full length (speedup of N GPUs over one).
  Timing: a jitted fori_loop of dependent calls with a compile-time trip count
  (bench_attention.make_loop), warm-up first, median of --repeats.

Writes <out>/<date>-<gpu>-ring-scaling[-tag].json, .md and .png (per-GPU TFLOP/s and efficiency
against the GPU count).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from pathlib import Path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="output folder for the JSON, markdown and plot")
    p.add_argument("--gpus", default=None,
                   help="comma list of GPU counts (default: 1 and every power of two up to the "
                        "devices present)")
    p.add_argument("--seq-per-gpu", type=int, default=32768)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--heads-kv", type=int, default=None, help="default: --heads (no GQA)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--no-causal", dest="causal", action="store_false")
    p.add_argument("--layout", default="zigzag", choices=("zigzag", "contiguous"))
    p.add_argument("--strategies", default="ring,allgather", help="comma list of ring,allgather")
    p.add_argument("--backward", default="auto", choices=("auto", "on", "off"),
                   help="auto: only when a backward kernel is built")
    p.add_argument("--full-length-baseline", action="store_true",
                   help="also time one GPU at each full length")
    p.add_argument("--oracle-rows", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--target-ms", type=float, default=400.0)
    p.add_argument("--tag", default="", help="suffix of the output files (e.g. gqa)")
    p.add_argument("--smoke", action="store_true",
                   help="8 simulated CPU devices, tiny sizes, portable path (checks the script)")
    args = p.parse_args(argv)
    if args.smoke:
        args.seq_per_gpu, args.heads, args.head_dim = 64, 2, 32
        args.oracle_rows, args.repeats, args.target_ms = 16, 2, 1.0
        args.backward = "on" if args.backward == "auto" else args.backward
    args.heads_kv = args.heads_kv or args.heads
    if args.gpus is not None:
        try:
            args.gpus = sorted({int(x) for x in args.gpus.split(",") if x.strip()})
        except ValueError:
            p.error(f"--gpus {args.gpus!r}: expected a comma list of integers")
        if not args.gpus or args.gpus[0] < 1:
            p.error("--gpus: GPU counts must be >= 1")
    return args


ARGS = parse_args()

import jax  # noqa: E402  (the CPU device count must be set before JAX starts)

if ARGS.smoke:
    jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_fa3  # noqa: E402
from jax_fa3 import attention, ring  # noqa: E402
from jax_fa3.sharding import context_parallel_attention  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import make_loop, time_ms, unmasked_pairs  # noqa: E402


# ----------------------------------------------------------------------------- helpers

def timed_loops(fn, q, k, v, dout, backward: bool):
    """{'fwd': run(n), 'bwd': run(n)}: n dependent calls in one jitted loop (bench_attention)."""
    loops = {"fwd": make_loop(fn, "fwd", q, k, v)[0]}
    if backward:
        loops["bwd"] = make_loop(fn, "bwd", q, k, v, dout=dout)[0]
    return loops


def max_rel_diff(a, b) -> float:
    """max |a - b| / max |b| over finite entries of b (float32, on b's device)."""
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    fin = jnp.isfinite(b)
    diff = jnp.where(fin, jnp.abs(a - b), 0).max()
    return float(diff / jnp.maximum(jnp.where(fin, jnp.abs(b), 0).max(), 1e-30))


def oracle_rows(q, k, v, rows, causal, scale, chunk=32):
    """float32 dense attention (out, lse) for the query `rows` only, against all keys."""
    outs, lses = [], []
    s_k, hq, hkv = k.shape[1], q.shape[2], k.shape[2]
    kf = jnp.repeat(k.astype(jnp.float32), hq // hkv, axis=2)
    vf = jnp.repeat(v.astype(jnp.float32), hq // hkv, axis=2)

    @jax.jit  # kf, vf as arguments: closed over, they would be baked in as 2 GB of constants
    def part(qr, pos, kf, vf):
        s = jnp.einsum("bqhd,bkhd->bhqk", qr.astype(jnp.float32), kf,
                       precision=jax.lax.Precision.HIGHEST) * scale
        if causal:  # bottom-right aligned; seq_q == seq_k here
            s = jnp.where(jnp.arange(s_k)[None, :] <= pos[:, None], s, -jnp.inf)
        lse = jax.nn.logsumexp(s, axis=-1)
        p = jnp.exp(s - lse[..., None])
        return jnp.einsum("bhqk,bkhd->bqhd", p, vf, precision=jax.lax.Precision.HIGHEST), lse

    for i in range(0, len(rows), chunk):
        pos = jnp.asarray(rows[i:i + chunk])
        o, l = part(q[:, pos], pos, kf, vf)
        outs.append(o)
        lses.append(l)
    return jnp.concatenate(outs, 1), jnp.concatenate(lses, 2)


@jax.jit
def apply_pullback(pullback, cotangent):
    """The pullback of jax.vjp as an argument: its residuals (q, k, v, out, lse: GBs at this
    length) are then inputs of the compiled call; jit(pullback) would bake them in as constants."""
    return pullback(cotangent)


def oracle_error(out, lse, ref_out, ref_lse, rows):
    rows = jnp.asarray(rows)
    return (float(jnp.abs(out[:, rows].astype(jnp.float32) - ref_out).max()),
            float(jnp.abs(lse[:, :, rows] - ref_lse).max()))


# ----------------------------------------------------------------------------- main

def gpu_counts(args, available: int) -> list[int]:
    """The GPU counts to run: --gpus, or 1 and the powers of two up to what is present."""
    if args.gpus is None:
        return [n for n in (1, 2, 4, 8, 16, 32) if n <= available]
    if args.gpus[-1] > available:
        raise SystemExit(f"ring_scaling: --gpus asks for {args.gpus[-1]} devices, {available} present")
    return args.gpus


def random_inputs(args, seq, dtype, device):
    b, h, hkv, d = args.batch, args.heads, args.heads_kv, args.head_dim
    keys = jax.random.split(jax.random.key(seq), 4)
    shapes = [(b, seq, h, d), (b, seq, hkv, d), (b, seq, hkv, d), (b, seq, h, d)]
    with jax.default_device(device):
        return [jax.random.normal(key, shape, jnp.float32).astype(dtype)
                for key, shape in zip(keys, shapes)]


class Run:
    """One configuration on one machine: inputs, implementations, and the report they fill."""

    def __init__(self, args):
        self.args = args
        self.impl = None if args.smoke else "cuda"
        self.dtype = jnp.dtype(args.dtype)
        self.devices = jax.devices()
        self.scale = 1.0 / np.sqrt(args.head_dim)
        self.strategies = [x.strip() for x in args.strategies.split(",") if x.strip()]
        bwd_reason = attention.unavailable_reason("bwd", self.dtype, args.head_dim)
        self.backward = args.backward == "on" or (args.backward == "auto" and bwd_reason is None)
        self.bwd_reason = bwd_reason
        self.timings = []

    def single(self, q, k, v):
        return attention.flash_attention(q, k, v, causal=self.args.causal, return_lse=True,
                                         implementation=self.impl)

    def sharded(self, mesh, strategy):
        def f(q, k, v):
            return context_parallel_attention(q, k, v, mesh=mesh, seq_axis="sp",
                                              causal=self.args.causal, layout=self.args.layout,
                                              strategy=strategy, return_lse=True,
                                              implementation=self.impl)
        return f

    def time(self, name, gpus, length, fn, inputs):
        """Time fwd (and bwd) of fn(q, k, v) -> out on `inputs`; one record per direction."""
        a = self.args
        flops_fwd = 4 * a.batch * a.heads * unmasked_pairs(length, a.causal) * a.head_dim
        for direction, run in timed_loops(fn, *inputs, self.backward).items():
            ms = time_ms(run, a.target_ms, a.repeats)
            flops = flops_fwd * (2.5 if direction == "bwd" else 1.0)
            rec = dict(name=name, direction=direction, gpus=gpus, seqlen=length,
                       ms=float(f"{ms:.4g}"), tflops_per_gpu=float(f"{flops / ms / 1e9 / gpus:.4g}"))
            self.timings.append(rec)
            print(f"  {name:28s} {direction} {gpus} GPU seq {length:7d}: {ms:9.3f} ms "
                  f"{rec['tflops_per_gpu']:7.1f} TFLOP/s per GPU", flush=True)

    def check_and_time(self, n) -> dict:
        """N GPUs: the sharded result against one GPU and the oracle, then its throughput."""
        a, dtype, dev0 = self.args, self.dtype, self.devices[0]
        seq = n * a.seq_per_gpu
        mesh = jax.make_mesh((n,), ("sp",), axis_types=(AxisType.Auto,), devices=self.devices[:n])
        q, k, v, dout = random_inputs(a, seq, dtype, dev0)
        zz = a.layout == "zigzag"
        perm = (lambda x, ax=1: ring.zigzag_permute(x, n, ax)) if zz else (lambda x, ax=1: x)
        unperm = (lambda x, ax=1: ring.zigzag_unpermute(x, n, ax)) if zz else (lambda x, ax=1: x)
        shard = NamedSharding(mesh, P(None, "sp"))
        place = lambda x: jax.device_put(jax.jit(perm)(x), shard)
        to_dev0 = lambda x, ax=1: jax.device_put(jax.jit(lambda y: unperm(y, ax))(x), dev0)

        t0 = time.perf_counter()
        out1, lse1 = jax.jit(self.single)(q, k, v)
        rows = np.unique(np.r_[0, seq - 1, np.random.default_rng(n).choice(
            seq, min(a.oracle_rows, seq), replace=False)])
        ref_out, ref_lse = oracle_rows(q, k, v, rows, a.causal, self.scale)
        err1 = oracle_error(out1, lse1, ref_out, ref_lse, rows)
        ulp = float(jnp.finfo(dtype).eps) * float(jnp.abs(ref_out).max())
        if self.backward:
            _, vjp1 = jax.vjp(lambda q, k, v: self.single(q, k, v)[0], q, k, v)
            grads1 = apply_pullback(vjp1, dout)
        qs, ks, vs, dos = (place(x) for x in (q, k, v, dout))
        checks = {}
        for strategy in self.strategies:
            f = jax.jit(self.sharded(mesh, strategy))
            out_r, lse_r = f(qs, ks, vs)
            out_r, lse_r = to_dev0(out_r), to_dev0(lse_r, 2)
            err_r = oracle_error(out_r, lse_r, ref_out, ref_lse, rows)
            rec = dict(
                gpus=n, out_vs_single_rel=max_rel_diff(out_r, out1), lse_vs_single_abs=float(
                    jnp.abs(jnp.where(jnp.isfinite(lse1), lse_r - lse1, 0)).max()),
                oracle_rows=len(rows), out_err_sharded=err_r[0], out_err_single=err1[0],
                lse_err_sharded=err_r[1], lse_err_single=err1[1])
            rec["out_pass"] = err_r[0] <= 2 * err1[0] + ulp
            rec["lse_pass"] = err_r[1] <= 2 * err1[1] + 1e-5 * float(jnp.abs(ref_lse).max())
            if self.backward:
                _, vjp_r = jax.vjp(lambda q, k, v: f(q, k, v)[0], qs, ks, vs)
                grads_r = [to_dev0(g) for g in apply_pullback(vjp_r, dos)]
                for name, g_r, g_1 in zip(("dq", "dk", "dv"), grads_r, grads1):
                    rec[f"{name}_vs_single_rel"] = max_rel_diff(g_r, g_1)
                # Partial dK/dV are rounded to the input dtype per block before the float32
                # sum: a few ulps.
                rec["grads_pass"] = all(rec[f"{g}_vs_single_rel"] <= 4 * float(jnp.finfo(dtype).eps)
                                        for g in ("dq", "dk", "dv"))
            rec["pass"] = bool(rec["out_pass"] and rec["lse_pass"] and rec.get("grads_pass", True))
            checks[strategy] = rec
            print(f"[{n} GPUs, {strategy}] {json.dumps(rec)}", flush=True)
        print(f"{n} GPUs: correctness checks took {time.perf_counter() - t0:.1f} s", flush=True)
        del out1, lse1

        for strategy in self.strategies:
            fn = lambda q, k, v, f=self.sharded(mesh, strategy): f(q, k, v)[0]
            self.time(f"{strategy} ({a.layout})", n, seq, fn, (qs, ks, vs, dos))
        del qs, ks, vs, dos
        if a.full_length_baseline:
            self.time("one GPU, full length", 1, seq, lambda q, k, v: self.single(q, k, v)[0],
                      (q, k, v, dout))
        return checks

    def efficiencies(self):
        """Per-GPU TFLOP/s at N over one GPU at seq-per-gpu; speedup over one GPU at the full length."""
        base = {r["direction"]: r for r in self.timings if r["name"] == "one GPU"}
        full = {(r["direction"], r["seqlen"]): r for r in self.timings
                if r["name"] == "one GPU, full length"}
        for r in self.timings:
            if r["gpus"] > 1 and r["direction"] in base:
                r["efficiency"] = float(f"{r['tflops_per_gpu'] / base[r['direction']]['tflops_per_gpu']:.3g}")
            if r["gpus"] > 1 and (r["direction"], r["seqlen"]) in full:
                r["speedup_vs_one_gpu"] = float(f"{full[(r['direction'], r['seqlen'])]['ms'] / r['ms']:.3g}")


def main(args) -> int:
    run = Run(args)
    counts = gpu_counts(args, len(run.devices))
    a, dev0 = args, run.devices[0]
    print(f"jax {jax.__version__}, devices {run.devices}, build {jax_fa3.build_info()}", flush=True)
    print(f"GPU counts {counts}, {a.seq_per_gpu} tokens per GPU, b{a.batch} h{a.heads}/{a.heads_kv} "
          f"d{a.head_dim} {run.dtype.name} causal={a.causal} layout={a.layout} "
          f"strategies={run.strategies} backward={run.backward}", flush=True)
    q, k, v, dout = random_inputs(a, a.seq_per_gpu, run.dtype, dev0)
    report = dict(
        date=dt.date.today().isoformat(), gpu=dev0.device_kind, jax=jax.__version__,
        build=jax_fa3.build_info(), devices=[str(x) for x in run.devices[:counts[-1]]],
        config=dict(gpu_counts=counts, seq_per_gpu=a.seq_per_gpu, batch=a.batch, heads=a.heads,
                    heads_kv=a.heads_kv, head_dim=a.head_dim, dtype=run.dtype.name,
                    causal=a.causal, layout=a.layout, strategies=run.strategies,
                    implementation=run.impl or "auto (portable on CPU)",
                    fwd_impl=attention.resolve_implementation(run.impl, q, "fwd"),
                    backward=run.backward,
                    bwd_impl=(attention.resolve_implementation(run.impl, q, "bwd")
                              if run.backward else None),
                    bwd_kernel_missing_reason=run.bwd_reason),
        correctness={})
    run.time("one GPU", 1, a.seq_per_gpu, lambda q, k, v: run.single(q, k, v)[0], (q, k, v, dout))
    del q, k, v, dout
    for n in counts:
        if n > 1:
            report["correctness"][str(n)] = run.check_and_time(n)
    run.efficiencies()
    report["timings"] = run.timings
    report["pass"] = all(r["pass"] for by_n in report["correctness"].values() for r in by_n.values())
    write(args, report)
    return 0 if report["pass"] else 1


def write(args, report) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "-".join(x for x in (report["date"], report["gpu"].replace(" ", "-"), "ring-scaling",
                                args.tag) if x)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    c = report["config"]
    lines = [f"# Context-parallel scaling ({report['gpu']}, jax {report['jax']}, {report['date']})",
             "",
             f"GPU counts {c['gpu_counts']}, {c['seq_per_gpu']} tokens per GPU (one sequence of "
             f"N x {c['seq_per_gpu']}), batch {c['batch']}, heads {c['heads']}/{c['heads_kv']}, "
             f"head dim {c['head_dim']}, {c['dtype']}, causal={c['causal']}, layout {c['layout']}; "
             f"forward {c['fwd_impl']}, backward {c['bwd_impl']}.", "",
             "## Correctness (N GPUs vs one GPU at the same length; float32 oracle on sampled rows)",
             "", "| GPUs | strategy | out rel diff | lse abs diff | out err sharded / single | dq | dk "
             "| dv | pass |", "|---|---|---|---|---|---|---|---|---|"]
    for n, by in report["correctness"].items():
        for s, r in by.items():
            g = [f"{r[x]:.2e}" if x in r else "-" for x in ("dq_vs_single_rel", "dk_vs_single_rel",
                                                             "dv_vs_single_rel")]
            lines.append(f"| {n} | {s} | {r['out_vs_single_rel']:.2e} | {r['lse_vs_single_abs']:.2e} | "
                         f"{r['out_err_sharded']:.2e} / {r['out_err_single']:.2e} | {' | '.join(g)} | "
                         f"{'yes' if r['pass'] else 'NO'} |")
    lines += ["", "## Throughput (TFLOP/s per GPU; efficiency = per GPU at N / one GPU at the same "
              "tokens per GPU)", "",
              "| run | dir | GPUs | seq | ms | TFLOP/s per GPU | efficiency | speedup vs 1 GPU at "
              "full length |", "|---|---|---|---|---|---|---|---|"]
    for r in report["timings"]:
        cells = [r["name"], r["direction"], r["gpus"], r["seqlen"], r["ms"], r["tflops_per_gpu"],
                 r.get("efficiency", "-"), r.get("speedup_vs_one_gpu", "-")]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    plot(report, out / f"{stem}.png")
    print(f"wrote {out / stem}.json, .md and .png", flush=True)


def plot(report, path: Path) -> None:
    """Per-GPU TFLOP/s and efficiency against the GPU count, one line per strategy and direction."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax_t, ax_e) = plt.subplots(1, 2, figsize=(10, 4))
    timings = report["timings"]
    one_gpu = {r["direction"]: r for r in timings if r["name"] == "one GPU"}
    lines = sorted({(r["name"], r["direction"]) for r in timings
                    if r["gpus"] > 1 and r["name"] != "one GPU, full length"})
    for name, direction in lines:  # each strategy's line starts at the one-GPU point
        recs = [one_gpu[direction]] if direction in one_gpu else []
        recs += sorted((r for r in timings if (r["name"], r["direction"]) == (name, direction)),
                       key=lambda r: r["gpus"])
        gpus = [r["gpus"] for r in recs]
        ax_t.plot(gpus, [r["tflops_per_gpu"] for r in recs], marker="o", label=f"{name} {direction}")
        if direction in one_gpu:
            base = one_gpu[direction]["tflops_per_gpu"]
            ax_e.plot(gpus, [r["tflops_per_gpu"] / base for r in recs], marker="o")
    for ax, title in ((ax_t, "TFLOP/s per GPU"), (ax_e, "efficiency (per GPU vs 1 GPU)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    ax_e.set_ylim(0, 1.1)
    ax_t.legend(fontsize=7)
    c = report["config"]
    fig.suptitle(f"{report['gpu']}: {c['seq_per_gpu']} tokens per GPU, h{c['heads']}/{c['heads_kv']} "
                 f"d{c['head_dim']}, causal={c['causal']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main(ARGS))
