"""The chat demo: fine-tune the `make demo` model on a task it can learn on a CPU in minutes, then score it.

    make demo                                   # first: out/shakespeare, the pretrained demo model
    python -m bench.chat_demo                   # task -> SFT shards -> train.py configs/chat_demo.py -> score
    python sample.py --ckpt out/chat_demo --chat --prompt "sort: k c f a" --temperature 0

The task is bench.sft's: sort 4 distinct letters of a-p ("sort: k c f a" -> " a c f k"), 10,000 prompt/completion
conversations in --data_dir/sort.jsonl and --eval held-out prompts (--data_dir/heldout.jsonl) whose letter sets never
occur in training. Steps, each one command a user could type: prepare_data.py --format sft (rows of the model's
block_size, 128), train.py configs/chat_demo.py (from out/shakespeare, the loss on the answers only; its out_dir,
out/chat_demo, is replaced), then the
held-out exact match (the greedy reply up to <|end|>, as sample.py --chat produces it). docs/sft.md has the numbers.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import prepare_data
from bench import machine_line
from bench.sft import exact_match, make_data
from gpt2train.config import ConfigError, parse_args


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/chat_demo.py", help="the train.py config (init_from, out_dir, steps)")
    p.add_argument("--data_dir", default="data/sort_chat", help="the task's jsonl files and SFT shards go here")
    p.add_argument("--train", type=int, default=10000, help="training conversations")
    p.add_argument("--eval", type=int, default=200, help="held-out prompts")
    p.add_argument("--seed", type=int, default=0)
    args, overrides = p.parse_known_args(argv)  # the rest: train.py --key=value overrides, e.g. --max_steps=50
    try:
        out_dir = parse_args([args.config, *overrides])["out_dir"]
    except ConfigError as e:
        p.error(str(e))
    data = Path(args.data_dir)
    data.mkdir(parents=True, exist_ok=True)
    path, held = make_data(data, args.train, args.eval, length=4, seed=args.seed)
    (data / "heldout.jsonl").write_text("".join(json.dumps({"prompt": q, "completion": a}) + "\n" for q, a in held))
    print(f"wrote {path} ({args.train} conversations) and {data / 'heldout.jsonl'} ({args.eval} held-out prompts)")
    t0 = time.time()
    shutil.rmtree(out_dir, ignore_errors=True)  # the demo's own run: a re-run starts over
    prepare_data.main(["--input", str(path), "--format", "sft", "--out_dir", str(data), "--block_size", "128"])
    cmd = [sys.executable, "train.py", args.config, f"--data_dir={data}", *overrides]
    # the interpreter that runs this (make's .venv/bin/python), so each printed command runs as it is in any shell
    python = os.path.relpath(sys.executable) if Path(sys.executable).is_relative_to(Path.cwd()) else sys.executable
    print("$", python, " ".join(cmd[1:]), flush=True)
    if subprocess.run(cmd).returncode != 0:
        return 1
    score = exact_match(out_dir, held)
    print(
        f"\n{machine_line('cpu')}\nheld-out exact match: {score:.1%} ({round(score * len(held))}/{len(held)}); "
        f"prep + fine-tuning + scoring {time.time() - t0:.0f} s\n"
        f'chat with it: {python} sample.py --ckpt {out_dir} --chat --prompt "sort: k c f a" --temperature 0'
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
