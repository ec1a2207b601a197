"""How torchrun's ranks are laid out when the model is split into pipeline stages (pipeline_parallel > 1), and the
one-line refusal of a layout that cannot run, before any process group exists (torchtitan's ParallelDims).

The ranks form one DeviceMesh of named dims ("pp", "dp_replicate", "dp_shard", "tp"), row-major as torchtitan
lays them out: pipeline outermost, so ranks 0 .. world_size/stages - 1 hold stage 0. The data-parallel size is
world_size / (pipeline x tensor); every stage of one pipeline reads the same rows (the loader's rank and world size
are the data-parallel ones), total_batch_size keeps its meaning. Tensor parallelism ("tp") splits each stage's blocks
over the group's ranks, innermost (a group's ranks adjoin, as in a node).
"""

from gpt2train.config import ConfigError, batch_layout

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


def device_mesh(env):
    """The run's DeviceMesh: dims ("pp", "dp_replicate", "dp_shard", "tp"), sizes (stages, data-parallel ranks, 1,
    tensor-parallel ranks): the data-parallel ranks replicate each stage (parallel='ddp'), a tensor-parallel group
    splits its blocks."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = (env.pipeline, env.dp_size, 1, env.tensor_parallel)
    return init_device_mesh(env.kind, shape, mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"))


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
