"""
Teach the demo model to quote its context at long range: a short fine-tune of
assets/tinyllama-pydoc on long windows of its own corpus, each ending with a passage copied from
earlier in the window (the way an answer quotes its document), so that speculation's document
tasks can be measured at ~6K tokens on a model that does quote there. The shipped demo model was
trained on 256-token windows and at 6K it rarely repeats its document (docs/speculation.md); a
pretrained model of the size this project targets does. CPU, fp32, deterministic given --seed.

    python tools/train_quote.py --out /tmp/demo-quote            # ~25 min on two cores
    python tools/train_quote.py --eval /tmp/demo-quote --lengths 1024,6144   # does it quote?
    python tools/speculation.py --ckpt /tmp/demo-quote --tasks quote,free --contexts 6144

A window is S tokens of the training stream (S drawn from --lengths), then --quotes passages of
--quote-min to --quote-max tokens from anywhere in it, each after a newline and re-encoded from its
text, as a prompt that quotes a document would be. The loss is the mean over the window's text plus
the mean over the passages, so that quoting is learnt without unlearning the text. Writes a Hugging
Face directory (the demo's tokenizer and config, the tuned weights) that model.py loads.
"""
import argparse
import json
import os
import shutil
import sys
import time

import sentencepiece as spm
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from checkpoint import hf_to_ours, read_config  # noqa: E402
from model import ModelArgs, Transformer  # noqa: E402
from tools.train_demo import corpus, encode, save_hf, split  # noqa: E402

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets",
                    "tinyllama-pydoc")


def load_demo(path):
    """The demo model as a trainable Transformer (fp32, its projections not joined)."""
    model_args = ModelArgs.from_config(*read_config(path))
    model = Transformer(model_args)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    state = {hf_to_ours(k, model_args): v.float() for k, v in tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("inv_freq" in k for k in missing), (missing, unexpected)
    return model


def window(stream, sp, gen, args, synthetic=False):
    """(ids [S + ...], where the passages start): S tokens of text, then --quotes passages of that
    text, each after a newline and re-encoded from its text. synthetic: the S tokens are drawn
    uniformly from the vocabulary and the passages are their exact spans, so only copying
    predicts them (the task that grows induction heads fastest, Olsson et al.)."""
    S = args.lengths[int(torch.randint(len(args.lengths), (1,), generator=gen))]
    if synthetic:
        text = torch.randint(3, sp.get_piece_size(), (S,), generator=gen).tolist()
    else:
        start = int(torch.randint(0, len(stream) - S - 1, (1,), generator=gen))
        text = stream[start:start + S].tolist()
    sep = [sp.piece_to_id("<0x0A>")]  # a newline (byte fallback's piece)
    quotes = []
    for _ in range(args.quotes):
        Q = int(torch.randint(args.quote_min, args.quote_max + 1, (1,), generator=gen))
        at = int(torch.randint(0, S - Q, (1,), generator=gen))
        span = text[at:at + Q]
        quotes += sep + (span if synthetic else sp.encode(sp.decode(span))[:Q])
    return torch.tensor(text + quotes), S + len(sep)


def next_token_losses(model, ids):
    """(logits [N-1, V], each position's next-token loss [N-1]) of ids [N]."""
    logits = model(ids[None, :-1])[0]                                 # [N-1, V]
    return logits, F.cross_entropy(logits, ids[1:], reduction="none")


def loss_on(model, ids, quote_at, synthetic=False):
    """Mean next-token loss over the text plus the mean over the passage (the passage's alone for
    a synthetic window: its random text has nothing to learn)."""
    losses = next_token_losses(model, ids)[1]
    if synthetic:
        return losses[quote_at - 1:].mean()
    return losses[:quote_at - 1].mean() + losses[quote_at - 1:].mean()


def score(model, stream, sp, length, windows=3, seed=1):
    """How well `model` quotes: over `windows` windows of `length` tokens of `stream`, each followed
    by two passages of 64-128 tokens quoted from it, (mean loss over the text, mean loss over the
    passages, the share of passage tokens that are the model's greedy token)."""
    args = argparse.Namespace(lengths=[length], quotes=2, quote_min=64, quote_max=128)
    gen = torch.Generator().manual_seed(seed)
    text, passages, copied = [], [], []
    for _ in range(windows):
        ids, quote_at = window(stream, sp, gen, args)
        with torch.no_grad():
            logits, losses = next_token_losses(model, ids)            # [N-1, V], [N-1]
        text.append(losses[:quote_at - 1].mean().item())
        passages.append(losses[quote_at - 1:].mean().item())
        copied.append((logits[quote_at - 1:].argmax(-1) == ids[quote_at:]).float().mean().item())
    return tuple(sum(v) / windows for v in (text, passages, copied))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default=DEMO, help="the model to tune")
    p.add_argument("--out", help="output Hugging Face directory")
    p.add_argument("--eval", metavar="DIR", help="only score DIR (a tuned model, or the demo's) on "
                   "held-out windows of each --lengths: text loss, passage loss, greedy copy")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--lengths", default="1024,2048,4096,6144",
                   help="window lengths in tokens, drawn uniformly")
    p.add_argument("--quote-min", type=int, default=64)
    p.add_argument("--quote-max", type=int, default=256)
    p.add_argument("--quotes", type=int, default=4, help="passages quoted after each window")
    p.add_argument("--synthetic", type=float, default=0.0,
                   help="the share of windows of random tokens whose passages only copying "
                   "predicts (default 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--minutes", type=float, default=40.0, help="safety cap: stops early")
    args = p.parse_args()
    args.lengths = [int(n) for n in args.lengths.split(",")]
    if args.eval:
        sp = spm.SentencePieceProcessor(model_file=os.path.join(args.eval, "tokenizer.model"))
        _, held_out = split(corpus(), 0.05)  # the demo's own split: text no model here trained on
        stream = encode(held_out, sp)
        model = load_demo(args.eval).eval()
        for n in args.lengths:
            t, q, c = score(model, stream, sp, n)
            print(f"{args.eval} at {n} tokens: text loss {t:.2f}, passage loss {q:.2f}, "
                  f"greedy copy {c:.2f}")
        return
    if not args.out:
        p.error("--out DIR is needed to train (or --eval DIR to score)")
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)

    sp = spm.SentencePieceProcessor(model_file=os.path.join(args.base, "tokenizer.model"))
    train_docs, _ = split(corpus(), 0.05)  # the demo's own split: the same training text
    stream = encode(train_docs, sp)
    model = load_demo(args.base)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    t0 = time.time()
    for step in range(args.steps):
        if time.time() - t0 > 60 * args.minutes:
            print(f"stopped by --minutes at step {step}", flush=True)
            break
        for group in opt.param_groups:  # linear warmup over 20 steps, then linear decay
            group["lr"] = args.lr * min(1.0, (step + 1) / 20, 1.1 - step / args.steps)
        synthetic = float(torch.rand(1, generator=gen)) < args.synthetic
        ids, quote_at = window(stream, sp, gen, args, synthetic)
        loss = loss_on(model, ids, quote_at, synthetic)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 10 == 0:
            print(f"step {step:4d} | {len(ids):5d} tokens | loss {loss.item():.3f} | "
                  f"{time.time() - t0:6.0f} s", flush=True)
    with open(os.path.join(args.base, "config.json")) as f:
        dtype = json.load(f)["torch_dtype"]
    save_hf(model, args.out, open(os.path.join(args.base, "tokenizer.model"), "rb").read(), dtype)
    shutil.copy(os.path.join(args.base, "generation_config.json"), args.out)
    print(f"saved {args.out} after {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
