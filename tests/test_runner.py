"""gpt2train/runner.py: sizes, the jobs' commands and slots, and run_jobs on a stand-in train.py (a few lines of Python
that print a result line, sleep, exit 2 or stop on SIGTERM as train.py does) so that supervision is tested in
milliseconds: kept and re-made runs, a bad-input run, forwarded signals, death with the parent."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from gpt2train import runner
from gpt2train.config import make_config, model_config, parse_args
from gpt2train.files import LockError
from model import GPT

ROOT = Path(__file__).resolve().parent.parent

STAND_IN = textwrap.dedent(
    """
    import json, os, signal, sys, time
    args = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--"))
    os.makedirs(args["out_dir"], exist_ok=True)
    open(os.path.join(args["out_dir"], "env"), "w").write(json.dumps(dict(os.environ)))
    if "bad" in args:
        print("train.py: error: unknown config key 'bad'", file=sys.stderr)
        sys.exit(2)
    def stop(signum, frame):
        open(os.path.join(args["out_dir"], "stopped"), "w").write(str(signum))
        print("result: " + json.dumps({"status": "interrupted", "val_loss": None}), flush=True)
        sys.exit(5)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print("started", flush=True)
    time.sleep(float(args.get("sleep", 0)))
    print("result: " + json.dumps({"status": "ok", "val_loss": int(args["seed"]) / 1000, "name": "x"}), flush=True)
    """
)


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """runner.TRAIN_PY replaced by STAND_IN."""
    path = tmp_path / "stand_in_train.py"
    path.write_text(STAND_IN)
    monkeypatch.setattr(runner, "TRAIN_PY", path)
    return path


def jobs_of(out, *extra, seeds=(1, 2)):
    return [runner.Job(f"a/seed{s}", list(extra), s, out / "a" / f"seed{s}") for s in seeds]


@pytest.mark.parametrize(
    "text, expected",
    [("4x256", (4, 256)), ("1X64", (1, 64)), (" 2x128 ", (2, 128))],
)
def test_a_size_is_layers_x_width(text, expected):
    assert runner.parse_size(text) == expected
    assert runner.size_args(*expected) == [
        f"--n_layer={expected[0]}",
        f"--n_embd={expected[1]}",
        f"--n_head={expected[1] // 64}",
    ]


@pytest.mark.parametrize("text", ["4", "4x", "x256", "4x250", "0x64", "4x0", "4*256", "a x b"])
def test_a_bad_size_is_one_line(text):
    with pytest.raises(runner.RunnerError) as e:
        runner.parse_size(text)
    assert "\n" not in str(e.value) and repr(text) in str(e.value)


@pytest.mark.parametrize("config", ["configs/shakespeare_cpu.py", "configs/modern.py"])
def test_every_width_a_multiple_of_64_makes_a_model_of_both_recipes(config):
    for width in range(64, 1025, 64):
        cfg = make_config(parse_args([str(ROOT / config), *runner.size_args(1, width)]))
        gpt = model_config(cfg, vocab_size=64)
        assert (gpt.n_embd, gpt.n_head, gpt.n_embd // gpt.n_head) == (width, width // 64, 64)
    GPT(model_config(cfg, vocab_size=64, n_embd=64, n_head=1, block_size=8))  # the smallest builds


def test_a_job_is_absolute_and_runs_this_interpreters_torchrun(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    job = runner.Job("k", ["c.py"], 7, Path("o/k"), nproc=2)
    assert job.out_dir == tmp_path / "o" / "k" and job.log_path == tmp_path / "o" / "k.log"
    command = runner.train_command(job, tmp_path / "ledger.jsonl")
    assert command[:4] == [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    assert command[-4:] == [
        "c.py",
        "--seed=7",
        f"--out_dir={tmp_path / 'o' / 'k'}",
        f"--ledger={tmp_path}/ledger.jsonl",
    ]


def test_slots_split_a_cpus_threads_and_give_each_run_its_own_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    assert runner.slot_envs(3) == [{"OMP_NUM_THREADS": "2"}] * 3
    with pytest.raises(runner.RunnerError, match="--jobs 9 is more runs than this machine's 8 threads"):
        runner.slot_envs(9)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert runner.slot_envs(1) == [{}]  # one run: the devices as they are
    assert [e["CUDA_VISIBLE_DEVICES"] for e in runner.slot_envs(4)] == ["0", "1", "2", "3"]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in runner.slot_envs(2, nproc=2)] == ["0,1", "2,3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # the node's devices as this process sees them
    assert [e["CUDA_VISIBLE_DEVICES"] for e in runner.slot_envs(2)] == ["4", "5"]
    with pytest.raises(runner.RunnerError, match="--jobs 3 needs 6 GPUs .2 per run.; this node has 4"):
        runner.slot_envs(3, nproc=2)


def test_runs_are_kept_when_finished_and_made_again_when_not(stand_in, tmp_path):
    """Every run gets its seed, out_dir and the ledger, its log at <out_dir>.log and a record; a second call with
    the records keeps the finished runs (their out_dir where the jobs say now) and makes the interrupted one again."""
    seen = []
    records = runner.run_jobs(jobs_of(tmp_path), tmp_path, metric="val_loss", on_run=lambda *a: seen.append(a))
    assert [(k, made) for k, _, made in seen] == [("a/seed1", True), ("a/seed2", True)]
    first = records["a/seed1"]
    assert (first["status"], first["value"], first["exit_code"], first["seed"]) == ("ok", 0.001, 0, 1)
    assert first["result"] == {"status": "ok", "val_loss": 0.001, "name": "x"} and first["seconds"] > 0
    assert first["out_dir"] == str(tmp_path / "a" / "seed1") and (tmp_path / "a" / "seed1.log").is_file()
    assert records["a/seed2"]["value"] == 0.002
    done = {**records, "a/seed2": {**records["a/seed2"], "status": "interrupted"}}
    seen.clear()
    again = runner.run_jobs(
        jobs_of(tmp_path / "moved"), tmp_path / "moved", done=done, on_run=lambda *a: seen.append(a)
    )
    assert [(k, made) for k, _, made in seen] == [("a/seed1", False), ("a/seed2", True)]
    assert again["a/seed1"]["out_dir"] == str(tmp_path / "moved" / "a" / "seed1")
    assert again["a/seed2"]["status"] == "ok"


def test_a_non_numeric_metric_is_one_line_at_the_first_result(stand_in, tmp_path):
    with pytest.raises(runner.RunnerError, match="--metric 'name' is not a number in the result of .*seed1.log"):
        runner.run_jobs(jobs_of(tmp_path), tmp_path, metric="name")
    assert not (tmp_path / "a" / "seed2").exists()  # the second run never started


def test_a_run_that_exits_2_stops_the_others_and_says_its_line(stand_in, tmp_path, monkeypatch):
    """With two at once: the bad run's line; the other run stopped (SIGTERM: it saved, exit 5) and reported."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # a CPU of 2 threads, whatever this worker's share
    todo = [runner.Job("bad", ["--bad=1"], 1, tmp_path / "bad"), runner.Job("slow", ["--sleep=30"], 1, tmp_path / "s")]
    seen = []
    t0 = time.perf_counter()
    with pytest.raises(runner.BadRun) as e:
        runner.run_jobs(todo, tmp_path, jobs=2, on_run=lambda k, r, m: seen.append((k, r["status"])))
    assert str(e.value).startswith("run bad: train.py: error: unknown config key 'bad' (its log: ")
    assert seen == [("slow", "interrupted")] and time.perf_counter() - t0 < 20


def test_jobs_run_side_by_side_with_their_share_of_the_threads(stand_in, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    jobs = jobs_of(tmp_path, "--sleep=1", seeds=(1, 2, 3))
    records = runner.run_jobs(jobs, tmp_path, jobs=2)
    assert [r["threads"] for r in records.values()] == [2, 2, 2]
    # when each stand-in started (it writes env first) and ended (its log's last line): the first wave's two runs
    # overlapped, and the third started once both had ended
    (s1, e1), (s2, e2), (s3, _) = [((j.out_dir / "env").stat().st_mtime, j.log_path.stat().st_mtime) for j in jobs]
    assert max(s1, s2) < min(e1, e2) and s3 >= max(e1, e2)
    env = (tmp_path / "a" / "seed1" / "env").read_text()
    assert '"OMP_NUM_THREADS": "2"' in env


def test_sigterm_to_the_runner_stops_the_runs_which_save(stand_in, tmp_path, monkeypatch):
    """SIGTERM (as a scheduler sends it) while two runs train: both get it, save (exit 5) and are reported; then
    Interrupted with exit code 143, and the old handler is back."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # a CPU of 2 threads, whatever this worker's share
    before = signal.getsignal(signal.SIGTERM)
    seen = []
    timer = threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        with pytest.raises(runner.Interrupted) as e:
            todo = jobs_of(tmp_path, "--sleep=30", seeds=(1, 2, 3))
            runner.run_jobs(todo, tmp_path, jobs=2, on_run=lambda k, r, m: seen.append((k, r["status"])))
    finally:
        timer.cancel()
    assert e.value.exit_code == 143 and signal.getsignal(signal.SIGTERM) is before
    assert sorted(seen) == [("a/seed1", "interrupted"), ("a/seed2", "interrupted")]  # the third never started
    assert (tmp_path / "a" / "seed1" / "stopped").read_text() == str(int(signal.SIGTERM))


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_run_dies_with_its_runner_even_on_kill_9(stand_in, tmp_path):
    script = (
        "import sys; from pathlib import Path; from gpt2train import runner; runner.TRAIN_PY = Path(sys.argv[1]); "
        "runner.run_jobs([runner.Job('k', ['--sleep=60'], 1, Path(sys.argv[2]) / 'k')], sys.argv[2])"
    )
    parent = subprocess.Popen([sys.executable, "-c", script, str(stand_in), str(tmp_path)], cwd=ROOT)
    log = tmp_path / "k.log"
    deadline = time.time() + 60
    while "started" not in (log.read_text() if log.is_file() else "") and time.time() < deadline:
        time.sleep(0.1)
    parent.kill()
    parent.wait()
    stopped, deadline = tmp_path / "k" / "stopped", time.time() + 20
    while not (stopped.exists() and stopped.read_text()) and time.time() < deadline:  # made, then written
        time.sleep(0.1)
    assert stopped.read_text() == str(int(signal.SIGTERM))


def test_the_out_dir_lock_refuses_a_second_holder(tmp_path):
    with runner.lock(tmp_path / "o", "compare.py"):
        with pytest.raises(LockError, match="is in use by compare.py"):
            with runner.lock(tmp_path / "o", "compare.py"):
                pass
