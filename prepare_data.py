"""Tokenize text into llm.c-format shards for training (format: see gpt2train/shards.py).

    python prepare_data.py --dataset shakespeare
    python prepare_data.py --dataset fineweb-edu --num_proc 16
    python prepare_data.py --input books/ notes/*.jsonl --out_dir data/mine --val_tokens 100000
    python prepare_data.py --input books/ --tokenizer tok/mine --out_dir data/mine   # your tokenizer (tokenizer.py)
    python prepare_data.py --input train.jsonl --val_input val.jsonl --test_input test.jsonl --out_dir data/mine

Writes out_dir/<name>_val_000000.bin (the start of the input: the fewest whole documents holding
--val_tokens tokens, by default 10% of the input and at most 1M; a document that would more than
double that is cut at --val_tokens, so one long text splits 90/10 as in nanoGPT; with --val_input, exactly the
documents of those files, and --input all goes to train), then
<name>_train_000000.bin, <name>_train_000001.bin, ... of --shard_tokens tokens each (the last one
shorter; a document may continue into the next shard), and <name>_manifest.json, which records the
input, the settings and every finished shard (its size, sha256 and where in the document stream it
starts and ends). A re-run verifies the finished shards, skips them and tokenizes only what is
missing; a directory holding <name> shards from another input or settings is refused. --test_input: a test split,
<name>_test_000000.bin, exactly those files' documents, which training never reads (evaluate.py --split test). A
held-out document (--val_input's, --test_input's) that --input holds too, by path or by content, is refused (exit 2).

Documents: a .jsonl file has one per line (field --text_key), a .parquet file one per row (column --text_key), any
other UTF-8 file (.txt, .py, .md, ...) is one document; a binary file named alone is refused. Directories are
searched recursively (sorted, hidden files and folders left out, binary files skipped with a note).
The shakespeare preset splits Tiny Shakespeare at blank lines, so each speech is one document.

--tokenizer: gpt2 (default, tiktoken) or a Hugging Face tokenizer.json / a directory holding one (tokenizer.py's
output, a Pythia model directory). Each document is preceded by that tokenizer's <|endoftext|>. The manifest records
the tokenizer (tokenizer_record: its content hash and size) and a copy of its file is kept beside the shards as
<name>_tokenizer.json, so that train.py takes the vocabulary from the data and puts the tokenizer in its checkpoints.

--format sft: supervised fine-tuning data (jsonl of prompt/completion or chat messages) -> token shards
plus loss-mask shards of whole conversations (rows built at load time, for any block_size), with GPT-2's tokenizer
or a --tokenizer that has the chat tokens (tokenizer.py --chat_tokens); see gpt2train/sft_shards.py and docs/sft.md.
"""

import argparse
import contextlib
import multiprocessing
import os
import re
import signal
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gpt2train.bpe import open_tokenizer, tokenizer_record
from gpt2train.console import log, progress_bar
from gpt2train.documents import (
    PRESETS,
    Corpus,
    HeldOutError,
    PrepError,
    held_out,
    non_empty,
    resolve_source,
    val_first,
    without_held_out,
)
from gpt2train.files import error_message, file_sha256, report_error
from gpt2train.manifests import keep_tokenizer, locked, remove_stale_temp_files, resumable_manifest, write_manifest
from gpt2train.sft_shards import prepare_sft
from gpt2train.shards import DEFAULT_SHARD_TOKENS, SPLITS, as_uint16, write_shard

VAL_SHARE = 0.1  # default validation split: the first 10% of the input, like nanoGPT's 90/10 ...
DEFAULT_VAL_TOKENS = 1_000_000  # ... and at most this many tokens (1M tokens estimate a val loss well enough)


# ---------------------------------------------------------------------------- tokenizing


def tokenize_batch(texts, tokenizer="gpt2"):
    """Pool worker: documents -> (uint16 tokens with EOT before each document, tokens per document).

    A module-level function so that it pickles under the spawn start method; each process builds
    the tokenizer once (open_tokenizer is cached). encode_to_numpy with no special tokens encodes
    exactly like encode_ordinary (which encode_ordinary_batch runs in a thread pool), but hands back
    a buffer instead of a list of Python ints. `tokenizer`: 'gpt2' or a tokenizer.json path
    (bpe.HFTokenizer.encode_to_numpy: a tiktoken translation of the file where one encodes alike).
    """
    enc = open_tokenizer(tokenizer)
    eot = np.array([enc.eot_token], dtype=np.uint32)
    gpt2 = tokenizer == "gpt2"
    parts, lengths = [], np.empty(len(texts), dtype=np.int64)
    for i, text in enumerate(texts):
        try:
            ids = enc.encode_to_numpy(text, disallowed_special=()) if gpt2 else enc.encode_to_numpy(text)
        except (UnicodeEncodeError, AttributeError):  # lone surrogates (encode_ordinary repairs them); tiktoken < 0.8
            ids = np.array(enc.encode_ordinary(text), dtype=np.uint32)
        parts += (eot, ids)
        lengths[i] = len(ids) + 1
    return as_uint16(np.concatenate(parts), f"tokenizer {tokenizer}"), lengths


def ignore_interrupts():
    """Pool worker initializer. A Ctrl-C reaches every process of the terminal's foreground group: the main process
    handles it (the pool's `with` terminates the workers, main() prints one line); a worker that raised
    KeyboardInterrupt would print a traceback and leave the pool waiting for its task forever."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def document_batches(texts, batch_chars, start_doc):
    """(index of first document, texts) batches of about batch_chars characters each, skipping the
    documents before start_doc (already in finished shards) without tokenizing them."""
    batch, chars, first = [], 0, start_doc
    for i, text in enumerate(texts):
        if i < start_doc:
            continue
        batch.append(text)
        chars += len(text)
        if chars >= batch_chars:
            yield first, batch
            batch, chars, first = [], 0, i + 1
    if batch:
        yield first, batch


def tokenized(batches, pool, max_pending, tokenizer="gpt2"):
    """(first document, tokens, lengths) per batch, in input order; pool None tokenizes in-process.

    apply_async with a bounded queue instead of Pool.imap: imap's feeder thread reads the whole
    input ahead of the workers, which for a streamed 10B-token dataset means unbounded memory.
    """
    if pool is None:
        for first, texts in batches:
            yield (first, *tokenize_batch(texts, tokenizer))
        return
    pending = deque()
    for first, texts in batches:
        pending.append((first, pool.apply_async(tokenize_batch, (texts, tokenizer))))
        if len(pending) >= max_pending:
            first, result = pending.popleft()
            yield (first, *result.get())
    while pending:
        first, result = pending.popleft()
        yield (first, *result.get())


# ---------------------------------------------------------------------------- shards


class ShardWriter:
    """Cuts the stream of tokenized documents into the val shard and the train shards.

    A stream position is [document index, token offset inside that document's tokens]; each shard
    record keeps where it starts and ends, so a re-run can resume right after the last good shard.
    The val shard is the start of the stream (split_val); val_tokens None means VAL_SHARE of the
    input, at most DEFAULT_VAL_TOKENS, so the writer holds up to DEFAULT_VAL_TOKENS / VAL_SHARE
    tokens before it knows whether the input is smaller than that. val_docs (--val_input): the val shard is exactly
    the stream's first val_docs documents, whatever their size.
    """

    def __init__(self, out_dir, name, shard_tokens, val_tokens, manifest, val_docs=None):
        self.out_dir, self.name = out_dir, name
        self.shard_tokens, self.val_tokens, self.val_docs = shard_tokens, val_tokens, val_docs
        self.manifest = manifest
        self.records = manifest["shards"]  # finished shards, val first
        self.held, self.held_count = [], 0  # (first document, tokens, lengths) batches before the val split
        self.buffer = np.empty(shard_tokens, dtype=np.uint16)
        self.fill = 0
        self.start = self.records[-1]["end"] if self.records else [0, 0]  # stream position of buffer[0]
        self.tokens_added = 0

    @property
    def in_val(self):
        return not self.records

    def add(self, first_doc, tokens, lengths):
        """Tokens of documents first_doc, first_doc+1, ...; leading tokens before self.start
        (a resumed run's first, partly written document) are skipped."""
        skip = self.start[1] if first_doc == self.start[0] else 0
        self.tokens_added += len(tokens) - skip
        if not self.in_val:
            self._add_train(first_doc, tokens, lengths, skip)
            return
        self.held.append((first_doc, tokens, lengths))  # a val split starts at [0, 0]: nothing to skip
        self.held_count += len(tokens)
        if self.val_docs and first_doc + len(lengths) >= self.val_docs:
            self._split_val(None)
        elif not self.val_docs and self.held_count >= (self.val_tokens or DEFAULT_VAL_TOKENS / VAL_SHARE):
            self._split_val(self.val_tokens or DEFAULT_VAL_TOKENS)

    def _split_val(self, target):
        """Write the val shard from the held batches: the fewest whole documents holding `target` tokens, or
        exactly `target` tokens where the document that crosses it would more than double the split (a long
        document: a book, a one-file corpus, which would otherwise go to val whole); the rest goes on to train."""
        first_doc = self.held[0][0]
        tokens = np.concatenate([t for _, t, _ in self.held])
        lengths = np.concatenate([n for _, _, n in self.held])
        self.held = []
        target = int(lengths[: self.val_docs].sum()) if self.val_docs else target  # --val_input's, whole
        ends = np.cumsum(lengths)
        k = int(np.searchsorted(ends, target, side="left"))  # the document in which the target-th token lies
        if ends[k] <= 2 * target:
            cut, end = int(ends[k]), [first_doc + k + 1, 0]
        else:
            cut, end = target, [first_doc + k, int(target - (ends[k - 1] if k else 0))]
        self._write("val", tokens[:cut], [0, 0], end)
        self._add_train(first_doc, tokens, lengths, cut)

    def _add_train(self, first_doc, tokens, lengths, pos):
        """Append tokens[pos:] (of documents first_doc, ...) to the train shards, writing each one that fills."""
        ends = np.cumsum(lengths)  # token position just after each document

        def position(pos):
            i = int(np.searchsorted(ends, pos, side="right"))
            return [first_doc + i, int(pos - (ends[i - 1] if i else 0))]

        while pos < len(tokens):
            n = min(len(tokens) - pos, self.shard_tokens - self.fill)
            self.buffer[self.fill : self.fill + n] = tokens[pos : pos + n]
            self.fill, pos = self.fill + n, pos + n
            if self.fill == self.shard_tokens:
                self._write_train(position(pos))

    def finish(self, num_docs):
        if self.in_val:  # the whole input is held: now its size is known
            if self.val_tokens and self.held_count <= self.val_tokens:
                raise PrepError(
                    f"the whole input ({num_docs} documents, {self.held_count} tokens) is not larger than "
                    f"--val_tokens {self.val_tokens}, leaving nothing to train on; lower --val_tokens"
                )
            self._split_val(self.val_tokens or max(1, round(VAL_SHARE * self.held_count)))
        if self.fill:
            self._write_train([num_docs, 0])
        if len(self.records) < 2:
            raise PrepError(
                f"no tokens left for training: the validation split took all {self.records[0]['tokens']} "
                f"tokens of the input"
                + ("; lower --val_tokens" if self.val_tokens else "; add text" + " to --input" * bool(self.val_docs))
            )

    def write_test(self, tokens, num_docs):
        """The test shard (--test_input's documents, tokenized), after the train shards; its place in the stream is
        the stream's end, [num_docs, 0], which a resumed run starts from."""
        self._write("test", tokens, [num_docs, 0], [num_docs, 0])

    def _write_train(self, end):
        self._write("train", self.buffer[: self.fill], self.start, end)
        self.fill = 0

    def _write(self, split, tokens, start, end):
        index = sum(r["split"] == split for r in self.records) if split == "train" else 0
        path = self.out_dir / f"{self.name}_{split}_{index:06d}.bin"
        write_shard(path, tokens)
        self.records.append(
            {
                "file": path.name,
                "split": split,
                "tokens": int(len(tokens)),
                "max_token": int(tokens.max()),
                "sha256": file_sha256(path),
                "start": list(start),
                "end": list(end),
            }
        )
        self.start = list(end)
        write_manifest(self.out_dir / f"{self.name}_manifest.json", self.manifest)


# ---------------------------------------------------------------------------- main


@dataclass(frozen=True)
class TextPrep:
    """What prepare() writes, resolved once from the flags, the preset and the input."""

    tokenizer: str  # what tokenize_batch takes: 'gpt2' or a tokenizer.json path
    record: dict  # bpe.tokenizer_record of it
    texts: Callable  # () -> the stream's texts (--val_input's documents first)
    count: Callable  # () -> how many documents the stream holds, or None where unknown
    out_dir: Path
    name: str  # the shards' name prefix
    shard_tokens: int
    val_tokens: int | None  # None: VAL_SHARE of the input, at most DEFAULT_VAL_TOKENS
    val_docs: int | None  # --val_input's documents, the val shard's whole; None without it
    test: object  # documents.HeldOut of --test_input: the test shard, which no training run reads; or None
    num_proc: int
    settings: dict  # what the manifest records: a re-run with the same fingerprint continues the shards


def plan(args):
    """The TextPrep of prepare_data.py's flags; PrepError for a bad --tokenizer (before anything is read), input or
    setting."""
    tokenizer, record = resolve_tokenizer(args.tokenizer)  # a bad --tokenizer fails before anything is read
    corpus = Corpus(
        args.input, args.dataset, args.text_key, args.dataset_config, args.split, args.revision, args.streaming
    )
    describe, texts, count, preset, default_name = resolve_source(corpus)
    if args.val_input and args.val_tokens is not None:
        raise PrepError("give --val_input or --val_tokens, not both: the validation split is --val_input's")
    files, key = describe.get("files"), args.text_key
    val = held_out("--val_input", args.val_input, key, files) if args.val_input else None
    test = held_out("--test_input", args.test_input, key, files, [val] if val else []) if args.test_input else None
    texts = without_held_out(describe, texts, key, [s for s in (val, test) if s])  # HeldOutError: in --input too
    if val:  # the val documents first in the stream; ShardWriter cuts the val shard after them
        texts, count = val_first(val, texts, count)
    name = re.sub(r"[^A-Za-z0-9]+", "_", args.name or default_name).strip("_") or "data"
    out_dir = Path(
        args.out_dir or Path("data") / (args.dataset if args.dataset in PRESETS else name)
    )  # data/fineweb-edu
    shard_tokens = preset.get("shard_tokens", DEFAULT_SHARD_TOKENS) if args.shard_tokens is None else args.shard_tokens
    val_tokens = preset.get("val_tokens") if args.val_tokens is None and not args.val_input else args.val_tokens
    num_proc = (os.cpu_count() or 1) if args.num_proc is None else args.num_proc
    batch_chars = args.batch_chars
    if min(shard_tokens, 1 if val_tokens is None else val_tokens, num_proc, batch_chars) < 1 or shard_tokens >= 2**31:
        raise PrepError(
            f"--shard_tokens (below 2^31), --val_tokens, --num_proc and --batch_chars must be >= 1, got "
            f"{shard_tokens}, {val_tokens}, {num_proc}, {batch_chars}"
        )
    settings = {
        "format": "llm.c uint16 shards v1",
        "tokenizer": record["id"],
        "input": describe,
        "shard_tokens": shard_tokens,
        "val_tokens": val_tokens or {"share": VAL_SHARE, "max": DEFAULT_VAL_TOKENS},
    }
    if val:  # recorded only then: the settings (fingerprint) of a run without it are unchanged
        settings.update(val_tokens={"documents": val.count}, val_input=val.describe)
    if test:
        settings.update(test_input=test.describe)
    val_docs = val and val.count
    return TextPrep(
        tokenizer, record, texts, count, out_dir, name, shard_tokens, val_tokens, val_docs, test, num_proc, settings
    )


def prepare(args):
    """Tokenize the input into shards (see the module docstring); args: prepare_data.py's flags for --format text
    (arg_parser().parse_args([...])). Returns a summary dict."""
    job = plan(args)
    t0 = time.time()  # after fetching the shakespeare file, if that was needed
    out_dir, name = job.out_dir, job.name
    with locked(out_dir):
        remove_stale_temp_files(out_dir, name)
        manifest_path = out_dir / f"{name}_manifest.json"
        manifest, existing = resumable_manifest(out_dir, name, manifest_path, job.settings)
        manifest["tokenizer"] = keep_tokenizer(out_dir, name, job.record)
        writer = ShardWriter(out_dir, name, job.shard_tokens, job.val_tokens, manifest, job.val_docs)
        if not manifest["complete"]:
            num_docs = tokenize_into(writer, job, args, t0)
            if num_docs == 0:
                raise PrepError("no documents with text in the input (all empty)")
            writer.finish(num_docs)
            if job.test and not any(r["split"] == "test" for r in manifest["shards"]):  # after train: resumes alike
                writer.write_test(tokenize_batch(list(job.test.texts()), job.tokenizer)[0], num_docs)
            manifest.update(complete=True, documents=num_docs, tokens=sum(r["tokens"] for r in manifest["shards"]))
            write_manifest(manifest_path, manifest)
        keep = {r["file"] for r in manifest["shards"]}
        for stale in set(existing) - keep:  # our shards from an earlier, longer run with the same input
            (out_dir / stale).unlink()

        seconds = time.time() - t0
        records = manifest["shards"]
        return {
            "out_dir": str(out_dir),
            "name": name,
            "documents": manifest["documents"],
            "tokens": manifest["tokens"],
            **{f"{split}_tokens": sum(r["tokens"] for r in records if r["split"] == split) for split in SPLITS},
            "shards": len(records),
            "tokenized": writer.tokens_added,
            "seconds": seconds,
            "tokens_per_s": writer.tokens_added / seconds,
            "tokenizer": job.record["id"],
        }


def tokenize_into(writer, job, args, t0):
    """Tokenize the documents the writer still needs (a resumed run skips those of its finished shards) in
    job.num_proc processes (args: --start_method, --batch_chars, --no_progress), adding them to the writer in input
    order; returns the number of documents in the stream."""
    num_docs, num_proc = writer.start[0], job.num_proc
    if writer.records:
        log(f"prepare_data: {len(writer.records)} finished shards verified; resuming at document {num_docs}")
    open_tokenizer(job.tokenizer).encode_to_numpy("")  # fails early; forked workers inherit it ready-made
    # The pool starts before anything else starts threads (tqdm's monitor, datasets' downloads):
    # fork + threads can deadlock.
    pool = multiprocessing.get_context(args.start_method).Pool(num_proc, ignore_interrupts) if num_proc > 1 else None
    with pool or contextlib.nullcontext():
        batches = document_batches(non_empty(job.texts()), args.batch_chars, start_doc=writer.start[0])
        bar = progress_bar(
            total=job.count(),
            initial=num_docs,
            unit="doc",
            show=not args.no_progress,
            desc=f"tokenizing ({num_proc} proc)",
        )
        for first, tokens, lengths in tokenized(batches, pool, max_pending=4 * num_proc, tokenizer=job.tokenizer):
            writer.add(first, tokens, lengths)
            num_docs = first + len(lengths)
            bar.update(len(lengths))
            bar.set_postfix_str(f"{writer.tokens_added / max(time.time() - t0, 1e-9) / 1e6:.2f}M tok/s", refresh=False)
        bar.close()
    return num_docs


def resolve_tokenizer(spec):
    """(what tokenize_batch takes: 'gpt2' or a tokenizer.json path, bpe.tokenizer_record of it) for --tokenizer;
    PrepError for a tokenizer the shards cannot hold (no <|endoftext|>, over 65,536 ids) or that cannot be read."""
    try:
        enc = open_tokenizer(str(spec))
    except (ValueError, ImportError) as e:
        raise PrepError(str(e)) from None
    path = "gpt2" if getattr(enc, "id", "gpt2") == "gpt2" else str(Path(enc.name).resolve())
    record = tokenizer_record(enc, source=None if path == "gpt2" else path)
    if enc.eot_token is None:
        raise PrepError(f"tokenizer {spec} has no <|endoftext|> token, which separates the documents of the shards")
    if enc.n_vocab > 2**16:  # its largest id + 1: a tokenizer.json may number its tokens with gaps
        high = sorted((i, token) for token, i in enc.vocab().items() if i >= 2**16)
        raise PrepError(
            f"tokenizer {spec}: token {high[0][1]!r} has id {high[0][0]:,} ({len(high):,} ids of 65,536 or more): "
            f"the shards store ids as uint16, 0 to 65,535; renumber its vocabulary below 65,536"
        )
    return path, record


def arg_parser():
    """prepare_data.py's flags."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--input",
        nargs="+",
        metavar="PATH",
        help="text files (any UTF-8: a document each), .jsonl, .parquet, dirs or globs",
    )
    p.add_argument("--dataset", metavar="NAME", help=f"preset ({', '.join(PRESETS)}) or a Hugging Face dataset path")
    p.add_argument("--dataset_config", help="Hugging Face dataset configuration (subset) name")
    p.add_argument("--split", help="Hugging Face split to read (default train)")
    p.add_argument("--revision", help="Hugging Face dataset revision")
    p.add_argument(
        "--streaming",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="stream the Hugging Face dataset instead of downloading it first (default: preset's, else on)",
    )
    p.add_argument("--text_key", default="text", help="jsonl field / parquet or dataset column holding the text")
    p.add_argument("--out_dir", help="output directory (default data/<preset> or data/<name>)")
    p.add_argument("--name", help="shard name prefix (default: the preset, dataset or single input's name)")
    p.add_argument("--shard_tokens", type=int, help=f"tokens per train shard (default {DEFAULT_SHARD_TOKENS:,})")
    p.add_argument(
        "--val_tokens",
        type=int,
        help=f"validation tokens, taken from the start in whole documents (a long one is cut) "
        f"(default {VAL_SHARE:.0%}% of the input, at most {DEFAULT_VAL_TOKENS:,}; presets differ)",
    )
    p.add_argument(
        "--val_input",
        nargs="+",
        metavar="PATH",
        help="the validation split is exactly these files' documents (as --input takes them), "
        "the train shards --input's; instead of --val_tokens (give tokenizer.py the same --val_input)",
    )
    p.add_argument(
        "--test_input",
        nargs="+",
        metavar="PATH",
        help="a test split of these files' documents, <name>_test_000000.bin, which training never reads (evaluate.py "
        "--split test scores a checkpoint on it; give tokenizer.py the same --test_input)",
    )
    p.add_argument("--num_proc", type=int, help="tokenizer processes (default: all CPUs)")
    p.add_argument(
        "--start_method",
        choices=multiprocessing.get_all_start_methods(),
        help="multiprocessing start method (default: the platform's)",
    )
    p.add_argument("--batch_chars", type=int, default=1 << 18, help="characters of text per worker task")
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--tokenizer",
        default="gpt2",
        metavar="gpt2|PATH",
        help="gpt2 (default), a tokenizer.json, or a directory with one (tokenizer.py's --out, Pythia's)",
    )
    p.add_argument(
        "--format",
        choices=["text", "sft"],
        default="text",
        help="text: documents for pretraining; sft: prompt/completion or chat jsonl -> tokens + loss masks",
    )
    p.add_argument(
        "--block_size",
        type=int,
        help="--format sft: report the conversations a run at this block_size "
        "leaves out (rows are built at load time, for any block_size)",
    )
    return p


def interrupted():
    """A Ctrl-C: one line and exit 130, as a shell reports it (the workers have stopped with the pool; the finished
    shards are kept, and a re-run continues after them)."""
    report_error("prepare_data.py", KeyboardInterrupt("interrupted; run the same command again to continue"))
    raise SystemExit(130) from None


def main(argv=None):
    p = arg_parser()
    args = p.parse_args(argv)
    sft = args.format == "sft"
    if sft and (args.dataset or not args.input):
        p.error("--format sft reads --input FILE.jsonl [...] (prompt/completion or messages lines)")
    if sft and args.test_input:
        p.error("--test_input is for --format text")
    try:
        s = prepare_sft(args, *resolve_tokenizer(args.tokenizer)) if sft else prepare(args)
    except HeldOutError as e:  # held-out documents also in --input: bad input
        print(error_message("prepare_data.py", e), file=sys.stderr)
        sys.exit(2)
    except (PrepError, OSError) as e:  # bad input or environment: one line (GPT2_TRACEBACK=1: the traceback)
        sys.exit(error_message("prepare_data.py", e))
    except KeyboardInterrupt:
        interrupted()
    print(sft_report(s) if sft else text_report(s))
    return s


def text_report(s):
    """prepare()'s summary in a line."""
    return (
        f"{s['documents']:,} documents, {s['tokens']:,} tokens ({s['val_tokens']:,} val + {s['train_tokens']:,} train"
        + (f"; {s['test_tokens']:,} test" if s["test_tokens"] else "")
        + f") in {s['shards']} shards"
        + (f", {s['seconds']:.1f} s, {s['tokens_per_s']:,.0f} tokens/s" if s["tokenized"] else ": already prepared")
        + f" -> {s['out_dir']}/{s['name']}_*.bin"
    )


def sft_report(s):
    """prepare_sft()'s summary in a line, after one naming the conversations too long for --block_size, if any."""
    line = (
        f"{s['conversations']:,} conversations ({s['val_conversations']:,} val, the longest {s['longest']:,} "
        f"tokens), {s['tokens']:,} tokens of which {s['trained_tokens']:,} trained, {s['shards']} shards"
        + (" (already prepared, verified)" if s["reused"] else f", {s['seconds']:.1f} s")
        + f" -> {s['out_dir']}/{s['name']}_*; rows are built at load time, for any block_size"
    )
    if not s["too_long"]:
        return line
    return (
        f"prepare_data: {'at least ' * s['too_long_at_least']}{s['too_long']} conversation(s) longer than "
        f"block_size+1 = {s['block_size'] + 1} tokens, "
        f"which training at block_size {s['block_size']} leaves out: "
        + ", ".join(s["too_long_lines"])
        + (", ..." if s["too_long"] > len(s["too_long_lines"]) else "")
        + f"; block_size >= {s['longest'] - 1} keeps them all\n{line}"
    )


if __name__ == "__main__":
    main()
