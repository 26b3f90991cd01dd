"""`onespark draft-vocab DIR [--size K] [--corpus FILE ...]`: the MTP draft's vocabulary subset (FR-Spec style).

The MTP draft's token choice decides only how many drafted tokens the target accepts, never what it outputs
(the target verifies every token with its full head). So the draft may compute logits for the K most frequent
tokens only (FR-Spec, arXiv 2502.14856): with K = 32,768 of Qwen3.5's 248,320 rows its LM-head read is 1/7.6
of the full head's. This command picks those K ids for the checkpoint's own tokenizer (DIR/tokenizer.json)
and writes them beside the checkpoint; the vLLM plugin (onespark.patches.draft_head) reads the file.

Ranking:
  --corpus FILE ...   token frequency over the files, tokenized with DIR/tokenizer.json (method
                      "corpus-frequency"); tokens the corpus never produced are ranked after it by merge order.
  no corpus           BPE merge order (method "bpe-merge-order"): byte-level BPE training adds, at each step, the
                      pair that is most frequent in its (partly merged) training data, so an earlier merge made a
                      token that was frequent in that data. Base tokens (the 256 byte symbols, which every text
                      uses) rank first, then each merge's token in merge order. The rank comes from the `merges`
                      list itself, not from the ids; whether the ids follow it (true for tokenizers trained by
                      `tokenizers`' BpeTrainer, and, as its tokenizer.json lists vocab and merges, for Qwen's) is
                      recorded as `ids_follow_merge_order`. A Unigram tokenizer ranks by its piece scores
                      (log probabilities; method "unigram-score"). Merge order is the frequency of the
                      tokenizer's training data, not of chat or code as served: a corpus of your own traffic
                      ranks better (FR-Spec ranks by corpus counts).
Always included, whatever the rank: every added token of tokenizer.json (<|im_start|>, <|im_end|>,
<|endoftext|>, <think>, </think>, <tool_call>, </tool_call>, ... on Qwen3.5), the eos/pad/bos tokens named by
tokenizer_config.json and the eos ids of generation_config.json. The draft cannot propose a token outside the
subset; those tokens stay as likely as before (the target produces them), only drafting them is lost.

The file (DIR/onespark-draft-vocab.json, written atomically): {"tool", "version", "schema", "method", "size",
"requested_size", "tokenizer_sha256", "tokenizer_vocab_size", "corpus": [{"file", "sha256", "bytes",
"tokens"}], "ids_follow_merge_order", "special_ids", "ids"} with `ids` ascending int32 values.
`onespark verify DIR` checks it (check_file) when present.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections import Counter
from pathlib import Path

from onespark import __version__, options
from onespark.checkpoint.safetensors_io import write_json_atomic
from onespark.checkpoint.writer import load_json, sha256_file
from onespark.errors import UserError
from onespark.shape import Int, ListOf, MapOf, Nullable, Num, Obj, OneOf, Str, Tuple

FILE = "onespark-draft-vocab.json"
SCHEMA = 1
DEFAULT_SIZE = 32768  # 1/8 of Qwen3.5's 248,320 rows, FR-Spec's 32K for a Llama-3 128K vocabulary
TOKENIZER = "tokenizer.json"
# Control tokens of Qwen3.5's chat template and tool calls: must be in the subset when the tokenizer has them
# (they are added tokens there, so the added_tokens rule already takes them; listed so verify can name them).
CONTROL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>",
                  "</tool_call>", "<tool_response>", "</tool_response>")
_CORPUS_PIECE = 1 << 20  # tokenize corpus files in ~1 MB pieces cut at line ends (bounded memory)


# What this module reads of tokenizer.json (onespark.shape): a BPE model's vocab and merges, a Unigram model's
# [piece, score] list, the added tokens. Ids stay under 2^22 (Qwen's vocabulary: 248k): they size a range().
_ID = Int(0, (1 << 22) - 1, "a token id")
TOKENIZER_SHAPE = Obj(optional={
    "model": Nullable(Obj(optional={
        "type": Nullable(str),
        "vocab": Nullable(OneOf(MapOf(_ID, "an object of token -> id"),
                                ListOf(Tuple(Str(), Num(), what="[piece, score]"), "a list of [piece, score]"))),
        "merges": Nullable(ListOf(OneOf(Str(), ListOf(str)), "a list of merges (\"a b\" or [a, b])"))},
        what="an object (the tokenizer model)")),
    "added_tokens": Nullable(ListOf(Obj({"id": _ID, "content": Str()}), "a list of {id, content}")),
}, what="a tokenizer object")


def _tokenizer_doc(d: Path) -> tuple[dict, str]:
    path = d / TOKENIZER
    if not path.is_file():
        raise UserError(f"{path}: missing: the draft vocabulary is built for the checkpoint's own tokenizer; "
                        f"copy tokenizer.json from the model's download into {d}")
    return (load_json(path, "tokenizer", "copy tokenizer.json from the model's download again", TOKENIZER_SHAPE),
            sha256_file(path))


def _vocab_size(doc: dict) -> int:
    model = doc.get("model") or {}
    vocab = model.get("vocab")
    ids = [t["id"] for t in doc.get("added_tokens") or []]
    if isinstance(vocab, dict):
        ids += list(vocab.values())
    elif isinstance(vocab, list):
        ids.append(len(vocab) - 1)
    return max(ids) + 1 if ids else 0


def _merge_pieces(m) -> str:
    if isinstance(m, list):  # tokenizers >= 0.20 writes [left, right]
        return "".join(m)
    left, _, right = m.partition(" ")  # older files: "left right"
    return left + right


def prior_ranking(doc: dict, path: Path) -> tuple[list[int], str, bool | None]:
    """(ids best first, method, ids_follow_merge_order) from the tokenizer alone (see the module docstring)."""
    model = doc.get("model") or {}
    kind, vocab = model.get("type"), model.get("vocab")
    if kind == "BPE" and isinstance(vocab, dict):
        merged = []
        seen = set()
        for m in model.get("merges") or []:
            tid = vocab.get(_merge_pieces(m))
            if tid is not None and tid not in seen:
                seen.add(tid)
                merged.append(tid)
        base = sorted(t for t in vocab.values() if t not in seen)
        return base + merged, "bpe-merge-order", merged == sorted(merged)
    if kind == "Unigram" and isinstance(vocab, list):
        order = sorted(range(len(vocab)), key=lambda i: -float(vocab[i][1]))
        return order, "unigram-score", None
    raise UserError(f"{path / TOKENIZER}: a {kind or 'unknown'} tokenizer has no corpus-free ranking here "
                    f"(BPE and Unigram do): pass --corpus FILE ... to rank by token frequency")


def special_ids(doc: dict, d: Path) -> list[int]:
    """Ids that are always in the subset: added tokens, the configured eos/pad/bos, generation_config's eos."""
    ids = {int(t["id"]) for t in doc.get("added_tokens") or [] if isinstance(t.get("id"), int)}
    vocab = (doc.get("model") or {}).get("vocab")
    by_text = {t["content"]: t["id"] for t in doc.get("added_tokens") or []}
    if isinstance(vocab, dict):
        by_text = {**vocab, **by_text}
    ids |= {by_text[t] for t in CONTROL_TOKENS if t in by_text}
    tc = d / "tokenizer_config.json"
    if tc.is_file():
        conf = load_json(tc, "tokenizer config")
        for key in ("eos_token", "pad_token", "bos_token", "unk_token"):
            v = conf.get(key)
            v = v.get("content") if isinstance(v, dict) else v
            if isinstance(v, str) and v in by_text:
                ids.add(by_text[v])
    gc = d / "generation_config.json"
    if gc.is_file():  # ids the tokenizer has (a generation_config copied from another model may name others)
        eos = load_json(gc, "generation config").get("eos_token_id")
        n = _vocab_size(doc)
        ids |= {e for e in (eos if isinstance(eos, list) else [eos]) if isinstance(e, int) and 0 <= e < n}
    return sorted(ids)


def _corpus_counts(tok, files: list[Path]) -> tuple[Counter, list[dict]]:
    counts: Counter = Counter()
    record = []
    for f in files:
        if not f.is_file():
            raise UserError(f"--corpus {f}: not a file: give text files (UTF-8) to count tokens in")
        h = hashlib.sha256()
        n = 0
        size = 0
        text_seen = False
        with open(f, "rb") as fh:
            rest = b""
            while True:
                block = fh.read(_CORPUS_PIECE)
                h.update(block)
                size += len(block)
                data = rest + block
                if block:
                    cut = data.rfind(b"\n") + 1
                    if cut == 0:  # no line end yet: keep reading
                        rest = data
                        continue
                    piece, rest = data[:cut], data[cut:]
                else:
                    piece, rest = data, b""
                try:
                    text = piece.decode("utf-8")
                except UnicodeDecodeError:
                    raise UserError(f"--corpus {f}: not UTF-8 text: convert it (iconv -t utf-8) or leave it "
                                    f"out") from None
                text_seen = text_seen or bool(text.strip())
                ids = tok.encode(text, add_special_tokens=False).ids
                counts.update(ids)
                n += len(ids)
                if not block:
                    break
        if not text_seen:  # its counts would rank blanks (or nothing) and call that "corpus-frequency"
            raise UserError(f"--corpus {f}: {'empty' if size == 0 else 'only whitespace'}: give text files of the "
                            f"traffic to rank for, or leave --corpus out (the tokenizer's BPE merge order)")
        record.append({"file": f.name, "sha256": h.hexdigest(), "bytes": size, "tokens": n})
    return counts, record


def build(d: Path, size: int = DEFAULT_SIZE, corpus: list[Path] | None = None) -> dict:
    """The draft-vocabulary document for checkpoint dir `d` (not written)."""
    if size < 1:
        raise UserError(f"--size must be at least 1, got {size}")
    doc, tok_hash = _tokenizer_doc(d)
    if _is_rankable(doc) or not corpus:  # (no corpus and no ranking: prior_ranking says so in one line)
        prior, method, follows = prior_ranking(doc, d)
    else:
        prior, method, follows = [], "", None
    n_vocab = _vocab_size(doc)
    specials = special_ids(doc, d)
    record: list[dict] = []
    if corpus:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise UserError("--corpus needs the `tokenizers` package (pip install tokenizers==0.23.3)") from None
        try:
            tok = Tokenizer.from_file(str(d / TOKENIZER))
        except Exception as e:  # the library's own parse error, as one line
            raise UserError(f"{d / TOKENIZER}: the tokenizers library cannot load it ({e})") from None
        counts, record = _corpus_counts(tok, corpus)
        prior_rank = {t: i for i, t in enumerate(prior)}
        # corpus count first; ties and unseen tokens by the prior ranking (or id where there is none)
        ranked = sorted(range(n_vocab), key=lambda t: (-counts.get(t, 0), prior_rank.get(t, n_vocab + t)))
        method = "corpus-frequency"
    else:
        ranked = prior
    chosen = set(specials)
    for t in ranked:
        if len(chosen) >= size:
            break
        chosen.add(t)
    if len(chosen) > size:
        raise UserError(f"--size {size} is smaller than the {len(specials)} special/control tokens that must be in "
                        f"the subset: use --size {len(specials)} or more")
    return {
        "tool": "onespark draft-vocab", "version": __version__, "schema": SCHEMA, "method": method,
        "size": len(chosen), "requested_size": size, "tokenizer_sha256": tok_hash, "tokenizer_vocab_size": n_vocab,
        "corpus": record, "ids_follow_merge_order": follows, "special_ids": specials, "ids": sorted(chosen),
    }


def _is_rankable(doc: dict) -> bool:
    model = doc.get("model") or {}
    return model.get("type") in ("BPE", "Unigram")


def _model_vocab_size(d: Path) -> int | None:
    """config.json's vocab_size (text_config first): the LM head's rows, the bound every id must be under."""
    cfg = d / "config.json"
    if not cfg.is_file():
        return None
    c = load_json(cfg, "config")
    for part in (c.get("text_config") or {}, c):
        if isinstance(part.get("vocab_size"), int):
            return part["vocab_size"]
    return None


def check_file(d: Path) -> list[str]:
    """Problems with DIR/onespark-draft-vocab.json (none when it is absent: the draft then uses the full head)."""
    path = Path(d) / FILE
    if not path.is_file():
        return []
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        return [f"{FILE} does not parse ({e}): run `onespark draft-vocab {d}` again"]
    fix = f"run `onespark draft-vocab {d}` again"
    ids = doc.get("ids") if isinstance(doc, dict) else None
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return [f"{FILE}: `ids` is not a non-empty list of integers: {fix}"]
    out = []
    bound = _model_vocab_size(Path(d))
    if bound is not None and (min(ids) < 0 or max(ids) >= bound):
        bad = next(i for i in ids if i < 0 or i >= bound)
        out.append(f"{FILE}: id {bad} is outside the model's vocabulary 0..{bound - 1} (config.json): {fix}")
    if len(set(ids)) != len(ids) or ids != sorted(ids):
        out.append(f"{FILE}: ids are not unique and ascending: {fix}")
    if doc.get("size") != len(ids):
        out.append(f"{FILE}: size says {doc.get('size')} but it lists {len(ids)} ids: {fix}")
    tok = Path(d) / TOKENIZER
    if not tok.is_file():
        out.append(f"{FILE} is present but {TOKENIZER} is not: the subset cannot be checked against a tokenizer")
        return out
    if doc.get("tokenizer_sha256") != sha256_file(tok):
        out.append(f"{FILE} was built for another {TOKENIZER} (sha256 differs): {fix}")
        return out
    tdoc = load_json(tok, "tokenizer", "copy tokenizer.json from the model's download again", TOKENIZER_SHAPE)
    missing = sorted(set(special_ids(tdoc, Path(d))) - set(ids))
    if missing:
        out.append(f"{FILE}: special/control token ids {missing[:10]} are not in the subset: {fix}")
    return out


def load(d: Path) -> dict:
    """DIR/onespark-draft-vocab.json as written (check_file says whether it fits the checkpoint)."""
    return load_json(Path(d) / FILE, "draft vocabulary", f"run `onespark draft-vocab {d}` again")


def write(d: Path, doc: dict) -> Path:
    path = Path(d) / FILE
    write_json_atomic(path, doc)
    return path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", type=options.directory_path, help="checkpoint directory (holds tokenizer.json; the file is written there)")
    p.add_argument("--size", "--draft-vocab-size", dest="size", type=options.COUNT, default=DEFAULT_SIZE,
                   help=f"ids in the subset, special tokens included (default {DEFAULT_SIZE}: 1/8 of Qwen3.5's "
                        f"248,320; FR-Spec used 32K)")
    p.add_argument("--corpus", type=Path, nargs="+", metavar="FILE",
                   help="UTF-8 text files to count tokens in (default: the tokenizer's BPE merge order)")
    p.add_argument("--skip-without-tokenizer", action="store_true",
                   help="exit 0 with a note when DIR has no tokenizer.json (steps/2-mtp.sh: test checkpoints)")


def run(args: argparse.Namespace) -> int:
    d = args.dir
    if not d.is_dir():
        raise UserError(f"{d}: not a directory: give the checkpoint directory (the one with config.json)")
    if args.skip_without_tokenizer and not (d / TOKENIZER).is_file():
        print(f"{d}: no {TOKENIZER}: draft vocabulary skipped (the MTP draft uses the full LM head)")
        return 0
    doc = build(d, args.size, args.corpus)
    old = d / FILE
    if old.is_file():
        try:
            prev = json.loads(old.read_text(encoding="utf-8"))
        except (OSError, ValueError, UnicodeDecodeError):
            prev = None
        same = ("ids", "method", "requested_size", "tokenizer_sha256", "corpus", "schema")
        if isinstance(prev, dict) and all(prev.get(k) == doc[k] for k in same):
            print(f"{old}: draft vocabulary already up to date ({doc['size']} ids, {doc['method']})")
            return 0
    path = write(d, doc)
    n = doc["tokenizer_vocab_size"]
    whole = " (the whole vocabulary: no saving)" if doc["size"] >= n else ""
    print(f"wrote {path}: {doc['size']} of {n} token ids{whole}, {doc['method']}, "
          f"{len(doc['special_ids'])} special/control tokens included")
    return 0
