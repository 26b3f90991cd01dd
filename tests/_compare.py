"""One comparison helper for kernel tests: every failure says how many elements differ, where,
by how much, and whether NaN/inf are involved. It never warns instead of failing."""

from __future__ import annotations

import torch


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol, what: str, show: int = 5) -> None:
    """Assert |actual - expected| <= tol elementwise (tol: a number or a tensor broadcastable to
    expected). A NaN or inf in `actual` passes only where `expected` has the same value at the same
    place; a poisoned (NaN-filled) output that a kernel left unwritten therefore fails."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    t = torch.as_tensor(tol, dtype=torch.float64).to("cpu").expand_as(e)
    a_nan, e_nan = torch.isnan(a), torch.isnan(e)
    a_inf, e_inf = torch.isinf(a), torch.isinf(e)
    finite = ~(a_nan | e_nan | a_inf | e_inf)
    special_bad = (a_nan != e_nan) | (a_inf != e_inf) | (a_inf & e_inf & (torch.sign(a) != torch.sign(e)))
    err = torch.zeros_like(a)
    err[finite] = (a[finite] - e[finite]).abs()
    bad = special_bad | (finite & (err > t))
    n_bad = int(bad.sum())
    if n_bad == 0:
        return
    idx = bad.nonzero()[:show].tolist()
    lines = [
        f"  at {tuple(i)}: got {a[tuple(i)].item():.6g}, expected {e[tuple(i)].item():.6g}, "
        f"tol {t[tuple(i)].item():.3g}"
        for i in idx
    ]
    rel = (err[finite] / e[finite].abs().clamp_min(1e-30)).max().item() if bool(finite.any()) else float("nan")
    norm_rel = ((a[finite] - e[finite]).norm() / e[finite].norm().clamp_min(1e-30)).item() if bool(finite.any()) else 0
    raise AssertionError(
        f"{what}: {n_bad} of {e.numel()} elements differ "
        f"(NaN in actual {int(a_nan.sum())} vs expected {int(e_nan.sum())}, "
        f"inf in actual {int(a_inf.sum())} vs expected {int(e_inf.sum())}; "
        f"max abs err {err.max().item():.3g}, max rel err {rel:.3g}, ||a-e||/||e|| {norm_rel:.3g})\n"
        + "\n".join(lines)
    )


def int8_rows_reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The INT8 LM head's per-row quantization as documented, independent of onespark.kernels: in fp32,
    scale = max|w_row| / 127 and q = round-half-even(w / scale) clamped to +-127. Returns (q int8, scale fp32)."""
    w = w.float()
    scale = w.abs().amax(dim=1) / 127
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale
