"""Mixtures of prepared datasets (data_dir "a:0.75,b:0.25", mixture.Mixture, issue 39): rows drawn in proportion to the
weights, each source with its own position and epochs, exact resume and world-size invariance with both packings, a
resume with other weights, one tokenizer for all sources, and each source validated alone beside the mixture."""

import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import prepare_data
import train
from conftest import data_cfg, in_file_order
from gpt2train.config import ConfigError, make_config, parse_args, read_config_file
from gpt2train.data import DataLoader, Loader, open_mixture
from gpt2train.mixture import parse_mixture
from gpt2train.shards import write_shard
from worlds import Scenario, world

ROOT = Path(__file__).resolve().parent.parent
T = 16
WORDS = ["the", "quick", "fox", "naïve", "café", "roof", "日本語", "42", "world", "hello", "upon", "a", "time", "\n"]
TINY = [
    "--n_layer=1",
    "--n_head=2",
    "--n_embd=16",
    f"--block_size={T}",
    "--batch_size=8",
    "--warmup_steps=2",
    "--learning_rate=3e-3",
    "--eval_interval=0",
    "--log_interval=0",
    "--sample_interval=0",
    "--device=cpu",
    "--dtype=float32",
    "--compile=False",
]


def documents(n, seed):
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30))) for _ in range(n)]


def prepare(directory, docs, tokenizer):
    """A prepared dataset in `directory` (prepare_data.py, with `tokenizer`): ~300 val tokens, the rest train."""
    src = directory.parent / f"{directory.name}.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    args = ["--input", src, "--out_dir", directory, "--val_tokens", 300, "--num_proc", 1, "--no_progress"]
    prepare_data.main([*map(str, args), "--tokenizer", str(tokenizer)])
    return directory


@pytest.fixture(scope="module")
def sources(tmp_path_factory, byte_level_tokenizer_json):
    """Two datasets prepared with one small own tokenizer: `big` (~900 rows of T+1 tokens) and `small` (~200)."""
    root = tmp_path_factory.mktemp("sources")
    return (
        prepare(root / "big", documents(300, seed=1), byte_level_tokenizer_json),
        prepare(root / "small", documents(70, seed=2), byte_level_tokenizer_json),
    )


def metrics(out_dir):
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------- data_dir names a mixture


def test_a_mixture_is_path_weight_pairs_on_the_command_line_or_a_dict_in_a_config_file(tmp_path):
    config = tmp_path / "mix.py"
    config.write_text('data_dir = {"data/x/fw": 3, "data/y/fw": 1, "data/code_*": 0}\n')
    from_file = make_config(read_config_file(config)).data_dir
    from_cli = make_config(parse_args(["--data_dir=data/x/fw:3,data/y/fw:1,data/code_*:0"])).data_dir
    expected = {"fw": ("data/x/fw", 0.75), "fw_2": ("data/y/fw", 0.25), "code_": ("data/code_*", 0.0)}
    assert parse_mixture(from_file) == parse_mixture(from_cli) == expected  # names unique, weights sum to 1
    for one in ("data/shakespeare", "data/fw/fineweb_*", "C:/data"):  # a directory or a glob, as before
        assert parse_mixture(make_config({"data_dir": one}).data_dir) is None
    for bad, message in [
        ("a:0.5,b", "data_dir 'a:0.5,b': 'b' is not path:weight"),
        ("a:-1,b:1", "the weight of a must be a number >= 0; got '-1'"),
        ("a:0,b:0", "at least one source needs a weight > 0"),
        ("a:1,a:2", "a is named twice"),
    ]:
        with pytest.raises(ConfigError, match=f"^config key 'data_dir': .*{message}"):
            make_config({"data_dir": bad})


def test_a_malformed_mixture_is_one_line_and_exit_2_through_train_main(sources, tmp_path, capsys):
    """Audit 6's MX2, MX4, MX8, MX9, MX17: the run's start reads the mixture's manifests before the config is
    validated; each malformed spec is still one line and exit 2, nothing trained."""
    a, b = sources
    for spec, message in [
        (f"{a}:-1,{b}:1", f"the weight of {a} must be a number >= 0; got '-1'"),
        (f"{a}:0,{b}:0", "at least one source needs a weight > 0"),
        (f"{a}:1,,{b}:1", "'' is not path:weight"),
        (f"{a}:0.5,{a}:0.5", f"{a} is named twice"),
        (f"{a}:0.5,{a}/:0.5", f"{a}/ and {a} are one directory, named twice"),
    ]:
        out = tmp_path / "out"
        with pytest.raises(SystemExit) as e:
            train.main([*TINY, f"--data_dir={spec}", f"--out_dir={out}", "--max_steps=2"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and message in err, (spec, err)
        assert err.startswith("train.py: error: config key 'data_dir': ") and not out.exists(), err


def test_a_directory_whose_name_holds_a_colon_or_a_comma_is_that_one_directory(tmp_path):
    numbered_source(tmp_path / "run", 0)  # the sibling that `run:1` read as a mixture would train on
    for name in ("run:1", "2026-11-28T10:30", "a:1,b:1"):
        directory = numbered_source(tmp_path / name, 5000)
        assert parse_mixture(str(directory)) is None and make_config({"data_dir": str(directory)})
        assert in_file_order(DataLoader(data_cfg(directory, 2, T), "train")).next_batch()[0][0, 0] == 5000
    numbered_source(tmp_path / "x:2", 0)
    assert parse_mixture(f"{tmp_path}/x:2/n_*") is None  # a glob that matches shards, as written
    assert parse_mixture(f"{tmp_path}/run:1:1") == {"run:1": (f"{tmp_path}/run:1", 1.0)}  # a mixture of it


def test_one_directory_named_twice_in_two_spellings_is_one_line(tmp_path):
    a = numbered_source(tmp_path / "a", 0)
    (tmp_path / "link").symlink_to(a)
    for other in (f"{a}/", f"{tmp_path}/./a", f"{tmp_path}/link"):
        with pytest.raises(ConfigError, match=re.escape(f"data_dir: {other} and {a} are one directory, named twice")):
            make_config({"data_dir": f"{a}:0.5,{other}:0.5"})


def test_weights_too_large_to_add_up_are_scaled_before_they_are_summed():
    assert parse_mixture("a:1e308,b:1e308,c:0") == {"a": ("a", 0.5), "b": ("b", 0.5), "c": ("c", 0.0)}
    assert parse_mixture({"a": 1.5e308, "b": 0.5e308}) == {"a": ("a", 0.75), "b": ("b", 0.25)}


def test_a_missing_source_of_a_mixture_is_named_alone_in_the_advice(sources, tmp_path, capsys):
    for missing in (tmp_path / "nope", sources[0] / "zzz_*"):
        with pytest.raises(SystemExit):
            train.main([*TINY, f"--data_dir={missing}:0.5,{sources[1]}:0.5", f"--out_dir={tmp_path / 'out'}"])
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{missing}: no " in err, err
        assert f"--out_dir {missing if missing.name == 'nope' else sources[0]}` (conversations" in err, err


# ----------------------------------------------------------------------------- what is drawn, and from where


def test_a_075_025_mixture_trains_each_source_its_share_over_the_first_epoch_of_the_smaller(sources, tmp_path, capsys):
    big, small = sources
    rows = DataLoader(data_cfg(small, 1, T), "train").num_samples
    steps = math.ceil(rows / 0.25 / 32) + 2  # 32 rows a step: past the end of small's first epoch
    out = tmp_path / "out"
    args = [f"--data_dir={big}:0.75,{small}:0.25", f"--out_dir={out}", f"--max_steps={steps}", "--batch_size=32"]
    assert train.main([*TINY, *args]) == 0
    train_records = [m for m in metrics(out) if "train_loss" in m]
    assert all(m["tokens/big"] + m["tokens/small"] == m["step"] * 32 * T for m in train_records)
    end = next(m for m in train_records if m["tokens/small"] >= rows * T)  # small's first epoch is done
    total = end["tokens/big"] + end["tokens/small"]
    assert (
        abs(end["tokens/big"] / total - 0.75) <= 0.01 * 0.75 and abs(end["tokens/small"] / total - 0.25) <= 0.01 * 0.25
    )
    err = capsys.readouterr().err
    assert err.count(f"data: small ran out after {rows:,} rows: its epoch 2 starts") == 1, err
    assert "data: big ran out" not in err
    summary = json.loads((out / "summary.json").read_text())
    assert (
        summary["tokens/big"] == train_records[-1]["tokens/big"]
        and summary["tokens"] == total + (steps - end["step"]) * 32 * T
    )


def test_both_loaders_are_a_loader_and_name_their_sources(sources):
    """DataLoader and Mixture meet data.Loader, what the step, the evaluator, the checkpoint and train.py call."""
    one = DataLoader(data_cfg(sources[0], 2, T), "val")
    mixed = open_mixture(data_cfg(f"{sources[0]}:0.75,{sources[1]}:0.25", 2, T), "val")
    assert isinstance(one, Loader) and isinstance(mixed, Loader)
    assert one.sources() == {None: (one, 1.0)} and one.tokens() == {}
    assert [(n, w) for n, (_, w) in mixed.sources().items()] == [
        (Path(sources[0]).name, 0.75),
        (Path(sources[1]).name, 0.25),
    ]
    assert [loader for loader, _ in mixed.sources().values()] == list(mixed.loaders.values())


def mixture_rows(spec, world_size, batch, steps, packing, state=None):
    """(every rank's (x, y) rows of `steps` micro-steps in global order, rank 0's loader)."""
    loaders = [
        open_mixture(data_cfg(spec, batch, T, seed=5, packing=packing), "train", r, world_size)
        for r in range(world_size)
    ]
    for loader in loaders:
        if state is not None:
            loader.load_state_dict(state)
    out = []
    for _ in range(steps):
        for loader in loaders:
            x, y = loader.next_batch()
            out += [tuple(row) for row in torch.cat([x, y], dim=1).tolist()]
    return out, loaders[0]


@pytest.mark.parametrize("packing", ["window", "document"])
def test_a_mixtures_rows_are_the_same_at_any_world_size_and_resume_exactly(sources, packing):
    spec = f"{sources[0]}:0.75,{sources[1]}:0.25"
    small_rows = DataLoader(data_cfg(sources[1], 1, T, packing=packing), "train").num_samples
    steps = math.ceil(small_rows / 0.25 / 8) + 3  # across small's epoch end
    one, loader = mixture_rows(spec, 1, 8, steps, packing)
    big_rows = DataLoader(data_cfg(sources[0], 1, T, packing=packing), "train").num_samples
    drawn = dict(zip(loader.loaders, loader.counts().tolist()))
    assert drawn["small"] // small_rows == 1 and drawn["big"] < big_rows  # small's second epoch, big's first
    assert mixture_rows(spec, 2, 4, steps, packing)[0] == one  # 2 ranks x 4 rows == 1 x 8, row for row
    assert mixture_rows(spec, 4, 2, steps, packing)[0] == one
    first, loader = mixture_rows(spec, 1, 8, steps // 2, packing)
    rest, _ = mixture_rows(spec, 1, 8, steps - steps // 2, packing, json.loads(json.dumps(loader.state_dict())))
    assert first + rest == one
    assert len(set(one)) > 0.9 * len(one)  # rows of both sources, not one row repeated


@pytest.mark.parametrize("packing", ["window", "document"])
def test_training_on_a_mixture_resumes_bit_exactly(sources, tmp_path, packing):
    args = [*TINY, f"--data_dir={sources[0]}:0.75,{sources[1]}:0.25", f"--packing={packing}", "--save_interval=4"]
    args += ["--eval_interval=4", "--eval_steps=1", "--lr_decay_steps=8"]
    assert train.main([*args, f"--out_dir={tmp_path / 'full'}", "--max_steps=8"]) == 0
    assert train.main([*args, f"--out_dir={tmp_path / 'split'}", "--max_steps=4"]) == 0
    assert train.main(["--init_from=resume", f"--out_dir={tmp_path / 'split'}", "--max_steps=8"]) == 0

    def logged(out):
        keys = ("train_loss", "trained_tokens", "tokens/big", "tokens/small")
        return {m["step"]: [m[k] for k in keys] for m in metrics(tmp_path / out) if "train_loss" in m}

    assert list(logged("split")) == list(range(1, 9)) and logged("split") == logged("full")
    val = [{k: v for k, v in m.items() if k.startswith("val")} for m in metrics(tmp_path / "full") if "val_loss" in m]
    assert val == [
        {k: v for k, v in m.items() if k.startswith("val")} for m in metrics(tmp_path / "split") if "val_loss" in m
    ]


def ddp_args(sources, packing):
    args = [*TINY, f"--data_dir={sources[0]}:0.75,{sources[1]}:0.25", f"--packing={packing}", "--dropout=0.0"]
    return [*args, "--batch_size=4", f"--total_batch_size={8 * T}", "--max_steps=4"]


@pytest.fixture(scope="module")
def ddp_runs(sources, tmp_path_factory):
    """Both packings' 2-rank DDP runs on the mixture, in one torchrun world (one start, not two): {packing: out_dir}."""
    root = tmp_path_factory.mktemp("mixture_ddp")
    runs = {p: Scenario([*ddp_args(sources, p), f"--out_dir={root / p}"]) for p in ("window", "document")}
    for s in world(list(runs.values()), root / "logs"):
        assert s.codes == [0, 0], s.stderr[-3000:]
    return {p: s.out_dir for p, s in runs.items()}


@pytest.mark.slow
@pytest.mark.parametrize("packing", ["window", "document"])
def test_ddp_two_processes_equal_one_process_on_a_mixture(sources, ddp_runs, tmp_path, packing):
    assert train.main([*ddp_args(sources, packing), f"--out_dir={tmp_path}"]) == 0  # 1 process x 2 accumulation steps

    def logged(out):
        keys = ("train_loss", "trained_tokens", "tokens/big", "tokens/small")
        return {m["step"]: [m[k] for k in keys] for m in metrics(out) if "train_loss" in m}

    ddp, single = logged(ddp_runs[packing]), logged(tmp_path)
    assert list(ddp) == [1, 2, 3, 4]
    for step, (loss, *counts) in single.items():
        assert abs(ddp[step][0] - loss) < 1e-5 and ddp[step][1:] == counts, (step, ddp[step], single[step])


def numbered_source(directory, first):
    """A source whose token at position p is first + p (window rows read in order name their place)."""
    directory.mkdir()
    write_shard(directory / "n_train_000000.bin", first + np.arange(T * 100 + 1))
    return directory


def test_a_resume_with_other_weights_continues_each_source_where_it_was(tmp_path, capsys):
    a, b = numbered_source(tmp_path / "a", 0), numbered_source(tmp_path / "b", 20000)

    def mixture(weights):
        return in_file_order(open_mixture(data_cfg({str(a): weights[0], str(b): weights[1]}, 8, T, seed=3), "train"))

    before = mixture((0.75, 0.25))
    for _ in range(5):
        before.next_batch()
    assert before.counts().tolist() == [30, 10]  # 3:1 in 40 rows
    after = mixture((0.5, 0.5))
    after.load_state_dict(json.loads(json.dumps(before.state_dict())))
    assert "data_dir's mixture changed since the checkpoint (a 0.75, b 0.25 -> a 0.5, b 0.5): each source " in (
        capsys.readouterr().err
    )
    starts = [row for _ in range(5) for row in after.next_batch()[0][:, 0].tolist()]
    assert sorted(s for s in starts if s < 20000) == [T * i for i in range(30, 50)]  # a goes on from row 30
    assert sorted(s - 20000 for s in starts if s >= 20000) == [T * i for i in range(10, 30)]  # b from row 10
    again = mixture((0.5, 0.5))  # a second resume with the new weights: the same stream, and no note
    again.load_state_dict(after.state_dict())
    assert capsys.readouterr().err == ""
    assert [after.next_batch()[0].tolist() for _ in range(3)] == [again.next_batch()[0].tolist() for _ in range(3)]
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"one data directory (to go on with this source alone, name it as a mixture of one: data_dir='{a}:1')"
        ),
    ):
        DataLoader(data_cfg(a, 8, T, seed=3), "train").load_state_dict(after.state_dict())


@pytest.mark.slow
def test_the_mixture_module_is_imported_only_when_data_dir_names_a_mixture(tmp_path):
    """A run on one dataset (its config, manifests, loader and steps) never imports gpt2train/mixture.py, so the
    feature costs it nothing; a run on a mixture does."""
    one, other = numbered_source(tmp_path / "one", 0), numbered_source(tmp_path / "other", 100)
    code = (  # in one fresh process: the run on one dataset first, then the run on a mixture
        "import sys, train\n"
        "for data_dir, out in zip(sys.argv[1:3], ('one', 'mix')):\n"
        f"    assert train.main([*sys.argv[3:], '--data_dir=' + data_dir, '--out_dir={tmp_path}/' + out]) == 0\n"
        "    print('gpt2train.mixture' in sys.modules)"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    data_dirs = [str(one), f"{one}:0.5,{other}:0.5"]
    result = subprocess.run(
        [sys.executable, "-c", code, *data_dirs, *TINY, "--max_steps=1"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert [line for line in result.stdout.splitlines() if line in ("False", "True")] == ["False", "True"]


def test_a_val_split_of_end_of_text_tokens_only_has_a_loss_but_no_bits_per_byte(tmp_path):
    eot, other = numbered_source(tmp_path / "eot", 0), numbered_source(tmp_path / "other", 100)
    write_shard(eot / "n_val_000000.bin", np.full(T * 20 + 1, 50256))  # targets that decode to 0 bytes
    write_shard(other / "n_val_000000.bin", 100 + np.arange(T * 20 + 1))
    for data_dir, out in ((eot, "one"), (f"{eot}:0.5,{other}:0.5", "mix")):
        args = [f"--data_dir={data_dir}", f"--out_dir={tmp_path / out}", "--max_steps=1", "--eval_interval=1"]
        assert train.main([*TINY, *args, "--eval_steps=1"]) == 0
    one = [m for m in metrics(tmp_path / "one") if "val_loss" in m]
    mix = [m for m in metrics(tmp_path / "mix") if "val_loss" in m]
    assert len(one) == len(mix) == 2 and not any("val_bpb" in m for m in one)
    assert all({"val_bpb", "val/eot_loss", "val/other_bpb"} <= set(m) and "val/eot_bpb" not in m for m in mix)


def test_sources_tokenized_with_two_tokenizers_are_one_line(sources, tmp_path, capsys):
    gpt2 = prepare(tmp_path / "gpt2", documents(40, seed=3), "gpt2")
    with pytest.raises(SystemExit) as exit_:
        train.main([*TINY, f"--data_dir={sources[0]}:0.5,{gpt2}:0.5", f"--out_dir={tmp_path / 'out'}"])
    err = capsys.readouterr().err
    assert exit_.value.code == 1 and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"data_dir: {sources[0]} was tokenized with sha256:" in err and f", {gpt2} with gpt2; the sources" in err


def test_each_source_is_validated_alone_beside_the_mixture(sources, tmp_path, capsys):
    out = tmp_path / "out"
    args = [f"--data_dir={sources[0]}:0.75,{sources[1]}:0.25", f"--out_dir={out}", "--max_steps=2"]
    assert train.main([*TINY, *args, "--eval_interval=2", "--eval_steps=2"]) == 0
    val = [m for m in metrics(out) if "val_loss" in m]
    assert [m["step"] for m in val] == [0, 2]
    for m in val:
        assert set(m) == {
            "step",
            "val_loss",
            "val_bpb",
            "val_bytes",  # both sources' (issue 58 item 8)
            *(f"val/{n}_{k}" for n in ("big", "small") for k in ("loss", "bpb")),
        }
        assert m["val_loss"] == pytest.approx(0.75 * m["val/big_loss"] + 0.25 * m["val/small_loss"])
        assert min(m["val/big_bpb"], m["val/small_bpb"]) < m["val_bpb"] < max(m["val/big_bpb"], m["val/small_bpb"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_val_bpb"] == val[-1]["val_bpb"] and summary["val/small_bpb"] == val[-1]["val/small_bpb"]
    printed = capsys.readouterr().out
    assert f"step 2: val loss {val[-1]['val_loss']:.4f} ({val[-1]['val_bpb']:.4f} bits/byte); big " in printed
    assert f"small: {summary['tokens/small']:,} tokens, val loss {val[-1]['val/small_loss']:.4f}" in printed


def test_the_sources_share_eval_steps(sources, tmp_path, monkeypatch):
    """A 4-source mixture validates eval_steps micro-batches in all, as one source does (not 4 x eval_steps): one per
    source, the rest by weight; each source's val loss is still logged."""
    from gpt2train.evaluation import shared_steps
    from model import GPT

    assert shared_steps(20, [1.0]) == [20] and shared_steps(20, [0.75, 0.25]) == [15, 5]
    assert shared_steps(20, [0.4, 0.3, 0.2, 0.1]) == [7, 6, 4, 3] and shared_steps(20, [0.5, 0.5, 0.0]) == [10, 9, 1]
    assert shared_steps(2, [0.25] * 4) == [1, 1, 1, 1]  # more sources than eval_steps: one each
    links = [tmp_path / name for name in "abcd"]  # four sources: two copies of each prepared dataset
    for link, target in zip(links, sources * 2):
        shutil.copytree(target, link)  # a copy: a link to it would be one directory named twice
    data_dir = ",".join(f"{link}:{w}" for link, w in zip(links, (0.4, 0.3, 0.2, 0.1)))
    forward, val_batches = GPT.forward, []

    def counted(self, *args, **kwargs):
        val_batches.extend([] if self.training else [1])
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(GPT, "forward", counted)
    out = tmp_path / "out"
    args = [f"--data_dir={data_dir}", f"--out_dir={out}", "--max_steps=2", "--eval_interval=2", "--eval_steps=8"]
    assert train.main([*TINY, *args]) == 0
    val = [m for m in metrics(out) if "val_loss" in m]
    assert len(val) == 2 and len(val_batches) == 2 * 8  # steps 0 and 2, 8 micro-batches (batch_size rows) each
    assert all({f"val/{n}_loss" for n in "abcd"} <= set(m) for m in val)
    assert val[-1]["val_loss"] == pytest.approx(
        sum(w * val[-1][f"val/{n}_loss"] for n, w in zip("abcd", (0.4, 0.3, 0.2, 0.1)))
    )
