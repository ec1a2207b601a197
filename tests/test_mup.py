"""parametrization='mup' (issue 56): the standard model unchanged, muP's multipliers, initialisation and per-group
rates, and its bad input."""

import json
from pathlib import Path

import pytest
import torch

import train
from gpt2train import hf as hf_io
from gpt2train import optim
from gpt2train.config import ConfigError, make_config, model_config
from model import GPT, GPTConfig
from tiny import TINY, expect_exit

ROOT = Path(__file__).resolve().parent.parent
SMALL = dict(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32)


def gpt(seed=0, **keys):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**SMALL, **keys}))


def forward_backward(model, seed=1):
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(seed))
    logits, loss = model(idx, idx)
    loss.backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_standard_is_the_default_model_bit_for_bit():
    """parametrization='standard' (with a base width it ignores) draws the same weights and gives the same logits and
    gradients as a model built from the default config."""
    default, explicit = gpt(), gpt(parametrization="standard", mup_base_width=16)
    assert all(torch.equal(a, b) for a, b in zip(default.state_dict().values(), explicit.state_dict().values()))
    (la, ga), (lb, gb) = forward_backward(default), forward_backward(explicit)
    assert torch.equal(la, lb) and all(torch.equal(ga[n], gb[n]) for n in ga)


def test_mup_at_its_base_width_starts_from_the_standard_weights_and_logits():
    """At width_mult 1 (tied head, head_dim 64) muP's init and multipliers reduce to the standard model's."""
    keys = dict(n_head=1, n_embd=64)
    standard, mup = gpt(**keys), gpt(**keys, parametrization="mup", mup_base_width=64)
    assert mup.config.width_mult == 1.0
    assert all(torch.equal(a, b) for a, b in zip(standard.state_dict().values(), mup.state_dict().values()))
    assert torch.allclose(forward_backward(standard)[0], forward_backward(mup)[0], atol=1e-6)


def test_mup_scales_hidden_init_by_fan_in_and_zeroes_an_untied_head():
    base, wide = gpt(), gpt(n_embd=128, n_head=8, parametrization="mup", mup_base_width=32, tie_embeddings=False)
    assert wide.config.width_mult == 4.0
    std = wide.transformer.h[0].mlp.c_fc.weight.std().item()  # 0.02 / sqrt(4)
    assert abs(std - 0.01) < 0.001, std
    proj = wide.transformer.h[0].attn.c_proj.weight.std().item()  # 0.02 / sqrt(2 * n_layer) / sqrt(4)
    assert abs(proj - 0.02 / 2 / 2) < 0.0006, proj
    assert abs(wide.transformer.wte.weight.std().item() - 0.02) < 0.001  # embeddings keep their init
    assert wide.lm_head.weight.abs().max() == 0
    assert base.lm_head.weight.abs().max() > 0


def test_mup_logits_are_divided_by_width_mult_and_attention_scaled_by_1_over_d():
    """The same weights under muP: logits = standard's / width_mult where attention matches (head_dim 64: 8/64 =
    1/sqrt(64)); at head_dim 16 attention differs (8/16 against 1/4)."""
    keys = dict(n_embd=128, n_head=2)  # head_dim 64
    standard, mup = gpt(**keys), gpt(**keys, parametrization="mup", mup_base_width=64)
    mup.load_state_dict(standard.state_dict())
    idx = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(mup(idx, idx)[0], standard(idx, idx)[0] / 2)
        # the chunked loss (training's path) and the full logits' loss agree under muP
        torch.testing.assert_close(mup(idx, idx, return_logits=False)[1], mup(idx, idx)[1])
        narrow, narrow_mup = gpt(n_embd=32, n_head=2), gpt(n_embd=32, n_head=2, parametrization="mup")
        narrow_mup.load_state_dict(narrow.state_dict())
        assert not torch.allclose(narrow_mup(idx, idx)[0], narrow(idx, idx)[0], atol=1e-4)


def test_mup_trains_forward_and_backward():
    model = gpt(n_embd=64, n_head=4, parametrization="mup", mup_base_width=32, tie_embeddings=False)
    _, grads = forward_backward(model)
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert grads["lm_head.weight"].abs().sum() > 0 and grads["transformer.h.0.attn.c_attn.weight"].abs().sum() == 0


def config(**keys):
    base = dict(SMALL, learning_rate=4e-3, min_lr=0.0, weight_decay=0.1, data_dir="data", out_dir="out")
    return make_config({**base, **keys})


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_mup_hidden_matrices_get_rate_over_width_mult_under_adamw_only(optimizer):
    cfg = config(n_embd=128, n_head=8, parametrization="mup", mup_base_width=32, optimizer=optimizer, muon_lr=0.02)
    model = GPT(model_config(cfg))
    opt = optim.build_optimizer(model, cfg)
    hidden = {id(p) for n, p in model.named_parameters() if n in optim.hidden_matrices(model)}
    optim.set_lr(opt, cfg.learning_rate / 2, cfg)  # the schedule's half-way point scales every group alike
    for group in opt.param_groups:
        ids = {id(p) for p in group["params"]}
        if group.get("role") == "hidden":
            assert optimizer == "adamw" and ids == hidden
            assert group["lr"] == pytest.approx(4e-3 / 4 / 2) and group["weight_decay"] == pytest.approx(0.4)
        elif "momentum" in group:  # Muon's: its rate is spectrally normalised already, no width factor
            assert ids == hidden and group["lr"] == pytest.approx(0.02 / 2)
        else:
            assert not ids & hidden and group["lr"] == pytest.approx(4e-3 / 2)
    assert any(g.get("role") == "hidden" for g in opt.param_groups) == (optimizer == "adamw")


def test_standard_optimizer_groups_unchanged():
    cfg = config(n_embd=128, n_head=8, mup_base_width=32)
    opt = optim.build_optimizer(GPT(model_config(cfg)), cfg)
    assert [g.get("role") for g in opt.param_groups] == [None, None]


@pytest.mark.parametrize("value", [0, -64, 40, 64.0, True, "64"])
def test_bad_mup_base_width_is_a_config_error(value):
    with pytest.raises(ConfigError, match=r"mup_base_width=.*positive multiple of head_dim 16"):
        config(parametrization="mup", mup_base_width=value, n_embd=32, n_head=2)


def test_bad_parametrization_is_a_config_error():
    with pytest.raises(ConfigError, match="parametrization='mu_p', expected 'standard' or 'mup'"):
        config(parametrization="mu_p")


def test_train_refuses_a_bad_base_width_in_one_line_exit_2(data_dir, tmp_path, capsys):  # noqa: F811
    args = [*TINY, "--parametrization=mup", "--mup_base_width=100", f"--data_dir={data_dir}", f"--out_dir={tmp_path}"]
    expect_exit(2, train.main, args)
    said = capsys.readouterr()
    assert said.out == "" and said.err.startswith("train.py: error: ") and said.err.count("\n") == 1, said
    assert "mup_base_width=100" in said.err
    assert not (tmp_path / "metrics.jsonl").exists()  # nothing trained


def test_a_mup_model_exports_through_the_gpt2train_route():
    """Neither GPT-2 nor NeoX has muP's multipliers: the remote code carries them (test_export checks the logits)."""
    assert hf_io.export_route(GPTConfig(**SMALL)) == "gpt2"
    assert hf_io.export_route(GPTConfig(**SMALL, parametrization="mup")) == "gpt2train"


@pytest.mark.slow
def test_coord_check_mup_keeps_every_kind_within_2x_across_widths_and_standard_logits_grow(data_dir, tmp_path):  # noqa: F811
    """bench.coord_check at widths 64-256 (2 layers, 5 AdamW steps at lr 1e-2 on the tiny corpus): under muP every
    kind's RMS at the last step within 2x across the widths; under standard the logits' not."""
    from bench import coord_check

    keys = ["--n_layer=2", "--block_size=16", "--batch_size=4", "--learning_rate=1e-2", f"--data_dir={data_dir}"]
    assert coord_check.main([*keys, "--widths", "64,128,256", "--steps", "5", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "coord_check.json").read_text())
    assert set(data) == {"standard", "mup"} and set(data["mup"]) == set(coord_check.KINDS)
    assert all(len(series) == 5 for series in data["mup"]["logits"].values())
    for kind in coord_check.KINDS:
        assert coord_check.spread_of(data["mup"][kind]) <= 2, (kind, data["mup"][kind])
    assert coord_check.spread_of(data["standard"]["logits"]) > 2, data["standard"]["logits"]
    assert (tmp_path / "coord_check.png").stat().st_size > 0


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--widths", "64,100"], "the width 100 must be a multiple of the head dimension 64"),
        (["--parametrization", "sp"], "--parametrization must list standard or mup"),
        (["--mup_base_width=32"], "mup_base_width=32, expected None or a positive multiple of head_dim 64"),
    ],
)
def test_coord_check_bad_input_is_one_line_exit_2(argv, expected, data_dir, capsys):  # noqa: F811
    from bench import coord_check

    assert coord_check.main([f"--data_dir={data_dir}", "--widths", "64,128", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err, err
