"""Pack vLLM 0.26.0 for the GPU host, on this machine: the trimmed wheel tree and the wheels the host lacks, in
pieces that each fit one device call (the tool carries at most 64 MiB of working tree; the checkout is ~3 MB).

  python3 tests/gpu_vllm/pack.py [--cache DIR] [--out .gpu-vllm] [--piece-mib 56]

Downloads every wheel of tests/gpu_vllm/wheels.lock with pip --require-hashes (into --cache, reused), unpacks
vLLM's wheel, drops what this model's server never loads (TRIM, with the reason for each), rewrites RECORD to
match, and writes OUT/manifest.json and OUT/part-NN: one tar.xz holding vllm-tree/ (the trimmed package, as it
lies in site-packages) and wheels/, cut into pieces. tests/gpu_vllm/install.sh puts it back together there.
Re-runs with the same lock and TRIM write the same tar (sorted names, fixed mtimes), so pieces are reproducible.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
LOCK = HERE / "wheels.lock"
VLLM_WHEEL = "vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl"
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux_2_31_x86_64"]  # llguidance 1.7.6 exists only as manylinux_2_31 (the host has glibc 2.39)

# Path prefixes inside the vLLM wheel that are not shipped, and why (732 MB unpacked -> ~625 MB). FlashAttention-2
# (`_vllm_fa2_C`, 305 MB) stays although the lane serves with TRITON_ATTN: upstream's TurboQuant, the baseline
# the lane measures, forces flash_attn_version 2 (vllm/engine/arg_utils.py, "TurboQuant is not yet compatible with
# FlashAttention >= 3") and runs its first-chunk prefill through torch.ops._vllm_fa2_C.varlen_fwd; without it
# that server would fail on its first request for our trim, not for upstream's code. FA3 stays because
# vllm.vllm_flash_attn is imported at module level on CUDA.
TRIM = {
    "vllm/vllm-rs": "the optional Rust front end (VLLM_USE_RUST_FRONTEND=1 only), 43 MB",
    "vllm/third_party/deep_gemm/": "DeepGEMM FP8 block GEMM (34 MB): absent means vLLM does not offer it; FP8 "
    "linear layers take the CUTLASS/Triton path",
    "vllm/third_party/fmha_sm100/": "Blackwell-only (SM100) sparse attention, 29 MB",
}


def lock_entries(lock: Path = LOCK) -> list[tuple[str, str]]:
    """(NAME==VERSION, sha256) per wheel of the lock."""
    entries = []
    for line in lock.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            spec, digest = line.split(" --hash=sha256:")
            entries.append((spec.strip(), digest.strip()))
    return entries


def download(cache: Path) -> list[Path]:
    cache.mkdir(parents=True, exist_ok=True)
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--require-hashes", "--python-version", "3.12", "--implementation", "cp", *platforms,
                    "-d", str(cache), "-r", str(LOCK)], check=True)
    by_hash = {hashlib.sha256(p.read_bytes()).hexdigest(): p for p in cache.glob("*.whl")}
    missing = [spec for spec, digest in lock_entries() if digest not in by_hash]
    if missing:
        sys.exit(f"pack: {cache} lacks the locked wheel of {', '.join(missing)}: remove the folder and re-run")
    return [by_hash[digest] for _, digest in lock_entries()]


def trimmed(path: str) -> bool:
    return any(path == t or (t.endswith("/") and path.startswith(t)) for t in TRIM)


def _add(tar: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), mode, 0
    tar.addfile(info, io.BytesIO(data))


def build_tar(wheels: list[Path], dest: Path) -> dict:
    """The tar of vllm-tree/ (trimmed, RECORD rewritten) and wheels/; returns what was kept and dropped."""
    kept = dropped = 0
    with tarfile.open(dest, "w", format=tarfile.PAX_FORMAT) as tar:
        with zipfile.ZipFile(next(w for w in wheels if w.name == VLLM_WHEEL)) as z:
            for info in sorted(z.infolist(), key=lambda i: i.filename):
                if info.is_dir():
                    continue
                if trimmed(info.filename):
                    dropped += info.file_size
                    continue
                data = z.read(info)
                if info.filename.endswith(".dist-info/RECORD"):
                    lines = data.decode().splitlines()
                    data = "".join(f"{x}\n" for x in lines if not trimmed(x.split(",", 1)[0])).encode()
                mode = 0o755 if (info.external_attr >> 16) & 0o111 else 0o644
                _add(tar, f"vllm-tree/{info.filename}", data, mode)
                kept += len(data)
        for w in sorted(wheels):
            if w.name != VLLM_WHEEL:
                _add(tar, f"wheels/{w.name}", w.read_bytes())
    return {"vllm_kept_bytes": kept, "vllm_trimmed_bytes": dropped}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache/onespark-gpu-vllm")
    p.add_argument("--out", type=Path, default=Path(".gpu-vllm"))
    p.add_argument("--piece-mib", type=int, default=56, help="piece size (a call carries 64 MiB with the checkout)")
    args = p.parse_args(argv)
    wheels = download(args.cache)
    args.out.mkdir(parents=True, exist_ok=True)
    for old in args.out.glob("part-*"):
        old.unlink()
    tar = args.out / "bundle.tar"
    sizes = build_tar(wheels, tar)
    subprocess.run(["xz", "-f", "-6", "-T2", str(tar)], check=True)
    blob = tar.with_suffix(".tar.xz").read_bytes()
    tar.with_suffix(".tar.xz").unlink()
    step = args.piece_mib << 20
    parts = []
    for i in range(0, len(blob), step):
        piece = args.out / f"part-{i // step:02d}"
        piece.write_bytes(blob[i:i + step])
        parts.append({"name": piece.name, "bytes": len(blob[i:i + step]),
                      "sha256": hashlib.sha256(blob[i:i + step]).hexdigest()})
    manifest = {"vllm": "0.26.0", "bundle_sha256": hashlib.sha256(blob).hexdigest(), "bundle_bytes": len(blob),
                "parts": parts, "trimmed": TRIM, **sizes,
                "wheels": [spec for spec, _ in lock_entries()]}
    tmp = args.out / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, args.out / "manifest.json")
    print(f"pack: {len(parts)} pieces, {len(blob) / 2**20:.1f} MiB in {args.out} "
          f"(vLLM tree {sizes['vllm_kept_bytes'] / 1e6:.0f} MB kept, {sizes['vllm_trimmed_bytes'] / 1e6:.0f} MB trimmed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
