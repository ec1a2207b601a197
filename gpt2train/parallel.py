"""How the model is spread over the processes: the one seam between the bare GPT and the training loop
(torchtitan's parallelize.py). setup() joins torchrun's process group and returns the Env (layout.py: rank, device,
precision and the run's parallel layout) every later step takes. parallelize() wraps the model once, the whole one or
a pipeline stage (pipeline.build cuts it first): DDP (every rank a whole replica), or the sharded path (shard): the
blocks split over the tensor-parallel ranks, FSDP2 / HSDP (parameters, gradients and optimizer state sharded over
ranks), a model built on the meta device materialised (meta_init.py); torch.compile is tried once on dummy tokens
so a compile error means eager from the start, never a swap mid-run. gathered() gives the evaluations a whole copy
of a sharded model; step.py runs the step's micro-batches on what parallelize() returned.
"""

import itertools
import os
import random
import sys
from contextlib import contextmanager
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from gpt2train.config import ConfigError
from gpt2train.console import launched_by_torchrun
from gpt2train.devices import (
    DTYPES,
    device_type,
    resolve_compile,
    resolve_device,
    resolve_dtype,
    tune_cpu_allocator,
    use_cuda_device,
)
from gpt2train.layout import Env, arrange, stage_of
from gpt2train.meta_init import DEFERRED, materialise
from gpt2train.tensor_parallel import split_blocks, whole
from model import GPT

# ----------------------------------------------------------------------------- how the processes are arranged


def any_rank(flag, env):
    """Whether flag is true on any rank: under torchrun a collective, so every rank must ask alike. One host sync
    (reading the result): the flag is filled on the device, not copied there from pageable host memory (a copy
    that would first wait for the device's queued work)."""
    if not env.distributed:
        return bool(flag)
    t = torch.full((), float(bool(flag)), device=env.device)
    dist.all_reduce(t)
    return t.item() > 0


def rank_ranges(ranks):
    """[0, 1, 2, 5] -> '0-2, 5': itertools.groupby of rank - index, which is constant along consecutive ranks."""
    runs = [[r for _, r in run] for _, run in itertools.groupby(enumerate(ranks), lambda p: p[1] - p[0])]
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)


def setup(cfg):
    """Join torchrun's process group (RANK/LOCAL_RANK/WORLD_SIZE; a plain `python train.py` is rank 0 of 1),
    pick device, precision and the layout (layout.arrange: a layout that cannot run is refused before any process
    group exists), and seed every RNG alike on all ranks (identical initial weights)."""
    distributed = launched_by_torchrun()
    rank, local_rank, world_size = (
        int(os.environ.get(k, d)) for k, d in (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", 1))
    )
    try:
        device = resolve_device(cfg.device)
    except ValueError as e:
        raise ConfigError(f"config key 'device': {e}") from None
    dtype = resolve_dtype(cfg.dtype, device)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    parallel, mesh, pipeline, tp = arrange(cfg, distributed, world_size, local, dtype, device)
    if device_type(device) == "cuda":
        device = use_cuda_device(device, local_rank if distributed else None)
        torch.backends.cuda.matmul.allow_tf32 = True  # TF32 matmuls on Ampere+ (docs/speed.md)
        torch.backends.cudnn.allow_tf32 = True
    if distributed:  # the timeout covers rank 0 writing a checkpoint while the others wait in the next collective
        dist.init_process_group(
            backend="nccl" if device_type(device) == "cuda" else "gloo",
            timeout=timedelta(minutes=cfg.dist_timeout_minutes),
        )
    tune_cpu_allocator(device)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    return Env(rank, local_rank, world_size, distributed, device, dtype, parallel, mesh, pipeline, tp)


def exit_process(main):
    """Run main() (a command's entry point) and end the process with its exit status. Under torchrun the end skips
    the interpreter's finalization (os._exit once stdout and stderr are flushed; main has destroyed the process
    group and closed its files): DDP keeps the gloo process group and its worker threads alive past
    destroy_process_group, and a worker that drops the last reference to a collective's tensor while the
    interpreter finalizes must take the GIL, which then ends the thread inside C++: `terminate called without an
    active exception`, SIGABRT, a failed job after a finished run (issue 58: seen under load). A rank that fails
    (main returns a non-zero status or raises) exits as before."""
    if not launched_by_torchrun():
        sys.exit(main())
    code = main()
    if code:  # a failed rank ends as before: an instant exit would let torchrun stop rank 0 before its one line
        sys.exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ----------------------------------------------------------------------------- how the model is spread over them


def parallelize(model, cfg, env):
    """The one place the bare model (whole, or a pipeline stage: pipeline.build) is wrapped for training: DDP across
    ranks, then torch.compile (which understands DDP's gradient buckets); or, where no rank holds the whole model
    (env.sharded), shard() in place. It runs nothing: the compile trial (step.compile_works, then
    after_compile_trial) decides whether the compiled model is kept."""
    if env.sharded:
        return shard(model, cfg, env)
    if env.distributed:
        from torch.nn.parallel import DistributedDataParallel as DDP

        # DDP turns existing gradients into views of its buckets: from step 1 on they stay there (keeps_grads),
        # one copy, not two
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        model = DDP(model, device_ids=[env.local_rank] if env.kind == "cuda" else None, gradient_as_bucket_view=True)
    return torch.compile(model) if resolve_compile(cfg.compile, env.device, env.dtype) else model


def after_compile_trial(model, works, env):
    """What the loop calls once the compile trial (step.compile_works) has run on parallelize()'s compiled model:
    that model, or where compiling failed (works False) the eager one, so a compile error means eager from the
    start, never a swap mid-run. A sharded model is also left as the optimizer must find it: every FSDP unit
    resharded (the trial's evaluation forward left the root gathered, as FSDP keeps the root for a backward) and no
    gradient (the trial's, on the root's shards, unseen while it was gathered)."""
    if not env.sharded:  # DDP or one process: the whole model compiled; the trial left no gradient
        return model if works else unwrapped(model)
    from torch.distributed.fsdp import FSDPModule

    if not works:
        if env.fsdp and not hasattr(FSDPModule, "reset_iter_state"):  # newer than the torch floor
            raise ConfigError(
                f"torch {torch.__version__} cannot recover FSDP from the failed torch.compile trial "
                "(no FSDPModule.reset_iter_state): set compile=False, or upgrade torch"
            )
        if env.fsdp:
            model.reset_iter_state()  # the failed forward left FSDP mid-iteration
        for block in model.transformer.h:
            del block.forward  # back to Block.forward, eager
        del model.head_loss
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()
    model.zero_grad(set_to_none=True)
    return model


def shard(model, cfg, env):
    """The sharded path (a whole model, or a pipeline stage), in place, in torchtitan's order: tensor parallelism (the
    blocks split over the mesh's "tp" dim, tensor_parallel.split_blocks); activation checkpointing is already inside
    the model; torch.compile of each block's forward and of the root's head_loss (ln_f, the head and the chunked loss;
    one graph serves every block); FSDP (env.fsdp) over the data-parallel dims, each block one unit and the root the
    last (the tied wte/lm_head, wpe, ln_f); then a model built on meta (meta_init) is materialised, this rank's part
    only. The model may still be on the CPU: fully_shard moves each unit to the device as it shards it, so no GPU
    ever holds the whole model. Under FSDP every rank must run the same forwards (each all-gathers a unit).

    Precision, the one rule of a bf16 run: FSDP's MixedPrecisionPolicy makes every unit all-gather bf16 copies
    of its fp32 shards (half the bytes, and half the memory of a gathered unit), so forward and backward
    compute from bf16 weights and activations, the residual stream included (torchtitan's and Composer's FSDP
    default); torch.autocast stays on, as in every mode, for the ops it keeps in fp32. Gradients are
    reduce-scattered and accumulated in fp32 (reduce_dtype) and AdamW updates the fp32 shards. An fp32 run
    casts nothing.

    Tensor parallelism with parallel='ddp' has data-parallel dims (replicas, 1): FSDP with shards of one rank is data
    parallelism that understands DTensor parameters (DistributedDataParallel does not; torchtitan refuses DDP with
    TP); with one data-parallel rank there is no FSDP. A pipeline stage is neither compiled nor FSDP-wrapped yet: its
    replicas average their gradients by hand (pipeline.Pipeline.average_gradients)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if env.tensor_parallel > 1:
        split_blocks(model, env.mesh["tp"])
    if env.pipeline == 1 and resolve_compile(cfg.compile, env.device, env.dtype):
        for block in model.transformer.h:
            block.forward = torch.compile(block.forward)  # FSDP's hooks stay outside the graph
        model.head_loss = torch.compile(model.head_loss)  # ln_f, the head and the chunked loss, in the root unit
    low = None if env.dtype == "float32" else DTYPES[env.dtype]
    policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
    if env.fsdp:
        dp_mesh = env.mesh[env.dp_dims]
        for block in model.transformer.h:
            fully_shard(block, mesh=dp_mesh, mp_policy=policy)
        fully_shard(model, mesh=dp_mesh, mp_policy=policy)
    elif not next(model.parameters()).is_meta:  # no FSDP: whole weights (or tensor-parallel parts) to the device (a
        model.to(env.device)  # model on meta stays there: materialised below, or the dry run's, to_empty'd on fakes)
    if model in DEFERRED:  # built on meta: this rank's part only, initialised as one process would
        materialise(model, env)
    return model


def is_compiled(model):
    """Whether parallelize() kept torch.compile: of the whole model (DDP, one process) or of each block (FSDP)."""
    return model is not unwrapped(model) or any("forward" in vars(m) for m in model.modules())


def unwrapped(model):
    """The module torch.compile wrapped (parallelize's DDP or whole model), or model itself."""
    return getattr(model, "_orig_mod", model)


def keeps_grads(env):
    """Whether the model's gradients are DDP's bucket views (gradient_as_bucket_view: parallelize wraps DDP under
    torchrun unless sharded): zero them in place, never set them to None, or the next step's no-sync micro-steps
    allocate a second copy beside the buckets."""
    return env.distributed and not env.sharded


@contextmanager
def gathered(raw_model, env):
    """The bare GPT with whole parameters, for code that uses it outside its forward (HellaSwag's scoring,
    generation). An unsharded model passes through. A sharded one: every rank must enter (each unit's
    all-gather is a collective) and then holds a plain GPT over the gathered tensors, with no FSDP hooks, to
    run any number of forwards alone; on exit the whole parameters are freed. Costs the whole model per rank
    for the duration: 2 bytes/param in bf16 runs, 4 in fp32. A tensor-parallel model's split weights are gathered
    over its group (tensor_parallel.whole). A pipeline stage (env.pipeline > 1): whole_pipeline's copy."""
    if env.pipeline > 1:
        yield whole_pipeline(raw_model, env)
        return
    if not env.sharded:
        yield raw_model
        return
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in raw_model.modules() if isinstance(m, FSDPModule)]  # none under tensor parallelism alone
    for unit in units:
        unit.unshard()  # the units' registered parameters are now the whole tensors (tensor-parallel shards)
    try:
        with torch.device("meta"):
            plain = GPT(raw_model.config)
        named = [*raw_model.named_parameters(remove_duplicate=False), *raw_model.named_buffers()]
        for name, tensor in named:
            owner, _, leaf = name.rpartition(".")
            value = whole(name, tensor.detach())  # a tensor-parallel shard gathered, in GPT-2's layout
            if isinstance(tensor, torch.nn.Parameter):
                value = torch.nn.Parameter(value, requires_grad=False)
            setattr(plain.get_submodule(owner), leaf, value)
        yield plain
    finally:
        for unit in units:
            unit.reshard()


def whole_pipeline(raw_model, env):
    """A whole GPT, on every rank of raw_model's pipeline (raw_model: this rank's stage, pipeline.build), from the
    stages' parameters: each stage's rank broadcasts its own. Every rank of the pipeline must call it."""
    group, stages, config = env.pp_group, env.pipeline, raw_model.config
    mine = dict(raw_model.named_parameters())
    device = next(iter(mine.values())).device
    with torch.device("meta"):
        gpt = GPT(config)
    gpt.to_empty(device=device)
    with torch.no_grad():
        for name, p in gpt.named_parameters():
            stage = stage_of(name, config.n_layer, stages)
            if name in mine:  # a tensor-parallel part gathered over its group (every rank of the stage calls it)
                p.copy_(whole(name, mine[name]))
            dist.broadcast(p, src=dist.get_global_rank(group, stage), group=group)
        for name, buffer in gpt.named_buffers():  # the rotary tables, on every stage
            buffer.copy_(raw_model.get_buffer(name))
    return gpt.requires_grad_(False)


def weights_finite(raw_model, env):
    """Whether every weight is finite; in a sharded run each rank checks its shards and all agree."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in raw_model.parameters()]
    finite = all(torch.isfinite(p).all() for p in local)
    if env.sharded:
        bad = torch.tensor(0.0 if finite else 1.0, device=env.device)
        dist.all_reduce(bad)
        finite = bad.item() == 0
    return finite
