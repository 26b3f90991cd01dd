"""patches/README.md (the ledger) names every patch, every entry names a patch that exists, has a field for
each supported vLLM version (0.19.1 and 0.32.0), and names a version seam that patches/_compat.py defines."""

from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

import pytest

from onespark.patches import TECHNIQUES
from onespark.patches._compat import SUPPORTED_VLLM

pytestmark = pytest.mark.vllm032  # pure text checks: run on both tracks

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ["Patch", *(f"vLLM {v}" for v in SUPPORTED_VLLM), "Seam", "Hook", "Switch", "Why", "How", "Upstream",
          "Remove when"]


def compat_functions(root: Path) -> set[str]:
    tree = ast.parse((root / "patches" / "_compat.py").read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}


def hook_module(target: str) -> str:
    """"onespark.patches.lm_head:install" -> "patches/lm_head.py"."""
    return "patches/" + target.split(":")[0].rsplit(".", 1)[1] + ".py"


def parse_ledger(text: str) -> dict[str, dict[str, str]]:
    """{entry name: {field: value}} for every `### ` entry under `## Ledger`."""
    body = text.split("\n## Ledger\n", 1)
    if len(body) != 2:
        return {}
    entries: dict[str, dict[str, str]] = {}
    for block in re.split(r"^### ", body[1], flags=re.M)[1:]:
        name, _, rest = block.partition("\n")
        entries[name.strip()] = dict(re.findall(r"^- \*\*(.+?):\*\* *(.*)$", rest, flags=re.M))
    return entries


def ledger_problems(root: Path) -> list[str]:
    """Every way patches/README.md and the patches in `root` disagree (empty = complete)."""
    entries = parse_ledger((root / "patches" / "README.md").read_text())
    if not entries:
        return ["patches/README.md has no '## Ledger' section with '### ' entries"]
    problems, named = [], {}
    seams = compat_functions(root)
    for name, fields in entries.items():
        if list(fields) != FIELDS or not all(v.strip() for v in fields.values()):
            problems.append(f"entry {name!r}: fields {list(fields)} must be {FIELDS}, all non-empty, in order")
            continue
        m = re.fullmatch(r"`(patches/[^`]+)`", fields["Patch"].strip())
        if not m:
            problems.append(f"entry {name!r}: Patch must be one backquoted path, got {fields['Patch']!r}")
            continue
        for seam in re.findall(r"`_compat\.(\w+)`", fields["Seam"]):
            if seam not in seams:
                problems.append(f"entry {name!r}: Seam `_compat.{seam}` is not a function of patches/_compat.py")
        if not re.findall(r"`_compat\.(\w+)`", fields["Seam"]) and not fields["Seam"].startswith("none"):
            problems.append(f"entry {name!r}: Seam must name a `_compat.<function>` or start with 'none'")
        path = m.group(1)
        if not (root / path).is_file():
            problems.append(f"entry {name!r} names {path}, which does not exist")
        if path in named:
            problems.append(f"{path} has two entries: {named[path]!r} and {name!r}")
        named[path] = name
    patches = {hook_module(t) for _, _, t in TECHNIQUES.values()}
    patches |= {f"patches/{p.name}" for p in (root / "patches").glob("*.diff")}
    problems += [f"{p} has no ledger entry" for p in sorted(patches - set(named))]
    problems += [f"entry {named[p]!r} names {p}, which is neither a hook in TECHNIQUES nor a .diff"
                 for p in sorted(set(named) - patches)]
    for _, (env, _, target) in TECHNIQUES.items():
        entry = entries.get(named.get(hook_module(target), ""), {})
        if entry and env not in entry.get("Switch", ""):
            problems.append(f"entry for {hook_module(target)} does not name its switch {env}")
    return problems


def test_ledger_is_complete():
    assert ledger_problems(ROOT) == [], "patches/README.md is out of date (format: top of that file)"


def _copy(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "patches", tmp_path / "patches", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def test_a_diff_without_entry_is_caught(tmp_path):
    root = _copy(tmp_path)
    (root / "patches" / "example-new.diff").write_text("--- a/x\n+++ b/x\n")
    assert "patches/example-new.diff has no ledger entry" in ledger_problems(root)


def test_an_entry_without_patch_or_field_is_caught(tmp_path):
    root = _copy(tmp_path)
    readme = root / "patches" / "README.md"
    text = readme.read_text()
    entry = "\n### ghost\n" + "".join(f"- **{f}:** x\n" for f in FIELDS).replace(
        "- **Patch:** x", "- **Patch:** `patches/ghost.diff`")
    readme.write_text(text + entry)
    assert any("names patches/ghost.diff, which does not exist" in p for p in ledger_problems(root))
    head, sep, tail = text.rpartition("- **Remove when:**")
    readme.write_text(head + "- **Removal:**" + tail)
    assert any("must be" in p for p in ledger_problems(root))


def test_a_missing_version_field_or_seam_is_caught(tmp_path):
    root = _copy(tmp_path)
    readme = root / "patches" / "README.md"
    text = readme.read_text()
    head, ledger = text.split("\n## Ledger\n", 1)
    readme.write_text(head + "\n## Ledger\n" + ledger.replace("- **vLLM 0.32.0:**", "- **vLLM 0.31.0:**", 1))
    assert any("must be" in p for p in ledger_problems(root))
    readme.write_text(text.replace("`_compat.register_lm_head`", "`_compat.no_such_seam`", 1))
    assert any("`_compat.no_such_seam` is not a function" in p for p in ledger_problems(root))
