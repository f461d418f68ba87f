"""
generate.py and verify.py as a user runs them: the JSON contract, verify's verdict, and bad input answered with
one line and exit code 2 before any heavy work.
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "The with statement is used to wrap the execution of a block with methods defined by a context manager."


def cli(script, *args, ok=True):
    p = subprocess.run([sys.executable, os.path.join(ROOT, script), *map(str, args)], capture_output=True, text=True,
                       cwd=ROOT, timeout=300)
    if ok:
        assert p.returncode == 0, p.stderr
    return p


def test_generate_json_contract(text_ckpt, tmp_path):
    out = cli("generate.py", "--ckpt", text_ckpt, "--prompt", PROMPT * 3, "--max-new-tokens", 12, "--chunk-size", 16,
              "--window", 1, "--offload", "disk", "--offload-dir", tmp_path, "--json")
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1
    r = json.loads(lines[0])
    assert set(r) >= {"id", "prompt_ids", "prompt_tokens", "tokens", "text", "stats"}
    assert r["prompt_tokens"] == len(r["prompt_ids"]) > 3 * 16 and len(r["tokens"]) == 12
    st = r["stats"]
    for key in ("prefill_s", "decode_s", "decode_tokens_per_s", "peak_device_bytes", "peak_host_rss_bytes"):
        assert st[key] > 0, key
    assert st["bytes"]["disk_write"] > 0 and st["bytes"]["disk_mapped_read"] > 0 and st["chunks"]["disk"] > 0
    assert "tok/s" in out.stderr
    # the same run without offload generates the same tokens
    plain = json.loads(cli("generate.py", "--ckpt", text_ckpt, "--prompt", PROMPT * 3, "--max-new-tokens", 12,
                           "--chunk-size", 16, "--offload", "none", "--json").stdout)
    assert plain["tokens"] == r["tokens"] and plain["stats"]["bytes"]["disk_mapped_read"] == 0


def test_generate_max_length_caps_prompt_plus_new(text_ckpt):
    """Exactly the tokens of a run that never stops at EOS, cut at the first EOS or at 80 positions in all."""
    from model import Transformer
    from offload import OffloadConfig
    from task import run_task
    from tokenizer import load_tokenizer
    r = json.loads(cli("generate.py", "--ckpt", text_ckpt, "--prompt", PROMPT, "--max-length", 80, "--chunk-size", 8,
                       "--offload", "cpu", "--window", 0, "--json").stdout)
    tok = load_tokenizer(text_ckpt)
    ids = tok.encode(PROMPT)
    assert r["prompt_ids"] == ids and len(ids) < 80
    free, _ = run_task(Transformer.from_pretrained(text_ckpt), ids, 80 - len(ids), chunk_size=8, cfg=OffloadConfig())
    ends = [i + 1 for i, t in enumerate(free) if t in tok.eos_ids]
    assert r["tokens"] == free[:ends[0] if ends else len(free)]


def test_generate_streams_text(text_ckpt):
    out = cli("generate.py", "--ckpt", text_ckpt, "--prompt", PROMPT, "--max-new-tokens", 5, "--chunk-size", 8)
    assert out.stdout.startswith(PROMPT) and len(out.stdout) > len(PROMPT)


def test_verify_passes_and_reports(text_ckpt, tmp_path):
    out = cli("verify.py", "--ckpt", text_ckpt, "--max-new-tokens", 8, "--chunk-size", 16, "--window", 1,
              "--max-prompt-tokens", 200, "--offload-dir", tmp_path, "--json")
    r = json.loads(out.stdout)
    assert r["ok"] and r["unchunked"]["greedy_ids_equal"] and r["unchunked"]["max_abs_logit_diff"] < 1e-4
    assert all(m["bit_identical"] for m in r["modes"].values())
    assert r["modes"]["disk+zstd"]["bytes"]["disk_read"] > 0 and r["modes"]["cpu"]["chunks"]["host"] > 0


def _one_line_error(p, *needles):
    assert p.returncode == 2, (p.returncode, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.mark.parametrize("script", ["generate.py", "verify.py"])
def test_offload_dir_that_cannot_be_created(text_ckpt, tmp_path, script):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    p = cli(script, "--ckpt", text_ckpt, "--offload-dir", blocker / "sub", "--chunk-size", 8,
            *(["--offload", "disk"] if script == "generate.py" else []), ok=False)
    _one_line_error(p, "--offload-dir")


@pytest.mark.parametrize("script", ["generate.py", "verify.py"])
@pytest.mark.parametrize("size", [0, -3])
def test_chunk_size_must_be_positive(text_ckpt, script, size):
    _one_line_error(cli(script, "--ckpt", text_ckpt, "--chunk-size", size, ok=False), "--chunk-size")


def test_prompt_longer_than_model_maximum(text_ckpt, tmp_path):
    f = tmp_path / "long.txt"
    f.write_text(PROMPT * 200)  # well past max_position_embeddings=2048
    _one_line_error(cli("generate.py", "--ckpt", text_ckpt, "--prompt-file", f, ok=False), "2048")


def test_bad_checkpoint_and_files(tmp_path, text_ckpt):
    _one_line_error(cli("generate.py", "--ckpt", tmp_path / "nowhere", ok=False), "--ckpt")
    _one_line_error(cli("generate.py", "--ckpt", text_ckpt, "--prompt-file", tmp_path / "missing.txt", ok=False),
                    "--prompt-file")
    _one_line_error(cli("generate.py", "--ckpt", text_ckpt, "--compress", "zstd", "--offload", "cpu", ok=False),
                    "--compress")
    _one_line_error(cli("verify.py", "--ckpt", text_ckpt, "--modes", "cpu,tape", ok=False), "--modes")
