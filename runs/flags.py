"""
The flags, checks and defaults every command shares (generate.py, verify.py, chat.py, bench.py,
probe.py, tune.py, doctor.py): the checkpoint and its dtype, the offload and its tiers, threads,
the KV store. Every check happens before any weight is loaded; a bad flag is a UsageError: one
line on stderr and exit code 2.
"""
import math
import os
import re
import sys

import torch

import fewrows
from checkpoint import read_config
from kvlayout import KV_DTYPES, chunk_layout
from model import ModelArgs
from offload import OffloadConfig
from policy import PLACEMENTS, SELECT_FIELDS, SELECTIONS, budgeted, summary
from private import PrivateError, create_private, make_private_dir
from quantize import (
    INT4_DEFAULT_GROUP_SIZE,
    INT4_GROUP_SIZES,
    check_int4_shapes,
    int4_kernel_status,
    kernel_status,
)
from rope import ROPE_OVERRIDES
from runs import taskdir
from runs.cores import CoreWatch
from runs.kvstore import KVStore, StoreError
from runs.taskdir import model_fingerprint

# the repository root, one folder up
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_CKPT = os.path.join(ROOT, "assets", "tinyllama-pydoc")
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
MAX_THREADS = 1024  # --threads: torch.set_num_threads segfaults at 100,000 (runs at 4,096)
CKPT_HELP = "Hugging Face checkpoint directory (default: the demo model in assets/)"
# generate.py's defaults that differ between the demo (no --ckpt) and a checkpoint of your own

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
    p.add_argument("--group-buffers", type=int, default=OffloadConfig.group_buffers,
                   help="CUDA with a host tier: device buffers of up to 16 chunks that a layer's "
                   "run of host-pool chunks crosses into as one copy, read there by one kernel "
                   "call; 0: chunk by chunk through the staging slots, for the least device "
                   "memory (default %(default)s: one crossing while attention reads the other)")
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
                   help="how the KV cache is held: auto = as --dtype; bf16, fp16 = in that half "
                   "precision under fp32 weights (half the bytes, as llama.cpp's default f16 KV; "
                   "fp16 clips past 65504); int8 = quantized per token "
                   "and kv head, about half of bf16's bytes in every tier and link; int4 = keys "
                   "per channel within a chunk, values per token, about a quarter (lossy; offload "
                   "stays bit-identical to --offload none with the same --kv-dtype)")
    p.add_argument("--attention", choices=("flash", "compiled", "auto"), default="flash",
                   help="the kernel of a decode step's visits to chunks on CPU: flash = torch's "
                   "fused kernel; compiled = one that inductor builds for a few query rows "
                   "(needs a C++ compiler, else flash with one line saying why; 3-6 seconds to "
                   "build as the cache is made, its C++ cached in ~/.cache/kvoffload/inductor); "
                   "auto = compiled for fp32 queries, and for bf16 ones on "
                   "a CPU with AVX512-BF16 (on AVX2 the fused kernel reads bf16 faster). On a "
                   "Zen 4, 6,400 positions: 15%% faster steps in fp32, 8-15%% in bf16, int8 and "
                   "int4, 2-3%% at 1,280 (docs/performance.md, round eighteen); on an Intel "
                   "Xeon with AMX within a few %% of flash either way (round twenty-eight), so "
                   "try it on your CPU for long contexts. Either way every "
                   "--offload mode is bit-identical to the others (default %(default)s)")
    p.add_argument("--products", choices=("library", "compiled"), default="library",
                   help="the linears of a decode step's few rows (up to 16) in bf16 or fp16 on "
                   "CPU: library = torch's products; compiled = one that inductor builds, each "
                   "output a dot product in fp32 (needs a C++ compiler; a few seconds as the "
                   "cache is made, cached like --attention compiled). On a Zen 4 one "
                   "sequence's decode read the weights about 1.5x faster (docs/performance.md, "
                   "round seventeen); on an Intel Xeon with AMX a 6K step is 1.6x slower "
                   "(round twenty-nine), and a batch of 16 tasks ran slower on the Zen 4: measure "
                   "it on your CPU (tools/profile_decode.py). fp32 keeps torch's. Every --offload "
                   "mode and batch stays bit-identical (default %(default)s)")
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
    p.add_argument("--select", choices=list(SELECTIONS), default="all",
                   help="which sealed chunks a decode step reads (policy.py): "
                   + "; ".join(f"{name}: {summary(cls)}" for name, cls in SELECTIONS.items())
                   + ". Prefill and the first --select-dense layers stay exact; every --offload "
                   "mode stays bit-identical to --offload none with the same --select")
    p.add_argument("--select-budget", type=int, metavar="TOKENS",
                   help=f"with --select {' or '.join(budgeted())}: tokens of sealed chunks a "
                   "decode step "
                   "reads besides the window and the open chunk, the first chunk included (at "
                   "least one chunk)")
    p.add_argument("--select-dense", type=int, metavar="N",
                   help="with --select: the first N layers read every chunk (default: Quest's 2 "
                   "of 32 layers, scaled to the model: max(1, round(layers / 16)))")
    p.add_argument("--placement", choices=list(PLACEMENTS), default="default",
                   help="where a chunk that leaves the device goes (policy.py): "
                   + "; ".join(f"{name}: {summary(cls)}" for name, cls in PLACEMENTS.items())
                   + ". Output is the same whichever")


def check_common(args, needs_disk):
    """The checks behind add_common_flags, in one place. needs_disk: the run writes the disk."""
    # one rule for every script: what runs fastest with the weights as they are held
    if args.dtype is None:
        args.dtype = "bf16" if args.quantize != "none" else "fp32"
    if args.group_size is not None and args.quantize != "int4":
        raise UsageError("--group-size goes with --quantize int4")
    if args.quantize == "int4" and args.group_size is None:
        args.group_size = INT4_DEFAULT_GROUP_SIZE
    fewrows.KERNEL = args.attention  # decided before any forward pass, kept for the run
    fewrows.PRODUCTS = args.products
    checks = [
        (args.chunk_size is None or args.chunk_size > 0,
         f"--chunk-size must be a positive number of positions, got {args.chunk_size}"),
        (args.window is None or args.window >= 0,
         f"--window must be >= 0, got {args.window}"),
        (args.cpu_budget is None or (math.isfinite(args.cpu_budget) and args.cpu_budget >= 0),
         f"--cpu-budget must be a number >= 0 GiB, got {args.cpu_budget}"),
        (args.threads is None or 1 <= args.threads <= MAX_THREADS,  # torch crashes far past it
         f"--threads must be from 1 to {MAX_THREADS}, got {args.threads}"),
        (args.staging_slots >= 1,
         f"--staging-slots must be >= 1, got {args.staging_slots}"),
        (args.group_buffers >= 0,
         f"--group-buffers must be >= 0, got {args.group_buffers}"),
        (args.products == "library" or args.quantize == "none",
         "--products compiled builds bf16 and fp16 products; with --quantize every linear is an "
         "int8 or int4 product it never runs: drop one of the two"),
        (re.fullmatch(r"cpu|cuda(:\d+)?", args.device),
         f"--device {args.device!r} is not a device this project runs on; give cpu, cuda or "
         "cuda:N"),
        (not args.device.startswith("cuda") or torch.cuda.is_available(),
         f"--device {args.device}: CUDA is not available here; use --device cpu"),
        (args.kv_store != "", "--kv-store is empty; give a directory"),
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
        (args.select in budgeted() or args.select_budget is None,
         f"--select-budget goes with --select {' or '.join(budgeted())}"),
        (args.select not in budgeted() or args.select_budget is not None,
         f"--select {args.select} needs --select-budget TOKENS (at least one chunk)"),
        (args.select_budget is None or args.chunk_size is None
         or args.select_budget >= args.chunk_size,
         f"--select-budget {args.select_budget} is below one chunk of {args.chunk_size} "
         "positions; give at least --chunk-size tokens"),
        (args.select_dense is None or args.select != "all",
         f"--select-dense N goes with --select {', '.join(list(SELECTIONS)[1:])}"),
        (args.select_dense is None or args.select_dense >= 0,
         f"--select-dense must be >= 0 layers, got {args.select_dense}"),
    ]
    for ok, msg in checks:
        if not ok:
            raise UsageError(msg)
    if needs_disk:
        check_offload_dir(args)


def check_offload_dir(args):
    """--offload-dir: made if needed, private and writable (check_writable_dir), or a UsageError."""
    args.created_offload_dir = check_writable_dir(args.offload_dir)
    # the default directory holding an earlier run's tasks (a resume): it goes again, as if this
    # run had made it, once it is left empty; one the user made, or named, stays
    args.emptied_default_dir = (not args.created_offload_dir
                                and args.offload_dir == DEFAULT_OFFLOAD_DIR
                                and bool(os.listdir(args.offload_dir)))


def set_threads(args, watch=None, log=None):
    """The run's CPU thread count, set once before its first forward pass and kept: --threads,
    else OMP_NUM_THREADS (torch reads it itself), else the cores this process may use less those
    other processes keep busy (cores.py; watch: a CoreWatch started as the run began)."""
    if args.threads:
        torch.set_num_threads(args.threads)
        return
    omp = os.environ.get("OMP_NUM_THREADS")
    if omp is not None and not (omp.strip().isdigit() and int(omp) >= 1):
        # libgomp ignores it with a warning, and torch then takes every core, busy or not
        raise UsageError(f"OMP_NUM_THREADS={omp!r} is not a thread count; set a whole number >= 1, "
                         "unset it, or give --threads N")
    if omp is not None or args.device.startswith("cuda"):
        return
    threads, why = (watch or CoreWatch()).threads()
    torch.set_num_threads(threads)
    if why:
        (log or print_err)(why)


def print_err(message):
    """One line on stderr, written in one call: lines of a batch's task threads never run
    together (print writes the text and its newline apart)."""
    sys.stderr.write(f"{message}\n")
    sys.stderr.flush()


def select_fields(args):
    """OffloadConfig's selection fields, from --select, --select-budget and --select-dense."""
    return {field: getattr(args, field) for field in SELECT_FIELDS}


def policy_fields(args):
    """OffloadConfig's fields that policy.py's classes decide: the selection's and --placement."""
    return {**select_fields(args), "placement": args.placement}


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
    a link) and writable. Returns the directories created here, `path` first, then the parents
    it needed, up to the first that was there (empty where none was made)."""
    if not path:
        raise UsageError("--offload-dir is empty; give a directory")
    made = []
    d = os.path.abspath(path)
    while not os.path.lexists(d):
        made.append(d)
        d = os.path.dirname(d)
    try:
        if not make_private_dir(path, "--offload-dir"):
            made = []  # another process made it first
        fd, probe = create_private(path, ".probe-")
        os.close(fd)
        os.remove(probe)
    except PrivateError as e:
        raise UsageError(str(e)) from None
    except OSError as e:
        raise UsageError(f"--offload-dir {path}: cannot create or write it ({e.strerror or e}); "
                         "choose a writable directory") from None
    return made


def check_ckpt_dir(path):
    """--ckpt must name a checkpoint's directory; a file in one (its config.json) says which."""
    if os.path.isdir(path):
        return
    if os.path.isfile(path):
        raise UsageError(f"--ckpt {path}: is a file; give the checkpoint's directory, the one "
                         f"holding config.json ({os.path.dirname(path) or '.'})")
    raise UsageError(f"--ckpt {path}: no such directory")


def remove_if_empty(path):
    """Remove the directory `path` if it is empty; leave it otherwise."""
    try:
        os.rmdir(path)
    except OSError:
        pass


def remove_created_offload_dir(args):
    """On every exit of a script: the --offload-dir that check_common created for this run, or the
    default one an earlier run left its tasks in, is removed again if the run left it empty (a
    failed task's directory keeps it, for resume)."""
    if getattr(args, "emptied_default_dir", False):
        remove_if_empty(args.offload_dir)
    for d in getattr(args, "created_offload_dir", None) or ():  # the directory, then its parents
        remove_if_empty(d)


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
    override, the quantization, the KV dtype and the decode kernels (the dtype, chunk size and
    device are in the task itself): resume and the KV store never mix runs that differ in any of
    them."""
    kv_dtype = None if args.kv_dtype == "auto" else args.kv_dtype
    return taskdir.run_fingerprint(model_fingerprint(ckpt), dtype=args.dtype,
                                   rope=rope_override(args), quantize=quantize_mode(args),
                                   kv_dtype=kv_dtype, **decode_kernels(args))


def decode_kernels(args):
    """The kernels of a decode step's few rows, which shape the KV of the positions they write:
    {"attention": ..., "products": ...}, None where the default (so fingerprints and saved sessions
    from before these flags still match)."""
    return {"attention": None if args.attention == "flash" else args.attention,
            "products": None if args.products == "library" else args.products}


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


def text_out():
    """stdout that cannot encode every character (PYTHONIOENCODING=ascii, a C locale without UTF-8
    mode) writes the others as escapes (\\u20ac: valid inside --json's strings too) rather than
    ending the run with a traceback midway through an answer. A closed stdout (>&-) is refused
    before any work (a traceback at the first token)."""
    if sys.stdout is None:
        print_err(f"{os.path.basename(sys.argv[0])}: error: stdout is closed; give the run one "
                  "(> FILE, or > /dev/null)")
        sys.exit(2)
    encoding = (getattr(sys.stdout, "encoding", None) or "").lower().replace("-", "")
    if encoding != "utf8" and hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="backslashreplace")


def one_line_errors(p):
    """argparse's errors (an unknown flag, a bad choice) as ours: one line on stderr, exit 2. And
    no abbreviated flags: argparse would read a flag this script lacks as one it has that starts
    the same (verify.py --prompt X as --prompt-file X), and name the wrong one in its error."""
    def error(message):
        print(f"{p.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)
    p.error = error
    p.allow_abbrev = False
    return p
