"""Partial rotary embeddings, two formulations side by side (issue 16).

    python bench/rotary.py             # (python -m bench.rotary once bench/ is a package)
    python bench/rotary.py --quick     # fewer rounds

slice: rotate the first rot_dim dims of each head and concatenate the untouched rest (GPT-NeoX, HF).
zero-freq: rotate every head dim with cos/sin tables of the full head width whose non-rotated dims have
frequency 0 (cos 1, sin 0), so there is no slicing of the pass-through dims and no final concatenation
(the trick of "Frugality meets Accuracy: Cost-efficient training of GPT NeoX and Pythia models with AWS
Trainium", AWS ML blog). Both are exact: the same bits come out.
Measured: the op alone, and forward+backward of a 4-layer, 256-wide model (T=256, rotary_pct=0.25), eager
and torch.compile'd, the variants interleaved round by round; medians reported.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: import the library from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import model as M  # noqa: E402


def slice_tables(rot_dim: int, head_dim: int, n_pos: int, base: float = 10000.0):
    return M.rotary_cos_sin(rot_dim, n_pos, base)  # (n_pos, rot_dim) each


def apply_slice(x, cos, sin):
    """Rotate x[..., :rot_dim], concatenate x[..., rot_dim:] back (rot_dim = cos.size(-1))."""
    r = cos.size(-1)
    x_rot, x_pass = x[..., :r], x[..., r:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    x_rot = x_rot * cos.to(x.dtype) + torch.cat((-x2, x1), dim=-1) * sin.to(x.dtype)
    return torch.cat((x_rot, x_pass), dim=-1)


def zero_freq_tables(rot_dim: int, head_dim: int, n_pos: int, base: float = 10000.0):
    """(cos, sin) of the full head width (n_pos, head_dim): cos 1 and sin 0 past rot_dim, and the sign of
    rotate_half folded into sin (its first half is -sin), so that x * cos + partner(x) * sin is the rotation."""
    cos, sin = M.rotary_cos_sin(rot_dim, n_pos, base)
    half = rot_dim // 2
    pad = head_dim - rot_dim
    cos = torch.cat((cos, torch.ones(n_pos, pad)), dim=-1)
    sin = torch.cat((-sin[:, :half], sin[:, half:], torch.zeros(n_pos, pad)), dim=-1)
    return cos, sin


def make_zero_freq(rot_dim: int):
    half = rot_dim // 2

    def apply_zero_freq(x, cos, sin):
        """x * cos + partner(x) * sin over the whole head: partner swaps the two halves of the rotated dims and
        leaves the rest in place (multiplied by sin = 0 there)."""
        partner = torch.cat((x[..., half:rot_dim], x[..., :half], x[..., rot_dim:]), dim=-1)
        return x * cos.to(x.dtype) + partner * sin.to(x.dtype)

    return apply_zero_freq


VARIANTS = {"slice": (slice_tables, lambda rot_dim: apply_slice), "zero-freq": (zero_freq_tables, make_zero_freq)}


def use_variant(model: M.GPT, name: str):
    """Point the model at one formulation: its rope tables and the module-level apply_rotary."""
    cfg = model.config
    tables, make_apply = VARIANTS[name]
    cos, sin = tables(cfg.rot_dim, cfg.n_embd // cfg.n_head, cfg.block_size, cfg.rotary_base)
    model.rope_cos, model.rope_sin = cos, sin
    M.apply_rotary = make_apply(cfg.rot_dim)


def median_time(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_op(rounds: int):
    """The rotary op alone on (B, nh, T, hs) = (8, 8, 256, 64), rot_dim 16, forward + backward."""
    B, nh, T, hs, r = 8, 8, 256, 64, 16
    x = torch.randn(B, nh, T, hs, requires_grad=True)
    fns = {}
    for name, (tables, make_apply) in VARIANTS.items():
        cos, sin = tables(r, hs, T)
        apply = make_apply(r)
        fns[name] = lambda apply=apply, cos=cos, sin=sin: apply(x, cos, sin).sum().backward()
    return interleaved(fns, rounds)


def interleaved(fns: dict, rounds: int) -> dict:
    """Median seconds per call of each fn, measured in alternating rounds so load changes hit all alike."""
    for fn in fns.values():
        fn(), fn()  # warm up (and compile)
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(median_time(fn, 3))
    return {name: statistics.median(t) for name, t in times.items()}


def bench_model(compiled: bool, rounds: int, bf16: bool = False):
    cfg = M.GPTConfig(
        n_layer=4,
        n_head=4,
        n_embd=256,
        block_size=256,
        vocab_size=512,
        rotary_pct=0.25,
        parallel_residual=True,
        tie_embeddings=False,
        activation="gelu",
    )
    idx = torch.randint(0, 512, (8, 256), generator=torch.Generator().manual_seed(0))
    fns, outputs = {}, {}
    for name in VARIANTS:
        torch.manual_seed(0)
        model = M.GPT(cfg)
        use_variant(model, name)
        apply = M.apply_rotary
        step_model = torch.compile(model) if compiled else model

        def step(model=model, step_model=step_model, apply=apply):
            M.apply_rotary = apply  # each variant's own op (eager looks the global up at call time)
            model.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = step_model(idx, idx, return_logits=False)[1]
            loss.backward()
            return loss

        fns[name] = step
        outputs[name] = step().item()
    if not compiled:  # eager: the same bits (compiled kernels may fuse the two differently)
        assert outputs["slice"] == outputs["zero-freq"], outputs
    return interleaved(fns, rounds)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="3 rounds instead of 7")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument(
        "--bf16",
        action="store_true",
        help="the model rows under bf16 autocast (train.py's CPU default where the CPU has native bf16)",
    )
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rounds = 3 if args.quick else 7
    original = M.apply_rotary
    try:
        dtype = "bf16 autocast" if args.bf16 else "fp32"
        rows = [
            ("rotary op (8x8x256x64, 16 dims), fp32 fwd+bwd", bench_op(rounds)),
            (f"model 4L/256d T=256 B=8, {dtype} eager fwd+bwd", bench_model(False, rounds, args.bf16)),
            (f"model 4L/256d T=256 B=8, {dtype} compiled fwd+bwd", bench_model(True, rounds, args.bf16)),
        ]
    finally:
        M.apply_rotary = original
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| case | slice (ms) | zero-freq (ms) | zero-freq / slice |")
    print("|---|---|---|---|")
    for label, t in rows:
        print(f"| {label} | {t['slice'] * 1e3:.2f} | {t['zero-freq'] * 1e3:.2f} | {t['zero-freq'] / t['slice']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
