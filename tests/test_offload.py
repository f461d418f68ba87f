"""
Offload changes where bytes live, never the math: every mode against --offload none (torch.equal),
the cached path against the unchunked reference (and a step across a chunk boundary refused),
memory that does not grow with context on the disk tier, CUDA ordering.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from disk import ALIGN, round_up
from generate import Sampling
from model import Transformer
from offload import OffloadConfig
from runs.task import run_task

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = [("cpu", "none"), ("disk", "none"), ("disk", "zstd")]
CUDA = torch.cuda.is_available()


def prompt(n, vocab, seed=0):
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(model, ids, new, chunk, mode="none", compress="none", window=1, tmp=None,
        sampling=Sampling(), **cfg_fields):
    """run_task: (new ids, [(length, logits) of each step], stats)."""
    steps = []

    def on_step(phase, logits, cache):
        steps.append((cache.length, logits.cpu().clone()))
    cfg = OffloadConfig(mode=mode, window=window, compress=compress,
                        offload_dir=str(tmp or "/nonexistent"), **cfg_fields)
    out, stats = run_task(model, ids, new, chunk_size=chunk, cfg=cfg, sampling=sampling,
                          on_step=on_step)
    return out, steps, stats


def tier_label(mode, compress):
    """cpu, disk or disk+zstd: what assert_tiers_used expects."""
    return mode + ("+zstd" if compress == "zstd" else "")


def assert_identical(base, other, label):
    (ids_a, steps_a, _), (ids_b, steps_b, _) = base, other
    assert len(steps_a) == len(steps_b), label
    for (pos_a, la), (pos_b, lb) in zip(steps_a, steps_b):
        assert pos_a == pos_b and torch.equal(la, lb), f"{label}: logits differ at position {pos_a}"
    assert ids_a == ids_b, label


def assert_tiers_used(mode, stats, label):
    chunks, moved = stats["chunks"], stats["bytes"]
    if mode == "cpu":
        assert chunks["host"] > 0 and moved["d2h"] > 0, (
            f"{label}: nothing reached the host tier: {stats}")
    else:
        assert chunks["disk"] > 0 and moved["disk_write"] > 0, f"{label}: disk unused: {stats}"
        read = "disk_read" if mode == "disk+zstd" else "disk_mapped_read"
        assert moved[read] > 0, f"{label}: disk unread: {stats}"


@pytest.fixture(scope="module")
def llama(checkpoint):
    return Transformer.from_pretrained(checkpoint())


# chunk size, prompt length (never a multiple of the chunk size), new tokens, window
SHAPES = [(1, 23, 6, 3), (7, 45, 8, 1), (64, 201, 8, 1), (512, 1100, 4, 0)]


@pytest.mark.parametrize("chunk,n_prompt,new,window", SHAPES)
def test_every_mode_bit_identical_to_none(llama, tmp_path, chunk, n_prompt, new, window):
    ids = prompt(n_prompt, llama.args.vocab_size)
    base = run(llama, ids, new, chunk)
    assert base[2]["chunks"]["host"] == base[2]["chunks"]["disk"] == 0
    for mode, compress in MODES:
        label = f"{mode}+{compress} chunk {chunk}"
        other = run(llama, ids, new, chunk, mode, compress, window, tmp_path)
        assert_identical(base, other, label)
        assert_tiers_used(tier_label(mode, compress), other[2], label)
    assert not any(os.scandir(tmp_path)), "the disk tier's files must be removed when the task ends"


@pytest.mark.parametrize("arch,dtype", [("qwen2", torch.float32),
                                        ("llama", torch.bfloat16),
                                        ("llama", torch.float16)])
def test_bit_identical_other_models_and_dtypes(checkpoint, tmp_path, arch, dtype):
    """Qwen2 (q/k/v biases, tied embeddings) in fp32, bf16 and fp16 compute and caches, sampling
    rather than greedy."""
    ckpt = checkpoint(arch=arch, tie_word_embeddings=arch == "qwen2")
    model = Transformer.from_pretrained(ckpt, dtype=dtype)
    ids = prompt(90, model.args.vocab_size, seed=1)
    s = Sampling(temperature=0.8, top_k=50, top_p=0.9, seed=3)
    base = run(model, ids, 12, 16, sampling=s)
    for mode, compress in MODES:
        other = run(model, ids, 12, 16, mode, compress, 2, tmp_path, sampling=s)
        assert_identical(base, other, f"{arch} {dtype} {mode}+{compress}")
        assert_tiers_used(tier_label(mode, compress), other[2], f"{arch} {mode}")


@pytest.mark.parametrize("chunk,n_prompt", [(16, 64), (32, 96)])
def test_prompt_ending_on_a_chunk_boundary(llama, tmp_path, chunk, n_prompt):
    """The prompt fills its last chunk exactly (so prefill ends on a seal and decoding opens a fresh
    chunk), then decoding crosses several more boundaries: logits bit-identical in every mode, and
    close to the unchunked model."""
    ids = prompt(n_prompt, llama.args.vocab_size, seed=7)
    new = 3 * chunk + 5
    base = run(llama, ids, new, chunk)
    for mode, compress in MODES:
        other = run(llama, ids, new, chunk, mode, compress, 1, tmp_path)
        assert_identical(base, other, f"{mode}+{compress} at {chunk}")
    with torch.inference_mode():
        ref = llama(torch.tensor([ids + base[0][:-1]]))[0]  # [T, V]
    lengths = [length for length, _ in base[1]]
    assert n_prompt in lengths
    assert all(length in lengths for length in range(n_prompt + chunk, n_prompt + new, chunk))
    for length, logits in base[1]:
        assert (ref[length - 1] - logits[0]).abs().max() < 1e-4, length


def test_host_budget_spills_to_disk(llama, tmp_path):
    """--offload disk with a small --cpu-budget: the first evicted chunks fill the host pool, the
    rest go to disk."""
    ids = prompt(300, llama.args.vocab_size, seed=2)
    base = run(llama, ids, 5, 16)
    slot_bytes = round_up(2 * llama.args.n_kv_heads * 16 * llama.args.head_dim * 4, ALIGN)
    other = run(llama, ids, 5, 16, "disk", "none", 1, tmp_path,
                cpu_budget_gib=10 * slot_bytes / 2**30)
    assert_identical(base, other, "spill")
    assert other[2]["chunks"]["host"] == 10 and other[2]["chunks"]["disk"] > 0, other[2]


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_cached_path_agrees_with_unchunked_reference(llama, chunk):
    ids = prompt(150, llama.args.vocab_size, seed=4)
    new, steps, _ = run(llama, ids, 16, chunk)
    with torch.inference_mode():
        ref = llama(torch.tensor([ids + new[:-1]]))[0]  # [T, V]
    assert ref[len(ids) - 1:].argmax(-1).tolist() == new
    for length, logits in steps:  # logits of position length-1
        assert (ref[length - 1] - logits[0]).abs().max() < 1e-4


def test_step_may_not_cross_a_chunk_boundary(llama):
    from kvcache import make_cache
    cache = make_cache(llama, OffloadConfig(), 8, 64)
    with pytest.raises(ValueError, match="crosses a chunk boundary"):
        cache.begin(9)
    cache.store.close()


def test_model_call_across_a_chunk_boundary_is_the_caches_clear_error(llama):
    from kvcache import make_cache
    cache = make_cache(llama, OffloadConfig(), 8, 64)
    try:
        with pytest.raises(ValueError, match="crosses a chunk boundary"):
            llama(torch.randint(3, 100, (1, 12)), cache)
        with pytest.raises(ValueError, match="cache.begin"):  # fits, but begin() was not called
            llama(torch.randint(3, 100, (1, 4)), cache)
    finally:
        cache.store.close()


def test_long_context_through_disk_tier(llama, tmp_path):
    ids = prompt(4000, llama.args.vocab_size, seed=5)
    base = run(llama, ids, 4, 256)
    other = run(llama, ids, 4, 256, "disk", "zstd", 1, tmp_path)
    assert_identical(base, other, "4000 tokens, disk+zstd")
    # every sealed chunk but the window's, 2 layers
    assert other[2]["chunks"]["disk"] == 2 * (4000 // 256 - 1)


MEMORY_PROBE = """
import json
import sys

import torch

sys.path.insert(0, {root!r})
from model import Transformer
from offload import OffloadConfig
from runs.task import run_task

m = Transformer.from_pretrained({ckpt!r})
peaks = []
for n in (1000, 9000):  # run_task's peak is its own: the max of RssAnon sampled at each step
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, m.args.vocab_size, (n,), generator=generator).tolist()
    cfg = OffloadConfig(mode={mode!r}, window=1, offload_dir={tmp!r})
    _, st = run_task(m, ids, 2, chunk_size=512, cfg=cfg)
    peaks.append(st["peak_host_anon_bytes"])
print(json.dumps(peaks))
"""


def test_disk_tier_anon_memory_does_not_grow_with_context(checkpoint, tmp_path):
    """RssAnon (what the process holds) for a 9K prompt vs a 1K prompt: grows by the KV bytes with
    --offload none, by far less with --offload disk, whose chunks live in the page cache (RssFile).
    (Without generate.trim_heap the freed activations that glibc keeps made the disk tier's growth
    wander between 5% and 40% of the KV.)"""
    # 16 KiB of fp32 KV per token
    ckpt = checkpoint(num_attention_heads=8, num_key_value_heads=8, head_dim=128)
    kv_extra = 8000 * 2 * 2 * 8 * 128 * 4

    def growth(mode):
        script = MEMORY_PROBE.format(root=ROOT, ckpt=ckpt, mode=mode, tmp=str(tmp_path))
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             check=True)
        small, large = json.loads(out.stdout)
        return large - small

    grow_none = growth("none")
    grow_disk = growth("disk")
    assert grow_none > 0.8 * kv_extra, (grow_none, kv_extra)
    assert grow_disk < 0.1 * kv_extra, (grow_disk, kv_extra)


# -----------------------------------------------------------------------------
# CUDA: the copy stream, events and staging slots (skipped cleanly without a GPU)

@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("chunk,window", [(16, 0), (64, 1)])
def test_cuda_bit_identical_with_tiny_windows(checkpoint, tmp_path, chunk, window):
    model = Transformer.from_pretrained(checkpoint(), device="cuda")
    ids = prompt(700, model.args.vocab_size, seed=6)
    base = run(model, ids, 40, chunk)
    for mode, compress in MODES:
        other = run(model, ids, 40, chunk, mode, compress, window, tmp_path, staging_slots=2)
        assert_identical(base, other, f"cuda {mode}+{compress}")
        assert other[2]["bytes"]["h2d"] > 0 and other[2]["bytes"]["d2h"] > 0


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_prefetch_runs_on_a_side_stream(checkpoint):
    from kvcache import make_cache
    model = Transformer.from_pretrained(checkpoint(), device="cuda")
    cache = make_cache(model, OffloadConfig(mode="cpu", window=0), 16, 128)
    assert cache.store.copy_stream != torch.cuda.current_stream()
    cache.store.close()


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_peak_memory_independent_of_context(checkpoint, tmp_path):
    ckpt = checkpoint(num_attention_heads=16, num_key_value_heads=16, head_dim=64)
    model = Transformer.from_pretrained(ckpt, device="cuda")
    peaks = {}
    for n in (1000, 6000):
        _, _, st = run(model, prompt(n, model.args.vocab_size), 4, 256, "cpu", "none", 1, tmp_path)
        peaks[n] = st["peak_device_bytes"]
    kv_extra = 5000 * 2 * 2 * 16 * 64 * 4
    assert peaks[6000] - peaks[1000] < 0.1 * kv_extra, peaks
