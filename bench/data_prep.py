"""Data benchmarks (not a test): prepare_data.py's throughput against tiktoken's raw
encode_ordinary_batch on the same text and number of processes, prepare_data.py with a tokenizer.json (--tokenizer)
against GPT-2's tiktoken path on the same text, the loader's time per batch, and a 4-source mixture's time per batch
against one source's. Run from the repository root:

    python -m bench.data_prep                      # all CPUs, Tiny Shakespeare x4, B=16 T=1024
    python -m bench.data_prep --num_proc 8 --copies 16 --batch_size 64
    python -m bench.data_prep --only tokenizers --tokenizer tok/mine   # just the tokenizer comparison
    python -m bench.data_prep --only mixture --repeats 30              # a mixture.Mixture of 4 vs one DataLoader

Text: Tiny Shakespeare (the assets fetcher), repeated --copies times, cut two ways: one document
per speech (~45 tokens, the worst case for per-document overhead) and ~4 KB pages (~1,000 tokens,
like a web document). Every rate is the best of --repeats runs. On a machine whose cores are busy
with other work, trust the CPU-time lines (CPU seconds per token over all processes) more than
the wall-clock ones. POSIX only (resource.getrusage).
"""

import argparse
import json
import multiprocessing
import os
import re
import resource
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from bench import machine_line
from gpt2train.assets import fetch_shakespeare, get_tokenizer
from gpt2train.config import TrainConfig
from gpt2train.data import DataLoader, open_mixture
from gpt2train.documents import split_speeches
from gpt2train.mixture import AHEAD_STEPS
from gpt2train.shards import write_shard
from prepare_data import arg_parser, prepare


def prep(src, out_dir, name, num_proc, *flags):
    """prepare_data.prepare of one input, 10,000 val tokens, no progress bar; returns its summary."""
    args = [src, "--out_dir", out_dir, "--name", name, "--num_proc", num_proc, "--val_tokens", 10_000, *flags]
    return prepare(arg_parser().parse_args(["--input", *map(str, args), "--no_progress"]))


def best_seconds(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def cpu_seconds(fn):
    """(CPU seconds of this process and its reaped children, of this process alone) spent in fn()."""

    def now():
        me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime

    me0, kids0 = now()
    fn()
    me1, kids1 = now()
    return (me1 - me0) + (kids1 - kids0), me1 - me0


def _count_tokens(texts):  # pool worker: the raw tokenizer, nothing else
    return sum(map(len, get_tokenizer().encode_ordinary_batch(texts, num_threads=1)))


def _warm(_):
    get_tokenizer()


def chunks(docs, chars):
    batch, n = [], 0
    for d in docs:
        batch.append(d)
        n += len(d)
        if n >= chars:
            yield batch
            batch, n = [], 0
    if batch:
        yield batch


def bench_prep(docs, label, num_proc, repeats, tmp):
    """Wall-clock rates, the three measurements interleaved in each repeat so that a busy machine's
    quiet moments are shared fairly; then CPU time per token summed over all processes."""
    enc = get_tokenizer()
    tokens = sum(map(len, enc.encode_ordinary_batch(docs, num_threads=num_proc)))
    src = Path(tmp) / f"{label}.d"
    src.mkdir()
    with open(src / "docs.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    batches = list(chunks(docs, 1 << 18))
    threads, procs, prep = [], [], []
    with multiprocessing.Pool(num_proc) as pool:  # the raw pool is started and warmed outside the timing
        pool.map(_warm, range(num_proc))
        for r in range(repeats):
            threads.append(tokens / best_seconds(lambda: enc.encode_ordinary_batch(docs, num_threads=num_proc), 1))
            procs.append(tokens / best_seconds(lambda: sum(pool.map(_count_tokens, batches, chunksize=1)), 1))
            s = prep(src, Path(tmp) / f"{label}_out{r}", label, num_proc)
            prep.append(s["tokens"] / s["seconds"])  # everything: pool start, reading, EOTs, writing, sha256
    threads, procs, prep = max(threads), max(procs), max(prep)
    print(
        f"prep  {label:9s} {len(docs):7,} docs {tokens:10,} tokens | encode_ordinary_batch: "
        f"{threads / 1e6:5.2f}M tok/s ({num_proc} threads), {procs / 1e6:5.2f}M tok/s ({num_proc} processes) | "
        f"prepare_data: {prep / 1e6:5.2f}M tok/s = {100 * prep / max(threads, procs):3.0f}% of the faster (wall clock)"
    )

    # The same work in CPU seconds (all processes), which a busy machine disturbs much less than
    # wall time: the overhead prepare_data adds, and the main process's share, which caps scaling.
    def raw_pool():
        with multiprocessing.Pool(num_proc) as pool:
            sum(pool.map(_count_tokens, batches, chunksize=1))
            pool.close()
            pool.join()  # reaped, so their CPU time shows in RUSAGE_CHILDREN

    raw_cpu = min(cpu_seconds(raw_pool)[0] for _ in range(repeats))
    runs = [cpu_seconds(lambda: prep(src, Path(tmp) / f"{label}_cpu{r}", label, num_proc)) for r in range(repeats)]
    prep_cpu, main_cpu = min(runs)
    print(
        f"prep  {label:9s} CPU time per token, all processes: encode_ordinary_batch {raw_cpu / tokens * 1e9:5.0f} ns, "
        f"prepare_data {prep_cpu / tokens * 1e9:5.0f} ns = {100 * raw_cpu / prep_cpu:3.0f}% efficiency; "
        f"its main process {main_cpu / tokens * 1e9:4.0f} ns/token caps it at {tokens / main_cpu / 1e6:.0f}M tok/s"
    )


def bench_tokenizers(docs, label, num_proc, repeats, tmp, tokenizer_path):
    """prepare_data.py on the same text with GPT-2 (tiktoken), with the tokenizer.json (its tiktoken translation,
    bpe.HFTokenizer.encode_to_numpy) and with the same file read by the tokenizers library alone (an empty
    normalizer added: same ids, no translation). Rates in MB of text per second, wall clock and CPU seconds."""
    from gpt2train.bpe import open_tokenizer

    src = Path(tmp) / f"tok_{label}.d"
    src.mkdir()
    (src / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    size = sum(len(d.encode()) for d in docs)
    spec = json.loads(Path(tokenizer_path).read_text())
    spec["normalizer"] = {"type": "Sequence", "normalizers": []}  # a no-op that _as_tiktoken does not translate
    library = Path(tmp) / f"library_{label}.json"
    library.write_text(json.dumps(spec))
    ids = open_tokenizer(str(tokenizer_path)).n_vocab
    rows = {
        "gpt2 (tiktoken)": "gpt2",
        f"{ids:,}-id tokenizer.json": tokenizer_path,
        "same file, tokenizers library": library,
    }
    wall, cpu, tokens = {k: [] for k in rows}, {k: [] for k in rows}, {}
    for r in range(repeats):  # interleaved, so that a busy machine's quiet moments are shared fairly
        for k, tok in rows.items():
            out = Path(tmp) / f"tok_{label}_{len(wall[k])}_{abs(hash(k))}"
            summary = {}

            def run(out=out, tok=tok, summary=summary):
                summary.update(prep(src, out, label, num_proc, "--tokenizer", tok))

            seconds = cpu_seconds(run)[0]
            wall[k].append(size / summary["seconds"] / 1e6)
            cpu[k].append(seconds / size * 1e9)
            tokens[k] = summary["tokens"]
    base_wall, base_cpu = max(wall["gpt2 (tiktoken)"]), min(cpu["gpt2 (tiktoken)"])
    for k in rows:
        print(
            f"tokenizer {label:9s} {k:32s} {size / 1e6:5.1f} MB -> {tokens[k]:10,} tokens | prepare_data "
            f"{max(wall[k]):5.2f} MB/s wall = {100 * max(wall[k]) / base_wall:3.0f}% of gpt2's | "
            f"{min(cpu[k]):5.0f} CPU ns/byte = {min(cpu[k]) / base_cpu:4.2f}x gpt2's ({num_proc} processes)"
        )


def bench_loader(batch_size, block_size, world_size, steps, tmp):
    rng = np.random.default_rng(0)
    d = Path(tmp) / "loader"
    for i in range(2):  # 2 x 10M tokens: samples come from two shards, as at a shard boundary
        write_shard(d / f"bench_train_{i:06d}.bin", rng.integers(0, 50257, size=10_000_000, dtype=np.uint16))
    cfg = TrainConfig(data_dir=str(d), batch_size=batch_size, block_size=block_size, vocab_size=50257)
    t0 = time.perf_counter()
    loader = DataLoader(cfg, "train", 0, world_size)
    for _ in range(2):  # the first batches of each shard pay its one-time vocab check
        loader.next_batch()
    first = time.perf_counter() - t0
    while loader.epoch == 0 and loader.position < loader.num_samples // 2:
        loader.next_batch()  # move on to the second shard's vocab check
    loader.next_batch()
    seconds = best_seconds(lambda: [loader.next_batch() for _ in range(steps)], 3) / steps
    tokens = batch_size * block_size
    print(
        f"loader B={batch_size} T={block_size} world_size={world_size}: {seconds * 1e3:.3f} ms/batch "
        f"({seconds / tokens * 1e9:.1f} ns/token); startup + first batches incl. vocab check of a 10M-token shard "
        f"{first * 1e3:.0f} ms. Under 1% of the step whenever a rank's micro-step takes "
        f">= {100 * seconds * 1e3:.1f} ms, "
        f"i.e. the trainer runs below {tokens / (100 * seconds) / 1e6:.1f}M tokens/s per rank"
    )


def bench_mixture(batch_size, block_size, world_size, steps, repeats, tmp):
    """CPU time per batch of a mixture.Mixture of 4 sources (equal weights; each 2 shards of 5M random tokens) against
    one DataLoader over the same 8 shards (a glob), so both read rows at random from the same 80 MB. The two take
    turns batch by batch, so a busy machine disturbs both alike; each batch is timed in CPU time (time.process_time:
    time the process was not running is not counted). The mixture's batches are cheap but every AHEAD_STEPS-th
    reads all the next ones: the figure is the mean over repeats * max(steps, 20 * AHEAD_STEPS) batches."""
    rng = np.random.default_rng(0)
    root = Path(tmp) / "mixture"
    for s in range(4):
        for i in range(2):
            tokens = rng.integers(0, 50257, size=5_000_000, dtype=np.uint16)
            write_shard(root / f"s{s}" / f"bench_train_{i:06d}.bin", tokens)
    glob = str(root / "s*" / "bench_train_*")
    cfg = TrainConfig(data_dir=glob, batch_size=batch_size, block_size=block_size, vocab_size=50257)
    one = DataLoader(cfg, "train", 0, world_size)
    mixture = open_mixture(replace(cfg, data_dir={str(root / f"s{s}"): 1 for s in range(4)}), "train", 0, world_size)
    batches = repeats * max(steps, 20 * AHEAD_STEPS)
    seconds = {one: 0.0, mixture: 0.0}
    for i in range(batches + 2 * AHEAD_STEPS):  # the first ones warm up
        for loader in (one, mixture):
            t0 = time.process_time()
            loader.next_batch()
            seconds[loader] += (time.process_time() - t0) if i >= 2 * AHEAD_STEPS else 0.0
    single, mixed = seconds[one] / batches, seconds[mixture] / batches
    print(
        f"mixture B={batch_size} T={block_size} world_size={world_size}: 4 sources {mixed * 1e6:.1f} us/batch, "
        f"one source {single * 1e6:.1f} us/batch (CPU time, {batches:,} batches each, taking turns): "
        f"{mixed / single:.3f}x"
    )


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num_proc", type=int, default=os.cpu_count())
    p.add_argument("--copies", type=int, default=4, help="Tiny Shakespeare repeated this many times")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--block_size", type=int, default=1024)
    p.add_argument("--world_size", type=int, default=1)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument(
        "--tokenizer",
        help="tokenizer.json (or its directory) to compare with GPT-2's (default: one "
        "trained here by tokenizer.py on the text, 8,192 ids)",
    )
    p.add_argument("--only", choices=["prep", "tokenizers", "loader", "mixture"], help="run one of the benchmarks")
    args = p.parse_args()
    # after parsing (--help needs no torch), before timing: the loader's first batch is not charged for it
    import torch  # noqa: F401

    print(f"machine: {machine_line('cpu')}")
    text = Path(fetch_shakespeare()).read_text(encoding="utf-8")
    speeches = split_speeches(text) * args.copies
    pages = re.findall(r".{1,4000}(?:\n|$)", text, flags=re.S) * args.copies
    with tempfile.TemporaryDirectory() as tmp:
        if args.only in (None, "prep"):
            bench_prep(speeches, "speeches", args.num_proc, args.repeats, tmp)
            bench_prep(pages, "pages", args.num_proc, args.repeats, tmp)
        if args.only in (None, "tokenizers"):
            path = args.tokenizer
            if path is not None and Path(path).is_dir():
                path = Path(path) / "tokenizer.json"
            if path is None:
                import tokenizer

                path = Path(tmp) / "tokenizer.json"
                tokenizer.train(split_speeches(text), 8192).save(str(path))
            bench_tokenizers(speeches, "speeches", args.num_proc, args.repeats, tmp, path)
            bench_tokenizers(pages, "pages", args.num_proc, args.repeats, tmp, path)
        if args.only in (None, "loader"):
            bench_loader(args.batch_size, args.block_size, args.world_size, args.steps, tmp)
        if args.only in (None, "mixture"):
            bench_mixture(args.batch_size, args.block_size, args.world_size, args.steps, args.repeats, tmp)


if __name__ == "__main__":
    main()
