"""One optimizer step's micro-batches on whatever parallel.parallelize() returned: batches to the device, gradient
sync only where an accumulation needs it, the loss weighted by each micro-batch's trained tokens, the global
gradient norm clipped; and the one out-of-memory loop (halving: the micro-batch halves) that the step, validation's
micro-batches (in_micro_batches), the compile trial before step 1 (compile_works) and batch_size='auto''s probe of
the bare model (probe_batch_size) run through. train.py's loop and dryrun.py's simulation run this same code.
"""

import math
from dataclasses import replace

import torch
import torch.distributed as dist

from gpt2train.config import ConfigError
from gpt2train.console import log
from gpt2train.devices import (
    autocast,
    device_type,
    is_compile_error,
    is_oom,
    make_compile_deterministic,
    resolve_compile,
    rng_state,
    set_rng_state,
)
from gpt2train.files import Halt, first_line
from gpt2train.headroom import with_margin
from gpt2train.memory import (
    COMPILE_RESERVE_FRACTION,
    NCCL_RESERVE,
    MemoryPlanError,
    estimate_memory,
    free_cached_memory,
    plan_kwargs,
    rows_per_rank,
    smaller_micro_batch,
)
from gpt2train.parallel import keeps_grads, unwrapped


def to_device(tensors, device):
    """CPU batch tensors on `device`. On CUDA the copy goes through pinned memory and is only queued, so the host
    does not wait: a copy from pageable memory first waits for all the work already queued on the GPU (a host
    sync per micro-batch, with or without non_blocking). The copy runs on the compute stream, after the work
    queued before it: it does not overlap a forward (1 MiB at 64 x 1024, tens of microseconds). Elsewhere a
    plain .to() (a no-op on the CPU)."""
    if device_type(device) != "cuda":
        return tuple(t.to(device) for t in tensors)
    return tuple(t.pin_memory().to(device, non_blocking=True) for t in tensors)


def set_grad_sync(model, enabled, env):
    """Whether the next backward all-reduces gradients across replicas: only the last micro-step of an
    accumulation needs to; must be set before the forward. DDP (parallel.keeps_grads) skips its all-reduce
    (gradients accumulate in its buckets). FSDP/HSDP (env.fsdp) reduce-scatter every micro-step, so a rank only ever
    holds its fp32 gradient shard (the no-sync alternative keeps whole fp32 gradients of every unit, 4 bytes/param
    of the whole model); HSDP adds up the shards locally and all-reduces them across replicas on the last
    micro-step only."""
    if env.fsdp:
        model.set_requires_all_reduce(enabled)  # a no-op without replicas
    elif keeps_grads(env):
        unwrapped(model).require_backward_grad_sync = enabled


def forward_backward(model, loader, rows, scaler, env, step=0):
    """Gradients of one optimizer step: `rows` sequences per rank, loader.B (the live micro-batch) at a time;
    returns micro_batches()'s (loss sum, counts). On an out-of-memory in a single process (halving): the micro-batch
    halves for the rest of the run (the largest divisor of rows at most half), the partial step's gradients are
    dropped, the loader rewinds to the step's start and the same step re-runs on the same data. Under torchrun, or at
    micro-batch 1, an out-of-memory is a Halt naming settings that would help (ranks cannot switch together: the
    others may be waiting in a gradient all-reduce). `step`: the step done so far, for the messages. A pipeline
    (pipeline.Pipeline, env.pipeline > 1) runs the step's rows through its schedule; an out-of-memory there is a
    Halt."""
    start = loader.state_dict()
    if env.pipeline > 1:
        run = lambda b: model.train_step(loader, rows, env)  # noqa: E731
        return halving(run, None, rows, loader.B, env, f"step {step + 1}")

    def recover(b, smaller):
        model.zero_grad(set_to_none=True)  # the partial step's gradients; the scaler has not stepped yet
        loader.load_state_dict(start)
        loader.set_batch_size(smaller)
        log(
            f"step {step + 1}: out of memory at micro-batch {b}: re-running the step at micro-batch {smaller} x "
            f"{rows // smaller} accumulation steps (batch_size={smaller} from now on)"
        )

    run = lambda b: micro_batches(model, loader, rows // b, scaler, env)  # noqa: E731
    return halving(run, recover, rows, loader.B, env, f"step {step + 1}")


def halving(attempt, recover, rows, b, env, what):
    """The one out-of-memory loop of a run: attempt(b), and after an out-of-memory recover(b, smaller) (drop what the
    attempt left, say so, take the new micro-batch) and attempt(smaller), with smaller the largest divisor of rows
    (sequences per rank per step) at most half of b; returns what attempt returned. The step, validation and the
    compile trial run through it. Under torchrun, or at micro-batch 1, a Halt instead (halve_or_halt)."""
    while True:
        try:
            return attempt(b)
        except Exception as e:  # noqa: BLE001 -- only out-of-memory is handled
            if not is_oom(e):
                raise
        # outside the except block from here: the failed attempt's tensors are freed
        smaller = halve_or_halt(rows, b, env, what)
        recover(b, smaller)
        free_cached_memory(env.device)
        b = smaller


def halve_or_halt(rows, b, env, what):
    """After an out-of-memory at micro-batch b: the micro-batch to go on at, the largest divisor of rows (sequences
    per rank per step) at most half of b. Under torchrun or at micro-batch 1 a Halt naming settings that would help
    instead (ranks cannot change micro-batch together: the others may be waiting in a collective). `what` starts the
    message ('step 3')."""
    smaller = smaller_micro_batch(rows, b)
    if env.distributed or smaller is None:
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
    trained = sum(counts) * (1 if masked else env.dp_size)  # of all ranks; masked and torchrun: this rank's
    # a tensor-parallel group's ranks read the same rows: the group's first rank counts them
    mine = [trained, counts.count(0)] if env.tp_rank == 0 or not masked else [0, 0]
    stats = to_device((torch.tensor(mine, dtype=torch.float32),), env.device)[0]
    pending = dist.all_reduce(stats, async_op=True) if masked and env.distributed else None
    loss_sum = torch.zeros((), device=env.device)
    for i, micro in enumerate(micros):
        x, y = to_device(batches[i], env.device)
        set_grad_sync(model, micro == grad_accum - 1, env)
        with autocast(env.device, env.dtype):
            _, loss = model(x, y, return_logits=False)
        # each micro-batch loss is a mean over its trained tokens; weighting it by its share of the step's
        # (x dp_size: DDP averages over the data-parallel ranks) makes the summed gradients those of the mean over
        # all the step's trained tokens. Without masks every share is 1/grad_accum. A step with no trained target at
        # all divides by 1 (its loss and gradients are 0; train.py skips its update)
        if not masked:
            loss = loss / grad_accum
        elif not env.distributed:
            loss = loss * (counts[i] / max(trained, 1))
        else:
            if pending is not None:  # on NCCL the compute stream waits for it, the host does not
                pending.wait()
                pending = None
            loss = loss * (counts[i] * env.dp_size / stats[0].clamp(min=1))
        loss_sum += loss.detach().float()
        scaler.scale(loss).backward()
    if pending is not None:  # no micro-step ran (cannot happen in training)
        pending.wait()
    return loss_sum, stats


def clip_gradients(model, max_norm, pipeline_group=None):
    """Clip the global gradient norm to max_norm (0: only measure it); returns the norm before clipping, a
    plain scalar tensor. Under FSDP and tensor parallelism the gradients are DTensor shards: their norm is reduced
    over ranks, so it is the whole gradient's norm, the number DDP gets, and the clip factor is the same. Norms
    are taken per device mesh (torch's one call needs a single mesh; tensor parallelism has two, or plain
    replicated tensors beside DTensors), then combined. A pipeline stage holds its own gradients: given its
    pipeline's group (env.pp_group), the stage's norm, so combined, is squared and summed over the stages."""
    by_mesh = {}
    for p in model.parameters():
        if p.grad is not None:
            by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    norms = [torch.nn.utils.get_total_norm([p.grad for p in params]) for params in by_mesh.values()]
    norm = torch.nn.utils.get_total_norm([n.full_tensor() if hasattr(n, "full_tensor") else n for n in norms])
    if pipeline_group is not None:  # a stage's norm: the whole model's is the root of the stages' summed squares
        norm = norm.square()
        dist.all_reduce(norm, group=pipeline_group)
        norm = norm.sqrt()
    for params in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm or math.inf, norm)
    return norm


def in_micro_batches(run, rows, micro, env, what):
    """Validation's rows: run(a, b) over rows [0, rows) `micro` at a time (micro divides rows); an out-of-memory
    halves micro (halving) and retries that slice; under torchrun, or at micro-batch 1, a Halt. `what` starts the
    messages ('step 100')."""
    at = 0

    def attempt(b):  # the slice from row `at`; returns the micro-batch it ran at
        run(at, at + b)
        return b

    def recover(b, smaller):
        log(f"{what}: out of memory in validation at micro-batch {b}: evaluating at {smaller}")

    while at < rows:
        micro = halving(attempt, recover, rows, micro, env, f"{what}, validation")
        at += micro


def compile_works(compiled, cfg, env, loader):
    """The compile trial, before step 1: run parallelize()'s compiled model once as training and once as evaluation,
    leaving weights, gradients and RNGs as they were; False (with a note) on a compile error, where the run goes on
    eagerly (parallel.after_compile_trial). Any other error but an out-of-memory propagates. The trial's calls are
    the loop's (distinct inputs and targets: dynamo guards on `idx is targets`), so the graphs compiled here are the
    ones the steps and evaluations run, not compiled a second time. An out-of-memory is not a compile error: the
    loader's micro-batch halves as a step's does (halving) and the trial runs again, compiled afresh at the new size
    (the loop then runs that graph, never one compiled for two sizes)."""
    log("compiling the model (torch.compile): the first step waits for it; compile=False skips it")
    make_compile_deterministic(env.device)  # graphs are built by the calls below
    rngs = rng_state()

    def attempt(b):  # the compile error's first line, or None
        try:
            trial(compiled, b, cfg, env)
        except Exception as e:  # noqa: BLE001 -- a compile error is an answer; the rest propagates
            if not is_compile_error(e):
                raise
            return first_line(e)
        finally:
            compiled.train()
            compiled.zero_grad(set_to_none=not keeps_grads(env))
            set_rng_state(rngs)
        return None

    def recover(b, smaller):
        torch._dynamo.reset()  # else the next size is compiled as a dynamic-shape graph
        log(
            f"the torch.compile trial: out of memory at micro-batch {b}: trying micro-batch {smaller} "
            f"(batch_size={smaller} from now on)"
        )
        loader.set_batch_size(smaller)

    error = halving(attempt, recover, env.rows, loader.B, env, "the torch.compile trial")
    if error is not None:
        log(f"torch.compile failed ({error}); training eagerly (compile=False skips the attempt)")
    return error is None


def trial(compiled, b, cfg, env):
    """The compile trial's calls: a training forward+backward at micro-batch b, and an evaluation forward."""
    x, y = (torch.zeros(b, cfg.block_size, dtype=torch.long, device=env.device) for _ in range(2))
    with autocast(env.device, env.dtype):
        compiled(x, y, return_logits=False)[1].backward()
        if cfg.eval_interval > 0:  # evaluation compiles a graph of its own
            compiled.eval()
            with torch.no_grad():
                compiled(x, y, return_logits=False)


def probe_batch_size(raw_model, cfg, env, loaders):
    """batch_size='auto' on a probed device: the largest divisor of the per-rank rows that runs one forward+
    backward of the bare model (probe_micro_batch; all ranks agree) with what the real step has beside it
    held aside (reserve below), leaving its RNGs and gradients as they were. Returns cfg with the resolved
    batch_size; the loaders take it too."""
    rows = rows_per_rank(cfg.total_batch_size, cfg.block_size, env.dp_size)
    plan = estimate_memory(raw_model.config, 1, **plan_kwargs(cfg, env))
    rngs = rng_state()

    def try_step(b):
        x = torch.randint(0, cfg.vocab_size, (b, cfg.block_size), device=env.device)  # (b, T)
        try:
            with autocast(env.device, env.dtype):
                raw_model(x, x, return_logits=False)[1].backward()
        finally:
            raw_model.zero_grad(set_to_none=True)

    compiled = resolve_compile(cfg.compile, env.device, env.dtype)

    def reserve(b):  # what the probe's bare forward+backward lacks: optimizer state; under torchrun NCCL's
        # buffers; the fp32 gradients where they are resident from the step's first forward on: DDP's bucket
        # views (kept across steps) or accumulation's (micro-batch b below the rows), 4 bytes/param; what compile
        # adds to the activations
        resident = plan.grads if env.distributed or b < rows else 0
        planned = estimate_memory(raw_model.config, b, **plan_kwargs(cfg, env))
        margin = with_margin(planned.total) - planned.total  # what neither plan nor probe sees (headroom.MARGIN)
        extra = int(planned.activations * COMPILE_RESERVE_FRACTION) if compiled else 0
        return plan.optimizer + resident + (NCCL_RESERVE if env.distributed else 0) + margin + extra

    try:
        b, why = probe_micro_batch(try_step, rows, env, reserve_bytes=reserve)
    except MemoryPlanError as e:
        raise ConfigError(str(e)) from None
    set_rng_state(rngs)
    if env.kind == "cuda":  # step 1's peak_mem_mb is then the step's, not the probe's
        torch.cuda.reset_peak_memory_stats(env.device)
    log(f"batch_size='auto': {why} ({rows // b} accumulation steps)")
    for loader in loaders:
        if loader is not None:
            loader.set_batch_size(b)
    return replace(cfg, batch_size=b)


def probe_micro_batch(try_step, rows, env, reserve_bytes=0):
    """CUDA batch_size='auto': try_step(b) runs one real forward+backward at micro-batch b and raises
    torch.OutOfMemoryError if it does not fit. From micro-batch `rows` (sequences per rank per step) down, halving
    as a step does (halving). reserve_bytes (bytes, or a function of b giving them) are held on env.device during
    each try (what the real step has and the bare model's try does not: optimizer state, resident gradients,
    NCCL's buffers). try_step runs the bare model (no collectives), so each rank halves alone; then all ranks agree
    on the smallest choice (one all-reduce MIN). Returns (micro_batch, why)."""
    tried = []

    def attempt(b):
        tried.append(b)
        held = reserve_bytes(b) if callable(reserve_bytes) else reserve_bytes
        reserve = torch.empty(held, dtype=torch.uint8, device=env.device) if held else None  # noqa: F841
        try_step(b)
        return b

    try:
        b = halving(attempt, lambda b, smaller: None, rows, rows, replace(env, distributed=False), "the probe")
    except Halt:  # out of memory at micro-batch 1
        b = 0
    free_cached_memory(env.device)
    failed = tried[:-1] if b else tried
    chosen = agree_micro_batch(b, env)  # every rank takes part, also one that found nothing
    if not chosen:
        where = (
            f"out of memory even at micro-batch {failed[-1]} (tried {', '.join(map(str, failed))})"
            if not b
            else "another rank ran out of memory even at micro-batch 1"
        )
        raise MemoryPlanError(f"batch_size='auto': {where}; try activation_checkpointing=True or parallel='fsdp'")
    why = (
        f"micro-batch {chosen}: the largest that ran forward+backward"
        + (f" (out of memory at {', '.join(map(str, failed))})" if failed else "")
        + (f"; {b} here, {chosen} on the smallest rank" if chosen != b else "")
    )
    return chosen, why


def agree_micro_batch(batch_size, env):
    """The smallest batch_size over all ranks (an all-reduce MIN) under torchrun."""
    if not env.distributed:
        return batch_size
    t = torch.tensor([batch_size], device=env.device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
