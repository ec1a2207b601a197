"""bpe.py: a model directory's own tokenizer.json behind tiktoken's interface (the tokenizers library as reference)."""

import sys

import pytest
import tiktoken

from gpt2train import bpe
from gpt2train.assets import get_tokenizer
from test_assets import varied_text


def test_hf_tokenizer_encodes_and_decodes_as_the_tokenizers_library(byte_level_tokenizer_json):
    from tokenizers import Tokenizer

    reference = Tokenizer.from_file(str(byte_level_tokenizer_json))
    reference.encode_special_tokens = True  # varied_text has "<|endoftext|>" as ordinary text
    enc = bpe.load_tokenizer(byte_level_tokenizer_json.parent)
    assert isinstance(enc, bpe.HFTokenizer)
    assert enc.n_vocab == reference.get_vocab_size() and enc.eot_token == reference.token_to_id("<|endoftext|>") == 0
    text = varied_text()
    ids = enc.encode_ordinary(text)
    assert ids == reference.encode(text, add_special_tokens=False).ids
    assert enc.decode(ids) == text
    # the streaming path: token bytes, some of them parts of a multi-byte character, join to the text's bytes
    pieces = [enc.decode_single_token_bytes(t) for t in ids]
    assert b"".join(pieces) == text.encode()
    assert any(_is_partial_utf8(p) for p in pieces)
    with pytest.raises(KeyError):
        enc.decode_single_token_bytes(enc.n_vocab + 5)


def _is_partial_utf8(b):
    try:
        b.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def test_hf_tokenizer_special_tokens_only_where_allowed(byte_level_tokenizer_json):
    enc = bpe.load_tokenizer(byte_level_tokenizer_json.parent)
    text = "hello<|endoftext|>world<|endoftext|>"
    assert enc.eot_token not in enc.encode_ordinary(text)  # ordinary: the text of the token, as tiktoken
    assert enc.encode(text) == enc.encode_ordinary(text)
    with_eot = enc.encode(text, allowed_special={"<|endoftext|>"})
    assert with_eot == enc.encode_ordinary("hello") + [0] + enc.encode_ordinary("world") + [0]
    assert enc.encode(text, allowed_special="all") == with_eot
    assert enc.decode(with_eot) == text
    assert enc.decode_single_token_bytes(0) == b"<|endoftext|>"


def test_load_tokenizer_without_tokenizer_json_is_gpt2(tmp_path):
    for enc in (bpe.load_tokenizer(tmp_path), bpe.load_tokenizer(None)):
        assert isinstance(enc, tiktoken.Encoding) and enc.name == "gpt2"


def test_missing_tokenizers_package_is_a_one_line_instruction(byte_level_tokenizer_json, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers now raises ImportError
    with pytest.raises(bpe.TokenizerError) as info:
        bpe.load_tokenizer(byte_level_tokenizer_json.parent)
    message = str(info.value)
    assert "\n" not in message and "pip install tokenizers" in message and str(byte_level_tokenizer_json) in message


def test_token_bytes_are_each_ids_utf8_bytes_and_none_for_special_tokens(byte_level_tokenizer_json):
    """val_bpb's denominator: an id's bytes (part of a character counts its part), 0 for <|endoftext|> and for the ids
    of a padded vocabulary."""
    gpt2 = get_tokenizer()
    table = bpe.token_bytes(gpt2, 50304)
    assert len(table) == 50304 and table[50256] == 0 and not table[50257:].any()
    text = "Hello naïve café 😀 日本語"
    assert sum(table[i] for i in gpt2.encode_ordinary(text)) == len(text.encode("utf-8"))
    own = bpe.HFTokenizer(byte_level_tokenizer_json)
    table = bpe.token_bytes(own)
    assert len(table) == own.n_vocab and table[own.eot_token] == 0
    assert sum(table[i] for i in own.encode_ordinary(text)) == len(text.encode("utf-8"))
