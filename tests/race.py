"""
A happens-before race detector for the store's buffers, driven by the emulated CUDA of cuda_emu.py.

Actors are host threads and streams (each host thread's compute stream is an actor of its own: on a
GPU it runs behind the host, so host code is not ordered after compute unless it synchronises).
Every actor keeps a vector clock; an ordering operation hands a snapshot from one actor to another:
    host -> stream      issuing any stream operation (the stream runs it after the host's earlier
                        work)
    stream -> event     event.record; event -> stream by stream.wait_event, event -> host by
                        event.synchronize
    stream -> host      stream.synchronize, torch.cuda.synchronize
    host -> host        executor submit (caller -> task), future result (task -> caller), a clocked
                        queue handoff
Each access (read or write of a byte range inside a registered buffer) is stamped with its actor's
clock value. A write must be ordered after the last write and every read since; a read after the
last write. Anything else is a race, reported with the buffer, the two accesses (actor, operation,
source line) and the rule that is missing.
"""
import bisect
from dataclasses import dataclass, field


@dataclass(eq=False)
class Actor:
    name: str
    kind: str  # "host" | "compute" | "copy"


@dataclass(eq=False)
class Buffer:
    start: int
    end: int
    name: str
    kind: str  # "device" | "slot" | "host" | "bounce" | "write bounce"
    cells: dict = field(default_factory=dict)  # (start, end) -> [last write, {actor: read}]


# Which rule orders two conflicting accesses, by (buffer kind, first actor kind + op, second actor
# kind + op).
RULES = {
    ("device", "compute write", "copy read"):
        "rule 1: the device-to-host copy must wait for the compute that wrote the chunk (event on "
        "the compute stream, copy_stream.wait_event)",
    ("device", "copy read", "compute write"):
        "rule 5: a device buffer is reused only after the copy out of it has finished (compute "
        "stream waits for the copy's fence)",
    ("device", "copy read", "compute read"):
        "none needed (two reads)",
    ("slot", "copy write", "compute read"):
        "rule 2: attention must wait for the copy that staged the slot",
    ("slot", "compute read", "copy write"):
        "rule 3: a staging slot is refilled only after attention's last read of it (event recorded "
        "at release, waited on by the copy stream)",
    ("slot", "copy write", "copy write"):
        "rule 3: two fills of one slot on different streams",
    ("bounce", "copy read", "host write"):
        "rule 4: a read bounce is refilled from disk only after the host-to-device copy out of it "
        "has finished",
    ("bounce", "host write", "copy read"):
        "rule 4: the copy out of a read bounce is issued after the disk read",
    ("write bounce", "copy write", "host read"):
        "rule 4: the CPU reads a write bounce (to write disk) only after the device-to-host copy "
        "into it has finished",
    ("write bounce", "host read", "copy write"):
        "rule 4: a write bounce is refilled only after its disk write has read it (the bounce's "
        "hand-back to the store)",
    ("host", "copy write", "copy read"):
        "rule 4: the host pool chunk is read only after the copy into it",
    ("host", "copy write", "host read"):
        "rule 4: the CPU reads a host pool chunk (read_back) only after the device-to-host copy "
        "into it has finished",
}


class Detector:
    def __init__(self):
        self.clocks = {}     # actor -> {actor: int}
        self.starts = []     # sorted starts of registered buffers
        self.buffers = {}    # start -> Buffer
        self.races = []      # one message per distinct race
        self.seen = set()

    # ---- clocks ---------------------------------------------------------------------------------

    def clock(self, actor):
        return self.clocks.setdefault(actor, {actor: 1})

    def send(self, actor):
        """A snapshot of actor's clock for another actor to join; the actor's later work is not
        covered by it."""
        c = self.clock(actor)
        snap = dict(c)
        c[actor] += 1
        return snap

    def join(self, actor, snap):
        c = self.clock(actor)
        for a, t in snap.items():
            if c.get(a, 0) < t:
                c[a] = t

    # ---- buffers --------------------------------------------------------------------------------

    def register(self, start, end, name, kind):
        """A fresh allocation: whatever was registered over these bytes before is gone, with its
        history."""
        i = bisect.bisect_left(self.starts, start)
        if i > 0 and self.buffers[self.starts[i - 1]].end > start:
            i -= 1
        while i < len(self.starts) and self.starts[i] < end:
            del self.buffers[self.starts.pop(i)]
        bisect.insort(self.starts, start)
        self.buffers[start] = Buffer(start, end, name, kind)

    def rename(self, start, name, kind):
        b = self.buffers.get(start)
        if b is not None:
            b.name = name
            b.kind = kind

    def buffer_at(self, start):
        i = bisect.bisect_right(self.starts, start) - 1
        if i < 0:
            return None
        b = self.buffers[self.starts[i]]
        return b if start < b.end else None

    # ---- accesses -------------------------------------------------------------------------------

    def access(self, actor, start, end, write, where):
        """actor reads (or writes) bytes [start, end); check it against the conflicting accesses
        before it, in every buffer the range covers (a copy of a run of chunks covers several)."""
        i = max(0, bisect.bisect_right(self.starts, start) - 1)
        while i < len(self.starts) and self.starts[i] < end:
            b = self.buffers[self.starts[i]]
            if b.end > start:
                self.access_in(b, actor, max(start, b.start), min(end, b.end), write, where)
            i += 1

    def access_in(self, b, actor, start, end, write, where):
        c = self.clock(actor)
        me = (actor, c[actor], "write" if write else "read", where)
        for (s, e), (last_write, reads) in b.cells.items():
            if s >= end or e <= start:
                continue
            # a write conflicts with the last write and every read since; a read with the write
            priors = [last_write] + list(reads.values()) if write else [last_write]
            for prior in priors:
                if prior is not None and prior[0] is not actor and c.get(prior[0], 0) < prior[1]:
                    self.report(b, prior, me)
        cell = b.cells.setdefault((start, end), [None, {}])
        if write:
            cell[0] = me
            cell[1] = {}
        else:
            cell[1][actor] = me

    def report(self, b, first, second):
        key = (b.name, first[0].kind, first[2], first[3], second[0].kind, second[2], second[3])
        if key in self.seen:
            return
        self.seen.add(key)
        kinds = (b.kind, f"{first[0].kind} {first[2]}", f"{second[0].kind} {second[2]}")
        rule = RULES.get(kinds, "no rule of the store orders these two accesses")
        self.races.append(f"race on {b.name}: {first[2]} by {first[0].name} at {first[3]}, then "
                          f"{second[2]} by {second[0].name} at {second[3]}, not ordered by "
                          f"happens-before; missing {rule}")
