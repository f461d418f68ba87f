"""
The same commands under torchrun (gloo, 2 CPU processes): tensor parallel generate.py and verify.py,
and a --prompts batch split over 2 replicas (--tp 1) that gives the single-process results, resumes
after one process is killed, and writes every id once. Each launch costs seconds, so a test makes
the most of each.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from runs import generate_cli
from test_cli import TEXT

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# os.environ when called: conftest points TMPDIR at the session's own directory
ENV = {"OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}


def torchrun(script, *args, n=2, wait=True, **kw):
    """script under torchrun with n processes: its CompletedProcess (wait=False: its Popen)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
           os.path.join(ROOT, script), *map(str, args)]
    env = {**os.environ, **ENV}
    if not wait:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                          **kw)


def parent_pid(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def children(pid):
    """The processes whose parent is pid (torchrun's workers)."""
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and parent_pid(int(p)) == pid]


def single(argv, capsys):
    """generate.py's main() in one process; it must succeed: its stdout."""
    capsys.readouterr()
    rc = generate_cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return out.out


def test_tensor_parallel_generate_and_verify(text_ckpt, tmp_path, capsys):
    """2 ranks hold half the heads each: rank 0 alone prints one JSON object, whose greedy tokens
    equal one process's; each rank's KV went through its own disk tier; verify.py passes under
    torchrun."""
    argv = ["--ckpt", text_ckpt, "--prompt", TEXT * 2, "--max-new-tokens", 12, "--chunk-size", 16,
            "--json", "--offload", "disk", "--window", 1, "--offload-dir", tmp_path / "off"]
    p = torchrun("generate.py", *argv)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 1, p.stdout  # one speaker
    r = json.loads(lines[0])
    ref = json.loads(single(argv[:-2] + ["--offload-dir", tmp_path / "off1"], capsys))
    assert r["tokens"] == ref["tokens"] and r["config"]["tp"] == 2
    ranks = r["stats"]["ranks"]
    assert len(ranks) == 2 and all(s["chunks"]["disk"] > 0 for s in ranks)
    # each rank holds half of the kv heads, so half of the KV bytes
    assert ranks[0]["bytes"]["disk_write"] * 2 == ref["stats"]["bytes"]["disk_write"]
    v = torchrun("verify.py", "--ckpt", text_ckpt, "--max-new-tokens", 6, "--chunk-size", 16,
                 "--window", 1, "--max-prompt-tokens", 120, "--offload-dir", tmp_path / "voff")
    assert v.returncode == 0, v.stdout + v.stderr
    verdict = "OK: every mode is bit-identical to --offload none on all 2 ranks"
    assert v.stdout.count(verdict) == 1, v.stdout


ONE_RANK_FLIPS = """
import os, sys
sys.path.insert(0, {root!r})
from offload import TieredStore
from pools import DEVICE
from runs import launch, proofs
real = TieredStore.load


def load(self, layer, j):  # rank 1's host tier flips one bit of V as it is read back
    kv = real(self, layer, j)
    if os.environ["RANK"] == "1" and self.loc[(layer, j)] is not DEVICE:
        kv = kv.clone()
        kv[1].view(-1)[0] = -kv[1].view(-1)[0]
    return kv


TieredStore.load = load
launch.exit(proofs.main(sys.argv[1:]))
"""


def test_verify_under_torchrun_fails_when_one_replica_differs(text_ckpt, tmp_path):
    """--tp 1: two replicas, each verifying its own share; a difference on rank 1 alone is rank 0's
    verdict too (rank 0 printed OK on all 2 ranks, and "ok": true)."""
    script = tmp_path / "flip_on_rank1.py"
    script.write_text(ONE_RANK_FLIPS.format(root=ROOT))
    v = torchrun(str(script), "--tp", 1, "--ckpt", text_ckpt, "--max-new-tokens", 6,
                 "--chunk-size", 16, "--window", 1, "--max-prompt-tokens", 120, "--modes", "cpu",
                 "--offload-dir", tmp_path / "voff", "--json")
    assert v.returncode != 0, v.stdout + v.stderr
    r = json.loads(v.stdout.strip().splitlines()[-1])
    assert not r["ok"] and r["failed_ranks"] == [1] and r["modes"]["cpu"]["bit_identical"], r


TASKS = [{"id": f"t{i}", "prompt": TEXT * (1 + i % 3), "max_new_tokens": 40} for i in range(6)]


def test_data_parallel_batch_splits_resumes_and_matches_one_process(text_ckpt, tmp_path, capsys):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(t) + "\n" for t in TASKS))
    # one task at a time on each rank, so that the kill lands between results: the tasks of a
    # batched step can all finish within the moment the loop below takes to see two results
    flags = ["--ckpt", text_ckpt, "--prompts", tasks, "--offload", "disk", "--chunk-size", 16,
             "--window", 1, "--batch-size", 1]
    single(flags + ["--output", tmp_path / "one.jsonl", "--offload-dir", tmp_path / "off1"], capsys)
    one = [json.loads(line) for line in (tmp_path / "one.jsonl").read_text().splitlines()]
    ref = {r["id"]: r["tokens"] for r in one}

    # and a bad line, which every replica reads: it must be counted and printed once
    bad = tmp_path / "bad.jsonl"
    bad.write_text(tasks.read_text() + '{"id": "broken", "prompt": \n')
    out = tmp_path / "two.jsonl"
    argv = [bad if a == tasks else a for a in flags]
    argv += ["--output", out, "--offload-dir", tmp_path / "off2", "--tp", 1]
    p = torchrun("generate.py", *argv, wait=False)
    deadline = time.monotonic() + 240
    # kill a rank once some results are in
    while not (out.exists() and out.read_text().count("\n") >= 2):
        assert p.poll() is None, p.communicate()[1]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    workers = children(p.pid)
    os.kill(workers[0], signal.SIGKILL)
    p.communicate(timeout=120)
    first = out.read_text().splitlines()
    assert 2 <= len(first) < len(TASKS), "the kill must land mid-batch"

    again = torchrun("generate.py", *argv)
    assert again.returncode == 1, again.stderr  # the bad line failed; every task succeeded
    said = again.stderr.splitlines()
    assert sum(f"{bad} line 7: not valid JSON" in line for line in said) == 2, again.stderr
    assert said.count(f"FAILED input: {bad} line 7: not valid JSON (Expecting value); "
                      "skipped") == 1, again.stderr
    assert re.search(r"^tasks: \d+ done, 1 failed", again.stderr, re.M), again.stderr
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in got) == sorted(ref), "every id exactly once"
    assert {r["id"]: r["tokens"] for r in got} == ref
    assert {r["group"] for r in got} == {0, 1}, "both replicas did work"
    assert "tasks: " in again.stderr and again.stderr.count("tasks: ") >= 1


@pytest.mark.parametrize("case", ["tp without torchrun", "tp not dividing the world"])
def test_launch_refusals_are_one_sentence(text_ckpt, capsys, case):
    if case == "tp without torchrun":
        capsys.readouterr()
        assert generate_cli.main(["--ckpt", text_ckpt, "--prompt", TEXT, "--tp", "2"]) == 2
        err = capsys.readouterr().err
    else:
        p = torchrun("generate.py", "--ckpt", text_ckpt, "--prompt", TEXT, "--tp", 3)
        assert p.returncode != 0
        err = "\n".join(line for line in p.stderr.splitlines()
                        if line.startswith("generate.py: error"))
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "--tp" in lines[0], err
    assert "torchrun" in lines[0] or "divid" in lines[0], err


def test_tensor_parallel_rank_killed_mid_task_resumes(text_ckpt, tmp_path, capsys):
    """2 ranks share one model; one is killed (SIGKILL) while the task decodes; the same command
    again resumes both ranks from the prefix both manifests vouch for and writes the single-process
    tokens."""
    task = {"id": "long", "prompt": TEXT * 3, "max_new_tokens": 150}
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps(task) + "\n")
    flags = ["--ckpt", text_ckpt, "--prompts", tasks, "--offload", "disk", "--chunk-size", 16,
             "--window", 1]
    single(flags + ["--output", tmp_path / "one.jsonl", "--offload-dir", tmp_path / "off1"], capsys)
    ref = json.loads((tmp_path / "one.jsonl").read_text())["tokens"]
    out = tmp_path / "two.jsonl"
    off = tmp_path / "off2"
    argv = flags + ["--output", out, "--offload-dir", off]
    p = torchrun("generate.py", *argv, wait=False)
    manifests = [off / "task_long" / f"rank{r}" / "manifest.json" for r in (0, 1)]
    deadline = time.monotonic() + 240
    while True:  # kill once both ranks' checkpoints vouch for decoded tokens
        try:
            ms = [json.loads(m.read_text()) for m in manifests]
            if all(len(m["tokens"]) > len(m["prompt_ids"]) + 20 for m in ms):
                break
        except (OSError, ValueError):
            pass
        assert p.poll() is None, p.communicate()[1]
        assert time.monotonic() < deadline
        time.sleep(0.02)
    workers = children(p.pid)
    os.kill(workers[-1], signal.SIGKILL)
    p.communicate(timeout=120)
    assert not out.exists() or out.read_text() == "", "the kill must land mid-task"
    again = torchrun("generate.py", *argv)
    assert again.returncode == 0, again.stderr
    r = json.loads(out.read_text())
    assert r["tokens"] == ref and r["stats"]["resumed_from"] > 0, r["stats"]
