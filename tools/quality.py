"""
What a lossy setting costs in quality, judged against the unquantized fp32 model on real text: the
demo model (assets/tinyllama-pydoc) reading pages of Python's own documentation (pydoc_data.topics,
`help("assert")` etc.).

    python tools/quality.py --pages 40 --window 256 --prompts 8 --new-tokens 48

Two measurements per variant (fp32, bf16, int8 weights with bf16 or fp32 activations, int8 with a
bf16 output, int8 KV, int8 weights with int8 KV, and the same for int4):
- teacher-forced: every page's first `window` tokens go through the model in one call; top-1
  agreement with the fp32 model's next-token choice at every position, and perplexity of the true
  next tokens (and its change).
- greedy continuation: the variant continues a real-text prompt greedily through run_task (the
  cached, chunked path that generation uses); the fp32 model then reads prompt + continuation in
  one call, and we count how many continuation tokens are also the fp32 model's top-1 at that
  position.
The demo model saw these pages in training (all but 5% of its documents) and 256-token windows
only; the numbers compare settings with each other, they do not say how good the model is.

With --passkey LENGTHS, a long-context check where KV precision bites: passkey retrieval (an
instruction, filler text, "The pass key is N. Remember it. N is the pass key." at five depths, the
question at the end), per KV format: how many keys the greedy answer starts with, the mean
log-probability of the key's tokens read teacher-forced, and the top-1 agreement with the fp32
model along the whole prompts and along as many tokens of real text (these move even where the
model never retrieves: the demo model, trained on 256-token windows, does not).

    python tools/quality.py --variants int4,int4-kv --passkey 1024,4096
"""
import argparse
import math
import os
import pydoc_data.topics
import random
import re
import sys
from contextlib import contextmanager

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import kvcache  # noqa: E402
from checkpoint import CheckpointError  # noqa: E402
from kvcache import make_cache  # noqa: E402
from kvlayout import PlainLayout, levels  # noqa: E402
from model import Transformer  # noqa: E402
from offload import OffloadConfig  # noqa: E402
from quantize import Int4Linear, quantize_weight_int4  # noqa: E402
from runs.task import run_task  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402

DEMO = os.path.join(ROOT, "assets", "tinyllama-pydoc")
# name -> (compute dtype, quantize, KV dtype); int8-blocks keeps the output matrix in bf16 (what
# quantizing it costs); int4-sym requantizes int4 with symmetric scales, and int4-kv-tok holds int4
# keys per token instead of per channel (measurements behind two choices: quantize.py, kvlayout.py)
VARIANTS = {
    "fp32": (torch.float32, None, None),
    "bf16": (torch.bfloat16, None, None),
    "int8": (torch.bfloat16, "int8", None),
    "int8-blocks": (torch.bfloat16, "int8", None),
    "int8-fp32-act": (torch.float32, "int8", None),
    "bf16-kv": (torch.float32, None, "bf16"),
    "fp16-kv": (torch.float32, None, "fp16"),
    "int8-kv": (torch.float32, None, "int8"),
    "int8+int8-kv": (torch.bfloat16, "int8", "int8"),
    "int4": (torch.bfloat16, "int4-g32", None),
    "int4-g64": (torch.bfloat16, "int4-g64", None),
    "int4-sym": (torch.bfloat16, "int4-g32", None),
    "int4-kv": (torch.float32, None, "int4"),
    "int4-kv-tok": (torch.float32, None, "int4-tok"),
    "int4+int4-kv": (torch.bfloat16, "int4-g32", "int4"),
}


# -----------------------------------------------------------------------------
# the variants that exist only here, as measurements

class TokenKeysInt4(PlainLayout):
    """int4-kv-tok: K and V both quantized per token and kv head (16 levels between the row's
    minimum and maximum, fp16 scale and minimum, as Int4Layout's values), simulated: stored
    dequantized in the compute dtype. The alternative to Int4Layout's per-channel keys."""

    def write(self, chunk, off, k, v):
        super().write(chunk, off, per_token_int4(k), per_token_int4(v))


def per_token_int4(x):
    """x [..., D] through 4 bits per row and back."""
    xf = x.float()
    lo = xf.amin(-1, keepdim=True).half().float()
    scale = ((xf.amax(-1, keepdim=True) - lo) / 15).clamp_min(2 ** -24).half().float()
    return (levels(xf, lo, scale) * scale + lo).to(x.dtype)


@contextmanager
def measured_layouts():
    """Inside: caches built for kv_dtype "int4-tok" hold TokenKeysInt4 (kvcache.make_cache asks
    kvcache.chunk_layout)."""
    plain = kvcache.chunk_layout

    def chunk_layout(kv_dtype, dtype):
        return TokenKeysInt4(dtype) if kv_dtype == "int4-tok" else plain(kv_dtype, dtype)
    kvcache.chunk_layout = chunk_layout
    try:
        yield
    finally:
        kvcache.chunk_layout = plain


def load_variant(ckpt, name):
    """The model of a VARIANTS row."""
    dtype, quantize, _ = VARIANTS[name]
    model = Transformer.from_pretrained(ckpt, dtype=dtype, quantize=quantize)
    if name == "int8-blocks":
        model.output = Transformer.from_pretrained(ckpt, dtype=dtype).output
    if name == "int4-sym":
        full = dict(Transformer.from_pretrained(ckpt).named_modules())  # fp32
        for path, module in model.named_modules():
            if isinstance(module, Int4Linear):
                q, sz = quantize_weight_int4(full[path].weight, module.group_size, symmetric=True)
                module.load_quantized(q, sz)
    return model


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
def logits_of(model, ids, kv_dtype=None, chunk_size=64, chunked=False):
    """Teacher-forced logits [T, V] of ids [T]: in one call with the KV in the model's dtype; with
    kv_dtype="int8" (or chunked=True) through the chunked, cached path (as generate.prefill feeds
    it, every position's logits kept), since the KV's dtype exists only there."""
    dev = model.tok_embeddings.weight.device
    x = torch.tensor([ids], device=dev)                                   # [1, T]
    if kv_dtype in (None, "auto") and not chunked:
        return model(x)[0].float().cpu()
    cache = make_cache(model, OffloadConfig(), chunk_size, len(ids), kv_dtype=kv_dtype or "auto")
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
        kv_dtype = VARIANTS[name][2]
        model = load_variant(ckpt, name)
        with measured_layouts():
            top1, ppl = teacher_forced(model, ref_logits, pages, kv_dtype)
            greedy, n = greedy_agreement(model, reference, prompts, new_tokens, kv_dtype=kv_dtype)
        rows.append({"variant": name, "top1_agreement": top1, "perplexity": ppl,
                     "perplexity_change": ppl / ref_ppl - 1, "greedy_agreement": greedy,
                     "greedy_tokens": n, "positions": len(pages) * (window - 1)})
    return rows


# -----------------------------------------------------------------------------
# passkey retrieval

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
         "it. I will quiz you about the important information there.\n")
FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
          "again. ")
QUESTION = "\nWhat is the pass key? The pass key is"
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def passkey_text(tok, n_tokens, depth, key):
    """About n_tokens of instruction, filler with the needle at `depth` (0: first, 1: last) and the
    question."""
    needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
    per_filler = len(tok.encode(FILLER * 10)) / 10
    fixed = len(tok.encode(INTRO + needle + QUESTION))
    n = max(0, round((n_tokens - fixed) / per_filler))
    before = round(n * depth)
    return INTRO + FILLER * before + needle + FILLER * (n - before) + QUESTION


def passkey_prompts(tok, length, seed=0):
    """Five (prompt ids, prompt + key ids, key) at one length, a depth each."""
    rng = random.Random(seed * 7919 + length)
    out = []
    for depth in DEPTHS:
        key = str(rng.randint(10000, 99999))
        text = passkey_text(tok, length, depth, key)
        ids = tok.encode(text)
        full = tok.encode(f"{text} {key}")
        if full[:len(ids)] != ids:  # the answer must not merge into the question's last token
            raise ValueError("passkey: the key's tokens change the question's")
        out.append((ids, full, key))
    return out


@torch.inference_mode()
def passkey(model, tok, prompts, ref_top1, kv_dtype=None, chunk_size=512, new_tokens=8):
    """One length's prompts (passkey_prompts): (keys retrieved, mean log-probability per key token,
    top-1 agreement with ref_top1 along the prompts). Retrieved: the greedy answer (run_task,
    offload none) starts with the key. ref_top1: per prompt, the reference's argmax [T] over
    prompt + key."""
    hits = 0
    logp = 0.0
    n_key = 0
    agree = 0
    n = 0
    for (ids, full, key), ref in zip(prompts, ref_top1):
        new, _ = run_task(model, ids, new_tokens, chunk_size=chunk_size, cfg=OffloadConfig(),
                          kv_dtype=kv_dtype or "auto")
        answer = re.match(r"\s*(\d+)", tok.decode(new))
        hits += bool(answer) and answer.group(1) == key
        logits = logits_of(model, full, kv_dtype, chunk_size, chunked=True)   # [T, V]
        agree += (logits.argmax(-1) == ref).sum().item()
        n += len(ref)
        # [key tokens, V]: the predictions of the key's tokens
        on_key = logits[len(ids) - 1:-1].float().log_softmax(-1)
        logp += on_key.gather(1, torch.tensor(full[len(ids):])[:, None]).sum().item()
        n_key += len(full) - len(ids)
    return hits, logp / n_key, agree / n


def passkey_table(ckpt, variants, lengths, chunk_size=512):
    """A row per variant and length: passkey retrieval, and top-1 agreement with the fp32 model
    (its KV as computed, through the same chunked path) along the passkey prompts and along as many
    tokens of Python's documentation."""
    tok = Tokenizer(ckpt)
    reference = Transformer.from_pretrained(ckpt, dtype=torch.float32)
    prompts = {n: passkey_prompts(tok, n) for n in lengths}
    docs = {n: pydoc_ids(tok, n) for n in lengths}

    def top1(model, ids, kv_dtype):
        return logits_of(model, ids, kv_dtype, chunk_size, chunked=True).argmax(-1)    # [T]
    ref_top1 = {n: [top1(reference, full, None) for _, full, _ in prompts[n]] for n in lengths}
    ref_docs = {n: top1(reference, docs[n], None) for n in lengths}
    rows = []
    for name in variants:
        model = load_variant(ckpt, name)
        kv_dtype = VARIANTS[name][2]
        for n in lengths:
            with measured_layouts():
                hits, logp, agree = passkey(model, tok, prompts[n], ref_top1[n], kv_dtype,
                                            chunk_size)
                on_docs = (top1(model, docs[n], kv_dtype) == ref_docs[n]).float().mean().item()
            tokens = sum(len(ids) for ids, _, _ in prompts[n]) // len(DEPTHS)
            rows.append({"variant": name, "length": n, "prompt_tokens": tokens, "hits": hits,
                         "key_logprob": logp, "top1_agreement": agree, "top1_docs": on_docs})
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
    p.add_argument("--passkey", metavar="LENGTHS",
                   help="also run passkey retrieval at these prompt lengths (comma list, e.g. "
                   "1024,4096), five depths each, for --passkey-variants")
    p.add_argument("--passkey-variants", default="bf16,int8-kv,int4-kv,int4-kv-tok",
                   help="variants the passkey check runs (default %(default)s)")
    p.add_argument("--passkey-chunk", type=int, default=512,
                   help="chunk size of the passkey runs (default 512)")
    args = p.parse_args(argv)
    names = [v for v in args.variants.split(",") if v]
    pk_names = [v for v in args.passkey_variants.split(",") if v]
    for flag, listed in (("--variants", names), ("--passkey-variants", pk_names)):
        if any(v not in VARIANTS for v in listed):
            p.error(f"{flag} {','.join(listed)!r}: each must be one of {list(VARIANTS)}")
    lengths = []
    if args.passkey:
        try:
            lengths = [int(n) for n in args.passkey.split(",")]
        except ValueError:
            p.error(f"--passkey {args.passkey!r}: give comma-separated token counts")
    for flag, value, least in (("--pages", args.pages, 1), ("--window", args.window, 2),
                               ("--prompts", args.prompts, 1), ("--new-tokens", args.new_tokens, 1),
                               ("--passkey-chunk", args.passkey_chunk, 1)):
        if value < least:
            p.error(f"{flag} {value}: give at least {least}")
    if lengths and min(lengths) < 64:
        p.error(f"--passkey {args.passkey}: give prompt lengths of at least 64 tokens")
    try:
        return report(args, names, pk_names, lengths)
    except (CheckpointError, ValueError) as e:  # a checkpoint, or a variant's shape refused
        p.error(str(e))


def report(args, names, pk_names, lengths):
    """The tables main prints."""
    rows = quality_table(args.ckpt, names, args.pages, args.window, args.prompts, 64,
                         args.new_tokens) if names else []
    if rows:
        print(f"{args.ckpt}, {args.pages} pydoc pages x {args.window} tokens teacher-forced, "
              f"{args.prompts} prompts x {args.new_tokens} greedy tokens; against the fp32 model\n")
        print("| weights / activations / KV | top-1 agreement | perplexity | change | greedy "
              "continuation agreement |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['top1_agreement']:.2%} | {r['perplexity']:.3f} | "
              f"{r['perplexity_change']:+.2%} | {r['greedy_agreement']:.2%} "
              f"({r['greedy_tokens']} tokens) |")
    if lengths:
        print(f"\npasskey retrieval, {len(DEPTHS)} depths per length, chunk {args.passkey_chunk}\n")
        print("| variant | prompt tokens | keys retrieved | mean log-prob per key token | top-1 "
              "agreement with fp32: along the prompts | along as many tokens of pydoc |\n"
              "|---|---|---|---|---|---|")
        for r in passkey_table(args.ckpt, pk_names, lengths, args.passkey_chunk):
            print(f"| {r['variant']} | {r['prompt_tokens']} | {r['hits']} of {len(DEPTHS)} | "
                  f"{r['key_logprob']:.3f} | {r['top1_agreement']:.2%} | {r['top1_docs']:.2%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
