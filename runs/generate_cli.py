r"""
`python generate.py`'s command line: its flags (the shared ones from flags.py, then its own), the
checks made before any weight is loaded, and main(): one prompt, or a --prompts batch through
batch.py.

    python generate.py --ckpt DIR --prompt-file doc.txt --max-new-tokens 256 \
        --chunk-size 512 --window 4 --offload disk

Without --ckpt it runs a short demo on the small model shipped in assets/ (disk tier, a window
smaller than the context). A bad flag is one line on stderr and exit code 2.
"""
import argparse
import contextlib
import json
import math
import os
import shlex
import shutil
import signal
import sys
import threading

from checkpoint import CheckpointError
from disk import ALIGN, DISK_FULL, round_up
from generate import MIN_TEMPERATURE, SEED_LIMIT, Sampling
from kvbatch import make_arena
from kvlayout import kv_chunk_bytes
from offload import COMPRESSIONS, MODES, OffloadConfig
from policy import SELECT_FIELDS, PolicyError, host_budget_refusal, plan_tiers
from pools import OffloadError
from quantize import int4_fallbacks
from rope import context_refusal, rope_override_note
from runs import interrupt, launch, speculation
from runs.batch import Interrupted, OutputError, holds_lines, run_batch
from runs.batcher import Batcher
from runs.cores import CoreWatch
from runs.flags import (
    DEFAULT_BATCH_SIZE,
    DEMO_CKPT,
    DTYPES,
    UsageError,
    add_common_flags,
    check_ckpt_dir,
    check_common,
    check_offload_dir,
    check_shapes,
    one_line_errors,
    open_kv_store,
    policy_fields,
    print_err,
    quantize_mode,
    read_model_args,
    remove_created_offload_dir,
    rope_override,
    run_fingerprint,
    set_threads,
    text_out,
)
from runs.monitor import Monitor, progress_line
from runs.progress import Progress
from runs.task import run_task
from runs.taskdir import TaskDirError, safe_task_name
from runs.tp import gather_stats
from tokenizer import TextStream, load_tokenizer

DEMO_PROMPT = ("A module is a file containing Python definitions and statements. The file name is "
               "the module name with the suffix .py appended. Within a module, the module's name "
               "is available as the value of the global variable __name__.")

DEMO_DEFAULTS = {"chunk_size": 16, "window": 1, "offload": "disk", "max_new_tokens": 64,
                 "threads": 1}
CKPT_DEFAULTS = {"chunk_size": 512, "window": 4, "offload": "none", "max_new_tokens": 128,
                 "threads": None}
USAGE = "%(prog)s [--ckpt DIR] [--prompt TEXT | --prompt-file FILE | --prompts JSONL] [flags below]"
DESCRIPTION = """\
Generate text from a Hugging Face checkpoint with its KV cache offloaded (--offload cpu or disk);
the output is bit-identical to --offload none. Without --ckpt: a demo on the model in assets/."""
EXAMPLE = """example:
  python generate.py --ckpt DIR --prompt-file doc.txt --max-new-tokens 256 \\
      --chunk-size 512 --window 4 --offload disk
the reading order, the docs and what each number means: README.md"""
# generate.py --help lists its flags under these headings, in this order (a name no flag has yet
# is skipped: the selection flags --select, --select-budget, --select-dense have their place)
HELP_GROUPS = {
    "model and text": ("ckpt", "prompt", "prompt_file", "chat", "system", "dtype", "quantize",
                       "group_size", "rope_scaling", "rope_factor", "rope_orig_ctx"),
    "generation": ("max_new_tokens", "max_length", "temperature", "top_k", "top_p", "seed",
                   "device", "threads", "attention", "products"),
    "speculation (the output is unchanged)": ("speculate", "draft", "draft_tokens"),
    "offload": ("offload", "chunk_size", "window", "offload_dir", "cpu_budget", "compress",
                "kv_dtype", "staging_slots", "group_buffers", "kv_store", "kv_store_budget",
                "select", "select_budget", "select_dense", "placement"),
    "batch (with --prompts)": ("prompts", "output", "batch_size", "keep_cache",
                               "fallback_cpu_budget", "fallback_context"),
    "parallel (under torchrun)": ("tp",),
    "output": ("echo", "json", "trace"),
}

# -----------------------------------------------------------------------------
# generate.py's command line

def group_help(p, groups):
    """List p's flags under argument groups in --help, each group's in the order given (parsing is
    unchanged; a flag no group names stays under "options")."""
    by_dest = {a.dest: a for a in p._actions}
    listed = {dest for dests in groups.values() for dest in dests}
    for group in p._action_groups:
        group._group_actions[:] = [a for a in group._group_actions if a.dest not in listed]
    for title, dests in groups.items():
        p.add_argument_group(title)._group_actions.extend(by_dest[d] for d in dests
                                                          if d in by_dest)
    return p


def both_defaults(dest):
    """'(default X; Y in the demo)' for a flag whose default differs in the demo."""
    return f"(default {CKPT_DEFAULTS[dest]}; {DEMO_DEFAULTS[dest]} in the demo)"


def build_parser():
    p = argparse.ArgumentParser(prog="generate.py", usage=USAGE, description=DESCRIPTION,
                                epilog=EXAMPLE,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_flags(p, None, None)
    for action in p._actions:  # the demo and a real checkpoint differ in these defaults: say both
        if action.dest == "chunk_size":
            action.help = ("positions per KV chunk, the unit of transfer, cut to a task's length "
                           "where longer " + both_defaults("chunk_size"))
        elif action.dest == "window":
            action.help = "sealed chunks per layer kept on the device " + both_defaults("window")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--prompt", help="prompt text (default: a built-in English paragraph)")
    g.add_argument("--prompt-file", help="read the prompt from this UTF-8 file")
    g.add_argument("--prompts",
                   help="batch: a JSONL file of {\"id\", \"prompt\" (or chat \"messages\")[, "
                   "\"max_new_tokens\", \"temperature\", \"seed\"]}")
    p.add_argument("--chat", action="store_true",
                   help="render the prompt with the checkpoint's chat template (instruct models), "
                   "as transformers' apply_chat_template(..., add_generation_prompt=True)")
    p.add_argument("--system",
                   help="with --chat: a system message (default: none, or the template's own)")
    n = p.add_mutually_exclusive_group()
    n.add_argument("--max-new-tokens", type=int,
                   help=f"tokens to generate {both_defaults('max_new_tokens')}; cut, with a "
                   "warning, where the model's context ends")
    n.add_argument("--max-length", type=int,
                   help="cap on prompt plus generated tokens (default: the model's maximum)")
    p.add_argument("--offload", choices=MODES,
                   help="where sealed chunks beyond the window go " + both_defaults("offload"))
    p.add_argument("--compress", choices=COMPRESSIONS, default="none",
                   help="compress disk chunks (lossless)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0,
                   help="sample among the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--seed", type=int, default=0,
                   help="sampling seed; each step is reproducible on its own")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object per prompt instead of text")
    p.add_argument("--echo", action="store_true",
                   help="print the prompt (as given, not a chat template's rendering) before the "
                   "generated text (default: the generated text only)")
    b = p.add_argument_group("batch (with --prompts)")
    b.add_argument("--output",
                   help="RESULTS.jsonl: one line per finished task; ids already there are skipped")
    b.add_argument("--batch-size", "--concurrency", dest="batch_size", type=int, metavar="N",
                   help=f"tasks in flight at once; their decode steps run as one forward pass, "
                   f"each task's output unchanged (default {DEFAULT_BATCH_SIZE}; 1: one task at a "
                   "time). Each task in flight holds its own cache: N tasks hold N times one "
                   "task's device window, and share --cpu-budget. --concurrency is the same "
                   "flag, kept from before batching")
    b.add_argument("--keep-cache", action="store_true",
                   help="keep a task's directory after it succeeds")
    b.add_argument("--fallback-cpu-budget", type=float,
                   help="with --prompts: if the disk tier fails (full, read-only, ...), rerun the "
                   "task on a host tier of this many GiB (output is identical); normal placement "
                   "is unchanged")
    b.add_argument("--fallback-context", type=int,
                   help="with --prompts: if the disk tier fails, continue on the last N tokens")
    b.add_argument("--trace",
                   help="TRACE.jsonl: one event per step (memory, bytes per tier, chunks) and "
                   "alerts; appended to, each run starting with a {\"run_start\"} event")
    speculation.add_flags(p)
    return one_line_errors(group_help(p, HELP_GROUPS))


def resolve(args):
    """Fill demo or plain defaults, check every flag, and return (offload config, prompt text).
    No heavy work."""
    defaults = DEMO_DEFAULTS if args.ckpt is None else CKPT_DEFAULTS
    args.ckpt = args.ckpt or DEMO_CKPT
    for dest in ("chunk_size", "window", "offload", "threads"):
        if getattr(args, dest) is None:
            setattr(args, dest, defaults[dest])
    if args.max_new_tokens is None and args.max_length is None:
        args.max_new_tokens = defaults["max_new_tokens"]
    checks = [
        (args.max_new_tokens is None or args.max_new_tokens > 0,
         f"--max-new-tokens must be >= 1, got {args.max_new_tokens}"),
        (args.max_length is None or args.max_length > 0,
         f"--max-length must be >= 1, got {args.max_length}"),
        (args.compress == "none" or args.offload == "disk",
         "--compress zstd applies to the disk tier; add --offload disk"),
        (math.isfinite(args.temperature)
         and (args.temperature == 0 or args.temperature >= MIN_TEMPERATURE)
         and args.top_k >= 0 and 0 < args.top_p <= 1,
         "--temperature must be 0 (greedy) or a number >= 1e-6, --top-k >= 0 and --top-p in "
         "(0, 1]"),
        (abs(args.seed) < SEED_LIMIT,
         f"--seed must be between -{SEED_LIMIT} and {SEED_LIMIT}, got {args.seed}"),
        (not args.prompts or args.output,
         "--prompts needs --output RESULTS.jsonl"),
        (not args.output or args.prompts,
         "--output is for batch mode; add --prompts TASKS.jsonl"),
        (not same_file(args.prompts, args.output),
         f"--output {args.output} is the --prompts file; give the results a file of their own"),
        (not any(same_file(args.trace, f) for f in (args.prompts, args.output, args.prompt_file)),
         f"--trace {args.trace} is an input or the results; give the trace a file of its own"),
        (args.batch_size is None or args.batch_size >= 1,
         f"--batch-size must be >= 1, got {args.batch_size}"),
        (args.batch_size is None or args.prompts,
         "--batch-size goes with --prompts TASKS.jsonl (a single --prompt is one task)"),
        (args.fallback_context is None or args.fallback_context > 0,
         "--fallback-context must be >= 1"),
        (args.prompts or (args.fallback_context is None and args.fallback_cpu_budget is None),
         "--fallback-cpu-budget and --fallback-context go with --prompts TASKS.jsonl; for a "
         "single prompt choose its tier (--offload cpu --cpu-budget GIB)"),
        (args.fallback_cpu_budget is None
         or (math.isfinite(args.fallback_cpu_budget) and args.fallback_cpu_budget > 0),
         "--fallback-cpu-budget must be a number > 0 GiB"),
        (args.system is None or args.chat,
         "--system goes with --chat; add --chat"),
    ]
    for ok, msg in checks:
        if not ok:
            raise UsageError(msg)
    check_ckpt_dir(args.ckpt)
    if args.prompt_file:  # read before check_common makes the offload dir: nothing to undo
        try:
            # a BOM is no text; CRLF stays as the file has it (the tokenizer reads "\r")
            with open(args.prompt_file, encoding="utf-8-sig", newline="") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--prompt-file {args.prompt_file}: cannot be read ({e})") from None
    else:
        text = args.prompt if args.prompt is not None else DEMO_PROMPT
    if text == "":  # whether a tokenizer would add a BOS to nothing: no prompt either way
        raise UsageError("the prompt is empty; give --prompt or --prompt-file with some text")
    for flag, value in (("--prompt", args.prompt), ("--system", args.system)):
        try:
            value is None or value.encode("utf-8")
        except UnicodeEncodeError:  # bytes the shell passed that are not UTF-8 (surrogates here)
            raise UsageError(f"{flag} holds bytes that are not UTF-8 text; give it in UTF-8 "
                             "(or in a file, --prompt-file)") from None
    check_common(args, needs_disk=False)
    if args.offload == "disk":
        try:
            check_offload_dir(args)
        except UsageError as e:
            if not (args.fallback_cpu_budget or args.fallback_context):
                raise
            why = ("the fallbacks take over a disk tier that fails once a task is running, not "
                   "one unusable from the start: for that, --offload cpu")
            raise UsageError(f"{e} ({why})") from None
    cfg = OffloadConfig(mode=args.offload, window=args.window, cpu_budget_gib=args.cpu_budget,
                        offload_dir=args.offload_dir, compress=args.compress,
                        keep_files=args.keep_cache, staging_slots=args.staging_slots,
                        group_buffers=args.group_buffers,
                        **policy_fields(args))
    return cfg, text


def plan_lengths(args, n_prompt, model_args, max_new_tokens=None, warn=None):
    """How many tokens to generate, checked against the model's maximum context; a cut is reported
    via warn."""
    limit = model_args.max_context
    if n_prompt == 0:
        if getattr(args, "chat", False):
            raise UsageError("the chat template rendered nothing for this prompt; check the "
                             "checkpoint's template, or drop --chat")
        raise UsageError("the prompt is empty; give --prompt or --prompt-file with some text")
    cap = args.max_length if args.max_length is not None else limit
    if cap > limit:
        raise UsageError(f"--max-length {cap} is past the model's maximum context of "
                         f"{limit} positions")
    # past the trained context: say how to go on, on purpose
    if n_prompt >= limit and args.max_length is None:
        asked = max_new_tokens or args.max_new_tokens or 1
        raise UsageError(context_refusal(n_prompt + asked, model_args))
    if n_prompt >= cap:
        raise UsageError(f"the prompt has {n_prompt} tokens, at or past the maximum length "
                         f"{cap}; shorten it")
    asked = max_new_tokens or args.max_new_tokens
    if asked and asked > cap - n_prompt and warn:
        where = "--max-length" if args.max_length else "model's context"
        warn(f"warning: --max-new-tokens {asked} cut to {cap - n_prompt}: the prompt's {n_prompt} "
             f"tokens leave no more room in the {where} of {cap} positions")
    return min(asked or cap - n_prompt, cap - n_prompt)


def check_host_budget(args, cfg, model_args, positions, layout):
    """A --cpu-budget too small for the one task's host tier (--offload cpu), refused before the
    model loads, as the store would refuse it once made (a replica's ranks hold slices: the store
    alone judges those)."""
    if cfg.cpu_budget_gib is None or layout.tp > 1:
        return
    C = min(args.chunk_size, positions)  # as run_task cuts it
    slot = round_up(kv_chunk_bytes(model_args, DTYPES[args.dtype], args.kv_dtype, C), ALIGN)
    plan = plan_tiers(positions, C, cfg.window, model_args.n_layers, cfg.mode,
                      int(cfg.cpu_budget_gib * 2**30) // slot)
    refusal = host_budget_refusal(plan, cfg.cpu_budget_gib, slot)
    if refusal:
        raise UsageError(refusal)


def main(argv=None):
    args = build_parser().parse_args(argv)
    text_out()
    args.at = None         # (phase, position, prompt tokens) of the lone task's last step
    args.started = set()   # ids of the tasks begun
    # signal handlers belong to the main thread; called from another, Ctrl-C stays the caller's.
    # SIGTERM and SIGHUP stop a run as Ctrl-C does (runs/interrupt.py); an ignored one stays so
    here = threading.current_thread() is threading.main_thread()
    previous = {}
    if here:
        previous = interrupt.install({signal.SIGINT: stop_once, signal.SIGTERM: interrupt.terminate,
                                      signal.SIGHUP: interrupt.terminate})
    try:
        return generate_main(args)
    except KeyboardInterrupt as e:
        print_interrupted(args, e)
        return interrupt.status(e)
    except BrokenPipeError:  # stdout's reader is gone (`| head`): a lone prompt's task is not
        # worth resuming (a batch keeps its tasks: its results go to --output)
        for t in () if args.prompts else args.started:
            shutil.rmtree(os.path.join(args.offload_dir, safe_task_name(t)), ignore_errors=True)
        return interrupt.closed_stdout("generate.py")
    finally:
        remove_created_offload_dir(args)
        interrupt.restore(previous)


def stop_once(signum, frame):
    """Ctrl-C: stop where the run is; a second one cannot cut short the cleanup that follows (the
    task directories it keeps, the threads it joins)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def vouched_for(task_dir):
    """Whether a kept task directory holds a manifest (under --tp, one in each rank<r>/)."""
    ranks = [e for e in os.listdir(task_dir) if e.startswith("rank")]
    return all(os.path.isfile(os.path.join(task_dir, r, "manifest.json")) for r in ranks or [""])


def print_interrupted(args, e):
    """The one line a Ctrl-C (a SIGTERM, a SIGHUP: e) ends a run with: what it kept, where, and
    how to go on or remove it. Said by the first process only (under torchrun every rank gets the
    signal)."""
    if os.environ.get("RANK", "0") != "0":
        return
    disk = getattr(args, "offload", None) == "disk"
    # "interrupted", or what else stopped it
    stopped = "interrupted" if interrupt.signum_of(e) == signal.SIGINT else interrupt.said(e)
    dirs = [os.path.join(args.offload_dir, safe_task_name(t)) for t in sorted(args.started)]
    kept = [d for d in dirs if disk and os.path.isdir(d)]
    # the disk blocks they hold (the tier's files are reserved up front, then filled)
    size = sum(os.lstat(os.path.join(top, f)).st_blocks * 512
               for d in kept for top, _, files in os.walk(d) for f in files)
    vouched = all(vouched_for(d) for d in kept)
    if args.prompts:
        done = 0
        if args.output and os.path.isfile(args.output):
            with open(args.output, "rb") as f:
                done = sum(1 for _ in f)
        said = f"generate.py: {stopped}; {done} results are in {args.output} (a rerun skips them)"
        what = f"{len(kept)} unfinished tasks kept their disk tiers"
    else:
        said = f"generate.py: {stopped} before the first step"
        if args.at:
            phase, position, n_prompt = args.at
            said = (f"generate.py: {stopped} at prefill {position} of {n_prompt} prompt tokens"
                    if phase == "prefill" else
                    f"generate.py: {stopped} while decoding, at position {position}")
        what = "the task kept its disk tier"
    if not kept:
        why = "" if disk else " (only --offload disk keeps a task to resume)"
        print_err(f"{said}; nothing was kept{why}")
        return
    resume = "resume" if vouched else "start over (no chunk was vouched for yet)"
    print_err(f"{said}; {what} ({size / 2**20:.1f} MiB) in {args.offload_dir}: run the same "
              f"command again to {resume}, or remove {'it' if len(kept) == 1 else 'them'} "
              f"(rm -r {' '.join(map(shlex.quote, kept))})")


def generate_main(args):
    """One prompt or a --prompts batch, as `python generate.py` runs it: the exit code."""
    # a file-size limit then fails a write (EFBIG), not the process
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    layout = None
    watch = CoreWatch()  # how busy other processes keep the cores, until the model is loaded
    try:
        launch.check(args.tp)  # a --tp the torchrun world refuses: before any file is made
        cfg, text = resolve(args)
        layout = launch.start(args.tp, args.device)  # one rank, or this rank of a torchrun world
        args.device = str(layout.device)
        # a replica's leader prints, traces and writes results
        speak = layout.is_leader

        def log(msg):
            if speak:
                print_err(msg)

        model_args = read_model_args(args.ckpt, args)
        check_shapes(args, model_args)
        speculation.check(args, model_args, batch=args.batch_size not in (None, 1))
        tokenizer = load_tokenizer(args.ckpt)
        if tokenizer is None:
            raise UsageError(f"--ckpt {args.ckpt}: has no tokenizer.model or tokenizer.json, so "
                             "text cannot be encoded")
        if args.chat:
            # a checkpoint without one is refused before any weight is loaded
            tokenizer.chat_template()
        if args.prompts and not holds_lines(args.prompts):
            launch.refuse(f"generate.py: --prompts {args.prompts} holds no task (every line is "
                          "blank); nothing to run", layout)
            return 0
        if not args.prompts:  # check the prompt before loading any weight
            prompt_ids = tokenizer.prompt_ids({"prompt": text}, args.chat, args.system)
            max_new = plan_lengths(args, len(prompt_ids), model_args)
            check_host_budget(args, cfg, model_args, len(prompt_ids) + max_new, layout)
        monitor = Monitor(args.trace if speak else None, log=log)  # a bad --trace: before any
        kv_store = open_kv_store(args, log)                          # store directory is made
        model = launch.load(args.ckpt, layout, args.device, DTYPES[args.dtype], rope_override(args),
                            quantize_mode(args))
        # a batch's tasks in flight share the model's forward passes (batcher.py); the ranks of a
        # tensor-parallel replica step together, one task at a time
        if args.batch_size is None:
            batched = args.prompts and layout.tp == 1 and args.speculate_k is None
            args.batch_size = DEFAULT_BATCH_SIZE if batched else 1
        draft = speculation.load_draft(args, args.device, DTYPES[args.dtype])
        guesser = speculation.factory(args, draft)
        set_threads(args, watch, log)  # other processes' load measured while the model loaded
        batcher = None
        if args.batch_size > 1:  # with --offload none on CPU the tasks' chunks share one arena
            cap = args.max_length or model.args.max_context
            arena = None if cfg.mode != "none" else make_arena(
                model, args.batch_size, args.chunk_size, cap, args.kv_dtype)
            batcher = Batcher(model, arena)
        if args.rope_scaling and layout.rank == 0:
            log(rope_override_note(model.args, read_model_args(args.ckpt)))
        fallbacks = int4_fallbacks(model)  # int4 layers no kernel takes: said once
        if fallbacks:
            log(fallbacks)
        # what a resumed manifest or a stored chunk must match: the weights' bytes and every setting
        # that changes the KV they make (only the disk tier and the KV store reuse KV, so only they
        # pay for hashing the weights)
        fingerprint = None
        if cfg.mode == "disk" or args.kv_store:
            fingerprint = run_fingerprint(args.ckpt, args)
        run_config = {
            "ckpt": args.ckpt, "dtype": args.dtype, "quantize": quantize_mode(args) or "none",
            "kv_dtype": args.kv_dtype, "chunk_size": args.chunk_size,
            "offload": cfg.mode, "window": cfg.window, "compress": cfg.compress,
            "max_context": model.args.max_context, "rope_scaling": model.args.rope_scaling or None,
            "rope_override": bool(args.rope_scaling),
            "tp": layout.tp, "replicas": layout.n_replicas,
            **{field: getattr(cfg, field) for field in SELECT_FIELDS}, "placement": cfg.placement,
            "speculate": args.speculate or (args.draft and f"draft:{args.speculate_k}"),
        }
    except (UsageError, CheckpointError, OffloadError, TaskDirError, ValueError) as e:
        launch.refuse(f"generate.py: error: {e}", layout)
        return 2

    def run_one(task, cfg, context=None, on_token=None, progress=None, deliver=None):
        """The task's result; deliver(result) first, before its disk tier goes (run_task)."""
        ids = tokenizer.prompt_ids(task, args.chat, args.system)
        ids = ids[-context:] if context else ids

        def warn(message):
            log(f"task {task['id']}: {message}" if args.prompts else message)

        def on_step(phase, logits, cache):
            step(task["id"], phase, cache, len(ids), progress)

        max_new = plan_lengths(args, len(ids), model_args, task.get("max_new_tokens"), warn=warn)
        sampling = Sampling(task.get("temperature", args.temperature), args.top_k, args.top_p,
                            task.get("seed", args.seed))
        monitor.task_started(task["id"], len(ids))
        args.started.add(task["id"])
        made = []

        def finished(new, stats):
            made.append(result_of(task, ids, new, stats, cfg, context))
            if deliver is not None:
                deliver(made[0])

        run_task(model, ids, max_new, chunk_size=args.chunk_size, cfg=cfg, sampling=sampling,
                 eos_ids=tokenizer.eos_ids, task_id=task["id"], on_token=on_token,
                 on_step=on_step, fingerprint=fingerprint, log=monitor.log, kv_store=kv_store,
                 kv_dtype=args.kv_dtype, layout=layout, batcher=batcher, speculation=guesser,
                 deliver=finished, keep_other_prompts=not args.prompts)
        return made[0]

    def result_of(task, ids, new, stats, cfg, context):
        # a collective: every rank of the replica reports its own bytes
        ranks = gather_stats(stats, layout)
        positions = len(ids) + len(new)
        monitor.selection_read_everything(task["id"], stats, cfg, positions,
                                          min(args.chunk_size, positions))
        if cfg.mode != "none":
            monitor.context_stayed_on_device(task["id"], stats, len(ids) + len(new),
                                             args.chunk_size, cfg.window, model_args.n_layers)
        result = {"id": task["id"], "prompt_ids": ids, "prompt_tokens": len(ids), "tokens": new,
                  "text": tokenizer.decode(new)}
        if context:
            result["fallback"] = {"context": context}
        result["config"] = run_config
        if layout.world > 1:
            result["group"] = layout.replica
        result["stats"] = {**stats, "ranks": ranks} if layout.tp > 1 and ranks else stats
        return result

    stop = threading.Event()  # a batch's Ctrl-C: its tasks in flight stop at their next step

    def step(task_id, phase, cache, n_prompt, progress):
        if stop.is_set():
            raise Interrupted  # in a task's thread; its directory is kept, as for any failure
        args.at = (phase, cache.length, n_prompt)
        monitor.step(task_id, phase, cache)
        if progress is not None and phase == "prefill":
            progress.update(cache.length, n_prompt)

    try:
        if args.prompts:
            try:
                rc = run_batch(args, cfg, monitor, run_one, layout, batcher, stop)
            except ValueError as e:
                log(f"generate.py: error: {e}")
                return 2
            finally:
                monitor.close()
                if batcher is not None:
                    batcher.close()
        elif layout.replica == 0:  # one prompt: the first replica runs it, the others idle
            rc = single(args, text, cfg, monitor, run_one, tokenizer, speak)
        else:
            rc = 0
    finally:
        launch.finish(layout)
    return rc


def same_file(a, b):
    """Whether paths a and b (either may be None) name one existing file."""
    return bool(a and b and os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b))


@contextlib.contextmanager
def to_stdout():
    """Writes to stdout: one that cannot take them (a full disk) is an OutputError naming it; a
    reader gone (BrokenPipeError) is main's."""
    try:
        yield
    except BrokenPipeError:
        raise
    except OSError as e:
        interrupt.closed_stdout_quietly()  # what is buffered cannot fail again at exit
        raise OutputError(f"cannot write the output to stdout ({e.strerror})") from None


def single(args, text, cfg, monitor, run_one, tokenizer, speak=True):
    """One prompt: stream the text (or print one JSON object), then the statistics line on
    stderr."""
    # a character split over tokens waits for them
    text_stream = TextStream(tokenizer.decode, tokenizer.is_byte)
    last = [None]  # the tokens of the latest call

    def stream(out, final=False):
        last[0] = out
        with to_stdout():
            sys.stdout.write(text_stream.update(out, final))
            sys.stdout.flush()

    show_text = speak and not args.json
    if show_text and args.echo:
        sys.stdout.write(text)
    progress = Progress(enabled=show_text)  # prefill progress on stderr, when it is a terminal

    delivered = []

    def deliver(result):
        """The output, flushed, before the task's disk tier goes (run_task): stdout on a full disk
        fails here, and the tier stays for the rerun."""
        if last[0] is not None:  # what waited for bytes that never came is printed as it is
            stream(last[0], final=True)
        with to_stdout():
            if speak and args.json:
                print(json.dumps(result, ensure_ascii=False))
            elif speak:
                print()  # the text ends its line (or stands for none); stderr's sentence its own
            sys.stdout.flush()
        delivered.append(result)

    try:
        result = run_one({"id": "0", "prompt": text}, cfg, on_token=stream if show_text else None,
                         progress=progress, deliver=deliver)
    except TaskDirError as e:  # its directory cannot be used: refused before any work
        print_err(f"generate.py: error: {e}")
        return 2
    except BrokenPipeError:  # stdout's reader is gone: main says so
        raise
    except (UsageError, OffloadError, OutputError, OSError, PolicyError) as e:
        task_dir = os.path.join(args.offload_dir, safe_task_name("0"))
        kept = ""
        if cfg.mode == "disk" and os.path.isdir(task_dir):
            kept = f" ({task_dir} is kept: the same command again resumes from it)"
        said = str(e)
        if isinstance(e, OSError) and e.errno in DISK_FULL and cfg.mode == "disk":
            if task_dir not in said:  # the tier's own write: say where
                said = f"the disk tier in {task_dir} cannot be written ({e.strerror})"
            said += "; free space there, or run on host memory (--offload cpu)"
        print_err(f"generate.py: error: {said}{kept}")
        return 1
    finally:
        progress.close()
        monitor.close()
        if not delivered:  # the run failed: what it streamed ends its line
            try:
                if last[0] is not None:
                    stream(last[0], final=True)
                if text_stream.shown or (show_text and args.echo):
                    print(flush=True)
            except (OSError, OutputError):
                pass  # stdout itself failed: the error says so
    if speak:
        stats_line = progress_line(result["stats"], result["prompt_tokens"], len(result["tokens"]))
        print(stats_line, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
