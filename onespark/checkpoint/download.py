"""Step 0, `onespark download [--model NAME] --dest DIR`: the INT4 checkpoint, and of the FP8 one only what step 1
needs. Repos and pinned revisions come from the spec (onespark.model.specs; default qwen3.5-122b-a10b):

    DEST/int4  e.g. Intel/Qwen3.5-122B-A10B-int4-AutoRound at a pinned commit (huggingface_hub snapshot_download:
               resumable, its progress bars; ~77 GB)
    DEST/fp8   e.g. from Qwen/Qwen3.5-122B-A10B-FP8 at a pinned commit: config.json, and in one file
               `fp8-shared-experts.safetensors` the 144 shared-expert weights + their weight_scale_inv
               (~0.5 GB), read by HTTP byte ranges: for each shard that holds some, its 8-byte length and
               JSON header, then the tensors' bytes (neighbours coalesced into one request). Never a whole shard.
    DEST/llmlingua2/NAME  with --compressor NAME: a pinned LLMLingua-2 checkpoint for `onespark compress serve`
               (config, tokenizer, model.safetensors; checked: family, headers, the published sha256; ~2.2 GB)
    DEST/dflash  with --drafter dflash (vLLM 0.32.0 track): the spec's DFlash drafter, whole, at
               --drafter-revision (no public pin), then checked as `onespark verify --drafter` checks it (~1.6 GB)

A spec without a public pin (qwen3.5-35b-a3b's INT4 repo, `custom`) needs --revision SHA; a spec without an FP8
source (qwen3.6-35b-a3b) skips DEST/fp8 and says why.

Every directory carries `onespark-download.json` (repo, revision, bytes); step 1 copies that into its manifest.
Re-running resumes: snapshot_download keeps every file it finished (huggingface_hub 2.4 starts the file it
was in again: it writes each download to a per-process temp name, its PR #4228); fetched FP8 byte ranges are
kept as parts until the file is assembled. The files are written by onespark.checkpoint.writer.Writer (temp name, fsync,
rename), the download record last: a directory whose record says complete is reported as already fetched.
Endpoint: HF_ENDPOINT (as huggingface_hub reads it); token: HF_TOKEN or `hf auth login`, never printed.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import struct
from pathlib import Path
from urllib.parse import quote

from onespark import options, shape
from onespark.checkpoint.lock import locked
from onespark.checkpoint.safetensors_io import (
    MAX_HEADER_BYTES,
    Range,
    encode_header,
    parse_header,
    write_safetensors_tmp,
)
from onespark.checkpoint.writer import (
    CONFIG,
    DOWNLOAD_RECORD,
    FINISHED_RECORD,
    INDEX,
    INDEX_FILE,
    Output,
    Writer,
    load_json,
    open_checkpoint,
    rewrite_index,
)
from onespark.errors import UserError, at_path
from onespark.model import qwen35, specs

# The default spec's pinned commits (every spec's repos, pins and where each pin comes from: onespark.model.specs).
INT4_REPO = specs.SPECS[specs.DEFAULT].int4.repo
INT4_REVISION = specs.SPECS[specs.DEFAULT].int4.revision
FP8_REPO = specs.SPECS[specs.DEFAULT].fp8.repo
FP8_REVISION = specs.SPECS[specs.DEFAULT].fp8.revision
FP8_FILE = "fp8-shared-experts.safetensors"
PARTS_DIR = ".parts"  # fetched byte ranges, one file each, until the FP8 file is assembled (a folder per revision)
FETCH_PROGRESS = ".onespark-download-progress.json"
COALESCE_GAP = 64 * 1024  # fetch two tensors in one request when at most this many bytes lie between them
CHUNK = 8 * 1024 * 1024
# What Fetcher.get reads of a file fetched whole (config.json, the index) before calling the answer wrong: the
# largest, an index of ~100k tensors at ~100 bytes a line, is ~10 MB.
MAX_JSON_BYTES = 64 * 1024 * 1024


def _endpoint() -> str | None:
    return os.environ.get("HF_ENDPOINT") or None


def _url(repo: str, filename: str, revision: str) -> str:
    from huggingface_hub import hf_hub_url
    return hf_hub_url(repo, filename, revision=revision, endpoint=_endpoint())


def _headers(extra: dict | None = None) -> dict:
    """The Hub's headers (token, user agent) and `extra`; bytes as stored (identity): a compressed answer would
    be inflated past the count Fetcher._body stops at before it could stop it."""
    from huggingface_hub.utils import build_hf_headers
    h = build_hf_headers()
    h.update({"Accept-Encoding": "identity", **(extra or {})})
    return h


class Fetcher:
    """Ranged GETs through huggingface_hub's HTTP session; counts every byte received."""

    def __init__(self, repo: str, revision: str):
        from huggingface_hub import get_session
        self.repo, self.revision, self.session = repo, revision, get_session()
        self.bytes, self.requests = 0, 0

    def _check(self, r, what: str, ranged: bool) -> None:
        if r.status_code in (401, 403):
            raise UserError(f"{self.repo}: access denied ({r.status_code}) for {what}: set HF_TOKEN or run "
                            f"`hf auth login`, and accept the model's terms on its page if it asks")
        if r.status_code == 404:
            raise UserError(f"{self.repo}@{self.revision}: {what} not found (404): check --fp8-repo/--fp8-revision")
        if r.status_code >= 400:
            raise UserError(f"{self.repo}: HTTP {r.status_code} for {what} from {_endpoint() or 'the Hub'}: try "
                            f"again later (byte ranges already fetched are kept)")
        if ranged and r.status_code != 206:
            raise UserError(f"{self.repo}: the server ignored the byte range for {what} (HTTP {r.status_code}): "
                            f"refusing to download whole shards; is HF_ENDPOINT a plain mirror?")

    @contextlib.contextmanager
    def _network(self, filename: str):
        """A transport failure (refused, reset, timeout, a broken answer) as one line, like the INT4 side's.
        Our own errors and local OSErrors (a full disk, named by path) pass through."""
        try:
            yield
        except (UserError, OSError):
            raise
        except Exception as e:  # huggingface_hub's HTTP client (httpx2 in 2.4) raises its own classes
            raise UserError(f"{self.repo}: fetching {filename} from {_endpoint() or 'the Hub'} failed "
                            f"({type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}): check the network "
                            f"or HF_ENDPOINT, then run the same command again (byte ranges already fetched are "
                            f"kept)") from None

    def json(self, filename: str) -> dict:
        raw = self.get(filename)
        try:
            doc = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise UserError(f"{self.repo}: {filename} is not JSON ({e}; it starts {raw[:40]!r}): "
                            f"{_endpoint() or 'the Hub'} sent something else (a login page, a proxy's error?): "
                            f"check HF_ENDPOINT, then run the same command again") from None
        if not isinstance(doc, dict):
            raise UserError(f"{self.repo}: {filename} is a JSON {type(doc).__name__}, not an object: "
                            f"check HF_ENDPOINT and --fp8-repo")
        return doc

    def _body(self, r, url: str, want: int, ranged: bool):
        """The answer's bytes as they arrive, at most `want`: the server, not us, decides how much it sends (one
        that ignores Range, a hostile or broken HF_ENDPOINT), so one byte past `want` ends the read as one line
        instead of filling memory or the disk. Counted as received. Blocks as the network delivers them (~64 KiB):
        a chunk size would buffer that much before the count could stop it."""
        got = 0
        for block in r.iter_bytes():
            got += len(block)
            self.bytes += len(block)
            if got > want:
                asked = f"the {want} bytes asked" if ranged else f"{want >> 20} MiB, more than a JSON file of a repo"
                raise UserError(f"{self.repo}: {url} sent more than {asked}: {_endpoint() or 'the Hub'} is not "
                                f"answering as the Hub does; check HF_ENDPOINT, then run the same command again")
            yield block
        if ranged and got < want:
            raise UserError(f"{self.repo}: {url} sent {got} of the {want} bytes asked (a dropped connection, or "
                            f"a file shorter than its header says): run the same command again; if it persists, "
                            f"check HF_ENDPOINT")

    def get(self, filename: str, start: int | None = None, end: int | None = None) -> bytes:
        """The file (a JSON file: at most MAX_JSON_BYTES), or bytes [start, end)."""
        ranged = start is not None
        headers = _headers({"Range": f"bytes={start}-{end - 1}"} if ranged else None)
        url = _url(self.repo, filename, self.revision)
        with self._network(filename), self.session.stream("GET", url, headers=headers, follow_redirects=True) as r:
            self.requests += 1
            self._check(r, filename, ranged)
            return b"".join(self._body(r, url, end - start if ranged else MAX_JSON_BYTES, ranged))

    def get_to_file(self, filename: str, start: int, end: int, path: Path, progress=lambda n: None) -> None:
        """Stream bytes [start, end) into `path` (temp name + rename: a part exists only when complete)."""
        tmp = path.with_name(path.name + ".tmp")
        headers = _headers({"Range": f"bytes={start}-{end - 1}"})
        url = _url(self.repo, filename, self.revision)
        with self._network(filename), self.session.stream("GET", url, headers=headers, follow_redirects=True) as r:
            self.requests += 1
            self._check(r, filename, True)
            with at_path(path, tmp), open(tmp, "wb") as f:
                for block in self._body(r, url, end - start, True):
                    f.write(block)
                    progress(len(block))
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)

    def header(self, filename: str) -> dict:
        head = self.get(filename, 0, 8)
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES:
            raise UserError(f"{self.repo}: {filename} claims a {n}-byte header: not a safetensors file")
        tensors, _, _ = parse_header(self.get(filename, 8, 8 + n), 8 + n, f"{self.repo}/{filename}",
                                     f"{_endpoint() or 'the Hub'} sent something else than the file: check "
                                     f"HF_ENDPOINT, or try another --fp8-revision")
        return tensors


def _ranges(infos: list) -> list[tuple[int, int, list]]:
    """Coalesce tensors (sorted by offset) into (start, end, tensors) requests."""
    out: list[tuple[int, int, list]] = []
    for t in sorted(infos, key=lambda t: t.begin):
        if out and t.begin - out[-1][1] <= COALESCE_GAP:
            s, _, ts = out[-1]
            out[-1] = (s, max(out[-1][1], t.end), ts + [t])
        else:
            out.append((t.begin, t.end, [t]))
    return out


def _finished_record(dest: Path, repo: str, revision: str, need_index: bool = True, log=print) -> dict | None:
    """The download record of a complete earlier fetch of repo@revision into dest, re-validated (headers
    parse, file sizes match), or None when there is work left."""
    rec_path = dest / DOWNLOAD_RECORD
    if not rec_path.is_file():
        return None
    try:
        rec = load_json(rec_path, "download record", "fetching again", FINISHED_RECORD)
    except UserError as e:  # damaged, or not step 0's: it vouches for nothing, and fetching again is safe (resumes)
        log(str(e))
        return None
    if rec["repo"] != repo or rec["revision"] != revision or rec["complete"] is not True:
        return None
    try:
        open_checkpoint(dest, need_index=need_index)
    except UserError as e:  # a file lost or damaged since: fetched again (its fix says to run this very command)
        log(f"{dest}: was complete, now damaged ({e}): fetching what is missing")
        return None
    return rec


def fetch_fp8(repo: str, revision: str, dest: Path, log=print) -> dict:
    """Fetch config.json and the shared-expert FP8 weights + scales of `repo` into `dest`, holding its lock."""
    with locked(Path(dest), "--dest"):
        return _fetch_fp8(repo, revision, Path(dest), log)


def _fetch_fp8(repo: str, revision: str, dest: Path, log=print) -> dict:
    """Fetch config.json and the shared-expert FP8 weights + scales of `repo` into `dest` (a small checkpoint):
    every header first, then the byte ranges as parts (kept across runs), then the files, the record last."""
    rec = _finished_record(dest, repo, revision, log=log)
    if rec:
        log(f"FP8 tensors already fetched: {dest} ({rec.get('tensors', '?')} tensors from {repo}@{revision[:12]})")
        return rec
    dest.mkdir(parents=True, exist_ok=True)
    f = Fetcher(repo, revision)
    config, wm, names = _fp8_wanted(f)
    # one folder per repo@revision: another revision's parts have the same names (same shapes), not the same bytes
    parts = dest / PARTS_DIR / hashlib.sha256(f"{repo}@{revision}".encode()).hexdigest()[:16]
    items = _fetch_parts(f, _fp8_ranges(f, wm, names), parts)
    items.sort(key=lambda i: names.index(i[0]))
    needed = sum(r.length for *_, r in items)
    header = encode_header([(n, d, s) for n, d, s, _ in items], {"format": "pt"})
    with Writer(dest, FETCH_PROGRESS, DOWNLOAD_RECORD, log=log) as w:
        w.resume(f"{repo}@{revision}", {FP8_FILE: len(header) + needed, "config.json": None, INDEX_FILE: None})
        w.begin()  # another revision's "complete" record goes before the first file of this one is written
        if FP8_FILE not in w.done:
            w.write(Output(FP8_FILE, len(header) + needed,
                           lambda dst: write_safetensors_tmp(dst, items, header=header)))
        for fname, doc in (("config.json", config),
                           (INDEX_FILE, rewrite_index(None, dict.fromkeys(names, FP8_FILE),
                                                      {n: r.length for n, *_, r in items}))):
            if fname not in w.done:
                w.write_json(fname, doc)
        w.wait()
        shutil.rmtree(dest / PARTS_DIR)
        rec = {"repo": repo, "revision": revision, "complete": True, "tensors": len(names),
               "bytes_needed": needed, "bytes_fetched": f.bytes, "requests": f.requests,
               "source_tensors": len(wm)}
        w.finish(rec)
    log(f"fetched {f.bytes / 1e6:.1f} MB in {f.requests} requests for {needed / 1e6:.1f} MB of FP8 tensors "
        f"(x{f.bytes / max(needed, 1):.3f}; {len(wm) - len(names)} other tensors of {repo} not fetched)")
    return rec


def _fp8_wanted(f: Fetcher) -> tuple[dict, dict, list[str]]:
    """(config, weight map, the tensors step 1 needs: each shared-expert weight, then its scale), checked: the
    Hub's files are checked at the edge like a local checkpoint's (their declared shapes bound the layer count)."""
    fix = "check HF_ENDPOINT and --fp8-repo/--fp8-revision"
    config = shape.check(f.json("config.json"), CONFIG, f"{f.repo}: config.json", fix)
    wm = shape.check(f.json(INDEX_FILE), INDEX, f"{f.repo}: {INDEX_FILE}", fix)["weight_map"]
    if (config.get("quantization_config") or {}).get("quant_method") != "fp8":
        raise UserError(f"{f.repo}: config.json does not describe an FP8 checkpoint: wrong --fp8-repo?")
    if not isinstance(qwen35.text_config(config).get("num_hidden_layers"), int):
        raise UserError(f"{f.repo}: config.json has no num_hidden_layers: not a Qwen3.5 checkpoint; {fix}")
    names = []
    for w in qwen35.shared_expert_weights(config):
        names += [w, qwen35.scale_name(w)]
    missing = [n for n in names if n not in wm]
    if missing:
        raise UserError(f"{f.repo}: its index lacks {len(missing)} of the {len(names)} tensors step 1 needs "
                        f"(e.g. {missing[0]}): wrong --fp8-repo?")
    for n in names:  # a shard's name becomes a URL and a part file's name: a plain file name, never a path
        if not shape.is_file_name(wm[n]):
            raise UserError(f"{f.repo}: {INDEX_FILE} puts {n} in {wm[n]!r}, not a file name of the repo: {fix}")
    return config, wm, names


def _fp8_ranges(f: Fetcher, wm: dict, names: list[str]) -> list[tuple[str, int, int, list]]:
    """(shard, start, end, tensors) requests: every header first, so the progress bar knows the total."""
    by_shard: dict[str, list[str]] = {}
    for n in names:
        by_shard.setdefault(wm[n], []).append(n)
    plan = []
    for shard, shard_names in sorted(by_shard.items()):
        header = f.header(shard)
        for n in shard_names:
            if n not in header:
                raise UserError(f"{f.repo}: {shard} lacks {n}, which the index puts there: try another revision")
        plan += [(shard, s, e, ts) for s, e, ts in _ranges([header[n] for n in shard_names])]
    return plan


def _fetch_parts(f: Fetcher, plan: list[tuple[str, int, int, list]], parts: Path) -> list[tuple]:
    """Each request's bytes as one part file (a part that is whole is not fetched again); returns the tensors
    as (name, dtype, shape, Range of their part)."""
    from huggingface_hub.utils import tqdm  # honours HF_HUB_DISABLE_PROGRESS_BARS

    parts.mkdir(parents=True, exist_ok=True)
    items = []
    with tqdm(total=sum(e - s for _, s, e, _ in plan), unit="B", unit_scale=True, desc="FP8 shared experts") as bar:
        for shard, start, end, ts in plan:
            part = parts / f"{shard}.{start}-{end}"
            if not part.is_file() or part.stat().st_size != end - start:
                f.get_to_file(shard, start, end, part, progress=bar.update)
            else:
                bar.update(end - start)
            items += [(t.name, t.dtype, t.shape, Range(part, t.begin - start, t.nbytes)) for t in ts]
    return items


def download_int4(repo: str, revision: str, dest: Path, log=print) -> dict:
    with locked(Path(dest), "--dest"):  # one writer per directory (onespark.checkpoint.lock)
        return _download_whole(repo, revision, Path(dest), "the INT4 checkpoint", _check_int4, log,
                               flags="--int4-repo and --revision")


def download_drafter(repo: str, revision: str, dest: Path, spec: specs.Spec, log=print) -> dict:
    """The DFlash drafter (`--drafter dflash`) to DEST/dflash: the whole repo at the pin, then the drafter
    check `onespark verify --drafter` makes (a drafter vLLM would refuse is not recorded as complete)."""
    with locked(Path(dest), "--dest"):
        # need_index=False: the drafter check takes a one-file drafter (model.safetensors, no index) as whole
        return _download_whole(repo, revision, Path(dest), "the DFlash drafter",
                               lambda d: _check_drafter(d, spec), log, flags="--drafter-revision", need_index=False)


def _check_int4(dest: Path) -> tuple[dict, str]:
    ck = open_checkpoint(dest, need_index=True)  # headers parse, sizes match: nothing truncated
    size = sum(p.stat().st_size for p in dest.iterdir() if p.is_file())
    return {"files": len(ck.headers), "bytes": size}, f"{size / 1e9:.2f} GB ({len(ck.headers)} safetensors files)"


def _check_drafter(dest: Path, spec: specs.Spec) -> tuple[dict, str]:
    from onespark.checkpoint.verify import drafter_problems

    problems, st = drafter_problems(dest, spec)
    if problems:
        raise UserError(f"{dest}: the downloaded drafter fails its check: {problems[0]}")
    return {"files": st["files"], "bytes": st["bytes"]}, f"{st['bytes'] / 1e9:.2f} GB, {st['tensors']} tensors"


def download_compressor(c: specs.Compressor, dest: Path, log=print) -> dict:
    """An LLMLingua-2 checkpoint (`--compressor NAME`, for `onespark compress serve`) to DEST/llmlingua2/NAME:
    its config, tokenizer and safetensors weights at the pin (not the repo's duplicate pytorch_model.bin),
    then checked: the family and head llmlingua needs, headers that parse, the sha256 where one is public."""
    with locked(Path(dest), "--dest"):
        return _download_whole(c.source.repo, c.source.revision, Path(dest), f"the LLMLingua-2 compressor {c.name}",
                               lambda d: check_compressor(d, c), log, flags="--compressor",
                               allow=["*.json", "*.safetensors", "*.txt", "*.model"], need_index=False)


def check_compressor(dest: Path, c: specs.Compressor) -> tuple[dict, str]:
    """(record fields, summary) of a compressor checkpoint that is what `c` says, else a UserError."""
    fix = f"delete {dest} and run `onespark download --dest DIR --compressor {c.name}` again"
    config = shape.load(dest / "config.json", shape.Obj({"model_type": shape.Str(), "architectures":
                                                         shape.ListOf(shape.Str(), min_len=1)}), fix)
    if config["model_type"] != c.model_type or not any("ForTokenClassification" in a for a in config["architectures"]):
        raise UserError(f"{dest}/config.json: a {config['model_type']} {config['architectures'][0]}, not the "
                        f"{c.model_type} token classifier {c.source.repo} is: {fix}")
    if not (dest / "tokenizer.json").is_file() and not (dest / "vocab.txt").is_file():
        raise UserError(f"{dest}: no tokenizer.json or vocab.txt: {fix}")
    ck = open_checkpoint(dest, need_index=False)  # one model.safetensors: its header parses, its size matches
    for name, want in c.sha256.items():
        h = hashlib.sha256()
        with open(dest / name, "rb") as f:
            while block := f.read(CHUNK):
                h.update(block)
        if h.hexdigest() != want:
            raise UserError(f"{dest}/{name}: sha256 {h.hexdigest()[:16]}... is not the published {want[:16]}...: {fix}")
    size = sum(p.stat().st_size for p in dest.iterdir() if p.is_file())
    return ({"files": len(ck.headers), "bytes": size, "sha256_checked": sorted(c.sha256)},
            f"{size / 1e9:.2f} GB, {c.model_type}, sha256 {'checked' if c.sha256 else 'not published'}")


def _download_whole(repo: str, revision: str, dest: Path, what: str, check, log, *, flags: str,
                    allow: list[str] | None = None, need_index: bool = True) -> dict:
    """`what`, the whole repo at the pin (or its files matching `allow`), into dest; `check(dest)` -> (record
    fields, summary) or a UserError. The record ("complete") is written last, so a killed or failed download is
    never taken for a finished one."""
    rec = _finished_record(dest, repo, revision, need_index, log)
    if rec:
        log(f"{what} already downloaded: {dest} ({repo}@{revision[:12]})")
        return rec
    log(f"downloading {what} {repo}@{revision[:12]} -> {dest} (interrupted? re-run: finished files are kept)")
    _check_hub(repo, revision, flags)
    (dest / DOWNLOAD_RECORD).unlink(missing_ok=True)  # another revision's: never vouches for files mixed with this one's
    _snapshot(repo, revision, dest, allow)
    fields, summary = check(dest)
    rec = {"repo": repo, "revision": revision, "complete": True, **fields}
    with Writer(dest, FETCH_PROGRESS, DOWNLOAD_RECORD, log=log) as w:
        w.finish(rec)
    log(f"downloaded {what}: {summary}")
    return rec


def _check_hub(repo: str, revision: str, flags: str) -> None:
    """Ask the Hub for repo's file list at revision, the request snapshot_download starts with, and turn its
    answer into the fix. snapshot_download itself, when that request fails, returns the local_dir as it is
    (a warning, no error): the failure would surface later as "config.json missing"."""
    from huggingface_hub import constants, get_session

    if constants.HF_HUB_OFFLINE:
        return  # HF_HUB_OFFLINE=1: snapshot_download uses what is on disk, and says so when it lacks something
    where = _endpoint() or constants.ENDPOINT
    url = f"{where.rstrip('/')}/api/models/{repo}/tree/{quote(revision, safe='')}"
    try:
        r = get_session().get(url, headers=_headers(), follow_redirects=True)
    except OSError:
        raise
    except Exception as e:  # huggingface_hub's HTTP client raises its own classes (httpx in 2.4)
        raise UserError(f"cannot reach {where} ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}): check "
                        f"the network (a proxy: HTTPS_PROXY; a mirror: HF_ENDPOINT), then run the same command "
                        f"again") from None
    hub = r.headers.get("X-Error-Code", "")  # the Hub's own reason: RepoNotFound, RevisionNotFound, GatedRepo
    if r.status_code in (401, 403):
        raise UserError(f"{repo}: {where} answered {r.status_code} {hub or 'unauthorized'}: log in (`hf auth login` "
                        f"or HF_TOKEN) and accept the model's licence on its page ({where.rstrip('/')}/{repo}); "
                        f"not logged in, the Hub answers 401 for a repo that does not exist too: check {flags}")
    if r.status_code == 404:
        which = {"RevisionNotFound": f"revision {revision} not found in {repo}",
                 "RepoNotFound": f"no repo {repo}"}.get(hub, f"{repo}@{revision} not found")
        raise UserError(f"{which} on {where} (404): check {flags} (`onespark specs` shows the pinned ones)")
    if r.status_code >= 400:
        raise UserError(f"{repo}: {where} answered HTTP {r.status_code}: try again later (finished files are kept)")
    try:  # the Hub answers a JSON list of files; a web server that is no Hub, a login page or a proxy, something else
        listing = r.json()
    except ValueError:
        listing = None
    if not isinstance(listing, list):
        raise UserError(f"{where} did not answer as the Hugging Face Hub does: GET {url} gave HTTP {r.status_code} "
                        f"{(r.headers.get('content-type') or 'without a content type').split(';')[0]}, not the JSON "
                        f"file list: check HF_ENDPOINT (a mirror must serve the Hub's API, /api/models/...)")


def _snapshot(repo: str, revision: str, dest: Path, allow: list[str] | None = None) -> None:
    """The whole repo at the pin into dest (huggingface_hub keeps finished files: a re-run resumes)."""
    from huggingface_hub import snapshot_download

    try:
        snapshot_download(repo, revision=revision, local_dir=dest, max_workers=4, endpoint=_endpoint(),
                          allow_patterns=allow)
    except OSError:
        raise  # permission denied, disk full...: the CLI names the path and the fix
    except json.JSONDecodeError as e:  # an answer that is no Hub's: running again would get the same
        raise UserError(f"download of {repo}@{revision[:12]}: {_endpoint() or 'the Hub'} did not answer as the "
                        f"Hugging Face Hub does ({type(e).__name__}): check HF_ENDPOINT") from None
    except Exception as e:  # huggingface_hub's errors name the repo and the HTTP status
        raise UserError(f"download of {repo}@{revision[:12]} failed: {type(e).__name__}: {str(e).splitlines()[0]}; "
                        f"re-run to resume") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dest", required=True, type=options.directory_path, help="directory for int4/ and fp8/")
    specs.add_model_argument(p)
    p.add_argument("--int4-repo", help="INT4 repo (default: the spec's; required with --model custom)")
    p.add_argument("--int4-revision", "--revision",
                   help="commit SHA of the INT4 repo (default: the spec's pin; required where it has none)")
    p.add_argument("--fp8-repo", help="FP8 repo (default: the spec's)")
    p.add_argument("--fp8-revision", help="commit SHA of the FP8 repo (default: the spec's pin)")
    p.add_argument("--skip-int4", action="store_true", help="fetch only the FP8 tensors")
    p.add_argument("--skip-fp8", action="store_true", help="download only the INT4 checkpoint")
    p.add_argument("--drafter", choices=specs.DRAFTERS, default=specs.DEFAULT_DRAFTER,
                   help="dflash: also fetch the spec's DFlash drafter to DEST/dflash (vLLM 0.32.0 track; default "
                        "mtp: the checkpoint's own MTP layer, nothing to fetch)")
    p.add_argument("--drafter-revision", help="commit SHA of the drafter repo (required: it has no public pin)")
    p.add_argument("--compressor", choices=sorted(specs.COMPRESSORS),
                   help=f"also fetch this LLMLingua-2 prompt compressor (pinned) to DEST/{specs.COMPRESSOR_DIR}/NAME, "
                        f"for `onespark compress serve` ("
                        + ", ".join(f"{c.name} ~{c.source.size_gb:g} GB" for c in specs.COMPRESSORS.values())
                        + "; default: none)")


def run(args: argparse.Namespace) -> int:
    log = lambda m: print(m, flush=True)  # noqa: E731
    # an unknown --model or a missing --revision fails before anything is created
    spec = specs.named_or_custom(args.model, args.int4_repo, args.fp8_repo, args.int4_revision, args.fp8_revision)
    int4 = None if args.skip_int4 else _pinned(spec.int4, args.int4_repo, args.int4_revision, "--revision", spec)
    fp8 = None
    if not args.skip_fp8 and (spec.fp8 is not None or args.fp8_repo):
        fp8 = _pinned(spec.fp8, args.fp8_repo, args.fp8_revision, "--fp8-revision", spec)
    drafter = None
    if args.drafter == "dflash":
        if spec.dflash is None:
            raise UserError(f"--drafter dflash: spec {spec.name} has no DFlash drafter; use --drafter mtp")
        drafter = _pinned(spec.dflash, None, args.drafter_revision, "--drafter-revision", spec)
    elif args.drafter_revision:
        raise UserError("--drafter-revision is for --drafter dflash")
    args.dest.mkdir(parents=True, exist_ok=True)  # an unwritable --dest fails here, before any transfer
    if int4:  # whether the files are the spec's model is checked by steps 1-2 (they name the spec they look like)
        download_int4(*int4, args.dest / "int4", log=log)
    if fp8:
        fetch_fp8(*fp8, args.dest / "fp8", log=log)
    elif not args.skip_fp8:
        log(f"step 0: no FP8 source for {spec.name}: {spec.no_splice}; FP8 fetch skipped")
    if drafter:
        download_drafter(*drafter, args.dest / "dflash", spec, log=log)
    if args.compressor:
        download_compressor(specs.COMPRESSORS[args.compressor],
                            args.dest / specs.COMPRESSOR_DIR / args.compressor, log=log)
    return 0


def _pinned(src: specs.Source | None, repo: str | None, revision: str | None, flag: str,
            spec: specs.Spec) -> tuple[str, str]:
    """(repo, revision): the flags, else the spec's; a repo without a pinned revision needs the flag."""
    repo = repo or src.repo
    revision = revision or (src.revision if src and repo == src.repo else None)
    if not revision:
        why = src.pin_source if src and repo == src.repo else "not the spec's repo"
        raise UserError(f"{repo}: no pinned revision ({why}): pass {flag} SHA, the commit you checked on the "
                        f"repo's 'Files and versions' page (`onespark specs --model {spec.name}` shows the pins)")
    return repo, revision
