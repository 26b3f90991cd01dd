"""Issue 23, part A: keys never printed, a closed stdout, and the smoke request's answers of the wrong shape.

(Host strings: tests/test_cluster.py; the guard's options: tests/test_memory_guard.py; the Hub's answers to the
INT4 download: tests/test_download.py.) Every test here failed before its fix.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from onespark import cli
from onespark.errors import UserError
from onespark.serving import launch, memory
from tests._ports import free_port

ROOT = Path(__file__).resolve().parents[1]
LONG_KEY = "sk-live-7f3e9a0c41d2b85e6f7a9c0d1e2f3a4b5c6d7e8f"
SHORT_KEY = "Zq7"  # under 12 characters: the old rule showed it in "invalid choice"

# Every spelling of a key option that no command takes as it stands: the parser refuses each, and must not
# show the value. `--api-ke KEY` in bench also makes KEY bench's positional ("invalid choice").
SPELLINGS = [
    lambda k: [f"--api-ke={k}"], lambda k: [f"--api_key={k}"], lambda k: ["--api-ke", k], lambda k: ["--apikey", k],
    lambda k: [f"--API-KEY={k}"], lambda k: ["--api-k", k], lambda k: [f"--hf-token={k}"], lambda k: ["--hf-tok", k],
    lambda k: ["--hf_token", k], lambda k: ["--token", k], lambda k: [f"--tok={k}"], lambda k: ["--b-api-ke", k],
    lambda k: [f"--auth-token={k}"],
]


def commands(tmp: Path) -> dict[str, list[str]]:
    """Each CLI command with the arguments it requires (all under tmp), so that the key option is what fails."""
    (tmp / "m").mkdir(exist_ok=True)
    return {
        "specs": ["specs"], "doctor": ["doctor", "--work", str(tmp / "w")],
        "synth": ["synth", "--format", "int4", "--out", str(tmp / "s")],
        "download": ["download", "--dest", str(tmp / "d")],
        "hybrid": ["hybrid", "--int4", str(tmp / "i"), "--fp8", str(tmp / "f"), "--out", str(tmp / "h")],
        "mtp": ["mtp", str(tmp / "m")], "verify": ["verify", str(tmp / "m")],
        "draft-vocab": ["draft-vocab", str(tmp / "m")], "tiny-model": ["tiny-model", "--out", str(tmp / "t")],
        "serve": ["serve", "--checkpoint", str(tmp / "m"), "--dry-run", "--demo"],
        "cluster": ["cluster", "--nodes", "spark1,spark2", "--work", str(tmp / "w"), "--dry-run"],
        "bench": ["bench", "--out", str(tmp / "b"), "--no-png"],
        "bench compare": ["bench", "compare", str(tmp / "a.json"), str(tmp / "b.json")],
    }


def files_holding(root: Path, needle: str) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and needle.encode() in p.read_bytes()]


def test_no_spelling_of_a_key_option_shows_the_key(tmp_path, monkeypatch, capsys):
    """Every command (the CLI's one parser entry, bench's compare subparser, the memory guard's own parser,
    an unknown command) with every spelling, both key lengths: exit 2, the key in no output and no file."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    runs = 0
    for key in (LONG_KEY, SHORT_KEY):
        for spell in SPELLINGS:
            cases = {**{n: a + spell(key) for n, a in commands(tmp_path).items()},
                     "unknown command": spell(key)}
            for name, argv in cases.items():
                with pytest.raises(SystemExit) as e:  # the parser exits; an unknown command returns 2
                    raise SystemExit(cli.main(argv))
                out = capsys.readouterr()
                assert e.value.code == 2, (name, argv, out)
                assert key not in out.out + out.err, (name, argv, out.err)
                runs += 1
            with pytest.raises(SystemExit) as e:
                memory.guard_main(["--pid", str(os.getpid()), *spell(key)])
            out = capsys.readouterr()
            assert e.value.code == 2 and key not in out.out + out.err, out.err
    assert runs == 2 * len(SPELLINGS) * 14
    assert files_holding(tmp_path, SHORT_KEY) == files_holding(tmp_path, LONG_KEY) == []
    # and the misspelt flag is still named, so the user sees what to fix
    with pytest.raises(SystemExit):
        cli.main(["bench", "--api-ke", SHORT_KEY])
    err = capsys.readouterr().err
    assert err.strip() == ("onespark bench: error: argument [compare | spark-model]: invalid choice: '***' (choose from 'compare', 'spark-model') "
                           "(see onespark bench --help)"), err
    with pytest.raises(SystemExit):
        cli.main(["serve", "--checkpoint", "m", f"--api_key={SHORT_KEY}"])
    assert capsys.readouterr().err.strip() == ("onespark serve: error: unrecognized arguments: --api_key=*** (see "
                                               "onespark serve --help)")


def test_a_key_after_the_double_dash_never_reaches_vllms_command_line(tmp_path, capsys):
    for name, argv in (("serve", ["serve", "--checkpoint", str(tmp_path), "--dry-run", "--demo"]),
                       ("cluster", ["cluster", "--nodes", "spark1,spark2", "--dry-run"])):
        for spell in (["--api-key", SHORT_KEY], [f"--api-key={LONG_KEY}"], ["--hf-token", SHORT_KEY]):
            assert cli.main([*argv, "--", "--max-model-len", "4096", *spell]) == 1
            out = capsys.readouterr()
            flag = spell[0].split("=")[0]
            assert out.err.splitlines() == [
                f"onespark {name}: error: {flag} after --: vLLM would get the key on its command line (shown in `ps` "
                f"and the plan): give it to onespark {name} as --api-key-file FILE or $ONESPARK_API_KEY"], out.err
            assert out.out == ""


def _fake_docker(tmp: Path, body: str) -> dict:
    fake = tmp / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "docker").write_text("#!/bin/sh\n" + f'printf "%s\\n" "$*" >> {tmp}/calls\n' + textwrap.dedent(body))
    (fake / "docker").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ONESPARK_", "VLLM_API_KEY", "HF_TOKEN"))}
    return {**env, "PATH": f"{fake}:{os.environ['PATH']}", "XDG_STATE_HOME": str(tmp / "state"), "HOME": str(tmp)}



def test_serve_env_secret_goes_to_docker_by_name(tmp_path):
    """docker's argv (what `ps` shows) and serve's output name HF_TOKEN; only docker's environment has it."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    env = _fake_docker(tmp_path, f"""\
        case "$1" in
          image) exit 0 ;;
          inspect) exit 1 ;;
          run) printf '%s' "$HF_TOKEN" > {tmp_path}/docker-saw; echo "no GPU here" >&2; exit 1 ;;
        esac
        """)
    r = subprocess.run([sys.executable, "-m", "onespark", "serve", "--demo", "--checkpoint", str(model), "--no-memory-guard",
                        "--port", str(free_port()), "--env", f"HF_TOKEN={LONG_KEY}", "--env", "MY_PASSWORD=pw-9",
                        "--env", "ONESPARK_INT8_LM_HEAD=0"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1 and r.stderr.splitlines() == ["onespark serve: error: docker run failed: no GPU here"]
    run = next(c for c in (tmp_path / "calls").read_text().splitlines() if c.startswith("run "))
    assert " -e HF_TOKEN " in run and " -e MY_PASSWORD " in run and " -e ONESPARK_INT8_LM_HEAD=0 " in run
    assert "-e HF_TOKEN -e MY_PASSWORD -e ONESPARK_INT8_LM_HEAD=0 onespark-demo/v2" in r.stdout
    assert (tmp_path / "docker-saw").read_text() == LONG_KEY  # the value reached docker, by its environment
    for text in (r.stdout, r.stderr, run):
        assert LONG_KEY not in text and "pw-9" not in text
    dry = subprocess.run([sys.executable, "-m", "onespark", "serve", "--demo", "--checkpoint", str(model), "--dry-run",
                          "--env", f"HF_TOKEN={LONG_KEY}"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert dry.returncode == 0 and " -e HF_TOKEN " in dry.stdout and LONG_KEY not in dry.stdout + dry.stderr


def test_serve_takes_only_a_container_for_a_container_of_its_name(tmp_path):
    """An image, volume or network named like the container (`docker inspect onespark` answers for any of them)
    is no container in the way: serve neither refuses for it nor removes anything."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    env = _fake_docker(tmp_path, """\
        case "$1 $2 $3" in
          "image inspect"*) exit 0 ;;
          "inspect --type container") echo "Error: No such container: onespark" >&2; exit 1 ;;
          inspect*) echo '[{"Name": "onespark", "Driver": "local"}]'; exit 0 ;;
          run*) echo "no GPU here" >&2; exit 1 ;;
        esac
        """)
    r = subprocess.run([sys.executable, "-m", "onespark", "serve", "--demo", "--checkpoint", str(model),
                        "--no-memory-guard", "--port", str(free_port())], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.stderr.splitlines() == ["onespark serve: error: docker run failed: no GPU here"], r.stderr
    assert not [c for c in (tmp_path / "calls").read_text().splitlines() if c.startswith("rm ")]


# ---- a closed stdout -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, code", [
    (["specs"], -signal.SIGPIPE), (["--help"], -signal.SIGPIPE),
    (["cluster", "--nodes", "spark1,spark2", "--dry-run", "--sync"], -signal.SIGPIPE),
    (["serve", "--help"], 0),  # argparse's own help drops what it cannot write (its _print_message), exit 0
], ids=["specs", "help", "cluster-plan", "serve-help"])
def test_a_closed_stdout_ends_quietly_as_coreutils_do(argv, code):
    """`onespark specs | head -0`: the reader is gone before the first write. Before: "(unknown path): Broken
    pipe", or Python's "Exception ignored ... BrokenPipeError" at exit (status 120)."""
    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run([sys.executable, "-m", "onespark", *argv], stdout=w, stderr=subprocess.PIPE, cwd=ROOT,
                           timeout=60)
    finally:
        os.close(w)
    assert (p.returncode, p.stderr) == (code, b""), p.stderr.decode()
    yes = subprocess.run(["bash", "-c", "yes | head -0; echo ${PIPESTATUS[0]}"], capture_output=True, text=True)
    assert yes.stdout.strip() == str(128 + signal.SIGPIPE)  # what coreutils do: the shell sees the same 141


# ---- the smoke request ------------------------------------------------------------------------------------------

ANSWERS = {  # kind -> (/v1/models body, chat body, the message)
    "models-empty": ('{"object": "list", "data": []}', None, "GET /v1/models lists no model"),
    "models-no-id": ('{"data": [{"object": "model"}]}', None, "GET /v1/models: the first model card has no id"),
    "models-not-json": ("<html>", None, "GET /v1/models is not JSON"),
    "chat-no-choices": (None, '{"usage": {"completion_tokens": 3}}', "the chat answer has no choices[0].message"),
    "chat-no-usage": (None, '{"choices": [{"message": {"content": "hi"}}]}', "or usage.completion_tokens"),
    "chat-not-json": (None, "Bad Gateway", "the chat answer is not JSON"),
    "chat-choices-string": (None, '{"choices": "x", "usage": {"completion_tokens": 3}}', "has no choices[0]"),
    # nested past Python's stack: json.loads raises RecursionError, which is no ValueError (it was a traceback)
    "models-nested": ("[" * 100_000, None, "GET /v1/models is not JSON"),
    "chat-nested": (None, "[" * 100_000, "the chat answer is not JSON"),
}
MODELS_OK = '{"data": [{"id": "tiny"}]}'
CHAT_OK = '{"choices": [{"message": {"content": "Paris."}}], "usage": {"completion_tokens": 2}}'

SERVER = """
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
port, models, chat = int(sys.argv[1]), sys.argv[2], sys.argv[3]
class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def _send(self, body):
        raw = body.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)
    def do_GET(self):
        self._send(models if self.path == "/v1/models" else "{}")
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self._send(chat)
ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
"""


@pytest.mark.parametrize("kind", list(ANSWERS))
def test_smoke_answers_of_the_wrong_shape_are_one_line(kind, tmp_path):
    models, chat, message = ANSWERS[kind]
    port = free_port()
    srv = subprocess.Popen([sys.executable, "-c", SERVER, str(port), models or MODELS_OK, chat or CHAT_OK])
    try:
        for _ in range(100):
            if launch.port_open("127.0.0.1", port):
                break
            time.sleep(0.05)
        with pytest.raises(UserError) as e:
            launch.smoke(f"http://127.0.0.1:{port}", "hi", 4, None)
        assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
        assert str(e.value).endswith(launch.NOT_VLLM)
    finally:
        srv.kill()
        srv.wait()


@pytest.mark.parametrize("kind", ["models-empty", "chat-no-usage"])
def test_serve_stops_the_container_whose_smoke_answer_is_wrong(kind, tmp_path):
    """The fake docker's `run` starts a server answering `kind`; serve must stop it, not leave it serving."""
    models, chat, message = ANSWERS[kind]
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    port = free_port()
    (tmp_path / "server.py").write_text(SERVER)
    env = _fake_docker(tmp_path, f"""\
        case "$1 $2" in
          "image inspect") exit 0 ;;
          "inspect --format") [ -e {tmp_path}/pid ] && echo "true 0 false" || echo "false 0 false" ;;
          "inspect "*) exit 1 ;;
          "run "*) {sys.executable} {tmp_path}/server.py {port} '{models or MODELS_OK}' '{chat or CHAT_OK}' \
                     >/dev/null 2>&1 & echo $! > {tmp_path}/pid; echo cid ;;
          "stop "*) kill "$(cat {tmp_path}/pid)"; rm {tmp_path}/pid ;;
        esac
        """)
    try:
        r = subprocess.run([sys.executable, "-m", "onespark", "serve", "--demo", "--checkpoint", str(model), "--name", "t1",
                            "--no-memory-guard", "--port", str(port), "--timeout", "60"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=120)
    finally:
        if (tmp_path / "pid").exists():  # the test's own cleanup, should serve have left it running
            os.kill(int((tmp_path / "pid").read_text()), signal.SIGKILL)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    [line] = r.stderr.splitlines()
    assert line.startswith("onespark serve: error: ") and message in line, line
    assert line.endswith("; stopped container t1 (its log: docker logs t1; then docker rm t1, or serve again with "
                         "--replace)"), line
    assert "stop t1" in (tmp_path / "calls").read_text().splitlines()
    assert not (tmp_path / "pid").exists() and not launch.port_open("127.0.0.1", port)  # not serving any more


def test_a_well_formed_answer_still_passes():
    port = free_port()
    srv = subprocess.Popen([sys.executable, "-c", SERVER, str(port), MODELS_OK, CHAT_OK])
    try:
        for _ in range(100):
            if launch.port_open("127.0.0.1", port):
                break
            time.sleep(0.05)
        r = launch.smoke(f"http://127.0.0.1:{port}", "hi", 4, None)
    finally:
        srv.kill()
        srv.wait()
    assert (r["model"], r["answer"], r["completion_tokens"]) == ("tiny", "Paris.", 2)


# ---- numeric options: one validator (onespark.options), the range in the message ------------------------------

NUMBERS = [  # (argv before the flag, flag, bad value, the range the message names)
    (["serve", "--checkpoint", "m", "--dry-run"], "--port", "0", "a whole number from 1 to 65535"),
    (["serve", "--checkpoint", "m", "--dry-run"], "--timeout", "nan", "a number above 0"),
    (["serve", "--checkpoint", "m", "--dry-run"], "--max-tokens", "-1", "a whole number of at least 1"),
    (["serve", "--checkpoint", "m", "--dry-run"], "--num-draft-tokens", "0", "a whole number of at least 1"),
    (["serve", "--checkpoint", "m", "--dry-run"], "--guard-floor-gib", "0", "a number above 0"),
    (["serve", "--checkpoint", "m", "--dry-run"], "--host-reserve-gib", "inf", "a number of at least 0"),
    (["cluster", "--nodes", "a,b", "--dry-run"], "--timeout", "-inf", "a number above 0"),
    (["cluster", "--nodes", "a,b", "--dry-run"], "--port", "70000", "a whole number from 1 to 65535"),
    (["doctor"], "--gpu-memory-utilization", "1.5", "a number above 0 and at most 1"),
    (["bench"], "--runs", "0", "a whole number of at least 1"),
    (["bench"], "--warmup", "-1", "a whole number of at least 0"),
    (["bench"], "--timeout", "nan", "a number above 0"),
    (["bench"], "--top-k", "1e9x", "a whole number of at least 1"),
    (["bench"], "--concurrency", "1,0", "comma-separated whole numbers of at least 1"),
    (["bench"], "--concurrency", "0", "comma-separated whole numbers of at least 1"),
    (["bench"], "--capacity-max-tokens", "0", "a whole number of at least 1"),
    (["bench"], "--top-k", "0", "a whole number of at least 1"),
    (["draft-vocab", "d"], "--size", "0", "a whole number of at least 1"),
    (["synth", "--format", "int4", "--out", "o"], "--shards", "0", "a whole number of at least 1"),
    (["synth", "--format", "int4", "--out", "o"], "--seed", "-3", "a whole number of at least 0"),
    (["tiny-model", "--out", "o"], "--seed", "nan", "a whole number of at least 0"),
    # finite but huge (issue 58): passed the check, then GiB x 2^30 was inf and int(inf) a traceback; a wait of
    # 1e10 s overflowed poll()'s milliseconds (subprocess.run, selectors)
    (["serve", "--checkpoint", "m", "--dry-run"], "--host-reserve-gib", "1e308", "a number from 0 to 1000000000"),
    (["serve", "--checkpoint", "m", "--dry-run"], "--guard-floor-gib", "1e308",
     "a number above 0 and at most 1000000000"),
    (["doctor"], "--host-reserve-gib", "1e308", "a number from 0 to 1000000000"),
    (["doctor"], "--guard-floor-gib", "1e308", "a number above 0 and at most 1000000000"),
    (["serve", "--checkpoint", "m", "--dry-run"], "--timeout", "1e10", "a number above 0 and at most 2000000"),
    (["cluster", "--nodes", "a,b", "--dry-run"], "--timeout", "1e308", "a number above 0 and at most 2000000"),
    (["bench"], "--timeout", "3e6", "a number above 0 and at most 2000000"),
]


@pytest.mark.parametrize("argv, flag, value, want", NUMBERS, ids=[f"{a[0]}{f}={v}" for a, f, v, _ in NUMBERS])
def test_numeric_options_are_finite_and_in_range(tmp_path, monkeypatch, capsys, argv, flag, value, want):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        cli.main([*argv, f"{flag}={value}"])  # `=`: argparse takes a bare -inf for an option
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.splitlines()) == 1, err
    prog = f"onespark {argv[0]}"
    if "comma-separated" in want:
        assert err.startswith(f"{prog}: error: argument {flag}: {value!r}: expected {want}"), err
    else:
        named = "--size/--draft-vocab-size" if flag == "--size" else flag  # argparse names every alias
        assert err == f"{prog}: error: argument {named}: expected {want}, got {value!r} (see {prog} --help)\n", err
    assert list(tmp_path.iterdir()) == []


# ---- what names a server, and its key: checked at the edge ---------------------------------------------------

def test_an_ipv6_host_gives_a_url_in_brackets(tmp_path):
    """--host ::1 (a local address: no warning) made http://::1:8000, which httpx refuses with InvalidURL (no
    HTTPError: a traceback after the container started) and curl and the image's health check with it."""
    assert launch.base_url("::1", 8000) == "http://[::1]:8000"
    assert launch.base_url("::", 8000) == launch.base_url("0.0.0.0", 8000) == "http://127.0.0.1:8000"
    assert launch.base_url("fd00::2", 9) == "http://[fd00::2]:9" and launch.base_url("spark1", 9) == "http://spark1:9"
    # an upstream (compress --upstream) keeps its scheme and a wildcard address as given: no bind-to-probe mapping
    assert launch.url("https", "::", 8443) == "https://[::]:8443" and launch.url("http", "0.0.0.0", 1) == "http://0.0.0.0:1"
    assert launch.http(launch.base_url("::1", free_port()) + "/health", timeout=2) == (0, b"")  # refused, no raise
    (tmp_path / "m").mkdir()
    r = subprocess.run([sys.executable, "-m", "onespark", "serve", "--demo", "--checkpoint", str(tmp_path / "m"),
                        "--dry-run", "--host", "::1"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ONESPARK_HEALTH_URL=http://[::1]:8000/health" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("flag, value, says", [
    ("--name", "../../../escaped", "is not a Docker container name"),
    ("--name", "-f", "is not a Docker container name"),
    ("--name", "a b", "is not a Docker container name"),
    ("--host", "-oProxyCommand=x", "is not an address to bind"),
    ("--host", "127.0.0.1 --api-key", "is not an address to bind"),
    ("--host", "a;b", "is not an address to bind"),
])
def test_serve_refuses_a_name_or_host_that_is_none(tmp_path, flag, value, says):
    """--name also names the memory guard's log and report (state dir/guard-NAME.log): `../../../escaped` made
    serve create that log outside the state directory (and read, then delete, a .report there) before
    `docker run` refused the name. Now refused by the parser, with nothing run or written."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    env = _fake_docker(tmp_path, """\
        case "$1" in
          image) exit 0 ;;
          inspect) exit 1 ;;
          run) echo "invalid container name" >&2; exit 1 ;;
        esac
        """)
    r = subprocess.run([sys.executable, "-m", "onespark", "serve", "--demo", "--checkpoint", str(model),
                        "--port", str(free_port()), f"{flag}={value}"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and says in r.stderr, r.stderr
    assert not (tmp_path / "calls").exists()  # docker was never called
    assert [p.name for p in tmp_path.rglob("*.log")] == []  # no guard log, in or out of the state directory


@pytest.mark.parametrize("command", ["serve", "cluster", "bench"])
@pytest.mark.parametrize("image", ["-v/:/host", "--privileged", "onespark/v2:0.1.0\nRUN id", "Onespark/V2", "x:"])
def test_an_image_that_is_no_image_reference_is_refused_by_the_parser(tmp_path, command, image):
    """serve puts --image on `docker run`'s argv after its flags (`-v/:/host` would mount the host's root there),
    cluster into the FROM line of the Dockerfile it builds on the head (a line break adds a line), bench into its
    record: each refuses anything but an image reference, in one line, before anything runs."""
    (tmp_path / "m").mkdir()
    argv = {"serve": ["serve", "--demo", "--checkpoint", str(tmp_path / "m"), "--dry-run"],
            "cluster": ["cluster", "--nodes", "spark1,spark2", "--work", str(tmp_path / "w"), "--dry-run"],
            "bench": ["bench"]}[command]
    r = subprocess.run([sys.executable, "-m", "onespark", *argv, f"--image={image}"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert "is not a Docker image reference" in r.stderr and "--image" in r.stderr, r.stderr


@pytest.mark.parametrize("command", ["serve", "cluster"])
@pytest.mark.parametrize("key", ["sk-caf\u00e9-0123456789", "sk-0123\n456789", "sk-0123 456789"])
def test_a_key_from_the_environment_is_held_to_the_key_files_rule(tmp_path, command, key):
    """$ONESPARK_API_KEY (or --api-key) with an accent made the smoke request raise UnicodeEncodeError in httpx:
    a traceback once the server was up. Refused before anything starts, the key never shown."""
    (tmp_path / "m").mkdir()
    argv = {"serve": ["serve", "--demo", "--checkpoint", str(tmp_path / "m"), "--dry-run"],
            "cluster": ["cluster", "--nodes", "spark1,spark2", "--work", str(tmp_path / "w"), "--dry-run"]}[command]
    env = {**os.environ, "ONESPARK_API_KEY": key}
    r = subprocess.run([sys.executable, "-m", "onespark", *argv], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 1 and r.stdout == "", r.stdout + r.stderr
    assert r.stderr.splitlines() == [
        f"onespark {command}: error: --api-key (or $ONESPARK_API_KEY): the key is not plain printable ASCII (a space, "
        "a line break or a character a copy-paste added?): set it again, or put it alone on the first line of "
        "--api-key-file"], r.stderr
    assert all(part not in r.stderr for part in key.split())
    with pytest.raises(UnicodeEncodeError):  # what the smoke request did with it
        launch.http(f"http://127.0.0.1:{free_port()}/v1/models", api_key="sk-caf\u00e9")


def test_doctor_names_a_bad_hf_endpoint_or_token_in_its_check(monkeypatch):
    """HF_ENDPOINT=http://::1 raised httpx.InvalidURL (no HTTPError) and a non-ASCII HF_TOKEN UnicodeEncodeError:
    both were tracebacks that ended the whole preflight. Now each is the Hugging Face check's FAIL line."""
    from onespark.serving import doctor

    monkeypatch.delenv("HF_TOKEN", raising=False)
    for endpoint in ("http://::1", "https://hub:port"):
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        [c] = doctor.check_hf()
        assert (c.status, c.detail.split(" (")[0]) == ("FAIL", f"HF_ENDPOINT {endpoint!r} is not a URL"), c
        assert "set HF_ENDPOINT to a URL" in c.fix
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("HF_TOKEN", "hf_s\u00e9cret123")
    [c] = doctor.check_hf()
    assert c.status == "FAIL" and c.detail.startswith("$HF_TOKEN is not plain printable ASCII"), c
    assert "s\u00e9cret" not in c.detail + c.fix


def test_an_unknown_spec_in_the_manifest_is_named_as_the_manifests(tmp_path, capsys):
    """The spec step 1 recorded (a newer onespark's, a hand edit) was reported as `--model zzz: unknown`, a flag the
    user never gave; the line names the manifest and the flag that overrides it."""
    model = tmp_path / "m"
    model.mkdir()
    (model / "onespark-manifest.json").write_text('{"files": {}, "spec": "qwen9-zzz"}')
    assert cli.main(["serve", "--demo", "--checkpoint", str(model), "--dry-run"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"onespark serve: error: {model}/onespark-manifest.json records the spec 'qwen9-zzz', "
                          "which this onespark does not know (it knows qwen3.5-122b-a10b"), err
    assert err.endswith(": pass --model NAME, or update onespark to the version that wrote it\n") and "--model qwen9" not in err
    assert cli.main(["serve", "--demo", "--checkpoint", str(model), "--dry-run", "--model", "qwen3.5-35b-a3b"]) == 0


@pytest.mark.parametrize("command, argv, says", [
    ("onespark.bench.cli", ["bench", "--base-url", "http://127.0.0.1:9"], "onespark bench: interrupted"),
    ("onespark.checkpoint.verify", ["verify", "x"], "onespark verify: interrupted"),
    ("onespark.checkpoint.download", ["download", "--dest", "x"],
     "onespark download: interrupted; re-run the same command to resume"),
])
def test_ctrl_c_promises_a_resume_only_where_a_rerun_resumes(monkeypatch, capsys, command, argv, says):
    """Ctrl-C said "re-run the same command to resume" for every command: a bench (or a verify) starts over."""
    import importlib

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib.import_module(command), "run", interrupted)
    assert cli.main(argv) == 130
    assert capsys.readouterr().err.strip() == says


# ---- issue 58, item 3: the leftovers --------------------------------------------------------------------------

def test_a_whole_number_past_any_float_is_one_line(capsys):
    """math.isfinite(10**400) raises OverflowError, which argparse does not catch: a traceback. The message shows
    the first 40 digits only."""
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--runs", "9" * 400])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == (f"onespark bench: error: argument --runs: expected a whole number from 1 to "
                                         f"1000000000, got {'9' * 40!r}... (see onespark bench --help)\n"), err


def test_memory_module_help_is_help():
    """`python -m onespark.serving.memory --help` printed the usage as an error and exited 2."""
    r = subprocess.run([sys.executable, "-m", "onespark.serving.memory", "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert (r.returncode, r.stderr) == (0, ""), r.stderr
    assert r.stdout.startswith("usage: python -m onespark.serving.memory guard --container NAME | --pid PID")
    assert "python -m onespark.serving.memory guard --help" in r.stdout
    r = subprocess.run([sys.executable, "-m", "onespark.serving.memory", "watch"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and "--help" in r.stderr, r.stderr


LABEL_64 = "a" * 64  # one label past DNS's 63 characters (RFC 1035)


@pytest.mark.parametrize("extra", [[], ["--dry-run"]])
def test_a_head_label_past_63_characters_is_no_ssh_address(tmp_path, extra):
    """Before: the head's name went to socket.gethostbyname (is it this machine?), whose idna codec raised
    UnicodeError ("label too long"): a traceback. 63 characters is a name."""
    r = subprocess.run([sys.executable, "-m", "onespark", "cluster", "--nodes", f"{LABEL_64}.lan,spark2", *extra],
                       cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout) == (1, ""), r.stdout + r.stderr
    assert r.stderr.splitlines() == [f"onespark cluster: error: --nodes: '{LABEL_64}.lan' is not an ssh address: "
                                     "give [user@]host, host a DNS name or an IP address (letters, digits, '.', '-', "
                                     "'_'; no leading '-', no spaces), e.g. --nodes spark1,user@192.168.100.2"]
    from onespark.serving import cluster
    assert cluster.is_ssh_destination("a" * 63 + ".lan") and not cluster.is_ssh_destination(f"u@{LABEL_64}")


def test_a_bind_host_label_past_63_characters_is_refused_by_the_parser(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--checkpoint", str(tmp_path), "--dry-run", "--demo", "--host", f"x.{LABEL_64}"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument --host: 'x.{LABEL_64}' is not an address to bind" in err, err


def _serve_or_cluster(command: str, tmp_path: Path) -> list[str]:
    (tmp_path / "m").mkdir(exist_ok=True)
    return {"serve": ["serve", "--demo", "--checkpoint", str(tmp_path / "m"), "--dry-run"],
            "cluster": ["cluster", "--nodes", "spark1,spark2", "--work", str(tmp_path / "w"), "--dry-run"]}[command]


def _onespark(argv: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("ONESPARK_API_KEY", "OPENAI_API_KEY")} | env
    return subprocess.run([sys.executable, "-m", "onespark", *argv], cwd=cwd, env=full, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("command", ["serve", "cluster"])
def test_api_key_with_api_key_file_is_refused_as_bench_refuses_it(tmp_path, command):
    """Both were taken, the file silently winning; bench refused the pair. The variable beside the file is a
    default, not a second choice: the file wins, as in bench."""
    key = tmp_path / "key"
    key.write_text(LONG_KEY + "\n")
    key.chmod(0o600)
    r = _onespark([*_serve_or_cluster(command, tmp_path), "--api-key", "sk-other-0123456789", "--api-key-file",
                   str(key)], tmp_path)
    assert (r.returncode, r.stdout) == (1, ""), r.stdout + r.stderr
    assert r.stderr.splitlines() == [f"onespark {command}: error: give --api-key or --api-key-file, not both"]
    r = _onespark([*_serve_or_cluster(command, tmp_path), "--api-key-file", str(key)], tmp_path,
                  ONESPARK_API_KEY="sk-from-env-0123456789")
    assert r.returncode == 0, r.stderr
    assert LONG_KEY not in r.stdout + r.stderr and "sk-from-env" not in r.stdout + r.stderr


@pytest.mark.parametrize("command", ["serve", "cluster", "bench"])
@pytest.mark.parametrize("mode, who", [(0o666, "group and others"), (0o602, "others"), (0o620, "its group")])
def test_a_key_file_others_can_write_is_refused_naming_the_chmod(tmp_path, command, mode, who):
    """A key file anyone could rewrite was used without a word: whoever writes it picks the key the server
    accepts. Refused, as ssh refuses a private key others can touch; 0600 and 0644 are used."""
    key = tmp_path / "key"
    key.write_text(LONG_KEY + "\n")
    argv = (_serve_or_cluster(command, tmp_path) if command != "bench" else
            ["bench", "--base-url", "http://127.0.0.1:9", "--out", str(tmp_path / "b"), "--no-png"])
    key.chmod(mode)
    r = _onespark([*argv, "--api-key-file", str(key)], tmp_path)
    assert (r.returncode, r.stdout) == (1, ""), r.stdout + r.stderr
    assert r.stderr.splitlines() == [
        f"onespark {command}: error: --api-key-file {key}: writable by {who} (mode {mode:04o}), who could change the "
        f"key: chmod go-w {key} (or chmod 600 {key}), then run the same command again"], r.stderr
    if command != "bench":  # (bench would go on to its unreachable server)
        for ok in (0o600, 0o644):
            key.chmod(ok)
            r = _onespark([*argv, "--api-key-file", str(key)], tmp_path)
            assert r.returncode == 0 and LONG_KEY not in r.stdout + r.stderr, r.stdout + r.stderr


@pytest.mark.parametrize("command", ["serve", "cluster"])
@pytest.mark.parametrize("words, flag, own", [
    (["--port", "9000"], "--port", "--port N"), (["--port=9000"], "--port", "--port N"),
    (["--host", "0.0.0.0"], "--host", "--host H"), (["--host=0.0.0.0"], "--host", "--host H"),
    (["--hos", "0.0.0.0"], "--hos", "--host H"), (["--por", "1"], "--por", "--port N"),
])
def test_host_or_port_after_the_double_dash_is_refused_naming_the_commands_flag(tmp_path, command, words, flag, own):
    """`serve -- --port 9000` made vLLM listen on 9000 while serve waited for /health on 8000 (and `-- --host
    0.0.0.0` exposed it with no warning): vLLM takes the last --port/--host, its own abbreviations included."""
    r = _onespark([*_serve_or_cluster(command, tmp_path), "--", "--max-model-len", "4096", *words], tmp_path)
    assert (r.returncode, r.stdout) == (1, ""), r.stdout + r.stderr
    assert r.stderr.splitlines() == [f"onespark {command}: error: {flag} after --: give it to onespark {command} as "
                                     f"{own} (before --), which the health check, the smoke request and the exposure "
                                     "warning follow"], r.stderr
    r = _onespark([*_serve_or_cluster(command, tmp_path), "--", "--max-model-len", "4096", "--pooler-config", "{}"],
                  tmp_path)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("argv, flag", [
    (["serve", "--demo", "--dry-run", "--checkpoint", ""], "--checkpoint"),
    (["serve", "--demo", "--dry-run", "--checkpoint", "m", "--drafter-dir", " "], "--drafter-dir"),
    (["serve", "--dry-run", "--checkpoint", "m", "--compressor-dir", ""], "--compressor-dir"),
    (["doctor", "--checkpoint", ""], "--checkpoint"),
    (["tiny-model", "--out", ""], "--out"),
    (["download", "--dest", ""], "--dest"),
    (["verify", ""], "dir"),
    (["compress", "serve", "--model-dir", ""], "--model-dir"),
    (["hybrid", "--int4", "", "--fp8", "f", "--out", "o"], "--int4"),
    (["hybrid", "--int4", "i", "--fp8", "f", "--out", " "], "--out"),
])
def test_an_empty_directory_argument_is_refused(tmp_path, monkeypatch, capsys, argv, flag):
    """An unset variable (`--checkpoint "$DIR"`) gave "": Path("") is the current directory, and docker's
    `-v :/model:ro` no mount at all."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err
    value = " " if flag == "--drafter-dir" or argv[-1] == " " else ""
    command = " ".join(argv[:2]) if argv[0] == "compress" else argv[0]  # compress's action is a subcommand
    assert e.value.code == 2 and err.startswith(f"onespark {command}: error: argument {flag}: {value!r} is no "
                                                "directory: give its path (an unset shell variable?)"), err
    assert list(tmp_path.iterdir()) == []


def test_the_plans_error_for_a_compressor_dir_without_weights_names_that_flag(tmp_path):
    """The compressor's directory without weights was reported as "--checkpoint must be the checkpoint directory"."""
    model, empty = tmp_path / "m", tmp_path / "llm"
    model.mkdir(), empty.mkdir()
    (model / "model.safetensors.index.json").write_text('{"metadata": {"total_size": 1000}, "weight_map": {}}')
    (tmp_path / "mi").write_text("MemTotal: 125514547 kB\nMemAvailable: 120000000 kB\n")
    with pytest.raises(memory.PlanError) as e:
        memory.make_plan(model, [], meminfo=str(tmp_path / "mi"), compressor_dir=empty)
    assert str(e.value) == (f"{empty}: no model.safetensors.index.json and no *.safetensors: --compressor-dir must be "
                            "the LLMLingua-2 checkpoint's directory (`onespark download --compressor NAME` writes "
                            "DEST/llmlingua2/NAME)")
    with pytest.raises(memory.PlanError, match="--checkpoint must be the checkpoint directory"):
        memory.make_plan(empty, [], meminfo=str(tmp_path / "mi"))


@pytest.mark.parametrize("flag, value, choices", [("--compressor", "nosuch", "bert-base, xlm-roberta-large"),
                                                  ("--drafter", "eagle", "dflash, mtp")])
def test_step_0_dry_run_refuses_a_name_the_run_refuses(tmp_path, flag, value, choices):
    """`steps/0-download.sh --dry-run --compressor nosuch` printed the command and exited 0; the run itself ends
    in argparse's "invalid choice"."""
    r = subprocess.run(["steps/0-download.sh", "--dry-run", "--work", str(tmp_path / "w"), flag, value], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout) == (2, ""), r.stdout + r.stderr
    assert r.stderr.splitlines() == [f"onespark: error: {flag} '{value}': expected one of: {choices} (see "
                                     "steps/0-download.sh --help)"], r.stderr
    r = subprocess.run(["steps/0-download.sh", "--dry-run", "--work", str(tmp_path / "w"), "--compressor",
                        "bert-base", "--drafter", "dflash"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--drafter dflash --compressor bert-base" in r.stdout, r.stderr


@pytest.mark.parametrize("content", ["", " \n\t\n\n   \n"], ids=["empty", "whitespace"])
def test_a_corpus_without_text_is_refused_not_called_corpus_frequency(tmp_path, content):
    """An empty or blank --corpus file ranked nothing (or blanks) and was recorded as method "corpus-frequency"."""
    from onespark.checkpoint.tinymodel import write_tiny_model

    d = write_tiny_model(tmp_path / "tiny")
    text, blank = tmp_path / "text.txt", tmp_path / "blank.txt"
    text.write_text("the quick brown fox\n")
    blank.write_text(content)
    r = _onespark(["draft-vocab", str(d), "--size", "64", "--corpus", str(text), str(blank)], tmp_path)
    assert (r.returncode, r.stdout) == (1, ""), r.stdout + r.stderr
    what = "empty" if not content else "only whitespace"
    assert r.stderr.splitlines() == [f"onespark draft-vocab: error: --corpus {blank}: {what}: give text files of the "
                                     "traffic to rank for, or leave --corpus out (the tokenizer's BPE merge order)"]
    assert not (d / "onespark-draft-vocab.json").exists()
    r = _onespark(["draft-vocab", str(d), "--size", "64", "--corpus", str(text)], tmp_path)
    assert r.returncode == 0 and "corpus-frequency" in r.stdout, r.stderr
