"""optim.py: AdamW decaying only the matrices (fused where asked), Muon for the blocks' hidden matrices with AdamW for
the rest as one optimizer, and the per-group learning rate. Parity with torch + transformers is in test_model.py;
Muon runs end to end in test_modern.py."""

import pytest
import torch

from gpt2train import optim
from gpt2train.config import make_config, model_config
from model import GPT
from test_model import small_gpt


def test_optimizer_decays_only_matrices_and_uses_fused_when_asked():
    model = small_gpt()
    for fused in (True, False):
        opt = optim.adamw(model.parameters(), 0.1, 1e-3, (0.9, 0.95), fused=fused)
        decay, no_decay = opt.param_groups
        assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
        assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
        assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == model.num_params()
        assert bool(opt.defaults["fused"]) is fused and (fused or opt.defaults["foreach"] is True)


def tiny_setup(**keys):
    cfg = make_config(
        {
            "n_layer": 2,
            "n_head": 2,
            "n_embd": 32,
            "block_size": 16,
            "vocab_size": 64,
            "learning_rate": 3e-3,
            "min_lr": 3e-4,
            "optimizer": "muon",
            "muon_lr": 0.03,
            **keys,
        }
    )
    model = GPT(model_config(cfg))
    return model, optim.build_optimizer(model, cfg), cfg


def test_muon_trains_the_hidden_matrices_and_adamw_the_rest():
    model, opt, cfg = tiny_setup()
    names = {id(p): n for n, p in model.named_parameters()}
    muon = sorted(names[id(p)] for g in opt.muon.param_groups for p in g["params"])
    assert muon == sorted(
        f"transformer.h.{i}.{m}.weight"
        for i in range(2)
        for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    )
    adamw = [names[id(p)] for g in opt.adamw.param_groups for p in g["params"]]
    assert {
        "transformer.wte.weight",
        "transformer.wpe.weight",
        "transformer.ln_f.weight",
        "transformer.h.0.attn.c_attn.bias",
        "transformer.h.1.ln_2.bias",
    } <= set(adamw)
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
    model, opt, _ = tiny_setup(
        tie_embeddings=False,
        bias=False,
        qk_norm=True,
        rotary_pct=1.0,
        zero_init_proj=True,
        activation="relu2",
        parallel_residual=True,
    )
    names = {id(p): n for n, p in model.named_parameters()}
    assert len([p for g in opt.muon.param_groups for p in g["params"]]) == 8
    decayed, plain = ([names[id(p)] for p in g["params"]] for g in opt.adamw.param_groups)
    assert sorted(decayed) == ["lm_head.weight", "transformer.wte.weight"]
    assert all(n.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")) for n in plain) and len(plain) == 5
    ids = [id(p) for g in opt.param_groups for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in model.parameters()) and len(ids) == len(set(ids))


@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_embedding_and_head_rates_have_groups_of_their_own(optimizer):
    """embedding_lr: every embedding table (token, value); head_lr: the untied head. Both decay like the other
    matrices, and the schedule scales them as it scales the rest."""
    model, opt, cfg = tiny_setup(
        optimizer=optimizer, tie_embeddings=False, value_embeds=True, embedding_lr=0.05, head_lr=1e-3, weight_decay=0.1
    )
    names = {id(p): n for n, p in model.named_parameters()}
    adamw = opt.adamw if optimizer == "muon" else opt
    roles = {g.get("role"): g for g in adamw.param_groups if g.get("role")}
    assert sorted(names[id(p)] for p in roles["embedding"]["params"]) == [
        "transformer.vte.weight",
        "transformer.wpe.weight",
        "transformer.wte.weight",
    ]
    assert [names[id(p)] for p in roles["head"]["params"]] == ["lm_head.weight"]
    assert [(g["lr"], g["weight_decay"]) for g in roles.values()] == [(0.05, 0.1), (1e-3, 0.1)]
    ids = [id(p) for g in opt.param_groups for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in model.parameters()) and len(ids) == len(set(ids))
    optim.set_lr(opt, 1e-3, cfg)  # a third of learning_rate's peak: every group at a third of its own
    assert roles["embedding"]["lr"] == pytest.approx(0.05 / 3) and roles["head"]["lr"] == pytest.approx(1e-3 / 3)
    assert all(g["lr"] == 1e-3 for g in adamw.param_groups if not g.get("role"))
    assert optimizer == "adamw" or opt.muon.param_groups[0]["lr"] == pytest.approx(0.01)


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
