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

# The top level: the core in reading order, what it leans on, and the commands a user types. The
# operations live in folders (FOLDERS), which import the top level and never the other way round.
CORE = ("generate", "speculate", "kvcache", "kvbatch", "attention", "fewrows", "policy", "offload",
        "prefetch", "pools", "disk", "model", "verify")
LEANS_ON = ("rope", "checkpoint", "kvlayout", "tokenizer", "quantize", "rowwise", "private")
COMMANDS = ("bench", "probe", "tune", "doctor", "chat")  # thin files: a __main__ that hands over
# folder -> the folders (besides the top level) its modules may import: measure/ runs the
# operations in runs/, runs/ never measures
FOLDERS = {"runs": (), "measure": ("runs",)}


def top_modules():
    return sorted(f[:-3] for f in os.listdir(ROOT) if f.endswith(".py"))


def folder_modules(folder):
    return sorted(f"{folder}.{f[:-3]}" for f in os.listdir(os.path.join(ROOT, folder))
                  if f.endswith(".py") and f != "__init__.py")


def project_modules():
    return top_modules() + [m for folder in FOLDERS for m in folder_modules(folder)]


def read(*path):
    """The text of a file of the repository."""
    with open(os.path.join(ROOT, *path), encoding="utf-8") as f:
        return f.read()


def source(module):
    """The text of a module: 'model' is model.py, 'runs.task' is runs/task.py."""
    *folder, name = module.split(".")
    return read(*folder, name + ".py")


def imports_of(module, main_too=False):
    """Project modules `module` imports anywhere (function-local imports too), except in its
    `__main__` block unless main_too: that block runs only when the file is the script, where a
    command hands over to the operations that run it."""
    tree = ast.parse(source(module))
    main_blocks = [n for n in tree.body
                   if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
    skip = set() if main_too else {id(n) for block in main_blocks for n in ast.walk(block)}
    known = set(project_modules())
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from runs import task` imports runs.task; `from runs.task import x` too
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if name in known:
                found.add(name)
    return found - {module}


def test_the_top_level_is_the_core_what_it_leans_on_and_the_commands():
    placed = set(CORE) | set(LEANS_ON) | set(COMMANDS)
    stray = set(top_modules()) - placed
    assert not stray, (f"{stray} at the top level: the core, what it leans on and the commands "
                       f"only; operations go in {sorted(FOLDERS)}")
    for folder in FOLDERS:
        assert os.path.isfile(os.path.join(ROOT, folder, "__init__.py")), folder


def test_the_top_level_imports_no_operations():
    """Nothing at the top level imports from the folders, except a command's __main__ block."""
    for m in top_modules():
        up = {d for d in imports_of(m) if "." in d}
        assert not up, f"{m}.py imports {sorted(up)} outside its __main__ block"


def test_commands_are_thin():
    """A command at the top level is its __main__ block: it hands over to measure/."""
    for m in COMMANDS:
        tree = ast.parse(source(m))
        body = [n for n in tree.body if not (isinstance(n, ast.Expr)
                                             and isinstance(n.value, ast.Constant))]
        assert all(isinstance(n, (ast.Import, ast.If)) for n in body), m
        assert len(source(m).splitlines()) <= 25, m


def test_folders_import_down_and_no_module_is_in_a_cycle():
    graph = {m: imports_of(m, main_too=True) for m in project_modules()}
    for m, deps in graph.items():
        if "." in m:
            folder = m.split(".")[0]
            allowed = (folder,) + FOLDERS[folder]
            bad = [d for d in deps if "." in d and d.split(".")[0] not in allowed]
            assert not bad, f"{m} imports {bad}"
    state = {}

    def visit(m, path):  # depth-first search for a back edge, __main__ hand-overs included
        state[m] = "open"
        for d in sorted(graph[m]):
            assert state.get(d) != "open", f"import cycle: {' -> '.join(path + [m, d])}"
            if d not in state:
                visit(d, path + [m])
        state[m] = "done"
    # a command's hand-over (generate.py, verify.py -> runs/) runs the operations that import the
    # core module again: graph[m] for those holds only what the module imports as a library
    for m in COMMAND_MAINS:
        graph[m] = imports_of(m)
    for m in graph:
        if m not in state:
            visit(m, [])


# core files whose __main__ hands over to runs/ (the operations then import them as libraries: the
# same module, aliased in sys.modules, not a second copy)
COMMAND_MAINS = ("generate", "verify")


def test_the_proof_and_the_core_import_only_the_core():
    """verify.py's closure outside its __main__ is the core and what it leans on."""
    allowed = set(CORE) | set(LEANS_ON)
    seen = set()
    todo = ["verify"]
    while todo:
        m = todo.pop()
        seen.add(m)
        todo += [d for d in imports_of(m) if d not in seen]
    assert seen <= allowed, f"verify.py's closure reaches {sorted(seen - allowed)}"
    for m in CORE:
        assert imports_of(m) <= allowed, (m, imports_of(m))


def test_the_network_knows_nothing_of_the_features():
    """No isinstance on the cache in model.py, no tensor-parallel attribute, quantize.py imported
    only where --quantize switches it on."""
    text = source("model")
    tree = ast.parse(text)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "isinstance":
            assert "cache" not in ast.unparse(node.args[0]), ast.unparse(node)
    attributes = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert not {a for a in attributes if "reduce" in a or "local" in a}, attributes
    assert "distributed" not in text
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert not any("quantize" in ast.unparse(n) for n in top)


def readme_block(after_heading):
    text = read("README.md")
    section = text[text.index(after_heading):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_python_snippet_runs_as_written(tmp_path):
    """The README's core snippet: load a checkpoint, build a cache with offload, generate, with the
    core files only."""
    code = readme_block("## Python API")
    assert len(code.strip().splitlines()) <= 18, "the core snippet should stay about ten lines"
    modules = {m.split(".")[0] for m in re.findall(r"^(?:from|import) (\S+)", code, re.M)}
    core = {"model", "offload", "kvcache", "generate", "tokenizer"}
    assert modules <= {"torch", "tempfile"} | core, modules
    # run from elsewhere, as the README says: the repository on PYTHONPATH, the checkpoint's path in
    # full; its temporary directory must be gone afterwards
    code = code.replace('"assets/tinyllama-pydoc"', repr(os.path.join(ROOT, "assets",
                                                                      "tinyllama-pydoc")))
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "TMPDIR": str(scratch)}
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    # it printed text and where the chunks were, and left nothing behind
    assert "disk" in p.stdout and p.stdout.strip(), p.stdout
    ours = [f for f in os.listdir(scratch) if not f.startswith("torchinductor")]  # torch's own
    assert not ours, ours


CORE_BUDGET = 450  # lines at 100 columns: a core file a reader takes in at one sitting


def test_core_files_stay_short():
    """The budget is by idea: the core files stay short enough to read in one sitting; the others
    are as long as their one idea needs."""
    lines = {f"{m}.py": len(read(m + ".py").splitlines()) for m in CORE}
    over = {f: n for f, n in lines.items() if n > CORE_BUDGET}
    assert not over, (f"core files over {CORE_BUDGET} lines: {over}; "
                      f"is there a second idea to move out?")


def test_readme_stays_short():
    """The README is the reading order, the pitch, install, quick start, verify and how it works;
    operational material goes to docs/."""
    assert len(read("README.md").splitlines()) <= 250


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
    sources = "".join(source(m) for m in project_modules())
    checked = 0
    for token, call in re.findall(r"`([A-Za-z_][\w.]*)(\([^`]*\))?`", text):
        head, *rest = token.split(".")
        if rest in (["py"], ["md"], ["json"]):  # a file's name, not a function
            continue
        # a function of ours, named bare: decode_one_token(...), _advise
        bare_function = (not rest and "_" in token and (call or token.startswith("_"))
                         and token.islower() and not hasattr(os, token))
        if head in top_modules() and rest:
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
