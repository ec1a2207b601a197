"""The token shard and loss-mask file format: what prepare_data.py writes and a loader reads, each file checked.

Shard format (llm.c's): a header of 256 little-endian int32 (magic 20240520, version 1, token
count, then zeros), followed by the tokens as little-endian uint16. Every document is preceded
by the end-of-text token 50256. prepare_data.py writes these; the loader also reads nanoGPT's
headerless uint16 `.bin` files and build-nanogpt's uint16 `.npy` shards.

Loss masks (supervised fine-tuning, prepare_data.py --format sft): a shard X.bin may have a mask shard X.mask
beside it: the same llm.c header with magic MASK_MAGIC, version 1, the token count and 0 (the row length of
an older format, which packed rows at prep time), then one uint8 per token, 1 where that token is a trained
target. A batch of rows read from shards becomes (x, y) tensors with y = -1 where a target is not trained
(batch_tensors).

A data_dir is a directory of shards or a glob of them (find_shards), or names a mixture of prepared datasets
(names_mixture; mixture.py reads it).
"""

import glob
import os
import re
from pathlib import Path

import numpy as np

from gpt2train.console import progress_bar
from gpt2train.documents import PrepError
from gpt2train.files import atomic_write

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
SHARD_SUFFIXES = (".bin", ".npy")
MASK_MAGIC = 20240527
MASK_SUFFIX = ".mask"
DEFAULT_SHARD_TOKENS = 100_000_000  # llm.c / build-nanogpt: 100M tokens (200 MB) per shard


class ShardError(ValueError):
    """A shard file that cannot be used; the message names the file and what was expected."""


class NoShardsError(ShardError):
    """A data directory that does not exist or holds no shards of a split (not prepared yet?); data_dir: which."""

    def __init__(self, message, data_dir=None):
        super().__init__(message)
        self.data_dir = data_dir


def shard_header(num_tokens, magic=MAGIC):
    """The 1024 header bytes of an llm.c shard holding num_tokens tokens (of a loss-mask shard: magic MASK_MAGIC)."""
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (magic, VERSION, num_tokens)
    return header.tobytes()


def as_uint16(ids, source):
    """ids as the uint16 array a shard holds; PrepError naming `source` (what made them) for an id of 65,536 or
    more, which a cast would wrap silently into another id."""
    if ids.size and int(ids.max()) >= 2**16:
        raise PrepError(f"{source}: token id {int(ids.max()):,} does not fit the shards' uint16 (0 to 65,535)")
    return ids.astype(np.uint16)


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

    def write(f):
        f.write(shard_header(mask.size, MASK_MAGIC))
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


def check_shards_vocab(paths, shards, vocab_size, progress=True, chunk=1 << 26, records=None):
    """Every token id of every shard < vocab_size, before training starts (ShardError naming the shard and
    the id otherwise). A shard's max id comes from its manifest record (manifests.manifest_records) if the shard was not
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


SPLITS = ("train", "val", "test")  # test: held out from training (prepare_data.py --test_input, evaluate.py --split)
SPLIT_WORD = re.compile(rf"(?:^|[_.-])({'|'.join(SPLITS)})(?=$|[_.-])")


def shard_split(name):
    """The split a shard file belongs to by its name: the last of train/val/test that is a word of its stem
    (`x_train_000001.bin`, `train.bin`, `edufineweb_val_000000.npy`; prepare_data.py's `train_val_000000.bin`, the
    val shard of an input named train.jsonl, is val), or None."""
    words = SPLIT_WORD.findall(Path(name).stem)
    return words[-1] if words else None


def find_shards(data_dir, split):
    """Sorted shard files (.bin/.npy) of one split in data_dir: the names shard_split gives that split.
    data_dir may also be a glob pattern (`data/fw/fineweb_edu_*`)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    data_dir = str(data_dir)
    if any(c in data_dir for c in "*?["):
        candidates = [Path(p) for p in sorted(glob.glob(data_dir))]
    elif os.path.isdir(data_dir):
        candidates = sorted(Path(data_dir).iterdir())
    elif os.path.exists(data_dir):
        raise ShardError(f"{data_dir}: is a file, not a data directory (data_dir: a directory of shards, or a glob)")
    else:
        raise NoShardsError(f"{data_dir}: no such data directory", data_dir)
    named = [p for p in candidates if p.suffix in SHARD_SUFFIXES and shard_split(p.name) == split]
    dangling = [p for p in named if p.is_symlink() and not p.exists()]
    if dangling:  # not skipped: the run would train on less data than the directory shows
        raise ShardError(f"{dangling[0]}: a symlink to {os.readlink(dangling[0])}, which does not exist")
    paths = [p for p in named if p.is_file()]
    if not paths:
        raise NoShardsError(
            f"{data_dir}: no {split} shards (*.bin or *.npy files with '{split}' in the name)", data_dir
        )
    return paths


def names_mixture(data_dir):
    """True where data_dir names a mixture of prepared datasets (mixture.parse_mixture reads it): a dict {path:
    weight} (a config file), or a text "path:weight,path:weight" (the command line). A text that names an existing
    directory or matches files is one source, whatever ':' or ',' it holds (`run:1`, `2026-11-28T10:30`)."""
    if isinstance(data_dir, dict):
        return True
    text = str(data_dir)
    if os.path.isdir(text) or (any(c in text for c in "*?[") and glob.glob(text)):
        return False
    path, _, weight = text.rpartition(":")
    return "," in text or bool(path and re.fullmatch(r"\s*[0-9.eE+-]+\s*", weight))


def batch_tensors(window, keep):
    """(x, y) int64 CPU tensors (B, T) of rows of T+1 ids (window); y is -1 where keep (if any) is 0."""
    import torch  # not at the top: prepare_data's tokenizer workers import this module and need no torch

    x = torch.from_numpy(window[:, :-1].astype(np.int64))  # (B, T)
    y = window[:, 1:].astype(np.int64)
    if keep is not None:
        y[keep[:, 1:] == 0] = -1
    return x, torch.from_numpy(y)  # (B, T) each
