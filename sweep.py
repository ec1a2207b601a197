"""Where is a hyperparameter best, and does that move with the model's size? Train a grid of train.py runs over
seeds on the runner (gpt2train/runner.py, as compare.py does), print each point's mean +- std, and fit the optimum:
a parabola in log(value) through the best point and its neighbours, with a bootstrap 95% interval over the seeds.

    B="configs/shakespeare_cpu.py --data_dir=data/shakespeare_512 --max_steps=150 --min_lr=1e-4"
    python sweep.py "$B" --grid learning_rate=2e-3,4e-3,8e-3,1.6e-2,3.2e-2 --out_dir out/sweep/lr
    python sweep.py "$B --parametrization=mup --mup_base_width=64" --grid learning_rate=2e-3,4e-3,8e-3,1.6e-2 \
        --sizes 2x64,2x256 --seeds 3 --jobs 2 --out_dir out/sweep/mup      # does the optimum move with width?

BASE is one quoted string of train.py arguments (config files, --key=value). Each --grid KEY=V1,V2,... names a
config key and its values (checked as train.py checks them); several --grid flags make the product, and the first
one's key is the one fitted (the others held at the best point's values). --sizes LxW,... runs the whole grid at each
size (n_layer x n_embd, n_embd / 64 heads) and reports `moved`: the largest size's optimum over the smallest's, with
its 95% interval; under muP (parametrization='mup') a transferred rate moves little (docs/transfer.md). A best
point at an end of the grid is `at_edge`, with the way to extend it. --confirm scores every run's final checkpoint on
the held-out test split (evaluate.py --split test) and fits the optimum there too: a rate that is best on val only
(an experiment loop that looked at val too long) shows up as a test optimum elsewhere.

Each run gets --seed (1337, 1338, ...), --out_dir=DIR/SIZE/POINT/seedS and --ledger=DIR/ledger.jsonl; its log is
beside its out_dir. DIR/sweep.json (rewritten after every run) holds `points` (each: `values`, `size`, `seeds`,
`mean`, `std`, `runs`), `optima` (per size, "all" without --sizes: `key`, `value`, `ci95`, `at_edge`, `extend`,
`best`) and, with --sizes, `moved`; the last stdout line is `sweep: {...}`. Run again into the same --out_dir,
sweep.py keeps the finished runs (a crash, Ctrl-C, more seeds). Exit 0 when every run was made, 2 on bad arguments
(one line, nothing trained).
"""

import argparse
import ast
import itertools
import json
import math
import shlex
import statistics
import sys
from pathlib import Path

from gpt2train import optimum, runner
from gpt2train.config import ConfigError, check_value, make_config, parse_args
from gpt2train.console import log
from gpt2train.files import atomic_write, report_error

ROOT = Path(__file__).resolve().parent
FIRST_SEED = 1337
SIZE_KEYS = ("n_layer", "n_embd", "n_head")


class SweepError(ValueError):
    """Bad arguments: one line."""


def parse_grid(text, sizes):
    """(key, [values]) of one --grid KEY=V1,V2,...: each value a Python literal (a bare word: a string) checked
    against the key's config type."""
    key, eq, raw = text.partition("=")
    key = key.strip().lstrip("-")
    if not eq or not raw.strip():
        raise SweepError(f"--grid {text!r}: expected KEY=V1,V2,... (e.g. learning_rate=1e-3,2e-3,4e-3)")
    if key in runner.SET_BY_RUNNER or sizes and key in SIZE_KEYS:
        raise SweepError(f"--grid {key}: set by sweep.py itself ({'--sizes' if key in SIZE_KEYS else 'per run'})")
    values = []
    for word in raw.split(","):
        try:
            value = ast.literal_eval(word.strip())
        except (ValueError, SyntaxError):
            value = word.strip()
        try:
            values.append(check_value(key, value, f"--grid {key}"))
        except ConfigError as e:
            raise SweepError(str(e)) from None
    if len(set(map(repr, values))) < len(values):
        raise SweepError(f"--grid {key}: a value is listed twice ({raw})")
    return key, values


def check_args(base, grid, sizes):
    """Every run's train.py arguments parse and validate (ConfigError -> SweepError: nothing is trained), and the
    fitted key's values are positive numbers when there are at least 3 of them."""
    key, values = grid[0]
    if len(values) >= 3 and not all(isinstance(v, (int, float)) and v > 0 for v in values):
        raise SweepError(f"--grid {key}: the fitted (first) key needs positive numbers; got {values}")
    for size, point in itertools.product(sizes or [None], points_of(grid)):
        try:
            make_config(parse_args(run_args(base, size, point)))
        except ConfigError as e:
            where = f" (size {size_name(size)}, {point_name(point)})" if size or len(values) > 1 else ""
            raise SweepError(f"{e}{where}") from None


def points_of(grid):
    return [dict(zip([k for k, _ in grid], combo)) for combo in itertools.product(*[v for _, v in grid])]


def run_args(base, size, point):
    return [*base, *(runner.size_args(*size) if size else []), *(f"--{k}={v!r}" for k, v in point.items())]


def size_name(size):
    return f"{size[0]}x{size[1]}" if size else None


def point_name(point):
    return ",".join(f"{k}={v}" for k, v in point.items())


def make_jobs(base, grid, sizes, seeds, out):
    """The runs, seed by seed (the runner starts a wave's runs together: a drifting machine slows them alike)."""
    jobs = []
    for seed, size, point in itertools.product(seeds, sizes or [None], points_of(grid)):
        where = [size_name(size) or "all", point_name(point), f"seed{seed}"]
        jobs.append(runner.Job("/".join(where), run_args(base, size, point), seed, out.joinpath(*where)))
    return jobs


def summarize(grid, sizes, seeds, records, metric, tests=None):
    """sweep.json's content from the records so far (a point's mean over its seeds' finished runs)."""
    points, optima = [], {}
    for size, point in itertools.product(sizes or [None], points_of(grid)):
        runs = [records.get(f"{size_name(size) or 'all'}/{point_name(point)}/seed{s}") for s in seeds]
        runs = [r for r in runs if r is not None]
        ok = [r["value"] for r in runs if r["status"] == "ok" and isinstance(r["value"], (int, float))]
        entry = {"values": point, "size": size_name(size), "seeds": [r["seed"] for r in runs], "metric": metric}
        entry["mean"] = statistics.fmean(ok) if ok else None
        entry["std"] = statistics.stdev(ok) if len(ok) > 1 else 0.0 if ok else None
        if tests is not None:
            scored = [tests[r["key"]]["test_loss"] for r in runs if r["key"] in tests]
            entry["test_loss"] = statistics.fmean(scored) if scored else None
        points.append({**entry, "runs": runs})
    for size in sizes or [None]:
        optima[size_name(size) or "all"] = fit_size(grid, size, seeds, records, lambda r: r.get("value"))
        if tests is not None:
            test = fit_size(grid, size, seeds, records, lambda r: tests.get(r["key"], {}).get("test_loss"))
            optima[size_name(size) or "all"]["confirm"] = test
    report = {"metric": metric, "points": points, "optima": optima}
    if sizes and len(sizes) > 1:
        small, large = min(sizes, key=flops_rank), max(sizes, key=flops_rank)
        pairs = [curve(grid, s, seeds, records, lambda r: r.get("value")) for s in (small, large)]
        fitted = all(pair[1] and len(pair[0]) >= 3 for pair in pairs)
        report["moved"] = {"of": [size_name(small), size_name(large)], **optimum.moved(*pairs)} if fitted else None
    return report


def flops_rank(size):
    return size[0] * size[1] ** 2, size[1]


def curve(grid, size, seeds, records, value_of):
    """(values, rows) of the fitted key at `size`, the other keys at the best point's values; rows per finished
    seed (a seed whose runs have not all ended is left out)."""
    key, values = grid[0]
    means = {}
    for point in points_of(grid):
        runs = [records.get(f"{size_name(size) or 'all'}/{point_name(point)}/seed{s}") for s in seeds]
        got = [value_of(r) if r and r["status"] == "ok" else None for r in runs]
        means[point_name(point)] = (
            statistics.fmean(got) if got and all(isinstance(v, (int, float)) for v in got) else math.inf
        )
    best = min(points_of(grid), key=lambda p: means[point_name(p)])
    line = [{**best, key: v} for v in values]
    rows = []
    for s in seeds:
        runs = [records.get(f"{size_name(size) or 'all'}/{point_name(p)}/seed{s}") for p in line]
        if all(r is not None for r in runs):
            rows.append([value_of(r) if r["status"] == "ok" else None for r in runs])
    return values, rows


def fit_size(grid, size, seeds, records, value_of):
    key, _ = grid[0]
    values, rows = curve(grid, size, seeds, records, value_of)
    if len(values) < 3 or not rows:
        return {"key": key, "value": None, "ci95": None, "at_edge": False, "extend": None, "best": None}
    return {"key": key, **optimum.fit_optimum(values, rows)}


def table(report):
    rows = [f"{'size':<8} {'point':<32} {'mean':>10} {'std':>9}  seeds"]
    for p in report["points"]:
        mean = "-" if p["mean"] is None else f"{p['mean']:.4f}"
        std = "-" if p["std"] is None else f"± {p['std']:.4f}"
        rows.append(f"{p['size'] or '-':<8} {point_name(p['values']):<32} {mean:>10} {std:>9}  {len(p['runs'])}")
    for size, fit in report["optima"].items():
        if fit["value"] is None:
            rows.append(f"optimum ({size}): none (no finished grid of >= 3 values)")
            continue
        ci = "" if fit["ci95"] is None else f" (95% CI {fit['ci95'][0]:.4g} - {fit['ci95'][1]:.4g})"
        edge = f"; at the grid's edge: extend it {fit['extend']}" if fit["at_edge"] else ""
        rows.append(f"optimum ({size}): {fit['key']} = {fit['value']:.4g}{ci}{edge}")
    moved = report.get("moved")
    if moved and moved["ratio"] is not None:
        ci = "" if moved["ci95"] is None else f" (95% CI {moved['ci95'][0]:.3g} - {moved['ci95'][1]:.3g})"
        rows.append(f"moved: {moved['of'][1]}'s optimum / {moved['of'][0]}'s = {moved['ratio']:.3g}{ci}")
    return "\n".join(rows)


def earlier_records(out):
    """{key: record} of the runs an earlier sweep.py into `out` made (its sweep.json)."""
    path = out / "sweep.json"
    if not path.exists():
        return {}
    return {r["key"]: r for p in json.loads(path.read_text()).get("points", []) for r in p["runs"]}


def parse(argv):
    parser = argparse.ArgumentParser(
        description="Sweep train.py hyperparameters over seeds (and sizes) and fit the optimum.",
        epilog=__doc__.split("\n\n", 2)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("base", metavar="BASE", help="quoted train.py arguments every run shares")
    parser.add_argument("--grid", action="append", required=True, metavar="KEY=V1,V2,...", help="a swept key")
    parser.add_argument("--sizes", default=None, help="comma-separated n_layer x n_embd sizes, e.g. 2x64,4x256")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 1337, 1338, ... (default 3)")
    parser.add_argument("--jobs", type=int, default=1, help="runs side by side (a CPU: threads split; GPUs: one each)")
    parser.add_argument("--metric", default="val_loss", help="the result field minimised (default val_loss)")
    parser.add_argument("--confirm", action="store_true", help="also score every run on the test split")
    parser.add_argument("--out_dir", required=True, help="runs, logs, ledger.jsonl and sweep.json")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    try:
        if args.seeds < 1:
            raise SweepError(f"--seeds must be >= 1, got {args.seeds}")
        sizes = [runner.parse_size(s) for s in args.sizes.split(",")] if args.sizes else None
        grid = [parse_grid(g, sizes) for g in args.grid]
        if len({k for k, _ in grid}) < len(grid):
            raise SweepError("--grid: a key is given twice")
        base = shlex.split(args.base)
        check_args(base, grid, sizes)
        report = sweep(base, grid, sizes, args, Path(args.out_dir))
    except (SweepError, runner.RunnerError, OSError) as e:
        report_error("sweep.py", e)
        return 2
    except runner.Interrupted as e:
        report_error("sweep.py", e)
        return e.exit_code
    print(table(report))
    print(f"sweep: {json.dumps({k: report[k] for k in ('metric', 'optima', 'moved') if k in report})}")
    return 0


def sweep(base, grid, sizes, args, out):
    """Make (or keep) every run, rewriting sweep.json after each; with --confirm score them on the test split."""
    seeds = [FIRST_SEED + i for i in range(args.seeds)]
    jobs = make_jobs(base, grid, sizes, seeds, out.absolute())
    log(f"sweep: {len(jobs)} runs ({len(points_of(grid))} points x {len(sizes or [0])} sizes x {len(seeds)} seeds)")
    out.mkdir(parents=True, exist_ok=True)
    records, made = {}, []

    def on_run(key, record, new):
        records[key] = record
        made.append(key)
        took = f"{record['seconds']:.0f} s" if new else "made before"
        log(f"[{len(made)}/{len(jobs)}] {key}: {record['status']}, {args.metric} {record['value']} ({took})")
        atomic_write(out / "sweep.json", json.dumps(summarize(grid, sizes, seeds, records, args.metric), indent=2))

    with runner.lock(out, "sweep.py"):
        if args.confirm:  # before anything trains
            runner.check_test_shards("the base arguments", jobs[0].args)
        done = earlier_records(out)
        records = runner.run_jobs(jobs, out, jobs=args.jobs, metric=args.metric, done=done, on_run=on_run)
        tests = (
            {key: runner.evaluate_test(r) for key, r in records.items() if r["status"] == "ok"}
            if args.confirm
            else None
        )
        report = summarize(grid, sizes, seeds, records, args.metric, tests)
        atomic_write(out / "sweep.json", json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    sys.exit(main())
