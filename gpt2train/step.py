"""One optimizer step's micro-batches on whatever parallel.parallelize() returned: batches to the device, gradient
sync only where an accumulation needs it, the loss weighted by each micro-batch's trained tokens, the micro-batch
halved on an out-of-memory, the global gradient norm clipped. train.py's loop and dryrun.py's simulation run this
same code; validation's micro-batches (in_micro_batches) halve alike.
"""

import math

import torch
import torch.distributed as dist

from gpt2train.console import log
from gpt2train.devices import autocast, device_type, is_oom
from gpt2train.files import Halt
from gpt2train.memory import free_cached_memory, smaller_micro_batch


def to_device(tensors, device):
    """CPU batch tensors on `device`. On CUDA the copy goes through pinned memory and is only queued, so the host
    does not wait: a copy from pageable memory first waits for all the work already queued on the GPU (a host
    sync per micro-batch, with or without non_blocking). The copy runs on the compute stream, after the work
    queued before it: it does not overlap a forward (1 MiB at 64 x 1024, tens of microseconds). Elsewhere a
    plain .to() (a no-op on the CPU)."""
    if device_type(device) != "cuda":
        return tuple(t.to(device) for t in tensors)
    return tuple(t.pin_memory().to(device, non_blocking=True) for t in tensors)


def set_grad_sync(model, enabled):
    """Whether the next backward all-reduces gradients across replicas: only the last micro-step of an
    accumulation needs to; must be set before the forward. DDP skips its all-reduce (gradients accumulate in its
    buckets). FSDP/HSDP reduce-scatter every micro-step, so a rank only ever holds its fp32 gradient shard (the
    no-sync alternative keeps whole fp32 gradients of every unit, 4 bytes/param of the whole model); HSDP adds
    up the shards locally and all-reduces them across replicas on the last micro-step only."""
    inner = getattr(model, "_orig_mod", model)  # under torch.compile
    if hasattr(inner, "require_backward_grad_sync"):  # DDP
        inner.require_backward_grad_sync = enabled
    elif hasattr(inner, "set_requires_all_reduce"):  # FSDP2 (a no-op without replicas)
        inner.set_requires_all_reduce(enabled)


def forward_backward(model, loader, rows, scaler, env, step=0):
    """Gradients of one optimizer step: `rows` sequences per rank, loader.B (the live micro-batch) at a time;
    returns micro_batches()'s (loss sum, counts). On an out-of-memory in a single process: the micro-batch halves
    for the rest of the run (the largest divisor of rows at most half), the partial step's gradients are dropped,
    the loader rewinds to the step's start and the same step re-runs on the same data. Under torchrun, or at
    micro-batch 1, an out-of-memory is a Halt naming settings that would help (ranks cannot switch together: the
    others may be waiting in a gradient all-reduce). `step`: the step done so far, for the messages."""
    start = loader.state_dict()
    while True:
        b = loader.B
        try:
            return micro_batches(model, loader, rows // b, scaler, env)
        except Exception as e:  # noqa: BLE001 -- only out-of-memory is handled
            if not is_oom(e):
                raise
        smaller = halve_or_halt(rows, b, env, f"step {step + 1}")
        model.zero_grad(set_to_none=True)  # the partial step's gradients; the scaler has not stepped yet
        free_cached_memory(env.device)
        loader.load_state_dict(start)
        loader.set_batch_size(smaller)
        log(
            f"step {step + 1}: out of memory at micro-batch {b}: re-running the step at micro-batch {smaller} x "
            f"{rows // smaller} accumulation steps (batch_size={smaller} from now on)"
        )


def halve_or_halt(rows, b, env, what, halvable=True):
    """After an out-of-memory at micro-batch b: the micro-batch to go on at, the largest divisor of rows (sequences
    per rank per step) at most half of b. Under torchrun, at micro-batch 1, or where the caller cannot change the
    micro-batch (halvable False), a Halt naming settings that would help instead (ranks cannot change micro-batch
    together: the others may be waiting in a collective). `what` starts the message ('step 3')."""
    smaller = smaller_micro_batch(rows, b)
    if env.distributed or not halvable or smaller is None:
        hint = f"batch_size={smaller} with {rows // smaller} accumulation steps, " if smaller else ""
        torchrun = (
            " under torchrun (ranks cannot change micro-batch together mid-run)" if smaller and env.distributed else ""
        )
        raise Halt(
            f"{what}: out of memory at micro-batch {b}{torchrun}; try {hint}"
            f"activation_checkpointing=True, parallel='fsdp' or a smaller block_size",
            "oom",
        )
    return smaller


def micro_batches(model, loader, grad_accum, scaler, env, micro_steps=None):
    """Gradients of the mean loss over the step's trained tokens (targets != -1, of all ranks); returns
    (the summed loss, a device scalar; a float32 device tensor [trained tokens, micro-batches with no trained
    target], both of all ranks: train.py reads them in its one copy to the host per step).
    The counts are float32, a dtype every backend has (MPS has no float64), and exact below 2**24 (16.7M) trained
    tokens per step of all ranks; above that trained_tokens is rounded (relative error below 1e-7). They are on
    the device because under torchrun with loss masks NCCL all-reduces them there, and train.py reads them in the
    same copy as the loss.
    No host sync: the counts are taken on the host from the CPU batches; with loss masks under torchrun their
    all-reduce runs while the first micro-batch's forward does, and is waited on (on the device) before its
    loss is scaled; each micro-batch is copied from pinned memory without the host waiting (to_device).
    A micro-batch with no trained target (SFT data) still runs its forward and backward (the other ranks wait
    for its gradients in a collective): its loss is 0 and so are its gradients.
    micro_steps: which of the grad_accum micro-steps to run (default all; the dry run skips repeats)."""
    micros = list(range(grad_accum) if micro_steps is None else micro_steps)
    batches = [loader.next_batch() for _ in micros]  # (x, y) on the host, (B, T) each
    masked = getattr(loader, "masked", False)  # some targets are -1 (SFT masks, document padding); else all trained
    counts = [int((y != -1).sum()) if masked else y.numel() for _, y in batches]  # host tensors: no sync
    trained = sum(counts) * (1 if masked else env.world_size)  # of all ranks; masked and torchrun: this rank's
    stats = to_device((torch.tensor([trained, counts.count(0)], dtype=torch.float32),), env.device)[0]
    pending = dist.all_reduce(stats, async_op=True) if masked and env.distributed else None
    loss_sum = torch.zeros((), device=env.device)
    for i, micro in enumerate(micros):
        x, y = to_device(batches[i], env.device)
        set_grad_sync(model, micro == grad_accum - 1)
        with autocast(env.device, env.dtype):
            _, loss = model(x, y, return_logits=False)
        # each micro-batch loss is a mean over its trained tokens; weighting it by its share of the step's
        # (x world_size: DDP averages over ranks) makes the summed gradients those of the mean over all the
        # step's trained tokens. Without masks every share is 1/grad_accum. A step with no trained target at
        # all divides by 1 (its loss and gradients are 0; train.py skips its update)
        if not masked:
            loss = loss / grad_accum
        elif not env.distributed:
            loss = loss * (counts[i] / max(trained, 1))
        else:
            if pending is not None:  # on NCCL the compute stream waits for it, the host does not
                pending.wait()
                pending = None
            loss = loss * (counts[i] * env.world_size / stats[0].clamp(min=1))
        loss_sum += loss.detach().float()
        scaler.scale(loss).backward()
    if pending is not None:  # no micro-step ran (cannot happen in training)
        pending.wait()
    return loss_sum, stats


def clip_gradients(model, max_norm):
    """Clip the global gradient norm to max_norm (0: only measure it); returns the norm before clipping, a
    plain scalar tensor. Under FSDP the gradients are DTensor shards: clip_grad_norm_ reduces the norm over
    ranks, so it is the whole gradient's norm, the number DDP gets, and the clip factor is the same."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm or math.inf)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # a DTensor under FSDP


def in_micro_batches(run, rows, micro, env, what):
    """Validation's rows: run(a, b) over rows [0, rows) `micro` at a time (micro divides rows); an out-of-memory
    halves micro (the largest divisor of rows at most half) and retries that slice; under torchrun, or at
    micro-batch 1, a Halt. `what` starts the messages ('step 100')."""
    at = 0
    while at < rows:
        try:
            run(at, at + micro)
            at += micro
            continue
        except Exception as e:  # noqa: BLE001 -- only out-of-memory is handled
            if not is_oom(e):
                raise
        smaller = smaller_micro_batch(rows, micro)
        if env.distributed or smaller is None:
            raise Halt(
                f"{what}: out of memory in validation at micro-batch {micro}; try a smaller batch_size, or eval_steps",
                "oom",
            )
        log(f"{what}: out of memory in validation at micro-batch {micro}: evaluating at {smaller}")
        micro = smaller
        free_cached_memory(env.device)
