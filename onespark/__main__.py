"""`python3 -m onespark ...`. Where onespark is not installed for this Python (a checkout run with a system
python3), a module a command needs is missing: a dependency such as httpx, or a subpackage only the install
maps (onespark.bench, .kernels, .patches: pyproject's package-dir). Say how to install, in one line, instead
of a traceback. Installed, only a missing declared dependency gets that line; any other import error is a bug
and keeps its traceback."""

import importlib.util
import re
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent


def _declared() -> set[str]:
    """Import names of pyproject.toml's dependencies and extras (distribution name, normalised)."""
    try:
        text = (CHECKOUT / "pyproject.toml").read_text()
    except OSError:
        return set()
    names = re.findall(r'"([A-Za-z][A-Za-z0-9_.-]*)(?:\[[^\]]*\])?\s*(?:==|>=|<=|~=|<|>)', text)
    return {n.lower().replace("-", "_") for n in names}


def _installed() -> bool:
    try:
        return importlib.util.find_spec("onespark.bench") is not None
    except ImportError:
        return False


def _run() -> int:
    from onespark.cli import main

    try:
        return main()
    except ModuleNotFoundError as e:
        top = (e.name or "").partition(".")[0]
        if _installed() and top not in _declared():
            raise
        print(f"onespark: {e}: onespark is not installed for {sys.executable}; install it with "
              f"`python3 -m venv .venv-host && .venv-host/bin/pip install -e {CHECKOUT}` (./install.sh does "
              "this), then run `.venv-host/bin/onespark ...`", file=sys.stderr)
        return 1


raise SystemExit(_run())
