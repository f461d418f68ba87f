"""
One process or many: what the command line needs to run the same commands under torchrun.
torch.distributed is the engine (NCCL on GPUs, gloo on CPU); this file only decides who loads what,
who speaks, which tasks a replica runs, and how the batch's totals meet on rank 0. There is no
scheduler beyond splitting the task list.

    # tensor parallel: 1 replica of 2 ranks
    torchrun --nproc-per-node 2 generate.py --ckpt DIR ...
    # 2 replicas of 2 ranks, tasks split
    torchrun --nproc-per-node 4 generate.py --tp 2 --prompts T --output R

A replica (data-parallel group) is --tp consecutive ranks holding one model between them; its leader
(tp rank 0) samples, prints and writes results. A plain `python generate.py` is one replica of one
rank.
"""
import os
import sys
import time

import torch.distributed as dist

from model import Transformer
from runs.tp import Layout, init_distributed, load_sharded, split_tasks


class LaunchError(ValueError):
    """A launch that cannot work (--tp without torchrun, a world that --tp does not divide):
    one sentence."""


def under_torchrun():
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def check(tp):
    """Refuse a --tp that cannot work, from the environment torchrun sets, before anything starts
    (no process group, no file)."""
    if tp is not None and tp < 1:
        raise LaunchError(f"--tp must be >= 1 (ranks a model is split over), got {tp}")
    if not under_torchrun():
        if tp is not None:
            script = os.path.basename(sys.argv[0]) or "generate.py"  # verify.py's, or ours
            raise LaunchError(f"--tp {tp} needs torchrun: torchrun --nproc-per-node N {script} "
                              f"--tp {tp} ...; without torchrun drop --tp")
        return
    world = int(os.environ["WORLD_SIZE"])
    if tp is not None and (tp < 1 or world % tp):
        raise LaunchError(f"--tp {tp} does not divide the {world} ranks torchrun started; "
                          f"choose --tp dividing {world}")


def refuse(message, layout=None):
    """One rank says why the run stops (the others leave quietly). Under torchrun the first rank to
    exit makes it stop the rest, so the quiet ones wait a moment: rank 0's sentence gets out
    first."""
    rank = layout.rank if layout else int(os.environ.get("RANK", "0"))
    if rank == 0:
        print(message, file=sys.stderr, flush=True)
    elif under_torchrun():
        time.sleep(REFUSAL_GRACE_S)


REFUSAL_GRACE_S = 3.0  # seconds a quiet rank waits before exiting with a refusal


def start(tp, device):
    """This process's Layout. --tp needs torchrun; without it everything is one rank, as before."""
    check(tp)
    if not under_torchrun():
        return Layout.single(device)
    return init_distributed(tp, device)


def load(ckpt, layout, device, dtype, rope_override=None, quantize=None):
    """This rank's model: the whole checkpoint with one rank per replica,
    else its slices (tp.load_sharded)."""
    if layout.tp == 1:
        kw = {"quantize": quantize} if quantize else {}
        return Transformer.from_pretrained(ckpt, device=device, dtype=dtype,
                                           rope_override=rope_override, **kw)
    if quantize:
        raise LaunchError("--quantize is not combined with tensor parallelism (--tp > 1) yet; "
                          "drop one of them")
    return load_sharded(ckpt, layout, device, dtype, rope_override=rope_override)


def my_tasks(tasks, layout):
    """The tasks this replica runs: a deterministic split by task id, the same on every rerun."""
    mine = set(split_tasks([t["id"] for t in tasks], layout.n_replicas, layout.replica))
    return [t for t in tasks if t["id"] in mine]


def from_leader(obj, layout):
    """The leader's `obj` on every rank of its replica (a collective of the replica), so that they
    run the same list even if they read the results file at different moments."""
    if layout.tp == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=layout.leader, group=layout.group)
    return box[0]


def gather_to_zero(obj, layout):
    """Every rank's obj on global rank 0, in rank order; None elsewhere (a collective: every rank
    calls it)."""
    if layout.world == 1:
        return [obj]
    everyone = [None] * layout.world if layout.rank == 0 else None
    dist.gather_object(obj, everyone, dst=0)
    return everyone


def batch_totals(totals, layout):
    """Every replica leader's totals meet on global rank 0 (a collective: every rank calls it).
    Returns (summed totals, list of per-replica totals) on rank 0, (None, None) elsewhere."""
    if layout.world == 1:
        return totals, [totals]
    everyone = gather_to_zero(totals if layout.is_leader else None, layout)
    if layout.rank != 0:
        return None, None
    shares = [t for t in everyone if t is not None]
    keys = ("done", "resumed", "new_tokens", "decode_s", "batched_steps", "batched_rows")
    summed = {k: sum(s.get(k, 0) for s in shares) for k in keys}
    summed["failed"] = [f for s in shares for f in s["failed"]]
    # the largest of the replicas (they ran at the same time)
    for k in ("peak_device", "peak_rss", "wall_s"):
        summed[k] = max(s.get(k, 0) for s in shares)
    summed["bytes"] = {k: sum(s["bytes"].get(k, 0) for s in shares) for k in shares[0]["bytes"]}
    return summed, shares


def finish(layout):
    """Leave the process group in order: a barrier (every rank is done with it), then destroy it,
    which joins gloo's worker threads. Returns whether they are gone. A thread of theirs still
    alive at exit may be releasing the last collective's tensors, which needs the interpreter
    while it shuts down: Python ends that thread inside a C++ destructor, and the process aborts
    ("terminate called without an active exception") after all its work is done."""
    if layout.world > 1 and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return not backend_threads()


def backend_threads():
    """This process's threads that belong to the collectives' backend (gloo), from /proc."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # a thread that ended while we looked
            pass
    return [n for n in names if "gloo" in n]


def exit(code):
    """End the process with `code`. If the backend's threads outlived the process group (finish),
    end it without the interpreter's shutdown, which would race them: everything of ours is closed
    and written by then, so only stdout and stderr need flushing."""
    if backend_threads():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
