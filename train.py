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

import json
import math
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from gpt2train.bpe import TokenizerError
from gpt2train.chat import CHAT_VOCAB
from gpt2train.checkpoint import CheckpointError, load_sharded_checkpoint
from gpt2train.config import (
    ARCH_KEYS,
    ConfigError,
    batch_layout,
    config_table,
    help_text,
    make_config,
    model_config,
    parse_args,
)
from gpt2train.console import distributed, log, progress_bar
from gpt2train.data import NoShardsError, ShardError, open_loader
from gpt2train.devices import fused_adamw_supported, is_oom, peak_flops, peak_memory
from gpt2train.documents import prepare_command
from gpt2train.evaluation import Abandoned, Evaluator
from gpt2train.files import Halt, LockError, atomic_write, check_writable, first_line, report_error
from gpt2train.hf import from_pretrained, pad_vocab
from gpt2train.memory import probe_batch_size
from gpt2train.optim import build_optimizer, set_lr
from gpt2train.parallel import (
    after_compile_trial,
    build_on_meta,
    is_compiled,
    keeps_grads,
    lock_out_dir,
    parallelize,
)
from gpt2train.resume import Checkpointer, Progress, restore, restore_rngs, resume_hint, start
from gpt2train.step import clip_gradients, compile_works, forward_backward
from gpt2train.tracking import EXIT_CODES, TRACKING_KEYS, NoTracker, Tracker, TrackingError, append_ledger
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
    mixture (data_dir names several datasets), a data.Mixture of one loader per source. Every shard is validated
    here, token ids included, before step 1. manifests: the data's, as the run's start read them
    (resume.Source.manifests)."""
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
    """(the bare GPT, cfg with the model's real shape) from what the run starts from (resume.Source): scratch, the
    checkpoint it resumes from, a checkpoint to fine-tune (its weights only: resolve_config took its architecture)
    or pretrained weights; pretrained weights with fewer than min_vocab rows (GPT-2's 50257, for SFT data's chat
    tokens) are padded to a multiple of 64. Where: an unsharded run's on its device. A sharded run's from scratch
    or from a sharded checkpoint on the meta device (parallel.build_on_meta: parallelize() gives each rank its
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


def get_lr(step, cfg):
    """Learning rate of optimizer step `step` (0-based): linear warmup, then cosine or WSD decay to min_lr. Under a
    budget (max_seconds) the decay starts after step Budget.FIXED_AT at the soonest: the steps before it run before
    max_steps is known (they get the peak), and every step's lr is the same function of the fixed max_steps, whenever
    it was fixed (a resume's is the uninterrupted run's)."""
    decay_steps = cfg.lr_decay_steps or cfg.max_steps
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
    was = replace(cfg, **{key: saved[key] for key in SCHEDULE_KEYS if key in saved})
    before, after = get_lr(step, was), get_lr(step, cfg)
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


class Budget:
    """max_seconds, a wall-clock budget for training (evaluation and checkpoints excluded), turned into max_steps once
    so that the schedule's decay fits it. A fresh run times its steps SKIPPED+1 .. FIXED_AT (the first ones are
    torch.compile's and the caches' warm-up: not timed, but spent from the budget), then fixes max_steps = the steps
    done + as many as the rest of the budget holds at their mean time (FIXED_AT at least), into cfg (every holder of
    it sees the change) and config.json. A checkpoint written sooner (a signal, a short save_interval) first fixes it
    from the steps done so far: every checkpoint of the run holds its fixed max_steps, and a resumed run continues on
    it, never re-timed, exactly as the uninterrupted run would (get_lr starts the decay after FIXED_AT either way)."""

    SKIPPED = 2
    FIXED_AT = 10  # steps 3-10 timed

    def __init__(self, cfg, env):
        self.cfg, self.env = cfg, env
        self.seconds = []  # of each step so far, until fixed
        self.fixed = False
        log(f"max_seconds={cfg.max_seconds:g}: max_steps is fixed after step {self.FIXED_AT}, from the steps' times")

    def add(self, seconds):
        """Count one step's seconds; fix max_steps when enough steps are timed. Returns whether it did now."""
        if self.fixed:
            return False
        self.seconds.append(seconds)
        if len(self.seconds) < self.FIXED_AT:
            return False
        self.fix()
        return True

    def fix(self):
        """Fix cfg.max_steps from the steps done (at least one), now; once. Every rank calls it alike."""
        if self.fixed:
            return
        done, spent = len(self.seconds), sum(self.seconds)
        timed = self.seconds[self.SKIPPED :] or self.seconds  # fewer steps done: their mean, warm-up included
        per_step = sum(timed) / len(timed)
        # at least FIXED_AT: never the step a save fixes it at, and the same floor wherever it was fixed
        steps = max(self.FIXED_AT, done + int((self.cfg.max_seconds - spent) / per_step))
        if self.env.distributed:  # each rank timed its own steps: rank 0's count is the run's
            agreed = torch.tensor(steps, device=self.env.device)
            dist.broadcast(agreed, 0)
            steps = int(agreed)
        self.cfg.max_steps, self.fixed = steps, True
        log(
            f"max_seconds={self.cfg.max_seconds:g}: the first {done} steps took {spent:.1f} s, steps "
            f"{done - len(timed) + 1}-{done} {per_step * 1000:,.0f} ms each: max_steps fixed at {steps}"
        )
        if self.env.master:
            write_config(self.cfg)


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


def step_record(stats, loader, total_batch_size, raw_model, peak, env):
    """The metrics.jsonl record of one optimizer step (stats: its StepStats; loader: the train loader, whose B is
    the live micro-batch; of a mixture, the tokens each source supplied so far, tokens/<name>)."""
    tokens_per_s = total_batch_size / stats.dt
    mem, reserved = peak_memory(env.kind)
    record = {
        "step": stats.step,
        "train_loss": stats.train_loss,
        "lr": stats.lr,
        "grad_norm": stats.grad_norm,
        "tokens_per_s": tokens_per_s,
        "mfu": raw_model.estimate_mfu(tokens_per_s / env.world_size, peak),
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


def report_step(record, tracker, bar, cfg):
    """One step's record to metrics.jsonl (and W&B/TensorBoard), the progress bar, and every log_interval a line."""
    tracker.log(record)
    bar.update(1)
    step = record["step"]
    if cfg.log_interval and (step % cfg.log_interval == 0 or step == cfg.max_steps):
        log(
            f"step {step:>6}/{cfg.max_steps} | loss {record['train_loss']:.4f} | lr {record['lr']:.2e} | norm "
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
        **{k: getattr(cfg, k) for k in TRACKING_KEYS},
    )


def write_config(cfg):
    """out_dir/config.json: the run's resolved config (rank 0)."""
    atomic_write(Path(cfg.out_dir) / "config.json", json.dumps(asdict(cfg), indent=2) + "\n")


# ----------------------------------------------------------------------------- the recipe


def run_summary(raw_model, model, cfg, env, resumed_step):
    """The one line that says what this run is: size, device, precision, world, batch layout."""
    total_batch_size, grad_accum = batch_layout(cfg, env.dp_size)
    tp = f", tensor_parallel {env.tensor_parallel}" if env.tensor_parallel > 1 else ""
    line = (
        f"{raw_model.num_params() / 1e6:.2f}M parameters | device {env.device} | dtype {env.dtype} | compile "
        f"{is_compiled(model)} | world size {env.world_size}"
        + (f" ({env.parallel}{tp})" if env.distributed else "")
        + f" | {total_batch_size:,} tokens/step = {env.dp_size} {'data-parallel ' if tp else ''}ranks"
        f" x {grad_accum} accumulation steps x {cfg.batch_size} x {cfg.block_size}"
    )
    return line if resumed_step is None else f"{line} | resumed from step {resumed_step}"


def run(user, argv=()):
    """The recipe, for the keys the user set (parse_args; argv: the command line, for the ledger). Config: defaults <
    checkpoint (on resume) < preset < config files < --key=value."""
    cfg, source, env = start(user)  # config, process group, what the run starts from: alike on every rank
    train_loader, val_loader = make_loaders(cfg, env, source.manifests)

    # the bare GPT (checkpoints, samples, HellaSwag); SFT data's chat tokens need GPT-2's vocabulary padded
    min_vocab = CHAT_VOCAB if train_loader.masks is not None else 0
    raw_model, cfg = build_model(cfg, source, env, min_vocab)
    if cfg.batch_size == "auto":  # a probed device (CUDA)
        cfg = probe_batch_size(raw_model, cfg, env, [train_loader, val_loader])
    # cfg is final from here on but for a budget's max_steps (Budget.fix); the micro-batch may still halve on an
    # out-of-memory: train_loader.B is the live one
    total_batch_size, grad_accum = batch_layout(cfg, env.dp_size)
    rows = cfg.batch_size * grad_accum  # sequences per rank per optimizer step
    model = parallelize(raw_model, cfg, env)  # what the loop calls: compiled, or eager where the trial fails
    if is_compiled(model):
        model = after_compile_trial(model, compile_works(model, cfg, env, train_loader))
    optimizer = build_optimizer(raw_model, cfg, fused_adamw_supported(env.kind))  # after sharding
    scaler = torch.amp.GradScaler(env.kind, enabled=env.dtype == "float16")  # loss scaling for fp16 only
    resumed = source.resumed
    progress = restore(resumed, raw_model, optimizer, scaler, train_loader) if resumed else Progress()

    out_dir = Path(cfg.out_dir)
    tracker = start_tracking(cfg, resumed, total_batch_size, env)
    states = {"model": raw_model, "optimizer": optimizer, "scaler": scaler, "loader": train_loader, "tracker": tracker}
    checkpointer = Checkpointer(cfg, env, states, source.tokenizer)
    log(config_table(cfg, user))
    log(run_summary(raw_model, model, cfg, env, resumed and resumed["step"]))
    if resumed is not None:
        restore_rngs(resumed, env)
        schedule_note(cfg, resumed["config"], resumed["step"])
    source.state = resumed = None  # free the checkpoint's copy of the weights and optimizer state

    stop = StopRequest()
    stop_flag = torch.zeros((), device=env.device)
    main_thread = threading.current_thread() is threading.main_thread()
    old_handlers = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)} if main_thread else {}
    peak = peak_flops(torch.cuda.get_device_name(env.device) if env.kind == "cuda" else env.kind, env.dtype)
    evaluator = Evaluator(train_loader, val_loader, tracker, cfg, env, source.tokenizer)
    budget = Budget(cfg, env) if cfg.max_seconds and source.kind != "resume" else None  # a resume's is fixed
    start_step = progress.step
    saved_step = start_step
    stopping = False
    status, final_loss = "error", None  # how the run ended (tracking.EXIT_CODES); the last step's train loss
    bar = progress_bar(total=None if budget else cfg.max_steps, initial=start_step, show=env.master, unit="step")
    try:
        while True:
            step = progress.step
            last = step >= cfg.max_steps
            step_start = train_loader.state_dict()
            val = None
            # a resumed run's first step was evaluated before it stopped
            if (step > start_step or start_step == 0) and not stopping:
                try:
                    val = evaluator.run(model, raw_model, step, last, stop)
                except Abandoned:  # a signal: save now rather than after a whole evaluation
                    stopping = True
            if step > start_step and (last or stopping or cfg.save_interval and step % cfg.save_interval == 0):
                if budget:  # before its timing is done (a signal, a short save_interval): from the steps so far
                    budget.fix()
                checkpointer.save(progress, val)
                saved_step = step
            if last or stopping:
                break

            # one optimizer step: the step's micro-batches, then clip, check and update
            t0 = time.perf_counter()
            lr = get_lr(step, cfg)
            set_lr(optimizer, lr, cfg)
            loss_sum, counts = forward_backward(model, train_loader, rows, scaler, env, step)
            if stop.signal is not None:
                stop_flag.fill_(1.0)
            scaler.unscale_(optimizer)  # true gradients before clipping (no-op without fp16)
            grad_norm = clip_gradients(raw_model, cfg.grad_clip)
            stats = reduce_step_stats(loss_sum, stop_flag, grad_norm, counts, env)
            stats.step, stats.lr, stopping = step + 1, lr, stats.stop
            stats.skipped = skip_reason(stats, scaler, cfg, progress)
            if stats.empty_micro_batches and stats.trained_tokens:  # they ran (every rank runs every backward)
                log(
                    f"step {step + 1}: {stats.empty_micro_batches} micro-batch(es) with no trained target (loss "
                    "masks) skipped: loss and gradients 0, the step's mean is over the others' tokens",
                    note=True,
                )
            if stats.skipped:
                log(f"step {step + 1}: {stats.skipped}: update skipped")
            else:
                scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=not keeps_grads(model))  # also drops the gradients of a skipped step
            stats.dt = time.perf_counter() - t0
            progress.step = step + 1
            if budget and budget.add(stats.dt):
                bar.total = cfg.max_steps
            report_step(step_record(stats, train_loader, total_batch_size, raw_model, peak, env), tracker, bar, cfg)
            final_loss = stats.train_loss
        if stopping:  # said before the summary: the result stays the last line
            log(
                f"stopped by {signal.Signals(stop.signal).name if stop.signal else 'a signal on another rank'} at "
                f"step {progress.step}; continue with --init_from=resume"
            )
        # a run that ends on a non-finite loss (the guard off: max_skipped_steps=0) diverged too
        status = "interrupted" if stopping else "ok" if final_loss is None or math.isfinite(final_loss) else "diverged"
    except Halt as e:
        status = e.status
        raise Halt(f"{e}; {resume_hint(out_dir)}", e.status) from None
    except KeyboardInterrupt:  # a second Ctrl-C: at once, even in the middle of a save
        status = "interrupted"
        raise KeyboardInterrupt(resume_hint(out_dir)) from None
    except ShardError as e:  # a shard changed under the run: first keep the steps done since the last save
        # in a single process only: under torchrun the other ranks would wait in a collective
        if not env.distributed and progress.step > saved_step:
            optimizer.zero_grad(set_to_none=True)
            train_loader.load_state_dict(step_start)
            if budget:
                budget.fix()
            checkpointer.save(progress)
        raise ShardError(f"{e}; {resume_hint(out_dir)}") from None
    except Exception as e:  # an out-of-memory where no micro-batch can halve (the optimizer step): one line, exit 4
        if not is_oom(e):
            raise
        status = "oom"
        raise Halt(
            f"step {progress.step + 1}: out of memory ({first_line(e)}); {resume_hint(out_dir)}", "oom"
        ) from None
    finally:
        bar.close()
        for s, handler in old_handlers.items():
            signal.signal(s, handler)
        params, lookup = raw_model.num_params(), raw_model.num_params() - raw_model.num_params(non_embedding=True)
        summary = tracker.close(status, {"params": params, "params_lookup": lookup, "max_seconds": cfg.max_seconds})
        if summary:
            log(summary)
        if cfg.ledger and tracker.result is not None:  # rank 0
            append_ledger(cfg.ledger, tracker.result, argv, out_dir)
    if env.distributed:  # no rank tears its process group down (main) while rank 0 still writes
        dist.barrier()
    return EXIT_CODES[status]


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
        with lock_out_dir(make_config(user).out_dir):  # one run per out_dir, for the whole run
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
    sys.exit(main())
