"""
How K and V sit in a chunk's bytes: a layout. The store (offload.py) moves a chunk as one buffer of
some shape and dtype whatever is inside it, and attention (kvcache.py) asks the layout for K and V
[B, G, C, D] in the compute dtype. PlainLayout keeps them as computed; Int8Layout (--kv-dtype int8)
quantizes them as they are written into the open chunk and dequantizes each chunk right before it
is attended, so the int8 bytes, not the compute dtype's, cross every link. A layout's read is a
function of the stored bytes only, so every tier stays bit-identical to --offload none.
"""
import math

import torch

# auto: K and V kept in the compute dtype; int8: quantized per token and kv head
KV_DTYPES = ("auto", "int8")


class PlainLayout:
    """K and V as computed: a chunk [2, B, G, C, D] in the compute dtype. write and read are views,
    nothing else."""

    def __init__(self, dtype):
        self.dtype = dtype

    def shape(self, B, G, C, D):
        return (2, B, G, C, D)

    def write(self, chunk, off, k, v):
        """k, v [B, G, T, D] into positions off..off+T-1 of the chunk."""
        T = k.shape[2]
        chunk[0, :, :, off:off + T] = k
        chunk[1, :, :, off:off + T] = v

    def read(self, chunk, upto):
        """(k, v) [B, G, upto, D] of the first `upto` positions of a chunk [2, B, G, C, D]."""
        if upto == chunk.shape[3]:
            # a sealed chunk: two views made in one call (a visit is the hot loop)
            return chunk.unbind(0)
        return chunk[0, :, :, :upto], chunk[1, :, :, :upto]


class Int8Layout:
    """K and V quantized symmetrically, one scale per token and kv head: a uint8 chunk
    [2, B, G, C, D + 4] whose rows are D int8 values then their fp32 scale (amax|x| / 127) as 4
    bytes. The scales live inside the chunk so that it stays one contiguous buffer that every tier
    moves as a unit; K and V cross every link at about half the bytes of bf16 (D=128: 132 bytes a
    row instead of 256). fp32 scales rather than bf16 ones: exact, so that the error stays within
    scale/2, for 2 more bytes a row; with D a multiple of 4 (every real head_dim), a row stride of
    D + 4 keeps the scales 4-byte aligned, readable as an fp32 view without a copy.
    Dequantized to the compute dtype chunk by chunk, right before attention: a function of the
    stored bytes only, so every tier stays bit-identical to --offload none with the same
    --kv-dtype."""

    S = 4  # bytes of a row's scale

    def __init__(self, compute_dtype):
        self.dtype = torch.uint8              # what the store holds
        self.compute_dtype = compute_dtype    # what attention gets

    def shape(self, B, G, C, D):
        return (2, B, G, C, D + self.S)

    def write(self, chunk, off, k, v):
        """Quantize k, v [B, G, T, D] into positions off..off+T-1 of the uint8 chunk."""
        T, D = k.shape[2], k.shape[3]
        x = torch.stack((k, v)).float()                               # [2, B, G, T, D]
        tiny = torch.finfo(torch.float32).tiny
        scale = (x.abs().amax(dim=-1, keepdim=True) / 127).clamp_min_(tiny)  # [2, B, G, T, 1]
        q = torch.round(x / scale).clamp_(-127, 127).to(torch.int8)   # [2, B, G, T, D]
        rows = chunk[:, :, :, off:off + T]                            # [2, B, G, T, D + 4] uint8
        rows[..., :D] = q.view(torch.uint8)
        rows[..., D:] = scale.view(torch.uint8)                       # [2, B, G, T, 4]: fp32 bytes

    def read(self, chunk, upto):
        """(k, v) [B, G, upto, D] in the compute dtype, dequantized from the first `upto` positions
        of a uint8 chunk [2, B, G, C, D + 4]: K and V in one multiply."""
        kv = chunk[:, :, :, :upto]                                    # [2, B, G, upto, D + 4]
        D = kv.shape[-1] - self.S
        scale = kv[..., D:]                                           # [2, B, G, upto, 4] uint8
        aligned = D % 4 == 0 and scale.storage_offset() % 4 == 0
        scale = (scale if aligned else scale.contiguous()).view(torch.float32)  # [2, B, G, upto, 1]
        # int8 * fp32: one kernel; [2, B, G, upto, D]
        x = torch.mul(kv[..., :D].view(torch.int8), scale).to(self.compute_dtype)
        return x[0], x[1]


def chunk_layout(kv_dtype, dtype):
    """The layout for --kv-dtype (auto: the compute dtype `dtype`)."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"--kv-dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
    return Int8Layout(dtype) if kv_dtype == "int8" else PlainLayout(dtype)


def kv_bytes_per_token(model_args, dtype, kv_dtype="auto"):
    """Bytes of K and V per position, all layers, as the chunks hold them (int8: with the scales);
    dtype is the compute dtype. What crosses a link per offloaded position."""
    layout = chunk_layout(kv_dtype, dtype)
    row = math.prod(layout.shape(1, model_args.n_kv_heads, 1, model_args.head_dim))
    return model_args.n_layers * row * torch.empty((), dtype=layout.dtype).element_size()


# partials stacked per group merge: all of a decode step's, a few of a prefill chunk's
