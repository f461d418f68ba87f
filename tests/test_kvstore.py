"""
The persistent KV store: keys that change with any earlier token or setting, entries that
round-trip bit for bit, never a torn or corrupt entry served (several processes at once), LRU
eviction, permissions, the command line, and the premise of it all: a prefix adopted from the store
gives the same logits as recomputing it.
"""
import errno
import json
import multiprocessing
import os
import shutil
import stat
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from disk import ALIGN
from model import Transformer
from offload import OffloadConfig
from runs import generate_cli, kvstore
from runs.kvstore import HEADER, KVStore, StoreError, chunk_keys
from runs.task import run_task
from runs.taskdir import model_fingerprint, run_fingerprint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = (2, 1, 2, 16, 8)  # one chunk [2, B, G, C, D]


def chunks(n_layers=3, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=g).to(dtype) for _ in range(n_layers)]


def keys(n=4, fp="model=a"):
    return chunk_keys(fp, list(range(n * 16)), 16)


# -----------------------------------------------------------------------------
# keys

def test_chunk_keys_chain_every_earlier_token_and_the_run_fingerprint():
    C = 8
    ids = list(range(100, 140))  # 5 full chunks
    base = chunk_keys("fp", ids, C)
    assert len(base) == 5 and len(set(base)) == 5 and all(len(k) == 64 for k in base)
    assert chunk_keys("fp", ids + [7, 7, 7], C) == base  # a partial last chunk has no key
    assert chunk_keys("fp", torch.tensor(ids), C) == base
    # one token changed: that chunk's key and all after it differ
    for p in (0, 7, 8, 21, 39):
        other = chunk_keys("fp", ids[:p] + [ids[p] + 1] + ids[p + 1:], C)
        j = p // C
        assert other[:j] == base[:j], p
        assert all(a != b for a, b in zip(other[j:], base[j:])), p
    # another model, dtype or chunk size never matches
    for fp, c in (("fp2", C), ("fp", 4), ("fp", 10)):
        assert not set(chunk_keys(fp, ids, c)) & set(base), (fp, c)
    # the run fingerprint task.py chains the keys from; the order of the fields does not matter
    fp = run_fingerprint("m", dtype="bf16", chunk_size=8)
    assert fp == run_fingerprint("m", chunk_size=8, dtype="bf16")
    assert fp != run_fingerprint("m", dtype="fp16", chunk_size=8)


# -----------------------------------------------------------------------------
# entries

@pytest.mark.parametrize("compress", ["none", "zstd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip(tmp_path, compress, dtype):
    store = KVStore(tmp_path / "s", compress=compress)
    k = keys()
    kv = chunks(dtype=dtype)
    n = store.write(k[0], kv)
    assert n == os.path.getsize(store.path(k[0]))
    assert store.write(k[0], kv) == 0  # present: not written twice
    out = [torch.full_like(t, float("nan")) for t in kv]
    assert store.read(k[0], out) == n
    assert all(torch.equal(a, b) for a, b in zip(out, kv))
    # bytes are bytes: numpy buffers of the same width read them as well
    np_dtype = np.uint16 if dtype == torch.bfloat16 else np.float32
    as_np = [np.zeros(SHAPE, np_dtype) for _ in kv]
    assert store.read(k[0], as_np) == n
    assert all(np.array_equal(a.view(np.uint8), t.view(torch.uint8).numpy())
               for a, t in zip(as_np, kv))
    # each layer starts on a page (every layer here fits in one): mappable in place
    if compress == "none":
        with open(store.path(k[0]), "rb") as f:
            data = f.read()
        assert all(data[ALIGN * (layer + 1):][:t.nbytes] == t.view(torch.uint8).numpy().tobytes()
                   for layer, t in enumerate(kv))
    assert store.read(k[1], out) == 0 and store.lookup(k) == 1
    assert store.stats == {"bytes_read": 2 * n, "bytes_written": n, "reused": 2, "stored": 1,
                           "misses": 1, "rejected": 0, "evicted": 0, "write_failures": 0}
    with pytest.raises(ValueError):
        # a copy would swallow the bytes: refused
        store.read(k[0], [t.transpose(2, 3) for t in out])


def test_zstd_entries_are_smaller_and_readable_by_any_store(tmp_path):
    kv = chunks(dtype=torch.bfloat16)
    k = keys()
    raw = KVStore(tmp_path / "s")
    packed = KVStore(tmp_path / "s", compress="zstd")
    assert packed.write(k[1], kv) < raw.write(k[0], kv)  # bf16 byte planes compress
    out = [torch.empty_like(t) for t in kv]
    # the header says how to decode
    assert raw.read(k[1], out) and all(torch.equal(a, b) for a, b in zip(out, kv))


def test_lookup_is_the_longest_stored_prefix(tmp_path):
    store = KVStore(tmp_path / "s")
    k = keys(5)
    for j in (0, 1, 3):
        store.write(k[j], chunks(seed=j))
    assert store.lookup(k) == 2 and store.lookup(k[3:]) == 1 and store.lookup([]) == 0
    with pytest.raises(ValueError):
        store.path("../x" + "0" * 60)  # a key is a file name: nothing may reach outside the store


CORRUPTIONS = {"header": HEADER.size - 3, "table": HEADER.size + 2, "payload": -1}


@pytest.mark.parametrize("compress", ["none", "zstd"])
@pytest.mark.parametrize("damage", [*CORRUPTIONS, "truncated", "other buffers"])
def test_damaged_entry_is_a_miss_and_is_removed(tmp_path, compress, damage):
    store = KVStore(tmp_path / "s", compress=compress)
    k = keys()
    kv = chunks()
    store.write(k[0], kv)
    path = store.path(k[0])
    out = [torch.empty_like(t) for t in kv]
    if damage == "truncated":
        os.truncate(path, os.path.getsize(path) - 1)
    elif damage == "other buffers":  # same key, other shape: a fingerprint that misses a setting
        out = out[:2]
    else:
        offset = CORRUPTIONS[damage]
        with open(path, "r+b") as f:
            f.seek(offset, os.SEEK_END if offset < 0 else os.SEEK_SET)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0x10]))
    assert store.read(k[0], out) == 0
    assert not os.path.exists(path) and store.stats["rejected"] == 1
    assert k[0][:8] in store.last_rejection
    store.write(k[0], kv)  # recomputed and stored again: reads back exactly
    out = [torch.empty_like(t) for t in kv]
    assert store.read(k[0], out) and all(torch.equal(a, b) for a, b in zip(out, kv))


def test_full_disk_skips_the_entry_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    said = []
    store = KVStore(tmp_path / "s", log=said.append)
    k = keys()

    def disk_full(fd, data):
        os.write(fd, b"half an entry")
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(kvstore, "write_all", disk_full)
    # the run goes on without it, and says so once
    assert store.write(k[0], chunks()) == 0 and store.stats["write_failures"] == 1
    assert store.write(k[1], chunks()) == 0 and store.stats["write_failures"] == 2
    assert os.listdir(tmp_path / "s") == []
    assert len(said) == 1 and "not stored (No space left on device)" in said[0], said
    assert str(tmp_path / "s") in said[0] and "--kv-store-budget" in said[0]

    def bad_descriptor(fd, data):  # EBADF: a bug, not a full disk
        os.close(-1)
    monkeypatch.setattr(kvstore, "write_all", bad_descriptor)
    with pytest.raises(OSError):
        store.write(k[0], chunks())
    assert os.listdir(tmp_path / "s") == []


def test_a_directory_at_an_entrys_name_is_a_miss_not_a_failure(tmp_path):
    """A directory where an entry's file would be: reads miss and say it was left (they said it
    was removed), writes skip that key (a raw EISDIR failed the run, every run), and --list and
    --clear pass it by (--clear ended in a traceback)."""
    said = []
    store = KVStore(tmp_path / "s", log=said.append)
    k = keys()
    store.write(k[1], chunks())
    os.mkdir(store.path(k[0]))
    out = [torch.zeros(SHAPE) for _ in range(len(chunks()))]
    assert store.read(k[0], out) == 0
    assert "(it was left; remove it for this chunk to be stored)" in said[-1], said
    assert store.write(k[0], chunks()) == 0 and store.stats["write_failures"] == 1
    assert [e[0] for e in store.entries()] == [k[1]]
    assert store.clear() == 1 and os.path.isdir(store.path(k[0]))


def test_rejected_entry_replaced_meanwhile_is_kept(tmp_path):
    """A reader that found a bad entry must not delete the good one a writer renamed over it
    since."""
    store = KVStore(tmp_path / "s")
    k = keys()
    kv = chunks()
    store.write(k[0], kv)
    fd = os.open(store.path(k[0]), os.O_RDONLY)  # the reader's file
    try:
        os.unlink(store.path(k[0]))
        store.write(k[0], kv)  # a writer's fresh entry under the same name
        store._discard(store.path(k[0]), fd)
    finally:
        os.close(fd)
    assert os.path.exists(store.path(k[0]))


# -----------------------------------------------------------------------------
# several processes at once

ENTRY_SHAPE = (2, 1, 4, 128, 64)  # one chunk [2, B, G, C, D] of the processes' entries


def payload(i):
    """Entry i: two layers of fp16 chunks."""
    return [np.random.default_rng(i * 10 + layer).standard_normal(ENTRY_SHAPE).astype(np.float16)
            for layer in range(2)]


def hammer(root, compress, worker, rounds, out):
    """Write, read back and evict the same keys as the other workers; report anything but a miss or
    exact bytes."""
    store = KVStore(root, compress=compress)
    bad = 0
    hits = 0
    ks = chunk_keys("shared", list(range(3 * 4)), 4)
    for r in range(rounds):
        for i, key in enumerate(ks):
            store.write(key, payload(i))
            got = [np.empty(ENTRY_SHAPE, np.float16) for _ in range(2)]
            if store.read(key, got):
                hits += 1
                bad += not all(np.array_equal(a, b) for a, b in zip(got, payload(i)))
        if r % 2 == worker % 2:
            # everything goes: rewrites race with reads and with other evictions
            store.evict_to_budget(0)
    out.put((bad, hits, dict(store.stats)))


def test_concurrent_writers_and_readers_never_see_a_torn_entry(tmp_path):
    root = str(tmp_path / "s")
    KVStore(root)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=hammer, args=(root, ("none", "zstd")[w % 2], w, 12, out))
             for w in range(4)]
    for p in procs:
        p.start()
    results = [out.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert sum(bad for bad, _, _ in results) == 0, results
    # a torn entry would fail its checksum
    assert all(st["rejected"] == 0 for _, _, st in results), results
    assert all(hits > 0 for _, hits, _ in results), results
    assert sum(st["stored"] for _, _, st in results) > 3, results
    store = KVStore(root)
    # no writer left a temporary file behind
    assert not [n for n in os.listdir(root) if n.startswith(".tmp-")]
    for i, key in enumerate(chunk_keys("shared", list(range(12)), 4)):
        got = [np.empty(ENTRY_SHAPE, np.float16) for _ in range(2)]
        assert (store.read(key, got) == 0
                or all(np.array_equal(a, b) for a, b in zip(got, payload(i))))
    assert store.stats["rejected"] == 0


def test_claims_let_a_task_wait_for_a_chunk_another_computes(tmp_path):
    store = KVStore(tmp_path / "s")
    k = keys()
    kv = chunks()
    # the second task learns someone computes chunk 0
    assert store.claim(k[0]) and not store.claim(k[0])
    t = time.monotonic()
    # waited, then gave up
    assert not store.wait_for(k[0], timeout_s=0.3) and time.monotonic() - t >= 0.3

    def computer():  # the first task: compute, store, release
        time.sleep(0.3)
        store.write(k[0], kv)
        store.release(k[0])
    worker = threading.Thread(target=computer)
    worker.start()
    assert store.wait_for(k[0], timeout_s=30)  # the entry appeared: adopt it instead of computing
    worker.join()
    out = [torch.empty_like(c) for c in kv]
    assert store.read(k[0], out) and all(torch.equal(a, b) for a, b in zip(out, kv))

    assert store.claim(k[1])
    store.release(k[1])  # the computer failed: a waiter stops at once, empty-handed
    t = time.monotonic()
    assert not store.wait_for(k[1], timeout_s=30) and time.monotonic() - t < 5
    assert store.claim(k[2])
    os.utime(store.path(k[2], ".claim"), (time.time() - 3600, time.time() - 3600))
    assert store.claim(k[2])  # a claim its dead owner never released is taken over
    store.clear()
    assert os.listdir(tmp_path / "s") == []


# -----------------------------------------------------------------------------
# budget, permissions, command line

def test_budget_evicts_least_recently_used(tmp_path):
    store = KVStore(tmp_path / "s")
    k = keys(5)
    sizes = [store.write(k[j], chunks(seed=j)) for j in range(3)]
    t0 = time.time() - 1000
    for j in range(3):  # written long ago, in order: 0 is the oldest
        os.utime(store.path(k[j]), (t0 + 10 * j, t0 + 10 * j))
    assert store.read(k[0], chunks())  # a read makes entry 0 the most recently used
    assert store.evict_to_budget(2 * sizes[0]) == 1
    assert [e[0] for e in store.entries()] == [k[2], k[0]] and store.size() == 2 * sizes[0]
    budgeted = KVStore(tmp_path / "s", budget_gib=2.5 * sizes[0] / 2**30)
    # a write evicts down to the budget: entry 2 is now the oldest
    budgeted.write(k[3], chunks(seed=3))
    assert [e[0] for e in budgeted.entries()] == [k[0], k[3]] and budgeted.stats["evicted"] == 1
    assert budgeted.size() <= budgeted.budget


def test_stale_temporary_files_are_swept(tmp_path):
    store = KVStore(tmp_path / "s")
    old = tmp_path / "s" / ".tmp-dead-1-aa"
    fresh = tmp_path / "s" / ".tmp-live-2-bb"
    old.write_bytes(b"x")
    fresh.write_bytes(b"x")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    store.evict_to_budget()
    assert not old.exists() and fresh.exists()  # a live writer's file is left alone


def test_store_is_owner_only(tmp_path):
    umask = os.umask(0)  # the modes must come from the store, not from a friendly umask
    try:
        store = KVStore(tmp_path / "s")
        store.write(keys()[0], chunks())
    finally:
        os.umask(umask)
    assert stat.S_IMODE(os.stat(tmp_path / "s").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(store.path(keys()[0])).st_mode) == 0o600
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o755)
    with pytest.raises(StoreError, match="open to other users"):
        KVStore(open_dir)


def run_kvstore(*args):
    """python -m runs.kvstore in a child process."""
    return subprocess.run([sys.executable, "-m", "runs.kvstore", *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_cli_list_and_clear(tmp_path):
    store = KVStore(tmp_path / "s")
    k = keys()
    n = sum(store.write(k[j], chunks(seed=j)) for j in range(2))
    (tmp_path / "s" / "notes.txt").write_text("not ours")
    out = run_kvstore(tmp_path / "s", "--list")
    assert out.returncode == 0, out.stderr
    assert k[0] in out.stdout and k[1] in out.stdout and "2 entries" in out.stdout
    assert f"{n / 2**20:.3f} MiB" in out.stdout.splitlines()[-1]
    out = run_kvstore(tmp_path / "s", "--clear")
    assert out.returncode == 0 and "removed 2 entries" in out.stdout
    # only the store's own files go
    assert store.entries() == [] and (tmp_path / "s" / "notes.txt").exists()
    assert "0 entries" in run_kvstore(tmp_path / "s", "--list").stdout


@pytest.mark.parametrize("args", [("{tmp}/missing", "--list"),
                                  ("{tmp}/file", "--list"),
                                  ("{tmp}/open", "--clear"),
                                  ("{tmp}",),
                                  ("{tmp}", "--list", "--clear"),
                                  ()])
def test_cli_bad_usage_is_one_sentence_and_exit_2(tmp_path, args):
    (tmp_path / "file").write_text("x")
    (tmp_path / "open").mkdir(mode=0o755)
    os.chmod(tmp_path / "open", 0o755)
    out = run_kvstore(*(a.format(tmp=tmp_path) for a in args))
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("runs.kvstore: error: "), out.stderr


# -----------------------------------------------------------------------------
# through the loop: a second question about a document adopts its chunks, bit-identically, in every
# tier

def doc_and_questions(vocab, n_doc=45, n_ask=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    doc = torch.randint(3, vocab, (n_doc,), generator=g).tolist()
    return doc, [torch.randint(3, vocab, (n_ask,), generator=g).tolist() for _ in range(2)]


def ask(model, ids, cfg, store=None, fingerprint=None, new=6, C=8):
    """run_task with the KV store: (new ids, {length: logits} of each step, stats)."""
    steps = []

    def on_step(phase, logits, cache):
        steps.append((cache.length, logits.clone()))
    out, stats = run_task(model, ids, new, chunk_size=C, cfg=cfg, kv_store=store,
                          fingerprint=fingerprint, on_step=on_step)
    return out, dict(steps), stats


@pytest.mark.parametrize("mode,compress",
                         [("none", "none"), ("cpu", "none"), ("disk", "none"), ("disk", "zstd")])
def test_second_question_reuses_the_document_bit_identically(llama_ckpt, tmp_path, mode,
                                                             compress):
    model = Transformer.from_pretrained(llama_ckpt)
    doc, (q1, q2) = doc_and_questions(model.args.vocab_size)
    cfg = OffloadConfig(mode=mode, compress=compress, window=1, offload_dir=str(tmp_path / "off"))
    store = KVStore(tmp_path / "s")
    fp = model_fingerprint(llama_ckpt)
    cold_ids, cold_steps, _ = ask(model, doc + q2, cfg)  # no store at all: the reference
    _, _, first = ask(model, doc + q1, cfg, store, fp)   # stores the full chunks of doc + q1
    assert first["reused_tokens"] == 0
    assert first["stored_tokens"] == (len(doc) + len(q1)) // 8 * 8
    warm_ids, warm_steps, warm = ask(model, doc + q2, cfg, store, fp)
    # the chunks inside doc
    assert warm["reused_tokens"] == len(doc) // 8 * 8 and warm["store_bytes_read"] > 0
    assert warm_ids == cold_ids
    assert min(warm_steps) > warm["reused_tokens"], "an adopted chunk was computed again"
    # the prefill rate counts the tokens computed, not the reused ones
    computed = len(doc) + len(q2) - warm["reused_tokens"]
    assert first["prefill_tokens"] == len(doc) + len(q1) and warm["prefill_tokens"] == computed
    # (prefill_s is rounded to 0.1 ms; counting every prompt token would be several times more)
    assert warm["prefill_tokens_per_s"] == pytest.approx(computed / warm["prefill_s"], rel=0.1)
    assert warm["ttft_s"] >= warm["store_read_s"] > 0
    for pos, logits in warm_steps.items():
        assert torch.equal(logits, cold_steps[pos]), pos


def test_other_weights_with_the_same_shapes_reuse_nothing(llama_ckpt, tmp_path):
    """A fine-tune of the same shapes (here layer 0's v_proj scaled by 1.5) never matches the
    original's entries."""
    from safetensors.torch import load_file, save_file
    other = tmp_path / "other"
    shutil.copytree(llama_ckpt, other)
    tensors = load_file(other / "model.safetensors")
    tensors["model.layers.0.self_attn.v_proj.weight"] *= 1.5
    save_file(tensors, other / "model.safetensors", metadata={"format": "pt"})
    a = Transformer.from_pretrained(llama_ckpt)
    b = Transformer.from_pretrained(str(other))
    doc, (q1, _) = doc_and_questions(a.args.vocab_size)
    store = KVStore(tmp_path / "s")
    cfg = OffloadConfig()
    ask(a, doc + q1, cfg, store, model_fingerprint(llama_ckpt))
    ids_b, _, st = ask(b, doc + q1, cfg, store, model_fingerprint(str(other)))
    assert st["reused_tokens"] == 0
    assert ids_b == ask(b, doc + q1, cfg)[0]


def test_generate_and_batch_reuse_through_the_command_line(text_ckpt, tmp_path, capsys):
    sentence = "The with statement wraps a block with methods defined by a context manager."
    doc = " ".join([sentence] * 6)
    common = ["--ckpt", text_ckpt, "--chunk-size", 16, "--kv-store", tmp_path / "s",
              "--max-new-tokens", 4]
    runs = []
    for q in ("What is it?", "Why?"):
        capsys.readouterr()
        assert generate_cli.main([str(a) for a in common + ["--prompt", doc + q, "--json"]]) == 0
        runs.append(json.loads(capsys.readouterr().out))
    assert runs[0]["stats"]["reused_tokens"] == 0 and runs[1]["stats"]["reused_tokens"] >= 16 * 3
    tasks = tmp_path / "tasks.jsonl"
    lines = [json.dumps({"id": i, "prompt": doc + q}) + "\n" for i, q in enumerate(["A?", "B?"])]
    tasks.write_text("".join(lines))
    out = tmp_path / "results.jsonl"
    assert generate_cli.main([str(a) for a in common + ["--prompts", tasks, "--output", out]]) == 0
    stats = [json.loads(line)["stats"] for line in out.read_text().splitlines()]
    # the document was computed once, long ago
    assert all(s["reused_tokens"] >= 16 * 3 for s in stats), stats


def test_a_budget_smaller_than_a_prompt_keeps_its_head(tmp_path):
    """A chunk is of use only after every one before it: writing a prompt's chunks under a budget
    smaller than the prompt (each written well after the one before, as prefill steps go) keeps
    the head that lookup() reaches, never a tail it cannot; so does reading the head back."""
    probe = KVStore(tmp_path / "probe")
    size = probe.write(keys(1)[0], chunks())
    store = KVStore(tmp_path / "s", budget_gib=3.5 * size / 2**30)
    k = keys(6)
    for j in range(6):
        store.write(k[j], chunks(seed=j), before=k[:j])
        time.sleep(0.01)  # a prefill step apart
    assert store.lookup(k) == 3 and sorted(e[0] for e in store.entries()) == sorted(k[:3])
    for j in range(3):  # a later task adopts the head, in order, then computes and stores the rest
        assert store.read(k[j], chunks())
        time.sleep(0.01)
    store.mark_used(k[:3])
    store.write(k[3], chunks(seed=3), before=k[:3])
    assert store.lookup(k) == 3 and store.size() <= store.budget
