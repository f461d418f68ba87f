"""
The tuner (bench.py --tune) and the diagnose mode (verify.py --diagnose) as a user runs them: the
tuner's recommendation fits the budgets, its JSON line parses and its command runs as printed; each
seeded fault is found and named on one line. No speed is asserted beyond "the recommendation is the
fastest measured, or within 5%".
"""
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from argparse import Namespace

import pytest

from measure import doctor, tune
from model import ModelArgs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# random_model's "tiny"
TINY = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=128,
                 vocab_size=256)


def test_tune_tiny_model_fits_budgets_and_its_command_runs(tmp_path):
    dev_gib = 0.0003  # 0.3 MiB of device KV: less than the 0.5 MiB the whole KV takes
    cpu_gib = 0.0004
    prompt = tmp_path / "doc.txt"
    prompt.write_text("The with statement wraps a block. " * 14)  # ~480 of the 512 tuned for
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "bench.py", "--tune", "--random-model", "tiny",
                        "--ckpt", tmp_path / "m", "--context", "512", "--new-tokens", "8",
                        "--device", "cpu", "--threads", "1", "--device-budget", str(dev_gib),
                        "--cpu-budget", str(cpu_gib), "--offload-dir", tmp_path / "kv",
                        "--prompt-file", prompt],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    took = time.perf_counter() - t
    assert p.returncode == 0, p.stderr
    assert took < 120, f"--tune on the tiny model took {took:.0f}s"
    last = json.loads(p.stdout.strip().splitlines()[-1])
    assert set(last) == {"recommended", "command", "measured", "why"}
    rec = last["recommended"]
    m = last["measured"]
    assert set(rec) == {"chunk_size", "window", "offload", "compress", "cpu_budget",
                        "staging_slots"}
    assert rec["offload"] != "none", (
        "the whole KV is over the device budget: something must be offloaded")
    # the recommendation fits: device KV planned from the shape, and measured; the host part within
    # --cpu-budget
    slot = -(-2 * TINY.n_kv_heads * rec["chunk_size"] * TINY.head_dim * 4 // 4096) * 4096
    staged = rec["staging_slots"] or 0
    assert (TINY.n_layers * (rec["window"] + 1) + staged) * slot <= dev_gib * 2**30
    assert m["device_kv_bytes"] <= dev_gib * 2**30
    assert m["kv_bytes_planned"]["host"] <= cpu_gib * 2**30
    assert m["decode_tokens_per_s"] >= 0.95 * m["fastest_decode_tokens_per_s"], last["why"]
    assert "| step | chunk | window | tier |" in p.stdout
    # one figure for the whole KV: the header's and step 2's
    whole = p.stdout.split(" MiB of KV in chunks of")[0].rsplit(" ", 1)[1]
    assert f"the whole KV ({whole} MiB)" in p.stdout, p.stdout
    # the command carries the prompt and a short budget
    assert f"--prompt-file {prompt}" in last["command"], last["command"]
    if rec["cpu_budget"] is not None:
        assert f"--cpu-budget {rec['cpu_budget']!r}" in last["command"]
        assert len(repr(rec["cpu_budget"])) <= 8 and rec["cpu_budget"] <= cpu_gib, rec
    assert "1. chunk size" in p.stdout and "4. prefetch" in p.stdout
    # how long it takes, said up front and as it goes
    said = p.stderr.splitlines()
    up_front = [i for i, line in enumerate(said) if line.startswith("tuning: calibrate ")]
    assert up_front and "twice, then measure up to" in said[up_front[0]], said
    assert said[up_front[0] + 1].startswith("calibrating [1/"), said
    assert any(line.startswith("calibrating [1/") and "s to go" in line for line in said), said
    assert any(re.match(r"measuring \d+ configurations: about \d+s", line) for line in said), said
    assert any(line.startswith("measure [1/") for line in said), said
    # the command runs as printed, with the python on PATH being this one
    path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    env = {**os.environ, "PATH": path}
    run = subprocess.run(["bash", "-c", last["command"]], capture_output=True, text=True, cwd=ROOT,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "decode" in run.stderr


def plan_args(**kw):
    """The tuner's flags, as argparse gives them, for TINY at 2048 tokens."""
    return Namespace(**{"dtype": "fp32", "kv_dtype": "auto", "context": 2048, "new_tokens": 16,
                        "chunk_sizes": [128, 256, 512, 1024], "device_budget": 0.4 / 1024,
                        "cpu_budget": 0.75 / 1024, **kw})


@pytest.mark.parametrize("cuda", [False, True])
def test_candidates_respect_the_budgets_and_the_tier_order(cuda):
    """The grid the tuner measures, from the shape alone: every window fits the device budget with
    its staging slots, and each tier is the nearest the budgets allow (cpu when the offloaded part
    fits, else disk)."""
    args = plan_args()
    cands = tune.candidates(TINY, args, cuda)
    live = [c for c in cands if not c.pruned]
    # 1024: two open chunks (one per layer) are over the budget; 512: the staging slots too, where
    # they are used
    assert {c.chunk_size for c in live} == ({128, 256} if cuda else {128, 256, 512})
    for c in live:
        assert c.kv["device"] <= args.device_budget * 2**30, c
        assert c.staged == (cuda or c.compress == "zstd")
        if c.offload == "cpu":
            assert c.kv["host"] <= args.cpu_budget * 2**30
        else:
            cpu = tune.plan(tune.Candidate(c.chunk_size, c.window, "cpu"), TINY, args, cuda)
            assert cpu.kv["host"] > args.cpu_budget * 2**30, (
                "disk chosen where the cpu tier would have held it")
    assert any(c.compress == "zstd" for c in live)
    # on CUDA the staging slots leave windows too small
    assert any(c.offload == "cpu" for c in live) != cuda
    assert all(c.pruned for c in cands if c.chunk_size == 1024)
    # a device budget that holds all the KV: nothing is offloaded
    roomy = tune.candidates(TINY, plan_args(device_budget=1.0), cuda)
    assert {c.offload for c in roomy} == {"none"}


@pytest.mark.parametrize("offload, window, budget_chunks",
                         [("cpu", 1, 100.37), ("disk", 1, 3.37), ("disk", 0, 0.5)])
def test_command_budget_is_short_and_keeps_the_planned_host_tier(offload, window, budget_chunks):
    """The printed --cpu-budget is the budget tuned under, rounded down to a few digits, and still
    holds every host chunk planned (plain arithmetic: --context 2048 + 16 in chunks of 128, 2
    layers); without --prompt-file the command names a placeholder."""
    args = plan_args(ckpt="m", offload_dir="kv", device="cpu", quantize="none", rope_scaling=None,
                     rope_orig_ctx=None, threads=None, prompt_file=None)
    slot = 2 * TINY.n_kv_heads * 128 * TINY.head_dim * 4  # K and V, fp32: 32 KiB, page aligned
    offloaded = 2 * (-(-(2048 + 16) // 128) - 1 - window)
    budget = budget_chunks * slot / 2**30 + 1e-12
    c = tune.plan(tune.Candidate(128, window, offload, cpu_budget=budget), TINY, args, False)
    want = offloaded if offload == "cpu" else int(budget_chunks)
    assert c.tiers.host == want
    cmd = tune.command(c, args)
    assert "--prompt-file PROMPT.txt" in cmd, cmd
    if want == 0:
        assert "--cpu-budget" not in cmd, cmd
        return
    text = cmd.split("--cpu-budget ")[1].split()[0]
    assert len(text) <= 8 and want * slot <= float(text) * 2**30 <= budget * 2**30, text


def test_tune_refuses_what_it_picks(capsys):
    assert tune.main(["--chunk-size", "64", "--random-model", "tiny"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--chunk-sizes" in err, err


@pytest.mark.parametrize("random_model", [False, True])
def test_tune_says_when_nothing_fits_the_budgets(capsys, monkeypatch, tmp_path, random_model):
    """One sentence; and a random model made for the run goes with it (no command names it)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    model = ["--random-model", "tiny"] if random_model else []
    assert tune.main(["--context", "256", "--device-budget", "1e-9", "--repeats", "1",
                      "--new-tokens", "4", "--threads", "1", *model]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "no configuration fits the budgets" in err[-1] and "--device-budget" in err[-1], err
    assert not [f for f in os.listdir(tmp_path) if f.startswith("tune-model-")]


@pytest.mark.parametrize("argv, says", [
    (["--context", "0"], "--context"),
    (["--target-tok-s", "nan"], "--target-tok-s"),
    (["--context", "99999999"], "past the model's maximum context"),
])
def test_doctor_refuses_what_it_cannot_check(capsys, llama_ckpt, argv, says):
    assert doctor.main(["--ckpt", llama_ckpt, "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and says in err, err


def test_diagnose_a_context_of_one_chunk_is_fixed_by_a_smaller_chunk(capsys, llama_ckpt):
    rc, found, out = diagnose(capsys, llama_ckpt, "--offload", "disk", "--chunk-size", 512,
                              "--window", 0, "--context", 256)
    line = next(line for line in found if line.startswith("FOUND  offload not in effect"))
    assert rc == 1 and "fix: --chunk-size 128" in line and "--window" not in line.split("fix:")[1]


# -----------------------------------------------------------------------------
# verify.py --diagnose: one seeded fault per test, found and named on one line

def diagnose(capsys, ckpt, *args):
    """verify.py --diagnose in this process: (exit code, the FOUND lines, every line)."""
    rc = doctor.main(["--ckpt", ckpt, "--device", "cpu", "--threads", "1", "--probe-mib", "8",
                      *map(str, args)])
    out = capsys.readouterr().out.splitlines()
    return rc, [line for line in out if line.startswith("FOUND")], out


def test_diagnose_finds_nothing_in_a_sound_configuration(capsys, llama_ckpt, tmp_path):
    rc, found, out = diagnose(capsys, llama_ckpt, "--offload", "disk",
                              "--offload-dir", tmp_path / "kv", "--chunk-size", 16, "--window", 2,
                              "--context", 256)
    assert rc == 0 and not found, out
    assert any(line.startswith("ok     no bytes moving: not found") for line in out), out
    assert any("bit-identical" in line for line in out), out


def test_diagnose_finds_an_unwritable_directory(capsys, llama_ckpt, tmp_path):
    (tmp_path / "a_file").write_text("")  # a directory under a file cannot be created, even by root
    rc, found, out = diagnose(capsys, llama_ckpt, "--offload", "disk",
                              "--offload-dir", tmp_path / "a_file" / "kv", "--chunk-size", 16,
                              "--window", 2, "--context", 256)
    assert rc == 1
    assert any(line.startswith("FOUND  offload dir not writable") and "--offload-dir" in line
               for line in found), out


def test_diagnose_a_disk_too_full_for_the_probe_is_a_finding(capsys, llama_ckpt, tmp_path,
                                                             monkeypatch):
    """An --offload-dir with less room than the probe's file: a FOUND line, the other checks still
    printed (an OSError traceback ended the doctor, every finding lost)."""
    import errno

    from measure import probe

    def full(path, nbytes):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(probe, "disk_bandwidth", full)
    rc, found, out = diagnose(capsys, llama_ckpt, "--offload", "disk",
                              "--offload-dir", tmp_path / "kv", "--chunk-size", 16, "--window", 2,
                              "--context", 256)
    assert rc == 1 and any("cannot hold the probe's 8 MiB (No space left on device)" in line
                           for line in found), out
    assert any(line.startswith("ok     no bytes moving") for line in out), out


def test_diagnose_finds_a_window_larger_than_the_context(capsys, llama_ckpt):
    rc, found, out = diagnose(capsys, llama_ckpt, "--offload", "cpu", "--chunk-size", 16,
                              "--window", 32, "--context", 256)
    assert rc == 1
    line = next(line for line in found if line.startswith("FOUND  offload not in effect"))
    assert "fits in --window 32" in line and "fix: --window 14" in line, line


def test_diagnose_finds_a_budget_smaller_than_the_kv(capsys, llama_ckpt):
    rc, found, out = diagnose(capsys, llama_ckpt, "--offload", "cpu", "--cpu-budget", "0.000001",
                              "--chunk-size", 16, "--window", 1, "--context", 256)
    assert rc == 1
    line = next(line for line in found if line.startswith("FOUND  budget smaller than the KV"))
    assert "--cpu-budget 1e-06 GiB holds 0 of the 28 chunks" in line, line
    assert "fix: --cpu-budget" in line, line


def test_fs_type_reads_the_longest_mount(tmp_path):
    mounts = tmp_path / "mounts"
    # mount points exist; the offload dirs below them need not
    (tmp_path / "ram" / "disk").mkdir(parents=True)
    mounts.write_text(f"/dev/sda1 / ext4 rw 0 0\n"
                      f"tmpfs {tmp_path}/ram tmpfs rw 0 0\n"
                      f"nvme {tmp_path}/ram/disk xfs rw 0 0\n")
    # a directory not made yet
    assert doctor.fs_type(str(tmp_path / "ram" / "kv"), mounts) == "tmpfs"
    # the longest mount point wins
    assert doctor.fs_type(str(tmp_path / "ram" / "disk" / "kv"), mounts) == "xfs"
    assert doctor.fs_type(str(tmp_path / "elsewhere"), mounts) == "ext4"


def test_diagnose_finds_a_disk_tier_on_tmpfs(capsys, llama_ckpt, tmp_path, monkeypatch):
    """The offload dir's file system as /proc/mounts would give it: tmpfs (whatever this machine
    mounts where)."""
    ram = str(tmp_path / "ram")
    real = doctor.fs_type

    def fs_type(path, *args):
        return "tmpfs" if path.startswith(ram) else real(path, *args)
    monkeypatch.setattr(doctor, "fs_type", fs_type)
    rc, found, out = diagnose(capsys, llama_ckpt, "--offload", "disk", "--offload-dir", f"{ram}/kv",
                              "--chunk-size", 16, "--window", 2, "--context", 256)
    assert rc == 1
    assert any(line.startswith("FOUND  offload dir in RAM") and "tmpfs" in line
               for line in found), out


def test_diagnose_names_a_mismatch_and_its_likely_cause(capsys, llama_ckpt, monkeypatch):
    """Offload is bit-identical by construction, so the mismatch is seeded: the comparison reports a
    decode step at a chunk boundary, and the doctor names the seal / eviction logic."""
    def compare(base, run):
        return 40, 63, "decode", "logits differ (max 0.5)"
    monkeypatch.setattr(doctor.verify, "compare", compare)
    rc, found, out = diagnose(capsys, llama_ckpt, "--offload", "cpu", "--chunk-size", 16,
                              "--window", 2, "--context", 256)
    assert rc == 1
    line = next(line for line in found
                if line.startswith("FOUND  different output with offload on and off"))
    assert "position 63" in line and "chunk boundary" in line, line


def test_the_printed_command_runs_what_was_measured():
    """--select (and its budget), --attention and --products shape what tune.py measures: its
    command carries them (they were dropped, so the command ran another configuration)."""
    args = tune.build_parser().parse_args(["--select", "quest", "--select-budget", "256",
                                           "--attention", "compiled", "--products", "compiled"])
    args.ckpt = "CKPT"
    cmd = tune.command(tune.Candidate(chunk_size=64, window=1, offload="none"), args)
    for flag in ("--select quest", "--select-budget 256", "--attention compiled",
                 "--products compiled"):
        assert flag in cmd, cmd
    args = tune.build_parser().parse_args([])
    args.ckpt = "CKPT"
    plain = tune.command(tune.Candidate(chunk_size=64, window=1, offload="none"), args)
    assert "--select" not in plain and "--attention" not in plain, plain
