"""
The persistent KV store: prompt chunks kept on disk across runs and tasks, found again by what
produced them.

    store/              0700, owned by the user (an entry is trusted KV: nobody else may plant one;
                        private.make_private_dir refuses any other directory)
        <key>.kv        one prompt chunk, every layer; 0600; <key> is 64 hex digits
        .tmp-<key>-<pid>-<random>
                        a write in progress, renamed over <key>.kv once complete and synced
        <key>.claim     a task is computing this chunk now: "<host> <pid>" (see claim())

Why reuse is exact: attention's schedule (kvcache.py) depends on positions and the chunk size only,
so the K and V of prompt chunk j are a function of the model, the run's settings and the tokens at
positions [0, (j+1)*C), and nothing else. The key hashes exactly those, chained so that a chunk's
key vouches for every token before it:
    key_{-1} = sha256(run fingerprint)     model content, dtype, quantization, C, rope, layout,
                                           device, torch
    key_j    = sha256(key_{j-1} || ids of chunk j as int64 little-endian)
Two runs that agree on a key computed the same bytes, so adopting them is the same as recomputing
them.

One entry (little-endian):
    header   magic b"KVS1", compression u8 (0 raw, 1 zstd), itemsize u8, n_layers u32,
             chunk_bytes u64, key 32 bytes
    table    n_layers x (stored length u64, CRC32 u32 of the stored blob)
    hcrc     CRC32 u32 of header and table
    payload  the blob of layer 0, layer 1, ..., each starting on a 4 KiB boundary (zero padding):
             a chunk [2, B, G, C, D] as raw bytes, or zstd of its byte planes (disk.split_planes,
             as --compress zstd)

Concurrency (several processes, one store): a write goes to a private temporary file, is fsynced
and renamed into place, so a reader sees no entry, an older entry or the new one, never part of
one; two writers of one key write the same bytes and one rename simply wins. A reader holds its file
open, so an eviction meanwhile cannot cut it short; a file that vanishes before it is opened is a
miss. Every read checks the CRCs: a failing entry is a miss, is reported (log) and removed (only if
the path still names the file that failed), so the caller recomputes and writes it again; a write
that finds an entry already there checks it the same way, so every bad entry a run meets is
repaired, not only the first. Claims let tasks that
start together compute a shared chunk once (claim, then write and release; or wait_for the entry):
task.PromptCache says how.
"""
import argparse
import errno
import hashlib
import os
import re
import socket
import stat
import struct
import sys
import threading
import time
import zlib

import numpy as np
import torch

from disk import ALIGN, DISK_FULL, as_bytes, join_planes, retry, round_up, split_planes
from private import (
    PrivateError,
    create_private,
    fsync_dir,
    make_private_dir,
    open_private,
    remove_quietly,
)

MAGIC = b"KVS1"
HEADER = struct.Struct("<4sBBIQ32s")  # magic, compression, itemsize, n_layers, chunk_bytes, key
LAYER = struct.Struct("<QI")           # stored length, CRC32
HCRC = struct.Struct("<I")
COMPRESSIONS = ("none", "zstd")        # index = the code in the header
ENTRY = re.compile(r"^[0-9a-f]{64}\.kv$")
CLAIM = re.compile(r"^[0-9a-f]{64}\.claim$")
TEMP_PREFIX = ".tmp-"
STALE_TEMP_S = 3600                    # a temporary file this old belongs to a writer that died
STALE_CLAIM_S = 600                    # a claim not renewed this long: its task died (or hangs)
WAIT_NOTE_S = 5                        # a wait on another's claim this long is said, once
HOST = socket.gethostname()            # a claim made on this machine names its process: see claim()


class StoreError(RuntimeError):
    """The store directory cannot be used; the message names it and what to do."""


class Rejected(Exception):
    """An entry that must not be used (torn, corrupt, or made for other buffers);
    the message says why."""


# -----------------------------------------------------------------------------
# keys

def chunk_keys(run_fp, ids, C):
    """Keys of the full chunks of ids (a list or 1-D tensor of token ids) at chunk size C:
    key j stands for positions [0, (j+1)*C) under run_fp.
    A partial last chunk has no key (its KV is not final)."""
    ids = np.asarray(ids, dtype="<i8")
    h = hashlib.sha256(run_fp.encode("utf-8")).digest()
    keys = []
    for j in range(len(ids) // C):
        h = hashlib.sha256(h + ids[j * C:(j + 1) * C].tobytes()).digest()
        keys.append(h.hex())
    return keys


def flat_bytes(buf):
    """A contiguous host tensor or numpy array -> its bytes as a flat uint8 numpy array, no copy (a
    copy would silently swallow what read() writes into it)."""
    if isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise ValueError("store buffers must be contiguous host tensors; copy the chunk to "
                             "the host first")
        return as_bytes(buf)
    if not buf.flags.c_contiguous:
        raise ValueError("store buffers must be C-contiguous numpy arrays")
    return buf.reshape(-1).view(np.uint8)


# -----------------------------------------------------------------------------
# the store


# mark_used: a chunk's use is recorded this much earlier for each chunk before it in its prompt
DEPTH_S = 1e-3


def touch(target, depth=0, now=None):
    """Record a use of an entry (a path or a descriptor) at `now` (default: now), less depth x
    DEPTH_S. Always this process's clock, never the file system's "now": on a file system a host
    serves, the two can be tens of milliseconds apart, which would reorder uses."""
    t = (time.time() if now is None else now) - depth * DEPTH_S
    os.utime(target, (t, t))

class KVStore:
    """A directory of entries, shared by any number of processes; safe to use from several threads.
    budget_gib: evict least recently used entries after a write to stay under it (None = no limit).
    compress: how this process writes ("none" or "zstd"); reads follow each entry's header.
    log(line): where each rejected entry is reported (default: stderr)."""

    def __init__(self, root, budget_gib=None, compress="none", create=True, log=None):
        if compress not in COMPRESSIONS:
            raise StoreError(f"compression must be one of {COMPRESSIONS}, got {compress!r}")
        self.root = root
        self.compress = compress
        self.budget = None if budget_gib is None else int(budget_gib * 2**30)
        try:
            make_private_dir(root, "--kv-store", create=create)
        except PrivateError as e:
            raise StoreError(str(e)) from None
        self.log = log or print_to_stderr
        self.lock = threading.Lock()
        self.last_rejection = None
        self.stats = {"bytes_read": 0, "bytes_written": 0, "reused": 0, "stored": 0, "misses": 0,
                      "rejected": 0, "evicted": 0, "write_failures": 0}

    def _count(self, **n):
        with self.lock:
            for k, v in n.items():
                self.stats[k] += v

    def path(self, key, suffix=".kv"):
        # a key is a file name: nothing else may reach the directory
        if not re.fullmatch(r"[0-9a-f]{64}", key):
            raise ValueError(f"not a store key: {key!r}")
        return os.path.join(self.root, key + suffix)

    def lookup(self, keys):
        """How many keys, from the first, have an entry: the longest stored prefix (not yet
        validated: read() is)."""
        n = 0
        while n < len(keys) and os.path.exists(self.path(keys[n])):
            n += 1
        return n

    # ---- read -----------------------------------------------------------------------------

    def read(self, key, buffers):
        """Fill buffers (one per layer: a contiguous host tensor or numpy array holding a chunk
        [2, B, G, C, D]) with the entry's KV. Returns the bytes read from the file, or 0 for a miss:
        no entry, or one rejected (corrupt, torn, or made for other buffers), which is then removed
        so that the next write replaces it. A miss may leave the buffers half filled: recompute the
        chunk into them."""
        path = self.path(key)
        flats = [flat_bytes(b) for b in buffers]
        fd = self._open(path)
        if fd is None:  # never stored, or evicted since lookup()
            self._count(misses=1)
            return 0
        try:
            n = self._read_entry(fd, key, flats, buffers[0].itemsize)
            try:
                touch(fd)  # last use = now: eviction is least recently used first
            except OSError:
                pass  # a read-only store still serves reads; it just cannot record their order
        except Rejected as e:
            self._reject(path, fd, e)
            return 0
        finally:
            os.close(fd)
        self._count(bytes_read=n, reused=1)
        return n

    def _open(self, path):
        """A descriptor of the entry at path, or None when there is none. Something there that is
        not an entry of ours (a link, a directory) is removed, reported, and is a miss."""
        try:
            return open_private(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        except PrivateError as e:
            self.last_rejection = str(e)
            self._count(rejected=1)
            try:
                os.unlink(path)  # a link goes, never its target
                self.log(f"{e} (it was removed)")
            except OSError:  # a directory: it stays, and every read of this key is a miss
                self.log(f"{e} (it was left; remove it for this chunk to be stored)")
            return None

    def _reject(self, path, fd, why):
        """Report a rejected entry and remove it, so that the chunk is computed and stored again."""
        self.last_rejection = f"{path}: {why}"  # for the caller's log
        self._count(misses=1, rejected=1)
        self._discard(path, fd)
        self.log(f"KV store entry {self.last_rejection}; removed, the chunk is computed again")

    def _read_entry(self, fd, key, flats, itemsize, fill=True):
        """Check the entry open at fd against key and the buffers' sizes (flats, itemsize), and
        with fill read its KV into the buffers. The bytes of the entry, or Rejected."""
        head = self._pread(fd, HEADER.size, 0)
        magic, code, stored_itemsize, n_layers, chunk_bytes, stored_key = HEADER.unpack(head)
        # a sanity bound before the layer count sizes a read
        if magic != MAGIC or n_layers > 1 << 16:
            raise Rejected("not an entry of this store")
        table = self._pread(fd, n_layers * LAYER.size + HCRC.size, HEADER.size)
        if zlib.crc32(head + table[:-HCRC.size]) != HCRC.unpack(table[-HCRC.size:])[0]:
            raise Rejected("its header fails its checksum")
        if stored_key != bytes.fromhex(key) or code >= len(COMPRESSIONS):
            raise Rejected("it holds another key, or an unknown compression")
        same_sizes = all(f.nbytes == chunk_bytes for f in flats)
        if n_layers != len(flats) or not same_sizes or itemsize != stored_itemsize:
            raise Rejected(f"it was made for {n_layers} layers of {chunk_bytes} bytes, "
                           f"{stored_itemsize} per element: the run fingerprint misses a setting")
        off = round_up(HEADER.size + len(table), ALIGN)
        for l, dst in enumerate(flats):
            length, crc = LAYER.unpack_from(table, l * LAYER.size)
            if code == 0 and length != chunk_bytes:
                raise Rejected(f"layer {l} is short")
            if code == 0 and fill:  # raw: read straight into the caller's buffer, then check it
                got = retry(lambda: os.preadv(fd, [memoryview(dst)], off))
                if got != length:
                    raise Rejected(f"layer {l} is short")
                stored = dst
            else:  # a blob no longer than a chunk (zstd's worst case is a little longer)
                if length > chunk_bytes + (chunk_bytes >> 7) + 1024:
                    raise Rejected(f"layer {l} is longer than a chunk can be")
                stored = self._pread(fd, length, off)
            if zlib.crc32(stored) != crc:
                raise Rejected(f"layer {l} fails its checksum")
            if code == 1 and fill:
                join_planes(decompress(stored, chunk_bytes, l), itemsize, dst)
            end = off + length
            off = round_up(end, ALIGN)
        return end

    def _entry_ok(self, path, key, flats, itemsize):
        """Whether the entry at path is whole and fits these buffers (checked, not read into them);
        a bad one is rejected and removed."""
        fd = self._open(path)
        if fd is None:
            return False
        try:
            self._read_entry(fd, key, flats, itemsize, fill=False)
            return True
        except Rejected as e:
            self._reject(path, fd, e)
            return False
        finally:
            os.close(fd)

    @staticmethod
    def _pread(fd, n, off):
        data = retry(lambda: os.pread(fd, n, off))
        if len(data) != n:
            raise Rejected("the entry is short (torn or truncated)")
        return data

    def _discard(self, path, fd):
        """Remove a rejected entry, unless a writer has already renamed a fresh one over it."""
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                os.unlink(path)
        except FileNotFoundError:
            pass

    # ---- write ----------------------------------------------------------------------------

    def write(self, key, chunks, before=()):
        """Store one prompt chunk under key: chunks holds one contiguous host tensor or numpy array
        per layer, each a chunk [2, B, G, C, D]. Atomic (temporary file, fsync, rename). Returns the
        bytes written, 0 when the key is already there and whole (same key, same bytes; a bad entry
        is replaced) or the disk refuses (full, read-only: the run goes on without it). before: the
        keys of the chunks before this one in its prompt, marked used (mark_used) before a budget
        evicts, so that the prompt's tail goes first."""
        path = self.path(key)
        flats = [flat_bytes(c) for c in chunks]
        itemsize = chunks[0].itemsize
        chunk_bytes = flats[0].nbytes
        if any(f.nbytes != chunk_bytes for f in flats):
            raise ValueError("every layer's chunk must have the same size")
        # an entry already there is kept only if it is whole: a bad one is replaced
        if os.path.lexists(path) and self._entry_ok(path, key, flats, itemsize):
            return 0
        now = time.time()  # the prompt's chunks before this one, then this one, used at once
        if self.budget is not None:
            self.mark_used(before, now)
        code = COMPRESSIONS.index(self.compress)
        if code == 1:
            import zstandard  # a compressor per call: one object is not thread-safe
            blobs = [zstandard.ZstdCompressor(level=1).compress(split_planes(f, itemsize))
                     for f in flats]
        else:
            blobs = flats
        head = HEADER.pack(MAGIC, code, itemsize, len(blobs), chunk_bytes, bytes.fromhex(key))
        head += b"".join(LAYER.pack(len(memoryview(b).cast("B")), zlib.crc32(b)) for b in blobs)
        head += HCRC.pack(zlib.crc32(head))
        tmp = None
        try:
            fd, tmp = create_private(self.root, f"{TEMP_PREFIX}{key}-{os.getpid()}-")
            try:
                n = 0
                # each blob starts on a page, so that a raw layer could be mapped in place
                for b in (head, *blobs):
                    n += write_all(fd, bytes(round_up(n, ALIGN) - n))
                    n += write_all(fd, b)
                # the data is on disk before the name is: a crash never leaves a torn entry
                os.fsync(fd)
            finally:
                os.close(fd)
            touch(tmp, len(before), now)  # the prompt's latest chunk: its least recently used
            os.replace(tmp, path)  # atomic; a concurrent writer of this key wrote the same bytes
            fsync_dir(self.root)
        except OSError as e:
            if tmp is not None:
                remove_quietly(tmp)
            # ENOENT: clear() took our temporary file; EISDIR: a directory holds the entry's name
            if e.errno not in DISK_FULL and e.errno not in (errno.ENOENT, errno.EISDIR):
                raise
            with self.lock:
                first = not self.stats["write_failures"]
                self.stats["write_failures"] += 1
            if first and e.errno in DISK_FULL:  # said once: the run goes on, storing less
                self.log(f"kv store {self.root}: a chunk was not stored ({e.strerror}); the run "
                         "goes on without storing it; free space there or set --kv-store-budget")
            return 0
        self._count(bytes_written=n, stored=1)
        if self.budget is not None:
            self.evict_to_budget()
        return n

    def mark_used(self, keys, now=None):
        """The entries of one prompt's chunks, in order, used now: an earlier chunk a little later
        than the ones after it (touch), since a chunk is of use only after every one before it.
        So a budget evicts a prompt's tail first and keeps a head that lookup() reaches (chunks are
        written and read at a prefill step's pace, so their own times would put the head first).
        Entries gone meanwhile, or a read-only store, are passed over."""
        now = time.time() if now is None else now
        for depth, key in enumerate(keys):
            try:
                touch(self.path(key), depth, now)
            except OSError:
                pass

    # ---- maintenance ----------------------------------------------------------------------

    def entries(self):
        """[(key, bytes, last use as a Unix time)], least recently used first. Entries removed
        meanwhile are skipped."""
        out = []
        for name in os.listdir(self.root):
            if ENTRY.match(name):
                try:
                    st = os.lstat(os.path.join(self.root, name))
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(st.st_mode):  # a directory or a link there is no entry
                    out.append((name[:-3], st.st_size, st.st_mtime))
        return sorted(out, key=lambda e: e[2])

    def size(self):
        return sum(n for _, n, _ in self.entries())

    def evict_to_budget(self, budget_bytes=None):
        """Remove least recently used entries until the store holds at most budget_bytes (default:
        the store's budget), and temporary files left by writers that died. Returns the number of
        entries removed. Another process's reader keeps its open file and finishes undisturbed."""
        budget = self.budget if budget_bytes is None else budget_bytes
        self._sweep_temporaries(STALE_TEMP_S)
        if budget is None:
            return 0
        entries = self.entries()
        total = sum(n for _, n, _ in entries)
        removed = 0
        for key, n, _ in entries:
            if total <= budget:
                break
            remove_quietly(self.path(key))
            total -= n
            removed += 1
        self._count(evicted=removed)
        return removed

    def clear(self):
        """Remove every entry, temporary file and claim (no other file).
        Returns the number of entries removed."""
        self._sweep_temporaries(0)
        return self.evict_to_budget(0)

    def _sweep_temporaries(self, older_than_s):
        """Remove temporary files and claims at least older_than_s old."""
        now = time.time()
        for name in os.listdir(self.root):
            if not (name.startswith(TEMP_PREFIX) or CLAIM.match(name)):
                continue
            p = os.path.join(self.root, name)
            try:
                if now - os.stat(p).st_mtime >= older_than_s:
                    os.unlink(p)
            except FileNotFoundError:
                pass

    # ---- claims: tasks that start together compute a shared chunk once --------------------

    def claim(self, key):
        """Announce that this process computes key's chunk. True: go ahead (write, then release).
        False: another task is computing it: wait_for() it, or compute it anyway (False too where
        the store takes no claims: a read-only one). A void claim is taken over: its process, on
        this machine, is gone, or it was not renewed for STALE_CLAIM_S. Either way the store stays
        whole (atomic entries, and every writer of a key writes the same bytes); a race on a void
        claim at worst computes a chunk twice."""
        p = self.path(key, ".claim")
        if claim_is_void(p):
            try:
                os.unlink(p)  # its task died while computing, or gave up without release()
            except OSError:
                pass
        try:
            fd = open_private(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        except (OSError, PrivateError):  # another task's claim, or a store that takes none
            return False
        try:
            os.write(fd, f"{HOST} {os.getpid()}\n".encode())
        except OSError:
            pass  # a full disk: the claim stands, judged by its age alone
        finally:
            os.close(fd)
        return True

    def renew(self, key):
        """This process still computes key's chunk: its claim's age starts again."""
        try:
            os.utime(self.path(key, ".claim"))
        except OSError:
            pass

    def release(self, key):
        """Drop this process's claim on key:
        after write(), or on failure so that waiters stop waiting."""
        remove_quietly(self.path(key, ".claim"))

    def wait_for(self, key, timeout_s, poll_s=0.05):
        """Wait while another task claims key and its entry is absent. True if the entry is there
        now; False on timeout, or when the claim went away or became void without an entry (then
        compute the chunk yourself)."""
        entry = self.path(key)
        claim = self.path(key, ".claim")
        start = time.monotonic()
        said = False
        while not os.path.exists(entry) and time.monotonic() < start + timeout_s:
            if not os.path.exists(claim) or claim_is_void(claim):
                break
            if not said and time.monotonic() > start + WAIT_NOTE_S:  # a wait, not a hang: say so
                said = True
                print(f"kv store {self.root}: waiting for {claim_owner(claim)}, which is computing "
                      f"a chunk of this prompt (a claim it stops renewing lapses after "
                      f"{STALE_CLAIM_S} s; then this run computes it)", file=sys.stderr)
            time.sleep(poll_s)
        return os.path.exists(entry)


def claim_owner(path):
    """'process N on HOST' of a claim, as far as its file says."""
    try:
        with os.fdopen(open_private(path, os.O_RDONLY), "rb") as f:
            owner = f.read(256).decode(errors="replace").split()
    except (OSError, PrivateError):
        owner = []
    return f"process {owner[1]} on {owner[0]}" if len(owner) == 2 else "another process"


def claim_is_void(path):
    """A claim that no longer stands: not renewed for STALE_CLAIM_S, or made by a process of this
    machine that is gone (killed while computing). False when there is no claim."""
    try:
        fd = open_private(path, os.O_RDONLY)
    except PrivateError:
        return True  # not a claim this project made (a link): void, and removed by claim()
    except OSError:
        return False
    with os.fdopen(fd, "rb") as f:
        owner = f.read(256).split()
        age = time.time() - os.fstat(f.fileno()).st_mtime
    if age >= STALE_CLAIM_S:
        return True
    if len(owner) != 2 or owner[0] != HOST.encode() or not owner[1].isdigit():
        return False  # another machine's (or one still being written): its age decides
    try:
        os.kill(int(owner[1]), 0)  # signal 0: is the process there?
    except ProcessLookupError:
        return True
    except OSError:
        pass  # there, but not ours to signal
    return False


def write_all(fd, data):
    """os.write may write less than asked (signals, file-size limits): loop until all is written."""
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += retry(lambda: os.write(fd, view[done:]))
    return done


def decompress(blob, chunk_bytes, layer):
    """A zstd blob -> the byte planes of exactly one chunk, or Rejected."""
    import zstandard
    try:
        planes = zstandard.ZstdDecompressor().decompress(blob, max_output_size=chunk_bytes)
    except zstandard.ZstdError:
        raise Rejected(f"layer {layer} does not decompress") from None
    if len(planes) != chunk_bytes:
        raise Rejected(f"layer {layer} does not decompress to one chunk")
    return planes


def print_to_stderr(line):
    print(line, file=sys.stderr, flush=True)


# -----------------------------------------------------------------------------
# command line

def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m runs.kvstore",
                                description="List or clear a persistent KV store (see the top of "
                                            "runs/kvstore.py).")
    p.add_argument("dir", metavar="DIR", help="the store's directory")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--list", action="store_true",
                   help="print every entry (key, size, last use) and the total")
    g.add_argument("--clear", action="store_true", help="remove every entry")

    def one_line_error(message):
        print(f"runs.kvstore: error: {message}", file=sys.stderr)
        sys.exit(2)
    p.error = one_line_error
    args = p.parse_args(argv)
    if not os.path.isdir(args.dir):
        p.error(f"{args.dir}: no such directory; give the directory of an existing KV store")
    try:
        store = KVStore(args.dir, create=False)
    except StoreError as e:
        p.error(str(e))
    if args.clear:
        print(f"removed {store.clear()} entries from {args.dir}")
        return
    entries = store.entries()
    for key, n, used in entries:
        used_at = time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(used))
        print(f"{key}  {n / 2**20:10.3f} MiB  last used {used_at}")
    total_mib = sum(n for _, n, _ in entries) / 2**20
    print(f"{len(entries)} entries, {total_mib:.3f} MiB in {args.dir}")


if __name__ == "__main__":
    main()
