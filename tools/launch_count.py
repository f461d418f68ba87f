"""
Kernel launches of one decode step on the store's CUDA path, counted on CPU under the emulated CUDA
of tests/cuda_emu.py (issue 33: a decode step's launches should fall as its CPU calls did). Every
aten operator the step dispatches is counted; a view (an alias of its input: no kernel) and an
allocation are not launches, everything else (the attention kernel, a product, an elementwise op,
a copy between tiers or into a group buffer) is at least one.

    python tools/launch_count.py TREE --ckpt DIR [--context 32768] [--chunk-size 512] [--mode cpu]

TREE is a checkout of the project (its model, cache, store and emulator are the ones counted), so
two trees give before and after. The cache is filled with synthetic K and V through the cache's
own verbs (no prefill), then one decode step runs inside the emulation, after two untimed ones.
"""
import argparse
import collections
import json
import os
import sys
import tempfile

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("tree")
p.add_argument("--ckpt", required=True)
p.add_argument("--context", type=int, default=32768)
p.add_argument("--chunk-size", type=int, default=512)
p.add_argument("--mode", default="cpu", help="--offload mode of the store: none, cpu or disk")
p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
args = p.parse_args()
sys.path[:0] = [args.tree, os.path.join(args.tree, "tests")]

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import cuda_emu  # noqa: E402
from generate import decode_one_token  # noqa: E402
from kvcache import make_cache  # noqa: E402
from model import Transformer  # noqa: E402
from offload import OffloadConfig  # noqa: E402

ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


class Launches(TorchDispatchMode):
    """Counts the aten operators dispatched inside it: {name: calls}, views and allocations apart.
    """

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
        self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if func.is_view or name in ALLOCATIONS:
            self.views += 1
        else:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def fill(cache, model, ctx, C):
    """cache at ctx positions of synthetic K, V, written and sealed through the cache's verbs."""
    G = model.layers[0].attention.wk.out_features // model.args.head_dim
    while cache.length < ctx:
        off = cache.length % C
        n = min(C - off, ctx - cache.length)
        cache.begin(n)
        for layer in range(model.args.n_layers):
            kv = torch.rand(2, 1, G, n, model.args.head_dim).sub_(0.5).mul_(2)  # [2, 1, G, n, D]
            cache.layout.write(cache.store.open_chunk(layer), off, kv[0], kv[1])
        if cache.commit():
            cache.store.seal(cache.n_sealed - 1)


dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
model = Transformer.from_pretrained(args.ckpt, dtype=dtype)
token = torch.tensor([[3]])
with tempfile.TemporaryDirectory() as tmp, torch.no_grad(), cuda_emu.emulate() as emu:
    os.chmod(tmp, 0o700)
    cfg = OffloadConfig(mode=args.mode, offload_dir=tmp)
    cache = make_cache(model, cfg, args.chunk_size, args.context + 8)
    fill(cache, model, args.context, args.chunk_size)
    for _ in range(2):
        decode_one_token(model, cache, token)
    with Launches() as seen:
        decode_one_token(model, cache, token)
    torch.cuda.synchronize()
    cache.store.close()
    problems = emu.problems()
attention = sum(n for name, n in seen.ops.items() if "attention" in name)
print(json.dumps({"tree": args.tree, "context": args.context, "chunk_size": args.chunk_size,
                  "mode": args.mode, "dtype": args.dtype, "layers": model.args.n_layers,
                  "launches": sum(seen.ops.values()), "attention_kernels": attention,
                  "copies": seen.ops["copy_"] + seen.ops["_to_copy"], "views": seen.views,
                  "emulator_problems": len(problems),
                  "top": seen.ops.most_common(8)}))
