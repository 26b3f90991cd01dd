"""The MTP draft's LM head over a vocabulary subset (FR-Spec style): logits for K_sub rows only.

    sub[M, K_sub] = int8_gemv(x, w_sub, scale_sub)            (or int4_gemv for the INT4 variant)
    out[M, N]     = -inf everywhere, out[:, ids] = sub        full-vocabulary logits, so every consumer
                                                              (argmax, top-k, softmax) yields vocabulary ids

w_sub is a contiguous copy of the subset's rows of the target's INT8 head (`subset_rows`, once at load), so
the GEMV reads K_sub x K bytes instead of N x K: for Qwen3.5 (N = 248,320, K = 3,072) with K_sub = 32,768,
100.7 MB instead of 762.8 MB (1/7.6). Around it: one fill of M x N output elements (M x 0.5 MB in bf16) and
one index_copy of M x K_sub. Floor at a DGX Spark's 273 GB/s: 0.37 ms a draft pass instead of 2.79 ms; measured
on an H200 at an earlier plugin module (lab/results/draft_head_h200.json; run `tests/gpu.sh --bench draft_head`
again for a current figure). Nothing syncs with the host and nothing but the outputs is allocated, so calls
are CUDA-graph safe. `ids` must be ascending and unique (onespark draft-vocab writes them so): then
argmax over `out` and ids[argmax over `sub`] pick the same token, ties included (both take the lowest id).

References (plain torch, float64 in tests): `draft_logits_ref` computes the FULL head's logits and masks the
columns outside `ids`, so it checks the row gather, the scatter and the GEMV at once, independently of them.
"""

from __future__ import annotations

import torch

from .lm_head import dequantize_int4_groups, int4_gemv, int8_gemv, int8_gemv_ref, quantize_int4_groups

__all__ = [
    "check_ids",
    "subset_rows",
    "subset_int4_rows",
    "draft_logits",
    "draft_logits_int4",
    "draft_logits_ref",
    "scatter_subset",
    "subset_argmax",
]


def check_ids(ids: torch.Tensor, n: int) -> None:
    """ids: a 1-D int64 tensor of ascending unique row indices in [0, n), at least one."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype != torch.int64 or ids.numel() == 0:
        raise ValueError(f"ids must be a non-empty 1-D int64 tensor, got {getattr(ids, 'dtype', type(ids))} "
                         f"{tuple(getattr(ids, 'shape', ()))}")
    if int(ids[0]) < 0 or int(ids[-1]) >= n:
        raise ValueError(f"ids must lie in [0, {n}), got {int(ids.min())}..{int(ids.max())}")
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError("ids must be ascending and unique (onespark draft-vocab writes them so)")


@torch.no_grad()
def subset_rows(w_int8: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous copies of the subset's rows: (w_int8[ids] [K_sub, K] int8, scale[ids] [K_sub] fp32).
    Host syncs (the checks): call once at load time, never per step."""
    check_ids(ids, w_int8.shape[0])
    ids = ids.to(w_int8.device)
    return w_int8.index_select(0, ids).contiguous(), scale.index_select(0, ids).contiguous()


@torch.no_grad()
def subset_int4_rows(w_int8: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The subset's rows re-quantized to INT4 groups of 128 (from the INT8 rows: the BF16 weight is gone by
    then). INT4 only changes which token the draft proposes, never what the target accepts."""
    w_sub, s_sub = subset_rows(w_int8, scale, ids)
    return quantize_int4_groups(w_sub.to(torch.float32) * s_sub[:, None])


def scatter_subset(sub: torch.Tensor, ids: torch.Tensor, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """[M, K_sub] subset logits -> [M, n] with -inf outside `ids` (ids on sub's device, not re-checked)."""
    m = sub.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=sub.dtype, device=sub.device)
    elif out.shape != (m, n) or out.dtype != sub.dtype or out.device != sub.device:
        raise ValueError(f"out must be a {sub.dtype} tensor of shape ({m}, {n}) on {sub.device}, "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    out.fill_(float("-inf"))
    return out.index_copy_(1, ids, sub)


def draft_logits(x: torch.Tensor, w_sub: torch.Tensor, scale_sub: torch.Tensor, ids: torch.Tensor, n: int,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Full-vocabulary [M, n] logits from the subset's INT8 rows (int8_gemv: Triton; the interpreter on CPU)."""
    return _subset_logits(int8_gemv, x, w_sub, scale_sub, ids, n, out)


def draft_logits_int4(x: torch.Tensor, w4_sub: torch.Tensor, scale4_sub: torch.Tensor, ids: torch.Tensor, n: int,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """As draft_logits, from a subset_int4_rows result (int4_gemv)."""
    return _subset_logits(int4_gemv, x, w4_sub, scale4_sub, ids, n, out)


def _subset_logits(gemv, x, w, scale, ids, n, out):
    if ids.shape != (w.shape[0],):
        raise ValueError(f"ids has {tuple(ids.shape)} entries but the subset weight has {w.shape[0]} rows")
    return scatter_subset(gemv(x, w, scale), ids, n, out)


def draft_logits_ref(
    x: torch.Tensor, w_int8: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor, *,
    acc_dtype: torch.dtype = torch.float32, out_dtype: torch.dtype | None = None,
    w4: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Plain torch: the FULL head's logits (int8_gemv_ref) with the columns outside `ids` set to -inf.
    w4: (w4_sub, scale4_sub) of subset_int4_rows: then the subset columns are x @ dequantized INT4 rows."""
    n = w_int8.shape[0]
    keep = torch.zeros(n, dtype=torch.bool, device=w_int8.device)
    keep[ids.to(w_int8.device)] = True
    if w4 is None:
        full = int8_gemv_ref(x, w_int8, scale, acc_dtype=acc_dtype, out_dtype=acc_dtype)
    else:
        full = torch.zeros((x.shape[0], n), dtype=acc_dtype, device=x.device)
        w = dequantize_int4_groups(w4[0], w4[1], x.shape[1]).to(acc_dtype)
        full[:, ids.to(x.device)] = torch.nn.functional.linear(x.to(acc_dtype), w)
    full = full.masked_fill(~keep, float("-inf"))
    return full.to(out_dtype or x.dtype)


def subset_argmax(sub: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Greedy draft tokens straight from [M, K_sub] subset logits: vocabulary ids ids[argmax]."""
    return ids[sub.argmax(dim=-1)]
