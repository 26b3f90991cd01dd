"""README.md and docs/: every relative link names a file that exists, and every #anchor a heading of it; the
generated pages are current; every figure of README's headline table is in the result file it cites.

Anchors follow GitHub's rule for headings: lower-case, markup (`, *, _ around words) and punctuation other than
`-` and `_` dropped, each space a `-`; a repeated heading gets `-1`, `-2`, ... Links inside code (fences and
backticks) are not links. External links (http:, mailto:) are not checked: no network here.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def pages(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def _prose(text: str) -> list[str]:
    """The lines outside fenced code blocks, with inline code spans blanked."""
    lines, fence = [], None
    for line in text.splitlines():
        m = re.match(r"^\s*(```+|~~~+)", line)
        if m:
            if fence is None:
                fence = m.group(1)[:3]
            elif line.strip().startswith(fence):
                fence = None
            lines.append("")
            continue
        lines.append("" if fence else re.sub(r"(`+)(?:(?!\1).)+?\1", "``", line))
    return lines


def slug(heading: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # GitHub keeps letters, digits, _, - and spaces
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    fence = None
    for line in path.read_text().splitlines():
        m = re.match(r"^\s*(```+|~~~+)", line)
        if m:
            fence = None if fence and line.strip().startswith(fence) else (fence or m.group(1)[:3])
            continue
        h = HEADING.match(line) if fence is None else None
        if not h:
            continue
        base = slug(h.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    out |= set(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", path.read_text()))
    return out


def broken_links(root: Path = ROOT) -> list[str]:
    problems = []
    cache: dict[Path, set[str]] = {}
    for page in pages(root):
        for lineno, line in enumerate(_prose(page.read_text()), 1):
            for target in LINK.findall(line):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                    continue
                path, _, anchor = target.partition("#")
                dest = (page.parent / path).resolve() if path else page
                where = f"{page.relative_to(root)}:{lineno}: ({target})"
                if not dest.exists():
                    problems.append(f"{where}: no such file {path}")
                    continue
                if anchor and dest.suffix == ".md":
                    if dest not in cache:
                        cache[dest] = anchors(dest)
                    if anchor not in cache[dest]:
                        problems.append(f"{where}: {dest.relative_to(root)} has no heading #{anchor}")
    return problems


def test_links_and_anchors_resolve():
    assert len(pages()) > 10
    problems = broken_links()
    assert not problems, "broken links in README.md / docs/:\n  " + "\n  ".join(problems)


def test_github_anchor_rule():
    assert slug("DFlash on the 0.32.0 track (`--drafter dflash`)") == "dflash-on-the-0320-track---drafter-dflash"
    assert slug("Steps 0-2: the hybrid checkpoint") == "steps-0-2-the-hybrid-checkpoint"
    assert slug("The MTP draft's head: a vocabulary subset") == "the-mtp-drafts-head-a-vocabulary-subset"
    assert slug("When it fails") == "when-it-fails"


def test_a_broken_link_or_anchor_fails(tmp_path):
    (tmp_path / "docs" / "guides").mkdir(parents=True)
    (tmp_path / "README.md").write_text(
        "# Top\n\n## When it fails\n\n## When it fails\n\n[ok](docs/a.md#part-two) [ok](#when-it-fails-1)\n"
        "[gone](docs/nope.md) [bad anchor](docs/a.md#part-three) [web](https://example.com/x)\n"
        "`[not a link](nowhere.md)`\n```\n[in a fence](nowhere.md)\n```\n")
    (tmp_path / "docs" / "a.md").write_text("# A\n\n## Part two\n\n[up](../README.md#top) [x](guides/b.md)\n")
    (tmp_path / "docs" / "guides" / "b.md").write_text("# B\n\n[wrong depth](../README.md)\n")
    assert broken_links(tmp_path) == [
        "README.md:8: (docs/nope.md): no such file docs/nope.md",
        "README.md:8: (docs/a.md#part-three): docs/a.md has no heading #part-three",
        "docs/guides/b.md:3: (../README.md): no such file ../README.md",
    ]


def pointers_in_code(root: Path = ROOT) -> list[str]:
    """Every docs/*.md page a message or comment of the code names, and the files that name it. Our pages are
    lower-case (another repository's `docs/FINDINGS.md`, cited in onespark/checkpoint/synth.py, is not ours)."""
    code = [root / "install.sh", *(root / "steps").glob("*.sh"), *(root / "docker").glob("*"),
            *[p for d in ("onespark", "patches", "kernels", "bench") for p in (root / d).rglob("*.py")]]
    found = []
    for path in code:
        if path.is_file():
            text = path.read_text(errors="replace")
            for page in sorted(set(re.findall(r"\bdocs/(?:[a-z0-9-]+/)*[a-z0-9-]+\.md", text))):
                found.append(f"{path.relative_to(root)}: {page}")
    return found


def test_pages_the_code_points_at_exist():
    found = pointers_in_code()
    assert found, "no code names a docs page: the messages that point readers there are gone"
    missing = [f for f in found if not (ROOT / f.split(": ")[1]).exists()]
    assert not missing, f"code names docs pages that do not exist: {missing}"
    stale = [str(p.relative_to(ROOT)) for p in [ROOT / "install.sh", *(ROOT / "onespark").rglob("*.py")]
             if re.search(r"\bREADME(: |'s )", p.read_text())]
    assert not stale, f"these point at README sections, which moved to docs/: {stale}"


def _generator():
    import importlib.util
    spec = importlib.util.spec_from_file_location("docs_generate", ROOT / "docs" / "generate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_generated_pages_are_current():
    """docs/reference/cli.md (each command's --help), results.md (bench/results/*.json) and plugin.md's switches
    table (the plugin's docstring list and TECHNIQUES) match the code."""
    r = subprocess.run([sys.executable, "docs/generate.py", "--check"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr


def test_a_stale_generated_page_fails(tmp_path, monkeypatch, capsys):
    gen = _generator()
    page = tmp_path / "results.md"
    monkeypatch.setattr(gen, "pages", lambda: {page: "new\n"})
    page.write_text("old\n")
    assert gen.main(["--check"]) == 1
    assert "run python docs/generate.py" in capsys.readouterr().err
    assert page.read_text() == "old\n"  # --check writes nothing
    assert gen.main([]) == 0 and page.read_text() == "new\n"
    assert gen.main(["--check"]) == 0


def test_every_result_file_has_its_section():
    text = (ROOT / "docs" / "reference" / "results.md").read_text()
    files = sorted(p.name for p in (ROOT / "bench" / "results").glob("*.json"))
    assert files and [f for f in files if f"\n## {f}\n" not in text] == []


SWITCHES_DOC = """The plugin.

Switches (environment variables):

  ONESPARK_A=1
      does A,
      in two lines.
      Speed/memory: 2x less.
  ONESPARK_B=flash
      picks B.

Not an entry.
"""


def test_switch_list_parses_and_disagreements_fail():
    gen = _generator()
    entries = gen.switch_entries(SWITCHES_DOC)
    assert entries == {"ONESPARK_A": ("1", "does A, in two lines.", "2x less."), "ONESPARK_B": ("flash", "picks B.", "")}
    rows = gen.switch_table(entries, {"a": ("ONESPARK_A", True, "onespark.patches.a_mod:install")},
                            {"ONESPARK_A", "ONESPARK_B"})
    assert rows[2].startswith("| `ONESPARK_A` | `1` | `a` ([`patches/a_mod.py`](../../patches/a_mod.py)) | does A,")
    assert rows[3] == "| `ONESPARK_B` | `flash` | — | picks B. | — |"
    # A technique without an entry, a default that is not the technique's, a switch the code reads with no entry,
    # an entry nothing reads: each named.
    with pytest.raises(SystemExit) as e:
        gen.switch_table(entries, {"a": ("ONESPARK_A", False, "m:f"), "c": ("ONESPARK_C", True, "m:f")},
                         {"ONESPARK_A", "ONESPARK_C", "ONESPARK_D"})
    assert str(e.value).endswith(
        "ONESPARK_A: the list says =1, TECHNIQUES 0; ONESPARK_C (technique c) has no entry; ONESPARK_C is read in "
        "patches/ but has no entry; ONESPARK_D is read in patches/ but has no entry; ONESPARK_B has an entry but "
        "nothing in patches/ reads it")


# ---- figures: each one of README's headline table is in the result file it cites -------------------------------

RESULT_FILE = re.compile(r"bench/results/([\w.-]+\.json)")
RATIO = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)(?:-(\d+(?:\.\d+)?))?x\b")  # 1.95x, 0.81-0.99x


def _objects(data) -> list[dict[str, float]]:
    """The numbers of each object in a result file (a table row, the file itself), by key."""
    out = []
    if isinstance(data, dict):
        out.append({k: v for k, v in data.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
        data = list(data.values())
    if isinstance(data, list):
        out.append({str(i): v for i, v in enumerate(data) if isinstance(v, (int, float)) and not isinstance(v, bool)})
        for v in data:
            if isinstance(v, (dict, list)):
                out += _objects(v)
    return out


def in_result(figure: str, data) -> bool:
    """The quoted figure rounds from a number of the file, or from the ratio of two numbers of one row in the
    same unit (a speedup the bench leaves to the reader: tq_ms / fa_bf16_folded_ms). Same unit only: a row of
    16 numbers has 240 ratios, and one of them would match almost any figure."""
    x, tol = float(figure), 0.5 * 10 ** -len(figure.partition(".")[2]) + 1e-9
    for row in _objects(data):
        if any(abs(v - x) <= tol for v in row.values()):
            return True
        unit = {k: k.rsplit("_", 1)[1] for k in row if "_" in k}  # tq_ms -> ms
        if any(a != b and unit[a] == unit.get(b) and row[b] and abs(row[a] / row[b] - x) <= tol
               for a in unit for b in unit):
            return True
    return False


def _ratios_missing(where: str, row: str, results: Path) -> list[str]:
    """Each NNx figure of a table row that is in none of the result files the row names. A figure after a
    comparison (`<= 0.6x`) is a target, not a measurement."""
    files = [results / n for n in RESULT_FILE.findall(row) if (results / n).is_file()]
    data = [json.loads(f.read_text()) for f in files]
    return [f"{where}: {x}x is in none of {[f.name for f in files]}" for m in RATIO.finditer(row)
            if not re.search(r"[<>]=?\s*$", row[:m.start()]) for x in filter(None, m.groups())
            if not any(in_result(x, d) for d in data)]


def figure_problems(root: Path = ROOT) -> list[str]:
    problems = []
    results = root / "bench" / "results"
    for page in pages(root):  # every result file a page names exists (in a link or not)
        for name in sorted(set(RESULT_FILE.findall(page.read_text()))):
            if not (results / name).is_file():
                problems.append(f"{page.relative_to(root)}: names bench/results/{name}, which does not exist")
    # README's headline table: each row names its result file, or is a public figure that links its source.
    table = (root / "README.md").read_text().split("\n## Headline numbers\n", 1)[1].split("\n## ", 1)[0]
    for row in [ln for ln in table.splitlines() if ln.startswith("|")][2:]:
        figure = row.split(" | ")[0].lstrip("| ")
        if not RESULT_FILE.search(row) and not ("not measured here" in figure and "](http" in row):
            problems.append(f"README headline {figure!r}: names no result file (a public figure says "
                            "'not measured here' and links its source)")
    # Every table row that names a result file (the generated results.md aside): its figures are in that file.
    for page in pages(root):
        if page == root / "docs" / "reference" / "results.md":
            continue
        for n, row in enumerate(page.read_text().splitlines(), 1):
            if row.startswith("|") and RESULT_FILE.search(row):
                problems += _ratios_missing(f"{page.relative_to(root)}:{n}", row, results)
    return problems


def test_every_headline_figure_is_in_its_result_file():
    problems = figure_problems()
    assert not problems, "figures without their result:\n  " + "\n  ".join(problems)


def test_a_figure_without_its_result_fails(tmp_path):
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "docs").mkdir()
    (tmp_path / "bench" / "results" / "a.json").write_text(json.dumps(
        {"rows": [{"m": 1, "speedup": 1.954}, {"m": 2, "tq_ms": 0.81, "bf16_ms": 1.0, "gbps": 2.43}]}))
    (tmp_path / "docs" / "page.md").write_text(
        "| x | `bench/results/a.json`, `bench/results/gone.json` |\n| 7.5x, target <= 0.6x | bench/results/a.json |\n")
    (tmp_path / "README.md").write_text(
        "# R\n\n## Headline numbers\n\n| figure | source |\n|---|---|\n"
        "| head 1.95x; decode 0.81-1.00x | [a](bench/results/a.json) |\n"  # stored; a ratio of one row; that row's 1.0
        "| head 3.10x; 3.00x | [a](bench/results/a.json) |\n"  # 3.00 = gbps / tq_ms: not one unit
        "| splice 2.5x | [b](bench/results/b.json) |\n"
        "| recipe 51 tok/s; not measured here | [theirs](https://example.com) |\n"
        "| recipe 39 tok/s | somewhere |\n\n## Next\n\n| 9.99x | not this table |\n")
    assert figure_problems(tmp_path) == [
        "README.md: names bench/results/b.json, which does not exist",
        "docs/page.md: names bench/results/gone.json, which does not exist",
        "README headline 'recipe 39 tok/s': names no result file (a public figure says 'not measured here' and "
        "links its source)",
        "README.md:8: 3.10x is in none of ['a.json']",
        "README.md:8: 3.00x is in none of ['a.json']",
        "README.md:9: 2.5x is in none of []",
        "docs/page.md:2: 7.5x is in none of ['a.json']",
    ]
