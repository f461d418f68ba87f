"""
The KV caches of a batch of tasks that decode together (generate.decode_batch: one forward pass
for every task's next token), behind the one cache's interface the model knows. Each task keeps
its own cache (kvcache.KVCache), store, positions and output; this file is the schedule of their
shared step.

Per task, a decode step's attention is one kernel call for the sealed chunks of each group, one for
the open chunk and a merge; a batch of N tasks would make N of each a layer, each reading a chunk
or two in less time than a call's fixed cost. Where the tasks' chunks share one arena
(pools.SharedArena, made by make_arena: --offload none on CPU, a --prompts job's and bench.py's
batches), task i's chunk j sits in slot j*I + i, so chunks 0..n-1 of every task are one tensor,
and one call a layer attends them all (the grid): each (chunk, task) is one element of the kernel's
batch, computed apart from the others (attention.attend_chunks), so each task's partials are those
of its own call, bit for bit. The tasks whose open chunks are the same chunk at the same offset
are one row of the arena: one copy writes their positions and one call attends them. Their merges
run as one where rowwise.rows's probes show each task the bits of its own (the tasks the outer
dimension of every operation). Where the step's tasks fill the arena in its order (a whole step,
plan), those placements and gathers are identities and are skipped. Row b of the step is then
exactly what task b computes alone, whatever tasks share it; a layer or step the grid does not
take (a sliding window, a --select that drops chunks, the compiled kernel, an arena mostly empty)
runs a task at a time, as before.
"""
import math
import os

import torch

from attention import attend_chunks, attend_open_chunk, padded_rows
from disk import ALIGN, round_up
from fewrows import few_rows_kernel
from kvcache import MERGE_GROUP_BYTES, chunk_spec
from kvlayout import PlainLayout
from pools import SharedArena
from rowwise import rows


class BatchedCaches:
    """The caches of B tasks whose decode steps run as one forward pass (generate.decode_batch),
    behind the one cache's interface the model knows: row i of the step is task i's next token,
    at task i's own position, attended over task i's own chunks: through the arena's grid where
    every task's chunks are in one (attend_grid), else a task at a time."""

    def __init__(self, caches):
        self.caches = caches
        self.windows = caches[0].windows  # one model: the same windows for every task
        arenas = {c.store.arena for c in caches}
        self.arena = arenas.pop() if len(arenas) == 1 else None  # every task's, or None
        self.fused = None  # whether a sealed chunk's visit takes the fused kernel (grid_pays)
        self.planned = None  # this step's plan (plan)

    @property
    def starts(self):
        return tuple(c.length for c in self.caches)

    def attend(self, layer, q, k, v):
        """q [B, H, 1, D], k, v [B, G, 1, D], row i task i's -> [B, H, 1, D]."""
        if self.arena is not None and self.grid_pays(layer, q, k):
            return self.attend_grid(layer, q, k, v)
        out = [c.attend(layer, q[i:i + 1], k[i:i + 1], v[i:i + 1])
               for i, c in enumerate(self.caches)]
        return torch.cat(out)

    def grid_pays(self, layer, q, k):
        """Whether this layer's step attends through the arena's grid: a decode step of one
        position a task, on a layer without a sliding window, every task reading every sealed
        chunk (no --select that drops one, no oracle), the fused kernel's (the compiled kernel
        takes one query block a call), a merge in one group (as KVCache.attend's), and the
        batch's sealed chunks at least half of the grid's elements (an index no task of the step
        holds, or a chunk past a task's, is read for nothing). A function of positions, shapes
        and the selection; either way each task's partials have the same bits."""
        B, H, T, D = q.shape
        G = k.shape[1]
        if self.fused is None:  # the kernel one task's visit takes (decided once a process)
            probe = torch.empty(0, 1, G, 1, D, dtype=self.caches[0].layout.attend_dtype)
            self.fused = few_rows_kernel(q[:1].reshape(1, G, H // G * T, D), probe) is None
        if self.windows[layer] is not None or not self.fused:
            return False
        n = 0
        for c in self.caches:
            visits = c.visits[layer] if c.decoding and c.T == 1 == q.shape[2] else None
            if (visits is None or c.selection.reads_all or len(visits) != c.n_sealed
                    or (visits and visits[0] != 0)):
                return False
            n = max(n, c.n_sealed)
        if n + 1 >= MERGE_GROUP_BYTES // (H * T * D * 4):  # KVCache.attend would merge in groups
            return False
        return 2 * sum(c.n_sealed for c in self.caches) >= n * self.arena.tasks

    def attend_grid(self, layer, q, k, v):
        """attend for a step that grid_pays: one kernel call over chunks 0..n-1 of every index of
        the arena (n the most any task has sealed), each with the queries of the task at that
        index (zero where none); the tasks whose open chunk is the same chunk, with the position at
        the same offset, written and attended as one row of the arena where they are at least half
        of it (else a task at a time, as KVCache.attend does); the partials of tasks with as many
        sealed chunks merged in one call where probes show each task the bits of its own merge
        (rowwise.rows). A task's partials, open chunk and merge are those KVCache.attend computes,
        bit for bit."""
        B, H, T, D = q.shape
        G = k.shape[1]
        R = H // G
        q = (q * (1.0 / math.sqrt(D))).reshape(B, G, R, D)    # KVCache.attend's, a task a row
        index, alike, whole = self.plan()
        n = max(alike)
        sealed = self.sealed_grid(layer, q, n, index, whole) if n else None
        out = None if whole else torch.empty(B, G, R, D, dtype=q.dtype)  # whole: its own o
        for n_b, (offsets, at, at_i) in alike.items():
            opened = []
            for off, rows_b in offsets.items():
                for b in rows_b:
                    self.caches[b].count(layer, 0, n_b, n_b)
                opened.append(self.open_partials(layer, q, k, v, n_b, off, rows_b, whole))
            o, lse = opened[0] if len(opened) == 1 else [torch.cat(p) for p in zip(*opened)]
            o, lse = o[:, None], lse[:, None]                       # [B', 1, G, R, (D)]
            if n_b:  # the sealed partials first, as attention's order has them
                o_s, lse_s = sealed[0][:n_b], sealed[1][:n_b]       # [n_b, I, G, R, ...]
                if not whole:
                    o_s, lse_s = o_s[:, at_i], lse_s[:, at_i]       # [n_b, B', G, R, ...]
                o = torch.cat([o_s.transpose(0, 1), o], 1)          # [B', n_b+1, G, R, D]
                lse = torch.cat([lse_s.transpose(0, 1), lse], 1)    # [B', n_b+1, G, R]
            o = rows(merge_tasks, "merge", o, lse)                   # [B', G, R, D]
            o = o if o.dtype == q.dtype else o.to(q.dtype)
            if whole:  # one kind of task, in the step's order
                return o.reshape(B, H, T, D)
            out[at] = o
        return out.reshape(B, H, T, D)

    def plan(self):
        """This step's (arena index of every task [B], {sealed chunks: ({offset of the position:
        the tasks' rows}, those rows in that order [B'], their arena indices [B'])}, whether the
        step is whole: every task with as many sealed chunks, task i at arena index i and at row i
        of its kind, every index a task's; then the step's gathers and scatters are identities and
        are skipped, and so is the open chunk's where its position is at one offset too), made at
        its first layer."""
        if self.planned is None:
            index = torch.tensor([c.store.arena_index for c in self.caches])   # [B]
            alike = {}
            for b, c in enumerate(self.caches):
                offsets = alike.setdefault(c.n_sealed, {})
                offsets.setdefault(c.length % c.chunk_size, []).append(b)
            plan = {}
            for n_b, offsets in alike.items():
                at = torch.tensor([b for rows_b in offsets.values() for b in rows_b])
                plan[n_b] = (offsets, at, index[at])
            B = len(self.caches)
            whole = (len(alike) == 1 and B == self.arena.tasks and index.tolist() == list(range(B))
                     and at.tolist() == list(range(B)))
            self.planned = index, plan, whole
        return self.planned

    def sealed_grid(self, layer, q, n, index, whole=False):
        """The partials of chunks 0..n-1 of every arena index in one kernel call, q [B, G, R, D]
        (scaled) the queries of the tasks at `index` [B] (whole: task i at index i, every index):
        (o [n, I, G, R, D], lse [n, I, G, R]) fp32, padded rows cut (attend_few's)."""
        B, G, R, D = q.shape
        I = self.arena.tasks
        self.arena.grid_calls += 1
        k_g, v_g = self.caches[0].layout.read_group(self.arena.grid(layer, n))  # [n*I, 1, G, C, D]
        rows = padded_rows(q[:1], k_g)
        q_g = q.new_zeros(n, I, G, rows, D)                   # [n, I, G, rows, D]
        if whole:
            q_g[..., :R, :] = q                               # task i's rows at index i
        else:
            q_g[:, index, :, :R] = q                          # task b's rows at its index
        o, lse = attend_chunks(q_g.view(n * I, 1, G, rows, D), k_g, v_g)
        return o.view(n, I, G, rows, D)[..., :R, :], lse.view(n, I, G, rows)[..., :R]

    def open_partials(self, layer, q, k, v, n_b, off, rows_b, whole=False):
        """Write the position of the tasks at rows_b, whose open chunk is chunk n_b and whose
        position is its offset off, and return their open chunk's partials (o [B', G, R, D], lse
        [B', G, R]) fp32, in rows_b's order. As one row of the arena (every index's chunk n_b: one
        copy of K and V into the tasks' slots, one call over the first off+1 positions, each index
        with its task's queries) where those tasks are at least half of the row and their layout's
        chunks are views (without gathers where they are the whole row of a whole step: plan);
        else a task at a time, as KVCache.attend writes and attends."""
        G, R = q.shape[1], q.shape[2]
        arena = self.arena
        caches = [self.caches[b] for b in rows_b]
        layout = caches[0].layout
        if 2 * len(rows_b) >= arena.tasks and isinstance(layout, PlainLayout):
            slots = arena.layer(layer)[1]
            opened = [c.store.open_chunk(layer).data_ptr() for c in caches]
            if opened == [slots[n_b * arena.tasks + c.store.arena_index].data_ptr()
                          for c in caches]:
                row = arena.grid(layer, n_b + 1)[n_b * arena.tasks:]   # [I, 2, 1, G, C, D]
                chunk = row.transpose(0, 1).flatten(1, 2)              # [2, I, G, C, D]
                if whole and len(rows_b) == arena.tasks:  # the same copies and call, no gathers
                    chunk[:, :, :, off] = torch.stack([k, v])[:, :, :, 0]   # [2, I, G, D]
                    k_o, v_o = layout.read(chunk, off + 1)             # [I, G, off+1, D]
                    return attend_open_chunk(q, k_o, v_o, off, R)     # [I, G, R, D], [I, G, R]
                at = torch.tensor(rows_b)
                at_i = torch.tensor([c.store.arena_index for c in caches])
                new = torch.stack([k[at], v[at]], 1)[:, :, :, 0]       # [B', 2, G, D]
                # PlainLayout.write's copies, each task's into its slot (a cast to a half KV)
                chunk[:, :, :, off].transpose(0, 1).index_copy_(0, at_i, new.to(chunk.dtype))
                k_o, v_o = layout.read(chunk, off + 1)                 # [I, G, off+1, D]
                q_o = q.new_zeros(arena.tasks, G, R, q.shape[3])       # [I, G, R, D]
                q_o[at_i] = q[at]
                o, lse = attend_open_chunk(q_o, k_o, v_o, off, R)     # [I, G, R, D], [I, G, R]
                return o[at_i], lse[at_i]
        parts = []
        for b, c in zip(rows_b, caches):
            kv = c.store.open_chunk(layer)
            c.layout.write(kv, off, k[b:b + 1], v[b:b + 1])
            parts.append(c.attend_open(q[b:b + 1], kv, off, R, None))
        return torch.cat([o for o, _ in parts]), torch.cat([lse for _, lse in parts])


def merge_tasks(o, lse):
    """attention.merge_last of tasks' partials at once, each task's its own stack: o [B, m, G, R,
    D], lse [B, m, G, R] -> [B, G, R, D]. The tasks are the outer dimension of each operation, so
    a task's weights and sum are computed as merge_last's [m, 1, ...] are (rowwise.rows probes
    it)."""
    if o.shape[1] == 1:
        return o[:, 0]
    return (o * torch.softmax(lse, dim=1).unsqueeze(-1)).sum(1)


def make_arena(model, tasks, chunk_size, max_length, kv_dtype="auto"):
    """The arena (pools.SharedArena) of up to `tasks` caches of `model` that decode together, each
    of up to max_length positions, with K and V held as kv_dtype says: give it to each one's
    make_cache. None on a GPU (the grid is the CPU's call count), and None where the arena would
    reserve more address space than the machine has memory (a task that needs more chunks than
    an arena of that size holds makes its own)."""
    emb = model.tok_embeddings.weight
    if not emb.is_cpu or tasks < 2:
        return None
    layout, shape = chunk_spec(model, chunk_size, kv_dtype)
    slot = round_up(math.prod(shape) * torch.empty((), dtype=layout.dtype).element_size(), ALIGN)
    n_chunks = -(-max_length // chunk_size)
    room = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    n_chunks = min(n_chunks, room // (slot * tasks * model.args.n_layers))
    if n_chunks < 1:
        return None
    return SharedArena(tasks, n_chunks, shape, layout.dtype, emb.device)
