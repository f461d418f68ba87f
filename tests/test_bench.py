"""
bench.py as a user runs it, on a tiny random model: the table and the JSON contract, the random
checkpoint that transformers also loads (same greedy ids), the probe's prediction on the CPU (and
probe.py as a command of its own), and bad flags answered with one line and exit code 2 before any
heavy work. No timing is asserted: the machines these run on are noisy.
"""
import argparse
import json
import os
import subprocess
import sys

import pytest
import torch

from measure import bench
from measure.random_model import parse_model_spec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = "dim=32,layers=2,heads=4,kv_heads=2,hidden=64,vocab=128"
ROW_KEYS = {"context", "mode", "runs", "prefill_tokens_per_s", "decode_tokens_per_s", "ttft_s",
            "peak_device_bytes", "peak_host_rss_bytes", "peak_host_anon_bytes", "bytes", "chunks",
            "prefill_tokens_per_s_spread", "decode_tokens_per_s_spread", "prefill_vs_none",
            "decode_vs_none", "predicted_decode_tokens_per_s", "prediction_error",
            "ours_over_hf_prefill", "ours_over_hf_decode"}


def run_bench(*args):
    """bench.py on the CPU in a child process, as a user runs it; it must succeed."""
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench.py"), "--device", "cpu",
                        "--threads", "1", *map(str, args)],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 0, p.stderr
    return p


def test_bench_end_to_end_with_transformers(tmp_path):
    model_dir = tmp_path / "model"
    out = tmp_path / "bench.json"
    p = run_bench("--random-model", TINY, "--ckpt", model_dir, "--contexts", "64,128",
                  "--modes", "none,disk", "--chunk-size", 16, "--new-tokens", 4, "--repeats", 1,
                  "--vs-hf", "--offload-dir", tmp_path / "kv", "--json", out)
    r = json.loads(out.read_text())
    assert set(r) == {"machine", "config", "calibration", "results", "hf"}
    runs = [(row["context"], row["mode"]) for row in r["results"]]
    assert runs == [(64, "none"), (64, "disk"), (128, "none"), (128, "disk")]
    for row in r["results"]:
        assert ROW_KEYS <= set(row), ROW_KEYS - set(row)
        rates = (row["prefill_tokens_per_s"], row["decode_tokens_per_s"],
                 row["predicted_decode_tokens_per_s"])
        assert min(rates) > 0
        assert row["peak_device_bytes"] > 0
        assert row["peak_host_rss_bytes"] >= row["peak_host_anon_bytes"] > 0
    none = r["results"][2]
    disk = r["results"][3]
    assert none["decode_vs_none"] == 1.0
    assert none["bytes"]["disk_write"] == 0 and none["chunks"]["disk"] == 0
    assert disk["bytes"]["disk_write"] > 0 and disk["bytes"]["disk_mapped_read"] > 0
    assert disk["chunks"]["disk"] > 0
    # the random checkpoint is a real Hugging Face one: transformers loads it and decodes the same
    # greedy ids
    assert [row["context"] for row in r["hf"]] == [64, 128]
    assert all(row["greedy_ids_equal_ours"] for row in r["hf"])
    assert r["config"]["model"] == dict(dim=32, layers=2, heads=4, kv_heads=2, head_dim=8,
                                        hidden=64, vocab=128)
    assert "| context | mode |" in p.stdout and "| 128 | disk |" in p.stdout
    assert "DynamicCache" in p.stdout
    assert (model_dir / "config.json").exists()
    # no disk tier file left, and the offload dir it made for the run is gone too
    assert not (tmp_path / "kv").exists(), list(os.scandir(tmp_path / "kv"))


def test_probe_predicts_on_cpu(tmp_path):
    out = tmp_path / "probe.json"
    p = run_bench("--probe", "--random-model", TINY, "--contexts", "64,256", "--chunk-size", 16,
                  "--new-tokens", 4, "--repeats", 1, "--offload-dir", tmp_path, "--probe-mib", 8,
                  "--json", out)
    r = json.loads(out.read_text())
    assert set(r["predicted"]) == {"64", "256"}
    for per_mode in r["predicted"].values():
        # zstandard is installed and the probe measures it, so every mode, disk+zstd too, gets a
        # prediction
        assert set(per_mode) == set(bench.MODE_SPECS), per_mode
        assert all(v is not None and v > 0 for v in per_mode.values()), per_mode
    assert r["calibration"]["link_gbps"]["host_memcpy"] > 0
    assert r["calibration"]["disk_gbps"]["read"] > 0 and r["calibration"]["disk_gbps"]["method"]
    assert "Predicted decode at 256 tokens" in p.stdout and "torch " in p.stdout
    if not torch.cuda.is_available():
        assert "CUDA is absent" in p.stdout
    scratch = [f for f in os.listdir(tmp_path) if f.startswith(".bench")]
    assert scratch == [], "probe scratch files left behind"


def test_probe_py_is_a_command():
    p = subprocess.run([sys.executable, os.path.join(ROOT, "probe.py"), "--help"],
                       capture_output=True, text=True)
    assert p.returncode == 0 and "--probe" in p.stdout


@pytest.mark.parametrize("argv", [
    ["--modes", "none,bogus"],
    ["--contexts", "1024,4k"],
    ["--contexts", "0"],
    ["--new-tokens", "1"],
    ["--layers", "2"],
    ["--random-model", "dim=0,layers=2"],
    ["--random-model", "heads=3,kv_heads=2,dim=6,layers=1,hidden=8,vocab=8"],
    ["--ckpt", "/nonexistent/model"],
    ["--json", "/nonexistent/dir/out.json"],
    ["--json", "/"],
    ["--json", "/proc/out.json"],
    ["--window", "-1"],
    ["--no-such-flag"],
    ["--dtype", "fp64"],
])
def test_bad_flags_exit_2_with_one_line(argv, capsys):
    try:
        rc = bench.main(["--device", "cpu"] + argv)
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("bench.py: error:"), err


def test_random_model_refuses_a_non_empty_directory(tmp_path, capsys):
    (tmp_path / "something").write_text("x")
    assert bench.main(["--device", "cpu", "--random-model", TINY, "--ckpt", str(tmp_path)]) == 2
    assert "not empty" in capsys.readouterr().err


def test_model_spec_presets_and_overrides():
    s = parse_model_spec("7b-like", layers=4)
    assert s == dict(dim=4096, layers=4, heads=32, kv_heads=32, head_dim=128, hidden=11008,
                     vocab=32000)
    assert parse_model_spec("7b-like,kv_heads=8")["kv_heads"] == 8
    assert parse_model_spec(TINY)["head_dim"] == 32 // 4


def test_fresh_process_runs_each_side_in_its_own_process(tmp_path, monkeypatch, capsys):
    """--fresh-process: every (context, mode) run, ours and transformers', is a child process of its
    own, whose numbers come back as JSON into the same table; the greedy ids still agree across the
    process boundary."""
    children = []
    real_run = bench.subprocess.run

    def spy(argv, **kwargs):
        children.append(argv[argv.index("--child-run") + 1])
        return real_run(argv, **kwargs)
    monkeypatch.setattr(bench.subprocess, "run", spy)
    out = tmp_path / "bench.json"
    rc = bench.main(["--device", "cpu", "--threads", "1", "--random-model", TINY,
                     "--contexts", "64", "--modes", "none", "--chunk-size", "16",
                     "--new-tokens", "4", "--repeats", "1", "--vs-hf", "--fresh-process",
                     "--offload-dir", str(tmp_path / "kv"), "--json", str(out)])
    assert rc == 0, capsys.readouterr().err
    assert sorted(children) == ["hf:64:4", "none:64:4"]  # no warm-up runs: each one is cold
    r = json.loads(out.read_text())
    assert [row["mode"] for row in r["results"]] == ["none"]
    assert r["hf"][0]["greedy_ids_equal_ours"]
    for row in r["results"] + r["hf"]:
        assert row["prefill_tokens_per_s"] > 0 and row["peak_host_anon_bytes"] > 0
    assert r["config"]["fresh_process"] and r["results"][0]["ours_over_hf_prefill"] > 0


def test_kv_store_reuse_counts_the_tokens_it_computes(tmp_path, capsys):
    """bench.py --kv-store: a document on a chunk boundary (64 of chunk 16) and one past it (50);
    the warm run reuses the document's whole chunks and computes the rest (plain arithmetic), and
    its time to first token includes reading them."""
    out = tmp_path / "reuse.json"
    assert bench.main(["--device", "cpu", "--threads", "1", "--random-model", TINY,
                       "--contexts", "64,50", "--chunk-size", "16", "--repeats", "1",
                       "--kv-store", str(tmp_path / "s"), "--offload-dir", str(tmp_path / "off"),
                       "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["reuse"]
    for row, doc in zip(rows, (64, 50)):
        reused = doc // 16 * 16
        assert row["context"] == doc + 32 and row["reused_tokens"] == reused, row
        assert row["computed_tokens"] == doc + 32 - reused, row
        assert row["warm_ttft_s"] > 0 and row["store_bytes_read"] > 0, row
    assert "| computed tokens |" in capsys.readouterr().out


def test_json_at_a_link_is_refused_before_any_work_and_left_alone(tmp_path, capsys):
    """--json names a file to write: a symbolic link there (/dev/stdout is one) is refused before
    the model loads, never replaced by a file."""
    target = tmp_path / "mine.txt"
    target.write_text("kept")
    link = tmp_path / "out.json"
    link.symlink_to(target)
    assert bench.main(["--device", "cpu", "--json", str(link)]) == 2
    err = capsys.readouterr().err
    assert "symbolic link" in err and os.path.islink(link) and target.read_text() == "kept", err


def test_a_benchmark_leaves_none_of_its_tasks_behind(tmp_path):
    """What an interrupted or failed run of this process left in --offload-dir goes at its end
    (there is nothing to resume); another process's tasks stay."""
    mine = tmp_path / f"task_bench_{os.getpid()}_0_2048_disk_zstd+ab12"
    theirs = tmp_path / "task_bench_1_warmup_disk"
    for d in (mine, theirs):
        d.mkdir(mode=0o700)
        (d / "layer0.kv").write_bytes(b"x")
    bench.remove_own_tasks(argparse.Namespace(offload_dir=str(tmp_path)))
    assert not mine.exists() and (theirs / "layer0.kv").exists()


def test_random_model_files_are_private(tmp_path):
    from measure.random_model import build_random_checkpoint
    out = build_random_checkpoint(parse_model_spec(TINY), str(tmp_path / "m"), torch.float32)
    modes = {name: os.stat(os.path.join(out, name)).st_mode & 0o777 for name in os.listdir(out)}
    assert os.stat(out).st_mode & 0o777 == 0o700 and set(modes.values()) == {0o600}, modes


def test_probe_refuses_a_disk_test_file_past_the_free_space(tmp_path, capsys):
    from measure import probe
    offload = tmp_path / "kv"
    assert probe.main(["--device", "cpu", "--probe-mib", "100000000", "--offload-dir",
                       str(offload)]) == 2
    err = capsys.readouterr().err.strip()
    assert "--probe-mib" in err and err.count("\n") == 0 and not offload.exists(), err


@pytest.mark.parametrize("at", [1, 3])
def test_the_disk_probe_leaves_no_file_however_it_ends(tmp_path, monkeypatch, at):
    """Ctrl-C at the probe's first write (where O_DIRECT is tried) or later: its scratch file goes
    (the first write was outside the cleanup, and 8 MiB stayed behind)."""
    from measure import probe
    calls = []

    def write(fd, data):
        calls.append(1)
        if len(calls) == at:
            raise KeyboardInterrupt
        return os.write(fd, data)
    monkeypatch.setattr(probe.os, "write", write)
    with pytest.raises(KeyboardInterrupt):
        probe.disk_bandwidth(str(tmp_path), nbytes=4 << 20, block=1 << 20)
    assert os.listdir(tmp_path) == []


def test_a_fresh_process_runs_what_this_one_would(monkeypatch):
    """--fresh-process (and --contention) hand the child every flag that shapes a run: the
    selection's and --group-buffers too (the child ran --select all where quest was asked)."""
    args = bench.build_parser().parse_args(["--random-model", "tiny", "--select", "quest",
                                            "--select-budget", "128", "--select-dense", "1",
                                            "--group-buffers", "3"])
    seen = []

    def run(cmd, **kwargs):
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout='{"ok": 1}\n', stderr="")
    monkeypatch.setattr(bench.subprocess, "run", run)
    args.ckpt = "CKPT"
    assert bench.run_fresh(args, "none", 100, 4) == {"ok": 1}
    cmd = " ".join(seen[0])
    for flag in ("--select quest", "--select-budget 128", "--select-dense 1", "--group-buffers 3"):
        assert flag in cmd, cmd


def test_visit_cost_needs_a_long_context(capsys):
    assert bench.main(["--random-model", "tiny", "--visit-cost", "--contexts", "100"]) == 2
    assert "--visit-cost needs --contexts of 8192 or more" in capsys.readouterr().err


def test_calibrations_measured_on_some_repeats_only_take_their_median():
    """probe.py's zstd calibration is measured on the first repeat only: the later repeats' None
    is left out of the median (it crashed probe.py at its default --repeats without disk+zstd)."""
    from measure.probe import median_of
    cals = [{"read": 30.0, "zstd": {"ratio": 2.0}}, {"read": 20.0, "zstd": None},
            {"read": 40.0, "zstd": None}]
    assert median_of(cals) == {"read": 30.0, "zstd": {"ratio": 2.0}}
    assert median_of([{"zstd": None}, {"zstd": None}]) == {"zstd": None}


def test_batch_sizes_run_once_each_in_order_against_the_first(capsys):
    """--batch-sizes 4,1,1: each size once, smallest first, the ratios against it and labelled so
    (a repeated size merged a cold and a warm run; an untimed warm-up comes first)."""
    assert bench.main(["--random-model", "tiny", "--batch-sizes", "4,1,1", "--contexts", "32",
                       "--new-tokens", "2", "--repeats", "1", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line.split("|")[1].strip() for line in out.splitlines()
            if line.startswith("| ") and line.split("|")[1].strip().isdigit()]
    assert rows == ["1", "4"], out
    assert "| batch | ours tok/s | vs batch 1 |" in out and "| 1 | " in out, out

