"""Declared shapes for what the tools read from outside (config.json, the index, tokenizer.json, result JSON,
the server's answers), checked once at the edge so nothing past it meets a null where a dict belongs.

    INDEX = Obj({"weight_map": MapOf(str)}, optional={"metadata": Obj(optional={"total_size": Int(0)})})
    doc = load(path, INDEX, fix="download it again")          # or check(doc, INDEX, where, fix)

A mismatch is one UserError naming the file, the field and the fix:
    "m/model.safetensors.index.json: weight_map["lm_head.weight"] is null, expected a file name (string):
     download it again"

Standard library only, on purpose: `install.sh --dry-run` runs serve and cluster with the system python3 before
any venv exists, and the host tools' venv has no pydantic. The shapes are few and small; a library's model
classes would not be shorter than these declarations, and its error text would need rewriting anyway.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from onespark.errors import UserError


class Mismatch(Exception):
    """Internal: where in the document (a field path) and what was found against what was wanted."""

    def __init__(self, field: str, got, want: str):
        super().__init__(field)
        self.field, self.got, self.want = field, got, want


def describe(value) -> str:
    """A JSON value as a message names it: null, true, the number 3, the string "abc", a list, an object."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        text = repr(value) if not isinstance(value, int) or abs(value) < 10**30 else f"a {len(str(abs(value)))}-digit number"
        return f"the number {text}"
    if isinstance(value, str):
        return f"the string {json.dumps(value[:40])}{'...' if len(value) > 40 else ''}"
    if isinstance(value, list):
        return f"a list of {len(value)}"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


class Shape:
    want = "?"

    def check(self, value, field: str) -> None:
        raise NotImplementedError


class Str(Shape):
    def __init__(self, what: str = "a string", ascii_only: bool = False):
        self.want, self.ascii_only = what, ascii_only

    def check(self, value, field):
        if not isinstance(value, str) or (self.ascii_only and not value.isascii()):
            raise Mismatch(field, value, self.want)


class Int(Shape):
    """An integer (never a bool) in [lo, hi]: ranges keep a corrupt 10**30 out of loops and allocations."""

    def __init__(self, lo: int | None = None, hi: int | None = None, what: str = "an integer"):
        self.lo, self.hi = lo, hi
        bounds = (f" >= {lo}" if hi is None else f" in {lo}..{hi}") if lo is not None else ""
        self.want = what + bounds

    def check(self, value, field):
        if not isinstance(value, int) or isinstance(value, bool) or \
                (self.lo is not None and value < self.lo) or (self.hi is not None and value > self.hi):
            raise Mismatch(field, value, self.want)


class Num(Shape):
    """A finite number (int or float, never a bool, never NaN or inf), optionally in [lo, hi]."""

    def __init__(self, lo: float | None = None, hi: float | None = None, what: str = "a finite number"):
        self.lo, self.hi = lo, hi
        self.want = what + (f" >= {lo}" if lo is not None else "") + (f" <= {hi}" if hi is not None else "")

    def check(self, value, field):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or \
                not math.isfinite(value) or (self.lo is not None and value < self.lo) or \
                (self.hi is not None and value > self.hi):
            raise Mismatch(field, value, self.want)


class Bool(Shape):
    want = "true or false"

    def check(self, value, field):
        if not isinstance(value, bool):
            raise Mismatch(field, value, self.want)


class Any(Shape):
    want = "any value"

    def check(self, value, field):
        pass


class Nullable(Shape):
    def __init__(self, inner):
        self.inner = as_shape(inner)
        self.want = f"{self.inner.want} or null"

    def check(self, value, field):
        if value is not None:
            try:
                self.inner.check(value, field)
            except Mismatch as m:
                if m.field == field:  # the value itself is wrong: say null would have done too
                    raise Mismatch(field, value, self.want) from None
                raise


class OneOf(Shape):
    def __init__(self, *shapes):
        self.shapes = [as_shape(s) for s in shapes]
        self.want = " or ".join(s.want for s in self.shapes)

    def check(self, value, field):
        for s in self.shapes:
            try:
                s.check(value, field)
                return
            except Mismatch:
                continue
        raise Mismatch(field, value, self.want)


class ListOf(Shape):
    def __init__(self, item, what: str | None = None, min_len: int = 0):
        self.item, self.min_len = as_shape(item), min_len
        self.want = what or f"a list of {self.item.want}" + (" (not empty)" if min_len else "")

    def check(self, value, field):
        if not isinstance(value, list) or len(value) < self.min_len:
            raise Mismatch(field, value, self.want)
        for i, v in enumerate(value):
            self.item.check(v, f"{field}[{i}]")


class Tuple(Shape):
    """A list whose first items have these shapes, in order ([piece, score]); more items are allowed."""

    def __init__(self, *items, what: str | None = None):
        self.items = [as_shape(i) for i in items]
        self.want = what or "[" + ", ".join(i.want for i in self.items) + "]"

    def check(self, value, field):
        if not isinstance(value, list) or len(value) < len(self.items):
            raise Mismatch(field, value, self.want)
        for i, (s, v) in enumerate(zip(self.items, value)):
            s.check(v, f"{field}[{i}]")


def is_file_name(text: str) -> bool:
    """`text` names a file inside one directory, never a path out of it ("/etc/passwd", "../x")."""
    return text not in ("", ".", "..") and "/" not in text and "\0" not in text


class FileName(Str):
    """A string that is_file_name."""

    def __init__(self, what: str = "a plain file name (no \"/\", not \"\", \".\" or \"..\")"):
        super().__init__(what)

    def check(self, value, field):
        super().check(value, field)
        if not is_file_name(value):
            raise Mismatch(field, value, self.want)


class MapOf(Shape):
    """An object whose values all have one shape (weight_map: tensor -> file); its keys are free unless `key`
    says what they must be (a manifest's file names: FileName)."""

    def __init__(self, value, what: str | None = None, key=None):
        self.value, self.key = as_shape(value), None if key is None else as_shape(key)
        self.want = what or f"an object of {self.value.want} values"

    def check(self, value, field):
        if not isinstance(value, dict):
            raise Mismatch(field, value, self.want)
        for k, v in value.items():
            if self.key is not None:
                self.key.check(k, f"a key of {field or 'the document'}")
            self.value.check(v, f"{field}[{json.dumps(k)}]")


class Obj(Shape):
    """An object with these required and optional fields (an optional one may be absent; null only where its
    shape is Nullable). Other fields are allowed: the tools read what they need, not the whole format."""

    def __init__(self, required: dict | None = None, optional: dict | None = None, what: str = "an object"):
        self.required = {k: as_shape(v) for k, v in (required or {}).items()}
        self.optional = {k: as_shape(v) for k, v in (optional or {}).items()}
        self.want = what

    def check(self, value, field):
        if not isinstance(value, dict):
            raise Mismatch(field, value, self.want)
        for k, s in self.required.items():
            sub = _join(field, k)
            if k not in value:
                raise Mismatch(sub, _MISSING, s.want)
            s.check(value[k], sub)
        for k, s in self.optional.items():
            if k in value:
                s.check(value[k], _join(field, k))


_MISSING = object()


def _join(field: str, key: str) -> str:
    return key if not field else f"{field}.{key}"


def as_shape(s) -> Shape:
    if isinstance(s, Shape):
        return s
    simple = {str: Str(), int: Int(), float: Num(), bool: Bool(), dict: Obj(), list: ListOf(Any(), "a list")}
    if s in simple:
        return simple[s]
    raise TypeError(f"not a shape: {s!r}")


def check(doc, shape, where: str, fix: str):
    """`doc` if it has `shape`; else one UserError: '{where}: FIELD is WHAT, expected WANT: {fix}'."""
    try:
        as_shape(shape).check(doc, "")
    except Mismatch as m:
        field = m.field or "the document"
        got = "missing" if m.got is _MISSING else describe(m.got)
        raise UserError(f"{where}: {field} is {got}, expected {m.want}: {fix}") from None
    return doc


def parse(text: str | bytes, where: str, fix: str):
    """JSON text -> value; anything that is not JSON (binary, truncated, a BOM, a 5000-digit number, nesting
    deeper than Python's stack) is one UserError."""
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        return json.loads(text)
    except UnicodeDecodeError:
        raise UserError(f"{where}: not UTF-8 text (a binary file?): {fix}") from None
    except RecursionError:
        raise UserError(f"{where}: JSON nested too deep to be what it should be: {fix}") from None
    except ValueError as e:  # JSONDecodeError, and int() past sys.get_int_max_str_digits
        raise UserError(f"{where} is not JSON ({e}): {fix}") from None


def load(path: str | Path, shape, fix: str, where: str | None = None):
    """Read, parse and check a JSON file (OSError is left to the CLI's one handler, which names the path)."""
    with open(path, "rb") as f:
        raw = f.read()
    return check(parse(raw, where or str(path), fix), shape, where or str(path), fix)
