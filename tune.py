"""
The tuner: the chunk size, window, tier, compression and staging slots that decode
fastest at one context within a budget of device memory and one of host memory, measured on this machine.

    python tune.py --ckpt DIR --context 8192 --device-budget 0.008 --cpu-budget 0.026 --threads 1

It follows the order in which KV offload is usually tuned, one knob per step:
    1. chunk size (128 to 1024, up to the context): larger = fewer, larger transfers and chunk visits per step, more
       device memory per chunk. Windows: 1, and the most that fit the device budget, where device KV = (L * (window
       + 1 open chunk) + staging slots) chunks;
    2. tier: none if the whole KV fits the device budget, else cpu if the offloaded part fits --cpu-budget, else
       disk (memory-mapped files, with a host tier of --cpu-budget in front);
    3. compression: the disk tier with and without zstd;
    4. prefetch: 2, 4 and 8 staging slots for the winner, where chunks are staged at all (CUDA, or zstd).
Each candidate is predicted first (probe.py, from this machine's costs measured twice); one predicted under half the
best is pruned, and said so. The rest are measured (bench.run_ours), the close ones again. The recommendation is the
fastest measured decode within both budgets, or one within 5% of it (a tie on a shared machine) that holds less KV
on the device. The last line of stdout is one JSON object: {"recommended", "command", "measured", "why"}.
"""
import argparse
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch

import bench
import probe
from checkpoint import CheckpointError
from cli import (
    DEMO_CKPT,
    DTYPES,
    UsageError,
    add_common_flags,
    check_common,
    one_line_errors,
    quantize_mode,
    read_model_args,
    remove_if_empty,
)
from disk import ALIGN, DiskError, round_up
from kvcache import kv_bytes_per_token
from model import Transformer
from monitor import mem_available
from offload import OffloadConfig
from pools import OffloadError
from quantize import weight_bytes
from random_model import PRESETS, build_random_checkpoint, parse_model_spec
from taskdir import TaskDirError

CHUNKS = (128, 256, 512, 1024)   # step 1's grid, cut at the context
SLOTS = (2, 4, 8)                # step 4's grid
PRUNE = 0.5                      # predicted decode under this fraction of the best prediction: not measured
CLOSE = 0.6                      # measured decode over this fraction of the best: measured again
TIE = 0.05                       # within this of the best measured decode: a tie, broken by the device footprint
MiB = 2**20
ROOT = os.path.dirname(os.path.abspath(__file__))


@dataclass
class Candidate:
    chunk_size: int
    window: int                  # for --offload none: every chunk (the window is not a knob there)
    offload: str                 # none | cpu | disk
    compress: str = "none"
    cpu_budget: float = None     # GiB: the host tier's cap (None for none)
    staging_slots: int = OffloadConfig.staging_slots
    step: int = 1                # the tuning step that made it
    kv: dict = field(default_factory=dict)  # planned KV bytes: device, host, disk
    staged: bool = False         # prefetched through staging slots (CUDA, or zstd)
    chunk_bytes: int = 0
    pred_decode: float = None
    pred_prefill: float = None
    pruned: str = None
    runs: list = field(default_factory=list)

    @property
    def mode(self):              # bench.py's name for the tier and compression
        return self.offload + ("+zstd" if self.compress == "zstd" else "")

    def measured(self, key):
        return statistics.median(r[key] for r in self.runs) if self.runs else None


# -----------------------------------------------------------------------------
# the plan: what a configuration puts in each tier, from the model's shape alone

def chunk_bytes(margs, args, C):
    """Bytes of one chunk of one layer: K and V of C positions (with --kv-dtype int8, its scales too)."""
    return kv_bytes_per_token(margs, DTYPES[args.dtype], args.kv_dtype) // margs.n_layers * C


def slot(margs, args, C):
    """A chunk as the tiers allocate it, aligned."""
    return round_up(chunk_bytes(margs, args, C), ALIGN)


def plan(c, margs, args, cuda):
    """Fill c.kv and c.staged as offload.TieredStore will allocate them for args.context + args.new_tokens positions
    of args.dtype and args.kv_dtype."""
    L, n = margs.n_layers, -(-(args.context + args.new_tokens) // c.chunk_size)
    slot_b, c.chunk_bytes = slot(margs, args, c.chunk_size), chunk_bytes(margs, args, c.chunk_size)
    c.staged = c.offload != "none" and (cuda or c.compress == "zstd")
    if c.offload == "none":
        c.kv = {"device": L * n * slot_b, "host": 0, "disk": 0}
        return c
    off = L * max(0, n - 1 - c.window) * slot_b   # the last chunk is never sealed, so never offloaded
    host = off if c.offload == "cpu" else min(off, int((c.cpu_budget or 0) * 2**30) // slot_b * slot_b)
    bounces = (c.staging_slots + L) * slot_b if cuda and c.offload == "disk" else 0  # pinned disk <-> device
    c.kv = {"device": (L * (c.window + 1) + (c.staging_slots if c.staged else 0)) * slot_b, "host": host + bounces,
            "disk": off - host}
    return c


def candidates(margs, args, cuda):
    """Steps 1-3: every chunk size, window, tier and compression the budgets allow; pruned ones carry why."""
    ctx, new = args.context, args.new_tokens
    dev, host = args.device_budget * 2**30, args.cpu_budget * 2**30
    out = []
    for C in args.chunk_sizes:
        none = plan(Candidate(C, -(-(ctx + new) // C), "none"), margs, args, cuda)
        if none.kv["device"] <= dev:  # the whole KV fits: nothing to offload
            out.append(none)
            continue
        for compress in ("none", "zstd"):
            S, L = OffloadConfig.staging_slots if cuda or compress == "zstd" else 0, margs.n_layers
            w_max = min((int(dev // slot(margs, args, C)) - S) // L - 1, none.window - 2)  # >= 1 chunk must leave
            if w_max < 0:
                least = (L + S) * slot(margs, args, C) / MiB  # window 0: the open chunks (and staging slots)
                out.append(Candidate(C, 0, "disk", compress, step=2 + (compress == "zstd"), pruned=f"window 0 "
                                     f"takes {least:.1f} MiB of device KV, over the budget"))
                continue
            for w in sorted({min(1, w_max), w_max}):
                c = plan(Candidate(C, w, "cpu", cpu_budget=args.cpu_budget), margs, args, cuda)
                if compress == "none" and c.kv["host"] <= host:
                    out.append(c)
                elif c.kv["host"] > host:  # the tier step: cpu does not fit, disk with a host tier in front
                    out.append(plan(Candidate(C, w, "disk", compress, cpu_budget=args.cpu_budget, step=2 + (
                        compress == "zstd")), margs, args, cuda))
    return out


def as_args(args, c):
    """The namespace bench.run_ours, probe.calibrate and probe.predict_decode read, for one candidate."""
    return argparse.Namespace(**{**vars(args), "chunk_size": c.chunk_size, "window": c.window, "probe_mib": 8,
                                 "cpu_budget": c.cpu_budget, "staging_slots": c.staging_slots})


# -----------------------------------------------------------------------------
# the search

def search(model, margs, args, log):
    cuda, ctx, weights = probe.is_cuda(args.device), args.context, weight_bytes(model)
    cands = candidates(margs, args, cuda)
    zstd, free = any(c.compress == "zstd" for c in cands), shutil.disk_usage(args.offload_dir).free
    sizes = sorted({c.chunk_size for c in cands if not c.pruned})
    cals, pfits = {C: [] for C in sizes}, {C: [] for C in sizes}
    t = time.perf_counter()
    for rnd in range(2):  # twice, the second in reverse order, medians: so that drift hits every chunk size alike
        for C in sizes[::1 if rnd == 0 else -1]:
            first = next(c for c in cands if c.chunk_size == C and not c.pruned)
            cals[C].append(probe.calibrate(model, as_args(args, first), [ctx], ["disk+zstd"] if zstd else []))
            pfits[C].append(probe.prefill_fit(model, ctx, C, args.kv_dtype))
    log(f"calibrated chunk sizes {sizes} in {time.perf_counter() - t:.1f}s")
    for c in (c for c in cands if not c.pruned):
        cal, fit = probe.median_of(cals[c.chunk_size]), [statistics.median(x) for x in zip(*pfits[c.chunk_size])]
        c.pred_decode = probe.predict_decode(cal, ctx, c.mode, as_args(args, c), margs, cuda)
        c.pred_prefill = probe.predict_prefill(fit, cal, ctx, c.mode, as_args(args, c), margs)
        if c.kv["disk"] > free:
            c.pruned = f"the disk tier needs {c.kv['disk'] / MiB:,.0f} MiB, {args.offload_dir} has {free / MiB:,.0f}"
    live = [c for c in cands if not c.pruned and c.pred_decode]
    best_pred = max(c.pred_decode for c in live)
    for c in live:
        if c.pred_decode < PRUNE * best_pred:
            c.pruned = f"predicted {c.pred_decode:,.1f} tok/s, under {PRUNE:.0%} of the best ({best_pred:,.1f})"
    ids = torch.randint(3, margs.vocab_size, (ctx,), generator=torch.Generator().manual_seed(0)).tolist()
    warm = min(cands, key=lambda c: c.chunk_size)  # first calls pay for thread pools and allocators: not recorded
    bench.run_ours(model, ids[:warm.chunk_size * 2], as_args(args, warm), "none", "tune_warmup", 3)

    def measure(cs, why):
        for c in cs:
            _, st = bench.run_ours(model, ids, as_args(args, c), c.mode, f"tune_{len(c.runs)}_{id(c)}")
            st["device_kv_bytes"] = st["peak_device_bytes"] - weights
            c.runs.append(st)
            log(f"{why}: chunk {c.chunk_size} window {c.window} {c.mode} slots {c.staging_slots}: decode "
                f"{st['decode_tokens_per_s']:,.1f} tok/s, load {os.getloadavg()[0]:.2f}")
    measure(sorted((c for c in live if not c.pruned), key=lambda c: -c.pred_decode), "measure")
    for rep in range(args.repeats - 1):  # the close ones again, in reverse order, so that drift hits them alike
        best = max(c.measured("decode_tokens_per_s") for c in cands if c.runs)
        close = [c for c in cands if c.runs and c.measured("decode_tokens_per_s") >= CLOSE * best]
        measure(close[::-1] if rep % 2 == 0 else close, "again")

    # step 4, prefetch: staging slots for the winner so far, where chunks are staged at all
    win = choose(cands, args)[0]
    if win.staged:
        more = []
        for s in [s for s in SLOTS if s != win.staging_slots]:
            c = plan(Candidate(win.chunk_size, win.window, win.offload, win.compress, win.cpu_budget, s, step=4),
                     margs, args, cuda)
            c.pred_decode, c.pred_prefill = win.pred_decode, win.pred_prefill  # slots are not in the model
            if c.kv["device"] > args.device_budget * 2**30:
                c.pruned = f"{s} staging slots take the device KV to {c.kv['device'] / MiB:.1f} MiB, over budget"
            more.append(c)
        cands += more
        for _ in range(args.repeats):
            measure([c for c in more if not c.pruned], "prefetch")
    return cands


def choose(cands, args):
    """(recommended, fastest, why): the fastest measured decode within the budgets, or a tie with a smaller
    device footprint (then a nearer tier, then no compression, then the faster prefill)."""
    ok = [c for c in cands if c.runs and max(c.kv["device"], c.measured("device_kv_bytes")) <= args.device_budget
          * 2**30 and c.kv["host"] <= args.cpu_budget * 2**30]  # planned and measured within the budgets
    if not ok:
        raise UsageError("no configuration fits --device-budget and --cpu-budget; raise one of them")
    dec = lambda c: c.measured("decode_tokens_per_s")  # noqa: E731
    fastest = max(ok, key=dec)
    ties = [c for c in ok if dec(c) >= (1 - TIE) * dec(fastest)]
    rec = min(ties, key=lambda c: (c.kv["device"], ("none", "cpu", "disk").index(c.offload), c.compress != "none",
                                   -c.measured("prefill_tokens_per_s")))
    others = ", ".join(f"chunk {c.chunk_size} window {c.window} {c.mode} {dec(c):,.1f}" for c in ties if c is not rec)
    if rec is fastest:
        why = f"the fastest measured decode ({dec(rec):,.1f} tok/s) of {len(ok)} configurations within the budgets" + (
            f"; within {TIE:.0%} of it: {others} tok/s, none with a smaller device footprint" if others else "")
    else:
        reason = (f"{(fastest.kv['device'] - rec.kv['device']) / MiB:.2f} MiB less KV on the device"
                  if rec.kv["device"] < fastest.kv["device"] else "a nearer tier" if rec.offload != fastest.offload
                  else "no compression" if rec.compress != fastest.compress else
                  f"the same device footprint and a faster prefill ({rec.measured('prefill_tokens_per_s'):,.0f} "
                  f"against {fastest.measured('prefill_tokens_per_s'):,.0f} tok/s)")
        why = (f"decode {dec(rec):,.1f} tok/s is within {TIE:.0%} of the fastest measured ({dec(fastest):,.1f} tok/s "
               f"at chunk {fastest.chunk_size}, window {fastest.window}, {fastest.mode}), a tie on a shared machine; "
               f"chosen for {reason}")
    return rec, fastest, why


# -----------------------------------------------------------------------------
# report

def command(c, args):
    """The generate.py command line of a configuration, runnable as printed from this directory."""
    cmd = ["python", os.path.relpath(os.path.join(ROOT, "generate.py")), "--ckpt", args.ckpt,
           "--chunk-size", c.chunk_size, "--offload", c.offload]
    cmd += ["--window", c.window, "--cpu-budget", c.cpu_budget] if c.offload != "none" else []
    cmd += ["--compress", c.compress] if c.compress != "none" else []
    cmd += ["--staging-slots", c.staging_slots] if c.staged else []
    cmd += ["--offload-dir", args.offload_dir] if c.offload == "disk" else []
    cmd += ["--device", args.device, "--dtype", args.dtype] + (["--threads", args.threads] if args.threads else [])
    cmd += ["--kv-dtype", args.kv_dtype] if args.kv_dtype != "auto" else []
    return " ".join(shlex.quote(str(x)) for x in cmd + ["--max-new-tokens", args.new_tokens])


def table(cands):
    mib = lambda n: "-" if n is None else f"{n / MiB:,.1f}"  # noqa: E731
    num = lambda x: "-" if x is None else f"{x:,.1f}"  # noqa: E731
    lines = ["| step | chunk | window | tier | slots | decode tok/s predicted / measured | prefill tok/s predicted / "
             "measured | device KV MiB planned / peak | host RSS / anon MiB | KV MiB device / host / disk | note |",
             "|---" * 11 + "|"]
    for c in sorted(cands, key=lambda c: (c.step, c.chunk_size, c.window, c.mode, c.staging_slots)):
        kv, m = c.kv or {}, c.runs[-1] if c.runs else None
        # where the KV was at the end of the run: chunks per tier x chunk bytes; the disk as written (zstd: smaller)
        tiers = "-" if not m else " / ".join(mib(x) for x in (
            m["chunks"]["device"] * c.chunk_bytes, m["chunks"]["host"] * c.chunk_bytes, m["bytes"]["disk_write"]))
        lines.append(
            f"| {c.step} | {c.chunk_size} | {c.window if c.offload != 'none' else 'all'} | {c.mode} | "
            f"{c.staging_slots if c.staged else '-'} | {num(c.pred_decode)} / {num(c.measured('decode_tokens_per_s'))}"
            f" | {num(c.pred_prefill)} / {num(c.measured('prefill_tokens_per_s'))} | {mib(kv.get('device'))} / "
            f"{mib(c.measured('device_kv_bytes'))} | {mib(c.measured('peak_host_rss_bytes'))} / "
            f"{mib(c.measured('peak_host_anon_bytes'))} | {tiers} | {'pruned: ' + c.pruned if c.pruned else ''} |")
    return "\n".join(lines)


def steps(cands, rec, margs, args):
    """One line per tuning step, in the order above: what was decided and what the measurements said."""
    dec, gib = (lambda c: c.measured("decode_tokens_per_s")), (lambda x: f"{x * 2**30 / MiB:,.1f} MiB")  # noqa: E731
    by_c = {C: [dec(c) for c in cands if c.chunk_size == C and c.runs] for C in sorted({c.chunk_size for c in cands})}
    whole = plan(Candidate(rec.chunk_size, 0, "none"), margs, args, probe.is_cuda(args.device)).kv["device"] / 2**30
    z = [c for c in cands if c.compress == "zstd"]
    slots = sorted((c.staging_slots, dec(c)) for c in cands if c.runs and c.staged and (c.chunk_size, c.window,
                   c.mode) == (rec.chunk_size, rec.window, rec.mode))
    return [f"1. chunk size {rec.chunk_size} ({rec.chunk_bytes / MiB:.2f} MiB per layer chunk); best measured decode "
            "by chunk size: " + ", ".join(f"{C} {max(v):,.1f} tok/s" if v else f"{C} pruned" for C, v in by_c.items()),
            f"2. tier {rec.offload}: the whole KV ({gib(whole)}) " + (
                f"fits --device-budget {gib(args.device_budget)}" if rec.offload == "none" else
                f"is over --device-budget {gib(args.device_budget)}; window {rec.window} keeps "
                f"{rec.kv['device'] / MiB:,.1f} MiB on the device, the rest "
                f"({(rec.kv['host'] + rec.kv['disk']) / MiB:,.1f} MiB) {'fits' if rec.offload == 'cpu' else 'is over'}"
                f" --cpu-budget {gib(args.cpu_budget)}"),
            f"3. compression {rec.compress}: " + ("not tried: zstd is for the disk tier, which no configuration needed"
            if not z else f"zstd measured at best {max(dec(c) for c in z if c.runs):,.1f} tok/s" if any(
                c.runs for c in z) else f"zstd pruned ({z[0].pruned})"),
            f"4. prefetch: {rec.staging_slots} staging slots; measured " + ", ".join(
                f"{s}: {d:,.1f} tok/s" for s, d in slots) if rec.staged else "4. prefetch: nothing is staged on this "
            "path (on CPU without zstd attention reads offloaded chunks in place): staging slots do not matter"]


# -----------------------------------------------------------------------------
# command line

def build_parser():
    p = argparse.ArgumentParser(prog="tune.py", description=__doc__,
                                epilog="alias: python bench.py --tune ... runs python tune.py ...",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_flags(p, chunk_size=None, window=None, ckpt_help="Hugging Face checkpoint directory (default: the "
                     "demo model in assets/); with --random-model, a new directory to write it to (default: a "
                     "temporary one, kept, since the printed command uses it)")
    for action in p._actions:
        if action.dest in ("chunk_size", "window", "staging_slots"):
            action.help = argparse.SUPPRESS  # what the tuner picks
        elif action.dest == "cpu_budget":
            action.help = "GiB of host memory the offloaded KV may take (default: half of MemAvailable)"
    p.add_argument("--device-budget", type=float, help="GiB of KV the device may hold (default: CUDA, 90%% of its "
                   "free memory after the weights; CPU, half of MemAvailable)")
    p.add_argument("--context", type=int, default=8192, help="prompt tokens to tune for (default %(default)s)")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens decoded per run (default %(default)s)")
    p.add_argument("--chunk-sizes", default=",".join(map(str, CHUNKS)), help="step 1's grid, cut at --context "
                   "(default %(default)s)")
    p.add_argument("--repeats", type=int, default=2, help="runs of the configurations within 60%% of the best "
                   "(default %(default)s)")
    p.add_argument("--random-model", metavar="SPEC", help=f"tune a random model: a preset {sorted(PRESETS)} "
                   "and/or dim=,layers=,heads=,kv_heads=,head_dim=,hidden=,vocab=")
    return one_line_errors(p)


def check(args):
    if args.chunk_size is not None or args.window is not None or args.staging_slots != OffloadConfig.staging_slots:
        raise UsageError("--chunk-size, --window and --staging-slots are what tune.py picks; give --chunk-sizes")
    try:
        sizes = sorted({int(x) for x in args.chunk_sizes.split(",") if x.strip()})
    except ValueError:
        raise UsageError(f"--chunk-sizes must be comma-separated integers, got {args.chunk_sizes!r}") from None
    checks = [(args.context >= 1, f"--context must be >= 1, got {args.context}"),
              (args.new_tokens >= 2 and args.repeats >= 1, "--new-tokens must be >= 2 and --repeats >= 1"),
              (sizes and sizes[0] >= 1, f"--chunk-sizes must be positive, got {args.chunk_sizes!r}"),
              (args.device_budget is None or args.device_budget > 0, "--device-budget must be > 0 GiB")]
    for ok, msg in checks:
        if not ok:
            raise UsageError(msg)
    args.chunk_sizes = [c for c in sizes if c <= args.context] or [sizes[0]]
    args.staging_slots = OffloadConfig.staging_slots
    check_common(args, needs_disk=True)
    if args.random_model:
        args.sizes = parse_model_spec(args.random_model)
        if args.ckpt and os.path.exists(args.ckpt) and os.listdir(args.ckpt):
            raise UsageError(f"--ckpt {args.ckpt} is not empty: with --random-model it names where to write the "
                             "new model; give a new directory")
    elif not os.path.isdir(args.ckpt or DEMO_CKPT):
        raise UsageError(f"--ckpt {args.ckpt}: no such directory")


def main(argv=None):
    args = build_parser().parse_args(argv)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    try:
        check(args)
        if args.threads:
            torch.set_num_threads(args.threads)
        dt = DTYPES[args.dtype]
        if args.random_model:
            args.ckpt = build_random_checkpoint(args.sizes, args.ckpt or tempfile.mkdtemp(prefix="tune-model-"), dt,
                                                args.device)
            log(f"random model written to {args.ckpt} (kept: the command below uses it)")
        args.ckpt = args.ckpt or DEMO_CKPT
        margs = read_model_args(args.ckpt)
        if args.context + args.new_tokens > margs.max_context:
            raise UsageError(f"--context {args.context} plus --new-tokens {args.new_tokens} is past the model's "
                             f"maximum context of {margs.max_context} positions")
        model = Transformer.from_pretrained(args.ckpt, device=args.device, dtype=dt, quantize=quantize_mode(args))
        free = 0.9 * torch.cuda.mem_get_info(args.device)[0] if probe.is_cuda(args.device) else mem_available() / 2
        args.device_budget = args.device_budget or free / 2**30  # defaults: see the flags' help
        args.cpu_budget = mem_available() / 2 / 2**30 if args.cpu_budget is None else args.cpu_budget
        t = time.perf_counter()
        cands = search(model, margs, args, log)
        rec, fastest, why = choose(cands, args)
    except (ValueError, CheckpointError, OffloadError, DiskError, TaskDirError) as e:  # ValueError: UsageError too
        print(f"tune.py: error: {e}", file=sys.stderr)
        return 2
    finally:
        if getattr(args, "created_offload_dir", False):
            remove_if_empty(args.offload_dir)  # as generate.py does: the printed command creates it again
    kv_total = (args.context + args.new_tokens) * kv_bytes_per_token(margs, dt, args.kv_dtype)
    print(f"{args.ckpt}: {margs.n_layers} layers x {margs.n_kv_heads} kv heads x {margs.head_dim}, {args.dtype} on "
          f"{args.device}, context {args.context} + {args.new_tokens} new: {kv_total / MiB:,.1f} MiB of KV; budgets: "
          f"device {args.device_budget * 2**30 / MiB:,.1f} MiB, host {args.cpu_budget * 2**30 / MiB:,.1f} MiB; "
          f"{sum(bool(c.runs) for c in cands)} configurations measured, {sum(bool(c.pruned) for c in cands)} pruned, "
          f"in {time.perf_counter() - t:.0f}s; {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}\n")
    print(table(cands) + "\n")
    print("\n".join(steps(cands, rec, margs, args)))
    print(f"recommended: {why}\n{command(rec, args)}")
    rec_cfg = {"chunk_size": rec.chunk_size, "window": rec.window if rec.offload != "none" else None, "offload":
               rec.offload, "compress": rec.compress, "cpu_budget": rec.cpu_budget, "staging_slots": rec.staging_slots
               if rec.staged else None}
    measured = {k: rec.measured(k) for k in ("decode_tokens_per_s", "prefill_tokens_per_s", "device_kv_bytes",
                                             "peak_host_rss_bytes", "peak_host_anon_bytes")} | {
        "predicted_decode_tokens_per_s": rec.pred_decode, "kv_bytes_planned": rec.kv, "runs": len(rec.runs),
        "fastest_decode_tokens_per_s": fastest.measured("decode_tokens_per_s"), "context": args.context}
    print(json.dumps({"recommended": rec_cfg, "command": command(rec, args), "measured": measured, "why": why}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
