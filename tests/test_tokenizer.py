"""tokenizer.py: a byte-level BPE trained with the `tokenizers` library, written as a standard tokenizer.json that
round-trips any text and encodes exactly as transformers and the tokenizers library do (and as the tiktoken
translation prepare_data.py's workers use)."""

import json
import random

import pytest

import tokenizer
from gpt2train import assets, bpe, chat

pytest.importorskip("tokenizers")

CORPUS = [
    "Once upon a time there was a naïve café owner 😀 who said hello to the world.",
    "The quick brown fox jumps over the lazy dog; 日本語 and ünïcödé too. Numbers: 12345 and 3.14159.",
    "def add(a, b):\n    return a + b  # code, with indentation\n\n\n",
    "She said: \"I'll go, they'd stay, WE'VE been here\".\tTabs\t\tand   spaces   end.",
] * 30
TEXTS = [
    "",
    " ",
    "   leading and trailing   ",
    "\n\n\n",
    "\t \t\r\n",
    "naïve café 😀 日本語 ﬁ İı 𝔘𝔫𝔦",
    "<|endoftext|>",
    "a <|endoftext|> b <|user|>hi<|end|><|assistant|>",
    "x" * 500,
    "1234567890 3.14",
    "unknown bytes: \x00\x01\x7f \u200b\u00a0",
    "Ünïcödé ÀÉÎÕÜ ß Ω≈ç√ ¡¿ emoji 👩‍👩‍👧 flags 🇫🇷",
]


def random_text(rng, n=300):
    alphabet = "abcXYZ019 \n\t\r.,;'\"<|>_-" + "éüñ日本語😀𝔘" + "\u00a0\u2003\u200b"
    return "".join(rng.choice(alphabet) for _ in range(n))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """tokenizer.py's CLI on a small corpus: (the output directory, its report)."""
    src = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in CORPUS))
    out = tmp_path_factory.mktemp("tok") / "mine"
    tokenizer.main(
        ["--input", str(src), "--vocab_size", "400", "--out", str(out), "--held_out_bytes", "500", "--no_progress"]
    )
    return out, json.loads((out / "report.json").read_text())


def test_the_special_tokens_come_first_and_the_vocabulary_has_the_asked_size(trained):
    out, report = trained
    enc = bpe.open_tokenizer(out)
    assert enc.n_vocab == 400 == report["vocab_size"]
    assert enc.eot_token == 0
    assert [enc.special_id(t) for t in chat.SPECIAL] == [1, 2, 3, 4]
    assert report["bytes_per_token"] > 1 and report["gpt2_bytes_per_token"] > 1


@pytest.mark.parametrize("text", TEXTS)
def test_text_round_trips_and_special_token_strings_are_plain_text(trained, text):
    enc = bpe.open_tokenizer(trained[0])
    ids = enc.encode_ordinary(text)
    assert enc.decode(ids) == text
    assert not set(ids) & {0, 1, 2, 3, 4}  # '<|endoftext|>' typed in a document is text, not the separator
    assert list(enc.encode_to_numpy(text)) == ids  # prepare_data.py's path


def test_random_text_round_trips_and_the_fast_path_agrees(trained):
    enc, rng = bpe.open_tokenizer(trained[0]), random.Random(0)
    for _ in range(50):
        text = random_text(rng)
        ids = enc.encode_ordinary(text)
        assert enc.decode(ids) == text
        assert list(enc.encode_to_numpy(text)) == ids
    assert enc._fast, "a tokenizer.py tokenizer has an exact tiktoken translation"


def test_transformers_and_tokenizers_load_the_file_and_give_the_same_ids(trained):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    out = trained[0]
    enc = bpe.open_tokenizer(out)
    library = Tokenizer.from_file(str(out / "tokenizer.json"))
    fast = PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(out)
    rng = random.Random(1)
    for text in [t for t in TEXTS if "<|" not in t] + [random_text(rng).replace("<|", "<") for _ in range(20)]:
        ids = enc.encode_ordinary(text)
        assert library.encode(text, add_special_tokens=False).ids == ids
        assert fast.encode(text, add_special_tokens=False) == ids
        assert auto.encode(text, add_special_tokens=False) == ids
        assert auto.decode(ids) == text
    text = "a <|endoftext|> b <|user|>hi<|end|>"  # transformers reads special-token strings as the tokens
    assert auto.encode(text, add_special_tokens=False) == enc.encode(text, allowed_special="all")
    assert auto.eos_token == "<|endoftext|>" and auto.eos_token_id == 0


def test_a_vocabulary_beyond_uint16_is_a_one_line_error(tmp_path, capsys):
    src = tmp_path / "a.txt"
    src.write_text("hello world " * 100)
    with pytest.raises(SystemExit) as e:
        tokenizer.main(["--input", str(src), "--vocab_size", "65537", "--out", str(tmp_path / "t")])
    message = str(e.value.code)
    assert message.startswith("tokenizer.py: error:") and "\n" not in message and "uint16" in message
    assert not (tmp_path / "t").exists()
    tokenizer.main(
        [
            "--input",
            str(src),
            "--vocab_size",
            "300",
            "--out",
            str(tmp_path / "ok"),
            "--held_out_bytes",
            "10",
            "--no_progress",
        ]
    )  # 65,536 and below are fine: 300 here
    assert bpe.open_tokenizer(tmp_path / "ok").n_vocab <= 300


def test_training_is_deterministic(tmp_path):
    first = tokenizer.train(CORPUS, 350).to_str()
    assert tokenizer.train(CORPUS, 350).to_str() == first


def test_held_out_text_is_the_start_of_the_input_cut_at_a_character():
    held, rest = tokenizer.split_held_out(["ab", "cdé", "fg"], 4)
    assert held == "ab\ncd" and list(rest) == ["é", "fg"]
    held, rest = tokenizer.split_held_out(["ab"], 100)
    assert held == "ab" and list(rest) == []


def test_gpt2s_tokenizer_json_is_gpt2_and_translates_to_tiktoken_exactly():
    enc = bpe.HFTokenizer(json_text=bpe.gpt2_tokenizer_json(), name="gpt2.json")
    assert enc.id == "gpt2"
    text = " ".join(TEXTS) + random_text(random.Random(2), 2000)
    assert list(enc.encode_to_numpy(text)) == assets.get_tokenizer().encode_ordinary(text) == enc.encode_ordinary(text)
    assert enc._fast


def test_a_normalizing_tokenizer_takes_the_tokenizers_path(neox_tokenizer_json):
    enc = bpe.open_tokenizer(neox_tokenizer_json)
    text = "Cafe\u0301 caf\u00e9 <|endoftext|> 😀"
    assert list(enc.encode_to_numpy(text)) == enc.encode_ordinary(text)
    assert enc._fast is False  # NFC: no tiktoken translation


# ----------------------------------------------------------------------------- through the whole pipeline

TINY = [
    "--n_layer=1",
    "--n_head=2",
    "--n_embd=16",
    "--block_size=16",
    "--batch_size=2",
    "--warmup_steps=1",
    "--eval_interval=2",
    "--eval_steps=1",
    "--log_interval=0",
    "--save_interval=2",
    "--device=cpu",
    "--dtype=float32",
    "--compile=False",
    "--sample_interval=2",
    "--sample_tokens=4",
]


def prepare(tmp_path, tok, name):
    """prepare_data.py --tokenizer tok over CORPUS in two worker processes -> the data directory."""
    import prepare_data

    src = tmp_path / f"{name}.jsonl"
    src.write_text("".join(json.dumps({"text": f"{i}: {t}"}) + "\n" for i, t in enumerate(CORPUS)))
    out = tmp_path / f"data_{name}"
    prepare_data.main(
        [
            "--input",
            str(src),
            "--tokenizer",
            str(tok),
            "--out_dir",
            str(out),
            "--val_tokens",
            "100",
            "--num_proc",
            "2",
            "--batch_chars",
            "500",
            "--no_progress",
        ]
    )
    return out


@pytest.fixture(params=["trained", "neox"])
def tokenizer_file(request, trained, neox_tokenizer_json):
    return trained[0] / "tokenizer.json" if request.param == "trained" else neox_tokenizer_json


@pytest.mark.slow
def test_prep_train_sample_export_autotokenizer_with_its_own_tokenizer(tokenizer_file, tmp_path, capsys):
    import shutil

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import checkpoint as checkpoint_command
    import sample
    import train
    from gpt2train import loading, shards

    enc = bpe.open_tokenizer(tokenizer_file)
    data_dir = prepare(tmp_path, tokenizer_file, "corpus")
    manifest = json.loads((data_dir / "corpus_manifest.json").read_text())
    assert manifest["tokenizer"]["id"] == enc.id == manifest["settings"]["tokenizer"]
    val = shards.load_shard(data_dir / "corpus_val_000000.bin")  # <|endoftext|> (the tokenizer's) before each document
    first = [enc.eot_token, *enc.encode_ordinary(f"0: {CORPUS[0]}"), enc.eot_token]
    assert list(val[: len(first)]) == first

    assert train.main([*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'out'}", "--max_steps=2"]) == 0
    ckpt = torch.load(tmp_path / "out" / "ckpt_000002.pt", weights_only=True)
    assert ckpt["model_args"]["vocab_size"] == 448  # 400 ids padded to a multiple of 64, from the data
    assert ckpt["tokenizer"]["json"] == tokenizer_file.read_text() and ckpt["tokenizer"]["id"] == enc.id

    moved = tmp_path / "elsewhere" / "ckpt_000002.pt"  # another machine: no data, no tokenizer file
    moved.parent.mkdir()
    for name in ("ckpt_000002.pt", "ckpt_000002.pt.sha256"):
        shutil.copy(tmp_path / "out" / name, moved.parent / name)
    shutil.rmtree(data_dir)
    capsys.readouterr()
    assert (
        sample.main(
            [
                "--ckpt",
                str(moved),
                "--prompt",
                "Once upon",
                "--max_new_tokens",
                "6",
                "--device",
                "cpu",
                "--dtype",
                "float32",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.startswith("Once upon")

    assert checkpoint_command.main(["export", str(moved), str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "tokenizer.json").read_text() == tokenizer_file.read_text()
    auto = AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "The quick brown fox, 日本語 😀"
    assert auto.encode(text, add_special_tokens=False) == enc.encode_ordinary(text)
    assert auto.eos_token_id == enc.eot_token
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    ours, _ = loading.load_model(ckpt=moved)
    ids = torch.tensor([enc.encode_ordinary(text)[:16]])  # block_size 16
    with torch.no_grad():
        logits, _ = ours(ids)
        np.testing.assert_allclose(hf(ids).logits[0, -1].numpy(), logits[0, -1].numpy(), atol=1e-4)


@pytest.fixture(scope="module")
def two_runs(trained, neox_tokenizer_json, tmp_path_factory):
    """Data prepared with the trained tokenizer (run 'a', 2 steps) and with the NeoX-style one."""
    import train

    tmp = tmp_path_factory.mktemp("mismatch")
    a, b = prepare(tmp, trained[0], "a"), prepare(tmp, neox_tokenizer_json, "b")
    assert train.main([*TINY, f"--data_dir={a}", f"--out_dir={tmp / 'run_a'}", "--max_steps=2"]) == 0
    return tmp, a, b


def one_line_refusal(capsys, argv):
    import train

    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code in (1, 2) and "\n" not in err and err.startswith("train.py: error:")
    return err


def test_resuming_on_data_of_another_tokenizer_is_refused(two_runs, capsys):
    tmp, a, b = two_runs
    err = one_line_refusal(
        capsys, ["--init_from=resume", f"--out_dir={tmp / 'run_a'}", f"--data_dir={b}", "--max_steps=4"]
    )
    a_id, b_id = bpe.open_tokenizer(a / "a_tokenizer.json").id, bpe.open_tokenizer(b / "b_tokenizer.json").id
    assert a_id in err and b_id in err and "ckpt_000002.pt" in err


def test_fine_tuning_on_data_of_another_tokenizer_is_refused(two_runs, capsys):
    tmp, a, b = two_runs
    err = one_line_refusal(
        capsys, [*TINY, f"--init_from={tmp / 'run_a'}", f"--data_dir={b}", f"--out_dir={tmp / 'ft'}", "--max_steps=2"]
    )
    assert "init_from=" in err and bpe.open_tokenizer(b / "b_tokenizer.json").id in err


def test_data_of_two_tokenizers_is_refused(two_runs, capsys):
    tmp, a, b = two_runs
    err = one_line_refusal(capsys, [*TINY, f"--data_dir={tmp}/data_*/*", f"--out_dir={tmp / 'both'}", "--max_steps=2"])
    assert "two tokenizers" in err and "a_manifest.json" in err and "b_manifest.json" in err


def test_the_same_tokenizer_fine_tunes_and_a_changed_tokenizer_file_is_refused(two_runs, capsys):
    import train

    tmp, a, b = two_runs
    assert (
        train.main(
            [
                *TINY,
                f"--init_from={tmp / 'run_a'}",
                f"--data_dir={a}",
                f"--out_dir={tmp / 'ft_a'}",
                "--max_steps=2",
                "--sample_interval=0",
                "--eval_interval=0",
            ]
        )
        == 0
    )
    (b / "b_tokenizer.json").write_text((a / "a_tokenizer.json").read_text())
    err = one_line_refusal(capsys, [*TINY, f"--data_dir={b}", f"--out_dir={tmp / 'changed'}", "--max_steps=2"])
    assert "b_tokenizer.json: changed since" in err


def test_a_bad_tokenizer_flag_is_a_one_line_prep_error(tmp_path, capsys):
    import prepare_data

    src = tmp_path / "a.txt"
    src.write_text("hello")
    with pytest.raises(SystemExit) as e:
        prepare_data.main(
            ["--input", str(src), "--tokenizer", str(tmp_path / "nope"), "--out_dir", str(tmp_path / "d")]
        )
    assert "no such tokenizer.json" in str(e.value.code) and "\n" not in str(e.value.code)


def test_a_vocab_size_the_config_sets_wins_over_the_datas(two_runs):
    import torch

    import train

    tmp, a, b = two_runs
    assert (
        train.main(
            [
                *TINY,
                f"--data_dir={a}",
                f"--out_dir={tmp / 'v512'}",
                "--vocab_size=512",
                "--max_steps=1",
                "--eval_interval=0",
                "--sample_interval=0",
            ]
        )
        == 0
    )
    assert torch.load(tmp / "v512" / "ckpt_000001.pt", weights_only=True)["model_args"]["vocab_size"] == 512


def test_the_chat_format_uses_the_tokenizers_own_chat_tokens(trained, neox_tokenizer_json):
    enc = chat.tokenizer(bpe.open_tokenizer(trained[0]))
    tokens, mask = chat.encode(enc, [{"role": "user", "content": "Hi <|end|>"}, {"role": "assistant", "content": "Yo"}])
    hi, yo = enc.encode_ordinary("Hi <|end|>"), enc.encode_ordinary("Yo")
    assert tokens == [0, 2, *hi, 4, 3, *yo, 4]
    assert mask == [0, 0, *[0] * len(hi), 0, 0, *[1] * len(yo), 1]
    with pytest.raises(ValueError, match=r"<\|system\|>, <\|user\|>, <\|assistant\|>, <\|end\|>"):
        chat.tokenizer(bpe.open_tokenizer(neox_tokenizer_json))


# ----------------------------------------------------------------------------- flags, input and output of tokenizer.py


def run_tokenizer(*args):
    """tokenizer.main on these flags, no progress bar; returns its exit status, or its one-line error."""
    try:
        return tokenizer.main([*map(str, args), "--no_progress"])
    except SystemExit as e:
        message = str(e.code)
        assert message.startswith("tokenizer.py: error: ") and "\n" not in message
        return message


def test_default_flags_train_on_a_50_kb_corpus_holding_out_a_tenth(tmp_path):
    """As prepare_data.py's --val_tokens: 10% of the input is held out (at most 200,000 bytes), so a small corpus
    trains with the default flags (it used to be refused below 200 KB)."""
    src = tmp_path / "small.txt"
    src.write_text(" ".join(CORPUS * 6)[:48_000])
    assert 50_000 <= src.stat().st_size < 52_000
    assert run_tokenizer("--input", src, "--vocab_size", 400, "--out", tmp_path / "tok") == 0
    report = json.loads((tmp_path / "tok" / "report.json").read_text())
    assert abs(report["held_out_bytes"] - src.stat().st_size / 10) <= 4  # cut at a character boundary
    assert report["train_bytes"] == src.stat().st_size - report["held_out_bytes"]
    held, rest = tokenizer.split_held_out(["x" * 3_000_000])  # a large input: 200,000 bytes
    assert len(held) == 200_000 and len(next(rest)) == 2_800_000


def test_a_second_tokenizer_py_on_the_same_out_is_refused_before_reading_the_input(tmp_path, monkeypatch):
    from gpt2train.files import directory_lock

    src = tmp_path / "a.txt"
    src.write_text("hello world " * 100)
    monkeypatch.setattr(tokenizer, "resolve_source", lambda *a: pytest.fail("read the input"))
    with directory_lock(tmp_path / "tok", "tokenizer.py"):
        message = run_tokenizer("--input", src, "--vocab_size", 300, "--out", tmp_path / "tok")
    assert f"{tmp_path / 'tok'} is in use by tokenizer.py (pid " in message


def test_an_unwritable_out_fails_before_the_input_is_read(tmp_path, monkeypatch, read_only):
    src = tmp_path / "a.txt"
    src.write_text("hello world " * 100)
    monkeypatch.setattr(tokenizer, "resolve_source", lambda *a: pytest.fail("read the input"))
    read_only(tmp_path / "ro")
    message = run_tokenizer("--input", src, "--vocab_size", 300, "--out", tmp_path / "ro" / "tok")
    assert message == f"tokenizer.py: error: {tmp_path / 'ro' / 'tok'}: Permission denied"


def test_a_full_disk_keeps_the_tokenizer_that_was_there_and_is_one_line(tmp_path, monkeypatch):
    """tokenizer.json is written whole or not at all: a disk that fills during the write leaves the previous one."""
    import errno
    import os

    src = tmp_path / "a.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in CORPUS))
    flags = ["--input", src, "--out", tmp_path / "tok", "--held_out_bytes", 500]
    assert run_tokenizer(*flags, "--vocab_size", 400) == 0
    before = (tmp_path / "tok" / "tokenizer.json").read_bytes()

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")  # the data did not reach the disk

    monkeypatch.setattr(os, "fsync", full)
    message = run_tokenizer(*flags, "--vocab_size", 350)
    monkeypatch.undo()
    assert message == (
        f"tokenizer.py: error: {tmp_path / 'tok' / 'tokenizer.json'}: no space left on the device; free some disk space"
    )
    assert (tmp_path / "tok" / "tokenizer.json").read_bytes() == before
    assert bpe.open_tokenizer(tmp_path / "tok").n_vocab == 400


def test_lone_surrogates_in_the_input_are_replaced_as_prepare_data_replaces_them(tmp_path):
    src = tmp_path / "s.jsonl"  # "\ud800" is valid JSON, not valid UTF-8
    src.write_text('{"text": "lone \\ud800 surrogate"}\n' + "".join(json.dumps({"text": t}) + "\n" for t in CORPUS))
    assert run_tokenizer("--input", src, "--vocab_size", 300, "--out", tmp_path / "tok", "--held_out_bytes", 10) == 0
    assert run_tokenizer("--input", src, "--vocab_size", 300, "--out", tmp_path / "tok2") == 0  # in the held-out text


def test_held_out_and_max_bytes_flags_are_checked_and_the_error_names_the_flag_to_change(tmp_path):
    src = tmp_path / "a.txt"
    src.write_text("hello world " * 100)
    flags = ["--input", src, "--vocab_size", 300, "--out", tmp_path / "tok"]
    assert "--held_out_bytes must be >= 0, got -5" in run_tokenizer(*flags, "--held_out_bytes", -5)
    assert "--max_bytes must be >= 1, got 0" in run_tokenizer(*flags, "--max_bytes", 0)
    message = run_tokenizer(*flags, "--held_out_bytes", 10, "--max_bytes", 100)
    assert "--max_bytes 100 is smaller than the first document after the held-out text (1,190 bytes)" in message
    assert "lower --held_out_bytes" in run_tokenizer(*flags, "--held_out_bytes", 5000)
    (tmp_path / "empty.txt").write_text("")
    assert "the input holds no text" in run_tokenizer(*flags[2:], "--input", tmp_path / "empty.txt")


def test_val_input_is_the_held_out_text_all_of_the_input_is_learned_and_prep_holds_out_the_same(tmp_path, monkeypatch):
    """tokenizer.py and prepare_data.py given the same --val_input hold out the same documents: the tokenizer's
    held-out text is exactly those documents, it learns from every input document and none of them, and
    prepare_data.py's val shard is those documents tokenized with the tokenizer (an <|endoftext|> before each)."""
    import numpy as np

    import prepare_data

    src = tmp_path / "train.jsonl"
    src.write_text("".join(json.dumps({"text": f"{i}: {t}"}) + "\n" for i, t in enumerate(CORPUS)))
    val = [f"held out {i}: {t}" for i, t in enumerate(CORPUS[:6])]
    (tmp_path / "val.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in [val[0], "", *val[1:]]))
    learned, held = [], []
    real_train, real_report = tokenizer.train, tokenizer.report
    monkeypatch.setattr(
        tokenizer, "train", lambda texts, *a, **k: real_train(learned.extend(texts) or learned, *a, **k)
    )
    monkeypatch.setattr(tokenizer, "report", lambda *a: held.append(a[3]) or real_report(*a))
    flags = ["--input", src, "--val_input", tmp_path / "val.jsonl"]
    assert run_tokenizer(*flags, "--vocab_size", 300, "--out", tmp_path / "tok") == 0
    assert learned == [f"{i}: {t}" for i, t in enumerate(CORPUS)] and held == ["\n".join(val)]
    report = json.loads((tmp_path / "tok" / "report.json").read_text())
    assert report["held_out_bytes"] == len("\n".join(val).encode()) and report["train_bytes"] == sum(
        len(t.encode()) for t in learned
    )
    prepare_data.main(
        [
            *map(str, flags),
            "--tokenizer",
            str(tmp_path / "tok"),
            "--out_dir",
            str(tmp_path / "data"),
            "--num_proc",
            "1",
            "--no_progress",
        ]
    )
    enc = bpe.open_tokenizer(tmp_path / "tok")
    shard = np.fromfile(tmp_path / "data" / "train_val_000000.bin", dtype="<u2", offset=1024)
    assert shard.tolist() == [t for d in val for t in [enc.eot_token, *enc.encode_to_numpy(d).tolist()]]


def test_val_input_errors_are_one_line_naming_the_flag(tmp_path):
    src, val = tmp_path / "a.txt", tmp_path / "val.txt"
    src.write_text("hello world " * 100)
    val.write_text("held out")
    (tmp_path / "empty.txt").write_text("")
    flags = ["--vocab_size", 300, "--out", tmp_path / "tok", "--input", src]
    message = run_tokenizer(*flags, "--val_input", val, "--held_out_bytes", 10)
    assert (
        message
        == "tokenizer.py: error: give --val_input or --held_out_bytes, not both: the held-out text is --val_input's"
    )
    assert "--val_input: no input files matched" in run_tokenizer(*flags, "--val_input", tmp_path / "missing.txt")
    assert "--val_input " + f"{tmp_path / 'empty.txt'}: no documents with text" in run_tokenizer(
        *flags, "--val_input", tmp_path / "empty.txt"
    )
    assert "the input holds no text" in run_tokenizer(*flags[:4], "--input", tmp_path / "empty.txt", "--val_input", val)


def test_long_runs_without_whitespace_are_cut_for_training_and_counted(tmp_path, capsys):
    """The trainer's time grows with the square of a pre-token's length (1 MB of 'a': not done in 300 s)."""
    text = "start " + "ab" * 1500 + " middle " + " " * 2500 + "end"
    pieces, runs = tokenizer.cut_long_runs(text)
    assert "".join(pieces) == text and runs == 2
    assert max(len(p) for p in pieces) == tokenizer.MAX_RUN
    assert tokenizer.cut_long_runs("x" * tokenizer.MAX_RUN) == (["x" * tokenizer.MAX_RUN], 0)
    src = tmp_path / "long.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in [*CORPUS, text, "q" * 50_000]))
    assert run_tokenizer("--input", src, "--vocab_size", 400, "--out", tmp_path / "tok", "--held_out_bytes", 500) == 0
    note = "note: 3 run(s) of over 1,000 characters without whitespace (or of whitespace) cut into 1,000-character"
    assert note in capsys.readouterr().err


# ----------------------------------------------------------------------------- ids the uint16 shards cannot hold


@pytest.fixture
def high_ids(trained, tmp_path):
    """The trained tokenizer with its 50 last merges renumbered 65,546-65,595: 400 entries, ids not contiguous."""
    spec = json.loads((trained[0] / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    last = sorted(vocab, key=vocab.get)[-50:]
    vocab.update({token: 65_546 + k for k, token in enumerate(last)})
    path = tmp_path / "high" / "tokenizer.json"
    path.parent.mkdir()
    path.write_text(json.dumps(spec))
    return path, last[0]


def test_a_tokenizer_with_ids_of_65536_or_more_is_refused_naming_the_first(high_ids, tmp_path):
    """It used to be accepted (it has 400 entries) and its ids wrapped silently into bytes and specials."""
    import prepare_data

    path, first = high_ids
    src = tmp_path / "a.txt"
    src.write_text(" ".join(CORPUS))
    with pytest.raises(SystemExit) as e:
        prepare_data.main(["--input", str(src), "--tokenizer", str(path), "--out_dir", str(tmp_path / "d")])
    assert str(e.value.code) == (
        f"prepare_data.py: error: tokenizer {path}: token {first!r} has id 65,546 (50 ids of 65,536 or more): the "
        f"shards store ids as uint16, 0 to 65,535; renumber its vocabulary below 65,536"
    )
    assert not (tmp_path / "d").exists()


def test_every_id_is_checked_before_the_cast_to_uint16(high_ids):
    import prepare_data
    from gpt2train.documents import PrepError

    path, _ = high_ids
    with pytest.raises(PrepError, match=r"tokenizer .*: token id 65,5\d\d does not fit the shards' uint16"):
        prepare_data.tokenize_batch(CORPUS[:4], str(path))


def test_a_tokenizer_that_cannot_be_built_is_one_line_from_train_py(trained, two_runs, capsys, monkeypatch):
    """The `tokenizers` package missing where the data's own tokenizer is needed: one line, not a traceback."""
    import sys

    tmp, a, _ = two_runs
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers now raises ImportError
    err = one_line_refusal(capsys, [*TINY, f"--data_dir={a}", f"--out_dir={tmp / 'no_package'}", "--max_steps=1"])
    assert err == (  # the evaluations load the run's tokenizer: samples are on in TINY
        f"train.py: error: sample_interval: the run's tokenizer cannot be loaded: {trained[0] / 'tokenizer.json'}: "
        f"this model's tokenizer needs the `tokenizers` package: pip install tokenizers; or train without it: "
        f"--sample_interval=0"
    )


# ----------------------------------------------------------------------------- SFT with an own tokenizer


def prepare_sft(tmp_path, tok):
    """prepare_data.py --format sft --tokenizer tok over test_sft's conversations -> the data directory."""
    import prepare_data
    from test_sft import ROWS, write_jsonl

    src = write_jsonl(tmp_path / "chat.jsonl", ROWS)
    out = tmp_path / "sft"
    prepare_data.main(["--input", str(src), "--format", "sft", "--tokenizer", str(tok), "--out_dir", str(out)])
    return out


def test_sft_data_with_an_own_tokenizer_uses_its_chat_tokens(trained, tmp_path):
    """tokenizer.py --chat_tokens (the default) reserves ids 1-4 for the chat tokens; prepare_data.py --format sft
    --tokenizer DIR renders each conversation with them (chat.encode with that tokenizer) and records the tokenizer
    as a text prep does, so that train.py takes the vocabulary from the data. It was refused: GPT-2's only."""
    import numpy as np

    from gpt2train import shards
    from test_sft import ROWS

    enc = chat.tokenizer(bpe.open_tokenizer(trained[0]))
    data = prepare_sft(tmp_path, trained[0])
    expected = [chat.encode(enc, chat.parse(row)) for row in ROWS]
    found = sorted(data.glob("chat_*.bin"), key=lambda p: ("train" in p.name, p.name))  # val first, as prepared
    loaded = [shards.load_shard(p) for p in found]
    tokens = np.concatenate(loaded).tolist()
    mask = np.concatenate([shards.load_mask(p.with_suffix(".mask"), len(t))[0] for p, t in zip(found, loaded)]).tolist()
    assert tokens == [t for c, _ in expected for t in c] and mask == [m for _, k in expected for m in k]
    assert {1, 2, 3, 4} <= set(tokens) and tokens[0] == enc.eot_token == 0 and max(tokens) < 400
    manifest = json.loads((data / "chat_manifest.json").read_text())
    assert manifest["tokenizer"]["id"] == enc.id == manifest["settings"]["tokenizer"]
    assert (data / "chat_tokenizer.json").read_text() == (trained[0] / "tokenizer.json").read_text()


def test_sft_prep_with_a_tokenizer_without_the_chat_tokens_is_one_line(tmp_path):
    src = tmp_path / "corpus.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in CORPUS))
    assert run_tokenizer("--input", src, "--vocab_size", 300, "--out", tmp_path / "plain", "--no-chat_tokens") == 0
    plain = bpe.open_tokenizer(tmp_path / "plain")
    assert plain.eot_token == 0 and all(plain.special_id(t) is None for t in chat.SPECIAL)
    with pytest.raises(SystemExit) as e:
        prepare_sft(tmp_path, tmp_path / "plain")
    message = str(e.value.code)
    assert message.startswith("prepare_data.py: error: ") and "\n" not in message
    assert "<|system|>, <|user|>, <|assistant|>, <|end|>" in message and "tokenizer.py --chat_tokens" in message
    assert not (tmp_path / "sft").exists() or not list((tmp_path / "sft").glob("*.bin"))  # before any shard


@pytest.mark.slow
def test_sft_with_an_own_tokenizer_trains_and_sample_chat_replies(trained, tmp_path, capsys):
    """The whole loop at tiny scale: own tokenizer -> SFT data -> a fine-tune (here from scratch, masked loss) ->
    `sample.py --chat` on its checkpoint, which carries the tokenizer: the reply stops at the tokenizer's <|end|>."""
    import sample
    import train
    from test_sft import TINY

    data = prepare_sft(tmp_path, trained[0])
    assert train.main([*TINY, f"--data_dir={data}", f"--out_dir={tmp_path / 'out'}", "--max_steps=4"]) == 0
    capsys.readouterr()
    argv = ["--ckpt", str(tmp_path / "out"), "--chat", "--prompt", "Hi", "--max_new_tokens", "8", "--device", "cpu"]
    assert sample.main(argv) == 0
    out = capsys.readouterr().out
    assert "<|" not in out and out.endswith("\n")  # the reply alone, without the template's tokens
