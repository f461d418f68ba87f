"""
One rank of the tensor-parallel tests; started by tests/test_tp.py through torchrun, never by pytest
itself.

    torchrun --standalone --nproc-per-node 2 tests/tp_worker.py SPEC.json OUT_DIR

SPEC.json: {"tp": N, "cases": [{"name", "ckpt", "vocab", "resume"}], "tasks": [...] (data
parallel)}. Each rank writes what it measured to OUT_DIR/rank<r>.json (and .safetensors for logits);
the test compares them with the one-process model. Everything is checked by the test, not here, so a
failure shows as a pytest assertion.
"""
import json
import os
import sys

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import generate as gen  # noqa: E402
from disk import ALIGN, round_up  # noqa: E402
from kvcache import make_cache  # noqa: E402
from offload import OffloadConfig  # noqa: E402
from runs import launch  # noqa: E402
from runs.launch import backend_threads  # noqa: E402
from runs.task import run_task  # noqa: E402
from runs.tp import (  # noqa: E402
    agree_min,
    gather_stats,
    init_distributed,
    load_sharded,
    per_rank_bytes,
    split_tasks,
)

# a 20-token prompt ends mid-chunk, decoding crosses two boundaries
C = 8       # chunk size
N_NEW = 12  # new tokens


def prompt(vocab_size, n=20, seed=3):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (n,), generator=generator).tolist()


def tokens_for_logits(vocab_size):
    return torch.randint(0, vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))


def held_bytes(model):
    # a tied matrix counts once
    seen = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    return sum(seen.values())


def run(model, layout, cfg, sampling=gen.Sampling(), task_id="t", fingerprint=None, seed=3):
    """run_task with every step's logits kept. The test's one-process reference calls it with
    layout=None."""
    steps = []

    def on_step(phase, logits, cache):
        steps.append(logits.clone())
    ids = prompt(model.args.vocab_size, seed=seed)
    new, stats = run_task(model, ids, N_NEW, chunk_size=C, cfg=cfg, sampling=sampling,
                          task_id=task_id, on_step=on_step, fingerprint=fingerprint, layout=layout)
    return new, torch.cat(steps), stats


def tp_case(case, layout, out, tensors):
    torch.manual_seed(0)
    model = load_sharded(case["ckpt"], layout, vocab=case["vocab"])
    model_args = model.args
    name = case["name"]
    r = layout.tp_rank
    res = {"loaded_bytes": model.loaded_bytes, "held_bytes": held_bytes(model),
           "local_heads": model.layers[0].attention.wq.out_features // model.args.head_dim,
           "local_kv_heads": model.layers[0].attention.wk.out_features // model.args.head_dim,
           "wk_rows": model.layers[0].attention.wk.weight.shape[0]}
    with torch.inference_mode():
        tensors[f"{name}.logits"] = model(tokens_for_logits(model_args.vocab_size))
    res["tokens"], tensors[f"{name}.steps"], _ = run(model, layout, OffloadConfig())
    off = os.path.join(out, f"off_{name}")
    disk = OffloadConfig(mode="disk", window=1, offload_dir=off)
    res["disk_tokens"], disk_steps, stats = run(model, layout, disk)
    res["disk_bit_identical"] = torch.equal(disk_steps, tensors[f"{name}.steps"])
    res["disk_chunks"] = stats["chunks"]["disk"]
    res["gathered"] = gather_stats({"rank": r, "disk_chunks": stats["chunks"]["disk"]}, layout)
    if name == "gqa":  # a query-aware selection: each rank selects for the heads it holds
        sel = dict(window=0, select="quest", select_budget=2 * C, select_dense=0)
        res["quest_tokens"], quest_none, quest_stats = run(model, layout, OffloadConfig(**sel))
        res["quest_skipped"] = quest_stats["bytes"]["select_skipped"]
        quest_cfg = OffloadConfig(mode="disk", offload_dir=off, **sel)
        _, quest_disk, _ = run(model, layout, quest_cfg)
        res["quest_disk_bit_identical"] = torch.equal(quest_none, quest_disk)

    # KV per rank, measured from the chunk tensors the store holds after a 2-chunk prefill
    cache = make_cache(model, OffloadConfig(), C, 4 * C)
    gen.prefill(model, cache, torch.tensor([prompt(model_args.vocab_size, 2 * C)]))
    res["kv_measured"] = sum(t.numel() * t.element_size() for t in cache.store.resident.values())
    res["kv_shape"] = list(next(iter(cache.store.resident.values())).shape)
    cache.store.close()
    res["predicted"] = per_rank_bytes(model_args, layout.tp, 2 * C, torch.float32, case["vocab"])

    # sampling with a different seed on every rank: only run_task's broadcast keeps the ranks on one
    # sequence
    sampling = gen.Sampling(temperature=1.0, seed=100 + r)
    res["sampled"], _, _ = run(model, layout, OffloadConfig(), sampling)

    # rank 1's chunk 1 fails its checksum: every rank must resume from chunk 1
    if case.get("resume"):
        keep = OffloadConfig(mode="disk", window=1, offload_dir=off, keep_files=True)
        run(model, layout, keep, task_id="r", fingerprint="fp")
        rank_dir = os.path.join(off, "task_r", f"rank{r}")
        with open(os.path.join(rank_dir, "manifest.json")) as f:
            res["chunks_before"] = len(json.load(f)["chunks"])
        if r == 1:
            slot = round_up(2 * res["local_kv_heads"] * C * model_args.head_dim * 4, ALIGN)
            with open(os.path.join(rank_dir, "layer0.kv"), "r+b") as f:
                f.seek(slot + 16)
                byte = f.read(1)
                f.seek(slot + 16)
                f.write(bytes([byte[0] ^ 0xFF]))
        agree_min(0, layout)  # a barrier: rank 1's chunk is damaged before anyone reads it
        res["resume_tokens"], _, stats = run(model, layout, disk, task_id="r", fingerprint="fp")
        res["resumed_from"] = stats["resumed_from"]
        agree_min(0, layout)  # every rank has closed its store
        res["task_dir_left"] = os.path.exists(os.path.join(off, "task_r"))
    return res


def dp_tasks(spec, layout):
    """Data parallel: each replica runs its share of the tasks; its leader reports them."""
    mine = split_tasks([t["id"] for t in spec["tasks"]], layout.n_replicas, layout.replica)
    model = load_sharded(spec["cases"][0]["ckpt"], layout)
    done = {}
    for t in spec["tasks"]:
        if t["id"] in mine:
            new, _, stats = run(model, layout, OffloadConfig(), task_id=t["id"], seed=t["seed"])
            done[t["id"]] = {"tokens": new, "ranks": len(gather_stats(stats, layout) or [])}
    return {"replica": layout.replica, "is_leader": layout.is_leader, "tasks": done}


def main():
    spec_path, out = sys.argv[1], sys.argv[2]
    with open(spec_path) as f:
        spec = json.load(f)
    torch.set_num_threads(1)
    layout = init_distributed(spec.get("tp"))
    result = {"rank": layout.rank, "tp_rank": layout.tp_rank, "world": layout.world}
    tensors = {}
    if spec.get("tasks"):
        result["dp"] = dp_tasks(spec, layout)
    else:
        for case in spec["cases"]:
            result[case["name"]] = tp_case(case, layout, out, tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()},
              os.path.join(out, f"rank{layout.rank}.safetensors"))
    with open(os.path.join(out, f"rank{layout.rank}.json"), "w") as f:
        json.dump(result, f)
    launch.finish(layout)
    return layout.rank, out


if __name__ == "__main__":
    rank, out = main()
    # what launch.exit sees: the backend's threads left once main's model and layout are gone
    with open(os.path.join(out, f"threads{rank}.json"), "w") as f:
        json.dump(backend_threads(), f)
    launch.exit(0)
