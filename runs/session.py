"""
A chat session on disk: the conversation, the token ids its KV holds, how each position was
computed, and the KV itself, saved so that a later run resumes it bit for bit.

    SESSION/
        lock                  flock'ed by the process using the session; holds its pid
        session.json          the manifest (below), replaced atomically, with a SHA-256 of itself
        kv/g<G>-c<j>.kv       sealed chunk j: every layer's bytes, back to back; written once
        kv/g<G>-open<L>.kv    the open chunk's buffers (every layer) when the KV held L positions
        tier/                 the disk tier of --offload disk, rebuilt by every run

A sealed chunk never changes, so a save writes only the chunks sealed since the last one and the
open chunk: its cost follows the new tokens, never the context. The files come first (each synced),
then the manifest that names them; a file is never rewritten (new names, and G grows when the
conversation starts over), so a kill at any moment leaves the last manifest and every file it names
intact: the turn in flight is lost, nothing before it.

Resume: the chunks are read back, checked against their CRC32s, and put through the open chunk and
sealed one by one (as kvstore adoption does), so they land where this run's --offload and --window
put them; the open chunk's bytes follow. Every position holds the bytes the first run computed, so
the next step is bit-identical to the uninterrupted session's. A file that fails its check is not
trusted: the positions from there on are computed again with the first run's schedule ("segments":
prefill segments a chunk-aligned step at a time, answers a token at a time), which gives the same
bits too.
"""
import fcntl
import hashlib
import json
import os
import stat
import zlib

import numpy as np
import torch

from generate import decode_one_token, prefill
from private import (
    PrivateError,
    dir_problem,
    make_private_dir,
    open_private,
    what_is_wrong,
    write_atomic,
)
from runs.taskdir import is_ints, manifest_check

VERSION = 1
MANIFEST = "session.json"
KV_DIR = "kv"
TIER_DIR = "tier"
# what a session's manifest holds besides its token ids (two ids lists of at most max_length)
MANIFEST_SLACK = 64 << 20


class SessionError(ValueError):
    """A session that cannot be used as asked; the message names it and what to do."""


def is_session(path):
    return os.path.isfile(os.path.join(path, MANIFEST))


def list_sessions(root):
    """(name, manifest or None, why not) of every session directory under root."""
    out = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if os.path.isdir(path) and not os.path.islink(path) and is_session(path):
            m, why = read_manifest(path)
            out.append((name, m, why))
    return out


def remove_session(path):
    """Remove a session directory: only the files a session holds (its manifest, lock, kv/ and
    tier/ files; links go, never their targets). Anything else stays, and so does the directory:
    returns the names left in it (none where the directory went)."""
    if not os.path.isdir(path) or os.path.islink(path) or not is_session(path):
        raise SessionError(f"--remove {path}: not a session directory (no {MANIFEST}); nothing "
                           "removed")
    lock = SessionLock(path)  # a session in use is not removed
    remove_files(path, lock)
    return sorted(os.listdir(path)) if os.path.isdir(path) else []


def forget_start(path, lock, created):
    """A new session whose start failed before its first save (a flag refused once the model was
    read, a document too long): what the start made goes (the lock, kv/, tier/), and the directory
    if this run made it, so that the same --session can be given again."""
    if is_session(path):  # saved once: a session, kept
        lock.close()
        return
    remove_files(path, lock, rmdir=created)


def remove_files(path, lock, rmdir=True):
    """The files of a session (manifest, lock, kv/ and tier/ and what they hold; links go, never
    their targets), then the directory where rmdir and it is left empty; lock is released."""
    for sub in (KV_DIR, TIER_DIR):
        d = os.path.join(path, sub)
        if os.path.islink(d):
            remove_file(d)
        elif os.path.isdir(d):
            for name in os.listdir(d):
                remove_file(os.path.join(d, name))
            try:
                os.rmdir(d)
            except OSError:
                pass
    for name in os.listdir(path):
        if name == MANIFEST or name == "lock" or name.startswith(f".{MANIFEST}.tmp-"):
            remove_file(os.path.join(path, name))
    lock.close()
    if rmdir:
        try:
            os.rmdir(path)
        except OSError:
            pass


def check_subdirs(path):
    """A session's kv/ and tier/, where they exist, must be private directories: a link, a file or
    a directory others can use is refused before any work (not when a turn is saved), in a
    SessionError saying which and what to do."""
    for sub, what in ((KV_DIR, "KV files"), (TIER_DIR, "disk tier")):
        d = os.path.join(path, sub)
        if not os.path.lexists(d):
            continue
        st = os.lstat(d)
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
            kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory"
            raise SessionError(f"--session {path}: {d}, the directory of its {what}, is {kind}; "
                               "remove it (the session computes what it held again)")
        if dir_problem(st):
            raise SessionError(f"--session {path}: {d}, the directory of its {what}, "
                               f"{dir_problem(st)}")


def remove_file(path):
    try:
        if not os.path.isdir(path) or os.path.islink(path):
            os.remove(path)
    except OSError:
        pass


class SessionLock:
    """flock on SESSION/lock: one process per session."""

    def __init__(self, path):
        try:
            self.fd = open_private(os.path.join(path, "lock"), os.O_RDWR | os.O_CREAT)
        except (OSError, PrivateError) as e:
            raise SessionError(f"--session {path}: cannot be locked "
                               f"({getattr(e, 'strerror', None) or e})") from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(self.fd, 64, 0).decode(errors="replace").strip() or "another"
            os.close(self.fd)
            raise SessionError(f"--session {path} is in use by process {holder}; end that chat "
                               "first, or give another --session") from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)

    def close(self):
        os.close(self.fd)


def read_manifest(path, max_bytes=MANIFEST_SLACK):
    """(manifest, None), or (None, why it cannot be used) as the end of a sentence."""
    try:
        fd = open_private(os.path.join(path, MANIFEST), os.O_RDONLY)
    except (OSError, PrivateError) as e:
        why = what_is_wrong(e)
        return None, f"{MANIFEST} cannot be read ({why})"
    with os.fdopen(fd, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        return None, f"{MANIFEST} is larger than any session's"
    try:
        m = json.loads(data)
    except (ValueError, RecursionError):
        return None, f"{MANIFEST} is not valid JSON"
    if not isinstance(m, dict) or m.get("version") != VERSION:
        return None, f"{MANIFEST} was not written by this version of chat.py"
    if m.pop("check", None) != manifest_check(m):
        return None, f"{MANIFEST} does not match its checksum (edited by hand, or damaged)"
    return m, None


def write_manifest(path, m):
    body = {**m, "version": VERSION}
    text = json.dumps({**body, "check": manifest_check(body)}, sort_keys=True)
    write_atomic(os.path.join(path, MANIFEST), text.encode())


def state_problem(m, n_layers, vocab, max_length):
    """Why a manifest's conversation fields cannot be used, or None: every field checked by type
    and range before anything reads it."""
    tokens = m.get("tokens")
    if not isinstance(tokens, list) or len(tokens) > max_length:
        return f"'tokens' is not a list of at most {max_length} ids"
    pending = m.get("pending")
    if not is_ints(tokens, len(tokens), 0, vocab) or not is_ints(pending, len(pending or []), 0,
                                                                 vocab) or len(pending) > 1:
        return f"'tokens' or 'pending' holds something other than ids below {vocab}"
    length = m.get("length")
    if type(length) is not int or not 0 <= length <= len(tokens):
        return "'length' is not a position of 'tokens'"
    segs = m.get("segments")
    end = 0
    if not isinstance(segs, list):
        return "'segments' is not a list"
    for s in segs:
        if not (isinstance(s, list) and len(s) == 3 and s[0] == end and type(s[1]) is int
                and s[0] < s[1] and s[2] in ("prefill", "decode")):
            return "'segments' do not cover the tokens in order"
        end = s[1]
    if end != len(tokens):
        return "'segments' do not cover the tokens in order"
    msgs = m.get("messages")
    if not isinstance(msgs, list) or not all(isinstance(x, dict) and isinstance(x.get("role"), str)
                                             and isinstance(x.get("content"), str) for x in msgs):
        return "'messages' is not a list of {role, content}"
    if not (isinstance(m.get("rendered"), str) and isinstance(m.get("head"), str)
            and type(m.get("gen")) is int and type(m.get("turns")) is int):
        return "'rendered', 'head', 'gen' or 'turns' is missing"
    chunks = m.get("chunks")
    C = m["chunk_size"]
    if not is_ints(chunks, length // C, 0, 1 << 32):
        return "'chunks' is not one CRC32 per sealed chunk"
    o = m.get("open")
    if o is None:  # no open chunk, or one recomputed on resume (int4's: kvlayout.open_in_bytes)
        return None
    if not (isinstance(o, dict) and o.get("length") == length and length % C
            and is_ints([o.get("crc")], 1, 0, 1 << 32)):
        return "'open' does not describe the open chunk"
    return None


# -----------------------------------------------------------------------------
# the KV: saved, restored, recomputed

def chunk_file(path, gen, j):
    return os.path.join(path, KV_DIR, f"g{gen}-c{j}.kv")


def open_file(path, gen, length):
    return os.path.join(path, KV_DIR, f"g{gen}-open{length}.kv")


def layer_views(buf, store):
    """One numpy buffer of every layer's chunk, back to back -> per-layer tensors of the chunk's
    shape (no copy)."""
    n = store.chunk_bytes
    return [torch.from_numpy(buf[l * n:(l + 1) * n]).view(store.dtype).view(store.shape)
            for l in range(store.n_layers)]


def save_kv(path, cache, gen, crcs, open_crc):
    """Write the chunks sealed since the last save (crcs: the CRC32s of those saved already) and
    the open chunk. Returns (crcs, {"length", "crc"} or None); every file synced."""
    store = cache.store
    make_private_dir(os.path.join(path, KV_DIR), "the session's kv directory")
    buf = np.empty(store.n_layers * store.chunk_bytes, np.uint8)
    views = layer_views(buf, store)
    crcs = list(crcs)
    for j in range(len(crcs), cache.n_sealed):
        for l, dst in enumerate(views):
            store.read_back(l, j, dst)
        write_atomic(chunk_file(path, gen, j), buf)
        crcs.append(zlib.crc32(buf))
    off = cache.length % cache.chunk_size
    if not off or not cache.layout.open_in_bytes:  # int4's open chunk: recomputed on resume
        return crcs, None
    if open_crc is not None and open_crc["length"] == cache.length:
        return crcs, open_crc  # saved already
    for l, dst in enumerate(views):
        dst.copy_(store.open_chunk(l))  # the whole buffer: what attention reads is its prefix
    write_atomic(open_file(path, gen, cache.length), buf)
    return crcs, {"length": cache.length, "crc": zlib.crc32(buf)}


def read_kv_file(fpath, buf, crc):
    """Fill buf from fpath; True if the file is there, the right size and matches crc."""
    try:
        fd = open_private(fpath, os.O_RDONLY)
    except (OSError, PrivateError):
        return False
    try:
        if os.fstat(fd).st_size != buf.nbytes:
            return False
        n = os.preadv(fd, [memoryview(buf)], 0)
    finally:
        os.close(fd)
    return n == buf.nbytes and zlib.crc32(buf) == crc


def restore_kv(path, cache, m, log):
    """Put the saved KV back into a fresh cache: chunks, then the open chunk. Returns the positions
    restored (a file that fails its check ends it: the rest is recomputed)."""
    store = cache.store
    C = cache.chunk_size
    buf = np.empty(store.n_layers * store.chunk_bytes, np.uint8)
    views = layer_views(buf, store)
    for j, crc in enumerate(m["chunks"]):
        if not read_kv_file(chunk_file(path, m["gen"], j), buf, crc):
            log(f"chat.py: {chunk_file(path, m['gen'], j)} is missing or fails its checksum; "
                f"recomputing the conversation from position {j * C}")
            return cache.length
        put(cache, views, C)
        store.seal(j)  # data: as after a prefill step, the placement puts it on a tier
    o = m["open"]
    # an open chunk whose bytes are not all of it (int4's keys): recomputed, with the first
    # run's schedule
    if o is not None and len(m["chunks"]) == o["length"] // C and cache.layout.open_in_bytes:
        fpath = open_file(path, m["gen"], o["length"])
        if read_kv_file(fpath, buf, o["crc"]):
            put(cache, views, o["length"] % C)
        else:
            log(f"chat.py: {fpath} is missing or fails its checksum; recomputing the conversation "
                f"from position {cache.length}")
    return cache.length


def put(cache, views, n):
    """Adopt n positions whose bytes are in views (one chunk buffer per layer) as the next ones."""
    for l, src in enumerate(views):
        cache.store.open_chunk(l).copy_(src)
    cache.begin(n)
    cache.commit()


def replay(model, cache, tokens, segments, on_step=None):
    """Compute the KV of tokens[cache.length:] as the first run did: each prefill segment in
    chunk-aligned steps (from a chunk boundary or a step's end the steps are the first run's), each
    decoded position one step. Returns the last logits (None if nothing was computed)."""
    logits = None
    device = cache.store.device
    for start, end, kind in segments:
        if end <= cache.length:
            continue
        ids = torch.tensor([tokens[max(start, cache.length):end]], device=device)  # [1, T]
        if kind == "prefill":
            logits = prefill(model, cache, ids, on_step)
            continue
        for t in range(ids.shape[1]):
            logits = decode_one_token(model, cache, ids[:, t:t + 1])
    return logits


def digest(h, logits):
    """Fold one step's logits [1, V] into a running SHA-256 (a turn's logits, bit for bit)."""
    h.update(logits.float().cpu().contiguous().numpy().tobytes())


def new_digest():
    return hashlib.sha256()
