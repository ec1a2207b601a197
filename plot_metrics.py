"""Plot a training run's metrics.jsonl: loss (train and val), learning rate and throughput.

    python plot_metrics.py out/shakespeare                      # -> out/shakespeare/metrics.png
    python plot_metrics.py out/a/metrics.jsonl out/b -o cmp.png  # several runs on the same axes

Needs matplotlib (`pip install matplotlib`, an optional extra; training does not need it).
"""
import argparse
import json
import sys
from pathlib import Path


def read_metrics(path):
    """(step records, val records, hellaswag records) of a metrics.jsonl file or a run directory."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such metrics file (expected a run's out_dir or its metrics.jsonl)")
    steps, val, hellaswag = [], [], []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a half-written last line of a killed run
        if "train_loss" in record:
            steps.append(record)
        elif "val_loss" in record:
            val.append(record)
        elif "hellaswag_acc_norm" in record:
            hellaswag.append(record)
    return steps, val, hellaswag


def series(records, key):
    """(steps, values) of the records where key has a value (skipped steps log null losses)."""
    pairs = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def plot(runs, out_path):
    """runs: list of (label, path). Writes a PNG with loss, learning rate and tokens/s panels."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("plot_metrics.py needs matplotlib, an optional extra: pip install matplotlib") from None
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_lr, ax_tps) = plt.subplots(1, 3, figsize=(16, 4.5))
    for label, path in runs:
        steps, val, hellaswag = read_metrics(path)
        line, = ax_loss.plot(*series(steps, "train_loss"), lw=1, alpha=0.8, label=f"{label} train")
        if val:
            ax_loss.plot(*series(val, "val_loss"), "o-", color=line.get_color(), ms=3, label=f"{label} val")
        ax_lr.plot(*series(steps, "lr"), label=label)
        ax_tps.plot(*series(steps, "tokens_per_s"), lw=1, label=label)
        if hellaswag:
            best = max(r["hellaswag_acc_norm"] for r in hellaswag)
            print(f"{label}: best HellaSwag acc_norm {best:.4f}")
    for ax, title in ((ax_loss, "loss"), (ax_lr, "learning rate"), (ax_tps, "tokens / s")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)
    print(f"wrote {out_path}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="run directories (out_dir) or metrics.jsonl files")
    parser.add_argument("-o", "--out", help="PNG to write (default: metrics.png next to the first run's metrics)")
    args = parser.parse_args(argv)
    paths = [Path(p) for p in args.runs]
    try:
        for p in paths:
            read_metrics(p)  # fail early, with the file's name, before importing matplotlib
    except FileNotFoundError as e:
        print(f"plot_metrics.py: error: {e}", file=sys.stderr)
        return 2
    first = paths[0] if paths[0].is_dir() else paths[0].parent
    out = args.out or first / "metrics.png"
    labels = [(p if p.is_dir() else p.parent).name or str(p) for p in paths]
    plot(list(zip(labels, paths)), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
