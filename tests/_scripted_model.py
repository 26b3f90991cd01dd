"""A tiny model whose greedy reply is a fixed text, to test what vLLM's serving layer makes of a reply.

`write_scripted_model(out, reply, arch=...)` writes onespark's tiny Qwen2-MoE (onespark.checkpoint.tinymodel), or with
arch="qwen3.5-moe" its real-architecture Qwen3.5-MoE whose MTP layer drafts what the head predicts (so under
MTP-2 the script is drafted and accepted, 1-3 tokens a step), and then:
  * splits the reply into pieces that are all different strings and adds each to the tokenizer as a token
    (the reply's `<think>`, `</think>` and the first `<tool_call>` / `</tool_call>` stay whole tokens, as in
    Qwen3.5's vocabulary; the qwen3 reasoning parser finds </think> by its token id);
  * makes the chat template end its generation prompt with `<think>` (Qwen3.5 starts the reply inside the
    reasoning block);
  * rewrites the LM head so that the row of piece i + 1 is the embedding of piece i (piece 0 follows
    `<think>`, <|im_end|> follows the last piece), CHAIN times stronger than the tiny model's own successor
    rows. Greedy decoding then emits the pieces in order: the reply, token by token.
Pieces must differ because the next token depends on the current one only; the pieces are 1-4 characters,
about what a BPE vocabulary gives for such text.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from onespark.checkpoint.tinymodel import write_tiny_model

CHAIN = 3.0  # x the tiny model's 0.35 / sqrt(hidden): ~17 logits for the next piece against ~5.6 for its successor row
WHOLE = ("<think>", "</think>", "<tool_call>", "</tool_call>")
PROMPT_TOKENS = ("<think>", "<|im_start|>", "<|im_end|>")
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>{% endif %}"
)


def pieces_of(reply: str, seed: int = 0) -> list[str]:
    """The reply as distinct pieces: the WHOLE markers on their first appearance, 1-4 characters elsewhere
    (random lengths; up to 24 where every shorter piece was used already; another draw if stuck)."""
    for attempt in range(5000):
        pieces = _split(reply, random.Random(seed * 1000 + attempt))
        if pieces:
            return pieces
    raise ValueError("cannot split the reply into distinct pieces: make it less repetitive")


def _steals(piece: str) -> bool:
    """Added tokens also match in the prompt, leftmost first: a piece such as "\n<" would swallow the start of
    the prompt's <think> (or a special token) and change the prompt's last token."""
    return any(piece.endswith(t[:k]) and len(piece) > k for t in PROMPT_TOKENS for k in range(1, len(t)))


def _split(reply: str, rng: random.Random) -> list[str] | None:
    used: set[str] = set()
    out: list[str] = []
    i = 0
    while i < len(reply):
        marker = next((m for m in WHOLE if reply.startswith(m, i) and m not in used), None)
        if marker:
            piece = marker
        else:  # 1-4 characters (longer only where those all repeat), never into a marker that must stay whole
            stop = min([reply.find(m, i) for m in WHOLE if m not in used and reply.find(m, i) > i] + [len(reply)])
            lengths = rng.sample(range(1, 5), 4) + rng.sample(range(5, 25), 20)
            fresh = [reply[i: i + n] for n in lengths
                     if i + n <= stop and reply[i: i + n] not in used | set(WHOLE) and not _steals(reply[i: i + n])]
            if not fresh:
                return None
            piece = fresh[0]
        used.add(piece)
        out.append(piece)
        i += len(piece)
    return out


def write_scripted_model(out: Path, reply: str, seed: int = 0, arch: str = "qwen2-moe") -> list[str]:
    """Write the model to `out` (must not exist); returns the reply's pieces, one token each."""
    from tokenizers import AddedToken, Tokenizer

    write_tiny_model(out, seed=seed, arch=arch)
    embed_name = "model.embed_tokens.weight" if arch == "qwen2-moe" else "model.language_model.embed_tokens.weight"
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    pieces = pieces_of(reply, seed)
    new = [p for p in dict.fromkeys(["<think>", *pieces]) if tok.token_to_id(p) is None]
    tok.add_tokens([AddedToken(p, normalized=False, special=False) for p in new])
    tok.save(str(out / "tokenizer.json"))
    ids = [tok.token_to_id(p) for p in pieces]
    assert len(set(ids)) == len(ids), "pieces must be distinct tokens"
    prompt_end = tok.encode("<|im_start|>assistant\n<think>").ids[-1]
    assert prompt_end == tok.token_to_id("<think>"), "the generation prompt must end with the <think> token"

    w = load_file(str(out / "model.safetensors"))
    old_vocab, hidden = w[embed_name].shape
    vocab = tok.get_vocab_size()
    g = torch.Generator().manual_seed(seed + 77)
    embed = torch.cat([w[embed_name].float(), torch.randn(vocab - old_vocab, hidden, generator=g)])
    head = torch.cat([w["lm_head.weight"].float(), torch.randn(vocab - old_vocab, hidden, generator=g) * 0.025])
    scale = CHAIN * 0.35 / np.sqrt(hidden)
    eos = tok.token_to_id("<|im_end|>")
    chain = [tok.token_to_id("<think>"), *ids, eos]
    for cur, nxt in zip(chain, chain[1:]):
        head[nxt] += embed[cur] * scale
    w[embed_name] = embed.to(torch.bfloat16)
    w["lm_head.weight"] = head.to(torch.bfloat16)
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})

    cfg = json.loads((out / "config.json").read_text())
    cfg.get("text_config", cfg)["vocab_size"] = vocab
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    tc = json.loads((out / "tokenizer_config.json").read_text())
    tc["chat_template"] = TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(tc, indent=2))
    (out / "onespark-tiny.json").unlink()  # its hashes describe the model before these changes
    return pieces
