"""Restoring a run where its checkpoint left it, and saving the checkpoints a run resumes from: train.py's side of
checkpoints. restore() and restore_rngs() put a run back (optimizer, weights of a sharded checkpoint, loss scaler,
loader position, RNGs); Checkpointer.save() writes one with everything an exact resume needs, the run's tokenizer
and its budget's max_steps included. The run's state crosses into and out of a checkpoint here in GPT-2's layout,
whatever layout the run holds it in (tensor_parallel's adapter, as torchtitan's checkpointer calls its state-dict
adapter). What a run starts from is start.py's; the files themselves are checkpoint.py's and sharded.py's.
"""

from dataclasses import asdict, dataclass

import torch.distributed as dist

from gpt2train import tensor_parallel
from gpt2train.checkpoint import FORMAT, checkpoint_path, list_checkpoints, prune_checkpoints, save_checkpoint
from gpt2train.config import ConfigError
from gpt2train.console import log
from gpt2train.devices import rng_state, set_rng_state
from gpt2train.files import Halt
from gpt2train.parallel import weights_finite
from gpt2train.sharded import load_sharded_checkpoint, save_sharded_checkpoint


@dataclass
class Progress:
    """What the loop carries from step to step and a checkpoint carries across a restart."""

    step: int = 0
    best_step: int | None = None
    best_val: float | None = None
    skipped_in_a_row: int = 0


def restore(ckpt, raw_model, optimizer, scaler, loader, env):
    """Optimizer (and from a sharded checkpoint the weights, resharded to this run's layout: env), loss scaler and
    loader position from a checkpoint; returns the Progress it recorded. Every rank calls it. The optimizer's
    kernel (fused, foreach) stays this run's: a fused checkpoint resumes where fused AdamW cannot run (tensor
    parallelism mixes plain tensors and DTensors: optim.adamw)."""
    kernels = [{k: group[k] for k in ("fused", "foreach") if k in group} for group in optimizer.param_groups]
    if "shards" in ckpt:
        load_sharded_checkpoint(ckpt["shards"], raw_model, optimizer, adapter=tensor_parallel)
    elif env.pipeline > 1:  # this rank holds a stage; the state is the whole model's
        raise ConfigError(
            f"init_from=resume: {ckpt['path']} is a single-file checkpoint, which pipeline stages cannot resume yet: "
            f"resume it with --pipeline_parallel=1, or train a pipeline on from its weights with "
            f"--init_from={ckpt['path']} (a fresh optimizer)"
        )
    else:
        try:
            load_optimizer_state(raw_model, optimizer, ckpt["optimizer"])
        except ValueError as e:  # a saved state this optimizer cannot take (optim.Muon's says why)
            raise ConfigError(f"init_from=resume: {e}") from None
    for group, kernel in zip(optimizer.param_groups, kernels):
        group.update(kernel)
    if ckpt["scaler"] is not None:
        scaler.load_state_dict(ckpt["scaler"])
    try:
        loader.load_state_dict(ckpt["loader"])
    except ValueError as e:
        saved = ckpt["config"]
        raise ConfigError(
            f"cannot resume: {e}; the checkpoint's run used data_dir={saved.get('data_dir')!r} and "
            f"seed={saved.get('seed')}"
        ) from None
    return Progress(ckpt["step"], ckpt.get("best_step"), ckpt.get("best_val_loss"))


def load_optimizer_state(model, optimizer, state):
    """A single-file checkpoint's optimizer state (optimizer.state_dict(): whole tensors keyed by parameter
    index) into `optimizer`; if `model` is FSDP-sharded each rank keeps its slice of every tensor."""
    if not any(hasattr(p, "full_tensor") for p in model.parameters()):  # no DTensor: not sharded
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    name_of = {p: name for name, p in model.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]  # index -> parameter
    names = [name_of[p] for p in params]
    by_name = {  # a tensor-parallel c_attn's moments in the row order it holds (tensor_parallel.model_rows)
        "state": {
            names[i]: {k: tensor_parallel.model_rows(names[i], t, params[i]) for k, t in v.items()}
            for i, v in state["state"].items()
        },
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]],
    }
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))


def restore_rngs(ckpt, env):
    """Last, after everything that draws random numbers during setup: each rank's RNGs as they were."""
    if len(ckpt["rng"]) == env.world_size:
        set_rng_state(ckpt["rng"][env.rank])
    else:
        log(
            f"checkpoint has RNG states of {len(ckpt['rng'])} ranks, this run has {env.world_size}; "
            "dropout masks will differ from an uninterrupted run",
            note=True,
        )


def resume_hint(out_dir):
    """What a halted run leaves to resume from, for the end of its error message."""
    found = list_checkpoints(out_dir)
    if not found:
        return "no checkpoint was written yet"
    return f"the last checkpoint, {found[-1][1]}, is kept (continue with --init_from=resume)"


class Checkpointer:
    """Writes the run's checkpoints, built once in train.run() (torchtitan's CheckpointManager). states: what a
    checkpoint holds the state of: {'model': the bare GPT, 'optimizer', 'scaler', 'loader': the train loader,
    'tracker'}. tokenizer: the run's bpe.tokenizer_record (its tokenizer.json text, a str, goes along: a checkpoint
    moved to another machine still samples); None is GPT-2's. budget: the run's budget.Budget, whose max_steps every
    checkpoint's config holds."""

    def __init__(self, cfg, env, states, tokenizer, budget):
        self.cfg, self.env, self.states, self.tokenizer, self.budget = cfg, env, states, tokenizer, budget

    def save(self, progress, val=None):
        """Write a checkpoint holding everything an exact resume needs at progress.step (val: the val loss there,
        which keeps the best checkpoint), then prune old ones: ckpt_{step}.pt from rank 0, or in a sharded run the
        directory ckpt_{step}/ to which every rank writes its own shards. A budget not fixed yet (a signal, a short
        save_interval) is fixed first, from the steps so far. Every rank calls it."""
        env, raw_model, loader = self.env, self.states["model"], self.states["loader"]
        self.budget.fix()
        rngs = [rng_state()]
        if env.distributed:  # every rank's dropout RNG, so a resumed DDP run draws the same masks
            rngs = [None] * env.world_size
            dist.all_gather_object(rngs, rng_state())
        if not (env.master or env.sharded):
            return
        step = progress.step
        if not weights_finite(raw_model, env):
            raise Halt(f"step {step}: the weights hold NaN/inf; not writing them")
        if val is not None and (progress.best_val is None or val < progress.best_val):
            progress.best_step, progress.best_val = step, val
        scaler, optimizer = self.states["scaler"], self.states["optimizer"]
        meta = {
            "model_args": asdict(raw_model.config),
            # the live micro-batch: an out-of-memory may have halved it
            "config": {**asdict(self.cfg), "batch_size": loader.B, "max_steps": self.budget.max_steps},
            "step": step,
            "scaler": scaler.state_dict() if scaler.is_enabled() else None,
            "loader": loader.state_dict(),
            "rng": rngs,
            "val_loss": val,
            "best_step": progress.best_step,
            "best_val_loss": progress.best_val,
            "tracker": self.states["tracker"].state_dict(),
            "format": FORMAT,
            "tokenizer": self.tokenizer,
        }
        path = checkpoint_path(self.cfg.out_dir, step, sharded=env.sharded)
        if env.sharded:
            save_sharded_checkpoint(path, meta, raw_model, optimizer, adapter=tensor_parallel, stage=env.pipeline > 1)
        else:
            save_checkpoint(path, {**meta, "model": raw_model.state_dict(), "optimizer": optimizer.state_dict()})
        if env.master:
            prune_checkpoints(self.cfg.out_dir, self.cfg.keep_last, keep_steps={progress.best_step})
            log(f"step {step}: saved {path}")
