"""Benchmark: HellaSwag examples/s, batched vs one example per forward, and that both agree.
Run from the repository root (a random model on the real examples):

    python -m bench.hellaswag_speed [--n 100] [--batch_size 16] [--device auto] [--dtype auto]
"""

import argparse
import time

import torch

from bench import machine_line
from gpt2train.assets import fetch_hellaswag, get_tokenizer
from gpt2train.devices import resolve_device, resolve_dtype, tune_cpu_allocator
from gpt2train.scoring import Forwards, Suite, score_requests
from gpt2train.tasks import HELLASWAG_LLMC, load_hellaswag
from model import GPT, GPTConfig


def _sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def evaluate(model, examples, device, batch_size=16, dtype=None, enc=None):
    """hellaswag.py's scoring: the suite's task hellaswag_llmc, batch_size examples (4 rows each) per forward."""
    suite = Suite({HELLASWAG_LLMC.name: examples}, enc or get_tokenizer())
    return suite.score(model, device, 4 * batch_size, dtype)


def one_example_per_forward(model, examples, device, dtype=None, enc=None):
    """The plain way (build-nanogpt's): each example's 4 rows in their own forward, in file order.
    Returns [(pred, pred_norm)] per example."""
    model = model.eval()
    suite = Suite({HELLASWAG_LLMC.name: examples}, enc or get_tokenizer())
    preds = []
    for _, pairs, *_ in suite.examples[HELLASWAG_LLMC.name]:
        log_likelihood, count = score_requests(model, pairs, Forwards(device, 4, dtype), suite.n_vocab)
        preds.append((int(log_likelihood.argmax()), int((log_likelihood / count.clamp(min=1)).argmax())))
    return preds


def bench_hellaswag(model, examples, device, batch_size=16, dtype=None, enc=None, warmup=4):
    """examples/s of hellaswag.py's scoring (batch_size examples per forward) and of one example per
    forward. Returns dict(n, batch_size, batched_ex_per_s, single_ex_per_s,
    speedup, same_preds): same_preds is True when both pick the same endings for every example.
    """
    if enc is None:
        enc = get_tokenizer()
    # warm up both paths (allocator, kernels) on a few examples before timing
    evaluate(model, examples[:warmup], device, batch_size=batch_size, dtype=dtype, enc=enc)
    one_example_per_forward(model, examples[:warmup], device, dtype, enc)
    _sync(device)
    t0 = time.perf_counter()
    batched = evaluate(model, examples, device, batch_size=batch_size, dtype=dtype, enc=enc)
    _sync(device)
    t1 = time.perf_counter()
    single = one_example_per_forward(model, examples, device, dtype, enc)
    _sync(device)
    t2 = time.perf_counter()
    same = [(p["pred"], p["pred_norm"]) for p in batched["preds"]] == single
    n = len(examples)
    return {
        "n": n,
        "batch_size": batch_size,
        "batched_ex_per_s": n / (t1 - t0),
        "single_ex_per_s": n / (t2 - t1),
        "speedup": (t2 - t1) / (t1 - t0),
        "same_preds": same,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--n", type=int, default=100, help="number of HellaSwag examples")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", help="autocast dtype, as hellaswag.py's --dtype")
    parser.add_argument("--n_layer", type=int, default=6)
    parser.add_argument("--n_embd", type=int, default=384)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    tune_cpu_allocator(device)  # as hellaswag.py does
    model = GPT(GPTConfig(n_layer=args.n_layer, n_head=args.n_embd // 64, n_embd=args.n_embd)).to(device)
    examples = load_hellaswag(fetch_hellaswag(), limit=args.n)
    r = bench_hellaswag(model, examples, device, batch_size=args.batch_size, dtype=dtype)
    print(
        f"HellaSwag on {machine_line(device)}: {args.n_layer}-layer {args.n_embd}-dim random GPT, "
        f"{r['n']} examples, {dtype}"
    )
    print(f"  one example per forward: {r['single_ex_per_s']:8.1f} examples/s")
    print(
        f"  {args.batch_size:3d} examples per forward: {r['batched_ex_per_s']:8.1f} examples/s "
        f"({r['speedup']:.2f}x), same predictions: {r['same_preds']}"
    )


if __name__ == "__main__":
    main()
