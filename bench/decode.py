"""Decoding speed, old and new paths interleaved in one process: greedy KV-cache generation of this checkout
(gpt2train/generation.py), of a git revision (--rev: its model.py's GPT.generate, or its generation.py once
generation left model.py), of this one with the block weights in nn.Linear's layout (fp32), without the cache, and
transformers' `generate` on the same weights.

    python -m bench.decode --rev 2dae516             # the bench model (6 x 384) and GPT-2 124M, fp32, batch 1
    python -m bench.decode --rev HEAD --models bench # before committing a change to the decode path
    python -m bench.decode --dtype bfloat16 --rounds 7

Every variant decodes --new_tokens tokens after the same 16-token prompt (random weights, same for all; no early
stop), once to warm up, then --rounds rounds of one run each, the order rotated every round, so a machine whose
load drifts slows all alike. Reported: each variant's tokens/s per round and median, and the median per-round
ratio of this checkout with the KV cache over each. Targets (issue 41, fp32, bench model): >= 2.5x no cache,
>= 1.5x transformers, and no slower than the old revision. Timings are only comparable within one run.
"""

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from functools import partial
from unittest import mock

MODELS = {
    "bench": dict(n_layer=6, n_head=6, n_embd=384, block_size=256, vocab_size=50304),  # bench.scoreboard's
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304),  # GPT-2 124M
}
PROMPT = 16
OURS = "this checkout, KV cache"


def generation_at(rev, folder):
    """(model.py at git revision rev, its greedy generate(model, prompt, n)): GPT.generate before generation left
    model.py, gpt2train/generation.py's generate (on that model.py) after."""
    from bench import model_at, module_at

    old = model_at(rev, folder)
    if hasattr(old.GPT, "generate"):
        return old, lambda model, prompt, n: model.generate(prompt, n, temperature=0.0)
    gen = module_at(rev, "gpt2train/generation.py", folder, {"model": old})
    return old, lambda model, prompt, n: gen.generate(model, prompt, n, gen.Sampling(temperature=0.0))


def measure(name, fields, dtype, old, rounds, new_tokens, with_hf):
    """{variant: tokens/s per round} for one model configuration. old: generation_at's pair, or None."""
    import torch

    import model as M
    from gpt2train import generation

    torch.manual_seed(0)
    ours = M.GPT(M.GPTConfig(**fields)).eval().to(dtype)
    prompt = torch.randint(0, 50257, (1, PROMPT), generator=torch.Generator().manual_seed(2))
    greedy = generation.Sampling(temperature=0.0)
    runs = {OURS: partial(generation.generate, ours, prompt, new_tokens, greedy)}
    if old is not None:
        module, generate = old
        theirs = module.GPT(module.GPTConfig(**fields)).eval().to(dtype)
        theirs.load_state_dict(ours.state_dict())
        runs[f"{module.rev}, KV cache"] = partial(generate, theirs, prompt, new_tokens)
    if dtype == torch.float32:  # the blocks' decode layout left out

        def rows_blocks():
            with mock.patch.object(generation, "column_major_linears", lambda model, enabled: nullcontext()):
                return generation.generate(ours, prompt, new_tokens, greedy)

        runs["this checkout, KV cache, block weights as nn.Linear's"] = rows_blocks
    runs["this checkout, no cache"] = partial(generation.generate, ours, prompt, new_tokens, greedy, use_kv_cache=False)
    if with_hf:
        from transformers import GPT2LMHeadModel

        from gpt2train.hf import save_pretrained

        with tempfile.TemporaryDirectory() as tmp:
            save_pretrained(ours, tmp)
            hf = GPT2LMHeadModel.from_pretrained(tmp, dtype=dtype, attn_implementation="sdpa").eval()
        hf.generation_config.eos_token_id = None  # never stop early: new_tokens tokens, as ours
        hf.generation_config.pad_token_id = 0
        runs["transformers generate"] = partial(hf.generate, prompt, max_new_tokens=new_tokens, do_sample=False)
    names = list(runs)
    tok_s = {n: [] for n in names}
    with torch.no_grad():
        reference = runs[names[0]]()[0, PROMPT:]
        for n in names[1:]:  # warm-up, and the same tokens (argmax ties aside)
            same = int((runs[n]()[0, PROMPT:] == reference).sum())
            print(f"  {name}: {n}: {same}/{new_tokens} tokens as this checkout with the cache", flush=True)
        for r in range(rounds):
            for n in names[r % len(names) :] + names[: r % len(names)]:
                t0 = time.perf_counter()
                runs[n]()
                tok_s[n].append(new_tokens / (time.perf_counter() - t0))
    return tok_s


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", help="also decode as at this git revision (e.g. 2dae516, HEAD)")
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="weights stored in it")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new_tokens", type=int, default=200)
    ap.add_argument("--no_hf", action="store_true", help="leave out transformers' generate")
    args = ap.parse_args(argv)
    with_hf = not args.no_hf and importlib.util.find_spec("transformers") is not None

    import torch

    from bench import machine_line

    print(machine_line("cpu"))
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        old = generation_at(args.rev, tmp) if args.rev else None
        for name in args.models:
            tok_s = measure(name, MODELS[name], dtype, old, args.rounds, args.new_tokens, with_hf)
            ref = tok_s[OURS]
            print(
                f"\n{name} ({args.dtype}, batch 1, {args.new_tokens} new tokens after {PROMPT}, {args.rounds} "
                "rounds)\n| variant | tokens/s per round | median | this checkout cached / this |\n|---|---|---|---|"
            )
            for n, v in tok_s.items():
                ratio = "-" if v is ref else f"{statistics.median(a / b for a, b in zip(ref, v)):.2f}x"
                print(f"| {n} | {' '.join(f'{x:.1f}' for x in v)} | {statistics.median(v):.1f} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
