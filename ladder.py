"""Will it hold at the size you train? A scaling ladder: train every size at every compute budget, fit how the
val loss scales, and predict a run before you pay for it.

    B="configs/shakespeare_cpu.py --data_dir=data/mine --eval_interval=0 --save_interval=0"
    python ladder.py "$B" --sizes 2x64,2x128,3x192,4x256 --flops 1e12,3e12,1e13 --out_dir out/ladder --dry_run
    python ladder.py "$B" --sizes 2x64,2x128,3x192,4x256 --flops 1e12,3e12,1e13 --out_dir out/ladder [--jobs 2]
    python ladder.py out/ladder --predict "--n_layer=6 --n_embd=384 --n_head=6 --target_flops=4e13"
    python ladder.py out/ladder --predict_flops 4e13

A size is n_layer x n_embd (LxW); its heads are n_embd / 64 (gpt2train.runner.HEAD_DIM: GPT-2's head dimension at
every size), so every width that is a multiple of 64 works. A budget is a run's target_flops (training FLOPs, the
count MFU uses; docs/config.md). Each (size, budget, seed) is one train.py run of the base arguments plus the size
and --target_flops, through the runner compare.py uses (gpt2train/runner.py): DIR/<size>_<budget>/seed<S> and its
.log, DIR/ledger.jsonl; a crash or Ctrl-C stops it, and the same command goes on from where it stopped. Seeds are
1337, 1338, ... (--seeds N); the runs of one seed start together under --jobs.

DIR/ladder.json holds every run (size, n_layer, n_embd, params, params_lookup, flops, tokens, seed, status, value:
its val_loss, out_dir) and the fits of gpt2train/scaling.py, each with its R^2 and bootstrap 95% intervals: per
budget the IsoFLOP parabola (isoflop: flops, n_opt, loss_opt, r2, at_edge: false, or 'smaller' / 'larger', the way
to extend --sizes), across budgets n_opt ~ C^a and d_opt ~ C^b (power_laws: a, b, ratio of tokens to params at the
optimum, r2), and the law L = E + A/N^alpha + B/D^beta over every run (law). N is the non-lookup params (the
result's params - params_lookup: what the FLOPs follow), D the tokens. The last line is `ladder: {...}`.

--predict "ARGS" (train.py arguments added to the ladder's base: the run's params and tokens are worked out from its
config and the model on the meta device) or --predict_flops C (the compute-optimal params and tokens of a budget):
the law's val loss with its 95% band; the last line is `predict: {...}`. --dry_run prices the ladder before it runs:
each run's steps, tokens and FLOPs, and its time at the tokens/s that a few measured steps of each size give.
A plot, DIR/ladder.png, needs matplotlib. docs/scaling.md has a ladder measured on a CPU. Bad input (a size that is
not LxW, a width 64 does not divide, a budget under one step, fewer than 3 sizes or 2 budgets, --predict on a
directory with no fit): one line, exit 2, nothing trained.
"""

import argparse
import json
import math
import shlex
import sys
import tempfile
import time
from pathlib import Path

from gpt2train.bpe import TokenizerError
from gpt2train.budget import planned_run
from gpt2train.config import ConfigError
from gpt2train.console import log
from gpt2train.files import atomic_write, report_error
from gpt2train.runner import Interrupted, Job, RunnerError, lock, parse_size, run_jobs, size_args
from gpt2train.scaling import FitError, fit_all, predict
from gpt2train.shards import ShardError

METRIC = "val_loss"
PROBE_STEPS = 8  # --dry_run: steps each size trains to measure its tokens/s (the first 2 untimed)


class LadderError(ValueError):
    """Bad arguments: one line."""


class RunsFailed(FitError):
    """Runs of the ladder did not end ok: no fit (exit 1; the same command makes the failed ones again)."""


class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise LadderError(message)


def parse(argv):
    parser = Parser(
        prog="ladder.py",
        description="A scaling ladder: sizes x compute budgets, fitted laws, predictions.",
        epilog=__doc__.split("\n\n", 2)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("base", metavar="BASE|DIR", help="quoted train.py arguments; with --predict: the ladder's DIR")
    parser.add_argument("--sizes", help="n_layer x n_embd, comma-separated: 2x64,2x128,3x192,4x256")
    parser.add_argument("--flops", help="compute budgets (target_flops), comma-separated: 1e12,3e12,1e13")
    parser.add_argument("--seeds", type=int, default=1, help="seeds 1337, 1338, ... (default 1)")
    parser.add_argument("--jobs", type=int, default=1, help="runs side by side (default 1)")
    parser.add_argument("--out_dir", help="runs, logs, ledger.jsonl, ladder.json, ladder.png")
    parser.add_argument("--dry_run", action="store_true", help="price the ladder: runs, FLOPs, measured time")
    parser.add_argument("--predict", metavar="ARGS", help="train.py arguments of a run to predict (DIR as BASE)")
    parser.add_argument("--predict_flops", type=float, metavar="C", help="predict a budget's compute-optimal run")
    return parser.parse_args(argv)


def rungs(args):
    """([(label, n_layer, n_embd)], [budget]) of --sizes and --flops, checked: one line for any bad one."""
    if not (args.sizes and args.flops and args.out_dir):
        raise LadderError("a ladder needs --sizes, --flops and --out_dir (or DIR with --predict/--predict_flops)")
    sizes = [(f"{n_layer}x{n_embd}", n_layer, n_embd) for n_layer, n_embd in map(parse_size, args.sizes.split(","))]
    budgets = []
    for text in args.flops.split(","):
        try:
            budget = float(text)
        except ValueError:
            budget = math.nan
        if not 0 < budget < math.inf:
            raise LadderError(f"--flops: {text!r} is not a number of FLOPs > 0")
        budgets.append(budget)
    if len(set(sizes)) < 3 or len(set(budgets)) < 2:
        raise LadderError(
            f"the fits need at least 3 sizes and 2 budgets; got {len(set(sizes))} sizes ({args.sizes}) and "
            f"{len(set(budgets))} budgets ({args.flops})"
        )
    if args.seeds < 1 or args.jobs < 1:
        raise LadderError(f"--seeds and --jobs must be >= 1, got {args.seeds} and {args.jobs}")
    return sizes, sorted(set(budgets))


def plan(base, sizes, budgets, seeds, out):
    """[(Job, its run record without results)] of every (seed, budget, size), each priced by planned_run (a budget
    under one step, a bad base: ConfigError before anything runs)."""
    planned = []
    scratch = out / ".plan"  # where planned_run may pretend to write: never created
    for seed in seeds:
        for budget in budgets:
            for label, n_layer, n_embd in sizes:
                args = [*base, *size_args(n_layer, n_embd), f"--target_flops={budget!r}"]
                try:
                    shape = planned_run(args, scratch)
                except ConfigError as e:
                    raise ConfigError(f"size {label} at {budget:g} FLOPs: {e}") from None
                run = {"size": label, "n_layer": n_layer, "n_embd": n_embd, "budget": budget, "seed": seed, **shape}
                key = f"{label}_{budget:g}/seed{seed}"
                planned.append((Job(key, args, seed, out / f"{label}_{budget:g}" / f"seed{seed}"), run))
    return planned


def run_record(key, run, rec):
    """ladder.json's record of the run `key`: its plan, then what the runner recorded (rec; {} before it ran)."""
    result = rec.get("result") or {}
    return {
        **{k: run[k] for k in ("size", "n_layer", "n_embd")},
        **{k: result.get(k, run[k]) for k in ("params", "params_lookup", "flops", "tokens")},
        "seed": run["seed"],
        **{k: rec.get(k) for k in ("status", "value", "out_dir")},
        "budget": run["budget"],
        "steps": result.get("steps", run["steps"]),
        "seconds": rec.get("seconds"),
        "key": key,
    }


def fit_runs(runs):
    """The runs as scaling.py takes them; FitError (one line) naming any that did not end ok."""
    bad = [f"{r['key']} ({r['status']})" for r in runs if r["status"] != "ok" or r["value"] is None]
    if bad:
        raise RunsFailed(
            f"the fits need every run ended ok with a val_loss; not: {', '.join(bad)} (their logs say why; rerun the "
            "same command to make the interrupted or failed ones again)"
        )
    return [
        {"n": r["params"] - r["params_lookup"], "d": r["tokens"], "budget": r["budget"], "loss": r["value"]}
        for r in runs
    ]


def ladder(args):
    """Run the ladder (or price it: --dry_run); returns ladder.json's content."""
    t0, (sizes, budgets) = time.perf_counter(), rungs(args)  # cost: from here to the last run's end
    out, base = Path(args.out_dir).absolute(), shlex.split(args.base)
    seeds = [1337 + i for i in range(args.seeds)]
    planned = plan(base, sizes, budgets, seeds, out)
    if args.dry_run:
        return dry_run(planned, base, sizes, args.jobs)
    path = out / "ladder.json"
    header = {"base": base, "sizes": [s[0] for s in sizes], "budgets": budgets, "seeds": seeds}
    out.mkdir(parents=True, exist_ok=True)
    with lock(out, "ladder.py"):
        earlier = json.loads(path.read_text())["runs"] if path.is_file() else []
        done = {r["key"]: r for r in earlier}
        runs = {job.key: run_record(job.key, run, {}) for job, run in planned}
        by_key = dict((job.key, run) for job, run in planned)
        made_s = []

        def on_run(key, rec, made):
            runs[key] = run_record(key, by_key[key], rec)
            if made:
                made_s.append(rec["seconds"])
            note = "made" if made else "made before"
            log(
                f"[{sum(r['status'] is not None for r in runs.values())}/{len(runs)}] {key}: {rec['status']}, "
                f"{METRIC} {rec['value']} ({note})"
            )
            atomic_write(path, json.dumps({**header, "runs": list(runs.values())}, indent=2) + "\n")

        log(f"ladder: {len(sizes)} sizes x {len(budgets)} budgets x {len(seeds)} seeds = {len(planned)} runs -> {out}")
        run_jobs([job for job, _ in planned], out, jobs=args.jobs, metric=METRIC, done=done, on_run=on_run)
        wall = time.perf_counter() - t0
        report = {**header, "runs": list(runs.values())}
        # of this call: the runs it made (kept ones cost nothing now), against the wall time of its --jobs slots
        overhead = wall * args.jobs / sum(made_s) - 1 if made_s else None
        report["cost"] = {"wall_s": wall, "runs_s": sum(made_s), "jobs": args.jobs, "overhead": overhead}
        atomic_write(path, json.dumps(report, indent=2) + "\n")
        fit = fit_all(fit_runs(report["runs"]))
        report.update({k: fit[k] for k in ("isoflop", "power_laws", "law")})
        report["bootstrap"] = {  # what --predict draws on: the law's residuals, each replicate's power laws and law
            "residuals": fit["residuals"],
            "replicates": [{k: r[k] for k in ("power_laws", "law")} for r in fit["replicates"]],
        }
        atomic_write(path, json.dumps(report, indent=2) + "\n")
    plot(report, out / "ladder.png")
    return report


def dry_run(planned, base, sizes, jobs):
    """Each run's plan and its estimated seconds: its tokens at the tokens/s of PROBE_STEPS steps of its size
    (measured by train.py through the runner, in a temporary directory), the evaluations not counted."""
    speed = {}
    with tempfile.TemporaryDirectory(prefix="ladder-dry-run-") as tmp:
        probe = [f"--max_steps={PROBE_STEPS}", "--eval_interval=0", "--save_interval=0", "--hellaswag_interval=0"]
        probes = [Job(label, [*base, *size_args(n, e), *probe], 1337, Path(tmp) / label) for label, n, e in sizes]
        for key, rec in run_jobs(probes, tmp, jobs=jobs, metric="tokens_per_s").items():
            if rec["status"] != "ok" or not rec["value"]:
                raise LadderError(
                    f"--dry_run: the probe of size {key} ended {rec['status']} (its log: {tmp}/{key}.log)"
                )
            speed[key] = rec["value"]
    runs = [
        {
            **{k: run[k] for k in ("size", "budget", "seed", "params", "params_lookup", "steps", "tokens", "flops")},
            "tokens_per_s": speed[run["size"]],
            "seconds": run["tokens"] / speed[run["size"]],
        }
        for _, run in planned
    ]
    total = sum(r["seconds"] for r in runs)
    return {
        "dry_run": True,
        "runs": runs,
        "flops": sum(r["flops"] for r in runs),
        "seconds": total,
        "seconds_at_jobs": total / jobs,
    }


def predict_from(args):
    """--predict / --predict_flops on DIR's ladder.json: the prediction's record."""
    path = Path(args.base) / "ladder.json"
    report = json.loads(path.read_text()) if path.is_file() else {}
    if "law" not in report or "bootstrap" not in report:
        raise LadderError(f"{path}: no fit there (run the ladder into {args.base} first; it writes the fit last)")
    fit = {**{k: report[k] for k in ("power_laws", "law")}, **report["bootstrap"]}
    edges = [f"{c['flops']:g}" for c in report["isoflop"] if c["at_edge"]]
    if edges and args.predict_flops is not None:
        log(
            f"the IsoFLOP optimum of budget(s) {', '.join(edges)} is at an end of the sizes: n_opt, d_opt lean on it",
            note=True,
        )
    if args.predict_flops is not None:
        if not 0 < args.predict_flops < math.inf:
            raise LadderError(f"--predict_flops: {args.predict_flops} is not a number of FLOPs > 0")
        return predict(fit, flops=args.predict_flops)
    shape = planned_run([*report["base"], *shlex.split(args.predict)], Path(args.base) / ".plan")
    return predict(fit, n=shape["n"], d=shape["tokens"], flops=shape["flops"])


def fmt(value, spec=".4g"):
    return "-" if value is None else format(value, spec)


def table(report):
    """The printed summary of a ladder (or its dry run)."""
    rows = [
        "| size | params (lookup) | budget | steps | tokens | val_loss | status | s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        rows.append(
            f"| {r['size']} | {r['params']:,} ({r['params_lookup']:,}) | {r['budget']:.3g} | {r['steps']:,} | "
            f"{r['tokens']:,} | {fmt(r.get('value'))} | {r.get('status', 'planned')} | {fmt(r.get('seconds'), '.0f')} |"
        )
    if report.get("dry_run"):
        rows.append(
            f"\n{len(report['runs'])} runs, {report['flops']:.3g} FLOPs, about {report['seconds']:.0f} s "
            f"({report['seconds_at_jobs']:.0f} s at --jobs), evaluations not counted"
        )
        return "\n".join(rows)
    rows.append("\nIsoFLOP optima (loss against ln N, a parabola per budget):")
    for c in report["isoflop"]:
        edge = f"  AT THE EDGE: extend --sizes {c['at_edge']}" if c["at_edge"] else ""
        ci = c["ci95"]
        rows.append(
            f"  C={c['flops']:.3g}: N_opt {c['n_opt']:,.0f} [{ci['n_opt'][0]:,.0f}, {ci['n_opt'][1]:,.0f}], "
            f"loss {c['loss_opt']:.4f}, R^2 {c['r2']:.3f}{edge}"
        )
    p = report["power_laws"]
    band = lambda k: f"[{p['ci95'][k][0]:.3g}, {p['ci95'][k][1]:.3g}]"  # noqa: E731
    rows.append(
        f"power laws: N_opt ~ C^{p['a']:.3f} {band('a')}, D_opt ~ C^{p['b']:.3f} {band('b')}, tokens/param at the "
        f"optimum {p['ratio']:.1f} {band('ratio')}, R^2 {fmt(p['r2']['a'], '.3f')} and {fmt(p['r2']['b'], '.3f')}"
    )
    law = report["law"]
    terms = ", ".join(f"{k} {law[k]:.4g} [{law['ci95'][k][0]:.4g}, {law['ci95'][k][1]:.4g}]" for k in law["ci95"])
    rows.append(f"law L = E + A/N^alpha + B/D^beta: {terms}; R^2 {law['r2']:.4f}")
    cost = report["cost"]
    rows.append(
        f"cost: {cost['wall_s']:.0f} s wall x {cost['jobs']} jobs, the runs {cost['runs_s']:.0f} s, "
        f"overhead {fmt(cost['overhead'], '.1%')}"
    )
    return "\n".join(rows)


def plot(report, out_path):
    """DIR/ladder.png: the IsoFLOP points and parabolas with their optima beside the law's curve, and the optima
    against compute with the power law. Skipped, with a note, without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        log("ladder.py: no plot without matplotlib (pip install matplotlib)", note=True)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from gpt2train.scaling import law_loss

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    law = report["law"]
    for i, c in enumerate(report["isoflop"]):
        runs = [r for r in report["runs"] if r["budget"] == c["flops"]]
        n = np.array([r["params"] - r["params_lookup"] for r in runs], float)
        d = np.array([r["tokens"] for r in runs], float)
        color = f"C{i}"
        ax.scatter(n, [r["value"] for r in runs], color=color, label=f"C = {c['flops']:.2g}")
        x = np.log(n)
        grid = np.linspace(x.min(), x.max(), 50)
        ax.plot(np.exp(grid), np.polyval(np.polyfit(x, [r["value"] for r in runs], 2), grid), "--", color=color)
        slope, icpt = np.polyfit(x, np.log(d), 1)
        ax.plot(np.exp(grid), law_loss(law, np.exp(grid), np.exp(icpt + slope * grid)), "-", color=color, alpha=0.5)
        ax.plot(c["n_opt"], c["loss_opt"], "*", color=color, markersize=12)
    ax.set(
        xscale="log", xlabel="non-lookup params N", ylabel="val loss", title="IsoFLOP: parabola --, law -, optimum *"
    )
    ax.legend(fontsize=8)
    flops = np.array([c["flops"] for c in report["isoflop"]])
    p = report["power_laws"]
    ax2.loglog(flops, [c["n_opt"] for c in report["isoflop"]], "o", label="N_opt")
    ax2.loglog(flops, p["n_coef"] * flops ** p["a"], "-", label=f"N_opt ~ C^{p['a']:.2f}")
    ax2.loglog(flops, [c["d_opt"] for c in report["isoflop"]], "s", label="D_opt")
    ax2.loglog(flops, p["d_coef"] * flops ** p["b"], "-", label=f"D_opt ~ C^{p['b']:.2f}")
    ax2.set(xlabel="training FLOPs C", title="compute-optimal N and D")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_path, dpi=80)
    plt.close(fig)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parse(argv)
        if args.predict is not None or args.predict_flops is not None:
            record = predict_from(args)
            print(
                f"predicted val_loss {record['val_loss']:.4f}, 95% band [{record['ci95'][0]:.4f}, "
                f"{record['ci95'][1]:.4f}], for {record['params']:,.0f} params (non-lookup) x "
                f"{record['tokens']:,.0f} tokens = {record['flops']:.3g} FLOPs"
            )
            print(f"predict: {json.dumps(record)}")
            return 0
        report = ladder(args)
    except (LadderError, RunnerError, ConfigError, FitError, ShardError, TokenizerError, OSError) as e:
        report_error("ladder.py", e)
        return 1 if isinstance(e, RunsFailed) else 2
    except Interrupted as e:
        report_error("ladder.py", e)
        return e.exit_code
    print(table(report))
    brief = {k: report[k] for k in ("isoflop", "power_laws", "law", "cost") if k in report}
    print(f"ladder: {json.dumps(brief or {k: report[k] for k in ('flops', 'seconds', 'seconds_at_jobs')})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
