"""The tiny training run that the tests of train.py and its modules share: a 2-layer, 32-wide model (vocab 64) on a
synthetic dataset, a random Markov chain over 64 token ids (3 possible successors per token), so a model can learn
it and its loss visibly falls (conftest's data_dir fixture writes it); train.py run in-process or under torchrun, and
what its runs write and print.
"""

import contextlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import train

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def torch_threads(n):
    """torch's intra-op thread count at n inside (a CPU run's float sums depend on it), restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


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


def run(data_dir, out_dir, *args):
    """train.main in-process with the tiny model; returns its exit code."""
    return train.main([*TINY, f"--data_dir={data_dir}", f"--out_dir={out_dir}", *args])


def metrics(out_dir):
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


def train_losses(out_dir):
    return {m["step"]: m["train_loss"] for m in metrics(out_dir) if "train_loss" in m}


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


def subprocess_env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def torchrun(*args, nproc=2, script=ROOT / "train.py", check=True):
    """`torchrun --standalone --nproc_per_node=NPROC SCRIPT ARGS` with one thread per process; fails on an error
    (check=False: returns what a failed run gave)."""
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
    assert result.returncode == 0 or not check, result.stderr[-3000:]
    return result


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
