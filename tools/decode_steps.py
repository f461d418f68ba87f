"""
Decode step times of a source tree at a few contexts, in a fresh process: the tree's model and
cache, a cache filled by measure.probe.filled_cache (--offload none, chunk 512), 2 warm-up steps,
then the median and the fastest of 8 (issue 33: before and after, interleaved).

    python tools/decode_steps.py TREE fp32|bf16 1024,2048,6144 THREADS [none|int8|int4 [KV_DTYPE]]

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
         "[none|int8|int4 [KV_DTYPE]]")
if len(sys.argv) < 5 or sys.argv[2] not in ("fp32", "bf16") or not sys.argv[4].isdigit():
    print(USAGE, file=sys.stderr)
    sys.exit(2)
tree, dtype, contexts, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
quantize = sys.argv[5] if len(sys.argv) > 5 and sys.argv[5] != "none" else None
kv_dtype = sys.argv[6] if len(sys.argv) > 6 else "auto"  # --kv-dtype
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
if not CKPT:
    sys.exit("tools/decode_steps.py: set CKPT to a checkpoint directory (see the docstring)")
model = Transformer.from_pretrained(CKPT, dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[
    dtype], quantize=quantize)
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
