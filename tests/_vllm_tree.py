"""A copy of the installed vLLM with onespark's .diff files applied, the one way the tests (and the lab, through
lab/harness.py) build one: the files a diff edits, applying a diff exactly, and the patched tree itself.
Standard library only."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def diff_targets(diff: Path) -> list[str]:
    """The files a unified diff edits (its `+++ b/` paths)."""
    import re

    return re.findall(r"^\+\+\+ b/(\S+)", Path(diff).read_text(), flags=re.M)


def apply_diff(diff: Path, root: Path, dry_run: bool = False) -> subprocess.CompletedProcess:
    """`patch -p1 --forward --fuzz=0` of `diff` inside `root` (`git apply` where patch is missing: it works
    outside a repository too); dry_run checks only. A diff applied already fails (--forward), as the images need."""
    import shutil

    diff = str(Path(diff).resolve())
    if shutil.which("patch"):
        cmd = ["patch", "-p1", "--forward", "--fuzz=0", "--batch", "-i", diff] + (["--dry-run"] if dry_run else [])
    else:
        cmd = ["git", "apply", "-p1", diff] + (["--check"] if dry_run else [])
    return subprocess.run(cmd, cwd=root, capture_output=True, text=True)


def patched_vllm(diffs, root: Path) -> Path:
    """A copy of the installed vllm package under `root` with each diff of `diffs` applied, in order: every file
    a symlink into the installed one except the diffs' targets, which are patched copies. Put `root` first on
    PYTHONPATH and that process imports the patched vLLM; the installed one is never modified. `patch
    --fuzz=0` (or `git apply`): a diff that does not apply exactly raises with the tool's own message."""
    import importlib.util
    import shutil

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("no vLLM is installed to patch")
    src = Path(next(iter(spec.submodule_search_locations))).parent
    root = Path(root)
    shutil.copytree(src / "vllm", root / "vllm", symlinks=True, copy_function=os.symlink,
                    ignore=shutil.ignore_patterns("__pycache__"))
    for diff in diffs:
        for rel in diff_targets(diff):
            if (root / rel).is_symlink():  # not yet copied by an earlier diff
                (root / rel).unlink()
                shutil.copyfile(src / rel, root / rel)
        r = apply_diff(diff, root)
        if r.returncode != 0:
            raise RuntimeError(f"{Path(diff).name} does not apply to the installed vLLM ({src}):\n{r.stdout}{r.stderr}")
    return root
