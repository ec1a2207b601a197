"""A sharded run's checkpoints (parallel='fsdp'/'hsdp', tensor and pipeline parallelism): its model and optimizer
written to a checkpoint directory out_dir/ckpt_{step:06d}/ by torch.distributed.checkpoint (DCP), every rank its own
part in parallel, and read back into them at any layout, each rank reading the part it holds. The directory (its
shards, meta.pt, SHA256SUMS), verifying and reading it in one process are checkpoint.py's. It is written as
.ckpt_{step:06d}.tmp/ and renamed by rank 0 only after every rank's shards and the index are on disk, so it is
complete or absent. The state is saved as the model holds it; a caller whose model holds it otherwise (tensor
parallelism's c_attn rows) passes an adapter that converts it, as torchtitan's checkpointer calls its state-dict
adapter.
"""

import contextlib
import functools
import os
import warnings
from pathlib import Path

import torch.distributed as dist

from gpt2train.checkpoint import META, SUMS, TIED, HashingWriter, read_metadata, read_sharded, remove, save_checkpoint
from gpt2train.console import distributed
from gpt2train.files import atomic_write, file_sha256, fsync_dir


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


def save_sharded_checkpoint(path, meta, model, optimizer, adapter=None, stage=False):
    """Write the sharded checkpoint directory `path`. Under torch.distributed a collective: every rank calls
    it with its (FSDP-sharded) model and optimizer and writes its own shards; rank 0 writes `meta` (all
    the rest of the checkpoint) and renames the temporary directory into place once every rank's shards
    and DCP's index are on disk. A rank killed midway leaves only the temporary directory behind. adapter:
    None, or what puts the {'model', 'optimizer'} state in the saved layout, adapter.to_saved(state) (every rank
    calls it), and back, adapter.from_saved(state) (load_sharded_checkpoint's). stage: the model is a pipeline stage."""
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
    options = StateDictOptions(flatten_optimizer_state_dict=stage)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    if model.config.tie_embeddings:  # an untied head (GPT-NeoX) is a tensor of its own
        model_state.pop(TIED, None)
    # returns on every rank only after rank 0 has written .metadata, which it does once all ranks report
    # their shards written (and fsync'ed)
    with warnings.catch_warnings():  # DCP warns whenever it runs without a process group, as asked here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        writer = FileSystemWriter(str(tmp))
        writer.fs = _hashing_filesystem()()  # each rank hashes the shards it writes, as it writes them
        state = {"model": model_state, "optimizer": optimizer_state}
        if adapter is not None:
            state = adapter.to_saved(state)
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


def load_sharded_checkpoint(path, model, optimizer=None, collective=None, adapter=None):
    """Fill `model` (and `optimizer`) in place from the sharded checkpoint directory `path`, whatever layout
    they have here: FSDP shards at any world size, or whole tensors (DDP, one process). DCP reads the part
    each rank needs: a collective of every rank under torch.distributed (collective=None: if there is a
    process group), else a plain read by this process alone. adapter: save_sharded_checkpoint's."""
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
    if adapter is not None:  # DCP reads the saved layout; from_saved puts it back in the model's
        state = adapter.to_saved(state)
    state = read_sharded(path, state, distributed() if collective is None else collective)
    if adapter is not None:
        state = adapter.from_saved(state)
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=False))  # lm_head is wte
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=flat)


def flattened_optimizer(path):
    """Whether the sharded checkpoint `path` keys its optimizer groups' settings by parameter name (a pipeline's,
    save_sharded_checkpoint), not by group index."""
    keys = read_metadata(path).state_dict_metadata
    return any(k.startswith("optimizer.param_groups.") and not k.split(".")[2].isdigit() for k in keys)
