"""Pipeline parallelism (pipeline_parallel > 1) on torch.distributed.pipelining: the GPT's blocks split into stages
over ranks, the step's rows per data-parallel rank cut into micro-batches that a schedule (1F1B or GPipe) runs
through the stages. train.py calls build() where env.pipeline > 1: it cuts the stage, then wraps it as every model
is (parallel.parallelize); the loop then runs each step through Pipeline.train_step (step.forward_backward) and
validation through Pipeline's forward. A stage runs GPT's own forward (models/common/decoder.py in torchtitan).

Each rank builds only its stage (keep_stage: the whole GPT on the meta device or the CPU, the rest set None), with
the parameters' global names, so a checkpoint (DCP, every rank its stage's tensors) loads at any layout. The split is
torchtitan's: blocks as even as the division allows (the first stages take the remainder), the embeddings in the
first stage, ln_f, the output head and the loss in the last; with tensor_parallel > 1 the stage's blocks are split
over its tensor-parallel group (tensor_parallel.split_blocks on the mesh's "tp" dim: each rank sends and receives
the whole activation to and from its peer of the same tp rank); the data-parallel ranks replicate each stage and
average its gradients (their local parts) after the schedule (average_gradients).
The gradient is the one a single process computes: each micro-batch's mean loss is weighted by its share of the
step's trained tokens (as step.micro_batches weights them), and the schedule does not rescale (scale_grads=False).
"""

import torch
import torch.distributed as dist
import torch.nn as nn

from gpt2train.console import log
from gpt2train.devices import autocast, resolve_compile
from gpt2train.layout import microbatches, stage_blocks
from gpt2train.meta_init import local_part
from gpt2train.parallel import parallelize
from gpt2train.step import to_device


def keep_stage(model, stage, stages):
    """model (a GPT on the meta device or the CPU) cut down in place to pipeline stage `stage` of `stages`, as
    torchtitan cuts its decoder: its blocks in a ModuleDict under their own indices, so every parameter keeps its
    global name (transformer.h.7.attn.c_attn.weight); the embeddings in the first stage; ln_f and the output head in
    the last; what the stage does not hold is None, and GPT.forward runs what it holds. The rotary tables stay on
    every stage. Returns the model."""
    t = model.transformer
    t.h = nn.ModuleDict({str(i): t.h[i] for i in stage_blocks(model.config.n_layer, stages, stage)})
    if stage > 0:
        for name in ("wte", "wpe", "drop"):
            if name in t:
                t[name] = None
        if model.config.smear:
            model.smear_gate = model.smear_lambda = None
    if stage < stages - 1:
        t.ln_f = model.lm_head = None
    return model


class Stage(nn.Module):
    """What the schedule runs of a stage: its GPT's forward, on the last stage its loss alone (the schedule's loss_fn
    weights it; GPT.forward gives (None, loss)); the first stage's input is the tokens (B, T), the others' the previous
    stage's output (B, T, C)."""

    def __init__(self, gpt, last):
        super().__init__()
        self.gpt, self.last = gpt, last

    def forward(self, x, targets=None):
        out = self.gpt(x, targets, return_logits=False)
        return out[1] if self.last else out


def build(model, cfg, env):
    """The Pipeline of this rank's stage of model (the bare GPT, whole, on the meta device or the CPU): cut down here
    in place (keep_stage, so the caller's raw model is the stage's), then through parallel.parallelize as every
    model is (the tensor-parallel split, on the device, built on meta: initialised as one process would), scheduled."""
    if resolve_compile(cfg.compile, env.device, env.dtype):
        log("torch.compile is not applied to pipeline stages yet: training eagerly", note=True)
    parallelize(keep_stage(model, env.stage, env.pipeline), cfg, env)
    return Pipeline(Stage(model, env.stage == env.pipeline - 1), cfg, env)


class Pipeline(nn.Module):
    """What the loop calls in a pipeline run: train_step() runs a step's micro-batches through the schedule (1F1B or
    GPipe, cfg.pipeline_schedule); a call (idx, targets) is validation's forward, the mean loss on every rank of the
    pipeline."""

    def __init__(self, module, cfg, env):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        super().__init__()
        self.module, self.env = module, env  # module: the Stage
        self.first, self.last = env.stage == 0, env.stage == env.pipeline - 1
        self.pp_group, self.dp_group = env.pp_group, env.mesh["dp_replicate"].get_group()
        self.pieces = microbatches(cfg, env.dp_size)[0]  # the schedule's micro-batches per step
        self.scale = None  # the step's dp_size / trained tokens of all data-parallel ranks (train_step)
        stage = PipelineStage(module, env.stage, env.pipeline, torch.device(env.device), group=self.pp_group)
        schedule = {"1F1B": Schedule1F1B, "GPipe": ScheduleGPipe}[cfg.pipeline_schedule]
        # each micro-batch's loss comes weighted (weighted): the schedule must not divide by their number
        self.schedule = schedule(stage, n_microbatches=self.pieces, loss_fn=self.weighted, scale_grads=False)

    def weighted(self, loss, targets):
        """The schedule's loss_fn: one micro-batch's mean loss weighted by its share of the step's trained tokens (x
        the data-parallel size, over which average_gradients averages), so the summed gradients are those of the
        step's mean, as step.micro_batches gives them."""
        return loss * (targets != -1).sum() * self.scale

    def train_step(self, loader, rows, env):
        """One optimizer step's gradients: `rows` sequences per data-parallel rank, read loader.B at a time (every
        stage of the pipeline reads the same ones), cut into the schedule's micro-batches. Returns what
        step.micro_batches returns: (the step's loss, the same number on every rank once train.py averages it over
        all ranks; a float32 device tensor [trained tokens of all data-parallel ranks, micro-batches with no trained
        target])."""
        x, y = (torch.cat(t) for t in zip(*(loader.next_batch() for _ in range(rows // loader.B))))  # (rows, T)
        masked = getattr(loader, "masked", False)
        trained = int((y != -1).sum()) if masked else y.numel()
        empty = sum(int((part != -1).sum()) == 0 for part in y.chunk(self.pieces)) if masked else 0
        stats = to_device((torch.tensor([trained, empty], dtype=torch.float32),), env.device)[0]
        if masked and env.dp_size > 1:
            dist.all_reduce(stats, group=self.dp_group)
        else:
            stats[0] *= env.dp_size  # every data-parallel rank trains as many tokens
        self.scale = env.dp_size / stats[0].clamp(min=1)
        x, y = to_device((x, y), env.device)
        losses = []
        with autocast(env.device, env.dtype):
            if self.first:
                self.schedule.step(x)
            elif self.last:
                self.schedule.step(targets=y, target=y, losses=losses, return_outputs=False)
            else:
                self.schedule.step()
        if env.dp_size > 1:
            self.average_gradients()
        loss = torch.stack(losses).sum().detach().float() if losses else torch.zeros((), device=env.device)
        # train.py sums every rank's loss and divides by world_size; only the last stage holds one
        return loss * env.pipeline, stats

    @torch.no_grad()
    def average_gradients(self):
        """The stage's gradients averaged over the data-parallel ranks that replicate it, in one all-reduce of a flat
        buffer once the schedule has run (DDP's reducer cannot follow a schedule's micro-batch backwards)."""
        grads = [local_part(p.grad) for p in self.module.parameters() if p.grad is not None]  # a rank's split part
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.dp_group)  # SUM: gloo has no AVG
        flat /= self.env.dp_size
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))

    @torch.no_grad()
    def forward(self, idx, targets, return_logits=False):
        """Validation: (None, the mean loss of targets (B, T) given tokens idx (B, T)) on every rank of the pipeline,
        the stages run one after the other (each sends its output to the next)."""
        env = self.env
        x = idx
        if not self.first:
            x = torch.empty(*idx.shape, self.module.gpt.config.n_embd, device=env.device)
            dist.recv(x, src=dist.get_global_rank(self.pp_group, env.stage - 1))
        out = self.module(x, targets) if self.last else self.module(x)
        if not self.last:
            dist.send(out.float().contiguous(), dst=dist.get_global_rank(self.pp_group, env.stage + 1))
        loss = out.float() if self.last else torch.zeros((), device=env.device)
        dist.broadcast(loss, src=dist.get_global_rank(self.pp_group, env.pipeline - 1), group=self.pp_group)
        return None, loss
