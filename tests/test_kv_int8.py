"""
--kv-dtype int8: the layout's round trip, the bytes it saves (in shapes and in what the store
moves), offload still bit-identical to --offload none with the same --kv-dtype, quality against the
unquantized model, verify.py, resume.
"""
import json
import os
import sys

import pytest
import torch

from kvlayout import Int8Layout, PlainLayout, chunk_layout, kv_bytes_per_token
from model import ModelArgs, Transformer
from offload import OffloadConfig
from pools import alloc_chunks
from runs.task import run_task
from test_offload import MODES, assert_identical, assert_tiers_used, prompt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import quality  # noqa: E402


def run(model, ids, new, chunk, mode="none", compress="none", window=1, tmp=None, kv_dtype="int8",
        **task):
    """run_task with int8 KV by default: (new ids, [(length, logits) of each step], stats)."""
    steps = []

    def on_step(phase, logits, cache):
        steps.append((cache.length, logits.cpu().clone()))
    cfg = OffloadConfig(mode=mode, window=window, compress=compress,
                        offload_dir=str(tmp or "/nonexistent"))
    out, stats = run_task(model, ids, new, chunk_size=chunk, cfg=cfg, kv_dtype=kv_dtype,
                          on_step=on_step, **task)
    return out, steps, stats


@pytest.fixture(scope="module")
def llama(checkpoint):
    return Transformer.from_pretrained(checkpoint())


# -----------------------------------------------------------------------------
# the layout

# D=6: the scales are not 4-byte aligned, read through a copy
@pytest.mark.parametrize("D", [64, 16, 6])
def test_round_trip_within_half_a_scale(D):
    layout = Int8Layout(torch.float32)
    B = 1
    G = 2
    C = 8
    off = 3  # where the written positions start
    T = 5    # how many are written
    _, (chunk,) = alloc_chunks(1, layout.shape(B, G, C, D), layout.dtype, "cpu")
    assert chunk.dtype == torch.uint8 and chunk.shape == (2, B, G, C, D + 4)
    g = torch.Generator().manual_seed(D)
    # rows of every size
    k = torch.randn(B, G, T, D, generator=g) * torch.rand(B, G, T, 1, generator=g).mul(100)
    v = torch.randn(B, G, T, D, generator=g) * 1e-3
    k[0, 1, 2] = 0.0  # an all-zero row: scale 0, no NaN
    layout.write(chunk, off, k, v)
    k2, v2 = layout.read(chunk, off + T)
    assert k2.shape == v2.shape == (B, G, off + T, D) and k2.dtype == torch.float32
    for x, x2 in ((k, k2[:, :, off:]), (v, v2[:, :, off:])):
        half = x.abs().amax(-1, keepdim=True) / 127 / 2  # scale / 2, per token and head
        assert ((x2 - x).abs() <= half * (1 + 1e-6)).all()
        assert not torch.equal(x2, x), (
            "int8 must round something: the test would pass for a no-op layout")
    assert torch.equal(k2[0, 1, off + 2], torch.zeros(D))


def test_plain_layout_reads_views():
    layout = PlainLayout(torch.bfloat16)
    chunk = torch.zeros(layout.shape(1, 2, 8, 4), dtype=layout.dtype)
    k = torch.ones(1, 2, 3, 4)
    v = torch.full((1, 2, 3, 4), 2.0)
    layout.write(chunk, 5, k, v)
    k2, v2 = layout.read(chunk, 8)
    assert k2.data_ptr() == chunk.data_ptr() and torch.equal(v2[:, :, 5:], v.bfloat16())


def test_a_decode_step_dequantizes_the_open_chunk_once_a_layer(llama, monkeypatch):
    """The open chunk's K and V, held as int8, are dequantized once a layer in a decode step; the
    path that read them again for the fused kernel (taken here by a read_held that is not the
    layout's read) dequantized them twice, to the same logits: the same arithmetic on the same
    bytes."""
    from generate import decode_one_token
    from measure.probe import filled_cache
    reads = []
    read = Int8Layout.read

    def counted(self, chunk, upto):
        reads.append(upto)
        return read(self, chunk, upto)
    logits = {}
    with torch.inference_mode():
        for path in ("once", "twice"):
            cache = filled_cache(llama, 40, 16, 8, kv_dtype="int8")
            monkeypatch.setattr(Int8Layout, "read", counted)
            # the same function under another name where the second path is taken
            held = counted if path == "once" else (lambda *a: counted(*a))
            monkeypatch.setattr(Int8Layout, "read_held", held)
            reads.clear()
            logits[path] = decode_one_token(llama, cache, torch.full((1, 1), 3))
            per_layer = 1 if path == "once" else 2
            assert reads == [40 % 16 + 1] * per_layer * llama.args.n_layers, path
    assert torch.equal(logits["once"], logits["twice"])


def test_int8_chunk_is_about_half_of_bf16():
    """A [2, 1, G, C, D] chunk: bf16 holds 2 bytes an element, int8 one plus a 4-byte scale per row
    of D."""
    G = 8
    C = 512
    D = 128

    def nbytes(layout):
        return torch.Size(layout.shape(1, G, C, D)).numel() * layout.dtype.itemsize
    bf16 = nbytes(chunk_layout("auto", torch.bfloat16))
    int8 = nbytes(chunk_layout("int8", torch.bfloat16))
    assert bf16 == 2 * G * C * D * 2 and int8 == 2 * G * C * (D + 4)
    assert 0.5 < int8 / bf16 < 0.52  # 132 / 256
    # Llama-3-8B's KV: 128 KiB/token in bf16
    model_args = ModelArgs(n_layers=32, n_kv_heads=G, head_dim=D)
    assert kv_bytes_per_token(model_args, torch.bfloat16) == 2 * 32 * G * D * 2 == 128 * 1024
    assert kv_bytes_per_token(model_args, torch.bfloat16, "int8") == 32 * 2 * G * (D + 4)
    with pytest.raises(ValueError, match="--kv-dtype"):
        chunk_layout("int2", torch.float32)


# -----------------------------------------------------------------------------
# offload with int8 chunks: bit-identical, and half the bytes moved

# chunk size, prompt length (never a multiple of the chunk size), new tokens, window
SHAPES = [(1, 23, 6, 3), (7, 45, 8, 1), (16, 90, 10, 0), (64, 201, 8, 1)]


@pytest.mark.parametrize("chunk,n_prompt,new,window", SHAPES)
def test_int8_every_mode_bit_identical_to_none(llama, tmp_path, chunk, n_prompt, new, window):
    ids = prompt(n_prompt, llama.args.vocab_size, seed=chunk)
    base = run(llama, ids, new, chunk)
    plain = run(llama, ids, new, chunk, kv_dtype="auto")
    assert not torch.equal(base[1][-1][1], plain[1][-1][1]), (
        "int8 KV must change the logits: is it in effect?")
    for mode, compress in MODES:
        label = f"int8 {mode}+{compress} chunk {chunk}"
        other = run(llama, ids, new, chunk, mode, compress, window, tmp_path)
        assert_identical(base, other, label)
        assert_tiers_used(mode + ("+zstd" if compress == "zstd" else ""), other[2], label)
        assert other[2]["kv_dtype"] == "int8"
    assert not any(os.scandir(tmp_path)), "the disk tier's files must be removed when the task ends"


def test_int8_moves_about_half_the_bytes_of_bf16(checkpoint, tmp_path):
    """The same bf16 run with --offload cpu: the int8 chunks' d2h bytes are (D + 4) / 2D of bf16's,
    and the disk tier (zstd: one byte plane) writes less too."""
    D = 64
    model = Transformer.from_pretrained(checkpoint(head_dim=D), dtype=torch.bfloat16)
    ids = prompt(100, model.args.vocab_size, seed=7)
    moved = {}
    for kv in ("auto", "int8"):
        moved[kv] = run(model, ids, 4, 16, "cpu", "none", 0, tmp_path, kv_dtype=kv)[2]["bytes"]
    assert moved["auto"]["d2h"] > 0
    assert moved["int8"]["d2h"] / moved["auto"]["d2h"] == pytest.approx((D + 4) / (2 * D))  # 0.53
    zst = {}
    for kv in ("auto", "int8"):
        zst[kv] = run(model, ids, 4, 16, "disk", "zstd", 0, tmp_path, kv_dtype=kv)[2]["bytes"]
    assert 0 < zst["int8"]["disk_write"] < 0.75 * zst["auto"]["disk_write"], zst


def test_resume_never_mixes_kv_dtypes(llama, tmp_path):
    """A disk tier left by an int8 run (its manifest kept) resumes an int8 rerun, never an
    unquantized one."""
    ids = prompt(60, llama.args.vocab_size, seed=8)
    logs = []
    cfg = OffloadConfig(mode="disk", window=0, offload_dir=str(tmp_path), keep_files=True)

    def task(kv):
        return run_task(llama, ids, 4, chunk_size=8, cfg=cfg, kv_dtype=kv, fingerprint="fp",
                        task_id="t", log=logs.append)
    first = task("int8")
    again = task("int8")
    # the same kv dtype: resumed, same output
    assert again[1]["resumed_from"] > 0 and again[0] == first[0]
    other = task("auto")
    assert other[1]["resumed_from"] == 0 and any("another kv_dtype" in m for m in logs), logs


# -----------------------------------------------------------------------------
# quality against the unquantized model, and the tools

def test_int8_cached_path_agrees_with_fp32_on_tiny_checkpoint(llama):
    """A random tiny model has many near-ties, so 'most tokens', not all: measured 95% top-1, 95%
    greedy."""
    r = quality.measure(llama, prompt(300, llama.args.vocab_size), chunk_size=16, prompt_tokens=100,
                        new_tokens=40)
    assert r["top1_agreement"] >= 0.85 and r["greedy_agreement"] >= 0.85, r


def test_int8_greedy_agrees_with_unquantized_demo_model():
    """The demo model on Python's documentation: measured 98.9% teacher-forced top-1 (2048 tokens)
    and 98.4% greedy agreement (128 tokens); here a shorter text keeps the test fast."""
    from runs.flags import DEMO_CKPT
    from tokenizer import load_tokenizer
    model = Transformer.from_pretrained(DEMO_CKPT, dtype=torch.float32)
    ids = quality.pydoc_ids(load_tokenizer(DEMO_CKPT), 640)
    r = quality.measure(model, ids, chunk_size=32, prompt_tokens=256, new_tokens=64)
    assert r["greedy_agreement"] >= 0.95 and r["top1_agreement"] >= 0.95, r
    assert abs(r["ppl_change"]) < 0.01, r


def test_verify_passes_with_int8_kv(text_ckpt, tmp_path, capsys):
    from runs import proofs
    rc = proofs.main(["--ckpt", text_ckpt, "--kv-dtype", "int8", "--max-new-tokens", "8",
                      "--chunk-size", "16", "--window", "1", "--max-prompt-tokens", "150",
                      "--offload-dir", str(tmp_path), "--json"])
    r = json.loads(capsys.readouterr().out)
    assert rc == 0 and r["ok"] and r["kv_dtype"] == "int8", r
    assert all(m["bit_identical"] for m in r["modes"].values())
    assert r["modes"]["cpu"]["chunks"]["host"] > 0
    # the unquantized model, reported not required
    assert r["unchunked"]["top1_agreement"] >= 0.75, r


def test_probe_calibrates_and_counts_int8_chunks(llama):
    from measure import probe
    # fills int8 chunks through the layout
    assert probe.decode_step_s(llama, 20, 8, steps=1, kv_dtype="int8") > 0
    z = probe.zstd_on_real_kv(llama, 8, kv_dtype="int8")
    model_args = llama.args
    # what the disk tier would compress
    assert z["chunk_bytes"] == 2 * model_args.n_kv_heads * 8 * (model_args.head_dim + 4)


def test_probe_predicts_int8_bytes_on_a_slow_link():
    """With a link so slow that transfers are all a step costs, the prediction scales with the
    chunk's bytes."""
    import argparse

    from measure import probe
    model_args = ModelArgs(n_layers=4, n_kv_heads=2, head_dim=64)
    cal = {"zstd": None, "link_gbps": {"h2d_pinned": 1e-3, "host_memcpy": 10.0},
           "worker_handoff_s": 0.0, "chunk_s": 0.0, "step_s": 0.0}
    step_s = {}
    for kv in ("auto", "int8"):
        args = argparse.Namespace(dtype="bf16", kv_dtype=kv, chunk_size=16, window=0, new_tokens=2)
        tokens_per_s = probe.predict_decode(cal, 1024, "cpu", args, model_args, cuda=True)
        step_s[kv] = 1 / tokens_per_s
    assert step_s["int8"] / step_s["auto"] == pytest.approx(68 / 128)


def test_generate_threads_kv_dtype(text_ckpt, tmp_path, capsys):
    """generate.py --kv-dtype int8 reaches the cache: the same tokens with the disk tier as without
    offload, and the statistics say which KV dtype ran."""
    from runs import generate_cli
    out = {}
    for mode in ("none", "disk"):
        assert generate_cli.main(["--ckpt", text_ckpt, "--prompt",
                                  "The with statement wraps a block. " * 8,
                         "--chunk-size", "8", "--window", "1", "--max-new-tokens", "6",
                         "--offload", mode, "--offload-dir", str(tmp_path), "--kv-dtype", "int8",
                         "--json"]) == 0
        out[mode] = json.loads(capsys.readouterr().out)
    assert out["disk"]["tokens"] == out["none"]["tokens"]
    assert out["disk"]["stats"]["chunks"]["disk"] > 0
    assert out["disk"]["stats"]["kv_dtype"] == out["none"]["stats"]["kv_dtype"] == "int8"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_int8_bit_identical_with_tiny_windows(checkpoint, tmp_path):
    """On CUDA the int8 chunks go through the copy streams, pinned pools and staging slots: still
    bit-identical."""
    model = Transformer.from_pretrained(checkpoint(), device="cuda")
    ids = prompt(300, model.args.vocab_size, seed=9)
    base = run(model, ids, 20, 16)
    for mode, compress in MODES:
        other = run(model, ids, 20, 16, mode, compress, 0, tmp_path)
        assert_identical(base, other, f"cuda int8 {mode}+{compress}")
        assert other[2]["bytes"]["h2d"] > 0 and other[2]["bytes"]["d2h"] > 0
