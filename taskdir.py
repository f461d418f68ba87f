"""
A task's directory on disk: a safe name, a lock, and a manifest that makes the disk tier a
checkpoint.

    offload_dir/task_<id>/
        lock            flock'ed by the process using the directory; holds its pid
        manifest.json   run fingerprint (the weights' bytes and the settings that shape the KV),
                        dtype, chunk size, task parameters, token ids so far, and for every chunk on
                        disk its checksum (and, compressed, where its blob lives); replaced
                        atomically
        layer{l}.kv     the disk tier (disk.DiskTier), raw or layer{l}.zst compressed;
                        rank{r}/ under torchrun

A killed run leaves chunks and a manifest behind; the next run of the same task checks the manifest
against the model and task, verifies each chunk's checksum, restores the longest valid prefix and
recomputes the rest. A manifest that does not match is reported and ignored, never trusted.
"""
import errno
import fcntl
import hashlib
import json
import os
import re

from checkpoint import checkpoint_files

MANIFEST_VERSION = 1


class TaskDirError(RuntimeError):
    """The task directory cannot be used; the message names it and why."""


def safe_task_name(task_id):
    """'task_' + the id with anything but letters, digits, '.', '_' and '-' replaced, so no id can
    reach outside the offload dir ('../', '/', NUL); long or rewritten ids get a hash suffix so two
    ids never share a name."""
    raw = str(task_id)
    clean = re.sub(r"[^A-Za-z0-9._-]", "_", raw)[:80].lstrip(".")
    if clean != raw or not clean:
        digest = hashlib.sha256(raw.encode("utf-8", "surrogatepass")).hexdigest()
        clean = f"{clean}_{digest[:12]}"
    return "task_" + clean


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
    """File digests kept in $XDG_CACHE_HOME/kvoffload/digests.json (else ~/.cache/...), owner-only.
    A cache that cannot be read or written is no error: the file is hashed again next time."""

    def __init__(self):
        root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        self.path = os.path.join(root, "kvoffload", "digests.json")
        self.entries = {}
        self.changed = False
        try:
            with open(self.path) as f:
                # a digest planted by someone else is not trusted
                if os.fstat(f.fileno()).st_uid == os.getuid():
                    entries = json.load(f)
                    self.entries = entries if isinstance(entries, dict) else {}
        except (OSError, ValueError):
            pass

    def digest(self, path):
        real = os.path.realpath(path)
        key = stat_key(path)
        hit = self.entries.get(real)
        if isinstance(hit, dict) and hit.get("key") == key and isinstance(hit.get("sha256"), str):
            return hit["sha256"]
        digest = file_sha256(path)
        if stat_key(path) == key:  # not rewritten while we read it: the digest belongs to that key
            self.entries[real] = {"key": key, "sha256": digest}
            self.changed = True
        return digest

    def save(self):
        """Atomically (a temporary file renamed over the old one);
        any failure leaves the run alone."""
        if not self.changed:
            return
        # forget deleted checkpoints
        self.entries = {p: e for p, e in self.entries.items() if os.path.exists(p)}
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(self.entries, f)
            os.replace(tmp, self.path)
        except OSError:
            try:
                os.remove(tmp)
            except OSError:
                pass


class TaskDir:
    """Create (owner-only) and lock offload_dir/task_<id>/.
    Two users of one directory are refused."""

    def __init__(self, root, task_id, sub=None):
        """sub: a rank's own subdirectory
        (tensor parallel: every rank keeps its store in task_<id>/rank<r>/)."""
        self.top = os.path.join(root, safe_task_name(task_id))
        self.path = os.path.join(self.top, sub) if sub else self.top
        try:
            os.makedirs(self.path, mode=0o700, exist_ok=True)
            lock_path = os.path.join(self.path, "lock")
            self.lock_fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
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
            raise TaskDirError(f"{self.path} is in use by process {holder}; wait for it to finish "
                               "or give this task another id") from None
        os.ftruncate(self.lock_fd, 0)
        os.pwrite(self.lock_fd, f"{os.getpid()}\n".encode(), 0)

    def read_manifest(self):
        """The manifest dict, or None if there is none or it cannot be parsed
        (then it is reported and ignored)."""
        path = os.path.join(self.path, "manifest.json")
        try:
            with open(path) as f:
                m = json.load(f)
            return m if isinstance(m, dict) and m.get("version") == MANIFEST_VERSION else None
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return None

    def write_manifest(self, manifest):
        """Atomically: write a temporary file, fsync it, rename it over the old one,
        fsync the directory."""
        tmp = os.path.join(self.path, "manifest.json.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, json.dumps({"version": MANIFEST_VERSION, **manifest}).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, os.path.join(self.path, "manifest.json"))
        dfd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def close(self, remove):
        if remove:
            for name in os.listdir(self.path):
                os.remove(os.path.join(self.path, name))
        os.close(self.lock_fd)  # releases the flock
        if remove:
            try:
                os.rmdir(self.path)
                if self.path != self.top:
                    os.rmdir(self.top)  # the last rank to finish removes task_<id>/ itself
            except OSError:
                pass
