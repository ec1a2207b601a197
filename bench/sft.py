"""The SFT learning check: a tiny model fine-tuned on a synthetic instruction task, with and without the loss mask.
Not a test: a measurement, printed as Markdown and written as JSON (docs/sft.md has the numbers).

    python -m bench.sft                        # the documented run (a few minutes on 2 CPU cores)
    python -m bench.sft --steps 100 --eval 50  # a quick look

The task: sort --length distinct letters ("sort: k c f a" -> " a c f k"), as prompt/completion jsonl; --eval
held-out prompts whose letter sets never occur in the training set. With the defaults a conversation is 15
tokens, so each row of 16 holds one. Both runs are the same
`python train.py --key=value ...` (a subprocess, from scratch, the same seed, data order and steps) on the same
shards from `prepare_data.py --format sft`: 'masked' with the loss-mask shards, 'unmasked' on a copy of the data
directory without them and their manifest (every token trained: what a dropped mask did before the loader
checked masks against the manifest), both with packing='document' (rows of whole conversations). So both see
exactly the same completion tokens; the unmasked run also trains on the prompts. Exact match: the greedy reply
(sample.stream_samples as --chat runs it, up to <|end|>) equals the sorted sequence.
"""

import argparse
import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import prepare_data
from bench import machine_line

LETTERS = "abcdefghijklmnop"  # " a" .. " p": one GPT-2 token each


def make_data(work, n_train, n_eval, length, seed):
    """(train.jsonl path, held-out [(prompt, answer)]): sort `length` distinct letters ("sort: k c f a" ->
    " a c f k"). The held-out prompts' letter *sets* never occur in training (not just their orders)."""
    rng = random.Random(seed)

    def task(letters):
        seq = rng.sample(letters, len(letters))
        return "sort: " + " ".join(seq), " " + " ".join(sorted(seq))

    sets = set()
    while len(sets) < n_eval:
        sets.add("".join(sorted(rng.sample(LETTERS, length))))
    held = [task(list(s)) for s in sorted(sets)]
    rows = []
    while len(rows) < n_train:
        letters = rng.sample(LETTERS, length)
        if "".join(sorted(letters)) not in sets:
            prompt, answer = task(letters)
            rows.append({"prompt": prompt, "completion": answer})
    path = work / "sort.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, held


def exact_match(out_dir, held):
    """Fraction of held-out prompts whose greedy reply is exactly the answer."""
    import torch

    from gpt2train import chat
    from gpt2train.generation import Sampling
    from gpt2train.loading import load_model
    from sample import stream_samples

    model, _ = load_model(ckpt=out_dir)
    enc = chat.tokenizer()
    greedy = Sampling(temperature=0, n_vocab=enc.n_vocab)
    sink = open("/dev/null", "w")
    right = 0
    with torch.no_grad():
        for prompt, answer in held:
            messages = [{"role": "user", "content": prompt}]
            reply = stream_samples(model, enc, messages, greedy, torch.Generator(), 16, sink)
            right += reply == answer
    return right / len(held)


def train_run(data_dir, out_dir, args):
    cmd = [
        sys.executable,
        "train.py",
        f"--data_dir={data_dir}",
        f"--out_dir={out_dir}",
        "--init_from=scratch",
        f"--n_layer={args.n_layer}",
        f"--n_head={args.n_head}",
        f"--n_embd={args.n_embd}",
        f"--block_size={args.block_size}",
        f"--batch_size={args.batch_size}",
        f"--total_batch_size={args.batch_size * args.block_size}",
        f"--max_steps={args.steps}",
        f"--learning_rate={args.lr}",
        f"--min_lr={args.lr / 10}",
        "--warmup_steps=20",
        "--dropout=0.0",
        "--eval_interval=0",
        "--sample_interval=0",
        "--hellaswag_interval=0",
        "--log_interval=0",
        f"--save_interval={args.steps}",
        "--device=cpu",
        "--dtype=float32",
        "--compile=False",
        f"--seed={args.seed}",
        "--packing=document",
    ]  # the unmasked copy too: rows of whole conversations, as SFT data always is
    t0 = time.time()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    lines = [json.loads(x) for x in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "train_loss" in m]
    return {
        "seconds": time.time() - t0,
        "final_train_loss": steps[-1]["train_loss"],
        "trained_tokens": sum(m["trained_tokens"] for m in steps),
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default="out/bench_sft", help="data, runs and results.json go here (replaced)")
    p.add_argument("--train", type=int, default=10000, help="training conversations")
    p.add_argument("--eval", type=int, default=200, help="held-out prompts")
    p.add_argument("--length", type=int, default=4, help="letters per prompt (distinct)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--block_size", type=int, default=16)
    p.add_argument("--n_layer", type=int, default=2)
    p.add_argument("--n_head", type=int, default=4)
    p.add_argument("--n_embd", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    path, held = make_data(work, args.train, args.eval, args.length, args.seed)
    prepare_data.main(
        ["--input", str(path), "--format", "sft", "--out_dir", str(work / "data"), "--block_size", str(args.block_size)]
    )
    # without the masks and the manifest that lists them (else the loader refuses the copy)
    shutil.copytree(work / "data", work / "data_unmasked", ignore=shutil.ignore_patterns("*.mask", "*_manifest.json"))
    results = {"args": vars(args), "machine": machine_line("cpu")}
    for name, data in (("masked", work / "data"), ("unmasked", work / "data_unmasked")):
        results[name] = train_run(data, work / name, args)
        results[name]["exact_match"] = exact_match(work / name, held)
    (work / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(
        f"\n{results['machine']}\n{args.train} conversations, {args.steps} steps of {args.batch_size} x "
        f"{args.block_size} tokens, {args.eval} held-out prompts\n"
    )
    print("| run | trained tokens | final train loss | held-out exact match | time |\n|---|---|---|---|---|")
    for name in ("masked", "unmasked"):
        r = results[name]
        print(
            f"| {name} | {r['trained_tokens']:,} | {r['final_train_loss']:.3f} | {r['exact_match']:.1%} | "
            f"{r['seconds']:.0f} s |"
        )
    return results


if __name__ == "__main__":
    main()
