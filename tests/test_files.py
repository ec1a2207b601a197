"""files.py: an atomic write leaves the whole new file or the old one, no temporary file, and a durable rename."""

import errno
import hashlib
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import prepare_data
from gpt2train import assets, files
from gpt2train.checkpoint import save_checkpoint
from gpt2train.files import atomic_write, file_sha256
from gpt2train.shards import write_shard


def test_writes_bytes_text_or_through_a_function(tmp_path):
    atomic_write(tmp_path / "a.bin", b"\x00\x01")
    atomic_write(tmp_path / "sub" / "b.txt", "naïve\n")  # creates the directory
    atomic_write(tmp_path / "c.bin", lambda f: (f.write(b"head"), f.write(b"tail")))
    assert (tmp_path / "a.bin").read_bytes() == b"\x00\x01"
    assert (tmp_path / "sub" / "b.txt").read_text(encoding="utf-8") == "naïve\n"
    assert (tmp_path / "c.bin").read_bytes() == b"headtail"
    atomic_write(tmp_path / "a.bin", b"replaced")
    assert (tmp_path / "a.bin").read_bytes() == b"replaced"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "c.bin", "sub"]


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_write_that_fails_midway_leaves_old_file_or_none_and_no_temporary(tmp_path, error):
    def half_then_fail(f):
        f.write(b"partial")
        f.flush()
        raise error("disk full")

    atomic_write(tmp_path / "old.bin", b"old contents")
    for name in ("old.bin", "new.bin"):
        with pytest.raises(error):
            atomic_write(tmp_path / name, half_then_fail)
    assert (tmp_path / "old.bin").read_bytes() == b"old contents"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.bin"]  # no new.bin, no .tmp left


def test_file_is_fsynced_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    target = tmp_path / "out.bin"
    synced = []  # (a directory?, did the final file exist yet?)
    real_fsync = os.fsync

    def recording_fsync(fd):
        synced.append((stat.S_ISDIR(os.fstat(fd).st_mode), target.exists()))
        real_fsync(fd)

    monkeypatch.setattr(files.os, "fsync", recording_fsync)
    atomic_write(target, b"data")
    assert synced == [(False, False), (True, True)]


WRITERS = {  # every durable file the library writes goes through atomic_write
    "checkpoint": lambda path: save_checkpoint(path, {"step": torch.tensor(1)}),
    "shard": lambda path: write_shard(path, np.arange(10)),
    "manifest": lambda path: prepare_data.write_manifest(path, {"shards": []}),
    "asset": lambda path: assets._fetch(path, hashlib.sha256(b"x").hexdigest(), [("test", lambda: b"x")]),
}


@pytest.mark.parametrize("kind", sorted(WRITERS))
def test_library_writers_fsync_their_directory(tmp_path, monkeypatch, kind):
    dirs = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            dirs.append(os.fstat(fd).st_ino)
        real_fsync(fd)

    monkeypatch.setattr(files.os, "fsync", recording_fsync)
    WRITERS[kind](tmp_path / f"out_{kind}")
    written = [f"out_{kind}"] + ([f"out_{kind}.sha256"] if kind == "checkpoint" else [])  # its sidecar: a file too
    assert dirs == [tmp_path.stat().st_ino] * len(written)
    assert sorted(p.name for p in tmp_path.iterdir()) == written


def test_file_sha256(tmp_path):
    data = os.urandom(3 << 20)
    (tmp_path / "x").write_bytes(data)
    assert file_sha256(tmp_path / "x") == hashlib.sha256(data).hexdigest()


def test_file_sha256_refuses_a_fifo_or_a_device_without_reading_it(tmp_path, deadline):
    os.mkfifo(tmp_path / "fifo")  # open() for reading would wait for a writer; read() of /dev/zero never ends
    (tmp_path / "link").symlink_to(tmp_path / "x")
    (tmp_path / "x").write_bytes(b"x")
    with deadline(30):
        for path in [tmp_path / "fifo", "/dev/zero", tmp_path]:
            with pytest.raises(OSError, match="not a regular file"):
                file_sha256(path)
    assert file_sha256(tmp_path / "link") == hashlib.sha256(b"x").hexdigest()
    with pytest.raises(OSError, match="is a symlink"):
        file_sha256(tmp_path / "link", follow_symlinks=False)


HOLD_LOCK = """
import sys, time
from gpt2train import files
with files.directory_lock(sys.argv[1], "holder.py"):
    print("locked", flush=True)
    time.sleep(600)
"""


def test_directory_lock_names_its_holder_and_dies_with_it(tmp_path):
    """A second locker gets a LockError naming the holder's pid; kill -9 of the holder frees the lock at once."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(tmp_path / "run")],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,  # the root: gpt2train importable
    )
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(files.LockError) as err:
            with files.directory_lock(tmp_path / "run", "second.py"):
                pass
        message = str(err.value)
        assert f"holder.py (pid {holder.pid} on " in message and "\n" not in message
    finally:
        holder.kill()  # SIGKILL: no cleanup code runs
        holder.wait()
    with files.directory_lock(tmp_path / "run", "third.py") as lock_file:  # not stale
        assert "third.py (pid" in lock_file.read_text()
        with pytest.raises(files.LockError):  # a second lock in the same process is refused too
            with files.directory_lock(tmp_path / "run", "fourth.py"):
                pass
    assert lock_file.read_text() == ""  # released: nobody named as the holder


def test_a_lock_that_made_its_directory_and_wrote_nothing_else_leaves_nothing_behind(tmp_path):
    """Issue 38: every failed train.py start left an empty out_dir holding only its .lock."""
    with files.directory_lock(tmp_path / "out" / "run", "train.py"):
        pass
    assert list(tmp_path.iterdir()) == []  # out/run and out/, both made for the lock
    with files.directory_lock(tmp_path / "out" / "run", "train.py"):
        (tmp_path / "out" / "run" / "config.json").write_text("{}")
    assert sorted(p.name for p in (tmp_path / "out" / "run").iterdir()) == [".lock", "config.json"]
    (tmp_path / "kept").mkdir()
    with files.directory_lock(tmp_path / "kept", "train.py"):  # there before the lock: not its to remove
        pass
    assert [p.name for p in (tmp_path / "kept").iterdir()] == [".lock"]


def test_a_full_disk_names_the_file_being_written(tmp_path):
    def fill(f):
        raise OSError(errno.ENOSPC, "No space left on device")  # what f.write raises: no file name

    with pytest.raises(OSError) as e:
        atomic_write(tmp_path / "config.json", fill)
    assert (e.value.errno, e.value.filename) == (errno.ENOSPC, str(tmp_path / "config.json"))
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_at_the_lock_names_the_lock_file(tmp_path, monkeypatch):
    """The lock's record is the first write of a run or a prep: os.write's error names no file."""

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError) as e:
        with files.directory_lock(tmp_path / "run", "train.py"):
            pass
    monkeypatch.undo()
    assert (
        files.error_line(e.value) == f"{tmp_path / 'run' / '.lock'}: no space left on the device; free some disk space"
    )
