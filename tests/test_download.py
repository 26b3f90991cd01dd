"""Step 0 against a local nginx standing in for the Hugging Face Hub.

nginx serves synthesized repositories in the Hub's URL layout: files at `/{repo}/resolve/{revision}/{file}`
(with the `X-Repo-Commit` header huggingface_hub requires, ETags and `Range` support as nginx gives them;
`Slow/int4` is the INT4 repo again at 1 MB/s per connection, to interrupt a download half way)
and the file listing snapshot_download asks for at `/api/models/{repo}/tree/{revision}`. Its access log is
the independent record of what was transferred: status and body bytes of every request.
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from onespark.checkpoint.synth import TINY_TEXT, synth
from onespark.model import qwen35, specs
from tests._hub import NEEDS_NGINX, NGINX, hub_env, publish, serve

pytestmark = pytest.mark.skipif(NGINX is None, reason=NEEDS_NGINX)
ROOT = Path(__file__).resolve().parents[1]
INT4, FP8 = "Intel/Qwen3.5-122B-A10B-int4-AutoRound", "Qwen/Qwen3.5-122B-A10B-FP8"
INT4_SHA, FP8_SHA = "1" * 40, "2" * 40
SLOW = "Slow/int4"

@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    d = tmp_path_factory.mktemp("hub")
    dims = dict(TINY_TEXT, shared_expert_intermediate_size=512)  # enough FP8 bytes that headers are small change
    synth(d / "src-int4", "int4", seed=3, dims=dims)
    synth(d / "src-fp8", "fp8", seed=3, dims=dims, shards=4)
    publish(d / "www", INT4, INT4_SHA, d / "src-int4")
    publish(d / "www", FP8, FP8_SHA, d / "src-fp8")
    publish(d / "www", SLOW, INT4_SHA, d / "src-int4")  # the same files, served at 1 MB/s
    with serve(d) as endpoint:
        yield d, endpoint


def _log(d: Path) -> list[tuple[str, str, int, int, str]]:
    out = []
    for line in (d / "access.log").read_text().splitlines():
        m, uri, status, nbytes, rng = line.split(" ", 4)
        out.append((m, uri, int(status), int(nbytes), rng.strip('"')))
    return out


def _download(endpoint: str, dest: Path, *extra: str) -> subprocess.CompletedProcess:
    env = hub_env(endpoint, dest.parent)
    return subprocess.run([sys.executable, "-m", "onespark", "download", "--dest", str(dest),
                           "--int4-revision", INT4_SHA, "--fp8-revision", FP8_SHA, *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_download_int4_and_ranged_fp8_then_splice(hub, tmp_path):
    d, endpoint = hub
    before = len(_log(d)) if (d / "access.log").exists() else 0
    r = _download(endpoint, tmp_path / "models")
    assert r.returncode == 0, r.stdout + r.stderr
    int4, fp8 = tmp_path / "models" / "int4", tmp_path / "models" / "fp8"
    for p in (d / "src-int4").iterdir():
        if p.name != ".onespark.lock":  # synth's lock on the source, never published (tests/_hub.py)
            assert (int4 / p.name).read_bytes() == p.read_bytes(), p.name
    rec = json.loads((fp8 / "onespark-download.json").read_text())
    assert rec["repo"] == FP8 and rec["revision"] == FP8_SHA and rec["tensors"] == 2 * 12
    # what nginx sent for the FP8 shards: only ranges (206), never a whole shard, <= 1.1x the tensor bytes
    reqs = [x for x in _log(d)[before:] if x[1].startswith(f"/{FP8}/") and x[1].endswith(".safetensors")]
    assert reqs and all(status == 206 and rng.startswith("bytes=") for _, _, status, _, rng in reqs)
    sent = sum(n for *_, n, _ in reqs)
    assert sent == rec["bytes_fetched"] - sum(n for m, uri, s, n, _ in _log(d)[before:]
                                              if uri.startswith(f"/{FP8}/") and uri.endswith(".json"))
    assert sent <= 1.1 * rec["bytes_needed"], (sent, rec["bytes_needed"])
    whole = sum((d / "src-fp8" / p).stat().st_size for p in os.listdir(d / "src-fp8") if p.endswith(".safetensors"))
    assert sent < whole / 5
    # the fetched tensors are byte-identical to the source's, and step 1 accepts them
    from safetensors import safe_open

    from onespark.checkpoint.hybrid import hybrid
    from onespark.checkpoint.mtp import mtp
    from onespark.checkpoint.verify import verify
    with safe_open(str(fp8 / "fp8-shared-experts.safetensors"), framework="pt") as got:
        src = {}
        for f in (d / "src-fp8").glob("*.safetensors"):
            with safe_open(str(f), framework="pt") as g:
                src.update({k: g.get_tensor(k) for k in g.keys() if k in got.keys()})
        assert set(src) == set(got.keys())
        for k in got.keys():
            assert got.get_tensor(k).view(-1).view(torch.uint8).equal(src[k].view(-1).view(torch.uint8)), k
    out = tmp_path / "hybrid"
    off_spec = specs.custom(INT4, FP8)  # the hub's tiny dims are no spec's (shared experts 512 wide)
    man = hybrid(int4, str(fp8), out, spec=off_spec, log=lambda m: None)
    assert man["inputs"]["int4"]["revision"] == INT4_SHA and man["inputs"]["fp8"]["revision"] == FP8_SHA
    mtp(out, spec=off_spec, log=lambda m: None)
    assert verify(out, spec=off_spec)[0] == []
    # a second run is "already done" and transfers no shard bytes
    n = len(_log(d))
    r = _download(endpoint, tmp_path / "models")
    assert r.returncode == 0 and "already" in r.stdout, r.stdout + r.stderr
    assert not [x for x in _log(d)[n:] if x[1].endswith(".safetensors")]


def test_hybrid_fetches_fp8_by_repo_id(hub, tmp_path):
    d, endpoint = hub
    env = hub_env(endpoint, tmp_path)
    out = tmp_path / "hybrid"
    r = subprocess.run([sys.executable, "-m", "onespark", "hybrid", "--model", "custom", "--int4", str(d / "src-int4"),
                        "--fp8", f"hf:{FP8}",
                        "--fp8-revision", FP8_SHA, "--out", str(out)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not (tmp_path / ".hybrid.fp8-fetch").exists()
    man = json.loads((out / "onespark-manifest.json").read_text())
    assert man["inputs"]["fp8"] == {"path": None, "repo": FP8, "revision": FP8_SHA}
    cfg = json.loads((out / "config.json").read_text())
    assert len(cfg["quantization_config"][qwen35.HYBRID_KEY]["layers"]) == 12


def test_unknown_revision_is_a_clear_error(hub, tmp_path):
    d, endpoint = hub
    env = hub_env(endpoint, tmp_path)
    r = subprocess.run([sys.executable, "-m", "onespark", "download", "--dest", str(tmp_path / "m"), "--skip-int4",
                        "--fp8-revision", "3" * 40], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "not found (404)" in r.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("case", ["401", "404-revision", "404-repo", "unreachable"])
def test_int4_download_names_the_hubs_answer_and_the_fix(hub, tmp_path, case):
    """Before: snapshot_download, refused, returned the (empty) local_dir, and step 0 ended with
    "config.json: missing (the model config): is this the right directory?" whatever the Hub had said."""
    d, endpoint = hub
    repo, rev = {"401": ("Gated/int4", INT4_SHA), "404-revision": (INT4, "3" * 40), "404-repo": ("Nobody/int4", INT4_SHA),
                 "unreachable": (INT4, INT4_SHA)}[case]
    url = "http://127.0.0.1:9" if case == "unreachable" else endpoint  # port 9 (discard): nothing listens
    dest = tmp_path / "m"
    r = subprocess.run([sys.executable, "-m", "onespark", "download", "--dest", str(dest), "--skip-fp8", "--int4-repo",
                        repo, "--int4-revision", rev], cwd=ROOT, env=hub_env(url, tmp_path), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    [line] = r.stderr.splitlines()
    want = {
        "401": f"onespark download: error: Gated/int4: {url} answered 401 unauthorized: log in (`hf auth login` or "
               f"HF_TOKEN) and accept the model's licence on its page ({url}/Gated/int4); not logged in, the Hub "
               f"answers 401 for a repo that does not exist too: check --int4-repo and --revision",
        "404-revision": f"onespark download: error: {INT4}@{'3' * 40} not found on {url} (404): check --int4-repo and "
                        f"--revision (`onespark specs` shows the pinned ones)",
        "404-repo": f"onespark download: error: Nobody/int4@{INT4_SHA} not found on {url} (404): check --int4-repo and "
                    f"--revision (`onespark specs` shows the pinned ones)",
        "unreachable": f"onespark download: error: cannot reach {url} (ConnectError: [Errno 111] Connection refused): "
                       f"check the network (a proxy: HTTPS_PROXY; a mirror: HF_ENDPOINT), then run the same command "
                       f"again",
    }[case]
    assert line == want, line
    assert [p for p in dest.rglob("*") if p.is_file()] == []  # nothing fetched, no record, no lock left


def test_step_0_script_downloads_then_says_already_done(hub, tmp_path):
    d, endpoint = hub
    env = dict(hub_env(endpoint, tmp_path), ONESPARK_VENV=str(ROOT / ".venv"))
    args = ["steps/0-download.sh", "--work", str(tmp_path / "w")]
    r = subprocess.run(args + ["--int4-revision", INT4_SHA, "--fp8-revision", FP8_SHA], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "step 0 already done" in r.stdout, r.stdout + r.stderr


def test_step_0_fetches_again_a_file_lost_after_it_finished(hub, tmp_path):
    """"Already done" holds only while the files do: a shard deleted after step 0 finished (what the message
    about a truncated one says to do) is fetched again by steps/0-download.sh and `onespark download`, instead of
    "already done" (the script) or the same "download it again" error (the CLI) forever. The script is run as
    install.sh runs it, without revision flags: a hub of its own serves the spec's pins."""
    d, _ = hub
    spec = specs.SPECS[specs.DEFAULT]
    h = tmp_path / "hub"
    publish(h / "www", spec.int4.repo, spec.int4.revision, d / "src-int4")
    publish(h / "www", spec.fp8.repo, spec.fp8.revision, d / "src-fp8")
    work = tmp_path / "w"
    with serve(h) as endpoint:
        env = dict(hub_env(endpoint, tmp_path), ONESPARK_VENV=str(ROOT / ".venv"))
        step0 = ["steps/0-download.sh", "--work", str(work)]
        r = subprocess.run(step0, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        for lost in (work / "int4" / "model-00002-of-00003.safetensors", work / "fp8" / "fp8-shared-experts.safetensors"):
            want = lost.read_bytes()
            lost.unlink()
            r = subprocess.run(step0, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
            assert r.returncode == 0 and "step 0 already done" not in r.stdout, r.stdout + r.stderr
            assert lost.read_bytes() == want
            lost.unlink()
            r = subprocess.run([sys.executable, "-m", "onespark", "download", "--dest", str(work)], cwd=ROOT, env=env,
                               capture_output=True, text=True, timeout=300)
            assert r.returncode == 0 and lost.read_bytes() == want, r.stdout + r.stderr
        r = subprocess.run(step0, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0 and "step 0 already done" in r.stdout, r.stdout + r.stderr
        # a record that only looks complete to a text search (the script grepped for it): not done
        rec = work / "int4" / "onespark-download.json"
        rec.write_text(json.dumps({**json.loads(rec.read_text()), "complete": False, "before": {"complete": True}}))
        r = subprocess.run(step0, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0 and "step 0 already done" not in r.stdout, r.stdout + r.stderr
        assert json.loads(rec.read_text())["complete"] is True


def _lying_index(index: dict) -> dict:
    """The index with one shared-expert weight's shard named as a path out of DEST/fp8/.parts."""
    wm = dict(index["weight_map"])
    wm[next(n for n in wm if n.endswith("shared_expert.gate_proj.weight"))] = "../../../escape.safetensors"
    return {**index, "weight_map": wm}


@pytest.mark.parametrize("fname, lie", [
    ("config.json", lambda c: {**c, "text_config": {**c["text_config"], "num_hidden_layers": 10**9}}),
    ("config.json", lambda c: {**c, "text_config": [c["text_config"]]}),
    ("config.json", lambda c: {**c, "quantization_config": ["fp8"]}),
    ("model.safetensors.index.json", lambda i: {**i, "weight_map": {k: [v] for k, v in i["weight_map"].items()}}),
    ("model.safetensors.index.json", _lying_index),
], ids=["layers-1e9", "text-config-list", "quant-config-list", "shard-name-list", "shard-name-path"])
def test_fp8_fetch_checks_the_hubs_config_and_index_at_the_edge(hub, tmp_path, monkeypatch, fname, lie):
    """The FP8 repo's config.json and index are outside input like a local checkpoint's: one line naming the repo
    and the file, never a traceback, a 10**9-layer loop (memory) or a part file written outside DEST."""
    from onespark.checkpoint import download
    from onespark.errors import UserError
    d, endpoint = hub
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    real = download.Fetcher.json

    def lying(self, filename):
        doc = real(self, filename)
        return lie(doc) if filename == fname else doc

    monkeypatch.setattr(download.Fetcher, "json", lying)
    dest = tmp_path / "a" / "b" / "fp8"
    with pytest.raises(UserError, match=f"{FP8}: {fname}"):
        download.fetch_fp8(FP8, FP8_SHA, dest, log=lambda m: None)
    assert [p.name for p in tmp_path.rglob("*") if p.is_file() and p.name != ".onespark.lock"] == []


@pytest.fixture(scope="module")
def two_revisions(tmp_path_factory):
    """The default spec's tiny INT4 and FP8 releases at two revisions: same names, shapes and sizes, other bytes."""
    d = tmp_path_factory.mktemp("revs")
    for rev, seed in (("a" * 40, 11), ("b" * 40, 12)):
        synth(d / rev / "int4", "int4", seed=seed)
        synth(d / rev / "fp8", "fp8", seed=seed)
    return d


@pytest.mark.parametrize("killed_at", ["after-the-file", "after-one-part"])
def test_fp8_fetch_of_another_revision_killed_is_never_taken_for_the_first(two_revisions, tmp_path, monkeypatch,
                                                                         killed_at):
    """Revision B killed half way into DEST, then A: A's bytes, neither "already fetched" over B's file (A's record
    of an earlier fetch left in place) nor A's file assembled from B's byte ranges (parts of the same names)."""
    from onespark.checkpoint import download, writer

    class Local(download.Fetcher):  # the Hub as files on disk: revision -> directory
        def __init__(self, repo, revision):
            self.repo, self.revision, self.bytes, self.requests = repo, revision, 0, 0

        def get(self, filename, start=None, end=None):
            raw = (two_revisions / self.revision / "fp8" / filename).read_bytes()
            return raw if start is None else raw[start:end]

        def get_to_file(self, filename, start, end, path, progress=lambda n: None):
            parts.append(path)
            if killed_at == "after-one-part" and self.revision == b and len(parts) == 2:
                raise KeyboardInterrupt
            path.write_bytes(self.get(filename, start, end))

    a, b, parts, dest = "a" * 40, "b" * 40, [], tmp_path / "fp8"
    monkeypatch.setattr(download, "Fetcher", Local)
    download.fetch_fp8(FP8, a, tmp_path / "ref", log=lambda m: None)
    want = (tmp_path / "ref" / download.FP8_FILE).read_bytes()
    if killed_at == "after-the-file":  # A fetched before: its record is there
        download.fetch_fp8(FP8, a, dest, log=lambda m: None)
    parts.clear()
    if killed_at == "after-the-file":
        monkeypatch.setattr(writer.Writer, "write_json", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        download.fetch_fp8(FP8, b, dest, log=lambda m: None)
    monkeypatch.undo()
    monkeypatch.setattr(download, "Fetcher", Local)
    logs: list[str] = []
    download.fetch_fp8(FP8, a, dest, log=logs.append)
    assert not any("already fetched" in m for m in logs), logs
    assert (dest / download.FP8_FILE).read_bytes() == want


def test_int4_download_of_another_revision_killed_is_never_taken_for_the_first(two_revisions, tmp_path, monkeypatch):
    from onespark.checkpoint import download

    def snapshot(repo, revision, dest, allow=None):  # the Hub as files on disk; revision b dies after one shard
        dest.mkdir(parents=True, exist_ok=True)
        for p in sorted((two_revisions / revision / "int4").iterdir()):
            (dest / p.name).write_bytes(p.read_bytes())
            if revision == "b" * 40 and p.suffix == ".safetensors":
                raise KeyboardInterrupt

    monkeypatch.setattr(download, "_check_hub", lambda *a: None)
    monkeypatch.setattr(download, "_snapshot", snapshot)
    dest = tmp_path / "int4"
    download.download_int4(INT4, "a" * 40, dest, log=lambda m: None)
    want = {p.name: p.read_bytes() for p in dest.glob("*.safetensors")}
    with pytest.raises(KeyboardInterrupt):
        download.download_int4(INT4, "b" * 40, dest, log=lambda m: None)
    logs: list[str] = []
    download.download_int4(INT4, "a" * 40, dest, log=logs.append)
    assert not any("already downloaded" in m for m in logs), logs
    assert {p.name: p.read_bytes() for p in dest.glob("*.safetensors")} == want


@pytest.mark.parametrize("record", [{"complete": "no"}, {"complete": 1}, {"repo": [INT4]}, [1], b"\xff{"],
                         ids=["complete-no", "complete-1", "repo-list", "a-list", "not-json"])
def test_a_download_record_of_another_shape_is_fetched_again(two_revisions, tmp_path, monkeypatch, record):
    """Only "complete": true (a JSON boolean) in a record of this repo@revision says done: a record of another
    shape vouches for nothing and is fetched again (safe: step 0 resumes), neither "already downloaded" over
    files nobody finished nor a stop that leaves the user to delete it."""
    from onespark.checkpoint import download

    fetched: list[str] = []

    def snapshot(repo, revision, dest, allow=None):  # the Hub as files on disk
        fetched.append(revision)
        dest.mkdir(parents=True, exist_ok=True)
        for p in sorted((two_revisions / revision / "int4").iterdir()):
            (dest / p.name).write_bytes(p.read_bytes())

    monkeypatch.setattr(download, "_check_hub", lambda *a: None)
    monkeypatch.setattr(download, "_snapshot", snapshot)
    a, dest = "a" * 40, tmp_path / "int4"
    download.download_int4(INT4, a, dest, log=lambda m: None)
    rec = dest / "onespark-download.json"
    good = json.loads(rec.read_text())
    rec.write_bytes(record if isinstance(record, bytes) else
                    json.dumps({**good, **record} if isinstance(record, dict) else record).encode())
    fetched.clear()
    logs: list[str] = []
    download.download_int4(INT4, a, dest, log=logs.append)
    assert fetched == [a] and not any("already downloaded" in m for m in logs), logs
    assert any(m.startswith(str(rec)) and m.endswith("fetching again") for m in logs), logs  # says why
    assert json.loads(rec.read_text()) == good


def test_interrupted_fp8_fetch_resumes_without_refetching(hub, tmp_path, monkeypatch):
    from onespark.checkpoint import download
    d, endpoint = hub
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    real = download.Fetcher.get_to_file
    calls = []

    def dies_on_third(self, *a, **kw):
        calls.append(a)
        if len(calls) == 3:
            raise KeyboardInterrupt  # what Ctrl-C (or a dropped connection) does mid-fetch
        return real(self, *a, **kw)

    monkeypatch.setattr(download.Fetcher, "get_to_file", dies_on_third)
    with pytest.raises(KeyboardInterrupt):
        download.fetch_fp8(FP8, FP8_SHA, tmp_path / "fp8", log=lambda m: None)
    kept = sorted(p.name for p in (tmp_path / "fp8" / ".parts").rglob("*") if p.is_file())
    assert len(kept) == 2 and not (tmp_path / "fp8" / "onespark-download.json").exists()
    monkeypatch.setattr(download.Fetcher, "get_to_file", real)
    n = len(_log(d))
    rec = download.fetch_fp8(FP8, FP8_SHA, tmp_path / "fp8", log=lambda m: None)
    refetched = {x[4] for x in _log(d)[n:] if x[1].endswith(".safetensors") and x[3] > 1000}
    assert refetched and rec["complete"]
    for name in kept:  # the two finished parts were not requested again
        start, end = name.rsplit(".", 1)[1].split("-")
        assert f"bytes={start}-{int(end) - 1}" not in refetched
    assert not (tmp_path / "fp8" / ".parts").exists()


def test_killed_int4_download_keeps_finished_files_and_completes(hub, tmp_path):
    """huggingface_hub 2.4 writes each file to a per-process temp name (its PR #4228), so a killed run
    restarts the file it was in; what it finished is kept and not fetched again."""
    d, endpoint = hub
    env = hub_env(endpoint, tmp_path)
    dest = tmp_path / "m" / "int4"
    cmd = [sys.executable, "-m", "onespark", "download", "--dest", str(tmp_path / "m"), "--skip-fp8",
           "--int4-repo", SLOW, "--int4-revision", INT4_SHA]
    child_log = open(tmp_path / "first-run.log", "wb")
    child = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=child_log, stderr=subprocess.STDOUT)

    def partial() -> bool:
        # huggingface_hub buffers its writes, so a partial file may still read 0 bytes: its presence counts
        # (the JSON files finish in milliseconds; a shard at 1 MB/s takes seconds).
        return any(True for _ in dest.rglob("*.incomplete"))

    deadline = time.monotonic() + 180  # generous: the CI machine may be busy
    finished: set[str] = set()
    while time.monotonic() < deadline:  # killed once some file is in and a shard is under way
        meta = dest / ".cache" / "huggingface" / "download"  # hub writes <file>.metadata once a file is done
        finished = {p.name for p in dest.glob("*") if p.is_file() and (meta / f"{p.name}.metadata").is_file()
                    and (meta / f"{p.name}.metadata").stat().st_size > 0} if dest.is_dir() else set()
        if finished and partial():
            break
        time.sleep(0.02)
    else:
        child.kill()
        pytest.fail(f"never saw a finished file beside a partial shard; first run: "
                    f"{(tmp_path / 'first-run.log').read_text()[-2000:]}")
    child.kill()
    child.wait()
    assert not (dest / "onespark-download.json").exists()
    n = len(_log(d))
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    again = {x[1].rsplit("/", 1)[1] for x in _log(d)[n:] if x[0] == "GET" and x[1].startswith(f"/{SLOW}/")}
    assert not (again & finished), (again, finished)
    assert any(f.endswith(".safetensors") for f in again), again
    for p in (d / "src-int4").iterdir():
        if p.name != ".onespark.lock":  # synth's lock on the source; dest has download's own
            assert (dest / p.name).read_bytes() == p.read_bytes(), p.name


class _Liar(http.server.BaseHTTPRequestHandler):
    """A Hub stand-in that answers every file request with `size` bytes and `status`, whatever Range asked, and
    records how many bytes it got out before the client hung up (the independent measure of what was read)."""

    def do_GET(self):
        srv = self.server
        if "/resolve/" not in self.path:  # huggingface_hub's own requests (its agent registry): none of ours
            self.send_error(404)
            return
        n, block = 0, b"\0" * 65536
        srv.encodings.append(self.headers.get("Accept-Encoding"))
        try:
            self.send_response(srv.status)
            self.send_header("Content-Length", str(srv.size))
            self.end_headers()
            while n < srv.size:
                self.wfile.write(block[:srv.size - n])
                n += min(len(block), srv.size - n)
        except OSError:  # the client hung up: what a capped read does
            pass
        finally:
            srv.sent.append(n)
            srv.done.set()

    def log_message(self, *args):
        pass


@pytest.fixture
def liar(monkeypatch):
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Liar)
    srv.sent, srv.done, srv.encodings = [], threading.Event(), []
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{srv.server_address[1]}")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    yield srv
    srv.shutdown()
    srv.server_close()


OFFERED = 128 << 20


@pytest.mark.parametrize("status, size, call, asked, match", [
    (200, OFFERED, lambda f, p: f.get("s.safetensors", 0, 8), 8, "the server ignored the byte range for s.safetensors"),
    (206, OFFERED, lambda f, p: f.get("s.safetensors", 0, 8), 8, f"/resolve/{FP8_SHA}/s.safetensors sent more than the 8"),
    (206, OFFERED, lambda f, p: f.get_to_file("s.safetensors", 0, 8, p), 8, "s.safetensors sent more than the 8 bytes"),
    (200, OFFERED, lambda f, p: f.json("config.json"), 64 << 20, "config.json sent more than 64 MiB, more than a JSON"),
    (206, 4, lambda f, p: f.get("s.safetensors", 0, 8), 8, "s.safetensors sent 4 of the 8 bytes asked"),
], ids=["range-ignored", "range-oversized", "part-oversized", "json-oversized", "range-short"])
def test_fetcher_reads_no_more_than_it_asked_for(liar, tmp_path, status, size, call, asked, match):
    """A server that ignores Range or sends more than asked (a plain mirror, a hostile HF_ENDPOINT) is one line
    naming the URL and HF_ENDPOINT, after reading at most what was asked (+ what was in flight): never a whole
    128 MiB answer in memory or on disk for an 8-byte range or a config.json."""
    from onespark.checkpoint import download
    from onespark.errors import UserError
    liar.status, liar.size, part = status, size, tmp_path / "part"
    with pytest.raises(UserError) as e:
        call(download.Fetcher(FP8, FP8_SHA), part)
    msg = str(e.value)
    assert match in msg and "HF_ENDPOINT" in msg and "\n" not in msg, msg
    assert liar.done.wait(10)
    # what was asked, and what loopback socket buffers held when the client hung up (tcp_wmem + tcp_rmem: a few
    # MiB): far below the 128 MiB offered
    assert sum(liar.sent) < asked + (32 << 20), liar.sent
    assert not part.exists()
    assert liar.encodings == ["identity"]  # bytes as stored: a compressed answer would inflate past the count
