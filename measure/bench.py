r"""
Measure it: prefill and decode speed, memory and bytes moved for every offload mode, against
transformers on the same checkpoint, beside a prediction made from this machine's own measured costs
(probe.py).

    python bench.py --ckpt DIR --contexts 1024,4096,8192 --modes none,cpu,disk,disk+zstd --vs-hf \
        --json out.json
    python bench.py --random-model 7b-like --layers 4 --dtype bf16 --contexts 4096,16384 \
        --modes none,disk
    python probe.py --offload-dir /mnt/nvme/kv    # what this machine can move, what offload costs
    python bench.py --kv-store /tmp/kvs --contexts 4096    # a second question: cold vs warm TTFT
    python bench.py --ckpt DIR --modes none --contexts 6258 --vs-llamacpp build/bin/llama-bench \
        --gguf DIR-f32.gguf    # beside llama.cpp, fresh processes (measure/llamacpp.py)
    bash scripts/gpu_check.sh OUT_DIR    # the CUDA tests, the probe and a KV-heavy bench on a GPU

Runs are interleaved (for each repeat: for each context: for each mode, the order reversed on odd
repeats), the calibration redone in each repeat, so that a shared machine's drift hits every mode
alike; in one process after a warm-up, or with --fresh-process each run (ours or transformers')
cold, in a process that loads only its model. Numbers are medians of --repeats runs, the spread
(min-max) beside them. Decode tok/s is 1 / the median step of a run (a preemption or a chunk seal,
1 step in C, does not move it; run_task's mean is decode_tokens_per_s_mean). The prompt is random
token ids with a fixed seed, so EOS never ends a run early.

JSON (--json OUT): {"machine", "config", "calibration", "results": [a row per context and mode: the
medians above, their spreads, ratios to none and to transformers, predicted decode], "hf":
[transformers' rows]}; with --vs-llamacpp {"machine", "config", "llamacpp" (its build, type and
KV), "results": [a row per context and mode: ours and theirs, medians and spreads, ours over
theirs]}.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

from checkpoint import CheckpointError
from disk import DiskError
from generate import decode_batch, prefill
from kvbatch import make_arena
from kvcache import make_cache
from kvlayout import kv_bytes_per_token
from measure import llamacpp, probe
from measure.flags import add_measure_flags, check_measure, measured_model_args
from measure.probe import GB, calibrate, decode_read_bytes, is_cuda, median_of, predict_decode
from model import Transformer
from offload import OffloadConfig
from pools import OffloadError
from private import PrivateError, make_private_dir, write_atomic
from quantize import weight_bytes
from runs.flags import (
    DTYPES,
    MODE_SPECS,
    ROOT,
    UsageError,
    one_line_errors,
    policy_fields,
    quantize_mode,
    remove_created_offload_dir,
    rope_override,
    set_threads,
)
from runs.monitor import host_memory
from runs.task import run_task
from runs.taskdir import TaskDirError

ALIASES = ("aliases: python bench.py --tune ... runs python tune.py ..., and python bench.py "
           "--probe ... runs python probe.py ...")
# the statistics a row reports as medians over its runs
MEDIANS = ("prefill_tokens_per_s", "decode_tokens_per_s", "decode_tokens_per_s_mean", "ttft_s",
           "peak_device_bytes", "peak_host_rss_bytes", "peak_host_anon_bytes")


def med(runs, key):
    """The median of one statistic over runs."""
    return statistics.median(r[key] for r in runs)


# -----------------------------------------------------------------------------
def batch_sizes(text):
    """--batch-sizes 1,4,16: argparse names the flag and this function in its error."""
    try:
        return [int(n) for n in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of whole numbers, e.g. "
                                         "1,4,8,16") from None


# the runs: ours, and transformers' on the same checkpoint, prompt and dtype

def run_ours(model, ids, args, mode, tag, new_tokens=None):
    offload, compress = MODE_SPECS[mode]
    cfg = OffloadConfig(mode=offload, window=args.window, offload_dir=args.offload_dir,
                        compress=compress, cpu_budget_gib=args.cpu_budget,
                        staging_slots=args.staging_slots,
                        group_buffers=args.group_buffers, **policy_fields(args))
    marks = []  # when the first token was sampled, then when each decode step ended

    def on_token(out):
        if len(out) == 1:
            marks.append(time.perf_counter())

    def on_step(phase, *_):
        if phase == "decode":
            marks.append(time.perf_counter())

    new, st = run_task(model, ids, new_tokens or args.new_tokens, chunk_size=args.chunk_size,
                       cfg=cfg, task_id=f"bench_{os.getpid()}_{tag}", kv_dtype=args.kv_dtype,
                       on_token=on_token, on_step=on_step)
    st["decode_step_s"] = statistics.median(np.diff(marks))
    st["decode_tokens_per_s_mean"] = st["decode_tokens_per_s"]  # run_task's: steps / their time
    st["decode_tokens_per_s"] = 1 / st["decode_step_s"]
    return new, st


def load_hf(ckpt, device, dtype):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local directory: never reach the network
    import transformers
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    return transformers.AutoModelForCausalLM.from_pretrained(ckpt, **{key: dtype}).to(device).eval()


# -----------------------------------------------------------------------------
# batched decode: N tasks' decode steps as one forward pass, beside transformers' [N, 1] steps

def run_batches(model, hf, args, ctx):
    """{(who, N): aggregate decode tokens/s}: N prompts of ctx tokens are prefilled (untimed), then
    --new-tokens decode steps are timed, ours as generate.decode_batch over N caches (--offload
    none), transformers' as one [N, 1] forward per step over one DynamicCache. Every N and both
    sides interleaved, --repeats times; medians."""
    g = torch.Generator().manual_seed(0)
    sizes = args.batch_sizes
    prompts = [torch.randint(3, model.args.vocab_size, (1, ctx), generator=g)
               for _ in range(max(sizes))]
    # untimed, once: the first timed size would pay the process's first steps (allocator, kernels'
    # first calls), and every ratio against it with them
    ours_batch(model, prompts[:sizes[0]], args)
    if hf is not None:
        hf_batch(hf, prompts[:sizes[0]], args)
    rates = {}
    for _ in range(args.repeats):
        for n in sizes:
            rates.setdefault(("ours", n), []).append(ours_batch(model, prompts[:n], args))
            if hf is not None:
                rates.setdefault(("hf", n), []).append(hf_batch(hf, prompts[:n], args))
    return {key: statistics.median(r) for key, r in rates.items()}


@torch.inference_mode()
def ours_batch(model, prompts, args):
    device = model.tok_embeddings.weight.device
    length = prompts[0].shape[1] + args.new_tokens + 1
    # one arena for the batch's chunks, as a --prompts job with --offload none has on CPU
    arena = make_arena(model, len(prompts), args.chunk_size, length, args.kv_dtype)
    caches = [make_cache(model, OffloadConfig(), args.chunk_size, length, kv_dtype=args.kv_dtype,
                         arena=arena) for _ in prompts]
    try:
        logits = torch.cat([prefill(model, c, p.to(device)) for c, p in zip(caches, prompts)])
        sync(device)
        start = time.perf_counter()
        for _ in range(args.new_tokens):
            logits, _ = decode_batch(model, caches, logits.argmax(-1, keepdim=True))
        sync(device)
        return len(prompts) * args.new_tokens / (time.perf_counter() - start)
    finally:
        for c in caches:
            c.store.close()


@torch.inference_mode()
def hf_batch(hf, prompts, args):
    import inspect

    import transformers
    device = next(hf.parameters()).device
    cache = transformers.DynamicCache(config=hf.config)
    params = inspect.signature(hf.forward).parameters
    kw = {"cache" if "cache" in params else "past_key_values": cache, "use_cache": True}
    ids = torch.cat(prompts).to(device)                            # [N, ctx]
    out = hf(input_ids=ids, logits_to_keep=1, **kw)
    token = out.logits[:, -1].argmax(-1, keepdim=True)             # [N, 1]
    sync(device)
    start = time.perf_counter()
    for _ in range(args.new_tokens):
        out = hf(input_ids=token, **kw)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
    sync(device)
    return len(prompts) * args.new_tokens / (time.perf_counter() - start)


def sync(device):
    if is_cuda(device):
        torch.cuda.synchronize(device)


def batch_table(rates, sizes):
    """Markdown: aggregate decode tokens/s per batch size, ours and transformers'."""
    lines = [f"| batch | ours tok/s | vs batch {sizes[0]} | transformers tok/s | vs batch "
             f"{sizes[0]} | ours / theirs |",
             "|---|---|---|---|---|---|"]
    for n in sizes:
        ours = rates[("ours", n)]
        row = f"| {n} | {ours:,.1f} | {ours / rates[('ours', sizes[0])]:.2f}x |"
        theirs = rates.get(("hf", n))
        if theirs:
            row += (f" {theirs:,.1f} | {theirs / rates[('hf', sizes[0])]:.2f}x | "
                    f"{ours / theirs:.2f} |")
        else:
            row += " - | - | - |"
        lines.append(row)
    return "\n".join(lines)


@torch.inference_mode()
def run_hf(hf, ids, new_tokens, device, offloaded=False):
    """Prefill in one call, then greedy decoding one token per call, with DynamicCache
    (offloading=True: each layer's KV goes to the CPU after use and is prefetched back for the next
    step; CUDA only)."""
    import inspect

    import transformers
    params = inspect.signature(hf.forward).parameters
    cuda = is_cuda(device)
    try:
        cache = transformers.DynamicCache(config=hf.config, offloading=offloaded)
    except TypeError:  # transformers 4.x
        cache = transformers.OffloadedCache() if offloaded else transformers.DynamicCache()
    kw = {"cache" if "cache" in params else "past_key_values": cache, "use_cache": True}
    # as generate() does: no logits for the prompt
    keep = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    peak = host_memory()
    t = time.perf_counter()
    prompt = torch.tensor([ids], device=device)                       # [1, T]
    tok = hf(input_ids=prompt, **kw, **keep).logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
    out = [tok.item()]
    marks = [time.perf_counter()]
    for _ in range(new_tokens - 1):
        tok = hf(input_ids=tok, **kw).logits[:, -1].argmax(-1, keepdim=True)
        out.append(tok.item())  # .item() synchronises
        marks.append(time.perf_counter())
        peak = {k: max(v, peak[k]) for k, v in host_memory().items()}
    layers = getattr(cache, "layers", None)
    if layers:
        kv = [x for layer in layers for x in (layer.keys, layer.values)]
    else:  # transformers 4.x
        kv = list(cache.key_cache) + list(cache.value_cache)
    step = statistics.median(np.diff(marks))
    if cuda:
        peak_device = torch.cuda.max_memory_allocated(device)
    else:  # as ours counts it: the weights and the KV
        peak_device = weight_bytes(hf) + sum(x.numel() * x.element_size() for x in kv)
    return out, {"prefill_tokens_per_s": len(ids) / (marks[0] - t), "ttft_s": marks[0] - t,
                 "decode_step_s": step, "decode_tokens_per_s": 1 / step,
                 "decode_tokens_per_s_mean": (new_tokens - 1) / (marks[-1] - marks[0]),
                 "peak_device_bytes": peak_device, "peak_host_rss_bytes": peak["rss"],
                 "peak_host_anon_bytes": peak["anon"]}


def make_prompts(vocab_size, contexts):
    g = torch.Generator().manual_seed(0)
    return {ctx: torch.randint(3, vocab_size, (ctx,), generator=g).tolist() for ctx in contexts}


def run_fresh(args, mode, ctx, new):
    """(ids, stats) of one run in a new process (--child-run: it loads only its model and runs
    once, no warm-up)."""
    # every flag that shapes a run: the child must run what this process would have run
    keep = ("ckpt", "device", "dtype", "quantize", "group_size", "kv_dtype", "chunk_size", "window",
            "offload_dir", "cpu_budget", "staging_slots", "rope_scaling", "rope_factor",
            "rope_orig_ctx", "contexts", "new_tokens", "threads", "attention", "products",
            "select", "select_budget", "select_dense", "placement", "group_buffers")
    flags = []
    for k in keep:
        if getattr(args, k) is not None:
            flags += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    # the top-level command, so the child finds the modules as this process does
    script = os.path.join(ROOT, "bench.py")
    cmd = [sys.executable, script, *flags, "--child-run", f"{mode}:{ctx}:{new}"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise UsageError(f"--fresh-process: the {mode} run at {ctx} tokens failed: "
                         f"{p.stderr.strip()[-300:]}")
    return json.loads(p.stdout.splitlines()[-1])


def run_contention(args, ctx, mode):
    """{"quiet"|"busy": [stats]}: the same run, each in a fresh process as a user starts it, quiet
    and beside a busy loop (another process that never sleeps, holding a core as a user's other
    work would), interleaved --repeats times."""
    runs = {"quiet": [], "busy": []}
    for rep in range(args.repeats):
        for state in ("quiet", "busy") if rep % 2 == 0 else ("busy", "quiet"):
            busy = None
            if state == "busy":
                busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            try:
                _, st = run_fresh(args, mode, ctx, args.new_tokens)
            finally:
                if busy is not None:
                    busy.kill()
                    busy.wait()
            runs[state].append(st)
            print(f"repeat {rep + 1}/{args.repeats} {state:<5} prefill "
                  f"{st['prefill_tokens_per_s']:9.1f} tok/s  decode "
                  f"{st['decode_tokens_per_s']:8.2f} tok/s", file=sys.stderr)
    return runs


def contention_table(runs):
    """Markdown: prefill and decode quiet, beside a busy loop, and the share kept."""
    lines = ["| | quiet tok/s | beside a busy loop tok/s | kept |", "|---|---|---|---|"]
    for key, name in (("prefill_tokens_per_s", "prefill"), ("decode_tokens_per_s", "decode")):
        quiet = statistics.median(r[key] for r in runs["quiet"])
        busy = statistics.median(r[key] for r in runs["busy"])
        lines.append(f"| {name} | {quiet:,.1f} | {busy:,.1f} | {busy / quiet:.0%} |")
    return "\n".join(lines)


def child_run(args, contexts, vocab_size, dtype):
    mode, ctx, new = args.child_run.split(":")
    ids = make_prompts(vocab_size, contexts)[int(ctx)]
    if mode.startswith("hf"):
        hf = load_hf(args.ckpt, device=args.device, dtype=dtype)
        return run_hf(hf, ids, int(new), args.device, mode == "hf-offloaded")
    model = Transformer.from_pretrained(args.ckpt, device=args.device, dtype=dtype,
                                        rope_override=rope_override(args),
                                        quantize=quantize_mode(args))
    return run_ours(model, ids, args, mode, f"fresh_{os.getpid()}", int(new))


def run_matrix(model, hf, args, contexts, modes):
    """{(context, mode): [stats of each repeat]}, interleaved; transformers runs as modes 'hf' (and
    on CUDA 'hf-offloaded'), and the calibration once per repeat, so that they drift with ours."""
    runs = {}
    ids_out = {}
    cals = []
    prompts = make_prompts(model.args.vocab_size, contexts)
    cuda = is_cuda(args.device)
    all_modes = list(modes)
    if args.vs_hf:
        all_modes += ["hf", "hf-offloaded"] if cuda else ["hf"]
    # on CUDA both models sit on the device: a run's peak leaves out the other library's weights
    other = {"hf": 0, "ours": 0}
    if hf and cuda:
        other = {"hf": weight_bytes(model), "ours": weight_bytes(hf)}

    def run(mode, ids, tag, new=args.new_tokens):
        if args.fresh_process:
            return run_fresh(args, mode, len(ids), new)
        if mode.startswith("hf"):
            return run_hf(hf, ids, new, args.device, mode == "hf-offloaded")
        return run_ours(model, ids, args, mode, tag, new)

    # a warm-up, not recorded: thread pools, allocators, lazy imports (with --fresh-process every
    # run pays for them, on both sides: it measures a cold start)
    if not args.fresh_process:
        for mode in all_modes:
            run(mode, prompts[min(contexts)][:args.chunk_size * (args.window + 2)],
                f"warmup_{mode}", 3)
    for rep in range(args.repeats):
        cals.append(calibrate(model, args, contexts, modes))
        order = all_modes if rep % 2 == 0 else all_modes[::-1]
        for ctx in contexts:
            for mode in order:
                ids_out[(ctx, mode)], st = run(mode, prompts[ctx], f"{rep}_{ctx}_{mode}")
                st["peak_device_bytes"] -= other["hf" if mode.startswith("hf") else "ours"]
                runs.setdefault((ctx, mode), []).append(st)
                print(f"repeat {rep + 1}/{args.repeats} context {ctx} {mode:<12} prefill "
                      f"{st['prefill_tokens_per_s']:9.1f} tok/s  decode "
                      f"{st['decode_tokens_per_s']:8.2f} tok/s  load {os.getloadavg()[0]:.2f}",
                      file=sys.stderr)
    return runs, ids_out, median_of(cals)


def run_reuse(model, args, contexts):
    """Time to first token of a second question (32 tokens) about the same document of `context`
    tokens through --kv-store, against the first (cold: nothing stored yet): [a row per context],
    medians of --repeats, each repeat on an empty store. Only whole chunks are stored, so a context
    that is a multiple of --chunk-size is the best case; any other leaves its partial last chunk,
    with the question, to compute again (the realistic case: --contexts 4096,2977)."""
    from runs.kvstore import KVStore
    rows = []
    g = torch.Generator().manual_seed(1)
    vocab = model.args.vocab_size
    offload, compress = MODE_SPECS[args.reuse_mode]
    # untimed, once, without the store: the first cold run would pay the process's first steps,
    # and show a speed-up where nothing was reused
    run_task(model, [3] * (min(contexts) + 32), 2, chunk_size=args.chunk_size, cfg=OffloadConfig())
    for ctx in contexts:
        doc = torch.randint(3, vocab, (ctx,), generator=g).tolist()
        asks = [torch.randint(3, vocab, (32,), generator=g).tolist() for _ in range(2)]
        cold = []
        warm = []
        for rep in range(args.repeats):
            # owner-only, as a store of its own would be (missing parents too)
            make_private_dir(args.kv_store, "--kv-store")
            store = KVStore(os.path.join(args.kv_store, f"bench-{os.getpid()}-{ctx}-{rep}"))
            for ask, out in zip(asks, (cold, warm)):
                cfg = OffloadConfig(mode=offload, compress=compress, window=args.window,
                                    offload_dir=args.offload_dir)
                _, st = run_task(model, doc + ask, 2, chunk_size=args.chunk_size, cfg=cfg,
                                 kv_store=store, fingerprint=f"bench-{ctx}",
                                 task_id=f"bench_{os.getpid()}_reuse")
                out.append(st)
            store.clear()
            os.rmdir(store.root)
        reused = warm[-1]["reused_tokens"]
        rows.append({"context": ctx + 32, "mode": args.reuse_mode,
                     "cold_ttft_s": med(cold, "ttft_s"), "warm_ttft_s": med(warm, "ttft_s"),
                     "speedup": med(cold, "ttft_s") / med(warm, "ttft_s"),
                     "reused_tokens": reused, "reused_fraction": reused / (ctx + 32),
                     "computed_tokens": warm[-1]["prefill_tokens"],
                     "stored_tokens": cold[-1]["stored_tokens"],
                     "store_bytes_read": warm[-1]["store_bytes_read"]})
    return rows


# -----------------------------------------------------------------------------
# report

def summarize(runs, ids_out, cal, args, model_args, contexts, modes, read_bytes=None):
    """The table's rows. read_bytes {context: bytes a decode step there reads}: with the measured
    read bandwidth, the memory roofline each decode speed is a fraction of."""
    rows = []
    hf_rows = []
    for ctx in contexts:
        theirs = [m for m in ("hf", "hf-offloaded") if (ctx, m) in runs]
        for mode in modes + theirs:
            rs = runs[(ctx, mode)]
            row = {"context": ctx, "mode": mode, "runs": len(rs)}
            row.update({k: med(rs, k) for k in MEDIANS})
            for k in ("prefill_tokens_per_s", "decode_tokens_per_s"):
                row[k + "_spread"] = [min(r[k] for r in rs), max(r[k] for r in rs)]
            if mode.startswith("hf"):
                row["greedy_ids_equal_ours"] = ids_out[(ctx, mode)] == ids_out.get((ctx, "none"))
                hf_rows.append(row)
                continue
            row["bytes"] = {k: med([r["bytes"] for r in rs], k) for k in rs[0]["bytes"]}
            row["chunks"] = rs[-1]["chunks"]
            for phase in ("prefill", "decode"):
                speed = f"{phase}_tokens_per_s"
                for key, ref in ((f"{phase}_vs_none", "none"), (f"ours_over_hf_{phase}", "hf")):
                    if (ctx, ref) in runs:
                        row[key] = row[speed] / med(runs[(ctx, ref)], speed)
            pred = predict_decode(cal, ctx, mode, args, model_args, is_cuda(args.device))
            row["predicted_decode_tokens_per_s"] = pred
            row["roofline_fraction"] = None
            if read_bytes and cal.get("read_gbps"):
                roofline = cal["read_gbps"] * GB / read_bytes[ctx]
                row["roofline_decode_tokens_per_s"] = roofline
                row["roofline_fraction"] = row["decode_tokens_per_s"] / roofline
            row["prediction_error"] = row["decode_tokens_per_s"] / pred - 1 if pred else None
            rows.append(row)
    return rows, hf_rows


def mib(n):
    """Bytes as MiB for a table: whole MiB from 1 MiB up, two decimals below."""
    return f"{n / 2**20:,.0f}" if n >= 2**20 else f"{n / 2**20:.2f}"


def spread(row, key):
    """A median and its spread: '12.3 (11.9-12.8)'."""
    low, high = row[key + "_spread"]
    return f"{row[key]:,.1f} ({low:,.1f}-{high:,.1f})"


def opt(x, spec):
    """x formatted, or '-' where there is none."""
    return "-" if x is None else format(x, spec)


def markdown(rows, hf_rows):
    lines = ["| context | mode | prefill tok/s (min-max) | decode tok/s (min-max) | of roofline "
             "| predicted | error | vs none: prefill / decode | TTFT s | peak device MiB "
             "| host RSS / anon MiB | disk tier write / read / read in place MiB |",
             "|---" * 12 + "|"]
    for r in rows:
        b = r["bytes"]
        lines.append(f"| {r['context']} | {r['mode']} | {spread(r, 'prefill_tokens_per_s')} | "
                     f"{spread(r, 'decode_tokens_per_s')} | "
                     f"{opt(r['roofline_fraction'], '.0%')} | "
                     f"{opt(r['predicted_decode_tokens_per_s'], ',.1f')} | "
                     f"{opt(r['prediction_error'], '+.0%')} | "
                     f"{opt(r.get('prefill_vs_none'), '.2f')} / "
                     f"{opt(r.get('decode_vs_none'), '.2f')} | {r['ttft_s']:.2f} | "
                     f"{mib(r['peak_device_bytes'])} | {mib(r['peak_host_rss_bytes'])} / "
                     f"{mib(r['peak_host_anon_bytes'])} | {mib(b['disk_write'])} / "
                     f"{mib(b['disk_read'])} / {mib(b['disk_mapped_read'])} |")
    if hf_rows:
        ours = {(r["context"], r["mode"]): r for r in rows}
        lines += ["",
                  "| context | transformers cache | prefill tok/s (min-max) | decode tok/s "
                  "(min-max) | ours none / theirs: prefill | decode | peak device MiB | host anon "
                  "MiB | same greedy ids |",
                  "|---" * 9 + "|"]
        for r in hf_rows:
            o = ours.get((r["context"], "none"))
            ratio = {k: opt(o and o[k] / r[k], ".2f")
                     for k in ("prefill_tokens_per_s", "decode_tokens_per_s")}
            cache = "DynamicCache" if r["mode"] == "hf" else "DynamicCache(offloading=True)"
            lines.append(f"| {r['context']} | {cache} | {spread(r, 'prefill_tokens_per_s')} "
                         f"| {spread(r, 'decode_tokens_per_s')} | {ratio['prefill_tokens_per_s']} "
                         f"| {ratio['decode_tokens_per_s']} | {mib(r['peak_device_bytes'])} "
                         f"| {mib(r['peak_host_anon_bytes'])} | {r['greedy_ids_equal_ours']} |")
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# command line

def build_parser():
    p = argparse.ArgumentParser(prog="bench.py", description=__doc__, epilog=ALIASES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_measure_flags(p, "bench")
    p.add_argument("--repeats", type=int, default=3,
                   help="runs of each context and mode, medians reported (default %(default)s)")
    p.add_argument("--vs-hf", action="store_true",
                   help="also run transformers (DynamicCache; on CUDA also offloaded)")
    p.add_argument("--contention", action="store_true",
                   help="the first --contexts and --modes, each run in a fresh process, quiet and "
                   "beside a busy loop on one core (interleaved, median of --repeats): how much of "
                   "its speed a run keeps when another process holds a core")
    p.add_argument("--fresh-process", action="store_true",
                   help="run each context and mode, ours and transformers', once in a process of "
                   "its own, cold (default: all in this process, after a warm-up)")
    # MODE:CONTEXT:NEW_TOKENS, --fresh-process's runs
    p.add_argument("--child-run", help=argparse.SUPPRESS)
    p.add_argument("--batch-sizes", type=batch_sizes,
                   metavar="N,N,...",
                   help="measure batched decode instead: aggregate decode tok/s of N tasks "
                   "decoding together at the first --contexts, for each N (with --vs-hf beside "
                   "transformers decoding [N, 1] per step), e.g. 1,4,8,16")
    p.add_argument("--visit-cost", action="store_true",
                   help="measure the fixed cost of one chunk visit (decode at the largest "
                   "--contexts with chunk 64 against 4096), and on CUDA the kernels per visit")
    p.add_argument("--vs-llamacpp", metavar="PATH",
                   help="instead: ours beside llama.cpp, PATH being a llama-bench binary you "
                   "built, on --gguf, at the same --contexts, threads and decode steps; every run "
                   "of both sides a fresh process, interleaved, medians of --repeats, ours at each "
                   "--modes (measure/llamacpp.py says how)")
    p.add_argument("--gguf", metavar="FILE",
                   help="with --vs-llamacpp: this checkpoint converted by llama.cpp's own "
                   "convert_hf_to_gguf.py to the weights that match ours: --outtype f32 for "
                   "--dtype fp32, bf16 for bf16, f16 for fp16, q8_0 for --quantize int8, and for "
                   "--quantize int4 the f32 file through `llama-quantize --pure F32.gguf "
                   "OUT.gguf Q4_1`; checked against the checkpoint before any timed run")
    p.add_argument("--llamacpp-fa", metavar="auto|on|off[,...]",
                   help="with --vs-llamacpp: llama-bench's flash attention, one setting or several "
                   "(each its own runs and rows, e.g. auto,off; default auto, its own default)")
    p.add_argument("--reuse-mode", default="none", choices=list(MODE_SPECS),
                   help="with --kv-store: the offload mode of the cold and warm runs "
                   "(default %(default)s)")
    return one_line_errors(p)


def check(args):
    """Every flag, before any heavy work. Returns (contexts, modes)."""
    if args.new_tokens < 2 or args.repeats < 1:
        raise UsageError("--new-tokens must be >= 2 and --repeats >= 1")
    if args.batch_sizes is not None and (not args.batch_sizes or min(args.batch_sizes) < 1):
        raise UsageError("--batch-sizes takes batch sizes >= 1, e.g. 1,4,8,16")
    if args.batch_sizes:  # once each, in order: the first is what the others are against
        args.batch_sizes = sorted(set(args.batch_sizes))
    contexts, modes = check_measure(args, "bench")
    if args.visit_cost and max(contexts) < 8192:
        # chunks of 64 against 4096: fewer positions leave too few extra visits to divide by
        raise UsageError("--visit-cost needs --contexts of 8192 or more (it compares chunks of 64 "
                         "with chunks of 4096 at the largest context)")
    if args.vs_llamacpp:
        llamacpp.check_flags(args)
    elif args.gguf:
        raise UsageError("--gguf goes with --vs-llamacpp")
    elif args.llamacpp_fa:
        raise UsageError("--llamacpp-fa goes with --vs-llamacpp")
    needed = {"--vs-hf": ("transformers", args.vs_hf),
              "--modes disk+zstd": ("zstandard", "disk+zstd" in modes)}
    for flag, (package, wanted) in needed.items():
        try:
            if wanted:
                __import__(package)
        except ImportError:
            raise UsageError(f"{flag} needs the {package} package: pip install {package}") from None
    return contexts, modes


def main(argv=None):
    args = build_parser().parse_args(argv)
    tmp = None
    try:
        contexts, modes = check(args)
        set_threads(args)  # cores.py: the cores this run may use
        dtype = DTYPES[args.dtype]
        if args.random_model and not args.ckpt:  # the random model's files, removed at the end
            tmp = tempfile.mkdtemp(prefix="bench-model-")
        model_args, contexts = measured_model_args(args, contexts, tmp)
        if args.child_run:
            print(json.dumps(child_run(args, contexts, model_args.vocab_size, dtype)))
            return 0
        if args.vs_llamacpp:  # both sides in fresh processes: this one loads no model
            args.threads = args.threads or torch.get_num_threads()  # the same count for both
            config = probe.describe(args, model_args, contexts, modes)
            report = llamacpp.compare(args, contexts, modes, run_fresh,
                                      probe.environment(args.device), config)
            return write_report(args, report)
        model = Transformer.from_pretrained(args.ckpt, device=args.device, dtype=dtype,
                                            rope_override=rope_override(args),
                                            quantize=quantize_mode(args))
        hf = None
        if args.vs_hf and not args.fresh_process:
            hf = load_hf(args.ckpt, args.device, dtype)
        machine = probe.environment(args.device)
        cuda = is_cuda(args.device)
        config = probe.describe(args, model_args, contexts, modes)
        if args.batch_sizes:
            rates = run_batches(model, hf, args, contexts[0])
            print(f"{args.ckpt} {config['model']}, {args.dtype}, {contexts[0]}-token prompts, "
                  f"{args.new_tokens} decode steps timed, median of {args.repeats}; "
                  f"{machine['date']}, {machine['torch_threads']} threads, load "
                  f"{machine['loadavg']}\n\n{batch_table(rates, args.batch_sizes)}")
            per_size = {f"{who}_{n}": r for (who, n), r in rates.items()}
            report = {"machine": machine, "config": config, "batch_decode_tokens_per_s": per_size}
        elif args.visit_cost:  # the fixed cost of a chunk visit (on CUDA its kernels): a median
            ctx = max(contexts)
            cost = statistics.median(probe.visit_cost_s(model, ctx) for _ in range(args.repeats))
            kernels = probe.kernels_per_visit(model, ctx) if cuda else None
            report = {"machine": machine, "config": config, "visit_cost_s": cost,
                      "kernels_per_visit": kernels}
            line = (f"fixed cost per chunk visit at {ctx} tokens (chunk 64 against 4096, "
                    f"{model_args.n_layers} layers): {cost * 1e6:.1f} us")
            if cuda:
                line += f", {kernels:.2f} kernels"
            print(line)
        elif args.contention:
            runs = run_contention(args, contexts[0], modes[0])
            print(f"{args.ckpt} {config['model']}, {args.dtype}, {modes[0]} at {contexts[0]} "
                  f"tokens, {args.new_tokens} new tokens, fresh processes, median of "
                  f"{args.repeats}; {machine['date']}, {machine['cpu_count']} CPUs, threads "
                  f"{args.threads or 'default'}\n\n{contention_table(runs)}")
            report = {"machine": machine, "config": config, "contention": runs}
        elif args.kv_store:
            rows = run_reuse(model, args, contexts)
            lines = ["| prompt tokens | mode | cold TTFT s | warm TTFT s | speedup | reused tokens "
                     "| computed tokens | store read MiB |",
                     "|---|---|---|---|---|---|---|---|"]
            for r in rows:
                read_mib = r["store_bytes_read"] / 2**20
                lines.append(f"| {r['context']} | {r['mode']} | {r['cold_ttft_s']:.3f} | "
                             f"{r['warm_ttft_s']:.3f} | {r['speedup']:.1f}x | {r['reused_tokens']} "
                             f"({r['reused_fraction']:.0%}) | {r['computed_tokens']} | "
                             f"{read_mib:.1f} |")
            print("\n".join(lines))
            report = {"machine": machine, "config": config, "reuse": rows}
        else:
            runs, ids_out, cal = run_matrix(model, hf, args, contexts, modes)
            machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
            # a decode step reads the weights it multiplies by and the KV of the context so far
            per_token = kv_bytes_per_token(model_args, dtype, args.kv_dtype, args.chunk_size)
            mid = args.new_tokens // 2
            read_bytes = {c: decode_read_bytes(model, c + mid, per_token) for c in contexts}
            rows, hf_rows = summarize(runs, ids_out, cal, args, model_args, contexts, modes,
                                      read_bytes)
            print(f"{args.ckpt} {config['model']}, {args.dtype} (KV {args.kv_dtype}) on "
                  f"{args.device}, chunk {args.chunk_size}, window {args.window}, "
                  f"{args.new_tokens} new tokens, median of {args.repeats}; {machine['date']}, "
                  f"{machine['cpu_count']} CPUs, {machine['torch_threads']} threads, load "
                  f"{machine['loadavg']} -> {machine['loadavg_end']}\n\n{markdown(rows, hf_rows)}")
            report = {"machine": machine, "config": config, "calibration": cal, "results": rows,
                      "hf": hf_rows}
    except (UsageError, CheckpointError, OffloadError, DiskError, TaskDirError,
            PrivateError) as e:
        print(f"bench.py: error: {e}", file=sys.stderr)
        return 2
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        remove_own_tasks(args)
        remove_created_offload_dir(args)
    return write_report(args, report)


def remove_own_tasks(args):
    """A benchmark has nothing to resume: the task directories of this process's runs
    (task_bench_<pid>_*, run_ours) that an interrupt or a failed run left in --offload-dir go, and
    whatever is in them (a link goes, never its target)."""
    prefix = f"task_bench_{os.getpid()}_"
    try:
        entries = list(os.scandir(args.offload_dir))
    except OSError:  # no --offload-dir: nothing was written
        return
    for e in entries:
        if e.name.startswith(prefix) and e.is_dir(follow_symlinks=False):
            shutil.rmtree(e.path, ignore_errors=True)


def write_report(args, report):
    """--json OUT: the report, 0600 (a link at the name is replaced, never followed). Returns 0."""
    if args.json:
        write_atomic(args.json, json.dumps(report, indent=1).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
