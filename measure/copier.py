"""
A model that quotes its document, built by hand: two layers of induction heads (Olsson et al.,
"In-context learning and induction heads") set weight by weight, then layers that compute as a
real layer does and add nothing. Trained models of this project's demo size do not quote at 6K
tokens (docs/speculation.md) and none can be downloaded here; this one does, so that speculation
can be measured where a model repeats its context, at a real model's shape and cost.

    python -m measure.copier /tmp/copier                      # SmolLM2-135M's layer shape, bf16
    python tools/speculation.py --ckpt /tmp/copier --tasks quote,free --contexts 6144

How it copies. Position t holds token x_t. The residual stream is split into subspaces:
    BIAS  1 dim, constant 1             (what the previous-token heads' queries and keys read)
    VAL   G*D dims, val(x_t)            (the token's code for copying, unit norm)
    KEY   R dims, key(x_t)              (the token's code for matching, unit norm)
    PREVd R dims, key(x_{t-d})          (d = 1, 2, 3: written by layer 0)
    OUT   G*D dims, the copied vals     (written by layer 1, read by the output matrix)
Layer 0: kv head d-1 attends to position t-d (its query and key are constants from BIAS whose
RoPE phases add up only at that distance) and copies KEY into PREVd. Layer 1: kv head 0 scores
key(x_t).PREV1(s) + key(x_{t-1}).PREV2(s), 2 where the two tokens before s are x_{t-1} x_t, so it
attends to the position after each earlier occurrence of the bigram ending at t and copies that
position's VAL into OUT; kv heads 1 and 2 do the same for the bigram before it and a skip-bigram
(MATCHES). The output matrix reads OUT: the logits favour the token that followed the context
before, by three votes where the three agree. The content rides in RoPE's slowest pairs, which
turn less than 0.02 rad over 8K positions at rope_theta 1e20; the positional heads use the
fastest 7. Teacher-forced on a passage of the manual repeated after 6K tokens of it, it predicts
92% of the passage's tokens (a bigram alone, 80%); on random tokens, all but collisions.

Every other layer (and both layers' MLPs) has random q, k, v, gate and up matrices and zero output
and down matrices: it costs a real layer's arithmetic and leaves the residual as it is.
"""
import json
import math
import os

import torch

from model import ModelArgs, Transformer

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets",
                    "tinyllama-pydoc")
ROPE_THETA = 1e20
POSITIONAL_PAIRS = 7  # RoPE pairs 0-6 place the previous-token heads
CONTENT_FROM = 9      # pairs 9..D/2-1 turn < 0.02 rad over 8K positions: the match's dims
# weights of pairs 0-6 in a previous-token head's score, found by maximising the smallest margin
# between distance 1 and every other distance in [0, 8192) (0.137 of the peak: 41 nats at SHARP)
PAIR_WEIGHTS = (0.291, 0.139, 0.144, 0.138, 0.106, 0.088, 0.094)
SHARP = 300.0  # a previous-token head's peak score
MATCH = 80.0   # an induction head's score per matching token
LOGIT = 30.0   # the output logit of a fully copied token


def codes(n, dim, g):
    """n random unit vectors of `dim` entries, [n, dim]."""
    c = torch.randn(n, dim, generator=g, dtype=torch.float64)
    return c / c.norm(dim=1, keepdim=True)


# layer 1's kv heads: each matches the tokens at two offsets back from t (0 is x_t itself) with
# those one further back from s, so that all of them attend to positions s whose token follows
# what t's context predicts: the bigram ending at t, the one before it, and a skip-bigram. Their
# votes add, so a continuation that all three agree on wins over one that a single bigram favours.
MATCHES = ((0, 1), (1, 2), (0, 2))


def copier_weights(a, seed=0):
    """{our parameter name: fp64 tensor} of the copier for ModelArgs a."""
    D, H, G, E = a.head_dim, a.n_heads, a.n_kv_heads, a.dim
    half = D // 2
    R = half - CONTENT_FROM  # a match code's dims
    U = G * D                # a copy code's dims
    matches = MATCHES[:G]
    distances = sorted({o + 1 for m in matches for o in m})  # layer 0's previous-token heads
    if G < 2 or half <= CONTENT_FROM or 1 + 2 * U + (1 + len(distances)) * R > E:
        raise ValueError(f"the copier needs at least 2 kv heads, head_dim > {2 * CONTENT_FROM} and "
                         f"dim >= {1 + 2 * U + (1 + len(distances)) * R}; got kv_heads={G}, "
                         f"head_dim={D}, dim={E}")
    g = torch.Generator().manual_seed(seed)  # the codes first: the same for any number of layers
    BIAS = 0
    VAL = torch.arange(1, 1 + U)
    code = {0: torch.arange(1 + U, 1 + U + R)}  # code[o]: key(x_{t-o}), o = 0 is KEY
    for i, d in enumerate(distances):
        code[d] = torch.arange(1 + U + (1 + i) * R, 1 + U + (2 + i) * R)
    OUT = torch.arange(1 + U + (1 + len(distances)) * R, 1 + 2 * U + (1 + len(distances)) * R)
    val, key = codes(a.vocab_size, U, g), codes(a.vocab_size, R, g)  # [V, U], [V, R]
    per_group = H // G
    g.manual_seed(seed + 1)

    with torch.device("meta"):
        shapes = {n: p.shape for n, p in Transformer(a).named_parameters()}
    w = {}
    for name, shape in shapes.items():  # every layer inert: random inputs, zero outputs
        if name.endswith(("wo.weight", "w2.weight")):
            w[name] = torch.zeros(shape, dtype=torch.float64)
        elif "norm" in name:
            w[name] = torch.ones(shape, dtype=torch.float64)
        else:
            w[name] = torch.randn(shape, generator=g, dtype=torch.float64) * shape[-1] ** -0.5
    emb = torch.zeros(a.vocab_size, E, dtype=torch.float64)
    emb[:, BIAS] = 1.0
    emb[:, VAL] = val
    emb[:, code[0]] = key
    w["tok_embeddings.weight"] = emb
    # the norms give back each layer's input at its own scale: RMS of BIAS plus unit codes
    n_codes = 2 + len(distances)
    w["layers.0.attention_norm.weight"].fill_(math.sqrt(3 / E))
    w["layers.1.attention_norm.weight"].fill_(math.sqrt((1 + n_codes) / E))
    w["norm.weight"].fill_(math.sqrt((2 + n_codes) / E))
    scale = math.sqrt(D)  # undo the softmax's 1/sqrt(D)

    inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    att = "layers.0.attention."
    w[att + "wq.weight"].zero_()  # the query heads not used below attend evenly, output unused
    for kv, distance in enumerate(distances):  # layer 0: previous-token heads
        hq = kv * per_group
        w[att + "wk.weight"][kv * D:(kv + 1) * D] = 0
        w[att + "wv.weight"][kv * D:(kv + 1) * D] = 0
        for j, weight in enumerate(PAIR_WEIGHTS):
            amp = math.sqrt(SHARP * weight * scale)
            phase = distance * inv_freq[j].item()  # q.k = amp^2 cos(theta_j (t - s - distance))
            w[att + "wq.weight"][hq * D + j, BIAS] = amp * math.cos(phase)
            w[att + "wq.weight"][hq * D + half + j, BIAS] = -amp * math.sin(phase)
            w[att + "wk.weight"][kv * D + j, BIAS] = amp
        w[att + "wv.weight"][kv * D + torch.arange(R), code[0]] = 1.0
        w[att + "wo.weight"][code[distance], hq * D + torch.arange(R)] = 1.0

    att = "layers.1.attention."  # layer 1: induction heads
    content = torch.arange(CONTENT_FROM, half)  # R dims of each half
    w[att + "wq.weight"].zero_()
    w[att + "wk.weight"].zero_()
    w[att + "wv.weight"].zero_()
    for kv, (o1, o2) in enumerate(matches):
        hq = kv * per_group
        w[att + "wq.weight"][hq * D + content, code[o1]] = MATCH * scale
        w[att + "wq.weight"][hq * D + half + content, code[o2]] = MATCH * scale
        w[att + "wk.weight"][kv * D + content, code[o1 + 1]] = 1.0
        w[att + "wk.weight"][kv * D + half + content, code[o2 + 1]] = 1.0
        w[att + "wv.weight"][kv * D + torch.arange(D), VAL[kv * D:(kv + 1) * D]] = 1.0
        w[att + "wo.weight"][OUT[kv * D:(kv + 1) * D], hq * D + torch.arange(D)] = 1.0
    w["output.weight"] = torch.zeros(a.vocab_size, E, dtype=torch.float64)
    w["output.weight"][:, OUT] = LOGIT * val
    return w


def build_copier(out_dir, dim=576, layers=30, heads=9, kv_heads=3, head_dim=64, hidden=1536,
                 dtype=torch.bfloat16, tokenizer_dir=DEMO, seed=0, max_positions=32768):
    """Write the copier as a Hugging Face directory (config.json, model.safetensors, the demo's
    tokenizer.model), private (0700 / 0600). Default shape: SmolLM2-135M's layers with the demo's
    4,096-token vocabulary."""
    from safetensors.torch import save

    from checkpoint import ours_to_hf
    from private import make_private_dir, write_atomic
    with open(os.path.join(tokenizer_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    a = ModelArgs(dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim,
                  hidden_dim=hidden, vocab_size=vocab, max_seq_len=max_positions,
                  rope_theta=ROPE_THETA)
    if layers < 2:
        raise ValueError(f"the copier needs at least 2 layers; got {layers}")
    tensors = {ours_to_hf(n): t.to(dtype).contiguous() for n, t in copier_weights(a, seed).items()}
    make_private_dir(out_dir, "the copier's directory")
    write_atomic(os.path.join(out_dir, "model.safetensors"), save(tensors, {"format": "pt"}))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": dim, "intermediate_size": hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "vocab_size": vocab, "max_position_embeddings": max_positions, "rms_norm_eps": 1e-5,
        "rope_theta": ROPE_THETA, "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False, "torch_dtype": str(dtype).removeprefix("torch."),
        "bos_token_id": 1, "eos_token_id": 2,
    }
    write_atomic(os.path.join(out_dir, "config.json"), json.dumps(config, indent=2).encode())
    for name in ("tokenizer.model", "generation_config.json"):
        with open(os.path.join(tokenizer_dir, name), "rb") as f:
            write_atomic(os.path.join(out_dir, name), f.read())
    return out_dir


if __name__ == "__main__":
    import argparse
    p = argparse.ArgumentParser(prog="python -m measure.copier",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    try:
        print(build_copier(args.out_dir, layers=args.layers, seed=args.seed,
                           dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32))
    except (ValueError, OSError) as e:
        p.exit(2, f"python -m measure.copier: error: {e}\n")
