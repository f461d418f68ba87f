"""
Could the KV store (kvstore.py) keep prompt prefixes at a granule g finer than the chunk, so that a
document that does not end on a chunk boundary loses less than a chunk? Two questions, measured:

1. Does the KV of a position depend on the positions after it in the same prefill step? Prefill
   one prompt in steps of C (today's schedule: generate.prefill) and in steps of g, where g divides
   C, and compare every layer's K and V and the logits of every step's last position, bit for bit.
   If they were equal, a granule computed inside a longer step could be stored as it is; where they
   differ, storing at g needs every run to prefill in steps of g (the same schedule for the run
   that stores and the runs that reuse), which is question 2.
2. What do steps of g cost prefill? Tokens/s at steps of C and of each g, the schedules interleaved
   round by round (alternating their order) on the same prompt, medians.

    python tools/prefill_granule.py --context 4096 --granules 64,128,256 --threads 1
    python tools/prefill_granule.py --random-model smollm2-135m --context 2048 --threads 1

The cache is --offload none: a step's compute is the same in every mode (bit-identical), and the
tiers add no cost to prefill on CPU.
"""
import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from checkpoint import CheckpointError  # noqa: E402
from generate import forward  # noqa: E402
from kvcache import make_cache  # noqa: E402
from measure.random_model import build_random_checkpoint, parse_model_spec  # noqa: E402
from model import Transformer  # noqa: E402
from offload import OffloadConfig  # noqa: E402

DEMO_CKPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets",
                         "tinyllama-pydoc")


def prefill_in_steps(model, ids, chunk_size, step, tail_only=False, cache=None, end=None):
    """Prefill ids [1, P] in steps cut at every multiple of `step` (a divisor of chunk_size, so no
    step crosses a chunk boundary); with tail_only, only the prompt's last, partial chunk is cut at
    `step`, its whole chunks taking one step each. cache/end: go on with a cache that holds a prefix
    already, and stop at position `end`. Returns (cache, logits of each step's last position)."""
    P = ids.shape[1]
    C = chunk_size
    cache = cache or make_cache(model, OffloadConfig(), C, P + 1)
    logits = []
    while cache.length < (end or P):
        t = cache.length
        cut = C if tail_only and t // C < P // C else step
        n = min(cut - t % cut, (end or P) - t)
        logits.append((t + n, forward(model, cache, ids[:, t:t + n])))
    return cache, logits


def kv_of(cache):
    """Every position's K and V, layer by layer: [(K [B, G, T, D], V [B, G, T, D]), ...]."""
    store = cache.store
    C = cache.chunk_size
    out = []
    for layer in range(store.n_layers):
        parts = [cache.layout.read(store.load(layer, j), C) for j in range(cache.n_sealed)]
        if cache.length % C:
            parts.append(cache.layout.read(store.open_chunk(layer), cache.length % C))
        out.append(tuple(torch.cat([p[i] for p in parts], dim=2) for i in (0, 1)))
    return out


def compare(model, ids, chunk_size, granule):
    """Steps of C against steps of g: (positions whose K or V differ in some layer, positions of
    C's step ends whose logits differ, the largest K/V difference)."""
    ref_cache, ref_logits = prefill_in_steps(model, ids, chunk_size, chunk_size)
    cache, logits = prefill_in_steps(model, ids, chunk_size, granule)
    try:
        differ = torch.zeros(ids.shape[1], dtype=torch.bool)
        worst = 0.0
        for (k0, v0), (k1, v1) in zip(kv_of(ref_cache), kv_of(cache)):
            for a, b in ((k0, k1), (v0, v1)):
                diff = (a.float() - b.float()).abs()                              # [B, G, T, D]
                differ |= diff.amax(dim=(0, 1, 3)) > 0
                worst = max(worst, diff.max().item())
        by_pos = dict(logits)
        bad_logits = sum(not torch.equal(lg, by_pos[pos]) for pos, lg in ref_logits)
        return int(differ.sum()), bad_logits, len(ref_logits), worst
    finally:
        ref_cache.store.close()
        cache.store.close()


def timed_prefill(model, ids, chunk_size, step):
    """(wall seconds, CPU seconds of this thread) of one prefill. With --threads 1 torch computes in
    this thread, so its CPU time leaves out the time slices a busy machine gave to other jobs."""
    wall = time.perf_counter()
    cpu = time.thread_time()
    cache, _ = prefill_in_steps(model, ids, chunk_size, step)
    out = time.perf_counter() - wall, time.thread_time() - cpu
    cache.store.close()
    return out


def reuse_case(model, ids, chunk_size, granule, document):
    """The realistic case: a document of `document` tokens and a question, asked twice. Cold: the
    whole prompt's prefill. Warm: what is left to compute once the reusable prefix is adopted (full
    chunks today; full granules when the last partial chunk is cut at the granule). (seconds,
    positions) of each, CPU time of this thread."""
    out = {}
    for name, step, tail in (("today", chunk_size, False), ("tail", granule, True)):
        t = time.thread_time()
        cache, _ = prefill_in_steps(model, ids, chunk_size, step, tail_only=tail)
        cold = time.thread_time() - t
        cache.store.close()
        prefix = document // step * step
        cache, _ = prefill_in_steps(model, ids, chunk_size, step, tail_only=tail, end=prefix)
        t = time.thread_time()
        prefill_in_steps(model, ids, chunk_size, step, tail_only=tail, cache=cache)
        warm = time.thread_time() - t
        cache.store.close()
        out[name] = (cold, warm, ids.shape[1] - prefix)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", help="checkpoint directory (default: the demo model in assets/)")
    p.add_argument("--random-model", metavar="SPEC",
                   help="a random model instead: a preset of random_model.py, e.g. smollm2-135m")
    p.add_argument("--context", type=int, default=4096, help="prompt tokens (default 4096)")
    p.add_argument("--chunk-size", type=int, default=512, help="C (default 512)")
    p.add_argument("--granules", default="64,128,256",
                   help="granules g to try, each dividing C (default 64,128,256)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds (default 3)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--document", type=int,
                   help="also time the realistic case: the first N tokens of the prompt are a "
                   "document asked about twice, the rest a question; cold prefill and what a warm "
                   "run computes, today and with the last partial chunk cut at each granule")
    args = p.parse_args(argv)
    granules = [int(g) for g in args.granules.split(",")]
    if any(args.chunk_size % g for g in granules):
        print("prefill_granule.py: error: every --granules value must divide --chunk-size",
              file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    tmp = None
    ckpt = args.ckpt or DEMO_CKPT
    if args.random_model:
        tmp = tempfile.mkdtemp(prefix="granule-model-")
        ckpt = build_random_checkpoint(parse_model_spec(args.random_model), tmp, torch.float32)
    try:
        try:
            model = Transformer.from_pretrained(ckpt)
        except CheckpointError as e:
            p.error(str(e))
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, model.args.vocab_size, (1, args.context), generator=g)  # [B, P]
        a = model.args
        print(f"{args.random_model or ckpt}: {a.n_layers} layers, dim {a.dim}, fp32, context "
              f"{args.context}, chunk {args.chunk_size}, {torch.get_num_threads()} threads, "
              f"{time.strftime('%Y-%m-%d %H:%M')}, load {os.getloadavg()[0]:.2f}")
        print("\n| steps of | positions whose K/V differ from steps of C | step-end logits "
              "differing | largest K/V difference |\n|---|---|---|---|")
        for granule in granules:
            n_kv, n_logits, n_steps, worst = compare(model, ids, args.chunk_size, granule)
            print(f"| {granule} | {n_kv} of {args.context} | {n_logits} of {n_steps} | "
                  f"{worst:.3g} |")
        schedules = [args.chunk_size] + granules
        timed_prefill(model, ids[:, :args.chunk_size], args.chunk_size, args.chunk_size)  # warm up
        seconds = {s: [] for s in schedules}
        for r in range(args.repeats):  # interleaved, alternating the order: drift hits all alike
            for s in schedules if r % 2 == 0 else schedules[::-1]:
                seconds[s].append(timed_prefill(model, ids, args.chunk_size, s))
        print(f"\n| steps of | prefill tok/s, wall (median of {args.repeats}) | relative | "
              "prefill tok/s, thread CPU time | relative |\n|---|---|---|---|---|")
        base = [statistics.median(x[i] for x in seconds[args.chunk_size]) for i in (0, 1)]
        for s in schedules:
            med = [statistics.median(x[i] for x in seconds[s]) for i in (0, 1)]
            print(f"| {s} | {args.context / med[0]:,.0f} | {base[0] / med[0]:.2f}x | "
                  f"{args.context / med[1]:,.0f} | {base[1] / med[1]:.2f}x |")
        if args.document:
            print(f"\nA document of {args.document} tokens and a question of "
                  f"{args.context - args.document} (thread CPU time, median of {args.repeats})\n"
                  "\n| schedule | cold prefill s | warm: positions computed | warm compute s |"
                  "\n|---|---|---|---|")
            for granule in granules:
                runs = [reuse_case(model, ids, args.chunk_size, granule, args.document)
                        for _ in range(args.repeats)]
                for name, label in (("today", f"steps of {args.chunk_size}"),
                                    ("tail", f"last partial chunk in steps of {granule}")):
                    if name == "today" and granule != granules[0]:
                        continue
                    cold = statistics.median(r[name][0] for r in runs)
                    warm = statistics.median(r[name][1] for r in runs)
                    print(f"| {label} | {cold:.3f} | {runs[0][name][2]} | {warm:.3f} |")
        print(f"\nload {os.getloadavg()[0]:.2f} at the end")
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
