"""The chunked loss compiled (Inductor) vs eager: what a compiled step holds beside eager's as the chunks grow.

    python -m bench.compiled_loss                     # micro-batches 8 and 16 (4 and 8 loss chunks)
    python -m bench.compiled_loss --rev 43fed26       # also model.py at a git revision, interleaved with this one
    python -m bench.compiled_loss --batch 2 4 --rounds 3

The GPU review's protocol (docs/memory.md): one block and GPT-2's 50,304 x 768 head, so the loss dominates; T=1024,
bf16 autocast on the CPU; micro-batch B gives B/2 chunks of 2,048 rows. For each B, every setup (each model.py,
eager and compiled) is built and warmed up (the first step compiles), then timed in --rounds rounds of one step
each, the setups interleaved so a machine whose load drifts slows all alike, then one profiled step each: the peak
of live tensors in its forward and in its backward, the bytes held when backward starts, and (compiled) the
matmul nodes of the forward graph Inductor compiles. The last lines give each setup's growth of the forward peak
between the smallest and the largest B. Timings on a shared machine are noisy: compare them only within a run.
"""

import argparse
import statistics
import tempfile
import time

GiB = 2**30


def step(net, fn, x, y):
    """One training step of net (fn: net or its compiled form), forward and backward marked for the profiler."""
    import torch
    from torch.profiler import record_function

    with record_function("FORWARD"), torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = fn(x, y, return_logits=False)
    with record_function("BACKWARD"):
        loss.backward()
    net.zero_grad(set_to_none=True)


def peaks(prof):
    """(forward peak, backward peak, held when backward starts) in bytes of a profiled step's live tensors."""
    events = list(prof.profiler.kineto_results.events())
    backward_start = min(e.start_ns() for e in events if e.name() == "BACKWARD")
    held = peak_fwd = peak_bwd = 0
    at_backward = None
    for t, n in sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"):
        if t >= backward_start and at_backward is None:
            at_backward = held
        held += n  # allocations count positive, frees negative
        if t < backward_start:
            peak_fwd = max(peak_fwd, held)
        else:
            peak_bwd = max(peak_bwd, held)
    return peak_fwd, peak_bwd, at_backward


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 16], help="micro-batches of 1024 tokens (default 8 16)")
    ap.add_argument("--rev", help="also measure model.py at this git revision (e.g. the commit before a change)")
    ap.add_argument("--rounds", type=int, default=2, help="timed steps per setup, interleaved; the median is reported")
    ap.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    args = ap.parse_args(argv)

    import torch
    import torch._inductor.compile_fx as compile_fx
    from torch.profiler import ProfilerActivity, profile

    import model
    from bench import machine_line, model_at

    partition = compile_fx.min_cut_rematerialization_partition
    forward_mm = []

    def counting_partition(joint, joint_inputs, **kwargs):  # the forward graph Inductor compiles: its matmuls
        fw, bw = partition(joint, joint_inputs, **kwargs)
        forward_mm.append(sum(n.op == "call_function" and "mm" in str(n.target) for n in fw.graph.nodes))
        return fw, bw

    compile_fx.min_cut_rematerialization_partition = counting_partition
    print(machine_line("cpu"))
    print(
        "| model.py | mode | B (chunks) | forward peak GiB | backward peak GiB | held at backward GiB | step s "
        "(median) | first step s | forward mm nodes |\n|---|---|---|---|---|---|---|---|---|"
    )
    growth = {}
    with tempfile.TemporaryDirectory() as tmp:
        modules = {"this model.py": model}
        if args.rev:
            modules = {f"model.py at {args.rev}": model_at(args.rev, tmp), **modules}
        for b in args.batch:
            torch._dynamo.reset()
            x, y = (torch.randint(0, 50257, (b, 1024), generator=torch.Generator().manual_seed(i)) for i in range(2))
            setups = {}
            for name, m in modules.items():
                for mode in args.modes:
                    torch.manual_seed(0)
                    net = m.GPT(m.GPTConfig(n_layer=1))
                    setups[name, mode] = (net, torch.compile(net) if mode == "compiled" else net)

            first, mms, times = {}, {}, {key: [] for key in setups}
            for key, (net, fn) in setups.items():
                forward_mm.clear()
                t0 = time.perf_counter()
                step(net, fn, x, y)
                first[key] = time.perf_counter() - t0
                step(net, fn, x, y)
                mms[key] = "/".join(map(str, forward_mm)) or "-"
            for _ in range(args.rounds):
                for key, (net, fn) in setups.items():
                    t0 = time.perf_counter()
                    step(net, fn, x, y)
                    times[key].append(time.perf_counter() - t0)
            for (name, mode), (net, fn) in setups.items():
                with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                    step(net, fn, x, y)
                fwd, bwd, held = peaks(prof)
                growth.setdefault((name, mode), {})[b] = fwd
                print(
                    f"| {name} | {mode} | {b} ({-(-b * 1024 // 2048)}) | {fwd / GiB:.3f} | {bwd / GiB:.3f} | "
                    f"{held / GiB:.3f} | {statistics.median(times[name, mode]):.2f} | {first[name, mode]:.1f} | "
                    f"{mms[name, mode]} |",
                    flush=True,
                )
            del setups
    lo, hi = min(args.batch), max(args.batch)
    if lo != hi:
        for (name, mode), by_b in growth.items():
            print(
                f"{name}, {mode}: forward peak {by_b[lo] / GiB:.3f} -> {by_b[hi] / GiB:.3f} GiB from B={lo} to "
                f"B={hi} (+{(by_b[hi] - by_b[lo]) / GiB:.3f})"
            )


if __name__ == "__main__":
    main()
