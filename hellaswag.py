"""HellaSwag validation accuracy, scored exactly the way llm.c and build-nanogpt score it.

Each example has a context and 4 endings. Row i is the tokens of `ctx` followed by the tokens of
" " + endings[i]; the model's cross-entropy is taken over the ending tokens only. The summed loss
gives `acc` (argmin of the sum), the mean loss per ending token gives `acc_norm` (argmin of the
mean) -- so numbers compare with their published ones (GPT-2 124M: acc 0.2859, acc_norm 0.2955).

Batched: the rows of many examples share one forward pass, right-padded to the longest row of
the batch; causal attention means the padding never reaches a real position, so predictions are
the ones of one example at a time. Rows are sorted by length so batches waste little padding.
Only the ending positions go through lm_head. The model is the bare GPT, run eagerly (train.py passes
its gathered one), so ranks may run different numbers of batches and eval shapes trigger no recompiles.
The scorer is scoring.py's, which evaluate.py uses too.

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
import torch.distributed as dist

import assets
from console import distributed
from devices import tune_cpu_allocator
from files import report_error
from loading import add_model_args, load_model_from_args
from scoring import score_requests, score_rows  # noqa: F401  (score_rows: the scorer's core, for tests and bench)


def load_examples(path, limit=None):
    """Examples from a HellaSwag jsonl file: dicts with ind, ctx, endings (4 strings), label (0..3).

    A malformed line raises ValueError naming the file and the line number. Blank lines are skipped.
    `ind` defaults to the example's 0-based position when the line has none.
    """
    examples = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(examples) >= limit:
                break
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                ex = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(ex, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(ex).__name__}")
            missing = [k for k in ("ctx", "endings", "label") if k not in ex]
            if missing:
                raise ValueError(f"{where}: missing key(s) {', '.join(missing)}")
            if not isinstance(ex["ctx"], str):
                raise ValueError(f"{where}: 'ctx' must be a string, got {type(ex['ctx']).__name__}")
            endings = ex["endings"]
            if not (isinstance(endings, list) and len(endings) == 4 and all(isinstance(e, str) for e in endings)):
                raise ValueError(f"{where}: 'endings' must be a list of 4 strings, got {json.dumps(endings)[:80]}")
            label = ex["label"]
            if isinstance(label, str) and label in ("0", "1", "2", "3"):  # the HF copy stores labels as strings
                label = int(label)
            if isinstance(label, bool) or label not in (0, 1, 2, 3):
                raise ValueError(f"{where}: 'label' must be 0, 1, 2 or 3, got {json.dumps(ex['label'])}")
            examples.append({"ind": ex.get("ind", len(examples)), "ctx": ex["ctx"], "endings": endings, "label": label})
    return examples


def render_example(example, enc):
    """(tokens, mask, label): tokens are 4 rows ctx + " " + ending; mask is 1 on ending tokens."""
    ctx = enc.encode_ordinary(example["ctx"])  # ordinary: "<|endoftext|>" in text is just text
    tokens, mask = [], []
    for ending in example["endings"]:
        end = enc.encode_ordinary(" " + ending)  # the leading space is part of GPT-2's next token
        tokens.append(ctx + end)
        mask.append([0] * len(ctx) + [1] * len(end))
    return tokens, mask, example["label"]


class Rendered:
    """A rank's share of the examples (examples[rank::world_size]) and their 4 (context ids, ending ids) requests
    each, tokenized once: train.py keeps one and scores it at every evaluation."""

    def __init__(self, examples, enc, rank=0, world_size=1):
        self.examples, self.n_vocab = examples[rank::world_size], enc.n_vocab
        # example-major: request r is example r // 4, ending r % 4
        self.requests = [
            (row[: row_mask.index(1)], row[row_mask.index(1) :])
            for ex in self.examples
            for row, row_mask in zip(*render_example(ex, enc)[:2])
        ]


def evaluate(
    model, examples, device, batch_size=16, rank=None, world_size=None, dtype=None, enc=None, progress=False, stop=None
):
    """HellaSwag accuracy of `model` on `examples` (dicts from load_examples, or this rank's Rendered ones).

    batch_size: examples per forward, i.e. 4 * batch_size rows of similar length.
    dtype: None or 'float32' (plain fp32), or an autocast dtype name / torch.dtype; the losses
    are computed in fp32 either way. Under torch.distributed (rank/world_size default to the
    process group's) this rank scores examples[rank::world_size] and the counts are all-reduced,
    so totals equal a single process's: every rank must call it (or pass rank=0, world_size=1
    to score everything in one process without collectives).
    Returns dict(n, correct, correct_norm, acc, acc_norm, preds): preds has one dict per example
    of THIS rank, in input order: ind, label, pred, pred_norm, sum_loss[4], mean_loss[4].
    The model is put in eval mode and its previous train/eval mode is restored afterwards.
    stop: a function asked between batches; once it returns True on any rank, the rank stops scoring and
    evaluate returns None on every rank (train.py's SIGTERM: the 30 s before SIGKILL are for the checkpoint).
    """
    if rank is None:
        rank = dist.get_rank() if distributed() else 0
    if world_size is None:
        world_size = dist.get_world_size() if distributed() else 1
    if enc is None:
        enc = assets.get_tokenizer()
    rendered = examples if isinstance(examples, Rendered) else Rendered(examples, enc, rank, world_size)
    mine, requests = rendered.examples, rendered.requests
    scored = score_requests(
        model,
        requests,
        device,
        4 * batch_size,
        dtype,
        n_vocab=rendered.n_vocab,
        stop=stop,
        progress=progress,
        desc="hellaswag",
    )
    abandoned = int(scored is None)
    if scored is None:
        sum_loss = mean_loss = torch.zeros(len(requests))
    else:
        log_likelihood, count = scored
        sum_loss, mean_loss = -log_likelihood, -log_likelihood / count.clamp(min=1)
    sum_loss, mean_loss = sum_loss.view(-1, 4), mean_loss.view(-1, 4)  # (examples, 4 endings)

    preds = []
    for ex, s, m in zip(mine, sum_loss, mean_loss):
        preds.append(
            {
                "ind": ex["ind"],
                "label": ex["label"],
                "pred": int(s.argmin()),
                "pred_norm": int(m.argmin()),
                "sum_loss": s.tolist(),
                "mean_loss": m.tolist(),
            }
        )
    counts = torch.tensor(
        [
            len(preds),
            sum(p["pred"] == p["label"] for p in preds),
            sum(p["pred_norm"] == p["label"] for p in preds),
            abandoned,
        ],
        dtype=torch.long,
    )
    if distributed() and world_size > 1:  # the one collective, also on a rank that stopped early
        on = device if dist.get_backend() == "nccl" else "cpu"
        counts = counts.to(on)
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    n, correct, correct_norm, abandoned = counts.tolist()
    if abandoned:
        return None
    if n == 0:  # an accuracy of 0/0 is no result
        raise ValueError("hellaswag: no examples to evaluate")
    return {
        "n": n,
        "correct": correct,
        "correct_norm": correct_norm,
        "acc": correct / n,
        "acc_norm": correct_norm / n,
        "preds": preds,
    }


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
        per_example = open(args.per_example, "w") if args.per_example else None
        data = args.data or assets.fetch_hellaswag(args.cache_dir)
        examples = load_examples(data, args.limit)  # its errors name the file and line
        if not examples:
            raise ValueError(f"{data}: no examples to evaluate")
    except (OSError, ValueError, RuntimeError) as e:
        report_error(parser.prog, e)
        parser.exit(2)
    model, enc, device, dtype = load_model_from_args(parser, args)
    tune_cpu_allocator(device)  # big activations stay mapped, as in train.py

    t0 = time.time()
    result = evaluate(
        model, examples, device, batch_size=args.batch_size, dtype=dtype, enc=enc, progress=sys.stderr.isatty()
    )
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    elapsed = time.time() - t0
    if per_example:
        with per_example as f:
            for p in result["preds"]:
                f.write(json.dumps({k: p[k] for k in ("ind", "label", "pred", "pred_norm")}) + "\n")
    print(
        f"hellaswag: n={result['n']} acc={result['acc']:.4f} acc_norm={result['acc_norm']:.4f} "
        f"({result['n'] / elapsed:.1f} examples/s, {device}, {dtype})"
    )
    if args.json:
        print(json.dumps({"n": result["n"], "acc": result["acc"], "acc_norm": result["acc_norm"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
