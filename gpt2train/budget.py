"""How many optimizer steps a run trains: the Budget owns max_steps, which the loop, the schedule and every
checkpoint read from it (the config is never rewritten mid-run).

max_steps is the config's, or under max_seconds (a wall-clock budget for training; evaluation and checkpoints
excluded) fixed once so that the schedule's decay fits the budget. A fresh run times its steps SKIPPED+1 .. FIXED_AT
(the first ones are torch.compile's and the caches' warm-up: not timed, but spent from the budget), then fixes
max_steps = the steps done + as many as the rest of the budget holds at their mean time (FIXED_AT at least). A
checkpoint written sooner (a signal, a short save_interval) first fixes it from the steps done so far: every
checkpoint of the run holds its fixed max_steps, and a resumed run continues on it, never re-timed, exactly as the
uninterrupted run would (train.get_lr starts the decay after FIXED_AT either way).
"""

from dataclasses import replace

import torch
import torch.distributed as dist

from gpt2train.config import ConfigError, batch_layout
from gpt2train.console import log


class Budget:
    """max_steps of a run (cfg: its config; env: parallel.Env). fixed: already known (no max_seconds, or a resume,
    whose checkpoint's config holds the fixed count). on_fix(max_steps) is called once, when a budget fixes it."""

    SKIPPED = 2
    FIXED_AT = 10  # steps 3-10 timed

    def __init__(self, cfg, env, fixed, on_fix=None):
        self.max_steps, self.max_seconds, self.env, self.on_fix = cfg.max_steps, cfg.max_seconds, env, on_fix
        self.seconds = []  # of each step so far, until fixed
        self.fixed = fixed or not cfg.max_seconds
        if not self.fixed:
            log(
                f"max_seconds={cfg.max_seconds:g}: max_steps is fixed after step {self.FIXED_AT}, from the steps' times"
            )

    def add(self, seconds):
        """Count one step's seconds; fix max_steps when enough steps are timed. Returns whether it did now."""
        if self.fixed:
            return False
        self.seconds.append(seconds)
        return len(self.seconds) >= self.FIXED_AT and self.fix()

    def fix(self):
        """Fix max_steps from the steps done (at least one), now, if not fixed yet; returns whether it did now. Every
        rank calls it alike."""
        if self.fixed:
            return False
        done, spent = len(self.seconds), sum(self.seconds)
        timed = self.seconds[self.SKIPPED :] or self.seconds  # fewer steps done: their mean, warm-up included
        per_step = sum(timed) / len(timed)
        # at least FIXED_AT: never the step a save fixes it at, and the same floor wherever it was fixed
        steps = max(self.FIXED_AT, done + int((self.max_seconds - spent) / per_step))
        if self.env.distributed:  # each rank timed its own steps: rank 0's count is the run's
            agreed = torch.tensor(steps, device=self.env.device)
            dist.broadcast(agreed, 0)
            steps = int(agreed)
        self.max_steps, self.fixed = steps, True
        log(
            f"max_seconds={self.max_seconds:g}: the first {done} steps took {spent:.1f} s, steps "
            f"{done - len(timed) + 1}-{done} {per_step * 1000:,.0f} ms each: max_steps fixed at {steps}"
        )
        if self.on_fix:
            self.on_fix(steps)
        return True


def horizon_steps(cfg, flops_per_token, params, tokens_per_step):
    """max_steps that cfg's target_flops (training FLOPs: flops_per_token x tokens, MFU's count) or tokens_per_param
    (tokens = this x params, the non-lookup count) sets, to the nearest step; None where neither is set. A horizon
    under one step is a ConfigError."""
    if cfg.target_flops is not None:
        per_step, total = flops_per_token * tokens_per_step, cfg.target_flops
        what = f"target_flops={cfg.target_flops:g}"
        unit = f"FLOPs ({tokens_per_step:,} tokens x {flops_per_token:,.0f} FLOPs per token)"
    elif cfg.tokens_per_param is not None:
        per_step, total = tokens_per_step, cfg.tokens_per_param * params
        what, unit = f"tokens_per_param={cfg.tokens_per_param:g} ({total:,.0f} tokens for {params:,} params)", "tokens"
    else:
        return None
    if total < per_step:
        raise ConfigError(f"{what} is less than one step: one step is {per_step:,.0f} {unit}")
    return round(total / per_step)


def with_horizon(cfg, model, world_size):
    """cfg with max_steps from its target_flops or tokens_per_param (horizon_steps) for the GPT `model` (its FLOPs per
    token and non-lookup params; the meta device will do) at world_size's tokens per step; cfg itself if unset."""
    steps = horizon_steps(
        cfg, model.flops_per_token(), model.num_params(non_embedding=True), batch_layout(cfg, world_size)[0]
    )
    return cfg if steps is None else replace(cfg, max_steps=steps)


def planned_run(args, out_dir):
    """What a train.py run of `args` (its arguments, as one process) will train, without training it: {n (non-lookup
    params), params, params_lookup, flops_per_token, steps, tokens, flops}, from the config train.py resolves (the
    data's vocab_size included; out_dir: where the run would write, which must hold no checkpoint) and the model
    on the meta device. A budget in seconds (max_seconds) has no step count yet: a ConfigError."""
    from gpt2train.config import model_config, parse_args
    from gpt2train.start import resolve_config
    from model import GPT

    cfg, _ = resolve_config({**parse_args(args), "out_dir": str(out_dir)}, verify=False)
    if cfg.max_seconds is not None:
        raise ConfigError(f"max_seconds={cfg.max_seconds:g} fixes its steps from their timing: give steps or FLOPs")
    if cfg.batch_size == "auto":  # total_batch_size is set (TrainConfig checks): the tokens per step
        cfg = replace(cfg, batch_size=cfg.total_batch_size // cfg.block_size)
    with torch.device("meta"):
        model = GPT(model_config(cfg))
    cfg = with_horizon(cfg, model, 1)
    tokens = cfg.max_steps * batch_layout(cfg, 1)[0]
    total, n = model.num_params(), model.num_params(non_embedding=True)
    return {
        "n": n,
        "params": total,
        "params_lookup": total - n,
        "flops_per_token": model.flops_per_token(),
        "steps": cfg.max_steps,
        "tokens": tokens,
        "flops": tokens * model.flops_per_token(),
    }
