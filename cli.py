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
import math
import os
import signal
import sys

import torch

import launch
import taskdir
from batch import run_batch
from batcher import Batcher
from checkpoint import CheckpointError, read_config
from cores import CoreWatch
from generate import SEED_LIMIT, Sampling
from kvlayout import KV_DTYPES, chunk_layout
from kvstore import KVStore, StoreError
from model import ModelArgs
from monitor import Monitor, progress_line
from offload import COMPRESSIONS, MODES, OffloadConfig
from policy import SELECTIONS
from pools import OffloadError
from private import PrivateError, create_private, make_private_dir
from progress import Progress
from quantize import (
    INT4_DEFAULT_GROUP_SIZE,
    INT4_GROUP_SIZES,
    check_int4_shapes,
    int4_fallbacks,
    int4_kernel_status,
    kernel_status,
)
from random_model import PRESETS, build_random_checkpoint, parse_model_spec
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
DEFAULT_BATCH_SIZE = 4  # --prompts: tasks in flight, their decode steps batched
CKPT_HELP = "Hugging Face checkpoint directory (default: the demo model in assets/)"
# generate.py's defaults that differ between the demo (no --ckpt) and a checkpoint of your own
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
                   "device", "threads"),
    "offload": ("offload", "chunk_size", "window", "offload_dir", "cpu_budget", "compress",
                "kv_dtype", "staging_slots", "kv_store", "kv_store_budget", "select",
                "select_budget", "select_dense"),
    "batch (with --prompts)": ("prompts", "output", "batch_size", "keep_cache",
                               "fallback_cpu_budget", "fallback_context"),
    "parallel (under torchrun)": ("tp",),
    "output": ("echo", "json", "trace"),
}


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
                   help=f"positions per KV chunk, the unit of transfer, cut to a task's length "
                   f"where longer (default {chunk_size})")
    p.add_argument("--window", type=int, default=window,
                   help=f"sealed chunks per layer kept on the device (default {window})")
    p.add_argument("--offload-dir", default=DEFAULT_OFFLOAD_DIR,
                   help="disk tier root, yours and open to nobody else (mode 700; made so when "
                   "created, refused otherwise); each task uses DIR/task_<id>/, removed when the "
                   "task succeeds (default %(default)s, removed too if left empty)")
    p.add_argument("--cpu-budget", type=float,
                   help="GiB of host memory for offloaded chunks: with --offload cpu the host "
                   "tier's size (default: all the task needs); with --offload disk a host tier "
                   "in front of the disk, filled first (default 0; resume covers the disk chunks "
                   "only). A batch's tasks in flight share it equally")
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
                   help="CPU threads for torch (default: OMP_NUM_THREADS if set, else the cores "
                   "this process may use that other processes do not keep busy while the model "
                   "loads: a thread sharing a busy core would hold up every operation)")
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
    p.add_argument("--select", choices=SELECTIONS, default="all",
                   help="which sealed chunks a decode step reads (policy.py): all (exact, the "
                   "default); quest (the chunks whose key digests allow the highest scores for "
                   "the step's queries, up to --select-budget); oracle (the true top chunks by "
                   "attention mass: reads everything, for evaluation); sink (the first chunk and "
                   "the window). Prefill and the first --select-dense layers stay exact; every "
                   "--offload mode stays bit-identical to --offload none with the same --select")
    p.add_argument("--select-budget", type=int, metavar="TOKENS",
                   help="with --select quest or oracle: tokens of sealed chunks a decode step "
                   "reads besides the window and the open chunk, the first chunk included (at "
                   "least one chunk)")
    p.add_argument("--select-dense", type=int, metavar="N",
                   help="with --select: the first N layers read every chunk (default: Quest's 2 "
                   "of 32 layers, scaled to the model: max(1, round(layers / 16)))")


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
        (args.cpu_budget is None or (math.isfinite(args.cpu_budget) and args.cpu_budget >= 0),
         f"--cpu-budget must be a number >= 0 GiB, got {args.cpu_budget}"),
        (args.threads is None or args.threads >= 1,
         f"--threads must be >= 1, got {args.threads}"),
        (args.staging_slots >= 1,
         f"--staging-slots must be >= 1, got {args.staging_slots}"),
        (not args.device.startswith("cuda") or torch.cuda.is_available(),
         f"--device {args.device}: CUDA is not available here; use --device cpu"),
        (args.kv_store_budget is None
         or (args.kv_store and math.isfinite(args.kv_store_budget) and args.kv_store_budget > 0),
         "--kv-store-budget goes with --kv-store DIR and must be a number > 0 GiB"),
        ((args.rope_factor is None and args.rope_orig_ctx is None) or args.rope_scaling,
         "--rope-factor and --rope-orig-ctx go with --rope-scaling {linear,yarn,llama3}"),
        (not args.rope_scaling or (args.rope_factor is not None
                                   and math.isfinite(args.rope_factor) and args.rope_factor > 1),
         "--rope-scaling needs --rope-factor F with F a number > 1"),
        (args.rope_orig_ctx is None or args.rope_orig_ctx > 0,
         "--rope-orig-ctx must be a positive number of positions"),
        (args.select in ("quest", "oracle") or args.select_budget is None,
         "--select-budget goes with --select quest or --select oracle"),
        (args.select not in ("quest", "oracle") or args.select_budget is not None,
         f"--select {args.select} needs --select-budget TOKENS (at least one chunk)"),
        (args.select_budget is None or args.chunk_size is None
         or args.select_budget >= args.chunk_size,
         f"--select-budget {args.select_budget} is below one chunk of {args.chunk_size} "
         "positions; give at least --chunk-size tokens"),
        (args.select_dense is None or (args.select != "all" and args.select_dense >= 0),
         "--select-dense N (N >= 0) goes with --select sink, quest or oracle"),
    ]
    for ok, msg in checks:
        if not ok:
            raise UsageError(msg)
    if needs_disk:
        args.created_offload_dir = check_writable_dir(args.offload_dir)


def set_threads(args, watch=None, log=None):
    """The run's CPU thread count, set once before its first forward pass and kept: --threads,
    else OMP_NUM_THREADS (torch reads it itself), else the cores this process may use less those
    other processes keep busy (cores.py; watch: a CoreWatch started as the run began)."""
    if args.threads:
        torch.set_num_threads(args.threads)
        return
    if "OMP_NUM_THREADS" in os.environ or args.device.startswith("cuda"):
        return
    threads, why = (watch or CoreWatch()).threads()
    torch.set_num_threads(threads)
    if why:
        (log or print_err)(why)


def print_err(message):
    print(message, file=sys.stderr, flush=True)


def select_fields(args):
    """OffloadConfig's selection fields, from --select, --select-budget and --select-dense."""
    return {"select": args.select, "select_budget": args.select_budget,
            "select_dense": args.select_dense}


def open_kv_store(args, log=None):
    """--kv-store DIR as a kvstore.KVStore (None without the flag); a bad one is a UsageError.
    log: where the store reports each entry it rejects (default stderr)."""
    if not args.kv_store:
        return None
    try:
        return KVStore(args.kv_store, budget_gib=args.kv_store_budget, log=log)
    except StoreError as e:
        raise UsageError(str(e)) from None


def check_writable_dir(path):
    """Create `path` if needed, check it is private (private.make_private_dir: yours, mode 700, not
    a link) and writable; True if created here."""
    try:
        created = make_private_dir(path, "--offload-dir")
        fd, probe = create_private(path, ".probe-")
        os.close(fd)
        os.remove(probe)
    except PrivateError as e:
        raise UsageError(str(e)) from None
    except OSError as e:
        raise UsageError(f"--offload-dir {path}: cannot create or write it ({e.strerror or e}); "
                         "choose a writable directory") from None
    return created


def remove_if_empty(path):
    """Remove the directory `path` if it is empty; leave it otherwise."""
    try:
        os.rmdir(path)
    except OSError:
        pass


def remove_created_offload_dir(args):
    """On every exit of a script: the --offload-dir that check_common created for this run is
    removed again if the run left it empty (a failed task's directory keeps it, for resume)."""
    if getattr(args, "created_offload_dir", False):
        remove_if_empty(args.offload_dir)


def read_model_args(ckpt, args=None):
    """The checkpoint's ModelArgs, with the --rope-scaling override of `args` if it has one."""
    # checked against the weights' headers (checkpoint.read_config)
    model_args = ModelArgs.from_config(*read_config(ckpt))
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
                   help="prompt lengths, comma separated (default %(default)s)")
    p.add_argument("--modes", default="none,cpu,disk,disk+zstd",
                   help=f"comma list of {list(MODE_SPECS)} (default all)")
    p.add_argument("--new-tokens", type=int, default=32,
                   help="greedy tokens generated per run (default %(default)s)")
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


def measured_model_args(args, contexts, scratch=None):
    """The model bench.py or probe.py measures: --random-model written into --ckpt or scratch (a
    temporary directory the caller made and removes), else --ckpt, else the demo model; sets
    args.ckpt. Returns its ModelArgs (with the --rope-scaling override), refused in one UsageError
    when --quantize or --kv-dtype cannot take its shapes or the contexts exceed it, before any
    weight is read."""
    if args.random_model:
        dtype = DTYPES[args.dtype]
        args.ckpt = build_random_checkpoint(args.sizes, args.ckpt or scratch, dtype, args.device)
    args.ckpt = args.ckpt or DEMO_CKPT
    model_args = read_model_args(args.ckpt, args)
    check_shapes(args, model_args)
    longest = max(contexts) + args.new_tokens
    if longest > model_args.max_context:
        raise UsageError(f"--contexts {max(contexts)} plus --new-tokens {args.new_tokens}: "
                         + context_refusal(longest, model_args))
    return model_args


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
                   help="if the disk tier fails (full, read-only, ...), rerun the task on a host "
                   "tier of this many GiB (output is identical); normal placement is unchanged")
    b.add_argument("--fallback-context", type=int,
                   help="if the disk tier fails, continue on the last N tokens")
    b.add_argument("--trace",
                   help="TRACE.jsonl: one event per step (memory, bytes per tier, chunks) and "
                   "alerts; appended to, each run starting with a {\"run_start\"} event")
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
        (math.isfinite(args.temperature) and args.temperature >= 0 and args.top_k >= 0
         and 0 < args.top_p <= 1,
         "--temperature must be a number >= 0, --top-k >= 0 and --top-p in (0, 1]"),
        (abs(args.seed) < SEED_LIMIT,
         f"--seed must be between -{SEED_LIMIT} and {SEED_LIMIT}, got {args.seed}"),
        (os.path.isdir(args.ckpt),
         f"--ckpt {args.ckpt}: no such directory"),
        (not args.prompts or args.output,
         "--prompts needs --output RESULTS.jsonl"),
        (not args.output or args.prompts,
         "--output is for batch mode; add --prompts TASKS.jsonl"),
        (args.batch_size is None or args.batch_size >= 1,
         f"--batch-size must be >= 1, got {args.batch_size}"),
        (args.batch_size is None or args.prompts,
         "--batch-size goes with --prompts TASKS.jsonl (a single --prompt is one task)"),
        (args.fallback_context is None or args.fallback_context > 0,
         "--fallback-context must be >= 1"),
        (args.fallback_cpu_budget is None
         or (math.isfinite(args.fallback_cpu_budget) and args.fallback_cpu_budget > 0),
         "--fallback-cpu-budget must be a number > 0 GiB"),
        (args.system is None or args.chat,
         "--system goes with --chat; add --chat"),
    ]
    for ok, msg in checks:
        if not ok:
            raise UsageError(msg)
    if args.prompt_file:  # read before check_common makes the offload dir: nothing to undo
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--prompt-file {args.prompt_file}: cannot be read ({e})") from None
    else:
        text = args.prompt if args.prompt is not None else DEMO_PROMPT
    check_common(args, needs_disk=args.offload == "disk")
    cfg = OffloadConfig(mode=args.offload, window=args.window, cpu_budget_gib=args.cpu_budget,
                        offload_dir=args.offload_dir, compress=args.compress,
                        keep_files=args.keep_cache, staging_slots=args.staging_slots,
                        **select_fields(args))
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
    try:
        return generate_main(args)
    finally:
        remove_created_offload_dir(args)


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
        kv_store = open_kv_store(args, log)
        monitor = Monitor(args.trace if speak else None, log=log)
        model = launch.load(args.ckpt, layout, args.device, DTYPES[args.dtype], rope_override(args),
                            quantize_mode(args))
        # a batch's tasks in flight share the model's forward passes (batcher.py); the ranks of a
        # tensor-parallel replica step together, one task at a time
        if args.batch_size is None:
            args.batch_size = DEFAULT_BATCH_SIZE if args.prompts and layout.tp == 1 else 1
        set_threads(args, watch, log)  # other processes' load measured while the model loaded
        batcher = Batcher(model) if args.batch_size > 1 else None
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
            "select": cfg.select, "select_budget": cfg.select_budget,
            "select_dense": cfg.select_dense,
        }
    except (UsageError, CheckpointError, OffloadError, TaskDirError, ValueError) as e:
        launch.refuse(f"generate.py: error: {e}", layout)
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
                              layout=layout, batcher=batcher)
        # a collective: every rank of the replica reports its own bytes
        ranks = gather_stats(stats, layout)
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

    def step(task_id, phase, cache, n_prompt, progress):
        monitor.step(task_id, phase, cache)
        if progress is not None and phase == "prefill":
            progress.update(cache.length, n_prompt)

    try:
        if args.prompts:
            try:
                rc = run_batch(args, cfg, monitor, run_one, layout, batcher)
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
    if show_text and args.echo:
        sys.stdout.write(text)
    progress = Progress(enabled=show_text)  # prefill progress on stderr, when it is a terminal
    try:
        result = run_one({"id": "0", "prompt": text}, cfg, on_token=stream if show_text else None,
                         progress=progress)
    except TaskDirError as e:  # its directory cannot be used: refused before any work
        print(f"\ngenerate.py: error: {e}", file=sys.stderr)
        return 2
    except (UsageError, OffloadError, OSError) as e:
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
