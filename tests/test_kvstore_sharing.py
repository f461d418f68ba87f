"""
Tasks that share a document through the persistent KV store (kvstore.py, task.PromptCache): two
tasks that start together compute each shared chunk once, one waiting for the other's entries; a
task that fails or dies leaves no wait behind; the ranks of a tensor-parallel replica adopt the
same prefix. Every output is bit-identical to a run without the store.
"""
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from generate import Sampling
from kvcache import make_cache
from model import Transformer
from offload import OffloadConfig
from runs import task
from runs.kvstore import HOST, KVStore
from runs.task import PromptCache, run_task, timed_generate
from runs.tp import Layout

C = 8          # chunk size
N_CHUNKS = 5   # full chunks of the prompt: the shared document
NEW = 4        # new tokens per task
FP = "model-a"


def prompt(vocab_size, seed=0):
    """N_CHUNKS full chunks and a partial one, so that every full chunk can be adopted."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (N_CHUNKS * C + 3,), generator=g).tolist()


@pytest.fixture(scope="module")
def model(llama_ckpt):
    return Transformer.from_pretrained(llama_ckpt)


@pytest.fixture(scope="module")
def cold(model):
    """The reference: (new tokens, logits of every step by position), no store at all."""
    return run(model, prompt(model.args.vocab_size), None)[:2]


def run(model, ids, store, task_id="0", on_prefill=None):
    """run_task with every step's logits kept, by the position they follow. on_prefill(position)
    runs after each prefill step of this task."""
    steps = {}

    def on_step(phase, logits, cache):
        steps[cache.length] = (phase, logits.clone())
        if phase == "prefill" and on_prefill:
            on_prefill(cache.length)
    new, stats = run_task(model, ids, NEW, chunk_size=C, cfg=OffloadConfig(), task_id=task_id,
                          on_step=on_step, kv_store=store, fingerprint=FP)
    return new, steps, stats


def in_thread(fn, *args, **kwargs):
    """Start fn in a thread; join() returns its result or raises its exception."""
    box = {}

    def target():
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as e:  # handed to the test's thread
            box["error"] = e
    thread = threading.Thread(target=target)
    thread.start()

    def join(timeout=120):
        thread.join(timeout)
        assert not thread.is_alive(), "a task never finished: a wait that does not end"
        if "error" in box:
            raise box["error"]
        return box["result"]
    return join


def prefilled(steps):
    """The positions after each prefill step: chunk j was computed here iff (j+1)*C is one."""
    return sorted(pos for pos, (phase, _) in steps.items() if phase == "prefill")


def assert_same(cold, new, steps):
    cold_new, cold_steps = cold
    assert new == cold_new
    for pos, (_, logits) in steps.items():
        assert torch.equal(logits, cold_steps[pos][1]), pos


def leftovers(root):
    return [n for n in os.listdir(root) if not n.endswith(".kv")]


def test_two_tasks_that_start_together_compute_each_shared_chunk_once(model, cold, tmp_path):
    """Task a computes the document slowly; task b starts after a's first chunk, finds the rest
    claimed, waits for each entry and adopts it. Without the claims b would find chunks 1-4
    absent and compute them again."""
    ids = prompt(model.args.vocab_size)
    store = KVStore(tmp_path / "s")
    a_started = threading.Event()

    def slow(position):  # a's prefill: one chunk at a time, slowly, so that b starts mid-way
        a_started.set()
        time.sleep(0.15)
    join_a = in_thread(run, model, ids, store, "a", slow)
    assert a_started.wait(60)
    b_new, b_steps, b_stats = run(model, ids, store, "b")
    a_new, a_steps, a_stats = join_a()
    assert_same(cold, a_new, a_steps)
    assert_same(cold, b_new, b_steps)
    assert a_stats["reused_tokens"] == 0 and a_stats["stored_tokens"] == N_CHUNKS * C
    assert b_stats["reused_tokens"] == N_CHUNKS * C, b_stats  # b adopted every full chunk
    full = [(j + 1) * C for j in range(N_CHUNKS)]
    assert prefilled(a_steps)[:N_CHUNKS] == full                # a computed each chunk once ...
    assert not set(prefilled(b_steps)) & set(full)              # ... and b none of them
    assert store.stats["stored"] == N_CHUNKS and store.stats["rejected"] == 0
    assert leftovers(tmp_path / "s") == []                      # no claim outlives its task


def test_a_task_that_fails_mid_prefill_leaves_no_wait_behind(model, cold, tmp_path):
    """Task a claims the document, stores chunk 0, then fails; task b, waiting for chunk 1, stops
    waiting at once, computes the rest itself and still matches the reference."""
    ids = prompt(model.args.vocab_size)
    store = KVStore(tmp_path / "s")
    a_started = threading.Event()

    class Crash(Exception):
        pass

    def crash(position):
        a_started.set()
        time.sleep(0.5)  # b is waiting for chunk 1 by now
        raise Crash()
    join_a = in_thread(run, model, ids, store, "a", crash)
    assert a_started.wait(60)
    t = time.monotonic()
    b_new, b_steps, b_stats = run(model, ids, store, "b")
    assert time.monotonic() - t < 30  # far below the claim timeout: b did not wait for it
    with pytest.raises(Crash):
        join_a()
    assert_same(cold, b_new, b_steps)
    assert b_stats["reused_tokens"] == C  # chunk 0, which a stored before failing
    assert b_stats["stored_tokens"] == (N_CHUNKS - 1) * C
    assert leftovers(tmp_path / "s") == []


def test_a_claim_whose_process_died_is_taken_over(model, cold, tmp_path):
    """A process killed while computing leaves its claims behind; a task on the same machine sees
    that the process is gone and computes the chunk at once rather than waiting for the claim to
    grow stale."""
    ids = prompt(model.args.vocab_size)
    store = KVStore(tmp_path / "s")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    probe = make_cache(model, OffloadConfig(), C, len(ids) + NEW)
    keys = PromptCache(store, probe, ids, FP, model).keys
    for key in keys:
        with open(store.path(key, ".claim"), "w") as f:
            f.write(f"{HOST} {dead.stdout.strip()}\n")
    t = time.monotonic()
    new, steps, stats = run(model, ids, store)
    assert time.monotonic() - t < 30
    assert_same(cold, new, steps)
    assert stats["reused_tokens"] == 0 and stats["stored_tokens"] == N_CHUNKS * C
    assert leftovers(tmp_path / "s") == []


def test_the_ranks_of_a_replica_adopt_the_prefix_every_rank_holds(model, cold, tmp_path,
                                                                  monkeypatch):
    """Each rank of a tensor-parallel replica reads its own entries. If another rank's store lacks
    chunk 2 (evicted under its budget, or corrupt), this rank must stop at chunk 2 as well, or the
    ranks' prefill steps, and their collectives, would no longer match. A stand-in for agree_min
    plays the other rank."""
    ids = prompt(model.args.vocab_size)
    store = KVStore(tmp_path / "s")
    run(model, ids, store)  # stores every full chunk
    other_rank_has = [1, 1, 0, 1, 1]
    seen = []

    def agree_min(n, layout):
        assert layout.tp == 2
        other = other_rank_has[len(seen)]
        seen.append(n)
        return min(n, other)
    monkeypatch.setattr(task, "agree_min", agree_min)
    cache = make_cache(model, OffloadConfig(), C, len(ids) + NEW)
    prompt_cache = PromptCache(store, cache, ids, FP, model, Layout(tp=2))
    prompt_cache.adopt(cache)
    assert seen == [1, 1, 1]  # this rank holds chunk 2; the replica agrees that it is missing
    assert cache.n_sealed == 2 and prompt_cache.adopted == 2 and cache.length == 2 * C
    assert not prompt_cache.claimed  # under tensor parallelism nothing is claimed or waited for
    new, _ = timed_generate(model, cache, ids, NEW, sampling=Sampling(), eos_ids=(), out=[],
                            on_token=None, on_step=None, stream=None)
    assert new == cold[0]
    assert prompt_cache.finish()["reused_tokens"] == 2 * C


def test_a_wait_on_a_live_claim_is_said(tmp_path, monkeypatch, capsys):
    """A claim whose process lives but does not finish (stopped with Ctrl-Z) makes another run
    wait, up to STALE_CLAIM_S: after a few seconds that wait is said once, naming the process, and
    when it ends without the entry the run computes the chunk itself (False)."""
    from runs import kvstore
    monkeypatch.setattr(kvstore, "WAIT_NOTE_S", 0.1)
    store = KVStore(tmp_path / "s")
    key = "ab" * 32
    with open(store.path(key, ".claim"), "w") as f:
        f.write(f"{HOST} {os.getpid()}\n")  # a live process of this machine: this one
    assert store.wait_for(key, timeout_s=0.5, poll_s=0.02) is False
    err = capsys.readouterr().err
    assert err.count(f"waiting for process {os.getpid()} on {HOST}, which is computing") == 1, err
