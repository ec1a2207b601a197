"""How a run starts (fresh, resumed or fine-tuned) and saves to resume: train.py's side of checkpoints.

start() is the start-up protocol every rank runs alike: config, process group, agreement on the checkpoint, the
memory plan; it decides once what the run starts from (Source: scratch, a resume, a checkpoint to fine-tune or
pretrained weights; the checkpoint file and the data's manifests are each read once). resolve_config() turns the
user's keys into the run's config: on init_from='resume' over the newest checkpoint that verifies (resumed_config:
the architecture and optimizer cannot change), on a fine-tuning init_from with the checkpoint's architecture
(fine_tune_config). Under torchrun only rank 0 hashes the checkpoint; the others agree on its choice
(agree_on_checkpoint). restore() and restore_rngs() put a run back where its checkpoint left it; Checkpointer.save()
writes one with everything an exact resume needs. The files themselves are checkpoint.py's.

Tokenizers: the data's tokenizer (prepare_data.py's manifest) must be the one of the weights a run starts from
(check_tokenizer, in resolve_config: resume, a fine-tuning checkpoint, a Hugging Face directory); run_tokenizer()
gives the run's tokenizer, which Checkpointer.save() puts in every checkpoint, and vocab_size from the data.
"""

import difflib
from dataclasses import asdict, dataclass
from pathlib import Path

import torch.distributed as dist

from gpt2train import assets, bpe
from gpt2train.checkpoint import (
    FORMAT,
    META_FILES,
    CheckpointError,
    checkpoint_path,
    checksum_path,
    is_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_latest_checkpoint,
    load_optimizer_state,
    load_sharded_checkpoint,
    prune_checkpoints,
    read_checksums,
    save_checkpoint,
    save_sharded_checkpoint,
    verify_checkpoint,
)
from gpt2train.config import ARCH_KEYS, ConfigError, make_config, model_config
from gpt2train.console import is_rank0, launched_by_torchrun, log
from gpt2train.data import NoShardsError, data_tokenizer, read_manifests
from gpt2train.devices import rng_state, set_rng_state
from gpt2train.documents import prepare_command
from gpt2train.files import Halt
from gpt2train.memory import resolve_batch_size
from gpt2train.parallel import check_shared_out_dir, setup, weights_finite
from gpt2train.tracking import check_tracking_available
from model import PRESETS, GPTConfig


@dataclass
class Source:
    """What a run starts from, decided once by start(). kind: 'scratch'; 'resume' (state: the checkpoint it
    continues, a sharded one's meta with its directory in state['shards'], state['path'] where it was found);
    'checkpoint' (fine-tunes the weights of the checkpoint file or directory init_from names: state, read once,
    its optimizer state dropped); 'pretrained' (a Hugging Face directory or hub name, loaded when the model is
    built). model: the GPTConfig the model will have, known before it is built (None for a Hugging Face directory:
    only loading it tells). tokenizer: the run's tokenizer record (bpe.tokenizer_record), which every checkpoint
    keeps. manifests: the data's prep manifests (data.read_manifests), read once; the loaders take them."""

    kind: str
    state: dict | None = None
    model: GPTConfig | None = None
    tokenizer: dict | None = None
    manifests: dict | None = None

    @property
    def resumed(self):
        """The checkpoint the run continues (kind 'resume'), else None."""
        return self.state if self.kind == "resume" else None


def source_kind(init_from):
    """The one classification of init_from: 'scratch', 'resume', 'checkpoint' or 'pretrained'."""
    if init_from in ("scratch", "resume"):
        return init_from
    return "checkpoint" if is_checkpoint(init_from) else "pretrained"


def start(user):
    """(cfg, Source, Env), alike on every rank. The config is resolved before the process group exists; under
    torchrun a rank's error waits until every rank has joined (a rank that failed before would leave the others in
    the rendezvous until it times out) and is then raised on all of them by check_shared_out_dir, as is an out_dir
    some node cannot see. Only rank 0 hashes the checkpoint (a sharded one: its metadata, then every rank its share
    of the shards, verify_shards); every rank resumes from rank 0's choice (agree_on_checkpoint). A sharded one
    that the ranks find damaged is skipped with a note, as one process skips it, and the choice made again among
    the older ones: every rank then resumes from the same older checkpoint. Then the run's
    tokenizer (run_tokenizer) and last the memory plan (memory.resolve_batch_size): logged, a batch_size that
    cannot fit refused, batch_size='auto' resolved from it where the device is not probed."""
    cfg, source, problem = resolve_config_or_defer(user)
    check_tracking_available(cfg.wandb_log, cfg.tensorboard_dir)  # every rank: all stop alike
    env = setup(cfg)
    started, damaged = cfg, {}  # damaged: {path: reason} of sharded checkpoints verify_shards refused
    while True:
        cfg, source, problem = agree_on_checkpoint(user, cfg, source, problem, env)
        problem = problem or setup_changed(started, cfg, source)
        check_shared_out_dir(cfg.out_dir, source.resumed and source.resumed["step"], problem, env)
        reason = verify_shards(source.resumed, env)  # a sharded checkpoint under torchrun: each rank its share
        if reason is None:
            break
        # as one process does (load_latest_checkpoint): skip it, with a note, and resume from the one before
        log(f"skipping {reason}", note=True)
        damaged[source.resumed["path"]] = reason
        cfg, source, problem = resolve_config_or_defer(user, damaged)
    cfg = run_tokenizer(cfg, user, source)  # vocab_size from the data's tokenizer, before the memory plan
    source.model = planned_model(cfg, source.kind)
    return resolve_batch_size(cfg, env, source.model), source, env


def planned_model(cfg, kind):
    """The GPTConfig the model will have, known before it is built; None for a Hugging Face directory. A resumed
    or fine-tuned run's cfg has its checkpoint's architecture (resolve_config)."""
    if kind != "pretrained":
        return model_config(cfg)
    return model_config(cfg, **PRESETS[cfg.init_from]) if cfg.init_from in PRESETS else None


def resolve_config(user, verify=True, damaged=None):
    """(TrainConfig, Source). On init_from='resume' the newest checkpoint that verifies is loaded (a note names each
    newer one skipped, and why; verify=False: the newest complete one, unhashed; damaged: checkpoints found damaged
    already, skipped); its config is the base the user's keys override (resumed_config). The data's manifests are
    read here, once, from the run's data_dir (on resume the checkpoint's unless the user sets one). A checkpoint to
    fine-tune is read once, its architecture taken (fine_tune_config). The data's tokenizer must be the one of the
    weights the run starts from (check_tokenizer)."""
    cfg = make_config(user)
    kind = source_kind(cfg.init_from)
    if kind != "resume" and list_checkpoints(cfg.out_dir):
        raise ConfigError(
            f"{cfg.out_dir} already holds checkpoints; continue with --init_from=resume, "
            f"or pick another out_dir (or delete them) to start over"
        )
    data_dir = cfg.data_dir
    if kind == "resume":
        if not list_checkpoints(cfg.out_dir):
            raise ConfigError(
                f"init_from='resume' but {cfg.out_dir} holds no checkpoint (ckpt_XXXXXX.pt or ckpt_XXXXXX/)"
            )
        # a sharded checkpoint: its meta only; each rank reads its own shards later
        ckpt, path = load_latest_checkpoint(cfg.out_dir, consolidate=False, verify=verify, damaged=damaged)
        ckpt = {**ckpt, "path": str(path)}
        data_dir = user.get("data_dir", ckpt["config"].get("data_dir", data_dir))  # the checkpoint's, unless set
    manifests = data_manifests(data_dir)
    source = Source(kind, tokenizer=data_tokenizer(manifests) if manifests else None, manifests=manifests)
    if kind == "pretrained":  # its tokenizer
        check_tokenizer(
            pretrained_tokenizer(cfg.init_from), source.tokenizer, cfg.data_dir, f"init_from={cfg.init_from!r}"
        )
    elif kind == "checkpoint":
        source.state = load_checkpoint(cfg.init_from, consolidate=False)
        source.state.pop("optimizer", None)  # a fine-tune starts its own
        cfg = fine_tune_config(user, cfg, source)
    elif kind == "resume":
        cfg, source.state = resumed_config(user, cfg.out_dir, ckpt, source.tokenizer)
    return cfg, source


def data_manifests(data_dir):
    """data.read_manifests of data_dir. No train shards there (no such directory, or not prepared yet) is a
    NoShardsError saying how to prepare it, and naming a sibling directory of a near name: found before anything
    else of the run is planned or printed."""
    try:
        return read_manifests(data_dir)
    except NoShardsError as e:
        missing = e.data_dir or data_dir  # of a mixture, the source that is missing
        path = Path(missing)
        near = (
            [] if path.exists() or not path.parent.is_dir() else [p.name for p in path.parent.iterdir() if p.is_dir()]
        )
        close = difflib.get_close_matches(path.name, near, n=1)
        hint = f" (did you mean '{path.parent / close[0]}'?)" if close else ""
        raise NoShardsError(f"{e}{hint}; prepare it with {prepare_command(missing)}", missing) from None


def pretrained_tokenizer(init_from):
    """The tokenizer record (bpe.tokenizer_record) of a Hugging Face model directory or hub name: its
    tokenizer.json where it has one, else GPT-2's."""
    own = Path(init_from) / "tokenizer.json"
    return bpe.tokenizer_record(
        bpe.HFTokenizer(own) if own.is_file() else assets.get_tokenizer(), source=own if own.is_file() else None
    )


def check_tokenizer(saved, data, data_dir, what):
    """ConfigError (one line naming both) unless data_dir's shards were tokenized (`data`: the tokenizer record its
    manifests give) with `saved`, the tokenizer record of the weights a run starts from (`what`: where they are);
    None (a checkpoint from before tokenizers were recorded) is GPT-2's. Data without a manifest (other tools'
    shards), or no data yet, is not checked here."""
    saved = saved or {"id": "gpt2", "source": None}
    if data is not None and data["id"] != saved["id"]:

        def name(r):
            return r["id"] + (f" ({r['source']})" if r.get("source") else "")

        raise ConfigError(
            f"data_dir={data_dir!r} was tokenized with {name(data)}, but {what} with {name(saved)}; "
            f"prepare the data with the model's tokenizer (prepare_data.py --tokenizer) or start "
            f"from weights trained with the data's"
        )


def run_tokenizer(cfg, user, source):
    """cfg, with source.tokenizer set to the run's tokenizer record: the data's (prepare_data.py's manifest), else
    that of the weights it starts from (check_tokenizer has refused a mismatch). A run from scratch takes vocab_size
    from the data, the tokenizer's size padded to a multiple of 64, unless the config sets it (directly or by
    preset)."""
    if source.tokenizer is None and source.state is not None:
        source.tokenizer = source.state.get("tokenizer")
    elif source.tokenizer is None and source.kind == "pretrained":
        source.tokenizer = pretrained_tokenizer(cfg.init_from)
    record = source.tokenizer
    chosen = {**PRESETS.get(user.get("preset"), {}), **user}
    if source.kind == "scratch" and record and record.get("n_vocab") and "vocab_size" not in chosen:
        cfg = make_config({**asdict(cfg), "vocab_size": -(-record["n_vocab"] // 64) * 64})
    return cfg


def resumed_config(user, out_dir, ckpt, data_tokenizer):
    """(cfg, ckpt) of a run resuming from ckpt: the user's keys over the checkpoint's config; the architecture, the
    optimizer, its groups and the budget (max_seconds) cannot change, nor the tokenizer of the data (data_tokenizer:
    its record, or None)."""
    path = ckpt["path"]
    # the run stays in the out_dir it found the checkpoint in (the checkpoint's own may be another, if moved)
    cfg = make_config({**user, "out_dir": out_dir}, base=ckpt["config"])
    if cfg.optimizer != ckpt["config"]["optimizer"]:  # the saved state is the other optimizer's
        raise ConfigError(
            f"cannot change optimizer when resuming: the checkpoint {path} has "
            f"{ckpt['config']['optimizer']!r}, the config {cfg.optimizer!r}"
        )
    for key in ("embedding_lr", "head_lr"):  # set or not, they decide the saved optimizer's groups; values may change
        if (getattr(cfg, key) is None) != (ckpt["config"].get(key) is None):
            raise ConfigError(
                f"cannot set or unset {key} when resuming: the checkpoint {path} has "
                f"{ckpt['config'].get(key)!r}, the config {getattr(cfg, key)!r} (its value may change, not whether "
                "it is set: the saved optimizer state has its groups)"
            )
    budget = ckpt["config"].get("max_seconds")
    if cfg.max_seconds is not None and cfg.max_seconds != budget:  # its max_steps was fixed by (or without) a budget
        raise ConfigError(
            f"cannot change max_seconds when resuming: the checkpoint {path} has max_seconds={budget!r} and "
            f"max_steps={ckpt['config']['max_steps']}; a budget fixes max_steps once, at the start of a run: set "
            "--max_steps to train on"
        )
    saved = model_config(cfg, **ckpt["model_args"])  # fields added since the checkpoint get their defaults
    for key in ARCH_KEYS:
        if getattr(cfg, key) != getattr(saved, key):
            raise ConfigError(
                f"cannot change {key} when resuming: the checkpoint {path} has "
                f"{getattr(saved, key)!r}, the config {getattr(cfg, key)!r}"
            )
    check_tokenizer(ckpt.get("tokenizer"), data_tokenizer, cfg.data_dir, f"the checkpoint {path}")
    return cfg, ckpt


def fine_tune_config(user, cfg, source):
    """cfg with the architecture of the checkpoint (source.state) that cfg.init_from names (train.build_model loads
    its weights); the step count, optimizer, schedule and data order stay this run's. An architecture key the user
    set (directly or through `preset`) that differs from the checkpoint's is a ConfigError."""
    saved = model_config(cfg, **source.state["model_args"])  # fields added since the checkpoint get their defaults
    chosen = {**PRESETS.get(user.get("preset"), {}), **user}
    for key in ARCH_KEYS:
        if key in chosen and chosen[key] != getattr(saved, key):
            raise ConfigError(
                f"init_from={cfg.init_from!r}: the checkpoint has {key}={getattr(saved, key)!r}, the "
                f"config {key}={chosen[key]!r}; a fine-tuned model keeps its architecture: drop {key} "
                f"from the config"
            )
    check_tokenizer(source.state.get("tokenizer"), source.tokenizer, cfg.data_dir, f"init_from={cfg.init_from!r}")
    return make_config({**user, **{key: getattr(saved, key) for key in ARCH_KEYS}})


def resolve_config_or_defer(user, damaged=None):
    """(cfg, Source, error message or None): resolve_config, except that under torchrun its error is
    returned rather than raised. A rank that failed before joining the process group (a node that cannot see
    out_dir's checkpoints) would leave the others waiting in the rendezvous until it times out; instead every
    rank joins and check_shared_out_dir raises the error on all of them."""
    try:  # only rank 0 hashes the checkpoint (of a sharded one only the metadata: verify_shards hashes the rest,
        # every rank its share, once the process group is up); the others check that it is complete
        verify = is_rank0() and ("meta" if launched_by_torchrun() else True)
        return (*resolve_config(user, verify, damaged), None)
    except (ConfigError, CheckpointError) as e:
        if not launched_by_torchrun():
            raise
        cfg = make_config(user)  # a bad key fails here alike on every rank: nobody waits
        return cfg, Source(source_kind(cfg.init_from)), str(e)


# what setup() used
SETUP_KEYS = ("device", "dtype", "parallel", "shard_size", "tensor_parallel", "seed", "dist_timeout_minutes")


def agree_on_checkpoint(user, cfg, source, problem, env):
    """Under torchrun only rank 0 sha256-hashed the checkpoint it resumes from (one read of an 18 GB file,
    not one per rank); a rank that chose another (rank 0 skipped a damaged one) loads rank 0's, unhashed.
    Returns (cfg, source, problem); a problem is raised on every rank by check_shared_out_dir."""
    if not env.distributed or source.kind != "resume":
        return cfg, source, problem
    mine = source.state and source.state["path"]
    chosen = [mine]
    dist.broadcast_object_list(chosen, src=0)
    if problem or chosen[0] is None or chosen[0] == mine:
        return cfg, source, problem
    try:
        ckpt = {**load_checkpoint(chosen[0], consolidate=False, verify=False), "path": chosen[0]}
        agreed, source.state = resumed_config(user, cfg.out_dir, ckpt, source.tokenizer)
    except (ConfigError, CheckpointError) as e:
        source.state = None
        return cfg, source, str(e)
    return agreed, source, None


def setup_changed(started, cfg, source):
    """The problem (or None) of a checkpoint chosen after setup() ran with `started` (rank 0 chose another than
    this rank, or the ranks skipped a damaged one) whose config would have set the process group up otherwise."""
    changed = [k for k in SETUP_KEYS if getattr(cfg, k) != getattr(started, k)]
    if changed and source.resumed:
        return (
            f"{source.resumed['path']}: its {changed[0]} differs from that of the checkpoint the run set up with; "
            f"resume again"
        )
    return None


def verify_shards(ckpt, env):
    """A sharded checkpoint resumed under torchrun: rank 0 hashed its metadata before the process group started;
    now every rank hashes its share of the shard files (every world_size-th of SHA256SUMS' names), all in
    parallel, rather than rank 0 alone hashing the whole checkpoint (80 GB at 6.7B) against the rendezvous
    timeout. Returns None, or the reason it is damaged: the same on every rank (the first rank's that found one)."""
    if not env.distributed or ckpt is None or "shards" not in ckpt:
        return None
    try:
        names = sorted(set(read_checksums(checksum_path(ckpt["shards"]))) - META_FILES)
        verify_checkpoint(ckpt["shards"], only=set(names[env.rank :: env.world_size]))
        problem = None
    except (CheckpointError, OSError, ValueError) as e:
        problem = str(e)
    problems = [None] * env.world_size
    dist.all_gather_object(problems, problem)
    return next((p for p in problems if p), None)


@dataclass
class Progress:
    """What the loop carries from step to step and a checkpoint carries across a restart."""

    step: int = 0
    best_step: int | None = None
    best_val: float | None = None
    skipped_in_a_row: int = 0


def restore(ckpt, raw_model, optimizer, scaler, loader):
    """Optimizer (and from a sharded checkpoint the weights, resharded to this run's layout), loss scaler and
    loader position from a checkpoint; returns the Progress it recorded. Every rank calls it. The optimizer's
    kernel (fused, foreach) stays this run's: a fused checkpoint resumes where fused AdamW cannot run (tensor
    parallelism mixes plain tensors and DTensors: optim.adamw)."""
    kernels = [{k: group[k] for k in ("fused", "foreach") if k in group} for group in optimizer.param_groups]
    if "shards" in ckpt:
        load_sharded_checkpoint(ckpt["shards"], raw_model, optimizer)
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
    moved to another machine still samples); None is GPT-2's."""

    def __init__(self, cfg, env, states, tokenizer=None):
        self.cfg, self.env, self.states, self.tokenizer = cfg, env, states, tokenizer

    def save(self, progress, val=None):
        """Write a checkpoint holding everything an exact resume needs at progress.step (val: the val loss there,
        which keeps the best checkpoint), then prune old ones: ckpt_{step}.pt from rank 0, or in a sharded run the
        directory ckpt_{step}/ to which every rank writes its own shards. Every rank calls it."""
        env, raw_model, loader = self.env, self.states["model"], self.states["loader"]
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
            "config": {**asdict(self.cfg), "batch_size": loader.B},
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
            save_sharded_checkpoint(path, meta, raw_model, optimizer)
        else:
            save_checkpoint(path, {**meta, "model": raw_model.state_dict(), "optimizer": optimizer.state_dict()})
        if env.master:
            prune_checkpoints(self.cfg.out_dir, self.cfg.keep_last, keep_steps={progress.best_step})
            log(f"step {step}: saved {path}")
