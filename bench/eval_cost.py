"""Benchmark: what a run's evaluations cost against its training steps, per rank, on this device.
Run from the repository root (random weights at the config's shape; the real evaluation data):

    python -m bench.eval_cost configs/gpt2_124m.py --world_size 8 [--steps 10]

Times one optimizer step of one rank (its micro-batches of the config, compiled as train.py compiles, bf16 AdamW
on CUDA), then one evaluation of each kind as one rank of --world_size runs it: the validation loss (eval_steps
micro-batches), its share of HellaSwag (hellaswag.py, all 10,042 examples / world_size) and of `--tasks` (evaluate.py,
default suite), each after its data was tokenized once (that time is printed apart: train.py pays it once). Prints
each evaluation's share of the training time at the config's intervals (and --tasks_interval for the suite).
"""

import argparse
import time

import torch

from bench import machine_line
from gpt2train import tasks
from gpt2train.assets import fetch_hellaswag, get_tokenizer
from gpt2train.config import batch_layout, make_config, model_config, parse_args
from gpt2train.devices import autocast, resolve_device
from gpt2train.scoring import Suite
from model import GPT


def _timed(fn, device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def parse(argv):
    """The benchmark's flags."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="a config file, e.g. configs/gpt2_124m.py")
    parser.add_argument("--world_size", type=int, default=8, help="ranks of the run being modelled")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps timed (after 3 warm-up steps)")
    parser.add_argument("--tasks", default="default")
    parser.add_argument("--tasks_interval", type=int, default=None, help="default: the config's eval_interval")
    parser.add_argument("--device", default="auto")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    cfg = make_config(parse_args([args.config]))
    device = resolve_device(args.device)
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    _, accum = batch_layout(cfg, args.world_size)
    torch.manual_seed(0)
    model = GPT(model_config(cfg)).to(device)
    compiled = torch.compile(model) if cfg.compile and device.startswith("cuda") else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.startswith("cuda"))
    x = torch.randint(0, 50257, (cfg.batch_size, cfg.block_size + 1), device=device)

    def step():
        for _ in range(accum):
            with autocast(device, dtype):
                loss = compiled(x[:, :-1], x[:, 1:], return_logits=False)[1]
            (loss / accum).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    _, t = _timed(lambda: [step() for _ in range(args.steps)], device)
    step_s = t / args.steps
    print(f"machine: {machine_line(device)}")
    print(
        f"one optimizer step of one rank: {step_s * 1000:.0f} ms ({accum} x {cfg.batch_size} x {cfg.block_size} "
        f"tokens, {accum * cfg.batch_size * cfg.block_size / step_s:,.0f} tokens/s)"
    )

    @torch.no_grad()
    def val():
        model.eval()
        for _ in range(cfg.eval_steps):
            with autocast(device, dtype):
                compiled(x[:, :-1], x[:, 1:], return_logits=False)
        model.train()

    val()
    _, val_s = _timed(val, device)

    enc = get_tokenizer()
    # one rank's share of HellaSwag and of the tasks (every world_size-th example), as train.py keeps it
    hs_docs = {tasks.HELLASWAG_LLMC.name: tasks.load_hellaswag(fetch_hellaswag())[:: args.world_size]}
    hs_suite, hs_tok = _timed(lambda: Suite(hs_docs, enc), "cpu")
    _, hs_cold = _timed(lambda: hs_suite.score(model, device, dtype=dtype), device)
    hs, hs_s = _timed(lambda: hs_suite.score(model, device, dtype=dtype), device)
    hs = hs["tasks"][tasks.HELLASWAG_LLMC.name]
    names = tasks.parse_tasks(args.tasks)
    docs = {name: tasks.load_docs(name)[:: args.world_size] for name in names}
    suite, suite_tok = _timed(lambda: Suite(docs, enc), "cpu")
    rows = {}
    for batch_size in (64, 256):
        _, rows[batch_size] = _timed(lambda b=batch_size: suite.score(model, device, b, dtype), device)
    suite_s = min(rows.values())
    n_suite = sum(len(v) for v in suite.examples.values())
    tasks_interval = args.tasks_interval or cfg.eval_interval
    print(
        f"val loss ({cfg.eval_steps} micro-batches): {val_s:.2f} s = {val_s / (cfg.eval_interval * step_s):.2%} of "
        f"the training time at eval_interval={cfg.eval_interval}"
    )
    print(
        f"hellaswag, {hs['n']} examples of this rank: tokenized once in {hs_tok:.1f} s, scored in {hs_s:.2f} s "
        f"(the first time: {hs_cold:.2f} s) = "
        f"{hs_s / (cfg.hellaswag_interval * step_s):.2%} at hellaswag_interval={cfg.hellaswag_interval}"
        if cfg.hellaswag_interval
        else f"hellaswag: {hs_s:.2f} s ({hs['n']} examples)"
    )
    print(
        f"tasks {','.join(names)}, {n_suite} examples of this rank: tokenized once in {suite_tok:.1f} s, scored in "
        f"{suite_s:.2f} s (rows per forward: "
        + ", ".join(f"{b}: {s:.2f} s" for b, s in rows.items())
        + f") = {suite_s / (tasks_interval * step_s):.2%} at eval_tasks_interval={tasks_interval}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
