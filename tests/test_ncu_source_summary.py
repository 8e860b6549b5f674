"""scripts/ncu_source_summary.py on a small source page in Nsight Compute's CSV form."""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("ncu_source_summary",
                                              ROOT / "scripts" / "ncu_source_summary.py")
summary_mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(summary_mod)

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)",
          "Warp Stall Sampling (Not-issued Samples)", "Instructions Executed", "stall_barrier",
          "stall_long_sb", "stall_wait", "stall_barrier (Not Issued)"]
ROWS = [  # address, source, samples, executed, barrier, long_sb, wait
    ("0x10", "MOV R1, c[0x0][0x28]", 3, 1, 0, 0, 3),
    ("0x20", "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2", 10, 1000, 0, 0, 10),
    ("0x30", "@!P0  BRA 0x80", 500, 1000, 0, 495, 5),
    ("0x40", "MUFU.EX2 R4, R4", 40, 1000, 0, 0, 40),
    ("0x50", "BAR.SYNC.DEFER_BLOCKING 0x9, 0x100", 5, 1000, 5, 0, 0),
    ("0x60", "UMOV UR15, 0x40000040", 300, 1000, 290, 0, 10),
    ("0x68", "HGMMA.64x128x16.F32.BF16 R88, R228, gdesc[UR16], R88", 200, 1000, 0, 0, 20),
    ("0x70", "EXIT", 1, 1, 0, 0, 1),
]


def _write(path: Path):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "void fa3::fwd_kernel<...>(T1::Params)"])
        w.writerow(HEADER)
        for a, src, samples, executed, bar, lsb, wait in ROWS:
            w.writerow([a, src, f"{samples:,}", samples, f"{executed:,}", bar, lsb, wait, 0])


def test_summary_names_the_stalls_and_the_loop(tmp_path):
    path = tmp_path / "source.csv"
    _write(path)
    header, body = summary_mod.read(str(path))
    assert len(body) == len(ROWS)
    text = summary_mod.summary(header, body, top=2, context=1)
    assert text.startswith("8 instructions, 1059 stall samples")
    reasons = text.split("## stall reasons")[1].split("##")[0].split()
    assert reasons[:2] == ["stall_long_sb", "495"] and "stall_barrier" in reasons
    # 180 of the HGMMA's 200 samples are in no reason column: said, overall and for it.
    assert "(in no stall_* column)              180   17.0%" in text
    # The two hottest, each after the instruction before it.
    assert "-- #2 0x30  500 samples (long_sb 495, wait 5)" in text
    assert "-- #5 0x60  300 samples (barrier 290, wait 10)" in text
    assert text.index("BAR.SYNC") < text.index("UMOV UR15")
    # The loop: the six instructions executed 1000 times each.
    assert "hottest loop: 6 instructions executed 1000 times each" in text
    assert "SYNCS 1, BRA 1, MUFU 1, BAR 1, UMOV 1, HGMMA 1" in text
    text3 = summary_mod.summary(header, body, top=3, context=0)
    assert "-- #6 0x68  200 samples (wait 20; 180 in no stall_* column)" in text3


def test_no_source_page_is_a_clear_error(tmp_path):
    path = tmp_path / "empty.csv"
    path.write_text("==WARNING== No kernels were profiled.\n")
    try:
        summary_mod.read(str(path))
    except SystemExit as e:
        assert "was any kernel profiled" in str(e)
    else:
        raise AssertionError("no error for a CSV without a source page")
