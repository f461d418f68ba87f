"""
Where a decode step's time goes: each part of a layer (the norms, the q, k, v and o projections,
RoPE, attention over the chunks, the MLP's three matrices), the output head, and what is left (the
embedding, the RoPE tables, the cache's bookkeeping); for each part the bytes it reads and the rate
it reads them at, against this machine's read bandwidth (the memory roofline's denominator); then
the slowest layer against the median one, torch.profiler's operators, and a profiled step split into
the library's products, attention's fused kernel and everything else.

    python tools/profile_decode.py --random-model smollm2-135m --context 2048
    python tools/profile_decode.py --ckpt DIR --context 4096 --dtype bf16 --offload disk
    python tools/profile_decode.py --ckpt DIR --context 6144 --attention compiled --kv-dtype fp16
    python tools/profile_decode.py --ckpt DIR --context 6144 --dtype bf16 --quantize int4-g32

A decode step reads every weight once and the KV of the whole context: when a part reads at a rate
well below the bandwidth, its time goes to something other than bytes (operator overhead, threads
waiting for each other, a kernel that does not stream); a model small enough to stay in the CPU's
caches reads faster than the bandwidth (over 100%). Timing wraps each module's forward with a
clock (a CPU runs operators synchronously, so the clock is the part's time); the wrappers add about
a microsecond each, about 1% of the step here. CPU only.
"""
import argparse
import collections
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fewrows  # noqa: E402
from checkpoint import CheckpointError  # noqa: E402
from generate import decode_one_token, prefill  # noqa: E402
from kvcache import make_cache  # noqa: E402
from kvlayout import KV_DTYPES  # noqa: E402
from measure.probe import GB, read_bandwidth  # noqa: E402
from measure.random_model import PRESETS, build_random_checkpoint, parse_model_spec  # noqa: E402
from model import Transformer  # noqa: E402
from offload import OffloadConfig  # noqa: E402
from quantize import QUANTIZE  # noqa: E402
from runs.cores import CoreWatch  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# a layer's parts, in the order a step runs them: (name, the modules whose forward it times)
LINEARS = {"q, k, v": ("attention.wq", "attention.wk", "attention.wv"), "o": ("attention.wo",),
           "gate, up": ("feed_forward.w1", "feed_forward.w3"), "down": ("feed_forward.w2",)}
# the library's kernels a step streams its bytes through, by torch.profiler's names (self time)
PRODUCT_KERNELS = ("aten::mm", "aten::addmm", "aten::mv", "aten::addmv_", "aten::bmm",
                   "aten::_weight_int8pack_mm", "aten::_weight_int4pack_mm_for_cpu")
ATTENTION_KERNELS = ("aten::_scaled_dot_product_flash_attention_for_cpu",)
PROFILED_STEPS = 4


def clocked(fn, key, spent):
    """fn, adding the seconds each call takes to spent[key]."""
    def run(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        spent[key] += time.perf_counter() - start
        return out
    return run


def nbytes(module):
    """Bytes of a module's weights (and scales, when quantized)."""
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


def instrument(model, cache, spent):
    """Wrap every part's forward (and the cache's attend) with a clock. Returns {part: bytes it
    reads per step}, the KV counted by the caller."""
    reads = collections.Counter()
    for i, block in enumerate(model.layers):
        block.forward = clocked(block.forward, ("layer", i), spent)
        for name in ("attention_norm", "ffn_norm"):
            norm = block.get_submodule(name)
            norm.forward = clocked(norm.forward, "norms", spent)
            reads["norms"] += nbytes(norm)
        block.attention.forward = clocked(block.attention.forward, "attention", spent)
        block.feed_forward.forward = clocked(block.feed_forward.forward, "mlp", spent)
        joints = {"q, k, v": block.attention.qkv, "gate, up": block.feed_forward.gate_up}
        for part, names in LINEARS.items():
            for name in names:
                lin = block.get_submodule(name)
                lin.forward = clocked(lin.forward, part, spent)
                reads[part] += nbytes(lin)
            if joints.get(part):  # one product over the part's weights (rowwise.Joint)
                joint = joints[part].layer
                joint.forward = clocked(joint.forward, part, spent)
    cache.attend = clocked(cache.attend, "attend", spent)
    model.norm.forward = clocked(model.norm.forward, "head norm", spent)
    model.output.forward = clocked(model.output.forward, "output", spent)
    reads["output"] = nbytes(model.output)
    return reads


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", help="a checkpoint directory (else --random-model)")
    p.add_argument("--random-model",
                   help=f"a random model of a known shape: {', '.join(PRESETS)} (default, without "
                   "--ckpt: smollm2-135m)")
    p.add_argument("--context", type=int, default=2048, help="prompt tokens before the steps")
    p.add_argument("--steps", type=int, default=24, help="decode steps timed (after 4 warm-up)")
    p.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--window", type=int, default=4)
    p.add_argument("--offload", default="none", choices=("none", "cpu", "disk"))
    p.add_argument("--threads", type=int,
                   help="default: OMP_NUM_THREADS, else as generate.py chooses (cores.py)")
    p.add_argument("--ops", type=int, default=12, help="rows of torch.profiler's table")
    p.add_argument("--attention", default="flash", choices=("flash", "compiled", "auto"),
                   help="a decode step's chunk visits: torch's fused kernel or fewrows.py's")
    p.add_argument("--products", default="library", choices=("library", "compiled"),
                   help="a decode step's half-precision linears: torch's or fewrows.py's")
    p.add_argument("--quantize", choices=[q for q in QUANTIZE if q],
                   help="weights quantized as they load (int8, or int4 with its group size)")
    p.add_argument("--kv-dtype", default="auto", choices=KV_DTYPES,
                   help="how K and V are held (kvlayout.py)")
    args = p.parse_args(argv)
    for flag, value, least in (("--context", args.context, 1), ("--steps", args.steps, 1),
                               ("--chunk-size", args.chunk_size, 1), ("--window", args.window, 0),
                               ("--ops", args.ops, 0)):
        if value < least:
            p.error(f"{flag} {value}: give at least {least}")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads {args.threads}: give at least 1")
    if args.ckpt and args.random_model:
        p.error("--ckpt and --random-model: give one of them")
    if args.ckpt and not os.path.isdir(args.ckpt):
        p.error(f"--ckpt {args.ckpt}: not a directory; give a checkpoint's directory")
    watch = CoreWatch()
    dtype = DTYPES[args.dtype]
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.ckpt
        if ckpt is None:
            try:
                spec = parse_model_spec(args.random_model or "smollm2-135m")
            except ValueError as e:
                p.error(str(e))
            ckpt = os.path.join(tmp, "model")
            build_random_checkpoint(spec, ckpt, dtype, "cpu")
        try:
            model = Transformer.from_pretrained(ckpt, dtype=dtype, quantize=args.quantize)
        except CheckpointError as e:
            p.error(str(e))
        # the prompt, 4 warm-up steps, the timed ones, 4 profiled and room to spare
        total = args.context + args.steps + 8
        if total > model.args.max_context:
            p.error(f"--context {args.context} plus --steps {args.steps} and 8 more: {total} "
                    f"positions, past the model's context of {model.args.max_context}; give a "
                    f"--context of at most {model.args.max_context - args.steps - 8}")
        if args.threads or "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(args.threads or watch.threads()[0])
        cfg = OffloadConfig(mode=args.offload, window=args.window, offload_dir=tmp + "/kv")
        fewrows.KERNEL = args.attention
        fewrows.PRODUCTS = args.products
        cache = make_cache(model, cfg, args.chunk_size, total, kv_dtype=args.kv_dtype)
        ids = torch.randint(3, model.args.vocab_size, (1, args.context),
                            generator=torch.Generator().manual_seed(0))
        try:
            profile(model, cache, prefill(model, cache, ids), args)
        finally:
            cache.store.close()


def profile(model, cache, logits, args):
    token = logits.argmax(-1, keepdim=True)  # [1, 1]
    for _ in range(4):  # warm-up: first calls pick kernels
        token = decode_one_token(model, cache, token).argmax(-1, keepdim=True)
    kv_per_token = cache.store.chunk_bytes / args.chunk_size  # one layer's K and V of a position
    spent = collections.defaultdict(float)
    reads = instrument(model, cache, spent)
    context = cache.length + args.steps // 2  # the steps' middle
    reads["attend"] = context * kv_per_token * model.args.n_layers
    steps = []
    for _ in range(args.steps):
        start = time.perf_counter()
        token = decode_one_token(model, cache, token).argmax(-1, keepdim=True)
        steps.append(time.perf_counter() - start)
    n = args.steps
    parts = {k: v / n for k, v in spent.items() if not isinstance(k, tuple)}
    layers = [spent[("layer", i)] / n for i in range(model.args.n_layers)]
    # self times: a wrapper's time less the parts inside it
    parts["rope, reshapes"] = (parts.pop("attention") - parts["q, k, v"] - parts["o"]
                               - parts["attend"])
    parts["silu, product"] = parts.pop("mlp") - parts["gate, up"] - parts["down"]
    inside = parts["norms"] + parts["q, k, v"] + parts["o"] + parts["attend"]
    inside += parts["rope, reshapes"] + parts["gate, up"] + parts["down"] + parts["silu, product"]
    parts["residual adds"] = sum(layers) - inside
    step = sum(steps) / n
    parts["other (embedding, RoPE table, cache)"] = step - sum(layers) - parts["head norm"]
    parts["other (embedding, RoPE table, cache)"] -= parts["output"]
    bandwidth = read_bandwidth("cpu")
    total_read = sum(reads.values())
    roofline = bandwidth * GB / total_read  # tok/s if every byte came at the bandwidth
    print(f"decode at {context} tokens, {args.dtype}, {torch.get_num_threads()} threads, chunk "
          f"{args.chunk_size}, --offload {args.offload}: step {step * 1e3:.2f} ms (median "
          f"{statistics.median(steps) * 1e3:.2f}), {1 / step:.1f} tok/s; reads "
          f"{total_read / 2**20:.1f} MiB; read bandwidth {bandwidth:.1f} GB/s: the roofline is "
          f"{roofline:.1f} tok/s, and this step {1 / step / roofline:.0%} of it\n")
    print("| part | ms per step | share | MiB read | GB/s | of bandwidth |")
    print("|---|---|---|---|---|---|")
    for name, seconds in sorted(parts.items(), key=lambda kv: -kv[1]):
        read = reads.get(name, 0)
        rate = read / seconds / GB if read and seconds > 0 else 0
        print(f"| {name} | {seconds * 1e3:.2f} | {seconds / step:.0%} | "
              f"{read / 2**20:.1f} | {rate:.1f} | {rate / bandwidth:.0%} |")
    median_layer = statistics.median(layers)
    slowest = max(range(len(layers)), key=layers.__getitem__)
    print(f"\nper layer: median {median_layer * 1e3:.3f} ms, slowest layer {slowest} "
          f"{layers[slowest] * 1e3:.3f} ms, fastest {min(layers) * 1e3:.3f} ms\n")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(PROFILED_STEPS):
            token = decode_one_token(model, cache, token).argmax(-1, keepdim=True)
    averages = prof.key_averages()
    print(averages.table(sort_by="self_cpu_time_total", row_limit=args.ops))
    print(kernels_and_the_rest(averages, step))


def kernels_and_the_rest(averages, step):
    """One line: a step (step seconds, timed without the profiler) split into the library's
    products and attention's fused kernel (their self time under torch.profiler, a step's share)
    and everything else (the small operators, Python between them, the cache's bookkeeping): the
    share no faster kernel can take, only fewer calls between kernels."""
    self_s = collections.defaultdict(float)
    for a in averages:
        self_s[a.key] += a.self_cpu_time_total / 1e6 / PROFILED_STEPS
    products = sum(self_s[k] for k in PRODUCT_KERNELS)
    attention = sum(self_s[k] for k in ATTENTION_KERNELS)
    rest = step - products - attention
    head = (f"the step's {step * 1e3:.2f} ms: the library's products {products * 1e3:.2f} ms "
            f"({products / step:.0%}), attention's fused kernel {attention * 1e3:.2f} ms "
            f"({attention / step:.0%}) (their self time under torch.profiler), ")
    if rest < 0:  # the profiled steps ran slower than the timed ones
        return head + "everything else not measurable here (a busy machine? run it again)"
    return head + (f"everything else {rest * 1e3:.2f} ms ({rest / step:.0%}): the small "
                   "operators, Python between them and the cache's bookkeeping (with --attention "
                   "or --products compiled, inductor's kernels too: the profiler does not name "
                   "them)")


if __name__ == "__main__":
    main()
