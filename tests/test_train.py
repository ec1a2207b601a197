"""train.py: the command line, the learning-rate schedule, the loop's outputs, skipped updates and the statuses a run
ends with (halt, oom, error, interrupted), DDP equivalence, and a run end to end in subprocesses (SIGTERM, kill -9,
torchrun). What the modules it calls do is tested beside them: test_start, test_step, test_budget, test_resume,
test_checkpoint, test_shards, test_evaluation, test_config.

Runs use tests/tiny.py's tiny model on the Markov-chain data of conftest's data_dir.
"""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import model as model_module
import train
from gpt2train.checkpoint import load_checkpoint
from gpt2train.config import TrainConfig
from gpt2train.shards import ShardError
from tiny import (
    ROOT,
    TINY,
    expect_exit,
    metrics,
    one_line_error,
    run,
    subprocess_env,
    torch_threads,
    torchrun,
    train_losses,
)
from train import get_lr

# ----------------------------------------------------------------------------- configuration


def test_cli_config_error_exits_2_without_traceback(capsys):
    with pytest.raises(SystemExit) as exit_:
        train.main(["--lerning_rate=1e-3"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did you mean 'learning_rate'" in err and "Traceback" not in err


def test_lr_schedules():
    cfg = TrainConfig(learning_rate=1.0, min_lr=0.1, warmup_steps=10, max_steps=110)
    lrs = [get_lr(s, cfg, cfg.max_steps) for s in range(110)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)  # linear warmup to the peak
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))  # then non-increasing
    assert lrs[60] == pytest.approx(0.55)  # cosine: halfway between peak and floor at mid-decay
    assert lrs[-1] == pytest.approx(0.1, abs=1e-3) and get_lr(500, cfg, cfg.max_steps) == 0.1
    longer = TrainConfig(learning_rate=1.0, min_lr=0.1, warmup_steps=10, max_steps=110, lr_decay_steps=210)
    assert get_lr(60, longer, longer.max_steps) > lrs[60]  # the schedule follows lr_decay_steps, not max_steps
    wsd = TrainConfig(
        learning_rate=1.0, min_lr=0.0, warmup_steps=10, max_steps=110, lr_schedule="wsd", wsd_decay_frac=0.5
    )
    assert [get_lr(s, wsd, wsd.max_steps) for s in (10, 54)] == [1.0, 1.0]  # stable phase
    assert get_lr(55, wsd, wsd.max_steps) == 1.0 and get_lr(82, wsd, wsd.max_steps) == pytest.approx(
        0.5, abs=0.02
    )  # linear decay over the last half
    assert get_lr(109, wsd, wsd.max_steps) == pytest.approx(0.0, abs=0.02)


# ----------------------------------------------------------------------------- the loop's outputs


def test_run_writes_metrics_config_and_clean_checkpoints(data_dir, tmp_path):
    out = tmp_path / "out"
    assert run(data_dir, out, "--max_steps=8", "--keep_last=1") == 0
    lines = metrics(out)
    steps = [m for m in lines if "train_loss" in m]
    assert [m["step"] for m in steps] == list(range(1, 9))
    for m in steps:
        assert {"step", "train_loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_ms", "peak_mem_mb"} <= set(m)
        assert m["mfu"] is None and m["tokens_per_s"] > 0 and math.isfinite(m["train_loss"])
    assert [m["step"] for m in lines if "val_loss" in m] == [0, 4, 8]
    assert json.loads((out / "config.json").read_text())["max_steps"] == 8

    ckpt = load_checkpoint(out)  # weights_only=True inside
    assert ckpt["step"] == 8 and ckpt["config"]["n_layer"] == 2 and ckpt["model_args"]["n_embd"] == 32
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in ckpt["model"])
    assert {"optimizer", "scaler", "loader", "rng", "val_loss"} <= set(ckpt)
    assert set(ckpt["rng"][0]) == {"python", "numpy", "torch", "cuda"}
    # keep_last=1 keeps the newest, plus the best by val loss if that is another one
    kept = sorted(int(p.stem.split("_")[1]) for p in out.glob("ckpt_*.pt"))
    assert kept == sorted({8, ckpt["best_step"]})


def test_demo_config_loss_falls(data_dir, tmp_path):
    """configs/shakespeare_cpu.py as the README runs it, shrunk: the tiny dataset's vocabulary, shorter
    sequences (the 8-sequence micro-batch stays), 30 steps."""
    out = tmp_path / "demo"
    code = train.main(
        [
            str(ROOT / "configs" / "shakespeare_cpu.py"),
            f"--data_dir={data_dir}",
            f"--out_dir={out}",
            "--vocab_size=64",
            "--block_size=32",
            "--total_batch_size=256",
            "--max_steps=30",
            "--eval_interval=30",
            "--sample_interval=0",
            "--save_interval=0",
        ]
    )
    assert code == 0
    val = [m["val_loss"] for m in metrics(out) if "val_loss" in m]
    assert val[0] > math.log(64) - 0.2  # chance level at the start
    assert val[-1] < val[0] - 1.5  # and well below it after 30 steps


def test_skip_reason_counts_consecutive_skips_and_halts():
    cfg = TrainConfig(max_skipped_steps=3)
    scaler, progress = torch.amp.GradScaler("cpu", enabled=False), train.Progress()

    def stats(loss, norm, step):
        return train.StepStats(loss, norm, False, trained_tokens=1, empty_micro_batches=0, step=step)

    assert train.skip_reason(stats(2.5, 0.7, 1), scaler, cfg, progress) is None
    assert "non-finite loss" in train.skip_reason(stats(float("nan"), 0.7, 2), scaler, cfg, progress)
    assert "non-finite gradient norm" in train.skip_reason(stats(2.5, float("inf"), 3), scaler, cfg, progress)
    with pytest.raises(train.Halt, match="step 4: 3 updates in a row skipped"):
        train.skip_reason(stats(float("nan"), float("nan"), 4), scaler, cfg, progress)
    progress = train.Progress(skipped_in_a_row=2)
    assert train.skip_reason(stats(2.5, 0.7, 5), scaler, cfg, progress) is None and progress.skipped_in_a_row == 0
    with pytest.raises(train.Halt, match="nonfinite='halt'"):
        train.skip_reason(stats(float("nan"), 1.0, 6), scaler, TrainConfig(nonfinite="halt"), progress)
    fp16 = torch.amp.GradScaler("cpu", enabled=True)  # an fp16 overflow is routine: never counted
    for step in range(10):
        assert "fp16 gradient overflow" in train.skip_reason(stats(2.5, float("inf"), step), fp16, cfg, progress)


# ----------------------------------------------------------------------------- exact resume


def test_a_resume_that_changes_the_learning_rate_schedule_says_so_once(data_dir, tmp_path, capsys):
    assert run(data_dir, tmp_path, "--max_steps=4", "--warmup_steps=1", "--min_lr=1e-4") == 0
    capsys.readouterr()
    assert train.main(["--init_from=resume", f"--out_dir={tmp_path}", "--max_steps=8"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "learning-rate schedule" in line]
    lr = {m["step"]: m["lr"] for m in metrics(tmp_path) if "lr" in m}
    assert notes == [
        f"note: the learning-rate schedule changed since the checkpoint (max_steps 4 -> 8): step 5's lr is "
        f"{lr[5]:.2e}, not 1.00e-04; --lr_decay_steps=4 keeps the old decay"
    ]
    assert train.main(["--init_from=resume", f"--out_dir={tmp_path}", "--max_steps=10", "--lr_decay_steps=8"]) == 0
    assert "learning-rate schedule" not in capsys.readouterr().err  # the same rate at step 9: no note


# ----------------------------------------------------------------------------- faults


def inject_nan_loss(monkeypatch, at_call):
    """Make the at_call-th training forward (1-based; or every call for which at_call(call) is true) return
    a NaN loss, still attached to the graph."""
    real_forward, calls = model_module.GPT.forward, [0]

    def forward(self, idx, targets=None, return_logits=True):
        logits, loss = real_forward(self, idx, targets, return_logits)
        if self.training and targets is not None:
            calls[0] += 1
            if at_call(calls[0]) if callable(at_call) else calls[0] == at_call:
                loss = loss * float("nan")
        return logits, loss

    monkeypatch.setattr(model_module.GPT, "forward", forward)


def test_nan_loss_is_skipped_and_logged(data_dir, tmp_path, monkeypatch, capsys):
    inject_nan_loss(monkeypatch, at_call=3)
    assert run(data_dir, tmp_path, "--max_steps=6") == 0
    steps = {m["step"]: m for m in metrics(tmp_path) if "train_loss" in m}
    assert steps[3]["train_loss"] is None and "non-finite loss" in steps[3]["skipped"]
    assert all("skipped" not in steps[s] and math.isfinite(steps[s]["train_loss"]) for s in (1, 2, 4, 5, 6))
    assert "update skipped" in capsys.readouterr().out
    ckpt = load_checkpoint(tmp_path)
    assert all(torch.isfinite(t).all() for t in ckpt["model"].values())
    # the skipped update left no trace: AdamW counted 5 steps, not 6
    assert all(int(s["step"]) == 5 for s in ckpt["optimizer"]["state"].values())


def test_nan_loss_halts_when_asked(data_dir, tmp_path, monkeypatch, capsys):
    inject_nan_loss(monkeypatch, at_call=6)
    with pytest.raises(SystemExit) as exit_:
        run(data_dir, tmp_path, "--max_steps=8", "--nonfinite=halt")
    assert exit_.value.code == 3 and "step 6: non-finite loss" in capsys.readouterr().err  # diverged
    assert load_checkpoint(tmp_path)["step"] == 4  # the last good checkpoint is untouched


def test_signal_saves_at_the_end_of_the_step(data_dir, tmp_path, monkeypatch):
    """In-process: a SIGTERM arriving during step 3 -> checkpoint at step 3, status 'interrupted' (exit code 5)."""
    real_forward, calls = model_module.GPT.forward, [0]

    def forward(self, *args, **kwargs):
        if self.training:
            calls[0] += 1
            if calls[0] == 3:
                os.kill(os.getpid(), signal.SIGTERM)
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(model_module.GPT, "forward", forward)
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    assert run(data_dir, tmp_path, "--max_steps=100") == 5
    assert load_checkpoint(tmp_path)["step"] == 3
    assert json.loads((tmp_path / "summary.json").read_text())["result"]["status"] == "interrupted"
    assert max(train_losses(tmp_path)) == 3
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before  # handlers restored


def test_a_shard_truncated_under_the_run_keeps_the_steps_and_ends_with_status_error(data_dir, tmp_path, monkeypatch):
    """Audit 6's ST_shard: the train shard truncated in place after step 6 (a checkpoint at 4): the next read is a
    ShardError (not SIGBUS, exit 135): one line, exit 1, steps 5 and 6 kept in a checkpoint, the result and the
    ledger's line with status error."""
    data = tmp_path / "data"
    shutil.copytree(data_dir, data)
    real_step = train.optimizer_step

    def step_then_truncate(t, step):
        stats = real_step(t, step)
        if stats.step == 6:
            os.truncate(data / "tiny_train_000000.bin", 2000)
        return stats

    monkeypatch.setattr(train, "optimizer_step", step_then_truncate)
    ledger = tmp_path / "ledger.jsonl"
    expect_exit(1, run, data, tmp_path / "out", "--max_steps=12", f"--ledger={ledger}")
    assert load_checkpoint(tmp_path / "out")["step"] == 6
    result = json.loads((tmp_path / "out" / "summary.json").read_text())["result"]
    assert result["status"] == "error" and result["steps"] == 6
    assert json.loads(ledger.read_text())["status"] == "error"


# ----------------------------------------------------------------------------- one line per expected error


def test_too_many_skipped_updates_halt_and_keep_the_last_checkpoint(data_dir, tmp_path, monkeypatch, capsys):
    """Every update from step 6 on is NaN (as with an absurd learning rate): 3 skips in a row halt the run
    with exit 3 (diverged), and the checkpoint of step 4 is untouched and resumable."""
    inject_nan_loss(monkeypatch, at_call=lambda call: call >= 6)
    expect_exit(3, run, data_dir, tmp_path, "--max_steps=20", "--max_skipped_steps=3")
    line = one_line_error(capsys)
    assert "step 8: 3 updates in a row skipped (non-finite loss" in line
    assert f"the last checkpoint, {tmp_path / 'ckpt_000004.pt'}, is kept (continue with --init_from=resume)" in line
    assert [p.name for p in sorted(tmp_path.glob("ckpt_*.pt"))] == ["ckpt_000004.pt"]
    assert [m.get("skipped") is not None for m in metrics(tmp_path) if "train_loss" in m] == [False] * 5 + [True] * 2
    monkeypatch.undo()
    assert train.main(["--init_from=resume", f"--out_dir={tmp_path}", "--max_steps=6"]) == 0


def test_a_halt_before_any_checkpoint_says_so(data_dir, tmp_path, monkeypatch, capsys):
    inject_nan_loss(monkeypatch, at_call=lambda call: True)
    expect_exit(3, run, data_dir, tmp_path, "--max_steps=20", "--max_skipped_steps=2")
    assert one_line_error(capsys).endswith(
        "halting (max_skipped_steps=2): lower learning_rate?; no checkpoint was written yet"
    )


def test_an_out_of_memory_no_micro_batch_can_halve_is_one_line_exit_4_and_status_oom(
    data_dir, tmp_path, monkeypatch, capsys
):
    """Out of memory in the optimizer step (outside the step's micro-batches): one line, exit 4, and the result says
    oom with no final losses; it used to be a traceback."""
    real_step, calls = torch.optim.AdamW.step, []

    def step(self, *args, **kwargs):
        if len(self.param_groups) == 2:  # the run's AdamW (decay, no decay), not fused_adamw_supported's probe
            calls.append(1)
            if len(calls) == 2:  # step 2's
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    expect_exit(4, run, data_dir, tmp_path, "--max_steps=8")
    line = one_line_error(capsys)
    assert "step 2: out of memory (OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB)" in line
    assert [m["step"] for m in metrics(tmp_path) if "train_loss" in m] == [1]
    result = json.loads((tmp_path / "summary.json").read_text())["result"]
    assert result["status"] == "oom" and result["train_loss"] is None and result["val_loss"] is None


def test_gpt2_traceback_shows_the_traceback(tmp_path, monkeypatch):
    monkeypatch.setenv("GPT2_TRACEBACK", "1")
    with pytest.raises(ShardError, match="no such data directory"):
        run(tmp_path / "missing", tmp_path / "out", "--max_steps=1")


# ----------------------------------------------------------------------------- end to end, in subprocesses


@pytest.mark.slow
def test_sigterm_mid_run_then_resume_matches_uninterrupted(data_dir, tmp_path):
    """The interrupted run is a subprocess (SIGTERM to a real process, as a preemption sends it); its resume and the
    uninterrupted reference run here, at the subprocess's one thread: the same float summation order."""
    args = [*TINY, f"--data_dir={data_dir}", "--max_steps=150", "--save_interval=50", "--eval_interval=50"]
    train_py = [sys.executable, str(ROOT / "train.py")]
    out = tmp_path / "interrupted"
    proc = subprocess.Popen(
        [*train_py, *args, f"--out_dir={out}"],
        cwd=ROOT,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:  # wait until it is training
        if (out / "metrics.jsonl").exists() and len(train_losses(out)) >= 5:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 5, stderr  # interrupted: saved and stopped
    assert json.loads(stdout.splitlines()[-1].removeprefix("result: "))["status"] == "interrupted"
    stopped_at = load_checkpoint(out)["step"]
    assert 5 <= stopped_at < 150, "the signal should have arrived mid-run"
    assert "received SIGTERM" in stderr

    with torch_threads(1):
        assert train.main(["--init_from=resume", f"--out_dir={out}"]) == 0
        assert train.main([*args, f"--out_dir={tmp_path / 'uninterrupted'}"]) == 0
    assert train_losses(out) == train_losses(tmp_path / "uninterrupted")


@pytest.mark.slow
def test_kill_9_leaves_a_loadable_checkpoint(data_dir, tmp_path):
    """SIGKILL while saving every step (so likely mid-write): the newest complete checkpoint loads
    and the run resumes from it."""
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "train.py"),
            *TINY,
            f"--data_dir={data_dir}",
            f"--out_dir={out}",
            "--max_steps=100000",
            "--save_interval=1",
            "--keep_last=3",
        ],
        cwd=ROOT,
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 120
    while time.time() < deadline and len(list(out.glob("ckpt_*.pt"))) < 3:
        time.sleep(0.05)
    time.sleep(0.5)
    proc.kill()
    proc.wait(timeout=60)
    step = load_checkpoint(out)["step"]  # the newest complete one
    assert step >= 3
    assert train.main(["--init_from=resume", f"--out_dir={out}", f"--max_steps={step + 2}"]) == 0
    assert load_checkpoint(out)["step"] == step + 2


@pytest.mark.slow
def test_ddp_two_processes_equal_one_process_with_accumulation(data_dir, tmp_path):
    common = [f"--data_dir={data_dir}", "--max_steps=6", "--total_batch_size=128", "--dropout=0.0"]
    torchrun(*TINY, *common, f"--out_dir={tmp_path / 'ddp'}")
    # 1 process x 2 accumulation steps; eval_steps counts micro-batches per process, so 2 x 2 ranks = 4
    assert run(data_dir, tmp_path / "single", *common[1:], "--eval_steps=4") == 0

    ddp, single = train_losses(tmp_path / "ddp"), train_losses(tmp_path / "single")
    assert list(ddp) == list(range(1, 7))  # only rank 0 wrote, one line per step
    for step in single:
        assert abs(ddp[step] - single[step]) < 1e-5, (step, ddp[step], single[step])
    val = lambda out, key: [m[key] for m in metrics(out) if "val_loss" in m]
    for key in ("val_loss", "val_bpb"):  # the bytes of both ranks' targets, added up
        assert np.allclose(val(tmp_path / "ddp", key), val(tmp_path / "single", key), atol=1e-5), key
    assert len(load_checkpoint(tmp_path / "ddp")["rng"]) == 2  # each rank's RNG state


@pytest.mark.slow
def test_torchrun_on_missing_data_prints_one_line_once(tmp_path):
    """A fresh clone's first command: each rank finds no data/fineweb-edu; rank 0 alone says so, in one line that
    names the command preparing it; no rank prints a traceback (torchrun then adds its own failure summary)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(ROOT / "train.py"),
        *TINY,
        "--max_steps=2",
        f"--out_dir={tmp_path / 'out'}",
    ]
    result = subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    line = (
        "train.py: error: data/fineweb-edu: no such data directory; prepare it with "
        "`python prepare_data.py --dataset fineweb-edu`\n"
    )
    assert result.stderr.count("train.py: error: ") == 1 and line in result.stderr, result.stderr
    assert f'File "{ROOT / "train.py"}"' not in result.stderr  # no traceback from a rank


def test_a_shard_that_changes_mid_run_is_one_line_after_saving_the_steps_done(data_dir, tmp_path, monkeypatch, capsys):
    """Step 7 meets an id the start-up check did not see (the file changed under the run): the steps done since
    the last save (5, 6) are saved first, then the error names the shard and the position; no IndexError."""
    import shutil

    from gpt2train import data

    shutil.copytree(data_dir, tmp_path / "data")
    shard, real, calls = tmp_path / "data" / "tiny_train_000000.bin", data.DataLoader.next_batch, []

    def next_batch(self):
        calls.append(self.shuffle)  # the train loader's
        if calls.count(True) == 7:  # step 7's batch
            with open(shard, "r+b") as f:
                f.seek(1024)
                f.write(np.full(30_000, 100, dtype="<u2").tobytes())
        return real(self)

    monkeypatch.setattr(data.DataLoader, "next_batch", next_batch)
    expect_exit(1, run, tmp_path / "data", tmp_path / "out", "--max_steps=8", "--save_interval=4")
    out, err = capsys.readouterr()
    assert "data: 1 train shards, 30,000 tokens; val: 1 shards, 3,000 tokens" in out
    assert err.count("train.py: error: ") == 1 and "Traceback" not in err and err.endswith("\n"), err
    line = err[err.index("train.py: error: ") :].rstrip("\n")
    assert "\n" not in line and f"{shard}: token id 100 >= vocab_size 64 at token " in line
    assert f"the last checkpoint, {tmp_path / 'out' / 'ckpt_000006.pt'}, is kept" in line
    assert load_checkpoint(tmp_path / "out")["step"] == 6
