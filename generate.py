r"""
Long-context generation with an offloaded KV cache: chunked prefill, then decoding, greedy or
sampled.

    python generate.py --ckpt DIR --prompt-file doc.txt --max-new-tokens 256 --chunk-size 512 \
        --window 4 --offload disk

The loop is four free functions, each small enough to time, replace or compile on its own: forward
(one cached step), prefill (the prompt, a chunk at a time), decode_one_token, generate. The command
line lives one layer up, in flags.py (flags, checks, batch mode); running this file runs it.
"""
import ctypes
import ctypes.util
import sys
from dataclasses import dataclass

if __name__ == "__main__":  # Ctrl-C while torch imports: one line, as later (runs/generate_cli.py)
    from runs import interrupt
    interrupt.starting("generate.py")

import torch  # noqa: E402

from kvbatch import BatchedCaches

_LIBC = ctypes.CDLL(ctypes.util.find_library("c"))
_MALLOC_TRIM = getattr(_LIBC, "malloc_trim", None)  # glibc only; elsewhere trim_heap does nothing


# -----------------------------------------------------------------------------
# the loop

@torch.inference_mode()
def forward(model, cache, tokens, decode=False):
    """One cached step: tokens [B, T] that fit in the open chunk -> logits [B, V] of the last
    position. A decode step may read fewer sealed chunks than a prefill step (policy.py)."""
    # bookkeeping: the step fits in the open chunk; the selection plans which chunks it reads
    cache.begin(tokens.shape[1], decode)
    # data: the planned chunks that are off the device start moving in
    cache.store.prefetch(cache.reads())
    # each layer: write k, v into the open chunk, attend over the chunks it reads
    logits = model(tokens, cache, last_only=True)
    if cache.commit():  # the open chunk is full:
        # data: it joins the window; the chunk the placement evicts leaves the device
        cache.store.seal(cache.n_sealed - 1)
    return logits[:, -1]


def prefill(model, cache, ids, on_step=None, step=None):
    """Feed ids [B, T] at most chunk_size tokens at a time, aligned to chunk boundaries, so the
    activations of a long prompt never exist at once. Returns the logits [B, V] of the last
    position. on_step(phase, logits, cache) runs after every step, here and in generate(). step:
    what runs a step (default forward; a batch's tasks run theirs through batcher.Batcher)."""
    step = step or forward
    t = 0
    C = cache.chunk_size
    while t < ids.shape[1]:
        n = min(C - cache.length % C, ids.shape[1] - t)
        logits = step(model, cache, ids[:, t:t + n])
        t += n
        trim_heap()
        if on_step:
            on_step("prefill", logits, cache)
    return logits


def trim_heap():
    """Give the heap's free pages back to the OS (glibc's malloc_trim). A prefill step frees a
    chunk's activations, tens of MiB that glibc keeps (its mmap threshold rises with every large
    free), so the process would hold a varying heap high-water mark on top of what it uses; once per
    prefill chunk it costs well under 1% of the step."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def decode_one_token(model, cache, token, step=None):
    """token [B, 1] -> logits [B, V] of the next position."""
    step = step or forward
    return step(model, cache, token, decode=True)


@torch.inference_mode()
def decode_batch(model, caches, tokens):
    """A decode step of N tasks at once: tokens [N, 1], row i the next token of the task whose
    cache is caches[i] -> logits [N, V]. The embedding, the norms and every linear see N rows, so
    each weight is read once for N tokens (rowwise.py keeps every row's bits its own); attention
    reads each task's own chunks, every task's in one kernel call a layer where their caches share
    an arena (kvbatch.py). Row i's logits are the bits decode_one_token gives
    task i alone. A task whose store fails as its chunk seals is reported, not raised:
    returns (logits [N, V], {i: the exception})."""
    for cache in caches:
        cache.begin(1, decode=True)
        cache.store.prefetch(cache.reads())
    logits = model(tokens, BatchedCaches(caches), last_only=True)
    failed = {}
    for i, cache in enumerate(caches):
        if cache.commit():
            try:
                cache.store.seal(cache.n_sealed - 1)
            except Exception as e:  # this task's tiers; the others' steps are done and stand
                failed[i] = e
    return logits[:, -1], failed


# |seed| below this keeps seed * 1_000_003 + position (sample's generator seed) inside the 64-bit
# range torch takes
SEED_LIMIT = 2**43
# the smallest temperature but 0 (greedy): logits / T must stay finite in fp32, and a temperature
# below this samples as greedy anyway
MIN_TEMPERATURE = 1e-6


@dataclass
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0            # 0 = no top-k cut
    top_p: float = 1.0        # 1 = no nucleus cut
    # each step draws from its own generator seeded by (seed, position): reproducible
    seed: int = 0


def sample(logits, s, position):
    """logits [B, V] fp32 -> next token ids [B, 1]."""
    if s.temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float().cpu() / s.temperature
    if s.top_k > 0:
        kth = torch.topk(logits, min(s.top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if s.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p
        drop = sorted_p.cumsum(-1) - sorted_p > s.top_p
        probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
    g = torch.Generator().manual_seed(s.seed * 1_000_003 + position)
    return torch.multinomial(probs, 1, generator=g)  # [B, 1] on the CPU; the caller moves it


def generate(model, cache, prompt_ids, max_new_tokens, sampling=Sampling(), eos_ids=(),
             on_token=None, on_step=None, replay=(), share=None, step=None):
    """prompt_ids [1, P] -> list of new token ids. Stops at an EOS id or after max_new_tokens.

    Resuming: the cache may already hold positions [0, cache.length) restored from disk, and
    `replay` the tokens generated before the interruption. Positions past the restored ones are
    recomputed with the first run's schedule (prompt positions a chunk at a time, generated ones one
    at a time), so the output is bit-identical. step: what runs each forward step (see prefill)."""
    P = prompt_ids.shape[1]
    out = list(replay)
    logits = None
    if cache.length < P:
        logits = prefill(model, cache, prompt_ids[:, cache.length:], on_step, step)
    # replay the generated tokens not restored
    for pos in range(max(cache.length, P), P + len(out)):
        token = prompt_ids.new_tensor([[out[pos - P]]])
        logits = decode_one_token(model, cache, token, step)
    while len(out) < max_new_tokens and not (out and out[-1] in eos_ids):
        token = sample(logits, sampling, cache.length).to(prompt_ids.device)  # [1, 1]
        if share:  # tensor parallel: every rank continues with rank 0's token (tp.broadcast_token)
            token = share(token)
        out.append(token.item())
        if on_token:
            on_token(out)
        if out[-1] in eos_ids or len(out) == max_new_tokens:
            break
        logits = decode_one_token(model, cache, token, step)
        if on_step:
            on_step("decode", logits, cache)
    return out


# the command line lives with the operations (runs/generate_cli.py); this file stays importable on
# its own
if __name__ == "__main__":
    # the operations import this very module, not a second copy of it
    sys.modules["generate"] = sys.modules["__main__"]
    from runs import generate_cli, launch
    interrupt.started()  # started: a late Ctrl-C is the run's, never "interrupted while starting"
    code = generate_cli.main()
    interrupt.finished()  # a stop signal during shutdown: ignored, never a traceback
    launch.exit(code)
