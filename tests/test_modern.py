"""The modern recipe's optimizer: optimizer='muon' (torch.optim.Muon for the blocks' hidden matrices, AdamW for
the rest) groups, schedules, checkpoints, resumes and runs under DDP like the default AdamW.

Runs reuse test_train.py's tiny model and synthetic Markov-chain data.
"""
import subprocess
import sys
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from test_train import ROOT, TINY, data_dir, metrics, run, subprocess_env, train_losses  # noqa: F401 (fixture)

import checkpoint
import optim
import train
from checkpoint import load_checkpoint
from config import ConfigError, TrainConfig, make_config, model_config, parse_args
from model import GPT

MUON = ["--optimizer=muon", "--muon_lr=0.03"]
MODERN = str(ROOT / "configs" / "modern.py")


def tiny_setup(**keys):
    cfg = make_config({"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, "vocab_size": 64,
                       "learning_rate": 3e-3, "min_lr": 3e-4, "optimizer": "muon", "muon_lr": 0.03, **keys})
    model = GPT(model_config(cfg))
    return model, optim.build_optimizer(model, cfg), cfg


def test_muon_trains_the_hidden_matrices_and_adamw_the_rest():
    model, opt, cfg = tiny_setup()
    names = {id(p): n for n, p in model.named_parameters()}
    muon = sorted(names[id(p)] for g in opt.muon.param_groups for p in g["params"])
    assert muon == sorted(f"transformer.h.{i}.{m}.weight" for i in range(2)
                          for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"))
    adamw = [names[id(p)] for g in opt.adamw.param_groups for p in g["params"]]
    assert {"transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight",
            "transformer.h.0.attn.c_attn.bias", "transformer.h.1.ln_2.bias"} <= set(adamw)
    # every trainable parameter in exactly one group of one optimizer (the tied head is wte, counted once)
    ids = [id(p) for g in opt.param_groups for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in model.parameters()) and len(ids) == len(set(ids))
    assert [g["lr"] for g in opt.muon.param_groups] == [0.03]
    assert [(g["lr"], g["weight_decay"]) for g in opt.adamw.param_groups] == [(3e-3, cfg.weight_decay), (3e-3, 0.0)]
    assert all(p.dim() == 2 for g in opt.adamw.param_groups[:1] for p in g["params"])  # decay: embeddings only
    optim.set_lr(opt, 1e-3, cfg)  # a third of the peak: both optimizers follow the schedule alike
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.01, 1e-3, 1e-3])
    _, plain, _ = tiny_setup(optimizer="adamw")
    assert type(plain) is torch.optim.AdamW  # the default is unchanged


def test_muon_grouping_with_the_modern_model_options():
    """An untied head is AdamW's (a 2-D matrix, but not a hidden one); without biases, norms are AdamW's only
    non-matrix tensors; qk_norm and rotary add no parameters."""
    model, opt, _ = tiny_setup(tie_embeddings=False, bias=False, qk_norm=True, rotary_pct=1.0, zero_init_proj=True,
                               activation="relu2", parallel_residual=True)
    names = {id(p): n for n, p in model.named_parameters()}
    assert len([p for g in opt.muon.param_groups for p in g["params"]]) == 8
    decayed, plain = ([names[id(p)] for p in g["params"]] for g in opt.adamw.param_groups)
    assert sorted(decayed) == ["lm_head.weight", "transformer.wte.weight"]
    assert all(n.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")) for n in plain) and len(plain) == 5
    ids = [id(p) for g in opt.param_groups for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in model.parameters()) and len(ids) == len(set(ids))


def test_grad_scaler_unscales_and_steps_both_optimizers():
    """fp16's GradScaler drives MuonAdamW as one optimizer: true gradients after unscale_, one update each."""
    model, opt, _ = tiny_setup()
    x = torch.randint(0, 64, (2, 16))
    model(x, x)[1].backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(model(x, x)[1]).backward()
    scaler.unscale_(opt)
    assert all(torch.allclose(p.grad, g) for p, g in zip(model.parameters(), expected))
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)
    scaler.update()
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before))  # every parameter moved
    assert len(opt.state_dict()["muon"]["state"]) == 8 and len(opt.state_dict()["adamw"]["state"]) > 0


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


@pytest.mark.parametrize("keys, error", [
    ({"optimizer": "muon", "parallel": "fsdp"}, "optimizer='muon' is not supported with parallel='fsdp'"),
    ({"optimizer": "sgd"}, "config key 'optimizer' must be one of 'adamw', 'muon'"),
    ({"muon_lr": 0.0}, "config key 'muon_lr' must be > 0"),
    ({"muon_momentum": 1.0}, "config key 'muon_momentum' must be in [0, 1)"),
])
def test_bad_muon_config_is_a_one_line_error(keys, error):
    with pytest.raises(ConfigError) as err:
        WithParallel(**keys)
    assert error in str(err.value) and "\n" not in str(err.value)
    WithParallel(optimizer="muon", parallel="ddp")  # DDP is fine


@pytest.mark.slow
def test_muon_ddp_two_processes_equal_one_process_with_accumulation(data_dir, tmp_path):
    """Gradients are all-reduced before the step, so each rank's Muon orthogonalises the same matrix."""
    common = [f"--data_dir={data_dir}", "--max_steps=4", "--total_batch_size=128", "--eval_interval=0", *MUON]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "train.py"), *TINY, *common, f"--out_dir={tmp_path / 'ddp'}"]
    result = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
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
    assert set(parse_args([MODERN])).isdisjoint({"n_layer", "n_embd", "n_head", "block_size", "batch_size",
                                                 "total_batch_size", "max_steps", "preset", "data_dir"})


def test_modern_config_trains_resumes_and_samples(data_dir, tmp_path):
    """configs/modern.py on the tiny model (its own learning rates and schedule): the loss falls, a resume
    continues the run, and the checkpoint samples the same tokens with and without the KV cache."""
    tiny = [a for a in TINY if not a.startswith(("--learning_rate", "--min_lr", "--warmup_steps"))]
    out = tmp_path / "out"
    assert train.main([MODERN, *tiny, f"--data_dir={data_dir}", f"--out_dir={out}", "--max_steps=8",
                       "--lr_decay_steps=12"]) == 0
    assert train.main(["--init_from=resume", f"--out_dir={out}", "--max_steps=12"]) == 0
    assert list(train_losses(out)) == list(range(1, 13))
    val = [m["val_loss"] for m in metrics(out) if "val_loss" in m]
    assert val[-1] < val[0] - 0.5, val  # from ~ln(64) = 4.16 towards the chain's ln(3) = 1.10
    model, info = checkpoint.load_model(ckpt=out)
    assert info["step"] == 12 and model.config.qk_norm and model.config.activation == "relu2"
    assert not model.config.tie_embeddings and info["config"]["optimizer"] == "muon"
    prompt = torch.tensor([[1, 2, 3]])
    cached, uncached = (model.generate(prompt, 12, temperature=0, use_kv_cache=c) for c in (True, False))
    assert torch.equal(cached, uncached) and cached.shape == (1, 15)
