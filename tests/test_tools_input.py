"""The measurement tools users are pointed to (docs/performance.md): a wrong argument or a missing
checkpoint is one line on stderr and exit 2, never a traceback."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("tool, args, says", [
    ("decode_steps.py", [], "usage: python tools/decode_steps.py TREE"),
    ("decode_steps.py", [ROOT, "fp64", "1024", "2"], "usage: python tools/decode_steps.py TREE"),
    ("attend_groups.py", ["two", "2048"], "usage: python tools/attend_groups.py THREADS"),
    ("decode_steps.py", [ROOT, "fp32", "abc", "2"], "usage: python tools/decode_steps.py TREE"),
    ("speculation.py", ["--ckpt", "/nonexistent"], "/nonexistent/config.json not found"),
    ("speculation.py", ["--ks", "lookup:x"], "--ks takes K or lookup:K"),
    ("speculation.py", ["--dtypes", "fp64"], "--dtypes 'fp64'"),
    ("speculation.py", ["--tasks", "bogus"], "--tasks 'bogus'"),
    ("speculation.py", ["--contexts", "99999"], "past the model's 32768 positions"),
    ("profile_decode.py", ["--ckpt", os.path.join(ROOT, "README.md")], "not a directory"),
    ("prefill_granule.py", ["--ckpt", "/nonexistent"], "/nonexistent/config.json not found"),
    ("longeval.py", ["--depths", "nan"], "--depths 'nan': give a comma list of numbers from 0"),
    ("longeval.py", ["--chunk-size", "0"], "--chunk-size must be at least 1, got 0"),
    ("longeval.py", ["--policies", "all,quest:8", "--chunk-size", "16"],
     "the budget must be a whole number of tokens, at least one chunk (16)"),
    ("longeval.py", ["--repeats", "0"], "--repeats must be at least 1"),
    ("longeval.py", ["--ckpt", "/nonexistent"], "/nonexistent/config.json not found"),
    ("longeval.py", ["--doc-file", ROOT], f"--doc-file {ROOT}: cannot be read as UTF-8 text"),
])
def test_bad_input_is_one_line_and_exit_2(tool, args, says):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", tool), *args],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    # argparse's usage lines, if any, then the one line that says what is wrong
    assert says in p.stderr.strip().splitlines()[-1] and "Traceback" not in p.stderr, p.stderr
