"""Did a change help? Train each arm (a string of train.py arguments) with the same seeds, one seed at a time, and
test each arm against the first (the baseline) with a paired t-test over the seeds.

    M="--data_dir=data/shakespeare --n_layer=4 --n_embd=256 --batch_size=16 --max_steps=45"
    python compare.py "configs/modern.py $M" "name=no_bigram configs/modern.py $M --bigram_embeds=0" --out_dir out/cmp
    python compare.py "configs/shakespeare_cpu.py" "configs/shakespeare_cpu.py" --repeat   # change nothing: identical?
    python compare.py "--nproc_per_node 8 configs/gpt2_124m.py --max_seconds=600" "..."     # each run under torchrun

An arm is one quoted string: train.py's arguments (config files, --key=value), optionally `name=NAME` (default:
baseline, arm1, arm2, ...) and `--nproc_per_node N` (the run goes through torchrun). Each run gets --seed=S,
--out_dir=DIR/NAME/seedS and --ledger=DIR/ledger.jsonl; its console output goes to DIR/NAME/seedS.log. For every
seed (1337, 1338, ...) the arms run in turn, A B C then A B C, so a machine that drifts slows every arm alike.
Runs with the same seed start from the same weights and read the same batches (train.py is deterministic), so
the per-seed difference of two arms holds little noise beyond the change itself: that is what the test uses.

Per arm against the baseline (DIR/compare.json, the table, and the last line `compare: {...}`): the per-seed
differences of --metric (any field of train.py's result; lower is better unless it is an accuracy, mfu or
tokens/s), their mean, its 95% t-interval, the two-sided paired t-test's p-value and a verdict: identical (every
difference exactly 0), better or worse (p < 0.05), no detectable difference, or failed (a run did not end with
status ok); the speed ratio (geometric mean of the per-seed tokens/s ratios) and the first step whose train loss
differs from the baseline's (None: none did, the arm trains exactly as the baseline). --repeat runs the baseline's
first seed twice: whether the machine repeats a run bit for bit. Exit 0 when every run was made (whatever their
status), 2 on bad arguments (one line). Run again into the same --out_dir with the same arms, compare.py goes on
from where it stopped (a crash, Ctrl-C), or adds seeds (--seeds 5 after 3). AGENTS.md describes the loop;
docs/experiments.md has measured examples.
"""

import argparse
import datetime
import json
import math
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from gpt2train.console import log
from gpt2train.files import atomic_write, report_error
from gpt2train.tracking import EXIT_CODES

ROOT = Path(__file__).resolve().parent
SET_BY_COMPARE = ("seed", "out_dir", "ledger")
HIGHER_IS_BETTER = re.compile(r"acc|mc_|mfu|tokens_per_s")  # the rest (losses, bpb, seconds, memory): lower


class CompareError(ValueError):
    """Bad arguments: one line."""


@dataclass
class Arm:
    name: str
    args: list  # train.py's
    nproc: int | None = None  # torchrun --nproc_per_node
    runs: list = field(default_factory=list)


def parse_arm(text, index):
    """An Arm from one quoted argument string; `index` names the default (baseline, arm1, ...)."""
    words, name, nproc, args = shlex.split(text), None, None, []
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
            if key in SET_BY_COMPARE:
                raise CompareError(f"arm {text!r}: compare.py sets --{key} for every run; leave it out")
            args.append(word)
    name = name or ("baseline" if index == 0 else f"arm{index}")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or name.startswith("."):
        raise CompareError(f"arm {text!r}: name={name!r} must be letters, digits, '_', '-' or '.' (a directory name)")
    return Arm(name, args, nproc)


def train_command(arm):
    """The command line of one of the arm's runs, without compare's own keys."""
    if arm.nproc is None:
        return [sys.executable, str(ROOT / "train.py"), *arm.args]
    return ["torchrun", "--standalone", f"--nproc_per_node={arm.nproc}", str(ROOT / "train.py"), *arm.args]


def run_once(arm, seed, out_dir, ledger, metric):
    """Train one run to its end; its record for compare.json (status, the metric's value, tokens/s, ...)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    command = [*train_command(arm), f"--seed={seed}", f"--out_dir={out_dir}", f"--ledger={ledger}"]
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    t0 = time.perf_counter()
    log_path = out_dir.with_name(out_dir.name + ".log")
    with open(log_path, "w") as log:
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.startswith("result: ")]
    result = json.loads(lines[-1][len("result: ") :]) if lines else {}
    codes = {c: s for s, c in EXIT_CODES.items()}
    status = result.get("status") or codes.get(code, "error")
    if status == "ok" and metric not in result:
        fields = ", ".join(k for k in result if not k.startswith("mc/"))
        raise CompareError(f"--metric {metric!r} is not in the result of {log_path}; its fields: {fields}")
    return {
        "seed": seed,
        "status": status,
        "value": result.get(metric),
        "tokens_per_s": result.get("tokens_per_s"),
        "params": result.get("params"),
        "params_lookup": result.get("params_lookup"),
        "started_at": started,
        "seconds": time.perf_counter() - t0,
        "exit_code": code,
        "out_dir": str(out_dir),
    }


def train_losses(run):
    """{step: train loss} of a run's metrics.jsonl ({} without one; a non-finite loss is None)."""
    path = Path(run["out_dir"]) / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    return {r["step"]: r["train_loss"] for r in records if "train_loss" in r}


def first_differing_step(run, base):
    """The first step whose train loss differs between two runs (a step only one of them has differs); None."""
    a, b = train_losses(run), train_losses(base)
    return next((s for s in sorted(set(a) | set(b)) if s not in a or s not in b or a[s] != b[s]), None)


def t_two_sided_p(t, df):
    """P(|T| >= |t|) for Student's t with df degrees of freedom: the regularized incomplete beta I_x(df/2, 1/2) at
    x = df / (df + t^2)."""
    x = df / (df + t * t)
    a, b = df / 2, 0.5
    if x < (a + 1) / (a + b + 2):
        return incomplete_beta(a, b, x)
    return 1 - incomplete_beta(b, a, 1 - x)  # where the continued fraction converges slowly: the symmetry


def incomplete_beta(a, b, x):
    """The regularized incomplete beta function I_x(a, b), by its continued fraction (modified Lentz); converges
    fast for x < (a + 1) / (a + b + 2)."""
    if x <= 0:
        return 0.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    tiny = 1e-300
    floor = lambda v: v if abs(v) > tiny else tiny  # noqa: E731
    c, d = 1.0, 1 / floor(1 - (a + b) * x / (a + 1))
    h = d
    for m in range(1, 500):
        even = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        odd = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        for term in (even, odd):
            d, c = 1 / floor(1 + term * d), floor(1 + term / c)
            h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return front * h / a


def t_quantile(q, df):
    """The t with P(T <= t) = q (q > 0.5), by bisection of t_two_sided_p."""
    lo, hi = 0.0, 1e7
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if 1 - t_two_sided_p(mid, df) / 2 < q else (lo, mid)
    return (lo + hi) / 2


def paired_test(deltas):
    """(mean, 95% t-interval, two-sided p) of per-seed differences, as scipy.stats.ttest_rel computes them; all exactly
    0: (0, [0, 0], 1); one seed: no interval or p (None)."""
    n, mean = len(deltas), statistics.fmean(deltas)
    if all(d == 0 for d in deltas):
        return 0.0, [0.0, 0.0], 1.0
    if n < 2:
        return mean, None, None
    sem = statistics.stdev(deltas) / math.sqrt(n)
    if sem == 0:  # every seed moved by exactly the same amount
        return mean, [mean, mean], 0.0
    half = t_quantile(0.975, n - 1) * sem
    return mean, [mean - half, mean + half], t_two_sided_p(mean / sem, n - 1)


def compare_arm(arm, base, metric):
    """The arm against the baseline: compare.json's `comparisons` entry."""
    pairs = [(r, b) for r, b in zip(arm.runs, base.runs) if r["status"] == b["status"] == "ok"]
    failed = len(pairs) < len(arm.runs) or len(arm.runs) < len(base.runs)
    deltas = [r["value"] - b["value"] for r, b in pairs if r["value"] is not None and b["value"] is not None]
    delta, ci95, p = paired_test(deltas) if deltas else (None, None, None)
    lower_is_better = not HIGHER_IS_BETTER.search(metric)
    if failed or not deltas:
        verdict = "failed"
    elif p == 1.0 and delta == 0:
        verdict = "identical"
    elif p is not None and p < 0.05:
        verdict = "better" if (delta < 0) == lower_is_better else "worse"
    else:
        verdict = "no detectable difference"
    speeds = [r["tokens_per_s"] / b["tokens_per_s"] for r, b in pairs if r["tokens_per_s"] and b["tokens_per_s"]]
    differs = [s for s in (first_differing_step(r, b) for r, b in zip(arm.runs, base.runs)) if s is not None]
    return {
        "arm": arm.name,
        "baseline": base.name,
        "deltas": deltas,
        "delta": delta,
        "ci95": ci95,
        "p_value": p,
        "verdict": verdict,
        "speed_ratio": math.exp(statistics.fmean(map(math.log, speeds))) if speeds else None,
        "first_differing_step": min(differs) if differs else None,
    }


def arm_text(arm):
    """An arm's arguments as compare.json records them."""
    return shlex.join(arm.args) + (f" --nproc_per_node {arm.nproc}" if arm.nproc else "")


def earlier_runs(out, arms, metric):
    """{out_dir: run} of the runs an earlier compare.py into `out` made, when it compared the same arms (names and
    arguments, in order) on the same metric, so a comparison that stopped (a crash, Ctrl-C) or is given more seeds
    goes on from where it was; CompareError if `out` holds another comparison."""
    path = out / "compare.json"
    if not path.exists():
        return {}
    earlier = json.loads(path.read_text())
    if earlier["metric"] != metric or [(a["name"], a["args"]) for a in earlier["arms"]] != [
        (arm.name, arm_text(arm)) for arm in arms
    ]:
        raise CompareError(f"{out} holds a comparison of other arms or another metric: choose another --out_dir")
    runs = [run for arm in earlier["arms"] for run in arm["runs"]] + [earlier["noise"]["repeat"]]
    return {run["out_dir"]: run for run in runs if run is not None}


def summarize(arms, metric, seeds, repeat):
    """compare.json's content so far."""
    values = lambda arm: [r["value"] for r in arm.runs if r["status"] == "ok" and r["value"] is not None]  # noqa: E731
    out_arms = []
    for arm in arms:
        v = values(arm)
        out_arms.append(
            {
                "name": arm.name,
                "args": arm_text(arm),
                "runs": arm.runs,
                "mean": statistics.fmean(v) if v else None,
                "std": statistics.stdev(v) if len(v) > 1 else None,
                "params": next((r["params"] for r in arm.runs if r["params"] is not None), None),
                "params_lookup": next((r["params_lookup"] for r in arm.runs if r["params_lookup"] is not None), None),
            }
        )
    base = arms[0]
    repeat_identical = None
    if repeat is not None and base.runs:
        repeat_identical = repeat["status"] == "ok" and train_losses(repeat) == train_losses(base.runs[0])
        repeat_identical = repeat_identical and repeat["value"] == base.runs[0]["value"]
    return {
        "metric": metric,
        "seeds": seeds,
        "arms": out_arms,
        "comparisons": [compare_arm(arm, base, metric) for arm in arms[1:]],
        "noise": {"baseline_std": out_arms[0]["std"], "repeat_identical": repeat_identical, "repeat": repeat},
    }


def table(report):
    """The report as a Markdown table, an arm a row."""
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    rows = [
        f"| arm | params (lookup) | {report['metric']} mean ± std | delta [95% CI] | p | verdict | speed "
        "| first diff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    comparisons = {c["arm"]: c for c in report["comparisons"]}
    for arm in report["arms"]:
        c = comparisons.get(arm["name"], {})
        ci = c.get("ci95")
        rows.append(
            f"| {arm['name']} | {fmt(arm['params'], ',')} ({fmt(arm['params_lookup'], ',')}) | "
            f"{fmt(arm['mean'], '.4f')} ± {fmt(arm['std'], '.4f')} | "
            + (
                f"{fmt(c['delta'], '+.4f')} [{fmt(ci and ci[0], '+.4f')}, {fmt(ci and ci[1], '+.4f')}] | "
                f"{fmt(c['p_value'], '.3g')} | {c['verdict']} | {fmt(c['speed_ratio'], '.3f')}x | "
                f"{fmt(c['first_differing_step'], 'd')} |"
                if c
                else "baseline | | | | |"
            )
        )
    noise = report["noise"]
    rows.append(
        f"\nnoise: the baseline's std over {len(report['seeds'])} seeds {fmt(noise['baseline_std'], '.4f')}; "
        + {None: "no repeat run (--repeat)", True: "a repeat run was bit-identical", False: "a repeat run DIFFERED"}[
            noise["repeat_identical"]
        ]
    )
    return "\n".join(rows)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Paired comparison of train.py runs over seeds.",
        epilog=__doc__.split("\n\n", 2)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("arms", nargs="+", metavar="ARM", help="quoted train.py arguments; the first is the baseline")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 1337, 1338, ... (default 3)")
    parser.add_argument("--out_dir", default="out/compare", help="runs, logs, ledger.jsonl and compare.json")
    parser.add_argument("--metric", default="val_loss", help="the result field compared (default val_loss)")
    parser.add_argument("--repeat", action="store_true", help="run the baseline's first seed twice: bit-identical?")
    args = parser.parse_args(argv)
    try:
        if args.seeds < 1:
            raise CompareError(f"--seeds must be >= 1, got {args.seeds}")
        arms = [parse_arm(text, i) for i, text in enumerate(args.arms)]
        names = [arm.name for arm in arms]
        if len(set(names)) < len(names):
            raise CompareError(f"two arms are named alike ({', '.join(names)}): give each its own name=...")
        report = compare(arms, Path(args.out_dir), args.metric, [1337 + i for i in range(args.seeds)], args.repeat)
    except (CompareError, OSError) as e:
        report_error("compare.py", e)
        return 2
    print(table(report))
    brief = {k: report[k] for k in ("metric", "seeds", "comparisons")}
    brief["noise"] = {k: v for k, v in report["noise"].items() if k != "repeat"}
    print(f"compare: {json.dumps(brief)}")  # the last line, as train.py's result
    return 0


def compare(arms, out, metric, seeds, repeat):
    """Make every run, seed by seed, arm by arm, rewriting compare.json after each; returns its final content."""
    total, made, repeat_run = len(seeds) * len(arms) + repeat, [], None
    done = earlier_runs(out, arms, metric)
    direction = "higher" if HIGHER_IS_BETTER.search(metric) else "lower"
    log(f"compare: {len(arms)} arms x {len(seeds)} seeds, {metric} ({direction} is better) -> {out}")

    def make(arm, seed, suffix=""):
        out_dir = out / arm.name / f"seed{seed}{suffix}"
        if str(out_dir) in done:
            run, took = done[str(out_dir)], "made before"
        else:
            if out_dir.exists():  # started by an earlier compare.py that stopped before it ended: made again
                unfinished = out_dir.with_name(out_dir.name + ".unfinished")
                shutil.rmtree(unfinished, ignore_errors=True)
                out_dir.rename(unfinished)
            run = run_once(arm, seed, out_dir, out / "ledger.jsonl", metric)
            took = f"{run['seconds']:.0f} s"
        made.append(run)
        log(f"[{len(made)}/{total}] {arm.name} seed {seed}{suffix}: {run['status']}, {metric} {run['value']} ({took})")
        return run

    for seed in seeds:
        for arm in arms:
            arm.runs.append(make(arm, seed))
            if repeat and arm is arms[0] and seed == seeds[0]:
                repeat_run = make(arm, seed, "_repeat")
            atomic_write(out / "compare.json", json.dumps(summarize(arms, metric, seeds, repeat_run), indent=2) + "\n")
    return summarize(arms, metric, seeds, repeat_run)


if __name__ == "__main__":
    sys.exit(main())
