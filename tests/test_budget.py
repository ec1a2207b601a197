"""budget.py: how many steps a run trains: max_seconds fixes max_steps once from steps 3-10 (a resume continues
bit-exactly with the budget it fixed), target_flops and tokens_per_param train their horizon to within one step.

Runs use tests/tiny.py's tiny model on the Markov-chain data of conftest's data_dir.
"""

import json
import os
import signal
from types import SimpleNamespace

import pytest
import torch

import model as model_module
import train
from gpt2train.budget import Budget
from gpt2train.checkpoint import load_checkpoint
from gpt2train.config import TrainConfig
from tiny import TINY, expect_exit, metrics, one_line_error, run, train_losses
from train import get_lr


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
