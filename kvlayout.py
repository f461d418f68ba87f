"""
How K and V sit in a chunk's bytes: a layout. The store (offload.py) moves a chunk as one buffer of
some shape and dtype whatever is inside it, and attention (kvcache.py) asks the layout for K and V
[B, G, C, D] in the compute dtype. PlainLayout keeps them as computed; Int8Layout (--kv-dtype int8)
quantizes them as they are written into the open chunk and dequantizes each chunk right before it
is attended, so the int8 bytes, not the compute dtype's, cross every link; Int4Layout
(--kv-dtype int4) does the same at 4 bits, its keys quantized when the chunk fills. A layout's read
of a sealed chunk is a function of the stored bytes only, so every tier stays bit-identical to
--offload none.
"""
import math

import torch

# auto: K and V kept in the compute dtype; bf16, fp16: held in that half precision (under fp32
# weights: half the bytes, as llama.cpp's default f16 KV); int8: quantized per token and kv head;
# int4: keys per channel within a chunk, values per token
KV_DTYPES = ("auto", "bf16", "fp16", "int8", "int4")
HALF_KV = {"bf16": torch.bfloat16, "fp16": torch.float16}


class PlainLayout:
    """K and V as computed: a chunk [2, B, G, C, D] in the compute dtype. write and read are views,
    nothing else."""

    def __init__(self, dtype):
        self.dtype = dtype

    @property
    def attend_dtype(self):
        """The dtype a sealed group's K and V reach attention in (read_group)."""
        return self.dtype

    def shape(self, B, G, C, D):
        return (2, B, G, C, D)

    def write(self, chunk, off, k, v):
        """k, v [B, G, T, D] into positions off..off+T-1 of the chunk (narrow and copy_: the same
        bytes as indexing, in fewer calls; every layer of every step writes)."""
        part = chunk.narrow(3, off, k.shape[2])  # [2, B, G, T, D]
        part[0].copy_(k)
        part[1].copy_(v)

    def read(self, chunk, upto):
        """(k, v) [B, G, upto, D] of the first `upto` positions of a chunk [2, B, G, C, D]: two
        views made in two calls (a visit is the hot loop)."""
        return chunk.narrow(3, 0, upto).unbind(0)

    # (k, v) as held: views (the compiled kernel reads any float dtype); a layout whose read_held
    # is its read gives attention the open chunk's K and V in one read (KVCache.attend_open)
    read_held = read
    # the open chunk is all in its bytes: a copy of them is the chunk (a session saves it)
    open_in_bytes = True

    def read_group(self, chunks):
        """(k, v) [n, B, G, C, D] of n sealed chunks held as one tensor [n, 2, B, G, C, D]:
        views."""
        return chunks[:, 0], chunks[:, 1]


class HalfLayout(PlainLayout):
    """K and V held in a half precision (--kv-dtype bf16 or fp16) under wider weights: a chunk
    [2, B, G, C, D] in bf16 or fp16, each value rounded to nearest as it is written (a cast: an
    element's bits whatever the kernel). A sealed group is read as views of the half-precision
    bytes, which attention widens to fp32 exactly on the way into its kernel
    (attention.widened); the open chunk and a lone sealed chunk are read widened to the compute
    dtype. Half the bytes of fp32 KV cross every link and are read every decode step."""

    def __init__(self, dtype, compute_dtype):
        super().__init__(dtype)
        self.compute_dtype = compute_dtype    # what attention computes in

    def read(self, chunk, upto):
        """(k, v) [B, G, upto, D] in the compute dtype, exact."""
        return tuple(x.to(self.compute_dtype) for x in super().read(chunk, upto))


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
        self.attend_dtype = compute_dtype     # what a sealed group reaches attention in

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

    read_held = read  # the compute dtype: what a sealed group reaches attention in
    open_in_bytes = True

    def read_group(self, chunks):
        """(k, v) [n, B, G, C, D] of n sealed chunks [n, 2, B, G, C, D + 4]: the same
        elementwise arithmetic as read, in one multiply for the group."""
        D = chunks.shape[-1] - self.S
        scale = chunks[..., D:]                                       # [n, 2, B, G, C, 4] uint8
        if any(st % self.S for st in scale.stride()[:-1]) or scale.storage_offset() % self.S:
            scale = scale.contiguous()
        x = torch.mul(chunks[..., :D].view(torch.int8), scale.view(torch.float32))
        x = x.to(self.compute_dtype)                                  # [n, 2, B, G, C, D]
        return x[:, 0], x[:, 1]


class Int4Layout:
    """K and V at 4 bits, asymmetric (16 levels from a minimum to a maximum), as KIVI quantizes
    them: values per token (a scale and a minimum per position and kv head), keys per channel (a
    scale and a minimum per channel for each group of up to KEY_GROUP positions of the chunk),
    since a few key channels run far larger than the rest in every token and would flatten a
    per-token scale. Measured on the demo model (docs/quantization.md): per-channel keys keep more
    top-1 agreement than per-token ones, and groups of 64 positions more than whole chunks of 512.

    A channel's scale needs the keys of every position of its group, and the open chunk is written
    a few positions at a time. As KIVI keeps its newest keys in full precision (its residual), the
    layout keeps the open chunk's keys in the compute dtype beside it (`open_keys`, one [B, G, C, D]
    tensor per open chunk, on the device): attention reads those while the chunk is open, and the
    write that fills the chunk quantizes them into its bytes. The open chunk never leaves the
    device and a sealed chunk holds only its packed bytes, so every tier moves and reads the same
    bytes; a resumed run recomputes its open chunk with the first run's schedule (generate.py), so
    those keys are the same too.

    A chunk is one uint8 buffer [1, B, G, C, D + 4 + E], a row per position (one plane: keys and
    values share the row):
        keys, then values, two channels a byte (channel 2i in the low nibble)   D bytes
        the values' scale and minimum, fp16                                     4 bytes
        an E-byte share of the key scales and minimums, fp16 [groups, 2, D]     E bytes, 4 bytes
                                                                                or more
    fp16 as llama.cpp's q4_0 (a key or value past +-65504 is clipped). D=128, C=512: 0.273 of
    bf16's bytes; D=64: 0.281. Dequantized to the compute dtype chunk by chunk, right before
    attention."""

    KEY_GROUP = 64  # positions per key scale

    def __init__(self, compute_dtype):
        self.dtype = torch.uint8              # what the store holds
        self.compute_dtype = compute_dtype    # what attention gets
        self.attend_dtype = compute_dtype     # what a sealed group reaches attention in
        self.open_keys = {}                   # an open chunk's data_ptr -> its keys [B, G, C, D]

    def shape(self, B, G, C, D):
        if D % 2:
            raise ValueError(f"--kv-dtype int4 packs two channels a byte, and head_dim {D} is odd; "
                             "use --kv-dtype int8")
        return (1, B, G, C, self.row_bytes(C, D))

    @classmethod
    def row_bytes(cls, C, D):
        """D + 4 + E: E the key params' share of a row, 4 bytes x groups x D / C, rounded up to 4
        bytes."""
        groups = -(-C // cls.KEY_GROUP)
        return D + 4 + 4 * -(-groups * D // C)

    def sizes(self, chunk):
        """(C, D, E) of a chunk [1, B, G, C, D + 4 + E]: the row width grows with D, so one D
        gives it."""
        C = chunk.shape[3]
        W = chunk.shape[4]
        D = next(d for d in range(2, W, 2) if self.row_bytes(C, d) == W)
        return C, D, W - D - 4

    def write(self, chunk, off, k, v):
        """k, v [B, G, T, D] into positions off..off+T-1: the values quantized into the chunk now,
        the keys kept in the compute dtype until the chunk is full, then quantized per channel."""
        B, G, T, D = k.shape
        C = chunk.shape[3]
        rows = chunk[0, :, :, off:off + T]                             # [B, G, T, D + 4 + E]
        ptr = chunk.data_ptr()
        if off == 0:  # a new open chunk
            self.open_keys[ptr] = torch.empty(B, G, C, D, dtype=self.compute_dtype,
                                              device=k.device)
        self.open_keys[ptr][:, :, off:off + T] = k
        # values: one (scale, minimum) per position
        q, params = quantize_fp16_params(v.float(), -1)                # [B, G, T, 1] params
        rows[..., D // 2:D] = pack_nibbles(q)                          # [B, G, T, D/2]
        rows[..., D:D + 4] = torch.cat(params, -1).view(torch.uint8)   # [B, G, T, 4]
        if off + T < C:
            return
        # the chunk is full: its keys, per channel over each group of positions
        x = self.open_keys.pop(ptr).float()                            # [B, G, C, D]
        groups = []
        for start in range(0, C, self.KEY_GROUP):
            q, params = quantize_fp16_params(x[:, :, start:start + self.KEY_GROUP], 2)
            chunk[0, :, :, start:start + q.shape[2], :D // 2] = pack_nibbles(q)
            groups.append(torch.cat(params, 2))                        # [B, G, 2, D] fp16
        params = torch.stack(groups, 2).view(torch.uint8).view(B, G, -1)  # [B, G, groups * 4D]
        shares = chunk[0, :, :, :, D + 4:]                             # [B, G, C, E]
        padded = torch.zeros(B, G, shares[0, 0].numel(), dtype=torch.uint8, device=x.device)
        padded[..., :params.shape[-1]] = params
        shares.copy_(padded.view(shares.shape))

    def read(self, chunk, upto):
        """(k, v) [B, G, upto, D] in the compute dtype from the first `upto` positions of a chunk
        [1, B, G, C, D + 4 + E]. A full chunk: both dequantized from its bytes. The open chunk
        (upto < C): its keys as computed, its values dequantized."""
        C, D, E = self.sizes(chunk)
        rows = chunk[0, :, :, :upto]                                   # [B, G, upto, D + 4 + E]
        B, G = rows.shape[:2]
        q = unpack_nibbles(rows[..., :D]).unflatten(-1, (2, D))       # [B, G, upto, 2, D]
        params = rows[..., D:D + 4].view(torch.float16).float()       # [B, G, upto, 2]
        v = torch.addcmul(params[..., 1:], q[..., 1, :], params[..., :1])  # [B, G, upto, D]
        if upto < C:
            return self.open_keys[chunk.data_ptr()][:, :, :upto], v.to(self.compute_dtype)
        n = -(-C // self.KEY_GROUP)
        # [B, G, groups, 2, D]: a copy, aligned whatever the row width
        shares = rows[..., D + 4:].reshape(B, G, C * E)[..., :n * 4 * D].clone()
        scale, lo = shares.view(torch.float16).float().view(B, G, n, 2, 1, D).unbind(3)
        k = torch.empty(B, G, C, D, dtype=torch.float32, device=chunk.device)
        full = C // self.KEY_GROUP  # groups of KEY_GROUP positions; the last may be shorter
        cut = full * self.KEY_GROUP
        if full:
            out = k[:, :, :cut].view(B, G, full, self.KEY_GROUP, D)
            grouped = q[:, :, :cut, 0].view(B, G, full, self.KEY_GROUP, D)
            torch.addcmul(lo[:, :, :full], grouped, scale[:, :, :full], out=out)
        if cut < C:
            torch.addcmul(lo[:, :, -1], q[:, :, cut:, 0], scale[:, :, -1], out=k[:, :, cut:])
        return k.to(self.compute_dtype), v.to(self.compute_dtype)

    read_held = read  # the compute dtype: what a sealed group reaches attention in
    # the open chunk's keys live beside its bytes (open_keys): a copy of the bytes is not the
    # chunk, so a session saves only sealed chunks and recomputes the open one (runs/session.py)
    open_in_bytes = False

    def read_group(self, chunks):
        """(k, v) [n, B, G, C, D] of n sealed chunks [n, 1, B, G, C, D + 4 + E], each read as
        read does."""
        C = chunks.shape[4]
        k, v = zip(*(self.read(c, C) for c in chunks.unbind(0)))
        return torch.stack(k), torch.stack(v)


def quantize_fp16_params(x, dim):
    """x (fp32) -> (levels 0..15 uint8, (scale, minimum) fp16) over `dim`: the minimum and the
    scale are rounded to fp16 before the levels are computed, so their storage adds no error beyond
    the 4-bit rounding (and a clamp at the edges)."""
    x = x.clamp(-65504, 65504)
    lo = x.amin(dim, keepdim=True).half()
    scale = ((x.amax(dim, keepdim=True) - lo.float()) / 15).clamp_min(2 ** -24).half()
    return levels(x, lo.float(), scale.float()), (scale, lo)


def levels(x, lo, scale):
    """x (float) -> its level 0..15 between lo and lo + 15 * scale, uint8."""
    return torch.round((x - lo) / scale).clamp_(0, 15).to(torch.uint8)


def pack_nibbles(q):
    """q [..., D] (0..15) -> uint8 [..., D/2]: channel 2i in the low nibble, 2i+1 in the high."""
    return q[..., 0::2] | q[..., 1::2] << 4


def unpack_nibbles(b):
    """pack_nibbles undone: uint8 [..., D/2] -> [..., D]."""
    return torch.stack((b & 15, b >> 4), -1).flatten(-2)              # [..., D/2, 2] -> [..., D]


def chunk_layout(kv_dtype, dtype):
    """The layout for --kv-dtype (auto: the compute dtype `dtype`)."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"--kv-dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
    if kv_dtype == "int8":
        return Int8Layout(dtype)
    if kv_dtype == "int4":
        return Int4Layout(dtype)
    if kv_dtype in HALF_KV and HALF_KV[kv_dtype] != dtype:
        return HalfLayout(HALF_KV[kv_dtype], dtype)
    return PlainLayout(dtype)


def kv_chunk_bytes(model_args, dtype, kv_dtype, chunk_size):
    """Bytes of one chunk of one layer as the store holds it, scales included; dtype is the compute
    dtype."""
    layout = chunk_layout(kv_dtype, dtype)
    shape = layout.shape(1, model_args.n_kv_heads, chunk_size, model_args.head_dim)
    return math.prod(shape) * torch.empty((), dtype=layout.dtype).element_size()


def kv_bytes_per_token(model_args, dtype, kv_dtype="auto", chunk_size=None):
    """Bytes of K and V per position, all layers, as the chunks hold them (int8, int4: with the
    scales); dtype is the compute dtype. What crosses a link per offloaded position. int4 keeps its
    key scales per chunk, so its bytes per position depend on chunk_size (a float then)."""
    if kv_dtype == "int4" and chunk_size is None:
        raise ValueError("kv_bytes_per_token: int4's bytes per position depend on the chunk size; "
                         "pass chunk_size")
    C = chunk_size or 1
    chunk = kv_chunk_bytes(model_args, dtype, kv_dtype, C)
    if kv_dtype == "int4":
        return model_args.n_layers * chunk / C
    return model_args.n_layers * chunk // C


# partials stacked per group merge: all of a decode step's, a few of a prefill chunk's
