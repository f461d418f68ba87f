"""
Long-context generation with an offloaded KV cache: chunked prefill, then decoding, greedy or sampled.

    python generate.py --ckpt DIR --prompt-file doc.txt --max-new-tokens 256 --chunk-size 512 --window 4 --offload disk

Without --ckpt it runs a short demo on the small model shipped in assets/ (disk tier, a window smaller than the
context). The loop is four free functions, each small enough to time, replace or compile on its own:
forward (one cached step), prefill (the prompt, a chunk at a time), decode_one_token, generate.
"""
import argparse
import json
import os
import signal
import sys
from dataclasses import dataclass

import torch

from model import CheckpointError, ModelArgs, Transformer, read_json
from offload import COMPRESSIONS, MODES, OffloadConfig, OffloadError
from tokenizer import load_tokenizer

DEMO_CKPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "tinyllama-pydoc")
DEMO_PROMPT = ("A module is a file containing Python definitions and statements. The file name is the module name "
               "with the suffix .py appended. Within a module, the module's name is available as the value of the "
               "global variable __name__.")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class UsageError(ValueError):
    """Bad input from the user: reported as one line, exit code 2."""


# -----------------------------------------------------------------------------
# the loop

@torch.inference_mode()
def forward(model, cache, tokens):
    """One cached step: tokens [B, T] that fit in the open chunk -> logits [B, V] of the last position."""
    cache.begin(tokens.shape[1])                    # the store starts prefetching this step's offloaded chunks
    logits = model(tokens, cache, last_only=True)   # each layer: write k, v into the open chunk, attend over all chunks
    cache.end()                                     # a full open chunk is sealed; the oldest window chunk is offloaded
    return logits[:, -1]


def prefill(model, cache, ids, on_step=None):
    """Feed ids [B, T] at most chunk_size tokens at a time, aligned to chunk boundaries, so the activations of
    a long prompt never exist at once. Returns the logits [B, V] of the last position."""
    t, C = 0, cache.chunk_size
    while t < ids.shape[1]:
        n = min(C - cache.length % C, ids.shape[1] - t)
        logits = forward(model, cache, ids[:, t:t + n])
        t += n
        if on_step:
            on_step("prefill", logits)
    return logits


def decode_one_token(model, cache, token):
    """token [B, 1] -> logits [B, V] of the next position."""
    return forward(model, cache, token)


@dataclass
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0            # 0 = no top-k cut
    top_p: float = 1.0        # 1 = no nucleus cut
    seed: int = 0             # each step draws from its own generator seeded by (seed, position): reproducible


def sample(logits, s, position):
    """logits [B, V] fp32 -> next token ids [B, 1]."""
    if s.temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float().cpu() / s.temperature
    if s.top_k > 0:
        kth = torch.topk(logits, min(s.top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if s.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > s.top_p   # keep the smallest prefix whose mass reaches top_p
        probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
    g = torch.Generator().manual_seed(s.seed * 1_000_003 + position)
    return torch.multinomial(probs, 1, generator=g)  # [B, 1] on the CPU; the caller moves it


def generate(model, cache, prompt_ids, max_new_tokens, sampling=Sampling(), eos_ids=(), on_token=None, on_step=None,
             replay=()):
    """prompt_ids [1, P] -> list of new token ids. Stops at an EOS id or after max_new_tokens.

    Resuming: the cache may already hold positions [0, cache.length) restored from disk, and `replay` the tokens
    generated before the interruption. Positions past the restored ones are recomputed with the first run's
    schedule (prompt positions a chunk at a time, generated ones one at a time), so the output is bit-identical."""
    P = prompt_ids.shape[1]
    out = list(replay)
    logits = None
    if cache.length < P:
        logits = prefill(model, cache, prompt_ids[:, cache.length:], on_step)
    for pos in range(max(cache.length, P), P + len(out)):                 # replay the generated tokens not restored
        logits = decode_one_token(model, cache, prompt_ids.new_tensor([[out[pos - P]]]))
    while len(out) < max_new_tokens and not (out and out[-1] in eos_ids):
        token = sample(logits, sampling, cache.length).to(prompt_ids.device)  # [1, 1]
        out.append(token.item())
        if on_token:
            on_token(out)
        if out[-1] in eos_ids or len(out) == max_new_tokens:
            break
        logits = decode_one_token(model, cache, token)
        if on_step:
            on_step("decode", logits)
    return out


# -----------------------------------------------------------------------------
# command line

def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", help="Hugging Face checkpoint directory (default: the demo model in assets/)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--prompt", help="prompt text (default: a built-in English paragraph)")
    g.add_argument("--prompt-file", help="read the prompt from this UTF-8 file")
    g.add_argument("--prompts", help="batch: a JSONL file of {\"id\", \"prompt\"[, \"max_new_tokens\", \"temperature\", \"seed\"]}")
    n = p.add_mutually_exclusive_group()
    n.add_argument("--max-new-tokens", type=int, help="tokens to generate (default 128; 64 in the demo)")
    n.add_argument("--max-length", type=int, help="cap on prompt plus generated tokens (default: the model's maximum)")
    p.add_argument("--chunk-size", type=int, help="positions per KV chunk, the unit of transfer (default 512; 16 in the demo)")
    p.add_argument("--window", type=int, help="sealed chunks per layer kept on the device (default 4; 1 in the demo)")
    p.add_argument("--offload", choices=MODES, help="where sealed chunks beyond the window go (default none; disk in the demo)")
    p.add_argument("--offload-dir", default="./kv_cache_offload", help="disk tier root; each task uses DIR/task_<id>/")
    p.add_argument("--cpu-budget", type=float, help="GiB of host memory for offloaded chunks "
                   "(default: all the task needs with --offload cpu, 0 with --offload disk)")
    p.add_argument("--compress", choices=COMPRESSIONS, default="none", help="compress disk chunks (lossless)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    p.add_argument("--dtype", choices=DTYPES, default="fp32", help="compute and KV dtype (default fp32)")
    p.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's choice; 1 in the demo, "
                   "whose small ops run fastest on one thread and do not stall when another process holds a core)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed; each step is reproducible on its own")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt instead of text")
    b = p.add_argument_group("batch (with --prompts)")
    b.add_argument("--output", help="RESULTS.jsonl: one line per finished task; ids already there are skipped")
    b.add_argument("--concurrency", type=int, default=1, help="tasks run at once (default 1)")
    b.add_argument("--keep-cache", action="store_true", help="keep a task's directory after it succeeds")
    b.add_argument("--fallback-context", type=int, help="if the disk tier fails, continue on the last N tokens")
    b.add_argument("--trace", help="TRACE.jsonl: one event per step (memory, bytes per tier, chunks) and alerts")
    return p


def resolve(args):
    """Fill demo or plain defaults, check every flag, and return (offload config, prompt text). No heavy work."""
    demo = args.ckpt is None
    args.ckpt = args.ckpt or DEMO_CKPT
    if args.chunk_size is None:
        args.chunk_size = 16 if demo else 512
    if args.window is None:
        args.window = 1 if demo else 4
    if args.offload is None:
        args.offload = "disk" if demo else "none"
    if args.max_new_tokens is None and args.max_length is None:
        args.max_new_tokens = 64 if demo else 128
    if args.threads is None and demo:
        args.threads = 1
    checks = [
        (args.chunk_size > 0, f"--chunk-size must be a positive number of positions, got {args.chunk_size}"),
        (args.window >= 0, f"--window must be >= 0, got {args.window}"),
        (args.max_new_tokens is None or args.max_new_tokens > 0, f"--max-new-tokens must be >= 1, got {args.max_new_tokens}"),
        (args.max_length is None or args.max_length > 0, f"--max-length must be >= 1, got {args.max_length}"),
        (args.cpu_budget is None or args.cpu_budget >= 0, f"--cpu-budget must be >= 0 GiB, got {args.cpu_budget}"),
        (args.compress == "none" or args.offload == "disk", "--compress zstd applies to the disk tier; add --offload disk"),
        (args.temperature >= 0 and args.top_k >= 0 and 0 < args.top_p <= 1,
         "--temperature must be >= 0, --top-k >= 0 and --top-p in (0, 1]"),
        (not args.device.startswith("cuda") or torch.cuda.is_available(),
         f"--device {args.device}: CUDA is not available here; use --device cpu"),
        (os.path.isdir(args.ckpt), f"--ckpt {args.ckpt}: no such directory"),
        (not args.prompts or args.output, "--prompts needs --output RESULTS.jsonl"),
        (not args.output or args.prompts, "--output is for batch mode; add --prompts TASKS.jsonl"),
        (args.concurrency >= 1, f"--concurrency must be >= 1, got {args.concurrency}"),
        (args.threads is None or args.threads >= 1, f"--threads must be >= 1, got {args.threads}"),
        (args.fallback_context is None or args.fallback_context > 0, "--fallback-context must be >= 1"),
    ]
    for ok, msg in checks:
        if not ok:
            raise UsageError(msg)
    if args.offload == "disk":
        check_writable_dir(args.offload_dir)
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


def check_writable_dir(path):
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        probe = os.path.join(path, f".probe-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        raise UsageError(f"--offload-dir {path}: cannot create or write it ({e.strerror or e}); "
                         "choose a writable directory") from None


def plan_lengths(args, n_prompt, model_args, max_new_tokens=None):
    """How many tokens to generate, checked against the model's maximum context."""
    limit = model_args.max_context
    if n_prompt == 0:
        raise UsageError("the prompt is empty; give --prompt or --prompt-file with some text")
    cap = args.max_length if args.max_length is not None else limit
    if cap > limit:
        raise UsageError(f"--max-length {cap} is past the model's maximum context of {limit} positions")
    if n_prompt >= cap:
        raise UsageError(f"the prompt has {n_prompt} tokens, at or past the maximum length {cap}; shorten it")
    new = max_new_tokens or args.max_new_tokens or cap - n_prompt
    return min(new, cap - n_prompt)


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
            f"chunks device/host/disk {c['device']}/{c['host']}/{c['disk']} | "
            f"h2d {fmt_bytes(b['h2d'])} d2h {fmt_bytes(b['d2h'])} disk w {fmt_bytes(b['disk_write'])} r {fmt_bytes(b['disk_read'])}"
            + (f" | resumed from position {stats['resumed_from']}" if stats.get("resumed_from") else ""))


def main(argv=None):
    from batch import run_batch                      # batch.py and task.py build on the loop above
    from monitor import Monitor, return_large_frees_to_os
    from task import run_task
    from taskdir import TaskDirError, model_fingerprint

    args = build_parser().parse_args(argv)
    return_large_frees_to_os()
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)    # a file-size limit then fails a write (EFBIG), not the process
    try:
        cfg, text = resolve(args)
        config_path = os.path.join(args.ckpt, "config.json")
        model_args = ModelArgs.from_config(read_json(config_path), config_path)
        tokenizer = load_tokenizer(args.ckpt)
        if tokenizer is None:
            raise UsageError(f"--ckpt {args.ckpt}: has no tokenizer.model or tokenizer.json, so text cannot be encoded")
        if not args.prompts:  # check the prompt before loading any weight
            plan_lengths(args, len(tokenizer.encode(text)), model_args)
        if args.threads:
            torch.set_num_threads(args.threads)
        monitor = Monitor(args.trace)
        model = Transformer.from_pretrained(args.ckpt, device=args.device, dtype=DTYPES[args.dtype])
        fingerprint = model_fingerprint(args.ckpt)
    except (UsageError, CheckpointError, OffloadError, TaskDirError, ValueError) as e:
        print(f"generate.py: error: {e}", file=sys.stderr)
        return 2

    def run_one(task, cfg, context=None, on_token=None):
        ids = tokenizer.encode(task["prompt"])[-context:] if context else tokenizer.encode(task["prompt"])
        max_new = plan_lengths(args, len(ids), model_args, task.get("max_new_tokens"))
        sampling = Sampling(task.get("temperature", args.temperature), args.top_k, args.top_p, task.get("seed", args.seed))
        new, stats = run_task(model, tokenizer, ids, max_new, args.chunk_size, cfg, sampling, task["id"], on_token,
                              lambda phase, logits, cache: monitor.step(task["id"], phase, cache), fingerprint, monitor.log)
        result = {"id": task["id"], "prompt_ids": ids, "prompt_tokens": len(ids), "tokens": new,
                  "text": tokenizer.decode(new)}
        if context:
            result["fallback"] = {"context": context}
        result["stats"] = stats
        return result

    if args.prompts:
        try:
            return run_batch(args, model, tokenizer, cfg, fingerprint, monitor, run_one)
        except ValueError as e:
            print(f"generate.py: error: {e}", file=sys.stderr)
            return 2
        finally:
            monitor.close()

    printed = [""]

    def stream(out):  # decode everything so far and print what is new: tokens may merge into one character
        full = tokenizer.decode(out)
        sys.stdout.write(full[len(printed[0]):])
        sys.stdout.flush()
        printed[0] = full

    if not args.json:
        sys.stdout.write(text)
    monitor.task_started("0")
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
