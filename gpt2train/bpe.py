"""The byte-level BPE tokenizers a run can use, behind tiktoken's Encoding interface: GPT-2's (tiktoken, from
assets.get_tokenizer) or any tokenizer.json (HFTokenizer, through the optional `tokenizers` package), opened from a
name, a file, a model directory or the record a checkpoint or a prep manifest keeps (tokenizer_record,
tokenizer_from_record); an exact tiktoken translation of a tokenizer.json for fast data preparation (_as_tiktoken);
and the tokenizer files of an export (gpt2_tokenizer_json, save_tokenizer). Training one is tokenizer.py's job.
"""

import contextlib
import functools
import hashlib
import json
import re
from pathlib import Path

import numpy as np
import tiktoken

from gpt2train.assets import EOT, get_tokenizer
from gpt2train.files import atomic_write


class TokenizerError(ValueError):
    """A tokenizer that cannot be built or trained as asked (its file unreadable or unsupported, the `tokenizers`
    package missing, a flag out of range); the message is one line naming the file or the flag."""


def load_tokenizer(model_dir=None, cache_dir=None):
    """The tokenizer of a model: `model_dir`/tokenizer.json when that file exists (a Hugging Face
    directory, e.g. an imported Pythia), read through the `tokenizers` package; else GPT-2's."""
    path = Path(model_dir) / "tokenizer.json" if model_dir is not None else None
    if path is not None and path.is_file():
        return HFTokenizer(path)
    return get_tokenizer(cache_dir)


@functools.lru_cache(maxsize=8)
def open_tokenizer(spec, cache_dir=None):
    """The tokenizer named by `spec` (prepare_data.py --tokenizer): 'gpt2' (tiktoken), a tokenizer.json file, or a
    directory holding one (e.g. tokenizer.py's output or a Pythia model directory). ValueError otherwise."""
    if str(spec) == "gpt2":
        return get_tokenizer(cache_dir)
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ValueError(
            f"tokenizer {spec}: no such tokenizer.json (give 'gpt2', a tokenizer.json file or a "
            f"directory holding one, e.g. what tokenizer.py --out wrote)"
        )
    return HFTokenizer(path)


def tokenizer_from_record(record, cache_dir=None):
    """The tokenizer a checkpoint or a data directory records (tokenizer_record), or GPT-2's for None (checkpoints and
    shards written before tokenizers were recorded)."""
    if record is None or record.get("json") is None:
        return get_tokenizer(cache_dir)
    return HFTokenizer(json_text=record["json"], name=record.get("source") or record["id"])


def tokenizer_record(enc, source=None):
    """What a checkpoint and a prep manifest store about a tokenizer: {"id", "n_vocab", "eot", "json", "source"}:
    id 'gpt2' for GPT-2's (json None: every install builds it), else 'sha256:<16 hex>' of its tokenizer.json text,
    which is kept whole (a plain str: a checkpoint stays weights_only-loadable and samples on any machine)."""
    own = isinstance(enc, HFTokenizer) and enc.id != "gpt2"
    return {
        "id": enc.id if own else "gpt2",
        "n_vocab": enc.n_vocab,
        "eot": enc.eot_token,
        "json": enc.json if own else None,
        "source": None if source is None else str(source),
    }


@functools.lru_cache(maxsize=4)  # GPT-2's takes 0.2 s, and every run in a process asks for it
def token_bytes(enc, size=0):
    """How many UTF-8 bytes of text each token id decodes to (decode_single_token_bytes), as a read-only int64
    array of max(size, n_vocab) entries: 0 for the special tokens (<|endoftext|> and the like mark text, they are
    none of it) and for ids the tokenizer does not have (a padded vocabulary's). The denominator of val_bpb."""
    if isinstance(enc, HFTokenizer):
        special = set(enc._special.values())
    else:  # tiktoken's Encoding
        special = {enc.encode_single_token(t) for t in enc.special_tokens_set}
    table = np.zeros(max(size, enc.n_vocab), dtype=np.int64)
    for i in range(enc.n_vocab):
        if i not in special:
            with contextlib.suppress(KeyError):  # an id in a gap of the vocabulary
                table[i] = len(enc.decode_single_token_bytes(i))
    table.flags.writeable = False
    return table


def _byte_level_chars():
    """GPT-2's byte-level alphabet: byte b is written as one printable character; here char -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, shifted = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:  # whitespace and control bytes move up past 255, in byte order
            chars[chr(256 + shifted)] = b
            shifted += 1
    return chars


# Text on which a tiktoken translation of a tokenizer.json must give the tokenizers library's ids before it is used.
_PROBE = (
    "Hello world! It's 2024: naïve café, 日本語テキスト 😀 don't WON'T they'll I'VE\n\n\n    def f(x):\r\n\t"
    "return x**2  # 1234567 3.14159\u00a0\u2003 tabs\t\tand   spaces   \n <|endoftext|> <|user|> ... "
    "---- ''' \"\"\" "
    "Ünïcödé ÀÉÎÕÜ ß ﬁ İı Ω≈ç√ 𝔘𝔫𝔦 \x00\x01 end  \n\n"
)


def _as_tiktoken(spec, name, expected):
    """A tiktoken Encoding that encodes ordinary text as the tokenizer.json `spec` (a dict) does, or None where it
    cannot: BPE over GPT-2's byte-level alphabet after GPT-2's regex or one Split regex, no normalizer, no non-special
    added token, every multi-byte token made by exactly one merge, ids rising in merge order (tiktoken merges the
    pair whose token has the lowest id, tokenizers applies the earliest merge: then the same rule). tokenizer.py
    trains such files; Pythia's (an NFC normalizer) is not one. The last word: it encodes _PROBE as `expected`."""
    pre, model = spec.get("pre_tokenizer") or {}, spec.get("model") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    options = ("dropout", "continuing_subword_prefix", "end_of_word_suffix", "byte_fallback", "ignore_merges")
    if (
        spec.get("normalizer") is not None
        or model.get("type") != "BPE"
        or any(model.get(k) for k in options)
        or any(not t.get("special") for t in spec.get("added_tokens", []))
    ):
        return None
    byte_level = steps[-1]
    if byte_level.get("type") != "ByteLevel" or byte_level.get("add_prefix_space"):
        return None
    if len(steps) == 1 and byte_level.get("use_regex", True):
        from tiktoken_ext.openai_public import r50k_pat_str as pattern
    elif (
        len(steps) == 2
        and not byte_level.get("use_regex", True)
        and steps[0].get("type") == "Split"
        and steps[0].get("behavior") == "Isolated"
        and not steps[0].get("invert")
        and "Regex" in (steps[0].get("pattern") or {})
    ):
        pattern = steps[0]["pattern"]["Regex"]
    else:
        return None
    chars = _byte_level_chars()
    special = {t["id"] for t in spec.get("added_tokens", [])}
    try:
        ranks = {bytes(chars[c] for c in piece): i for piece, i in model["vocab"].items() if i not in special}
        last, made = -1, set()
        for merge in model["merges"]:
            left, right = merge.split(" ") if isinstance(merge, str) else merge
            token = bytes(chars[c] for c in left + right)
            if token in made or ranks.get(token, -1) <= last:
                return None
            made.add(token)
            last = ranks[token]
    except (KeyError, ValueError, TypeError):  # a piece outside the byte alphabet, a malformed merge
        return None
    if len(made) != len(ranks) - 256 or sum(len(t) == 1 for t in ranks) != 256:
        return None  # a multi-byte token that no merge makes, or a byte missing
    try:
        enc = tiktoken.Encoding(name=f"{name} (tiktoken)", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
    except Exception:  # noqa: BLE001 -- a pattern tiktoken's regex engine does not accept
        return None
    return enc if enc.encode_ordinary(_PROBE) == expected else None


class HFTokenizer:
    """A byte-level BPE tokenizer.json (GPT-2 / GPT-NeoX style) behind the part of tiktoken's Encoding
    that the scripts use: encode, encode_ordinary, decode, decode_single_token_bytes, n_vocab,
    eot_token (the id of <|endoftext|>, or None). encode() treats special-token text as ordinary
    text unless it is in allowed_special (it never raises for it, as tiktoken's default does).
    Built from a file (`path`) or from its text (`json_text`, as a checkpoint carries it); `json` is that text and
    `id` 'gpt2' when the vocabulary is GPT-2's, else 'sha256:<16 hex>' of the text."""

    def __init__(self, path=None, json_text=None, name=None):
        self.name = str(path or name)
        try:
            from tokenizers import Tokenizer, decoders
        except ImportError:
            raise TokenizerError(
                f"{self.name}: this model's tokenizer needs the `tokenizers` package: pip install tokenizers"
            ) from None
        self.json = Path(path).read_text(encoding="utf-8") if json_text is None else json_text
        try:
            self._tok = Tokenizer.from_str(self.json)
        except Exception as e:  # noqa: BLE001 -- tokenizers raises a bare Exception naming no file
            raise TokenizerError(
                f"{self.name}: not a readable tokenizer.json ({' '.join(str(e).split())[:200]})"
            ) from None
        if not isinstance(self._tok.decoder, decoders.ByteLevel):
            raise TokenizerError(
                f"{self.name}: only byte-level BPE tokenizers (GPT-2 / GPT-NeoX style) are supported, "
                f"this one decodes with {type(self._tok.decoder).__name__}"
            )
        self._tok.encode_special_tokens = True  # special tokens in text are text; encode() splits them off itself
        self._added = {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()}
        self._special = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        self._bytes = _byte_level_chars()
        # the largest id + 1, as tiktoken's n_vocab: ids may have gaps, and the shards and the embedding hold ids
        self.n_vocab = max(self.vocab().values(), default=-1) + 1
        self.eot_token = self._tok.token_to_id("<|endoftext|>")
        self.id = "gpt2" if self._is_gpt2() else "sha256:" + hashlib.sha256(self.json.encode()).hexdigest()[:16]
        self._fast = None  # encode_to_numpy's tiktoken translation: None until first asked, False if there is none

    def _is_gpt2(self):
        """True if every id decodes to its bytes in GPT-2's tokenizer (e.g. a Hugging Face gpt2 directory's file)."""
        if self.n_vocab != EOT + 1 or self.eot_token != EOT:
            return False
        gpt2 = get_tokenizer()
        return all(self.decode_single_token_bytes(i) == gpt2.decode_single_token_bytes(i) for i in range(EOT))

    def vocab(self):
        """{token: id} of every id, the added tokens included (a token in GPT-2's byte-level alphabet)."""
        return self._tok.get_vocab(with_added_tokens=True)

    def special_id(self, text):
        """The id of the special token `text` (e.g. '<|user|>'), or None where this tokenizer has none."""
        return self._special.get(text)

    def encode_to_numpy(self, text):
        """encode_ordinary's ids as a uint32 array (prepare_data.py's workers), from a tiktoken translation of the
        file where one exists (_as_tiktoken, checked once on a probe text against this tokenizer), ~4x faster."""
        if self._fast is None:
            self._fast = _as_tiktoken(json.loads(self.json), self.name, self.encode_ordinary(_PROBE)) or False
        try:
            if self._fast:
                return self._fast.encode_to_numpy(text, disallowed_special=())
            return np.array(self.encode_ordinary(text), dtype=np.uint32)
        except (UnicodeEncodeError, TypeError):  # lone surrogates: replaced, as tiktoken's encode_ordinary does
            return self.encode_to_numpy(replace_surrogates(text))

    def encode_ordinary(self, text):
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode(self, text, allowed_special=()):
        """Ids of text; the special tokens named in allowed_special (a set, or 'all') become their ids."""
        candidates = self._special if allowed_special == "all" else allowed_special
        allowed = [s for s in candidates if s in self._special]
        if not allowed:
            return self.encode_ordinary(text)
        pieces = re.split("(" + "|".join(map(re.escape, sorted(allowed, key=len, reverse=True))) + ")", text)
        ids = []
        for i, piece in enumerate(pieces):
            if i % 2:  # re.split puts the matched special tokens at the odd positions
                ids.append(self._special[piece])
            elif piece:
                ids += self.encode_ordinary(piece)
        return ids

    def decode(self, tokens):
        return self._tok.decode(list(tokens), skip_special_tokens=False)

    def decode_single_token_bytes(self, token):
        """The bytes of one id (may be part of a UTF-8 character); KeyError for an id it does not have."""
        if token in self._added:  # added tokens are stored as plain text, not in the byte alphabet
            return self._added[token].encode()
        piece = self._tok.id_to_token(token)
        if piece is None:
            raise KeyError(token)
        return bytes(self._bytes[c] for c in piece)


def replace_surrogates(text):
    """text with its lone surrogates (valid JSON such as "\\ud800", not valid UTF-8) replaced by U+FFFD."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


# ----------------------------------------------------------------------------- tokenizer files for an export


def _bpe_parts(ranks, token, below):
    """token's bytes merged as tiktoken's BPE merges them, using only tokens of rank < `below`."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 1:
        rank, i = min((ranks.get(a + b, below), i) for i, (a, b) in enumerate(zip(parts, parts[1:])))
        if rank >= below:
            break
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return parts


@functools.lru_cache(maxsize=None)
def gpt2_tokenizer_json(cache_dir=None):
    """GPT-2's tokenizer.json (a Hugging Face byte-level BPE), built from the ranks get_tokenizer() uses, with
    the stdlib. Vocabulary: each token's bytes in the byte-level alphabet, id = rank. Merges: token r is the
    merge of the two parts BPE leaves of its bytes with ranks < r only, listed in rank order, so applying
    them by priority reproduces tiktoken's lowest-rank-first merging (the tests check it id for id)."""
    enc = get_tokenizer(cache_dir)
    ranks = {enc.decode_single_token_bytes(i): i for i in range(enc.n_vocab) if i != EOT}
    char = {b: c for c, b in _byte_level_chars().items()}
    text = lambda token: "".join(char[b] for b in token)  # noqa: E731
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) > 1:
            left, right = _bpe_parts(ranks, token, rank)  # exactly two parts, or the ranks are not BPE's
            merges.append(f"{text(left)} {text(right)}")
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return json.dumps(
        {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": [
                {
                    "id": EOT,
                    "content": "<|endoftext|>",
                    "single_word": False,
                    "lstrip": False,
                    "rstrip": False,
                    "normalized": True,
                    "special": True,
                }
            ],
            "normalizer": None,
            "pre_tokenizer": byte_level,
            "post_processor": byte_level,
            "decoder": byte_level,
            "model": {
                "type": "BPE",
                "dropout": None,
                "unk_token": None,
                "continuing_subword_prefix": "",
                "end_of_word_suffix": "",
                "fuse_unk": False,
                "byte_fallback": False,
                "vocab": {**{text(t): r for t, r in ranks.items()}, "<|endoftext|>": EOT},
                "merges": merges,
            },
        },
        ensure_ascii=False,
    )


def save_tokenizer(
    out_dir,
    tokenizer_json=None,
    chat_template=None,
    model_max_length=None,
    cache_dir=None,
    special_tokens=None,
    eos_token=None,
):
    """Write the tokenizer files transformers' AutoTokenizer reads into out_dir and return the id of
    <|endoftext|> (None if the tokenizer has none): `tokenizer_json` (the text of a tokenizer.json: a model's own,
    e.g. Pythia's, or a checkpoint's) when given, else GPT-2's built offline (gpt2_tokenizer_json);
    tokenizer_config.json and special_tokens_map.json with <|endoftext|> as bos, eos and unk token, and
    `chat_template` (a Jinja string) when given; `special_tokens` ({text: id}, e.g. chat.SPECIAL) are added to
    tokenizer.json as special tokens. `eos_token` (one of them, e.g. a chat model's <|end|>) replaces
    <|endoftext|> as the eos token: the end of generation that llama.cpp's converter reads from here."""
    if tokenizer_json is not None:
        try:
            tok = json.loads(tokenizer_json)
            eot = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}.get("<|endoftext|>")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"the tokenizer.json to write is not a Hugging Face tokenizer.json ({e})") from None
    else:
        tokenizer_json, eot = gpt2_tokenizer_json(cache_dir), EOT
    if special_tokens:
        tok = json.loads(tokenizer_json)
        tok["added_tokens"] += [
            {
                "id": i,
                "content": t,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for t, i in special_tokens.items()
        ]
        tokenizer_json = json.dumps(tok, ensure_ascii=False)
    special = {} if eot is None else {key: "<|endoftext|>" for key in ("bos_token", "eos_token", "unk_token")}
    if eos_token is not None:
        special["eos_token"] = eos_token
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
    }  # decode() gives the text back exactly
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    if chat_template is not None:
        config["chat_template"] = chat_template
    out = Path(out_dir)
    atomic_write(out / "tokenizer.json", tokenizer_json)  # whole or not at all; a full disk's error names the file
    atomic_write(out / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")
    atomic_write(out / "special_tokens_map.json", json.dumps(special, indent=2) + "\n")
    return eot
