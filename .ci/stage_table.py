"""Print the lane's stage table (.ci/stages.sh writes the rows) and check it against .ci/budget.txt.

  python3 .ci/stage_table.py STAGES_TSV

The budget file gives the cold and warm limits of the whole run in seconds; the run is judged cold when a stage
built a venv (its name says "(built)"). Exit status 0, or 3 when the total is past its kind's budget by more than
the margin.
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
        name, seconds, rc = line.split("\t")
        rows.append((name, int(seconds), int(rc)))
    total = sum(s for _, s, _ in rows)
    cold = any("(built)" in name for name, _, _ in rows)
    width = max(len(n) for n, _, _ in rows + [("total", 0, 0)])
    print("\n== lane stages (wall time) ==")
    for name, seconds, rc in rows:
        print(f"{name:<{width}}  {seconds:>6d} s  {seconds / 60:5.1f} min" + ("" if rc == 0 else f"  rc {rc}"))
    print(f"{'total':<{width}}  {total:>6d} s  {total / 60:5.1f} min")
    budget = read_budget()
    kind = "cold" if cold else "warm"
    limit = budget[f"{kind}_s"] * (100 + budget["margin_pct"]) // 100
    verdict = "within" if total <= limit else "OVER"
    print(f"budget ({kind}: {budget[f'{kind}_s']} s + {budget['margin_pct']}% margin = {limit} s): {verdict}")
    return 0 if total <= limit else 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
