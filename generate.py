"""
Long-context generation with an offloaded KV cache: chunked prefill, then decoding, greedy or sampled.

    python generate.py --ckpt DIR --prompt-file doc.txt --max-new-tokens 256 --chunk-size 512 --window 4 --offload disk

Without --ckpt it runs a short demo on the small model shipped in assets/ (disk tier, a window smaller than the
context). The loop is four free functions, each small enough to time, replace or compile on its own:
forward (one cached step), prefill (the prompt, a chunk at a time), decode_one_token, generate.
"""
import argparse
import ctypes
import json
import os
import sys
import time
from dataclasses import dataclass

import torch

from kvcache import KVCache
from model import CheckpointError, ModelArgs, Transformer, read_json
from offload import COMPRESSIONS, MODES, OffloadConfig, OffloadError, TieredStore
from tokenizer import load_tokenizer

DEMO_CKPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "tinyllama-pydoc")
DEMO_PROMPT = ("The with statement is used to wrap the execution of a block with methods defined by a context "
               "manager. This allows common try, except and finally usage patterns to be encapsulated for "
               "convenient reuse. The execution of the with statement proceeds as follows:")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class UsageError(ValueError):
    """Bad input from the user: reported as one line, exit code 2."""


# -----------------------------------------------------------------------------
# the loop

@torch.inference_mode()
def forward(model, cache, tokens):
    """One cached step: tokens [B, T] that fit in the open chunk -> logits [B, T, V]."""
    cache.begin(tokens.shape[1])      # the store starts prefetching this step's offloaded chunks
    logits = model(tokens, cache)     # each layer: write k, v into the open chunk, attend over all chunks
    cache.end()                       # a full open chunk is sealed; the oldest window chunk is offloaded
    return logits


def prefill(model, cache, ids, on_step=None):
    """Feed ids [B, T] at most chunk_size tokens at a time, aligned to chunk boundaries, so the activations of
    a long prompt never exist at once. Returns the logits [B, V] of the last position."""
    t, C = 0, cache.chunk_size
    while t < ids.shape[1]:
        n = min(C - cache.length % C, ids.shape[1] - t)
        logits = forward(model, cache, ids[:, t:t + n])[:, -1]
        t += n
        if on_step:
            on_step("prefill", logits)
    return logits


def decode_one_token(model, cache, token):
    """token [B, 1] -> logits [B, V] of the next position."""
    return forward(model, cache, token)[:, -1]


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


def generate(model, cache, prompt_ids, max_new_tokens, sampling=Sampling(), eos_ids=(), on_token=None, on_step=None):
    """prompt_ids [1, T] -> list of new token ids. Stops at an EOS id or after max_new_tokens."""
    logits = prefill(model, cache, prompt_ids, on_step)
    out = []
    for i in range(max_new_tokens):
        token = sample(logits, sampling, cache.length).to(prompt_ids.device)  # [1, 1]
        out.append(token.item())
        if on_token:
            on_token(out)
        if out[-1] in eos_ids or i == max_new_tokens - 1:
            break
        logits = decode_one_token(model, cache, token)
        if on_step:
            on_step("decode", logits)
    return out


# -----------------------------------------------------------------------------
# one task: cache, timing, memory

def host_memory():
    """Resident memory of this process in bytes: total, anonymous (what it really holds) and file-backed
    (mapped pages, e.g. the disk tier, that the OS may evict)."""
    out = {"rss": 0, "anon": 0, "file": 0}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, val = line.partition(":")
                if key in ("VmRSS", "RssAnon", "RssFile"):
                    out[{"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file"}[key]] = int(val.split()[0]) * 1024
    except OSError:  # not Linux: the peak RSS is all we can get
        import resource
        out["rss"] = out["anon"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def return_large_frees_to_os(threshold=1 << 20):
    """glibc raises its mmap threshold after each large free; from then on big temporaries (the attention scores of
    a prefill chunk) come from the heap, which fragments and is rarely trimmed, so resident memory creeps up with
    the context although nothing holds it. A fixed threshold keeps big blocks in mmap: freed, they go back to the OS."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, threshold)  # -3 = M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def make_cache(model, cfg, chunk_size, max_length, task_id="task"):
    a, p = model.args, next(model.parameters())
    store = TieredStore(a.n_layers, 1, a.n_kv_heads, a.head_dim, chunk_size, max_length, p.device, p.dtype, cfg, task_id)
    return KVCache(store)


def run_task(model, tokenizer, prompt_ids, max_new_tokens, chunk_size, cfg, sampling=Sampling(), task_id="task",
             on_token=None, on_step=None):
    """Generate for one prompt with its own cache; returns (new ids, stats) with everything measured."""
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    cache = make_cache(model, cfg, chunk_size, len(prompt_ids) + max_new_tokens, task_id)
    peak = {"anon": 0, "rss": 0, "file": 0}
    clock = {"t": time.perf_counter(), "prefill_s": 0.0, "decode_s": 0.0, "decode_steps": 0}

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    def step(phase, logits):
        sync()
        now = time.perf_counter()
        clock[phase + "_s"] += now - clock["t"]
        clock["t"] = now
        clock["decode_steps"] += phase == "decode"
        for k, v in host_memory().items():
            peak[k] = max(peak[k], v)
        if on_step:
            on_step(phase, logits, cache)

    def token_cb(out):
        if len(out) == 1:  # sampling the first token ends prefill: restart the clock for decoding
            clock["ttft_s"] = clock["prefill_s"] + time.perf_counter() - clock["t"]
            clock["t"] = time.perf_counter()
        if on_token:
            on_token(out)

    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    try:
        new = generate(model, cache, ids, max_new_tokens, sampling, tokenizer.eos_ids if tokenizer else (),
                       token_cb, step)
        store_stats = cache.store.stats()
    finally:
        cache.store.close()
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    stats = {
        "prefill_s": round(clock["prefill_s"], 4),
        "prefill_tokens_per_s": round(len(prompt_ids) / max(clock["prefill_s"], 1e-9), 2),
        "ttft_s": round(clock.get("ttft_s", clock["prefill_s"]), 4),
        "decode_s": round(clock["decode_s"], 4),
        "decode_tokens_per_s": round(clock["decode_steps"] / clock["decode_s"], 2) if clock["decode_s"] else 0.0,
        # CUDA: the allocator's peak. CPU: weights plus the KV chunks allocated on the "device" tier.
        "peak_device_bytes": torch.cuda.max_memory_allocated(device) if cuda else weights + store_stats["kv_device_bytes_peak"],
        "peak_host_rss_bytes": peak["rss"],
        "peak_host_anon_bytes": peak["anon"],
        "peak_host_file_bytes": peak["file"],
        "bytes": store_stats["bytes"],
        "chunks": store_stats["chunks"],
    }
    return new, stats


# -----------------------------------------------------------------------------
# command line

def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", help="Hugging Face checkpoint directory (default: the demo model in assets/)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--prompt", help="prompt text (default: a built-in English paragraph)")
    g.add_argument("--prompt-file", help="read the prompt from this UTF-8 file")
    n = p.add_mutually_exclusive_group()
    n.add_argument("--max-new-tokens", type=int, help="tokens to generate (default 128; 48 in the demo)")
    n.add_argument("--max-length", type=int, help="cap on prompt plus generated tokens (default: the model's maximum)")
    p.add_argument("--chunk-size", type=int, help="positions per KV chunk, the unit of transfer (default 512; 32 in the demo)")
    p.add_argument("--window", type=int, default=4, help="sealed chunks per layer kept on the device (default 4)")
    p.add_argument("--offload", choices=MODES, help="where sealed chunks beyond the window go (default none; disk in the demo)")
    p.add_argument("--offload-dir", default="./kv_cache_offload", help="disk tier root; each task uses DIR/<id>/")
    p.add_argument("--cpu-budget", type=float, help="GiB of host memory for offloaded chunks "
                   "(default: all the task needs with --offload cpu, 0 with --offload disk)")
    p.add_argument("--compress", choices=COMPRESSIONS, default="none", help="compress disk chunks (lossless)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    p.add_argument("--dtype", choices=DTYPES, default="fp32", help="compute and KV dtype (default fp32)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed; each step is reproducible on its own")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt instead of text")
    return p


def resolve(args):
    """Fill demo or plain defaults, check every flag, and return (offload config, prompt text). No heavy work."""
    demo = args.ckpt is None
    args.ckpt = args.ckpt or DEMO_CKPT
    if args.chunk_size is None:
        args.chunk_size = 32 if demo else 512
    if args.offload is None:
        args.offload = "disk" if demo else "none"
    if args.max_new_tokens is None and args.max_length is None:
        args.max_new_tokens = 48 if demo else 128
    if args.chunk_size <= 0:
        raise UsageError(f"--chunk-size must be a positive number of positions, got {args.chunk_size}")
    if args.window < 0:
        raise UsageError(f"--window must be >= 0, got {args.window}")
    if args.max_new_tokens is not None and args.max_new_tokens <= 0:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.max_length is not None and args.max_length <= 0:
        raise UsageError(f"--max-length must be >= 1, got {args.max_length}")
    if args.cpu_budget is not None and args.cpu_budget < 0:
        raise UsageError(f"--cpu-budget must be >= 0 GiB, got {args.cpu_budget}")
    if args.compress == "zstd" and args.offload != "disk":
        raise UsageError("--compress zstd applies to the disk tier; add --offload disk")
    if args.temperature < 0 or args.top_k < 0 or not 0 < args.top_p <= 1:
        raise UsageError("--temperature must be >= 0, --top-k >= 0 and --top-p in (0, 1]")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {args.device}: CUDA is not available here; use --device cpu")
    if not os.path.isdir(args.ckpt):
        raise UsageError(f"--ckpt {args.ckpt}: no such directory")
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
                        offload_dir=args.offload_dir, compress=args.compress)
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


def plan_lengths(args, n_prompt, model_args):
    """How many tokens to generate, checked against the model's maximum context."""
    limit = model_args.max_context
    if n_prompt == 0:
        raise UsageError("the prompt is empty; give --prompt or --prompt-file with some text")
    cap = args.max_length if args.max_length is not None else limit
    if cap > limit:
        raise UsageError(f"--max-length {cap} is past the model's maximum context of {limit} positions")
    if n_prompt >= cap:
        raise UsageError(f"the prompt has {n_prompt} tokens, at or past the maximum length {cap}; shorten it")
    new = args.max_new_tokens if args.max_new_tokens is not None else cap - n_prompt
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
            f"h2d {fmt_bytes(b['h2d'])} d2h {fmt_bytes(b['d2h'])} disk w {fmt_bytes(b['disk_write'])} r {fmt_bytes(b['disk_read'])}")


def main(argv=None):
    args = build_parser().parse_args(argv)
    return_large_frees_to_os()
    try:
        cfg, text = resolve(args)
        model_args = ModelArgs.from_config(read_json(os.path.join(args.ckpt, "config.json")), os.path.join(args.ckpt, "config.json"))
        tokenizer = load_tokenizer(args.ckpt)
        if tokenizer is None:
            raise UsageError(f"--ckpt {args.ckpt}: has no tokenizer.model or tokenizer.json, so text cannot be encoded")
        prompt_ids = tokenizer.encode(text)
        max_new = plan_lengths(args, len(prompt_ids), model_args)
        model = Transformer.from_pretrained(args.ckpt, device=args.device, dtype=DTYPES[args.dtype])
        printed = [""]

        def stream(out):
            if not args.json:
                full = tokenizer.decode(out)
                sys.stdout.write(full[len(printed[0]):])
                sys.stdout.flush()
                printed[0] = full

        if not args.json:
            sys.stdout.write(text)
        sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
        new, stats = run_task(model, tokenizer, prompt_ids, max_new, args.chunk_size, cfg, sampling, "task_0", stream)
    except (UsageError, CheckpointError, OffloadError) as e:
        print(f"generate.py: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"id": "0", "prompt_ids": prompt_ids, "prompt_tokens": len(prompt_ids), "tokens": new,
                          "text": tokenizer.decode(new), "stats": stats}))
    else:
        sys.stdout.write("\n")
    print(progress_line(stats, len(prompt_ids), len(new)), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
