"""compare.py: the paired statistics against scipy's, and whole comparisons of tiny train.py runs: identical arms,
a clearly worse arm, an arm that diverges."""

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import scipy.stats

import compare
from gpt2train import runner
from test_train import TINY, data_dir  # noqa: F401  (data_dir is a fixture)


@pytest.mark.parametrize("df", [1, 2, 3, 7, 30, 1000])
@pytest.mark.parametrize("t", [0.0, 0.05, 0.7, 1.96, 4.3, 31.8, 400.0])
def test_the_t_distribution_is_scipys(t, df):
    assert compare.t_two_sided_p(t, df) == pytest.approx(2 * scipy.stats.t.sf(t, df), rel=1e-9, abs=1e-300)
    if t == 0.0:
        assert compare.t_quantile(0.975, df) == pytest.approx(scipy.stats.t.ppf(0.975, df), rel=1e-9)


@pytest.mark.parametrize(
    "deltas", [[0.01, 0.03, 0.02], [-0.5, 0.49, 0.02, -0.01], [3e-4, 2e-4], [-1.0, -1.1, -0.9, -1.0, -1.2]]
)
def test_the_paired_test_is_scipys_ttest_rel(deltas):
    base = np.array([5.0, 4.0, 6.0, 5.5, 4.5][: len(deltas)])
    arm = base + np.array(deltas)
    expected = scipy.stats.ttest_rel(arm, base)
    delta, ci95, p = compare.paired_test(list(arm - base))
    assert delta == pytest.approx(np.mean(arm - base), rel=1e-12) and p == pytest.approx(expected.pvalue, rel=1e-9)
    assert ci95 == pytest.approx(list(expected.confidence_interval(0.95)), rel=1e-9)


def test_the_paired_test_edge_cases():
    assert compare.paired_test([0.0, 0.0, 0.0]) == (0.0, [0.0, 0.0], 1.0)  # identical
    assert compare.paired_test([0.25]) == (0.25, None, None)  # one seed: no test
    assert compare.paired_test([0.5, 0.5, 0.5]) == (0.5, [0.5, 0.5], 0.0)  # the same shift on every seed


def test_an_arm_is_a_name_torchruns_count_and_train_pys_arguments():
    arm = compare.parse_arm("name=wide configs/a.py --n_embd=512 --nproc_per_node 8 --compile=False", 2)
    assert (arm.name, arm.args, arm.nproc) == ("wide", ["configs/a.py", "--n_embd=512", "--compile=False"], 8)
    command = runner.train_command(arm.job(1337, Path("out")), "ledger.jsonl")
    assert command[:5] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=8"]
    assert command[-3:] == ["--seed=1337", f"--out_dir={Path('out/wide/seed1337').absolute()}", "--ledger=ledger.jsonl"]
    assert compare.parse_arm("configs/a.py", 0).name == "baseline" and compare.parse_arm("'a b.py'", 3).name == "arm3"
    assert compare.parse_arm("'a b.py'", 3).args == ["a b.py"]


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["configs/a.py --seed=3"], "compare.py sets --seed for every run; leave it out"),
        (["configs/a.py --out_dir=x"], "compare.py sets --out_dir"),
        (["name=a x.py", "name=a y.py"], "two arms are named alike (a, a)"),
        (["name=../up x.py"], "name='../up' must be letters, digits"),
        (["x.py --nproc_per_node=0"], "--nproc_per_node needs a count >= 1, got '0'"),
        (["x.py", "--seeds", "0"], "--seeds must be >= 1 and <= 1000, got 0"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(argv, expected, tmp_path, capsys):
    assert compare.main([*argv, "--out_dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("compare.py: error: ") and err.count("\n") == 1 and expected in err, err


def tiny_arm(data_dir, *extra):
    """One arm's train.py arguments: the tiny model for 6 steps, validated at 3 and 6."""
    return " ".join([*TINY, f"--data_dir={data_dir}", "--max_steps=6", "--eval_interval=3", *extra])


@pytest.mark.slow
def test_identical_worse_and_diverging_arms_over_three_seeds(data_dir, tmp_path, capsys):  # noqa: F811
    """Two identical arms: every delta exactly 0, `identical`, a bit-identical repeat, yet the baseline's values differ
    across seeds (std > 0). A learning rate 300x lower: `worse` at p < 0.05, with scipy's numbers. A learning rate
    that makes every loss NaN: `failed`, its runs `diverged` (exit 3), and compare still finishes. The ledger has
    one line per run."""
    base = tiny_arm(data_dir)
    arms = [
        base,
        f"name=same {base}",
        f"name=slow {tiny_arm(data_dir, '--learning_rate=1e-5', '--min_lr=1e-6')}",
        f"name=nan {tiny_arm(data_dir, '--learning_rate=1e30', '--max_skipped_steps=2')}",
    ]
    assert compare.main([*arms, "--out_dir", str(tmp_path), "--repeat"]) == 0
    report = json.loads((tmp_path / "compare.json").read_text())
    out = capsys.readouterr().out
    assert out.splitlines()[-1].startswith("compare: ") and "[13/13]" in out
    brief = json.loads(out.splitlines()[-1][len("compare: ") :])
    assert brief["comparisons"] == report["comparisons"] and report["seeds"] == [1337, 1338, 1339]
    same, slow, nan = report["comparisons"]
    assert same["deltas"] == [0.0, 0.0, 0.0] and same["verdict"] == "identical" and same["p_value"] == 1.0
    assert same["first_differing_step"] is None
    assert report["noise"]["repeat_identical"] is True and report["noise"]["baseline_std"] > 0

    values = {arm["name"]: [run["value"] for run in arm["runs"]] for arm in report["arms"]}
    expected = scipy.stats.ttest_rel(values["slow"], values["baseline"])
    assert slow["verdict"] == "worse" and slow["p_value"] < 0.05 and slow["delta"] > 0
    assert slow["p_value"] == pytest.approx(expected.pvalue, rel=1e-9)
    assert slow["ci95"] == pytest.approx(list(expected.confidence_interval(0.95)), rel=1e-9)
    assert slow["delta"] == pytest.approx(float(np.mean(np.subtract(values["slow"], values["baseline"]))), rel=1e-12)
    assert slow["first_differing_step"] == 2  # step 1 is the same weights on the same batch
    assert math.isfinite(slow["speed_ratio"])

    nan_runs = report["arms"][3]["runs"]
    assert nan["verdict"] == "failed" and [r["status"] for r in nan_runs] == ["diverged"] * 3
    assert [r["exit_code"] for r in nan_runs] == [3] * 3 and [r["value"] for r in nan_runs] == [None] * 3
    ledger = [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    assert len(ledger) == 13 and sorted(r["status"] for r in ledger) == ["diverged"] * 3 + ["ok"] * 10
    assert all(r["params"] > r["params_lookup"] > 0 for r in ledger)
    assert {r["out_dir"] for r in ledger} == {r["out_dir"] for a in report["arms"] for r in a["runs"]} | {
        report["noise"]["repeat"]["out_dir"]
    }


def test_a_metric_the_result_does_not_have_is_one_line(data_dir, tmp_path, capsys):  # noqa: F811
    arm = " ".join([*TINY, f"--data_dir={data_dir}", "--max_steps=1"])
    assert compare.main([arm, "--out_dir", str(tmp_path), "--seeds", "1", "--metric", "val_accuracy"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--metric 'val_accuracy' is not in the result of" in err
    assert "its fields: status, val_loss" in err


def test_a_comparison_goes_on_where_it_stopped_and_takes_more_seeds(data_dir, tmp_path, capsys):  # noqa: F811
    """A comparison killed in its second run: run again, the first run is reused, the unfinished one is moved aside
    and made again; then --seeds 2 adds the second seed's runs only. Other arms into the same directory: refused."""
    base = " ".join([*TINY, f"--data_dir={data_dir}", "--max_steps=2", "--eval_interval=2"])
    arms = [base, f"name=b {base} --learning_rate=1e-3"]
    assert compare.main([*arms, "--out_dir", str(tmp_path), "--seeds", "1"]) == 0
    first = json.loads((tmp_path / "compare.json").read_text())
    # as if killed while b's run was training: compare.json had only the baseline's run, b's directory half made
    partial = json.loads(json.dumps(first))
    partial["arms"][1]["runs"] = []
    (tmp_path / "compare.json").write_text(json.dumps(partial))
    (tmp_path / "b" / "seed1337" / "stale").write_text("")
    capsys.readouterr()
    assert compare.main([*arms, "--out_dir", str(tmp_path), "--seeds", "2"]) == 0
    out = capsys.readouterr().out
    assert "[1/4] baseline seed 1337: ok" in out and "(made before)" in out.splitlines()[1]
    assert (tmp_path / "b" / "seed1337.unfinished" / "stale").exists()
    report = json.loads((tmp_path / "compare.json").read_text())
    assert report["arms"][0]["runs"][0] == first["arms"][0]["runs"][0]  # reused, not made again
    assert [r["value"] for r in report["arms"][1]["runs"]][:1] == [r["value"] for r in first["arms"][1]["runs"]]
    assert [len(a["runs"]) for a in report["arms"]] == [2, 2]
    assert len((tmp_path / "ledger.jsonl").read_text().splitlines()) == 2 + 1 + 2  # one line per run made
    assert compare.main([base, f"name=c {base}", "--out_dir", str(tmp_path)]) == 2
    assert "holds a comparison of other arms or another metric" in capsys.readouterr().err
