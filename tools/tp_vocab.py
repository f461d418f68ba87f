"""
The measurement behind tp.py's default vocab="shard": weight bytes per rank and decode speed with
the embedding and output head cut by vocab rows against kept whole on every rank, on a model whose
two vocab tables are a large part of it (here 84%; Llama-3.2-1B: 21%, tied; Llama-3-70B: 3%).

    python tools/tp_vocab.py build /tmp/vocab_ckpt    # a random checkpoint, E=512, V=32000
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 tools/tp_vocab.py /tmp/vocab_ckpt
"""
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import torch  # noqa: E402

SHAPE = dict(hidden_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
             intermediate_size=1536, vocab_size=32000)


def main():
    if sys.argv[1] == "build":
        from ckpt import build_checkpoint
        build_checkpoint(sys.argv[2], **SHAPE)
        return
    from generate import decode_one_token, prefill
    from kvcache import make_cache
    from offload import OffloadConfig
    from runs.tp import agree_min, init_distributed, load_sharded
    torch.set_num_threads(1)
    layout = init_distributed()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, SHAPE["vocab_size"], (1, 64), generator=g)             # [B, T]
    models = {vocab: load_sharded(sys.argv[1], layout, vocab=vocab)
              for vocab in ("replicate", "shard")}
    best = {vocab: float("inf") for vocab in models}
    # the best of five, the two modes taking turns: other processes share these cores
    for _ in range(5):
        for vocab, model in models.items():
            cache = make_cache(model, OffloadConfig(), 64, 256)
            prefill(model, cache, prompt)
            token = prompt[:, -1:]
            agree_min(0, layout)  # start the clock together
            t = time.perf_counter()
            for _ in range(32):
                token = decode_one_token(model, cache, token).argmax(-1, keepdim=True)
            best[vocab] = min(best[vocab], (time.perf_counter() - t) / 32)
            cache.store.close()
    for vocab, model in models.items():
        held = sum(p.numel() * p.element_size() for p in model.parameters())
        if layout.is_leader:
            print(f"N={layout.tp} vocab={vocab:9s} weights per rank {held / 2**20:6.1f} MiB | "
                  f"decode {best[vocab] * 1e3:.2f} ms/token")


if __name__ == "__main__":
    main()
