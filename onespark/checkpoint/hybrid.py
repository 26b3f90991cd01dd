"""Step 1, `onespark hybrid [--model NAME] --int4 DIR --fp8 DIR|hf:REPO --out DIR`: FP8 shared experts in the INT4
checkpoint. --model (default qwen3.5-122b-a10b, see onespark.model.specs) refuses another model's files, naming the spec
they look like; a spec without an FP8 source (qwen3.6-35b-a3b) skips the step and says why.

Replaces the 3 x num_hidden_layers BF16 `mlp.shared_expert.{gate,up,down}_proj.weight` tensors of the
Intel INT4 checkpoint (144 for the 122B) by the FP8 weights of the Qwen FP8 checkpoint and adds each one's
`weight_scale_inv`. Every other tensor, `mtp.*` included, is copied byte for byte with os.copy_file_range;
no shard is ever read into memory. Plan decides every output file before a byte is written; the writer
(onespark.checkpoint.writer.Writer) writes each under a temporary name, fsyncs and renames it, and keeps a progress
record, so an interrupted run resumes (files already written are kept when their size and the inputs still
match). The input directories are only read.

What config.json says afterwards (the vLLM plugin reads this; nothing else changes in the config):

    config["quantization_config"]["onespark_fp8"] = {
        "layers": ["model.language_model.layers.0.mlp.shared_expert.gate_proj", ...],  # HF module names,
                     # without ".weight"; vLLM's hf_to_vllm_mapper maps them like extra_config's keys
        "weight_block_size": [128, 128],    # from the FP8 source's quantization_config
        "activation_scheme": "dynamic",     # idem
        "fmt": "e4m3",                      # weight dtype F8_E4M3
        "scale_name": "weight_scale_inv",   # per-block scale, dequant = weight * scale_inv
        "scale_dtype": "BF16",              # as stored (BF16 in Qwen's release)
        "source": {"repo": ..., "revision": ...},
    }
    config["onespark"] = {"schema_version": 1, "step": "hybrid", "tool_version": "...",
                          "manifest": "onespark-manifest.json"}

quantization_config keeps quant_method "auto-round" and its extra_config (which already says these layers
are not INT4: bits 16); `quantization_config.json`, when present, gets the same dict.
The manifest (onespark-manifest.json) records inputs, revisions, what changed, the sha256 of every output
file and the tool version; it is written last, so its presence means the step finished.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import math
import os
import shutil
from pathlib import Path

from onespark import __version__, options
from onespark.checkpoint.lock import locked
from onespark.checkpoint.safetensors_io import Header, Range, copy_file_tmp, encode_header, write_safetensors_tmp
from onespark.checkpoint.writer import (
    DOWNLOAD_RECORD,
    INDEX_FILE,
    MANIFEST,
    MANIFEST_FILE,
    MANIFEST_FIX,
    RECORD,
    Checkpoint,
    Output,
    Writer,
    damaged_files,
    input_files,
    is_inside,
    load_json,
    open_checkpoint,
    rewrite_index,
)
from onespark.errors import UserError
from onespark.model import qwen35, specs

PROGRESS_FILE = ".onespark-hybrid-progress.json"
CONFIG_FILES = ("config.json", "quantization_config.json")  # rewritten, not copied
JSON_FILES = (INDEX_FILE,) + CONFIG_FILES  # written last, from the plan


def _check_dirs(int4: Path, fp8: Path | None, out: Path) -> None:
    for name, src in (("--int4", int4), ("--fp8", fp8)):
        if src is None:
            continue
        if is_inside(out, src):
            raise UserError(f"--out {out} is inside {name} {src}: write the output somewhere else "
                            f"(inputs are never modified)")
        if is_inside(src, out):
            raise UserError(f"{name} {src} is inside --out {out}: choose an --out that does not contain the input")


def _dims(config: dict) -> dict:
    tc = qwen35.text_config(config)
    return {k: tc.get(k) for k in ("hidden_size", "num_hidden_layers", "shared_expert_intermediate_size")}


class Plan:
    """Everything step 1 will write, decided before writing a byte."""

    def __init__(self, int4: Checkpoint, fp8: Checkpoint, inputs: dict):
        _check_pair(int4, fp8)
        self.int4, self.fp8, self.inputs, self.fp8_source = int4, fp8, inputs, inputs["fp8"]
        self.block = tuple((fp8.config.get("quantization_config") or {}).get("weight_block_size") or (128, 128))
        self.targets = qwen35.shared_expert_weights(int4.config)
        self.replace: dict[str, tuple] = {n: self._fp8_for(n) for n in self.targets}  # -> (fp8 weight, its scale)
        self.unmatched = self._unmatched()
        # Output files: the same names as the input's safetensors files, tensors in the same order.
        self.files = {fname: self._items(h) for fname, h in int4.headers.items()}
        # A file without a replaced tensor (model_extra_tensors.safetensors: the MTP head) is copied whole,
        # byte-identical to its input; the others get a new header.
        self.verbatim = {f for f, items in self.files.items() if not any(n in self.replace for n, *_ in items)}
        self.headers = {f: encode_header([(n, d, s) for n, d, s, _ in items], int4.headers[f].metadata)
                        for f, items in self.files.items() if f not in self.verbatim}
        self.sizes = {f: (int4.headers[f].file_size if f in self.verbatim else
                          len(self.headers[f]) + sum(r.length for *_, r in items)) for f, items in self.files.items()}
        self.aux = [p for p in sorted(int4.path.iterdir()) if p.is_file() and not p.name.startswith(".")
                    and p.suffix != ".safetensors" and p.name not in JSON_FILES + (MANIFEST_FILE, DOWNLOAD_RECORD)]
        # Written last, from the plan: quantization_config.json only where the input has one.
        self.json_files = [f for f in JSON_FILES if f != "quantization_config.json" or (int4.path / f).is_file()]

    def _fp8_for(self, name: str) -> tuple:
        """The FP8 weight and scale that replace the INT4 checkpoint's 16-bit `name`, checked against it."""
        int4, fp8 = self.int4, self.fp8
        if name not in int4.where:
            raise UserError(f"{int4.path}: has no {name}: not the Intel INT4 layout this step expects")
        old = int4.info(name)
        if old.dtype == "F8_E4M3":
            raise UserError(f"{int4.path}: {name} is already FP8: give the original INT4 download as --int4")
        if old.dtype not in qwen35.FLOAT_DTYPES:
            raise UserError(f"{int4.path}: {name} is {old.dtype}, expected a 16-bit weight")
        sname = qwen35.scale_name(name)
        for n in (name, sname):
            if n not in fp8.where:
                raise UserError(f"{fp8.path}: has no {n}: the FP8 source is incomplete; run step 0 again")
        w, s = fp8.info(name), fp8.info(sname)
        want_s = (math.ceil(old.shape[0] / self.block[0]), math.ceil(old.shape[1] / self.block[1]))
        if w.dtype != "F8_E4M3" or w.shape != old.shape:
            raise UserError(f"FP8 source shapes do not match: {name} is {w.dtype}{list(w.shape)} in "
                            f"{fp8.path}, expected F8_E4M3{list(old.shape)}; wrong --fp8 checkpoint?")
        if s.dtype not in ("BF16", "F32") or s.shape != want_s:
            raise UserError(f"FP8 source shapes do not match: {sname} is {s.dtype}{list(s.shape)}, expected "
                            f"BF16{list(want_s)} for block {list(self.block)}; wrong --fp8 checkpoint?")
        return w, s

    def _unmatched(self) -> dict[str, int]:
        """What the FP8 checkpoint offers that we leave alone, counted by family (not 400 warnings)."""
        used = set(self.replace) | {qwen35.scale_name(n) for n in self.replace}
        unmatched: dict[str, int] = {}
        for name in sorted(set(self.fp8.where) | set(self.fp8.weight_map)):
            if name in used:
                continue
            cat = qwen35.category(name)
            if cat == "other" or cat == "shared experts":
                raise UserError(f"{self.fp8.path}: unexpected tensor {name}: neither a splice target nor a known "
                                f"family; refusing to guess (is --fp8 the Qwen3.5 FP8 checkpoint?)")
            unmatched[cat] = unmatched.get(cat, 0) + 1
        return unmatched

    def _items(self, h: Header) -> list[tuple]:
        """One output shard's tensors (name, dtype, shape, where its bytes are): a replaced weight by its FP8
        weight and scale, every other tensor as it is."""
        def src(ck: Checkpoint, t) -> Range:
            return Range(ck.headers[ck.where[t.name]].path, t.begin, t.nbytes)

        items = []
        for t in h.tensors.values():
            if t.name in self.replace:
                w, s = self.replace[t.name]
                items += [(t.name, w.dtype, w.shape, src(self.fp8, w)), (s.name, s.dtype, s.shape, src(self.fp8, s))]
            else:
                items.append((t.name, t.dtype, t.shape, Range(h.path, t.begin, t.nbytes)))
        return items

    def outputs(self) -> list[Output]:
        """Every file but the JSON ones, and how each is made: a spliced shard, a shard or file copied whole."""
        def shard(fname: str):
            return lambda dst: write_safetensors_tmp(dst, self.files[fname], header=self.headers[fname])

        def whole(src: Path):
            return lambda dst: copy_file_tmp(src, dst)

        return [Output(f, self.sizes[f], whole(self.int4.path / f) if f in self.verbatim else shard(f))
                for f in self.files] + [Output(p.name, p.stat().st_size, whole(p)) for p in self.aux]

    def index(self) -> dict:
        """The input's index with each scale beside its weight; every other entry (mtp.* included) as it was."""
        wm = dict(self.int4.weight_map)
        for name in self.replace:
            wm[qwen35.scale_name(name)] = self.int4.where[name]
        return rewrite_index(self.int4.index, wm, {n: r.length for items in self.files.values() for n, *_, r in items})

    def fingerprint(self) -> str:
        """Changes whenever an input or this tool changes, so a resumed run never mixes two inputs."""
        h = hashlib.sha256(__version__.encode())
        h.update(json.dumps(self.inputs, sort_keys=True).encode())  # contents, repos and revisions too
        for ck in (self.int4, self.fp8):
            for fname, hd in sorted(ck.headers.items()):
                h.update(f"{fname}:{hd.file_size}:{hd.data_start}:{len(hd.tensors)}".encode())
                for t in hd.tensors.values():
                    h.update(f"{t.name}:{t.dtype}:{t.shape}:{t.begin}".encode())
        return h.hexdigest()


def _check_pair(int4: Checkpoint, fp8: Checkpoint) -> None:
    """The two inputs are the INT4 and the FP8 release of one model, and the INT4 one is consistent."""
    qc = int4.config.get("quantization_config") or {}
    if qc.get("quant_method") not in ("auto-round", "intel/auto-round"):
        raise UserError(f"{int4.path}: quantization_config.quant_method is {qc.get('quant_method')!r}, "
                        f"not auto-round: --int4 must be the Intel AutoRound checkpoint")
    if qc.get(qwen35.HYBRID_KEY):
        raise UserError(f"{int4.path}: already a hybrid checkpoint (its config lists FP8 layers): "
                        f"give the original INT4 download as --int4")
    fqc = fp8.config.get("quantization_config") or {}
    if fqc.get("quant_method") != "fp8":
        raise UserError(f"{fp8.path}: quantization_config.quant_method is {fqc.get('quant_method')!r}, "
                        f"not fp8: --fp8 must be the Qwen FP8 checkpoint (or what step 0 fetched of it)")
    if _dims(int4.config) != _dims(fp8.config):
        raise UserError(f"the two checkpoints are different models: INT4 {_dims(int4.config)} vs "
                        f"FP8 {_dims(fp8.config)}")
    if int4.duplicates:
        n, fs = next(iter(int4.duplicates.items()))
        raise UserError(f"{int4.path}: tensor {n} is in {len(fs)} files ({', '.join(fs)}): "
                        f"the download is inconsistent; download it again")
    for name, fname in int4.weight_map.items():
        if name not in int4.headers[fname].tensors:
            raise UserError(f"{int4.path / fname}: lacks {name}, which the index puts there: "
                            f"download that shard again")


HUB_PREFIX = "hf:"  # --fp8 hf:OWNER/NAME: fetch from the Hub; anything else is a local path


def _fp8_source(arg: str, revision: str | None, spec: specs.Spec) -> dict:
    """What --fp8 names, without fetching anything: a local directory (its path, step 0's record of it, and
    its files: input_files), or hf:OWNER/NAME at a revision. Only the explicit prefix reaches the network: a
    mistyped directory that happens to look like OWNER/NAME (fp8/qwen) must say it is missing, not download."""
    if not arg.startswith(HUB_PREFIX):
        p = Path(arg)
        if not p.is_dir():
            looks_like_repo = arg.count("/") == 1 and not arg.startswith((".", "/", "~")) and not p.exists()
            raise UserError(f"--fp8 {arg}: " + ("is a file, not a directory" if p.exists() else "no such directory")
                            + (f"; to fetch a Hub repo, give its id as --fp8 {HUB_PREFIX}{arg}" if looks_like_repo
                               else ": give step 0's fp8/ directory (or --fp8 hf:OWNER/NAME)"))
        rec = load_json(p / DOWNLOAD_RECORD, "download record", like=RECORD) if (p / DOWNLOAD_RECORD).is_file() else {}
        return {"path": str(p.resolve()), "repo": rec.get("repo"), "revision": rec.get("revision"),
                "files": input_files(p)}
    repo = arg[len(HUB_PREFIX):]
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise UserError(f"--fp8 {arg}: expected {HUB_PREFIX}OWNER/NAME, e.g. {HUB_PREFIX}Qwen/Qwen3.5-122B-A10B-FP8")
    revision = revision or (spec.fp8.revision if spec.fp8 and spec.fp8.repo == repo else None)
    if not revision:
        raise UserError(f"--fp8 {arg}: no pinned revision for this repo in {spec.name}: pass --fp8-revision SHA")
    return {"path": None, "repo": repo, "revision": revision}


def _resolve_fp8(source: dict, out: Path) -> Path:
    """The FP8 directory to read: the local one, or the needed tensors fetched by byte range next to --out."""
    if source["path"] is not None:
        return Path(source["path"])
    from onespark.checkpoint import download  # imports huggingface_hub only when needed
    dest = out.parent / f".{out.name}.fp8-fetch"
    rec = download.fetch_fp8(source["repo"], source["revision"], dest)
    source.update(repo=rec["repo"], revision=rec["revision"])
    return dest


def _inputs(int4: Checkpoint, fp8_source: dict) -> dict:
    """Every input of step 1, as the manifest records it and the done-check compares it."""
    return {"int4": {"path": str(int4.path.resolve()), "repo": int4.record.get("repo"),
                     "revision": int4.record.get("revision"), "files": input_files(int4.path)},
            "fp8": fp8_source}


def _other_inputs(old: dict, new: dict) -> str | None:
    """How a finished run's recorded inputs differ from this run's, or None when they are the same. Each side is
    compared by its files (names, sizes, sample_sha256) where both runs read local files, else by Hub repo and
    revision, else (a manifest of an older onespark) by path; what cannot be compared counts as different."""
    for side in ("int4", "fp8"):
        o, n = old.get(side) or {}, new[side]
        flag = f"--{side}"
        if isinstance(o.get("files"), dict) and n.get("files") is not None:
            changed = sorted(set(o["files"]) ^ set(n["files"])) or \
                sorted(f for f in n["files"] if o["files"][f] != n["files"][f])
            if changed:
                return f"{flag} file {changed[0]} is not the one it was made from"
        elif o.get("repo") and o.get("revision") and n.get("repo") and n.get("revision"):
            if (o["repo"], o["revision"]) != (n["repo"], n["revision"]):
                return f"{flag} was {o['repo']}@{o['revision']}, now {n['repo']}@{n['revision']}"
        elif not (o.get("path") and o.get("path") == n.get("path")):
            return f"{flag} was {o.get('path') or o.get('repo')}, now {n.get('path') or n.get('repo')}"
    return None


def hybrid(int4_dir: Path, fp8_arg: str, out: Path, **kw) -> dict:
    """Step 1 into `out`, holding its lock (onespark.checkpoint.lock): a second run into the same --out is refused."""
    out = Path(out)
    _check_dirs(Path(int4_dir), Path(fp8_arg) if Path(fp8_arg).exists() else None, out)  # before out exists
    with locked(out, "--out"):
        return _hybrid(int4_dir, fp8_arg, out, **kw)


def _hybrid(int4_dir: Path, fp8_arg: str, out: Path, *, fp8_revision: str | None = None,
            hash_outputs: bool = True, spec: specs.Spec | None = None, log=print) -> dict:
    spec = spec or specs.get(None)
    int4_dir, out = Path(int4_dir), Path(out)
    fp8_local = Path(fp8_arg) if Path(fp8_arg).exists() else None
    _check_dirs(int4_dir, fp8_local, out)
    int4 = open_checkpoint(int4_dir)
    specs.check_config(spec, int4.config, f"--int4 {int4_dir}")
    inputs = _inputs(int4, _fp8_source(fp8_arg, fp8_revision, spec))
    man = _finished_manifest(out, int4, inputs)
    bad = _damaged(out, man, log) if man else {}
    if man and not bad:
        return man
    carried = {f: v for f, v in man.get("files", {}).items() if f not in bad} if man else {}
    old_steps = man.get("steps", {}) if man else {}
    with Writer(out, PROGRESS_FILE, MANIFEST_FILE, hash_outputs=hash_outputs, log=log) as w:
        if man is None:  # a finished run's manifest says the directory is ours, even with every file damaged
            w.refuse_foreign("`onespark hybrid`", "--out")
        fp8_dir = _resolve_fp8(inputs["fp8"], out)
        fp8 = open_checkpoint(fp8_dir)
        specs.check_config(spec, fp8.config, f"--fp8 {fp8_dir}")
        plan = Plan(int4, fp8, inputs)
        outputs = plan.outputs()
        w.resume(plan.fingerprint(), {**{o.name: o.size for o in outputs}, **dict.fromkeys(plan.json_files)},
                 carried)
        _open_inputs(plan)
        _check_disk(out, [o for o in outputs if o.name not in w.done])
        w.begin()
        log(f"splicing {len(plan.replace)} shared-expert weights (FP8 + {qwen35.SCALE_SUFFIX}) into "
            f"{len(plan.files)} files -> {out}")
        for o in outputs:
            if o.name not in w.done:
                size = w.write(o)
                if o.name in plan.files:
                    log(f"  {o.name}: {size / 1e6:.1f} MB")
        written = _write_json_files(w, plan)
        if man and INDEX_FILE in written:
            old_steps.pop("mtp", None)
            log(f"the index was rewritten from --int4: run step 2 again (`onespark mtp {out} --source "
                f"{int4.path}`) to list the mtp.* tensors")
        manifest = _manifest(plan, spec, old_steps, w.files())
        w.finish(manifest)
    if fp8_local is None and fp8_dir.name.endswith(".fp8-fetch"):
        shutil.rmtree(fp8_dir, ignore_errors=True)
    _report(plan, manifest, log)
    return manifest


def _finished_manifest(out: Path, int4: Checkpoint, inputs: dict) -> dict | None:
    """The manifest of a finished step 1 on these inputs in `out`, or None when there is none. A finished run
    of other inputs is refused: its files are never mixed with, nor silently replaced by, this run's."""
    if not (out / MANIFEST_FILE).is_file():
        return None
    man = load_json(out / MANIFEST_FILE, "manifest", MANIFEST_FIX, MANIFEST)
    old = man.get("inputs") if isinstance(man.get("inputs"), dict) else {}
    if not isinstance((old.get("int4") or {}).get("files"), dict):  # an older manifest: the INT4 shard list
        step = man.get("steps", {}).get("hybrid", {})
        old = {**old, "int4": {"repo": None, "revision": None, "path": inputs["int4"]["path"]
                               if step.get("int4_fingerprint") == _int4_fingerprint(int4) else None}}
    why = _other_inputs(old, inputs)
    if why:
        raise UserError(f"{out} holds step-1 output of other inputs ({why}): choose a new --out or remove it "
                        f"(nothing was changed)")
    return man


def _damaged(out: Path, man: dict, log) -> dict[str, str]:
    """Already done? Only when every file the manifest lists is still there as written; a damaged one is
    rewritten, the intact ones are kept. Says which, and returns the damaged files."""
    bad = damaged_files(out, man)
    if not bad:
        log(f"step 1 already done: {out} (every file the manifest lists is intact; "
            f"`onespark verify {out}` checks hashes too)")
    else:
        log(f"step 1 output damaged: {'; '.join(list(bad.values())[:3])}"
            f"{f' (and {len(bad) - 3} more)' if len(bad) > 3 else ''}: rewriting {len(bad)} file(s), "
            f"keeping the {len(man.get('files', {})) - len(bad)} intact ones")
    return bad


def _open_inputs(plan: Plan) -> None:
    """Every input is opened once before the first byte is written: an unreadable file fails now, not after
    an hour of copying (open_checkpoint read the shards' headers; the other files it never opened)."""
    for src in sorted({r.path for items in plan.files.values() for *_, r in items} | set(plan.aux)):
        os.close(os.open(src, os.O_RDONLY))


def _check_disk(out: Path, todo: list[Output]) -> None:
    need = sum(o.size for o in todo) + 10 * 1024 * 1024  # + the JSON files, with room to spare
    free = shutil.disk_usage(out).free
    if free < need:
        raise UserError(f"not enough free disk for {out}: need {need / 1e9:.2f} GB, {free / 1e9:.2f} GB free "
                        f"(checked before writing; free space or choose another --out)")


def _write_json_files(w: Writer, plan: Plan) -> list[str]:
    """The index, config.json and quantization_config.json (where the input has one), unless kept from a
    finished run: an intact index of a repaired checkpoint carries what step 2 added. Returns those written."""
    config = _hybrid_config(plan.int4.config, plan)
    docs = {INDEX_FILE: plan.index(), "config.json": config, "quantization_config.json": config["quantization_config"]}
    written = [f for f in plan.json_files if f not in w.done]
    for f in written:
        w.write_json(f, docs[f])
    return written


def _manifest(plan: Plan, spec: specs.Spec, old_steps: dict, files: dict) -> dict:
    int4 = plan.int4
    return {
        "schema_version": 1,
        "tool": "onespark", "tool_version": __version__,
        "created_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "spec": spec.name,  # what mtp, verify and serve take when given no --model (writer.recorded_spec)
        "inputs": plan.inputs,
        "steps": {**old_steps, "hybrid": {
            "int4_fingerprint": _int4_fingerprint(int4),
            "replaced": sorted(plan.replace), "added": sorted(qwen35.scale_name(n) for n in plan.replace),
            "fp8_weight_block_size": list(plan.block),
            "bytes_before": sum(int4.info(n).nbytes for n in plan.replace),
            "bytes_after": sum(w.nbytes + s.nbytes for w, s in plan.replace.values()),
            "unmatched_fp8_by_category": dict(sorted(plan.unmatched.items())),
            "mtp_tensors": sum(1 for n in int4.where if qwen35.is_mtp(n)),
        }},
        "files": files,
    }


def _report(plan: Plan, manifest: dict, log) -> None:
    step = manifest["steps"]["hybrid"]
    log(f"replaced {len(plan.replace)} tensors ({step['bytes_before'] / 1e6:.1f} MB BF16 -> "
        f"{step['bytes_after'] / 1e6:.1f} MB FP8 + scales); carried {step['mtp_tensors']} mtp.* tensors")
    if plan.unmatched:
        log("FP8 tensors left unused (expected; they stay INT4/BF16): " +
            ", ".join(f"{c} {n}" for c, n in sorted(plan.unmatched.items())))


def _int4_fingerprint(ck: Checkpoint) -> str:
    h = hashlib.sha256()
    for fname, hd in sorted(ck.headers.items()):
        h.update(f"{fname}:{hd.file_size}:{len(hd.tensors)}".encode())
    return h.hexdigest()


def _hybrid_config(config: dict, plan: Plan) -> dict:
    config = json.loads(json.dumps(config))
    qc = config["quantization_config"]
    fqc = plan.fp8.config["quantization_config"]
    scale_dtypes = {s.dtype for _, s in plan.replace.values()}
    qc[qwen35.HYBRID_KEY] = {
        "layers": sorted(n[: -len(".weight")] for n in plan.replace),
        "weight_block_size": list(plan.block),
        "activation_scheme": fqc.get("activation_scheme", "dynamic"),
        "fmt": fqc.get("fmt", "e4m3"),
        "scale_name": qwen35.SCALE_SUFFIX,
        "scale_dtype": scale_dtypes.pop() if len(scale_dtypes) == 1 else sorted(scale_dtypes),
        "source": {"repo": plan.fp8_source.get("repo"), "revision": plan.fp8_source.get("revision")},
    }
    config["onespark"] = {"schema_version": 1, "step": "hybrid", "tool_version": __version__,
                          "manifest": MANIFEST_FILE}
    return config


def add_arguments(p: argparse.ArgumentParser) -> None:
    specs.add_model_argument(p)
    p.add_argument("--int4", required=True, type=options.directory_path,
                   help="the Intel AutoRound INT4 checkpoint directory")
    p.add_argument("--fp8", help="the Qwen FP8 checkpoint: a directory (full, or what step 0 fetched), or "
                                 "hf:OWNER/NAME to fetch its shared experts from the Hub by byte range "
                                 "(required unless the spec has no FP8 source)")
    p.add_argument("--fp8-revision", help="with hf:OWNER/NAME: the commit to fetch (default: the pinned one)")
    p.add_argument("--out", required=True, type=options.directory_path, help="new directory for the hybrid checkpoint")
    p.add_argument("--hash", action=argparse.BooleanOptionalAction, default=True,
                   help="record each output file's sha256 in the manifest (default: yes)")


def run(args: argparse.Namespace) -> int:
    spec = specs.custom("(local files)", args.fp8) if args.model == specs.CUSTOM else specs.get(args.model)
    if not spec.splice:
        print(f"step 1 skipped for {spec.name}: {spec.no_splice}; nothing written (step 2 and serve use --int4 "
              f"{args.int4} as it is)", flush=True)
        return 0
    if not args.fp8:
        raise UserError(f"--fp8 is required for {spec.name}: step 0's fp8/ directory or {spec.fp8.repo}")
    hybrid(args.int4, args.fp8, args.out, fp8_revision=args.fp8_revision, hash_outputs=args.hash, spec=spec,
           log=lambda m: print(m, flush=True))
    return 0

