"""Did a change help? Train each arm (a string of train.py arguments) with the same seeds, one seed at a time, and
test each arm against the first (the baseline) with a paired t-test over the seeds.

    M="--data_dir=data/shakespeare --n_layer=4 --n_embd=256 --batch_size=16 --max_steps=45"
    python compare.py "configs/modern.py $M" "name=no_bigram configs/modern.py $M --bigram_embeds=0" --out_dir out/cmp
    python compare.py "configs/shakespeare_cpu.py" "configs/shakespeare_cpu.py" --repeat   # change nothing: identical?
    python compare.py "--nproc_per_node 8 configs/gpt2_124m.py --max_seconds=600" "..."     # each run under torchrun
    python compare.py "$A" "$B" --jobs 2 --sizes 2x64,3x128,4x192   # two runs at once; does the verdict hold?
    python compare.py "$A" "$B" --equal_time 60 --confirm           # ~60 s each; the verdict again on the test split

An arm is one quoted string: train.py's arguments (config files, --key=value), optionally `name=NAME` (default:
baseline, arm1, arm2, ...) and `--nproc_per_node N` (the run goes through this interpreter's torch.distributed.run).
Each run gets --seed=S, --out_dir=DIR/NAME/seedS and --ledger=DIR/ledger.jsonl; its console output goes to
DIR/NAME/seedS.log (gpt2train/runner.py runs them in this directory: an arm's paths mean what they mean to
train.py). For every seed (1337, 1338, ...) the arms run in turn, A B C then A B C (with --jobs J, J at once), so a
machine that drifts slows every arm alike. Runs with the same seed start from the same weights and read the same
batches (train.py is deterministic), so the per-seed difference of two arms holds little noise beyond the change
itself: that is what the test uses.

Per arm against the baseline (DIR/compare.json, the table, and the last line `compare: {...}`): the per-seed
differences of --metric (any numeric field of train.py's result; lower is better unless it is an accuracy, mfu or
tokens/s), their mean, its 95% t-interval, the two-sided paired t-test's p-value and a verdict: identical (every
difference exactly 0), better or worse (p < 0.05), no detectable difference, failed (a run did not end with status
ok) or no value (every run ok, the metric null in them); the speed ratio (geometric mean of the per-seed tokens/s
ratios) and the first step whose train loss differs from the baseline's (None: none did). --repeat runs the
baseline's first seed twice: whether the machine repeats a run bit for bit.

--sizes 2x64,3x128 (n_layer x n_embd, heads of 64) runs every arm at every size: a comparison per arm and size, and
per arm a `transfer` verdict: holds (better at every size), shrinks (better, then no detectable difference at the
largest), grows (no detectable difference at the smallest, better at the larger), flips (better at a smaller size,
worse at a larger), else the largest size's verdict; with the slope of the delta against log(params).
--equal_time S times each arm in a short interleaved calibration and gives each arm the --max_steps that take it S
seconds, for every seed (compare.json's arms' `max_steps`). --confirm scores each run's final checkpoint on the
data's test split (evaluate.py --split test) and adds a `confirm` verdict on test_loss beside the val verdict.

Exit 0 when every run was made (whatever their status); 2 on bad arguments or a run that exits 2 (bad input: its
one line); 143/130 on SIGTERM/SIGINT (forwarded to the runs, which save; compare.json written). Run again into the
same --out_dir with the same arms, compare.py goes on from where it stopped: finished runs are kept (by arm and
seed), interrupted ones made again, more seeds added (--seeds 5 after 3; fewer seeds keep the others in compare.json
and leave them out of the verdict). One compare.py at a time per --out_dir. AGENTS.md describes the loop;
docs/experiments.md has measured examples.
"""

import argparse
import json
import math
import re
import shlex
import statistics
import sys
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

from gpt2train import runner
from gpt2train.console import log
from gpt2train.files import LockError, atomic_write, first_line, report_error
from gpt2train.runner import Interrupted, Job, RunnerError

ROOT = Path(__file__).resolve().parent
HIGHER_IS_BETTER = re.compile(r"acc|mc_|mfu|tokens_per_s")  # the rest (losses, bpb, seconds, memory): lower
HORIZON_KEYS = ("max_steps", "max_seconds", "target_flops", "tokens_per_param")  # what --equal_time sets
MAX_SEEDS = 1000
CALIBRATION = (2, 10)  # --equal_time's timing: rounds (A B A B) of runs of this many steps


class CompareError(RunnerError):
    """Bad arguments: one line."""


@dataclass
class Arm:
    name: str
    args: list  # train.py's
    nproc: int | None = None  # torchrun --nproc_per_node
    size: str | None = None  # --sizes: 'LxW'
    max_steps: int | None = None  # --equal_time's
    runs: dict = field(default_factory=dict)  # {seed: record}, seeds beyond --seeds included

    @property
    def label(self):
        return self.name if self.size is None else f"{self.name}@{self.size}"

    def key(self, seed, suffix=""):
        return "/".join(p for p in (self.name, self.size) if p) + f"/seed{seed}{suffix}"

    def job(self, seed, out, suffix="", extra=()):
        """The runner's Job for one of the arm's runs: its args, then the size's, then --equal_time's steps."""
        args = [*self.args, *(runner.size_args(*runner.parse_size(self.size)) if self.size else [])]
        args += [f"--max_steps={self.max_steps}"] if self.max_steps else []
        key = self.key(seed, suffix)
        return Job(key, [*args, *extra], seed, out / key, self.nproc)

    def seed_runs(self, seeds):
        return [self.runs[s] for s in seeds if s in self.runs]


def parse_arm(text, index):
    """An Arm from one quoted argument string; `index` names the default (baseline, arm1, ...)."""
    try:
        words, name, nproc, args = shlex.split(text), None, None, []
    except ValueError as e:
        raise CompareError(f"arm {text!r}: {e} (an unbalanced quote?)") from None
    while words:
        word = words.pop(0)
        if word.startswith("name="):
            name = word[len("name=") :]
        elif word.split("=")[0] == "--nproc_per_node":
            value = word.split("=", 1)[1] if "=" in word else (words.pop(0) if words else "")
            if not value.isdigit() or int(value) < 1:
                raise CompareError(f"arm {text!r}: --nproc_per_node needs a count >= 1, got {value!r}")
            nproc = int(value)
        else:
            key = word[2:].split("=")[0] if word.startswith("--") else None
            if key in runner.SET_BY_RUNNER:
                raise CompareError(f"arm {text!r}: compare.py sets --{key} for every run; leave it out")
            args.append(word)
    name = name or ("baseline" if index == 0 else f"arm{index}")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or name.startswith("."):
        raise CompareError(f"arm {text!r}: name={name!r} must be letters, digits, '_', '-' or '.' (a directory name)")
    return Arm(name, args, nproc)


def train_losses(run):
    """{step: train loss} of a run's metrics.jsonl ({} without one; a non-finite loss is None)."""
    path = Path(run["out_dir"]) / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    return {r["step"]: r["train_loss"] for r in records if "train_loss" in r}


def first_differing_step(run, base):
    """The first step whose train loss differs between two runs (a step only one of them has differs); None."""
    a, b = train_losses(run), train_losses(base)
    return next((s for s in sorted(set(a) | set(b)) if s not in a or s not in b or a[s] != b[s]), None)


def paired_test(deltas):
    """(mean, 95% t-interval, two-sided p) of per-seed differences: scipy's paired t-test (ttest_rel, as the one-sample
    test of the differences); all exactly 0: (0, [0, 0], 1); one seed: no interval or p (None)."""
    n, mean = len(deltas), statistics.fmean(deltas)
    if all(d == 0 for d in deltas):
        return 0.0, [0.0, 0.0], 1.0
    if n < 2:
        return mean, None, None
    if statistics.stdev(deltas) == 0:  # every seed moved by exactly the same amount
        return mean, [mean, mean], 0.0
    from scipy import stats

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # scipy's precision note on near-equal deltas: nothing the user can act on
        test = stats.ttest_1samp(deltas, 0.0)
    return mean, [float(v) for v in test.confidence_interval(0.95)], float(test.pvalue)


def verdict(pairs, metric, failed=False):
    """(deltas, delta, ci95, p, verdict) of (arm value, baseline value) pairs of ok runs; failed: a run was not ok.
    Every value null in runs that were all ok: 'no value' (nothing to compare, e.g. a field the runs leave null)."""
    deltas = [a - b for a, b in pairs if a is not None and b is not None]
    delta, ci95, p = paired_test(deltas) if deltas else (None, None, None)
    if failed:
        word = "failed"
    elif not deltas:
        word = "no value"
    elif p == 1.0 and delta == 0:
        word = "identical"
    elif p is not None and p < 0.05:
        word = "better" if (delta < 0) != bool(HIGHER_IS_BETTER.search(metric)) else "worse"
    else:
        word = "no detectable difference"
    return deltas, delta, ci95, p, word


def compare_arm(arm, base, metric, seeds, confirm=False):
    """The arm against the baseline (at the same size) over `seeds`: compare.json's `comparisons` entry."""
    runs, base_runs = arm.seed_runs(seeds), base.seed_runs(seeds)
    pairs = [(r, b) for r, b in zip(runs, base_runs) if r["status"] == b["status"] == "ok"]
    failed = len(pairs) < len(runs) or len(runs) < len(base_runs)
    deltas, delta, ci95, p, word = verdict([(r["value"], b["value"]) for r, b in pairs], metric, failed)
    speeds = [r["tokens_per_s"] / b["tokens_per_s"] for r, b in pairs if r["tokens_per_s"] and b["tokens_per_s"]]
    differs = [s for s in (first_differing_step(r, b) for r, b in zip(runs, base_runs)) if s is not None]
    entry = {"arm": arm.name, "baseline": base.name, **({"size": arm.size} if arm.size else {})}
    entry |= {"deltas": deltas, "delta": delta, "ci95": ci95, "p_value": p, "verdict": word}
    entry["speed_ratio"] = math.exp(statistics.fmean(map(math.log, speeds))) if speeds else None
    entry["first_differing_step"] = min(differs) if differs else None
    if confirm:
        tests = [(r.get("confirm", {}).get("test_loss"), b.get("confirm", {}).get("test_loss")) for r, b in pairs]
        names = ("deltas", "delta", "ci95", "p_value", "verdict")
        entry["confirm"] = {"metric": "test_loss", **dict(zip(names, verdict(tests, "test_loss", failed)))}
    return entry


def slope_fit(points):
    """(slope, its 95% t-interval) of the least-squares line through (x, y) points (scipy's linregress); (None, None)
    under 3 points or when every x is the same."""
    if len(points) < 3 or len({x for x, _ in points}) == 1:
        return None, None
    from scipy import stats

    fit = stats.linregress(*zip(*points))
    half = stats.t.ppf(0.975, len(points) - 2) * fit.stderr
    return float(fit.slope), [float(fit.slope - half), float(fit.slope + half)]


def transfer_verdict(words):
    """The transfer verdict of the per-size verdicts, smallest size first (compare.py's docstring)."""
    if all(w == "better" for w in words):
        return "holds"
    better, worse = ([i for i, w in enumerate(words) if w == v] for v in ("better", "worse"))
    if better and worse and min(better) < max(worse):
        return "flips"
    if not worse and len(words) > 1 and better:
        if words[0] == "better" and words[-1] == "no detectable difference":
            return "shrinks"
        if words[0] == "no detectable difference" and words[-1] == "better":
            return "grows"
    return words[-1]


def transfer(arms, comparisons):
    """compare.json's `transfer`: per arm (not the baseline), its delta at each size (smallest first by params), the
    slope of the per-seed deltas against log(params) and the transfer verdict."""
    params = {(a.name, a.size): next((r["params"] for r in a.runs.values() if r.get("params")), None) for a in arms}
    out = []
    for name in dict.fromkeys(c["arm"] for c in comparisons):
        rows = [c for c in comparisons if c["arm"] == name]
        rows.sort(key=lambda c: params[name, c["size"]] or 0)
        per_size = [
            {"size": c["size"], "params": params[name, c["size"]]} | {k: c[k] for k in ("delta", "ci95", "verdict")}
            for c in rows
        ]
        points = [(math.log(params[name, c["size"]]), d) for c in rows if params[name, c["size"]] for d in c["deltas"]]
        slope, slope_ci = slope_fit(points)
        verdict_word = transfer_verdict([c["verdict"] for c in rows])
        out.append({"arm": name, "per_size": per_size, "slope": slope, "slope_ci95": slope_ci, "verdict": verdict_word})
    return out


def val_bytes_warnings(arms, seeds):
    """A warning per arm whose runs scored another number of val bytes than the baseline's (train.py's result field
    `val_bytes`, where present): their bits per byte are over other text."""
    warnings = []
    for arm in arms:
        base = next(a for a in arms if a.size == arm.size)
        mine, theirs = (
            {r["result"].get("val_bytes") for r in a.seed_runs(seeds) if r.get("result")} for a in (arm, base)
        )
        mine.discard(None), theirs.discard(None)
        if arm is not base and mine and theirs and mine != theirs:
            warnings.append(
                f"arm {arm.label} scored {', '.join(map(str, sorted(mine)))} val bytes, the baseline "
                f"{', '.join(map(str, sorted(theirs)))}: its val_bpb is over other text; give every arm "
                "--eval_steps=all to score the whole val split"
            )
    return warnings


def summarize(arms, metric, seeds, settings, repeat):
    """compare.json's content so far; statistics over `seeds`, the runs of other seeds kept in `runs`."""
    out_arms = []
    for arm in arms:
        v = [r["value"] for r in arm.seed_runs(seeds) if r["status"] == "ok" and r["value"] is not None]
        first = lambda k: next((r[k] for r in arm.runs.values() if r.get(k) is not None), None)  # noqa: E731
        entry = {"name": arm.name, **({"size": arm.size} if arm.size else {}), "args": arm_text(arm)}
        entry |= {"max_steps": arm.max_steps} if settings.get("equal_time") else {}
        entry["runs"] = [arm.runs[s] for s in sorted(arm.runs)]
        entry |= {"mean": statistics.fmean(v) if v else None, "std": statistics.stdev(v) if len(v) > 1 else None}
        out_arms.append(entry | {"params": first("params"), "params_lookup": first("params_lookup")})
    base = arms[0]
    bases = {arm.size: next(a for a in arms if a.size == arm.size) for arm in arms}
    confirm = bool(settings.get("confirm"))
    comparisons = [compare_arm(a, bases[a.size], metric, seeds, confirm) for a in arms if a is not bases[a.size]]
    repeat_identical, first_run = None, base.runs.get(seeds[0])
    if repeat is not None and first_run is not None:
        repeat_identical = repeat["status"] == "ok" and train_losses(repeat) == train_losses(first_run)
        repeat_identical = repeat_identical and repeat["value"] == first_run["value"]
    report = {"metric": metric, "seeds": seeds, **settings, "arms": out_arms, "comparisons": comparisons}
    if any(a.size for a in arms):
        report["transfer"] = transfer(arms, comparisons)
    report["warnings"] = val_bytes_warnings(arms, seeds)
    report["noise"] = {"baseline_std": out_arms[0]["std"], "repeat_identical": repeat_identical, "repeat": repeat}
    return report


def arm_text(arm):
    """An arm's arguments as compare.json records them."""
    return shlex.join(arm.args) + (f" --nproc_per_node {arm.nproc}" if arm.nproc else "")


def earlier_runs(out, arms, metric, settings):
    """{key: run} of the runs an earlier compare.py into `out` made (the calibration's and the repeat included), when
    it compared the same arms (names, sizes and arguments, in order) on the same metric with the same --equal_time,
    so a comparison that stopped or is given other seeds goes on; CompareError if `out` holds another comparison or
    a compare.json compare.py did not write."""
    path = out / "compare.json"
    if not path.exists():
        return {}
    try:
        earlier = json.loads(path.read_bytes())
        same = earlier["metric"] == metric and earlier.get("equal_time") == settings.get("equal_time")
        same = same and [(a["name"], a.get("size"), a["args"]) for a in earlier["arms"]] == [
            (arm.name, arm.size, arm_text(arm)) for arm in arms
        ]
        runs = {Arm(a["name"], [], size=a.get("size")).key(r["seed"]): r for a in earlier["arms"] for r in a["runs"]}
        repeat = earlier["noise"]["repeat"]
        if repeat is not None:
            runs[arms[0].key(repeat["seed"], "_repeat")] = repeat
        runs |= {r["key"]: r for r in earlier.get("calibration", {}).get("runs", [])}
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
        raise CompareError(f"{path} is not a comparison compare.py wrote ({first_line(e)}): move it away") from None
    if not same:
        raise CompareError(f"{out} holds a comparison of other arms or another metric: choose another --out_dir")
    return runs


def table(report):
    """The report as a Markdown table, an arm (at a size) a row; then the transfer verdicts and the warnings."""
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    rows = [
        f"| arm | params (lookup) | {report['metric']} mean ± std | delta [95% CI] | p | verdict | speed "
        "| first diff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    comparisons = {(c["arm"], c.get("size")): c for c in report["comparisons"]}
    for arm in report["arms"]:
        c = comparisons.get((arm["name"], arm.get("size")), {})
        ci = c.get("ci95")
        test = f" (test: {c['confirm']['verdict']})" if c.get("confirm") else ""
        rows.append(
            f"| {arm['name']}{'@' + arm['size'] if arm.get('size') else ''} | {fmt(arm['params'], ',')} "
            f"({fmt(arm['params_lookup'], ',')}) | {fmt(arm['mean'], '.4f')} ± {fmt(arm['std'], '.4f')} | "
            + (
                f"{fmt(c['delta'], '+.4f')} [{fmt(ci and ci[0], '+.4f')}, {fmt(ci and ci[1], '+.4f')}] | "
                f"{fmt(c['p_value'], '.3g')} | {c['verdict']}{test} | "
                f"{fmt(c['speed_ratio'], '.3f')}x | {fmt(c['first_differing_step'], 'd')} |"
                if c
                else "baseline | | | | |"
            )
        )
    for t in report.get("transfer", []):
        sizes = ", ".join(f"{s['size']} {s['verdict']}" for s in t["per_size"])
        ci = t["slope_ci95"]
        rows.append(
            f"\ntransfer: {t['arm']} {t['verdict']} ({sizes}; slope of the delta per log(params) "
            f"{fmt(t['slope'], '+.4f')} [{fmt(ci and ci[0], '+.4f')}, {fmt(ci and ci[1], '+.4f')}])"
        )
    noise = report["noise"]
    rows.append(
        f"\nnoise: the baseline's std over {len(report['seeds'])} seeds {fmt(noise['baseline_std'], '.4f')}; "
        + {None: "no repeat run (--repeat)", True: "a repeat run was bit-identical", False: "a repeat run DIFFERED"}[
            noise["repeat_identical"]
        ]
    )
    return "\n".join(rows)


def calibrate(arms, out, seconds, seed, jobs, done):
    """--equal_time: time every arm in CALIBRATION's interleaved short runs (no evaluation) and set each arm's
    max_steps to the steps its fastest timing run makes in `seconds`; the timing runs' records."""
    rounds, steps = CALIBRATION
    todo = [
        arm.job(seed, out / "calibrate", f"_round{r}", (f"--max_steps={steps}", "--eval_interval=0"))
        for r in range(rounds)
        for arm in arms
    ]
    for job in todo:
        job.key = f"calibrate/{job.key}"
    log(f"compare: timing each arm ({rounds} x {steps} steps) for --equal_time {seconds:g} s")
    records = runner.run_jobs(todo, out, jobs=jobs, done=done)
    for arm in arms:
        rates = [
            rec["result"]["steps"] / rec["result"]["train_s"]
            for key, rec in records.items()
            if key.startswith(f"calibrate/{arm.key(seed)}_round") and rec["status"] == "ok" and rec["result"]["train_s"]
        ]
        if not rates:
            raise CompareError(
                f"--equal_time: arm {arm.label}'s timing runs did not end ok (their logs: {out}/calibrate)"
            )
        arm.max_steps = max(1, round(seconds * max(rates)))
        log(f"compare: {arm.label}: {max(rates):.2f} steps/s, --max_steps={arm.max_steps}")
    return list(records.values())


def parse(argv):
    parser = argparse.ArgumentParser(
        description="Paired comparison of train.py runs over seeds.",
        epilog=__doc__.split("\n\n", 2)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("arms", nargs="+", metavar="ARM", help="quoted train.py arguments; the first is the baseline")
    parser.add_argument("--seeds", type=int, default=3, help=f"seeds 1337, 1338, ... (default 3, at most {MAX_SEEDS})")
    parser.add_argument("--out_dir", default="out/compare", help="runs, logs, ledger.jsonl and compare.json")
    parser.add_argument("--metric", default="val_loss", help="the result field compared (default val_loss)")
    parser.add_argument("--repeat", action="store_true", help="run the baseline's first seed twice: bit-identical?")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (one GPU each; a CPU's threads split)")
    parser.add_argument("--sizes", help="n_layer x n_embd sizes (e.g. 2x64,3x128): every arm at each; `transfer`")
    parser.add_argument("--equal_time", type=float, metavar="S", help="time the arms, then give each S seconds' steps")
    parser.add_argument("--confirm", action="store_true", help="score each run's checkpoint on the test split too")
    return parser.parse_args(argv)


def arms_of(args):
    """The Arms to run (one per arm and size, sizes in order) from the command line; CompareError on bad input."""
    if not 1 <= args.seeds <= MAX_SEEDS:
        raise CompareError(f"--seeds must be >= 1 and <= {MAX_SEEDS}, got {args.seeds}")
    if args.jobs < 1:
        raise CompareError(f"--jobs must be >= 1, got {args.jobs}")
    arms = [parse_arm(text, i) for i, text in enumerate(args.arms)]
    names = [arm.name for arm in arms]
    if len(set(names)) < len(names):
        raise CompareError(f"two arms are named alike ({', '.join(names)}): give each its own name=...")
    if args.equal_time is not None:
        if not args.equal_time > 0:
            raise CompareError(f"--equal_time must be > 0 seconds, got {args.equal_time:g}")
        for arm in arms:
            fixed = [w for w in arm.args if w.startswith("--") and w[2:].split("=")[0] in HORIZON_KEYS]
            if fixed:
                raise CompareError(f"arm {arm.name} sets {fixed[0]}: --equal_time sets every arm's max_steps")
    if not args.sizes:
        return arms
    sizes = [s.strip() for s in args.sizes.split(",")]
    for size in sizes:
        runner.parse_size(size)
    if len(set(sizes)) < len(sizes):
        raise CompareError(f"--sizes names a size twice: {args.sizes}")
    return [replace(arm, size=size, runs={}) for size in sizes for arm in arms]


def main(argv=None):
    args = parse(argv)
    try:
        arms = arms_of(args)
        settings = {"sizes": args.sizes and [a.size for a in arms if a.name == arms[0].name]}
        settings |= {"equal_time": args.equal_time, "confirm": args.confirm, "repeat": args.repeat}
        seeds = [1337 + i for i in range(args.seeds)]
        report = compare(arms, Path(args.out_dir).absolute(), args.metric, seeds, settings, args.jobs)
    except (RunnerError, LockError, OSError) as e:
        report_error("compare.py", e)
        return 2
    except Interrupted as e:
        report_error("compare.py", e)
        return e.exit_code
    except KeyboardInterrupt:
        report_error("compare.py", KeyboardInterrupt("interrupted; run the same command again to go on"))
        return 130
    print(table(report))
    for warning in report["warnings"]:
        log(warning, note=True)
    brief = {
        k: report[k] for k in ("metric", "seeds", "comparisons", "warnings") + ("transfer",) * ("transfer" in report)
    }
    brief["noise"] = {k: v for k, v in report["noise"].items() if k != "repeat"}
    print(f"compare: {json.dumps(brief)}")  # the last line, as train.py's result
    return 0


def compare(arms, out, metric, seeds, settings, jobs=1):
    """Make every run (the calibration first, with --equal_time), seed by seed, arm by arm, rewriting compare.json
    after each, holding `out`; returns compare.json's final content."""
    with runner.lock(out, "compare.py"):
        done = earlier_runs(out, arms, metric, settings)
        if settings.get("confirm"):
            for arm in arms:
                runner.check_test_shards(f"arm {arm.name}", arm.args)
        state = {"repeat": None, "calibration": [], "made": 0}

        def report():
            calibration = {"calibration": {"runs": state["calibration"]}} if settings.get("equal_time") else {}
            return summarize(arms, metric, seeds, settings, state["repeat"]) | calibration

        write = lambda: atomic_write(out / "compare.json", json.dumps(report(), indent=2) + "\n")  # noqa: E731
        if settings.get("equal_time"):
            state["calibration"] = calibrate(arms, out, settings["equal_time"], seeds[0], jobs, done)
        todo, owner = [], {}
        for seed in seeds:
            for arm in arms:
                todo.append(arm.job(seed, out))
                owner[todo[-1].key] = arm
                if settings["repeat"] and arm is arms[0] and seed == seeds[0]:
                    todo.append(arm.job(seed, out, "_repeat"))
        for key, run in done.items():  # seeds beyond --seeds: kept in compare.json
            arm = next((a for a in arms if key == a.key(run.get("seed"))), None)
            if arm is not None and run["seed"] not in seeds:
                arm.runs[run["seed"]] = run | {"out_dir": str(out / key)}
        direction = "higher" if HIGHER_IS_BETTER.search(metric) else "lower"
        log(f"compare: {len(arms)} arms x {len(seeds)} seeds, {metric} ({direction} is better) -> {out}")

        def on_run(key, run, made):
            arm = owner.get(key, arms[0])
            if key in owner:
                arm.runs[run["seed"]] = run
            else:
                state["repeat"] = run
            state["made"] += 1
            took = f"{run['seconds']:.0f} s" if made else "made before"
            log(
                f"[{state['made']}/{len(todo)}] {key.replace('/seed', ' seed ')}: {run['status']}, {metric} "
                f"{run['value']} ({took})"
            )
            write()

        try:
            runner.run_jobs(todo, out, jobs=jobs, metric=metric, done=done, on_run=on_run)
        finally:
            write()
        if settings.get("confirm"):
            for arm in arms:
                for run in arm.seed_runs(seeds):
                    if run["status"] == "ok" and "confirm" not in run:
                        run["confirm"] = runner.evaluate_test(run)
                        write()
        return report()


if __name__ == "__main__":
    sys.exit(main())
