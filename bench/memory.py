"""Accuracy of the memory planner: predicted (memory.estimate_memory) vs measured peak RSS rise on this CPU.

    python -m bench.memory              # the default configurations (fp32, plus bf16 on a CPU with native bf16)
    python -m bench.memory --steps=2    # fewer training steps per configuration

    python -m bench.memory --live       # also the peak of live tensors (torch.profiler; a second run each)

Each configuration runs in a fresh subprocess: RSS is read after imports (with glibc malloc tuned as
train.py tunes it), then the model is built and trained for a few steps (model(x, y, return_logits=False),
loss.backward(), fused AdamW step); the measured value is the peak RSS (VmHWM) minus that baseline.
--live adds the peak of bytes held by live tensors over the same steps (profiler memory events, from
before the model is built), which is what the plan models; RSS exceeds it by what glibc's heap keeps
fragmented (the tuned allocator never unmaps, and a freed block is reused only by requests that fit in it).
"""

import argparse
import json
import subprocess
import sys

CONFIGS = [  # name, GPTConfig fields, micro-batch, activation checkpointing
    ("4L 256d T256 B16", dict(n_layer=4, n_head=4, n_embd=256, block_size=256), 16, False),
    ("8L 512d T512 B8", dict(n_layer=8, n_head=8, n_embd=512, block_size=512), 8, False),
    ("8L 512d T512 B16", dict(n_layer=8, n_head=8, n_embd=512, block_size=512), 16, False),
    ("8L 512d T512 B16 ckpt", dict(n_layer=8, n_head=8, n_embd=512, block_size=512), 16, True),
    ("6L 384d T1024 B4", dict(n_layer=6, n_head=6, n_embd=384, block_size=1024), 4, False),
    ("12L 768d T128 B2 (124M)", dict(n_layer=12, n_head=12, n_embd=768, block_size=128), 2, False),
]
BF16_CONFIGS = [0, 3, 4]  # rows of CONFIGS also run under bf16 autocast where the CPU has native bf16


def status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def measure(fields: dict, batch_size: int, ckpt: bool, dtype: str, steps: int, live: bool = False) -> int:
    """In this (fresh) process: peak RSS rise in bytes over `steps` training steps, or with live=True the
    peak of bytes held by tensors (torch.profiler memory events)."""
    from contextlib import nullcontext

    import torch
    from torch.profiler import ProfilerActivity, profile

    from gpt2train import devices
    from model import GPT, GPTConfig

    devices.tune_cpu_allocator("cpu")
    torch.manual_seed(0)
    cfg = GPTConfig(**fields, activation_checkpointing=ckpt)
    x = torch.randint(0, cfg.vocab_size, (batch_size, cfg.block_size))
    y = torch.randint(0, cfg.vocab_size, (batch_size, cfg.block_size))
    base = status_kb("VmRSS")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) if live else nullcontext() as prof:
        model = GPT(cfg)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            with devices.autocast("cpu", dtype):
                _, loss = model(x, y, return_logits=False)
            loss.backward()
            optimizer.step()
    if not live:
        return (status_kb("VmHWM") - base) * 1024
    return peak_of_live_tensors(prof)


def peak_of_live_tensors(prof) -> int:
    """The largest number of bytes held by tensors at once during a torch.profiler(profile_memory=True) run."""
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    held = peak = 0
    for _, n in events:  # allocations count positive, frees negative
        held += n
        peak = max(peak, held)
    return peak


def run_one(fields, batch_size, ckpt, dtype, steps, live=False) -> int:
    job = json.dumps([fields, batch_size, ckpt, dtype, steps, live])
    out = subprocess.run([sys.executable, "-m", "bench.memory", "--worker", job], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"worker {job} failed:\n{out.stderr}")
    return int(out.stdout.strip().splitlines()[-1])


def cpu_name() -> str:
    from gpt2train import devices

    try:
        name = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        import platform

        name = platform.processor() or "unknown CPU"
    return f"{name} ({'native bf16' if devices.cpu_has_fast_bf16() else 'no native bf16'})"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3, help="training steps per configuration")
    ap.add_argument("--live", action="store_true", help="also measure the peak of live tensors (slower)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(measure(*json.loads(args.worker)))
        return

    from gpt2train import devices
    from gpt2train.memory import GiB, estimate_memory
    from model import GPTConfig

    rows = [(name, f, b, ck, "float32") for name, f, b, ck in CONFIGS]
    if devices.cpu_has_fast_bf16():
        rows += [(name, f, b, ck, "bfloat16") for name, f, b, ck in (CONFIGS[i] for i in BF16_CONFIGS)]
    print(f"memory planner vs peak RSS rise, {args.steps} training steps each, on {cpu_name()}")
    live_head = (" live tensors GiB | predicted/live |", "---|---|") if args.live else ("", "")
    print(
        f"| config | dtype | predicted GiB | RSS rise GiB | predicted/RSS |{live_head[0]}\n"
        f"|---|---|---|---|---|{live_head[1]}"
    )
    worst = 0.0
    for name, fields, b, ckpt, dtype in rows:
        plan = estimate_memory(GPTConfig(**fields, activation_checkpointing=ckpt), b, dtype=dtype)
        measured = run_one(fields, b, ckpt, dtype, args.steps)
        worst = max(worst, abs(plan.total / measured - 1))
        row = f"| {name} | {dtype} | {plan.total / GiB:.2f} | {measured / GiB:.2f} | {plan.total / measured:.2f} |"
        if args.live:
            live = run_one(fields, b, ckpt, dtype, args.steps, live=True)
            row += f" {live / GiB:.2f} | {plan.total / live:.2f} |"
        print(row, flush=True)
    print(f"largest deviation from the RSS rise: {worst:.0%}")


if __name__ == "__main__":
    main()
