"""The dry run: `python dryrun.py CONFIG [--key=value ...] --world_size=N [--gpus_per_node=8]
[--device_memory_gib=80]` prints memory.py's plan beside a simulation of one optimizer step of the config at world
size N: the project's own model, sharding, optimizer and step on fake tensors and a fake process group, measured by
torch's memory trackers (docs/dry-run.md). No parameter memory is allocated: any size runs on a laptop.
"""

import sys
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.testing._internal.distributed.fake_pg import FakeStore

from gpt2train import pipeline
from gpt2train.config import ConfigError, batch_layout, make_config, model_config, parse_args
from gpt2train.devices import autocast
from gpt2train.files import report_error
from gpt2train.headroom import MARGIN, GiB, gib, with_margin, within_margin
from gpt2train.layout import Env, check_pipeline, data_parallel_size, mesh_shape, microbatches, stage_blocks
from gpt2train.memory import MemoryPlan, choose_checkpointing, estimate_memory, stage_plan
from gpt2train.optim import build_optimizer
from gpt2train.parallel import parallelize, rank_ranges
from gpt2train.step import clip_gradients, micro_batches
from model import GPT

NOT_SIMULATED = (
    "not simulated: torch.compile, CUDA kernels' workspaces, NCCL's buffers and the caching allocator's "
    "fragmentation (leave headroom for them)"
)
GPU_DTYPE = "bfloat16"  # dtype='auto' on a GPU with native bf16 (devices.resolve_dtype): what the dry run assumes


class DDPBuckets(torch.nn.Module):
    """DDP as the dry run models it (its C++ reducer cannot run on fake tensors): one flat fp32 buffer whose views
    are the gradients (gradient_as_bucket_view=True, kept across steps: parallel.keeps_grads); the all-reduce is
    in place, so it costs no more memory. step.set_grad_sync sets its require_backward_grad_sync as DDP's."""

    def __init__(self, module):
        super().__init__()
        self.module, self.require_backward_grad_sync = module, True
        params = [p for p in module.parameters() if p.requires_grad]
        self.buckets = torch.zeros(sum(p.numel() for p in params))
        for p, view in zip(params, self.buckets.split([p.numel() for p in params])):
            p.grad = view.view_as(p)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


@dataclass
class DryRun:
    """The simulated peak of one rank, in bytes, by the plan's parts; notes say what was modelled or skipped."""

    parts: dict
    notes: list

    @property
    def total(self) -> int:
        return sum(self.parts.values())


def _categories(snapshot) -> dict:
    """A MemTracker peak snapshot (category name -> bytes) as the plan's parts."""
    by_name = {str(getattr(k, "value", k)): v for k, v in snapshot.items()}
    get = lambda *names: sum(by_name.get(n, 0) for n in names)  # noqa: E731
    return {
        "params": get("Parameter", "Sharded Param", "Buffer"),
        "grads": get("Gradient", "Sharded Grad", "Other"),
        "optimizer": get("Optstate", "OptState"),
        "gathered": get("Unsharded Param", "Unsharded Grad", "All Gather", "Reduce Scatter"),
        "activations": get("Activation", "Temp", "Inputs"),
    }


def dry_run(cfg, world_size: int, gpus_per_node: int = 8) -> DryRun:
    """Simulate one optimizer step of rank 0 of `world_size` for TrainConfig cfg (an int batch_size) on fake
    tensors and the fake process group: the project's own model (built on meta, materialised fake), parallelize
    (FSDP/HSDP sharding on a CPU mesh), optimizer, step.micro_batches (with cfg's autocast dtype, 'auto' as a bf16
    GPU, activation checkpointing and the chunked loss), clip and update, tracked by torch's MemTracker /
    FSDPMemTracker. The simulated step is a steady one: the optimizer state exists (made by a first update on
    zero gradients). Micro-steps that start from the memory state micro-step 2 started from (checked) have its
    peak and are not re-run, but the last. No parameter memory is allocated: any size runs on a laptop."""
    if cfg.batch_size == "auto":
        raise ValueError("the dry run needs batch_size set (it simulates a given micro-batch), not 'auto'")
    cfg = replace(cfg, compile=False, dtype=GPU_DTYPE if cfg.dtype == "auto" else cfg.dtype)
    parallel, tp = cfg.parallel, cfg.tensor_parallel
    mesh = mesh_shape(
        parallel, cfg.shard_size, data_parallel_size(world_size, tp), node_ranks(gpus_per_node, world_size, tp), tp
    )
    env = Env(0, 0, world_size, True, "cpu", cfg.dtype, parallel, mesh, tensor_parallel=tp)
    grad_accum = batch_layout(cfg, env.dp_size)[1]
    ddp = not env.sharded and world_size > 1  # (tensor parallelism without FSDP: its own collectives)
    notes = []
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        with torch.device("meta"):
            raw = GPT(model_config(cfg))
        model = parallelize(raw, cfg, env) if env.sharded else raw  # the mesh is made outside FakeTensorMode
        x = torch.zeros(cfg.batch_size, cfg.block_size, dtype=torch.long)  # a real batch, as the loader's
        with FakeTensorMode(allow_non_fake_inputs=True):
            raw.to_empty(device="cpu")
            if cfg.tie_embeddings and not env.fsdp:  # to_empty gives each module its own tensor (FSDP keeps ties)
                raw.transformer.wte.weight = raw.lm_head.weight
            if ddp:
                model = DDPBuckets(raw)
                notes.append(
                    "DDP modelled, not run (its C++ reducer cannot run on fake tensors): gradients are views "
                    "of one fp32 bucket buffer, all-reduced in place"
                )
            optimizer = build_optimizer(raw, cfg, fused=True)  # as on a GPU
            # a first update, untracked, on zero gradients: it makes the optimizer state, and fills DTensor's
            # sharding cache (its propagation runs global-shape ops in this fake mode, which a tracker would count)
            for p in raw.parameters():
                p.grad = torch.zeros_like(p) if p.grad is None else p.grad
            clip_gradients(raw, cfg.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=not ddp)
            inner = [optimizer.muon, optimizer.adamw] if hasattr(optimizer, "muon") else [optimizer]
            if env.fsdp:
                tracker = FSDPMemTracker(model, optimizer)
            else:
                tracker = MemTracker()
                tracker.track_external(model, *inner, *([model.buckets] if ddp else []))

            class Batches:  # what micro_batches reads; each micro-step is a new iteration for the tracker
                def next_batch(self):
                    tracker.reset_mod_stats()
                    return x, x

            scaler = torch.amp.GradScaler("cpu", enabled=False)
            with tracker:
                starts, skipped = [], []  # the memory state each micro-step started from
                for micro in range(grad_accum):
                    starts.append(_categories(tracker.get_tracker_snapshot()[torch.device("cpu")]))
                    if 1 < micro < grad_accum - 1 and starts[-1] == starts[1]:  # as micro-step 2 began: its peak
                        skipped.append(micro)
                        continue
                    micro_batches(model, Batches(), grad_accum, scaler, env, micro_steps=[micro])
                clip_gradients(raw, cfg.grad_clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=not ddp)
            if parallel == "hsdp" and grad_accum > 1:
                notes.append(
                    "HSDP: until the last micro-step's all-reduce across replicas, the gradient shards add "
                    "up in FSDP's partial-reduce buffer, counted under temporaries"
                )
            if skipped:
                notes.append(
                    f"micro-steps {skipped[0] + 1}-{skipped[-1] + 1} of {grad_accum} start from the memory "
                    "state micro-step 2 started from: the same peak, not re-run"
                )
        return DryRun(_categories(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]), notes)
    finally:
        dist.destroy_process_group()


def dry_run_stage(cfg, world_size: int, stage: int) -> DryRun:
    """Simulate one optimizer step of a rank of pipeline stage `stage` (cfg.pipeline_parallel stages, each replicated
    over the data-parallel ranks) on fake tensors: the stage's own modules (pipeline.keep_stage), through
    parallel.parallelize as pipeline.build does (its blocks split over cfg.tensor_parallel ranks: the fake process
    group's "tp" mesh dim), its
    optimizer, the forwards of the micro-batches its schedule keeps in flight (1F1B: stages - stage, GPipe: all),
    then their backwards (the stage's input a fake activation, its output's gradient fake ones), clip and update,
    tracked by torch's MemTracker. The sends and receives between stages and the replicas' all-reduce are not
    simulated (the tensor-parallel all-reduces run on the fake process group)."""
    stages, tp = cfg.pipeline_parallel, cfg.tensor_parallel
    dp = world_size // (stages * tp)
    pieces, rows = microbatches(cfg, dp)
    in_flight = pieces if cfg.pipeline_schedule == "GPipe" else min(pieces, stages - stage)
    mesh = mesh_shape("ddp", None, dp, dp, tp)
    env = Env(stage * dp * tp, 0, world_size, True, "cpu", cfg.dtype, "ddp", mesh, stages, tp)  # a rank of the stage
    with torch.device("meta"):
        raw = pipeline.keep_stage(GPT(model_config(cfg)), stage, stages)
    if tp > 1:  # the mesh (env.mesh) is made outside FakeTensorMode; the blocks split on meta, materialised fake below
        dist.init_process_group("fake", store=FakeStore(), rank=env.rank, world_size=world_size)
    try:
        parallelize(raw, cfg, env)
        return DryRun(_simulate_stage(raw, cfg, (stage, in_flight, rows)), [])
    finally:
        if tp > 1:
            dist.destroy_process_group()


def _simulate_stage(raw, cfg, where):
    """The peak parts of dry_run_stage's step of the stage raw (a stage's GPT on meta) at where (stage, micro-batches
    in flight, rows per micro-batch)."""
    (stage, in_flight, rows), stages = where, cfg.pipeline_parallel
    module = pipeline.Stage(raw, stage == stages - 1)
    tokens = torch.zeros(rows, cfg.block_size, dtype=torch.long)  # a real batch, as the loader's
    with FakeTensorMode(allow_non_fake_inputs=True):
        raw.to_empty(device="cpu")
        optimizer = build_optimizer(raw, cfg, fused=True)  # as on a GPU
        for p in raw.parameters():  # a first update, untracked, makes the optimizer state (and DTensor's caches)
            p.grad = torch.zeros_like(p)
        clip_gradients(raw, cfg.grad_clip)
        optimizer.step()
        # the gradients stay: from a schedule's first backward on they are resident while its forwards run
        optimizer.zero_grad(set_to_none=False)
        tracker = MemTracker()
        tracker.track_external(module, optimizer)
        with tracker:
            outputs = []
            for _ in range(in_flight):
                x = tokens if stage == 0 else torch.zeros(rows, cfg.block_size, cfg.n_embd, requires_grad=True)
                tracker.reset_mod_stats()  # its per-module stats take one forward each; the peak is the step's
                with autocast("cpu", cfg.dtype):
                    outputs.append(module(x, tokens) if stage == stages - 1 else module(x))
            for out in outputs:
                out.backward(None if out.dim() == 0 else torch.ones_like(out))
                del out
            outputs.clear()
            clip_gradients(raw, cfg.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return _categories(tracker.get_tracker_snapshot("peak")[torch.device("cpu")])


def report_pipeline(cfg, world_size: int):
    """(the heaviest stage's plan, its simulation, the printed table: plan and simulation of every stage) of a
    pipeline config (cfg.pipeline_parallel > 1, a checked layout) at world_size."""
    stages, tp = cfg.pipeline_parallel, cfg.tensor_parallel
    dp = world_size // (stages * tp)
    pieces, rows = microbatches(cfg, dp)
    args = {**plan_args(cfg, world_size), "pipeline": (stages, cfg.pipeline_schedule, pieces)}
    kwargs = {"dtype": args["dtype"], "activation_checkpointing": None, "seq_len": None, "tensor_parallel": tp}
    plans = [stage_plan(model_config(cfg), rows, s, args["pipeline"], kwargs) for s in range(stages)]
    sims = [dry_run_stage(replace(cfg, dtype=args["dtype"]), world_size, s) for s in range(stages)]
    head = (
        f"dry run: {stages} pipeline stages ({cfg.pipeline_schedule}) x {dp} data-parallel replicas"
        + (f" x tensor_parallel {tp}" if tp > 1 else "")
        + f" = {world_size} "
        f"ranks, {args['dtype']}, {pieces} micro-batches of {rows} x {cfg.block_size} per step"
        + CHECKPOINTING[cfg.activation_checkpointing]
        + ": a rank of every stage simulated on fake tensors"
    )
    names = "".join(f"{f'stage {s}':>20}" for s in range(stages))
    lines = [head, f"  {'GiB per rank':<26}{names}", f"  {'':<26}" + f"{'plan':>10}{'simulated':>10}" * stages]
    for k, name in PARTS.items():
        planned = [getattr(p, k) + (p.logits if k == "activations" else 0) for p in plans]
        cells = "".join(f"{a / GiB:>10.2f}{sim.parts[k] / GiB:>10.2f}" for a, sim in zip(planned, sims))
        lines.append(f"  {name:<26}{cells}")
    lines.append(
        f"  {'peak':<26}" + "".join(f"{p.total / GiB:>10.2f}{m.total / GiB:>10.2f}" for p, m in zip(plans, sims))
    )
    blocks = [rank_ranges(stage_blocks(cfg.n_layer, stages, s)) for s in range(stages)]  # '0-10'
    lines.append("note: blocks per stage " + ", ".join(blocks) + "; the embeddings in stage 0, ln_f and the head last")
    lines.append("note: " + NOT_SIMULATED + "; nor the stages' sends and receives, nor the replicas' all-reduce")
    heaviest = max(range(stages), key=lambda s: sims[s].total)
    return plans[heaviest], sims[heaviest], "\n".join([plans[heaviest].line(), *lines])


PARTS = {
    "params": "parameters",
    "grads": "gradients",
    "optimizer": "optimizer state",
    "gathered": "all-gathered units (FSDP)",
    "activations": "activations + temporaries",
}


def node_ranks(gpus_per_node: int, world_size: int, tensor_parallel: int) -> int:
    """The data-parallel ranks of one node (HSDP's default shard group): its GPUs over the tensor-parallel ones."""
    return max(1, min(gpus_per_node, world_size) // tensor_parallel)


def plan_args(cfg, world_size: int, gpus_per_node: int = 8) -> dict:
    """estimate_memory's arguments besides the model and micro-batch, on a GPU (dtype 'auto' as bf16)."""
    tp, stages = cfg.tensor_parallel, cfg.pipeline_parallel
    dp = data_parallel_size(world_size, tp * stages)
    mesh = mesh_shape(cfg.parallel, cfg.shard_size, dp, node_ranks(gpus_per_node, world_size, tp), tp)
    return {
        "dtype": GPU_DTYPE if cfg.dtype == "auto" else cfg.dtype,
        "parallel": cfg.parallel,
        "world_size": world_size,
        "optimizer": cfg.optimizer,
        "shard_size": mesh[-1] if cfg.parallel != "ddp" else None,
        "pipeline": (stages, cfg.pipeline_schedule, microbatches(cfg, dp)[0]) if stages > 1 else None,
        "tensor_parallel": tp,
    }


def resolve_checkpointing(cfg, world_size: int, gpus_per_node: int = 8, device_memory_gib: float = 80.0):
    """(cfg with activation_checkpointing='auto' chosen as train.py chooses it on a GPU with device_memory_gib free,
    the line saying why, or None when cfg set it)."""
    if cfg.activation_checkpointing != "auto":
        return cfg, None
    mode, why = choose_checkpointing(
        model_config(cfg),
        cfg.batch_size,
        within_margin(int(device_memory_gib * GiB)),
        **plan_args(cfg, world_size, gpus_per_node),
    )
    return replace(cfg, activation_checkpointing=mode), why


def dry_run_plan(cfg, world_size: int, gpus_per_node: int = 8, device_memory_gib: float = 80.0) -> MemoryPlan:
    """The memory plan of TrainConfig cfg at world_size, on a GPU (dtype 'auto' as bf16), as the dry run sees it."""
    cfg, _ = resolve_checkpointing(cfg, world_size, gpus_per_node, device_memory_gib)
    dp = world_size // (cfg.pipeline_parallel * cfg.tensor_parallel)
    micro = microbatches(cfg, dp)[1] if cfg.pipeline_parallel > 1 else cfg.batch_size
    return estimate_memory(model_config(cfg), micro, **plan_args(cfg, world_size, gpus_per_node))


CHECKPOINTING = {
    True: ", activation checkpointing",
    "selective": ", activation checkpointing of every other block",
    False: "",
}


def report(cfg, world_size: int, gpus_per_node: int = 8, device_memory_gib: float = 80.0):
    """(plan, dry run, the printed comparison) of TrainConfig cfg at world_size; activation_checkpointing='auto' is
    chosen first, as on a GPU with device_memory_gib free."""
    cfg, why = resolve_checkpointing(cfg, world_size, gpus_per_node, device_memory_gib)
    if cfg.pipeline_parallel > 1:
        plan, sim, text = report_pipeline(cfg, world_size)
        return plan, sim, "\n".join([*([why] if why else []), text])
    dtype = GPU_DTYPE if cfg.dtype == "auto" else cfg.dtype
    plan = dry_run_plan(cfg, world_size, gpus_per_node)
    sim = dry_run(cfg, world_size, gpus_per_node)
    planned = {**{k: getattr(plan, k) for k in PARTS}, "activations": plan.activations + plan.logits}
    tp = cfg.tensor_parallel
    mode = cfg.parallel + (
        f" (shard_size {cfg.shard_size or node_ranks(gpus_per_node, world_size, tp)})" if cfg.parallel == "hsdp" else ""
    )
    mode += f" x tensor_parallel {tp}" if tp > 1 else ""
    rows = [
        f"dry run: rank 0 of {world_size}, {mode}, {dtype}, micro-batch {cfg.batch_size} x "
        f"{batch_layout(cfg, world_size // tp)[1]} accumulation steps"
        + CHECKPOINTING[cfg.activation_checkpointing]
        + ": one optimizer step simulated on fake tensors",
        f"  {'GiB per rank':<28}{'plan':>8}{'simulated':>11}",
    ]
    rows += [f"  {name:<28}{planned[k] / GiB:>8.2f}{sim.parts[k] / GiB:>11.2f}" for k, name in PARTS.items()]
    ratio = plan.total / sim.total
    rows += [f"  {'peak':<28}{plan.total / GiB:>8.2f}{sim.total / GiB:>11.2f}  (plan/simulated {ratio:.2f})"]
    rows += [
        f"  {'+ margin (x 1.05 + 1.5 GiB)':<28}{with_margin(plan.total) / GiB:>8.2f}"
        f"{with_margin(sim.total) / GiB:>11.2f}"
    ]
    notes = [*([why] if why else []), plan.line(), *rows, *[f"note: {n}" for n in sim.notes], f"note: {NOT_SIMULATED}"]
    return plan, sim, "\n".join(notes)


DRY_RUN_FLAGS = {"world_size": int, "gpus_per_node": int, "device_memory_gib": float}  # not config keys
# a plan over this many times the device memory cannot fit (the simulation has stayed within 15% of the plan on every
# shipped config): refused from the plan, not simulated (an absurd config's simulation takes minutes)
NOT_SIMULATED_ABOVE = 1.5


def main(argv=None) -> int:
    """python dryrun.py CONFIG [--key=value ...] --world_size=N [--gpus_per_node=8] [--device_memory_gib=80]:
    the memory plan and the dry run side by side; exit 1 if the simulated peak with the margin exceeds
    device_memory_gib, 2 on a bad config or flag."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        print(
            "usage: dryrun.py CONFIG [--key=value ...] --world_size=N [--gpus_per_node=8] [--device_memory_gib=80]\n\n"
            f"{__doc__.strip()}\n\nCONFIG and --key=value are train.py's: `python train.py --help` lists every key."
        )
        return 0
    flags = {"gpus_per_node": 8, "device_memory_gib": 80.0}
    try:
        rest = []
        for arg in argv:
            key, eq, value = arg[2:].partition("=")
            if not (arg.startswith("--") and eq and key in DRY_RUN_FLAGS):
                rest.append(arg)
                continue
            try:
                flags[key] = DRY_RUN_FLAGS[key](value)
            except ValueError:
                raise ConfigError(f"{arg}: expected {DRY_RUN_FLAGS[key].__name__}") from None
        if flags.get("world_size", 0) < 1 or flags["gpus_per_node"] < 1:
            raise ConfigError("dryrun.py needs --world_size=N (N >= 1; and --gpus_per_node >= 1)")
        if not 0 < flags["device_memory_gib"] < float("inf"):  # nan fails this too
            raise ConfigError(f"--device_memory_gib={flags['device_memory_gib']}: expected a number of GiB > 0")
        cfg = make_config(parse_args(rest))
        if cfg.pipeline_parallel > 1:
            check_pipeline(cfg, flags["world_size"])
        if cfg.batch_size == "auto":
            raise ConfigError("the dry run needs batch_size set (it simulates a given micro-batch), not 'auto'")
        plan = dry_run_plan(cfg, flags["world_size"], flags["gpus_per_node"])
        if plan.total > NOT_SIMULATED_ABOVE * flags["device_memory_gib"] * GiB:
            print(
                f"{plan.line()}\ndoes NOT fit: the plan alone is {gib(plan.total)} GiB per rank, over "
                f"{NOT_SIMULATED_ABOVE:g} x {flags['device_memory_gib']:g} GiB per device: not simulated (to "
                f"simulate it anyway, give a larger --device_memory_gib)"
            )
            return 1
        _, sim, text = report(cfg, flags["world_size"], flags["gpus_per_node"], flags["device_memory_gib"])
    except (ConfigError, ValueError) as e:
        report_error("dryrun.py", e)
        return 2
    print(text)
    fits = with_margin(sim.total) <= flags["device_memory_gib"] * GiB
    print(
        f"{'fits' if fits else 'does NOT fit'}: simulated peak {gib(sim.total)} GiB, with the margin ({MARGIN}) "
        f"{gib(with_margin(sim.total))} GiB {'<=' if fits else '>'} {flags['device_memory_gib']:g} GiB per device"
    )
    return 0 if fits else 1


if __name__ == "__main__":
    raise SystemExit(main())
