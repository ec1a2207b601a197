"""The texts prepare_data.py and tokenizer.py read: files (.txt, .jsonl, .parquet), Hugging Face datasets and the
ready-made dataset presets; and the command that prepares a data directory (train.py names it when data is missing).

resolve_source(Corpus(inputs, dataset, ...)) is the one entry: local files (expand_inputs: a .txt file is one
document, a .jsonl file one per line, a .parquet file one per row; directories are searched recursively) or a dataset
(a preset of PRESETS or any Hugging Face dataset path), as an iterator of texts beside what a manifest records of the
input.
val_source and val_first read --val_input, a validation split of the user's own files (prepare_data.py's val shard,
tokenizer.py's held-out text).
Reading texts needs no torch and no tokenizer, so neither is imported here.
"""

import glob
import itertools
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from gpt2train.assets import fetch_shakespeare
from gpt2train.console import log
from gpt2train.files import first_line

TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")

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
    """Input files, in argument order: plain files as given; directories (searched recursively)
    and globs contribute their .txt/.jsonl/.parquet files in sorted order. The other files they
    hold are skipped, and a line names them (a README.md in a folder of books is not read)."""
    files, skipped = [], []
    for pattern in patterns:
        if any(c in pattern for c in "*?["):
            matches = sorted(glob.glob(pattern, recursive=True))
        else:
            matches = [pattern] if os.path.exists(pattern) else []
        found = []
        for m in map(Path, matches):
            if m.is_dir():
                under = sorted(p for p in m.rglob("*") if p.is_file())
                found += [p for p in under if p.suffix in TEXT_SUFFIXES]
                skipped += [p for p in under if p.suffix not in TEXT_SUFFIXES]
            elif m.suffix in TEXT_SUFFIXES:
                found.append(m)
            elif m.is_file() and m == Path(pattern):
                raise PrepError(f"{m}: unsupported input type {m.suffix!r} (expected .txt, .jsonl or .parquet)")
            elif m.is_file():
                skipped.append(m)
        if not found:
            raise PrepError(
                f"no input files matched {pattern!r} (expected .txt, .jsonl or .parquet files, directories or globs)"
            )
        files += found
    if skipped:
        skipped = list(dict.fromkeys(skipped))
        names = ", ".join(map(str, skipped[:5])) + (f" and {len(skipped) - 5} more" if len(skipped) > 5 else "")
        log(f"prepare_data: skipped {len(skipped)} file(s) that are not .txt, .jsonl or .parquet: {names}", note=True)
    return list(dict.fromkeys(files))  # drop repeats, keep order


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
            if path.suffix == ".txt":
                yield path.read_text(encoding="utf-8")
            elif path.suffix == ".jsonl":
                yield from _jsonl_documents(path, text_key)
            else:
                yield from _parquet_documents(path, text_key)
        except PrepError:
            raise
        except Exception as e:  # OSError, UnicodeDecodeError, pyarrow errors: all mean "cannot read this file"
            raise PrepError(f"{path}: cannot read ({first_line(e)})") from None


def count_documents(files):
    """Number of documents in the files (jsonl: its lines), for the progress bar's ETA."""
    total = 0
    for path in files:
        try:
            if path.suffix == ".txt":
                total += 1
            elif path.suffix == ".jsonl":
                with open(path, "rb") as f:
                    total += sum(block.count(b"\n") for block in iter(lambda: f.read(1 << 24), b""))
            else:
                import pyarrow.parquet as pq

                total += pq.ParquetFile(path).metadata.num_rows
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


def val_files(val_input, input_files=None):
    """--val_input's files (files, directories or globs, as --input takes them); a one-line PrepError naming
    --val_input where they match nothing or hold a file of --input (input_files: describe_files' "files" of
    --input), which would then be trained on too."""
    try:
        files = expand_inputs(val_input)
    except PrepError as e:
        raise PrepError(f"--val_input: {e}") from None
    both = {str(p.resolve()) for p in files} & {p for p, *_ in input_files or []}
    if both:
        raise PrepError(f"--val_input {min(both)} is also an --input file; hold it out of --input")
    return files


def val_source(val_input, text_key, input_files=None):
    """--val_input's documents: (what a manifest records of its files, a factory of their documents with text, how
    many there are); a one-line PrepError naming --val_input for files that hold no text (and as val_files)."""
    files = val_files(val_input, input_files)
    try:
        count = sum(1 for _ in non_empty(file_documents(files, text_key)))
    except PrepError as e:
        raise PrepError(f"--val_input: {e}") from None
    if not count:
        raise PrepError(f"--val_input {' '.join(val_input)}: no documents with text (validation needs at least one)")
    return describe_files(files, text_key), lambda: non_empty(file_documents(files, text_key)), count


def val_first(val_input, text_key, describe, texts, count):
    """prepare_data.py's stream with --val_input (val_source's documents first, then the input's: describe, texts
    and count as resolve_source gives them): (what a manifest records of --val_input, the stream's texts and count
    factories (None where the input's count is unknown), the number of --val_input's documents)."""
    val_describe, val_texts, val_docs = val_source(val_input, text_key, describe.get("files"))

    def total():
        n = count()
        return None if n is None else n + val_docs

    return val_describe, (lambda: itertools.chain(val_texts(), texts())), total, val_docs


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
    describe = {
        "hf": hf["hf_path"],
        "config": hf["config"],
        "split": hf["split"],
        "revision": hf["revision"],
        "text_key": text_key,
    }
    loaded = {}

    def texts():
        loaded["texts"], loaded["total"] = hf_documents(**hf, text_key=text_key)
        return loaded["texts"]

    return describe, texts, lambda: loaded.get("total"), preset, dataset.split("/")[-1]
