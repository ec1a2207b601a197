"""Sharded checkpoints are as safe and as verified as single files: no pickled code runs from .metadata or the
shards, every file's sha256 is checked before any tensor is read, an incomplete directory is skipped with a note,
and every failure is one line."""

import json
import os
import pickle

import pytest
import torch

import checkpoint as checkpoint_command
import hellaswag
import sample
import train
from gpt2train import checkpoint, loading, sharded
from gpt2train.checkpoint import CheckpointError, load_checkpoint, load_latest_checkpoint
from gpt2train.files import file_sha256
from test_fsdp import tiny_sharded_checkpoint
from test_hellaswag import EXAMPLES


def rewrite_sums(path):
    """What a forger does: SHA256SUMS made to match the directory's files as they are now."""
    names = sorted(p.name for p in path.iterdir() if p.name not in (checkpoint.SUMS, "meta.pt.sha256"))
    (path / checkpoint.SUMS).write_text("".join(f"{file_sha256(path / n)}  {n}\n" for n in names))


class CreatesAFile:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


def entry_points(ckpt, tmp_path):
    """The five programs that open a sharded checkpoint, each as a callable returning its exit status."""
    (tmp_path / "hs.jsonl").write_text("".join(json.dumps(ex) + "\n" for ex in EXAMPLES[:2]))
    flags = ["--ckpt", str(ckpt), "--device", "cpu", "--dtype", "float32"]

    def exits(main, argv):
        try:
            return main(argv)
        except SystemExit as e:
            return e.code

    return {
        "sample": lambda: exits(sample.main, [*flags, "--max_new_tokens", "2", "--prompt", "x"]),
        "hellaswag": lambda: exits(hellaswag.main, [*flags, "--data", str(tmp_path / "hs.jsonl")]),
        "consolidate": lambda: checkpoint_command.main(["consolidate", str(ckpt), str(tmp_path / "one.pt")]),
        "export": lambda: checkpoint_command.main(["export", str(ckpt), str(tmp_path / "hf")]),
        "resume": lambda: exits(train.main, ["--init_from=resume", f"--out_dir={ckpt.parent}", "--device=cpu"]),
    }


def one_line_error(capsys):
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("note:")]
    assert len(err) == 1 and "error:" in err[0] and "Traceback" not in err[0], err
    return err[0]


def test_a_metadata_that_would_run_code_is_refused_by_every_entry_point(tmp_path, capsys):
    ckpt = tmp_path / "run" / "ckpt_000005"
    tiny_sharded_checkpoint(ckpt)
    metadata = pickle.load(open(ckpt / ".metadata", "rb"))
    marker = tmp_path / "pwned"
    metadata.storage_meta = CreatesAFile(marker)  # unpickled as the index is read, before any tensor
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    rewrite_sums(ckpt)  # a sidecar proves nothing about who wrote the directory
    for name, run in entry_points(ckpt, tmp_path).items():
        assert run() in (1, 2), name
        assert "io.open is not allowed in a checkpoint's .metadata" in one_line_error(capsys), name
        assert not marker.exists(), name


def test_a_shard_value_that_would_run_code_is_refused(tmp_path):
    """DCP torch.saves non-tensor values (the optimizer's hyperparameters) into the shards, and torch's planner
    loads them with weights_only=False."""
    ckpt = tmp_path / "ckpt_000005"
    model, optimizer = tiny_sharded_checkpoint(ckpt)
    metadata = checkpoint.read_metadata(ckpt)
    info = next(i for k, i in metadata.storage_data.items() if "param_groups" in k.fqn)  # a float, torch.save'd
    marker, evil = tmp_path / "pwned", tmp_path / "evil.pt"
    torch.save(CreatesAFile(marker), evil)
    shard = ckpt / info.relative_path
    data = shard.read_bytes()
    info.offset, info.length = len(data), evil.stat().st_size
    shard.write_bytes(data + evil.read_bytes())
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    rewrite_sums(ckpt)
    with pytest.raises(CheckpointError, match="cannot read the sharded checkpoint"):
        sharded.load_sharded_checkpoint(ckpt, model, optimizer, collective=False)
    assert not marker.exists()


def test_every_shard_is_hashed_and_a_damaged_one_is_refused_everywhere(tmp_path, capsys):
    run = tmp_path / "run"
    tiny_sharded_checkpoint(run / "ckpt_000004")
    tiny_sharded_checkpoint(run / "ckpt_000005")
    ckpt = run / "ckpt_000005"
    listed = checkpoint.read_checksums(ckpt / checkpoint.SUMS)
    assert set(listed) == {".metadata", "meta.pt", "__0_0.distcp"}
    assert all(file_sha256(ckpt / n) == digest for n, digest in listed.items())
    shard = ckpt / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40  # one flipped bit in the middle of a weight: loads fine, silently wrong
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"ckpt_000005: damaged: its sha256 is"):
        load_checkpoint(ckpt)
    notes = []
    assert load_latest_checkpoint(run, consolidate=False, note=notes.append)[1] == run / "ckpt_000004"
    assert len(notes) == 1 and "skipping" in notes[0] and "damaged" in notes[0]
    assert checkpoint_command.main(["consolidate", str(ckpt), str(tmp_path / "one.pt")]) == 2
    assert "damaged" in one_line_error(capsys) and not (tmp_path / "one.pt").exists()
    with pytest.raises(CheckpointError, match="damaged"):
        loading.load_model(ckpt=str(ckpt))


def test_a_missing_or_truncated_shard_is_skipped_with_a_note_and_named(tmp_path):
    for step in (3, 4, 5):
        tiny_sharded_checkpoint(tmp_path / f"ckpt_{step:06d}")
    (tmp_path / "ckpt_000005" / "__0_0.distcp").unlink()  # a copy that stopped half-way
    shard = tmp_path / "ckpt_000004" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])
    notes = []
    assert load_latest_checkpoint(tmp_path, consolidate=False, note=notes.append)[1] == tmp_path / "ckpt_000003"
    assert "shard __0_0.distcp is missing" in notes[0]
    assert "shard __0_0.distcp has" in notes[1] and "its index needs" in notes[1]
    with pytest.raises(CheckpointError, match="incomplete sharded checkpoint: shard __0_0.distcp is missing"):
        load_checkpoint(tmp_path / "ckpt_000005")


def test_a_failure_inside_dcp_is_a_checkpoint_error(tmp_path, capsys):
    """DCP wraps every failure in CheckpointException, a BaseException that `except Exception` misses."""
    ckpt = tmp_path / "ckpt_000005"
    tiny_sharded_checkpoint(ckpt)
    shard = ckpt / "__0_0.distcp"
    shard.write_bytes(bytes(shard.stat().st_size))  # the right size, all zeros, and recorded so: only DCP can tell
    sums = ckpt / checkpoint.SUMS
    sums.write_text("".join(f"{file_sha256(ckpt / name)}  {name}\n" for name in checkpoint.read_checksums(sums)))
    with pytest.raises(CheckpointError, match=r"ckpt_000005: cannot read the sharded checkpoint \(rank 0: "):
        load_checkpoint(ckpt)
    assert checkpoint_command.main(["export", str(ckpt), str(tmp_path / "hf")]) == 2
    assert "cannot read the sharded checkpoint" in one_line_error(capsys)


def test_consolidate_refuses_non_finite_weights(tmp_path, capsys):
    model, optimizer = tiny_sharded_checkpoint(tmp_path / "ok")
    with torch.no_grad():
        model.transformer.wpe.weight[0, 0] = float("nan")
    meta = {k: v for k, v in load_checkpoint(tmp_path / "ok", consolidate=False).items() if k != "shards"}
    sharded.save_sharded_checkpoint(tmp_path / "ckpt_000005", meta, model, optimizer)
    assert checkpoint_command.main(["consolidate", str(tmp_path / "ckpt_000005"), str(tmp_path / "one.pt")]) == 2
    assert "NaN/inf" in one_line_error(capsys) and not (tmp_path / "one.pt").exists()


def test_sha256sums_lists_only_regular_files_inside_the_directory(tmp_path, deadline):
    """A SHA256SUMS line naming a file outside the directory ('../x', '/dev/zero'), a FIFO or a symlink inside it
    is refused, one CheckpointError, before anything is opened: nothing hangs, nothing outside is read."""
    run = tmp_path / "run"
    tiny_sharded_checkpoint(run / "ckpt_000004")
    tiny_sharded_checkpoint(run / "ckpt_000005")
    ckpt, sums = run / "ckpt_000005", run / "ckpt_000005" / checkpoint.SUMS
    good = sums.read_text()
    outside = run / "x"  # ckpt_000005/../x
    outside.write_text("anything readable")
    os.mkfifo(ckpt / "fifo")
    (ckpt / "link").symlink_to(outside)
    cases = {
        "../x": "names '../x', not a file of this directory",
        str(outside): f"names '{outside}', not a file of this directory",
        "/dev/zero": "names '/dev/zero', not a file of this directory",
        "fifo": r"cannot read fifo to verify it \(not a regular file",
        "link": r"cannot read link to verify it \(is a symlink",
    }
    with deadline(60):
        for name, message in cases.items():
            digest = file_sha256(outside) if name != "fifo" else "0" * 64
            sums.write_text(good + f"{digest}  {name}\n")  # '../x' and the link: the right sha256 of a real file
            with pytest.raises(CheckpointError, match=message):
                load_checkpoint(ckpt)
            notes = []
            assert load_latest_checkpoint(run, consolidate=False, note=notes.append)[1] == run / "ckpt_000004", name
            assert len(notes) == 1 and notes[0].startswith(f"skipping {ckpt}: ")
        sums.unlink()
        sums.symlink_to(tmp_path / "sums")  # SHA256SUMS itself a symlink out of the directory
        (tmp_path / "sums").write_text(good)
        with pytest.raises(CheckpointError, match=r"unreadable checksum file SHA256SUMS \(is a symlink"):
            load_checkpoint(ckpt)


def test_a_fifo_metadata_is_refused_unread_and_resume_skips_to_the_intact_checkpoint(tmp_path, deadline):
    """open() of a FIFO waits for a writer: every loader hung, and resume never reached the checkpoint before."""
    run = tmp_path / "run"
    tiny_sharded_checkpoint(run / "ckpt_000004")
    tiny_sharded_checkpoint(run / "ckpt_000005")
    ckpt = run / "ckpt_000005"
    (ckpt / ".metadata").unlink()
    os.mkfifo(ckpt / ".metadata")
    with deadline(30):
        with pytest.raises(CheckpointError, match=r"cannot read .metadata \(not a regular file"):
            load_checkpoint(ckpt)
        notes = []
        assert load_latest_checkpoint(run, consolidate=False, note=notes.append)[1] == run / "ckpt_000004"
        assert len(notes) == 1 and notes[0].startswith(f"skipping {ckpt}: ")


@pytest.mark.parametrize("dst", ["meta.pt", "one.pt", "."])
def test_consolidate_refuses_to_write_inside_its_source(tmp_path, capsys, dst):
    """SRC/meta.pt as DST would overwrite the source's own meta.pt and leave that checkpoint damaged."""
    ckpt = tmp_path / "ckpt_000005"
    tiny_sharded_checkpoint(ckpt)
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    assert checkpoint_command.main(["consolidate", str(ckpt), str(ckpt / dst)]) == 2
    assert f"inside the checkpoint {ckpt} it is made from" in one_line_error(capsys)
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before
    assert load_checkpoint(ckpt)["step"] == 5
