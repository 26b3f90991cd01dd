"""The serving image holds what it runs: steps/4-images.sh fingerprints exactly the files Dockerfile.v2's COPY lines
take from the build context that .dockerignore lets through, and that is the runtime package only (no README, no
bench/lab scripts, no bench/results). Without Docker: steps/lib.sh in a temporary copy of the checkout, checked
against Docker's own .dockerignore rules written out below.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BASH = shutil.which("bash")


@pytest.fixture
def tree(tmp_path) -> Path:
    """A copy of the checkout (what git tracks or would track), plus the caches and lab files a working tree grows."""
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    t = tmp_path / "tree"
    for name in names:
        if (ROOT / name).is_file():  # not one deleted in the working tree
            (t / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, t / name)
    for name in ("onespark/__pycache__/cli.cpython-312.pyc", "kernels/__pycache__/lm_head.cpython-312.pyc",
                 "bench/lab/probe.py", "bench/results/new-run.json", "bench/prompts/README.md"):
        (t / name).parent.mkdir(parents=True, exist_ok=True)
        (t / name).write_text("x\n")
    return t


def _bash(tree: Path, script: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONESPARK_")}
    r = subprocess.run([BASH, "-c", script], cwd=tree, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def _fingerprints(tree: Path) -> dict[str, str]:
    """The fingerprint label of each image that `steps/4-images.sh --tq --dry-run` would build."""
    out = _bash(tree, "steps/4-images.sh --tq --dry-run")
    return {f: fp for fp, f in re.findall(r"--label dev\.onespark\.fingerprint=(\w+) .* -f (\S+)", out)}


# ---- Docker's .dockerignore matching (moby/patternmatcher), independent of steps/lib.sh ----

def _regex(pattern: str) -> re.Pattern:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] in "*?":
            out, i = out + ("[^/]*" if pattern[i] == "*" else "[^/]"), i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def _dockerignore(path: Path) -> list[tuple[bool, re.Pattern]]:
    rules = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keep = line.startswith("!")
            rules.append((keep, _regex(os.path.normpath(line.lstrip("!")).lstrip("/"))))
    return rules


def _in_context(name: str, rules) -> bool:
    """Docker's rule: a pattern matches the file or any directory above it; the last matching pattern wins."""
    parts = name.split("/")
    prefixes = ["/".join(parts[:k]) for k in range(1, len(parts) + 1)]
    inside = True
    for keep, rx in rules:
        if any(rx.match(p) for p in prefixes):
            inside = keep
    return inside


def _copied(tree: Path, dockerfile: str) -> list[str]:
    """What DOCKERFILE's COPY lines bring into the image from the build context."""
    rules = _dockerignore(tree / ".dockerignore")
    files = []
    for line in (tree / dockerfile).read_text().splitlines():
        if line.startswith("COPY "):
            for src in line.split()[1:-1]:
                p = tree / src
                found = [p] if p.is_file() else [f for f in p.rglob("*") if f.is_file()]
                files += [str(f.relative_to(tree)) for f in found]
    return sorted({f for f in files if _in_context(f, rules)})


@pytest.mark.parametrize("dockerfile", ["Dockerfile.v2", "Dockerfile.v2-tq"])
def test_fingerprint_covers_what_the_build_context_and_copy_lines_bring_in(tree, dockerfile):
    fingerprinted = _bash(tree, f"source steps/lib.sh && image_sources {dockerfile}").split()
    assert fingerprinted == _copied(tree, dockerfile)
    if dockerfile == "Dockerfile.v2":
        # The runtime package and what its build reads (pyproject's package-data), nothing else.
        assert {"pyproject.toml", "LICENSE", "kernels/lm_head.py", "patches/turboquant.diff", "bench/cli.py",
                "bench/prompts/published.json", "docker/entrypoint.sh"} <= set(fingerprinted)
        stray = [f for f in fingerprinted if "README" in f or f.endswith(".pyc")
                 or f.startswith(("bench/lab/", "bench/results/"))]
        assert stray == []


@pytest.mark.parametrize("edit, rebuilds", [
    ("README.md", False),
    ("docs/status.md", False),
    ("patches/README.md", False),
    ("bench/results/another-run.json", False),
    ("bench/lab/probe.py", False),
    ("tests/test_images.py", False),
    ("kernels/lm_head.py", True),
    ("onespark/serving/serve.py", True),
    ("bench/prompts/published.json", True),
    ("Dockerfile.v2", True),
], ids=lambda v: str(v))
def test_only_a_runtime_edit_changes_the_fingerprint(tree, edit, rebuilds):
    before = _fingerprints(tree)
    assert set(before) == {"Dockerfile.v2", "Dockerfile.v2-tq"}
    with open(tree / edit, "a") as f:
        f.write("\n")
    after = _fingerprints(tree)
    assert (after["Dockerfile.v2"] != before["Dockerfile.v2"]) == rebuilds, edit


def test_the_package_builds_from_the_image_sources_alone(tree, tmp_path):
    """What Dockerfile.v2's `pip install /opt/onespark/src` does, on exactly the files the image gets."""
    src = tmp_path / "src"
    for name in _bash(tree, "source steps/lib.sh && image_sources Dockerfile.v2").split():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(tree / name, src / name)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                        "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = (tmp_path / "dist").glob("onespark-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for want in ("onespark/kernels/lm_head.py", "onespark/patches/turboquant.diff", "onespark/bench/cli.py",
                 "onespark/bench/prompts/published.json"):
        assert want in names
    assert not [n for n in names if "README" in n or "/lab/" in n or "/results/" in n]


# ---------------------------------------------------------------------------------------------------------
# steps 3-4: a rebuild removes the image its tag named before (steps/lib.sh drop_replaced), with a real engine

def _build(tag: str, n: int, ctx: Path) -> str:
    """A one-label image on an empty base: a rebuild with another n gives the tag a new image ID."""
    (ctx / "Dockerfile").write_text(f"FROM onespark-test/empty:1\nLABEL dev.onespark.test.n={n}\n")
    subprocess.run(["docker", "build", "-q", "-t", tag, str(ctx)], check=True, capture_output=True, timeout=300)
    return _image_id(tag)


def _image_id(ref: str) -> str:
    r = subprocess.run(["docker", "image", "inspect", "--format", "{{.Id}}", ref], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else ""


def _drop_replaced(tag: str, old: str) -> str:
    r = subprocess.run(["bash", "-c", f'source steps/lib.sh && drop_replaced "{tag}" "{old}"'], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.docker
def test_a_rebuild_drops_the_image_its_tag_named_before(tmp_path):
    empty = tmp_path / "empty.tar"
    subprocess.run(["tar", "cf", str(empty), "--files-from", "/dev/null"], check=True)
    subprocess.run(["docker", "import", str(empty), "onespark-test/empty:1"], check=True, capture_output=True)
    tag, keep, box = f"onespark-test/replaced:{os.getpid()}", f"onespark-test/kept:{os.getpid()}", f"onespark-test-{os.getpid()}"
    try:
        a = _build(tag, 1, tmp_path)
        assert _drop_replaced(tag, a) == ""  # not rebuilt: the tag still names it
        b = _build(tag, 2, tmp_path)
        assert b != a and _image_id(a) == a  # the replaced image is still on disk, untagged
        out = _drop_replaced(tag, a)
        assert _image_id(a) == "" and _image_id(tag) == b
        assert out == f"onespark: removed the image {tag} named before this build ({a.removeprefix('sha256:')}) " \
                      "to free its disk\n"
        # a container made from it keeps it, with the note
        subprocess.run(["docker", "create", "--name", box, b, "/x"], check=True, capture_output=True)
        c = _build(tag, 3, tmp_path)
        out = _drop_replaced(tag, b)
        assert _image_id(b) == b and "is still used by a container or another image: docker image prune" in out, out
        # another tag names it: not ours to remove
        subprocess.run(["docker", "tag", c, keep], check=True, capture_output=True)
        _build(tag, 4, tmp_path)
        assert _drop_replaced(tag, c) == "" and _image_id(keep) == c
    finally:
        subprocess.run(["docker", "rm", "-f", box], capture_output=True)
        subprocess.run(["docker", "image", "rm", "-f", tag, keep], capture_output=True)
        subprocess.run(["docker", "image", "prune", "-f", "--filter", "label=dev.onespark.test.n"], capture_output=True)
