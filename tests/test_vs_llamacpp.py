"""
bench.py --vs-llamacpp without llama.cpp: a fake llama-bench (a script that answers as llama-bench
-o json does, at rates it is told) stands in for the binary, so the flags it is run with, the
parsing of its JSON, the table and the refusals are covered where llama.cpp is not installed. No
timing is asserted.
"""
import json
import os
import sys

import pytest

from measure import bench

TINY = "dim=32,layers=2,heads=4,kv_heads=2,hidden=64,vocab=128"
# TINY's parameters, counted by hand: embeddings and output (128 x 32 each), per layer q and o
# (32 x 32), k and v (32 x 16: 2 kv heads of 8), the MLP (3 x 32 x 64) and two norms, a final norm
TINY_PARAMS = 2 * 128 * 32 + 2 * (2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64 + 2 * 32) + 32
PREFILL = 1234.5  # the fake's rates, tok/s
DECODE = 56.25

FAKE = """#!{python}
import json, sys
argv = sys.argv[1:]
with open({log!r}, "a") as f:
    f.write(json.dumps(argv) + "\\n")
if {fail!r}:
    sys.stderr.write("llama.cpp build info\\nerror: invalid parameter for argument: -d\\n")
    sys.exit(1)
flag = lambda name, default: argv[argv.index(name) + 1] if name in argv else default
model = json.load(open(flag("-m", "")))  # the fake GGUF: what llama-bench would read in it
n_prompt, n_gen = int(flag("-p", 512)), int(flag("-n", 128))
ts = {decode} if n_gen else {prefill}
print("main: some line a build prints first")
print(json.dumps([{{"build_commit": "fake", "build_number": 1, "backends": "CPU",
                   "model_type": model["type"], "model_n_params": model["params"],
                   "n_threads": int(flag("-t", 4)), "type_k": "f16", "type_v": "f16",
                   "flash_attn": -1, "n_prompt": n_prompt, "n_gen": n_gen,
                   "n_depth": int(flag("-d", 0)), "avg_ts": ts, "stddev_ts": 0.0,
                   "samples_ts": [ts]}}], indent=2))
"""


def fake_llama_bench(tmp_path, fail=False):
    """(path of the fake binary, path of the log of its argv lists)."""
    log = tmp_path / "calls.jsonl"
    path = tmp_path / "llama-bench"
    path.write_text(FAKE.format(python=sys.executable, log=str(log), fail=fail, decode=DECODE,
                                prefill=PREFILL))
    os.chmod(path, 0o755)
    return str(path), log


def fake_gguf(tmp_path, kind="llama ?B all F32", params=TINY_PARAMS):
    path = tmp_path / "model.gguf"
    path.write_text(json.dumps({"type": kind, "params": params}))
    return str(path)


def run_bench(tmp_path, *args):
    """bench.py on the tiny random model in tmp_path, one thread, --offload none, chunk 16, then
    args: its exit code."""
    return bench.main(["--device", "cpu", "--threads", "1", "--random-model", TINY,
                       "--ckpt", str(tmp_path / "model"), "--modes", "none", "--chunk-size", "16",
                       "--offload-dir", str(tmp_path / "kv"), *args])


def test_the_table_from_a_fake_llama_bench(tmp_path, capsys):
    binary, log = fake_llama_bench(tmp_path)
    out = tmp_path / "bench.json"
    rc = run_bench(tmp_path, "--contexts", "64,48", "--new-tokens", "4", "--repeats", "2",
                   "--json", str(out), "--vs-llamacpp", binary, "--gguf", fake_gguf(tmp_path))
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    # the check first, then per repeat and context a prefill and a decode at that depth, each
    # with our thread count and 3 decode steps (4 new tokens, the first from the prefill)
    assert calls[0][calls[0].index("-p") + 1] == "16"
    tests = [(c[c.index("-p") + 1], c[c.index("-n") + 1], c[c.index("-d") + 1] if "-d" in c
              else None) for c in calls[1:]]
    assert tests == [("64", "0", None), ("0", "3", "64"), ("48", "0", None), ("0", "3", "48")] * 2
    for c in calls:
        assert c[c.index("-t") + 1] == "1" and c[c.index("-o") + 1] == "json", c
        assert "-ctk" not in c and "-fa" not in c  # llama-bench's defaults, as a user runs it
    r = json.loads(out.read_text())
    assert r["llamacpp"]["model_type"] == "llama ?B all F32"
    assert [(row["context"], row["mode"], row["runs"]) for row in r["results"]] == [
        (64, "none", 2), (48, "none", 2)]
    lines = captured.out.splitlines()
    for row in r["results"]:
        assert row["llamacpp_prefill_tokens_per_s"]["median"] == PREFILL
        assert row["llamacpp_decode_tokens_per_s"]["median"] == DECODE
        ours = row["ours_prefill_tokens_per_s"]
        assert ours["min"] <= ours["median"] <= ours["max"] and ours["min"] > 0
        assert row["ours_over_llamacpp_prefill"] == pytest.approx(ours["median"] / PREFILL)
        decode = row["ours_decode_tokens_per_s"]["median"]
        assert row["ours_over_llamacpp_decode"] == pytest.approx(decode / DECODE)
        line = next(x for x in lines
                    if x.startswith(f"| {row['context']} | none | fp32 / F32 | auto |"))
        assert f"| {PREFILL:,.1f} ({PREFILL:,.1f}-{PREFILL:,.1f}) |" in line
        assert line.endswith(f"| {row['ours_over_llamacpp_decode']:.2f} |")


def test_their_kv_holds_the_precision_of_ours(tmp_path, capsys):
    """--kv-dtype bf16 is compared with llama.cpp's bf16 KV (-ctk, -ctv on every call); without
    it llama-bench runs its default (f16), as the calls of the test above carry no -ctk."""
    binary, log = fake_llama_bench(tmp_path)
    rc = run_bench(tmp_path, "--contexts", "32", "--new-tokens", "2", "--repeats", "1",
                   "--kv-dtype", "bf16", "--vs-llamacpp", binary, "--gguf", fake_gguf(tmp_path))
    assert rc == 0, capsys.readouterr().err
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 3
    for c in calls:
        assert c[c.index("-ctk") + 1] == c[c.index("-ctv") + 1] == "bf16", c


def test_their_flash_attention_settings_each_a_side_and_a_row(tmp_path, capsys):
    """--llamacpp-fa auto,off: every repeat runs llama-bench at its default (no -fa) and with -fa 0,
    each its own prefill and decode call, interleaved with ours; the table has a row for each,
    named."""
    binary, log = fake_llama_bench(tmp_path)
    out = tmp_path / "bench.json"
    rc = run_bench(tmp_path, "--contexts", "32", "--new-tokens", "2", "--repeats", "2",
                   "--json", str(out), "--vs-llamacpp", binary, "--gguf", fake_gguf(tmp_path),
                   "--llamacpp-fa", "auto,off")
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    fa = [c[c.index("-fa") + 1] if "-fa" in c else None for c in calls[1:]]
    # repeat 1: ours, auto, off; repeat 2 reversed: off, auto, ours (two calls a side)
    assert fa == [None, None, "0", "0", "0", "0", None, None], fa
    r = json.loads(out.read_text())
    assert [(row["context"], row["llamacpp_fa"]) for row in r["results"]] == [(32, "auto"),
                                                                              (32, "off")]
    for setting in ("auto", "off"):
        assert any(x.startswith(f"| 32 | none | fp32 / F32 | {setting} |")
                   for x in captured.out.splitlines()), captured.out


@pytest.mark.parametrize("case", ["no gguf", "missing gguf", "not executable", "fails",
                                  "wrong type", "other model", "with vs-hf", "int4 groups",
                                  "bad fa", "fa alone"])
def test_refusals_exit_2_with_one_line(tmp_path, capsys, case):
    binary, _ = fake_llama_bench(tmp_path, fail=case == "fails")
    gguf = fake_gguf(tmp_path, kind="llama ?B Q8_0" if case == "wrong type" else "llama ?B F32",
                     params=TINY_PARAMS * 2 if case == "other model" else TINY_PARAMS)
    if case == "not executable":
        os.chmod(binary, 0o644)
    extra = {"no gguf": [], "missing gguf": ["--gguf", str(tmp_path / "none.gguf")],
             "with vs-hf": ["--gguf", gguf, "--vs-hf"],
             "int4 groups": ["--gguf", gguf, "--quantize", "int4", "--group-size", "64"],
             "bad fa": ["--gguf", gguf, "--llamacpp-fa", "auto,maybe"],
             "fa alone": ["--llamacpp-fa", "off"]}
    vs = [] if case == "fa alone" else ["--vs-llamacpp", binary]
    rc = bench.main(["--device", "cpu", "--threads", "1", "--random-model", TINY,
                     "--ckpt", str(tmp_path / "model"), "--contexts", "32", "--modes", "none",
                     "--repeats", "1", "--offload-dir", str(tmp_path / "kv"),
                     *vs, *extra.get(case, ["--gguf", gguf])])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("bench.py: error:"), err
    words = {"no gguf": "--gguf FILE", "missing gguf": "no such file",
             "not executable": "not an executable", "fails": "invalid parameter",
             "wrong type": "convert the checkpoint to F32", "other model": "parameters",
             "with vs-hf": "drop --vs-hf", "int4 groups": "--group-size 32",
             "bad fa": "--llamacpp-fa auto,maybe", "fa alone": "--llamacpp-fa goes with"}
    assert words[case] in err, err
