"""
The tuner: the chunk size, window, tier, compression and staging slots that decode fastest at one
context within a budget of device memory and one of host memory, measured on this machine.

    python tune.py --ckpt DIR --context 8192 --device-budget 0.008 --cpu-budget 0.026 --threads 1

It follows the order in which KV offload is usually tuned, one knob per step:
    1. chunk size (128 to 1024, up to the context): larger = fewer, larger transfers and chunk
       visits per step, more device memory per chunk. Windows: 1, and the most that fit the device
       budget, where device KV = (L * (window + 1 open chunk) + staging slots) chunks, and on
       CUDA with a host tier two group buffers of up to 16 chunks (prefetch.py) where the budget
       has room for them (else --group-buffers 0);
    2. tier: none if the whole KV fits the device budget, else cpu if the offloaded part fits
       --cpu-budget, else disk (memory-mapped files, with a host tier of --cpu-budget in front);
    3. compression: the disk tier with and without zstd;
    4. prefetch: 2, 4 and 8 staging slots for the winner, where chunks are staged at all (CUDA, or
       zstd).
If no configuration fits the budgets with the KV as --kv-dtype holds it, the steps run again with
int8 KV, then int4 (lossy, half and a quarter of bf16's bytes), and the recommendation says so.
Each candidate is predicted first (probe.py, from this machine's costs measured twice); one
predicted under half the best is pruned, and said so. The rest are measured (bench.run_ours), the
close ones again. The recommendation is the fastest measured decode within both budgets, or one
within 5% of it (a tie on a shared machine) that holds less KV on the device. The last line of
stdout is one JSON object: {"recommended", "command", "measured", "why"}.
"""
import argparse
import json
import math
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch

from checkpoint import CheckpointError
from disk import ALIGN, DiskError, round_up
from measure import bench, probe
from measure.flags import fitted_contexts
from measure.random_model import PRESETS, build_random_checkpoint, parse_model_spec
from model import Transformer
from offload import OffloadConfig
from policy import TierPlan, plan_tiers
from pools import OffloadError, group_run
from quantize import weight_bytes
from runs.flags import (
    DEMO_CKPT,
    DTYPES,
    UsageError,
    add_common_flags,
    check_ckpt_dir,
    check_common,
    one_line_errors,
    quantize_mode,
    read_model_args,
    remove_created_offload_dir,
    rope_override,
    set_threads,
)
from runs.monitor import mem_available
from runs.taskdir import TaskDirError

CHUNKS = (128, 256, 512, 1024)   # step 1's grid, cut at the context
DEFAULT_CONTEXT = 8192
SLOTS = (2, 4, 8)                # step 4's grid
TIERS = ("none", "cpu", "disk")  # nearest first
PRUNE = 0.5   # predicted decode under this fraction of the best prediction: not measured
CLOSE = 0.6   # measured decode over this fraction of the best: measured again
TIE = 0.05    # within this of the best measured decode: a tie, broken by the device footprint
MiB = 2**20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
ALIAS = "alias: python bench.py --tune ... runs python tune.py ..."
PROMPT_PLACEHOLDER = "PROMPT.txt"  # in the printed command without --prompt-file: yours to replace


@dataclass
class Candidate:
    chunk_size: int
    window: int                  # for --offload none: every chunk (the window is not a knob there)
    offload: str                 # none | cpu | disk
    compress: str = "none"
    cpu_budget: float = None     # GiB: the host tier's cap (None for none)
    staging_slots: int = OffloadConfig.staging_slots
    group_buffers: int = OffloadConfig.group_buffers
    step: int = 1                # the tuning step that made it
    kv: dict = field(default_factory=dict)  # planned KV bytes: device, host, disk
    tiers: TierPlan = None       # planned chunks per tier (policy.plan_tiers)
    staged: bool = False         # prefetched through staging slots (CUDA, or zstd)
    chunk_bytes: int = 0
    slot_bytes: int = 0          # a chunk as the tiers allocate it, aligned
    pred_decode: float = None
    pred_prefill: float = None
    pruned: str = None
    runs: list = field(default_factory=list)

    @property
    def mode(self):              # bench.py's name for the tier and compression
        return self.offload + ("+zstd" if self.compress == "zstd" else "")

    def measured(self, key):
        return statistics.median(r[key] for r in self.runs) if self.runs else None


def decode_speed(c):
    """A candidate's measured decode tokens/s: the median of its runs."""
    return c.measured("decode_tokens_per_s")


# -----------------------------------------------------------------------------
# the plan: what a configuration puts in each tier, from the model's shape alone

def slot(model_args, args, C):
    """A chunk as the tiers allocate it, aligned."""
    return round_up(probe.chunk_bytes(model_args, args, C), ALIGN)


def plan(c, model_args, args, cuda):
    """Fill c.kv and c.staged as offload.TieredStore will allocate them for args.context +
    args.new_tokens positions of args.dtype and args.kv_dtype: the chunks per tier from
    policy.plan_tiers (as the store sizes its host pool), times the aligned chunk."""
    L = model_args.n_layers
    slot_b = c.slot_bytes = slot(model_args, args, c.chunk_size)
    c.chunk_bytes = probe.chunk_bytes(model_args, args, c.chunk_size)
    c.staged = c.offload != "none" and (cuda or c.compress == "zstd")
    host_slots = None  # --offload cpu: the host tier holds every offloaded chunk
    if c.offload == "disk":  # a host tier of --cpu-budget in front of the disk
        host_slots = int((c.cpu_budget or 0) * 2**30) // slot_b
    tiers = c.tiers = plan_tiers(args.context + args.new_tokens, c.chunk_size, c.window, L,
                                 c.offload, host_slots)
    if c.offload == "none":
        c.kv = {"device": L * tiers.per_layer * slot_b, "host": 0, "disk": 0}
        return c
    # the pinned bounce buffers between the disk and the device
    bounces = (c.staging_slots + L) * slot_b if cuda and c.offload == "disk" else 0
    staging = c.staging_slots if c.staged else 0
    # CUDA with a host tier: two group buffers, each as long as a layer's run of offloaded chunks
    # can be (offload.TieredStore, prefetch.py)
    run = group_run(tiers.per_layer)
    groups = c.group_buffers * run if cuda and tiers.host > 1 and run > 1 else 0
    # the device: the windows' sealed chunks, each layer's open chunk, the staging slots
    c.kv = {"device": (tiers.device + L + staging + groups) * slot_b,
            "host": tiers.host * slot_b + bounces, "disk": tiers.disk * slot_b}
    return c


def whole_kv(model_args, args, C, cuda):
    """The KV of the whole context in chunks of C, as the device tier would hold it without
    offload: the one figure the report gives for it."""
    return plan(Candidate(C, 0, "none"), model_args, args, cuda).kv["device"]


def candidates(model_args, args, cuda):
    """Steps 1-3: every chunk size, window, tier and compression the budgets allow; pruned ones
    carry why."""
    L = model_args.n_layers
    dev = args.device_budget * 2**30
    host = args.cpu_budget * 2**30
    out = []
    for C in args.chunk_sizes:
        whole = -(-(args.context + args.new_tokens) // C)
        none = plan(Candidate(C, whole, "none"), model_args, args, cuda)
        if none.kv["device"] <= dev:  # the whole KV fits: nothing to offload
            out.append(none)
            continue
        for compress in ("none", "zstd"):
            step = 3 if compress == "zstd" else 2
            S = OffloadConfig.staging_slots if cuda or compress == "zstd" else 0
            # at least one chunk must leave the device
            w_max = min((int(dev // slot(model_args, args, C)) - S) // L - 1, none.window - 2)
            if w_max < 0:
                # window 0: the open chunks (and the staging slots)
                least = (L + S) * slot(model_args, args, C) / MiB
                why = f"window 0 takes {least:.1f} MiB of device KV, over the budget"
                out.append(Candidate(C, 0, "disk", compress, step=step, pruned=why))
                continue
            for w in sorted({min(1, w_max), w_max}):
                cpu = Candidate(C, w, "cpu", cpu_budget=args.cpu_budget)
                c = plan(cpu, model_args, args, cuda)
                # on CUDA the group buffers (prefetch.py) take device memory too: none where
                # the budget has no room for them
                groups = c.group_buffers if c.kv["device"] <= dev else 0
                cpu.group_buffers = groups
                c = plan(cpu, model_args, args, cuda)
                if compress == "none" and c.kv["host"] <= host:
                    out.append(c)
                elif c.kv["host"] > host:
                    # the tier step: cpu does not fit, disk with a host tier in front
                    disk = Candidate(C, w, "disk", compress, cpu_budget=args.cpu_budget, step=step,
                                     group_buffers=groups)
                    out.append(plan(disk, model_args, args, cuda))
    return out


# when no configuration fits the budgets with the KV as computed: the lossy formats to try, in order
KV_LADDER = {"auto": ("auto", "int8", "int4"), "int8": ("int8", "int4"), "int4": ("int4",)}


def fitting_candidates(model_args, args, cuda, free_disk):
    """Steps 1-3 at --kv-dtype, with disk tiers past free_disk bytes pruned. If none fits the
    budgets, the same with a smaller KV: int8, then int4 (lossy; about half, then a quarter of
    bf16's bytes), and args.kv_dtype and args.kv_dtype_why say which and why."""
    asked = args.kv_dtype
    for kv_dtype in KV_LADDER[asked]:
        args.kv_dtype = kv_dtype
        cands = candidates(model_args, args, cuda)
        for c in cands:
            if not c.pruned and c.kv["disk"] > free_disk:
                c.pruned = (f"the disk tier needs {c.kv['disk'] / MiB:,.0f} MiB, "
                            f"{args.offload_dir} has {free_disk / MiB:,.0f}")
        if any(not c.pruned for c in cands):
            break
    if args.kv_dtype != asked:
        args.kv_dtype_why = (f"no configuration with --kv-dtype {asked} fits the budgets; with "
                             f"--kv-dtype {args.kv_dtype} (lossy: tools/quality.py) one does")
    return cands


def as_args(args, c):
    """The namespace bench.run_ours, probe.calibrate and probe.predict_decode read, for one
    candidate."""
    knobs = {"chunk_size": c.chunk_size, "window": c.window, "probe_mib": 8,
             "cpu_budget": c.cpu_budget, "staging_slots": c.staging_slots,
             "group_buffers": c.group_buffers}
    return argparse.Namespace(**{**vars(args), **knobs})


# -----------------------------------------------------------------------------
# the search

def search(model, model_args, args, log):
    cuda = probe.is_cuda(args.device)
    ctx = args.context
    weights = weight_bytes(model)
    free = shutil.disk_usage(args.offload_dir).free
    cands = fitting_candidates(model_args, args, cuda, free)
    if all(c.pruned for c in cands):  # not even int4 KV fits: nothing to measure
        why = next((c.pruned for c in cands), "no chunk size can be planned")
        raise UsageError(f"no configuration fits the budgets at --context {ctx}, int4 KV "
                         f"included ({why}); raise --device-budget or --cpu-budget, or lower "
                         "--context")
    modes = ["disk+zstd"] if any(c.compress == "zstd" for c in cands) else []
    sizes = sorted({c.chunk_size for c in cands if not c.pruned})
    cals = {C: [] for C in sizes}
    pfits = {C: [] for C in sizes}
    t = time.perf_counter()
    live = [c for c in cands if not c.pruned]
    log(f"tuning: calibrate {len(sizes)} chunk sizes twice, then measure up to {len(live)} "
        f"configurations (a prefill of {ctx} tokens and {args.new_tokens} decoded each, the close "
        f"ones {args.repeats} times); how long that takes is said as the calibration goes")
    # twice, the second in reverse order, medians: so that drift hits every chunk size alike
    order = sizes + sizes[::-1]
    for i, C in enumerate(order, 1):
        first = next(c for c in cands if c.chunk_size == C and not c.pruned)
        cals[C].append(probe.calibrate(model, as_args(args, first), [ctx], modes))
        pfits[C].append(probe.prefill_fit(model, ctx, C, args.kv_dtype))
        spent = time.perf_counter() - t
        log(f"calibrating [{i}/{len(order)}] chunk {C}: {spent:.0f}s so far, about "
            f"{spent / i * (len(order) - i):.0f}s to go")
    log(f"calibrated chunk sizes {sizes} in {time.perf_counter() - t:.1f}s")
    for c in cands:
        if c.pruned:
            continue
        cal = probe.median_of(cals[c.chunk_size])
        fit = [statistics.median(x) for x in zip(*pfits[c.chunk_size])]
        c_args = as_args(args, c)
        c.pred_decode = probe.predict_decode(cal, ctx, c.mode, c_args, model_args, cuda)
        c.pred_prefill = probe.predict_prefill(fit, cal, ctx, c.mode, c_args, model_args)
    live = [c for c in cands if not c.pruned and c.pred_decode]
    best_pred = max(c.pred_decode for c in live)
    for c in live:
        if c.pred_decode < PRUNE * best_pred:
            c.pruned = (f"predicted {c.pred_decode:,.1f} tok/s, under {PRUNE:.0%} of the best "
                        f"({best_pred:,.1f})")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model_args.vocab_size, (ctx,), generator=g).tolist()
    # the first calls pay for thread pools and allocators: not recorded
    warm = min(cands, key=lambda c: c.chunk_size)
    bench.run_ours(model, ids[:warm.chunk_size * 2], as_args(args, warm), "none", "tune_warmup", 3)

    def measure(cs, why):
        for i, c in enumerate(cs, 1):
            tag = f"tune_{len(c.runs)}_{id(c)}"
            _, st = bench.run_ours(model, ids, as_args(args, c), c.mode, tag)
            st["device_kv_bytes"] = st["peak_device_bytes"] - weights
            c.runs.append(st)
            log(f"{why} [{i}/{len(cs)}]: chunk {c.chunk_size} window {c.window} {c.mode} slots "
                f"{c.staging_slots}: decode {st['decode_tokens_per_s']:,.1f} tok/s, load "
                f"{os.getloadavg()[0]:.2f}")

    first_pass = sorted((c for c in live if not c.pruned), key=lambda c: -c.pred_decode)
    # one run: the prompt at the predicted prefill rate, the new tokens at the decode rate
    expect = sum(ctx / c.pred_prefill + args.new_tokens / c.pred_decode for c in first_pass
                 if c.pred_prefill)
    log(f"measuring {len(first_pass)} configurations: about {expect:.0f}s by the calibration's "
        f"predictions, the close ones again after ({args.repeats} runs each in all)")
    measure(first_pass, "measure")
    # the close ones again, in reverse order, so that drift hits them alike
    for rep in range(args.repeats - 1):
        best = max(decode_speed(c) for c in cands if c.runs)
        close = [c for c in cands if c.runs and decode_speed(c) >= CLOSE * best]
        measure(close[::-1] if rep % 2 == 0 else close, "again")

    # step 4, prefetch: staging slots for the winner so far, where chunks are staged at all
    win = choose(cands, args)[0]
    if win.staged:
        more = []
        for s in SLOTS:
            if s == win.staging_slots:
                continue
            c = Candidate(win.chunk_size, win.window, win.offload, win.compress, win.cpu_budget, s,
                          step=4)
            plan(c, model_args, args, cuda)
            c.pred_decode = win.pred_decode  # the slots are not in the prediction
            c.pred_prefill = win.pred_prefill
            if c.kv["device"] > args.device_budget * 2**30:
                c.pruned = (f"{s} staging slots take the device KV to {c.kv['device'] / MiB:.1f} "
                            "MiB, over budget")
            more.append(c)
        cands += more
        for _ in range(args.repeats):
            measure([c for c in more if not c.pruned], "prefetch")
    return cands


def preference(c):
    """How a tie is broken: a smaller device footprint, then a nearer tier, then no compression,
    then the faster prefill."""
    return (c.kv["device"], TIERS.index(c.offload), c.compress != "none",
            -c.measured("prefill_tokens_per_s"))


def choose(cands, args):
    """(recommended, fastest, why): the fastest measured decode within the budgets, or a tie with a
    smaller device footprint (then a nearer tier, then no compression, then the faster prefill)."""
    dev = args.device_budget * 2**30
    host = args.cpu_budget * 2**30
    # planned and measured within the budgets
    ok = [c for c in cands
          if c.runs and max(c.kv["device"], c.measured("device_kv_bytes")) <= dev
          and c.kv["host"] <= host]
    if not ok:
        raise UsageError("no configuration fits --device-budget and --cpu-budget; "
                         "raise one of them")
    fastest = max(ok, key=decode_speed)
    ties = [c for c in ok if decode_speed(c) >= (1 - TIE) * decode_speed(fastest)]
    rec = min(ties, key=preference)
    others = ", ".join(f"chunk {c.chunk_size} window {c.window} {c.mode} {decode_speed(c):,.1f}"
                       for c in ties if c is not rec)
    if rec is fastest:
        why = (f"the fastest measured decode ({decode_speed(rec):,.1f} tok/s) of {len(ok)} "
               "configurations within the budgets")
        if others:
            why += (f"; within {TIE:.0%} of it: {others} tok/s, "
                    "none with a smaller device footprint")
        return rec, fastest, why
    if rec.kv["device"] < fastest.kv["device"]:
        reason = f"{(fastest.kv['device'] - rec.kv['device']) / MiB:.2f} MiB less KV on the device"
    elif rec.offload != fastest.offload:
        reason = "a nearer tier"
    elif rec.compress != fastest.compress:
        reason = "no compression"
    else:
        reason = ("the same device footprint and a faster prefill "
                  f"({rec.measured('prefill_tokens_per_s'):,.0f} against "
                  f"{fastest.measured('prefill_tokens_per_s'):,.0f} tok/s)")
    why = (f"decode {decode_speed(rec):,.1f} tok/s is within {TIE:.0%} of the fastest measured "
           f"({decode_speed(fastest):,.1f} tok/s at chunk {fastest.chunk_size}, window "
           f"{fastest.window}, {fastest.mode}), a tie on a shared machine; chosen for {reason}")
    return rec, fastest, why


# -----------------------------------------------------------------------------
# report

def command(c, args):
    """The generate.py command line of a configuration, runnable as printed from this directory
    (once PROMPT.txt holds your prompt, where tune.py was not given --prompt-file)."""
    cmd = ["python", os.path.relpath(os.path.join(ROOT, "generate.py")), "--ckpt", args.ckpt,
           "--prompt-file", args.prompt_file or PROMPT_PLACEHOLDER,
           "--chunk-size", c.chunk_size, "--offload", c.offload]
    if c.offload != "none":
        cmd += ["--window", c.window]
    budget = budget_gib(c)
    if budget:
        cmd += ["--cpu-budget", budget]
    if c.compress != "none":
        cmd += ["--compress", c.compress]
    if c.staged:
        cmd += ["--staging-slots", c.staging_slots]
    if c.group_buffers != OffloadConfig.group_buffers:
        cmd += ["--group-buffers", c.group_buffers]
    if c.offload == "disk":
        cmd += ["--offload-dir", args.offload_dir]
    cmd += ["--device", args.device, "--dtype", args.dtype]
    if args.quantize != "none":
        cmd += ["--quantize", args.quantize]
    if args.quantize == "int4":
        cmd += ["--group-size", args.group_size]
    if args.rope_scaling:
        cmd += ["--rope-scaling", args.rope_scaling, "--rope-factor", args.rope_factor]
    if args.rope_orig_ctx:
        cmd += ["--rope-orig-ctx", args.rope_orig_ctx]
    if args.threads:
        cmd += ["--threads", args.threads]
    if args.kv_dtype != "auto":
        cmd += ["--kv-dtype", args.kv_dtype]
    # the selection and kernels it was measured with (they change speed, and --select the output)
    if getattr(args, "select", "all") != "all":
        cmd += ["--select", args.select]
        for flag in ("select_budget", "select_dense"):
            if getattr(args, flag) is not None:
                cmd += [f"--{flag.replace('_', '-')}", getattr(args, flag)]
    for flag, default in (("attention", "flash"), ("products", "library")):
        if getattr(args, flag, default) != default:
            cmd += [f"--{flag}", getattr(args, flag)]
    cmd += ["--max-new-tokens", args.new_tokens]
    return " ".join(shlex.quote(str(x)) for x in cmd)


def budget_gib(c):
    """--cpu-budget for a configuration's command, as short as it can be: the budget it was tuned
    under, rounded down to the fewest significant digits that still hold the host chunks planned
    (and measured). None where there is no host tier, or no budget (--offload cpu then holds all
    it needs)."""
    if c.offload == "none" or not c.tiers.host or not c.cpu_budget:
        return None
    need = c.tiers.host * c.slot_bytes
    for digits in range(1, 17):
        scale = 10 ** (digits - 1 - math.floor(math.log10(c.cpu_budget)))
        text = repr(math.floor(c.cpu_budget * scale) / scale)
        if float(text) * 2**30 >= need:
            return text
    return repr(c.cpu_budget)


def mib(n):
    """Bytes as MiB in the table, '-' where there are none."""
    return "-" if n is None else f"{n / MiB:,.1f}"


def num(x):
    """A speed in the table, '-' where there is none."""
    return "-" if x is None else f"{x:,.1f}"


def table_order(c):
    return c.step, c.chunk_size, c.window, c.mode, c.staging_slots


def table(cands):
    lines = ["| step | chunk | window | tier | slots | decode tok/s predicted / measured | prefill "
             "tok/s predicted / measured | device KV MiB planned / peak | host RSS / anon MiB | KV "
             "MiB device / host / disk | note |",
             "|---" * 11 + "|"]
    for c in sorted(cands, key=table_order):
        kv = c.kv or {}
        # where the KV was at the end of the run: chunks per tier x chunk bytes; the disk as written
        # (zstd: smaller)
        tiers = "-"
        if c.runs:
            m = c.runs[-1]
            at_end = (m["chunks"]["device"] * c.chunk_bytes, m["chunks"]["host"] * c.chunk_bytes,
                      m["bytes"]["disk_write"])
            tiers = " / ".join(mib(x) for x in at_end)
        window = c.window if c.offload != "none" else "all"
        slots = c.staging_slots if c.staged else "-"
        note = "pruned: " + c.pruned if c.pruned else ""
        lines.append(f"| {c.step} | {c.chunk_size} | {window} | {c.mode} | {slots} | "
                     f"{num(c.pred_decode)} / {num(c.measured('decode_tokens_per_s'))} | "
                     f"{num(c.pred_prefill)} / {num(c.measured('prefill_tokens_per_s'))} | "
                     f"{mib(kv.get('device'))} / {mib(c.measured('device_kv_bytes'))} | "
                     f"{mib(c.measured('peak_host_rss_bytes'))} / "
                     f"{mib(c.measured('peak_host_anon_bytes'))} | {tiers} | {note} |")
    return "\n".join(lines)


def gib(x):
    """A budget in GiB, said in MiB."""
    return f"{x * 2**30 / MiB:,.1f} MiB"


def steps(cands, rec, model_args, args):
    """One line per tuning step, in the order above: what was decided and what the measurements
    said."""
    sizes = sorted({c.chunk_size for c in cands})
    by_size = {C: [decode_speed(c) for c in cands if c.chunk_size == C and c.runs] for C in sizes}
    best_by_size = ", ".join(f"{C} {max(v):,.1f} tok/s" if v else f"{C} pruned"
                             for C, v in by_size.items())
    cuda = probe.is_cuda(args.device)
    whole = whole_kv(model_args, args, rec.chunk_size, cuda) / 2**30
    zstd = [c for c in cands if c.compress == "zstd"]
    same = (rec.chunk_size, rec.window, rec.mode)
    slots = sorted((c.staging_slots, decode_speed(c)) for c in cands
                   if c.runs and c.staged and (c.chunk_size, c.window, c.mode) == same)

    step1 = (f"1. chunk size {rec.chunk_size} ({rec.chunk_bytes / MiB:.2f} MiB per layer chunk); "
             "best measured decode by chunk size: " + best_by_size)
    step2 = f"2. tier {rec.offload}: the whole KV ({gib(whole)}) "
    if rec.offload == "none":
        step2 += f"fits --device-budget {gib(args.device_budget)}"
    else:
        rest = (rec.kv["host"] + rec.kv["disk"]) / MiB
        fits = "fits" if rec.offload == "cpu" else "is over"
        step2 += (f"is over --device-budget {gib(args.device_budget)}; window {rec.window} keeps "
                  f"{rec.kv['device'] / MiB:,.1f} MiB on the device, the rest ({rest:,.1f} MiB) "
                  f"{fits} --cpu-budget {gib(args.cpu_budget)}")
    step3 = f"3. compression {rec.compress}: "
    if not zstd:
        step3 += "not tried: zstd is for the disk tier, which no configuration needed"
    elif any(c.runs for c in zstd):
        step3 += f"zstd measured at best {max(decode_speed(c) for c in zstd if c.runs):,.1f} tok/s"
    else:
        step3 += f"zstd pruned ({zstd[0].pruned})"
    if rec.staged:
        step4 = (f"4. prefetch: {rec.staging_slots} staging slots; measured "
                 + ", ".join(f"{s}: {d:,.1f} tok/s" for s, d in slots))
    else:
        step4 = ("4. prefetch: nothing is staged on this path (on CPU without zstd attention reads "
                 "offloaded chunks in place): staging slots do not matter")
    return [step1, step2, step3, step4]


# -----------------------------------------------------------------------------
# command line

def build_parser():
    p = argparse.ArgumentParser(prog="tune.py", description=__doc__, epilog=ALIAS,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    ckpt_help = ("Hugging Face checkpoint directory (default: the demo model in assets/); with "
                 "--random-model, a new directory to write it to (default: a temporary one, kept, "
                 "since the printed command uses it)")
    add_common_flags(p, chunk_size=None, window=None, ckpt_help=ckpt_help)
    for action in p._actions:
        if action.dest in ("chunk_size", "window", "staging_slots"):
            action.help = argparse.SUPPRESS  # what the tuner picks
        elif action.dest == "cpu_budget":
            action.help = ("GiB of host memory the offloaded KV may take "
                           "(default: half of MemAvailable)")
    p.add_argument("--device-budget", type=float,
                   help="GiB of KV the device may hold (default: CUDA, 90%% of its free memory "
                   "after the weights; CPU, half of MemAvailable)")
    p.add_argument("--context", type=int,
                   help=f"prompt tokens to tune for (default {DEFAULT_CONTEXT}, cut to fit the "
                   "model's context with --new-tokens)")
    p.add_argument("--new-tokens", type=int, default=32,
                   help="greedy tokens decoded per run (default %(default)s)")
    p.add_argument("--chunk-sizes", default=",".join(map(str, CHUNKS)),
                   help="step 1's grid, cut at --context (default %(default)s)")
    p.add_argument("--repeats", type=int, default=2,
                   help="runs of the configurations within 60%% of the best (default %(default)s)")
    p.add_argument("--prompt-file", metavar="FILE",
                   help="the prompt the recommended command runs on, carried into it as given; "
                   "tune --context to its length in tokens (default: the command names "
                   f"{PROMPT_PLACEHOLDER}, for you to fill with your prompt)")
    p.add_argument("--random-model", metavar="SPEC",
                   help=f"tune a random model: a preset {sorted(PRESETS)} and/or "
                   "dim=,layers=,heads=,kv_heads=,head_dim=,hidden=,vocab=")
    return one_line_errors(p)


def check(args):
    picked = args.chunk_size is not None or args.window is not None
    if picked or args.staging_slots != OffloadConfig.staging_slots:
        raise UsageError("--chunk-size, --window and --staging-slots are what tune.py "
                         "picks; give --chunk-sizes")
    try:
        sizes = sorted({int(x) for x in args.chunk_sizes.split(",") if x.strip()})
    except ValueError:
        raise UsageError("--chunk-sizes must be comma-separated integers, got "
                         f"{args.chunk_sizes!r}") from None
    args.context_given = args.context is not None
    if args.context is None:
        args.context = DEFAULT_CONTEXT
    checks = [
        (args.context >= 1,
         f"--context must be >= 1, got {args.context}"),
        (args.new_tokens >= 2 and args.repeats >= 1,
         "--new-tokens must be >= 2 and --repeats >= 1"),
        (sizes and sizes[0] >= 1,
         f"--chunk-sizes must be positive, got {args.chunk_sizes!r}"),
        (args.device_budget is None or args.device_budget > 0,
         "--device-budget must be > 0 GiB"),
    ]
    for ok, msg in checks:
        if not ok:
            raise UsageError(msg)
    args.chunk_grid = sizes  # cut at the context once the model's is known (main)
    if args.prompt_file:
        try:
            with open(args.prompt_file, encoding="utf-8-sig", newline="") as f:
                f.read(1)
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--prompt-file {args.prompt_file}: cannot be read ({e})") from None
    args.staging_slots = OffloadConfig.staging_slots
    check_common(args, needs_disk=True)
    if args.random_model:
        args.sizes = parse_model_spec(args.random_model)
        if args.ckpt and os.path.exists(args.ckpt) and os.listdir(args.ckpt):
            raise UsageError(f"--ckpt {args.ckpt} is not empty: with --random-model it names where "
                             "to write the new model; give a new directory")
    else:
        check_ckpt_dir(args.ckpt or DEMO_CKPT)


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def main(argv=None):
    args = build_parser().parse_args(argv)
    made = None  # a random model's temporary directory: kept only for the command it prints
    try:
        check(args)
        set_threads(args)  # cores.py: the cores this run may use
        dtype = DTYPES[args.dtype]
        if args.random_model:
            made = None if args.ckpt else tempfile.mkdtemp(prefix="tune-model-")
            args.ckpt = build_random_checkpoint(args.sizes, args.ckpt or made, dtype, args.device)
            log(f"random model written to {args.ckpt} (kept: the command below uses it)")
        args.ckpt = args.ckpt or DEMO_CKPT
        model_args = read_model_args(args.ckpt, args)  # with the --rope-scaling override
        args.context = fitted_contexts([args.context], args.context_given, args.new_tokens,
                                       model_args, "--context", log)[0]
        args.chunk_sizes = [c for c in args.chunk_grid if c <= args.context] or args.chunk_grid[:1]
        model = Transformer.from_pretrained(args.ckpt, device=args.device, dtype=dtype,
                                            rope_override=rope_override(args),
                                            quantize=quantize_mode(args))
        # the budgets' defaults: see the flags' help
        if probe.is_cuda(args.device):
            free = 0.9 * torch.cuda.mem_get_info(args.device)[0]
        else:
            free = mem_available() / 2
        args.device_budget = args.device_budget or free / 2**30
        if args.cpu_budget is None:
            args.cpu_budget = mem_available() / 2 / 2**30
        t = time.perf_counter()
        cands = search(model, model_args, args, log)
        rec, fastest, why = choose(cands, args)
        made = None  # a command will name it: kept
    except (ValueError, CheckpointError, OffloadError, DiskError, TaskDirError) as e:
        print(f"tune.py: error: {e}", file=sys.stderr)  # ValueError: UsageError too
        return 2
    finally:
        remove_created_offload_dir(args)  # as generate.py does: the printed command makes it again
        if made is not None:  # failed or interrupted: no command names the random model
            shutil.rmtree(made, ignore_errors=True)
    if getattr(args, "kv_dtype_why", None):
        why = f"{args.kv_dtype_why}; {why}"
    kv_total = whole_kv(model_args, args, rec.chunk_size, probe.is_cuda(args.device))
    n_measured = sum(bool(c.runs) for c in cands)
    n_pruned = sum(bool(c.pruned) for c in cands)
    print(f"{args.ckpt}: {model_args.n_layers} layers x {model_args.n_kv_heads} kv heads x "
          f"{model_args.head_dim}, {args.dtype} on {args.device}, context {args.context} + "
          f"{args.new_tokens} new: {kv_total / MiB:,.1f} MiB of KV in chunks of "
          f"{rec.chunk_size}; budgets: device "
          f"{args.device_budget * 2**30 / MiB:,.1f} MiB, host {args.cpu_budget * 2**30 / MiB:,.1f} "
          f"MiB; {n_measured} configurations measured, {n_pruned} pruned, in "
          f"{time.perf_counter() - t:.0f}s; {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}\n")
    print(table(cands) + "\n")
    print("\n".join(steps(cands, rec, model_args, args)))
    print(f"recommended: {why}\n{command(rec, args)}")
    if not args.prompt_file:
        print(f"(put your prompt in {PROMPT_PLACEHOLDER} first, or give tune.py --prompt-file; "
              f"it was tuned for {args.context} tokens)")
    budget = budget_gib(rec)  # GiB, as the command says it (None: no host tier)
    rec_cfg = {"chunk_size": rec.chunk_size,
               "window": rec.window if rec.offload != "none" else None,
               "offload": rec.offload, "compress": rec.compress,
               "cpu_budget": float(budget) if budget else None,
               "staging_slots": rec.staging_slots if rec.staged else None}
    keys = ("decode_tokens_per_s", "prefill_tokens_per_s", "device_kv_bytes", "peak_host_rss_bytes",
            "peak_host_anon_bytes")
    measured = {k: rec.measured(k) for k in keys}
    measured |= {"predicted_decode_tokens_per_s": rec.pred_decode, "kv_bytes_planned": rec.kv,
                 "runs": len(rec.runs), "fastest_decode_tokens_per_s": decode_speed(fastest),
                 "context": args.context}
    print(json.dumps({"recommended": rec_cfg, "command": command(rec, args), "measured": measured,
                      "why": why}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
