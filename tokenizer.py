"""Train a byte-level BPE tokenizer on your own text, with the Hugging Face `tokenizers` library.

    python tokenizer.py --input books/ notes/*.jsonl --vocab_size 16384 --out tok/mine
    python prepare_data.py --input books/ notes/*.jsonl --tokenizer tok/mine --out_dir data/mine
    python train.py configs/shakespeare_cpu.py --data_dir=data/mine   # vocab_size comes from the data

--input takes what prepare_data.py --input takes (.txt, .jsonl, .parquet files, directories, globs; --text_key),
or --dataset shakespeare. The first --held_out_bytes of the text (as prepare_data.py's validation split, the start of
the input) are held out; the tokenizer learns from the rest. It writes DIR/tokenizer.json (a standard Hugging Face
file: tokenizers.Tokenizer.from_file and transformers' PreTrainedTokenizerFast / AutoTokenizer load it) and
DIR/tokenizer_config.json, then reports bytes per token on the held-out text next to GPT-2's, and its speed.

Design: GPT-4's split pattern (cl100k_base) before the byte-level BPE. Compared with GPT-2's it keeps runs of
newlines and indentation apart from the words (code and markdown compress better), splits digits in groups of at most
three (numbers cost a bounded number of tokens instead of one arbitrary merge per frequent number), and matches
contractions case-insensitively. The special tokens come first: <|endoftext|> is id 0 (the document separator) and
chat.py's chat tokens 1..4, so a model trained on the data can be fine-tuned to chat without resizing. vocab_size
counts everything (specials, the 256 bytes, the merges) and is at most 65,536: the shards hold uint16 ids.
"""

import argparse
import json
import sys
import time
from pathlib import Path

GPT4_SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*"""
    r"""|\s*[\r\n]|\s+(?!\S)|\s+"""
)
MAX_VOCAB = 2**16  # uint16 shards
DEFAULT_HELD_OUT_BYTES = 200_000


class TokenizerError(Exception):
    """A one-line problem with the flags or the input."""


def special_tokens():
    """<|endoftext|> then chat.py's chat tokens, in id order."""
    from gpt2train import chat

    return ["<|endoftext|>", *chat.SPECIAL]


def split_held_out(texts, held_out_bytes):
    """(held-out text, iterator over the remaining texts): the first held_out_bytes of UTF-8 text of the documents
    (whole documents, the last one cut at a character boundary) and everything after it."""
    held, size, texts = [], 0, iter(texts)
    for text in texts:
        need = held_out_bytes - size
        data = text.encode("utf-8", errors="surrogatepass")
        if len(data) <= need:
            held.append(text)
            size += len(data)
            continue
        cut = data[:need].decode("utf-8", errors="ignore")  # drop a character cut in half
        held.append(cut)
        rest = text[len(cut) :]
        return "\n".join(held), _chain(rest, texts)
    return "\n".join(held), iter(())


def _chain(first, rest):
    if first:
        yield first
    yield from rest


def build_tokenizer():
    """An untrained byte-level BPE with GPT-4's split pattern (module docstring)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(GPT4_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def train(texts, vocab_size, progress=False):
    """A trained tokenizers.Tokenizer of vocab_size ids (specials, 256 bytes, merges) from an iterable of texts."""
    specials = special_tokens()
    if not len(specials) + 256 < vocab_size <= MAX_VOCAB:
        raise TokenizerError(
            f"--vocab_size must be in ({len(specials) + 256}, {MAX_VOCAB:,}]: the shards store token "
            f"ids as uint16 (at most 65,536 ids) and the vocabulary holds {len(specials)} special "
            f"tokens and 256 bytes before any merge; got {vocab_size:,}"
        )
    try:
        from tokenizers import pre_tokenizers, trainers
    except ImportError:
        raise TokenizerError("training needs the Hugging Face `tokenizers` package: pip install tokenizers") from None
    tok = build_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        show_progress=progress,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def compression(enc, text):
    """(bytes per token, encoding MB/s) of one tokenizer on text, encoded in this process as prepare_data.py's
    workers encode it (encode_to_numpy), after a warm-up (HFTokenizer builds its tiktoken translation on first use)."""

    def encode(text):
        return enc.encode_to_numpy(text) if hasattr(enc, "json") else enc.encode_to_numpy(text, disallowed_special=())

    encode(text[:1000])
    start = time.perf_counter()
    n = len(encode(text))
    seconds = time.perf_counter() - start
    size = len(text.encode("utf-8", errors="surrogatepass"))
    return size / max(n, 1), size / max(seconds, 1e-9) / 1e6


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--input", nargs="+", metavar="PATH", help=".txt/.jsonl/.parquet files, directories or globs")
    p.add_argument("--dataset", metavar="NAME", help="a prepare_data.py preset or Hugging Face dataset, as there")
    p.add_argument("--text_key", default="text", help="jsonl field / parquet or dataset column holding the text")
    p.add_argument("--vocab_size", type=int, required=True, help=f"ids in all, at most {MAX_VOCAB:,} (uint16 shards)")
    p.add_argument("--out", required=True, metavar="DIR", help="directory for tokenizer.json and tokenizer_config.json")
    p.add_argument(
        "--held_out_bytes",
        type=int,
        default=DEFAULT_HELD_OUT_BYTES,
        help="bytes at the start of the input kept out of training and used for the report",
    )
    p.add_argument("--max_bytes", type=int, default=None, help="learn from at most this many bytes (default: all)")
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    try:
        report = train_cli(args)
    except (TokenizerError, OSError) as e:
        from gpt2train.files import error_message

        sys.exit(error_message("tokenizer.py", e))
    print(report)
    return 0


def train_cli(args):
    """tokenizer.py's work for parsed flags; returns the report's text."""
    from gpt2train import assets, bpe
    from gpt2train.documents import PrepError, non_empty, resolve_source

    if not len(special_tokens()) + 256 < args.vocab_size <= MAX_VOCAB:
        train([], args.vocab_size)  # the one-line error, before reading anything
    try:
        _, texts, _, _, _ = resolve_source(args.input, args.dataset, args.text_key, None, None, None, None)
        held_out, rest = split_held_out(non_empty(texts()), args.held_out_bytes)
        learned = {"bytes": 0, "docs": 0}

        def limited():
            for text in rest:
                size = len(text.encode("utf-8", errors="surrogatepass"))
                if args.max_bytes is not None and learned["bytes"] + size > args.max_bytes:
                    return
                learned["bytes"] += size
                learned["docs"] += 1
                yield text

        start = time.perf_counter()
        tok = train(limited(), args.vocab_size, progress=not args.no_progress)
    except PrepError as e:
        raise TokenizerError(str(e)) from None
    seconds = time.perf_counter() - start
    if learned["bytes"] == 0:
        raise TokenizerError(
            f"no text left to learn from after the first --held_out_bytes {args.held_out_bytes:,} "
            f"bytes; lower --held_out_bytes or give more text"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    bpe.save_tokenizer(out, model_dir=out)  # tokenizer_config.json: <|endoftext|> as bos/eos/unk, for AutoTokenizer
    ours = bpe.open_tokenizer(out)
    speed = learned["bytes"] / 1e6 / max(seconds, 1e-9)
    fewer = (
        f" (asked for {args.vocab_size:,}: no pair of tokens left that occurs twice in the text)"
        if tok.get_vocab_size() < args.vocab_size
        else ""
    )
    lines = [
        (
            f"tokenizer.py: {tok.get_vocab_size():,} ids learned from {learned['bytes'] / 1e6:,.1f} MB "
            f"({learned['docs']:,} documents) in {seconds:.1f} s ({speed:.1f} MB/s) -> {out / 'tokenizer.json'} "
            f"({ours.id}){fewer}"
        )
    ]
    if held_out:
        mine, mine_speed = compression(ours, held_out)
        gpt2, gpt2_speed = compression(assets.get_tokenizer(), held_out)
        size = len(held_out.encode("utf-8", errors="surrogatepass"))
        lines.append(
            f"held-out {size:,} bytes: {mine:.3f} bytes/token ({ours.n_vocab:,} ids) vs GPT-2 {gpt2:.3f} "
            f"(50,257 ids), {gpt2 / mine - 1:+.1%} tokens for the same text; encoding {mine_speed:.1f} MB/s vs "
            f"GPT-2's {gpt2_speed:.1f} MB/s (one process)"
        )
        report = {
            "vocab_size": ours.n_vocab,
            "held_out_bytes": size,
            "bytes_per_token": mine,
            "gpt2_bytes_per_token": gpt2,
            "train_seconds": seconds,
            "train_bytes": learned["bytes"],
        }
        (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
