"""How a run starts (fresh, resumed or fine-tuned) and saves to resume: train.py's side of checkpoints.

start() is the start-up protocol every rank runs alike: config, process group, agreement on the checkpoint, the
memory plan. resolve_config() turns the user's keys into the run's config: on init_from='resume' over the newest
checkpoint that verifies (resumed_config: the architecture and optimizer cannot change), on a fine-tuning init_from
with the checkpoint's architecture (fine_tune_config). Under torchrun only rank 0 hashes the checkpoint; the others
agree on its choice (agree_on_checkpoint). restore() and restore_rngs() put a run back where its checkpoint left it;
save() writes one with everything an exact resume needs. The files themselves are checkpoint.py's.

Tokenizers: the data's tokenizer (prepare_data.py's manifest) must be the one of the weights a run starts from
(check_tokenizer, in resolve_config: resume, a fine-tuning checkpoint, a Hugging Face directory); run_tokenizer()
gives the run's tokenizer, which save() puts in every checkpoint, and vocab_size from the data.
"""

from dataclasses import asdict, dataclass
from pathlib import Path

import torch.distributed as dist

import assets
import bpe
from checkpoint import (
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
from config import ARCH_KEYS, ConfigError, make_config, model_config
from console import is_rank0, launched_by_torchrun, log
from devices import rng_state, set_rng_state
from files import Halt
from memory import resolve_batch_size
from model import PRESETS
from parallel import check_shared_out_dir, setup, weights_finite
from tracking import check_tracking_available


def start(user):
    """(cfg, the checkpoint the run resumes from or None, Env, the run's tokenizer record: run_tokenizer), alike on
    every rank. The config is resolved before
    the process group exists; under torchrun a rank's error waits until every rank has joined (a rank that failed
    before would leave the others in the rendezvous until it times out) and is then raised on all of them by
    check_shared_out_dir, as is an out_dir some node cannot see. Only rank 0 hashes the checkpoint (a sharded
    one: its metadata, then every rank its share of the shards, verify_shards); every rank resumes from rank 0's
    choice (agree_on_checkpoint). Last, the memory plan (memory.resolve_batch_size): logged,
    a batch_size that cannot fit refused, batch_size='auto' resolved from it where the device is not probed."""
    cfg, ckpt, problem = resolve_config_or_defer(user)
    check_tracking_available(cfg.wandb_log, cfg.tensorboard_dir)  # every rank: all stop alike
    env = setup(cfg)
    cfg, ckpt, problem = agree_on_checkpoint(user, cfg, ckpt, problem, env)
    check_shared_out_dir(cfg.out_dir, ckpt and ckpt["step"], problem, env)
    verify_shards(ckpt, env)  # a sharded checkpoint under torchrun: every rank hashes its share, in parallel
    cfg, tokenizer = run_tokenizer(cfg, user, ckpt)  # vocab_size from the data's tokenizer, before the memory plan
    return resolve_batch_size(cfg, env), ckpt, env, tokenizer


def resolve_config(user, verify=True):
    """(TrainConfig, checkpoint dict or None). On init_from='resume' the newest checkpoint that verifies is
    loaded (a note names each newer one skipped, and why; verify=False: the newest complete one, unhashed);
    its config is the base the user's keys override (resumed_config); ckpt['path'] says where it was."""
    cfg = make_config(user)
    if cfg.init_from != "resume":
        if list_checkpoints(cfg.out_dir):
            raise ConfigError(
                f"{cfg.out_dir} already holds checkpoints; continue with --init_from=resume, "
                f"or pick another out_dir (or delete them) to start over"
            )
        if cfg.init_from != "scratch" and not is_checkpoint(cfg.init_from):  # pretrained weights, their tokenizer
            check_tokenizer(pretrained_tokenizer(cfg.init_from), cfg.data_dir, f"init_from={cfg.init_from!r}")
        return fine_tune_config(user, cfg) if is_checkpoint(cfg.init_from) else cfg, None
    if not list_checkpoints(cfg.out_dir):
        raise ConfigError(f"init_from='resume' but {cfg.out_dir} holds no checkpoint (ckpt_XXXXXX.pt or ckpt_XXXXXX/)")
    # a sharded checkpoint: its meta only; each rank reads its own shards later
    ckpt, path = load_latest_checkpoint(cfg.out_dir, consolidate=False, verify=verify)
    return resumed_config(user, cfg.out_dir, {**ckpt, "path": str(path)})


def pretrained_tokenizer(init_from):
    """The tokenizer record (bpe.tokenizer_record) of a Hugging Face model directory or hub name: its
    tokenizer.json where it has one, else GPT-2's."""
    own = Path(init_from) / "tokenizer.json"
    return bpe.tokenizer_record(
        bpe.HFTokenizer(own) if own.is_file() else assets.get_tokenizer(), source=own if own.is_file() else None
    )


def check_tokenizer(saved, data_dir, what):
    """ConfigError (one line naming both) unless data_dir's shards were tokenized with `saved`, the tokenizer record
    of the weights a run starts from (`what`: where they are); None (a checkpoint from before tokenizers were
    recorded) is GPT-2's. Data without a manifest (other tools' shards), or no data yet, is not checked here."""
    from data import NoShardsError, data_tokenizer

    try:
        data = data_tokenizer(data_dir)
    except NoShardsError:
        return  # make_loaders says how to prepare it
    saved = saved or {"id": "gpt2", "source": None}
    if data is not None and data["id"] != saved["id"]:

        def name(r):
            return r["id"] + (f" ({r['source']})" if r.get("source") else "")

        raise ConfigError(
            f"data_dir={data_dir!r} was tokenized with {name(data)}, but {what} with {name(saved)}; "
            f"prepare the data with the model's tokenizer (prepare_data.py --tokenizer) or start "
            f"from weights trained with the data's"
        )


def run_tokenizer(cfg, user, ckpt):
    """(cfg, the run's tokenizer record, bpe.tokenizer_record): the data's (prepare_data.py's manifest), else that
    of the weights it starts from (check_tokenizer has refused a mismatch). A run from scratch takes vocab_size from
    the data, the tokenizer's size padded to a multiple of 64, unless the config sets it (directly or by preset)."""
    from data import NoShardsError, data_tokenizer

    try:
        record = data_tokenizer(cfg.data_dir)
    except NoShardsError:
        record = None  # make_loaders says how to prepare it
    if record is None and ckpt is not None:
        record = ckpt.get("tokenizer")
    elif record is None and is_checkpoint(cfg.init_from):
        record = load_checkpoint(cfg.init_from, consolidate=False, verify=False).get("tokenizer")
    elif record is None and cfg.init_from not in ("scratch", "resume"):
        record = pretrained_tokenizer(cfg.init_from)
    chosen = {**PRESETS.get(user.get("preset"), {}), **user}
    if cfg.init_from == "scratch" and record and record.get("n_vocab") and "vocab_size" not in chosen:
        cfg = make_config({**asdict(cfg), "vocab_size": -(-record["n_vocab"] // 64) * 64})
    return cfg, record


def resumed_config(user, out_dir, ckpt):
    """(cfg, ckpt) of a run resuming from ckpt: the user's keys over the checkpoint's config; the architecture and
    the optimizer cannot change."""
    path = ckpt["path"]
    # the run stays in the out_dir it found the checkpoint in (the checkpoint's own may be another, if moved)
    cfg = make_config({**user, "out_dir": out_dir}, base=ckpt["config"])
    if cfg.optimizer != ckpt["config"]["optimizer"]:  # the saved state is the other optimizer's
        raise ConfigError(
            f"cannot change optimizer when resuming: the checkpoint {path} has "
            f"{ckpt['config']['optimizer']!r}, the config {cfg.optimizer!r}"
        )
    saved = model_config(cfg, **ckpt["model_args"])  # fields added since the checkpoint get their defaults
    for key in ARCH_KEYS:
        if getattr(cfg, key) != getattr(saved, key):
            raise ConfigError(
                f"cannot change {key} when resuming: the checkpoint {path} has "
                f"{getattr(saved, key)!r}, the config {getattr(cfg, key)!r}"
            )
    check_tokenizer(ckpt.get("tokenizer"), cfg.data_dir, f"the checkpoint {path}")
    return cfg, ckpt


def fine_tune_config(user, cfg):
    """cfg with the architecture of the checkpoint cfg.init_from names (train.build_model loads its weights); the
    step count, optimizer, schedule and data order stay this run's. An architecture key the user set (directly or
    through `preset`) that differs from the checkpoint's is a ConfigError."""
    ckpt = load_checkpoint(cfg.init_from, consolidate=False)
    saved = model_config(cfg, **ckpt["model_args"])  # fields added since the checkpoint get their defaults
    chosen = {**PRESETS.get(user.get("preset"), {}), **user}
    for key in ARCH_KEYS:
        if key in chosen and chosen[key] != getattr(saved, key):
            raise ConfigError(
                f"init_from={cfg.init_from!r}: the checkpoint has {key}={getattr(saved, key)!r}, the "
                f"config {key}={chosen[key]!r}; a fine-tuned model keeps its architecture: drop {key} "
                f"from the config"
            )
    check_tokenizer(ckpt.get("tokenizer"), cfg.data_dir, f"init_from={cfg.init_from!r}")
    return make_config({**user, **{key: getattr(saved, key) for key in ARCH_KEYS}})


def resolve_config_or_defer(user):
    """(cfg, checkpoint or None, error message or None): resolve_config, except that under torchrun its error is
    returned rather than raised. A rank that failed before joining the process group (a node that cannot see
    out_dir's checkpoints) would leave the others waiting in the rendezvous until it times out; instead every
    rank joins and check_shared_out_dir raises the error on all of them."""
    try:  # only rank 0 hashes the checkpoint (of a sharded one only the metadata: verify_shards hashes the rest,
        # every rank its share, once the process group is up); the others check that it is complete
        return (*resolve_config(user, verify=is_rank0() and ("meta" if launched_by_torchrun() else True)), None)
    except (ConfigError, CheckpointError) as e:
        if not launched_by_torchrun():
            raise
        return make_config(user), None, str(e)  # a bad key fails here alike on every rank: nobody waits


SETUP_KEYS = ("device", "dtype", "parallel", "shard_size", "seed", "dist_timeout_minutes")  # what setup() used


def agree_on_checkpoint(user, cfg, ckpt, problem, env):
    """Under torchrun only rank 0 sha256-hashed the checkpoint it resumes from (one read of an 18 GB file,
    not one per rank); a rank that chose another (rank 0 skipped a damaged one) loads rank 0's, unhashed.
    Returns (cfg, ckpt, problem); a problem is raised on every rank by check_shared_out_dir."""
    if not env.distributed or cfg.init_from != "resume":
        return cfg, ckpt, problem
    chosen = [ckpt and ckpt["path"]]
    dist.broadcast_object_list(chosen, src=0)
    if problem or chosen[0] is None or chosen[0] == (ckpt and ckpt["path"]):
        return cfg, ckpt, problem
    try:
        agreed, ckpt = resumed_config(
            user, cfg.out_dir, {**load_checkpoint(chosen[0], consolidate=False, verify=False), "path": chosen[0]}
        )
    except (ConfigError, CheckpointError) as e:
        return cfg, None, str(e)
    changed = [k for k in SETUP_KEYS if getattr(agreed, k) != getattr(cfg, k)]
    if changed:
        return (
            cfg,
            None,
            (
                f"rank 0 resumes from {chosen[0]}, whose {changed[0]} differs from that of the checkpoint "
                f"this rank found; resume again"
            ),
        )
    return agreed, ckpt, None


def verify_shards(ckpt, env):
    """A sharded checkpoint resumed under torchrun: rank 0 hashed its metadata before the process group started;
    now every rank hashes its share of the shard files (every world_size-th of SHA256SUMS' names), all in
    parallel, rather than rank 0 alone hashing the whole checkpoint (80 GB at 6.7B) against the rendezvous
    timeout. All ranks agree: a damaged shard is the same CheckpointError on every rank."""
    if not env.distributed or ckpt is None or "shards" not in ckpt:
        return
    try:
        names = sorted(set(read_checksums(checksum_path(ckpt["shards"]))) - META_FILES)
        verify_checkpoint(ckpt["shards"], only=set(names[env.rank :: env.world_size]))
        problem = None
    except (CheckpointError, OSError, ValueError) as e:
        problem = str(e)
    problems = [None] * env.world_size
    dist.all_gather_object(problems, problem)
    found = [p for p in problems if p]
    if found:
        raise CheckpointError(
            f"{found[0]}; move {ckpt['shards']} aside and resume again (the newest intact checkpoint is then used)"
        )


@dataclass
class Progress:
    """What the loop carries from step to step and a checkpoint carries across a restart."""

    step: int = 0
    best_step: int | None = None
    best_val: float | None = None
    skipped_in_a_row: int = 0


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


def kept_checkpoint(out_dir):
    """What a halted run leaves to resume from, for its error message."""
    found = list_checkpoints(out_dir)
    if not found:
        return "no checkpoint was written yet"
    return f"the last checkpoint, {found[-1][1]}, is kept (continue with --init_from=resume)"


def save(out_dir, val, progress, raw_model, optimizer, scaler, loader, tracker, cfg, env, tokenizer=None):
    """Write a checkpoint holding everything an exact resume needs, then prune old ones: ckpt_{step}.pt from
    rank 0, or in a sharded run the directory ckpt_{step}/ to which every rank writes its own shards.
    `tokenizer`: the run's bpe.tokenizer_record (its tokenizer.json text, a str, goes along: a checkpoint moved
    to another machine still samples); None is GPT-2's."""
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
    config = {**asdict(cfg), "batch_size": loader.B}  # the live micro-batch: an out-of-memory may have halved it
    meta = {
        "model_args": asdict(raw_model.config),
        "config": config,
        "step": step,
        "scaler": scaler.state_dict() if scaler.is_enabled() else None,
        "loader": loader.state_dict(),
        "rng": rngs,
        "val_loss": val,
        "best_step": progress.best_step,
        "best_val_loss": progress.best_val,
        "tracker": tracker.state_dict(),
        "format": FORMAT,
        "tokenizer": tokenizer,
    }
    path = checkpoint_path(out_dir, step, sharded=env.sharded)
    if env.sharded:
        save_sharded_checkpoint(path, meta, raw_model, optimizer)
    else:
        save_checkpoint(path, {**meta, "model": raw_model.state_dict(), "optimizer": optimizer.state_dict()})
    if env.master:
        prune_checkpoints(out_dir, cfg.keep_last, keep_steps={progress.best_step})
        log(f"step {step}: saved {path}")
