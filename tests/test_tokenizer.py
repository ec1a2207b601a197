"""tokenizer.py: a byte-level BPE trained with the `tokenizers` library, written as a standard tokenizer.json that
round-trips any text and encodes exactly as transformers and the tokenizers library do (and as the tiktoken
translation prepare_data.py's workers use)."""
import json
import random

import pytest

import assets
import chat
import tokenizer

pytest.importorskip("tokenizers")

CORPUS = ["Once upon a time there was a naïve café owner 😀 who said hello to the world.",
          "The quick brown fox jumps over the lazy dog; 日本語 and ünïcödé too. Numbers: 12345 and 3.14159.",
          "def add(a, b):\n    return a + b  # code, with indentation\n\n\n",
          "She said: \"I'll go, they'd stay, WE'VE been here\".\tTabs\t\tand   spaces   end."] * 30
TEXTS = ["", " ", "   leading and trailing   ", "\n\n\n", "\t \t\r\n", "naïve café 😀 日本語 ﬁ İı 𝔘𝔫𝔦",
         "<|endoftext|>", "a <|endoftext|> b <|user|>hi<|end|><|assistant|>", "x" * 500, "1234567890 3.14",
         "unknown bytes: \x00\x01\x7f \u200b\u00a0", "Ünïcödé ÀÉÎÕÜ ß Ω≈ç√ ¡¿ emoji 👩‍👩‍👧 flags 🇫🇷"]


def random_text(rng, n=300):
    alphabet = "abcXYZ019 \n\t\r.,;'\"<|>_-" + "éüñ日本語😀𝔘" + "\u00a0\u2003\u200b"
    return "".join(rng.choice(alphabet) for _ in range(n))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """tokenizer.py's CLI on a small corpus: (the output directory, its report)."""
    src = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in CORPUS))
    out = tmp_path_factory.mktemp("tok") / "mine"
    tokenizer.main(["--input", str(src), "--vocab_size", "400", "--out", str(out), "--held_out_bytes", "500",
                    "--no_progress"])
    return out, json.loads((out / "report.json").read_text())


def test_the_special_tokens_come_first_and_the_vocabulary_has_the_asked_size(trained):
    out, report = trained
    enc = assets.open_tokenizer(out)
    assert enc.n_vocab == 400 == report["vocab_size"]
    assert enc.eot_token == 0
    assert [enc.special_id(t) for t in chat.SPECIAL] == [1, 2, 3, 4]
    assert report["bytes_per_token"] > 1 and report["gpt2_bytes_per_token"] > 1


@pytest.mark.parametrize("text", TEXTS)
def test_text_round_trips_and_special_token_strings_are_plain_text(trained, text):
    enc = assets.open_tokenizer(trained[0])
    ids = enc.encode_ordinary(text)
    assert enc.decode(ids) == text
    assert not set(ids) & {0, 1, 2, 3, 4}  # '<|endoftext|>' typed in a document is text, not the separator
    assert list(enc.encode_to_numpy(text)) == ids  # prepare_data.py's path


def test_random_text_round_trips_and_the_fast_path_agrees(trained):
    enc, rng = assets.open_tokenizer(trained[0]), random.Random(0)
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
    enc = assets.open_tokenizer(out)
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
    tokenizer.main(["--input", str(src), "--vocab_size", "300", "--out", str(tmp_path / "ok"), "--held_out_bytes", "10",
                    "--no_progress"])  # 65,536 and below are fine: 300 here
    assert assets.open_tokenizer(tmp_path / "ok").n_vocab <= 300


def test_training_is_deterministic(tmp_path):
    first = tokenizer.train(CORPUS, 350).to_str()
    assert tokenizer.train(CORPUS, 350).to_str() == first


def test_held_out_text_is_the_start_of_the_input_cut_at_a_character():
    held, rest = tokenizer.split_held_out(["ab", "cdé", "fg"], 4)
    assert held == "ab\ncd" and list(rest) == ["é", "fg"]
    held, rest = tokenizer.split_held_out(["ab"], 100)
    assert held == "ab" and list(rest) == []


def test_gpt2s_tokenizer_json_is_gpt2_and_translates_to_tiktoken_exactly():
    enc = assets.HFTokenizer(json_text=assets.gpt2_tokenizer_json(), name="gpt2.json")
    assert enc.id == "gpt2"
    text = " ".join(TEXTS) + random_text(random.Random(2), 2000)
    assert list(enc.encode_to_numpy(text)) == assets.get_tokenizer().encode_ordinary(text) == enc.encode_ordinary(text)
    assert enc._fast


def test_a_normalizing_tokenizer_takes_the_tokenizers_path(neox_tokenizer_json):
    enc = assets.open_tokenizer(neox_tokenizer_json)
    text = "Cafe\u0301 caf\u00e9 <|endoftext|> 😀"
    assert list(enc.encode_to_numpy(text)) == enc.encode_ordinary(text)
    assert enc._fast is False  # NFC: no tiktoken translation
