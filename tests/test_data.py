"""prepare_data.py and the DataLoader (issue 4); the shard format is test_shards.py's, the manifests'
test_manifests.py's."""

import contextlib
import json
import os
import random
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

import prepare_data
from conftest import data_cfg, in_file_order
from gpt2train import documents
from gpt2train.assets import get_tokenizer
from gpt2train.data import DataLoader
from gpt2train.shards import ShardError, find_shards, write_shard

EOT = 50256


@pytest.fixture(scope="module")
def enc():
    return get_tokenizer()


def make_docs(n, seed=0):
    """Varied documents: plain words, unicode, digits and the literal text of the EOT token
    (which must be encoded as ordinary text, never as the separator)."""
    rng = random.Random(seed)
    words = ["the", "Shard", "token", "naïve", "café", "日本語", "42", "\n", "  ", "x" * 13, "<|endoftext|>", "ok."]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(1, 40))) for _ in range(n)]


def write_jsonl(path, docs, key="text"):
    path.write_text("".join(json.dumps({key: d}) + "\n" for d in docs), encoding="utf-8")
    return path


def run_prep(*args):
    return prepare_data.main([*map(str, args), "--no_progress"])


def shard_tokens(directory, name, split):
    return [np.fromfile(p, dtype="<u2", offset=1024) for p in sorted(directory.glob(f"{name}_{split}_*.bin"))]


def split_docs(tokens, enc):
    """Token stream -> decoded documents; asserts every document starts with EOT."""
    assert tokens[0] == EOT, "the stream must start with the EOT that precedes the first document"
    starts = np.flatnonzero(tokens == EOT)
    return [enc.decode(tokens[a + 1 : b].tolist()) for a, b in zip(starts, [*starts[1:], len(tokens)])]


# ---------------------------------------------------------------------------- prepare_data.py


def test_worker_encodes_like_encode_ordinary_with_eot_first(enc):
    docs = ["Hello world", "a <|endoftext|> b", "lone surrogate \ud800 here", "naïve café 日本語\n\n"]
    tokens, lengths = prepare_data.tokenize_batch(docs)
    expected = [t for d in docs for t in [EOT, *enc.encode_ordinary(d)]]
    assert tokens.dtype == np.uint16 and tokens.tolist() == expected
    assert lengths.tolist() == [len(enc.encode_ordinary(d)) + 1 for d in docs]


def test_round_trip_documents_shards_documents(tmp_path, enc):
    docs = make_docs(80)
    src = write_jsonl(tmp_path / "docs.jsonl", docs)
    out = tmp_path / "out"
    summary = run_prep("--input", src, "--out_dir", out, "--shard_tokens", 400, "--val_tokens", 300, "--num_proc", 1)

    (val,) = shard_tokens(out, "docs", "val")
    train = shard_tokens(out, "docs", "train")
    assert (out / "docs_val_000000.bin").exists() and (out / "docs_train_000000.bin").exists()
    assert len(train) >= 3 and all(len(t) == 400 for t in train[:-1]) and 0 < len(train[-1]) <= 400
    assert any(t[0] != EOT for t in train[1:]), "the test should cover a document split across shards"

    val_docs = split_docs(val, enc)
    assert val_docs == docs[: len(val_docs)]  # val holds whole documents, the first ones
    lengths = [len(enc.encode_ordinary(d)) + 1 for d in val_docs]
    assert sum(lengths) == len(val) >= 300 > sum(lengths[:-1])  # the fewest documents reaching --val_tokens
    assert split_docs(np.concatenate(train), enc) == docs[len(val_docs) :]  # concatenated shards restore them
    total = len(val) + sum(map(len, train))
    assert int((np.concatenate([val, *train]) == EOT).sum()) == len(docs)  # literal "<|endoftext|>" is text
    assert summary["documents"] == len(docs) and summary["tokens"] == total and summary["shards"] == 1 + len(train)


def test_txt_jsonl_parquet_directories_and_globs(tmp_path, enc):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = make_docs(9, seed=1)
    (tmp_path / "in" / "sub").mkdir(parents=True)
    (tmp_path / "in" / "a.txt").write_text(docs[0], encoding="utf-8")
    (tmp_path / "in" / "b.txt").write_text(docs[1], encoding="utf-8")
    (tmp_path / "in" / ".notes.md").write_text("hidden: not an input")
    (tmp_path / "in" / "sub" / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")  # binary: skipped
    write_jsonl(tmp_path / "in" / "sub" / "c.jsonl", docs[2:5], key="content")
    pq.write_table(pa.table({"content": docs[5:7], "id": [1, 2]}), tmp_path / "d.parquet")
    (tmp_path / "e1.txt").write_text(docs[7], encoding="utf-8")
    (tmp_path / "e2.txt").write_text(docs[8], encoding="utf-8")
    out = tmp_path / "out"
    run_prep(
        "--input",
        tmp_path / "in",
        tmp_path / "d.parquet",
        tmp_path / "e*.txt",
        "--text_key",
        "content",
        "--out_dir",
        out,
        "--name",
        "mix",
        "--val_tokens",
        len(enc.encode_ordinary(docs[0])) + 1,
        "--num_proc",
        1,
    )
    (val,) = shard_tokens(out, "mix", "val")
    stream = np.concatenate([val, *shard_tokens(out, "mix", "train")])
    assert split_docs(stream, enc) == docs
    assert split_docs(val, enc) == docs[:1]


def test_source_code_is_text_and_a_directory_is_its_visible_text_files(tmp_path, capsys, enc):
    """Issue 58 item 13: any UTF-8 file is one document whatever its extension (`--input lib/*.py`, a directory of
    code); under a directory, recursively and sorted, hidden files and folders are left out and binary files (a
    NUL byte, not UTF-8) skipped with a note naming them; a binary file named alone is one line naming it."""
    lib = tmp_path / "lib"
    (lib / "pkg" / "__pycache__").mkdir(parents=True)
    (lib / ".git").mkdir()
    code = {"lib/a.py": "def f(x):\n    return x + 1\n", "lib/pkg/b.py": "import os\n", "lib/README.md": "# lib\n"}
    for name, text in code.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    (lib / ".git" / "config").write_text("[core]\n")  # hidden: never read
    (lib / ".env").write_text("SECRET=1\n")
    (lib / "pkg" / "__pycache__" / "b.cpython-312.pyc").write_bytes(b"\r\r\r\n\0\0\0\0")  # UTF-8 but NUL bytes
    (lib / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))  # not UTF-8
    run_prep("--input", lib, "--out_dir", tmp_path / "dir", "--val_tokens", 5, "--num_proc", 1)
    out = tmp_path / "dir"
    stream = np.concatenate([*shard_tokens(out, "lib", "val"), *shard_tokens(out, "lib", "train")])
    assert split_docs(stream, enc) == [code["lib/README.md"], code["lib/a.py"], code["lib/pkg/b.py"]]
    err = capsys.readouterr().err
    pyc = lib / "pkg" / "__pycache__" / "b.cpython-312.pyc"
    assert f"skipped 2 binary file(s) (NUL bytes or not UTF-8): {lib / 'latin1.txt'}, {pyc}\n" in err
    run_prep("--input", f"{lib}/**/*.py", "--out_dir", tmp_path / "glob", "--val_tokens", 5, "--num_proc", 1)
    glob = tmp_path / "glob"
    stream = np.concatenate([*shard_tokens(glob, "data", "val"), *shard_tokens(glob, "data", "train")])
    assert split_docs(stream, enc) == [code["lib/a.py"], code["lib/pkg/b.py"]]
    for name, said in [
        ("pkg/__pycache__/b.cpython-312.pyc", "holds NUL bytes: a binary file, not text"),
        ("latin1.txt", "not UTF-8 text (byte 0xe9 at 3): a binary file?"),
    ]:
        with pytest.raises(SystemExit) as e:
            run_prep("--input", lib / name, "--out_dir", tmp_path / "bin", "--num_proc", 1)
        assert str(e.value.code) == f"prepare_data.py: error: {lib / name}: {said}"


def test_default_val_split_is_a_tenth_of_a_small_corpus_in_whole_documents(tmp_path, enc):
    docs = make_docs(200, seed=7)
    run_prep("--input", write_jsonl(tmp_path / "docs.jsonl", docs), "--out_dir", tmp_path / "out", "--num_proc", 1)
    (val,) = shard_tokens(tmp_path / "out", "docs", "val")
    (train,) = shard_tokens(tmp_path / "out", "docs", "train")
    lengths = [len(enc.encode_ordinary(d)) + 1 for d in docs]
    k = len(split_docs(val, enc))
    assert sum(lengths[:k]) == len(val) >= sum(lengths) / 10 > sum(lengths[: k - 1])  # the fewest reaching 10%
    assert split_docs(train, enc) == docs[k:]


def test_default_val_split_cuts_a_single_text_file_90_10(tmp_path, enc):
    text = "\n\n".join(make_docs(60, seed=8))  # one .txt file is one document
    (tmp_path / "corpus.txt").write_text(text, encoding="utf-8")
    summary = run_prep("--input", tmp_path / "corpus.txt", "--out_dir", tmp_path / "out", "--num_proc", 1)
    (val,) = shard_tokens(tmp_path / "out", "corpus", "val")
    (train,) = shard_tokens(tmp_path / "out", "corpus", "train")
    assert len(val) == round((len(enc.encode_ordinary(text)) + 1) / 10) == summary["val_tokens"]
    assert np.concatenate([val, train]).tolist() == [EOT, *enc.encode_ordinary(text)]


def test_a_run_interrupted_after_a_cut_val_split_resumes_mid_document(tmp_path, monkeypatch):
    (tmp_path / "corpus.txt").write_text("\n\n".join(make_docs(60, seed=9)), encoding="utf-8")
    args = ["--input", tmp_path / "corpus.txt", "--val_tokens", 50, "--shard_tokens", 300, "--num_proc", 1]
    run_prep(*args, "--out_dir", tmp_path / "clean")
    real_write = prepare_data.write_shard

    def crash_after_val(path, tokens):
        if "_train_" in path.name:
            raise KeyboardInterrupt
        real_write(path, tokens)

    monkeypatch.setattr(prepare_data, "write_shard", crash_after_val)
    with pytest.raises(SystemExit, match="^130$"):  # a Ctrl-C: one line, exit 130
        run_prep(*args, "--out_dir", tmp_path / "crashed")
    monkeypatch.setattr(prepare_data, "write_shard", real_write)
    run_prep(*args, "--out_dir", tmp_path / "crashed")
    names = sorted(p.name for p in (tmp_path / "clean").iterdir())
    assert len(shard_tokens(tmp_path / "clean", "corpus", "val")[0]) == 50 and len(names) >= 4
    assert names == sorted(p.name for p in (tmp_path / "crashed").iterdir())
    for name in names:
        assert (tmp_path / "clean" / name).read_bytes() == (tmp_path / "crashed" / name).read_bytes(), name


def test_shakespeare_preset_makes_one_document_per_speech(tmp_path, monkeypatch, enc):
    text = (
        "First Citizen:\nBefore we proceed,\nhear me.\n\nAll:\nSpeak, speak.\n\n\nFirst Citizen:\nYou are resolved.\n"
    )
    (tmp_path / "input.txt").write_text(text)
    monkeypatch.setattr(documents, "fetch_shakespeare", lambda: tmp_path / "input.txt")
    monkeypatch.chdir(tmp_path)
    first = "First Citizen:\nBefore we proceed,\nhear me."
    run_prep("--dataset", "shakespeare", "--val_tokens", len(enc.encode_ordinary(first)) + 1, "--num_proc", 1)
    out = tmp_path / "data" / "shakespeare"  # the default out_dir, where configs/ look for it
    (val,) = shard_tokens(out, "shakespeare", "val")
    (train,) = shard_tokens(out, "shakespeare", "train")
    assert split_docs(val, enc) == [first]
    assert split_docs(train, enc) == ["All:\nSpeak, speak.", "First Citizen:\nYou are resolved."]


def test_hugging_face_preset_streams_through_datasets(tmp_path, monkeypatch, enc):
    import datasets

    docs = make_docs(30, seed=2)
    calls = []

    def fake_load_dataset(path, name=None, split=None, revision=None, streaming=False):
        calls.append((path, name, split, revision, streaming))
        return ({"text": d, "id": i} for i, d in enumerate(docs))  # an IterableDataset is just iterable

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    out = tmp_path / "out"
    summary = run_prep(
        "--dataset", "fineweb-edu", "--out_dir", out, "--shard_tokens", 200, "--val_tokens", 100, "--num_proc", 1
    )
    assert calls == [("HuggingFaceFW/fineweb-edu", "sample-10BT", "train", None, True)]
    assert summary["name"] == "fineweb_edu"
    stream = np.concatenate([*shard_tokens(out, "fineweb_edu", "val"), *shard_tokens(out, "fineweb_edu", "train")])
    assert split_docs(stream, enc) == docs

    calls.clear()
    run_prep(
        "--dataset",
        "someone/corpus",
        "--dataset_config",
        "en",
        "--split",
        "validation",
        "--no-streaming",
        "--out_dir",
        tmp_path / "out2",
        "--val_tokens",
        100,
        "--num_proc",
        1,
    )
    assert calls == [("someone/corpus", "en", "validation", None, False)]
    assert (tmp_path / "out2" / "corpus_val_000000.bin").exists()


def test_multiprocess_spawn_writes_identical_shards(tmp_path):
    src = write_jsonl(tmp_path / "docs.jsonl", make_docs(120, seed=3))
    common = ["--input", src, "--shard_tokens", 700, "--val_tokens", 250, "--batch_chars", 300]
    run_prep(*common, "--out_dir", tmp_path / "one", "--num_proc", 1)
    run_prep(*common, "--out_dir", tmp_path / "two", "--num_proc", 2, "--start_method", "spawn")
    one = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert len(one) >= 4 and one == sorted(p.name for p in (tmp_path / "two").iterdir())
    for name in one:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name


def test_rerun_skips_finished_shards_and_resumes_after_damage(tmp_path, monkeypatch, capsys):
    src = write_jsonl(tmp_path / "docs.jsonl", make_docs(100, seed=4))
    out = tmp_path / "out"
    args = ["--input", src, "--out_dir", out, "--shard_tokens", 300, "--val_tokens", 200, "--num_proc", 1]
    first = run_prep(*args)
    reference = {p.name: p.read_bytes() for p in out.iterdir()}
    assert first["shards"] >= 5

    writes = []
    real_write = prepare_data.write_shard
    monkeypatch.setattr(
        prepare_data, "write_shard", lambda path, tokens: (writes.append(path.name), real_write(path, tokens))
    )
    capsys.readouterr()
    again = run_prep(*args)
    assert writes == [] and again["tokenized"] == 0 and again["tokens"] == first["tokens"]
    assert f"in {first['shards']} shards: already prepared -> " in capsys.readouterr().out  # not "0 tokens/s"

    # Damage train shard 2: shards before it are kept, it and the rest are rebuilt from its start.
    damaged = out / "docs_train_000002.bin"
    raw = bytearray(damaged.read_bytes())
    raw[-1] ^= 1
    damaged.write_bytes(bytes(raw))
    resumed = run_prep(*args)
    assert writes[0] == "docs_train_000002.bin" and "docs_train_000001.bin" not in writes
    assert 0 < resumed["tokenized"] < first["tokens"]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == reference


def test_interrupted_run_resumes_to_identical_output(tmp_path, monkeypatch):
    src = write_jsonl(tmp_path / "docs.jsonl", make_docs(100, seed=5))
    args = ["--input", src, "--shard_tokens", 250, "--val_tokens", 150, "--num_proc", 1]
    run_prep(*args, "--out_dir", tmp_path / "clean")

    real_write = prepare_data.write_shard
    count = []

    def crashing_write(path, tokens):
        if len(count) == 3:
            raise KeyboardInterrupt
        count.append(path)
        real_write(path, tokens)

    monkeypatch.setattr(prepare_data, "write_shard", crashing_write)
    with pytest.raises(SystemExit, match="^130$"):  # a Ctrl-C: one line, exit 130
        run_prep(*args, "--out_dir", tmp_path / "crashed")
    monkeypatch.setattr(prepare_data, "write_shard", real_write)
    resumed = run_prep(*args, "--out_dir", tmp_path / "crashed")
    assert 0 < resumed["tokenized"] < resumed["tokens"]
    names = sorted(p.name for p in (tmp_path / "clean").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "crashed").iterdir())
    for name in names:
        assert (tmp_path / "clean" / name).read_bytes() == (tmp_path / "crashed" / name).read_bytes(), name


def val_input_corpus(tmp_path):
    """(input file, val files, the val documents with text): a jsonl input, and a val split in a .txt and a .jsonl
    (with an empty line, which is no document) whose documents never occur in the input."""
    train = write_jsonl(tmp_path / "train.jsonl", make_docs(120, seed=11))
    val = ["held out: " + d for d in make_docs(25, seed=12)]
    (tmp_path / "val_a.txt").write_text(val[0], encoding="utf-8")
    write_jsonl(tmp_path / "val_b.jsonl", [val[1], "", *val[2:]])
    return train, [tmp_path / "val_a.txt", tmp_path / "val_b.jsonl"], val


def test_val_input_is_exactly_the_val_shard_and_the_input_exactly_the_train_shards(tmp_path, enc):
    """--val_input (a sorted corpus's held-out file): the val shard is its documents, tokenized as prep tokenizes
    (an EOT before each), whatever their size; the train shards hold every input document and none of them."""
    train, val_files, val = val_input_corpus(tmp_path)
    args = ["--input", train, "--val_input", *val_files, "--shard_tokens", 300, "--batch_chars", 400, "--num_proc", 1]
    s = run_prep(*args, "--out_dir", tmp_path / "out")
    (val_shard,) = shard_tokens(tmp_path / "out", "train", "val")
    assert val_shard.tolist() == [t for d in val for t in [EOT, *enc.encode_ordinary(d)]] and s["val_tokens"] > 0
    train_docs = split_docs(np.concatenate(shard_tokens(tmp_path / "out", "train", "train")), enc)
    assert train_docs == make_docs(120, seed=11) and not set(train_docs) & set(val)
    manifest = json.loads((tmp_path / "out" / "train_manifest.json").read_text())
    assert [f for f, *_ in manifest["settings"]["val_input"]["files"]] == [str(p.resolve()) for p in val_files]
    assert manifest["shards"][0]["end"] == [len(val), 0] and s["documents"] == len(val) + 120


def test_a_rerun_with_another_val_input_is_refused_and_the_same_one_is_already_prepared(tmp_path):
    train, val_files, _ = val_input_corpus(tmp_path)
    args = ["--input", train, "--out_dir", tmp_path / "out", "--num_proc", 1]
    run_prep(*args, "--val_input", *val_files)
    assert run_prep(*args, "--val_input", *val_files)["tokenized"] == 0  # verified, nothing to do
    for other in ([val_files[1]], [write_jsonl(tmp_path / "other.jsonl", ["another held-out text"])]):
        with pytest.raises(SystemExit, match="^prepare_data.py: error: .* from a different input or settings"):
            run_prep(*args, "--val_input", *other)
    with pytest.raises(SystemExit, match="from a different input or settings"):
        run_prep(*args)  # without --val_input: another split


@pytest.mark.parametrize("crash_at", [0, 2])  # the val shard's write, a train shard's
def test_an_interrupted_run_with_val_input_resumes_to_identical_output(tmp_path, monkeypatch, crash_at):
    train, val_files, _ = val_input_corpus(tmp_path)
    args = ["--input", train, "--val_input", *val_files, "--shard_tokens", 250, "--batch_chars", 400, "--num_proc", 1]
    run_prep(*args, "--out_dir", tmp_path / "clean")
    real_write, count = prepare_data.write_shard, []

    def crashing_write(path, tokens):
        if len(count) == crash_at:
            raise KeyboardInterrupt
        count.append(path)
        real_write(path, tokens)

    monkeypatch.setattr(prepare_data, "write_shard", crashing_write)
    with pytest.raises(SystemExit, match="^130$"):
        run_prep(*args, "--out_dir", tmp_path / "crashed")
    monkeypatch.setattr(prepare_data, "write_shard", real_write)
    resumed = run_prep(*args, "--out_dir", tmp_path / "crashed")
    assert (0 < resumed["tokenized"] < resumed["tokens"]) == (crash_at > 0)
    names = sorted(p.name for p in (tmp_path / "clean").iterdir())
    assert len(names) >= 5 and names == sorted(p.name for p in (tmp_path / "crashed").iterdir())
    for name in names:
        assert (tmp_path / "clean" / name).read_bytes() == (tmp_path / "crashed" / name).read_bytes(), name


def split_corpus(tmp_path):
    """Files named as a newcomer names them (train.jsonl, val.jsonl, test.jsonl) and their documents, each split's
    distinct from the others'."""
    docs = {"train": make_docs(120, seed=11)}
    docs["val"] = ["held out: " + d for d in make_docs(12, seed=12)]
    docs["test"] = ["tested: " + d for d in make_docs(9, seed=13)]
    return {split: write_jsonl(tmp_path / f"{split}.jsonl", d) for split, d in docs.items()}, docs


def test_a_test_split_is_its_own_shard_recorded_in_the_manifest_and_resumes(tmp_path, enc, monkeypatch):
    """Issue 56 item 5: --test_input writes <name>_test_000000.bin (exactly its documents) beside the val shard,
    recorded in the manifest as the val shard is; an input named train.jsonl (docs/data.md's example) gives shards
    that find_shards tells apart (issue 58 item 7). A run killed at the test shard's write resumes to the same files."""
    files, docs = split_corpus(tmp_path)
    args = ["--input", files["train"], "--val_input", files["val"], "--test_input", files["test"], "--num_proc", 1]
    s = run_prep(*args, "--shard_tokens", 400, "--out_dir", tmp_path / "out")
    out = tmp_path / "out"
    for split in ("val", "test"):
        assert [p.name for p in find_shards(out, split)] == [f"train_{split}_000000.bin"]
        assert split_docs(np.concatenate(shard_tokens(out, "train", split)), enc) == docs[split]
    assert split_docs(np.concatenate(shard_tokens(out, "train", "train")), enc) == docs["train"]
    assert all("_train_" in p.name[5:] for p in find_shards(out, "train"))  # train_train_*: not the val or test shard
    manifest = json.loads((out / "train_manifest.json").read_text())
    test = [r for r in manifest["shards"] if r["split"] == "test"]
    assert [r["file"] for r in test] == ["train_test_000000.bin"] and s["test_tokens"] == test[0]["tokens"] > 0
    assert [f for f, *_ in manifest["settings"]["test_input"]["files"]] == [str(files["test"].resolve())]
    assert DataLoader(data_cfg(out, 2, 8), "test").num_samples > 0
    assert run_prep(*args, "--shard_tokens", 400, "--out_dir", out)["tokenized"] == 0  # verified, nothing to do
    real_write = prepare_data.write_shard

    def crash_at_test(path, tokens):
        if "_test_" in Path(path).name:
            raise KeyboardInterrupt
        real_write(path, tokens)

    monkeypatch.setattr(prepare_data, "write_shard", crash_at_test)
    with pytest.raises(SystemExit, match="^130$"):
        run_prep(*args, "--shard_tokens", 400, "--out_dir", tmp_path / "crashed")
    monkeypatch.setattr(prepare_data, "write_shard", real_write)
    run_prep(*args, "--shard_tokens", 400, "--out_dir", tmp_path / "crashed")
    for path in out.iterdir():
        assert (tmp_path / "crashed" / path.name).read_bytes() == path.read_bytes(), path.name


@pytest.mark.parametrize("names", [("train", "val", "test"), ("val", "test", "train"), ("test", "train", "val")])
def test_inputs_named_train_val_test_prepare_data_that_trains_and_never_opens_its_test_shard(
    tmp_path, names, byte_level_tokenizer_json
):
    """Issue 58 item 7: docs/data.md's own example (`--input train.jsonl --val_input val.jsonl`) and its rotations
    give shards that train.py tells apart (train_val_000000.bin is val). Issue 56 item 5: a run that trains,
    evaluates at eval_interval and keeps its best checkpoint never opens the test shard (every file opened, watched
    by an audit hook)."""
    import sys

    import train

    _, docs = split_corpus(tmp_path)
    named = {
        role: write_jsonl(tmp_path / f"{name}.jsonl", docs[split])
        for role, name, split in zip(("input", "val", "test"), names, ("train", "val", "test"))
    }
    out = tmp_path / "data"
    flags = ["--input", named["input"], "--val_input", named["val"], "--test_input", named["test"], "--num_proc", 1]
    run_prep(*flags, "--out_dir", out, "--tokenizer", byte_level_tokenizer_json)
    assert (out / f"{names[0]}_test_000000.bin").is_file() and (out / f"{names[0]}_val_000000.bin").is_file()
    opened = []
    sys.addaudithook(lambda event, args: opened.append(str(args[0])) if event == "open" and WATCH else None)
    tiny = ["--n_layer=1", "--n_head=2", "--n_embd=16", "--block_size=16", "--batch_size=4", "--max_steps=4"]
    tiny += ["--eval_interval=2", "--eval_steps=all", "--save_interval=2", "--device=cpu", "--compile=False"]
    WATCH.append(True)
    try:
        assert train.main([*tiny, f"--data_dir={out}", f"--out_dir={tmp_path / 'run'}", "--sample_interval=0"]) == 0
    finally:
        WATCH.clear()
    assert any("_train_" in p for p in opened) and any(f"{names[0]}_val_000000" in p for p in opened)
    assert not [p for p in opened if "_test_" in Path(p).name]


WATCH = []  # an audit hook cannot be removed: it records only while this holds something


@pytest.mark.parametrize(
    "case, expected",
    [
        ("val is an input", "--val_input {train} is also an --input file; hold it out of --input"),
        ("test is an input", "--test_input {train} is also an --input file; hold it out of --input"),
        ("a copy of val", "--input {copy} holds 12 of the 12 documents of --val_input (a copy of it?)"),
        ("a copy of test", "--input {copy} holds 9 of the 9 documents of --test_input (a copy of it?)"),
        ("val documents in a larger file", "--input {copy} holds 3 of the 12 documents of --val_input"),
        ("test documents in val", "--val_input {val} holds 2 of the 11 documents of --test_input"),
    ],
)
@pytest.mark.parametrize("command", ["prepare_data.py", "tokenizer.py"])
def test_held_out_documents_also_in_the_input_are_one_line_and_exit_2(tmp_path, capsys, case, expected, command):
    """Audit 6's VI_dupcontent, VT_dupcontent (issue 58 item 6), issue 56 item 5: a held-out document that training
    would read too, by path or by content (a copy under another name), is refused before anything is written."""
    import tokenizer

    files, docs = split_corpus(tmp_path)
    copy = tmp_path / "copy.jsonl"
    inputs, val, test = [files["train"], copy], [files["val"]], [files["test"]]
    if case == "val is an input":
        inputs, val = [files["train"]], [files["train"]]
    elif case == "test is an input":
        inputs, test = [files["train"]], [files["train"]]
    elif case in ("a copy of val", "a copy of test"):
        copy.write_bytes(files[case.split()[-1]].read_bytes())
    elif case == "val documents in a larger file":
        write_jsonl(copy, ["new text", *docs["val"][4:7], "more new text"])
    else:
        inputs = [files["train"]]
        write_jsonl(files["test"], [*docs["test"][:9], docs["val"][0], docs["val"][5]])
    flags = [
        "--input",
        *inputs,
        "--val_input",
        *val,
        "--test_input",
        *test,
        "--out_dir" if command[0] == "p" else "--out",
    ]
    flags += [tmp_path / "out"] + (["--num_proc", 1, "--no_progress"] if command[0] == "p" else ["--vocab_size", 300])
    with pytest.raises(SystemExit) as e:
        (prepare_data if command[0] == "p" else tokenizer).main(list(map(str, flags)))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith(f"{command}: error: "), err
    assert expected.format(train=files["train"].resolve(), copy=copy, val=files["val"]) in err
    assert not (tmp_path / "out").exists() or command == "tokenizer.py"


@pytest.mark.parametrize(
    "case, expected",
    [
        ("with_val_tokens", "give --val_input or --val_tokens, not both"),
        ("no_match", "--val_input: no input files matched"),
        ("no_text", "--val_input {tmp}/empty.jsonl: no documents with text"),
        ("bad_json", "--val_input: {tmp}/bad.jsonl:1: not valid JSON"),
        ("no_train_text", "tokens of the input; add text to --input"),
    ],
)
def test_val_input_errors_are_one_line_naming_the_flag(tmp_path, case, expected):
    train, val_files, _ = val_input_corpus(tmp_path)
    val = {
        "with_val_tokens": [*val_files, "--val_tokens", 100],
        "no_match": [tmp_path / "missing.jsonl"],
        "no_text": [write_jsonl(tmp_path / "empty.jsonl", ["", ""])],
        "bad_json": [tmp_path / "bad.jsonl"],
        "no_train_text": val_files,
    }[case]
    (tmp_path / "bad.jsonl").write_text("{oops\n")
    if case == "no_train_text":
        write_jsonl(train, ["", ""])
    with pytest.raises(SystemExit) as e:
        run_prep("--input", train, "--val_input", *val, "--out_dir", tmp_path / "out", "--num_proc", 1)
    message = str(e.value.code)
    assert expected.format(tmp=tmp_path) in message and "\n" not in message and message.startswith("prepare_data.py")


@pytest.mark.parametrize(
    "case",
    [
        "no_match",
        "only_empty",
        "bad_utf8",
        "bad_json",
        "missing_key",
        "too_small",
        "different_input",
        "foreign_shards",
        "other_dataset",
    ],
)
def test_prepare_errors_are_one_clear_line(tmp_path, case):
    out = tmp_path / "out"
    src = write_jsonl(tmp_path / "docs.jsonl", make_docs(20))
    args = ["--input", src, "--out_dir", out, "--val_tokens", 10, "--num_proc", 1]
    expected = {
        "no_match": "no input files matched",
        "only_empty": "no documents with text",
        "bad_utf8": "bad.txt: not UTF-8 text (byte 0xe9 at 3): a binary file?",
        "bad_json": "bad.jsonl:2: not valid JSON",
        "missing_key": "docs.jsonl:1: no 'body' field",
        "too_small": "lower --val_tokens",
        "different_input": "from a different input",
        "foreign_shards": "but no docs_manifest.json",
        "other_dataset": "holds other token files (tiny_train_000000.bin, ...)",
    }[case]
    if case == "no_match":
        args[1] = tmp_path / "missing" / "*.jsonl"
    elif case == "only_empty":
        write_jsonl(src, ["", "", ""])
    elif case == "bad_utf8":
        (tmp_path / "bad.txt").write_bytes(b"caf\xe9 au lait")
        args[1] = tmp_path / "bad.txt"
    elif case == "bad_json":
        (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": oops}\n')
        args[1] = tmp_path / "bad.jsonl"
    elif case == "missing_key":
        args += ["--text_key", "body"]
    elif case == "too_small":
        args[5] = 10**6
    elif case == "different_input":
        run_prep(*args)
        write_jsonl(src, make_docs(25))
    elif case == "foreign_shards":
        write_shard(out / "docs_train_000000.bin", np.arange(10))
    elif case == "other_dataset":
        write_shard(out / "tiny_train_000000.bin", np.arange(10))
    with pytest.raises(SystemExit) as e:
        run_prep(*args)
    message = str(e.value.code)
    assert expected in message and "\n" not in message


def test_a_killed_preps_temporary_files_are_removed_by_the_next_run(tmp_path, capsys):
    """kill -9 during a shard write leaves files.atomic_write's full-size `.<file>.<pid>.tmp`; the next run on that
    directory (which holds its lock, so no other prep writes there) removes its own, and nobody else's."""
    src = write_jsonl(tmp_path / "docs.jsonl", make_docs(60, seed=6))
    args = ["--input", src, "--shard_tokens", 300, "--val_tokens", 200, "--num_proc", 1]
    run_prep(*args, "--out_dir", tmp_path / "clean")
    out = tmp_path / "out"
    out.mkdir()
    stale = [out / ".docs_train_000003.bin.999999.tmp", out / ".docs_manifest.json.999999.tmp"]
    stale[0].write_bytes(bytes(1024 + 2 * 300))
    stale[1].write_text("{")
    foreign = out / ".notes.txt.12.tmp"  # not a docs_* file: left alone
    foreign.write_text("x")
    capsys.readouterr()
    run_prep(*args, "--out_dir", out)
    assert "removed 2 temporary file(s) (0.0 MiB) of an interrupted run" in capsys.readouterr().out
    assert not any(p.exists() for p in stale) and foreign.exists()
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [p.name for p in (tmp_path / "clean").iterdir()] + [foreign.name]
    )


def test_unwritable_output_dir_fails_before_any_work(tmp_path, monkeypatch, read_only):
    src = write_jsonl(tmp_path / "docs.jsonl", make_docs(20))
    monkeypatch.setattr(prepare_data, "tokenize_batch", lambda *args: pytest.fail("tokenizing began"))
    read_only(tmp_path / "ro")
    with pytest.raises(SystemExit) as e:
        run_prep("--input", src, "--out_dir", tmp_path / "ro" / "out", "--num_proc", 1)
    assert str(e.value.code) == (
        f"prepare_data.py: error: cannot write to the output directory {tmp_path / 'ro' / 'out'} "
        f"({tmp_path / 'ro' / 'out'}: Permission denied)"
    )


def test_a_full_output_disk_names_the_file_that_could_not_be_written(tmp_path, monkeypatch):
    import errno
    import os

    src = write_jsonl(tmp_path / "docs.jsonl", make_docs(20))
    monkeypatch.setattr(prepare_data, "tokenize_batch", lambda *args: pytest.fail("tokenizing began"))

    def full(fd, data):  # the lock's record: the first write
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(SystemExit) as e:
        run_prep("--input", src, "--out_dir", tmp_path / "out", "--num_proc", 1)
    monkeypatch.undo()
    assert str(e.value.code) == (
        f"prepare_data.py: error: cannot write to the output directory {tmp_path / 'out'} "
        f"({tmp_path / 'out' / '.lock'}: no space left on the device; free some disk space)"
    )


def test_a_second_prep_on_the_same_output_dir_is_refused(tmp_path, monkeypatch):
    from gpt2train.files import directory_lock

    src = write_jsonl(tmp_path / "docs.jsonl", make_docs(20))
    monkeypatch.setattr(prepare_data, "tokenize_batch", lambda *args: pytest.fail("tokenizing began"))
    with directory_lock(tmp_path / "out", "prepare_data.py"):
        with pytest.raises(SystemExit) as e:
            run_prep("--input", src, "--out_dir", tmp_path / "out", "--num_proc", 1)
    message = str(e.value.code)
    assert f"{tmp_path / 'out'} is in use by prepare_data.py (pid " in message and "\n" not in message


# ---------------------------------------------------------------------------- DataLoader

T = 8
SHARD_LENGTHS = [41, 33, 57]  # 5 + 4 + 7 = 16 samples of T+1 tokens at stride T


@pytest.fixture
def numbered(tmp_path):
    """Shards whose token at position p of shard i is 10000*i + p, so a window's first token names it."""
    for i, n in enumerate(SHARD_LENGTHS):
        write_shard(tmp_path / f"num_train_{i:06d}.bin", 10000 * i + np.arange(n))
        write_shard(tmp_path / f"num_val_{i:06d}.bin", 10000 * i + np.arange(n))
    return tmp_path


ALL_SAMPLES = sorted(10000 * i + T * j for i, n in enumerate(SHARD_LENGTHS) for j in range((n - 1) // T))


def sample_ids(loader, steps):
    out = []
    for _ in range(steps):
        x, y = loader.next_batch()
        out += x[:, 0].tolist()
    return out


def test_batches_are_shifted_windows(numbered):
    loader = DataLoader(data_cfg(numbered, 3, T), "train")
    assert loader.num_samples == len(ALL_SAMPLES) == 16
    for _ in range(8):
        x, y = loader.next_batch()
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (3, T)
        assert torch.equal(x, x[:, :1] + torch.arange(T)) and torch.equal(y, x + 1)  # contiguous window, shifted by one
        assert all(s in ALL_SAMPLES for s in x[:, 0].tolist())


def test_two_ranks_cover_each_sample_of_an_epoch_exactly_once(numbered):
    ranks = [DataLoader(data_cfg(numbered, 2, T, seed=3), "train", r, 2) for r in range(2)]
    per_epoch = 16 // (2 * 2)
    epochs = []
    for _ in range(2):
        seen = [s for _ in range(per_epoch) for loader in ranks for s in sample_ids(loader, 1)]  # stream order
        assert sorted(seen) == ALL_SAMPLES  # every sample once, none twice
        epochs.append(seen)
    # Reshuffled each epoch: shard order and the order of samples inside a shard.
    in_shard_2 = [[s for s in seen if s >= 20000] for seen in epochs]
    assert sorted(in_shard_2[0]) == sorted(in_shard_2[1]) and in_shard_2[0] != in_shard_2[1]


def test_epoch_tail_continues_into_the_next_epoch(numbered):
    loader = DataLoader(data_cfg(numbered, 3, T, seed=7), "train")  # 16 samples, batches of 3
    stream = sample_ids(loader, 11)  # 33 samples: two epochs and one more
    assert sorted(stream[:16]) == ALL_SAMPLES and sorted(stream[16:32]) == ALL_SAMPLES
    assert loader.epoch == 2


@pytest.mark.parametrize("world_size, accum", [(2, 2), (4, 1)])
def test_world_size_times_accumulation_gives_the_same_global_batches(numbered, world_size, accum):
    def step_samples(world_size, accum, steps):
        loaders = [DataLoader(data_cfg(numbered, 3, T, seed=5), "train", r, world_size) for r in range(world_size)]
        return [
            sorted(s for _ in range(accum) for loader in loaders for s in sample_ids(loader, 1)) for _ in range(steps)
        ]

    # A global batch of 12 does not divide 16 samples, so steps straddle epochs too.
    assert step_samples(world_size, accum, 6) == step_samples(1, world_size * accum, 6)


def test_shuffle_is_deterministic_from_seed(numbered):
    def stream(seed):
        return sample_ids(DataLoader(data_cfg(numbered, 4, T, seed=seed), "train"), 8)

    assert stream(0) == stream(0)
    assert stream(0) != stream(1)
    assert stream(0)[:16] != ALL_SAMPLES  # actually shuffled


def test_resume_continues_the_exact_stream(numbered):
    loader = DataLoader(data_cfg(numbered, 3, T, seed=2), "train")
    sample_ids(loader, 4)
    state = json.loads(json.dumps(loader.state_dict()))  # plain python values
    rest = sample_ids(loader, 9)  # crosses an epoch boundary

    resumed = DataLoader(data_cfg(numbered, 3, T, seed=2), "train")
    resumed.load_state_dict(state)
    assert sample_ids(resumed, 9) == rest

    with pytest.raises(ValueError, match="seed is 2 in the saved state but 9 here"):
        DataLoader(data_cfg(numbered, 3, T, seed=9), "train").load_state_dict(state)


def test_val_loader_reads_fixed_batches_in_file_order(numbered):
    loader = DataLoader(data_cfg(numbered, 4, T, seed=123), "val")
    first = sample_ids(loader, 4)
    assert first == ALL_SAMPLES  # no shuffling for val, whatever the seed
    loader.reset()
    assert sample_ids(loader, 2) == first[:8]
    halves = [sample_ids(DataLoader(data_cfg(numbered, 2, T), "val", r, 2), 1) for r in range(2)]
    assert halves[0] + halves[1] == first[:4]  # ranks split each global batch


# ---------------------------------------------------------------------------- a shard that changes under the loader


@pytest.fixture
def prepped(tmp_path):
    """A finished prep: docs_val_000000.bin, docs_train_000000..7.bin and docs_manifest.json."""
    src = write_jsonl(tmp_path / "docs.jsonl", make_docs(60, seed=7))
    run_prep("--input", src, "--out_dir", tmp_path / "out", "--shard_tokens", 300, "--val_tokens", 200, "--num_proc", 1)
    return tmp_path / "out"


def poke(path, at, value):
    """Token `at` of an llm.c shard set to `value` in place: the same size, as an edit or bit rot leaves it."""
    with open(path, "r+b") as f:
        f.seek(1024 + 2 * at)
        f.write(struct.pack("<H", value))


def test_an_id_that_appears_after_the_start_check_is_a_shard_error_naming_the_position(prepped):
    loader = in_file_order(DataLoader(data_cfg(prepped, 4, 8, vocab_size=50304), "train"))
    poke(prepped / "docs_train_000000.bin", 13, 60000)  # the memory-mapped file changes under the run
    with pytest.raises(
        ShardError,
        match=r"docs_train_000000.bin: token id 60000 >= vocab_size 50304 at token 13: "
        r"the shard changed after the run checked it at start",
    ):
        loader.next_batch()


def test_a_shard_truncated_in_place_under_the_loader_is_a_shard_error_not_a_bus_error(prepped):
    """Audit 6's ST_shard: `cp`/`rsync --inplace` over a data directory in use truncates the memory-mapped shard;
    a read of its vanished pages would be SIGBUS. A shard replaced by a rename is left alone: the map reads the old
    file, whole."""
    loader = in_file_order(DataLoader(data_cfg(prepped, 4, 8, vocab_size=50304), "train"))
    first = loader.next_batch()
    replaced = prepped / "docs_train_000001.bin"
    write_shard(replaced, np.zeros(10, dtype=np.uint16))  # atomic_write: a new file renamed over the old one
    loader.reset()
    assert torch.equal(loader.next_batch()[0], first[0])
    os.truncate(prepped / "docs_train_000000.bin", 1024)
    with pytest.raises(
        ShardError,
        match=r"docs_train_000000.bin: 1,024 bytes, 1,624 when the run opened it: the shard changed under the run",
    ):
        loader.next_batch()


# ---------------------------------------------------------------------------- document rows (packing='document')


def make_documents(tmp_path, seed=0):
    """Shards of documents (each <|endoftext|> then distinct ids, so a token names its place), some longer than a
    row of T+1; the first shard opens with the tail of a document (no <|endoftext|>), as a prep's shards can.
    Returns {token: (shard, position)} for every non-EOT token."""
    rng, next_id, where = np.random.default_rng(seed), 1, {}
    for i in range(3):
        parts = [] if i else [np.arange(next_id, next_id + 5)]
        next_id += 0 if i else 5
        for _ in range(12):
            n = int(rng.choice([1, 3, 5, 8, 9, 10, 17, 30]))
            parts += [np.array([EOT]), np.arange(next_id, next_id + n)]
            next_id += n
        tokens = np.concatenate(parts)
        where.update({int(t): (i, p) for p, t in enumerate(tokens) if t != EOT})
        write_shard(tmp_path / f"doc_train_{i:06d}.bin", tokens)
        write_shard(tmp_path / f"doc_val_{i:06d}.bin", tokens)
    return where


def epoch_rows(loader):
    """(x, y) rows of one epoch, in stream order."""
    xs, ys = [], []
    for _ in range(-(-loader.num_samples // loader.B)):
        x, y = loader.next_batch()
        xs += x.tolist()
        ys += y.tolist()
    return xs[: loader.num_samples], ys[: loader.num_samples]


def test_document_rows_start_at_a_document_and_train_each_target_once(tmp_path):
    where = make_documents(tmp_path)
    loader = DataLoader(data_cfg(tmp_path, 3, T, seed=4, packing="document"), "train")
    assert loader.masked and loader.summary().startswith("3 shards, ") and "document rows" in loader.summary()
    shards = [np.asarray(s) for s in loader.shards]
    xs, ys = epoch_rows(loader)
    targets, inputs = [], []
    for x, y in zip(xs, ys):
        if x[0] != EOT:  # a row that continues a long document: at a piece border, or the shard's opening tail
            shard, p = where[x[0]]
            doc = max([q for q in range(p + 1) if shards[shard][q] == EOT], default=0)
            assert (p - doc) % T == 0, (x, p, doc)
        for t, (a, b) in enumerate(zip(x, y)):
            if b == -1:
                continue
            assert t + 1 == T or x[t + 1] == b  # y is x shifted by one
            if b == EOT:  # a document's end is trained only where the document really ends
                shard, p = where[a]
                assert shards[shard][p + 1] == EOT
            else:
                targets.append(b)
        inputs += [a for a in x if a != EOT]
    first = int(shards[0][0])  # the opening tail's first token has no context in its shard: never a target
    assert sorted(targets) == sorted(set(where) - {first})  # every target once, none twice
    assert len(inputs) == len(set(inputs))  # no token is an input twice in an epoch
    # padding is rare: the rows hold about the tokens there are
    assert loader.num_samples * (T + 1) < 1.25 * sum(len(s) for s in shards)


def test_document_rows_pack_best_fit_and_split_only_longer_documents():
    from gpt2train.data import document_items, pack_best_fit

    lengths = np.array([9, 2, 7, 4, 5, 3, 1, 6])
    row, rows = pack_best_fit(lengths, 9)
    assert rows == 5 and all(np.bincount(row, weights=lengths) <= 9)  # 37 tokens: 5 rows is the minimum
    tokens = np.array([EOT, 1, 2, EOT, *range(3, 23), EOT, 30])  # documents of 3, 21 and 2 tokens
    start, length, ends, left = document_items(tokens, 9, EOT, split_long=True)
    assert start.tolist() == [0, 3, 11, 19, 24] and length.tolist() == [3, 9, 9, 5, 2]  # pieces overlap by one
    assert ends.tolist() == [True, False, False, True, False] and not len(left[0])  # the last may go on
    start, length, ends, left = document_items(tokens, 9, EOT, split_long=False)
    assert start.tolist() == [0, 24] and left[0].tolist() == [3] and left[1].tolist() == [21]


def test_document_rows_are_the_same_global_rows_at_any_world_size_and_resume_exactly(tmp_path):
    make_documents(tmp_path, seed=1)

    def rows(world_size, batch, steps, state=None):
        loaders = [
            DataLoader(data_cfg(tmp_path, batch, T, seed=5, packing="document"), "train", r, world_size)
            for r in range(world_size)
        ]
        for loader in loaders:
            loader.load_state_dict(state) if state else None
        out = [tuple(map(tuple, loader.next_batch()[1].tolist())) for _ in range(steps) for loader in loaders]
        return [r for batch in out for r in batch], loaders[0].state_dict()

    one, _ = rows(1, 4, 6)
    two, _ = rows(2, 2, 6)
    assert one == two  # 2 ranks x 2 rows == 1 rank x 4 rows, row for row, across epoch ends
    first, state = rows(1, 4, 3)
    rest, _ = rows(1, 4, 3, json.loads(json.dumps(state)))
    assert first + rest == one
    with pytest.raises(ValueError, match="packing is 'document' in the saved state but 'window' here"):
        DataLoader(data_cfg(tmp_path, 4, T, seed=5), "train").load_state_dict(state)


def test_training_with_document_rows_resumes_bit_exactly(tmp_path):
    import train

    make_documents(tmp_path / "data")
    tiny = [
        "--n_layer=1",
        "--n_head=2",
        "--n_embd=16",
        f"--block_size={T}",
        "--batch_size=2",
        "--vocab_size=50304",
        f"--total_batch_size={4 * T}",
        "--warmup_steps=2",
        "--eval_interval=4",
        "--eval_steps=1",
        "--log_interval=0",
        "--save_interval=4",
        "--device=cpu",
        "--dtype=float32",
        "--compile=False",
        "--sample_interval=0",
        "--packing=document",
        "--lr_decay_steps=8",
        f"--data_dir={tmp_path / 'data'}",
    ]
    assert train.main([*tiny, f"--out_dir={tmp_path / 'full'}", "--max_steps=8"]) == 0
    assert train.main([*tiny, f"--out_dir={tmp_path / 'split'}", "--max_steps=4"]) == 0
    assert train.main(["--init_from=resume", f"--out_dir={tmp_path / 'split'}", "--max_steps=8"]) == 0

    def losses(out):
        lines = [json.loads(x) for x in (tmp_path / out / "metrics.jsonl").read_text().splitlines()]
        return {m["step"]: (m["train_loss"], m["trained_tokens"]) for m in lines if "train_loss" in m}

    assert list(losses("split")) == list(range(1, 9)) and losses("split") == losses("full")


@pytest.mark.slow
def test_ddp_two_processes_equal_one_process_with_accumulation_on_document_rows(tmp_path):
    """Document rows have padding (targets -1) in varying amounts: the step's loss is the mean over the trained
    tokens of both ranks, so 2 DDP ranks == 1 process x 2 micro-batches."""
    import os
    import subprocess
    import sys

    import train

    make_documents(tmp_path / "data")
    root = Path(__file__).resolve().parent.parent
    args = [
        "--n_layer=1",
        "--n_head=2",
        "--n_embd=16",
        f"--block_size={T}",
        "--batch_size=2",
        "--max_steps=4",
        f"--total_batch_size={4 * T}",
        "--warmup_steps=2",
        "--eval_interval=0",
        "--log_interval=0",
        "--device=cpu",
        "--dtype=float32",
        "--compile=False",
        "--sample_interval=0",
        "--dropout=0.0",
        "--packing=document",
        f"--data_dir={tmp_path / 'data'}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(root / "train.py"),
        *args,
        f"--out_dir={tmp_path / 'ddp'}",
    ]
    result = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert train.main([*args, f"--out_dir={tmp_path / 'single'}"]) == 0

    def losses(out):
        lines = [json.loads(x) for x in (tmp_path / out / "metrics.jsonl").read_text().splitlines()]
        return {m["step"]: (m["train_loss"], m["trained_tokens"]) for m in lines if "train_loss" in m}

    ddp, single = losses("ddp"), losses("single")
    assert list(ddp) == list(range(1, 5)) and len({n for _, n in single.values()}) > 1  # padding varies
    for step, (loss, trained) in single.items():
        assert abs(ddp[step][0] - loss) < 1e-5 and ddp[step][1] == trained, (step, ddp[step], single[step])


def test_document_rows_start_at_the_end_of_text_token_of_the_tokenizer_the_manifest_records(prepped):
    """A prep with another tokenizer (its manifest's "tokenizer" entry names its <|endoftext|> id): documents start
    there, not at GPT-2's 50256."""
    manifest = json.loads((prepped / "docs_manifest.json").read_text())
    gpt2 = DataLoader(data_cfg(prepped, 2, 8, packing="document"), "train")
    assert gpt2.doc_token == EOT
    other = int(np.asarray(gpt2.shards[0])[1])  # a token id that is not 50256, as if it were the separator
    (prepped / "docs_manifest.json").write_text(json.dumps({**manifest, "tokenizer": {"id": "x", "eot": other}}))
    loader = DataLoader(data_cfg(prepped, 2, 8, packing="document"), "train")
    assert loader.doc_token == other and loader.num_samples != gpt2.num_samples
    for tokens, rows in zip(loader.shards, loader.rows):
        separators = np.flatnonzero(np.asarray(tokens) == other)
        for p in rows.start.tolist():  # a segment starts at a separator, a piece border of a long document, or 0
            doc = separators[separators <= p].max(initial=0)
            assert p == doc or (p - doc) % 8 == 0, (p, doc)


def test_ctrl_c_while_tokenizing_stops_the_prep_at_once_with_one_line(tmp_path):
    """A terminal's Ctrl-C sends SIGINT to the whole foreground process group: the workers too. They used to print
    a KeyboardInterrupt traceback each and leave the main process waiting for their tasks forever."""
    import os
    import signal
    import subprocess
    import sys
    import time

    src = write_jsonl(tmp_path / "docs.jsonl", make_docs(2000, seed=8) * 100)  # ~30 MB: a minute of tokenizing
    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, str(root / "prepare_data.py"), "--input", str(src), "--out_dir", str(tmp_path / "out")]
    cmd += ["--num_proc", "2", "--shard_tokens", "100000", "--val_tokens", "1000", "--batch_chars", "20000"]
    # SIGINT at its default, as in a terminal's foreground job: a shell starts background jobs (`make test &`)
    # with SIGINT ignored, the child would inherit that, and Python installs no KeyboardInterrupt handler then
    prep = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        while not (tmp_path / "out" / "docs_train_000001.bin").exists():  # the workers are busy
            assert prep.poll() is None, prep.communicate()
            time.sleep(0.05)
        os.killpg(prep.pid, signal.SIGINT)  # the group, as a terminal does
        _, err = prep.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(prep.pid, signal.SIGKILL)
    assert prep.returncode == 130, err
    assert err == "prepare_data.py: error: interrupted; run the same command again to continue\n"
    for _ in range(100):  # the workers were terminated with the pool, not left behind
        try:
            os.killpg(prep.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail("a worker of the interrupted prep is still running")
