"""
Write tests/golden_demo.json: the greedy continuation of a fixed prompt by the demo model, computed
by transformers (an independent implementation), so tests can hold every path of ours (plain,
cached, offloaded) to it.

    python tools/make_golden.py   # after tools/train_demo.py has (re)written assets/tinyllama-pydoc
"""
import argparse
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local directory: never reach for the Hub

import torch  # noqa: E402
import transformers  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tokenizer import Tokenizer  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1].strip())
    p.add_argument("--ckpt", default="assets/tinyllama-pydoc", help="the demo model directory")
    p.add_argument("--prompt", default="The list of built-in functions",
                   help="prompt text (BOS is prepended)")
    p.add_argument("--new-tokens", type=int, default=40, help="max_new_tokens for greedy generate")
    p.add_argument("--out", default="tests/golden_demo.json", help="where to write the golden ids")
    args = p.parse_args()

    tok = Tokenizer(args.ckpt)
    # our tokenizer, BOS first: the ids are what the test feeds our model
    prompt_ids = tok.encode(args.prompt)
    model = transformers.LlamaForCausalLM.from_pretrained(args.ckpt, dtype=torch.float32).eval()
    x = torch.tensor([prompt_ids])
    # it stops early at EOS, as our generate does
    out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                         max_new_tokens=args.new_tokens, pad_token_id=sorted(tok.eos_ids)[0])
    new_ids = out[0, len(prompt_ids):].tolist()
    produced_by = f"transformers {transformers.__version__} LlamaForCausalLM greedy, fp32"
    golden = {"prompt": args.prompt, "prompt_ids": prompt_ids, "new_ids": new_ids,
              "produced_by": produced_by}
    with open(args.out, "w") as f:
        json.dump(golden, f, indent=1)
        f.write("\n")
    print(f"{args.out}: {args.prompt!r} -> {tok.decode(new_ids)!r}")


if __name__ == "__main__":
    main()
