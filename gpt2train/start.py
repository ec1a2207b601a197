"""What a run starts from, decided once, alike on every rank: start() resolves the user's keys into the run's config
(on init_from='resume' over the newest checkpoint that verifies; on a fine-tuning init_from with the checkpoint's
architecture), joins the process group, makes sure every rank sees one out_dir and agrees on the checkpoint, and
returns the config, the Env and a frozen Source (the checkpoint, the planned model shape, the tokenizer, the data's
manifests: each file read once). The config is built once on a fresh start and at most twice on a resume (the
user's keys alone, checked first; then over the checkpoint's config); resolving batch_size='auto' or
activation_checkpointing='auto' (the memory plan, in train.run()) replaces it once more. lock_out_dir() holds the
out_dir for the whole run (train.main). resume.py restores and saves; the files themselves are checkpoint.py's.

Tokenizers: the data's tokenizer (prepare_data.py's manifest) must be the one of the weights a run starts from
(check_tokenizer: resume, a fine-tuning checkpoint, a Hugging Face directory); run_tokenizer() gives the run's
tokenizer, which every checkpoint keeps; a run from scratch takes vocab_size from the data's.
"""

import contextlib
import difflib
import os
import socket
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch.distributed as dist

from gpt2train import assets, bpe
from gpt2train.checkpoint import (
    META_FILES,
    CheckpointError,
    checksum_path,
    is_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_latest_checkpoint,
    read_checksums,
    verify_checkpoint,
)
from gpt2train.config import ARCH_KEYS, ConfigError, TrainConfig, make_config, model_config
from gpt2train.console import is_rank0, launched_by_torchrun, log
from gpt2train.documents import prepare_command
from gpt2train.files import directory_lock
from gpt2train.manifests import data_tokenizer, read_manifests, tokenizer_name
from gpt2train.parallel import rank_ranges, setup
from gpt2train.shards import NoShardsError, ShardError
from gpt2train.tracking import check_tracking_available
from model import PRESETS, GPTConfig

DEFAULTS = {f.name: f.default for f in fields(TrainConfig)}


@dataclass(frozen=True)
class Source:
    """What a run starts from, decided once by start(), then read only. kind: 'scratch'; 'resume' (state: the
    checkpoint it continues, a sharded one's meta with its directory in state['shards'], state['path'] where it
    was found); 'checkpoint' (fine-tunes the weights of the checkpoint file or directory init_from names: state,
    read once, its optimizer state dropped); 'pretrained' (a Hugging Face directory or hub name, loaded when the
    model is built). model: the GPTConfig the model will have, known before it is built (None for a Hugging Face
    directory: only loading it tells). tokenizer: the run's tokenizer record (bpe.tokenizer_record), which every
    checkpoint keeps. manifests: the data's prep manifests (manifests.read_manifests), read once; the loaders take
    them."""

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
    the older ones: every rank then resumes from the same older checkpoint. Last, the run's tokenizer
    (run_tokenizer) and the model's planned shape."""
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
    return cfg, replace(source, model=planned_model(cfg, source.kind), tokenizer=run_tokenizer(cfg, source)), env


def planned_model(cfg, kind):
    """The GPTConfig the model will have, known before it is built; None for a Hugging Face directory. A resumed
    or fine-tuned run's cfg has its checkpoint's architecture (resolve_config)."""
    if kind != "pretrained":
        return model_config(cfg)
    return model_config(cfg, **PRESETS[cfg.init_from]) if cfg.init_from in PRESETS else None


def setting(user, key):
    """What the config will hold for `key` (one no preset sets), before it is built: the user's value or the default."""
    return user.get(key, DEFAULTS[key])


def resolve_config(user, verify=True, damaged=None):
    """(TrainConfig, Source). A run from scratch builds its config once, with the data's vocab_size (data_vocab);
    any other first checks the user's keys (init_from must name something), then on init_from='resume' loads the
    newest checkpoint that verifies (a note names each newer one skipped, and why; verify=False: the newest
    complete one, unhashed; damaged: checkpoints found damaged already, skipped) and builds the config again over
    its config (resumed_config). The data's manifests are read here, once, from the run's data_dir (on resume the
    checkpoint's unless the user sets one). A checkpoint to fine-tune is read once, its architecture taken
    (fine_tune_config). The data's tokenizer must be the one of the weights the run starts from (check_tokenizer)."""
    kind, out_dir = source_kind(setting(user, "init_from")), setting(user, "out_dir")
    if kind != "resume" and list_checkpoints(out_dir):
        raise ConfigError(
            f"{out_dir} already holds checkpoints; continue with --init_from=resume, "
            f"or pick another out_dir (or delete them) to start over"
        )
    if kind == "scratch":
        manifests = data_manifests(setting(user, "data_dir"))
        tokenizer = data_tokenizer(manifests) if manifests else None
        return make_config(data_vocab(user, tokenizer)), Source(kind, tokenizer=tokenizer, manifests=manifests)
    cfg = make_config(user)
    data_dir = cfg.data_dir
    if kind == "resume":
        if not list_checkpoints(out_dir):
            raise ConfigError(f"init_from='resume' but {out_dir} holds no checkpoint (ckpt_XXXXXX.pt or ckpt_XXXXXX/)")
        # a sharded checkpoint: its meta only; each rank reads its own shards later
        ckpt, path = load_latest_checkpoint(out_dir, consolidate=False, verify=verify, damaged=damaged)
        ckpt = {**ckpt, "path": str(path)}
        data_dir = user.get("data_dir", ckpt["config"].get("data_dir", data_dir))  # the checkpoint's, unless set
    manifests = data_manifests(data_dir)
    tokenizer, state = data_tokenizer(manifests) if manifests else None, None
    if kind == "pretrained":  # its tokenizer
        check_tokenizer(pretrained_tokenizer(cfg.init_from), tokenizer, cfg.data_dir, f"init_from={cfg.init_from!r}")
    elif kind == "checkpoint":
        state = load_checkpoint(cfg.init_from, consolidate=False)
        state.pop("optimizer", None)  # a fine-tune starts its own
        cfg = fine_tune_config(user, cfg, state, tokenizer)
    else:
        cfg, state = resumed_config(user, out_dir, ckpt, tokenizer)
    return cfg, Source(kind, state, tokenizer=tokenizer, manifests=manifests)


def data_vocab(user, record):
    """The user's keys, with vocab_size from the data's tokenizer record (its size padded to a multiple of 64)
    unless the config sets it (directly or by preset)."""
    chosen = {**PRESETS.get(user.get("preset"), {}), **user}
    if not record or not record.get("n_vocab") or "vocab_size" in chosen:
        return user
    return {**user, "vocab_size": -(-record["n_vocab"] // 64) * 64}


def data_manifests(data_dir):
    """manifests.read_manifests of data_dir. No train shards there (no such directory, or not prepared yet) is a
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
    except ShardError:
        raise
    except ValueError as e:  # a malformed mixture (mixture.parse_mixture), read before make_config checks data_dir
        raise ConfigError(f"config key 'data_dir': {e}") from None


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
        raise ConfigError(
            f"data_dir={data_dir!r} was tokenized with {tokenizer_name(data)}, but {what} with "
            f"{tokenizer_name(saved)}; prepare the data with the model's tokenizer (prepare_data.py --tokenizer) or "
            f"start from weights trained with the data's"
        )


def run_tokenizer(cfg, source):
    """The run's tokenizer record: the data's (prepare_data.py's manifest), else that of the weights it starts from
    (check_tokenizer has refused a mismatch)."""
    if source.tokenizer is None and source.state is not None:
        return source.state.get("tokenizer")
    if source.tokenizer is None and source.kind == "pretrained":
        return pretrained_tokenizer(cfg.init_from)
    return source.tokenizer


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


def fine_tune_config(user, cfg, state, data_tokenizer):
    """cfg with the architecture of the checkpoint (state) that cfg.init_from names (train.build_model loads
    its weights); the step count, optimizer, schedule and data order stay this run's. An architecture key the user
    set (directly or through `preset`) that differs from the checkpoint's is a ConfigError."""
    saved = model_config(cfg, **state["model_args"])  # fields added since the checkpoint get their defaults
    chosen = {**PRESETS.get(user.get("preset"), {}), **user}
    for key in ARCH_KEYS:
        if key in chosen and chosen[key] != getattr(saved, key):
            raise ConfigError(
                f"init_from={cfg.init_from!r}: the checkpoint has {key}={getattr(saved, key)!r}, the "
                f"config {key}={chosen[key]!r}; a fine-tuned model keeps its architecture: drop {key} "
                f"from the config"
            )
    check_tokenizer(state.get("tokenizer"), data_tokenizer, cfg.data_dir, f"init_from={cfg.init_from!r}")
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
SETUP_KEYS = (
    "device",
    "dtype",
    "parallel",
    "shard_size",
    "pipeline_parallel",
    "tensor_parallel",
    "seed",
    "dist_timeout_minutes",
)


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
        agreed, state = resumed_config(user, cfg.out_dir, ckpt, source.tokenizer)
    except (ConfigError, CheckpointError) as e:
        return cfg, replace(source, state=None), str(e)
    return agreed, replace(source, state=state), None


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


# ----------------------------------------------------------------------------- the out_dir


def lock_out_dir(out_dir):
    """One run per out_dir: rank 0 holds an exclusive lock on it (files.directory_lock) for the whole run;
    a second run there is a one-line error naming the holder. The other ranks of a torchrun job don't lock."""
    if not is_rank0():
        return contextlib.nullcontext()
    return directory_lock(out_dir, "train.py")


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
        with contextlib.suppress(OSError):
            sees = marker.read_text() == token[0]
        if sees or env.master:
            break
        time.sleep(0.5)
    ranks = [None] * env.world_size
    dist.all_gather_object(
        ranks, {"host": socket.gethostname(), "sees": sees, "problem": problem, "resumed_step": resumed_step}
    )
    if env.master:
        marker.unlink(missing_ok=True)
    blind = [r for r, info in enumerate(ranks) if not info["sees"]]
    if blind and not ranks[0]["problem"]:
        hosts = sorted({ranks[r]["host"] for r in blind})
        raise ConfigError(
            f"out_dir {out_dir} must be storage shared by every node: rank(s) {rank_ranges(blind)} on "
            f"{', '.join(hosts)} do not see the file rank 0 ({ranks[0]['host']}) wrote there "
            f"(node-local disk?); use a path on a shared filesystem"
        )
    failed = [(r, info) for r, info in enumerate(ranks) if info["problem"]]
    if failed:
        r, info = failed[0]
        raise ConfigError(f"rank {r} ({info['host']}): {info['problem']}")
    resumed = sorted({str(info["resumed_step"]) for info in ranks})
    if len(resumed) > 1:
        raise ConfigError(
            f"ranks resumed from checkpoints of different steps ({', '.join(resumed)}) in out_dir "
            f"{out_dir}: every node must see the same shared directory"
        )
