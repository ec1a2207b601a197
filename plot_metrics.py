"""Plot training runs' metrics.jsonl: loss (train and val; a mixture's sources dashed), gradient norm, learning
rate, throughput, val bits per byte and evaluations; or compare two runs' trajectories step by step.

    python plot_metrics.py out/shakespeare                      # -> out/shakespeare/metrics.png
    python plot_metrics.py out/a/metrics.jsonl out/b -o cmp.png  # several runs overlaid, legend from the dirs
    python plot_metrics.py --compare out/a out/b                 # do the trajectories match? (text, no plot)

Plotting needs matplotlib (`pip install matplotlib`, an optional extra; training does not need it).
"""

import argparse
import itertools
import json
import sys
from pathlib import Path

from gpt2train.console import log
from gpt2train.files import report_error


def read_metrics(path):
    """(step records, val records, evaluation records: HellaSwag's and the task suite's) of a metrics.jsonl file
    or a run directory."""
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
        if not isinstance(record, dict):
            continue  # JSON, but not a record (a stray 5, null or list)
        if "train_loss" in record:
            steps.append(record)
        elif "val_loss" in record:
            val.append(record)
        elif "hellaswag_acc_norm" in record or "mc_centered" in record:
            hellaswag.append(record)
    return steps, val, hellaswag


def series(records, key):
    """(steps, values) of the records where key has a value (skipped steps log null losses)."""
    pairs = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


EVAL_KEYS = ("hellaswag_acc_norm", "mc_centered")  # hellaswag.py's, and evaluate.py's summary
SOURCE_STYLES = ("--", ":", "-.")  # a mixture's sources, in turn


def sources(val):
    """The names of a mixture's sources in val records (val/<name>_loss), in order."""
    keys = dict.fromkeys(k for r in val for k in r if k.startswith("val/") and k.endswith("_loss"))
    return [k[len("val/") : -len("_loss")] for k in keys]


def plot(runs, out_path):
    """runs: list of (label, path). Writes a PNG with loss, gradient norm, learning rate and tokens/s panels."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("plot_metrics.py needs matplotlib, an optional extra: pip install matplotlib") from None
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    read = [read_metrics(path) for _, path in runs]
    titles = ["loss", "gradient norm", "learning rate", "tokens / s"]
    titles += ["val bits / byte"] if any(r.get("val_bpb") is not None for _, val, _ in read for r in val) else []
    titles += ["evaluations"] if any(evals for _, _, evals in read) else []  # HellaSwag, the task suite
    fig, axes = plt.subplots(1, len(titles), figsize=(5 * len(titles), 4.5))
    ax = dict(zip(titles, axes))
    for (label, _), (steps, val, hellaswag) in zip(runs, read):
        (line,) = ax["loss"].plot(*series(steps, "train_loss"), lw=1, alpha=0.8, label=f"{label} train")
        color = line.get_color()
        if val:
            ax["loss"].plot(*series(val, "val_loss"), "o-", color=color, ms=3, label=f"{label} val")
        if "val bits / byte" in ax and any(r.get("val_bpb") is not None for r in val):
            ax["val bits / byte"].plot(*series(val, "val_bpb"), "o-", color=color, ms=3, label=label)
        for name, style in zip(sources(val), itertools.cycle(SOURCE_STYLES)):  # a mixture's sources, each alone
            ax["loss"].plot(*series(val, f"val/{name}_loss"), style, color=color, label=f"{label} val {name}")
            if "val bits / byte" in ax:
                ax["val bits / byte"].plot(*series(val, f"val/{name}_bpb"), style, color=color, label=f"{label} {name}")
        ax["gradient norm"].plot(*series(steps, "grad_norm"), lw=1, label=label)
        ax["learning rate"].plot(*series(steps, "lr"), label=label)
        ax["tokens / s"].plot(*series(steps, "tokens_per_s"), lw=1, label=label)
        for key in EVAL_KEYS:
            if any(key in r for r in hellaswag):
                ax["evaluations"].plot(*series(hellaswag, key), "o-", ms=3, label=f"{label} {key}")
                log(f"{label}: best {key} {max(series(hellaswag, key)[1]):.4f}")
    for title, axis in ax.items():
        axis.set_title(title)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)
    log(f"wrote {out_path}")


def compare(path_a, path_b):
    """Over the steps both runs logged: max and mean |a - b| of train_loss and grad_norm; of the evaluations and
    val bits per byte (a mixture's: each source's val loss and bits per byte too) both logged, each run's last value
    and the largest gap; each run's final val loss. Returns a dict (what --compare prints)."""
    (steps_a, val_a, eval_a), (steps_b, val_b, eval_b) = read_metrics(path_a), read_metrics(path_b)
    out = {}
    for key in ("train_loss", "grad_norm"):
        a, b = dict(zip(*series(steps_a, key))), dict(zip(*series(steps_b, key)))
        common = sorted(a.keys() & b.keys())
        diffs = [abs(a[s] - b[s]) for s in common]
        out[key] = {
            "steps": len(common),
            "first": common[0] if common else None,
            "last": common[-1] if common else None,
            "max_abs_diff": max(diffs, default=None),
            "mean_abs_diff": sum(diffs) / len(diffs) if diffs else None,
        }
    evaluated = {k: (eval_a, eval_b) for r in eval_a + eval_b for k in r if k in EVAL_KEYS or k.startswith("mc/")}
    # val_bpb, and a mixture's val/<name>_loss and _bpb
    evaluated |= {k: (val_a, val_b) for r in val_a + val_b for k in r if k == "val_bpb" or k.startswith("val/")}
    for key in sorted(evaluated):
        a, b = (dict(zip(*series(records, key))) for records in evaluated[key])
        if a and b:  # an evaluation both runs logged: each run's last value, and the largest gap at common steps
            common = sorted(a.keys() & b.keys())
            out[key] = {
                "last": [a[max(a)], b[max(b)]],
                "steps": [max(a), max(b)],
                "max_abs_diff": max((abs(a[s] - b[s]) for s in common), default=None),
            }
    out["final_val_loss"] = [val[-1]["val_loss"] if val else None for val in (val_a, val_b)]
    out["final_val_step"] = [val[-1]["step"] if val else None for val in (val_a, val_b)]
    return out


def compare_text(path_a, path_b, result):
    lines = [f"a = {path_a}\nb = {path_b}"]
    for key in ("train_loss", "grad_norm"):
        r = result[key]
        if not r["steps"]:
            lines.append(f"{key:<10}  no common steps")
            continue
        lines.append(
            f"{key:<10}  over {r['steps']} common steps ({r['first']}..{r['last']}): "
            f"max |a-b| {r['max_abs_diff']:.3e}, mean |a-b| {r['mean_abs_diff']:.3e}"
        )
    (va, vb), (sa, sb) = result["final_val_loss"], result["final_val_step"]
    fmt = lambda v, s: "n/a" if v is None else f"{v:.6f} (step {s})"
    line = f"final val_loss  a {fmt(va, sa)}, b {fmt(vb, sb)}"
    if va is not None and vb is not None:
        line += f", |a-b| {abs(va - vb):.3e}"
    for key, r in result.items():  # the evaluations (HellaSwag, the task suite, val bpb), then the val loss last
        if key in EVAL_KEYS or key.startswith(("mc/", "val")):
            gap = "n/a" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:.4f}"
            lines.append(
                f"{key:<22}  a {r['last'][0]:.4f} (step {r['steps'][0]}), b {r['last'][1]:.4f} "
                f"(step {r['steps'][1]}), max |a-b| at common steps {gap}"
            )
    lines.append(line)
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="run directories (out_dir) or metrics.jsonl files")
    parser.add_argument("-o", "--out", help="PNG to write (default: metrics.png next to the first run's metrics)")
    parser.add_argument(
        "--compare",
        action="store_true",
        help="print how far two runs' train loss and grad norm differ per step (no plot)",
    )
    args = parser.parse_args(argv)
    paths = [Path(p) for p in args.runs]
    if args.compare and len(paths) != 2:
        parser.error(f"--compare takes exactly two runs, got {len(paths)}")
    try:
        for p in paths:
            read_metrics(p)  # fail early, with the file's name, before importing matplotlib
    except FileNotFoundError as e:
        report_error("plot_metrics.py", e)
        return 2
    if args.compare:
        print(compare_text(*paths, compare(*paths)))
        return 0
    first = paths[0] if paths[0].is_dir() else paths[0].parent
    out = args.out or first / "metrics.png"
    labels = [(p if p.is_dir() else p.parent).name or str(p) for p in paths]
    plot(list(zip(labels, paths)), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
