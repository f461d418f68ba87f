"""
Negative controls for the emulated CUDA tests: remove each stream-ordering call of offload.py in turn (the line
becomes `pass`, same indentation) in a temporary copy of the repository, and expect tests/test_cuda_emulated.py to
fail every time. A mutant that survives is a wait no test needs: either a missing test or a redundant wait.

    python tests/mutate_waits.py            # every wait_event / synchronize / record line; exit 1 if one survives
    python tests/mutate_waits.py 194 201    # only these line numbers

Lines without a "# rule N" comment are mutated too, and reported as unmarked.
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ORDERING = re.compile(r"\.(wait_event|wait_stream|synchronize|record|record_stream)\(")
SKIP = {".git", ".venv", ".ci-venv", "__pycache__", ".pytest_cache", "kv_cache_offload", ".whl"}
TESTS = ["tests/test_cuda_emulated.py", "-x", "-q", "-p", "no:cacheprovider", "--tb=short", "-k", "not full_disk"]


def ordering_lines(source):
    """(line number, text) of every stream-ordering call in offload.py's code (not its docstrings or comments)."""
    out = []
    for n, line in enumerate(source.splitlines(), 1):
        code = line.split("#", 1)[0]
        if ORDERING.search(code) and not code.strip().startswith(('"', "'")):
            out.append((n, line))
    return out


def mutate(source, n):
    lines = source.splitlines(keepends=True)
    text = lines[n - 1]
    lines[n - 1] = text[:len(text) - len(text.lstrip())] + "pass\n"
    return "".join(lines)


def first_failure(output):
    """The first problem the emulator named (else the first assertion or error line pytest printed), shortened."""
    errors = [line[2:].strip() for line in output.splitlines() if line.startswith("E ") and len(line.strip()) > 2]
    for line in errors:
        if line.startswith(("race on", "waits on an event", "store closed", "offload.py")):
            return line[:400]
    for line in errors:
        return line[:400]
    tail = [ln for ln in output.splitlines() if ln.strip()]
    return tail[-1][:240] if tail else "(no output)"


def main(only=()):
    source = open(os.path.join(ROOT, "offload.py")).read()
    targets = [(n, t) for n, t in ordering_lines(source) if not only or n in only]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    survivors, unmarked = [], []
    with tempfile.TemporaryDirectory(prefix="mutate_waits_") as tmp:
        copy = os.path.join(tmp, "repo")
        shutil.copytree(ROOT, copy, ignore=lambda d, names: [x for x in names if x in SKIP])
        clean = subprocess.run([sys.executable, "-m", "pytest", *TESTS], cwd=copy, env=env, capture_output=True,
                               text=True)
        if clean.returncode != 0:
            sys.exit("the unmutated tests fail; fix them first:\n" + clean.stdout[-3000:])
        for n, text in targets:
            rule = re.search(r"#.*\brule (\d)", text)
            if not rule:
                unmarked.append(n)
            with open(os.path.join(copy, "offload.py"), "w") as f:
                f.write(mutate(source, n))
            t = time.time()
            try:
                r = subprocess.run([sys.executable, "-m", "pytest", *TESTS], cwd=copy, env=env, capture_output=True,
                                   text=True, timeout=600)
                rc, output = r.returncode, r.stdout + r.stderr
            except subprocess.TimeoutExpired:
                rc, output = -1, "timed out (a hang counts as caught)"
            killed = rc != 0
            if not killed:
                survivors.append(n)
            label = f"rule {rule.group(1)}" if rule else "unmarked"
            print(f"line {n:4d} [{label:8s}] {'caught  ' if killed else 'SURVIVED'} {time.time() - t:5.1f}s  "
                  f"{text.strip()}")
            if killed:
                summary = next((ln[2:].strip() for ln in output.splitlines()
                                if ln.startswith("E ") and "problems (" in ln), "")
                print(f"           {summary}\n           {first_failure(output)}")
            sys.stdout.flush()
    with open(os.path.join(ROOT, "offload.py")) as f:
        assert f.read() == source, "the repository's offload.py must be untouched"
    print(f"{len(targets)} mutants, {len(targets) - len(survivors)} caught, survived: {survivors or 'none'}; "
          f"ordering lines without a '# rule N' comment: {unmarked or 'none'}")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main({int(a) for a in sys.argv[1:]}))
