"""
One model, shared by the tasks of a batch that run at once (--batch-size N): their decode steps run
as one forward pass, so every weight is read once per step for all of them.

Each task runs in a thread of its own exactly as a lone task runs (task.run_task: its cache, task
directory, resume, fallbacks, statistics, trace), with Batcher.step in generate.forward's place:
    - a decode step waits until every task that is decoding has one waiting; then one
      generate.decode_batch runs them all, and each task gets back its own row of logits;
    - a prefill step (a chunk of a joining task's prompt) runs alone, between two decode steps, so
      the running tasks keep producing tokens while a new one reads its prompt.
Every forward pass, batched or a prefill step, runs on the batcher's one model thread, and the
tasks' threads keep their own parallel operations to one thread (cores.one_thread_here): more
OpenMP teams than cores slow every operation of all of them (measured: 1.5x per decode step).
A task leaves when it stops decoding, finished or failed, and the others stop waiting for it. Row i
of a batched step is the bits decode_one_token gives task i alone (rowwise.py), so a task's output
never depends on which tasks shared its steps. If a batched step fails before any task's step is
committed, each of its tasks runs the step alone: only the task whose tiers failed sees its error,
in its own thread, where batch.py's fallbacks take it over as for a lone task.
"""
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from generate import decode_batch, decode_one_token, forward


class Batcher:
    def __init__(self, model, arena=None):
        self.model = model
        # the arena the tasks' caches share (kvbatch.make_arena): one kernel call a layer attends
        # every task's sealed chunks (kvbatch.BatchedCaches)
        self.arena = arena
        self.cond = threading.Condition()
        self.decoding = set()  # caches of the tasks in their decode phase
        self.waiting = {}      # cache -> token [1, 1]: decode steps waiting for the next batch
        self.results = {}      # cache -> logits [1, V] of its step, or the exception it raised
        self.prefills = 0      # prefill steps waiting for their turn
        self.busy = False      # a forward pass (a batch, or one prefill step) is running
        self.turn = "prefill"  # when both wait, they alternate: neither starves the other
        self.steps = 0         # batched decode steps run, the tokens they gave, the most at once
        self.rows = 0
        self.widest = 0
        self.sizes = set()     # every row count a decode step ran with (verify --batch wants all)
        self.engine = ThreadPoolExecutor(1, thread_name_prefix="model")  # runs every forward pass

    def close(self):
        self.engine.shutdown()

    def step(self, model, cache, tokens, decode=False):
        """generate.forward's signature: this task's step, run when its turn comes."""
        if decode:
            return self._decode(cache, tokens)
        with self.cond:
            self.prefills += 1
            self.cond.wait_for(lambda: not self.busy and (self.turn == "prefill"
                                                          or not self._batch_ready()))
            self.prefills -= 1
            self.busy = True
        try:
            return self.engine.submit(forward, model, cache, tokens).result()
        finally:
            self._done("decode")

    def leave(self, cache):
        """The task of `cache` decodes no more (finished or failed): stop waiting for it."""
        with self.cond:
            self.decoding.discard(cache)
            self.waiting.pop(cache, None)
            self.cond.notify_all()

    def _batch_ready(self):
        return bool(self.waiting) and len(self.waiting) == len(self.decoding)

    def _decode(self, cache, token):
        batch = None
        with self.cond:
            self.decoding.add(cache)
            self.waiting[cache] = token
            self.cond.notify_all()
            while cache not in self.results:
                goes = self.turn == "decode" or not self.prefills
                if not self.busy and self._batch_ready() and goes:
                    batch = self.waiting  # the thread that completes a batch runs it
                    self.waiting = {}
                    self.busy = True
                    break
                self.cond.wait()
        if batch is not None:
            try:
                results = self.engine.submit(self._run, batch).result()
            except BaseException as e:  # never leave the batch's tasks waiting
                results = {c: e for c in batch}
            with self.cond:
                self.results.update(results)
            self._done("prefill")
        with self.cond:
            result = self.results.pop(cache)
        if isinstance(result, BaseException):
            raise result
        return result

    def _run(self, batch):
        """One decode step for every task in `batch`: together, or each alone if that fails."""
        caches = list(batch)
        tokens = torch.cat([batch[c] for c in caches])  # [N, 1]
        try:
            logits, failed = decode_batch(self.model, caches, tokens)
        except Exception:  # no step was committed: run each alone, so the error reaches its task
            return {c: self._alone(c, batch[c]) for c in caches}
        self.steps += 1
        self.rows += len(caches)
        self.widest = max(self.widest, len(caches))
        self.sizes.add(len(caches))
        return {c: failed.get(i, logits[i:i + 1]) for i, c in enumerate(caches)}

    def _alone(self, cache, token):
        try:
            return decode_one_token(self.model, cache, token)
        except Exception as e:
            return e

    def _done(self, next_turn):
        with self.cond:
            self.busy = False
            self.turn = next_turn
            self.cond.notify_all()
