"""The run's parallel layout, the one record every caller reads (torchtitan's ParallelDims): Env, where this process
runs and how torchrun's ranks are laid out (the degrees, this rank's coordinates, the one DeviceMesh of named dims,
the step's tokens and rows per rank), and the one-line refusals of a layout that cannot run (arrange), before any
process group exists. "Which parallelism is on?" is asked of Env (env.pipeline > 1, env.sharded), never of the model.

The mesh's dims are torchtitan's, row-major, each where the layout has it: "pp" outermost (ranks 0 .. world_size /
stages - 1 hold stage 0), the data-parallel dims ("dp_replicate", "dp_shard"), "tp" innermost (a group's ranks
adjoin, as in a node). Every stage of a pipeline and every rank of a tensor-parallel group reads the same rows (the
loader's rank and world size are the data-parallel ones): total_batch_size keeps its meaning.
"""

from dataclasses import dataclass, field, replace

from gpt2train.config import ConfigError, batch_layout
from gpt2train.console import log
from gpt2train.devices import device_type


@dataclass
class Env:
    """Where this process runs (its rank among torchrun's processes, its device and precision) and the run's layout."""

    rank: int
    local_rank: int
    world_size: int
    distributed: bool  # launched by torchrun (even with one process)
    device: str
    dtype: str  # resolved: 'float32', 'bfloat16' or 'float16'
    parallel: str = "ddp"  # in effect: 'fsdp'/'hsdp' only under torchrun ('ddp' also for one plain process)
    # the data-parallel dims of a sharded run: (dp,) for 'fsdp', (replica groups, shard_size) for 'hsdp'; with
    # tensor parallelism 'ddp' is (dp, 1): replicas of one shard (tensor_parallel.py says why)
    mesh_shape: tuple = ()
    pipeline: int = 1  # pipeline stages: each rank holds the blocks of one (stage_blocks)
    tensor_parallel: int = 1  # in effect: 1 outside torchrun
    tokens_per_step: int | None = None  # of all ranks, once the config is final (with_batch)
    rows: int | None = None  # sequences per data-parallel rank per step (batch_size x accumulation steps)
    _mesh: object = field(default=None, repr=False, compare=False)  # Env.mesh, once built (kept by replace())

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
        a tensor-parallel run (parallel.shard); never a pipeline stage (its replicas average by hand)."""
        return self.pipeline == 1 and (self.parallel != "ddp" or self.tensor_parallel > 1 and self.dp_size > 1)

    @property
    def dp_size(self):
        """Data-parallel ranks: the ranks reading distinct rows."""
        return self.world_size // (self.pipeline * self.tensor_parallel)

    @property
    def dp_rank(self):
        """This rank's place among the data-parallel ranks (the mesh's row-major order)."""
        return self.rank // self.tensor_parallel % self.dp_size

    @property
    def tp_rank(self):
        return self.rank % self.tensor_parallel

    @property
    def stage(self):
        """This rank's pipeline stage (pipeline outermost)."""
        return self.rank // (self.dp_size * self.tensor_parallel)

    @property
    def kind(self):
        return device_type(self.device)

    @property
    def dp_dims(self):
        """The mesh's data-parallel dims: those of mesh_shape, or a pipeline's replicas ("dp_replicate",)."""
        return ("dp_replicate", "dp_shard")[-len(self.mesh_shape) :] if self.mesh_shape else ("dp_replicate",)

    @property
    def mesh(self):
        """The run's DeviceMesh (build_mesh), built on first use and kept: every caller slices this one."""
        if self._mesh is None:
            self._mesh = self.build_mesh()
        return self._mesh

    def build_mesh(self):
        """A DeviceMesh of the layout's named dims ("pp", the data-parallel dims, "tp"; each where the layout has it)
        over the process group's ranks."""
        from torch.distributed.device_mesh import init_device_mesh

        dims = [("pp", self.pipeline)] if self.pipeline > 1 else []
        dims += zip(self.dp_dims, self.mesh_shape or (self.dp_size,))
        dims += [("tp", self.tensor_parallel)] if self.tensor_parallel > 1 else []
        names, shape = zip(*dims)
        return init_device_mesh(self.kind, shape, mesh_dim_names=names)

    @property
    def pp_group(self):
        """The process group of this rank's pipeline (its stages), None without one."""
        return self.mesh["pp"].get_group() if self.pipeline > 1 else None

    def with_batch(self, cfg):
        """This Env with the step's tokens (of all ranks) and rows per data-parallel rank, for cfg once it is final."""
        tokens, accumulation = batch_layout(cfg, self.dp_size)
        return replace(self, tokens_per_step=tokens, rows=cfg.batch_size * accumulation)


# ----------------------------------------------------------------------------- the degrees, and refusals


def arrange(cfg, distributed, world_size, local_world_size, dtype, device):
    """(parallel, mesh_shape, pipeline, tensor_parallel) in effect for cfg on torchrun's world_size ranks
    (local_world_size of them on a node); outside torchrun one process trains the whole model (a note names what is
    ignored). A layout that cannot run is a ConfigError of one line, before any process group exists."""
    asked = {"parallel": cfg.parallel != "ddp", "tensor_parallel": cfg.tensor_parallel > 1}
    asked["pipeline_parallel"] = cfg.pipeline_parallel > 1
    split = " and ".join(f"{key}={getattr(cfg, key)!r}" for key, on in asked.items() if on)
    if split and not distributed:
        log(f"{split} ignored: not launched by torchrun, this one process trains the whole model", note=True)
    if not split or not distributed:
        return "ddp", (), 1, 1
    if dtype == "float16":  # GradScaler's inf check would see only this rank's gradient shard or stage
        raise ConfigError(
            f"{split} trains in bfloat16 or float32, not float16 (dtype={cfg.dtype!r} "
            f"resolved to float16 on {device}): set --dtype=float32 or a bf16 device"
        )
    stages, tp = cfg.pipeline_parallel, cfg.tensor_parallel
    if stages > 1:
        check_pipeline(cfg, world_size)
    dp = data_parallel_size(world_size, tp * stages)
    mesh = mesh_shape(cfg.parallel, cfg.shard_size, dp, max(1, local_world_size // tp), tp)
    return cfg.parallel, mesh, stages, tp


def data_parallel_size(world_size, split):
    """world_size / split (the ranks one model is split over: pipeline x tensor), the ranks that read different
    rows; a tensor_parallel that does not divide the world is a ConfigError."""
    if world_size % split:
        raise ConfigError(
            f"tensor_parallel={split} must divide the world size {world_size} (groups of "
            f"tensor_parallel ranks split each block; the groups are the data-parallel ranks)"
        )
    return world_size // split


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


# one line each: what the model has that a split into stages cannot carry yet, and what to set instead
UNSPLITTABLE = {
    "tie_embeddings": "a head tied to the embedding (wte in the first stage is lm_head in the last): "
    "set tie_embeddings=False (an untied head, as GPT-NeoX)",
    "value_embeds": "value_embeds, a table every block reads: set value_embeds=False",
    "bigram_embeds": "bigram_embeds, a table every block reads: set bigram_embeds=0",
}


def check_pipeline(cfg, world_size):
    """ConfigError (one line saying what to change) unless cfg's pipeline_parallel stages can train on world_size
    ranks: stages dividing the world size, no more stages than blocks, nothing shared across stages, a data-parallel
    mode, optimizer and batch the pipeline supports, and at least as many pipeline micro-batches as stages, each a
    whole number of rows (microbatches). Tensor parallelism splits each stage's blocks (its divisibility of the
    heads is TrainConfig's check)."""
    stages, tp = cfg.pipeline_parallel, cfg.tensor_parallel
    what = f"pipeline_parallel={stages}"
    if world_size % (stages * tp):
        split = f" x tensor_parallel={tp}" if tp > 1 else ""
        raise ConfigError(
            f"{what}{split} does not divide the world size {world_size}: launch a multiple of {stages * tp} ranks, "
            f"or set pipeline_parallel{' x tensor_parallel' if tp > 1 else ''} to a divisor of {world_size}"
        )
    if stages > cfg.n_layer:
        raise ConfigError(
            f"{what} is more stages than the model's {cfg.n_layer} blocks: set pipeline_parallel <= n_layer"
        )
    for key, why in UNSPLITTABLE.items():
        if getattr(cfg, key):
            raise ConfigError(f"{what} cannot split {why}, or pipeline_parallel=1")
    refusals = {
        "parallel": (cfg.parallel != "ddp", "replicates each stage over the data-parallel ranks: set parallel='ddp'"),
        "optimizer": (cfg.optimizer != "adamw", "trains with AdamW: set optimizer='adamw'"),
        "embedding_lr": (cfg.embedding_lr is not None, "has one learning rate so far: leave embedding_lr None"),
        "head_lr": (cfg.head_lr is not None, "has one learning rate so far: leave head_lr None"),
        "batch_size": (cfg.batch_size == "auto", "needs a fixed micro-batch: set batch_size to a number"),
    }
    for key, (refused, fix) in refusals.items():
        if refused:
            raise ConfigError(f"{what} {fix} (not {key}={getattr(cfg, key)!r}), or pipeline_parallel=1")
    microbatches(cfg, world_size // (stages * tp))


def microbatches(cfg, dp_size):
    """(pieces, rows per piece): the step's rows per data-parallel rank (batch_size x accumulation steps) cut into
    pipeline_microbatches pieces; by default one per accumulation step (each piece a micro-batch of batch_size rows,
    as without a pipeline), and at least as many as the stages (the schedule keeps every stage busy only then)."""
    rows = cfg.batch_size * batch_layout(cfg, dp_size)[1]
    stages = cfg.pipeline_parallel
    pieces = cfg.pipeline_microbatches or max(stages, rows // cfg.batch_size)
    if pieces < stages:
        raise ConfigError(
            f"pipeline_microbatches={pieces} is fewer than the {stages} stages: set pipeline_microbatches >= "
            f"pipeline_parallel"
        )
    if rows % pieces:
        raise ConfigError(
            f"pipeline_microbatches={pieces} does not divide the step's {rows} rows per data-parallel rank "
            f"(batch_size {cfg.batch_size} x {rows // cfg.batch_size} accumulation steps): set pipeline_microbatches "
            f"to a divisor of {rows}, or total_batch_size to a multiple of {pieces} x block_size x {dp_size}"
        )
    return pieces, rows // pieces


def stage_blocks(n_layer, stages, stage):
    """The blocks of pipeline stage `stage` of `stages`: n_layer // stages each, the first n_layer % stages stages
    one more."""
    size, extra = divmod(n_layer, stages)
    start = stage * size + min(stage, extra)
    return range(start, start + size + (stage < extra))


def stage_of(name, n_layer, stages):
    """The pipeline stage that holds the GPT's parameter `name`: a block's by stage_blocks, ln_f and the output head
    the last, the embeddings the first."""
    if name.startswith("transformer.h."):
        block = int(name.split(".")[2])
        return next(s for s in range(stages) if block in stage_blocks(n_layer, stages, s))
    return stages - 1 if name.startswith(("transformer.ln_f.", "lm_head.")) else 0
