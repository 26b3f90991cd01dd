"""`onespark bench`: benchmark an OpenAI-compatible endpoint; `onespark bench compare A.json B.json`.

  onespark bench --suite published                      # the public recipe's five prompt classes
  onespark bench --suite depth,concurrency,capacity --server-log server.log
  onespark bench --suite quality --b-base-url http://127.0.0.1:8001   # greedy A/B against a second server
  onespark bench compare results/A.json results/B.json
  onespark bench spark-model                            # the calibrated Spark estimate's tables
  onespark bench spark-model --start bench/results/spark_start_h100.json   # and the engine starts' table

Writes NAME.json (every request), NAME.md (tables for a README) and NAME.png under --out, prints the tables,
and exits 1 when any request failed (failed requests never enter a summary).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from onespark import __version__, options
from onespark.bench import report
from onespark.bench.client import Endpoint, detect_model, make_client, server_version
from onespark.bench.suites import SUITES, Progress, Runner, Settings, published_classes
from onespark.errors import UserError

ALL = SUITES + ("quality",)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = __doc__
    sub = p.add_subparsers(dest="action", metavar="[compare | spark-model]")
    c = sub.add_parser("compare", help="B vs A: per-metric deltas with their noise", allow_abbrev=False)
    c.add_argument("a", help="result JSON (the reference, A)")
    c.add_argument("b", help="result JSON (the candidate, B)")
    c.add_argument("--markdown", action="store_true", help="print a Markdown table")
    m = sub.add_parser("spark-model", help="the calibrated Spark estimate: every published point and each "
                                           "configuration's tok/s (onespark.bench.spark_model)", allow_abbrev=False)
    m.add_argument("--steps", help="a tests/gpu_vllm/spark_steps.py result: its verify sweep joins the step times")
    m.add_argument("--start", help="a spark_steps.py start result (spark_start_<gpu>.json): both engine starts and "
                                   "their Spark estimate")
    m.add_argument("--write", metavar="JSON", help="also write the result there (bench/results/spark_model.json)")

    g = p.add_argument_group("endpoint")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (default: %(default)s)")
    g.add_argument("--api-key", help="bearer token; visible in `ps`: prefer --api-key-file or $OPENAI_API_KEY "
                                     "(then $ONESPARK_API_KEY, the key `onespark serve` reads); never written to "
                                     "results")
    g.add_argument("--api-key-file", help="read the bearer token from this file (first line)")
    g.add_argument("--model", help="served model name (default: the first one /v1/models lists)")
    # --model is the served name here (as in the OpenAI API), so the spec has its own flag.
    g.add_argument("--spec", metavar="NAME", help="model spec the server runs (onespark specs), recorded in the result; "
                                                  "its served name is the default --model")
    g.add_argument("--api", choices=["chat", "completions"], default="chat", help="default: %(default)s")
    g.add_argument("--no-think", action="store_true",
                   help="send chat_template_kwargs.enable_thinking=false (the published figures keep thinking on)")
    g.add_argument("--no-stream", action="store_true",
                   help="non-streamed requests timed whole, exactly as the published script (no TTFT or decode rate)")
    g.add_argument("--timeout", type=options.SECONDS, default=600.0, help="seconds per request (default: %(default)s)")

    g = p.add_argument_group("suites")
    g.add_argument("--suite", default="published",
                   help=f"comma-separated: {', '.join(ALL)}, or all (default: %(default)s)")
    g.add_argument("--runs", type=options.COUNT, default=3, help="measured runs per point (default: %(default)s)")
    g.add_argument("--warmup", type=options.number(int, 0), default=1, help="warm-up runs, reported apart (default: %(default)s)")
    g.add_argument("--max-tokens", type=options.COUNT, help="cap every request's max_tokens (quick runs)")
    g.add_argument("--classes", help="published classes to run, e.g. Q&A,Math (default: all five)")
    g.add_argument("--depths", type=options.sizes(0), default=Settings().depths, help="default: 0,4k,16k,64k,128k,256k")
    g.add_argument("--depth-max-tokens", type=options.COUNT, default=128, help="default: %(default)s")
    g.add_argument("--concurrency", type=options.sizes(1), default=Settings().concurrency, help="default: 1,2,4,8")
    g.add_argument("--concurrency-max-tokens", type=options.COUNT, default=256, help="default: %(default)s")
    g.add_argument("--capacity-contexts", type=options.sizes(1), default=Settings().capacity_contexts,
                   help="context lengths to size users for (default: 32k,128k,256k and the server's max)")
    g.add_argument("--capacity-streams", type=options.number(int, 0), default=0,
                   help="also load the server with this many streams and watch /metrics (default: off)")
    g.add_argument("--capacity-context", type=options.COUNT, default=4096, help="context of each load stream")
    g.add_argument("--capacity-max-tokens", type=options.COUNT, default=Settings().capacity_max_tokens,
                   help="new tokens per load stream (default: %(default)s)")
    g.add_argument("--compression-lengths", type=options.sizes(1), default=Settings().compression_lengths,
                   help="compression: prompt lengths in tokens, estimated (default: 8k,16k,32k,64k); --base-url is "
                        "`onespark compress serve`'s")
    g.add_argument("--compression-rate", type=options.number(float, 0, 1, lo_open=True), default=0.5,
                   help="compression: the fraction of tokens kept that B asks for (default: %(default)s)")
    g.add_argument("--compression-max-tokens", type=options.COUNT, default=Settings().compression_max_tokens,
                   help="compression: new tokens per answer (default: %(default)s)")
    g.add_argument("--server-log", help="server start-up log, for the KV cache size (docker logs NAME > FILE)")
    g.add_argument("--b-base-url", help="quality: the second endpoint (B)")
    g.add_argument("--b-model", help="quality: B's model name (default: its first)")
    g.add_argument("--b-api-key", help="quality: B's bearer token (default: A's); visible in `ps`, prefer "
                                       "--b-api-key-file")
    g.add_argument("--b-api-key-file", help="quality: read B's bearer token from this file")
    g.add_argument("--top-k", type=options.COUNT, default=20,
                   help="quality: top logprobs per position (default: %(default)s, vLLM's default limit; more needs "
                        "the server started with --max-logprobs N; the whole vocabulary makes KL exact)")

    g = p.add_argument_group("output")
    g.add_argument("--out", default="bench-results", help="output directory (default: %(default)s)")
    g.add_argument("--name", type=options.file_stem, help="file stem in --out (default: SUITES-UTCDATE)")
    g.add_argument("--hardware", help="what it ran on, stated in every table, e.g. 'DGX Spark GB10'")
    g.add_argument("--gpu", help="GPU name for the record")
    g.add_argument("--image", type=options.image_ref, help="container image for the record, e.g. onespark:v2")
    g.add_argument("--note", help="free text for the record, e.g. how the server was started")
    g.add_argument("--no-png", action="store_true", help="skip the plot")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")


def _recorded_quality(a: dict, b: dict, path_a: str, path_b: str) -> dict | None:
    """The quality A/B from two results that each recorded greedy generations (`--suite quality` alone)."""
    from onespark.bench.quality import compare_records

    rec_a = (a.get("quality") or {}).get("record") or (a.get("quality") or {}).get("record_a")
    rec_b = (b.get("quality") or {}).get("record") or (b.get("quality") or {}).get("record_a")
    if not rec_a or not rec_b:
        return None
    try:
        return compare_records(rec_a, rec_b)
    except ValueError as e:
        raise UserError(f"cannot compare the quality recordings of {path_a} and {path_b}: {e}; "
                        "record both with the same --max-tokens and --top-k") from e


KEY_ENV = ("OPENAI_API_KEY", "ONESPARK_API_KEY")


def _read_key(path: str, flag: str) -> str:
    from onespark.errors import read_secret

    return read_secret(path, flag)


def resolve_keys(args) -> tuple[str | None, str | None]:
    """(A's key, B's key) from the file, the flag or the environment, in that order of preference."""
    from onespark.errors import check_key_pair, plain_key

    check_key_pair(args.api_key, args.api_key_file, "--api-key")
    check_key_pair(args.b_api_key, args.b_api_key_file, "--b-api-key")

    # held to the key file's rule (printable ASCII): a line break would reach the HTTP client, whose error message
    # quotes the header, key and all, and an accent would fail as a traceback
    env = next((k for k in KEY_ENV if os.environ.get(k)), None)
    if args.api_key_file:
        key = _read_key(args.api_key_file, "--api-key-file")
    else:
        key = plain_key(args.api_key, "--api-key") or (plain_key(os.environ[env], f"${env}") if env else None)
    b_key = _read_key(args.b_api_key_file, "--b-api-key-file") if args.b_api_key_file else \
        plain_key(args.b_api_key, "--b-api-key") or key
    return key, b_key


@dataclass(frozen=True)
class Run:
    """One `onespark bench` run as read once from the arguments (keys resolved, the served model named, every
    setting checked): nothing below run() reads the Namespace."""

    suites: list[str]
    settings: Settings
    base_url: str
    api_key: str | None
    model: str | None
    b_base_url: str | None
    b_api_key: str | None
    b_model: str | None
    api: str
    timeout: float
    no_think: bool
    stream: bool
    progress: bool
    top_k: int
    out: str
    png: bool
    name: str | None
    record: dict  # what the result file names as given: hardware, gpu, image, note, spec


def secrets(run: Run) -> list[str]:
    """Every key this run knows of, to be removed by value from whatever it records."""
    values = [run.api_key, run.b_api_key] + [os.environ.get(k) for k in KEY_ENV + ("HF_TOKEN",)]
    # Shorter than 4 characters, a value would be replaced inside ordinary words and numbers; the flags'
    # own redaction (_redacted) still hides it on the command line.
    return sorted({v for v in values if v and len(v) >= 4}, key=len, reverse=True)


def redact(obj, values: list[str]):
    """obj (JSON-ready) with every occurrence of each secret value replaced by ***."""
    if isinstance(obj, str):
        for v in values:
            obj = obj.replace(v, "***")
        return obj
    if isinstance(obj, dict):
        return {redact(k, values): redact(v, values) for k, v in obj.items()}
    if isinstance(obj, list):
        return [redact(v, values) for v in obj]
    return obj


def _git_sha() -> str | None:
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "-C", str(here), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                             text=True, timeout=5).stdout.strip()
        # tracked files changed anywhere in the checkout (untracked files do not change what ran)
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (sha + ("-dirty" if dirty else "")) if sha else None


def _suites(text: str) -> list[str]:
    names = list(ALL) if text.strip() == "all" else [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in ALL]
    if bad or not names:
        raise UserError(f"unknown suite {', '.join(bad) or repr(text)}: choose from {', '.join(ALL)} or all")
    return names


def settings_from(args) -> Settings:
    s = Settings(runs=args.runs, warmup=args.warmup, max_tokens_cap=args.max_tokens,
                 classes=[c.strip() for c in args.classes.split(",")] if args.classes else None,
                 depths=args.depths, depth_max_tokens=args.depth_max_tokens, concurrency=args.concurrency,
                 concurrency_max_tokens=args.concurrency_max_tokens, capacity_contexts=args.capacity_contexts,
                 capacity_streams=args.capacity_streams, capacity_context=args.capacity_context,
                 capacity_max_tokens=args.capacity_max_tokens, server_log=args.server_log,
                 compression_lengths=args.compression_lengths, compression_rate=args.compression_rate,
                 compression_max_tokens=args.compression_max_tokens)
    s.check()
    return s


async def _bench(run: Run, result: dict) -> None:
    """Measures into `result` as it goes: what the suites that finished measured is there whatever stops the run."""
    settings = run.settings
    extra = {"chat_template_kwargs": {"enable_thinking": False}} if run.no_think else {}
    ep = Endpoint(run.base_url, run.api_key, run.model, run.api, run.timeout, extra, stream=run.stream)
    concurrency = max(settings.concurrency + [settings.capacity_streams, 1])
    progress = Progress(run.progress)
    async with make_client(ep, concurrency) as client:
        card = await detect_model(client, ep)
        ep.model = card["id"]
        result.update(model=ep.model, max_model_len=card.get("max_model_len"),
                      server_version=await server_version(client))
        if "compression" in run.suites:
            from onespark.bench.compression import check_proxy

            await check_proxy(client, ep)
        runner = Runner(client, ep, settings, card.get("max_model_len"), progress)
        for name in run.suites:
            result["running"] = name
            try:
                if name == "quality":
                    result["quality"] = await _quality(run, ep, client, progress)
                else:
                    result["suites"][name] = await getattr(runner, name)()
            except UserError as e:  # this suite cannot go on: the suites before it measured what they did
                result["stopped"] = {"suite": name, "error": str(e)}
                break
    del result["running"]


async def _quality(run: Run, ep_a: Endpoint, client_a, progress: Progress) -> dict:
    from onespark.bench.quality import record, run_ab

    settings = run.settings
    classes = published_classes()["classes"]
    if settings.classes:
        classes = [c for c in classes if c["name"] in settings.classes]
    prompts = [(c["name"], c["prompt"]) for c in classes]
    max_tokens = settings.max_tokens_cap or 256
    if not run.b_base_url:  # record A only; `onespark bench compare` pairs it with B's recording later
        progress.start("quality (record)", len(prompts))
        try:
            return {"record": await record(ep_a, client_a, prompts, max_tokens, run.top_k, progress)}
        finally:
            progress.close()
    ep_b = Endpoint(run.b_base_url, run.b_api_key, run.b_model, run.api, run.timeout, dict(ep_a.extra_body),
                    flag="--b-base-url")
    async with make_client(ep_b) as client_b:
        ep_b.model = (await detect_model(client_b, ep_b))["id"]
        progress.start("quality", 2 * len(prompts))
        try:
            q = await run_ab(ep_a, ep_b, client_a, client_b, prompts, max_tokens, run.top_k, progress)
        finally:
            progress.close()
    q["model_b"] = ep_b.model
    return q


def _compare(args) -> int:
    """`onespark bench compare A B`: the deltas of two result files, and their recorded quality."""
    a, b = report.load_result(args.a), report.load_result(args.b)
    for path, r in ((args.a, a), (args.b, b)):
        if r.get("failed_requests"):
            raise UserError(f"{path} has {r['failed_requests']} failed requests: its figures are incomplete; "
                            "re-run that benchmark")
    rows = report.compare(a, b)
    differ = report.settings_diff(a, b)
    if differ:  # said first, so nobody reads a delta of --max-tokens 64 vs 256 as the server's
        print(f"note: A and B ran with different settings ({'; '.join(differ)}): a delta may come from "
              "them rather than from the servers\n")
    quality = _recorded_quality(a, b, args.a, args.b)
    if not rows and quality is None:
        raise UserError(f"{args.a} and {args.b} share no suite and group to compare")
    if rows:
        print(report.compare_table(rows, args.a, args.b, md=args.markdown))
    if quality is not None:
        view = {"quality": quality, "endpoint": args.a, "endpoint_b": args.b}
        for title, headers, body in report.tables(view):
            print(report.table_text(title, headers, body, md=args.markdown))
    return 0


def read_run(args) -> Run:
    """The run, every flag checked (and the output directory writable) before anything is sent."""
    names = _suites(args.suite)
    model = args.model
    if args.spec:
        from onespark.model import specs
        model = model or specs.get(args.spec, flag="--spec").name  # = the --served-model-name serve --spec sets
    key, b_key = resolve_keys(args)
    if "--api-key" in sys.argv or any(a.startswith("--api-key=") for a in sys.argv):
        print("onespark bench: warning: --api-key shows the key to every user in `ps`; use --api-key-file or "
              "$OPENAI_API_KEY", file=sys.stderr)
    settings = settings_from(args)
    if args.no_think and args.api != "chat":
        raise UserError("--no-think works through the chat template: use it with --api chat")
    for url, flag in ((args.base_url, "--base-url"), (args.b_base_url, "--b-base-url")):
        if url:  # a URL httpx cannot parse fails now, not after the suites before quality
            Endpoint(url, flag=flag)
    report.check_writable(args.out)  # before the run: what it measures must have somewhere to go
    if not args.no_png:
        report.require_png()
    return Run(suites=names, settings=settings, base_url=args.base_url, api_key=key, model=model,
               b_base_url=args.b_base_url, b_api_key=b_key, b_model=args.b_model, api=args.api, timeout=args.timeout,
               no_think=args.no_think, stream=not args.no_stream, progress=not args.no_progress, top_k=args.top_k,
               out=args.out, png=not args.no_png, name=args.name,
               record=dict(hardware=args.hardware, gpu=args.gpu, image=args.image, note=args.note, spec=args.spec))


def _result(run: Run, created: dt.datetime, body: dict) -> dict:
    """The result file's content: what ran where, with which settings, and the measurements."""
    rows = [r for s in body["suites"].values() for r in s["rows"]]
    settings_record = {k: v for k, v in vars(run.settings).items()}
    settings_record.update(api=run.api, no_think=run.no_think, stream=run.stream, timeout_s=run.timeout,
                           suites=run.suites)
    result = {
        "kind": "onespark-bench",
        "schema_version": report.SCHEMA_VERSION,
        "created_utc": created.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "onespark_version": __version__,
        "git_sha": _git_sha(),
        "command": _command(),
        "hardware": run.record["hardware"],
        "gpu": run.record["gpu"],
        "image": run.record["image"],
        "note": run.record["note"],
        "spec": run.record["spec"],
        "endpoint": Endpoint(run.base_url).base_url,
        "endpoint_b": run.b_base_url,
        **body,
        "settings": settings_record,
        "requests": len(rows),
        "failed_requests": sum(not r["ok"] for r in rows),
    }
    return redact(result, secrets(run))  # a key passed anywhere (--note, a URL) is never recorded


def _result_text(result: dict) -> str:
    text = json.dumps(result, indent=1)
    if len(text) > 200_000:  # e.g. whole-vocabulary logprobs: indentation would double a file nobody reads by eye
        text = json.dumps(result, separators=(",", ":"))
    return text + "\n"


def _write(run: Run, result: dict, stem: str, wrote: list[Path]) -> None:
    """NAME.json, .md and .png under --out; `wrote` gets each file once it is in place (JSON first: it is the
    record every other output, and `bench compare`, is made from)."""
    out = Path(run.out)
    report.write_atomic(out / f"{stem}.json", _result_text(result))
    wrote.append(out / f"{stem}.json")
    report.write_atomic(out / f"{stem}.md", report.markdown(result) + "\n")
    wrote.append(out / f"{stem}.md")
    if run.png and report.plot(result, out / f"{stem}.png"):
        wrote.append(out / f"{stem}.png")


def _what(e: OSError) -> str:
    """What went wrong, without the CLI's usual fix (its "run the same command again (finished files are kept)"
    is not true of a benchmark: the run is over, and the fix is where the measurements went)."""
    return f"{e.filename}: {e.strerror}" if e.filename else str(e.strerror or e)


def _keep(result: dict, stem: str, error: OSError) -> str:
    """--out failed after the run (disk full, permissions changed): the measurements, still in memory, go to the
    temp directory or the home directory, else to stdout as JSON. Returns the one line that says where."""
    why = _what(error)
    text = _result_text(result)
    for d in (Path(tempfile.gettempdir()), Path.home()):
        p = d / f"onespark-bench-{stem}.json"
        if not d.is_dir():  # write_atomic would create it: a fallback never makes directories
            continue
        try:
            p = report.write_new(p, text)  # the last failed run of this --name keeps its file
        except OSError:
            continue
        return (f"could not write the results ({why}); the measurements are saved in {p} instead: move it "
                f"into --out once there is room (`onespark bench compare` reads it from anywhere)")
    print(text, end="")
    return (f"could not write the results ({why}), nor to {tempfile.gettempdir()} or {Path.home()}: the "
            f"measurements are the JSON printed above on stdout; save it to a file (it is a complete result)")


def run(args) -> int:
    if args.action == "compare":
        return _compare(args)
    if args.action == "spark-model":
        from onespark.bench import spark_model

        return spark_model.cli(args.write, args.steps, _command(), _git_sha(), args.start)
    bench_run = read_run(args)
    created = dt.datetime.now(dt.timezone.utc)
    body: dict = {"suites": {}}
    interrupted = False
    try:
        asyncio.run(_bench(bench_run, body))
    except KeyboardInterrupt:  # Ctrl-C: the suites that finished are written as a stopped run's are
        if "running" not in body:
            raise
        body["stopped"] = {"suite": body.pop("running"), "error": "interrupted (Ctrl-C)"}
        interrupted = True
        if not body["suites"] and "quality" not in body:
            raise
    stopped = body.get("stopped")
    if stopped and not body["suites"] and "quality" not in body:  # nothing measured: nothing to keep
        raise UserError(stopped["error"])
    result = _result(bench_run, created, body)
    stem = bench_run.name or f"{'-'.join(bench_run.suites)}-{created.strftime('%Y%m%dT%H%M%SZ')}"
    wrote: list[Path] = []
    try:
        _write(bench_run, result, stem, wrote)
        kept = None
    except OSError as e:  # the JSON first: when it is in place, only the tables or the plot are missing
        kept = (f"could not write all the results ({_what(e)}); the measurements are in {wrote[0]}, "
                "the tables are printed above") if wrote else _keep(result, stem, e)
    print(report.console(result))
    if wrote:
        print("wrote " + ", ".join(map(str, wrote)))
    if kept:
        print(f"onespark bench: error: {kept}", file=sys.stderr)
        return 1
    if stopped:
        print(f"onespark bench: error: {stopped['suite']} stopped ({redact(stopped['error'], secrets(bench_run))}); "
              f"what the suites before it measured is kept in {wrote[0]}", file=sys.stderr)
        return 130 if interrupted else 1
    rows = [r for s in body["suites"].values() for r in s["rows"]]
    failed = [r for r in rows if not r["ok"]]
    empty = [n for n, s in body["suites"].items() if n != "capacity" and not any(r["ok"] for r in s["rows"])]
    if empty and not failed:
        print(f"onespark bench: error: nothing measured in {', '.join(empty)} (see skipped in the JSON): "
              "lower --depths / max tokens to fit the server's max_model_len", file=sys.stderr)
        return 1
    if failed:
        print(f"onespark bench: error: {len(failed)} of {len(rows)} requests failed (first: "
              f"{redact(failed[0]['error'], secrets(bench_run))}); "
              "their figures are left out of every summary", file=sys.stderr)
        return 1
    return 0


def _command() -> str:
    argv = sys.argv[1:]
    if argv[:1] != ["bench"]:  # called from Python (tests): the settings below are the record
        return "(called from Python; see settings)"
    return "onespark " + shlex.join(_redacted(argv))


SECRET_FLAGS = ("--api-key", "--b-api-key")


def _redacted(argv: list[str]) -> list[str]:
    """The command line for the record, without API keys."""
    out, hide = [], False
    for a in argv:
        if hide:
            out.append("***")
            hide = False
        elif a in SECRET_FLAGS:
            out.append(a)
            hide = True
        elif a.startswith(tuple(f + "=" for f in SECRET_FLAGS)):
            out.append(a.split("=", 1)[0] + "=***")
        else:
            out.append(a)
    return out
