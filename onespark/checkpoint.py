"""A checkpoint directory as the steps see it: config, index, and every shard's header (never its data)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from onespark.errors import UserError
from onespark.safetensors_io import REDOWNLOAD, Header, TensorInfo, read_header

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
