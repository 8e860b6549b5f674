"""Flag register hazards around in-flight WGMMAs in SASS (no GPU needed).

    cuobjdump -sass kernel.cubin > kernel.sass
    python3 wgmma_inflight_check.py kernel.sass [KERNEL_NAME_REGEX] [--trace LO HI]

A WGMMA (HGMMA in SASS) reads its register A operand and reads/writes its accumulator
asynchronously until a `WARPGROUP.DEPBAR.LE gsb0, k` retires its commit group (the HGMMA that
carries `gsb0` closes a group; the wait keeps the newest k groups in flight). Source code keeps
these registers untouched only by convention (and the compiler's goodwill); this check reports
any instruction that, while a group may be in flight, writes an A-operand register or reads or
writes an accumulator register, and any EXIT reached with a group in flight.

It follows the control flow: the in-flight groups are propagated along every branch edge of
the function (fall-through, branch targets, loop back-edges) to a fixed point, as the set of
possible in-flight stacks per instruction (a may-analysis over all paths: a hazard on any path
is reported). So a group left in flight at a loop back-edge is seen at the loop head, and code
that only other paths reach (e.g. the producer warpgroup's code laid out after the consumers'
loop, or out-of-line barrier retry blocks) is checked with the state of the paths that really
reach it. Not modelled: predicate correlation between branches (an infeasible path can only add
reports, never hide one) and indirect branches / calls (reported as an error).
Exit status 1 if anything is found. `--trace LO HI` prints the possible in-flight groups
(named by their first HGMMA's address) at each instruction in [LO, HI].
"""

from __future__ import annotations

import re
import sys

import sass

# A general register (not UR, SR_, RZ), optionally negated / absolute, with suffixes.
_REG = re.compile(r"(?<![\w.])-?\|?R(\d+)((?:\.\w+)*)\|?")
_GUARD = re.compile(r"^@(!?)(U?P\w+)\s+")
_NO_DEST = ("ST", "RED", "SYNCS", "BAR", "BRA", "EXIT", "RET", "CALL", "WARPSYNC", "NOP", "YIELD",
            "NANOSLEEP", "FENCE", "MEMBAR", "BSSY", "BSYNC", "UTMA", "CCTL", "ERRBAR", "DEPBAR")
_PRED_FIRST = ("SHFL", "ATOM", "ATOMG", "ATOMS")  # `SHFL.BFLY PT, R6, ...`: the R is the dest
_MAX_DEPTH = 16  # in-flight groups on one path: more means an unbounded chain (reported)


def _split(rest: str) -> list[str]:
    """Operands, split at commas outside brackets."""
    out, depth, cur = [], 0, ""
    for ch in rest:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def _regs(operand: str, width: int = 1) -> set[int]:
    """Registers an operand names: `R2.64` (64-bit address) is R2 and R3; a plain register
    operand of a 64/128-bit instruction is `width` registers."""
    regs = set()
    for m in _REG.finditer(operand):
        r, suffix = int(m.group(1)), m.group(2)
        w = 2 if ".64" in suffix else (width if "[" not in operand else 1)
        regs.update(range(r, r + w))
    return regs


class Instr:
    def __init__(self, addr: int, text: str):
        self.addr, self.text = addr, text
        g = _GUARD.match(text)
        self.guarded = bool(g) and not (g.group(1) == "" and g.group(2) in ("PT", "UPT"))
        body = text[g.end():] if g else text
        self.op, _, rest = body.partition(" ")
        self.operands = _split(rest)
        base = self.op.split(".")[0]
        self.hgmma = self.op.startswith(("HGMMA", "QGMMA", "IGMMA", "BGMMA"))
        self.depbar = self.op.startswith("WARPGROUP.DEPBAR")
        self.branch = base in ("BRA", "BRX", "JMP", "JMX", "CALL", "RET", "EXIT")
        width = 4 if ".128" in self.op else (2 if ".64" in self.op else 1)
        # Registers written (as a set) and all registers touched.
        self.written: set[int] = set()
        self.touched: set[int] = set()
        for i, o in enumerate(self.operands):
            self.touched |= _regs(o, width)
        if self.hgmma:
            acc = _regs(self.operands[0])
            n = int(re.search(r"x(\d+)x", self.op).group(1))
            per_reg = 4 if re.search(r"x\d+\.F16", self.op) else 2  # f16 accumulators: 2 per register
            # An RZ accumulator (ptxas emits "HGMMA.64x8x16.F16 RZ, gdesc[URZ], RZ, !UPT, gsb0"
            # as an empty group) writes no register.
            self.acc = set(range(min(acc), min(acc) + n * 2 // per_reg // 2)) if acc else set()  # 64 x N per 128 threads
            a = _regs(self.operands[1]) if self.operands[1].startswith("R") else set()
            self.a = set(range(min(a), min(a) + 4)) if a else set()  # 64xNxK A fragment: 4 regs
            self.commits = "gsb0" in text
            self.touched = self.acc | self.a
            self.written = set(self.acc)
        elif self.depbar:
            self.keep = int(self.operands[-1], 16)
        elif not self.op.startswith(_NO_DEST) and not self.op.startswith("U"):
            dest = None
            if base in _PRED_FIRST and len(self.operands) > 1:
                dest = self.operands[1]
            elif self.operands and re.fullmatch(r"R\d+(\.\w+)*", self.operands[0]):
                dest = self.operands[0]
            if dest is not None:
                dw = 2 if base == "CS2R" and ".32" not in self.op else width
                if self.op.startswith("IMAD.WIDE"):
                    dw = 2
                    self.touched |= _regs(self.operands[-1], 2)  # the 64-bit addend
                r = min(_regs(dest)) if _regs(dest) else None
                if r is not None:
                    self.written = set(range(r, r + dw))
                    self.touched |= self.written

    def targets(self) -> list[int]:
        m = re.search(r"0x([0-9a-f]+)\s*$", self.text)
        return [int(m.group(1), 16)] if m and self.op.split(".")[0] == "BRA" else []

    def falls_through(self) -> bool:
        base = self.op.split(".")[0]
        if base in ("EXIT", "RET") or (base == "BRA" and len(self.operands) == 1):
            return self.guarded  # unconditional BRA / EXIT / RET end the block
        return True


def analyse(instructions, trace=None):
    """Returns ({addr: [message, ...]}, per-instruction states). A state is (committed groups,
    oldest first, each a tuple of HGMMA addresses; the open group's HGMMA addresses)."""
    ins = [Instr(a, t) for a, t in instructions]
    index = {x.addr: i for i, x in enumerate(ins)}
    succ = []
    for i, x in enumerate(ins):
        base = x.op.split(".")[0]
        if base in ("BRX", "JMX", "JMP", "CALL") or (base == "RET" and x.guarded):
            raise ValueError(f"{x.addr:#06x}: control flow not modelled: {x.text}")
        s = [index[t] for t in x.targets()]
        if x.falls_through() and i + 1 < len(ins):
            s.append(i + 1)
        succ.append(s)
    by_addr = {x.addr: x for x in ins}

    def transfer(x: Instr, state):
        stack, open_ = state
        if x.hgmma:
            open_ = open_ + (x.addr,)
            if x.commits:
                stack, open_ = stack + (open_,), ()
            out = {(stack, open_)}
        elif x.depbar:
            out = {(stack[len(stack) - x.keep:] if x.keep else (), open_)}
        else:
            return {state}
        if len(stack) > _MAX_DEPTH:
            raise ValueError(f"{x.addr:#06x}: more than {_MAX_DEPTH} WGMMA groups in flight")
        return out | ({state} if x.guarded else set())

    states = [set() for _ in ins]
    states[0].add(((), ()))
    work = [0]
    while work:
        i = work.pop()
        out = set()
        for st in states[i]:
            out |= transfer(ins[i], st)
        for j in succ[i]:
            if not out <= states[j]:
                states[j] |= out
                work.append(j)

    issues: dict[int, list[str]] = {}
    for i, x in enumerate(ins):
        for stack, open_ in states[i]:
            groups = list(stack) + ([open_] if open_ else [])
            if not groups:
                continue
            # An HGMMA chained onto an in-flight HGMMA's accumulator (the very same registers)
            # is ordered by the hardware, also when the group holds other accumulators too; its
            # A operand or accumulator overlapping another in-flight HGMMA's registers is not.
            for g in groups:
                acc = set().union(*(by_addr[a].acc for a in g))
                a_regs = set().union(*(by_addr[a].a for a in g))
                name = f"group@{g[0]:#06x}"
                if x.hgmma:
                    if x.addr in g:
                        continue
                    bad = set()
                    for m in (by_addr[a] for a in g):
                        bad |= (x.written & m.a) | (x.a & m.acc)
                        if x.acc != m.acc:
                            bad |= x.acc & m.acc
                    if bad:
                        issues.setdefault(x.addr, []).append(f"HGMMA overlaps {name} in flight (R{min(bad)})")
                    continue
                if x.written & a_regs:
                    issues.setdefault(x.addr, []).append(f"writes A operand R{min(x.written & a_regs)} of {name} in flight")
                if x.touched & acc:
                    issues.setdefault(x.addr, []).append(f"touches accumulator R{min(x.touched & acc)} of {name} in flight")
            if x.op.split(".")[0] == "EXIT":
                issues.setdefault(x.addr, []).append(f"exits with {len(groups)} group(s) in flight")
    if trace:
        lo, hi = trace
        for i, x in enumerate(ins):
            if lo <= x.addr <= hi:
                gs = sorted({"+".join(f"{g[0]:#x}" for g in s) + ("|open" if o else "") or "-" for s, o in states[i]})
                print(f"{x.addr:#06x} {'/'.join(gs) if states[i] else 'unreached':24s} {x.text[:90]}")
    return {a: sorted(set(m)) for a, m in issues.items()}, states


def check_function(name: str, instructions, trace=None) -> int:
    issues, _ = analyse(instructions, trace)
    texts = dict(instructions)
    for addr in sorted(issues):
        for msg in issues[addr]:
            print(f"{name[:60]} {addr:#06x}: {msg}: {texts[addr]}")
    return sum(len(m) for m in issues.values())


def main(argv) -> int:
    trace = None
    if "--trace" in argv:
        k = argv.index("--trace")
        trace = (int(argv[k + 1], 16), int(argv[k + 2], 16))
        argv = argv[:k] + argv[k + 3:]
    pattern = argv[2] if len(argv) > 2 else "."
    total = 0
    for name, instructions in sass.functions(argv[1]).items():
        if re.search(pattern, name) and any(t.startswith("HGMMA") or "GMMA" in t.split(" ")[0] for _, t in instructions):
            issues = check_function(name, instructions, trace)
            print(f"{name[:100]}: {issues} issue(s)")
            total += issues
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
