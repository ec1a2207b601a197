"""The codebase's shape: what a user runs apart from what it imports, who imports whom, and who speaks. The root
holds model.py (the GPT, importing nothing local) and the commands (each with a `__main__` block); every other
module is in the gpt2train package. No root file imports another but model.py, the package imports no root file but
model.py, and nothing forms an import cycle, so each module can be read and tested on its own; each file keeps its
one job (the checkpoint files apart from the run's resume policy, the memory plan apart from the dry run and the
step); every note goes through console.log and every progress bar through console.progress_bar. And what a clone
needs around the code: requirements.txt installs what the scripts import, .gitignore hides what they write.

The size budgets (over_budget) are symptoms, never the goal: a module is split where the split names one job you
can say in a sentence, not where it meets a count, and a wide call becomes a record that names what it carries,
not a dict splatted out of the count's sight (a splat of a function's own dict counts its keys)."""

import ast
import functools
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "gpt2train"


def module_name(path):
    """'train' for a root file, 'gpt2train.step' for a package module, 'bench.gpu' for a bench script."""
    return str(path.relative_to(ROOT).with_suffix("")).replace("/", ".")


def code_files():
    """The root files and the package's modules (not tests, bench/, scripts/, configs/)."""
    return [*sorted(ROOT.glob("*.py")), *sorted((ROOT / PACKAGE).glob("*.py"))]


def parsed():
    """{module name: parsed AST} of the root files and the package's modules."""
    return {module_name(p): ast.parse(p.read_text()) for p in code_files() if p.name != "__init__.py"}


def commands():
    """The root files a user runs: each has a `__main__` block."""
    main_block = re.compile(r'^if __name__ == "__main__":', re.MULTILINE)
    return {p.stem for p in ROOT.glob("*.py") if main_block.search(p.read_text())}


# the imports made when a function is called, not when the module is imported, each with why; left out of the graph
DEFERRED = {("model", "gpt2train.generation"): "GPT.generate, nanoGPT's call, delegates to the decoding loop"}


def imports_by_module():
    """{module: set of project modules it imports} for the root, the package, bench/, scripts/ and configs/ (not
    tests, nor what runs leave in data/ or out*/): root files by their name, package modules as 'gpt2train.x'.
    DEFERRED's imports are not edges."""
    folders = [ROOT / "bench", ROOT / "scripts", ROOT / "configs"]
    files = [*code_files(), *(p for folder in folders for p in folder.rglob("*.py"))]
    roots = {p.stem for p in ROOT.glob("*.py")}
    return {
        module_name(path): local_imports(path, roots) - {d for m, d in DEFERRED if m == module_name(path)}
        for path in files
        if path.name != "__init__.py"
    }


def test_deferred_imports_are_made_inside_a_function_only():
    """A DEFERRED import is one statement inside a function of its module, never at its top level: importing
    model.py alone still imports nothing of the library's."""
    roots = {p.stem for p in ROOT.glob("*.py")}
    for module, dep in DEFERRED:
        path = ROOT / (module.replace(".", "/") + ".py")
        assert dep in local_imports(path, roots), f"{module} no longer imports {dep}: drop it from DEFERRED"
        top = ast.Module(
            body=[n for n in ast.parse(path.read_text()).body if isinstance(n, (ast.Import, ast.ImportFrom))]
        )
        assert not any(
            isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == PACKAGE for n in ast.walk(top)
        ), f"{module} imports {PACKAGE} at its top level"


def local_imports(path, roots):
    """The project modules the file at `path` imports, anywhere in it (inside functions too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
            if node.module == PACKAGE:  # from gpt2train import step, data
                modules = [f"{PACKAGE}.{alias.name}" for alias in node.names]
        else:
            continue
        for m in modules:
            top = m.split(".")[0]
            if top == PACKAGE:
                names.add(".".join(m.split(".")[:2]))
            elif top in roots:
                names.add(top)
    return names


def third_party_imports(path):
    """The top-level names of what the file at `path` imports that is not the project's."""
    roots = {p.stem for p in ROOT.glob("*.py")} | {PACKAGE}
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names - roots


def test_the_root_holds_model_py_and_the_commands_only():
    roots = {p.stem for p in ROOT.glob("*.py")}
    assert roots - commands() == {"model"}, (
        f"root files that are not commands: {sorted(roots - commands() - {'model'})}"
    )
    assert len(roots) <= 13, sorted(roots)  # 11 + ladder.py (issue 55) and sweep.py (issue 56), named by the issues
    assert {"train", "sample", "prepare_data", "hellaswag", "evaluate", "checkpoint", "dryrun"} <= commands()


def test_no_root_file_imports_another_but_model_py():
    """Commands share code only through the package (bench/ and scripts/ may drive the commands)."""
    graph = imports_by_module()
    roots = {p.stem for p in ROOT.glob("*.py")}
    crossings = sorted((m, d) for m in roots for d in graph[m] if "." not in d and d != "model")
    assert not crossings, f"(root file, root file it imports) pairs: {crossings}"


def test_the_package_imports_no_root_file_but_model_py():
    graph = imports_by_module()
    crossings = sorted((m, d) for m, deps in graph.items() if m.startswith(PACKAGE) for d in deps if "." not in d)
    assert crossings and {d for _, d in crossings} == {"model"}, f"(module, root file) pairs: {crossings}"


def test_no_import_cycles():
    graph = {m: deps for m, deps in imports_by_module().items() if not m.startswith(("bench", "scripts", "configs"))}
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
    "matplotlib": "plot_metrics.py, ladder.py's plot",
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
    imported = {
        name: path.name
        for path in code_files()
        for name in third_party_imports(path)
        if name not in sys.stdlib_module_names
    }
    unlisted = {
        name: where
        for name, where in imported.items()
        if name.lower() not in listed and PULLED_IN.get(name) not in listed and name not in OPTIONAL
    }
    assert not unlisted, f"imported but not in requirements.txt: {unlisted}"


def test_docs_document_every_config_key():
    """docs/config.md's key table has a row for every key of config.config_docs(): a new key without one fails here."""
    from gpt2train import config

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
    makers = sorted(module_name(p) for p in code_files() if "tqdm" in third_party_imports(p))
    assert makers == ["gpt2train.console"], makers


def test_each_file_keeps_its_one_job():
    graph = imports_by_module()
    assert graph["model"] == set(), "model.py imports no project module"
    importers = sorted(m for m, deps in graph.items() if "gpt2train.resume" in deps)
    assert importers == ["train"], f"the resume policy is train.py's alone, imported by {importers}"
    fake = [
        n.module
        for n in ast.walk(parsed()["gpt2train.memory"])
        if isinstance(n, ast.ImportFrom) and n.module and ("fake" in n.module or "_tools" in n.module)
    ]
    assert not fake, f"memory.py plans; the fake-tensor dry run is dryrun.py's: {fake}"
    defines = {
        name: sorted(m for m, tree in parsed().items() for f in tree.body if getattr(f, "name", None) == name)
        for name in ("forward_backward", "clip_gradients", "parallelize", "estimate_memory")
    }
    assert defines["forward_backward"] == defines["clip_gradients"] == ["gpt2train.step"], defines
    assert defines["parallelize"] == ["gpt2train.parallel"] and defines["estimate_memory"] == ["gpt2train.memory"]
    step_users = sorted(m for m, deps in graph.items() if "gpt2train.step" in deps and "." not in m)
    assert {"train", "dryrun"} <= set(step_users), step_users


def test_the_file_layer_knows_no_run():
    """The checkpoint files (checkpoint.py: a file or a sharded directory on disk; sharded.py: a sharded run's DCP save
    and load; files.py) know no run: no run config, no ranks, no parallel layout (a tensor-parallel model's row order
    is converted by the checkpointer, resume.py, which hands sharded.py its adapter) and no optimizer (a sharded
    checkpoint is consolidated from what it holds, not by building the run's AdamW to load it into)."""
    graph = imports_by_module()
    run = {"gpt2train.config", "gpt2train.parallel", "gpt2train.tensor_parallel", "gpt2train.optim"}
    for layer in ("gpt2train.checkpoint", "gpt2train.sharded", "gpt2train.files"):
        assert not graph[layer] & run, f"{layer} is the checkpoint file layer; it imports {sorted(graph[layer] & run)}"


def test_wrapping_runs_nothing_and_no_caller_asks_which_loader_it_holds():
    """parallel.py wraps the model (parallelize takes no loader) and runs no training code (no import of the step
    module); only the data module knows a loader's class: everyone else calls data.Loader's methods."""
    assert "gpt2train.step" not in imports_by_module()["gpt2train.parallel"]
    parallelize = next(f for f in parsed()["gpt2train.parallel"].body if getattr(f, "name", None) == "parallelize")
    assert [a.arg for a in parallelize.args.args] == ["model", "cfg", "env"]
    asks = [
        f"{name}.py:{n.lineno}"
        for name, tree in parsed().items()
        if name != "gpt2train.data"
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and ast.unparse(n.func) == "isinstance"
        and re.search(r"Loader|Mixture", ast.unparse(n))
    ]
    assert not asks, f"a caller asks which loader it holds: {asks}"


MODULE_LINES, FUNCTION_LINES, CALL_ARGS = 600, 80, 6  # the library's size budgets


def own_dicts(function):
    """{name: its keys} of the names a function binds to a dict display or a dict(...) call."""
    return {
        node.targets[0].id: len(node.value.keys) if isinstance(node.value, ast.Dict) else len(node.value.keywords)
        for node in ast.walk(function)
        if isinstance(node, ast.Assign)
        and isinstance(node.targets[0], ast.Name)
        and (
            isinstance(node.value, ast.Dict)
            or isinstance(node.value, ast.Call)
            and ast.unparse(node.value.func) == "dict"
        )
    }


def call_widths(tree):
    """{call: the arguments it passes} of every call in a module; a **splat of a dict display, or of a name its
    function binds to one, passes that dict's keys."""

    def passed(call, dicts):
        splats = [k.value for k in call.keywords if k.arg is None]
        keys = [len(v.keys) if isinstance(v, ast.Dict) else dicts.get(getattr(v, "id", None), 1) for v in splats]
        return len(call.args) + len(call.keywords) - len(splats) + sum(keys)

    widths = {}
    for scope in [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]:
        dicts = own_dicts(scope) if scope is not tree else {}
        for call in (n for n in ast.walk(scope) if isinstance(n, ast.Call)):
            widths[call] = max(widths.get(call, 0), passed(call, dicts))
    return widths


@functools.cache
def parsed_with_widths(text):
    """A file's AST and its calls' widths, made once per text (the budget test reads a copy of the library after
    each edit it makes)."""
    tree = ast.parse(text)
    return tree, call_widths(tree)


def over_budget(root):
    """What in the library under `root` (its root .py files and the package) breaks a size budget: a module over
    MODULE_LINES lines, a function over FUNCTION_LINES (def to last line, docstring included), a call passing more
    than CALL_ARGS arguments (call_widths: a splatted dict's keys count), unless it builds a record (a dataclass or
    NamedTuple of the library)."""
    files = [*sorted(root.glob("*.py")), *sorted((root / PACKAGE).glob("*.py"))]
    texts = {path.relative_to(root).as_posix(): path.read_text() for path in files}
    trees = {name: (text, *parsed_with_widths(text)) for name, text in texts.items()}
    records = {
        node.name
        for _, tree, _ in trees.values()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        and (
            any("dataclass" in ast.unparse(d) for d in node.decorator_list)
            or any("NamedTuple" in ast.unparse(b) for b in node.bases)
        )
    }
    found = []
    for name, (text, tree, widths) in trees.items():
        if len(text.splitlines()) > MODULE_LINES:
            found.append(f"{name}: {len(text.splitlines())} lines")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > FUNCTION_LINES:
                    found.append(f"{name}:{node.lineno} {node.name}(): {length} lines")
            elif isinstance(node, ast.Call) and widths[node] > CALL_ARGS:
                callee = ast.unparse(node.func)
                if callee.split(".")[-1] not in records:
                    found.append(f"{name}:{node.lineno} {callee}(...): {widths[node]} arguments")
    return found


def test_the_library_keeps_its_size_budgets():
    """No module over 600 lines, no function over 80, no call with more than 6 arguments (a record's aside): a file
    a newcomer reads in one sitting, a function on one screen, a call whose arguments can be told apart."""
    assert not over_budget(ROOT), "\n".join(over_budget(ROOT))


def test_the_size_budgets_catch_a_601_line_module_an_81_line_function_and_a_7_argument_call(tmp_path):
    """In a copy of the library: one line more than a budget allows is caught, a call's 7th argument too when it
    comes in a splatted dict of the function's own, and a record with 7 fields is not."""
    for path in code_files():
        (tmp_path / path.relative_to(ROOT)).parent.mkdir(exist_ok=True)
        shutil.copy(path, tmp_path / path.relative_to(ROOT))
    before = over_budget(tmp_path)  # the library as it is (test_the_library_keeps_its_size_budgets)

    def new():
        return [found for found in over_budget(tmp_path) if found not in before]

    padded = "\n".join(["x = 0"] * MODULE_LINES) + "\n"
    (tmp_path / "padded.py").write_text(padded)
    assert new() == []
    (tmp_path / "padded.py").write_text(padded + "x = 1\n")
    assert new() == ["padded.py: 601 lines"]
    (tmp_path / "padded.py").unlink()
    body = "".join(f"    x{i} = {i}\n" for i in range(FUNCTION_LINES - 1))
    (tmp_path / PACKAGE / "long.py").write_text(f"def f():\n{body}")
    assert new() == []
    (tmp_path / PACKAGE / "long.py").write_text(f"def f():\n{body}    return 0\n")
    assert new() == [f"{PACKAGE}/long.py:1 f(): 81 lines"]
    record = "from dataclasses import dataclass\n\n\n@dataclass\nclass R:\n" + "".join(
        f"    f{i}: int\n" for i in range(7)
    )
    calls = "R(1, 2, 3, 4, 5, 6, 7)\nprint(1, 2, 3, 4, 5, 6)\nprint(1, 2, 3, 4, 5, 6, sep='')\n"
    (tmp_path / PACKAGE / "long.py").write_text(record + calls)
    assert new() == [f"{PACKAGE}/long.py:15 print(...): 7 arguments"]
    six = {f"k{i}": i for i in range(CALL_ARGS)}  # splatted alone, then beside one more argument
    for options in (repr(six), f"dict({', '.join(f'{k}={v}' for k, v in six.items())})"):
        splats = f"def f():\n    options = {options}\n    print(**options)\n    print(0, **options)\n"
        (tmp_path / PACKAGE / "long.py").write_text(splats)
        assert new() == [f"{PACKAGE}/long.py:4 print(...): 7 arguments"]


def test_every_note_goes_through_console_log():
    """print(), tqdm.write and sys.stdout/stderr.write only in console.py, and print() in a script's main()
    (its result: a sample, a --json line, a report); "is there a process group?" is asked of console.distributed()."""
    offenders = []
    for name, tree in parsed().items():
        if name == "gpt2train.console":
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


# the package's parallelism and step code, which reads the run's layout from layout.Env (torchtitan's ParallelDims)
LAYOUT_READERS = ("parallel", "pipeline", "step", "sharded", "layout", "tensor_parallel", "resume")
MODEL_NAMES = {"model", "raw", "raw_model", "compiled", "inner", "gpt", "stage", "module"}  # what holds a model there
MODEL_CLASSES = {"GPT", "StageGPT", "StageModule", "Stage", "Pipeline"}


def model_probes(trees):
    """Where the modules `trees` ({name: AST}) ask the model which parallelism is on: hasattr/getattr/vars/type of a
    name that holds a model, a __dict__ or __class__ probe, an isinstance check against the model's classes, a count
    of its blocks (len(model.transformer.h): a stage is a model short of blocks). The one
    attribute asked is torch.compile's wrapper's (_orig_mod, parallel.unwrapped): what compiled, not how it is laid
    out."""
    found = []
    for name, tree in trees.items():
        for node in ast.walk(tree):
            call = ast.unparse(node.func) if isinstance(node, ast.Call) else ""
            compiled = call in ("hasattr", "getattr") and "'_orig_mod'" in ast.unparse(node)
            first = (
                node.args[0] if call in ("hasattr", "getattr", "vars", "type") and node.args and not compiled else None
            )
            classes = (
                {n.id for n in ast.walk(node.args[-1]) if isinstance(n, ast.Name)} if call == "isinstance" else set()
            )
            counted = node.args[0] if call == "len" and node.args else None
            if (
                isinstance(node, ast.Attribute)
                and node.attr in ("__dict__", "__class__")
                or ast.unparse(counted or ast.Name("")).split(".")[0] in MODEL_NAMES
                or isinstance(first, ast.Name)
                and first.id in MODEL_NAMES
                or classes & MODEL_CLASSES
            ):
                found.append(f"{name}.py:{node.lineno}: {ast.unparse(node)}")
    return found


def test_which_parallelism_is_on_is_read_from_the_layout_never_asked_of_the_model():
    """One record of the layout (layout.Env: the degrees, this rank's coordinates, the one mesh), read by every caller
    (env.pipeline > 1, env.sharded, env.fsdp): no attribute, __dict__ or class probe of the model in the parallelism
    and step code; one mesh builder (init_device_mesh in layout.py only); the pipeline goes through parallelize.
    Each kind of probe is caught (the copies below)."""
    trees = parsed()
    readers = {m: trees[m] for m in ["train", *(f"{PACKAGE}.{m}" for m in LAYOUT_READERS)]}
    assert not model_probes(readers), "read the layout (env), not the model: " + "; ".join(model_probes(readers))
    meshes = [
        f"{m}:{n.lineno}"
        for m, tree in trees.items()
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and ast.unparse(n.func).endswith("init_device_mesh")
    ]
    assert meshes == [f"{PACKAGE}.layout:{meshes[0].split(':')[1]}"], f"one build_mesh (layout.Env): {meshes}"
    build = next(f for f in trees[f"{PACKAGE}.pipeline"].body if getattr(f, "name", None) == "build")
    assert "parallelize" in {ast.unparse(n.func) for n in ast.walk(build) if isinstance(n, ast.Call)}
    for probe in (
        'hasattr(model, "train_step")',
        'getattr(raw_model, "pipeline_group", None)',
        '"deferred_init" in model.__dict__',
        "model.__class__ = StageGPT",
        "isinstance(raw, (GPT, DDP))",
        "len(raw_model.transformer.h) < raw_model.config.n_layer",
    ):
        assert len(model_probes({"copy": ast.parse(probe)})) == 1, probe
