"""
Tensor parallel (Megatron style, as gpt-fast's tp.py) and data parallel over processes started by
torchrun.

    # torchrun's RANK, WORLD_SIZE, LOCAL_RANK; replicas of 2 ranks
    layout = init_distributed(tp=2)
    # this rank's heads, MLP columns and vocab rows
    model = load_sharded(ckpt_dir, layout, device)
    # data parallel: this replica's tasks
    mine = split_tasks(ids, layout.n_replicas, layout.replica)
    # each rank's cache holds its own kv heads
    new, stats = task.run_task(model, ..., layout=layout)

A tensor-parallel group of N ranks holds one model. Each rank holds H/N query heads with the kv
heads they read, and F/N columns of the MLP; the cache of each rank holds its own kv heads only, so
KV per rank is 1/N of the whole (or one head when G < N). Per layer:

    x [B, T, E], the same on every rank
      -> wq wk wv: local heads [B, H/N, T, D] -> attention over this rank's cache
      -> wo: a partial sum [B, T, E] -> all-reduce (sum) -> + x
      -> w1 w3: local columns [B, T, F/N] -> w2: a partial sum -> all-reduce -> + x

so two all-reduces per layer, each of B*T*E numbers. The embedding and output head are cut by vocab
rows (vocab="shard": each rank looks up the tokens in its range, an all-reduce sums; each rank
computes its slice of the logits, an all-gather joins them), or kept whole on every rank
(vocab="replicate"). Sharding is the default because the two tables are whole on every rank
otherwise: at Llama-3-70B, N=8, 4.2 GB of bf16 per rank instead of 0.5 GB (+21% weights per rank),
and a replicated head reads all V*E of it for every token; the price is one small all-reduce and one
all-gather of V/N logits per step (tools/tp_vocab.py measures both).

A world of W ranks is W/N groups (replicas), each of N consecutive ranks, so a group stays on one
machine when the ranks of a machine are numbered together (torchrun does). split_tasks deals tasks
to the replicas. Every function here is a no-op on a single process (Layout.single()), so the loop
can call them unconditionally.

Limits: the ranks of a replica must issue the same collectives in the same order, so a replica runs
one task at a time (no --batch-size above 1), and an error on one rank leaves the others waiting in
a collective until torchrun stops the job (a rerun resumes).
"""
import hashlib
import importlib
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open

from checkpoint import CheckpointError, check_complete, checkpoint_files, expected, read_config
from model import ModelArgs, Transformer, join_projections
from rope import rope_inv_freq

VOCAB_MODES = ("shard", "replicate")


class TPError(ValueError):
    """A layout that cannot hold this model; one sentence naming the size and what to do."""


# -----------------------------------------------------------------------------
# layout: who is who

@dataclass
class Layout:
    rank: int = 0                  # global rank (torchrun's RANK)
    world: int = 1                 # all ranks (WORLD_SIZE)
    tp: int = 1                    # N, ranks that hold one model between them
    device: Any = "cpu"            # this rank's device; NCCL's collectives need their tensors there
    group: Optional[Any] = None    # the process group of this rank's replica (None when N = 1)

    @classmethod
    def single(cls, device="cpu"):
        return cls(device=device)

    @property
    def tp_rank(self):
        """This rank's index inside its replica: which heads and columns it holds."""
        return self.rank % self.tp

    @property
    def replica(self):
        """Which replica (data-parallel group) this rank belongs to."""
        return self.rank // self.tp

    @property
    def n_replicas(self):
        return self.world // self.tp

    @property
    def leader(self):
        """Global rank of the replica's rank 0: it samples, prints and writes results."""
        return self.replica * self.tp

    @property
    def is_leader(self):
        return self.rank == self.leader

    def rank_dir(self):
        """A task's subdirectory for this rank's store (None without tensor parallel)."""
        return f"rank{self.tp_rank}" if self.tp > 1 else None

    def fingerprint_part(self):
        """What of the layout changes the bytes of a rank's KV: N and the heads this rank holds.
        A store written under another N is refused on resume. (The replica does not matter.)"""
        return f"tp{self.tp}.{self.tp_rank}" if self.tp > 1 else ""


def init_distributed(tp=None, device=None):
    """Join the process group torchrun set up (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR in the
    environment) and return this rank's Layout. tp: ranks per model (default all). Without
    torchrun: Layout.single(device)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Layout.single(device or "cpu")
    rank = int(os.environ["RANK"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    tp = tp or world
    if tp < 1 or world % tp:
        raise TPError(f"the world of {world} ranks cannot be cut into tensor-parallel groups of "
                      f"{tp}; choose --tp dividing {world}")
    cuda = torch.cuda.is_available() and (device is None or str(device).startswith("cuda"))
    if cuda:
        device = torch.device("cuda", local)  # one GPU per rank of this machine
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        # torch._dynamo, imported after the group exists, keeps references to it that
        # destroy_process_group cannot drop, so gloo's worker threads would outlive it and race the
        # interpreter's exit (launch.finish). Building the model on the meta device imports it
        # anyway (nn.init on a meta tensor): import it first.
        importlib.import_module("torch._dynamo")
        dist.init_process_group("nccl" if cuda else "gloo")
    group = None
    if tp > 1:
        # every rank creates every group, in the same order (new_group is collective);
        # it keeps its own
        groups = [dist.new_group(list(range(g * tp, (g + 1) * tp))) for g in range(world // tp)]
        group = groups[rank // tp]
    return Layout(rank, world, tp, device if cuda else "cpu", group)


def split_tasks(task_ids, n_groups, group_index):
    """The task ids replica `group_index` of `n_groups` runs: by a stable hash of the id (sha256,
    not Python's salted hash), so a rerun, or a run with more tasks, sends each id to the same
    replica as before."""
    def bucket(task_id):
        digest = hashlib.sha256(str(task_id).encode()).digest()
        return int.from_bytes(digest[:8], "big") % n_groups
    return [t for t in task_ids if bucket(t) == group_index]


# -----------------------------------------------------------------------------
# collectives the loop calls (each a no-op on one process)

def all_reduce_sum(x, layout):
    # in place; x is this layer's fresh output
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=layout.group)
    return x


def broadcast_token(token, layout):
    """token [B, 1] on layout.device: the leader's sample replaces every rank's, so a sampler whose
    result could differ across ranks (a different RNG stream, a logit off by one ulp) never splits
    the replica's caches."""
    if layout.tp > 1:
        dist.broadcast(token, src=layout.leader, group=layout.group)
    return token


def gather_stats(stats, layout):
    """Every rank's stats dict, in tp_rank order, on the leader; None on the other ranks."""
    if layout.tp == 1:
        return [stats]
    out = [None] * layout.tp if layout.is_leader else None
    dist.gather_object(stats, out, dst=layout.leader, group=layout.group)
    return out


def agree_min(n, layout):
    """The smallest n of the replica:
    a task resumes from the longest prefix every rank's store vouches for."""
    if layout.tp == 1:
        return n
    t = torch.tensor([n], dtype=torch.int64, device=layout.device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=layout.group)
    return int(t.item())


# -----------------------------------------------------------------------------
# what each rank holds

@dataclass
class Shard:
    """This rank's share of the model:
    index ranges into the checkpoint's rows (heads, columns, vocab)."""
    n: int
    heads: range       # local query heads
    kv_heads: range    # local kv heads (when G < N: one head, replicated on the ranks sharing it)
    ffn: range         # local MLP columns
    vocab: range       # local vocab rows (padded: the last rank's tail may run past V)

    @classmethod
    def of(cls, model_args, n, tp_rank, vocab="shard"):
        H = model_args.n_heads
        G = model_args.n_kv_heads
        F_ = model_args.hidden_dim
        V = model_args.vocab_size
        if H % n:
            raise TPError(f"{n} ranks cannot split the model's {H} attention heads evenly; use a "
                          f"tensor-parallel size that divides {H}")
        if (G >= n and G % n) or (G < n and n % G):
            raise TPError(f"{n} ranks cannot share the model's {G} key/value heads; use a "
                          f"tensor-parallel size that divides {G} or is a multiple of it")
        if F_ % n:
            raise TPError(f"{n} ranks cannot split the MLP's {F_} columns (intermediate_size) "
                          f"evenly; use a tensor-parallel size that divides {F_}")
        if vocab not in VOCAB_MODES:
            raise TPError(f"vocab must be one of {VOCAB_MODES}, got {vocab!r}")
        h = H // n
        if G >= n:
            g = G // n
            kv = range(tp_rank * g, (tp_rank + 1) * g)
        else:  # fewer kv heads than ranks: each rank holds the one its query heads read (as vLLM)
            first = tp_rank * h // (H // G)
            kv = range(first, first + 1)
        f = F_ // n
        v = -(-V // n)  # ceil: every rank's slice has one shape, the last one padded with zero rows
        vocab_rows = range(tp_rank * v, (tp_rank + 1) * v) if vocab == "shard" else range(V)
        heads = range(tp_rank * h, (tp_rank + 1) * h)
        ffn = range(tp_rank * f, (tp_rank + 1) * f)
        return cls(n, heads, kv, ffn, vocab_rows)


def per_rank_bytes(model_args, n, context, dtype=torch.bfloat16, vocab="shard"):
    """On paper, for the leader (which alone adds the row-parallel biases): weight bytes and KV
    bytes of `context` positions (batch 1) held by one rank of an N-rank replica. Checked against a
    measured tiny model."""
    s = Shard.of(model_args, n, 0, vocab)
    E = model_args.dim
    D = model_args.head_dim
    h = len(s.heads)
    g = len(s.kv_heads)
    f = len(s.ffn)
    layer = 2 * E + (2 * h + 2 * g) * D * E + 3 * E * f  # norms, wq wo wk wv, w1 w3 w2
    layer += (h + 2 * g) * D * model_args.qkv_bias
    layer += E * model_args.o_bias + (2 * f + E) * model_args.mlp_bias
    # embedding and output head
    tables = len(s.vocab) * E * (1 if model_args.tie_embeddings else 2)
    size = torch.empty((), dtype=dtype).element_size()
    return {"weights": (model_args.n_layers * layer + E + tables) * size,
            "kv": 2 * model_args.n_layers * g * D * context * size}


# -----------------------------------------------------------------------------
# vocab-sharded embedding and output head

class ShardedEmbedding(nn.Module):
    """Rows [start, start + V/N) of the embedding: each token is found on exactly one rank, the
    others add zeros."""

    def __init__(self, weight, start, layout):
        super().__init__()
        self.weight = weight
        self.start = start
        self.layout = layout

    def forward(self, tokens):
        local = tokens - self.start                                       # [B, T]
        mine = (local >= 0) & (local < self.weight.shape[0])
        x = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)  # [B, T, E]
        return all_reduce_sum(x.masked_fill(~mine[..., None], 0.0), self.layout)


class ShardedHead(nn.Module):
    """Logits of this rank's vocab rows, gathered from every rank into [B, T, V]
    (identical on every rank)."""

    def __init__(self, weight, vocab_size, layout):
        super().__init__()
        self.weight = weight
        self.vocab_size = vocab_size
        self.layout = layout

    def forward(self, x):
        part = F.linear(x, self.weight).contiguous()                      # [B, T, V/N]
        parts = [torch.empty_like(part) for _ in range(self.layout.tp)]
        dist.all_gather(parts, part, group=self.layout.group)
        return torch.cat(parts, dim=-1)[..., :self.vocab_size]           # [B, T, V]: padding cut


# -----------------------------------------------------------------------------
# loading: each rank reads its slices only

def _plan(name, model_args, s, layout):
    """(dim, rows) of the checkpoint tensor this rank reads for parameter `name`; None = all of it;
    "leader" = all of it on the leader only (a row-parallel bias is added once, not N times)."""
    D = model_args.head_dim
    kind = name.rsplit(".", 2)[-2:]  # e.g. ["wq", "weight"]
    heads = range(s.heads.start * D, s.heads.stop * D)
    kv = range(s.kv_heads.start * D, s.kv_heads.stop * D)
    table = {"wq": (0, heads), "wk": (0, kv), "wv": (0, kv), "wo": (1, heads),
             "w1": (0, s.ffn), "w3": (0, s.ffn), "w2": (1, s.ffn)}
    if name.startswith("layers.") and kind[0] in table:
        if kind[0] in ("wo", "w2") and kind[1] == "bias":
            return "leader"
        dim, rows = table[kind[0]]
        return (0 if kind[1] == "bias" else dim), rows
    if name in ("tok_embeddings.weight", "output.weight") and len(s.vocab) < model_args.vocab_size:
        return 0, s.vocab
    return None


def _read(sl, plan, full):
    """(the part of a safetensors slice this rank holds, bytes read from the file for it).
    Vocab rows past the end of the table are zeros, not read: padding, so that every rank's slice
    has one shape."""
    if plan in (None, "leader"):
        t = sl[:]
        return t, t.numel() * t.element_size()
    dim, rows = plan
    stop = min(rows.stop, full[dim])
    t = sl[rows.start:stop] if dim == 0 else sl[:, rows.start:stop]
    n = t.numel() * t.element_size()
    if stop < rows.stop:
        pad = list(t.shape)
        pad[dim] = rows.stop - stop
        t = torch.cat([t, t.new_zeros(pad)], dim=dim)
    return t, n


def _slices(ckpt_dir):
    """Yield (name, safetensors slice, file) for every tensor;
    a slice reads nothing until it is indexed."""
    for path in checkpoint_files(ckpt_dir):
        try:
            f = safe_open(path, framework="pt")
        # safetensors reports truncation and corruption with its own error types
        except Exception as e:
            raise CheckpointError(f"{path}: cannot be read as safetensors ({e}); the file is "
                                  "truncated or corrupt") from None
        with f:
            for name in f.keys():
                yield name, f.get_slice(name), path


@torch.no_grad()
def load_sharded(ckpt_dir, layout, device="cpu", dtype=torch.float32, vocab="shard",
                 rope_override=None):
    """This rank's share of a Hugging Face checkpoint: built on the meta device with full sizes,
    then each parameter is assigned the slice read by safetensors' get_slice (only those bytes
    leave the file). model.loaded_bytes counts them. With Layout.single() this is the whole model,
    as from_pretrained. rope_override: as Transformer.from_pretrained's."""
    # checked against the weights' headers before anything is built from it
    model_args = ModelArgs.from_config(*read_config(ckpt_dir))
    if rope_override is not None:
        model_args = model_args.with_rope_override(*rope_override)
    s = Shard.of(model_args, layout.tp, layout.tp_rank, vocab)
    with torch.device("meta"):
        model = Transformer(model_args)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = set()
    model.loaded_bytes = 0
    for hf_name, sl, path in _slices(ckpt_dir):
        full = tuple(sl.get_shape())
        name = expected(hf_name, full, params, model_args, path)
        if name is None:
            continue
        plan = _plan(name, model_args, s, layout)
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        loaded.add(name)
        if plan == "leader" and not layout.is_leader:
            # nn.Linear then adds no bias: the leader's is summed in once
            setattr(module, attr, None)
            continue
        t, n = _read(sl, plan, full)
        model.loaded_bytes += n
        setattr(module, attr, nn.Parameter(t.to(device, dtype), requires_grad=False))
    check_complete(params, loaded, model_args, ckpt_dir)
    if model_args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight  # the same rows, sharded the same way
    _wire(model, s, layout)
    model.inv_freq = rope_inv_freq(model_args).to(device)
    return join_projections(model).eval()  # this rank's shares, as from_pretrained joins all


def _wire(model, s, layout):
    """The all-reduces, attached from outside as forward hooks (as gpt-fast does): the model
    itself knows nothing of tensor parallelism. Each rank's attention and MLP give a partial sum of
    the output (its heads' and its hidden units' share of wo and w2); the hook sums them over the
    ranks. The local head counts follow from the sliced projections' shapes."""
    if layout.tp == 1:
        return

    def summed(module, inputs, output):
        return all_reduce_sum(output, layout)
    for block in model.layers:
        attention = block.attention
        ffn = block.feed_forward
        attention.register_forward_hook(summed)
        ffn.register_forward_hook(summed)
        for lin in (attention.wq, attention.wk, attention.wv, attention.wo, ffn.w1, ffn.w3, ffn.w2):
            # keep repr() honest about the local shapes
            lin.out_features, lin.in_features = lin.weight.shape
    if len(s.vocab) < model.args.vocab_size:
        model.tok_embeddings = ShardedEmbedding(model.tok_embeddings.weight, s.vocab.start, layout)
        model.output = ShardedHead(model.output.weight, model.args.vocab_size, layout)


# -----------------------------------------------------------------------------
# the table on paper: python tp.py

LLAMA_70B = ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, head_dim=128,
                      hidden_dim=28672, vocab_size=128256)

if __name__ == "__main__":
    GiB = 2 ** 30
    ctx = 32768
    print(f"Llama-3-70B shape, bf16, batch 1, KV of {ctx} positions, per rank (the leader)")
    print("| N | weights, vocab sharded | weights, vocab replicated | KV at 32K | KV per token |")
    print("|---|---|---|---|---|")
    for n in (1, 2, 4, 8):
        sharded = per_rank_bytes(LLAMA_70B, n, ctx)
        replicated = per_rank_bytes(LLAMA_70B, n, ctx, vocab="replicate")
        print(f"| {n} | {sharded['weights'] / GiB:.1f} GiB | "
              f"{replicated['weights'] / GiB:.1f} GiB | {sharded['kv'] / GiB:.2f} GiB "
              f"| {sharded['kv'] // ctx // 1024} KiB |")
