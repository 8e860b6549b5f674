"""Reading `cuobjdump -sass` listings: the instructions of each kernel, in address order."""

from __future__ import annotations

import re


def functions(path: str) -> dict[str, list[tuple[int, str]]]:
    """{kernel name: [(address, instruction text without the trailing ';'), ...]}."""
    funcs, cur = {}, None
    with open(path) as f:
        for line in f:
            m = re.search(r"Function : (\S+)", line)
            if m:
                cur = m.group(1)
                funcs[cur] = []
                continue
            m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
            if m and cur:
                funcs[cur].append((int(m.group(1), 16), m.group(2).strip()))
    return funcs
