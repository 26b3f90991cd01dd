"""The step times the Spark model (onespark.bench.spark_model) takes from a GPU, and an engine's first and second
start, in one device call on an offline GPU host with vLLM 0.26.0 (the lane's wheel set, two pieces).

  python3 tests/gpu_vllm/spark_steps.py pack [--out .gpu-vllm/spark]     here: the wheel set in two pieces
  python3 tests/gpu_vllm/spark_steps.py run --out DIR [--git-sha SHA]     there, after install.sh install

`pack` is tests/gpu_vllm/pack.py's bundle with FlashAttention-2 left out too (nothing here serves through it)
and the device code of every architecture but sm_90 zeroed in vLLM's two large extension libraries (their
sm_90 SASS and every PTX kept byte for byte; the file layout is unchanged, zeros compress to nothing), and the
dependency wheels stored rather than deflated inside the tar.xz (xz compresses them a third smaller so): two
pieces, each with room for the checkout in one call. Pieces and manifest are install.sh's format:

  STORE=/root/gpu-vllm-spark MANIFEST=.gpu-vllm/spark/manifest.json tests/gpu_vllm/install.sh stash .gpu-vllm/spark/part-00

`run` starts two vLLM engines of the real Qwen3.5-122B-A10B shape with dummy weights, one after the other, the
same configuration both times (lab/vllm_step.py `product`: INT4 experts, FP8 shared experts, onespark's INT8
head; CUDA graphs and torch.compile on, TRITON_ATTN, no speculative decoding):

- the first, with cold caches, times a decode step at batch 1..13 (1K context): q one-token requests send the
  same q tokens through every linear layer, expert and the LM head as one request's verify step of q_len q
  (MTP-2: 3, DFlash n=12: 13); what differs (q GDN states and KV caches instead of one) is counted in bytes by
  the model. CUDA graphs are captured for exactly these batch sizes.
- the second is the restart: vLLM's torch.compile cache, Triton's cache and autotuning (TRITON_CACHE_AUTOTUNING,
  as the images set it) and the driver's PTX cache from the first; the same model folder and batch sizes (both
  are in vLLM's compile-cache key, as they stay the same between a Spark's restarts), timed again.
  `--cold-batches 1,13` leaves the time for both in one call.

Each engine's start-up phases are read from its log (weights, torch.compile or its cache, profiling, CUDA-graph
capture). Writes DIR/spark_steps_<gpu>.json and each engine's log; prints one table last.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
FATBIN_MAGIC = 0xBA55ED50
KEEP_SM = 90  # the H100's and H200's SASS
ZEROED = ("vllm-tree/vllm/_C_stable_libtorch.abi3.so", "vllm-tree/vllm/_moe_C_stable_libtorch.abi3.so")
BATCHES = list(range(1, 14))  # q_len 1..13: MTP-1 2, MTP-2 3, DFlash n=6..12 7..13
CTX = 1024
PHASES = {  # start-up phase -> the regex of vLLM 0.26.0's log line that times it (seconds in group 1; summed
    # over the lines that match: the target and a drafter each compile and profile)
    "model_load_s": r"Model loading took [\d.]+ GiB (?:memory )?and ([\d.]+) s",
    "compile_s": r"torch\.compile took ([\d.]+) s in total",
    "compile_cache_load_s": r"Directly load the compiled graph.*?took ([\d.]+) s",
    "profiling_s": r"Initial profiling/warmup run took ([\d.]+) s",
    "graph_capture_s": r"Graph capturing finished in ([\d.]+) secs",
    "init_engine_s": r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s",
}


# ---- pack (here) ---------------------------------------------------------------------------------------------

def fatbin_entries(so: bytes):
    """(kind, sm, payload offset, payload size) of every entry of an ELF64 library's .nv_fatbin section
    (kind 1 = PTX, 2 = SASS ELF); the fatbin layout as cuobjdump reads it (a 16-byte header per fatbin, then
    entries each with its own header: kind, header size, payload size, and the architecture at byte 28)."""
    shoff = struct.unpack_from("<Q", so, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", so, 0x3A)
    heads = [struct.unpack_from("<IIQQQQ", so, shoff + i * shentsize) for i in range(shnum)]
    names = heads[shstrndx][4]
    section = next(((h[4], h[5]) for h in heads if so[names + h[0]:so.index(b"\0", names + h[0])] == b".nv_fatbin"),
                   None)
    if section is None:
        return
    off, end = section[0], section[0] + section[1]
    while off + 16 <= end:
        magic, _, hsize, fsize = struct.unpack_from("<IHHQ", so, off)
        if magic != FATBIN_MAGIC:  # fatbins are 8-byte aligned within the section
            off += 8
            continue
        e, stop = off + hsize, off + hsize + fsize
        while e < stop:
            kind, _, ehs, psize = struct.unpack_from("<HHIQ", so, e)
            yield kind, struct.unpack_from("<I", so, e + 28)[0], e + ehs, psize
            e += ehs + psize
        off = stop


def zero_foreign_sass(so: bytes) -> tuple[bytes, int]:
    """The library with the payload of every SASS entry for another architecture than KEEP_SM set to zeros
    (headers, PTX and the sm_90 SASS untouched, so the loader picks what it picked before); bytes zeroed."""
    buf, zeroed = bytearray(so), 0
    for kind, sm, start, size in list(fatbin_entries(so)):
        if kind == 2 and sm != KEEP_SM:
            buf[start:start + size] = bytes(size)
            zeroed += size
    return bytes(buf), zeroed


def stored_wheel(whl: bytes) -> bytes:
    """The same wheel with its members stored, not deflated (pip installs either; the files and RECORD are
    unchanged): xz then compresses the whole bundle a third smaller than it can compress deflated members."""
    src, out = zipfile.ZipFile(io.BytesIO(whl)), io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info)  # before the entry is marked stored: reading goes by its own compression
            info.compress_type = zipfile.ZIP_STORED
            dst.writestr(info, data)
    return out.getvalue()


def pack(out: Path, cache: Path, pieces: int) -> int:
    sys.path.insert(0, str(HERE))
    import pack as lane_pack  # tests/gpu_vllm/pack.py: the lock, the download and the lane's trim

    lane_pack.TRIM["vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so"] = "FlashAttention-2 (305 MB): TRITON_ATTN serves here"
    # FlashAttention-3 stays: vllm.vllm_flash_attn refuses to import with neither build, and every model module
    # imports it (through fa_utils), whatever backend serves
    wheels = lane_pack.download(cache)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as d:
        plain, slim = Path(d) / "plain.tar", out / "bundle.tar"
        sizes = lane_pack.build_tar(wheels, plain)
        zeroed = {}
        with tarfile.open(plain) as src, tarfile.open(slim, "w", format=tarfile.PAX_FORMAT) as dst:
            for m in src.getmembers():
                data = src.extractfile(m).read()
                if m.name in ZEROED:
                    data, zeroed[m.name] = zero_foreign_sass(data)
                elif m.name.startswith("wheels/") and m.name.endswith(".whl"):
                    data = stored_wheel(data)
                    m.size = len(data)
                dst.addfile(m, io.BytesIO(data))
    subprocess.run(["xz", "-f", "-9e", "-T2", str(slim)], check=True)
    blob = slim.with_suffix(".tar.xz").read_bytes()
    slim.with_suffix(".tar.xz").unlink()
    step = -(-len(blob) // pieces)
    parts = []
    for old in out.glob("part-*"):
        old.unlink()
    for i in range(pieces):
        chunk = blob[i * step:(i + 1) * step]
        (out / f"part-{i:02d}").write_bytes(chunk)
        parts.append({"name": f"part-{i:02d}", "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
    manifest = {"vllm": "0.26.0", "bundle_sha256": hashlib.sha256(blob).hexdigest(), "bundle_bytes": len(blob),
                "parts": parts, "trimmed": lane_pack.TRIM, "sass_zeroed_bytes": zeroed, "kept_sm": KEEP_SM, **sizes}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"pack: {pieces} pieces, {len(blob) / 2**20:.1f} MiB in {out}; SASS zeroed: "
          + ", ".join(f"{Path(k).name} {v / 1e6:.0f} MB" for k, v in zeroed.items()))
    return 0


# ---- run (on the GPU host) -----------------------------------------------------------------------------------

def phases(log: str) -> dict:
    """Each start-up phase's seconds as the engine's log states them (summed over its lines)."""
    found = {}
    for name, rx in PHASES.items():
        hits = re.findall(rx, log)
        if hits:
            found[name] = round(sum(map(float, hits)), 2)
    return found


def child(out: Path, batches: list[int]) -> int:
    """One engine (in its own process, as vllm_step's children): vllm_step.one with CUDA graphs for exactly
    these batch sizes."""
    import vllm_step  # lab/, on PYTHONPATH (the run's environment)

    vllm_step.CAPTURE_SIZES = sorted(set(batches))
    # one model folder for both engines, as the images serve /model at every start: vLLM's compile-cache key
    # holds the model path, so a new temporary folder would make the restart compile again
    vllm_step.one("122b", "product", [CTX], batches, out, Path(tempfile.gettempdir()) / "onespark-spark-steps-122b")
    return 0


def engine(name: str, batches: list[int], out: Path, left: float) -> dict:
    """Start one engine in a child, wait for it (at most `left` seconds); its result, start-up phases and the
    wall time from launch to its first timed point."""
    res, log = out / f"spark_steps_{name}.json", out / f"spark_steps_{name}.log"
    cmd = [sys.executable, __file__, "child", "--out", str(res), "--batches", ",".join(map(str, batches))]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(x for x in (str(ROOT / "lab"), os.environ.get("PYTHONPATH")) if x))
    t0 = time.monotonic()
    error = None
    with open(log, "w") as lf:
        try:
            r = subprocess.run(cmd, stdout=lf, stderr=subprocess.STDOUT, timeout=left, env=env)
            error = None if r.returncode == 0 else f"exit {r.returncode}"
        except subprocess.TimeoutExpired:
            error = "stopped at the deadline"
    text = log.read_text(errors="replace")
    run = json.loads(res.read_text()) if res.exists() and res.stat().st_size else {"points": []}
    run.update(name=name, wall_s=round(time.monotonic() - t0, 1), phases=phases(text))
    if error:
        run["error"] = error + ": " + "\n".join(text.splitlines()[-15:])
    return run


def run(out: Path, sha: str | None, deadline_s: float, cold_batches: list[int]) -> int:
    sys.path.insert(0, str(ROOT / "lab"))
    import harness

    t0 = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    result = harness.header(sha) | {"ctx": CTX, "config": "product (FP8 shared experts + INT8 head, no MTP)",
                                    "engines": []}
    gpu = result["gpu"]
    # the whole sweep calibrates the step model (spark_steps_<gpu>.json); fewer cold batches leave time for the
    # restart in one call, and that run is about the two starts (spark_start_<gpu>.json)
    dest = out / f"spark_{'steps' if cold_batches == BATCHES else 'start'}_{gpu}.json"
    # each engine's floor is about its measured start (H200: first 392 s at batch 1 and 13, restart 234 s): one
    # started with less is killed at the deadline, and its device time buys nothing
    for name, batches, need in (("cold", cold_batches, 240), ("restart", cold_batches, 240)):
        left = deadline_s - (time.monotonic() - t0)
        if left < need:
            result["engines"].append({"name": name, "error": f"not started: {left:.0f} s left, {need} s needed"})
            continue
        print(f"== engine {name} ({left:.0f} s left)", flush=True)
        result["engines"].append(engine(name, batches, out, left))
        harness.write_result(dest, result)
    harness.write_result(dest, result)
    print(f"{'engine':8s} {'batch':>5s} {'ms/step':>8s} {'GB/step':>8s}   start-up: wall s, phases")
    for e in result["engines"]:
        ph = ", ".join(f"{k} {v:g}" for k, v in e.get("phases", {}).items())
        print(f"{e['name']:8s} start {e.get('startup_s', '-')} s (LLM()), wall {e.get('wall_s', '-')} s: {ph} "
              f"{e.get('error', '')[:300]}")
        for p in e.get("points", []):
            print(f"{e['name']:8s} {p['batch']:5d} {p['step_ms']:8.3f} {p['bytes'] / 1e9:8.2f}")
    return 0 if all("error" not in e for e in result["engines"]) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    sub = p.add_subparsers(dest="what", required=True)
    pk = sub.add_parser("pack", allow_abbrev=False)
    pk.add_argument("--out", type=Path, default=ROOT / ".gpu-vllm" / "spark")
    pk.add_argument("--cache", type=Path, default=Path.home() / ".cache/onespark-gpu-vllm")
    pk.add_argument("--pieces", type=int, default=2)
    r = sub.add_parser("run", allow_abbrev=False)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--git-sha")
    r.add_argument("--deadline-s", type=float, default=480, help="start no engine past this (default: %(default)s)")
    r.add_argument("--cold-batches", default=",".join(map(str, BATCHES)),
                   help="the first engine's batch sizes (default: 1..13, the verify sweep)")
    c = sub.add_parser("child", allow_abbrev=False)
    c.add_argument("--out", type=Path, required=True)
    c.add_argument("--batches", required=True)
    a = p.parse_args(argv)
    if a.what == "pack":
        return pack(a.out, a.cache, a.pieces)
    if a.what == "run":
        try:
            cold = sorted({int(x) for x in a.cold_batches.split(",")})
        except ValueError:
            p.error(f"--cold-batches: comma-separated batch sizes 1..13, got {a.cold_batches!r}")
        if not cold or not set(cold) <= set(BATCHES):
            p.error(f"--cold-batches: comma-separated batch sizes 1..13, got {a.cold_batches!r}")
        return run(a.out, a.git_sha, a.deadline_s, cold)
    return child(a.out, [int(x) for x in a.batches.split(",")])


if __name__ == "__main__":
    sys.exit(main())
