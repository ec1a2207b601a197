"""Mixtures of prepared datasets: data_dir "a:0.75,b:0.25" (parse_mixture) trains on rows drawn from each by weight
(Mixture, one data.DataLoader per source, which data.open_loader opens). Imported only when data_dir names a
mixture (shards.names_mixture): a run on one dataset never loads this module."""

import math
import os
import re
from pathlib import Path

import numpy as np

from gpt2train.console import log
from gpt2train.shards import batch_tensors, names_mixture


def parse_mixture(data_dir):
    """{name: (path, weight)} of a data_dir that names a mixture of prepared datasets (shards.names_mixture: a dict
    {path: weight} or a string "path:weight,path:weight"), weights scaled to sum to 1; None for one source (a
    directory or a glob of shards, whatever ':' or ',' it holds). A weight is a share of the rows drawn, >= 0 (0:
    validated, never trained on). A source's name is its path's last part without glob characters, made unique by
    _2, _3 ... in order. ValueError (one line) for a malformed mixture, or one directory named twice (`a`, `a/`, a
    link to it)."""
    if not names_mixture(data_dir):
        return None
    if isinstance(data_dir, dict):
        items = [(str(path), weight) for path, weight in data_dir.items()]
    else:
        text = str(data_dir)
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


# a mixture reads each rank's rows of up to AHEAD_STEPS micro-steps (AHEAD_TOKENS at most) at a time: a read costs
# tens of microseconds per source whatever its size, a micro-batch of one source's windows about as much
AHEAD_STEPS, AHEAD_TOKENS = 128, 1 << 22


class Mixture:
    """(x, y) batches from several prepared datasets (the sources of parse_mixture), each row from one source, in
    proportion to the weights: one DataLoader per source, each with its own stream position and epochs (a source
    that runs out starts its next epoch, and a note says so).

    Which source supplies each row of the global stream (all ranks' rows, as DataLoader's) is a schedule worked out
    from the sources' row counts alone: source s's k-th row since its weights were set is due at (k + phase_s) /
    weight_s, with phase_s in [0, 1) drawn from the seed, and rows go to the sources in order of due time (ties: the
    first source). So it is the same on every rank (each works out the whole stream's sources and reads its own B
    rows of each micro-step), a checkpoint of the counts resumes it exactly, and after any n rows each source has
    supplied weight * n rows give or take one or two: a 0.75/0.25 mixture is 3:1 in every stretch of rows. A weight
    of 0 never draws (the source is still validated). A resume with other weights continues every source where it
    was and applies the new weights from there (load_state_dict). Rows are read many micro-steps ahead, one read per
    source, so a batch costs about what one source's does."""

    def __init__(self, sources):
        """sources: {name: (its DataLoader, its weight)}, weights summing to 1, the loaders of one split and one
        stream's settings (B, T, rank, world_size, seed): data.open_mixture opens them."""
        self.loaders = {name: loader for name, (loader, _) in sources.items()}
        self.paths = {name: loader.data_dir for name, loader in self.loaders.items()}
        self.weights = np.array([weight for _, weight in sources.values()], dtype=np.float64)
        first = next(iter(self.loaders.values()))
        self.B, self.T = first.B, first.T
        self.rank, self.world_size, self.seed = first.rank, first.world_size, first.seed
        self.phase = np.random.Generator(np.random.PCG64([self.seed, 2])).random(len(sources))  # tag 2: not a loader's
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
