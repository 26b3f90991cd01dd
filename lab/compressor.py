"""LLMLingua-2's own latency on a GPU (issue 27): onespark compress's Compressor (llmlingua 0.2.2's
PromptCompressor, use_llmlingua2=True) on an xlm-roberta-large-shaped token classifier with random weights,
built here (no download: the GPU host has no network), at 8K, 16K, 32K and 64K tokens of prose.

    python lab/compressor.py [--tokens 8k,16k,32k,64k] [--rate 0.5] [--runs 3] [--out PATH]

Latency depends on the shapes, not the weights: 24 layers of 1024, 16 heads, FFN 4096, FP32 as Microsoft
publishes the checkpoint, llmlingua's 512-token chunks in batches of 50. Two things differ from the real model
and are said in the result: the vocabulary (a unigram tokenizer over a few thousand pieces, built locally; the
real one has 250K: the embedding lookup costs the same, tokenization a little less), and which words are kept
(random weights keep random words; the kept fraction follows the rate all the same).

Writes bench/results/compressor_<gpu>.json through the lab harness (git SHA, command, GPU, torch, UTC date):
per length the compressor's tokens in and out and the median wall time of compress_prompt_llmlingua2 (the
call onespark compress makes), with the Spark TTFT saving it buys estimated from a published prefill rate.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import harness

# Published prefill rates of the 122B class on one Spark: ~1.8-2.4K tokens/s (issue 27's sources); the midpoint
# turns removed tokens into seconds. An estimate, labelled as such in the result.
SPARK_PREFILL_TOK_S = 2100.0
# xlm-roberta-large, as microsoft/llmlingua-2-xlm-roberta-large-meetingbank's config.json has it
XLMR_LARGE = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
                  max_position_embeddings=514, type_vocab_size=1, layer_norm_eps=1e-5, pad_token_id=1,
                  bos_token_id=0, eos_token_id=2, num_labels=2)


def build_model(d: Path, device: str = "cuda", layers: int | None = None) -> None:
    """Random xlm-roberta-large token classifier + a local Metaspace/unigram tokenizer, saved to d."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, XLMRobertaConfig, XLMRobertaForTokenClassification

    from onespark.bench import compression

    words = sorted({w.strip(",.").lower() for s in (compression.SUBJECTS + compression.VERBS + compression.TIMES
                                                     + compression.TOPICS + ["and people in still speak of it"])
                    for w in s.split()})
    chars = sorted(set("abcdefghijklmnopqrstuvwxyz0123456789.,?!:;'\"()-"))
    special = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    vocab = [(t, 0.0) for t in special] + [("\u2581" + w, -5.0) for w in words] + \
        [("\u2581" + c, -9.0) for c in chars] + [(c, -10.0) for c in chars] + [("\u2581", -8.0)]
    tok = Tokenizer(models.Unigram(vocab, unk_id=3))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", sep_token="</s>",
                                   cls_token="<s>", unk_token="<unk>", pad_token="<pad>", mask_token="<mask>")
    fast.save_pretrained(d)
    cfg = XLMRobertaConfig(vocab_size=len(vocab), architectures=["XLMRobertaForTokenClassification"],
                           **{**XLMR_LARGE, **({"num_hidden_layers": layers} if layers else {})})
    torch.manual_seed(0)
    with torch.device(device):  # random init on the GPU: seconds, not the CPU's minute
        model = XLMRobertaForTokenClassification(cfg)
    model.save_pretrained(d)


def prose(compressor, tokens: int, seed: int) -> str:
    """Prose of `tokens` compressor tokens (bench/compression.py's generator, trimmed by the tokenizer)."""
    import random

    from onespark.bench import compression

    text = compression.filler(random.Random(seed), int(tokens * 1.2))
    ids = compressor.pc.tokenizer(text, add_special_tokens=False).input_ids[:tokens]
    return compressor.pc.tokenizer.decode(ids)


def main(argv=None) -> int:
    from onespark.options import sizes

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--tokens", type=sizes(1), default=[8192, 16384, 32768, 65536],
                   help="prompt lengths in compressor tokens (default 8k,16k,32k,64k)")
    p.add_argument("--rate", type=float, default=0.5, help="fraction of tokens kept (default 0.5)")
    p.add_argument("--runs", type=int, default=3, help="timed runs per length, after one warm-up (default 3)")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/compressor_<gpu>.json)")
    p.add_argument("--git-sha", default=os.environ.get("GIT_SHA", "unknown"))
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: a smoke run of this script (with --layers 1), no measurement")
    p.add_argument("--layers", type=int, help="fewer layers than xlm-roberta-large's 24 (smoke runs only)")
    args = p.parse_args(argv)
    import torch

    gpu = args.device == "cuda"
    if gpu and not torch.cuda.is_available():
        print("needs a CUDA GPU: run it on the H200 (or the Spark)", file=sys.stderr)
        return 1
    import llmlingua
    import transformers

    from onespark.serving.compress import Ask, Compressor

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "xlm-roberta-large-random"
        build_model(d, args.device, args.layers)
        compressor = Compressor(d, args.device)
    build_s = time.perf_counter() - t0
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    res = harness.header(args.git_sha, gpu=gpu, argv=argv) | {
        "what": "llmlingua 0.2.2 compress_prompt_llmlingua2 through onespark.serving.compress.Compressor",
        "model": f"xlm-roberta-large shape ({args.layers or 24} x 1024, 16 heads, FFN 4096), random weights, FP32, "
                 "local unigram "
                 f"tokenizer of {len(compressor.pc.tokenizer)} pieces (the real one: 250K)",
        "llmlingua": llmlingua.__version__, "transformers": transformers.__version__, "rate": args.rate,
        "build_and_load_s": round(build_s, 1), "spark_prefill_tok_s_assumed": SPARK_PREFILL_TOK_S,
        "rows": []}
    ask = Ask(args.rate, 0)
    for n in args.tokens:
        text = prose(compressor, n, n)
        times, out = [], None
        for run in range(args.runs + 1):
            sync()
            t = time.perf_counter()
            out = compressor.compress([text], ask)[0]
            sync()
            if run:  # the first is the warm-up (cuBLAS handles, allocator)
                times.append(time.perf_counter() - t)
        before, after = compressor.count(text), compressor.count(out)
        ms = statistics.median(times) * 1000
        removed = before - after
        res["rows"].append({
            "tokens_in": before, "tokens_out": after, "kept": round(after / before, 3), "median_ms": round(ms, 1),
            "runs_ms": [round(x * 1000, 1) for x in times],
            "peak_gpu_mib": round(torch.cuda.max_memory_allocated() / 2**20) if gpu else None,
            # the Spark: prefill time the removed tokens would have cost, at the assumed rate (an estimate;
            # the compressor's own time on a GB10 is not this H200 figure, which is what the row measures)
            "spark_prefill_saved_s_estimate": round(removed / SPARK_PREFILL_TOK_S, 2)})
        r = res["rows"][-1]
        print(f"{n:>6} tokens -> {after:>6} ({r['kept']:.2f}): {ms:8.1f} ms median of {args.runs}; "
              f"Spark prefill saved ~{r['spark_prefill_saved_s_estimate']} s (estimate)", flush=True)
    out_path = Path(args.out or f"bench/results/compressor_{res.get('gpu', 'cpu')}.json")
    harness.write_result(out_path, res)
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
