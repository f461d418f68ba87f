r"""
Batch mode: many prompts from a JSONL file, --batch-size of them in flight at once, each task with
its own cache and directory, their decode steps run as one forward pass (batcher.py).

    python generate.py --ckpt DIR --prompts tasks.jsonl --output results.jsonl \
        --batch-size 4 --offload disk

Built to be killed: a result line is written whole (one write, then fsync) or not at all; a rerun of
the same command skips ids already in the output and resumes unfinished tasks from their disk tier
(see taskdir.py). A disk that fills up sends a task to the host tier (if --fallback-cpu-budget
allows) or to a shorter context (if --fallback-context allows); otherwise that task fails with one
line. One failed task never stops the others.
"""
import dataclasses
import fcntl
import json
import math
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from disk import DISK_FULL, DiskError
from generate import MIN_TEMPERATURE, SEED_LIMIT
from pools import OffloadError
from private import PrivateError, open_private, what_is_wrong
from runs import launch
from runs.cores import one_thread_here
from runs.taskdir import TaskDir, TaskDirError, safe_task_name
from runs.tp import Layout
from tokenizer import messages_problem

TASK_FIELDS = {"id": (str, int), "prompt": (str,), "max_new_tokens": (int,),
               "temperature": (int, float), "seed": (int,)}


class OutputError(Exception):
    """The results file cannot take a result: the task failed, its disk tier kept (not an OSError,
    which with_fallbacks would take for the disk tier's own failure)."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C reached a batch: each task in flight stops at its next step, keeping its directory
    (for resume) as any failed task does."""


class NotANumber:
    """NaN or Infinity in a task line, kept in its place so that the problem can name the field:
    JSON has no such numbers, and no field takes them."""

    def __init__(self, name):
        self.name = name


def not_a_number(value):
    """(where, name) of the first NaN or Infinity in a parsed line (where: "temperature",
    "messages.0.content"), or None. A stack, not recursion: the line may nest as deep as json
    allows."""
    stack = [("", value)]
    while stack:
        path, x = stack.pop()
        if isinstance(x, NotANumber):
            return path, x.name
        if isinstance(x, dict):
            items = list(x.items())
        elif isinstance(x, list):
            items = list(enumerate(x))
        else:
            continue
        stack.extend((f"{path}.{k}" if path else str(k), v) for k, v in reversed(items))
    return None


def read_tasks(path):
    """(tasks, errors, notes): each task a dict with at least id and prompt; each error one line
    naming the input line. A bad line (not UTF-8, not JSON, nested too deeply, a field of the wrong
    type or range, an empty prompt) is skipped, and the batch goes on. A field that is not a task's
    (a typo of one, or the user's own) is said in a note, and the task runs without it."""
    tasks = []
    errors = []
    notes = []
    seen = set()
    try:
        f = open(path, "rb")
    except OSError as e:
        raise ValueError(f"--prompts {path}: cannot be read ({e.strerror})") from None
    with f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            task, problem = parse_line(raw)
            problem = problem or task_problem(task)
            if problem:
                errors.append(f"{path} line {n}: {problem}; skipped")
            elif str(task["id"]) in seen:
                errors.append(f"{path} line {n}: duplicate id {task['id']!r}; skipped "
                              "(the first one runs)")
            else:
                seen.add(str(task["id"]))
                tasks.append({**task, "id": str(task["id"])})
                other = sorted(set(task) - set(TASK_FIELDS) - {"messages"})
                if other:
                    notes.append(f"{path} line {n}: {', '.join(map(repr, other))} not a task's "
                                 f"field ({', '.join([*TASK_FIELDS, 'messages'])}); not used")
    return tasks, errors, notes


def holds_lines(path):
    """Whether the --prompts file has a line that is not blank (True when it cannot be read:
    read_tasks says why)."""
    try:
        with open(path, "rb") as f:
            return any(raw.strip() for raw in f)
    except OSError:
        return True


def parse_line(raw):
    """One line of bytes -> (the JSON value, None), or (None, why it is not JSON)."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, f"not valid UTF-8 (byte {e.start + 1} of the line)"
    try:
        value = json.loads(line, parse_constant=NotANumber)
    except json.JSONDecodeError as e:
        return None, f"not valid JSON ({e.msg})"
    except ValueError:  # json refuses an integer of thousands of digits
        return None, "not valid JSON (a number of thousands of digits)"
    except RecursionError:
        return None, "not valid JSON (nested too deeply)"
    found = not_a_number(value)
    if found:
        where, name = found
        field = f"field '{where}' is" if where else "the line is"
        return None, f"{field} {name}, which is no number JSON or a task may hold; give a number"
    return value, None


def task_problem(task):
    if not isinstance(task, dict):
        return "not a JSON object"
    if not encodable(task):
        return "a string holds a lone surrogate (\\ud800 to \\udfff alone), which is no text"
    if "id" not in task:
        return "field 'id' is missing"
    if ("prompt" in task) == ("messages" in task):
        return "give one of 'prompt' (text) or 'messages' (a chat)"
    if task.get("prompt") == "":
        return "field 'prompt' is empty; give some text"
    if "messages" in task and messages_problem(task["messages"]):
        return messages_problem(task["messages"])
    for key, types in TASK_FIELDS.items():
        if key in task and (not isinstance(task[key], types) or isinstance(task[key], bool)):
            return f"field '{key}' must be {' or '.join(t.__name__ for t in types)}"
    temperature = task.get("temperature", 0)
    if (task.get("max_new_tokens", 1) < 1 or not finite(temperature)
            or not (temperature == 0 or temperature >= MIN_TEMPERATURE)):
        return "max_new_tokens must be >= 1 and temperature 0 (greedy) or a number >= 1e-6"
    if abs(task.get("seed", 0)) >= SEED_LIMIT:
        return f"field 'seed' must be between -{SEED_LIMIT} and {SEED_LIMIT}"
    return None


def finite(x):
    try:
        return math.isfinite(x)
    except OverflowError:  # an integer too large for a float
        return False


def encodable(obj):
    """Every string in obj (keys too) can be written as UTF-8: JSON's "\\ud800" escapes can make
    one that cannot, which would fail the task later, when its result is written."""
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                return False
        elif isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return True


class Results:
    """The output JSONL: append-only, one os.write per line followed by fsync,
    so a line is whole or absent."""

    def __init__(self, path, log):
        self.path = path
        self.lock = threading.Lock()
        try:  # created 0600, never through a link at its name (private.open_private)
            self.fd = open_private(path, os.O_RDWR | os.O_CREAT | os.O_APPEND)
        except (OSError, PrivateError) as e:
            why = what_is_wrong(e)
            raise ValueError(f"--output {path}: cannot be opened ({why}); choose another "
                             "file") from None
        self.done = set()
        # other processes (replicas under torchrun) may append to the same file
        with self.locked():
            # read through our own descriptor, never by name again
            with open(self.fd, "rb", closefd=False) as f:
                f.seek(0)
                data = f.read()
            # a crash of another writer can leave this: a whole result is ended, a torn one goes
            if data and not data.endswith(b"\n"):
                keep = data.rfind(b"\n") + 1
                if self.read_ids(data[keep:]) == 0:
                    os.write(self.fd, b"\n")
                    log(f"{path}: its last result lacked its line end; added")
                    data += b"\n"
                else:
                    os.ftruncate(self.fd, keep)
                    log(f"{path}: removed a partial last line ({len(data) - keep} bytes)")
                    data = data[:keep]
        self.seen = len(data)  # the bytes read: what other processes append is read on
        ignored = self.read_ids(data)
        if ignored and not self.done:
            os.close(self.fd)
            lines = f"{ignored} line" + ("s" if ignored > 1 else "")
            raise ValueError(f"--output {path} holds {lines} and none is a result; give the "
                             "results a file of their own")
        if ignored:
            log(f"{path}: {ignored} lines that are not results were ignored")

    def read_ids(self, data):
        """The ids of the result lines in data join self.done; returns how many lines were not
        results."""
        ignored = 0
        for line in data.splitlines():
            try:
                r = json.loads(line)
                if "tokens" not in r:  # a task's line (a --prompts file), not its result
                    raise KeyError("tokens")
                self.done.add(str(r["id"]))
            except (ValueError, KeyError, TypeError):
                ignored += 1
        return ignored

    def refresh(self):
        """Under the lock: the results other processes appended since this one last read."""
        end = os.fstat(self.fd).st_size
        if end > self.seen:
            self.read_ids(os.pread(self.fd, end - self.seen, self.seen))
            self.seen = end

    def has(self, task_id):
        with self.locked():
            self.refresh()
            return str(task_id) in self.done

    @contextmanager
    def locked(self):
        """This thread alone, and this process alone of those sharing the file (an flock on it)."""
        with self.lock:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self.fd, fcntl.LOCK_UN)

    def append(self, result):
        """One result line, whole and synced, or none (a line another process appended for the
        same task is kept instead). OutputError naming the file when it cannot be written."""
        line = (json.dumps(result, ensure_ascii=False) + "\n").encode()
        with self.locked():  # whole lines, never interleaved with another writer's
            self.refresh()
            if str(result["id"]) in self.done:
                return
            start = self.seen
            try:
                self.write(line)
            except OSError as e:  # a full disk: no part of the line stays
                try:
                    os.ftruncate(self.fd, start)
                except OSError:
                    pass  # a torn last line is dropped by the next run (__init__)
                raise OutputError(f"--output {self.path}: cannot append the result "
                                  f"({e.strerror}); free space there and run the same command "
                                  "again") from None
            self.seen = start + len(line)
            self.done.add(str(result["id"]))

    def write(self, line):
        view = memoryview(line)
        while view:
            n = os.write(self.fd, view)
            view = view[n:]
        os.fsync(self.fd)

    def close(self):
        os.close(self.fd)


def pause(stop):
    """Half a second, or less when stop (Ctrl-C's Event) is set: whether it is."""
    if stop is None:
        time.sleep(0.5)
        return False
    return stop.wait(0.5)


def remove_leftover(offload_dir, task_id, output, log):
    """Remove the directory of a task whose result is in `output` already: a run killed between
    writing the result and removing the directory left it (GBs of disk tier), and no rerun runs
    that task again. One another process holds is left to it."""
    if not os.path.isdir(os.path.join(offload_dir, safe_task_name(task_id))):
        return
    try:
        taskdir = TaskDir(offload_dir, task_id)
    except TaskDirError:
        return
    taskdir.close(remove=True)
    log(f"task {task_id}: its result is in {output}; removed its leftover {taskdir.path}")


def run_batch(args, cfg, monitor, run_one, layout=None, batcher=None, stop=None):
    """Run every task not yet in the output; returns the exit code (0 only if every task
    succeeded). Under torchrun (layout) each replica runs its share of the tasks (launch.my_tasks)
    and its leader appends their results. stop: an Event set on Ctrl-C, after which run_one's steps
    raise Interrupted."""
    layout = layout or Layout.single()
    log = monitor.log
    started = time.perf_counter()
    if layout.tp > 1 and args.batch_size > 1:
        raise ValueError("--batch-size above 1 is not combined with --tp above 1 (the ranks of a "
                         "replica step together); run more replicas instead: a smaller --tp")
    tasks, errors, notes = read_tasks(args.prompts)
    # every replica reads the whole file: the first one alone reports (and counts) its bad lines
    if layout.replica:
        errors = notes = []
    for e in errors + notes:
        log(e)
    results = Results(args.output, log)
    todo = [t for t in tasks if t["id"] not in results.done]
    if len(todo) < len(tasks):
        log(f"{len(tasks) - len(todo)} of {len(tasks)} tasks already in {args.output}; "
            "skipping them")
    if layout.tp == 1:  # a result written, its task killed before its directory went
        for t in tasks:
            if t["id"] in results.done:
                remove_leftover(args.offload_dir, t["id"], args.output, log)
    # the ranks of a replica run the same list
    todo = launch.from_leader(launch.my_tasks(todo, layout), layout)
    if layout.n_replicas > 1:
        log(f"group {layout.replica} of {layout.n_replicas}: {len(todo)} tasks")

    # --cpu-budget is the batch's: the tasks in flight hold an equal share each, never more
    in_flight = min(args.batch_size, len(todo))
    if cfg.cpu_budget_gib is not None and in_flight > 1:
        note = f" (this task's share: {in_flight} tasks in flight; or lower --batch-size)"
        cfg = dataclasses.replace(cfg, cpu_budget_gib=cfg.cpu_budget_gib / in_flight,
                                  budget_note=note)

    deferred = []  # tasks another process was running: tried again once the others are done

    def one(task, last_try=False):
        said = False
        try:
            while True:
                if layout.tp == 1 and results.has(task["id"]):  # a second process on --output
                    log(f"task {task['id']}: already in {args.output} (another process ran it); "
                        "skipped")
                    return
                # the result is in the file before the task's disk tier goes (run_task's deliver)
                deliver = results.append if layout.is_leader else None
                try:
                    result = with_fallbacks(task, args, cfg, run_one, log, deliver)
                    break
                except TaskDirError as e:  # another process runs this task now (another job)
                    if e.holder is None or layout.tp > 1:
                        raise
                    if not last_try:
                        log(f"task {task['id']}: process {e.holder} runs it now (another job on "
                            "this --offload-dir); tried again after the other tasks")
                        deferred.append(task)
                        return
                    if not said:  # the other tasks are done: wait for its result or its end
                        log(f"task {task['id']}: process {e.holder} still runs it; waiting for "
                            "it to finish")
                        said = True
                    if pause(stop):
                        return  # Ctrl-C: the summary says what is left
            stats = {**result["stats"], "prompt_tokens": result["prompt_tokens"]}
            monitor.task_finished(task["id"], stats)
        except Exception as e:
            # one failed task never stops the others (but a replica's ranks must agree: stop)
            if layout.tp > 1:
                raise
            monitor.task_finished(task["id"], error=one_line(e))
            log(f"task {task['id']}: FAILED: {one_line(e)}")

    # --batch-size tasks in flight, a thread each; their forward passes meet in the batcher, which
    # runs them on its own thread (and the tasks' threads keep to one: cores.one_thread_here)
    init = one_thread_here if batcher is not None else None
    try:
        with ThreadPoolExecutor(args.batch_size, thread_name_prefix="task",
                                initializer=init) as pool:
            futures = [pool.submit(one, task) for task in todo]
            try:
                for future in futures:
                    future.result()  # a failure that stops the replica (tensor parallel) is here
                # then what another job was running: written by it by now, or this job's again
                futures = [pool.submit(one, task, True) for task in deferred]
                for future in futures:
                    future.result()
            except KeyboardInterrupt:
                # the tasks not begun never start; those in flight stop at their next step
                for future in futures:
                    future.cancel()
                if stop is not None:
                    stop.set()
                raise
    finally:
        results.close()
    if batcher is not None:  # how many decode steps the tasks in flight shared
        monitor.totals["batched_steps"] = batcher.steps
        monitor.totals["batched_rows"] = batcher.rows
    for e in errors:
        monitor.totals["failed"].append(("input", e))
    monitor.totals["wall_s"] = time.perf_counter() - started
    if layout.n_replicas > 1:
        prefix = f"group {layout.replica}: "
        log(prefix + monitor.summary(failures=False).replace("\n", "\n" + prefix))
    totals, _ = launch.batch_totals(monitor.totals, layout)  # every replica's share meets on rank 0
    if layout.rank == 0:
        print(monitor.summary(totals), file=sys.stderr, flush=True)
    return 1 if monitor.totals["failed"] else 0


def with_fallbacks(task, args, cfg, run_one, log, deliver=None):
    """Run a task; if its disk tier cannot be written, retry it on the host tier or on a shorter
    context. Every tier gives bit-identical output, so the host fallback changes nothing but where
    the bytes live. deliver(result): as run_task's."""
    try:
        return run_one(task, cfg, deliver=deliver)
    except (DiskError, OSError) as e:
        if cfg.mode != "disk" or e.errno not in DISK_FULL:
            raise
        where = os.path.join(cfg.offload_dir, safe_task_name(task["id"]))
        cause = str(e.strerror or e)
        if where not in str(e.strerror):
            cause += f" in {where}"
    if args.fallback_cpu_budget:
        log(f"task {task['id']}: the disk tier failed ({cause}); falling back to host memory "
            f"(--fallback-cpu-budget {args.fallback_cpu_budget} GiB)")
        host_cfg = dataclasses.replace(cfg, mode="cpu", compress="none",
                                       cpu_budget_gib=args.fallback_cpu_budget)
        try:
            result = run_one(task, host_cfg, deliver=deliver)
            discard_task_dir(cfg.offload_dir, task["id"])
            return result
        except OffloadError as e:
            log(f"task {task['id']}: host fallback impossible: {e}")
    if args.fallback_context:
        log(f"task {task['id']}: the disk tier failed ({cause}); continuing on the last "
            f"{args.fallback_context} tokens of the context, on the device")
        device_cfg = dataclasses.replace(cfg, mode="none", compress="none")
        result = run_one(task, device_cfg, context=args.fallback_context, deliver=deliver)
        discard_task_dir(cfg.offload_dir, task["id"])
        return result
    raise OffloadError(f"cannot write the disk tier ({cause}); free space there, or allow a "
                       "fallback with --fallback-cpu-budget GIB or --fallback-context N")


def discard_task_dir(root, task_id):
    """The disk tier's leftovers are useless once the task finished elsewhere:
    remove them (if we can)."""
    try:
        TaskDir(root, task_id).close(remove=True)
    except (TaskDirError, OSError):
        pass


def one_line(e):
    return " ".join(str(e).split()) or type(e).__name__


if __name__ == "__main__":
    sys.exit("run batches through generate.py --prompts TASKS.jsonl --output RESULTS.jsonl")
