r"""
Speculative decoding side by side with plain decoding, in one process, interleaved: decode tokens/s,
tokens per verify step, KV bytes read per generated token, the guesser's time, and whether the
tokens are the same (they must be).

    python tools/speculation.py --contexts 2048,8192 --offloads none,disk --dtypes fp32,bf16
    python tools/speculation.py --tasks quote --contexts 6144 --offloads disk --dtypes bf16 \
        --repeats 3 --ks 4,6,8
    python tools/speculation.py --step-cost --contexts 2048,6144 --dtypes bf16

Tasks, on the demo model (trained on Python's reference manual) and the manual's pages:
    quote   the prompt is pages of the manual, then the opening of one of its paragraphs: the
            model goes on quoting it, which prompt lookup finds in the prompt
    code    the prompt is pages of the manual, then the opening of a code example from them
    free    the prompt is pages of the manual, then the opening of a page that is not among them,
            sampled at temperature 1: the model writes from memory, and lookup finds little to
            copy (greedy decoding of this small model at long contexts falls into loops, which
            lookup does find: the quote and code tasks measure those too)
Each (task, context, offload, dtype) runs plain and every --ks in turn, --repeats times, in fresh
caches; the figure is the median. The prompt's full chunks are computed once per (task, context,
dtype) and adopted by every later run from a KV store in a temporary directory (bit for bit what
prefill computes: tests/test_kvstore.py), so a run costs its decode and the prompt's open chunk.
Prints a markdown table (docs/speculation.md).
"""
import argparse
import os
import pydoc_data.topics
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import speculate  # noqa: E402
from checkpoint import CheckpointError  # noqa: E402
from generate import Sampling, decode_one_token, prefill  # noqa: E402
from kvcache import make_cache  # noqa: E402
from model import Transformer  # noqa: E402
from offload import OffloadConfig  # noqa: E402
from runs.cores import CoreWatch  # noqa: E402
from runs.flags import read_model_args, set_threads  # noqa: E402
from runs.kvstore import KVStore  # noqa: E402
from runs.task import run_task  # noqa: E402
from runs.taskdir import model_fingerprint, run_fingerprint  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets",
                    "tinyllama-pydoc")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOPICS = sorted(pydoc_data.topics.topics)


def document(tok, n_tokens, skip=()):
    """Pages of the manual, in order, until n_tokens: (ids, pages used)."""
    ids, used = [], []
    for t in TOPICS:
        if t in skip:
            continue
        page = tok.encode(pydoc_data.topics.topics[t] + "\n\n")
        if len(ids) + len(page) > n_tokens:
            continue  # a shorter page may still fit
        ids += page
        used.append(t)
    return ids, used


def task_prompt(tok, task, context, opening=32):
    """The prompt of a task at about `context` tokens: a document, then an opening to continue."""
    free_page = "lambda"
    doc, used = document(tok, context - opening, skip=(free_page,))
    if task == "free":
        return doc + tok.encode(pydoc_data.topics.topics[free_page])[:opening]
    text = pydoc_data.topics.topics[used[len(used) // 2]]
    if task == "code":
        at = text.find(">>> ")
        at = at if at >= 0 else len(text) // 2
    else:
        at = len(text) // 3
    return doc + tok.encode(text[at:])[:opening]


def one_run(model, task, ids, args, mode, k, tmp, store):
    """(new ids, stats) of one generation, plain (k None) or with lookup:k."""
    cfg = OffloadConfig(mode=mode, window=args.window, offload_dir=tmp,
                        cpu_budget_gib=0 if mode == "disk" else None)
    speculation = None
    if k is not None:
        def speculation(chunk_size, max_length):
            return speculate.Lookup(k)
    sampling = Sampling(temperature=1.0, seed=0) if task == "free" else Sampling()
    return run_task(model, ids, args.max_new_tokens, chunk_size=args.chunk_size, cfg=cfg,
                    sampling=sampling, task_id=f"spec_{os.getpid()}_{time.monotonic_ns()}",
                    speculation=speculation, kv_store=store.kv, fingerprint=store.fingerprint)


def chunk_bytes(model, args):
    """Bytes of one layer's chunk: K and V, [G, C, D] each."""
    a = model.args
    return 2 * a.n_kv_heads * args.chunk_size * a.head_dim * model.output.weight.element_size()


@torch.inference_mode()
def step_cost(model, tok, args, rows=(2, 3, 5, 7, 9), repeats=15):
    """What a verify step of N positions costs against a one-token step, at each context: medians
    of interleaved steps on one cache (--offload none)."""
    for context in [int(c) for c in args.contexts.split(",")]:
        ids, _ = document(tok, context)
        C = args.chunk_size
        cache = make_cache(model, OffloadConfig(), C, len(ids) + repeats * (sum(rows) + C * 2))
        prefill(model, cache, torch.tensor([ids]))
        token = torch.tensor([[ids[-1]]])
        times = {n: [] for n in (1, *rows)}
        for _ in range(repeats):
            for n in times:
                while cache.length % C + n > C:  # a verify step stays inside the open chunk
                    decode_one_token(model, cache, token)
                t = time.perf_counter()
                if n == 1:
                    decode_one_token(model, cache, token)
                else:
                    speculate.verify_step(model, cache, [ids[-1]] * n)
                    speculate.commit(cache, 1)
                times[n].append(time.perf_counter() - t)
        one = statistics.median(times[1])
        print(f"context {len(ids)}: one-token step {one * 1e3:.2f} ms; "
              + ", ".join(f"N={n} {statistics.median(times[n]) / one:.2f}x" for n in rows),
              flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", default=DEMO)
    p.add_argument("--tasks", default="quote,code,free")
    p.add_argument("--contexts", default="2048,8192")
    p.add_argument("--offloads", default="none,disk")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--ks", default=str(speculate.LOOKUP_K),
                   help="the K of each lookup:K setting to run, comma-separated (4 or lookup:4)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--window", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, help="default: as generate.py chooses (cores.py)")
    p.add_argument("--step-cost", action="store_true",
                   help="only time verify steps of N positions against one-token steps")
    args = p.parse_args()
    args.device = "cpu"
    watch = CoreWatch()
    ks = check(p, args)
    tok = load_tokenizer(args.ckpt)
    print("| task | context | offload | dtype | run | decode tok/s | x plain | tokens/step | "
          "KV bytes/token | guesser s | same tokens |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o700)
        for dtype in args.dtypes.split(","):
            try:
                model = Transformer.from_pretrained(args.ckpt, dtype=DTYPES[dtype])
            except CheckpointError as e:
                p.error(str(e))
            store = argparse.Namespace(kv=KVStore(os.path.join(tmp, f"store-{dtype}")),
                                       fingerprint=run_fingerprint(model_fingerprint(args.ckpt),
                                                                   dtype=dtype))
            set_threads(args, watch)
            print(f"<!-- {dtype}: {torch.get_num_threads()} threads, load "
                  f"{open('/proc/loadavg').read().split()[0]} -->", flush=True)
            if args.step_cost:
                step_cost(model, tok, args)
                continue
            for context in [int(c) for c in args.contexts.split(",")]:
                for task in args.tasks.split(","):
                    ids = task_prompt(tok, task, context)
                    for mode in args.offloads.split(","):
                        runs = {k: [] for k in [None] + ks}
                        for _ in range(args.repeats):
                            for k in runs:  # interleaved: plain, then each K, then again
                                runs[k].append(one_run(model, task, ids, args, mode, k, tmp, store))
                        report(task, len(ids), mode, dtype, runs, chunk_bytes(model, args))


def check(p, args):
    """Every flag before any work, each wrong one refused in one line (p.error: exit 2). Returns
    the lookup:K settings, as numbers."""
    def listed(flag, value, allowed):
        items = [v.strip() for v in value.split(",") if v.strip()]
        if not items or any(v not in allowed for v in items):
            p.error(f"{flag} {value!r}: a comma list of {sorted(allowed)}")

    listed("--tasks", args.tasks, {"quote", "code", "free"})
    listed("--offloads", args.offloads, {"none", "cpu", "disk"})
    listed("--dtypes", args.dtypes, set(DTYPES))
    try:
        ks = [int(k.strip().removeprefix("lookup:")) for k in args.ks.split(",")]
        contexts = [int(c) for c in args.contexts.split(",")]
    except ValueError:
        p.error("--ks takes K or lookup:K and --contexts token counts, comma-separated")
    if min(ks) < 1 or min(contexts) < 64 or args.max_new_tokens < 2 or args.repeats < 1:
        p.error("--ks must be >= 1, --contexts >= 64, --max-new-tokens >= 2 and --repeats >= 1")
    if args.chunk_size < 1 or args.window < 0 or (args.threads is not None and args.threads < 1):
        p.error("--chunk-size and --threads must be >= 1, --window >= 0")
    try:
        limit = read_model_args(args.ckpt).max_context
    except CheckpointError as e:
        p.error(str(e))
    if max(contexts) + args.max_new_tokens > limit:
        p.error(f"--contexts {max(contexts)} plus --max-new-tokens {args.max_new_tokens} are past "
                f"the model's {limit} positions")
    return ks


def report(task, n_prompt, mode, dtype, runs, chunk_bytes):
    plain_ids = runs[None][0][0]
    plain = statistics.median(s["decode_tokens_per_s"] for _, s in runs[None])
    for k, results in runs.items():
        rate = statistics.median(s["decode_tokens_per_s"] for _, s in results)
        same = all(new == plain_ids for new, _ in results)
        if k is None:  # every sealed chunk, every step
            per_token = results[0][1]["chunks_read_per_decode_step"] * chunk_bytes
            spec = {"tokens_per_step": 1.0, "draft_s": 0.0}
            name = "plain"
        else:
            spec = results[0][1]["speculation"]
            per_token = spec["kv_bytes_per_token"]
            name = f"lookup:{k}"
        print(f"| {task} | {n_prompt} | {mode} | {dtype} | {name} | {rate:.1f} | "
              f"{rate / plain:.2f} | {spec['tokens_per_step']:.2f} | {per_token / 2**20:.2f} MiB | "
              f"{spec['draft_s']:.3f} | {'yes' if same else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()
