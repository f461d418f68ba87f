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
  the reference the kernel is tested against. On a CPU without oneDNN's half-precision kernel
  (AVX2), a prefill chunk's rows do it in fp32 and round once (rowwise.wide: 3x faster there).
  On CUDA this saves memory, not time: torch's CUDA _weight_int8pack_mm is, in its source, a
  one-thread-per-output fp32 loop (unmeasured here); a fused kernel would need torch.compile, not
  used here.

Weight-only int4 (quantize="int4-g32", -g64 or -g128: --quantize int4 --group-size N): every group
of N consecutive input features of an output row keeps 16 levels between its own minimum and
maximum (asymmetric, as gpt-fast and torch's tinygemm kernels store it: w = (q - 8) * scale + zero,
q in 0..15, scale and zero bf16 per group). Asymmetric rather than symmetric because a group of 32
to 128 weights is rarely centred on zero, and an offset costs nothing in the kernel; measured on the
demo model (docs/quantization.md) it keeps 2.4 points more top-1 agreement than symmetric scales
(max|w| / 7) with groups of 32. Half a byte a weight plus 4 bytes per group (g32: 0.625 bytes a
weight, about a sixth of fp32).
- CPU, a few rows: aten._weight_int4pack_mm_for_cpu, on weights packed once, while loading, by
  aten._convert_weight_to_int4pack_for_cpu (N a multiple of 16). Its packing is the only copy kept;
  the rows it interleaves are undone by unpack_cpu_kernel, checked on every tensor as it is packed.
- CPU, many rows (prefill): unpack, dequantize to the activation dtype (to fp32 where
  rowwise.wide says so), matmul.
- CUDA: aten._weight_int4pack_mm (tinygemm) for every row count, on weights packed by
  aten._convert_weight_to_int4pack (N a multiple of 8, K of 128). Written, not run here: the build
  machine has no GPU.
- Shapes no kernel takes keep a plain packing (two weights a byte) and the dequantize path; the
  command line says so once (int4_fallbacks). A group size that does not divide a layer's input
  features is refused before any weight is read (check_int4_shapes).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from rowwise import concatenate, wide

# what Transformer.from_pretrained(quantize=...) accepts; int4-gN: N input features per group
QUANTIZE = (None, "int8", "int4-g32", "int4-g64", "int4-g128")
INT4_GROUP_SIZES = (32, 64, 128)
INT4_DEFAULT_GROUP_SIZE = 32  # the best top-1 agreement measured (docs/quantization.md)


def _aten(name):
    """An aten kernel through its torch._ binding where torch has one: the same operator, with a
    faster argument parser than torch.ops.aten's overload resolution (5.6 against 8.9 us a small
    int8 call here); else through torch.ops.aten; None where this torch lacks it."""
    return getattr(torch, name, None) or getattr(torch.ops.aten, name, None)


# Shapes are [M, K] activations, [N, K] int8 weight, [N] scales (M rows, K input features, N output
# features).
_KERNEL = _aten("_weight_int8pack_mm")
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


def as_bf16(t):
    """t in bf16: itself where it is (a decode step's activations and scales; a cast that does
    nothing is still a call, and a step makes hundreds)."""
    return t if t.dtype == torch.bfloat16 else t.to(torch.bfloat16)


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
        y = _KERNEL(as_bf16(x2).contiguous(), q, as_bf16(scales))      # [M, N]
        y = y if y.dtype == x.dtype else y.to(x.dtype)
    else:
        # [M, N]; the cast is exact, the scale is per column; in fp32 where the CPU has no
        # half-precision GEMM (rowwise.wide), rounded once
        dtype = torch.float32 if wide(x2) else x.dtype
        y = (F.linear(x2.to(dtype), q.to(dtype)) * scales.to(dtype)).to(x.dtype)
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

    @classmethod
    def joined(cls, layers):
        """One Int8Linear [sum N, K] of layers (rowwise.Joint): the kernel's sums run along K,
        output by output, so each output keeps the bits of its own layer's product."""
        joint = cls(layers[0].in_features, sum(l.out_features for l in layers),
                    bias=layers[0].bias is not None, device="meta")
        return concatenate(layers, joint, ("weight", "scales", "bias"))

    def forward(self, x):
        y = int8_matmul(x, self.weight, self.scales)
        return y if self.bias is None else y + self.bias

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, int8")


# -----------------------------------------------------------------------------
# int4: groupwise, asymmetric, packed two weights a byte

# Shapes as above: [M, K] activations, [N, K] weight, groups of g input features; scales_and_zeros
# [K/g, N, 2] bf16 (tinygemm's layout: scale, then zero, per group and output row).
_INT4_CPU_PACK = _aten("_convert_weight_to_int4pack_for_cpu")
_INT4_CPU_MM = _aten("_weight_int4pack_mm_for_cpu")
_INT4_CUDA_PACK = _aten("_convert_weight_to_int4pack")
_INT4_CUDA_MM = _aten("_weight_int4pack_mm")
INT4_CPU_N_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu refuses other N
INT4_CUDA_INNER_K_TILES = 8  # gpt-fast's choice: K a multiple of 8 * 16, N of 8
# Rows up to which the CPU kernel beats dequantize-and-matmul: its cost grows linearly in M, the
# dequantize is paid once per call. Measured here (1 thread, 1536x576 and 576x1536, g32): M=1
# kernel 0.05 ms vs 2.0, M=16 0.3 vs 2.0-2.4, M=64 1.2 vs 2.1-3.4, M=512 9.8 vs 2.6-2.8 ms.
INT4_KERNEL_MAX_ROWS = 64


def int4_kernel_status(device="cpu"):
    """One sentence for logs and --help: which int4 matmul runs on `device` with this torch."""
    if torch.device(device).type == "cuda":
        if _INT4_CUDA_MM is None:
            return ("--quantize int4 on CUDA: this torch has no aten._weight_int4pack_mm, so "
                    "every matmul dequantizes first (a sixth of the fp32 weight memory, slow)")
        return ("--quantize int4 on CUDA: aten._weight_int4pack_mm for every matmul (untested "
                "in this project's CI, which has no GPU)")
    if _INT4_CPU_MM is None:
        return (f"torch {torch.__version__} has no aten._weight_int4pack_mm_for_cpu: --quantize "
                "int4 dequantizes in every matmul (a sixth of the fp32 weight memory, slow)")
    return ("--quantize int4 on CPU: aten._weight_int4pack_mm_for_cpu for decode steps, "
            "dequantize-and-matmul for prefill chunks")


def quantize_weight_int4(w, group_size, symmetric=False):
    """w [N, K] float -> (q uint8 [N, K] in 0..15, scales_and_zeros bf16 [K/g, N, 2]) with
    w ~ (q - 8) * scale + zero per group of g input features. Asymmetric: the group's minimum and
    maximum span the 16 levels. symmetric=True (for measurements): zero 0, scale max|w| / 7, 15
    levels. Scale and zero are rounded to bf16 first and q computed against the rounded values, so
    their storage adds no error beyond the 4-bit rounding (and a clamp at the group's edges)."""
    N, K = w.shape
    w = w.float().reshape(N, K // group_size, group_size)           # [N, K/g, g]
    if symmetric:
        scale = w.abs().amax(-1) / 7                                  # [N, K/g]
        zero = torch.zeros_like(scale)
    else:
        lo = w.amin(-1)                                               # [N, K/g]
        scale = (w.amax(-1) - lo) / 15
        zero = lo + 8 * scale  # the value of level 8
    # an all-constant group has scale 0: q 8, w = zero
    scale = scale.clamp(min=1e-12).to(torch.bfloat16).float()
    zero = zero.to(torch.bfloat16).float()
    q = torch.round((w - zero[..., None]) / scale[..., None] + 8).clamp_(0, 15).to(torch.uint8)
    scales_and_zeros = torch.stack((scale, zero), -1).transpose(0, 1)  # [K/g, N, 2]
    return q.view(N, K), scales_and_zeros.to(torch.bfloat16).contiguous()


def dequantize_int4(q, scales_and_zeros, dtype=torch.float32):
    """The float weight [N, K] that q [N, K] (0..15) and scales_and_zeros [K/g, N, 2] stand for,
    computed in fp32 and rounded once to dtype: q * scale + (zero - 8 * scale), one fused pass
    over the weight (the dequantize path runs once per prefill matmul)."""
    N, K = q.shape
    sz = scales_and_zeros.float().transpose(0, 1).contiguous()       # [N, K/g, 2]
    scale = sz[..., :1].contiguous()                                 # [N, K/g, 1]
    offset = sz[..., 1:] - 8 * scale                                 # [N, K/g, 1]
    w = torch.addcmul(offset, q.view(N, scale.shape[1], -1), scale)  # [N, K/g, g] fp32
    return w.view(N, K).to(dtype)


def pack_int4(q):
    """q [N, K] (0..15) -> uint8 [N, K/2]: input features 2i (high nibble) and 2i+1 (low), the
    order aten._convert_weight_to_int4pack takes."""
    return q[:, 0::2] << 4 | q[:, 1::2]


def unpack_int4(packed):
    """pack_int4 undone: uint8 [N, K/2] -> q [N, K]."""
    N = packed.shape[0]
    return torch.stack((packed >> 4, packed & 15), -1).view(N, -1)   # [N, K/2, 2] -> [N, K]


def _cpu_kernel_blocks():
    """(rows the CPU kernel packs together, whether a full block pairs row j with row j + BN/2):
    AVX512 (64, True), AVX2 (32, True), other x86 builds (32, False), as torch's int4mm_kernel.cpp
    packs them. Another CPU may differ: Int4Linear.load_weight checks every tensor."""
    return {"AVX512": (64, True), "AVX2": (32, True)}.get(
        torch.backends.cpu.get_cpu_capability(), (32, False))


def unpack_cpu_kernel(packed):
    """q [N, K] from aten._convert_weight_to_int4pack_for_cpu's packing [N, K/2]. Rows go in
    blocks of BN (_cpu_kernel_blocks), a block's bytes k by k: byte j of feature k holds row j (low
    nibble) and row j + BN/2 (high) in a full block on AVX512 and AVX2, rows 2j and 2j + 1 otherwise
    and in a last, partial block. A torch that packs in another order is caught by the check in
    Int4Linear.load_weight, which then keeps the plain packing."""
    N, half = packed.shape
    K = 2 * half
    flat = packed.reshape(-1)
    BN, halves = _cpu_kernel_blocks()
    full = N // BN * BN  # rows in full blocks
    parts = []
    if full:
        b = flat[:full * half].view(full // BN, K, BN // 2)          # [N/BN, K, BN/2]
        if halves:
            rows = torch.cat((b & 15, b >> 4), -1)                   # [N/BN, K, BN]
        else:
            rows = torch.stack((b & 15, b >> 4), -1).flatten(-2)     # [N/BN, K, BN]
        parts.append(rows.transpose(1, 2).reshape(full, K))          # [full, K]
    if full < N:
        b = flat[full * half:].view(K, (N - full) // 2)              # [K, (N - full)/2]
        rows = torch.stack((b & 15, b >> 4), -1).view(K, N - full)   # [K, N - full]
        parts.append(rows.T)                                         # [N - full, K]
    return torch.cat(parts)                                          # [N, K]


def int4_packing(device, N, K):
    """How Int4Linear holds an [N, K] weight on `device`: "cpu" or "cuda" (a kernel's packing) where
    the kernel exists and takes the shape, else "plain" (pack_int4)."""
    if device.type == "cpu" and _INT4_CPU_MM is not None and N % INT4_CPU_N_MULTIPLE == 0:
        return "cpu"
    tiles = INT4_CUDA_INNER_K_TILES
    if device.type == "cuda" and _INT4_CUDA_MM is not None and N % 8 == 0 and K % (tiles * 16) == 0:
        return "cuda"
    return "plain"


def int4_matmul(x, packed, scales_and_zeros, group_size, packing, kernel=None):
    """x [..., K] @ W^T -> [..., N] in x's dtype, W the int4 weight `packed` holds as `packing`
    says (int4_packing). kernel: None chooses (CPU: the kernel for up to INT4_KERNEL_MAX_ROWS
    rows; CUDA: always); True / False force it on CPU (tests compare the two)."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)                                            # [M, K]
    if kernel is None:
        kernel = packing == "cuda" or x2.shape[0] <= INT4_KERNEL_MAX_ROWS
    if packing == "cuda":
        # tinygemm takes bf16 activations, scales of the same dtype
        x_bf16 = x2.to(torch.bfloat16).contiguous()
        sz = scales_and_zeros.to(torch.bfloat16)
        y = _INT4_CUDA_MM(x_bf16, packed, group_size, sz).to(x.dtype)  # [M, N]
    elif packing == "cpu" and kernel:
        # bf16: the kernel's fp32 path is ~40x slower (measured here)
        y = _INT4_CPU_MM(as_bf16(x2).contiguous(), packed, group_size, as_bf16(scales_and_zeros))
        y = y if y.dtype == x.dtype else y.to(x.dtype)                # [M, N]
    else:
        q = unpack_cpu_kernel(packed) if packing == "cpu" else unpack_int4(packed)  # [N, K]
        dtype = torch.float32 if wide(x2) else x.dtype          # rowwise.wide
        y = F.linear(x2.to(dtype), dequantize_int4(q, scales_and_zeros, dtype)).to(x.dtype)
    return y.view(*x.shape[:-1], y.shape[-1])                       # [..., N]


class Int4Linear(nn.Module):
    """nn.Linear with an int4 weight: `weight` the packed bytes (uint8 [N, K/2], or the CUDA
    kernel's int32 tiles) and `scales_and_zeros` bf16 [K/g, N, 2], both buffers (so state_dict and
    weight_bytes see them); `packing` says which packing `weight` holds. The bias, if any, stays a
    parameter in the model dtype."""

    def __init__(self, in_features, out_features, bias=False, device=None, dtype=None,
                 group_size=INT4_DEFAULT_GROUP_SIZE):
        super().__init__()
        if in_features % group_size:
            raise ValueError(f"Int4Linear: group size {group_size} does not divide "
                             f"{in_features} input features")
        self.in_features = in_features
        self.out_features = out_features
        self.group_size = group_size
        self.packing = "plain"
        weight = torch.empty(out_features, in_features // 2, dtype=torch.uint8, device=device)
        self.register_buffer("weight", weight)
        sz = torch.empty(in_features // group_size, out_features, 2, dtype=torch.bfloat16,
                         device=device)
        self.register_buffer("scales_and_zeros", sz)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype),
                                     requires_grad=False)
        else:
            self.bias = None

    def load_weight(self, w):
        """Quantize a full-precision weight [N, K] into this layer and pack it for w's device; the
        caller drops w, so only one full-precision tensor is alive at a time while a model
        loads."""
        N = self.out_features
        K = self.in_features
        if tuple(w.shape) != (N, K):
            raise ValueError(f"Int4Linear.load_weight: weight of shape {tuple(w.shape)}, expected "
                             f"{(N, K)}")
        self.load_quantized(*quantize_weight_int4(w, self.group_size))

    def load_quantized(self, q, scales_and_zeros):
        """Hold q [N, K] (0..15, uint8) and scales_and_zeros [K/g, N, 2], packed for q's device."""
        N, K = q.shape
        self.scales_and_zeros = scales_and_zeros
        self.packing = int4_packing(q.device, N, K)
        if self.packing == "cpu":
            self.weight = _INT4_CPU_PACK(q.to(torch.int32), 1)       # [N, K/2] uint8
            if not torch.equal(unpack_cpu_kernel(self.weight), q):
                # this torch packs rows in another order: keep the plain packing and dequantize
                self.packing = "plain"
        elif self.packing == "cuda":
            # [N/8, K/(tiles*16), 32, tiles/2] int32
            self.weight = _INT4_CUDA_PACK(pack_int4(q), INT4_CUDA_INNER_K_TILES)
        if self.packing == "plain":
            self.weight = pack_int4(q)                                # [N, K/2] uint8

    @classmethod
    def joined(cls, layers):
        """One Int4Linear [sum N, K] of layers (rowwise.Joint), or None where their packings
        differ or do not stack: the packed rows go in blocks, so layers stack only in whole blocks,
        which is checked on the bytes. The scales [K/g, N, 2] are copied (the kernel takes them
        contiguous, which a view of the joint ones would not be)."""
        first = layers[0]
        unpack = {"cpu": unpack_cpu_kernel, "plain": unpack_int4}.get(first.packing)
        if unpack is None or {(l.group_size, l.packing) for l in layers} != {
                (first.group_size, first.packing)}:  # the CUDA kernel's tiles, mixed packings
            return None
        q = torch.cat([unpack(l.weight) for l in layers])                # [sum N, K]
        if not torch.equal(unpack(torch.cat([l.weight for l in layers])), q):
            return None
        joint = cls(first.in_features, sum(l.out_features for l in layers),
                    bias=first.bias is not None, device="meta", group_size=first.group_size)
        joint.packing = first.packing
        concatenate(layers, joint, ("scales_and_zeros",), dim=1, share=False)
        return concatenate(layers, joint, ("weight", "bias"))

    def forward(self, x):
        y = int4_matmul(x, self.weight, self.scales_and_zeros, self.group_size, self.packing)
        return y if self.bias is None else y + self.bias

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, int4 g{self.group_size} {self.packing}")


def int4_group_size(quantize):
    """"int4-g64" -> 64; None for anything else."""
    if quantize is None or not quantize.startswith("int4-g"):
        return None
    return int(quantize[len("int4-g"):])


def check_int4_shapes(model_args, group_size):
    """Refuse, before any weight is read, a group size that does not divide the input features of
    every linear layer int4 quantizes (the embedding's width, the attention output's, the
    feed-forward's hidden width)."""
    widths = {"the model width (hidden_size)": model_args.dim,
              "the attention output (heads x head_dim)": model_args.n_heads * model_args.head_dim,
              "the feed-forward width (intermediate_size)": model_args.hidden_dim}
    for what, K in widths.items():
        if K % group_size:
            fits = [str(g) for g in INT4_GROUP_SIZES if all(k % g == 0 for k in widths.values())]
            fix = "use --quantize int8"
            if fits:
                fix = f"use --group-size {' or '.join(fits)}"
            raise ValueError(f"--group-size {group_size} does not divide {what}, {K} input "
                             f"features; {fix}")


def int4_fallbacks(model):
    """One sentence naming the int4 layers that no kernel takes (they dequantize in every matmul,
    slower), or None."""
    plain = [name for name, m in model.named_modules()
             if isinstance(m, Int4Linear) and m.packing == "plain"]
    device = model.tok_embeddings.weight.device
    has_kernel = _INT4_CPU_MM if device.type == "cpu" else _INT4_CUDA_MM
    if not plain or has_kernel is None:
        return None
    return (f"--quantize int4: {len(plain)} linear layer(s) ({plain[0]}, ...) have a shape the "
            f"{device.type} kernel does not take and dequantize in every matmul (slower)")


# the quantized linears: each has load_weight(w), which the loader (model.py) calls
QUANTIZED_LINEARS = (Int8Linear, Int4Linear)


def quantize_linears(model, quantize="int8"):
    """Replace every nn.Linear of the blocks, and the output matrix, with an empty Int8Linear (or
    Int4Linear) on the same device (meta, while loading). The embedding stays full precision: a
    lookup reads one row per token, so quantizing it would save memory but no time. The output
    matrix is quantized because in decode it is the largest single matmul (V x E: for a 49K
    vocabulary as large as 5 layers); with tied embeddings it becomes a quantized copy of the
    embedding."""
    if quantize not in QUANTIZE:
        raise ValueError(f"quantize={quantize!r} is not one of {QUANTIZE}; use None (full "
                         "precision), 'int8' or 'int4-g<group size>'")
    if quantize is None:
        return model
    group_size = int4_group_size(quantize)
    if group_size:
        check_int4_shapes(model.args, group_size)
    for parent in [*model.layers.modules(), model]:
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and (parent is not model or name == "output"):
                w = child.weight
                shape = (child.in_features, child.out_features, child.bias is not None, w.device,
                         w.dtype)
                if group_size:
                    setattr(parent, name, Int4Linear(*shape, group_size=group_size))
                else:
                    setattr(parent, name, Int8Linear(*shape))
    return model


def weight_bytes(model):
    """Bytes of the model's weights as held in memory: every state_dict tensor once (a tied matrix
    is counted once), int8 weights at 1 byte and their scales at 2, int4 weights at half a byte
    and 4 bytes per group."""
    seen = set()
    total = 0
    for t in model.state_dict().values():
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total
