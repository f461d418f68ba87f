"""
Negative controls for the emulated CUDA tests: remove each stream-ordering statement of offload.py,
prefetch.py and pools.py in turn (it becomes `pass`, same indentation; the other lines of a
statement broken over several become blank) in a temporary copy of the repository, and expect
tests/test_cuda_emulated.py to fail every time. A mutant that survives is a wait no test needs:
either a missing test or a redundant wait.

    python tests/mutate_waits.py  # every ordering statement; exit 1 if one survives
    python tests/mutate_waits.py offload.py:258 pools.py:88  # only the statements starting there

An ordering statement is a wait_event / wait_stream / synchronize / record / record_stream call, or
any statement tagged "# rule N" (on one of its lines, or in the comment lines right above it); calls
without the tag are mutated too, and reported as unmarked.
"""
import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = ("offload.py", "prefetch.py", "pools.py")
ORDERING = re.compile(r"\.(wait_event|wait_stream|synchronize|record|record_stream)\(")
RULE = re.compile(r"#.*\brule (\d)")
SKIP = {".git", ".venv", ".ci-venv", "__pycache__", ".pytest_cache", "kv_cache_offload", ".whl"}
TESTS = ["tests/test_cuda_emulated.py", "-x", "-q", "-p", "no:cacheprovider", "--tb=short"]


def statements(source):
    """{first line: last line} of every simple statement of a file (not compound statements, whose
    bodies are walked, nor docstrings)."""
    spans = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.stmt) or hasattr(node, "body"):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue
        spans[node.lineno] = max(node.end_lineno, spans.get(node.lineno, 0))
    return spans


def comment_above(lines, first):
    """The comment lines right above line `first` (1-based), joined: a tag there is the
    statement's."""
    above = []
    i = first - 2
    while i >= 0 and lines[i].strip().startswith("#"):
        above.insert(0, lines[i].strip())
        i -= 1
    return " ".join(above)


def ordering_lines(source):
    """(first line number, text) of every stream-ordering statement of a file's code, its text with
    the comment above it and its lines joined."""
    lines = source.splitlines()
    out = []
    for first, last in sorted(statements(source).items()):
        own = lines[first - 1:last]
        code = " ".join(line.split("#", 1)[0] for line in own)
        tagged = " ".join([comment_above(lines, first)] + [line.strip() for line in own])
        if ORDERING.search(code) or RULE.search(tagged):
            out.append((first, tagged.strip()))
    return out


def mutate(source, n):
    """The statement starting on line n becomes `pass` (its other lines blank, so that every line
    keeps its number); `(e := expr).record(...)` becomes `e = expr` (the event stays, its record
    goes)."""
    last = statements(source)[n]
    lines = source.splitlines(keepends=True)
    text = lines[n - 1]
    indent = text[:len(text) - len(text.lstrip())]
    walrus = re.match(r"\s*\((\w+) := (.+)\)\.record\(", text)
    if walrus:
        lines[n - 1] = f"{indent}{walrus.group(1)} = {walrus.group(2)}\n"
    else:
        lines[n - 1] = f"{indent}pass\n"
    lines[n:last] = ["\n"] * (last - n)
    return "".join(lines)


def first_failure(output):
    """The first problem the emulator named (else the first assertion or error line pytest printed),
    shortened."""
    errors = [line[2:].strip() for line in output.splitlines()
              if line.startswith("E ") and len(line.strip()) > 2]
    for line in errors:
        if line.startswith(("race on", "waits on an event", "store closed", "offload.py")):
            return line[:400]
    for line in errors:
        return line[:400]
    tail = [ln for ln in output.splitlines() if ln.strip()]
    return tail[-1][:240] if tail else "(no output)"


def main(only=()):
    sources = {}
    for f in FILES:
        with open(os.path.join(ROOT, f)) as src:
            sources[f] = src.read()
    targets = [(f, n, t) for f in FILES for n, t in ordering_lines(sources[f])
               if not only or (f, n) in only]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    survivors = []
    unmarked = []
    with tempfile.TemporaryDirectory(prefix="mutate_waits_") as tmp:
        copy = os.path.join(tmp, "repo")
        shutil.copytree(ROOT, copy, ignore=skipped)
        clean = subprocess.run([sys.executable, "-m", "pytest", *TESTS], cwd=copy, env=env,
                               capture_output=True, text=True)
        if clean.returncode != 0:
            sys.exit("the unmutated tests fail; fix them first:\n" + clean.stdout[-3000:])
        for f, n, text in targets:
            rule = RULE.search(text)
            if not rule:
                unmarked.append(f"{f}:{n}")
            with open(os.path.join(copy, f), "w") as out:
                out.write(mutate(sources[f], n))
            t = time.time()
            try:
                r = subprocess.run([sys.executable, "-m", "pytest", *TESTS], cwd=copy, env=env,
                                   capture_output=True, text=True, timeout=600)
                rc = r.returncode
                output = r.stdout + r.stderr
            except subprocess.TimeoutExpired:
                rc = -1
                output = "timed out (a hang counts as caught)"
            finally:
                with open(os.path.join(copy, f), "w") as out:
                    out.write(sources[f])
            killed = rc != 0
            if not killed:
                survivors.append(f"{f}:{n}")
            label = f"rule {rule.group(1)}" if rule else "unmarked"
            verdict = "caught  " if killed else "SURVIVED"
            print(f"{f}:{n:<4d} [{label:8s}] {verdict} {time.time() - t:5.1f}s  {text.strip()}")
            if killed:
                summary = next((ln[2:].strip() for ln in output.splitlines()
                                if ln.startswith("E ") and "problems (" in ln), "")
                test = next((ln.split(" - ")[0][len("FAILED "):] for ln in output.splitlines()
                             if ln.startswith("FAILED ")), "")
                print(f"           {test}\n"
                      f"           {summary}\n"
                      f"           {first_failure(output)}")
            sys.stdout.flush()
    for f in FILES:
        with open(os.path.join(ROOT, f)) as out:
            assert out.read() == sources[f], f"the repository's {f} must be untouched"
    caught = len(targets) - len(survivors)
    print(f"{len(targets)} mutants, {caught} caught, survived: {survivors or 'none'}; "
          f"ordering lines without a '# rule N' comment: {unmarked or 'none'}")
    return 1 if survivors else 0


def skipped(directory, names):
    """What the copy of the repository leaves out."""
    return [name for name in names if name in SKIP]


def parse_target(arg):
    """A command-line target: pools.py:88 -> ("pools.py", 88); a bare number is a line of
    offload.py."""
    if ":" in arg:
        f, n = arg.split(":")
        return f, int(n)
    return "offload.py", int(arg)


if __name__ == "__main__":
    sys.exit(main({parse_target(a) for a in sys.argv[1:]}))
