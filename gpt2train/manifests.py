"""prepare_data.py's manifests: written by a prep (one at a time in a directory: its lock; the manifest written whole
or not at all, a killed run's temporary files removed, its finished shards verified and kept: resumable_manifest),
read once at a run's start, and what they vouch for: that a prep finished and its shards are all there and unchanged
(manifest_records), and which tokenizer made them (data_tokenizer; the sources of a mixture share one,
check_one_tokenizer). A manifest is <name>_manifest.json beside its shards; shards of other tools have none and are
trained on unchecked (GPT-2's tokenizer assumed)."""

import contextlib
import hashlib
import itertools
import json
import re
from pathlib import Path

from gpt2train.console import log
from gpt2train.documents import PrepError
from gpt2train.files import (
    LockError,
    atomic_write,
    directory_lock,
    error_line,
    file_sha256,
    first_line,
    lock_holder,
    read_regular,
)
from gpt2train.shards import HEADER_BYTES, SHARD_SUFFIXES, NoShardsError, ShardError, find_shards, names_mixture

MAX_JSON_BYTES = 1 << 28  # a prep manifest or a tokenizer.json (tens of MB at most) is read whole


def read_manifests(data_dir):
    """{manifest path: its parsed JSON} of prepare_data.py's manifests (<name>_manifest.json) in the directories of
    data_dir's train and val shards, each file read once: a run reads them at its start (resume.start) and its
    loaders and tokenizer check take them. ShardError naming a manifest that is unreadable or not a JSON object,
    or a directory a prepare_data.py is still writing; NoShardsError when data_dir has no train shards. A mixture
    (mixture.parse_mixture): the manifests of all its sources, which must share one tokenizer (check_one_tokenizer)."""
    if names_mixture(data_dir):
        from gpt2train.mixture import parse_mixture  # only for a mixture

        sources = parse_mixture(data_dir)
        found = {name: read_manifests(path) for name, (path, _) in sources.items()}
        check_one_tokenizer(found, sources)
        return {manifest: m for manifests in found.values() for manifest, m in manifests.items()}
    directories = {p.parent for p in find_shards(data_dir, "train")}
    with contextlib.suppress(NoShardsError):  # a missing val split is the val loader's error, if the run evaluates
        directories |= {p.parent for p in find_shards(data_dir, "val")}
    manifests = {}
    for manifest in sorted(m for d in directories for m in d.glob("*_manifest.json")):
        holder = lock_holder(manifest.parent)
        if holder and holder.startswith("prepare_data.py"):
            raise ShardError(f"{manifest.parent} is being written by {holder}: wait until it ends")
        try:
            manifests[manifest] = json.loads(read_regular(manifest, MAX_JSON_BYTES))
            if not isinstance(manifests[manifest], dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as e:  # a FIFO, /dev/zero or a huge file: refused unread (read_regular)
            reason = e.strerror if isinstance(e, OSError) and e.strerror else first_line(e)
            raise ShardError(
                f"{manifest}: unreadable prep manifest ({reason}); run prepare_data.py again, or "
                f"delete it to train on the shards unchecked"
            ) from None
    return manifests


def manifest_records(paths, split, manifests):
    """{shard path: its record} for the shards that prepare_data's manifests (read_manifests: <name>_manifest.json
    next to them) describe, after checking that each manifest covers its `split` shards: the prep finished (the
    manifest says complete), every shard it lists is there at its recorded size, and no shard under its <name>_
    prefix is unlisted. ShardError naming the file otherwise. Shards without a manifest (nanoGPT's,
    build-nanogpt's) are left out; mixed in one directory with shards a manifest lists, they are a ShardError too."""
    found, paths = {}, [Path(p) for p in paths]
    for directory in sorted({p.parent for p in paths}):
        for manifest in [m for m in manifests if m.parent == directory]:
            name = manifest.name[: -len("_manifest.json")]
            m = manifests[manifest]
            try:
                records = {directory / r["file"]: r for r in m["shards"] if r["split"] == split}
                sizes = {path: HEADER_BYTES + 2 * int(r["tokens"]) for path, r in records.items()}
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ShardError(
                    f"{manifest}: unreadable prep manifest ({type(e).__name__}: {e}); run "
                    f"prepare_data.py again, or delete it to train on the shards unchecked"
                ) from None
            if not m.get("complete"):
                raise ShardError(
                    f"{manifest}: the prep that writes {name}_* did not finish; run it again to complete it"
                )
            for path, size in sizes.items():
                have = path.stat().st_size if path.is_file() else None
                if have != size:
                    what = "is missing" if have is None else f"has {have:,} bytes, the manifest records {size:,}"
                    raise ShardError(f"{path}: listed in {manifest.name} but {what}; run prepare_data.py again")
            unlisted = [
                p for p in paths if p.parent == directory and p.name.startswith(f"{name}_") and p not in records
            ]
            if unlisted:
                raise ShardError(
                    f"{unlisted[0]}: not in {manifest.name} (another prep's shard?); move it out of "
                    f"{directory}, or run prepare_data.py again"
                )
            written = manifest.stat().st_mtime_ns  # after each of its shards
            eot = (tokenizer_entry(manifest, m) or {}).get("eot")
            doc_token = {"doc_token": eot} if eot is not None else {}
            found.update(
                {
                    path: {**r, "manifest": manifest.name, "manifest_mtime_ns": written, **doc_token}
                    for path, r in records.items()
                }
            )
        mine = [p for p in paths if p.parent == directory]
        stray = [p for p in mine if p not in found]
        if stray and len(stray) < len(mine):  # a prep's shards mixed with others no manifest vouches for
            raise ShardError(
                f"{stray[0]}: in no prep manifest of {directory}, unlike its other {split} shards (copied "
                f"in from elsewhere?); move it out, or give data_dir as a glob of the shards to train on"
            )
    return found


def tokenizer_entry(manifest, m):
    """The "tokenizer" entry of the prep manifest m (read from the file `manifest`), its values' types checked, or
    None where it has none (a prep from before tokenizers were recorded: GPT-2's). ShardError naming the manifest
    and the key otherwise (a manifest is a text file: anything may be there)."""
    entry = m.get("tokenizer")
    if entry is None:
        return None

    def refuse(key, expected):
        value = entry if key is None else entry.get(key)
        raise ShardError(
            f"{manifest}: {'tokenizer' if key is None else f'tokenizer.{key}'} is {str(repr(value))[:80]}, expected "
            f"{expected}; run prepare_data.py again"
        )

    if not isinstance(entry, dict):
        refuse(None, "an object")
    if not isinstance(entry.get("id"), str):
        refuse("id", "a string")
    for key, top in (("n_vocab", 2**16), ("eot", 2**16 - 1)):
        value = entry.get(key)
        if value is not None and (type(value) is not int or not 0 <= value <= top):
            refuse(key, f"an integer from 0 to {top:,}")
    name = entry.get("file")
    if "file" in entry and (not isinstance(name, str) or Path(name).name != name or name in ("", ".", "..")):
        refuse("file", "the name of a file in the manifest's directory")
    return entry


def data_tokenizer(manifests):
    """The tokenizer of a data_dir's shards, as its prepare_data.py manifests (read_manifests) record it
    (bpe.tokenizer_record; "json" read back from the <name>_tokenizer.json beside them and checked against its
    hash), or None where no manifest says (shards of other tools: assumed GPT-2's). A manifest from before tokenizers
    were recorded means GPT-2's ("n_vocab" None). ShardError when the manifests name different tokenizers (e.g. a
    glob over two data directories), or a tokenizer entry or file that is malformed, missing, changed or not a
    regular file (tokenizer_entry: a plain name inside the directory, read with a size cap)."""
    found = {}
    for manifest, m in manifests.items():
        directory = manifest.parent
        record = tokenizer_entry(manifest, m) or {"id": "gpt2", "n_vocab": None, "eot": 50256, "source": None}
        record = {**record, "json": None}
        if "file" in record:
            path = directory / record["file"]
            try:  # a regular file of bounded size: not a FIFO, nor a symlink to /dev/zero
                data = read_regular(path, MAX_JSON_BYTES, follow_symlinks=False)
            except OSError as e:
                raise ShardError(
                    f"{path}: cannot read the tokenizer that {manifest.name} names ({e.strerror}); "
                    f"run prepare_data.py again"
                ) from None
            if record["id"] != "sha256:" + hashlib.sha256(data).hexdigest()[:16]:
                raise ShardError(
                    f"{path}: changed since {manifest.name} recorded it as {record['id']}; run prepare_data.py again"
                )
            try:  # a file made to match its recorded id: its errors name it, not the tokenizer it was made from
                record["json"] = data.decode("utf-8")
                if not isinstance(json.loads(record["json"]), dict):
                    raise ValueError("not a JSON object")
            except ValueError as e:
                raise ShardError(f"{path}: not a tokenizer.json ({first_line(e)}); run prepare_data.py again") from None
        found[manifest] = record
    ids = {r["id"] for r in found.values()}
    if len(ids) > 1:
        (a, ra), (b, rb) = [next((m, r) for m, r in found.items() if r["id"] == i) for i in sorted(ids)[:2]]
        raise ShardError(
            f"{a.parent}: its shards come from two tokenizers: {a} has {ra['id']}, {b} has {rb['id']}; "
            f"train on one tokenizer's data"
        )
    return next(iter(found.values()), None)


def check_one_tokenizer(found, sources):
    """ShardError, one line naming two sources and their tokenizers, unless the sources of a mixture ({name: (path,
    weight)}) were all tokenized with one tokenizer, by the ids their manifests (found: {name: read_manifests'})
    record; a source without a manifest is taken to be GPT-2's, as everywhere. Two tokenizers within one source are
    data_tokenizer's error."""

    def tokenizer(m):
        t = m.get("tokenizer")
        return t if isinstance(t, dict) and "id" in t else {"id": "gpt2"}

    ids = {}
    for name, manifests in found.items():
        records = [tokenizer(m) for m in manifests.values()] or [{"id": "gpt2"}]
        if len({r["id"] for r in records}) == 1:
            ids[name] = records[0]
    first = next(iter(ids.values()), None)
    other = next((name for name, r in ids.items() if r["id"] != first["id"]), None)
    if other is None:
        return
    one = next(iter(ids))
    raise ShardError(
        f"data_dir: {sources[one][0]} was tokenized with {tokenizer_name(ids[one])}, {sources[other][0]} with "
        f"{tokenizer_name(ids[other])}; the sources of a mixture share one tokenizer: prepare them with the same "
        f"prepare_data.py --tokenizer"
    )


def tokenizer_name(record):
    """A tokenizer record's id, and the file it came from where it has one, for a message."""
    return record["id"] + (f" ({record['source']})" if record.get("source") else "")


def remove_stale_temp_files(out_dir, name):
    """Delete the temporary shard and manifest files (files.atomic_write's `.<file>.<pid>.tmp`) a killed run
    left in out_dir; the caller holds out_dir's lock, so no other prep is writing them."""
    stale = list(out_dir.glob(f".{name}_*.tmp"))
    if stale:
        size = sum(p.stat().st_size for p in stale)
        for p in stale:
            p.unlink(missing_ok=True)
        log(f"prepare_data: removed {len(stale)} temporary file(s) ({size / 2**20:,.1f} MiB) of an interrupted run")


def shard_is_complete(out_dir, record):
    """Whether the shard a manifest record lists is in out_dir whole: its size and sha256 as recorded."""
    path = out_dir / record["file"]
    return (
        path.is_file()
        and path.stat().st_size == HEADER_BYTES + 2 * record["tokens"]
        and file_sha256(path) == record["sha256"]
    )


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
        manifest["shards"] = list(itertools.takewhile(lambda r: shard_is_complete(out_dir, r), old["shards"]))
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
