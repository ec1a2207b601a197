"""loading.py: a model from a checkpoint or pretrained weights, and the model flags the commands share."""

import argparse

import pytest
import torch

from gpt2train.checkpoint import FORMAT, checkpoint_path, save_checkpoint
from gpt2train.loading import add_model_args, load_model, load_model_from_args
from model import GPT, GPTConfig
from test_checkpoint import TINY


def test_load_model_from_checkpoint(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY))
    save_checkpoint(
        checkpoint_path(tmp_path, 3),
        {
            "format": FORMAT,
            "model": model.state_dict(),
            "model_args": TINY,
            "config": {"seed": 1},
            "step": 3,
            "val_loss": 2.5,
        },
    )
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
    save_checkpoint(
        checkpoint_path(tmp_path, 3),
        {"format": FORMAT, "model": model.state_dict(), "model_args": TINY, "config": {}, "step": 3},
    )
    loaded, enc, device, dtype = load_model_from_args(
        *model_flags("--ckpt", str(tmp_path), "--device", "cpu", "--dtype", "float32")
    )
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
