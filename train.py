"""Train a GPT-2 style model, from Tiny Shakespeare on a laptop CPU to GPT-2 1.5B on GPU nodes.

    python train.py configs/shakespeare_cpu.py                        # the CPU demo
    python train.py configs/shakespeare_cpu.py --max_steps=50 --out_dir=out/quick
    torchrun --standalone --nproc_per_node=8 train.py configs/gpt2_124m.py
    torchrun --standalone --nproc_per_node=8 train.py configs/gpt3_2p7b.py --parallel=fsdp   # sharded
    python train.py configs/shakespeare_cpu.py --init_from=resume --max_steps=800   # continue a run
    python train.py --help                                              # every key, its default

A config file is plain Python assignments to TrainConfig keys (config.py); `--key=value` overrides are
Python literals (strings may be written bare) and win over the file. run() at the bottom is the recipe: config,
setup, data, model, optimizer, parallelize, then the loop; each step of it is a function above it or one call
into the module named for its job. Expected errors are one line on stderr (main(); docs/failure-modes.md).
"""

import contextlib
import json
import math
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from gpt2train import pipeline
from gpt2train.bpe import TokenizerError
from gpt2train.budget import Budget, with_horizon
from gpt2train.chat import CHAT_VOCAB
from gpt2train.checkpoint import CheckpointError
from gpt2train.config import (
    ARCH_KEYS,
    ConfigError,
    config_table,
    help_text,
    make_config,
    model_config,
    parse_args,
)
from gpt2train.console import distributed, log, progress_bar
from gpt2train.data import open_loader
from gpt2train.devices import fused_adamw_supported, is_oom, peak_flops, peak_memory
from gpt2train.documents import prepare_command
from gpt2train.evaluation import Abandoned, Evaluator
from gpt2train.files import Halt, LockError, atomic_write, check_writable, first_line, report_error
from gpt2train.hf import from_pretrained, pad_vocab
from gpt2train.memory import resolve_batch_size
from gpt2train.meta_init import build_on_meta
from gpt2train.optim import build_optimizer, set_lr
from gpt2train.parallel import after_compile_trial, exit_process, is_compiled, keeps_grads, parallelize
from gpt2train.resume import Checkpointer, Progress, restore, restore_rngs, resume_hint
from gpt2train.sharded import load_sharded_checkpoint
from gpt2train.shards import NoShardsError, ShardError
from gpt2train.start import lock_out_dir, setting, start
from gpt2train.step import clip_gradients, compile_works, forward_backward, probe_batch_size
from gpt2train.tracking import EXIT_CODES, NoTracker, Tracker, TrackingError, append_ledger
from model import GPT, TRAINING_ONLY_MODEL_KEYS


class StopRequest:
    """SIGTERM/SIGINT handler: remember the signal; the loop checkpoints after the current step and
    exits 0. A second Ctrl-C quits at once."""

    def __init__(self):
        self.signal = None

    def __call__(self, signum, frame):
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal = signum
        log(f"received {signal.Signals(signum).name}: saving a checkpoint after this step, then exiting", note=True)


# ----------------------------------------------------------------------------- setup


def make_loaders(cfg, env, manifests):
    """Train and val loaders: every rank reads its own slice of one global, world-size-invariant stream; of a
    mixture (data_dir names several datasets), a mixture.Mixture of one loader per source. The stages of a pipeline
    are one data-parallel rank: they read the same rows. Every shard is validated
    here, token ids included, before step 1. manifests: the data's, as the run's start read them
    (start.Source.manifests)."""
    try:
        train_loader = open_loader(cfg, "train", env.dp_rank, env.dp_size, manifests)
        val_loader = open_loader(cfg, "val", env.dp_rank, env.dp_size, manifests) if cfg.eval_interval > 0 else None
    except NoShardsError as e:
        raise NoShardsError(f"{e}; prepare it with {prepare_command(e.data_dir or cfg.data_dir)}") from None
    log(
        f"data: {train_loader.summary().replace(' shards', ' train shards')}; "
        f"val: {val_loader.summary() if val_loader else 'none (eval_interval=0)'}"
    )
    return train_loader, val_loader


def build_model(cfg, source, env, min_vocab=0):
    """(the bare GPT, cfg with the model's real shape) from what the run starts from (start.Source): scratch, the
    checkpoint it resumes from, a checkpoint to fine-tune (its weights only: resolve_config took its architecture)
    or pretrained weights; pretrained weights with fewer than min_vocab rows (GPT-2's 50257, for SFT data's chat
    tokens) are padded to a multiple of 64. Where: an unsharded run's on its device. A sharded run's from scratch
    or from a sharded checkpoint on the meta device (meta_init.build_on_meta: parallelize() gives each rank its
    shards only, and restore() loads a sharded checkpoint's weights into them); from whole weights on the CPU,
    for fully_shard to move."""
    state = source.state
    if source.kind in ("scratch", "resume"):
        if env.sharded and (state is None or "shards" in state):
            # a sharded checkpoint overwrites every weight: no replay of the random initialisation
            return build_on_meta(model_config(cfg), replay=state is None), cfg
        model = GPT(model_config(cfg))
        if state is not None and "shards" not in state:
            model.load_state_dict(state["model"])
    elif source.kind == "checkpoint":  # fine-tuning
        model = GPT(model_config(cfg))
        if "shards" in state:
            load_sharded_checkpoint(state["shards"], model, collective=False)
        else:
            model.load_state_dict(state["model"])
    else:
        try:
            model = from_pretrained(cfg.init_from, **{k: getattr(cfg, k) for k in TRAINING_ONLY_MODEL_KEYS})
        except (ValueError, ImportError) as e:  # a broken model directory; a hub download's errors are OSErrors
            raise ConfigError(f"init_from={cfg.init_from!r}: {e}") from None
        if model.config.vocab_size < min_vocab:
            model = pad_vocab(model, -(-min_vocab // 64) * 64)
        cfg = make_config({**asdict(cfg), **{k: getattr(model.config, k) for k in ARCH_KEYS}})
    return model.to("cpu" if env.sharded else env.device), cfg


# ----------------------------------------------------------------------------- the step


def get_lr(step, cfg, max_steps):
    """Learning rate of optimizer step `step` (0-based) of a run of max_steps (its Budget's): linear warmup, then
    cosine or WSD decay to min_lr. Under a budget (max_seconds) the decay starts after step Budget.FIXED_AT at the
    soonest: the steps before it run before max_steps is known (they get the peak), and every step's lr is the same
    function of the fixed max_steps, whenever it was fixed (a resume's is the uninterrupted run's)."""
    decay_steps = cfg.lr_decay_steps or max_steps
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps
    stable = max(cfg.warmup_steps, Budget.FIXED_AT if cfg.max_seconds else 0)  # the steps before the decay
    if step < stable:
        return cfg.learning_rate
    if step >= decay_steps:
        return cfg.min_lr
    if cfg.lr_schedule == "cosine":
        progress = (step - stable) / max(1, decay_steps - stable)  # 0 -> 1
        return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (cfg.learning_rate - cfg.min_lr)
    decay_start = max(stable, decay_steps - round(cfg.wsd_decay_frac * decay_steps))
    if step < decay_start:  # WSD: constant until the final decay_frac of the schedule, then linear
        return cfg.learning_rate
    progress = (step - decay_start) / max(1, decay_steps - decay_start)
    return cfg.learning_rate + progress * (cfg.min_lr - cfg.learning_rate)


SCHEDULE_KEYS = (
    "learning_rate",
    "min_lr",
    "warmup_steps",
    "max_steps",
    "lr_decay_steps",
    "lr_schedule",
    "wsd_decay_frac",
)


def schedule_note(cfg, saved, step):
    """One note when a resume's settings (saved: the checkpoint's config) give its next step another learning rate
    than the checkpoint's run would have (a new max_steps stretches the decay): which keys changed, the rate before
    and after, and how to keep the old decay."""
    was = SimpleNamespace(**{**asdict(cfg), **{key: saved[key] for key in SCHEDULE_KEYS if key in saved}})
    before, after = get_lr(step, was, was.max_steps), get_lr(step, cfg, cfg.max_steps)
    if before == after:
        return
    changed = ", ".join(
        f"{k} {getattr(was, k)} -> {getattr(cfg, k)}" for k in SCHEDULE_KEYS if getattr(was, k) != getattr(cfg, k)
    )
    keep = (
        f"; --lr_decay_steps={was.max_steps} keeps the old decay"
        if was.max_steps != cfg.max_steps and was.lr_decay_steps is None and cfg.lr_decay_steps is None
        else ""
    )
    log(
        f"the learning-rate schedule changed since the checkpoint ({changed}): step {step + 1}'s lr is "
        f"{after:.2e}, not {before:.2e}{keep}",
        note=True,
    )


@dataclass
class StepStats:
    """What one optimizer step measured, of all ranks (reduce_step_stats), and what the loop adds to it."""

    train_loss: float
    grad_norm: float
    stop: bool  # a rank got SIGTERM/SIGINT
    trained_tokens: int
    empty_micro_batches: int  # micro-batches with no trained target (loss masks)
    step: int = 0  # the step this one completes (1-based)
    lr: float = 0.0
    dt: float = 0.0  # seconds
    skipped: str | None = None  # why its update was skipped


def reduce_step_stats(loss_sum, stop_flag, grad_norm, counts, env):
    """The step's StepStats with one device->host copy: the mean loss over ranks, the grad norm, whether any rank
    got a signal, and forward_backward's counts (already of all ranks)."""
    flags = torch.stack([loss_sum, stop_flag])
    if env.distributed:
        dist.all_reduce(flags)  # SUM: gloo has no AVG
    mine = torch.stack([flags[0] / env.world_size, flags[1], grad_norm.float()])  # float32: MPS has no float64
    loss, stop, norm, trained, empty = torch.cat([mine, counts.to(mine.device)]).tolist()
    return StepStats(loss, norm, stop > 0, int(trained), int(empty))


def skip_reason(stats, scaler, cfg, progress):
    """Why the update of the step `stats` measured must be skipped (None: apply it); raises Halt where the run must
    stop. Gradients are identical on every rank after the all-reduce, so all ranks decide alike."""
    train_loss, grad_norm, step = stats.train_loss, stats.grad_norm, stats.step
    if stats.trained_tokens == 0:  # SFT data whose every target in the step is masked: nothing to learn from
        return "no trained target in any micro-batch of the step (loss masks)"
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
        raise Halt(
            f"step {step}: {progress.skipped_in_a_row} updates in a row skipped ({reason}); halting "
            f"(max_skipped_steps={cfg.max_skipped_steps}): lower learning_rate?"
        )
    return reason


# ----------------------------------------------------------------------------- logging


def step_record(stats, loader, flops_per_token, peak, env):
    """The metrics.jsonl record of one optimizer step (stats: its StepStats; loader: the train loader, whose B is
    the live micro-batch; of a mixture, the tokens each source supplied so far, tokens/<name>); MFU from the whole
    model's training FLOPs per token over the device's peak."""
    tokens_per_s = env.tokens_per_step / stats.dt
    mem, reserved = peak_memory(env.kind)
    record = {
        "step": stats.step,
        "train_loss": stats.train_loss,
        "lr": stats.lr,
        "grad_norm": stats.grad_norm,
        "tokens_per_s": tokens_per_s,
        "mfu": tokens_per_s / env.world_size * flops_per_token / peak if peak else None,
        "step_ms": stats.dt * 1000,
        "peak_mem_mb": mem,
        "micro_batch": loader.B,
        "trained_tokens": stats.trained_tokens,
    }
    record.update(loader.tokens())  # of a mixture, each source's
    if reserved is not None:
        record["peak_reserved_mb"] = reserved
    if stats.skipped:
        record["skipped"] = stats.skipped
    if stats.empty_micro_batches:
        record["skipped_micro_batches"] = stats.empty_micro_batches
    return record


def report_step(record, tracker, bar, log_interval, max_steps):
    """One step's record to metrics.jsonl (and W&B/TensorBoard), the progress bar, and every log_interval a line."""
    tracker.log(record)
    bar.update(1)
    step = record["step"]
    if log_interval and (step % log_interval == 0 or step == max_steps):
        log(
            f"step {step:>6}/{max_steps} | loss {record['train_loss']:.4f} | lr {record['lr']:.2e} | norm "
            f"{record['grad_norm']:.3f} | {record['step_ms']:.0f} ms | {record['tokens_per_s']:,.0f} tok/s"
            + (f" | mfu {record['mfu']:.1%}" if record["mfu"] else "")
        )


def start_tracking(cfg, resumed, total_batch_size, env):
    """Rank 0 writes out_dir/config.json and tracks the run (metrics.jsonl, W&B, TensorBoard; resumed with the state
    of the checkpoint `resumed`, if any); the other ranks track nothing."""
    if not env.master:
        return NoTracker()
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if cfg.ledger:  # one line at the end of the run: an unwritable ledger is refused now
        Path(cfg.ledger).parent.mkdir(parents=True, exist_ok=True)
        check_writable(cfg.ledger)
    write_config(cfg)
    return Tracker(
        out_dir,
        asdict(cfg),
        total_batch_size,
        resume_step=resumed["step"] if resumed else None,
        state=resumed.get("tracker") if resumed else None,
    )


def write_config(cfg, max_steps=None):
    """out_dir/config.json: the run's resolved config (rank 0); max_steps: once a budget has fixed it."""
    config = {**asdict(cfg), **({"max_steps": max_steps} if max_steps is not None else {})}
    atomic_write(Path(cfg.out_dir) / "config.json", json.dumps(config, indent=2) + "\n")


# ----------------------------------------------------------------------------- the recipe


def run_summary(params, model, cfg, env, resumed_step):
    """The one line that says what this run is: size (params: the whole model's), device, precision, world, batch
    layout."""
    total_batch_size, grad_accum = env.tokens_per_step, env.rows // cfg.batch_size
    tp = f", tensor_parallel {env.tensor_parallel}" if env.tensor_parallel > 1 else ""
    split = env.pipeline > 1 or env.tensor_parallel > 1
    line = (
        f"{params / 1e6:.2f}M parameters | device {env.device} | dtype {env.dtype} | compile "
        f"{is_compiled(model)} | world size {env.world_size}"
        + (f" ({env.pipeline} pipeline stages x {env.dp_size} {env.parallel}{tp})" if env.pipeline > 1 else "")
        + (f" ({env.parallel}{tp})" if env.distributed and env.pipeline == 1 else "")
        + f" | {total_batch_size:,} tokens/step = {env.dp_size} {'data-parallel ' if split else ''}ranks"
        f" x {grad_accum} accumulation steps x {cfg.batch_size} x {cfg.block_size}"
    )
    return line if resumed_step is None else f"{line} | resumed from step {resumed_step}"


@dataclass
class Training:
    """What the loop works with, put together once by run() (torchtitan's Trainer): the model as the loop calls it
    (model: compiled or wrapped) and bare (raw_model: checkpoints, samples, evaluation), what steps it, the data,
    the run's companions; and what the loop's handlers need of where it stopped."""

    cfg: object
    env: object
    model: object
    raw_model: object
    optimizer: object
    scaler: object
    train_loader: object
    progress: Progress
    tracker: object
    budget: Budget
    checkpointer: Checkpointer
    evaluator: Evaluator
    stop: StopRequest = field(default_factory=StopRequest)
    peak: float | None = None  # the device's peak FLOP/s, for MFU
    saved_step: int = 0  # the last step a checkpoint holds
    step_start: dict | None = None  # the train loader's position at the current step's start
    final_loss: float | None = None  # the last step's train loss
    size: dict | None = None  # the whole model's params, params_lookup, flops_per_token (model_size)


def model_size(raw_model):
    """The whole model's parameter counts and training FLOPs per token, counted before a pipeline cuts it to this
    rank's stage (torchtitan counts them once, before parallelizing): the summary, the result and MFU use them."""
    params = raw_model.num_params()
    lookup = params - raw_model.num_params(non_embedding=True)
    return {"params": params, "params_lookup": lookup, "flops_per_token": raw_model.flops_per_token()}


def run(user, argv=()):
    """The recipe, for the keys the user set (parse_args; argv: the command line, for the ledger). Config: defaults <
    checkpoint (on resume) < preset < config files < --key=value."""
    cfg, source, env = start(user)  # config, process group, what the run starts from: alike on every rank
    # the memory plan, before anything big is allocated: logged; a batch that cannot fit refused; 'auto' resolved
    cfg = resolve_batch_size(cfg, env, source.model)
    train_loader, val_loader = make_loaders(cfg, env, source.manifests)
    # the bare GPT (checkpoints, samples, HellaSwag); SFT data's chat tokens need GPT-2's vocabulary padded
    raw_model, cfg = build_model(cfg, source, env, CHAT_VOCAB if train_loader.masks is not None else 0)
    if cfg.batch_size == "auto":  # a probed device (CUDA)
        cfg = probe_batch_size(raw_model, cfg, env, [train_loader, val_loader])
    cfg = with_horizon(cfg, raw_model, env.dp_size)  # target_flops, tokens_per_param: max_steps from the model
    # cfg is final from here on (the step's tokens and rows per rank: env); the micro-batch may still halve on an
    # out-of-memory: train_loader.B is the live one
    env, size = env.with_batch(cfg), model_size(raw_model)
    # what the loop calls: compiled, or eager where the trial fails; a pipeline: this rank's stage, scheduled
    model = pipeline.build(raw_model, cfg, env) if env.pipeline > 1 else parallelize(raw_model, cfg, env)
    if is_compiled(model):
        model = after_compile_trial(model, compile_works(model, cfg, env, train_loader), env)
    optimizer = build_optimizer(raw_model, cfg, fused_adamw_supported(env.kind))  # after sharding
    scaler = torch.amp.GradScaler(env.kind, enabled=env.dtype == "float16")  # loss scaling for fp16 only
    resumed = source.resumed
    progress = Progress() if resumed is None else restore(resumed, raw_model, optimizer, scaler, train_loader, env)
    tracker = start_tracking(cfg, resumed, env.tokens_per_step, env)
    # a resume's max_steps was fixed by the run it continues; rank 0 rewrites config.json when a budget fixes it
    budget = Budget(cfg, env, source.kind == "resume", (lambda steps: write_config(cfg, steps)) if env.master else None)
    states = {"model": raw_model, "optimizer": optimizer, "scaler": scaler, "loader": train_loader, "tracker": tracker}
    t = Training(
        cfg,
        env,
        model,
        raw_model,
        optimizer,
        scaler,
        train_loader,
        progress,
        tracker,
        budget,
        checkpointer=Checkpointer(cfg, env, states, source.tokenizer, budget),
        evaluator=Evaluator(train_loader, val_loader, tracker, cfg, env, source.tokenizer),
        peak=peak_flops(torch.cuda.get_device_name(env.device) if env.kind == "cuda" else env.kind, env.dtype),
        saved_step=progress.step,  # the last step a checkpoint holds: the resumed one's
        size=size,
    )
    log(config_table(cfg, user))
    log(run_summary(size["params"], model, cfg, env, resumed and resumed["step"]))
    if resumed is not None:
        restore_rngs(resumed, env)
        schedule_note(cfg, resumed["config"], resumed["step"])
    del source, resumed  # the checkpoint's copy of the weights and optimizer state goes
    return train(t, argv)


def train(t, argv):
    """Run the loop with SIGTERM/SIGINT caught (StopRequest); returns the exit code of how it ended
    (tracking.EXIT_CODES). Whatever the ending, the result line and the ledger's line are written."""
    main_thread = threading.current_thread() is threading.main_thread()
    old_handlers = {s: signal.signal(s, t.stop) for s in (signal.SIGTERM, signal.SIGINT)} if main_thread else {}
    out_dir = Path(t.cfg.out_dir)
    status = "error"  # how the run ended (tracking.EXIT_CODES)
    try:
        status = loop(t)
    except Halt as e:
        status = e.status
        raise Halt(f"{e}; {resume_hint(out_dir)}", e.status) from None
    except KeyboardInterrupt:  # a second Ctrl-C: at once, even in the middle of a save
        status = "interrupted"
        raise KeyboardInterrupt(resume_hint(out_dir)) from None
    except ShardError as e:  # a shard changed under the run: first keep the steps done since the last save
        # in a single process only: under torchrun the other ranks would wait in a collective
        if not t.env.distributed and t.progress.step > t.saved_step:
            t.optimizer.zero_grad(set_to_none=True)
            t.train_loader.load_state_dict(t.step_start)
            t.checkpointer.save(t.progress)
        raise ShardError(f"{e}; {resume_hint(out_dir)}") from None
    except Exception as e:  # an out-of-memory where no micro-batch can halve (the optimizer step): one line, exit 4
        if not is_oom(e):
            raise
        status = "oom"
        raise Halt(
            f"step {t.progress.step + 1}: out of memory ({first_line(e)}); {resume_hint(out_dir)}", "oom"
        ) from None
    finally:
        for s, handler in old_handlers.items():
            signal.signal(s, handler)
        size = t.size
        flops = t.progress.step * t.env.tokens_per_step * size["flops_per_token"]  # trained
        extra = {
            "params": size["params"],
            "params_lookup": size["params_lookup"],
            "max_seconds": t.cfg.max_seconds,
            "flops": flops,
        }
        summary = t.tracker.close(status, extra)
        if summary:
            log(summary)
        if t.cfg.ledger and t.tracker.result is not None:  # rank 0
            append_ledger(t.cfg.ledger, t.tracker.result, argv, out_dir)
    if t.env.distributed:  # no rank tears its process group down (main) while rank 0 still writes
        dist.barrier()
    return EXIT_CODES[status]


def loop(t):
    """Evaluate, save, step, until the budget's max_steps or a signal; returns the status it ended with: 'ok',
    'interrupted' (a signal: saved and stopped) or 'diverged' (it ended on a non-finite loss, the guard off)."""
    start_step, stopping = t.progress.step, False
    bar = progress_bar(
        total=t.budget.max_steps if t.budget.fixed else None, initial=start_step, show=t.env.master, unit="step"
    )
    with contextlib.closing(bar):
        while True:
            step = t.progress.step
            last = step >= t.budget.max_steps
            t.step_start = t.train_loader.state_dict()
            val = None
            # a resumed run's first step was evaluated before it stopped
            if (step > start_step or start_step == 0) and not stopping:
                try:
                    val = t.evaluator.run(t.model, t.raw_model, step, last, t.stop)
                except Abandoned:  # a signal: save now rather than after a whole evaluation
                    stopping = True
            if step > start_step and (last or stopping or t.cfg.save_interval and step % t.cfg.save_interval == 0):
                t.checkpointer.save(t.progress, val)
                t.saved_step = step
            if last or stopping:
                break
            stats = optimizer_step(t, step)
            stopping = stats.stop
            if t.budget.add(stats.dt):
                bar.total = t.budget.max_steps
            record = step_record(stats, t.train_loader, t.size["flops_per_token"], t.peak, t.env)
            report_step(record, t.tracker, bar, t.cfg.log_interval, t.budget.max_steps)
            t.final_loss = stats.train_loss
    if stopping:  # said before the summary: the result stays the last line
        signame = signal.Signals(t.stop.signal).name if t.stop.signal else "a signal on another rank"
        log(f"stopped by {signame} at step {t.progress.step}; continue with --init_from=resume")
        return "interrupted"
    # a run that ends on a non-finite loss (the guard off: max_skipped_steps=0) diverged too
    return "ok" if t.final_loss is None or math.isfinite(t.final_loss) else "diverged"


def optimizer_step(t, step):
    """One optimizer step after `step` done: the step's micro-batches, then clip, check and update. Returns its
    StepStats; t.progress.step moves on."""
    t0 = time.perf_counter()
    lr = get_lr(step, t.cfg, t.budget.max_steps)
    set_lr(t.optimizer, lr, t.cfg)
    loss_sum, counts = forward_backward(t.model, t.train_loader, t.env.rows, t.scaler, t.env, step)
    stop_flag = torch.full((), float(t.stop.signal is not None), device=t.env.device)
    t.scaler.unscale_(t.optimizer)  # true gradients before clipping (no-op without fp16)
    grad_norm = clip_gradients(t.raw_model, t.cfg.grad_clip, t.env.pp_group)
    stats = reduce_step_stats(loss_sum, stop_flag, grad_norm, counts, t.env)
    stats.step, stats.lr = step + 1, lr
    stats.skipped = skip_reason(stats, t.scaler, t.cfg, t.progress)
    if stats.empty_micro_batches and stats.trained_tokens:  # they ran (every rank runs every backward)
        log(
            f"step {step + 1}: {stats.empty_micro_batches} micro-batch(es) with no trained target (loss "
            "masks) skipped: loss and gradients 0, the step's mean is over the others' tokens",
            note=True,
        )
    if stats.skipped:
        log(f"step {step + 1}: {stats.skipped}: update skipped")
    else:
        t.scaler.step(t.optimizer)
    t.scaler.update()
    t.optimizer.zero_grad(set_to_none=not keeps_grads(t.env))  # also drops the gradients of a skipped step
    stats.dt = time.perf_counter() - t0
    t.progress.step = step + 1
    return stats


def main(argv=None):
    """Command-line entry point: returns the run's status's exit code (tracking.EXIT_CODES: 0 ok, 5 interrupted: saved
    and stopped), or exits 2 on a config error, 3 diverged and 4 out of memory (a Halt), 1 on any other expected
    error (bad checkpoint or data, out_dir in use, an unwritable or full disk), 130 on a second Ctrl-C: one line on
    stderr from rank 0, no traceback. A traceback is for bugs, or for everything with GPT2_TRACEBACK=1 set."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        print(help_text(__doc__))
        return 0
    try:
        user = parse_args(argv)
        with lock_out_dir(setting(user, "out_dir")):  # one run per out_dir, for the whole run
            return run(user, argv)
    except (ConfigError, TrackingError, CheckpointError, Halt, ShardError, LockError, TokenizerError, OSError) as e:
        report_error("train.py", e)
        bad_input = isinstance(e, (ConfigError, TrackingError))
        raise SystemExit(2 if bad_input else EXIT_CODES[e.status] if isinstance(e, Halt) else 1) from None
    except KeyboardInterrupt as e:  # 130, as a shell reports a Ctrl-C
        report_error("train.py", KeyboardInterrupt(f"interrupted{'; ' if str(e) else ''}{e}"))
        raise SystemExit(130) from None
    finally:
        if distributed():  # the one place the process group is destroyed
            dist.destroy_process_group()


if __name__ == "__main__":
    exit_process(main)
