"""
Chat templates judged against transformers' apply_chat_template on tiny tokenizers built offline (a
byte-level BPE tokenizer.json with ChatML and Llama 2 special tokens; a sentencepiece model), plus
the errors around them, the eos ids generate stops at, the gguf message and the prefill progress
line.
"""
import io
import json
import os
import random
import re

import pytest

from checkpoint import CheckpointError
from model import Transformer
from runs.progress import Progress, duration
from tokenizer import Tokenizer, chat_messages, messages_problem

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly packing "
         "boxes system user assistant you are helpful").split()
SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]

# Qwen2.5's template, shortened: a default system message when the chat has none
CHATML = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'system' and loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Llama 2's template: bos_token before every user turn, <<SYS>> folded into the first,
# raise_exception on bad roles
LLAMA2 = ("{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
          "{% set system_message = messages[0]['content'] %}"
          "{% else %}{% set loop_messages = messages %}"
          "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
          "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
          "{{ raise_exception('Conversation roles must alternate "
          "user/assistant/user/assistant/...') }}"
          "{% endif %}"
          "{% if loop.index0 == 0 and system_message != false %}"
          "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' "
          "+ message['content'] %}"
          "{% else %}{% set content = message['content'] %}{% endif %}"
          "{% if message['role'] == 'user' %}"
          "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
          "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}"
          "{% endif %}"
          "{% endfor %}")

# the rest of the environment transformers renders in: tojson keeping non-ASCII, strftime_now,
# namespace, loop controls, {% generation %}, trim_blocks / lstrip_blocks around block tags
FEATURES = """{% set ns = namespace(n=0) %}
{% for m in messages %}
    {% if m.role == 'system' %}{% continue %}{% endif %}
    {% set ns.n = ns.n + 1 %}
<|im_start|>{{ m.role }} {{ m | tojson }} {{ strftime_now('%Y') }}<|im_end|>
    {% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}{% endif %}
    {% if ns.n >= 3 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant {{ ns.n }}
{% endif %}
{% if greeting is defined %}{{ greeting }}{% endif %}"""

SYSTEM = "You are a jolly wizard."
CHATS = {
    "user": [{"role": "user", "content": "the lazy dog jumps over a fox"}],
    "system": chat_messages("the lazy dog jumps over a fox", system=SYSTEM),
    "turns": [{"role": "system", "content": SYSTEM},
              {"role": "user", "content": "hex the boxes", "name": None},
              {"role": "assistant", "content": "  seven boxes, naïve 日本  "},
              {"role": "user", "content": "why?"}],
}


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f)


def build_json_ckpt(path, template=None, bos_processor=False, **tokenizer_config):
    """A byte-level BPE tokenizer.json with ChatML and Llama 2 special tokens, its configs, and a
    template."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers
    r = random.Random(0)
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    lines = [" ".join(r.choice(WORDS) for _ in range(12)) for _ in range(300)]
    tok.train_from_iterator(lines, trainer)
    # Llama 3 style: plain encode() prepends BOS, which a rendered chat must not get twice
    if bos_processor:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                           special_tokens=[("<s>", 0)])
    os.makedirs(path, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    write_json(path / "config.json", {"bos_token_id": 0, "eos_token_id": 1})
    eos = {"__type": "AddedToken", "content": "</s>", "special": True}
    tok_config = {"bos_token": "<s>", "eos_token": eos, "pad_token": "<|endoftext|>",
                  "tokenizer_class": "PreTrainedTokenizerFast", **tokenizer_config}
    if template is not None:
        tok_config["chat_template"] = template
    write_json(path / "tokenizer_config.json", tok_config)
    return path


def hf_chat_ids(path, messages):
    from transformers import AutoTokenizer
    hf_tok = AutoTokenizer.from_pretrained(str(path))
    out = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)  # 5.x returns a BatchEncoding


@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("template,bos_processor",
                         [(CHATML, False), (LLAMA2, True), (FEATURES, False)],
                         ids=["chatml", "llama2", "features"])
def test_template_matches_transformers(tmp_path, template, bos_processor, chat):
    path = build_json_ckpt(tmp_path / "ckpt", template, bos_processor)
    ids = Tokenizer(str(path)).apply_chat_template(CHATS[chat])
    assert ids == hf_chat_ids(path, CHATS[chat])
    specials = set(range(len(SPECIALS)))
    # the template's special tokens became their ids, not their characters
    assert specials & set(ids)
    if template is LLAMA2:
        assert ids[:2] != [0, 0] and ids.count(0) == sum(m["role"] == "user" for m in CHATS[chat])
    if template is FEATURES:  # extra variables reach the template, as transformers' **kwargs do
        from transformers import AutoTokenizer
        hf = AutoTokenizer.from_pretrained(str(path))
        with_var = Tokenizer(str(path)).apply_chat_template(CHATS[chat], greeting="hex")
        want = hf.apply_chat_template(CHATS[chat], add_generation_prompt=True, greeting="hex")
        assert with_var != ids and with_var == want["input_ids"]


def test_default_system_message_and_system_flag(tmp_path):
    tok = Tokenizer(str(build_json_ckpt(tmp_path / "ckpt", CHATML)))
    default = tok.tok.decode(tok.apply_chat_template(CHATS["user"]))
    given = tok.tok.decode(tok.apply_chat_template(CHATS["system"]))
    assert "You are a helpful assistant." in default and SYSTEM not in default
    assert SYSTEM in given and "You are a helpful assistant." not in given
    assert chat_messages("hi") == [{"role": "user", "content": "hi"}]
    # "" overrides the default
    assert chat_messages("hi", system="")[0] == {"role": "system", "content": ""}


def test_chat_template_jinja_and_named_list(tmp_path):
    # chat_template.jinja wins over tokenizer_config.json's template, as in transformers
    path = build_json_ckpt(tmp_path / "jinja", template=LLAMA2)
    (path / "chat_template.jinja").write_text(CHATML)
    ids = Tokenizer(str(path)).apply_chat_template(CHATS["system"])
    assert ids == hf_chat_ids(path, CHATS["system"])
    plain = Tokenizer(str(build_json_ckpt(tmp_path / "plain", LLAMA2)))
    assert ids != plain.apply_chat_template(CHATS["system"])
    # a list of named templates: "default" is the one used
    listed = build_json_ckpt(tmp_path / "list", [{"name": "tool_use", "template": LLAMA2},
                                                 {"name": "default", "template": CHATML}])
    listed_ids = Tokenizer(str(listed)).apply_chat_template(CHATS["turns"])
    assert listed_ids == hf_chat_ids(listed, CHATS["turns"])
    nameless_path = build_json_ckpt(tmp_path / "nameless",
                                    [{"name": "tool_use", "template": CHATML}])
    nameless = Tokenizer(str(nameless_path))
    # plain text still works
    assert nameless.decode(nameless.encode("the lazy dog")) == "the lazy dog"
    with pytest.raises(CheckpointError, match="none named \"default\""):
        nameless.chat_template()


def test_template_errors_are_one_sentence(tmp_path):
    from transformers import AutoTokenizer
    path = build_json_ckpt(tmp_path / "ckpt", LLAMA2)
    bad = [{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}]
    with pytest.raises(Exception, match="must alternate"):  # transformers refuses it too
        hf_tok = AutoTokenizer.from_pretrained(str(path))
        hf_tok.apply_chat_template(bad, add_generation_prompt=True)
    with pytest.raises(ValueError,
                       match="rejected the messages \\(Conversation roles must alternate"):
        Tokenizer(str(path)).apply_chat_template(bad)
    none = build_json_ckpt(tmp_path / "none")
    with pytest.raises(CheckpointError, match="has no chat template .*drop --chat"):
        Tokenizer(str(none)).apply_chat_template(CHATS["user"])
    broken = build_json_ckpt(tmp_path / "broken", "{% for m in messages %}{{ m.content }")
    with pytest.raises(CheckpointError,
                       match="tokenizer_config.json: the chat template is not valid jinja"):
        # the early check the CLI makes, before the model loads
        Tokenizer(str(broken)).chat_template()


@pytest.mark.parametrize("messages", [
    None,
    [],
    "hi",
    {"role": "user", "content": "hi"},
    ["hi"],
    [{"role": "user"}],
    [{"content": "hi"}],
    [{"role": "user", "content": 3}],
    [{"role": "", "content": "hi"}],
    [{"role": "user", "content": "hi"}, {"role": None, "content": "x"}],
])
def test_messages_problem(tmp_path, messages):
    problem = messages_problem(messages)
    assert isinstance(problem, str) and "'messages'" in problem
    tok = Tokenizer(str(build_json_ckpt(tmp_path / "ckpt", CHATML)))
    with pytest.raises(ValueError, match="'messages'"):
        tok.apply_chat_template(messages)


def test_messages_problem_accepts_chats():
    for chat in CHATS.values():
        assert messages_problem(chat) is None


@pytest.mark.parametrize("legacy", [True, False])
def test_sentencepiece_bos_once(tmp_path, legacy):
    """A template that writes bos_token, on a sentencepiece model that prepends BOS to plain text:
    BOS once per user turn. legacy=True is compared with transformers' sentencepiece tokenizer (the
    other mode needs protobuf)."""
    import sentencepiece as spm

    from ckpt import add_sentencepiece
    path = tmp_path / "spm"
    os.makedirs(path)
    add_sentencepiece(str(path))
    write_json(path / "config.json", {"bos_token_id": 1, "eos_token_id": 2})
    write_json(path / "tokenizer_config.json", {"chat_template": LLAMA2, "legacy": legacy})
    tok = Tokenizer(str(path))
    chat = [{"role": "user", "content": "the object is a class"},
            {"role": "assistant", "content": "yes it is"},
            {"role": "user", "content": "return None"}]
    ids = tok.apply_chat_template(chat)
    assert tok.encode("x")[0] == 1 and ids[0] == 1 and ids[1] != 1
    assert ids.count(1) == 2 and ids.count(2) == 1
    sp = spm.SentencePieceProcessor(model_file=str(path / "tokenizer.model"))
    if legacy:
        from transformers.tokenization_utils_sentencepiece import SentencePieceBackend
        ref = SentencePieceBackend(vocab_file=str(path / "tokenizer.model"), legacy=True,
                                   bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   chat_template=LLAMA2)
        want = ref.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        assert ids == want["input_ids"]
    else:  # after a special token no prefix space: the pieces spell the text exactly
        pieces = "".join(sp.id_to_piece(i) for i in ids[1:ids.index(2)])
        # byte-fallback pieces
        pieces = re.sub("<0x([0-9A-F]{2})>", lambda m: chr(int(m.group(1), 16)), pieces)
        assert pieces == "[INST] the object is a class [/INST] yes it is".replace(" ", "\u2581")


def test_eos_ids_are_generation_configs(tmp_path):
    from transformers import GenerationConfig
    path = build_json_ckpt(tmp_path / "ckpt", CHATML)
    write_json(path / "generation_config.json", {"bos_token_id": 0, "eos_token_id": [1, 3, 4]})
    want = GenerationConfig.from_pretrained(str(path)).eos_token_id
    assert Tokenizer(str(path)).eos_ids == set(want)
    write_json(path / "generation_config.json", {"bos_token_id": 0, "eos_token_id": 3})
    want = GenerationConfig.from_pretrained(str(path)).eos_token_id
    assert Tokenizer(str(path)).eos_ids == {want}


def test_gguf_directory(tmp_path):
    (tmp_path / "qwen2.5-0.5b-instruct-q4_k_m.gguf").write_bytes(b"GGUF")
    for load in (Transformer.from_pretrained, Tokenizer):
        with pytest.raises(CheckpointError,
                           match="holds qwen2.5-0.5b-instruct-q4_k_m.gguf, a llama.cpp file.*"
                                 "gguf_file=\"qwen2.5-0.5b-instruct-q4_k_m.gguf\""):
            load(str(tmp_path))
    os.remove(tmp_path / "qwen2.5-0.5b-instruct-q4_k_m.gguf")
    with pytest.raises(CheckpointError, match="config.json not found"):
        Transformer.from_pretrained(str(tmp_path))


# -----------------------------------------------------------------------------
# progress

class Tty(io.StringIO):
    def isatty(self):
        return True


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_progress_on_a_terminal():
    out = Tty()
    clock = Clock()
    p = Progress(stream=out, clock=clock)
    # 16 steps of 1024 tokens, 0.1 s each: a draw every third step at most
    for step in range(1, 17):
        clock.t += 0.1
        p.update(1024 * step, 16384)
    lines = out.getvalue().split("\r")[1:]
    assert out.getvalue().endswith("\n") and 3 <= len(lines) <= 7
    done = 1024 * 3  # the first draw: 0.3 s in, after step 3
    elapsed = 0.3
    assert lines[0].rstrip() == (f"prefill {done}/16384 tokens, {done / elapsed:.0f} tok/s, "
                                 f"ETA {(16384 - done) / (done / elapsed):.0f}s")
    assert lines[-1].rstrip() == f"prefill 16384/16384 tokens, {16384 / 1.6:.0f} tok/s"
    # each line blanks the tail of the one before it
    assert all(len(line.rstrip("\n")) >= len(lines[i].rstrip())
               for i, line in enumerate(lines[1:]))


@pytest.mark.parametrize("stream,enabled", [(io.StringIO(), True), (Tty(), False)],
                         ids=["not-a-tty", "disabled"])
def test_progress_silent(stream, enabled):
    clock = Clock()
    p = Progress(stream=stream, enabled=enabled, clock=clock)
    for step in range(1, 5):
        clock.t += 1.0
        p.update(step, 4)
    p.close()
    assert stream.getvalue() == ""


def test_progress_silent_for_a_short_prefill():
    out = Tty()
    clock = Clock()
    p = Progress(stream=out, clock=clock)
    clock.t += 0.05
    p.update(100, 100)
    assert out.getvalue() == ""
    assert [duration(s) for s in (4.4, 65, 7300)] == ["4s", "1m05s", "2h01m"]


def test_generate_chat_builds_transformers_ids(checkpoint, tmp_path, capsys):
    """`generate.py --chat --system S --prompt Q` on an instruct-style checkpoint feeds exactly the
    ids transformers' apply_chat_template(..., add_generation_prompt=True) builds, and batch lines
    may carry "messages"."""
    import shutil

    from runs import generate_cli
    ckpt = tmp_path / "instruct"
    shutil.copytree(checkpoint(vocab_size=384), ckpt)
    toks = build_json_ckpt(tmp_path / "tok", CHATML)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(toks / name, ckpt / name)
    question = "the lazy dog jumps over a fox"
    capsys.readouterr()
    argv = ["--ckpt", str(ckpt), "--chat", "--system", SYSTEM, "--prompt", question, "--json",
            "--max-new-tokens", "2", "--chunk-size", "16"]
    assert generate_cli.main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["prompt_ids"] == hf_chat_ids(ckpt, chat_messages(question, SYSTEM))
    tasks = tmp_path / "tasks.jsonl"
    out = tmp_path / "results.jsonl"
    task = {"id": "m", "messages": CHATS["turns"], "max_new_tokens": 2}
    tasks.write_text(json.dumps(task) + "\n")
    assert generate_cli.main(["--ckpt", str(ckpt), "--prompts", str(tasks), "--output", str(out),
                     "--chunk-size", "16"]) == 0
    assert json.loads(out.read_text())["prompt_ids"] == hf_chat_ids(ckpt, CHATS["turns"])
    capsys.readouterr()
    # --system needs --chat
    assert generate_cli.main(["--ckpt", str(ckpt), "--system", SYSTEM, "--prompt", question]) == 2
    assert "--chat" in capsys.readouterr().err
