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

from onespark import shape
from onespark.checkpoint.lock import LOCK_FILE
from onespark.checkpoint.safetensors_io import (
    MAX_HEADER_BYTES,
    REDOWNLOAD,
    Header,
    TensorInfo,
    finalize,
    read_header,
    write_json_atomic,
)
from onespark.errors import UserError
from onespark.shape import Bool, FileName, Int, ListOf, MapOf, Nullable, Obj, OneOf, Str

INDEX_FILE = "model.safetensors.index.json"
MANIFEST_FILE = "onespark-manifest.json"
DOWNLOAD_RECORD = "onespark-download.json"

# What the steps read of config.json, declared (onespark.shape): anything else in it is passed through unread.
# The ranges keep a corrupt number out of the layout's loops: the real models have 40-48 layers of 256 experts.
_DIM = Int(1, 1 << 22, "a positive integer")
_TEXT = Obj(optional={
    **dict.fromkeys(("hidden_size", "head_dim", "num_attention_heads", "num_key_value_heads", "linear_key_head_dim",
                     "linear_num_key_heads", "linear_value_head_dim", "linear_num_value_heads",
                     "linear_conv_kernel_dim", "moe_intermediate_size", "shared_expert_intermediate_size",
                     "vocab_size", "num_experts_per_tok"), _DIM),
    "num_hidden_layers": Int(1, 1024, "a layer count"), "num_experts": Int(1, 4096, "an expert count"),
    "mtp_num_hidden_layers": Int(0, 16, "a layer count"), "full_attention_interval": Int(1, 1024),
    "layer_types": ListOf(Str("a layer type (string)")), "attn_output_gate": Bool(),
    "tie_word_embeddings": Bool(), "dtype": Nullable(str), "torch_dtype": Nullable(str),
}, what="an object (the text model's dims)")
_LAYER_CONFIG = Obj(optional={"bits": Int(1, 32, "a bit width")}, what="an object ({\"bits\": N, ...})")
_QUANT = Obj(optional={
    "quant_method": Str(), "packing_format": Str(), "fmt": Str(), "activation_scheme": Str(),
    "bits": Int(1, 32, "a bit width"), "group_size": Int(1, 1 << 20, "a group size"),
    "weight_block_size": ListOf(Int(1, 1 << 20), "a list of two block sizes [rows, cols]", min_len=2),
    "extra_config": Nullable(MapOf(_LAYER_CONFIG, "an object of layer name -> {\"bits\": N}")),
    "block_name_to_quantize": Nullable(OneOf(Str(), ListOf(str))), "to_quant_block_names": Nullable(OneOf(Str(),
                                                                                                          ListOf(str))),
    "modules_to_not_convert": Nullable(ListOf(str)),
    "onespark_fp8": Nullable(Obj({"layers": ListOf(str)}, optional={
        "scale_dtype": OneOf(Str(), ListOf(str)),
        "weight_block_size": ListOf(Int(1, 1 << 20), "a list of two block sizes [rows, cols]", min_len=2)})),
}, what="an object (the quantization settings)")
_VISION = Obj({**dict.fromkeys(("hidden_size", "intermediate_size", "patch_size", "num_position_embeddings",
                                 "out_hidden_size"), _DIM), "depth": Int(0, 1024, "a block count")},
              dict.fromkeys(("spatial_merge_size", "in_channels", "temporal_patch_size", "num_heads"), _DIM),
              what="an object (the vision tower's dims)")
CONFIG = Obj(optional={"text_config": _TEXT, "vision_config": Nullable(_VISION), "quantization_config": Nullable(_QUANT), "onespark": Nullable(dict),
                       "architectures": Nullable(ListOf(str)), "model_type": Nullable(str),
                       "tie_word_embeddings": Bool(), "dtype": Nullable(str), "torch_dtype": Nullable(str),
                       # a flat config (no text_config) has the text dims at the top
                       **_TEXT.optional}, what="an object (the model config)")
INDEX = Obj({"weight_map": MapOf(Str("a file name (string)"), "an object of tensor name -> file name")},
            {"metadata": Nullable(Obj(optional={"total_size": Int(0, what="a byte count")}))},
            what="an object ({\"metadata\": ..., \"weight_map\": ...})")
RECORD = Obj(optional={"repo": Nullable(str), "revision": Nullable(str)}, what="an object (step 0's record)")
# What step 0 reads back before it says "already fetched": only a JSON true is complete (not "no", not 1).
FINISHED_RECORD = Obj({"repo": Str(), "revision": Str(), "complete": Bool()}, what="an object (step 0's record)")
# The files' names are joined to the checkpoint directory, then stat'ed and hashed (damaged_files, verify): plain
# names only, or "/etc/passwd" and "../x" are read outside it (and verify reported them: "delete it").
MANIFEST = Obj({"files": MapOf(Obj({"size": Int(0, what="a byte count")}, {"sha256": Nullable(str)}),
                               "an object of file name -> {size, sha256}", key=FileName())},
               {"steps": MapOf(dict, "an object of step -> record"),
                "inputs": Obj(optional={"int4": Nullable(dict), "fp8": Nullable(dict)},
                              what="an object ({\"int4\": ..., \"fp8\": ...})"),
                "spec": Str("a spec name")},
               what="an object (the manifest)")
# The fix a damaged manifest's message ends with. Not "delete it": step 1 refuses a non-empty --out without one.
MANIFEST_FIX = "remove the directory that holds it, then run step 1 again"
# Writer's progress record (a hidden file of its own): the inputs' fingerprint and the files written so far.
PROGRESS = Obj({"fingerprint": Str(), "done": MapOf(Obj({"size": Int(0, what="a byte count")}),
                                                    "an object of file name -> {size}")},
               what="an object ({\"fingerprint\": ..., \"done\": ...})")


def load_json(path: Path, what: str, fix: str = "download it again", like=dict) -> dict:
    """A JSON file checked against its declared shape (`like`, onespark.shape): one UserError naming the file,
    the field and `fix` when it is missing, not JSON, or of another shape."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise UserError(f"{path}: missing ({what}): is this the right directory?") from None
    doc = shape.parse(raw, str(path), f"the file is corrupt; {fix}")
    return shape.check(doc, like, f"{path} ({what})", f"the file is corrupt or not {what}; {fix}")


def recorded_spec(path: str | Path) -> str | None:
    """The model spec step 1 recorded in DIR's manifest, so that later steps and serve need no --model; None
    where there is none (no manifest: a download served as it is, or a manifest of an earlier onespark)."""
    if not (Path(path) / MANIFEST_FILE).is_file():
        return None
    return load_json(Path(path) / MANIFEST_FILE, "manifest", MANIFEST_FIX, MANIFEST).get("spec")


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
        return load_json(p, "download record", like=RECORD) if p.is_file() else {}


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
    config = load_json(path / "config.json", "the model config", early_fix.removeprefix("delete it and "), CONFIG)
    fix = repair_hint(path, config)
    index = None
    if (path / INDEX_FILE).is_file():
        index = load_json(path / INDEX_FILE, "the tensor index", fix.removeprefix("delete it and "), INDEX)
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


def header_sha256(path: Path) -> str:
    """sha256 of a safetensors file's length prefix and JSON header: every tensor's name, dtype, shape and
    place, read in microseconds. A relabelled dtype or a swapped shape changes it; the size does not."""
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        return hashlib.sha256(head + f.read(min(n, MAX_HEADER_BYTES))).hexdigest()


SAMPLE_BLOCKS, SAMPLE_BYTES = 16, 64 * 1024


def sample_sha256(path: Path) -> str:
    """A cheap content fingerprint of an input file: the whole file up to 1 MiB, else its safetensors header
    (if any) and 16 blocks of 64 KiB spread over it. 1 MiB read per 5 GB shard (14 shards: well under a second
    from the page cache, a few seconds of seeks on a disk); two INT4 exports of the same shapes differ in it,
    where names and sizes alone are equal. Not a hash of every byte: `onespark verify` hashes the outputs."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        if size <= SAMPLE_BLOCKS * SAMPLE_BYTES:
            h.update(f.read())
            return h.hexdigest()
        if path.suffix == ".safetensors":
            h.update(header_sha256(path).encode())
        for i in range(SAMPLE_BLOCKS):
            f.seek((size - SAMPLE_BYTES) * i // (SAMPLE_BLOCKS - 1))
            h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def input_files(directory: Path) -> dict[str, dict]:
    """What a step read from an input directory, to tell it from another one later: every file but the hidden
    ones and onespark's own records, with its size and sample_sha256."""
    return {p.name: {"size": p.stat().st_size, "sample_sha256": sample_sha256(p)}
            for p in sorted(Path(directory).iterdir())
            if p.is_file() and not p.name.startswith(".") and p.name not in (MANIFEST_FILE, DOWNLOAD_RECORD)}


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


SMALL_FILE = 64 * 1024 * 1024  # JSON and tokenizer files: hashed whole when the done-check compares them


def damaged_files(out: Path, manifest: dict) -> dict[str, str]:
    """The files a manifest lists that no longer are as it says: missing, another size, a shard header that no
    longer parses or is not the one written (header_sha256: a relabelled dtype, a swapped shape), a JSON file
    that no longer parses, a small file whose sha256 changed. File -> what is wrong.
    Sizes, headers and small files only: seconds for 77 GB (`onespark verify` compares every sha256)."""
    bad = {}
    for fname, entry in sorted(manifest.get("files", {}).items()):
        f = out / fname
        if not f.is_file():
            bad[fname] = f"{fname} is missing"
        elif f.stat().st_size != entry.get("size"):
            bad[fname] = f"{fname} is {f.stat().st_size} bytes, the manifest says {entry.get('size')}"
        elif fname.endswith((".safetensors", ".json")) and not _parses(f):
            bad[fname] = f"{fname} does not parse"
        elif entry.get("header_sha256") and header_sha256(f) != entry["header_sha256"]:
            bad[fname] = f"{fname}'s header is not the one written (a tensor's dtype or shape changed)"
        elif entry.get("sha256") and entry["size"] <= SMALL_FILE and sha256_file(f) != entry["sha256"]:
            bad[fname] = f"{fname} changed since it was written (sha256 differs)"
    return bad


def _parses(f: Path) -> bool:
    try:
        read_header(f) if f.name.endswith(".safetensors") else load_json(f, f.name)
    except UserError:
        return False
    return True


def file_entry(path: Path, sha256: str | None) -> dict:
    """A manifest's record of one written file: size, sha256 (None when not hashed) and, for a shard, the
    sha256 of its header (the done-check compares it; see damaged_files)."""
    entry = {"size": path.stat().st_size, "sha256": sha256}
    if path.name.endswith(".safetensors"):
        entry["header_sha256"] = header_sha256(path)
    return entry


def rewrite_index(index: dict | None, weight_map: dict[str, str], nbytes: dict[str, int]) -> dict:
    """`index` (left as it is) with this weight map, sorted, and metadata.total_size = the bytes of the tensors it
    lists (the Hugging Face convention); `nbytes`: tensor name -> size, for every tensor the shards hold."""
    doc = json.loads(json.dumps(index or {"metadata": {}}))  # a new index: metadata first, as HF writes it
    doc["weight_map"] = dict(sorted(weight_map.items()))
    if not isinstance(doc.get("metadata"), dict):  # "metadata": null is allowed in (INDEX): written as an object
        doc["metadata"] = {}
    doc["metadata"]["total_size"] = sum(nbytes[n] for n in weight_map if n in nbytes)
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
        self.progress_damage = ""  # why the progress record was not usable (_load_progress)
        self.progress = self._load_progress()
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

    def _load_progress(self) -> dict | None:
        """The progress record of a killed run, or None when there is none. One that is damaged (not JSON, another
        shape) cannot say what was written: its run is taken as one of other inputs, and `resume` starts over."""
        if not self.progress_path.is_file():
            return None
        try:
            return load_json(self.progress_path, "progress record", "starting over", PROGRESS)
        except UserError as e:
            self.progress_damage = str(e)
            return {"fingerprint": None, "done": {}}

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
        - a killed run on other inputs: nothing, and every file it left is deleted (not the lock: onespark.checkpoint.lock).
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
            self.log(self.progress_damage or "inputs changed since the interrupted run: starting over")
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
        sums = {f: self.carried.get(f, {}).get("sha256") for f in self.done}
        if self.hash_outputs:
            for f in sums:
                if sums[f] is None or f in self._hashes:
                    sums[f] = (self._hashes.get(f) or self._pool.submit(sha256_file, self.out / f)).result()
        return {f: file_entry(self.out / f, sums[f]) for f in sorted(self.done)}

    def finish(self, doc: dict) -> None:
        """The "complete" record, last; then the progress record goes."""
        self.wait()
        write_json_atomic(self.record_path, doc)
        self.progress_path.unlink(missing_ok=True)
