"""Checkpoints: what one holds, finding the newest good one in an out_dir, reading any of them (a file, a sharded
directory or an out_dir) safely, pruning old ones, consolidating a sharded one and a model read from one (the root
checkpoint.py is the command over them). Writing and verifying a file is checkpoint_file.py's, the sharded (DCP) form
sharded.py's; how a training run resumes from them is resume.py's; how the commands open a model, loading.py's.

A checkpoint is out_dir/ckpt_{step:06d}.pt, a torch.save'd dict of tensors and plain Python
containers only, so it loads with torch.load(weights_only=True) (no pickled code runs):

    model       state_dict of the bare GPT (no 'module.' / '_orig_mod.' prefixes)
    model_args  dict of GPTConfig fields        config     dict of TrainConfig fields
    step        optimizer steps done             optimizer  AdamW state_dict
    scaler      GradScaler state_dict or None    loader     train DataLoader.state_dict()
    rng         list, one dict per rank: python / numpy / torch / cuda generator states
    val_loss    val loss measured at this step, or None
    best_step, best_val_loss   the best checkpoint so far (never pruned)
    format      'gpt2-train-ckpt-v1'
    tokenizer   the run's tokenizer (bpe.tokenizer_record: id, n_vocab, eot, source and the tokenizer.json text,
                a str; None or json None: GPT-2's), so that sampling and export need nothing but the checkpoint

or a sharded checkpoint directory out_dir/ckpt_{step:06d}/ (sharded.py). Every load verifies the checkpoint's
recorded sha256 (checkpoint_file.verify_checkpoint): a damaged file is an error naming it, and a directory (out_dir)
means its newest checkpoint that verifies and loads, with a note for each newer one skipped.
"""

import functools
from pathlib import Path

import torch

from gpt2train import optim
from gpt2train.checkpoint_file import (
    CKPT_NAME,
    FORMAT,
    CheckpointError,
    checksum_path,
    remove,
    save_checkpoint,
    verify_checkpoint,
)
from gpt2train.console import log
from gpt2train.files import first_line
from gpt2train.sharded import META, META_FILES, check_shards, is_sharded, load_sharded_checkpoint
from model import GPT, GPTConfig


def list_checkpoints(out_dir):
    """[(step, path)] of the ckpt_XXXXXX.pt files and ckpt_XXXXXX/ sharded directories in out_dir, oldest
    first (no integrity check)."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in out_dir.iterdir()
        if (m := CKPT_NAME.match(p.name)) and (p.is_file() if m.group(2) else p.is_dir())
    ]
    return sorted(found)


def is_checkpoint(path):
    """Whether `path` (an init_from) names a checkpoint of this library: a file, a sharded checkpoint directory or
    a run directory holding checkpoints, as opposed to a Hugging Face model directory."""
    path = Path(path)
    return path.is_file() or is_sharded(path) or bool(list_checkpoints(path))


def load_latest_checkpoint(
    out_dir, map_location="cpu", consolidate=True, note=functools.partial(log, note=True), verify=True, damaged=None
):
    """(checkpoint dict, path) of the newest checkpoint in out_dir that verifies and loads; note() is called
    with the reason for each newer one skipped. CheckpointError if out_dir holds none that loads. damaged:
    {path: reason} of checkpoints already found damaged (resume.verify_shards), skipped as if found so here."""
    found = list_checkpoints(out_dir)
    if not found:
        raise CheckpointError(f"{out_dir}: no checkpoint (ckpt_XXXXXX.pt or ckpt_XXXXXX/) in this directory")
    reasons = []
    for _, path in reversed(found):
        if damaged and str(path) in damaged:  # its note was given when it was found
            reasons.append(damaged[str(path)])
            continue
        try:
            return load_checkpoint(path, map_location, consolidate, note, verify), path
        except CheckpointError as e:
            reasons.append(str(e))
            note(f"skipping {e}")
    raise CheckpointError(f"{out_dir}: none of its {len(found)} checkpoints loads (newest: {reasons[0]})")


def load_checkpoint(path, map_location="cpu", consolidate=True, note=functools.partial(log, note=True), verify=True):
    """The checkpoint dict at `path`: a file (verified against its sidecar), a sharded checkpoint directory, or
    an out_dir meaning its newest checkpoint that verifies and loads (load_latest_checkpoint; note() says which
    newer ones were skipped and why). A sharded checkpoint is gathered into this process, in the single-file
    layout; with consolidate=False its model and optimizer stay on disk instead, named by ckpt['shards'] (what
    a sharded resume loads from, each rank only its part). verify=False skips the sha256 (another process
    verified the same files) but still checks that the checkpoint is complete; verify='meta' hashes only a
    sharded checkpoint's metadata (META_FILES: under torchrun each rank then hashes its share of the shards,
    resume.verify_shards), a file checkpoint wholly."""
    path = Path(path)
    if path.is_dir() and not is_sharded(path):
        return load_latest_checkpoint(path, map_location, consolidate, note, verify)[0]
    if path.is_dir():  # every shard present and verified before any tensor is read
        check_shards(path)
        if verify:
            verify_checkpoint(path, only=META_FILES if verify == "meta" else None)
        ckpt = _load_file(path / META, map_location, verify)
        ckpt["shards"] = str(path)
        return _consolidated(ckpt) if consolidate else ckpt
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    return _load_file(path, map_location, verify)


def _load_file(path, map_location, verify=True):
    if verify:
        verify_checkpoint(path)
    try:
        # mmap: tensors are read from the file as they are touched, and ranks on one node share the page
        # cache instead of each reading the whole checkpoint into its own memory (8 x 18 GB at 1.5B)
        ckpt = torch.load(path, map_location=map_location, weights_only=True, mmap=True)
    except Exception as e:  # truncated zip, foreign pickle, not a torch file at all...
        raise CheckpointError(f"{path}: not a readable checkpoint ({first_line(e)})") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        found = ckpt.get("format") if isinstance(ckpt, dict) else type(ckpt).__name__
        raise CheckpointError(f"{path}: not a gpt2-train checkpoint (format {found!r}, expected {FORMAT!r})")
    missing = [
        key
        for key, kind in (("model_args", dict), ("config", dict), ("step", int))
        if not isinstance(ckpt.get(key), kind)
    ]
    if missing:
        raise CheckpointError(f"{path}: incomplete gpt2-train checkpoint: no {missing[0]!r}")
    return ckpt


def prune_checkpoints(out_dir, keep_last, keep_steps=()):
    """Delete all but the newest `keep_last` checkpoints (keep_last <= 0 keeps all), never those at
    `keep_steps` (the best one), with their sidecars; plus temporary files and sidecars left behind by an
    interrupted save."""
    out_dir = Path(out_dir)
    for tmp in out_dir.glob(".ckpt_*.tmp"):
        remove(tmp)
    for sidecar in out_dir.glob("ckpt_*.pt.sha256"):  # of a save interrupted before its rename
        if not sidecar.with_suffix("").exists():
            sidecar.unlink(missing_ok=True)
    if keep_last <= 0:
        return
    found = list_checkpoints(out_dir)
    for step, path in found[:-keep_last]:
        if step not in keep_steps:
            remove(path)
            checksum_path(path).unlink(missing_ok=True)


def _consolidated(ckpt):
    """A sharded checkpoint's model and optimizer gathered into this process, in the single-file layout
    (model, optimizer.state_dict()). Needs host memory for the model and its AdamW state: 16 bytes/param."""
    cfg = ckpt["config"]
    model = GPT(GPTConfig(**ckpt["model_args"]))
    optimizer = optim.adamw(model.parameters(), cfg["weight_decay"], cfg["learning_rate"], (cfg["beta1"], cfg["beta2"]))
    load_sharded_checkpoint(ckpt["shards"], model, optimizer, collective=False)
    out = {k: v for k, v in ckpt.items() if k != "shards"}
    return {**out, "model": model.state_dict(), "optimizer": optimizer.state_dict()}


def consolidate(src, dst):
    """Write the sharded checkpoint directory `src` as the single-file checkpoint `dst` (resumable too); returns
    its step."""
    if not is_sharded(src):
        raise CheckpointError(f"{src}: not a sharded checkpoint directory (expected ckpt_XXXXXX/ with {META})")
    if Path(src).resolve() in (Path(dst).resolve(), *Path(dst).resolve().parents):  # e.g. SRC/meta.pt: damages SRC
        raise CheckpointError(
            f"{dst}: inside the checkpoint {src} it is made from; write it outside, e.g. "
            f"{Path(src).resolve().with_suffix('.pt')}"
        )
    ckpt = load_checkpoint(src)  # verified: a damaged directory is refused
    if not all(torch.isfinite(t).all() for t in ckpt["model"].values()):
        raise CheckpointError(f"{src}: its weights hold NaN/inf; not writing them to {dst}")
    save_checkpoint(dst, ckpt)
    return ckpt["step"]


def model_from_checkpoint(path):
    """(GPT on the CPU, info) from the checkpoint at `path`: a file, a sharded directory (read straight into the
    model: no second copy of the weights) or an out_dir (its newest good checkpoint). info: source, step, val_loss,
    config (the training config), tokenizer (the run's bpe.tokenizer_record, or None) and hf_dir: the Hugging Face
    directory the run started from (its init_from, when that is a directory), or None."""
    state = load_checkpoint(path, consolidate=False)
    model = GPT(GPTConfig(**state["model_args"]))
    if "shards" in state:
        load_sharded_checkpoint(state["shards"], model, collective=False)
    else:
        model.load_state_dict(state["model"])
    hf_dir = (state["config"] or {}).get("init_from")
    info = {
        "source": str(path),
        "step": state["step"],
        "val_loss": state.get("val_loss"),
        "config": state["config"],
        "hf_dir": hf_dir if hf_dir is not None and Path(hf_dir).is_dir() else None,  # else GPT-2's tokenizer
        "tokenizer": state.get("tokenizer"),
    }
    return model, info
