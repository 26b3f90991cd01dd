"""Issue 12: damaged outputs, OS errors, locks, secrets, strict verify, bench answers of the wrong shape,
no surprise network. Every test here failed before its fix; the references are real files (sha256 of what a
clean run wrote), real permission bits and filesystems, and a real HTTP server standing in for the Hub.
"""

from __future__ import annotations

import ast
import errno
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from onespark.checkpoint.hybrid import hybrid
from onespark.checkpoint.mtp import mtp
from onespark.checkpoint.verify import verify
from onespark.checkpoint.writer import MANIFEST_FILE
from onespark.errors import UserError
from tests._checkpoints import synth_pair
from tests._hub import hub_env

ROOT = Path(__file__).resolve().parents[1]
SHARD = "model-00002-of-00003.safetensors"
EXTRA = "model_extra_tensors.safetensors"


def digest(d: Path, skip=(MANIFEST_FILE, ".onespark.lock")) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())
            if p.is_file() and p.name not in skip}


def cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "onespark", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, **kw)


def one_line_error(r: subprocess.CompletedProcess, command: str) -> str:
    """The last stderr line, asserting it is the CLI's one-line error and no traceback was printed."""
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"onespark {command}: error: "), r.stderr
    return last


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return synth_pair(tmp_path_factory.mktemp("pair"), seed=5)


@pytest.fixture(scope="module")
def finished(pair, tmp_path_factory):
    """Steps 1 and 2 run cleanly once: the reference every repaired output must equal byte for byte."""
    out = tmp_path_factory.mktemp("finished") / "hy"
    hybrid(pair / "int4", str(pair / "fp8"), out, log=lambda m: None)
    mtp(out, log=lambda m: None)
    assert verify(out)[0] == []
    return out


def _clone(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


# ---- item 2: a damaged step-1 output is never "already done" -----------------------------------------------

@pytest.mark.parametrize("damage", ["delete", "truncate"])
def test_damaged_hybrid_output_is_repaired_not_already_done(pair, finished, tmp_path, damage):
    out = _clone(finished, tmp_path / "hy")
    want = digest(finished)
    if damage == "delete":
        (out / SHARD).unlink()
    else:
        data = (out / SHARD).read_bytes()
        (out / SHARD).write_bytes(data[: len(data) // 2])
    # verify and mtp name step 1 (the step that makes the file), not "download it again"
    with pytest.raises(UserError, match=r"step 1 wrote it: re-run step 1") as e:
        verify(out)
    assert "download" not in str(e.value)
    with pytest.raises(UserError, match=r"step 1 wrote it: re-run step 1"):
        mtp(out, log=lambda m: None)
    logs: list[str] = []
    hybrid(pair / "int4", str(pair / "fp8"), out, log=logs.append)
    assert not any("already done" in m for m in logs), logs
    assert any("step 1 output damaged" in m and SHARD in m for m in logs), logs
    assert digest(out) == want  # byte-identical to the clean run, index with step 2's mtp.* entries included
    assert verify(out)[0] == []
    man = json.loads((out / MANIFEST_FILE).read_text())
    assert "mtp" in man["steps"]  # step 2's record survives: its index was intact and kept
    logs.clear()
    hybrid(pair / "int4", str(pair / "fp8"), out, log=logs.append)
    assert any("step 1 already done" in m for m in logs), logs


def test_every_file_damaged_is_a_repair_not_a_foreign_directory(pair, finished, tmp_path):
    out = _clone(finished, tmp_path / "hy")
    for f in json.loads((out / MANIFEST_FILE).read_text())["files"]:
        (out / f).unlink()
    logs: list[str] = []
    hybrid(pair / "int4", str(pair / "fp8"), out, log=logs.append)
    assert any("step 1 output damaged" in m for m in logs) and any("run step 2 again" in m for m in logs), logs
    assert "mtp" not in json.loads((out / MANIFEST_FILE).read_text())["steps"]  # its index entries are gone
    mtp(out, log=lambda m: None)
    assert digest(out) == digest(finished) and verify(out)[0] == []


def test_damaged_index_is_rewritten_and_step_2_is_asked_for(pair, finished, tmp_path):
    out = _clone(finished, tmp_path / "hy")
    (out / "model.safetensors.index.json").write_text("{")
    logs: list[str] = []
    hybrid(pair / "int4", str(pair / "fp8"), out, log=logs.append)
    assert any("run step 2 again" in m for m in logs), logs
    mtp(out, log=lambda m: None)
    assert digest(out) == digest(finished)
    assert verify(out)[0] == []


def test_verify_says_what_to_do_about_each_damaged_file_and_step_1_does_it(pair, finished, tmp_path):
    out = _clone(finished, tmp_path / "hy")
    (out / "generation_config.json").unlink()  # a file step 1 copies as is
    data = bytearray((out / SHARD).read_bytes())
    data[-1] ^= 0xFF  # same size, one byte of tensor data changed: only the sha256 sees it
    (out / SHARD).write_bytes(bytes(data))
    problems, _ = verify(out)
    assert "generation_config.json is in the manifest but missing: run step 1 again with the same --out (it " \
           "rewrites missing or damaged files)" in problems, problems
    assert f"{SHARD}: sha256 differs from the manifest (the file changed or is corrupt): delete it, then run " \
           "step 1 again with the same --out (it rewrites missing or damaged files)" in problems, problems
    (out / SHARD).unlink()  # as the message says
    hybrid(pair / "int4", str(pair / "fp8"), out, log=lambda m: None)
    assert digest(out) == digest(finished) and verify(out)[0] == []


# ---- item 3: `mtp --source` restores the head's file deleted after step 2 ------------------------------------

def test_mtp_source_restores_extra_file_deleted_after_step_2(pair, finished, tmp_path):
    out = _clone(finished, tmp_path / "hy")
    (out / EXTRA).unlink()  # the index (step 2) lists the 785-style mtp.* tensors in it
    r = cli("mtp", str(out), "--source", str(pair / "int4"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"copying {EXTRA}" in r.stdout
    assert (out / EXTRA).read_bytes() == (pair / "int4" / EXTRA).read_bytes()
    assert digest(out) == digest(finished)
    assert verify(out)[0] == []  # the manifest's entry for the copied file matches again


# ---- item 4: operating-system errors are one line naming the path, in every command --------------------------
# Permission bits do not stop root: as root, the commands run without the capabilities that override them
# (setpriv drops CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH), so chmod means what it says, as for any user.
# Disk full and out of inodes come from a small tmpfs.

NO_DAC = (["setpriv", "--inh-caps=-dac_override,-dac_read_search",
           "--bounding-set=-dac_override,-dac_read_search"] if os.geteuid() == 0 else [])
needs_permission_bits = pytest.mark.skipif(
    bool(NO_DAC) and shutil.which("setpriv") is None,
    reason="as root, permission bits need setpriv (util-linux) to drop the capabilities that override them")


def ucli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(NO_DAC + [sys.executable, "-m", "onespark", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


IN_THE_WAY = "(exists and is not a directory|is, or lies under, a file where a directory is expected)"


def _tmpfs(path: Path, opts: str) -> bool:
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True)
    return r.returncode == 0


@pytest.fixture
def small_fs(tmp_path):
    """mount(dir, 'size=..,nr_inodes=..') -> a fresh tmpfs there (skips where mounting is not allowed)."""
    mounted = []

    def mount(name: str, opts: str) -> Path:
        p = tmp_path / name
        if not _tmpfs(p, opts + ",mode=0777"):
            pytest.skip("cannot mount a tmpfs here (not root); test_disk_full_in_process covers ENOSPC")
        mounted.append(p)
        return p

    yield mount
    for p in mounted:
        subprocess.run(["umount", str(p)], check=False)


def _unreadable_copy(src: Path, dst: Path, name: str) -> Path:
    d = _clone(src, dst)
    os.chmod(d / name, 0)
    return d


@needs_permission_bits
def test_permission_denied_not_a_directory_and_file_in_the_way(pair, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o555)
    last = one_line_error(ucli("synth", "--format", "int4", "--out", str(ro / "x")), "synth")
    assert f"{ro / 'x'}: permission denied" in last, last
    (tmp_path / "afile").write_text("x")
    last = one_line_error(ucli("synth", "--format", "int4", "--out", str(tmp_path / "afile")), "synth")
    assert re.search(f"{tmp_path / 'afile'}: {IN_THE_WAY}", last), last
    last = one_line_error(ucli("synth", "--format", "int4", "--out", str(tmp_path / "afile" / "sub")), "synth")
    assert str(tmp_path / "afile") in last and "a file where a directory is expected" in last, last
    last = one_line_error(ucli("download", "--dest", str(ro / "models")), "download")
    assert f"{ro / 'models'}: permission denied" in last, last
    last = one_line_error(ucli("bench", "--out", str(tmp_path / "afile"), "--base-url", "http://127.0.0.1:9"), "bench")
    assert re.search(f"{tmp_path / 'afile'}: {IN_THE_WAY}", last), last  # before any request is sent
    last = one_line_error(ucli("doctor", "--demo", "--meminfo", str(tmp_path)), "doctor")
    assert f"{tmp_path}: is a directory where a file is expected" in last, last
    r = ucli("doctor", "--skip-hf", "--work", str(tmp_path / "afile"))
    assert "Traceback" not in r.stderr and "is a file, not a directory" in r.stdout, r.stdout + r.stderr


@needs_permission_bits
def test_unreadable_inputs_fail_before_the_copy(pair, tmp_path):
    # an input the step never parses (copied as is, last): refused before the first output byte
    int4 = _unreadable_copy(pair / "int4", tmp_path / "int4", "generation_config.json")
    last = one_line_error(ucli("hybrid", "--int4", str(int4), "--fp8", str(pair / "fp8"), "--out",
                               str(tmp_path / "out")), "hybrid")
    assert f"{int4 / 'generation_config.json'}: permission denied" in last, last
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("*.safetensors"))
    bad = _unreadable_copy(pair / "int4", tmp_path / "int4b", SHARD)
    last = one_line_error(ucli("verify", str(bad)), "verify")
    assert f"{bad / SHARD}: permission denied" in last, last
    last = one_line_error(ucli("hybrid", "--int4", str(bad), "--fp8", str(pair / "fp8"), "--out",
                               str(tmp_path / "out2")), "hybrid")
    assert f"{bad / SHARD}: permission denied" in last, last


@needs_permission_bits
def test_mtp_into_a_directory_it_may_not_write(pair, tmp_path):
    out = tmp_path / "hy"
    hybrid(pair / "int4", str(pair / "fp8"), out, log=lambda m: None)
    os.chmod(out, 0o555)
    try:
        last = one_line_error(ucli("mtp", str(out)), "mtp")
    finally:
        os.chmod(out, 0o755)
    assert f"{out / 'model.safetensors.index.json'}: permission denied" in last, last


def test_disk_full_and_out_of_inodes(pair, small_fs):
    full = small_fs("full", "size=256k")
    last = one_line_error(cli("synth", "--format", "int4", "--out", str(full / "ck")), "synth")
    assert f"{full / 'ck'}/" in last and "no space left on the device" in last and "df -i" in last, last
    assert not [p for p in (full / "ck").iterdir() if ".tmp-" in p.name]  # no temp file left behind
    inodes = small_fs("inodes", "size=64m,nr_inodes=6")  # room for the bytes, not for the files
    last = one_line_error(cli("hybrid", "--int4", str(pair / "int4"), "--fp8", str(pair / "fp8"), "--out",
                              str(inodes / "hy")), "hybrid")
    assert f"{inodes / 'hy'}/" in last and "out of inodes" in last, last


@pytest.mark.parametrize("opts, where", [("size=64k", "model.safetensors"), ("size=64m,nr_inodes=3", "tokenizer.json")])
def test_tiny_model_on_a_full_disk_names_the_file(small_fs, opts, where):
    """Issue 58: a full disk was "(unknown path)" (the write names no file), and out of inodes the tokenizers
    library's own save raised a bare Exception: a traceback. The file is named as --out's, the temp dir removed."""
    full = small_fs("full", opts)
    last = one_line_error(cli("tiny-model", "--out", str(full / "t")), "tiny-model")
    assert last.startswith(f"onespark tiny-model: error: {full / 't' / where}: no space left on the device"), last
    assert list(full.iterdir()) == []


def test_verify_says_a_tiny_model_is_one(tmp_path):
    """Issue 58: verify on `onespark tiny-model`'s output said the index was missing, "download it again"."""
    out = tmp_path / "tiny"
    assert cli("tiny-model", "--out", str(out)).returncode == 0
    last = one_line_error(cli("verify", str(out)), "verify")
    assert last == (f"onespark verify: error: {out}: a tiny test model that `onespark tiny-model` wrote "
                    "(onespark-tiny.json), not a checkpoint verify checks (step 0's downloads, the output of steps "
                    "1-2); if it is damaged, write it again with `onespark tiny-model --out NEWDIR`"), last


def test_disk_full_in_process(pair, tmp_path, monkeypatch, capsys):
    """ENOSPC from a descriptor-level write names the file being written (the kernel gives no path)."""
    from onespark import cli as cli_mod

    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "copy_file_range", full, raising=False)
    monkeypatch.setattr(os, "write", full)
    rc = cli_mod.main(["hybrid", "--int4", str(pair / "int4"), "--fp8", str(pair / "fp8"),
                       "--out", str(tmp_path / "hy")])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 1 and err.startswith("onespark hybrid: error: "), err
    assert f"{tmp_path / 'hy'}/model-00001-of-00003.safetensors: no space left" in err, err


# ---- item 5: no abbreviations, keys from a file or the environment, redacted by value ------------------------

def _parser_calls(path: Path):
    """(line, allow_abbrev keyword or None) of every ArgumentParser(...) / add_parser(...) call in a file."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if name in ("ArgumentParser", "add_parser", "Parser"):
                kw = next((k.value for k in node.keywords if k.arg == "allow_abbrev"), None)
                yield node.lineno, kw


def test_every_parser_turns_abbreviations_off():
    tracked = subprocess.run(["git", "ls-files", "onespark", "bench", "patches", "kernels", "lab"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    files = [ROOT / f for f in tracked if f.endswith(".py")]
    calls = [(f, line, kw) for f in files for line, kw in _parser_calls(f)]
    assert len(calls) >= 7  # the CLI's, bench compare's and the lab scripts'
    bad = [f"{f.relative_to(ROOT)}:{line}" for f, line, kw in calls
           if not (isinstance(kw, ast.Constant) and kw.value is False)]
    assert not bad, f"parsers that accept abbreviations: {bad}"


def test_abbreviated_key_flag_is_refused_and_not_echoed(tmp_path):
    key = "sk-abbrev-0123456789"
    for argv in (["bench", "--api-ke", key, "--out", str(tmp_path)], ["bench", "--no-png", "--api-ke", key],
                 ["hybrid", "--int", "a", "--fp8", "b", "--out", "c"]):
        r = cli(*argv)
        assert r.returncode == 2, (argv, r.stdout, r.stderr)
        assert key not in r.stdout + r.stderr
    assert not list(tmp_path.iterdir())  # nothing ran, nothing recorded


def _bench_args(srv, out: Path, *extra: str) -> list[str]:
    return ["bench", "--base-url", srv.base_url, "--suite", "published", "--classes", "Q&A", "--runs", "1",
            "--warmup", "0", "--max-tokens", "3", "--no-png", "--no-progress", "--out", str(out), "--name", "r",
            *extra]


def test_api_key_from_file_or_env_reaches_the_server_and_no_record(tmp_path):
    from tests._openai_standin import StandIn
    key = "sk-file-key-0123456789"
    (tmp_path / "key").write_text(key + "\n")
    os.chmod(tmp_path / "key", 0o600)
    env = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "ONESPARK_API_KEY")}
    with StandIn() as srv:
        r = cli(*_bench_args(srv, tmp_path / "a", "--api-key-file", str(tmp_path / "key"),
                             "--note", f"served with key {key}"), env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        assert set(srv.auth) == {f"Bearer {key}"}
        r2 = cli(*_bench_args(srv, tmp_path / "b", "--note", f"key={key}"), env=dict(env, OPENAI_API_KEY=key))
        assert r2.returncode == 0, r2.stdout + r2.stderr
        assert set(srv.auth) == {f"Bearer {key}"}
        r3 = cli(*_bench_args(srv, tmp_path / "c", f"--api-key={key}"), env=env)
        assert r3.returncode == 0 and "--api-key shows the key" in r3.stderr, r3.stderr
    for d, run in ((tmp_path / "a", r), (tmp_path / "b", r2), (tmp_path / "c", r3)):
        text = (d / "r.json").read_text() + (d / "r.md").read_text() + run.stdout + run.stderr
        assert key not in text, d
    rec = json.loads((tmp_path / "a" / "r.json").read_text())
    assert rec["note"] == "served with key ***" and rec["requests"] == 1 and rec["failed_requests"] == 0
    assert "--api-key=***" in json.loads((tmp_path / "c" / "r.json").read_text())["command"]


# ---- item 6: one writer per output directory -------------------------------------------------------------

HELD_CHILD = """
import os, sys, time
import onespark.checkpoint.safetensors_io as io
real = io.copy_range
go = sys.argv.pop(1)
def held(*a):  # the test's brake: the first run copies nothing until the test has tried the second one
    deadline = time.monotonic() + 120
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.01)
    real(*a)
io.copy_range = held
from onespark.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_second_writer_is_refused_naming_the_holder(pair, finished, tmp_path):
    out = tmp_path / "hy"
    args = ["hybrid", "--int4", str(pair / "int4"), "--fp8", str(pair / "fp8"), "--out", str(out)]
    go = tmp_path / "go"
    first = subprocess.Popen([sys.executable, "-c", HELD_CHILD, str(go), *args], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    lock = out / ".onespark.lock"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (lock.is_file() and lock.read_text() and list(out.glob(".*.tmp-*"))
                                               ) and first.poll() is None:
        time.sleep(0.005)
    assert first.poll() is None, "the first run ended before the second one could start"
    second = cli(*args)
    last = one_line_error(second, "hybrid")
    assert f"--out {out} is in use by pid {first.pid} (onespark hybrid --int4 " in last, last
    last = one_line_error(cli("mtp", str(out)), "mtp")  # step 2 waits for step 1 too
    assert f"is in use by pid {first.pid}" in last, last
    go.touch()
    assert first.wait(timeout=300) == 0, first.stdout.read()
    # byte-identical to a clean run (whose index step 2 has since extended)
    skip = (MANIFEST_FILE, ".onespark.lock", "model.safetensors.index.json")
    assert digest(out, skip) == digest(finished, skip)
    mtp(out, log=lambda m: None)
    assert verify(out)[0] == []  # the refused runs deleted nothing of the first one's


def test_download_refuses_a_destination_in_use(tmp_path):
    from onespark.checkpoint.lock import locked
    env = dict(os.environ, HF_ENDPOINT="http://127.0.0.1:9", NO_PROXY="127.0.0.1", HF_HUB_OFFLINE="0")
    with locked(tmp_path / "m" / "fp8", "--dest"):  # this process holds it; the child must not write there
        r = cli("download", "--dest", str(tmp_path / "m"), "--skip-int4", "--fp8-revision", "2" * 40, env=env)
    last = one_line_error(r, "download")
    assert f"--dest {tmp_path / 'm' / 'fp8'} is in use by pid {os.getpid()}" in last, last


# ---- item 7: verify --fast checks the exact dtype and the layer count -------------------------------------

def _relabel(ck_dir: Path, name: str, dtype: str, widen: bool = False) -> None:
    """Rewrite the shard holding `name` with its dtype changed: the same bytes under another label, or
    (widen) the values as F32 (twice the bytes)."""
    import numpy as np

    from onespark.checkpoint.safetensors_io import Range, read_header, write_safetensors
    idx = json.loads((ck_dir / "model.safetensors.index.json").read_text())
    fname = idx["weight_map"][name]
    h = read_header(ck_dir / fname)
    items = []
    for t in h.tensors.values():
        if t.name != name:
            items.append((t.name, t.dtype, t.shape, Range(h.path, t.begin, t.nbytes)))
        elif widen:
            raw = np.frombuffer((ck_dir / fname).read_bytes()[t.begin:t.end], dtype=np.uint16)
            items.append((t.name, "F32", t.shape, (raw.astype(np.uint32) << 16).tobytes()))  # BF16 -> F32 exactly
        else:
            items.append((t.name, dtype, t.shape, Range(h.path, t.begin, t.nbytes)))
    write_safetensors(ck_dir / (fname + ".new"), items, h.metadata)
    os.replace(ck_dir / (fname + ".new"), ck_dir / fname)


@pytest.mark.parametrize("how", ["bf16-as-f16", "bf16-as-f32"])
def test_verify_fast_checks_the_exact_dtype(finished, tmp_path, how):
    out = _clone(finished, tmp_path / "hy")
    name = "model.language_model.layers.1.mlp.shared_expert_gate.weight"  # a BF16 router gate, not spliced
    _relabel(out, name, "F16", widen=how == "bf16-as-f32")
    last = one_line_error(cli("verify", "--fast", str(out)), "verify")
    want = "F16" if how == "bf16-as-f16" else "F32"
    assert f"{name} (" in last and f") is {want}[" in last and "the config implies BF16[" in last, last


def test_verify_checks_num_hidden_layers(finished, tmp_path):
    out = _clone(finished, tmp_path / "hy")
    cfg = json.loads((out / "config.json").read_text())
    tc = cfg["text_config"]
    tc["layer_types"] = tc.get("layer_types") or ["linear_attention", "linear_attention", "linear_attention",
                                                  "full_attention"]
    n = len(tc["layer_types"])
    tc["num_hidden_layers"] = n + 1  # layer_types and the tensors say n
    (out / "config.json").write_text(json.dumps(cfg))
    r = cli("verify", "--fast", "--model", "custom", str(out))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"num_hidden_layers is {n + 1} but layer_types lists {n} layers" in r.stderr, r.stderr
    assert f"the tensors hold decoder layers 0-{n - 1} (no tensor of layers {n}" in r.stderr, r.stderr
    del tc["layer_types"]
    tc["num_hidden_layers"] = n - 1  # the tensors hold one layer more than the config has
    (out / "config.json").write_text(json.dumps(cfg))
    r = cli("verify", "--fast", "--model", "custom", str(out))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"num_hidden_layers {n - 1}, the tensors hold decoder layers 0-{n - 1} (layers {n - 1} beyond it)" \
        in r.stderr, r.stderr


# ---- item 8: the bench keeps what it measured ----------------------------------------------------------------

def test_wrong_shaped_answers_fail_alone_and_the_rest_is_kept(tmp_path):
    from tests._openai_standin import StandIn
    kinds = ["ok", "list", "strnum", "choices", "garbage", "ok"]
    with StandIn(answers=kinds) as srv:
        r = cli(*_bench_args(srv, tmp_path, "--runs", str(len(kinds))))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "4 of 6 requests failed" in r.stderr.strip().splitlines()[-1], r.stderr
    rec = json.loads((tmp_path / "r.json").read_text())
    rows = rec["suites"]["published"]["rows"]
    assert [row["ok"] for row in rows] == [k == "ok" for k in kinds]
    errors = [row["error"] for row in rows if not row["ok"]]
    assert "a stream chunk is a JSON list where an object belongs" in errors[0], errors
    assert "usage.prompt_tokens is '5' (str), not a token count" in errors[1], errors
    assert "'choices' is \"hi\", not a list of objects" in errors[2], errors
    assert "a stream chunk is not JSON" in errors[3], errors
    assert all(e.startswith("malformed answer: ") for e in errors), errors
    ok = [row for row in rows if row["ok"]]
    assert [row["completion_tokens"] for row in ok] == [3, 3]  # the server's usage, as sent
    assert rec["suites"]["published"]["groups"][0]["summary"]["e2e_tok_s"]["n"] == 2
    assert (tmp_path / "r.md").is_file()


def test_wrong_shaped_unstreamed_answers_fail_alone(tmp_path):
    from tests._openai_standin import StandIn
    kinds = ["ok", "list", "strnum", "garbage", "ok"]
    with StandIn(answers=kinds) as srv:
        r = cli(*_bench_args(srv, tmp_path, "--runs", str(len(kinds)), "--no-stream"))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    rows = json.loads((tmp_path / "r.json").read_text())["suites"]["published"]["rows"]
    assert [row["ok"] for row in rows] == [k == "ok" for k in kinds]
    errors = [row["error"] for row in rows if not row["ok"]]
    assert "the answer is a JSON list where an object belongs" in errors[0], errors
    assert "usage.completion_tokens is '3' (str), not a token count" in errors[1], errors
    assert "not JSON" in errors[2], errors


def test_a_token_count_past_any_float_fails_that_request_alone(tmp_path):
    """usage.completion_tokens 10**400 is valid JSON: its rate raised OverflowError and lost the whole run."""
    from tests._openai_standin import StandIn
    for stream in ([], ["--no-stream"]):
        with StandIn(answers=["ok", "huge"]) as srv:
            r = cli(*_bench_args(srv, tmp_path, "--runs", "2", *stream))
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert "1 of 2 requests failed" in r.stderr.strip().splitlines()[-1], r.stderr
        rows = json.loads((tmp_path / "r.json").read_text())["suites"]["published"]["rows"]
        assert [row["ok"] for row in rows] == [True, False] and "not a token count" in rows[1]["error"]


def test_metrics_the_tables_cannot_hold_are_left_out(tmp_path):
    """/metrics with drafts counted but no draft tokens (acceptance None: the table's 100 * None was a TypeError),
    a NaN gauge and block_size="inf" (int(float("inf")) an OverflowError): the run ends in its tables."""
    from tests._openai_standin import StandIn
    zero = "vllm:spec_decode_num_drafts_total 0\nvllm:spec_decode_num_draft_tokens_total 0\n" \
           "vllm:spec_decode_num_accepted_tokens_total 0\n"
    odd = "vllm:spec_decode_num_drafts_total 10\nvllm:spec_decode_num_draft_tokens_total 0\n" \
          "vllm:spec_decode_num_accepted_tokens_total 5\nvllm:kv_cache_usage_perc NaN\n" \
          'vllm:cache_config_info{block_size="inf",num_gpu_blocks="100"} 1.0\n'
    with StandIn(metrics=[zero, zero, zero, odd]) as srv:
        r = cli(*_bench_args(srv, tmp_path, "--suite", "published,capacity"))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stdout + r.stderr
    rec = json.loads((tmp_path / "r.json").read_text())
    assert rec["suites"]["published"]["spec_decode"]["acceptance_rate"] is None
    assert rec["suites"]["capacity"]["block_size"] is None
    assert "1.50 (-)" in (tmp_path / "r.md").read_text()


def test_a_suite_that_stops_keeps_the_suites_before_it(tmp_path):
    """quality needs logprobs this server does not send: the published figures measured before it are written."""
    from tests._openai_standin import StandIn
    with StandIn() as srv:
        last = one_line_error(cli(*_bench_args(srv, tmp_path, "--suite", "published,quality")), "bench")
    assert last.startswith("onespark bench: error: quality stopped (") and str(tmp_path / "r.json") in last, last
    rec = json.loads((tmp_path / "r.json").read_text())
    assert rec["stopped"]["suite"] == "quality" and "no usable logprobs" in rec["stopped"]["error"]
    assert rec["suites"]["published"]["groups"][0]["summary"]["e2e_tok_s"]["n"] == 1
    assert (tmp_path / "r.md").is_file()


def test_ctrl_c_keeps_the_suites_that_finished(tmp_path):
    """Ctrl-C during the second suite: the first suite's figures are written, as for a suite that stops, and the
    exit status is 130; Ctrl-C before any suite finished writes nothing (there is nothing to keep)."""
    from tests._openai_standin import StandIn
    for answers, kept in ((["ok", "hang"], True), (["hang"], False)):
        with StandIn(answers=answers) as srv:
            argv = [sys.executable, "-m", "onespark",
                    *_bench_args(srv, tmp_path, "--suite", "published,depth", "--depths", "0")]
            # SIG_DFL in the child: a lane started in the background by a non-interactive shell (nohup ... &, or
            # tests/run.sh's other tracks) ignores SIGINT, and Python keeps an ignored SIGINT ignored (no Ctrl-C)
            proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
            assert srv.hung.wait(120), proc.communicate(timeout=60)
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=120)
        assert proc.returncode == 130 and "Traceback" not in err, (proc.returncode, out, err)
        last = err.strip().splitlines()[-1]
        if kept:
            assert last == (f"onespark bench: error: depth stopped (interrupted (Ctrl-C)); what the suites before it "
                            f"measured is kept in {tmp_path / 'r.json'}"), last
            rec = json.loads((tmp_path / "r.json").read_text())
            assert rec["stopped"] == {"suite": "depth", "error": "interrupted (Ctrl-C)"} and "running" not in rec
            assert rec["suites"]["published"]["groups"][0]["summary"]["e2e_tok_s"]["n"] == 1
            (tmp_path / "r.json").unlink()
        else:
            assert last == "onespark bench: interrupted", last
            assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("key", ["sk-line-break-0123456789\n", "sk-carriage-0123456789\r\nX-Other: 1",
                                 "sk-accent-\u00e9-0123456789"], ids=["newline", "header-injection", "non-ascii"])
def test_an_env_key_no_header_can_carry_is_one_line_that_never_shows_it(tmp_path, key):
    """The HTTP client's error quoted the header, key and all ("Illegal header value b'Bearer sk-...'"); an accent
    was a UnicodeEncodeError traceback."""
    from tests._openai_standin import StandIn
    env = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "ONESPARK_API_KEY")}
    with StandIn() as srv:
        r = cli(*_bench_args(srv, tmp_path), env=dict(env, OPENAI_API_KEY=key))
        assert srv.requests == []
    last = one_line_error(r, "bench")
    assert "$OPENAI_API_KEY: the key is not plain printable ASCII" in last, last
    assert "0123456789" not in r.stdout + r.stderr


def test_a_url_with_credentials_is_refused_without_showing_them(tmp_path):
    """http://user:secret@host: the URL is recorded with the results (endpoint, command) and shown in every
    error; refused before anything is sent, the password in no line."""
    from tests._openai_standin import StandIn
    with StandIn() as srv:
        url = srv.base_url.replace("http://", "http://bench:pw-0123456789@")
        args = _bench_args(srv, tmp_path)
        args[args.index("--base-url") + 1] = url
        r = cli(*args)
        assert srv.requests == []
    last = one_line_error(r, "bench")
    assert "--base-url: the URL holds a user name or password" in last, last
    assert "pw-0123456789" not in r.stdout + r.stderr and not list(tmp_path.iterdir())


@pytest.mark.parametrize("name", ["../escaped", "/tmp/abs", "a/b", ".hidden", ""])
def test_a_bench_name_is_a_file_in_out_never_a_path(tmp_path, name):
    """--name is the results' file stem in --out: `../x` or `/abs/x` wrote outside it (the write check before the
    run covers --out only). Refused by the parser, nothing sent or written."""
    out = tmp_path / "out"
    r = cli("bench", "--base-url", "http://127.0.0.1:9", "--out", str(out), f"--name={name}")
    assert r.returncode == 2 and "is not a file name" in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    assert not out.exists() and not (tmp_path / "escaped.json").exists()


def test_quality_against_a_server_without_logprobs_is_one_line(tmp_path):
    from tests._openai_standin import StandIn
    with StandIn() as srv:
        last = one_line_error(cli("bench", "--base-url", srv.base_url, "--suite", "quality", "--classes", "Q&A",
                                  "--max-tokens", "3", "--no-png", "--no-progress", "--out", str(tmp_path)), "bench")
    assert "the answer to prompt 'Q&A' carries no usable logprobs" in last, last


@pytest.mark.parametrize("models,why", [
    ("<html>502 Bad Gateway</html>", "answered something that is not JSON"),
    ('[{"id": "standin"}]', "answered list JSON without a list of model objects under 'data'"),
    ('{"data": "standin"}', "answered dict JSON without a list of model objects under 'data'"),
], ids=["html", "list", "data-string"])
def test_models_of_the_wrong_shape_is_one_line(tmp_path, models, why):
    from tests._openai_standin import StandIn
    with StandIn(models=models) as srv:
        last = one_line_error(cli(*_bench_args(srv, tmp_path)), "bench")
        assert f"{srv.base_url}/v1/models {why}" in last, last
        assert "/v1/chat/completions" not in srv.requests


def test_png_dependency_is_checked_before_the_run(tmp_path):
    from tests._openai_standin import StandIn
    blocker = tmp_path / "no-matplotlib" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('matplotlib hidden by the test')\n")
    env = dict(os.environ, PYTHONPATH=str(blocker.parent))
    with StandIn() as srv:
        args = [a for a in _bench_args(srv, tmp_path / "out") if a != "--no-png"]
        last = one_line_error(cli(*args, env=env), "bench")
        assert srv.requests == []  # not one request was sent
    assert "PNG output needs matplotlib" in last and "--no-png" in last, last


def test_compare_says_when_settings_differ(tmp_path):
    from tests._openai_standin import StandIn
    with StandIn() as srv:
        for name, runs in (("a", "1"), ("b", "2")):
            r = cli(*_bench_args(srv, tmp_path / name, "--runs", runs))
            assert r.returncode == 0, r.stderr
        r = cli(*_bench_args(srv, tmp_path / "c", "--runs", "1"))
    same = cli("bench", "compare", str(tmp_path / "a" / "r.json"), str(tmp_path / "c" / "r.json"))
    assert same.returncode == 0 and "different settings" not in same.stdout, same.stdout + same.stderr
    diff = cli("bench", "compare", str(tmp_path / "a" / "r.json"), str(tmp_path / "b" / "r.json"))
    assert diff.returncode == 0, diff.stderr
    assert diff.stdout.startswith("note: A and B ran with different settings (runs 1 vs 2)"), diff.stdout


# ---- item 9: no surprise network; FP8 fetch errors are one line ------------------------------------------

class _Hub:
    """Answers every GET as `mode` says, recording the paths: 503 | html | list | badheader (a valid config and
    index from `src`, then safetensors byte ranges that are not a safetensors header)."""

    def __init__(self, mode: str, src: Path | None = None):
        import struct
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        self.paths: list[str] = []
        hub = self
        fake = struct.pack("<Q", 16) + b"{not json at all"

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                hub.paths.append(self.path)
                name = self.path.rsplit("/", 1)[-1]
                status, body = 200, b""
                if mode == "503":
                    status, body = 503, b"Service Unavailable"
                elif name == "config.json":
                    body = {"html": b"<html>Sign in</html>", "list": b"[1, 2]"}.get(
                        mode, (src / "config.json").read_bytes() if src else b"{}")
                elif name.endswith(".json"):
                    body = (src / name).read_bytes()
                else:
                    a, b = (int(x) for x in self.headers["Range"].split("=")[1].split("-"))
                    status, body = 206, (fake + b"\0" * (b + 1))[a: b + 1]
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_fp8_path_shaped_like_a_repo_is_not_fetched(pair, tmp_path):
    hub = _Hub("503")
    try:
        r = cli("hybrid", "--int4", str(pair / "int4"), "--fp8", "Qwen/Qwen3.5-122B-A10B-FP8", "--out",
                str(tmp_path / "hy"), env=hub_env(hub.url, tmp_path))
    finally:
        hub.close()
    last = one_line_error(r, "hybrid")
    assert "--fp8 Qwen/Qwen3.5-122B-A10B-FP8: no such directory; to fetch a Hub repo, give its id as " \
           "--fp8 hf:Qwen/Qwen3.5-122B-A10B-FP8" in last, last
    assert hub.paths == []  # not one request
    assert not (tmp_path / "hy").exists()


@pytest.mark.parametrize("mode,why", [
    ("refused", "fetching config.json from http://127.0.0.1:9 failed (ConnectError: "),
    ("503", "HTTP 503 for config.json from "),
    ("html", "config.json is not JSON ("),
    ("list", "config.json is a JSON list, not an object"),
    ("badheader", "safetensors header is not valid JSON"),
])
def test_fp8_fetch_errors_are_one_line(pair, tmp_path, mode, why):
    hub = None if mode == "refused" else _Hub(mode, pair / "fp8")
    url = "http://127.0.0.1:9" if hub is None else hub.url  # port 9 (discard): nothing listens there
    try:
        r = cli("download", "--dest", str(tmp_path / "m"), "--skip-int4", "--fp8-revision", "2" * 40,
                env=hub_env(url, tmp_path))
    finally:
        if hub is not None:
            hub.close()
    last = one_line_error(r, "download")
    assert why in last, last
    assert "run the same command again" in last or "HF_ENDPOINT" in last or "try again later" in last, last


@pytest.fixture
def not_a_hub():
    """A web server that answers every GET with a 200 HTML page (a mistyped HF_ENDPOINT, a login portal)."""
    import http.server
    import threading

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b"<html><body>welcome</body></html>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_HEAD = do_GET

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_a_download_from_an_endpoint_that_is_no_hub_says_so(not_a_hub, tmp_path):
    """Issue 58: the INT4 download from such an endpoint ended in "JSONDecodeError ...; re-run to resume"; a re-run
    gets the same answer. The line names the endpoint, what it answered and HF_ENDPOINT."""
    # TRANSFORMERS_OFFLINE too: huggingface_hub reads either, and the compressor's in-process tests set it in this
    # process's environment (onespark/serving/lingua.py: a local model is never fetched).
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN")}
    r = cli("download", "--dest", str(tmp_path / "d"), env={**env, "HF_ENDPOINT": not_a_hub,
                                                             "HF_HOME": str(tmp_path / "hf")})
    last = one_line_error(r, "download")
    assert last.startswith(f"onespark download: error: {not_a_hub} did not answer as the Hugging Face Hub does: GET "
                           f"{not_a_hub}/api/models/"), last
    assert last.endswith("gave HTTP 200 text/html, not the JSON file list: check HF_ENDPOINT (a mirror must serve "
                         "the Hub's API, /api/models/...)"), last
    assert "re-run" not in last and "JSONDecodeError" not in r.stderr


def test_serve_takes_its_key_from_a_file_and_never_shows_it(tmp_path):
    (tmp_path / "key").write_text("sk-serve-7d1e\n")
    (tmp_path / "model").mkdir()
    r = cli("serve", "--dry-run", "--demo", "--checkpoint", str(tmp_path / "model"), "--api-key-file", str(tmp_path / "key"))
    assert r.returncode == 0, r.stderr
    assert "-e VLLM_API_KEY " in r.stdout + r.stderr  # the name only: docker reads the value from serve's env
    assert "sk-serve-7d1e" not in r.stdout + r.stderr
    r = cli("serve", "--dry-run", "--demo", "--checkpoint", str(tmp_path / "model"), "--api-key-file", str(tmp_path / "no"))
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        f"onespark serve: error: cannot read --api-key-file {tmp_path / 'no'}: No such file or directory"]


def test_a_terminated_pytest_still_tears_its_fixtures_down(tmp_path):
    """tests/run.sh stops its background track with SIGTERM; the vLLM servers of that track run in their own
    process groups and stop only in their fixture's teardown. With tests/_interrupt.py (loaded by conftest), a
    SIGTERM during a test still runs the teardown; without it, pytest dies and the teardown never runs."""
    (tmp_path / "test_sleep.py").write_text(
        "import pathlib, time\nimport pytest\n\n"
        "@pytest.fixture\ndef server(tmp_path_factory):\n"
        f"    pathlib.Path({str(tmp_path / 'up')!r}).write_text('')\n"
        "    yield\n"
        f"    pathlib.Path({str(tmp_path / 'torn-down')!r}).write_text('')\n\n"
        "def test_slow(server):\n    time.sleep(60)\n")
    for plugin, torn_down in ((["-p", "tests._interrupt"], True), ([], False)):
        for f in ("up", "torn-down"):
            (tmp_path / f).unlink(missing_ok=True)
        proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin,
                                 str(tmp_path / "test_sleep.py")], cwd=Path(__file__).resolve().parent.parent,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 60
        while not (tmp_path / "up").exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert (tmp_path / "up").exists(), proc.communicate()[0]
        proc.terminate()
        out = proc.communicate(timeout=60)[0]
        assert (tmp_path / "torn-down").exists() == torn_down, out
