"""What one rank's memory plan may use: what its device has (available_memory), less on a GPU the margin no plan
sees (with_margin, within_margin), and on a CPU or MPS shared by a node's ranks their share (device_memory).
memory.py plans a step and checks the plan against it.
"""

import contextlib
import os

import torch

GiB = 2**30

# What neither the plan nor the dry run sees on a real GPU: the CUDA context and kernels' workspaces, NCCL's buffers
# (more with NVLS), the caching allocator's fragmentation, compile's fallback to eager. The margin was set from an
# estimate of 3-9 GiB for these on an H100, not a measurement. Measured since (python -m bench.gpu on one H100,
# configs/gpt2_124m.py compiled at micro-batch 64; docs/gpu-checklist.md): the step's peak was 28.80 GiB against a
# 23.88 GiB plan while compile kept every chunk of the loss alive, and 22.96 GiB (0.96x) once the loss was one op.
# On CUDA a plan fits when plan x MARGIN_FACTOR + MARGIN_BYTES <= free memory (memory_check, batch_size and
# activation_checkpointing 'auto'), and the probe holds the margin aside too.
MARGIN_FACTOR = 1.05
MARGIN_BYTES = 3 * GiB // 2
MARGIN = "plan x 1.05 + 1.5 GiB"


def gib(n_bytes: int) -> str:
    """Bytes as GiB: one decimal from 1 GiB up (the plan line's contract: '21.3'), three below it."""
    v = n_bytes / GiB
    return f"{v:.1f}" if v >= 1 else f"{v:.3f}"


def available_memory(device) -> tuple[int, str]:
    """(bytes this process can still use, a description). CUDA: free memory (of total); CPU: MemAvailable
    (and a cgroup v2 limit if lower); MPS: the recommended working-set size."""
    kind = str(device).split(":")[0]
    if kind == "cuda":
        free, total = torch.cuda.mem_get_info(torch.device(device))
        return free, f"{str(device)}: {gib(free)} GiB free of {gib(total)} GiB"
    if kind == "mps":
        rec = torch.mps.recommended_max_memory()
        return rec, f"mps: recommended max {gib(rec)} GiB"
    avail, what = _cpu_available()
    return avail, f"{kind}: {gib(avail)} GiB {what}"


def _cpu_available() -> tuple[int, str]:
    avail, what = None, "available RAM"
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    if avail is None:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        what = "free RAM"
    with contextlib.suppress(OSError, ValueError):  # a container's limit is invisible to /proc/meminfo
        with open("/sys/fs/cgroup/memory.max") as f, open("/sys/fs/cgroup/memory.current") as g:
            limit, used = f.read().strip(), int(g.read())
        if limit != "max" and int(limit) - used < avail:
            avail, what = int(limit) - used, "left under the cgroup limit"
    return avail, what


def with_margin(plan_bytes: int) -> int:
    """What a plan of plan_bytes needs free on a GPU, the margin included."""
    return int(plan_bytes * MARGIN_FACTOR) + MARGIN_BYTES


def within_margin(available: int) -> int:
    """The largest plan that fits `available` bytes of a GPU with the margin (with_margin's inverse)."""
    plan = max(0, int((available - MARGIN_BYTES) / MARGIN_FACTOR))
    return plan + 1 if with_margin(plan + 1) <= available else plan  # float rounding


def device_memory(env):
    """(bytes one rank's plan may use, description): the device's available memory; on a CPU/MPS shared by this
    node's ranks, their share of it; on CUDA, less the margin (within_margin: what the plan cannot see)."""
    available, what = available_memory(env.device)
    if env.kind == "cuda":
        return within_margin(available), f"{what}; a plan may use {gib(within_margin(available))} GiB: {MARGIN} <= free"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return (available // local, f"{what} / {local} ranks") if local > 1 else (available, what)
