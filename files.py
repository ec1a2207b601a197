"""Crash-safe file writes and file hashes, shared by checkpoints, shards, manifests, assets and run outputs.

No torch here: prepare_data's tokenizer workers import it.
"""
import hashlib
import os
from pathlib import Path


def fsync_dir(directory):
    """Make a rename inside `directory` durable; a platform that cannot open a directory skips it."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path, data):
    """Write a file that readers (and a crash, even kill -9 or a power loss) see whole or not at all.

    data: bytes, str (written as UTF-8) or a function write(f) that writes to the binary file object f.
    The bytes go to a hidden temporary file in the same directory (`.<name>.<pid>.tmp`, so the rename
    stays on one filesystem and concurrent processes never share it), which is flushed and fsynced,
    renamed over `path` (os.replace: atomic) and the directory fsynced. On any exception, including
    KeyboardInterrupt, the temporary file is removed and the exception propagates; `path` is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def file_sha256(path):
    """Hex sha256 of a file, read in 16 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()
