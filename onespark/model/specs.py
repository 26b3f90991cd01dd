"""Model specs: every model this recipe supports, as data. Steps, verify, synth, doctor, serve and install.sh
read it; adding a model of this family adds a spec here, not code paths.

    onespark specs                                   # the table
    onespark specs --model qwen3.5-35b-a3b           # one spec, every field
    onespark specs --model NAME --get work_subdir    # one field, for shell scripts

A spec holds (a) the two source repositories and the pinned revision of each, with where the pin comes from
(`None`: no public commit SHA was found; then --revision is required), (b) the architecture facts steps 1-2 and
verify rely on (the real text_config, and the tiny one `onespark synth` writes for tests), (c) how the INT4
release stores its MTP head, (d) sizes, and (e) serving defaults. `custom` builds a spec from
--int4-repo/--fp8-repo for another checkpoint of this family; its facts come from the checkpoint's own config.

Sources of the facts (so each can be checked again):
- 122B dims: Qwen/Qwen3.5-122B-A10B config.json as transformers' Qwen3_5MoeTextConfig reads it (the dims
  this project used since its first synth). 785 MTP tensors, 16-bit, not in the INT4 index: onespark/model/qwen35.py
  and albond/DGX_Spark_Qwen3.5-122B-A10B-AR-INT4 patches/02-mtp-speculative/add-mtp-weights.py.
- 35B dims: transformers 5.24.0 `models/qwen3_5_moe/configuration_qwen3_5_moe.py` (its defaults are
  documented as checkpoint "Qwen/Qwen3.5-35B-A3B": hidden 2048, 40 layers, 16/2 heads, 32 linear value
  heads, 256 experts of 512, shared 512, vocab 248320), and adrianpuiu/DGX_Spark_Qwen3.5-35B-A3B-Optimized
  research/phase0-findings.md (same dims; `mtp_num_hidden_layers: 1`; the Intel INT4 release quantizes the
  MTP layer to 4 bits except mtp.fc; 11 shards + model_extra_tensors.safetensors). Its install.sh: "restores
  2329 MTP tensors" = 13 16-bit tensors + (4 attention + 768 expert linears) x (qweight, qzeros, scales):
  no g_idx. Qwen3.6-35B-A3B has the same text dims (public configs quoted in several repositories).
- Qwen3.6 INT4: Intel's plain Intel/Qwen3.6-35B-A3B-int4-AutoRound was withdrawn (its Hub discussions ask
  "Why delete ...?"); what Intel publishes is Intel/Qwen3.6-35B-A3B-int4-mixed-AutoRound, made with
  auto-round's W4A16_MIXED scheme (intel/auto-round issue #1755 quotes `--scheme w4a16_mixed`), whose
  recipe keeps routed experts at 4 bits and puts everything else, the shared experts included, at 8 bits
  (auto-round's own test: default bits 8, ".experts." 4, ".shared_expert." 8). Its shared experts are
  therefore not 16-bit: there is nothing for step 1 to swap for FP8, and the spec skips the splice.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from onespark.errors import UserError

DEFAULT = "qwen3.5-122b-a10b"
CUSTOM = "custom"


@dataclasses.dataclass(frozen=True)
class Source:
    repo: str
    revision: str | None  # a commit SHA, or None when no public one was found (then --revision is required)
    pin_source: str  # where the pin comes from, or why there is none
    size_gb: float  # what step 0 stores of it (GB = 1e9)


@dataclasses.dataclass(frozen=True)
class Published:
    """A figure someone else published for this model on one Spark, with its source (docs/guides/bench.md's table)."""
    tok_s: float
    what: str
    source: str


@dataclasses.dataclass(frozen=True)
class Spec:
    name: str
    title: str
    int4: Source
    fp8: Source | None  # None: step 1 skips the splice; `no_splice` says why
    no_splice: str | None
    text: dict  # the real text_config dims (synth --preset real writes them)
    tiny: dict  # the tiny dims synth writes for tests: every structural feature of `text`, at ~10 MB
    # The INT4 release's MTP head: how many tensors (None: not published), stored 16-bit or INT4, and
    # whether model.safetensors.index.json lists them (step 2 adds them when it does not).
    mtp_tensors: int | None
    mtp_dtype: str  # "bf16" | "int4"
    mtp_in_index: bool
    g_idx: bool  # whether the INT4 release writes GPTQ g_idx tensors (synth follows it)
    mixed_bits: int | None  # W4A16_MIXED releases: bits of every non-expert quantized linear (None: plain INT4)
    hybrid_gb: float  # step 1's output (0 without a splice)
    min_memory_gib: int  # onespark doctor: total memory below this cannot serve the model with `serving`
    serving: dict  # vLLM flags that differ per model (serve / the entrypoint defaults)
    published: tuple = ()
    notes: str = ""
    # The DFlash drafter (`--drafter dflash`, vLLM 0.32.0 track only): its repo and pin, None where the spec has
    # no public one. `dflash_tokens`: num_speculative_tokens of the published record.
    dflash: Source | None = None
    dflash_tokens: int = 0

    @property
    def splice(self) -> bool:
        return self.fp8 is not None

    @property
    def served_dir(self) -> str:
        """The work-dir subfolder that is served: step 1's output, or the download itself without a splice."""
        return "hybrid" if self.splice else "int4"

    @property
    def work_subdir(self) -> str:
        """Where this model's checkpoints go inside install.sh's --work: the default keeps the layout earlier
        versions wrote (an existing 122B install resumes); every other model gets its own folder."""
        return "" if self.name == DEFAULT else self.name

    @property
    def disk_gb(self) -> float:
        """Checkpoint disk steps 0-2 write (what doctor checks)."""
        return self.int4.size_gb + (self.fp8.size_gb if self.fp8 else 0) + self.hybrid_gb

    @property
    def spliced(self) -> int:
        """How many tensors step 1 replaces: the 3 shared-expert projections of every decoder layer."""
        return 3 * self.text["num_hidden_layers"] if self.splice else 0

    def vllm_args(self) -> list[str]:
        """The serving defaults as vLLM flags (they replace docker/entrypoint.sh's defaults of the same name)."""
        s = self.serving
        return ["--served-model-name", self.name,
                "--gpu-memory-utilization", str(s["gpu_memory_utilization"]),
                "--max-model-len", str(s["max_model_len"]),
                "--speculative-config", json.dumps(s["speculative_config"], separators=(",", ":"))]


# The real text_config of each architecture, as transformers' Qwen3_5MoeTextConfig reads it.
# Same shape as TINY_* below on purpose (`duplicates` pairs them): key for key, each reads against a config.json.
TEXT_122B = dict(hidden_size=3072, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=2,
                 head_dim=256, linear_num_key_heads=16, linear_num_value_heads=64, linear_key_head_dim=128,
                 linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=256, num_experts_per_tok=8,
                 moe_intermediate_size=1024, shared_expert_intermediate_size=1024, vocab_size=248320,
                 mtp_num_hidden_layers=1)
TEXT_35B = dict(hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
                head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=256, num_experts_per_tok=8,
                moe_intermediate_size=512, shared_expert_intermediate_size=512, vocab_size=248320,
                mtp_num_hidden_layers=1)
# Tiny: every dimension a multiple of the INT4 group (128) where a packed layer needs it; every 4th layer full
# attention; vocab deliberately not a power of two. The two architectures' tiny dims differ in every fact
# `facts()` compares, so "these files look like the other spec" is testable at tiny sizes too.
# Same shape as TEXT_* above on purpose: the same keys in the same order, so a tiny and a real table compare by eye.
TINY_122B = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                 linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=128, shared_expert_intermediate_size=128, vocab_size=1000,
                 mtp_num_hidden_layers=1)
TINY_35B = dict(hidden_size=128, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                linear_value_head_dim=32, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=256, shared_expert_intermediate_size=256, vocab_size=1100,
                mtp_num_hidden_layers=1)

# vLLM's MTP drafter with 2 draft tokens: the project default (docker/entrypoint.sh) and what the published
# 35B figure used (adrianpuiu/DGX_Spark_Qwen3.5-35B-A3B-Optimized install.sh: num_speculative_tokens 2).
MTP2 = {"method": "mtp", "num_speculative_tokens": 2}
DRAFTERS = ("mtp", "dflash")
DEFAULT_DRAFTER = "mtp"
# Where serve mounts the DFlash drafter in the container (read-only), and so where vLLM reads it.
DRAFTER_MOUNT = "/drafter"
# The DFlash drafter's config.json, as vLLM 0.32.0 reads it (model_executor/models/registry.py maps
# DFlashDraftModel to qwen3_dflash.DFlashQwen3ForCausalLM, whose DFlashQwen3Model reads dflash_config's
# target_layer_ids and mask_token_id). The 122B drafter's values: a public fixture of its config.json
# (architectures DFlashDraftModel, model_type qwen3, hidden 3072, vocab 248320, dflash_config block_size 16,
# mask_token_id 248077, 8 target_layer_ids up to 45 of the target's 48 layers).
DFLASH_ARCH = "DFlashDraftModel"


def dflash_config(spec: "Spec", model: str = DRAFTER_MOUNT, tokens: int | None = None) -> dict:
    """--speculative-config for the DFlash drafter: the fields of the published record's serve line."""
    return {"method": "dflash", "model": model, "num_speculative_tokens": tokens or spec.dflash_tokens}

@dataclasses.dataclass(frozen=True)
class Compressor:
    """An LLMLingua-2 prompt compressor (`onespark compress serve`, issue 27): `onespark download --compressor
    NAME` fetches it to DEST/COMPRESSOR_DIR/NAME and checks it against these facts."""
    name: str
    source: Source
    model_type: str  # config.json's: the family llmlingua's word rules follow (bert or xlm-roberta)
    params_m: float  # millions of parameters, all FP32 as published (size_gb = 4 bytes each)
    sha256: dict  # file -> sha256 where a public record gives it: checked after the download


COMPRESSOR_DIR = "llmlingua2"
# The two LLMLingua-2 checkpoints Microsoft publishes (MIT), trained on MeetingBank compressions by GPT-4.
# Pins: the commit several independent public reproductions load with llmlingua 0.2.2 (their snapshot paths
# and manifests name the full SHA, and one of them the weights' sha256); sizes from the Hub's file list as
# those records quote it (model.safetensors 2132 MiB and 677 MiB).
COMPRESSORS: dict[str, Compressor] = {c.name: c for c in (
    Compressor("xlm-roberta-large",
               Source("microsoft/llmlingua-2-xlm-roberta-large-meetingbank", "ebaba9b0e874dadd3003ffcff828e4397e568089",
                      "the snapshot public LLMLingua-2 reproductions pin (models--microsoft--llmlingua-2-xlm-roberta-"
                      "large-meetingbank/snapshots/ebaba9b0e874...), with the weights' sha256", 2.24),
               "xlm-roberta", 558.9,
               {"model.safetensors": "a33a153b2493bff6be06af6921e69de9c0d0bb6ff06fe5bbb68670ba8d980ae2"}),
    Compressor("bert-base",
               Source("microsoft/llmlingua-2-bert-base-multilingual-cased-meetingbank",
                      "5f0c82792b7ea14c6484e015b6a072009496b7f2",
                      "the snapshot public LLMLingua-2 deployments pin (models--microsoft--llmlingua-2-bert-base-"
                      "multilingual-cased-meetingbank/snapshots/5f0c82792b7e...); no public sha256 of its weights",
                      0.71),
               "bert", 177.9, {}),
)}
DEFAULT_COMPRESSOR = "xlm-roberta-large"  # the paper's main model; bert-base: ~3x fewer FLOPs, a bit weaker


SPECS: dict[str, Spec] = {s.name: s for s in (
    Spec(
        name="qwen3.5-122b-a10b", title="Qwen3.5-122B-A10B (122B, 10B active): the recipe this project reproduces",
        int4=Source("Intel/Qwen3.5-122B-A10B-int4-AutoRound", "3045d02bb737effc4581da91bddbad3be02934e4",
                    "the snapshot hash in Entrpi/qwen3.5-122B-A10B-on-spark tools/inspect_ckpt.py "
                    "(snapshots/3045d02bb737...) = the head commit 3045d02 on the repo's Files page", 77.0),
        fp8=Source("Qwen/Qwen3.5-122B-A10B-FP8", "a099dee70ccfcd8d5dda56aaa0b60cb8ecadabc9",
                   "the snapshot hash several independent public scripts load "
                   "(models--Qwen--Qwen3.5-122B-A10B-FP8/snapshots/a099dee7...)", 0.5),
        no_splice=None, text=TEXT_122B, tiny=TINY_122B,
        mtp_tensors=785, mtp_dtype="bf16", mtp_in_index=False, g_idx=True, mixed_bits=None,
        hybrid_gb=71.0,
        # 0.82 x 128 GB is the stable setting public Spark reports give (0.90 swaps); 110 GiB: doctor's
        # floor since the first release (a 128 GB Spark reports ~119 GiB MemTotal).
        min_memory_gib=110,
        serving={"gpu_memory_utilization": 0.82, "max_model_len": 262144, "speculative_config": MTP2},
        published=(Published(51, "v2 (hybrid + MTP-2 + INT8 head), vLLM 0.19.1, bench_qwen35.sh",
                             "albond/DGX_Spark_Qwen3.5-122B-A10B-AR-INT4 README results table"),),
        # No full commit SHA of the drafter is public: the record (Entrpi/qwen3.5-122B-A10B-on-spark install.sh,
        # DRAFT_REPO) downloads its main branch; z-lab/dflash issue #152 names two short commits, 2274357 (the
        # 2026-06-19 retrain: 6 layers, 8 target layers, SWA 4096) and 6c7242c (the April original: 4 layers,
        # 6 target layers). Hence --drafter-revision is required. 12 tokens: the record's runtime/serve.sh
        # (NSPEC default 12).
        dflash=Source("z-lab/Qwen3.5-122B-A10B-DFlash", None,
                      "no public full commit SHA: the record (Entrpi/qwen3.5-122B-A10B-on-spark install.sh) "
                      "downloads main; z-lab/dflash issue #152 names short commits 2274357 (2026-06-19 retrain, "
                      "6 layers) and 6c7242c (April original, 4 layers): pass the full SHA you checked with "
                      "--drafter-revision", 1.6),
        dflash_tokens=12,
    ),
    Spec(
        name="qwen3.5-35b-a3b", title="Qwen3.5-35B-A3B (35B, 3B active): the 122B's smaller sibling",
        int4=Source("Intel/Qwen3.5-35B-A3B-int4-AutoRound", None,
                    "no public commit SHA found: the public 35B port downloads the repo's main branch "
                    "(adrianpuiu/DGX_Spark_Qwen3.5-35B-A3B-Optimized install.sh `hf download` without "
                    "--revision); pass the commit you checked with --revision", 18.0),
        fp8=Source("Qwen/Qwen3.5-35B-A3B-FP8", "0b2752837483aa34b3db6e83e151b150c0e00e49",
                   "the snapshot hash public Spark scripts load (models--Qwen--Qwen3.5-35B-A3B-FP8/snapshots/"
                   "0b2752837483...); another public one, 9d1823d2dee6..., is older or newer: pass "
                   "--fp8-revision to choose", 0.15),
        no_splice=None, text=TEXT_35B, tiny=TINY_35B,
        mtp_tensors=2329, mtp_dtype="int4", mtp_in_index=True, g_idx=False, mixed_bits=None,
        hybrid_gb=18.0,
        # 0.50 x 128 GB = 64 GB: ~18 GB weights + a few GB of runtime leave ~40 GB of KV cache = ~7
        # sequences of 262144 tokens at 20 KiB/token (10 attention layers x 2 KV heads x 256 x K,V x BF16),
        # and leave half the Spark free. Derived from the shapes, not measured by this project.
        min_memory_gib=72,
        serving={"gpu_memory_utilization": 0.50, "max_model_len": 262144, "speculative_config": MTP2},
        published=(Published(112.8, "INT4 + INT8 LM head + MTP-2 (no hybrid), vLLM 0.19.0, albond's "
                                    "bench_qwen35.sh (5 prompts x 2 runs, temperature 0)",
                             "adrianpuiu/DGX_Spark_Qwen3.5-35B-A3B-Optimized README results table; the 122B "
                             "recipe's README quotes 112 tok/s for the 35B"),),
        notes="the published port measured the splice at +1.8% on this model (shared experts are 512 wide)",
    ),
    Spec(
        name="qwen3.6-35b-a3b", title="Qwen3.6-35B-A3B (35B, 3B active): Intel's W4A16-mixed release",
        int4=Source("Intel/Qwen3.6-35B-A3B-int4-mixed-AutoRound", "65f69c73f17488236c85c85211f6ba28d7106157",
                    "the snapshot hash in a public benchmark log that downloaded it "
                    "(models--Intel--Qwen3.6-35B-A3B-int4-mixed-AutoRound/snapshots/65f69c73...: 21 GB, 10 "
                    "shards + model_extra_tensors.safetensors)", 21.0),
        fp8=None,
        no_splice="its shared experts are already 8-bit (auto-round W4A16_MIXED: routed experts 4 bits, every "
                  "other linear 8), so there is no 16-bit weight to swap for Qwen/Qwen3.6-35B-A3B-FP8's FP8 "
                  "(public, snapshot 95a723d08a94...); the INT4 download is served as it is",
        text=TEXT_35B, tiny=TINY_35B,
        mtp_tensors=None, mtp_dtype="int4", mtp_in_index=True, g_idx=False, mixed_bits=8,
        hybrid_gb=0.0,
        min_memory_gib=72,
        serving={"gpu_memory_utilization": 0.50, "max_model_len": 262144, "speculative_config": MTP2},
        # mtp_in_index: assumed as the 35B's (not published for this release); step 2 lists the head either way.
        notes="MTP tensor count and whether the index lists the head are not published: verify derives the "
              "count from the config, step 2 lists the head either way",
    ),
)}

# The facts a config is compared on to tell models apart (and to refuse files of another model).
FACT_KEYS = ("hidden_size", "num_hidden_layers", "num_experts", "moe_intermediate_size",
             "shared_expert_intermediate_size", "vocab_size", "linear_num_value_heads", "num_attention_heads")
# text_config keys every step needs; a config without one of them is refused rather than guessed.
REQUIRED_KEYS = tuple(TEXT_35B)


def names() -> list[str]:
    return list(SPECS) + [CUSTOM]


def get(name: str | None, flag: str = "--model") -> Spec:
    """The spec called `name` (None: the default). `custom` needs custom(); unknown names list the specs."""
    name = name or DEFAULT
    if name in SPECS:
        return SPECS[name]
    if name == CUSTOM:
        raise UserError(f"{flag} custom needs --int4-repo (and --fp8-repo for the splice) and --revision")
    raise UserError(f"{flag} {name}: unknown; the specs are: {', '.join(names())}")


def custom(int4_repo: str, fp8_repo: str | None, revision: str | None = None,
           fp8_revision: str | None = None) -> Spec:
    """A spec for another checkpoint of this family: facts from its own config (see check_config)."""
    if not int4_repo:
        raise UserError("--model custom needs --int4-repo OWNER/NAME (and --fp8-repo OWNER/NAME for the splice)")
    no_pin = "--model custom: no pinned revision"
    return Spec(
        name=CUSTOM, title=f"custom: {int4_repo}" + (f" + {fp8_repo}" if fp8_repo else ""),
        int4=Source(int4_repo, revision, no_pin, 0.0),
        fp8=Source(fp8_repo, fp8_revision, no_pin, 0.0) if fp8_repo else None,
        no_splice=None if fp8_repo else "no FP8 source given (--fp8-repo, or --fp8 for step 1)",
        text={}, tiny={}, mtp_tensors=None, mtp_dtype="bf16", mtp_in_index=False, g_idx=True, mixed_bits=None,
        hybrid_gb=0.0, min_memory_gib=SPECS[DEFAULT].min_memory_gib,
        serving=dict(SPECS[DEFAULT].serving))


def named_or_custom(name: str | None, int4_repo: str | None, fp8_repo: str | None,
                    int4_revision: str | None = None, fp8_revision: str | None = None) -> Spec:
    """--model NAME, or --model custom with --int4-repo/--fp8-repo."""
    if name == CUSTOM:
        return custom(int4_repo, fp8_repo, int4_revision, fp8_revision)
    return get(name)


def add_model_argument(p: argparse.ArgumentParser, flag: str = "--model", recorded: bool = False) -> None:
    """--model NAME. recorded: a step after step 1, whose default is the spec the checkpoint's manifest records
    (None here; the step reads it: onespark.checkpoint.writer.recorded_spec)."""
    default = f"the spec the checkpoint's manifest records, else {DEFAULT}" if recorded else DEFAULT
    p.add_argument(flag, dest="model", default=None if recorded else DEFAULT, metavar="NAME",
                   help=f"model spec: {', '.join(names())} (default: {default}; `onespark specs` lists them)")


# ---- facts of a config ---------------------------------------------------------------------------

def facts(text: dict) -> dict:
    return {k: text.get(k) for k in FACT_KEYS}


def _describe(f: dict) -> str:
    return (f"hidden_size {f['hidden_size']}, {f['num_hidden_layers']} layers, {f['num_experts']} experts of "
            f"{f['moe_intermediate_size']}, shared expert {f['shared_expert_intermediate_size']}, "
            f"vocab {f['vocab_size']}")


def looks_like(text: dict) -> list[str]:
    """Names of the specs whose real or tiny (synth) dims a text_config has."""
    f = facts(text)
    return [s.name for s in SPECS.values() if f in (facts(s.text), facts(s.tiny))]


def check_config(spec: Spec, config: dict, where: str) -> None:
    """Refuse a config that is not this spec's model (saying which spec it looks like), or, for `custom`,
    one that lacks a fact the steps need (nothing is guessed)."""
    text = config.get("text_config", config)
    if spec.name == CUSTOM:
        arch = config.get("architectures") or []
        if config.get("model_type") != "qwen3_5_moe" and "Qwen3_5MoeForConditionalGeneration" not in arch:
            raise UserError(f"{where}: model_type {config.get('model_type')!r}, architectures {arch}: not a "
                            f"Qwen3.5/3.6 MoE checkpoint; --model custom covers only this family")
    # Every spec: the layout is derived from these (a named spec's facts alone leave head_dim etc. unchecked).
    missing = [k for k in REQUIRED_KEYS if k != "mtp_num_hidden_layers" and not isinstance(text.get(k), int)]
    if missing:
        raise UserError(f"{where}: text_config lacks {', '.join(missing)}: cannot derive the tensor layout "
                        f"from this config, so it cannot be checked (restore the downloaded config.json)")
    if spec.name == CUSTOM:
        return
    f = facts(text)
    if f in (facts(spec.text), facts(spec.tiny)):
        return
    like = looks_like(text)
    if like:
        hint = (f"these files look like {' / '.join(like)} ({_describe(f)}), not {spec.name} "
                f"({_describe(facts(spec.text))}): pass --model {like[0]}")
    else:
        hint = (f"these files match no spec ({_describe(f)}; {spec.name} is {_describe(facts(spec.text))}): "
                f"pass --model custom to check them against their own config")
    raise UserError(f"{where}: {hint}")


# ---- `onespark specs` ------------------------------------------------------------------------------

def as_dict(spec: Spec) -> dict:
    d = dataclasses.asdict(spec)
    d.update(splice=spec.splice, served_dir=spec.served_dir, work_subdir=spec.work_subdir, disk_gb=spec.disk_gb,
             spliced=spec.spliced, vllm_args=spec.vllm_args())
    return d


def _field(d: dict, path: str):
    cur = d
    for part in path.split("."):
        if not isinstance(cur, dict) or part not in cur:
            raise UserError(f"--get {path}: no such field; fields: {', '.join(sorted(d))}")
        cur = cur[part]
    return cur


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="NAME", help="print one spec (default: the table of all)")
    p.add_argument("--get", metavar="FIELD", help="print one field of --model's spec (dots for nested: int4.repo)")


def run(args: argparse.Namespace) -> int:
    if args.get and not args.model:
        raise UserError("--get needs --model NAME")
    if args.model:
        d = as_dict(get(args.model))
        if args.get:
            v = _field(d, args.get)
            print("" if v is None else (" ".join(v) if isinstance(v, list) else
                                        json.dumps(v) if isinstance(v, dict) else v))
        else:
            print(json.dumps(d, indent=2))
        return 0
    for s in SPECS.values():
        pin = lambda src: f"{src.repo}@{src.revision[:12] if src.revision else '(no pin: --revision)'}"  # noqa: E731
        print(f"{s.name}{'  (default)' if s.name == DEFAULT else ''}: {s.title}")
        print(f"  int4 {pin(s.int4)}  ~{s.int4.size_gb:g} GB")
        print(f"  fp8  {pin(s.fp8) if s.fp8 else 'none: step 1 skips the splice (' + s.no_splice + ')'}")
        print(f"  mtp  {s.mtp_tensors or 'unpublished count of'} tensors, {s.mtp_dtype}, "
              f"{'listed' if s.mtp_in_index else 'not listed'} in the INT4 index; serve {' '.join(s.vllm_args())}")
    print(f"{CUSTOM}: --int4-repo OWNER/NAME [--fp8-repo OWNER/NAME] --revision SHA; facts from the config")
    return 0
