"""The one CLI: `onespark COMMAND ...`.

Each command lives in its own module exposing `add_arguments(parser)` and `run(args) -> int`.
Modules are imported only when their command runs, so `onespark --help` stays instant and
a host without torch can run every checkpoint command.
"""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
import sys

from onespark import __version__
from onespark.errors import UserError, os_error_message

# name -> (module, one-line help). A table on purpose (`duplicates` pairs its same-shape rows): one row a command.
COMMANDS: dict[str, tuple[str, str]] = {
    "specs": ("onespark.specs", "the supported models: repos, pinned revisions, shapes, MTP layout, serving defaults"),
    "doctor": ("onespark.doctor", "preflight: GPU, driver, Docker, NVIDIA runtime, disk, memory, Hugging Face"),
    "synth": ("onespark.synth", "write a small checkpoint in the real Intel INT4 / Qwen FP8 formats"),
    "download": ("onespark.download", "step 0: the INT4 checkpoint, and the FP8 shared experts by byte range"),
    "hybrid": ("onespark.hybrid", "step 1: splice FP8 shared-expert weights into the INT4 checkpoint"),
    "mtp": ("onespark.mtp", "step 2: make every mtp.* tensor loadable"),
    "verify": ("onespark.verify", "check a checkpoint against its index, config and manifest"),
    "draft-vocab": ("onespark.draft_vocab", "the MTP draft's vocabulary subset: the K most frequent token ids"),
    "tiny-model": ("onespark.tinymodel", "write a tiny servable model (weights + tokenizer) that vLLM runs on CPU"),
    "serve": ("onespark.serve", "launch the v2 / v2-tq container on 127.0.0.1 and wait until it answers"),
    "cluster": ("onespark.cluster", "two Sparks: preflight both, Ray head + worker, vLLM TP=2 (or PP=2) across them"),
    "bench": ("onespark.bench.cli", "benchmark an OpenAI-compatible endpoint (published, depth, concurrency, ...)"),
}


class _Parser(argparse.ArgumentParser):
    """argparse, minus the echo of values it did not understand: `--api-ke sk-...` must not print the key
    (as an unrecognized argument, or as an "invalid choice" of the next positional, e.g. bench's `compare`)."""

    def error(self, message: str):
        head, sep, rest = message.partition("unrecognized arguments: ")
        if sep:
            flags = [a for a in rest.split() if a.startswith("-")]
            message = f"{head}unrecognized arguments: {' '.join(flags) or '(values not shown)'}"
        # a choice typo (--api chta) stays readable; a value as long as a key is not echoed
        message = re.sub(r"invalid choice: '([^']{12,})'", "invalid choice: (value not shown)", message)
        super().error(message)


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"onespark {__version__}", "", "usage: onespark COMMAND [options]   (onespark COMMAND --help)", ""]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] == "--version":
        print(__version__)
        return 0
    name = argv[0]
    if name not in COMMANDS:
        print(f"onespark: error: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, help_ = COMMANDS[name]
    module = importlib.import_module(module_name)
    # allow_abbrev=False: argparse would take a prefix (--api-ke KEY) for the flag, and its value past the
    # redaction of the recorded command line; every parser here turns that off
    parser = _Parser(prog=f"onespark {name}", description=help_, allow_abbrev=False)
    module.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    if name in ("download", "hybrid", "mtp"):  # the commands that lock a directory; none takes a key
        from onespark import lock  # who holds an output directory, for the message a second writer gets
        lock.COMMAND = "onespark " + shlex.join(argv)
    try:
        return int(module.run(args) or 0)
    except UserError as e:
        print(f"onespark {name}: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # permission denied, disk full, not a directory...: one line naming the path, no traceback
        print(f"onespark {name}: error: {os_error_message(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"onespark {name}: interrupted; re-run the same command to resume", file=sys.stderr)
        return 130
