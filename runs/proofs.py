"""
`python verify.py`'s command line: its flags and checks, and the modes that go beyond the proof in
verify.py (which runs every --offload mode against --offload none and the unchunked model):
    --kv-store DIR  two more runs through the persistent prompt cache (the second must reuse stored
                    chunks), both compared with --offload none;
    --batch N       N prompts of different lengths as one batch of tasks in flight, their decode
                    steps shared (batcher.py), in every mode: each task must be bit-identical to
                    itself alone;
    torchrun        every rank verifies its own share; the verdict is every rank's.
(`python verify.py --diagnose ...` is the alias of `python doctor.py ...`: verify.py's __main__.)
With --kv-dtype int8 (or int4) every mode is compared with an --offload none of the same --kv-dtype
(bit-identical all the same); the unquantized reference's greedy ids are then reported, not
required, as they are with --quantize and --select.
"""
import argparse
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import verify
from checkpoint import CheckpointError
from disk import DiskError
from generate import Sampling
from kvbatch import make_arena
from offload import OffloadConfig
from pools import OffloadError
from rowwise import PIECES, decisions
from runs import interrupt, launch, speculation
from runs.batcher import Batcher
from runs.cores import one_thread_here
from runs.flags import (
    DEMO_CKPT,
    DTYPES,
    MODE_SPECS,
    UsageError,
    add_common_flags,
    check_ckpt_dir,
    check_common,
    one_line_errors,
    open_kv_store,
    policy_fields,
    print_err,
    quantize_mode,
    read_model_args,
    remove_created_offload_dir,
    rope_override,
    run_fingerprint,
    select_fields,
    set_threads,
)
from runs.monitor import fmt_bytes
from runs.task import run_task
from runs.tp import broadcast_token
from tokenizer import load_tokenizer

OFFLOAD_MODES = [m for m in MODE_SPECS if m != "none"]
SAMPLED_T = 0.8  # --speculate's sampled proof: a temperature that keeps some guesses
ALIAS = "alias: python verify.py --diagnose ... runs python doctor.py ..."


def mode_config(mode, args):
    """The OffloadConfig of a --modes name under these flags."""
    offload, compress = MODE_SPECS[mode]
    return OffloadConfig(mode=offload, window=args.window, offload_dir=args.offload_dir,
                         compress=compress, cpu_budget_gib=args.cpu_budget,
                         staging_slots=args.staging_slots,
                         group_buffers=args.group_buffers, **policy_fields(args))


def run_as_task(model, ids, max_new, mode, args, kv_store=None, fingerprint=None, layout=None,
                batcher=None, task="", gate=None):
    """verify.run_mode's result, through task.run_task: a task directory, the KV store, a batch
    (gate: its Gate, waited on after each decode step)."""
    steps = []

    def on_step(phase, logits, cache):
        steps.append((cache.length - 1, phase, logits[0].cpu()))
        if gate is not None and phase == "decode":
            gate.wait()

    offload, compress = MODE_SPECS[mode]
    new, stats = run_task(model, ids, max_new, chunk_size=args.chunk_size,
                          cfg=mode_config(mode, args),
                          task_id=f"verify_{os.getpid()}_{offload}_{compress}{task}",
                          kv_store=kv_store, fingerprint=fingerprint, kv_dtype=args.kv_dtype,
                          layout=layout, on_step=on_step, batcher=batcher)
    return new, steps, stats


def batch_prompts(ids, n):
    """n prompts of different lengths and contents cut from ids: task i starts i / (3n) of the way
    in and runs to the end, so the tasks decode at different positions, the shortest at two thirds
    of the longest: near enough that with --offload none their steps take the shared arena's grid
    (kvbatch.py), as a job's prompts of like lengths do."""
    return [ids[len(ids) * i // (3 * n):] for i in range(n)]


def batch_new_tokens(max_new, i):
    """Task i's new tokens in a batch proof (and in its lone run): 2 more than task i - 1's, so that
    no two tasks leave the batch at the same step, whichever of them went a step ahead (Gate), and
    the last steps run every row count from --batch down to 1."""
    return max_new + 2 * i


class Gate:
    """Holds each task of a batch proof after its first decode step until every task has begun
    to decode, so that the whole batch then steps together however fast a machine decodes: a task
    that decodes while the others still read their prompts (their prefill steps run between its
    decode steps, batcher.py) could otherwise finish before they join (a proof with no step of
    --batch rows). A task begins to decode when its first decode step reaches the batcher
    (GatedBatcher), so it is one of the batcher's decoding tasks before the held ones step again.
    While tasks are held the others' prefill steps run; a task that ends, finished or failed,
    counts as begun, so no one waits for it. Tasks are told apart by their threads' `here.task`."""

    def __init__(self, n):
        self.n = n
        self.begun = set()
        self.lock = threading.Lock()
        self.open = threading.Event()
        self.here = threading.local()

    def begin(self):
        with self.lock:
            self.begun.add(self.here.task)
            if len(self.begun) == self.n:
                self.open.set()

    def wait(self):
        self.open.wait()


class GatedBatcher(Batcher):
    """A Batcher that tells its Gate when a task's decode step reaches it."""

    def __init__(self, model, gate, arena=None):
        super().__init__(model, arena)
        self.gate = gate

    def step(self, model, cache, tokens, decode=False):
        if decode:
            self.gate.begin()
        return super().step(model, cache, tokens, decode)


def run_batched(model, prompts, mode, args):
    """The prompts as one batch of tasks in flight, their decode steps shared (batcher.py): per task
    what run_mode returns, every row count a decode step ran with, and the layer steps whose
    sealed chunks of every task were one kernel call (kvbatch.py's grid: --offload none on CPU).
    Task i makes batch_new_tokens(--max-new-tokens, i) tokens."""
    gate = Gate(len(prompts))
    # as a --prompts job runs it: with --offload none on CPU the tasks' chunks share one arena
    longest = max(len(q) + batch_new_tokens(args.max_new_tokens, i) for i, q in enumerate(prompts))
    arena = None
    if mode_config(mode, args).mode == "none":
        arena = make_arena(model, len(prompts), args.chunk_size, longest, args.kv_dtype)
    batcher = GatedBatcher(model, gate, arena)

    def one(i):
        gate.here.task = i
        try:
            return run_as_task(model, prompts[i], batch_new_tokens(args.max_new_tokens, i), mode,
                               args, batcher=batcher, task=f"_b{i}", gate=gate)
        finally:  # failed or finished: never waited for
            gate.begin()
    try:
        with ThreadPoolExecutor(len(prompts), initializer=one_thread_here) as pool:
            runs = list(pool.map(one, range(len(prompts))))
    finally:
        batcher.close()
    return runs, sorted(batcher.sizes), arena.grid_calls if arena else 0


def rowwise_summary():
    """{operation: "one call at 2x1, 3x1; not one call at ..."} from rowwise.decisions(): the
    rows of a size that is not one call go in smaller groups that are, or one at a time (groups
    read a piece of the weight at a time: "taken at ...", where their probes vouch)."""
    by_op = {}
    for what, (B, T), one in decisions():
        by_op.setdefault(what, {True: [], False: []})[one].append(f"{B}x{T}")
    words = {True: "one call", False: "not one call"}
    pieces = {True: "taken", False: "not taken"}
    return {what: "; ".join(f"{(pieces if what.endswith(PIECES) else words)[one]} at "
                            f"{', '.join(r)}" for one, r in ways.items() if r)
            for what, ways in by_op.items()}


def missing_sizes(n, sizes):
    """The decode step sizes from 1 to n tasks that a batch never ran."""
    return [k for k in range(1, n + 1) if k not in sizes]


def speculated(model, ids, args, cfgs, guesser, runs, diffs):
    """Every mode again with guesses checked in verify steps, greedy against --offload none and
    sampled against --offload none sampled the same way: ids and every logit equal."""
    n = len(ids) + args.max_new_tokens
    chunk = min(args.chunk_size, n)
    sampled = Sampling(temperature=SAMPLED_T, seed=0)
    runs["sampled"] = verify.run_mode(model, ids, args.max_new_tokens, args.chunk_size,
                                      cfgs["none"], args.kv_dtype, sampling=sampled)
    diffs["sampled"] = None
    for m, cfg in cfgs.items():
        for name, s, reference in ((f"{m}+spec", Sampling(), "none"),
                                   (f"{m}+spec sampled", sampled, "sampled")):
            runs[name] = verify.run_mode(model, ids, args.max_new_tokens, args.chunk_size, cfg,
                                         args.kv_dtype, sampling=s, speculator=guesser(chunk, n))
            diffs[name] = verify.compare(runs[reference], runs[name])


def build_parser():
    p = argparse.ArgumentParser(prog="verify.py", description=verify.__doc__, epilog=ALIAS,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    one_line_errors(p)
    add_common_flags(p, chunk_size=64, window=2)
    p.add_argument("--prompt-file",
                   help="UTF-8 prompt (default: pages of Python's reference manual)")
    p.add_argument("--max-new-tokens", type=int, default=32,
                   help="greedy tokens to generate (default %(default)s)")
    p.add_argument("--modes", default="cpu,disk,disk+zstd",
                   help=f"comma list of {OFFLOAD_MODES} (default all)")
    p.add_argument("--max-prompt-tokens", type=int, default=2048,
                   help="verify at most the first this many tokens of the prompt (default "
                   "%(default)s; a longer --prompt-file is cut, and said so)")
    p.add_argument("--batch", type=int, metavar="N",
                   help="also run N prompts of different lengths as one batch of tasks in flight "
                   "(their decode steps shared) in every mode: each task must be bit-identical to "
                   "itself run alone with --offload none, in decode steps of every size from N "
                   "down to 1 (task i makes --max-new-tokens + 2i tokens)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    speculation.add_flags(p)  # also every mode with guesses checked, greedy and sampled
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except BrokenPipeError:  # stdout's reader is gone (`| head`): neither a proof nor a mismatch
        return interrupt.closed_stdout("verify.py")
    finally:
        remove_created_offload_dir(args)


def run(args):
    """verify.py's checks, runs and report: the exit code."""
    layout = None
    try:
        layout = launch.start(args.tp, args.device)  # under torchrun: each rank verifies its share
        args.device = str(layout.device)
        args.ckpt = args.ckpt or DEMO_CKPT
        modes = list(dict.fromkeys(m.strip() for m in args.modes.split(",") if m.strip()))
        bad = [m for m in modes if m not in OFFLOAD_MODES]
        if bad or not modes:
            raise UsageError(f"--modes: {bad or args.modes!r} not among {OFFLOAD_MODES}")
        if args.max_new_tokens <= 0 or args.max_prompt_tokens <= 0:
            raise UsageError("--max-new-tokens and --max-prompt-tokens must be >= 1")
        if args.batch is not None and (args.batch < 2 or layout.tp > 1):
            raise UsageError("--batch N needs N >= 2 tasks, and one process per model (no --tp "
                             "above 1)")
        check_common(args, needs_disk=any(MODE_SPECS[m][0] == "disk" for m in modes))
        check_ckpt_dir(args.ckpt)
        set_threads(args)  # cores.py: the cores this run may use
        model_args = read_model_args(args.ckpt, args)
        speculation.check(args, model_args, batch=bool(args.batch))
        kv_store = open_kv_store(args)
        tokenizer = load_tokenizer(args.ckpt)
        if tokenizer is None:
            raise UsageError(f"--ckpt {args.ckpt}: has no tokenizer, so the prompt "
                             "cannot be encoded")
        try:
            if args.prompt_file:  # as generate.py reads it: no BOM, CRLF kept
                with open(args.prompt_file, encoding="utf-8-sig", newline="") as f:
                    text = f.read()
            else:
                text = verify.DEFAULT_PROMPT
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--prompt-file {args.prompt_file}: cannot be read ({e})") from None
        room = model_args.max_context - args.max_new_tokens
        whole = tokenizer.encode(text)
        ids = whole[:min(args.max_prompt_tokens, room)]
        if args.prompt_file and len(ids) < len(whole) and layout.rank == 0:
            why = (f"--max-prompt-tokens {args.max_prompt_tokens}; raise it to verify more"
                   if args.max_prompt_tokens <= room else
                   f"the model's context of {model_args.max_context} less --max-new-tokens")
            print_err(f"verify.py: --prompt-file {args.prompt_file} holds {len(whole)} tokens; "
                      f"verifying its first {len(ids)} ({why})")
        if not whole or len(whole) == int(bool(getattr(tokenizer, "add_bos", False))):
            raise UsageError(f"--prompt-file {args.prompt_file} holds no text; give a file with "
                             "the text to verify on")
        if len(ids) < 1:
            raise UsageError(f"--max-new-tokens {args.max_new_tokens} leaves no room for the "
                             f"prompt in the model's context of {model_args.max_context}; lower "
                             "it")
        # the last token is never fed back, and a chunk that leaves the device must be read after
        if len(ids) + args.max_new_tokens - 1 <= args.chunk_size * (args.window + 1):
            raise UsageError(f"prompt ({len(ids)} tokens) plus --max-new-tokens fit in the device "
                             f"window ({args.window} chunks of {args.chunk_size} plus the open "
                             "one): nothing would be offloaded and read back, so nothing would be "
                             "verified; lower --chunk-size or --window")
        if kv_store and len(ids) - 1 < args.chunk_size:  # one prompt token is always computed
            raise UsageError(f"--kv-store: the prompt ({len(ids)} tokens) holds no whole chunk of "
                             f"--chunk-size {args.chunk_size} before its last token, so nothing "
                             "would be stored and reused; lower --chunk-size or give a longer "
                             "prompt")
        model = launch.load(args.ckpt, layout, args.device, DTYPES[args.dtype], rope_override(args),
                            quantize_mode(args))
        share = None  # under tensor parallelism rank 0's token is everyone's
        if layout.tp > 1:
            def share(token):
                return broadcast_token(token, layout)
        cfgs = {m: mode_config(m, args) for m in ["none"] + modes}
        runs, diffs = verify.prove(model, ids, args.max_new_tokens, args.chunk_size, cfgs,
                                   args.kv_dtype, share)
        guesser = speculation.factory(args, speculation.load_draft(args, args.device,
                                                                   DTYPES[args.dtype]))
        if guesser:
            speculated(model, ids, args, cfgs, guesser, runs, diffs)
        # the first run stores what the store lacks, the second must reuse it: both against none
        if kv_store:
            fp = run_fingerprint(args.ckpt, args)
            for m in ("store", "reuse"):
                runs[m] = run_as_task(model, ids, args.max_new_tokens, modes[-1], args, kv_store,
                                      fp, layout)
                diffs[m] = verify.compare(runs["none"], runs[m])
        # mode -> (per task: the first difference from its lone run, or None; the step sizes)
        batched = {}
        if args.batch:
            prompts = batch_prompts(ids, args.batch)
            alone = [run_as_task(model, q, batch_new_tokens(args.max_new_tokens, i), "none", args,
                                 task=f"_a{i}")
                     for i, q in enumerate(prompts)]
            for m in ["none"] + modes:
                tasks, sizes, grid = run_batched(model, prompts, m, args)
                batched[m] = ([verify.compare(a, b) for a, b in zip(alone, tasks)], sizes, grid)
    except (UsageError, CheckpointError, OffloadError, ValueError, DiskError) as e:
        launch.refuse(f"verify.py: error: {e}", layout)
        return 2
    bad = next((pos for pos, _, logits in runs["none"][1] if not logits.isfinite().all()), None)
    if bad is not None and layout.rank == 0:  # compared by their bits all the same (same_bits)
        print_err(f"verify.py: note: the logits hold NaN or inf from position {bad} on: the "
                  f"model overflows in --dtype {args.dtype}; they are compared by their bits")

    ref_ok, agree, ref_diff = verify.unchunked(model, ids, runs["none"])
    report = {}
    ok = True
    for m, (new, _, st) in runs.items():
        ok &= diffs[m] is None
        report[m] = {"bit_identical": diffs[m] is None, "first_difference": diffs[m],
                     "tokens": len(new), "chunks": st["chunks"], "bytes": st["bytes"],
                     "decode_tokens_per_s": st["decode_tokens_per_s"],
                     "chunks_read_per_decode_step": st["chunks_read_per_decode_step"],
                     "reused_tokens": st.get("reused_tokens", 0),
                     "speculation": st.get("speculation")}
    # a mode whose tier was never read back proves nothing (a sliding window that hides every
    # chunk that left, --cpu-budget holding every chunk a disk mode had to write)
    unread = [m for m in modes if not tier_read(m, runs[m][2]["bytes"])]
    for m in unread:
        report[m]["bit_identical"] = None
    for m, (task_diffs, sizes, _) in batched.items():
        # every task its own bits, in decode steps of every size from 1 to --batch
        ok &= all(d is None for d in task_diffs) and not missing_sizes(args.batch, sizes)
    if kv_store and not report["reuse"]["reused_tokens"]:  # nothing reused would prove nothing
        ok = False
        report["reuse"]["first_difference"] = (0, None, "prefill",
                                               "the second run reused no stored chunk")
    # bf16/fp16 rounding, quantized KV, a quantized matmul's kernel for one row and another for
    # many (quantize.py), or a --select reading less than the unchunked model may flip a near-tie:
    # reported, not failed
    exact = (args.dtype == "fp32" and args.kv_dtype == "auto" and args.quantize == "none"
             and args.select == "all")
    if exact:
        ok &= ref_ok
    # under torchrun: every rank's share must pass, each replica's too
    first = next((f"{m}: step {d[0]} ({d[2]}, position {d[1]}): {d[3]}"
                  for m, d in diffs.items() if d), None)
    ranks = launch.gather_to_zero({"mismatch": not ok, "unread": unread, "first": first}, layout)
    launch.finish(layout)
    if layout.rank != 0:  # one report, from rank 0
        return 1 if not ok else 2 if unread else 0
    failed = {r: v for r, v in enumerate(ranks) if r and (v["mismatch"] or v["unread"])}
    mismatch = not ok or any(v["mismatch"] for v in failed.values())
    unread = sorted({*unread, *(m for v in failed.values() for m in v["unread"])})
    ok = not mismatch and not unread
    if args.json:
        unchunked = {"greedy_ids_equal": ref_ok, "top1_agreement": agree,
                     "max_abs_logit_diff": ref_diff}
        print(json.dumps({"ok": ok, "ranks": layout.world, "failed_ranks": sorted(failed),
                          "not_proven": unread, "prompt_tokens": len(ids),
                          "chunk_size": args.chunk_size, "window": args.window,
                          "kv_dtype": args.kv_dtype, "select": select_fields(args),
                          "modes": report, "unchunked": unchunked,
                          "batch": {m: {"identical_to_alone": [d is None for d in d_],
                                        "tasks_per_step": sizes, "grid_layer_steps": grid}
                                    for m, (d_, sizes, grid) in batched.items()},
                          "rowwise": [{"what": w, "rows": r, "one_call": one}
                                      for w, r, one in decisions()]}))
    else:
        print_report(args, layout, ids, report, batched, ref_ok, agree, ref_diff, ok, unread,
                     failed)
    return 1 if mismatch else 2 if unread else 0


def tier_read(mode, moved):
    """Whether a run in `mode` read chunks back from the tier the mode puts them in (moved: its
    bytes counters)."""
    if mode == "cpu":
        return moved["host_read"] + moved["h2d"] > 0
    return moved["disk_read"] + moved["disk_mapped_read"] > 0


def print_report(args, layout, ids, report, batched, ref_ok, agree, ref_diff, ok, unread=(),
                 failed=None):
    """The table verify.py prints: a row per mode, the unchunked comparison, any mismatch."""
    ranks = ""
    if layout.world > 1:
        ranks = (f"; under torchrun: {layout.world} ranks, --tp {layout.tp}, each verifying "
                 "its own share (rank 0's table below)")
    print(f"prompt {len(ids)} tokens, {args.max_new_tokens} new, chunk {args.chunk_size}, "
          f"window {args.window}, {args.device} {args.dtype}, KV {args.kv_dtype}{ranks}")
    if args.select != "all":
        none = report["none"]
        skipped = none["bytes"]["select_skipped"]
        budget = f" (budget {args.select_budget} tokens)" if args.select_budget else ""
        print(f"--select {args.select}{budget}: "
              f"{none['chunks_read_per_decode_step']:g} sealed chunks read per decode step, "
              f"{skipped / 2**20:.1f} MiB left unread over the run")
    print(f"{'mode':<24} {'ids+logits vs none':<20} {'chunks dev/host/disk':<22} "
          f"{'disk tier read':>14} {'decode tok/s':>13} {'reused':>7}")
    for m, r in report.items():
        c = r["chunks"]
        b = r["bytes"]
        if m == "none":
            verdict = "reference"
        elif m == "sampled":
            verdict = f"reference, T={SAMPLED_T}"
        elif r["bit_identical"] is None:
            verdict = "NOT PROVEN"
        else:
            verdict = "bit-identical" if r["bit_identical"] else "DIFFERENT"
        read = fmt_bytes(b["disk_read"] + b["disk_mapped_read"])
        print(f"{m:<24} {verdict:<20} {c['device']:>5}/{c['host']:>5}/{c['disk']:>5}{'':<5} "
              f"{read:>14} {r['decode_tokens_per_s']:>13.1f} {r['reused_tokens']:>7}")
        spec = r["speculation"]
        if spec:
            print(f"{'':<24} {spec['speculate']}: {spec['guesses_kept']} of "
                  f"{spec['guesses_proposed']} guesses kept, {spec['tokens_per_step']:.2f} tokens "
                  f"per verify step")
    if args.select != "all":
        why = f"(--select {args.select} reads a selection; the unchunked model reads all)"
    elif args.kv_dtype != "auto":
        why = f"({args.kv_dtype} KV against an unquantized cache: close, not equal)"
    elif args.dtype != "fp32":
        why = ("(a different kernel schedule: close, not bit-identical; "
               "in fp32 only it must agree)")
    else:
        why = "(a different kernel schedule: close, not bit-identical)"
    equal = "equal" if ref_ok else "DIFFERENT"
    print(f"unchunked  greedy ids {equal} (top-1 agreement {agree:.1%}), max |logit diff| "
          f"{ref_diff:.3g} {why}")
    for m, r in report.items():
        if r["first_difference"]:
            step, pos, phase, what = r["first_difference"]
            mine = (f", or --select {args.select} keeping a view of the keys its summarize is "
                    "handed (the store reuses that buffer: keep a copy)"
                    if args.select != "all" else "")
            print(f"MISMATCH {m}: step {step} ({phase}, position {pos}): {what}. Likely "
                  "causes: a chunk read back at the wrong position or from a stale slot (a "
                  f"missing stream wait), or a dtype change across tiers{mine}.")
    for m, (diffs, sizes, grid) in batched.items():
        same = sum(d is None for d in diffs)
        shared = f"; {grid} layer steps attended every task's chunks in one call" if grid else ""
        print(f"batch of {args.batch}, {m}: {same} of {len(diffs)} tasks bit-identical to "
              f"themselves alone with --offload none; decode steps of "
              f"{', '.join(map(str, sizes))} tasks{shared}")
        missing = missing_sizes(args.batch, sizes)
        if missing:
            print(f"NOT PROVEN batch {m}: no decode step of {', '.join(map(str, missing))} "
                  "tasks ran (tasks finished before the others had read their prompts); raise "
                  "--max-new-tokens")
        for i, d in enumerate(diffs):
            if d:
                print(f"MISMATCH batch {m} task {i}: step {d[0]} ({d[2]}, position {d[1]}): "
                      f"{d[3]}")
    if batched:
        print("rowwise.py, per operation the row counts (tasks x positions) checked: "
              + "; ".join(f"{what}: {rows}" for what, rows in rowwise_summary().items()))
    for m in unread:
        print(f"NOT PROVEN {m}: no chunk was read back from its tier (chunks dev/host/disk above: "
              "none left the device, a sliding window hid every chunk that left, or --cpu-budget "
              "kept a disk mode's chunks in host memory); raise --max-new-tokens or the prompt, "
              "or lower --chunk-size or --window")
    for r, v in (failed or {}).items():
        if v["mismatch"]:
            where = v["first"] or "a batch task or the unchunked model (see that rank's own run)"
            print(f"MISMATCH on rank {r}: {where}")
    everywhere = f" on all {layout.world} ranks" if layout.world > 1 else ""
    print(f"OK: every mode is bit-identical to --offload none{everywhere}" if ok else "FAILED")


if __name__ == "__main__":
    launch.exit(main())
