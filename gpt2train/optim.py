"""The optimizers, built in one place: AdamW for every parameter (optimizer='adamw', GPT-2's recipe), or Muon for
the blocks' weight matrices with AdamW for the rest (optimizer='muon', the modern recipe). Both decay only the
2-D tensors (matmul weights, embeddings), never biases or norms. The embedding tables and an untied output head
can have AdamW rates of their own (embedding_lr, head_lr); the schedule scales every rate alike.

Muon here is torch.optim.Muon's update with the matrices of one shape stepped together (Muon below): the 48 block
matrices of GPT-2 124M are 4 shapes, so its step is ~130 ops instead of ~1,400."""

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from gpt2train.console import distributed
from gpt2train.devices import cpu_has_fast_bf16

# torch.optim.Muon's defaults (Keller Jordan's Newton-Schulz coefficients, its epsilon and step count)
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
NS_STEPS = 5


def adamw(params, weight_decay, lr, betas, fused=False):
    """AdamW with weight decay on 2-D+ parameters only. fused: the one-kernel implementation
    (devices.fused_adamw_supported says where it exists), else foreach. Parameters that mix plain tensors and
    DTensors, or DTensors of several device meshes (tensor parallelism), cannot go into one fused or foreach
    call: there the loop over parameters."""
    params = [p for p in params if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    one_kind = len({getattr(p, "device_mesh", None) for p in params}) <= 1
    kernel = {"foreach": False} if not one_kind else {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), **kernel)


class Muon(torch.optim.Optimizer):
    """torch.optim.Muon's update, with its arguments, param_groups keys and state (a 'momentum_buffer' per matrix,
    so either loads the other's state_dict), but the matrices of one shape, dtype and device stepped as one stack:
    momentum as two lerps over the stack, Newton-Schulz as batched matmuls (bmm, baddbmm) in bf16, the update as one
    foreach add. Each matrix's momentum buffer is a view of its stack, made at the first step (and again after a
    load_state_dict), so the state stays per matrix at no copy per step. Under DDP the ranks share the
    orthogonalisation (orthogonalised), where torch.optim.Muon has every rank do all of it."""

    def __init__(
        self,
        params,
        lr=1e-3,
        weight_decay=0.1,
        momentum=0.95,
        nesterov=True,
        ns_coefficients=NS_COEFFICIENTS,
        eps=NS_EPS,
        ns_steps=NS_STEPS,
        adjust_lr_fn=None,
    ):
        if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
            raise ValueError(f"Muon's adjust_lr_fn must be None, 'original' or 'match_rms_adamw'; got {adjust_lr_fn!r}")
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": tuple(ns_coefficients),
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
        }
        super().__init__(params, defaults)
        if any(p.dim() != 2 for g in self.param_groups for p in g["params"]):
            raise ValueError("Muon steps 2-D matrices only")
        self.stacks = {}  # the matrices' ids -> (their momentum stack, the views the state holds)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            same = {}  # (shape, dtype, device) -> the group's matrices with a gradient, in order
            for p in group["params"]:
                if p.grad is not None:
                    same.setdefault((p.shape, p.dtype, p.device), []).append(p)
            for params in same.values():
                self.step_stack(params, group)
        return loss

    def load_state_dict(self, state_dict):
        """torch.optim.Muon's state_dict (or this one's), refused in one line (ValueError) where a momentum buffer's
        shape is not its matrix's: checkpoints written before the matrices were listed in the model's order (a set of
        names: its order was each process's own) cannot be matched to them."""
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in enumerate(params):
            buf = self.state[p].get("momentum_buffer")
            if buf is not None and buf.shape != p.shape:
                self.state.clear()
                raise ValueError(
                    f"Muon's saved momentum does not fit the matrices (buffer {i} is {tuple(buf.shape)}, matrix {i} "
                    f"{tuple(p.shape)}): the checkpoint lists them in another order (before they followed the "
                    "model's, each process had its own), so it cannot resume; init_from=<the checkpoint> trains on "
                    "from its weights with a fresh optimizer"
                )

    def momentum_stack(self, params):
        """The (n, rows, cols) momentum of `params`, whose views are their state's momentum buffers."""
        key = tuple(id(p) for p in params)
        stack, views = self.stacks.get(key, (None, ()))
        held = [self.state[p].get("momentum_buffer") for p in params]
        if len(views) == len(held) and all(a is b for a, b in zip(views, held)):
            return stack
        stack = torch.stack([torch.zeros_like(p) if b is None else b for p, b in zip(params, held)])
        views = stack.unbind(0)
        for p, view in zip(params, views):
            self.state[p]["momentum_buffer"] = view
        self.stacks[key] = (stack, views)
        return stack

    def step_stack(self, params, group):
        """torch.optim.Muon's step for matrices of one shape, stacked: (n, rows, cols)."""
        lr, momentum = group["lr"], group["momentum"]
        buf = self.momentum_stack(params)
        grad = torch.stack([p.grad for p in params])
        buf.lerp_(grad, 1 - momentum)
        update = grad.lerp_(buf, momentum) if group["nesterov"] else buf
        ortho = orthogonalised(update, group["ns_coefficients"], group["ns_steps"], group["eps"])
        if group["weight_decay"] != 0:  # torch's mul_(1 - lr * 0) is a pass over every matrix that changes nothing
            torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
        rows, cols = params[0].shape
        scale = {"match_rms_adamw": 0.2 * math.sqrt(max(rows, cols))}.get(
            group["adjust_lr_fn"], math.sqrt(max(1, rows / cols))
        )
        torch._foreach_add_(params, ortho.to(params[0].dtype).unbind(0), alpha=-lr * scale)


def orthogonalised(stack, *args):
    """newton_schulz(stack, *args), the work shared among torch.distributed's ranks where there are several: under
    DDP every rank holds the same all-reduced gradients, so the same stack; rank r orthogonalises its consecutive
    share of the matrices (the r-th of world_size, rounded up) and all-gathers the others' shares, in bf16 (what
    newton_schulz returns), as modded-nanogpt shares it: every rank gets the same matrices (on the CPU bit for bit
    one process's), each doing about a world_size-th of the work (12 matrices at 8 ranks: 2 on ranks 0-5)."""
    world = dist.get_world_size() if distributed() else 1
    if world == 1:
        return newton_schulz(stack, *args)
    share = math.ceil(len(stack) / world)
    first = dist.get_rank() * share
    mine = stack.new_empty((share, *stack.shape[1:]), dtype=torch.bfloat16)  # rows past the stack: never read
    if first < len(stack):
        mine[: len(stack) - first] = newton_schulz(stack[first : first + share], *args)
    everyone = mine.new_empty((share * world, *stack.shape[1:]))
    getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(everyone, mine)  # the new name from torch 2.13
    return everyone[: len(stack)]


def product_dtype(device):
    """What newton_schulz multiplies in on `device`: bf16, or fp32 (of bf16 values) on a CPU that would emulate bf16."""
    return torch.float32 if torch.device(device).type == "cpu" and not cpu_has_fast_bf16() else torch.bfloat16


def newton_schulz(stack, coefficients, steps, eps):
    """torch.optim.Muon's orthogonalisation of each (rows, cols) matrix of `stack`, in bf16, as batched matmuls: the
    quintic iteration X <- a X + (b A + c A^2) X, A = X X^T, on the wide side (X^T where rows > cols), from X
    divided by its Frobenius norm (at least eps). On a CPU that would emulate bf16 matmuls (AVX2: 10-50x slower than
    fp32 at these shapes) each product is taken in fp32 from bf16 values and rounded back to bf16, as a GPU's bf16
    GEMM accumulates in fp32 and rounds once."""
    a, b, c = coefficients
    work = product_dtype(stack.device)
    x = stack.bfloat16()
    tall = stack.size(1) > stack.size(2)
    if tall:
        x = x.mT
    x = x / torch.linalg.vector_norm(x, dim=(1, 2), keepdim=True).clamp(min=eps)
    for _ in range(steps):  # .to(work) and .bfloat16() return their tensor where work is bf16
        x = x.to(work)
        gram = torch.bmm(x, x.mT).bfloat16().to(work)  # (n, rows, rows) on the wide side
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c).bfloat16().to(work)
        x = torch.baddbmm(x, poly, x, beta=a).bfloat16()
    return x.mT if tall else x


class MuonAdamW:
    """Muon and torch.optim.AdamW stepped as one optimizer: param_groups lists Muon's groups, then
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
    """{'embedding': [...], 'head': [...], 'hidden': [...]}: the parameters at embedding_lr (every nn.Embedding table)
    and head_lr (an untied output head), for the keys that are set (a key left None keeps its tensors at
    learning_rate); under muP with AdamW also the hidden matrices, at learning_rate / width_mult."""
    groups = {}
    if cfg.parametrization == "mup" and cfg.optimizer == "adamw":  # Muon's update is already width-independent
        names = set(hidden_matrices(model))
        groups["hidden"] = [p for n, p in model.named_parameters() if n in names]
    if cfg.embedding_lr is not None:
        groups["embedding"] = [m.weight for m in model.modules() if isinstance(m, nn.Embedding)]
    if cfg.head_lr is not None:  # untied: config.py refuses head_lr for a tied head, which is the embedding
        groups["head"] = [model.lm_head.weight]
    return groups


def peak_lr(cfg, role):
    """Peak rate of an AdamW group by its role (None: the default group at learning_rate)."""
    hidden = cfg.learning_rate / cfg.width_mult  # muP (the mup package's MuAdamW): matrix-like rates over width_mult
    return {"embedding": cfg.embedding_lr, "head": cfg.head_lr, "hidden": hidden}.get(role) or cfg.learning_rate


def peak_weight_decay(cfg, role):
    """weight_decay of an AdamW group by its role: the muP hidden group's times width_mult, so that AdamW's decay per
    step (lr * weight_decay) stays the standard one's (the mup package's MuAdamW, decoupled_wd=False)."""
    return cfg.weight_decay * cfg.width_mult if role == "hidden" else cfg.weight_decay


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
        group = {"params": ps, "lr": peak_lr(cfg, role), "weight_decay": peak_weight_decay(cfg, role), "role": role}
        opt.add_param_group(group)
    if cfg.optimizer == "adamw":
        return opt
    # adjust_lr_fn='original' (Keller Jordan's Muon): the update is scaled by sqrt(max(1, rows/cols))
    muon = Muon(
        [p for n, p in params.items() if n in hidden],  # the model's order: the same in every process and rank
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
