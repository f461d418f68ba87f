"""
Tasks that share their decode steps (generate.decode_batch, batcher.Batcher, --batch-size): every
task's logits and tokens are the bits it gets alone, in bf16 (one product for all rows) and fp32
(rows kept apart, rowwise.py), at different positions, on different tiers, across chunk boundaries;
a task whose disk fails leaves the batch and falls back alone while the others go on; refusals.
(The batch killed mid-way and rerun is in test_batch.py, as are fp32 sampled batches against
serial results.)
"""
import errno
import re
import threading

import pytest
import torch

import disk
import fewrows
import kvbatch
import model as model_module
import rowwise
from generate import decode_batch, decode_one_token, prefill
from kvcache import make_cache
from model import Transformer
from offload import OffloadConfig
from rowwise import linear
from runs import proofs
from test_batch import TOPICS, batch_args, by_id, run_main, write_tasks

C = 8
PROMPTS = (13, 40, 7, 64, 29)  # tokens: each task at its own position, several chunks apart
STEPS = 12                     # decode steps: every task crosses a chunk boundary
CFGS = [dict(), dict(mode="disk", window=1), dict(mode="cpu", window=0), dict(mode="disk"),
        dict(mode="disk", window=2, compress="zstd")]


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def model(request, checkpoint):
    return Transformer.from_pretrained(checkpoint(num_hidden_layers=3), dtype=request.param)


def prompts(vocab):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (1, n), generator=g) for n in PROMPTS]


def cfg(i, tmp):
    return OffloadConfig(offload_dir=str(tmp), **CFGS[i % len(CFGS)])


def alone(model, ids, config, steps=STEPS, kv_dtype="auto"):
    """Greedy decode of one task by itself: the logits of every step."""
    cache = make_cache(model, config, C, 200, kv_dtype=kv_dtype)
    logits = prefill(model, cache, ids)
    seen = []
    for _ in range(steps):
        seen.append(logits.clone())
        logits = decode_one_token(model, cache, logits.argmax(-1, keepdim=True))
    cache.store.close()
    return seen


def test_a_batched_step_gives_every_task_its_lone_bits(model, tmp_path):
    """Five tasks at positions 7 to 64, on five different tier setups: each row of every batched
    step equals, bit for bit, the logits of that task decoding alone."""
    ids = prompts(model.args.vocab_size)
    ref = [alone(model, p, cfg(i, tmp_path / f"a{i}")) for i, p in enumerate(ids)]
    caches = [make_cache(model, cfg(i, tmp_path / f"b{i}"), C, 200) for i in range(len(ids))]
    logits = torch.cat([prefill(model, c, p) for c, p in zip(caches, ids)])
    for step in range(STEPS):
        for i in range(len(ids)):
            assert torch.equal(logits[i:i + 1], ref[i][step]), f"task {i}, step {step}"
        logits, failed = decode_batch(model, caches, logits.argmax(-1, keepdim=True))
        assert not failed
    tiers = [c.store.snapshot()["chunks"] for c in caches]
    assert tiers[1]["disk"] > 0 and tiers[2]["host"] > 0  # the tiers were really in use
    for c in caches:
        c.store.close()


def test_linear_keeps_rows_apart_whatever_the_platform(model):
    """rowwise.linear: row i of a B-row call is the 1-row product's bits, for every layer kind of
    the model and every row count, whether the platform's matmul is row-invariant or not."""
    g = torch.Generator().manual_seed(1)
    layers = [model.layers[0].attention.wq, model.layers[0].feed_forward.w2, model.output]
    for layer in layers:
        for B in (2, 3, 4, 7, 16):
            x = torch.randn(B, 1, layer.weight.shape[1], generator=g).to(model.output.weight.dtype)
            rows = torch.cat([layer(x[i:i + 1]) for i in range(B)])
            assert torch.equal(linear(layer, x), rows), (layer, B)


def test_the_batch_and_the_lone_model_agree_on_a_reference_call(model):
    """model(tokens) with B rows (the reference path, no cache) equals B lone calls too: the
    linears keep rows apart everywhere, not only in decode_batch."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, model.args.vocab_size, (3, 5), generator=g)
    full = model(ids)
    rows = torch.cat([model(ids[i:i + 1]) for i in range(3)])
    assert torch.equal(full, rows)


# -----------------------------------------------------------------------------
# the command line

MIXED = [{"id": "long", "prompt": TOPICS["pass"][:300], "max_new_tokens": 20},
         {"id": "sampled", "prompt": TOPICS["break"][:120], "max_new_tokens": 14,
          "temperature": 0.9, "seed": 5},
         {"id": "short", "prompt": TOPICS["del"][:40], "max_new_tokens": 3},
         {"id": "mid", "prompt": TOPICS["continue"][:200], "max_new_tokens": 9},
         {"id": "late", "prompt": TOPICS["else"][:80], "max_new_tokens": 11}]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_a_batch_gives_each_task_its_lone_result(text_ckpt, tmp_path, capsys, monkeypatch,
                                                 dtype):
    """Five tasks of different lengths (one sampled), three in flight: a task that finishes leaves,
    the next joins; every result line equals --batch-size 1's. Every forward pass of the batch,
    prefill or decode, runs on one thread (batcher.py: one OpenMP team)."""
    tasks = write_tasks(tmp_path / "tasks.jsonl", MIXED)
    flags = ["--offload", "disk", "--chunk-size", C, "--window", 1, "--dtype", dtype]
    threads = []
    forward = Transformer.forward

    def recorded(self, *args, **kwargs):
        threads.append(threading.get_ident())
        return forward(self, *args, **kwargs)
    monkeypatch.setattr(Transformer, "forward", recorded)
    results = {}
    for n in (1, 3):
        out = tmp_path / f"r{n}.jsonl"
        argv = batch_args(text_ckpt, tasks, out, tmp_path / f"off{n}", *flags, "--batch-size", n)
        threads.clear()
        rc, err = run_main(argv, capsys)
        assert rc == 0, err
        results[n] = by_id(out)
        if n > 1:
            assert re.search(r"batched: \d+ decode steps for \d+ tokens", err), err
            assert len(set(threads)) == 1 and threading.get_ident() not in threads
    assert sorted(results[1]) == sorted(results[3]) == sorted(t["id"] for t in MIXED)
    for task_id, r in results[3].items():
        assert r["tokens"] == results[1][task_id]["tokens"], task_id


def test_a_task_whose_disk_fails_leaves_the_batch_and_falls_back(text_ckpt, tmp_path, capsys,
                                                                 monkeypatch):
    """Task "mid" cannot write its disk tier: it leaves the batch, reruns on host memory
    (--fallback-cpu-budget) and still gives its lone tokens; the others are untouched."""
    tasks = write_tasks(tmp_path / "tasks.jsonl", MIXED)
    flags = ["--offload", "disk", "--chunk-size", C, "--window", 1, "--dtype", "bf16"]
    ref_out = tmp_path / "ref.jsonl"
    rc, err = run_main(batch_args(text_ckpt, tasks, ref_out, tmp_path / "o1", *flags,
                                  "--batch-size", 1), capsys)
    assert rc == 0, err
    real_write = disk.DiskTier.write

    def write(self, layer, j, src):
        if "task_mid" in self.path:
            raise disk.DiskError(errno.ENOSPC, "No space left on device")
        return real_write(self, layer, j, src)
    monkeypatch.setattr(disk.DiskTier, "write", write)
    out = tmp_path / "out.jsonl"
    rc, err = run_main(batch_args(text_ckpt, tasks, out, tmp_path / "o2", *flags, "--batch-size",
                                  4, "--fallback-cpu-budget", 1), capsys)
    assert rc == 0, err
    assert "task mid: the disk tier failed" in err and "falling back to host memory" in err, err
    got = by_id(out)
    ref = by_id(ref_out)
    assert {k: r["tokens"] for k, r in got.items()} == {k: r["tokens"] for k, r in ref.items()}
    assert got["mid"]["stats"]["chunks"]["host"] > 0 and got["long"]["stats"]["chunks"]["disk"] > 0


def test_the_tasks_in_flight_share_the_cpu_budget(text_ckpt, tmp_path, capsys):
    """--cpu-budget is the batch's: three tasks in flight hold a third of it each, and one whose
    third is too small says so, naming the share and --batch-size."""
    tasks = write_tasks(tmp_path / "tasks.jsonl", MIXED[:3])
    flags = ["--offload", "cpu", "--chunk-size", C, "--window", 1, "--cpu-budget", "0.00003"]
    rc, err = run_main(batch_args(text_ckpt, tasks, tmp_path / "r.jsonl", tmp_path / "o",
                                  *flags, "--batch-size", 4), capsys)
    assert rc == 1 and "--cpu-budget 1e-05 GiB (this task's share: 3 tasks in flight" in err, err
    assert "lower --batch-size" in err, err


@pytest.mark.parametrize("argv,needle", [
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--batch-size", "-2"], "--batch-size must be >= 1"),
    (["--prompt", "hello", "--batch-size", "4"], "--batch-size goes with --prompts"),
])
def test_bad_batch_sizes_are_one_sentence(text_ckpt, tmp_path, capsys, argv, needle):
    tasks = write_tasks(tmp_path / "tasks.jsonl", MIXED[:1])
    if "--prompt" not in argv:
        argv = ["--prompts", str(tasks), "--output", str(tmp_path / "r.jsonl"), *argv]
    rc, err = run_main(["--ckpt", text_ckpt, *argv], capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and needle in lines[0], err


# -----------------------------------------------------------------------------
# verify.py --batch: the proof on the user's own checkpoint, and that it can fail

VERIFY = ["--chunk-size", "16", "--window", "1", "--max-new-tokens", "24",
          "--max-prompt-tokens", "120", "--batch", "3", "--modes", "disk"]


def test_verify_batch_proves_every_task_equals_itself_alone(text_ckpt, tmp_path, capsys):
    """Every task of the batch equals itself alone, with --offload none through the shared arena's
    grid (every task's sealed chunks of a layer in one call) and with a disk tier a task at a
    time."""
    rc = proofs.main(["--ckpt", text_ckpt, *VERIFY, "--offload-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    lines = {mode: next(line for line in out.splitlines() if f"batch of 3, {mode}:" in line)
             for mode in ("none", "disk")}
    for mode, line in lines.items():
        assert "3 of 3 tasks bit-identical" in line, out
        assert ("attended every task's chunks in one call" in line) == (mode == "none"), out


@pytest.mark.parametrize("extra", [["--batch", "3"], ["--speculate", "lookup:3"]],
                         ids=["batch", "speculate"])
def test_verify_proves_compiled_products_in_every_mode(text_ckpt, tmp_path, capsys, monkeypatch,
                                                       extra):
    """--products compiled (bf16): every mode, a batch's tasks and a speculative run's verify
    steps bit-identical, the products really compiled ones."""
    monkeypatch.setattr(fewrows, "PRODUCTS", "library")  # restored after: the run sets it
    if fewrows.build_product(torch.bfloat16, False) is None:
        pytest.skip("inductor cannot build the product here")
    calls = []
    call = fewrows.call_product
    monkeypatch.setattr(fewrows, "call_product",  # (fn, x, w, b): the rows x brings
                        lambda *a: calls.append(a[1].numel() // a[1].shape[-1]) or call(*a))
    flags = [a for a in VERIFY if a not in ("--batch", "3")]
    rc = proofs.main(["--ckpt", text_ckpt, *flags, *extra, "--dtype", "bf16", "--products",
                      "compiled", "--modes", "cpu,disk", "--offload-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0 and "DIFFERENT" not in out, out
    assert calls and fewrows.PRODUCTS == "compiled"
    if extra[0] == "--batch":
        for mode in ("none", "cpu", "disk"):
            assert f"batch of 3, {mode}: 3 of 3 tasks bit-identical" in out, out
        assert any(rows > 1 for rows in calls)   # a batch's rows in one compiled product
    else:
        assert "none+spec " in out and "disk+spec " in out, out


def test_verify_batch_steps_the_whole_batch_however_slowly_the_others_read_their_prompts(
        text_ckpt, tmp_path, capsys, monkeypatch):
    """Prefill steps made slow (as on a machine that decodes fast beside them): the shortest task
    would make its few tokens before the longest has read its prompt, and no step of the whole
    batch would run. proofs.Gate holds it, so steps of 3, 2 and 1 tasks all run and the proof
    passes at a small --max-new-tokens; each task makes 2 tokens more than the one before."""
    import json
    import time

    import runs.batcher as batcher_module
    real = batcher_module.forward

    def slow(model, cache, tokens):
        time.sleep(0.15)
        return real(model, cache, tokens)
    monkeypatch.setattr(batcher_module, "forward", slow)
    argv = [a if a != "24" else "3" for a in VERIFY]  # --max-new-tokens 3
    rc = proofs.main(["--ckpt", text_ckpt, *argv, "--offload-dir", str(tmp_path), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and report["ok"], report
    for mode in ("none", "disk"):
        assert report["batch"][mode]["tasks_per_step"] == [1, 2, 3], report["batch"]
        assert report["batch"][mode]["identical_to_alone"] == [True] * 3


def test_verify_batch_fails_when_a_row_depends_on_its_neighbours(text_ckpt, tmp_path, capsys,
                                                                 monkeypatch):
    """A linear whose rows feel the batch they are in (as an fp32 matmul would, unchecked): the
    tasks of a batch no longer equal themselves alone, and verify --batch says so and exits 1."""
    real = rowwise.linear

    def leaky(layer, x):
        y = real(layer, x)
        return y + 1e-3 * (x.shape[0] - 1)  # 0 alone, something in a batch
    monkeypatch.setattr(model_module, "linear", leaky)
    rc = proofs.main(["--ckpt", text_ckpt, *VERIFY, "--offload-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 1 and "MISMATCH batch none task" in out and "FAILED" in out, out


# -----------------------------------------------------------------------------
# tasks whose chunks share one arena (--offload none on CPU): one kernel call a layer

def decode_together(model, ids, late, leaves, arena, kv_dtype):
    """The tasks of prompts ids decode together in arena (task i at index i), STEPS steps; midway
    task `leaves` leaves and a task of prompt late takes its index, over its chunks. Every row of
    every step must equal, bit for bit, its task's logits alone."""
    none = OffloadConfig()
    ref = [alone(model, p, none, kv_dtype=kv_dtype) for p in ids]
    ref_late = alone(model, late, none, STEPS // 2, kv_dtype)
    caches = [make_cache(model, none, C, 200, kv_dtype=kv_dtype, arena=arena) for _ in ids]
    assert [c.store.arena_index for c in caches] == list(range(len(ids)))
    logits = torch.cat([prefill(model, c, p) for c, p in zip(caches, ids)])
    seen = [[] for _ in ids]
    for step in range(STEPS):
        if step == STEPS // 2:
            caches[leaves].store.close()
            caches[leaves] = make_cache(model, none, C, 200, kv_dtype=kv_dtype, arena=arena)
            assert caches[leaves].store.arena_index == leaves
            logits = torch.cat([logits[:leaves], prefill(model, caches[leaves], late),
                                logits[leaves + 1:]])
        for i in range(len(ids)):
            seen[i].append(logits[i:i + 1].clone())
        logits, failed = decode_batch(model, caches, logits.argmax(-1, keepdim=True))
        assert not failed
    for i in range(len(ids)):
        want = ref[i] if i != leaves else ref[leaves][:STEPS // 2] + ref_late
        for step, (a, b) in enumerate(zip(seen[i], want)):
            assert torch.equal(a, b), f"task {i}, step {step}"
    for c in caches:
        c.store.close()


ARENA_PROMPTS = (40, 45, 40, 33, 40)  # near lengths: the grid pays; three at one offset


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "int4", "half"])
def test_tasks_in_one_arena_attend_in_one_call_with_their_lone_bits(model, kv_dtype,
                                                                    monkeypatch):
    """Five tasks in an arena of six indices, at positions 33 to 45, decode together: each step
    attends every task's sealed chunks of a layer in one kernel call (the grid), the open chunks
    of the three at one offset in another (int8 and int4 KV: a task at a time) and merges the
    four with as many sealed chunks in a third, and every row
    equals, bit for bit, the task's logits alone; K and V held as the model computes them, in int8,
    int4, or a half precision not the model's. Midway one task leaves and a new one takes its
    index, over its chunks."""
    if kv_dtype == "half":  # K and V held in a half precision not the model's
        kv_dtype = "fp16" if model.output.weight.dtype == torch.bfloat16 else "bf16"
    calls = {"grid": 0, "open rows": 0, "merged": 0}
    sealed_grid = kvbatch.BatchedCaches.sealed_grid
    open_chunk = kvbatch.attend_open_chunk
    rows = kvbatch.rows

    def counted_rows(fn, key, o, lse):
        calls["merged"] = max(calls["merged"], o.shape[0])
        return rows(fn, key, o, lse)
    monkeypatch.setattr(kvbatch, "rows", counted_rows)

    def counted_grid(self, *args):
        calls["grid"] += 1
        return sealed_grid(self, *args)

    def counted_open(q, *args):
        calls["open rows"] += q.shape[0] > 1
        return open_chunk(q, *args)
    monkeypatch.setattr(kvbatch.BatchedCaches, "sealed_grid", counted_grid)
    monkeypatch.setattr(kvbatch, "attend_open_chunk", counted_open)
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(3, model.args.vocab_size, (1, n), generator=g) for n in ARENA_PROMPTS]
    late = torch.randint(3, model.args.vocab_size, (1, 44), generator=g)
    arena = kvbatch.make_arena(model, 6, C, 200, kv_dtype)
    decode_together(model, ids, late, 1, arena, kv_dtype)
    assert calls["grid"] == STEPS * model.args.n_layers   # one sealed call a layer, every step
    assert calls["merged"] >= 4  # tasks with as many sealed chunks, at other offsets: one merge
    # some steps' open chunks in one call, where the layout's open chunk is a view (not int8, int4)
    assert (calls["open rows"] > 0) == (kv_dtype not in ("int8", "int4"))
    assert sorted(arena.free) == list(range(6))


@pytest.mark.parametrize("lengths", [(37, 37, 37, 37), (33, 33, 35, 35), (33, 35, 33, 35)],
                         ids=["one_length", "two_in_order", "two_interleaved"])
@pytest.mark.parametrize("kv_dtype", ["auto", "half"])
def test_a_whole_step_takes_no_gathers_and_keeps_every_tasks_bits(model, kv_dtype, lengths,
                                                                  monkeypatch):
    """Four tasks filling an arena of four, task i at index i: a step where they have as many
    sealed chunks and their rows, grouped by offset, stay in order is whole (BatchedCaches.plan),
    so the grid and the merge run without gathers or scatters, and so does the open chunk's row
    where they are at one offset; every row still equals, bit for bit, the task's logits alone.
    Two offsets in order are whole with a row of open chunks each; interleaved, never. Midway a
    task leaves and a shorter one takes its index: those steps are not whole, and their bits
    hold too."""
    if kv_dtype == "half":
        kv_dtype = "fp16" if model.output.weight.dtype == torch.bfloat16 else "bf16"
    plan = kvbatch.BatchedCaches.plan
    wholes = []

    def seen_plan(self):
        planned = plan(self)
        if not wholes or wholes[-1][0] is not self:
            wholes.append((self, planned[2]))
        return planned
    monkeypatch.setattr(kvbatch.BatchedCaches, "plan", seen_plan)
    g = torch.Generator().manual_seed(4)
    ids = [torch.randint(3, model.args.vocab_size, (1, n), generator=g) for n in lengths]
    late = torch.randint(3, model.args.vocab_size, (1, 30), generator=g)
    decode_together(model, ids, late, 2, kvbatch.make_arena(model, 4, C, 200, kv_dtype), kv_dtype)
    steps = [whole for _, whole in wholes]
    assert len(steps) == STEPS and not any(steps[STEPS // 2:])

    def whole(s):  # as many sealed chunks, and the rows grouped by offset in the tasks' order
        at = [b for off in dict.fromkeys((n + s) % C for n in lengths)
              for b, n in enumerate(lengths) if (n + s) % C == off]
        return len({(n + s) // C for n in lengths}) == 1 and at == [0, 1, 2, 3]
    assert steps[:STEPS // 2] == [whole(s) for s in range(STEPS // 2)]
    assert any(steps) == (lengths != (33, 35, 33, 35))


def test_a_job_without_offload_shares_an_arena(text_ckpt, tmp_path, capsys, monkeypatch):
    """A --prompts job with --offload none (the default with --ckpt): its tasks' caches share one
    arena, their sealed chunks are attended a layer at a time in one call, and every result line
    equals --batch-size 1's."""
    calls = []
    sealed_grid = kvbatch.BatchedCaches.sealed_grid

    def counted(self, layer, q, *args):
        calls.append(q.shape[0])
        return sealed_grid(self, layer, q, *args)
    monkeypatch.setattr(kvbatch.BatchedCaches, "sealed_grid", counted)
    tasks = write_tasks(tmp_path / "tasks.jsonl", [dict(t, max_new_tokens=24) for t in MIXED])
    results = {}
    for n in (1, 3):
        out = tmp_path / f"r{n}.jsonl"
        argv = batch_args(text_ckpt, tasks, out, tmp_path / f"off{n}", "--offload", "none",
                          "--chunk-size", C, "--dtype", "bf16", "--batch-size", n)
        rc, err = run_main(argv, capsys)
        assert rc == 0, err
        results[n] = {k: r["tokens"] for k, r in by_id(out).items()}
    assert results[3] == results[1]
    assert calls and max(calls) == 3, calls  # decode steps of three tasks, one call a layer


def test_the_grid_gives_each_task_its_own_bits_at_every_batch_size(model):
    """BatchedCaches.attend through an arena of N indices against each task's own attend, for
    every N from 2 to 16 (bf16 and fp32): K, V and queries heavy-tailed (normal times e^normal),
    tasks at 40 to 44 positions, half of them at one offset (their open chunks as one row) and
    all with as many sealed chunks (one merge of N, probed at each N). Each task's output has its
    lone bits, and the grid, not a task at a time, computed them."""
    g = torch.Generator().manual_seed(5)
    dtype = model.output.weight.dtype
    G = model.layers[0].attention.wk.out_features // model.args.head_dim
    H, D = model.args.n_heads, model.args.head_dim
    none = OffloadConfig()

    def heavy(*shape):
        return (torch.randn(*shape, generator=g) * torch.randn(*shape, generator=g).exp()).to(dtype)
    for N in range(2, 17):
        lengths = [40 if i % 2 == 0 else 40 + i % 5 for i in range(N)]
        kv = [heavy(2, 1, G, n, D) for n in lengths]                 # each task's K and V so far
        arena = kvbatch.make_arena(model, N, C, 64)
        pairs = [[make_cache(model, none, C, 64, arena=a) for _ in lengths] for a in (None, arena)]
        with torch.inference_mode():
            for caches in pairs:
                for c, x, n in zip(caches, kv, lengths):
                    for start in range(0, n, C):              # chunk by chunk, as prefill writes
                        m = min(C, n - start)
                        c.begin(m)
                        for layer in range(model.args.n_layers):
                            c.layout.write(c.store.open_chunk(layer), start % C,
                                           x[0, :, :, start:start + m], x[1, :, :, start:start + m])
                        if c.commit():
                            c.store.seal(c.n_sealed - 1)
                    c.begin(1, decode=True)
            q, k, v = heavy(N, H, 1, D), heavy(N, G, 1, D), heavy(N, G, 1, D)
            alone = torch.cat([c.attend(0, q[i:i + 1], k[i:i + 1], v[i:i + 1])
                               for i, c in enumerate(pairs[0])])
            together = kvbatch.BatchedCaches(pairs[1]).attend(0, q, k, v)
        assert torch.equal(together, alone), N
        assert arena.grid_calls == 1, N
        for caches in pairs:
            for c in caches:
                c.store.close()
