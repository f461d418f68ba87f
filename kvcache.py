"""
The KV cache as attention sees it: chunks of C consecutive positions, attended one by one and merged exactly.

The KV of each layer is cut into chunks of `chunk_size` (C) positions. Chunk j holds positions [j*C, (j+1)*C).
The chunk being filled (the *open* chunk) always lives on the compute device; once full it is *sealed* and
handed to the store (offload.py), which decides where it lives: the device window, host memory or disk.

Attention of a block of queries (a prefill chunk, or one decode token) runs over
    sealed chunk 0, sealed chunk 1, ..., sealed chunk n-1, then the open chunk (causal inside it),
one partial attention per chunk, merged with the running max / running sum of exponentials (the
flash-attention recurrence). No position is dropped or approximated.

Why offload cannot change the output: the compute schedule (which positions go into which kernel call, the
shapes of those calls, and the order of the merges) is a function of the positions and C only. Where a chunk
lives changes which copy brings it to the device, never the arithmetic: every chunk reaches attention as a
contiguous [B, G, C, D] tensor with the same bytes, whether it stayed on the device, came back from host
memory, was decompressed, or is a view of a memory-mapped file. So `--offload cpu|disk` is bit-identical to
`--offload none` at the same chunk size, by construction; verify.py checks it on every run.
"""
import math

import torch


def attend_chunk(q, k, v, state, visible=None):
    """One step of the exact chunked-attention recurrence, in fp32.

    q [B, G, R*T, D], already scaled by 1/sqrt(D); k, v [B, G, L, D]: the L positions of one chunk.
    state: (m, l, acc) with m, l [B, G, R*T, 1] (row max, row sum of exponentials) and acc [B, G, R*T, D],
    or None before the first chunk. visible [R*T, L] bool masks future keys inside the open chunk.
    """
    B, G, RT, D = q.shape
    L = k.shape[2]
    # bmm over B*G flattened views: the 4-D matmul with a transposed operand takes a path that stalls under CPU load
    s = torch.bmm(q.reshape(B * G, RT, D), k.reshape(B * G, L, D).transpose(1, 2)).view(B, G, RT, L).float()  # scores
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)                           # [B, G, R*T, 1]
    if state is not None:
        m = torch.maximum(state[0], m)
    p = torch.exp(s - m)                                       # [B, G, R*T, L]
    l = p.sum(dim=-1, keepdim=True)                            # [B, G, R*T, 1]
    acc = torch.bmm(p.to(v.dtype).view(B * G, RT, L), v.reshape(B * G, L, D)).view(B, G, RT, D).float()
    if state is not None:
        alpha = torch.exp(state[0] - m)                        # rescales what earlier chunks accumulated
        l = state[1] * alpha + l
        acc = state[2] * alpha + acc
    return m, l, acc


class KVCache:
    """Positions, the open chunk and the attention schedule; the store (offload.py) owns every byte.

    Use it through three calls per forward step of T tokens, as generate.forward does:
        cache.begin(T)          # check the step fits in the open chunk; the store starts prefetching
        model(tokens, cache)    # each layer calls cache.attend(layer, q, k, v)
        cache.end()             # advance; a full open chunk is sealed and placed by the store
    A step never crosses a chunk boundary (prefill feeds at most C tokens, aligned to chunks), so each
    step's queries all sit in the open chunk.
    """

    def __init__(self, store):
        self.store = store
        self.chunk_size = store.chunk_size  # C
        self.length = 0                     # positions already written and committed
        self.T = 0                          # tokens of the step in flight

    @property
    def n_sealed(self):
        return self.length // self.chunk_size

    def begin(self, T):
        off = self.length % self.chunk_size
        if T < 1 or off + T > self.chunk_size:
            raise ValueError(f"a step of {T} tokens at position {self.length} crosses a chunk boundary "
                             f"(chunk size {self.chunk_size}); feed the prompt through generate.prefill")
        if self.length + T > self.store.max_length:
            raise ValueError(f"the cache holds {self.store.max_length} positions; position {self.length + T} is past it")
        self.T = T
        self.store.prefetch(self.n_sealed)  # queue the sealed chunks not on the device, in the order attend reads them

    def attend(self, layer, q, k, v):
        """q [B, H, T, D], k, v [B, G, T, D] at positions [length, length+T) -> attention output [B, H, T, D]."""
        B, H, T, D = q.shape
        G = k.shape[1]
        R = H // G
        off = self.length % self.chunk_size
        kv = self.store.open_chunk(layer)                              # [2, B, G, C, D] on the device
        kv[0, :, :, off:off + T] = k
        kv[1, :, :, off:off + T] = v
        q = (q * (1.0 / math.sqrt(D))).view(B, G, R, T, D).reshape(B, G, R * T, D)  # rows are (r, t) pairs
        state = None
        for j in range(self.n_sealed):                                 # sealed chunks: every key is in the past
            k_j, v_j = self.store.load(layer, j)                       # [B, G, C, D] each, on the device
            state = attend_chunk(q, k_j, v_j, state)
            self.store.release(layer, j)                               # its staging slot may be refilled
        visible = None
        if T > 1:                                                      # query t sees keys <= off + t
            t = torch.arange(R * T, device=q.device) % T
            visible = torch.arange(off + T, device=q.device)[None, :] <= (off + t)[:, None]  # [R*T, off+T]
        m, l, acc = attend_chunk(q, kv[0, :, :, :off + T], kv[1, :, :, :off + T], state, visible)
        y = (acc / l).to(q.dtype)                                      # [B, G, R*T, D]
        return y.view(B, G, R, T, D).reshape(B, H, T, D)

    def end(self):
        self.length += self.T
        self.T = 0
        if self.length % self.chunk_size == 0:
            self.store.seal(self.length // self.chunk_size - 1)  # every layer's open chunk goes to the store
