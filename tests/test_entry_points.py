"""
Each tool is a command of its own, with its own --help: tune.py, doctor.py, probe.py. The older
spellings (bench.py --tune, bench.py --probe, verify.py --diagnose) are aliases that reach the same
main(), so a bad flag given through one is the tool's own one-line error. Bad input to any of them:
one line on stderr, exit code 2. No model runs: every case stops at the flags.
"""
import os
import subprocess
import sys

import pytest

from measure import bench, doctor, probe, tune

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = [("tune.py", "bench.py --tune"),
         ("doctor.py", "verify.py --diagnose"),
         ("probe.py", "bench.py --probe")]


def run(*argv):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("tool, alias", TOOLS)
def test_each_tool_is_a_command_with_its_own_help(tool, alias):
    p = run(tool, "--help")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith(f"usage: {tool} "), p.stdout[:200]
    assert f"alias: python {alias} ... runs python {tool} ..." in p.stdout


@pytest.mark.parametrize("script, aliases", [("bench.py", ["--tune", "--probe"]),
                                             ("verify.py", ["--diagnose"])])
def test_the_aliases_are_not_flags_of_the_script(script, aliases):
    """The script names its aliases in its help, and does not declare them as flags of its own."""
    p = run(script, "--help")
    assert p.returncode == 0, p.stderr
    usage, _, rest = p.stdout.partition("\n\n")
    for alias in aliases:
        assert f"[{alias}]" not in usage and f"\n  {alias}" not in rest, p.stdout
        assert f"python {script} {alias} ..." in rest


@pytest.mark.parametrize("argv, tool", [
    (["bench.py", "--tune"], "tune.py"),
    (["bench.py", "--probe"], "probe.py"),
    (["bench.py", "--device", "cpu", "--probe"], "probe.py"),  # anywhere on the line
    (["verify.py", "--diagnose"], "doctor.py"),
])
def test_an_alias_reaches_the_tools_own_main(argv, tool):
    p = run(*argv, "--no-such-flag")
    assert p.returncode == 2, p.stderr
    error = f"{tool}: error: unrecognized arguments: --no-such-flag"
    assert p.stderr.strip().splitlines() == [error]


def test_an_alias_shows_the_tools_own_help():
    p = run("bench.py", "--tune", "--help")
    assert p.returncode == 0 and p.stdout.startswith("usage: tune.py "), p.stdout[:200]


@pytest.mark.parametrize("main, argv, needle", [
    (tune.main, ["--context", "0"], "--context"),
    (tune.main, ["--chunk-sizes", "64,big"], "--chunk-sizes"),
    (tune.main, ["--no-such-flag"], "--no-such-flag"),
    (doctor.main, ["--ckpt", "/nonexistent/model"], "--ckpt"),
    (doctor.main, ["--compress", "zstd", "--offload", "cpu"], "--compress"),
    (doctor.main, ["--offload", "tape"], "--offload"),
    (probe.main, ["--contexts", "1024,4k"], "--contexts"),
    (probe.main, ["--probe-mib", "4"], "--probe-mib"),
    (probe.main, ["--layers", "2"], "--layers"),
    (probe.main, ["--vs-hf"], "--vs-hf"),               # bench.py's flag, not the probe's
    (bench.main, ["--probe-mib", "8"], "--probe-mib"),  # the probe's flag, not bench.py's
])
def test_bad_input_is_one_line_and_exit_2(main, argv, needle, capsys):
    prog = main.__module__.rsplit(".", 1)[-1] + ".py"  # measure.tune -> tune.py
    try:
        rc = main(["--device", "cpu", *argv])
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"{prog}: error:") and needle in err, err
