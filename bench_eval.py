"""Benchmark: HellaSwag examples/s, batched vs one example per forward, and that both agree.

    python bench_eval.py [--n 100] [--batch_size 16] [--device auto]   # small random model, real data
"""
import argparse
import time

import torch


def _timed_evaluate(model, examples, device, batch_size, dtype, enc):
    from hellaswag import evaluate
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    result = evaluate(model, examples, device, batch_size=batch_size, dtype=dtype, enc=enc)
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
    return result, time.perf_counter() - t0


def bench_hellaswag(model, examples, device, batch_size=16, dtype=None, enc=None, warmup=4):
    """examples/s of hellaswag.evaluate with `batch_size` examples per forward and with one.

    Returns dict(n, batch_size, batched_ex_per_s, single_ex_per_s, speedup, same_preds): same_preds
    is True when both ways pick the same ending (sum and mean loss) for every example.
    """
    if enc is None:
        from assets import get_tokenizer
        enc = get_tokenizer()
    # warm up both paths (allocator, kernels, compile) on a few examples before timing
    _timed_evaluate(model, examples[:warmup], device, batch_size, dtype, enc)
    _timed_evaluate(model, examples[:warmup], device, 1, dtype, enc)
    batched, t_batched = _timed_evaluate(model, examples, device, batch_size, dtype, enc)
    single, t_single = _timed_evaluate(model, examples, device, 1, dtype, enc)
    same = all((a["pred"], a["pred_norm"]) == (b["pred"], b["pred_norm"])
               for a, b in zip(batched["preds"], single["preds"]))
    n = len(examples)
    return {"n": n, "batch_size": batch_size, "batched_ex_per_s": n / t_batched,
            "single_ex_per_s": n / t_single, "speedup": t_single / t_batched, "same_preds": same}


if __name__ == "__main__":
    from assets import fetch_hellaswag
    from devices import resolve_device
    from hellaswag import load_examples
    from model import GPT, GPTConfig

    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--n", type=int, default=100, help="number of HellaSwag examples")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--n_layer", type=int, default=6)
    parser.add_argument("--n_embd", type=int, default=384)
    args = parser.parse_args()

    torch.manual_seed(0)
    device = resolve_device(args.device)
    model = GPT(GPTConfig(n_layer=args.n_layer, n_head=args.n_embd // 64, n_embd=args.n_embd)).to(device)
    examples = load_examples(fetch_hellaswag(), limit=args.n)
    r = bench_hellaswag(model, examples, device, batch_size=args.batch_size)
    print(f"HellaSwag on {device}, {args.n_layer}-layer {args.n_embd}-dim random GPT, {r['n']} examples, "
          f"torch {torch.get_num_threads()} threads")
    print(f"  one example per forward: {r['single_ex_per_s']:8.1f} examples/s")
    print(f"  {args.batch_size:3d} examples per forward: {r['batched_ex_per_s']:8.1f} examples/s "
          f"({r['speedup']:.2f}x), same predictions: {r['same_preds']}")
