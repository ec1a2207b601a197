"""The modern recipe's optimizer in runs: optimizer='muon' (torch.optim.Muon for the blocks' hidden matrices, AdamW
for the rest) checkpoints, resumes and runs under DDP like the default AdamW (its grouping: test_optim.py).

Runs reuse tests/tiny.py's tiny model and synthetic Markov-chain data.
"""

import json
from dataclasses import dataclass

import numpy as np
import pytest
import torch

import train
from gpt2train import loading
from gpt2train.checkpoint import load_checkpoint
from gpt2train.config import ConfigError, TrainConfig, parse_args
from gpt2train.generation import Sampling, generate
from gpt2train.hf import save_pretrained
from model import bigram_rows
from test_model import perturb_, small_gpt
from tiny import ROOT, TINY, metrics, run, torchrun, train_losses

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
    with pytest.raises(SystemExit):  # a group of its own that the saved optimizer state lacks
        train.main(["--init_from=resume", f"--out_dir={tmp_path}", "--embedding_lr=0.01"])
    assert "cannot set or unset embedding_lr when resuming" in capsys.readouterr().err


def test_a_checkpoint_with_muons_matrices_in_another_order_is_refused_in_one_line(data_dir, tmp_path, capsys):
    """Before Muon's matrices followed the model's order each process listed them in its own (a set of names): such
    a checkpoint's momentum cannot be matched to the matrices, and resuming from it says so (exit 2), where it
    failed at the first step with a shape error."""
    from gpt2train.checkpoint import list_checkpoints, save_checkpoint

    assert run(data_dir, tmp_path, *MUON, "--max_steps=2", "--save_interval=2") == 0
    [(_, path)] = list_checkpoints(tmp_path)
    ckpt = load_checkpoint(path)
    state = ckpt["optimizer"]["muon"]["state"]
    ckpt["optimizer"]["muon"]["state"] = {i: state[(i + 1) % len(state)] for i in state}  # as another process's
    save_checkpoint(path, ckpt)
    with pytest.raises(SystemExit) as exit_:
        train.main(["--init_from=resume", f"--out_dir={tmp_path}", "--max_steps=4"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "init_from=resume: Muon's saved momentum does not fit the matrices" in err
    assert "init_from=<the checkpoint> trains on from its weights with a fresh optimizer" in err


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
    cached, uncached = (generate(model, prompt, 12, Sampling(temperature=0), use_kv_cache=c) for c in (True, False))
    assert torch.equal(cached, uncached) and cached.shape == (1, 15)


# ----------------------------------------------------------------------------- the recipe's model options

RECIPE_OPTIONS = dict(
    value_embeds=True, smear=True, bigram_embeds=37, qk_norm=True, rotary_pct=1.0, tie_embeddings=False
)


def without(model, **off):
    """A model with `off` switched off and every weight `model` shares with it copied over."""
    plain = small_gpt(**{**vars(model.config), **off})
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if k in plain.state_dict()})
    return plain


@pytest.mark.parametrize(
    "option, off, gates, table",
    [
        ("value_embeds", False, "ve_gate", "transformer.vte"),
        ("smear", False, "smear_lambda", "smear_gate"),
        ("bigram_embeds", 0, "bigram_lambdas", "transformer.bte"),
    ],
)
def test_each_option_at_a_zero_gate_is_the_model_without_it(option, off, gates, table):
    """With its learned gates at zero an option changes nothing (the rest of the model is the plain one); open,
    it changes the output and its gate and table get gradients."""
    model = perturb_(small_gpt(n_layer=4, **RECIPE_OPTIONS))
    idx = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    logits, loss = model(idx, idx)
    loss.backward()
    opened = [p for n, p in model.named_parameters() if n.endswith(gates) or n.startswith(table)]
    assert len(opened) >= 2 and all(p.grad is not None and p.grad.abs().sum() > 0 for p in opened)
    plain = without(model, **{option: off})
    assert (logits - plain(idx, idx)[0]).abs().max() > 1e-3
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(gates):
                p.zero_()
    assert torch.allclose(model(idx, idx)[0], plain(idx, idx)[0], atol=1e-6)


def test_value_embeddings_are_added_to_each_heads_values():
    """The second table is looked up per token and added to attention's values, head h scaled by ve_gate[h]:
    with every query attending to itself only (one position), attention's output is exactly v + gate * vte."""
    model = perturb_(small_gpt(value_embeds=True))
    attn, idx = model.transformer.h[0].attn, torch.tensor([[5]])
    with torch.no_grad():
        attn.ve_gate.copy_(torch.tensor([0.0, 2.0]))
        x = torch.randn(1, 1, 32)
        ve = model.transformer.vte(idx)  # (1, 1, 32)
        v = attn.c_attn(x)[..., 64:]
        expected = attn.c_proj(v + torch.cat((0 * ve[..., :16], 2 * ve[..., 16:]), dim=-1))
        assert torch.allclose(attn(x, ve=ve), expected, atol=1e-6)
    # wpe and vte are lookups, no matmul FLOPs (the tied wte is also the head's matmul)
    assert model.num_params(non_embedding=True) == model.num_params() - 32 * 32 - 96 * 32


def test_smear_mixes_in_the_previous_tokens_embedding():
    """Position t's input is wte[t] + smear_lambda * sigmoid(gate(wte[t][:16])) * wte[t-1]; the first token of a
    sequence has no previous one, and one continuing a cached sequence gets it from `prev`."""
    model = perturb_(small_gpt(smear=True, n_layer=1, rotary_pct=1.0))  # rotary: no wpe added
    model.transformer.h = torch.nn.ModuleList()  # no blocks: hidden_states is ln_f of the embedding
    idx = torch.tensor([[3, 7, 11]])
    with torch.no_grad():
        e = model.transformer.wte(idx)[0]
        share = model.smear_lambda * torch.sigmoid(model.smear_gate(e[:, :16]))  # (3, 1)
        expected = torch.stack([e[0], e[1] + share[1] * e[0], e[2] + share[2] * e[1]])
        assert torch.allclose(model.hidden_states(idx, final_norm=False)[0], expected, atol=1e-6)
        last = model.hidden_states(idx[:, 2:], pos=2, final_norm=False, prev=idx[:, 1:2])
        assert torch.allclose(last[0, 0], expected[2], atol=1e-6)


def test_the_bigram_table_adds_each_tokens_pair_row_before_every_block():
    """Block i's input gains bigram_lambdas[i] * bte[row(previous token, token)]: the same pair always reads the
    same row, the first token (no previous one) the last row, and a token continuing a cached sequence the row
    its pair with `prev` reads in the whole sequence. The table starts at zero: a new model is the one without."""
    rows = 37
    idx = torch.tensor([[3, 7, 3, 7, 11]])
    r = bigram_rows(idx, None, rows)[0].tolist()
    assert r[0] == rows - 1 and r[1] == r[3] != r[2] and all(0 <= x < rows - 1 for x in r[1:])
    assert bigram_rows(idx[:, 3:], idx[:, 2:3], rows)[0].tolist() == r[3:]
    fresh = small_gpt(n_layer=2, bigram_embeds=rows)
    assert torch.allclose(fresh(idx)[0], without(fresh, bigram_embeds=0)(idx)[0])
    model = perturb_(small_gpt(n_layer=1, bigram_embeds=rows, rotary_pct=1.0))
    seen = []
    model.transformer.h[0].register_forward_pre_hook(lambda _, args: seen.append(args[0]))
    with torch.no_grad():
        model(idx)
        expected = model.transformer.wte(idx) + model.bigram_lambdas[0] * model.transformer.bte.weight[r]
    assert torch.allclose(seen[0], expected, atol=1e-6)


@pytest.mark.parametrize("prompt_len", [1, 17])
def test_kv_cache_equals_recompute_with_the_recipes_options(prompt_len):
    model = perturb_(small_gpt(n_layer=3, **RECIPE_OPTIONS), scale=0.2)
    idx = torch.randint(0, 96, (2, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
    cached = generate(model, idx, 40 - prompt_len, Sampling(temperature=0.0), use_kv_cache=True)
    assert torch.equal(cached, generate(model, idx, 40 - prompt_len, Sampling(temperature=0.0), use_kv_cache=False))


def test_activation_checkpointing_recomputes_the_recipes_options_alike():
    """The recomputed blocks get the value embeddings too: the same loss and gradients as without recompute."""
    model = perturb_(small_gpt(n_layer=3, **RECIPE_OPTIONS)).train()
    idx = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    grads = []
    for mode in (False, True):
        model.config.activation_checkpointing = mode
        model.zero_grad()
        model(idx, idx)[1].backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*grads))


@pytest.mark.parametrize("option, value", [("value_embeds", True), ("smear", True), ("bigram_embeds", 37)])
def test_export_writes_what_hugging_face_has_no_class_for_as_a_gpt2train_model(tmp_path, option, value):
    """Neither GPT-2 nor GPT-NeoX holds these: the export carries its own code (tests/test_export.py loads it)."""
    save_pretrained(small_gpt(**{option: value}), str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "gpt2train" and config[option] == value
    assert (tmp_path / "modeling_gpt2train.py").is_file() and (tmp_path / "configuration_gpt2train.py").is_file()


def test_export_of_the_whole_recipe_names_every_setting_that_sent_it_there_in_one_note(tmp_path, capsys):
    options = dict(qk_norm=True, value_embeds=True, smear=True, bigram_embeds=37)
    save_pretrained(small_gpt(**options), str(tmp_path))
    notes = [line for line in capsys.readouterr().err.splitlines() if "gpt2train" in line]
    assert notes == [
        f"note: {tmp_path}: qk_norm=True, value_embeds=True, smear=True, bigram_embeds=37: no GPT-2 or GPT-NeoX "
        "equivalent, so a gpt2train model (its own modeling code: load it with trust_remote_code=True)"
    ]
