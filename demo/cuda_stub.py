"""Write and build the arm64 stand-in's driver stub: lib64/stubs/libcuda.so, as the CUDA toolkit ships one.

  python3 cuda_stub.py CUDA_HOME

A docker build has no GPU driver, so a module that links libcuda.so.1 can only be loaded against a stub: a library
that exports the driver's entry points and answers every call with CUDA_ERROR_STUB_LIBRARY. The toolkit's own stub is
not among NVIDIA's PyPI wheels, so this one is made from CUDA_HOME/include/cuda.h (the CUDA 13.0 header of the
stand-in's toolkit): every function the header declares, under each name it can bind to (the plain one, the
versioned `_v2`/`_v3` one its macros select, and the per-thread-stream `_ptds`/`_ptsz` ones). Loading a module
against it checks everything else the module links (torch's ABI, cudart, nvrtc, glibc); the driver's behaviour is
the Spark's to show.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

CUDA_ERROR_STUB_LIBRARY = 34  # cuda.h: "the CUDA driver is a stub library"
NAME = re.compile(r"\b(cu[A-Z]\w*)\s*\(")


def names(header: Path) -> list[str]:
    """Every cu* function name cuda.h can declare: its text as written, then preprocessed both ways."""
    found = set(NAME.findall(header.read_text(errors="replace")))
    for extra in ([], ["-DCUDA_API_PER_THREAD_DEFAULT_STREAM"]):
        out = subprocess.run(["gcc", "-E", "-P", *extra, "-I", str(header.parent), "-x", "c", str(header)],
                             capture_output=True, text=True, check=True).stdout
        found |= set(NAME.findall(out))
    return sorted(found)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: cuda_stub.py CUDA_HOME", file=sys.stderr)
        return 2
    home = Path(argv[0])
    symbols = names(home / "include" / "cuda.h")
    stubs = home / "lib64" / "stubs"
    stubs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as d:
        src = Path(d, "stub.c")
        src.write_text("".join(f"int {s}(void) {{ return {CUDA_ERROR_STUB_LIBRARY}; }}\n" for s in symbols))
        subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-Wl,-soname,libcuda.so.1", "-o", str(stubs / "libcuda.so"),
                        str(src)], check=True)
    print(f"cuda_stub: {stubs / 'libcuda.so'}: {len(symbols)} driver entry points from {home / 'include' / 'cuda.h'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
