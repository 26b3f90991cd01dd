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
MAX_HEADLINES = 8
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
    index = results / "INDEX.md"
    indexed = set(re.findall(r"\[`([\w.-]+\.json)`\]", index.read_text())) if index.is_file() else set()
    for page in pages(root):  # every result file a page names exists and is in the index (in a link or not)
        for name in sorted(set(RESULT_FILE.findall(page.read_text()))):
            if not (results / name).is_file():
                problems.append(f"{page.relative_to(root)}: names bench/results/{name}, which does not exist")
            elif name not in indexed:
                problems.append(f"{page.relative_to(root)}: names bench/results/{name}, which is not in "
                                "bench/results/INDEX.md (python docs/generate.py)")
    # README's headline table: each row names its result file, or is a public figure that links its source.
    table = (root / "README.md").read_text().split("\n## Headline numbers\n", 1)[1].split("\n## ", 1)[0]
    rows = [ln for ln in table.splitlines() if ln.startswith("|")][2:]
    if len(rows) > MAX_HEADLINES:
        problems.append(f"README headline numbers: {len(rows)} rows (at most {MAX_HEADLINES}); the rest belong in "
                        "docs/ or lab/")
    for row in rows:
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
    (tmp_path / "bench" / "results" / "c.json").write_text("{}")  # there, but not in the index
    (tmp_path / "bench" / "results" / "INDEX.md").write_text("| [`a.json`](a.json) | ... |\n")
    (tmp_path / "docs" / "page.md").write_text(
        "| x | `bench/results/a.json`, `bench/results/gone.json` |\n| 7.5x, target <= 0.6x | bench/results/a.json |\n"
        "see bench/results/c.json\n")
    (tmp_path / "README.md").write_text(
        "# R\n\n## Headline numbers\n\n| figure | source |\n|---|---|\n"
        "| head 1.95x; decode 0.81-1.00x | [a](bench/results/a.json) |\n"  # stored; a ratio of one row; that row's 1.0
        "| head 3.10x; 3.00x | [a](bench/results/a.json) |\n"  # 3.00 = gbps / tq_ms: not one unit
        "| splice 2.5x | [b](bench/results/b.json) |\n"
        "| recipe 51 tok/s; not measured here | [theirs](https://example.com) |\n"
        "| recipe 39 tok/s | somewhere |\n\n## Next\n\n| 9.99x | not this table |\n")
    assert figure_problems(tmp_path) == [
        "README.md: names bench/results/b.json, which does not exist",
        "docs/page.md: names bench/results/c.json, which is not in bench/results/INDEX.md (python docs/generate.py)",
        "docs/page.md: names bench/results/gone.json, which does not exist",
        "README headline 'recipe 39 tok/s': names no result file (a public figure says 'not measured here' and "
        "links its source)",
        "README.md:8: 3.10x is in none of ['a.json']",
        "README.md:8: 3.00x is in none of ['a.json']",
        "README.md:9: 2.5x is in none of []",
        "docs/page.md:2: 7.5x is in none of ['a.json']",
    ]


def test_a_headline_table_of_more_than_eight_rows_fails(tmp_path):
    (tmp_path / "bench" / "results").mkdir(parents=True)
    rows = "".join(f"| recipe {n} tok/s; not measured here | [theirs](https://example.com) |\n" for n in range(9))
    (tmp_path / "README.md").write_text(f"# R\n\n## Headline numbers\n\n| figure | source |\n|---|---|\n{rows}")
    assert figure_problems(tmp_path) == [
        "README headline numbers: 9 rows (at most 8); the rest belong in docs/ or lab/"]
    (tmp_path / "README.md").write_text("# R\n\n## Headline numbers\n\n| figure | source |\n|---|---|\n"
                                        + rows.split("\n", 1)[1])
    assert figure_problems(tmp_path) == []


# ---- bench/results/: current results only, each in the index ---------------------------------------------------

def test_every_result_is_current_at_the_code_it_measures():
    gen = _generator()
    files = sorted(p.name for p in (ROOT / "bench" / "results").glob("*.json"))
    index = (ROOT / "bench" / "results" / "INDEX.md").read_text()
    assert files and [f for f in files if f"[`{f}`]({f})" not in index] == []
    problems = gen.index_problems()
    assert not problems, "bench/results/ holds results that are not current:\n  " + "\n  ".join(problems)


def _git(cwd: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin", "HOME": str(cwd)}
    return subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True, check=True).stdout.strip()


def test_a_result_older_than_its_code_or_named_by_commit_fails(tmp_path):
    """A kernels result at commit A: current while kernels/ changes only in words (a docstring, a comment), stale
    once its code changes; a name with a commit in it, a result with no commit, one no MEASURES entry names, a
    stray file and a folder each named."""
    gen = _generator()
    (tmp_path / "kernels").mkdir()
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "kernels" / "k.py").write_text('"""A kernel."""\n\n\ndef f():\n    return 1\n')
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "a")
    sha = _git(tmp_path, "rev-parse", "HEAD")
    res = tmp_path / "bench" / "results"
    (res / "turboquant_h100.json").write_text(json.dumps({"git_sha": sha[:7], "command": "python x.py"}))
    assert gen.index_problems(tmp_path) == []
    (tmp_path / "kernels" / "k.py").write_text('"""A kernel, in other words."""\n\n\ndef f():  # why\n    return 1\n')
    assert gen.index_problems(tmp_path) == []  # words only: the code measured is the same
    (tmp_path / "kernels" / "README.md").write_text("What the kernels are.\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "b")
    assert gen.index_problems(tmp_path) == []  # prose beside the code: not a change to it
    (tmp_path / "kernels" / "k.py").write_text('"""A kernel."""\n\n\ndef f():\n    return 2\n')
    (res / "turboquant_h100_1234abc.json").write_text(json.dumps({"git_sha": sha}))
    (res / "lm_head_h200.json").write_text(json.dumps({"git_sha": "unknown"}))
    (res / "mystery_h100.json").write_text(json.dumps({"git_sha": sha}))
    (res / "notes.txt").write_text("x")
    (res / "variants").mkdir()
    assert gen.index_problems(tmp_path) == [
        "bench/results/lm_head_h200.json: records no commit (git_sha 'unknown'); a result measures a committed tree",
        "bench/results/mystery_h100.json: no MEASURES entry in docs/generate.py names the code it measures",
        "bench/results/notes.txt: not a result file (a .json, or a .md/.png beside its .json): move it to lab/",
        f"bench/results/turboquant_h100.json: its commit {sha[:7]} is older than the code it measures "
        "(kernels/k.py changed since): run it again (python x.py) or move it to lab/results/",
        "bench/results/turboquant_h100_1234abc.json: a commit in the name; the commit belongs inside (git_sha), one "
        "file per benchmark and hardware",
        f"bench/results/turboquant_h100_1234abc.json: its commit {sha[:9]} is older than the code it measures "
        "(kernels/k.py changed since): run it again (?) or move it to lab/results/",
        "bench/results/variants: not a result file (a .json, or a .md/.png beside its .json): move it to lab/",
    ]


# ---- the front door and the concept pages: within their caps ------------------------------------------------------

README_LINES, CELL_CHARS, CONCEPT_LINES = 180, 200, 250
CONCEPT_PAGES = ("docs/concepts/turboquant.md", "docs/concepts/kernels.md")
# The project describes itself, not the machinery it was developed with (issue 56).
WORKPLACE = re.compile(r"device (call|machine|tool)|budget_left|lent (an|no|us)|was lent|\$OUT\b|\blease\b", re.I)


def cap_problems(root: Path = ROOT) -> list[str]:
    problems = []
    readme = (root / "README.md").read_text().splitlines()
    if len(readme) > README_LINES:
        problems.append(f"README.md: {len(readme)} lines (at most {README_LINES}): it is the front door")
    for n, line in enumerate(_prose("\n".join(readme)), 1):
        if line.startswith("|"):
            wide = [c.strip() for c in readme[n - 1].strip().strip("|").split(" | ") if len(c.strip()) > CELL_CHARS]
            problems += [f"README.md:{n}: a table cell of {len(c)} characters (at most {CELL_CHARS})" for c in wide]
    for rel in CONCEPT_PAGES:
        page = root / rel
        if page.is_file() and len(page.read_text().splitlines()) > CONCEPT_LINES:
            problems.append(f"{rel}: {len(page.read_text().splitlines())} lines (at most {CONCEPT_LINES}): "
                            "a lab notebook belongs in lab/")
    return problems


def test_readme_and_concept_pages_keep_their_caps():
    problems = cap_problems()
    assert not problems, "\n  ".join(["over the caps:", *problems])


def test_a_long_readme_or_wide_cell_fails(tmp_path):
    (tmp_path / "docs" / "concepts").mkdir(parents=True)
    (tmp_path / "README.md").write_text("# R\n\n| a | b |\n|---|---|\n| " + "x" * 201 + " | y |\n"
                                        + "`| " + "z" * 300 + " |` in code\n" + "line\n" * 175)
    (tmp_path / "docs" / "concepts" / "turboquant.md").write_text("x\n" * 251)
    (tmp_path / "docs" / "concepts" / "kernels.md").write_text("x\n" * 250)
    assert cap_problems(tmp_path) == [
        "README.md: 181 lines (at most 180): it is the front door",
        "README.md:5: a table cell of 201 characters (at most 200)",
        "docs/concepts/turboquant.md: 251 lines (at most 250): a lab notebook belongs in lab/",
    ]


def workplace_words(root: Path = ROOT) -> list[str]:
    files = [root / "README.md", *(root / "docs").rglob("*.md"),
             *[p for d in ("onespark", "kernels", "patches") for p in (root / d).rglob("*.py")],
             *(root / "bench").glob("*.py"), *(root / "kernels").glob("*.cu*")]
    return [f"{p.relative_to(root)}:{n}: {line.strip()[:100]}" for p in sorted(files) if p.is_file()
            for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if WORKPLACE.search(line)]


def test_the_project_speaks_of_itself():
    found = workplace_words()
    assert not found, "README, docs and product code speak of the machinery, not the project:\n  " + "\n  ".join(found)


def test_a_workplace_word_is_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("Run it on a GPU.\n")
    (tmp_path / "docs" / "a.md").write_text("ok\nThe device lent an H200 for one call.\nfiles under $OUT\n")
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "x.py").write_text("# one device call per piece\nOUTPUT = 1\n")
    assert workplace_words(tmp_path) == ["bench/x.py:1: # one device call per piece",
                                         "docs/a.md:2: The device lent an H200 for one call.",
                                         "docs/a.md:3: files under $OUT"]
