"""optim.py: AdamW decaying only the matrices (fused where asked), Muon for the blocks' hidden matrices with AdamW for
the rest as one optimizer, and the per-group learning rate. Parity with torch + transformers is in test_model.py;
Muon runs end to end in test_modern.py."""

import copy

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


# ----------------------------------------------------------------------------- Muon, batched

SHAPES = [(96, 32), (32, 32), (32, 128), (96, 32), (32, 32), (32, 128)]  # tall, square, wide; two of each


@pytest.fixture
def bf16_products(monkeypatch):
    """torch.optim.Muon multiplies in bf16 on every CPU; ours does where the CPU does it in hardware (below)."""
    monkeypatch.setattr(optim, "cpu_has_fast_bf16", lambda: True)


def muon_pair(shapes=SHAPES, **keys):
    """torch.optim.Muon and optim.Muon over two copies of the same matrices, with the same arguments."""
    keys = {"lr": 0.02, "momentum": 0.9, "nesterov": True, "weight_decay": 0.0, "adjust_lr_fn": "original", **keys}
    torch.manual_seed(0)
    start = [torch.randn(s) * 0.02 for s in shapes]
    theirs, ours = ([torch.nn.Parameter(w.clone()) for w in start] for _ in range(2))
    return (theirs, torch.optim.Muon(theirs, **keys)), (ours, optim.Muon(ours, **keys))


def step_both(pairs, step):
    g = torch.Generator().manual_seed(step)
    grads = [torch.randn(p.shape, generator=g) for p in pairs[0][0]]
    for params, opt in pairs:
        for p, grad in zip(params, grads):
            p.grad = grad.clone()
        opt.step()


def worst_relative(a, b):
    return max(((p - q).norm() / q.norm()).item() for p, q in zip(a, b))


@pytest.mark.parametrize(
    "keys",
    [{}, {"nesterov": False}, {"weight_decay": 0.1}, {"adjust_lr_fn": "match_rms_adamw", "momentum": 0.95}],
)
def test_batched_muon_equals_torch_muon_after_three_steps(keys, bf16_products):
    pairs = muon_pair(**keys)
    for step in range(3):
        step_both(pairs, step)
    (theirs, _), (ours, _) = pairs
    assert worst_relative(ours, theirs) < 1e-4
    assert all(not torch.equal(p, q) for p, q in zip(ours, muon_pair()[1][0]))  # every matrix moved


@pytest.mark.parametrize("fast_bf16", [True, False])
def test_newton_schulz_multiplies_in_bf16_only_where_the_cpu_does_it_in_hardware(monkeypatch, fast_bf16):
    """Where the CPU would emulate bf16 matmuls (AVX2: 10-50x slower), each product is taken in fp32 from the bf16
    values and rounded back; the two ways agree to bf16's rounding, and both return bf16."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Products(TorchDispatchMode):
        dtypes = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default):
                self.dtypes.add(args[-1].dtype)
            return func(*args, **(kwargs or {}))

    stack = torch.randn(3, 96, 32)
    args = (optim.NS_COEFFICIENTS, optim.NS_STEPS, optim.NS_EPS)
    monkeypatch.setattr(optim, "cpu_has_fast_bf16", lambda: fast_bf16)
    with Products() as mode:
        ortho = optim.newton_schulz(stack, *args)
    assert mode.dtypes == {torch.bfloat16 if fast_bf16 else torch.float32}
    assert ortho.dtype == torch.bfloat16 and ortho.shape == stack.shape
    monkeypatch.setattr(optim, "cpu_has_fast_bf16", lambda: not fast_bf16)
    other = optim.newton_schulz(stack, *args).float()
    assert ((ortho.float() - other).norm() / other.norm()).item() < 2e-2
    assert not torch.equal(ortho.float(), stack)  # it did orthogonalise


def test_batched_muon_state_dict_is_torch_muons(bf16_products):
    """The same param_groups keys and one 'momentum_buffer' per matrix: torch.optim.Muon's state loads into it and
    the next steps match (a checkpoint of a run before it resumes), and its state loads into torch.optim.Muon."""
    pairs = muon_pair()
    step_both(pairs, 0)
    (theirs, torch_muon), (ours, our_muon) = pairs
    saved, mine = copy.deepcopy(torch_muon.state_dict()), our_muon.state_dict()  # as a checkpoint holds it
    assert saved["param_groups"] == mine["param_groups"]
    assert [sorted(s) for s in mine["state"].values()] == [["momentum_buffer"]] * len(SHAPES)
    fresh = optim.Muon([torch.nn.Parameter(p.detach().clone()) for p in theirs])  # other defaults: the state's win
    fresh.load_state_dict(saved)
    resumed = [p for g in fresh.param_groups for p in g["params"]]
    pairs = [pairs[0], (resumed, fresh)]
    for step in (1, 2):
        step_both(pairs, step)
    assert worst_relative(resumed, theirs) < 1e-4
    back = torch.optim.Muon([torch.nn.Parameter(torch.zeros(s)) for s in SHAPES])
    back.load_state_dict(fresh.state_dict())  # and back: the state is torch's layout
    momentum = [back.state[p]["momentum_buffer"] for p in back.param_groups[0]["params"]]
    assert all(torch.equal(m, torch_muon.state[p]["momentum_buffer"]) for m, p in zip(momentum, theirs))


def test_batched_muon_skips_matrices_without_a_gradient(bf16_products):
    """As torch.optim.Muon: a matrix without a gradient is left alone, its momentum with it, while its shape's others
    step."""
    pairs = muon_pair()
    step_both(pairs, 0)
    for params, _ in pairs:
        params[1].grad = None
    for params, opt in pairs:
        opt.step()
    (theirs, torch_muon), (ours, our_muon) = pairs
    assert worst_relative(ours, theirs) < 1e-4
    assert torch.equal(our_muon.state[ours[1]]["momentum_buffer"], torch_muon.state[theirs[1]]["momentum_buffer"])


def test_batched_muon_refuses_momentum_that_does_not_fit_its_matrices_in_one_line():
    """A checkpoint whose Muon matrices were listed in another order (before they followed the model's: each process
    had its own) cannot be matched to the matrices: one line, not a shape error at the next step."""
    (theirs, torch_muon), (ours, our_muon) = muon_pair()
    for p in theirs:
        p.grad = torch.ones_like(p)
    torch_muon.step()
    saved = copy.deepcopy(torch_muon.state_dict())
    saved["state"] = {i: saved["state"][(i + 1) % len(SHAPES)] for i in saved["state"]}  # listed one place on
    with pytest.raises(ValueError, match=r"^Muon's saved momentum does not fit the matrices \(buffer 0 is \(32, 32\)"):
        our_muon.load_state_dict(saved)
    assert "\n" not in str(pytest.raises(ValueError, our_muon.load_state_dict, saved).value)


def test_muons_matrices_follow_the_models_order():
    """Not a set's order, which differs between processes: a resumed run's momentum buffers meet their matrices, and
    the DDP ranks that share the orthogonalisation stack the same matrices."""
    model, opt, _ = tiny_setup()
    hidden = set(optim.hidden_matrices(model))
    assert [id(p) for p in opt.muon.param_groups[0]["params"]] == [
        id(p) for n, p in model.named_parameters() if n in hidden
    ]


def test_the_modern_optimizer_step_at_gpt2_124m_shapes_dispatches_few_ops():
    """GPT-2 124M's modern recipe (48 block matrices in 4 shapes): the whole step (Muon and AdamW) dispatches at most
    600 ops on the meta device (torch.optim.Muon's: ~1,500), a few per shape for Muon instead of ~30 per matrix."""
    from bench.muon import dispatched_ops
    from gpt2train.config import parse_args
    from tiny import ROOT

    cfg = make_config(parse_args([str(ROOT / "configs" / "gpt2_124m_modern.py")]))
    with torch.device("meta"):
        model = GPT(model_config(cfg))
    opt = optim.build_optimizer(model, cfg)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # the state, made at the first step
    ops = dispatched_ops(opt.step)
    assert sum(ops.values()) <= 600, ops.most_common(10)
    assert ops["aten.bmm.default"] == 4 * 5 and ops["aten.baddbmm.default"] == 4 * 5 * 2  # 4 shapes x 5 iterations
    assert "aten.mul_.Scalar" not in ops  # muon_weight_decay = 0: no pass over the matrices


SHARED = """
import sys
import torch
import torch.distributed as dist
from gpt2train import optim

dist.init_process_group("gloo")
done = []
orthogonalise = optim.newton_schulz
optim.newton_schulz = lambda stack, *args: done.append(len(stack)) or orthogonalise(stack, *args)
params = [torch.nn.Parameter(w) for w in torch.load(sys.argv[1])]
opt = optim.Muon(params, lr=0.02, momentum=0.9, weight_decay=0.1, adjust_lr_fn="original")
for step in range(3):
    for p, g in zip(params, torch.load(sys.argv[2])[step]):
        p.grad = g.clone()
    opt.step()
torch.save({"params": [p.detach() for p in params], "done": done}, f"{sys.argv[3]}.{dist.get_rank()}")
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_ddp_ranks_share_the_orthogonalisation_and_get_one_processs_matrices(tmp_path):
    """3 gloo ranks with the same gradients (as DDP's all-reduce leaves them), 4 matrices of each shape: each rank
    orthogonalises its share (2, 2, 0 of each shape) and gathers the rest, and every rank's matrices after 3 steps
    equal one process's, bit for bit."""
    from tiny import torchrun

    shapes = SHAPES[:3] * 4
    torch.manual_seed(0)
    start = [torch.randn(s) * 0.02 for s in shapes]
    grads = [[torch.randn(s) for s in shapes] for _ in range(3)]
    torch.save(start, tmp_path / "start.pt")
    torch.save(grads, tmp_path / "grads.pt")
    (tmp_path / "shared.py").write_text(SHARED)
    torchrun(tmp_path / "start.pt", tmp_path / "grads.pt", tmp_path / "out", nproc=3, script=tmp_path / "shared.py")
    alone = [torch.nn.Parameter(w.clone()) for w in start]
    opt = optim.Muon(alone, lr=0.02, momentum=0.9, weight_decay=0.1, adjust_lr_fn="original")
    for step in range(3):
        for p, g in zip(alone, grads[step]):
            p.grad = g.clone()
        opt.step()
    ranks = [torch.load(f"{tmp_path / 'out'}.{r}") for r in range(3)]
    assert [r["done"] for r in ranks] == [[2, 2, 2] * 3, [2, 2, 2] * 3, []]  # 3 shapes x 3 steps; rank 2: none left
    assert all(torch.equal(p, q) for r in ranks for p, q in zip(r["params"], alone))
