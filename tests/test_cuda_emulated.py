"""
The store's CUDA path (copy stream, events, pinned pools, staging slots, bounce buffers) run on CPU
under the emulated CUDA of cuda_emu.py: logits bit-identical to --offload none, and no race, no wait
on an event that is never recorded, no copy still queued when the store closes.
tests/mutate_waits.py checks these tests fail when any stream-ordering line of offload.py,
prefetch.py or pools.py is removed.
"""
import errno
import os
import threading

import pytest
import torch

import cuda_emu
import disk
from disk import DiskError
from generate import decode_batch, decode_one_token, prefill
from kvcache import make_cache
from model import Transformer
from offload import OffloadConfig
from runs.kvstore import KVStore
from runs.task import run_task

# P + NEW - 1 = 56 positions: the last step seals a chunk, so copies are queued at close
C = 7     # chunk size
P = 45    # prompt tokens
NEW = 12  # new tokens


@pytest.fixture(scope="module")
def llama(checkpoint):
    return Transformer.from_pretrained(checkpoint())


@pytest.fixture(scope="module")
def base(llama):
    """--offload none, outside the emulation: the reference every emulated run must match bit for
    bit."""
    return run(llama, prompt(P, llama.args.vocab_size), NEW)


def prompt(n, vocab, seed=0):
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(model, ids, new, task_id="0", fingerprint=None, on_token=None, kv_store=None,
        kv_dtype="auto", **cfg):
    """run_task with the model on CPU: only offload.on_cuda is patched, so task.py makes no CUDA
    stream of its own and skips its per-step stream synchronize (a timing aid), which would order
    every copy before the next step and hide the hazards that span steps (rule 5; copies left for
    close())."""
    steps = []

    def on_step(phase, logits, cache):
        steps.append((cache.length, logits.clone()))
    out, stats = run_task(model, ids, new, chunk_size=C, cfg=OffloadConfig(**cfg), task_id=task_id,
                          fingerprint=fingerprint, on_token=on_token, kv_store=kv_store,
                          on_step=on_step, kv_dtype=kv_dtype)
    return out, steps, stats


def differences(base, other):
    """Where the logits or ids differ from the reference ("" if nowhere)."""
    (ids_a, steps_a, _), (ids_b, steps_b, _) = base, other
    by_pos = dict(steps_a)
    if not steps_b:
        return "no step computed"
    for pos, logits in steps_b:  # a resumed run starts later: compare the positions it computed
        if not torch.equal(by_pos[pos], logits):
            return f"logits differ at position {pos}"
    return "" if ids_a == ids_b else "ids differ"


def assert_good(emu, base, other, label):
    """No problem found by the emulator, logits bit-identical to the reference, copies really
    deferred. Problems first: a race names the buffer and the missing rule, a logits difference only
    says that something is wrong."""
    problems = emu.problems()
    diff = differences(base, other)
    stats = other[2]
    assert not problems, (f"{label}: {len(problems)} problems ({diff or 'logits identical'})\n"
                          + "\n".join(problems[:8]))
    assert not diff, f"{label}: {diff}"
    assert emu.stats["deferred"] > 0, (label, stats)
    assert stats["bytes"]["h2d"] > 0 and stats["bytes"]["d2h"] > 0, (label, stats)


# -----------------------------------------------------------------------------
# the emulator itself: it must see what it claims to see

def test_emulator_defers_copies_and_flags_a_missing_wait():
    with cuda_emu.emulate() as emu:
        side = torch.cuda.Stream()
        host = torch.empty(64, dtype=torch.uint8, pin_memory=True).fill_(7)
        dev = torch.zeros(64, dtype=torch.uint8)
        emu.register(dev, "dev", "slot")
        with torch.cuda.stream(side):
            dev.copy_(host, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        assert dev.sum() == 0, "a copy on a side stream must not run before something orders it"
        emu.compute_access(dev, False, "read without the wait")  # rule 2 skipped: a race
        assert any("rule 2" in r for r in emu.problems()), emu.problems()
        torch.cuda.current_stream().wait_event(ready)
        emu.compute_access(dev, False, "read after the wait")
        assert dev.sum() == 7 * 64 and len(emu.det.races) == 1
        first = torch.cuda.Event()
        # a first use: allowed once the event is recorded later
        torch.cuda.current_stream().wait_event(first)
        first.record()
        assert not any("never recorded" in p for p in emu.problems())
        torch.cuda.current_stream().wait_event(torch.cuda.Event())  # never recorded: orders nothing
        assert any("never recorded" in p for p in emu.problems())
    with cuda_emu.emulate(strict_waits=True) as emu:
        first = torch.cuda.Event()
        torch.cuda.current_stream().wait_event(first)
        first.record()
        assert any("before its first record" in p for p in emu.problems()), (
            "strict: a first wait is reported")
    assert not torch.cuda.is_available() or torch.version.cuda, (
        "the emulation must be uninstalled on exit")


def test_emulator_pinning_and_pageable_copies():
    """Pinned = allocated with pin_memory, copied by pin_memory(), or registered with
    cudaHostRegister; an asynchronous copy with no pinned side is reported (on CUDA it would be
    synchronous)."""
    with cuda_emu.emulate() as emu:
        plain = torch.zeros(4096, dtype=torch.uint8)
        dev = torch.zeros(4096, dtype=torch.uint8)
        assert not plain.is_pinned() and plain.pin_memory().is_pinned()
        with torch.cuda.stream(torch.cuda.Stream()):
            dev.copy_(plain, non_blocking=True)
        assert any("no pinned side" in p for p in emu.problems()), emu.problems()
        rt = torch.cuda.cudart()
        assert rt.cudaHostRegister(plain.data_ptr(), plain.numel(), 0) == 0 and plain.is_pinned()
        assert rt.cudaHostUnregister(plain.data_ptr()) == 0 and not plain.is_pinned()
        torch.cuda.synchronize()
        assert dev.sum() == 0 and emu.stats["forced"] == 1


# -----------------------------------------------------------------------------
# the store's CUDA path against --offload none

CASES = [  # mode, compress, window, staging slots
    ("cpu", "none", 0, 1),
    ("cpu", "none", 2, 3),
    ("disk", "none", 1, 2),
    ("disk", "zstd", 0, 3),
    ("disk", "zstd", 2, 1),
]


@pytest.mark.parametrize("mode,compress,window,slots", CASES)
def test_cuda_path_bit_identical_and_race_free(llama, base, tmp_path, mode, compress, window,
                                               slots):
    label = f"{mode}+{compress} window {window} slots {slots}"
    with cuda_emu.emulate(strict_waits=True) as emu:
        other = run(llama, prompt(P, llama.args.vocab_size), NEW, mode=mode, compress=compress,
                    window=window, staging_slots=slots, offload_dir=str(tmp_path))
    assert_good(emu, base, other, label)
    tier = "host" if mode == "cpu" else "disk"
    assert other[2]["chunks"][tier] > 0, (label, other[2])


@pytest.mark.parametrize("mode,compress", [("cpu", "none"), ("disk", "zstd")])
def test_half_precision_kv_on_the_cuda_path(llama, tmp_path, mode, compress):
    """--kv-dtype bf16 under fp32 weights: the half-precision chunks cross the copy streams and
    are widened into the attention scratch on the compute stream, bit-identical to --offload none
    with the same --kv-dtype and race-free."""
    ids = prompt(P, llama.args.vocab_size)
    reference = run(llama, ids, NEW, kv_dtype="bf16")
    with cuda_emu.emulate(strict_waits=True) as emu:
        other = run(llama, ids, NEW, kv_dtype="bf16", mode=mode, compress=compress, window=1,
                    offload_dir=str(tmp_path))
    assert_good(emu, reference, other, f"bf16 KV {mode}+{compress}")
    assert other[2]["kv_dtype"] == "bf16"


@pytest.mark.parametrize("window", [0, 2])
def test_a_host_run_crosses_as_one_copy_and_chunk_by_chunk_alike(llama, base, tmp_path, window):
    """The host tier with group buffers (a layer's run of host-pool chunks crosses as one copy
    into a group buffer, attention reads it there) and without (--group-buffers 0: chunk by chunk
    into staging slots, gathered): both bit-identical to --offload none and race-free, and the
    group copies are fewer copies on the copy stream than chunk by chunk."""
    copies = {}
    for groups in (2, 0):
        label = f"cpu window {window} group buffers {groups}"
        with cuda_emu.emulate(strict_waits=True) as emu:
            other = run(llama, prompt(P, llama.args.vocab_size), NEW, mode="cpu", window=window,
                        staging_slots=2, group_buffers=groups)
        assert_good(emu, base, other, label)
        copies[groups] = emu.stats["deferred"]  # evictions and prefetches, on the side streams
        assert other[2]["chunks"]["host"] > 0, (label, other[2])
    assert copies[2] < copies[0], copies


SELECT_CASES = [  # selection, mode, compress, window, staging slots
    ("quest", "cpu", "none", 0, 1),
    ("quest", "disk", "zstd", 1, 2),
    ("oracle", "disk", "none", 1, 2),
    ("sink", "cpu", "none", 1, 3),
]


@pytest.mark.parametrize("select,mode,compress,window,slots", SELECT_CASES)
def test_selection_on_the_cuda_path_bit_identical_and_race_free(llama, tmp_path, select, mode,
                                                                compress, window, slots):
    """A selection reads some chunks: the ones a query-aware selection (quest) decides as each
    layer runs go through the staging slots layer by layer (prefetch_more), in attention's
    order; against the same selection with --offload none, outside the emulation."""
    ids = prompt(P, llama.args.vocab_size)
    sel = dict(select=select, select_budget=None if select == "sink" else 2 * C, select_dense=0,
               window=window)
    reference = run(llama, ids, NEW, **sel)
    label = f"{select} {mode}+{compress} window {window} slots {slots}"
    with cuda_emu.emulate(strict_waits=True) as emu:
        other = run(llama, ids, NEW, mode=mode, compress=compress, staging_slots=slots,
                    offload_dir=str(tmp_path), **sel)
    assert_good(emu, reference, other, label)
    if select != "oracle":  # the oracle reads every chunk
        assert other[2]["bytes"]["select_skipped"] > 0, other[2]


def test_a_batched_decode_step_on_the_cuda_path(llama, tmp_path):
    """generate.decode_batch over three tasks whose stores take the CUDA path (host pool, disk,
    zstd), each at its own position: every row equals that task decoding alone with --offload
    none, and the emulator finds no race across the three stores' streams."""
    lengths = (45, 23, 31)
    ids = [torch.tensor([prompt(n, llama.args.vocab_size, seed=n)]) for n in lengths]
    cfgs = [dict(mode="cpu", window=0, staging_slots=1), dict(mode="disk", window=1),
            dict(mode="disk", compress="zstd", window=1, staging_slots=2)]
    steps = 10
    reference = []
    for p in ids:  # alone, no offload, no emulation
        cache = make_cache(llama, OffloadConfig(), C, 120)
        logits = prefill(llama, cache, p)
        seen = []
        for _ in range(steps):
            seen.append(logits)
            logits = decode_one_token(llama, cache, logits.argmax(-1, keepdim=True))
        reference.append(seen)
        cache.store.close()
    with cuda_emu.emulate(strict_waits=True) as emu:
        caches = [make_cache(llama, OffloadConfig(offload_dir=str(tmp_path), **c), C, 120)
                  for c in cfgs]
        logits = torch.cat([prefill(llama, c, p) for c, p in zip(caches, ids)])
        for step in range(steps):
            for i in range(len(ids)):
                assert torch.equal(logits[i:i + 1], reference[i][step]), (i, step)
            logits, failed = decode_batch(llama, caches, logits.argmax(-1, keepdim=True))
            assert not failed
        moved = [c.store.snapshot()["bytes"] for c in caches]
        for c in caches:
            c.store.close()
    assert not emu.problems(), "\n".join(emu.problems()[:8])
    assert emu.stats["deferred"] > 0 and all(b["h2d"] > 0 for b in moved), moved


def test_host_budget_spills_to_disk(llama, base, tmp_path):
    """--offload disk with a small --cpu-budget: the host pool (pinned) takes the first evicted
    chunks, disk the rest."""
    # one chunk here: 2 x 2 kv heads x 7 positions x 16 dims x 4 bytes, padded to a page
    slot_bytes = 4096
    with cuda_emu.emulate(strict_waits=True) as emu:
        other = run(llama, prompt(P, llama.args.vocab_size), NEW, mode="disk", window=1,
                    staging_slots=2, cpu_budget_gib=3 * slot_bytes / 2**30,
                    offload_dir=str(tmp_path))
    assert_good(emu, base, other, "spill")
    assert other[2]["chunks"]["host"] == 3 and other[2]["chunks"]["disk"] > 0, other[2]


class Crash(Exception):
    pass


def crash_at_6(out):
    if len(out) == 6:
        raise Crash


@pytest.mark.parametrize("compress,select", [("none", "all"), ("zstd", "all"), ("none", "quest")])
def test_crashed_run_resumes_from_the_disk_tier(llama, base, tmp_path, compress, select):
    """A task killed mid-decode keeps its directory (manifest + chunks); the rerun restores the
    chunks the manifest vouches for, through the read bounces and staging slots, and must still
    match --offload none (under quest: its digests rebuilt from the restored chunks)."""
    ids = prompt(P, llama.args.vocab_size)
    sel = {}
    if select != "all":
        sel = dict(select=select, select_budget=2 * C, select_dense=0)
        base = run(llama, ids, NEW, window=1, **sel)
    cfg = dict(mode="disk", compress=compress, window=1, staging_slots=2, offload_dir=str(tmp_path),
               keep_files=True, **sel)
    with cuda_emu.emulate(strict_waits=True) as emu:
        with pytest.raises(Crash):
            run(llama, ids, NEW, task_id="t", fingerprint="model-a", on_token=crash_at_6, **cfg)
    assert not emu.problems(), emu.problems()
    with cuda_emu.emulate(strict_waits=True) as emu:
        other = run(llama, ids, NEW, task_id="t", fingerprint="model-a", **cfg)
    assert_good(emu, base, other, "resumed")
    assert other[2]["resumed_from"] >= 3 * C, other[2]


def test_prompt_chunks_read_back_for_the_kv_store(llama, base, tmp_path):
    """The persistent KV store keeps each prompt chunk through read_back, right after its seal: with
    window 0 the chunk is already in the host pool, its eviction maybe still queued (rule 4). A
    second run, on the disk tier, adopts the stored chunks: it seals them one after another with no
    step between, so each seal waits for write bounces that only the writer's hand-back (the bounce
    queue) orders. Both must match --offload none."""
    ids = prompt(P, llama.args.vocab_size)
    kv = KVStore(str(tmp_path / "store"))
    for mode in ("cpu", "disk"):
        with cuda_emu.emulate(strict_waits=True) as emu:
            other = run(llama, ids, NEW, fingerprint="model-a", kv_store=kv, mode=mode, window=0,
                        staging_slots=2, offload_dir=str(tmp_path))
        assert_good(emu, base, other, f"kv store, {mode}")
    assert other[2]["reused_tokens"] == (P - 1) // C * C, other[2]


def test_two_concurrent_tasks(llama, base, tmp_path):
    """Two tasks in two threads, each with its own store, copy stream, worker and compute stream."""
    results = {}

    def task(name, **cfg):
        try:
            results[name] = run(llama, prompt(P, llama.args.vocab_size), NEW, task_id=name,
                                offload_dir=str(tmp_path), **cfg)
        except BaseException as e:  # noqa: BLE001 (reported by the main thread)
            results[name] = e
    cfg_a = dict(mode="cpu", window=0, staging_slots=1)
    cfg_b = dict(mode="disk", compress="zstd", window=1, staging_slots=2)
    with cuda_emu.emulate(strict_waits=True) as emu:
        threads = [threading.Thread(target=task, args=("a",), kwargs=cfg_a),
                   threading.Thread(target=task, args=("b",), kwargs=cfg_b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for name, other in results.items():
        assert not isinstance(other, BaseException), f"task {name}: {other!r}"
        assert_good(emu, base, other, f"task {name}")
    assert len(results) == 2


def test_full_disk_on_the_cuda_path_with_zstd_raises_disk_error(llama, tmp_path, monkeypatch):
    """ENOSPC from the 4th blob written on: the task must fail with DiskError (a fallback can act on
    its errno)."""
    pwrite = os.pwrite
    calls = []

    def full(fd, data, offset):
        calls.append(1)
        if len(calls) > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return pwrite(fd, data, offset)
    monkeypatch.setattr(os, "pwrite", full)
    with cuda_emu.emulate(strict_waits=True) as emu:
        with pytest.raises(DiskError) as e:
            run(llama, prompt(P, llama.args.vocab_size), NEW, mode="disk", compress="zstd",
                window=0, staging_slots=2, offload_dir=str(tmp_path))
    assert e.value.errno == errno.ENOSPC
    assert not emu.problems(), emu.problems()


def test_a_step_that_fails_half_way_leaves_no_copy_behind(llama, tmp_path, monkeypatch):
    """A disk read fails in the middle of a step: the task raises DiskError while the copies of
    later chunks are already issued on the copy stream; close() must let them land before it frees
    the slots and unpins the bounces."""
    read_into = disk.DiskTier.read_into

    def failing(tier, layer, j, dst):
        if (layer, j) == (0, 2):
            raise DiskError(errno.EIO, "injected read error")
        return read_into(tier, layer, j, dst)
    # before emulate(), which wraps it and restores it
    monkeypatch.setattr(disk.DiskTier, "read_into", failing)
    with cuda_emu.emulate(strict_waits=True) as emu:
        with pytest.raises(DiskError):
            run(llama, prompt(P, llama.args.vocab_size), NEW, mode="disk", window=0,
                staging_slots=3, offload_dir=str(tmp_path))
    assert not emu.problems(), emu.problems()
    assert emu.stats["queued_at_close"]["copy"] > 0, (
        "no copy left in flight: the test no longer covers close()")


def test_launch_count_tool_counts_one_attention_call_per_group(checkpoint):
    """tools/launch_count.py counts a decode step's launches on the emulated CUDA path: at 64
    positions in chunks of 8 a layer attends its 8 sealed chunks as one group and the open chunk
    apart, so 2 attention kernels a layer; no race. The host tier (window 4) brings a layer's 4
    offloaded chunks, side by side in the host pool, with one copy into a group buffer, and the
    window's 4 chunks are copied in after them: 5 copies a layer more than --offload none (chunk by
    chunk it was 12: each offloaded chunk into a staging slot and on into the group buffer)."""
    import json
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ckpt = checkpoint()
    layers = Transformer.from_pretrained(ckpt).args.n_layers
    counts = {}
    for mode in ("none", "cpu"):
        p = subprocess.run([sys.executable, os.path.join(root, "tools", "launch_count.py"), root,
                            "--ckpt", ckpt, "--context", "64", "--chunk-size", "8",
                            "--mode", mode], capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        counts[mode] = json.loads(p.stdout.strip().splitlines()[-1])
        assert counts[mode]["attention_kernels"] == 2 * layers, counts[mode]
        assert counts[mode]["emulator_problems"] == 0
    assert counts["cpu"]["copies"] - counts["none"]["copies"] == 5 * layers, counts
    assert counts["cpu"]["launches"] > counts["none"]["launches"]
