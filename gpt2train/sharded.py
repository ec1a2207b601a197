"""Sharded checkpoints (parallel='fsdp'/'hsdp'): a directory out_dir/ckpt_{step:06d}/ of torch.distributed.checkpoint
(DCP) shards of the model and optimizer, every rank writing its own part in parallel (__0_0.distcp, __1_0.distcp, ...
and DCP's .metadata index), plus meta.pt, a checkpoint file (checkpoint_file.py) without the model and optimizer. It is
written as .ckpt_{step:06d}.tmp/ and renamed by rank 0 only after every rank's shards and the index are on disk, so it
is complete or absent. DCP reshards on load: a sharded checkpoint resumes at any world size, and loads into a single
process without a process group (checkpoint.py's load_checkpoint and model_from_checkpoint, `python checkpoint.py
consolidate` to write the single-file form).

A sharded checkpoint is verified like a file before any tensor is read: its SHA256SUMS records the sha256
of every file in it (each rank hashes its shards as it writes them, rank 0 writes the list before the rename), and
every shard the .metadata index names must be there, listed, at the size the index needs (check_shards).
DCP itself unpickles .metadata and the shards' non-tensor values with plain pickle (a crafted checkpoint
would run code): they are read here through an unpickler that builds only DCP's metadata classes
(_MetadataUnpickler) and with weights_only=True (_safe_dcp), wherever a sharded checkpoint is opened.
"""

import contextlib
import functools
import os
import pickle
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from gpt2train.checkpoint_file import (
    SUMS,
    CheckpointError,
    HashingWriter,
    checksum_path,
    read_checksums,
    remove,
    save_checkpoint,
)
from gpt2train.console import distributed
from gpt2train.files import atomic_write, file_sha256, first_line, fsync_dir, open_regular
from gpt2train.tensor_parallel import from_saved, model_rows, to_saved

META = "meta.pt"  # a sharded checkpoint's everything-but-the-tensors file
META_FILES = frozenset({META, ".metadata"})  # what rank 0 verifies of a sharded checkpoint before the group starts
TIED = "lm_head.weight"  # tied (GPT-2), the same tensor as transformer.wte.weight: stored once in sharded checkpoints


def is_sharded(path):
    """Whether `path` is a sharded checkpoint directory (as opposed to a file, or an out_dir)."""
    path = Path(path)
    return path.is_dir() and ((path / META).exists() or (path / ".metadata").exists())


class _HashingStream(HashingWriter):
    """HashingWriter for DCP's writer, which also asks its stream tell(), fileno() and close()."""

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


def save_sharded_checkpoint(path, meta, model, optimizer):
    """Write the sharded checkpoint directory `path`. Under torch.distributed a collective: every rank calls
    it with its (FSDP-sharded) model and optimizer and writes its own shards; rank 0 writes `meta` (all
    the rest of the checkpoint) and renames the temporary directory into place once every rank's shards
    and DCP's index are on disk. A rank killed midway leaves only the temporary directory behind."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    collective = distributed()
    first = not collective or dist.get_rank() == 0
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")  # the same name on every rank
    if first:
        remove(tmp)  # what an interrupted save of this step left
        tmp.mkdir(parents=True)
    if collective:
        dist.barrier()
    # a pipeline stage's optimizer groups list its own parameters only: each name then carries its group's settings
    # (flattened), where one list per group would be written by one stage for all
    options = StateDictOptions(flatten_optimizer_state_dict=len(model.transformer.h) < model.config.n_layer)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    if model.config.tie_embeddings:  # an untied head (GPT-NeoX) is a tensor of its own
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
        remove(old)
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
    if model.config.tie_embeddings:
        state["model"].pop(TIED, None)
    # DCP creates the optimizer's state (a zero-lr step) only where no parameter has a gradient yet; DDP's are its
    # bucket views from the start (parallel.keeps_grads): set aside while it does, then put back
    grads = {p: p.grad for p in model.parameters()}
    for p in grads:
        p.grad = None
    flat = StateDictOptions(flatten_optimizer_state_dict=optimizer is not None and flattened_optimizer(path))
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer, options=flat)
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
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=flat)


def flattened_optimizer(path):
    """Whether the sharded checkpoint `path` keys its optimizer groups' settings by parameter name (a pipeline's,
    save_sharded_checkpoint), not by group index."""
    keys = read_metadata(path).state_dict_metadata
    return any(k.startswith("optimizer.param_groups.") and not k.split(".")[2].isdigit() for k in keys)


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
