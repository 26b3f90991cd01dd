"""The lane's time budget (issue 29): vLLM server starts are the lane's dearest work (~30-90 s each on 2 CPU cores),
so they are counted here, per file. A new file that starts servers, or a file that starts more, fails this test
until the start is either a reuse of the shared fixtures (conftest.py's `vllm_server`, the module-scoped servers
of test_plugin_server.py / test_v032_server.py) or is added to SERVER_STARTS with what it checks that no running
server can. And the stage table .ci/run prints (.ci/stage_table.py) judges a run against .ci/budget.txt."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# file -> VLLMServer(...) constructions in it (each a server start; a fixture's counts once however many use it).
SERVER_STARTS = {
    "conftest.py": 1,  # vllm_server: the session's tiny Qwen2-MoE, shared by every plain server test
    "test_draft_head.py": 1,  # a checkpoint with a draft-vocabulary file (the draft head's own load path)
    "test_plugin_server.py": 3,  # the BF16-head and tied-head models, the INT8 side (module fixtures)
    "test_tool_calls_streaming.py": 3,  # patched and stock vLLM trees at --stream-interval 1/3/4/6 (parametrized)
    "test_turboquant_backend.py": 2,  # the TurboQuant cache and its BF16 reference on the patched tree
    "test_v032_server.py": 1,  # _serve: mtp, plain (module fixtures), bf16, tq servers of the 0.32.0 track
    "vllm_server.py": 2,  # the class itself: its docstring's example and its definition's doc line
}
START = re.compile(r"\bVLLMServer\(")


def server_starts(tests: Path) -> dict[str, int]:
    """VLLMServer( constructions per file (this file's own examples aside)."""
    return {p.name: n for p in sorted(tests.glob("*.py"))
            if p.name != Path(__file__).name and (n := len(START.findall(p.read_text()))) > 0}


def over_budget(found: dict[str, int], allowed: dict[str, int]) -> list[str]:
    return [f"tests/{name}: {n} vLLM server start(s), {allowed.get(name, 0)} allowed: reuse the shared server "
            f"fixtures, or add the start to SERVER_STARTS in tests/test_lane_budget.py with what it checks"
            for name, n in found.items() if n > allowed.get(name, 0)]


def test_no_new_server_starts():
    assert over_budget(server_starts(ROOT / "tests"), SERVER_STARTS) == []


def test_a_new_server_start_is_caught(tmp_path):
    for name, n in SERVER_STARTS.items():
        (tmp_path / name).write_text("srv = VLLMServer(model)\n" * n)
    assert over_budget(server_starts(tmp_path), SERVER_STARTS) == []
    (tmp_path / "test_new_feature.py").write_text("def test_x():\n    with VLLMServer(m) as s:\n        pass\n")
    (tmp_path / "conftest.py").write_text("a = VLLMServer(m)\nb = VLLMServer(m)\n")
    assert [x.split(":")[0] for x in over_budget(server_starts(tmp_path), SERVER_STARTS)] == [
        "tests/conftest.py", "tests/test_new_feature.py"]


def _table(tmp_path: Path, rows: list[tuple[str, int]]) -> subprocess.CompletedProcess:
    tsv = tmp_path / "stages.tsv"
    tsv.write_text("".join(f"{name}\t{s}\t0\n" for name, s in rows))
    return subprocess.run([sys.executable, str(ROOT / ".ci/stage_table.py"), str(tsv)], capture_output=True,
                          text=True, timeout=60)


def test_stage_table_judges_cold_and_warm_runs_by_their_own_budget(tmp_path):
    budget = dict(x.split("#")[0].replace(" ", "").split("=") for x in (ROOT / ".ci/budget.txt").read_text()
                  .splitlines() if x.split("#")[0].strip())
    warm, cold, margin = int(budget["warm_s"]), int(budget["cold_s"]), int(budget["margin_pct"])
    ok = _table(tmp_path, [("apt packages", 10), ("pytest, vLLM 0.19.1 track", warm)])
    assert ok.returncode == 0 and "budget (warm:" in ok.stdout and "within" in ok.stdout, ok.stdout
    assert "pytest, vLLM 0.19.1 track" in ok.stdout and f"{warm + 10:>6d} s" in ok.stdout
    slow = _table(tmp_path, [("pytest, vLLM 0.19.1 track", warm * (100 + margin) // 100 + 1)])
    assert slow.returncode == 3 and "OVER" in slow.stdout, slow.stdout
    # a run that found nothing cached is held to the cold budget
    built = _table(tmp_path, [("this run is cold", 0), ("pytest, vLLM 0.19.1 track", cold * (100 + margin) // 100)])
    assert built.returncode == 0 and "budget (cold:" in built.stdout and "within" in built.stdout, built.stdout
    # a cold run past its budget is reported, not failed
    late = _table(tmp_path, [("this run is cold", 0), ("pytest, vLLM 0.19.1 track", cold * (100 + margin) // 100 + 1)])
    assert late.returncode == 0 and "OVER" in late.stdout, late.stdout


def _rows(tmp_path: Path, rows: list[tuple]) -> subprocess.CompletedProcess:
    tsv = tmp_path / "stages.tsv"
    tsv.write_text("".join("\t".join(map(str, (*row[:2], 0, *row[2:]))) + "\n" for row in rows))
    return subprocess.run([sys.executable, str(ROOT / ".ci/stage_table.py"), str(tsv)], capture_output=True,
                          text=True, timeout=60)


def test_tracks_side_by_side_count_once_in_the_total(tmp_path):
    """tests/run.sh runs the tracks at once: their rows say "within" and the wall-time row after them is what the
    total (and so the budget) counts; a run stopped before that row still counts its longest track."""
    warm = int(dict(x.split("#")[0].replace(" ", "").split("=") for x in (ROOT / ".ci/budget.txt").read_text()
                    .splitlines() if x.split("#")[0].strip())["warm_s"])
    side = [("venv .venv (built)", 10), ("pytest, vLLM 0.32.0 track", 700, "within"),
            ("pytest, vLLM 0.19.1 track", 900, "within")]
    done = _rows(tmp_path, [*side, ("pytest, 2 tracks side by side", 905)])
    assert done.returncode == 0 and re.search(r"^total +915 s", done.stdout, re.M), done.stdout
    assert "  pytest, vLLM 0.19.1 track" in done.stdout and "     900 s" in done.stdout
    stopped = _rows(tmp_path, side)
    assert re.search(r"^total +910 s", stopped.stdout, re.M), stopped.stdout
    # the shared row is what the budget judges: past the warm budget fails the run, however the tracks split it
    over = _rows(tmp_path, [*side, ("pytest, 2 tracks side by side", warm * 2)])
    assert over.returncode == 3 and "OVER" in over.stdout, over.stdout


def test_the_venv_holds_its_bytecode():
    """tests/run.sh compiles each venv's bytecode at install (uv --compile-bytecode): with PYTHONDONTWRITEBYTECODE
    set, a venv without .pyc has every vLLM import compile vLLM and torch from source (~2x each server start)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("no vLLM in this venv")
    source = Path(spec.origin).parent / "entrypoints" / "openai" / "api_server.py"  # a server's, not this process's
    assert Path(importlib.util.cache_from_source(str(source))).exists(), \
        f"{source} has no .pyc: rebuild the venv with tests/run.sh (uv pip install --compile-bytecode)"
