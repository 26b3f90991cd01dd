"""Step 2, `onespark mtp DIR [--model NAME] [--source INT4_DIR]`: every mtp.* tensor loadable.

vLLM finds a tensor only through model.safetensors.index.json. The Intel 122B release keeps its MTP head
(785 tensors) in model_extra_tensors.safetensors without listing it there (the reason albond's
add-mtp-weights.py exists; the 35B release lists its 2329: onespark.model.specs), and a public fork's splice
step dropped the file altogether (112 -> 45 tok/s). --model (default qwen3.5-122b-a10b) refuses another
model's files, naming the spec they look like.
This step makes the index list every mtp.* tensor at the file that really holds it, whatever step 1 or
the source did: it adds missing entries, corrects wrong ones, and with --source copies
model_extra_tensors.safetensors back when the head is absent. It fails when the head is incomplete.
Running it again changes nothing ("already done"). The manifest, if any, is updated to match.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from onespark import options
from onespark.checkpoint.lock import locked
from onespark.checkpoint.safetensors_io import copy_file_atomic, read_header, write_json_atomic
from onespark.checkpoint.writer import (
    CONFIG,
    INDEX_FILE,
    MANIFEST,
    MANIFEST_FILE,
    MANIFEST_FIX,
    Checkpoint,
    file_entry,
    is_inside,
    load_json,
    open_checkpoint,
    recorded_spec,
    rewrite_index,
    sha256_file,
)
from onespark.errors import UserError
from onespark.model import qwen35, specs


def _required_mtp(config: dict) -> set[str]:
    return {n for n in qwen35.expected_tensors(config) if qwen35.is_mtp(n) and not qwen35.is_optional(n)}


def _restore_head(path: Path, source: Path, log) -> list[str]:
    """Copy the files holding the MTP head from `source` when `path` lacks some required mtp.* tensor.

    Runs before `path` is opened as a checkpoint: after step 2 the index lists the head's file, so a
    checkpoint that lost it cannot be opened until the file is back."""
    if is_inside(source, path) or is_inside(path, source):
        raise UserError(f"--source {source} and {path} overlap: give the original INT4 download as --source")
    if not path.is_dir():
        return []  # open_checkpoint says what is wrong with it
    required = _required_mtp(load_json(path / "config.json", "the model config", like=CONFIG))
    have: set[str] = set()
    for f in sorted(path.glob("*.safetensors")):
        try:
            have |= set(read_header(f).tensors)
        except UserError:
            continue  # a damaged file: open_checkpoint reports it, with the step that makes it
    if not required or required <= have:
        return []
    src = open_checkpoint(source, need_index=False)
    files = sorted({src.where[n] for n in src.where if qwen35.is_mtp(n)})
    if not files:
        raise UserError(f"--source {source} has no mtp.* tensors either: it is not the Intel INT4 download")
    copied = []
    for f in files:
        if (path / f).exists():
            raise UserError(f"{path / f} exists but lacks mtp.* tensors that {source / f} has: "
                            f"remove it or re-run step 1")
        log(f"copying {f} from {source}")
        copy_file_atomic(source / f, path / f)
        copied.append(f)
    return copied


def mtp(path: Path, **kw) -> dict:
    """Step 2 in `path`, holding its lock (onespark.checkpoint.lock): never while step 1 still writes there."""
    path = Path(path)
    if not path.is_dir():
        return _mtp(path, **kw)  # open_checkpoint says what is wrong with it
    with locked(path, "checkpoint directory"):
        return _mtp(path, **kw)


def _mtp(path: Path, *, source: Path | None = None, spec: specs.Spec | None = None, log=print) -> dict:
    path = Path(path)
    spec = spec or specs.get(None)
    if path.is_dir() and (path / "config.json").is_file():  # before anything is copied into it
        config = load_json(path / "config.json", "the model config", like=CONFIG)
        specs.check_config(spec, config, str(path / "config.json"))
    copied = _restore_head(path, Path(source), log) if source is not None else []
    ck = open_checkpoint(path)
    found = _mtp_tensors(ck, source)
    wm = dict(ck.weight_map)
    added = [n for n in found if n not in wm]
    fixed = [n for n in found if n in wm and wm[n] != found[n]]
    stale = [n for n in wm if qwen35.is_mtp(n) and n not in found]
    if not (added or fixed or stale or copied):
        result = {"added": 0, "fixed": 0, "removed": 0, "mtp_tensors": len(found)}
        if _index_unrecorded(path):  # a run killed between writing the index and recording it: finish it
            _record_in_manifest(path, [INDEX_FILE], result)
            log(f"{MANIFEST_FILE} updated to the index an interrupted step 2 wrote")
        log(f"step 2 already done: all {len(found)} mtp.* tensors are in the index of {path}")
        return result
    for n in added + fixed:
        wm[n] = found[n]
    for n in stale:  # points at nothing: vLLM would fail on it
        del wm[n]
    write_json_atomic(path / INDEX_FILE, rewrite_index(ck.index, wm, {n: ck.info(n).nbytes for n in ck.where}))
    result = {"added": len(added), "fixed": len(fixed), "removed": len(stale), "copied": copied,
              "mtp_tensors": len(found)}
    if (path / MANIFEST_FILE).is_file():
        _record_in_manifest(path, [INDEX_FILE] + copied, result)
    log(f"index now lists all {len(found)} mtp.* tensors ({len(added)} added, {len(fixed)} corrected, "
        f"{len(stale)} dangling removed{', copied ' + ', '.join(copied) if copied else ''})")
    return result


def _mtp_tensors(ck: Checkpoint, source: Path | None) -> dict[str, str]:
    """Every mtp.* tensor -> the file that holds it; fails unless the head is whole and in one copy."""
    required = _required_mtp(ck.config)
    if not required:
        raise UserError(f"{ck.path}: config.json has no MTP layers (text_config.mtp_num_hidden_layers = 0): "
                        f"nothing to do for a model without an MTP head")
    found = {n: f for n, f in ck.where.items() if qwen35.is_mtp(n)}
    dup = {n: fs for n, fs in ck.duplicates.items() if qwen35.is_mtp(n)}
    if dup:
        n, fs = next(iter(dup.items()))
        raise UserError(f"{ck.path}: {len(dup)} mtp.* tensors are in more than one file (e.g. {n} in "
                        f"{', '.join(fs)}): remove the stale copy")
    missing = sorted(required - set(found))
    if missing:
        hint = "re-run with --source INT4_DIR (the original Intel download)" if source is None else \
            f"{source} lacks them too: download the Intel checkpoint again"
        raise UserError(f"MTP head incomplete in {ck.path}: {len(missing)} of {len(required)} mtp.* tensors "
                        f"missing (e.g. {missing[0]}): {hint}")
    return found


def _index_unrecorded(path: Path) -> bool:
    """Step 1's manifest is there and its entry for the index is not the index on disk (size, or sha256 where
    the manifest has one)."""
    if not (path / MANIFEST_FILE).is_file():
        return False
    entry = load_json(path / MANIFEST_FILE, "manifest", MANIFEST_FIX, MANIFEST)["files"].get(INDEX_FILE)
    index = path / INDEX_FILE
    return entry is None or entry["size"] != index.stat().st_size or \
        (entry.get("sha256") is not None and entry["sha256"] != sha256_file(index))


def _record_in_manifest(path: Path, changed: list[str], result: dict) -> None:
    """Step 1's manifest, updated to the files step 2 changed (hashed when the manifest hashes) and its result."""
    man = load_json(path / MANIFEST_FILE, "manifest", MANIFEST_FIX, MANIFEST)
    had_hash = any(v.get("sha256") for v in man.get("files", {}).values())
    for f in changed:
        man.setdefault("files", {})[f] = file_entry(path / f, sha256_file(path / f) if had_hash else None)
    man["files"] = dict(sorted(man["files"].items()))
    man.setdefault("steps", {})["mtp"] = result
    write_json_atomic(path / MANIFEST_FILE, man)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", type=options.directory_path, help="checkpoint directory (the output of step 1)")
    specs.add_model_argument(p, recorded=True)
    p.add_argument("--source", type=Path,
                   help="the original INT4 download, to copy model_extra_tensors.safetensors from if it is missing")


def run(args: argparse.Namespace) -> int:
    name = args.model or recorded_spec(args.dir)
    spec = specs.custom("(local files)", None) if name == specs.CUSTOM else specs.get(name)
    mtp(args.dir, source=args.source, spec=spec, log=lambda m: print(m, flush=True))
    return 0
