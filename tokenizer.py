"""
Tokenizers of Hugging Face checkpoints: `tokenizer.model` (sentencepiece: Llama 1/2, Mistral) or `tokenizer.json`
(the tokenizers library: Llama 3, Qwen2). BOS and EOS ids come from config.json and generation_config.json.
"""
import os

from model import CheckpointError, read_json


class Tokenizer:
    def __init__(self, ckpt_dir):
        cfg = read_json(os.path.join(ckpt_dir, "config.json"))
        gen_path = os.path.join(ckpt_dir, "generation_config.json")
        gen = read_json(gen_path) if os.path.exists(gen_path) else {}
        self.bos_id = gen.get("bos_token_id", cfg.get("bos_token_id"))
        eos = gen.get("eos_token_id", cfg.get("eos_token_id"))
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        spm_path, json_path = os.path.join(ckpt_dir, "tokenizer.model"), os.path.join(ckpt_dir, "tokenizer.json")
        if os.path.exists(json_path):  # preferred when both exist: it carries the checkpoint's own BOS rule
            from tokenizers import Tokenizer as HFTokenizer
            try:
                self.tok = HFTokenizer.from_file(json_path)
            except Exception as e:
                raise CheckpointError(f"{json_path}: cannot be read by the tokenizers library ({e})") from None
            self.kind = "json"
        elif os.path.exists(spm_path):
            import sentencepiece as spm
            self.tok = spm.SentencePieceProcessor()
            try:
                self.tok.Load(spm_path)
            except Exception as e:
                raise CheckpointError(f"{spm_path}: cannot be read by sentencepiece ({e})") from None
            self.kind = "spm"
            if self.bos_id is None:
                self.bos_id = self.tok.bos_id() if self.tok.bos_id() >= 0 else None
            if not self.eos_ids and self.tok.eos_id() >= 0:
                self.eos_ids = {self.tok.eos_id()}
        else:
            raise CheckpointError(f"{ckpt_dir}: no tokenizer.model or tokenizer.json; pass token ids instead of text")
        # sentencepiece checkpoints (Llama 2, Mistral) prepend BOS unless tokenizer_config.json says otherwise
        tc_path = os.path.join(ckpt_dir, "tokenizer_config.json")
        tc = read_json(tc_path) if os.path.exists(tc_path) else {}
        self.add_bos = self.kind == "spm" and tc.get("add_bos_token", True) and self.bos_id is not None

    def encode(self, text):
        if self.kind == "json":  # the file's post-processor decides about BOS (Llama 3 adds it, Qwen2 does not)
            return self.tok.encode(text).ids
        return ([self.bos_id] if self.add_bos else []) + self.tok.EncodeAsIds(text)

    def decode(self, ids):
        if self.kind == "json":
            return self.tok.decode(list(ids), skip_special_tokens=True)
        return self.tok.DecodeIds(list(ids))


def load_tokenizer(ckpt_dir):
    """The checkpoint's tokenizer, or None when it ships none (then only token ids can be generated)."""
    if not any(os.path.exists(os.path.join(ckpt_dir, f)) for f in ("tokenizer.model", "tokenizer.json")):
        return None
    return Tokenizer(ckpt_dir)

