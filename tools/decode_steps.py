"""
Decode step times of a source tree at a few contexts, in a fresh process: the tree's model and
cache, a cache filled by measure.probe.filled_cache (--offload none, chunk 512), 2 warm-up steps,
then the median and the fastest of 8 (issue 33: before and after, interleaved).

    python tools/decode_steps.py TREE fp32|bf16 1024,2048,6144 THREADS [none|int8|int4[-gN] [KV]]

$ATTENTION=flash|compiled|auto runs the tree with that --attention (default flash, generate.py's;
its build before the steps, timed), $PRODUCTS=compiled with --products compiled (a tree that has
them).
The checkpoint is $CKPT (a Hugging Face directory: `python -m measure.random_model smollm2-135m
DIR --dtype fp32` makes the one docs/performance.md measures).
"""
import json
import os
import statistics
import sys
import time

USAGE = ("usage: python tools/decode_steps.py TREE fp32|bf16 1024,2048,6144 THREADS "
         "[none|int8|int4|int4-g32|int4-g64|int4-g128 [auto|bf16|fp16|int8|int4]]")


def refuse(why):
    """A wrong argument: one line naming it, and the usage, exit 2."""
    print(f"tools/decode_steps.py: {why}\n{USAGE}", file=sys.stderr)
    sys.exit(2)


args = sys.argv[1:] + [None] * (6 - len(sys.argv[1:]))
tree, dtype, contexts, threads, quantize, kv_dtype = args[:6]
if None in (tree, dtype, contexts, threads):
    refuse("TREE, a dtype, contexts and a thread count are needed")
if not os.path.isfile(os.path.join(tree, "model.py")):
    refuse(f"TREE {tree} is not a source tree of this project (no model.py in it)")
if dtype not in ("fp32", "bf16"):
    refuse(f"dtype {dtype!r} is not fp32 or bf16")
if not all(c.isdigit() and int(c) > 0 for c in contexts.split(",")):
    refuse(f"contexts {contexts!r} are not comma-separated positive token counts")
if not threads.isdigit() or int(threads) < 1:
    refuse(f"THREADS {threads!r} is not a count >= 1")
threads = int(threads)
quantize = None if quantize in (None, "none") else quantize
quantize = "int4-g32" if quantize == "int4" else quantize  # --quantize int4's default group
if quantize not in (None, "int8", "int4-g32", "int4-g64", "int4-g128"):
    refuse(f"quantize {quantize!r} is not none, int8 or int4-gN (N 32, 64 or 128)")
kv_dtype = kv_dtype or "auto"  # --kv-dtype
if kv_dtype not in ("auto", "bf16", "fp16", "int8", "int4"):
    refuse(f"KV dtype {kv_dtype!r} is not auto, bf16, fp16, int8 or int4")
if os.environ.get("ATTENTION", "flash") not in ("flash", "compiled", "auto"):
    refuse(f"ATTENTION={os.environ['ATTENTION']} is not flash, compiled or auto")
if os.environ.get("PRODUCTS", "library") not in ("library", "compiled"):
    refuse(f"PRODUCTS={os.environ['PRODUCTS']} is not library or compiled")
sys.path.insert(0, tree)
import torch  # noqa: E402

from generate import decode_one_token  # noqa: E402
from measure.probe import filled_cache  # noqa: E402
from model import Transformer  # noqa: E402

torch.set_num_threads(threads)
kernel = os.environ.get("ATTENTION", "flash")
products = os.environ.get("PRODUCTS", "library")
if kernel != "flash" or products != "library" or os.path.exists(os.path.join(tree, "fewrows.py")):
    import fewrows  # noqa: E402
    fewrows.KERNEL = kernel
    fewrows.PRODUCTS = products
CKPT = os.environ.get("CKPT")
if not CKPT or not os.path.isdir(CKPT):
    refuse("set CKPT to a checkpoint directory (see the docstring)")
model = Transformer.from_pretrained(CKPT, dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[
    dtype], quantize=quantize)
if max(int(c) for c in contexts.split(",")) + 12 > model.args.max_context:
    refuse(f"contexts {contexts}: past the model's {model.args.max_context} positions")
out = {}
for ctx in [int(c) for c in contexts.split(",")]:
    cache = filled_cache(model, ctx, 512, 12, kv_dtype)
    token = torch.tensor([[3]])
    for _ in range(2):
        decode_one_token(model, cache, token)
    times = []
    for _ in range(8):
        start = time.perf_counter()
        decode_one_token(model, cache, token)
        times.append(time.perf_counter() - start)
    cache.store.close()
    out[ctx] = {"median_ms": statistics.median(times) * 1e3, "fastest_ms": min(times) * 1e3}
fewrows = sys.modules.get("fewrows")
build_s = sum(getattr(fewrows, "BUILD_SECONDS", {}).values())  # the compiled kernel's build
print(json.dumps({"tree": tree, "build_s": round(build_s, 2), "dtype": dtype,
                  "quantize": quantize, "kv_dtype": kv_dtype, "attention": kernel,
                  "products": products,
                  "threads": threads,
                  "steps": out}))
