"""
What the other test files left open (issue 11): batch concurrency on the disk tier, storage faults beyond a full
file (ENOSPC, EACCES, EROFS, transient EIO/EAGAIN), fallbacks that cannot happen, a torn results file, verify.py's
failure report, the statistics and trace contract end to end, and low-precision parity with transformers.
Everything runs in this process, on the tiny models of conftest.py.
"""
import errno
import json
import os

import pytest
import torch

import cli
import disk
import generate
import verify
from model import Transformer
from offload import OffloadConfig, TieredStore
from pools import DISK
from task import run_task
from test_batch import DISK as DISK_FLAGS
from test_batch import TOPICS, batch_args, by_id, results, run_main, write_tasks

C = 16
TASKS = [{"id": f"t{i}", "prompt": TOPICS[topic][:60 + 45 * i], "max_new_tokens": 12, "temperature": 0.8, "seed": i}
         for i, topic in enumerate(("pass", "break", "continue", "del"))]  # 1 to 4 chunks of prompt, sampled


@pytest.fixture(scope="module")
def serial(text_ckpt, tmp_path_factory):
    """TASKS run one at a time on the disk tier: {id: result}."""
    d = tmp_path_factory.mktemp("serial")
    argv = batch_args(text_ckpt, write_tasks(d / "tasks.jsonl", TASKS), d / "results.jsonl", d / "off", *DISK_FLAGS,
                      "--top-p", "0.9")
    assert cli.main([str(a) for a in argv]) == 0
    return by_id(d / "results.jsonl")


@pytest.mark.parametrize("concurrency", [2, 3])
def test_concurrent_tasks_equal_their_serial_results(text_ckpt, tmp_path, capsys, serial, concurrency):
    argv = batch_args(text_ckpt, write_tasks(tmp_path / "tasks.jsonl", TASKS), tmp_path / "results.jsonl",
                      tmp_path / "off", *DISK_FLAGS, "--top-p", "0.9", "--concurrency", concurrency)
    rc, err = run_main(argv, capsys)
    assert rc == 0, err
    got = by_id(tmp_path / "results.jsonl")
    assert sorted(got) == sorted(serial)
    for i, r in got.items():
        assert r["tokens"] == serial[i]["tokens"], f"task {i} differs at concurrency {concurrency}"
        assert r["stats"]["chunks"]["disk"] > 0 or r["prompt_tokens"] + 12 <= 2 * C, r["stats"]


# -----------------------------------------------------------------------------
# storage faults, injected where disk.py calls the OS (the zstd tier writes with os.pwrite)

class FaultyOS:
    """disk.py's os module, except that pwrite fails with fail(n) (an errno, or 0 to write) on its n-th call."""

    def __init__(self, fail):
        self.fail, self.calls = fail, 0

    def __getattr__(self, name):
        return getattr(os, name)

    def pwrite(self, fd, data, offset):
        self.calls += 1
        code = self.fail(self.calls)
        if code:
            raise OSError(code, os.strerror(code))
        return os.pwrite(fd, data, offset)


ZSTD = [*DISK_FLAGS, "--compress", "zstd"]
ONE = [{"id": "one", "prompt": TOPICS["else"][:400], "max_new_tokens": 6}]  # ~100 tokens: chunks reach the disk


@pytest.fixture(scope="module")
def plain_one(text_ckpt, tmp_path_factory):
    d = tmp_path_factory.mktemp("plain")
    argv = batch_args(text_ckpt, write_tasks(d / "tasks.jsonl", ONE), d / "results.jsonl", d / "off", "--chunk-size", C)
    assert cli.main([str(a) for a in argv]) == 0
    return by_id(d / "results.jsonl")["one"]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES, errno.EROFS])
def test_disk_faults_fall_back_or_fail_that_task(text_ckpt, tmp_path, capsys, monkeypatch, plain_one, code):
    monkeypatch.setattr(disk, "os", FaultyOS(lambda n: code))
    tasks = write_tasks(tmp_path / "tasks.jsonl", ONE)
    argv = batch_args(text_ckpt, tasks, tmp_path / "failed.jsonl", tmp_path / "off", *ZSTD)
    rc, err = run_main(argv, capsys)
    assert rc == 1 and "Traceback" not in err, err
    failed = [line for line in err.splitlines() if line.startswith("task one: FAILED")]
    assert len(failed) == 1 and os.strerror(code) in failed[0] and "--fallback-cpu-budget" in failed[0], err

    argv = batch_args(text_ckpt, tasks, tmp_path / "results.jsonl", tmp_path / "off", *ZSTD, "--fallback-cpu-budget", 1)
    rc, err = run_main(argv, capsys)
    assert rc == 0, err
    assert f"the disk tier failed ({os.strerror(code)}" in err and "falling back to host memory" in err, err
    r = by_id(tmp_path / "results.jsonl")["one"]
    assert r["tokens"] == plain_one["tokens"] and r["stats"]["chunks"]["host"] > 0


@pytest.mark.parametrize("code", [errno.EIO, errno.EAGAIN])
def test_transient_write_errors_are_retried(lm_small, tmp_path, monkeypatch, code):
    model, ids, ref = lm_small
    faulty = FaultyOS(lambda n: code if n <= 2 else 0)  # the first two writes fail once each, then all succeed
    monkeypatch.setattr(disk, "os", faulty)
    cfg = OffloadConfig(mode="disk", window=1, compress="zstd", offload_dir=str(tmp_path))
    new, stats = run_task(model, ids, 6, chunk_size=C, cfg=cfg)
    assert new == ref and stats["chunks"]["disk"] > 0
    assert faulty.calls == stats["chunks"]["disk"] + 2  # one write per chunk, plus the two that were retried


def test_persistent_eio_fails_with_its_cause(lm_small, tmp_path, monkeypatch):
    model, ids, _ = lm_small
    monkeypatch.setattr(disk, "time", type("NoSleep", (), {"sleep": staticmethod(lambda s: None)}))
    monkeypatch.setattr(disk, "os", FaultyOS(lambda n: errno.EIO))
    cfg = OffloadConfig(mode="disk", window=1, compress="zstd", offload_dir=str(tmp_path))
    with pytest.raises(OSError) as e:
        run_task(model, ids, 6, chunk_size=C, cfg=cfg)
    assert e.value.errno == errno.EIO


@pytest.fixture(scope="module")
def lm_small(text_ckpt):
    """(model, ~100 prompt ids, the 6 greedy tokens of an all-device run)."""
    from tokenizer import load_tokenizer
    model = Transformer.from_pretrained(text_ckpt)
    ids = load_tokenizer(text_ckpt).encode(TOPICS["else"])[:100]
    return model, ids, run_task(model, ids, 6, chunk_size=C, cfg=OffloadConfig())[0]


def test_fallback_context_when_host_fallback_is_impossible(text_ckpt, tmp_path, capsys, monkeypatch, lm_small):
    monkeypatch.setattr(disk, "os", FaultyOS(lambda n: errno.ENOSPC))
    N = 48
    argv = batch_args(text_ckpt, write_tasks(tmp_path / "tasks.jsonl", ONE), tmp_path / "results.jsonl",
                      tmp_path / "off", *ZSTD, "--fallback-cpu-budget", 1e-9, "--fallback-context", N)
    rc, err = run_main(argv, capsys)
    assert rc == 0, err
    assert "host fallback impossible" in err and f"continuing on the last {N} tokens" in err, err
    r = by_id(tmp_path / "results.jsonl")["one"]
    assert r["fallback"] == {"context": N} and r["prompt_tokens"] == N
    new, _ = run_task(lm_small[0], r["prompt_ids"], 6, chunk_size=C, cfg=OffloadConfig(), eos_ids=(2,))
    assert r["tokens"] == new


def test_torn_last_line_is_repaired(text_ckpt, tmp_path, capsys, serial):
    tasks = write_tasks(tmp_path / "tasks.jsonl", TASKS[:2])
    output = tmp_path / "results.jsonl"
    whole = json.dumps(serial["t0"]) + "\n"
    output.write_text(whole + '{"id": "t1", "prompt_ids": [1, 2')  # a writer died in the middle of a line
    rc, err = run_main(batch_args(text_ckpt, tasks, output, tmp_path / "off", *DISK_FLAGS, "--top-p", "0.9"), capsys)
    assert rc == 0, err
    assert "removed a partial last line" in err and "1 of 2 tasks already in" in err, err
    lines = results(output)  # every line whole and parseable
    assert lines[0][0] + "\n" == whole and [r["id"] for _, r in lines] == ["t0", "t1"]
    assert lines[1][1]["tokens"] == serial["t1"]["tokens"]


# -----------------------------------------------------------------------------
# verify.py's failure path: a store that flips one bit of one chunk on its way back from disk

def test_verify_names_the_first_differing_step(text_ckpt, tmp_path, monkeypatch, capsys):
    steps, flipped = [], []
    real_forward, real_load = generate.forward, TieredStore.load

    def forward(model, cache, tokens):  # counts steps and where each ended, independently of verify.py
        logits = real_forward(model, cache, tokens)
        steps.append(cache.length)
        return logits

    def load(self, layer, j):
        kv = real_load(self, layer, j)                  # the chunk [2, B, G, C, D]: K at 0, V at 1
        if (layer, j) == (0, 1) and self.loc[(layer, j)] is DISK:
            if not flipped:
                flipped.append(len(steps))  # the step in flight
            kv = kv.clone()
            kv[1].view(torch.int32)[0, 0, 0, 0] ^= 1 << 31  # the sign bit of one value of V
        return kv
    monkeypatch.setattr(generate, "forward", forward)
    monkeypatch.setattr(TieredStore, "load", load)
    rc = verify.main(["--ckpt", text_ckpt, "--modes", "disk", "--chunk-size", str(C), "--window", "1",
                      "--max-new-tokens", "4", "--max-prompt-tokens", "60", "--offload-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 1 and flipped, out
    step = flipped[0] - len(steps) // 2  # steps counts both runs: --offload none first, then disk
    phase = "prefill" if step < -(-60 // C) else "decode"
    assert f"MISMATCH disk: step {step} ({phase}, position {steps[flipped[0]] - 1})" in out and "FAILED" in out, out


# -----------------------------------------------------------------------------
# end to end: the statistics, the trace and the summary as a user gets them

STATS_KEYS = {"prefill_s", "prefill_tokens_per_s", "ttft_s", "decode_s", "decoded_tokens", "decode_tokens_per_s",
              "peak_device_bytes", "peak_host_rss_bytes", "peak_host_anon_bytes", "peak_host_file_bytes",
              "pinned_bytes", "bytes", "io", "chunks", "resumed_from", "kv_dtype"}


def test_stats_trace_and_summary_end_to_end(text_ckpt, tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    argv = batch_args(text_ckpt, write_tasks(tmp_path / "tasks.jsonl", ONE), tmp_path / "results.jsonl",
                      tmp_path / "off", *DISK_FLAGS, "--device", "cpu", "--trace", trace)
    rc, err = run_main(argv, capsys)
    assert rc == 0, err
    r = by_id(tmp_path / "results.jsonl")["one"]
    st = r["stats"]
    assert set(st) == STATS_KEYS, set(st) ^ STATS_KEYS
    assert set(st["bytes"]) == {"h2d", "d2h", "disk_write", "disk_read", "disk_mapped_read", "window_skipped"}
    assert set(st["io"]) == {"storage_read", "storage_write"} and set(st["chunks"]) == {"device", "host", "disk"}
    assert st["bytes"]["h2d"] == 0 and st["pinned_bytes"] == 0, st  # CPU: no host-to-device link, nothing pinned
    assert st["decoded_tokens"] == len(r["tokens"]) - 1 and st["resumed_from"] == 0
    assert min(st["prefill_s"], st["decode_s"], st["ttft_s"], st["peak_host_anon_bytes"]) > 0
    assert st["peak_host_rss_bytes"] >= st["peak_host_anon_bytes"]
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    assert "run_start" in events[0] and all(e["task"] == "one" for e in events[1:])
    assert [e["phase"] for e in events[1:]] == ["prefill"] * -(-r["prompt_tokens"] // C) + ["decode"] * (len(r["tokens"]) - 1)
    assert sum(e["bytes"]["disk_write"] for e in events[1:]) == st["bytes"]["disk_write"]
    assert "tasks: 1 done, 0 failed, 0 resumed" in err and f"decode: {len(r['tokens']) - 1} tokens" in err, err


# -----------------------------------------------------------------------------
# low precision: parity with transformers computing in the same dtype

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_parity_with_transformers(checkpoint, dtype):
    """Our logits in bf16/fp16 are as close to transformers' in that dtype as transformers' are to exact (fp32):
    the tolerance is the dtype's own rounding, measured, not a constant."""
    from transformers import AutoModelForCausalLM
    path = checkpoint()
    tokens = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        exact = Transformer.from_pretrained(path)(tokens)[0]
        ours = Transformer.from_pretrained(path, dtype=dtype)(tokens)[0]
        theirs = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()(tokens).logits[0].float()
    rounding, diff = (theirs - exact).abs().max().item(), (ours - theirs).abs().max().item()
    assert rounding > 1e-3, "not computed in low precision"
    assert diff <= 2 * rounding and (ours - exact).abs().max().item() <= 2 * rounding, (diff, rounding)
    top2 = theirs.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * diff  # positions where our difference cannot flip the greedy choice
    assert clear.sum() >= len(clear) // 2 and torch.equal(ours.argmax(-1)[clear], theirs.argmax(-1)[clear])
