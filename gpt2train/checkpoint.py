"""Checkpoint files: their format, atomic writes, finding the newest good one, safe loading, sharded (DCP) saves
and loads, a model read from one, consolidation (the root checkpoint.py is the command over them). How a training
run resumes from them is resume.py's; how the commands open a model, loading.py's.

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

Writes go through files.atomic_write (a hidden temporary file in the same directory, fsync'ed, renamed
over the final name, the directory fsync'ed): a crash (even kill -9) at any moment leaves either the old
set of checkpoints or the new one, never a truncated ckpt_*.pt. Before writing, the free disk space is
checked against the checkpoint's size.

Each checkpoint's sha256 is recorded in a sidecar, ckpt_{step:06d}.pt.sha256 (`sha256sum -c` reads it),
written before the checkpoint is renamed into place, so a checkpoint written here never lacks one. The sidecar
verifies the file it sits beside, whatever name is written in it (verify_checkpoint). Every
load verifies it: a damaged file is an error naming it, and a directory (out_dir) means its newest
checkpoint that verifies and loads, with a note for each newer one skipped.

A sharded run (parallel='fsdp'/'hsdp') writes a directory out_dir/ckpt_{step:06d}/ instead: model and
optimizer as torch.distributed.checkpoint (DCP) shards, every rank writing its own part in parallel
(__0_0.distcp, __1_0.distcp, ... and DCP's .metadata index), plus meta.pt, a file like the above without
the model and optimizer. It is written as .ckpt_{step:06d}.tmp/ and renamed by rank 0 only after every rank's
shards and the index are on disk, so it is complete or absent. DCP reshards on load: a sharded checkpoint
resumes at any world size, and loads into a single process without a process group (model_from_checkpoint,
load_checkpoint, `python checkpoint.py consolidate` to write the single-file form).

A sharded checkpoint is verified like a file before any tensor is read: its SHA256SUMS records the sha256
of every file in it (each rank hashes its shards as it writes them, rank 0 writes the list before the rename), and
every shard the .metadata index names must be there, listed, at the size the index needs (check_shards).
DCP itself unpickles .metadata and the shards' non-tensor values with plain pickle (a crafted checkpoint
would run code): they are read here through an unpickler that builds only DCP's metadata classes
(_MetadataUnpickler) and with weights_only=True (_safe_dcp), wherever a sharded checkpoint is opened.
"""

import contextlib
import errno
import functools
import hashlib
import os
import pickle
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from gpt2train import optim
from gpt2train.console import distributed, log
from gpt2train.files import atomic_write, file_sha256, first_line, fsync_dir, open_regular, read_regular
from gpt2train.tensor_parallel import from_saved, model_rows, to_saved
from model import GPT, GPTConfig

FORMAT = "gpt2-train-ckpt-v1"
CKPT_NAME = re.compile(r"^ckpt_(\d{6,})(\.pt)?$")  # a file ckpt_000100.pt or a sharded directory ckpt_000100
META = "meta.pt"  # a sharded checkpoint's everything-but-the-tensors file
META_FILES = frozenset({META, ".metadata"})  # what rank 0 verifies of a sharded checkpoint before the group starts
SUMS = "SHA256SUMS"  # a sharded checkpoint's sidecar: the sha256 of each of its files (`sha256sum -c SHA256SUMS`)
TIED = "lm_head.weight"  # the same tensor as transformer.wte.weight: stored once in sharded checkpoints


class CheckpointError(Exception):
    """A missing, truncated or foreign checkpoint; the message is one line naming the file."""


def checkpoint_path(out_dir, step, sharded=False):
    return Path(out_dir) / (f"ckpt_{step:06d}" if sharded else f"ckpt_{step:06d}.pt")


def is_sharded(path):
    """Whether `path` is a sharded checkpoint directory (as opposed to a file, or an out_dir)."""
    path = Path(path)
    return path.is_dir() and ((path / META).exists() or (path / ".metadata").exists())


def checksum_path(path):
    """The sidecar recording a checkpoint's sha256: ckpt_000100.pt -> ckpt_000100.pt.sha256; for a sharded
    checkpoint directory, the sha256 of every file in it: ckpt_000100/SHA256SUMS."""
    path = Path(path)
    return path / SUMS if path.is_dir() else path.with_name(path.name + ".sha256")


class _HashingWriter:
    """A binary file wrapper that hashes what is written through it and keeps the error of a failed write
    (an OSError, or a second Ctrl-C's KeyboardInterrupt: torch.save turns it into 'unexpected pos ...')."""

    def __init__(self, f):
        self.f, self.sha256, self.error = f, hashlib.sha256(), None

    def write(self, data):
        try:
            written = self.f.write(data)
            self.sha256.update(data)
            return written
        except BaseException as e:
            self.error = e
            raise

    def flush(self):
        self.f.flush()


class _HashingStream(_HashingWriter):
    """_HashingWriter for DCP's writer, which also asks its stream tell(), fileno() and close()."""

    def __getattr__(self, name):
        return getattr(self.f, name)


@functools.cache
def _hashing_filesystem():
    """DCP's FileSystem, hashing each shard file (.distcp) as it is written: .sums {file name: sha256}."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    class HashingFileSystem(FileSystem):
        def __init__(self):
            super().__init__()
            self.sums = {}

        @contextlib.contextmanager
        def create_stream(self, path, mode):
            with super().create_stream(path, mode) as stream:
                if "w" not in mode or not str(path).endswith(".distcp"):
                    yield stream
                    return
                hashing = _HashingStream(stream)
                yield hashing
                self.sums[Path(path).name] = hashing.sha256.hexdigest()

    return HashingFileSystem


def storage_bytes(obj):
    """Bytes of tensor data torch.save writes for obj (nested dicts/lists/tuples): each storage once."""
    seen, total, stack = set(), 0, [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()  # tied weights and views share one
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


def check_free_space(path, obj):
    """Raise CheckpointError unless the disk holding `path` has room for obj's checkpoint (its tensor bytes
    plus 1% and 1 MiB for the pickle, the zip headers and the sidecar)."""
    need = int(storage_bytes(obj) * 1.01) + 2**20
    free = shutil.disk_usage(Path(path).parent).free
    if free < need:
        raise CheckpointError(
            f"{path}: not enough disk space to write this checkpoint: it needs about "
            f"{need / 2**20:,.0f} MiB, {Path(path).parent} has {free / 2**20:,.0f} MiB free; "
            f"nothing was written, the previous checkpoints are kept"
        )


def save_checkpoint(path, obj):
    """torch.save(obj) to `path` atomically (files.atomic_write: temporary file, fsync, rename, fsync dir),
    its sha256 recorded in checksum_path(path) before the rename. Checks the free space first; a full disk or
    any other write error is a one-line CheckpointError and leaves no temporary file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    check_free_space(path, obj)
    hashing = None

    def write(f):
        nonlocal hashing
        hashing = _HashingWriter(f)
        try:
            torch.save(obj, hashing)
        except RuntimeError:
            if hashing.error is not None:
                raise hashing.error from None
            raise
        atomic_write(checksum_path(path), f"{hashing.sha256.hexdigest()}  {path.name}\n")

    try:
        atomic_write(path, write)
    except OSError as e:
        hint = "; free some disk space" if e.errno in (errno.ENOSPC, errno.EDQUOT) else ""
        raise CheckpointError(
            f"{path}: cannot write the checkpoint ({e.strerror or e}){hint}; "
            f"nothing was written, the previous checkpoints are kept"
        ) from None


def read_checksums(sidecar, follow_symlinks=True, limit=1 << 24):
    """{file name: sha256} from a sidecar in sha256sum's format ('<hex>  <name>' per line): a regular file of at
    most `limit` bytes (files.read_regular: a FIFO or a device is refused, never read), each name once."""
    data = read_regular(sidecar, limit, follow_symlinks)
    recorded = {}
    for line in data.decode().splitlines():
        digest, sep, name = line.partition("  ")
        if not sep or not re.fullmatch(r"[0-9a-f]{64}", digest) or not name.strip():
            raise ValueError(f"not a sha256sum line: {line[:80]!r}")
        if name.strip() in recorded:
            raise ValueError(f"{name.strip()!r} is listed twice")
        recorded[name.strip()] = digest
    if not recorded:
        raise ValueError("empty")
    return recorded


def verify_checkpoint(path, only=None):
    """Check that the checkpoint at `path` has the sha256 recorded when it was written: CheckpointError naming the
    file if it differs, if none was recorded (every checkpoint is written with its sidecar), or if the sidecar is
    not one (unreadable, not a regular file, or naming what it cannot verify). only: the names (of a
    directory's files) to hash, the others left to other ranks (resume.verify_shards).

    A file's sidecar (ckpt_000100.pt.sha256) is one line, and it verifies the file it sits beside: the name in
    it is for `sha256sum -c`, not trusted to pick what is hashed (a copied pair renamed to best.pt and
    best.pt.sha256 verifies best.pt). A sharded directory's SHA256SUMS lists its files by plain names: each must be
    a regular file in the directory (no '/', '..' or symlink), so nothing outside it is ever opened."""
    path, sidecar = Path(path), checksum_path(path)
    if not os.path.lexists(sidecar):
        raise CheckpointError(f"{path}: no {sidecar.name}: cannot verify the checkpoint")
    directory = path.is_dir()
    try:
        recorded = read_checksums(sidecar, follow_symlinks=not directory)
        if not directory and len(recorded) != 1:
            raise ValueError(f"{len(recorded)} lines; a checkpoint file's sidecar has one")
    except (OSError, ValueError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else e
        raise CheckpointError(
            f"{path}: unreadable checksum file {sidecar.name} ({reason}); cannot verify the checkpoint"
        ) from None
    if directory:
        outside = [name for name in recorded if "/" in name or "\0" in name or name in (".", "..")]
        if outside:
            raise CheckpointError(
                f"{path}: {SUMS} names {outside[0]!r}, not a file of this directory; cannot verify the checkpoint"
            )
        files = {path / name: digest for name, digest in recorded.items() if only is None or name in only}
    else:
        files = {path: next(iter(recorded.values()))}
    for file, digest in files.items():
        try:
            actual = file_sha256(file, follow_symlinks=not directory)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read {file.name} to verify it ({e.strerror})") from None
        if actual != digest:
            raise CheckpointError(
                f"{path}: damaged: its sha256 is {actual[:16]}..., {sidecar.name} recorded "
                f"{digest[:16]}... when it was written"
            )


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's .metadata index is a pickle (torch reads it with plain pickle.load: a crafted file runs code).
    This unpickler builds only DCP's metadata classes, torch.Size, dtypes and layouts; anything else is refused
    before it is imported or called."""

    def find_class(self, module, name):
        allowed = _metadata_globals()
        if (module, name) not in allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's .metadata")
        return allowed[module, name]


def _metadata_globals():
    import pathlib

    import torch.distributed.checkpoint.metadata as md
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    classes = [
        md.Metadata,
        md.TensorStorageMetadata,
        md.BytesStorageMetadata,
        md.ChunkStorageMetadata,
        md.TensorProperties,
        md.MetadataIndex,
        md.StorageMeta,
        md._MEM_FORMAT_ENCODING,
        _StorageInfo,
        torch.Size,
        torch.serialization._get_layout,
        pathlib.PurePosixPath,
        pathlib.PosixPath,
        pathlib.PureWindowsPath,
        pathlib.WindowsPath,
    ]
    allowed = {(c.__module__, c.__qualname__): c for c in classes}
    allowed.update({("pathlib", c.__name__): c for c in classes[-4:]})  # pickled from Python >= 3.13 too
    allowed.update({("torch", n): getattr(torch, n) for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)})
    return allowed


def read_metadata(path):
    """The DCP index (.metadata) of the sharded checkpoint directory `path`, read with _MetadataUnpickler.
    CheckpointError naming the file if it is missing, truncated or holds anything but metadata."""
    from torch.distributed.checkpoint.metadata import Metadata

    file = Path(path) / ".metadata"
    try:
        with open_regular(file, follow_symlinks=False) as f:  # not open(): a FIFO would block every loader
            metadata = _MetadataUnpickler(f).load()
    except OSError as e:
        raise CheckpointError(f"{path}: incomplete sharded checkpoint: cannot read .metadata ({e.strerror})") from None
    except Exception as e:  # noqa: BLE001 -- a refused global, a truncated or foreign pickle
        raise CheckpointError(f"{file}: not a DCP checkpoint index ({first_line(e)})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise CheckpointError(f"{file}: not a DCP checkpoint index (a {type(metadata).__name__})")
    return metadata


def check_shards(path):
    """The DCP index of the sharded checkpoint `path` (read_metadata), after checking the directory holds
    every shard file the index names, each at least as long as the items it records in it, and meta.pt;
    with a SHA256SUMS, that every one of them is listed there. CheckpointError naming what is missing."""
    path = Path(path)
    if not (path / META).is_file():
        raise CheckpointError(f"{path}: incomplete sharded checkpoint: no {META}")
    needed = {}  # shard file -> bytes its items reach
    for info in read_metadata(path).storage_data.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or Path(name).name != name or name.startswith("."):
            raise CheckpointError(f"{path}/.metadata: names a shard outside the directory ({name!r})")
        needed[name] = max(needed.get(name, 0), int(info.offset) + int(info.length))
    for name, size in sorted(needed.items()):
        have = (path / name).stat().st_size if (path / name).is_file() else None
        if have is None or have < size:
            what = "is missing" if have is None else f"has {have:,} bytes, its index needs {size:,}"
            raise CheckpointError(f"{path}: incomplete sharded checkpoint: shard {name} {what}")
    if checksum_path(path).is_file():
        try:
            listed = read_checksums(checksum_path(path))
        except (OSError, ValueError, UnicodeDecodeError):
            listed = {}  # verify_checkpoint says what is wrong with it
        unlisted = sorted((set(needed) | {".metadata", META}) - set(listed))
        if unlisted:
            raise CheckpointError(f"{path}: {unlisted[0]} is not in {SUMS}: cannot verify the checkpoint")
    return needed


def is_checkpoint(path):
    """Whether `path` (an init_from) names a checkpoint of this library: a file, a sharded checkpoint directory or
    a run directory holding checkpoints, as opposed to a Hugging Face model directory."""
    path = Path(path)
    return path.is_file() or is_sharded(path) or bool(list_checkpoints(path))


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


def _remove(path):
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def prune_checkpoints(out_dir, keep_last, keep_steps=()):
    """Delete all but the newest `keep_last` checkpoints (keep_last <= 0 keeps all), never those at
    `keep_steps` (the best one), with their sidecars; plus temporary files and sidecars left behind by an
    interrupted save."""
    out_dir = Path(out_dir)
    for tmp in out_dir.glob(".ckpt_*.tmp"):
        _remove(tmp)
    for sidecar in out_dir.glob("ckpt_*.pt.sha256"):  # of a save interrupted before its rename
        if not sidecar.with_suffix("").exists():
            sidecar.unlink(missing_ok=True)
    if keep_last <= 0:
        return
    found = list_checkpoints(out_dir)
    for step, path in found[:-keep_last]:
        if step not in keep_steps:
            _remove(path)
            checksum_path(path).unlink(missing_ok=True)


def save_sharded_checkpoint(path, meta, model, optimizer):
    """Write the sharded checkpoint directory `path`. Under torch.distributed a collective: every rank calls
    it with its (FSDP-sharded) model and optimizer and writes its own shards; rank 0 writes `meta` (all
    the rest of the checkpoint) and renames the temporary directory into place once every rank's shards
    and DCP's index are on disk. A rank killed midway leaves only the temporary directory behind."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict

    collective = distributed()
    first = not collective or dist.get_rank() == 0
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")  # the same name on every rank
    if first:
        _remove(tmp)  # what an interrupted save of this step left
        tmp.mkdir(parents=True)
    if collective:
        dist.barrier()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    model_state.pop(TIED, None)
    # returns on every rank only after rank 0 has written .metadata, which it does once all ranks report
    # their shards written (and fsync'ed)
    with warnings.catch_warnings():  # DCP warns whenever it runs without a process group, as asked here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        writer = FileSystemWriter(str(tmp))
        writer.fs = _hashing_filesystem()()  # each rank hashes the shards it writes, as it writes them
        state = to_saved({"model": model_state, "optimizer": optimizer_state})  # GPT-2's layout at any layout
        dcp.save(state, storage_writer=writer, no_dist=not collective)
    mine = writer.fs.sums
    sums = [mine]
    if collective:
        sums = [None] * dist.get_world_size()
        dist.all_gather_object(sums, mine)
    if first:
        save_checkpoint(tmp / META, meta)
        sums = {name: digest for ranks in sums for name, digest in ranks.items()}
        sums.update({name: file_sha256(tmp / name) for name in (".metadata", META)})
        atomic_write(tmp / SUMS, "".join(f"{digest}  {name}\n" for name, digest in sorted(sums.items())))
        fsync_dir(tmp)
        old = path.with_name(f".{path.name}.old.tmp")
        if path.exists():  # the same step saved again
            os.replace(path, old)
        os.replace(tmp, path)
        fsync_dir(path.parent)
        _remove(old)
    if collective:
        dist.barrier()


def load_sharded_checkpoint(path, model, optimizer=None, collective=None):
    """Fill `model` (and `optimizer`) in place from the sharded checkpoint directory `path`, whatever layout
    they have here: FSDP shards at any world size, or whole tensors (DDP, one process). DCP reads the part
    each rank needs: a collective of every rank under torch.distributed (collective=None: if there is a
    process group), else a plain read by this process alone."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state = {"model": get_model_state_dict(model)}
    state["model"].pop(TIED, None)
    # DCP creates the optimizer's state (a zero-lr step) only where no parameter has a gradient yet; DDP's are its
    # bucket views from the start (parallel.keeps_grads): set aside while it does, then put back
    grads = {p: p.grad for p in model.parameters()}
    for p in grads:
        p.grad = None
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    for p, g in grads.items():
        p.grad = g
    state = to_saved(state)  # DCP reads GPT-2's layout; from_saved puts it back in the model's
    try:
        with warnings.catch_warnings():  # DCP warns whenever it runs without a process group, as asked here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            no_dist = not (distributed() if collective is None else collective)
            reader, planner = _safe_dcp()
            dcp.load(
                state, storage_reader=reader(str(path)), planner=planner(), no_dist=no_dist
            )  # strict: every key must be there
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        raise CheckpointError(f"{path}: cannot read the sharded checkpoint ({_dcp_reason(e)})") from None
    state = from_saved(state)
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=False))  # lm_head is wte
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])


def _dcp_reason(e):
    """The first failure inside a DCP CheckpointException (which wraps each rank's), else first_line(e)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, error = sorted(failures.items())[0]
        return f"rank {rank}: {first_line(error)}"
    return first_line(e)


@functools.cache
def _safe_dcp():
    """(reader, planner) classes reading a DCP checkpoint without unpickling code: the index through
    _MetadataUnpickler, and the non-tensor values that DCP torch.saves into the shards (torch's own planner
    loads them with weights_only=False) with weights_only=True."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            metadata = read_metadata(self.path)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = getattr(self, "load_id", None)
            return metadata

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return Reader, Planner


def load_optimizer_state(model, optimizer, state):
    """A single-file checkpoint's optimizer state (optimizer.state_dict(): whole tensors keyed by parameter
    index) into `optimizer`; if `model` is FSDP-sharded each rank keeps its slice of every tensor."""
    if not any(hasattr(p, "full_tensor") for p in model.parameters()):  # no DTensor: not sharded
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    name_of = {p: name for name, p in model.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]  # index -> parameter
    names = [name_of[p] for p in params]
    by_name = {  # a tensor-parallel c_attn's moments in the row order it holds (tensor_parallel.model_rows)
        "state": {
            names[i]: {k: model_rows(names[i], t, params[i]) for k, t in v.items()} for i, v in state["state"].items()
        },
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]],
    }
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))


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
