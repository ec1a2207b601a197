"""The modern recipe's optimizer in runs: optimizer='muon' (torch.optim.Muon for the blocks' hidden matrices, AdamW
for the rest) checkpoints, resumes and runs under DDP like the default AdamW (its grouping: test_optim.py).

Runs reuse test_train.py's tiny model and synthetic Markov-chain data.
"""

from dataclasses import dataclass

import numpy as np
import pytest
import torch

import train
from gpt2train import loading
from gpt2train.checkpoint import load_checkpoint
from gpt2train.config import ConfigError, TrainConfig, parse_args
from test_train import ROOT, TINY, data_dir, metrics, run, subprocess_env, torchrun, train_losses  # noqa: F401 (fixture)

MUON = ["--optimizer=muon", "--muon_lr=0.03"]
MODERN = str(ROOT / "configs" / "modern.py")


def test_muon_resume_is_bit_exact(data_dir, tmp_path):
    """As test_train's AdamW test: 4 steps + resume + 4 == 8 straight, Muon's momentum buffers included (with
    configs/modern.py's model and schedule)."""
    common = [MODERN, "--dropout=0.1", "--total_batch_size=128", "--lr_decay_steps=8"]
    assert run(data_dir, tmp_path / "full", *common, "--max_steps=8") == 0
    assert run(data_dir, tmp_path / "split", *common, "--max_steps=4") == 0
    assert train.main(["--init_from=resume", f"--out_dir={tmp_path / 'split'}", "--max_steps=8"]) == 0
    full, split = train_losses(tmp_path / "full"), train_losses(tmp_path / "split")
    assert list(split) == list(range(1, 9)) and split == full
    a, b = load_checkpoint(tmp_path / "full"), load_checkpoint(tmp_path / "split")
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    momentum = b["optimizer"]["muon"]["state"]
    assert len(momentum) == 8 and all(s["momentum_buffer"].abs().sum() > 0 for s in momentum.values())


def test_resume_cannot_change_the_optimizer(data_dir, tmp_path, capsys):
    assert run(data_dir, tmp_path, "--max_steps=4") == 0
    with pytest.raises(SystemExit):
        train.main(["--init_from=resume", f"--out_dir={tmp_path}", "--optimizer=muon"])
    assert "cannot change optimizer when resuming" in capsys.readouterr().err


@dataclass
class WithParallel(TrainConfig):  # the `parallel` key as the sharding issue adds it, whether or not it has landed
    parallel: str = "ddp"


@pytest.mark.parametrize(
    "keys, error",
    [
        ({"optimizer": "muon", "parallel": "fsdp"}, "optimizer='muon' is not supported with parallel='fsdp'"),
        ({"optimizer": "sgd"}, "config key 'optimizer' must be one of 'adamw', 'muon'"),
        ({"muon_lr": 0.0}, "config key 'muon_lr' must be > 0"),
        ({"muon_momentum": 1.0}, "config key 'muon_momentum' must be in [0, 1)"),
    ],
)
def test_bad_muon_config_is_a_one_line_error(keys, error):
    with pytest.raises(ConfigError) as err:
        WithParallel(**keys)
    assert error in str(err.value) and "\n" not in str(err.value)
    WithParallel(optimizer="muon", parallel="ddp")  # DDP is fine


@pytest.mark.slow
def test_muon_ddp_two_processes_equal_one_process_with_accumulation(data_dir, tmp_path):
    """Gradients are all-reduced before the step, so each rank's Muon orthogonalises the same matrix."""
    common = [f"--data_dir={data_dir}", "--max_steps=4", "--total_batch_size=128", "--eval_interval=0", *MUON]
    torchrun(*TINY, *common, f"--out_dir={tmp_path / 'ddp'}")
    assert run(data_dir, tmp_path / "single", *common[1:]) == 0
    ddp, single = train_losses(tmp_path / "ddp"), train_losses(tmp_path / "single")
    assert list(ddp) == list(single) == [1, 2, 3, 4]
    # torch.optim.Muon orthogonalises in bf16: the fp32 rounding difference between an all-reduce and an
    # accumulation (~1e-7) can flip a bf16 rounding, so steps agree to ~1e-5, not bit for bit; a wrong
    # reduction (a sum, or one rank's gradient) is off by far more
    assert np.allclose(list(ddp.values()), list(single.values()), atol=1e-4, rtol=0), (ddp, single)
    a, b = load_checkpoint(tmp_path / "ddp"), load_checkpoint(tmp_path / "single")
    worst = max((a["model"][k] - b["model"][k]).abs().max().item() for k in a["model"])
    print(f"Muon DDP vs accumulation: max weight difference after 4 steps {worst:.2e}")
    # a few bf16 roundings of updates of size ~muon_lr (0.03): measured ~1e-3; a wrong reduction moves weights
    # by O(muon_lr) per step
    assert worst < 0.1 * 0.03


# ----------------------------------------------------------------------------- the recipe configs


def test_gpt2_124m_modern_is_gpt2_124m_with_the_modern_recipe():
    both = parse_args([str(ROOT / "configs" / "gpt2_124m.py"), MODERN])
    one = parse_args([str(ROOT / "configs" / "gpt2_124m_modern.py")])
    assert {k: v for k, v in one.items() if k != "out_dir"} == {k: v for k, v in both.items() if k != "out_dir"}
    assert set(parse_args([MODERN])).isdisjoint(
        {
            "n_layer",
            "n_embd",
            "n_head",
            "block_size",
            "batch_size",
            "total_batch_size",
            "max_steps",
            "preset",
            "data_dir",
        }
    )


def test_modern_config_trains_resumes_and_samples(data_dir, tmp_path):
    """configs/modern.py on the tiny model (its own learning rates and schedule): the loss falls, a resume
    continues the run, and the checkpoint samples the same tokens with and without the KV cache."""
    tiny = [a for a in TINY if not a.startswith(("--learning_rate", "--min_lr", "--warmup_steps"))]
    out = tmp_path / "out"
    assert (
        train.main(
            [MODERN, *tiny, f"--data_dir={data_dir}", f"--out_dir={out}", "--max_steps=8", "--lr_decay_steps=12"]
        )
        == 0
    )
    assert train.main(["--init_from=resume", f"--out_dir={out}", "--max_steps=12"]) == 0
    assert list(train_losses(out)) == list(range(1, 13))
    val = [m["val_loss"] for m in metrics(out) if "val_loss" in m]
    assert val[-1] < val[0] - 0.5, val  # from ~ln(64) = 4.16 towards the chain's ln(3) = 1.10
    model, info = loading.load_model(ckpt=out)
    assert info["step"] == 12 and model.config.qk_norm and model.config.activation == "relu2"
    assert not model.config.tie_embeddings and info["config"]["optimizer"] == "muon"
    prompt = torch.tensor([[1, 2, 3]])
    cached, uncached = (model.generate(prompt, 12, temperature=0, use_kv_cache=c) for c in (True, False))
    assert torch.equal(cached, uncached) and cached.shape == (1, 15)
