"""A checkpoint file on disk: its names, one written atomically with its sha256 sidecar, and a checkpoint (file or
sharded directory) verified against the sha256s recorded when it was written. What a checkpoint holds, and reading
one back, is checkpoint.py's; the sharded (DCP) form is sharded.py's.

Writes go through files.atomic_write (a hidden temporary file in the same directory, fsync'ed, renamed
over the final name, the directory fsync'ed): a crash (even kill -9) at any moment leaves either the old
set of checkpoints or the new one, never a truncated ckpt_*.pt. Before writing, the free disk space is
checked against the checkpoint's size.

Each checkpoint's sha256 is recorded in a sidecar, ckpt_{step:06d}.pt.sha256 (`sha256sum -c` reads it),
written before the checkpoint is renamed into place, so a checkpoint written here never lacks one. The sidecar
verifies the file it sits beside, whatever name is written in it (verify_checkpoint). A sharded checkpoint's
SHA256SUMS records the sha256 of every file in it.
"""

import errno
import hashlib
import os
import re
import shutil
from pathlib import Path

import torch

from gpt2train.files import atomic_write, file_sha256, read_regular

FORMAT = "gpt2-train-ckpt-v1"
CKPT_NAME = re.compile(r"^ckpt_(\d{6,})(\.pt)?$")  # a file ckpt_000100.pt or a sharded directory ckpt_000100
SUMS = "SHA256SUMS"  # a sharded checkpoint's sidecar: the sha256 of each of its files (`sha256sum -c SHA256SUMS`)


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
