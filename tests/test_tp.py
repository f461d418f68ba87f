"""
tp.py judged against the one-process model: two launches of torchrun (2 ranks of one model, then 4
ranks as two replicas of 2), each running tests/tp_worker.py through many checks; this file compares
what every rank measured with what the unsharded model computes here. Then the pure functions:
refusals, the task split, the paper table.
"""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import tp_worker as W
from model import ModelArgs, Transformer
from offload import OffloadConfig
from runs.tp import (
    LLAMA_70B,
    Layout,
    Shard,
    TPError,
    init_distributed,
    load_sharded,
    per_rank_bytes,
    split_tasks,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RTOL = 1e-5  # of the largest logit: fp32 sums split over ranks and products in another order
# name -> (build_checkpoint kwargs, vocab mode); every case runs on 2 ranks
CASES = {
    # H=4, G=2: one kv head per rank
    "gqa": (dict(), "shard"),
    "gqa_replicated_vocab": (dict(), "replicate"),
    # row biases once
    "mha_bias": (dict(num_key_value_heads=4, attention_bias=True, mlp_bias=True), "shard"),
    # G=1 < N: the kv head replicated; V odd: the last rank's vocab rows padded
    "one_kv_head": (dict(arch="qwen2", num_key_value_heads=1, tie_word_embeddings=True,
                         vocab_size=127), "shard"),
}


def torchrun(spec, out, nproc):
    """tp_worker.py on nproc ranks: ([each rank's json], [each rank's tensors])."""
    with open(os.path.join(out, "spec.json"), "w") as f:
        json.dump(spec, f)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", os.path.join(ROOT, "tests", "tp_worker.py"),
           os.path.join(out, "spec.json"), out]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    results = []
    for r in range(nproc):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            results.append(json.load(f))
        with open(os.path.join(out, f"threads{r}.json")) as f:
            results[-1]["backend_threads"] = json.load(f)
    tensors = [load_file(os.path.join(out, f"rank{r}.safetensors")) for r in range(nproc)]
    return results, tensors


@pytest.fixture(scope="module")
def ckpts(checkpoint):
    return {name: checkpoint(**kwargs) for name, (kwargs, _) in CASES.items()}


@pytest.fixture(scope="module")
def two_ranks(ckpts, tmp_path_factory):
    """(per-rank json, per-rank tensors) of one 2-rank launch over every case."""
    cases = [{"name": n, "ckpt": ckpts[n], "vocab": v, "resume": n == "gqa"}
             for n, (_, v) in CASES.items()]
    return torchrun({"tp": 2, "cases": cases}, str(tmp_path_factory.mktemp("tp2")), 2)


@pytest.fixture(scope="module")
def reference(ckpts):
    """What one process computes: logits of a full forward, greedy run_task (tokens, step logits),
    sampled."""
    def get(name):
        model = Transformer.from_pretrained(ckpts[name])
        with torch.inference_mode():
            logits = model(W.tokens_for_logits(model.args.vocab_size))
        tokens, steps, _ = W.run(model, None, OffloadConfig())
        sampling = W.gen.Sampling(temperature=1.0, seed=100)
        sampled, _, _ = W.run(model, None, OffloadConfig(), sampling)
        return {"logits": logits, "tokens": tokens, "steps": steps, "sampled": sampled,
                "model": model}
    return {name: get(name) for name in CASES}


# -----------------------------------------------------------------------------
# 2 ranks against 1 process

@pytest.mark.parametrize("case", list(CASES))
def test_tp_greedy_tokens_equal_one_process(two_ranks, reference, case):
    results, _ = two_ranks
    for r in results:
        assert r[case]["tokens"] == reference[case]["tokens"], f"rank {r['rank']}"


@pytest.mark.parametrize("case", list(CASES))
def test_tp_logits_within_1e5_of_one_process(two_ranks, reference, case):
    _, tensors = two_ranks
    ref = reference[case]
    for t in tensors:
        # model(tokens), no cache
        scale = ref["logits"].abs().max().item()
        assert (t[f"{case}.logits"] - ref["logits"]).abs().max().item() < RTOL * scale
        # every cached step
        assert (t[f"{case}.steps"] - ref["steps"]).abs().max().item() < RTOL * scale
    # the ranks see one set of logits
    assert torch.equal(tensors[0][f"{case}.steps"], tensors[1][f"{case}.steps"])


@pytest.mark.parametrize("case", list(CASES))
def test_tp_disk_offload_bit_identical_to_none(two_ranks, case):
    results, _ = two_ranks
    for r in results:
        assert r[case]["disk_bit_identical"] and r[case]["disk_tokens"] == r[case]["tokens"]
        assert r[case]["disk_chunks"] > 0  # the disk tier was in use


def test_tp_selection_per_rank_bit_identical_across_modes(two_ranks):
    """Under --select quest each rank scores chunks with the heads it holds and reads its own
    choice; the ranks stay on rank 0's tokens, and each rank's disk tier matches its own
    --offload none bit for bit."""
    results, _ = two_ranks
    for r in results:
        assert r["gqa"]["quest_disk_bit_identical"] and r["gqa"]["quest_skipped"] > 0
    assert results[0]["gqa"]["quest_tokens"] == results[1]["gqa"]["quest_tokens"]


def test_leaving_the_process_group_ends_the_backends_threads(two_ranks):
    """launch.finish leaves no gloo thread behind on any rank. One that outlives the process group
    can still be releasing the last collective's tensors while the interpreter shuts down, and the
    process then aborts ("terminate called without an active exception") after its work is done:
    a torchrun batch that finished would exit 1, now and then."""
    results, _ = two_ranks
    for r in results:
        assert r["backend_threads"] == [], r["backend_threads"]


@pytest.mark.parametrize("case", list(CASES))
def test_tp_each_rank_reads_only_its_slices(two_ranks, reference, case):
    results, _ = two_ranks
    model = reference[case]["model"]
    vocab = CASES[case][1]
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    model_args = model.args
    E = model_args.dim
    D = model_args.head_dim
    pad = (-model_args.vocab_size) % 2 * E * 4  # zero rows on the last rank, held but not read
    for r in results:
        c = r[case]
        assert c["loaded_bytes"] + pad * (r["tp_rank"] == 1) == c["held_bytes"] < whole
        assert c["local_heads"] == model_args.n_heads // 2
        assert c["local_kv_heads"] == max(1, model_args.n_kv_heads // 2)
        assert c["wk_rows"] == c["local_kv_heads"] * D
    # with every table cut, two ranks together read the file once (plus replicated norms)
    if vocab == "shard":
        # row biases are read by the leader alone: once
        norms = (2 * model_args.n_layers + 1) * E * 4
        # a single kv head is read by both ranks: wk and wv (with their biases) twice
        kv_copies = ((model_args.n_kv_heads == 1) * 2 * model_args.n_layers * D * E * 4
                     * (1 + model_args.qkv_bias / E))
        assert sum(r[case]["loaded_bytes"] for r in results) == whole + norms + kv_copies


@pytest.mark.parametrize("case", list(CASES))
def test_tp_measured_bytes_equal_paper(two_ranks, case):
    """per_rank_bytes on paper = what the leader holds (weights) and what its store allocates (KV, 2
    chunks)."""
    results, _ = two_ranks
    leader = results[0][case]
    assert leader["held_bytes"] == leader["predicted"]["weights"]
    assert leader["kv_measured"] == leader["predicted"]["kv"]
    # no row biases off the leader
    assert results[1][case]["held_bytes"] <= leader["predicted"]["weights"]


def test_tp_sampling_follows_the_leader(two_ranks, reference):
    """Each rank samples with its own seed; broadcast_token must put every rank on the leader's
    sequence."""
    results, _ = two_ranks
    for case in CASES:
        sampled = reference[case]["sampled"]
        assert results[0][case]["sampled"] == results[1][case]["sampled"] == sampled


def test_tp_resume_from_the_prefix_every_rank_vouches_for(two_ranks, reference):
    """Rank 1's chunk 1 was damaged: rank 0 could restore more, but both must resume from chunk 1
    together."""
    results, _ = two_ranks
    assert results[0]["gqa"]["chunks_before"] >= 2  # so rank 0 alone would have resumed further
    for r in results:
        assert r["gqa"]["resumed_from"] == W.C
        assert r["gqa"]["resume_tokens"] == reference["gqa"]["tokens"]
        assert not r["gqa"]["task_dir_left"]  # task_<id>/ and its rank<r>/ removed on success


def test_tp_gather_stats_on_the_leader(two_ranks):
    results, _ = two_ranks
    assert [s["rank"] for s in results[0]["gqa"]["gathered"]] == [0, 1]
    assert results[1]["gqa"]["gathered"] is None


def test_dp_two_replicas_of_two_ranks(ckpts, reference, tmp_path):
    """4 ranks = 2 replicas x 2 ranks: every task runs on exactly one replica, with the one-process
    tokens."""
    tasks = [{"id": f"task-{i}", "seed": 10 + i} for i in range(6)]
    spec = {"tp": 2, "cases": [{"name": "gqa", "ckpt": ckpts["gqa"]}], "tasks": tasks}
    results, _ = torchrun(spec, str(tmp_path), 4)
    model = reference["gqa"]["model"]
    seen = []
    for r in results:
        dp = r["dp"]
        assert dp["replica"] == r["rank"] // 2 and dp["is_leader"] == (r["rank"] % 2 == 0)
        for tid, done in dp["tasks"].items():
            seed = next(t["seed"] for t in tasks if t["id"] == tid)
            assert done["tokens"] == W.run(model, None, OffloadConfig(), seed=seed)[0]
            assert done["ranks"] == (2 if dp["is_leader"] else 0)
        if dp["is_leader"]:
            seen += list(dp["tasks"])
    assert sorted(seen) == sorted(t["id"] for t in tasks)  # each task once: covering and disjoint


# -----------------------------------------------------------------------------
# no processes needed

def test_refusals_are_one_sentence(llama_ckpt, monkeypatch):
    model_args = ModelArgs(n_heads=6, n_kv_heads=6, hidden_dim=128)
    with pytest.raises(TPError, match=r"^4 ranks cannot split the model's 6 attention heads "
                                      r"evenly; .*divides 6$"):
        Shard.of(model_args, 4, 0)
    with pytest.raises(TPError, match="2 ranks cannot share the model's 3 key/value heads"):
        Shard.of(ModelArgs(n_heads=6, n_kv_heads=3, hidden_dim=128), 2, 0)
    with pytest.raises(TPError, match="intermediate_size"):
        Shard.of(ModelArgs(n_heads=4, n_kv_heads=4, hidden_dim=130), 4, 0)
    # before any read
    with pytest.raises(TPError, match="3 ranks cannot split the model's 4 attention heads"):
        load_sharded(llama_ckpt, Layout(rank=0, world=3, tp=3))
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(TPError, match="the world of 4 ranks cannot be cut into tensor-parallel "
                                      "groups of 3"):
        init_distributed(tp=3)


def test_one_process_layout_loads_the_whole_model(llama_ckpt):
    ours = load_sharded(llama_ckpt, Layout.single())
    ref = Transformer.from_pretrained(llama_ckpt)
    for (n, p), (m, q) in zip(ours.named_parameters(), ref.named_parameters()):
        assert n == m and torch.equal(p, q)


@pytest.mark.parametrize("H,G,N", [(4, 2, 2), (8, 2, 4), (64, 8, 16), (4, 1, 4), (8, 8, 2)])
def test_each_rank_holds_the_kv_heads_its_query_heads_read(H, G, N):
    model_args = ModelArgs(n_heads=H, n_kv_heads=G, hidden_dim=64)
    for r in range(N):
        s = Shard.of(model_args, N, r)
        assert len(s.heads) == H // N and len(s.kv_heads) == max(1, G // N)
        # the one-process query -> kv head map
        assert {i // (H // G) for i in s.heads} == set(s.kv_heads)


def test_split_tasks_deterministic_disjoint_covering():
    ids = [f"doc-{i}" for i in range(1000)]
    parts = [split_tasks(ids, 3, g) for g in range(3)]
    assert sorted(sum(parts, [])) == sorted(ids)                    # covering
    assert sum(len(p) for p in parts) == len(set(sum(parts, [])))  # disjoint
    assert all(280 < len(p) < 390 for p in parts)                   # about a third each
    # adding a task moves no other
    assert [t for t in split_tasks(ids + ["new"], 3, 1) if t != "new"] == parts[1]
    # a stable hash, not Python's salted hash(): these assignments hold in every process, on every
    # run
    groups = [g for t in ("a", "b", "c", "task-7") for g in range(4) if split_tasks([t], 4, g)]
    assert groups == [2, 2, 2, 1]


def test_per_rank_table_70b():
    """The paper table of the README: weights and KV per rank shrink as 1/N (the norms stay
    whole)."""
    GiB = 2 ** 30
    one = per_rank_bytes(LLAMA_70B, 1, 32768)
    # 70.6 B parameters, 320 KiB/token
    assert 131 < one["weights"] / GiB < 132 and one["kv"] == 10 * GiB
    for n in (2, 4, 8):
        b = per_rank_bytes(LLAMA_70B, n, 32768)
        assert b["kv"] * n == one["kv"]
        assert abs(b["weights"] * n / one["weights"] - 1) < 1e-3
        rep = per_rank_bytes(LLAMA_70B, n, 32768, vocab="replicate")
        # both tables, bf16
        assert rep["weights"] - b["weights"] == 2 * (128256 - 128256 // n) * 8192 * 2
    # 8 kv heads, 16 ranks: one head each
    assert per_rank_bytes(LLAMA_70B, 16, 32768)["kv"] == one["kv"] // 8
