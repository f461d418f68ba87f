"""
Weight-only int8 (quantize.py): the matmul against a dequantized fp32 reference, the loader against
the unquantized model, quality on the demo model against its fp32 self, and bit-identity across
offload modes.
"""
import gc
import os
import sys
import weakref

import pytest
import torch
import torch.nn as nn

import model as model_module
from model import Transformer
from offload import OffloadConfig
from quantize import (
    _KERNEL,
    KERNEL_MAX_ROWS,
    Int8Linear,
    dequantize,
    int8_matmul,
    quantize_weight,
    weight_bytes,
)
from runs.task import run_task

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
DEMO = os.path.join(ROOT, "assets", "tinyllama-pydoc")
sys.path.insert(0, os.path.join(ROOT, "tools"))
needs_kernel = pytest.mark.skipif(_KERNEL is None,
                                  reason="this torch has no aten._weight_int8pack_mm")
PROMPT = "The import statement combines two operations; it searches for the named module"


# -----------------------------------------------------------------------------
# the layer

def test_quantize_weight_error_is_half_a_step():
    g = torch.Generator().manual_seed(0)
    # rows of different magnitudes
    w = torch.randn(48, 80, generator=g) * torch.rand(48, 1, generator=g)
    w[3] = 0.0  # an all-zero row must not divide by 0
    q, s = quantize_weight(w)
    assert q.dtype == torch.int8 and s.dtype == torch.bfloat16 and q.abs().max() <= 127
    step = s.float()[:, None]
    # round to nearest, scale absorbed
    assert ((dequantize(q, s) - w).abs() <= step / 2 + 1e-7).all()
    assert (q.abs().amax(1)[torch.arange(48) != 3] >= 126).all()  # the range is used
    assert torch.equal(dequantize(q, s)[3], torch.zeros(80))


@pytest.mark.parametrize("K,N,bias",
                         [(64, 96, False), (64, 96, True), (40, 24, True), (576, 192, False)])
@pytest.mark.parametrize("M", [1, 3, KERNEL_MAX_ROWS + 5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_linear_matches_dequantized_reference(K, N, bias, M, dtype):
    """Against fp32 x @ dequantized W^T + b: within bf16 rounding of the output (both paths round
    activations or outputs to bf16 at most once or twice). K=40 is not a multiple of 16: the kernel
    must not be used there."""
    g = torch.Generator().manual_seed(K + N + M)
    lin = nn.Linear(K, N, bias=bias)
    with torch.no_grad():
        lin.weight.normal_(generator=g).mul_(K ** -0.5)
        if bias:
            lin.bias.normal_(generator=g)
    layer = Int8Linear(K, N, bias, dtype=dtype)
    layer.load_weight(lin.weight)
    if bias:
        layer.bias = nn.Parameter(lin.bias.detach().to(dtype), requires_grad=False)
    x = torch.randn(2, M, K, generator=g)  # [B, T, K]: the layer sees 3-D input
    b = lin.bias.detach() if bias else 0
    ref = x @ dequantize(layer.weight, layer.scales).T + b  # [B, T, N] fp32
    with torch.no_grad():
        y = layer(x.to(dtype))
    assert y.dtype == dtype and y.shape == (2, M, N)
    tol = 2 ** -7 * ref.abs().max().item() * 2  # ~2 bf16 ulps of the largest output
    assert (y.float() - ref).abs().max().item() < tol


@needs_kernel
@pytest.mark.parametrize("M", [1, 7, 40])
def test_kernel_and_fallback_agree(M):
    g = torch.Generator().manual_seed(M)
    q, s = quantize_weight(torch.randn(200, 128, generator=g))
    x = torch.randn(M, 128, generator=g).bfloat16()
    a = int8_matmul(x, q, s, kernel=True)
    b = int8_matmul(x, q, s, kernel=False)
    assert not torch.equal(q.float(), torch.zeros_like(q.float()))
    assert (a.float() - b.float()).abs().max().item() <= 2 ** -7 * b.float().abs().max().item()


@needs_kernel
def test_kernel_runs_for_decode_rows_only(monkeypatch):
    """The choice of path, which the speed depends on: the kernel for up to KERNEL_MAX_ROWS rows
    with K a multiple of 16, cast-and-matmul for a prefill chunk and for other K."""
    import quantize
    calls = []

    def counted(*args):
        calls.append(args[0].shape)
        return _KERNEL(*args)
    monkeypatch.setattr(quantize, "_KERNEL", counted)
    q, s = quantize_weight(torch.randn(32, 64))
    for M, K in ((1, 64), (KERNEL_MAX_ROWS, 64), (KERNEL_MAX_ROWS + 1, 64), (512, 64), (1, 40)):
        weight = q if K == 64 else quantize_weight(torch.randn(32, K))[0]
        int8_matmul(torch.randn(1, M, K).bfloat16(), weight, s)
    assert calls == [(1, 64), (KERNEL_MAX_ROWS, 64)]


# -----------------------------------------------------------------------------
# the loader

@pytest.fixture(scope="module")
def demo_fp32():
    return Transformer.from_pretrained(DEMO, dtype=torch.float32)


@pytest.fixture(scope="module")
def demo_int8():
    return Transformer.from_pretrained(DEMO, dtype=torch.bfloat16, quantize="int8")


def test_every_block_linear_quantized_embedding_not(demo_int8):
    m = demo_int8
    assert m.quantize == "int8"
    linears = [mod for mod in m.layers.modules() if isinstance(mod, (nn.Linear, Int8Linear))]
    assert len(linears) == 7 * m.args.n_layers
    assert all(isinstance(mod, Int8Linear) for mod in linears)
    assert all(mod.weight.dtype == torch.int8 and mod.weight.device.type == "cpu"
               for mod in linears)
    assert isinstance(m.output, Int8Linear)
    assert type(m.tok_embeddings) is nn.Embedding
    assert m.tok_embeddings.weight.dtype == torch.bfloat16
    assert not any(t.is_meta for t in m.state_dict().values())


def test_weight_bytes_about_a_quarter_of_fp32(demo_fp32, demo_int8):
    """Counted from the parameter shapes, independently of state_dict: int8 linears at 1 byte plus a
    bf16 scale per output row, everything else (embedding, norms) at 2 bytes in bf16."""
    expected = 0
    for name, p in demo_fp32.named_parameters():
        if name.startswith(("layers.", "output.")) and p.dim() == 2:
            expected += p.numel() + 2 * p.shape[0]
        else:
            expected += 2 * p.numel()
    fp32 = weight_bytes(demo_fp32)
    assert fp32 == 4 * sum(p.numel() for p in demo_fp32.parameters())
    assert weight_bytes(demo_int8) == expected
    # the bf16 embedding is 1/5 of this model's parameters
    assert 0.25 <= weight_bytes(demo_int8) / fp32 < 0.32


KINDS = {"llama": {}, "tied": {"tie_word_embeddings": True}, "qwen2-bias": {"arch": "qwen2"}}


@pytest.mark.parametrize("kind", list(KINDS))
def test_int8_model_is_the_fp32_model_with_dequantized_weights(checkpoint, monkeypatch, kind):
    """Every weight lands in the right Int8Linear (biases, tied output included): with the exact
    cast-and-matmul path forced, the int8 model's logits are those of the fp32 model whose linears
    hold dequantize(q, s)."""
    import quantize
    ckpt = checkpoint(**KINDS[kind])
    monkeypatch.setattr(quantize, "KERNEL_MAX_ROWS", 0)
    m8 = Transformer.from_pretrained(ckpt, quantize="int8")
    ref = Transformer.from_pretrained(ckpt)
    if kind == "tied":
        # parameters() counts a tie once
        assert weight_bytes(ref) == 4 * sum(p.numel() for p in ref.parameters())
        # untie: the output gets its own
        ref.output = nn.Linear(ref.args.dim, ref.args.vocab_size, bias=False)
    n = 0
    for name, mod in m8.named_modules():
        if isinstance(mod, Int8Linear):
            target = ref.get_submodule(name)
            with torch.no_grad():
                target.weight.copy_(dequantize(mod.weight, mod.scales))
            n += 1
            assert (mod.bias is None) == (target.bias is None)
            assert mod.bias is None or torch.equal(mod.bias, target.bias)
    assert n == 7 * ref.args.n_layers + 1
    x = torch.randint(0, ref.args.vocab_size, (1, 12))
    with torch.no_grad():
        got = m8(x)
        want = ref(x)
        full = Transformer.from_pretrained(ckpt)(x)
    assert (got - want).abs().max().item() < 1e-4
    # quantization did change the weights: the check above can fail
    assert (full - want).abs().max().item() > 1e-3


def test_model_to_another_dtype_keeps_int8(llama_ckpt):
    # casts floats, scales too
    m = Transformer.from_pretrained(llama_ckpt, quantize="int8").to(torch.float16)
    assert m.layers[0].feed_forward.w1.weight.dtype == torch.int8
    x = torch.randint(0, m.args.vocab_size, (1, 3))
    with torch.no_grad():
        assert torch.isfinite(m(x)).all()


def test_unknown_quantize_is_refused(llama_ckpt):
    with pytest.raises(ValueError, match="quantize='int4'.*use None"):
        Transformer.from_pretrained(llama_ckpt, quantize="int4")


def watch_full_precision_weights(monkeypatch):
    """Make from_pretrained fail if a full-precision linear weight read from the file is still
    referenced two reads later (one read later the loader's loop variable still holds it): the
    quantized loader must hold at most the tensor in hand, never the model."""
    real = model_module.iter_checkpoint
    alive = []  # (name, weak reference) of the linear weight read two reads ago

    def watched(ckpt_dir):
        last = None
        for name, tensor, path in real(ckpt_dir):
            gc.collect()
            assert not [n for n, ref in alive if ref() is not None], (
                "a full-precision linear weight is still held")
            alive.clear()
            if last is not None:
                alive.append(last)
            if name.endswith("proj.weight") or name == "lm_head.weight":
                last = (name, weakref.ref(tensor))
            else:
                last = None
            yield name, tensor, path
            del tensor
    monkeypatch.setattr(model_module, "iter_checkpoint", watched)
    return alive


def test_loader_quantizes_tensor_by_tensor(monkeypatch):
    alive = watch_full_precision_weights(monkeypatch)
    m = Transformer.from_pretrained(DEMO, dtype=torch.float32, quantize="int8")
    gc.collect()
    assert isinstance(m.layers[0].attention.wq, Int8Linear)
    assert not [n for n, ref in alive if ref() is not None]


def test_loader_watch_can_fail(monkeypatch):
    """The same watch catches a loader that keeps the full-precision weights beside the int8
    ones."""
    real = Int8Linear.load_weight

    def hoarding(self, w):
        self.kept = w  # the bug to catch: a full-precision copy that outlives quantization
        real(self, w)
    monkeypatch.setattr(Int8Linear, "load_weight", hoarding)
    watch_full_precision_weights(monkeypatch)
    with pytest.raises(AssertionError, match="still held"):
        Transformer.from_pretrained(DEMO, dtype=torch.bfloat16, quantize="int8")


# -----------------------------------------------------------------------------
# quality and offload

def test_greedy_continuation_agrees_with_fp32(demo_fp32, demo_int8):
    """The int8 model's greedy continuation of real text is the fp32 model's top-1 at >= 90% of its
    tokens."""
    from quality import greedy_agreement, pydoc_pages
    from tokenizer import Tokenizer
    prompts = [p[:64] for p in pydoc_pages(Tokenizer(DEMO), 4, 256)]
    agreement, n = greedy_agreement(demo_int8, demo_fp32, prompts, 32)
    assert n >= 64 and agreement >= 0.9


@pytest.mark.parametrize("mode", ["cpu", "disk"])
def test_offload_bit_identical_with_int8_weights(demo_int8, tmp_path, mode):
    from tokenizer import Tokenizer
    ids = Tokenizer(DEMO).encode(PROMPT)
    runs = {}
    for m in ("none", mode):
        logits = []

        def on_step(phase, step_logits, cache):
            logits.append(step_logits.clone())
        cfg = OffloadConfig(mode=m, window=1, offload_dir=str(tmp_path))
        new, st = run_task(demo_int8, ids, 24, chunk_size=8, cfg=cfg, on_step=on_step)
        runs[m] = (new, torch.stack(logits), st)
    assert runs["none"][0] == runs[mode][0]
    assert torch.equal(runs["none"][1], runs[mode][1])
    tier = "host" if mode == "cpu" else "disk"
    assert runs[mode][2]["chunks"][tier] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_int8_offloaded_bit_identical_and_agrees_with_fp32(demo_fp32, tmp_path):
    """On CUDA (the cast-and-matmul path): the cpu tier is bit-identical to none, and the greedy
    continuation is the CPU fp32 model's top-1 at >= 90% of its tokens."""
    from quality import greedy_agreement, pydoc_pages
    from tokenizer import Tokenizer
    ids = Tokenizer(DEMO).encode(PROMPT)
    m = Transformer.from_pretrained(DEMO, device="cuda", dtype=torch.bfloat16, quantize="int8")
    assert m.layers[0].attention.wq.weight.device.type == "cuda"
    runs = {}
    for mode in ("none", "cpu"):
        cfg = OffloadConfig(mode=mode, window=1, offload_dir=str(tmp_path))
        runs[mode], _ = run_task(m, ids, 24, chunk_size=8, cfg=cfg)
    assert runs["none"] == runs["cpu"]
    prompts = [p[:64] for p in pydoc_pages(Tokenizer(DEMO), 4, 256)]
    agreement, n = greedy_agreement(m, demo_fp32, prompts, 32)
    assert n >= 64 and agreement >= 0.9
