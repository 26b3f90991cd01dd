"""Issue 23 (part B): a re-run never keeps stale output as done, synth takes the writers' lock and resumes,
and the bench never loses what it measured. The references are real files (sha256 of what a clean run wrote)
and real child processes (kill -9, a held lock)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from onespark.checkpoint.hybrid import hybrid
from onespark.checkpoint.writer import MANIFEST_FILE
from onespark.shape import describe
from tests._checkpoints import synth_pair
from tests.test_reliability import cli, one_line_error

ROOT = Path(__file__).resolve().parents[1]
SHARD = "model-00002-of-00003.safetensors"


def digest(d: Path, skip=(".onespark.lock",)) -> dict[str, str]:
    """Every file's sha256 but the lock's (it names its last holder)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())
            if p.is_file() and p.name not in skip}


REWRITTEN = (".onespark.lock", MANIFEST_FILE)  # a repair writes a new manifest: its created_utc is now


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """Two INT4 + FP8 pairs of the same shapes and file sizes, from two seeds."""
    return synth_pair(tmp_path_factory.mktemp("a"), seed=1), synth_pair(tmp_path_factory.mktemp("b"), seed=2)


@pytest.fixture
def finished(pairs, tmp_path):
    a, _ = pairs
    out = tmp_path / "hy"
    hybrid(a / "int4", str(a / "fp8"), out, log=lambda m: None)
    return out


# ---- item 3: the done-check compares all inputs -----------------------------------------------------------

@pytest.mark.parametrize("other", ["fp8", "int4", "fp8-hub"])
def test_other_inputs_into_a_finished_out_are_refused(pairs, finished, other):
    a, b = pairs
    for f in ("model-00001-of-00003.safetensors", SHARD):  # same names and sizes: only the content differs
        assert (a / "int4" / f).stat().st_size == (b / "int4" / f).stat().st_size
    before = digest(finished)
    int4, fp8 = a / "int4", str(a / "fp8")
    if other == "fp8":
        fp8 = str(b / "fp8")
    elif other == "int4":
        int4 = b / "int4"
    else:
        fp8 = "hf:Qwen/Qwen3.5-122B-A10B-FP8"  # refused before anything is fetched (no network here)
    r = cli("hybrid", "--int4", str(int4), "--fp8", fp8, "--out", str(finished))
    last = one_line_error(r, "hybrid")
    assert f"{finished} holds step-1 output of other inputs (--{other.split('-')[0]} " in last, last
    assert last.endswith("choose a new --out or remove it (nothing was changed)"), last
    assert digest(finished) == before
    assert not any(finished.parent.glob(".*fp8-fetch"))


def test_same_inputs_are_already_done(pairs, finished):
    a, _ = pairs
    logs: list[str] = []
    hybrid(a / "int4", str(a / "fp8"), finished, log=logs.append)
    assert any("step 1 already done" in m for m in logs), logs
    man = json.loads((finished / MANIFEST_FILE).read_text())
    assert set(man["inputs"]["int4"]["files"]) >= {SHARD, "config.json"}
    assert set(man["inputs"]["fp8"]["files"]) >= {"config.json"}
    assert all(len(e["header_sha256"]) == 64 for f, e in man["files"].items() if f.endswith(".safetensors"))


def _edit_header(path: Path, edit) -> None:
    """Rewrite a shard's JSON header in place, same length (padding absorbs the change): it still parses."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    doc = json.loads(data[8:8 + n])
    edit(doc)
    raw = json.dumps(doc, separators=(",", ":")).encode()
    assert len(raw) <= n
    path.write_bytes(data[:8] + raw + b" " * (n - len(raw)) + data[8 + n:])


@pytest.mark.parametrize("how", ["dtype", "shape"])
def test_an_edited_header_is_repaired_not_already_done(pairs, finished, how):
    a, _ = pairs
    want = digest(finished, REWRITTEN)

    def edit(doc):  # the first 16-bit matrix that is not square
        t = next(v for k, v in doc.items() if k != "__metadata__" and v["dtype"] == "BF16" and len(v["shape"]) == 2
                 and v["shape"][0] != v["shape"][1])
        if how == "dtype":
            t["dtype"] = "F16"  # BF16 bytes read as another number
        else:
            t["shape"] = t["shape"][::-1]  # [1, H] -> [H, 1]: same bytes, another layout

    _edit_header(finished / SHARD, edit)
    logs: list[str] = []
    hybrid(a / "int4", str(a / "fp8"), finished, log=logs.append)
    assert not any("already done" in m for m in logs), logs
    assert any("step 1 output damaged" in m and f"{SHARD}'s header is not the one written" in m for m in logs), logs
    assert digest(finished, REWRITTEN) == want  # byte-identical to the clean run


def test_an_edited_config_is_repaired(pairs, finished):
    a, _ = pairs
    want = digest(finished, REWRITTEN)
    text = (finished / "config.json").read_text()
    assert '"rms_norm_eps": 1e-06' in text
    (finished / "config.json").write_text(text.replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 2e-06'))  # same size
    logs: list[str] = []
    hybrid(a / "int4", str(a / "fp8"), finished, log=logs.append)
    assert any("config.json" in m and "step 1 output damaged" in m for m in logs), logs
    assert digest(finished, REWRITTEN) == want


def test_a_killed_run_resumed_with_other_inputs_starts_over(pairs, tmp_path, monkeypatch):
    """The progress record's fingerprint covers the inputs' contents: a run killed on pair A and resumed on
    pair B (same names, shapes and sizes) keeps nothing of A's."""
    a, b = pairs
    ref = tmp_path / "ref"
    hybrid(b / "int4", str(b / "fp8"), ref, log=lambda m: None)
    out = tmp_path / "hy"
    import onespark.checkpoint.hybrid as hy
    real = hy.Writer.write
    calls = []

    def die_after_one(self, o):
        if calls:
            raise KeyboardInterrupt
        calls.append(o.name)
        return real(self, o)

    with monkeypatch.context() as mp:
        mp.setattr(hy.Writer, "write", die_after_one)
        with pytest.raises(KeyboardInterrupt):
            hybrid(a / "int4", str(a / "fp8"), out, log=lambda m: None)
    logs: list[str] = []
    hybrid(b / "int4", str(b / "fp8"), out, log=logs.append)
    assert "inputs changed since the interrupted run: starting over" in logs, logs
    skip = {MANIFEST_FILE}
    assert {k: v for k, v in digest(out).items() if k not in skip} == \
        {k: v for k, v in digest(ref).items() if k not in skip}


def test_step_2_killed_between_index_and_manifest_finishes_on_rerun(pairs, finished, monkeypatch):
    """Step 2 writes the index, then records it in step 1's manifest: a run killed between the two is finished by
    the next one (the manifest brought up to date), not "already done" with a manifest that verify refuses."""
    import onespark.checkpoint.mtp as step2
    from onespark.checkpoint.verify import verify

    def killed(*a):
        raise KeyboardInterrupt

    with monkeypatch.context() as mp:
        mp.setattr(step2, "_record_in_manifest", killed)
        with pytest.raises(KeyboardInterrupt):
            step2.mtp(finished, log=lambda m: None)
    logs: list[str] = []
    step2.mtp(finished, log=logs.append)
    assert any("updated to the index an interrupted step 2 wrote" in m for m in logs), logs
    assert verify(finished)[0] == []
    logs.clear()
    step2.mtp(finished, log=logs.append)
    assert len(logs) == 1 and "step 2 already done" in logs[0], logs


@pytest.mark.parametrize("progress", ["[]", '{"fingerprint": "F", "done": []}', '{"fingerprint": "F", "done": {"S": 3}}',
                                      '{"fingerprint": "F", "done": {"S": {}}}', "{not json"],
                         ids=["list", "done-list", "entry-number", "entry-no-size", "not-json"])
def test_a_damaged_progress_record_starts_over(pairs, tmp_path, progress, monkeypatch):
    """A killed run's progress record that does not say what was written (another shape, not JSON) is one of
    unknown inputs: the run starts over and finishes, never a traceback, and keeps nothing on its word."""
    a, _ = pairs
    ref = tmp_path / "ref"
    hybrid(a / "int4", str(a / "fp8"), ref, log=lambda m: None)
    out = tmp_path / "hy"
    import onespark.checkpoint.hybrid as hy
    real, fingerprints = hy.Writer.resume, []

    def dies_at_resume(self, fingerprint, *rest):  # a run killed right after its progress record was written
        fingerprints.append(fingerprint)
        real(self, fingerprint, *rest)
        self.begin()
        raise KeyboardInterrupt

    with monkeypatch.context() as mp:
        mp.setattr(hy.Writer, "resume", dies_at_resume)
        with pytest.raises(KeyboardInterrupt):
            hybrid(a / "int4", str(a / "fp8"), out, log=lambda m: None)
    (out / SHARD).write_bytes(b"\0" * (a / "int4" / SHARD).stat().st_size)  # a file the record must not vouch for
    (out / hy.PROGRESS_FILE).write_text(progress.replace('"F"', json.dumps(fingerprints[0])).replace('"S"', json.dumps(SHARD)))
    logs: list[str] = []
    hybrid(a / "int4", str(a / "fp8"), out, log=logs.append)
    assert any(hy.PROGRESS_FILE in m and m.endswith("starting over") for m in logs), logs
    skip = {MANIFEST_FILE, ".onespark.lock"}
    assert {k: v for k, v in digest(out).items() if k not in skip} == \
        {k: v for k, v in digest(ref).items() if k not in skip}


@pytest.mark.parametrize("side", ["int4", "fp8"])
def test_a_manifest_whose_inputs_are_not_objects_is_one_line_with_a_fix_that_works(pairs, finished, side):
    a, _ = pairs
    man = json.loads((finished / MANIFEST_FILE).read_text())
    man["inputs"][side] = [man["inputs"][side]]
    (finished / MANIFEST_FILE).write_text(json.dumps(man))
    args = ("hybrid", "--int4", str(a / "int4"), "--fp8", str(a / "fp8"), "--out", str(finished))
    last = one_line_error(cli(*args), "hybrid")
    assert f"inputs.{side} is a list of 1, expected an object or null" in last, last
    assert last.endswith("remove the directory that holds it, then run step 1 again"), last
    for p in finished.iterdir():  # what the fix says (deleting the manifest alone: step 1 refuses the directory)
        p.unlink()
    finished.rmdir()
    assert cli(*args).returncode == 0


@pytest.mark.parametrize("name", ["../outside.txt", "OUTSIDE", ".", "", "a\0b"],
                         ids=["dotdot", "absolute", "dot", "empty", "nul"])
def test_a_manifest_that_lists_a_path_is_one_line_and_nothing_outside_is_read(pairs, finished, name):
    """The manifest's file names are joined to the checkpoint directory: "/etc/passwd" or "../x" made step 1
    and verify stat and hash a file outside it (and verify said "delete it"). Only plain names load."""
    a, _ = pairs
    outside = finished.parent / "outside.txt"
    outside.write_text("not the checkpoint's")
    name = str(outside) if name == "OUTSIDE" else name
    man = json.loads((finished / MANIFEST_FILE).read_text())
    man["files"][name] = {"size": outside.stat().st_size, "sha256": "0" * 64}
    (finished / MANIFEST_FILE).write_text(json.dumps(man))
    want = f"{finished / MANIFEST_FILE} (manifest): a key of files is {describe(name)}, expected a plain file name"
    for args in (("verify", str(finished)), ("mtp", str(finished)),
                 ("hybrid", "--int4", str(a / "int4"), "--fp8", str(a / "fp8"), "--out", str(finished))):
        last = one_line_error(cli(*args), args[0])
        assert want in last and last.endswith("remove the directory that holds it, then run step 1 again"), last


# ---- item 4: nothing measured is lost ---------------------------------------------------------------------

# The bench in a child whose --out (and, where the test says so, its temp and home directories) fails at the
# final write with ENOSPC or EACCES, after the run, as a disk filling up or a permission change would.
FAILING_OUT = """
import errno, sys
from pathlib import Path
from onespark.bench import report
dirs = [Path(d).resolve() for d in sys.argv[1].split(",")]
code, keep_json = getattr(errno, sys.argv[2]), sys.argv[3] == "1"
real = report.write_atomic
def failing(path, data):
    path = Path(path)
    if path.parent.resolve() in dirs and not (keep_json and path.suffix == ".json"):
        raise OSError(code, "refused by the test", str(path))
    return real(path, data)
report.write_atomic = failing
from onespark.cli import main
sys.exit(main(sys.argv[4:]))
"""


def _bench(tmp_path: Path, code: str, keep_json: bool, tmp: Path, home: Path, failing: tuple = ()):
    from tests._openai_standin import StandIn
    out = tmp_path / "out"
    with StandIn() as srv:
        args = ["bench", "--base-url", srv.base_url, "--suite", "published", "--classes", "Q&A", "--runs", "1",
                "--warmup", "0", "--max-tokens", "3", "--no-png", "--no-progress", "--out", str(out), "--name", "r"]
        env = dict(os.environ, TMPDIR=str(tmp), HOME=str(home))
        dirs = ",".join(map(str, (out, *failing)))
        return out, subprocess.run([sys.executable, "-c", FAILING_OUT, dirs, code, "1" if keep_json else "0",
                                    *args], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)


def _is_result(doc: dict) -> None:
    assert doc["kind"] == "onespark-bench" and doc["requests"] == 1 and doc["failed_requests"] == 0
    assert doc["suites"]["published"]["rows"][0]["ok"]


@pytest.mark.parametrize("code", ["ENOSPC", "EACCES"])
def test_a_failed_final_write_keeps_the_measurements_in_the_temp_dir(tmp_path, code):
    tmp, home = tmp_path / "tmp", tmp_path / "home"
    tmp.mkdir(), home.mkdir()
    out, r = _bench(tmp_path, code, False, tmp, home)
    last = one_line_error(r, "bench")
    kept = tmp / "onespark-bench-r.json"
    assert f"could not write the results ({out / 'r.json'}: " in last, last
    assert f"the measurements are saved in {kept} instead" in last, last
    assert "finished files are kept" not in r.stderr  # nothing of it is in --out
    assert not (out / "r.json").exists()
    _is_result(json.loads(kept.read_text()))
    assert "published" in r.stdout  # the tables were printed too


def test_the_next_failed_run_of_the_same_name_never_overwrites_the_kept_copy(tmp_path):
    """Issue 58: the fallback was always TMPDIR/onespark-bench-NAME.json, written over by the next failed run of
    that --name (or over whatever file had that name). Each run gets its own file, the first name that is free."""
    tmp, home = tmp_path / "tmp", tmp_path / "home"
    tmp.mkdir(), home.mkdir()
    (tmp / "onespark-bench-r-2.json").write_text("someone else's file\n")
    kept = []
    for _ in range(2):
        _, r = _bench(tmp_path, "ENOSPC", False, tmp, home)
        last = one_line_error(r, "bench")
        kept.append(Path(re.search(r"the measurements are saved in (\S+) instead", last)[1]))
    assert kept == [tmp / "onespark-bench-r.json", tmp / "onespark-bench-r-3.json"], kept
    first = kept[0].read_text()
    _is_result(json.loads(first)), _is_result(json.loads(kept[1].read_text()))
    assert first != kept[1].read_text()  # two runs, two records (created_utc, timings)
    assert (tmp / "onespark-bench-r-2.json").read_text() == "someone else's file\n"
    assert sorted(p.name for p in tmp.iterdir()) == ["onespark-bench-r-2.json", "onespark-bench-r-3.json",
                                                     "onespark-bench-r.json"]  # no temp file left behind


def test_with_nowhere_to_write_the_measurements_are_printed_as_json(tmp_path):
    tmp, home = tmp_path / "tmp", tmp_path / "home"
    tmp.mkdir(), home.mkdir()
    out, r = _bench(tmp_path, "ENOSPC", False, tmp, home, failing=(tmp, home))
    last = one_line_error(r, "bench")
    assert "the measurements are the JSON printed above on stdout" in last, last
    start = r.stdout.index("{\n")
    doc, _ = json.JSONDecoder().raw_decode(r.stdout[start:])
    _is_result(doc)


def test_when_only_the_tables_fail_the_json_in_out_is_named(tmp_path):
    out, r = _bench(tmp_path, "ENOSPC", True, tmp_path, tmp_path)
    last = one_line_error(r, "bench")
    assert f"the measurements are in {out / 'r.json'}, the tables are printed above" in last, last
    _is_result(json.loads((out / "r.json").read_text()))
    assert not (tmp_path / "onespark-bench-r.json").exists()


# ---- item 5: synth takes the writers' lock and resumes -------------------------------------------------------

# synth in a child that stops before its second shard: until `go` exists (the lock test), or for good, to be
# killed there with SIGKILL (the resume test). `started` says it got there.
HELD_SYNTH = """
import os, sys, time
import onespark.checkpoint.synth as s
real = s.write_safetensors
go, started = sys.argv.pop(1), sys.argv.pop(1)
calls = []
def held(*a, **kw):
    if calls:
        open(started, "w").close()
        deadline = time.monotonic() + 120
        while not os.path.exists(go) and time.monotonic() < deadline:
            time.sleep(0.01)
    calls.append(1)
    return real(*a, **kw)
s.write_safetensors = held
from onespark.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _held_synth(tmp_path: Path, *args: str) -> tuple[subprocess.Popen, Path]:
    go, started = tmp_path / "go", tmp_path / "started"
    child = subprocess.Popen([sys.executable, "-c", HELD_SYNTH, str(go), str(started), "synth", *args], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not started.exists() and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert child.poll() is None, child.stdout.read()
    return child, go


def _synth_args(out: Path, seed: int = 0) -> list[str]:
    return ["--format", "int4", "--out", str(out), "--seed", str(seed)]


@pytest.fixture(scope="module")
def clean_synth(tmp_path_factory):
    """What an uninterrupted synth writes, for seeds 0 and 1."""
    d = tmp_path_factory.mktemp("clean")
    for seed in (0, 1):
        r = cli("synth", *_synth_args(d / str(seed), seed))
        assert r.returncode == 0, r.stderr
    return d


def test_two_synth_runs_into_one_out_the_second_is_refused(tmp_path, clean_synth):
    out = tmp_path / "s"
    first, go = _held_synth(tmp_path, *_synth_args(out))
    last = one_line_error(cli("synth", *_synth_args(out, seed=1)), "synth")
    assert f"--out {out} is in use by pid {first.pid} (" in last, last
    assert "(onespark synth --format int4" in last, last  # the holder's command as the CLI records it
    go.touch()
    assert first.wait(timeout=300) == 0, first.stdout.read()
    assert digest(out) == digest(clean_synth / "0")  # the refused run wrote nothing into it


@pytest.mark.parametrize("then", ["same", "other"])
def test_a_killed_synth_resumes_or_starts_over(tmp_path, clean_synth, then):
    out = tmp_path / "s"
    first, _ = _held_synth(tmp_path, *_synth_args(out))
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=60)
    assert any(out.glob("*.safetensors")) and (out / ".onespark-synth-progress.json").is_file()
    seed = 0 if then == "same" else 1
    r = cli("synth", *_synth_args(out, seed))  # what the kill/disk-full advice says: the same command again
    assert r.returncode == 0, r.stdout + r.stderr
    assert ("resuming: 1 file(s) already written" if then == "same" else "starting over") in r.stdout, r.stdout
    assert digest(out) == digest(clean_synth / str(seed))
    last = one_line_error(cli("synth", *_synth_args(out, seed)), "synth")  # a finished one is never overwritten
    assert "exists and is not empty: choose a new --out" in last, last
