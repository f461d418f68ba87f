"""
The embedded demo model, assets/tinyllama-pydoc, judged against transformers: it loads there, its
logits agree with ours, and our plain greedy decoding reproduces the golden ids that transformers'
generate produced (tools/make_golden.py).
"""
import json
import math
import os

# the model is a local directory; the Hub is never needed
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from model import Transformer  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
DEMO = os.path.join(ROOT, "assets", "tinyllama-pydoc")
with open(os.path.join(ROOT, "tests", "golden_demo.json")) as f:
    GOLDEN = json.load(f)


@pytest.fixture(scope="module")
def ours():
    return Transformer.from_pretrained(DEMO, dtype=torch.float32)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(DEMO)


def test_fits_in_the_repository():
    size = sum(os.path.getsize(os.path.join(DEMO, f)) for f in os.listdir(DEMO))
    assert size < 25e6, f"{DEMO} is {size / 1e6:.1f} MB; the demo model must stay under 25 MB"


def test_gqa(ours):
    # the offload code must see grouped-query attention
    assert ours.args.n_kv_heads < ours.args.n_heads


def test_tokenizer_round_trips(tok):
    assert tok.encode(GOLDEN["prompt"]) == GOLDEN["prompt_ids"]
    # tabs, runs of spaces, bytes not in the vocab
    text = "def f(x):\n\treturn x  # naïve — 東京 🐍\n\n  two  spaces"
    assert tok.decode(tok.encode(text)[1:]) == text


def test_logits_match_transformers(ours):
    from transformers import LlamaForCausalLM
    theirs = LlamaForCausalLM.from_pretrained(DEMO, dtype=torch.float32).eval()
    x = torch.tensor([GOLDEN["prompt_ids"] + GOLDEN["new_ids"]])  # [1, T]
    with torch.no_grad():
        ref = theirs(x).logits  # [1, T, V]
        got = ours(x)           # [1, T, V]
    assert (got - ref).abs().max().item() < 1e-4


def test_greedy_matches_golden(ours, tok):
    ids = list(GOLDEN["prompt_ids"])
    with torch.no_grad():
        for _ in range(len(GOLDEN["new_ids"])):
            # full recompute: the plain reference path
            nxt = int(ours(torch.tensor([ids]))[0, -1].argmax())
            ids.append(nxt)
            if nxt in tok.eos_ids:  # transformers' generate stops at EOS too
                break
    assert ids[len(GOLDEN["prompt_ids"]):] == GOLDEN["new_ids"]


@pytest.mark.parametrize("mode,compress",
                         [("none", "none"), ("cpu", "none"), ("disk", "none"), ("disk", "zstd")])
def test_offloaded_generation_matches_golden(ours, tok, tmp_path, mode, compress):
    """The whole cached, chunked, offloaded path (chunk 8, window 1: most chunks leave the device)
    reproduces transformers' greedy ids: any change to the forward pass or the cache that alters
    output is caught."""
    from offload import OffloadConfig
    from runs.task import run_task
    cfg = OffloadConfig(mode=mode, window=1, compress=compress, offload_dir=str(tmp_path))
    new, stats = run_task(ours, GOLDEN["prompt_ids"], len(GOLDEN["new_ids"]), chunk_size=8,
                          cfg=cfg, eos_ids=tok.eos_ids)
    assert new == GOLDEN["new_ids"]
    if mode == "disk":
        assert stats["chunks"]["disk"] > 0
        assert stats["bytes"]["disk_read"] + stats["bytes"]["disk_mapped_read"] > 0


def test_demo_command_runs_offloaded(tmp_path):
    """`python generate.py` alone: the shipped model, the disk tier in use, text and a statistics
    line."""
    import subprocess
    import sys
    p = subprocess.run([sys.executable, os.path.join(ROOT, "generate.py"),
                        "--offload-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    from runs.generate_cli import DEMO_PROMPT
    # the generated text alone (--echo would print the prompt first)
    assert not p.stdout.startswith(DEMO_PROMPT[:20]) and len(p.stdout.split()) > 20, p.stdout
    stats = p.stderr.strip().splitlines()[-1]
    assert "tok/s" in stats and "chunks device/host/disk" in stats
    disk_chunks = int(stats.split("chunks device/host/disk ")[1].split()[0].split("/")[2])
    assert disk_chunks > 0


def test_the_quote_tune_starts_from_the_demo_and_quotes_its_own_window(ours, tok):
    """tools/train_quote.py: the model it tunes is the demo model (the same logits as
    from_pretrained's), and each window ends with passages that are the window's own text."""
    import argparse
    import sys
    sys.path.insert(0, ROOT)
    from tools.train_quote import load_demo, window
    x = torch.tensor([[1] + tok.encode("The list of built-in functions")])
    with torch.no_grad():  # its projections are not joined: the same sums, maybe not their order
        torch.testing.assert_close(load_demo(DEMO)(x), ours(x))
    sp = tok.tok
    stream = torch.tensor(tok.encode(" ".join(f"word{i} and more" for i in range(400))))
    args = argparse.Namespace(lengths=[300], quote_min=8, quote_max=20, quotes=3)
    ids, at = window(stream, sp, torch.Generator().manual_seed(0), args)
    text = sp.decode(ids[:at - 1].tolist())
    assert ids[at - 1] == sp.piece_to_id("<0x0A>")  # a newline before each passage
    passages = [p.strip() for p in sp.decode(ids[at:].tolist()).split("\n")]
    assert len(passages) == 3 and all(p and p in text for p in passages), passages
    # --synthetic: random tokens, and passages that are their exact spans
    ids, at = window(stream, sp, torch.Generator().manual_seed(1), args, synthetic=True)
    text, newline = ids[:at - 1].tolist(), sp.piece_to_id("<0x0A>")
    assert len(text) == 300 and min(text) >= 3 and max(text) < sp.get_piece_size()
    assert not torch.equal(ids[:at - 1], stream[:300])
    rest, spans = ids[at - 1:].tolist(), []
    for t in rest:
        if t == newline:
            spans.append([])
        else:
            spans[-1].append(t)
    assert len(spans) == 3 and all(8 <= len(q) <= 20 for q in spans)
    assert all(any(text[i:i + len(q)] == q for i in range(300)) for q in spans)


def test_the_quote_score_of_a_model_that_knows_nothing(tok):
    """tools/train_quote.py --eval: a model whose logits are all equal has loss ln V on text and
    passages alike, and its greedy token (id 0, <unk>, which encoding never gives) copies
    nothing."""
    import sys
    sys.path.insert(0, ROOT)
    from tools.train_quote import score
    V = tok.tok.get_piece_size()
    stream = torch.tensor(tok.encode(" ".join(f"word{i} and more" for i in range(400))))
    assert (stream != 0).all()

    def flat(x):  # [1, N] -> [1, N, V], every logit 0
        return torch.zeros(*x.shape, V)
    text, passages, copied = score(flat, stream, tok.tok, 300, windows=2)
    assert abs(text - math.log(V)) < 1e-5 and abs(passages - math.log(V)) < 1e-5
    assert copied == 0
