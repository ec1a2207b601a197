"""HellaSwag validation accuracy, scored exactly the way llm.c and build-nanogpt score it.

Each example has a context and 4 endings. Row i is the tokens of `ctx` followed by the tokens of
" " + endings[i]; the model's cross-entropy is taken over the ending tokens only. The summed loss
gives `acc` (argmin of the sum), the mean loss per ending token gives `acc_norm` (argmin of the
mean) -- so numbers compare with their published ones (GPT-2 124M: acc 0.2859, acc_norm 0.2955).

This is the task hellaswag_llmc (tasks.py), scored by the evaluation suite evaluate.py and train.py use too
(scoring.py): batched (the rows of many examples share one forward pass, and predictions are the ones of one
example at a time), only the ending positions through lm_head.

    python hellaswag.py --init_from gpt2              # default data: assets.fetch_hellaswag()
    python hellaswag.py --ckpt out/ --limit 1000 --json --per_example preds.jsonl

A Hugging Face model directory with a tokenizer.json (e.g. an imported Pythia) is scored with that
tokenizer (needs the `tokenizers` package); everything else with GPT-2's.
"""

import argparse
import json
import sys
import time

import torch

from gpt2train import assets
from gpt2train.devices import tune_cpu_allocator
from gpt2train.files import atomic_write, check_writable, report_error
from gpt2train.loading import add_model_args, load_model_from_args
from gpt2train.scoring import Suite
from gpt2train.tasks import HELLASWAG_LLMC, load_hellaswag


def main(argv=None):
    parser = argparse.ArgumentParser(description="HellaSwag accuracy of a checkpoint or a pretrained GPT-2.")
    add_model_args(parser)
    parser.add_argument("--data", help="HellaSwag jsonl file (default: the validation set, fetched and cached)")
    parser.add_argument("--limit", type=int, default=None, help="score only the first N examples")
    parser.add_argument("--batch_size", type=int, default=16, help="examples per forward pass (4 rows each)")
    parser.add_argument("--json", action="store_true", help='last stdout line: {"n": ..., "acc": ..., "acc_norm": ...}')
    parser.add_argument("--per_example", help="write one JSON line per example: ind, label, pred, pred_norm")
    args = parser.parse_args(argv)
    if args.batch_size < 1:
        parser.error(f"--batch_size must be >= 1, got {args.batch_size}")
    if args.limit is not None and args.limit < 1:
        parser.error(f"--limit must be >= 1, got {args.limit}")

    try:  # bad input is one line on stderr and exit code 2, never a traceback; all checked before evaluating
        if args.per_example:  # written at the end: an earlier file stays until then
            check_writable(args.per_example)
        data = args.data or assets.fetch_hellaswag(args.cache_dir)
        examples = load_hellaswag(data, args.limit)  # its errors name the file and line
        if not examples:
            raise ValueError(f"{data}: no examples to evaluate")
    except (OSError, ValueError, RuntimeError) as e:
        report_error(parser.prog, e)
        parser.exit(2)
    model, enc, device, dtype = load_model_from_args(parser, args)
    tune_cpu_allocator(device)  # big activations stay mapped, as in train.py

    t0 = time.time()
    suite = Suite({HELLASWAG_LLMC.name: examples}, enc)
    result = suite.score(model, device, 4 * args.batch_size, dtype, progress=sys.stderr.isatty())  # 4 rows an example
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    elapsed = time.time() - t0
    if args.per_example:
        lines = (
            json.dumps({"ind": examples[p["index"]]["ind"], **{k: p[k] for k in ("label", "pred", "pred_norm")}})
            for p in result["preds"]
        )
        try:
            atomic_write(args.per_example, "".join(line + "\n" for line in lines))
        except OSError as e:
            report_error(parser.prog, e)
            parser.exit(2)
    r = result["tasks"][HELLASWAG_LLMC.name]
    print(
        f"hellaswag: n={r['n']} acc={r['acc']:.4f} acc_norm={r['acc_norm']:.4f} "
        f"({r['n'] / elapsed:.1f} examples/s, {device}, {dtype})"
    )
    if args.json:
        print(json.dumps({"n": r["n"], "acc": r["acc"], "acc_norm": r["acc_norm"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
