"""
Private directories and files: everything this project writes lives in a directory that only you
can use (yours, mode 700, not a symbolic link) and in files only you can read (0600), opened
without following links. Every module that writes a file comes here: the task directories and the
disk tier, the KV store, the digest cache, the trace, the results, the probe files.

Why: another user who can write a directory we use can plant a symbolic link at a name we are about
to open (task_<id>, lock, layer0.kv, a temporary file) and make us truncate or overwrite a file of
ours outside it, or plant state (a manifest, a KV entry) that we would trust. So a directory is
checked before use and refused in one sentence if others could write it, and a file is opened with
O_NOFOLLOW (a link at its name is an error, never followed), created with O_EXCL where it is new,
and replaced through a new file renamed over it (write_atomic), never rewritten in place.

What this cannot stop: whoever can rename entries in the directory *above* a private directory can
swap the whole directory after the check; keep it under directories only you (or root) can write.
"""
import os
import secrets
import stat

DIR_MODE = 0o700
FILE_MODE = 0o600


class PrivateError(ValueError):
    """A directory or file that is not private to this user; the message names it and what to
    do."""


def make_private_dir(path, what, create=True):
    """Create `path` (and its missing parents) mode 700, or check the directory already there: a
    directory, not a symbolic link, owned by this user, and open to nobody else. Returns True if
    this call created it. `what` names it for the user (a flag such as "--offload-dir")."""
    given = path
    path = os.fspath(path).rstrip(os.sep) or os.sep  # "link/" would make lstat follow a link
    created = False
    if create and not os.path.lexists(path):
        created = True
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.lexists(parent):
            make_private_dir(parent, what)
        try:
            os.mkdir(path, DIR_MODE)
        except FileExistsError:  # another process (a rank, a concurrent task) made it first
            created = False
        except OSError as e:
            raise PrivateError(f"{what} {given} cannot be created ({e.strerror}); choose a "
                               "directory you can write") from None
    try:
        st = os.lstat(path)
    except OSError as e:
        raise PrivateError(f"{what} {given} cannot be used ({e.strerror}); choose a directory you "
                           "can write") from None
    problem = dir_problem(st)
    if problem:
        raise PrivateError(f"{what} {given} {problem}")
    return created


def dir_problem(st):
    """Why a directory with this lstat result is not private, as the end of a sentence; or None."""
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link; give the directory it points to, or remove the link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory; choose another path"
    if st.st_uid != os.getuid():
        return f"belongs to another user (uid {st.st_uid}); choose a directory of your own"
    if mode & 0o077:
        return (f"is open to other users (mode {mode:o}); chmod 700 it, or choose a directory "
                "of your own")
    return None


def what_is_wrong(e):
    """An open_private failure (OSError or PrivateError) as the words for what is wrong, without
    PrivateError's own advice: for a caller whose sentence gives its own."""
    return str(e).split("; ")[0] if isinstance(e, PrivateError) else e.strerror or str(e)


def open_private(path, flags):
    """os.open for a file of ours: never through a symbolic link at its name (O_NOFOLLOW), never
    inherited by a child process (O_CLOEXEC), created 0600. A file already there must be a regular
    file of this user's with no other hard link; otherwise PrivateError, before anything is read or
    written (so never pass O_TRUNC: truncate once this returns). Other OSErrors (ENOENT, ...)
    propagate."""
    # O_NONBLOCK: a FIFO planted at the name cannot hang the open; cleared for the real file
    flags |= os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, FILE_MODE)
    except OSError:
        if os.path.islink(path):  # ELOOP, or EEXIST with O_EXCL: either way a link is there
            raise PrivateError(f"{path} is a symbolic link, which this project never writes or "
                               "reads through; give another path") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # a device, a FIFO, a socket: never ours to write
        os.close(fd)
        raise PrivateError(f"{path} is not a regular file; give another path")
    # nlink 0 is a file removed since the open (an eviction): ours still; 2 or more is not
    if st.st_uid != os.getuid() or st.st_nlink > 1:
        os.close(fd)
        raise PrivateError(f"{path} is not a file of this project's (a file of your own with one "
                           "link); remove it, or give another path")
    os.set_blocking(fd, True)
    return fd


def create_private(dirpath, prefix, flags=0):
    """A new file with a random name in dirpath (O_EXCL: nothing already there is opened), 0600:
    (fd, path). flags are added to O_RDWR (e.g. O_DIRECT)."""
    while True:
        path = os.path.join(dirpath, prefix + secrets.token_hex(8))
        try:
            return open_private(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | flags), path
        except FileExistsError:
            continue  # 64 random bits taken already: draw again


def output_problem(path):
    """Why a file the user names for output (--json) cannot be written, as the end of a sentence,
    or None: checked before any work, so that a run is not lost at its end. Its directory must
    exist and be writable; a name already taken must be a regular file, which the output replaces
    (write_atomic) - never a directory, a device, or a symbolic link, which write_atomic would
    replace by a file."""
    if os.path.lexists(path):
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            return "is a symbolic link, which this project never writes through; give a file's path"
        if stat.S_ISDIR(st.st_mode):
            return "is a directory; give the path of a file in it"
        if not stat.S_ISREG(st.st_mode):
            return "is not a regular file; give the path of a file"
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return "cannot be written: its directory does not exist"
    try:  # a file made and removed where the output's temporary file will be (write_atomic)
        fd, probe = create_private(parent, f".{os.path.basename(path)}.tmp-")
        os.close(fd)
        os.remove(probe)
    except (OSError, PrivateError) as e:
        return f"cannot be written ({getattr(e, 'strerror', None) or e}); choose another path"
    return None


def write_atomic(path, data):
    """Replace the file at `path` with the bytes `data`: written to a new private file in the same
    directory, synced, renamed over `path`, the directory synced. A reader sees the old bytes or the
    new ones, never a mix; a link planted at `path` is replaced, never followed."""
    dirpath = os.path.dirname(path) or "."
    fd, tmp = create_private(dirpath, f".{os.path.basename(path)}.tmp-")
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
        os.close(fd)
        fd = None
        os.replace(tmp, path)
    except BaseException:
        if fd is not None:
            os.close(fd)
        remove_quietly(tmp)
        raise
    fsync_dir(dirpath)


def fsync_dir(path):
    """Make a rename durable: the directory entry, not only the file's data."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_quietly(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
