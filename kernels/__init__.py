"""Triton kernels with plain-torch references. Imports only torch and triton."""

from . import turboquant  # noqa: F401  (TurboQuant reference codec; Triton kernels: onespark.kernels.turboquant_triton)
from .lm_head import (  # noqa: F401
    int4_gemv,
    int4_gemv_ref,
    int8_gemv,
    int8_gemv_ref,
    quantize_int4_groups,
    quantize_int8_rows,
)
