"""
A task's directory on disk: a safe name, a lock, and a manifest that makes the disk tier a checkpoint.

    offload_dir/task_<id>/
        lock            flock'ed by the process using the directory; holds its pid
        manifest.json   model fingerprint, dtype, chunk size, task parameters, token ids so far, and for every
                        chunk on disk its checksum (and, compressed, where its blob lives); replaced atomically
        layer{l}.kv     the disk tier (offload.DiskTier), raw or layer{l}.zst compressed

A killed run leaves chunks and a manifest behind; the next run of the same task checks the manifest against
the model and task, verifies each chunk's checksum, restores the longest valid prefix and recomputes the rest.
A manifest that does not match is reported and ignored, never trusted.
"""
import errno
import fcntl
import hashlib
import json
import os
import re

from model import checkpoint_files

MANIFEST_VERSION = 1


class TaskDirError(RuntimeError):
    """The task directory cannot be used; the message names it and why."""


def safe_task_name(task_id):
    """'task_' + the id with anything but letters, digits, '.', '_' and '-' replaced, so no id can reach outside
    the offload dir ('../', '/', NUL); long or rewritten ids get a hash suffix so two ids never share a name."""
    raw = str(task_id)
    clean = re.sub(r"[^A-Za-z0-9._-]", "_", raw)[:80].lstrip(".")
    if clean != raw or not clean:
        clean = f"{clean}_{hashlib.sha256(raw.encode('utf-8', 'surrogatepass')).hexdigest()[:12]}"
    return "task_" + clean


def model_fingerprint(ckpt_dir):
    """A hash of config.json and of every safetensors file's header and size: cheap, and changes with the weights'
    names, shapes, dtypes or file sizes. (Not a hash of every weight byte: that would cost a full read per run.)"""
    h = hashlib.sha256()
    with open(os.path.join(ckpt_dir, "config.json"), "rb") as f:
        h.update(f.read())
    for path in checkpoint_files(ckpt_dir):
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            h.update(f.read(min(n, 1 << 24)))
        h.update(str(os.path.getsize(path)).encode())
    return h.hexdigest()[:32]


class TaskDir:
    """Create (owner-only) and lock offload_dir/task_<id>/. Two users of one directory are refused."""

    def __init__(self, root, task_id, sub=None):
        """sub: a rank's own subdirectory (tensor parallel: every rank keeps its store in task_<id>/rank<r>/)."""
        self.top = os.path.join(root, safe_task_name(task_id))
        self.path = os.path.join(self.top, sub) if sub else self.top
        try:
            os.makedirs(self.path, mode=0o700, exist_ok=True)
            self.lock_fd = os.open(os.path.join(self.path, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise TaskDirError(f"{self.path}: cannot create the task directory ({e.strerror})") from None
        try:
            fcntl.flock(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            holder = os.pread(self.lock_fd, 64, 0).decode(errors="replace").strip() or "another task"
            os.close(self.lock_fd)
            raise TaskDirError(f"{self.path} is in use by process {holder}; wait for it to finish "
                               "or give this task another id") from None
        os.ftruncate(self.lock_fd, 0)
        os.pwrite(self.lock_fd, f"{os.getpid()}\n".encode(), 0)

    def read_manifest(self):
        """The manifest dict, or None if there is none or it cannot be parsed (then it is reported and ignored)."""
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
        """Atomically: write a temporary file, fsync it, rename it over the old one, fsync the directory."""
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
