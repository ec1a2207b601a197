"""Tracking through train.py, end to end: W&B (offline) and TensorBoard get every metrics line of a tiny
run, a resume continues the same W&B run and TensorBoard directory, a missing package stops the run at
start, a failing sink does not, cost and summary.json; plot_metrics.py --compare on real runs."""

import json
import sys

import pytest

import plot_metrics
import train
from gpt2train.checkpoint import load_checkpoint
from test_tracking import assert_tensorboard_holds, assert_wandb_holds, tensorboard_events, wandb_segments
from tiny import metrics, run


@pytest.fixture(autouse=True)
def wandb_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home"))


def sinks(tb):
    return ["--wandb_log=True", "--wandb_project=test", f"--tensorboard_dir={tb}"]


@pytest.mark.slow
def test_wandb_and_tensorboard_get_every_metric_of_a_run(data_dir, tmp_path):
    out, tb = tmp_path / "run", tmp_path / "tb"
    assert run(data_dir, out, "--max_steps=8", *sinks(tb)) == 0
    records = metrics(out)
    assert {"train_loss", "val_loss", "grad_norm", "lr", "tokens_per_s", "step_ms"} <= {k for r in records for k in r}
    [(run_id, config, history)] = wandb_segments(out)
    assert run_id == (out / "wandb_id.txt").read_text().strip()
    assert config == json.loads((out / "config.json").read_text())  # the resolved config is the run's config
    assert_wandb_holds(history, records)
    scalars, texts = tensorboard_events(tb)
    assert_tensorboard_holds(scalars, texts, records)
    assert [step for step, _ in scalars["val_loss"]] == [0, 4, 8]
    assert json.loads((out / "summary.json").read_text())["steps"] == 8


def test_resume_continues_the_same_wandb_run_and_tensorboard_dir(data_dir, tmp_path):
    out, tb = tmp_path / "run", tmp_path / "tb"
    assert run(data_dir, out, "--max_steps=4", *sinks(tb)) == 0
    first_id = (out / "wandb_id.txt").read_text().strip()
    assert load_checkpoint(out)["tracker"]["wandb_id"] == first_id
    # the tracking keys come back from the checkpoint's config, like every other key
    import train

    assert train.main(["--init_from=resume", f"--out_dir={out}", "--max_steps=8"]) == 0
    (id_a, _, hist_a), (id_b, config_b, hist_b) = wandb_segments(out)
    assert id_a == id_b == first_id and config_b["max_steps"] == 8
    assert max(hist_a) == 4 and min(hist_b) == 5  # the resumed run logged only the steps after the checkpoint
    records = metrics(out)
    assert [r["step"] for r in records if "train_loss" in r] == list(range(1, 9))
    assert_wandb_holds({**hist_a, **hist_b}, records)
    assert_tensorboard_holds(*tensorboard_events(tb), records)
    assert json.loads((out / "summary.json").read_text())["tokens"] == 8 * 4 * 16  # the whole run's


def test_missing_wandb_is_a_one_line_error_at_start(data_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(SystemExit) as exit_:
        run(data_dir, tmp_path / "run", "--max_steps=4", "--wandb_log=True")
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install wandb" in err and "Traceback" not in err
    assert not list((tmp_path / "run").glob("ckpt_*.pt"))  # stopped before training


def test_a_failing_sink_is_disabled_and_training_finishes(data_dir, tmp_path, monkeypatch, capsys):
    from torch.utils.tensorboard.writer import FileWriter

    real_add_summary, calls = FileWriter.add_summary, [0]

    def add_summary(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] >= 4:  # the config, val step 0, train step 1, then the disk is full
            raise OSError(28, "No space left on device")
        return real_add_summary(self, *args, **kwargs)

    monkeypatch.setattr(FileWriter, "add_summary", add_summary)
    out = tmp_path / "run"
    assert run(data_dir, out, "--max_steps=8", f"--tensorboard_dir={tmp_path / 'tb'}") == 0
    err = capsys.readouterr().err
    assert err.count("tracking: tensorboard failed (OSError: [Errno 28] No space left on device); disabled") == 1
    assert [r["step"] for r in metrics(out) if "train_loss" in r] == list(range(1, 9))  # metrics.jsonl complete
    assert load_checkpoint(out)["step"] == 8


def test_cost_and_summary(data_dir, tmp_path):
    out = tmp_path / "run"
    assert run(data_dir, out, "--max_steps=8", "--cost_per_hour=2.5") == 0
    records = metrics(out)
    train_lines = [r for r in records if "train_loss" in r]
    costs = [r["cost_usd"] for r in train_lines]
    assert all(0 < a < b for a, b in zip(costs, costs[1:]))  # cumulative
    assert all(r["tokens_per_dollar"] == pytest.approx(64 * r["step"] / r["cost_usd"]) for r in train_lines)
    summary = json.loads((out / "summary.json").read_text())
    val = [r for r in records if "val_loss" in r]
    assert summary["steps"] == 8 and summary["tokens"] == 8 * 64
    assert summary["final_train_loss"] == train_lines[-1]["train_loss"]
    assert summary["final_val_loss"] == val[-1]["val_loss"]
    assert summary["best_val_loss"] == min(r["val_loss"] for r in val)
    assert summary["mean_tokens_per_s"] > 0 and summary["mean_mfu"] is None  # no MFU on a CPU
    assert summary["cost_per_hour"] == 2.5 and summary["cost_usd"] >= costs[-1]
    assert summary["cost_usd"] == pytest.approx(summary["wall_s"] / 3600 * 2.5)
    assert summary["peak_mem_mb"] > 0


def test_compare_identical_runs_is_zero_and_another_seed_is_not(data_dir, tmp_path, capsys):
    for name, seed in (("a", 1337), ("b", 1337), ("c", 7)):
        assert run(data_dir, tmp_path / name, "--max_steps=8", f"--seed={seed}") == 0
    same = plot_metrics.compare(tmp_path / "a", tmp_path / "b")
    assert same["train_loss"]["steps"] == 8 and same["train_loss"]["max_abs_diff"] == 0.0
    assert same["grad_norm"]["max_abs_diff"] == 0.0
    assert same["final_val_loss"][0] == same["final_val_loss"][1]
    other = plot_metrics.compare(tmp_path / "a", tmp_path / "c")
    assert other["train_loss"]["max_abs_diff"] > 0 and other["grad_norm"]["max_abs_diff"] > 0
    assert other["final_val_loss"][0] != other["final_val_loss"][1]
    capsys.readouterr()
    assert plot_metrics.main(["--compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert "max |a-b| 0.000e+00, mean |a-b| 0.000e+00" in capsys.readouterr().out


def test_resume_drops_metrics_after_the_checkpoint(data_dir, tmp_path):
    out = tmp_path / "out"
    assert run(data_dir, out, "--max_steps=6") == 0  # checkpoints at 4 and 6
    (out / "ckpt_000006.pt").unlink()  # as if killed after step 6 was logged but before it was saved
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "train_lo')  # and a torn last line
    assert train.main(["--init_from=resume", f"--out_dir={out}", "--max_steps=6"]) == 0
    assert [m["step"] for m in metrics(out) if "train_loss" in m] == [1, 2, 3, 4, 5, 6]
