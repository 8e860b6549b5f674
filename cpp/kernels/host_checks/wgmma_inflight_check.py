"""Flag register hazards around in-flight WGMMAs in SASS (no GPU needed).

    cuobjdump -sass kernel.cubin > kernel.sass
    python3 wgmma_inflight_check.py kernel.sass [KERNEL_NAME_REGEX]

A WGMMA (HGMMA in SASS) reads its register A operand and reads/writes its accumulator
asynchronously until a `WARPGROUP.DEPBAR.LE gsb0, k` retires its commit group. Source code
keeps these registers untouched only by convention (and the compiler's goodwill); this scan
reports any instruction that, while a group is in flight, writes an A-operand register or reads
or writes an accumulator register. Straight-line scan in address order: a hazard across a loop
back-edge is not seen. Exit status 1 if anything is found.
"""

from __future__ import annotations

import re
import sys

import sass

_REG = re.compile(r"-?\|?R(\d+)\|?(?:\.\w+)*")
_NO_DEST = ("ST", "RED", "ATOM", "SYNCS", "BAR", "BRA", "SHFL", "EXIT", "RET", "CALL")


def _reg(token: str):
    m = _REG.fullmatch(token.strip().strip("[]").split()[0]) if token.strip() else None
    return int(m.group(1)) if m else None


def _width(op: str) -> int:
    """Registers written by a destination operand (vector loads/moves)."""
    if ".128" in op:
        return 4
    return 2 if ".64" in op else 1


def check_function(name: str, instructions) -> int:
    in_flight, group, issues = [], None, 0  # committed groups (oldest first), open group
    for addr, text in instructions:
        text = re.sub(r"^@!?U?P\w+\s+", "", text)  # drop the predicate guard
        op, _, rest = text.partition(" ")
        operands = rest.split(",")
        if op.startswith("HGMMA"):
            acc, a = _reg(operands[0]), _reg(operands[1])
            group = group or {"A": set(), "C": set()}
            if a is not None:
                group["A"].update(range(a, a + 4))  # a 64xNx16 A fragment: 4 registers
            n = int(re.search(r"64x(\d+)x", op).group(1))
            group["C"].update(range(acc, acc + n // 2))  # N/2 fp32 accumulators per thread
            if "gsb0" in text:
                in_flight.append(group)
                group = None
            continue
        if op.startswith("WARPGROUP.DEPBAR"):
            keep = int(operands[-1].strip(), 16)
            in_flight = in_flight[len(in_flight) - keep:] if keep else []
            continue
        if op.startswith("WARPGROUP") or not in_flight:
            continue
        live_a = set().union(*(g["A"] for g in in_flight))
        live_c = set().union(*(g["C"] for g in in_flight))
        sources = operands if op.startswith(_NO_DEST) else operands[1:]
        if not op.startswith(_NO_DEST) and operands and operands[0].strip():
            dest = _reg(operands[0])
            if dest is not None:
                written = set(range(dest, dest + _width(op)))
                if written & live_a:
                    print(f"{name[:60]} {addr:#06x}: writes an A operand in flight: {text}")
                    issues += 1
                if written & live_c:
                    print(f"{name[:60]} {addr:#06x}: writes an accumulator in flight: {text}")
                    issues += 1
        if any(_reg(s) in live_c for s in sources if _reg(s) is not None):
            print(f"{name[:60]} {addr:#06x}: reads an accumulator in flight: {text}")
            issues += 1
    return issues


def main(argv) -> int:
    pattern = argv[2] if len(argv) > 2 else "."
    total = 0
    for name, instructions in sass.functions(argv[1]).items():
        if re.search(pattern, name) and any(t.startswith("HGMMA") for _, t in instructions):
            issues = check_function(name, instructions)
            print(f"{name[:100]}: {issues} issue(s)")
            total += issues
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
