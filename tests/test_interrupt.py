"""
Ctrl-C as a user presses it: a real generate.py run on the demo model, SIGINT mid-prefill through
the disk tier, must end with exit code 130 and one line on stderr (no traceback) that says what was
kept and where; what it says must be true (the directory is there), and the same command again
resumes from it and leaves no empty ./kv_cache_offload behind. A scheduler's SIGTERM and a closed
terminal's SIGHUP stop a run as Ctrl-C does, with 143 and 129.
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from runs import generate_cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "assets", "tinyllama-pydoc")
TEXT = ("A module is a file containing Python definitions and statements. The file name is the "
        "module name with the suffix .py appended. ")
# os.environ when called: conftest points TMPDIR at the session's own directory
ENV = {"OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}


def interrupt_mid_prefill(argv, cwd, trace, position, signum=signal.SIGINT):
    """Start generate.py, wait until its trace shows a prefill step past `position`, send signum:
    (exit code, stdout, stderr)."""
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, "generate.py"), *argv,
                          "--trace", trace], cwd=cwd, env={**os.environ, **ENV},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=ctrl_c_reaches)
    deadline = time.monotonic() + 60
    while True:
        assert p.poll() is None, p.communicate()
        assert time.monotonic() < deadline, "no prefill step within 60 s"
        # every line but the last, which may be half written
        lines = trace.read_text().splitlines()[:-1] if trace.exists() else []
        events = [json.loads(line) for line in lines]
        if any(e.get("phase") == "prefill" and e["position"] >= position for e in events):
            break
        time.sleep(0.02)
    p.send_signal(signum)
    out, err = p.communicate(timeout=60)
    return p.returncode, out, err


@pytest.mark.parametrize("batch,signum", [(False, signal.SIGINT), (True, signal.SIGINT),
                                          (True, signal.SIGTERM)])
def test_ctrl_c_mid_prefill_is_one_line_and_the_kept_tier_resumes(tmp_path, batch, signum,
                                                                  monkeypatch, capsys):
    # about 400 tokens in chunks of 16: the signal lands with most of the prefill still to go
    flags = ["--ckpt", DEMO, "--offload", "disk", "--window", "1", "--chunk-size", "16",
             "--max-new-tokens", "2", "--threads", "1"]
    if batch:
        tasks = tmp_path / "tasks.jsonl"
        tasks.write_text("".join(json.dumps({"id": f"t{i}", "prompt": f"{i} " + TEXT * 16}) + "\n"
                                 for i in range(3)))
        flags += ["--prompts", tasks, "--output", tmp_path / "out.jsonl", "--batch-size", "2"]
    else:
        flags += ["--prompt", TEXT * 16, "--json"]
    flags = [str(f) for f in flags]
    rc, out, err = interrupt_mid_prefill(flags, tmp_path, tmp_path / "trace.jsonl", 64, signum)
    assert rc == 128 + signum, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    line = lines[0]
    said = "interrupted" if signum == signal.SIGINT else "stopped (SIGTERM)"
    assert line.startswith(f"generate.py: {said}") and "rm -r " in line, line
    # what it says is true: the directories it names are there, with their manifests
    kept = line.split("rm -r ")[1].rstrip(")").split()
    assert kept and all(k.startswith("./kv_cache_offload/task_") for k in kept), line
    # a task whose first chunk is not written yet has no manifest (on a loaded machine a batch's
    # second task may be there when the signal lands): the line then says to start over
    vouched = [(tmp_path / k / "manifest.json").is_file() for k in kept]
    assert all(vouched) == ("to resume" in line), (line, [os.listdir(tmp_path / k) for k in kept])
    if not batch:
        assert "at prefill" in line and "to resume" in line, line
    else:
        assert "results are in" in line and "unfinished tasks kept" in line, line

    # the same command again (in this process: the start of a process costs seconds)
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert generate_cli.main(flags) == 0
    again = capsys.readouterr()
    if batch:
        results = [json.loads(r) for r in (tmp_path / "out.jsonl").read_text().splitlines()]
        assert sorted(r["id"] for r in results) == ["t0", "t1", "t2"]
        assert any(r["stats"]["resumed_from"] > 0 for r in results), again.err
    else:
        assert json.loads(again.out)["stats"]["resumed_from"] > 0, again.out
    # the rerun emptied the default directory an earlier run had made: it is gone
    assert not (tmp_path / "kv_cache_offload").exists(), os.listdir(tmp_path / "kv_cache_offload")


def ctrl_c_reaches():
    """In the child, before exec: SIGINT as a terminal's foreground job has it. A suite started in
    the background of a non-interactive shell has SIGINT ignored, the child inherits that, and
    Python then installs no KeyboardInterrupt for it (tune.py would run to its end)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("command,signum", [("tune.py", signal.SIGINT),
                                            ("verify.py", signal.SIGINT),
                                            ("verify.py", signal.SIGTERM)])
def test_ctrl_c_in_the_other_commands_is_one_line(tmp_path, command, signum):
    """The measuring and proving commands end on Ctrl-C with exit 130 and one line, whenever it
    lands: here while the run is under way (tune.py has printed its plan; verify.py runs its disk
    mode); on SIGTERM with 143 and the same line, naming it. verify.py's disk tier goes with it."""
    argv = {"tune.py": ["--context", "4096", "--threads", "1"],
            "verify.py": ["--max-new-tokens", "64", "--threads", "1"]}[command]
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, command), *argv,
                          "--offload-dir", str(tmp_path / "kv")], cwd=tmp_path,
                         env={**os.environ, **ENV, "PYTHONUNBUFFERED": "1"},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=ctrl_c_reaches)
    if command == "tune.py":  # the run is under way: it has printed its plan
        assert p.stderr.readline(), p.communicate()
    else:  # verify.py prints its table at the end: its disk mode's tier is made on the way
        deadline = time.monotonic() + 120
        while not (tmp_path / "kv").is_dir() or not os.listdir(tmp_path / "kv"):
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.02)
    assert p.poll() is None, p.communicate()
    p.send_signal(signum)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signum, (p.returncode, err)
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    said = "interrupted (Ctrl-C)" if signum == signal.SIGINT else "stopped (SIGTERM)"
    assert last == f"{command}: {said}; nothing to resume: run it again", err
    if command == "verify.py":  # it says nothing on stderr before: the one line is all
        assert len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "kv").exists() or not os.listdir(tmp_path / "kv"), (
            os.listdir(tmp_path / "kv"))


def python_c(code):
    """`python -c code` from the repository's root: the finished process."""
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


def test_ctrl_c_while_a_command_starts_ends_it_at_once():
    """Ctrl-C during a command's imports: one line, exit 130, the process ended where it stood
    (an exception raised inside an import could leave a module half made and the command going
    on); once started, Ctrl-C is a KeyboardInterrupt again."""
    start = "import os, signal, time\nfrom runs import interrupt\ninterrupt.starting('x.py')\n"
    p = python_c(start + "os.kill(os.getpid(), signal.SIGINT)\ntime.sleep(30)\nprint('went on')\n")
    assert p.returncode == 130 and p.stdout == "", (p.returncode, p.stdout, p.stderr)
    assert p.stderr == "x.py: interrupted (Ctrl-C) while starting; nothing was kept\n", p.stderr
    p = python_c(start + "interrupt.started()\ntry:\n    os.kill(os.getpid(), signal.SIGINT)\n"
                 "except KeyboardInterrupt:\n    print('raised')\n")
    assert p.returncode == 0 and p.stdout == "raised\n", (p.stdout, p.stderr)


def test_sigterm_and_sighup_stop_a_command_as_ctrl_c_does_and_nohup_is_kept():
    """SIGTERM while starting: one line, 143. Once started, SIGTERM and SIGHUP raise Terminated (a
    KeyboardInterrupt: every cleanup of Ctrl-C runs) with their own status; a second SIGTERM while
    it cleans up is ignored. A SIGHUP the process was started ignoring (nohup) stays ignored."""
    start = "import os, signal, time\nfrom runs import interrupt\ninterrupt.starting('x.py')\n"
    p = python_c(start + "os.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(30)\n")
    said = "x.py: stopped (SIGTERM) while starting; nothing was kept\n"
    assert p.returncode == 143 and p.stderr == said, (p.returncode, p.stderr)
    for name, code in (("SIGTERM", 143), ("SIGHUP", 129)):
        p = python_c(start + "interrupt.started()\ntry:\n"
                     f"    os.kill(os.getpid(), signal.{name})\n    time.sleep(30)\n"
                     "except KeyboardInterrupt as e:\n"
                     "    os.kill(os.getpid(), signal.SIGTERM)  # ignored: cleaning up\n"
                     "    raise SystemExit(interrupt.ended('x.py', e))\n")
        assert p.returncode == code, (p.returncode, p.stderr)
        assert p.stderr == f"x.py: stopped ({name}); nothing to resume: run it again\n", p.stderr
    p = python_c("import signal\nsignal.signal(signal.SIGHUP, signal.SIG_IGN)\n" + start +
                 "interrupt.started()\nos.kill(os.getpid(), signal.SIGHUP)\nprint('went on')\n")
    assert p.returncode == 0 and p.stdout == "went on\n", (p.returncode, p.stderr)


def test_only_the_first_rank_says_it_was_stopped(monkeypatch, capfd):
    """Under torchrun, rank 0's refusal ends the job and torchrun stops the other ranks with
    SIGTERM: they end with 143 and say nothing (their line read as a second, contrary one)."""
    from runs import interrupt
    monkeypatch.setenv("RANK", "1")
    assert interrupt.ended("verify.py", interrupt.Terminated(signal.SIGTERM)) == 143
    assert capfd.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert interrupt.ended("verify.py", interrupt.Terminated(signal.SIGTERM)) == 143
    said = "verify.py: stopped (SIGTERM); nothing to resume: run it again\n"
    assert capfd.readouterr().err == said
