"""install.sh, steps 3-4, docker/entrypoint.sh, `onespark doctor` and `onespark serve`, without a GPU.

External programs (docker, nvidia-smi, sudo) are replaced by small scripts on PATH that answer the way
the real ones do on the machine being imitated (a DGX Spark, an H100 box, a machine without Docker) and
log every call, so the tests can assert what was run and, as important, what was not.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import shlex
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from onespark import __version__
from onespark.errors import UserError
from onespark.serving import doctor, serve, vllm_log
from tests._plan import in_order

ROOT = Path(__file__).resolve().parent.parent
BASH = shutil.which("bash")


def _script(path: Path, body: str) -> None:
    path.write_text("#!/usr/bin/env bash\n" + textwrap.dedent(body))
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


@pytest.fixture
def fakebin(tmp_path):
    """A directory of fake programs placed first on PATH; every call is appended to calls.log."""
    d = tmp_path / "bin"
    d.mkdir()
    log = tmp_path / "calls.log"
    for name in ("sudo", "apt-get", "debootstrap"):
        _script(d / name, f'echo "{name} $*" >> "{log}"; exit 1\n')
    # Tools the scripts may legitimately use come from the real system.
    path = f"{d}:{os.path.dirname(sys.executable)}:/usr/bin:/bin"
    return {"dir": d, "log": log, "path": path}


def _calls(fb) -> list[str]:
    return fb["log"].read_text().splitlines() if fb["log"].exists() else []


def _env(fb, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ONESPARK_", "VLLM_API_KEY"))}
    env.update(PATH=fb["path"], **extra)
    return env


def _fake_docker(fb, *, state: Path | None = None, runtimes='{"runc":{}}', server="28.3.3", buildx=True,
                 fail_daemon: str | None = None):
    """A docker that keeps image labels in `state` (JSON: tag -> fingerprint) so that a build followed by
    an inspect behaves like the real engine."""
    state = state or fb["dir"].parent / "docker-state.json"
    if not state.exists():
        state.write_text("{}")
    py = sys.executable
    _script(fb["dir"] / "docker", f'''
        echo "docker $*" >> "{fb['log']}"
        {"echo " + repr(fail_daemon) + " >&2; exit 1" if fail_daemon else ""}
        exec {py} - "$@" <<'PY'
import json, sys
state_path = {str(state)!r}
args = sys.argv[1:]
state = json.load(open(state_path))
if args[:1] == ["version"]:
    print({server!r}); sys.exit(0)
if args[:1] == ["info"]:
    fmt = args[args.index("--format") + 1] if "--format" in args else ""
    print({runtimes!r} if "Runtimes" in fmt else "/var/lib/docker"); sys.exit(0)
if args[:2] == ["buildx", "version"]:
    sys.exit(0 if {buildx!r} else 1)
if args[:2] == ["image", "inspect"] and args[-1].startswith("sha256:"):  # by ID: the tags that name it
    print(" ".join(t for t, v in state.items() if isinstance(v, dict) and v.get("__id__") == args[-1])); sys.exit(0)
if args[:2] == ["image", "inspect"]:
    tag = args[-1]
    if tag not in state: sys.exit(1)
    labels = state[tag] if isinstance(state[tag], dict) else {{"dev.onespark.fingerprint": state[tag]}}
    fmt = " ".join(args)
    if "{{{{.Id}}}}" in fmt:
        print(labels.get("__id__", "sha256:" + "ab" * 32))
    elif "Labels" in fmt:
        key = fmt.split('"')[1]  # {{{{ index .Config.Labels "KEY" }}}}
        print(labels.get(key, ""))
    else:
        print("sha256:" + "ab" * 32)
    sys.exit(0)
if args[:1] == ["build"]:
    labels = dict(args[i + 1].split("=", 1) for i, a in enumerate(args) if a == "--label")
    state["__builds__"] = state.get("__builds__", 0) + 1  # each build a new image ID: 1, 2, ...
    labels["__id__"] = "sha256:%064x" % state["__builds__"]
    state[args[args.index("-t") + 1]] = labels
    json.dump(state, open(state_path, "w")); print("Successfully built"); sys.exit(0)
sys.exit(0)
PY
''')
    return state


def _run(argv, fb, timeout=120, **env):
    return subprocess.run(argv, cwd=ROOT, env=_env(fb, **env), capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------------------------------------------------
# install.sh

def test_help_shows_real_defaults(fakebin):
    r = _run([BASH, "install.sh", "--help"], fakebin)
    assert r.returncode == 0, r.stderr
    assert "(default: 8000)" in r.stdout and "(default: 127.0.0.1" in r.stdout
    # The defaults the help states are the ones the plan uses.
    plan = _run([BASH, "install.sh", "--dry-run", "--launch"], fakebin,
                ONESPARK_VENV=str(fakebin["dir"].parent / "venv"))
    assert plan.returncode == 0, plan.stderr
    assert "--host 127.0.0.1 --port 8000" in plan.stdout
    assert f"onespark/v2:{__version__}" in r.stdout and f"onespark/v2:{__version__}" in plan.stdout


@pytest.mark.parametrize("argv, message", [
    (["--bogus"], "unknown option: --bogus"),
    (["--port", "eighty"], "--port must be a number"),
    (["--demo", "--tq"], "--tq needs a GPU"),
    (["--model", "custom", "--dry-run"], "--model custom: install.sh runs the named specs"),
])
def test_bad_options(fakebin, argv, message):
    r = _run([BASH, "install.sh", *argv], fakebin)
    assert r.returncode != 0
    assert message in r.stderr
    assert _calls(fakebin) == []


def _installed_venv(tmp_path: Path, log: Path) -> Path:
    """A host virtualenv install.sh takes as up to date, whose onespark only logs its calls: a real (not dry) run
    then shows which steps it started."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    _script(venv / "bin" / "onespark", f'echo "onespark $*" >> "{log}"\n')
    (venv / ".onespark-installed").touch()
    return venv


# A value that the launch (serve or cluster, at the end) refuses is refused before the first step: before, a real run
# created the venv, ran the preflight, downloaded 77 GB and built the images, then stopped at `onespark serve`.
@pytest.mark.parametrize("argv, message", [
    (["--port", "99999"], "argument --port: expected a whole number from 1 to 65535, got '99999'"),
    (["--port", "0"], "argument --port: expected a whole number from 1 to 65535, got '0'"),
    (["--host", "bad;host"], "argument --host: 'bad;host' is not an address to bind"),
    (["--api-key", "two words"], "--api-key (or $ONESPARK_API_KEY): the key is not plain printable ASCII"),
    (["--nodes", "spark1,spark2", "--port", "70000"], "argument --port: expected a whole number from 1 to 65535"),
], ids=["port-high", "port-0", "host", "api-key", "nodes-port"])
@pytest.mark.parametrize("dry", [False, True], ids=["run", "dry-run"])
def test_a_launch_value_is_refused_before_any_step(fakebin, tmp_path, argv, message, dry):
    venv = _installed_venv(tmp_path, fakebin["log"])
    r = _run([BASH, "install.sh", "-y", "--work", str(tmp_path / "work"), *argv] + (["--dry-run"] if dry else []),
             fakebin, ONESPARK_VENV=str(venv))
    assert r.returncode == 2, r.stdout + r.stderr
    assert len(r.stderr.splitlines()) == 1 and message in r.stderr, r.stderr
    assert "two words" not in r.stdout + r.stderr  # the key is never shown
    assert "+ " not in r.stdout and _calls(fakebin) == [], (r.stdout, _calls(fakebin))  # not one command planned or run


@pytest.mark.parametrize("work", ["/tmp/with space", "/tmp/a:b", "/tmp/it's", "/tmp/a;b", "-y", "-L"])
def test_a_work_directory_docker_cannot_mount_is_one_line(fakebin, tmp_path, work):
    """`--work /tmp/a:b` became `docker run -v /tmp/a:b/hybrid:/model:ro` (docker splits it at the colon) after every
    step had run; `--work -L` was an option of realpath, which then failed, and the plan wrote to /."""
    r = _run([BASH, "install.sh", "--dry-run", "-y", "--work", work], fakebin, ONESPARK_VENV=str(tmp_path / "venv"))
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"onespark: error: --work '{work}': "), r.stderr
    assert "e.g. --work " in lines[0]
    assert r.stdout == "" and _calls(fakebin) == []


@pytest.mark.parametrize("step", ["steps/0-download.sh", "steps/1-hybrid.sh", "steps/2-mtp.sh"])
@pytest.mark.parametrize("work", ["-L", "/tmp/a:b"])
def test_a_step_checks_its_work_directory_as_install_does(fakebin, tmp_path, step, work):
    """Steps 0-2 run alone: `--work -L` reached the onespark command the step runs as one of its options; a work
    directory docker cannot mount is refused as install.sh refuses it (steps/lib.sh work_dir)."""
    r = _run([BASH, step, "--dry-run", "--work", work], fakebin, ONESPARK_VENV=str(tmp_path / "venv"))
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"onespark: error: --work '{work}': "), r.stderr
    assert "+ " not in r.stdout and _calls(fakebin) == []


@pytest.mark.parametrize("flag", ["--max-jobs", "--nvcc-threads"])
@pytest.mark.parametrize("value", ["abc", "0", "-4", "4x"])
def test_base_image_counts_are_whole_numbers(fakebin, tmp_path, flag, value):
    """--max-jobs and --nvcc-threads went unread into the base image's build arguments, to fail (or not) there."""
    r = _run([BASH, "steps/3-base-image.sh", "--dry-run", flag, value], fakebin)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stdout + r.stderr
    assert f"{flag} {value}: give a whole number" in r.stderr or "needs a value" in r.stderr, r.stderr


def test_an_ipv6_host_is_in_brackets_in_the_urls(fakebin, tmp_path):
    """What serve calls the server (launch.base_url) is what the bench and the printed curl use: http://::1:8000
    is no URL (httpx raises InvalidURL, curl refuses it)."""
    r = _run([BASH, "install.sh", "--dry-run", "-y", "--host", "::1", "--bench", "--work", str(tmp_path / "w")],
             fakebin, ONESPARK_VENV=str(tmp_path / "venv"))
    assert r.returncode == 0, r.stderr
    bench = next(shlex.split(ln[2:]) for ln in r.stdout.splitlines() if ln.startswith("+ ") and " bench " in ln)
    assert _flag(bench, "--base-url") == ["http://[::1]:8000"], bench
    assert "curl http://[::1]:8000/v1/chat/completions" in r.stdout and "http://::1" not in r.stdout


@pytest.mark.parametrize("script", ["install.sh", "steps/3-base-image.sh"])
def test_an_option_with_an_equals_sign_is_refused_without_its_value(fakebin, script):
    r = _run([BASH, script, "--api-key=s3cret-value", "--dry-run"], fakebin)
    assert r.returncode == 2
    assert "s3cret" not in r.stdout + r.stderr
    assert r.stderr.splitlines()[0] == ("onespark: error: unknown option: --api-key=... (an option's value is the "
                                        "next word: --api-key VALUE)"), r.stderr


def test_demo_resumes_a_synth_that_was_interrupted(fakebin, tmp_path):
    """onespark synth resumes a killed run from its progress record; install.sh skipped it when the directory
    existed, so step 1 then read half a checkpoint."""
    from onespark.checkpoint.synth import PROGRESS_FILE

    work = tmp_path / "demo"
    (work / "int4").mkdir(parents=True)
    (work / "int4" / PROGRESS_FILE).write_text('{"fingerprint": "f", "done": {}}')
    (work / "fp8").mkdir()
    (work / "fp8" / "config.json").write_text("{}")  # a finished synth: config.json written, record removed
    r = _run([BASH, "install.sh", "--demo", "--dry-run", "-y", "--work", str(work)], fakebin,
             ONESPARK_VENV=str(tmp_path / "venv"))
    assert r.returncode == 0, r.stderr
    assert f"synth --model qwen3.5-122b-a10b --format int4 --out {work}/int4" in r.stdout
    assert "--format fp8" not in r.stdout


def test_dry_run_prints_the_spark_plan_and_runs_nothing(fakebin, tmp_path):
    """The plan of the plain command a user runs, end to end: the build, the launch, then the curl to try."""
    _fake_docker(fakebin)
    venv, work = tmp_path / "venv", tmp_path / "work"
    r = _run([BASH, "install.sh", "--dry-run", "-y", "--work", str(work)], fakebin, ONESPARK_VENV=str(venv),
             XDG_STATE_HOME=str(tmp_path / "state"))
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "no GB10" in out and "./install.sh --demo" in out
    in_order(out, [
        f"python3 -m venv {venv}",
        f"{venv}/bin/onespark doctor --work {work}",
        "steps/0-download.sh", "steps/1-hybrid.sh", "steps/2-mtp.sh",
        # the default track: official wheels, no compile (issue 55)
        "steps/3-base-image.sh --vllm 0.32.0", "--target vllm-wheels",
        "-f Dockerfile.base -t onespark/vllm-base:0.32.0-cu130-sm121",
        "--build-arg VLLM_BASE=onespark/vllm-base:0.32.0-cu130-sm121 --build-arg VLLM_VERSION=0.32.0",
        f"-f Dockerfile.v2 -t onespark/v2:{__version__} .",
        f"{venv}/bin/onespark serve --host 127.0.0.1 --port 8000 --replace",
        "docker run -d --name onespark --network host",
        "--gpus all", f"onespark/v2:{__version__} --host 127.0.0.1 --port 8000",
    ])
    # Its last lines: the request to try (the spec's served name) and where the logs are.
    assert out.splitlines()[-4:] == [
        "onespark: (dry run) then the server answers on http://127.0.0.1:8000/v1 (model qwen3.5-122b-a10b). Try:",
        "  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\",
        """    -d '{"model": "qwen3.5-122b-a10b", "messages": [{"role": "user", "content": "Hello"}]}'""",
        f"onespark: logs: docker logs -f onespark (the server), {tmp_path}/state/onespark/guard-onespark.log (its "
        "memory guard); stop: docker rm -f onespark",
    ]
    # The wheels stage needs no BuildKit (CI's classic builder builds it); the source build's does.
    assert "DOCKER_BUILDKIT" not in out and "MAX_JOBS" not in out and "vllm-base:0.19.1" not in out
    assert "--replace --image" not in out  # the default track's images are serve's defaults
    # Nothing ran: no docker call, no sudo, no venv, no work directory.
    assert _calls(fakebin) == []
    assert not venv.exists() and not work.exists()


def test_launch_is_the_default_and_no_launch_stops_after_the_images(fakebin, tmp_path):
    """Issue 25: ./install.sh serves; --launch (what older docs say) changes nothing; --no-launch builds and then
    names the one command that starts the server, and why it did not."""
    venv, work = tmp_path / "venv", tmp_path / "work"
    plan = lambda *a: _run([BASH, "install.sh", "--dry-run", "-y", "--work", str(work), *a], fakebin,  # noqa: E731
                           ONESPARK_VENV=str(venv))
    plain, alias, built = plan(), plan("--launch"), plan("--no-launch")
    assert plain.returncode == alias.returncode == built.returncode == 0, plain.stderr + built.stderr
    assert alias.stdout == plain.stdout and "docker run -d --name onespark" in plain.stdout
    assert f"-f Dockerfile.v2 -t onespark/v2:{__version__}" in built.stdout
    assert "docker run" not in built.stdout and "curl" not in built.stdout
    assert built.stdout.splitlines()[-3:] == [
        "onespark: the server is not started (--no-launch). Start it with:",
        f"  {venv}/bin/onespark serve --host 127.0.0.1 --port 8000 --replace --checkpoint {work}/hybrid "
        "--model qwen3.5-122b-a10b",
        "onespark: (or ./install.sh again without --no-launch: the finished steps are skipped)",
    ]
    for argv, message in ((["--bench"], "--bench measures the server: drop --no-launch"),
                          (["--nodes", "spark1,spark2"], "--nodes starts the server on both Sparks: drop --no-launch")):
        r = plan("--no-launch", *argv)
        assert r.returncode == 2 and r.stderr.splitlines() == [f"onespark: error: {message}"], r.stderr
    assert _calls(fakebin) == [] and not venv.exists() and not work.exists()


def test_demo_dry_run_ends_with_the_bench_and_the_tiny_models_curl(fakebin, tmp_path):
    r = _run([BASH, "install.sh", "--dry-run", "--demo", "--port", "8123", "--work", str(tmp_path / "w")], fakebin,
             ONESPARK_VENV=str(tmp_path / "venv"))
    assert r.returncode == 0, r.stderr
    in_order(r.stdout, ["serve --host 127.0.0.1 --port 8123 --replace --demo", "bench --base-url http://127.0.0.1:8123",
                        "the server answers on http://127.0.0.1:8123/v1 (model onespark-tiny)",
                        "curl http://127.0.0.1:8123/v1/chat/completions", '"model": "onespark-tiny"',
                        "docker logs -f onespark"])
    built = _run([BASH, "install.sh", "--dry-run", "--demo", "--no-launch", "--work", str(tmp_path / "w")], fakebin,
                 ONESPARK_VENV=str(tmp_path / "venv"))
    assert built.returncode == 0 and "onespark-demo/v2:" in built.stdout, built.stderr
    assert "bench --base-url" not in built.stdout and "docker run" not in built.stdout


def test_dry_run_on_a_spark_has_no_demo_note(fakebin):
    _script(fakebin["dir"] / "nvidia-smi", 'echo "12.1"\n')
    r = _run([BASH, "install.sh", "--dry-run"], fakebin, ONESPARK_VENV=str(fakebin["dir"].parent / "v"))
    assert r.returncode == 0, r.stderr
    assert "no GB10" not in r.stdout


def test_api_key_never_printed(fakebin):
    secret = "sk-test-4f9c2e"
    r = _run([BASH, "install.sh", "--dry-run", "--launch", "--api-key", secret], fakebin,
             ONESPARK_VENV=str(fakebin["dir"].parent / "v"))
    assert r.returncode == 0, r.stderr
    assert secret not in r.stdout + r.stderr
    # the curl to try sends the key from the user's environment, by name
    assert '-H "Authorization: Bearer $ONESPARK_API_KEY"' in r.stdout


# Every shell option that takes a value, as the last word and followed by another option. Before: bash's
# `${2:?}` printed "install.sh: line 65: 2: --host needs a value"; `--work --demo` took "--demo" as the directory.
VALUE_FLAGS = [
    ("install.sh", "--host"), ("install.sh", "--port"), ("install.sh", "--api-key"), ("install.sh", "--work"),
    ("install.sh", "--vllm"), ("steps/0-download.sh", "--work"), ("steps/0-download.sh", "--int4-revision"),
    ("steps/1-hybrid.sh", "--work"), ("steps/2-mtp.sh", "--work"), ("steps/3-base-image.sh", "--tag"),
    ("steps/3-base-image.sh", "--vllm"), ("steps/3-base-image.sh", "--max-jobs"), ("steps/4-images.sh", "--base"),
    ("steps/4-images.sh", "--vllm"), ("demo/rootfs.sh", "--mirror"),
]


@pytest.mark.parametrize("script, flag", VALUE_FLAGS, ids=[f"{s}{f}" for s, f in VALUE_FLAGS])
@pytest.mark.parametrize("where", ["last", "before-option"])
def test_flag_missing_its_value_is_named(fakebin, script, flag, where):
    argv = [BASH, script, flag] + (["--dry-run"] if where == "before-option" else [])
    r = _run(argv, fakebin)
    assert r.returncode == 2, r.stdout + r.stderr
    want = f"onespark: error: {flag} needs a value" + (", got the option --dry-run" if where == "before-option" else "")
    assert r.stderr.splitlines() == [f"{want} (see {script} --help)"], r.stderr
    assert _calls(fakebin) == []


@pytest.mark.parametrize("script", ["install.sh", "steps/3-base-image.sh", "steps/4-images.sh"])
def test_unknown_vllm_track_is_one_line(fakebin, script):
    r = _run([BASH, script, "--vllm", "0.23.0", "--dry-run"], fakebin)
    assert r.returncode == 2
    assert r.stderr.splitlines() == ["onespark: error: --vllm must be one of 0.19.1 0.32.0, got '0.23.0'"], r.stderr
    assert _calls(fakebin) == []


def test_dry_run_prints_the_019_plan(fakebin, tmp_path):
    """--vllm 0.19.1: the source build, said before it starts; its images carry the version in the tag."""
    venv, work = tmp_path / "venv", tmp_path / "work"
    r = _run([BASH, "install.sh", "--dry-run", "--vllm", "0.19.1", "--launch", "--work", str(work)], fakebin,
             ONESPARK_VENV=str(venv))
    assert r.returncode == 0, r.stderr
    out = r.stdout
    v2 = f"onespark/v2:{__version__}-vllm0.19.1"
    in_order(out, [
        "vLLM 0.19.1", "steps/0-download.sh", "steps/2-mtp.sh",
        "note: --vllm 0.19.1 builds vLLM from source: about an hour the first time, and this build has never been "
        "completed on arm64 by this project", "steps/3-base-image.sh --vllm 0.19.1", "DOCKER_BUILDKIT=1", "--target vllm-base",
        "-f Dockerfile.base -t onespark/vllm-base:0.19.1-cu130-sm121",
        "steps/4-images.sh --vllm 0.19.1", "--build-arg VLLM_BASE=onespark/vllm-base:0.19.1-cu130-sm121 "
        "--build-arg VLLM_VERSION=0.19.1", f"-f Dockerfile.v2 -t {v2}",
        f"serve --host 127.0.0.1 --port 8000 --replace --image {v2}", f"{v2} --host 127.0.0.1 --port 8000",
    ])
    assert "--target vllm-wheels" not in out and "vllm-base:0.32.0" not in out
    assert re.search(r"onespark doctor --work \S+ --model \S+ --vllm 0\.19\.1\s", out), out  # its base's disk
    assert _calls(fakebin) == [] and not venv.exists() and not work.exists()
    tq = _run([BASH, "steps/4-images.sh", "--dry-run", "--vllm", "0.19.1", "--tq"], fakebin)
    assert tq.returncode == 0 and f"-t onespark/v2-tq:{__version__}-vllm0.19.1" in tq.stdout, tq.stderr
    tq = _run([BASH, "steps/4-images.sh", "--dry-run", "--tq"], fakebin)  # the default track's v2-tq
    assert tq.returncode == 0 and f"-t onespark/v2-tq:{__version__} ." in tq.stdout, tq.stderr


def test_dry_run_prints_both_demo_plans(fakebin, tmp_path):
    r = _run([BASH, "install.sh", "--dry-run", "--demo", "--work", str(tmp_path / "w")], fakebin,
             ONESPARK_VENV=str(tmp_path / "venv"))
    assert r.returncode == 0, r.stderr
    in_order(r.stdout, [
        "demo/rootfs.sh", "--build-arg VLLM_VERSION=0.32.0 --build-arg TORCH_VERSION=2.13.0 "
        "--build-arg REQUIREMENTS=tests/requirements-032.txt --build-arg OVERRIDES=tests/overrides-032.txt",
        "-f demo/Dockerfile.cpu-base -t onespark-demo/vllm-cpu:0.32.0",
        "--build-arg VLLM_BASE=onespark-demo/vllm-cpu:0.32.0 --build-arg VLLM_VERSION=0.32.0",
        f"-t onespark-demo/v2:{__version__} .", "tiny-qwen3.5-moe",
    ])
    assert "--replace --image" not in r.stdout
    # the source-build track's demo: its own stand-in and tag
    r = _run([BASH, "install.sh", "--dry-run", "--demo", "--vllm", "0.19.1", "--work", str(tmp_path / "w")], fakebin,
             ONESPARK_VENV=str(tmp_path / "venv"))
    v2 = f"onespark-demo/v2:{__version__}-vllm0.19.1"
    assert "-t onespark-demo/vllm-cpu:0.19.1" in r.stdout and "REQUIREMENTS=tests/requirements.txt" in r.stdout
    assert f"-t {v2} ." in r.stdout and f"--replace --image {v2}" in r.stdout


def test_a_rebuild_removes_the_images_it_replaced_children_first(fakebin):
    """steps/lib.sh drop_replaced after a rebuild; v2-tq's old image before v2's, since Docker's classic builder
    keeps a parent while its child exists (a real engine: tests/test_images.py)."""
    _fake_docker(fakebin)
    assert _run([BASH, "steps/3-base-image.sh"], fakebin).returncode == 0  # image 1
    first = _run([BASH, "steps/4-images.sh", "--tq"], fakebin)  # v2: 2, v2-tq: 3
    assert first.returncode == 0 and "removed the image" not in first.stdout, first.stdout + first.stderr
    again = _run([BASH, "steps/4-images.sh", "--tq", "--no-cache"], fakebin)  # v2: 4, v2-tq: 5
    assert again.returncode == 0, again.stderr
    assert [c for c in _calls(fakebin) if c.startswith("docker image rm")] == [
        f"docker image rm sha256:{3:064x}", f"docker image rm sha256:{2:064x}"]
    assert f"removed the image onespark/v2-tq:{__version__} named before this build ({3:064x})" in again.stdout


def test_step4_refuses_a_base_of_the_other_track(fakebin):
    state = _fake_docker(fakebin)
    assert _run([BASH, "steps/3-base-image.sh", "--vllm", "0.19.1"], fakebin).returncode == 0  # the 0.19.1 base
    builds = lambda: [c for c in _calls(fakebin) if c.startswith("docker build")]  # noqa: E731
    assert "--label dev.onespark.vllm.track=0.19.1" in builds()[0]
    r = _run([BASH, "steps/4-images.sh", "--vllm", "0.32.0", "--base", "onespark/vllm-base:0.19.1-cu130-sm121"], fakebin)
    assert r.returncode == 1 and len(builds()) == 1, r.stdout + r.stderr
    assert r.stderr.splitlines() == ["onespark: error: onespark/vllm-base:0.19.1-cu130-sm121 is a vLLM 0.19.1 base, "
                                     "not 0.32.0: pass --vllm 0.19.1, or build the 0.32.0 base first "
                                     "(steps/3-base-image.sh --vllm 0.32.0)"]
    # a base built before the label existed
    labels = json.loads(state.read_text())
    labels["old/base:1"] = {"dev.onespark.fingerprint": "x"}
    state.write_text(json.dumps(labels))
    r = _run([BASH, "steps/4-images.sh", "--vllm", "0.19.1", "--base", "old/base:1"], fakebin)
    assert r.returncode == 1 and "old/base:1 has no dev.onespark.vllm.track label" in r.stderr and len(builds()) == 1
    # the matching track builds, and v2 carries the track for v2-tq's check
    assert _run([BASH, "steps/3-base-image.sh", "--vllm", "0.32.0"], fakebin).returncode == 0
    r = _run([BASH, "steps/4-images.sh", "--vllm", "0.32.0"], fakebin)
    assert r.returncode == 0, r.stderr
    assert f"-t onespark/v2:{__version__} ." in builds()[-1] and "VLLM_VERSION=0.32.0" in builds()[-1]
    assert json.loads(state.read_text())[f"onespark/v2:{__version__}"]["dev.onespark.vllm.track"] == "0.32.0"
    # the default (0.32.0) v2 on the 0.19.1 base is refused too
    r = _run([BASH, "steps/4-images.sh", "--base", "onespark/vllm-base:0.19.1-cu130-sm121", "--tag", "x/v2:1"], fakebin)
    assert r.returncode == 1 and "is a vLLM 0.19.1 base, not 0.32.0" in r.stderr, r.stderr


def test_step3_from_a_stand_in_needs_a_tag(fakebin):
    _fake_docker(fakebin)
    r = _run([BASH, "steps/3-base-image.sh", "--vllm", "0.32.0", "--from", "onespark-demo/debian:bookworm"], fakebin)
    assert r.returncode == 2 and "--from needs --tag" in r.stderr and _calls(fakebin) == []


# ---------------------------------------------------------------------------------------------------------
# steps 3-4: skip when the labelled image exists, rebuild when an input changes

def test_step3_builds_then_skips_then_rebuilds(fakebin):
    _fake_docker(fakebin)
    first = _run([BASH, "steps/3-base-image.sh", "--vllm", "0.19.1"], fakebin)
    assert first.returncode == 0, first.stderr
    builds = [c for c in _calls(fakebin) if c.startswith("docker build")]
    assert len(builds) == 1 and "--target vllm-base" in builds[0] and "--network host" in builds[0]
    assert "timing:" in first.stdout

    again = _run([BASH, "steps/3-base-image.sh", "--vllm", "0.19.1"], fakebin)
    assert "up to date" in again.stdout and "skipping" in again.stdout
    assert len([c for c in _calls(fakebin) if c.startswith("docker build")]) == 1

    # A different build input (compile jobs) is a different image: rebuilt.
    _run([BASH, "steps/3-base-image.sh", "--vllm", "0.19.1", "--max-jobs", "6"], fakebin)
    builds = [c for c in _calls(fakebin) if c.startswith("docker build")]
    assert len(builds) == 2 and "MAX_JOBS=6" in builds[1]

    forced = _run([BASH, "steps/3-base-image.sh", "--vllm", "0.19.1", "--max-jobs", "6", "--no-cache"], fakebin)
    assert forced.returncode == 0
    builds = [c for c in _calls(fakebin) if c.startswith("docker build")]
    assert len(builds) == 3 and "--no-cache" in builds[2]


def test_step4_needs_the_base_and_chains_tq(fakebin):
    _fake_docker(fakebin)
    r = _run([BASH, "steps/4-images.sh"], fakebin)
    assert r.returncode != 0 and "run steps/3-base-image.sh first" in r.stderr
    _run([BASH, "steps/3-base-image.sh"], fakebin)
    r = _run([BASH, "steps/4-images.sh", "--tq"], fakebin)
    assert r.returncode == 0, r.stderr
    builds = [c for c in _calls(fakebin) if c.startswith("docker build")]
    assert "VLLM_BASE=onespark/vllm-base:0.32.0-cu130-sm121" in builds[1] and "-f Dockerfile.v2 " in builds[1]
    assert f"ONESPARK_V2=onespark/v2:{__version__}" in builds[2] and f"-t onespark/v2-tq:{__version__}" in builds[2]
    r = _run([BASH, "steps/4-images.sh", "--tq"], fakebin)
    assert r.stdout.count("up to date") == 2


SCRIPTS = ["install.sh", "steps/0-download.sh", "steps/1-hybrid.sh", "steps/2-mtp.sh", "steps/3-base-image.sh",
           "steps/4-images.sh", "demo/rootfs.sh"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_step_help_and_bad_option(fakebin, script):
    r = _run([BASH, script, "--help"], fakebin)
    assert r.returncode == 0 and r.stdout.startswith("usage:") and "default" in r.stdout and "--dry-run" in r.stdout
    r = _run([BASH, script, "--nope"], fakebin)
    assert r.returncode == 2 and r.stdout == "", r.stdout
    assert r.stderr.splitlines()[0] == "onespark: error: unknown option: --nope"
    assert r.stderr.splitlines()[1].startswith("usage:")


@pytest.mark.parametrize("script", SCRIPTS)
def test_one_option_loop_and_one_ending(script):
    """steps/lib.sh parse_options is every script's option loop; `main "$@" || exit 1` its last line, so that a
    file cut short by a download never runs half a script."""
    text = (ROOT / script).read_text()
    assert "parse_options " in text and "while (($#))" not in text
    assert text.rstrip("\n").splitlines()[-1] == 'main "$@" || exit 1'


def test_step4_tq_needs_a_tag_it_can_name_v2_tq(fakebin):
    """--tq builds v2-tq as the --tag with /v2: replaced by /v2-tq:; a tag without /v2: made both images one tag,
    v2-tq overwriting v2 (and each re-run rebuilding both)."""
    r = _run([BASH, "steps/4-images.sh", "--tq", "--tag", "my/img:1", "--dry-run"], fakebin)
    assert r.returncode == 2 and r.stdout == "", r.stdout
    assert r.stderr.splitlines() == ["onespark: error: --tq with --tag my/img:1: the v2-tq image is named after the "
                                     "tag with /v2: replaced by /v2-tq:, so give a tag of the form REPO/v2:TAG"], r.stderr
    r = _run([BASH, "steps/4-images.sh", "--tq", "--tag", "my/v2:1", "--dry-run"], fakebin)
    assert r.returncode == 0, r.stderr
    assert "-t my/v2:1 ." in r.stdout and "-t my/v2-tq:1 ." in r.stdout


# ---------------------------------------------------------------------------------------------------------
# docker/entrypoint.sh: defaults, and the user's flags replacing them

def _entry(*args, **env) -> list[str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("ONESPARK_")}
    e.update(ONESPARK_PRINT_ONLY="1", **env)
    r = subprocess.run([BASH, str(ROOT / "docker/entrypoint.sh"), *args], env=e, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


def _flag(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_entrypoint_defaults():
    argv = _entry()
    assert argv[:5] == ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/model"]
    assert _flag(argv, "--attention-backend") == ["FLASHINFER"]
    assert json.loads(_flag(argv, "--speculative-config")[0]) == {"method": "mtp", "num_speculative_tokens": 2}
    assert _flag(argv, "--load-format") == ["fastsafetensors"]
    assert _flag(argv, "--gpu-memory-utilization") == ["0.82"]
    assert _flag(argv, "--max-model-len") == ["262144"]
    assert _flag(argv, "--reasoning-parser") == ["qwen3"] and _flag(argv, "--tool-call-parser") == ["qwen3_xml"]
    assert _flag(argv, "--host") == ["127.0.0.1"]


def test_entrypoint_user_flags_replace_defaults():
    argv = _entry("--max-model-len", "65536", "--gpu-memory-utilization=0.7", "--speculative-config", "{}")
    assert _flag(argv, "--max-model-len") == ["65536"]
    assert "--gpu-memory-utilization" not in argv and "--gpu-memory-utilization=0.7" in argv
    assert _flag(argv, "--speculative-config") == ["{}"]
    assert _flag(argv, "--attention-backend") == ["FLASHINFER"]  # untouched defaults stay


def test_entrypoint_drop_and_extra():
    argv = _entry(ONESPARK_DROP_DEFAULTS="--attention-backend --enable-auto-tool-choice")
    assert "--attention-backend" not in argv and "FLASHINFER" not in argv
    assert "--enable-auto-tool-choice" not in argv and _flag(argv, "--tool-call-parser") == ["qwen3_xml"]
    argv = _entry(ONESPARK_DROP_DEFAULTS="all")
    assert argv == ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/model"]
    argv = _entry(ONESPARK_EXTRA_DEFAULTS="--kv-cache-dtype fp8 --enable-prefix-caching")
    assert _flag(argv, "--kv-cache-dtype") == ["fp8"] and "--enable-prefix-caching" in argv
    argv = _entry("--kv-cache-dtype", "auto", ONESPARK_EXTRA_DEFAULTS="--kv-cache-dtype fp8")
    assert _flag(argv, "--kv-cache-dtype") == ["auto"]
    # an extra default that repeats a built-in one replaces it (Dockerfile.v2-tq: --attention-backend CUSTOM)
    argv = _entry(ONESPARK_EXTRA_DEFAULTS="--attention-backend CUSTOM --kv-cache-dtype turboquant_k4v4")
    assert _flag(argv, "--attention-backend") == ["CUSTOM"] and _flag(argv, "--kv-cache-dtype") == ["turboquant_k4v4"]
    argv = _entry("--attention-backend", "FLASHINFER", ONESPARK_EXTRA_DEFAULTS="--attention-backend CUSTOM")
    assert _flag(argv, "--attention-backend") == ["FLASHINFER"]


def test_entrypoint_extra_defaults_with_a_quote_is_one_line():
    """ONESPARK_EXTRA_DEFAULTS is split at blanks, quotes are not read: a quoted value with spaces reached vLLM in
    pieces (`'{"method":` as --speculative-config, `"mtp",` as a stray word)."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("ONESPARK_")}
    e.update(ONESPARK_PRINT_ONLY="1",
             ONESPARK_EXTRA_DEFAULTS="--speculative-config '{\"method\": \"mtp\", \"num_speculative_tokens\": 3}'")
    r = subprocess.run([BASH, str(ROOT / "docker/entrypoint.sh")], env=e, capture_output=True, text=True)
    assert r.returncode == 2 and r.stdout == "", r.stdout
    assert r.stderr.splitlines() == [
        "onespark: error: ONESPARK_EXTRA_DEFAULTS quotes a word ('{\"method\":); its words are split at blanks and "
        "quotes are not read: write a JSON value without spaces, or pass the flag after the image "
        "(docker run IMAGE --flag 'value')"]
    argv = _entry(ONESPARK_EXTRA_DEFAULTS='--speculative-config {"method":"mtp","num_speculative_tokens":3}')
    assert _flag(argv, "--speculative-config") == ['{"method":"mtp","num_speculative_tokens":3}']


@pytest.mark.vllm
def test_entrypoint_defaults_parse_with_vllm():
    """The default command line is valid for vLLM 0.19.1's own `serve` argument parser (names, choices)."""
    pytest.importorskip("vllm")
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = _entry()[3:]  # after `python -m vllm.entrypoints.openai.api_server`
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    assert args.model == "/model"
    assert str(args.attention_backend).endswith("FLASHINFER")
    assert args.speculative_config == {"method": "mtp", "num_speculative_tokens": 2}
    assert args.load_format == "fastsafetensors" and args.gpu_memory_utilization == 0.82
    assert args.max_model_len == 262144 and args.enable_auto_tool_choice
    assert args.reasoning_parser == "qwen3" and args.tool_call_parser == "qwen3_xml"


# ---------------------------------------------------------------------------------------------------------
# onespark doctor

def _meminfo(tmp_path, total_gib, avail_gib) -> str:
    p = tmp_path / "meminfo"
    p.write_text(f"MemTotal: {total_gib * 1024 ** 2} kB\nMemFree: 1 kB\nMemAvailable: {avail_gib * 1024 ** 2} kB\n")
    return str(p)


def _doctor(fb, tmp_path, monkeypatch, *, demo=False, total=119, avail=115, track=None):
    monkeypatch.setenv("PATH", fb["path"])
    p = argparse.ArgumentParser(prog="onespark doctor")
    doctor.add_arguments(p)
    args = p.parse_args(["--work", str(tmp_path / "work"), "--skip-hf", "--meminfo", _meminfo(tmp_path, total, avail),
                         *(["--demo"] if demo else []), *(["--vllm", track] if track else [])])
    return {c.name: c for c in doctor.run_checks(doctor.Preflight.from_args(args))}, args


def test_doctor_on_a_spark(fakebin, tmp_path, monkeypatch, capsys):
    _script(fakebin["dir"] / "nvidia-smi", 'echo "NVIDIA GB10, 12.1, 580.95.05"\n')
    _fake_docker(fakebin, runtimes='{"nvidia":{"path":"nvidia-container-runtime"},"runc":{}}')
    checks, args = _doctor(fakebin, tmp_path, monkeypatch)
    for name in ("GPU", "driver", "Docker", "NVIDIA runtime", "buildx", "memory"):
        assert checks[name].status == "ok", checks[name]
    assert "GB10" in checks["GPU"].detail and "12.1" in checks["GPU"].detail
    # Disk: the real free space of this machine against the 150 GB the checkpoint steps write.
    free_gb = shutil.disk_usage(tmp_path).free / 1e9
    disk = checks["disk (checkpoints)"]
    reported = float(re.match(r"(\d+) GB free", disk.detail).group(1))
    assert abs(reported - free_gb) < 3, (disk.detail, free_gb)  # others write to this disk meanwhile
    assert f"need {doctor.CHECKPOINT_DISK_GB} GB more" in disk.detail  # empty work directory: all of it
    assert disk.status == ("ok" if reported >= doctor.CHECKPOINT_DISK_GB else "FAIL")
    rc = doctor.run(args)
    assert rc == (0 if reported >= doctor.CHECKPOINT_DISK_GB else 1)
    assert not [c for c in _calls(fakebin) if c.startswith(("sudo", "apt-get"))]


def test_doctor_names_the_fix(fakebin, tmp_path, monkeypatch, capsys):
    _script(fakebin["dir"] / "nvidia-smi", 'echo "NVIDIA H100 80GB HBM3, 9.0, 550.54.15"\n')
    _fake_docker(fakebin, buildx=False)
    checks, args = _doctor(fakebin, tmp_path, monkeypatch, total=62, avail=60)
    assert checks["GPU"].status == "FAIL" and "./install.sh --demo" in checks["GPU"].fix
    assert checks["driver"].status == "FAIL" and ">= 580" in checks["driver"].detail
    assert checks["NVIDIA runtime"].status == "FAIL" and "nvidia-ctk runtime configure" in checks["NVIDIA runtime"].fix
    assert checks["buildx"].status == "FAIL" and "docker-buildx-plugin" in checks["buildx"].fix
    assert checks["memory"].status == "FAIL"
    assert doctor.run(args) == 1
    out = capsys.readouterr().out
    assert "fix: sudo apt-get install -y nvidia-container-toolkit" in out
    assert not [c for c in _calls(fakebin) if c.startswith(("sudo", "apt-get"))]  # printed, never run


def test_doctor_docker_permission_and_missing(fakebin, tmp_path, monkeypatch):
    _fake_docker(fakebin, fail_daemon="permission denied while trying to connect to the Docker daemon socket")
    checks, _ = _doctor(fakebin, tmp_path, monkeypatch, demo=True)
    assert checks["Docker"].status == "FAIL" and "usermod -aG docker" in checks["Docker"].fix
    (fakebin["dir"] / "docker").unlink()
    monkeypatch.setenv("PATH", str(fakebin["dir"]))  # no docker anywhere
    checks = {c.name: c for c in doctor.check_docker(nvidia=False)}
    assert checks["Docker"].status == "FAIL" and "not found" in checks["Docker"].detail


def test_doctor_demo_needs_no_gpu(fakebin, tmp_path, monkeypatch):
    _fake_docker(fakebin)
    state = fakebin["dir"].parent / "docker-state.json"
    state.write_text(json.dumps({"onespark-demo/debian:bookworm": ""}))
    checks, _ = _doctor(fakebin, tmp_path, monkeypatch, demo=True, total=23, avail=20)
    assert "GPU" not in checks and checks["Docker"].status == "ok"
    assert checks["memory"].status == "ok" and checks["debootstrap"].status == "ok"


@pytest.mark.parametrize("demo", [True, False], ids=["demo", "spark"])
@pytest.mark.parametrize("track", ["0.19.1", "0.32.0"])
def test_doctor_docker_disk_counts_the_tracks_own_base(fakebin, tmp_path, monkeypatch, track, demo):
    """With the track's base image built, step 4 adds only v2 and v2-tq's layers: 9.6 GB free is enough. (A CI machine
    with both demo bases built had 9.6 GB left and failed: doctor asked 10 GB whatever the base, and looked for the
    0.19.1 base on every track.) Another track's base does not count."""
    other = "0.32.0" if track == "0.19.1" else "0.19.1"
    # the names steps 3-4 build (their dry runs above print the same tags)
    base = f"onespark-demo/vllm-cpu:{track}" if demo else f"onespark/vllm-base:{track}-cu130-sm121"
    assert doctor.base_image(track, demo=demo) == base
    _fake_docker(fakebin)
    state = fakebin["dir"].parent / "docker-state.json"
    images = {"onespark-demo/debian:bookworm": "", doctor.base_image(other, demo=demo): ""}
    state.write_text(json.dumps(images))
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(doctor.shutil, "disk_usage", lambda path: usage._replace(free=int(9.6e9)))
    checks, _ = _doctor(fakebin, tmp_path, monkeypatch, demo=demo, track=track)
    disk = checks["disk (Docker)"]
    need = doctor.DEMO_DOCKER_DISK_GB if demo else doctor.DOCKER_DISK_GB
    assert disk.status == "FAIL" and "docker system prune" in disk.fix, disk
    assert disk.detail == f"9.6 GB free at /var/lib/docker, the images need {need} GB"
    state.write_text(json.dumps({**images, base: ""}))
    checks, _ = _doctor(fakebin, tmp_path, monkeypatch, demo=demo, track=track)
    disk = checks["disk (Docker)"]
    assert disk.status == "ok", disk
    assert disk.detail == f"9.6 GB free at /var/lib/docker, v2 and v2-tq on {base} need {doctor.LAYERS_DISK_GB} GB"


# ---------------------------------------------------------------------------------------------------------
# onespark serve: the docker command, stage detection, likely causes

def _serve_args(tmp_path, *extra) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    return p.parse_args(["--checkpoint", str(model), *extra])


def test_serve_command_spark(tmp_path):
    args = _serve_args(tmp_path, "--api-key", "sk-secret", "--", "--max-model-len", "65536")
    cmd, env = serve.docker_run_command(args, serve.V2_IMAGE)
    assert cmd[:3] == ["docker", "run", "-d"] and ["--network", "host"] == cmd[5:7]
    assert "--gpus" in cmd and f"{tmp_path / 'model'}:/model:ro" in cmd
    assert "sk-secret" not in " ".join(cmd) and env["VLLM_API_KEY"] == "sk-secret"
    assert cmd[cmd.index("-e", cmd.index("VLLM_API_KEY") - 1) + 1] == "VLLM_API_KEY"
    tail = cmd[cmd.index(serve.V2_IMAGE):]
    assert tail == [serve.V2_IMAGE, "--host", "127.0.0.1", "--port", "8000", "--max-model-len", "65536"]


def test_serve_keeps_the_compile_caches_in_a_named_volume(tmp_path):
    """The container's ~/.cache (vLLM's, Triton's and FlashInfer's compile caches: the image points them there) is a
    Docker named volume, so the next container starts without compiling again; `none` runs without one."""
    cmd, _ = serve.docker_run_command(_serve_args(tmp_path), serve.V2_IMAGE)
    mounts = [cmd[i + 1] for i, a in enumerate(cmd[:cmd.index(serve.V2_IMAGE)]) if a == "-v"]
    assert mounts == [f"{tmp_path / 'model'}:/model:ro", "onespark-cache:/root/.cache"]
    cmd, _ = serve.docker_run_command(_serve_args(tmp_path, "--cache-volume", "my.cache-2"), serve.V2_IMAGE)
    assert "my.cache-2:/root/.cache" in cmd
    cmd, _ = serve.docker_run_command(_serve_args(tmp_path, "--cache-volume", "none"), serve.V2_IMAGE)
    assert not any(a.endswith(":/root/.cache") for a in cmd)
    dockerfile = (Path(__file__).resolve().parents[1] / "Dockerfile.v2").read_text()
    for env in ("VLLM_CACHE_ROOT=/root/.cache/vllm", "TRITON_CACHE_DIR=/root/.cache/triton", "TRITON_CACHE_AUTOTUNING=1"):
        assert env in dockerfile, env


@pytest.mark.parametrize("bad", ["/etc", "/:/host", "data:/root", "../x", "-v", "a b", "", ".hidden", "x" * 129,
                                 "vol;rm", "$(id)", "naïve"])
def test_serve_refuses_a_cache_volume_that_is_not_a_name(tmp_path, bad):
    """A path or `src:dst` would make the -v flag a bind mount of the host's files: one line, exit 2, nothing run."""
    r = subprocess.run([sys.executable, "-m", "onespark", "serve", "--checkpoint", str(tmp_path), "--dry-run",
                        f"--cache-volume={bad}"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "docker run" not in r.stdout, r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--cache-volume" in lines[0] and "Docker volume name" in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_serve_command_demo(tmp_path):
    cmd, env = serve.docker_run_command(_serve_args(tmp_path, "--demo", "--port", "9123"), serve.DEMO_IMAGE)
    assert "--gpus" not in cmd
    # vLLM 0.32.0's CPU engine needs 160 MiB of /dev/shm; Docker's default 64 MiB stopped it at start-up
    assert cmd[cmd.index("--shm-size") + 1] == "1g" and cmd.index("--shm-size") < cmd.index(serve.DEMO_IMAGE)
    assert "ONESPARK_HEALTH_URL=http://127.0.0.1:9123/health" in cmd
    drop = next(a for a in cmd if a.startswith("ONESPARK_DROP_DEFAULTS=")).split("=", 1)[1].split()
    # Every GPU-only default of the entrypoint is dropped: compare against the entrypoint's real output.
    gpu_only = {"--attention-backend", "--speculative-config", "--load-format", "--gpu-memory-utilization"}
    assert gpu_only <= set(drop)
    kept = _entry(ONESPARK_DROP_DEFAULTS=" ".join(drop))
    assert not gpu_only & set(kept)


def test_serve_refuses_a_non_checkpoint(tmp_path):
    args = _serve_args(tmp_path)
    with pytest.raises(UserError, match="no config.json"):
        serve.run(args)


VLLM_SRC = None


def _vllm_source() -> str:
    """All of this venv's vLLM Python source (0.19.1 or 0.32.0) as one string: the reference for its log messages."""
    global VLLM_SRC
    if VLLM_SRC is None:
        import importlib.util
        spec = importlib.util.find_spec("vllm")  # locates the package without importing it (slow)
        if spec is None:
            pytest.skip("vllm not installed")
        root = Path(spec.origin).parent
        VLLM_SRC = "\n".join(p.read_text(errors="replace") for p in root.rglob("*.py"))
    return VLLM_SRC


@pytest.mark.vllm
@pytest.mark.vllm032  # both tracks: the default one (0.32.0) logs these too
@pytest.mark.parametrize("literal", [
    "Automatically detected platform", "Resolved architecture", "Initializing a V1 LLM engine",
    "Starting to load model", "Loading safetensors checkpoint shards", "Loading weights took",
    "Model loading took", "Dynamo bytecode transform", "Compiling a graph", "torch.compile took",
    "Memory profiling takes", "Available KV cache memory", "Capturing CUDA graphs", "Graph capturing finished",
    "init engine (profile, create kv cache, warmup model) took", "Starting vLLM server on",
])
def test_stage_messages_exist_in_vllm(literal):
    """Every message the progress line keys on is one each track's vLLM really logs."""
    assert literal in _vllm_source()
    assert any(p.search(literal) or p.pattern.split("[")[0].split("|")[0] in literal for p, _ in vllm_log.STAGES)


@pytest.mark.vllm
@pytest.mark.vllm032
@pytest.mark.parametrize("literal", [
    "Invalid repository ID or local directory", "than the derived max_model_len",
    "which is larger than the available KV cache",
])
def test_cause_messages_exist(literal):
    """The likely causes keyed on vLLM's own error messages use words each track's vLLM really prints."""
    assert literal in _vllm_source()
    assert vllm_log.likely_cause("ValueError: " + literal, 1) != vllm_log.likely_cause("ValueError: nothing", 1)


def test_detect_stage_follows_the_log():
    log = textwrap.dedent("""\
        INFO 11-30 06:01:17 [__init__.py:251] Automatically detected platform cuda.
        (APIServer pid=1) INFO [model.py:549] Resolved architecture: Qwen3_5MoeForConditionalGeneration
        (APIServer pid=1) WARNING [vllm.py:848] Enforce eager set, disabling torch.compile and CUDAGraphs.
        (EngineCore pid=29) INFO [gpu_model_runner.py:4736] Starting to load model /model...
        Loading safetensors checkpoint shards:  43% Completed | 6/14 [01:02<01:23, 10.3s/it]
        """)
    assert vllm_log.detect_stage(log) == "loading weights (6/14 shards)"
    log += "(EngineCore pid=29) INFO [default_loader.py:385] Loading weights took 151.20 seconds\n"
    assert vllm_log.detect_stage(log) == "weights loaded"
    log += "(EngineCore pid=29) INFO [backends.py:391] Compiling a graph for compile range (1, 8192) takes 41.2 s\n"
    assert vllm_log.detect_stage(log) == "compiling (torch.compile)"
    log += "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 37%|███ | 19/51 [00:05<00:09]\r"
    assert vllm_log.detect_stage(log) == "capturing CUDA graphs (37%)"
    log += "(APIServer pid=1) INFO [api_server.py:596] Starting vLLM server on http://127.0.0.1:8000\n"
    assert vllm_log.detect_stage(log) == "API server up"
    assert vllm_log.detect_stage("nothing yet\n") is None


@pytest.mark.parametrize("log, code, oom, expect", [
    ("", 137, False, "SIGKILL"),
    ("", 137, False, "dmesg"),
    ("", 0, True, "OOM"),
    ("ImportError: /opt/venv/lib/python3.12/site-packages/vllm/_C.abi3.so: undefined symbol: "
     "_ZN2at4cuda26getCurrentCUDABlasHandleEv", 1, False, "torch ABI mismatch"),
    ("triton.runtime.errors.PTXASError: ptxas fatal   : Value 'sm_121a' is not defined for option 'gpu-name'",
     1, False, "ptxas"),
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", 1, False, "out of memory"),
    ("OSError: [Errno 98] Address already in use", 1, False, "port is taken"),
    ("ValueError: User-specified max_model_len (4096) is greater than the derived max_model_len "
     "(max_position_embeddings=2048 or model_max_length=None in model's config.json).", 1, False,
     "longer than the model's config allows"),
    ("ValueError: To serve at least one request with the models's max seq len (262144), (24.0 GiB KV "
     "cache is needed, which is larger than the available KV cache memory (8.1 GiB).", 1, False,
     "KV cache cannot hold"),
    ("RuntimeError: No CUDA GPUs are available", 1, False, "sees no GPU"),
    ("KeyError: 'mtp.layers.0.mlp.experts.0.down_proj.weight'", 1, False, "MTP"),
    ("ValueError: Invalid repository ID or local directory specified: '/model'", 1, False, "no model at /model"),
    # The start-up config dump names speculative and mtp harmlessly: no false MTP diagnosis.
    ("INFO Initializing a V1 LLM engine with config: speculative_config=SpeculativeConfig(method='mtp')\n"
     "RuntimeError: something else entirely", 1, False, "not recognised"),
])
def test_likely_cause(log, code, oom, expect):
    assert expect in vllm_log.likely_cause(log, code, oom)


# ---------------------------------------------------------------------------------------------------------
# Dockerfile.base's pins against vLLM 0.19.1's own metadata (the vllm-cpu build of the same release)

def _dockerfile_args(path: Path) -> dict[str, str]:
    args = {}
    for line in path.read_text().splitlines():
        m = re.match(r"ARG (\w+)=(\S+)", line)
        if m:
            args[m.group(1)] = m.group(2)
    return args


@pytest.mark.vllm
def test_base_pins_match_vllm_metadata():
    import importlib.metadata as md

    args = _dockerfile_args(ROOT / "Dockerfile.base")
    assert args["VLLM_VERSION"] == md.version("vllm-cpu") == "0.19.1"
    assert re.fullmatch(r"[0-9a-f]{40}", args["VLLM_COMMIT"]) and args["VLLM_TAG"] == "v" + args["VLLM_VERSION"]
    # vllm 0.19.1 asks for torch==2.10.0 on aarch64 (the Spark); the base must install exactly that release.
    aarch64 = [r for r in md.requires("vllm-cpu") if r.startswith("torch==") and "aarch64" in r]
    assert aarch64, md.requires("vllm-cpu")
    assert aarch64[0].split(";")[0] == f"torch=={args['TORCH_VERSION']}"
    assert args["TORCH_CUDA_SUFFIX"] == "cu130" and args["TORCH_INDEX_URL"].endswith("/cu130")
    assert args["TORCH_CUDA_ARCH_LIST"] == "12.1a"
    # torch 2.10.0 declares triton 3.6.0, the version the test lane runs too.
    assert args["TRITON_VERSION"] == md.version("triton")


def test_install_stops_at_preflight_without_a_spark(fakebin, tmp_path):
    """A real run (not --dry-run) on a machine without a GB10: doctor fails, nothing is built or downloaded."""
    _fake_docker(fakebin)
    venv = Path(sys.executable).parent.parent  # tests/run.sh's venv has this checkout installed
    r = _run([BASH, "install.sh", "-y", "--work", str(tmp_path / "work")], fakebin, timeout=300,
             ONESPARK_VENV=str(venv), HF_ENDPOINT="http://127.0.0.1:9")  # port 9: refused at once
    assert r.returncode == 1
    assert "FAIL  GPU" in r.stdout and "preflight failed" in r.stderr
    assert "./install.sh --demo" in r.stdout + r.stderr
    assert not [c for c in _calls(fakebin) if c.startswith(("docker build ", "docker run ", "sudo", "apt-get"))]
    assert not (tmp_path / "work").exists()


def test_serve_env_passthrough_for_ab_runs():
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    args = p.parse_args(["--checkpoint", "/tmp/m", "--env", "ONESPARK_INT8_LM_HEAD=0", "--env", "A_B=x=y"])
    cmd, env = serve.docker_run_command(args, "img")
    assert "ONESPARK_INT8_LM_HEAD=0" in cmd and "A_B=x=y" in cmd and env["A_B"] == "x=y"
    for bad in (["--env", "NOVALUE"], ["--env", "1BAD=x"], ["--env", "VLLM_API_KEY=secret"]):
        args = p.parse_args(["--checkpoint", "/tmp/m", *bad])
        with pytest.raises(serve.UserError):
            serve.docker_run_command(args, "img")


# ---------------------------------------------------------------------------------------------------------
# The 0.32.0 track's pins: Dockerfile.base's ARGs, docker/vllm-0.32.0.lock.txt, and PyPI's own resolution

LOCK = ROOT / "docker/vllm-0.32.0.lock.txt"


def _lock_pins(text: str) -> dict[str, list[str]]:
    """name -> ['version ; marker', ...] for every requirement line of a uv lock (hash lines skipped)."""
    pins: dict[str, list[str]] = {}
    for line in text.splitlines():
        m = re.match(r"([A-Za-z0-9_.\-]+)==(\S+)(\s*;\s*([^\\]*?))?\s*\\?$", line)
        if m:
            pins.setdefault(m.group(1).lower(), []).append(m.group(2) + (f" ; {m.group(4)}" if m.group(4) else ""))
    return pins


def test_wheels_pins_match_the_lock():
    args = _dockerfile_args(ROOT / "Dockerfile.base")
    pins = _lock_pins(LOCK.read_text())
    assert pins["vllm"] == [args["WHEELS_VLLM_VERSION"]] == ["0.32.0"]
    assert pins["torch"] == [args["WHEELS_TORCH_VERSION"]]
    assert pins["flashinfer-python"] == [args["WHEELS_FLASHINFER_VERSION"]]
    # Linux (the Spark and CI) gets torch's own triton; uv's universal lock also lists macOS's.
    assert f"{args['WHEELS_TRITON_VERSION']} ; sys_platform != 'darwin'" in pins["triton"], pins["triton"]
    assert args["WHEELS_LOCK"] == LOCK.relative_to(ROOT).as_posix()
    # --require-hashes in the image: every pinned line carries at least one sha256
    blocks = re.split(r"\n(?=[A-Za-z0-9])", LOCK.read_text().split("\n", 2)[2])
    unhashed = [b.split()[0] for b in blocks if re.match(r"[A-Za-z0-9]", b) and "--hash=sha256:" not in b]
    assert not unhashed, unhashed
    # the lock says how it was made, and that is the command the .in file documents
    command = next(line.strip("# ").strip() for line in LOCK.read_text().splitlines() if "uv pip compile" in line)
    assert command in (ROOT / "docker/vllm-0.32.0.in").read_text()


def test_wheels_lock_is_what_pypi_resolves(tmp_path):
    """Re-resolve vllm==0.32.0 from PyPI (metadata only, ~5 s) with the lock's own command, the lock itself as
    constraints: the same pins and the same sha256 set, so the lock is a consistent resolution of vLLM's, torch's
    and FlashInfer's published metadata and its hashes are PyPI's (uv reads each wheel's METADATA). Constrained,
    not fresh: a fresh resolve drifts whenever PyPI shows a release dated before the cutoff that it did not list
    when the lock was made (2026-12-02: httpx 0.29.0, sse-starlette 3.7.1, opencv-python-headless 5.1.0.95, all
    dated before 2026-11-28), which says nothing about the lock."""
    command = next(line.strip("# ").strip() for line in LOCK.read_text().splitlines() if "uv pip compile" in line)
    argv = shlex.split(command)
    argv[argv.index("-o") + 1] = str(tmp_path / "lock.txt")
    r = subprocess.run([sys.executable, "-m", *argv, "-c", str(LOCK)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    if r.returncode != 0 and re.search(r"(?i)connect|dns|network|timed out", r.stderr):
        pytest.skip(f"PyPI not reachable: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr
    got = (tmp_path / "lock.txt").read_text()
    assert _lock_pins(got) == _lock_pins(LOCK.read_text())
    sha = re.compile(r"--hash=(sha256:[0-9a-f]{64})")
    assert set(sha.findall(got)) == set(sha.findall(LOCK.read_text()))


@pytest.mark.parametrize("platform, python", [("aarch64-manylinux_2_39", "3.12"), ("x86_64-manylinux_2_36", "3.11")],
                         ids=["spark-ubuntu24.04-py3.12", "ci-bookworm-py3.11"])
def test_wheels_lock_has_wheels_for_both_images(tmp_path, platform, python):
    """The lock's exact pins resolve from wheels alone (no sdist build) on each image's platform: the Spark's
    (aarch64, Ubuntu 24.04's glibc 2.39, Python 3.12; CI cannot build it) and CI's stand-in (x86_64, bookworm's
    glibc 2.36, Python 3.11). A pin whose wheel is missing there fails here, not in a Spark build."""
    r = subprocess.run([sys.executable, "-m", "uv", "pip", "compile", str(LOCK), "--python-platform", platform,
                        "--python-version", python, "--only-binary", ":all:", "--exclude-newer", "2026-12-01T00:00:00Z",
                        "--no-header", "-o", str(tmp_path / "out.txt")], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    if r.returncode != 0 and re.search(r"(?i)connect|dns|network|timed out", r.stderr):
        pytest.skip(f"PyPI not reachable: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr
    got, lock = _lock_pins((tmp_path / "out.txt").read_text()), _lock_pins(LOCK.read_text())
    assert {"vllm", "torch", "triton", "flashinfer-python"} <= got.keys()
    strays = {k: v for k, v in got.items() if not {x.split(" ;")[0] for x in v} <= {x.split(" ;")[0] for x in lock.get(k, [])}}
    assert not strays, strays


def _fake_dist(site: Path, name: str, files: list[str], version: str = "1.0") -> None:
    d = site / f"{name}-{version}.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (d / "RECORD").write_text("".join(f"{f},,\n" for f in files))


def _base_check(tmp_path, *argv, **env) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith("TRITON_")}
    e.update(PYTHONPATH=str(tmp_path / "site"), **env)
    return subprocess.run([sys.executable, str(ROOT / "docker/base-check.py"), *argv], env=e, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.vllm
def test_base_check_passes_and_fails_on_the_truth(tmp_path):
    """docker/base-check.py (both Dockerfile.base stages end in it), run on the test venv's real torch, vLLM and
    Triton; FlashInfer (not in the venv) is a stand-in module. It passes when every pin holds and names each
    broken one otherwise."""
    import torch
    import triton
    import vllm

    site = tmp_path / "site"
    (site / "flashinfer").mkdir(parents=True)
    (site / "flashinfer/__init__.py").write_text('__version__ = "0.7.0.post1"\n')
    pins = ["--vllm", vllm.__version__, "--torch", torch.__version__.split("+")[0], "--triton", triton.__version__,
            "--flashinfer", "0.7.0.post1"]
    ok = _base_check(tmp_path, *pins, "--cuda", str(torch.version.cuda))
    assert ok.returncode == 0, ok.stderr
    # Triton 3.6 (this venv) runs its bundled CUDA 12.9 ptxas-blackwell for sm_121, and that one knows sm_121a
    assert "ptxas for sm_121: " in ok.stdout and "ptxas-blackwell" in ok.stdout, ok.stdout

    # A ptxas that predates the GB10, a torch of the wrong CUDA, a second distribution owning torch/.
    fake = tmp_path / "ptxas"
    _script(fake, 'if [ "$1" = --version ]; then echo "Cuda compilation tools, release 12.8, V12.8.93"; '
                  'else echo "--gpu-name  Allowed values: sm_90a,sm_100a"; fi\n')
    _fake_dist(site, "torch_cpu_copy", ["torch/__init__.py"])
    bad = _base_check(tmp_path, *pins, "--cuda", "13.9", TRITON_PTXAS_BLACKWELL_PATH=str(fake))
    assert bad.returncode == 1, bad.stdout
    lines = bad.stderr.splitlines()
    assert lines[0] == "Dockerfile.base check failed:", bad.stderr
    assert any(f"expected {pins[3]} with CUDA 13.9: a CPU or other-CUDA torch was resolved" in x for x in lines)
    assert any("2 distributions install the torch package" in x and "torch_cpu_copy==1.0" in x for x in lines)
    assert any(f"{fake} (Triton's choice for sm_121 (get_ptxas(121))) does not know sm_121a" in x for x in lines)
    assert len(lines) == 4, bad.stderr


@pytest.mark.vllm
@pytest.mark.timeout(900)
@pytest.mark.skipif(shutil.which("qemu-x86_64") is None or platform.machine() != "x86_64",
                    reason="needs qemu-user on x86-64 (.ci/apt-packages.txt installs it)")
def _base_check_module():
    spec = importlib.util.spec_from_file_location("onespark_base_check", ROOT / "docker/base-check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# What `uv pip check` printed in the arm64 lane's first build of the vllm-wheels stage (tests/arm64.sh).
UV_CHECK_SBSA = """Using Python 3.11.2 environment at: /opt/venv
Checked 199 packages in 496ms
Found 1 incompatibility
The package `nvidia-cusparselt-cu13` was built for a different platform
"""


def test_uv_check_accepts_an_sbsa_tagged_wheel_on_aarch64_only():
    """nvidia-cusparselt-cu13 0.8.1 (pinned by torch 2.13.0) is an aarch64 wheel tagged `manylinux2014_sbsa` inside:
    uv's check calls it another platform's, which stopped the Spark's step 3. Accepted on aarch64 only, and only
    when every tag is sbsa; any other report fails."""
    problems = _base_check_module().pip_check_problems
    sbsa = {"nvidia-cusparselt-cu13": ["manylinux2014_sbsa"]}.get
    assert problems(UV_CHECK_SBSA, "aarch64", sbsa) == (
        [], ["nvidia-cusparselt-cu13 is tagged manylinux2014_sbsa (NVIDIA's name for aarch64): accepted"])
    assert problems(UV_CHECK_SBSA, "x86_64", sbsa)[0] == ["The package `nvidia-cusparselt-cu13` was built for a "
                                                          "different platform"]
    x86 = {"nvidia-cusparselt-cu13": ["manylinux2014_x86_64"]}.get
    assert problems(UV_CHECK_SBSA, "aarch64", x86)[0] != []
    other = UV_CHECK_SBSA + "The package `torch` requires `nvidia-nccl-cu13==2.29.7`, but `2.28.0` is installed\n"
    assert problems(other, "aarch64", sbsa)[0] == ["The package `torch` requires `nvidia-nccl-cu13==2.29.7`, but "
                                                   "`2.28.0` is installed"]


def test_base_check_on_a_real_cpu_model_without_avx512(tmp_path, monkeypatch):
    """The SIGILL case for real, on any x86-64 host: base-check's own import_compiled, its children run by QEMU's
    user-mode emulator as an AMD EPYC-Rome (AVX2, no AVX-512: the CPU of the machine where the lane first
    failed). numpy's compiled core, which picks its kernels at run time, imports there (so the emulated CPU runs
    this venv's compiled code); the 0.19.1 CPU wheel's vllm._C is an illegal instruction, reported as "NOT
    checked on this CPU". ~45 s: the emulator is ~20x slower than the host."""
    spec = importlib.util.spec_from_file_location("onespark_base_check", ROOT / "docker/base-check.py")
    base_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(base_check)
    python = tmp_path / "python-on-epyc-rome"
    _script(python, f'exec qemu-x86_64 -cpu EPYC-Rome {shlex.quote(sys.executable)} "$@"\n')
    monkeypatch.setattr(base_check.sys, "executable", str(python))
    core = "numpy._core._multiarray_umath"
    assert base_check.import_compiled(core) == f"{core} imports"
    assert base_check.import_compiled("vllm._C").startswith("vllm._C NOT checked on this CPU: importing it is an "
                                                            "illegal instruction (SIGILL")


def test_base_check_tells_a_cpu_without_the_wheels_isa_from_a_broken_import(tmp_path):
    """The 0.19.1 CPU wheel's vllm._C is built for AVX-512; on an AVX2-only CPU importing it is SIGILL (exit 132),
    which killed base-check.py itself. Each compiled module is now imported in a child: SIGILL reads "NOT checked
    on this CPU" (and the check passes on the rest), a real import failure (an ABI mismatch) still fails it."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sigill_ops.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGILL)\n")
    (site / "abi_ops.py").write_text("raise ImportError('undefined symbol: _ZN3c104impl3cow')\n")
    (site / "fine_ops.py").write_text("")
    for name, version in (("vllm", "1.0"), ("flashinfer", "1.0"), ("triton", "1.0")):
        (site / name).mkdir()
        (site / name / "__init__.py").write_text(f'__version__ = "{version}"\n')
    import torch

    pins = ["--vllm", "1.0", "--torch", torch.__version__.split("+")[0], "--cuda", str(torch.version.cuda),
            "--triton", "1.0", "--flashinfer", "1.0"]
    ptxas = tmp_path / "ptxas"
    _script(ptxas, 'if [ "$1" = --version ]; then echo "release 13.0"; else echo "sm_121a"; fi\n')
    ok = _base_check(tmp_path, *pins, "--compiled-ops", "fine_ops,sigill_ops", TRITON_PTXAS_PATH=str(ptxas))
    assert ok.returncode == 0, ok.stderr
    assert "fine_ops imports" in ok.stdout, ok.stdout
    assert "sigill_ops NOT checked on this CPU: importing it is an illegal instruction (SIGILL" in ok.stdout
    bad = _base_check(tmp_path, *pins, "--compiled-ops", "sigill_ops,abi_ops", TRITON_PTXAS_PATH=str(ptxas))
    assert bad.returncode == 1, bad.stdout
    assert "import abi_ops failed: ImportError('ImportError: undefined symbol: _ZN3c104impl3cow')" in bad.stderr
    assert "Traceback" not in bad.stderr.split("Dockerfile.base check failed:")[0], bad.stderr
