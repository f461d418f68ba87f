"""
A task's directory on disk: a safe name, a lock, and a manifest that makes the disk tier a
checkpoint.

    offload_dir/task_<id>/
        lock            flock'ed by the process using the directory; holds its pid
        manifest.json   run fingerprint (the weights' bytes and the settings that shape the KV),
                        dtype, chunk size, task parameters, token ids so far, and for every chunk on
                        disk its checksum (and, compressed, where its blob lives), all under a
                        SHA-256 of the rest ("check"); replaced atomically
        layer{l}.kv     the disk tier (disk.DiskTier), raw or layer{l}.zst compressed;
                        rank{r}/ under torchrun

A killed run leaves chunks and a manifest behind; the next run of the same task checks the manifest
against the model and task, verifies each chunk's checksum, restores the longest valid prefix and
recomputes the rest. A manifest that does not match, or that fails any check of its fields (type,
range, its own checksum), is reported in one line and ignored, never trusted.

Everything here is private (private.py): the offload dir and the task directories are mode 700
and yours, or refused; files are 0600 and opened without following links.
"""
import errno
import fcntl
import hashlib
import json
import os
import re

from checkpoint import checkpoint_files
from private import PrivateError, make_private_dir, open_private, write_atomic

MANIFEST_VERSION = 2  # 2: the manifest carries a checksum of itself


class TaskDirError(RuntimeError):
    """The task directory cannot be used; the message names it and why. holder: the process that
    holds it, where another does (the task runs there now), else None."""
    holder = None


def safe_task_name(task_id):
    """'task_' + the id when it is a plain name: 1 to 80 lowercase letters, digits, '.', '_', '-'.
    Any other id has the rest replaced by '_' and a hash of the whole id appended after a '+', which
    no plain name holds. So no id reaches outside the offload dir ('../', '/', NUL), and two ids
    never share a directory, on a file system that ignores case too ('A' is not 'a')."""
    raw = str(task_id)
    if re.fullmatch(r"[a-z0-9._-]{1,80}", raw):
        return "task_" + raw
    clean = re.sub(r"[^a-z0-9._-]", "_", raw.lower())[:80]
    digest = hashlib.sha256(raw.encode("utf-8", "surrogatepass")).hexdigest()
    return f"task_{clean}+{digest[:32]}"


def model_fingerprint(ckpt_dir):
    """A hash of config.json and of every byte of every safetensors file: a fine-tune with the same
    shapes (or a file rewritten in place) gets another fingerprint, so a rerun never resumes from KV
    that other weights made. Reading every byte costs ~0.2 s per 100 MB, so each file's digest is
    cached by (path, size, mtime, ctime, inode): only the first run after a change pays."""
    h = hashlib.sha256()
    with open(os.path.join(ckpt_dir, "config.json"), "rb") as f:
        h.update(f.read())
    cache = DigestCache()
    for path in checkpoint_files(ckpt_dir):
        h.update(cache.digest(path).encode())
    cache.save()
    return h.hexdigest()[:32]


def run_fingerprint(model_fp, **parts):
    """The model's fingerprint chained with everything else that changes the KV it makes (dtype,
    quantization, a RoPE override, a parallel layout, ...). Parts set to None are left out, so
    adding an option keeps the fingerprints of runs that do not use it."""
    given = {k: v for k, v in sorted(parts.items()) if v is not None}
    return hashlib.sha256(json.dumps([model_fp, given], default=str).encode()).hexdigest()[:32]


def file_sha256(path, block=8 << 20):
    """SHA-256 of a file's bytes, read in large blocks into one reused buffer."""
    h = hashlib.sha256()
    buf = bytearray(block)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()


def stat_key(path):
    st = os.stat(path)
    # any write changes one of these
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


class DigestCache:
    """File digests kept in $XDG_CACHE_HOME/kvoffload/digests.json (else ~/.cache/...), in a
    private directory (private.py). A cache that cannot be read or written, or sits in a directory
    others could write (where a planted digest would be trusted), is no error: it is not used, and
    the file is hashed again next time."""

    MAX_BYTES = 16 << 20  # far above any real cache: a larger file is not read

    def __init__(self):
        root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        self.dir = os.path.join(root, "kvoffload")
        self.path = os.path.join(self.dir, "digests.json")
        self.entries = {}
        self.changed = False
        try:
            make_private_dir(self.dir, "the digest cache", create=False)
            fd = open_private(self.path, os.O_RDONLY)
            with os.fdopen(fd, "rb") as f:
                entries = json.loads(f.read(self.MAX_BYTES + 1))
        except (OSError, ValueError, RecursionError):  # PrivateError is a ValueError
            return
        if isinstance(entries, dict):
            self.entries = entries

    def digest(self, path):
        real = os.path.realpath(path)
        key = stat_key(path)
        hit = self.entries.get(real)
        if isinstance(hit, dict) and hit.get("key") == key and is_sha256(hit.get("sha256")):
            return hit["sha256"]
        digest = file_sha256(path)
        if stat_key(path) == key:  # not rewritten while we read it: the digest belongs to that key
            self.entries[real] = {"key": key, "sha256": digest}
            self.changed = True
        return digest

    def save(self):
        """Atomically (a new private file renamed over the old one); any failure leaves the run
        alone."""
        if not self.changed:
            return
        # forget deleted checkpoints
        self.entries = {p: e for p, e in self.entries.items() if os.path.exists(p)}
        try:
            make_private_dir(self.dir, "the digest cache")
            write_atomic(self.path, json.dumps(self.entries).encode())
        except (OSError, PrivateError):
            pass


def is_sha256(s):
    return isinstance(s, str) and re.fullmatch(r"[0-9a-f]{64}", s) is not None


class TaskDir:
    """Create and lock offload_dir/task_<id>/. The offload dir, the task directory and every file
    in it are private (private.py): yours and open to nobody else, or refused in one sentence. Two
    users of one directory are refused."""

    def __init__(self, root, task_id, sub=None):
        """sub: a rank's own subdirectory
        (tensor parallel: every rank keeps its store in task_<id>/rank<r>/)."""
        self.top = os.path.join(root, safe_task_name(task_id))
        self.path = os.path.join(self.top, sub) if sub else self.top
        try:
            make_private_dir(root, "--offload-dir")
            make_private_dir(self.top, "task directory")
            if sub:
                make_private_dir(self.path, "task directory")
            self.lock_fd = open_private(os.path.join(self.path, "lock"), os.O_RDWR | os.O_CREAT)
        except PrivateError as e:
            raise TaskDirError(str(e)) from None
        except OSError as e:
            raise TaskDirError(f"{self.path}: cannot create the task directory "
                               f"({e.strerror})") from None
        try:
            fcntl.flock(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            holder = os.pread(self.lock_fd, 64, 0).decode(errors="replace").strip()
            holder = holder or "another task"
            os.close(self.lock_fd)
            error = TaskDirError(f"{self.path} is in use by process {holder}; wait for it to "
                                 "finish, or run this task in another --offload-dir (or, in a "
                                 "--prompts file, under another id)")
            error.holder = holder
            raise error from None
        os.ftruncate(self.lock_fd, 0)
        os.pwrite(self.lock_fd, f"{os.getpid()}\n".encode(), 0)

    # Who can forge a manifest, and what the checksum is for. The task directory is private (mode
    # 700, yours, checked before use), so only you, or root, can write a manifest: another user
    # cannot plant one. Whoever can write it can also recompute its checksum (there is no secret
    # to keep: a key would sit beside it, readable by the same people), so the checksum does not
    # stop a forger; it stops the accidents: a manifest edited by hand or by a tool (tokens
    # replaced, a field changed), one stitched from two runs, or bytes damaged on disk. A forged
    # manifest that passes it still cannot crash the run or make it allocate more than the task
    # needs (every field is checked by type and range, see tokens_problem and chunks_problem), and
    # its chunks still have to match their CRC32s; what it can do is make a rerun replay tokens of
    # its choosing, as anyone who can write your files can change your results.

    def read_manifest(self, max_bytes):
        """(manifest, None); (None, None) when there is none; (None, why not) when the one there
        cannot be used: unreadable, larger than max_bytes (what this task's could be), not JSON,
        another version's, or failing its own checksum. The caller reports why and starts over."""
        path = os.path.join(self.path, "manifest.json")
        try:
            fd = open_private(path, os.O_RDONLY)
        except FileNotFoundError:
            return None, None
        except (OSError, PrivateError) as e:
            return None, f"manifest.json cannot be read ({getattr(e, 'strerror', None) or e})"
        with os.fdopen(fd, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > max_bytes:
                return None, (f"manifest.json holds {size} bytes, more than a manifest of this "
                              "task can")
            data = f.read()
        try:
            m = json.loads(data)
        except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
            return None, "manifest.json is not valid JSON"
        if not isinstance(m, dict) or m.get("version") != MANIFEST_VERSION:
            return None, "manifest.json was not written by this version of the project"
        if m.pop("check", None) != manifest_check(m):
            return None, "manifest.json does not match its checksum (edited by hand, or damaged)"
        return m, None

    def write_manifest(self, manifest):
        """Atomically (private.write_atomic: a new file, synced, renamed over the old one, the
        directory synced), with the checksum read_manifest checks."""
        text = json.dumps({"version": MANIFEST_VERSION, **manifest}, sort_keys=True)
        # manifest_check's digest of exactly this text, added as the last field: one dump, not two
        check = hashlib.sha256(text.encode()).hexdigest()
        text = f'{text[:-1]}, "check": "{check}"}}'
        write_atomic(os.path.join(self.path, "manifest.json"), text.encode())

    def vouches(self):
        """Whether a manifest vouches for any of the directory's chunks (else nothing in it can be
        resumed)."""
        return os.path.isfile(os.path.join(self.path, "manifest.json"))

    def close(self, remove):
        if remove:
            for name in os.listdir(self.path):
                try:
                    os.remove(os.path.join(self.path, name))  # a link goes, never its target
                except OSError:
                    pass  # not a file of ours (a directory): left, and so is the directory
        os.close(self.lock_fd)  # releases the flock
        if remove:
            try:
                os.rmdir(self.path)
                if self.path != self.top:
                    os.rmdir(self.top)  # the last rank to finish removes task_<id>/ itself
            except OSError:
                pass


def manifest_check(body):
    """The SHA-256 a manifest carries of everything else in it (keys sorted: the same text before
    writing and after reading)."""
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def manifest_size_bound(n_tokens, n_chunks, n_layers):
    """The most bytes a manifest of a task can hold: its task fields, n_tokens ids twice (the
    prompt in the task, all in "tokens"), n_chunks chunks of n_layers CRC32s and blob positions,
    each number at most 20 digits and a separator (so with room to spare)."""
    return (1 << 16) + 2 * 22 * n_tokens + n_chunks * (32 + 3 * 22 * n_layers)


# -----------------------------------------------------------------------------
# the fields of a manifest, checked by type and range before anything uses them

def is_ints(x, n, lo, hi):
    """x is a list of n ints (not bools), each in [lo, hi)."""
    return (isinstance(x, list) and len(x) == n
            and all(type(v) is int and lo <= v < hi for v in x))


def tokens_problem(tokens, prompt_ids, max_new_tokens, vocab_size, eos_ids):
    """Why a manifest's token ids cannot be replayed for this task, or None. They must be ids of
    the vocabulary, start with the prompt, hold at most max_new_tokens more, and have no EOS
    before the last (the run would have stopped there)."""
    P = len(prompt_ids)
    if not isinstance(tokens, list) or len(tokens) > P + max_new_tokens:
        return "'tokens' is not a list of at most the prompt plus max_new_tokens ids"
    if not is_ints(tokens, len(tokens), 0, vocab_size):
        return f"'tokens' holds something other than token ids below {vocab_size}"
    if tokens[:P] != prompt_ids:
        return "tokens do not start with this prompt"
    if any(t in eos_ids for t in tokens[P:-1]):
        return "tokens go on past an EOS"
    return None


def chunks_problem(chunks, n_layers, max_chunks, compressed):
    """Why a manifest's 'chunks' cannot be checked against the disk tier, or None. They must be
    {"0": ..., "1": ..., ...}, at most max_chunks (the task's length), each {"crc": one CRC32 per
    layer, "blob": null, or compressed one [offset, length] pair of non-negative ints per layer}
    (disk.DiskTier checks that each blob lies inside its file)."""
    if not isinstance(chunks, dict) or len(chunks) > max_chunks:
        return f"'chunks' is not an object of at most {max_chunks} chunks"
    if set(chunks) != {str(j) for j in range(len(chunks))}:
        return "'chunks' is not numbered 0, 1, 2, ..."
    for j, c in chunks.items():
        if not isinstance(c, dict) or not is_ints(c.get("crc"), n_layers, 0, 1 << 32):
            return f"chunk {j} does not have one CRC32 per layer ({n_layers})"
        blob = c.get("blob")
        if not compressed and blob is not None:
            return f"chunk {j} has a blob, but the disk tier is not compressed"
        pairs_ok = isinstance(blob, list) and all(is_ints(b, 2, 0, 1 << 62) for b in blob)
        if compressed and not (pairs_ok and len(blob) == n_layers):
            return f"chunk {j} does not have one [offset, length] pair per layer ({n_layers})"
    return None
