"""
4-bit weights (--quantize int4) and 4-bit KV (--kv-dtype int4): packing round trips and the
quantization error against references computed here from the integers, the CPU kernel against the
dequantize path, the loader against the fp32 model with dequantized weights, offload and resume
bit-identical with int4 KV, the bytes moved, the refusals, the fingerprint, the tuner's fallback.
"""
import json
import math
import os
import shutil
import subprocess
import sys
from argparse import Namespace

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

import quantize
from ckpt import add_sentencepiece
from kvlayout import Int4Layout, kv_bytes_per_token, kv_chunk_bytes
from measure import tune
from model import ModelArgs, Transformer
from offload import OffloadConfig
from pools import alloc_chunks
from quantize import (
    _INT4_CPU_MM,
    _INT4_CPU_PACK,
    INT4_KERNEL_MAX_ROWS,
    Int4Linear,
    dequantize_int4,
    int4_matmul,
    pack_int4,
    quantize_weight_int4,
    unpack_cpu_kernel,
    unpack_int4,
    weight_bytes,
)
from runs import flags, generate_cli, taskdir
from runs.task import run_task
from test_offload import MODES, assert_identical, assert_tiers_used, prompt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "assets", "tinyllama-pydoc")
sys.path.insert(0, os.path.join(ROOT, "tools"))
import quality  # noqa: E402

needs_kernel = pytest.mark.skipif(_INT4_CPU_MM is None,
                                  reason="this torch has no aten._weight_int4pack_mm_for_cpu")


def reference_dequantize(q, scales_and_zeros, group_size):
    """w[n, k] = (q[n, k] - 8) * scale[k // g, n] + zero[k // g, n], element by element in fp64
    over a flat index: the formula of tinygemm's format, written without quantize.py's reshapes."""
    N, K = q.shape
    n = torch.arange(N)[:, None].expand(N, K)
    k = torch.arange(K)[None, :].expand(N, K)
    sz = scales_and_zeros.double()
    return (q.double() - 8) * sz[k // group_size, n, 0] + sz[k // group_size, n, 1]


# -----------------------------------------------------------------------------
# the weights: quantization, packing, the kernel and the dequantize path

@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_weight_error_within_half_a_step(group_size):
    """Every weight is within half its group's step of the original (a group's extremes a little
    more: the bf16-rounded scale and zero move the range's edges), and the 16 levels are used; an
    all-constant group comes back exact."""
    g = torch.Generator().manual_seed(group_size)
    # groups of different magnitudes and offsets
    w = torch.randn(48, 256, generator=g) * torch.rand(48, 1, generator=g) * 3
    w += torch.randn(48, 256 // group_size, generator=g).repeat_interleave(group_size, 1) * 0.5
    w[5] = 0.25  # constant groups
    q, sz = quantize_weight_int4(w, group_size)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15
    assert sz.shape == (256 // group_size, 48, 2) and sz.dtype == torch.bfloat16
    back = reference_dequantize(q, sz, group_size)
    step = sz[..., 0].double().T.repeat_interleave(group_size, 1)             # [N, K]
    zero = sz[..., 1].double().T.repeat_interleave(group_size, 1).abs()
    # at a group's edge, the bf16 rounding of scale and zero may add up to 8 * 2^-9 steps and 2^-9
    # of the zero
    assert ((back - w.double()).abs() <= step * (1 / 2 + 1 / 32) + zero * 2 ** -8 + 1e-7).all()
    assert torch.equal(back[5], torch.full((256,), 0.25, dtype=torch.float64))
    spans = q.view(48, -1, group_size).amax(-1).int() - q.view(48, -1, group_size).amin(-1).int()
    assert (spans[torch.arange(48) != 5] >= 14).all(), "asymmetric: a group spans 16 levels"
    # quantize.py's own dequantize is the same arithmetic
    assert torch.allclose(dequantize_int4(q, sz).double(), back, atol=1e-6)


def test_plain_packing_round_trips_two_weights_a_byte():
    """pack_int4: input feature 2i in the high nibble, 2i+1 in the low (the CUDA kernel's order),
    checked byte by byte against plain arithmetic."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (24, 64), generator=gen, dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (24, 32) and packed.dtype == torch.uint8
    assert int(packed[3, 5]) == int(q[3, 10]) * 16 + int(q[3, 11])
    assert torch.equal(unpack_int4(packed), q)


@needs_kernel
@pytest.mark.parametrize("N", [16, 32, 48, 64, 80, 192, 576])
def test_cpu_kernel_packing_round_trips(N):
    """unpack_cpu_kernel undoes aten._convert_weight_to_int4pack_for_cpu, full blocks of rows and a
    partial last one alike (N 48 and 80 end in one on AVX512)."""
    q = torch.randint(0, 16, (N, 96), generator=torch.Generator().manual_seed(N),
                      dtype=torch.int32)
    packed = _INT4_CPU_PACK(q, 1)
    assert packed.shape == (N, 48) and packed.dtype == torch.uint8
    assert torch.equal(unpack_cpu_kernel(packed), q.to(torch.uint8))


ROUND_TRIP = """
import sys, torch
sys.path.insert(0, sys.argv[1])
import quantize
for N in (16, 32, 48, 64, 80, 96, 192):
    q = torch.randint(0, 16, (N, 64), dtype=torch.int32)
    packed = quantize._INT4_CPU_PACK(q, 1)
    assert torch.equal(quantize.unpack_cpu_kernel(packed), q.to(torch.uint8)), N
print(torch.backends.cpu.get_cpu_capability())
"""


@needs_kernel
@pytest.mark.parametrize("capability", ["avx2", "default"])
def test_cpu_kernel_packing_round_trips_on_other_cpus(capability):
    """The kernel packs rows in another order for each CPU capability torch dispatches to; forced
    with ATEN_CPU_CAPABILITY (in a process of its own), unpack_cpu_kernel still undoes it."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    p = subprocess.run([sys.executable, "-c", ROUND_TRIP, ROOT], capture_output=True, text=True,
                       env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    if p.stdout.strip() != capability.upper():
        pytest.skip(f"this CPU runs {p.stdout.strip()}, not {capability}")


@needs_kernel
@pytest.mark.parametrize("K,N,g", [(64, 96, 32), (576, 192, 64), (256, 48, 128), (96, 80, 32)])
@pytest.mark.parametrize("M", [1, 5, INT4_KERNEL_MAX_ROWS + 3])
def test_kernel_and_dequantize_paths_agree_with_the_reference(K, N, g, M):
    """Both paths against x @ W^T in fp64, W from the integers: within bf16 rounding of the output
    (the kernel rounds its fp32 sum once to bf16; the dequantize path rounds W and the sum)."""
    gen = torch.Generator().manual_seed(K + N + M)
    layer = Int4Linear(K, N, group_size=g)
    layer.load_weight(torch.randn(N, K, generator=gen) * K ** -0.5)
    assert layer.packing == "cpu"
    q = unpack_cpu_kernel(layer.weight)
    ref = torch.randn(M, K, generator=gen).bfloat16()
    expected = ref.double() @ reference_dequantize(q, layer.scales_and_zeros, g).T   # [M, N]
    tol = 2 ** -7 * expected.abs().max().item() * 2  # ~2 bf16 ulps of the largest output
    for kernel in (True, False):
        y = int4_matmul(ref, layer.weight, layer.scales_and_zeros, g, "cpu", kernel=kernel)
        assert y.dtype == torch.bfloat16 and y.shape == (M, N)
        assert (y.double() - expected).abs().max().item() < tol, f"kernel={kernel}"
    a = int4_matmul(ref, layer.weight, layer.scales_and_zeros, g, "cpu", kernel=True)
    b = int4_matmul(ref, layer.weight, layer.scales_and_zeros, g, "cpu", kernel=False)
    assert (a.float() - b.float()).abs().max().item() <= tol


@needs_kernel
def test_kernel_runs_for_decode_rows_only(monkeypatch):
    """The choice of path, which the speed depends on: the kernel up to INT4_KERNEL_MAX_ROWS rows,
    dequantize-and-matmul for a prefill chunk."""
    calls = []

    def counted(*args):
        calls.append(args[0].shape[0])
        return _INT4_CPU_MM(*args)
    monkeypatch.setattr(quantize, "_INT4_CPU_MM", counted)
    layer = Int4Linear(64, 32, group_size=32)
    layer.load_weight(torch.randn(32, 64))
    for M in (1, INT4_KERNEL_MAX_ROWS, INT4_KERNEL_MAX_ROWS + 1, 512):
        layer(torch.randn(1, M, 64).bfloat16())
    assert calls == [1, INT4_KERNEL_MAX_ROWS]


def test_shapes_no_kernel_takes_fall_back_to_the_plain_packing():
    """N not a multiple of 16: the CPU kernel refuses it, so the layer keeps pack_int4's bytes and
    dequantizes; the result is the same arithmetic."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(40, 64, generator=gen)
    layer = Int4Linear(64, 40, group_size=32)
    layer.load_weight(w)
    assert layer.packing == "plain" and layer.weight.shape == (40, 32)
    q, sz = quantize_weight_int4(w, 32)
    assert torch.equal(unpack_int4(layer.weight), q)
    x = torch.randn(2, 64, generator=gen)
    expected = x.double() @ reference_dequantize(q, sz, 32).T
    assert torch.allclose(layer(x).double(), expected, atol=1e-4)


def test_a_group_size_that_does_not_divide_is_refused_in_one_sentence(llama_ckpt):
    """The tiny checkpoint's layers take 64 input features: groups of 128 cannot cover them; the
    message names the flag and the sizes that fit."""
    with pytest.raises(ValueError) as e:
        Transformer.from_pretrained(llama_ckpt, quantize="int4-g128")
    msg = str(e.value)
    assert "--group-size 128" in msg and "64 input features" in msg and "32 or 64" in msg
    assert "\n" not in msg
    with pytest.raises(ValueError, match="group size 48 does not divide 64"):
        Int4Linear(64, 32, group_size=48)


# -----------------------------------------------------------------------------
# the model

def tiny_int4(checkpoint, **kw):
    return Transformer.from_pretrained(checkpoint(**kw), quantize="int4-g32")


KINDS = {"llama": {}, "tied": {"tie_word_embeddings": True}, "qwen2-bias": {"arch": "qwen2"}}


@pytest.mark.parametrize("kind", list(KINDS))
def test_int4_model_is_the_fp32_model_with_dequantized_weights(checkpoint, monkeypatch, kind):
    """Every weight lands in the right Int4Linear (the tied output, biases): with the dequantize
    path forced, the fp32 int4 model equals an fp32 model whose linear weights hold the dequantized
    integers (from reference_dequantize)."""
    monkeypatch.setattr(quantize, "INT4_KERNEL_MAX_ROWS", 0)
    ckpt = checkpoint(**KINDS[kind])
    m4 = Transformer.from_pretrained(ckpt, quantize="int4-g32")
    ref = Transformer.from_pretrained(ckpt)
    for name, mod in list(m4.named_modules()):
        if isinstance(mod, Int4Linear):
            q = unpack_cpu_kernel(mod.weight) if mod.packing == "cpu" else unpack_int4(mod.weight)
            target = ref.get_submodule(name)
            if kind == "tied" and name == "output":  # untie: the output holds its own weights
                target.weight = nn.Parameter(target.weight.clone(), requires_grad=False)
            with torch.no_grad():
                target.weight.copy_(reference_dequantize(q, mod.scales_and_zeros, 32).float())
    assert isinstance(m4.output, Int4Linear) and type(m4.tok_embeddings) is nn.Embedding
    ids = torch.tensor([prompt(40, m4.args.vocab_size, seed=4)])
    with torch.inference_mode():
        assert torch.allclose(m4(ids), ref(ids), atol=1e-4, rtol=1e-4)


def test_weight_bytes_half_a_byte_a_weight_plus_scales(checkpoint):
    """Counted from the fp32 model's parameter shapes: every linear of the blocks and the output at
    N*K/2 bytes plus 4 bytes per group of 32, everything else in bf16."""
    ckpt = checkpoint()
    fp32 = Transformer.from_pretrained(ckpt)
    expected = 0
    for name, p in fp32.named_parameters():
        if name.startswith(("layers.", "output.")) and p.dim() == 2:
            expected += p.numel() // 2 + 4 * p.numel() // 32
        else:
            expected += 2 * p.numel()
    m4 = Transformer.from_pretrained(ckpt, dtype=torch.bfloat16, quantize="int4-g32")
    assert weight_bytes(m4) == expected


def test_int4_weights_keep_top1_agreement_on_the_demo_model():
    """Real text (the demo model reading pages of Python's documentation): top-1 agreement with
    the fp32 model at least 85% (measured 92.1% over 40 pages in docs/quantization.md; 10 here)."""
    tok = quality.Tokenizer(DEMO)
    pages = quality.pydoc_pages(tok, 10, 256)
    reference = Transformer.from_pretrained(DEMO)
    ref_logits = [quality.logits_of(reference, ids) for ids in pages]
    m4 = Transformer.from_pretrained(DEMO, dtype=torch.bfloat16, quantize="int4-g32")
    top1, ppl = quality.teacher_forced(m4, ref_logits, pages)
    _, ref_ppl = quality.teacher_forced(reference, ref_logits, pages)
    assert top1 >= 0.85 and ppl / ref_ppl - 1 < 0.05, (top1, ppl, ref_ppl)
    assert top1 < 0.999, "int4 must change something: is it in effect?"


@pytest.mark.parametrize("mode,compress", MODES)
def test_offload_bit_identical_with_int4_weights(checkpoint, tmp_path, mode, compress):
    model = tiny_int4(checkpoint)
    ids = prompt(45, model.args.vocab_size, seed=5)
    base = run(model, ids, 8, 8, kv_dtype="auto")
    other = run(model, ids, 8, 8, mode, compress, 1, tmp_path, kv_dtype="auto")
    assert_identical(base, other, f"int4 weights {mode}+{compress}")


# -----------------------------------------------------------------------------
# the KV layout

def row_bytes(C, D):
    """An int4 chunk's bytes per position and kv head, from the layout's description: D nibbles of
    keys and values, a 4-byte fp16 (scale, minimum) of the values, and the share of 4 bytes per
    channel and group of 64 positions of the keys' (scale, minimum), rounded up to 4 bytes."""
    groups = math.ceil(C / 64)
    return D + 4 + 4 * math.ceil(groups * D * 4 / C / 4)


def within_half_a_step(x2, x, dim):
    """|x2 - x| within half a step of 16 levels spanning x over `dim`, plus the fp16 rounding of
    the stored minimum and scale (2^-11 of each, the scale's times 15 levels)."""
    lo = x.amin(dim, keepdim=True)
    step = (x.amax(dim, keepdim=True) - lo) / 15
    slack = (lo.abs() + 15 * step) * 2 ** -10
    return bool(((x2 - x).abs() <= step / 2 + slack + 1e-6).all())


def test_int4_layout_round_trip():
    """Values within half their position's step from the first write; keys as computed while the
    chunk is open, within half their channel's step (over their group of 64 positions) once the
    write that fills the chunk has quantized them; the steps computed here from the tensors."""
    layout = Int4Layout(torch.float32)
    B, G, C, D = 1, 2, 80, 16  # two key groups: 64 positions and 16
    _, (chunk,) = alloc_chunks(1, layout.shape(B, G, C, D), layout.dtype, "cpu")
    assert chunk.shape == (1, B, G, C, row_bytes(C, D)) and chunk.dtype == torch.uint8
    gen = torch.Generator().manual_seed(2)
    # channels of different sizes and offsets: what per-channel scales are for
    k = torch.randn(B, G, C, D, generator=gen) * torch.rand(D, generator=gen) * 20 + 5
    # the second group's keys span a hundredth of the first's: one scale for both would fail
    # its bound
    k[:, :, 64:] = k[:, :, 64:] * 0.01
    v = torch.randn(B, G, C, D, generator=gen) * torch.rand(B, G, C, 1, generator=gen)
    off = 0
    for T in (3, 1, 60, 16):  # the open chunk, written a few positions at a time
        layout.write(chunk, off, k[:, :, off:off + T], v[:, :, off:off + T])
        off += T
        k2, v2 = layout.read(chunk, off)
        assert k2.shape == v2.shape == (B, G, off, D)
        assert within_half_a_step(v2, v[:, :, :off], -1)
        if off < C:
            assert torch.equal(k2, k[:, :, :off])
    assert off == C and not layout.open_keys, "the full chunk's keys live in its bytes only"
    for start in (0, 64):
        group = slice(start, start + 64)
        assert within_half_a_step(k2[:, :, group], k[:, :, group], 2)
    assert not torch.equal(k2, k), "int4 must round something"
    # a copy of the bytes reads the same: a read is a function of the bytes alone
    assert all(torch.equal(a, b) for a, b in zip(layout.read(chunk.clone(), C), (k2, v2)))


def test_int4_layout_reads_the_compute_dtype_whatever_is_written():
    """As PlainLayout: fp32 written into a bf16 cache (the probe's synthetic K and V) reads back as
    bf16, open chunk and sealed alike."""
    layout = Int4Layout(torch.bfloat16)
    _, (chunk,) = alloc_chunks(1, layout.shape(1, 2, 4, 8), layout.dtype, "cpu")
    kv = torch.randn(2, 1, 2, 4, 8)
    layout.write(chunk, 0, kv[0, :, :, :2], kv[1, :, :, :2])
    assert all(x.dtype == torch.bfloat16 for x in layout.read(chunk, 2))
    layout.write(chunk, 2, kv[0, :, :, 2:], kv[1, :, :, 2:])
    assert all(x.dtype == torch.bfloat16 for x in layout.read(chunk, 4))


def test_int4_layout_refuses_an_odd_head_dim():
    with pytest.raises(ValueError, match="head_dim 15 is odd; use --kv-dtype int8"):
        Int4Layout(torch.float32).shape(1, 2, 8, 15)


def test_int4_chunk_is_about_a_quarter_of_bf16():
    """Exact byte counts from the layout's description (row_bytes): D=128, C=512, 0.273 of bf16."""
    model_args = ModelArgs(n_layers=32, n_kv_heads=8, head_dim=128)
    bf16 = kv_chunk_bytes(model_args, torch.bfloat16, "auto", 512)
    int4 = kv_chunk_bytes(model_args, torch.bfloat16, "int4", 512)
    assert bf16 == 2 * 8 * 512 * 128 * 2
    assert int4 == 8 * 512 * row_bytes(512, 128) == 8 * 512 * 140
    assert 0.27 < int4 / bf16 < 0.28
    per_token = kv_bytes_per_token(model_args, torch.bfloat16, "int4", 512)
    assert per_token == 32 * int4 / 512
    with pytest.raises(ValueError, match="chunk size"):
        kv_bytes_per_token(model_args, torch.bfloat16, "int4")


# -----------------------------------------------------------------------------
# offload and resume with int4 KV

def run(model, ids, new, chunk, mode="none", compress="none", window=1, tmp=None, kv_dtype="int4",
        keep_files=False, **task):
    """run_task with int4 KV by default: (new ids, [(length, logits) of each step], stats)."""
    steps = []

    def on_step(phase, logits, cache):
        steps.append((cache.length, logits.cpu().clone()))
    cfg = OffloadConfig(mode=mode, window=window, compress=compress,
                        offload_dir=str(tmp or "/nonexistent"), keep_files=keep_files)
    out, stats = run_task(model, ids, new, chunk_size=chunk, cfg=cfg, kv_dtype=kv_dtype,
                          on_step=on_step, **task)
    return out, steps, stats


@pytest.fixture(scope="module")
def llama(checkpoint):
    return Transformer.from_pretrained(checkpoint())


# chunk size, prompt length (never a multiple of the chunk size), new tokens, window
SHAPES = [(1, 23, 6, 3), (7, 45, 8, 1), (16, 90, 10, 0), (64, 201, 8, 1)]


@pytest.mark.parametrize("chunk,n_prompt,new,window", SHAPES)
def test_int4_every_mode_bit_identical_to_none(llama, tmp_path, chunk, n_prompt, new, window):
    ids = prompt(n_prompt, llama.args.vocab_size, seed=chunk)
    base = run(llama, ids, new, chunk)
    plain = run(llama, ids, new, chunk, kv_dtype="auto")
    int8 = run(llama, ids, new, chunk, kv_dtype="int8")
    assert not torch.equal(base[1][-1][1], plain[1][-1][1]), "int4 KV must change the logits"
    assert not torch.equal(base[1][-1][1], int8[1][-1][1]), "int4 is not int8"
    for mode, compress in MODES:
        label = f"int4 {mode}+{compress} chunk {chunk}"
        other = run(llama, ids, new, chunk, mode, compress, window, tmp_path)
        assert_identical(base, other, label)
        assert_tiers_used(mode + ("+zstd" if compress == "zstd" else ""), other[2], label)
        assert other[2]["kv_dtype"] == "int4"
    assert not any(os.scandir(tmp_path)), "the disk tier's files must be removed when the task ends"


def test_int4_moves_about_a_quarter_of_the_bytes_of_bf16(checkpoint, tmp_path):
    """The same bf16 run with --offload cpu: the int4 chunks' d2h bytes are the layouts' byte ratio
    exactly, row_bytes / 4D a position (chunks of 16: 84 / 256; of 512 it would be 72 / 256)."""
    D = 64
    C = 16
    model = Transformer.from_pretrained(checkpoint(head_dim=D), dtype=torch.bfloat16)
    ids = prompt(100, model.args.vocab_size, seed=7)
    moved = {}
    for kv in ("auto", "int4"):
        moved[kv] = run(model, ids, 4, C, "cpu", "none", 0, tmp_path, kv_dtype=kv)[2]["bytes"]
    assert moved["auto"]["d2h"] > 0
    assert moved["int4"]["d2h"] / moved["auto"]["d2h"] == pytest.approx(row_bytes(C, D) / (4 * D))


def test_resumed_int4_run_is_the_uninterrupted_one(llama, tmp_path):
    """A run killed mid-decode (its disk tier and manifest kept) and rerun: it restores the sealed
    chunks, recomputes the open one's keys by replay, and ends with the uninterrupted run's tokens
    and, step for step, its logits."""
    ids = prompt(61, llama.args.vocab_size, seed=8)  # ends inside a chunk of 8

    class Crash(Exception):
        pass

    def crash_at(out):
        if len(out) == 14:
            raise Crash
    whole = run(llama, ids, 24, 8)
    cfg = dict(fingerprint="fp", task_id="t")
    with pytest.raises(Crash):
        run(llama, ids, 24, 8, "disk", "none", 0, tmp_path, keep_files=True, on_token=crash_at,
            **cfg)
    again = run(llama, ids, 24, 8, "disk", "none", 0, tmp_path, **cfg)
    assert again[2]["resumed_from"] > len(ids), "resumed inside the decode"
    assert again[0] == whole[0]
    by_length = dict(whole[1])
    for length, logits in again[1]:
        assert torch.equal(logits, by_length[length]), f"step at {length} differs after resume"


# -----------------------------------------------------------------------------
# the command line, the fingerprint, the tools

def fingerprint(ckpt, *argv):
    args = generate_cli.build_parser().parse_args(["--ckpt", ckpt, *argv])
    flags.check_common(args, needs_disk=False)
    return flags.run_fingerprint(ckpt, args)


def test_fingerprint_changes_with_int4_and_its_group_size(llama_ckpt):
    runs = [(), ("--quantize", "int8"), ("--quantize", "int4"),
            ("--quantize", "int4", "--group-size", "64"), ("--kv-dtype", "int4"),
            ("--kv-dtype", "int8")]
    fps = [fingerprint(llama_ckpt, *r) for r in runs]
    assert len(set(fps)) == len(runs), "resume and the KV store must never mix these runs"
    assert fingerprint(llama_ckpt, "--quantize", "int4") == fingerprint(
        llama_ckpt, "--quantize", "int4", "--group-size", "32"), "32 is the default"


def test_fingerprint_changes_with_the_decode_kernels_and_keeps_the_defaults(llama_ckpt,
                                                                            monkeypatch):
    """The kernels of a decode step's few rows shape the KV of what it writes: resume and the KV
    store never mix --attention or --products; their defaults keep the fingerprints of before."""
    import fewrows
    monkeypatch.setattr(fewrows, "KERNEL", fewrows.KERNEL)      # restored after: the runs set them
    monkeypatch.setattr(fewrows, "PRODUCTS", fewrows.PRODUCTS)
    runs = [(), ("--attention", "compiled"), ("--attention", "auto"), ("--products", "compiled")]
    fps = [fingerprint(llama_ckpt, *r) for r in runs]
    assert len(set(fps)) == len(runs)
    assert fps[0] == fingerprint(llama_ckpt, "--attention", "flash", "--products", "library")
    assert fps[0] == taskdir.run_fingerprint(taskdir.model_fingerprint(llama_ckpt), dtype="fp32")


def test_generate_int4_weights_and_kv(text_ckpt, tmp_path, capsys):
    """generate.py --quantize int4 --kv-dtype int4: the disk tier gives the tokens --offload none
    gives, and the result's config names the weights' format and the group size."""
    out = {}
    for mode in ("none", "disk"):
        assert generate_cli.main(["--ckpt", text_ckpt, "--prompt",
                                  "The with statement wraps a block. " * 8,
                         "--chunk-size", "8", "--window", "1", "--max-new-tokens", "6",
                         "--offload", mode, "--offload-dir", str(tmp_path), "--quantize", "int4",
                         "--kv-dtype", "int4", "--json"]) == 0
        out[mode] = json.loads(capsys.readouterr().out)
    assert out["disk"]["tokens"] == out["none"]["tokens"]
    assert out["disk"]["stats"]["chunks"]["disk"] > 0
    config = out["disk"]["config"]
    assert config["quantize"] == "int4-g32" and config["kv_dtype"] == "int4"
    assert config["dtype"] == "bf16", "bf16 activations: the kernel's fast path"


@pytest.mark.parametrize("flags,words", [
    (("--quantize", "int4", "--group-size", "128"), "--group-size 128 does not divide"),
    (("--group-size", "64"), "--group-size goes with --quantize int4"),
])
def test_generate_refuses_in_one_line(text_ckpt, capsys, flags, words):
    assert generate_cli.main(["--ckpt", text_ckpt, "--prompt", "x", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and words in err, err


@pytest.mark.parametrize("script", ["bench", "probe", "verify", "tune"])
def test_the_other_scripts_refuse_in_one_line(text_ckpt, tmp_path, capsys, script):
    """The same refusal from every script that loads a model, before any weight is read."""
    import importlib
    where = {"bench": "measure.bench", "probe": "measure.probe", "verify": "runs.proofs",
             "tune": "measure.tune"}
    main = importlib.import_module(where[script]).main
    flags = {"bench": ["--contexts", "64", "--modes", "none"], "probe": ["--contexts", "64"],
             "verify": [], "tune": ["--context", "64"]}[script]
    rc = main(["--ckpt", text_ckpt, "--quantize", "int4", "--group-size", "128", "--offload-dir",
               str(tmp_path), *flags])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and "--group-size 128 does not divide" in err, err


def test_generate_refuses_int4_kv_for_an_odd_head_dim(tmp_path, capsys):
    """Before any weight is loaded: head_dim 60 / 4 = 15 cannot pack two values a byte.
    (transformers builds no such model: the weights the config is checked against are written by
    hand.)"""
    hf_config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 60, "num_hidden_layers": 1,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
                 "vocab_size": 64, "max_position_embeddings": 256}
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    shapes = {"model.embed_tokens.weight": (64, 60), "model.norm.weight": (60,),
              "lm_head.weight": (64, 60)}
    layer = {"input_layernorm": (60,), "post_attention_layernorm": (60,),
             "self_attn.q_proj": (60, 60), "self_attn.k_proj": (30, 60),
             "self_attn.v_proj": (30, 60), "self_attn.o_proj": (60, 60), "mlp.gate_proj": (64, 60),
             "mlp.up_proj": (64, 60), "mlp.down_proj": (60, 64)}
    for name, shape in layer.items():
        shapes[f"model.layers.0.{name}.weight"] = shape
    save_file({n: torch.zeros(s) for n, s in shapes.items()}, str(tmp_path / "model.safetensors"))
    assert generate_cli.main(["--ckpt", str(tmp_path), "--prompt", "x", "--kv-dtype", "int4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "head_dim 15 is odd" in err, err


def test_generate_says_once_which_layers_no_kernel_takes(checkpoint, tmp_path, capsys):
    """A vocabulary of 420 (not a multiple of 16): the output matrix dequantizes in every matmul,
    said once on stderr."""
    ckpt = shutil.copytree(checkpoint(vocab_size=420), tmp_path / "m")
    add_sentencepiece(str(ckpt), vocab_size=400)
    argv = ["--ckpt", str(ckpt), "--prompt", "The for statement. " * 4, "--quantize", "int4",
            "--chunk-size", "8", "--max-new-tokens", "3"]
    assert generate_cli.main(argv) == 0
    err = capsys.readouterr().err
    assert err.count("--quantize int4: 1 linear layer(s) (output, ...)") == 1, err


def test_verify_passes_with_int4_weights_and_kv(text_ckpt, tmp_path, capsys):
    from runs import proofs
    for argv in (["--kv-dtype", "int4"], ["--quantize", "int4"]):
        rc = proofs.main(["--ckpt", text_ckpt, *argv, "--max-new-tokens", "8", "--chunk-size",
                          "16", "--window", "1", "--max-prompt-tokens", "150", "--offload-dir",
                          str(tmp_path), "--json"])
        r = json.loads(capsys.readouterr().out)
        assert rc == 0 and r["ok"], (argv, r)
        assert all(m["bit_identical"] for m in r["modes"].values())
        assert r["modes"]["cpu"]["chunks"]["host"] > 0


def test_probe_counts_int4_chunks(llama):
    from measure import probe
    assert probe.decode_step_s(llama, 20, 8, steps=1, kv_dtype="int4") > 0
    z = probe.zstd_on_real_kv(llama, 8, kv_dtype="int4")
    model_args = llama.args
    assert z["chunk_bytes"] == model_args.n_kv_heads * 8 * row_bytes(8, model_args.head_dim)
    args = Namespace(dtype="fp32", kv_dtype="int4")
    assert probe.chunk_bytes(model_args, args, 8) == z["chunk_bytes"]


def test_tuner_falls_back_to_smaller_kv_when_nothing_fits():
    """A device budget under one layer's open chunks at every chunk size: nothing fits with fp32 KV,
    nor int8; int4 does, and the tuner says why."""
    from test_tune import TINY, plan_args
    # window 0 holds 2 layers x 1 open chunk of 128 positions, in 4 KiB pages: fp32 2 x 32 KiB,
    # int8 2 x 12 KiB, int4 2 x 8 KiB (6 KiB of data)
    args = plan_args(chunk_sizes=[128], device_budget=20 / 2**20, offload_dir="/tmp")
    assert all(c.pruned for c in tune.candidates(TINY, args, False))
    cands = tune.fitting_candidates(TINY, args, False, free_disk=2**40)
    live = [c for c in cands if not c.pruned]
    assert args.kv_dtype == "int4" and live and all(c.window == 0 for c in live)
    assert args.kv_dtype_why.startswith("no configuration with --kv-dtype auto fits the budgets")


# -----------------------------------------------------------------------------
# CUDA: written, not run on the build machine (no GPU); scripts/gpu_check.sh runs these

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize("M", [1, 7, 300])
def test_cuda_int4_kernel_agrees_with_the_reference(M):
    """aten._weight_int4pack_mm on the tinygemm packing against x @ W^T in fp64, W from the same
    integers (quantized on the device, then read back)."""
    gen = torch.Generator().manual_seed(M)
    w = (torch.randn(256, 512, generator=gen) * 512 ** -0.5).cuda()
    layer = Int4Linear(512, 256, group_size=32)
    layer.load_weight(w)
    assert layer.packing == "cuda", quantize.int4_kernel_status("cuda")
    q, sz = quantize_weight_int4(w, 32)
    x = torch.randn(M, 512, generator=gen).bfloat16().cuda()
    expected = x.double().cpu() @ reference_dequantize(q.cpu(), sz.cpu(), 32).T
    y = layer(x)
    assert y.dtype == torch.bfloat16 and y.device.type == "cuda"
    tol = 2 ** -7 * expected.abs().max().item() * 2
    assert (y.double().cpu() - expected).abs().max().item() < tol


@needs_cuda
def test_cuda_int4_weights_and_kv_offloaded_bit_identical(tmp_path):
    """The demo model on CUDA with int4 weights and int4 KV: every tier gives the tokens and
    logits of --offload none."""
    model = Transformer.from_pretrained(DEMO, device="cuda", dtype=torch.bfloat16,
                                        quantize="int4-g32")
    ids = prompt(300, model.args.vocab_size, seed=9)
    base = run(model, ids, 20, 16)
    for mode, compress in MODES:
        other = run(model, ids, 20, 16, mode, compress, 0, tmp_path)
        assert_identical(base, other, f"cuda int4 {mode}+{compress}")
