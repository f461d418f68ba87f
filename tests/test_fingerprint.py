"""
Resume trusts only KV made by the same weights and settings (issue 11): two checkpoints of identical
shapes, file sizes and headers, differing in one tensor's values; a run of A interrupted mid-decode,
then a run of B over its directory. And the digest cache that spares later runs from hashing the
weights again.
"""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from model import Transformer
from offload import OffloadConfig
from runs import taskdir
from runs.task import run_task
from runs.taskdir import model_fingerprint, run_fingerprint, safe_task_name

C = 16    # chunk size
NEW = 40  # new tokens


@pytest.fixture(scope="module")
def twins(checkpoint, tmp_path_factory):
    """(dir A, dir B): B is A with layer 0's v_proj scaled by 1.5, saved with the same names, shapes
    and order."""
    root = tmp_path_factory.mktemp("twins")
    a = root / "a"
    b = root / "b"
    shutil.copytree(checkpoint(), a)
    shutil.copytree(checkpoint(), b)
    tensors = load_file(b / "model.safetensors")
    name = "model.layers.0.self_attn.v_proj.weight"
    tensors[name] = tensors[name] * 1.5
    save_file(tensors, b / "model.safetensors", metadata={"format": "pt"})
    return str(a), str(b)


def header(path):
    with open(path, "rb") as f:
        return f.read(8 + int.from_bytes(f.read(8), "little"))


def test_twins_differ_only_in_weight_values(twins):
    """The premise: what the old fingerprint hashed (config, headers, sizes) is equal; the new one
    differs."""
    a, b = (os.path.join(d, "model.safetensors") for d in twins)
    assert header(a) == header(b) and os.path.getsize(a) == os.path.getsize(b)
    with open(a, "rb") as fa, open(b, "rb") as fb:
        assert fa.read() != fb.read()
    assert model_fingerprint(twins[0]) != model_fingerprint(twins[1])
    assert model_fingerprint(twins[0]) == model_fingerprint(twins[0])


def run_disk(model, ids, offload_dir, fingerprint, on_token=None):
    log = []
    cfg = OffloadConfig(mode="disk", window=1, offload_dir=str(offload_dir), keep_files=True)
    new, stats = run_task(model, ids, NEW, chunk_size=C, cfg=cfg, task_id="t", on_token=on_token,
                          fingerprint=fingerprint, log=log.append)
    return new, stats, log


def test_rerun_with_other_weights_never_resumes_from_their_chunks(twins, tmp_path):
    model_a, model_b = (Transformer.from_pretrained(d) for d in twins)
    fp_a, fp_b = (run_fingerprint(model_fingerprint(d), dtype="fp32") for d in twins)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model_a.args.vocab_size, (100,), generator=generator).tolist()
    ref_b, _ = run_task(model_b, ids, NEW, chunk_size=C, cfg=OffloadConfig())  # B, no disk tier
    ref_a, _ = run_task(model_a, ids, NEW, chunk_size=C, cfg=OffloadConfig())
    assert ref_a != ref_b, "the twins must disagree"

    class Crash(Exception):
        pass

    def crash_at_20(out):
        if len(out) == 20:
            raise Crash
    with pytest.raises(Crash):  # A dies mid-decode, its directory and manifest left behind
        run_disk(model_a, ids, tmp_path / "off", fp_a, on_token=crash_at_20)
    with open(tmp_path / "off" / safe_task_name("t") / "manifest.json") as f:
        assert len(json.load(f)["chunks"]) >= 2
    shutil.copytree(tmp_path / "off", tmp_path / "control")

    new, stats, log = run_disk(model_b, ids, tmp_path / "off", fp_b)
    assert stats["resumed_from"] == 0
    assert len(log) == 1 and "another fingerprint" in log[0] and "not used" in log[0], log
    assert new == ref_b

    # the control: had B been given A's fingerprint (as header-only hashing did), it would resume
    # and go wrong
    new, stats, _ = run_disk(model_b, ids, tmp_path / "control", fp_a)
    assert stats["resumed_from"] > 0 and new != ref_b


def test_run_fingerprint_chains_the_settings():
    fp = run_fingerprint("m", dtype="fp32")
    assert fp != run_fingerprint("m", dtype="bf16") and fp != run_fingerprint("n", dtype="fp32")
    # an unused option leaves it unchanged
    assert fp == run_fingerprint("m", dtype="fp32", quantize=None)
    assert fp != run_fingerprint("m", dtype="fp32", quantize="int8")


def test_digest_cache_hashes_each_file_once(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    ckpt = tmp_path / "m"
    shutil.copytree(checkpoint(), ckpt)
    hashed = []
    real = taskdir.file_sha256

    def counted(path):
        hashed.append(path)
        return real(path)
    monkeypatch.setattr(taskdir, "file_sha256", counted)
    first = model_fingerprint(ckpt)
    assert first == model_fingerprint(ckpt) and len(hashed) == 1  # the second run read the cache
    cache_file = tmp_path / "cache" / "kvoffload" / "digests.json"
    assert os.stat(cache_file).st_mode & 0o777 == 0o600
    assert os.stat(cache_file.parent).st_mode & 0o777 == 0o700

    weights = ckpt / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # the same size, and the old mtime put back: ctime still tells
    st = os.stat(weights)
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert model_fingerprint(ckpt) != first and len(hashed) == 2


def test_unwritable_digest_cache_is_no_error(checkpoint, tmp_path, monkeypatch):
    """A cache that cannot be written or read costs a hash, never a wrong fingerprint."""
    want = model_fingerprint(checkpoint())  # through the session's working cache
    (tmp_path / "file").write_text("not a directory")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))
    assert model_fingerprint(checkpoint()) == want
    assert model_fingerprint(checkpoint()) == want
    (tmp_path / "cache" / "kvoffload").mkdir(parents=True)
    (tmp_path / "cache" / "kvoffload" / "digests.json").write_text("{not json")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert model_fingerprint(checkpoint()) == want
    assert model_fingerprint(checkpoint()) == want


def test_another_thread_count_never_resumes_or_reuses(twins, tmp_path):
    """A CPU's kernels split their sums by the thread count, so the KV's bits change with --threads:
    a manifest or a stored chunk made with 2 threads is not trusted by a run with 1, which starts
    over and gives exactly what a clean run with 1 thread gives."""
    from runs.kvstore import KVStore
    model = Transformer.from_pretrained(twins[0])
    ids = torch.randint(3, model.args.vocab_size, (70,),
                        generator=torch.Generator().manual_seed(5)).tolist()
    cfg = OffloadConfig(mode="disk", window=1, offload_dir=str(tmp_path / "off"))
    store = KVStore(str(tmp_path / "store"))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)

        class Stop(Exception):
            pass

        def stop(out):
            if len(out) == 20:
                raise Stop()
        with pytest.raises(Stop):
            run_task(model, ids, NEW, chunk_size=C, cfg=cfg, task_id="t", fingerprint="fp",
                     on_token=stop, kv_store=store)
        torch.set_num_threads(1)
        logs = []
        new, stats = run_task(model, ids, NEW, chunk_size=C, cfg=cfg, task_id="t",
                              fingerprint="fp", log=logs.append, kv_store=store)
        clean, _ = run_task(model, ids, NEW, chunk_size=C, cfg=OffloadConfig())
    finally:
        torch.set_num_threads(before)
    assert stats["resumed_from"] == 0 and stats["reused_tokens"] == 0, stats
    assert any("threads count" in m for m in logs), logs
    assert new == clean
