"""Every command-line script answers --help with its usage and exit status 0, and a bad flag with an error line
on stderr and exit status 2 (issue 34). The scripts are found, not listed: each .py file at the top level, in
bench/ or in scripts/ with an `if __name__ == "__main__":` block, so a new script is covered the day it lands.
Each runs as `python X.py ...` (`python -m bench.X ...`) would run it, __main__ block included, through runpy in
this process: torch is imported once for all of them, not once per script."""

import re
import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAIN_BLOCK = re.compile(r'^if __name__ == "__main__":', re.MULTILINE)
SCRIPTS = sorted(
    str(p.relative_to(ROOT))
    for p in [*ROOT.glob("*.py"), *ROOT.glob("bench/*.py"), *ROOT.glob("scripts/*.py")]
    if MAIN_BLOCK.search(p.read_text())
)


def run_script(path, args, monkeypatch, capsys):
    """(exit status, stdout, stderr) of `python PATH ARGS` from the repository root; bench/ modules as
    `python -m bench.NAME ARGS`."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", [str(ROOT / path), *args])
    try:
        if path.startswith("bench/"):
            name = path[: -len(".py")].replace("/", ".")
            monkeypatch.delitem(sys.modules, name, raising=False)  # imported by another bench: python -m has it fresh
            runpy.run_module(name, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(str(ROOT / path), run_name="__main__")
        status = 0
    except SystemExit as e:  # as the interpreter maps it: None is 0, a message is 1
        status = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return status, out, err


def test_the_scripts_are_found():
    assert {
        "train.py",
        "sample.py",
        "prepare_data.py",
        "checkpoint.py",
        "hellaswag.py",
        "dryrun.py",
        "plot_metrics.py",
        "bench/scoreboard.py",
        "scripts/check_ranks.py",
    } <= set(SCRIPTS)


@pytest.mark.parametrize("path", SCRIPTS)
def test_help_prints_the_usage_and_exits_0(path, monkeypatch, capsys):
    status, out, _ = run_script(path, ["--help"], monkeypatch, capsys)
    assert status == 0 and out.startswith("usage: "), out[:500]


@pytest.mark.parametrize("path", SCRIPTS)
def test_a_bad_flag_is_an_error_line_and_exit_status_2(path, monkeypatch, capsys):
    status, out, err = run_script(path, ["--no_such_flag=1"], monkeypatch, capsys)
    assert status == 2 and out == "", (status, out[:500])
    assert re.match(r"\S+: error: \S", err.strip().splitlines()[-1]), err[-500:]
