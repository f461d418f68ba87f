r"""
The proof that offload changes where the bytes of the KV cache live, not the math.

    python verify.py --ckpt DIR --max-new-tokens 32 --chunk-size 64 --window 2 \
        --modes cpu,disk,disk+zstd

Greedy generation with --offload none, then with each mode, on the same prompt and chunk size; the
generated ids and the logits of every forward step are compared bit for bit. Then the model
runs once unchunked and uncached (plain causal attention over prompt + generated tokens): its greedy
ids must agree, and the largest logit difference is reported (not bit-identical: a different
kernel schedule rounds differently). This file is the proof alone, on the core; its command line
and its extra modes (torchrun, --kv-store, --batch, --diagnose) are runs/proofs.py.
Exit 0: all bit-identical; 1: a mismatch (the first differing step is named); 2: bad usage.
"""
import pydoc_data.topics
import sys
import time

if __name__ == "__main__":  # Ctrl-C while torch imports: one line, as later (the __main__ below)
    from runs import interrupt
    interrupt.starting("verify.py")

import torch  # noqa: E402

import speculate  # noqa: E402
from generate import Sampling, generate  # noqa: E402
from kvcache import make_cache  # noqa: E402

# real English text that every Python installation carries: the reference manual's pages on a few
# statements
DEFAULT_TOPICS = ("with", "try", "for", "while", "if", "assignment")
DEFAULT_PROMPT = "\n\n".join(pydoc_data.topics.topics[t] for t in DEFAULT_TOPICS)


def run_mode(model, ids, max_new, chunk_size, cfg, kv_dtype="auto", share=None,
             sampling=Sampling(), speculator=None):
    """Greedy generation (or as `sampling` says) of max_new tokens after the prompt `ids` (a
    list), its KV stored as the OffloadConfig `cfg` says. Returns (new ids, [(position, phase,
    logits [V]), ...], stats). share: under tensor parallelism, what makes rank 0's token
    everyone's. speculator: decode with its guesses checked in verify steps (speculate.py), which
    must change nothing."""
    steps = []
    clock = {"t": time.perf_counter(), "decode_s": 0.0}

    def on_step(phase, logits, cache):
        steps.append((cache.length - 1, phase, logits[0].cpu()))
        now = time.perf_counter()
        if phase == "decode":
            clock["decode_s"] += now - clock["t"]
        clock["t"] = now

    # a chunk longer than the task is cut to it, as task.run_task does
    chunk_size = min(chunk_size, len(ids) + max_new)
    cache = make_cache(model, cfg, chunk_size, len(ids) + max_new, kv_dtype=kv_dtype)
    prompt = torch.tensor([ids], device=cache.store.device)  # [1, P]
    try:
        if speculator is None:
            new = generate(model, cache, prompt, max_new, sampling, on_step=on_step, share=share)
        else:
            new = speculate.generate(model, cache, prompt, max_new, sampling, on_step=on_step,
                                     speculator=speculator, pace=speculate.Pace(timed=False))
        snap = cache.store.snapshot()
    finally:
        cache.store.close()
    decoded = sum(phase == "decode" for _, phase, _ in steps)
    stats = {"chunks": snap["chunks"], "bytes": snap["bytes"],
             "decode_tokens_per_s": decoded / clock["decode_s"] if clock["decode_s"] else 0.0,
             "chunks_read_per_decode_step": cache.decode_chunks / max(1, cache.decode_steps),
             "reused_tokens": 0}
    if speculator is not None:
        stats["speculation"] = speculate.summary(speculator.stats)
    return new, steps, stats


def decode_positions(steps):
    return [pos for pos, phase, _ in steps if phase == "decode"]


def compare(base, other):
    """First difference between two runs, or None: (step, position, phase, what). Steps are matched
    by position: a run that reused stored prompt chunks (--kv-store) has no prefill steps for them,
    and must match the rest."""
    ids_a, steps_a, _ = base
    ids_b, steps_b, _ = other
    by_pos = {pos: la for pos, _, la in steps_a}
    for i, (pos, phase, lb) in enumerate(steps_b):
        la = by_pos.get(pos)
        if la is None:
            return i, pos, phase, "a step the reference never ran"
        if not same_bits(la, lb):
            return i, pos, phase, f"logits differ (max |diff| {(la - lb).abs().max().item():.3g})"
    if decode_positions(steps_a) != decode_positions(steps_b) or ids_a != ids_b:
        return len(steps_b), None, "decode", f"generated ids differ: {ids_a} vs {ids_b}"
    return None


def same_bits(a, b):
    """Whether two tensors hold the same bits: torch.equal on integer views, so that a NaN (a model
    that overflows in its dtype) equals the same NaN, as the bytes do."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    as_int = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.view(as_int), b.view(as_int))


def prove(model, ids, max_new, chunk_size, cfgs, kv_dtype="auto", share=None):
    """Every configuration of `cfgs` (a dict: name -> OffloadConfig, "none" first, the reference)
    run on the same prompt: {name: (new ids, steps, stats)}, and per name its first difference from
    "none" (None: bit-identical)."""
    runs = {name: run_mode(model, ids, max_new, chunk_size, cfg, kv_dtype, share)
            for name, cfg in cfgs.items()}
    diffs = {name: None if name == "none" else compare(runs["none"], run)
             for name, run in runs.items()}
    return runs, diffs


@torch.inference_mode()
def unchunked(model, ids, reference):
    """The unchunked, uncached model over prompt + generated tokens, against the reference run:
    (its greedy ids equal, their top-1 agreement, the largest |logit difference| of any step)."""
    new, steps, _ = reference
    full = torch.tensor([ids + new[:-1]], device=model.output.weight.device)  # [1, P + N - 1]
    ref = model(full)[0].cpu()                                               # [P + N - 1, V]
    ref_ids = ref[len(ids) - 1:].argmax(-1).tolist()
    diff = max((ref[pos] - logits).abs().max().item() for pos, _, logits in steps)
    agree = sum(a == b for a, b in zip(ref_ids, new)) / len(new)
    return ref_ids == new, agree, diff


if __name__ == "__main__":
    # the command line lives with the operations; they import this very module, not a second copy
    sys.modules["verify"] = sys.modules["__main__"]
    if "--diagnose" in sys.argv[1:]:  # the alias: the troubleshooting chains are a command now
        from measure import doctor
        interrupt.started()
        try:
            sys.exit(doctor.main([a for a in sys.argv[1:] if a != "--diagnose"]))
        except KeyboardInterrupt as e:
            sys.exit(interrupt.ended("doctor.py", e))
    try:
        from runs import launch, proofs
        # from here Ctrl-C (SIGTERM, SIGHUP) raises KeyboardInterrupt, so the runs' finally blocks
        # close their stores
        interrupt.started()
        code = proofs.main()
    except KeyboardInterrupt as e:
        sys.exit(interrupt.ended("verify.py", e))
    interrupt.finished()  # a stop signal during shutdown: ignored, never a traceback
    launch.exit(code)
