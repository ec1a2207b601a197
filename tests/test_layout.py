"""The codebase's shape: who imports whom, and who speaks. train.py is imported by nobody but tests, library
modules form no import cycle, so each can be read and tested on its own; each file keeps its one job (the
checkpoint files apart from the run's resume policy, the memory plan apart from the dry run, the model apart from
the optimizers); and every note goes through console.log."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENTRY_POINTS = {"train"}  # the training script: its functions are not an API


def library():
    """{module name: parsed AST} of the top-level modules (the library and its scripts)."""
    return {p.stem: ast.parse(p.read_text()) for p in sorted(ROOT.glob("*.py"))}


def imports_by_module():
    """{module: set of top-level repo modules it imports} for the library, bench/, scripts/ and configs/ (not tests,
    nor what runs leave in data/ or out*/)."""
    folders = [ROOT / "bench", ROOT / "scripts", ROOT / "configs"]
    files = [*ROOT.glob("*.py"), *(p for folder in folders for p in folder.rglob("*.py"))]
    local = {p.stem for p in ROOT.glob("*.py")}
    graph = {}
    for path in files:
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        graph[str(path.relative_to(ROOT).with_suffix("")).replace("/", ".")] = names & local
    return graph


def test_no_module_imports_an_entry_point():
    offenders = {m: deps & ENTRY_POINTS for m, deps in imports_by_module().items() if deps & ENTRY_POINTS - {m}}
    assert not offenders, f"entry points imported by library code: {offenders}"


def test_no_import_cycles():
    graph = {m: deps for m, deps in imports_by_module().items() if "." not in m}
    state = {}

    def visit(m, path):
        if state.get(m) == "done":
            return
        assert state.get(m) != "open", f"import cycle: {' -> '.join(path + [m])}"
        state[m] = "open"
        for dep in graph.get(m, ()):
            visit(dep, path + [m])
        state[m] = "done"

    for module in graph:
        visit(module, [])


def test_docs_document_every_config_key():
    """docs/config.md's key table is generated from config.config_docs(): a new key without a row fails here."""
    import config
    table = (ROOT / "docs" / "config.md").read_text()
    missing = [key for key in config.config_docs() if f"| `{key}` |" not in table]
    assert not missing, f"docs/config.md's key table lacks {missing}: regenerate it (config.key_table())"


def test_each_file_keeps_its_one_job():
    graph = imports_by_module()
    assert not graph["checkpoint"] & {"config", "parallel"}, "checkpoint.py is the file layer: no run config, no ranks"
    assert graph["model"] == set(), "model.py imports no project module"
    importers = sorted(m for m, deps in graph.items() if "resume" in deps)
    assert importers == ["train"], f"the resume policy is train.py's alone, imported by {importers}"
    fake = [n.module for n in ast.walk(library()["memory"]) if isinstance(n, ast.ImportFrom) and n.module
            and ("fake" in n.module or "_tools" in n.module)]
    assert not fake, f"memory.py plans; the fake-tensor dry run is dryrun.py's: {fake}"


def test_every_note_goes_through_console_log():
    """print(), tqdm.write and sys.stdout/stderr.write only in console.py, and print() in a script's main()
    (its result: a sample, a --json line, a report); "is there a process group?" is asked of console.distributed()."""
    offenders = []
    for name, tree in library().items():
        if name == "console":
            continue
        mains = {id(n) for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "main" for n in ast.walk(f)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            call = ast.unparse(node.func)
            writes = call in ("tqdm.write", "sys.stdout.write", "sys.stderr.write")
            if call == "print" and id(node) not in mains or writes or call.endswith("dist.is_initialized"):
                offenders.append(f"{name}.py:{node.lineno}: {call}")
    assert not offenders, f"speak through console.log (ask console.distributed()): {offenders}"
