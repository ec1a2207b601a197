"""Fixtures shared by several test files."""
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
