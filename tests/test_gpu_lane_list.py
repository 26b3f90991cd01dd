"""The GPU lanes' test lists name tests that exist: tests/gpu.sh runs pytest-xdist, whose workers drop a path that
is not there without a word (a moved file once left the lane at "0 passed"); tests/gpu_vllm/lane.sh's list is
checked the same way, as both run only on a GPU host."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LISTS = {"tests/gpu.sh": "LANE_TESTS", "tests/gpu_vllm/lane.sh": "tests"}


def bash_array(root: Path, script: str, name: str) -> list[str]:
    """The array as bash itself reads it (comments and line breaks included), not as a regex guesses."""
    text = (root / script).read_text()
    m = re.search(rf"^{name}=\(.*?^\)", text, flags=re.S | re.M)
    assert m, f"{script}: no {name}=( ... ) array"
    out = subprocess.run(["bash", "-c", m.group(0) + f'\nprintf "%s\\n" "${{{name}[@]}}"'],
                         capture_output=True, text=True, check=True).stdout
    return out.split()


def defined_tests(path: Path) -> set[str]:
    return {n.name for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test_")}


def missing(root: Path, script: str, name: str) -> list[str]:
    entries = bash_array(root, script, name)
    assert entries, f"{script}: empty list"
    out = []
    for entry in entries:
        file, _, test = entry.partition("::")
        path = root / file
        if not path.is_file():
            out.append(f"{entry}: no file {file}")
        elif test and test not in defined_tests(path):
            out.append(f"{entry}: {file} defines no {test}")
    return out


@pytest.mark.parametrize("script", sorted(LISTS))
def test_every_listed_test_exists(script):
    assert not missing(ROOT, script, LISTS[script]), script


def test_the_check_catches_a_moved_file_and_a_renamed_test(tmp_path):
    """What the lab move did: a listed file that is no longer there, or a test renamed, is named."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_here.py").write_text("def test_one():\n    pass\n")
    (tmp_path / "tests" / "lane.sh").write_text(
        "LANE_TESTS=(\n  tests/test_gone.py  # moved\n  tests/test_here.py::test_one tests/test_here.py::test_two\n)\n")
    assert missing(tmp_path, "tests/lane.sh", "LANE_TESTS") == [
        "tests/test_gone.py: no file tests/test_gone.py",
        "tests/test_here.py::test_two: tests/test_here.py defines no test_two"]
