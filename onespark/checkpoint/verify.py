"""`onespark verify DIR [--model NAME] [--fast]`: is this checkpoint exactly what its config, index and manifest say?

Checks, each reported with the file and tensor it concerns:
- the config is the chosen spec's model (onespark.model.specs; default qwen3.5-122b-a10b): other files are refused
  with the spec they look like; `--model custom` checks any checkpoint of this family against its own config
  and refuses one whose config lacks a fact the layout is derived from;
- every shard's header parses and its size matches the header (truncation), every index entry exists
  in the shard it names, no tensor is in two files, no tensor sits in a shard without an index entry;
- every tensor has the dtype and shape the config implies (onespark.model.qwen35: INT4 qweight/qzeros/scales,
  FP8 weight + weight_scale_inv, 16-bit elsewhere), and every tensor the config implies is present,
  all mtp.* tensors included (the spec's published count for real shapes: 785 for the 122B, 2329 for the
  35B's INT4 release);
- every F8_E4M3 weight has its weight_scale_inv;
- the manifest's sizes and sha256 match the files (--fast checks sizes only);
- the draft vocabulary (onespark-draft-vocab.json), when present: ids in the vocabulary, unique, the special
  tokens in it, built for this tokenizer.json (onespark.checkpoint.draft_vocab.check_file).
Exit status 0 when all hold; otherwise 1, with every problem on stderr and the first in the last line.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import re
import sys
from collections import Counter
from pathlib import Path

from onespark import options
from onespark.checkpoint import draft_vocab
from onespark.checkpoint.tinymodel import TINY_RECORD
from onespark.checkpoint.writer import (
    INDEX_FILE,
    MANIFEST,
    MANIFEST_FILE,
    MANIFEST_FIX,
    Checkpoint,
    load_json,
    open_checkpoint,
    recorded_spec,
    sha256_file,
)
from onespark.errors import UserError
from onespark.model import qwen35, specs

MAX_LISTED = 10  # per kind of problem; the rest are counted
# Step 1 compares its output with the manifest (sizes, headers) and rewrites what differs; a file of the right
# size whose bytes changed it cannot see without hashing 77 GB, hence "delete it" for a sha256 mismatch.
REWRITE = "run step 1 again with the same --out (it rewrites missing or damaged files)"


TORCH_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def model_dtype(config: dict) -> str:
    """The dtype of the 16-bit tensors, as config.json states it (`dtype`, or `torch_dtype` before transformers
    4.56; text_config first). Both Qwen3.5 releases say bfloat16, so that is the default."""
    for c in (qwen35.text_config(config), config):
        for key in ("dtype", "torch_dtype"):
            if c.get(key) in TORCH_DTYPES:
                return TORCH_DTYPES[c[key]]
    return "BF16"


def exact_dtypes(name: str, exp: qwen35.Expect, config: dict) -> frozenset:
    """The one dtype a tensor must have, where the config implies one (qwen35.expected_tensors allows the
    family; a BF16 weight relabelled F16 is the same bytes read as another number, so only this catches it):
    - 16-bit weights and dense tensors: the model dtype, except `A_log`, which the releases keep in float32
      (as `onespark synth` writes it);
    - INT4 `scales` of the auto_gptq packing: F16 (auto-round's QuantLinear registers them float16; see qwen35);
    - a hybrid's `weight_scale_inv`: the scale_dtype step 1 recorded from its FP8 source."""
    qc = config.get("quantization_config") or {}
    if exp.dtypes == qwen35.FLOAT_DTYPES:
        return frozenset({"F32" if name.endswith(".A_log") else model_dtype(config)})
    if name.endswith(".scales") and "auto_gptq" in str(qc.get("packing_format", "")):
        return frozenset({"F16"})
    hybrid = qc.get(qwen35.HYBRID_KEY) or {}
    scale = "." + qwen35.SCALE_SUFFIX
    if name.endswith(scale) and isinstance(hybrid.get("scale_dtype"), str) \
            and name[: -len(scale)] in set(hybrid.get("layers", [])):
        return frozenset({hybrid["scale_dtype"]})
    return exp.dtypes


def layer_problems(ck) -> list[str]:
    """num_hidden_layers against layer_types and against the decoder layers the tensors hold: the layout is
    derived from layer_types, so without this a config whose two disagree passes with either count."""
    tc = qwen35.text_config(ck.config)
    n = tc.get("num_hidden_layers")
    out = []
    if tc.get("layer_types") is not None and len(tc["layer_types"]) != n:
        out.append(f"config.json: num_hidden_layers is {n} but layer_types lists {len(tc['layer_types'])} layers: "
                   f"the config is inconsistent (edited by hand, or another model's); restore the downloaded one")
    present = {int(m.group(1)) for name in ck.where if (m := re.match(re.escape(qwen35.LAYERS) + r"(\d+)\.", name))}
    if isinstance(n, int) and present and present != set(range(n)):
        extra, lost = sorted(present - set(range(n))), sorted(set(range(n)) - present)
        what = "; ".join(s for s in (f"layers {_span(extra)} beyond it" if extra else "",
                                     f"no tensor of layers {_span(lost)}" if lost else "") if s)
        out.append(f"config.json says num_hidden_layers {n}, the tensors hold decoder layers {_span(sorted(present))} "
                   f"({what}): config and weights are of different models")
    return out


def _span(xs: list[int]) -> str:
    return f"{xs[0]}-{xs[-1]}" if len(xs) > 1 and xs == list(range(xs[0], xs[-1] + 1)) else ", ".join(map(str, xs))


class Problems(list):
    """The problems found, in order; past MAX_LISTED of one kind the rest are counted in one line."""

    def __init__(self) -> None:
        super().__init__()
        self.kinds: Counter = Counter()

    def add(self, kind: str, text: str) -> None:
        self.kinds[kind] += 1
        if self.kinds[kind] <= MAX_LISTED:
            self.append(text)
        elif self.kinds[kind] == MAX_LISTED + 1:
            self.append(f"... more problems of this kind ({kind}) not listed")


def verify(path: Path, *, fast: bool = False, spec: specs.Spec | None = None) -> tuple[list[str], dict]:
    """Returns (problems, summary). Raises UserError when the directory cannot be read at all, or is another
    model than `spec` (default: the default spec)."""
    path = Path(path)
    spec = spec or specs.get(None)
    if (path / TINY_RECORD).is_file():  # its one model.safetensors has no index: "download it again" would mislead
        raise UserError(f"{path}: a tiny test model that `onespark tiny-model` wrote ({TINY_RECORD}), not a "
                        f"checkpoint verify checks (step 0's downloads, the output of steps 1-2); if it is damaged, "
                        f"write it again with `onespark tiny-model --out NEWDIR`")
    ck = open_checkpoint(path)
    specs.check_config(spec, ck.config, str(path / "config.json"))
    problems = Problems()
    _index_problems(ck, problems)
    problems += layer_problems(ck)
    expected = qwen35.expected_tensors(ck.config)
    _tensor_problems(ck, expected, problems)
    mtp_required = _missing_problems(ck, expected, spec, problems)
    hashed = _manifest_problems(ck, fast, problems)
    problems += draft_vocab.check_file(path)
    summary = {
        "tensors": len(ck.where), "files": len(ck.headers),
        "bytes": sum(h.file_size for h in ck.headers.values()),
        "mtp_tensors": sum(1 for n in ck.where if qwen35.is_mtp(n)), "mtp_required": mtp_required,
        "fp8_weights": sum(1 for n in ck.where if ck.info(n).dtype == "F8_E4M3"),
        "manifest": (path / MANIFEST_FILE).is_file(), "hashed_files": hashed, "spec": spec.name,
    }
    return list(problems), summary


def _index_problems(ck: Checkpoint, problems: Problems) -> None:
    """Each tensor in one file, each index entry in the file it names, each tensor in the index."""
    for name, files in sorted(ck.duplicates.items()):
        problems.add("duplicate", f"{name} is in {len(files)} files: {', '.join(files)}")
    wm = ck.weight_map
    for name, fname in sorted(wm.items()):
        if name not in ck.headers[fname].tensors:
            other = f" (it is in {ck.where[name]})" if name in ck.where else ""
            problems.add("index", f"index puts {name} in {fname}, which lacks it{other}")
    orphans = sorted(n for n in ck.where if n not in wm)
    mtp_orphans = [n for n in orphans if qwen35.is_mtp(n)]
    if mtp_orphans:
        files = sorted({ck.where[n] for n in mtp_orphans})
        problems.append(f"{len(mtp_orphans)} mtp.* tensors in {', '.join(files)} are not in the index, so vLLM "
                        f"cannot load the MTP head: run `onespark mtp {ck.path}`")
    for n in orphans:
        if not qwen35.is_mtp(n):
            problems.add("orphan", f"{n} is in {ck.where[n]} but not in the index")


def _tensor_problems(ck: Checkpoint, expected: dict, problems: Problems) -> None:
    """Every tensor present is one the config implies, of its exact dtype and shape; FP8 weights have scales."""
    for name, fname in sorted(ck.where.items()):
        t = ck.headers[fname].tensors[name]
        exp = expected.get(name)
        if exp is None:
            if name.startswith("model.visual.") and t.dtype in qwen35.FLOAT_DTYPES:
                continue  # vision tower: passed through untouched, shapes not derived here
            problems.add("unexpected", f"{name} ({fname}) is a tensor the config implies no such thing as")
            continue
        dtypes = exact_dtypes(name, exp, ck.config)
        if t.dtype not in dtypes or t.shape != exp.shape:
            problems.add("shape", f"{name} ({fname}) is {t.dtype}{list(t.shape)}, the config implies "
                                  f"{'/'.join(sorted(dtypes))}{list(exp.shape)}")
        if t.dtype == "F8_E4M3" and name.endswith(".weight"):
            scale = qwen35.scale_name(name)
            if scale not in ck.where:
                problems.add("scale", f"FP8 weight {name} has no {scale}")


def _missing_problems(ck: Checkpoint, expected: dict, spec: specs.Spec, problems: Problems) -> int:
    """Every tensor the config implies is present, the MTP head against the spec's published count.
    Returns how many mtp.* tensors the config requires."""
    missing = sorted(n for n in expected if n not in ck.where and not qwen35.is_optional(n))
    mtp_missing = [n for n in missing if qwen35.is_mtp(n)]
    mtp_required = sum(1 for n in expected if qwen35.is_mtp(n) and not qwen35.is_optional(n))
    published = spec.mtp_tensors if specs.facts(qwen35.text_config(ck.config)) == specs.facts(spec.text) else None
    if published and (ck.config.get("quantization_config") or {}).get("quant_method") != "fp8" \
            and mtp_required != published:
        problems.append(f"the config implies {mtp_required} mtp.* tensors, {spec.name}'s INT4 release has "
                        f"{published}: its quantization_config differs from the release's (wrong --model, or a "
                        f"re-quantized checkpoint: check it with --model custom)")
    if mtp_missing:
        problems.append(f"MTP head incomplete: {len(mtp_missing)} of {mtp_required} mtp.* tensors missing "
                        f"(e.g. {mtp_missing[0]}): run `onespark mtp {ck.path} --source INT4_DIR`")
    for n in missing:
        if not qwen35.is_mtp(n):
            problems.add("missing", f"{n} is missing (the config implies it)")
    return mtp_required


def _manifest_problems(ck: Checkpoint, fast: bool, problems: Problems) -> int:
    """The manifest's sizes (and, unless `fast`, sha256) against the files. Returns how many files were hashed."""
    path, man_path = ck.path, ck.path / MANIFEST_FILE
    if not man_path.is_file():
        if (ck.config.get("onespark") or {}).get("manifest"):
            problems.append(f"{MANIFEST_FILE} is missing although config.json says step 1 wrote one: "
                            f"the run did not finish; run step 1 again")
        return 0
    listed = load_json(man_path, "manifest", MANIFEST_FIX, MANIFEST)["files"]
    to_hash = []
    for fname, entry in sorted(listed.items()):
        f = path / fname
        if not f.is_file():
            problems.add("manifest", f"{fname} is in the manifest but missing: {REWRITE}")
        elif f.stat().st_size != entry.get("size"):
            problems.add("manifest", f"{fname} is {f.stat().st_size} bytes, the manifest says {entry.get('size')}: "
                                     f"{REWRITE}")
        elif not fast and entry.get("sha256"):
            to_hash.append(fname)
    # sha256 is CPU-bound (~1 GB/s a core): hash up to 4 files at once
    with cf.ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        digests = dict(zip(to_hash, pool.map(lambda f: sha256_file(path / f), to_hash)))
    for fname in to_hash:
        if digests[fname] != listed[fname]["sha256"]:
            problems.add("manifest", f"{fname}: sha256 differs from the manifest (the file changed or is corrupt): "
                                     f"delete it, then {REWRITE}")
    for fname in sorted(ck.headers):
        if fname not in listed:
            problems.add("manifest", f"{fname} is not in the manifest")
    return len(to_hash)


def drafter_problems(path: Path, spec: specs.Spec) -> tuple[list[str], dict]:
    """The DFlash drafter directory (`--drafter dflash`): what vLLM 0.32.0 reads of config.json (the
    DFlashDraftModel architecture; dflash_config's target_layer_ids and mask_token_id, see specs.DFLASH_ARCH),
    the same widths as the target it drafts for, and an index that agrees with the shards' headers. A problem
    raised by open_checkpoint (missing/corrupt config, index or shard) is one UserError naming the path."""
    ck = open_checkpoint(path, need_index=False)  # one-file drafters (model.safetensors) have no index
    cfg, problems = ck.config, []
    arch = cfg.get("architectures") or []
    if specs.DFLASH_ARCH not in arch:
        problems.append(f"{path}/config.json: architectures {arch}, not [{specs.DFLASH_ARCH!r}]: not a DFlash "
                        "drafter (vLLM 0.32.0 maps only that name to its DFlash model)")
    dc = cfg.get("dflash_config")
    dc = dc if isinstance(dc, dict) else {}
    layers = dc.get("target_layer_ids")
    # The target it taps: the spec's real or tiny dims (the tiny ones for tests' stand-ins).
    targets = [t for t in (spec.text, spec.tiny) if t.get("hidden_size") == cfg.get("hidden_size")]
    if not (isinstance(layers, list) and layers and all(isinstance(i, int) and i >= 0 for i in layers)):
        problems.append(f"{path}/config.json: dflash_config.target_layer_ids {layers!r}: expected a non-empty "
                        "list of target layer numbers")
    elif targets and max(layers) >= targets[0]["num_hidden_layers"]:
        problems.append(f"{path}/config.json: dflash_config.target_layer_ids reach layer {max(layers)}, past "
                        f"{spec.name}'s {targets[0]['num_hidden_layers']} layers: a drafter of another model")
    if not isinstance(dc.get("mask_token_id"), int):
        problems.append(f"{path}/config.json: dflash_config.mask_token_id {dc.get('mask_token_id')!r}: expected "
                        "the token id of the drafter's mask slots")
    if spec.text and not targets:
        problems.append(f"{path}/config.json: hidden_size {cfg.get('hidden_size')}, but {spec.name} has "
                        f"{spec.text['hidden_size']}: a drafter of another model")
    elif targets and cfg.get("vocab_size") != targets[0]["vocab_size"]:
        problems.append(f"{path}/config.json: vocab_size {cfg.get('vocab_size')}, but {spec.name} has "
                        f"{targets[0]['vocab_size']}")
    if ck.index is not None:
        for name, fname in ck.weight_map.items():
            if name not in ck.headers[fname].tensors:
                problems.append(f"{path}/{INDEX_FILE}: lists {name} in {fname}, whose header lacks it: the index "
                                "and the shards disagree; download the drafter again")
        unlisted = sorted(set(ck.where) - set(ck.weight_map))
        if unlisted:
            problems.append(f"{path}/{INDEX_FILE}: does not list {len(unlisted)} tensor(s) of the shards, e.g. "
                            f"{unlisted[0]}; download the drafter again")
    for name, fs in sorted(ck.duplicates.items())[:1]:
        problems.append(f"{path}: {name} is in {len(fs)} files ({', '.join(fs)})")
    stats = {"tensors": len(ck.where), "files": len(ck.headers),
             "bytes": sum((path / f).stat().st_size for f in ck.headers)}
    return problems, stats


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", type=options.directory_path, nargs="?", help="checkpoint directory (may be left out with --drafter)")
    specs.add_model_argument(p, recorded=True)
    p.add_argument("--fast", action="store_true", help="skip sha256 (check sizes only)")
    p.add_argument("--drafter", type=Path, metavar="DIR",
                   help="also check the DFlash drafter directory (after --drafter dflash: WORK/dflash)")


def run(args: argparse.Namespace) -> int:
    name = args.model or (recorded_spec(args.dir) if args.dir else None)
    spec = specs.custom("(local files)", None) if name == specs.CUSTOM else specs.get(name)
    if args.dir is None and not args.drafter:
        raise UserError("onespark verify: give the checkpoint directory (and/or --drafter DIR)")
    if args.drafter:
        dprob, d = drafter_problems(args.drafter, spec)
        print(f"{args.drafter} (DFlash drafter of {spec.name}): {d['tensors']} tensors in {d['files']} files "
              f"({d['bytes'] / 1e9:.2f} GB){'' if dprob else ', ok'}")
        if dprob:
            for p in dprob:
                print(f"  problem: {p}", file=sys.stderr)
            raise UserError(f"{len(dprob)} problem(s) in the drafter; first: {dprob[0]}")
        if args.dir is None:
            print("ok")
            return 0
    problems, s = verify(args.dir, fast=args.fast, spec=spec)
    line = (f"{args.dir} ({spec.name}): {s['tensors']} tensors in {s['files']} files ({s['bytes'] / 1e9:.2f} GB), "
            f"{s['fp8_weights']} FP8 weights, mtp.* {s['mtp_tensors']}/{s['mtp_required']}, "
            f"manifest: {'yes, ' + str(s['hashed_files']) + ' files hashed' if s['manifest'] else 'none'}")
    if problems:
        print(line, file=sys.stderr)
        for p in problems:
            print(f"  problem: {p}", file=sys.stderr)
        raise UserError(f"{len(problems)} problem(s); first: {problems[0]}")
    print(line)
    print("ok")
    return 0
