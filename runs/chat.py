"""
Talk to a long document: `python chat.py`'s loop. The document (and --system) is prefilled once;
each turn renders only the new messages through the checkpoint's chat template, appends their
tokens to the same cache, and streams the answer. The session (runs/session.py) is saved after
every turn, so a kill loses at most the turn in flight, and --session DIR resumes it bit for bit.

    python chat.py --ckpt DIR --document paper.txt --session ~/chats/paper --offload cpu

A turn's tokens: the template renders the whole conversation; if that text starts with the text the
cache already holds (the conversation so far, the last answer as the model wrote it), only the rest
is encoded and computed. A template that rewrites earlier turns (some strip past reasoning) does not
extend: said once, and such a turn is computed from the start.
"""
import argparse
import contextlib
import json
import math
import os
import signal
import sys
import time

import torch

from checkpoint import CheckpointError
from generate import SEED_LIMIT, Sampling, generate
from kvcache import make_cache
from model import Transformer
from offload import COMPRESSIONS, MODES, OffloadConfig
from pools import OffloadError
from private import PrivateError, make_private_dir
from runs.flags import (
    DTYPES,
    UsageError,
    add_common_flags,
    check_common,
    check_shapes,
    one_line_errors,
    open_kv_store,
    quantize_mode,
    read_model_args,
    rope_override,
    run_fingerprint,
    select_fields,
    set_threads,
)
from runs.monitor import fmt_bytes, open_trace
from runs.progress import Progress
from runs.session import (
    KV_DIR,
    TIER_DIR,
    SessionError,
    SessionLock,
    chunk_file,
    digest,
    is_session,
    list_sessions,
    new_digest,
    open_file,
    read_manifest,
    remove_file,
    remove_session,
    replay,
    restore_kv,
    save_kv,
    state_problem,
    write_manifest,
)
from runs.task import PromptCache, cpu_threads
from tokenizer import load_tokenizer

HELP = ("commands: /save (save now), /reset (forget the conversation, keep the document), "
        "/drop K (forget the K oldest turns, the rest recomputed), /stats (tiers, bytes moved, "
        "time to first token), /quit (or Ctrl-D); Ctrl-C stops an answer")


class Stop(Exception):
    """Ctrl-C: the answer ends at the next token (a point where every fed token is committed)."""


class Chat:
    """One session: the model, its cache, the conversation, and the session directory."""

    def __init__(self, model, tokenizer, path, settings, cfg, max_length, max_new_tokens,
                 sampling, log, write, trace=None):
        self.model = model
        self.tok = tokenizer
        self.path = path
        self.settings = settings  # what the KV's bits depend on: refused when a session differs
        self.cfg = cfg
        self.C = settings["chunk_size"]
        self.max_length = max_length
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling
        self.log = log        # notes and refusals (stderr)
        self.write = write    # the answer's text (stdout)
        self.trace = trace
        self.stop = False
        self.cache = None
        self.last = {}        # the last turn's numbers, for /stats
        self.warned = False
        self.extra = {}       # recorded, never compared: threads, sampling, the checkpoint's path

    # ---- the state ------------------------------------------------------------------------------

    def start(self, system):
        """A new conversation: the system message (the document in it) prefilled, if the template
        renders it apart from what follows."""
        self.messages = [] if system is None else [{"role": "system", "content": system}]
        self.head = ""  # the template's text of the system message alone, when it renders apart
        self.tokens, self.segments, self.pending = [], [], []
        self.gen, self.crcs, self.open_crc, self.turns = 0, [], None, 0
        if system is not None:
            head = self.tok.render_chat(self.messages, add_generation_prompt=False)
            probe = self.render(self.messages + [{"role": "user", "content": "?"}])
            if head and probe.startswith(head):
                self.head = head
                self.tokens = self.tok.encode_rendered(head)
                self.segments = [[0, len(self.tokens), "prefill"]]
                rest = self.tok.encode_rendered(probe[len(head):], continues=True)
                if self.tokens + rest != self.tok.encode_rendered(probe):
                    self.log("chat.py: the chat template's turns do not meet at a special token, "
                             "so a turn's tokens may differ at the seam from an encoding of the "
                             "whole conversation at once (the cache holds what the model was "
                             "given)")
            else:
                self.log("chat.py: the chat template does not render the system message apart "
                         "from the first question; the document is computed with it")
        self.rendered = self.head
        self.open_cache()

    def open_cache(self):
        if self.cache is not None:
            self.cache.store.close()
        tier = None
        if self.cfg.mode == "disk":
            tier = os.path.join(self.path, TIER_DIR)
            make_private_dir(tier, "the session's disk tier")
        self.cache = make_cache(self.model, self.cfg, self.C, self.max_length, tier,
                                kv_dtype=self.settings["kv_dtype"])

    def close(self):
        """Stop the store's workers; the disk tier's files go (every run rebuilds them)."""
        if self.cache is not None:
            self.cache.store.close()
        tier = os.path.join(self.path, TIER_DIR)
        if os.path.isdir(tier) and not os.path.islink(tier):
            for name in os.listdir(tier):
                remove_file(os.path.join(tier, name))

    def manifest(self):
        return {**self.settings, **self.extra, "messages": self.messages, "tokens": self.tokens,
                "segments": self.segments, "pending": self.pending, "rendered": self.rendered,
                "length": self.cache.length, "gen": self.gen, "chunks": self.crcs,
                "open": self.open_crc, "turns": self.turns, "head": self.head}

    def save(self):
        """Files first, then the manifest naming them, then the files it no longer names."""
        self.crcs, self.open_crc = save_kv(self.path, self.cache, self.gen, self.crcs,
                                           self.open_crc)
        write_manifest(self.path, self.manifest())
        keep = {os.path.basename(chunk_file(self.path, self.gen, j)) for j in range(len(self.crcs))}
        if self.open_crc:
            keep.add(os.path.basename(open_file(self.path, self.gen, self.open_crc["length"])))
        kv = os.path.join(self.path, KV_DIR)
        for name in os.listdir(kv):
            if name not in keep:
                remove_file(os.path.join(kv, name))

    def resume(self):
        """The saved session: refused when its settings are not this run's, else its KV
        restored."""
        m, why = read_manifest(self.path)
        if why:
            raise SessionError(f"--session {self.path}: {why}; remove it (chat.py --remove "
                               f"{self.path}) or give another --session")
        # the settings a person gives first, the fingerprint (which covers some of them) last
        for key, flag in FLAG_OF.items():
            if m.get(key) != self.settings[key]:
                what = (f"{flag} {m.get(key)} (this run: {self.settings[key]})" if flag else
                        "other weights (or another --rope-scaling, --quantize or --kv-dtype)")
                raise SessionError(f"--session {self.path} was made with {what}; resume it with "
                                   "what it was made with, or give another --session")
        why = state_problem(m, self.model.args.n_layers, self.model.args.vocab_size,
                            self.model.args.max_context)
        if why:
            raise SessionError(f"--session {self.path}: {MANIFEST_NAME} {why}; remove it "
                               f"(chat.py --remove {self.path}) or give another --session")
        held = len(m["tokens"]) + len(m["pending"])
        if held >= self.max_length:
            raise SessionError(f"--session {self.path} holds {held} positions, which leave no "
                               f"room in --max-length {self.max_length}; raise --max-length")
        self.messages, self.tokens, self.segments = m["messages"], m["tokens"], m["segments"]
        self.pending, self.rendered, self.gen = m["pending"], m["rendered"], m["gen"]
        self.turns, self.head = m["turns"], m["head"]
        self.open_cache()
        restore_kv(self.path, self.cache, m, self.log)
        self.crcs = m["chunks"][:self.cache.n_sealed]
        self.open_crc = m["open"] if self.cache.length == (m["open"] or {}).get("length") else None
        return len(self.tokens) - self.cache.length

    def prefill_document(self, kv_store=None, progress=None):
        """A new session's first step: the system message and the document. With --kv-store the
        stored prefix of its full chunks is adopted (the bytes its prefill makes, bit for bit) and
        the chunks computed here are stored for the next session."""
        if kv_store is None or not self.tokens:
            self.catch_up(progress)
            return
        P = self.segments[0][1]
        stored = PromptCache(kv_store, self.cache, self.tokens[:P], self.settings["fingerprint"],
                             self.model)
        try:
            stored.adopt(self.cache)
            self.catch_up(progress, on_step=lambda cache: stored.store_sealed(cache))
            n = stored.finish()
        finally:
            stored.close()
        self.log(f"kv store: {n['reused_tokens']} document tokens adopted, {n['stored_tokens']} "
                 "stored")

    def catch_up(self, progress=None, on_step=None):
        """Compute what the tokens hold past the cache (a document being prefilled, positions whose
        saved KV failed its check), with the first run's schedule; Ctrl-C stops it between steps
        (what is done is kept)."""
        total = len(self.tokens)
        if self.cache.length >= total:
            return

        def step(phase, logits, cache):
            if on_step:
                on_step(cache)
            if progress:
                progress.update(cache.length, total)
            if self.stop:
                raise Stop

        try:
            replay(self.model, self.cache, self.tokens, self.segments, step)
        except Stop:
            self.log(f"\nchat.py: stopped at {self.cache.length} of {total} tokens; the rest is "
                     "computed before the next answer")
        finally:
            if progress:
                progress.close()

    # ---- a turn ---------------------------------------------------------------------------------

    def render(self, messages):
        return self.tok.render_chat(messages, add_generation_prompt=True)

    def turn(self, question, progress=None):
        """Ask one question: the answer streams; the turn is committed and saved when it ends
        (Ctrl-C ends it early). Returns None, or one sentence saying why it was not asked."""
        t0 = time.perf_counter()
        self.catch_up(progress)
        if self.cache.length < len(self.tokens):
            return "the document is not prefilled yet; ask again to go on with it"
        messages = self.messages + [{"role": "user", "content": question}]
        text = self.render(messages)
        restart = not text.startswith(self.rendered)
        if restart:
            if not self.warned:
                self.log("chat.py: the chat template does not render this conversation as an "
                         "extension of the last turn; this turn is computed from the start")
                self.warned = True
            seg = self.tok.encode_rendered(text)
            base = 0
        else:
            seg = self.pending + self.tok.encode_rendered(text[len(self.rendered):],
                                                          continues=bool(self.tokens))
            base = self.cache.length
        room = self.max_length - base - len(seg)
        if room < 1:
            return (f"the conversation holds {base} of {self.max_length} positions and this "
                    f"question needs {len(seg) + 1}; /drop K forgets the K oldest turns (the rest "
                    "is recomputed), /reset starts over with the document, or start a new "
                    "session with a longer --max-length (up to the model's context)")
        if restart:
            self.gen += 1
            self.crcs, self.open_crc = [], None
            self.tokens, self.segments, self.pending = [], [], []
            self.head = ""
            self.open_cache()
        out, stats = self.answer(self.tokens + seg, min(self.max_new_tokens, room), t0)
        # commit: every token but the last is in the cache; the last is fed with the next turn
        L = self.cache.length
        self.segments.append([base, base + len(seg), "prefill"])
        self.tokens = self.tokens + seg + out[:-1]
        if len(out) > 1:
            self.segments.append([base + len(seg), L, "decode"])
        self.pending = [] if out[-1] in self.tok.eos_ids else out[-1:]
        answer = self.tok.decode(out)
        self.messages = messages + [{"role": "assistant", "content": answer}]
        self.rendered = text + answer
        self.turns += 1
        self.save()
        stats.update(turn=self.turns, context=L, tokens=out)
        self.last = stats
        if self.trace:
            self.trace.write(json_line({"t": time.time(), "turn": stats}))
        if stats["stopped"]:
            self.write("\n[stopped]")
        if len(out) == min(self.max_new_tokens, room) and room <= self.max_new_tokens:
            self.log("\nchat.py: the answer reached the end of the context "
                     f"({self.max_length} positions); /reset starts over with the document")
        return None

    def answer(self, ids, max_new, t0):
        """Generate after ids (the whole conversation, the cache holding all but the turn's own
        tokens), streaming the text. Returns (the answer's ids, the turn's numbers)."""
        shown = [""]
        got = []
        clock = {"first": None, "prefill_end": None}
        h = new_digest()
        before = dict(self.cache.store.snapshot()["bytes"])
        start = self.cache.length

        def on_token(out):
            got[:] = out
            if clock["first"] is None:
                clock["first"] = time.perf_counter()
            full = self.tok.decode(out)
            self.write(full[len(shown[0]):])
            shown[0] = full
            if self.stop:
                raise Stop

        def on_step(phase, logits, cache):
            digest(h, logits)
            if phase == "prefill":
                clock["prefill_end"] = time.perf_counter()

        t1 = time.perf_counter()
        device = self.cache.store.device
        stopped = False
        try:
            generate(self.model, self.cache, torch.tensor([ids], device=device), max_new,
                     self.sampling, self.tok.eos_ids, on_token, on_step)
        except Stop:
            stopped = True
        t2 = time.perf_counter()
        after = self.cache.store.snapshot()["bytes"]
        return list(got), {
            "question_tokens": len(ids) - start,
            "ttft_s": round(clock["first"] - t0, 4),
            "prefill_s": round((clock["prefill_end"] or t1) - t1, 4),
            "answer_s": round(t2 - clock["first"], 4),
            "stopped": stopped,
            "logits_sha256": h.hexdigest(),
            "bytes": {k: after[k] - before.get(k, 0) for k in after},
        }

    # ---- commands -------------------------------------------------------------------------------

    def reset(self):
        """Forget the conversation, keep the system message and the document, and their KV: the
        cache is cut back to them."""
        P = self.segments[0][1] if self.head else 0
        old = self.cache
        self.cache = None
        self.open_cache()
        copy_prefix(old, self.cache, min(P, old.length))
        old.store.close()
        system = self.messages[:1] if self.messages and self.messages[0]["role"] == "system" else []
        self.messages = system
        self.tokens = self.tokens[:P]
        self.segments = [[0, P, "prefill"]] if P else []
        self.pending = []
        self.rendered = self.head
        # the chunks wholly inside the document are the same bytes: their files stay
        self.crcs = self.crcs[:self.cache.n_sealed]
        self.open_crc = None
        self.turns = 0
        self.last = {}
        self.save()

    def drop(self, k):
        """Forget the k oldest questions and their answers; the system message and the document
        keep their KV, the turns kept are computed again at their new positions. Returns None, or
        why not."""
        system = 1 if self.messages and self.messages[0]["role"] == "system" else 0
        if k < 1 or k > self.turns:
            return f"/drop takes a number of turns from 1 to {self.turns}"
        kept = self.messages[:system] + self.messages[system + 2 * k:]
        P = self.segments[0][1] if self.head else 0
        tokens = self.tokens[:P]
        text = self.head
        if len(kept) > system:
            text = self.tok.render_chat(kept, add_generation_prompt=False)
            if not text.startswith(self.head):
                return "the chat template renders the document differently without those turns"
            tokens = tokens + self.tok.encode_rendered(text[len(self.head):],
                                                       continues=bool(tokens))
        if len(tokens) >= self.max_length:
            return "what is left still fills the context; /reset starts over with the document"
        old = self.cache
        self.cache = None
        self.open_cache()
        copy_prefix(old, self.cache, min(P, old.length))
        old.store.close()
        self.gen += 1  # later chunks change: files of their own
        self.crcs = []
        self.open_crc = None
        self.messages = kept
        self.segments = [[0, P, "prefill"]] if P else []
        if len(tokens) > P:
            self.segments.append([P, len(tokens), "prefill"])
        self.tokens, self.pending, self.rendered = tokens, [], text
        self.turns -= k
        self.catch_up()
        self.save()
        return None

    def stats(self):
        snap = self.cache.store.snapshot()
        per_layer = {k: v // self.model.args.n_layers for k, v in snap["chunks"].items()}
        lines = [f"context {self.cache.length} of {self.max_length} positions, {self.turns} turns; "
                 f"chunks per layer device/host/disk {per_layer['device']}/{per_layer['host']}/"
                 f"{per_layer['disk']}"]
        moved = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in snap["bytes"].items() if v)
        lines.append(f"bytes moved: {moved or 'none'}")
        if self.last:
            s = self.last
            lines.append(f"last turn: {s['question_tokens']} tokens of its own, time to first "
                         f"token {s['ttft_s']:.3f} s (its forward steps {s['prefill_s']:.3f} s), "
                         f"{len(s['tokens'])} tokens answered")
        return "\n".join(lines)


# the settings the KV's bits depend on -> the flag that sets each (the fingerprint: the weights)
FLAG_OF = {"dtype": "--dtype", "chunk_size": "--chunk-size", "kv_dtype": "--kv-dtype",
           "device": "--device", "select": "--select", "fingerprint": None}
MANIFEST_NAME = "session.json"


def copy_prefix(old, new, n):
    """Put positions [0, n) of cache old into the empty cache new: its sealed chunks, then the
    partial one, bytes as they are (the schedule that made them is the document's)."""
    store = old.store
    C = old.chunk_size
    host = [torch.empty(store.shape, dtype=store.dtype) for _ in range(store.n_layers)]
    for j in range(n // C + (1 if n % C else 0)):
        for l, dst in enumerate(host):
            if j < old.n_sealed:
                store.read_back(l, j, dst)
            else:
                dst.copy_(store.open_chunk(l))
            new.store.open_chunk(l).copy_(dst)
        k = min(C, n - j * C)
        new.begin(k)
        if new.commit():
            new.store.seal(j)


def json_line(obj):
    return json.dumps(obj) + "\n"


@contextlib.contextmanager
def interruptible(chat):
    """Ctrl-C sets chat.stop instead of raising wherever Python happens to be (half-way through a
    step, a seal, a save): the loops check it where every fed token is committed."""
    def interrupt(signum, frame):
        chat.stop = True
    chat.stop = False
    old = signal.signal(signal.SIGINT, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def repl(chat, read=input, progress=None):
    """Ask for a line with '> ', answer it; returns the exit code. Ctrl-C stops an answer (and,
    at the prompt, clears the line); Ctrl-D or /quit ends the session, saved."""
    while True:
        try:
            line = read("> ")
        except EOFError:
            chat.write("\n")
            return 0
        except KeyboardInterrupt:
            chat.write("\n")
            continue
        with interruptible(chat):
            if command(chat, line.strip(), progress):
                return 0


def command(chat, line, progress):
    """One line typed at the prompt: a command or a question. True to end the session."""
    if not line:
        return False
    if not line.startswith("/"):
        why = chat.turn(line, progress() if progress else None)
        if why:
            chat.log(f"chat.py: {why}")
        else:
            chat.write("\n")
        return False
    cmd = line.split()[0]
    if cmd == "/quit":
        return True
    if cmd == "/save":
        chat.save()
        chat.log(f"saved: {chat.path} (resume with --session {chat.path})")
    elif cmd == "/reset":
        chat.reset()
        chat.log("a new conversation; the document is kept")
    elif cmd == "/drop":
        arg = line.split()[1:]
        why = chat.drop(int(arg[0]) if len(arg) == 1 and arg[0].isdigit() else 0)
        chat.log(f"chat.py: {why}" if why else f"{chat.turns} turns kept")
    elif cmd == "/stats":
        chat.log(chat.stats())
    elif cmd == "/help":
        chat.log(HELP)
    else:
        chat.log(f"chat.py: {cmd} is not a command; {HELP}")
    return False


# -----------------------------------------------------------------------------
# the command line

SESSIONS = "./chat_sessions"  # where a session goes without --session, and what --list lists


def build_parser():
    p = argparse.ArgumentParser(
        prog="chat.py", description="Talk to a long document: each turn computes only its own "
        "tokens; the session is saved after every turn and resumed bit for bit with --session.")
    add_common_flags(p, chunk_size=None, window=4)
    p.add_argument("--document", metavar="FILE",
                   help="a UTF-8 text file put in the system message and prefilled once")
    p.add_argument("--system", help="a system message (before the document)")
    p.add_argument("--session", metavar="DIR",
                   help="the session's directory: resumed if it holds one, else made (default: a "
                   f"new one under {SESSIONS}/)")
    p.add_argument("--list", metavar="DIR", nargs="?", const=SESSIONS,
                   help=f"list the sessions under DIR (default {SESSIONS}) and exit")
    p.add_argument("--remove", metavar="SESSION", help="remove a session directory and exit")
    p.add_argument("--offload", choices=MODES, default="none",
                   help="where sealed chunks beyond the window go (default %(default)s)")
    p.add_argument("--compress", choices=COMPRESSIONS, default="none",
                   help="compress disk chunks (lossless)")
    p.add_argument("--max-new-tokens", type=int, default=256,
                   help="tokens per answer at most (default %(default)s)")
    p.add_argument("--max-length", type=int,
                   help="positions the conversation may reach (default: the model's context)")
    p.add_argument("--temperature", type=float,
                   help="0 = greedy (default: the session's, else 0)")
    p.add_argument("--top-k", type=int, help="sample among the k most likely (default: off)")
    p.add_argument("--top-p", type=float, help="nucleus sampling mass (default: off)")
    p.add_argument("--seed", type=int, help="sampling seed (default: the session's, else 0)")
    p.add_argument("--trace", help="TRACE.jsonl: one event per turn, appended to")
    return one_line_errors(p)


def main(argv=None):
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file-size limit fails a write, not us
    lock = chat = None
    try:
        if args.list:
            return list_main(args.list)
        if args.remove:
            remove_session(args.remove)
            print(f"removed {args.remove}")
            return 0
        chat, lock, fresh = setup(args)
        kv_store = open_kv_store(args) if fresh else None
    except (UsageError, CheckpointError, OffloadError, SessionError, PrivateError,
            ValueError) as e:
        print(f"chat.py: error: {e}", file=sys.stderr)
        if lock is not None:
            lock.close()
        return 2
    try:
        if fresh:
            chat.save()  # the session exists before its first long step
            t = time.perf_counter()
            with interruptible(chat):
                chat.prefill_document(kv_store, Progress("document"))
            took = time.perf_counter() - t
            chat.save()
            print(f"document: {chat.cache.length} tokens prefilled in {took:.2f} s",
                  file=sys.stderr)
            if chat.trace:
                chat.trace.write(json_line({"t": time.time(), "document": {
                    "tokens": chat.cache.length, "prefill_s": round(took, 4)}}))
        print(f"session {chat.path}: {chat.cache.length} tokens, {chat.turns} turns; /help lists "
              "the commands", file=sys.stderr)
        try:
            import readline  # noqa: F401 -- line editing for input(), where the platform has it
        except ImportError:
            pass
        rc = repl(chat, progress=lambda: Progress("prefill"))
        chat.save()
        return rc
    except (OSError, OffloadError) as e:
        print(f"\nchat.py: error: {e}; the turn in flight is dropped, every turn before it is "
              f"saved (resume with --session {chat.path})", file=sys.stderr)
        return 1
    finally:
        chat.close()
        lock.close()


def list_main(root):
    if not os.path.isdir(root):
        print(f"chat.py: error: --list {root}: no such directory", file=sys.stderr)
        return 2
    for name, m, why in list_sessions(root):
        if why:
            print(f"{name}: cannot be used ({why})")
            continue
        print(f"{name}: {m['turns']} turns, {len(m['tokens'])} tokens, {m['dtype']}, chunk "
              f"{m['chunk_size']}, {m.get('ckpt')}")
    return 0


def setup(args):
    """Check every flag, open or make the session, load the model: (Chat, lock, whether new)."""
    if not args.ckpt:
        raise UsageError("--ckpt DIR is needed: a checkpoint with a chat template")
    if args.tp:
        raise UsageError("--tp: chat.py runs one process; drop --tp")
    path = args.session or os.path.join(SESSIONS, time.strftime("%Y%m%d-%H%M%S"))
    m = None
    if is_session(path):
        m, why = read_manifest(path)
        if why:
            raise SessionError(f"--session {path}: {why}; remove it (chat.py --remove {path}) or "
                               "give another --session")
    elif os.path.isdir(path) and os.listdir(path):
        raise UsageError(f"--session {path} is a directory that holds no session; give a new or "
                         "empty directory")
    # what the KV's bits depend on, taken from the session unless given
    saved = m or {}
    if args.chunk_size is None:
        args.chunk_size = saved.get("chunk_size", 512)
    if args.dtype is None and saved.get("dtype") in DTYPES and args.quantize == "none":
        args.dtype = saved["dtype"]
    if args.threads is None and saved.get("threads"):
        args.threads = saved["threads"]
    sampling = saved.get("sampling") or {}
    # a forged manifest (its checksum recomputed) must not reach a flag with a value of the wrong
    # type: the checks below see these values as if typed
    if not (type(args.chunk_size) is int and (type(args.threads) is int or args.threads is None)
            and isinstance(sampling, dict)):
        raise SessionError(f"--session {path}: {MANIFEST_NAME} holds settings of the wrong type; "
                           f"remove it (chat.py --remove {path}) or give another --session")
    sampling = {k: v for k, v in sampling.items() if type(v) in (int, float)}
    s = Sampling(*(v if v is not None else sampling.get(k, getattr(Sampling, k)) for k, v in (
        ("temperature", args.temperature), ("top_k", args.top_k), ("top_p", args.top_p),
        ("seed", args.seed))))
    checks = [
        (args.max_new_tokens > 0, f"--max-new-tokens must be >= 1, got {args.max_new_tokens}"),
        (args.max_length is None or args.max_length > 1,
         f"--max-length must be >= 2, got {args.max_length}"),
        (math.isfinite(s.temperature) and s.temperature >= 0 and s.top_k >= 0
         and 0 < s.top_p <= 1,
         "--temperature must be a number >= 0, --top-k >= 0 and --top-p in (0, 1]"),
        (abs(s.seed) < SEED_LIMIT, f"--seed must be below {SEED_LIMIT} in size"),
        (os.path.isdir(args.ckpt), f"--ckpt {args.ckpt}: no such directory"),
        (args.compress == "none" or args.offload == "disk",
         "--compress zstd applies to the disk tier; add --offload disk"),
    ]
    for ok, msg in checks:
        if not ok:
            raise UsageError(msg)
    system = None
    if m is None:
        system = system_text(args)
    elif args.document or args.system is not None:
        if system_text(args) != (m["messages"][:1] or [{}])[0].get("content"):
            raise UsageError(f"--session {path} holds a conversation about its own document and "
                             "system message; drop --document and --system to resume it")
    check_common(args, needs_disk=False)
    model_args = read_model_args(args.ckpt, args)
    check_shapes(args, model_args)
    max_length = args.max_length or model_args.max_context
    if max_length > model_args.max_context:
        raise UsageError(f"--max-length {max_length} is past the model's context of "
                         f"{model_args.max_context} positions")
    tok = load_tokenizer(args.ckpt)
    if tok is None:
        raise UsageError(f"--ckpt {args.ckpt} has no tokenizer.model or tokenizer.json")
    tok.chat_template()  # a checkpoint without one is refused before any weight is read
    fresh = m is None
    make_private_dir(path, "--session")
    lock = SessionLock(path)
    try:
        model = Transformer.from_pretrained(args.ckpt, device=args.device,
                                            dtype=DTYPES[args.dtype],
                                            rope_override=rope_override(args),
                                            quantize=quantize_mode(args))
        set_threads(args)
        settings = {"fingerprint": run_fingerprint(args.ckpt, args), "dtype": args.dtype,
                    "device": torch.device(args.device).type, "chunk_size": args.chunk_size,
                    "kv_dtype": args.kv_dtype, "select": [args.select, args.select_budget,
                                                          args.select_dense, args.window]}
        if args.select == "all":
            settings["select"] = None
        cfg = OffloadConfig(mode=args.offload, window=args.window, cpu_budget_gib=args.cpu_budget,
                            compress=args.compress, staging_slots=args.staging_slots,
                            **select_fields(args))
        trace = open_trace(args.trace) if args.trace else None
        chat = Chat(model, tok, path, settings, cfg, max_length, args.max_new_tokens, s,
                    log=print_err, write=write_out, trace=trace)
        chat.extra = {"threads": cpu_threads(args.device), "sampling": vars(s), "ckpt": args.ckpt}
        if fresh:
            chat.start(system)
            if len(chat.tokens) >= max_length:
                raise UsageError(f"the document and system message are {len(chat.tokens)} tokens, "
                                 f"at or past the {max_length} positions of the context; "
                                 "shorten the document or raise --max-length")
        else:
            if m.get("threads") != chat.extra["threads"]:
                print_err(f"chat.py: the session was computed with {m.get('threads')} threads; "
                          f"{chat.extra['threads']} now change the bits of what follows (not of "
                          "what is saved)")
            chat.resume()
    except BaseException:
        lock.close()
        raise
    return chat, lock, fresh


def system_text(args):
    """The system message: --system, then the document (read here, UTF-8), or None."""
    parts = [] if args.system is None else [args.system]
    if args.document:
        try:
            with open(args.document, encoding="utf-8") as f:
                parts.append(f.read())
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--document {args.document}: cannot be read ({e})") from None
    return "\n\n".join(parts) if parts else None


def print_err(msg):
    print(msg, file=sys.stderr, flush=True)


def write_out(text):
    sys.stdout.write(text)
    sys.stdout.flush()
