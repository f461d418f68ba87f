"""The hand-built copier (measure/copier.py) quotes its document, its extra layers add nothing, and
prompt lookup keeps several guesses a step on it, bit-identically."""
import os
import stat

import pytest
import torch

import speculate
from generate import Sampling, generate
from kvcache import make_cache
from measure.copier import build_copier
from model import Transformer
from offload import OffloadConfig
from runs.task import run_task

SHAPE = dict(dim=576, heads=9, kv_heads=3, head_dim=64, hidden=256)


@pytest.fixture(scope="module")
def copiers(tmp_path_factory):
    root = tmp_path_factory.mktemp("copier")
    return {n: build_copier(str(root / f"l{n}"), layers=n, dtype=torch.float32, **SHAPE)
            for n in (2, 3)}


def document(n, seed=0, vocab=4096):
    """n random tokens (ids 3..vocab-1): almost every bigram in it is unique."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


@torch.inference_mode()
def test_the_copier_continues_a_passage_of_its_document(copiers):
    model = Transformer.from_pretrained(copiers[2], dtype=torch.float32)
    doc = document(1500)
    start = 700
    ids = doc + doc[start:start + 200]  # the passage again: each next token is the document's
    logits = model(torch.tensor([ids]))[0]  # [T, V]
    predicted = logits[len(doc):-1].argmax(-1)
    truth = torch.tensor(ids[len(doc) + 1:])
    assert (predicted == truth).float().mean() >= 0.98
    first = logits[len(doc) + 2].argmax().item()  # and nothing like it in the document's own text
    assert first == doc[start + 3]
    ahead = logits[200:len(doc) - 1].argmax(-1)  # before any repeat there is nothing to copy
    assert (ahead == torch.tensor(doc[201:len(doc)])).float().mean() < 0.05


@torch.inference_mode()
def test_the_layers_past_the_second_leave_the_logits_as_they_are(copiers):
    ids = torch.tensor([document(300, seed=1)])
    two = Transformer.from_pretrained(copiers[2], dtype=torch.float32)(ids)
    three = Transformer.from_pretrained(copiers[3], dtype=torch.float32)(ids)
    assert torch.equal(two, three)


def test_the_copier_is_written_private_and_refuses_a_shape_it_cannot_hold(copiers, tmp_path):
    for name in os.listdir(copiers[2]):
        assert stat.S_IMODE(os.stat(os.path.join(copiers[2], name)).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(copiers[2]).st_mode) == 0o700
    with pytest.raises(ValueError, match="at least 2 kv heads"):
        build_copier(str(tmp_path / "x"), layers=2, heads=4, kv_heads=1, **{
            k: v for k, v in SHAPE.items() if k not in ("heads", "kv_heads")})


def test_lookup_keeps_several_guesses_a_step_on_the_copier_and_changes_nothing(copiers, tmp_path):
    model = Transformer.from_pretrained(copiers[2], dtype=torch.float32)
    doc = document(600, seed=2)
    prompt = doc + doc[100:116]  # the opening of a passage: the copier quotes on from there
    cfg = OffloadConfig(mode="none")
    runs = {}
    for k in (None, 6):
        runs[k] = run_task(model, prompt, 40, chunk_size=64, cfg=cfg, sampling=Sampling(),
                           speculation=None if k is None else (lambda c, m: speculate.Lookup(6)))
    plain, spec = runs[None], runs[6]
    assert spec[0] == plain[0]
    assert plain[0][:30] == doc[116:146]
    assert spec[1]["speculation"]["tokens_per_step"] >= 3


@torch.inference_mode()
def test_through_the_disk_tier_in_bf16_every_kept_guess_has_one_token_decodings_bits(copiers,
                                                                                    tmp_path):
    """Most guesses kept, verify steps cut at chunk ends, and each position's logits the bits of
    the one-token loop's (generate.generate) with every sealed chunk but one on disk."""
    model = Transformer.from_pretrained(copiers[2], dtype=torch.bfloat16)
    doc = document(600, seed=3)
    prompt = torch.tensor([doc + doc[200:216]])  # 616 tokens: the steps cross 640 and 704
    runs = []
    for guesser in (None, speculate.Lookup(6)):
        steps = []
        disk = tmp_path / f"kv{len(runs)}"
        disk.mkdir(mode=0o700)
        (disk / "t").mkdir(mode=0o700)
        cfg = OffloadConfig(mode="disk", window=1, offload_dir=str(disk), cpu_budget_gib=0)
        cache = make_cache(model, cfg, 64, prompt.shape[1] + 100, disk_path=str(disk / "t"))

        def on_step(phase, logits, cache):
            steps.append((cache.length - 1, logits[0].clone()))
        try:
            if guesser is None:
                out = generate(model, cache, prompt, 100, Sampling(), (), on_step=on_step)
            else:
                out = speculate.generate(model, cache, prompt, 100, Sampling(), (),
                                         on_step=on_step, speculator=guesser,
                                         pace=speculate.Pace(timed=False))
        finally:
            cache.store.close()
        runs.append((out, steps))
    (plain, plain_steps), (spec, spec_steps) = runs
    assert spec == plain
    assert [p for p, _ in spec_steps] == [p for p, _ in plain_steps]
    for (pos, a), (_, b) in zip(plain_steps, spec_steps):
        assert torch.equal(a, b), f"position {pos}: logits differ"
    assert guesser.stats["kept"] >= 0.8 * guesser.stats["proposed"]
    assert guesser.stats["tokens"] / guesser.stats["steps"] >= 3
