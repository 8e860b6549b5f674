"""Where the GPU time of back-to-back calls goes: per call, each GPU op and the idle time.

    python3 -P benchmarks/timeline_point.py --impl jax_fa3 --direction fwd --head-dim 128 --seqlen 512 --causal 1

Runs the benchmark's timed loop of a grid point (profile_point.py's arguments and inputs;
--calls dependent calls in one jitted fori_loop) under jax.profiler, reads the GPU streams'
events back (jax.profiler.ProfileData: kernels, memsets, copies) and splits the time between
consecutive calls into every op's share and the time in which no op runs. Nsight Compute (scripts/ncu_point.sh) times each kernel alone;
this shows what the benchmark's figure holds around the kernels (session 41, H100: the hd128
causal 512 forward kernel alone 5% faster than FA3's, the two level in the benchmark).

A call is the stretch from one launch of the anchor kernel to the next; the anchor is the op
with the most GPU time (the attention kernel) unless --anchor names another (a regex).
"""

from __future__ import annotations

import argparse
import collections
import glob
import re
import statistics
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))


class Event(NamedTuple):
    start_ns: float
    duration_ns: float
    name: str


def gpu_events(xspace_path: str) -> list[Event]:
    """The GPU streams' events of a profile (one xplane.pb), in start order."""
    import jax

    events = []
    for plane in jax.profiler.ProfileData.from_file(xspace_path).planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if line.name.startswith("Stream"):  # not the per-op or per-module summary lines
                events += [Event(e.start_ns, e.duration_ns, e.name) for e in line.events]
    return sorted(events)


WRAPPERS = ("device_kernel", "enable_sm90_or_later", "enable_sm80_to_sm89")


def short_name(name: str) -> str:
    """A kernel's name without return type, template arguments, parameters or namespaces (of a
    CUTLASS `device_kernel<...>` wrapper, the kernel it wraps: FA3's are all such); other ops'
    names (XLA's fusions, "Memset (Device)") as they are."""
    if not (name.startswith("void ") or "::" in name or "<" in name):
        return name
    name = re.sub(r"^void ", "", name)
    while True:
        base, _, args = name.partition("<")
        base = re.split(r"\(", base, maxsplit=1)[0].rsplit("::", 1)[-1]
        if base in WRAPPERS and args:
            name = args
        else:
            return base or name


def split_calls(events: list[Event], anchor: str | None = None) -> dict:
    """Medians per call over the calls between the first and the last anchor launch: the period,
    the anchor kernel, every op by short name (summed within a call) and the idle time (no op
    on any stream). The first and last calls are left out (the loop's start and end)."""
    if anchor is None:
        total = collections.Counter()
        for e in events:
            total[short_name(e.name)] += e.duration_ns
        if not total:
            raise ValueError("no GPU events")
        busiest = total.most_common(1)[0][0]
        anchor_of = lambda e: short_name(e.name) == busiest  # noqa: E731
    else:
        pattern = re.compile(anchor)
        anchor_of = lambda e: bool(pattern.search(e.name))  # noqa: E731
    at = [i for i, e in enumerate(events) if anchor_of(e)]
    if len(at) < 4:
        raise ValueError(f"{len(at)} anchor launches: too few calls to split")
    period, idle, per_call = [], [], []
    for a, b in zip(at[1:-2], at[2:-1]):
        period.append(events[b].start_ns - events[a].start_ns)
        busy_until, gap, per_op = events[a].start_ns, 0.0, collections.Counter()
        for e in events[a:b]:
            gap += max(0.0, e.start_ns - busy_until)
            busy_until = max(busy_until, e.start_ns + e.duration_ns)
            per_op[short_name(e.name)] += e.duration_ns
        gap += max(0.0, events[b].start_ns - busy_until)
        idle.append(gap)
        per_call.append(per_op)
    us = lambda xs: statistics.median(xs) / 1e3  # noqa: E731
    names = set().union(*per_call)
    ops = {n: us([c.get(n, 0.0) for c in per_call]) for n in names}
    return {
        "calls": len(period),
        "anchor": short_name(events[at[0]].name),
        "period_us": us(period),
        "idle_us": us(idle),
        "ops_us": dict(sorted(ops.items(), key=lambda x: -x[1])),
    }


def render(split: dict, title: str) -> str:
    rows = [f"{title}: {split['calls']} calls, {split['period_us']:.1f} us per call "
            f"(anchor {split['anchor']})", "", "| op | us per call | share |", "|---|---|---|"]
    for name, t in list(split["ops_us"].items()) + [("(idle: no op running)", split["idle_us"])]:
        rows.append(f"| {name} | {t:.1f} | {t / split['period_us']:.1%} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    import jax
    from profile_point import add_point_arguments, point_loop

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_point_arguments(p, seqlen=512)
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--anchor", default=None, help="regex of the kernel that starts a call")
    args = p.parse_args(argv)
    run, _ = point_loop(p, args)
    jax.block_until_ready(run(args.calls))  # compile and warm up
    trace_dir = tempfile.mkdtemp(prefix="timeline_")
    with jax.profiler.trace(trace_dir):
        jax.block_until_ready(run(args.calls))
    events = gpu_events(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0])
    if not events:
        print(f"no GPU events in the profile ({jax.devices()[0].platform}): this needs a GPU")
        return 2
    title = (f"{args.impl} {args.direction} {args.dtype} hd{args.head_dim} s{args.seqlen} "
             f"causal={bool(args.causal)}")
    print(render(split_calls(events, args.anchor), title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
