"""scripts/tests_not_reached.py and the shard list tests/conftest.py writes for it: the tests a
sharded device run (scripts/gpu_cycle.sh) selected but never reached when a shard was cut."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("tests_not_reached", ROOT / "scripts" / "tests_not_reached.py")
not_reached_mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(not_reached_mod)


def test_a_cut_shard_names_its_unreported_tests(tmp_path):
    # Shard 0 finished; shard 1 was cut inside its second test (the line has no result).
    (tmp_path / "shard_0.ids").write_text("tests/a.py::test_x[1]\ntests/a.py::test_y\n")
    (tmp_path / "shard_0.log").write_text(
        "tests/a.py::test_x[1] PASSED      [ 50%]\ntests/a.py::test_y SKIPPED (no GPU) [100%]\n")
    (tmp_path / "shard_1.ids").write_text("tests/a.py::test_x[2]\ntests/b.py::test_z[8-256]\n"
                                          "tests/b.py::test_w\n")
    (tmp_path / "shard_1.log").write_text("tests/a.py::test_x[2] FAILED      [ 33%]\n"
                                          "tests/b.py::test_z[8-256] ")
    assert not_reached_mod.not_reached(tmp_path, 2) == ["tests/b.py::test_z[8-256]", "tests/b.py::test_w"]
    assert not_reached_mod.not_reached(tmp_path, 1) == []
    # A shard without its list (it died before collection ended) is skipped, not an error.
    assert not_reached_mod.not_reached(tmp_path, 3) == ["tests/b.py::test_z[8-256]", "tests/b.py::test_w"]


def test_node_ids_with_spaces_count_as_reported(tmp_path):
    (tmp_path / "shard_0.ids").write_text("tests/f.py::test_options[long band causal]\n"
                                          "tests/f.py::test_options[empty rows]\n")
    (tmp_path / "shard_0.log").write_text("tests/f.py::test_options[long band causal] PASSED     [ 50%]\n"
                                          "tests/f.py::test_options[empty rows] ")
    assert not_reached_mod.not_reached(tmp_path, 1) == ["tests/f.py::test_options[empty rows]"]


def test_conftest_writes_the_shard_list(tmp_path):
    """A sharded pytest run writes its selected node ids, those of its shard only."""
    ids = tmp_path / "ids"
    env = dict(os.environ, FA3_TEST_SHARD="2/3", FA3_TEST_SHARD_LIST=str(ids))
    target = "tests/test_tests_not_reached.py::test_a_cut_shard_names_its_unreported_tests"
    # Three tests of this file; shard 2 of 3 keeps the third, which --co does not run.
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "--co", "-p", "no:cacheprovider",
                          "tests/test_tests_not_reached.py"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    listed = ids.read_text().split()
    assert listed == ["tests/test_tests_not_reached.py::test_conftest_writes_the_shard_list"], listed
    assert target not in listed
