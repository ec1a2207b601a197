"""pipeline_parallel: 2 stages on 2 CPU ranks (torchrun, gloo) train a NeoX-shaped model (untied head, parallel
residual, partial rotary) to one process's losses, validate to its val loss, checkpoint so that one process resumes;
the splits and the layouts it cannot run are refused in one line.
"""


import pytest

import train
from gpt2train.data import write_shard
from test_train import TINY, markov_tokens, metrics, torchrun

# a tiny NeoX: 4 blocks (2 per stage), 2 ranks x 8 rows of 16 tokens per step, or one process x 2 micro-batches;
# the 2 micro-batches of 4 rows are the pipeline's 2 pieces
NEOX = [
    *TINY,
    "--n_layer=4",
    "--rotary_pct=0.25",
    "--parallel_residual=True",
    "--tie_embeddings=False",
    "--activation=gelu",
    "--total_batch_size=128",
    "--max_steps=8",
    "--lr_decay_steps=8",
    "--eval_interval=4",
    "--save_interval=4",
    "--keep_last=0",
]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    write_shard(d / "tiny_train_000000.bin", markov_tokens(30_000, seed=1))
    write_shard(d / "tiny_val_000000.bin", markov_tokens(3_000, seed=2))
    return d


@pytest.fixture(scope="module")
def pipeline_run(data_dir, tmp_path_factory):
    """8 steps of 2 pipeline stages on 2 ranks (1F1B), checkpoints at steps 4 and 8."""
    out = tmp_path_factory.mktemp("pp")
    torchrun(*NEOX, f"--data_dir={data_dir}", f"--out_dir={out}", "--pipeline_parallel=2")
    return out


def by_step(out, key):
    return {m["step"]: m[key] for m in metrics(out) if key in m}


def max_diff(a, b):
    assert set(a) == set(b)
    return max(abs(a[k] - b[k]) for k in a)


@pytest.mark.slow
def test_two_stages_train_neox_to_one_process_losses(data_dir, pipeline_run, tmp_path):
    assert train.main([*NEOX, f"--data_dir={data_dir}", f"--out_dir={tmp_path}"]) == 0
    assert list(by_step(pipeline_run, "train_loss")) == list(range(1, 9))
    for key in ("train_loss", "grad_norm", "val_loss"):  # val_loss at step 0 too: the same initial weights
        assert max_diff(by_step(pipeline_run, key), by_step(tmp_path, key)) <= 1e-4, key
