"""start.py: what a run starts from, decided once: the out_dir protocol (no start over checkpoints, the lock, a
read-only or node-local out_dir, a file where a directory belongs), the data directory found or named with its
prepare command, a resume's fixed architecture, and a fine-tune's checkpoint read once with its architecture.

Runs use tests/tiny.py's tiny model on the Markov-chain data of conftest's data_dir.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import model as model_module
import train
from conftest import data_cfg
from gpt2train import checkpoint, loading, optim, sharded
from gpt2train.checkpoint import load_checkpoint
from gpt2train.config import TrainConfig
from gpt2train.data import DataLoader
from gpt2train.shards import write_shard
from tiny import ROOT, TINY, expect_exit, free_port, metrics, one_line_error, run, subprocess_env, train_losses


def test_refuses_to_start_over_existing_checkpoints(data_dir, tmp_path, capsys):
    assert run(data_dir, tmp_path, "--max_steps=4") == 0
    with pytest.raises(SystemExit) as exit_:
        run(data_dir, tmp_path, "--max_steps=4")
    assert exit_.value.code == 2 and "--init_from=resume" in capsys.readouterr().err


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


def test_resume_cannot_change_the_architecture(data_dir, tmp_path, capsys):
    assert run(data_dir, tmp_path, "--max_steps=4") == 0
    with pytest.raises(SystemExit):
        train.main(["--init_from=resume", f"--out_dir={tmp_path}", "--n_layer=3"])
    assert "cannot change n_layer when resuming" in capsys.readouterr().err


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


def test_a_second_run_on_a_locked_out_dir_is_refused(data_dir, tmp_path, capsys):
    from gpt2train.files import directory_lock

    with directory_lock(tmp_path, "other.py"):
        expect_exit(1, run, data_dir, tmp_path, "--max_steps=4")
    line = one_line_error(capsys)
    assert f"{tmp_path} is in use by other.py (pid {os.getpid()} on " in line
    assert not (tmp_path / "metrics.jsonl").exists()
    assert run(data_dir, tmp_path, "--max_steps=4") == 0  # the lock ended with its holder


def test_read_only_out_dir_is_one_line(data_dir, tmp_path, read_only, capsys):
    read_only(tmp_path / "ro")
    expect_exit(1, run, data_dir, tmp_path / "ro" / "out", "--max_steps=4")
    assert one_line_error(capsys) == f"train.py: error: {tmp_path / 'ro' / 'out'}: Permission denied"


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
