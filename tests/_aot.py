"""Compile the project's Triton kernels, exactly as a launch would, for GPUs that are not here.

Host code (decode_attention, int8_gemv, ...) runs on CPU tensors with `captured_launches()` active: each
`kernel[grid](...)` is recorded instead of launched. `compile_for()` then specializes the recorded arguments
with Triton's own binder for the target (the same signature, constexprs and alignment attributes a real
launch on that GPU derives), compiles to a cubin with the ptxas that ships in the Triton wheel, and reads
the resource usage (registers, spill stack, shared memory) with the wheel's cuobjdump. No GPU is needed:
this is how the DGX Spark's sm_121 code is checked on a CPU-only machine.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


@dataclass
class Launch:
    kernel: JITFunction
    args: tuple
    kwargs: dict


@dataclass
class Compiled:
    name: str
    ptx: str
    shared: int  # bytes per block, static + dynamic, as the launch would request
    registers: int
    spill_stack: int  # bytes per thread of local-memory stack (register spills)
    cubin: bytes


@contextlib.contextmanager
def captured_launches():
    """Record kernel launches instead of running them (they would need a GPU)."""
    launches: list[Launch] = []
    original = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        launches.append(Launch(self, args, dict(kwargs)))

    JITFunction.run = record
    try:
        yield launches
    finally:
        JITFunction.run = original


def compile_for(launch: Launch, capability: int, **constexpr_overrides) -> Compiled:
    """The cubin a real launch of `launch` would build on an sm_<capability> GPU (e.g. 90, 121)."""
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    kernel = launch.kernel
    kwargs = {"debug": False, "instrumentation_mode": "", **launch.kwargs, **constexpr_overrides}
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    ck = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(ck.asm["cubin"])
        f.flush()
        usage = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    assert m, f"no resource usage in cuobjdump's output:\n{usage}"
    return Compiled(kernel.fn.__name__, ck.asm["ptx"], ck.metadata.shared, int(m.group(1)), int(m.group(2)),
                    ck.asm["cubin"])
