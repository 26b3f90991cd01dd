"""Triton kernels with plain-torch references. Imports only torch and triton."""
from . import turboquant  # noqa: F401  (TurboQuant reference codec; Triton kernels: onespark.kernels.turboquant_triton)
