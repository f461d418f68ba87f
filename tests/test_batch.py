"""
Batch tasks that survive failure (issue 4): SIGKILL mid-decode then a rerun with byte-identical
results, concurrent tasks equal to serial ones, a torn results file, a disk that fills up for real
(RLIMIT_FSIZE), resume, corrupt chunks and foreign manifests, hostile ids, two users of one task
directory, owner-only files, the monitor's alerts, the trace and the statistics, and bad input
lines. (Other storage faults are in test_disk_faults.py.)

generate.py runs in a child process where the test needs one (a kill, a file-size limit); elsewhere
generate_cli.main() runs in-process, which is the same code minus ~3 s of importing torch.
"""
import errno
import json
import os
import pydoc_data.topics
import re
import resource
import signal
import subprocess
import sys
import time

import pytest
import torch

from disk import ALIGN, round_up
from model import Transformer
from offload import OffloadConfig, TieredStore
from runs import generate_cli
from runs.monitor import Monitor
from runs.task import run_task
from runs.taskdir import TaskDir, TaskDirError, manifest_check, safe_task_name
from tokenizer import load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# English text every Python carries; the test tokenizer was trained on it
TOPICS = pydoc_data.topics.topics
C = 16  # chunk size of every run here
DISK = ["--offload", "disk", "--chunk-size", str(C), "--window", "1"]
SHORT = {"id": "short", "prompt": TOPICS["pass"][:150], "max_new_tokens": 4}  # ~40 tokens: 3 chunks


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # a tiny model gains nothing from more threads, and on a shared machine OpenMP's barriers make
    # 2 threads ~50x slower than 1; children get OMP_NUM_THREADS=1 for the same reason (and so
    # compute exactly what we compute)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def lm(text_ckpt):
    """(model, tokenizer) in this process, for run_task and for references."""
    return Transformer.from_pretrained(text_ckpt), load_tokenizer(text_ckpt)


def write_tasks(path, tasks):
    path.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    return path


def batch_args(ckpt, tasks, output, offload_dir, *flags):
    return ["--ckpt", ckpt, "--prompts", tasks, "--output", output, "--offload-dir", offload_dir,
            *flags]


def child(argv, **kwargs):
    """generate.py in a child process (not waited for). No .pyc writes: under RLIMIT_FSIZE one could
    raise SIGXFSZ before generate.py gets to ignore it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "generate.py"), *map(str, argv)],
                            env=env, text=True, **kwargs)


def run_child(argv, **kwargs):
    p = child(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, **kwargs)
    _, err = p.communicate(timeout=300)
    return p.returncode, err


def run_main(argv, capsys):
    """generate.py's main() in this process: (exit code, stderr)."""
    capsys.readouterr()
    rc = generate_cli.main([str(a) for a in argv])
    return rc, capsys.readouterr().err


def results(path):
    """[(raw line, parsed dict)] of a RESULTS.jsonl; every line must be whole and parse."""
    data = path.read_text(encoding="utf-8")
    assert data == "" or data.endswith("\n"), f"partial last line in {path}: {data[-80:]!r}"
    return [(line, json.loads(line)) for line in data.splitlines()]


def by_id(path):
    return {r["id"]: r for _, r in results(path)}


def before_stats(line):
    """The raw text of a result line before its "config" and "stats" objects (the run's settings;
    timings, resumed_from): the part a rerun must reproduce byte for byte, whatever tier it used.
    The writer keeps keys in a fixed order with config and stats last."""
    keys = list(json.loads(line))
    assert set(keys) >= {"id", "config", "stats"} and keys[-2:] == ["config", "stats"]
    return line[:line.rindex(', "config": ')]


def slot_bytes(model):
    """The bytes of one chunk [2, B=1, G, C, D] in fp32, as the raw disk tier aligns it."""
    model_args = model.args
    return round_up(2 * model_args.n_kv_heads * C * model_args.head_dim * 4, ALIGN)


# -----------------------------------------------------------------------------
# SIGKILL in the middle of a long task, then the same command again

# ~140 prompt tokens, no early EOS
LONG = {"id": "long", "prompt": TOPICS["await"], "max_new_tokens": 200}


@pytest.fixture(scope="module")
def uninterrupted(text_ckpt, tmp_path_factory):
    """The kill test's batch (a short task, then a long one) run once without interruption: (tasks,
    lines by id)."""
    d = tmp_path_factory.mktemp("uninterrupted")
    tasks = write_tasks(d / "tasks.jsonl", [SHORT, LONG])
    argv = batch_args(text_ckpt, str(tasks), str(d / "results.jsonl"), str(d / "off"), *DISK)
    rc = generate_cli.main(argv)
    assert rc == 0
    lines = {r["id"]: line for line, r in results(d / "results.jsonl")}
    assert list(lines) == ["short", "long"]
    # no EOS: decode runs to the end
    assert len(json.loads(lines["long"])["tokens"]) == LONG["max_new_tokens"]
    return tasks, lines


def read_manifest(path):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def without_stats(result):
    return {k: v for k, v in result.items() if k not in ("stats", "config")}


@pytest.mark.parametrize("compress", ["none", "zstd"])
def test_sigkill_mid_decode_then_rerun_gives_identical_results(text_ckpt, tmp_path, capsys,
                                                               uninterrupted, compress):
    """Kill -9 while the long task decodes; the same command again skips the finished short task,
    resumes the long one from its disk tier, and writes the lines an uninterrupted run writes (stats
    aside). The reference ran with raw chunks; the zstd variant must match it too, as every tier is
    bit-identical. (The rerun runs in-process.)"""
    tasks, reference = uninterrupted
    P = json.loads(reference["long"])["prompt_tokens"]
    output = tmp_path / "results.jsonl"
    offload_dir = tmp_path / "off"
    argv = batch_args(text_ckpt, tasks, output, offload_dir, *DISK, "--compress", compress)

    manifest_path = offload_dir / safe_task_name("long") / "manifest.json"
    with open(tmp_path / "killed.err", "w") as err:
        p = child(argv, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 300
        while True:  # poll the long task's checkpoint until it vouches for decoded tokens
            m = read_manifest(manifest_path)
            if m and len(m["tokens"]) >= P + 10 and len(m["chunks"]) >= 2:
                break
            assert p.poll() is None, (f"generate.py ended (rc {p.returncode}) before the kill: "
                                      f"{err.name}")
            assert time.monotonic() < deadline, "the long task never reached its decode phase"
            time.sleep(0.005)
        os.kill(p.pid, signal.SIGKILL)
    finally:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=60)
    assert p.returncode == -signal.SIGKILL
    killed = results(output)
    assert [r["id"] for _, r in killed] == ["short"], (
        "the kill must land while the long task decodes")
    m = read_manifest(manifest_path)
    assert len(m["tokens"]) < P + LONG["max_new_tokens"]

    rc, err = run_main(argv, capsys)
    assert rc == 0, err
    assert "1 of 2 tasks already in" in err and "1 resumed" in err, err
    lines = results(output)
    assert [r["id"] for _, r in lines] == ["short", "long"], (
        "the finished task ran again or the long one is missing")
    # the short task's line is the one written before the kill, untouched
    assert lines[0][0] == killed[0][0]
    for line, r in lines:
        ref = reference[r["id"]]
        assert before_stats(line) == before_stats(ref), (
            f"task {r['id']}: the result differs from the reference")
        assert without_stats(r) == without_stats(json.loads(ref))
    resumed = lines[1][1]["stats"]["resumed_from"]
    assert resumed > 0 and resumed % C == 0, (
        f"the long task did not resume from its disk tier: {resumed}")


# -----------------------------------------------------------------------------
# several tasks at once, and a results file torn by a crash

# 1 to 4 chunks of prompt, sampled
TASKS = [{"id": f"t{i}", "prompt": TOPICS[topic][:60 + 45 * i], "max_new_tokens": 12,
          "temperature": 0.8, "seed": i}
         for i, topic in enumerate(("pass", "break", "continue", "del"))]


@pytest.fixture(scope="module")
def serial(text_ckpt, tmp_path_factory):
    """TASKS run one at a time on the disk tier: {id: result}."""
    d = tmp_path_factory.mktemp("serial")
    tasks = write_tasks(d / "tasks.jsonl", TASKS)
    argv = batch_args(text_ckpt, tasks, d / "results.jsonl", d / "off", *DISK, "--top-p", "0.9",
                      "--batch-size", 1)
    assert generate_cli.main([str(a) for a in argv]) == 0
    return by_id(d / "results.jsonl")


@pytest.mark.parametrize("flag,n", [("--batch-size", 2), ("--batch-size", 4), ("--concurrency", 3)])
def test_batched_tasks_equal_their_serial_results(text_ckpt, tmp_path, capsys, serial, flag, n):
    """fp32, sampled, prompts of 1 to 4 chunks: tasks that share their decode steps give the
    tokens they give one at a time (--concurrency is the same flag as --batch-size)."""
    tasks = write_tasks(tmp_path / "tasks.jsonl", TASKS)
    argv = batch_args(text_ckpt, tasks, tmp_path / "results.jsonl", tmp_path / "off", *DISK,
                      "--top-p", "0.9", flag, n)
    rc, err = run_main(argv, capsys)
    assert rc == 0, err
    got = by_id(tmp_path / "results.jsonl")
    assert sorted(got) == sorted(serial)
    for i, r in got.items():
        assert r["tokens"] == serial[i]["tokens"], f"task {i} differs at {flag} {n}"
        assert r["stats"]["chunks"]["disk"] > 0 or r["prompt_tokens"] + 12 <= 2 * C, r["stats"]
    # the tasks did share their decode steps: fewer steps than the tokens they gave. How many are
    # shared depends on when each task's thread joins (a joining task's prefill runs between the
    # others' steps, which do not wait for it): 19 to 36 steps for 44 tokens have been seen.
    shared = re.search(r"batched: (\d+) decode steps for (\d+) tokens", err)
    assert shared and int(shared.group(1)) < int(shared.group(2)), err


def test_torn_last_line_is_repaired(text_ckpt, tmp_path, capsys, serial):
    tasks = write_tasks(tmp_path / "tasks.jsonl", TASKS[:2])
    output = tmp_path / "results.jsonl"
    whole = json.dumps(serial["t0"]) + "\n"
    output.write_text(whole + '{"id": "t1", "prompt_ids": [1, 2')  # a writer died mid-line
    argv = batch_args(text_ckpt, tasks, output, tmp_path / "off", *DISK, "--top-p", "0.9")
    rc, err = run_main(argv, capsys)
    assert rc == 0, err
    assert "removed a partial last line" in err and "1 of 2 tasks already in" in err, err
    lines = results(output)  # every line whole and parseable
    assert lines[0][0] + "\n" == whole and [r["id"] for _, r in lines] == ["t0", "t1"]
    assert lines[1][1]["tokens"] == serial["t1"]["tokens"]


def test_a_results_file_that_cannot_take_a_result_keeps_the_task_to_resume(text_ckpt, tmp_path,
                                                                            capsys, serial,
                                                                            monkeypatch):
    """--output on a full disk: the task fails naming the file, no part of its line stays, and its
    disk tier stays (it went before the line was written); the same command again resumes it and
    writes the result the task gives."""
    from runs.batch import Results
    tasks = write_tasks(tmp_path / "tasks.jsonl", TASKS[2:3])
    output = tmp_path / "results.jsonl"
    argv = batch_args(text_ckpt, tasks, output, tmp_path / "off", *DISK, "--top-p", "0.9")
    write = Results.write

    def full(self, line):  # half the line lands, then the disk is full
        os.write(self.fd, line[:len(line) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(Results, "write", full)
    rc, err = run_main(argv, capsys)
    assert rc == 1 and f"--output {output}: cannot append the result (No space left" in err, err
    assert output.read_bytes() == b""
    assert (tmp_path / "off" / safe_task_name("t2") / "manifest.json").is_file()
    monkeypatch.setattr(Results, "write", write)
    rc, err = run_main(argv, capsys)
    assert rc == 0 and "1 resumed" in err, err
    (_, r), = results(output)
    assert r["tokens"] == serial["t2"]["tokens"] and r["stats"]["resumed_from"] > 0


@pytest.mark.parametrize("ends", ["meanwhile", "at_the_end"])
def test_a_task_another_job_runs_is_tried_again_not_failed(text_ckpt, tmp_path, capsys,
                                                          monkeypatch, ends):
    """Two jobs on one --output and --offload-dir: a task whose directory the other job holds is
    tried again after the other tasks, skipped where that job's result is in the file by then
    (meanwhile), and waited for where that job still runs it (at_the_end: it ends a second into
    the last try). It was counted FAILED, and the job exited 1 though every task finished."""
    import threading

    from runs import batch
    tasks = write_tasks(tmp_path / "tasks.jsonl", [SHORT, TASKS[0]])
    output = tmp_path / "results.jsonl"
    other = TaskDir(str(tmp_path / "off"), "short")  # the other job, running "short"
    with_fallbacks = batch.with_fallbacks
    tries = []

    def finish():  # the other job: its result, then its directory goes
        with open(output, "a") as f:
            f.write(json.dumps({"id": "short", "tokens": [1], "text": ""}) + "\n")
        other.close(remove=True)

    def other_job(task, *args):
        if ends == "meanwhile" and task["id"] == "t0":  # it finishes while this job runs "t0"
            finish()
        if task["id"] == "short":
            tries.append(1)
            if ends == "at_the_end" and len(tries) == 2:  # the last try: it ends soon
                threading.Timer(1.0, finish).start()
        return with_fallbacks(task, *args)
    monkeypatch.setattr(batch, "with_fallbacks", other_job)
    rc, err = run_main(batch_args(text_ckpt, tasks, output, tmp_path / "off", *DISK,
                                  "--batch-size", 1), capsys)
    assert rc == 0 and "FAILED" not in err, err
    assert f"task short: process {os.getpid()} runs it now" in err, err
    if ends == "at_the_end":
        assert f"task short: process {os.getpid()} still runs it; waiting for it" in err, err
        assert len(tries) >= 3, tries
    assert "task short: already in" in err and "skipped" in err, err
    assert sorted(r["id"] for _, r in results(output)) == ["short", "t0"]


def test_a_finished_tasks_leftover_directory_is_removed(text_ckpt, tmp_path, capsys):
    """Killed after a task's result was written but before its directory went: the rerun skips
    the task and removes the directory (it stayed for good, a disk tier's worth)."""
    tasks = write_tasks(tmp_path / "tasks.jsonl", [SHORT])
    output = tmp_path / "results.jsonl"
    output.write_text(json.dumps({"id": "short", "tokens": [1], "text": ""}) + "\n")
    left = TaskDir(str(tmp_path / "off"), "short")
    with open(os.path.join(left.path, "layer0.kv"), "wb") as f:
        f.write(b"\0" * 4096)
    left.close(remove=False)
    rc, err = run_main(batch_args(text_ckpt, tasks, output, tmp_path / "off", *DISK), capsys)
    assert rc == 0 and "task short: its result is in" in err and "removed its leftover" in err, err
    assert not os.path.exists(left.path) and os.listdir(tmp_path / "off") == []


def test_two_writers_of_one_results_file_write_a_task_once(tmp_path):
    """Two jobs on one --output (two processes, as two Results): what one appended, the other
    sees before it starts the task and before it appends its own line."""
    from runs.batch import Results
    a, b = (Results(str(tmp_path / "r.jsonl"), print) for _ in range(2))
    result = {"id": "t0", "tokens": [1, 2], "text": ""}
    assert not b.has("t0")
    a.append(result)
    assert b.has("t0")
    b.append(result)
    b.append({**result, "id": "t1"})
    assert [r["id"] for _, r in results(tmp_path / "r.jsonl")] == ["t0", "t1"]


# -----------------------------------------------------------------------------
# a disk that fills up: RLIMIT_FSIZE in the child, so the disk tier's writes fail with EFBIG

LIMIT = 40 * 1024  # bytes per file: the short task's disk tier fits, the long task's does not
FULL_LONG = {"id": "long", "prompt": TOPICS["else"], "max_new_tokens": 16}  # ~340 prompt tokens


def limited():
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))


@pytest.fixture
def full_disk(lm, tmp_path, text_ckpt):
    """(argv, output, offload dir, long prompt ids) of a batch [short, long] on the disk tier, where
    under LIMIT the short task's disk tier fits and the long task's does not."""
    model, tok = lm
    per_file = {}  # the raw tier reserves n_chunks * slot_bytes per layer file
    for t in (SHORT, FULL_LONG):
        n_chunks = -(-(len(tok.encode(t["prompt"])) + t["max_new_tokens"]) // C)
        per_file[t["id"]] = n_chunks * slot_bytes(model)
    # // 2: zstd's blobs overflow it too
    assert per_file["short"] < LIMIT < per_file["long"] // 2, per_file
    tasks = write_tasks(tmp_path / "tasks.jsonl", [SHORT, FULL_LONG])
    output = tmp_path / "results.jsonl"
    offload_dir = tmp_path / "off"
    argv = batch_args(text_ckpt, tasks, output, offload_dir, *DISK)
    return argv, output, offload_dir, tok.encode(FULL_LONG["prompt"])


def test_disk_full_falls_back_to_host_memory(full_disk, capsys):
    argv, output, offload_dir, _ = full_disk
    rc, err = run_child(argv + ["--fallback-cpu-budget", "1"], preexec_fn=limited)
    assert rc == 0, err
    assert "task long: the disk tier failed" in err and "falling back to host memory" in err, err
    got = by_id(output)
    chunks = got["long"]["stats"]["chunks"]
    assert chunks["host"] > 0 and chunks["disk"] == 0
    plain = output.with_name("plain.jsonl")
    rc, _ = run_main(argv[:4] + ["--output", plain, "--offload", "none", "--chunk-size", C], capsys)
    assert rc == 0
    assert got["long"]["tokens"] == by_id(plain)["long"]["tokens"]
    # the useless disk tier is cleaned away
    assert not (offload_dir / safe_task_name("long")).exists()


def test_disk_full_without_fallback_fails_that_task_alone(full_disk):
    argv, output, offload_dir, _ = full_disk
    rc, err = run_child(argv, preexec_fn=limited)
    assert rc == 1, err  # a failed task, not a crash (2 would be bad usage, a signal negative)
    assert "Traceback" not in err, err
    failed = [line for line in err.splitlines() if line.startswith("task long: FAILED")]
    assert len(failed) == 1, err
    assert str(offload_dir / safe_task_name("long")) in failed[0], failed
    assert os.strerror(errno.EFBIG) in failed[0], failed
    # whole, parseable lines only, and the other task
    assert [r["id"] for _, r in results(output)] == ["short"]
    # the tier failed as it was reserved: nothing in it was vouched for, and its files (which
    # filled the disk for the next task) are gone
    assert not (offload_dir / safe_task_name("long")).exists()


@pytest.mark.parametrize("compress", ["none", "zstd"])
def test_a_single_prompt_on_a_full_disk_names_its_tier(text_ckpt, tmp_path, compress):
    """One prompt whose disk tier fills (as it is reserved, or mid-prefill with zstd): one line
    naming the tier and what to do, no traceback."""
    offload_dir = tmp_path / "off"
    argv = ["--ckpt", text_ckpt, "--prompt", FULL_LONG["prompt"], "--max-new-tokens", 4,
            "--offload-dir", offload_dir, *DISK, "--compress", compress]
    rc, err = run_child(argv, preexec_fn=limited)
    assert rc == 1 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    task = offload_dir / safe_task_name("0")
    said = {"none": f"--offload-dir: cannot create the disk tier in {task} (File too large)",
            "zstd": f"the disk tier in {task} cannot be written (File too large)"}[compress]
    assert err.startswith(f"generate.py: error: {said}; free space there, or run on host memory "
                          "(--offload cpu)"), err


def test_disk_full_falls_back_to_shorter_context(full_disk, lm):
    """With zstd, the file fills while chunks are written (a short pwrite, then EFBIG), mid-prefill,
    rather than when the raw tier reserves it (the two tests above); the fallback runs on the
    device, uncompressed."""
    argv, output, _, long_ids = full_disk
    N = 64
    rc, err = run_child(argv + ["--compress", "zstd", "--fallback-context", N], preexec_fn=limited)
    assert rc == 0, err
    assert f"continuing on the last {N} tokens" in err, err
    r = by_id(output)["long"]
    assert r["fallback"] == {"context": N} and r["prompt_tokens"] == N
    assert r["prompt_ids"] == long_ids[-N:]
    model, tok = lm
    new, _ = run_task(model, long_ids[-N:], FULL_LONG["max_new_tokens"], chunk_size=C,
                      cfg=OffloadConfig(), eos_ids=tok.eos_ids)
    assert r["tokens"] == new


def test_zstd_disk_tier_with_a_host_pool(lm, tmp_path):
    """--offload disk --compress zstd --cpu-budget: the first evicted chunks go to the host pool,
    the rest are compressed to disk; both kinds are staged for attention."""
    model, tok = lm
    ids = tok.encode(TOPICS["await"])[:100]
    ref, _ = run_task(model, ids, 8, chunk_size=C, cfg=OffloadConfig(), eos_ids=tok.eos_ids)
    cfg = OffloadConfig(mode="disk", window=1, compress="zstd", offload_dir=str(tmp_path),
                        cpu_budget_gib=4 * slot_bytes(model) / 2**30)
    new, stats = run_task(model, ids, 8, chunk_size=C, cfg=cfg, eos_ids=tok.eos_ids)
    assert stats["chunks"]["host"] == 4 and stats["chunks"]["disk"] > 0, stats
    assert new == ref


# -----------------------------------------------------------------------------
# the disk tier as a checkpoint: resume, corrupt chunks, foreign manifests (run_task directly)

NEW = 40


@pytest.fixture(scope="module")
def ids_and_reference(lm):
    model, tok = lm
    ids = tok.encode(TOPICS["await"])[:100]
    ref, _ = run_task(model, ids, NEW, chunk_size=C, cfg=OffloadConfig(), eos_ids=tok.eos_ids)
    return ids, ref


def run_kept(lm, ids, offload_dir, compress="none", chunk=C, fingerprint="model-a",
             on_token=None):
    """run_task on the disk tier, keeping its directory and manifest after success: (new ids,
    stats, log)."""
    model, tok = lm
    log = []
    cfg = OffloadConfig(mode="disk", window=1, offload_dir=str(offload_dir), compress=compress,
                        keep_files=True)
    new, stats = run_task(model, ids, NEW, chunk_size=chunk, cfg=cfg, eos_ids=tok.eos_ids,
                          task_id="t", on_token=on_token, fingerprint=fingerprint,
                          log=log.append)
    return new, stats, log


@pytest.mark.parametrize("compress", ["none", "zstd"])
def test_rerun_resumes_from_the_disk_tier(lm, ids_and_reference, tmp_path, compress):
    ids, ref = ids_and_reference
    new, stats, log = run_kept(lm, ids, tmp_path, compress)
    assert new == ref and stats["resumed_from"] == 0 and log == []
    new, stats, log = run_kept(lm, ids, tmp_path, compress)
    assert new == ref and log == []
    assert stats["resumed_from"] >= 2 * C, stats["resumed_from"]


class Crash(Exception):
    pass


@pytest.mark.parametrize("compress", ["none", "zstd"])
def test_crashed_run_resumes_and_its_rerun_keeps_checkpointing(lm, ids_and_reference, tmp_path,
                                                               compress):
    """A task that dies mid-decode (here: an exception from on_token) keeps its directory; the rerun
    resumes and, as it goes, writes manifests that vouch for the restored chunks as well as its
    own."""
    ids, ref = ids_and_reference

    def crash_at_20(out):
        if len(out) == 20:
            raise Crash
    with pytest.raises(Crash):
        run_kept(lm, ids, tmp_path, compress, on_token=crash_at_20)
    manifest = tmp_path / safe_task_name("t") / "manifest.json"
    before = read_manifest(manifest)
    new, stats, log = run_kept(lm, ids, tmp_path, compress)
    assert new == ref and log == [] and stats["resumed_from"] >= 2 * C
    after = read_manifest(manifest)
    assert len(after["chunks"]) > len(before["chunks"])
    assert len(after["tokens"]) > len(before["tokens"])
    assert after["tokens"] == ids + ref[:len(after["tokens"]) - len(ids)]


def test_resumed_task_reports_only_what_it_decoded(llama_ckpt, tmp_path):
    """After a resume, the replayed tokens are fed again, not decoded: decoded_tokens and the decode
    rate count only the tokens this run sampled (the batch summary adds decoded_tokens)."""
    model = Transformer.from_pretrained(llama_ckpt)
    ids = torch.randint(3, 128, (60,), generator=torch.Generator().manual_seed(0)).tolist()
    cfg = OffloadConfig(mode="disk", window=1, offload_dir=str(tmp_path), keep_files=True)

    def crash(out):
        if len(out) == 30:
            raise Crash
    with pytest.raises(Crash):
        run_task(model, ids, 40, chunk_size=8, cfg=cfg, on_token=crash, fingerprint="fp",
                 task_id="t")
    new, st = run_task(model, ids, 40, chunk_size=8, cfg=cfg, fingerprint="fp", task_id="t")
    assert st["resumed_from"] > 0 and len(new) == 40
    assert 0 < st["decoded_tokens"] < 40 - (st["resumed_from"] - len(ids)) + 1, st


@pytest.mark.parametrize("compress", ["none", "zstd"])
def test_corrupt_chunk_restores_only_the_chunks_before_it(lm, ids_and_reference, tmp_path,
                                                          compress):
    ids, ref = ids_and_reference
    run_kept(lm, ids, tmp_path, compress)
    task_dir = tmp_path / safe_task_name("t")
    m = read_manifest(task_dir / "manifest.json")
    assert len(m["chunks"]) >= 3
    if compress == "none":  # chunk j of a layer starts at byte j * slot_bytes of layer{l}.kv
        path = task_dir / "layer0.kv"
        offset = 1 * slot_bytes(lm[0]) + 5
    else:                   # a blob at the (offset, length) the manifest records
        path = task_dir / "layer0.zst"
        offset = m["chunks"]["1"]["blob"][0][0] + 5
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
    new, stats, log = run_kept(lm, ids, tmp_path, compress)
    assert stats["resumed_from"] == C  # chunk 0 only
    assert any("chunk 1" in line and "checksum" in line for line in log), log
    assert new == ref


def foreign_fingerprint(lm, ids, d):
    run_kept(lm, ids, d, fingerprint="model-b")


def foreign_chunk_size(lm, ids, d):
    run_kept(lm, ids, d, chunk=8)


def foreign_dtype(lm, ids, d):  # as if a bf16 run had left it: the manifest says so
    run_kept(lm, ids, d)
    path = d / safe_task_name("t") / "manifest.json"
    m = read_manifest(path)
    del m["check"]
    m["dtype"] = str(torch.bfloat16)
    path.write_text(json.dumps({**m, "check": manifest_check(m)}))  # vouched for, as a run does


@pytest.mark.parametrize("make_foreign,key", [(foreign_fingerprint, "fingerprint"),
                                              (foreign_chunk_size, "chunk_size"),
                                              (foreign_dtype, "dtype")])
def test_foreign_manifest_is_reported_and_ignored(lm, ids_and_reference, tmp_path, make_foreign,
                                                  key):
    ids, ref = ids_and_reference
    make_foreign(lm, ids, tmp_path)
    assert read_manifest(tmp_path / safe_task_name("t") / "manifest.json")["chunks"]
    new, stats, log = run_kept(lm, ids, tmp_path)
    assert stats["resumed_from"] == 0
    assert len(log) == 1 and f"another {key}" in log[0] and "not used" in log[0], log
    assert new == ref


# -----------------------------------------------------------------------------
# task directories: hostile ids, locks, permissions

HOSTILE = ["../escape", "/abs/path", "a\x00b", "x" * 500, "dot.."]


def test_hostile_ids_stay_inside_the_offload_dir(text_ckpt, tmp_path, capsys):
    tasks = write_tasks(tmp_path / "tasks.jsonl", [{**SHORT, "id": i} for i in HOSTILE])
    off = tmp_path / "off"
    argv = batch_args(text_ckpt, tasks, tmp_path / "results.jsonl", off, *DISK, "--keep-cache")
    rc, err = run_main(argv, capsys)
    assert rc == 0, err
    assert sorted(r["id"] for _, r in results(tmp_path / "results.jsonl")) == sorted(HOSTILE)
    names = os.listdir(off)
    # one each, distinct
    assert len(names) == len(HOSTILE) and set(names) == {safe_task_name(i) for i in HOSTILE}
    root = os.path.realpath(off)
    for name in names:
        path = os.path.realpath(off / name)
        assert os.path.dirname(path) == root, path
        assert os.path.isfile(os.path.join(path, "layer0.kv")), path
    # nothing landed beside it
    assert sorted(os.listdir(tmp_path)) == ["off", "results.jsonl", "tasks.jsonl"]


def file_mode(path):
    return os.stat(path).st_mode & 0o777


def test_files_are_owner_only(text_ckpt, tmp_path, capsys):
    tasks = write_tasks(tmp_path / "tasks.jsonl", [SHORT])
    off = tmp_path / "off"
    output = tmp_path / "results.jsonl"
    old = os.umask(0)  # so that every mode below is the one the code asked for
    try:
        rc, err = run_main(batch_args(text_ckpt, tasks, output, off, *DISK, "--keep-cache"), capsys)
    finally:
        os.umask(old)
    assert rc == 0, err
    task_dir = off / safe_task_name("short")
    assert file_mode(off) == 0o700 and file_mode(task_dir) == 0o700
    assert file_mode(output) == 0o600
    files = sorted(os.listdir(task_dir))
    assert {"lock", "manifest.json", "layer0.kv", "layer1.kv"} <= set(files), files
    assert {f: file_mode(task_dir / f) for f in files} == {f: 0o600 for f in files}


def test_second_user_of_a_task_dir_is_refused_in_process(tmp_path):
    first = TaskDir(str(tmp_path), "same")
    with pytest.raises(TaskDirError, match=f"in use by process {os.getpid()}"):
        TaskDir(str(tmp_path), "same")
    first.close(remove=False)
    TaskDir(str(tmp_path), "same").close(remove=True)  # free again once the holder let go


HOLDER = """
import sys
sys.path.insert(0, sys.argv[1])
from runs.taskdir import TaskDir
t = TaskDir(sys.argv[2], 'busy')
print('holding', flush=True)
sys.stdin.read()
"""


def test_second_user_of_a_task_dir_is_waited_for_across_processes(text_ckpt, tmp_path, capsys,
                                                                  monkeypatch):
    """Another process holds a task's directory: the task is tried after the others, then waited
    for (the other job's result, or the lock's end); here the holder lets go without a result once
    the wait begins, so this job runs the task itself, and every task is in --output at exit 0."""
    from runs import batch
    off = tmp_path / "off"
    off.mkdir(mode=0o700)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, ROOT, str(off)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    waits = []

    def pause(stop):  # the job waits for the holder: it lets go now
        waits.append(1)
        if not holder.stdin.closed:
            holder.stdin.close()
            holder.wait(timeout=60)
        return False
    monkeypatch.setattr(batch, "pause", pause)
    try:
        assert holder.stdout.readline() == "holding\n"
        tasks = write_tasks(tmp_path / "tasks.jsonl",
                            [{**SHORT, "id": "busy"}, {**SHORT, "id": "free"}])
        argv = batch_args(text_ckpt, tasks, tmp_path / "results.jsonl", off, *DISK)
        rc, err = run_main(argv, capsys)
    finally:
        if not holder.stdin.closed:
            holder.stdin.close()
        holder.wait(timeout=60)
    assert rc == 0 and waits and "FAILED" not in err, err
    assert f"task busy: process {holder.pid} runs it now" in err, err
    assert f"task busy: process {holder.pid} still runs it; waiting for it" in err, err
    assert sorted(r["id"] for _, r in results(tmp_path / "results.jsonl")) == ["busy", "free"]


# -----------------------------------------------------------------------------
# the monitor: alerts, trace and statistics

@pytest.fixture
def store(tmp_path):
    """make(mode): a real, empty TieredStore (1 layer, 4 chunks) for Monitor.step to read."""
    made = []

    def make(mode):
        cfg = OffloadConfig(mode=mode, window=1, offload_dir=str(tmp_path))
        made.append(TieredStore(shape=(2, 1, 1, C, 4), dtype=torch.float32, n_layers=1,
                                max_length=4 * C, device="cpu", cfg=cfg,
                                disk_path=str(tmp_path)))
        return made[-1]
    yield make
    for s in made:
        s.close()


class StubCache:
    """How far a task got, as Monitor.step reads it off a KVCache; the store says where its chunks
    are (nowhere)."""
    def __init__(self, store, n_sealed=3):
        self.store = store
        self.n_sealed = n_sealed
        self.chunk_size = C
        self.length = n_sealed * C


BIG_RAM = 1 << 60
FINISHED = {"resumed_from": 0, "prefill_s": 0.01, "prompt_tokens": 40, "prefill_tokens": 40,
            "decode_s": 0.01, "decoded_tokens": 10, "peak_device_bytes": 0,
            "peak_host_rss_bytes": 0, "bytes": {"h2d": 0, "d2h": 0, "disk_write": 0}}


def trace_alerts(path):
    events = [json.loads(line) for line in path.read_text().splitlines()]
    return [e["alert"] for e in events if "alert" in e]


def test_host_memory_alert(tmp_path, store):
    alerts = []
    quiet = store("none")
    m = Monitor(str(tmp_path / "trace.jsonl"), log=alerts.append, ram=1)
    m.step("a", "decode", StubCache(quiet))
    m.step("a", "decode", StubCache(quiet))  # once, not every step
    m.close()
    assert len(alerts) == 1 and "host memory" in alerts[0], alerts
    assert trace_alerts(tmp_path / "trace.jsonl") == ["host_memory"]
    calm = []
    Monitor(None, log=calm.append, ram=BIG_RAM).step("a", "decode", StubCache(quiet))
    assert calm == []


def test_slow_task_alert_compares_time_per_unit_of_work(tmp_path, store):
    """A task is slow when it took over 2x what the finished tasks' mean rates give for the work it
    has done (prefill seconds per prompt token, decode seconds per token); a task that is merely
    longer is not slow."""
    alerts = []
    quiet = store("none")
    m = Monitor(str(tmp_path / "trace.jsonl"), log=alerts.append, ram=BIG_RAM)
    at = StubCache(quiet, n_sealed=4)  # position 64: 40 prompt tokens, then 24 decoded
    m.task_started("slow", prompt_tokens=40)
    m.started["slow"] = (time.perf_counter() - 60, 40)  # began a minute ago
    m.step("slow", "decode", at)
    assert alerts == []  # no finished task yet: nothing to compare with
    m.task_started("fast", prompt_tokens=40)
    # 0.1 s/prompt token, 1 s/token
    m.task_finished("fast", {**FINISHED, "prefill_s": 4.0, "decode_s": 10.0})
    m.task_started("long", prompt_tokens=40)
    # 40 s for 4 + 24 s of work: longer, not slower than 2x
    m.started["long"] = (time.perf_counter() - 40, 40)
    m.step("long", "decode", at)
    assert alerts == [], alerts
    # 60 s for 4 + (32 - 40 < 0) s of work: slow
    m.step("slow", "decode", StubCache(quiet, n_sealed=2))
    m.close()
    assert len(alerts) == 1 and "task slow" in alerts[0] and "2x" in alerts[0], alerts
    assert trace_alerts(tmp_path / "trace.jsonl") == ["slow_task"]


def test_offload_not_in_effect_alert(tmp_path, store):
    alerts = []
    disk = store("disk")
    m = Monitor(str(tmp_path / "trace.jsonl"), log=alerts.append, ram=BIG_RAM)
    # not past the window yet: nothing should have left
    m.step("young", "decode", StubCache(disk, n_sealed=1))
    m.step("off", "decode", StubCache(store("none")))  # no offload configured
    assert alerts == []
    m.step("stuck", "decode", StubCache(disk))  # 3 sealed, window 1, none on host or disk
    m.close()
    assert len(alerts) == 1 and "task stuck" in alerts[0] and "not in effect" in alerts[0], alerts
    assert trace_alerts(tmp_path / "trace.jsonl") == ["offload_not_in_effect"]


BYTES_KEYS = {"h2d", "d2h", "disk_write", "disk_read", "disk_mapped_read", "host_read",
              "kv_read", "window_skipped", "select_skipped"}


def test_real_run_raises_no_alert_and_traces_every_step(lm, ids_and_reference, tmp_path):
    model, tok = lm
    ids, _ = ids_and_reference
    alerts = []
    trace = tmp_path / "trace.jsonl"
    m = Monitor(str(trace), log=alerts.append, ram=BIG_RAM)
    cfg = OffloadConfig(mode="disk", window=1, offload_dir=str(tmp_path / "off"))

    def on_step(phase, logits, cache):
        m.step("t", phase, cache)
    run_task(model, ids, NEW, chunk_size=C, cfg=cfg, eos_ids=tok.eos_ids, on_step=on_step)
    m.close()
    assert alerts == []
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    assert "run_start" in events.pop(0)  # a trace marks where each run starts
    keys = {"t", "task", "phase", "position", "device_allocated", "device_peak", "host_rss",
            "host_anon", "bytes", "chunks"}
    for e in events:
        assert set(e) == keys and set(e["bytes"]) == BYTES_KEYS, e
        assert set(e["chunks"]) == {"device", "host", "disk"} and e["task"] == "t", e
    assert [e["phase"] for e in events] == ["prefill"] * -(-len(ids) // C) + ["decode"] * (NEW - 1)
    assert [e["position"] for e in events][-1] == len(ids) + NEW - 1
    assert sum(e["bytes"]["disk_write"] for e in events) > 0 and events[-1]["chunks"]["disk"] > 0


# ~100 tokens: chunks reach the disk
ONE = [{"id": "one", "prompt": TOPICS["else"][:400], "max_new_tokens": 6}]
STATS_KEYS = {"prefill_s", "prefill_tokens", "prefill_tokens_per_s", "ttft_s", "decode_s",
              "decoded_tokens", "decode_tokens_per_s", "chunks_read_per_decode_step",
              "peak_device_bytes", "peak_host_rss_bytes", "peak_host_anon_bytes",
              "peak_host_file_bytes", "pinned_bytes", "bytes", "io", "chunks", "resumed_from",
              "kv_dtype", "attention_build_s", "products_build_s"}


def test_stats_trace_and_summary_end_to_end(text_ckpt, tmp_path, capsys):
    """The statistics, the trace and the summary as a user gets them from a batch run."""
    trace = tmp_path / "trace.jsonl"
    tasks = write_tasks(tmp_path / "tasks.jsonl", ONE)
    argv = batch_args(text_ckpt, tasks, tmp_path / "results.jsonl", tmp_path / "off", *DISK,
                      "--device", "cpu", "--trace", trace)
    rc, err = run_main(argv, capsys)
    assert rc == 0, err
    r = by_id(tmp_path / "results.jsonl")["one"]
    st = r["stats"]
    assert set(st) == STATS_KEYS, set(st) ^ STATS_KEYS
    assert set(st["bytes"]) == BYTES_KEYS
    assert set(st["io"]) == {"storage_read", "storage_write"}
    assert set(st["chunks"]) == {"device", "host", "disk"}
    # CPU: no host-to-device link, nothing pinned
    assert st["bytes"]["h2d"] == 0 and st["pinned_bytes"] == 0, st
    assert st["decoded_tokens"] == len(r["tokens"]) - 1 and st["resumed_from"] == 0
    assert min(st["prefill_s"], st["decode_s"], st["ttft_s"], st["peak_host_anon_bytes"]) > 0
    assert st["peak_host_rss_bytes"] >= st["peak_host_anon_bytes"]
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    assert "run_start" in events[0] and all(e["task"] == "one" for e in events[1:])
    prefill_steps = -(-r["prompt_tokens"] // C)
    decode_steps = len(r["tokens"]) - 1
    phases = [e["phase"] for e in events[1:]]
    assert phases == ["prefill"] * prefill_steps + ["decode"] * decode_steps
    assert sum(e["bytes"]["disk_write"] for e in events[1:]) == st["bytes"]["disk_write"]
    assert "tasks: 1 done, 0 failed, 0 resumed" in err, err
    decode = next(line for line in err.splitlines() if line.startswith("decode: "))
    assert re.fullmatch(rf"decode: {len(r['tokens']) - 1} tokens at [\d.]+ tok/s over the batch's "
                        r"[\d.]+s; the tasks' decode times, added up: [\d.]+s", decode), decode
    # the same command again: every task is skipped, and the summary says nothing moved
    rc, err = run_main(argv, capsys)
    assert rc == 0 and "1 of 1 tasks already in" in err, err
    assert "bytes: none moved (no task ran)" in err.splitlines(), err


def test_an_empty_prompts_file_says_so_in_one_line(text_ckpt, tmp_path, capsys):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n  \n")
    output = tmp_path / "results.jsonl"
    rc, err = run_main(batch_args(text_ckpt, tasks, output, tmp_path / "off", *DISK), capsys)
    assert rc == 0
    assert err.strip().splitlines() == [f"generate.py: --prompts {tasks} holds no task (every "
                                        "line is blank); nothing to run"], err
    assert not output.exists()


# -----------------------------------------------------------------------------
# bad input

def task_line(task_id):
    return json.dumps({"id": task_id, "prompt": SHORT["prompt"], "max_new_tokens": 2})


def test_malformed_lines_are_named_and_skipped(text_ckpt, tmp_path, capsys):
    tasks = tmp_path / "tasks.jsonl"
    lines = [task_line("a"), '{"id": "b", "prompt": ', task_line("c"), task_line("a"),
             '{"prompt": "no id"}']
    tasks.write_text("\n".join(lines) + "\n")
    output = tmp_path / "results.jsonl"
    argv = batch_args(text_ckpt, tasks, output, tmp_path / "off", "--chunk-size", C)
    rc, err = run_main(argv, capsys)
    assert rc == 1
    assert f"{tasks} line 2: not valid JSON" in err, err
    assert f"{tasks} line 4: duplicate id 'a'" in err, err
    assert f"{tasks} line 5: field 'id' is missing" in err, err
    # a batch writes its lines as its tasks finish: order aside, exactly the good ones
    assert sorted(r["id"] for _, r in results(output)) == ["a", "c"]


@pytest.mark.parametrize("problem", ["missing checkpoint", "offload dir cannot be created",
                                     "missing prompts"])
def test_unusable_paths_give_one_line_and_exit_2(text_ckpt, tmp_path, capsys, problem):
    tasks = write_tasks(tmp_path / "tasks.jsonl", [SHORT])
    ckpt = text_ckpt
    off = tmp_path / "off"
    if problem == "missing checkpoint":
        ckpt = tmp_path / "nowhere"
        flag = "--ckpt"
    elif problem == "offload dir cannot be created":
        (tmp_path / "file").write_text("not a directory")
        off = tmp_path / "file" / "sub"
        flag = "--offload-dir"
    else:
        tasks = tmp_path / "missing.jsonl"
        flag = "--prompts"
    output = tmp_path / "results.jsonl"
    rc, err = run_main(batch_args(ckpt, tasks, output, off, *DISK), capsys)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0] and "Traceback" not in err, err
    assert not output.exists()


def test_an_unusable_offload_dir_is_refused_at_the_start_fallback_or_not(text_ckpt, tmp_path,
                                                                        capsys):
    """The fallbacks cover a disk tier that fails once a task runs (docs/batches.md); an
    --offload-dir unusable from the start is refused before any work, and with a fallback given the
    line says why it did not apply."""
    (tmp_path / "file").write_text("not a directory")
    tasks = write_tasks(tmp_path / "tasks.jsonl", [SHORT])
    output = tmp_path / "results.jsonl"
    argv = batch_args(text_ckpt, tasks, output, tmp_path / "file" / "sub", *DISK,
                      "--fallback-cpu-budget", 1)
    rc, err = run_main(argv, capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and not output.exists(), err
    said = ("(the fallbacks take over a disk tier that fails once a task is running, not one "
            "unusable from the start: for that, --offload cpu)")
    assert "--offload-dir" in lines[0] and said in lines[0], lines


def test_task_lines_that_are_empty_or_unknown_and_an_output_that_is_the_tasks(text_ckpt, tmp_path,
                                                                             capsys):
    """An empty prompt is a bad line (skipped, said, exit 1); a field no task has is said and the
    task runs; --output naming the --prompts file is refused before any work, and so is a file
    holding lines but no result (a copy of the tasks): it is left as it was."""
    tasks = write_tasks(tmp_path / "tasks.jsonl", [{"id": "e", "prompt": ""},
                                                   {**SHORT, "max_tokens": 9}])
    output = tmp_path / "results.jsonl"
    rc, err = run_main(batch_args(text_ckpt, tasks, output, tmp_path / "off"), capsys)
    assert rc == 1 and "field 'prompt' is empty" in err and "'max_tokens' not a task's field" in err
    assert [r["id"] for _, r in results(output)] == ["short"]
    rc, err = run_main(batch_args(text_ckpt, tasks, tasks, tmp_path / "off"), capsys)
    assert rc == 2 and "is the --prompts file" in err and len(err.strip().splitlines()) == 1, err
    copy = write_tasks(tmp_path / "copy.jsonl", [SHORT])
    before = copy.read_bytes()
    rc, err = run_main(batch_args(text_ckpt, tasks, copy, tmp_path / "off"), capsys)
    assert rc == 2 and f"--output {copy} holds 1 line and none is a result" in err, err
    assert copy.read_bytes() == before
    # a whole result whose line end a crash cut off is kept and ended, not removed
    whole = output.read_text().rstrip("\n")
    output.write_text(whole)
    rc, err = run_main(batch_args(text_ckpt, tasks, output, tmp_path / "off"), capsys)
    assert "its last result lacked its line end; added" in err and "tasks already in" in err, err
    assert output.read_text() == whole + "\n"
