"""Writers: JSON (atomic), console and Markdown tables, PNG plots, and the A-vs-B comparison of two results."""

from __future__ import annotations

import errno
import os
import tempfile
import textwrap
from pathlib import Path

from onespark import shape
from onespark.bench.stats import summarize, welch
from onespark.errors import UserError, at_path
from onespark.shape import Int, ListOf, MapOf, Nullable, Num, Obj, OneOf, Str

SCHEMA_VERSION = 1
COMPARED = ("e2e_tok_s", "decode_tok_s", "ttft_s", "prefill_tok_s")  # the metrics `compare` pairs


def write_atomic(path: str | Path, data: bytes | str) -> None:
    """Write to a temp file in the same directory, then rename: a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with at_path(path, tmp), os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; a result is meant to be read by others
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_new(path: str | Path, data: bytes | str) -> Path:
    """Write `path`, or NAME-2.json, NAME-3.json ... where that name is taken: never over an existing file (in a
    shared directory such as /tmp, the next run of the same --name, or another user's file), and whole: written
    to a temp name first, then hard-linked to the free name (a link fails on an existing name, where a rename
    would replace it). Returns the path written."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.urandom(6).hex()}.new")
    write_atomic(tmp, data)
    try:
        for n in range(1, 10_000):
            final = path if n == 1 else path.with_name(f"{path.stem}-{n}{path.suffix}")
            try:
                os.link(tmp, final)
                return final
            except FileExistsError:
                continue
        raise OSError(errno.EEXIST, "10,000 files of this name exist", str(path))
    finally:
        os.unlink(tmp)


def check_writable(directory: str | Path) -> None:
    """Create `directory` and a file in it, now: an unwritable --out fails before the run, not after it
    (raises OSError naming the path; the CLI prints it as one line)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    try:
        fd, tmp = tempfile.mkstemp(prefix=".onespark-write-check.", dir=directory)
    except OSError as e:  # named after the directory the user gave, not the probe's random name
        raise OSError(e.errno, e.strerror, str(directory)) from e
    os.close(fd)
    os.unlink(tmp)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# What `bench compare` reads of a result file, declared (onespark.shape); the rest is passed over.
# Every compared metric is a rate or a time, never below 0; 1e12 tok/s or s is no measurement either, and the bound
# keeps Welch's std**2 and B - A finite (1e200 would overflow to a traceback, 1e308 to a delta of inf).
_VALUE = Num(lo=0, hi=1e12)
_STATS = Nullable(Obj({"mean": _VALUE, "std": _VALUE, "n": Int(0)}, what="summary statistics {mean, std, n}"))
_GROUP = Obj({"group": OneOf(Str(), Num()), "summary": Obj(optional=dict.fromkeys(COMPARED, _STATS))},
             {"aggregate_tok_s": _STATS}, what="a group {group, summary, ...}")
_SUITE = Obj({"groups": ListOf(_GROUP)}, what="a suite {groups: [...]}")
_PUBLISHED = Obj({"groups": ListOf(_GROUP), "cross_class": Obj(optional=dict.fromkeys(COMPARED, _STATS))},
                 what="a suite {groups: [...], cross_class}")
_CAPACITY = Obj({"estimates": ListOf(Obj({"context": OneOf(Int(), Str())},
                                         dict.fromkeys(("kv_cache_tokens", "users"), Nullable(Int(0, 2**53)))))},
                what="a suite {estimates: [...]}")
_RECORDING = Nullable(Obj({"top_k": Int(1), "max_tokens": Int(1), "rows": ListOf(Obj({
    "group": Str(), "prompt": Str(), "tokens": ListOf(str),
    "top_logprobs": ListOf(Nullable(MapOf(Num(hi=1.0, what="a log probability"))))}))},
    what="a recording {top_k, max_tokens, rows}"))
RESULT = Obj({"kind": Str(), "schema_version": Int()}, {
    "suites": Obj(optional={"published": Nullable(_PUBLISHED), "depth": Nullable(_SUITE),
                            "concurrency": Nullable(_SUITE), "capacity": Nullable(_CAPACITY)}),
    "settings": Nullable(dict), "failed_requests": Nullable(Int(0)),
    "quality": Nullable(Obj(optional={"record": _RECORDING, "record_a": _RECORDING})),
}, what="an `onespark bench` result object")


def load_result(path: str) -> dict:
    """A result file, checked: one UserError naming the file, the field and the fix for anything else."""
    fix = "pass a result written by `onespark bench` (it is damaged, or another kind of file)"
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from e
    data = shape.parse(raw, path, fix)
    if not isinstance(data, dict) or data.get("kind") != "onespark-bench":
        raise UserError(f"{path} is not an `onespark bench` result (no kind: onespark-bench)")
    if data.get("schema_version") != SCHEMA_VERSION:
        raise UserError(f"{path} has schema_version {shape.describe(data.get('schema_version'))}, this onespark "
                        f"reads {SCHEMA_VERSION}: re-run the benchmark with this version")
    return shape.check(data, RESULT, path, fix)


# ------------------------------------------------------------------ tables
def _f(x, digits=1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _ms(summary: dict | None, key="mean", digits=1, scale=1.0) -> str:
    if not summary:
        return "-"
    return _f(summary[key] * scale, digits)


def _pm(summary: dict | None, digits=1, scale=1.0) -> str:
    """mean ± std (n)"""
    if not summary:
        return "-"
    return f"{summary['mean'] * scale:.{digits}f} ± {summary['std'] * scale:.{digits}f}"


def _accept(sd: dict | None) -> str:
    if not sd or sd.get("mean_acceptance_length") is None:
        return "off" if sd is None else "-"
    rate = "-" if sd.get("acceptance_rate") is None else f"{100 * sd['acceptance_rate']:.0f}%"  # no draft tokens
    return f"{sd['mean_acceptance_length']:.2f} ({rate})"


Table = tuple[str, list[str], list[list[str]]]  # (title, headers, rows)


def _published_table(s: dict, result: dict) -> Table:
    """The five prompt classes, the warm-up and the cross-class line."""
    headers = ["class", "max tok", "n", "e2e tok/s (published method)", "median", "decode tok/s", "TTFT s",
               "tokens", "tok/chunk", "accept len"]
    rows = []
    for g in s["groups"]:
        m = g["summary"]
        rows.append([str(g["group"]), str(g["max_tokens"]), str(m["e2e_tok_s"]["n"] if m["e2e_tok_s"] else 0),
                     _pm(m["e2e_tok_s"]), _ms(m["e2e_tok_s"], "median"), _pm(m["decode_tok_s"]),
                     _ms(m["ttft_s"], "median", 3), _ms(m["completion_tokens"], "mean", 0),
                     _ms(m.get("tokens_per_chunk"), "mean", 2),
                     _accept(g.get("spec_decode") if s.get("spec_decode") else None)])
    warm = summarize(r["e2e_tok_s"] for r in s["rows"] if r["warmup"] and r["ok"])
    if warm:
        rows.append(["warm-up (excluded)", "", str(warm["n"]), _pm(warm), _ms(warm, "median"), "", "", "", "",
                     ""])
    cc = s["cross_class"]
    rows.append(["cross-class", "", str(cc["classes_measured"]), _pm(cc["e2e_tok_s"]),
                 _ms(cc["e2e_tok_s"], "median"), _pm(cc["decode_tok_s"]), "", "", "", _accept(s.get("spec_decode"))])
    how = "" if result.get("settings", {}).get("stream", True) else ", non-streamed requests timed whole"
    return (f"published: five prompt classes, single stream, temperature 0{how}", headers, rows)


def _depth_table(s: dict, result: dict) -> Table:
    """Context depth vs rates; skipped depths say why."""
    headers = ["depth", "prompt tok", "n", "TTFT s", "prefill tok/s", "decode tok/s", "e2e tok/s"]
    rows = [[str(g["group"]), _ms(g["summary"]["prompt_tokens"], "mean", 0),
             str(g["summary"]["requests"] - g["summary"]["failed"]), _ms(g["summary"]["ttft_s"], "median", 3),
             _pm(g["summary"]["prefill_tok_s"], 0), _pm(g["summary"]["decode_tok_s"]),
             _pm(g["summary"]["e2e_tok_s"])] for g in s["groups"]]
    rows += [[str(k["depth"]), "skipped", "", k["reason"], "", "", ""] for k in s.get("skipped", [])]
    return (f"depth: context depth vs rates, {s['max_tokens']} new tokens, accept len "
            f"{_accept(s.get('spec_decode'))}", headers, rows)


def _concurrency_table(s: dict, result: dict) -> Table:
    """Per-stream and aggregate rates by number of streams."""
    headers = ["streams", "n", "per-stream decode tok/s", "per-stream e2e tok/s", "aggregate tok/s",
               "TTFT p50 s", "TTFT p99 s", "ITL p99 ms"]
    rows = [[str(g["group"]), str(g["summary"]["requests"] - g["summary"]["failed"]),
             _pm(g["summary"]["decode_tok_s"]), _pm(g["summary"]["e2e_tok_s"]), _pm(g["aggregate_tok_s"]),
             _ms(g["summary"]["ttft_s"], "p50", 3), _ms(g["summary"]["ttft_s"], "p99", 3),
             _ms(g["summary"].get("itl_ms"), "p99", 1)] for g in s["groups"]]
    return (f"concurrency: {s['max_tokens']} new tokens per stream, accept len "
            f"{_accept(s.get('spec_decode'))}", headers, rows)


def _capacity_table(s: dict, result: dict) -> Table:
    """Concurrent users per context length: estimates, vLLM's own figure, the measured load."""
    headers = ["context", "KV cache tokens", "concurrent users", "source"]
    rows = [[str(e["context"]), str(e["kv_cache_tokens"] or "-"), str(e["users"] if e["users"] is not None else "-"),
             e["source"] or "no log and no cache_config_info"] for e in s["estimates"]]
    log = s.get("server_log") or {}
    if log.get("max_concurrency_at_max_model_len") is not None:
        rows.append([str(log["max_model_len"]), str(log.get("kv_cache_tokens", "-")),
                     f"{log['max_concurrency_at_max_model_len']:.2f}x", "server log: vLLM's own figure"])
    if s.get("load"):
        ld = s["load"]
        use = "-" if ld["peak_kv_usage"] is None else f"{100 * ld['peak_kv_usage']:.3g}%"
        rows.append([str(ld["context"]), f"peak use {use}",
                     str(ld["users_at_context_measured"] or "-"),
                     f"measured: {ld['streams']} streams, peak {ld['peak_running']} running"
                     + (f", run {ld['attempts']} times" if ld.get("attempts", 1) > 1 else "")
                     + (f" ({ld['note']})" if ld.get("note") else "")])
    return ("capacity: KV cache and concurrent users per context length", headers, rows)


def _quality_table(result: dict) -> Table:
    """A/B greedy agreement and KL, or a recording waiting for its pair."""
    q = result["quality"]
    if "rows" in q:
        headers = ["prompt", "tokens A/B", "identical tokens", "first divergence", "KL mean (nats)", "KL max"]
        rows = [[str(r["group"]), f"{r['tokens_a']}/{r['tokens_b']}", f"{100 * r['identical_token_frac']:.1f}%",
                 "none" if r["first_divergence"] is None else str(r["first_divergence"]),
                 _f(r["kl_mean"], 5), _f(r["kl_max"], 5)] for r in q["rows"]]
        return (f"quality A/B: greedy, top-{q['top_k']} logprobs, A={result['endpoint']} "
                f"B={result['endpoint_b']}", headers, rows)
    rec = q["record"]
    rows = [[str(r["group"]), str(len(r["tokens"]))] for r in rec["rows"]]
    return (f"quality, recorded (greedy, top-{rec['top_k']} logprobs): pair it with another "
            "recording in `onespark bench compare`", ["prompt", "tokens"], rows)


def _compression_table(s: dict, result: dict) -> Table:
    from onespark.bench.compression import table

    return table(s, result)


# suite -> its table, in the order they are printed
_SUITE_TABLES = {"published": _published_table, "depth": _depth_table, "concurrency": _concurrency_table,
                 "capacity": _capacity_table, "compression": _compression_table}


def tables(result: dict) -> list[Table]:
    """(title, headers, rows) for every suite in a result, then the quality comparison."""
    suites = result.get("suites", {})
    out = [table(suites[name], result) for name, table in _SUITE_TABLES.items() if name in suites]
    if "quality" in result:
        out.append(_quality_table(result))
    return out


def table_text(title: str, headers: list[str], rows: list[list[str]], md: bool = False) -> str:
    if md:
        lines = [f"*{title}*", "", "| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
        return "\n".join(lines) + "\n"
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = [title, "  ".join(h.ljust(w) for h, w in zip(headers, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines) + "\n"


def console(result: dict) -> str:
    return "\n".join([_provenance(result), ""] + [table_text(*t) for t in tables(result)])


def _provenance(result: dict) -> str:
    return (f"{result.get('hardware') or 'hardware not given'} | model {result.get('model')} | "
            f"server vLLM {result.get('server_version') or '?'} | image {result.get('image') or '-'} | "
            f"gpu {result.get('gpu') or '-'} | {result.get('created_utc')} | onespark {result.get('git_sha') or '?'}")


def markdown(result: dict) -> str:
    lines = [f"**{_provenance(result)}**", "", f"Command: `{result.get('command')}`", ""]
    if result.get("note"):
        lines[3:3] = [f"Note: {result['note']}", ""]
    return "\n".join(lines + [table_text(*t, md=True) for t in tables(result)])


# ------------------------------------------------------------------ plots
def require_png() -> None:
    """Raise UserError now, before a run, when the PNG cannot be drawn (not after an hour of measuring)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise UserError("PNG output needs matplotlib, which is not installed: pip install 'onespark[bench]', "
                        "or pass --no-png (checked before the run)") from e


def _errorbar(ax, xs: list, stats: list[dict | None], label: str, marker: str = "o") -> None:
    """mean ± std at each x that has a summary."""
    ok = [(x, st) for x, st in zip(xs, stats) if st]
    ax.errorbar([x for x, _ in ok], [st["mean"] for _, st in ok], yerr=[st["std"] for _, st in ok],
                marker=marker, capsize=3, label=label)


def _plot_published(ax, s: dict) -> None:
    groups = s["groups"]
    labels = [str(g["group"]) for g in groups] + ["cross-class"]
    series = [("end-to-end (published method)", "e2e_tok_s"), ("decode", "decode_tok_s")]
    width = 0.38
    for j, (lab, key) in enumerate(series):
        means = [g["summary"][key]["mean"] if g["summary"][key] else 0 for g in groups]
        stds = [g["summary"][key]["std"] if g["summary"][key] else 0 for g in groups]
        cc = s["cross_class"][key]
        means.append(cc["mean"] if cc else 0)
        stds.append(cc["std"] if cc else 0)
        xs = [i + (j - 0.5) * width for i in range(len(labels))]
        ax.bar(xs, means, width, yerr=stds, capsize=3, label=lab)
    ax.set_xticks(range(len(labels)), labels, rotation=20)
    top = max((g["summary"][k]["mean"] + g["summary"][k]["std"]) for g in groups
              for _, k in series if g["summary"][k]) if any(g["summary"]["e2e_tok_s"] for g in groups) else 1
    ax.set_ylim(0, 1.3 * top)  # room for the legend above the error bars
    ax.set_ylabel("tok/s (mean ± std over runs)")
    ax.set_title("published prompt classes")
    ax.legend(fontsize=8, ncol=2, loc="upper left")


def _plot_depth(ax, s: dict) -> None:
    groups = s["groups"]
    xs = [g["group"] for g in groups]
    for lab, key in (("decode", "decode_tok_s"), ("end-to-end", "e2e_tok_s")):
        _errorbar(ax, xs, [g["summary"][key] for g in groups], lab)
    ax.set_xlabel("context depth (tokens)")
    ax.set_ylabel("tok/s")
    ax2 = ax.twinx()
    ok = [(x, g["summary"]["prefill_tok_s"]) for x, g in zip(xs, groups) if g["summary"]["prefill_tok_s"]]
    ax2.plot([x for x, _ in ok], [st["mean"] for _, st in ok], "s--", color="gray", label="prefill")
    ax2.set_ylabel("prefill tok/s", color="gray")
    if max(xs) > 4096:
        ax.set_xscale("symlog", linthresh=4096)  # 0, 4K ... 256K: spread the short depths out
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=8, ncol=3, loc="upper left")  # one legend for both axes
    ax.set_title("rate vs context depth")


def _plot_concurrency(ax, s: dict) -> None:
    groups = s["groups"]
    xs = [g["group"] for g in groups]
    for lab, key in (("per-stream decode", "decode_tok_s"), ("per-stream end-to-end", "e2e_tok_s")):
        _errorbar(ax, xs, [g["summary"][key] for g in groups], lab)
    _errorbar(ax, xs, [g["aggregate_tok_s"] for g in groups], "aggregate", marker="s")
    ax.set_xticks(xs)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("tok/s")
    ax.set_title("rate vs concurrency")
    ax.legend(fontsize=8, ncol=2, loc="upper left")


# suite -> its panel, left to right
_SUITE_PANELS = {"published": _plot_published, "depth": _plot_depth, "concurrency": _plot_concurrency}


def plot(result: dict, path: str | Path) -> bool:
    """One PNG with a panel per suite that has something to draw. False when there is nothing to draw."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise UserError("PNG output needs matplotlib: pip install 'onespark[bench]', or pass --no-png") from e
    suites = result.get("suites", {})
    panels = [k for k in _SUITE_PANELS if k in suites and suites[k]["groups"]]
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.6), squeeze=False)
    for ax, name in zip(axes[0], panels):
        _SUITE_PANELS[name](ax, suites[name])
        ax.grid(alpha=0.3)
    fig.suptitle(textwrap.fill(_provenance(result), width=95 * len(panels)), fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.png")
    try:
        fig.savefig(tmp, dpi=110)
        os.replace(tmp, path)
    finally:  # a failed write (a full disk) leaves no temp file beside the results
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return True


# ------------------------------------------------------------------ compare
SETTINGS_NOT_COMPARED = ("suites", "server_log")  # which suites ran is matched per row; a log path says nothing


def settings_diff(a: dict, b: dict) -> list[str]:
    """The recorded settings (and served model) in which two results differ, e.g. ["runs 3 vs 5"]."""
    sa, sb = a.get("settings") or {}, b.get("settings") or {}
    out = [f"{k} {sa.get(k)!r} vs {sb.get(k)!r}" for k in sorted(set(sa) | set(sb))
           if k not in SETTINGS_NOT_COMPARED and sa.get(k) != sb.get(k)]
    for k in ("model", "max_model_len"):
        if a.get(k) != b.get(k):
            out.append(f"{k} {a.get(k)!r} vs {b.get(k)!r}")
    return out


def compare(a: dict, b: dict) -> list[dict]:
    """B vs A for every (suite, group, metric) both results have. Deltas with their noise (Welch SE)."""
    out = []
    metrics = COMPARED

    def add(suite, group, metric, sa, sb):
        if not sa or not sb:
            return
        w = welch(sa["mean"], sa["std"], sa["n"], sb["mean"], sb["std"], sb["n"])
        out.append({"suite": suite, "group": group, "metric": metric, "a": sa["mean"], "b": sb["mean"],
                    "n_a": sa["n"], "n_b": sb["n"], **w})

    for suite in ("published", "depth", "concurrency"):
        sa, sb = a.get("suites", {}).get(suite), b.get("suites", {}).get(suite)
        if not sa or not sb:
            continue
        gb = {str(g["group"]): g for g in sb["groups"]}
        for ga in sa["groups"]:
            g2 = gb.get(str(ga["group"]))
            if g2 is None:
                continue
            for m in metrics:
                add(suite, ga["group"], m, ga["summary"].get(m), g2["summary"].get(m))
            if suite == "concurrency":
                add(suite, ga["group"], "aggregate_tok_s", ga.get("aggregate_tok_s"), g2.get("aggregate_tok_s"))
        if suite == "published":
            for m in ("e2e_tok_s", "decode_tok_s"):
                add(suite, "cross-class", m, sa["cross_class"].get(m), sb["cross_class"].get(m))
    ca, cb = a.get("suites", {}).get("capacity"), b.get("suites", {}).get("capacity")
    if ca and cb:  # v2 vs v2-tq is mostly this: counts from the server, no run-to-run noise
        eb = {e["context"]: e for e in cb["estimates"]}
        for e in ca["estimates"]:
            e2 = eb.get(e["context"])
            for m in ("kv_cache_tokens", "users"):
                if e2 is not None and e.get(m) is not None and e2.get(m) is not None:
                    d = e2[m] - e[m]
                    out.append({"suite": "capacity", "group": e["context"], "metric": m, "a": e[m], "b": e2[m],
                                "n_a": 1, "n_b": 1, "delta": d, "delta_pct": 100.0 * d / e[m] if e[m] else None,
                                "se": None, "significant": None, "count": True})
    return out


def compare_table(rows: list[dict], path_a: str, path_b: str, md: bool = False) -> str:
    headers = ["suite", "group", "metric", "A", "B", "delta", "delta %", "± 2 SE", "verdict"]
    body = []
    for r in rows:
        if r.get("count"):
            verdict = "a count: no noise"
        elif r["significant"] is None:
            verdict = "n<2: noise unknown"
        else:
            verdict = "beyond noise" if r["significant"] else "within noise"
        body.append([r["suite"], str(r["group"]), r["metric"], _f(r["a"], 3), _f(r["b"], 3), _f(r["delta"], 3),
                     _f(r["delta_pct"], 1), _f(2 * r["se"], 3) if r["se"] is not None else "-", verdict])
    return table_text(f"B = {path_b} vs A = {path_a}", headers, body, md).rstrip("\n")
