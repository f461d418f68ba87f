"""
The house: imports flow one way (a layer imports only layers below it or beside it, never above,
and no cycle), the core runs alone from the README's Python snippet, and the core files stay within
their line budget.
"""
import ast
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# top to bottom: each row may import the rows below it (and its own row, without a cycle)
LAYERS = [
    # measure and prove
    {"bench", "probe", "verify", "tune", "doctor"},
    # flags, checks, generate.py's main
    {"cli"},
    # tasks, resume, torchrun, trace; the tasks in flight sharing their decode steps
    {"batch", "batcher", "task", "taskdir", "monitor", "launch"},
    # the loop
    {"generate"},
    # the network, text <-> ids; a batch's rows through a linear, each its own bits
    {"model", "rope", "quantize", "rowwise", "tp", "tokenizer", "progress", "random_model"},
    # chunks as attention sees them and their layouts; the files
    {"kvcache", "kvlayout", "checkpoint"},
    # where bytes live and move; the policy that decides what is read, evicted and placed; private
    # directories and files
    {"offload", "kvstore", "disk", "pools", "policy", "private", "cores"},
]
RANK = {m: i for i, row in enumerate(LAYERS) for m in row}


def project_modules():
    return sorted(f[:-3] for f in os.listdir(ROOT) if f.endswith(".py"))


def read(*path):
    """The text of a file of the repository."""
    with open(os.path.join(ROOT, *path), encoding="utf-8") as f:
        return f.read()


def imports_of(module):
    """Project modules `module` imports anywhere (function-local imports too), except in its
    `__main__` block: that block runs only when the file is the script, where a script may hand over
    to the layer above it."""
    tree = ast.parse(read(module + ".py"))
    main_blocks = [n for n in tree.body
                   if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
    skip = {id(n) for block in main_blocks for n in ast.walk(block)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found & set(project_modules())


def test_every_module_has_a_layer():
    unplaced = set(project_modules()) - set(RANK)
    assert not unplaced, f"place these modules in LAYERS: {unplaced}"


def test_imports_flow_down_and_have_no_cycle():
    graph = {m: imports_of(m) for m in project_modules()}
    upward = [(m, d) for m, deps in graph.items() for d in deps if RANK[d] < RANK[m]]
    assert not upward, f"imports from a layer above: {upward}"
    state = {}

    def visit(m, path):  # depth-first search for a back edge
        state[m] = "open"
        for d in sorted(graph[m]):
            assert state.get(d) != "open", f"import cycle: {' -> '.join(path + [m, d])}"
            if d not in state:
                visit(d, path + [m])
        state[m] = "done"
    for m in graph:
        if m not in state:
            visit(m, [])


def test_core_imports_nothing_above_the_loop():
    core = {"model", "rope", "checkpoint", "kvcache", "kvlayout", "offload", "disk", "pools",
            "policy", "generate", "tokenizer"}
    allowed = core | {"quantize", "rowwise", "tp", "progress", "kvstore", "private"}
    for m in core:
        assert imports_of(m) <= allowed, (m, imports_of(m))


def readme_block(after_heading):
    text = read("README.md")
    section = text[text.index(after_heading):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_python_snippet_runs_as_written(tmp_path):
    """The README's core snippet: load a checkpoint, build a cache with offload, generate, with the
    core files only."""
    code = readme_block("## Python API")
    assert len(code.strip().splitlines()) <= 16, "the core snippet should stay about ten lines"
    modules = {m.split(".")[0] for m in re.findall(r"^(?:from|import) (\S+)", code, re.M)}
    assert modules <= {"torch", "model", "offload", "kvcache", "generate", "tokenizer"}, modules
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    # it printed text and where the chunks were
    assert "disk" in p.stdout and p.stdout.strip(), p.stdout


CORE_BUDGET = 450  # lines at 100 columns: a core file a reader takes in at one sitting


def test_core_files_stay_short():
    """The budget is by idea: the core files (the network, the cache, the tiers, the loop) stay
    short enough to read in one sitting; the others are as long as their one idea needs."""
    core = ("model.py", "kvcache.py", "offload.py", "pools.py", "disk.py", "generate.py")
    lines = {f: len(read(f).splitlines()) for f in core}
    over = {f: n for f, n in lines.items() if n > CORE_BUDGET}
    assert not over, (f"core files over {CORE_BUDGET} lines: {over}; "
                      f"is there a second idea to move out?")


def test_nothing_points_outside_the_repository():
    # spelled apart, so that this file passes its own test
    outside = ("../" + "shared", "DESIGN" + ".md")
    for dirpath, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("__pycache__", "assets")]
        for f in files:
            if f.endswith((".py", ".md", ".sh", ".txt")):
                with open(os.path.join(dirpath, f), encoding="utf-8", errors="replace") as fh:
                    text = fh.read()
                assert not any(o in text for o in outside), os.path.join(dirpath, f)


def test_walkthrough_names_functions_that_exist():
    """docs/walkthrough.md teaches by naming functions: every `module.name` and every `name(...)` it
    names exists."""
    import importlib
    text = read("docs", "walkthrough.md")
    sources = "".join(read(m + ".py") for m in project_modules())
    checked = 0
    for token, call in re.findall(r"`([A-Za-z_][\w.]*)(\([^`]*\))?`", text):
        head, *rest = token.split(".")
        if rest in (["py"], ["md"], ["json"]):  # a file's name, not a function
            continue
        # a function of ours, named bare: decode_one_token(...), _advise
        bare_function = (not rest and "_" in token and (call or token.startswith("_"))
                         and token.islower() and not hasattr(os, token))
        if head in project_modules() and rest:
            obj = importlib.import_module(head)
            for attr in rest:
                # AttributeError: the walkthrough names something that is not there
                obj = getattr(obj, attr)
            checked += 1
        elif bare_function:
            assert re.search(rf"def {token}\(", sources), (
                f"docs/walkthrough.md names {token}, which no file defines")
            checked += 1
    assert checked >= 15, checked
