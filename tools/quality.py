"""
What a lossy KV cache costs in quality, measured against the unquantized model on real text: the demo model on
pages of Python's documentation (pydoc_data.topics, in every Python installation).

    python tools/quality.py                       # demo model, --kv-dtype auto vs int8, a markdown table
    python tools/quality.py --ckpt DIR --tokens 4096 --chunk-size 512

Three numbers per KV dtype, each against the reference model run plainly (unchunked, uncached, fp32 logits):
    top-1        teacher-forced: at each position of the text, does the cached path's argmax equal the reference's
    ppl          perplexity of the text through the cached path (the reference's own is printed beside it)
    greedy       the cached path continues a prompt greedily; the reference, teacher-forced along that
                 continuation, picks the same token at each step this often
measure() takes the model under test and, separately, the reference, so that a quantized-weights model can be
judged by the same function and the rows merged into one table.
"""
import argparse
import math
import os
import sys

import pydoc_data.topics
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from cli import DEMO_CKPT, DTYPES  # noqa: E402
from kvcache import KV_DTYPES, make_cache  # noqa: E402
from model import Transformer  # noqa: E402
from offload import OffloadConfig  # noqa: E402
from task import run_task  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402


def pydoc_ids(tokenizer, n):
    """The first n tokens of Python's documentation pages, in a fixed order."""
    topics = pydoc_data.topics.topics
    return tokenizer.encode("\n\n".join(topics[t] for t in sorted(topics)))[:n]


@torch.inference_mode()
def cached_logits(model, ids, chunk_size, kv_dtype):
    """Logits [T, V] (fp32, CPU) of every position of ids through the chunked, cached path, as generate.prefill
    feeds it (chunk by chunk), with every position's logits kept instead of the last one's."""
    dev = model.tok_embeddings.weight.device
    cache, out = make_cache(model, OffloadConfig(), chunk_size, len(ids), kv_dtype=kv_dtype), []
    x = torch.tensor([ids], device=dev)                                   # [1, T]
    try:
        while cache.length < len(ids):
            t = cache.length
            n = min(chunk_size - t % chunk_size, len(ids) - t)
            cache.begin(n)
            cache.store.prefetch(cache.n_sealed)
            out.append(model(x[:, t:t + n], cache)[0].float().cpu())     # [n, V]
            if cache.commit():
                cache.store.seal(cache.n_sealed - 1)
    finally:
        cache.store.close()
    return torch.cat(out)                                                 # [T, V]


@torch.inference_mode()
def reference_logits(model, ids):
    return model(torch.tensor([ids], device=model.tok_embeddings.weight.device))[0].float().cpu()  # [T, V]


def perplexity(logits, ids):
    """exp of the mean next-token cross-entropy: logits [T, V] predict ids[1:]."""
    return math.exp(F.cross_entropy(logits[:-1], torch.tensor(ids[1:])).item())


def measure(model, ids, *, reference=None, kv_dtype="int8", chunk_size=64, prompt_tokens=256, new_tokens=128):
    """One row for `model` holding its KV as kv_dtype, judged against `reference` (default: model itself, plainly).
    ids: the text (a list of token ids). Returns a dict: top1_agreement, ppl, ref_ppl, ppl_change (relative),
    greedy_agreement (over new_tokens greedy tokens after the first prompt_tokens ids)."""
    reference = reference or model
    ref = reference_logits(reference, ids)                               # [T, V]
    got = cached_logits(model, ids, chunk_size, kv_dtype)                 # [T, V]
    ppl, ref_ppl = perplexity(got, ids), perplexity(ref, ids)
    prompt = ids[:prompt_tokens]
    new, _ = run_task(model, prompt, new_tokens, chunk_size=chunk_size, cfg=OffloadConfig(), kv_dtype=kv_dtype)
    along = reference_logits(reference, prompt + new[:-1])[len(prompt) - 1:].argmax(-1).tolist()  # [new_tokens]
    return {"kv_dtype": kv_dtype, "tokens": len(ids), "chunk_size": chunk_size,
            "top1_agreement": (got.argmax(-1) == ref.argmax(-1)).float().mean().item(),
            "ppl": ppl, "ref_ppl": ref_ppl, "ppl_change": ppl / ref_ppl - 1,
            "greedy_tokens": len(new), "greedy_agreement": sum(a == b for a, b in zip(along, new)) / len(new)}


def table(rows):
    lines = ["| KV | top-1 vs reference | ppl (reference) | ppl change | greedy agreement |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['kv_dtype']} | {r['top1_agreement']:.2%} | {r['ppl']:.3f} ({r['ref_ppl']:.3f}) | "
                     f"{r['ppl_change']:+.3%} | {r['greedy_agreement']:.2%} of {r['greedy_tokens']} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1].strip())
    p.add_argument("--ckpt", default=DEMO_CKPT, help="checkpoint directory (default: the demo model)")
    p.add_argument("--dtype", choices=DTYPES, default="fp32", help="compute dtype (default %(default)s)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens of text, teacher-forced (default %(default)s)")
    p.add_argument("--chunk-size", type=int, default=64, help="positions per KV chunk (default %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=256, help="prompt of the greedy run (default %(default)s)")
    p.add_argument("--new-tokens", type=int, default=128, help="greedy tokens generated (default %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default %(default)s)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = Transformer.from_pretrained(args.ckpt, dtype=DTYPES[args.dtype])
    reference = model if args.dtype == "fp32" else Transformer.from_pretrained(args.ckpt, dtype=torch.float32)
    ids = pydoc_ids(load_tokenizer(args.ckpt), args.tokens)
    rows = [measure(model, ids, reference=reference, kv_dtype=kv, chunk_size=args.chunk_size,
                    prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens) for kv in KV_DTYPES]
    print(f"{args.ckpt}, {args.dtype} compute, {len(ids)} tokens of pydoc text, chunk {args.chunk_size}; "
          f"reference: the {'same' if reference is model else 'fp32'} model, unchunked\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
