"""
Input that is too large, of the wrong type or out of range (issue 25, cases 3 to 8): sizes checked
against the weights' own headers and the task's length before any work, every bad JSONL line
skipped alone, number flags without inf or nan, config.json fields by type and range, chat
templates that fail or try to allocate without bound, shard paths outside the checkpoint, task ids
that would share a directory, and a KV store with several bad entries. Each case ends in exit code 2
and one line (no traceback), or in the output of a clean run.

generate.py's main() runs in this process (generate_cli.main) on the tiny sentencepiece checkpoint.
"""
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
from contextlib import redirect_stdout

import pytest
import torch

from checkpoint import CheckpointError
from generate import generate
from kvcache import make_cache
from model import Transformer
from offload import OffloadConfig, TieredStore
from runs import generate_cli
from runs.kvstore import KVStore
from runs.task import run_task
from runs.taskdir import model_fingerprint, safe_task_name
from test_cli import PROMPT

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ["--max-new-tokens", 6, "--chunk-size", 16, "--json"]


def main(argv, capsys):
    """generate_cli.main in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    rc = generate_cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def one_line(err, *words):
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in lines[0], (w, lines[0])


@pytest.fixture(scope="module")
def clean_tokens(text_ckpt):
    """The tokens of generate.py on PROMPT with BASE and no offload."""
    with redirect_stdout(io.StringIO()) as out:
        argv = [str(a) for a in ["--ckpt", text_ckpt, "--prompt", PROMPT, *BASE]]
        assert generate_cli.main(argv) == 0
    return json.loads(out.getvalue())["tokens"]


def copy_ckpt(text_ckpt, tmp_path):
    return shutil.copytree(text_ckpt, tmp_path / "ckpt")


def set_config(ckpt, **changes):
    """Set top-level fields of config.json (None writes null)."""
    path = ckpt / "config.json"
    hf_config = json.loads(path.read_text())
    hf_config.update(changes)
    path.write_text(json.dumps(hf_config))


# -----------------------------------------------------------------------------
# case 3: sizes bounded before work

def test_layer_count_past_the_weights_is_refused_before_building(text_ckpt, tmp_path, capsys):
    """num_hidden_layers 10**9 would build 10**9 layers (minutes, GiBs) before any tensor is
    read: the safetensors header refuses it first, in generate.py and in from_pretrained."""
    ckpt = copy_ckpt(text_ckpt, tmp_path)
    set_config(ckpt, num_hidden_layers=10**9)
    rc, _, err = main(["--ckpt", ckpt, "--prompt", PROMPT, *BASE], capsys)
    assert rc == 2
    one_line(err, "config.json", "num_hidden_layers", "1000000000", "2 layers")
    with pytest.raises(CheckpointError, match="num_hidden_layers"):
        Transformer.from_pretrained(str(ckpt))


@pytest.mark.parametrize("flags", [["--chunk-size", 10**9], ["--chunk-size", 10**6],
                                   ["--staging-slots", 10**9, "--compress", "zstd"]])
def test_chunk_size_and_staging_slots_are_bounded_by_the_task(text_ckpt, tmp_path, capsys,
                                                              clean_tokens, flags):
    """A chunk longer than the task is cut to the task's length, and staging slots to the chunks
    it has: the run gives the clean run's tokens and reserves disk for the task's positions only."""
    off = tmp_path / "off"
    argv = ["--ckpt", text_ckpt, "--prompt", PROMPT, *BASE, "--offload", "disk", "--window", 0,
            "--offload-dir", off, "--keep-cache", *flags]
    rc, out, err = main(argv, capsys)
    assert rc == 0, err
    result = json.loads(out)
    assert result["tokens"] == clean_tokens
    n_positions = result["prompt_tokens"] + 6
    hf_config = json.loads(open(os.path.join(text_ckpt, "config.json")).read())
    kv_heads = hf_config["num_key_value_heads"]
    head_dim = hf_config["hidden_size"] // hf_config["num_attention_heads"]
    # the task's positions (rounded up to a chunk of 16, and to a page) of K and V in fp32
    most = (n_positions + 16) * 2 * kv_heads * head_dim * 4 + 4096
    for name in os.listdir(off / safe_task_name("0")):
        assert os.path.getsize(off / safe_task_name("0") / name) <= most, name


def test_a_chunk_cut_to_the_task_computes_what_the_uncut_chunk_does(llama_ckpt):
    """The reference is the uncut path: a cache whose one chunk is longer than the task, built
    directly (run_task cuts it)."""
    model = Transformer.from_pretrained(llama_ckpt)
    ids = torch.randint(3, 128, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    cache = make_cache(model, OffloadConfig(), 1000, 30 + 10)
    want = generate(model, cache, torch.tensor([ids]), 10)
    got, _ = run_task(model, ids, 10, chunk_size=10**9, cfg=OffloadConfig())
    assert got == want


def test_staging_slots_never_exceed_the_chunks_of_the_task(tmp_path):
    cfg = OffloadConfig(mode="disk", compress="zstd", staging_slots=10**9,
                        offload_dir=str(tmp_path / "off"))
    store = TieredStore(shape=(2, 1, 2, 8, 16), dtype=torch.float32, n_layers=3, max_length=40,
                        device="cpu", cfg=cfg)
    try:
        assert len(store.staging.slots) == 3 * 5  # layers x chunks of 40 positions
    finally:
        store.close()


# -----------------------------------------------------------------------------
# case 4: one bad JSONL line skips that line only

def good(task_id):
    return json.dumps({"id": task_id, "prompt": PROMPT, "max_new_tokens": 2}).encode()


BAD_LINES = [
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"id": "n", "prompt": "x", "seed": ' + b"9" * 5000 + b"}", "thousands of digits"),
    (b'{"id": "u", "prompt": "caf\xe9"}', "not valid UTF-8"),
    (b'{"id": "\\ud800", "prompt": "x"}', "lone surrogate"),
    (b'{"id": "s", "prompt": "a\\udfffb"}', "lone surrogate"),
    (b'{"id": "t1", "prompt": "x", "temperature": NaN}', "field 'temperature' is NaN"),
    (b'{"id": "t2", "prompt": "x", "temperature": Infinity}', "field 'temperature' is Infinity"),
    (b'{"id": "t3", "prompt": "x", "temperature": -Infinity}', "'temperature' is -Infinity"),
    (b'{"id": "t6", "messages": [{"role": "user", "content": NaN}]}',
     "field 'messages.0.content' is NaN"),
    (b'{"id": "t4", "prompt": "x", "temperature": 1e400}', "temperature"),
    (b'{"id": "t5", "prompt": "x", "temperature": ' + b"9" * 400 + b"}", "temperature"),
    (b'{"id": "t7", "prompt": "x", "temperature": 1e-40}', "temperature 0 (greedy) or"),
    (b'{"id": "s1", "prompt": "x", "seed": ' + b"1" + b"0" * 29 + b"}", "seed"),
    (b'{"id": "s2", "prompt": "x", "seed": -' + b"1" + b"0" * 29 + b"}", "seed"),
    (b"null", "not a JSON object"),
]


def test_every_bad_line_is_skipped_alone(text_ckpt, tmp_path, capsys):
    tasks = tmp_path / "tasks.jsonl"
    lines = [good("first")] + [line for line, _ in BAD_LINES] + [good("last")]
    tasks.write_bytes(b"\n".join(lines) + b"\n")
    output = tmp_path / "results.jsonl"
    rc, _, err = main(["--ckpt", text_ckpt, "--prompts", tasks, "--output", output,
                       "--offload-dir", tmp_path / "off", "--chunk-size", 16], capsys)
    assert rc == 1  # some lines failed; the batch went on
    assert "Traceback" not in err
    for n, (_, words) in enumerate(BAD_LINES, 2):
        said = [line for line in err.splitlines() if f"{tasks} line {n}:" in line]
        assert said and all(words in s and "skipped" in s for s in said), (n, words, err)
    done = [json.loads(line)["id"] for line in output.read_text().splitlines()]
    assert sorted(done) == ["first", "last"]  # tasks of a batch finish in any order


# -----------------------------------------------------------------------------
# case 5: number flags

@pytest.mark.parametrize("flags,name", [
    (["--cpu-budget", "inf"], "--cpu-budget"),
    (["--cpu-budget", "nan"], "--cpu-budget"),
    (["--kv-store", "STORE", "--kv-store-budget", "inf"], "--kv-store-budget"),
    (["--kv-store", "STORE", "--kv-store-budget", "nan"], "--kv-store-budget"),
    (["--rope-scaling", "yarn", "--rope-factor", "inf"], "--rope-factor"),
    (["--rope-scaling", "yarn", "--rope-factor", "nan"], "--rope-factor"),
    (["--rope-scaling", "yarn"], "--rope-factor"),
    (["--seed", str(10**30), "--temperature", "0.7"], "--seed"),
    (["--seed", str(-10**30), "--temperature", "0.7"], "--seed"),
    (["--temperature", "nan"], "--temperature"),
    (["--temperature", "inf"], "--temperature"),
    (["--temperature", "1e-40"], "--temperature must be 0 (greedy) or a number >= 1e-6"),
    (["--top-p", "nan"], "--top-p"),
    (["--fallback-cpu-budget", "inf"], "--fallback-cpu-budget"),
    (["--fallback-cpu-budget", "nan"], "--fallback-cpu-budget"),
])
def test_number_flags_refuse_inf_nan_and_out_of_range(text_ckpt, tmp_path, capsys, flags, name):
    flags = [str(tmp_path / "store") if f == "STORE" else f for f in flags]
    rc, _, err = main(["--ckpt", text_ckpt, "--prompt", PROMPT, *BASE, "--offload", "cpu",
                       *flags], capsys)
    assert rc == 2
    one_line(err, name)


# -----------------------------------------------------------------------------
# case 6: config.json fields by type and range

@pytest.mark.parametrize("field,value", [
    ("max_position_embeddings", "x"),
    ("max_position_embeddings", None),
    ("num_key_value_heads", "2"),
    ("num_key_value_heads", -1),
    ("head_dim", "64"),
    ("head_dim", -64),
    ("head_dim", 15),
    ("rms_norm_eps", "x"),
    ("rms_norm_eps", None),
    ("hidden_size", 64.0),
    ("hidden_size", True),
    ("bos_token_id", "x"),
    ("bos_token_id", 10**9),
    ("eos_token_id", [[2]]),
    ("eos_token_id", "2"),
    ("tie_word_embeddings", "false"),
    ("attention_bias", 0),
    ("rope_theta", "x"),
    ("rope_scaling", "linear"),
    ("rope_parameters", {"rope_type": "linear", "factor": "2"}),
    ("sliding_window", "4096"),
    ("num_local_experts", "8"),
])
def test_config_field_of_the_wrong_type_or_range_is_named(text_ckpt, tmp_path, capsys, field,
                                                          value):
    ckpt = copy_ckpt(text_ckpt, tmp_path)
    set_config(ckpt, **{field: value})
    rc, _, err = main(["--ckpt", ckpt, "--prompt", PROMPT, *BASE], capsys)
    assert rc == 2
    one_line(err, "config.json", field)


def test_config_nested_too_deeply_is_one_line(text_ckpt, tmp_path, capsys):
    ckpt = copy_ckpt(text_ckpt, tmp_path)
    hf_config = (ckpt / "config.json").read_text()
    (ckpt / "config.json").write_text(hf_config[:-1] + ', "x": ' + "[" * 100_000
                                      + "]" * 100_000 + "}")
    rc, _, err = main(["--ckpt", ckpt, "--prompt", PROMPT, *BASE], capsys)
    assert rc == 2
    one_line(err, "config.json", "not valid JSON")


def test_tie_word_embeddings_false_as_a_bool_still_loads(text_ckpt, tmp_path, capsys,
                                                         clean_tokens):
    """The control: the same field as a JSON bool is read as before."""
    ckpt = copy_ckpt(text_ckpt, tmp_path)
    set_config(ckpt, tie_word_embeddings=False)
    rc, out, err = main(["--ckpt", ckpt, "--prompt", PROMPT, *BASE], capsys)
    assert rc == 0, err
    assert json.loads(out)["tokens"] == clean_tokens


# -----------------------------------------------------------------------------
# case 7: chat templates

USER = "{% for m in messages %}{{ m.content }}{% endfor %}"
TEMPLATES = {
    "range": "{% for i in range(10**8) %}x{% endfor %}" + USER,
    "division by zero": "{{ 1//0 }}" + USER,
    "include": "{% include 'other.jinja' %}" + USER,
    "repetition": "{{ 'a' * 10**9 }}" + USER,
    "power": "{{ 2 ** (10**9) }}" + USER,
    "width": "{{ 'a'|center(10**9) }}" + USER,
    "format width": "{{ '{:>1000000000}'.format('a') }}" + USER,
    "doubling": ("{% set ns = namespace(s='a') %}{% for i in range(40) %}"
                 "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}" + USER),
    "recursion": ("{% macro f(s, n) %}{{ f(s ~ s, n - 1) if n else s|length }}{% endmacro %}"
                  "{{ f('a', 40) }}" + USER),
    "long output": ("{% for i in range(100000) %}{% for j in range(1000) %}"
                    "xxxxxxxxxxxxxxxxxxxx{% endfor %}{% endfor %}" + USER),
    "endless macro": "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}" + USER,
}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_bad_chat_template_is_one_sentence(text_ckpt, tmp_path, capsys, name):
    ckpt = copy_ckpt(text_ckpt, tmp_path)
    (ckpt / "chat_template.jinja").write_text(TEMPLATES[name])
    rc, _, err = main(["--ckpt", ckpt, "--prompt", PROMPT, "--chat", *BASE], capsys)
    assert rc == 2
    one_line(err, "chat template")


def test_a_template_cannot_allocate_much(tmp_path):
    """In a child process that does nothing else, rendering each bad template keeps the peak
    resident memory (VmHWM: this process image's own, where ru_maxrss would count the parent's
    before exec) far below the GiB that 'a' * 10**9 alone would take."""
    if not os.path.exists("/proc/self/status"):
        pytest.skip("needs Linux's /proc/self/status")
    code = f"""
import json, sys
sys.path.insert(0, {ROOT!r})
from tokenizer import compile_template, render
for source in json.loads(sys.argv[1]):
    try:
        render(compile_template(source), messages=[{{"role": "user", "content": "hi"}}])
    except Exception:
        pass
with open("/proc/self/status") as f:
    print(next(line.split()[1] for line in f if line.startswith("VmHWM:")))
"""
    p = subprocess.run([sys.executable, "-c", code, json.dumps(list(TEMPLATES.values()))],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    peak_mib = int(p.stdout) / 1024
    assert peak_mib < 300, peak_mib


# -----------------------------------------------------------------------------
# case 8: shard paths, task ids, the KV store's bad entries

@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/hostname",
                                   "sub/../../outside.safetensors"])
def test_shard_outside_the_checkpoint_is_refused(checkpoint, tmp_path, shard):
    ckpt = shutil.copytree(checkpoint(shard_size="100KB"), tmp_path / "ckpt")
    shutil.copy(ckpt / os.listdir(ckpt)[0], tmp_path / "outside.safetensors")
    index = ckpt / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    first = next(iter(data["weight_map"]))
    data["weight_map"][first] = shard
    index.write_text(json.dumps(data))
    for load in (Transformer.from_pretrained, model_fingerprint):
        with pytest.raises(CheckpointError, match="outside the checkpoint directory") as e:
            load(str(ckpt))
        assert "\n" not in str(e.value)


def test_two_ids_never_share_a_task_directory():
    plain = "a_b"
    escaped = "a/b"
    # a plain id spelled like an escaped one, down to its hash
    forged = "a_b+" + hashlib.sha256(b"a/b").hexdigest()[:32]
    ids = [plain, escaped, forged, "A", "a", "Ab", "aB", "x" * 80, "x" * 81, "x" * 80 + "y", "",
           ".", "..", "a\x00b", "a b", "a_b_", "\ud800"]
    names = [safe_task_name(i) for i in ids]
    assert len(set(names)) == len(ids), names
    # and on a file system that ignores case
    assert len({n.lower() for n in names}) == len(ids), names
    for n in names:
        assert "/" not in n and "\x00" not in n and n not in (".", "..") and len(n) < 200


def test_kv_store_repairs_every_bad_entry_and_reports_each(text_ckpt, tmp_path, capsys):
    """Two of a prompt's stored chunks damaged: the run that meets them reports each in one line,
    replaces both (not only the first), and gives the clean output; the next run reuses every
    chunk."""
    store = tmp_path / "store"
    argv = ["--ckpt", text_ckpt, "--prompt", PROMPT * 4, "--max-new-tokens", 4,
            "--chunk-size", 16, "--json", "--kv-store", store]
    rc, out, err = main(argv, capsys)
    assert rc == 0, err
    clean = json.loads(out)["tokens"]
    entries = sorted(KVStore(str(store)).entries(), key=lambda e: e[2])  # written in order
    assert len(entries) >= 4
    damaged = [entries[1][0], entries[3][0]]
    for key in damaged:
        path = store / f"{key}.kv"
        data = bytearray(path.read_bytes())
        data[-10] ^= 0xFF
        path.write_bytes(bytes(data))
    rc, out, err = main(argv, capsys)
    assert rc == 0, err
    assert json.loads(out)["tokens"] == clean
    for key in damaged:
        said = [line for line in err.splitlines() if key in line]
        assert len(said) == 1 and "checksum" in said[0] and "removed" in said[0], err
    rc, out, err = main(argv, capsys)
    r = json.loads(out)
    assert r["tokens"] == clean and r["stats"]["reused_tokens"] == len(entries) * 16
    assert not any(key in err for key in damaged), err
