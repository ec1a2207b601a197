"""How the processes are arranged and how the model is spread over them: the one seam between the bare GPT and
the training loop (torchtitan's ParallelDims and parallelize.py). setup() joins torchrun's process group and
returns the Env (rank, device, precision, parallel mode) every later step takes; check_shared_out_dir() makes
sure all nodes see one out_dir. parallelize() wraps the model once: DDP (every rank a whole replica), or FSDP2 /
HSDP (parameters, gradients and optimizer state sharded over ranks), then torch.compile, tried once on dummy
tokens so a compile error means eager from the start, never a swap mid-run. gathered() gives the
evaluations a whole copy of a sharded model; step.py runs the step's micro-batches on what parallelize() returned.
"""

import os
import random
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from gpt2train.config import ConfigError
from gpt2train.console import launched_by_torchrun, log
from gpt2train.devices import (
    DTYPES,
    device_type,
    resolve_compile,
    resolve_device,
    resolve_dtype,
    tune_cpu_allocator,
    use_cuda_device,
)
from gpt2train.layout import check_pipeline, stage_of
from gpt2train.tensor_parallel import model_rows, split_blocks, whole
from model import GPT, rotary_cos_sin


@dataclass
class Env:
    """Where this process runs: its rank among torchrun's processes, its device and precision."""

    rank: int
    local_rank: int
    world_size: int
    distributed: bool  # launched by torchrun (even with one process)
    device: str
    dtype: str  # resolved: 'float32', 'bfloat16' or 'float16'
    parallel: str = "ddp"  # in effect: 'fsdp'/'hsdp' only under torchrun ('ddp' also for one plain process)
    # sharded runs, over the data-parallel ranks: (dp,) for 'fsdp', (replica groups, shard_size) for 'hsdp'; with
    # tensor parallelism 'ddp' is (dp, 1): replicas of one shard (tensor_parallel.py says why)
    mesh_shape: tuple = ()
    pipeline: int = 1  # pipeline stages (layout.py): each rank holds the blocks of one
    tensor_parallel: int = 1  # in effect: 1 outside torchrun

    @property
    def master(self):
        return self.rank == 0

    @property
    def sharded(self):
        """Whether no rank holds the whole model (FSDP/HSDP shards, pipeline stages, tensor-parallel shards): it is
        built on the meta device, every rank saves its part (DCP) and gathers for evaluations."""
        return self.parallel != "ddp" or self.pipeline > 1 or self.tensor_parallel > 1

    @property
    def fsdp(self):
        """Whether parallelize() wraps the model in FSDP: 'fsdp'/'hsdp', and 'ddp' across the data-parallel ranks of
        a tensor-parallel run (shard())."""
        return self.parallel != "ddp" or self.tensor_parallel > 1 and self.dp_size > 1

    @property
    def dp_size(self):
        """Data-parallel ranks: the ranks reading distinct rows (every stage of a pipeline, and every rank of a
        tensor-parallel group, reads the same ones)."""
        return self.world_size // (self.pipeline * self.tensor_parallel)

    @property
    def dp_rank(self):
        """This rank's place among the data-parallel ranks (ranks laid out as the mesh (pp, dp, tp): the ranks of
        one tensor-parallel group are consecutive, a pipeline's stages outermost)."""
        return self.rank // self.tensor_parallel % self.dp_size

    @property
    def tp_rank(self):
        return self.rank % self.tensor_parallel

    @property
    def stage(self):
        """This rank's pipeline stage (layout.py: pipeline outermost)."""
        return self.rank // (self.dp_size * self.tensor_parallel)

    @property
    def kind(self):
        return device_type(self.device)


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
    """[0, 1, 2, 5] -> '0-2, 5'."""
    runs = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in runs)


def setup(cfg):
    """Join torchrun's process group (RANK/LOCAL_RANK/WORLD_SIZE; a plain `python train.py` is rank 0 of 1),
    pick device, precision and parallelism, and seed every RNG alike on all ranks (identical initial weights)."""
    distributed = launched_by_torchrun()
    rank, local_rank, world_size = (
        int(os.environ.get(k, d)) for k, d in (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", 1))
    )
    try:
        device = resolve_device(cfg.device)
    except ValueError as e:
        raise ConfigError(f"config key 'device': {e}") from None
    dtype = resolve_dtype(cfg.dtype, device)
    parallel, mesh, tp = "ddp", (), 1
    asked = {"parallel": cfg.parallel != "ddp", "tensor_parallel": cfg.tensor_parallel > 1}
    split = " and ".join(f"{key}={getattr(cfg, key)!r}" for key, on in asked.items() if on)
    if split and not distributed:
        log(f"{split} ignored: not launched by torchrun, this one process trains the whole model", note=True)
    elif split:
        parallel, tp = cfg.parallel, cfg.tensor_parallel
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        mesh = mesh_shape(parallel, cfg.shard_size, data_parallel_size(world_size, tp), max(1, local // tp), tp)
        if dtype == "float16":  # GradScaler's inf check would see only this rank's gradient shard
            raise ConfigError(
                f"{split} trains in bfloat16 or float32, not float16 (dtype={cfg.dtype!r} "
                f"resolved to float16 on {device}): set --dtype=float32 or a bf16 device"
            )
    pipeline = cfg.pipeline_parallel if distributed else 1
    if pipeline > 1:
        check_pipeline(cfg, world_size)
        if dtype == "float16":  # GradScaler's inf check would see only this stage's gradients
            raise ConfigError(
                f"pipeline_parallel={pipeline} trains in bfloat16 or float32, not float16 (dtype={cfg.dtype!r} "
                f"resolved to float16 on {device}): set --dtype=float32 or a bf16 device"
            )
    elif cfg.pipeline_parallel > 1:
        log(
            f"pipeline_parallel={cfg.pipeline_parallel} ignored: not launched by torchrun, this one process trains "
            "the whole model",
            note=True,
        )
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


def data_parallel_size(world_size, tensor_parallel):
    """world_size / tensor_parallel, the ranks that read different rows; a tensor_parallel that does not divide
    the world is a ConfigError."""
    if world_size % tensor_parallel:
        raise ConfigError(
            f"tensor_parallel={tensor_parallel} must divide the world size {world_size} (groups of "
            f"tensor_parallel ranks split each block; the groups are the data-parallel ranks)"
        )
    return world_size // tensor_parallel


def mesh_shape(parallel, shard_size, world_size, local_world_size, tensor_parallel=1):
    """Data-parallel device-mesh shape of a sharded run over world_size data-parallel ranks: 'fsdp'
    (world_size,), every rank holding 1/world_size of the model; 'hsdp' (world_size // shard_size, shard_size):
    groups of shard_size ranks (default one node's ranks, so the all-gathers stay on the fast intra-node links)
    each shard the model and replicate each other; 'ddp' under tensor parallelism (world_size, 1): replicas."""
    if parallel == "fsdp":
        return (world_size,)
    if parallel == "ddp":
        return (world_size, 1) if tensor_parallel > 1 else ()
    size = shard_size or local_world_size
    if world_size % size:
        raise ConfigError(
            f"shard_size={size} does not divide the world size {world_size} (parallel='hsdp' "
            f"shards within groups of shard_size ranks)"
        )
    return (world_size // size, size)


# ----------------------------------------------------------------------------- how the model is spread over them


def parallelize(model, cfg, env):
    """The one place the bare model is wrapped for training: DDP across ranks, then torch.compile (which
    understands DDP's gradient buckets); or, with parallel='fsdp'/'hsdp', shard() in place. It runs nothing: the
    compile trial (step.compile_works, then after_compile_trial) decides whether the compiled model is kept."""
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


def after_compile_trial(model, works):
    """What the loop calls once the compile trial (step.compile_works) has run on parallelize()'s compiled model:
    that model, or where compiling failed (works False) the eager one, so a compile error means eager from the
    start, never a swap mid-run. A sharded model is also left as the optimizer must find it: every unit resharded
    (the trial's evaluation forward left the root gathered, as FSDP keeps the root for a backward) and no gradient
    (the trial's, on the root's shards, unseen while it was gathered)."""
    if not hasattr(model, "reshard"):  # DDP or one process: the trial left no gradient
        return model if works else model._orig_mod
    from torch.distributed.fsdp import FSDPModule

    if not works:
        if not hasattr(model, "reset_iter_state"):  # newer than the torch floor
            raise ConfigError(
                f"torch {torch.__version__} cannot recover FSDP from the failed torch.compile trial "
                "(no FSDPModule.reset_iter_state): set compile=False, or upgrade torch"
            )
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
    """FSDP2 on the bare model, in place, torchtitan's order: activation checkpointing is already inside the
    model (cfg.activation_checkpointing), then each block's forward and the root's head_loss (ln_f, output head,
    chunked loss: compiled under DDP too, as part of the whole model) are compiled (before sharding; one graph
    serves every block), then each block becomes one FSDP unit and the root the last (the tied wte/lm_head,
    wpe and ln_f). The model may still be on the CPU: fully_shard moves each unit to the device as it shards
    it, so no GPU ever holds the whole model. Returns the model; its forward all-gathers the parameters of one
    unit at a time, so every rank must run the same forwards.

    Precision, the one rule of a bf16 run: FSDP's MixedPrecisionPolicy makes every unit all-gather bf16 copies
    of its fp32 shards (half the bytes, and half the memory of a gathered unit), so forward and backward
    compute from bf16 weights and activations, the residual stream included (torchtitan's and Composer's FSDP
    default); torch.autocast stays on, as in every mode, for the ops it keeps in fp32. Gradients are
    reduce-scattered and accumulated in fp32 (reduce_dtype) and AdamW updates the fp32 shards. An fp32 run
    casts nothing.

    Tensor parallelism (tensor_parallel > 1) comes first, as in torchtitan: the blocks are split over the mesh's
    last dim (tensor_parallel.split_blocks), then FSDP shards each rank's part over the data-parallel dims (2-D
    FSDP x TP). With parallel='ddp' those dims are (replicas, 1): FSDP with shards of one rank is data parallelism
    that understands DTensor parameters (DistributedDataParallel does not; torchtitan refuses DDP with TP), the
    gradients all-reduced over the replicas; with a single data-parallel rank there is no FSDP at all."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dp = ("dp_replicate", "dp_shard")[-len(env.mesh_shape) :]  # torchtitan's names; 'tp' last: a group's ranks adjoin
    shape, names = env.mesh_shape, dp
    if env.tensor_parallel > 1:
        shape, names = (*shape, env.tensor_parallel), (*dp, "tp")
    mesh = dp_mesh = init_device_mesh(env.kind, shape, mesh_dim_names=names)
    if env.tensor_parallel > 1:
        split_blocks(model, mesh["tp"])
        dp_mesh = mesh[dp]
    compile_blocks = resolve_compile(cfg.compile, env.device, env.dtype)
    if compile_blocks:
        for block in model.transformer.h:
            block.forward = torch.compile(block.forward)  # FSDP's hooks stay outside the graph
        model.head_loss = torch.compile(model.head_loss)  # ln_f, the head and the chunked loss, in the root unit
    low = None if env.dtype == "float32" else DTYPES[env.dtype]
    policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
    if env.fsdp:
        for block in model.transformer.h:
            fully_shard(block, mesh=dp_mesh, mp_policy=policy)
        fully_shard(model, mesh=dp_mesh, mp_policy=policy)
    elif not next(model.parameters()).is_meta:  # tensor parallelism alone: whole weights to the device (a model on
        model.to(env.device)  # meta stays there: materialised below, or the dry run's, to_empty'd on fake tensors)
    if "deferred_init" in model.__dict__:  # built on meta: this rank's shards only, initialised as one process would
        materialise(model, env)
    return model


class RecordInit(torch.overrides.TorchFunctionMode):
    """While a model is built on the meta device: every in-place call on one of its parameters (nn.init.normal_,
    kaiming_uniform_, Tensor.zero_, ...), in order, to be replayed on real tensors by materialise()."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = kwargs.get("tensor", args[0] if args else None)  # nn.init passes it by keyword
        name = getattr(func, "__name__", "")
        if isinstance(target, nn.Parameter) and name.endswith("_") and not name.startswith("__"):
            self.calls.append((target, func, args, kwargs))
        return func(*args, **kwargs)


def build_on_meta(config, replay=True):
    """GPT(config) with its parameters on the meta device (no memory), carrying what materialise() needs to give
    it exactly the weights GPT(config) would have drawn here: the RNG state and every init call, in order.
    replay=False (a sharded checkpoint will overwrite every weight): materialise() only allocates."""
    if not replay:
        with torch.device("meta"):
            model = GPT(config)
        model.deferred_init = None
        return model
    rng = torch.get_rng_state()
    with torch.device("meta"), RecordInit() as record:
        model = GPT(config)
    # a tensor no longer in the model (wte's own weight, before tying) maps to None: its draws are replayed for the
    # RNG stream and dropped
    names = {id(p): n for n, p in model.named_parameters()}
    model.deferred_init = (rng, [(names.get(id(t)), t.shape, f, a, k) for t, f, a, k in record.calls])
    return model


def materialise(model, env):
    """Allocate a model built by build_on_meta() on `device` (a sharded one: only this rank's shards) and initialise
    it as GPT() would have from the same RNG state: each init call is replayed on a whole CPU tensor, one parameter
    at a time, and each rank keeps its slice (a pipeline stage: its own parameters, whole). Host memory: the shards
    plus the largest parameter. Afterwards the RNG is where GPT() would have left it; the rotary tables are
    recomputed. Built with replay=False: the shards are only allocated (a checkpoint's weights and RNG states come
    next), the RNG untouched."""
    rng, calls = model.__dict__.pop("deferred_init") or (None, [])
    model.to_empty(device=env.device)
    if model.config.tie_embeddings:  # to_empty gives each module its own tensor (FSDP keeps the tie, DTensor not)
        model.lm_head.weight = model.transformer.wte.weight
    params = dict(model.named_parameters(remove_duplicate=False))  # a pipeline stage's only
    if rng is not None:
        torch.set_rng_state(rng)
    with torch.no_grad():
        for name, shape, func, args, kwargs in calls:
            whole = torch.empty(shape)
            if "tensor" in kwargs:
                func(*args, **{**kwargs, "tensor": whole})
            else:
                func(whole, *args[1:], **kwargs)
            if name in params:
                param = params[name]
                local_part(param).copy_(part_of(name, whole, param, env))
            del whole  # before the next one is allocated: one whole parameter at a time
        if model.config.rotary_pct is not None:
            for buffer, table in zip(
                (model.rope_cos, model.rope_sin),
                rotary_cos_sin(model.config.rot_dim, model.config.block_size, model.config.rotary_base),
            ):
                buffer.copy_(table)


def local_part(tensor):
    """What this rank holds of `tensor`: a DTensor's local shard, a plain (replicated) tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def part_of(name, whole, param, env):
    """This rank's part of `whole`, the values of parameter `name` in GPT-2's layout, as `param` holds it: FSDP's
    shard (local_slice), a tensor-parallel DTensor's slice (with FSDP's of it; tensor_parallel.model_rows), or a
    plain (replicated) parameter whole."""
    if not isinstance(param, DTensor):
        return whole
    if env.tensor_parallel == 1:  # the mesh is (replicate, shard) or (shard,), ranks laid out row-major
        return local_slice(whole, env.mesh_shape[-1], env.rank % env.mesh_shape[-1])
    placements = param.placements
    return distribute_tensor(
        model_rows(name, whole, param), param.device_mesh, placements, src_data_rank=None
    ).to_local()


def local_slice(whole, shards, index):
    """Shard `index` of `whole` split over `shards` ranks as FSDP2 splits a parameter: torch.chunk along dim 0
    (trailing ranks of a short dim 0 get nothing)."""
    chunks = whole.chunk(shards)
    return chunks[index] if index < len(chunks) else whole[:0]


def is_compiled(model):
    """Whether parallelize() kept torch.compile: of the whole model (DDP, one process) or of each block (FSDP)."""
    return hasattr(model, "_orig_mod") or any("forward" in vars(m) for m in model.modules())


def keeps_grads(model):
    """Whether model's gradients are DDP's bucket views (gradient_as_bucket_view): zero them in place, never
    set them to None, or the next step's no-sync micro-steps allocate a second copy beside the buckets."""
    return hasattr(getattr(model, "_orig_mod", model), "require_backward_grad_sync")


@contextmanager
def gathered(raw_model):
    """The bare GPT with whole parameters, for code that uses it outside its forward (HellaSwag's scoring,
    generation). An unsharded model passes through. A sharded one: every rank must enter (each unit's
    all-gather is a collective) and then holds a plain GPT over the gathered tensors, with no FSDP hooks, to
    run any number of forwards alone; on exit the whole parameters are freed. Costs the whole model per rank
    for the duration: 2 bytes/param in bf16 runs, 4 in fp32. A tensor-parallel model's split weights are gathered
    over its group (tensor_parallel.whole). A pipeline stage: whole_pipeline's copy."""
    if hasattr(raw_model, "pipeline_group"):
        yield whole_pipeline(raw_model)
        return
    units = [m for m in raw_model.modules() if hasattr(m, "unshard")]  # the FSDP units (fully_shard adds it)
    if not units and not any(isinstance(p, DTensor) for p in raw_model.parameters()):
        yield raw_model
        return
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


def whole_pipeline(raw_model):
    """A whole GPT, on every rank of raw_model's pipeline (a stage: pipeline.build sets its pipeline_group),
    from the stages' parameters: each stage's rank broadcasts its own. Every rank of the pipeline must call it."""
    group = raw_model.pipeline_group
    stages, config = dist.get_world_size(group), raw_model.config
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
