"""Token shards on disk and the loader that turns them into (x, y) training batches.

Shard format (llm.c's): a header of 256 little-endian int32 (magic 20240520, version 1, token
count, then zeros), followed by the tokens as little-endian uint16. Every document is preceded
by the end-of-text token 50256. prepare_data.py writes these; the loader also reads nanoGPT's
headerless uint16 `.bin` files and build-nanogpt's uint16 `.npy` shards.

Samples are non-overlapping windows of block_size+1 tokens at stride block_size within a shard
(x = window[:-1], y = window[1:]); a window never crosses a shard boundary.

Loss masks (supervised fine-tuning, prepare_data.py --format sft): a shard X.bin may have a mask shard X.mask
beside it: the same llm.c header with magic MASK_MAGIC, version 1, the token count and the row length (the
block_size it was packed for), then one uint8 per token, 1 where that token is a trained target. The loader
then yields y = -1 where the mask is 0, which the loss ignores.
"""
import glob
import json
import os
import re
from pathlib import Path

import numpy as np
from tqdm import tqdm

from files import atomic_write

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
SHARD_SUFFIXES = (".bin", ".npy")
MASK_MAGIC = 20240527
MASK_SUFFIX = ".mask"


class ShardError(ValueError):
    """A shard file that cannot be used; the message names the file and what was expected."""


class NoShardsError(ShardError):
    """A data directory that does not exist or holds no shards of a split (not prepared yet?)."""


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


def write_mask(path, mask, row_tokens):
    """Write a loss-mask shard (0/1 per token, rows of row_tokens) atomically; see the module docstring."""
    mask = np.asarray(mask, dtype=np.uint8)
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:4] = (MASK_MAGIC, VERSION, mask.size, row_tokens)

    def write(f):
        f.write(header.tobytes())
        f.write(mask.data)
    atomic_write(Path(path), write)


def load_mask(path, num_tokens, block_size):
    """Memory-map a loss-mask shard as uint8; ShardError naming the file unless it is a mask of num_tokens
    tokens packed in rows of block_size."""
    path = Path(path)
    size = path.stat().st_size
    head = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    if len(head) < HEADER_INTS or head[0] != MASK_MAGIC or head[1] != VERSION:
        raise ShardError(f"{path}: not a loss-mask shard (expected magic {MASK_MAGIC}, version {VERSION})")
    count, row = int(head[2]), int(head[3])
    if count != num_tokens or size != HEADER_BYTES + count:
        raise ShardError(f"{path}: loss mask of {count} tokens ({size} bytes) for a token shard of {num_tokens} tokens")
    if row != block_size:
        raise ShardError(f"{path}: rows were packed for block_size {row}, this run has block_size {block_size}; "
                         f"train with block_size={row} or prepare the data again with --block_size {block_size}")
    return np.memmap(path, dtype=np.uint8, mode="r", offset=HEADER_BYTES, shape=(count,)).view(np.ndarray)


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
            raise ShardError(f"{path}: .npy shard must be a 1-D uint16 array, got {tokens.dtype} of shape {tokens.shape}"
                             " (convert with np.save(path, a.astype(np.uint16)) if all ids are < 65536)")
    else:
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
        if _looks_like_header(head):
            if len(head) < HEADER_BYTES:
                raise ShardError(f"{path}: truncated llm.c shard: {size} bytes, shorter than the {HEADER_BYTES}-byte header")
            magic, version, count = (int(v) for v in np.frombuffer(head, dtype="<i4")[:3])
            if magic != MAGIC:
                raise ShardError(f"{path}: bad magic {magic} in the llm.c shard header (expected {MAGIC})")
            if version != VERSION:
                raise ShardError(f"{path}: unsupported llm.c shard version {version} (expected {VERSION}, uint16 tokens)")
            if count < 0 or size != HEADER_BYTES + 2 * count:
                kind = "truncated" if size < HEADER_BYTES + 2 * count else "corrupt"
                raise ShardError(f"{path}: {kind} llm.c shard: header says {count} tokens "
                                 f"({HEADER_BYTES + 2 * count} bytes), file has {size} bytes")
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
        raise ShardError(f"{path}: token id {int(tokens[where])} >= vocab_size {vocab_size} (first bad id at token "
                         f"{where:,}); tokenized for another vocabulary?")


def manifest_records(paths, split):
    """{shard path: its record} for the shards that prepare_data's manifests (<name>_manifest.json next to them)
    describe, after checking that each manifest covers its `split` shards: the prep finished (the manifest says
    complete, and no prepare_data.py holds the directory's lock), every shard it lists is there at its recorded
    size, and no shard under its <name>_ prefix is unlisted. ShardError naming the file otherwise. Shards
    without a manifest (nanoGPT's, build-nanogpt's) are left out."""
    from files import lock_holder
    found, paths = {}, [Path(p) for p in paths]
    for directory in sorted({p.parent for p in paths}):
        manifests = sorted(directory.glob("*_manifest.json"))
        holder = lock_holder(directory) if manifests else None
        if holder and holder.startswith("prepare_data.py"):
            raise ShardError(f"{directory} is being written by {holder}: wait until it ends")
        for manifest in manifests:
            name = manifest.name[:-len("_manifest.json")]
            try:
                m = json.loads(manifest.read_text())
                records = {directory / r["file"]: r for r in m["shards"] if r["split"] == split}
                sizes = {path: HEADER_BYTES + 2 * int(r["tokens"]) for path, r in records.items()}
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ShardError(f"{manifest}: unreadable prep manifest ({type(e).__name__}: {e}); run "
                                 f"prepare_data.py again, or delete it to train on the shards unchecked") from None
            if not m.get("complete"):
                raise ShardError(f"{manifest}: the prep that writes {name}_* did not finish; run it again to complete it")
            for path, size in sizes.items():
                have = path.stat().st_size if path.is_file() else None
                if have != size:
                    what = "is missing" if have is None else f"has {have:,} bytes, the manifest records {size:,}"
                    raise ShardError(f"{path}: listed in {manifest.name} but {what}; run prepare_data.py again")
            unlisted = [p for p in paths if p.parent == directory and p.name.startswith(f"{name}_") and p not in records]
            if unlisted:
                raise ShardError(f"{unlisted[0]}: not in {manifest.name} (another prep's shard?); move it out of "
                                 f"{directory}, or run prepare_data.py again")
            written = manifest.stat().st_mtime_ns  # after each of its shards
            found.update({path: {**r, "manifest_mtime_ns": written} for path, r in records.items()})
    return found


def data_tokenizer(data_dir):
    """The tokenizer of the train shards in data_dir (a directory or a glob), as prepare_data.py's manifests record it
    (assets.tokenizer_record; "json" read back from the <name>_tokenizer.json beside them and checked against its
    hash), or None where no manifest says (shards of other tools: assumed GPT-2's). A manifest from before tokenizers
    were recorded means GPT-2's ("n_vocab" None). ShardError when the manifests name different tokenizers (e.g. a
    glob over two data directories) or a tokenizer file is missing or changed."""
    import hashlib
    found = {}
    for directory in sorted({p.parent for p in find_shards(data_dir, "train")}):
        for manifest in sorted(directory.glob("*_manifest.json")):
            try:
                m = json.loads(manifest.read_text())
                record = m.get("tokenizer") or {"id": "gpt2", "n_vocab": None, "eot": 50256, "source": None}
                record = {**record, "json": None}
                if "file" in record:
                    record["json"] = (directory / record["file"]).read_text(encoding="utf-8")
            except (OSError, ValueError, TypeError, AttributeError) as e:
                raise ShardError(f"{manifest}: cannot read its tokenizer ({type(e).__name__}: {e}); run "
                                 f"prepare_data.py again") from None
            if record["json"] is not None and record["id"] != "sha256:" + hashlib.sha256(
                    record["json"].encode()).hexdigest()[:16]:
                raise ShardError(f"{directory / record['file']}: changed since {manifest.name} recorded it as "
                                 f"{record['id']}; run prepare_data.py again")
            found[manifest] = record
    ids = {r["id"] for r in found.values()}
    if len(ids) > 1:
        (a, ra), (b, rb) = [next((m, r) for m, r in found.items() if r["id"] == i) for i in sorted(ids)[:2]]
        raise ShardError(f"{data_dir}: its shards come from two tokenizers: {a} has {ra['id']}, {b} has {rb['id']}; "
                         f"train on one tokenizer's data")
    return next(iter(found.values()), None)


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
    with tqdm(total=total, unit="tok", unit_scale=True, desc="checking token ids", dynamic_ncols=True,
              disable=not progress or 2 * total < 2**30) as bar:
        for path, tokens in todo:
            top = 0
            for start in range(0, len(tokens), chunk):
                top = max(top, int(tokens[start:start + chunk].max()))
                bar.update(min(chunk, len(tokens) - start))
            check_vocab(tokens, vocab_size, path, top=top)


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
        raise NoShardsError(f"{data_dir}: no such data directory")
    word = re.compile(rf"(^|[_.-]){split}($|[_.-])")
    paths = [p for p in candidates if p.suffix in SHARD_SUFFIXES and p.is_file() and word.search(p.stem)]
    if not paths:
        raise NoShardsError(f"{data_dir}: no {split} shards (*.bin or *.npy files with '{split}' in the name)")
    return paths


class DataLoader:
    """(x, y) batches of B x T token ids from the shards of one split.

    The data is a sequence of samples (windows, see the module docstring). The stream is the
    infinite concatenation of epochs; epoch e visits every sample once, in an order fixed by
    (seed, e): shards in a permuted order, each shard's samples in a permuted order (or in file
    order when shuffle is False). Micro-step k of the whole job consumes stream positions
    [k*B*W, (k+1)*B*W) and rank r reads only [k*B*W + r*B, k*B*W + (r+1)*B). So the samples of an
    optimizer step depend only on W*B*accumulation, and an epoch is covered exactly once across
    ranks. A micro-batch that reaches the end of an epoch continues into the next one (the stream
    position is just a number: nothing is dropped or repeated within any epoch).
    """

    def __init__(self, data_dir, split, batch_size, block_size, rank=0, world_size=1, seed=0,
                 vocab_size=None, shuffle=None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if batch_size < 1 or block_size < 1 or seed < 0:
            raise ValueError(f"batch_size and block_size must be >= 1 and seed >= 0 (got {batch_size}, {block_size}, {seed})")
        self.B, self.T = batch_size, block_size
        self.rank, self.world_size = rank, world_size
        self.seed = seed
        self.vocab_size = vocab_size
        self.shuffle = (split == "train") if shuffle is None else bool(shuffle)
        self.paths = find_shards(data_dir, split)
        records = manifest_records(self.paths, split)  # a prep's shards: all there, none foreign, prep finished
        # Memory-mapped once, headers validated; plain ndarray views skip np.memmap's per-slice overhead.
        self.shards = [load_shard(p).view(np.ndarray) for p in self.paths]
        if vocab_size is not None:  # now, not when a shard is first read many steps into the run
            check_shards_vocab(self.paths, self.shards, vocab_size, progress=rank == 0, records=records)
        # loss masks: all shards have one (SFT data) or none does
        masks = [p.with_suffix(MASK_SUFFIX) for p in self.paths]
        have = [m.is_file() for m in masks]
        if any(have) and not all(have):
            raise ShardError(f"{masks[have.index(False)]}: missing loss-mask shard (other shards of {data_dir} have one)")
        self.masks = [load_mask(m, len(s), block_size) for m, s in zip(masks, self.shards)] if all(have) else None
        self._window_offsets = np.arange(block_size + 1)
        self.samples_per_shard = np.array([max(0, (len(s) - 1) // block_size) for s in self.shards], dtype=np.int64)
        self.num_samples = int(self.samples_per_shard.sum())
        if self.num_samples == 0:
            total = sum(len(s) for s in self.shards)
            raise ShardError(f"{data_dir}: the {split} shards hold {total} tokens; none has the "
                             f"block_size+1 = {block_size + 1} tokens of one sample")
        self._plans = {}  # epoch -> (shard order, cumulative sample counts in that order)
        self._perms = {}  # (epoch, shard) -> permutation of that shard's samples
        self.position = 0  # global stream position: samples consumed by all ranks together

    def summary(self):
        """'9 shards, 5,516 tokens' (the start-up line's)."""
        return f"{len(self.paths)} shards, {sum(len(s) for s in self.shards):,} tokens"

    @property
    def epoch(self):
        return self.position // self.num_samples

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
            order = (np.random.Generator(np.random.PCG64([self.seed, epoch, 0])).permutation(n)
                     if self.shuffle else np.arange(n))
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
            yield done, shard, self._perm(epoch, shard)[begin:begin + take]
            done += take

    def next_batch(self):
        """The next (x, y) of this rank: int64 CPU tensors of shape (B, T); y[:, t] == x[:, t+1], or -1 where a
        loss mask is off."""
        B, T = self.B, self.T
        window = np.empty((B, T + 1), dtype=np.uint16)
        keep = np.empty((B, T + 1), dtype=np.uint8) if self.masks else None
        for at, shard, samples in self._runs(self.position + self.rank * B, B):  # usually a single run
            starts = samples * T
            where = starts[:, None] + self._window_offsets
            rows = window[at:at + len(samples)]
            rows[:] = self.shards[shard][where]  # (b, T+1) gather
            if self.vocab_size is not None and rows.size and int(rows.max()) >= self.vocab_size:  # changed since start
                row, col = np.argwhere(rows >= self.vocab_size)[0]
                raise ShardError(f"{self.paths[shard]}: token id {int(rows[row, col])} >= vocab_size {self.vocab_size} "
                                 f"at token {int(starts[row]) + int(col):,}: the shard changed after the run checked it "
                                 f"at start; restore or re-prepare it")
            if keep is not None:
                keep[at:at + len(samples)] = self.masks[shard][where]
        self.position += B * self.world_size
        import torch  # not at the top: prepare_data's tokenizer workers import this module and need no torch
        x = torch.from_numpy(window[:, :-1].astype(np.int64))  # (B, T)
        y = window[:, 1:].astype(np.int64)
        if keep is not None:
            y[keep[:, 1:] == 0] = -1
        return x, torch.from_numpy(y)  # (B, T) each

    def state_dict(self):
        """Plain ints/bools: the stream position and what identifies the stream."""
        return {"position": int(self.position), "seed": int(self.seed), "block_size": int(self.T),
                "num_samples": int(self.num_samples), "shuffle": bool(self.shuffle)}

    def load_state_dict(self, state):
        """Continue the exact stream of the loader that saved state (any B/world_size split)."""
        for key in ("seed", "block_size", "num_samples", "shuffle"):
            mine = getattr(self, {"block_size": "T"}.get(key, key))
            if state.get(key) != mine:
                raise ValueError(f"loader state is for a different stream: {key} is {state.get(key)!r} "
                                 f"in the saved state but {mine!r} here (data or settings changed?)")
        self.position = int(state["position"])
