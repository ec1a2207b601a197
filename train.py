"""Train a GPT-2 style model, from Tiny Shakespeare on a laptop CPU to GPT-2 1.5B on GPU nodes.

    python train.py configs/shakespeare_cpu.py                        # the CPU demo
    python train.py configs/shakespeare_cpu.py --max_steps=50 --out_dir=out/quick
    torchrun --standalone --nproc_per_node=8 train.py configs/gpt2_124m.py
    torchrun --standalone --nproc_per_node=8 train.py configs/gpt3_2p7b.py --parallel=fsdp   # sharded
    python train.py configs/shakespeare_cpu.py --init_from=resume --max_steps=800   # continue a run
    python train.py --help                                              # every key, its default

A config file is plain Python assignments to TrainConfig keys (config.py); `--key=value` overrides are
Python literals (strings may be written bare) and win over the file. train() at the bottom locks out_dir
and calls run(), the recipe: config, setup, data, model, optimizer, parallelize, then the loop; each step of
it is a function above. Expected errors are one line on stderr (main(); see README "Failure modes").
"""
import contextlib
import json
import math
import os
import random
import signal
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from checkpoint import (FORMAT, CheckpointError, checkpoint_path, clean_state_dict, list_checkpoints,
                        load_latest_checkpoint, load_optimizer_state, load_sharded_checkpoint, prune_checkpoints,
                        rng_state, save_checkpoint, save_sharded_checkpoint, set_rng_state)
from config import ARCH_KEYS, ConfigError, help_text, make_config, model_config, config_table, parse_args
from data import DataLoader, NoShardsError, ShardError
from devices import (autocast, device_type, fused_adamw_supported, is_oom, peak_flops, resolve_device,
                     resolve_dtype, tune_cpu_allocator)
from files import LockError, atomic_write, directory_lock
from memory import (MemoryPlanError, available_memory, check_fits, divisors, estimate_memory, maybe_fake_oom,
                    plan_micro_batch, probe_micro_batch, rows_per_rank, smaller_micro_batch)
from model import GPT, PRESETS
from parallel import (Env, clip_gradients, gathered, is_compiled, keeps_grads, mesh_shape, parallelize,
                      set_grad_sync, weights_finite)
from tracking import TRACKING_KEYS, Tracker, TrackingError, check_tracking_available


class Halt(Exception):
    """Stop the run with exit code 1 (nonfinite='halt', too many skipped steps, non-finite weights)."""


class StopRequest:
    """SIGTERM/SIGINT handler: remember the signal; the loop checkpoints after the current step and
    exits 0. A second Ctrl-C quits at once."""

    def __init__(self):
        self.signal = None

    def __call__(self, signum, frame):
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal = signum
        print(f"\nreceived {signal.Signals(signum).name}: saving a checkpoint after this step, then exiting",
              file=sys.stderr, flush=True)


@dataclass
class Progress:
    """What the loop carries from step to step and a checkpoint carries across a restart."""
    step: int = 0
    best_step: int | None = None
    best_val: float | None = None
    skipped_in_a_row: int = 0


# ----------------------------------------------------------------------------- setup

def is_rank0():
    """Rank 0 of torchrun's processes, or a plain `python train.py`; usable before the process group exists."""
    return os.environ.get("RANK", "0") == "0"


def note0(message):
    """A note on stderr from rank 0 only (the other ranks see the same things)."""
    if is_rank0():
        print(f"note: {message}", file=sys.stderr, flush=True)


def lock_out_dir(out_dir):
    """One run per out_dir: rank 0 holds an exclusive lock on it (files.directory_lock) for the whole run;
    a second run there is a one-line error naming the holder. The other ranks of a torchrun job don't lock."""
    if not is_rank0():
        return contextlib.nullcontext()
    return directory_lock(out_dir, "train.py")


def resolve_config(user):
    """(TrainConfig, checkpoint dict or None). On init_from='resume' the newest checkpoint that verifies is
    loaded (a note names each newer one skipped, and why); its config is the base the user's keys override;
    the architecture cannot change."""
    cfg = make_config(user)
    if cfg.init_from != "resume":
        if list_checkpoints(cfg.out_dir):
            raise ConfigError(f"{cfg.out_dir} already holds checkpoints; continue with --init_from=resume, "
                              f"or pick another out_dir (or delete them) to start over")
        return cfg, None
    if not list_checkpoints(cfg.out_dir):
        raise ConfigError(f"init_from='resume' but {cfg.out_dir} holds no checkpoint (ckpt_XXXXXX.pt or ckpt_XXXXXX/)")
    # a sharded checkpoint: its meta only; each rank reads its own shards later
    ckpt, path = load_latest_checkpoint(cfg.out_dir, consolidate=False, note=note0)
    # the run stays in the out_dir it found the checkpoint in (the checkpoint's own may be another, if moved)
    cfg = make_config({**user, "out_dir": cfg.out_dir}, base=ckpt["config"])
    if cfg.optimizer != ckpt["config"].get("optimizer", "adamw"):  # the saved state is the other optimizer's
        raise ConfigError(f"cannot change optimizer when resuming: the checkpoint {path} has "
                          f"{ckpt['config'].get('optimizer', 'adamw')!r}, the config {cfg.optimizer!r}")
    saved = model_config(cfg, **ckpt["model_args"])  # fields added since the checkpoint get their defaults
    for key in ARCH_KEYS:
        if getattr(cfg, key) != getattr(saved, key):
            raise ConfigError(f"cannot change {key} when resuming: the checkpoint {path} has "
                              f"{getattr(saved, key)!r}, the config {getattr(cfg, key)!r}")
    return cfg, ckpt


def launched_by_torchrun():
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def resolve_config_or_defer(user):
    """(cfg, checkpoint or None, error message or None): resolve_config, except that under torchrun its error is
    returned rather than raised. A rank that failed before joining the process group (a node that cannot see
    out_dir's checkpoints) would leave the others waiting in the rendezvous until it times out; instead every
    rank joins and check_shared_out_dir raises the error on all of them."""
    try:
        return (*resolve_config(user), None)
    except (ConfigError, CheckpointError) as e:
        if not launched_by_torchrun():
            raise
        return make_config(user), None, str(e)  # a bad key fails here alike on every rank: nobody waits


def check_shared_out_dir(out_dir, resumed_step, problem, env):
    """The rule for torchrun runs: out_dir is one directory every rank sees (storage shared by all nodes), since
    rank 0 alone writes the checkpoints that every rank reads on resume. Rank 0 writes a marker file there and
    each rank looks for it; then ranks compare what they resumed from and any error they deferred. Raises the
    same one-line ConfigError on every rank on a mismatch. Nothing to check outside torchrun."""
    if not env.distributed:
        return
    token = [f"{socket.gethostname()}.{os.getpid()}.{time.time_ns()}"]  # unique: two runs never mix markers
    dist.broadcast_object_list(token, src=0)
    marker = Path(out_dir) / f".out_dir_check.{token[0]}"
    if env.master:
        try:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(token[0])
        except OSError as e:
            problem = problem or f"cannot write to out_dir {out_dir}: {e.strerror}"
    dist.barrier()
    sees = False
    for _ in range(10):  # a shared filesystem may show a new file a moment late
        try:
            sees = marker.read_text() == token[0]
        except OSError:
            pass
        if sees or env.master:
            break
        time.sleep(0.5)
    ranks = [None] * env.world_size
    dist.all_gather_object(ranks, {"host": socket.gethostname(), "sees": sees, "problem": problem,
                                   "resumed_step": resumed_step})
    if env.master:
        marker.unlink(missing_ok=True)
    blind = [r for r, info in enumerate(ranks) if not info["sees"]]
    if blind and not ranks[0]["problem"]:
        hosts = sorted({ranks[r]["host"] for r in blind})
        raise ConfigError(f"out_dir {out_dir} must be storage shared by every node: rank(s) {span(blind)} on "
                          f"{', '.join(hosts)} do not see the file rank 0 ({ranks[0]['host']}) wrote there "
                          f"(node-local disk?); use a path on a shared filesystem")
    failed = [(r, info) for r, info in enumerate(ranks) if info["problem"]]
    if failed:
        r, info = failed[0]
        raise ConfigError(f"rank {r} ({info['host']}): {info['problem']}")
    resumed = sorted({str(info["resumed_step"]) for info in ranks})
    if len(resumed) > 1:
        raise ConfigError(f"ranks resumed from checkpoints of different steps ({', '.join(resumed)}) in out_dir "
                          f"{out_dir}: every node must see the same shared directory")


def span(ranks):
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
    rank, local_rank, world_size = (int(os.environ.get(k, d)) for k, d in
                                    (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", 1)))
    try:
        device = resolve_device(cfg.device)
    except ValueError as e:
        raise ConfigError(f"config key 'device': {e}") from None
    dtype = resolve_dtype(cfg.dtype, device)
    parallel, mesh = "ddp", ()
    if cfg.parallel != "ddp" and not distributed:
        print(f"note: parallel={cfg.parallel!r} ignored: not launched by torchrun, this one process trains the "
              "whole model", file=sys.stderr)
    elif cfg.parallel != "ddp":
        parallel = cfg.parallel
        mesh = mesh_shape(parallel, cfg.shard_size, world_size, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
        if dtype == "float16":  # GradScaler's inf check would see only this rank's gradient shard
            raise ConfigError(f"parallel={parallel!r} trains in bfloat16 or float32, not float16 (dtype={cfg.dtype!r} "
                              f"resolved to float16 on {device}): set --dtype=float32 or a bf16 device")
    if device_type(device) == "cuda":
        if distributed:
            device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)  # also for --device=cuda:N alone: memory stats, syncs and RNG follow it
        torch.backends.cuda.matmul.allow_tf32 = True  # TF32 matmuls: ~8x fp32 throughput on Ampere+
        torch.backends.cudnn.allow_tf32 = True
    if distributed:  # the timeout covers rank 0 writing a checkpoint while the others wait in the next collective
        dist.init_process_group(backend="nccl" if device_type(device) == "cuda" else "gloo",
                                timeout=timedelta(minutes=cfg.dist_timeout_minutes))
    tune_cpu_allocator(device)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    return Env(rank, local_rank, world_size, distributed, device, dtype, parallel, mesh)


def batch_layout(cfg, world_size):
    """(tokens per optimizer step, accumulation steps): total_batch_size split over ranks and micro-batches."""
    tokens_per_micro = cfg.batch_size * cfg.block_size * world_size
    total = cfg.total_batch_size or tokens_per_micro
    if total % tokens_per_micro:
        raise ConfigError(f"total_batch_size={total} is not a multiple of batch_size*block_size*world_size"
                          f" = {cfg.batch_size}*{cfg.block_size}*{world_size} = {tokens_per_micro}")
    return total, total // tokens_per_micro


# ----------------------------------------------------------------------------- memory: plan, auto micro-batch

PROBED_KINDS = ("cuda",)  # batch_size='auto' probes the real model on these devices; the others use the plan


def probes(env):
    """Whether batch_size='auto' probes (probe_batch_size) rather than plans: not for a sharded run, whose bare
    model is built on the CPU and would not fit one device whole."""
    return env.kind in PROBED_KINDS and not env.sharded


def planned_shape(cfg, ckpt):
    """The GPTConfig the model will have, known before it is built; None for a Hugging Face directory."""
    if ckpt is not None:
        return model_config(cfg, **{**ckpt["model_args"], "dropout": cfg.dropout,
                                    "activation_checkpointing": cfg.activation_checkpointing})
    if cfg.init_from == "scratch":
        return model_config(cfg)
    return model_config(cfg, **PRESETS[cfg.init_from]) if cfg.init_from in PRESETS else None


def plan_kwargs(cfg, env):
    """estimate_memory's arguments besides the model and the micro-batch."""
    return {"dtype": env.dtype, "parallel": env.parallel, "world_size": env.world_size, "shard_size": cfg.shard_size,
            "optimizer": cfg.optimizer}


def device_memory(env):
    """(bytes one rank may use, description): the device's available memory; on a CPU/MPS shared by this node's
    ranks, their share of it."""
    available, what = available_memory(env.device)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if env.kind != "cuda" else 1
    return (available // local, f"{what} / {local} ranks") if local > 1 else (available, what)


def check_memory(cfg, ckpt, env, log):
    """Before anything big is allocated: log the memory plan and the device's memory; refuse (ConfigError, one line
    naming settings that fit) a batch_size whose plan exceeds it; resolve batch_size='auto' from the plan on devices
    that are not probed (probes()). Returns cfg with batch_size resolved, or still 'auto' (probe_batch_size)."""
    shape = planned_shape(cfg, ckpt)
    auto = cfg.batch_size == "auto"
    if auto:  # sequences per rank per optimizer step; total_batch_size is checked before anything is built
        try:
            rows = rows_per_rank(cfg.total_batch_size, cfg.block_size, env.world_size)
        except ValueError as e:
            raise ConfigError(f"batch_size='auto': {e}") from None
    else:
        rows = cfg.batch_size * batch_layout(cfg, env.world_size)[1]
    if shape is None:
        if auto and not probes(env):
            raise ConfigError(f"batch_size='auto' cannot plan init_from={cfg.init_from!r} before loading it; set batch_size")
        return cfg
    available, what = device_memory(env)
    if auto and not probes(env):
        try:
            b, why = plan_micro_batch(shape, rows, available, description=what, **plan_kwargs(cfg, env))
        except MemoryPlanError as e:
            raise ConfigError(str(e)) from None
        log(f"batch_size='auto': {why}")
        cfg = replace(cfg, batch_size=b)
    plan = estimate_memory(shape, 1 if cfg.batch_size == "auto" else cfg.batch_size, **plan_kwargs(cfg, env))
    log(plan.line() + (" [micro-batch 1; batch_size='auto' probes the rest]" if cfg.batch_size == "auto" else ""))
    log(f"available memory: {what}")
    if cfg.memory_check and not auto and plan.total > available:
        msg = check_fits(shape, cfg.batch_size, available, what, rows, **plan_kwargs(cfg, env))
        raise ConfigError(f"{msg} (memory_check=False skips this check)")
    return cfg


def probe_batch_size(raw_model, cfg, env, log, loaders):
    """batch_size='auto' on a probed device: the largest divisor of the per-rank rows that runs one forward+
    backward of the bare model (memory.probe_micro_batch; all ranks agree), leaving its RNGs and gradients as
    they were. Returns cfg with the resolved batch_size; the loaders take it too."""
    rows = rows_per_rank(cfg.total_batch_size, cfg.block_size, env.world_size)
    plan = estimate_memory(raw_model.config, 1, **plan_kwargs(cfg, env))
    rngs = rng_state()

    def try_step(b):
        x = torch.randint(0, cfg.vocab_size, (b, cfg.block_size), device=env.device)  # (b, T)
        try:
            with autocast(env.device, env.dtype):
                raw_model(x, x, return_logits=False)[1].backward()
        finally:
            raw_model.zero_grad(set_to_none=True)

    try:
        b, why = probe_micro_batch(try_step, divisors(rows), reserve_bytes=plan.optimizer + plan.ddp_buckets,
                                   device=env.device)
    except MemoryPlanError as e:
        raise ConfigError(str(e)) from None
    set_rng_state(rngs)
    log(f"batch_size='auto': {why} ({rows // b} accumulation steps)")
    return set_micro_batch(cfg, b, loaders)


def set_micro_batch(cfg, b, loaders):
    """cfg with batch_size=b (what checkpoints record), and the loaders reading b sequences per micro-batch: the
    global sample stream is unchanged (data.DataLoader counts positions in samples)."""
    for loader in loaders:
        if loader is not None:
            loader.B = b
    return replace(cfg, batch_size=b)


def fitting_forward_backward(model, loader, grad_accum, scaler, optimizer, cfg, env, log, step):
    """forward_backward, and on an out-of-memory: halve the micro-batch (the largest divisor of the per-rank rows at
    most half), drop the partial step's gradients, rewind the loader to the step's start and re-run the same step
    with the same data. Returns (loss sum, cfg, grad_accum), the latter two as changed. Under torchrun, or at
    micro-batch 1, an out-of-memory is a Halt naming settings that would help (ranks cannot switch safely:
    the others may be waiting in a gradient all-reduce)."""
    start = loader.state_dict()
    while True:
        try:
            return forward_backward(model, loader, grad_accum, scaler, env), cfg, grad_accum
        except Exception as e:  # noqa: BLE001 -- only out-of-memory is handled
            if not is_oom(e):
                raise
        b, rows = cfg.batch_size, cfg.batch_size * grad_accum
        smaller = smaller_micro_batch(rows, b)
        if env.distributed or smaller is None:
            hint = f"batch_size={smaller} with {rows // smaller} accumulation steps, " if smaller else ""
            raise Halt(f"step {step + 1}: out of memory at micro-batch {b}"
                       + (" under torchrun (ranks cannot change micro-batch together mid-run)" if smaller else "")
                       + f"; try {hint}activation_checkpointing=True, parallel='fsdp' or a smaller block_size")
        optimizer.zero_grad(set_to_none=True)  # the partial step's gradients; the scaler has not stepped yet
        free_memory(env)
        loader.load_state_dict(start)
        cfg, grad_accum = set_micro_batch(cfg, smaller, [loader]), rows // smaller
        log(f"step {step + 1}: out of memory at micro-batch {b}: re-running the step at micro-batch {smaller} x "
            f"{grad_accum} accumulation steps (batch_size={smaller} from now on)")


def free_memory(env):
    import gc
    gc.collect()
    if env.kind == "cuda":
        torch.cuda.empty_cache()


def make_loaders(cfg, env):
    """Train and val loaders: every rank reads its own slice of one global, world-size-invariant stream.
    Every shard is validated here, token ids included, before step 1."""
    def loader(split):  # batch_size='auto': 1 until probe_batch_size sets it
        return DataLoader(cfg.data_dir, split, 1 if cfg.batch_size == "auto" else cfg.batch_size, cfg.block_size, rank=env.rank,
                          world_size=env.world_size, seed=cfg.seed, vocab_size=cfg.vocab_size)
    try:
        return loader("train"), loader("val") if cfg.eval_interval > 0 else None
    except NoShardsError as e:
        from prepare_data import prepare_command
        raise NoShardsError(f"{e}; prepare it with `{prepare_command(cfg.data_dir)}`") from None


def build_model(cfg, ckpt, device):
    """(the bare GPT on device, cfg with the model's real shape) from a checkpoint, scratch or pretrained.
    A sharded checkpoint's weights are loaded later, by restore(), into the model as this run shards it."""
    training_only = {"dropout": cfg.dropout, "activation_checkpointing": cfg.activation_checkpointing}
    if ckpt is not None:
        model = GPT(model_config(cfg, **{**ckpt["model_args"], **training_only}))
        if "shards" not in ckpt:
            model.load_state_dict(clean_state_dict(ckpt["model"]))
    elif cfg.init_from == "scratch":
        model = GPT(model_config(cfg))
    else:
        try:
            model = GPT.from_pretrained(cfg.init_from, **training_only)
        except (ValueError, ImportError) as e:  # a broken model directory; a hub download's errors are OSErrors
            raise ConfigError(f"init_from={cfg.init_from!r}: {e}") from None
        cfg = make_config({**asdict(cfg), **{k: getattr(model.config, k) for k in ARCH_KEYS}})
    return model.to(device), cfg


class MuonAdamW:
    """torch.optim.Muon and torch.optim.AdamW stepped as one optimizer: param_groups lists Muon's groups, then
    AdamW's (the loop sets each group's lr), state_dict/load_state_dict hold both (exact resume), and GradScaler
    unscales and steps it like any optimizer."""

    def __init__(self, muon, adamw):
        self.muon, self.adamw = muon, adamw

    @property
    def param_groups(self):
        return self.muon.param_groups + self.adamw.param_groups

    def step(self):
        self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none=True):
        self.muon.zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)

    def state_dict(self):
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state):
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])


def hidden_matrices(model):
    """Names of the parameters Muon trains: the 2-D weight matrices inside the blocks (attention c_attn/c_proj,
    MLP c_fc/c_proj). Embeddings, the output head, biases and norms are not hidden matrices."""
    return [n for n, p in model.named_parameters()
            if p.requires_grad and p.dim() == 2 and n.startswith("transformer.h.")]


def build_optimizer(model, cfg, env):
    """AdamW for every parameter (optimizer='adamw'), or MuonAdamW: Muon for hidden_matrices(), AdamW for the
    rest, weight decay on its 2-D tensors (embeddings, an untied head) as configure_optimizer does."""
    fused = fused_adamw_supported(env.kind)
    if cfg.optimizer == "adamw":
        return model.configure_optimizer(cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2), fused=fused)
    hidden = set(hidden_matrices(model))
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}  # a tied head is wte, listed once
    # adjust_lr_fn='original' (Keller Jordan's Muon): the update is scaled by sqrt(max(1, rows/cols))
    muon = torch.optim.Muon([params[n] for n in hidden], lr=cfg.muon_lr, momentum=cfg.muon_momentum,
                            nesterov=True, weight_decay=cfg.muon_weight_decay, adjust_lr_fn="original")
    rest = [p for n, p in params.items() if n not in hidden]
    groups = [{"params": [p for p in rest if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}]
    adamw = torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2),
                              **({"fused": True} if fused else {"foreach": True}))
    return MuonAdamW(muon, adamw)


def set_lr(optimizer, lr, cfg):
    """Every group at the schedule's fraction lr / learning_rate of its own peak: learning_rate for AdamW's
    groups, muon_lr for Muon's."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    for group in optimizer.muon.param_groups if isinstance(optimizer, MuonAdamW) else []:
        group["lr"] = lr / cfg.learning_rate * cfg.muon_lr


# ----------------------------------------------------------------------------- the step

def get_lr(step, cfg):
    """Learning rate of optimizer step `step` (0-based): linear warmup, then cosine or WSD decay to min_lr."""
    decay_steps = cfg.lr_decay_steps or cfg.max_steps
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps
    if step >= decay_steps:
        return cfg.min_lr
    if cfg.lr_schedule == "cosine":
        progress = (step - cfg.warmup_steps) / max(1, decay_steps - cfg.warmup_steps)  # 0 -> 1
        return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (cfg.learning_rate - cfg.min_lr)
    decay_start = max(cfg.warmup_steps, decay_steps - round(cfg.wsd_decay_frac * decay_steps))
    if step < decay_start:  # WSD: constant until the final decay_frac of the schedule, then linear
        return cfg.learning_rate
    progress = (step - decay_start) / max(1, decay_steps - decay_start)
    return cfg.learning_rate + progress * (cfg.min_lr - cfg.learning_rate)


def to_device(tensors, device):
    """CPU batch tensors on `device`. On CUDA the copy goes through pinned memory and is only queued: a copy
    from pageable memory first waits for all the work already queued on the GPU (a host sync per micro-batch,
    with or without non_blocking). Elsewhere a plain .to() (a no-op on the CPU)."""
    if device_type(device) != "cuda":
        return tuple(t.to(device) for t in tensors)
    return tuple(t.pin_memory().to(device, non_blocking=True) for t in tensors)


def forward_backward(model, loader, grad_accum, scaler, env, micro_steps=None):
    """Gradients of the mean loss over grad_accum micro-batches; returns the summed loss (a device scalar).
    micro_steps: which of them to run (default all; the dry run skips repeats)."""
    loss_sum = torch.zeros((), device=env.device)
    for micro in range(grad_accum) if micro_steps is None else micro_steps:
        x, y = to_device(loader.next_batch(), env.device)  # (B, T) each
        maybe_fake_oom(x.shape[0])  # test hook: GPT_FAKE_OOM_ABOVE simulates an out-of-memory
        set_grad_sync(model, micro == grad_accum - 1)
        with autocast(env.device, env.dtype):
            _, loss = model(x, y, return_logits=False)
        # each micro-batch loss is a mean over B*T tokens; dividing by grad_accum makes the summed
        # gradients those of the mean over the whole step's tokens, not grad_accum times that
        loss = loss / grad_accum
        loss_sum += loss.detach().float()
        scaler.scale(loss).backward()
    return loss_sum


def reduce_step_stats(loss_sum, stop_flag, grad_norm, env):
    """(mean loss over ranks, grad norm, whether any rank got a signal) with one device->host copy."""
    flags = torch.stack([loss_sum, stop_flag])
    if env.distributed:
        dist.all_reduce(flags)  # SUM: gloo has no AVG
    loss, stop, norm = torch.stack([flags[0] / env.world_size, flags[1], grad_norm.float()]).tolist()
    return loss, norm, stop > 0


def skip_reason(train_loss, grad_norm, scaler, cfg, progress, step):
    """Why this update must be skipped (None: apply it); raises Halt where the run must stop. Gradients are
    identical on every rank after the all-reduce, so all ranks decide alike."""
    if math.isfinite(train_loss) and math.isfinite(grad_norm):
        progress.skipped_in_a_row = 0
        return None
    if scaler.is_enabled() and math.isfinite(train_loss):
        return f"fp16 gradient overflow; GradScaler lowers its scale to {scaler.get_scale() / 2:g}"
    what = "loss" if not math.isfinite(train_loss) else "gradient norm"
    reason = f"non-finite {what} (loss {train_loss}, grad norm {grad_norm})"
    if cfg.nonfinite == "halt":
        raise Halt(f"step {step}: {reason}; halting (nonfinite='halt')")
    progress.skipped_in_a_row += 1
    if cfg.max_skipped_steps and progress.skipped_in_a_row >= cfg.max_skipped_steps:
        raise Halt(f"step {step}: {progress.skipped_in_a_row} updates in a row skipped ({reason}); halting "
                   f"(max_skipped_steps={cfg.max_skipped_steps}): lower learning_rate?")
    return reason


def peak_memory(kind):
    """(peak allocated, peak reserved) MiB since the last call on CUDA; peak RSS elsewhere (reserved None)."""
    if kind == "cuda":
        out = torch.cuda.max_memory_allocated() / 2**20, torch.cuda.max_memory_reserved() / 2**20
        torch.cuda.reset_peak_memory_stats()
        return out
    try:
        import resource
    except ImportError:  # Windows
        return None, None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return (rss / 2**20 if sys.platform == "darwin" else rss / 2**10), None


# ----------------------------------------------------------------------------- evaluation

@torch.no_grad()
def val_loss(model, loader, eval_steps, env):
    """Mean loss over the same eval_steps val micro-batches every time, averaged over ranks."""
    model.eval()
    loader.reset()
    total = torch.zeros((), device=env.device)
    for _ in range(eval_steps):
        x, y = to_device(loader.next_batch(), env.device)
        with autocast(env.device, env.dtype):
            _, loss = model(x, y, return_logits=False)
        total += loss.float()
    if env.distributed:
        dist.all_reduce(total)  # SUM: gloo has no AVG
    model.train()
    return total.item() / eval_steps / env.world_size


def hellaswag_eval(raw_model, examples, cfg, env):
    """HellaSwag accuracy, examples sharded over ranks (every rank calls it); `examples` is filled on first use
    and reused."""
    import hellaswag
    from assets import fetch_hellaswag
    if not examples:
        examples.extend(hellaswag.load_examples(fetch_hellaswag(), limit=cfg.hellaswag_limit))
    with gathered(raw_model) as model:
        return hellaswag.evaluate(model, examples, env.device, dtype=env.dtype)


def sample_preview(raw_model, cfg, env):
    """A sample's text from rank 0, None on the others. Every rank calls it: a sharded model must be gathered."""
    from assets import EOT, get_tokenizer
    with gathered(raw_model) as model:
        if not env.master:
            return None
        enc = get_tokenizer()
        prompt = enc.encode(cfg.sample_prompt) or [EOT]
        generator = torch.Generator(device=env.device).manual_seed(cfg.seed)  # leaves the training RNG alone
        model.eval()
        with autocast(env.device, env.dtype):
            out = model.generate(torch.tensor([prompt], device=env.device), cfg.sample_tokens,
                                 top_k=200, generator=generator, n_vocab=enc.n_vocab)
        model.train()
    return enc.decode([t for t in out[0].tolist() if t < enc.n_vocab])


# ----------------------------------------------------------------------------- checkpoints and RNGs

def restore(ckpt, raw_model, optimizer, scaler, loader):
    """Optimizer (and from a sharded checkpoint the weights, resharded to this run's layout), loss scaler and
    loader position from a checkpoint; returns the Progress it recorded. Every rank calls it."""
    if "shards" in ckpt:
        load_sharded_checkpoint(ckpt["shards"], raw_model, optimizer)
    else:
        load_optimizer_state(raw_model, optimizer, ckpt["optimizer"])
    if ckpt["scaler"] is not None:
        scaler.load_state_dict(ckpt["scaler"])
    try:
        loader.load_state_dict(ckpt["loader"])
    except ValueError as e:
        saved = ckpt["config"]
        raise ConfigError(f"cannot resume: {e}; the checkpoint's run used data_dir={saved.get('data_dir')!r} and "
                          f"seed={saved.get('seed')}") from None
    return Progress(ckpt["step"], ckpt.get("best_step"), ckpt.get("best_val_loss"))


def restore_rngs(ckpt, env, log):
    """Last, after everything that draws random numbers during setup: each rank's RNGs as they were."""
    if len(ckpt["rng"]) == env.world_size:
        set_rng_state(ckpt["rng"][env.rank])
    else:
        log(f"note: checkpoint has RNG states of {len(ckpt['rng'])} ranks, this run has {env.world_size}; "
            "dropout masks will differ from an uninterrupted run")


def kept_checkpoint(out_dir):
    """What a halted run leaves to resume from, for its error message."""
    found = list_checkpoints(out_dir)
    if not found:
        return "no checkpoint was written yet"
    return f"the last checkpoint, {found[-1][1]}, is kept (continue with --init_from=resume)"


def save(out_dir, val, progress, raw_model, optimizer, scaler, loader, tracker, cfg, env, log):
    """Write a checkpoint holding everything an exact resume needs, then prune old ones: ckpt_{step}.pt from
    rank 0, or in a sharded run the directory ckpt_{step}/ to which every rank writes its own shards."""
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
    meta = {"model_args": asdict(raw_model.config), "config": asdict(cfg), "step": step,
            "scaler": scaler.state_dict() if scaler.is_enabled() else None, "loader": loader.state_dict(),
            "rng": rngs, "val_loss": val, "best_step": progress.best_step, "best_val_loss": progress.best_val,
            "tracker": tracker.state_dict() if tracker else None, "format": FORMAT}
    path = checkpoint_path(out_dir, step, sharded=env.sharded)
    if env.sharded:
        save_sharded_checkpoint(path, meta, raw_model, optimizer)
    else:
        save_checkpoint(path, {**meta, "model": raw_model.state_dict(), "optimizer": optimizer.state_dict()})
    if env.master:
        prune_checkpoints(out_dir, cfg.keep_last, keep_steps={progress.best_step})
        log(f"step {step}: saved {path}")


# ----------------------------------------------------------------------------- the recipe

def train(argv):
    """One run: the command line's config, out_dir locked for all of it (lock_out_dir), the recipe."""
    user = parse_args(argv)
    with lock_out_dir(make_config(user).out_dir):
        return run(user)


def run_summary(raw_model, compiled, cfg, env, total_batch_size, grad_accum, resumed_step):
    """The one line that says what this run is: size, device, precision, world, batch layout."""
    line = (f"{raw_model.num_params() / 1e6:.2f}M parameters | device {env.device} | dtype {env.dtype} | compile "
            f"{compiled} | world size {env.world_size}" + (f" ({env.parallel})" if env.distributed else "") +
            f" | {total_batch_size:,} tokens/step = {env.world_size} ranks"
            f" x {grad_accum} accumulation steps x {cfg.batch_size} x {cfg.block_size}")
    return line if resumed_step is None else f"{line} | resumed from step {resumed_step}"


def run(user):
    """The recipe, for the keys the user set (parse_args). Config: defaults < checkpoint (on resume) < preset <
    config files < --key=value."""
    cfg, ckpt, problem = resolve_config_or_defer(user)
    check_tracking_available(cfg.wandb_log, cfg.tensorboard_dir)  # every rank: all stop alike
    env = setup(cfg)
    check_shared_out_dir(cfg.out_dir, ckpt and ckpt["step"], problem, env)
    log = tqdm.write if env.master else (lambda *a, **k: None)
    cfg = check_memory(cfg, ckpt, env, log)  # the plan line; a refusal; batch_size='auto' from the plan
    train_loader, val_loader = make_loaders(cfg, env)

    # the bare GPT (checkpoints, samples, HellaSwag); a sharded run keeps it on the CPU for fully_shard to move
    raw_model, cfg = build_model(cfg, ckpt, "cpu" if env.sharded else env.device)
    if cfg.batch_size == "auto":  # a probed device (CUDA)
        cfg = probe_batch_size(raw_model, cfg, env, log, [train_loader, val_loader])
    total_batch_size, grad_accum = batch_layout(cfg, env.world_size)
    model = parallelize(raw_model, cfg, env)  # what the loop calls
    optimizer = build_optimizer(raw_model, cfg, env)  # after sharding: fully_shard replaces the parameters
    scaler = torch.amp.GradScaler(env.kind, enabled=env.dtype == "float16")  # loss scaling for fp16 only
    progress = restore(ckpt, raw_model, optimizer, scaler, train_loader) if ckpt else Progress()

    out_dir, tracker = Path(cfg.out_dir), None  # rank 0 writes metrics.jsonl (+ W&B/TensorBoard) and config.json
    if env.master:
        out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(out_dir / "config.json", json.dumps(asdict(cfg), indent=2) + "\n")
        tracker = Tracker(out_dir, asdict(cfg), total_batch_size, resume_step=progress.step if ckpt else None,
                          state=ckpt.get("tracker") if ckpt else None, **{k: getattr(cfg, k) for k in TRACKING_KEYS})
        log(f"config ('*' = set on this command line):\n{config_table(cfg, user)}")
        log(run_summary(raw_model, is_compiled(model), cfg, env, total_batch_size, grad_accum,
                        progress.step if ckpt else None))
    if ckpt is not None:
        restore_rngs(ckpt, env, log)
    del ckpt  # free the checkpoint's copy of the weights and optimizer state

    stop, stop_flag = StopRequest(), torch.zeros((), device=env.device)
    main_thread = threading.current_thread() is threading.main_thread()
    old_handlers = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)} if main_thread else {}
    peak = peak_flops(torch.cuda.get_device_name(env.device) if env.kind == "cuda" else env.kind, env.dtype)
    hellaswag_examples = []
    start_step, stopping, finished = progress.step, False, False
    bar = tqdm(total=cfg.max_steps, initial=start_step, disable=not env.master, unit="step", dynamic_ncols=True)
    try:
        while True:
            step, last = progress.step, progress.step >= cfg.max_steps
            val = None
            if step > start_step or start_step == 0:  # a resumed run's first step was evaluated before it stopped
                due = lambda interval: interval > 0 and (step % interval == 0 or last) and not stopping  # noqa: E731
                if due(cfg.eval_interval):
                    val = val_loss(model, val_loader, cfg.eval_steps, env)
                    if env.master:
                        tracker.log({"step": step, "val_loss": val})
                    log(f"step {step}: val loss {val:.4f}")
                if due(cfg.hellaswag_interval):
                    hs = hellaswag_eval(raw_model, hellaswag_examples, cfg, env)
                    if env.master:
                        tracker.log({"step": step, "hellaswag_acc": hs["acc"], "hellaswag_acc_norm": hs["acc_norm"],
                                       "hellaswag_n": hs["n"]})
                    log(f"step {step}: hellaswag acc_norm {hs['acc_norm']:.4f} ({hs['n']} examples)")
                if step > 0 and due(cfg.sample_interval):  # every rank: a sharded model is gathered first
                    log(f"step {step}: sample: {sample_preview(raw_model, cfg, env)!r}")
            if step > start_step and (last or stopping or cfg.save_interval and step % cfg.save_interval == 0):
                save(out_dir, val, progress, raw_model, optimizer, scaler, train_loader, tracker, cfg, env, log)
            if last or stopping:
                break

            # one optimizer step: grad_accum micro-batches, then clip, check and update
            t0 = time.perf_counter()
            lr = get_lr(step, cfg)
            set_lr(optimizer, lr, cfg)
            loss_sum, cfg, grad_accum = fitting_forward_backward(model, train_loader, grad_accum, scaler, optimizer,
                                                                 cfg, env, log, step)
            if stop.signal is not None:
                stop_flag.fill_(1.0)
            scaler.unscale_(optimizer)  # true gradients before clipping (no-op without fp16)
            grad_norm = clip_gradients(raw_model, cfg.grad_clip)
            train_loss, grad_norm, stopping = reduce_step_stats(loss_sum, stop_flag, grad_norm, env)
            skipped = skip_reason(train_loss, grad_norm, scaler, cfg, progress, step + 1)
            if skipped:
                log(f"step {step + 1}: {skipped}: update skipped")
            else:
                scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=not keeps_grads(model))  # also drops the gradients of a skipped step
            dt = time.perf_counter() - t0
            progress.step = step = step + 1

            tokens_per_s = total_batch_size / dt
            mfu = raw_model.estimate_mfu(tokens_per_s / env.world_size, peak)
            mem, reserved = peak_memory(env.kind)
            record = {"step": step, "train_loss": train_loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_s":
                      tokens_per_s, "mfu": mfu, "step_ms": dt * 1000, "peak_mem_mb": mem, "micro_batch": cfg.batch_size}
            if reserved is not None:
                record["peak_reserved_mb"] = reserved
            if skipped:
                record["skipped"] = skipped
            if env.master:
                tracker.log(record)
                bar.update(1)
                if cfg.log_interval and (step % cfg.log_interval == 0 or step == cfg.max_steps):
                    log(f"step {step:>6}/{cfg.max_steps} | loss {train_loss:.4f} | lr {lr:.2e} | norm {grad_norm:.3f}"
                        f" | {dt * 1000:.0f} ms | {tokens_per_s:,.0f} tok/s" + (f" | mfu {mfu:.1%}" if mfu else ""))
        finished = True
    except Halt as e:
        raise Halt(f"{e}; {kept_checkpoint(out_dir)}") from None
    finally:
        bar.close()
        for s, handler in old_handlers.items():
            signal.signal(s, handler)
        if tracker:
            summary = tracker.close(exit_code=0 if finished else 1)
            if finished:
                log(summary)
        if env.distributed:
            dist.destroy_process_group()
    if stopping:
        log(f"stopped by {signal.Signals(stop.signal).name if stop.signal else 'a signal on another rank'} at step "
            f"{progress.step}; continue with --init_from=resume")
    return 0


EXPECTED_ERRORS = (ConfigError, TrackingError, CheckpointError, Halt, ShardError, LockError, OSError)


def error_line(e):
    """The one line an expected error prints: an OSError as '<file>: <reason>', the others their message."""
    if isinstance(e, OSError) and e.filename is not None:
        return f"{e.filename}: {e.strerror}"
    return " ".join(str(e).split())


def main(argv=None):
    """Command-line entry point: returns 0, or exits 2 on a config error and 1 on any other expected error (bad
    checkpoint or data, a halt, out_dir in use, an unwritable or full disk): one line on stderr from rank 0,
    no traceback. A traceback is for bugs, or for everything with GPT2_TRACEBACK=1 in the environment."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(help_text(__doc__))
        return 0
    try:
        return train(argv)
    except EXPECTED_ERRORS as e:
        if os.environ.get("GPT2_TRACEBACK") == "1":
            raise
        if os.environ.get("LOCAL_RANK", "0") == "0":  # once per node: every node's log says why it stopped
            print(f"train.py: error: {error_line(e)}", file=sys.stderr, flush=True)
        raise SystemExit(2 if isinstance(e, (ConfigError, TrackingError)) else 1) from None
    finally:
        if dist.is_available() and dist.is_initialized():  # also after an error: no "not destroyed" warning
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
