"""Tests of scripts/sass/sass_summary.py on small SASS listings written here (no GPU, no nvcc).

Each listing is one kernel with one loop of the forward's shape: Q K^T and P V issued, then the
softmax; what differs is where the wait for every WGMMA (`WARPGROUP.DEPBAR.LE gsb0, 0x0`) sits
against the exponentials.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "sass"))
import sass_summary  # noqa: E402

GEMMS = ["QGMMA.64x192x32.F32.E4M3.E4M3 R24, gdesc[UR8], RZ, !UPT",
         "QGMMA.64x128x32.F32.E4M3.E4M3 R120, R184, gdesc[UR12], R120, gsb0",
         "WARPGROUP.DEPBAR.LE gsb0, 0x1"]
MAX = ["FMNMX.FTZ R4, R24, R25, !PT", "SHFL.BFLY PT, R5, R4, 0x1, 0x1f"]
EXPS = ["FFMA.FTZ R6, R24, UR4, -R4", "MUFU.EX2 R24, R6", "FFMA.FTZ R7, R25, UR4, -R4", "MUFU.EX2 R25, R7"]
WAIT = ["WARPGROUP.DEPBAR.LE gsb0, 0x0"]
CONVERT = ["F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C R184, R25, R24, RZ"]


def _write(path: Path, body):
    lines = ["\tcode for sm_90a", "\t\tFunction : _ZN3fa310fwd_kernelINS_9FwdTraitsIN7cutlass12float_e4m3_tELi128ELi128ELi192ELi2ELb1ELb0EEEEEvNT_6ParamsE"]
    addr = 0
    for text in body + ["@P0 BRA 0x0", "EXIT"]:
        lines.append(f"        /*{addr:04x}*/                   {text} ;")
        addr += 16
    path.write_text("\n".join(lines) + "\n")


def _summary(tmp_path, body, capsys, **kw):
    path = tmp_path / "k.sass"
    _write(path, body)
    sass_summary.main(str(path), **kw)
    return capsys.readouterr().out


def test_softmax_before_the_wait_overlaps(tmp_path, capsys):
    out = _summary(tmp_path, WAIT + CONVERT + GEMMS + MAX + EXPS, capsys)  # the rotated loop: wait at the top
    assert "fwd<float_e4m3_t, d=128, 128x192, stages=2, pp=1, banded=0>: HGMMA=0 QGMMA=2 LDL/STL=0" in out
    assert "2 exp2, softmax overlaps P V" in out


def test_wait_after_the_max(tmp_path, capsys):
    out = _summary(tmp_path, GEMMS + MAX + EXPS[:2] + WAIT + EXPS[2:] + CONVERT, capsys, mix=True)
    assert "softmax waits for P V after 1 of them" in out
    mix = dict(item.rsplit(" ", 1) for item in out.split("\n")[2].strip().split(", "))
    assert mix["FFMA"] == mix["MUFU"] == mix["QGMMA"] == "2" and mix["F2FP"] == "1" and mix["WARPGROUP"] == "2"


def test_wait_between_the_max_and_the_exponentials(tmp_path, capsys):
    out = _summary(tmp_path, GEMMS + MAX + WAIT + EXPS + CONVERT, capsys)  # FA3's bf16 loop
    assert "softmax waits for P V after the row max, before the exponentials" in out


def test_wait_before_the_max(tmp_path, capsys):
    out = _summary(tmp_path, GEMMS + WAIT + MAX + EXPS + CONVERT, capsys)
    assert "softmax waits for P V (no overlap)" in out


def test_match_keeps_the_named_kernels(tmp_path, capsys):
    assert _summary(tmp_path, GEMMS + MAX + EXPS, capsys, match="Li176E") == ""


def test_usage_instead_of_a_traceback(tmp_path):
    import subprocess
    script = Path(sass_summary.__file__)
    help_ = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True)
    assert help_.returncode == 0 and help_.stdout.startswith("Per-kernel summary")
    missing = subprocess.run([sys.executable, str(script), str(tmp_path / "none.sass")], capture_output=True, text=True)
    assert missing.returncode == 2 and "no file" in missing.stdout and not missing.stderr
