"""
The command line: the flags, checks and defaults that the scripts share (generate.py, verify.py,
bench.py, probe.py, tune.py, doctor.py), and the main() that `python generate.py` runs (one prompt,
or a --prompts batch through batch.py).

    python generate.py --ckpt DIR --prompt-file doc.txt --max-new-tokens 256 \
        --chunk-size 512 --window 4 --offload disk

Without --ckpt it runs a short demo on the small model shipped in assets/ (disk tier, a window
smaller than the context). Every check happens before any weight is loaded; a bad flag is one line
on stderr and exit code 2.
"""
import argparse
import json
import os
import signal
import sys

import torch

import launch
import taskdir
from batch import run_batch
from checkpoint import CheckpointError, read_json
from generate import Sampling
from kvlayout import KV_DTYPES, chunk_layout
from kvstore import KVStore, StoreError
from model import ModelArgs
from monitor import Monitor, progress_line
from offload import COMPRESSIONS, MODES, OffloadConfig
from pools import OffloadError
from progress import Progress
from quantize import (
    INT4_DEFAULT_GROUP_SIZE,
    INT4_GROUP_SIZES,
    check_int4_shapes,
    int4_fallbacks,
    int4_kernel_status,
    kernel_status,
)
from random_model import PRESETS, parse_model_spec
from rope import ROPE_OVERRIDES, context_refusal, rope_override_note
from task import run_task
from taskdir import TaskDirError, model_fingerprint
from tokenizer import load_tokenizer
from tp import gather_stats

DEMO_CKPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "tinyllama-pydoc")
DEMO_PROMPT = ("A module is a file containing Python definitions and statements. The file name is "
               "the module name with the suffix .py appended. Within a module, the module's name "
               "is available as the value of the global variable __name__.")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# a --modes name -> (--offload, --compress)
MODE_SPECS = {
    "none": ("none", "none"),
    "cpu": ("cpu", "none"),
    "disk": ("disk", "none"),
    "disk+zstd": ("disk", "zstd"),
}
DEFAULT_OFFLOAD_DIR = "./kv_cache_offload"
CKPT_HELP = "Hugging Face checkpoint directory (default: the demo model in assets/)"


class UsageError(ValueError):
    """Bad input from the user: reported as one line, exit code 2."""


# -----------------------------------------------------------------------------
# flags and checks shared by every script

def add_common_flags(p, chunk_size, window, ckpt_help=CKPT_HELP):
    """The flags every script takes; chunk_size and window are its defaults (None: set later)."""
    cuda = torch.cuda.is_available()
    kind = "cuda" if cuda else "cpu"
    p.add_argument("--ckpt", help=ckpt_help)
    p.add_argument("--chunk-size", type=int, default=chunk_size,
                   help=f"positions per KV chunk, the unit of transfer (default {chunk_size})")
    p.add_argument("--window", type=int, default=window,
                   help=f"sealed chunks per layer kept on the device (default {window})")
    p.add_argument("--offload-dir", default=DEFAULT_OFFLOAD_DIR,
                   help="disk tier root; each task uses DIR/task_<id>/, removed when the task "
                   "succeeds (default %(default)s, removed too if left empty)")
    p.add_argument("--cpu-budget", type=float,
                   help="GiB of host memory for offloaded chunks: with --offload cpu the host "
                   "tier's size (default: all the task needs); with --offload disk a host tier "
                   "in front of the disk, filled first (default 0; resume covers the disk chunks "
                   "only)")
    p.add_argument("--staging-slots", type=int, default=OffloadConfig.staging_slots,
                   help="chunks prefetched ahead of attention, device buffers (used on CUDA, and "
                   "with --compress zstd) (default %(default)s)")
    p.add_argument("--device", default="cuda" if cuda else "cpu",
                   help="cpu or cuda (default %(default)s)")
    p.add_argument("--dtype", choices=DTYPES,
                   help="compute and KV dtype (default fp32; bf16 with --quantize int8 or int4, "
                   "the fastest here: the CPU kernels take bf16 activations)")
    p.add_argument("--quantize", choices=("none", "int8", "int4"), default="none",
                   help="weight-only int8 (a scale per output channel) or int4 (groups of "
                   "--group-size input features) for every linear layer, quantized while loading "
                   "(lossy; offload stays bit-identical). " + kernel_status(kind) + ". "
                   + int4_kernel_status(kind))
    p.add_argument("--group-size", type=int, choices=INT4_GROUP_SIZES,
                   help="with --quantize int4: input features per scale and zero (default "
                   f"{INT4_DEFAULT_GROUP_SIZE}; it must divide every layer's input features)")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="auto",
                   help="how the KV cache is held: auto = as --dtype; int8 = quantized per token "
                   "and kv head, about half of bf16's bytes in every tier and link; int4 = keys "
                   "per channel within a chunk, values per token, about a quarter (lossy; offload "
                   "stays bit-identical to --offload none with the same --kv-dtype)")
    p.add_argument("--threads", type=int,
                   help="CPU threads for torch (default: torch's choice; on a busy machine 1 "
                   "avoids OpenMP threads stalling while another process holds a core)")
    p.add_argument("--rope-scaling", choices=ROPE_OVERRIDES,
                   help="stretch RoPE past the trained context, replacing config.json's scaling "
                   "for this run (quality past the trained length is not guaranteed)")
    p.add_argument("--rope-factor", type=float, metavar="F",
                   help="with --rope-scaling: the stretch; the model's maximum context becomes F x "
                   "--rope-orig-ctx")
    p.add_argument("--rope-orig-ctx", type=int, metavar="N",
                   help="with --rope-scaling: the trained context it stretches (default: the "
                   "checkpoint's max_position_embeddings)")
    p.add_argument("--tp", type=int, metavar="N",
                   help="under torchrun: ranks that share one model (tensor parallel); the world "
                   "splits into world/N replicas that split a --prompts batch (default: all)")
    p.add_argument("--kv-store", metavar="DIR",
                   help="a persistent prompt cache: reuse the KV of a prompt's stored full chunks "
                   "(a document asked again), store the ones computed; output stays bit-identical")
    p.add_argument("--kv-store-budget", type=float, metavar="GIB",
                   help="with --kv-store: evict least recently used entries to stay under this "
                   "size (default: no limit)")


def check_common(args, needs_disk):
    """The checks behind add_common_flags, in one place. needs_disk: the run writes the disk."""
    # one rule for every script: what runs fastest with the weights as they are held
    if args.dtype is None:
        args.dtype = "bf16" if args.quantize != "none" else "fp32"
    if args.group_size is not None and args.quantize != "int4":
        raise UsageError("--group-size goes with --quantize int4")
    if args.quantize == "int4" and args.group_size is None:
        args.group_size = INT4_DEFAULT_GROUP_SIZE
    checks = [
        (args.chunk_size is None or args.chunk_size > 0,
         f"--chunk-size must be a positive number of positions, got {args.chunk_size}"),
        (args.window is None or args.window >= 0,
         f"--window must be >= 0, got {args.window}"),
        (args.cpu_budget is None or args.cpu_budget >= 0,
         f"--cpu-budget must be >= 0 GiB, got {args.cpu_budget}"),
        (args.threads is None or args.threads >= 1,
         f"--threads must be >= 1, got {args.threads}"),
        (args.staging_slots >= 1,
         f"--staging-slots must be >= 1, got {args.staging_slots}"),
        (not args.device.startswith("cuda") or torch.cuda.is_available(),
         f"--device {args.device}: CUDA is not available here; use --device cpu"),
        (args.kv_store_budget is None or (args.kv_store and args.kv_store_budget > 0),
         "--kv-store-budget goes with --kv-store DIR and must be > 0 GiB"),
        ((args.rope_factor is None and args.rope_orig_ctx is None) or args.rope_scaling,
         "--rope-factor and --rope-orig-ctx go with --rope-scaling {linear,yarn,llama3}"),
        (not args.rope_scaling or (args.rope_factor or 0) > 1,
         "--rope-scaling needs --rope-factor F with F > 1"),
        (args.rope_orig_ctx is None or args.rope_orig_ctx > 0,
         "--rope-orig-ctx must be a positive number of positions"),
    ]
    for ok, msg in checks:
        if not ok:
            raise UsageError(msg)
    if needs_disk:
        args.created_offload_dir = check_writable_dir(args.offload_dir)


def open_kv_store(args):
    """--kv-store DIR as a kvstore.KVStore (None without the flag); a bad one is a UsageError."""
    if not args.kv_store:
        return None
    try:
        return KVStore(args.kv_store, budget_gib=args.kv_store_budget)
    except StoreError as e:
        raise UsageError(f"--kv-store {e}") from None


def check_writable_dir(path):
    """Create `path` (owner-only) if needed and check it is writable; True if created here."""
    created = not os.path.exists(path)
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        probe = os.path.join(path, f".probe-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        raise UsageError(f"--offload-dir {path}: cannot create or write it ({e.strerror or e}); "
                         "choose a writable directory") from None
    return created


def remove_if_empty(path):
    """After a successful run, the offload dir this run created is removed again if it is empty."""
    try:
        os.rmdir(path)
    except OSError:
        pass


def read_model_args(ckpt, args=None):
    """The checkpoint's ModelArgs, with the --rope-scaling override of `args` if it has one."""
    path = os.path.join(ckpt, "config.json")
    model_args = ModelArgs.from_config(read_json(path), path)
    if args and args.rope_scaling:
        return model_args.with_rope_override(*rope_override(args))
    return model_args


def rope_override(args):
    """Transformer.from_pretrained's rope_override: (kind, factor, orig ctx or None), or None."""
    if not args.rope_scaling:
        return None
    return args.rope_scaling, args.rope_factor, args.rope_orig_ctx


def quantize_mode(args):
    """from_pretrained's quantize: None, "int8" or "int4-g<group size>"."""
    if args.quantize == "int4":
        return f"int4-g{args.group_size}"
    return None if args.quantize == "none" else args.quantize


def run_fingerprint(ckpt, args):
    """Everything that shapes a task's KV besides the tokens: the weights' contents, the RoPE
    override, the quantization and the KV dtype (the dtype, chunk size and device are in the task
    itself): resume and the KV store never mix runs that differ in any of them."""
    kv_dtype = None if args.kv_dtype == "auto" else args.kv_dtype
    return taskdir.run_fingerprint(model_fingerprint(ckpt), dtype=args.dtype,
                                   rope=rope_override(args), quantize=quantize_mode(args),
                                   kv_dtype=kv_dtype)


def check_shapes(args, model_args):
    """What --quantize int4 and --kv-dtype refuse of the model's shapes, before any weight is read:
    a group size that does not divide a layer's input features, a head_dim the layout cannot
    pack."""
    try:
        if args.quantize == "int4":
            check_int4_shapes(model_args, args.group_size)
        layout = chunk_layout(args.kv_dtype, DTYPES[args.dtype])
        layout.shape(1, model_args.n_kv_heads, args.chunk_size or 1, model_args.head_dim)
    except ValueError as e:
        raise UsageError(str(e)) from None


def one_line_errors(p):
    """argparse's errors (an unknown flag, a bad choice) as ours: one line on stderr, exit 2."""
    def error(message):
        print(f"{p.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)
    p.error = error
    return p


# -----------------------------------------------------------------------------
# flags and checks shared by bench.py and probe.py: the model to measure, its contexts and modes

def add_measure_flags(p, verb):
    """The flags of a measurement: the model (a checkpoint, or a random one of a given shape), the
    prompt lengths, the offload modes and the tokens decoded per run. verb: what the script does."""
    ckpt_help = ("Hugging Face checkpoint directory (default: the demo model in assets/); "
                 "with --random-model, a new directory to write the random model to "
                 "(default: a temporary one)")
    # window 1: nearly all the context offloaded, the worst case
    add_common_flags(p, chunk_size=512, window=1, ckpt_help=ckpt_help)
    p.add_argument("--random-model", metavar="SPEC",
                   help=f"{verb} a random model: a preset {sorted(PRESETS)} and/or "
                   "dim=,layers=,heads=,kv_heads=,head_dim=,hidden=,vocab=")
    p.add_argument("--layers", type=int,
                   help="with --random-model: set the layer count (e.g. cut 7b-like to 4)")
    p.add_argument("--contexts", default="1024,4096,8192",
                   help="prompt lengths, comma separated (default 1024,4096,8192)")
    p.add_argument("--modes", default="none,cpu,disk,disk+zstd",
                   help=f"comma list of {list(MODE_SPECS)} (default all)")
    p.add_argument("--new-tokens", type=int, default=32,
                   help="greedy tokens generated per run (default 32)")
    p.add_argument("--json", metavar="OUT", help="also write the numbers to this JSON file")


def check_measure(args, verb):
    """The checks behind add_measure_flags (--new-tokens aside: each script checks it with
    --repeats), before any heavy work. Returns (contexts, modes)."""
    try:
        contexts = [int(c) for c in args.contexts.split(",") if c.strip()]
    except ValueError:
        raise UsageError("--contexts must be comma-separated integers, got "
                         f"{args.contexts!r}") from None
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not contexts or min(contexts) < 1:
        raise UsageError(f"--contexts must be positive token counts, got {args.contexts!r}")
    if not modes or any(m not in MODE_SPECS for m in modes):
        raise UsageError(f"--modes: {args.modes!r} is not a comma list of {list(MODE_SPECS)}")
    if args.layers is not None and (args.layers < 1 or not args.random_model):
        raise UsageError("--layers goes with --random-model and must be >= 1")
    check_common(args, needs_disk=True)  # the disk tier, the probe's scratch files
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        raise UsageError(f"--json {args.json}: its directory does not exist")
    if args.random_model:
        try:
            args.sizes = parse_model_spec(args.random_model, args.layers)
        except ValueError as e:
            raise UsageError(str(e)) from None
        if args.ckpt and os.path.exists(args.ckpt) and os.listdir(args.ckpt):
            raise UsageError(f"--ckpt {args.ckpt} is not empty: with --random-model it names where "
                             "to write the new model; give a new directory, or drop --random-model "
                             f"to {verb} the model already there")
    elif not os.path.isdir(args.ckpt or DEMO_CKPT):
        raise UsageError(f"--ckpt {args.ckpt or DEMO_CKPT}: no such directory")
    return contexts, modes


# -----------------------------------------------------------------------------
# generate.py's command line

def build_parser():
    p = argparse.ArgumentParser(prog="generate.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_flags(p, None, None)
    for action in p._actions:  # the demo and a real checkpoint differ in these defaults: say both
        if action.dest == "chunk_size":
            action.help = ("positions per KV chunk, the unit of transfer "
                           "(default 512; 16 in the demo)")
        elif action.dest == "window":
            action.help = "sealed chunks per layer kept on the device (default 4; 1 in the demo)"
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
                   help="tokens to generate (default 128; 64 in the demo); cut, with a warning, "
                   "where the model's context ends")
    n.add_argument("--max-length", type=int,
                   help="cap on prompt plus generated tokens (default: the model's maximum)")
    p.add_argument("--offload", choices=MODES,
                   help="where sealed chunks beyond the window go (default none; disk in the demo)")
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
    b = p.add_argument_group("batch (with --prompts)")
    b.add_argument("--output",
                   help="RESULTS.jsonl: one line per finished task; ids already there are skipped")
    b.add_argument("--concurrency", type=int, default=1, help="tasks run at once (default 1)")
    b.add_argument("--keep-cache", action="store_true",
                   help="keep a task's directory after it succeeds")
    b.add_argument("--fallback-cpu-budget", type=float,
                   help="if the disk tier fails (full, read-only, ...), rerun the task on a host "
                   "tier of this many GiB (output is identical); normal placement is unchanged")
    b.add_argument("--fallback-context", type=int,
                   help="if the disk tier fails, continue on the last N tokens")
    b.add_argument("--trace",
                   help="TRACE.jsonl: one event per step (memory, bytes per tier, chunks) and "
                   "alerts; appended to, each run starting with a {\"run_start\"} event")
    return p


def resolve(args):
    """Fill demo or plain defaults, check every flag, and return (offload config, prompt text).
    No heavy work."""
    demo = args.ckpt is None
    args.ckpt = args.ckpt or DEMO_CKPT
    if args.chunk_size is None:
        args.chunk_size = 16 if demo else 512
    if args.window is None:
        args.window = 1 if demo else 4
    args.offload = args.offload or ("disk" if demo else "none")
    if args.max_new_tokens is None and args.max_length is None:
        args.max_new_tokens = 64 if demo else 128
    if args.threads is None and demo:
        args.threads = 1
    checks = [
        (args.max_new_tokens is None or args.max_new_tokens > 0,
         f"--max-new-tokens must be >= 1, got {args.max_new_tokens}"),
        (args.max_length is None or args.max_length > 0,
         f"--max-length must be >= 1, got {args.max_length}"),
        (args.compress == "none" or args.offload == "disk",
         "--compress zstd applies to the disk tier; add --offload disk"),
        (args.temperature >= 0 and args.top_k >= 0 and 0 < args.top_p <= 1,
         "--temperature must be >= 0, --top-k >= 0 and --top-p in (0, 1]"),
        (os.path.isdir(args.ckpt),
         f"--ckpt {args.ckpt}: no such directory"),
        (not args.prompts or args.output,
         "--prompts needs --output RESULTS.jsonl"),
        (not args.output or args.prompts,
         "--output is for batch mode; add --prompts TASKS.jsonl"),
        (args.concurrency >= 1,
         f"--concurrency must be >= 1, got {args.concurrency}"),
        (args.fallback_context is None or args.fallback_context > 0,
         "--fallback-context must be >= 1"),
        (args.fallback_cpu_budget is None or args.fallback_cpu_budget > 0,
         "--fallback-cpu-budget must be > 0 GiB"),
        (args.system is None or args.chat,
         "--system goes with --chat; add --chat"),
    ]
    for ok, msg in checks:
        if not ok:
            raise UsageError(msg)
    check_common(args, needs_disk=args.offload == "disk")
    if args.prompt_file:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--prompt-file {args.prompt_file}: cannot be read ({e})") from None
    else:
        text = args.prompt if args.prompt is not None else DEMO_PROMPT
    cfg = OffloadConfig(mode=args.offload, window=args.window, cpu_budget_gib=args.cpu_budget,
                        offload_dir=args.offload_dir, compress=args.compress,
                        keep_files=args.keep_cache, staging_slots=args.staging_slots)
    return cfg, text


def plan_lengths(args, n_prompt, model_args, max_new_tokens=None, warn=None):
    """How many tokens to generate, checked against the model's maximum context; a cut is reported
    via warn."""
    limit = model_args.max_context
    if n_prompt == 0:
        raise UsageError("the prompt is empty; give --prompt or --prompt-file with some text")
    cap = args.max_length if args.max_length is not None else limit
    if cap > limit:
        raise UsageError(f"--max-length {cap} is past the model's maximum context of "
                         f"{limit} positions")
    # past the trained context: say how to go on, on purpose
    if n_prompt >= limit and args.max_length is None:
        raise UsageError(context_refusal(n_prompt + 1, model_args))
    if n_prompt >= cap:
        raise UsageError(f"the prompt has {n_prompt} tokens, at or past the maximum length "
                         f"{cap}; shorten it")
    asked = max_new_tokens or args.max_new_tokens
    if asked and asked > cap - n_prompt and warn:
        where = "--max-length" if args.max_length else "model's context"
        warn(f"warning: --max-new-tokens {asked} cut to {cap - n_prompt}: the prompt's {n_prompt} "
             f"tokens leave no more room in the {where} of {cap} positions")
    return min(asked or cap - n_prompt, cap - n_prompt)


def main(argv=None):
    args = build_parser().parse_args(argv)
    # a file-size limit then fails a write (EFBIG), not the process
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    layout = None
    try:
        cfg, text = resolve(args)
        layout = launch.start(args.tp, args.device)  # one rank, or this rank of a torchrun world
        args.device = str(layout.device)
        # a replica's leader prints, traces and writes results
        speak = layout.is_leader

        def log(msg):
            if speak:
                print(msg, file=sys.stderr, flush=True)

        model_args = read_model_args(args.ckpt, args)
        check_shapes(args, model_args)
        tokenizer = load_tokenizer(args.ckpt)
        if tokenizer is None:
            raise UsageError(f"--ckpt {args.ckpt}: has no tokenizer.model or tokenizer.json, so "
                             "text cannot be encoded")
        if args.chat:
            # a checkpoint without one is refused before any weight is loaded
            tokenizer.chat_template()
        if not args.prompts:  # check the prompt before loading any weight
            prompt_ids = tokenizer.prompt_ids({"prompt": text}, args.chat, args.system)
            plan_lengths(args, len(prompt_ids), model_args)
        if args.threads:
            torch.set_num_threads(args.threads)
        kv_store = open_kv_store(args)
        monitor = Monitor(args.trace if speak else None, log=log)
        model = launch.load(args.ckpt, layout, args.device, DTYPES[args.dtype], rope_override(args),
                            quantize_mode(args))
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
        }
    except (UsageError, CheckpointError, OffloadError, TaskDirError, ValueError) as e:
        rank = layout.rank if layout else int(os.environ.get("RANK", "0"))
        if rank == 0:  # one rank says it
            print(f"generate.py: error: {e}", file=sys.stderr)
        return 2

    def run_one(task, cfg, context=None, on_token=None, progress=None):
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
        new, stats = run_task(model, ids, max_new, chunk_size=args.chunk_size, cfg=cfg,
                              sampling=sampling, eos_ids=tokenizer.eos_ids, task_id=task["id"],
                              on_token=on_token, on_step=on_step, fingerprint=fingerprint,
                              log=monitor.log, kv_store=kv_store, kv_dtype=args.kv_dtype,
                              layout=layout)
        # a collective: every rank of the replica reports its own bytes
        ranks = gather_stats(stats, layout)
        if cfg.mode != "none":
            monitor.context_stayed_on_device(task["id"], stats, args.chunk_size, cfg.window)
        result = {"id": task["id"], "prompt_ids": ids, "prompt_tokens": len(ids), "tokens": new,
                  "text": tokenizer.decode(new)}
        if context:
            result["fallback"] = {"context": context}
        result["config"] = run_config
        if layout.world > 1:
            result["group"] = layout.replica
        result["stats"] = {**stats, "ranks": ranks} if layout.tp > 1 and ranks else stats
        return result

    def step(task_id, phase, cache, n_prompt, progress):
        monitor.step(task_id, phase, cache)
        if progress is not None and phase == "prefill":
            progress.update(cache.length, n_prompt)

    try:
        if args.prompts:
            try:
                rc = run_batch(args, cfg, monitor, run_one, layout)
            except ValueError as e:
                log(f"generate.py: error: {e}")
                return 2
            finally:
                monitor.close()
        elif layout.replica == 0:  # one prompt: the first replica runs it, the others idle
            rc = single(args, text, cfg, monitor, run_one, tokenizer, speak)
        else:
            rc = 0
    finally:
        launch.finish(layout)
    if rc == 0 and getattr(args, "created_offload_dir", False):
        remove_if_empty(args.offload_dir)
    return rc


def single(args, text, cfg, monitor, run_one, tokenizer, speak=True):
    """One prompt: stream the text (or print one JSON object), then the statistics line on
    stderr."""
    printed = [""]

    # decode everything so far and print what is new: tokens may merge into one character
    def stream(out):
        full = tokenizer.decode(out)
        sys.stdout.write(full[len(printed[0]):])
        sys.stdout.flush()
        printed[0] = full

    show_text = speak and not args.json
    if show_text:
        # a chat prompt is the template's business, not the page's
        sys.stdout.write(text if not args.chat else "")
    progress = Progress(enabled=show_text)  # prefill progress on stderr, when it is a terminal
    try:
        result = run_one({"id": "0", "prompt": text}, cfg, on_token=stream if show_text else None,
                         progress=progress)
    except (UsageError, OffloadError, TaskDirError, OSError) as e:
        print(f"\ngenerate.py: error: {e}", file=sys.stderr)
        return 1
    finally:
        progress.close()
        monitor.close()
    if speak:
        print(json.dumps(result, ensure_ascii=False) if args.json else "")
        stats_line = progress_line(result["stats"], result["prompt_tokens"], len(result["tokens"]))
        print(stats_line, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
