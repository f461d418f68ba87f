"""
The command line: the flags, checks and defaults that generate.py, verify.py and bench.py share, and the main()
that `python generate.py` runs (one prompt, or a --prompts batch through batch.py).

    python generate.py --ckpt DIR --prompt-file doc.txt --max-new-tokens 256 --chunk-size 512 --window 4 --offload disk

Without --ckpt it runs a short demo on the small model shipped in assets/ (disk tier, a window smaller than the
context). Every check happens before any weight is loaded; a bad flag is one line on stderr and exit code 2.
"""
import argparse
import json
import os
import signal
import sys

import torch

from batch import run_batch
from generate import Sampling
from model import CheckpointError, ModelArgs, Transformer, read_json
from monitor import Monitor
from offload import COMPRESSIONS, MODES, OffloadConfig, OffloadError
from task import run_task
from taskdir import TaskDirError, model_fingerprint, run_fingerprint
from tokenizer import load_tokenizer

DEMO_CKPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "tinyllama-pydoc")
DEMO_PROMPT = ("A module is a file containing Python definitions and statements. The file name is the module name "
               "with the suffix .py appended. Within a module, the module's name is available as the value of the "
               "global variable __name__.")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MODE_SPECS = {"none": ("none", "none"), "cpu": ("cpu", "none"), "disk": ("disk", "none"), "disk+zstd": ("disk", "zstd")}
DEFAULT_OFFLOAD_DIR = "./kv_cache_offload"


class UsageError(ValueError):
    """Bad input from the user: reported as one line, exit code 2."""


# -----------------------------------------------------------------------------
# flags and checks shared by generate.py, verify.py and bench.py

def add_common_flags(p, chunk_size, window, ckpt_help="Hugging Face checkpoint directory (default: the demo model "
                     "in assets/)"):
    """The flags every script takes. chunk_size and window are that script's defaults (None: decided later)."""
    p.add_argument("--ckpt", help=ckpt_help)
    p.add_argument("--chunk-size", type=int, default=chunk_size,
                   help=f"positions per KV chunk, the unit of transfer (default {chunk_size})")
    p.add_argument("--window", type=int, default=window, help=f"sealed chunks per layer kept on the device "
                   f"(default {window})")
    p.add_argument("--offload-dir", default=DEFAULT_OFFLOAD_DIR, help="disk tier root; each task uses "
                   "DIR/task_<id>/, removed when the task succeeds (default %(default)s, removed too if left empty)")
    p.add_argument("--cpu-budget", type=float, help="GiB of host memory for offloaded chunks: with --offload cpu "
                   "the host tier's size (default: all the task needs); with --offload disk a host tier in front "
                   "of the disk, filled first (default 0; resume covers the disk chunks only)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda "
                   "(default %(default)s)")
    p.add_argument("--dtype", choices=DTYPES, default="fp32", help="compute and KV dtype (default %(default)s)")
    p.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's choice; on a busy machine 1 "
                   "avoids OpenMP threads stalling while another process holds a core)")


def check_common(args, needs_disk):
    """The checks behind add_common_flags, in one place. needs_disk: the run will write the disk tier."""
    checks = [
        (args.chunk_size is None or args.chunk_size > 0,
         f"--chunk-size must be a positive number of positions, got {args.chunk_size}"),
        (args.window is None or args.window >= 0, f"--window must be >= 0, got {args.window}"),
        (args.cpu_budget is None or args.cpu_budget >= 0, f"--cpu-budget must be >= 0 GiB, got {args.cpu_budget}"),
        (args.threads is None or args.threads >= 1, f"--threads must be >= 1, got {args.threads}"),
        (not args.device.startswith("cuda") or torch.cuda.is_available(),
         f"--device {args.device}: CUDA is not available here; use --device cpu"),
    ]
    for ok, msg in checks:
        if not ok:
            raise UsageError(msg)
    if needs_disk:
        args.created_offload_dir = check_writable_dir(args.offload_dir)


def check_writable_dir(path):
    """Create `path` (owner-only) if needed and check it is writable. Returns True if it was created here."""
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
    """After a successful run, the offload dir this run created is removed again if nothing is left in it."""
    try:
        os.rmdir(path)
    except OSError:
        pass


def read_model_args(ckpt):
    path = os.path.join(ckpt, "config.json")
    return ModelArgs.from_config(read_json(path), path)


# -----------------------------------------------------------------------------
# generate.py's command line

def build_parser():
    p = argparse.ArgumentParser(prog="generate.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_flags(p, None, None)
    for action in p._actions:  # the demo and a real checkpoint differ in these defaults: say both
        if action.dest == "chunk_size":
            action.help = "positions per KV chunk, the unit of transfer (default 512; 16 in the demo)"
        elif action.dest == "window":
            action.help = "sealed chunks per layer kept on the device (default 4; 1 in the demo)"
    g = p.add_mutually_exclusive_group()
    g.add_argument("--prompt", help="prompt text (default: a built-in English paragraph)")
    g.add_argument("--prompt-file", help="read the prompt from this UTF-8 file")
    g.add_argument("--prompts", help="batch: a JSONL file of {\"id\", \"prompt\"[, \"max_new_tokens\", \"temperature\", \"seed\"]}")
    n = p.add_mutually_exclusive_group()
    n.add_argument("--max-new-tokens", type=int, help="tokens to generate (default 128; 64 in the demo); cut, with a "
                   "warning, where the model's context ends")
    n.add_argument("--max-length", type=int, help="cap on prompt plus generated tokens (default: the model's maximum)")
    p.add_argument("--offload", choices=MODES, help="where sealed chunks beyond the window go (default none; disk in the demo)")
    p.add_argument("--compress", choices=COMPRESSIONS, default="none", help="compress disk chunks (lossless)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed; each step is reproducible on its own")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt instead of text")
    b = p.add_argument_group("batch (with --prompts)")
    b.add_argument("--output", help="RESULTS.jsonl: one line per finished task; ids already there are skipped")
    b.add_argument("--concurrency", type=int, default=1, help="tasks run at once (default 1)")
    b.add_argument("--keep-cache", action="store_true", help="keep a task's directory after it succeeds")
    b.add_argument("--fallback-cpu-budget", type=float, help="if the disk tier fails (full, read-only, ...), rerun "
                   "the task on a host tier of this many GiB (output is identical); normal placement is unchanged")
    b.add_argument("--fallback-context", type=int, help="if the disk tier fails, continue on the last N tokens")
    b.add_argument("--trace", help="TRACE.jsonl: one event per step (memory, bytes per tier, chunks) and alerts; "
                   "appended to, each run starting with a {\"run_start\"} event")
    return p


def resolve(args):
    """Fill demo or plain defaults, check every flag, and return (offload config, prompt text). No heavy work."""
    demo = args.ckpt is None
    args.ckpt = args.ckpt or DEMO_CKPT
    args.chunk_size = args.chunk_size if args.chunk_size is not None else 16 if demo else 512
    args.window = args.window if args.window is not None else 1 if demo else 4
    args.offload = args.offload or ("disk" if demo else "none")
    if args.max_new_tokens is None and args.max_length is None:
        args.max_new_tokens = 64 if demo else 128
    if args.threads is None and demo:
        args.threads = 1
    checks = [
        (args.max_new_tokens is None or args.max_new_tokens > 0, f"--max-new-tokens must be >= 1, got {args.max_new_tokens}"),
        (args.max_length is None or args.max_length > 0, f"--max-length must be >= 1, got {args.max_length}"),
        (args.compress == "none" or args.offload == "disk", "--compress zstd applies to the disk tier; add --offload disk"),
        (args.temperature >= 0 and args.top_k >= 0 and 0 < args.top_p <= 1,
         "--temperature must be >= 0, --top-k >= 0 and --top-p in (0, 1]"),
        (os.path.isdir(args.ckpt), f"--ckpt {args.ckpt}: no such directory"),
        (not args.prompts or args.output, "--prompts needs --output RESULTS.jsonl"),
        (not args.output or args.prompts, "--output is for batch mode; add --prompts TASKS.jsonl"),
        (args.concurrency >= 1, f"--concurrency must be >= 1, got {args.concurrency}"),
        (args.fallback_context is None or args.fallback_context > 0, "--fallback-context must be >= 1"),
        (args.fallback_cpu_budget is None or args.fallback_cpu_budget > 0, "--fallback-cpu-budget must be > 0 GiB"),
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
                        offload_dir=args.offload_dir, compress=args.compress, keep_files=args.keep_cache)
    return cfg, text


def plan_lengths(args, n_prompt, model_args, max_new_tokens=None, warn=None):
    """How many tokens to generate, checked against the model's maximum context; a cut is reported via warn."""
    limit = model_args.max_context
    if n_prompt == 0:
        raise UsageError("the prompt is empty; give --prompt or --prompt-file with some text")
    cap = args.max_length if args.max_length is not None else limit
    if cap > limit:
        raise UsageError(f"--max-length {cap} is past the model's maximum context of {limit} positions")
    if n_prompt >= cap:
        raise UsageError(f"the prompt has {n_prompt} tokens, at or past the maximum length {cap}; shorten it")
    asked = max_new_tokens or args.max_new_tokens
    if asked and asked > cap - n_prompt and warn:
        where = "--max-length" if args.max_length else "model's context"
        warn(f"warning: --max-new-tokens {asked} cut to {cap - n_prompt}: the prompt's {n_prompt} tokens leave no "
             f"more room in the {where} of {cap} positions")
    return min(asked or cap - n_prompt, cap - n_prompt)


def fmt_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024


def progress_line(stats, n_prompt, n_new):
    b, c = stats["bytes"], stats["chunks"]
    return (f"prefill {n_prompt} tok {stats['prefill_s']:.2f}s ({stats['prefill_tokens_per_s']:.1f} tok/s) | "
            f"decode {n_new} tok {stats['decode_tokens_per_s']:.1f} tok/s | peak device {fmt_bytes(stats['peak_device_bytes'])} | "
            f"host rss {fmt_bytes(stats['peak_host_rss_bytes'])} (anon {fmt_bytes(stats['peak_host_anon_bytes'])}) | "
            f"chunks device/host/disk {c['device']}/{c['host']}/{c['disk']} | h2d {fmt_bytes(b['h2d'])} "
            f"d2h {fmt_bytes(b['d2h'])} | disk tier: write {fmt_bytes(b['disk_write'])} read {fmt_bytes(b['disk_read'])}"
            f" attended in place {fmt_bytes(b['disk_mapped_read'])} | storage I/O read "
            f"{fmt_bytes(stats['io']['storage_read'])} write {fmt_bytes(stats['io']['storage_write'])}"
            + (f" | resumed from position {stats['resumed_from']}" if stats.get("resumed_from") else ""))


def main(argv=None):
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)    # a file-size limit then fails a write (EFBIG), not the process
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    try:
        cfg, text = resolve(args)
        model_args = read_model_args(args.ckpt)
        tokenizer = load_tokenizer(args.ckpt)
        if tokenizer is None:
            raise UsageError(f"--ckpt {args.ckpt}: has no tokenizer.model or tokenizer.json, so text cannot be encoded")
        if not args.prompts:  # check the prompt before loading any weight
            plan_lengths(args, len(tokenizer.encode(text)), model_args)
        if args.threads:
            torch.set_num_threads(args.threads)
        monitor = Monitor(args.trace)
        model = Transformer.from_pretrained(args.ckpt, device=args.device, dtype=DTYPES[args.dtype])
        # what the disk tier's manifest must match to be resumed from: the weights' bytes and every setting that
        # changes the KV they make (only the disk tier resumes, so only it pays for hashing the weights)
        fingerprint = run_fingerprint(model_fingerprint(args.ckpt), dtype=args.dtype) if cfg.mode == "disk" else None
    except (UsageError, CheckpointError, OffloadError, TaskDirError, ValueError) as e:
        print(f"generate.py: error: {e}", file=sys.stderr)
        return 2

    def run_one(task, cfg, context=None, on_token=None):
        ids = tokenizer.encode(task["prompt"])[-context:] if context else tokenizer.encode(task["prompt"])
        max_new = plan_lengths(args, len(ids), model_args, task.get("max_new_tokens"),
                               warn=lambda m: log(f"task {task['id']}: {m}" if args.prompts else m))
        sampling = Sampling(task.get("temperature", args.temperature), args.top_k, args.top_p, task.get("seed", args.seed))
        monitor.task_started(task["id"], len(ids))
        new, stats = run_task(model, ids, max_new, chunk_size=args.chunk_size, cfg=cfg, sampling=sampling,
                              eos_ids=tokenizer.eos_ids, task_id=task["id"], on_token=on_token,
                              on_step=lambda phase, logits, cache: monitor.step(task["id"], phase, cache),
                              fingerprint=fingerprint, log=monitor.log)
        if cfg.mode != "none":
            monitor.context_stayed_on_device(task["id"], stats, args.chunk_size, cfg.window)
        result = {"id": task["id"], "prompt_ids": ids, "prompt_tokens": len(ids), "tokens": new,
                  "text": tokenizer.decode(new)}
        if context:
            result["fallback"] = {"context": context}
        result["stats"] = stats
        return result

    if args.prompts:
        try:
            rc = run_batch(args, cfg, monitor, run_one)
        except ValueError as e:
            print(f"generate.py: error: {e}", file=sys.stderr)
            return 2
        finally:
            monitor.close()
    else:
        rc = single(args, text, cfg, monitor, run_one, tokenizer)
    if rc == 0 and getattr(args, "created_offload_dir", False):
        remove_if_empty(args.offload_dir)
    return rc


def single(args, text, cfg, monitor, run_one, tokenizer):
    """One prompt: stream the text (or print one JSON object), then the statistics line on stderr."""
    printed = [""]

    def stream(out):  # decode everything so far and print what is new: tokens may merge into one character
        full = tokenizer.decode(out)
        sys.stdout.write(full[len(printed[0]):])
        sys.stdout.flush()
        printed[0] = full

    if not args.json:
        sys.stdout.write(text)
    try:
        result = run_one({"id": "0", "prompt": text}, cfg, on_token=None if args.json else stream)
    except (UsageError, OffloadError, TaskDirError, OSError) as e:
        print(f"\ngenerate.py: error: {e}", file=sys.stderr)
        return 1
    finally:
        monitor.close()
    print(json.dumps(result, ensure_ascii=False) if args.json else "")
    print(progress_line(result["stats"], result["prompt_tokens"], len(result["tokens"])), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
