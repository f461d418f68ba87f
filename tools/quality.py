"""
What a lossy setting costs in quality, judged against the unquantized fp32 model on real text: the
demo model (assets/tinyllama-pydoc) reading pages of Python's own documentation (pydoc_data.topics,
`help("assert")` etc.).

    python tools/quality.py --pages 40 --window 256 --prompts 8 --new-tokens 48

Two measurements per variant (fp32, bf16, int8 weights with bf16 or fp32 activations, int8 with a
bf16 output, int8 KV, and int8 weights with int8 KV):
- teacher-forced: every page's first `window` tokens go through the model in one call; top-1
  agreement with the fp32 model's next-token choice at every position, and perplexity of the true
  next tokens (and its change).
- greedy continuation: the variant continues a real-text prompt greedily through run_task (the
  cached, chunked path that generation uses); the fp32 model then reads prompt + continuation in
  one call, and we count how many continuation tokens are also the fp32 model's top-1 at that
  position.
The demo model saw these pages in training (all but 5% of its documents) and 256-token windows
only; the numbers compare settings with each other, they do not say how good the model is.
"""
import argparse
import math
import os
import pydoc_data.topics
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from kvcache import make_cache  # noqa: E402
from model import Transformer  # noqa: E402
from offload import OffloadConfig  # noqa: E402
from task import run_task  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402

DEMO = os.path.join(ROOT, "assets", "tinyllama-pydoc")
# name -> (compute dtype, quantize, KV dtype); int8-blocks keeps the output matrix in bf16 (what
# quantizing it costs)
VARIANTS = {
    "fp32": (torch.float32, None, None),
    "bf16": (torch.bfloat16, None, None),
    "int8": (torch.bfloat16, "int8", None),
    "int8-blocks": (torch.bfloat16, "int8", None),
    "int8-fp32-act": (torch.float32, "int8", None),
    "int8-kv": (torch.float32, None, "int8"),
    "int8+int8-kv": (torch.bfloat16, "int8", "int8"),
}


def pydoc_pages(tok, n_pages, window):
    """Token ids of the first `window` tokens of n_pages pages of pydoc_data.topics, in sorted-key
    order (skipping pages shorter than a window, so every page contributes the same number of
    positions)."""
    from pydoc_data.topics import topics
    pages = []
    for key in sorted(topics):
        ids = tok.encode(topics[key])
        if len(ids) >= window:
            pages.append(ids[:window])
        if len(pages) == n_pages:
            break
    return pages


@torch.inference_mode()
def logits_of(model, ids, kv_dtype=None, chunk_size=64):
    """Teacher-forced logits [T, V] of ids [T]: in one call with the KV in the model's dtype; with
    kv_dtype="int8" through the chunked, cached path (as generate.prefill feeds it, every
    position's logits kept), since the KV's dtype exists only there."""
    dev = model.tok_embeddings.weight.device
    x = torch.tensor([ids], device=dev)                                   # [1, T]
    if kv_dtype in (None, "auto"):
        return model(x)[0].float().cpu()
    cache = make_cache(model, OffloadConfig(), chunk_size, len(ids), kv_dtype=kv_dtype)
    out = []
    try:
        while cache.length < len(ids):
            t = cache.length
            n = min(chunk_size - t % chunk_size, len(ids) - t)
            cache.begin(n)
            cache.store.prefetch(cache.reads())
            out.append(model(x[:, t:t + n], cache)[0].float().cpu())     # [n, V]
            if cache.commit():
                cache.store.seal(cache.n_sealed - 1)
    finally:
        cache.store.close()
    return torch.cat(out)                                                 # [T, V]


def teacher_forced(model, ref_logits, pages, kv_dtype=None):
    """(top-1 agreement with the reference, perplexity) over every next-token position of every
    page."""
    agree = 0
    total = 0
    nll = 0.0
    for ids, ref in zip(pages, ref_logits):
        logits = logits_of(model, ids, kv_dtype)[:-1]    # [T-1, V]: predictions of ids[1:]
        agree += (logits.argmax(-1) == ref[:-1].argmax(-1)).sum().item()
        nll += F.cross_entropy(logits.float(), torch.tensor(ids[1:]), reduction="sum").item()
        total += len(ids) - 1
    return agree / total, math.exp(nll / total)


def greedy_agreement(model, reference, prompts, new_tokens, chunk_size=64, kv_dtype=None):
    """The fraction of `model`'s greedy continuation tokens (generated through run_task, offload
    none) that are also the reference model's top-1 when it reads prompt + continuation
    (teacher-forced along the continuation). Returns (fraction, tokens counted)."""
    agree = 0
    total = 0
    for prompt in prompts:
        new, _ = run_task(model, prompt, new_tokens, chunk_size=chunk_size, cfg=OffloadConfig(),
                          kv_dtype=kv_dtype or "auto")
        ref = logits_of(reference, prompt + new)         # [P+N, V]
        # the reference's choice at each new position
        picks = ref[len(prompt) - 1:-1].argmax(-1).tolist()
        agree += sum(a == b for a, b in zip(picks, new))
        total += len(new)
    return agree / total, total


def pydoc_ids(tokenizer, n):
    """The first n tokens of Python's documentation pages, in a fixed order."""
    topics = pydoc_data.topics.topics
    return tokenizer.encode("\n\n".join(topics[t] for t in sorted(topics)))[:n]


def perplexity(logits, ids):
    """Perplexity of ids[1:] under the logits [T, V] of ids."""
    return math.exp(F.cross_entropy(logits[:-1], torch.tensor(ids[1:])).item())


def measure(model, ids, *, reference=None, kv_dtype="int8", chunk_size=64, prompt_tokens=256,
            new_tokens=128):
    """One row for `model` holding its KV as kv_dtype, judged against `reference` (default: model
    itself, plainly). ids: the text (a list of token ids). Returns a dict: top1_agreement, ppl,
    ref_ppl, ppl_change (relative), greedy_agreement (over new_tokens greedy tokens after the first
    prompt_tokens ids)."""
    reference = reference or model
    ref = logits_of(reference, ids)                                       # [T, V]
    got = logits_of(model, ids, kv_dtype, chunk_size)                     # [T, V]
    prompt = ids[:prompt_tokens]
    new, _ = run_task(model, prompt, new_tokens, chunk_size=chunk_size, cfg=OffloadConfig(),
                      kv_dtype=kv_dtype)
    # [new_tokens]: the reference's top-1 along the continuation
    along = logits_of(reference, prompt + new[:-1])[len(prompt) - 1:].argmax(-1).tolist()
    return {"kv_dtype": kv_dtype, "tokens": len(ids), "chunk_size": chunk_size,
            "top1_agreement": (got.argmax(-1) == ref.argmax(-1)).float().mean().item(),
            "ppl": perplexity(got, ids), "ref_ppl": perplexity(ref, ids),
            "ppl_change": perplexity(got, ids) / perplexity(ref, ids) - 1,
            "greedy_tokens": len(new),
            "greedy_agreement": sum(a == b for a, b in zip(along, new)) / len(new)}


def quality_table(ckpt=DEMO, variants=tuple(VARIANTS), n_pages=40, window=256, n_prompts=8,
                  prompt_len=64, new_tokens=48):
    """A row per variant: teacher-forced agreement and perplexity, and greedy-continuation
    agreement, all against the fp32 model of ckpt."""
    tok = Tokenizer(ckpt)
    pages = pydoc_pages(tok, n_pages, window)
    prompts = [p[:prompt_len] for p in pages[:n_prompts]]
    reference = Transformer.from_pretrained(ckpt, dtype=torch.float32)
    ref_logits = [logits_of(reference, ids) for ids in pages]
    _, ref_ppl = teacher_forced(reference, ref_logits, pages)
    rows = []
    for name in variants:
        dtype, quantize, kv_dtype = VARIANTS[name]
        model = Transformer.from_pretrained(ckpt, dtype=dtype, quantize=quantize)
        if name == "int8-blocks":
            model.output = Transformer.from_pretrained(ckpt, dtype=dtype).output
        top1, ppl = teacher_forced(model, ref_logits, pages, kv_dtype)
        greedy, n = greedy_agreement(model, reference, prompts, new_tokens, kv_dtype=kv_dtype)
        rows.append({"variant": name, "top1_agreement": top1, "perplexity": ppl,
                     "perplexity_change": ppl / ref_ppl - 1, "greedy_agreement": greedy,
                     "greedy_tokens": n, "positions": len(pages) * (window - 1)})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", default=DEMO,
                   help="checkpoint with a tokenizer (default: the demo model)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma list of {list(VARIANTS)}")
    p.add_argument("--pages", type=int, default=40,
                   help="pydoc topic pages read teacher-forced (default 40)")
    p.add_argument("--window", type=int, default=256,
                   help="tokens per page (default 256, the demo's trained context)")
    p.add_argument("--prompts", type=int, default=8,
                   help="pages whose first 64 tokens prompt a greedy continuation")
    p.add_argument("--new-tokens", type=int, default=48,
                   help="greedy tokens per prompt (default 48)")
    args = p.parse_args(argv)
    names = [v for v in args.variants.split(",") if v]
    if any(v not in VARIANTS for v in names):
        p.error(f"--variants {args.variants!r}: each must be one of {list(VARIANTS)}")
    rows = quality_table(args.ckpt, names, args.pages, args.window, args.prompts, 64,
                         args.new_tokens)
    print(f"{args.ckpt}, {args.pages} pydoc pages x {args.window} tokens teacher-forced, "
          f"{args.prompts} prompts x {args.new_tokens} greedy tokens; against the fp32 model\n")
    print("| weights / activations / KV | top-1 agreement | perplexity | change | greedy "
          "continuation agreement |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['top1_agreement']:.2%} | {r['perplexity']:.3f} | "
              f"{r['perplexity_change']:+.2%} | {r['greedy_agreement']:.2%} "
              f"({r['greedy_tokens']} tokens) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
