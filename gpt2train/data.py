"""Token shards on disk and the loader that turns them into (x, y) training batches; a Mixture draws rows from
several prepared datasets by weight (data_dir "a:0.75,b:0.25", parse_mixture), one loader per source.

Shard format (llm.c's): a header of 256 little-endian int32 (magic 20240520, version 1, token
count, then zeros), followed by the tokens as little-endian uint16. Every document is preceded
by the end-of-text token 50256. prepare_data.py writes these; the loader also reads nanoGPT's
headerless uint16 `.bin` files and build-nanogpt's uint16 `.npy` shards.

Samples (rows of block_size+1 tokens: x = row[:-1], y = row[1:]) never cross a shard boundary. packing='window':
non-overlapping windows at stride block_size. packing='document': every row starts at a document start (or
continues a document longer than a row), whole documents packed best-fit into rows, the rest of a row padding
that is never a target (DocumentRows).

Loss masks (supervised fine-tuning, prepare_data.py --format sft): a shard X.bin may have a mask shard X.mask
beside it: the same llm.c header with magic MASK_MAGIC, version 1, the token count and 0 (the row length of
an older format, which packed rows at prep time), then one uint8 per token, 1 where that token is a trained
target. SFT data is always read as rows of whole conversations (packing='document'; a conversation longer
than a row is left out, counted and reported), and the loader yields y = -1 where the mask is 0.
"""

import bisect
import glob
import json
import math
import os
import re
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from gpt2train.assets import EOT
from gpt2train.console import log, progress_bar
from gpt2train.files import atomic_write, first_line, read_regular

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
SHARD_SUFFIXES = (".bin", ".npy")
MASK_MAGIC = 20240527
MASK_SUFFIX = ".mask"
PACKINGS = ("window", "document")
MAX_JSON_BYTES = 1 << 28  # a prep manifest or a tokenizer.json (tens of MB at most) is read whole


class ShardError(ValueError):
    """A shard file that cannot be used; the message names the file and what was expected."""


class NoShardsError(ShardError):
    """A data directory that does not exist or holds no shards of a split (not prepared yet?); data_dir: which."""

    def __init__(self, message, data_dir=None):
        super().__init__(message)
        self.data_dir = data_dir


def shard_header(num_tokens):
    """The 1024 header bytes of an llm.c shard holding num_tokens tokens."""
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (MAGIC, VERSION, num_tokens)
    return header.tobytes()


def write_shard(path, tokens):
    """Write tokens (any integer array, values < 65536) as an llm.c shard, atomically (files.atomic_write)."""
    path = Path(path)
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise ValueError(f"{path}: expected a 1-D integer token array, got {tokens.dtype} of shape {tokens.shape}")
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= 2**16):
        raise ValueError(f"{path}: token ids must lie in [0, 65535] to fit uint16")
    if tokens.size >= 2**31:
        raise ValueError(f"{path}: {tokens.size} tokens do not fit the int32 count of the header")

    def write(f):
        f.write(shard_header(tokens.size))
        f.write(np.ascontiguousarray(tokens, dtype="<u2").data)  # no extra copy when already uint16

    atomic_write(path, write)


def write_mask(path, mask):
    """Write a loss-mask shard (0/1 per token) atomically; see the module docstring."""
    mask = np.asarray(mask, dtype=np.uint8)
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (MASK_MAGIC, VERSION, mask.size)

    def write(f):
        f.write(header.tobytes())
        f.write(mask.data)

    atomic_write(Path(path), write)


def load_mask(path, num_tokens, record=None):
    """(the loss mask of a shard of num_tokens tokens, memory-mapped as uint8; its number of trained tokens).
    ShardError naming the file unless it is such a mask with only 0 and 1 and, when the prep's manifest
    `record` lists it, the trained-token count recorded there. Like token shards (check_shards_vocab), a mask
    not modified after its manifest was written is trusted to its record; any other is scanned."""
    path = Path(path)
    size = path.stat().st_size
    head = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    if len(head) < HEADER_INTS or head[0] != MASK_MAGIC or head[1] != VERSION:
        raise ShardError(f"{path}: not a loss-mask shard (expected magic {MASK_MAGIC}, version {VERSION})")
    count, row = int(head[2]), int(head[3])
    if row:
        raise ShardError(
            f"{path}: rows packed for block_size {row} by an older prepare_data.py; prepare the data "
            f"again with `prepare_data.py --format sft` (rows are now built at load time, any block_size)"
        )
    if count != num_tokens or size != HEADER_BYTES + count:
        raise ShardError(f"{path}: loss mask of {count} tokens ({size} bytes) for a token shard of {num_tokens} tokens")
    mask = np.memmap(path, dtype=np.uint8, mode="r", offset=HEADER_BYTES, shape=(count,)).view(np.ndarray)
    recorded = (record or {}).get("trained_tokens")
    if recorded is not None and os.stat(path).st_mtime_ns <= record["manifest_mtime_ns"]:
        return mask, int(recorded)
    top = int(mask.max())
    if top > 1:
        raise ShardError(
            f"{path}: loss-mask value {top} at token {int(np.argmax(mask > 1)):,} (a mask holds 0 and 1 "
            f"only); prepare the data again"
        )
    trained = int(mask.sum(dtype=np.int64))
    if recorded is not None and trained != recorded:
        raise ShardError(
            f"{path}: {trained:,} trained tokens, {record['manifest']} records {recorded:,}: the mask "
            f"changed after the prep; prepare the data again"
        )
    return mask, trained


def load_masks(paths, shards, records, data_dir):
    """[(mask, trained tokens)] of SFT data, a mask X.mask beside each shard X.bin (load_mask), or None for text
    data: no shard has a mask file and no manifest lists one. A missing mask is a ShardError naming it."""
    listed = [records.get(Path(p), {}).get("mask") for p in paths]
    masks = [Path(p).with_suffix(MASK_SUFFIX) for p in paths]
    have = [m.is_file() for m in masks]
    if not any(have) and not any(listed):
        return None
    for path, mask, there, name in zip(paths, masks, have, listed):
        if not there:
            why = f"{records[Path(path)]['manifest']} lists it" if name else f"other shards of {data_dir} have one"
            raise ShardError(f"{mask}: missing loss-mask shard ({why}); prepare the data again")
    return [load_mask(m, len(s), records.get(Path(p))) for p, m, s in zip(paths, masks, shards)]


def _looks_like_header(head):
    """True if the first bytes of a .bin file are an llm.c header (possibly a damaged one).

    A header is recognised by its magic, or -- so that a wrong magic is reported rather than the
    file silently read as raw tokens -- by version 1 followed by 253 zero ints. Raw GPT-2 token
    files can match neither: the magic read as uint16 is the token pair (55432, 308) and 55432 is
    beyond GPT-2's vocabulary (50257, or 50304 padded), and the second pattern would need tokens
    2..3 to be (1, 0) and tokens 6..511 to be 506 copies of token 0 ('!').
    """
    ints = np.frombuffer(head[: len(head) // 4 * 4], dtype="<i4")
    if len(ints) and ints[0] == MAGIC:
        return True
    return len(ints) == HEADER_INTS and ints[1] == VERSION and not ints[3:].any()


def load_shard(path, vocab_size=None):
    """Memory-map the tokens of one shard as a 1-D uint16 array (header skipped).

    .bin with an llm.c header (see _looks_like_header) -> validated header; any other .bin ->
    headerless raw uint16 (nanoGPT); .npy -> np.load(mmap_mode='r'), must be 1-D uint16
    (build-nanogpt). With vocab_size, every token id must be < vocab_size (one pass over the file).
    Raises ShardError naming the file on anything else.
    """
    path = Path(path)
    if not path.is_file():
        raise ShardError(f"{path}: no such shard file")
    size = path.stat().st_size
    if path.suffix == ".npy":
        try:
            tokens = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise ShardError(f"{path}: not a readable .npy token shard ({e})") from None
        if tokens.ndim != 1 or tokens.dtype != np.uint16:
            raise ShardError(
                f"{path}: .npy shard must be a 1-D uint16 array, got {tokens.dtype} of shape {tokens.shape}"
                " (convert with np.save(path, a.astype(np.uint16)) if all ids are < 65536)"
            )
    else:
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
        if _looks_like_header(head):
            if len(head) < HEADER_BYTES:
                raise ShardError(
                    f"{path}: truncated llm.c shard: {size} bytes, shorter than the {HEADER_BYTES}-byte header"
                )
            magic, version, count = (int(v) for v in np.frombuffer(head, dtype="<i4")[:3])
            if magic != MAGIC:
                raise ShardError(f"{path}: bad magic {magic} in the llm.c shard header (expected {MAGIC})")
            if version != VERSION:
                raise ShardError(
                    f"{path}: unsupported llm.c shard version {version} (expected {VERSION}, uint16 tokens)"
                )
            if count < 0 or size != HEADER_BYTES + 2 * count:
                kind = "truncated" if size < HEADER_BYTES + 2 * count else "corrupt"
                raise ShardError(
                    f"{path}: {kind} llm.c shard: header says {count} tokens "
                    f"({HEADER_BYTES + 2 * count} bytes), file has {size} bytes"
                )
            if count == 0:
                raise ShardError(f"{path}: empty shard (0 tokens)")
            tokens = np.memmap(path, dtype="<u2", mode="r", offset=HEADER_BYTES, shape=(count,))
        else:
            if size % 2:
                raise ShardError(f"{path}: {size} bytes is an odd size; neither an llm.c shard nor raw uint16 tokens")
            if size == 0:
                raise ShardError(f"{path}: empty shard (0 tokens)")
            tokens = np.memmap(path, dtype="<u2", mode="r")
    if tokens.size == 0:
        raise ShardError(f"{path}: empty shard (0 tokens)")
    if vocab_size is not None:
        check_vocab(tokens, vocab_size, path)
    return tokens


def check_vocab(tokens, vocab_size, path, top=None):
    """Raise ShardError if any token id in the shard is >= vocab_size (`top`: its max id, if known)."""
    top = int(tokens.max()) if top is None else top
    if top >= vocab_size:
        bad = tokens >= vocab_size
        where = int(np.argmax(bad))
        if not bad[where]:  # a stale manifest record: the file itself is fine
            return
        raise ShardError(
            f"{path}: token id {int(tokens[where])} >= vocab_size {vocab_size} (first bad id at token "
            f"{where:,}); tokenized for another vocabulary?"
        )


def read_manifests(data_dir):
    """{manifest path: its parsed JSON} of prepare_data.py's manifests (<name>_manifest.json) in the directories of
    data_dir's train and val shards, each file read once: a run reads them at its start (resume.start) and its
    loaders and tokenizer check take them. ShardError naming a manifest that is unreadable or not a JSON object,
    or a directory a prepare_data.py is still writing; NoShardsError when data_dir has no train shards. A mixture
    (parse_mixture): the manifests of all its sources, which must share one tokenizer (check_one_tokenizer)."""
    sources = parse_mixture(data_dir)
    if sources is not None:
        found = {name: read_manifests(path) for name, (path, _) in sources.items()}
        check_one_tokenizer(found, sources)
        return {manifest: m for manifests in found.values() for manifest, m in manifests.items()}
    directories = {p.parent for p in find_shards(data_dir, "train")}
    try:
        directories |= {p.parent for p in find_shards(data_dir, "val")}
    except NoShardsError:
        pass  # a missing val split is the val loader's error, if the run evaluates
    from gpt2train.files import lock_holder

    manifests = {}
    for manifest in sorted(m for d in directories for m in d.glob("*_manifest.json")):
        holder = lock_holder(manifest.parent)
        if holder and holder.startswith("prepare_data.py"):
            raise ShardError(f"{manifest.parent} is being written by {holder}: wait until it ends")
        try:
            manifests[manifest] = json.loads(read_regular(manifest, MAX_JSON_BYTES))
            if not isinstance(manifests[manifest], dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as e:  # a FIFO, /dev/zero or a huge file: refused unread (read_regular)
            reason = e.strerror if isinstance(e, OSError) and e.strerror else first_line(e)
            raise ShardError(
                f"{manifest}: unreadable prep manifest ({reason}); run prepare_data.py again, or "
                f"delete it to train on the shards unchecked"
            ) from None
    return manifests


def manifest_records(paths, split, manifests):
    """{shard path: its record} for the shards that prepare_data's manifests (read_manifests: <name>_manifest.json
    next to them) describe, after checking that each manifest covers its `split` shards: the prep finished (the
    manifest says complete), every shard it lists is there at its recorded size, and no shard under its <name>_
    prefix is unlisted. ShardError naming the file otherwise. Shards without a manifest (nanoGPT's,
    build-nanogpt's) are left out; mixed in one directory with shards a manifest lists, they are a ShardError too."""
    found, paths = {}, [Path(p) for p in paths]
    for directory in sorted({p.parent for p in paths}):
        for manifest in [m for m in manifests if m.parent == directory]:
            name = manifest.name[: -len("_manifest.json")]
            m = manifests[manifest]
            try:
                records = {directory / r["file"]: r for r in m["shards"] if r["split"] == split}
                sizes = {path: HEADER_BYTES + 2 * int(r["tokens"]) for path, r in records.items()}
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ShardError(
                    f"{manifest}: unreadable prep manifest ({type(e).__name__}: {e}); run "
                    f"prepare_data.py again, or delete it to train on the shards unchecked"
                ) from None
            if not m.get("complete"):
                raise ShardError(
                    f"{manifest}: the prep that writes {name}_* did not finish; run it again to complete it"
                )
            for path, size in sizes.items():
                have = path.stat().st_size if path.is_file() else None
                if have != size:
                    what = "is missing" if have is None else f"has {have:,} bytes, the manifest records {size:,}"
                    raise ShardError(f"{path}: listed in {manifest.name} but {what}; run prepare_data.py again")
            unlisted = [
                p for p in paths if p.parent == directory and p.name.startswith(f"{name}_") and p not in records
            ]
            if unlisted:
                raise ShardError(
                    f"{unlisted[0]}: not in {manifest.name} (another prep's shard?); move it out of "
                    f"{directory}, or run prepare_data.py again"
                )
            written = manifest.stat().st_mtime_ns  # after each of its shards
            eot = (tokenizer_entry(manifest, m) or {}).get("eot")
            doc_token = {"doc_token": eot} if eot is not None else {}
            found.update(
                {
                    path: {**r, "manifest": manifest.name, "manifest_mtime_ns": written, **doc_token}
                    for path, r in records.items()
                }
            )
        mine = [p for p in paths if p.parent == directory]
        stray = [p for p in mine if p not in found]
        if stray and len(stray) < len(mine):  # a prep's shards mixed with others no manifest vouches for
            raise ShardError(
                f"{stray[0]}: in no prep manifest of {directory}, unlike its other {split} shards (copied "
                f"in from elsewhere?); move it out, or give data_dir as a glob of the shards to train on"
            )
    return found


def tokenizer_entry(manifest, m):
    """The "tokenizer" entry of the prep manifest m (read from the file `manifest`), its values' types checked, or
    None where it has none (a prep from before tokenizers were recorded: GPT-2's). ShardError naming the manifest
    and the key otherwise (a manifest is a text file: anything may be there)."""
    entry = m.get("tokenizer")
    if entry is None:
        return None

    def refuse(key, expected):
        value = entry if key is None else entry.get(key)
        raise ShardError(
            f"{manifest}: {'tokenizer' if key is None else f'tokenizer.{key}'} is {str(repr(value))[:80]}, expected "
            f"{expected}; run prepare_data.py again"
        )

    if not isinstance(entry, dict):
        refuse(None, "an object")
    if not isinstance(entry.get("id"), str):
        refuse("id", "a string")
    for key, top in (("n_vocab", 2**16), ("eot", 2**16 - 1)):
        value = entry.get(key)
        if value is not None and (type(value) is not int or not 0 <= value <= top):
            refuse(key, f"an integer from 0 to {top:,}")
    name = entry.get("file")
    if "file" in entry and (not isinstance(name, str) or Path(name).name != name or name in ("", ".", "..")):
        refuse("file", "the name of a file in the manifest's directory")
    return entry


def data_tokenizer(manifests):
    """The tokenizer of a data_dir's shards, as its prepare_data.py manifests (read_manifests) record it
    (bpe.tokenizer_record; "json" read back from the <name>_tokenizer.json beside them and checked against its
    hash), or None where no manifest says (shards of other tools: assumed GPT-2's). A manifest from before tokenizers
    were recorded means GPT-2's ("n_vocab" None). ShardError when the manifests name different tokenizers (e.g. a
    glob over two data directories), or a tokenizer entry or file that is malformed, missing, changed or not a
    regular file (tokenizer_entry: a plain name inside the directory, read with a size cap)."""
    import hashlib

    found = {}
    for manifest, m in manifests.items():
        directory = manifest.parent
        record = tokenizer_entry(manifest, m) or {"id": "gpt2", "n_vocab": None, "eot": 50256, "source": None}
        record = {**record, "json": None}
        if "file" in record:
            path = directory / record["file"]
            try:  # a regular file of bounded size: not a FIFO, nor a symlink to /dev/zero
                data = read_regular(path, MAX_JSON_BYTES, follow_symlinks=False)
            except OSError as e:
                raise ShardError(
                    f"{path}: cannot read the tokenizer that {manifest.name} names ({e.strerror}); "
                    f"run prepare_data.py again"
                ) from None
            if record["id"] != "sha256:" + hashlib.sha256(data).hexdigest()[:16]:
                raise ShardError(
                    f"{path}: changed since {manifest.name} recorded it as {record['id']}; run prepare_data.py again"
                )
            try:  # a file made to match its recorded id: its errors name it, not the tokenizer it was made from
                record["json"] = data.decode("utf-8")
                if not isinstance(json.loads(record["json"]), dict):
                    raise ValueError("not a JSON object")
            except ValueError as e:
                raise ShardError(f"{path}: not a tokenizer.json ({first_line(e)}); run prepare_data.py again") from None
        found[manifest] = record
    ids = {r["id"] for r in found.values()}
    if len(ids) > 1:
        (a, ra), (b, rb) = [next((m, r) for m, r in found.items() if r["id"] == i) for i in sorted(ids)[:2]]
        raise ShardError(
            f"{a.parent}: its shards come from two tokenizers: {a} has {ra['id']}, {b} has {rb['id']}; "
            f"train on one tokenizer's data"
        )
    return next(iter(found.values()), None)


def check_one_tokenizer(found, sources):
    """ShardError, one line naming two sources and their tokenizers, unless the sources of a mixture ({name: (path,
    weight)}) were all tokenized with one tokenizer, by the ids their manifests (found: {name: read_manifests'})
    record; a source without a manifest is taken to be GPT-2's, as everywhere. Two tokenizers within one source are
    data_tokenizer's error."""

    def tokenizer(m):
        t = m.get("tokenizer")
        return t if isinstance(t, dict) and "id" in t else {"id": "gpt2"}

    ids = {}
    for name, manifests in found.items():
        records = [tokenizer(m) for m in manifests.values()] or [{"id": "gpt2"}]
        if len({r["id"] for r in records}) == 1:
            ids[name] = records[0]
    first = next(iter(ids.values()), None)
    other = next((name for name, r in ids.items() if r["id"] != first["id"]), None)
    if other is None:
        return
    one = next(iter(ids))

    def named(name):
        r = ids[name]
        return r["id"] + (f" ({r['source']})" if r.get("source") else "")

    raise ShardError(
        f"data_dir: {sources[one][0]} was tokenized with {named(one)}, {sources[other][0]} with {named(other)}; the "
        f"sources of a mixture share one tokenizer: prepare them with the same prepare_data.py --tokenizer"
    )


def check_shards_vocab(paths, shards, vocab_size, progress=True, chunk=1 << 26, records=None):
    """Every token id of every shard < vocab_size, before training starts (ShardError naming the shard and
    the id otherwise). A shard's max id comes from its manifest record (manifest_records) if the shard was not
    modified after the manifest was written (free); other shards are scanned once (at disk speed, a progress
    bar when there is over 1 GiB to read)."""
    todo = []
    for path, tokens in zip(paths, shards):
        r = (records or {}).get(Path(path), {})
        if "max_token" in r and r["tokens"] == len(tokens) and os.stat(path).st_mtime_ns <= r["manifest_mtime_ns"]:
            check_vocab(tokens, vocab_size, path, top=int(r["max_token"]))
        else:
            todo.append((path, tokens))
    total = sum(len(tokens) for _, tokens in todo)
    with progress_bar(
        total=total, unit="tok", unit_scale=True, desc="checking token ids", show=progress and 2 * total >= 2**30
    ) as bar:
        for path, tokens in todo:
            top = 0
            for start in range(0, len(tokens), chunk):
                top = max(top, int(tokens[start : start + chunk].max()))
                bar.update(min(chunk, len(tokens) - start))
            check_vocab(tokens, vocab_size, path, top=top)


def parse_mixture(data_dir):
    """{name: (path, weight)} of a data_dir that names a mixture of prepared datasets, weights scaled to sum to 1;
    None for one source (a directory or a glob of shards). A mixture is a dict {path: weight} (a config file) or a
    string "path:weight,path:weight" (the command line); a text that names an existing directory or matches files
    is one source, whatever ':' or ',' it holds (`run:1`, `2026-11-28T10:30`). A weight is a share of the rows
    drawn, >= 0 (0: validated, never trained on). A source's name is its path's last part without glob
    characters, made unique by _2, _3 ... in order. ValueError (one line) for a malformed mixture, or one
    directory named twice (`a`, `a/`, a link to it)."""
    if isinstance(data_dir, dict):
        items = [(str(path), weight) for path, weight in data_dir.items()]
    else:
        text = str(data_dir)
        if os.path.isdir(text) or (any(c in text for c in "*?[") and glob.glob(text)):
            return None
        path, _, weight = text.rpartition(":")
        if "," not in text and not (path and re.fullmatch(r"\s*[0-9.eE+-]+\s*", weight)):
            return None
        items = [part.rpartition(":")[::2] for part in text.split(",")]
        bad = next((part for part, (path, _) in zip(text.split(","), items) if not path.strip()), None)
        if bad is not None:
            raise ValueError(f"data_dir {text!r}: {bad!r} is not path:weight (a mixture is path:weight,path:weight)")
    sources, paths = {}, {}
    for path, weight in items:
        path = path.strip()
        try:
            number = float(weight) if not isinstance(weight, bool) else math.nan
        except (TypeError, ValueError):
            number = math.nan
        if not math.isfinite(number) or number < 0:
            raise ValueError(f"data_dir: the weight of {path} must be a number >= 0; got {weight!r}")
        weight = number
        same = paths.get(os.path.realpath(path))  # one directory, however it is spelled
        if same is not None:
            twice = f"{path} is named twice" if same == path else f"{path} and {same} are one directory, named twice"
            raise ValueError(f"data_dir: {twice}")
        paths[os.path.realpath(path)] = path
        base = re.sub(r"[*?\[\]]", "", Path(path).name) or Path(path).parent.name or "data"
        name, n = base, 1
        while name in sources:
            n += 1
            name = f"{base}_{n}"
        sources[name] = (path, weight)
    total = sum(w for _, w in sources.values())
    if math.isinf(total):  # finite weights whose sum overflows: scaled by the largest first
        top = max(w for _, w in sources.values())
        sources = {name: (path, w / top) for name, (path, w) in sources.items()}
        total = sum(w for _, w in sources.values())
    if total <= 0:
        raise ValueError(f"data_dir: at least one source needs a weight > 0; got {data_dir!r}")
    return {name: (path, w / total) for name, (path, w) in sources.items()}


def find_shards(data_dir, split):
    """Sorted shard files (.bin/.npy) of one split in data_dir: names whose stem contains the split
    as a word, e.g. `x_train_000001.bin`, `train.bin`, `edufineweb_val_000000.npy`.
    data_dir may also be a glob pattern (`data/fw/fineweb_edu_*`)."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    data_dir = str(data_dir)
    if any(c in data_dir for c in "*?["):
        candidates = [Path(p) for p in sorted(glob.glob(data_dir))]
    elif os.path.isdir(data_dir):
        candidates = sorted(Path(data_dir).iterdir())
    elif os.path.exists(data_dir):
        raise ShardError(f"{data_dir}: is a file, not a data directory (data_dir: a directory of shards, or a glob)")
    else:
        raise NoShardsError(f"{data_dir}: no such data directory", data_dir)
    word = re.compile(rf"(^|[_.-]){split}($|[_.-])")
    named = [p for p in candidates if p.suffix in SHARD_SUFFIXES and word.search(p.stem)]
    dangling = [p for p in named if p.is_symlink() and not p.exists()]
    if dangling:  # not skipped: the run would train on less data than the directory shows
        raise ShardError(f"{dangling[0]}: a symlink to {os.readlink(dangling[0])}, which does not exist")
    paths = [p for p in named if p.is_file()]
    if not paths:
        raise NoShardsError(
            f"{data_dir}: no {split} shards (*.bin or *.npy files with '{split}' in the name)", data_dir
        )
    return paths


# ---------------------------------------------------------------------------- document rows (packing='document')


def document_items(tokens, row_tokens, doc_token, split_long):
    """A shard's documents as packable items (start, length, ends_document), each at most row_tokens long, plus
    the (starts, lengths) of the documents left out. A document starts at a doc_token (the shard's first item may
    instead continue a document of the previous shard). A document longer than a row: split_long cuts it into pieces of
    row_tokens that overlap by one token (the last target of one piece is the first input of the next, so every
    target is trained once) and a remainder (its last tokens, packed like a short document); otherwise it is
    left out (SFT: a truncated conversation would teach an answer that never ends)."""
    starts = np.flatnonzero(tokens == doc_token)
    if not len(starts) or starts[0] != 0:
        starts = np.concatenate([[0], starts])
    ends = np.append(starts[1:], len(tokens))
    lengths = ends - starts
    fits = lengths <= row_tokens
    if not split_long:
        return starts[fits], lengths[fits], ends[fits] < len(tokens), (starts[~fits], lengths[~fits])
    T = row_tokens - 1  # stride between pieces of one long document
    pieces = np.where(fits, 1, -(-(lengths - 1) // np.maximum(T, 1)))  # pieces per document (targets: length - 1)
    first = np.repeat(starts, pieces) + T * (np.arange(pieces.sum()) - np.repeat(np.cumsum(pieces) - pieces, pieces))
    doc_end = np.repeat(ends, pieces)
    end = np.minimum(first + row_tokens, doc_end)
    return first, end - first, (end == doc_end) & (end < len(tokens)), (starts[:0], lengths[:0])


def pack_best_fit(lengths, capacity):
    """Best-fit decreasing: the longest item first, each into the row with the least room that still holds it (a new
    row when none does). Returns (row of each item, number of rows); rows are numbered as they open."""
    room_rows = [[] for _ in range(capacity + 1)]  # room left -> the rows with exactly that much room
    rooms = []  # sorted, the rooms that some row has
    row_of = np.empty(len(lengths), dtype=np.int64)
    rows = 0
    for i in np.lexsort((np.arange(len(lengths)), -lengths)).tolist():  # longest first, ties in file order
        need = int(lengths[i])
        k = bisect.bisect_left(rooms, need)
        if k == len(rooms):
            row, room = rows, capacity
            rows += 1
        else:
            room = rooms[k]
            row = room_rows[room].pop()
            if not room_rows[room]:
                del rooms[k]
        row_of[i] = row
        if room > need:
            if not room_rows[room - need]:
                bisect.insort(rooms, room - need)
            room_rows[room - need].append(row)
    return row_of, rows


class DocumentRows:
    """One shard's rows of row_tokens tokens, each starting at a document start (or continuing a document longer
    than a row), documents packed best-fit (pack_best_fit); the rest of a row is padding (doc_token, never a
    target). Row r is segments ptr[r]:ptr[r+1] of (start, length, ends_document) in the shard, in file order."""

    def __init__(self, tokens, row_tokens, doc_token, split_long):
        start, length, ends, self.left_out = document_items(tokens, row_tokens, doc_token, split_long)
        row_of, self.num_rows = pack_best_fit(length, row_tokens)
        order = np.lexsort((start, row_of))
        self.start, self.length, self.ends = start[order], length[order], ends[order]
        self.ptr = np.searchsorted(row_of[order], np.arange(self.num_rows + 1))
        self.tokens = int(length.sum())  # tokens in rows (a long document's piece borders count twice)

    def gather(self, rows, out, keep, tokens, mask, doc_token):
        """Fill out (b, row_tokens) with rows' tokens (padding: doc_token) and keep (b, row_tokens) with 1 where the
        token is a trained target: mask's value (SFT), else 1 inside a segment, at a segment's first token only when
        the previous segment ended its document and this one starts one (its doc_token is a right target), at the
        first padding token only when the last segment ended its document."""
        lo = self.ptr[rows]
        count = self.ptr[rows + 1] - lo  # segments per row
        first_seg = np.cumsum(count) - count  # each row's first segment, among the batch's
        seg_row = np.repeat(np.arange(len(rows)), count)  # each segment's row in the batch
        seg = np.arange(count.sum()) + np.repeat(lo - first_seg, count)  # the segments' indices
        length, start = self.length[seg], self.start[seg]
        before = np.cumsum(length) - length  # tokens of the batch before each segment
        col0 = before - before[first_seg][seg_row]  # each segment's first column in its row
        inside = np.arange(length.sum()) - np.repeat(before, length)  # each token's place in its segment
        row = np.repeat(seg_row, length)
        col = np.repeat(col0, length) + inside
        src = np.repeat(start, length) + inside
        out[:] = doc_token
        out[row, col] = tokens[src]
        keep[:] = 0
        if mask is not None:
            keep[row, col] = mask[src]
            return
        keep[row, col] = 1
        ends = self.ends[seg]
        later = col0 > 0  # segments after a row's first: is their first token a right target?
        keep[seg_row[later], col0[later]] = ends[np.flatnonzero(later) - 1] & (tokens[start[later]] == doc_token)
        fill = np.bincount(seg_row, weights=length, minlength=len(rows)).astype(np.int64)
        pad = (fill < out.shape[1]) & ends[first_seg + count - 1]  # the first padding: after a document's end
        keep[np.flatnonzero(pad), fill[pad]] = 1


@runtime_checkable
class Loader(Protocol):
    """What the step, the evaluator, the checkpoint and train.py may call of a loader, whichever it is: DataLoader
    (one prepared dataset) or Mixture (several), so that none of them asks which one it holds."""

    B: int  # the live micro-batch: rows per next_batch
    masked: bool  # some targets are -1 (SFT loss masks, document padding)
    masks: list | None  # SFT data's loss-mask arrays, or None

    def next_batch(self) -> tuple: ...  # (x, y), (B, T) token ids each, on the CPU

    def reset(self) -> None: ...  # back to the start of the stream (validation: the same batches again)

    def set_batch_size(self, batch_size: int) -> None: ...  # batch_size='auto', halving on an out-of-memory

    def summary(self) -> str: ...  # the start-up line's description

    def tokens(self) -> dict: ...  # {'tokens/<name>': ...} of each source of a mixture so far; {} for one dataset

    def sources(self) -> dict: ...  # {name: (that source's loader, weight)}; one dataset: {None: (itself, 1.0)}

    def state_dict(self) -> dict: ...  # the stream position, for a checkpoint

    def load_state_dict(self, state: dict) -> None: ...  # continue that stream exactly


class DataLoader:
    """(x, y) batches of B x T token ids from the shards of one split.

    The data is a sequence of samples (rows: windows or packed documents, see the module docstring). The
    stream is the infinite concatenation of epochs; epoch e visits every sample once, in an order fixed by
    (seed, e): shards in a permuted order, each shard's samples in a permuted order (or in file
    order when shuffle is False). Micro-step k of the whole job consumes stream positions
    [k*B*W, (k+1)*B*W) and rank r reads only [k*B*W + r*B, k*B*W + (r+1)*B). So the samples of an
    optimizer step depend only on W*B*accumulation, and an epoch is covered exactly once across
    ranks. A micro-batch that reaches the end of an epoch continues into the next one (the stream
    position is just a number: nothing is dropped or repeated within any epoch). Document rows are a
    deterministic function of the shards and block_size, so the position is all the state there is.
    """

    def __init__(
        self,
        data_dir,
        split,
        batch_size,
        block_size,
        rank=0,
        world_size=1,
        seed=0,
        vocab_size=None,
        shuffle=None,
        packing="window",
        doc_token=None,
        manifests=None,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if batch_size < 1 or block_size < 1 or seed < 0:
            raise ValueError(
                f"batch_size and block_size must be >= 1 and seed >= 0 (got {batch_size}, {block_size}, {seed})"
            )
        if packing not in PACKINGS:
            raise ValueError(f"packing must be one of {', '.join(PACKINGS)}, got {packing!r}")
        self.B, self.T = batch_size, block_size
        self.rank, self.world_size = rank, world_size
        self.seed = seed
        self.vocab_size = vocab_size
        self.shuffle = (split == "train") if shuffle is None else bool(shuffle)
        self.data_dir = str(data_dir)
        self.paths = find_shards(data_dir, split)
        if manifests is None:  # a run's start read them already (resume.start)
            manifests = read_manifests(data_dir)
        records = manifest_records(self.paths, split, manifests)  # a prep's shards: all there, none foreign, finished
        # what starts a document: the <|endoftext|> of the tokenizer the manifest records, else GPT-2's
        self.doc_token = (
            doc_token
            if doc_token is not None
            else next((r["doc_token"] for r in records.values() if "doc_token" in r), EOT)
        )
        # Memory-mapped once, headers validated; plain ndarray views skip np.memmap's per-slice overhead.
        self.shards = [load_shard(p).view(np.ndarray) for p in self.paths]
        if vocab_size is not None:  # now, not when a shard is first read many steps into the run
            check_shards_vocab(self.paths, self.shards, vocab_size, progress=rank == 0, records=records)
        masks = load_masks(self.paths, self.shards, records, data_dir)  # SFT data; None for text
        self.masks = None if masks is None else [m for m, _ in masks]
        self.trained_tokens = None if masks is None else sum(n for _, n in masks)
        self.packing = "document" if masks is not None else packing  # SFT: rows of whole conversations
        # masked: some targets are -1 (SFT masks, document rows' padding), so a step weighs micro-batches by them
        self.masked = self.packing == "document"
        self.rows = None
        if self.packing == "document":
            self.rows = [DocumentRows(s, block_size + 1, self.doc_token, split_long=masks is None) for s in self.shards]
            self.samples_per_shard = np.array([r.num_rows for r in self.rows], dtype=np.int64)
            if masks is not None:  # the trained tokens of the conversations left out
                self.trained_tokens -= sum(
                    int(m[s : s + n].sum(dtype=np.int64))
                    for r, m in zip(self.rows, self.masks)
                    for s, n in zip(*r.left_out)
                )
        else:
            self.samples_per_shard = np.array([max(0, (len(s) - 1) // block_size) for s in self.shards], dtype=np.int64)
            # each shard as its (samples, T+1) windows at stride T, a view: a batch copies whole rows out of it
            self.windows = [
                np.lib.stride_tricks.as_strided(
                    s, (n, block_size + 1), (block_size * s.strides[0], s.strides[0]), writeable=False
                )
                for s, n in zip(self.shards, self.samples_per_shard.tolist())
            ]
        self.num_samples = int(self.samples_per_shard.sum())
        if masks is not None and self.num_samples and not self.trained_tokens:
            raise ShardError(
                f"{data_dir}: the loss masks of the {split} shards mark no token as trained; prepare the data again"
            )
        if self.num_samples == 0:
            total = sum(len(s) for s in self.shards)
            if masks is not None:
                shortest = min(int(n.min()) for r in self.rows for n in r.left_out[1:] if len(n))
                raise ShardError(
                    f"{data_dir}: every {split} conversation is longer than block_size+1 = "
                    f"{block_size + 1} tokens (the shortest has {shortest}); train with block_size >= "
                    f"{shortest - 1}"
                )
            more = "prepare it again with a larger --val_tokens" if split == "val" else "prepare more text"
            raise ShardError(
                f"{data_dir}: the {split} shards hold {total} tokens; none has the "
                f"block_size+1 = {block_size + 1} tokens of one sample: {more}, or train with a smaller block_size"
            )
        self._plans = {}  # epoch -> (shard order, cumulative sample counts in that order)
        self._perms = {}  # (epoch, shard) -> permutation of that shard's samples
        self.position = 0  # global stream position: samples consumed by all ranks together

    def summary(self):
        """'9 shards, 5,516 tokens' (the start-up line's), and with document rows how many, the share of
        padding, the trained tokens of SFT data and the conversations left out."""
        text = f"{len(self.paths)} shards, {sum(len(s) for s in self.shards):,} tokens"
        if self.rows is None:
            return text
        slots = self.num_samples * (self.T + 1)
        used = sum(r.tokens for r in self.rows)
        text += f" in {self.num_samples:,} document rows ({(slots - used) / slots:.1%} padding)"
        if self.masks is None:
            return text
        text += f", {self.trained_tokens:,} trained"
        left = np.concatenate([r.left_out[1] for r in self.rows])
        if len(left):
            text += (
                f"; {len(left):,} conversation(s) longer than block_size+1 = {self.T + 1} tokens left out (the "
                f"longest has {int(left.max()):,}: block_size >= {int(left.max()) - 1} keeps them all)"
            )
        return text

    @property
    def epoch(self):
        return self.position // self.num_samples

    def tokens(self):
        return {}  # one dataset: its tokens are the run's

    def sources(self):
        return {None: (self, 1.0)}

    def reset(self):
        """Back to the start of the stream (validation: the same fixed batches again)."""
        self.position = 0

    def set_batch_size(self, batch_size):
        """Read batch_size sequences per micro-batch from now on (batch_size='auto', halving on out-of-memory).
        The global sample stream is unchanged: positions count samples, not batches."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.B = batch_size

    def _plan(self, epoch):
        if epoch not in self._plans:
            if len(self._plans) >= 2:  # a batch usually touches one epoch, at most two
                self._plans.pop(next(iter(self._plans)))
            n = len(self.shards)
            # SeedSequence pads short entropy with zeros, so the tags 0 / 1 keep the streams distinct.
            order = (
                np.random.Generator(np.random.PCG64([self.seed, epoch, 0])).permutation(n)
                if self.shuffle
                else np.arange(n)
            )
            self._plans[epoch] = (order, np.cumsum(self.samples_per_shard[order]))
        return self._plans[epoch]

    def _perm(self, epoch, shard):
        key = (epoch, shard)
        if key not in self._perms:
            if len(self._perms) >= 8:  # the stream walks shard by shard: keep only the recent ones
                self._perms.pop(next(iter(self._perms)))
            n = int(self.samples_per_shard[shard])
            rng = np.random.Generator(np.random.PCG64([self.seed, epoch, 1, shard]))
            self._perms[key] = rng.permutation(n) if self.shuffle else np.arange(n)
        return self._perms[key]

    def _runs(self, first, count):
        """Split stream positions [first, first+count) into runs that lie in one shard of one epoch.
        Yields (offset in the batch, shard index, that shard's sample indices for the run)."""
        done = 0
        while done < count:
            epoch, offset = divmod(first + done, self.num_samples)
            order, cum = self._plan(epoch)
            slot = int(np.searchsorted(cum, offset, side="right"))  # place in the epoch's shard order
            shard = int(order[slot])
            begin = offset - int(cum[slot] - self.samples_per_shard[shard])  # index into the shard's permutation
            take = min(count - done, int(cum[slot]) - offset)
            yield done, shard, self._perm(epoch, shard)[begin : begin + take]
            done += take

    def next_batch(self):
        """The next (x, y) of this rank: int64 CPU tensors of shape (B, T); y[:, t] == x[:, t+1], or -1 where a
        loss mask is off or a document row is padded."""
        window, keep = self.empty_rows(self.B)
        self.read(self.position + self.rank * self.B, window, keep)
        self.position += self.B * self.world_size
        return batch_tensors(window, keep)

    def empty_rows(self, count):
        """Buffers for `count` rows: (token ids (count, T+1) uint16, trained-target flags of the same shape uint8
        where some targets are not trained (self.masked), else None)."""
        window = np.empty((count, self.T + 1), dtype=np.uint16)
        return window, np.empty(window.shape, dtype=np.uint8) if self.masked else None

    def read(self, first, window, keep=None):
        """Stream positions [first, first + len(window)) into window (rows of T+1 ids) and keep (empty_rows')."""
        for at, shard, samples in self._runs(first, len(window)):  # usually a single run
            self._fill(shard, samples, window, keep, slice(at, at + len(samples)))

    def read_at(self, positions, window, keep, rows):
        """Stream positions (sorted, gaps allowed) into window[rows] and keep[rows] (rows: an index array, one per
        position): a Mixture's read-ahead, this source's rows among those of the other sources and ranks."""
        epoch, offset = np.divmod(positions, self.num_samples)
        for a, b in runs(epoch):  # usually one epoch
            e = int(epoch[a])
            order, cum = self._plan(e)
            slot = np.searchsorted(cum, offset[a:b], side="right")  # places in the epoch's shard order
            shard = order[slot]
            begin = offset[a:b] - (cum[slot] - self.samples_per_shard[shard])  # indices into the permutations
            for c, d in runs(slot):  # each in one shard
                s = int(shard[c])
                self._fill(s, self._perm(e, s)[begin[c:d]], window, keep, rows[a + c : a + d])

    def _fill(self, shard, samples, window, keep, rows):
        """window[rows] (and keep[rows]) = the samples of a shard; ShardError if one holds an id >= vocab_size."""
        T = self.T
        if self.rows is None:
            out = self.windows[shard][samples]  # (b, T+1)
            window[rows] = out
        else:  # document rows; a view of window where rows is a slice
            out, kept = (window[rows], keep[rows]) if isinstance(rows, slice) else self.empty_rows(len(samples))
            mask = None if self.masks is None else self.masks[shard]
            self.rows[shard].gather(samples, out, kept, self.shards[shard], mask, self.doc_token)
            if not isinstance(rows, slice):
                window[rows], keep[rows] = out, kept
        if self.vocab_size is not None and out.size and int(out.max()) >= self.vocab_size:  # changed since start
            row, col = np.argwhere(out >= self.vocab_size)[0]
            at_token = (
                f"at token {int(samples[row]) * T + int(col):,}"
                if self.rows is None
                else f"in document row {int(samples[row]):,}"
            )
            raise ShardError(
                f"{self.paths[shard]}: token id {int(out[row, col])} >= vocab_size {self.vocab_size} "
                f"{at_token}: the shard changed after the run checked it at start; restore or "
                f"re-prepare it"
            )

    def state_dict(self):
        """Plain ints/bools: the stream position and what identifies the stream."""
        return {
            "position": int(self.position),
            "seed": int(self.seed),
            "block_size": int(self.T),
            "num_samples": int(self.num_samples),
            "shuffle": bool(self.shuffle),
            "packing": self.packing,
        }

    def load_state_dict(self, state):
        """Continue the exact stream of the loader that saved state (any B/world_size split)."""
        if "sources" in state:
            raise ValueError(
                "loader state is of a mixture, but data_dir now names one data directory (to go on with this "
                f"source alone, name it as a mixture of one: data_dir='{self.data_dir}:1')"
            )
        for key in ("packing", "seed", "block_size", "num_samples", "shuffle"):
            mine = getattr(self, {"block_size": "T"}.get(key, key))
            if state.get(key, "window" if key == "packing" else None) != mine:  # older states: windows
                raise ValueError(
                    f"loader state is for a different stream: {key} is {state.get(key)!r} "
                    f"in the saved state but {mine!r} here (data or settings changed?)"
                )
        self.position = int(state["position"])


# a mixture reads each rank's rows of up to AHEAD_STEPS micro-steps (AHEAD_TOKENS at most) at a time: a read costs
# tens of microseconds per source whatever its size, a micro-batch of one source's windows about as much
AHEAD_STEPS, AHEAD_TOKENS = 128, 1 << 22


class Mixture:
    """(x, y) batches from several prepared datasets (sources: parse_mixture's {name: (path, weight)}), each row
    from one source, in proportion to the weights: one DataLoader per source, each with its own stream position
    and epochs (a source that runs out starts its next epoch, and a note says so).

    Which source supplies each row of the global stream (all ranks' rows, as DataLoader's) is a schedule worked out
    from the sources' row counts alone: source s's k-th row since its weights were set is due at (k + phase_s) /
    weight_s, with phase_s in [0, 1) drawn from the seed, and rows go to the sources in order of due time (ties: the
    first source). So it is the same on every rank (each works out the whole stream's sources and reads its own B
    rows of each micro-step), a checkpoint of the counts resumes it exactly, and after any n rows each source has
    supplied weight * n rows give or take one or two: a 0.75/0.25 mixture is 3:1 in every stretch of rows. A weight
    of 0 never draws (the source is still validated). A resume with other weights continues every source where it
    was and applies the new weights from there (load_state_dict). Rows are read many micro-steps ahead, one read per
    source, so a batch costs about what one source's does."""

    def __init__(
        self,
        sources,
        split,
        batch_size,
        block_size,
        rank=0,
        world_size=1,
        seed=0,
        vocab_size=None,
        shuffle=None,
        packing="window",
        manifests=None,
    ):
        self.paths = {name: str(path) for name, (path, _) in sources.items()}
        kwargs = dict(rank=rank, world_size=world_size, seed=seed, vocab_size=vocab_size, shuffle=shuffle)
        self.loaders = {
            name: DataLoader(path, split, batch_size, block_size, packing=packing, manifests=manifests, **kwargs)
            for name, path in self.paths.items()
        }
        self.weights = np.array([weight for _, weight in sources.values()], dtype=np.float64)
        self.B, self.T = batch_size, block_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.phase = np.random.Generator(np.random.PCG64([seed, 2])).random(len(sources))  # tag 2: not a loader's
        self.base = np.zeros(len(sources), dtype=np.int64)  # each source's row count when the weights were set
        self.masked = any(loader.masked for loader in self.loaders.values())
        self.masks = next((loader.masks for loader in self.loaders.values() if loader.masks is not None), None)
        self.position = 0  # global stream position: rows consumed by all ranks together
        self._ahead = None  # (position, B, each source's rows before each micro-step) of the rows read ahead
        self._rows = None  # (the rows read ahead, their keep): buffers that each read-ahead fills again
        self._drawn = None  # each source's rows after the last batch, given to its loader when asked (_sync)

    def summary(self):
        """'mixture of 2: a 0.75: 3 shards, 5,516 tokens; b 0.25: ...' (DataLoader.summary per source)."""
        parts = [f"{name} {w:.3g}: {loader.summary()}" for (name, loader), w in zip(self.loaders.items(), self.weights)]
        return f"mixture of {len(parts)}: " + "; ".join(parts)

    def _sync(self):
        """Bring each source's loader to the rows it has supplied (next_batch only notes them: per batch, that
        would cost as much as the rest of a mixture's bookkeeping)."""
        if self._drawn is not None:
            for loader, c in zip(self.loaders.values(), self._drawn):
                loader.position = c
            self._drawn = None

    def counts(self):
        """Rows each source has supplied so far (its loader's stream position), in source order."""
        self._sync()
        return np.array([loader.position for loader in self.loaders.values()], dtype=np.int64)

    def tokens(self):
        """{'tokens/<name>': tokens of the rows each source supplied so far (all ranks)}, for metrics.jsonl."""
        self._sync()
        return {f"tokens/{name}": loader.position * self.T for name, loader in self.loaders.items()}

    def sources(self):
        """{name: (its loader, its weight)}, in source order."""
        return {name: (loader, float(w)) for (name, loader), w in zip(self.loaders.items(), self.weights)}

    def reset(self):
        """Back to the start of every source and of the schedule."""
        for loader in self.loaders.values():
            loader.reset()
        self.position, self._ahead, self._drawn = 0, None, None
        self.base[:] = 0

    def set_batch_size(self, batch_size):
        """As DataLoader.set_batch_size (the sources' loaders take it too: validation reads each alone)."""
        for loader in self.loaders.values():
            loader.set_batch_size(batch_size)
        self.B = batch_size

    def _schedule(self, count):
        """(the sources of rows [position, position + count), each source's rows among them before each row: an
        array of count + 1 rows), worked out from the counts now."""
        S = len(self.weights)
        # candidates: each source's next rows, as many as `count` rows can take of it: every source's next row is
        # due within 1 / weight of the last row drawn (the counts came from this schedule, or were just rebased),
        # so count rows reach at most count + S - 1 further in time, weight * (count + S - 1) + 1 rows of a source
        cap = np.ceil(self.weights * (count + S)).astype(np.int64) + 1
        owner = np.repeat(np.arange(S), cap)  # in source order: a stable sort breaks ties for the first source
        k = np.arange(cap.sum()) - np.repeat(np.cumsum(cap) - cap, cap) + (self.counts() - self.base)[owner]
        with np.errstate(divide="ignore"):
            due = (k + self.phase[owner]) / self.weights[owner]  # weight 0: inf, never due
        src = owner[np.argsort(due, kind="stable")[:count]]  # (count,) in order of due time
        before = np.zeros((count + 1, S), dtype=np.int64)
        np.cumsum(src[:, None] == np.arange(S), axis=0, out=before[1:])
        return src, before

    def _read_ahead(self):
        """This rank's rows of the next micro-steps (AHEAD_STEPS, AHEAD_TOKENS), each source's in one read_at, and
        each source's row count before each of them (all ranks), from the counts now."""
        B, W, counts = self.B, self.world_size, self.counts()
        steps = max(1, min(AHEAD_STEPS, AHEAD_TOKENS // (B * (self.T + 1))))
        src, before = self._schedule(steps * B * W)
        mine = (np.arange(steps)[:, None] * B * W + self.rank * B + np.arange(B)).ravel()  # rows of the schedule
        shape = (steps * B, self.T + 1)
        if self._rows is None or self._rows[0].shape != shape:  # else the same buffers: batch_tensors copies
            self._rows = (np.empty(shape, np.uint16), np.empty(shape, np.uint8) if self.masked else None)
        window, keep = self._rows
        if keep is not None:
            keep.fill(1)  # rows of sources without masks or padding
        sources = src[mine]
        positions = counts[sources] + before[mine, sources]  # in each row's source's stream
        by_source = np.argsort(sources, kind="stable")  # this rank's rows, source by source, each in stream order
        edges = np.searchsorted(sources[by_source], np.arange(len(self.weights) + 1)).tolist()
        for s, loader in enumerate(self.loaders.values()):
            rows = by_source[edges[s] : edges[s + 1]]
            if len(rows):
                loader.read_at(positions[rows], window, keep, rows)
        rows = counts + before[np.arange(steps + 1) * B * W]  # (steps + 1, S): of all ranks
        sizes = [loader.num_samples for loader in self.loaders.values()]
        ends = {}  # micro-step -> its notes: the sources that run out in it
        for step, s in np.argwhere(np.diff(rows // sizes, axis=0)).tolist():
            ends.setdefault(step, []).append(
                f"data: {list(self.loaders)[s]} ran out after {sizes[s]:,} rows: its epoch "
                f"{rows[step + 1, s] // sizes[s] + 1} starts"
            )
        self._ahead = (self.position, B, rows.tolist(), ends)

    def next_batch(self):
        """This rank's next (x, y), as DataLoader.next_batch; its rows in the global stream's order."""
        B = self.B
        ahead = self._ahead
        if ahead is not None:
            step, off = divmod(self.position - ahead[0], B * self.world_size)
        if ahead is None or ahead[1] != B or off or not 0 <= step < len(ahead[2]) - 1:
            self._read_ahead()
            ahead, step = self._ahead, 0
        self._drawn = ahead[2][step + 1]
        for note in ahead[3].get(step, ()):
            log(note, note=True)
        window, keep = self._rows
        self.position += B * self.world_size
        rows = slice(step * B, (step + 1) * B)
        return batch_tensors(window[rows], None if keep is None else keep[rows])

    def state_dict(self):
        """Plain values: the position, and each source's path, weight, schedule base and DataLoader state."""
        self._sync()
        return {
            "position": int(self.position),
            "seed": int(self.seed),
            "block_size": int(self.T),
            "sources": {
                name: {"path": path, "weight": float(w), "base": int(b), "loader": self.loaders[name].state_dict()}
                for (name, path), w, b in zip(self.paths.items(), self.weights, self.base)
            },
        }

    def load_state_dict(self, state):
        """Continue the exact stream of the mixture that saved state. Sources are matched by path; where the weights
        (or the sources) changed, each source continues where it was (a new one at its start) and the new weights
        apply from here, with a note."""
        if "sources" not in state:
            raise ValueError("loader state is of one data directory, but data_dir now names a mixture")
        for key, mine in (("seed", self.seed), ("block_size", self.T)):
            if state.get(key) != mine:
                raise ValueError(
                    f"loader state is for a different stream: {key} is {state.get(key)!r} in the saved state but "
                    f"{mine!r} here"
                )
        saved = {entry["path"]: entry for entry in state["sources"].values()}
        self._drawn = None  # what the state says wins
        for name, loader in self.loaders.items():
            entry = saved.get(self.paths[name])
            if entry is None:
                loader.reset()
                continue
            try:
                loader.load_state_dict(entry["loader"])
            except ValueError as e:
                raise ValueError(f"{self.paths[name]}: {e}") from None
        self.position, self._ahead = int(state["position"]), None
        was = {name: entry["weight"] for name, entry in state["sources"].items()}
        now = {name: float(w) for name, w in zip(self.paths, self.weights)}
        if [(e["path"], e["weight"]) for e in state["sources"].values()] == list(
            zip(self.paths.values(), now.values())
        ):
            self.base = np.array([e["base"] for e in state["sources"].values()], dtype=np.int64)
            return
        self.base = self.counts()
        new = [name for name, path in self.paths.items() if path not in saved]
        log(
            "data_dir's mixture changed since the checkpoint ("
            + ", ".join(f"{n} {w:.3g}" for n, w in was.items())
            + " -> "
            + ", ".join(f"{n} {w:.3g}" for n, w in now.items())
            + "): each source continues where it was"
            + (f" ({', '.join(new)} from its start)" if new else "")
            + " and the new weights apply from here",
            note=True,
        )


def open_loader(cfg, split, rank=0, world_size=1, manifests=None):
    """The run's Loader of `split`: a DataLoader of cfg.data_dir, or a Mixture where it names several datasets
    (parse_mixture). cfg: a TrainConfig (data_dir, batch_size, block_size, seed, vocab_size, packing); batch_size
    'auto' reads 1 row until batch_size='auto' is resolved (memory.probe_batch_size)."""
    sources = parse_mixture(cfg.data_dir)
    batch_size = 1 if cfg.batch_size == "auto" else cfg.batch_size
    options = dict(
        rank=rank,
        world_size=world_size,
        seed=cfg.seed,
        vocab_size=cfg.vocab_size,
        packing=cfg.packing,
        manifests=manifests,
    )
    if sources:
        return Mixture(sources, split, batch_size, cfg.block_size, **options)
    return DataLoader(cfg.data_dir, split, batch_size, cfg.block_size, **options)


def runs(values):
    """[(start, end)] of the runs of equal values in a non-decreasing 1-D array (usually one: no search)."""
    if values[0] == values[-1]:
        return [(0, len(values))]
    cuts = [0, *(np.flatnonzero(values[1:] != values[:-1]) + 1).tolist(), len(values)]
    return list(zip(cuts, cuts[1:]))


def batch_tensors(window, keep):
    """(x, y) int64 CPU tensors (B, T) of rows of T+1 ids (window); y is -1 where keep (if any) is 0."""
    import torch  # not at the top: prepare_data's tokenizer workers import this module and need no torch

    x = torch.from_numpy(window[:, :-1].astype(np.int64))  # (B, T)
    y = window[:, 1:].astype(np.int64)
    if keep is not None:
        y[keep[:, 1:] == 0] = -1
    return x, torch.from_numpy(y)  # (B, T) each
