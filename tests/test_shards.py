"""shards.py: the token shard format (llm.c's header, written atomically), load_shard's checks (bad header, truncated,
an id beyond the vocabulary, nanoGPT's headerless .bin and .npy), and as a run meets them: an id beyond the
vocabulary found before step 1, missing, empty, short, truncated or damaged shards as one-line errors.

Runs use tests/tiny.py's tiny model on the Markov-chain data of conftest's data_dir.
"""

import struct

import numpy as np
import pytest
import torch

from conftest import data_cfg
from gpt2train.assets import EOT
from gpt2train.data import DataLoader
from gpt2train.shards import ShardError, find_shards, load_shard, write_shard
from tiny import expect_exit, markov_tokens, one_line_error, run

# ----------------------------------------------------------------------------- the format


def test_header_bytes_match_spec(tmp_path):
    tokens = [EOT, 15496, 995, 0, 65535]
    path = tmp_path / "s.bin"
    write_shard(path, np.array(tokens, dtype=np.int64))
    expected = struct.pack("<256i", 20240520, 1, len(tokens), *[0] * 253) + struct.pack(f"<{len(tokens)}H", *tokens)
    assert path.read_bytes() == expected
    assert list(path.parent.iterdir()) == [path]  # no temporary file left behind


def test_failed_write_keeps_the_old_shard(tmp_path):
    path = tmp_path / "s.bin"
    write_shard(path, np.array([1, 2, 3]))
    before = path.read_bytes()
    with pytest.raises(ValueError, match="65535"):
        write_shard(path, np.array([1, 70000]))
    assert path.read_bytes() == before and list(tmp_path.iterdir()) == [path]


# ----------------------------------------------------------------------------- load_shard


def llmc_bytes(tokens, magic=20240520, version=1, count=None):
    header = struct.pack("<256i", magic, version, len(tokens) if count is None else count, *[0] * 253)
    return header + np.asarray(tokens, dtype="<u2").tobytes()


@pytest.mark.parametrize(
    "content, expected",
    [
        (llmc_bytes(range(100), magic=20240521), "bad magic 20240521"),
        (llmc_bytes(range(100))[:-10], "truncated"),
        (llmc_bytes(range(100))[:500], "truncated"),
        (llmc_bytes(range(100), count=90), "corrupt"),
        (llmc_bytes(range(100), version=2), "version 2"),
        (llmc_bytes([]), "empty shard"),
        (b"", "empty shard"),
        (b"\x01\x02\x03", "odd size"),
    ],
)
def test_bad_shards_give_clear_errors(tmp_path, content, expected):
    path = tmp_path / "x_train_000000.bin"
    path.write_bytes(content)
    with pytest.raises(ShardError) as e:
        load_shard(path)
    assert expected in str(e.value) and str(path) in str(e.value)


def test_out_of_vocab_token_is_reported(tmp_path):
    path = tmp_path / "x_train_000000.bin"
    write_shard(path, [EOT, 10, 50257, 7] * 10)
    assert len(load_shard(path)) == 40  # no vocab given: not checked
    assert len(load_shard(path, vocab_size=50258)) == 40
    with pytest.raises(ShardError, match=r"token id 50257 >= vocab_size 50257 \(first bad id at token 2\)"):
        load_shard(path, vocab_size=50257)
    with pytest.raises(ShardError, match="x_train_000000.bin: token id 50257"):  # before the first batch
        DataLoader(data_cfg(tmp_path, 2, 4, vocab_size=50257), "train")


def test_shards_without_a_manifest_are_scanned_in_chunks_to_the_last_token(tmp_path):
    from gpt2train.shards import check_shards_vocab

    paths = [tmp_path / f"x_train_{i:06d}.bin" for i in range(2)]
    write_shard(paths[0], np.arange(5000) % 64)
    write_shard(paths[1], np.r_[np.arange(4999) % 64, 64])  # the very last token is out of range
    shards = [load_shard(p) for p in paths]
    check_shards_vocab(paths, shards, 65, chunk=999)
    with pytest.raises(
        ShardError, match=r"x_train_000001.bin: token id 64 >= vocab_size 64 \(first bad id at token 4,999\)"
    ):
        check_shards_vocab(paths, shards, 64, chunk=999)


def test_npy_must_be_uint16_and_missing_shards_are_named(tmp_path):
    np.save(tmp_path / "x_train_000000.npy", np.arange(10, dtype=np.int32))
    with pytest.raises(ShardError, match="x_train_000000.npy: .npy shard must be a 1-D uint16 array, got int32"):
        load_shard(tmp_path / "x_train_000000.npy")
    with pytest.raises(ShardError, match=f"{tmp_path}: no val shards"):
        find_shards(tmp_path, "val")
    with pytest.raises(ShardError, match="nowhere: no such data directory"):
        DataLoader(data_cfg(tmp_path / "nowhere", 1, 4), "train")


def test_headerless_bin_and_npy_load_to_the_same_tokens(tmp_path):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50257, size=5000).astype(np.uint16)
    for d in ("llmc", "raw", "npy"):
        (tmp_path / d).mkdir()
    write_shard(tmp_path / "llmc" / "fw_train_000000.bin", tokens)
    tokens.astype("<u2").tofile(tmp_path / "raw" / "train.bin")  # nanoGPT's prepare.py layout
    np.save(tmp_path / "npy" / "edufineweb_train_000000.npy", tokens)  # build-nanogpt's
    for path in (
        tmp_path / "llmc" / "fw_train_000000.bin",
        tmp_path / "raw" / "train.bin",
        tmp_path / "npy" / "edufineweb_train_000000.npy",
    ):
        loaded = load_shard(path, vocab_size=50257)
        assert loaded.dtype == np.uint16 and np.array_equal(loaded, tokens), path
    batches = []
    for d in ("llmc", "raw", "npy"):
        loader = DataLoader(data_cfg(tmp_path / d, 4, 32, seed=1), "train")
        batches.append([loader.next_batch() for _ in range(3)])
    for other in batches[1:]:
        for (x0, y0), (x1, y1) in zip(batches[0], other):
            assert torch.equal(x0, x1) and torch.equal(y0, y1)


# ----------------------------------------------------------------------------- in a run


def test_a_token_id_beyond_the_vocabulary_late_in_the_data_fails_before_step_1(tmp_path, capsys):
    for i in range(3):
        tokens = markov_tokens(5000, seed=10 + i)
        if i == 2:
            tokens[-3] = 64  # vocab_size is 64: the last shard's third-to-last token is out of range
        write_shard(tmp_path / f"d_train_{i:06d}.bin", tokens)
    write_shard(tmp_path / "d_val_000000.bin", markov_tokens(1000, seed=9))
    expect_exit(1, run, tmp_path, tmp_path / "out", "--max_steps=4")
    line = one_line_error(capsys)
    assert f"{tmp_path / 'd_train_000002.bin'}: token id 64 >= vocab_size 64 (first bad id at token 4,997)" in line
    assert not (tmp_path / "out" / "metrics.jsonl").exists()  # before the first step


def shard_problem(data_dir, tmp_path, case):
    """A data directory with one problem; returns (data_dir, extra args)."""
    bad = tmp_path / "bad"
    bad.mkdir()
    if case == "missing data_dir":
        return tmp_path / "fineweb-edu", []
    if case == "no shards":
        (bad / "notes.txt").write_text("not a shard")
        return bad, []
    write_shard(bad / "d_val_000000.bin", markov_tokens(100, seed=3))
    train = bad / "d_train_000000.bin"
    write_shard(train, markov_tokens(5000 if case == "val split shorter than a sample" else 100, seed=4))
    if case == "truncated shard":
        train.write_bytes(train.read_bytes()[:-10])
    elif case == "bad header":
        train.write_bytes((12345).to_bytes(4, "little") + train.read_bytes()[4:])
    return bad, ["--block_size=200", "--n_embd=32"] if "sample" in case or "block_size" in case else []


@pytest.mark.parametrize(
    "case, expected",
    [
        (
            "missing data_dir",
            "fineweb-edu: no such data directory; prepare it with "
            "`python prepare_data.py --dataset fineweb-edu --out_dir ",
        ),
        (
            "no shards",
            "no train shards (*.bin or *.npy files with 'train' in the name); prepare it with "
            "`python prepare_data.py --input YOUR_TEXT_FILES --out_dir ",
        ),
        (  # a hint with it (issue 38: the fix, not only the cause)
            "block_size longer than every shard",
            "the train shards hold 100 tokens; none has the block_size+1 = 201 tokens of one sample: "
            "prepare more text, or train with a smaller block_size",
        ),
        (
            "val split shorter than a sample",
            "the val shards hold 100 tokens; none has the block_size+1 = 201 tokens of one sample: "
            "prepare it again with a larger --val_tokens, or train with a smaller block_size",
        ),
        ("truncated shard", "d_train_000000.bin: truncated llm.c shard: header says 100 tokens"),
        ("bad header", "d_train_000000.bin: bad magic 12345 in the llm.c shard header"),
    ],
)
def test_data_problems_are_one_line_errors(data_dir, tmp_path, capsys, case, expected):
    bad, extra = shard_problem(data_dir, tmp_path, case)
    expect_exit(1, run, bad, tmp_path / "out", "--max_steps=4", *extra)
    assert expected in one_line_error(capsys)
