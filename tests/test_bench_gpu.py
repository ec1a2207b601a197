"""bench/gpu.py, the GPU acceptance run: its CPU-checkable parts (python -m bench.gpu --device=cpu --tiny)
pass, a wrong result fails the run, and its verdicts are right."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bench import gpu
from gpt2train import memory
from gpt2train.config import make_config, model_config, parse_args
from gpt2train.optim import product_dtype

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


def bench_gpu(args, env):
    """Run `python -m bench.gpu ARGS`; it must exit 0. Returns its table's rows."""
    result = subprocess.run(
        [sys.executable, "-m", "bench.gpu", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    return table_rows(result.stdout)


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
    rows = bench_gpu(["--device=cpu", "--tiny", "--nproc=2"], env)
    assert {check: status for check, (_, status) in rows.items()} == {
        "train": "INFO",
        "compile": "SKIP",
        "chunked loss (float32)": "PASS",
        "chunked loss (bfloat16)": "PASS",
        "hellaswag": "PASS",
        "memory plan": "INFO",
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
    monkeypatch.setattr(gpu, "check_sigterm_resume", lambda *a: None)  # 3 runs of 60 steps this test does not read
    assert gpu.main(["--device=cpu", "--tiny", "--inject=chunked"]) == 1
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert rows["chunked loss (float32)"][1] == "FAIL" and rows["chunked loss (bfloat16)"][1] == "FAIL"
    assert rows["hellaswag"][1] == "PASS" and "FAILED" in out


def steps(peaks, micro_batch):
    """metrics.jsonl step records with these peaks (MiB), at one micro-batch."""
    return [
        {
            "step": i + 1,
            "train_loss": 3.0,
            "tokens_per_s": 1000.0,
            "mfu": 0.4,
            "peak_mem_mb": p,
            "micro_batch": micro_batch,
        }
        for i, p in enumerate(peaks)
    ]


def test_memory_rows_plan_at_the_micro_batch_run_and_keep_step_1_apart_from_the_steady_steps(monkeypatch):
    """1558m memory: the run halved its micro-batch 16 to 8 (an out-of-memory), and step 1's peak holds the
    process's start and compile's first call: the plan is at 8, step 1 is reported apart, and the verdict is on
    the steady steps (>= 3: step 2 may still hold first-call costs). No 1.5B dry run on the GPU host's CPU (it
    agrees with the plan: docs/dry-run.md)."""
    monkeypatch.setitem(sys.modules, "dryrun", None)  # importing it fails
    cfg = make_config(parse_args([str(gpu.ROOT / "configs" / "gpt2_1558m.py")]))
    plan = memory.estimate_memory(model_config(cfg), 8, dtype="bfloat16", optimizer=cfg.optimizer).total / 2**20
    records = steps([2.0 * plan, 1.5 * plan, 1.05 * plan, 1.0 * plan], micro_batch=8)
    monkeypatch.setattr(gpu, "run_train", lambda *a, **k: (0, "", records))
    report = gpu.Report()
    gpu.check_1558m_memory(report, SimpleNamespace(tiny=False, device="cuda:0"), "/unused", "/unused")
    [(check, result, reference, status)] = report.rows
    assert status == "PASS" and reference.startswith("steps >= 3 <= 1.10x planned")
    assert f"planned {plan / 1024:.2f} GiB at micro-batch 8" in result
    assert "step 1 " in result and "(2.00x)" in result and "steps >= 3 " in result and "(1.05x)" in result
    status, result, _ = gpu.plan_vs_peaks(steps([plan, plan, 1.2 * plan], 8), model_config(cfg), "bfloat16")
    assert status == "FAIL" and "(1.20x)" in result  # a steady step over the plan fails the row


def test_ddp_x8_measures_tokens_over_wall_time_as_well(fake_gpus, monkeypatch, tmp_path):
    """The row runs evaluation, samples and HellaSwag; its steps' tokens/s leave their cost out. It reports tokens
    over wall time (summary.json), against the one-GPU train row's, and the wall time's share outside the steps."""
    from gpt2train import assets

    fake_gpus(8)
    monkeypatch.setattr(assets, "fetch_hellaswag", lambda *a: (_ for _ in ()).throw(OSError("offline")))
    one_dir, ddp_dir = tmp_path / "train", tmp_path / "ddp8"
    for out, tokens, wall in ((one_dir, 1000 * 40, 42.0), (ddp_dir, 8 * 1000 * 40, 50.0)):
        out.mkdir()
        (out / "summary.json").write_text(json.dumps({"tokens": tokens, "wall_s": wall}))
    cfg = make_config({"batch_size": 4, "block_size": 256})
    one = steps([1] * 40, 4)  # 1,000 tokens/s a step
    ddp = [{**r, "tokens_per_s": 7600.0} for r in one]  # 95%
    monkeypatch.setattr(gpu, "run_train", lambda *a, **k: (0, "", ddp))
    report = gpu.Report()
    opts = SimpleNamespace(device="cuda:0", train_args=[], steps=40)
    gpu.check_ddp_scaling(report, opts, tmp_path, tmp_path / "data", (cfg, one_dir, one))
    [(check, result, reference, status)] = report.rows
    assert status == "PASS" and result.startswith("steps 95% of 8x one GPU; ")
    wall, one_wall = 8 * 1000 * 40 / 50.0, 1000 * 40 / 42.0
    assert f"over wall time {wall:,.0f} tokens/s, {wall / (8 * one_wall):.0%} of 8x one GPU's" in result
    assert f"{1 - wall / 7600:.0%} of the wall time outside the steps" in result


def test_the_masked_sync_debug_row_fails_unless_its_all_reduce_was_issued():
    """The masked torchrun row is about the trained-token count's asynchronous all-reduce: a run that never issued
    it (a loader the step does not read as masked) took the other path, and must not pass."""
    clean = {"per_step": 1.0, "steps": 10, "first": []}
    assert gpu.sync_debug_verdict("masked", {**clean, "async_all_reduces": 10})[0] == "PASS"
    assert gpu.sync_debug_verdict("masked", {**clean, "async_all_reduces": 0})[0] == "FAIL"
    assert gpu.sync_debug_verdict("masked", {**clean, "per_step": 2.0, "async_all_reduces": 10})[0] == "FAIL"
    assert gpu.sync_debug_verdict("plain", {**clean, "async_all_reduces": 0})[0] == "PASS"


@pytest.mark.slow
def test_the_sync_debug_script_counts_the_masked_ranks_async_all_reduce(tmp_path, monkeypatch):
    """The row's own script through train.main on the CPU (torch's sync check is CUDA only; the counting is not):
    the masked rank under torchrun issues one asynchronous all-reduce a step, the plain process none."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    opts = gpu.parse(["--device=cpu", "--tiny"])
    gpu.write_random_shards(tmp_path / "data", 20_000, 50304)
    for name, nproc, issued in (("masked", 1, 10), ("plain", 0, 0)):
        run, found = gpu.run_sync_debug(opts, tmp_path, tmp_path / "data", name, nproc, timeout=600)
        assert found is not None, run.stderr[-2000:]
        assert (found["steps"], found["async_all_reduces"]) == (10, issued)


def test_the_slot_needs_a_directory_for_its_results(capsys):
    with pytest.raises(SystemExit) as exit_:
        gpu.main(["--slot", "--tiny", "--device=cpu"])
    assert exit_.value.code == 2 and "--slot needs --out DIR" in capsys.readouterr().err


@pytest.mark.parametrize("out", ["a_file", "a_file/sub"])
def test_a_slot_out_that_cannot_be_a_directory_is_one_line_naming_it(out, tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(SystemExit) as exit_:
        gpu.main(["--slot", "--tiny", "--device=cpu", f"--out={tmp_path / out}"])
    said = "is a file, where a directory is expected" if out == "a_file" else "a part of this path is a file, not a"
    assert exit_.value.code.startswith(f"bench.gpu: error: {tmp_path / out}: {said}"), exit_.value.code


def slot_without_runs(monkeypatch, **fakes):
    """gpu.slot's rows with no train.py run: each row's work replaced by `fakes` (name -> function)."""
    monkeypatch.setattr(gpu, "slot_phases", lambda *a: {})
    for name, fake in fakes.items():
        monkeypatch.setattr(gpu, name, fake)


def test_a_ctrl_c_in_the_slot_is_one_line_and_exit_130_keeping_the_rows_measured(tmp_path, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    slot_without_runs(monkeypatch, slot_train=interrupted)
    assert gpu.main(["--slot", "--tiny", "--device=cpu", f"--out={tmp_path}"]) == 130
    err = capsys.readouterr().err
    assert err.endswith(f"\nbench.gpu: error: interrupted; the rows measured are in {tmp_path}/slot.json\n")
    assert "Traceback" not in err
    assert [row["check"] for row in json.loads((tmp_path / "slot.json").read_text())["rows"]] == ["environment"]
    assert [p.name for p in tmp_path.iterdir()] == ["slot.json"]  # written whole: no temporary file left


def test_a_row_whose_log_found_the_disk_full_says_so(tmp_path, monkeypatch, capsys):
    slot_without_runs(monkeypatch, run_train=lambda *a, **k: (1, "", []), slot_optimizer=lambda *a: {})
    monkeypatch.setattr(gpu.shutil, "disk_usage", lambda path: SimpleNamespace(total=1 << 20, used=1 << 20, free=0))
    assert gpu.main(["--slot", "--tiny", "--device=cpu", f"--out={tmp_path}"]) == 1
    result, status = table_rows(capsys.readouterr().out)["124m eager"]
    assert status == "FAIL" and "124m_eager.log is empty: no space left on its device" in result


@pytest.mark.slow
def test_the_slot_runs_offline_on_the_cpu_and_writes_one_table_and_one_json(tmp_path):
    """python -m bench.gpu --slot --tiny: every row the slot runs on a GPU, on a tiny model on the CPU, with no
    GPT-2 tokenizer to be had and no package index (as on an offline GPU node): one table, slot.json with each
    run's per-step records and summary, and each run's log."""
    empty = tmp_path / "empty_cache"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
        "GPT2_CACHE_DIR": str(empty),
        "TIKTOKEN_CACHE_DIR": str(empty),
        "PIP_NO_INDEX": "1",
    }
    out = tmp_path / "out"
    rows = bench_gpu(["--slot", "--tiny", "--device=cpu", f"--out={out}"], env)
    assert {check: status for check, (_, status) in rows.items()} == {
        "environment": "INFO",
        "124m compiled": "INFO",
        "124m modern compiled": "INFO",
        "optimizer step": "PASS",
        "124m eager": "INFO",
        "memory by phase": "INFO",
        "sync debug": "SKIP",
        "1558m eager": "INFO",
    }
    found = json.loads((out / "slot.json").read_text())
    assert [row["check"] for row in found["rows"]] == list(rows)
    runs = (
        ("124m compiled", 6, 256),
        ("124m modern compiled", 3, 256),
        ("124m eager", 4, 256),
        ("1558m eager", 3, 256),
    )
    for name, n, tokens in runs:
        assert [r["step"] for r in found[name]["steps"]] == list(range(1, n + 1)), name
        log = (out / f"{name.replace(' ', '_')}.log").read_text()
        assert found[name]["summary"]["tokens"] == n * tokens and ": saved " not in log  # no checkpoint: no time
    assert {r["micro_batch"] for r in found["1558m eager"]["steps"]} == {2}  # 2 x 2 accumulation steps
    assert set(found["memory by phase"]) == {"eager first", "eager", "compiled first", "compiled"}
    assert "compile False" in rows["124m compiled"][0]  # --tiny: no compile; said so
    assert found["124m modern compiled"]["args"][0].endswith("modern.py")  # the modern recipe on the tiny model
    optimizer = found["optimizer step"]  # the batched Muon dispatches a few ops per shape, torch's ~30 per matrix
    in_fp32 = product_dtype("cpu") == torch.float32  # then 6 more an iteration: 3 products' ins and outs, 4 shapes
    tol, more = (gpu.MUON_TOL_FP32_PRODUCTS, 4 * 5 * 6) if in_fp32 else (gpu.MUON_TOL, 0)
    assert optimizer["batched"]["ops"] < optimizer["torch.optim.Muon"]["ops"] / 4 + more
    assert optimizer["max_rel_diff"] < tol
