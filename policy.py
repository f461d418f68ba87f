"""
The offload and attention policy in one place: what a researcher edits to try a new idea.

    selection   which sealed chunks a step's attention reads    Exact (default), Sink, Quest, Oracle
    eviction    which chunk leaves the device when one seals    Placement.evict: the oldest
    placement   where that chunk goes                           Placement.place: host, then disk
    planning    how many chunks sit in each tier                plan_tiers

The rest of the project asks and never decides. kvcache.KVCache asks the selection which chunks a
layer attends and hands the same list to the store's prefetcher, so the two cannot disagree;
offload.TieredStore asks the placement which chunk to evict and where it goes; the store, tune.py,
doctor.py, probe.py and the monitor size the tiers with plan_tiers.

Why a selection cannot break bit-identity across --offload modes: it sees positions, queries, and
digests computed from a chunk's bytes when it seals, never where a chunk lives. With the same
--select and budget every mode reads the same chunks in the same order and merges them the same
way, so verify.py's proof extends to it.

To try a new selection, subclass Sparse, give it a `name` and write `pick` (see Quest: about
fifteen lines). Defining the class registers it: `--select NAME --select-budget N` of generate.py,
verify.py and tools/longeval.py, their help texts and their error messages all read SELECTIONS.
A new placement is the same: subclass Placement, give it a `name`, write `place`; `--placement
NAME` uses it (PLACEMENTS).

Shapes: B batch, G kv heads, R query heads per kv head, D head dim, C chunk size, n chunks.
"""
import math
from dataclasses import dataclass

import torch

# the OffloadConfig fields that --select, --select-budget and --select-dense set: the flags, a
# run's recorded config and a task's identity all read this one list
SELECT_FIELDS = ("select", "select_budget", "select_dense")
# every selection by its --select name, in the order the classes are defined: a class with a
# `name` registers itself (Exact.__init_subclass__)
SELECTIONS = {}
# every placement by its --placement name, the same way (Placement.__init_subclass__)
PLACEMENTS = {}


class PolicyError(ValueError):
    """A policy class's mistake (a pick past its budget), named with the class: one sentence."""


# -----------------------------------------------------------------------------
# selection: which sealed chunks a step reads

class Exact:
    """Every visible chunk: exact attention (the default). `first` is the first chunk any query
    of the step can see: 0 with full attention, later on a sliding-window layer
    (attention.first_visible_chunk). That visibility rule comes first; a selection chooses among
    the visible chunks."""
    name = "all"
    takes_budget = False  # True: --select NAME needs --select-budget TOKENS
    summarizes = False    # True: wants every sealed chunk's keys (summarize)
    reads_all = False     # True: attend every visible chunk, then merge the ones `choose` keeps

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:  # a class that names itself is a --select choice
            SELECTIONS[cls.name] = cls

    @classmethod
    def build(cls, budget, chunk_size, window, dense, n_layers):
        """The selection for a run (make_selection's arguments): Exact needs none of them."""
        return cls()

    def visits(self, layer, first, n_sealed, T, q=None):
        """The sealed chunks `layer` attends in this decode step of T queries (prefill steps read
        every visible chunk, whatever the selection), ascending: attention's order. Asked first
        at the start of the step without q; None then means "ask again with this layer's queries
        q [B, G, R*T, D], scaled", and the cache does when the layer runs."""
        return list(range(first, n_sealed))

    def summarize(self, layer, j, keys):
        """Chunk j of `layer` has sealed with these keys [B, G, C, D]: keep what `visits` will
        need of it (nothing here). The keys are a view of a buffer the store reuses once the
        chunk leaves the device: keep a copy (or a reduction), never the view."""


SELECTIONS["all"] = Exact  # the subclasses register themselves


class Sparse(Exact):
    """What the sparse selections share. A decode step (one query) of a layer past the first
    `dense` reads the first visible chunk (an attention sink, StreamingLLM), the `window` most
    recent chunks (on the device anyway), and the chunks `pick` chooses, budget // C chunks in
    all with the sink counted and the window not. Prefill steps and the first `dense` layers stay
    exact, as in Quest. When the budget covers every visible chunk the visits are Exact's, so the
    output is --select all's bit for bit."""
    takes_budget = True
    needs_queries = False  # True: `pick` scores chunks against the layer's queries

    def __init__(self, budget, chunk_size, window, dense, n_layers=None):
        self.budget_chunks = budget // chunk_size  # make_selection refuses less than one chunk
        self.window = window
        self.dense = dense
        self.n_layers = n_layers

    @classmethod
    def build(cls, budget, chunk_size, window, dense, n_layers):
        return cls(budget, chunk_size, window, dense, n_layers)

    def always(self, layer, first, n_sealed, T):
        """The chunks this decode step reads in any case, or None when it is exact."""
        if layer < self.dense:
            return None
        recent = set(range(max(first, n_sealed - self.window), n_sealed))
        if n_sealed - first - len(recent) <= self.budget_chunks:  # the budget covers the rest
            return None
        return recent | {first}

    def visits(self, layer, first, n_sealed, T, q=None):
        keep = self.always(layer, first, n_sealed, T)
        if keep is None:
            return list(range(first, n_sealed))
        if q is None and self.needs_queries:
            return None
        candidates = [j for j in range(first, n_sealed) if j not in keep]
        k = self.budget_chunks - 1
        got = self.pick(layer, candidates, k, q)
        try:
            picked = set(got)
        except TypeError:  # None, a number: not chunks
            picked = None
        if picked is None or len(picked) > k or not picked <= set(candidates):  # said here
            said = sorted(picked) if picked is not None else repr(got)
            raise PolicyError(f"{type(self).__name__}.pick returned {said}: give a set or list of "
                             f"at most {k} of the candidates {candidates}")
        return sorted(keep | picked)

    def pick(self, layer, candidates, k, q):
        """At most k of the candidate chunks (a list of chunk indices) to read besides the sink and
        the window: any iterable of them (a set, a list)."""
        return set()


class Sink(Sparse):
    """StreamingLLM's baseline: the first chunk and the window, nothing else."""
    name = "sink"
    takes_budget = False

    @classmethod
    def build(cls, budget, chunk_size, window, dense, n_layers):
        return cls(chunk_size, chunk_size, window, dense, n_layers)  # a budget of the sink alone


class Quest(Sparse):
    """The chunks whose key digests allow the highest scores for the step's queries, up to
    --select-budget: Quest (Tang et al., 2024), a chunk at a time. When a chunk seals, its keys
    are summarised per kv head and channel by their minimum and maximum: a digest of 2 x G x D
    values, 1/C of the keys, kept on the device. For a query q no key of the chunk has q.k above
    sum over d of max(q_d min_d, q_d max_d). A chunk scores that bound minus the best chunk's bound
    for the same query head (an upper bound on the log of its weight relative to the best chunk),
    maximised over the heads: a chunk moves as a unit, so one head that needs it is enough."""
    name = "quest"
    needs_queries = True
    summarizes = True

    def __init__(self, budget, chunk_size, window, dense, n_layers):
        super().__init__(budget, chunk_size, window, dense, n_layers)
        self.digests = [[] for _ in range(n_layers)]  # per layer and sealed chunk: [2, B, G, D]

    def summarize(self, layer, j, keys):
        digest = torch.stack((keys.amin(dim=2), keys.amax(dim=2))).float()  # [2, B, G, D]
        chunks = self.digests[layer]
        if j < len(chunks):  # summarised again (a restored chunk): the same bytes, the same digest
            chunks[j] = digest
        else:
            chunks.append(digest)

    def pick(self, layer, candidates, k, q):
        digests = torch.stack([self.digests[layer][j] for j in candidates])  # [n, 2, B, G, D]
        qf = q.float().unsqueeze(0)                       # [1, B, G, R, D]: one query, R heads
        low = qf * digests[:, 0].unsqueeze(3)             # [n, B, G, R, D]
        high = qf * digests[:, 1].unsqueeze(3)            # [n, B, G, R, D]
        bound = torch.maximum(low, high).sum(dim=-1)      # [n, B, G, R]: no q.k is above it
        relative = bound - bound.amax(dim=0, keepdim=True)
        score = relative.flatten(1).amax(dim=1)           # [n]
        return top_k(candidates, score, k)


class Oracle(Sparse):
    """The true top chunks by attention mass, the ceiling for evaluation: it reads everything. It
    attends every visible chunk, then merges only the k whose true attention mass (the softmax of
    the chunks' log-sum-exps, averaged over query heads) is largest, so it saves no bytes: it says
    how well a selection of k chunks could do."""
    name = "oracle"
    reads_all = True

    def visits(self, layer, first, n_sealed, T, q=None):
        return list(range(first, n_sealed))  # everything: choose() keeps some after attending

    def choose(self, layer, first, n_sealed, T, lse):
        """lse [n, B, G, R*T] of the visible chunks -> the chunks to merge, ascending."""
        keep = self.always(layer, first, n_sealed, T)
        if keep is None:
            return list(range(first, n_sealed))
        mass = torch.softmax(lse.float(), dim=0).flatten(1).mean(dim=1)  # [n]
        candidates = [j for j in range(first, n_sealed) if j not in keep]
        score = mass[[j - first for j in candidates]]
        return sorted(keep | top_k(candidates, score, self.budget_chunks - 1))


def top_k(candidates, score, k):
    """The k candidates of highest score; a tie goes to the earlier chunk (a stable sort)."""
    order = torch.sort(score.cpu(), descending=True, stable=True).indices[:k]
    return {candidates[i] for i in order.tolist()}


def default_dense(n_layers):
    """Quest leaves 2 of a model's 32 layers exact; the same share of this model, at least one."""
    return max(1, round(n_layers / 16))


def make_selection(name, budget, chunk_size, window, n_layers, dense=None):
    """The selection --select names (SELECTIONS). budget: tokens a decode step reads besides the
    window (None when the selection takes none); dense: layers left exact (default:
    default_dense)."""
    if name not in SELECTIONS:
        raise ValueError(f"--select must be one of {', '.join(SELECTIONS)}, not {name!r}")
    cls = SELECTIONS[name]
    if dense is None:
        dense = default_dense(n_layers)
    if cls.takes_budget and (budget is None or budget < chunk_size):
        raise ValueError(f"--select {name} needs --select-budget of at least one chunk "
                         f"({chunk_size} tokens), got {budget}")
    return cls.build(budget, chunk_size, window, dense, n_layers)


def budgeted():
    """The selections that take --select-budget, by name."""
    return [name for name, cls in SELECTIONS.items() if cls.takes_budget]


def summary(cls):
    """What a selection does, for --help: the first sentence of its docstring (or its name)."""
    doc = " ".join((cls.__doc__ or cls.name).split())
    return doc.split(". ")[0].rstrip(".")


# -----------------------------------------------------------------------------
# eviction and placement: which chunk leaves the device, and where it goes

class Placement:
    """The device window holds the `window` most recent sealed chunks of each layer; the chunk
    that falls out goes to the host pool while it has a free slot, then to disk."""

    name = "default"

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:  # a class that names itself is a --placement choice
            PLACEMENTS[cls.name] = cls

    def evict(self, layer, on_device, window):
        """on_device: the layer's sealed chunks on the device, ascending, the one just sealed
        last. The chunk to move off the device now, or None."""
        if len(on_device) <= window:
            return None
        return on_device[0]

    def place(self, layer, j, host_free, has_disk):
        """'host' or 'disk' for chunk j of `layer`, or None when neither can take it (the store
        refuses a tier it does not have: 'host' when the pool is full, 'disk' without one)."""
        if host_free:
            return "host"
        if has_disk:
            return "disk"
        return None


PLACEMENTS["default"] = Placement  # subclasses register themselves


# -----------------------------------------------------------------------------
# planning: how many chunks sit in each tier

@dataclass(frozen=True)
class TierPlan:
    """The chunks of a task of `positions` positions, all layers together, once the last position
    is written. The last chunk of a layer stays open (never sealed), so it never leaves the
    device."""
    per_layer: int     # chunks per layer, the open one included
    device: int        # sealed chunks in the device windows
    host: int          # in the host pool
    disk: int          # on disk
    unplaced: int = 0  # offloaded chunks no tier can take (--offload cpu, too small a budget)

    @property
    def offloaded(self):
        return self.host + self.disk + self.unplaced


def plan_tiers(positions, chunk_size, window, n_layers, mode="disk", host_slots=None):
    """Where the chunks of `positions` positions end up with --offload `mode` and --window
    `window`, under the default placement. host_slots: the host pool in chunks (None: all the
    offloaded chunks with --offload cpu, none with --offload disk)."""
    n = math.ceil(positions / chunk_size)
    sealed = max(0, n - 1)
    if mode == "none":
        return TierPlan(n, n_layers * sealed, 0, 0)
    offloaded = n_layers * max(0, sealed - window)
    if host_slots is None:
        host_slots = offloaded if mode == "cpu" else 0
    host = min(offloaded, host_slots)
    disk = offloaded - host if mode == "disk" else 0
    unplaced = offloaded - host - disk
    return TierPlan(n, n_layers * sealed - offloaded, host, disk, unplaced)


def host_budget_refusal(plan, budget_gib, slot_bytes, note=""):
    """Why --cpu-budget cannot hold the chunks `plan` offloads to the host (--offload cpu), or None:
    the store says it when it is made, the command line before the model loads."""
    if not plan.unplaced:
        return None
    return (f"--cpu-budget {budget_gib:.3g} GiB{note} holds {plan.host} of the {plan.offloaded} "
            f"chunks this task offloads ({plan.offloaded * slot_bytes / 2**30:.2f} GiB); raise it, "
            "widen --window, or use --offload disk")
