"""The loader that turns a prepared dataset's token shards (shards.py) into (x, y) training batches: rows of the
shards, packed as windows or as whole documents, in a world-size-invariant stream that resumes exactly
(DataLoader). open_loader opens a run's loader: a DataLoader, or a mixture.Mixture of one per source where data_dir
names several datasets; both meet Loader, all that the rest of the run calls.

Samples (rows of block_size+1 tokens: x = row[:-1], y = row[1:]) never cross a shard boundary. packing='window':
non-overlapping windows at stride block_size. packing='document': every row starts at a document start (or
continues a document longer than a row), whole documents packed best-fit into rows, the rest of a row padding
that is never a target (DocumentRows).

SFT data (shards with loss masks, shards.py) is always read as rows of whole conversations (packing='document'; a
conversation longer than a row is left out, counted and reported), and the loader yields y = -1 where the mask is 0.
"""

import bisect
import copy
import os
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from gpt2train.assets import EOT
from gpt2train.manifests import manifest_records, read_manifests
from gpt2train.shards import (
    MASK_SUFFIX,
    ShardError,
    batch_tensors,
    check_shards_vocab,
    find_shards,
    load_masks,
    load_shard,
    names_mixture,
)

PACKINGS = ("window", "document")


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
    (one prepared dataset) or mixture.Mixture (several), so that none of them asks which one it holds."""

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


def check_stream(batch_size, block_size, rank, world_size, seed, packing):
    """ValueError, one line, unless these settings of a DataLoader's stream are possible."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    if batch_size < 1 or block_size < 1 or seed < 0:
        raise ValueError(
            f"batch_size and block_size must be >= 1 and seed >= 0 (got {batch_size}, {block_size}, {seed})"
        )
    if packing not in PACKINGS:
        raise ValueError(f"packing must be one of {', '.join(PACKINGS)}, got {packing!r}")


class DataLoader:
    """(x, y) batches of B x T token ids from the shards of one split.

    The data is a sequence of samples (rows: windows or packed documents, see the module docstring). The
    stream is the infinite concatenation of epochs; epoch e visits every sample once, in an order fixed by
    (seed, e): shards in a permuted order, each shard's samples in a permuted order (the train split;
    other splits in file order: shuffle). Micro-step k of the whole job consumes stream positions
    [k*B*W, (k+1)*B*W) and rank r reads only [k*B*W + r*B, k*B*W + (r+1)*B). So the samples of an
    optimizer step depend only on W*B*accumulation, and an epoch is covered exactly once across
    ranks. A micro-batch that reaches the end of an epoch continues into the next one (the stream
    position is just a number: nothing is dropped or repeated within any epoch). Document rows are a
    deterministic function of the shards and block_size, so the position is all the state there is.
    """

    def __init__(self, cfg, split, rank=0, world_size=1, manifests=None):
        """cfg: what the loader reads of a run's config (a TrainConfig, or any record with its data_dir, batch_size,
        block_size, seed, vocab_size, packing; batch_size 'auto' reads 1 row until it is resolved,
        step.probe_batch_size); manifests: read_manifests(cfg.data_dir) where a run's start read them already."""
        batch_size = 1 if cfg.batch_size == "auto" else cfg.batch_size
        check_stream(batch_size, cfg.block_size, rank, world_size, cfg.seed, cfg.packing)
        self.B, self.T = batch_size, cfg.block_size
        self.rank, self.world_size = rank, world_size
        self.seed = cfg.seed
        self.vocab_size = cfg.vocab_size
        self.shuffle = split == "train"
        self.data_dir = str(cfg.data_dir)
        self._open_shards(split, manifests)
        self.packing = "document" if self.masks is not None else cfg.packing  # SFT: rows of whole conversations
        # masked: some targets are -1 (SFT masks, document rows' padding), so a step weighs micro-batches by them
        self.masked = self.packing == "document"
        self._make_samples()
        self._refuse_no_samples(split)
        self._plans = {}  # epoch -> (shard order, cumulative sample counts in that order)
        self._perms = {}  # (epoch, shard) -> permutation of that shard's samples
        self.position = 0  # global stream position: samples consumed by all ranks together

    def _open_shards(self, split, manifests):
        """The split's shards (self.paths), memory-mapped and checked: a prep's against its manifests (read now unless
        a run's start read them), token ids against vocab_size; the token that starts a document (self.doc_token);
        SFT data's loss masks (self.masks, self.trained_tokens; None for text)."""
        self.paths = find_shards(self.data_dir, split)
        if manifests is None:  # a run's start read them already (resume.start)
            manifests = read_manifests(self.data_dir)
        records = manifest_records(self.paths, split, manifests)  # a prep's shards: all there, none foreign, finished
        # what starts a document: the <|endoftext|> of the tokenizer the manifest records, else GPT-2's
        self.doc_token = next((r["doc_token"] for r in records.values() if "doc_token" in r), EOT)
        # Memory-mapped once, headers validated; plain ndarray views skip np.memmap's per-slice overhead.
        self.shards = [load_shard(p).view(np.ndarray) for p in self.paths]
        self.mapped = [mapped_file(p) for p in self.paths]  # what _fill checks before each read
        if self.vocab_size is not None:  # now, not when a shard is first read many steps into the run
            check_shards_vocab(self.paths, self.shards, self.vocab_size, progress=self.rank == 0, records=records)
        masks = load_masks(self.paths, self.shards, records, self.data_dir)  # SFT data; None for text
        if masks is not None:
            self.mapped = [
                [*files, *mapped_file(Path(p).with_suffix(MASK_SUFFIX))] for p, files in zip(self.paths, self.mapped)
            ]
        self.masks = None if masks is None else [m for m, _ in masks]
        self.trained_tokens = None if masks is None else sum(n for _, n in masks)

    def _make_samples(self):
        """Each shard's samples: document rows (self.rows; SFT data's trained tokens less those of the conversations
        left out) or windows at stride T (self.windows), and how many (samples_per_shard, num_samples)."""
        T = self.T
        self.rows = None
        if self.packing == "document":
            self.rows = [DocumentRows(s, T + 1, self.doc_token, split_long=self.masks is None) for s in self.shards]
            self.samples_per_shard = np.array([r.num_rows for r in self.rows], dtype=np.int64)
            if self.masks is not None:  # the trained tokens of the conversations left out
                self.trained_tokens -= sum(
                    int(m[s : s + n].sum(dtype=np.int64))
                    for r, m in zip(self.rows, self.masks)
                    for s, n in zip(*r.left_out)
                )
        else:
            self.samples_per_shard = np.array([max(0, (len(s) - 1) // T) for s in self.shards], dtype=np.int64)
            # each shard as its (samples, T+1) windows at stride T, a view: a batch copies whole rows out of it
            self.windows = [
                np.lib.stride_tricks.as_strided(s, (n, T + 1), (T * s.strides[0], s.strides[0]), writeable=False)
                for s, n in zip(self.shards, self.samples_per_shard.tolist())
            ]
        self.num_samples = int(self.samples_per_shard.sum())

    def _refuse_no_samples(self, split):
        """ShardError, one line saying what to change, when the split has no sample of block_size+1 tokens, or SFT
        data's masks train no token."""
        if self.masks is not None and self.num_samples and not self.trained_tokens:
            raise ShardError(
                f"{self.data_dir}: the loss masks of the {split} shards mark no token as trained; "
                "prepare the data again"
            )
        if self.num_samples:
            return
        if self.masks is not None:
            shortest = min(int(n.min()) for r in self.rows for n in r.left_out[1:] if len(n))
            raise ShardError(
                f"{self.data_dir}: every {split} conversation is longer than block_size+1 = {self.T + 1} tokens (the "
                f"shortest has {shortest}); train with block_size >= {shortest - 1}"
            )
        total = sum(len(s) for s in self.shards)
        more = "prepare it again with a larger --val_tokens" if split == "val" else "prepare more text"
        raise ShardError(
            f"{self.data_dir}: the {split} shards hold {total} tokens; none has the block_size+1 = {self.T + 1} "
            f"tokens of one sample: {more}, or train with a smaller block_size"
        )

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
            rng = np.random.Generator(np.random.PCG64([self.seed, epoch, 0]))
            order = rng.permutation(n) if self.shuffle else np.arange(n)
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
        """window[rows] (and keep[rows]) = the samples of a shard; ShardError if one holds an id >= vocab_size, or if
        the shard shrank since it was opened (check_mapped)."""
        T = self.T
        check_mapped(self.mapped[shard])
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


def open_loader(cfg, split, rank=0, world_size=1, manifests=None):
    """The run's Loader of `split`: a DataLoader of cfg.data_dir, or a Mixture where it names several datasets
    (shards.names_mixture; only then is mixture.py imported). cfg: as DataLoader's."""
    if names_mixture(cfg.data_dir):
        return open_mixture(cfg, split, rank, world_size, manifests)
    return DataLoader(cfg, split, rank, world_size, manifests)


def open_mixture(cfg, split, rank=0, world_size=1, manifests=None):
    """A Mixture of the sources cfg.data_dir names (mixture.parse_mixture): a DataLoader of each source's `split`,
    each with cfg's settings and its source's path as data_dir."""
    from gpt2train.mixture import Mixture, parse_mixture

    sources = {}
    for name, (path, weight) in parse_mixture(cfg.data_dir).items():
        source = copy.copy(cfg)
        source.data_dir = path
        sources[name] = (DataLoader(source, split, rank, world_size, manifests), weight)
    return Mixture(sources)


def mapped_file(path):
    """[(path, (device, inode), size)] of a file the loader memory-maps, as it was when opened (check_mapped)."""
    st = os.stat(path)
    return [(path, (st.st_dev, st.st_ino), st.st_size)]


def check_mapped(files):
    """ShardError where a memory-mapped file (mapped_file's) was truncated in place since it was opened (`cp` or
    `rsync --inplace` over a data directory in use): a read of its pages past the new end would kill the process
    with SIGBUS, with no message and the steps since the last save lost. A file replaced by another (a rename over
    it, a deletion) is left alone: the map still reads the old one, which stays whole."""
    for path, inode, size in files:
        try:
            st = os.stat(path)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == inode and st.st_size < size:
            raise ShardError(
                f"{path}: {st.st_size:,} bytes, {size:,} when the run opened it: the shard changed under the run "
                f"(truncated in place); restore or re-prepare it"
            )


def runs(values):
    """[(start, end)] of the runs of equal values in a non-decreasing 1-D array (usually one: no search)."""
    if values[0] == values[-1]:
        return [(0, len(values))]
    cuts = [0, *(np.flatnonzero(values[1:] != values[:-1]) + 1).tolist(), len(values)]
    return list(zip(cuts, cuts[1:]))
