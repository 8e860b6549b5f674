"""Summarise an A/B of kernel build variants (scripts/ab_variants.sh's ab_tables.md files).

    python3 benchmarks/ab_compare.py OUT/ab_tables.md [more.md ...] [--out summary.md]

Each table in the files is one benchmark run of one variant (its tag, the variant's name, is in
the table's title): benchmarks/bench_attention.py's (jax_fa3 per direction) or bench_fp8.py's
(jax_fa3_fp8, direction "fp8"). A variant run more than once (AB_ABBA=1: base, x, x, base) gets the
geometric mean of its runs' jax_fa3 TFLOP/s per point, so a drift of the card over the call
cancels; the summary gives that mean per variant and its ratio to the first variant named.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

TITLE = re.compile(r"heads\*head_dim=\d+, (\S+) \(TFLOP/s")
ROW = re.compile(r"\| (fwd|bwd) \| (\d+) \| (no|yes) \| (\d+) \| ([\d.]+)")
# benchmarks/bench_fp8.py's rows: hd, causal, seqlen, then jax_fa3_fp8 first (direction "fp8").
ROW_FP8 = re.compile(r"\| (\d+) \| (no|yes) \| (\d+) \| ([\d.]+)")


def read_runs(paths: list[Path]) -> dict[str, list[dict[tuple, float]]]:
    """{variant: [run, ...]}, a run being {(dir, hd, causal, seqlen): jax_fa3 TFLOP/s}, in
    the order the variants first appear."""
    runs: dict[str, list[dict[tuple, float]]] = {}
    current = None
    for path in paths:
        for line in path.read_text().splitlines():
            if title := TITLE.search(line):
                current = {}
                runs.setdefault(title.group(1), []).append(current)
            elif (row := ROW.match(line)) and current is not None:
                d, hd, causal, seqlen, tflops = row.groups()
                current[(d, int(hd), causal, int(seqlen))] = float(tflops)
            elif (row := ROW_FP8.match(line)) and current is not None:
                hd, causal, seqlen, tflops = row.groups()
                current[("fp8", int(hd), causal, int(seqlen))] = float(tflops)
    return runs


def geo_mean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def summary(runs: dict[str, list[dict[tuple, float]]]) -> str:
    names = list(runs)
    base = names[0]
    points = sorted(set.intersection(*(set(r) for rs in runs.values() for r in rs)))
    cols = ["dir", "hd", "causal", "seqlen"] + [f"{n} (x{len(runs[n])})" for n in names]
    cols += [f"{n}/{base}" for n in names[1:]]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for point in points:
        means = {n: geo_mean([r[point] for r in runs[n]]) for n in names}
        row = [point[0], str(point[1]), point[2], str(point[3])]
        row += [f"{means[n]:.1f}" for n in names]
        row += [f"{means[n] / means[base]:.3f}" for n in names[1:]]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tables", nargs="+", type=Path)
    p.add_argument("--out", type=Path, help="also write the summary here")
    args = p.parse_args(argv)
    runs = read_runs(args.tables)
    if not runs:
        print("ab_compare: no benchmark tables found", file=sys.stderr)
        return 1
    text = summary(runs)
    print(text, end="")
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
