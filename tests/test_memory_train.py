"""train.py with the memory planner: the plan line before the model is built, the refusal of a config that cannot
fit, batch_size='auto' (from the plan, and by probing), and the runtime out-of-memory path that halves the
micro-batch and re-runs the step. Out-of-memory is simulated (GPT_FAKE_OOM_ABOVE or a patched hook)."""

import pytest
import torch

import train
from gpt2train import headroom, memory
from gpt2train.checkpoint import load_checkpoint
from gpt2train.config import ConfigError, make_config, model_config, parse_args
from model import GPT
from tiny import TINY, metrics, run, train_losses

PLAN_PREFIX = "estimated peak memory per rank: "
STEPS = ["--max_steps=5", "--eval_interval=0", "--save_interval=0"]


def oom_above(monkeypatch, limit, calls=None, oom_at_call=None):
    """From now on the model's training forward raises the out-of-memory CUDA raises: above micro-batch `limit`,
    or at the oom_at_call-th call (counted in `calls`, which records each call's micro-batch)."""
    forward = GPT.forward

    def failing(self, idx, *args, **kwargs):
        if calls is not None and torch.is_grad_enabled():
            calls.append(idx.shape[0])
        if torch.is_grad_enabled() and (
            (limit is not None and idx.shape[0] > limit) or (oom_at_call is not None and len(calls) == oom_at_call)
        ):
            raise torch.OutOfMemoryError(f"simulated: micro-batch {idx.shape[0]}")
        return forward(self, idx, *args, **kwargs)

    monkeypatch.setattr(GPT, "forward", failing)


def tiny_plan(batch_size):
    cfg = make_config(parse_args(TINY))
    return memory.estimate_memory(model_config(cfg), batch_size, dtype="float32")


def test_plan_line_is_printed_before_the_model_is_built(data_dir, tmp_path, capsys):
    assert run(data_dir, tmp_path, "--max_steps=1") == 0
    lines = capsys.readouterr().out.splitlines()
    plan = next(i for i, line in enumerate(lines) if line.startswith(PLAN_PREFIX))
    assert lines[plan] == tiny_plan(4).line()  # the contract: prefix, then the total in GiB
    assert lines[plan + 1].startswith("available memory: cpu: ") and "GiB" in lines[plan + 1]
    assert plan < next(i for i, line in enumerate(lines) if "parameters | device" in line)


def test_a_config_that_cannot_fit_is_refused_before_anything_is_allocated(data_dir, tmp_path, monkeypatch, capsys):
    available = (tiny_plan(2).total + tiny_plan(4).total) // 2  # micro-batch 2 fits, 4 (TINY's) does not
    monkeypatch.setattr(headroom, "available_memory", lambda device: (available, "fake: tiny"))

    def must_not_run(*args, **kwargs):
        raise AssertionError("allocated before the refusal")

    monkeypatch.setattr(train, "make_loaders", must_not_run)
    monkeypatch.setattr(train, "build_model", must_not_run)
    with pytest.raises(SystemExit) as exit_:
        run(data_dir, tmp_path, "--max_steps=1")
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"estimated peak memory per rank {memory.gib(tiny_plan(4).total)} GiB exceeds" in err
    assert "settings that fit: batch_size=2 with 2 accumulation steps" in err and "memory_check=False" in err
    with pytest.raises(AssertionError, match="allocated before the refusal"):  # memory_check=False: no refusal
        run(data_dir, tmp_path, "--max_steps=1", "--memory_check=False")


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--batch_size=auto"], "batch_size='auto' keeps total_batch_size fixed"),
        (["--batch_size=big"], "config key 'batch_size' must be an int >= 1 or 'auto'; got 'big'"),
        (["--batch_size=0"], "config key 'batch_size' must be >= 1 or 'auto'; got 0"),
    ],
)
def test_bad_batch_size_is_a_one_line_error(args, expected):
    with pytest.raises(ConfigError) as err:
        make_config(parse_args(args))
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_micro_batch_8_x_2_accumulation_equals_16_x_1(data_dir, tmp_path):
    assert run(data_dir, tmp_path / "a", *STEPS, "--batch_size=16") == 0
    assert run(data_dir, tmp_path / "b", *STEPS, "--batch_size=8", "--total_batch_size=256") == 0
    a, b = train_losses(tmp_path / "a"), train_losses(tmp_path / "b")
    assert list(a) == list(b) == [1, 2, 3, 4, 5]
    assert b == pytest.approx(a, rel=1e-6, abs=1e-6)  # the same samples; only the summation order differs
    assert {m["micro_batch"] for m in metrics(tmp_path / "b") if "train_loss" in m} == {8}


def test_auto_from_the_plan_then_simulated_oom_ends_at_the_right_size(data_dir, tmp_path, monkeypatch, capsys):
    """CPU: the plan picks all 16 rows per micro-batch; the simulated out-of-memory above 4 halves it twice in
    step 1, which is re-run: the run equals one at micro-batch 4 from the start, bit for bit."""
    assert run(data_dir, tmp_path / "fixed", *STEPS, "--batch_size=4", "--total_batch_size=256") == 0
    oom_above(monkeypatch, 4)
    assert run(data_dir, tmp_path / "auto", *STEPS, "--batch_size=auto", "--total_batch_size=256") == 0
    out = capsys.readouterr().out
    assert "batch_size='auto': micro-batch 16 x 1 accumulation steps" in out
    assert out.count("out of memory at micro-batch") == 2  # 16 -> 8 -> 4, each logged once
    assert train_losses(tmp_path / "auto") == train_losses(tmp_path / "fixed")
    assert [m["micro_batch"] for m in metrics(tmp_path / "auto") if "train_loss" in m] == [4] * 5
    ckpt = load_checkpoint(tmp_path / "auto")
    assert ckpt["config"]["batch_size"] == 4 and ckpt["loader"]["position"] == 5 * 16  # resume is exact


def test_auto_by_probing_ends_at_the_right_size(data_dir, tmp_path, monkeypatch, capsys):
    """The CUDA path on the CPU: real forward+backward probes at 16 and 8 hit the simulated out-of-memory, 4 runs;
    the probe leaves weights, gradients and RNGs as they were (dropout on: its masks would tell)."""
    args = [*STEPS, "--total_batch_size=256", "--dropout=0.1"]
    assert run(data_dir, tmp_path / "fixed", *args, "--batch_size=4") == 0
    monkeypatch.setattr(memory, "PROBED_KINDS", ("cpu",))
    oom_above(monkeypatch, 4)
    assert run(data_dir, tmp_path / "auto", *args, "--batch_size=auto") == 0
    out = capsys.readouterr().out
    assert "batch_size='auto': micro-batch 4: the largest that ran forward+backward (out of memory at 16, 8)" in out
    assert "out of memory at micro-batch" not in out.replace("(out of memory at 16, 8)", "")  # no runtime halving
    assert train_losses(tmp_path / "auto") == train_losses(tmp_path / "fixed")
    assert load_checkpoint(tmp_path / "auto")["config"]["batch_size"] == 4


def test_runtime_oom_mid_step_reruns_the_step_with_the_same_data(data_dir, tmp_path, monkeypatch, capsys):
    """An out-of-memory in the second micro-batch of step 3 (8 x 2): the step is re-run from its first sample at
    4 x 4, nothing skipped or repeated: the losses equal a run at 4 x 4 from the start (up to summation order)."""
    assert run(data_dir, tmp_path / "small", *STEPS, "--batch_size=4", "--total_batch_size=256") == 0
    calls = []
    oom_above(monkeypatch, None, calls, oom_at_call=6)  # steps 1 and 2 took 2 micro-batches each
    assert run(data_dir, tmp_path / "halved", *STEPS, "--batch_size=8", "--total_batch_size=256") == 0
    assert calls == [8] * 6 + [4] * 12
    out = capsys.readouterr().out
    assert out.count("out of memory at micro-batch") == 1
    assert "step 3: out of memory at micro-batch 8: re-running the step at micro-batch 4 x 4 accumulation" in out
    assert train_losses(tmp_path / "halved") == pytest.approx(train_losses(tmp_path / "small"), rel=1e-6, abs=1e-6)
    assert [m["micro_batch"] for m in metrics(tmp_path / "halved") if "train_loss" in m] == [8, 8, 4, 4, 4]
    ckpt = load_checkpoint(tmp_path / "halved")
    assert ckpt["config"]["batch_size"] == 4 and ckpt["loader"]["position"] == 5 * 16


def test_oom_in_the_compile_trial_halves_the_micro_batch_before_step_1(data_dir, tmp_path, monkeypatch, capsys):
    """The compile trial runs at the run's micro-batch before step 1 (and a compiled step may hold more than the
    eager probe did): an out-of-memory there (simulated above micro-batch 4) halves it as a step's does and the
    trial runs again, until it fits. The run then trains at 4 from its first step: a run at 4 x 4, bit for bit."""
    assert run(data_dir, tmp_path / "fixed", *STEPS, "--batch_size=4", "--total_batch_size=256") == 0

    class Compiled(torch.nn.Module):  # torch.compile's place, without the compile
        def __init__(self, model):
            super().__init__()
            self._orig_mod = model

        def forward(self, *args, **kwargs):
            return self._orig_mod(*args, **kwargs)

    monkeypatch.setattr(torch, "compile", Compiled)
    calls = []
    oom_above(monkeypatch, 4, calls)
    assert run(data_dir, tmp_path / "trial", *STEPS, "--batch_size=16", "--total_batch_size=256", "--compile=True") == 0
    out = capsys.readouterr().out
    assert "the torch.compile trial: out of memory at micro-batch 16: trying micro-batch 8 (batch_size=8" in out
    assert "the torch.compile trial: out of memory at micro-batch 8: trying micro-batch 4 (batch_size=4" in out
    assert calls == [16, 8, 4] + [4] * 4 * 5 and "step 1: out of memory" not in out  # the steps start at 4
    assert train_losses(tmp_path / "trial") == train_losses(tmp_path / "fixed")
    assert [m["micro_batch"] for m in metrics(tmp_path / "trial") if "train_loss" in m] == [4] * 5
    assert load_checkpoint(tmp_path / "trial")["config"]["batch_size"] == 4


def test_oom_at_micro_batch_1_stops_with_one_line_naming_settings(data_dir, tmp_path, monkeypatch, capsys):
    oom_above(monkeypatch, 0)
    with pytest.raises(SystemExit) as exit_:
        run(data_dir, tmp_path, *STEPS, "--batch_size=2")
    assert exit_.value.code == 4  # status 'oom'
    err = capsys.readouterr().err
    [line] = [line for line in err.splitlines() if "train.py: error:" in line]  # the progress bar is on stderr too
    assert line.startswith("train.py: error: ") and "Traceback" not in err
    assert "step 1: out of memory at micro-batch 1; try activation_checkpointing=True, parallel='fsdp'" in line


def test_oom_in_validation_halves_its_micro_batch_like_a_step(data_dir, tmp_path, monkeypatch, capsys):
    """Validation runs at the training micro-batch (8) and an out-of-memory there halves it, as a step's does:
    the same rows are evaluated, so the val losses equal those of a run that fits."""
    args = ["--max_steps=4", "--eval_interval=2", "--eval_steps=2", "--save_interval=0", "--batch_size=8"]
    assert run(data_dir, tmp_path / "fits", *args) == 0
    forward, sizes = GPT.forward, []

    def failing(self, idx, *a, **k):
        if not torch.is_grad_enabled():
            sizes.append(idx.shape[0])
            if idx.shape[0] > 4:
                raise torch.OutOfMemoryError(f"simulated: micro-batch {idx.shape[0]}")
        return forward(self, idx, *a, **k)

    monkeypatch.setattr(GPT, "forward", failing)
    assert run(data_dir, tmp_path / "oom", *args) == 0
    assert sizes == [8, 4, 4, 4, 4] * 3  # steps 0, 2, 4: 16 rows each
    assert "step 0: out of memory in validation at micro-batch 8: evaluating at 4" in capsys.readouterr().out
    val = lambda out: {m["step"]: m["val_loss"] for m in metrics(out) if "val_loss" in m}  # noqa: E731
    assert val(tmp_path / "oom") == pytest.approx(val(tmp_path / "fits"), rel=1e-6)
    assert train_losses(tmp_path / "oom") == train_losses(tmp_path / "fits")
