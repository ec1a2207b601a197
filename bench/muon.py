"""The modern recipe's optimizer step: torch.optim.Muon against optim.Muon (the same update, same-shape matrices
stacked), side by side in one process, steps interleaved, on the same gradients:

    python -m bench.muon                  # GPT-2 124M's modern recipe (configs/gpt2_124m_modern.py), on the CPU
    python -m bench.muon --tiny           # its 48 block matrices at 32 wide: what is left is per-op dispatch
    python -m bench.muon --device=cuda    # ms on a GPU, and its kernels per step

Per optimizer: ms per step of Muon alone and of the whole step (Muon + AdamW: the median of --reps), the ops the
whole step dispatches (a TorchDispatchMode: every op that reaches a kernel, views included; on a GPU each op that is
not a view is about one kernel launch), torch.profiler's aten events (nested calls too) and, on CUDA, its kernels;
then the largest relative difference of the block matrices after 3 steps from the same start (the norm of the
difference over the matrix's). bench.gpu --slot runs the same at GPT-2 124M's size (compare()).
"""

import argparse
import collections
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from gpt2train import optim
from gpt2train.config import make_config, model_config, parse_args
from gpt2train.devices import device_type
from model import GPT

CONFIG = "configs/gpt2_124m_modern.py"
TINY = dict(n_embd=32, n_head=2, vocab_size=512, block_size=64, bigram_embeds=100)  # 12 layers still: 48 matrices


class Dispatched(TorchDispatchMode):
    """Counts the ATen ops that reach a kernel while it is on."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def dispatched_ops(fn):
    """Counter of the ATen ops fn() dispatches, by overload name."""
    with Dispatched() as mode:
        fn()
    return mode.ops


def profiled(fn, cuda):
    """(aten events, GPU kernels) of one call of fn, as torch.profiler records them."""
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    events = prof.events()
    kernels = sum(e.device_type.name == "CUDA" for e in events) if cuda else None
    return sum(e.name.startswith("aten::") for e in events), kernels


def with_torch_muon(opt):
    """The same MuonAdamW with torch.optim.Muon in place of ours (its AdamW shared: one of the two is timed apart)."""
    group = opt.muon.param_groups[0]
    return optim.MuonAdamW(
        torch.optim.Muon(group["params"], **{k: v for k, v in group.items() if k != "params"}), opt.adamw
    )


def compare(device, tiny=False, reps=5):
    """{'torch.optim.Muon': {...}, 'batched': {...}, 'max_rel_diff': x}: ms per step (Muon alone, whole), ops and
    kernels per whole step of configs/gpt2_124m_modern.py's optimizer (TINY's sizes with tiny), and the matrices'
    largest relative difference after 3 steps."""
    cfg = make_config({**parse_args([CONFIG]), **(TINY if tiny else {})})
    cuda = device_type(device) == "cuda"
    sync = torch.cuda.synchronize if cuda else lambda: None
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(model_config(cfg))
    start = [p.detach().clone() for p in model.parameters()]
    ours = optim.build_optimizer(model, cfg, fused=cuda)
    opts = {"torch.optim.Muon": with_torch_muon(ours), "batched": ours}
    grads = [torch.randn_like(p) * 1e-3 for p in model.parameters()]
    for p, g in zip(model.parameters(), grads):
        p.grad = g
    found = {name: {} for name in opts}
    for name, opt in opts.items():
        opt.step()  # the state
        found[name]["ops"] = sum(dispatched_ops(opt.step).values())
        found[name]["aten_events"], found[name]["kernels"] = profiled(opt.step, cuda)
    times = {(name, part): [] for name in opts for part in ("muon", "whole")}
    for _ in range(reps):  # interleaved: a machine's drift falls on both alike
        for name, opt in opts.items():
            for part, fn in (("muon", opt.muon.step), ("whole", opt.step)):
                sync()
                t = time.perf_counter()
                fn()
                sync()
                times[name, part].append((time.perf_counter() - t) * 1e3)
    for (name, part), ms in times.items():
        found[name][f"{part}_ms"] = statistics.median(ms)
    found["max_rel_diff"] = three_steps_apart(model, opts, start, grads)
    return found


@torch.no_grad()
def three_steps_apart(model, opts, start, grads):
    """Each optimizer's Muon from `start` (fresh momentum) for 3 steps on `grads`: the largest relative difference of
    the block matrices."""
    after = {}
    for name, opt in opts.items():
        for p, w in zip(model.parameters(), start):
            p.copy_(w)
        opt.muon.state.clear()
        for _ in range(3):
            opt.muon.step()
        after[name] = [p.clone() for p in opt.muon.param_groups[0]["params"]]
    a, b = after.values()
    return max(((x - y).norm() / y.norm()).item() for x, y in zip(a, b))


def lines(found):
    """The comparison as printable lines."""
    out = []
    for name in ("torch.optim.Muon", "batched"):
        r = found[name]
        kernels = f", {r['kernels']} GPU kernels" if r["kernels"] is not None else ""
        out.append(
            f"{name:17s} Muon {r['muon_ms']:8.1f} ms, whole step {r['whole_ms']:8.1f} ms; {r['ops']:5d} ops "
            f"dispatched, {r['aten_events']:5d} profiler aten events{kernels}"
        )
    out.append(f"matrices after 3 steps: max relative difference {found['max_rel_diff']:.1e}")
    return out


def main(argv=None):
    from bench import machine_line

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--tiny", action="store_true", help="the 48 matrices at 32 wide (dispatch, not arithmetic)")
    p.add_argument("--reps", type=int, default=5, help="timed steps of each, interleaved (the median is reported)")
    opts = p.parse_args(argv)
    print(f"{machine_line(opts.device)}; {CONFIG}{' (tiny)' if opts.tiny else ''}, {opts.reps} reps")
    print("\n".join(lines(compare(opts.device, opts.tiny, opts.reps))))


if __name__ == "__main__":
    main()
