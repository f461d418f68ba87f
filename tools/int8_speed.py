r"""
Decode speed of int8 and int4 weights against bf16, on a random model of the SmolLM2-135M shape
(30 layers, E 576, 9 heads, 3 kv heads, D 64, F 1536, V 49152, tied embeddings), all in one process,
interleaved so that a busy machine slows every variant alike. Each run is task.run_task with
OffloadConfig() (no offload), as bench.py runs ours.

    OMP_NUM_THREADS=2 python tools/int8_speed.py --context 1200 --new-tokens 32 --repeats 3 \
        --threads 2,1

Decode speed is given three ways: the median step (wall clock), the median step in CPU time of the
one thread (with --threads 1: immune to time slices given to other jobs), and the fastest step of
all runs (the least disturbed, the best guess of an idle machine's speed when two threads share a
busy machine).

Variants: bf16 (no quantization), int8 (block linears and the output matrix), int8-blocks (block
linears only, the output shares the bf16 embedding): the last one is why quantize.py quantizes the
output matrix too; int4 and int4-g64 (--quantize int4, group size 32 or 64). The ratios are against
the first variant named:

    python tools/int8_speed.py --variants int8,int4,bf16 --threads 2,1 --repeats 5
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from measure.random_model import build_random_checkpoint  # noqa: E402
from model import Transformer  # noqa: E402
from offload import OffloadConfig  # noqa: E402
from quantize import weight_bytes  # noqa: E402
from runs.task import run_task  # noqa: E402

# name -> from_pretrained's quantize
VARIANTS = {"bf16": None, "int8": "int8", "int8-blocks": "int8", "int4": "int4-g32",
            "int4-g64": "int4-g64"}
SMOLLM2_135M = dict(dim=576, layers=30, heads=9, kv_heads=3, head_dim=64, hidden=1536, vocab=49152)


def tie(ckpt):
    """build_random_checkpoint writes untied models; SmolLM2 ties: drop lm_head.weight by config
    (it is ignored)."""
    path = os.path.join(ckpt, "config.json")
    with open(path) as f:
        hf_config = json.load(f)
    hf_config["tie_word_embeddings"] = True
    with open(path, "w") as f:
        json.dump(hf_config, f, indent=2)


def clock():
    """(wall, thread CPU) seconds."""
    return time.perf_counter(), time.thread_time()


def run_once(model, ids, new_tokens, chunk_size):
    """(new ids, stats) of one run_task, offload none, with the median decode step in wall time
    and, when torch runs one thread, in CPU time of this thread: on a machine shared with other
    jobs the wall clock also counts the time the OS gave the core to someone else, the thread's CPU
    time does not."""
    marks = []  # (wall, thread CPU) when the first token was sampled, then after each decode step

    def on_token(out):
        if len(out) == 1:
            marks.append(clock())

    def on_step(phase, *_):
        if phase == "decode":
            marks.append(clock())

    new, st = run_task(model, ids, new_tokens, chunk_size=chunk_size, cfg=OffloadConfig(),
                       on_token=on_token, on_step=on_step)
    for i, key in enumerate(("decode_tokens_per_s", "decode_tokens_per_cpu_s")):
        st[key] = 1 / statistics.median(b[i] - a[i] for a, b in zip(marks, marks[1:]))
    # the least disturbed step
    st["decode_tokens_per_s_best"] = 1 / min(b[0] - a[0] for a, b in zip(marks, marks[1:]))
    return new, st


def load_variants(ckpt, names):
    models = {}
    for name in names:
        q = VARIANTS[name]
        m = Transformer.from_pretrained(ckpt, dtype=torch.bfloat16, quantize=q)
        if name == "int8-blocks":  # put back the tied bf16 output matrix
            m.output = nn.Linear(m.args.dim, m.args.vocab_size, bias=False, device="meta")
            m.output.weight = m.tok_embeddings.weight
        models[name] = m
    return models


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=1200, help="prompt tokens (default 1200)")
    p.add_argument("--new-tokens", type=int, default=32,
                   help="greedy tokens per run (default 32)")
    p.add_argument("--repeats", type=int, default=3,
                   help="runs per variant and thread count; medians (default 3)")
    p.add_argument("--threads", default="2,1",
                   help="torch thread counts, comma separated (default 2,1)")
    p.add_argument("--variants", default="bf16,int8,int8-blocks",
                   help=f"comma list of {list(VARIANTS)}, the first the baseline of the ratios "
                   "(default bf16,int8,int8-blocks)")
    p.add_argument("--chunk-size", type=int, default=512,
                   help="positions per KV chunk (default 512)")
    args = p.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    names = args.variants.split(",")
    tmp = tempfile.mkdtemp(prefix="int8-speed-")
    try:
        return run(args, threads, names, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def med(runs, key):
    return statistics.median(r[key] for r in runs)


def run(args, threads, names, tmp):
    ckpt = build_random_checkpoint(SMOLLM2_135M, tmp, torch.bfloat16)
    tie(ckpt)
    models = load_variants(ckpt, names)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, SMOLLM2_135M["vocab"], (args.context,), generator=g).tolist()
    runs = {}
    out = {}
    for n in threads:  # warm-up, not recorded
        torch.set_num_threads(n)
        for name in names:
            run_once(models[name], ids[:600], 3, args.chunk_size)
    for rep in range(args.repeats):
        for n in threads:
            torch.set_num_threads(n)
            for name in names if rep % 2 == 0 else names[::-1]:
                out[name], st = run_once(models[name], ids, args.new_tokens, args.chunk_size)
                runs.setdefault((n, name), []).append(st)
                print(f"repeat {rep + 1} threads {n} {name:<12} prefill "
                      f"{st['prefill_tokens_per_s']:8.1f} tok/s  decode "
                      f"{st['decode_tokens_per_s']:7.2f} tok/s, per CPU s "
                      f"{st['decode_tokens_per_cpu_s']:7.2f}  load {os.getloadavg()[0]:.2f}",
                      file=sys.stderr)
    print(f"\nSmolLM2-135M shape (random, tied), context {args.context}, {args.new_tokens} new "
          f"tokens, chunk {args.chunk_size}, offload none, median of {args.repeats}; torch "
          f"{torch.__version__}, {os.cpu_count()} CPUs, load {os.getloadavg()}\n")
    first = names[0]  # the ratios are against the first variant
    print(f"| threads | weights | weight MiB | prefill tok/s | decode tok/s (min-max) | vs {first} "
          f"| decode tok per CPU s (min-max) | vs {first} | fastest step tok/s | vs {first} | "
          f"greedy ids = {first} |\n" + "|---" * 11 + "|")
    for n in threads:
        base = runs[(n, names[0])]
        for name in names:
            rs = runs[(n, name)]
            cells = []
            for k in ("decode_tokens_per_s", "decode_tokens_per_cpu_s"):
                if n == 1 or k == "decode_tokens_per_s":
                    v = [r[k] for r in rs]
                    cells.append(f"{med(rs, k):.1f} ({min(v):.1f}-{max(v):.1f}) | "
                                 f"{med(rs, k) / med(base, k):.2f}x")
                else:  # CPU time is the thread's own only with one thread
                    cells.append("- | -")
            best = max(r["decode_tokens_per_s_best"] for r in rs)
            base_best = max(r["decode_tokens_per_s_best"] for r in base)
            cells.append(f"{best:.1f} | {best / base_best:.2f}x")
            agree = sum(x == y for x, y in zip(out[name], out[names[0]])) / len(out[names[0]])
            weight_mib = weight_bytes(models[name]) / 2**20
            print(f"| {n} | {name} | {weight_mib:,.1f} | {med(rs, 'prefill_tokens_per_s'):,.0f} | "
                  f"{cells[0]} | {cells[1]} | {cells[2]} | {agree:.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
