"""Checkpoints on disk: what one holds, one written atomically with its sha256, verified, found (the newest good one
in an out_dir), read (a file, a sharded directory or an out_dir, safely), pruned and consolidated. The root
checkpoint.py is the command over them; a sharded run's collective save and load are sharded.py's, how a training run
resumes from them resume.py's, how the commands open a model loading.py's.

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

or a sharded checkpoint directory out_dir/ckpt_{step:06d}/: torch.distributed.checkpoint (DCP) shards of the model
and optimizer (__0_0.distcp, ... and DCP's .metadata index) plus meta.pt, a checkpoint file without the model and
optimizer. DCP reshards on load: it resumes at any world size, and reads into one process without a process group.

Writes go through files.atomic_write (a hidden temporary file in the same directory, fsync'ed, renamed over the final
name, the directory fsync'ed): a crash (even kill -9) at any moment leaves either the old set of checkpoints or the
new one, never a truncated ckpt_*.pt. Before writing, the free disk space is checked against the checkpoint's size.
Each checkpoint's sha256 is recorded in a sidecar, ckpt_{step:06d}.pt.sha256 (`sha256sum -c` reads it), written
before the checkpoint is renamed into place; a sharded checkpoint's SHA256SUMS records the sha256 of every file in it.
Every load verifies them (verify_checkpoint) before any tensor is read, and that every shard the .metadata index names
is there, listed, at the size the index needs (check_shards): a damaged checkpoint is an error naming it, and a
directory (out_dir) means its newest checkpoint that verifies and loads, with a note for each newer one skipped.
DCP itself unpickles .metadata and the shards' non-tensor values with plain pickle (a crafted checkpoint would run
code): they are read here through an unpickler that builds only DCP's metadata classes (_MetadataUnpickler) and with
weights_only=True (_safe_dcp), wherever a sharded checkpoint is opened.
"""

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

from gpt2train.console import log
from gpt2train.files import atomic_write, file_sha256, first_line, open_regular, read_regular
from model import GPT, GPTConfig

FORMAT = "gpt2-train-ckpt-v1"
CKPT_NAME = re.compile(r"^ckpt_(\d{6,})(\.pt)?$")  # a file ckpt_000100.pt or a sharded directory ckpt_000100
SUMS = "SHA256SUMS"  # a sharded checkpoint's sidecar: the sha256 of each of its files (`sha256sum -c SHA256SUMS`)
META = "meta.pt"  # a sharded checkpoint's everything-but-the-tensors file
META_FILES = frozenset({META, ".metadata"})  # what rank 0 verifies of a sharded checkpoint before the group starts
TIED = "lm_head.weight"  # tied (GPT-2), the same tensor as transformer.wte.weight: stored once in sharded checkpoints


class CheckpointError(Exception):
    """A missing, truncated or foreign checkpoint; the message is one line naming the file."""


def checkpoint_path(out_dir, step, sharded=False):
    return Path(out_dir) / (f"ckpt_{step:06d}" if sharded else f"ckpt_{step:06d}.pt")


def checksum_path(path):
    """The sidecar recording a checkpoint's sha256: ckpt_000100.pt -> ckpt_000100.pt.sha256; for a sharded
    checkpoint directory, the sha256 of every file in it: ckpt_000100/SHA256SUMS."""
    path = Path(path)
    return path / SUMS if path.is_dir() else path.with_name(path.name + ".sha256")


class HashingWriter:
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


def storage_bytes(obj):
    """Bytes of tensor data torch.save writes for obj (nested dicts/lists/tuples): each storage once."""
    from torch.utils._pytree import tree_leaves

    storages = [t.untyped_storage() for t in tree_leaves(obj) if isinstance(t, torch.Tensor)]
    return sum({s.data_ptr(): s.nbytes() for s in storages}.values())  # tied weights and views share one


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
        hashing = HashingWriter(f)
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


def remove(path):
    """Delete the checkpoint file or directory at `path`, if there is one."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def is_sharded(path):
    """Whether `path` is a sharded checkpoint directory (as opposed to a file, or an out_dir)."""
    path = Path(path)
    return path.is_dir() and ((path / META).exists() or (path / ".metadata").exists())


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


def _dcp_reason(e):
    """The first failure inside a DCP CheckpointException (which wraps each rank's), else first_line(e)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, error = sorted(failures.items())[0]
        return f"rank {rank}: {first_line(error)}"
    return first_line(e)


@functools.cache
def _safe_dcp():
    """(reader, planner, whole) classes reading a DCP checkpoint without unpickling code: the index through
    _MetadataUnpickler, and the non-tensor values that DCP torch.saves into the shards (torch's own planner
    loads them with weights_only=False) with weights_only=True. whole: the planner that builds the state to read
    from the index (torch's own dcp_to_torch_save does so)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
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

    class Whole(_EmptyStateDictLoadPlanner, Planner):
        pass

    return Reader, Planner, Whole


def read_sharded(path, state=None, collective=False):
    """`state` ({'model': ..., 'optimizer': ...} as a live model and optimizer hold them: DCP's get_state_dict)
    filled in place from the sharded checkpoint `path`, every key of it there: a collective of every rank, each
    reading its part, or a read by this process alone. state=None: all the checkpoint holds, read whole into this
    process as it was saved. Nothing pickled runs (_safe_dcp); CheckpointError naming `path` if it cannot be read."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    reader, planner, whole = _safe_dcp()
    try:
        with warnings.catch_warnings():  # DCP warns whenever it runs without a process group, as asked here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            if state is None:  # dcp.load would fill a copy of it
                state = {}
                _load_state_dict(state, storage_reader=reader(str(path)), planner=whole(), no_dist=True)
            else:
                dcp.load(state, storage_reader=reader(str(path)), planner=planner(), no_dist=not collective)
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        raise CheckpointError(f"{path}: cannot read the sharded checkpoint ({_dcp_reason(e)})") from None
    return state


def list_checkpoints(out_dir):
    """[(step, path)] of the ckpt_XXXXXX.pt files and ckpt_XXXXXX/ sharded directories in out_dir, oldest
    first (no integrity check)."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    return sorted(
        (int(m.group(1)), p)
        for p in out_dir.iterdir()
        if (m := CKPT_NAME.match(p.name)) and (p.is_file() if m.group(2) else p.is_dir())
    )


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
    """A sharded checkpoint's model and optimizer read whole into this process, in the single-file layout (model:
    the GPT's state_dict, optimizer: optimizer.state_dict(), keyed by parameter index): DCP's state as saved
    (torch's dcp_to_torch_save), no model or optimizer built. Needs host memory for the model and its optimizer
    state: 16 bytes/param with AdamW."""
    saved = read_sharded(ckpt["shards"])
    with torch.device("meta"):  # the parameters' names and order, no memory
        like = GPT(GPTConfig(**ckpt["model_args"]))
    if like.config.tie_embeddings:
        saved["model"][TIED] = saved["model"]["transformer.wte.weight"]
    out = {k: v for k, v in ckpt.items() if k != "shards"}
    model = {name: saved["model"][name] for name in like.state_dict()}
    return {**out, "model": model, "optimizer": by_index(saved["optimizer"], dict(like.named_parameters()))}


def by_index(saved, params):
    """A sharded checkpoint's optimizer state, keyed by parameter name (get_optimizer_state_dict's), keyed by index
    as optimizer.state_dict() is: the parameters numbered in the order its groups list them. A pipeline's
    (flattened: 'state.<name>.exp_avg', each group's settings on its parameters' names, 'param_groups.<name>.lr')
    lists no order: its groups are the parameters of equal settings and kind (matrices, the rest) in the model's
    order (`params`: {name: parameter}), each group where its first parameter is, as optim.adamw builds them from a
    model's parameters (with weight_decay=0 its two groups have equal settings, and stay two)."""
    if "param_groups" not in saved:
        state, settings = {}, {}
        for key, value in saved.items():
            kind, _, rest = key.partition(".")
            name, _, field = rest.rpartition(".")
            (state if kind == "state" else settings).setdefault(name, {})[field] = value
        groups = {}
        for name in (n for n in params if n in settings):
            groups.setdefault((tuple(sorted(settings[name].items())), params[name].dim() >= 2), []).append(name)
        saved = {"state": state, "param_groups": [{**dict(k), "params": group} for (k, _), group in groups.items()]}
    index = {name: i for i, name in enumerate(n for group in saved["param_groups"] for n in group["params"])}
    return {
        "state": {index[name]: state for name, state in saved["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in saved["param_groups"]],
    }


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
