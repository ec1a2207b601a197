"""The coordinate check of muP (Tensor Programs V, and the mup package's get_coord_data): train the same model at
several widths for a few steps at a fixed learning rate and watch the size (RMS) of each kind of activation. Under
muP every kind keeps its size as the width grows; under the standard parametrization the logits (and with them the
steps' effect on the output) grow with the width, which is why its best learning rate moves.

    python -m bench.coord_check configs/shakespeare_cpu.py --data_dir=data/shakespeare_512 --widths 64,128,256,512
    python -m bench.coord_check configs/modern.py --data_dir=data/shakespeare_512 --widths 64,256 --steps 5 --out DIR

CONFIG and --key=value are train.py's (its config files and overrides); the width replaces n_embd (n_embd / 64
heads, as sweep.py's sizes), mup_base_width defaults to the smallest width, and the optimizer is the config's, at its
peak rates (set_lr at learning_rate: muP's per-group rates included) with no schedule and no clipping. Batches are
the config's training data (data_dir; the same batches at every width), or uniform random tokens where data_dir has
no shards (a note says so). Per parametrization (--parametrization standard,mup), kind and width the RMS after each
of --steps updates, of: `embedding` (the token embedding's output), `attention` and `mlp` (each block's branch output,
the mean over blocks), `residual` (each block's output, the mean over blocks) and `logits` (the output head's).
DIR/coord_check.json holds {parametrization: {kind: {width: [rms after steps 1..S]}}}, DIR/coord_check.png the plot
(one panel per parametrization and kind, RMS against width, one line per step), and the last stdout line
`coord_check: {...}` each kind's spread at the last step: the largest RMS over the smallest across the widths.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

from gpt2train import optim, runner
from gpt2train.config import ConfigError, make_config, model_config, parse_args
from gpt2train.console import log
from gpt2train.files import atomic_write, report_error
from model import GPT, PARAMETRIZATIONS

KINDS = ("embedding", "attention", "mlp", "residual", "logits")


def parse(argv):
    parser = argparse.ArgumentParser(
        prog="python -m bench.coord_check",
        description="muP's coordinate check: activation RMS per layer kind across widths.",
        epilog=__doc__.split("\n\n", 2)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("config", nargs="*", metavar="CONFIG", help="train.py config files and --key=value")
    parser.add_argument("--widths", default="64,128,256,512", help="comma-separated n_embd, multiples of 64")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per width (default 10)")
    parser.add_argument("--parametrization", default="standard,mup", help="comma-separated: standard, mup")
    parser.add_argument("--out", default="out/coord_check", help="coord_check.json and coord_check.png go here")
    args, rest = parser.parse_known_args(argv)
    bad = [a for a in rest if not a.startswith("--") or "=" not in a]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)}")
    return args, [*args.config, *rest]


def configs(train_args, widths, kinds):
    """{(parametrization, width): TrainConfig}, every one validated before anything trains."""
    from gpt2train.start import data_manifests, data_tokenizer, data_vocab

    user = parse_args(train_args)
    manifests = data_manifests(user.get("data_dir", "data/fineweb-edu"))
    user = data_vocab(user, data_tokenizer(manifests) if manifests else None)
    user = {**user, "dropout": 0.0, "grad_clip": 0.0}
    user.setdefault("mup_base_width", min(widths))
    out = {}
    for p in kinds:
        for w in widths:
            n_layer = user.get("n_layer", 12)
            keys = dict(zip(("n_layer", "n_embd", "n_head"), (a.split("=")[1] for a in runner.size_args(n_layer, w))))
            out[p, w] = make_config({**user, **{k: int(v) for k, v in keys.items()}, "parametrization": p})
    return out


def batches(cfg, steps):
    """steps + 1 (x, y) batches of the config's training data, or random tokens without it."""
    from gpt2train.data import open_loader

    try:
        loader = open_loader(cfg, "train")
        return [loader.next_batch() for _ in range(steps + 1)]
    except (ConfigError, OSError, ValueError) as e:
        log(f"coord_check: no training data ({e}); uniform random tokens instead", note=True)
        gen = torch.Generator().manual_seed(cfg.seed)
        x = torch.randint(0, cfg.vocab_size, (steps + 1, cfg.batch_size, cfg.block_size + 1), generator=gen)
        return [(row[:, :-1], row[:, 1:]) for row in x]


def hooks(model, sums):
    """Forward hooks adding each kind's RMS to sums[kind] (a list per kind: one entry per module)."""
    modules = [("embedding", model.transformer.wte), ("logits", model.lm_head)]
    for block in model.transformer.h:
        modules += [("attention", block.attn), ("mlp", block.mlp), ("residual", block)]

    def record(kind):
        return lambda module, args, output: sums[kind].append(output.detach().float().pow(2).mean().sqrt().item())

    return [module.register_forward_hook(record(kind)) for kind, module in modules]


def coord_data(cfg, steps):
    """{kind: [RMS after each of `steps` updates]} of one width."""
    torch.manual_seed(cfg.seed)
    model = GPT(model_config(cfg)).train()
    opt = optim.build_optimizer(model, cfg)
    optim.set_lr(opt, cfg.learning_rate, cfg)
    rms = {kind: [] for kind in KINDS}
    for i, (x, y) in enumerate(batches(cfg, steps)):
        sums = {kind: [] for kind in KINDS}
        handles = hooks(model, sums) if i else []  # forward i sees the weights after i updates
        _, loss = model(x.long(), y.long())
        for h in handles:
            h.remove()
        for kind in KINDS if i else ():
            rms[kind].append(sum(sums[kind]) / len(sums[kind]))
        if i == steps:
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return rms


def plot(data, widths, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(data), len(KINDS), figsize=(3 * len(KINDS), 2.6 * len(data)), squeeze=False)
    for row, (p, kinds) in zip(axes, data.items()):
        for ax, kind in zip(row, KINDS):
            series = kinds[kind]
            steps = len(series[str(widths[0])])
            for s in range(steps):
                color = plt.cm.viridis(s / max(1, steps - 1))
                ax.plot(widths, [series[str(w)][s] for w in widths], marker=".", color=color, lw=1)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{p}: {kind}", fontsize=9)
            ax.set_xlabel("width", fontsize=8)
            ax.tick_params(labelsize=7)
    axes[0][0].set_ylabel("RMS (step 1 dark .. last light)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=64)


def main(argv=None):
    args, train_args = parse(argv)
    try:
        widths = sorted({int(w) for w in args.widths.split(",")})
        for w in widths:
            runner.parse_size(f"1x{w}")
        kinds = args.parametrization.split(",")
        if any(p not in PARAMETRIZATIONS for p in kinds) or args.steps < 1:
            raise ConfigError(
                f"--parametrization must list {' or '.join(PARAMETRIZATIONS)} and --steps be >= 1; got "
                f"{args.parametrization!r}, {args.steps}"
            )
        cfgs = configs(train_args, widths, kinds)
    except (ConfigError, ValueError) as e:
        report_error("coord_check", e)
        return 2
    data = {p: {kind: {} for kind in KINDS} for p in kinds}
    for (p, w), cfg in cfgs.items():
        for kind, series in coord_data(cfg, args.steps).items():
            data[p][kind][str(w)] = series
        log(f"coord_check: {p} width {w}: " + ", ".join(f"{k} {data[p][k][str(w)][-1]:.3g}" for k in KINDS))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "coord_check.json", json.dumps(data, indent=2) + "\n")
    plot(data, widths, out / "coord_check.png")
    spread = {p: {k: spread_of(data[p][k]) for k in KINDS} for p in kinds}
    for p in kinds:
        log(f"{p}: last-step RMS max/min across widths " + ", ".join(f"{k} {v:.2f}" for k, v in spread[p].items()))
    print(f"coord_check: {json.dumps({'out': str(out), 'spread': spread})}")
    return 0


def spread_of(series):
    """max / min across the widths of the last step's RMS."""
    last = [values[-1] for values in series.values()]
    return max(last) / min(last)


if __name__ == "__main__":
    sys.exit(main())
