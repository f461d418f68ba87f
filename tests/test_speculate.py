"""
Speculative decoding (speculate.py) changes nothing: with --speculate lookup or a --draft, the ids
and the logits of every position are the bits one-token decoding gives, on every tier, greedy and
sampled, fp32 and bf16, sliding windows and quantized KV; guesses cut at chunk ends, an EOS among
the kept guesses, --max-new-tokens reached inside a verify step, and a resume after a crash in the
middle of generation. The reference is generate.generate, the one-token loop, run beside it.

The guessers: the model itself as its own draft (every guess kept, so verify steps run up to each
chunk's end), another random model of the same vocabulary (some kept, some rejected), and prompt
lookup (a random model's greedy text falls into loops that lookup finds).
"""
import json
import os

import pytest
import torch

import fewrows
import speculate
from generate import Sampling, generate
from kvcache import make_cache
from model import Transformer
from offload import OffloadConfig
from runs import generate_cli
from runs.task import run_task
from runs.taskdir import safe_task_name

C = 8     # chunk size: a verify step meets a chunk's end every few steps
P = 37    # prompt tokens: four full chunks and an open one
NEW = 40
SAMPLED = Sampling(temperature=0.9, seed=3)


@pytest.fixture(scope="module")
def models(checkpoint):
    """{dtype: (model, another model of the same vocabulary)}."""
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        out[dtype] = (Transformer.from_pretrained(checkpoint(), dtype=dtype),
                      Transformer.from_pretrained(checkpoint(seed=1), dtype=dtype))
    return out


def prompt(n=P, seed=0):
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def config(mode, tmp_path):
    if mode == "disk":
        d = tmp_path / "kv"
        d.mkdir(mode=0o700, exist_ok=True)
        return OffloadConfig(mode="disk", window=1, offload_dir=str(d), cpu_budget_gib=0)
    return OffloadConfig(mode=mode, window=1)


def run(model, ids, mode, tmp_path, guesser=None, sampling=Sampling(), eos=(), new=NEW,
        kv_dtype="auto", pace=None):
    """(new ids, [(position, logits [V])...] of every forward step, the cache's final length,
    its sealed chunks' bytes)."""
    steps = []

    def on_step(phase, logits, cache):
        steps.append((cache.length - 1, logits[0].clone()))
    disk = None
    if mode == "disk":
        disk = str(tmp_path / f"task{len(os.listdir(tmp_path))}")
        os.mkdir(disk, 0o700)
    cache = make_cache(model, config(mode, tmp_path), C, len(ids) + new, disk_path=disk,
                       kv_dtype=kv_dtype)
    x = torch.tensor([ids])
    try:
        if guesser is None:
            out = generate(model, cache, x, new, sampling, eos, on_step=on_step)
        else:
            out = speculate.generate(model, cache, x, new, sampling, eos, on_step=on_step,
                                     speculator=guesser, pace=pace or speculate.Pace(timed=False))
        host = torch.empty(cache.store.shape, dtype=cache.store.dtype)
        sealed = []
        for j in range(cache.n_sealed):
            for layer in range(model.args.n_layers):
                cache.store.read_back(layer, j, host)
                sealed.append(host.clone())
    finally:
        cache.store.close()
    return out, steps, cache.length, sealed


def assert_same(a, b):
    out_a, steps_a, length_a, sealed_a = a
    out_b, steps_b, length_b, sealed_b = b
    assert out_b == out_a
    assert [p for p, _ in steps_b] == [p for p, _ in steps_a]
    for (pos, la), (_, lb) in zip(steps_a, steps_b):
        assert torch.equal(la, lb), f"position {pos}: logits differ"
    assert length_b == length_a
    # the rejected rows never reached a sealed chunk: every sealed chunk holds the same bytes
    assert len(sealed_b) == len(sealed_a)
    assert all(torch.equal(x, y) for x, y in zip(sealed_a, sealed_b))


def guessers(models, dtype, name):
    model, other = models[dtype]
    return {"self": lambda: speculate.Draft(model, 5, C, P + NEW),
            "other": lambda: speculate.Draft(other, 3, C, P + NEW),
            "lookup": lambda: speculate.Lookup(6)}[name]()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["none", "cpu", "disk"])
@pytest.mark.parametrize("name", ["self", "other", "lookup"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_ids_and_every_logit_equal_one_token_decoding(models, tmp_path, dtype, mode, name,
                                                      sampled):
    model = models[dtype][0]
    sampling = SAMPLED if sampled else Sampling()
    ids = prompt()
    if name == "lookup":  # a text that repeats itself, sampled cool: lookup finds something
        ids = (ids[:12] * 4)[:P]
        sampling = Sampling(temperature=0.2, seed=3) if sampled else sampling
    reference = run(model, ids, "none", tmp_path, sampling=sampling)
    g = guessers(models, dtype, name)
    assert_same(reference, run(model, ids, mode, tmp_path, g, sampling))
    stats = g.stats
    assert stats["proposed"] > 0 and stats["tokens"] == NEW - 1
    if name == "self" and not sampled:  # its own guesses, all kept: steps up to each chunk's end
        assert stats["kept"] == stats["proposed"] and stats["tokens"] / stats["steps"] > 2


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
@pytest.mark.parametrize("name", ["self", "other"])
def test_quantized_kv(models, tmp_path, kv_dtype, name):
    model = models[torch.float32][0]
    ids = prompt()
    reference = run(model, ids, "none", tmp_path, kv_dtype=kv_dtype)
    got = run(model, ids, "disk", tmp_path, guessers(models, torch.float32, name),
              kv_dtype=kv_dtype)
    assert_same(reference, got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rows_together_and_apart_give_the_same_bits(models, tmp_path, monkeypatch, dtype):
    """A verify step's rows visit a chunk group in one call where rowwise.shared_rows vouches for
    it, one call each otherwise: both are one-token decoding's bits."""
    model = models[dtype][0]
    ids = prompt()
    reference = run(model, ids, "none", tmp_path)
    together = run(model, ids, "cpu", tmp_path, guessers(models, dtype, "self"))
    assert_same(reference, together)
    asked = []
    monkeypatch.setattr(speculate, "shared_rows", lambda *a: asked.append(a) and False)
    apart = run(model, ids, "cpu", tmp_path, guessers(models, dtype, "self"))
    assert_same(reference, apart)
    assert asked  # the step asked, and went a row at a time


@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32, "auto"), (torch.float32, "bf16"),
                                            (torch.bfloat16, "fp16"), (torch.float16, "bf16")])
def test_sliding_window(checkpoint, tmp_path, dtype, kv_dtype):
    """A verify step's rows see different windows: each row visits and masks what its own step
    would, reading each chunk as it does (a half-precision KV of another dtype than the weights'
    included: a cast on the way to attention changed bits)."""
    model = Transformer.from_pretrained(checkpoint(arch="mistral", sliding_window=12),
                                        dtype=dtype)
    ids = prompt()
    reference = run(model, ids, "none", tmp_path, kv_dtype=kv_dtype)
    # the random model's greedy text repeats its prompt in fp32 only: lookup proposes there
    lookup = [speculate.Lookup(4)] if kv_dtype == "auto" else []
    for g in (speculate.Draft(model, 5, C, P + NEW), speculate.Draft(model, 2, C, P + NEW),
              *lookup):
        assert_same(reference, run(model, ids, "disk", tmp_path, g, kv_dtype=kv_dtype))
        assert g.stats["proposed"] > 0


def test_eos_inside_the_kept_guesses(models, tmp_path):
    model = models[torch.float32][0]
    ids = prompt()
    free, *_ = run(model, ids, "none", tmp_path)
    for at in (3, 9, 17):  # an EOS that a verify step of the model's own guesses meets
        eos = {free[at]}
        reference = run(model, ids, "none", tmp_path, eos=eos)
        assert reference[0][-1] in eos and len(reference[0]) < NEW
        assert_same(reference, run(model, ids, "cpu", tmp_path,
                                   speculate.Draft(model, 6, C, P + NEW), eos=eos))


@pytest.mark.parametrize("new", range(1, 12))
def test_max_new_tokens_inside_a_verify_step(models, tmp_path, new):
    model = models[torch.float32][0]
    ids = prompt()
    reference = run(model, ids, "none", tmp_path, new=new)
    assert_same(reference, run(model, ids, "disk", tmp_path,
                               speculate.Draft(model, 6, C, P + new), new=new))


def test_draft_rolls_back_and_matches_a_fresh_draft(models):
    """The draft's own cache after rejections: its next guesses are a fresh draft's on the same
    text."""
    model, other = models[torch.float32]
    text = prompt(20)
    d = speculate.Draft(other, 4, C, 64)
    first = d.propose(text, 4)
    kept = text + first[:1] + [(first[1] + 1) % 128]  # one kept, then the model's own token
    assert d.propose(kept, 4) == speculate.Draft(other, 4, C, 64).propose(kept, 4)


def test_lookup_finds_the_longest_recent_match():
    g = speculate.Lookup(3)
    text = [5, 6, 7, 8, 9, 1, 6, 7, 4, 2, 5, 6, 7]
    # 5 6 7 occurred at 0 (then 8 9 1); 6 7 alone more recently (then 4 2 5)
    assert g.propose(text, 3) == [8, 9, 1]
    assert g.propose(text + [3], 3) == []
    assert speculate.Lookup(2).propose([1, 2, 1, 2], 2) == [1, 2]


@pytest.mark.parametrize("verify_cost", [0.5, 50.0])
def test_pace_stops_guessing_where_verify_steps_do_not_pay(models, tmp_path, monkeypatch,
                                                           verify_cost):
    """Pace holds each verify step to the plain steps' time per token, on a clock of its own: a
    one-token step (plain, or the draft's) costs 1, a verify step verify_cost. The model is its own
    draft, so every guess is kept and a verify step of 5 guesses costs 4 draft steps and itself:
    at 0.5 it gives 6 tokens for 4.5 and pays, and guessing goes on; at 50 none pays, whatever it
    kept, and the backoff leaves a handful of verify steps. The output is the same either way."""
    model = models[torch.float32][0]
    ids = prompt()
    reference = run(model, ids, "none", tmp_path)
    clock = [0.0]
    verify_steps = []

    def costing(fn, cost, calls=None):
        def step(*args, **kw):
            clock[0] += cost
            if calls is not None:
                calls.append(1)
            return fn(*args, **kw)
        return step
    kept = []  # each verify step's kept positions, as it commits them
    commit = speculate.commit
    monkeypatch.setattr(speculate, "commit", lambda cache, n: (kept.append(n), commit(cache, n)))
    monkeypatch.setattr(speculate, "decode_one_token", costing(speculate.decode_one_token, 1.0))
    monkeypatch.setattr(speculate, "verify_step",
                        costing(speculate.verify_step, verify_cost, verify_steps))
    g = guessers(models, torch.float32, "self")
    pace = speculate.Pace(clock=lambda: clock[0])
    pace.plain.extend([1.0] * speculate.PACE_STEPS)  # as if plain steps of 1 had been timed
    assert_same(reference, run(model, ids, "none", tmp_path, g, pace=pace))
    assert len(kept) == len(verify_steps) > 0
    assert all(n > 1 for n in kept)  # its own guesses: some kept in every verify step
    if verify_cost < 1:  # every one paid: guessing never paused
        assert g.stats["unpaid"] == 0 and len(kept) > 6
    else:  # none paid, whatever they kept: 1, 2, 4, 8 ... plain steps between them
        assert g.stats["unpaid"] == len(kept) <= 6 and g.stats["steps"] > len(kept)


class Crash(Exception):
    pass


def test_resume_after_a_crash_mid_generation(models, tmp_path):
    """A task killed while speculating: its manifest vouches only for kept tokens, and the rerun
    resumes from the disk tier and ends with the uninterrupted output."""
    model = models[torch.float32][0]
    ids = prompt(50)
    d = tmp_path / "kv"
    d.mkdir(mode=0o700)
    cfg = OffloadConfig(mode="disk", window=1, offload_dir=str(d), keep_files=True)
    reference, _ = run_task(model, ids, NEW, chunk_size=C, cfg=OffloadConfig())

    def speculation(chunk_size, max_length):
        return speculate.Draft(models[torch.float32][1], 4, chunk_size, max_length)

    def crash(out):
        if len(out) == 23:
            raise Crash()
    with pytest.raises(Crash):
        run_task(model, ids, NEW, chunk_size=C, cfg=cfg, task_id="t", fingerprint="fp",
                 on_token=crash, speculation=speculation)
    manifest = json.loads((d / safe_task_name("t") / "manifest.json").read_text())
    vouched = manifest["tokens"][len(ids):]
    assert vouched and vouched == reference[:len(vouched)]
    new, stats = run_task(model, ids, NEW, chunk_size=C, cfg=cfg, task_id="t", fingerprint="fp",
                          speculation=speculation)
    assert stats["resumed_from"] > len(ids)
    assert new == reference
    assert stats["speculation"]["verify_steps"] > 0


@pytest.mark.parametrize("argv,says", [
    (["--speculate", "lookup:0"], "--speculate must be lookup or lookup:K"),
    (["--speculate", "lookup:99"], "--speculate must be lookup or lookup:K"),
    (["--speculate", "ngram"], "--speculate must be lookup or lookup:K"),
    (["--draft-tokens", "3"], "--draft-tokens goes with --draft"),
    (["--speculate", "lookup", "--select", "quest", "--select-budget", "512"], "drop --select"),
    (["--draft", "DRAFT", "--draft-tokens", "0"], "--draft-tokens must be from 1"),
    (["--draft", "OTHER_VOCAB"], "tokens, the model's 400; a draft must share"),
    (["--draft", "/nonexistent"], "no such directory"),
    (["--draft", os.path.join(os.path.dirname(__file__), "ckpt.py")], "is not a directory"),
    (["--speculate", "lookup:"], "--speculate must be lookup or lookup:K"),
])
def test_refusals_are_one_sentence(text_ckpt, checkpoint, capsys, argv, says):
    other = checkpoint(vocab_size=96)
    argv = [{"DRAFT": text_ckpt, "OTHER_VOCAB": other}.get(a, a) for a in argv]
    capsys.readouterr()
    rc = generate_cli.main(["--ckpt", text_ckpt, "--prompt", "hello", "--max-new-tokens", "4",
                            "--offload", "none", *argv])
    err = capsys.readouterr().err
    assert rc == 2
    assert says in err and len(err.strip().splitlines()) == 1, err


def test_generate_json_reports_speculation(text_ckpt, capsys):
    capsys.readouterr()
    rc = generate_cli.main(["--ckpt", text_ckpt, "--prompt", "the cat sat on the mat " * 6,
                            "--max-new-tokens", "24", "--offload", "none", "--chunk-size", "16",
                            "--speculate", "lookup:4", "--json"])
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    spec = result["stats"]["speculation"]
    assert spec["speculate"] == "lookup:4" and spec["verify_steps"] >= 1
    assert result["config"]["speculate"] == "lookup:4"


@pytest.mark.parametrize("guesser", [["--speculate", "lookup:3"], ["--draft", "SELF"]])
def test_verify_py_proves_speculation_in_every_mode(text_ckpt, tmp_path, capsys, guesser):
    from runs import proofs
    d = tmp_path / "kv"
    d.mkdir(mode=0o700)
    guesser = [text_ckpt if a == "SELF" else a for a in guesser]
    capsys.readouterr()
    rc = proofs.main(["--ckpt", text_ckpt, "--max-new-tokens", "12", "--chunk-size", "8",
                      "--window", "1", "--max-prompt-tokens", "60", "--modes", "cpu,disk",
                      "--offload-dir", str(d), *guesser])
    out = capsys.readouterr().out
    assert rc == 0, out
    for mode in ("none", "cpu", "disk"):
        assert f"{mode}+spec " in out and f"{mode}+spec sampled" in out
    assert "DIFFERENT" not in out and "OK: every mode" in out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_compiled_attention_keeps_every_mode_and_guess_bit_identical(models, tmp_path,
                                                                         monkeypatch, dtype):
    """--attention compiled (fewrows.few_rows built by inductor): plain decoding through
    every tier, and speculation by the model itself and by lookup, give the bits of plain
    decoding with --offload none; a verify step's rows share a group's call (its rows are their
    own bits by construction)."""
    monkeypatch.setattr(fewrows, "KERNEL", "compiled")
    model = models[dtype][0]
    G = model.args.n_kv_heads
    if fewrows.few_rows_kernel(torch.zeros(1, G, 3, model.args.head_dim, dtype=dtype),
                                 torch.zeros(1, 1, G, C, model.args.head_dim, dtype=dtype)) is None:
        pytest.skip("inductor cannot build the kernel here")
    ids = prompt()
    reference = run(model, ids, "none", tmp_path)
    monkeypatch.setattr(fewrows, "KERNEL", "flash")
    flash = run(model, ids, "none", tmp_path)
    monkeypatch.setattr(fewrows, "KERNEL", "compiled")
    # the kernel is in effect: its sums are not the fused kernel's
    assert not all(torch.equal(a[1], b[1]) for a, b in zip(reference[1], flash[1]))
    shared = []
    real = speculate.shared_rows
    monkeypatch.setattr(speculate, "shared_rows", lambda *a: shared.append(real(*a)) or shared[-1])
    for mode in ("none", "cpu", "disk"):
        assert_same(reference, run(model, ids, mode, tmp_path))
        assert_same(reference, run(model, ids, mode, tmp_path, guessers(models, dtype, "self")))
        lookup_ids = (ids[:12] * 4)[:P]
        assert_same(run(model, lookup_ids, "none", tmp_path),
                    run(model, lookup_ids, mode, tmp_path, guessers(models, dtype, "lookup")))
    assert shared and all(shared)
