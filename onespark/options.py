"""The CLI's argparse pieces: a parser whose errors never show a secret, and the one validator of numeric flags.

Standard library only: `onespark serve --dry-run`, `cluster --dry-run` and the memory guard run without the
project's virtualenv.
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import re
import sys
from pathlib import Path

# Words that make an environment variable's value a secret (serve --env passes it by name): HF_TOKEN, MY_API_KEY,
# AWS_SECRET_ACCESS_KEY, DB_PASSWORD. A name with one that is no secret (MAX_TOKENS) loses nothing by it.
SECRET_WORDS = ("key", "token", "secret", "password", "passwd")
# Key options and the shortest abbreviation that is still them: --api-k, --hf-t, --tok (--api is bench's
# chat/completions switch, --hf and --to are nothing yet).
SECRET_FLAG_PREFIXES = (("apikey", 4), ("hftoken", 3), ("token", 3))


def is_secret_name(name: str) -> bool:
    """An environment variable name that carries a secret: TOKEN, KEY, SECRET or PASSWORD in it."""
    return any(w in name.lower() for w in SECRET_WORDS)


def is_secret_flag(arg: str) -> bool:
    """A command-line word that looks like a key option, in any spelling or abbreviation: --api-key,
    --api_key=K, --API-KE, --apikey, --b-api-ke, --api-key-file, --hf-tok, --token, --auth-token. Not vLLM's
    --tokenizer, --max-num-batched-tokens or --kv-cache-dtype, nor bench's --api."""
    if not arg.startswith("-"):
        return False
    squashed = re.sub(r"[-_]", "", arg.split("=", 1)[0]).lower()
    # ends with an abbreviation: --api-ke, --b-api-k, --hf-tok
    if any(squashed.endswith(full[:i]) for full, n in SECRET_FLAG_PREFIXES for i in range(n, len(full) + 1)):
        return True
    return ("apikey" in squashed or "hftoken" in squashed or squashed.endswith("key")
            or any(w in squashed for w in ("secret", "password", "passwd")))


def secret_values(argv: list[str]) -> list[str]:
    """The values given to key-looking options: `--api-ke=K` and `--api-ke K` both give K."""
    out = []
    for i, arg in enumerate(argv):
        if arg == "--":
            break  # after --, vLLM's flags: serve and cluster refuse key options there (reject_secret_flags)
        if not is_secret_flag(arg):
            continue
        if "=" in arg:
            out.append(arg.split("=", 1)[1])
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out.append(argv[i + 1])
    return [v for v in out if v]


def redact(text: str, values: list[str]) -> str:
    """text with each whole word (between spaces, quotes, `=` or a comma) equal to one of values as ***."""
    for v in sorted(set(values), key=len, reverse=True):
        text = re.sub(r"(?<![^\s'\"=,])" + re.escape(v) + r"(?![^\s'\",])", "***", text)
    return text


def redact_argv(argv: list[str]) -> list[str]:
    """argv for a record or a message: the value of every key-looking option as ***."""
    values = secret_values(argv)
    return [redact(a, values) for a in argv]


def reject_secret_flags(vllm_args: list[str], command: str) -> None:
    """A key among the flags after -- would reach vLLM's command line (`ps`, the printed plan): refused."""
    from onespark.errors import UserError

    for arg in vllm_args:
        if is_secret_flag(arg):
            flag = arg.split("=", 1)[0]
            raise UserError(f"{flag} after --: vLLM would get the key on its command line (shown in `ps` and the "
                            f"plan): give it to onespark {command} as --api-key-file FILE or $ONESPARK_API_KEY")


def reject_own_flags(vllm_args: list[str], command: str) -> None:
    """--host or --port after -- would be vLLM's, not onespark's: the server would bind where the health check,
    the smoke request and the exposure warning do not look (they read the command's own flags). vLLM's parser
    takes `_` for `-`, `--port=N` and any unambiguous abbreviation (--por, --hos): each is refused, naming the
    command's flag."""
    from onespark.errors import UserError

    for arg in vllm_args:
        name = arg.split("=", 1)[0].replace("_", "-")
        own = next((f for f, shortest in (("--host", 4), ("--port", 5)) if len(name) >= shortest and f.startswith(name)),
                   None)
        if own:
            raise UserError(f"{arg.split('=', 1)[0]} after --: give it to onespark {command} as {own} "
                            f"{'H' if own == '--host' else 'N'} (before --), which the health check, the smoke "
                            f"request and the exposure warning follow")


def directory(text: str) -> str:
    """argparse `type=` of a flag that names a directory: "" is refused (an unset variable in
    `--checkpoint "$DIR"`), where Path("") and os.path.join would take it for the current directory and
    docker's -v for nothing."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is no directory: give its path (an unset shell variable?)")
    return text


def directory_path(text: str) -> Path:
    """directory(), as a Path."""
    return Path(directory(text))


def spec_name(text: str) -> str:
    """argparse `type=` of serve's and doctor's --model: a model spec's name, as in every command. A path there is
    the old spelling (--model was their checkpoint directory): refused in one line that names --checkpoint."""
    if "/" in text or text.startswith((".", "~")):
        raise argparse.ArgumentTypeError(f"{text} is a directory: give the checkpoint as --checkpoint {text} "
                                         "(--model names a model spec, as in every command: onespark specs)")
    return text


_VOLUME_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def cache_volume(text: str) -> str | None:
    """argparse `type=` of serve's --cache-volume: a Docker named volume (Docker's own name rule), or `none`. Only a
    name: a path or a `src:dst` would turn the -v flag it becomes into a bind mount of the host's files."""
    if text == "none":
        return None
    if not _VOLUME_NAME.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a Docker volume name: give letters, digits and _ . - "
                                         "(starting with a letter or digit), or none for no cache")
    return text


# Docker's own rule for a container name (daemon/names: [a-zA-Z0-9][a-zA-Z0-9_.-]+). serve's --name also names the
# memory guard's files (memory.guard_files): a `/` there would put them, or the report serve deletes, anywhere.
_CONTAINER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{1,127}")


def container_name(text: str) -> str:
    """argparse `type=` of serve's --name: a Docker container name, refused here rather than by `docker run`."""
    if not _CONTAINER_NAME.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a Docker container name: give 2 or more letters, digits "
                                         "and _ . - (starting with a letter or digit), e.g. onespark")
    return text


# A DNS name or an ~/.ssh/config alias: labels of letters, digits, `-` and `_`, no leading `-` (an option to the
# program that gets it), no space or quote, each of at most 63 characters (RFC 1035; a longer one is no name, and
# Python's resolver fails on it with "UnicodeError: label too long", not OSError). cluster's ssh destinations and
# every --host share it.
_LABEL = r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
DNS_NAME = rf"{_LABEL}(\.{_LABEL})*\.?"


def bind_host(text: str) -> str:
    """argparse `type=` of --host (the address a server binds): an IP address or a host name."""
    try:
        ipaddress.ip_address(text)
        return text
    except ValueError:
        pass
    if len(text) <= 253 and re.fullmatch(DNS_NAME, text):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not an address to bind: give an IP address (127.0.0.1: this "
                                     "machine only; 0.0.0.0: every interface) or a host name")


# A Docker image reference (distribution/reference's grammar, lightly): [registry[:port]/]path[:tag][@digest].
# serve puts it on `docker run`'s argv after the flags and cluster into a Dockerfile's FROM line: a value such as
# `-v/:/host` would be an option there, a line break a second Dockerfile line.
_IMAGE = re.compile(
    r"(?:[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?(?::[0-9]{1,5})?/)?"  # registry host[:port]/
    r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"  # path components
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?"  # :tag
    r"(?:@[a-z0-9]+(?:[+._-][a-z0-9]+)*:[0-9a-fA-F]{32,})?")  # @sha256:...


def image_ref(text: str) -> str:
    """argparse `type=` of --image: a Docker image reference, e.g. onespark/v2:0.1.0."""
    if len(text) > 512 or not _IMAGE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text[:80]!r} is not a Docker image reference: give NAME[:TAG] or "
                                         "NAME@sha256:DIGEST, e.g. onespark/v2:0.1.0 (docker images lists them)")
    return text


def file_stem(text: str) -> str:
    """argparse `type=` of a name that becomes a file in an output folder (bench --name): never a path."""
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.+=-]{0,127}", text):
        raise argparse.ArgumentTypeError(f"{text[:80]!r} is not a file name: give letters, digits and _ . + = - "
                                         "(no /; the folder is --out), e.g. published-spark-v2")
    return text


class Parser(argparse.ArgumentParser):
    """argparse with errors of one line, without the value of any key-looking option (`--api-ke=KEY`,
    `--api_key KEY`, a short key taken for a positional's "invalid choice"), and without the values of
    unrecognized arguments. Subparsers (bench compare) are of this class too: add_subparsers uses type(self)."""

    _secrets: list[str] = []

    def parse_known_args(self, args=None, namespace=None):
        self._secrets = secret_values(list(sys.argv[1:] if args is None else args))
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        head, sep, rest = message.partition("unrecognized arguments: ")
        if sep:  # the flags only: a value that follows a misspelt flag may be anything, a key included
            flags = [a for a in rest.split() if a.startswith("-")]
            message = f"{head}unrecognized arguments: {' '.join(flags) or '(values not shown)'}"
        message = redact(message, self._secrets)
        # a choice typo (--api chta) stays readable; a value as long as a key, after a flag of any name, is not shown
        message = re.sub(r"invalid choice: '([^']{12,})'", "invalid choice: (value not shown)", message)
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# ---- numbers --------------------------------------------------------------------------------------------------


# No flag here means more than a billion of anything (a billion GiB is an exabyte; a billion tokens, 3,800 times the
# longest context): a larger value is a typo. One near float's limit (1e308) is finite, yet overflows the first
# product it meets (GiB x 2^30 is inf, and int(inf) a traceback), and a whole number of 400 digits is past float.
LARGEST = 10**9
# A wait: poll() takes milliseconds in a C int (2^31 ms is 24.8 days), and subprocess.run(timeout=), selectors and
# every socket wait go through it: a timeout or interval of 1e10 s ends in "OverflowError: timeout is too large".
LONGEST_WAIT_S = 2_000_000  # 23 days


def _bound(x: float) -> str:
    return f"{x:g}" if abs(x) < 1e6 else str(int(x))  # 2000000, not 2e+06: an int flag cannot parse the latter


def _shown(text: str) -> str:
    return repr(text) if len(text) <= 40 else repr(text[:40]) + "..."  # 4,000 digits are no message


def _range_text(kind: type, lo: float | None, hi: float | None, lo_open: bool) -> str:
    noun = "a whole number" if kind is int else "a number"
    if lo is not None and hi is not None:
        return f"{noun} {'above' if lo_open else 'from'} {_bound(lo)}{' and at most' if lo_open else ' to'} {_bound(hi)}"
    if lo is not None:
        return f"{noun} {'above' if lo_open else 'of at least'} {_bound(lo)}"
    if hi is not None:
        return f"{noun} of at most {_bound(hi)}"
    return noun


def number(kind: type = float, lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
           ceiling: float = LARGEST):
    """An argparse `type=`: a finite int or float in [lo, hi] ((lo, hi] with lo_open), and never above `ceiling`
    (LARGEST; a wait's LONGEST_WAIT_S) where hi leaves it open; the message names the range. nan and inf never
    reach arithmetic: `timeout > nan` is always false, a wait that never ends."""
    want = _range_text(kind, lo, hi, lo_open)
    top = ceiling if hi is None else min(hi, ceiling)

    def parse(text: str):
        try:
            value = kind(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected {want}, got {_shown(text)}") from None
        if isinstance(value, float) and not math.isfinite(value) \
                or (lo is not None and (value <= lo if lo_open else value < lo)):
            raise argparse.ArgumentTypeError(f"expected {want}, got {_shown(text)}")
        if value > top:  # an int of any size compares exactly: math.isfinite(10**400) would raise OverflowError
            raise argparse.ArgumentTypeError(f"expected {_range_text(kind, lo, top, lo_open)}, got {_shown(text)}")
        return value

    return parse


def sizes(lo: int = 0):
    """An argparse `type=`: comma-separated whole numbers, `k` = 1024 (`0,4k,16k`), each at least lo."""
    one = number(int, lo)

    def parse(text: str) -> list[int]:
        vals = []
        for x in (x.strip().lower() for x in text.split(",")):
            if x:
                k = x.endswith("k")
                try:
                    vals.append(one(x[:-1] if k else x) * (1024 if k else 1))
                except argparse.ArgumentTypeError:
                    raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated whole numbers of at least "
                                                     f"{lo}, e.g. {lo},4k,16k") from None
        if not vals:
            raise argparse.ArgumentTypeError("expected at least one number")
        return vals

    return parse


PORT = number(int, 1, 65535)
SECONDS = number(float, 0, lo_open=True, ceiling=LONGEST_WAIT_S)
COUNT = number(int, 1)  # tokens, runs, shards, samples: at least one
