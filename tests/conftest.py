"""Fixtures shared by several test files."""
import errno
import os

import pytest

TOKENIZER_CORPUS = ["Once upon a time there was a naïve café owner 😀 who said hello to the world.",
                    "The quick brown fox jumps over the lazy dog; 日本語 and ünïcödé too.",
                    "A man is sitting on a roof. He starts pulling up roofing on a roof."]


@pytest.fixture(scope="session")
def byte_level_tokenizer_json(tmp_path_factory):
    """A tiny byte-level BPE tokenizer.json (GPT-NeoX style: <|endoftext|> is id 0), trained here with the
    `tokenizers` library: 256 byte tokens + merges + the special token, under 320 ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TOKENIZER_CORPUS * 20, trainer)
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture
def read_only(monkeypatch):
    """read_only(directory): from now on, writes under `directory` fail with EACCES as on a read-only mount
    (the tests may run as root, whom chmod does not stop)."""
    real_open, real_os_open, real_mkdir = open, os.open, os.mkdir

    def refuse(path):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    def make(directory):
        inside = lambda path: str(path).startswith(str(directory))  # noqa: E731
        writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT
        monkeypatch.setattr("builtins.open", lambda path, mode="r", *a, **k: refuse(path) if inside(path) and
                            set(mode) & set("wax+") else real_open(path, mode, *a, **k))
        monkeypatch.setattr(os, "open", lambda path, flags, *a, **k: refuse(path) if inside(path) and flags & writes
                            else real_os_open(path, flags, *a, **k))
        monkeypatch.setattr(os, "mkdir", lambda path, *a, **k: refuse(path) if inside(path) else real_mkdir(path, *a, **k))
    return make
