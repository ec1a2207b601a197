"""The optimizers, built in one place: AdamW for every parameter (optimizer='adamw', GPT-2's recipe), or Muon for
the blocks' weight matrices with AdamW for the rest (optimizer='muon', the modern recipe). Both decay only the
2-D tensors (matmul weights, embeddings), never biases or norms. The embedding tables and an untied output head
can have AdamW rates of their own (embedding_lr, head_lr); the schedule scales every rate alike."""

import torch
import torch.nn as nn


def adamw(params, weight_decay, lr, betas, fused=False):
    """AdamW with weight decay on 2-D+ parameters only. fused: the one-kernel implementation
    (devices.fused_adamw_supported says where it exists), else foreach."""
    params = [p for p in params if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), **({"fused": True} if fused else {"foreach": True}))


class MuonAdamW:
    """torch.optim.Muon and torch.optim.AdamW stepped as one optimizer: param_groups lists Muon's groups, then
    AdamW's (the loop sets each group's lr), state_dict/load_state_dict hold both (exact resume), and GradScaler
    unscales and steps it like any optimizer."""

    def __init__(self, muon, adamw):
        self.muon, self.adamw = muon, adamw

    @property
    def param_groups(self):
        return self.muon.param_groups + self.adamw.param_groups

    def step(self):
        self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none=True):
        self.muon.zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)

    def state_dict(self):
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state):
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])


def hidden_matrices(model):
    """Names of the parameters Muon trains: the 2-D weight matrices inside the blocks (attention c_attn/c_proj,
    MLP c_fc/c_proj). Embeddings, the output head, biases and norms are not hidden matrices."""
    return [
        n for n, p in model.named_parameters() if p.requires_grad and p.dim() == 2 and n.startswith("transformer.h.")
    ]


def own_rate_groups(model, cfg):
    """{'embedding': [...], 'head': [...]}: the parameters at embedding_lr (every nn.Embedding table) and head_lr
    (an untied output head), for the keys that are set; a key left None keeps its tensors at learning_rate."""
    groups = {}
    if cfg.embedding_lr is not None:
        groups["embedding"] = [m.weight for m in model.modules() if isinstance(m, nn.Embedding)]
    if cfg.head_lr is not None:  # untied: config.py refuses head_lr for a tied head, which is the embedding
        groups["head"] = [model.lm_head.weight]
    return groups


def peak_lr(cfg, role):
    """Peak rate of an AdamW group by its role (None: the default group at learning_rate)."""
    return {"embedding": cfg.embedding_lr, "head": cfg.head_lr}.get(role) or cfg.learning_rate


def build_optimizer(model, cfg, fused=False):
    """The configured optimizer over the model's parameters (after sharding: fully_shard replaces them)."""
    betas = (cfg.beta1, cfg.beta2)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}  # a tied head is wte, listed once
    hidden = set(hidden_matrices(model)) if cfg.optimizer == "muon" else set()
    own = own_rate_groups(model, cfg)
    apart = {id(p) for ps in own.values() for p in ps}
    rest = [p for n, p in params.items() if n not in hidden and id(p) not in apart]
    opt = adamw(rest, cfg.weight_decay, cfg.learning_rate, betas, fused)
    for role, ps in own.items():  # matrices all: decayed like wte and lm_head in the default group
        opt.add_param_group({"params": ps, "lr": peak_lr(cfg, role), "weight_decay": cfg.weight_decay, "role": role})
    if cfg.optimizer == "adamw":
        return opt
    # adjust_lr_fn='original' (Keller Jordan's Muon): the update is scaled by sqrt(max(1, rows/cols))
    muon = torch.optim.Muon(
        [params[n] for n in hidden],
        lr=cfg.muon_lr,
        momentum=cfg.muon_momentum,
        nesterov=True,
        weight_decay=cfg.muon_weight_decay,
        adjust_lr_fn="original",
    )
    return MuonAdamW(muon, opt)


def set_lr(optimizer, lr, cfg):
    """Every group at the schedule's fraction lr / learning_rate of its own peak: learning_rate for AdamW's
    default groups, embedding_lr and head_lr for theirs, muon_lr for Muon's."""
    muon = optimizer.muon.param_groups if isinstance(optimizer, MuonAdamW) else []
    for group in optimizer.param_groups:
        peak = cfg.muon_lr if any(group is g for g in muon) else peak_lr(cfg, group.get("role"))
        group["lr"] = lr * (peak / cfg.learning_rate)  # exactly lr at peak learning_rate
