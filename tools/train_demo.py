"""
Train the embedded demo model, assets/tinyllama-pydoc: a small Llama trained from scratch, on CPU,
with this project's own model.py, on English text that every Python installation carries (the pydoc
help topics and the standard library's docstrings). It writes a Hugging Face directory that
transformers and model.py both load.

    python tools/train_demo.py                      # the shipped run: ~20 min on one CPU thread
    python tools/train_demo.py --steps 60 --out /tmp/smoke

Deterministic given --seed, the Python version (the text comes from its standard library) and the
CPU; --minutes is only a safety cap that stops early (and the model card says so) when a machine is
much slower than planned.
"""
import argparse
import ast
import io
import json
import math
import os
import platform
import sys
import sysconfig
import time
import warnings

import sentencepiece as spm
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from checkpoint import ours_to_hf  # noqa: E402
from model import ModelArgs, Transformer  # noqa: E402

BOS, EOS = 1, 2
SKIP_DIRS = {"site-packages", "test", "tests", "idlelib", "turtledemo", "lib2to3", "__pycache__"}
DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)

# -----------------------------------------------------------------------------
# data


def corpus(min_chars=120):
    """(name, text) documents in a fixed order: every pydoc help topic, then the standard
    library's docstrings."""
    from pydoc_data.topics import topics
    docs = [(f"topic {k}", topics[k]) for k in sorted(topics)]
    lib = sysconfig.get_paths()["stdlib"]
    for root, dirs, files in os.walk(lib):
        # sorted: os.walk's order is the file system's
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        for f in sorted(fn for fn in files if fn.endswith(".py")):
            path = os.path.join(root, f)
            try:
                with open(path, encoding="utf-8") as fh, warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # SyntaxWarnings about escapes in old modules
                    tree = ast.parse(fh.read())
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue  # a few files are deliberately broken (bad encodings, py2 syntax)
            for node in ast.walk(tree):
                if isinstance(node, DOCUMENTED):
                    doc = ast.get_docstring(node)  # dedented, as pydoc shows it
                    if doc and len(doc) >= min_chars:  # one-liners ("Return self.") teach little
                        name = f"{os.path.relpath(path, lib)}:{getattr(node, 'name', '')}"
                        docs.append((name, doc))
    return docs


def split(docs, val_frac):
    """Whole documents to validation whenever its share of the characters seen so far falls behind
    val_frac, so the held-out text is spread evenly through the corpus and no document is in both
    halves."""
    train = []
    val = []
    seen = 0
    held = 0
    for doc in docs:
        seen += len(doc[1])
        if held + len(doc[1]) <= val_frac * seen:
            val.append(doc)
            held += len(doc[1])
        else:
            train.append(doc)
    return train, val


def train_tokenizer(texts, vocab_size):
    """A Llama-2-style sentencepiece BPE model (identity normalisation, byte fallback): any text
    round-trips."""
    lines = [line for t in texts for line in t.split("\n") if line.strip()]
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=out, model_type="bpe", vocab_size=vocab_size,
        unk_id=0, bos_id=BOS, eos_id=EOS, pad_id=-1, byte_fallback=True, character_coverage=0.9999,
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=True,
        allow_whitespace_only_pieces=True, split_digits=True, num_threads=1, minloglevel=2)
    return out.getvalue()


def encode(docs, sp):
    """One token stream [N]: BOS, the document, EOS, for each document in order."""
    ids = []
    for _, text in docs:
        ids += [BOS] + sp.encode(text) + [EOS]
    return torch.tensor(ids, dtype=torch.long)


# -----------------------------------------------------------------------------
# training


def init_weights(model):
    """GPT-2 style: N(0, 0.02), residual projections scaled down by depth so the residual stream
    starts small."""
    for name, p in model.named_parameters():
        if p.dim() == 2:
            if name.endswith(("wo.weight", "w2.weight")):
                std = 0.02 / math.sqrt(2 * model.args.n_layers)
            else:
                std = 0.02
            nn.init.normal_(p, std=std)


def lr_at(step, args):
    """Linear warmup, then cosine decay to a tenth of the peak."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def loss_on(model, x, bf16):
    # x [B, T+1]: predict x[:, 1:] from x[:, :-1]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = model(x[:, :-1])  # [B, T, V]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate(model, stream, seq_len, bf16, batch=16):
    """Mean loss over every non-overlapping window of the held-out stream (the same windows each
    time)."""
    n = (len(stream) - 1) // seq_len
    # [n, T+1]
    windows = torch.stack([stream[i * seq_len: i * seq_len + seq_len + 1] for i in range(n)])
    model.eval()
    total = 0
    for i in range(0, n, batch):
        x = windows[i:i + batch]                                      # [batch, T+1]
        total += loss_on(model, x, bf16).item() * len(x)
    model.train()
    return total / n


def train(model, train_ids, val_ids, args):
    """AdamW on random windows of the training stream; returns the log rows and whether --minutes
    cut it short."""
    decay = [p for p in model.parameters() if p.dim() == 2]   # matrices and embeddings
    no_decay = [p for p in model.parameters() if p.dim() < 2]  # norm gains
    groups = [{"params": decay, "weight_decay": args.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    # the data order: window starts drawn from this alone
    gen = torch.Generator().manual_seed(args.seed)
    log = []
    losses = []
    t0 = time.time()
    for step in range(args.steps + 1):
        over = time.time() - t0 > 60 * args.minutes
        if step % args.eval_every == 0 or step == args.steps or over:
            val = evaluate(model, val_ids, args.seq_len, args.bf16)
            train_loss = sum(losses) / len(losses) if losses else float("nan")
            log.append({"step": step, "train": train_loss, "val": val, "seconds": time.time() - t0})
            lr = lr_at(min(step, args.steps - 1), args)
            print(f"step {step:5d}/{args.steps} | train {train_loss:.3f} | val {val:.3f} ppl "
                  f"{math.exp(val):7.1f} | lr {lr:.2e} | {time.time() - t0:6.0f} s", flush=True)
            losses = []
        if step == args.steps or over:
            if over and step < args.steps:
                print(f"stopped by --minutes {args.minutes} at step {step} of {args.steps}",
                      flush=True)
            return log, over and step < args.steps
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        starts = torch.randint(0, len(train_ids) - args.seq_len - 1, (args.batch,), generator=gen)
        # [B, T+1]
        x = torch.stack([train_ids[s: s + args.seq_len + 1] for s in starts.tolist()])
        loss = loss_on(model, x, args.bf16)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())


# -----------------------------------------------------------------------------
# export


def hf_config(model_args, dtype):
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": model_args.dim, "intermediate_size": model_args.hidden_dim,
        "num_hidden_layers": model_args.n_layers, "num_attention_heads": model_args.n_heads,
        "num_key_value_heads": model_args.n_kv_heads, "head_dim": model_args.head_dim,
        "vocab_size": model_args.vocab_size, "rms_norm_eps": model_args.norm_eps,
        "rope_theta": model_args.rope_theta, "rope_scaling": None, "attention_bias": False,
        "mlp_bias": False, "tie_word_embeddings": False,
        # trained on 256-token windows; positions beyond that run (RoPE extrapolates) but the text
        # degrades
        "max_position_embeddings": model_args.max_seq_len, "bos_token_id": BOS, "eos_token_id": EOS,
        "torch_dtype": dtype, "initializer_range": 0.02, "use_cache": True,
    }


def save_hf(model, out, sp_bytes, dtype):
    os.makedirs(out, exist_ok=True)
    tensors = {ours_to_hf(n): p.detach().to(getattr(torch, dtype)).contiguous()
               for n, p in model.named_parameters()}
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "tokenizer.model"), "wb") as f:
        f.write(sp_bytes)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(hf_config(model.args, dtype), f, indent=2)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": BOS, "eos_token_id": EOS}, f, indent=2)


@torch.no_grad()
def complete(model, sp, prompt, n, temperature=0.0, top_k=40, seed=0):
    """Plain full-sequence recompute each step: slow but obviously right, which is all a model card
    needs."""
    gen = torch.Generator().manual_seed(seed)
    ids = [BOS] + sp.encode(prompt)
    for _ in range(n):
        logits = model(torch.tensor([ids]))[0, -1]  # [V]
        if temperature == 0:
            nxt = int(logits.argmax())
        else:
            v, i = torch.topk(logits / temperature, top_k)
            nxt = int(i[torch.multinomial(F.softmax(v, -1), 1, generator=gen)])
        if nxt == EOS:
            break
        ids.append(nxt)
    return sp.decode(ids[1:])


def loss_cell(x):
    """A loss for the card's table; step 0 has no train loss yet."""
    return "-" if math.isnan(x) else f"{x:.3f}"


def write_card(out, args, info, log, samples):
    rows = "\n".join(f"| {r['step']} | {loss_cell(r['train'])} | {r['val']:.3f} | "
                     f"{math.exp(r['val']):.1f} | {r['seconds'] / 60:.1f} |" for r in log)
    shown = "\n\n".join(f"**{kind}**, prompt `{p}`:\n\n```\n{text}\n```"
                        for kind, p, text in samples)
    m = info["model_args"]
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo_card.md")) as f:
        template = f.read()
    last = log[-1]["step"]
    tokens_seen = last * args.batch * args.seq_len
    cut = ""
    if info["cut"]:
        cut = f"\n**Stopped early by --minutes at step {last} of {args.steps}.**\n"
    card = template.format(
        params=f"{info['params']:,}", mb=info["bytes"] / 1e6, dtype=args.dtype, dim=m.dim,
        layers=m.n_layers, heads=m.n_heads, kv_heads=m.n_kv_heads, head_dim=m.head_dim,
        hidden=m.hidden_dim, vocab=m.vocab_size, max_pos=m.max_seq_len, seq_len=args.seq_len,
        train_tokens=info["train_tokens"], val_tokens=info["val_tokens"],
        train_docs=info["train_docs"], val_docs=info["val_docs"], val_pct=100 * info["val_frac"],
        steps=last, batch=args.batch, tokens_seen=tokens_seen,
        epochs=tokens_seen / info["train_tokens"], minutes=info["seconds"] / 60, cut=cut,
        train_loss=log[-1]["train"], val_loss=info["final_val"], ppl=math.exp(info["final_val"]),
        rows=rows, samples=shown, command=info["command"], python=platform.python_version(),
        torch=torch.__version__, cpu=info["cpu"], lr=args.lr)
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(card)


# -----------------------------------------------------------------------------
# CLI


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            names = (line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
            return next(names)
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="assets/tinyllama-pydoc", help="output Hugging Face directory")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the initialisation and the data order")
    p.add_argument("--steps", type=int, default=1000,
                   help="optimizer steps; the LR schedule spans exactly these")
    p.add_argument("--minutes", type=float, default=28.0,
                   help="safety cap on training wall-clock time; stops early")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--dim", type=int, default=256, help="model dim E")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks")
    p.add_argument("--heads", type=int, default=4, help="query heads H")
    p.add_argument("--kv-heads", type=int, default=2,
                   help="kv heads G (< H: grouped-query attention)")
    p.add_argument("--head-dim", type=int, default=64, help="head dim D")
    p.add_argument("--hidden", type=int, default=704, help="SwiGLU hidden dim F")
    p.add_argument("--vocab", type=int, default=4096, help="sentencepiece vocabulary size")
    p.add_argument("--seq-len", type=int, default=256, help="training window in tokens")
    p.add_argument("--max-pos", type=int, default=32768,
                   help="max_position_embeddings written to config.json")
    p.add_argument("--batch", type=int, default=16, help="windows per step")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=50, help="linear warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.1,
                   help="AdamW weight decay on matrices")
    p.add_argument("--val-frac", type=float, default=0.05,
                   help="share of the text held out for validation")
    p.add_argument("--eval-every", type=int, default=100,
                   help="steps between held-out evaluations")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True,
                   help="bf16 autocast for the matmuls (about 2x faster on CPUs with "
                   "AMX/AVX512-BF16)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="saved weight dtype")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    docs = corpus()
    train_docs, val_docs = split(docs, args.val_frac)
    sp_bytes = train_tokenizer([t for _, t in train_docs], args.vocab)
    sp = spm.SentencePieceProcessor(model_proto=sp_bytes)
    train_ids = encode(train_docs, sp)
    val_ids = encode(val_docs, sp)
    n_chars = sum(len(t) for _, t in docs)
    print(f"{len(docs)} documents, {n_chars:,} characters; train {len(train_ids):,} tokens, "
          f"held out {len(val_ids):,} tokens ({len(val_docs)} documents)", flush=True)

    model_args = ModelArgs(arch="llama", dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                           n_kv_heads=args.kv_heads, head_dim=args.head_dim,
                           hidden_dim=args.hidden, vocab_size=sp.vocab_size(), norm_eps=1e-5,
                           max_seq_len=args.max_pos, rope_theta=10000.0, torch_dtype=args.dtype)
    model = Transformer(model_args)
    init_weights(model)
    params = sum(p.numel() for p in model.parameters())
    print(f"{params:,} parameters", flush=True)

    t0 = time.time()
    log, cut = train(model, train_ids, val_ids, args)
    seconds = time.time() - t0
    save_hf(model, args.out, sp_bytes, args.dtype)

    # everything below uses the saved files, so it also checks that they load
    model = Transformer.from_pretrained(args.out)
    final_val = evaluate(model, val_ids, args.seq_len, bf16=False)
    print(f"saved {args.out}: held-out loss {final_val:.3f}, perplexity {math.exp(final_val):.1f} "
          f"(fp32 compute on the saved {args.dtype} weights); trained {seconds / 60:.1f} min",
          flush=True)
    samples = []
    for prompt in ["The list of built-in functions", "A class is", "Return the number of"]:
        samples.append(("Greedy", prompt, complete(model, sp, prompt, 60)))
    for prompt in ["The list of built-in functions", "This module provides"]:
        text = complete(model, sp, prompt, 60, 0.8)
        samples.append(("Sampled (temperature 0.8, top-k 40, seed 0)", prompt, text))
    for kind, prompt, text in samples:
        print(f"--- {kind}: {text!r}", flush=True)
    command = "python tools/train_demo.py " + " ".join(sys.argv[1:])
    weights = os.path.join(args.out, "model.safetensors")
    info = dict(model_args=model_args, params=params, bytes=os.path.getsize(weights),
                train_tokens=len(train_ids), val_tokens=len(val_ids),
                train_docs=len(train_docs), val_docs=len(val_docs),
                val_frac=sum(len(t) for _, t in val_docs) / n_chars, seconds=seconds, cut=cut,
                final_val=final_val, command=command.strip(), cpu=cpu_name())
    write_card(args.out, args, info, log, samples)


if __name__ == "__main__":
    main()
