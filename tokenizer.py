"""
Tokenizers of Hugging Face checkpoints: `tokenizer.model` (sentencepiece: Llama 1/2, Mistral) or
`tokenizer.json` (the tokenizers library: Llama 3, Qwen2). BOS and EOS ids come from config.json
and generation_config.json. Instruct models also get their chat template rendered here, as
transformers renders it.
"""
import functools
import json
import os
import re
from datetime import datetime

from checkpoint import CheckpointError, check_config, check_token_ids, read_json

# the named special tokens transformers hands to a chat template (its SPECIAL_TOKENS_ATTRIBUTES)
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")
BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # a byte-fallback token's name


class TemplateError(ValueError):
    """The chat template refused or failed on a conversation: one sentence, nothing changed."""


class Tokenizer:
    def __init__(self, ckpt_dir):
        self.ckpt_dir = ckpt_dir
        config_path = os.path.join(ckpt_dir, "config.json")
        hf_config = read_json(config_path)
        check_config(hf_config, config_path)
        self.vocab_size = hf_config.get("vocab_size")
        gen_path = os.path.join(ckpt_dir, "generation_config.json")
        gen = read_json(gen_path) if os.path.exists(gen_path) else {}
        check_token_ids(gen, gen_path, hf_config.get("vocab_size"))
        self.bos_id = gen.get("bos_token_id", hf_config.get("bos_token_id"))
        # transformers' generate stops at any of generation_config's eos ids (Llama 3 instruct
        # lists two or three)
        eos = gen.get("eos_token_id", hf_config.get("eos_token_id"))
        if eos is None:
            eos = []
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])
        spm_path = os.path.join(ckpt_dir, "tokenizer.model")
        json_path = os.path.join(ckpt_dir, "tokenizer.json")
        # tokenizer.json is preferred when both exist: it carries the checkpoint's own BOS rule
        if os.path.exists(json_path):
            from tokenizers import Tokenizer as HFTokenizer
            try:
                self.tok = HFTokenizer.from_file(json_path)
            except Exception as e:
                raise CheckpointError(f"{json_path}: cannot be read by the tokenizers library "
                                      f"({e})") from None
            self.kind = "json"
            self.path = json_path
        elif os.path.exists(spm_path):
            import sentencepiece as spm
            self.tok = spm.SentencePieceProcessor()
            try:
                self.tok.Load(spm_path)
            except Exception as e:
                raise CheckpointError(f"{spm_path}: cannot be read by sentencepiece "
                                      f"({e})") from None
            self.kind = "spm"
            self.path = spm_path
            if self.bos_id is None:
                self.bos_id = self.tok.bos_id() if self.tok.bos_id() >= 0 else None
            if not self.eos_ids and self.tok.eos_id() >= 0:
                self.eos_ids = {self.tok.eos_id()}
        else:
            raise CheckpointError(f"{ckpt_dir}: no tokenizer.model or tokenizer.json; pass token "
                                  "ids instead of text")
        # sentencepiece checkpoints (Llama 2, Mistral) prepend BOS unless tokenizer_config.json says
        # otherwise
        tc_path = os.path.join(ckpt_dir, "tokenizer_config.json")
        tc = read_json(tc_path) if os.path.exists(tc_path) else {}
        if self.kind == "json" and loads_as_llama_tokenizer(hf_config, tc, json_path):
            llama_pipeline(self.tok, tc)
        add_bos = tc.get("add_bos_token", True)
        self.add_bos = self.kind == "spm" and add_bos and self.bos_id is not None
        # and append EOS where it says so (transformers' LlamaTokenizer)
        self.add_eos = (self.kind == "spm" and bool(tc.get("add_eos_token", False))
                        and self.tok.eos_id() >= 0)
        # special_tokens_map.json names what tokenizer_config.json leaves out (older checkpoints)
        map_path = os.path.join(ckpt_dir, "special_tokens_map.json")
        named = {**(read_json(map_path) if os.path.exists(map_path) else {}), **tc}
        self.special_tokens = special_tokens(named, self.tok if self.kind == "spm" else None)
        self.tokenizer_config = tc
        # a sentencepiece model's added tokens (ChatML markers on a Mistral fine-tune): text -> id,
        # matched in the text as transformers matches them; and the ids decode skips, as
        # transformers' skip_special_tokens does: every named special token and added special one
        self.added, special = {}, set()
        if self.kind == "spm":
            self.added, special = added_tokens(ckpt_dir, named, self.tok)
        else:
            add_named_tokens(self.tok, named, self.special_tokens)
        self.skip_ids = special | {self.id_of(t) for t in self.special_tokens.values()} - {None}
        # compiled on first use: a checkpoint whose template is broken still generates text
        self._template = None
        # transformers (LlamaTokenizer) gives text after a special token no sentencepiece prefix
        # space unless legacy
        self.legacy = bool(tc.get("legacy", False))
        self._bytes = None  # the byte-fallback ids of a tokenizer.json (is_byte), on first use

    def encode(self, text):
        # the file's post-processor decides about BOS (Llama 3 adds it, Qwen2 does not)
        if self.kind == "json":
            return self.in_vocab(self.tok.encode(text).ids)
        # special tokens typed in the text are their ids, as transformers and tokenizer.json have it
        ids = ([self.bos_id] if self.add_bos else []) + self.encode_rendered(text)
        return ids + ([self.tok.eos_id()] if self.add_eos else [])

    def id_of(self, text):
        """The id of a token's text, or None."""
        if self.kind == "json":
            return self.tok.token_to_id(text)
        if text in self.added:
            return self.added[text]
        i = self.tok.PieceToId(text)
        return i if self.tok.IdToPiece(i) == text else None

    def in_vocab(self, ids):
        """ids, each checked against config.json's vocab_size: a tokenizer that gives an id the
        embedding does not have belongs to other weights."""
        past = [i for i in ids if i >= (self.vocab_size or float("inf"))]
        if past:
            raise CheckpointError(f"{self.path} gave token id {past[0]}, past the vocab_size "
                                  f"{self.vocab_size} of {self.ckpt_dir}/config.json: the "
                                  "tokenizer and the weights do not belong together")
        return ids

    def prompt_ids(self, task, chat=False, system=None):
        """A task's prompt ids: its chat "messages" through the template, its "prompt" through the
        template with chat (and a system message), or its plain "prompt" text."""
        if "messages" in task:
            try:
                return self.apply_chat_template(task["messages"])
            except CheckpointError as e:  # no --chat was given: a task's messages asked for it
                raise CheckpointError(str(e).replace(
                    "drop --chat or add", "give the task a \"prompt\" instead of \"messages\", "
                    "or add")) from None
        if chat:
            return self.apply_chat_template(chat_messages(task["prompt"], system))
        return self.encode(task["prompt"])

    def decode(self, ids):
        ids = [i for i in ids if i not in self.skip_ids]
        if self.kind == "json":
            return self.tok.decode(ids, skip_special_tokens=True)
        # runs of the model's pieces, between added tokens (their text as it is); an id past both
        # is dropped, as the tokenizers library drops it
        text = {i: t for t, i in self.added.items()}
        parts, run = [], []
        for i in ids + [None]:
            if i is not None and 0 <= i < self.tok.GetPieceSize() and i not in text:
                run.append(i)
                continue
            if run:
                parts.append(self.tok.DecodeIds(run))
                run = []
            parts.append(text.get(i, ""))
        return "".join(parts)

    def is_byte(self, i):
        """Whether id i is a byte-fallback token (<0x41>): a run of them decodes as a whole, so a
        stream shows it only once it ends (TextStream)."""
        if self.kind == "spm":
            return 0 <= i < self.tok.GetPieceSize() and self.tok.IsByte(i)
        if self._bytes is None:
            self._bytes = {i for t, i in self.tok.get_vocab().items() if BYTE_TOKEN.fullmatch(t)}
        return i in self._bytes

    # -------------------------------------------------------------------------
    # chat

    def apply_chat_template(self, messages, add_generation_prompt=True, **template_vars):
        """The token ids of `messages` ([{"role", "content"}, ...]) rendered by the checkpoint's
        chat template, as transformers' apply_chat_template(messages, add_generation_prompt=...,
        tokenize=True) gives them. template_vars reach the template too, e.g.
        enable_thinking=False for Qwen3."""
        return self.encode_rendered(self.render_chat(messages, add_generation_prompt,
                                                     **template_vars))

    def render_chat(self, messages, add_generation_prompt=True, **template_vars):
        """The text the chat template makes of `messages` (apply_chat_template before encoding)."""
        import jinja2
        problem = messages_problem(messages)
        if problem:
            raise TemplateError(problem)
        template = self.chat_template()
        # keys set to None are dropped, as transformers does: templates handle a missing key better
        # than "None"
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        # tools and documents are None: templates test them to switch their tool-use sections off
        try:
            text = render(template, messages=messages, tools=None, documents=None,
                          add_generation_prompt=add_generation_prompt,
                          **{**self.special_tokens, **template_vars})
        except jinja2.exceptions.SecurityError as e:  # past a bound of compile_template's
            raise TemplateError(f"the chat template of {self.ckpt_dir} was stopped "
                                f"({one_line(e)}); it is not a template this project can "
                                "render") from None
        except jinja2.UndefinedError as e:  # the template's own mistake, not the messages'
            raise TemplateError(f"the chat template of {self.ckpt_dir} failed ({one_line(e)}); "
                                "fix the template, or drop --chat") from None
        except jinja2.TemplateError as e:
            # raise_exception() in the template, e.g. "roles must alternate"
            raise TemplateError(f"the chat template of {self.ckpt_dir} rejected the messages "
                                f"({one_line(e)}); check their roles and order (some templates "
                                "take no system message)") from None
        except Exception as e:  # the template is code from the checkpoint: any error is its own
            raise TemplateError(f"the chat template of {self.ckpt_dir} failed "
                                f"({type(e).__name__}: {one_line(e)}); fix the template, or drop "
                                "--chat") from None
        return text

    def chat_template(self):
        """The checkpoint's chat template, compiled; CheckpointError when it has none or it does not
        compile. Call it right after loading the tokenizer to fail before the model is loaded."""
        import jinja2
        if self._template is None:
            source, where = read_chat_template(self.ckpt_dir, self.tokenizer_config)
            if source is None:
                raise CheckpointError(f"{self.ckpt_dir} has no chat template "
                                      "(tokenizer_config.json 'chat_template' or "
                                      "chat_template.jinja); drop --chat or add a template to the "
                                      "checkpoint")
            try:
                self._template = compile_template(source)
            except (jinja2.TemplateError, RecursionError, MemoryError) as e:
                raise CheckpointError(f"{where}: the chat template is not valid jinja "
                                      f"({one_line(e)})") from None
        return self._template

    def encode_rendered(self, text, continues=False):
        """Encode a rendered chat: the template wrote BOS and the other special tokens itself, so
        none are added (transformers' add_special_tokens=False) and each special token's text
        becomes its one id. continues: the text goes on from a rendering already encoded (a chat's
        next turn), so its first piece gets no sentencepiece prefix space either."""
        if self.kind == "json":  # tokenizer.json matches its added tokens itself
            return self.in_vocab(self.tok.encode(text, add_special_tokens=False).ids)
        # sentencepiece reads "<s>" as three characters: split on the special and added tokens
        # first, as transformers does
        ids_of = {t: self.id_of(t) for t in set(self.special_tokens.values()) | set(self.added)}
        ids_of = {t: i for t, i in ids_of.items() if i is not None}
        if not ids_of:
            return self.in_vocab(self.tok.EncodeAsIds(text))
        longest_first = sorted(ids_of, key=len, reverse=True)
        pattern = "(" + "|".join(re.escape(t) for t in longest_first) + ")"
        ids = []
        # [text, special, text, special, ..., text]
        for i, piece in enumerate(re.split(pattern, text)):
            if i % 2:
                ids.append(ids_of[piece])
            elif piece:
                if self.legacy or (i == 0 and not continues):
                    ids += self.tok.EncodeAsIds(piece)
                else:
                    ids += self._encode_no_prefix(piece)
        return self.in_vocab(ids)

    def _encode_no_prefix(self, text):
        # sentencepiece prepends "▁" to every call; encode after a newline and drop the newline's
        # ids instead (transformers' own trick for pieces in the middle of a chat)
        newline = self.tok.EncodeAsIds("\n")
        ids = self.tok.EncodeAsIds("\n" + text)
        return ids[len(newline):] if ids[:len(newline)] == newline else self.tok.EncodeAsIds(text)


class TextStream:
    """The text of a growing list of token ids, shown as it grows. An update decodes a window of the
    newest ids twice, without and with the ids since the last update, and shows what the second
    adds: both decodes start at the same id, so what a decoder does at a text's start (a stripped
    leading space) cancels, and the ids before are context for the new ones. The window starts
    where the update before the last ended, so an update costs the ids since then, not all of them
    (decoding every id each token cost 1.7 ms a token at 8K tokens). The bytes of one UTF-8
    character may come in several tokens (byte fallback, byte-level BPE), so a text that ends in
    U+FFFD waits for the next token, and a run of byte-fallback tokens (is_byte) waits until it
    ends: its decoder turns the whole run into U+FFFDs when a later byte makes it invalid. The
    window moves on only where its text is whole, so it starts at a character, never inside a run,
    and only past ids that gave text: a decoder strips the space of the first id with text (an id
    it skips, such as <unk>, would pass it on). The last update (final) gives the text as it is.
    Shown text is never taken back: where a decode changes what was already shown, nothing more is
    shown until it agrees again."""

    def __init__(self, decode, is_byte=None):
        self.decode = decode
        self.is_byte = is_byte
        self.start = 0  # the window's first id
        self.end = 0  # the ids whose whole text was shown: ids[:end]
        self.tail = ""  # text shown past decode(ids[start:end]), before its character is whole
        self.shown = 0  # characters shown

    def update(self, ids, final=False):
        n = len(ids)
        while not final and self.is_byte and n > self.end and self.is_byte(ids[n - 1]):
            n -= 1  # a run of byte tokens not ended yet
        before = self.decode(ids[self.start:self.end]) + self.tail
        after = self.decode(ids[self.start:n])
        whole = final or not after.endswith("\ufffd")
        if not whole:
            after = after.rstrip("\ufffd")
        if not after.startswith(before):
            return ""
        new = after[len(before):]
        if whole:
            if new:  # the next window starts at this update's first id: one with text
                self.start = self.end
            self.end = n
            self.tail = ""
        else:
            self.tail += new
        self.shown += len(new)
        return new


def load_tokenizer(ckpt_dir):
    """The checkpoint's tokenizer, or None when it ships none (then only token ids can be
    generated)."""
    files = ("tokenizer.model", "tokenizer.json")
    if not any(os.path.exists(os.path.join(ckpt_dir, f)) for f in files):
        return None
    return Tokenizer(ckpt_dir)


# -----------------------------------------------------------------------------
# chat templates

def chat_messages(prompt, system=None):
    """The conversation for one prompt: a user message, after a system message when `system` is
    given (even "", which replaces the default system message some templates insert, e.g.
    Qwen2.5's)."""
    messages = [] if system is None else [{"role": "system", "content": system}]
    return messages + [{"role": "user", "content": prompt}]


def messages_problem(messages):
    """None when `messages` is a chat a template can render, else one sentence saying what is wrong
    with it."""
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty list of {\"role\": ..., \"content\": ...} objects"
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return f"'messages'[{i}] must be an object with string fields 'role' and 'content'"
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                return f"'messages'[{i}] needs a string '{key}', not {json.dumps(m.get(key))}"
        if not m["role"]:
            return (f"'messages'[{i}] has an empty 'role' (use \"system\", \"user\" or "
                    "\"assistant\")")
    return None


def special_tokens(tc, sp=None):
    """The special-token strings a template may use ({{ bos_token }}...), from
    tokenizer_config.json, where each is a string or {"content": ...}; a sentencepiece model fills
    bos/eos/unk from its pieces, as LlamaTokenizer does."""
    def text(v):
        return v.get("content") if isinstance(v, dict) else v
    extra = tc.get("extra_special_tokens")
    if not isinstance(extra, dict):
        extra = {}
    out = {k: text(tc.get(k)) for k in SPECIAL_TOKEN_NAMES}
    # named model-specific tokens, e.g. image_token
    out.update({k: text(v) for k, v in extra.items()})
    if sp is not None:
        pieces = (("bos_token", sp.bos_id()), ("eos_token", sp.eos_id()),
                  ("unk_token", sp.unk_id()))
        for name, i in pieces:
            if out.get(name) is None and i >= 0:
                out[name] = sp.IdToPiece(i)
    return {k: v for k, v in out.items() if isinstance(v, str)}


def loads_as_llama_tokenizer(hf_config, tc, json_path):
    """Whether transformers 5 (AutoTokenizer) loads this tokenizer.json as its LlamaTokenizer,
    which keeps the file's vocabulary, merges, added tokens and post-processor but builds its own
    normalizer, pre-tokenizer and decoder (llama_pipeline): a Llama model whose tokenizer_class
    is LlamaTokenizer (Llama 2's) and whose file is not byte-level (Llama 3's is). Mistral's and
    Qwen2's model types keep the file's own (Qwen2's class builds what its files hold)."""
    named = tc.get("tokenizer_class") or hf_config.get("tokenizer_class") or ""
    if hf_config.get("model_type") != "llama" or named.removesuffix("Fast") != "LlamaTokenizer":
        return False
    with open(json_path, encoding="utf-8", errors="replace") as f:
        return '"ByteLevel"' not in f.read()  # as transformers tells a byte-level file


def llama_pipeline(tok, tc):
    """transformers 5's LlamaTokenizer (tokenization_llama.py) on a tokenizers.Tokenizer: no
    normalizer; a Metaspace pre-tokenizer that turns spaces into "▁" and prepends one to the
    text unless it starts with one, to its first piece only ("first": text after a special token
    gets none), to every piece with legacy, to none with add_prefix_space false; a decoder that
    strips the prepended space again; byte fallback. A Llama 2 tokenizer.json's own normalizer
    prepends to every piece: other ids after a special token and for text that starts with a
    space."""
    from tokenizers import decoders, pre_tokenizers
    prefix = tc.get("add_prefix_space")
    prefix = True if prefix is None else bool(prefix)
    scheme = ("always" if tc.get("legacy") else "first") if prefix else "never"
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme,
                                                 split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    tok.model.byte_fallback = True
    tok.model.fuse_unk = True


def add_named_tokens(tok, tc, special):
    """Add to a tokenizer.json's tokenizer what transformers adds as it loads it and the file
    lacks: the tokens of tokenizer_config.json's added_tokens_decoder (in id order), then the
    named special tokens (special: bos_token...; additional_special_tokens), so that their text
    is one id and decode skips the special ones."""
    from tokenizers import AddedToken
    have = {t.content for t in tok.get_added_tokens_decoder().values()}
    decl = tc.get("added_tokens_decoder") or {}
    decl = [(int(i), d) for i, d in decl.items() if str(i).isdigit() and isinstance(d, dict)]
    extra = tc.get("additional_special_tokens")
    extra = [t.get("content") if isinstance(t, dict) else t for t in
             (extra if isinstance(extra, list) else [])]
    wanted = [(d.get("content"), d) for _, d in sorted(decl, key=lambda x: x[0])]
    wanted += [(t, {"special": True}) for t in [*special.values(), *extra]]
    for content, d in wanted:
        if not isinstance(content, str) or not content or content in have:
            continue
        flags = {k: bool(d[k]) for k in ("lstrip", "rstrip", "normalized", "single_word")
                 if k in d}
        flags.setdefault("normalized", not d.get("special", False))
        token = AddedToken(content, special=bool(d.get("special", False)), **flags)
        if d.get("special"):
            tok.add_special_tokens([token])
        else:
            tok.add_tokens([token])
        have.add(content)


def added_tokens(ckpt_dir, tc, sp):
    """A sentencepiece checkpoint's added tokens, as transformers reads them: ({text: id}, the ids
    of the special ones), from tokenizer_config.json's added_tokens_decoder, added_tokens.json and
    additional_special_tokens (pieces of the model, or added)."""
    added, special = {}, set()
    for i, d in (tc.get("added_tokens_decoder") or {}).items():
        if isinstance(d, dict) and isinstance(d.get("content"), str) and str(i).isdigit():
            added[d["content"]] = int(i)
            if d.get("special"):
                special.add(int(i))
    path = os.path.join(ckpt_dir, "added_tokens.json")
    for t, i in (read_json(path) if os.path.exists(path) else {}).items():
        if isinstance(i, int) and i >= 0:
            added.setdefault(t, i)
    # their text is matched whether or not the model has a piece of it
    added = {t: i for t, i in added.items() if i >= sp.GetPieceSize()
             or sp.IdToPiece(i) != t}
    extra = tc.get("additional_special_tokens")
    for t in extra if isinstance(extra, list) else []:
        t = t.get("content") if isinstance(t, dict) else t
        i = added.get(t)
        if i is None and isinstance(t, str):
            i = sp.PieceToId(t)
            i = i if sp.IdToPiece(i) == t else None
            if i is not None:
                added[t] = i
        if i is not None:
            special.add(i)
    return added, special


def read_chat_template(ckpt_dir, tc):
    """(template text, where it came from), or (None, None). chat_template.jinja wins over
    tokenizer_config.json, as in transformers; there 'chat_template' is a string or a list of
    {"name", "template"} whose "default" is used."""
    jinja_path = os.path.join(ckpt_dir, "chat_template.jinja")
    if os.path.exists(jinja_path):
        try:
            with open(jinja_path, encoding="utf-8") as f:
                return f.read(), jinja_path
        except UnicodeDecodeError:
            why = "not UTF-8 text; save the template as UTF-8"
        except OSError as e:  # a directory, a file this user cannot read
            why = f"cannot be read ({e.strerror}); it must be the chat template's text"
        raise CheckpointError(f"{jinja_path}: {why}")
    tc_path = os.path.join(ckpt_dir, "tokenizer_config.json")
    t = tc.get("chat_template")
    if isinstance(t, list):
        named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
        if "default" not in named:
            raise CheckpointError(f"{tc_path}: 'chat_template' lists templates "
                                  f"{sorted(map(str, named))} but none named \"default\"; add a "
                                  "chat_template.jinja with the one to use")
        t = named["default"]
    if t is not None and not isinstance(t, str):
        raise CheckpointError(f"{tc_path}: 'chat_template' must be a string or a list of "
                              "{name, template} objects")
    return (t, tc_path) if t is not None else (None, None)


# what a template may make: a chat template is code from the checkpoint, run in a sandbox (no
# attribute escapes, range() capped at 100,000) that also bounds what it allocates
TEMPLATE_MAX_CHARS = 1 << 24  # 16 Mi characters rendered: millions of tokens, past any context
TEMPLATE_MAX_INT_BITS = 1 << 20  # the largest integer a template may compute by ** (128 KiB)
WIDE_FORMAT = re.compile(r"\d{8,}")  # a width of 10**7 or more in a format string


def compile_template(source):
    """The template in the environment transformers renders it in: a sandbox (templates come from
    the Hub and are untrusted code), trim_blocks and lstrip_blocks, raise_exception, strftime_now,
    and a tojson that keeps non-ASCII; within bounds (bounded_sandbox) on what it may allocate."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        # {% generation %}...{% endgeneration %} marks assistant text for training masks; it renders
        # as its body
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = bounded_sandbox(ImmutableSandboxedEnvironment)(trim_blocks=True, lstrip_blocks=True,
                                                         extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.filters = {name: bounded_filter(f) for name, f in env.filters.items()}
    return env.from_string(source)


def bounded_sandbox(base):
    """A subclass of jinja's sandbox `base` in which a template cannot allocate much past
    TEMPLATE_MAX_CHARS: repetition (*), concatenation (+), powers (**), %-formatting, calls (an
    integer argument that large, a format width of 8 digits) and namespace attributes are checked
    before they run; render() caps the output."""
    from jinja2.utils import Namespace

    class BoundedNamespace(Namespace):
        def __setitem__(self, name, value):
            if isinstance(value, (str, list, tuple, dict)) and len(value) > TEMPLATE_MAX_CHARS:
                refuse(f"namespace attribute {name!r}")
            super().__setitem__(name, value)

    class Bounded(base):
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.globals["namespace"] = BoundedNamespace

        def call_binop(self, context, operator, left, right):
            sequences = (str, list, tuple)
            if operator == "*" and isinstance(right, sequences):
                left, right = right, left  # n * s: check as s * n
            if operator == "*" and isinstance(left, sequences) and type(right) is int:
                if len(left) * right > TEMPLATE_MAX_CHARS:
                    refuse("a repetition")
            if operator == "+" and isinstance(left, sequences) and isinstance(right, sequences):
                if len(left) + len(right) > TEMPLATE_MAX_CHARS:
                    refuse("a concatenation")
            if operator == "**" and type(left) is int and type(right) is int:
                if right * abs(left).bit_length() > TEMPLATE_MAX_INT_BITS:
                    refuse("a power")
            if operator == "%" and isinstance(left, str):  # "%*s" % (width, s) too
                check_arguments(left, right if isinstance(right, tuple) else (right,), {})
                if WIDE_FORMAT.search(left):
                    refuse("a format width")
            return super().call_binop(context, operator, left, right)

        def wrap_str_format(self, value):
            # "{:>99999999}".format: refused where the sandbox hands out str.format
            receiver = getattr(value, "__self__", None)
            if isinstance(receiver, str) and WIDE_FORMAT.search(receiver):
                refuse("a format width")
            return super().wrap_str_format(value)

        def call(__self, __context, __obj, *args, **kwargs):  # jinja's own signature
            check_arguments(__obj, args, kwargs)
            return super().call(__context, __obj, *args, **kwargs)

    return Bounded


def refuse(what):
    """Stop a template that is about to make more than it may."""
    from jinja2.exceptions import SecurityError
    raise SecurityError(f"{what} would pass {TEMPLATE_MAX_CHARS} characters, the most a chat "
                        "template may make")


def check_arguments(obj, args, kwargs):
    """A call from a template (of obj: a method, a macro, a filter) with an integer argument past
    TEMPLATE_MAX_CHARS (a width, a count), or a string or list past it, is refused before it
    runs."""
    for value in (*args, *kwargs.values()):
        if type(value) is int and abs(value) > TEMPLATE_MAX_CHARS:
            refuse(f"an argument of {value}")
        if isinstance(value, (str, list, tuple)) and len(value) > TEMPLATE_MAX_CHARS:
            refuse("an argument")


def bounded_filter(f):
    """A filter whose arguments check_arguments checks first (the format filter's format string
    too); it keeps jinja's markers (pass_context, ...), which functools.wraps copies."""
    @functools.wraps(f)
    def bounded(*args, **kwargs):
        check_arguments(f, args, kwargs)
        if f.__name__ == "do_format" and args and isinstance(args[0], str):
            if WIDE_FORMAT.search(args[0]):
                refuse("a format width")
        return f(*args, **kwargs)
    return bounded


def render(template, **context):
    """template.render(**context), streamed and stopped once past TEMPLATE_MAX_CHARS."""
    from jinja2.exceptions import SecurityError
    parts = []
    n = 0
    for part in template.generate(**context):
        n += len(part)
        if n > TEMPLATE_MAX_CHARS:
            raise SecurityError(f"the rendered chat is past {TEMPLATE_MAX_CHARS} characters")
        parts.append(part)
    return "".join(parts)


def one_line(e):
    return " ".join(str(e).split()) or type(e).__name__
