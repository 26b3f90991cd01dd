"""Unified memory (onespark.serving.memory): the plan's arithmetic, the guard against scripted meminfo/vmstat files,
and the guard stopping a real process that allocates inside a memory-limited cgroup.

The plan's expected numbers are computed by hand in the comments (MemTotal 119.70 GiB = 125,514,547 kB, the
Spark's visible memory; weights from the real 122B layout), not by the code under test. The guard runs its
real loop on real files; only its clock and sleep are the test's, so the scripts are exact.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from onespark.checkpoint import synth
from onespark.checkpoint.safetensors_io import read_header
from onespark.errors import UserError
from onespark.model import qwen35
from onespark.serving import container, launch, memory, serve

ROOT = Path(__file__).resolve().parent.parent
GIB = 1024**3
MIB = 1024**2
SPARK_KB = 125_514_547  # MemTotal of a Spark: 119.70 GiB
SPARK = SPARK_KB * 1024  # 128,526,896,128 B


def _meminfo(path: Path, *, total_kb=SPARK_KB, avail_gib=115.0, cached_gib=2.0, shmem_gib=0.0) -> str:
    path.write_text(f"MemTotal:       {total_kb} kB\nMemFree:        1000 kB\n"
                    f"MemAvailable:   {int(avail_gib * 1024**2)} kB\nCached:         {int(cached_gib * 1024**2)} kB\n"
                    f"Shmem:          {int(shmem_gib * 1024**2)} kB\nHugePages_Total:       0\n")
    return str(path)


def _real_122b_bytes() -> int:
    """Tensor bytes of the real Intel 122B INT4 checkpoint with its 785 BF16 mtp.* tensors (the layout in
    onespark.model.qwen35 for the real config; g_idx left out, as the index's total_size of a release without it)."""
    cfg = synth.make_config("int4", synth.REAL_TEXT, vision=synth.REAL_VISION)
    size = {"BF16": 2, "F16": 2, "F32": 4, "I32": 4}
    total = 0
    for name, e in qwen35.expected_tensors(cfg).items():
        if not qwen35.is_optional(name):
            dtype = next(d for d in ("BF16", "F16", "I32", "F32") if d in e.dtypes)
            total += size[dtype] * math.prod(e.shape)
    return total


def _index_only(d: Path, total_size: int | None, files: dict[str, int] | None = None) -> Path:
    """A checkpoint directory with config.json and an index (optionally shards of given sizes, sparse)."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text("{}")
    weight_map = {f"t{i}": f for i, f in enumerate(files or {"model-00001-of-00001.safetensors": 0})}
    meta = {} if total_size is None else {"total_size": total_size}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": meta, "weight_map": weight_map}))
    for f, n in (files or {}).items():
        with open(d / f, "wb") as fh:
            fh.truncate(n)
    return d


# ------------------------------------------------------------------------------------------------------
# the plan

def test_real_122b_at_the_default_fits_and_leaves_the_floor(tmp_path):
    weights = _real_122b_bytes()
    assert weights == 72_400_187_872  # 67.35 GB main model + 5.05 GB BF16 MTP head
    model = _index_only(tmp_path / "m", weights)
    plan = memory.make_plan(model, [], meminfo=_meminfo(tmp_path / "mi"))
    # share = ceil(0.82 x 128,526,896,128) = ceil(105,392,054,824.96) = 105,392,054,825 B = 98.154 GiB
    assert plan.util == 0.82 and plan.share == 105_392_054_825
    # KV = 105,392,054,825 - 72,400,187,872 - 4 x 2^30 (4,294,967,296) = 28,696,899,657 B = 26.73 GiB
    assert plan.kv_pool == 28_696_899_657
    # host = 128,526,896,128 - 105,392,054,825 = 23,134,841,303 B = 21.55 GiB >= 20 GiB
    assert plan.host_reserve == 23_134_841_303
    # headroom now = 115 GiB (123,480,309,760 B) - 105,392,054,825 = 18,088,254,935 B = 16.85 GiB >= 5 GiB
    assert plan.headroom_now == 18_088_254_935
    assert plan.problems() == []
    text = "\n".join(plan.lines())
    for piece in ("67.4 GiB", "98.2 GiB", "26.7 GiB", "21.5 GiB", "16.8 GiB", "metadata.total_size"):
        assert piece in text, text


def test_088_swaps_on_a_spark_and_is_refused_with_the_flag_to_change(tmp_path):
    model = _index_only(tmp_path / "m", _real_122b_bytes())
    mi = _meminfo(tmp_path / "mi")
    plan = memory.make_plan(model, ["--max-model-len", "65536", "--gpu-memory-utilization", "0.88"], meminfo=mi)
    # host = 128,526,896,128 - ceil(0.88 x 128,526,896,128 = 113,103,668,592.64) = 15,423,227,535 B = 14.36 GiB
    assert plan.host_reserve == 15_423_227_535
    [problem] = plan.problems()
    # the largest util that keeps 20 GiB: (119.70 - 20) / 119.70 = 0.8329 -> 0.83; the override: 14 (GiB)
    for piece in ("14.4 GiB", "below the 20.0 GiB floor", "-- --gpu-memory-utilization 0.83", "--host-reserve-gib 14"):
        assert piece in problem, problem
    assert memory.make_plan(model, ["--gpu-memory-utilization=0.88"], meminfo=mi, floor_gib=14).problems() == []
    assert memory.make_plan(model, ["--gpu-memory-utilization", "0.83"], meminfo=mi).problems() == []
    assert memory.make_plan(model, ["--gpu-memory-utilization", "0.84"], meminfo=mi).problems() != []


def test_a_busy_host_is_refused_before_the_guard_would_have_to_stop_it(tmp_path):
    model = _index_only(tmp_path / "m", _real_122b_bytes())
    plan = memory.make_plan(model, [], meminfo=_meminfo(tmp_path / "mi", avail_gib=100.0))
    # headroom = 100 GiB - 98.154 GiB = 1.85 GiB < 5; others use 119.70 - 100 = 19.70 GiB;
    # util that keeps 5 + 19.70 GiB: (119.70 - 24.70) / 119.70 = 0.7936 -> 0.79
    [problem] = plan.problems()
    for piece in ("already use 19.7 GiB", "keep 1.8 GiB", "guard's 5.0 GiB floor", "free 3.2 GiB",
                  "--gpu-memory-utilization 0.79"):
        assert piece in problem, problem
    # more than MemAvailable: vLLM itself refuses, and the message says so
    worse = memory.make_plan(model, [], meminfo=_meminfo(tmp_path / "mi2", avail_gib=90.0)).problems()[0]
    assert "vLLM itself would refuse" in worse


def test_kv_cache_memory_bytes_sizes_the_share_and_weights_that_do_not_fit(tmp_path):
    model = _index_only(tmp_path / "m", 10 * GIB)
    plan = memory.make_plan(model, ["--kv-cache-memory-bytes", "36864M"], meminfo=_meminfo(tmp_path / "mi"))
    assert plan.kv_pool == 36 * GIB and plan.share == (10 + 4 + 36) * GIB  # weights + overhead + KV
    small = _meminfo(tmp_path / "small", total_kb=16 * 1024**2, avail_gib=15)
    big = memory.make_plan(_index_only(tmp_path / "big", 72 * GIB), [], meminfo=small)
    assert big.kv_pool < 0 and "do not fit" in big.problems()[0] and "use a smaller checkpoint" in big.problems()[0]
    # at 0.5 (share 59.85 GiB) 60 GiB of weights do not fit; (60 + 4 + 1) / 119.70 = 0.543 -> 0.55 would, and up
    # to 0.83 keeps the floor
    low = memory.make_plan(_index_only(tmp_path / "mid", 60 * GIB), ["--gpu-memory-utilization", "0.5"],
                           meminfo=_meminfo(tmp_path / "mi3"))
    assert low.kv_pool < 0, low
    assert "-- --gpu-memory-utilization 0.55 (up to 0.83 keeps the host's floor)" in low.problems()[0]


def test_weights_come_from_the_checkpoints_own_index_or_its_shards(tmp_path):
    ck = tmp_path / "tiny"
    synth.synth(ck, "int4")  # real safetensors shards + index, MTP in model_extra_tensors (not in the index)
    index = json.loads((ck / "model.safetensors.index.json").read_text())
    # independent: the tensors' bytes as the shard headers describe them
    listed = set(index["weight_map"].values())
    in_headers = sum(t.nbytes for f in listed for t in read_header(ck / f).tensors.values())
    assert memory.weights_bytes(ck) == (in_headers, "model.safetensors.index.json metadata.total_size")
    index["metadata"] = {}
    (ck / "model.safetensors.index.json").write_text(json.dumps(index))
    files = sum(os.path.getsize(ck / f) for f in listed)
    assert memory.weights_bytes(ck) == (files, f"the {len(listed)} shards model.safetensors.index.json names")
    (ck / "model.safetensors.index.json").unlink()
    everything = sum(p.stat().st_size for p in ck.glob("*.safetensors"))
    assert memory.weights_bytes(ck)[0] == everything > files  # the MTP file counts too


@pytest.mark.parametrize("setup, flags, message", [
    ("corrupt", [], "unreadable"),
    ("empty", [], "no model.safetensors.index.json and no *.safetensors"),
    ("ok", ["--gpu-memory-utilization", "lots"], "expected a fraction"),
    ("ok", ["--gpu-memory-utilization", "82"], "must be in (0, 1]"),
    ("ok", ["--kv-cache-memory-bytes", "some"], "expected bytes"),
    ("missing-shard", [], "a shard the index names is missing"),
])
def test_bad_input_is_one_line_naming_what_to_fix(tmp_path, setup, flags, message):
    d = tmp_path / "m"
    d.mkdir()
    if setup == "corrupt":
        (d / "model.safetensors.index.json").write_text("{not json")
    elif setup == "ok":
        _index_only(d, GIB)
    elif setup == "missing-shard":
        _index_only(d, None)
    with pytest.raises(memory.PlanError, match=re.escape(message)) as e:
        memory.make_plan(d, flags, meminfo=_meminfo(tmp_path / "mi"))
    assert "\n" not in str(e.value)


def test_the_default_util_is_the_entrypoints():
    out = subprocess.run(["bash", str(ROOT / "docker/entrypoint.sh")], env={**os.environ, "ONESPARK_PRINT_ONLY": "1"},
                         capture_output=True, text=True, check=True).stdout.split("\n")
    assert float(out[out.index("--gpu-memory-utilization") + 1]) == memory.DEFAULT_GPU_UTIL


def _fake_proc(root: Path, pid: int, name: str, rss_kb: int, cmdline: str, cgroup: str = "0::/user.slice\n"):
    d = root / str(pid)
    d.mkdir(parents=True)
    (d / "status").write_text(f"Name:\t{name}\nState:\tS (sleeping)\nVmRSS:\t{rss_kb} kB\n")
    (d / "cmdline").write_bytes(cmdline.replace(" ", "\0").encode() + b"\0")
    (d / "cgroup").write_text(cgroup)


def test_other_consumers_are_named_with_the_command_that_frees_them(tmp_path):
    proc = tmp_path / "proc"
    cid = "ab12cd34ef56" + "0" * 52
    _fake_proc(proc, 101, "gnome-shell", 300 * 1024, "/usr/bin/gnome-shell")
    _fake_proc(proc, 102, "python3", 3 * 1024**2, "python3 -m vllm.entrypoints.openai.api_server --model /m",
               cgroup=f"0::/system.slice/docker-{cid}.scope\n")
    _fake_proc(proc, 103, "bash", 4 * 1024, "bash")
    _fake_proc(proc, 104, "ollama", 5 * 1024**2, "/usr/bin/ollama serve")
    _fake_proc(proc, 105, "cuda_app", 1024, "./cuda_app")
    _fake_proc(proc, 106, "python3", 3 * 1024**2, "python3 -c import ray\nray.init()")
    (proc / "self").mkdir()
    mem = memory.read_meminfo(_meminfo(tmp_path / "mi", cached_gib=30, shmem_gib=2))
    found = memory.consumers(mem, proc=proc, gpu={105})
    by = {c.what: c for c in reversed(found)}  # the largest of a kind (found is sorted by size)
    assert by["a vLLM server"].fix == "docker stop ab12cd34ef56" and "pid 102" in by["a vLLM server"].detail
    assert by["a desktop session"].fix.startswith("sudo systemctl isolate multi-user.target")
    assert by["a large process"].fix.startswith("kill 104") and "5.0 GiB resident" in by["a large process"].detail
    assert by["a GPU program"].fix.startswith("kill 105")
    assert "Shmem 2.0 GiB" in by["shared memory (tmpfs)"].detail
    assert by["page cache"].fix == memory.DROP_CACHES and "28.0 GiB" in by["page cache"].detail  # Cached - Shmem
    assert not any("pid 103" in c.detail for c in found)
    assert "python3 -c import ray ray.init()" in next(c.detail for c in found if "pid 106" in c.detail)  # one line
    assert all("sudo" not in c.fix or c.what in ("a desktop session", "page cache") for c in found)


def _serve_args(model: Path, *extra) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    return p.parse_args(["--checkpoint", str(model), *extra])


def test_serve_refuses_before_anything_is_started(tmp_path, monkeypatch, capsys):
    """The plan runs before `docker run` and before the guard: the fake docker records every call."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "docker").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/docker.log\n"
                                 '[ "$1 $2" = "image inspect" ]\n')  # the image exists, no container does
    (fake / "docker").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    model = _index_only(tmp_path / "m", _real_122b_bytes())
    args = _serve_args(model, "--meminfo", _meminfo(tmp_path / "mi"), "--", "--gpu-memory-utilization", "0.9")
    with pytest.raises(UserError, match=r"memory plan refused: .*leaves the host 12\.0 GiB") as e:
        serve.run(args)
    assert "onespark serve ... -- --gpu-memory-utilization 0.83" in str(e.value)
    out = capsys.readouterr().out
    assert re.search(r"vLLM's share +107\.7 GiB", out) and "KV pool" in out
    calls = (tmp_path / "docker.log").read_text().splitlines()
    assert [c.split()[0] for c in calls] == ["image", "inspect"], calls  # looked, ran nothing


def test_serve_dry_run_shows_plan_oom_adjustment_and_guard(tmp_path, capsys):
    model = _index_only(tmp_path / "m", _real_122b_bytes())
    serve.run(_serve_args(model, "--dry-run", "--meminfo", _meminfo(tmp_path / "mi")))
    out = capsys.readouterr().out
    assert "--oom-score-adj 1000" in out and re.search(r"host reserve +21\.5 GiB", out)
    assert "-m onespark.serving.memory guard --container onespark --floor-gib 5" in out
    serve.run(_serve_args(model, "--dry-run", "--no-memory-guard", "--meminfo", _meminfo(tmp_path / "mi")))
    assert "onespark.serving.memory guard" not in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------------
# the guard against scripted files

class Script:
    """The guard's sleep: advances the clock and rewrites meminfo/vmstat for the next sample."""

    def __init__(self, tmp_path: Path, steps: list[dict], interval: float = 0.5):
        self.meminfo, self.vmstat = tmp_path / "meminfo", tmp_path / "vmstat"
        self.steps, self.interval, self.t, self.i = steps, interval, 1000.0, 0
        self.child = subprocess.Popen(["sleep", "120"])  # the "server": a real process the guard may stop
        self.said: list[str] = []
        self.write(steps[0])

    def write(self, step: dict) -> None:
        for path, text in ((self.meminfo, step.get("meminfo")), (self.vmstat, step.get("vmstat"))):
            if text is None:
                path.unlink(missing_ok=True)  # unreadable this time
            else:
                path.write_text(text)

    def clock(self) -> float:
        return self.t

    def sleep(self, _seconds: float) -> None:
        self.t += self.interval
        self.i += 1
        if self.i >= len(self.steps):  # script over: the server ends by itself
            self.child.terminate()
            self.child.wait()
            return
        self.write(self.steps[self.i])

    def run(self, tmp_path: Path, *, log: str = "", floor_gib: float = 5.0) -> tuple[int, str]:
        server_log = tmp_path / "server.log"
        server_log.write_text(log)
        report = tmp_path / "report"
        guard = memory.Guard(int(floor_gib * GIB), page_size=4096)
        target = memory.PidTarget(self.child.pid, str(server_log))
        rc = memory.run_guard(memory.ProcSource(str(self.meminfo), str(self.vmstat)), target, guard, interval=0.5,
                              report=report, util="0.82", say=self.said.append, clock=self.clock, sleep=self.sleep)
        self.child.wait(timeout=10)
        return rc, report.read_text() if report.exists() else ""


def _mi(avail_gib: float) -> str:
    return f"MemTotal: {SPARK_KB} kB\nMemFree: 1 kB\nMemAvailable: {int(avail_gib * 1024**2)} kB\n"


def _vm(pages: int) -> str:
    return f"nr_free_pages 100\npgpgin 5\npswpin {pages // 2}\npswpout {pages - pages // 2}\npgfault 9\n"


PROFILING_LOG = ("(EngineCore pid=7) INFO Loading weights took 120.5 seconds\n"
                 "(EngineCore pid=7) INFO Memory profiling takes 14.2 seconds\n")


def test_falling_memavailable_stops_the_server_and_reports(tmp_path):
    script = Script(tmp_path, [{"meminfo": _mi(g), "vmstat": _vm(0)} for g in (20, 15, 10, 6, 4.9, 4.5, 4.0, 3.0)])
    rc, report = script.run(tmp_path, log=PROFILING_LOG)
    assert rc == 3 and script.child.returncode == -signal.SIGTERM
    assert script.i == 5  # stopped at the second sample below 5 GiB (4.9, 4.5), not later
    assert "MemAvailable 4.5 GiB stayed below the 5.0 GiB floor for 2 samples in a row" in report
    assert "stage (from the server log): sizing the KV cache" in report
    assert "vLLM's start-up profiling went past its share" in report and "--gpu-memory-utilization (now 0.82)" in report
    assert "-- --gpu-memory-utilization 0.78," in report  # 0.04 lower: ~4.8 GiB more for the host on a Spark
    assert "--no-memory-guard" in report
    rows = [ln.split() for ln in report.splitlines() if re.match(r"\s+-?\d+\.\d\s", ln)]
    assert [r[1] for r in rows] == ["20.0", "15.0", "10.0", "6.0", "4.9", "4.5"]
    assert [r[0] for r in rows] == ["-2.5", "-2.0", "-1.5", "-1.0", "-0.5", "0.0"]  # seconds before the stop


def test_a_swap_burst_is_not_a_reason_but_sustained_swapping_is(tmp_path):
    # one interval with 51,200 pages (x 4096 B = 200 MiB in 0.5 s: 400 MiB/s), then quiet
    burst = [0, 0, 51_200, 51_200, 51_200, 51_200, 51_200, 51_200]
    (tmp_path / "a").mkdir()
    script = Script(tmp_path / "a", [{"meminfo": _mi(30), "vmstat": _vm(p)} for p in burst])
    rc, report = script.run(tmp_path / "a")
    assert rc == 0 and report == "" and script.child.returncode == -signal.SIGTERM  # the script's own end
    assert any("ended" in s and "CPU" in s for s in script.said)
    # 2,560 pages per 0.5 s = 20 MiB/s >= 16 MiB/s, without a break: stopped once 5 s of it have passed
    (tmp_path / "b").mkdir()
    steady = [{"meminfo": _mi(30), "vmstat": _vm(2560 * i)} for i in range(30)]
    script = Script(tmp_path / "b", steady)
    rc, report = script.run(tmp_path / "b")
    assert rc == 3 and script.i == 10  # samples 0..10: the streak began at sample 0, 10 x 0.5 s = 5 s
    assert "the host swapped at 20 MiB/s or more (>= 16 MiB/s) for 5.0 s without a break" in report
    assert "20.0 MiB/s" in report


def test_a_flapping_reading_does_not_stop_a_healthy_server(tmp_path):
    # every other reading is below the floor: never two in a row, so never a trend
    steps = [{"meminfo": _mi(4.0 if i % 2 else 40.0), "vmstat": _vm(0)} for i in range(16)]
    script = Script(tmp_path, steps)
    rc, report = script.run(tmp_path)
    assert rc == 0 and report == "" and script.i == 16


def test_unreadable_samples_are_skipped_and_logged_once(tmp_path):
    steps = ([{"meminfo": None, "vmstat": None}] * 4  # both files gone for 2 s
             + [{"meminfo": "garbage\n", "vmstat": "nothing here\n"}] * 3  # present, but not what it should be
             + [{"meminfo": _mi(30), "vmstat": _vm(0)}] * 4
             + [{"meminfo": _mi(4), "vmstat": None}, {"meminfo": None, "vmstat": None}, {"meminfo": _mi(3)}])
    script = Script(tmp_path, steps)
    rc, report = script.run(tmp_path)
    said = "\n".join(script.said)
    assert said.count("cannot read available memory: [Errno 2]") == 1, said
    assert said.count("cannot read available memory: ") == 2  # one per kind of error, not per sample
    assert said.count("cannot read swap counters") == 2
    # still guarding: two low readings around an unreadable one are two in a row
    assert rc == 3 and script.i == len(steps) - 1 and "MemAvailable 3.0 GiB stayed below" in report


def test_the_guards_cost_per_sample_on_the_real_proc_files(tmp_path):
    """CPU time (not wall time, so a busy machine does not fail it) of 200 real samples of /proc."""
    child = subprocess.Popen(["sleep", "120"])
    n = 0

    def sleep(_):
        nonlocal n
        n += 1
        if n == 200:
            child.terminate()
            child.wait()

    said: list[str] = []
    t0 = time.process_time()
    rc = memory.run_guard(memory.ProcSource(), memory.PidTarget(child.pid), memory.Guard(0), interval=0.5,
                          report=None, util=None, say=said.append, sleep=sleep)
    per_sample = (time.process_time() - t0) / 200
    assert rc == 0 and per_sample < 0.002, per_sample  # measured ~0.1 ms; at 2 samples/s that is 0.02% of a core


def test_the_container_lifecycle_with_a_docker_that_records(tmp_path, monkeypatch):
    """The guard as `onespark serve` starts it: ends when `docker wait` returns, stops with `docker stop`."""
    fake, state = tmp_path / "bin", tmp_path / "state"
    fake.mkdir()
    state.mkdir()
    (fake / "docker").write_text(textwrap.dedent(f"""\
        #!/bin/sh
        echo "$@" >> {state}/calls
        case $1 in
          wait) while [ -e {state}/running ]; do sleep 0.05; done; echo 143 ;;
          stop) rm -f {state}/running ;;
          logs) printf '(EngineCore pid=7) INFO Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 37%%|\\n' ;;
        esac
        """))
    (fake / "docker").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT)}
    mi = tmp_path / "meminfo"
    (state / "running").touch()
    mi.write_text(_mi(40))
    cmd = memory.guard_command("srv", floor_gib=5, report=tmp_path / "report", util="0.82", meminfo=str(mi),
                               vmstat=str(tmp_path / "no-vmstat"))
    guard = subprocess.Popen(cmd + ["--interval", "0.05"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    time.sleep(1.0)
    assert guard.poll() is None  # memory is fine: it just watches
    mi.write_text(_mi(2))
    out, _ = guard.communicate(timeout=30)
    assert guard.returncode == 3, out
    calls = (state / "calls").read_text().splitlines()
    # first: the container exists (a guard of nothing is an error); then `docker wait` watches it
    assert calls[:2] == ["inspect --type container --format {{.Id}} srv", "wait srv"], calls
    assert "stop --time 5 srv" in calls and "logs --tail 400 srv" in calls
    report = (tmp_path / "report").read_text()
    assert "stopped container srv" in report and "capturing CUDA graphs (37%)" in report
    assert out.count("cannot read swap counters") == 1
    # started with the container, stopped with it: a container that ends (rm -f, replace) ends the guard
    (state / "running").touch()
    mi.write_text(_mi(40))
    guard = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(1.0)
    (state / "running").unlink()
    out, _ = guard.communicate(timeout=30)
    assert guard.returncode == 0 and "container srv ended" in out, out


GUARD = [sys.executable, "-m", "onespark.serving.memory", "guard"]


@pytest.mark.parametrize("flags, message", [
    # 0 samples in a row below the floor: before, the first sample stopped the target whatever it read
    (["--confirm", "0"], "argument --confirm: expected a whole number from 1 to 1000, got '0'"),
    (["--interval", "nan"], "argument --interval: expected a number above 0, got 'nan'"),
    (["--floor-gib", "-1"], "argument --floor-gib: expected a number above 0, got '-1'"),
    (["--swap-mib-s", "inf"], "argument --swap-mib-s: expected a number above 0, got 'inf'"),
    # issue 58: --util 1.5 was taken (the advice then read "now 1.5"); finite but huge values overflowed once used
    (["--util", "1.5"], "argument --util: expected a number above 0 and at most 1, got '1.5'"),
    (["--floor-gib", "1e308"], "argument --floor-gib: expected a number above 0 and at most 1000000000, got '1e308'"),
    (["--interval", "1e308"], "argument --interval: expected a number above 0 and at most 2000000, got '1e308'"),
])
def test_guard_options_that_would_stop_a_healthy_server_are_refused(tmp_path, flags, message):
    mi = tmp_path / "meminfo"
    mi.write_text(_mi(2))  # below the 5 GiB floor: a guard that ran would stop the target at once
    target = subprocess.Popen(["sleep", "60"])
    try:
        r = subprocess.run(GUARD + ["--pid", str(target.pid), "--floor-gib", "5", "--meminfo", str(mi), *flags],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, r.stdout + r.stderr
        assert r.stderr.splitlines() == [f"python -m onespark.serving.memory guard: error: {message} "
                                         "(see python -m onespark.serving.memory guard --help)"], r.stderr
        assert target.poll() is None  # still running
    finally:
        target.kill()
        target.wait()


def test_guard_of_a_process_or_container_that_does_not_exist_is_exit_2(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()  # reaped: its PID names no process now
    r = subprocess.run(GUARD + ["--pid", str(gone.pid)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stderr.splitlines()) == (2, [
        f"python -m onespark.serving.memory guard: error: --pid {gone.pid}: no such process (it exited, or the number is "
        "wrong): give the PID of the running server"]), r.stdout + r.stderr
    fake = tmp_path / "bin"
    fake.mkdir()  # docker as it answers for a name it does not know
    (fake / "docker").write_text('#!/bin/sh\necho "$@" >> %s/calls\n'
                                 '[ "$1" = inspect ] && { echo "Error: No such container: nosuch" >&2; exit 1; }\n'
                                 'exit 0\n' % tmp_path)
    (fake / "docker").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"}
    r = subprocess.run(GUARD + ["--container", "nosuch"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=60)
    assert (r.returncode, r.stderr.splitlines()) == (2, [
        "python -m onespark.serving.memory guard: error: --container nosuch: Error: No such container: nosuch: give the "
        "name `docker ps` lists for the running server"]), r.stdout + r.stderr
    assert (tmp_path / "calls").read_text().splitlines() == ["inspect --type container --format {{.Id}} nosuch"]


# ------------------------------------------------------------------------------------------------------
# a real process in a real memory-limited cgroup

ALLOCATOR = textwrap.dedent("""\
    import sys, time
    sys.stdin.readline()                       # go
    held = []
    for _ in range(112):                       # 112 x 4 MiB = 448 MiB: past the 256 MiB limit
        held.append(bytearray(4 * 1024 * 1024))  # zero-filled: every page is touched
        time.sleep(0.05)                         # 80 MiB/s
    print("allocated everything", flush=True)
""")
BYSTANDER = textwrap.dedent("""\
    import sys, time
    keep = bytearray(64 * 1024 * 1024)
    while True:
        print("alive", flush=True)
        time.sleep(0.1)
""")
LIMIT = 256 * MIB


def _memory_cgroup() -> tuple[Path, str] | None:
    """A fresh child cgroup under ours with a memory controller we may write: (path, 'v2' | 'v1')."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if controllers == "" and Path("/sys/fs/cgroup/cgroup.controllers").is_file():
            base, kind = Path("/sys/fs/cgroup") / rel.lstrip("/"), "v2"
            if "memory" not in (base / "cgroup.controllers").read_text().split():
                continue
        elif "memory" in controllers.split(","):
            base, kind = Path("/sys/fs/cgroup/memory") / rel.lstrip("/"), "v1"
        else:
            continue
        d = base / f"onespark-test-{os.getpid()}"
        try:
            d.mkdir()
            (d / ("memory.max" if kind == "v2" else "memory.limit_in_bytes")).write_text(str(LIMIT))
            if kind == "v2":
                (d / "memory.swap.max").write_text("0") if (d / "memory.swap.max").exists() else None
        except OSError:
            if d.exists():
                d.rmdir()
            continue
        return d, kind
    return None


def _oom_kills(d: Path, kind: str) -> int:
    text = (d / ("memory.events" if kind == "v2" else "memory.oom_control")).read_text()
    return int(dict(line.split() for line in text.splitlines()).get("oom_kill", 0))


def _in_cgroup(d: Path, script: str) -> subprocess.Popen:
    return subprocess.Popen(["sh", "-c", f'echo $$ > "{d}/cgroup.procs" && exec "{sys.executable}" -c "$0"', script],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _limit_hits(d: Path, kind: str) -> int:
    """How often usage ran into the limit (v2 memory.events `max`, v1 memory.failcnt)."""
    if kind == "v2":
        return int(dict(line.split() for line in (d / "memory.events").read_text().splitlines())["max"])
    return int((d / "memory.failcnt").read_text())


@pytest.fixture
def cgroup():
    found = _memory_cgroup()
    if found is None:
        pytest.skip("no writable memory cgroup (v2 with the memory controller, or v1) on this machine")
    d, kind = found
    yield d, kind
    for _ in range(50):
        try:
            d.rmdir()
            return
        except OSError:
            time.sleep(0.1)


def test_the_guard_stops_a_real_allocation_before_the_cgroup_limit(cgroup, tmp_path):
    d, kind = cgroup
    # negative control: the same allocator without the guard reaches the limit and the kernel kills it
    alone = _in_cgroup(d, ALLOCATOR)
    alone.communicate("go\n", timeout=60)
    assert alone.returncode == -signal.SIGKILL and _oom_kills(d, kind) == 1, "the limit does not bind here"
    hits = _limit_hits(d, kind)
    assert hits > 0

    bystander = subprocess.Popen([sys.executable, "-c", BYSTANDER], stdout=subprocess.PIPE, text=True)
    assert bystander.stdout.readline().strip() == "alive"
    server = _in_cgroup(d, ALLOCATOR)
    report = tmp_path / "report"
    # floor 96 MiB of the 256 MiB limit: at 80 MiB/s the guard has ~1.2 s between the floor and the limit
    guard = subprocess.Popen([sys.executable, "-m", "onespark.serving.memory", "guard", "--pid", str(server.pid),
                              "--cgroup", str(d), "--floor-gib", str(96 / 1024), "--interval", "0.1",
                              "--report", str(report)],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = guard.stdout.readline()
    assert "watching process" in first, first
    server.stdin.write("go\n")
    server.stdin.flush()
    out = first + guard.communicate(timeout=60)[0]
    server.communicate(timeout=30)
    try:
        assert guard.returncode == 3, out
        assert server.returncode == -signal.SIGTERM, server.returncode  # the guard's SIGTERM, not the OOM killer
        assert _oom_kills(d, kind) == 1  # still only the control's
        assert _limit_hits(d, kind) == hits  # usage never ran into the limit this time
        text = report.read_text()
        assert "stopped process" in text and "stayed below the 0.1 GiB floor" in text
        # the bystander (outside the cgroup, holding 64 MiB) was never touched and still runs
        assert bystander.poll() is None and bystander.stdout.readline().strip() == "alive"
    finally:
        bystander.kill()
        bystander.wait()


# ------------------------------------------------------------------------------------------------------
# a real container: the flag serve passes, and the guard's docker wait / docker stop

@pytest.mark.docker
def test_a_real_container_gets_the_oom_adjustment_and_the_guard_stops_it(tmp_path):
    """An image with nothing in it; the host's /usr (bin, lib) mounted read-only gives it a `sleep`."""
    empty = tmp_path / "empty.tar"
    subprocess.run(["tar", "cf", str(empty), "--files-from", "/dev/null"], check=True)
    image = "onespark-test/empty:1"
    subprocess.run(["docker", "import", str(empty), image], check=True, capture_output=True)
    cmd, _ = serve.docker_run_command(_serve_args(tmp_path, "--demo"), image)
    adj = cmd[cmd.index("--oom-score-adj"):cmd.index("--oom-score-adj") + 2]
    name = f"onespark-test-guard-{os.getpid()}"
    mounts = [a for d in ("/usr", "/bin", "/lib", "/lib64") if os.path.exists(d) for a in ("-v", f"{d}:{d}:ro")]
    run = ["docker", "run", "-d", "--name", name, *adj, *mounts, image, "/bin/sleep", "300"]
    try:
        subprocess.run(run, check=True, capture_output=True, timeout=120)
        pid = subprocess.run(["docker", "inspect", "-f", "{{.State.Pid}}", name], capture_output=True, text=True,
                             check=True).stdout.strip()
        # the kernel's choice: 1000 makes these processes the OOM killer's first victims, whatever their RSS
        assert Path(f"/proc/{pid}/oom_score_adj").read_text().strip() == "1000"
        mi = tmp_path / "meminfo"
        mi.write_text(_mi(40))
        guard = subprocess.Popen(memory.guard_command(name, floor_gib=5, report=tmp_path / "report", util="0.82",
                                                      meminfo=str(mi)) + ["--interval", "0.1"],
                                 cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        time.sleep(1.5)
        assert guard.poll() is None
        mi.write_text(_mi(1))
        out, _ = guard.communicate(timeout=60)
        assert guard.returncode == 3, out
        state = subprocess.run(["docker", "inspect", "-f", "{{.State.Running}}", name], capture_output=True,
                               text=True).stdout.strip()
        assert state == "false" and "docker stop --time 5" in (tmp_path / "report").read_text()
        # a guard whose container is removed ends with it
        subprocess.run(["docker", "start", name], check=True, capture_output=True)
        mi.write_text(_mi(40))
        guard = subprocess.Popen(memory.guard_command(name, floor_gib=5, report=tmp_path / "r2", util=None,
                                                      meminfo=str(mi)),
                                 cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        time.sleep(1.5)
        subprocess.run(["docker", "rm", "-f", name], check=True, capture_output=True)
        out, _ = guard.communicate(timeout=60)
        assert guard.returncode == 0 and f"container {name} ended" in out, out
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True)


def test_doctor_makes_the_same_plan(tmp_path):
    from onespark.serving import doctor

    model = _index_only(tmp_path / "work" / "hybrid", _real_122b_bytes())
    mi = _meminfo(tmp_path / "mi")
    ns = dict(work=str(tmp_path / "work"), meminfo=mi, host_reserve_gib=20.0, guard_floor_gib=None)
    # [0]: the plan; what follows names this machine's own large processes, if any
    ok = doctor.check_memory_plan(doctor.Preflight(**ns, checkpoint=None, gpu_memory_utilization=None))[0]
    assert ok.status == "ok" and "KV pool 26.7 GiB, host keeps 21.5 GiB" in ok.detail
    bad = doctor.check_memory_plan(doctor.Preflight(**ns, checkpoint=str(model), gpu_memory_utilization=0.88))[0]
    assert bad.status == "FAIL" and "--gpu-memory-utilization 0.83" in bad.fix
    [later] = doctor.check_memory_plan(doctor.Preflight(**{**ns, "work": str(tmp_path / "none")}, checkpoint=None,
                                                          gpu_memory_utilization=None))
    assert later.status == "ok" and "made once the checkpoint exists" in later.detail


def test_serve_shows_the_guards_report_when_it_stopped_the_container(tmp_path, monkeypatch):
    report = tmp_path / "guard.report"
    # the guard writes its report just after docker stop: serve may see the exit first
    threading.Timer(1.0, report.write_text,
                    ["onespark memory guard stopped container onespark at ...: MemAvailable 4.1 GiB stayed below\n"]).start()
    monkeypatch.setattr(launch, "http", lambda *a, **k: (0, b""))
    monkeypatch.setattr(container, "state", lambda name: (False, 143, False))
    monkeypatch.setattr(container, "logs", lambda name: "INFO Memory profiling takes 3 s\n")
    with pytest.raises(UserError, match=r"stopped by the memory guard after \d+ s:\nonespark memory guard stopped"):
        container.wait_healthy("onespark", "http://127.0.0.1:1", 60, tty=False, guard_report=report)
    report.unlink()  # no report (and not docker stop's exit code): the usual exit message and cause
    monkeypatch.setattr(container, "state", lambda name: (False, 1, False))
    with pytest.raises(UserError, match="exited \\(code 1\\)"):
        container.wait_healthy("onespark", "http://127.0.0.1:1", 60, tty=False, guard_report=report)


def test_replace_plans_after_the_old_server_gave_its_memory_back(tmp_path, monkeypatch, capsys):
    """install.sh --launch always passes --replace: the running server's memory must not count against the new
    one. The fake docker's `rm -f` gives 95 GiB back (in the meminfo file); `run` fails, ending the flow there."""
    state, fake = tmp_path / "state", tmp_path / "bin"
    state.mkdir()
    fake.mkdir()
    mi = tmp_path / "meminfo"
    _meminfo(mi, avail_gib=20.0)  # the old server holds ~95 GiB
    (state / "exists").touch()
    (fake / "docker").write_text(textwrap.dedent(f"""\
        #!/bin/sh
        echo "$@" >> {state}/calls
        case "$1 $2" in
          "image inspect") exit 0 ;;
          "inspect onespark") [ -e {state}/exists ] ;;
          "rm -f") rm -f {state}/exists; sed -i 's/^MemAvailable:.*/MemAvailable: {115 * 1024**2} kB/' {mi} ;;
          "run -d") echo "no GPU here" >&2; exit 1 ;;
        esac
        """))
    (fake / "docker").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(memory, "wait_until_settled", lambda *a, **k: None)
    _, report = memory.guard_files("onespark")
    report.parent.mkdir(parents=True)
    report.write_text("onespark memory guard stopped container onespark at 2026-12-01: MemAvailable 4.0 GiB ...\n")
    model = _index_only(tmp_path / "m", _real_122b_bytes())
    with pytest.raises(UserError, match="docker run failed: no GPU here"):
        serve.run(_serve_args(model, "--replace", "--port", "1", "--meminfo", str(mi)))
    out = capsys.readouterr().out
    assert "the previous run's memory guard stopped it:\nonespark memory guard stopped container" in out
    assert not report.exists() and re.search(r"headroom now +16\.8 GiB", out)
    calls = (state / "calls").read_text().splitlines()
    assert calls[calls.index("rm -f onespark") + 1].startswith("run -d")  # the plan passed in between


def test_wait_until_settled_waits_while_memory_comes_back(tmp_path):
    mi = tmp_path / "meminfo"
    readings = iter([40, 70, 95, 110, 115.1, 115.2, 115.2])
    mi.write_text(_mi(next(readings)))
    t = [0.0]

    def sleep(s):
        t[0] += s
        mi.write_text(_mi(next(readings)))

    memory.wait_until_settled(str(mi), clock=lambda: t[0], sleep=sleep)
    assert t[0] == 5.0  # 40 -> 70 -> 95 -> 110 -> 115.1 -> 115.2: the last step is < 256 MiB
    t[0] = 0.0
    readings = iter(range(10, 1000, 10))
    mi.write_text(_mi(next(readings)))
    memory.wait_until_settled(str(mi), clock=lambda: t[0], sleep=sleep, timeout=30)
    assert t[0] == 30.0  # never settles: gives up at the timeout


def test_install_launch_runs_the_plan_and_the_guard_by_default(tmp_path):
    """./install.sh --launch goes through `onespark serve`: its dry run shows the plan, the OOM adjustment and
    the guard (the real launch is the same serve command without --dry-run)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "docker").write_text("#!/bin/sh\nexit 1\n")  # no images, no daemon: the dry run only prints
    (fake / "docker").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONESPARK_")}
    env.update(PATH=f"{fake}:{os.path.dirname(sys.executable)}:/usr/bin:/bin", ONESPARK_VENV=str(tmp_path / "venv"),
               XDG_STATE_HOME=str(tmp_path / "state"))
    r = subprocess.run(["bash", "install.sh", "--dry-run", "--launch", "-y", "--work", str(tmp_path / "w")], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    launch = r.stdout[r.stdout.index("onespark serve --host"):]
    assert "memory plan: not made yet" in launch  # no checkpoint in a dry run
    assert "--oom-score-adj 1000" in launch and "-m onespark.serving.memory guard --container onespark --floor-gib 5" in launch


def test_an_unwritable_guard_log_is_one_line_before_anything_starts(tmp_path, monkeypatch):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "docker").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/docker.log\n[ \"$1 $2\" = \"image inspect\" ]\n")
    (fake / "docker").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "file"))  # a file where a directory must be
    model = _index_only(tmp_path / "m", _real_122b_bytes())
    with pytest.raises(UserError, match=r"cannot write the memory guard's log .*--no-memory-guard") as e:
        serve.run(_serve_args(model, "--port", "1", "--meminfo", _meminfo(tmp_path / "mi")))
    assert "\n" not in str(e.value)
    assert not any(c.startswith("run") for c in (tmp_path / "docker.log").read_text().splitlines())
