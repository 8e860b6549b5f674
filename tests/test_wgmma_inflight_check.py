"""Tests of wgmma_inflight_check.py on small SASS listings written here (no GPU, no nvcc).

    pytest tests/test_wgmma_inflight_check.py

Each listing is the shape of a case seen in the forward kernels, cut down to a few
instructions. With FA3_SASS=<cuobjdump listing, e.g. the forward with the cross-tile
consumer> it also removes the kernel's real waits one at a time and checks that the hazard each
removal creates is reported (a planted hazard in real code).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "sass"))
import wgmma_inflight_check as chk  # noqa: E402

# 64x128 P V group: accumulator R24-R87, A operand R152-R155 (+ R156-R159 for the second k-step).
PV = ["HGMMA.64x128x16.F32.BF16 R24, R152, gdesc[UR16].tnspB, R24, UP0",
      "HGMMA.64x128x16.F32.BF16 R24, R156, gdesc[UR16].tnspB, R24, gsb0"]
QK = ["HGMMA.64x128x16.F32.BF16 R88, gdesc[UR16], RZ, !UPT",
      "HGMMA.64x128x16.F32.BF16 R88, gdesc[UR16], R88, gsb0"]


def listing(lines):
    """[(addr, text)] at 16-byte steps; `BRA @label` / `@P0 BRA @label` jump to the line
    `label:` (labels take no address)."""
    labels, out, addr = {}, [], 0
    for line in lines:
        if line.endswith(":"):
            labels[line[:-1]] = addr
        else:
            out.append((addr, line))
            addr += 16
    return [(a, re.sub(r"@(\w+)$", lambda m: hex(labels[m.group(1)]), t)) for a, t in out]


def issues(lines):
    found, _ = chk.analyse(listing(lines))
    return found


def addr_of(lines, text):
    return next(a for a, t in listing(lines) if t == text)


def test_straight_line():
    code = ["WARPGROUP.ARRIVE", *PV, "FADD.FTZ R30, R30, R2", "WARPGROUP.DEPBAR.LE gsb0, 0x0",
            "FADD.FTZ R31, R31, R2", "EXIT"]
    found = issues(code)
    assert list(found) == [addr_of(code, "FADD.FTZ R30, R30, R2")], found


def test_empty_group_with_rz_accumulator():
    # ptxas emits an empty group (RZ accumulator, no descriptor); it writes no register, and a
    # read after it is no hazard. The checker used to stop on it (min() of no registers).
    code = ["HGMMA.64x8x16.F16 RZ, gdesc[URZ], RZ, !UPT, gsb0", "FADD.FTZ R30, R30, R2",
            "WARPGROUP.DEPBAR.LE gsb0, 0x0", "EXIT"]
    assert not issues(code)


def test_wait_keeps_the_newest_groups():
    # P V, then Q K^T; wait_group 1 retires P V only: O is free, S is not.
    code = [*PV, *QK, "WARPGROUP.DEPBAR.LE gsb0, 0x1", "FMUL.FTZ R24, R24, R3",
            "FMNMX.FTZ R4, R88, R89, !PT", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "EXIT"]
    found = issues(code)
    assert list(found) == [addr_of(code, "FMNMX.FTZ R4, R88, R89, !PT")], found


def test_a_operand_write_and_wide_destinations():
    # CS2R writes two registers (R154, R155: P's A fragment); reading A in flight is fine.
    code = [*PV, "F2FP.BF16.F32.PACK_AB R2, R153, R152", "CS2R R154, SRZ",
            "WARPGROUP.DEPBAR.LE gsb0, 0x0", "EXIT"]
    found = issues(code)
    assert list(found) == [addr_of(code, "CS2R R154, SRZ")], found
    code = [*PV, "LDC.64 R86, c[0x0][0x6c8]", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "EXIT"]
    assert list(issues(code)) == [addr_of(code, "LDC.64 R86, c[0x0][0x6c8]")]
    code = [*PV, "STG.E desc[UR14][R86.64], R2", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "EXIT"]
    assert list(issues(code)) == [addr_of(code, "STG.E desc[UR14][R86.64], R2")]


def test_hazard_across_the_back_edge():
    # The cross-tile loop: the final P V is issued at the bottom and waited for in the next
    # iteration. A write of O at the loop head, before that wait, is a race that a
    # straight-line scan never sees (the head comes first in address order).
    code = ["head:", "IMAD.MOV.U32 R40, RZ, RZ, RZ", "ISETP.NE.AND P0, PT, R2, RZ, PT",
            "WARPGROUP.DEPBAR.LE gsb0, 0x0", "@!P0 EXIT", *PV, "BRA @head"]
    found = issues(code)
    assert list(found) == [addr_of(code, "IMAD.MOV.U32 R40, RZ, RZ, RZ")], found


def test_code_after_an_unconditional_branch_is_not_reached_with_the_group():
    # The 219 reports of session 5: the consumer's tile loop ends with its final P V in flight
    # and `BRA` back to its head; the producer's code is laid out after that branch and uses
    # R24-R32 (O's registers in the consumer). Only the entry's other branch reaches it, with
    # nothing in flight.
    code = ["ISETP.NE.AND P0, PT, R0, RZ, PT", "@!P0 BRA @producer",
            "head:", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "FMUL.FTZ R24, R24, R3", *PV, "BRA @head",
            "producer:", "IMAD R25, R9, 0x8, R17", "SYNCS.PHASECHK.TRANS64 P0, [R30+URZ], R29", "EXIT"]
    assert issues(code) == {}


def test_out_of_line_retry_block_is_checked_with_its_callers_state():
    # mbarrier try-wait loops are moved out of line; their state is the state at the branch.
    code = [*PV, "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [R8+URZ+0x38000], R7", "@!P1 BRA @retry",
            "back:", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "EXIT",
            "retry:", "SYNCS.PHASECHK.TRANS64 P1, [R8+URZ+0x38000], R30", "@!P1 BRA @retry", "BRA @back"]
    found = issues(code)
    assert list(found) == [addr_of(code, "SYNCS.PHASECHK.TRANS64 P1, [R8+URZ+0x38000], R30")], found


def test_join_of_paths_with_and_without_the_group():
    # One path waits, the other does not: after the join the group may be in flight.
    code = [*PV, "@P0 BRA @skip", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "skip:",
            "FADD.FTZ R2, R87, R2", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "EXIT"]
    found = issues(code)
    assert list(found) == [addr_of(code, "FADD.FTZ R2, R87, R2")], found


def test_exit_with_a_group_in_flight():
    code = [*PV, "@P0 EXIT", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "EXIT"]
    found = issues(code)
    a = addr_of(code, "@P0 EXIT")
    assert list(found) == [a] and "exits" in found[a][0], found


def test_chain_onto_one_of_two_accumulators():
    # One commit group holding two accumulators (as the split-D hd256 backward's dK/dV GEMMs):
    # an HGMMA chained onto one of them (the same registers) is ordered by the hardware; one
    # whose accumulator covers part of an in-flight one is not.
    two = ["HGMMA.64x64x16.F32.BF16 R24, gdesc[UR16], R24", "HGMMA.64x64x16.F32.BF16 R56, gdesc[UR20], R56, gsb0"]
    code = [*two, "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR24], R24, gsb0", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "EXIT"]
    assert issues(code) == {}
    code = [*two, "HGMMA.64x64x16.F32.BF16 R40, gdesc[UR24], R40, gsb0", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "EXIT"]
    found = issues(code)
    assert list(found) == [addr_of(code, "HGMMA.64x64x16.F32.BF16 R40, gdesc[UR24], R40, gsb0")], found


def test_planted_in_real_sass():
    """Remove each WGMMA wait of a real kernel in turn: the checker must then report a hazard
    (every wait that retires a group in these kernels protects registers used before the next
    wait, or the kernel's exit)."""
    path = os.environ.get("FA3_SASS")
    if not path:
        import pytest
        pytest.skip("needs FA3_SASS=<cuobjdump -sass listing> (scripts/sass_digest.sh writes OUT/<dir>_hd<d>.sass)")
    import sass
    for name, ins in sass.functions(path).items():
        if not any(t.startswith("HGMMA") for _, t in ins):
            continue
        found, states = chk.analyse(ins)
        assert found == {}, (name[:80], found)
        # The waits that retire a group on some path (a wait with nothing older than its
        # count in flight is a no-op; removing it changes nothing).
        waits = [k for k, (_, t) in enumerate(ins) if t.startswith("WARPGROUP.DEPBAR")
                 and any(len(st) > int(t.split(",")[-1], 16) for st, _ in states[k])]
        smem_guards = 0
        for k in waits:
            planted = ins[:k] + [(ins[k][0], "NOP")] + ins[k + 1:]
            found, _ = chk.analyse(planted)
            if not found:
                # A wait may guard shared memory instead (the GEMM's operands), which a register
                # check cannot see: then a stage release (mbarrier or named-barrier arrive)
                # follows it before the next wait, in address order.
                nxt = next((j for j in range(k + 1, len(ins)) if ins[j][1].startswith("WARPGROUP.DEPBAR")), len(ins))
                assert any(re.search(r"SYNCS\.ARRIVE|BAR\.(ARV|SYNC)", t) for _, t in ins[k + 1:nxt]), \
                    f"{name[:80]}: removing the wait at {ins[k][0]:#06x} went unreported"
                smem_guards += 1
        print(f"  {name[:90]}: clean; of its {len(waits)} waits, each removed is reported "
              f"({smem_guards} guard shared memory: a release follows them)")


if __name__ == "__main__":
    import pytest
    for f in [v for k, v in sorted(globals().items()) if k.startswith("test_")]:
        try:
            f()
            print(f"{f.__name__}: ok")
        except pytest.skip.Exception as why:
            print(f"{f.__name__}: skipped ({why})")
