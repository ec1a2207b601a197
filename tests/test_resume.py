"""resume.py: a resumed run continues bit-exactly (weights, optimizer, loader position, RNGs), and refuses a loader
state from another stream in one line.

Runs use tests/tiny.py's tiny model on the Markov-chain data of conftest's data_dir.
"""

import pytest
import torch

import train
from gpt2train.checkpoint import load_checkpoint
from gpt2train.shards import write_shard
from tiny import expect_exit, markov_tokens, one_line_error, run, train_losses


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
