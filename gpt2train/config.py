"""Training configuration: the TrainConfig keys, config files, --key=value overrides, validation, --help.

A config file is plain Python assignments to TrainConfig keys (nanoGPT's convention: it is executed, so
only use config files you trust); `--key=value` overrides are Python literals (strings may be written
bare) and win over the file. The model's keys are GPTConfig's fields, declared once in model.py:
TrainConfig extends GPTConfig, so every model option is a config key without being restated here,
and GPTConfig validates its own values.

Precedence, lowest first: defaults < the checkpoint's config (on resume) < `preset` < config files <
--key=value, in command-line order.
"""

import ast
import difflib
import inspect
import math
import re
import types
import typing
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from model import HUB_NAMES, PRESETS, TRAINING_ONLY_MODEL_KEYS, GPTConfig

MODEL_KEYS = tuple(f.name for f in fields(GPTConfig))
ARCH_KEYS = tuple(k for k in MODEL_KEYS if k not in TRAINING_ONLY_MODEL_KEYS)  # fixed by the weights


class ConfigError(ValueError):
    """A bad config key or value; the message is one line."""


@dataclass
class TrainConfig(GPTConfig):
    # data and output
    data_dir: str | dict = "data/fineweb-edu"  # prepare_data.py's shards (dir or glob); a mixture: "a:0.8,b:0.2"
    out_dir: str = "out"  # checkpoints, metrics.jsonl and config.json are written here
    init_from: str = "scratch"  # scratch, resume (out_dir's latest), gpt2..gpt2-xl, an HF dir, a checkpoint/run dir
    preset: str | None = None  # fill the model keys from model.PRESETS, e.g. 'gpt2', 'gpt3-350m' (keys set win)
    packing: str = "window"  # rows: 'window' (across documents) or 'document' (each starts a document; docs/data.md)
    # batch
    batch_size: int | str = 16  # micro-batch: sequences per process per step; 'auto': the largest that fits
    total_batch_size: int | None = None  # tokens per step: a multiple of batch_size*block_size*world_size (None: that)
    # optimization
    max_steps: int = 19073  # optimizer steps to train for
    max_seconds: float | None = None  # training budget in s (evaluation excluded): max_steps fixed from the first steps
    target_flops: float | None = None  # training FLOPs (flops_per_token x tokens, as MFU counts): sets max_steps
    tokens_per_param: float | None = None  # tokens = this x params (non-lookup, the result's `params`): sets max_steps
    lr_decay_steps: int | None = None  # schedule length (None: max_steps); fix it to stop early, resume later
    learning_rate: float = 6e-4  # peak learning rate, reached at the end of warmup
    min_lr: float = 6e-5  # learning rate at the end of the decay
    warmup_steps: int = 715  # linear warmup from learning_rate/warmup_steps to learning_rate
    lr_schedule: str = "cosine"  # 'cosine' (decay over the whole schedule) or 'wsd' (warmup-stable-decay)
    wsd_decay_frac: float = 0.2  # 'wsd' only: fraction of lr_decay_steps spent in the final linear decay
    weight_decay: float = 0.1  # AdamW weight decay of the matmul and embedding weights (not biases/LayerNorms)
    beta1: float = 0.9  # AdamW beta1
    beta2: float = 0.95  # AdamW beta2
    optimizer: str = "adamw"  # 'adamw', or 'muon': Muon (muon_lr) for the blocks' 2-D matrices, AdamW for the rest
    muon_lr: float = 0.02  # optimizer='muon': peak learning rate of the Muon matrices (the schedule scales it alike)
    muon_momentum: float = 0.95  # optimizer='muon': Muon's Nesterov momentum
    muon_weight_decay: float = 0.0  # optimizer='muon': decoupled weight decay of the Muon matrices (lr * this per step)
    embedding_lr: float | None = None  # peak AdamW rate of the embedding tables (None: learning_rate)
    head_lr: float | None = None  # peak AdamW rate of an untied output head (None: learning_rate)
    grad_clip: float = 1.0  # clip the global gradient norm to this; 0 disables clipping
    nonfinite: str = "skip"  # a NaN/inf loss or gradient norm: 'skip' the update or 'halt' the run (exit 3)
    max_skipped_steps: int = 10  # halt (exit 3) after this many consecutive skipped updates; 0: no limit
    # evaluation, logging, checkpoints (an interval of 0 disables that activity)
    eval_interval: int = 250  # steps between validation-loss evaluations (also at step 0 and the last step)
    eval_steps: int | str = 20  # val micro-batches per process per evaluation (the same ones), or 'all': the val split
    hellaswag_interval: int = 0  # steps between HellaSwag evaluations
    hellaswag_limit: int | None = None  # evaluate only the first N HellaSwag examples; None: all 10,042
    eval_tasks: str = "default"  # evaluate.py's tasks at eval_tasks_interval: comma-separated names, 'default', 'all'
    eval_tasks_interval: int = 0  # steps between evaluations of eval_tasks (logged as mc/<task>_acc, mc_centered)
    eval_tasks_limit: int | None = None  # score only the first N examples of each of eval_tasks; None: all
    sample_interval: int = 0  # steps between printed sample previews
    sample_prompt: str = ""  # prompt of the sample preview ('' starts from <|endoftext|>)
    sample_tokens: int = 64  # tokens generated per sample preview
    log_interval: int = 10  # steps between console lines (metrics.jsonl gets every step)
    save_interval: int = 1000  # steps between checkpoints; the last step always gets one
    keep_last: int = 2  # checkpoints kept besides the best by val loss; 0 keeps all
    # system
    device: str = "auto"  # 'auto' (cuda > mps > cpu), 'cpu', 'cuda', 'cuda:1', 'mps'
    dtype: str = "auto"  # 'float32', 'bfloat16', 'float16' (+GradScaler) or 'auto' (devices.resolve_dtype)
    compile: bool | str = "auto"  # torch.compile the model: True, False or 'auto' (devices.resolve_compile)
    seed: int = 1337  # seeds weights, data order and dropout
    # tracking (optional packages: pip install wandb tensorboard); metrics.jsonl is always written
    wandb_log: bool = False  # log to Weights & Biases (WANDB_MODE=offline records locally for `wandb sync`)
    wandb_project: str = "gpt2-train"  # W&B project
    wandb_run_name: str | None = None  # W&B run name (None: out_dir's name)
    tensorboard_dir: str | None = None  # write TensorBoard event files here (None: no TensorBoard)
    cost_per_hour: float | None = None  # USD per hour for the whole job: metrics gain cost_usd, tokens_per_dollar
    ledger: str | None = None  # append one JSON line per run (its result and status, commit, argv) to this file
    memory_check: bool = True  # refuse at start a batch_size whose memory plan exceeds the device's available memory
    dist_timeout_minutes: float = 30.0  # torchrun: how long a rank waits in a collective (rank 0 saving) before failing
    # several processes (torchrun only; a plain `python train.py` ignores these)
    parallel: str = "ddp"  # 'ddp' (every rank holds the whole model), 'fsdp' (all of it sharded over ranks) or 'hsdp'
    shard_size: int | None = None  # 'hsdp': ranks per shard group; groups replicate each other (None: one node's ranks)
    pipeline_parallel: int = 1  # pipeline stages: the blocks split over this many ranks in turn (torchrun only)
    pipeline_schedule: str = "1F1B"  # '1F1B' (at most `stages` micro-batches in flight per stage) or 'GPipe' (all)
    pipeline_microbatches: int | None = None  # pieces of a step's rows per rank (None: accumulation steps, >= stages)
    tensor_parallel: int = 1  # ranks splitting each block's heads and MLP width; data-parallel: world_size / this

    def __post_init__(self):
        for key, options in CHOICES.items():
            if getattr(self, key) not in options:
                raise ConfigError(
                    f"config key '{key}' must be one of {', '.join(map(repr, options))}; got {getattr(self, key)!r}"
                )
        for f in fields(self):  # 1e999 and nan are typos, not settings
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"config key '{f.name}' must be a finite number; got {value!r}")
        if isinstance(self.batch_size, str) and self.batch_size != "auto":
            raise ConfigError(f"config key 'batch_size' must be an int >= 1 or 'auto'; got {self.batch_size!r}")
        if self.batch_size == "auto" and self.total_batch_size is None:
            raise ConfigError(
                "batch_size='auto' keeps total_batch_size fixed and picks the micro-batch: set "
                "total_batch_size (tokens per step, a multiple of block_size*world_size)"
            )
        for key, (ok, what) in RANGES.items():
            value = getattr(self, key)
            if value is not None and not ok(value):
                raise ConfigError(f"config key '{key}' must be {what}; got {value!r}")
        if self.init_from not in ("scratch", "resume", *HUB_NAMES) and not Path(self.init_from).exists():
            raise ConfigError(
                f"config key 'init_from' must be 'scratch', 'resume', one of {', '.join(HUB_NAMES)}, a "
                f"Hugging Face model directory or a checkpoint of this library (a ckpt_XXXXXX.pt file, "
                f"a ckpt_XXXXXX/ directory or a run's out_dir); got {self.init_from!r} (no such file "
                f"or directory)"
            )
        # torch.optim.Muon on FSDP's DTensor shards runs each Newton-Schulz matmul as collectives over whole
        # matrices, and the sharded checkpoint path knows torch optimizers only: not a combination we support
        if self.optimizer == "muon" and self.parallel != "ddp":
            raise ConfigError(
                f"optimizer='muon' is not supported with parallel={self.parallel!r}; use "
                "parallel='ddp', or optimizer='adamw' to shard"
            )
        self.check_tensor_parallel()
        if self.optimizer == "muon" and not hasattr(torch.optim, "Muon"):  # torch.optim.Muon arrived in torch 2.9
            raise ConfigError(
                f"optimizer='muon' needs torch.optim.Muon (torch >= 2.9), which torch "
                f"{torch.__version__} lacks: upgrade torch, or use optimizer='adamw'"
            )
        from gpt2train.shards import names_mixture  # no torch: the shard format

        if names_mixture(self.data_dir):
            from gpt2train.mixture import parse_mixture  # only for a mixture

            try:
                parse_mixture(self.data_dir)
            except ValueError as e:
                raise ConfigError(f"config key 'data_dir': {e}") from None
        if self.eval_tasks_interval:
            from gpt2train.tasks import parse_tasks  # no torch: the task catalogue

            try:
                parse_tasks(self.eval_tasks)
            except ValueError as e:
                raise ConfigError(f"config key 'eval_tasks': {e}") from None
        if self.head_lr is not None and self.tie_embeddings:
            raise ConfigError(
                "config key 'head_lr' needs tie_embeddings=False: a tied head is the token embedding (set embedding_lr)"
            )
        check_run_length({k: getattr(self, k) for k in RUN_LENGTH[1:]}, "the config")  # max_steps: always has one
        if self.min_lr > self.learning_rate:
            raise ConfigError(f"config key 'min_lr' must be <= learning_rate={self.learning_rate}; got {self.min_lr}")
        try:
            super().__post_init__()  # the model's own checks
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def check_tensor_parallel(self):
        """One line for a model that tensor_parallel cannot split: its ranks divide the heads (and so the MLP's
        4 * n_embd hidden units, a multiple of n_head); Muon and the value embeddings are not split yet."""
        tp = self.tensor_parallel
        if tp == 1:
            return
        if self.n_head % tp:
            raise ConfigError(f"tensor_parallel={tp} must divide n_head={self.n_head} (each rank computes whole heads)")
        for key, off in (("optimizer", "'adamw'"), ("value_embeds", "False")):
            if getattr(self, key) != getattr(TrainConfig, key):
                raise ConfigError(
                    f"tensor_parallel={tp} does not support {key}={getattr(self, key)!r} yet: set {key}={off} "
                    "or tensor_parallel=1"
                )


CHOICES = {
    "lr_schedule": ("cosine", "wsd"),
    "optimizer": ("adamw", "muon"),
    "nonfinite": ("skip", "halt"),
    "compile": (True, False, "auto"),
    "dtype": ("auto", "float32", "bfloat16", "float16"),
    "parallel": ("ddp", "fsdp", "hsdp"),
    "packing": ("window", "document"),
    "pipeline_schedule": ("1F1B", "GPipe"),
}
AT_LEAST_ONE = (
    "sample_tokens",
    "total_batch_size",
    "lr_decay_steps",
    "hellaswag_limit",
    "eval_tasks_limit",
    "shard_size",
    "pipeline_parallel",
    "pipeline_microbatches",
    "tensor_parallel",
)
NON_NEGATIVE = (
    "max_steps",
    "warmup_steps",
    "eval_interval",
    "hellaswag_interval",
    "eval_tasks_interval",
    "sample_interval",
    "log_interval",
    "save_interval",
    "keep_last",
    "seed",
    "max_skipped_steps",
    "min_lr",
    "weight_decay",
    "grad_clip",
    "muon_weight_decay",
    "cost_per_hour",
)
RANGES = {  # key: (check, what the message says); None passes where the key allows it
    **{k: (lambda v: v >= 1, ">= 1") for k in AT_LEAST_ONE},
    "batch_size": (lambda v: v == "auto" or v >= 1, ">= 1 or 'auto'"),
    "eval_steps": (lambda v: v == "all" or not isinstance(v, str) and v >= 1, ">= 1 or 'all'"),
    **{k: (lambda v: v >= 0, ">= 0") for k in NON_NEGATIVE},
    "learning_rate": (lambda v: v > 0, "> 0"),
    "max_seconds": (lambda v: v > 0, "> 0"),
    "target_flops": (lambda v: v > 0, "> 0"),
    "tokens_per_param": (lambda v: v > 0, "> 0"),
    "muon_lr": (lambda v: v > 0, "> 0"),
    "embedding_lr": (lambda v: v > 0, "> 0"),
    "head_lr": (lambda v: v > 0, "> 0"),
    "muon_momentum": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "dist_timeout_minutes": (lambda v: v > 0, "> 0"),
    "beta1": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "beta2": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "wsd_decay_frac": (lambda v: 0 <= v <= 1, "in [0, 1]"),
}
FIELD_TYPES = typing.get_type_hints(TrainConfig)


def config_docs():
    """{key: (default, comment)} read from the source of GPTConfig and TrainConfig (--help, docs/config.md's table)."""
    source = inspect.getsource(GPTConfig) + inspect.getsource(TrainConfig)
    comments = dict(re.findall(r"^\s+(\w+):[^#\n]*#\s*(.+)$", source, re.M))
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
        if tp in (int, str, dict) and isinstance(value, tp):
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
    return {
        key: check_value(key, value, path)
        for key, value in namespace.items()
        if not key.startswith("_") and not isinstance(value, types.ModuleType) and not callable(value)
    }


def parse_args(argv):
    """{key: value} the user set on this command line: config files in order, then --key=value (later wins).
    max_steps, max_seconds, target_flops and tokens_per_param each say how long a run trains (RUN_LENGTH), so one
    set later replaces another set earlier (a budget on the command line, a config file's max_steps); two in one
    config file or on the command line are ambiguous (which stops the run?): a ConfigError."""
    user, overrides = {}, {}
    for arg in argv:
        if not arg.startswith("--"):
            layer = read_config_file(arg)
            check_run_length(layer, arg)
            set_layer(user, layer)
            continue
        key, eq, raw = arg[2:].partition("=")
        if not eq:
            raise ConfigError(f"'{arg}': write overrides as --key=value")
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw  # a bare word: a string, if the key takes strings
        try:
            value = check_value(key, value, arg)
        except ConfigError:
            if key not in FIELD_TYPES or str not in typing.get_args(FIELD_TYPES[key]) + (FIELD_TYPES[key],):
                raise
            value = raw  # --out_dir=123 means the directory '123'
        overrides[key] = value
        check_run_length(overrides, "the command line")
        set_layer(user, {key: value})
    return user


RUN_LENGTH = ("max_steps", "max_seconds", "target_flops", "tokens_per_param")  # each says how long a run trains


def run_length_keys(keys):
    """The keys of RUN_LENGTH that `keys` sets (None, but for max_steps, sets nothing)."""
    return [k for k in RUN_LENGTH if k in keys and (k == "max_steps" or keys[k] is not None)]


def check_run_length(keys, where):
    """ConfigError where one place (a config file, the command line) sets two of RUN_LENGTH: which would stop it?"""
    both = run_length_keys(keys)
    if both == ["max_steps", "max_seconds"]:
        raise ConfigError(
            f"{where} sets both max_steps={keys['max_steps']} and max_seconds={keys['max_seconds']:g}: set one (a "
            "budget fixes max_steps from the first steps' timing)"
        )
    if len(both) > 1:
        a, b = both[:2]
        raise ConfigError(
            f"{where} sets both {a}={keys[a]:g} and {b}={keys[b]:g}: set one (each fixes how long the run trains)"
        )


def set_layer(user, keys):
    """user.update(keys), where a key of RUN_LENGTH set drops the others set earlier (a budget on the command line
    replaces a config file's max_steps)."""
    if run_length_keys(keys):
        for key in RUN_LENGTH:
            user.pop(key, None)
    user.update(keys)


def make_config(user, base=None):
    """A validated TrainConfig: defaults, then `base` (a checkpoint's config), then the preset named by
    the user (or the base), then the user's keys."""
    values = {k: v for k, v in (base or {}).items() if k in FIELD_TYPES}
    preset = user.get("preset", values.get("preset"))
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError(f"config key 'preset' must be one of {', '.join(map(repr, PRESETS))}; got {preset!r}")
        values.update(PRESETS[preset])
    values.update(user)
    if run_length_keys(user):  # a step count replaces the base's (a resume's) budget or horizon
        values.update({k: None for k in RUN_LENGTH[1:] if k not in user})
    return TrainConfig(**values)


def model_config(cfg, **overrides):
    """The GPTConfig part of a TrainConfig."""
    return GPTConfig(**{**{k: getattr(cfg, k) for k in MODEL_KEYS}, **overrides})


def batch_layout(cfg, world_size):
    """(tokens per optimizer step, accumulation steps): total_batch_size split over ranks and micro-batches."""
    tokens_per_micro = cfg.batch_size * cfg.block_size * world_size
    total = cfg.total_batch_size or tokens_per_micro
    if total % tokens_per_micro:
        raise ConfigError(
            f"total_batch_size={total} is not a multiple of batch_size*block_size*world_size"
            f" = {cfg.batch_size}*{cfg.block_size}*{world_size} = {tokens_per_micro}"
        )
    return total, total // tokens_per_micro


def config_table(cfg, user):
    """The resolved config under a legend line, one 'key  value' row per key; '*' marks the keys the user set
    (parse_args: in a config file or by --key=value)."""
    width = max(map(len, FIELD_TYPES))
    rows = [f"  {'*' if k in user else ' '} {k:<{width}}  {v!r}" for k, v in asdict(cfg).items()]
    return "\n".join(["config ('*' = set in a config file or by --key=value):", *rows])


def help_text(doc):
    """`python train.py --help`: a usage line, the script's docstring, then every key with its default and meaning."""
    keys = "\n".join(f"  {key} = {default!r}  # {comment}" for key, (default, comment) in config_docs().items())
    usage = "usage: train.py [CONFIG_FILE ...] [--key=value ...]"
    return f"{usage}\n\n{doc.strip()}\n\nkeys (default  # meaning):\n{keys}"
