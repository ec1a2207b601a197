"""ladder.py: bad input is one line before anything trains; a ladder writes ladder.json with every field, its
table and `ladder:` line; --predict and --predict_flops end with a `predict:` line; an end-to-end tiny ladder."""

import json
import math
import shlex

import pytest

import ladder
import train
from gpt2train import scaling
from tiny import TINY

TRUE = {"E": 1.2, "A": 30.0, "alpha": 0.35, "B": 60.0, "beta": 0.3}


def base(data_dir):  # noqa: F811
    return shlex.join(
        [*TINY, f"--data_dir={data_dir}", "--eval_interval=100000", "--eval_steps=20", "--save_interval=0"]
    )


def one_line(capsys, code, argv):
    assert ladder.main(argv) == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ladder.py: error: " in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    "flags, expected",
    [
        ({"--sizes": "1x64,2x64,abc"}, "size 'abc': expected n_layer x n_embd, e.g. 4x256"),
        ({"--sizes": "1x64,2x64,2x100"}, "size '2x100': the width 100 must be a multiple of the head dimension 64"),
        ({"--flops": "1e3,2e9"}, "size 1x64 at 1000 FLOPs: target_flops=1000 is less than one step: one step is"),
        ({"--flops": "2e9,nan"}, "--flops: 'nan' is not a number of FLOPs > 0"),
        ({"--sizes": "1x64,2x64"}, "the fits need at least 3 sizes and 2 budgets; got 2 sizes (1x64,2x64)"),
        ({"--flops": "2e9"}, "the fits need at least 3 sizes and 2 budgets; got 3 sizes (1x64,2x64,2x128) and 1"),
        ({"--seeds": "0"}, "--seeds and --jobs must be >= 1"),
        ({"--max_steps=5": None}, "unrecognized arguments: --max_steps=5"),
        ({"--out_dir": None}, "a ladder needs --sizes, --flops and --out_dir"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_trains_nothing(flags, expected, data_dir, tmp_path, capsys):  # noqa: F811
    args = {"--sizes": "1x64,2x64,2x128", "--flops": "2e9,4e9", "--out_dir": str(tmp_path / "l"), **flags}
    argv = [base(data_dir), *[x for k, v in args.items() if k != "--out_dir" or v for x in (k, v) if x is not None]]
    assert expected in one_line(capsys, 2, argv)
    assert not (tmp_path / "l").exists()


def test_predict_on_a_directory_with_no_fit_is_one_line(tmp_path, capsys):
    err = one_line(capsys, 2, [str(tmp_path), "--predict_flops", "1e12"])
    assert f"{tmp_path / 'ladder.json'}: no fit there" in err


def fake_runs(monkeypatch, status=lambda key: "ok"):
    """ladder.run_jobs replaced by runs whose val loss is TRUE's law at their planned params and tokens (no
    training): every record as the runner makes it."""

    def run_jobs(todo, out_dir, *, jobs, metric, done, on_run):
        records = {}
        for job in todo:
            shape = ladder.planned_run(job.args, out_dir / ".x")
            loss = scaling.law_loss(TRUE, shape["n"], shape["tokens"]) * (1 + 0.002 * math.sin(len(records)))
            result = {k: shape[k] for k in ("params", "params_lookup", "tokens", "flops", "steps")}
            ok = status(job.key) == "ok"
            records[job.key] = {
                "key": job.key,
                "status": status(job.key),
                "value": loss if ok else None,
                "result": {**result, "val_loss": loss if ok else None},
                "seconds": 1.0,
                "out_dir": str(job.out_dir),
            }
            on_run(job.key, records[job.key], True)
        return records

    monkeypatch.setattr(ladder, "run_jobs", run_jobs)


def test_a_ladder_writes_every_field_and_predicts(data_dir, tmp_path, capsys, monkeypatch):  # noqa: F811
    fake_runs(monkeypatch)
    monkeypatch.setattr(ladder, "fit_all", lambda runs: scaling.fit_all(runs, scaling.Fits(boot=20)))
    out = tmp_path / "l"
    sizes = "1x64,2x64,3x64,2x128"
    argv = [base(data_dir), "--sizes", sizes, "--flops", "2e9,4e9,8e9", "--jobs", "2", "--out_dir", str(out)]
    assert ladder.main(argv) == 0
    printed = capsys.readouterr().out.splitlines()
    report = json.loads((out / "ladder.json").read_text())
    cost = report["cost"]  # 12 runs of 1 s in 2 slots: the wall time of both slots, over the runs' seconds
    assert cost["runs_s"] == 12.0 and cost["overhead"] == pytest.approx(cost["wall_s"] * 2 / 12.0 - 1)
    assert json.loads(printed[-1].removeprefix("ladder: "))["law"] == report["law"]
    assert len(report["runs"]) == 12
    for run in report["runs"]:
        for key in ("size", "n_layer", "n_embd", "params", "params_lookup", "flops", "tokens", "seed", "status"):
            assert run[key] is not None, key
        assert run["value"] > 0 and run["out_dir"].endswith(f"{run['size']}_{run['budget']:g}/seed1337")
        assert abs(run["flops"] - run["budget"]) <= run["flops"] / run["steps"]  # within one step
    assert [c["flops"] for c in report["isoflop"]] == [2e9, 4e9, 8e9]
    for curve in report["isoflop"]:
        assert {"flops", "n_opt", "loss_opt", "r2", "at_edge", "ci95"} <= set(curve)
    assert {"a", "b", "ratio", "r2", "ci95"} <= set(report["power_laws"])
    assert set(report["law"]) == {"E", "A", "alpha", "B", "beta", "r2", "ci95"}
    assert set(report["law"]["ci95"]) == set(scaling.LAW_KEYS)
    assert report["law"]["r2"] > 0.95  # the runs follow a law: the fit (tests/test_scaling.py) finds it
    assert (out / "ladder.png").stat().st_size > 0
    for argv in (
        ["--predict", "--n_layer=3 --n_embd=128 --n_head=2 --target_flops=3.2e10"],
        ["--predict_flops", "3.2e10"],
    ):
        assert ladder.main([str(out), *argv]) == 0
        line = capsys.readouterr().out.splitlines()[-1]
        record = json.loads(line.removeprefix("predict: "))
        assert line.startswith("predict: ") and record["ci95"][0] < record["val_loss"] < record["ci95"][1]
        assert record["flops"] == pytest.approx(3.2e10, rel=0.05)
    assert record["n_opt"] == record["params"] and record["d_opt"] == record["tokens"]


def test_runs_that_did_not_end_ok_give_no_fit_but_one_line(data_dir, tmp_path, capsys, monkeypatch):  # noqa: F811
    fake_runs(monkeypatch, status=lambda key: "diverged" if key.startswith("2x128_4e+09") else "ok")
    argv = [base(data_dir), "--sizes", "1x64,2x64,2x128", "--flops", "2e9,4e9", "--out_dir", str(tmp_path)]
    err = one_line(capsys, 1, argv)
    assert "the fits need every run ended ok with a val_loss; not: 2x128_4e+09/seed1337 (diverged)" in err
    assert "law" not in json.loads((tmp_path / "ladder.json").read_text())  # the runs are there, no fit


@pytest.mark.slow
def test_a_tiny_ladder_end_to_end_predicts_a_run_at_4x_its_largest_budget(data_dir, tmp_path, capsys):  # noqa: F811
    """Real runs through the runner: 3 sizes x 3 budgets of the tiny model, then the prediction of a run at 4x the
    largest budget, made and compared with its band."""
    out = tmp_path / "l"
    argv = [base(data_dir), "--sizes", "1x64,2x64,2x128", "--flops", "2e9,4e9,8e9", "--out_dir", str(out)]
    assert ladder.main(argv) == 0
    report = json.loads((out / "ladder.json").read_text())
    assert all(r["status"] == "ok" for r in report["runs"]) and "law" in report
    assert capsys.readouterr().out.splitlines()[-1].startswith("ladder: {")
    target = "--n_layer=2 --n_embd=64 --n_head=1 --target_flops=3.2e10"
    assert ladder.main([str(out), "--predict", target]) == 0
    predicted = json.loads(capsys.readouterr().out.splitlines()[-1].removeprefix("predict: "))
    run_dir = tmp_path / "run"
    assert train.main([*shlex.split(base(data_dir)), *shlex.split(target), f"--out_dir={run_dir}"]) == 0
    result = json.loads((run_dir / "summary.json").read_text())["result"]
    assert result["flops"] == pytest.approx(predicted["flops"])
    assert predicted["ci95"][0] <= result["val_loss"] <= predicted["ci95"][1], (predicted, result["val_loss"])
