"""README.md and docs/: every relative link names a file that exists, and every #anchor a heading of it.

Anchors follow GitHub's rule for headings: lower-case, markup (`, *, _ around words) and punctuation other than
`-` and `_` dropped, each space a `-`; a repeated heading gets `-1`, `-2`, ... Links inside code (fences and
backticks) are not links. External links (http:, mailto:) are not checked: no network here.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

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
    lower-case (another repository's `docs/FINDINGS.md`, cited in onespark/synth.py, is not ours)."""
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
    """docs/reference/cli.md (each command's --help) and results.md (bench/results/*.json) match the code."""
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
