"""
Resume state that does not validate (issue 25, case 2, and the reports of case 8): a manifest whose
fields have the wrong type or range, whose tokens were replaced, that is too large, not JSON or
nested 30,000 deep; zstd files cut short; blob positions negative or far past the file. Each is
reported in one line saying what, and the task is recomputed with the output of a clean run: never a
traceback, never a huge allocation, never trusted, and the rerun after it resumes normally.

run_task directly on the tiny Llama (vocab 128), as tests/test_batch.py's resume tests do.
"""
import json
import os

import pytest
import torch

from model import Transformer
from offload import OffloadConfig
from runs.task import run_task
from runs.taskdir import manifest_check, safe_task_name

C = 8     # chunk size
NEW = 20  # new tokens
P = 50    # prompt tokens: 6 full chunks
EOS = {2}  # the checkpoint's eos_token_id


@pytest.fixture(scope="module")
def model(llama_ckpt):
    return Transformer.from_pretrained(llama_ckpt)


@pytest.fixture(scope="module")
def ids_and_reference(model):
    ids = torch.randint(3, 128, (P,), generator=torch.Generator().manual_seed(0)).tolist()
    ref, _ = run_task(model, ids, NEW, chunk_size=C, cfg=OffloadConfig(), eos_ids=EOS)
    assert len(ref) == NEW  # no EOS: every case has generated tokens to replay
    return ids, ref


def run_kept(model, ids, offload_dir, compress="none"):
    """run_task on the disk tier, keeping its directory and manifest: (new ids, stats, log)."""
    log = []
    cfg = OffloadConfig(mode="disk", window=1, offload_dir=str(offload_dir), compress=compress,
                        keep_files=True)
    new, stats = run_task(model, ids, NEW, chunk_size=C, cfg=cfg, eos_ids=EOS, task_id="t",
                          fingerprint="fp", log=log.append)
    return new, stats, log


def manifest_path(offload_dir):
    return offload_dir / safe_task_name("t") / "manifest.json"


def rewrite(path, m, vouch=True):
    """Write manifest m back, with the checksum a run would give it (vouch) or the old one."""
    m = dict(m)
    check = m.pop("check")
    path.write_text(json.dumps({**m, "check": manifest_check(m) if vouch else check}))


# what a bad manifest may hold: (name, change to the manifest dict, compress)
def set_field(key, value):
    def change(m, task_dir):
        m[key] = value
    return change


def set_chunk(j, key, value):
    def change(m, task_dir):
        m["chunks"][str(j)][key] = value
    return change


def huge_token(m, task_dir):
    m["tokens"][-1] = 10**9


def longer_than_allowed(m, task_dir):
    m["tokens"] += [5] * (NEW + 1)


def other_prompt(m, task_dir):
    m["tokens"][0] = (m["tokens"][0] + 1) % 128


def eos_in_the_middle(m, task_dir):
    m["tokens"][P + 2] = 2  # EOS


def chunks_renumbered(m, task_dir):
    m["chunks"] = {str(int(k) + 1): v for k, v in m["chunks"].items()}


def too_many_chunks(m, task_dir):
    one = m["chunks"]["0"]
    m["chunks"] = {str(j): one for j in range(1000)}


def blob_far_past_the_file(m, task_dir):
    m["chunks"]["1"]["blob"][0] = [10**12, 10**12]


def blob_longer_than_a_chunk(m, task_dir):
    m["chunks"]["1"]["blob"][0][1] = 10**12


def truncated_zstd_file(m, task_dir):
    path = task_dir / "layer0.zst"
    os.truncate(path, os.path.getsize(path) // 2)


BAD = [
    ("chunks a list", set_field("chunks", [1, 2]), "none"),
    ("chunks an int", set_field("chunks", 7), "none"),
    ("chunks renumbered", chunks_renumbered, "none"),
    ("more chunks than the task has", too_many_chunks, "none"),
    ("crc a string", set_chunk(0, "crc", "x"), "none"),
    ("crc one short", set_chunk(0, "crc", [0]), "none"),
    ("crc negative", set_chunk(0, "crc", [-1, -1]), "none"),
    ("a blob on the raw tier", set_chunk(0, "blob", [[0, 1], [0, 1]]), "none"),
    ("tokens an int", set_field("tokens", 10**9), "none"),
    ("tokens a string", set_field("tokens", "hello"), "none"),
    ("tokens null", set_field("tokens", None), "none"),
    ("a token id past the vocab", huge_token, "none"),
    ("a token that is a float", set_field("tokens", [1.5]), "none"),
    ("tokens longer than max_new_tokens allows", longer_than_allowed, "none"),
    ("tokens of another prompt", other_prompt, "none"),
    ("tokens past an EOS", eos_in_the_middle, "none"),
    ("blob offsets negative", set_chunk(1, "blob", [[-5, 10], [-5, 10]]), "zstd"),
    ("blob far past the file", blob_far_past_the_file, "zstd"),
    ("blob longer than a chunk", blob_longer_than_a_chunk, "zstd"),
    ("blob missing", set_chunk(1, "blob", None), "zstd"),
    ("zstd file cut short", truncated_zstd_file, "zstd"),
]


@pytest.mark.parametrize("name,change,compress", BAD, ids=[b[0] for b in BAD])
def test_bad_manifest_field_is_reported_and_recomputed(model, ids_and_reference, tmp_path, name,
                                                       change, compress):
    """The manifest keeps a valid checksum (as one a run wrote, or one recomputed by whoever can
    write it): the field checks themselves refuse it."""
    ids, ref = ids_and_reference
    new, stats, log = run_kept(model, ids, tmp_path, compress)
    assert new == ref and log == []
    path = manifest_path(tmp_path)
    m = json.loads(path.read_text())
    assert len(m["chunks"]) >= 4
    change(m, path.parent)
    rewrite(path, m)
    new, stats, log = run_kept(model, ids, tmp_path, compress)
    assert new == ref
    assert len(log) == 1 and "recomputing" in log[0], log
    # the run wrote a good manifest again: the next rerun resumes from it, silently
    new, stats, log = run_kept(model, ids, tmp_path, compress)
    assert new == ref and log == [] and stats["resumed_from"] > 0


def test_a_resume_is_not_counted_as_reuse_from_the_kv_store(model, ids_and_reference, tmp_path):
    """A kept run resumed with --kv-store: the chunks restored from its disk tier are
    resumed_from, not reused_tokens (nothing was read from the store, which is empty here; the
    restored chunks were counted as reused)."""
    from runs.kvstore import KVStore
    ids, ref = ids_and_reference
    new, _, _ = run_kept(model, ids, tmp_path)
    assert new == ref
    cfg = OffloadConfig(mode="disk", window=1, offload_dir=str(tmp_path), keep_files=True)
    new, stats = run_task(model, ids, NEW, chunk_size=C, cfg=cfg, eos_ids=EOS, task_id="t",
                          fingerprint="fp", kv_store=KVStore(tmp_path / "store"))
    assert new == ref and stats["resumed_from"] > 0
    assert stats["reused_tokens"] == 0 and stats["store_bytes_read"] == 0, stats


def test_replaced_tokens_are_not_replayed(model, ids_and_reference, tmp_path):
    """Generated tokens replaced by hand (or by any tool that does not know the checksum): the
    manifest no longer matches its checksum, is reported, and the task is recomputed; without the
    checksum these tokens (in the vocabulary, after the prompt) would be the output."""
    ids, ref = ids_and_reference
    run_kept(model, ids, tmp_path)
    path = manifest_path(tmp_path)
    m = json.loads(path.read_text())
    chosen = [(t + 1) % 128 or 3 for t in m["tokens"][P:]]
    assert chosen != ref
    m["tokens"][P:] = chosen
    rewrite(path, m, vouch=False)
    new, stats, log = run_kept(model, ids, tmp_path)
    assert new == ref and stats["resumed_from"] == 0
    assert len(log) == 1 and "checksum" in log[0] and "recomputing" in log[0], log


def write_raw(path, text):
    path.write_text(text)


@pytest.mark.parametrize("what,text,words", [
    ("not JSON", "{not json", "not valid JSON"),
    ("nested 30,000 deep", "[" * 30_000 + "]" * 30_000, "not valid JSON"),
    ("nested 100,000 deep", "[" * 100_000 + "]" * 100_000, "bytes"),  # refused by its size
    ("a 5,000-digit number", '{"version": ' + "9" * 5000 + "}", "not valid JSON"),
    ("another version's", '{"version": 1, "tokens": [1]}', "version"),
    ("an array", "[1, 2, 3]", "version"),
    ("invalid UTF-8", b"\xff\xfe{".decode("latin-1"), "not valid JSON"),
])
def test_unreadable_manifest_is_reported_and_recomputed(model, ids_and_reference, tmp_path, what,
                                                        text, words):
    ids, ref = ids_and_reference
    run_kept(model, ids, tmp_path)
    path = manifest_path(tmp_path)
    if what == "invalid UTF-8":
        path.write_bytes(b"\xff\xfe{")
    else:
        path.write_text(text)
    new, stats, log = run_kept(model, ids, tmp_path)
    assert new == ref and stats["resumed_from"] == 0
    assert len(log) == 1 and words in log[0] and "recomputing" in log[0], log


def test_manifest_larger_than_the_task_allows_is_not_read(model, ids_and_reference, tmp_path):
    """A manifest far larger than this task's could be (here 64 MiB of padding) is refused by its
    size, before it is read."""
    ids, ref = ids_and_reference
    run_kept(model, ids, tmp_path)
    path = manifest_path(tmp_path)
    with open(path, "ab") as f:
        f.truncate(64 << 20)
    new, stats, log = run_kept(model, ids, tmp_path)
    assert new == ref and stats["resumed_from"] == 0
    assert len(log) == 1 and "bytes" in log[0] and "recomputing" in log[0], log


def test_layer_file_that_is_not_ours_is_recomputed(model, ids_and_reference, tmp_path):
    """A layer file replaced by a link (to anything) since the manifest was written: not opened,
    the chunks are recomputed, and the file the link points to is not touched."""
    ids, ref = ids_and_reference
    run_kept(model, ids, tmp_path)
    task_dir = manifest_path(tmp_path).parent
    victim = tmp_path / "victim"
    victim.write_bytes(b"x" * 100)
    os.remove(task_dir / "layer1.kv")
    (task_dir / "layer1.kv").symlink_to(victim)
    new, stats, log = run_kept(model, ids, tmp_path)
    assert new == ref and stats["resumed_from"] == 0
    assert len(log) == 1 and "chunk 0" in log[0] and "recomputing" in log[0], log
    assert victim.read_bytes() == b"x" * 100
