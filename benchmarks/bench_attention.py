"""Side-by-side attention benchmark on one GPU: jax_fa3, cuDNN, plain XLA and FlashAttention-3.

Implementations (all called from JAX, all in this one process):
  jax_fa3  jax_fa3.flash_attention(..., implementation="cuda")
  jax_fa3_det  the same with deterministic=True (the cost of ordered dQ accumulation)
  jax_fa3_sinks  the same with attention sinks (one logit per head; their gradient included)
  cudnn    jax.nn.dot_product_attention(..., implementation="cudnn")
  xla      jax.nn.dot_product_attention(..., implementation="xla")  (dense; skipped above --xla-max-seqlen)
  fa3      flash_attn3_jax.flash_mha (FA3's own kernels; head dim 128; only when importable)

Grid (the FA3 paper's): batch * seqlen = --tokens (16384), heads * head_dim = --hidden (2048),
seqlen 512..16384, causal and not, head dims 64/128/256. --heads fixes the head count instead
(to compare head dims at one shape); --head-dim-v gives v its own head dim (MLA's 192/128).
FLOPs: forward 2 * batch * heads * unmasked_pairs * (head_dim + head_dim_v) (Q K^T and P V; 4 *
... * head_dim when they are equal); backward 2.5x that.

How it times: each measurement jit-compiles a `lax.fori_loop` of N dependent calls (each
iteration's q passes an optimization barrier together with one element of the previous
result, so XLA can neither hoist nor drop a call, and nothing else runs per call: the earlier
feed-back, `q.at[0, 0, 0, 0].add(...)`, made XLA copy all of q per call, ~42 us at these
sizes), so Python dispatch is out of the figure. N is a compile-time constant: XLA then knows
the trip count and runs the loop body N times back to back; with a traced N, XLA's GPU while
loop copies the loop condition to the host and waits for it at every iteration (a bubble per
call, and figures that move with the host's load). A 2-call loop gives the time per call, N is
chosen so one loop takes about --target-ms, and the N-call loop is compiled and warmed up.
At each grid point all implementations are prepared first, then their loops take turns for
--repeats rounds, each starting one implementation later (A B C, B C A, C A B, ...), so clock
or host drift hits each alike, and no one always has the first (coolest) slot; the median
time / N is reported (every round's in the JSON as ms_rounds; the spread under the table).
Backward: residuals come from one `jax.vjp` outside the loop; the loop calls the pullback
(its own recomputation, if any, counts as backward time). Inputs are fresh normal random data
(never zeros); q, k, v together are 3 x 64 MB at the default size, above the 60 MB L2.

Each implementation's result (out, or dq for the backward) is compared with the first finite
implementation's at the same point; one further than --max-rel-err, or with a NaN/Inf in its
result, is flagged as suspect in the JSON, the table and the log (its time is not a valid figure).

Writes <out>/<date>-<gpu>.json ({"date", "gpu", "jax", "cuda", "records": [...]}), a markdown
table with ratios to each peer (<out>/<date>-<gpu>.md), and a PNG plot per head dim.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import math
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


def unmasked_pairs(seqlen: int, causal: bool) -> int:
    return seqlen * (seqlen + 1) // 2 if causal else seqlen * seqlen


def grid_shape(head_dim: int, seqlen: int, tokens: int, hidden: int) -> tuple[int, int, int, int]:
    """(batch, seqlen, heads, head_dim) of a grid point: batch * seqlen = tokens, heads *
    head_dim = hidden (the FA3 paper's convention)."""
    return max(tokens // seqlen, 1), seqlen, hidden // head_dim, head_dim


def attention_fn(impl: str, causal: bool, direction: str = "fwd"):
    """A function (q, k, v) -> out for `impl`, or raise if it cannot be built here; `direction`
    is the one it will be timed in."""
    if impl == "jax_fa3":
        import jax_fa3
        return lambda q, k, v: jax_fa3.flash_attention(q, k, v, causal=causal, implementation="cuda")
    if impl == "jax_fa3_sinks":
        import jax_fa3

        def with_sinks(q, k, v):
            # In the backward the sinks are taken from q, so that the pullback (over q, k, v) also
            # computes their gradient, as training does; the pullback is formed once, outside the
            # timed loop, and the gradient's scatter into dq is one small op. In the forward they
            # are a constant: the timed loop changes q at every call, and a slice of it would add
            # an XLA op per call (~5 us, 2-4% of an hd64 causal 512 call) that is not the sinks'.
            if direction == "bwd":
                sinks = q[0, 0, :, 0].astype(jnp.float32)
            else:
                sinks = jnp.asarray(np.linspace(-1.0, 1.0, q.shape[2], dtype=np.float32))
            return jax_fa3.flash_attention(q, k, v, causal=causal, sinks=sinks, implementation="cuda")
        return with_sinks
    if impl == "jax_fa3_det":
        import jax_fa3
        return lambda q, k, v: jax_fa3.flash_attention(q, k, v, causal=causal, deterministic=True,
                                                       implementation="cuda")
    if impl in ("cudnn", "xla"):
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=impl)
    if impl == "fa3":
        from flash_attn3_jax import flash_mha
        return lambda q, k, v: flash_mha(q, k, v, is_causal=causal)
    raise ValueError(f"unknown implementation {impl!r}")


def chained(x, token):
    """x, made to depend on `token` (a scalar from the previous call's result) through an
    optimization barrier: the next call cannot start before the previous one ended, nor be
    hoisted out of the loop, and x is not touched (no copy of it per call)."""
    x, _ = jax.lax.optimization_barrier((x, token))
    return x


def first_element(*arrays):
    """A float32 scalar that depends on every array (so none of them can be dropped); an
    index, not a reshape, so a sharded array is not gathered for it."""
    return sum(a[(0,) * a.ndim].astype(jnp.float32) for a in arrays)


def make_loop(fn, direction: str, q, k, v, dout=None):
    """(run, once): run(n) runs `direction` of fn n times back to back in one jitted loop;
    once() returns one result (out, or dq for the backward) for the cross-check. The backward's
    output cotangent is `dout` (placed like q), or fresh random data."""
    if direction == "fwd":
        @functools.partial(jax.jit, static_argnums=0)  # static n: a known trip count (docstring)
        def loop(n, q, k, v):
            def body(_, carry):
                q = chained(*carry)
                return q, first_element(fn(q, k, v))
            return jax.lax.fori_loop(0, n, body, (q, jnp.float32(0)))
        return (lambda n: loop(n, q, k, v)), (lambda: jax.jit(fn)(q, k, v))

    _, pullback = jax.vjp(fn, q, k, v)
    if dout is None:
        dout = jax.random.normal(jax.random.key(7), (*q.shape[:3], v.shape[-1]), q.dtype)  # out's shape

    @functools.partial(jax.jit, static_argnums=0)
    def loop(n, pullback, dout):
        def body(_, carry):
            dout = chained(*carry)
            return dout, first_element(*pullback(dout))
        return jax.lax.fori_loop(0, n, body, (dout, jnp.float32(0)))
    return (lambda n: loop(n, pullback, dout)), (lambda: jax.jit(lambda p, d: p(d)[0])(pullback, dout))


def relative_error(x, ref) -> float:
    x, ref = x.astype(jnp.float32), ref.astype(jnp.float32)
    return float(jnp.linalg.norm(x - ref) / jnp.maximum(jnp.linalg.norm(ref), 1e-30))


def calibrate(run, target_ms: float) -> int:
    """The call count n for which run(n) takes about target_ms; run(n) is compiled and warm."""
    jax.block_until_ready(run(2))  # compile and warm up
    t0 = time.perf_counter()
    jax.block_until_ready(run(2))
    per_call = max((time.perf_counter() - t0) * 1e3 / 2, 1e-3)
    n = int(min(max(target_ms / per_call, 3), 2000))
    jax.block_until_ready(run(n))  # compile and warm up the timed loop
    return n


def sample_ms(run, n: int) -> float:
    """Milliseconds per call of one run(n)."""
    t0 = time.perf_counter()
    jax.block_until_ready(run(n))
    return (time.perf_counter() - t0) * 1e3 / n


def time_ms(run, target_ms: float, repeats: int) -> float:
    """Median milliseconds per call of run(n) (each n is compiled once: run takes it static)."""
    n = calibrate(run, target_ms)
    return statistics.median(sample_ms(run, n) for _ in range(repeats))


def gpu_name() -> str:
    return jax.devices()[0].device_kind.replace(" ", "-")


def cuda_version() -> str:
    try:
        from jax._src.lib import cuda_versions  # version of the plugin JAX runs on
        return str(cuda_versions.cuda_runtime_get_version())
    except Exception:  # noqa: BLE001 - informational only
        return "unknown"


def time_point(args, point: dict, q, k, v) -> list[dict]:
    """One grid point: every implementation that can run it is compiled, warmed up and
    cross-checked first; then the timed loops take turns for --repeats rounds, each round
    starting one implementation later (A B C, B C A, ...), so a drift of the GPU's clocks or of
    the host hits every one alike.
    Returns one record per implementation (median ms per call, TFLOP/s, cross-check)."""
    head_dim, seqlen, causal, direction = (point[x] for x in ("head_dim", "seqlen", "causal",
                                                                "direction"))
    flops = (2 * point["batch"] * point["heads"] * unmasked_pairs(seqlen, causal)
             * (head_dim + point["head_dim_v"]))
    flops *= 2.5 if direction == "bwd" else 1.0
    reference = None  # the first finite result of this point: the others must match it
    ready = []  # (record, run, n)
    for impl in args.impls:
        if impl == "xla" and seqlen > args.xla_max_seqlen:
            continue
        if impl == "fa3" and (head_dim != 128 or point["head_dim_v"] != 128):
            continue
        rec = dict(impl=impl, **point)
        try:
            run, once = make_loop(attention_fn(impl, causal, direction), direction, q, k, v)
            result = once()
            n = calibrate(run, args.target_ms)
        except Exception as err:  # noqa: BLE001 - a peer that cannot run this point
            print(f"  {impl:8s} {direction} hd{head_dim} s{seqlen} causal={causal}: "
                  f"unsupported ({type(err).__name__}: {str(err).splitlines()[0][:120]})",
                  flush=True)
            continue
        if impl == "jax_fa3_sinks" and bool(jnp.isfinite(result).all()):
            rec["rel_err"] = "not compared: sinks change the result"  # another function
        else:
            reference = check_result(rec, direction, result, reference, args.max_rel_err)
        del result
        ready.append((rec, run, n))
    for rec, ms in time_rounds(ready, args.repeats, flops):
        print(f"  {rec['impl']:8s} {direction} hd{hd_label(rec)} s{seqlen:5d} b{point['batch']:2d} "
              f"h{point['heads']:2d} causal={int(causal)}: {ms:8.3f} ms {rec['tflops']:7.1f} TFLOP/s",
              flush=True)
    return [rec for rec, _, _ in ready]


def check_result(rec: dict, direction: str, result, reference, max_rel_err: float):
    """Marks rec["suspect"] when `result` holds non-finite values or differs from
    `reference` = (impl, result) by max_rel_err or more (a wrong result's speed means nothing);
    returns the reference, which the first finite result becomes."""
    impl = rec["impl"]
    nonfinite = int(result.size - jnp.isfinite(result).sum())
    if nonfinite:  # wrong on its own; never the yardstick for the others
        rec.update(nonfinite=nonfinite, suspect=True)
        print(f"  WARNING {impl} {direction} returned {nonfinite} non-finite values: its "
              f"time is not a valid figure", flush=True)
        return reference
    if reference is None:
        return impl, result
    err = relative_error(result, reference[1])
    rec[f"rel_err_vs_{reference[0]}"] = float(f"{err:.3g}")
    if not err < max_rel_err:
        rec["suspect"] = True
        print(f"  WARNING {impl} {direction} differs from {reference[0]} by {err:.3g} "
              f"(relative): its time is not a valid figure", flush=True)
    return reference


def time_rounds(ready, repeats: int, flops: float):
    """Times each (record, run, n) of `ready` in `repeats` rounds and fills its record's ms
    (median), tflops and ms_rounds; yields (record, ms)."""
    samples = [[] for _ in ready]
    for r in range(repeats):
        # Round r starts at implementation r (A B C, B C A, C A B, ...): the card slows as it heats
        # within a point, so a fixed order would always hand the coolest slot to the first one.
        for j in range(len(ready)):
            i = (r + j) % len(ready)
            _, run, n = ready[i]
            samples[i].append(sample_ms(run, n))
    for (rec, _, _), times in zip(ready, samples):
        ms = statistics.median(times)
        rec.update(ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1),
                   ms_rounds=[round(t, 4) for t in times])
        yield rec, ms


def run_grid(args) -> list[dict]:
    dtype = jnp.dtype(args.dtype)
    records = []
    for head_dim in args.head_dims:
        head_dim_v = args.head_dim_v or head_dim
        for seqlen in args.seqlens:
            shape = grid_shape(head_dim, seqlen, args.tokens, args.hidden)
            if args.heads:
                shape = (shape[0], seqlen, args.heads, head_dim)
            batch, _, heads, _ = shape
            kq, kk, kv = jax.random.split(jax.random.key(seqlen * 1000 + head_dim), 3)
            q, k = (jax.random.normal(key, shape, dtype) for key in (kq, kk))
            v = jax.random.normal(kv, (*shape[:3], head_dim_v), dtype)
            for causal in args.causal:
                for direction in args.directions:
                    point = dict(dtype=dtype.name, head_dim=head_dim, head_dim_v=head_dim_v,
                                 seqlen=seqlen, batch=batch, heads=heads, causal=causal,
                                 direction=direction)
                    records += time_point(args, point, q, k, v)
    return records


IMPLS = ("jax_fa3", "jax_fa3_det", "jax_fa3_sinks", "cudnn", "fa3", "xla")


def hd_label(r: dict) -> str:
    """The head dim of a record, "192/128" when v's differs from q's and k's."""
    dv = r.get("head_dim_v", r["head_dim"])
    return str(r["head_dim"]) if dv == r["head_dim"] else f"{r['head_dim']}/{dv}"


def _key(r: dict):
    return r["direction"], r["head_dim"], r.get("head_dim_v", r["head_dim"]), r["causal"], r["seqlen"]


def markdown(records: list[dict], header: str) -> str:
    """One row per (direction, head dims, causal, seqlen); TFLOP/s per impl and jax_fa3's ratios."""
    impls = [i for i in IMPLS if any(r["impl"] == i for r in records)]
    peers = [i for i in impls if i != "jax_fa3"]
    cols = ["dir", "hd", "causal", "seqlen"] + impls + [f"vs {p}" for p in peers]
    lines = [header, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for key in sorted({_key(r) for r in records}):
        at = [r for r in records if _key(r) == key]
        by = {r["impl"]: r["tflops"] for r in at}
        row = [key[0], hd_label(at[0]), "yes" if key[3] else "no", str(key[4])]
        suspect = {r["impl"] for r in at if r.get("suspect")}
        row += [f"{by[i]:.1f}{' (wrong result)' if i in suspect else ''}" if i in by else "-" for i in impls]
        row += [f"{by['jax_fa3'] / by[p]:.2f}x" if "jax_fa3" in by and p in by
                and not suspect & {"jax_fa3", p} else "-" for p in peers]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", spread_note(records)]
    return "\n".join(lines) + "\n"


def spread_note(records: list[dict], point=lambda r: f"s{r['seqlen']}") -> str:
    """How far the rounds of one implementation at one point were apart (slowest / fastest - 1):
    the noise a ratio in the table has to beat. `point(record)` names a point's shape."""
    spreads = sorted(((max(r["ms_rounds"]) / min(r["ms_rounds"]) - 1, r) for r in records
                      if len(r.get("ms_rounds", ())) > 1 and min(r["ms_rounds"]) > 0),
                     key=lambda pair: pair[0])
    if not spreads:
        return "Spread between rounds: not recorded."
    median = statistics.median(s for s, _ in spreads)
    worst, r = spreads[-1]
    return (f"Spread between rounds (slowest / fastest - 1, per implementation and point): median "
            f"{median:.1%}, largest {worst:.1%} ({r['impl']} {r['direction']} hd{r['head_dim']} "
            f"{point(r)} causal={int(r['causal'])}).")


def plot(records: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = sorted({(r["direction"], r["causal"], r["head_dim"]) for r in records})
    cols = max(1, len({p[2] for p in panels}))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.4 * rows), squeeze=False)
    for ax, (direction, causal, hd) in zip(axes.flat, panels):
        for impl in IMPLS:
            pts = sorted((r["seqlen"], r["tflops"]) for r in records if r["impl"] == impl
                         and (r["direction"], r["causal"], r["head_dim"]) == (direction, causal, hd))
            if pts:
                ax.plot(*zip(*pts), marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{direction} hd{hd} {'causal' if causal else 'non-causal'}", fontsize=9)
        ax.set_xlabel("seqlen")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def rerender(json_path: Path) -> None:
    """Rewrite the markdown table and the plot of a results JSON (after a change here)."""
    data = json.loads(json_path.read_text())
    md = json_path.with_suffix(".md")
    header = md.read_text().splitlines()[0] if md.exists() else f"# {json_path.stem}"
    md.write_text(markdown(data["records"], header))
    plot(data["records"], json_path.with_suffix(".png"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--impls", nargs="+", default=["cudnn", "jax_fa3", "fa3", "xla"],
                   help="the first that runs a point is the reference the others are checked against")
    p.add_argument("--head-dims", nargs="+", type=int, default=[64, 128, 256])
    p.add_argument("--seqlens", nargs="+", type=int, default=[512, 1024, 2048, 4096, 8192, 16384])
    p.add_argument("--causal", nargs="+", type=int, default=[0, 1], choices=[0, 1])
    p.add_argument("--directions", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--tokens", type=int, default=16384, help="batch * seqlen")
    p.add_argument("--hidden", type=int, default=2048, help="heads * head_dim")
    p.add_argument("--heads", type=int, default=0, help="fixed head count (0: hidden // head_dim)")
    p.add_argument("--head-dim-v", type=int, default=0, help="v's head dim (0: the head dim)")
    p.add_argument("--xla-max-seqlen", type=int, default=2048)
    p.add_argument("--target-ms", type=float, default=40.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tag", default="",
                   help="suffix of the results files (e.g. the kernel version), so runs of one day do not overwrite each other")
    p.add_argument("--max-rel-err", type=float, default=0.02,
                   help="results further than this from the first implementation's are flagged suspect")
    args = p.parse_args(argv)
    args.causal = [bool(c) for c in args.causal]
    if jax.default_backend() != "gpu":
        print(f"bench_attention: needs a GPU (backend is {jax.default_backend()})", file=sys.stderr)
        return 2

    date = dt.date.today().isoformat()
    meta = dict(date=date, gpu=gpu_name(), jax=jax.__version__, cuda=cuda_version())
    print(f"bench_attention: {meta}", flush=True)
    try:
        import jax_fa3
        meta["jax_fa3_build"] = jax_fa3.build_info()
    except Exception as err:  # noqa: BLE001
        meta["jax_fa3_build"] = f"unavailable: {err}"
    records = run_grid(args)
    args.out.mkdir(parents=True, exist_ok=True)
    meta["tag"] = args.tag
    stem = args.out / "-".join(x for x in (date, meta["gpu"], args.tag) if x)
    stem.with_suffix(".json").write_text(json.dumps({**meta, "records": records}, indent=1))
    header = (f"# Attention benchmark, {date}, {meta['gpu']}, jax {meta['jax']}, {args.dtype}, "
              f"batch*seqlen={args.tokens}, heads*head_dim={args.hidden}{', ' + args.tag if args.tag else ''} (TFLOP/s; ratios = jax_fa3 / peer)")
    table = markdown(records, header)
    stem.with_suffix(".md").write_text(table)
    if records:
        plot(records, stem.with_suffix(".png"))
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
