"""
Past the trained context on purpose (--rope-scaling): refused without the override in one sentence
naming it, run with it (one line on stderr says which scaling is in force), recorded in the
result's config, and never mixed with KV made under another RoPE setting, neither by resume nor by
the KV store.
"""
import importlib
import json
import shutil

import pytest

from checkpoint import CheckpointError
from ckpt import edit_config
from model import Transformer
from offload import OffloadConfig
from runs import flags, generate_cli
from runs.task import run_task
from test_cli import TEXT, main_in_process


@pytest.fixture(scope="module")
def short_ckpt(text_ckpt, tmp_path_factory):
    """The test tokenizer's model, its config cut to 128 positions of context."""
    path = tmp_path_factory.mktemp("short") / "ckpt"
    shutil.copytree(text_ckpt, path)
    edit_config(path, max_position_embeddings=128)
    return str(path)


def test_long_prompt_refused_without_the_override(short_ckpt, capsys):
    argv = ["--ckpt", short_ckpt, "--prompt", TEXT * 4, "--max-new-tokens", 4]
    rc, out, err = main_in_process(argv, capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and out == "", err
    assert "--rope-scaling" in lines[0] and "--rope-factor" in lines[0], lines[0]
    assert "not guaranteed" in lines[0], lines[0]


@pytest.mark.parametrize("script", ["bench", "probe", "tune"])
def test_measuring_past_the_context_names_the_override(short_ckpt, tmp_path, capsys, script):
    """bench.py, probe.py and tune.py refuse a context past the model's as generate.py does: one
    sentence that names --rope-scaling."""
    module = importlib.import_module(f"measure.{script}")
    flag = "--context" if script == "tune" else "--contexts"
    argv = ["--ckpt", short_ckpt, flag, "200", "--offload-dir", str(tmp_path / "off")]
    assert module.main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--rope-scaling" in lines[0] and f"{flag} 200" in lines[0], lines


@pytest.mark.parametrize("script", ["probe", "tune"])
def test_measuring_with_the_defaults_fits_any_model(short_ckpt, tmp_path, capsys, monkeypatch,
                                                    script):
    """probe.py and tune.py with their default contexts (up to 8192) on a 128-position model: the
    defaults are cut to the model's context less --new-tokens, said once, and the run goes on to
    load the model (stopped there: the measuring is tested elsewhere); a context given past the
    model is refused naming a smaller one."""
    module = importlib.import_module(f"measure.{script}")

    def stop(*args, **kw):
        raise CheckpointError("stopped at the load")
    monkeypatch.setattr(module.Transformer, "from_pretrained", stop)
    flag = "--context" if script == "tune" else "--contexts"
    default = "8192" if script == "tune" else "1024,4096,8192"
    argv = ["--ckpt", short_ckpt, "--new-tokens", "8", "--offload-dir", str(tmp_path / "off")]
    capsys.readouterr()
    assert module.main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"{flag} 120: the default {default} cut to the model's context of 128 "
                     f"positions, less --new-tokens 8; give {flag} to choose",
                     f"{script}.py: error: stopped at the load"], lines
    assert module.main(argv + [flag, "121"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    said = f"{flag} 121 plus --new-tokens 8: at most 120 fit with them, so give a smaller {flag}; "
    assert len(lines) == 1 and said in lines[0] and "--rope-scaling" in lines[0], lines


@pytest.mark.parametrize("kind", ["linear", "yarn", "llama3"])
def test_override_runs_past_the_context_and_says_so(short_ckpt, tmp_path, capsys, kind):
    argv = ["--ckpt", short_ckpt, "--prompt", TEXT * 4, "--max-new-tokens", 4, "--chunk-size", 16,
            "--json", "--rope-scaling", kind, "--rope-factor", 2, "--offload", "disk",
            "--window", 1, "--offload-dir", tmp_path]
    rc, out, err = main_in_process(argv, capsys)
    assert rc == 0, err
    r = json.loads(out)
    assert 128 < r["prompt_tokens"] + len(r["tokens"]) <= 256
    notes = [l for l in err.splitlines() if l.startswith(f"RoPE {kind} scaling")]
    assert len(notes) == 1 and "256" in notes[0], err
    assert r["config"]["rope_override"] and r["config"]["rope_scaling"]["rope_type"] == kind
    assert r["config"]["max_context"] == 256
    # the same tokens as the library's own override, loaded directly and run without offload
    model = Transformer.from_pretrained(short_ckpt, rope_override=(kind, 2.0, None))
    ref, _ = run_task(model, r["prompt_ids"], len(r["tokens"]), chunk_size=16, cfg=OffloadConfig())
    assert ref == r["tokens"]


def test_flags_without_scaling_are_refused(short_ckpt, capsys):
    argv = ["--ckpt", short_ckpt, "--prompt", TEXT, "--rope-factor", 2]
    rc, _, err = main_in_process(argv, capsys)
    assert rc == 2 and "--rope-scaling" in err and len(err.strip().splitlines()) == 1


def test_kv_made_under_another_rope_setting_is_not_adopted(short_ckpt, tmp_path, capsys):
    base = ["--ckpt", short_ckpt, "--prompt", TEXT * 4, "--max-new-tokens", 2, "--chunk-size", 16,
            "--json", "--kv-store", tmp_path / "s", "--rope-factor", 2]
    runs = []
    for kind in ("yarn", "yarn", "linear"):
        rc, out, err = main_in_process(base + ["--rope-scaling", kind], capsys)
        assert rc == 0, err
        runs.append(json.loads(out)["stats"])
    assert runs[0]["reused_tokens"] == 0 and runs[1]["reused_tokens"] > 0  # the same setting reuses
    assert runs[2]["reused_tokens"] == 0                                   # another one never does
    # resume keys on the same fingerprint: it differs between the settings
    a = generate_cli.build_parser().parse_args(["--rope-scaling", "yarn", "--rope-factor", "2"])
    b = generate_cli.build_parser().parse_args(["--rope-scaling", "linear", "--rope-factor", "2"])
    assert flags.run_fingerprint(short_ckpt, a) != flags.run_fingerprint(short_ckpt, b)
