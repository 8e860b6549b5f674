"""Per-kernel summary of a cuobjdump -sass listing: HGMMA / QGMMA (FP8) counts, local-memory instructions
(LDL/STL: spills), the highest register used, and the order of WGMMA waits against the softmax
exponentials in each loop (a wait of P V before the exp2s means no intra-warpgroup overlap).
Usage: python3 sass_summary.py file.sass [--mix] [--match SUBSTRING]
--mix adds each loop's instruction mix (opcodes without modifiers, most frequent first; the static
body, so branches taken only on some blocks, e.g. softcap or the mask, count too); --match keeps
the kernels whose mangled name contains SUBSTRING (e.g. the tile, "Li192ELi2E")."""
import collections
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sass  # noqa: E402  (scripts/sass/sass.py)


def short(name):
    m = re.search(r"FwdTraitsIN7cutlass(\d+)(\w+?)ELi(\d+)ELi(\d+)ELi(\d+)ELi(\d+)ELb(\d)(?:ELb(\d))?", name)
    if not m:
        return name
    elem = m.group(2)[:m.group(1) and int(m.group(1))]
    return f"fwd<{elem}, d={m.group(3)}, {m.group(4)}x{m.group(5)}, stages={m.group(6)}, pp={m.group(7)}" + (
        f", banded={m.group(8)}>" if m.group(8) else ">")


def opcode(text):
    """The opcode without predicate and modifiers: "@!P0 MUFU.EX2 R1, R2" -> "MUFU"."""
    return re.sub(r"^@!?U?P\w+\s+", "", text).split(" ")[0].split(".")[0]


def main(path, mix=False, match=""):
    funcs = sass.functions(path)
    for f, ins in funcs.items():
        if match not in f:
            continue
        text = [i for _, i in ins]
        hg = sum("HGMMA" in t for t in text)
        qg = sum("QGMMA" in t for t in text)
        local = sum(bool(re.search(r"\b(LDL|STL)\b", t)) for t in text)
        regs = [int(r) for t in text for r in re.findall(r"\bR(\d+)\b", t)]
        # Innermost loops with WGMMA (backward branches whose body holds no other loop): does a
        # "WARPGROUP.DEPBAR.LE gsb0, 0x0" (wait for every WGMMA) sit between the last HGMMA
        # issued and the exp2s of the softmax? Then the softmax waits for P V: no overlap.
        spans = []
        for addr, t in ins:
            m = re.search(r"BRA (?:\w+, )?0x([0-9a-f]+)", t)
            if m and int(m.group(1), 16) < addr:
                spans.append((int(m.group(1), 16), addr))
        loops = []
        for lo, hi in spans:
            if any(lo <= a and b <= hi and (a, b) != (lo, hi) for a, b in spans):
                continue
            body = [s for a, s in ins if lo <= a <= hi]
            last_mma = max((k for k, s in enumerate(body) if "HGMMA" in s or "QGMMA" in s), default=None)
            if last_mma is None:
                continue
            ex2 = [k for k, s in enumerate(body) if "MUFU.EX2" in s and k > last_mma]
            if not ex2:
                continue
            # The first wait for every WGMMA after the GEMMs' issue: how many exp2 precede it.
            wait = next((k for k in range(last_mma, len(body)) if "DEPBAR.LE gsb0, 0x0" in body[k]), None)
            before = len(ex2) if wait is None else sum(k < wait for k in ex2)
            if before == len(ex2):
                how = "overlaps P V"
            elif before == 0 and any("FMNMX" in t for t in body[last_mma:wait]):
                how = "waits for P V after the row max, before the exponentials"
            elif before == 0:
                how = "waits for P V (no overlap)"
            else:
                how = f"waits for P V after {before} of them (the max overlaps it, the rest does not)"
            line = f"[{lo:#x}-{hi:#x}]: {len(body)} instructions, {len(ex2)} exp2, softmax {how}"
            if mix:
                counts = collections.Counter(opcode(t) for t in body)
                line += "\n      " + ", ".join(f"{op} {n}" for op, n in counts.most_common(16))
            loops.append(line)
        print(f"{short(f)}: HGMMA={hg}" + (f" QGMMA={qg}" if qg else "") +
              f" LDL/STL={local} maxreg=R{max(regs) if regs else 0}")
        for l in loops:
            print("   loop", l)


if __name__ == "__main__":
    args = sys.argv[1:]
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if args else 2)
    if not Path(args[0]).is_file():
        print(f"sass_summary: no file {args[0]}\n\n{__doc__}")
        sys.exit(2)
    match = args[args.index("--match") + 1] if "--match" in args else ""
    main(args[0], mix="--mix" in args, match=match)
