"""
Weight-only int8: every linear layer of the blocks (and the output matrix) keeps int8 weights and
one scale per output channel, about a quarter of the fp32 bytes. Activations, norms, the embedding
and the KV stay in the model's dtype. Symmetric, no zero point, no calibration data: the scale of
output channel n is max|W[n, :]| / 127.

    model = Transformer.from_pretrained(ckpt, dtype=torch.bfloat16, quantize="int8")

Quantization happens while loading, one tensor at a time (model.py calls quantize_linears on the
meta model, then Int8Linear.load_weight as each weight arrives), so the full-precision model never
exists in memory. Nothing new is written to disk: the checkpoint stays the Hugging Face safetensors
file.

The matmul, y = (x @ W_int8^T) * scales:
- CPU, a few rows (decode): aten._weight_int8pack_mm with bf16 activations, 2.5-3x faster than a
  bf16 matmul (measured here: a decode-step GEMV is memory-bound and reads half the bytes). fp32
  activations make the same kernel 10-20x slower (its fast path is bf16), so they are cast to bf16
  and back.
- CPU, many rows (prefill), CUDA, or no kernel: cast the int8 weight to the activation dtype and
  matmul, then scale the output. Exact in the cast (int8 values are exact in bf16/fp16), so it is
  the reference the kernel is tested against. On CUDA this saves memory, not time: torch's CUDA
  _weight_int8pack_mm is, in its source, a one-thread-per-output fp32 loop (unmeasured here); a
  fused kernel would need torch.compile, not used here.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

QUANTIZE = (None, "int8")  # what Transformer.from_pretrained(quantize=...) accepts

# Shapes are [M, K] activations, [N, K] int8 weight, [N] scales (M rows, K input features, N output
# features).
_KERNEL = getattr(torch.ops.aten, "_weight_int8pack_mm", None)
# The CPU kernel in torch 2.13 returns wrong values, NaN or a segfault unless K is a multiple of 16
# (tried here: K = 1, 2, 4, 8, 17, 24, 33, 40, 60, 65 fail; multiples of 16 from 16 to 4096 pass).
KERNEL_K_MULTIPLE = 16
# Rows up to which the kernel beats cast-and-matmul on CPU: it costs ~linearly in M (a GEMV per
# row), the bf16 matmul barely grows. Measured here (1 thread, 576x1536 and 1536x576): M=8 kernel
# 0.09 ms vs 0.17, M=16 0.18 vs 0.20, M=32 0.36 vs 0.26 ms.
KERNEL_MAX_ROWS = 16


def kernel_status(device="cpu"):
    """One sentence for logs and --help: which int8 matmul runs on `device` with this torch."""
    if torch.device(device).type != "cpu":
        return ("--quantize int8 on CUDA casts int8 weights to the compute dtype in each matmul: "
                "a quarter of the fp32 weight memory, no speed-up")
    if _KERNEL is None:
        return (f"torch {torch.__version__} has no aten._weight_int8pack_mm: --quantize int8 "
                "falls back to cast-and-matmul (a quarter of the fp32 weight memory, but slower "
                "than --dtype bf16; a newer torch has it)")
    return ("--quantize int8 on CPU: aten._weight_int8pack_mm for decode steps, cast-and-matmul "
            "for prefill chunks")


def quantize_weight(w):
    """w [N, K] float -> (int8 [N, K], bf16 scales [N]). The scale is rounded to bf16 first and the
    weight divided by the rounded scale, so the bf16 storage of the scale adds no error beyond the
    int8 rounding itself."""
    w = w.float()
    # [N]; an all-zero row gets 0 weights
    scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12).to(torch.bfloat16)
    # [N, K]; symmetric: no -128
    q = torch.round(w / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


def dequantize(q, scales, dtype=torch.float32):
    """The float weight [N, K] that int8 q [N, K] and scales [N] stand for."""
    return q.to(dtype) * scales.to(dtype)[:, None]


def int8_matmul(x, q, scales, kernel=None):
    """x [..., K] @ (q [N, K] * scales [N, 1])^T -> [..., N] in x's dtype. kernel: None chooses
    (CPU kernel for up to KERNEL_MAX_ROWS rows), True / False force it (tests compare the two)."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)                                        # [M, K]
    if kernel is None:
        kernel = x.device.type == "cpu" and x2.shape[0] <= KERNEL_MAX_ROWS
    if kernel and _KERNEL is not None and K % KERNEL_K_MULTIPLE == 0:
        # the kernel wants bf16 activations contiguous in K and scales of the activation dtype
        # (model.to(dtype) may have cast the scales)
        x_bf16 = x2.to(torch.bfloat16).contiguous()
        y = _KERNEL(x_bf16, q, scales.to(torch.bfloat16)).to(x.dtype)  # [M, N]
    else:
        # [M, N]; the cast is exact, the scale is per column
        y = F.linear(x2, q.to(x.dtype)) * scales.to(x.dtype)
    return y.view(*x.shape[:-1], q.shape[0])                    # [..., N]


class Int8Linear(nn.Module):
    """nn.Linear with an int8 weight [N, K] and bf16 scales [N] as buffers (so state_dict and
    weight_bytes see them); the bias, if any, stays a parameter in the model dtype."""

    def __init__(self, in_features, out_features, bias=False, device=None, dtype=None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        weight = torch.empty(out_features, in_features, dtype=torch.int8, device=device)
        self.register_buffer("weight", weight)
        scales = torch.empty(out_features, dtype=torch.bfloat16, device=device)
        self.register_buffer("scales", scales)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype),
                                     requires_grad=False)
        else:
            self.bias = None

    def load_weight(self, w):
        """Quantize a full-precision weight [N, K] into this layer; the caller drops w, so only one
        full-precision tensor is alive at a time while a model loads."""
        if tuple(w.shape) != (self.out_features, self.in_features):
            raise ValueError(f"Int8Linear.load_weight: weight of shape {tuple(w.shape)}, expected "
                             f"{(self.out_features, self.in_features)}")
        self.weight, self.scales = quantize_weight(w)

    def forward(self, x):
        y = int8_matmul(x, self.weight, self.scales)
        return y if self.bias is None else y + self.bias

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, int8")


def quantize_linears(model, quantize="int8"):
    """Replace every nn.Linear of the blocks, and the output matrix, with an empty Int8Linear on the
    same device (meta, while loading). The embedding stays full precision: a lookup reads one row
    per token, so int8 would save memory but no time. The output matrix is quantized because in
    decode it is the largest single matmul (V x E: for a 49K vocabulary as large as 5 layers); with
    tied embeddings it becomes an int8 copy of the embedding."""
    if quantize not in QUANTIZE:
        raise ValueError(f"quantize={quantize!r} is not one of {QUANTIZE}; use None (full "
                         "precision) or 'int8'")
    if quantize is None:
        return model
    for parent in [*model.layers.modules(), model]:
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and (parent is not model or name == "output"):
                w = child.weight
                setattr(parent, name, Int8Linear(child.in_features, child.out_features,
                                                 child.bias is not None, w.device, w.dtype))
    return model


def weight_bytes(model):
    """Bytes of the model's weights as held in memory: every state_dict tensor once (a tied matrix
    is counted once), int8 weights at 1 byte and their scales at 2."""
    seen = set()
    total = 0
    for t in model.state_dict().values():
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total
