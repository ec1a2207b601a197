"""The codebase's shape: who imports whom, and who speaks. train.py is imported by nobody but tests, no command is
imported by another root module, library modules form no import cycle, so each can be read and tested on its own;
each file keeps its one job (the checkpoint files apart from the run's resume policy, the memory plan apart from the
dry run, the model apart from the optimizers); every note goes through console.log and every progress bar through
console.progress_bar. And what a clone needs around the code: requirements.txt installs what the scripts import,
.gitignore hides what they write."""

import ast
import re
import shutil
import subprocess
from pathlib import Path

import pytest

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
    return {
        str(path.relative_to(ROOT).with_suffix("")).replace("/", "."): top_level_imports(path) & local for path in files
    }


def top_level_imports(path):
    """The top-level package names the file at `path` imports, anywhere in it (inside functions too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_no_module_imports_an_entry_point():
    offenders = {m: deps & ENTRY_POINTS for m, deps in imports_by_module().items() if deps & ENTRY_POINTS - {m}}
    assert not offenders, f"entry points imported by library code: {offenders}"


def commands():
    """The root files a user runs: each has a `__main__` block. checkpoint.py aside until the package move: it is the
    library's checkpoint module, with the `python checkpoint.py` command as a block at its bottom."""
    main_block = re.compile(r'^if __name__ == "__main__":', re.MULTILINE)
    return {p.stem for p in ROOT.glob("*.py") if main_block.search(p.read_text())} - {"checkpoint"}


def test_no_root_module_imports_a_command():
    """Commands share code only through library modules, and a library module is never a command (bench/ and
    scripts/ may drive the commands). train.py's evaluation hooks import hellaswag.py and evaluate.py until their
    scaffold moves into the library (issue 37)."""
    waiting = {("train", "hellaswag"), ("train", "evaluate")}
    graph = {m: deps for m, deps in imports_by_module().items() if "." not in m}
    crossings = sorted((m, c) for m, deps in graph.items() for c in deps & commands() - {m} if (m, c) not in waiting)
    assert not crossings, f"(importer, command) pairs: {crossings}"


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


# packages the scripts import that requirements.txt does not list, and why that is right
PULLED_IN = {"huggingface_hub": "datasets", "pyarrow": "datasets", "tiktoken_ext": "tiktoken"}  # -> who installs it
OPTIONAL = {
    "wandb": "wandb_log=True",
    "tensorboard": "tensorboard_dir",
    "matplotlib": "plot_metrics.py",
    "tokenizers": "a model directory's own tokenizer.json",
}


def test_requirements_txt_installs_what_the_scripts_import():
    """The README's set-up (requirements.txt) runs every command it lists, `checkpoint.py export` included: each
    third-party package a top-level module imports is listed, pulled in by one that is, or an optional extra."""
    import sys

    listed = {
        re.split(r"[<>=!~ ;\[]", line.split("#")[0].strip())[0].lower().replace("-", "_")
        for line in (ROOT / "requirements.txt").read_text().splitlines()
        if line.split("#")[0].strip()
    }
    local = {p.stem for p in ROOT.glob("*.py")}
    imported = {
        name: path.name
        for path in sorted(ROOT.glob("*.py"))
        for name in top_level_imports(path)
        if name not in local and name not in sys.stdlib_module_names
    }
    unlisted = {
        name: where
        for name, where in imported.items()
        if name.lower() not in listed and PULLED_IN.get(name) not in listed and name not in OPTIONAL
    }
    assert not unlisted, f"imported but not in requirements.txt: {unlisted}"


def test_docs_document_every_config_key():
    """docs/config.md's key table has a row for every key of config.config_docs(): a new key without one fails here."""
    import config

    table = (ROOT / "docs" / "config.md").read_text()
    missing = [key for key in config.config_docs() if f"| `{key}` |" not in table]
    assert not missing, (
        f"docs/config.md's key table lacks {missing}: add a row per key, as `python train.py --help` says"
    )


def test_what_the_documented_commands_write_is_ignored_by_git():
    """README's and docs/'s commands write these at the root of a clone: none shows up in `git status`."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    written = [
        "out/shakespeare/ckpt_000300.pt",
        "data/shakespeare/x_train_000000.bin",
        "hf_out/model.safetensors",
        "hf_shakespeare/config.json",
        "runs/shakespeare/events",
        "wandb/run-1/files",
        "lm_eval_out/results.json",
        "tok/mine/tokenizer.json",
        "harness_tasks/gpt2train_piqa.yaml",
    ]
    shown = subprocess.run(
        ["git", "check-ignore", "--no-index", "--verbose", "--non-matching", *written],
        cwd=ROOT,
        check=False,
        capture_output=True,
        text=True,
    ).stdout.splitlines()  # exit 1: one not ignored
    assert not [line for line in shown if line.startswith("::")], shown


def test_every_progress_bar_is_consoles():
    """console.progress_bar is the one bar (on a terminal only): no other module makes its own with tqdm."""
    makers = sorted(p.name for p in ROOT.glob("*.py") if "tqdm" in top_level_imports(p))
    assert makers == ["console.py"], makers


def test_each_file_keeps_its_one_job():
    graph = imports_by_module()
    assert not graph["checkpoint"] & {"config", "parallel"}, "checkpoint.py is the file layer: no run config, no ranks"
    assert graph["model"] == set(), "model.py imports no project module"
    importers = sorted(m for m, deps in graph.items() if "resume" in deps)
    assert importers == ["train"], f"the resume policy is train.py's alone, imported by {importers}"
    fake = [
        n.module
        for n in ast.walk(library()["memory"])
        if isinstance(n, ast.ImportFrom) and n.module and ("fake" in n.module or "_tools" in n.module)
    ]
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
