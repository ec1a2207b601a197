"""The output directory of a data prep (prepare_data.py's text shards and SFT shards alike): one prep at a time
(its lock), a killed run's temporary files removed, the manifest written whole or not at all, finished shards
verified against it, and token ids checked to fit the shards' uint16 before they are written."""

import contextlib
import hashlib
import json
import re
from pathlib import Path

import numpy as np

from gpt2train.console import log
from gpt2train.documents import PrepError
from gpt2train.files import LockError, atomic_write, directory_lock, error_line, file_sha256
from gpt2train.shards import HEADER_BYTES, SHARD_SUFFIXES

DEFAULT_SHARD_TOKENS = 100_000_000  # llm.c / build-nanogpt: 100M tokens (200 MB) per shard


def as_uint16(ids, source):
    """ids as the uint16 array a shard holds; PrepError naming `source` (what made them) for an id of 65,536 or
    more, which a cast would wrap silently into another id."""
    if ids.size and int(ids.max()) >= 2**16:
        raise PrepError(f"{source}: token id {int(ids.max()):,} does not fit the shards' uint16 (0 to 65,535)")
    return ids.astype(np.uint16)


def shard_is_complete(out_dir, record):
    path = out_dir / record["file"]
    return (
        path.is_file()
        and path.stat().st_size == HEADER_BYTES + 2 * record["tokens"]
        and file_sha256(path) == record["sha256"]
    )


def remove_stale_temp_files(out_dir, name):
    """Delete the temporary shard and manifest files (files.atomic_write's `.<file>.<pid>.tmp`) a killed run
    left in out_dir; the caller holds out_dir's lock, so no other prep is writing them."""
    stale = list(out_dir.glob(f".{name}_*.tmp"))
    if stale:
        size = sum(p.stat().st_size for p in stale)
        for p in stale:
            p.unlink(missing_ok=True)
        log(f"prepare_data: removed {len(stale)} temporary file(s) ({size / 2**20:,.1f} MiB) of an interrupted run")


def write_manifest(path, manifest):
    atomic_write(path, json.dumps(manifest, indent=1) + "\n")


def locked(out_dir):
    """One prep per output directory (files.directory_lock), held while the returned context is: the lock makes
    any temporary file of ours found there a killed run's. Taking it is the first write, so an output directory
    that cannot be written fails now, before any work."""
    held = contextlib.ExitStack()
    try:
        held.enter_context(directory_lock(out_dir, "prepare_data.py"))
    except LockError as e:
        raise PrepError(str(e)) from None
    except OSError as e:
        raise PrepError(f"cannot write to the output directory {out_dir} ({error_line(e)})") from None
    return held


def fingerprint(settings):
    """The manifest's fingerprint of a prep's settings: a re-run whose settings hash alike continues (or reuses) the
    shards there; any other is refused or rewrites them."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def resumable_manifest(out_dir, name, manifest_path, settings):
    """(the manifest to continue, the names of our shards found in out_dir): the earlier run's finished shards
    that verify (all of them, and complete, if it finished), or a fresh manifest. Somebody else's token files
    there, our shards without a manifest, or a manifest of another input are a PrepError."""
    ours = re.compile(rf"{re.escape(name)}_(train|val|test)_\d{{6}}\.bin")
    existing = sorted(p.name for p in out_dir.iterdir() if ours.fullmatch(p.name))
    others = sorted(p.name for p in out_dir.iterdir() if p.suffix in SHARD_SUFFIXES and not ours.fullmatch(p.name))
    if others:  # a loader reading out_dir would mix them with ours
        raise PrepError(
            f"{out_dir} holds other token files ({others[0]}, ...) that a loader reading the directory "
            f"would mix with the {name} shards; use another --out_dir"
        )
    manifest = {"fingerprint": fingerprint(settings), "settings": settings, "complete": False, "shards": []}
    if manifest_path.exists():
        try:
            old = json.loads(manifest_path.read_text())
        except (OSError, ValueError) as e:
            raise PrepError(f"{manifest_path}: unreadable manifest ({e}); delete it and the {name}_* shards") from None
        if old.get("fingerprint") != manifest["fingerprint"]:
            raise PrepError(
                f"{out_dir} holds {name} shards from a different input or settings ({manifest_path.name}); "
                f"use another --out_dir or --name, or delete them"
            )
        for record in old["shards"]:
            if not shard_is_complete(out_dir, record):
                break
            manifest["shards"].append(record)
        if old.get("complete") and len(manifest["shards"]) == len(old["shards"]):
            manifest.update(complete=True, documents=old["documents"], tokens=old["tokens"])
    elif existing:
        raise PrepError(
            f"{out_dir} holds {name} shards ({existing[0]}, ...) but no {manifest_path.name}, so they come "
            f"from another run or tool; use another --out_dir or --name, or delete them"
        )
    return manifest, existing


def keep_tokenizer(out_dir, name, record):
    """The manifest's "tokenizer" entry: the record without the file's text, which goes beside the shards as
    <name>_tokenizer.json (manifests.data_tokenizer reads it back; GPT-2's needs no file)."""
    entry = {k: v for k, v in record.items() if k != "json"}
    if record["json"] is not None:
        entry["file"] = f"{name}_tokenizer.json"
        atomic_write(Path(out_dir) / entry["file"], record["json"])
    return entry
