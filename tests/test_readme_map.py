"""The map ("Where things are" in docs/concepts/overview.md: the two path tables, then the layout; README links
to it) names files and functions a reader follows: each must exist in the code.

Every backticked path in the map exists. In the two path tables (checkpoint, logits), the cell that names the
code (`FILE`: `name` -> `name` ...) is read left to right: a path sets the file, `module.name` looks in
onespark/module.py (or a wing's, onespark/WING/module.py), `Class.method` and `.method` (the last class named)
look for the method, and any other name must be defined at the top level of the file named last.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPAN = re.compile(r"`([^`]+)`")
NAME = re.compile(r"^\.?[A-Za-z_]\w*(\.[A-Za-z_]\w*)?$")


MAP_PAGES = ("docs/concepts/overview.md",)  # README, the front door, links here


def _section(text: str, heading: str) -> str:
    """From the heading that starts with `heading` to the next heading of its level or above (or the end)."""
    start = text.index(heading)
    level = len(heading) - len(heading.lstrip("#"))
    body = text.index("\n", start)
    end = re.search(r"^#{1,%d} " % level, text[body:], re.M)
    return text[start:body + end.start()] if end else text[start:]


def map_section() -> str:
    """The map as it reads: the overview page's section (the two path tables, then the layout)."""
    return "\n".join(_section((ROOT / page).read_text(), "## Where things are") for page in MAP_PAGES)


def code_cells(section: str) -> list[str]:
    """The cell of each table row that names the code: the one holding a `*.py`: `name` pair."""
    cells = []
    for line in section.splitlines():
        if line.startswith("|") and not set(line) <= set("|- "):
            cells += [c for c in line.split("|") if re.search(r"`[\w/]+\.py`: `", c)]
    return cells


def defined(path: Path) -> dict[str, set[str]]:
    """Top-level names of a Python file -> the methods each class defines (empty for the rest)."""
    names: dict[str, set[str]] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names[node.name] = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(t, ast.Name):
                    names[t.id] = set()
    return names


def module_file(name: str) -> Path | None:
    """onespark's module `name`, at the top level or in one of its wings (model/, checkpoint/, serving/)."""
    found = [ROOT / "onespark" / f"{name}.py", *sorted((ROOT / "onespark").glob(f"*/{name}.py"))]
    return next((f for f in found if f.exists()), None)


def cell_problems(cell: str) -> list[str]:
    problems, file, last_class = [], None, None
    for span in SPAN.findall(cell):
        if span.endswith(".py"):
            file = ROOT / span
            continue
        if file is None or not NAME.match(span):
            continue
        head, _, tail = span.lstrip(".").partition(".")
        where = file
        if span.startswith("."):
            head, tail = last_class, span[1:]
        elif tail and module_file(head) and head not in defined(file):
            where, head, tail = module_file(head), tail, ""
        names = defined(where)
        rel = where.relative_to(ROOT)
        if head not in names:
            problems.append(f"`{span}`: {rel} defines no {head}")
        elif tail and tail not in names[head]:
            problems.append(f"`{span}`: {rel}'s {head} has no method {tail}")
        if head in names and names[head]:
            last_class = head
    return problems


def test_map_paths_exist():
    section = map_section()
    paths = [s for s in SPAN.findall(section) if re.fullmatch(r"[\w.-]+(/[\w.*-]*)+|[\w-]+\.(py|sh|toml|md)", s)]
    assert len(paths) > 20, paths
    missing = [p for p in paths if "*" not in p and not (ROOT / p).exists()]
    assert not missing, f"the map names paths that do not exist: {missing}"


def test_map_names_are_defined():
    cells = code_cells(map_section())
    assert len(cells) >= 8, cells  # 4 checkpoint rows + 5 logits rows, minus none
    problems = [p for c in cells for p in cell_problems(c)]
    assert not problems, "the map (docs/concepts/overview.md) is out of date:\n  " + "\n  ".join(problems)


def test_map_check_finds_a_wrong_name():
    assert cell_problems("`onespark/checkpoint/hybrid.py`: `hybrid` -> `Plan.no_such_method`") == [
        "`Plan.no_such_method`: onespark/checkpoint/hybrid.py's Plan has no method no_such_method"]
    assert cell_problems("`onespark/checkpoint/mtp.py`: `writer.NoWriter`") == [
        "`writer.NoWriter`: onespark/checkpoint/writer.py defines no NoWriter"]
    assert cell_problems("`patches/lm_head.py`: `Int8LMHeadMethod.apply`, `.create_weights`, `.nope`") == [
        "`.nope`: patches/lm_head.py's Int8LMHeadMethod has no method nope"]
