"""
Exact speculative decoding: guess the next few tokens cheaply, check them all in one forward step
that reads every weight and every sealed chunk once, and keep the guesses the model would have
produced itself. The output (ids, and every kept position's logits) is bit for bit the output of
one-token decoding.

    new = speculate.generate(model, cache, prompt_ids, 256, speculator=Lookup(k=6))

A verify step feeds the last token and K guesses at positions p..p+K as K+1 rows (PositionRows): the
model sees a batch of K+1 one-token rows, each at its own position, so every linear, norm and RoPE
table gives row i the bits of a one-token step at p+i (rowwise.py keeps a row's bits its own), and
attend_rows gives row i what KVCache.attend gives a one-token step at p+i: each sealed chunk is
brought from its tier once; with full attention all rows visit a group of chunks in one kernel call,
each row's queries padded as its own step pads them (attention.attend_few), where probes show that
call gives each row its own call's bits (rowwise.shared_rows), and otherwise (or with a sliding
window) each row that sees the chunk gets the kernel call its own step makes; then the open chunk up
to the row's own offset, and the same merges in the same order. Row i's token is what sample() draws
there (greedy, or its position's own generator); guess i+1 is kept iff it equals that token, and the
first mismatch gives the model's own token.

Rollback: a verify step stays inside the open chunk (the guesses are cut at its end), and the
cache commits only the kept rows (KVCache.commit(kept)). The rejected rows' K and V sit past the
committed length in the open chunk, where nothing reads them and the next step overwrites them: a
chunk is sealed only once full of kept positions, so they are never sealed, offloaded, written to
disk, vouched for by a manifest or stored.

Guessers: Lookup (the longest recent n-gram of the prompt and the generated text) and Draft (a
small model with the same vocabulary and a cache of its own).
"""
import math
import statistics
import time
from collections import deque

import torch

from attention import (
    Partials,
    attend_chunk,
    attend_chunks,
    attend_few,
    first_visible_chunk,
    pad_rows,
    padded_rows,
    visible_keys,
)
from generate import Sampling, decode_one_token, prefill, sample
from kvcache import MERGE_GROUP_BYTES, chunk_groups, make_cache
from kvlayout import Int4Layout
from offload import OffloadConfig
from pools import GROUP_CHUNKS
from rowwise import shared_rows

K_MAX = 32        # guesses per verify step at most
LOOKUP_K = 6      # lookup's default: see docs/speculation.md
BACKOFF = 32      # plain steps at most between failed guesses and the next ones
PACE_STEPS = 8    # the plain steps whose median time a verify step is held to (Pace)
NGRAMS = (4, 3, 2)  # lookup's n-gram sizes, longest first; a lone token matches too often


# -----------------------------------------------------------------------------
# a verify step: K+1 positions as K+1 one-token rows

class PositionRows:
    """One task's positions p..p+N-1 as the N rows of one forward step, behind the cache interface
    the model knows (starts, windows, attend): row i is a one-token step at p+i."""

    def __init__(self, cache, N):
        self.cache = cache
        self.windows = cache.windows
        self.starts = tuple(range(cache.length, cache.length + N))

    def attend(self, layer, q, k, v):
        return attend_rows(self.cache, layer, q, k, v)


def attend_rows(cache, layer, q, k, v):
    """q [N, H, 1, D], k, v [N, G, 1, D]: row i at position cache.length + i -> [N, H, 1, D], row i
    the bits KVCache.attend gives a one-token decode step at that position. Each sealed chunk is
    loaded once, in the order the step prefetched; all rows visit a group of chunks in one kernel
    call where that gives each row its own step's bits (rowwise.shared_rows), else each row visits
    it alone while it is hot. Mirrors KVCache.attend's T = 1 path: change both together (tests/
    test_speculate.py compares them bit for bit)."""
    N, H, _, D = q.shape
    G = k.shape[1]
    R = H // G
    C = cache.chunk_size
    W = cache.windows[layer]
    off = cache.length % C
    if not cache.decoding or N != cache.T or cache.selection.name != "all":
        raise ValueError("a verify step reads every visible chunk: begin(N, decode=True) with the "
                         "exact selection")
    kv = cache.store.open_chunk(layer)
    # every position's K and V at once: a copy, or per position a max and elementwise rounding
    # (int8, int4's values), so each position's bytes are those its own step writes
    cache.layout.write(kv, off, k.transpose(0, 2), v.transpose(0, 2))  # [1, G, N, D]
    # [N, H, 1, D] scaled at once (elementwise: each element's bits as its own step's)
    q = q * (1.0 / math.sqrt(D))
    # partials per merge, as the row's own step makes them: its q is [1, G, R, D]
    group = max(1, MERGE_GROUP_BYTES // (G * R * D * 4))
    rows = []
    for i in range(N):
        p = cache.length + i
        q_i = q[i:i + 1].view(1, G, R, 1, D).reshape(1, G, R, D)  # [1, H, 1, D] -> [1, G, R, D]
        q_pos = None if W is None else p + torch.zeros(R, dtype=torch.long, device=q.device)
        rows.append(Row(q_i, p, first_visible_chunk(W, p, C), q_pos, group))
    visits = cache.visits[layer]  # the union: every row's visible chunks (row 0 sees furthest)
    cache.count(layer, cache.first[layer], cache.n_sealed, len(visits))
    if W is None:
        attend_together(cache, layer, rows, visits)
    else:
        attend_apart(cache, layer, rows, visits)
    out = []
    for i, row in enumerate(rows):
        # the open chunk up to this row's own offset, as the row's own step reads it
        row.parts.add_one(*cache.attend_open(row.q, kv, off + i, R, W))
        o = row.parts.output()
        out.append(o.to(q.dtype).view(1, G, R, 1, D).reshape(1, H, 1, D))
    return torch.cat(out)  # [N, H, 1, D]


def attend_together(cache, layer, rows, visits):
    """Full attention: every row sees every chunk. The chunks in the groups a one-token step reads
    them (KVCache.attend_sealed), each group one call for all rows, where rowwise.shared_rows
    vouches that every position's R rows get the bits of its own step's call (attention.attend_few,
    which pads them), else a call per row. The positions' rows go unpadded, side by side (padded
    once at the end where they are fewer than a call's least, attention.padded_rows): a verify
    step's attention is bound by the kernel's arithmetic, and a position's padding row is a row of
    it (a quarter of the rows at R = 3)."""
    _, G, R, D = rows[0].q.shape
    N = len(rows)
    q_all = torch.cat([row.q for row in rows], dim=2)               # [1, G, N*R, D]
    size = max(1, min(GROUP_CHUNKS, MERGE_GROUP_BYTES // (rows[0].q.numel() * 4)))
    for js in chunk_groups(visits, size):
        for run in cache.store.load_group(layer, js):
            k_n, v_n = cache.layout.read_group(run)  # [n, 1, G, C, D] each
            q_in = pad_rows(q_all, padded_rows(q_all, k_n))  # [1, G, N*R (+ pad), D]
            if N > 1 and shared_rows(attend_chunks, q_in, k_n, v_n, R, N, attend_few):
                o, lse = attend_chunks(q_in, k_n, v_n)  # [n, 1, G, N*R (+ pad), D], [.., N*R]
                for i, row in enumerate(rows):
                    block = slice(i * R, (i + 1) * R)
                    row.parts.add(o[:, :, :, block].contiguous(), lse[:, :, :, block].contiguous())
            else:
                for row in rows:
                    row.parts.add(*attend_few(row.q, k_n, v_n))


def attend_apart(cache, layer, rows, visits):
    """A sliding window: a chunk at a time, each row that sees it alone, the window's edge with
    its mask, as the row's own step does."""
    C = cache.chunk_size
    W = cache.windows[layer]
    release = cache.store.release if cache.store.staged else None
    for j in visits:
        # read as a one-token step reads a sealed chunk (read_group: a half-precision KV stays as
        # held, for the kernel to widen, where read casts it to the compute dtype)
        k_n, v_n = cache.layout.read_group(cache.store.load(layer, j)[None])  # [1, 1, G, C, D]
        k_j, v_j = k_n[0], v_n[0]                                              # [1, G, C, D]
        for row in rows:
            if j < row.first:  # before this row's sliding window
                continue
            if j * C <= row.p - W:  # the window's edge
                visible = visible_keys(row.q_pos, j * C + torch.arange(C, device=k_j.device), W)
                row.parts.add_one(*attend_chunk(row.q, k_j, v_j, visible))
            else:
                row.parts.add(*attend_few(row.q, k_j[None], v_j[None]))
        if release:
            release(layer, j)


class Row:
    """One position's partials in a verify step, merged in the groups its own step makes."""

    def __init__(self, q, p, first, q_pos, group):
        self.q, self.p, self.first, self.q_pos = q, p, first, q_pos
        self.parts = Partials(group)


@torch.inference_mode()
def verify_step(model, cache, tokens):
    """tokens: the last token and the guesses, at positions cache.length.. -> logits [N, V], row i
    the next position's after tokens[i]. Nothing is committed: the caller keeps a prefix."""
    N = len(tokens)
    cache.begin(N, decode=True)
    cache.store.prefetch(cache.reads())
    ids = torch.tensor(tokens, device=cache.store.device).view(N, 1)  # [N, 1]: a row a position
    return model(ids, PositionRows(cache, N), last_only=True)[:, -1]  # [N, V]


def commit(cache, kept):
    """Keep the step's first `kept` positions; seal the open chunk if they filled it."""
    if cache.commit(kept):
        cache.store.seal(cache.n_sealed - 1)


# -----------------------------------------------------------------------------
# the loop

class Pace:
    """Whether guessing pays here (this machine, model, context and tier), from this run's own step
    times: a verify step pays when its tokens came faster than plain steps give theirs (the median
    of the last PACE_STEPS). Where a row costs a row of compute (a CPU), a verify step of 2 rows
    costs about 1.4 plain steps, so a step that kept 1 guess of 5 did not pay; where rows are nearly
    free (a step bound by reading weights or KV) it did. Only speed depends on it: whichever steps
    run, every token and logit is the same."""

    def __init__(self, timed=True, clock=time.perf_counter):
        self.timed = timed  # False: every step that kept a guess paid (verify.py: the proof
        self.clock = clock  # should exercise as many verify steps as it can, whatever they cost)
        self.plain = deque(maxlen=PACE_STEPS)  # seconds of the last plain steps

    def paid(self, seconds, tokens):
        """Whether a verify step of `seconds` that gave `tokens` beat the plain steps (yes before
        any plain step was timed)."""
        if not self.timed or not self.plain:
            return True
        return seconds / tokens < statistics.median(self.plain)


def generate(model, cache, prompt_ids, max_new_tokens, sampling=Sampling(), eos_ids=(),
             on_token=None, on_step=None, replay=(), share=None, step=None, speculator=None,
             pace=None):
    """generate.generate with guesses checked in verify steps: the same tokens, and on_step gets
    the same logits for the same positions, one call per kept position. speculator.stats holds
    what it cost and kept. pace: a Pace (default: timed by this process's clock)."""
    if share is not None or step is not None:
        raise ValueError("speculation runs one task alone: not under tensor parallelism or in a "
                         "batch")
    P = prompt_ids.shape[1]
    out = list(replay)
    logits = None
    if cache.length < P:
        logits = prefill(model, cache, prompt_ids[:, cache.length:], on_step)
    for pos in range(max(cache.length, P), P + len(out)):  # replay, one token at a time
        logits = decode_one_token(model, cache, prompt_ids.new_tensor([[out[pos - P]]]))
    prompt = prompt_ids[0].tolist()
    stats = speculator.stats
    kv_start = cache.store.snapshot()["bytes"].get("kv_read", 0)
    # the int4 layout quantizes a chunk's keys on the write that fills it: only a kept row may
    spare = 1 if isinstance(cache.layout, Int4Layout) else 0
    pace = pace or Pace()
    idle = 0     # plain steps before the next guesses
    k_now = speculator.k  # guesses the next verify step may make
    backoff = 1  # what idle becomes when guesses fail
    while len(out) < max_new_tokens and not (out and out[-1] in eos_ids):
        token = sample(logits, sampling, cache.length).to(prompt_ids.device)  # [1, 1]
        out.append(token.item())
        if on_token:
            on_token(out)
        if out[-1] in eos_ids or len(out) == max_new_tokens:
            break
        # guesses stay inside the open chunk and never run past max_new_tokens
        room = min(k_now, cache.chunk_size - cache.length % cache.chunk_size - 1 - spare,
                   max_new_tokens - len(out) - 1)
        guesses = []
        start = pace.clock()  # a verify step costs its guesses too (a draft model's steps)
        if idle:  # the last guesses all failed: a few plain steps first
            idle -= 1
        elif room > 0:
            t = time.perf_counter()
            guesses = speculator.propose(prompt + out, room)[:room]
            stats["draft_s"] += time.perf_counter() - t
        stats["steps"] += 1
        if not guesses:
            logits = decode_one_token(model, cache, token)
            pace.plain.append(pace.clock() - start)
            stats["tokens"] += 1
            if on_step:
                on_step("decode", logits, cache)
            continue
        rows = verify_step(model, cache, [out[-1]] + guesses)  # [N, V]
        stats["proposed"] += len(guesses)
        kept = 1  # row 0, the last token's step, always stands
        done = False
        while kept <= len(guesses):
            t = sample(rows[kept - 1:kept], sampling, cache.length + kept).item()
            if t != guesses[kept - 1]:
                break
            out.append(t)  # before the commit: a manifest written once it seals vouches for it
            if on_token:
                on_token(out)
            if t in eos_ids or len(out) == max_new_tokens:
                done = True  # the plain loop decodes no further either
                break
            kept += 1
        stats["kept"] += kept - 1
        stats["tokens"] += kept
        commit(cache, kept)
        # free text: a verify step whose guesses all fail costs more than plain steps, and so
        # does one that kept them all and still did not pay (Pace: guessing costs too much here),
        # so each such step in a row waits twice as long before guessing again (1, 2, 4 ...
        # BACKOFF steps), then guesses one token; one that kept some and did not pay guesses
        # fewer next time; guesses all kept double the next guess count, up to k
        paid = pace.paid(pace.clock() - start, kept)
        stats["unpaid"] += not paid
        failed = kept == 1 or (not paid and kept - 1 == len(guesses))
        idle = backoff if failed else 0
        backoff = min(2 * backoff, BACKOFF) if failed else 1
        if failed:
            k_now = 1
        elif kept - 1 == len(guesses):
            k_now = min(speculator.k, 2 * len(guesses))
        else:
            k_now = kept  # the guesses kept, and one more
        if on_step:
            report_rows(on_step, cache, rows, kept)
        if done:
            break
        logits = rows[kept - 1:kept]
    stats["kv_read_bytes"] += cache.store.snapshot()["bytes"].get("kv_read", 0) - kv_start
    return out


def report_rows(on_step, cache, rows, kept):
    """on_step for each kept row, the cache's length what it is after that row's own step (what
    on_step reads it for: the position), as one-token decoding calls it."""
    end = cache.length
    try:
        for i in range(kept):
            cache.length = end - kept + i + 1
            on_step("decode", rows[i:i + 1], cache)
    finally:
        cache.length = end


def summary(stats):
    """The statistics --json and the statistics line show."""
    steps = max(1, stats["steps"])
    tokens = max(1, stats["tokens"])
    return {"speculate": stats["kind"], "verify_steps": stats["steps"],
            "guesses_proposed": stats["proposed"], "guesses_kept": stats["kept"],
            "tokens_per_step": round(stats["tokens"] / steps, 3),
            "verify_steps_unpaid": stats["unpaid"],
            "kv_bytes_per_token": round(stats["kv_read_bytes"] / tokens),
            "draft_s": round(stats["draft_s"], 4)}


def new_stats(kind):
    return {"kind": kind, "steps": 0, "tokens": 0, "proposed": 0, "kept": 0, "kv_read_bytes": 0,
            "draft_s": 0.0, "unpaid": 0}


# -----------------------------------------------------------------------------
# guessers

class Lookup:
    """Prompt lookup: the tokens that followed the most recent earlier occurrence of the longest
    n-gram (NGRAMS) ending the text so far. An index of every n-gram's latest continuation, grown
    as tokens come: O(1) a step."""

    def __init__(self, k=LOOKUP_K):
        self.k = k
        self.index = {n: {} for n in NGRAMS}
        self.indexed = 0  # n-grams ending before this position are in the index
        self.stats = new_stats(f"lookup:{k}")

    def propose(self, seq, n):
        """Up to n guesses of what follows seq (the prompt and the tokens so far)."""
        for e in range(self.indexed, len(seq) - 1):  # n-grams ending at e, followed by seq[e+1]
            for size, index in self.index.items():
                if e + 1 >= size:
                    index[tuple(seq[e + 1 - size:e + 1])] = e + 1
        self.indexed = max(self.indexed, len(seq) - 1)
        for size, index in self.index.items():
            start = index.get(tuple(seq[-size:]))
            if start is not None:
                return seq[start:start + n]
        return []


class Draft:
    """A small model with the same vocabulary guesses greedily, on a cache of its own (on the
    device, never offloaded). Its cache follows the target's text: after a verify step it drops
    the rejected guesses (they sit in its open chunk: the same cut keeps them there) and feeds
    what was kept."""

    def __init__(self, model, k, chunk_size, max_length):
        self.model = model
        self.k = k
        self.cache = make_cache(model, OffloadConfig(mode="none"), chunk_size, max_length)
        self.fed = []  # the tokens whose K and V the draft's cache holds
        self.stats = new_stats(f"draft:{k}")

    @torch.inference_mode()
    def propose(self, seq, n):
        cache = self.cache
        same = 0
        for a, b in zip(self.fed, seq):
            if a != b:
                break
            same += 1
        if same < len(self.fed):  # roll back the rejected guesses, never into a sealed chunk
            if same < cache.n_sealed * cache.chunk_size:
                raise ValueError("the draft's rollback would cross a sealed chunk")
            cache.length = same
            del self.fed[same:]
        device = cache.store.device
        # seq always ends past what was fed: at least the target's own token is new. The prompt
        # (all but the target's first token) is prefilled as the target prefilled it and the
        # first token decoded, as the target decoded it: a step of several tokens sums in another
        # order, and its near ties could flip a draft that is the target itself. Later tokens
        # (a verify step's last guess and the target's own token) come as one step: cheaper
        new = seq[len(self.fed):]
        if not self.fed and len(new) > 1:
            prefill(self.model, cache, torch.tensor([new[:-1]], device=device))
            new = new[-1:]
        if len(new) == 1:
            logits = decode_one_token(self.model, cache, torch.tensor([new], device=device))
        else:
            logits = prefill(self.model, cache, torch.tensor([new], device=device))  # [1, V]
        self.fed = list(seq)
        guesses = [int(logits.argmax())]
        while len(guesses) < n:
            logits = decode_one_token(self.model, cache, torch.tensor([[guesses[-1]]],
                                                                      device=device))
            self.fed.append(guesses[-1])
            guesses.append(int(logits.argmax()))
        return guesses


def parse_lookup(spec):
    """'lookup' or 'lookup:K' -> K, or None when the spec is not one."""
    kind, colon, k = spec.partition(":")
    if kind != "lookup":
        return None
    if not colon:
        return LOOKUP_K
    return int(k) if k.isdigit() else -1
