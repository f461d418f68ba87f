"""
Prefetch: the chunks a step reads that are off the device, brought ahead of attention, in its
order. TieredStore (offload.py) is a Prefetcher: these are its staging verbs, kept apart from the
tiers' bookkeeping because this is where the streams meet.

    prefetch(reads)        start of a step: queue the chunks it reads that are off the device
    prefetch_more(reads)   more of them, once a layer's selection decides its reads (policy.Quest)
    (pump)                 stage the queue's head while a staging slot or group buffer is free
    staged_runs(l, js)     attention's runs of staged chunks, each released once attended
    release(l, j)          attention is done with chunk j: its slot (or group buffer) may refill

What stages a chunk: on CUDA, a host-pool chunk is one asynchronous copy on the copy stream (pinned
memory), a disk chunk a read into a pinned bounce by the reader thread and then that copy; on CPU
only a zstd chunk is staged (the reader decompresses it into a slot; raw host and disk chunks are
read in place). On CUDA a run of one layer's consecutive chunks of a group (GROUP_CHUNKS), lying
side by side in the host pool (HostPool.take), crosses as one copy into a group buffer, and
attention reads it there as one tensor: one copy and one kernel call for the run, where chunk by
chunk it took a copy into a staging slot and another into the group buffer per chunk. Two group
buffers: one crosses while attention reads the other. Everything is staged and released in
attention's order, so a slot or buffer is always freed by the chunk ahead of the one that waits for
it. Every wait is marked "rule N" (offload.py lists the rules).
"""
from concurrent.futures import Future

import torch

from disk import as_bytes
from pools import DEVICE, DISK, GROUP_CHUNKS, GroupSlot, Loc


class Prefetcher:
    """The staging half of TieredStore: its queue, slots and group buffers are the store's
    `staging` (pools.Staging); the tiers it reads from are the store's host pool and disk."""

    def prefetch(self, reads):
        """Start of a step: queue the chunks it reads, [(layer, j), ...] in attention's order (all
        of layer 0's, then layer 1's, ...), so that the next layer's first chunks arrive while this
        layer's last are attended. Chunks on the device need nothing."""
        st = self.staging
        while st.inflight:  # a step that failed half-way left copies in flight: let them land first
            st.inflight.popleft()[3].result()
        st.reset()
        self.prefetch_more(reads)

    def prefetch_more(self, reads):
        """Queue more of this step's reads, after those already queued: a layer whose selection
        needs its own queries decides them only when it runs (policy.Quest)."""
        order = [key for key in reads if self.loc[key] is not DEVICE]
        if self.staged:
            self.staging.queue.extend(order)
            self._pump()
        elif self.disk is not None and order:
            # CPU, raw disk: attention reads the mapping in place; ask the OS to page in, ahead of
            # use, whatever it has evicted
            self.reader.submit(self.disk.advise_chunks, [k for k in order if self.loc[k] is DISK])

    def _pump(self):
        st = self.staging
        while st.queue:
            n = self._host_run()
            if n > 1:  # CUDA: chunks side by side in the host pool cross as one copy
                if not st.group_free:
                    return  # in attention's order: wait for attention to release a group buffer
                self._copy_group([st.queue.popleft() for _ in range(n)], st.group_free.popleft())
                continue
            if not st.free:
                return
            l, j = st.queue.popleft()
            slot = st.free.pop()
            where = self.loc[(l, j)]
            if self.cuda and where.tier == "host":  # pinned memory: an async copy, no thread needed
                fut = Future()
                fut.set_result(self._copy_in(l, j, slot, self.host.slots[where.slot]))
            else:
                fut = self.reader.submit(self._stage, l, j, slot)
            st.inflight.append((l, j, slot, fut))

    def _host_run(self):
        """How many chunks at the head of the staging queue are one layer's consecutive chunks of
        one block (GROUP_CHUNKS), in consecutive host pool slots (0 without group buffers)."""
        st = self.staging
        if not st.groups:
            return 0
        l, j = st.queue[0]
        first = self.loc[(l, j)]
        n = 0
        block = j // GROUP_CHUNKS
        while (n < min(len(st.queue), len(st.groups[0])) and (j + n) // GROUP_CHUNKS == block
               and st.queue[n] == (l, j + n)
               and self.loc[(l, j + n)] == Loc("host", first.slot + n)):
            n += 1
        return n

    def _copy_group(self, keys, g):
        """Issue the host-to-device copy of chunks `keys`, consecutive in the host pool, into group
        buffer g: one copy of their bytes, on the copy stream."""
        st = self.staging
        stream = self.copy_stream
        first = self.host.slots[self.loc[keys[0]].slot]
        nbytes = (len(keys) - 1) * self.slot_bytes + self.chunk_bytes
        at = first.data_ptr() - self.host.flat.data_ptr()
        to = st.groups[g].data_ptr() - st.group_flat.data_ptr()
        with torch.cuda.stream(stream):
            stream.wait_event(st.group_released[g])  # rule 3: attention has finished with it
            for key in keys:
                stream.wait_event(self.evicted[key])  # rule 4: the eviction into src is done
            st.group_flat[to:to + nbytes].copy_(self.host.flat[at:at + nbytes], non_blocking=True)
            st.group_ready[g].record(stream)  # rule 2: attention waits for this before reading
        self.count("h2d", len(keys) * self.chunk_bytes)
        done = Future()
        done.set_result(None)
        for i, (l, j) in enumerate(keys):
            st.inflight.append((l, j, GroupSlot(g, i, i == len(keys) - 1), done))

    def _stage(self, l, j, slot):
        """Reader thread: bring chunk (l, j) from disk (or, CPU with zstd, from the host pool) into
        staging slot."""
        where, dst = self.loc[(l, j)], self.staging.slots[slot]
        if where is DISK:
            self.written[(l, j)].result()  # its write has landed (or raises its DiskError)
        if not self.cuda:  # CPU, zstd only: decompress a disk chunk straight into the slot
            if where is DISK:
                self.count("disk_read", self.disk.read_into(l, j, dst))
            else:  # a host-pool chunk in front of a zstd disk tier (numpy copies: see disk.py)
                as_bytes(dst)[:] = as_bytes(self.host.slots[where.slot])
                self.count("host_read", self.chunk_bytes)
            return
        bounce = self.read_bounces.slots[slot]
        self.staging.ready[slot].synchronize()  # rule 4: the last copy out of this bounce is done
        self.count("disk_read", self.disk.read_into(l, j, bounce))
        self._copy_in(l, j, slot, bounce)

    def _copy_in(self, l, j, slot, src):
        """Issue the host-to-device copy of a pinned chunk into staging slot `slot`, on the copy
        stream."""
        st = self.staging
        stream = self.copy_stream
        with torch.cuda.stream(stream):
            stream.wait_event(st.released[slot])  # rule 3: attention has finished with the slot
            if self.loc[(l, j)].tier == "host":
                stream.wait_event(self.evicted[(l, j)])  # rule 4: the eviction into src is done
            st.slots[slot].copy_(src, non_blocking=True)
            st.ready[slot].record(stream)  # rule 2: attention waits for this before reading
        self.count("h2d", self.chunk_bytes)

    def staged_runs(self, layer, js):
        """js as runs in order, each released once attended: the chunks one group copy brought,
        and the device chunks that follow them in the block copied in after them (the window's
        first chunks), as one view of the group buffer, one kernel call like a group of the arena;
        every other chunk alone (CPU with zstd: every chunk)."""
        st = self.staging
        i = 0
        while i < len(js):
            slot = st.inflight[0][2] if self.loc[(layer, js[i])] is not DEVICE else None
            if not isinstance(slot, GroupSlot):
                yield self.load(layer, js[i])[None]
                self.release(layer, js[i])
                i += 1
                continue
            n = 1  # the rest of its copy, as far as js goes
            while (i + n < len(js) and n < len(st.inflight) and st.inflight[n][:2] ==
                   (layer, js[i + n]) and getattr(st.inflight[n][2], "g", None) == slot.g):
                n += 1
            staged = js[i:i + n]
            for j in staged:
                self.load(layer, j)  # rule 2 waits in load
            buf = st.groups[slot.g]  # [GROUP_CHUNKS, *shape]
            while (i + n < len(js) and slot.i + n < len(buf)
                   and self.loc[(layer, js[i + n])] is DEVICE):
                # on the compute stream, after the group copy it waited for
                buf[slot.i + n].copy_(self.load(layer, js[i + n]))
                n += 1
            yield buf[slot.i:slot.i + n]
            for j in staged:
                self.release(layer, j)
            i += n

    def release(self, layer, j):
        if not self.staged or self.loc[(layer, j)] is DEVICE:
            return
        st = self.staging
        _, _, slot, _ = st.inflight.popleft()
        if isinstance(slot, GroupSlot):
            if slot.last:
                st.group_released[slot.g].record(torch.cuda.current_stream(self.device))  # rule 3
                st.group_free.append(slot.g)
                self._pump()
            return
        if self.cuda:
            st.released[slot].record(torch.cuda.current_stream(self.device))  # rule 3
        st.free.append(slot)
        self._pump()

