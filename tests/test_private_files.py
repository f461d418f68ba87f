"""
Hostile directories (issue 25, case 1, and the trace of case 8): every directory the project uses is
yours, mode 700 and not a link, or the run is refused with exit code 2 and one line; a link planted
at any name the project opens is never followed (the file it points to, outside, stays byte for
byte as it was), and the run either refuses or gives the output of a clean run; every file the
project writes is 0600 and every directory 0700.

generate.py's main() runs in this process (generate_cli.main), on the tiny sentencepiece checkpoint.
"""
import contextlib
import io
import json
import os
import stat

import pytest

from measure import doctor, probe
from private import PrivateError, create_private, make_private_dir, open_private, write_atomic
from runs import generate_cli, taskdir
from runs.taskdir import safe_task_name
from test_cli import PROMPT

# 3 prompt chunks of 16 and a window of 1: chunks reach the disk tier, manifests are written
DISK = ["--offload", "disk", "--chunk-size", 16, "--window", 1, "--max-new-tokens", 8, "--json"]
VICTIM_BYTES = b"a file of yours outside every directory the run was given\n"


def generate(ckpt, offload_dir, capsys, *flags):
    """generate.py on one prompt (task id "0"): (exit code, stdout, stderr)."""
    capsys.readouterr()
    argv = ["--ckpt", ckpt, "--prompt", PROMPT * 3, "--offload-dir", offload_dir, *DISK, *flags]
    rc = generate_cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def tokens(stdout):
    return json.loads(stdout)["tokens"]


def one_line(err, *words):
    """stderr is one line (no traceback) holding every word."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


@pytest.fixture
def victim(tmp_path):
    """A file outside every directory a run is given; the test checks it is untouched."""
    d = tmp_path / "outside"
    d.mkdir()
    path = d / "victim.txt"
    path.write_bytes(VICTIM_BYTES)
    return path


def untouched(victim):
    assert victim.read_bytes() == VICTIM_BYTES
    assert sorted(os.listdir(victim.parent)) == ["victim.txt"]


@pytest.fixture(scope="module")
def clean_tokens(text_ckpt, tmp_path_factory):
    """The tokens of a clean run of DISK."""
    off = tmp_path_factory.mktemp("clean") / "off"
    argv = ["--ckpt", text_ckpt, "--prompt", PROMPT * 3, "--offload-dir", off, *DISK]
    with contextlib.redirect_stdout(io.StringIO()) as out:
        rc = generate_cli.main([str(a) for a in argv])
    assert rc == 0
    return tokens(out.getvalue())


def give_away(path, monkeypatch):
    """Make `path` another user's: chown as root; otherwise this process pretends to be another
    user (os.getuid), which is what the check compares the owner with."""
    if os.getuid() == 0:
        os.chown(path, 4321, 4321)
    else:
        uid = os.getuid() + 1
        monkeypatch.setattr(os, "getuid", lambda: uid)


# -----------------------------------------------------------------------------
# the offload directory itself

def test_offload_dir_of_another_user_is_refused(text_ckpt, tmp_path, capsys, monkeypatch):
    off = tmp_path / "off"
    off.mkdir(mode=0o700)
    give_away(off, monkeypatch)
    rc, _, err = generate(text_ckpt, off, capsys)
    assert rc == 2
    one_line(err, "--offload-dir", str(off), "another user")
    assert os.listdir(off) == []


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770, 0o755])
def test_offload_dir_open_to_others_is_refused(text_ckpt, tmp_path, capsys, mode):
    off = tmp_path / "off"
    off.mkdir()
    os.chmod(off, mode)
    rc, _, err = generate(text_ckpt, off, capsys)
    assert rc == 2
    one_line(err, "--offload-dir", str(off), "open to other users", "chmod 700")
    assert os.listdir(off) == []
    assert "open to other users" in doctor.writable(str(off))  # the doctor finds it too


@pytest.mark.parametrize("slash", ["", "/"])
def test_offload_dir_that_is_a_link_is_refused(text_ckpt, tmp_path, capsys, slash):
    """A trailing slash ("link/") would make the check follow the link: it does not."""
    target = tmp_path / "real"
    target.mkdir(mode=0o700)
    off = tmp_path / "off"
    off.symlink_to(target)
    rc, _, err = generate(text_ckpt, str(off) + slash, capsys)
    assert rc == 2
    one_line(err, "--offload-dir", str(off), "symbolic link")
    assert os.listdir(target) == []


def test_missing_parents_are_made_private(text_ckpt, tmp_path, capsys, clean_tokens,
                                          monkeypatch):
    """The parents a run makes for --offload-dir are private while it runs, and go with the
    directory when the run leaves them empty."""
    off = tmp_path / "a" / "b" / "off"
    modes = {}

    def spy(args):  # at the run's end, before the directories it made are removed
        modes.update({d: stat.S_IMODE(os.stat(d).st_mode) for d in (tmp_path / "a",
                                                                     tmp_path / "a" / "b")})
        real(args)
    real = generate_cli.remove_created_offload_dir
    monkeypatch.setattr(generate_cli, "remove_created_offload_dir", spy)
    old = os.umask(0)
    try:
        rc, out, err = generate(text_ckpt, off, capsys)
    finally:
        os.umask(old)
    assert rc == 0, err
    assert tokens(out) == clean_tokens
    assert set(modes.values()) == {0o700} and not (tmp_path / "a").exists(), modes


# -----------------------------------------------------------------------------
# links planted inside a private offload directory, at every name the project opens

def private_dir(path):
    path.mkdir(mode=0o700)
    return path


def test_link_at_the_task_directory_is_refused(text_ckpt, tmp_path, capsys, victim):
    off = private_dir(tmp_path / "off")
    (off / safe_task_name("0")).symlink_to(victim.parent)
    rc, _, err = generate(text_ckpt, off, capsys)
    assert rc == 2
    one_line(err, safe_task_name("0"), "symbolic link")
    untouched(victim)


@pytest.mark.skipif(os.getuid() != 0, reason="giving a directory to another user needs root")
def test_task_directory_of_another_user_is_refused(text_ckpt, tmp_path, capsys):
    """A task_<id> someone else made (while the offload dir was open to them), holding a manifest
    of their choosing: refused, never read."""
    task_dir = private_dir(private_dir(tmp_path / "off") / safe_task_name("0"))
    (task_dir / "manifest.json").write_text('{"tokens": [1, 2, 3]}')
    os.chown(task_dir, 4321, 4321)
    rc, _, err = generate(text_ckpt, tmp_path / "off", capsys)
    assert rc == 2
    one_line(err, safe_task_name("0"), "another user")


def test_a_hostile_task_directory_fails_that_task_alone(text_ckpt, tmp_path, capsys, victim):
    """In a batch, the task whose directory holds a planted link fails with one line naming it;
    the other tasks run."""
    off = private_dir(tmp_path / "off")
    (private_dir(off / safe_task_name("a")) / "lock").symlink_to(victim)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": i, "prompt": PROMPT, "max_new_tokens": 2}) + "\n"
                             for i in ("a", "b")))
    output = tmp_path / "results.jsonl"
    capsys.readouterr()
    argv = [str(a) for a in ["--ckpt", text_ckpt, "--prompts", tasks, "--output", output,
                             "--offload-dir", off, *DISK[:6]]]
    rc = generate_cli.main(argv)
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err
    failed = [line for line in err.splitlines() if line.startswith("task a: FAILED")]
    assert len(failed) == 1 and "symbolic link" in failed[0], err
    assert [json.loads(line)["id"] for line in output.read_text().splitlines()] == ["b"]
    untouched(victim)


def test_link_at_the_lock_is_refused(text_ckpt, tmp_path, capsys, victim):
    task_dir = private_dir(private_dir(tmp_path / "off") / safe_task_name("0"))
    (task_dir / "lock").symlink_to(victim)
    rc, _, err = generate(text_ckpt, tmp_path / "off", capsys)
    assert rc == 2
    one_line(err, "lock", "symbolic link")
    untouched(victim)


@pytest.mark.parametrize("name", ["layer0.kv", "layer1.kv", "manifest.json.tmp", "manifest.json"])
def test_link_at_a_task_file_is_replaced_never_followed(text_ckpt, tmp_path, capsys, victim,
                                                        clean_tokens, name):
    """The disk tier's files are made afresh (a link there is removed, not followed), the manifest
    is written through a new file renamed into place, and a manifest that is a link is not read:
    the run gives the clean run's tokens."""
    task_dir = private_dir(private_dir(tmp_path / "off") / safe_task_name("0"))
    (task_dir / name).symlink_to(victim)
    rc, out, err = generate(text_ckpt, tmp_path / "off", capsys, "--keep-cache")
    assert rc == 0, err
    assert tokens(out) == clean_tokens
    untouched(victim)
    assert not any(os.path.islink(task_dir / f) and f != name for f in os.listdir(task_dir))


def test_links_at_old_probe_names_are_not_followed(text_ckpt, tmp_path, capsys, victim,
                                                   clean_tokens):
    """The writability probes (generate.py's, doctor.py's, probe.py's) write new files under random
    names: links planted at the names they used to take are left alone, as is the victim."""
    off = private_dir(tmp_path / "off")
    pid = os.getpid()
    for name in (f".probe-{pid}", f".doctor-{pid}", f".bench-probe-{pid}"):
        (off / name).symlink_to(victim)
    rc, out, err = generate(text_ckpt, off, capsys)
    assert rc == 0, err
    assert tokens(out) == clean_tokens
    assert doctor.writable(str(off)) is None
    result = probe.disk_bandwidth(str(off), nbytes=1 << 20, block=1 << 20)
    assert result["write"] > 0
    untouched(victim)
    assert sorted(os.listdir(off)) == sorted([f".probe-{pid}", f".doctor-{pid}",
                                             f".bench-probe-{pid}"])


# -----------------------------------------------------------------------------
# the digest cache, the trace, the results, the KV store

def test_digest_cache_never_follows_a_link_and_is_private(checkpoint, tmp_path, monkeypatch,
                                                          victim):
    xdg = tmp_path / "xdg"
    monkeypatch.setenv("XDG_CACHE_HOME", str(xdg))
    cache_dir = xdg / "kvoffload"
    os.makedirs(cache_dir, mode=0o700)
    (cache_dir / f"digests.json.{os.getpid()}.tmp").symlink_to(victim)  # the old temporary name
    ckpt = checkpoint()
    fp = taskdir.model_fingerprint(ckpt)
    untouched(victim)
    entries = json.loads((cache_dir / "digests.json").read_text())
    assert len(entries) == 1
    assert stat.S_IMODE(os.stat(cache_dir / "digests.json").st_mode) == 0o600
    # a cache that is a link is not read, and is replaced (not followed) when saved
    os.remove(cache_dir / "digests.json")
    (cache_dir / "digests.json").symlink_to(victim)
    assert taskdir.model_fingerprint(ckpt) == fp
    untouched(victim)
    assert not os.path.islink(cache_dir / "digests.json")


def test_digest_cache_in_a_directory_others_can_write_is_not_used(checkpoint, tmp_path,
                                                                  monkeypatch):
    """A digest planted by someone else would be trusted: in a directory open to others the cache
    is neither read nor written, and the weights are hashed."""
    ckpt = checkpoint()
    xdg = tmp_path / "xdg"
    monkeypatch.setenv("XDG_CACHE_HOME", str(xdg))
    fp = taskdir.model_fingerprint(ckpt)
    cache = xdg / "kvoffload" / "digests.json"
    entries = json.loads(cache.read_text())
    for e in entries.values():
        e["sha256"] = "0" * 64  # planted
    cache.write_text(json.dumps(entries))
    os.chmod(xdg / "kvoffload", 0o777)
    assert taskdir.model_fingerprint(ckpt) == fp
    assert json.loads(cache.read_text()) == entries  # not written either


def test_trace_is_private_and_never_follows_a_link(text_ckpt, tmp_path, capsys, victim,
                                                   clean_tokens):
    trace = tmp_path / "trace.jsonl"
    old = os.umask(0)
    try:
        rc, out, err = generate(text_ckpt, tmp_path / "off", capsys, "--trace", trace)
    finally:
        os.umask(old)
    assert rc == 0, err
    assert tokens(out) == clean_tokens
    assert stat.S_IMODE(os.stat(trace).st_mode) == 0o600
    link = tmp_path / "link.jsonl"
    link.symlink_to(victim)
    rc, _, err = generate(text_ckpt, tmp_path / "off", capsys, "--trace", link)
    assert rc == 2
    one_line(err, "--trace", "symbolic link")
    untouched(victim)


def test_results_never_follow_a_link(text_ckpt, tmp_path, capsys, victim):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "a", "prompt": PROMPT, "max_new_tokens": 2}) + "\n")
    output = tmp_path / "results.jsonl"
    output.symlink_to(victim)
    capsys.readouterr()
    rc = generate_cli.main(["--ckpt", text_ckpt, "--prompts", str(tasks), "--output", str(output),
                   "--offload-dir", str(tmp_path / "off"), "--chunk-size", "16"])
    err = capsys.readouterr().err
    assert rc == 2
    one_line(err, "--output", "symbolic link")
    untouched(victim)


@pytest.mark.parametrize("problem", ["another user", "open to other users", "symbolic link"])
def test_kv_store_is_held_to_the_same_rule(text_ckpt, tmp_path, capsys, monkeypatch, problem):
    store = tmp_path / "store"
    if problem == "symbolic link":
        (tmp_path / "real").mkdir(mode=0o700)
        store.symlink_to(tmp_path / "real")
    else:
        store.mkdir(mode=0o700 if problem == "another user" else 0o777)
        os.chmod(store, 0o700 if problem == "another user" else 0o777)
    if problem == "another user":
        give_away(store, monkeypatch)
    rc, _, err = generate(text_ckpt, tmp_path / "off", capsys, "--kv-store", store)
    assert rc == 2
    one_line(err, "--kv-store", str(store), problem)


# -----------------------------------------------------------------------------
# modes

def modes_under(root):
    """{path: mode} of root and everything below it."""
    found = {str(root): stat.S_IMODE(os.lstat(root).st_mode)}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            found[p] = stat.S_IMODE(os.lstat(p).st_mode)
    return found


def test_every_file_is_0600_and_every_directory_0700(text_ckpt, tmp_path, capsys, monkeypatch):
    """Under umask 0 (so that every mode is the one the code asked for): the offload dir, a kept
    task directory with its lock, layer files and manifest, the KV store and its entries, the
    digest cache, the trace and the results."""
    xdg = tmp_path / "xdg"
    monkeypatch.setenv("XDG_CACHE_HOME", str(xdg))
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "a", "prompt": PROMPT * 3, "max_new_tokens": 4}) + "\n")
    out = tmp_path / "out"
    old = os.umask(0)
    try:
        rc = generate_cli.main([str(a) for a in [
            "--ckpt", text_ckpt, "--prompts", tasks, "--output", out / "results.jsonl",
            "--offload-dir", out / "off", "--kv-store", out / "store", "--trace",
            out / "trace.jsonl", "--keep-cache", *DISK[:6], "--compress", "zstd"]])
    finally:
        os.umask(old)
    assert rc == 0, capsys.readouterr().err
    written = {**modes_under(out / "off"), **modes_under(out / "store"), **modes_under(xdg)}
    written[str(out / "trace.jsonl")] = stat.S_IMODE(os.stat(out / "trace.jsonl").st_mode)
    written[str(out / "results.jsonl")] = stat.S_IMODE(os.stat(out / "results.jsonl").st_mode)
    names = {os.path.basename(p) for p in written}
    assert {"lock", "manifest.json", "layer0.zst", "digests.json"} <= names, names
    assert any(n.endswith(".kv") for n in names), names  # a KV store entry
    for p, mode in written.items():
        assert mode == (0o700 if os.path.isdir(p) else 0o600), (p, oct(mode))


# -----------------------------------------------------------------------------
# the helpers themselves

def test_private_helpers(tmp_path, victim):
    d = tmp_path / "d"
    assert make_private_dir(str(d), "x") is True and make_private_dir(str(d), "x") is False
    with pytest.raises(PrivateError, match="symbolic link"):
        (tmp_path / "l").symlink_to(victim)
        open_private(str(tmp_path / "l"), os.O_RDWR)
    hard = tmp_path / "hard"
    os.link(victim, hard)
    with pytest.raises(PrivateError, match="one link"):
        open_private(str(hard), os.O_RDWR | os.O_CREAT)
    os.remove(hard)
    fifo = d / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(PrivateError):  # opened without blocking, then refused
        open_private(str(fifo), os.O_RDONLY)
    fd, path = create_private(str(d), ".x-")
    os.close(fd)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    (d / "target").symlink_to(victim)
    write_atomic(str(d / "target"), b"new")
    assert (d / "target").read_bytes() == b"new" and not os.path.islink(d / "target")
    untouched(victim)
