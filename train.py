"""Train a GPT-2 style model, from Tiny Shakespeare on a laptop CPU to GPT-2 1.5B on GPU nodes.

    python train.py configs/shakespeare_cpu.py                        # the CPU demo (2 cores: ~10 min)
    python train.py configs/shakespeare_cpu.py --max_steps=50 --out_dir=out/quick
    torchrun --standalone --nproc_per_node=8 train.py configs/gpt2_124m.py
    python train.py configs/shakespeare_cpu.py --init_from=resume --max_steps=800   # continue a run
    python train.py --help                                              # every key, its default

A config file is plain Python assignments to TrainConfig keys; `--key=value` overrides are Python
literals (strings may be written bare) and win over the file. The sections below read top to
bottom like a recipe: config, setup, data, model, optimizer, evaluation, checkpoints, the loop.
"""
import ast
import dataclasses
import difflib
import inspect
import json
import math
import os
import random
import re
import signal
import sys
import threading
import time
import types
import typing
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch

from checkpoint import (FORMAT, checkpoint_path, clean_state_dict, latest_checkpoint, list_checkpoints,
                        load_checkpoint, prune_checkpoints, save_checkpoint)
from devices import autocast, device_type, resolve_device, resolve_dtype, tune_cpu_allocator

# CPU defaults for dtype/compile 'auto'. On the project's 2-core AMD EPYC (AVX2, no native bf16) bf16
# autocast ran 10-15x slower than fp32 (emulated bf16 matmuls) and torch.compile was no faster than eager in
# fp32 after a 30-190 s first step: fp32, eager. A CPU with AVX512-BF16/AMX gets bf16 autocast (devices.
# resolve_dtype) and compile, which were 1.4-1.9x and a further 1.6x over fp32 eager on the 6L/384d bench
# config on such a machine (issue 7's reference figures; not measured on the AVX2 machine).
CPU_COMPILE_BF16 = True
CPU_TUNE_MALLOC = True  # glibc: keep freed blocks mapped (devices.set_malloc_tuned): 1.3x on the bench config


# ----------------------------------------------------------------------------- config

@dataclass
class TrainConfig:
    # data and output
    data_dir: str = "data/fineweb-edu"  # directory (or glob) of token shards written by prepare_data.py
    out_dir: str = "out"  # checkpoints, metrics.jsonl and config.json are written here
    init_from: str = "scratch"  # 'scratch', 'resume' (latest checkpoint in out_dir), 'gpt2'..'gpt2-xl' or an HF dir
    # model (GPTConfig); ignored for pretrained inits and on resume (the checkpoint's are used)
    n_layer: int = 12  # transformer blocks
    n_head: int = 12  # attention heads per block
    n_embd: int = 768  # residual stream width
    block_size: int = 1024  # context length in tokens
    vocab_size: int = 50304  # GPT-2's 50257 tokens padded up to a multiple of 64 for faster matmuls
    dropout: float = 0.0  # dropout probability; 0 for pretraining
    bias: bool = True  # biases in Linear layers and LayerNorms, as GPT-2
    rotary_pct: float | None = None  # None: learned position embeddings; else fraction of head dims rotated (RoPE)
    activation_checkpointing: bool = False  # recompute activations in backward: much less memory, ~1/3 slower
    # batch
    batch_size: int = 16  # micro-batch: sequences per process per forward/backward
    total_batch_size: int | None = None  # tokens per step: a multiple of batch_size*block_size*world_size (None: that)
    # optimization
    max_steps: int = 19073  # optimizer steps to train for
    lr_decay_steps: int | None = None  # schedule length (None: max_steps); fix it to stop early, resume later
    learning_rate: float = 6e-4  # peak learning rate, reached at the end of warmup
    min_lr: float = 6e-5  # learning rate at the end of the decay
    warmup_steps: int = 715  # linear warmup from learning_rate/warmup_steps to learning_rate
    lr_schedule: str = "cosine"  # 'cosine' (decay over the whole schedule) or 'wsd' (warmup-stable-decay)
    wsd_decay_frac: float = 0.2  # 'wsd' only: fraction of lr_decay_steps spent in the final linear decay
    weight_decay: float = 0.1  # AdamW weight decay of the matmul and embedding weights (not biases/LayerNorms)
    beta1: float = 0.9  # AdamW beta1
    beta2: float = 0.95  # AdamW beta2
    grad_clip: float = 1.0  # clip the global gradient norm to this; 0 disables clipping
    nonfinite: str = "skip"  # a NaN/inf loss or gradient norm: 'skip' the update or 'halt' the run (exit 1)
    # evaluation, logging, checkpoints (an interval of 0 disables that activity)
    eval_interval: int = 250  # steps between validation-loss evaluations (also at step 0 and the last step)
    eval_steps: int = 20  # val micro-batches per process per evaluation (the same fixed batches every time)
    hellaswag_interval: int = 0  # steps between HellaSwag evaluations
    hellaswag_limit: int | None = None  # evaluate only the first N HellaSwag examples; None: all 10,042
    sample_interval: int = 0  # steps between printed sample previews
    sample_prompt: str = ""  # prompt of the sample preview ('' starts from <|endoftext|>)
    sample_tokens: int = 64  # tokens generated per sample preview
    log_interval: int = 10  # steps between console lines (metrics.jsonl gets every step)
    save_interval: int = 1000  # steps between checkpoints; the last step always gets one
    keep_last: int = 2  # checkpoints kept besides the best by val loss; 0 keeps all
    # system
    device: str = "auto"  # 'auto' (cuda > mps > cpu), 'cpu', 'cuda', 'cuda:1', 'mps'
    dtype: str = "auto"  # 'float32', 'bfloat16', 'float16' (+GradScaler) or 'auto': bf16/fp16 on CUDA, else fp32
    compile: bool | str = "auto"  # torch.compile the model: True, False or 'auto' (on for CUDA and for bf16 on CPU)
    seed: int = 1337  # seeds weights, data order and dropout


class ConfigError(ValueError):
    """A bad config key or value; the message is one line."""


FIELD_TYPES = typing.get_type_hints(TrainConfig)
MODEL_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "bias", "rotary_pct")  # fixed by the weights
CHOICES = {"lr_schedule": ("cosine", "wsd"), "nonfinite": ("skip", "halt"), "compile": (True, False, "auto"),
           "dtype": ("auto", "float32", "bfloat16", "float16")}


def config_docs():
    """{key: (default, comment)} read from TrainConfig's source (also used to write the README table)."""
    comments = dict(re.findall(r"^\s+(\w+):[^#\n]*#\s*(.+)$", inspect.getsource(TrainConfig), re.M))
    return {f.name: (f.default, comments.get(f.name, "")) for f in fields(TrainConfig)}


def check_value(key, value, source):
    """`value` converted to key's field type, or ConfigError naming where it came from."""
    if key not in FIELD_TYPES:
        close = difflib.get_close_matches(key, FIELD_TYPES, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(f"{source}: unknown config key '{key}'{hint}")
    allowed = typing.get_args(FIELD_TYPES[key]) or (FIELD_TYPES[key],)
    for tp in allowed:
        if value is None and tp is type(None) or tp is bool and isinstance(value, bool):
            return value
        if isinstance(value, bool):  # True is an int in Python, but never a valid int/float setting
            continue
        if tp is int and isinstance(value, int) or tp is str and isinstance(value, str):
            return value
        if tp is float and isinstance(value, (int, float)):
            return float(value)
    expected = " or ".join("None" if tp is type(None) else tp.__name__ for tp in allowed)
    raise ConfigError(f"{source}: config key '{key}' expects {expected}, got {type(value).__name__} {value!r}")


def read_config_file(path):
    """{key: value} of the plain assignments in a config file (names starting with '_' are private)."""
    if not Path(path).is_file():
        raise ConfigError(f"config file '{path}' not found")
    namespace = {}
    try:
        exec(compile(Path(path).read_text(), str(path), "exec"), namespace)
    except Exception as e:
        raise ConfigError(f"{path}: {type(e).__name__}: {e}") from None
    return {key: check_value(key, value, path) for key, value in namespace.items()
            if not key.startswith("_") and not isinstance(value, types.ModuleType) and not callable(value)}


def parse_args(argv):
    """{key: value} the user set on this command line: config files in order, then --key=value (later wins)."""
    user = {}
    for arg in argv:
        if not arg.startswith("--"):
            user.update(read_config_file(arg))
            continue
        key, eq, raw = arg[2:].partition("=")
        if not eq:
            raise ConfigError(f"'{arg}': write overrides as --key=value")
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw  # a bare word: a string, if the key takes strings
        try:
            user[key] = check_value(key, value, arg)
        except ConfigError:
            if key not in FIELD_TYPES or str not in typing.get_args(FIELD_TYPES[key]) + (FIELD_TYPES[key],):
                raise
            user[key] = raw  # --out_dir=123 means the directory '123'
    return user


def make_config(user, base=None):
    """A validated TrainConfig: `base` (defaults, or a checkpoint's config) with the user's keys on top."""
    values = {k: v for k, v in (base or {}).items() if k in FIELD_TYPES}
    values.update(user)
    cfg = TrainConfig(**values)
    for key, options in CHOICES.items():
        if getattr(cfg, key) not in options:
            raise ConfigError(f"config key '{key}' must be one of {', '.join(map(repr, options))}; "
                              f"got {getattr(cfg, key)!r}")
    for key in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "batch_size", "eval_steps",
                "sample_tokens", "total_batch_size", "lr_decay_steps"):
        if getattr(cfg, key) is not None and getattr(cfg, key) < 1:
            raise ConfigError(f"config key '{key}' must be >= 1; got {getattr(cfg, key)}")
    for key in ("max_steps", "warmup_steps", "eval_interval", "hellaswag_interval", "sample_interval",
                "log_interval", "save_interval", "keep_last", "seed", "learning_rate", "min_lr", "grad_clip"):
        if getattr(cfg, key) < 0:
            raise ConfigError(f"config key '{key}' must be >= 0; got {getattr(cfg, key)}")
    if cfg.n_embd % cfg.n_head:
        raise ConfigError(f"n_embd={cfg.n_embd} must be divisible by n_head={cfg.n_head}")
    if not 0 <= cfg.wsd_decay_frac <= 1 or not 0 <= cfg.dropout < 1:
        raise ConfigError(f"wsd_decay_frac must be in [0, 1] and dropout in [0, 1); "
                          f"got {cfg.wsd_decay_frac}, {cfg.dropout}")
    return cfg


def config_table(cfg, user):
    """The resolved config, one 'key  value' row per key; '*' marks keys set on this command line."""
    width = max(map(len, FIELD_TYPES))
    return "\n".join(f"  {'*' if k in user else ' '} {k:<{width}}  {v!r}" for k, v in asdict(cfg).items())


# ----------------------------------------------------------------------------- helpers

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


def choose_dtype(dtype, device):
    if dtype != "auto":
        return dtype
    if device_type(device) == "cuda":  # bf16 needs Ampere+; older GPUs get fp16 with loss scaling
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return resolve_dtype("auto", device)  # bf16 on a CPU with AVX512-BF16/AMX, else fp32


def choose_compile(setting, device, dtype):
    if setting != "auto":
        return setting
    kind = device_type(device)
    return kind == "cuda" or (kind == "cpu" and dtype == "bfloat16" and CPU_COMPILE_BF16)


def rng_state():
    """Every RNG this process draws from, as tensors and plain lists (weights_only-loadable)."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": [version, list(internal), gauss],
            "numpy": {"name": name, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                      "cached_gaussian": float(cached)},
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None}


def set_rng_state(state):
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["name"], np.array(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def json_safe(value):
    return None if isinstance(value, float) and not math.isfinite(value) else value  # JSON has no NaN


class MetricsLog:
    """out_dir/metrics.jsonl, one JSON object per line. A fresh run starts an empty file; a resumed
    run first drops the lines of steps after its checkpoint (they are about to be redone)."""

    def __init__(self, path, resume_step=None):
        kept = []
        if resume_step is not None and path.exists():
            for line in path.read_text().splitlines():
                try:
                    if json.loads(line)["step"] <= resume_step:
                        kept.append(line + "\n")
                except (ValueError, KeyError, TypeError):
                    pass  # a half-written last line from a killed run
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)  # atomic: a crash here leaves the old file or the new one
        self.file = open(path, "a")

    def write(self, record):
        self.file.write(json.dumps({k: json_safe(v) for k, v in record.items()}) + "\n")
        self.file.flush()


def peak_mem_mb(kind):
    if kind == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    try:
        import resource
    except ImportError:  # Windows
        return None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


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


class Halt(Exception):
    """Stop the run with exit code 1 (nonfinite='halt', or non-finite weights about to be saved)."""


# ----------------------------------------------------------------------------- training

def train(argv):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from tqdm import tqdm

    from data import DataLoader
    from model import GPT, GPTConfig, peak_flops

    # ---- config: defaults < checkpoint (on resume) < config files < --key=value
    user = parse_args(argv)
    cfg = make_config(user)
    ckpt = None
    if cfg.init_from == "resume":
        path = latest_checkpoint(cfg.out_dir)
        if path is None:
            raise ConfigError(f"init_from='resume' but {cfg.out_dir} holds no complete ckpt_XXXXXX.pt checkpoint")
        ckpt = load_checkpoint(path)
        cfg = make_config(user, base=ckpt["config"])
        for key in MODEL_KEYS:
            if getattr(cfg, key) != ckpt["model_args"][key]:
                raise ConfigError(f"cannot change {key} when resuming: the checkpoint {path} has "
                                  f"{ckpt['model_args'][key]!r}, the config {getattr(cfg, key)!r}")
    elif list_checkpoints(cfg.out_dir):
        raise ConfigError(f"{cfg.out_dir} already holds checkpoints; continue with --init_from=resume, "
                          f"or pick another out_dir (or delete them) to start over")

    # ---- setup: torchrun sets RANK/LOCAL_RANK/WORLD_SIZE; a plain `python train.py` is rank 0 of 1
    ddp = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank, local_rank, world_size = (int(os.environ.get(k, d)) for k, d in
                                    (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", 1)))
    device = resolve_device(cfg.device)
    kind = device_type(device)
    if ddp:
        if kind == "cuda":
            device = f"cuda:{local_rank}"
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if kind == "cuda" else "gloo")
    master = rank == 0
    log = tqdm.write if master else (lambda *a, **k: None)
    dtype = choose_dtype(cfg.dtype, device)
    use_compile = choose_compile(cfg.compile, device, dtype)
    if CPU_TUNE_MALLOC:
        tune_cpu_allocator(device)
    if kind == "cuda":  # TF32 matmuls: ~8x fp32 throughput on Ampere+, plenty accurate for training
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    tokens_per_micro = cfg.batch_size * cfg.block_size * world_size
    total_batch_size = cfg.total_batch_size or tokens_per_micro
    if total_batch_size % tokens_per_micro:
        raise ConfigError(f"total_batch_size={total_batch_size} is not a multiple of batch_size*block_size*world_size"
                          f" = {cfg.batch_size}*{cfg.block_size}*{world_size} = {tokens_per_micro}")
    grad_accum = total_batch_size // tokens_per_micro
    # the same seed on every rank: identical initial weights (DDP also broadcasts rank 0's)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)

    # ---- data: every rank reads its own slice of one global, world-size-invariant stream
    train_loader = DataLoader(cfg.data_dir, "train", cfg.batch_size, cfg.block_size, rank=rank,
                              world_size=world_size, seed=cfg.seed, vocab_size=cfg.vocab_size)
    val_loader = None
    if cfg.eval_interval > 0:
        val_loader = DataLoader(cfg.data_dir, "val", cfg.batch_size, cfg.block_size, rank=rank,
                                world_size=world_size, seed=cfg.seed, vocab_size=cfg.vocab_size)

    # ---- model
    train_only = {"dropout": cfg.dropout, "activation_checkpointing": cfg.activation_checkpointing}
    if ckpt is not None:
        model = GPT(GPTConfig(**{**ckpt["model_args"], **train_only}))
        model.load_state_dict(clean_state_dict(ckpt["model"]))
    elif cfg.init_from == "scratch":
        model = GPT(GPTConfig(**{k: getattr(cfg, k) for k in MODEL_KEYS}, **train_only))
    else:
        model = GPT.from_pretrained(cfg.init_from, **train_only)
        cfg = dataclasses.replace(cfg, **{k: getattr(model.config, k) for k in MODEL_KEYS})  # record the real shape
    model.to(device)
    raw_model = model  # the bare GPT: what checkpoints, samples and HellaSwag use

    # ---- optimizer (and loss scaling, only for fp16)
    optimizer = model.configure_optimizer(cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2), kind)
    scaler = torch.amp.GradScaler(kind, enabled=dtype == "float16")
    start_step, best_step, best_val = 0, None, None
    if ckpt is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
        if ckpt["scaler"] is not None:
            scaler.load_state_dict(ckpt["scaler"])
        train_loader.load_state_dict(ckpt["loader"])
        start_step, best_step, best_val = ckpt["step"], ckpt.get("best_step"), ckpt.get("best_val_loss")

    # ---- wrap: DDP first, then compile (compile understands DDP's gradient buckets)
    if ddp:
        model = DDP(model, device_ids=[local_rank] if kind == "cuda" else None)
    ddp_model = model
    if use_compile:
        model = torch.compile(model)

    # ---- output: config table, config.json, metrics.jsonl
    out_dir = Path(cfg.out_dir)
    metrics = None
    if master:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")
        metrics = MetricsLog(out_dir / "metrics.jsonl", resume_step=start_step if ckpt else None)
        log(f"config ('*' = set on this command line):\n{config_table(cfg, user)}")
        log(f"{raw_model.num_params() / 1e6:.2f}M parameters | device {device} | dtype {dtype} | compile "
            f"{use_compile} | world size {world_size} | {total_batch_size:,} tokens/step = {world_size} ranks x "
            f"{grad_accum} accumulation steps x {cfg.batch_size} x {cfg.block_size}"
            + (f" | resumed from step {start_step}" if ckpt else ""))

    # ---- evaluation
    @torch.no_grad()
    def val_loss():
        """Mean loss over the same eval_steps val micro-batches every time, averaged over ranks."""
        model.eval()
        val_loader.reset()
        total = torch.zeros((), device=device)
        for _ in range(cfg.eval_steps):
            x, y = val_loader.next_batch()
            with autocast(device, dtype):
                _, loss = model(x.to(device), y.to(device), return_logits=False)
            total += loss.float()
        if ddp:
            dist.all_reduce(total)  # SUM: gloo has no AVG
        model.train()
        return total.item() / cfg.eval_steps / world_size

    hellaswag_examples = []

    def hellaswag_eval():
        import hellaswag
        from assets import fetch_hellaswag
        if not hellaswag_examples:
            hellaswag_examples.extend(hellaswag.load_examples(fetch_hellaswag(), limit=cfg.hellaswag_limit))
        return hellaswag.evaluate(raw_model, hellaswag_examples, device, dtype=dtype)  # sharded over ranks

    def sample_preview():
        from assets import EOT, get_tokenizer
        enc = get_tokenizer()
        prompt = enc.encode(cfg.sample_prompt) or [EOT]
        generator = torch.Generator(device=device).manual_seed(cfg.seed)  # leaves the training RNG alone
        raw_model.eval()
        with autocast(device, dtype):
            out = raw_model.generate(torch.tensor([prompt], device=device), cfg.sample_tokens,
                                     top_k=200, generator=generator)
        raw_model.train()
        return enc.decode([t for t in out[0].tolist() if t < enc.n_vocab])

    # ---- checkpoints
    def save(step, val):
        nonlocal best_step, best_val
        rngs = [rng_state()]
        if ddp:  # every rank's dropout RNG, so a resumed DDP run draws the same masks
            rngs = [None] * world_size
            dist.all_gather_object(rngs, rng_state())
        if not master:
            return
        if not all(torch.isfinite(p).all() for p in raw_model.parameters()):
            raise Halt(f"step {step}: the weights hold NaN/inf; not writing them (last good checkpoint kept)")
        if val is not None and (best_val is None or val < best_val):
            best_step, best_val = step, val
        path = checkpoint_path(out_dir, step)
        save_checkpoint(path, {
            "model": raw_model.state_dict(), "model_args": asdict(raw_model.config), "config": asdict(cfg),
            "step": step, "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict() if scaler.is_enabled() else None, "loader": train_loader.state_dict(),
            "rng": rngs, "val_loss": val, "best_step": best_step, "best_val_loss": best_val, "format": FORMAT})
        prune_checkpoints(out_dir, cfg.keep_last, keep_steps={best_step})
        log(f"step {step}: saved {path}")

    # ---- one optimizer step: grad_accum micro-batches, then clip and update
    def forward_backward():
        loss_sum = torch.zeros((), device=device)
        for micro in range(grad_accum):
            x, y = train_loader.next_batch()  # (B, T) each
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if ddp:  # all-reduce gradients only on the last micro-step; must be set before the forward
                ddp_model.require_backward_grad_sync = micro == grad_accum - 1
            with autocast(device, dtype):
                _, loss = model(x, y, return_logits=False)
            # each micro-batch loss is a mean over B*T tokens; dividing by grad_accum makes the summed
            # gradients those of the mean over the whole step's tokens, not grad_accum times that
            loss = loss / grad_accum
            loss_sum += loss.detach().float()
            scaler.scale(loss).backward()
        return loss_sum

    compile_tried = set()  # the functions that already ran compiled

    def first_use_of_compile(fn):
        """fn(); torch.compile errors surface on a compiled model's first call (train and eval
        compile separately): then say so once, restore the loader and RNGs, and redo fn eagerly."""
        nonlocal model, use_compile
        if not use_compile or fn in compile_tried:
            return fn()
        before = train_loader.state_dict(), rng_state()
        try:
            result = fn()
        except Exception as e:
            reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
            log(f"torch.compile failed ({type(e).__name__}: {reason}); falling back to eager mode "
                "(compile=False skips the attempt)")
            model, use_compile = ddp_model, False
            optimizer.zero_grad(set_to_none=True)
            train_loader.load_state_dict(before[0])
            set_rng_state(before[1])
            return fn()
        compile_tried.add(fn)
        return result

    # ---- the loop
    stop = StopRequest()
    main_thread = threading.current_thread() is threading.main_thread()
    old_handlers = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)} if main_thread else {}
    peak = peak_flops(torch.cuda.get_device_name(device) if kind == "cuda" else kind, dtype)
    if ckpt is not None:  # last, after everything that draws random numbers during setup
        if len(ckpt["rng"]) == world_size:
            set_rng_state(ckpt["rng"][rank])
        else:
            log(f"note: checkpoint has RNG states of {len(ckpt['rng'])} ranks, this run has {world_size}; "
                "dropout masks will differ from an uninterrupted run")
    del ckpt  # free the checkpoint's copy of the weights and optimizer state
    bar = tqdm(total=cfg.max_steps, initial=start_step, disable=not master, unit="step", dynamic_ncols=True)
    step, stopping = start_step, False
    try:
        while True:
            last = step >= cfg.max_steps
            val = None
            if step > start_step or start_step == 0:  # a resumed run's first step was evaluated before it stopped
                due = lambda interval: interval > 0 and (step % interval == 0 or last) and not stopping
                if due(cfg.eval_interval):
                    val = first_use_of_compile(val_loss)
                    if master:
                        metrics.write({"step": step, "val_loss": val})
                    log(f"step {step}: val loss {val:.4f}")
                if due(cfg.hellaswag_interval):
                    hs = hellaswag_eval()
                    if master:
                        metrics.write({"step": step, "hellaswag_acc": hs["acc"], "hellaswag_acc_norm": hs["acc_norm"],
                                       "hellaswag_n": hs["n"]})
                    log(f"step {step}: hellaswag acc_norm {hs['acc_norm']:.4f} ({hs['n']} examples)")
                if master and step > 0 and due(cfg.sample_interval):
                    log(f"step {step}: sample: {sample_preview()!r}")
            if step > start_step and (last or stopping or cfg.save_interval and step % cfg.save_interval == 0):
                save(step, val)
            if last or stopping:
                break

            t0 = time.perf_counter()
            lr = get_lr(step, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.zero_grad(set_to_none=True)
            loss_sum = first_use_of_compile(forward_backward)
            flags = torch.stack([loss_sum, torch.tensor(float(stop.signal is not None), device=device)])
            if ddp:  # average the logged loss over ranks, and stop together if any rank got a signal
                dist.all_reduce(flags)
                flags[0] /= world_size
            scaler.unscale_(optimizer)  # true gradients before clipping (no-op without fp16)
            grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), cfg.grad_clip or math.inf)
            train_loss, grad_norm, stopping = flags[0].item(), grad_norm.item(), flags[1].item() > 0

            # gradients are identical on every rank after the all-reduce, so all ranks decide alike
            skipped = None
            if not math.isfinite(train_loss) or not math.isfinite(grad_norm):
                what = "loss" if not math.isfinite(train_loss) else "gradient norm"
                skipped = f"non-finite {what} (loss {train_loss}, grad norm {grad_norm})"
                if scaler.is_enabled() and math.isfinite(train_loss):
                    skipped = f"fp16 gradient overflow; GradScaler lowers its scale to {scaler.get_scale() / 2:g}"
                elif cfg.nonfinite == "halt":
                    raise Halt(f"step {step + 1}: {skipped}; halting (nonfinite='halt'), last checkpoint kept")
                log(f"step {step + 1}: {skipped}: update skipped")
            else:
                scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)  # also drops the gradients of a skipped step
            if kind == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            step += 1

            tokens_per_s = total_batch_size / dt
            mfu = raw_model.estimate_mfu(tokens_per_s / world_size, peak)
            record = {"step": step, "train_loss": train_loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_s":
                      tokens_per_s, "mfu": mfu, "step_ms": dt * 1000, "peak_mem_mb": peak_mem_mb(kind)}
            if skipped:
                record["skipped"] = skipped
            if master:
                metrics.write(record)
                bar.update(1)
                if cfg.log_interval and (step % cfg.log_interval == 0 or step == cfg.max_steps):
                    log(f"step {step:>6}/{cfg.max_steps} | loss {train_loss:.4f} | lr {lr:.2e} | norm {grad_norm:.3f}"
                        f" | {dt * 1000:.0f} ms | {tokens_per_s:,.0f} tok/s" + (f" | mfu {mfu:.1%}" if mfu else ""))
    finally:
        bar.close()
        for s, handler in old_handlers.items():
            signal.signal(s, handler)
        if metrics:
            metrics.file.close()
        if ddp:
            dist.destroy_process_group()
    if stopping:
        log(f"stopped by {signal.Signals(stop.signal).name if stop.signal else 'a signal on another rank'} at step "
            f"{step}; continue with --init_from=resume")
    return 0


def main(argv=None):
    """Command-line entry point: returns 0, or exits 2 on a config error and 1 on a bad checkpoint or a halt."""
    from checkpoint import CheckpointError

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__.strip() + "\n\nkeys (default  # meaning):")
        for key, (default, doc) in config_docs().items():
            print(f"  {key} = {default!r}  # {doc}")
        return 0
    try:
        return train(argv)
    except (ConfigError, CheckpointError, Halt) as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"train.py: error: {e}", file=sys.stderr)
        raise SystemExit(2 if isinstance(e, ConfigError) else 1) from None


if __name__ == "__main__":
    sys.exit(main())
