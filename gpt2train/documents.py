"""The texts prepare_data.py, tokenizer.py and evaluate.py --bpb read: files (text of any kind, .jsonl, .parquet),
Hugging Face datasets and the ready-made dataset presets; and the command that prepares a data directory (train.py
names it when data is missing).

resolve_source(Corpus(inputs, dataset, ...)) is the one entry: local files (expand_inputs: a .jsonl file has a
document per line, a .parquet file one per row, any other UTF-8 file (.txt, .py, .md, ...) is one document;
directories are searched recursively, hidden and binary files left out) or a dataset
(a preset of PRESETS or any Hugging Face dataset path), as an iterator of texts beside what a manifest records of the
input.
held_out reads --val_input and --test_input, the validation and test splits of the user's own files (prepare_data.py's
val and test shards, tokenizer.py's held-out text), without_held_out refuses input documents that are theirs, and
val_first puts the val documents at the start of prepare_data.py's stream.
Reading texts needs no torch and no tokenizer, so neither is imported here.
"""

import codecs
import glob
import hashlib
import itertools
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from gpt2train.assets import fetch_shakespeare
from gpt2train.console import log
from gpt2train.files import first_line

# Ready-made datasets. fineweb-edu follows build-nanogpt / llm.c: sample-10BT in 100M-token
# shards, the first shard validation. Hugging Face presets stream unless they are small.
PRESETS = {
    "shakespeare": dict(val_tokens=32_768),  # ~10% of its ~0.34M tokens, like nanoGPT's 90/10 split
    "fineweb-edu": dict(
        hf_path="HuggingFaceFW/fineweb-edu",
        hf_config="sample-10BT",
        split="train",
        streaming=True,
        shard_tokens=100_000_000,
        val_tokens=100_000_000,
    ),
    "tinystories": dict(hf_path="roneneldan/TinyStories", split="train", streaming=False, val_tokens=4_000_000),
    # The original repository is a loading script, which `datasets` >= 4 refuses; the hub's
    # automatic parquet conversion of it loads directly.
    "openwebtext": dict(
        hf_path="Skylion007/openwebtext",
        revision="refs/convert/parquet",
        split="train",
        streaming=True,
        val_tokens=4_000_000,
    ),
}


class PrepError(Exception):
    """A one-line problem with the input or output that the user must fix."""


@dataclass(frozen=True)
class Corpus:
    """What to read, as prepare_data.py's and tokenizer.py's flags name it: --input paths or a --dataset (a preset or
    a Hugging Face dataset path: its --dataset_config, --split, --revision and --streaming; None: the preset's or
    the dataset's default), and the --text_key of its jsonl fields / parquet or dataset columns."""

    inputs: list | None = None
    dataset: str | None = None
    text_key: str = "text"
    hf_config: str | None = None
    split: str | None = None
    revision: str | None = None
    streaming: bool | None = None


def prepare_command(data_dir):
    """The command that writes shards to data_dir, quoted for a message: a preset's when data_dir is named after
    one, else the one for your own files, and its form for conversations (SFT data)."""
    data_dir = Path(data_dir)
    if any(c in data_dir.name for c in "*?["):  # a glob of shards: they are prepared into its directory
        data_dir = data_dir.parent
    if data_dir.name in PRESETS:
        default = Path("data") / data_dir.name
        return f"`python prepare_data.py --dataset {data_dir.name}" + (
            "`" if data_dir == default else f" --out_dir {data_dir}`"
        )
    return (
        f"`python prepare_data.py --input YOUR_TEXT_FILES --out_dir {data_dir}` "
        f"(conversations to fine-tune on: add `--format sft`)"
    )


def split_speeches(text):
    """Tiny Shakespeare -> documents: one per speech (blocks separated by blank lines), stripped."""
    return [block.strip() for block in re.split(r"\n\s*\n", text) if block.strip()]


def expand_inputs(patterns):
    """Input files, in argument order: a file as given, whatever its kind (file_documents reads it by its suffix);
    a glob's matching files and directories in sorted order; a directory's files, recursively in sorted order, leaving
    out hidden ones (a name under it that starts with '.': .git, .venv) and binary ones (looks_binary; a .parquet
    file is read), which a note names."""
    files, skipped = [], []
    for pattern in patterns:
        globbed = any(c in pattern for c in "*?[")
        matches = (
            sorted(glob.glob(pattern, recursive=True)) if globbed else [pattern] if os.path.exists(pattern) else []
        )
        found = []
        for m in map(Path, matches):
            if m.is_dir():
                under = sorted(p for p in visible_files(m))
                binary = {p for p in under if p.suffix != ".parquet" and looks_binary(p)}
                found += [p for p in under if p not in binary]
                skipped += sorted(binary)
            elif m.is_file() or not globbed:  # a FIFO named alone is read, as `cat` would
                found.append(m)
        if not found and os.path.isdir(pattern):
            raise PrepError(f"{pattern}: a directory with no text files (hidden and binary ones are left out)")
        if not found:
            raise PrepError(f"no input files matched {pattern!r} (expected text files, directories or globs)")
        files += found
    if skipped:
        skipped = list(dict.fromkeys(skipped))
        names = ", ".join(map(str, skipped[:5])) + (f" and {len(skipped) - 5} more" if len(skipped) > 5 else "")
        log(f"skipped {len(skipped)} binary file(s) (NUL bytes or not UTF-8): {names}", note=True)
    return list(dict.fromkeys(files))  # drop repeats, keep order


def visible_files(directory):
    """The regular files under directory, recursively, but none whose name or folder's name starts with '.'."""
    for folder, subfolders, names in os.walk(directory):
        subfolders[:] = [d for d in subfolders if not d.startswith(".")]
        for name in names:
            path = Path(folder) / name
            if not name.startswith(".") and path.is_file():
                yield path


def looks_binary(path):
    """True for a file whose first 8 KiB hold a NUL byte or are not UTF-8 (a character cut at the end aside)."""
    try:
        with open(path, "rb") as f:
            head = f.read(8192)
    except OSError:
        return False  # file_documents names it when it reads it
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=len(head) < 8192)  # the whole file: no cut
    except UnicodeDecodeError:
        return True
    return b"\0" in head


def text_document(path):
    """A file that is one document: its UTF-8 text (newlines as Python reads text); PrepError naming a binary file."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise PrepError(
            f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at {e.start:,}): a binary file?"
        ) from None
    if "\0" in text:
        raise PrepError(f"{path}: holds NUL bytes: a binary file, not text")
    return text


def _jsonl_documents(path, text_key):
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise PrepError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict) or text_key not in row:
                raise PrepError(f"{path}:{lineno}: no {text_key!r} field (choose it with --text_key)")
            text = row[text_key]
            if text is not None and not isinstance(text, str):
                raise PrepError(f"{path}:{lineno}: {text_key!r} is a {type(text).__name__}, not a string")
            yield text


def _parquet_documents(path, text_key):
    import pyarrow.parquet as pq  # installed with `datasets`; only needed for parquet input

    parquet = pq.ParquetFile(path)
    if text_key not in parquet.schema_arrow.names:
        raise PrepError(
            f"{path}: no {text_key!r} column (columns: {', '.join(parquet.schema_arrow.names)}; use --text_key)"
        )
    for batch in parquet.iter_batches(columns=[text_key], batch_size=4096):
        yield from batch.column(0).to_pylist()


def file_documents(files, text_key):
    """Texts of all documents in the input files, in order; read errors name the file."""
    for path in files:
        try:
            if path.suffix == ".jsonl":
                yield from _jsonl_documents(path, text_key)
            elif path.suffix == ".parquet":
                yield from _parquet_documents(path, text_key)
            else:  # .txt, source code, any text: one document
                yield text_document(path)
        except PrepError:
            raise
        except Exception as e:  # OSError, UnicodeDecodeError, pyarrow errors: all mean "cannot read this file"
            raise PrepError(f"{path}: cannot read ({first_line(e)})") from None


def count_documents(files):
    """Number of documents in the files (jsonl: its lines), for the progress bar's ETA."""
    total = 0
    for path in files:
        try:
            if path.suffix == ".jsonl":
                with open(path, "rb") as f:
                    total += sum(block.count(b"\n") for block in iter(lambda: f.read(1 << 24), b""))
            elif path.suffix == ".parquet":
                import pyarrow.parquet as pq

                total += pq.ParquetFile(path).metadata.num_rows
            else:
                total += 1
        except Exception as e:
            raise PrepError(f"{path}: cannot read ({first_line(e)})") from None
    return total


def hf_documents(hf_path, config, split, revision, streaming, text_key):
    """(texts, number of rows or None) of a Hugging Face dataset."""
    import datasets  # imported here: local inputs need no `datasets`

    ds = datasets.load_dataset(hf_path, name=config, split=split, revision=revision, streaming=streaming)
    try:
        total = len(ds) if not streaming else ds.info.splits[split].num_examples
    except Exception:  # streaming datasets may not know their size
        total = None

    def texts():
        for row in ds:
            if text_key not in row:
                raise PrepError(
                    f"{hf_path}: rows have no {text_key!r} column (columns: {', '.join(row)}; use --text_key)"
                )
            yield row[text_key]

    return texts(), total


def non_empty(texts):
    """Drop empty documents (they would be a lone EOT); anything but a string is an error."""
    for i, text in enumerate(texts):
        if text is None or text == "":
            continue
        if not isinstance(text, str):
            raise PrepError(f"document {i} is a {type(text).__name__}, not a string (check --text_key)")
        yield text


def describe_files(files, text_key):
    """What a manifest records of input files: each one's resolved path, size and modification time."""
    return {"files": [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files], "text_key": text_key}


class HeldOutError(PrepError):
    """Held-out documents (--val_input's, --test_input's) that --input holds too, which would then be trained on:
    bad input (exit 2)."""


def val_files(val_input, input_files=None, flag="--val_input"):
    """--val_input's files (files, directories or globs, as --input takes them; or --test_input's, `flag`); a
    one-line PrepError naming the flag where they match nothing, a HeldOutError where they hold a file of --input
    (input_files: describe_files' "files" of --input), which would then be trained on too."""
    try:
        files = expand_inputs(val_input)
    except PrepError as e:
        raise PrepError(f"{flag}: {e}") from None
    both = {str(p.resolve()) for p in files} & {p for p, *_ in input_files or []}
    if both:
        raise HeldOutError(f"{flag} {min(both)} is also an --input file; hold it out of --input")
    return files


def document_hash(text):
    """A held-out document's identity: the hash of its text (a copy of it elsewhere is the same document)."""
    return hashlib.blake2b(text.encode("utf-8", errors="surrogatepass"), digest_size=16).digest()


@dataclass(frozen=True)
class HeldOut:
    """A held-out split of the user's own files (--val_input, --test_input): held_out() reads it."""

    flag: str
    files: list
    describe: dict  # what a manifest records of its files
    texts: object  # () -> its documents with text
    count: int
    hashes: frozenset  # document_hash of each


def held_out(flag, patterns, text_key, input_files=None, before=()):
    """The HeldOut of --val_input's (or --test_input's: `flag`) files; a one-line PrepError naming the flag for files
    that hold no text (and as val_files, input_files: those of --input and of the held-out splits read `before`,
    each of which must share no document with it: HeldOutError)."""
    files = val_files(patterns, input_files, flag)
    texts = lambda: non_empty(file_documents(files, text_key))  # noqa: E731
    try:
        hashes = [document_hash(text) for text in texts()]
    except PrepError as e:
        raise PrepError(f"{flag}: {e}") from None
    if not hashes:
        raise PrepError(f"{flag} {' '.join(patterns)}: no documents with text (validation needs at least one)")
    split = HeldOut(flag, files, describe_files(files, text_key), texts, len(hashes), frozenset(hashes))
    for other in before:
        refuse_held_out(other.files, text_key, [split], flag=other.flag)
    return split


def refuse_held_out(files, text_key, splits, flag="--input"):
    """HeldOutError, one line naming the first of `files` (--input's) that holds documents of a held-out split (a
    copy of the val file under another name) and how many: they would be trained on, or learned from."""
    for path in files:
        try:
            found = [document_hash(text) for text in non_empty(file_documents([path], text_key))]
        except PrepError as e:
            raise PrepError(f"{flag}: {e}") from None
        for split in splits:
            n = sum(h in split.hashes for h in found)
            if n:
                raise HeldOutError(
                    f"{flag} {path} holds {n:,} of the {split.count:,} documents of {split.flag} (a copy of it?); "
                    f"hold them out of {flag}"
                )


def without_held_out(describe, texts, text_key, splits):
    """--input's texts factory (describe: what resolve_source records of it) after refusing documents of the held-out
    splits: input files now, in a pass over them (refuse_held_out); a dataset's as they stream, at the first one."""
    if not splits:
        return texts
    if "files" in describe:
        refuse_held_out([Path(p) for p, *_ in describe["files"]], text_key, splits)
        return texts

    def checked():
        for i, text in enumerate(texts()):
            split = next((s for s in splits if text and document_hash(text) in s.hashes), None)
            if split is not None:
                raise HeldOutError(f"document {i:,} of the dataset is one of {split.flag}'s; hold it out of --input")
            yield text

    return checked


def val_first(val, texts, count):
    """prepare_data.py's stream with --val_input (the HeldOut val's documents first, then the input's: texts and
    count as resolve_source gives them): the stream's texts and count factories (None where the input's count is
    unknown)."""

    def total():
        n = count()
        return None if n is None else n + val.count

    return (lambda: itertools.chain(val.texts(), texts())), total


def resolve_source(corpus):
    """-> (description for the manifest, texts iterator factory, documents total or None, preset dict, default name)
    of the Corpus to read."""
    inputs, dataset, text_key = corpus.inputs, corpus.dataset, corpus.text_key
    if bool(inputs) == bool(dataset):
        raise PrepError("give exactly one of --input PATH [PATH ...] or --dataset NAME")
    if inputs:
        files = expand_inputs(inputs)
        describe = describe_files(files, text_key)
        single = len(inputs) == 1 and not any(c in inputs[0] for c in "*?[")
        name = Path(inputs[0]).stem if single else "data"
        return describe, lambda: file_documents(files, text_key), lambda: count_documents(files), {}, name
    preset = PRESETS.get(dataset, {})
    if dataset == "shakespeare":
        path = Path(fetch_shakespeare())
        docs = split_speeches(path.read_text(encoding="utf-8"))
        describe = {"dataset": "shakespeare", "bytes": path.stat().st_size, "documents": "speeches"}
        return describe, lambda: iter(docs), lambda: len(docs), preset, "shakespeare"
    hf = dict(
        hf_path=preset.get("hf_path", dataset),
        config=corpus.hf_config or preset.get("hf_config"),
        split=corpus.split or preset.get("split", "train"),
        revision=corpus.revision or preset.get("revision"),
        streaming=preset.get("streaming", True) if corpus.streaming is None else corpus.streaming,
    )
    describe = {"hf": hf["hf_path"], **{k: hf[k] for k in ("config", "split", "revision")}, "text_key": text_key}
    loaded = {}

    def texts():
        loaded["texts"], loaded["total"] = hf_documents(**hf, text_key=text_key)
        return loaded["texts"]

    return describe, texts, lambda: loaded.get("total"), preset, dataset.split("/")[-1]
