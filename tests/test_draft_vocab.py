"""`onespark draft-vocab`: the MTP draft's vocabulary subset, against the tokenizer.json it is built from.

References are independent of the code under test: the merge list read straight from the file, token counts
from the `tokenizers` library encoding the whole corpus in one call, and `onespark verify` on a generated
checkpoint for the check.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from onespark.checkpoint import draft_vocab
from onespark.checkpoint.synth import synth
from onespark.checkpoint.tinymodel import write_tiny_model
from onespark.errors import UserError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("dv") / "tiny", seed=0)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "onespark", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def _fresh(tok_dir: Path, tmp_path: Path) -> Path:
    d = tmp_path / "ck"
    shutil.copytree(tok_dir, d)
    return d


def test_merge_order_ranking_is_base_tokens_then_merges_in_order(tok_dir):
    doc = json.loads((tok_dir / "tokenizer.json").read_text())
    vocab, merges = doc["model"]["vocab"], doc["model"]["merges"]
    merged = [vocab["".join(m)] for m in merges]  # the file's own order (tokenizers 0.23 writes [left, right])
    base = sorted(set(vocab.values()) - set(merged))
    specials = sorted(t["id"] for t in doc["added_tokens"])
    k = 300
    expect = set(specials)
    for t in base + merged:
        if len(expect) == k:
            break
        expect.add(t)
    got = draft_vocab.build(tok_dir, size=k)
    assert got["ids"] == sorted(expect) and got["size"] == k and got["method"] == "bpe-merge-order"
    assert got["ids_follow_merge_order"] is True  # BpeTrainer assigns ids in merge order
    assert got["special_ids"] == specials == [0, 1, 2]  # <|endoftext|> <|im_start|> <|im_end|>


def test_ranking_follows_the_merge_list_not_the_ids(tmp_path, tok_dir):
    """A tokenizer whose ids do not follow its merges: the ranking still does, and the file says so."""
    doc = json.loads((tok_dir / "tokenizer.json").read_text())
    vocab, merges = doc["model"]["vocab"], doc["model"]["merges"]
    first, last = "".join(merges[0]), "".join(merges[-1])
    vocab[first], vocab[last] = vocab[last], vocab[first]  # the first merge's token now has the highest id
    ranked, method, follows = draft_vocab.prior_ranking(doc, tmp_path)
    assert follows is False and method == "bpe-merge-order"
    n_base = len(vocab) - len(merges)
    assert ranked[n_base] == vocab[first] == max(vocab.values())
    assert ranked[-1] == vocab[last]


def test_corpus_frequency_keeps_the_most_frequent_tokens(tmp_path, tok_dir):
    from tokenizers import Tokenizer

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(["the sea is wide and the sea is deep"] * 40 + ["print(add(2, 3)) 42"] * 7
                                + ["Paris Berlin France"] * 3) + "\n")
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    counts = Counter(tok.encode(corpus.read_text(), add_special_tokens=False).ids)  # one call, whole file
    k = 3 + 10
    got = draft_vocab.build(tok_dir, size=k, corpus=[corpus])
    assert got["method"] == "corpus-frequency" and got["size"] == k
    chosen = set(got["ids"]) - {0, 1, 2}
    unchosen = set(range(got["tokenizer_vocab_size"])) - set(got["ids"])
    assert min(counts[t] for t in chosen) >= max(counts[t] for t in unchosen)  # FR-Spec's rule
    assert counts.most_common(1)[0][0] in chosen
    rec = got["corpus"][0]
    assert rec["file"] == "corpus.txt" and rec["tokens"] == sum(counts.values())
    assert rec["bytes"] == corpus.stat().st_size and len(rec["sha256"]) == 64
    # a subset larger than the corpus' tokens: every token seen is in, the rest by merge order
    big = draft_vocab.build(tok_dir, size=300, corpus=[corpus])
    assert set(counts) <= set(big["ids"]) and big["size"] == 300


def test_corpus_read_in_pieces_counts_like_one_piece(tmp_path, tok_dir, monkeypatch):
    from tokenizers import Tokenizer

    corpus = tmp_path / "c.txt"
    corpus.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(200)))
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    whole = Counter(tok.encode(corpus.read_text(), add_special_tokens=False).ids)
    monkeypatch.setattr(draft_vocab, "_CORPUS_PIECE", 100)  # ~100 pieces, cut at line ends
    counts, rec = draft_vocab._corpus_counts(tok, [corpus])
    assert counts == whole and rec[0]["bytes"] == corpus.stat().st_size


def test_qwen_control_tokens_are_always_in(tmp_path, tok_dir):
    """Qwen3.5's chat/tool tokens as added tokens of a tokenizer.json, and tokenizer_config's eos: in the subset
    even at the smallest size."""
    d = _fresh(tok_dir, tmp_path)
    doc = json.loads((d / "tokenizer.json").read_text())
    n = max(doc["model"]["vocab"].values()) + 1
    extra = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
    for i, t in enumerate(extra):
        doc["added_tokens"].append({"id": n + i, "content": t, "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": False, "special": False})
    (d / "tokenizer.json").write_text(json.dumps(doc))
    got = draft_vocab.build(d, size=len(extra) + 3)
    assert got["ids"] == [0, 1, 2, n, n + 1, n + 2, n + 3]
    with pytest.raises(UserError, match=r"--size 6 is smaller than the 7 special/control tokens"):
        draft_vocab.build(d, size=6)


def test_cli_writes_atomically_reruns_as_up_to_date_and_check_passes(tmp_path, tok_dir):
    d = _fresh(tok_dir, tmp_path)
    r = cli("draft-vocab", str(d), "--size", "300")
    assert r.returncode == 0 and "300 of 677 token ids, bpe-merge-order" in r.stdout, r.stdout + r.stderr
    assert not [p.name for p in d.iterdir() if ".tmp" in p.name]
    doc = json.loads((d / draft_vocab.FILE).read_text())
    assert doc["tool"] == "onespark draft-vocab" and doc["schema"] == 1 and doc["requested_size"] == 300
    import hashlib
    assert doc["tokenizer_sha256"] == hashlib.sha256((d / "tokenizer.json").read_bytes()).hexdigest()
    assert draft_vocab.check_file(d) == []
    r = cli("draft-vocab", str(d), "--size", "300")
    assert r.returncode == 0 and "already up to date" in r.stdout
    r = cli("draft-vocab", str(d), "--draft-vocab-size", "5000")  # larger than the vocabulary
    assert r.returncode == 0 and "677 of 677 token ids (the whole vocabulary: no saving)" in r.stdout


@pytest.mark.parametrize("args,rc,msg", [  # a number out of range fails at the parser (exit 2, the range named)
    (["--size", "0"], 2, "--size/--draft-vocab-size: expected a whole number of at least 1, got '0'"),
    (["--corpus", "/nonexistent.txt"], 1, "--corpus /nonexistent.txt: not a file"),
])
def test_cli_bad_input_is_one_line(tmp_path, tok_dir, args, rc, msg):
    d = _fresh(tok_dir, tmp_path)
    r = cli("draft-vocab", str(d), *args)
    assert r.returncode == rc and r.stderr.count("\n") == 1 and msg in r.stderr, r.stderr
    assert not (d / draft_vocab.FILE).exists()


def test_cli_without_tokenizer(tmp_path):
    r = cli("draft-vocab", str(tmp_path))
    assert r.returncode == 1 and f"{tmp_path}/tokenizer.json: missing" in r.stderr and "Traceback" not in r.stderr
    r = cli("draft-vocab", str(tmp_path), "--skip-without-tokenizer")
    assert r.returncode == 0 and "draft vocabulary skipped" in r.stdout
    assert list(tmp_path.iterdir()) == []


def test_non_utf8_corpus_is_one_line(tmp_path, tok_dir):
    bad = tmp_path / "bin.txt"
    bad.write_bytes(b"hello\n\xff\xfe\n")
    with pytest.raises(UserError, match="not UTF-8 text"):
        draft_vocab.build(tok_dir, size=10, corpus=[bad])


@pytest.fixture
def checkpoint(tmp_path, tok_dir) -> Path:
    """A generated INT4 checkpoint (vocab 1000) with the tiny model's tokenizer and a draft vocabulary."""
    d = tmp_path / "int4"
    synth(d, "int4", seed=3)
    assert cli("mtp", str(d)).returncode == 0  # the download's MTP head listed in the index (step 2)
    shutil.copy(tok_dir / "tokenizer.json", d / "tokenizer.json")
    draft_vocab.write(d, draft_vocab.build(d, size=200))
    return d


def _edit(d: Path, **changes) -> None:
    doc = json.loads((d / draft_vocab.FILE).read_text())
    doc.update(changes)
    (d / draft_vocab.FILE).write_text(json.dumps(doc))


@pytest.mark.parametrize("case,expect", [
    ("duplicate", "ids are not unique and ascending"),
    ("range", "id 1000 is outside the model's vocabulary 0..999 (config.json)"),
    ("special", "special/control token ids [1] are not in the subset"),
    ("tokenizer", "was built for another tokenizer.json (sha256 differs)"),
    ("garbage", "does not parse"),
])
def test_verify_checks_the_draft_vocabulary(checkpoint, case, expect):
    r = cli("verify", str(checkpoint), "--model", "custom", "--fast")
    assert r.returncode == 0 and r.stdout.rstrip().endswith("ok"), r.stdout + r.stderr
    doc = json.loads((checkpoint / draft_vocab.FILE).read_text())
    ids = doc["ids"]
    if case == "duplicate":
        _edit(checkpoint, ids=ids[:5] + ids[4:-1])
    elif case == "range":
        _edit(checkpoint, ids=ids[:-1] + [1000])
    elif case == "special":
        _edit(checkpoint, ids=[i for i in ids if i != 1] + [250], size=len(ids))
    elif case == "tokenizer":
        with open(checkpoint / "tokenizer.json", "a") as f:
            f.write("\n")
    else:
        (checkpoint / draft_vocab.FILE).write_text("{not json")
    r = cli("verify", str(checkpoint), "--model", "custom", "--fast")
    assert r.returncode == 1 and expect in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_step_2_dry_run_names_draft_vocab(tmp_path):
    import os
    env = dict(os.environ, ONESPARK_VENV=str(tmp_path / "no-venv"), PATH="/usr/bin:/bin")
    r = subprocess.run(["steps/2-mtp.sh", "--work", str(tmp_path), "--dry-run"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert f"+ onespark draft-vocab {tmp_path}/hybrid --skip-without-tokenizer" in r.stdout
