"""
Storage faults beyond a full file, injected where disk.py calls the OS (the zstd tier writes with
os.pwrite): ENOSPC, EACCES and EROFS fail their task alone or fall back to host memory, EIO and
EAGAIN are retried, a persistent EIO is raised with its cause, and where host memory cannot take the
KV either the task goes on with a shorter context. And the host fallback's budget, which must not
change where chunks go while the disk works. (A disk that fills up for real, RLIMIT_FSIZE, is in
test_batch.py.)
"""
import errno
import json
import os

import pytest

import disk
from model import Transformer
from offload import OffloadConfig
from runs import generate_cli
from runs.task import run_task
from test_batch import DISK, ONE, TOPICS, batch_args, by_id, run_main, write_tasks
from test_cli import TEXT
from tokenizer import load_tokenizer

C = 16  # the chunk size of test_batch.DISK
ZSTD = [*DISK, "--compress", "zstd"]


class FaultyOS:
    """disk.py's os module, except that pwrite fails with fail(n) (an errno, or 0 to write) on its
    n-th call."""

    def __init__(self, fail):
        self.fail = fail
        self.calls = 0

    def __getattr__(self, name):
        return getattr(os, name)

    def pwrite(self, fd, data, offset):
        self.calls += 1
        code = self.fail(self.calls)
        if code:
            raise OSError(code, os.strerror(code))
        return os.pwrite(fd, data, offset)


class NoSleep:
    """disk.py's time module, without the pauses between retries."""

    @staticmethod
    def sleep(seconds):
        pass


@pytest.fixture(scope="module")
def plain_one(text_ckpt, tmp_path_factory):
    """The result of ONE with no offload."""
    d = tmp_path_factory.mktemp("plain")
    tasks = write_tasks(d / "tasks.jsonl", ONE)
    argv = batch_args(text_ckpt, tasks, d / "results.jsonl", d / "off", "--chunk-size", C)
    assert generate_cli.main([str(a) for a in argv]) == 0
    return by_id(d / "results.jsonl")["one"]


@pytest.fixture(scope="module")
def lm_small(text_ckpt):
    """(model, ~100 prompt ids, the 6 greedy tokens of an all-device run)."""
    model = Transformer.from_pretrained(text_ckpt)
    ids = load_tokenizer(text_ckpt).encode(TOPICS["else"])[:100]
    new, _ = run_task(model, ids, 6, chunk_size=C, cfg=OffloadConfig())
    return model, ids, new


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES, errno.EROFS])
def test_disk_faults_fall_back_or_fail_that_task(text_ckpt, tmp_path, capsys, monkeypatch,
                                                 plain_one, code):
    monkeypatch.setattr(disk, "os", FaultyOS(lambda n: code))
    tasks = write_tasks(tmp_path / "tasks.jsonl", ONE)
    argv = batch_args(text_ckpt, tasks, tmp_path / "failed.jsonl", tmp_path / "off", *ZSTD)
    rc, err = run_main(argv, capsys)
    assert rc == 1 and "Traceback" not in err, err
    failed = [line for line in err.splitlines() if line.startswith("task one: FAILED")]
    assert len(failed) == 1, err
    assert os.strerror(code) in failed[0] and "--fallback-cpu-budget" in failed[0], err

    argv = batch_args(text_ckpt, tasks, tmp_path / "results.jsonl", tmp_path / "off", *ZSTD,
                      "--fallback-cpu-budget", 1)
    rc, err = run_main(argv, capsys)
    assert rc == 0, err
    assert f"the disk tier failed ({os.strerror(code)}" in err, err
    assert "falling back to host memory" in err, err
    r = by_id(tmp_path / "results.jsonl")["one"]
    assert r["tokens"] == plain_one["tokens"] and r["stats"]["chunks"]["host"] > 0


@pytest.mark.parametrize("code", [errno.EIO, errno.EAGAIN])
def test_transient_write_errors_are_retried(lm_small, tmp_path, monkeypatch, code):
    model, ids, ref = lm_small
    # the first two writes fail once each, then all succeed
    faulty = FaultyOS(lambda n: code if n <= 2 else 0)
    monkeypatch.setattr(disk, "os", faulty)
    cfg = OffloadConfig(mode="disk", window=1, compress="zstd", offload_dir=str(tmp_path))
    new, stats = run_task(model, ids, 6, chunk_size=C, cfg=cfg)
    assert new == ref and stats["chunks"]["disk"] > 0
    # one write per chunk, plus the two that were retried
    assert faulty.calls == stats["chunks"]["disk"] + 2


def test_persistent_eio_fails_with_its_cause(lm_small, tmp_path, monkeypatch):
    model, ids, _ = lm_small
    monkeypatch.setattr(disk, "time", NoSleep)
    monkeypatch.setattr(disk, "os", FaultyOS(lambda n: errno.EIO))
    cfg = OffloadConfig(mode="disk", window=1, compress="zstd", offload_dir=str(tmp_path))
    with pytest.raises(OSError) as e:
        run_task(model, ids, 6, chunk_size=C, cfg=cfg)
    assert e.value.errno == errno.EIO


def test_fallback_context_when_host_fallback_is_impossible(text_ckpt, tmp_path, capsys, monkeypatch,
                                                           lm_small):
    monkeypatch.setattr(disk, "os", FaultyOS(lambda n: errno.ENOSPC))
    N = 48
    tasks = write_tasks(tmp_path / "tasks.jsonl", ONE)
    argv = batch_args(text_ckpt, tasks, tmp_path / "results.jsonl", tmp_path / "off", *ZSTD,
                      "--fallback-cpu-budget", 1e-9, "--fallback-context", N)
    rc, err = run_main(argv, capsys)
    assert rc == 0, err
    assert "host fallback impossible" in err, err
    assert f"continuing on the last {N} tokens" in err, err
    r = by_id(tmp_path / "results.jsonl")["one"]
    assert r["fallback"] == {"context": N} and r["prompt_tokens"] == N
    model = lm_small[0]
    new, _ = run_task(model, r["prompt_ids"], 6, chunk_size=C, cfg=OffloadConfig(), eos_ids=(2,))
    assert r["tokens"] == new


def test_fallback_cpu_budget_leaves_normal_placement_on_disk(text_ckpt, tmp_path, capsys):
    """--fallback-cpu-budget only matters after a disk failure: without one, every offloaded chunk
    reaches disk (so the task can resume), where --cpu-budget would have put the first ones in host
    memory."""
    tasks = write_tasks(tmp_path / "tasks.jsonl",
                        [{"id": "a", "prompt": TEXT * 3, "max_new_tokens": 4}])
    output = tmp_path / "r.jsonl"
    argv = batch_args(text_ckpt, tasks, output, tmp_path / "off", *DISK, "--fallback-cpu-budget", 1)
    rc, err = run_main(argv, capsys)
    assert rc == 0, err
    st = json.loads(output.read_text())["stats"]
    assert st["chunks"]["host"] == 0, st
    assert st["chunks"]["disk"] > 0 and st["bytes"]["disk_write"] > 0, st


def test_a_zstd_chunk_changed_under_the_run_is_one_sentence(lm_small, tmp_path, monkeypatch):
    """A compressed chunk that stops decompressing while the run reads it back (another process
    wrote over the tier): a DiskError naming the file and chunk, not zstandard's traceback."""
    model, ids, _ = lm_small
    blob = disk.DiskTier.blob

    def damaged(self, layer, j):
        return b"\xff" * 40 + blob(self, layer, j)[40:]
    monkeypatch.setattr(disk.DiskTier, "blob", damaged)
    cfg = OffloadConfig(mode="disk", window=1, compress="zstd", offload_dir=str(tmp_path))
    with pytest.raises(disk.DiskError, match=r"layer\d+\.zst: chunk \d+ does not decompress .*"
                                             "something else wrote to the disk tier"):
        run_task(model, ids, 6, chunk_size=C, cfg=cfg)
