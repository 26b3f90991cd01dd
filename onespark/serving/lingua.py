"""LLMLingua-2 for `onespark compress serve` (onespark.serving.compress is the proxy around it): which requests
ask for compression and with which options, what of a request is compressed, and the compressor itself.

Standard library only at module level (onespark.serving's rule): torch and llmlingua load in `Compressor`.
"""

from __future__ import annotations

import functools
import json
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from onespark import shape
from onespark.errors import UserError

FIELD = "onespark_compress"
HEADER = "X-Onespark-Compress"
STATUS_HEADER = "X-Onespark-Compression"
REMOVED_HEADER = "X-Onespark-Tokens-Removed"
TIME_HEADER = "X-Onespark-Compressor-Ms"
REASON_HEADER = "X-Onespark-Compression-Reason"  # why a request that asked was not compressed
CHAT, RESPONSES = "/v1/chat/completions", "/v1/responses"
DEFAULT_RATE = 0.5  # keep half: LLMLingua-2's paper reports small losses at 2x-3x (docs/guides/compression.md)
DEFAULT_MIN_TOKENS = 1024  # below ~1K tokens prefill costs ~0.5 s on a Spark: nothing worth a lossy step
# Words the compressor never drops: line breaks keep the layout, '?' keeps questions questions.
BASE_FORCE = ["\n", "?"]
MAX_FORCE = 100  # llmlingua 0.2.2's max_force_token: the added [NEWi] tokens it maps multi-token words to
MAX_USER_FORCE = 32
FENCE = re.compile(r"```.*?(?:```|\Z)", re.S)
# snake_case, dotted.names, camelCase, PascalCase with an inner capital: code words a prose model would drop
IDENT = re.compile(r"\b(?:[A-Za-z][A-Za-z0-9]*(?:[_.][A-Za-z0-9]+)+|[a-z]+[A-Z][A-Za-z0-9]*|[A-Z][a-z]+[A-Z][A-Za-z0-9]*)\b")
ON, OFF = {"1", "true", "on", "yes"}, {"0", "false", "off", "no"}

ASK = shape.Obj(optional={
    "rate": shape.Num(what="a fraction of the tokens kept"),
    "min_tokens": shape.Int(0, 10**7, what="a token count"),
    "question": shape.Bool(), "code": shape.Bool(), "keep_digits": shape.Bool(),
    "force_tokens": shape.ListOf(shape.Str("a word (string)"), what="a list of words (strings)"),
}, what="true, false or an object of compression options")


class BadRequest(Exception):
    """The request's own compression options are wrong: a 400, its message one line."""


class Ask:
    """What one request asked for, checked."""

    def __init__(self, rate: float, min_tokens: int, question: bool = False, code: bool = False,
                 keep_digits: bool = True, force_tokens: list[str] | None = None):
        self.rate, self.min_tokens, self.question, self.code = rate, min_tokens, question, code
        self.keep_digits, self.force_tokens = keep_digits, force_tokens or []


def _rate(value, where: str) -> float:
    if not 0 < value <= 1:
        raise BadRequest(f"{where}: rate {value!r} is outside (0, 1]: it is the fraction of tokens kept, e.g. 0.5")
    return float(value)


def parse_ask(header: str | None, body, defaults: Ask) -> Ask | None:
    """The request's compression options from the header and the body field, or None when it does not opt in.
    `body` is the parsed JSON (any value); raises BadRequest for a malformed header or field."""
    rate, on = defaults.rate, False
    if header is not None:
        h = header.strip().lower()
        if h in ON:
            on = True
        elif h in OFF:
            pass
        else:
            try:
                rate, on = _rate(float(h), HEADER), True
            except ValueError:
                raise BadRequest(f"{HEADER}: {header[:40]!r} is neither on/off nor a rate in (0, 1], e.g. 0.5") from None
    field = body.get(FIELD) if isinstance(body, dict) else None
    if field is None or field is True or field is False:
        on = on or field is True
        if field is False:
            on = False
        return Ask(rate, defaults.min_tokens) if on else None
    if not isinstance(field, dict):
        raise BadRequest(f"{FIELD} is {shape.describe(field)}: expected true, false or an object such as "
                         '{"rate": 0.5}')
    try:
        shape.check(field, ASK, FIELD, "see docs/guides/compression.md")
    except UserError as e:
        raise BadRequest(str(e)) from None
    unknown = sorted(set(field) - set(ASK.optional))
    if unknown:
        raise BadRequest(f"{FIELD}: unknown option {unknown[0][:40]!r}: use {', '.join(ASK.optional)}")
    force = field.get("force_tokens", [])
    if len(force) > MAX_USER_FORCE or any(not 0 < len(t) <= 32 for t in force):
        raise BadRequest(f"{FIELD}.force_tokens: at most {MAX_USER_FORCE} words of 1 to 32 characters each")
    return Ask(_rate(field["rate"], f"{FIELD}.rate") if "rate" in field else rate,
               field.get("min_tokens", defaults.min_tokens), field.get("question", False), field.get("code", False),
               field.get("keep_digits", True), force)


# ---- what of a request is compressed ------------------------------------------------------------------------


class Slot:
    """One string of the request body that may be compressed: container[key], and whether it is the last user
    turn (whose last paragraph is the question) and a tool result."""

    def __init__(self, container, key, last_user: bool = False, tool: bool = False):
        self.container, self.key, self.last_user, self.tool = container, key, last_user, tool

    @property
    def text(self) -> str:
        return self.container[self.key]


def _text_slots(container, key, **kw) -> list[Slot]:
    """The strings of a message's content: the content itself, or its text parts (other parts: images...)."""
    content = container.get(key)
    if isinstance(content, str):
        return [Slot(container, key, **kw)]
    if isinstance(content, list):
        parts = [p for p in content if isinstance(p, dict) and p.get("type") in ("text", "input_text")
                 and isinstance(p.get("text"), str)]
        return [Slot(p, "text", last_user=kw.get("last_user", False) and p is parts[-1], tool=kw.get("tool", False))
                for p in parts]
    return []


def slots(path: str, body: dict) -> list[Slot]:
    """The compressible strings of a Chat Completions or Responses body, in order. Anything of another shape
    is left as it is: vLLM judges the rest of the request."""
    out: list[Slot] = []
    if path == CHAT:
        msgs = body.get("messages")
        msgs = [m for m in msgs if isinstance(m, dict)] if isinstance(msgs, list) else []
        last = max((i for i, m in enumerate(msgs) if m.get("role") == "user"), default=-1)
        for i, m in enumerate(msgs):
            if m.get("role") in ("user", "tool"):
                out += _text_slots(m, "content", last_user=i == last, tool=m.get("role") == "tool")
        return out
    items = body.get("input")
    if isinstance(items, str):
        return [Slot(body, "input", last_user=True)]
    items = [m for m in items if isinstance(m, dict)] if isinstance(items, list) else []
    last = max((i for i, m in enumerate(items) if m.get("role") == "user"), default=-1)
    for i, m in enumerate(items):
        if m.get("role") == "user":
            out += _text_slots(m, "content", last_user=i == last)
        elif m.get("type") == "function_call_output" and isinstance(m.get("output"), str):
            out.append(Slot(m, "output", tool=True))
    return out


def _is_json(text: str) -> bool:
    t = text.strip()
    if not t.startswith(("{", "[")):
        return False
    try:
        json.loads(t)
    except (ValueError, RecursionError):
        return False
    return True


def pieces(slot: Slot, ask: Ask) -> list[tuple[str, bool]]:
    """The slot's text cut into (text, compressible) pieces that join back into it: code fences, JSON tool
    results and the question (the last user message's last paragraph) are kept as they are."""
    text = slot.text
    if slot.tool and not ask.code and _is_json(text):
        return [(text, False)]
    tail = ""
    if slot.last_user and not ask.question:
        cut = text.rstrip().rfind("\n\n")
        if cut < 0:
            return [(text, False)]  # one paragraph: it is the question
        text, tail = text[:cut + 2], text[cut + 2:]
    out: list[tuple[str, bool]] = []
    at = 0
    for m in ([] if ask.code else FENCE.finditer(text)):
        out.append((text[at:m.start()], True))
        out.append((m.group(0), False))
        at = m.end()
    out.append((text[at:], True))
    if tail:
        out.append((tail, False))
    return [p for p in out if p[0]]


# ---- the compressor -----------------------------------------------------------------------------------------


class Compressor:
    """llmlingua 0.2.2's PromptCompressor(use_llmlingua2=True) on a local checkpoint; one call at a time."""

    def __init__(self, model_dir: str | Path, device: str = "auto"):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local directory: nothing is fetched, ever
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        from unittest import mock

        import llmlingua.prompt_compressor as lp
        import torch

        cfg = shape.load(Path(model_dir) / "config.json", shape.Obj({"model_type": shape.Str()}),
                         "download it again: onespark download --compressor ...")
        # llmlingua picks its word-boundary rules by a substring of the model name (utils.is_begin_of_new_word):
        # the two LLMLingua-2 families, named by what the checkpoint says it is, not by its directory's name.
        family = {"bert": "bert-base-multilingual-cased", "xlm-roberta": "xlm-roberta-large"}.get(cfg["model_type"])
        if family is None:
            raise UserError(f"{model_dir}: model_type {cfg['model_type']!r} is no LLMLingua-2 model (bert or "
                            f"xlm-roberta): --model-dir must be a directory `onespark download --compressor` wrote")
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        # PromptCompressor's __init__ asks tiktoken for GPT-3.5's encoding, which tiktoken downloads on first use
        # (openaipublic.blob.core.windows.net): no network here. LLMLingua-2 uses it only to count tokens, so it
        # counts with the compressor's own tokenizer instead (set once the tokenizer is loaded).
        with mock.patch.object(lp.tiktoken, "encoding_for_model", lambda _name: None):
            pc = lp.PromptCompressor(model_name=str(model_dir), device_map=device, use_llmlingua2=True,
                                     model_config={"trust_remote_code": False})
        pc.model_name = family
        pc.oai_tokenizer = _Counter(pc.tokenizer)
        pc.model.eval()
        self.pc, self.device, self.family = pc, device, family
        self._lock = threading.Lock()

    def count(self, text: str) -> int:
        return len(self.pc.tokenizer(text, add_special_tokens=False).input_ids)

    def compress(self, texts: list[str], ask: Ask) -> list[str]:
        words = sorted({w for t in texts for w in IDENT.findall(t)}, key=len, reverse=True)
        force = list(dict.fromkeys(BASE_FORCE + ask.force_tokens))
        force += [w for w in words if w not in force][:MAX_FORCE - len(force)]
        with self._lock:
            res = self.pc.compress_prompt_llmlingua2(texts, rate=ask.rate, force_tokens=force,
                                                     force_reserve_digit=ask.keep_digits, drop_consecutive=True,
                                                     use_context_level_filter=False)
        return res["compressed_prompt_list"]


class _Counter:
    """What llmlingua wants of tiktoken's Encoding: encode(text) -> token ids. llmlingua calls it once per word
    of the prompt (its __compress weighs each word by its token count), so it goes straight to the Rust
    tokenizer and remembers words: transformers' __call__ costs ~30x the Rust encode per word (285 vs 9 us on
    the 2-core CI machine), which made it most of a 64K-token compression on an H200 (3.3 s)."""

    def __init__(self, tokenizer):
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            self._ids = lambda t: backend.encode(t, add_special_tokens=False).ids
        else:  # a slow (Python) tokenizer
            self._ids = lambda t: tokenizer(t, add_special_tokens=False).input_ids
        self.encode = functools.lru_cache(maxsize=1 << 16)(self._encode)

    def _encode(self, text: str) -> tuple[int, ...]:
        return tuple(self._ids(text))


def compress_body(path: str, body: dict, ask: Ask, compressor) -> dict:
    """Compress the body's long user and tool text in place; returns the accounting."""
    todo: list[tuple[Slot, list[tuple[str, bool]]]] = []
    for s in slots(path, body):
        ps = pieces(s, ask)
        if sum(compressor.count(t) for t, c in ps if c) >= max(ask.min_tokens, 1):
            todo.append((s, ps))
    texts = [t for _, ps in todo for t, c in ps if c]
    if not texts or ask.rate >= 1:
        return {"status": "skipped", "tokens_before": 0, "tokens_after": 0, "tokens_removed": 0, "messages": 0}
    out = iter(compressor.compress(texts, ask))
    before = after = 0
    for s, ps in todo:
        joined = []
        for t, c in ps:
            if c:
                new = next(out)
                before, after = before + compressor.count(t), after + compressor.count(new)
                # the compressor joins words with single spaces: keep the piece's own edges (a paragraph break)
                lead, trail = t[:len(t) - len(t.lstrip())], t[len(t.rstrip()):]
                t = lead + new.strip() + trail
            joined.append(t)
        s.container[s.key] = "".join(joined)
    return {"status": "compressed", "tokens_before": before, "tokens_after": after,
            "tokens_removed": before - after, "messages": len(todo)}


# ---- the proxy's reading of a request ---------------------------------------------------------------------------


@dataclass
class Reading:
    """What the proxy does with one request: forward the client's bytes (body None) or `body` serialized again;
    compress it when `ask` is set; report `status` and `reason` when the request asked and is not compressed."""

    body: dict | None = None
    ask: Ask | None = None
    status: str | None = None
    reason: str | None = None


def _json_object(raw: bytes) -> dict | None:
    """The body as a JSON object, or None for anything else (vLLM judges those)."""
    if not raw.lstrip()[:1] == b"{":
        return None
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError; so is a 5000-digit number
        return None
    return doc if isinstance(doc, dict) else None


def read_request(method: str, path: str, header: str | None, raw: bytes, defaults: Ask) -> Reading:
    """The opt-in header and body field of any request, the field found however it is written (JSON escapes
    in its name are the same name). Raises BadRequest for a malformed header or field, and for a body that is
    no JSON object on a request that asks, by header, for a compressed path."""
    body = _json_object(raw)
    has_field = body is not None and FIELD in body
    if header is None and not has_field:
        return Reading()  # not ours: the client's bytes, untouched
    ask = parse_ask(header, body, defaults)
    if has_field:
        del body[FIELD]  # vLLM would warn about, or refuse, a field it does not know
    sent = body if has_field else None
    if ask is None:
        return Reading(sent, None, "off", f"{FIELD} is false" if has_field else f"{HEADER} is off")
    if method != "POST" or path not in (CHAT, RESPONSES):
        return Reading(sent, None, "unsupported", f"{method} {path[:80]} is not compressed: only POST {CHAT} "
                                                  f"and POST {RESPONSES} are")
    if body is None:
        raise BadRequest(f"{HEADER}: the request body is not a JSON object; send the request as JSON")
    return Reading(body, ask)


def encode_body(body: dict) -> bytes:
    """JSON bytes; a lone surrogate (valid JSON as an escape, no UTF-8) goes out escaped, as it came in."""
    try:
        return json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return json.dumps(body).encode()
