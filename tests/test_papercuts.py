"""
What a new user trips over, each fixed and held here: the host fallback that must not change normal placement,
the offload that cannot take effect because the context fits the window, warnings for a cut --max-new-tokens,
the default offload dir left behind, probe.py as a command, model(tokens, cache) across a chunk boundary, and a
resumed task's decode rate.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

import cli
from kvcache import make_cache
from model import Transformer
from offload import OffloadConfig
from task import run_task

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = "The with statement is used to wrap the execution of a block with methods defined by a context manager. "


def main(argv, capsys):
    capsys.readouterr()
    rc = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_fallback_cpu_budget_leaves_normal_placement_on_disk(text_ckpt, tmp_path, capsys):
    """--fallback-cpu-budget only matters after a disk failure: without one, every offloaded chunk reaches disk
    (so the task can resume), where --cpu-budget would have put the first ones in host memory."""
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "a", "prompt": TEXT * 3, "max_new_tokens": 4}) + "\n")
    rc, _, err = main(["--ckpt", text_ckpt, "--prompts", tasks, "--output", tmp_path / "r.jsonl", "--offload", "disk",
                       "--offload-dir", tmp_path / "off", "--chunk-size", 16, "--window", 1,
                       "--fallback-cpu-budget", 1], capsys)
    assert rc == 0, err
    st = json.loads((tmp_path / "r.jsonl").read_text())["stats"]
    assert st["chunks"]["host"] == 0 and st["chunks"]["disk"] > 0 and st["bytes"]["disk_write"] > 0, st


def test_offload_that_never_takes_effect_is_said_once(text_ckpt, tmp_path, capsys):
    rc, _, err = main(["--ckpt", text_ckpt, "--prompt", TEXT, "--offload", "disk", "--offload-dir", tmp_path,
                       "--chunk-size", 512, "--max-new-tokens", 3, "--json"], capsys)
    assert rc == 0
    lines = [l for l in err.splitlines() if "nothing left the device" in l]
    assert len(lines) == 1 and "--window" in lines[0] and "chunks" in lines[0], err
    rc, _, err = main(["--ckpt", text_ckpt, "--prompt", TEXT * 3, "--offload", "disk", "--offload-dir", tmp_path,
                       "--chunk-size", 8, "--window", 1, "--max-new-tokens", 3, "--json"], capsys)
    assert rc == 0 and "nothing left the device" not in err, err  # a negative control: here chunks do leave


def test_max_new_tokens_cut_to_the_context_warns(text_ckpt, tmp_path, capsys):
    import shutil

    from ckpt import edit_config
    short = tmp_path / "short"
    shutil.copytree(text_ckpt, short)
    edit_config(short, max_position_embeddings=96)  # the model's own context: 96 positions
    rc, out, err = main(["--ckpt", short, "--prompt", TEXT, "--max-new-tokens", 500, "--chunk-size", 8, "--json"],
                        capsys)
    assert rc == 0, err
    r = json.loads(out)
    cut = 96 - r["prompt_tokens"]
    warnings = [l for l in err.splitlines() if l.startswith("warning: --max-new-tokens 500 cut to")]
    assert len(warnings) == 1 and f"cut to {cut}" in warnings[0] and "model's context" in warnings[0], err
    assert len(r["tokens"]) <= cut


def test_default_offload_dir_is_in_help_and_not_left_behind(text_ckpt, tmp_path):
    help_text = subprocess.run([sys.executable, os.path.join(ROOT, "generate.py"), "--help"], capture_output=True,
                               text=True).stdout
    assert "./kv_cache_offload" in help_text and "appended" in help_text
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, os.path.join(ROOT, "generate.py"), "--ckpt", text_ckpt, "--prompt", TEXT * 2,
                        "--offload", "disk", "--chunk-size", "8", "--window", "1", "--max-new-tokens", "2"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert not (tmp_path / "kv_cache_offload").exists(), os.listdir(tmp_path / "kv_cache_offload")


def test_probe_py_is_a_command():
    p = subprocess.run([sys.executable, os.path.join(ROOT, "probe.py"), "--help"], capture_output=True, text=True)
    assert p.returncode == 0 and "--probe" in p.stdout


def test_model_call_across_a_chunk_boundary_is_the_caches_clear_error(llama_ckpt):
    model = Transformer.from_pretrained(llama_ckpt)
    cache = make_cache(model, OffloadConfig(), 8, 64)
    try:
        with pytest.raises(ValueError, match="crosses a chunk boundary"):
            model(torch.randint(3, 100, (1, 12)), cache)
        with pytest.raises(ValueError, match="cache.begin"):  # fits, but begin() was not called
            model(torch.randint(3, 100, (1, 4)), cache)
    finally:
        cache.store.close()


def test_resumed_task_reports_only_what_it_decoded(llama_ckpt, tmp_path):
    """After a resume, the replayed tokens are fed again, not decoded: decoded_tokens and the decode rate count
    only the tokens this run sampled (the batch summary adds decoded_tokens)."""
    model = Transformer.from_pretrained(llama_ckpt)
    ids = torch.randint(3, 128, (60,), generator=torch.Generator().manual_seed(0)).tolist()
    cfg = OffloadConfig(mode="disk", window=1, offload_dir=str(tmp_path), keep_files=True)

    class Crash(Exception):
        pass

    def crash(out):
        if len(out) == 30:
            raise Crash
    with pytest.raises(Crash):
        run_task(model, ids, 40, chunk_size=8, cfg=cfg, on_token=crash, fingerprint="fp", task_id="t")
    new, st = run_task(model, ids, 40, chunk_size=8, cfg=cfg, fingerprint="fp", task_id="t")
    assert st["resumed_from"] > 0 and len(new) == 40
    assert 0 < st["decoded_tokens"] < 40 - (st["resumed_from"] - len(ids)) + 1, st
