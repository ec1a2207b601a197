"""Crash-safe file writes, file hashes and directory locks, shared by checkpoints, shards, manifests, assets
and run outputs; and the expected errors: their one-line messages (first_line, error_line, error_message,
report_error), a locked directory (LockError) and a run that must stop (Halt).

No torch here: prepare_data's tokenizer workers import it.
"""

import contextlib
import errno
import hashlib
import os
import socket
import stat
from pathlib import Path

from gpt2train.console import log

try:
    import fcntl
except ImportError:  # Windows: no flock; directory_lock does not lock there
    fcntl = None

LOCK_FILE = ".lock"


def first_line(e):
    """'<type>: <the first line of its message>' (200 characters at most), for a message that quotes an error."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200]}" if text else type(e).__name__


OS_REASONS = {
    errno.EEXIST: "is a file, where a directory is expected",
    errno.ENOTDIR: "a part of this path is a file, not a directory",
    errno.ENOSPC: "no space left on the device; free some disk space",
    errno.EDQUOT: "disk quota exceeded; free some disk space",
}


def error_line(e):
    """The one line an expected error prints: an OSError as '<file>: <what is wrong with it>', the others their
    message."""
    if isinstance(e, OSError) and e.filename is not None:
        return f"{e.filename}: {OS_REASONS.get(e.errno, e.strerror)}"
    return " ".join(str(e).split())


def error_message(prog, e, about=None):
    """The scripts' handler for an expected error (bad input or environment), called in its except block: the
    line '<prog>: error: [<about>: ]<one line>' (`about` where the message does not name it already) for the
    caller to print before it exits. With GPT2_TRACEBACK=1 in the environment it re-raises instead."""
    if os.environ.get("GPT2_TRACEBACK") == "1":
        raise e
    line = error_line(e)
    return f"{prog}: error: {line if not about or about in line else f'{about}: {line}'}"


def report_error(prog, e, about=None):
    """error_message() on stderr, once per node (every node's log says why it stopped)."""
    log(error_message(prog, e, about), error=True)


def fsync_dir(directory):
    """Make a rename inside `directory` durable; a platform that cannot open a directory skips it."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
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
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if e.filename is None:  # a failed write (ENOSPC...) names no file
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def check_writable(path):
    """Raise the OSError (naming `path`) that writing it would meet, without creating or changing anything: a
    file written whole at the end of the work (atomic_write) is checked before it, and an earlier one is kept
    until then."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    if not path.parent.is_dir():
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
    if not os.access(path.parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))


def open_regular(path, follow_symlinks=True):
    """`path` opened for binary reading if it is a regular file; else an OSError naming it. Opened without
    blocking and checked before a byte is read: a FIFO (whose open would wait for a writer) or a device such as
    /dev/zero (endless) is refused, never read. follow_symlinks=False refuses a symlink too."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | (0 if follow_symlinks else getattr(os, "O_NOFOLLOW", 0))
    if not follow_symlinks and os.path.islink(path):  # O_NOFOLLOW's own error (ELOOP) would not say so
        raise OSError(errno.ELOOP, "is a symlink, not a regular file", str(path))
    fd = os.open(path, flags)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file (a FIFO, device or directory)", str(path))
    return os.fdopen(fd, "rb")


def read_regular(path, limit, follow_symlinks=True):
    """The bytes of `path`, a regular file (open_regular) of at most `limit` bytes; else an OSError naming it.
    For the small files a user can replace (manifests, sidecars, tokenizer files): a FIFO does not hang the
    reader, and neither /dev/zero nor a huge file can fill its memory."""
    with open_regular(path, follow_symlinks) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise OSError(errno.EFBIG, f"larger than {limit:,} bytes", str(path))
    return data


def file_sha256(path, follow_symlinks=True):
    """Hex sha256 of a regular file (open_regular), read in 16 MiB blocks."""
    h = hashlib.sha256()
    with open_regular(path, follow_symlinks) as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


class LockError(Exception):
    """Another live process holds a directory's lock; the message (one line) names it."""


class Halt(Exception):
    """Stop the run: status 'diverged' (nonfinite='halt', too many skipped steps, non-finite weights) or 'oom' (an
    out-of-memory that cannot be recovered from); train.py exits with the status's code (tracking.EXIT_CODES)."""

    def __init__(self, message, status="diverged"):
        super().__init__(message)
        self.status = status


@contextlib.contextmanager
def directory_lock(directory, program):
    """Hold an exclusive lock on `directory` for the with block: flock(2) on directory/.lock, which also
    records who holds it (`program`, pid, host) for the error a second process gets (LockError).

    The OS drops the lock when the process dies in any way (kill -9 included), so it is never stale;
    the file itself stays, unless the block created the directory and wrote nothing else into it (a run that
    failed at its start): then the directory goes too, with the parents created for it. Across machines it holds
    only where the shared filesystem implements flock for all its clients (docs/failure-modes.md); where flock is
    not supported at all, a note says the directory is not locked and the block runs anyway.
    """
    directory = Path(directory)
    created = [d for d in (directory, *directory.parents) if not d.exists()]  # what mkdir makes, innermost first
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    held = False
    try:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "another process"
                raise LockError(
                    f"{directory} is in use by {holder} (lock file {path}); wait until it ends, "
                    f"or use another directory"
                ) from None
            except OSError as e:
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    raise
                log(
                    f"{path}: this filesystem has no file locks ({e.strerror}); nothing stops a second process "
                    f"from using {directory} at the same time",
                    note=True,
                )
        held = True
        try:  # the first write of a run: a full disk fails here, and os.write's error names no file
            os.ftruncate(fd, 0)
            os.write(fd, f"{program} (pid {os.getpid()} on {socket.gethostname()})\n".encode())
        except OSError as e:
            raise OSError(e.errno, e.strerror, str(path)) from None
        yield path
    finally:
        if held:  # an empty file: nobody holds it now
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
        if held and created:
            with contextlib.suppress(OSError):
                if [p.name for p in directory.iterdir()] == [LOCK_FILE]:
                    path.unlink()  # while still held: a process after us makes a lock file of its own
                    for d in created:
                        d.rmdir()  # only while empty: a parent something else was written into stays
        os.close(fd)  # releases the flock


def lock_holder(directory):
    """Who holds `directory`'s directory_lock right now (its record, e.g. 'prepare_data.py (pid 12 on host)'),
    or None: a shared flock tried and released at once."""
    path = Path(directory) / LOCK_FILE
    if fcntl is None or not path.is_file():
        return None
    with open(path, "rb") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return f.read(512).decode(errors="replace").strip() or "another process"
        except OSError:  # no locks on this filesystem
            return None
    return None
