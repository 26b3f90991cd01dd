"""Where the LM-head kernel tests (tests/test_kernels_lm_head.py, tests/test_draft_head.py) run, and their tolerance.

With CUDA they run in the test process on the GPU, in bf16 and fp16. On CPU they skip in the parent and run in
test_interpreter_lane's child (tests/_interpreter.py: TRITON_INTERPRET=1), in fp16 and fp32: the interpreter
computes bf16 wrongly.
"""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.bfloat16, torch.float16] if CUDA else [torch.float16, torch.float32]
kernel_lane = pytest.mark.skipif(not (CUDA or INTERPRET), reason="CPU: runs in test_interpreter_lane's child")

# Significand bits of each output dtype: rounding to it moves a value by at most 2^-P of itself.
P_BITS = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}
# fp32 accumulation over K terms: realistic error ~sqrt(K) 2^-24 of sum|x w|; 2^-16 leaves ~10x margin
# at K = 3072 yet is far below what a lost K block or a wrong scale does (>= 1e-2 of sum|x w|).
ACC = 2.0**-16
