"""checkpoint.py: atomic writes, sha256 sidecars verified on load with fallback, free-space checks, one-line load
errors."""

import errno
import hashlib
import os
import shutil
import signal
import zipfile
from pathlib import Path

import pytest
import torch

import train
from gpt2train import checkpoint, optim
from gpt2train.checkpoint import (
    FORMAT,
    CheckpointError,
    checkpoint_path,
    checksum_path,
    load_checkpoint,
    load_latest_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)
from gpt2train.files import file_sha256
from model import GPT, GPTConfig
from tiny import expect_exit, metrics, one_line_error, run, train_losses

TINY = dict(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=32)


def fake_ckpt(step, **extra):
    return {
        "format": FORMAT,
        "step": step,
        "model": {"w": torch.full((3,), float(step))},
        "model_args": {},
        "config": {},
        "rng": [{"python": [3, list(range(5)), None]}],
        **extra,
    }


def test_roundtrip_loads_with_weights_only(tmp_path):
    path = checkpoint_path(tmp_path, 7)
    assert path.name == "ckpt_000007.pt"
    save_checkpoint(path, fake_ckpt(7, val_loss=None))
    ckpt = load_checkpoint(path)
    assert ckpt["step"] == 7 and torch.equal(ckpt["model"]["w"], torch.full((3,), 7.0))
    assert load_checkpoint(tmp_path)["step"] == 7  # a directory means its latest checkpoint
    # no temporary file left; the sidecar records the sha256 in sha256sum's format
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt_000007.pt", "ckpt_000007.pt.sha256"]
    assert (tmp_path / "ckpt_000007.pt.sha256").read_text() == f"{file_sha256(path)}  ckpt_000007.pt\n"


def file_mappings(path):
    """[(start, end)] address ranges of this process mapped from `path` (Linux /proc/self/maps)."""
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(path):
            start, end = (int(a, 16) for a in fields[0].split("-"))
            out.append((start, end))
    return out


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads Linux's /proc/self/maps")
def test_loading_maps_the_file_instead_of_reading_it(tmp_path):
    """Resume on 8 ranks must not hold 8 private copies of an 18 GB checkpoint: the tensors' memory is the
    file's pages (shared through the page cache), not a copy read into each process."""
    path = checkpoint_path(tmp_path, 3)
    save_checkpoint(path, fake_ckpt(3, optimizer={"m": torch.arange(1 << 20, dtype=torch.float32)}))
    ckpt = load_checkpoint(path)
    tensor = ckpt["optimizer"]["m"]
    assert torch.equal(tensor, torch.arange(1 << 20, dtype=torch.float32))
    ptr = tensor.untyped_storage().data_ptr()
    assert any(start <= ptr < end for start, end in file_mappings(path.resolve())), "tensor is not file-backed"


def test_latest_skips_truncated_and_temporary_files(tmp_path):
    save_checkpoint(checkpoint_path(tmp_path, 1), fake_ckpt(1))
    save_checkpoint(checkpoint_path(tmp_path, 2), fake_ckpt(2))
    good = checkpoint_path(tmp_path, 2).read_bytes()
    checkpoint_path(tmp_path, 3).write_bytes(good[: len(good) // 2])  # a torn write under the final name
    (tmp_path / ".ckpt_000004.pt.123.tmp").write_bytes(good)  # an interrupted save's temporary file
    assert load_checkpoint(tmp_path)["step"] == 2
    assert checkpoint.list_checkpoints(tmp_path / "missing") == []


@pytest.mark.parametrize("content", [b"", b"not a checkpoint at all", "truncated", "foreign"])
def test_bad_files_give_one_line_errors(tmp_path, content):
    path = tmp_path / "ckpt_000001.pt"
    if content == "truncated":
        save_checkpoint(path, fake_ckpt(1))
        path.write_bytes(path.read_bytes()[:-100])
    elif content == "foreign":
        torch.save({"state_dict": {"w": torch.zeros(2)}}, path)  # someone else's checkpoint
    else:
        path.write_bytes(content)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_missing_file_and_empty_dir(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        load_checkpoint(tmp_path / "ckpt_000001.pt")
    with pytest.raises(CheckpointError, match=r"no checkpoint \(ckpt_XXXXXX.pt or ckpt_XXXXXX/\) in this directory"):
        load_checkpoint(tmp_path)


def test_crash_during_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    save_checkpoint(checkpoint_path(tmp_path, 1), fake_ckpt(1))

    def crash(obj, f):  # half a file reaches the disk, then the process "dies"
        f.write(b"PK\x03\x04 partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint.torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(checkpoint_path(tmp_path, 2), fake_ckpt(2))
    assert load_checkpoint(tmp_path)["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt_000001.pt", "ckpt_000001.pt.sha256"]


def test_prune_keeps_last_n_and_the_best(tmp_path):
    for step in range(1, 6):
        save_checkpoint(checkpoint_path(tmp_path, step), fake_ckpt(step))
    (tmp_path / "ckpt_000006.pt.sha256").write_text("0" * 64 + "  ckpt_000006.pt\n")  # a save killed before its rename
    prune_checkpoints(tmp_path, keep_last=2, keep_steps={1})
    kept = ["ckpt_000001.pt", "ckpt_000004.pt", "ckpt_000005.pt"]  # each with its sidecar, nothing else
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept + [k + ".sha256" for k in kept])
    prune_checkpoints(tmp_path, keep_last=0)  # 0 keeps everything
    assert len(list(tmp_path.iterdir())) == 6


# ----------------------------------------------------------------------------- verification, disk space


def tensor_offset(path, tensor):
    """Where a tensor's bytes start in a checkpoint file (torch.save stores them uncompressed, as they are)."""
    offset = path.read_bytes().find(tensor.numpy().tobytes())
    assert offset > 0
    return offset


def overwrite(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def two_checkpoints(tmp_path):
    for step in (1, 2):
        save_checkpoint(checkpoint_path(tmp_path, step), fake_ckpt(step, big=torch.randn(4096)))
    return checkpoint_path(tmp_path, 2)


@pytest.mark.parametrize("damage", ["random bytes in tensor data", "damaged metadata"])
def test_a_damaged_checkpoint_is_named_and_a_directory_falls_back(tmp_path, damage):
    newest = two_checkpoints(tmp_path)
    if damage == "random bytes in tensor data":  # loads fine as a zip: only the checksum can tell
        overwrite(newest, tensor_offset(newest, load_checkpoint(newest)["big"]) + 1000, os.urandom(16))
    else:  # inside the pickle that describes the tensors
        with zipfile.ZipFile(newest) as z:
            info = next(i for i in z.infolist() if i.filename.endswith("data.pkl"))
        header = newest.read_bytes()[info.header_offset : info.header_offset + 30]  # the zip's local file header
        name_len, extra_len = int.from_bytes(header[26:28], "little"), int.from_bytes(header[28:30], "little")
        overwrite(newest, info.header_offset + 30 + name_len + extra_len + 10, b"\xff" * 8)
    with pytest.raises(CheckpointError) as err:  # named explicitly: an error, one line
        load_checkpoint(newest)
    assert str(newest) in str(err.value) and "damaged" in str(err.value) and "\n" not in str(err.value)
    notes = []
    assert load_checkpoint(tmp_path, note=notes.append)["step"] == 1  # a directory: its newest good one
    assert len(notes) == 1 and notes[0].startswith(f"skipping {newest}: damaged: its sha256 is ")
    ckpt, path = load_latest_checkpoint(tmp_path, note=notes.append)
    assert path == checkpoint_path(tmp_path, 1) and ckpt["step"] == 1


def test_a_checkpoint_without_its_sidecar_is_refused_and_skipped(tmp_path):
    """Every checkpoint is written with its .sha256: one without is unverifiable, an error when named and skipped
    with a note in an out_dir."""
    newest = two_checkpoints(tmp_path)
    checksum_path(newest).unlink()
    with pytest.raises(CheckpointError, match=r"no ckpt_000002.pt.sha256: cannot verify the checkpoint"):
        load_checkpoint(newest)
    notes = []
    assert load_checkpoint(tmp_path, note=notes.append)["step"] == 1
    assert notes == [f"skipping {newest}: no ckpt_000002.pt.sha256: cannot verify the checkpoint"]
    assert load_checkpoint(newest, verify=False)["step"] == 2  # another rank verified it: complete is enough


def test_nothing_loads_is_one_line(tmp_path):
    newest = two_checkpoints(tmp_path)
    for step in (1, 2):
        overwrite(checkpoint_path(tmp_path, step), 100, b"\x00" * 8)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path, note=lambda message: None)
    assert "none of its 2 checkpoints loads" in str(err.value) and str(newest) in str(err.value)
    assert "\n" not in str(err.value)


def test_storage_bytes_counts_shared_storage_once_and_bounds_the_file(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY))  # lm_head.weight is wte.weight: one storage
    obj = {"model": model.state_dict(), "format": FORMAT, "step": 1, "model_args": {}, "config": {}}
    assert checkpoint.storage_bytes(obj) == sum(p.numel() * 4 for p in model.parameters())  # lists it once
    save_checkpoint(checkpoint_path(tmp_path, 1), obj)
    size = checkpoint_path(tmp_path, 1).stat().st_size
    assert checkpoint.storage_bytes(obj) <= size <= checkpoint.storage_bytes(obj) * 1.01 + 2**20


def test_full_disk_is_refused_before_writing(tmp_path, monkeypatch):
    save_checkpoint(checkpoint_path(tmp_path, 1), fake_ckpt(1))
    big = fake_ckpt(2, big=torch.zeros(3 * 2**20 // 4))  # 3 MiB of tensor data
    monkeypatch.setattr(
        checkpoint.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12 - 2**20, 2**20)
    )
    with pytest.raises(CheckpointError) as err:
        save_checkpoint(checkpoint_path(tmp_path, 2), big)
    assert "not enough disk space to write this checkpoint: it needs about 4 MiB" in str(err.value)
    assert "has 1 MiB free" in str(err.value) and "\n" not in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt_000001.pt", "ckpt_000001.pt.sha256"]
    assert load_checkpoint(tmp_path)["step"] == 1


def test_disk_filling_up_midway_is_one_line_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    save_checkpoint(checkpoint_path(tmp_path, 1), fake_ckpt(1))
    real_open, written = open, [0]

    class FillingFile:  # a disk that fills up after 2,000 bytes of the new checkpoint
        def __init__(self, f):
            self.f = f

        def write(self, data):
            written[0] += len(data)
            if written[0] > 2000:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

    def filling_open(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        return FillingFile(f) if "ckpt_000002.pt." in str(path) and "w" in mode else f

    monkeypatch.setattr("builtins.open", filling_open)
    with pytest.raises(CheckpointError) as err:
        save_checkpoint(checkpoint_path(tmp_path, 2), fake_ckpt(2, big=torch.randn(4096)))
    monkeypatch.undo()
    assert str(err.value) == (
        f"{checkpoint_path(tmp_path, 2)}: cannot write the checkpoint (No space left on device); "
        "free some disk space; nothing was written, the previous checkpoints are kept"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt_000001.pt", "ckpt_000001.pt.sha256"]
    assert load_checkpoint(tmp_path)["step"] == 1


def test_a_file_sidecar_verifies_the_file_beside_it_whatever_it_names(tmp_path, deadline):
    """The name inside ckpt_000001.pt.sha256 is for `sha256sum -c`: a loader never opens it, so a sidecar naming
    /dev/zero or a FIFO cannot hang it, and any other file it names cannot vouch for this one."""
    path = checkpoint_path(tmp_path, 1)
    save_checkpoint(path, fake_ckpt(1))
    digest = file_sha256(path)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with deadline(30):
        for named in ["/dev/zero", str(fifo), "../../etc/passwd", "ckpt_000001.pt"]:
            checksum_path(path).write_text(f"{digest}  {named}\n")
            assert load_checkpoint(path)["step"] == 1, named
        checksum_path(path).write_text(f"{'0' * 64}  /dev/zero\n")
        with pytest.raises(CheckpointError, match="damaged"):
            load_checkpoint(path)
        checksum_path(path).write_text(f"{digest}  ckpt_000001.pt\n{digest}  other.pt\n")
        with pytest.raises(CheckpointError, match=r"unreadable checksum file ckpt_000001.pt.sha256 \(2 lines"):
            load_checkpoint(path)
        for sidecar in ["/dev/zero", str(fifo)]:  # the sidecar itself a device or a FIFO: refused, not read
            checksum_path(path).unlink()
            checksum_path(path).symlink_to(sidecar)
            with pytest.raises(CheckpointError, match="unreadable checksum file .*not a regular file"):
                load_checkpoint(path)
        with pytest.raises(CheckpointError, match="none of its 1 checkpoints loads"):
            load_latest_checkpoint(tmp_path, note=lambda message: None)


def test_a_copied_pair_renamed_to_best_verifies_the_copy(tmp_path):
    """ckpt_000030.pt + its sidecar copied to best.pt + best.pt.sha256: the sidecar still names ckpt_000030.pt
    inside, and it verifies best.pt: a damaged best.pt is refused, an intact one loads on its own."""
    original, best = checkpoint_path(tmp_path, 30), tmp_path / "best.pt"
    save_checkpoint(original, fake_ckpt(30, big=torch.randn(4096)))
    shutil.copy(original, best)
    shutil.copy(checksum_path(original), checksum_path(best))
    assert "ckpt_000030.pt" in checksum_path(best).read_text()
    overwrite(best, tensor_offset(best, load_checkpoint(best)["big"]) + 1000, os.urandom(16))
    with pytest.raises(CheckpointError, match=r"best.pt: damaged: its sha256 is"):
        load_checkpoint(best)
    shutil.copy(original, best)
    original.unlink()  # the original gone: the copy verifies alone
    checksum_path(original).unlink()
    assert load_checkpoint(best, note=pytest.fail)["step"] == 30


# ----------------------------------------------------------------------------- in a training run


def test_crash_while_writing_a_checkpoint_keeps_the_previous_one(data_dir, tmp_path, monkeypatch):
    real_save, saves = checkpoint.torch.save, []

    def save_then_crash(obj, f):
        saves.append(obj["step"])
        if obj["step"] == 8:  # the second checkpoint: half written, then the process dies
            f.write(b"PK\x03\x04 partial checkpoint")
            raise KeyboardInterrupt
        real_save(obj, f)

    monkeypatch.setattr(checkpoint.torch, "save", save_then_crash)
    expect_exit(130, run, data_dir, tmp_path, "--max_steps=8")  # as a Ctrl-C
    assert saves == [4, 8]
    assert load_latest_checkpoint(tmp_path, consolidate=False)[1] == tmp_path / "ckpt_000004.pt"
    assert load_checkpoint(tmp_path)["step"] == 4
    monkeypatch.setattr(checkpoint.torch, "save", real_save)
    assert train.main(["--init_from=resume", f"--out_dir={tmp_path}"]) == 0  # and training can go on
    assert load_checkpoint(tmp_path)["step"] == 8


def damage_tensor_data(path, key="transformer.wte.weight", data=None):
    """Overwrite 16 bytes inside a tensor's data in a checkpoint file (random bytes by default)."""
    raw = load_checkpoint(path)["model"][key].numpy().tobytes()
    offset = path.read_bytes().find(raw)
    assert offset > 0
    with open(path, "r+b") as f:
        f.seek(offset + len(raw) // 2)
        f.write(os.urandom(16) if data is None else data)


@pytest.mark.parametrize("damage", ["tensor data", "metadata"])
def test_resume_falls_back_past_a_damaged_checkpoint(data_dir, tmp_path, capsys, damage):
    assert run(data_dir, tmp_path, "--max_steps=8") == 0  # checkpoints at 4 and 8
    losses = train_losses(tmp_path)
    newest = tmp_path / "ckpt_000008.pt"
    if damage == "tensor data":
        damage_tensor_data(newest, "transformer.h.0.mlp.c_fc.weight")
    else:
        with open(newest, "r+b") as f:  # the zip's central directory, at the end of the file
            f.seek(-40, os.SEEK_END)
            f.write(os.urandom(16))
    capsys.readouterr()
    assert train.main(["--init_from=resume", f"--out_dir={tmp_path}", "--max_steps=8"]) == 0
    err = capsys.readouterr().err
    assert f"note: skipping {newest}: damaged: its sha256 is " in err
    assert train_losses(tmp_path) == losses  # resumed from step 4 and redid 5..8 exactly
    assert load_checkpoint(newest)["step"] == 8  # rewritten, and verifies


def test_a_resume_where_no_checkpoint_verifies_is_refused_never_a_fresh_start(data_dir, tmp_path, capsys):
    assert run(data_dir, tmp_path, "--max_steps=8") == 0  # checkpoints at 4 and 8
    for step in (4, 8):
        damage_tensor_data(tmp_path / f"ckpt_{step:06d}.pt")
    steps_logged = len(metrics(tmp_path))
    capsys.readouterr()
    expect_exit(1, train.main, ["--init_from=resume", f"--out_dir={tmp_path}", "--max_steps=12"])
    assert "none of its 2 checkpoints loads" in one_line_error(capsys)
    assert len(metrics(tmp_path)) == steps_logged  # nothing trained, nothing logged: no run from random weights


def test_disk_full_at_a_save_is_one_line_and_the_run_resumes(data_dir, tmp_path, monkeypatch, capsys):
    real = checkpoint.shutil.disk_usage
    saves = []

    def disk_usage(path):  # the disk is full from the second save on
        saves.append(path)
        usage = real(path)
        return usage if len(saves) < 2 else usage._replace(free=1000)

    monkeypatch.setattr(checkpoint.shutil, "disk_usage", disk_usage)
    expect_exit(1, run, data_dir, tmp_path, "--max_steps=12")
    line = one_line_error(capsys)
    assert f"{tmp_path / 'ckpt_000008.pt'}: not enough disk space to write this checkpoint: it needs about " in line
    assert "MiB free; nothing was written, the previous checkpoints are kept" in line
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("ckpt", ".ckpt"))) == [
        "ckpt_000004.pt",
        "ckpt_000004.pt.sha256",
    ]
    monkeypatch.undo()
    assert train.main(["--init_from=resume", f"--out_dir={tmp_path}"]) == 0
    assert load_checkpoint(tmp_path)["step"] == 12


def test_disk_filling_up_during_a_save_is_one_line_and_the_run_resumes(data_dir, tmp_path, monkeypatch, capsys):
    real_save = checkpoint.torch.save

    def save_until_full(obj, f):
        if obj["step"] == 8:  # a third of the checkpoint reaches the disk, then it is full
            f.write(b"\0" * 3000)
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(obj, f)

    monkeypatch.setattr(checkpoint.torch, "save", save_until_full)
    expect_exit(1, run, data_dir, tmp_path, "--max_steps=12")
    assert (
        "ckpt_000008.pt: cannot write the checkpoint (No space left on device); free some disk space"
        in one_line_error(capsys)
    )
    assert not list(tmp_path.glob(".ckpt_*"))  # the temporary file is gone
    monkeypatch.undo()
    assert train.main(["--init_from=resume", f"--out_dir={tmp_path}", "--max_steps=8"]) == 0
    assert load_checkpoint(tmp_path)["step"] == 8


def test_a_second_ctrl_c_during_a_save_exits_130_and_says_what_was_kept(data_dir, tmp_path, monkeypatch, capsys):
    real_write = checkpoint.HashingWriter.write
    saves = []

    class Interrupted:  # the file being written, as Ctrl-C is pressed twice during the write
        def __init__(self, f):
            self.f = f

        def write(self, data):
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            return self.f.write(data)

    def write(self, data):
        if self.sha256.digest() == hashlib.sha256().digest():  # the first write of a checkpoint
            saves.append(1)
            if len(saves) == 2:
                self.f = Interrupted(self.f)
        return real_write(self, data)

    monkeypatch.setattr(checkpoint.HashingWriter, "write", write)
    expect_exit(130, run, data_dir, tmp_path, "--max_steps=8")
    err = capsys.readouterr().err
    assert err.count("train.py: error: ") == 1 and "Traceback" not in err, err
    assert (
        f"train.py: error: interrupted; the last checkpoint, {tmp_path / 'ckpt_000004.pt'}, is kept (continue "
        f"with --init_from=resume)\n"
    ) in err
    assert sorted(p.name for p in tmp_path.glob("*ckpt*")) == ["ckpt_000004.pt", "ckpt_000004.pt.sha256"]


@pytest.mark.parametrize("flat", [False, True])  # True: a pipeline's, each group's settings keyed by parameter name
@pytest.mark.parametrize("weight_decay", [0.1, 0.0])  # 0.0: adamw's two groups have equal settings
def test_a_sharded_optimizer_state_is_numbered_as_the_optimizer_numbers_its_parameters(flat, weight_decay):
    """Consolidating renumbers a sharded checkpoint's optimizer state (keyed by parameter name) as
    optimizer.state_dict() does, from what the checkpoint holds: no optimizer is built to load it into."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY))
    optimizer = optim.adamw(list(model.parameters()), weight_decay, 1e-3, (0.9, 0.95))  # 2-D tensors, then the rest
    x = torch.randint(0, TINY["vocab_size"], (2, 8))
    model(x, x, return_logits=False)[1].backward()
    optimizer.step()
    saved = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=flat))
    numbered, now = checkpoint.by_index(saved, dict(model.named_parameters())), optimizer.state_dict()
    assert numbered["param_groups"] == now["param_groups"]
    assert numbered["state"].keys() == now["state"].keys()
    assert all(torch.equal(t, numbered["state"][i][k]) for i, s in now["state"].items() for k, t in s.items())
