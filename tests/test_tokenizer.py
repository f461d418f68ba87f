"""
tokenizer.py judged against the libraries it wraps: a tiny sentencepiece model (Llama 2 / Mistral
style) and a tiny byte-level BPE tokenizer.json (Llama 3 style with a BOS post-processor, Qwen2
style without), all trained offline in a temporary directory.
"""
import json
import os
import random

import pytest

from tokenizer import TextStream, Tokenizer, load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly packing "
         "boxes").split()
# the last few characters are not in the training text
TEXT = "the lazy wizard jumps — naïve 日本 boxes!"


def corpus(lines=300, seed=0):
    r = random.Random(seed)
    return [" ".join(r.choice(WORDS) for _ in range(12)) for _ in range(lines)]  # ~20 KB


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f)


@pytest.fixture(scope="module")
def spm_dir(tmp_path_factory):
    import sentencepiece as spm
    path = tmp_path_factory.mktemp("spm")
    # byte_fallback adds 256 byte pieces, so the vocab must exceed 259; identity normalisation keeps
    # round trips exact
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus()),
                                   model_prefix=str(path / "tokenizer"), vocab_size=300,
                                   model_type="bpe", byte_fallback=True,
                                   normalization_rule_name="identity", minloglevel=2)
    os.remove(path / "tokenizer.vocab")
    write_json(path / "config.json", {"bos_token_id": 1, "eos_token_id": 2})
    return path


def test_sentencepiece_encode_decode(spm_dir):
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=str(spm_dir / "tokenizer.model"))
    tok = Tokenizer(str(spm_dir))
    ids = tok.encode(TEXT)
    assert ids == [1] + sp.encode(TEXT)  # BOS first, then exactly what sentencepiece itself gives
    assert any(sp.IsByte(i) for i in ids[1:])  # the unseen characters went through byte fallback
    assert tok.decode(ids) == TEXT
    # from config.json: there is no generation_config.json
    assert tok.bos_id == 1 and tok.eos_ids == {2}


def test_sentencepiece_eos_from_generation_config(spm_dir, tmp_path):
    path = tmp_path / "ckpt"
    os.makedirs(path)
    os.symlink(spm_dir / "tokenizer.model", path / "tokenizer.model")
    write_json(path / "config.json", {"bos_token_id": 1, "eos_token_id": 2})
    write_json(path / "generation_config.json", {"bos_token_id": 1, "eos_token_id": [2, 7]})
    assert Tokenizer(str(path)).eos_ids == {2, 7}
    write_json(path / "tokenizer_config.json", {"add_bos_token": False})
    tok = load_tokenizer(str(path))
    assert tok.encode(TEXT)[0] != 1 and tok.decode(tok.encode(TEXT)) == TEXT
    write_json(path / "tokenizer_config.json", {"add_eos_token": True})  # as LlamaTokenizer does
    ids = load_tokenizer(str(path)).encode(TEXT)
    assert ids[0] == 1 and ids[-1] == 2 and ids.count(2) == 1


def build_tokenizer_json(path, bos):
    """Byte-level BPE trained in memory; with bos=True a post-processor prepends <|begin|> as Llama
    3's does."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|begin|>", "<|end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<|begin|> $A",
                                                           special_tokens=[("<|begin|>", 0)])
    os.makedirs(path, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    write_json(path / "config.json", {"bos_token_id": 0, "eos_token_id": 1})
    return path


@pytest.mark.parametrize("bos", [True, False], ids=["llama3-style", "qwen2-style"])
def test_tokenizer_json_encode_decode(tmp_path, bos):
    path = build_tokenizer_json(tmp_path / "ckpt", bos)
    tok = Tokenizer(str(path))
    ids = tok.encode(TEXT)
    # BOS exactly as the file says: once, or not at all
    assert ids.count(0) == int(bos) and (ids[0] == 0) == bos
    assert len(ids) < len(TEXT.encode())  # merges were learnt and used, not just bytes
    assert tok.decode(ids) == TEXT  # special tokens skipped, bytes reassembled
    assert tok.eos_ids == {1}


def test_no_tokenizer_means_none(llama_ckpt):
    assert load_tokenizer(llama_ckpt) is None


def test_text_stream_shows_a_run_of_byte_tokens_once_it_ends(tmp_path, spm_dir):
    """Llama 2 / Mistral style tokenizer.json (byte fallback, the ByteFallback decoder): a run of
    byte tokens that a later byte makes invalid decodes as U+FFFDs throughout, '€' included. The
    stream shows a run only once it ends, so what it shows, joined, is the final decode
    (transformers' text); sentencepiece's byte pieces stream as they did."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for w in ("▁the", "▁quick", "▁fox"):
        vocab[w] = len(vocab)
    hf = HFTokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                    decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    hf.save(str(tmp_path / "tokenizer.json"))
    write_json(tmp_path / "config.json", {"bos_token_id": 1, "eos_token_id": 2})
    for path, pieces in ((tmp_path, ["▁the", "<0xE2>", "<0x82>", "<0xAC>", "<0x82>", "▁quick",
                                     "<0xE2>", "<0x82>", "<0xAC>", "▁fox"]),
                         (spm_dir, ["▁the", "<0xE2>", "<0x82>", "<0xAC>", "<0x82>", "▁quick"])):
        tok = Tokenizer(str(path))
        ids = [tok.tok.token_to_id(p) if tok.kind == "json" else tok.tok.PieceToId(p)
               for p in pieces]
        assert [tok.is_byte(i) for i in ids] == [p.startswith("<0x") for p in pieces]
        stream = TextStream(tok.decode, tok.is_byte)
        shown = "".join(stream.update(ids[:n]) for n in range(1, len(ids) + 1))
        shown += stream.update(ids, final=True)
        assert shown == tok.decode(ids), (path, shown, tok.decode(ids))
        assert "€" in shown  # a valid run is its character, in both decoders


def test_text_stream_holds_a_character_split_over_tokens():
    """Bytes as tokens (byte fallback, byte-level BPE): 'ъ' is two tokens. What is shown while the
    ids grow, joined, is the decode of them all; a character cut off at the end is shown as the
    decoder gives it."""
    def decode(ids):
        return bytes(ids).decode("utf-8", errors="replace")

    ids = list("cъd€".encode())
    stream = TextStream(decode)
    shown = "".join(stream.update(ids[:n]) for n in range(1, len(ids) + 1))
    assert shown == "cъd€" and "\ufffd" not in shown
    stream = TextStream(decode)
    parts = [stream.update(ids[:2]), stream.update(ids[:2], final=True)]
    assert parts == ["c", "\ufffd"]


def test_text_stream_decodes_a_window_and_shows_the_whole_decode():
    """An update decodes the ids since the update before the last, not every id (each token cost
    1.7 ms at 8K tokens when it decoded them all), and what it shows, joined, is the decode of all
    of them: random ids of the demo model's sentencepiece tokenizer, <unk> (which decodes to
    nothing and would pass the first word's stripped space on), byte pieces and special ids among
    them, several ids an update as a speculative step gives."""
    tok = Tokenizer(os.path.join(ROOT, "assets", "tinyllama-pydoc"))
    decoded = []

    def decode(ids):
        decoded.append(len(ids))
        return tok.decode(ids)

    rng = random.Random(0)
    pool = [0, 1, 2, *range(3, 259, 7), *range(259, 2000)]
    for _ in range(300):
        ids = rng.choices(pool, k=40)
        stream = TextStream(decode, tok.is_byte)
        shown = ""
        n = 0
        while n < len(ids):
            n = min(len(ids), n + rng.choice([1, 1, 2, 3]))
            shown += stream.update(ids[:n])
        shown += stream.update(ids, final=True)
        assert shown == tok.decode(ids), ids
    decoded.clear()
    stream = TextStream(decode, tok.is_byte)
    ids = [rng.randrange(259, 2000) for _ in range(2000)]
    for n in range(1, len(ids) + 1):
        stream.update(ids[:n])
    assert sum(decoded) < 8 * len(ids)  # every id at most a few times, not n^2 / 2


def test_a_chat_template_file_that_cannot_be_read_is_named(tmp_path):
    """chat_template.jinja that is not UTF-8, or a directory: one sentence naming the file (a
    traceback before)."""
    from checkpoint import CheckpointError
    from tokenizer import read_chat_template
    path = tmp_path / "chat_template.jinja"
    path.write_bytes(b"{{ messages }}\xff")
    with pytest.raises(CheckpointError, match=f"^{path}: not UTF-8 text"):
        read_chat_template(str(tmp_path), {})
    path.unlink()
    path.mkdir()
    with pytest.raises(CheckpointError, match=f"^{path}: cannot be read"):
        read_chat_template(str(tmp_path), {})


def test_an_id_past_the_vocab_size_is_named(tmp_path):
    """A tokenizer that gives an id config.json's vocab_size lacks (the weights of another model):
    one sentence naming both files, before the embedding is indexed."""
    from checkpoint import CheckpointError
    path = build_tokenizer_json(tmp_path / "ckpt", bos=False)
    write_json(path / "config.json", {"bos_token_id": 0, "eos_token_id": 1, "vocab_size": 280})
    tok = Tokenizer(str(path))
    ids = Tokenizer.__new__(Tokenizer)  # the same file, unchecked: which ids TEXT gives
    ids.__dict__.update(tok.__dict__, vocab_size=None)
    past = [i for i in ids.encode(TEXT) if i >= 280]
    assert past  # the text does reach past 280
    with pytest.raises(CheckpointError, match=f"tokenizer.json gave token id {past[0]}, past the "
                                              "vocab_size 280 of"):
        tok.encode(TEXT)
    with pytest.raises(CheckpointError, match="do not belong together"):
        tok.encode_rendered(TEXT)
    assert tok.encode("x")  # ids within the vocab pass (a byte: below 258)


def test_sentencepiece_added_tokens_are_matched_and_skipped(spm_dir, tmp_path):
    """A Mistral-style fine-tune that adds ChatML markers past the sentencepiece model's pieces
    (tokenizer_config.json's added_tokens_decoder, added_tokens.json) and names [INST] among
    additional_special_tokens: each marker in the text is its one id, as transformers gives it; a
    special one is skipped by decode; an id past every token is dropped, not a traceback."""
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=str(spm_dir / "tokenizer.model"))
    path = tmp_path / "ckpt"
    os.makedirs(path)
    os.symlink(spm_dir / "tokenizer.model", path / "tokenizer.model")
    write_json(path / "config.json", {"bos_token_id": 1, "eos_token_id": 300, "vocab_size": 310})
    write_json(path / "tokenizer_config.json", {
        "added_tokens_decoder": {"300": {"content": "<|im_end|>", "special": True},
                                 "301": {"content": "<|im_start|>", "special": True}},
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    write_json(path / "added_tokens.json", {"<think>": 302})
    tok = Tokenizer(str(path))
    ids = tok.encode("<|im_start|>user\nthe fox<|im_end|><think>the dog")
    assert ids[:2] == [1, 301] and 300 in ids and 302 in ids and len(ids) < 30, ids
    i = ids.index(300)
    assert ids[2:i] == tok._encode_no_prefix("user\nthe fox")  # after a marker: no prefix space
    assert tok.decode(ids) == "user\nthe fox<think>the dog"
    assert tok.decode(sp.encode("the fox") + [300, 305]) == "the fox"  # 305: no token at all
    assert tok.encode("the </s> fox")[1:].count(2) == 1  # EOS typed in a prompt is its id


def test_named_special_tokens_from_either_file_are_special(tmp_path):
    """A tokenizer.json whose <|im_end|> is an added token not flagged special, named eos_token by
    tokenizer_config.json: decode skips it, as transformers does (all_special_ids); a bos_token
    named only in special_tokens_map.json reaches the template."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer
    path = build_tokenizer_json(tmp_path / "ckpt", bos=False)
    hf = HFTokenizer.from_file(str(path / "tokenizer.json"))
    hf.add_tokens([AddedToken("<|im_end|>", special=False)])
    hf.save(str(path / "tokenizer.json"))
    end = hf.token_to_id("<|im_end|>")
    write_json(path / "tokenizer_config.json", {"eos_token": "<|im_end|>",
                                                "chat_template": "{{ bos_token }}{{ messages[0]"
                                                                 "['content'] }}"})
    write_json(path / "special_tokens_map.json", {"bos_token": "<|begin|>"})
    tok = Tokenizer(str(path))
    assert tok.decode(tok.encode("the fox") + [end]) == "the fox"
    assert hf.decode(tok.encode("the fox") + [end], skip_special_tokens=True) != "the fox"
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == "<|begin|>hi"


def llama2_tokenizer_json(path, config, tc):
    """A Llama 2 style tokenizer.json, as transformers' converter writes one (a normalizer that
    prepends "\u2581" to every piece of text between special tokens, byte fallback, a BOS
    post-processor), trained in memory, with config.json and tokenizer_config.json."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers, processors, trainers
    tok = HFTokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                           normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    special = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=special, show_progress=False)
    tok.train_from_iterator([line.replace(" ", "\u2581") for line in corpus()], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", 1)])
    os.makedirs(path, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    write_json(path / "config.json", {"vocab_size": 600, "bos_token_id": 1, "eos_token_id": 2,
                                      **config})
    write_json(path / "tokenizer_config.json", {"bos_token": "<s>", "eos_token": "</s>",
                                                "unk_token": "<unk>", **tc})
    return path


INST = ("{% for m in messages %}{% if m['role'] == 'user' %}{{ bos_token + '[INST] ' + "
        "m['content'] + ' [/INST]' }}{% else %}{{ ' ' + m['content'] + ' ' + eos_token }}"
        "{% endif %}{% endfor %}")


@pytest.mark.parametrize("config,tc", [
    ({"model_type": "llama"}, {"tokenizer_class": "LlamaTokenizerFast", "legacy": False}),
    ({"model_type": "llama"}, {"tokenizer_class": "LlamaTokenizer"}),
    ({"model_type": "llama"}, {"tokenizer_class": "LlamaTokenizer", "legacy": True}),
    ({"model_type": "llama"}, {"tokenizer_class": "LlamaTokenizer", "add_prefix_space": False}),
    ({"model_type": "mistral"}, {"tokenizer_class": "LlamaTokenizerFast", "legacy": False}),
    ({"model_type": "llama"}, {}),
], ids=["llama2", "no-legacy-field", "legacy", "no-prefix-space", "mistral", "no-class"])
def test_a_llama2_tokenizer_json_gives_transformers_ids(tmp_path, config, tc):
    """transformers 5 loads a Llama model's LlamaTokenizer tokenizer.json with a pipeline of its
    own (Metaspace, the prefix on the text's first piece only unless legacy), a Mistral model's as
    the file says: text after a special token and text that starts with a space got other ids here
    (the file's normalizer), and so did every [INST] turn of a chat template."""
    from transformers import AutoTokenizer
    path = llama2_tokenizer_json(tmp_path / "ckpt", config, {**tc, "chat_template": INST})
    ours = Tokenizer(str(path))
    ref = AutoTokenizer.from_pretrained(str(path))
    texts = [TEXT, "  two leading spaces", " ", "<s>after bos</s> and eos", "a\n the fox", ""]
    for text in texts:
        assert ours.encode(text) == ref(text).input_ids, text
        assert ours.decode(ref(text).input_ids) == ref.decode(ref(text).input_ids,
                                                             skip_special_tokens=True), text
    chat = [{"role": "user", "content": "the quick fox"}, {"role": "assistant", "content": "a dog"},
            {"role": "user", "content": " over"}]
    want = ref.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert ours.apply_chat_template(chat) == list(want)


def test_tokens_named_only_in_tokenizer_config_are_added_as_transformers_adds_them(tmp_path):
    """A tokenizer.json that lacks tokens tokenizer_config.json declares (added_tokens_decoder)
    or names (additional_special_tokens that are plain vocabulary entries, a pad token it lacks):
    transformers adds them as it loads, so their text is one id and decode skips the special ones;
    we spelled them out in bytes and printed them."""
    from tokenizers import Tokenizer as HFTokenizer
    from transformers import AutoTokenizer
    path = build_tokenizer_json(tmp_path / "ckpt", bos=False)
    data = json.loads((path / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    vocab["<|im_start|>"] = len(vocab)  # plain entries, not added tokens
    vocab["<|im_end|>"] = len(vocab)
    write_json(path / "tokenizer.json", data)
    tool = {"content": "<tool>", "special": False, "lstrip": False, "rstrip": False,
            "normalized": False, "single_word": False}
    write_json(path / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
        "pad_token": "<pad>", "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "added_tokens_decoder": {str(len(vocab)): tool}})
    write_json(path / "config.json", {"model_type": "llama", "vocab_size": 400,
                                      "bos_token_id": 0, "eos_token_id": 1})
    assert HFTokenizer.from_file(str(path / "tokenizer.json")).token_to_id("<tool>") is None
    ours = Tokenizer(str(path))
    ref = AutoTokenizer.from_pretrained(str(path))
    for text in ("a <tool> b", "x<|im_start|>user hi<|im_end|>", "the <pad> fox"):
        ids = ref(text).input_ids
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
    assert len(ours.encode("<|im_start|>")) == 1 and ours.decode(ours.encode("<tool>")) == "<tool>"
