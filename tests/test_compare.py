"""compare.py: the paired statistics against scipy's, and whole comparisons of tiny train.py runs: identical arms,
a clearly worse arm, an arm that diverges."""

import contextlib
import io
import json
import math
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import scipy.stats
import torch

import compare
from gpt2train import runner
from gpt2train.files import lock_holder
from tiny import TINY

ROOT = Path(__file__).resolve().parent.parent


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
        (["x.py", "--seeds", "1000000000"], "--seeds must be >= 1 and <= 1000, got 1000000000"),
        (["x.py --learning_rate='2e-3"], "No closing quotation (an unbalanced quote?)"),
        (["x.py --max_steps=5", "--equal_time", "60"], "arm baseline sets --max_steps=5: --equal_time sets every"),
        (["x.py", "--equal_time", "0"], "--equal_time must be > 0 seconds, got 0"),
        (["x.py", "--sizes", "2x64,3x100"], "size '3x100': the width 100 must be a multiple of the head dimension 64"),
        (["x.py", "--sizes", "2x64,2x64"], "--sizes names a size twice"),
        (["x.py", "--jobs", "0"], "--jobs must be >= 1, got 0"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(argv, expected, tmp_path, capsys):
    assert compare.main([*argv, "--out_dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("compare.py: error: ") and err.count("\n") == 1 and expected in err, err


def tiny_arm(data_dir, *extra):
    """One arm's train.py arguments: the tiny model for 6 steps, validated at 3 and 6."""
    return " ".join([*TINY, f"--data_dir={data_dir}", "--max_steps=6", "--eval_interval=3", *extra])


def slow_arm(data_dir):
    """The tiny arm at a learning rate 300x lower."""
    return tiny_arm(data_dir, "--learning_rate=1e-5", "--min_lr=1e-6")


def compare_quietly(argv, threads):
    """compare.main(argv), which must exit 0, with torch.get_num_threads() giving `threads` (the runner gives each of
    --jobs runs its share: a CPU run's sums depend on its thread count); returns what it printed."""
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
        patch.setattr(torch, "get_num_threads", lambda: threads)
        assert compare.main(argv) == 0
    return printed.getvalue()


@pytest.fixture(scope="module")
def compared(data_dir, tmp_path_factory):  # noqa: F811
    """Four arms over three seeds and the baseline's repeat, one thread a run: the baseline, an identical arm, a
    learning rate 300x lower (slow) and one that makes every loss NaN. Its directory and what compare printed."""
    out, base = tmp_path_factory.mktemp("compared"), tiny_arm(data_dir)
    arms = [
        base,
        f"name=same {base}",
        f"name=slow {slow_arm(data_dir)}",
        f"name=nan {tiny_arm(data_dir, '--learning_rate=1e30', '--max_skipped_steps=2')}",
    ]
    return out, compare_quietly([*arms, "--out_dir", str(out), "--repeat"], threads=1)


@pytest.fixture(scope="module")
def two_jobs(data_dir, tmp_path_factory):  # noqa: F811
    """The baseline and slow arms of `compared` over two seeds with --jobs 2 (two runs at once, one thread each):
    its directory and compare.json."""
    out = tmp_path_factory.mktemp("two_jobs")
    compare_quietly(
        [tiny_arm(data_dir), f"name=slow {slow_arm(data_dir)}", "--seeds", "2", "--jobs", "2", "--out_dir", str(out)],
        threads=2,
    )
    return out, json.loads((out / "compare.json").read_text())


@pytest.mark.slow
def test_identical_worse_and_diverging_arms_over_three_seeds(compared):
    """Two identical arms: every delta exactly 0, `identical`, a bit-identical repeat, yet the baseline's values differ
    across seeds (std > 0). A learning rate 300x lower: `worse` at p < 0.05, with scipy's numbers. A learning rate
    that makes every loss NaN: `failed`, its runs `diverged` (exit 3), and compare still finishes. The ledger has
    one line per run."""
    tmp_path, out = compared
    report = json.loads((tmp_path / "compare.json").read_text())
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


@pytest.mark.slow
def test_a_metric_the_result_does_not_have_is_one_line(data_dir, tmp_path, capsys):  # noqa: F811
    arm = " ".join([*TINY, f"--data_dir={data_dir}", "--max_steps=1"])
    assert compare.main([arm, "--out_dir", str(tmp_path), "--seeds", "1", "--metric", "val_accuracy"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--metric 'val_accuracy' is not in the result of" in err
    assert "its fields: status, val_loss" in err


@pytest.mark.slow
def test_a_comparison_goes_on_where_it_stopped_and_takes_more_seeds(two_jobs, data_dir, tmp_path, capsys):  # noqa: F811
    """A comparison killed in a run (a copy of two_jobs', moved: runs are keyed by arm and seed): run again, the
    finished runs are reused, the unfinished one is moved aside and made again; --seeds 3 adds the third seed's runs
    only. Other arms into the same directory: refused."""
    shutil.copytree(two_jobs[0], tmp_path, dirs_exist_ok=True)
    first = two_jobs[1]
    arms = [tiny_arm(data_dir), f"name=slow {slow_arm(data_dir)}"]
    # as if killed while slow's first run was training: compare.json without it, its directory half made
    partial = json.loads(json.dumps(first))
    partial["arms"][1]["runs"] = partial["arms"][1]["runs"][1:]
    (tmp_path / "compare.json").write_text(json.dumps(partial))
    (tmp_path / "slow" / "seed1337" / "stale").write_text("")
    capsys.readouterr()
    with pytest.MonkeyPatch.context() as patch:  # one thread, as two_jobs gave each run
        patch.setattr(torch, "get_num_threads", lambda: 1)
        assert compare.main([*arms, "--out_dir", str(tmp_path), "--seeds", "3"]) == 0
    out = capsys.readouterr().out
    assert "[1/6] baseline seed 1337: ok" in out and "(made before)" in out.splitlines()[1]
    assert (tmp_path / "slow" / "seed1337.unfinished" / "stale").exists()
    report = json.loads((tmp_path / "compare.json").read_text())
    reused, made = report["arms"][0]["runs"][0], first["arms"][0]["runs"][0]  # reused, not made again
    assert reused == made | {"out_dir": str(tmp_path / "baseline" / "seed1337")}
    assert [r["value"] for r in report["arms"][1]["runs"]][:2] == [r["value"] for r in first["arms"][1]["runs"]]
    assert [len(a["runs"]) for a in report["arms"]] == [3, 3]
    assert len((tmp_path / "ledger.jsonl").read_text().splitlines()) == 4 + 1 + 2  # one line per run made
    assert compare.main([tiny_arm(data_dir), f"name=c {tiny_arm(data_dir)}", "--out_dir", str(tmp_path)]) == 2
    assert "holds a comparison of other arms or another metric" in capsys.readouterr().err


@pytest.mark.parametrize(
    "content",
    [bytes(range(256)) * 12, b'{"metric": "val_loss", "seeds": [13', b"", b"[]", b'{"metric": "val_loss"}'],
    ids=["garbage", "truncated", "empty", "list", "missing_keys"],
)
def test_a_compare_json_compare_py_did_not_write_is_one_line(content, tmp_path, capsys):
    (tmp_path / "compare.json").write_bytes(content)
    assert compare.main(["x.py", "--out_dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{tmp_path}/compare.json is not a comparison compare.py wrote (" in err, err
    assert err.rstrip().endswith("move it away") and sorted(p.name for p in tmp_path.iterdir()) == [
        ".lock",
        "compare.json",
    ]


def fake_arm(name, values, statuses=None, size=None, val_bytes=None):
    """An Arm whose runs (seeds 1337...) ended with these values, without training."""
    arm = compare.Arm(name, [], size=size)
    for i, v in enumerate(values):
        status = statuses[i] if statuses else "ok"
        result = {"val_bytes": val_bytes} if val_bytes else {}
        run = {"seed": 1337 + i, "status": status, "value": v, "tokens_per_s": None, "out_dir": "/nonexistent"}
        arm.runs[1337 + i] = run | {"params": 1000 * (1 + 3 * (size == "2x64")), "result": result}
    return arm


def test_a_metric_null_in_every_ok_run_is_no_value_not_failed():
    base, arm = fake_arm("baseline", [None] * 3), fake_arm("a", [None] * 3)
    assert compare.compare_arm(arm, base, "max_seconds", [1337, 1338, 1339])["verdict"] == "no value"
    failed = fake_arm("a", [None] * 3, statuses=["ok", "diverged", "ok"])
    assert compare.compare_arm(failed, base, "max_seconds", [1337, 1338, 1339])["verdict"] == "failed"


def test_the_verdict_counts_the_requested_seeds_only():
    base, arm = fake_arm("baseline", [1.0, 2.0, 3.0, 4.0]), fake_arm("a", [1.5, 2.5, 3.0, 9.0])
    assert compare.compare_arm(arm, base, "val_loss", [1337, 1338])["deltas"] == [0.5, 0.5]


def test_arms_that_scored_other_val_bytes_are_warned_about():
    base, same, other = (fake_arm(n, [1.0, 1.0], val_bytes=b) for n, b in [("base", 100), ("s", 100), ("o", 180)])
    warnings = compare.val_bytes_warnings([base, same, other], [1337, 1338])
    assert len(warnings) == 1 and warnings[0].startswith("arm o scored 180 val bytes, the baseline 100")
    assert "--eval_steps=all" in warnings[0]
    assert compare.val_bytes_warnings([fake_arm("b", [1.0]), fake_arm("o", [1.0])], [1337]) == []  # no field


def test_the_slope_fit_is_scipys_linregress():
    x, y = [0.0, 0.0, 1.0, 1.0, 2.5, 2.5], [0.1, 0.12, 0.05, 0.08, -0.01, 0.02]
    fit = scipy.stats.linregress(x, y)
    slope, ci = compare.slope_fit(list(zip(x, y)))
    half = scipy.stats.t.ppf(0.975, len(x) - 2) * fit.stderr
    assert slope == pytest.approx(fit.slope, rel=1e-12) and ci == pytest.approx([fit.slope - half, fit.slope + half])
    assert compare.slope_fit([(0.0, 1.0), (1.0, 2.0)]) == (None, None)


@pytest.mark.parametrize(
    "words, expected",
    [
        (["better", "better", "better"], "holds"),
        (["better", "better", "no detectable difference"], "shrinks"),
        (["no detectable difference", "better", "better"], "grows"),
        (["better", "no detectable difference", "worse"], "flips"),
        (["worse", "worse"], "worse"),
        (["worse", "better"], "better"),
        (["better", "failed"], "failed"),
        (["identical", "identical"], "identical"),
    ],
)
def test_the_transfer_verdict(words, expected):
    assert compare.transfer_verdict(words) == expected


def test_transfer_orders_sizes_by_params_and_fits_the_slope():
    arms = [
        fake_arm("baseline", [1.0, 2.0, 3.0], size="2x64"),
        fake_arm("a", [0.9, 1.9, 2.9], size="2x64"),  # params 4000
        fake_arm("baseline", [1.0, 2.0, 3.0], size="1x64"),
        fake_arm("a", [0.5, 1.5, 2.45], size="1x64"),  # params 1000
    ]
    comparisons = [compare.compare_arm(arms[i], arms[i - 1], "val_loss", [1337, 1338, 1339]) for i in (1, 3)]
    (t,) = compare.transfer(arms, comparisons)
    assert [s["size"] for s in t["per_size"]] == ["1x64", "2x64"] and t["per_size"][0]["params"] == 1000
    assert [s["verdict"] for s in t["per_size"]] == ["better", "better"] and t["verdict"] == "holds"
    assert t["slope"] == pytest.approx(0.4 / math.log(4), rel=0.05) and t["slope_ci95"][0] < t["slope"]


@pytest.mark.slow
def test_an_arm_that_is_bad_input_stops_at_its_first_run(data_dir, tmp_path, capsys):  # noqa: F811
    """A typo'd key: train.py exits 2 at once; compare stops there with train.py's line, exit 2, no more runs."""
    arm = " ".join([*TINY, f"--data_dir={data_dir}", "--max_steps=1"])
    assert compare.main([arm, f"name=typo {arm} --max_step=5", "--out_dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "run typo/seed1337: train.py: error: " in err and "max_step" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "baseline", "compare.json", "ledger.jsonl", "typo"]
    assert [p.name for p in (tmp_path / "baseline").iterdir() if p.is_dir()] == ["seed1337"]  # seed 1338 not started


@pytest.mark.slow
def test_a_metric_that_is_not_a_number_is_one_line_at_the_first_result(data_dir, tmp_path, capsys):  # noqa: F811
    arm = " ".join([*TINY, f"--data_dir={data_dir}", "--max_steps=1"])
    assert compare.main([arm, arm, "--out_dir", str(tmp_path), "--metric", "status"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--metric 'status' is not a number in the result of " in err, err
    assert not (tmp_path / "arm1").exists()


def test_a_second_compare_on_one_out_dir_is_refused(tmp_path, capsys):
    with runner.lock(tmp_path, "compare.py"):
        assert compare.main(["x.py", "--out_dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{tmp_path} is in use by compare.py (pid " in err


@pytest.mark.slow
def test_sigterm_stops_the_run_which_saves_and_compare_says_so_in_one_line(data_dir, tmp_path):  # noqa: F811
    """SIGTERM to compare.py alone (as `kill PID` sends it) during a run: the run saves (interrupted, exit 5),
    compare.json says so, one line, exit 143, no train.py left holding the run's directory."""
    arm = " ".join([*TINY, f"--data_dir={data_dir}", "--max_steps=100000", "--eval_interval=0", "--save_interval=0"])
    command = [sys.executable, str(ROOT / "compare.py"), arm, "--seeds", "1", "--out_dir", str(tmp_path)]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    metrics = tmp_path / "baseline" / "seed1337" / "metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics.is_file() and metrics.stat().st_size) and time.time() < deadline:
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 143 and err.count("\n") == 1 and "interrupted by SIGTERM" in err, err
    (run,) = json.loads((tmp_path / "compare.json").read_text())["arms"][0]["runs"]
    assert run["status"] == "interrupted" and run["exit_code"] == 5
    assert lock_holder(tmp_path / "baseline" / "seed1337") is None


class FakeTrain:
    """subprocess.Popen of train.py, faked: records the command and environment and writes a result line whose
    val_loss is seed / 1000 plus the learning rate, at 100 steps/s (50 with --n_layer=2)."""

    calls = []

    def __init__(self, command, stdout, env, **kwargs):
        FakeTrain.calls.append((command, env))
        args = dict(a[2:].split("=", 1) for a in command if a.startswith("--") and "=" in a)
        steps, rate = int(args.get("max_steps", 10)), 50 if args.get("n_layer") == "2" else 100
        value = int(args["seed"]) / 1000 + float(args.get("learning_rate", 0))
        result = {"status": "ok", "val_loss": value, "steps": steps, "train_s": steps / rate, "tokens_per_s": 1.0}
        stdout.write(f"result: {json.dumps(result | {'params': 10, 'params_lookup': 0})}\n")
        Path(args["out_dir"]).mkdir(parents=True)
        losses = [{"step": s, "train_loss": 5 - (s - 1) * (0.1 + float(args.get("learning_rate", 0)))} for s in (1, 2)]
        (Path(args["out_dir"]) / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in losses))

    def poll(self):
        return 0


@pytest.fixture
def fake_train(monkeypatch):
    """FakeTrain in place of train.py's processes, on a machine with `devices` CUDA devices (0: a CPU of 2 threads)."""
    FakeTrain.calls = []
    monkeypatch.setattr(runner.subprocess, "Popen", FakeTrain)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return lambda devices: monkeypatch.setattr(torch.cuda, "device_count", lambda: devices)


def test_jobs_on_a_gpu_node_give_each_run_one_device(fake_train, tmp_path, capsys):
    fake_train(2)
    assert compare.main(["x.py", "name=b x.py --learning_rate=1", "--jobs", "3", "--out_dir", str(tmp_path)]) == 2
    assert "--jobs 3 needs 3 GPUs (1 per run); this node has 2" in capsys.readouterr().err
    assert compare.main(["x.py", "name=b x.py --learning_rate=1", "--jobs", "2", "--out_dir", str(tmp_path)]) == 0
    devices = [env["CUDA_VISIBLE_DEVICES"] for _, env in FakeTrain.calls]
    assert devices == ["0", "1"] * 3  # per seed, the two arms at once, each on its own device
    report = json.loads((tmp_path / "compare.json").read_text())
    assert [r["devices"] for r in report["arms"][1]["runs"]] == ["1"] * 3
    assert report["comparisons"][0]["deltas"] == pytest.approx([1.0] * 3)


def test_equal_time_gives_each_arm_the_steps_its_timing_makes_in_s_seconds(fake_train, tmp_path):
    fake_train(0)
    arms = ["configs/x.py", "name=deep configs/x.py --n_layer=2"]
    assert compare.main([*arms, "--equal_time", "2", "--seeds", "2", "--out_dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "compare.json").read_text())
    assert [a["max_steps"] for a in report["arms"]] == [200, 100] and report["equal_time"] == 2
    timing = [c for c, _ in FakeTrain.calls[:4]]
    assert [c[c.index("--max_steps=10") - 1] for c in timing] == ["configs/x.py", "--n_layer=2"] * 2  # A B A B
    runs = [c for c, _ in FakeTrain.calls[4:]]
    assert [c[-4] for c in runs] == ["--max_steps=200", "--max_steps=100"] * 2
    FakeTrain.calls = []
    assert compare.main([*arms, "--equal_time", "2", "--seeds", "2", "--out_dir", str(tmp_path)]) == 0
    assert FakeTrain.calls == []  # timing and runs kept


def test_confirm_refuses_data_without_test_shards_before_training(data_dir, tmp_path, capsys):  # noqa: F811
    arm = " ".join([*TINY, f"--data_dir={data_dir}", "--max_steps=1"])
    assert compare.main([arm, "--confirm", "--out_dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--confirm: {data_dir} holds no test shards (arm baseline)" in err, err
    assert not (tmp_path / "o" / "baseline").exists()


def test_confirm_scores_each_run_on_the_test_split_and_gives_its_verdict(fake_train, tmp_path, monkeypatch):
    fake_train(0)
    data = tmp_path / "data"
    data.mkdir()
    (data / "x_test_000000.bin").write_bytes(b"")
    scored = []
    test_loss = lambda run: scored.append(run["out_dir"]) or {"test_loss": run["value"] * 2, "test_bpb": 1.0}  # noqa: E731
    monkeypatch.setattr(compare.runner, "evaluate_test", test_loss)
    (tmp_path / "cfg.py").write_text(f"data_dir = {str(data)!r}\n")  # the data_dir a config file names
    arms = [f"{tmp_path}/cfg.py", f"name=b {tmp_path}/cfg.py --learning_rate=-0.5"]
    assert compare.main([*arms, "--confirm", "--out_dir", str(tmp_path / "o")]) == 0
    (c,) = json.loads((tmp_path / "o" / "compare.json").read_text())["comparisons"]
    assert c["verdict"] == "better" and c["confirm"]["metric"] == "test_loss"
    assert c["confirm"]["deltas"] == pytest.approx([-1.0] * 3) and c["confirm"]["verdict"] == "better"
    assert len(scored) == 6
    assert compare.main([*arms, "--confirm", "--out_dir", str(tmp_path / "o")]) == 0 and len(scored) == 6  # kept


@pytest.mark.slow
def test_two_jobs_at_once_are_bit_identical_to_one(compared, two_jobs):
    """The baseline and slow arms over two seeds with --jobs 2 against the same runs of `compared` (--jobs 1), one
    thread per run both times (a CPU run's sums depend on its thread count): the same values and train losses."""
    made = json.loads((compared[0] / "compare.json").read_text())
    one = {"arms": [{"runs": made["arms"][i]["runs"][:2]} for i in (0, 2)]}  # baseline and slow, seeds 1337, 1338
    two = two_jobs[1]
    assert [r["threads"] for a in one["arms"] + two["arms"] for r in a["runs"]] == [1] * 8
    assert [[r["value"] for r in a["runs"]] for a in one["arms"]] == [
        [r["value"] for r in a["runs"]] for a in two["arms"]
    ]
    for a, b in zip(one["arms"], two["arms"]):
        assert [compare.train_losses(r) for r in a["runs"]] == [compare.train_losses(r) for r in b["runs"]]
        assert all(compare.train_losses(r) for r in a["runs"])


@pytest.mark.slow
def test_a_10x_lower_learning_rate_is_worse_at_every_size(data_dir, tmp_path, capsys):  # noqa: F811
    base = tiny_arm(data_dir, "--max_steps=4", "--eval_interval=4")
    arms = [base, f"name=slow {base} --learning_rate=3e-4 --min_lr=3e-5"]
    assert compare.main([*arms, "--sizes", "1x64,2x64", "--out_dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "compare.json").read_text())
    assert [(c["arm"], c["size"], c["verdict"]) for c in report["comparisons"]] == [
        ("slow", "1x64", "worse"),
        ("slow", "2x64", "worse"),
    ]
    (t,) = report["transfer"]
    assert t["arm"] == "slow" and t["verdict"] == "worse" and [s["size"] for s in t["per_size"]] == ["1x64", "2x64"]
    assert t["per_size"][0]["params"] < t["per_size"][1]["params"] and t["slope"] is not None
    out = capsys.readouterr().out
    assert "| slow@2x64 |" in out and "transfer: slow worse (1x64 worse, 2x64 worse;" in out


def test_from_another_directory_moved_and_with_fewer_seeds(fake_train, tmp_path, monkeypatch, capsys):
    """Run from elsewhere with a relative --out_dir: one tree under the cwd and the first differing step found.
    Moved to another path, the comparison keeps every run (keyed by arm and seed); --seeds 1 after 2 keeps seed
    1338's runs in compare.json out of the verdict; an interrupted run is made again, and only it."""
    fake_train(0)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    arms = ["x.py", "name=b x.py --learning_rate=0.5"]
    assert compare.main([*arms, "--out_dir", "o", "--seeds", "2", "--repeat"]) == 0
    report = json.loads((elsewhere / "o" / "compare.json").read_text())
    assert report["comparisons"][0]["first_differing_step"] == 2 and report["noise"]["repeat_identical"] is True
    assert {c[-2] for c, _ in FakeTrain.calls} == {
        f"--out_dir={elsewhere}/o/{k}" for k in KEYS + ["baseline/seed1337_repeat"]
    }
    (elsewhere / "o").rename(tmp_path / "moved")
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert compare.main([*arms, "--out_dir", str(tmp_path / "moved"), "--seeds", "1", "--repeat"]) == 0
    assert capsys.readouterr().out.count("(made before)") == 3
    report = json.loads((tmp_path / "moved" / "compare.json").read_text())
    assert report["seeds"] == [1337] and [len(a["runs"]) for a in report["arms"]] == [2, 2]
    assert len(report["comparisons"][0]["deltas"]) == 1 and report["comparisons"][0]["first_differing_step"] == 2
    assert report["arms"][1]["runs"][1]["out_dir"] == str(tmp_path / "moved" / "b" / "seed1338")
    report["arms"][1]["runs"][0]["status"] = "interrupted"
    (tmp_path / "moved" / "compare.json").write_text(json.dumps(report))
    FakeTrain.calls = []
    assert compare.main([*arms, "--out_dir", str(tmp_path / "moved"), "--seeds", "2", "--repeat"]) == 0
    assert capsys.readouterr().out.count("(made before)") == 4
    assert [c[-2] for c, _ in FakeTrain.calls] == [f"--out_dir={tmp_path}/moved/b/seed1337"]


KEYS = ["baseline/seed1337", "b/seed1337", "baseline/seed1338", "b/seed1338"]
