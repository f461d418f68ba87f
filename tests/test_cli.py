"""
generate.py and verify.py as a user runs them: the JSON contract, verify's verdict (and the first
differing step it names when a mode differs), what a user is told when an offload cannot take
effect or --max-new-tokens is cut, the default offload directory, and bad input answered with one
line and exit code 2 before any heavy work.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import generate
from ckpt import edit_config
from measure import probe
from model import Transformer
from offload import OffloadConfig, TieredStore
from pools import DISK
from runs import flags, generate_cli, proofs
from runs.task import run_task
from tokenizer import load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = ("The with statement is used to wrap the execution of a block with methods defined by a "
          "context manager.")
TEXT = PROMPT + " "  # to repeat


def main_in_process(argv, capsys):
    """generate.py's main() in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    rc = generate_cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def run_script(name, *args, ok=True):
    """The script `name` in a child process, as a user runs it."""
    p = subprocess.run([sys.executable, os.path.join(ROOT, name), *map(str, args)],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    if ok:
        assert p.returncode == 0, p.stderr
    return p


def test_generate_json_contract(text_ckpt, tmp_path):
    out = run_script("generate.py", "--ckpt", text_ckpt, "--prompt", PROMPT * 3,
                     "--max-new-tokens", 12, "--chunk-size", 16, "--window", 1, "--offload", "disk",
                     "--offload-dir", tmp_path, "--json")
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1
    r = json.loads(lines[0])
    assert set(r) >= {"id", "prompt_ids", "prompt_tokens", "tokens", "text", "stats"}
    assert r["prompt_tokens"] == len(r["prompt_ids"]) > 3 * 16 and len(r["tokens"]) == 12
    st = r["stats"]
    for key in ("prefill_s", "decode_s", "decode_tokens_per_s", "peak_device_bytes",
                "peak_host_rss_bytes"):
        assert st[key] > 0, key
    assert st["bytes"]["disk_write"] > 0 and st["bytes"]["disk_mapped_read"] > 0
    assert st["chunks"]["disk"] > 0
    # the statistics line counts as the JSON does: 12 new tokens, 11 decode steps
    assert st["decoded_tokens"] == 11 and st["prefill_tokens"] == r["prompt_tokens"]
    assert f"prefill {r['prompt_tokens']} tok " in out.stderr, out.stderr
    assert "new 12 tok, decode 11 tok" in out.stderr, out.stderr
    # the same run without offload generates the same tokens
    plain = run_script("generate.py", "--ckpt", text_ckpt, "--prompt", PROMPT * 3,
                       "--max-new-tokens", 12, "--chunk-size", 16, "--offload", "none", "--json")
    plain = json.loads(plain.stdout)
    assert plain["tokens"] == r["tokens"] and plain["stats"]["bytes"]["disk_mapped_read"] == 0


def test_generate_max_length_caps_prompt_plus_new(text_ckpt):
    """Exactly the tokens of a run that never stops at EOS, cut at the first EOS or at 80 positions
    in all."""
    out = run_script("generate.py", "--ckpt", text_ckpt, "--prompt", PROMPT, "--max-length", 80,
                     "--chunk-size", 8, "--offload", "cpu", "--window", 0, "--json")
    r = json.loads(out.stdout)
    tok = load_tokenizer(text_ckpt)
    ids = tok.encode(PROMPT)
    assert r["prompt_ids"] == ids and len(ids) < 80
    model = Transformer.from_pretrained(text_ckpt)
    free, _ = run_task(model, ids, 80 - len(ids), chunk_size=8, cfg=OffloadConfig())
    ends = [i + 1 for i, t in enumerate(free) if t in tok.eos_ids]
    assert r["tokens"] == free[:ends[0] if ends else len(free)]


def test_a_prompt_file_is_read_as_it_is(text_ckpt, tmp_path, capsys):
    """--prompt-file's bytes are the prompt: a BOM is no text, but CRLF line ends stay "\r\n"
    (text mode turned them into "\n", a prompt the tokenizer encodes differently)."""
    f = tmp_path / "crlf.txt"
    f.write_bytes(b"\xef\xbb\xbf" + (PROMPT + "\r\n").encode() * 2)
    rc, out, err = main_in_process(["--ckpt", text_ckpt, "--prompt-file", f, "--max-new-tokens",
                                    1, "--offload", "none", "--json"], capsys)
    assert rc == 0, err
    ids = load_tokenizer(text_ckpt).encode((PROMPT + "\r\n") * 2)
    assert json.loads(out)["prompt_ids"] == ids
    assert ids != load_tokenizer(text_ckpt).encode((PROMPT + "\n") * 2)


def test_a_chat_template_that_renders_nothing_is_named(text_ckpt, tmp_path, capsys):
    ckpt = shutil.copytree(text_ckpt, tmp_path / "ckpt")
    (ckpt / "chat_template.jinja").write_text("{% if false %}{{ messages }}{% endif %}")
    rc, _, err = main_in_process(["--ckpt", ckpt, "--prompt", "hi", "--chat"], capsys)
    assert rc == 2 and "the chat template rendered nothing for this prompt" in err, err


@pytest.mark.parametrize("json_out", [False, True])
def test_stdout_on_a_full_disk_keeps_the_task_to_resume(text_ckpt, tmp_path, json_out):
    """stdout that cannot be written (/dev/full: every write fails with ENOSPC): one sentence
    naming stdout, no traceback, and the task's disk tier kept (the output goes before it does);
    the same command again resumes from it."""
    argv = [sys.executable, os.path.join(ROOT, "generate.py"), "--ckpt", text_ckpt, "--prompt",
            PROMPT * 3, "--max-new-tokens", "8", "--chunk-size", "16", "--offload", "disk",
            "--offload-dir", str(tmp_path / "kv"), *(["--json"] if json_out else [])]
    with open("/dev/full", "w") as full:
        p = subprocess.run(argv, stdout=full, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                           timeout=300)
    task = tmp_path / "kv" / "task_0"
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert ("generate.py: error: cannot write the output to stdout (No space left on device) "
            f"({task} is kept: the same command again resumes from it)") in p.stderr, p.stderr
    assert (task / "manifest.json").is_file()
    p = subprocess.run(argv + ["--json"] * (not json_out), capture_output=True, text=True,
                       cwd=tmp_path, timeout=300)
    assert p.returncode == 0 and json.loads(p.stdout)["stats"]["resumed_from"] > 0, p.stderr


def test_another_prompt_never_recomputes_over_a_kept_run(text_ckpt, tmp_path, capsys):
    """A lone prompt's directory is always task_0: another prompt in the same --offload-dir is
    refused in one sentence while a run of the first is kept there (it recomputed over it, so the
    first command could no longer resume), and the first command still resumes from it."""
    base = ["--ckpt", text_ckpt, "--max-new-tokens", 4, "--chunk-size", 16, "--offload", "disk",
            "--offload-dir", tmp_path / "kv", "--json"]
    rc, out, err = main_in_process([*base, "--prompt", PROMPT * 3, "--keep-cache"], capsys)
    assert rc == 0, err
    task = tmp_path / "kv" / "task_0"
    before = sorted(os.listdir(task))
    rc, _, err = main_in_process([*base, "--prompt", PROMPT * 2], capsys)
    assert rc == 2 and f"{task} holds the run of another prompt" in err, err
    assert sorted(os.listdir(task)) == before
    rc, out, err = main_in_process([*base, "--prompt", PROMPT * 3], capsys)
    assert rc == 0 and json.loads(out)["stats"]["resumed_from"] > 0, err


def test_stdout_that_cannot_encode_a_character_escapes_it(text_ckpt):
    """stdout in ASCII (PYTHONIOENCODING=ascii): a character it cannot encode is written as an
    escape, never a traceback midway; in --json the escape keeps the JSON valid and its text."""
    argv = [sys.executable, os.path.join(ROOT, "generate.py"), "--ckpt", text_ckpt, "--prompt",
            "€ " + PROMPT, "--max-new-tokens", "2", "--offload", "none"]
    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    p = subprocess.run([*argv, "--echo"], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert p.stdout.startswith("\\u20ac "), p.stdout
    p = subprocess.run([*argv, "--json"], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["prompt_ids"] == load_tokenizer(text_ckpt).encode("€ " + PROMPT)


def test_generate_streams_text(text_ckpt):
    """stdout is the generated text alone; --echo prints the prompt before it."""
    argv = ["--ckpt", text_ckpt, "--prompt", PROMPT, "--max-new-tokens", 5, "--chunk-size", 8,
            "--json"]
    tokens = json.loads(run_script("generate.py", *argv).stdout)["tokens"]
    text = load_tokenizer(text_ckpt).decode(tokens)
    plain = run_script("generate.py", *argv[:-1]).stdout
    assert plain == text + "\n", (plain, text)
    echo = run_script("generate.py", *argv[:-1], "--echo").stdout
    assert echo == PROMPT + text + "\n", (echo, text)


def test_help_is_grouped_and_opens_with_what_it_does():
    """--help: one line a user needs first, then the flags under their headings, each flag once,
    every one with its help."""
    help_text = run_script("generate.py", "--help").stdout
    lines = help_text.splitlines()
    assert lines[0].startswith("usage: generate.py") and lines[2].startswith("Generate text"), lines
    headings = [line[:-1] for line in lines if line and not line[0].isspace() and line[-1] == ":"]
    assert headings == ["options", *generate_cli.HELP_GROUPS, "example"], headings
    p = generate_cli.build_parser()
    flags = [a for a in p._actions if a.dest != "help"]
    grouped = [d for dests in generate_cli.HELP_GROUPS.values() for d in dests]
    assert len(grouped) == len(set(grouped)) and {a.dest for a in flags} <= set(grouped)
    listed = [line.split()[0] for line in lines if line.startswith("  --")]
    assert sorted(listed) == sorted(a.option_strings[0] for a in flags)  # each flag listed once
    assert all(a.help for a in flags)
    for dest in ("chunk_size", "window", "offload", "max_new_tokens"):
        action = next(a for a in flags if a.dest == dest)  # the defaults said are the ones used
        said = (f"default {generate_cli.CKPT_DEFAULTS[dest]}; "
                f"{generate_cli.DEMO_DEFAULTS[dest]} in the demo")
        assert said in action.help, action.help


def test_verify_passes_and_reports(text_ckpt, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text(TEXT * 20)
    whole = len(load_tokenizer(text_ckpt).encode(doc.read_text()))
    assert whole > 200
    out = run_script("verify.py", "--ckpt", text_ckpt, "--max-new-tokens", 8, "--chunk-size", 16,
                     "--window", 1, "--max-prompt-tokens", 200, "--offload-dir", tmp_path, "--json",
                     "--prompt-file", doc)
    # the cut is said, with the flag that makes it
    assert f"verify.py: --prompt-file {doc} holds {whole} tokens; verifying its first 200 " \
        "(--max-prompt-tokens 200; raise it to verify more)" in out.stderr.splitlines(), out.stderr
    assert "(default 2048;" in " ".join(proofs.build_parser().format_help().split())
    r = json.loads(out.stdout)
    assert r["ok"] and r["unchunked"]["greedy_ids_equal"]
    assert r["unchunked"]["max_abs_logit_diff"] < 1e-4
    assert all(m["bit_identical"] for m in r["modes"].values())
    assert r["modes"]["disk+zstd"]["bytes"]["disk_read"] > 0
    assert r["modes"]["cpu"]["chunks"]["host"] > 0


# -----------------------------------------------------------------------------
# verify.py's failure path: a store that flips one bit of one chunk on its way back from disk

def test_verify_names_the_first_differing_step(text_ckpt, tmp_path, monkeypatch, capsys):
    C = 16
    steps = []
    flipped = []
    real_forward = generate.forward
    real_load = TieredStore.load

    def forward(model, cache, tokens, decode=False):  # counts steps and where each ended
        logits = real_forward(model, cache, tokens, decode)
        steps.append(cache.length)
        return logits

    def load(self, layer, j):
        kv = real_load(self, layer, j)  # the chunk [2, B, G, C, D]: K at 0, V at 1
        if (layer, j) == (0, 1) and self.loc[(layer, j)] is DISK:
            if not flipped:
                flipped.append(len(steps))  # the step in flight
            kv = kv.clone()
            kv[1].view(torch.int32)[0, 0, 0, 0] ^= 1 << 31  # the sign bit of one value of V
        return kv
    monkeypatch.setattr(generate, "forward", forward)
    monkeypatch.setattr(TieredStore, "load", load)
    rc = proofs.main(["--ckpt", text_ckpt, "--modes", "disk", "--chunk-size", str(C),
                      "--window", "1", "--max-new-tokens", "4", "--max-prompt-tokens", "60",
                      "--offload-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 1 and flipped, out
    step = flipped[0] - len(steps) // 2  # steps counts both runs: --offload none first, then disk
    phase = "prefill" if step < -(-60 // C) else "decode"
    position = steps[flipped[0]] - 1
    assert f"MISMATCH disk: step {step} ({phase}, position {position})" in out, out
    assert "FAILED" in out, out


def test_verify_refuses_or_withholds_a_proof_that_read_no_tier(text_ckpt, tmp_path, capsys):
    """Chunks that leave the device but are never read back prove nothing: a prompt and output
    that fill the window and seal one chunk more after the last step fed (the last token is never
    fed back), a --kv-store prompt with no whole chunk to store, and a disk mode whose chunks
    --cpu-budget keeps in host memory (NOT PROVEN, exit 2); each passed as bit-identical."""
    ids = load_tokenizer(text_ckpt).encode(TEXT * 20)
    C, W = 16, 1
    prompt = tmp_path / "p.txt"
    prompt.write_text(TEXT * 20)
    base = ["--ckpt", text_ckpt, "--chunk-size", str(C), "--window", str(W), "--prompt-file",
            str(prompt), "--offload-dir", str(tmp_path)]
    assert len(ids) > 40
    # 25 + 8 = C * (W + 1) + 1: the chunk that leaves seals after the last step
    rc = proofs.main(base + ["--modes", "cpu", "--max-prompt-tokens", "25",
                             "--max-new-tokens", "8"])
    err = capsys.readouterr().err
    assert rc == 2 and "nothing would be offloaded and read back" in err, err
    rc = proofs.main(base + ["--modes", "cpu", "--max-prompt-tokens", "26",
                             "--max-new-tokens", "8"])
    out = capsys.readouterr().out
    assert rc == 0 and "OK: every mode" in out, out  # one token more: the chunk is read
    rc = proofs.main(base + ["--modes", "cpu", "--max-prompt-tokens", "16",
                             "--max-new-tokens", "40", "--kv-store", str(tmp_path / "store")])
    err = capsys.readouterr().err
    assert rc == 2 and "--kv-store: the prompt (16 tokens) holds no whole chunk" in err, err
    rc = proofs.main(base + ["--modes", "cpu,disk", "--max-prompt-tokens", "60",
                             "--max-new-tokens", "8", "--cpu-budget", "1", "--json"])
    r = json.loads(capsys.readouterr().out)
    assert rc == 2 and not r["ok"] and r["not_proven"] == ["disk"], r
    assert r["modes"]["disk"]["chunks"]["disk"] == 0 and r["modes"]["disk"]["bit_identical"] is None
    assert r["modes"]["cpu"]["bit_identical"] and r["modes"]["cpu"]["bytes"]["host_read"] > 0
    rc = proofs.main(base + ["--modes", "disk", "--max-prompt-tokens", "60",
                             "--max-new-tokens", "8", "--cpu-budget", "1"])
    out = capsys.readouterr().out
    assert rc == 2 and "NOT PROVEN disk: no chunk was read back" in out, out
    assert "disk                     NOT PROVEN" in out and "FAILED" in out, out


@pytest.mark.parametrize("script", ["generate.py", "chat.py"])
def test_a_closed_stdout_is_one_sentence(script, text_ckpt, tmp_path):
    """Started with stdout closed (>&-): one line and exit 2 before any work (a traceback)."""
    p = subprocess.run([sys.executable, os.path.join(ROOT, script), "--ckpt", text_ckpt],
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                       timeout=120, preexec_fn=lambda: os.close(1))
    assert p.returncode == 2 and p.stderr == f"{script}: error: stdout is closed; give the run " \
        "one (> FILE, or > /dev/null)\n", p.stderr


# -----------------------------------------------------------------------------
# what a user is told

def test_offload_that_never_takes_effect_is_said_once(text_ckpt, tmp_path, capsys):
    rc, _, err = main_in_process(["--ckpt", text_ckpt, "--prompt", TEXT, "--offload", "disk",
                                  "--offload-dir", tmp_path, "--chunk-size", 512,
                                  "--max-new-tokens", 3, "--json"], capsys)
    assert rc == 0
    lines = [line for line in err.splitlines() if "nothing left the device" in line]
    # per layer, not the total over the 2 layers
    assert len(lines) == 1 and "--window" in lines[0] and "(1 chunk per layer" in lines[0], err
    rc, _, err = main_in_process(["--ckpt", text_ckpt, "--prompt", TEXT * 3, "--offload", "disk",
                                  "--offload-dir", tmp_path, "--chunk-size", 8, "--window", 1,
                                  "--max-new-tokens", 3, "--json"], capsys)
    # a negative control: here chunks do leave
    assert rc == 0 and "nothing left the device" not in err, err


def test_max_new_tokens_cut_to_the_context_warns(text_ckpt, tmp_path, capsys):
    short = tmp_path / "short"
    shutil.copytree(text_ckpt, short)
    edit_config(short, max_position_embeddings=96)  # the model's own context: 96 positions
    rc, out, err = main_in_process(["--ckpt", short, "--prompt", TEXT, "--max-new-tokens", 500,
                                    "--chunk-size", 8, "--json"], capsys)
    assert rc == 0, err
    r = json.loads(out)
    cut = 96 - r["prompt_tokens"]
    warnings = [line for line in err.splitlines()
                if line.startswith("warning: --max-new-tokens 500 cut to")]
    assert len(warnings) == 1, err
    assert f"cut to {cut}" in warnings[0] and "model's context" in warnings[0], err
    assert len(r["tokens"]) <= cut


def test_default_offload_dir_is_in_help_and_not_left_behind(text_ckpt, tmp_path):
    help_text = run_script("generate.py", "--help").stdout
    assert "./kv_cache_offload" in help_text and "appended" in help_text
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, os.path.join(ROOT, "generate.py"), "--ckpt", text_ckpt,
                        "--prompt", TEXT * 2, "--offload", "disk", "--chunk-size", "8",
                        "--window", "1", "--max-new-tokens", "2"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert not (tmp_path / "kv_cache_offload").exists(), os.listdir(tmp_path / "kv_cache_offload")


def test_no_empty_offload_dir_is_left_behind_on_any_exit(text_ckpt, tmp_path, monkeypatch,
                                                         capsys):
    """./kv_cache_offload, made by a run that writes the disk, is gone when the run ends (verify.py
    passing, probe.py refusing a context), or never made (generate.py refusing an unreadable
    --prompt-file, or a --tp that the torchrun world does not divide, before any process group);
    one that was there before the run stays."""
    monkeypatch.chdir(tmp_path)
    default = tmp_path / "kv_cache_offload"
    existed = []  # whether the directory was there when each run cleaned up

    def spy(args):
        existed.append(os.path.isdir(args.offload_dir))
        real(args)
    real = flags.remove_created_offload_dir
    for module in (generate_cli, proofs, probe):
        monkeypatch.setattr(module, "remove_created_offload_dir", spy)
    assert proofs.main(["--ckpt", text_ckpt, "--modes", "disk", "--chunk-size", "8", "--window",
                        "1", "--max-new-tokens", "2", "--max-prompt-tokens", "40"]) == 0
    rc, _, err = main_in_process(["--ckpt", text_ckpt, "--offload", "disk", "--prompt-file",
                                  tmp_path / "missing.txt"], capsys)
    assert rc == 2 and "--prompt-file" in err, err
    assert probe.main(["--ckpt", text_ckpt, "--contexts", "99999"]) == 2
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    rc, _, err = main_in_process(["--ckpt", text_ckpt, "--offload", "disk", "--tp", 2], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "--tp 2 does not divide the 3 ranks" in err and not torch.distributed.is_initialized()
    assert existed == [True, False, True, False] and not default.exists()
    monkeypatch.delenv("WORLD_SIZE")
    default.mkdir()  # the user's own: kept
    rc, _, _ = main_in_process(["--ckpt", text_ckpt, "--offload", "disk", "--prompt-file",
                                tmp_path / "missing.txt"], capsys)
    assert rc == 2 and default.is_dir()


# -----------------------------------------------------------------------------
# bad input: one line, exit code 2

def assert_one_line_error(p, *needles):
    assert p.returncode == 2, (p.returncode, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.mark.parametrize("script", ["generate.py", "verify.py"])
def test_offload_dir_that_cannot_be_created(text_ckpt, tmp_path, script):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    offload = ["--offload", "disk"] if script == "generate.py" else []
    p = run_script(script, "--ckpt", text_ckpt, "--offload-dir", blocker / "sub", "--chunk-size", 8,
                   *offload, ok=False)
    assert_one_line_error(p, "--offload-dir")


@pytest.mark.parametrize("script", ["generate.py", "verify.py"])
@pytest.mark.parametrize("size", [0, -3])
def test_chunk_size_must_be_positive(text_ckpt, script, size):
    p = run_script(script, "--ckpt", text_ckpt, "--chunk-size", size, ok=False)
    assert_one_line_error(p, "--chunk-size")


def test_group_buffers_must_not_be_negative(text_ckpt):
    p = run_script("generate.py", "--ckpt", text_ckpt, "--group-buffers", -1, ok=False)
    assert_one_line_error(p, "--group-buffers")


def test_prompt_longer_than_model_maximum(text_ckpt, tmp_path):
    f = tmp_path / "long.txt"
    f.write_text(PROMPT * 200)  # well past max_position_embeddings=2048
    p = run_script("generate.py", "--ckpt", text_ckpt, "--prompt-file", f, ok=False)
    assert_one_line_error(p, "2048")


def test_bad_checkpoint_and_files(tmp_path, text_ckpt):
    p = run_script("generate.py", "--ckpt", tmp_path / "nowhere", ok=False)
    assert_one_line_error(p, "--ckpt")
    p = run_script("generate.py", "--ckpt", text_ckpt, "--prompt-file", tmp_path / "missing.txt",
                   ok=False)
    assert_one_line_error(p, "--prompt-file")
    p = run_script("generate.py", "--ckpt", text_ckpt, "--compress", "zstd", "--offload", "cpu",
                   ok=False)
    assert_one_line_error(p, "--compress")
    p = run_script("verify.py", "--ckpt", text_ckpt, "--modes", "cpu,tape", ok=False)
    assert_one_line_error(p, "--modes")


def test_refused_before_loading_a_ckpt_file_and_a_host_budget_too_small(text_ckpt, monkeypatch,
                                                                      capsys):
    """--ckpt naming config.json says it is a file; a --cpu-budget that cannot hold what
    --offload cpu offloads (plan_tiers knows it from the lengths) is exit 2 before any weight is
    read, with the store's sentence and no blank line."""
    argv = ["--ckpt", text_ckpt, "--prompt", TEXT * 4, "--offload", "cpu", "--chunk-size", 8,
            "--window", 1, "--max-new-tokens", 2]
    rc, out, err = main_in_process(argv + ["--cpu-budget", "1", "--json"], capsys)
    assert rc == 0, err
    offloaded = json.loads(out)["stats"]["chunks"]["host"]  # what the store placed, room for all

    def no_load(*args, **kw):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr(generate_cli.launch, "load", no_load)
    rc, out, err = main_in_process(argv + ["--cpu-budget", "1e-6"], capsys)
    assert rc == 2 and out == "" and len(err.splitlines()) == 1, (out, err)
    assert err.startswith(f"generate.py: error: --cpu-budget 1e-06 GiB holds 0 of the {offloaded} "
                          "chunks this task offloads"), err
    config = os.path.join(text_ckpt, "config.json")
    rc, out, err = main_in_process(["--ckpt", config, "--prompt", PROMPT], capsys)
    assert rc == 2 and err.splitlines() == [
        f"generate.py: error: --ckpt {config}: is a file; give the checkpoint's directory, the "
        f"one holding config.json ({text_ckpt})"], err


def test_a_selection_that_reads_everything_says_so_once(text_ckpt, tmp_path, capsys):
    """--select quest whose budget, with the first chunk and the window, covers every sealed chunk
    changes nothing: one line says so, and the output is indeed --select all's; a budget that
    leaves chunks out says nothing."""
    argv = ["--ckpt", text_ckpt, "--prompt", TEXT * 6, "--chunk-size", 16, "--window", 1,
            "--max-new-tokens", 4, "--json"]
    rc, out, err = main_in_process(argv, capsys)
    assert rc == 0 and "--select" not in err, err
    exact = json.loads(out)["tokens"]
    rc, out, err = main_in_process(argv + ["--select", "quest", "--select-budget", 4096], capsys)
    assert rc == 0, err
    said = [line for line in err.splitlines() if "--select quest" in line]
    assert len(said) == 1 and "read every sealed chunk" in said[0], err
    assert "so the output is --select all's; lower --select-budget" in said[0], said
    assert json.loads(out)["tokens"] == exact
    rc, out, err = main_in_process(argv + ["--select", "quest", "--select-budget", 16], capsys)
    assert rc == 0 and "--select quest" not in err, err
    assert json.loads(out)["stats"]["bytes"]["select_skipped"] > 0


# -----------------------------------------------------------------------------
# round three of what a new user trips over: devices, bytes, pipes, parents, NaN

@pytest.mark.parametrize("device", ["tpu", "cpu:1"])
def test_device_must_be_cpu_or_cuda(text_ckpt, device):
    p = run_script("generate.py", "--ckpt", text_ckpt, "--device", device, ok=False)
    assert_one_line_error(p, "--device", "cpu, cuda or cuda:N")


def test_a_prompt_that_is_not_utf8_is_refused(text_ckpt):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "generate.py"), "--ckpt", text_ckpt,
                        "--prompt", b"caf\xe9"], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert_one_line_error(p, "--prompt", "not UTF-8")


def test_offload_dir_parents_made_by_a_run_go_with_it(text_ckpt, tmp_path, capsys):
    rc, _, err = main_in_process(["--ckpt", text_ckpt, "--prompt", TEXT * 2, "--offload", "disk",
                                  "--chunk-size", 8, "--window", 1, "--max-new-tokens", 2,
                                  "--offload-dir", tmp_path / "deep" / "a" / "b"], capsys)
    assert rc == 0 and not (tmp_path / "deep").exists(), (err, os.listdir(tmp_path))
    rc, _, err = main_in_process(["--ckpt", text_ckpt, "--offload", "disk", "--offload-dir", ""],
                                 capsys)
    assert rc == 2 and "--offload-dir is empty" in err, err


def test_a_closed_stdout_ends_the_run_quietly(text_ckpt, tmp_path):
    """`generate.py ... | head`: the reader gone, the run stops with 141 (as SIGPIPE would end it),
    one line and no traceback, and leaves no task to resume in ./kv_cache_offload."""
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, "generate.py"), "--ckpt", text_ckpt,
                          "--prompt", TEXT * 2, "--offload", "disk", "--chunk-size", "8",
                          "--window", "1", "--max-new-tokens", "40", "--threads", "1"],
                         cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # before the first token: its write fails
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141, err
    assert "broken pipe" in err and "Traceback" not in err, err
    assert not (tmp_path / "kv_cache_offload").exists()


def test_nan_logits_compare_by_their_bits():
    """verify.py compares the bits: a model that overflows (NaN logits) is identical to itself,
    and one NaN against another value still differs."""
    import verify
    nan = torch.tensor([1.0, float("nan"), 3.0])
    run = ([5], [(0, "prefill", nan.clone()), (1, "decode", nan.clone())], {})
    assert verify.compare(run, ([5], [(0, "prefill", nan.clone()), (1, "decode", nan.clone())],
                                {})) is None
    other = nan.clone()
    other[1] = 2.0
    diff = verify.compare(run, ([5], [(0, "prefill", nan.clone()), (1, "decode", other)], {}))
    assert diff is not None and diff[:3] == (1, 1, "decode")
    assert not verify.same_bits(torch.zeros(2), -torch.zeros(2))  # -0.0 is other bits


def test_a_thread_count_that_is_not_one_is_refused(text_ckpt):
    """OMP_NUM_THREADS that libgomp ignores would leave torch on every core, busy or not; and
    --products compiled with --quantize would build products no linear runs."""
    env = {**os.environ, "OMP_NUM_THREADS": "abc"}
    p = subprocess.run([sys.executable, os.path.join(ROOT, "generate.py"), "--ckpt", text_ckpt,
                        "--max-new-tokens", "2"], capture_output=True, text=True, cwd=ROOT,
                       env=env, timeout=120)
    err = "\n".join(line for line in p.stderr.splitlines() if not line.startswith("libgomp"))
    assert p.returncode == 2 and "OMP_NUM_THREADS='abc'" in err and "Traceback" not in err, err
    p = run_script("generate.py", "--ckpt", text_ckpt, "--quantize", "int8", "--products",
                   "compiled", ok=False)
    assert_one_line_error(p, "--products compiled", "--quantize")
