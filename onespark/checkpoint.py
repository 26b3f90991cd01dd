"""A checkpoint directory as the steps see it: config, index, and every shard's header (never its data); and
the skeleton every step writes one with (Writer: temp file + fsync + rename, a progress record, the index
rewrite, the manifest last)."""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Callable, NamedTuple

from onespark.errors import UserError
from onespark.lock import LOCK_FILE
from onespark.safetensors_io import REDOWNLOAD, Header, TensorInfo, finalize, read_header, write_json_atomic

INDEX_FILE = "model.safetensors.index.json"
MANIFEST_FILE = "onespark-manifest.json"
DOWNLOAD_RECORD = "onespark-download.json"


def load_json(path: Path, what: str, fix: str = "download it again") -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise UserError(f"{path}: missing ({what}): is this the right directory?") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: not valid JSON ({e}): the file is corrupt; {fix}") from None
    if not isinstance(doc, dict):
        raise UserError(f"{path}: expected a JSON object ({what})")
    return doc


@dataclasses.dataclass
class Checkpoint:
    path: Path
    config: dict
    index: dict | None  # the parsed index file, or None when there is none
    headers: dict[str, Header]  # every *.safetensors file in the directory, by file name
    where: dict[str, str]  # tensor name -> file name (first file holding it)
    duplicates: dict[str, list[str]]  # tensor name -> every file holding it, when more than one

    @property
    def weight_map(self) -> dict[str, str]:
        return (self.index or {}).get("weight_map", {})

    def info(self, name: str) -> TensorInfo:
        return self.headers[self.where[name]].tensors[name]

    @property
    def record(self) -> dict:
        """What step 0 recorded about where this directory came from (repo, revision), if anything."""
        p = self.path / DOWNLOAD_RECORD
        return load_json(p, "download record") if p.is_file() else {}


def repair_hint(path: Path, config: dict) -> str:
    """What to do about a damaged file in this directory, naming the step that made it: step 1 writes a
    hybrid checkpoint's files (and repairs them when run again), step 0 downloads the inputs."""
    if (config.get("onespark") or {}).get("step") == "hybrid" or (path / MANIFEST_FILE).is_file():
        return ("step 1 wrote it: re-run step 1 (steps/1-hybrid.sh, or `onespark hybrid` with the same --int4, "
                "--fp8 and --out), which rewrites what is damaged")
    return REDOWNLOAD


def open_checkpoint(path: Path | str, *, need_index: bool = True) -> Checkpoint:
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"{path}: not a directory: give the checkpoint directory (the one with config.json)")
    if not any(path.iterdir()):
        raise UserError(f"{path}: empty directory: run step 0 (onespark download) or point at the checkpoint")
    early_fix = repair_hint(path, {})  # before config.json is read, the manifest alone says who wrote it
    config = load_json(path / "config.json", "the model config", early_fix.removeprefix("delete it and "))
    fix = repair_hint(path, config)
    index = None
    if (path / INDEX_FILE).is_file():
        index = load_json(path / INDEX_FILE, "the tensor index", fix.removeprefix("delete it and "))
        if not isinstance(index.get("weight_map"), dict):
            raise UserError(f"{path / INDEX_FILE}: has no weight_map object: the file is corrupt; {fix}")
    elif need_index:
        raise UserError(f"{path / INDEX_FILE}: missing: a sharded checkpoint needs its index; "
                        f"{fix.removeprefix('delete it and ')}")
    headers: dict[str, Header] = {}
    for f in sorted(path.glob("*.safetensors")):
        headers[f.name] = read_header(f, fix)
    for fname in sorted(set((index or {}).get("weight_map", {}).values())):
        if fname not in headers:
            raise UserError(f"{path / fname}: missing, but the index lists tensors in it: "
                            f"{fix.removeprefix('delete it and ')}")
    if not headers:
        raise UserError(f"{path}: no *.safetensors files: is this the right directory?")
    where: dict[str, str] = {}
    seen: dict[str, list[str]] = {}
    for fname, h in headers.items():
        for name in h.tensors:
            seen.setdefault(name, []).append(fname)
            where.setdefault(name, fname)
    duplicates = {n: fs for n, fs in seen.items() if len(fs) > 1}
    return Checkpoint(path, config, index, headers, where, duplicates)


def sha256_file(path: Path, chunk: int = 8 * 1024 * 1024) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def is_inside(child: Path, parent: Path) -> bool:
    child, parent = child.resolve(), parent.resolve()
    return child == parent or parent in child.parents


# -- writing: the skeleton steps 0, 1 and 2 share ---------------------------------------------------------------


def damaged_files(out: Path, manifest: dict) -> dict[str, str]:
    """The files a manifest lists that no longer are as it says: missing, another size, or a shard header /
    JSON file that no longer parses. File -> what is wrong.
    Sizes and headers only: seconds for 77 GB (`onespark verify` compares the sha256)."""
    bad = {}
    for fname, entry in sorted(manifest.get("files", {}).items()):
        f = out / fname
        if not f.is_file():
            bad[fname] = f"{fname} is missing"
        elif f.stat().st_size != entry.get("size"):
            bad[fname] = f"{fname} is {f.stat().st_size} bytes, the manifest says {entry.get('size')}"
        elif fname.endswith((".safetensors", ".json")):
            try:
                read_header(f) if fname.endswith(".safetensors") else load_json(f, fname)
            except UserError:
                bad[fname] = f"{fname} does not parse"
    return bad


def rewrite_index(index: dict | None, weight_map: dict[str, str], nbytes: dict[str, int]) -> dict:
    """`index` (left as it is) with this weight map, sorted, and metadata.total_size = the bytes of the tensors it
    lists (the Hugging Face convention); `nbytes`: tensor name -> size, for every tensor the shards hold."""
    doc = json.loads(json.dumps(index or {"metadata": {}}))  # a new index: metadata first, as HF writes it
    doc["weight_map"] = dict(sorted(weight_map.items()))
    doc.setdefault("metadata", {})["total_size"] = sum(nbytes[n] for n in weight_map if n in nbytes)
    return doc


class Output(NamedTuple):
    """One file of a plan: its name, its size (known before writing, so the disk check and a resume can use it)
    and how it is made: dst -> (its temp file, size), not yet synced nor renamed (safetensors_io's *_tmp)."""
    name: str
    size: int
    make: Callable[[Path], tuple[Path, int]]


class Writer:
    """Writes one step's output files into `out` so that a killed run resumes and a finished one is known:

    - every file is written under a temp name, fsynced, then renamed (safetensors_io): a file with its final name
      is whole;
    - the progress record (the hidden file `progress`) lists the files written so far with their sizes, under the
      fingerprint of the inputs: a re-run on the same inputs keeps them, a run on other inputs starts over;
    - the `record` that says "complete" (step 1's manifest, step 0's download record) is written last, and the
      progress record removed after it: its presence means the step finished.

    Two thread pools (shut down on leaving the `with` block): one file's fsync overlaps the next file's copy, and
    with `hash_outputs` each written file is hashed from the page cache while the next one is copied."""

    def __init__(self, out: Path, progress: str, record: str, *, hash_outputs: bool = False, log=print):
        self.out, self.hash_outputs, self.log = Path(out), hash_outputs, log
        self.progress_path, self.record_path = self.out / progress, self.out / record
        self.progress = load_json(self.progress_path, "progress") if self.progress_path.is_file() else None
        self.fingerprint = ""
        self.done: dict[str, dict] = {}  # file -> {"size": n}, written and renamed
        self.carried: dict[str, dict] = {}  # file -> a finished run's manifest entry (size, sha256), kept
        self._lock = threading.Lock()
        self._hashes: dict[str, cf.Future] = {}
        self._synced: list[cf.Future] = []
        # sha256 runs at ~1 GB/s a core (SHA-NI Xeon, measured): hash up to 4 files at once beside the copy.
        self._pool = cf.ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1)))
        self._syncer = cf.ThreadPoolExecutor(max_workers=1)  # threads start on the first submit

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc) -> None:
        self._syncer.shutdown(wait=True)
        self._pool.shutdown(wait=True, cancel_futures=True)

    def refuse_foreign(self, tool: str, flag: str) -> None:
        """A directory this writer did not start (no progress record) must be empty: it is never overwritten."""
        if self.out.exists() and self.progress is None and any(p.name != LOCK_FILE for p in self.out.iterdir()):
            raise UserError(f"{self.out} exists, is not empty and was not written by {tool}: choose a new {flag} "
                            f"(nothing was changed)")

    def resume(self, fingerprint: str, expect: dict[str, int | None], carried: dict | None = None) -> None:
        """Decide what is written already, before the first byte:
        - a repair (`carried`: a finished run's intact files, by its manifest): those the plan still makes at that
          size (`expect`: file -> size, None where only writing tells, as for JSON files);
        - a killed run on the same inputs: the files its progress record lists, still of the recorded size;
        - a killed run on other inputs: nothing, and every file it left is deleted (not the lock: onespark.lock).
        Then the temp files of a killed run go: never renamed, so never trusted."""
        self.fingerprint = fingerprint
        if carried:
            self.carried = carried
            self.done = {f: {"size": v["size"]} for f, v in carried.items()
                         if f in expect and expect[f] in (None, v["size"])}
        elif self.progress and self.progress.get("fingerprint") == fingerprint:
            self.done = {f: v for f, v in self.progress.get("done", {}).items()
                         if (self.out / f).is_file() and (self.out / f).stat().st_size == v["size"]}
            if self.done:
                self.log(f"resuming: {len(self.done)} of {len(expect)} files already written")
        elif self.progress:
            self.log("inputs changed since the interrupted run: starting over")
            for p in self.out.iterdir():
                if p.is_file() and p.name != LOCK_FILE:
                    p.unlink()
        self.out.mkdir(parents=True, exist_ok=True)
        for p in self.out.glob(".*.tmp-*"):
            p.unlink()

    def begin(self) -> None:
        """From here on a repair is a killed run like any other: the progress record says what is done."""
        self._record()
        self.record_path.unlink(missing_ok=True)

    def _record(self) -> None:
        write_json_atomic(self.progress_path, {"fingerprint": self.fingerprint, "done": self.done})

    def _finished(self, fname: str, size: int) -> None:
        with self._lock:
            self.done[fname] = {"size": size}
            self._record()
        if self.hash_outputs:
            self._hashes[fname] = self._pool.submit(sha256_file, self.out / fname)

    def write(self, o: Output) -> int:
        """Make `o` under its temp name now; fsync, rename and record it on the sync thread. Returns its size."""
        fname = o.name
        tmp, size = o.make(self.out / fname)
        if size != o.size:
            raise AssertionError(f"{fname}: wrote {size} bytes, the plan says {o.size}")

        def sync_and_rename() -> None:
            finalize(tmp, self.out / fname)  # a file has its final name only once its bytes are on disk
            self._finished(fname, size)

        self._synced.append(self._syncer.submit(sync_and_rename))
        return size

    def write_json(self, fname: str, doc: dict) -> None:
        """A JSON file, once every file written before it is on disk (the JSON files describe them)."""
        self.wait()
        write_json_atomic(self.out / fname, doc)
        self._finished(fname, (self.out / fname).stat().st_size)

    def wait(self) -> None:
        for fut in self._synced:
            fut.result()
        self._synced = []

    def files(self) -> dict[str, dict]:
        """The manifest's "files": every file written or kept, its size and (with hash_outputs) its sha256."""
        self.wait()
        files = {f: {"size": v["size"], "sha256": self.carried.get(f, {}).get("sha256")} for f, v in self.done.items()}
        if self.hash_outputs:
            for f, entry in files.items():
                if entry["sha256"] is None or f in self._hashes:
                    entry["sha256"] = (self._hashes.get(f) or self._pool.submit(sha256_file, self.out / f)).result()
        return dict(sorted(files.items()))

    def finish(self, doc: dict) -> None:
        """The "complete" record, last; then the progress record goes."""
        self.wait()
        write_json_atomic(self.record_path, doc)
        self.progress_path.unlink(missing_ok=True)
