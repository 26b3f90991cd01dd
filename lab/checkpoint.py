"""Step 1's speed against `cp -r` of the same bytes, and its peak memory (a benchmark, not a test).

    python lab/checkpoint.py --work /var/tmp/ckbench [--size-gb 4] [--shard-gb 2] [--repeats 3]

Synthesizes an INT4 checkpoint of about --size-gb (Intel layout, shards of about --shard-gb) and a matching
FP8 source, then times, alternately and --repeats times each:
  cp      `cp -r INT4 OUT && sync`: what copying the output's bytes costs (coreutils uses copy_file_range too;
          `sync` because step 1 fsyncs every file it writes, and an unsynced copy only measures the page cache)
  hybrid  `onespark hybrid` (all files fsynced, sha256 of every output in the manifest)
  hybrid-nohash  the same with --no-hash
and reports medians, the ratio hybrid / cp (the target: <= 1.3) and each run's peak RSS (ru_maxrss of the
child; the target: < 1 GB whatever the shard size). Results: bench/results/checkpoint-<host>-<date>.json.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import harness

from onespark import __version__

ROOT = harness.ROOT


def _timed(cmd: list[str], cwd: Path) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes) of a child process."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{p.stderr.read().decode()}")
    return wall, usage.ru_maxrss * 1024  # Linux reports KiB


def _synth(out: Path, fmt: str, dims: dict, shards: int) -> None:
    flags = [f"--{k.replace('_', '-')}={dims[k]}" for k in ("hidden_size", "num_hidden_layers", "num_experts",
                                                           "moe_intermediate_size", "shared_expert_intermediate_size",
                                                           "vocab_size")]
    subprocess.run([sys.executable, "-m", "onespark", "synth", "--format", fmt, "--out", str(out),
                    f"--shards={shards}", *flags], check=True)


def _dims(size_gb: float) -> dict:
    # Routed experts dominate, as in the real model: 256 experts x 3 x (1024 x 512) int4 = ~0.2 GB a layer.
    dims = dict(hidden_size=1024, num_experts=256, moe_intermediate_size=512,
                shared_expert_intermediate_size=1024, vocab_size=32000)
    dims["num_hidden_layers"] = max(4, round(size_gb / 0.205))
    return dims


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--work", type=Path, required=True, help="scratch directory (needs ~3 x --size-gb free)")
    ap.add_argument("--size-gb", type=float, default=4.0)
    ap.add_argument("--shard-gb", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--keep", action="store_true", help="keep the synthesized inputs for another run")
    args = ap.parse_args(argv)
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    dims = _dims(args.size_gb)
    int4, fp8 = work / "int4", work / "fp8"
    if not (int4 / "config.json").exists():
        shards = max(1, round(args.size_gb / args.shard_gb))
        print(f"synthesizing ~{args.size_gb} GB INT4 checkpoint ({dims['num_hidden_layers']} layers, {shards} shards)",
              flush=True)
        # In child processes: a forked child's ru_maxrss starts at its parent's RSS, so this process
        # must never hold a shard itself or every measurement below would include it.
        _synth(int4, "int4", dims, shards)
        # The FP8 side only has to agree on the spliced tensors' model dims; one expert keeps it small.
        _synth(fp8, "fp8", dict(dims, num_experts=1), 1)
    in_bytes = sum(p.stat().st_size for p in int4.iterdir())
    shard_bytes = max(p.stat().st_size for p in int4.glob("*.safetensors"))
    # --model custom: the synthesized dims are no published model's, so hybrid checks them against their own config
    hybrid = [sys.executable, "-m", "onespark", "hybrid", "--model", "custom", "--int4", str(int4), "--fp8", str(fp8)]
    variants = {
        "cp": lambda out: ["sh", "-c", f'cp -r "{int4}" "{out}" && sync'],
        "hybrid": lambda out: hybrid + ["--out", str(out)],
        "hybrid-nohash": lambda out: hybrid + ["--out", str(out), "--no-hash"],
    }
    runs: dict[str, list[tuple[float, int]]] = {k: [] for k in variants}
    out_bytes = 0
    for i in range(args.repeats):
        for name, cmd in variants.items():
            out = work / f"out-{name}"
            shutil.rmtree(out, ignore_errors=True)
            subprocess.run(["sync"], check=True)
            wall, rss = _timed(cmd(out), ROOT)
            runs[name].append((wall, rss))
            if name == "hybrid":
                out_bytes = sum(p.stat().st_size for p in out.iterdir())
            print(f"  run {i + 1} {name:14s} {wall:7.2f} s  peak RSS {rss / 2**20:7.1f} MiB", flush=True)
            shutil.rmtree(out, ignore_errors=True)
    med = {k: statistics.median(w for w, _ in v) for k, v in runs.items()}
    rss = {k: max(r for _, r in v) for k, v in runs.items()}
    parent_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the floor of every child's figure
    result = harness.header(gpu=False, argv=argv) | {
        "what": "step 1 (onespark hybrid) vs cp -r of the same bytes", "tool_version": __version__,
        "host": platform.node(), "cpu": _cpu(), "cpus": os.cpu_count(), "filesystem": _fstype(work),
        "input_bytes": in_bytes, "output_bytes": out_bytes, "largest_shard_bytes": shard_bytes,
        "repeats": args.repeats,
        "median_s": med, "peak_rss_bytes": rss, "parent_rss_bytes_at_fork": parent_rss,
        "ratio_hybrid_over_cp": med["hybrid"] / med["cp"],
        "ratio_hybrid_nohash_over_cp": med["hybrid-nohash"] / med["cp"],
        "runs": {k: [{"wall_s": w, "peak_rss_bytes": r} for w, r in v] for k, v in runs.items()},
    }
    path = harness.write_result(args.out / f"checkpoint-{platform.node()}-{result['date'][:16].replace(':', '')}.json",
                                result)
    if not args.keep:
        shutil.rmtree(int4, ignore_errors=True)
        shutil.rmtree(fp8, ignore_errors=True)
    print(f"\n{'variant':14s} {'median s':>9s} {'GB/s':>6s} {'peak RSS MiB':>13s}   "
          f"({out_bytes / 1e9:.2f} GB out, largest shard {shard_bytes / 1e9:.2f} GB, {result['filesystem']})")
    for k in variants:
        print(f"{k:14s} {med[k]:9.2f} {out_bytes / med[k] / 1e9:6.2f} {rss[k] / 2**20:13.1f}")
    print(f"ratio hybrid/cp = {result['ratio_hybrid_over_cp']:.2f} (target <= 1.3); "
          f"without hashing {result['ratio_hybrid_nohash_over_cp']:.2f}; results: {path}")
    return 0


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _fstype(path: Path) -> str:
    r = subprocess.run(["df", "--output=fstype", str(path)], capture_output=True, text=True)
    return r.stdout.split()[-1] if r.returncode == 0 else "?"


if __name__ == "__main__":
    sys.exit(main())
