"""Where a kernel's warps stall, per SASS instruction, from Nsight Compute's source page:

    ncu -i REPORT.ncu-rep --page source --csv --print-source sass > source.csv
    python3 scripts/ncu_source_summary.py source.csv [--top 30] [--context 6]

(`scripts/ncu_point.sh` with NCU_SOURCE=1 does both on the device and keeps only this summary.)
Prints the stall reasons summed over the kernel, the instructions with the most stall samples
(each with its two main reasons and a few instructions before it, since a stall is charged to
the instruction that waits, often the one after a barrier or a load), and the instruction mix
of the hottest loop (the instructions executed most often, i.e. one trip of the main loop).
Session 23 found the FP8 V transposer's 64-bit generic loads this way.
"""

from __future__ import annotations

import argparse
import collections
import csv
import re
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def _num(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def read(path: str):
    """(header index, instruction rows) of the source page's CSV (the first kernel in it)."""
    rows = list(csv.reader(open(path, newline="")))
    start = next((i for i, r in enumerate(rows) if r and r[0] == "Address"), None)
    if start is None:  # e.g. ncu matched no kernel (its log then says "No kernels were profiled")
        raise SystemExit(f"{path}: no source page (no 'Address' header row): was any kernel profiled?")
    header = {name: i for i, name in enumerate(rows[start])}
    body = []
    for r in rows[start + 1:]:
        if not r or r[0] == "Address" or not r[0].startswith("0x"):
            break
        body.append(r)
    return header, body


def opcode(source: str) -> str:
    m = re.match(r"\s*(@!?U?P\w+\s+)?([A-Z0-9_]+)", source)
    return m.group(2) if m else "?"


def summary(header, body, top: int = 30, context: int = 6) -> str:
    stalls = [n for n in header if n.startswith("stall_") and "(Not Issued)" not in n]
    total = sum(_num(r[header[SAMPLES]]) for r in body) or 1.0
    out = [f"{len(body)} instructions, {total:.0f} stall samples", "", "## stall reasons"]
    sums = {s: sum(_num(r[header[s]]) for r in body) for s in stalls}
    for s, v in sorted(sums.items(), key=lambda kv: -kv[1])[:12]:
        out.append(f"{s:28s} {v:10.0f}  {v / total:6.1%}")
    # Samples that no stall_* column of this CSV names (a reason the source page does not break
    # out, e.g. waits on the tensor pipe): shown, so that a hot instruction's listed reasons are
    # not taken for all of its samples.
    other = total - sum(sums.values())
    if other > 0.01 * total:
        out.append(f"{'(in no stall_* column)':28s} {other:10.0f}  {other / total:6.1%}")
    out += ["", f"## the {top} instructions with the most samples (and what precedes them)"]
    hot = sorted(range(len(body)), key=lambda i: -_num(body[i][header[SAMPLES]]))[:top]
    for i in sorted(hot):
        r = body[i]
        why = sorted(((_num(r[header[s]]), s) for s in stalls), reverse=True)
        reasons = ", ".join(f"{s[6:]} {v:.0f}" for v, s in why[:2] if v)
        unnamed = _num(r[header[SAMPLES]]) - sum(v for v, _ in why)
        if unnamed > 0.5 * _num(r[header[SAMPLES]]):
            reasons += f"; {unnamed:.0f} in no stall_* column"
        out.append(f"-- #{i} {r[0]}  {_num(r[header[SAMPLES]]):.0f} samples ({reasons})")
        for j in range(max(0, i - context), i + 1):
            q = body[j]
            out.append(f"   {_num(q[header[SAMPLES]]):8.0f} {_num(q[header[EXECUTED]]):12.0f}  {q[1].strip()[:90]}")
    counts = collections.Counter(_num(r[header[EXECUTED]]) for r in body)
    trips = max((c for c in counts if c > 0), key=lambda c: (counts[c] * c, c), default=0)
    loop = [r for r in body if _num(r[header[EXECUTED]]) == trips]
    mix = collections.Counter(opcode(r[1]) for r in loop)
    out += ["", f"## hottest loop: {len(loop)} instructions executed {trips:.0f} times each",
            "   " + ", ".join(f"{op} {n}" for op, n in mix.most_common(24))]
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--context", type=int, default=6)
    args = p.parse_args(argv)
    header, body = read(args.csv)
    print(summary(header, body, args.top, args.context))
    return 0


if __name__ == "__main__":
    sys.exit(main())
