"""The Makefile's demo target, run with a stand-in for the virtual environment's python (no training)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# a python that records its command lines, and as train.py refuses an out_dir holding checkpoints, as train.py does
FAKE_PYTHON = """#!/bin/sh
echo "$@" >> calls.txt
if [ "$1" = train.py ]; then
    if ls out/shakespeare/ckpt_*.pt >/dev/null 2>&1; then echo "holds checkpoints" >&2; exit 2; fi
    mkdir -p out/shakespeare && echo "run $(wc -l < calls.txt)" > out/shakespeare/ckpt_000300.pt
fi
"""


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_demo_twice_starts_over_and_ends_pointing_at_your_own_data(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    (tmp_path / "requirements.txt").touch()
    os.utime(tmp_path / "requirements.txt", (0, 0))
    (venv / ".installed").touch()  # newer than requirements.txt: nothing to install
    make = ["make", "--no-print-directory", "-f", str(ROOT / "Makefile"), "demo", f"VENV={venv}", f"PY={python}"]
    first = subprocess.run(make, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    second = subprocess.run(make, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert first.returncode == 0 and second.returncode == 0, second.stdout + second.stderr
    assert "starting over; the earlier demo run is now out/shakespeare.prev" in second.stdout
    assert (tmp_path / "out/shakespeare.prev/ckpt_000300.pt").read_text() == "run 2\n"  # the first run's, kept
    assert (tmp_path / "out/shakespeare/ckpt_000300.pt").read_text() == "run 5\n"
    lines = second.stdout.splitlines()
    assert (
        lines[-5].startswith("your own text (docs/data.md): make venv")
        and lines[-1] == "  python sample.py --ckpt out/mine"
    )
    for command in ("tokenizer.py", "prepare_data.py --input YOUR_FILES --tokenizer tok/mine", "--data_dir=data/mine"):
        assert any(command in line for line in lines[-4:]), command
