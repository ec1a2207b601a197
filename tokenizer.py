"""Train a byte-level BPE tokenizer on your own text, with the Hugging Face `tokenizers` library.

    python tokenizer.py --input books/ notes/*.jsonl --vocab_size 16384 --out tok/mine
    python prepare_data.py --input books/ notes/*.jsonl --tokenizer tok/mine --out_dir data/mine
    python train.py configs/shakespeare_cpu.py --data_dir=data/mine   # vocab_size comes from the data

--input takes what prepare_data.py --input takes (any UTF-8 text file, .jsonl, .parquet, directories, globs;
--text_key), or --dataset shakespeare. The first --held_out_bytes of the text (as prepare_data.py's validation split,
the start of the input; by default 10% of it, at most 200,000 bytes) are held out; the tokenizer learns from the
rest. With --val_input (files as --input takes them) the held-out text is their documents instead, the ones
prepare_data.py --val_input makes the validation split, and the tokenizer learns from all of --input; a document of
--val_input or --test_input that --input holds too (by path or content) is refused (exit 2), as prepare_data.py does.
It locks DIR, then writes DIR/tokenizer.json (a standard Hugging Face file: tokenizers.Tokenizer.from_file and
transformers' PreTrainedTokenizerFast / AutoTokenizer load it) and DIR/tokenizer_config.json, each whole or not at
all, then reports bytes per token on the held-out text next to GPT-2's, and its speed.

Design: GPT-4's split pattern (cl100k_base) before the byte-level BPE. Compared with GPT-2's it keeps runs of
newlines and indentation apart from the words (code and markdown compress better), splits digits in groups of at most
three (numbers cost a bounded number of tokens instead of one arbitrary merge per frequent number), and matches
contractions case-insensitively. The special tokens come first: <|endoftext|> is id 0 (the document separator) and,
with --chat_tokens (the default), chat.py's chat tokens 1..4, so a model trained on the data can be fine-tuned to chat
(prepare_data.py --format sft --tokenizer DIR, docs/sft.md) without resizing. vocab_size counts everything
(specials, the 256 bytes, the merges) and is at most 65,536: the shards hold uint16 ids.
"""

import argparse
import itertools
import json
import re
import sys
import time
from pathlib import Path

from gpt2train import assets, bpe
from gpt2train.bpe import TokenizerError
from gpt2train.console import log
from gpt2train.documents import Corpus, HeldOutError, PrepError, held_out, non_empty, resolve_source, without_held_out
from gpt2train.files import LockError, atomic_write, directory_lock, error_message

GPT4_SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*"""
    r"""|\s*[\r\n]|\s+(?!\S)|\s+"""
)
MAX_VOCAB = 2**16  # uint16 shards
HELD_OUT_SHARE = 0.1  # default held-out text: the first 10% of the input, as prepare_data.py's validation split ...
DEFAULT_HELD_OUT_BYTES = 200_000  # ... and at most this many bytes
MAX_RUN = 1_000  # characters: longer runs without whitespace (or of whitespace) are cut for training (cut_long_runs)
LONG_RUN = re.compile(rf"\S{{{MAX_RUN + 1},}}|\s{{{MAX_RUN + 1},}}")


def special_tokens(chat_tokens=True):
    """<|endoftext|> then (chat_tokens) chat.py's chat tokens, in id order."""
    from gpt2train import chat

    return ["<|endoftext|>", *(chat.SPECIAL if chat_tokens else ())]


def split_held_out(texts, held_out_bytes=None):
    """(held-out text, iterator over the remaining texts): the first held_out_bytes of UTF-8 text of the documents
    (whole documents, the last one cut at a character boundary) and everything after it. None: HELD_OUT_SHARE of
    the input, at most DEFAULT_HELD_OUT_BYTES, so up to DEFAULT_HELD_OUT_BYTES / HELD_OUT_SHARE bytes are read
    ahead before the input's size is known."""
    texts = iter(texts)
    if held_out_bytes is None:
        ahead, size = [], 0
        for text in texts:
            ahead.append(text)
            size += len(text.encode("utf-8", errors="surrogatepass"))
            if size >= DEFAULT_HELD_OUT_BYTES / HELD_OUT_SHARE:
                break
        held_out_bytes = min(DEFAULT_HELD_OUT_BYTES, round(HELD_OUT_SHARE * size))
        texts = itertools.chain(ahead, texts)
    held, size = [], 0
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
        return "\n".join(held), itertools.chain([rest] if rest else [], texts)
    return "\n".join(held), iter(())


def cut_long_runs(text):
    """(pieces of text, runs cut): every run of over MAX_RUN characters without whitespace, or of whitespace, cut
    into MAX_RUN-character pieces, each piece a text of its own. The BPE trainer's time grows with the square of a
    pre-token's length (a 1 MB line of base64 or DNA: hours), and no token worth learning is that long. Text
    without such a run comes back whole."""
    pieces, start, runs = [], 0, 0
    for m in LONG_RUN.finditer(text):
        pieces.append(text[start : m.start()])
        pieces += [m.group()[i : i + MAX_RUN] for i in range(0, m.end() - m.start(), MAX_RUN)]
        start, runs = m.end(), runs + 1
    pieces.append(text[start:])
    return [p for p in pieces if p], runs


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


def train(texts, vocab_size, progress=False, chat_tokens=True):
    """A trained tokenizers.Tokenizer of vocab_size ids (specials, 256 bytes, merges) from an iterable of texts."""
    specials = special_tokens(chat_tokens)
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
    p.add_argument(
        "--input",
        nargs="+",
        metavar="PATH",
        help="text files (any UTF-8: one document each), .jsonl, .parquet, directories or globs",
    )
    p.add_argument("--dataset", metavar="NAME", help="a prepare_data.py preset or Hugging Face dataset, as there")
    p.add_argument("--text_key", default="text", help="jsonl field / parquet or dataset column holding the text")
    p.add_argument("--vocab_size", type=int, required=True, help=f"ids in all, at most {MAX_VOCAB:,} (uint16 shards)")
    p.add_argument("--out", required=True, metavar="DIR", help="directory for tokenizer.json and tokenizer_config.json")
    p.add_argument(
        "--held_out_bytes",
        type=int,
        help=f"bytes at the start of the input kept out of training and used for the report (default "
        f"{HELD_OUT_SHARE:.0%}% of the input, at most {DEFAULT_HELD_OUT_BYTES:,})",
    )
    p.add_argument(
        "--val_input",
        nargs="+",
        metavar="PATH",
        help="hold out exactly these files' documents (prepare_data.py --val_input's validation split) instead of "
        "the start of the input, and learn from all of --input",
    )
    p.add_argument(
        "--test_input",
        nargs="+",
        metavar="PATH",
        help="prepare_data.py --test_input's files: refused where --input holds their documents; never read else",
    )
    p.add_argument("--max_bytes", type=int, default=None, help="learn from at most this many bytes (default: all)")
    p.add_argument(
        "--chat_tokens",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reserve ids 1-4 for the chat tokens (<|system|>, <|user|>, <|assistant|>, <|end|>) that "
        "prepare_data.py --format sft and sample.py --chat use (default: on)",
    )
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    try:
        report = train_cli(args)
    except HeldOutError as e:  # held-out documents also in --input: bad input
        print(error_message("tokenizer.py", e), file=sys.stderr)
        sys.exit(2)
    except (TokenizerError, LockError, OSError) as e:
        sys.exit(error_message("tokenizer.py", e))
    print(report)
    return 0


def check_flags(args):
    """TokenizerError for a flag out of range, before anything is read or written."""
    if not len(special_tokens(args.chat_tokens)) + 256 < args.vocab_size <= MAX_VOCAB:
        train([], args.vocab_size, chat_tokens=args.chat_tokens)  # its one-line error
    if args.held_out_bytes is not None and args.held_out_bytes < 0:
        raise TokenizerError(f"--held_out_bytes must be >= 0, got {args.held_out_bytes:,}")
    if args.held_out_bytes is not None and args.val_input:
        raise TokenizerError("give --val_input or --held_out_bytes, not both: the held-out text is --val_input's")
    if args.max_bytes is not None and args.max_bytes < 1:
        raise TokenizerError(f"--max_bytes must be >= 1, got {args.max_bytes:,}")


def train_cli(args):
    """tokenizer.py's work for parsed flags; returns the report's text. --out is locked before the input is read
    (files.directory_lock: a second tokenizer.py there, or a directory that cannot be written, fails at once), and
    each file is written whole or not at all (files.atomic_write: a full disk keeps the tokenizer that was there)."""
    check_flags(args)
    out = Path(args.out)
    with directory_lock(out, "tokenizer.py"):
        tok, held_out, learned = learn(args)
        bpe.save_tokenizer(out, tokenizer_json=tok.to_str(pretty=True))  # + tokenizer_config.json, for AutoTokenizer
        return report(args, out, tok, held_out, learned)


def learn(args):
    """(the trained tokenizers.Tokenizer, the held-out text, {"bytes", "docs", "seconds", ...}: what it learned from
    and how long it took); TokenizerError where the input is unreadable or leaves nothing to learn from."""
    try:
        describe, texts, _, _, _ = resolve_source(Corpus(args.input, args.dataset, args.text_key))
        files, key = describe.get("files"), args.text_key
        val = held_out("--val_input", args.val_input, key, files) if args.val_input else None
        test = held_out("--test_input", args.test_input, key, files, [val] if val else []) if args.test_input else None
        texts = without_held_out(describe, texts, key, [s for s in (val, test) if s])  # never learned from
        valid = (bpe.replace_surrogates(text) for text in non_empty(texts()))  # as prepare_data.py's encoders do
        if val:  # its documents, as prepare_data.py --val_input's val shard; all of the input learned
            held_out_text, rest = "\n".join(map(bpe.replace_surrogates, val.texts())), valid
        else:
            held_out_text, rest = split_held_out(valid, args.held_out_bytes)
        learned = {"bytes": 0, "docs": 0, "runs_cut": 0, "stopped": None}

        def limited():
            for text in rest:
                size = len(text.encode("utf-8"))
                if args.max_bytes is not None and learned["bytes"] + size > args.max_bytes:
                    learned["stopped"] = size
                    return
                learned["bytes"] += size
                learned["docs"] += 1
                pieces, runs = cut_long_runs(text)
                learned["runs_cut"] += runs
                yield from pieces

        start = time.perf_counter()
        tok = train(limited(), args.vocab_size, progress=not args.no_progress, chat_tokens=args.chat_tokens)
        learned["seconds"] = time.perf_counter() - start
    except HeldOutError:
        raise
    except PrepError as e:
        raise TokenizerError(str(e)) from None
    if learned["bytes"] == 0:
        raise TokenizerError(nothing_learned(args, held_out_text, learned["stopped"]))
    if learned["runs_cut"]:
        log(
            f"{learned['runs_cut']:,} run(s) of over {MAX_RUN:,} characters without whitespace (or of whitespace) "
            f"cut into {MAX_RUN:,}-character pieces for training",
            note=True,
        )
    return tok, held_out_text, learned


def report(args, out, tok, held_out, learned):
    """The report's lines, and out/report.json where text was held out to measure it on."""
    ours = bpe.open_tokenizer(out)
    seconds = learned["seconds"]
    speed = learned["bytes"] / 1e6 / max(seconds, 1e-9)
    fewer = (
        f" (asked for {args.vocab_size:,}: no pair of tokens left that occurs twice in the text)"
        if tok.get_vocab_size() < args.vocab_size
        else ""
    )
    lines = [
        f"tokenizer.py: {tok.get_vocab_size():,} ids learned from {learned['bytes'] / 1e6:,.1f} MB "
        f"({learned['docs']:,} documents) in {seconds:.1f} s ({speed:.1f} MB/s) -> {out / 'tokenizer.json'} "
        f"({ours.id}){fewer}"
    ]
    if held_out:
        mine, mine_speed = compression(ours, held_out)
        gpt2, gpt2_speed = compression(assets.get_tokenizer(), held_out)
        size = len(held_out.encode("utf-8"))
        lines.append(
            f"held-out {size:,} bytes: {mine:.3f} bytes/token ({ours.n_vocab:,} ids) vs GPT-2 {gpt2:.3f} "
            f"(50,257 ids), {gpt2 / mine - 1:+.1%} tokens for the same text; encoding {mine_speed:.1f} MB/s vs "
            f"GPT-2's {gpt2_speed:.1f} MB/s (one process)"
        )
        numbers = {
            "vocab_size": ours.n_vocab,
            "held_out_bytes": size,
            "bytes_per_token": mine,
            "gpt2_bytes_per_token": gpt2,
            "train_seconds": seconds,
            "train_bytes": learned["bytes"],
        }
        atomic_write(out / "report.json", json.dumps(numbers, indent=1) + "\n")
    return "\n".join(lines)


def nothing_learned(args, held_out, stopped):
    """The one line for an input that left no text to learn from, naming the flag to change."""
    if stopped is not None:
        return (
            f"--max_bytes {args.max_bytes:,} is smaller than the first document after the held-out text "
            f"({stopped:,} bytes): nothing to learn from; raise --max_bytes"
        )
    if not held_out or args.val_input:
        return "the input holds no text"
    return (
        f"no text left to learn from after the first {len(held_out.encode('utf-8')):,} bytes, held out "
        f"(--held_out_bytes); lower --held_out_bytes or give more text"
    )


if __name__ == "__main__":
    main()
