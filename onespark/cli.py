"""The one CLI: `onespark COMMAND ...`.

Each command lives in its own module exposing `add_arguments(parser)` and `run(args) -> int`.
Modules are imported only when their command runs, so `onespark --help` stays instant and
a host without torch can run every checkpoint command.
"""

from __future__ import annotations

import importlib
import os
import select
import shlex
import signal
import sys

from onespark import __version__
from onespark.errors import UserError, os_error_message
from onespark.options import Parser, redact_argv

# name -> (module, one-line help). A table on purpose (`duplicates` pairs its same-shape rows): one row a command.
COMMANDS: dict[str, tuple[str, str]] = {
    "specs": ("onespark.model.specs", "the supported models: repos, pinned revisions, shapes, MTP layout, serving defaults"),
    "doctor": ("onespark.serving.doctor", "preflight: GPU, driver, Docker, NVIDIA runtime, disk, memory, Hugging Face"),
    "synth": ("onespark.checkpoint.synth", "write a small checkpoint in the real Intel INT4 / Qwen FP8 formats"),
    "download": ("onespark.checkpoint.download", "step 0: the INT4 checkpoint, and the FP8 shared experts by byte range"),
    "hybrid": ("onespark.checkpoint.hybrid", "step 1: splice FP8 shared-expert weights into the INT4 checkpoint"),
    "mtp": ("onespark.checkpoint.mtp", "step 2: make every mtp.* tensor loadable"),
    "verify": ("onespark.checkpoint.verify", "check a checkpoint against its index, config and manifest"),
    "draft-vocab": ("onespark.checkpoint.draft_vocab", "the MTP draft's vocabulary subset: the K most frequent token ids"),
    "tiny-model": ("onespark.checkpoint.tinymodel", "write a tiny servable model (weights + tokenizer) that vLLM runs on CPU"),
    "serve": ("onespark.serving.serve", "launch the v2 / v2-tq container on 127.0.0.1 and wait until it answers"),
    "cluster": ("onespark.serving.cluster", "two Sparks: preflight both, Ray head + worker, vLLM TP=2 (or PP=2) across them"),
    "compress": ("onespark.serving.compress", "LLMLingua-2 prompt compression: a proxy in front of vLLM, opt-in per request"),
    "bench": ("onespark.bench.cli", "benchmark an OpenAI-compatible endpoint (published, depth, concurrency, ...)"),
}


# The commands that write a checkpoint directory: they lock it, and a re-run resumes what they were writing.
WRITERS = ("download", "hybrid", "mtp", "synth")


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"onespark {__version__}", "", "usage: onespark COMMAND [options]   (onespark COMMAND --help)", ""]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def _stdout_closed() -> bool:
    """Whether our stdout's reader went away (`onespark ... | head -1`): Linux's poll reports POLLERR for a
    pipe without readers. A broken pipe elsewhere (a child's stdin, a socket) is an error like any other."""
    try:
        p = select.poll()
        p.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in p.poll(0))
    except (OSError, ValueError):
        return False


def _end_as_coreutils_do() -> None:
    """Die of SIGPIPE, silently, as `yes | head -1` does: the shell sees 141, nothing is printed. Python ignores
    SIGPIPE (so a write raises BrokenPipeError instead); put the default back and raise it."""
    sys.stderr.flush()
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGPIPE)


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            return _main(sys.argv[1:] if argv is None else argv)
        finally:  # what is still buffered, before the interpreter's own flush at exit finds stdout closed
            sys.stdout.flush()
    except BrokenPipeError:  # from a print outside a command (usage, --help) or that flush
        if not _stdout_closed():
            raise
        _end_as_coreutils_do()
        raise  # not reached: SIGPIPE ends the process


def _main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] == "--version":
        print(__version__)
        return 0
    name = argv[0]
    if name not in COMMANDS:
        shown = redact_argv(argv)[0] if name.startswith("-") else name  # `onespark --api-key=KEY`
        print(f"onespark: error: unknown command {shown!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, help_ = COMMANDS[name]
    module = importlib.import_module(module_name)
    # allow_abbrev=False: argparse would take a prefix (--api-ke KEY) for the flag, and its value past the
    # redaction of the recorded command line; every parser here turns that off
    parser = Parser(prog=f"onespark {name}", description=help_, allow_abbrev=False)
    module.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    if name in WRITERS:
        from onespark.checkpoint import lock  # who holds an output directory, for the message a second writer gets
        lock.COMMAND = "onespark " + shlex.join(redact_argv(argv))
    try:
        return int(module.run(args) or 0)
    except UserError as e:
        print(f"onespark {name}: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # permission denied, disk full, not a directory...: one line naming the path, no traceback
        if isinstance(e, BrokenPipeError) and _stdout_closed():
            _end_as_coreutils_do()
        print(f"onespark {name}: error: {os_error_message(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the checkpoint writers resume; a bench that measured a suite has written it (bench/cli.py)
        print(f"onespark {name}: interrupted" + ("; re-run the same command to resume" if name in WRITERS else ""),
              file=sys.stderr)
        return 130
