"""
`python chat.py`'s command line: the flags (generate.py's generation, offload and threading flags,
and the session's), the checks before any weight is read, the session opened or made, and the exit
codes: 0, 1 when the disk fails mid-turn (that turn dropped, the ones before it saved), 2 for a
refusal (one sentence; nothing saved is touched).
"""
import argparse
import math
import os
import signal
import sys
import time

import torch

from checkpoint import CheckpointError
from generate import MIN_TEMPERATURE, SEED_LIMIT, Sampling
from model import Transformer
from offload import COMPRESSIONS, MODES, OffloadConfig
from pools import OffloadError
from private import PrivateError, make_private_dir
from runs import interrupt
from runs.chat import MANIFEST_NAME, Chat, interruptible, json_line, repl
from runs.cores import CoreWatch
from runs.flags import (
    DTYPES,
    UsageError,
    add_common_flags,
    check_common,
    check_shapes,
    decode_kernels,
    one_line_errors,
    open_kv_store,
    policy_fields,
    quantize_mode,
    read_model_args,
    remove_if_empty,
    rope_override,
    run_fingerprint,
    set_threads,
    text_out,
)
from runs.monitor import open_trace
from runs.progress import Progress
from runs.session import (
    SessionError,
    SessionLock,
    check_subdirs,
    forget_start,
    is_session,
    list_sessions,
    read_manifest,
    remove_session,
)
from runs.task import cpu_threads
from tokenizer import load_tokenizer

SESSIONS = "./chat_sessions"  # where a session goes without --session, and what --list lists


def build_parser():
    p = argparse.ArgumentParser(
        prog="chat.py", description="Talk to a long document: each turn computes only its own "
        "tokens; the session is saved after every turn and resumed bit for bit with --session.")
    add_common_flags(p, chunk_size=None, window=4,
                     ckpt_help="Hugging Face checkpoint directory with a chat template (needed)")
    for action in p._actions:  # what differs from the other scripts: say it
        if action.dest == "chunk_size":
            action.help = ("positions per KV chunk, the unit of transfer (default: the session's, "
                           "else 512)")
        elif action.dest == "offload_dir":
            action.help = ("not used by chat.py: a session's disk tier lives in its own directory "
                           "(SESSION/tier/)")
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
    p.add_argument("--max-new-tokens", type=int,
                   help="tokens per answer at most (default: the session's, else 256)")
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
    text_out()
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file-size limit fails a write, not us
    lock = chat = None
    if args.list and args.remove:
        print("chat.py: error: --list and --remove are two commands; give one", file=sys.stderr)
        return 2
    try:
        if args.list:
            try:
                return list_main(args.list)
            except BrokenPipeError:  # `--list | head`
                return interrupt.closed_stdout_quietly()
        if args.remove:
            left = remove_session(args.remove)
            if left:
                print(f"removed the session's files; {args.remove} stays, holding what is not a "
                      f"session's: {', '.join(left)}")
            else:
                print(f"removed {args.remove}")
            return 0
        chat, lock, fresh = setup(args)
        kv_store = open_kv_store(args) if fresh else None
    except KeyboardInterrupt as e:  # while the session opened (setup undid a new one's start)
        if lock is not None:  # it came after setup: a new session's start goes too
            chat.close()
            if fresh:
                abandon_start(args, chat.path, lock, lock.created)
            else:
                lock.close()
        return interrupt.ended("chat.py", e, "a saved session is as it was; a new one was not "
                               "made")
    except (UsageError, CheckpointError, OffloadError, SessionError, PrivateError,
            ValueError) as e:
        print(f"chat.py: error: {e}", file=sys.stderr)
        if lock is not None:  # setup succeeded: a new session's start goes again
            chat.close()
            if fresh:
                abandon_start(args, chat.path, lock, lock.created)
            else:
                lock.close()
        return 2
    try:
        if fresh and args.document is None and args.system is None:
            print(f"chat.py: {chat.path} is a new session, without a document (--document FILE "
                  "gives it one)", file=sys.stderr)
        if fresh:
            chat.save()  # the session exists before its first long step
            t = time.perf_counter()
            with interruptible(chat):
                chat.prefill_document(kv_store, Progress("document"))
            took = time.perf_counter() - t
            chat.save()
            if chat.ending:  # SIGTERM or SIGHUP: what is prefilled is saved; the rest on resume
                return interrupt.ended("chat.py", interrupt.Terminated(chat.ending),
                                       f"the session is saved (resume with --session {chat.path})")
            if chat.cache.length:
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
        if rc > 128:  # SIGTERM or SIGHUP: the turn in flight stopped, the session saved
            return interrupt.ended("chat.py", interrupt.Terminated(rc - 128),
                                   f"the session is saved (resume with --session {chat.path})")
        return rc
    except BrokenPipeError:  # stdout's reader is gone (`| head`): as generate.py, 141
        print(f"chat.py: stdout was closed (a broken pipe): the turn in flight is dropped, every "
              f"turn before it is saved (resume with --session {chat.path})", file=sys.stderr)
        return interrupt.closed_stdout_quietly()
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
        if not all(k in m for k in ("turns", "tokens", "dtype", "chunk_size")):  # hand-edited
            print(f"{name}: cannot be used (its {MANIFEST_NAME} lacks fields)")
            continue
        print(f"{name}: {m['turns']} turns, {len(m['tokens'])} tokens, {m['dtype']}, chunk "
              f"{m['chunk_size']}, {m.get('ckpt')}")
    return 0


def setup(args):
    """Check every flag, open or make the session, load the model: (Chat, lock, whether new)."""
    watch = CoreWatch()  # how busy other processes keep the cores, until the model is loaded
    if not args.ckpt:
        raise UsageError("--ckpt DIR is needed: a checkpoint with a chat template")
    if args.tp:
        raise UsageError("--tp: chat.py runs one process; drop --tp")
    # a new session's name: the time and the process (two started in one second collided)
    new = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    path = args.session or os.path.join(SESSIONS, new)
    m = None
    if is_session(path):
        m, why = read_manifest(path)
        if why:
            raise SessionError(f"--session {path}: {why}; remove it (chat.py --remove {path}) or "
                               "give another --session")
        check_subdirs(path)
    elif os.path.isdir(path) and set(os.listdir(path)) - {"lock"}:  # a lock alone: a failed start
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
    if args.max_new_tokens is None:  # the session's, as its sampling: the same answers later
        args.max_new_tokens = saved.get("max_new_tokens", 256)
    sampling = saved.get("sampling") or {}
    # a forged manifest (its checksum recomputed) must not reach a flag with a value of the wrong
    # type: the checks below see these values as if typed
    if not (type(args.chunk_size) is int and (type(args.threads) is int or args.threads is None)
            and type(args.max_new_tokens) is int and isinstance(sampling, dict)):
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
        (math.isfinite(s.temperature) and (s.temperature == 0 or s.temperature >= MIN_TEMPERATURE)
         and s.top_k >= 0 and 0 < s.top_p <= 1,
         "--temperature must be 0 (greedy) or a number >= 1e-6, --top-k >= 0 and --top-p in "
         "(0, 1]"),
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
    try:
        tok.chat_template()  # a checkpoint without one is refused before any weight is read
    except CheckpointError as e:  # generate.py's advice (drop --chat) is not chat.py's
        raise UsageError(str(e).replace("drop --chat or ", "")) from None
    fresh = m is None
    created = make_private_dir(path, "--session")
    lock = SessionLock(path)
    lock.created = created  # main's forget_start, where the start fails after setup
    chat = None
    try:
        model = Transformer.from_pretrained(args.ckpt, device=args.device,
                                            dtype=DTYPES[args.dtype],
                                            rope_override=rope_override(args),
                                            quantize=quantize_mode(args))
        set_threads(args, watch, print_err)
        settings = {"fingerprint": run_fingerprint(args.ckpt, args), "dtype": args.dtype,
                    "device": torch.device(args.device).type, "chunk_size": args.chunk_size,
                    "kv_dtype": args.kv_dtype, "select": [args.select, args.select_budget,
                                                          args.select_dense, args.window]}
        if args.select == "all":
            settings["select"] = None
        settings.update(decode_kernels(args))
        cfg = OffloadConfig(mode=args.offload, window=args.window, cpu_budget_gib=args.cpu_budget,
                            compress=args.compress, staging_slots=args.staging_slots,
                            group_buffers=args.group_buffers,
                            **policy_fields(args))
        trace = open_trace(args.trace) if args.trace else None
        chat = Chat(model, tok, path, settings, cfg, max_length, args.max_new_tokens, s,
                    log=print_err, write=write_out, trace=trace)
        chat.extra = {"threads": cpu_threads(args.device), "sampling": vars(s), "ckpt": args.ckpt,
                      "max_new_tokens": args.max_new_tokens}
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
        if chat is not None:
            chat.close()
        if fresh:
            abandon_start(args, path, lock, created)
        else:
            lock.close()
        raise
    return chat, lock, fresh


def abandon_start(args, path, lock, created):
    """A new session's start failed before its first save: what it made goes (forget_start), and
    the default sessions' directory where it is left empty, so a later start finds nothing of it."""
    forget_start(path, lock, created)
    if args.session is None:
        remove_if_empty(SESSIONS)


def system_text(args):
    """The system message: --system, then the document (read here, UTF-8), or None."""
    parts = [] if args.system is None else [args.system]
    try:
        "".join(parts).encode("utf-8")
    except UnicodeEncodeError:  # bytes the shell passed that are not UTF-8 (surrogates here)
        raise UsageError("--system holds bytes that are not UTF-8 text; give it in UTF-8") from None
    if args.document:
        try:
            # a BOM is no text; CRLF stays as the file has it (the tokenizer reads "\r")
            with open(args.document, encoding="utf-8-sig", newline="") as f:
                parts.append(f.read())
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--document {args.document}: cannot be read ({e})") from None
    return "\n\n".join(parts) if parts else None


def print_err(msg):
    print(msg, file=sys.stderr, flush=True)


def write_out(text):
    sys.stdout.write(text)
    sys.stdout.flush()
