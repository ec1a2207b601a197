"""Does the CPU fp32 decode layout still pay? GPT.generate_stream on a CPU in fp32 reads a (C, V) copy of the
embedding and stores the blocks' Linear weights column-major while it decodes. This runs the same greedy decode
with and without that layout, interleaved (A, B, A, B, ...) in one process so a shared, noisy machine hits both
alike, and prints the median tokens/s of each.

    python -m bench.decode_layout [--rounds 7] [--new_tokens 64]
"""

import argparse
import statistics
import time
from unittest import mock

import torch

from bench import machine_line
from model import GPT, GPTConfig

MODELS = {
    "bench model (6 x 384)": GPTConfig(n_layer=6, n_head=6, n_embd=384, block_size=256, vocab_size=50304),
    "GPT-2 124M": GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304),
}


def decode_tokens_per_s(model, prompt, new_tokens, layout):
    """Tokens/s of one greedy KV-cache decode; layout=False makes generate_stream see autocast on, which is how it
    skips the fp32 CPU layout (the math is fp32 either way: no autocast context is entered)."""
    with mock.patch.object(torch, "is_autocast_enabled", lambda *a: not layout):
        t0 = time.perf_counter()
        model.generate(prompt, new_tokens, temperature=0.0)
        return new_tokens / (time.perf_counter() - t0)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--new_tokens", type=int, default=64)
    args = parser.parse_args(argv)
    print(machine_line("cpu"))
    for name, config in MODELS.items():
        torch.manual_seed(0)
        model = GPT(config).eval()
        prompt = torch.randint(0, 50257, (1, 16))
        decode_tokens_per_s(model, prompt, 8, True)  # warm-up, both paths
        decode_tokens_per_s(model, prompt, 8, False)
        rates = {True: [], False: []}
        for _ in range(args.rounds):
            for layout in (True, False):
                rates[layout].append(decode_tokens_per_s(model, prompt, args.new_tokens, layout))
        on, off = statistics.median(rates[True]), statistics.median(rates[False])
        wins = sum(a > b for a, b in zip(rates[True], rates[False]))
        print(
            f"{name}: fp32 decode, batch 1, {args.new_tokens} tokens, median of {args.rounds}: "
            f"column-major layout {on:.1f} tokens/s, nn.Linear's layout {off:.1f} tokens/s ({on / off:.2f}x; "
            f"faster in {wins} of {args.rounds} rounds)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
