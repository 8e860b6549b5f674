"""The tests that sharded pytest runs selected but never reported (a shard cut at its time
limit prints no summary): scripts/gpu_cycle.sh appends this to pytest_gpu.log.

    python3 scripts/tests_not_reached.py LOG_DIR SHARDS

LOG_DIR holds shard_<i>.ids (the shard's selected node ids, one a line: tests/conftest.py,
FA3_TEST_SHARD_LIST) and shard_<i>.log (its `pytest -v` output). A test counts as reported when
its node id is followed by a result word on one line of the log. Prints "not reached: N" and
the node ids, or nothing when every selected test reported.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

# A node id may hold spaces (`test_options[long band causal]`), so each result word on a line
# offers the text before it as a candidate id (session 29: a regex for ids without spaces counted
# 13 passed FP8 tests as not reached).
RESULT_WORD = re.compile(r" (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


def reported_ids(log: str) -> set[str]:
    return {line[:m.start()] for line in log.splitlines() for m in RESULT_WORD.finditer(line)}


def not_reached(log_dir: Path, shards: int) -> list[str]:
    missing = []
    for i in range(shards):
        ids_file, log_file = log_dir / f"shard_{i}.ids", log_dir / f"shard_{i}.log"
        if not ids_file.exists():  # the shard died before collection ended: its log says why
            continue
        log = log_file.read_text(errors="replace") if log_file.exists() else ""
        reported = reported_ids(log)
        missing += [t for t in ids_file.read_text().split("\n") if t and t not in reported]
    return missing


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    missing = not_reached(Path(argv[1]), int(argv[2]))
    if missing:
        print(f"not reached: {len(missing)} selected tests never reported (a shard cut at its time limit)")
        print("\n".join(missing))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
