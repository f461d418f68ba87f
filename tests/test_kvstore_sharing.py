"""
Tasks that share a document through the persistent KV store (kvstore.py, task.PromptCache): the
ranks of a tensor-parallel replica adopt the same prefix.
"""
import torch

import task
from generate import Sampling
from kvcache import make_cache
from kvstore import KVStore
from model import Transformer
from offload import OffloadConfig
from task import PromptCache, run_task, timed_generate
from tp import Layout

C = 8     # chunk size
NEW = 4   # new tokens per task


def prompt(vocab_size, n_chunks=5, tail=3, seed=0):
    """n_chunks full chunks and a partial one: every full chunk can be adopted."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (n_chunks * C + tail,), generator=g).tolist()


def test_the_ranks_of_a_replica_adopt_the_prefix_every_rank_holds(llama_ckpt, tmp_path,
                                                                  monkeypatch):
    """Each rank of a tensor-parallel replica reads its own entries. If another rank's store lacks
    chunk 2 (evicted under its budget, or corrupt), this rank must stop at chunk 2 as well, or the
    ranks' prefill steps, and their collectives, would no longer match. A stand-in for agree_min
    plays the other rank."""
    model = Transformer.from_pretrained(llama_ckpt)
    ids = prompt(model.args.vocab_size)
    cold, _ = run_task(model, ids, NEW, chunk_size=C, cfg=OffloadConfig())
    store = KVStore(tmp_path / "s")
    run_task(model, ids, NEW, chunk_size=C, cfg=OffloadConfig(), kv_store=store,
             fingerprint="model-a")  # stores all 5 full chunks
    other_rank_has = [1, 1, 0, 1, 1]
    seen = []

    def agree_min(n, layout):
        assert layout.tp == 2
        other = other_rank_has[len(seen)]
        seen.append(n)
        return min(n, other)
    monkeypatch.setattr(task, "agree_min", agree_min)
    cache = make_cache(model, OffloadConfig(), C, len(ids) + NEW)
    prompt_cache = PromptCache(store, cache, ids, "model-a", model, Layout(tp=2))
    prompt_cache.adopt(cache)
    assert seen == [1, 1, 1]  # this rank holds chunk 2; the replica agrees that it is missing
    assert cache.n_sealed == 2 and prompt_cache.adopted == 2
    assert cache.length == 2 * C
    new, _ = timed_generate(model, cache, ids, NEW, sampling=Sampling(), eos_ids=(), out=[],
                            on_token=None, on_step=None, stream=None)
    assert new == cold
    assert prompt_cache.finish()["reused_tokens"] == 2 * C
