r"""
What reading fewer chunks costs in quality and saves in bytes and time: the evaluation behind
--select (policy.py), for any checkpoint. One table row per policy and budget:

    python tools/longeval.py --ckpt DIR --policies all,sink,quest:1024,quest:2048,oracle:1024 \
        --lengths 2048,4096 --depths 0,0.25,0.5,0.75,1 --doc-tokens 8192

- passkey: Quest's protocol. Filler text ("The grass is green. The sky is blue. ...") with "The
  pass key is N. Remember it. N is the pass key." at a depth of the context, asked at the end;
  a hit when the greedy answer holds N. Per length, hits over depths x --trials.
- top-1 and perplexity: a long document (--doc-file; default the pages of Python's reference
  manual, pydoc_data) prefilled to its last --eval-tokens tokens, which are then fed one at a time
  as decode steps, so the selection applies; top-1 agreement with --select all's next-token choice
  and the perplexity of the true next tokens, against exact's.
- KV read: MiB of sealed chunks attention read per decode step during that decode, and the share
  of what exact reads.
- decode tok/s: the same decode steps, through --offload (default disk), timed; with --repeats,
  the median of the policies' runs interleaved.
Prefill is exact under every selection, so each prompt is prefilled once and its full chunks are
shared by the policies through the KV store (kvstore.py; the adoption is bit-identical). Every
policy reads the same prompts and document. A policy that cannot do better than exact on top-1
(100%) or passkey shows it here; that is the point.
"""
import argparse
import math
import os
import pydoc_data.topics
import random
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from checkpoint import CheckpointError  # noqa: E402
from generate import decode_one_token, prefill  # noqa: E402
from kvcache import make_cache  # noqa: E402
from model import Transformer  # noqa: E402
from offload import OffloadConfig  # noqa: E402
from policy import SELECTIONS  # noqa: E402
from runs.kvstore import KVStore  # noqa: E402
from runs.task import PromptCache, run_task  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402

DEMO = os.path.join(ROOT, "assets", "tinyllama-pydoc")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
         "it. I will quiz you about the important information there.\n")
FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
          "again. ")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\nWhat is the pass key? The pass key is"


def refuse(message):
    """A wrong argument: one line on stderr, exit 2."""
    print(f"longeval.py: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def parse_policies(text, chunk_size):
    """'all,quest:1024' -> [('all', None), ('quest', 1024)]; a budget is whole tokens, at least
    one chunk (refused before the model loads, not after the first policies ran)."""
    out = []
    for item in text.split(","):
        name, _, budget = item.strip().partition(":")
        takes_budget = name in SELECTIONS and SELECTIONS[name].takes_budget
        if name not in SELECTIONS or takes_budget != bool(budget):
            spelled = [f"{n}:TOKENS" if c.takes_budget else n for n, c in SELECTIONS.items()]
            refuse(f"--policies: {item!r} is not one of {', '.join(spelled)}")
        if budget and not (budget.isdigit() and int(budget) >= chunk_size):
            refuse(f"--policies: {item!r}: the budget must be a whole number of tokens, at least "
                   f"one chunk ({chunk_size})")
        out.append((name, int(budget) if budget else None))
    return out


def label(policy):
    name, budget = policy
    return name if budget is None else f"{name}:{budget}"


def passkey_ids(tok, length, depth, key):
    """Token ids of a passkey prompt of about `length` tokens, the needle at `depth` (0: first,
    1: last) of the filler."""
    per_filler = len(tok.encode(FILLER * 20)) / 20
    fixed = len(tok.encode(INTRO + NEEDLE.format(key=key) + QUESTION))
    n = max(1, int((length - fixed) / per_filler))
    while True:
        at = round(n * depth)
        text = INTRO + FILLER * at + NEEDLE.format(key=key) + FILLER * (n - at) + QUESTION
        ids = tok.encode(text)
        if len(ids) <= length or n == 1:
            return ids
        n -= 1


def document_ids(tok, path, n_tokens):
    """The first n_tokens of --doc-file, or of the pages of Python's reference manual."""
    if path:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    else:
        topics = pydoc_data.topics.topics
        text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = tok.encode(text)
    if len(ids) < n_tokens:
        refuse(f"the document has {len(ids)} tokens, fewer than --doc-tokens {n_tokens}")
    return ids[:n_tokens]


def config(args, policy, tmp):
    name, budget = policy
    return OffloadConfig(mode=args.offload, window=args.window, offload_dir=tmp, select=name,
                         select_budget=budget, select_dense=args.dense)


def passkey(model, tok, args, policies, store, tmp):
    """{policy: {length: hits}} over depths x trials; the prompts are the same for every policy."""
    hits = {label(p): {n: 0 for n in args.lengths} for p in policies}
    rng = random.Random(0)
    for n in args.lengths:
        for depth in args.depths:
            for trial in range(args.trials):
                key = rng.randrange(10_000, 100_000)
                ids = passkey_ids(tok, n, depth, key)
                for p in policies:
                    new, _ = run_task(model, ids, 8, chunk_size=args.chunk_size,
                                      cfg=config(args, p, tmp), kv_store=store,
                                      fingerprint=args.fingerprint, task_id="passkey")
                    hits[label(p)][n] += str(key) in tok.decode(new)
    return hits


def teacher_forced(model, ids, args, policy, store, tmp):
    """The document's last --eval-tokens tokens fed as decode steps under `policy`: (logits
    [n, V] predicting each next token, MiB of sealed chunks read per decode step, decode s)."""
    C = args.chunk_size
    P = len(ids) - args.eval_tokens
    x = torch.tensor([ids], device=model.tok_embeddings.weight.device)
    cache = make_cache(model, config(args, policy, tmp), C, len(ids))
    adopted = PromptCache(store, cache, ids[:P], args.fingerprint, model)
    try:
        adopted.adopt(cache)  # the prompt's stored full chunks: prefill them once for all

        def store(phase, logits, cache):
            adopted.store_sealed(cache)
        logits = [prefill(model, cache, x[:, cache.length:P], on_step=store)]
        adopted.finish()
        read_before = cache.store.snapshot()["bytes"]["kv_read"]
        start = time.perf_counter()
        for t in range(P, len(ids) - 1):
            logits.append(decode_one_token(model, cache, x[:, t:t + 1]))
        seconds = time.perf_counter() - start
        read = cache.store.snapshot()["bytes"]["kv_read"] - read_before
    finally:
        adopted.close()
        cache.store.close()
    steps = len(ids) - 1 - P
    return torch.cat(logits).float().cpu(), read / max(1, steps) / 2**20, seconds / steps


def check_flags(args):
    """Every number a run needs, in range, before the model loads: one sentence, exit 1."""
    def numbers(flag, text, kind, ok):
        try:
            values = [kind(x) for x in text.split(",")]
        except ValueError:
            values = []
        if not values or not all(ok(v) for v in values):
            what = "numbers from 0 to 1" if kind is float else "whole numbers of at least 1"
            refuse(f"{flag} {text!r}: give a comma list of {what}")
        return values
    args.lengths = numbers("--lengths", args.lengths, int, lambda n: n >= 1)
    args.depths = numbers("--depths", args.depths, float, lambda d: 0 <= d <= 1)
    for flag, value, least in (("--trials", args.trials, 1), ("--doc-tokens", args.doc_tokens, 2),
                               ("--eval-tokens", args.eval_tokens, 1),
                               ("--chunk-size", args.chunk_size, 1), ("--window", args.window, 0),
                               ("--repeats", args.repeats, 1), ("--dense", args.dense, 0),
                               ("--threads", args.threads, 1)):
        if value is not None and value < least:
            refuse(f"{flag} must be at least {least}, got {value}")
    if args.eval_tokens >= args.doc_tokens:
        refuse(f"--eval-tokens {args.eval_tokens} must be below --doc-tokens {args.doc_tokens}")


def main(argv=None):
    p = argparse.ArgumentParser(prog="longeval.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", default=DEMO, help="checkpoint directory (default: the demo model)")
    p.add_argument("--policies", default="all,sink,quest:1024,quest:2048,oracle:1024",
                   help="comma list of "
                   + ", ".join(f"{n}:TOKENS" if c.takes_budget else n
                               for n, c in SELECTIONS.items())
                   + " (all is added first if missing: it is the reference)")
    p.add_argument("--lengths", default="2048,4096", help="passkey prompt lengths in tokens")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="needle depths, 0 to 1")
    p.add_argument("--trials", type=int, default=1, help="passkeys per length and depth")
    p.add_argument("--doc-file", help="UTF-8 document for top-1 and perplexity (default: the "
                   "pages of Python's reference manual)")
    p.add_argument("--doc-tokens", type=int, default=8192, help="document length (default 8192)")
    p.add_argument("--eval-tokens", type=int, default=128,
                   help="last tokens of the document fed as decode steps (default 128)")
    p.add_argument("--chunk-size", type=int, default=256, help="positions per chunk (default 256)")
    p.add_argument("--window", type=int, default=1, help="sealed chunks kept on the device and "
                   "always read (default 1)")
    p.add_argument("--dense", type=int, help="--select-dense (default: policy.default_dense)")
    p.add_argument("--offload", default="disk", choices=("none", "cpu", "disk"),
                   help="where chunks past the window live while timing (default disk)")
    p.add_argument("--dtype", default="fp32", choices=DTYPES)
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--repeats", type=int, default=1, help="interleaved timing repeats (median)")
    p.add_argument("--skip-passkey", action="store_true", help="the document columns only")
    args = p.parse_args(argv)
    check_flags(args)
    policies = parse_policies(args.policies, args.chunk_size)
    if ("all", None) not in policies:
        policies.insert(0, ("all", None))
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        model = Transformer.from_pretrained(args.ckpt, dtype=DTYPES[args.dtype])
        tok = load_tokenizer(args.ckpt)
    except CheckpointError as e:
        refuse(str(e))
    if args.doc_file:  # read before any policy runs: a bad file is said, not met midway
        try:
            with open(args.doc_file, encoding="utf-8") as f:
                f.read(1)
        except (OSError, UnicodeDecodeError) as e:
            refuse(f"--doc-file {args.doc_file}: cannot be read as UTF-8 text "
                   f"({getattr(e, 'strerror', None) or e})")
    args.fingerprint = f"longeval-{os.path.abspath(args.ckpt)}-{args.dtype}-{args.chunk_size}"
    tmp = tempfile.mkdtemp(prefix="longeval-")
    os.chmod(tmp, 0o700)
    store = KVStore(os.path.join(tmp, "store"))
    try:
        hits = {} if args.skip_passkey else passkey(model, tok, args, policies, store, tmp)
        ids = document_ids(tok, args.doc_file, args.doc_tokens)
        runs = {label(pol): [] for pol in policies}
        for _ in range(args.repeats):  # interleaved: each repeat runs every policy once
            for pol in policies:
                runs[label(pol)].append(teacher_forced(model, ids, args, pol, store, tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    targets = torch.tensor(ids[len(ids) - args.eval_tokens:])           # the true next tokens
    exact = runs["all"][0][0]
    exact_ppl = math.exp(F.cross_entropy(exact, targets).item())
    exact_read = runs["all"][0][1]
    trials = len(args.depths) * args.trials
    print(f"{args.ckpt}: document {args.doc_tokens} tokens (last {args.eval_tokens} decoded), "
          f"chunk {args.chunk_size}, window {args.window}, {args.offload}, {args.dtype}, "
          f"{torch.get_num_threads()} threads")
    head = ["policy"] + [f"passkey {n}" for n in args.lengths if hits]
    head += ["top-1 vs exact", "perplexity (change)", "KV read/step MiB (of exact)",
             "decode tok/s"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for pol in policies:
        name = label(pol)
        logits, read, _ = runs[name][0]
        seconds = statistics.median(r[2] for r in runs[name])
        agree = (logits.argmax(-1) == exact.argmax(-1)).float().mean().item()
        ppl = math.exp(F.cross_entropy(logits, targets).item())
        row = [name] + [f"{hits[name][n]}/{trials}" for n in args.lengths if hits]
        row += [f"{agree:.1%}", f"{ppl:.3f} ({ppl / exact_ppl - 1:+.2%})",
                f"{read:.2f} ({read / exact_read:.0%})", f"{1 / seconds:.1f}"]
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
