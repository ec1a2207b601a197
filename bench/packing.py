"""Document packing vs windows at equal tokens: the same small model trained twice on Tiny Shakespeare (one
document per speech), packing='window' and packing='document', then both scored on the held-out speeches.
Not a test: a measurement, printed as Markdown and written as JSON (docs/data.md has the numbers).

    python -m bench.packing                     # the documented run (a few minutes per run on 2 CPU cores)
    python -m bench.packing --steps 50          # a quick look

Both runs are `python train.py configs/shakespeare_cpu.py --packing=... ` (a subprocess, from scratch, the same
seed, steps and rows of block_size tokens, fp32 eager). Held-out losses, mean cross entropy per target token of
the val split: 'whole documents' scores every speech alone from its start (a speech longer than a row in pieces
of block_size+1 tokens, each alone), 'windows' the val windows as training with packing='window' evaluates them,
'document rows' the val rows as training with packing='document' does. Also the share of padding (and of
tokens dropped: none, by design) of document rows at several block sizes.
"""

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

import prepare_data
from bench import machine_line
from gpt2train.assets import EOT
from gpt2train.config import TrainConfig
from gpt2train.data import DataLoader
from gpt2train.loading import load_model
from gpt2train.shards import find_shards, load_shard


def train_run(data, out_dir, packing, seed, args):
    cmd = [
        sys.executable,
        "train.py",
        "configs/shakespeare_cpu.py",
        f"--data_dir={data}",
        f"--out_dir={out_dir}",
        f"--packing={packing}",
        f"--max_steps={args.steps}",
        f"--block_size={args.block_size}",
        f"--batch_size={args.batch_size}",
        f"--total_batch_size={args.batch_size * args.block_size}",
        "--eval_interval=0",
        "--sample_interval=0",
        "--log_interval=0",
        f"--save_interval={args.steps}",
        f"--device={args.device}",
        "--dtype=float32",
        "--compile=False",
        f"--seed={seed}",
    ]
    t0 = time.time()
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{result.stderr[-3000:]}")
    lines = [json.loads(x) for x in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "train_loss" in m]
    return {
        "seconds": time.time() - t0,
        "final_train_loss": steps[-1]["train_loss"],
        "trained_tokens": sum(m["trained_tokens"] for m in steps),
    }


@torch.no_grad()
def mean_loss(model, rows, device="cpu"):
    """Mean cross entropy over the targets != -1 of (x, y) row batches."""
    total, count = 0.0, 0
    for x, y in rows:
        x, y = x.to(device), y.to(device)
        _, loss = model(x, y, return_logits=False)  # the mean over the batch's targets != -1 (the chunked loss)
        n = int((y != -1).sum())
        total, count = total + loss.item() * n, count + n
    return total / count


def whole_document_rows(tokens, T, batch=32):
    """(x, y) batches: every document of tokens alone in its row from its start (a longer one in pieces of T+1
    tokens at stride T, each alone), padding targets -1."""
    starts = np.flatnonzero(tokens == EOT)
    pieces = [
        (s, min(s + T + 1, e)) for s, e in zip(starts, np.append(starts[1:], len(tokens))) for s in range(s, e - 1, T)
    ]
    for i in range(0, len(pieces), batch):
        x = torch.full((len(pieces[i : i + batch]), T), EOT, dtype=torch.int64)
        y = torch.full_like(x, -1)
        for r, (s, e) in enumerate(pieces[i : i + batch]):
            piece = torch.from_numpy(tokens[s:e].astype(np.int64))
            x[r, : len(piece) - 1], y[r, : len(piece) - 1] = piece[:-1], piece[1:]
        yield x, y


def loader_rows(data, T, packing, batch=32):
    loader = DataLoader(TrainConfig(data_dir=str(data), batch_size=batch, block_size=T, packing=packing), "val")
    for _ in range(-(-loader.num_samples // batch)):
        yield loader.next_batch()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default="out/bench_packing", help="data, runs and results.json go here (replaced)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--block_size", type=int, default=128)
    p.add_argument("--seeds", type=int, nargs="+", default=[1337])
    p.add_argument("--device", default="cpu")
    p.add_argument("--data", help="Tiny Shakespeare shards already prepared (default: prepare them under --work)")
    args = p.parse_args(argv)
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    data = Path(args.data or work / "data")
    if not args.data:
        prepare_data.main(["--dataset", "shakespeare", "--out_dir", str(data), "--num_proc", "1", "--no_progress"])
    results = {"args": vars(args), "machine": machine_line(args.device), "padding": {}, "runs": []}
    for T in (64, 128, 256, 512, 1024):
        loader = DataLoader(TrainConfig(data_dir=str(data), batch_size=1, block_size=T, packing="document"), "train")
        slots = loader.num_samples * (T + 1)
        results["padding"][T] = {
            "rows": loader.num_samples,
            "windows": sum((len(s) - 1) // T for s in loader.shards),
            "padding": 1 - sum(r.tokens for r in loader.rows) / slots,
            "dropped": 0.0,
        }
    val = np.concatenate([np.asarray(load_shard(p)) for p in find_shards(data, "val")])
    for seed in args.seeds:
        for packing in ("window", "document"):
            r = train_run(data, work / f"{packing}_{seed}", packing, seed, args)
            model, _ = load_model(work / f"{packing}_{seed}", device=args.device)
            r.update(
                packing=packing,
                seed=seed,
                whole_documents=mean_loss(model, whole_document_rows(val, args.block_size), args.device),
                windows=mean_loss(model, loader_rows(data, args.block_size, "window"), args.device),
                document_rows=mean_loss(model, loader_rows(data, args.block_size, "document"), args.device),
            )
            results["runs"].append(r)
            print(json.dumps(r), flush=True)
    (work / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(
        f"\n{results['machine']}\nTiny Shakespeare (one document per speech), {args.steps} steps of "
        f"{args.batch_size} x {args.block_size} tokens\n"
    )
    print(
        "| packing | seed | trained tokens | held-out loss: whole documents | windows | document rows | time |\n"
        "|---|---|---|---|---|---|---|"
    )
    for r in results["runs"]:
        print(
            f"| {r['packing']} | {r['seed']} | {r['trained_tokens']:,} | {r['whole_documents']:.4f} | "
            f"{r['windows']:.4f} | {r['document_rows']:.4f} | {r['seconds']:.0f} s |"
        )
    print("\n| block_size | windows | document rows | padding | dropped |\n|---|---|---|---|---|")
    for T, r in results["padding"].items():
        print(f"| {T} | {r['windows']:,} | {r['rows']:,} | {r['padding']:.2%} | {r['dropped']:.0%} |")
    return results


if __name__ == "__main__":
    main()
