"""
--speculate lookup[:K] and --draft CKPT [--draft-tokens K]: the flags, their checks (before any
weight is loaded) and the guesser each task gets (speculate.py). The output never changes; what
may not be combined is refused in one sentence.
"""
import filecmp
import os

from checkpoint import CheckpointError
from model import Transformer
from runs.flags import UsageError, read_model_args
from speculate import K_MAX, LOOKUP_K, Draft, Lookup, parse_lookup

DRAFT_K = 4  # --draft-tokens' default: a draft's guesses cost a forward step each


def add_flags(g):
    """The flags, on a parser or an argument group."""
    g.add_argument("--speculate", metavar="lookup[:K]",
                   help="guess up to K next tokens (default %d) from the longest recent n-gram "
                   "of the prompt and the text so far, and check them in one step that reads "
                   "the KV once; every token and logit stays what plain decoding gives" % LOOKUP_K)
    g.add_argument("--draft", metavar="CKPT",
                   help="guess with a small model of the same vocabulary instead (its own cache, "
                   "on the device)")
    g.add_argument("--draft-tokens", type=int, metavar="K",
                   help=f"with --draft: guesses per verify step (default {DRAFT_K})")


def check(args, model_args, batch=False):
    """The flags' checks, before any weight: refusals are UsageErrors. Sets args.speculate_k."""
    args.speculate_k = None
    if args.speculate is None and args.draft is None:
        if args.draft_tokens is not None:
            raise UsageError("--draft-tokens goes with --draft CKPT")
        return
    if args.speculate is not None and args.draft is not None:
        raise UsageError("--speculate and --draft are two guessers; give one of them")
    if args.speculate is not None:
        k = parse_lookup(args.speculate)
        if k is None or not 1 <= k <= K_MAX:
            raise UsageError(f"--speculate must be lookup or lookup:K with K from 1 to {K_MAX}, "
                             f"got {args.speculate!r}")
    else:
        k = DRAFT_K if args.draft_tokens is None else args.draft_tokens
        if not 1 <= k <= K_MAX:
            raise UsageError(f"--draft-tokens must be from 1 to {K_MAX}, got {k}")
        check_draft(args.draft, args.ckpt, model_args)
    args.speculate_k = k
    flag = "--speculate" if args.speculate is not None else "--draft"
    if getattr(args, "select", "all") != "all":
        raise UsageError(f"{flag} checks its guesses on every chunk, and what a step of several "
                         "positions would select is not proven; drop --select or " + flag)
    if (getattr(args, "tp", None) or 1) > 1:
        raise UsageError(f"{flag} runs on one process; drop --tp or {flag}")
    if batch:
        raise UsageError(f"{flag} runs one task at a time; add --batch-size 1")


def check_draft(draft, ckpt, model_args):
    """A draft must share the model's vocabulary: the same size and the same tokenizer files."""
    if not os.path.isdir(draft):
        what = "is not a directory" if os.path.exists(draft) else "no such directory"
        raise UsageError(f"--draft {draft}: {what}; give the draft checkpoint's directory")
    try:
        draft_args = read_model_args(draft)
    except CheckpointError as e:
        raise UsageError(f"--draft {draft}: {e}") from None
    if draft_args.vocab_size != model_args.vocab_size:
        raise UsageError(f"--draft {draft}: its vocabulary has {draft_args.vocab_size} tokens, the "
                         f"model's {model_args.vocab_size}; a draft must share the model's "
                         "tokenizer")
    for name in ("tokenizer.model", "tokenizer.json"):
        a, b = os.path.join(draft, name), os.path.join(ckpt, name)
        if os.path.exists(a) != os.path.exists(b):
            missing = draft if os.path.exists(b) else ckpt
            raise UsageError(f"--draft {draft}: {name} is in one checkpoint and not in the other "
                             f"({missing} lacks it); copy the model's tokenizer files to the draft")
        if os.path.exists(a) and not filecmp.cmp(a, b, shallow=False):
            raise UsageError(f"--draft {draft}: its {name} is not the model's; a draft must share "
                             "the model's tokenizer")


def load_draft(args, device, dtype):
    """The draft model, or None without --draft."""
    if args.draft is None:
        return None
    return Transformer.from_pretrained(args.draft, device=device, dtype=dtype)


def factory(args, draft_model=None):
    """What run_task calls for each task's guesser: f(chunk_size, max_length), or None."""
    if args.speculate_k is None:
        return None
    k = args.speculate_k
    if draft_model is None:
        def lookup(chunk_size, max_length):
            return Lookup(k)
        return lookup

    def draft(chunk_size, max_length):
        return Draft(draft_model, k, chunk_size, max_length)
    return draft
