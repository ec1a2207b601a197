"""loading.py: a model from a checkpoint or pretrained weights, and the model flags the commands share."""

import argparse
import importlib
import json
import shutil

import pytest
import torch

from gpt2train.bpe import load_tokenizer
from gpt2train.checkpoint import FORMAT, checkpoint_path, save_checkpoint
from gpt2train.hf import save_pretrained
from gpt2train.loading import add_model_args, load_model, load_model_from_args
from model import GPT, GPTConfig
from test_checkpoint import TINY
from test_evaluate import docs_of
from test_hellaswag import EXAMPLES


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
    args = {**TINY, "vocab_size": 50304}  # GPT-2's ids, padded: what its tokenizer needs
    model = GPT(GPTConfig(**args))
    save_checkpoint(
        checkpoint_path(tmp_path, 3),
        {"format": FORMAT, "model": model.state_dict(), "model_args": args, "config": {}, "step": 3},
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


@pytest.mark.parametrize("command", ["sample", "hellaswag", "evaluate"])
def test_a_tokenizer_with_more_ids_than_the_model_is_one_line_in_every_command(
    byte_level_tokenizer_json, tmp_path, capsys, command
):
    """Issue 38 (Z): a model directory whose tokenizer.json is another model's; its ids past the embedding were an
    IndexError in sample.py and hellaswag.py, and evaluate.py's own check was raised outside its handler."""
    torch.manual_seed(0)
    save_pretrained(GPT(GPTConfig(block_size=64, vocab_size=64, n_layer=1, n_head=2, n_embd=16)), tmp_path / "hf")
    shutil.copy(byte_level_tokenizer_json, tmp_path / "hf" / "tokenizer.json")
    capsys.readouterr()  # save_pretrained's note
    rows = tmp_path / "rows.jsonl"
    args = {
        "sample": ["--prompt", "hello world", "--max_new_tokens", "2"],
        "hellaswag": ["--data", str(rows)],
        "evaluate": ["--tasks", "copa", "--data", str(rows)],
    }[command]
    rows.write_text("".join(json.dumps(r) + "\n" for r in (EXAMPLES if command == "hellaswag" else docs_of("copa"))))
    with pytest.raises(SystemExit) as info:
        importlib.import_module(command).main(["--init_from", str(tmp_path / "hf"), "--device", "cpu", *args])
    err = capsys.readouterr().err
    n_vocab = load_tokenizer(tmp_path / "hf").n_vocab
    assert info.value.code == 2 and err.count("\n") == 1, err
    assert f"its tokenizer has {n_vocab} ids, the model's vocabulary 64" in err and str(tmp_path / "hf") in err
