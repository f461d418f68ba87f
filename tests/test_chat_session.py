"""
chat.py driven through a pseudo-terminal as a person drives it: type a question, read the answer
off the screen, Ctrl-C in the middle of one, quit, kill, resume. The reference for every resumed
turn is the same turn of a session that never stopped: the same tokens and the same logits (a
SHA-256 of every step's logits, from the trace). The first answer is judged against generate()
over the whole conversation rendered by the template at once.
"""
import errno
import io
import json
import os
import pty
import re
import select
import shutil
import signal
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "assets", "tinyllama-pydoc")
# the demo's vocabulary has no chat tokens: <s> opens a message and </s> ends it, so every seam
# between turns sits at a special token, as in ChatML or Llama 3's templates
TEMPLATE = ("{% for m in messages %}{{ bos_token }}### {{ m.role }}:\n{{ m.content }}"
            "{{ eos_token }}\n{% endfor %}"
            "{% if add_generation_prompt %}{{ bos_token }}### assistant:\n{% endif %}")
# a few hundred tokens, so that the document fills sealed chunks and leaves an open one
DOCUMENT = ("A module is a file containing Python definitions and statements. The file name is the "
            "module name with the suffix .py appended. Within a module, the module's name is "
            "available as the value of the global variable __name__. ") * 6
FLAGS = ["--chunk-size", "32", "--max-new-tokens", "64", "--threads", "1", "--max-length", "1024"]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@pytest.fixture(scope="module")
def chat_ckpt(tmp_path_factory):
    """The demo model with a chat template added."""
    path = tmp_path_factory.mktemp("demo-chat")
    for name in os.listdir(DEMO):
        shutil.copy(os.path.join(DEMO, name), path / name)
    (path / "chat_template.jinja").write_text(TEMPLATE)
    doc = path / "doc.txt"
    doc.write_text(DOCUMENT)
    return str(path)


class Terminal:
    """chat.py on a pseudo-terminal: what it prints is the screen; keys go to its input, Ctrl-C
    as the terminal's interrupt character (a SIGINT from the line discipline)."""

    def __init__(self, *argv):
        env = {**os.environ, "TERM": "dumb", "OMP_NUM_THREADS": "1"}
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: chat.py with the terminal as stdin, stdout and stderr
            os.chdir(ROOT)
            os.execve(sys.executable, [sys.executable, "chat.py", *argv], env)
        self.screen = ""
        self.seen = 0  # what expect() has matched so far
        self.at_prompt = False

    def expect(self, pattern, timeout=60):
        """Read until pattern appears after what was matched last; returns the text up to it."""
        deadline = time.monotonic() + timeout
        while True:
            m = re.search(pattern, self.screen[self.seen:])
            if m:
                text = self.screen[self.seen:self.seen + m.end()]
                self.seen += m.end()
                return text
            left = deadline - time.monotonic()
            assert left > 0, f"no {pattern!r} on the screen:\n{self.screen[-2000:]}"
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready:
                try:
                    data = os.read(self.fd, 4096)
                except OSError:  # the child is gone
                    data = b""
                assert data, f"chat.py ended before {pattern!r}:\n{self.screen[-2000:]}"
                self.screen += ANSI.sub("", data.decode(errors="replace").replace("\r", ""))

    def type(self, text):
        os.write(self.fd, text.encode())

    def prompt(self):
        """Wait for the '> ' that asks for the next line (at once if it is showing)."""
        if not self.at_prompt:
            self.expect(r"(^|\n)> $")
        self.at_prompt = True

    def ask(self, question):
        """Type a question at the prompt; returns once the answer has begun on the screen."""
        self.prompt()
        self.type(question + "\n")
        self.at_prompt = False
        self.expect(re.escape(question) + r"\n")  # the terminal's echo
        self.expect(r"\S")

    def waiting_for_a_key(self, timeout=30):
        """Until chat.py's main thread sleeps in readline's select(): a signal that lands between
        the prompt and that select() is seen only at the next key (readline's own race), so a
        test sends its signals after it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with open(f"/proc/{self.pid}/wchan") as f:
                    wchan = f.read()
            except OSError:
                wchan = "0"
            if "select" in wchan or "poll" in wchan:
                return
            if wchan == "0":  # a kernel that does not say: a second is plenty in practice
                time.sleep(1.0)
                return
            time.sleep(0.01)

    def wait(self, timeout=60):
        """The exit status, reading the screen meanwhile."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                os.close(self.fd)
                return os.waitstatus_to_exitcode(status)
            ready, _, _ = select.select([self.fd], [], [], 0.1)
            if ready:
                try:
                    self.screen += os.read(self.fd, 4096).decode(errors="replace")
                except OSError:
                    pass
        os.kill(self.pid, signal.SIGKILL)
        raise AssertionError(f"chat.py did not end:\n{self.screen[-2000:]}")

    def kill(self):
        os.kill(self.pid, signal.SIGKILL)
        return self.wait()


def turns(trace):
    with open(trace) as f:
        return [json.loads(line)["turn"] for line in f if '"turn"' in line]


def chat_in_process(argv, lines):
    """chat.py's main() in this process, its input the given lines: (exit code, stdout, stderr).
    Cheaper than a terminal (no second torch to import), for the references and the refusals."""
    from runs.chat_cli import main
    old = sys.stdin, sys.stdout, sys.stderr
    sys.stdin = io.StringIO("".join(line + "\n" for line in lines))
    sys.stdout, sys.stderr = io.StringIO(), io.StringIO()
    try:
        rc = main(argv)
        return rc, sys.stdout.getvalue(), sys.stderr.getvalue()
    finally:
        sys.stdin, sys.stdout, sys.stderr = old


QUESTIONS = ["What is a module?", "And its name?"]
TIERS = ["--offload", "disk", "--window", "1"]


@pytest.fixture(scope="module")
def reference(chat_ckpt, tmp_path_factory):
    """The turns of a session never stopped: the document on the disk tier behind a window of one
    chunk, then QUESTIONS."""
    tmp = tmp_path_factory.mktemp("reference")
    rc, _, _ = chat_in_process(["--ckpt", chat_ckpt, *FLAGS, *TIERS, "--document",
                                os.path.join(chat_ckpt, "doc.txt"), "--session", str(tmp / "s"),
                                "--trace", str(tmp / "t.jsonl")], QUESTIONS)
    assert rc == 0
    return turns(tmp / "t.jsonl")


def test_a_session_killed_stopped_and_resumed_gives_the_uninterrupted_tokens_and_logits(
        chat_ckpt, tmp_path, reference):
    """Through a terminal: a session killed in the middle of an answer, resumed, asked the next
    question (the turn that was being answered is lost, nothing before it): the tokens and logits of
    a session that was never stopped. Then Ctrl-C in the middle of an answer: the session goes on,
    and a copy of it resumed later answers the next question as the session itself does."""
    doc = os.path.join(chat_ckpt, "doc.txt")
    common = ["--ckpt", chat_ckpt, *FLAGS, *TIERS]
    want = reference
    assert len(want) == 2 and want[1]["question_tokens"] < 40  # the turn's own tokens only

    s = str(tmp_path / "s")
    t = Terminal(*common, "--document", doc, "--session", s)
    t.ask("What is a module?")
    t.ask("Say more, at length.")
    t.kill()  # the answer has begun
    t = Terminal(*common, "--session", s, "--trace", str(tmp_path / "b.jsonl"))
    t.expect(r"1 turns")
    t.ask("And its name?")
    t.prompt()
    got = turns(tmp_path / "b.jsonl")
    assert got[0]["tokens"] == want[1]["tokens"]
    assert got[0]["logits_sha256"] == want[1]["logits_sha256"]
    # the resumed session recomputed nothing: the saved KV was put back as it was
    assert got[0]["context"] == want[1]["context"] and "recomputing" not in t.screen

    t.ask("Tell me everything.")
    t.type("\x03")  # Ctrl-C, mid-answer
    t.expect(r"\[stopped\]")
    t.prompt()
    # the session as the stop left it, copied while chat.py waits for the next question
    shutil.copytree(s, tmp_path / "copy")
    t.type("/bogus\n")
    t.at_prompt = False
    t.expect(r"/bogus is not a command")
    t.ask("And then?")
    t.prompt()
    t.type("\x04")  # Ctrl-D ends the session
    assert t.wait() == 0
    a = turns(tmp_path / "b.jsonl")
    assert a[1]["stopped"] and len(a[1]["tokens"]) < 64
    rc, _, _ = chat_in_process([*common, "--session", str(tmp_path / "copy"), "--trace",
                                str(tmp_path / "c.jsonl")], ["And then?"])
    assert rc == 0
    c = turns(tmp_path / "c.jsonl")
    assert (c[0]["tokens"], c[0]["logits_sha256"]) == (a[2]["tokens"], a[2]["logits_sha256"])


def test_sigterm_mid_answer_and_sighup_at_the_prompt_end_the_session_saved(chat_ckpt, tmp_path):
    """A scheduler's SIGTERM in the middle of an answer stops it as Ctrl-C does (the turn kept,
    stopped) and ends the session, saved: 143 and one line. A closed terminal's SIGHUP at the
    prompt: 129. Each reopens with every turn it had."""
    common = ["--ckpt", chat_ckpt, *FLAGS, *TIERS]
    s = str(tmp_path / "s")
    t = Terminal(*common, "--document", os.path.join(chat_ckpt, "doc.txt"), "--session", s)
    t.ask("Tell me everything.")
    os.kill(t.pid, signal.SIGTERM)
    assert t.wait() == 143, t.screen[-2000:]
    assert f"chat.py: stopped (SIGTERM); the session is saved (resume with --session {s})" in (
        t.screen), t.screen[-2000:]
    assert "Traceback" not in t.screen, t.screen[-2000:]
    rc, _, err = chat_in_process([*common, "--session", s, "--trace", str(tmp_path / "a.jsonl")],
                                 ["And then?"])
    assert rc == 0 and " tokens, 1 turns;" in err, err
    assert len(turns(tmp_path / "a.jsonl")) == 1
    t = Terminal(*common, "--session", s)
    t.prompt()
    t.waiting_for_a_key()
    os.kill(t.pid, signal.SIGHUP)
    assert t.wait() == 129, t.screen[-2000:]
    assert "chat.py: stopped (SIGHUP); the session is saved" in t.screen, t.screen[-2000:]
    rc, _, err = chat_in_process([*common, "--session", s], [])
    assert rc == 0 and " tokens, 2 turns;" in err, err


def test_an_int4_session_resumes_resets_and_drops_exactly(chat_ckpt, tmp_path):
    """--kv-dtype int4 holds the open chunk's keys beside its bytes: a session saves its sealed
    chunks and recomputes the open one with the first run's schedule, so a resumed session answers
    as the uninterrupted one, bit for bit; /reset and /drop work (they crashed)."""
    common = ["--ckpt", chat_ckpt, *FLAGS, *TIERS, "--kv-dtype", "int4"]
    doc = ["--document", os.path.join(chat_ckpt, "doc.txt")]
    rc, _, err = chat_in_process([*common, *doc, "--session", str(tmp_path / "a"), "--trace",
                                  str(tmp_path / "a.jsonl")], QUESTIONS)
    assert rc == 0, err
    rc, _, err = chat_in_process([*common, *doc, "--session", str(tmp_path / "b")], QUESTIONS[:1])
    assert rc == 0, err
    rc, _, err = chat_in_process([*common, "--session", str(tmp_path / "b"), "--trace",
                                  str(tmp_path / "b.jsonl")], QUESTIONS[1:] + ["/reset",
                                                                             QUESTIONS[0],
                                                                             "/drop 1"])
    assert rc == 0 and "the document is kept" in err and "0 turns kept" in err, err
    a, b = turns(tmp_path / "a.jsonl"), turns(tmp_path / "b.jsonl")
    assert (b[0]["tokens"], b[0]["logits_sha256"]) == (a[1]["tokens"], a[1]["logits_sha256"])
    # after /reset, the first question again: the first turn's answer, bit for bit
    assert (b[1]["tokens"], b[1]["logits_sha256"]) == (a[0]["tokens"], a[0]["logits_sha256"])


def test_a_session_keeps_its_answer_length_and_says_when_it_is_new(chat_ckpt, tmp_path):
    """--max-new-tokens, when not given, is the session's (as the sampling flags are): a session
    resumed without it answers as it did. A --session that does not exist is a new session, said
    when it has no document (a resume line with a mistyped path gave an empty session silently)."""
    argv = ["--ckpt", chat_ckpt, "--chunk-size", "32", "--threads", "1", "--session",
            str(tmp_path / "s"), "--trace", str(tmp_path / "t.jsonl")]
    rc, _, err = chat_in_process([*argv, "--max-new-tokens", "3"], ["What is a module?"])
    assert rc == 0 and f"chat.py: {tmp_path / 's'} is a new session, without a document" in err
    rc, _, err = chat_in_process(argv, ["And its name?"])
    assert rc == 0 and "new session" not in err, err
    assert [len(t["tokens"]) for t in turns(tmp_path / "t.jsonl")] == [3, 3]


def test_a_disk_tier_that_cannot_be_reserved_is_one_sentence(chat_ckpt, tmp_path, monkeypatch):
    """--offload disk reserves the tier for --max-length positions as the session opens: a disk
    without the room is one sentence naming the session and the ways out (a traceback before,
    naming --offload-dir, which chat.py does not have), and no session is left."""
    import disk

    def full(fd, size):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(disk, "reserve", full)
    s = tmp_path / "s"
    rc, _, err = chat_in_process(session_argv(chat_ckpt, s, None, *TIERS), ["What is a module?"])
    assert rc == 2 and "Traceback" not in err, err
    assert (f"chat.py: error: --session {s}: its disk tier cannot be made for --max-length 1024 "
            "positions (No space left on device); free space there, give a smaller --max-length, "
            "or --offload cpu") in err, err
    assert not s.exists()


def session_argv(ckpt, path, trace=None, *more):
    argv = ["--ckpt", ckpt, *FLAGS, "--session", str(path), *more]
    return argv + (["--trace", str(trace)] if trace else [])


def test_first_answer_is_what_the_whole_conversation_gives(chat_ckpt, tmp_path):
    """The document prefilled apart, then the question's own tokens: the same ids as the template's
    rendering of the whole conversation at once, and the same greedy answer as generate() over it
    on a fresh cache."""
    from generate import generate
    from kvcache import make_cache
    from model import Transformer
    from offload import OffloadConfig
    from tokenizer import Tokenizer
    doc = os.path.join(chat_ckpt, "doc.txt")
    trace = tmp_path / "t.jsonl"
    rc, _, _ = chat_in_process(session_argv(chat_ckpt, tmp_path / "s", trace, "--document", doc),
                               ["What is a module?"])
    assert rc == 0
    tok = Tokenizer(chat_ckpt)
    ids = tok.apply_chat_template([{"role": "system", "content": DOCUMENT},
                                   {"role": "user", "content": "What is a module?"}])
    with open(tmp_path / "s" / "session.json") as f:
        saved = json.load(f)
    assert saved["tokens"][:len(ids)] == ids
    model = Transformer.from_pretrained(chat_ckpt)
    cache = make_cache(model, OffloadConfig(), 32, 1024)
    want = generate(model, cache, torch.tensor([ids]), 64, eos_ids=tok.eos_ids)
    assert turns(trace)[0]["tokens"] == want


def test_a_damaged_chunk_is_recomputed_to_the_same_bits(chat_ckpt, tmp_path, reference):
    """A saved chunk that fails its CRC32 is computed again with the first run's schedule (the
    document a chunk-aligned step at a time, the answer a token at a time): the next turn's
    logits are still the uninterrupted session's."""
    doc = os.path.join(chat_ckpt, "doc.txt")
    r = tmp_path / "r"
    rc, _, _ = chat_in_process(session_argv(chat_ckpt, r, None, *TIERS, "--document", doc),
                               QUESTIONS[:1])
    assert rc == 0
    # chunk 1 of the session that stopped after one turn loses a byte
    path = r / "kv" / "g0-c1.kv"
    data = bytearray(path.read_bytes())
    data[100] ^= 1
    path.write_bytes(bytes(data))
    rc, _, err = chat_in_process(session_argv(chat_ckpt, r, tmp_path / "b.jsonl", *TIERS),
                                 QUESTIONS[1:])
    assert rc == 0 and "fails its checksum; recomputing the conversation from position 32" in err
    b = turns(tmp_path / "b.jsonl")
    assert (b[0]["tokens"], b[0]["logits_sha256"]) == (reference[1]["tokens"],
                                                       reference[1]["logits_sha256"])


def test_refusals_are_one_sentence_and_lose_nothing(chat_ckpt, tmp_path):
    doc = os.path.join(chat_ckpt, "doc.txt")
    s = tmp_path / "s"
    rc, _, _ = chat_in_process(session_argv(chat_ckpt, s, None, "--document", doc),
                               ["What is a module?"])
    assert rc == 0
    saved = {p: p.read_bytes() for p in s.rglob("*") if p.is_file() and p.name != "lock"}
    # private: the directories 700, every file 600
    modes = {p.relative_to(s): p.stat().st_mode & 0o777 for p in [s, *s.rglob("*")]}
    assert modes and all(m == (0o700 if (s / p).is_dir() else 0o600) for p, m in modes.items())
    other = tmp_path / "other"  # the same shapes, other weights (config.json is fingerprinted)
    shutil.copytree(chat_ckpt, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-6}))
    for argv, needle in [
        (session_argv(chat_ckpt, s) + ["--chunk-size", "16"], "--chunk-size 32 (this run: 16)"),
        (session_argv(chat_ckpt, s) + ["--dtype", "bf16"], "--dtype fp32 (this run: bf16)"),
        (session_argv(chat_ckpt, s) + ["--products", "compiled"],
         "--products as the default (this run: compiled)"),
        (session_argv(str(other), s), "other weights"),
        (session_argv(chat_ckpt, s) + ["--document", os.path.join(other, "config.json")],
         "drop --document"),
        (session_argv(chat_ckpt, tmp_path / "new", None, "--document", doc, "--max-length", "100"),
         "shorten the document"),
    ]:
        rc, out, err = chat_in_process(argv, [])
        assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1, (needle, err)
    # a damaged manifest: refused, with what to do, and left as it was
    m = s / "session.json"
    text = m.read_text()
    m.write_text(text.replace('"turns": 1', '"turns": 2'))
    rc, _, err = chat_in_process(session_argv(chat_ckpt, s), [])
    assert rc == 2 and "does not match its checksum" in err and "--remove" in err
    m.write_text(text)
    assert saved == {p: p.read_bytes() for p in s.rglob("*") if p.is_file() and p.name != "lock"}
    # the context's end: the question is refused, the session goes on
    rc, _, err = chat_in_process(session_argv(chat_ckpt, s, None, "--max-length", "300"), [])
    assert rc == 2 and "raise --max-length" in err
    cap = str(len(json.loads(m.read_text())["tokens"]) + 20)
    rc, out, err = chat_in_process(session_argv(chat_ckpt, s, None, "--max-length", cap),
                                   ["a question far too long " * 20, "/stats"])
    assert rc == 0 and f"of {cap} positions and this question needs" in err and "1 turns" in err
    # listed, then removed
    rc, out, _ = chat_in_process(["--list", str(tmp_path)], [])
    assert rc == 0 and "s: 1 turns" in out
    rc, _, _ = chat_in_process(["--remove", str(s)], [])
    assert rc == 0 and not s.exists()
    rc, _, err = chat_in_process(["--remove", str(other)], [])
    assert rc == 2 and "not a session directory" in err and other.exists()


def test_a_template_that_rewrites_past_turns_keeps_what_it_did_not_change(chat_ckpt, tmp_path):
    """A template that drops earlier answers (as some drop past reasoning) does not extend the
    conversation: said once; the cache keeps the positions whose tokens did not change (the
    document among them) back to a point where their record replays exactly, and computes the
    rest. The answer is generate()'s over the whole conversation with those positions computed in
    the same steps; /reset then keeps the document."""
    from generate import generate, prefill
    from kvcache import make_cache
    from model import Transformer
    from offload import OffloadConfig
    from tokenizer import Tokenizer
    ckpt = tmp_path / "m"
    shutil.copytree(chat_ckpt, ckpt)
    (ckpt / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m.role != 'assistant' %}<s>### {{ m.role }}:\n"
        "{{ m.content }}</s>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<s>### "
        "assistant:\n{% endif %}")
    trace = tmp_path / "t.jsonl"
    doc = os.path.join(chat_ckpt, "doc.txt")
    # a first question of over a chunk: the cut falls on a chunk boundary inside it
    questions = [("What is a module? Say what a module holds and how it is named. " * 3).strip(),
                 "And its name?"]
    rc, _, err = chat_in_process(session_argv(str(ckpt), tmp_path / "s", trace, "--document", doc),
                                 [*questions, "/reset"])
    assert rc == 0 and err.count("renders the conversation so far differently") == 1, err
    assert "a new conversation; the document is kept" in err, err
    t = turns(trace)
    P = t[0]["context"] - t[0]["question_tokens"] - len(t[0]["tokens"]) + 1  # the document's
    cut = t[1]["context"] - t[1]["question_tokens"] - len(t[1]["tokens"]) + 1
    assert P < cut < t[0]["context"] and cut % 32 == 0, (P, cut)

    tok = Tokenizer(str(ckpt))
    ids = torch.tensor([tok.apply_chat_template(
        [{"role": "system", "content": DOCUMENT}, {"role": "user", "content": questions[0]},
         {"role": "user", "content": questions[1]}])])
    model = Transformer.from_pretrained(str(ckpt))
    cache = make_cache(model, OffloadConfig(), 32, 1024)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the session's --threads: a product's bits depend on them
    try:
        prefill(model, cache, ids[:, :P])     # the document's steps
        prefill(model, cache, ids[:, P:cut])  # the first turn's, as far as the cut
        assert generate(model, cache, ids, 64, eos_ids=tok.eos_ids) == t[1]["tokens"]
    finally:
        torch.set_num_threads(threads)


def test_a_template_that_refuses_a_turn_is_one_line_and_the_session_goes_on(chat_ckpt, tmp_path):
    """A template that raises at the second question (raise_exception) or fails on it (an
    undefined name): the sentence, the session unchanged and still asking."""
    for name, guard in (("raises", "{{ raise_exception('one question per conversation') }}"),
                        ("fails", "{{ nothing.here }}")):
        ckpt = tmp_path / name
        shutil.copytree(chat_ckpt, ckpt)
        (ckpt / "chat_template.jinja").write_text(
            "{% if messages|length > 2 %}" + guard + "{% endif %}" + TEMPLATE)
        rc, _, err = chat_in_process(session_argv(str(ckpt), tmp_path / f"s-{name}"),
                                     ["What is a module?", "And its name?", "/stats"])
        assert rc == 0 and "Traceback" not in err, err
        said = {"raises": "rejected the messages (one question per conversation)",
                "fails": "failed ('nothing' is undefined); fix the template"}[name]
        assert f"chat.py: the chat template of {ckpt} {said}" in err, err
        assert ", 1 turns;" in err, err  # /stats: the refused question changed nothing


def test_a_document_stored_by_one_session_is_adopted_by_the_next(chat_ckpt, tmp_path):
    doc = os.path.join(chat_ckpt, "doc.txt")
    store = ["--kv-store", str(tmp_path / "store")]
    answers = []
    for name, needle in (("a", "0 document tokens adopted, 288 stored"),
                         ("b", "288 document tokens adopted, 0 stored")):
        trace = tmp_path / f"{name}.jsonl"
        rc, _, err = chat_in_process(session_argv(chat_ckpt, tmp_path / name, trace, "--document",
                                                  doc, *store), ["What is a module?"])
        assert rc == 0 and needle in err, err
        answers.append((turns(trace)[0]["tokens"], turns(trace)[0]["logits_sha256"]))
    assert answers[0] == answers[1]


def test_dropping_the_oldest_turn_recomputes_the_rest_at_their_new_places(chat_ckpt, tmp_path,
                                                                         ):
    """/drop 1 after two turns: the document keeps its KV, the second turn is computed again right
    after it, and the next answer is what generate() gives over that conversation rendered at
    once."""
    from generate import generate
    from kvcache import make_cache
    from model import Transformer
    from offload import OffloadConfig
    from tokenizer import Tokenizer
    doc = os.path.join(chat_ckpt, "doc.txt")
    trace = tmp_path / "a.jsonl"
    rc, _, err = chat_in_process(session_argv(chat_ckpt, tmp_path / "a", trace, "--document", doc),
                                 ["What is a module?", "And its name?", "/drop 1", "/stats",
                                  "Why?"])
    assert rc == 0 and "1 turns kept" in err and "1 turns" in err
    with open(tmp_path / "a" / "session.json") as f:
        m = json.load(f)
    assert [x["content"] for x in m["messages"][1::2]] == ["And its name?", "Why?"]
    tok = Tokenizer(chat_ckpt)
    ids = tok.apply_chat_template(m["messages"][:-1])
    assert m["tokens"][:len(ids)] == ids
    model = Transformer.from_pretrained(chat_ckpt)
    want = generate(model, make_cache(model, OffloadConfig(), 32, 1024), torch.tensor([ids]), 64,
                    eos_ids=tok.eos_ids)
    assert turns(trace)[2]["tokens"] == want


def test_a_disk_that_fills_mid_answer_loses_only_that_turn(chat_ckpt, tmp_path, monkeypatch,
                                                          reference):
    """The disk tier fails (ENOSPC) in the middle of the second answer: chat.py ends in one
    sentence (exit 1), and the session resumed later answers that question as an uninterrupted
    session does."""
    import errno

    from disk import DiskError
    from offload import TieredStore
    doc = os.path.join(chat_ckpt, "doc.txt")
    seal = TieredStore.seal

    def full(self, j):  # chunk 12 seals at position 416, inside the second answer
        if j >= 12:
            raise DiskError(errno.ENOSPC, "No space left on device")
        return seal(self, j)
    monkeypatch.setattr(TieredStore, "seal", full)
    s = tmp_path / "s"
    rc, _, err = chat_in_process(session_argv(chat_ckpt, s, None, *TIERS, "--document", doc),
                                 QUESTIONS)
    last = err.strip().splitlines()[-1]
    assert rc == 1 and "No space left" in last and "the turn in flight is dropped" in last
    assert reference[0]["context"] < 384 < reference[1]["context"]  # the second turn's failure
    monkeypatch.setattr(TieredStore, "seal", seal)
    rc, _, err = chat_in_process(session_argv(chat_ckpt, s, tmp_path / "b.jsonl", *TIERS),
                                 QUESTIONS[1:])
    got = turns(tmp_path / "b.jsonl")
    assert rc == 0 and (got[0]["tokens"], got[0]["logits_sha256"]) == (
        reference[1]["tokens"], reference[1]["logits_sha256"])


def test_a_full_session_opens_and_a_failed_start_leaves_no_trace(chat_ckpt, tmp_path):
    """A session whose answer reached the end of the context opens again (its next question is
    refused, /reset makes room); a line that is not UTF-8 is refused and the session goes on; a kv/
    that is a link is refused before any work; a start that fails leaves no directory, and a
    directory holding only a failed start's lock can be started in."""
    doc = os.path.join(chat_ckpt, "doc.txt")
    probe = tmp_path / "probe"
    rc, _, _ = chat_in_process(session_argv(chat_ckpt, probe, None, "--document", doc), [])
    cap = str(len(json.loads((probe / "session.json").read_text())["tokens"]) + 30)
    s = tmp_path / "s"
    rc, _, err = chat_in_process(session_argv(chat_ckpt, s, None, "--document", doc,
                                              "--max-length", cap), ["What is a module?"])
    assert rc == 0 and "reached the end of the context" in err, err
    rc, out, err = chat_in_process(session_argv(chat_ckpt, s, None, "--max-length", cap),
                                   ["And its name?", "/reset", "\udcff\udcfe bad", "/stats"])
    assert rc == 0 and "this question needs" in err and "a new conversation" in err, err
    assert "not UTF-8" in err and "Traceback" not in err, err
    kv = s / "kv"
    os.rename(kv, tmp_path / "kv-moved")
    os.symlink(tmp_path / "kv-moved", kv)
    rc, _, err = chat_in_process(session_argv(chat_ckpt, s, None, "--max-length", cap), [])
    assert rc == 2 and "symbolic link" in err and len(err.strip().splitlines()) == 1, err
    new = tmp_path / "new"
    rc, _, err = chat_in_process(session_argv(chat_ckpt, new, None, "--document", doc,
                                              "--trace", str(tmp_path)), [])
    assert rc == 2 and "--trace" in err and not new.exists(), err
    new.mkdir(mode=0o700)
    (new / "lock").write_text("12345\n")
    os.chmod(new / "lock", 0o600)
    rc, _, err = chat_in_process(session_argv(chat_ckpt, new, None, "--document", doc), [])
    assert rc == 0 and (new / "session.json").is_file(), err
