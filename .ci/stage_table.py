"""Print the lane's stage table (.ci/stages.sh writes the rows) and check it against .ci/budget.txt.

  python3 .ci/stage_table.py STAGES_TSV

A row whose fourth field is "within" ran beside other rows, inside a later row's time (tests/run.sh runs the two
tracks' pytest side by side and then writes their shared wall time as one row): it is listed, indented, and left
out of the total, which is the run's wall time.

The budget file gives the cold and warm limits of the whole run in seconds; the run is cold when a row says so
(.ci/run writes "this run is cold" when it found no uv cache or no demo images), warm otherwise. Exit status 3
when a warm run is past its budget by more than the margin (a regression: .ci/run fails on it), else 0; a cold run
past its budget is reported, not failed (a slow fresh machine is not a regression, and CI's own limit is 90 min).
"""

from __future__ import annotations

import sys
from pathlib import Path

BUDGET = Path(__file__).with_name("budget.txt")


def read_budget(path: Path = BUDGET) -> dict[str, int]:
    budget = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            key, value = line.split("=", 1)
            budget[key.strip()] = int(value)
    return budget


def main(argv: list[str]) -> int:
    rows = []
    for line in Path(argv[0]).read_text().splitlines():
        name, seconds, rc, *within = line.split("\t")
        rows.append((("  " + name) if within == ["within"] else name, int(seconds), int(rc), within == ["within"]))
    total = sum(s for _, s, _, inside in rows if not inside)
    uncovered = 0  # side-by-side rows at the end, no row after them (a run stopped early): the longest counts
    for _, seconds, _, inside in reversed(rows):
        if not inside:
            break
        uncovered = max(uncovered, seconds)
    total += uncovered
    cold = any(name == "this run is cold" for name, _, _, _ in rows)
    width = max(len(n) for n, _, _, _ in rows + [("total", 0, 0, False)])
    print("\n== lane stages (wall time) ==")
    for name, seconds, rc, inside in rows:
        print(f"{name:<{width}}  {seconds:>6d} s  {seconds / 60:5.1f} min" + ("" if rc == 0 else f"  rc {rc}")
              + ("  (side by side: the total counts their shared wall time)" if inside else ""))
    print(f"{'total':<{width}}  {total:>6d} s  {total / 60:5.1f} min")
    budget = read_budget()
    kind = "cold" if cold else "warm"
    limit = budget[f"{kind}_s"] * (100 + budget["margin_pct"]) // 100
    verdict = "within" if total <= limit else "OVER"
    print(f"budget ({kind}: {budget[f'{kind}_s']} s + {budget['margin_pct']}% margin = {limit} s): {verdict}")
    return 3 if total > limit and not cold else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
