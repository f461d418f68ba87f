"""
The flags and checks bench.py and probe.py share: the model to measure (a checkpoint, or a random
one of a given shape), its contexts and modes, refused before any weight is loaded.
"""
import os

from measure.random_model import PRESETS, build_random_checkpoint, parse_model_spec
from private import output_problem
from rope import context_refusal
from runs.flags import (
    DEMO_CKPT,
    DTYPES,
    MODE_SPECS,
    UsageError,
    add_common_flags,
    check_ckpt_dir,
    check_common,
    check_shapes,
    print_err,
    read_model_args,
)

DEFAULT_CONTEXTS = "1024,4096,8192"


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
    p.add_argument("--contexts",
                   help=f"prompt lengths, comma separated (default {DEFAULT_CONTEXTS}, cut to fit "
                   "the model's context with --new-tokens)")
    p.add_argument("--modes", default="none,cpu,disk,disk+zstd",
                   help=f"comma list of {list(MODE_SPECS)} (default all)")
    p.add_argument("--new-tokens", type=int, default=32,
                   help="greedy tokens generated per run (default %(default)s)")
    p.add_argument("--json", metavar="OUT", help="also write the numbers to this JSON file")


def check_measure(args, verb):
    """The checks behind add_measure_flags (--new-tokens aside: each script checks it with
    --repeats), before any heavy work. Returns (contexts, modes)."""
    args.contexts_given = args.contexts is not None
    if args.contexts is None:
        args.contexts = DEFAULT_CONTEXTS
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
    problem = args.json and output_problem(args.json)
    if problem:
        raise UsageError(f"--json {args.json} {problem}")
    if args.random_model:
        try:
            args.sizes = parse_model_spec(args.random_model, args.layers)
        except ValueError as e:
            raise UsageError(str(e)) from None
        if args.ckpt and os.path.exists(args.ckpt) and os.listdir(args.ckpt):
            raise UsageError(f"--ckpt {args.ckpt} is not empty: with --random-model it names where "
                             "to write the new model; give a new directory, or drop --random-model "
                             f"to {verb} the model already there")
    else:
        check_ckpt_dir(args.ckpt or DEMO_CKPT)
    return contexts, modes


def measured_model_args(args, contexts, scratch=None):
    """The model bench.py or probe.py measures: --random-model written into --ckpt or scratch (a
    temporary directory the caller made and removes), else --ckpt, else the demo model; sets
    args.ckpt. Returns (its ModelArgs with the --rope-scaling override, the contexts: the default
    ones cut to fit it), refused in one UsageError when --quantize or --kv-dtype cannot take its
    shapes or given contexts exceed it, before any weight is read."""
    if args.random_model:
        dtype = DTYPES[args.dtype]
        args.ckpt = build_random_checkpoint(args.sizes, args.ckpt or scratch, dtype, args.device)
    args.ckpt = args.ckpt or DEMO_CKPT
    model_args = read_model_args(args.ckpt, args)
    check_shapes(args, model_args)
    contexts = fitted_contexts(contexts, args.contexts_given, args.new_tokens, model_args,
                               "--contexts")
    return model_args, contexts


def fitted_contexts(contexts, given, new_tokens, model_args, flag, log=print_err):
    """The prompt lengths to measure: those given, refused past the model's context (a smaller one,
    or RoPE stretched); the defaults cut to fit it, said once in `log`."""
    room = model_args.max_context - new_tokens
    if max(contexts) <= room:
        return contexts
    longest = max(contexts) + new_tokens
    if given or room < 1:
        fits = f"at most {room} fit with them, so give a smaller {flag}; " if room >= 1 else ""
        raise UsageError(f"{flag} {max(contexts)} plus --new-tokens {new_tokens}: {fits}"
                         + context_refusal(longest, model_args))
    fitted = sorted({min(c, room) for c in contexts})
    log(f"{flag} {','.join(map(str, fitted))}: the default {','.join(map(str, contexts))} cut to "
        f"the model's context of {model_args.max_context} positions, less --new-tokens "
        f"{new_tokens}; give {flag} to choose")
    return fitted
