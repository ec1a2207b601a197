"""checkpoint.py: atomic writes, finding the newest complete checkpoint, one-line load errors, the scripts' model flags."""
import argparse
from pathlib import Path

import pytest
import torch

import checkpoint
from checkpoint import (FORMAT, CheckpointError, add_model_args, checkpoint_path, clean_state_dict,
                        latest_checkpoint, load_checkpoint, load_model, load_model_from_args, prune_checkpoints,
                        save_checkpoint)
from model import GPT, GPTConfig

TINY = dict(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=32)


def fake_ckpt(step, **extra):
    return {"format": FORMAT, "step": step, "model": {"w": torch.full((3,), float(step))},
            "rng": [{"python": [3, list(range(5)), None]}], **extra}


def test_roundtrip_loads_with_weights_only(tmp_path):
    path = checkpoint_path(tmp_path, 7)
    assert path.name == "ckpt_000007.pt"
    save_checkpoint(path, fake_ckpt(7, val_loss=None))
    ckpt = load_checkpoint(path)
    assert ckpt["step"] == 7 and torch.equal(ckpt["model"]["w"], torch.full((3,), 7.0))
    assert load_checkpoint(tmp_path)["step"] == 7  # a directory means its latest checkpoint
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt_000007.pt"]  # no temporary file left


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
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 2)
    assert load_checkpoint(tmp_path)["step"] == 2
    assert latest_checkpoint(tmp_path / "missing") is None


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
    with pytest.raises(CheckpointError, match="no complete"):
        load_checkpoint(tmp_path)


def test_crash_during_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    save_checkpoint(checkpoint_path(tmp_path, 1), fake_ckpt(1))

    def crash(obj, f):  # half a file reaches the disk, then the process "dies"
        f.write(b"PK\x03\x04 partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint.torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(checkpoint_path(tmp_path, 2), fake_ckpt(2))
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 1)
    assert load_checkpoint(tmp_path)["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt_000001.pt"]


def test_prune_keeps_last_n_and_the_best(tmp_path):
    for step in range(1, 6):
        save_checkpoint(checkpoint_path(tmp_path, step), fake_ckpt(step))
    prune_checkpoints(tmp_path, keep_last=2, keep_steps={1})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt_000001.pt", "ckpt_000004.pt", "ckpt_000005.pt"]
    prune_checkpoints(tmp_path, keep_last=0)  # 0 keeps everything
    assert len(list(tmp_path.iterdir())) == 3


def test_clean_state_dict_strips_ddp_and_compile_prefixes():
    sd = {"module._orig_mod.lm_head.weight": 1, "_orig_mod.transformer.wte.weight": 2, "transformer.x": 3}
    assert clean_state_dict(sd) == {"lm_head.weight": 1, "transformer.wte.weight": 2, "transformer.x": 3}


def test_load_model_from_checkpoint(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY))
    prefixed = {"_orig_mod." + k: v for k, v in model.state_dict().items()}
    save_checkpoint(checkpoint_path(tmp_path, 3), {
        "format": FORMAT, "model": prefixed, "model_args": TINY, "config": {"seed": 1}, "step": 3, "val_loss": 2.5})
    loaded, info = load_model(ckpt=str(tmp_path))
    assert not loaded.training and info["step"] == 3 and info["val_loss"] == 2.5
    for (k, a), (k2, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and torch.equal(a, b)
    with pytest.raises(ValueError):
        load_model()



def model_flags(*argv):
    parser = argparse.ArgumentParser(prog="tool.py")
    add_model_args(parser)
    return parser, parser.parse_args(list(argv))


def test_model_flags_load_the_model_tokenizer_device_and_dtype(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY))
    save_checkpoint(checkpoint_path(tmp_path, 3), {
        "format": FORMAT, "model": model.state_dict(), "model_args": TINY, "config": {}, "step": 3})
    loaded, enc, device, dtype = load_model_from_args(*model_flags("--ckpt", str(tmp_path), "--device", "cpu",
                                                                   "--dtype", "float32"))
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight) and not loaded.training
    assert (device, dtype, enc.name) == ("cpu", "float32", "gpt2")
    with pytest.raises(SystemExit):  # exactly one of --ckpt / --init_from
        model_flags("--device", "cpu")


@pytest.mark.parametrize("flag", ["--ckpt", "--init_from"])
def test_model_flags_bad_source_is_one_line_and_exit_2(tmp_path, capsys, flag):
    (tmp_path / "config.json").write_text("{not json")  # an HF directory with a broken config
    for source in (tmp_path / "missing", tmp_path):
        with pytest.raises(SystemExit) as info:
            load_model_from_args(*model_flags(flag, str(source), "--device", "cpu"))
        err = capsys.readouterr().err
        assert info.value.code == 2
        assert err.startswith("tool.py: error: ") and err.count("\n") == 1 and str(source) in err, err
