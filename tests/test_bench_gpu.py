"""bench/gpu.py, the GPU acceptance run: its CPU-checkable parts (python -m bench.gpu --device=cpu --tiny)
pass, a wrong result fails the run, and its verdicts are right."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpu

ROOT = Path(__file__).resolve().parent.parent


def table_rows(stdout):
    """{check: (result, status)} from the printed table (columns are separated by two or more spaces)."""
    lines = stdout[stdout.index("check ") :].splitlines()[2:]
    rows = {}
    for line in lines:
        if not line.strip() or line.startswith("FAILED"):
            break
        cells = [c for c in line.split("  ") if c.strip()]
        rows[cells[0].strip()] = (cells[1].strip(), cells[-1].strip())
    return rows


def test_memory_plan_may_be_loose_but_must_not_underestimate():
    assert gpu.memory_verdict(predicted_bytes=10 << 30, measured_bytes=6 << 30) == ("PASS", 0.6)
    assert gpu.memory_verdict(predicted_bytes=10 << 30, measured_bytes=11 << 30)[0] == "PASS"  # within 10%
    assert gpu.memory_verdict(predicted_bytes=10 << 30, measured_bytes=12 << 30)[0] == "FAIL"


def test_report_fails_on_any_failed_row():
    report = gpu.Report()
    report.add("train", "1,000 tokens/s", "-", "INFO")
    report.add("ddp", "needs >= 2 GPUs", "-", "SKIP")
    assert not report.failed()
    report.add("chunked loss (float32)", "|diff| 1.0e+00", "<= 0.0001", "FAIL")
    assert report.failed()
    assert table_rows(report.table())["chunked loss (float32)"] == ("|diff| 1.0e+00", "FAIL")


def test_without_a_gpu_it_asks_for_tiny(capsys):
    with pytest.raises(SystemExit) as exit_:
        gpu.main(["--device=cpu"])
    assert exit_.value.code == 2 and "use --tiny" in capsys.readouterr().err


@pytest.mark.slow
def test_tiny_cpu_run_passes_every_check_it_can_run_and_prints_one_table():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "bench.gpu", "--device=cpu", "--tiny", "--nproc=2"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    rows = table_rows(result.stdout)
    assert {check: status for check, (_, status) in rows.items()} == {
        "train": "INFO",
        "compile": "SKIP",
        "chunked loss (float32)": "PASS",
        "chunked loss (bfloat16)": "PASS",
        "hellaswag": "PASS",
        "memory plan": "INFO" if (ROOT / "memory.py").exists() else "SKIP",
        "ddp": "PASS",
        **({"fsdp": "PASS"} if "parallel" in gpu.TrainConfig.__dataclass_fields__ else {}),
        "sigterm": "PASS",
        "host syncs": "SKIP",
        "sync debug": "SKIP",
        "oom": "SKIP",
        "fsdp bf16": "SKIP",
        "ddp x8": "SKIP",
        "1558m memory": "SKIP",
    }
    assert "tokens/s" in rows["train"][0] and "2 ranks vs 1 process x 2 accumulation steps" in rows["ddp"][0]
    assert "stopped after step " in rows["sigterm"][0] and "max |loss diff| 0.0e+00" in rows["sigterm"][0]


@pytest.mark.slow
def test_a_wrong_result_fails_the_run(capsys, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert gpu.main(["--device=cpu", "--tiny", "--inject=chunked"]) == 1
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert rows["chunked loss (float32)"][1] == "FAIL" and rows["chunked loss (bfloat16)"][1] == "FAIL"
    assert rows["hellaswag"][1] == "PASS" and "FAILED" in out
