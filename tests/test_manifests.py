"""manifests.py: what a prep's manifest vouches for, and the loader trusts: each shard's max token (no scan, unless
the shard changed after the prep), only the shards it lists, whole and finished; its tokenizer entry checked key by
key; a manifest or tokenizer file that is not a regular file refused unread.

The data is test_data.py's finished prep (its `prepped` fixture).
"""

import contextlib
import json

import numpy as np
import pytest

from conftest import data_cfg
from gpt2train.data import DataLoader
from gpt2train.shards import ShardError, load_shard, write_shard
from test_data import EOT, make_docs, poke, prepped, run_prep, write_jsonl  # noqa: F401  (prepped is a fixture)


def test_manifest_records_each_shards_max_token_and_the_loader_trusts_it(tmp_path):
    src = write_jsonl(tmp_path / "docs.jsonl", make_docs(60, seed=7))
    out = tmp_path / "out"
    run_prep("--input", src, "--out_dir", out, "--shard_tokens", 300, "--val_tokens", 200, "--num_proc", 1)
    manifest_path = out / "docs_manifest.json"
    manifest = json.loads(manifest_path.read_text())
    for record in manifest["shards"]:
        assert record["max_token"] == int(load_shard(out / record["file"]).max())
    top = max(r["max_token"] for r in manifest["shards"])
    assert top == EOT  # every document starts with it
    DataLoader(data_cfg(out, 2, 8, vocab_size=top + 1), "train")
    with pytest.raises(ShardError, match=f"token id {EOT} >= vocab_size {EOT}"):
        DataLoader(data_cfg(out, 2, 8, vocab_size=EOT), "train")
    # the record is what is checked (no scan): a record claiming smaller ids lets vocab_size=EOT through
    for record in manifest["shards"]:
        record["max_token"] = 100
    manifest_path.write_text(json.dumps(manifest))
    DataLoader(data_cfg(out, 2, 8, vocab_size=EOT), "train")


def test_a_shard_changed_after_prep_is_scanned_not_trusted_to_its_record(prepped):
    import os

    shard = prepped / "docs_train_000003.bin"
    poke(shard, 123, 60000)
    later = (prepped / "docs_manifest.json").stat().st_mtime + 5
    os.utime(shard, (later, later))  # what any write does (set here: filesystem clocks can be coarse)
    with pytest.raises(ShardError, match=r"docs_train_000003.bin: token id 60000 >= vocab_size 50304 .*at token 123"):
        DataLoader(data_cfg(prepped, 2, 8, vocab_size=50304), "train")


@pytest.mark.parametrize(
    "case, expected",
    [
        ("missing", r"docs_train_000002.bin: listed in docs_manifest.json but is missing"),
        (
            "replaced",
            r"docs_train_000002.bin: listed in docs_manifest.json but has 1,604 bytes, the manifest records 1,624",
        ),
        ("foreign", r"docs_train_000099.bin: not in docs_manifest.json \(another prep's shard\?\)"),
        ("unfinished", r"docs_manifest.json: the prep that writes docs_\* did not finish"),
        ("locked", r"is being written by prepare_data.py \(pid"),
        ("unmanifested", r"other_train_000000.bin: in no prep manifest of .*, unlike its other train shards"),
        ("dangling symlink", r"docs_train_000002.bin: a symlink to .*gone.bin, which does not exist"),
    ],
)
def test_the_loader_trains_only_on_what_the_manifest_lists(prepped, case, expected):
    from gpt2train.files import directory_lock

    shard = prepped / "docs_train_000002.bin"
    manifest = json.loads((prepped / "docs_manifest.json").read_text())
    assert [r["tokens"] for r in manifest["shards"] if r["file"] == shard.name] == [300]
    lock = directory_lock(prepped, "prepare_data.py")
    if case == "missing":
        shard.unlink()
    elif case == "replaced":  # another prep run's shard under the same name
        write_shard(shard, np.arange(290))
    elif case == "foreign":
        write_shard(prepped / "docs_train_000099.bin", np.arange(300))
    elif case == "unfinished":
        manifest["complete"] = False
        (prepped / "docs_manifest.json").write_text(json.dumps(manifest))
    elif case == "unmanifested":  # another dataset's shard copied in: not silently mixed into this prep's
        write_shard(prepped / "other_train_000000.bin", np.arange(300))
    elif case == "dangling symlink":  # not silently skipped: the run would train on less than the directory shows
        shard.unlink()
        shard.symlink_to(prepped / "gone.bin")
    with lock if case == "locked" else contextlib.nullcontext():
        with pytest.raises(ShardError, match=expected):
            DataLoader(data_cfg(prepped, 2, 8, vocab_size=50304), "train")
    DataLoader(data_cfg(prepped, 2, 8), "val") if case in ("missing", "replaced", "foreign") else None
    if case == "unmanifested":  # a glob picks the prep's shards; the other dataset alone is shards without a manifest
        DataLoader(data_cfg(str(prepped / "docs_*"), 2, 8, vocab_size=50304), "train")
        DataLoader(data_cfg(str(prepped / "other_*"), 2, 8, vocab_size=50304), "train")


def edit_tokenizer_entry(prepped, **entry):
    """docs_manifest.json's "tokenizer" entry updated with `entry`; returns the manifest's path."""
    path = prepped / "docs_manifest.json"
    manifest = json.loads(path.read_text())
    manifest["tokenizer"].update(entry)
    path.write_text(json.dumps(manifest))
    return path


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"eot": "abc"}, "tokenizer.eot is 'abc', expected an integer from 0 to 65,535"),
        ({"eot": [1]}, "tokenizer.eot is [1], expected an integer from 0 to 65,535"),
        ({"n_vocab": "many"}, "tokenizer.n_vocab is 'many', expected an integer from 0 to 65,536"),
        ({"id": 5}, "tokenizer.id is 5, expected a string"),
        (
            {"file": "/dev/zero"},
            "tokenizer.file is '/dev/zero', expected the name of a file in the manifest's directory",
        ),
        (
            {"file": "../x.json"},
            "tokenizer.file is '../x.json', expected the name of a file in the manifest's directory",
        ),
    ],
)
def test_a_manifests_tokenizer_entry_is_checked_key_by_key(prepped, entry, message):
    """A manifest is a text file: a malformed entry is one ShardError naming it and the key, in every reader."""
    from gpt2train.manifests import data_tokenizer, read_manifests

    path = edit_tokenizer_entry(prepped, **entry)
    for read in (
        lambda: data_tokenizer(read_manifests(prepped)),
        lambda: DataLoader(data_cfg(prepped, 2, 8, packing="document"), "train"),
    ):
        with pytest.raises(ShardError) as e:
            read()
        assert str(e.value) == f"{path}: {message}; run prepare_data.py again"


def test_a_manifest_or_tokenizer_file_that_is_not_a_regular_file_is_refused_unread(prepped, deadline):
    """A FIFO would hang the run, /dev/zero fill its memory; a tokenizer file made to match its recorded id but not a
    tokenizer.json is named (the run's tokenizer error named the file the prep read it from)."""
    import hashlib
    import os

    from gpt2train.manifests import data_tokenizer, read_manifests

    tokenizer_file, broken = prepped / "docs_tokenizer.json", '{"model": '
    tokenizer_file.write_text(broken)
    digest = hashlib.sha256(broken.encode()).hexdigest()[:16]
    manifest = edit_tokenizer_entry(prepped, id=f"sha256:{digest}", file=tokenizer_file.name, source="/elsewhere")
    with deadline(30):
        with pytest.raises(ShardError, match=rf"^{tokenizer_file}: not a tokenizer.json \(JSONDecodeError: "):
            data_tokenizer(read_manifests(prepped))
        tokenizer_file.unlink()
        os.mkfifo(tokenizer_file)
        with pytest.raises(ShardError, match=r"docs_tokenizer.json: cannot read the tokenizer that docs_manifest.json"):
            data_tokenizer(read_manifests(prepped))
        tokenizer_file.unlink()
        tokenizer_file.symlink_to("/dev/zero")
        with pytest.raises(ShardError, match=r"names \(is a symlink, not a regular file\); run prepare_data.py again"):
            data_tokenizer(read_manifests(prepped))
        manifest.unlink()
        os.mkfifo(manifest)
        with pytest.raises(ShardError, match=r"docs_manifest.json: unreadable prep manifest \(not a regular file"):
            read_manifests(prepped)
