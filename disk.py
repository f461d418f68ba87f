"""
The disk tier: np.memmap files (or zstd blobs) in one directory per task, and the careful I/O around
them.

On CPU a raw chunk is read in place: `view()` is a zero-copy tensor over the mapped file, so its
pages belong to the page cache (RssFile, which the OS may evict), not to the process (RssAnon). On
CUDA the store copies chunks through pinned bounce buffers with `read_into()` (one pread) and
`write()`.
"""
import errno
import os
import time
import zlib

import numpy as np
import torch

from private import PrivateError, open_private, remove_quietly

# every chunk starts on a page boundary in every tier, so kernels see identically aligned inputs
ALIGN = 4096


def round_up(n, a):
    return (n + a - 1) // a * a


class DiskTier:
    """One file per layer. Raw: an np.memmap with chunk j at byte j*slot_bytes, its space reserved
    up front so that a full disk is an error at the start, never a SIGBUS in the middle of a run.
    zstd: blobs appended to a file, the byte planes of each element split first (KV compresses
    better that way), with an index (offset, length). Every write keeps a CRC32 of what it
    stored, so that a manifest can vouch for the chunk after a crash (vouch, verify_prefix)."""

    def __init__(self, path, n_layers, n_chunks, shape, dtype, compress, restore=None):
        """path: the task's (private) directory; restore: a manifest's "chunks" (checked by
        taskdir.chunks_problem) to resume from, or None to start afresh."""
        self.path = path
        self.shape = shape
        self.dtype = dtype
        self.compress = compress
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.chunk_bytes = int(np.prod(shape)) * self.itemsize
        self.slot_bytes = round_up(self.chunk_bytes, ALIGN)
        self.n_layers = n_layers
        self.index = {}  # zstd: (layer, j) -> (offset, length)
        self.views = {}  # raw: (layer, j) -> tensor over the mapping
        self.crcs = {}   # (layer, j) -> CRC32 of the chunk as stored
        self.fds = []
        self.maps = []
        names = [f"layer{l}.zst" if compress == "zstd" else f"layer{l}.kv" for l in range(n_layers)]
        try:
            self.resumed = False
            if restore is not None:
                self.resumed = self._open(names, fresh=False)
            if not self.resumed:  # nothing to resume, or files that are not ours: start afresh
                self._open(names, fresh=True)
            if compress == "zstd":
                import zstandard
                self.zc = zstandard.ZstdCompressor(level=1)
                self.zd = zstandard.ZstdDecompressor()
                if self.resumed:
                    self.index = self._blob_index(restore)
                self.ends = []  # per layer: the end of its last blob
                for l in range(n_layers):
                    ends = [o + n for (l2, _), (o, n) in self.index.items() if l2 == l]
                    self.ends.append(max(ends, default=0))
            else:
                size = n_chunks * self.slot_bytes
                for fd in self.fds:
                    reserve(fd, size)
                    # mapped through the descriptor open_private checked, never by name again
                    with open(fd, "r+b", closefd=False) as f:
                        self.maps.append(np.memmap(f, dtype=np.uint8, mode="r+", shape=(size,)))
        except (OSError, PrivateError) as e:
            self.close()
            # PrivateError: a link came back at a name just cleared, a file that is not ours
            code = e.errno if isinstance(e, OSError) else errno.EEXIST
            raise DiskError(code, f"--offload-dir: cannot create the disk tier in {path} "
                                  f"({getattr(e, 'strerror', None) or e})") from None

    def _open(self, names, fresh):
        """Open every layer's file, private (private.open_private). Fresh: whatever is at the name
        is removed (a link goes, never its target) and a new file made. Else the files left by the
        run being resumed: True if all are there and ours, else False with none left open."""
        for name in names:
            f = os.path.join(self.path, name)
            if fresh:
                remove_quietly(f)
                self.fds.append(open_private(f, os.O_RDWR | os.O_CREAT | os.O_EXCL))
                continue
            try:
                self.fds.append(open_private(f, os.O_RDWR))
            except (OSError, PrivateError):
                self.close()
                return False
        return True

    def _blob_index(self, chunks):
        """A manifest's blob positions, chunk by chunk, up to the first one that does not lie
        inside its file or is longer than any compressed chunk can be (a truncated file, a forged
        manifest): that chunk and the ones after it are recomputed."""
        sizes = [os.fstat(fd).st_size for fd in self.fds]
        longest = self.chunk_bytes + (self.chunk_bytes >> 7) + 1024  # above zstd's worst case
        index = {}
        for j in range(len(chunks)):
            blobs = chunks[str(j)]["blob"]
            if not all(0 < n <= longest and off + n <= size
                       for (off, n), size in zip(blobs, sizes)):
                break
            for l, (off, n) in enumerate(blobs):
                index[(l, j)] = (off, n)
        return index

    def view(self, layer, j):
        """Raw tier: chunk j of layer as a zero-copy tensor over the mapped file (made once, then
        reused: slicing an np.memmap costs more than attending a small chunk)."""
        if (layer, j) not in self.views:
            start = j * self.slot_bytes
            mapped = self.maps[layer][start:start + self.chunk_bytes]
            # [chunk_bytes] uint8 -> a chunk of `shape`
            self.views[(layer, j)] = torch.from_numpy(mapped).view(self.dtype).view(self.shape)
        return self.views[(layer, j)]

    def flat(self, layer):
        """Raw tier: layer's whole mapped file as a flat uint8 tensor (zero-copy), over which a
        group of its chunks is one view (pools.group_view)."""
        if ("flat", layer) not in self.views:
            self.views[("flat", layer)] = torch.from_numpy(self.maps[layer])
        return self.views[("flat", layer)]

    def advise(self, layer, first, last):
        """Raw tier: ask the OS to read chunks first..last into the page cache now (a no-op for
        pages there). posix_fadvise, not madvise on the mapping: the kernel does the same
        read-ahead, but Python releases the GIL around it, so the reader thread no longer holds up
        the decode loop (~4% of a step at 6K tokens)."""
        start = first * self.slot_bytes
        length = (last + 1 - first) * self.slot_bytes
        os.posix_fadvise(self.fds[layer], start, length, os.POSIX_FADV_WILLNEED)

    def advise_chunks(self, keys):
        """Reader thread: advise [(layer, j), ...] of disk chunks, one fadvise per layer over the
        span of its chunks (the file keeps them in order)."""
        span = {}
        for l, j in keys:
            first, last = span.get(l, (j, j))
            span[l] = (min(first, j), max(last, j))
        for l, (first, last) in span.items():
            self.advise(l, first, last)

    def write(self, layer, j, src):
        """src: a host tensor [2, B, G, C, D]. Returns the bytes written."""
        if self.compress != "zstd":
            # numpy, not torch, copies on the worker thread: a torch copy here would start a second
            # OpenMP team that slows every op of the main thread
            dst = as_bytes(self.view(layer, j))
            dst[:] = as_bytes(src)
            self.crcs[(layer, j)] = zlib.crc32(dst)
            return self.chunk_bytes
        blob = self.zc.compress(split_planes(as_bytes(src), self.itemsize))
        off = self.ends[layer]
        done = 0
        # pwrite may write less (a file-size limit): the next call then says why
        while done < len(blob):
            done += retry(lambda: os.pwrite(self.fds[layer], memoryview(blob)[done:], off + done))
        self.ends[layer] += len(blob)
        self.index[(layer, j)] = (off, len(blob))
        self.crcs[(layer, j)] = zlib.crc32(blob)
        return len(blob)

    def read_into(self, layer, j, dst):
        """Copy (raw) or decompress (zstd) chunk j into the host tensor dst. Returns the bytes read
        from the file."""
        if self.compress != "zstd":
            # one pread into dst (a pinned bounce on CUDA): the kernel reads ahead, where copying
            # through the mapping would fault the pages in 4 KiB at a time
            buf = as_bytes(dst)
            n = retry(lambda: os.preadv(self.fds[layer], [buf], j * self.slot_bytes))
            if n != self.chunk_bytes:
                raise OSError(errno.EIO, f"{self.path}/layer{layer}.kv: short read of chunk {j}")
            return n
        import zstandard
        try:
            planes = self.zd.decompress(self.blob(layer, j), max_output_size=self.chunk_bytes)
        except zstandard.ZstdError as e:  # the file was changed under the run (not by it)
            raise DiskError(errno.EIO, f"{self.path}/layer{layer}.zst: chunk {j} does not "
                                       f"decompress ({e}); something else wrote to the disk tier "
                                       "while the run used it") from None
        if len(planes) != self.chunk_bytes:
            raise DiskError(errno.EIO, f"{self.path}/layer{layer}.zst: chunk {j} decompresses to "
                                       f"{len(planes)} bytes, not {self.chunk_bytes}; something "
                                       "else wrote to the disk tier while the run used it")
        join_planes(planes, self.itemsize, as_bytes(dst))
        return self.index[(layer, j)][1]

    def blob(self, layer, j):
        off, n = self.index[(layer, j)]
        data = retry(lambda: os.pread(self.fds[layer], n, off))
        if len(data) != n:
            raise OSError(errno.EIO, f"{self.path}/layer{layer}.zst: short read of chunk {j}")
        return data

    def vouch(self, n):
        """What a manifest records for chunks 0..n-1 of every layer, all written: per chunk the
        CRC32 of each layer's stored bytes and, compressed, where each blob lies."""
        layers = range(self.n_layers)
        chunks = {}
        for j in range(n):
            blobs = [self.index[(l, j)] for l in layers] if self.index else None
            chunks[str(j)] = {"crc": [self.crcs[(l, j)] for l in layers], "blob": blobs}
        return chunks

    def verify_prefix(self, n, chunks):
        """Of chunks 0..n-1 left by an interrupted run, how many (a prefix) still hold what the
        manifest's `chunks` vouch for; their checksums are kept for the next manifest."""
        if not self.resumed:
            return 0
        for j in range(n):
            crcs = chunks[str(j)]["crc"]
            if not all(self.restorable(l, j, crc) for l, crc in enumerate(crcs)):
                return j
            for l, crc in enumerate(crcs):
                self.crcs[(l, j)] = crc
        return n

    def restorable(self, layer, j, crc):
        """Chunk j of layer is what the run that vouched `crc` for it stored: its CRC32 matches
        and, compressed, its blob decompresses to exactly one chunk."""
        if self.compress != "zstd":
            return zlib.crc32(as_bytes(self.view(layer, j))) == crc
        if (layer, j) not in self.index:
            return False
        blob = self.blob(layer, j)
        if zlib.crc32(blob) != crc:
            return False
        import zstandard
        try:
            planes = self.zd.decompress(blob, max_output_size=self.chunk_bytes)
        except zstandard.ZstdError:
            return False
        return len(planes) == self.chunk_bytes

    def flush(self):
        """Make every write so far durable (msync / fsync) before a manifest vouches for it."""
        for m in getattr(self, "maps", []):
            m.flush()
        for fd in self.fds if self.compress == "zstd" else []:
            os.fsync(fd)

    def close(self):
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        self.maps = []
        self.views = {}


class DiskError(OSError):
    """The disk tier cannot be created or written; errno tells why (DISK_FULL lists the ones a
    fallback can cure)."""

    def __str__(self):  # the sentence alone: the errno is for code, not for the user
        return self.strerror or super().__str__()


DISK_FULL = (errno.ENOSPC, errno.EFBIG, errno.EACCES, errno.EROFS, errno.EDQUOT, errno.EPERM)
TRANSIENT = (errno.EIO, errno.EAGAIN, errno.EINTR, errno.EBUSY)


def retry(op, attempts=4, delay=0.05):
    """Retry an I/O call on errors that may pass (EIO, EAGAIN, EINTR, EBUSY), backing off 4x each
    time."""
    for i in range(attempts):
        try:
            return op()
        except OSError as e:
            if e.errno in DISK_FULL:
                raise DiskError(e.errno, e.strerror) from None
            if e.errno not in TRANSIENT or i == attempts - 1:
                raise
            time.sleep(delay * 4 ** i)


def reserve(fd, nbytes):
    """Allocate the file's blocks now (posix_fallocate); fall back to a sparse file where the FS
    cannot."""
    if os.fstat(fd).st_size >= nbytes:
        return
    try:
        retry(lambda: os.posix_fallocate(fd, 0, nbytes))
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, nbytes)


def split_planes(b, itemsize):
    """Flat element bytes -> [itemsize, n] contiguous: every element's byte 0, then every
    byte 1, ... KV compresses better that way (the high bytes of nearby values repeat, the low
    bytes are close to noise)."""
    return np.ascontiguousarray(b.reshape(-1, itemsize).T)


def join_planes(planes, itemsize, dst):
    """Undo split_planes: planes (bytes-like, [itemsize, n]) -> the flat uint8 array dst, in
    place."""
    dst.reshape(-1, itemsize)[:] = np.frombuffer(planes, np.uint8).reshape(itemsize, -1).T


def as_bytes(t):
    """A contiguous CPU tensor's bytes as a flat uint8 numpy array (no copy)."""
    return t.reshape(-1).view(torch.uint8).numpy()
