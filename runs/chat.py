"""
Talk to a long document: `python chat.py`'s loop. The document (and --system) is prefilled once;
each turn renders only the new messages through the checkpoint's chat template, appends their
tokens to the same cache, and streams the answer. The session (runs/session.py) is saved after
every turn, so a kill loses at most the turn in flight, and --session DIR resumes it bit for bit.

    python chat.py --ckpt DIR --document paper.txt --session ~/chats/paper --offload cpu

A turn's tokens: the template renders the whole conversation; if that text starts with the text the
cache already holds (the conversation so far, the last answer as the model wrote it), only the rest
is encoded and computed. A template that rewrites earlier turns (some strip past reasoning) does not
extend: said once, and such a turn keeps the positions whose tokens it did not change (exact_cut).
"""
import contextlib
import json
import os
import signal
import time

import torch

from checkpoint import CheckpointError
from disk import DiskError
from generate import generate
from kvcache import make_cache
from policy import default_dense
from pools import OffloadError
from private import make_private_dir
from runs.interrupt import Terminated, install, restore, status
from runs.monitor import fmt_bytes
from runs.session import (
    KV_DIR,
    TIER_DIR,
    SessionError,
    chunk_file,
    digest,
    new_digest,
    open_file,
    read_manifest,
    remove_file,
    replay,
    restore_kv,
    save_kv,
    state_problem,
    write_manifest,
)
from runs.task import PromptCache
from tokenizer import TemplateError, TextStream

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
        self.ending = None    # SIGTERM or SIGHUP came: the session ends, saved, after this turn
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
        try:  # the disk tier reserves room for --max-length positions up front
            self.cache = make_cache(self.model, self.cfg, self.C, self.max_length, tier,
                                    kv_dtype=self.settings["kv_dtype"])
        except DiskError as e:
            why = os.strerror(e.errno) if e.errno else str(e)
            raise OffloadError(f"--session {self.path}: its disk tier cannot be made for "
                               f"--max-length {self.max_length} positions ({why}); free space "
                               "there, give a smaller --max-length, or --offload cpu") from None

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
            was, now = m.get(key), self.settings.get(key)
            if key == "select" and isinstance(was, list) and isinstance(now, list):
                was, now = (self.effective_select(x) for x in (was, now))
                # the first setting of the selection that differs, under its own flag's name
                i = next((i for i, (a, b) in enumerate(zip(was, now)) if a != b), 0)
                flag, was, now = SELECT_FLAGS[i], was[i], now[i]
            if was != now:
                was, now = (v if v is not None else "as the default" for v in (was, now))
                what = (f"{flag} {was} (this run: {now})" if flag else
                        "other weights (or another --rope-scaling, --quantize or --kv-dtype)")
                raise SessionError(f"--session {self.path} was made with {what}; resume it with "
                                   "what it was made with, or give another --session")
        why = state_problem(m, self.model.args.n_layers, self.model.args.vocab_size,
                            self.model.args.max_context)
        if why:
            raise SessionError(f"--session {self.path}: {MANIFEST_NAME} {why}; remove it "
                               f"(chat.py --remove {self.path}) or give another --session")
        # a session as long as the context opens (its next question is refused, /reset and /drop
        # make room); one longer than this run's --max-length cannot be held
        held = len(m["tokens"])
        if held > self.max_length:
            raise SessionError(f"--session {self.path} holds {held} positions, more than "
                               f"--max-length {self.max_length}; raise --max-length")
        self.messages, self.tokens, self.segments = m["messages"], m["tokens"], m["segments"]
        self.pending, self.rendered, self.gen = m["pending"], m["rendered"], m["gen"]
        self.turns, self.head = m["turns"], m["head"]
        self.open_cache()
        restore_kv(self.path, self.cache, m, self.log)
        self.crcs = m["chunks"][:self.cache.n_sealed]
        self.open_crc = m["open"] if self.cache.length == (m["open"] or {}).get("length") else None
        return len(self.tokens) - self.cache.length

    def effective_select(self, select):
        """settings["select"] with --select-dense's default made explicit (None and the default's
        count select alike)."""
        name, budget, dense, window = select
        if dense is None:
            dense = default_dense(self.model.args.n_layers)
        return [name, budget, dense, window]

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
        rewritten = not text.startswith(self.rendered)
        if rewritten:
            # the template rewrote what it rendered before (an answer trimmed, past reasoning
            # dropped): the cache keeps the positions whose tokens are unchanged, back to a point
            # where the record of how they were computed replays exactly (exact_cut)
            ids = self.tok.encode_rendered(text)
            same = next((i for i, (a, b) in enumerate(zip(self.tokens, ids)) if a != b),
                        min(len(self.tokens), len(ids)))
            base = exact_cut(self.segments, same, self.C)
            seg = ids[base:]
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
        if rewritten:
            if not self.warned:
                self.log("chat.py: the chat template renders the conversation so far differently "
                         f"this turn; positions from {base} on are computed again (said once)")
                self.warned = True
            if self.head and base < self.segments[0][1]:
                self.head = ""  # the document itself is computed again: /reset cannot keep it
            self.keep_prefix(base)
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
        # a character split over tokens waits for them
        text_stream = TextStream(self.tok.decode, self.tok.is_byte)
        got = []
        clock = {"first": None, "prefill_end": None}
        h = new_digest()
        before = dict(self.cache.store.snapshot()["bytes"])
        start = self.cache.length

        def on_token(out):
            got[:] = out
            if clock["first"] is None:
                clock["first"] = time.perf_counter()
            self.write(text_stream.update(out))
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
        finally:
            if got:  # what waited for bytes that never came is shown as it is
                self.write(text_stream.update(got, final=True))
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

    def keep_prefix(self, n):
        """Cut the cache back to its first n positions, their bytes as they are, and the record of
        how they were computed with it (n: a point where that record replays exactly). A layout
        whose open chunk is not all in its bytes (int4) keeps the sealed chunks and computes the
        rest again, with the record's schedule."""
        old = self.cache
        self.cache = None
        self.open_cache()
        copy_prefix(old, self.cache, kept_positions(old, min(n, old.length)))
        old.store.close()
        self.tokens = self.tokens[:n]
        self.segments = [[a, min(b, n), kind] for a, b, kind in self.segments if a < n]
        self.pending = []
        # the chunks wholly inside the prefix are the same bytes: their files stay (a later chunk
        # is written again under its name, atomically; a crash before the manifest names it leaves
        # a file that fails its CRC, and is recomputed)
        self.crcs = self.crcs[:self.cache.n_sealed]
        self.open_crc = None
        self.catch_up()

    def reset(self):
        """Forget the conversation, keep the system message and the document, and their KV: the
        cache is cut back to them. Returns whether its KV was kept (not when an earlier turn's
        template rewrote it)."""
        P = self.segments[0][1] if self.head else 0
        self.keep_prefix(P)
        system = self.messages[:1] if self.messages and self.messages[0]["role"] == "system" else []
        self.messages = system
        self.rendered = self.head
        self.turns = 0
        self.last = {}
        self.save()
        return bool(P)

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
        self.keep_prefix(P)  # the document's KV
        self.gen += 1  # later chunks change: files of their own
        self.crcs = []
        self.messages = kept
        self.segments = [[0, P, "prefill"]] if P else []
        if len(tokens) > P:
            self.segments.append([P, len(tokens), "prefill"])
        self.tokens, self.pending, self.rendered = tokens, [], text
        self.turns -= k
        self.last = {}  # the last turn's figures were of a turn that may be gone
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
# settings["select"]: [--select, --select-budget, --select-dense, --window]
SELECT_FLAGS = ("--select", "--select-budget", "--select-dense", "--window")
FLAG_OF = {"dtype": "--dtype", "chunk_size": "--chunk-size", "kv_dtype": "--kv-dtype",
           "device": "--device", "select": "--select", "attention": "--attention",
           "products": "--products", "fingerprint": None}
MANIFEST_NAME = "session.json"


def exact_cut(segments, n, C):
    """The last position <= n where the cache can be cut and its record (segments: [start, end,
    "prefill" | "decode"], how each run of positions was computed) still replays to the same bits:
    a segment's end, any point of a decode segment (a step a token), a chunk boundary inside a
    prefill segment (its steps end at chunk boundaries)."""
    cut = 0
    for a, b, kind in segments:
        if a >= n:
            break
        if b <= n:
            cut = b
        else:
            cut = n if kind == "decode" else max(a, n // C * C)
    return cut


def kept_positions(cache, n):
    """How many of the first n positions a copy of cache's bytes keeps: n, or its sealed chunks
    only where the open chunk is not all in its bytes (int4's keys: the rest is recomputed with the
    record's schedule, catch_up)."""
    return n if cache.layout.open_in_bytes else n // cache.chunk_size * cache.chunk_size


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
    step, a seal, a save): the loops check it where every fed token is committed. SIGTERM and
    SIGHUP (a closed terminal) stop the turn so too, and set chat.ending: the session then ends,
    saved. A signal the process was started ignoring (nohup's SIGHUP) stays ignored."""
    def interrupt(signum, frame):
        chat.stop = True
        if signum != signal.SIGINT:
            chat.ending = signum
    chat.stop = False
    old = install(dict.fromkeys((signal.SIGINT, signal.SIGTERM, signal.SIGHUP), interrupt))
    try:
        yield
    finally:
        restore(old)


def repl(chat, read=input, progress=None):
    """Ask for a line with '> ', answer it; returns the exit code. Ctrl-C stops an answer (and,
    at the prompt, clears the line); Ctrl-D or /quit ends the session, saved; SIGTERM or SIGHUP
    end it too, after the turn in flight stops: 128 + the signal."""
    while True:
        try:
            line = read("> ")
        except EOFError:
            chat.write("\n")
            return 0
        except Terminated as e:  # at the prompt (runs/interrupt.py's handler)
            chat.write("\n")
            return status(e)
        except KeyboardInterrupt:
            chat.write("\n")
            continue
        with interruptible(chat):
            if command(chat, line.strip(), progress):
                return 0
        if chat.ending:
            return 128 + chat.ending


def command(chat, line, progress):
    """One line typed at the prompt: a command or a question. True to end the session."""
    if not line:
        return False
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:  # bytes that are not UTF-8 (input() kept them as surrogates)
        chat.log("chat.py: that line is not UTF-8 text; nothing was asked, type it again")
        return False
    try:
        return run_command(chat, line, progress)
    except (TemplateError, CheckpointError) as e:  # the template refused the conversation, or
        # the tokenizer gave an id the weights lack: nothing was changed
        chat.log(f"chat.py: {e}")
        return False


def run_command(chat, line, progress):
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
        system = chat.messages and chat.messages[0]["role"] == "system"
        kept = chat.reset()
        chat.log("a new conversation" + ("" if not system else "; the document is kept" if kept
                                         else "; the document is computed with the next question"))
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
