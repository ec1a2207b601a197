"""Learning speed: the GPT-2 recipe (TrainConfig's defaults) against configs/modern.py, on the same data, model
size and token budget. Not a test: a measurement, printed as Markdown and written as JSON.

    python -m bench.recipes                     # the issue's measurement: sweep on Tiny Shakespeare, then stdlib
    python -m bench.recipes --corpora shakespeare --steps 60 --gpt2_sweep 1e-3 --modern_sweep 1   # a quick look

Every run is `python train.py [configs/modern.py] --key=value ...` in a subprocess (train.py is a script, not
an API), evaluated every --eval_interval steps (the modern recipe: every --modern_eval_interval) on the same
val batches. Per corpus:
  1. a learning-rate sweep on the first of --seeds: learning_rate in --gpt2_sweep for the GPT-2 recipe (cosine
     to lr/10 after --gpt2_warmup steps); for the modern recipe all of its rates (muon_lr, learning_rate,
     embedding_lr, head_lr, as configs/modern.py sets them) times each of --modern_sweep. Each recipe keeps the
     rate with the lowest final val loss and runs it again with the other seeds (weights and data order);
     corpora after the first reuse the first corpus's winners (a check the recipe was not tuned to one
     dataset) unless --sweep_every_corpus.
  2. the target: the GPT-2 winner's final val loss, the mean over the seeds (its steps to target: --steps, by
     definition). The modern recipe's steps to target: in each run, the first evaluation at or below it (so to
     within --modern_eval_interval); the mean over the seeds and their spread (min-max). Time to target: the
     summed step_ms (forward, backward, optimizer; no evaluation, no compile trial) of the steps up to it.
  3. ablations (first corpus only): the modern recipe without each of its ABLATIONS, every seed, the first
     --ablation_steps steps of the same --steps-step schedule (lr_decay_steps=--steps, so each run follows
     the full recipe's schedule and the full runs' first steps are its reference): steps to target and val
     loss at step --ablation_steps, at equal tokens.
  4. per-step cost (first corpus only): --knob_steps steps each, median step_ms after the first 5, of the
     GPT-2 recipe, it with each of the modern recipe's knobs alone, the modern recipe, the GPT-2 recipe again,
     back to back, --knob_rounds times (the lowest median of each counts). On a shared machine the sweep's
     runs see different loads, so the time ratio is also given at these back-to-back costs:
     (modern steps x modern ms/step) / (GPT-2 steps x GPT-2 ms/step).
--jobs N runs the independent runs of each stage (the sweeps, the other seeds, the ablations) N at a time, for
a machine with the cores or the GPU to spare (then set --threads to cores/N, and the in-run ms/step of those
runs share the machine: only the per-step cost runs, always one at a time, time the recipes fairly).
Corpora: 'shakespeare' (prepare_data.py's preset) and 'stdlib' (this Python's standard library: the .py files
of its top directory, each top-level function/class/block a document, in a seeded random order so validation
is a random sample of them).
"""

import argparse
import glob
import json
import os
import random
import statistics
import subprocess
import sys
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import prepare_data
from bench import machine_line
from gpt2train.config import read_config_file

ROOT = Path(__file__).resolve().parent.parent
MODERN = ROOT / "configs" / "modern.py"
MODERN_RATES = ("learning_rate", "muon_lr", "embedding_lr", "head_lr")  # --modern_sweep scales them together
BIGRAM_ROWS = 100_000  # the bigram table measured with the recipe (configs/modern.py leaves it off)
# the modern recipe's knobs, each added alone to the GPT-2 recipe for its per-step cost
KNOBS = {
    "muon": ["--optimizer=muon"],
    "qk_norm": ["--qk_norm=True"],
    "relu2": ["--activation=relu2"],
    "rotary": ["--rotary_pct=1.0"],
    "untied head": ["--tie_embeddings=False"],
    "no biases": ["--bias=False"],
    "value embeddings": ["--value_embeds=True"],
    "smear": ["--smear=True"],
    "bigram table": [f"--bigram_embeds={BIGRAM_ROWS}"],
}
# the ingredients this recipe was built from, each ablated: configs/modern.py's keys that turn it off ('-'), or
# on ('+' for one measured and left off); rates are scaled by the sweep's factor like the recipe's own
ABLATIONS = {
    "- value embeddings": {"value_embeds": False},
    "- smear": {"smear": False},
    f"+ bigram table ({BIGRAM_ROWS:,} rows)": {"bigram_embeds": BIGRAM_ROWS},
    "- embedding_lr, head_lr (both at learning_rate)": {"embedding_lr": None, "head_lr": None},
    "- muon_lr 0.01 (0.02, as before)": {"muon_lr": 0.02},
    "- betas (0.7, 0.99), Muon momentum 0.9, embedding_lr 0.05 (0.8, 0.95; 0.95; 0.03)": {
        "beta1": 0.8,
        "beta2": 0.95,
        "muon_momentum": 0.95,
        "embedding_lr": 0.03,
    },
}


def prepare_corpus(name, data_root):
    """Token shards of a corpus under data_root/name (prepared once; prepare_data.py verifies and skips)."""
    out = Path(data_root) / name
    if name == "shakespeare":
        flags = ["--dataset", "shakespeare"]
    elif name == "stdlib":
        files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
        # documents: the top-level units of each module (PEP 8 puts two blank lines between them), shuffled
        units = [u for f in files for u in Path(f).read_text(encoding="utf-8", errors="replace").split("\n\n\n")]
        random.Random(0).shuffle(units)
        src = Path(data_root) / "stdlib_src" / "stdlib.jsonl"
        src.parent.mkdir(parents=True, exist_ok=True)
        text = "".join(json.dumps({"text": u}) + "\n" for u in units if u.strip())
        if not src.exists() or src.read_text() != text:
            src.write_text(text)
        flags = ["--input", str(src), "--val_tokens", "32768"]
    else:
        raise SystemExit(f"bench.recipes: unknown corpus {name!r}; expected 'shakespeare' or 'stdlib'")
    prepare_data.prepare(
        prepare_data.arg_parser().parse_args([*flags, "--out_dir", str(out), "--num_proc", "1", "--no_progress"])
    )
    return out


def train_runs(runs, threads, jobs=1):
    """Run train.py once per (out_dir, args), `jobs` at a time (each a subprocess: threads suffice to wait on
    them); returns their metrics lines in the order given. The commands are printed in that order before any
    starts, so the output does not depend on which finishes first. A finished run in out_dir with the same
    arguments and config file values is reused (so an interrupted bench continues where it stopped)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    todo = []
    for out_dir, args in runs:
        done = Path(out_dir) / "bench_args.json"
        key = {"args": args, "configs": {a: read_config_file(a) for a in args if not a.startswith("--")}}
        if done.exists() and json.loads(done.read_text()) == key:
            continue
        if done.parent.exists():
            for f in done.parent.iterdir():
                f.unlink()
        cmd = [sys.executable, str(ROOT / "train.py"), *args, f"--out_dir={out_dir}"]
        print("  $ " + " ".join(cmd[1:]), flush=True)
        todo.append((cmd, done, key))

    def run(cmd, done, key):
        result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        for f in done.parent.glob("ckpt_*"):  # the final checkpoint (~0.5 GB at the default size): unused here
            f.unlink()
        return result

    with ThreadPoolExecutor(jobs) as pool:
        results = list(pool.map(lambda t: run(*t), todo))
    for (cmd, done, key), result in zip(todo, results):
        if result.returncode:
            raise SystemExit(f"bench.recipes: {' '.join(cmd[1:])} failed:\n{result.stderr[-3000:]}")
        done.write_text(json.dumps(key))
    return [read_metrics(out_dir) for out_dir, _ in runs]


def read_metrics(out_dir):
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


def summarize(metrics):
    """{val: {step: loss}, step_ms: {step: ms}} of one run."""
    return {
        "val": {m["step"]: m["val_loss"] for m in metrics if "val_loss" in m},
        "step_ms": {m["step"]: m["step_ms"] for m in metrics if "step_ms" in m},
    }


def to_target(run, target):
    """(steps, seconds of training compute) to the first evaluation at or below target; (None, None) if never."""
    step = next((s for s, v in sorted(run["val"].items()) if v <= target), None)
    if step is None:
        return None, None
    return step, sum(ms for s, ms in run["step_ms"].items() if s <= step) / 1000


def median_ms(run, skip=5):
    """Median step time after the first `skip` steps (compile warm-up), or of all steps in a shorter run."""
    return statistics.median([ms for s, ms in run["step_ms"].items() if s > skip] or run["step_ms"].values())


def spread(xs):
    """{mean, min, max} of the seeds' values; None where a run never got there (then no mean)."""
    done = [x for x in xs if x is not None]
    return {
        "values": xs,
        "mean": statistics.mean(xs) if xs and len(done) == len(xs) else None,
        "min": min(done, default=None),
        "max": max(done, default=None),
    }


def recipe_args(recipe, lr, common, steps, seed, changes=None):
    """train.py arguments of one recipe at one learning rate (GPT-2: its rate; modern: a scale of all its rates)
    and seed; `changes` replace configs/modern.py's keys (an ablation), before the scaling."""
    if recipe == "gpt2":
        return [*common, f"--learning_rate={lr}", f"--min_lr={lr / 10}", f"--max_steps={steps}", f"--seed={seed}"]
    keys = {**read_config_file(MODERN), **(changes or {})}
    scaled = {k: keys[k] * lr for k in MODERN_RATES if keys.get(k) is not None}
    flags = [f"--{k}={v}" for k, v in {**(changes or {}), **scaled}.items()]
    return [str(MODERN), *common, *flags, f"--max_steps={steps}", f"--seed={seed}"]


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--corpora", default="shakespeare,stdlib", help="comma-separated: shakespeare, stdlib")
    p.add_argument("--data_root", default="data", help="corpora are prepared under DATA_ROOT/<corpus>")
    p.add_argument("--out_dir", default="out/bench_recipes", help="runs (reused when re-run) and recipes.json")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per run (the token budget)")
    p.add_argument("--seeds", default="1337,1338,1339", help="seeds of every comparison; the sweep uses the first")
    p.add_argument("--check_seeds", type=int, default=None, help="corpora after the first: the first N seeds only")
    p.add_argument("--gpt2_sweep", default="1e-3,2e-3,4e-3", help="GPT-2 recipe: learning rates swept")
    p.add_argument("--gpt2_warmup", type=int, default=20, help="GPT-2 recipe: warmup steps")
    p.add_argument("--modern_sweep", default="0.5,1,2", help="modern recipe: factors on all of its rates")
    p.add_argument("--sweep_every_corpus", action="store_true", help="sweep on every corpus, not the first only")
    p.add_argument(
        "--model",
        default="--n_layer=4 --n_head=4 --n_embd=256 --block_size=128 --batch_size=16",
        help="model size and batch, as train.py flags",
    )
    p.add_argument("--eval_interval", type=int, default=20, help="GPT-2 recipe: steps between evaluations")
    p.add_argument("--modern_eval_interval", type=int, default=5, help="modern recipe: steps between evaluations")
    p.add_argument("--eval_steps", type=int, default=8, help="val micro-batches per evaluation")
    p.add_argument("--ablation_steps", type=int, default=60, help="steps per ablation run (0: skip them)")
    p.add_argument("--knob_steps", type=int, default=30, help="steps per knob-cost run (0: skip them)")
    p.add_argument("--knob_rounds", type=int, default=2, help="rounds of the back-to-back per-step cost runs")
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of the runs (default: torch's)")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time within a stage (the per-step costs: 1)")
    return p.parse_args(argv)


def common_args(data, a):
    """train.py flags every run of a corpus shares: data, model, evaluation; nothing printed or sampled."""
    return [
        f"--data_dir={data}",
        *a.model.split(),
        f"--eval_interval={a.eval_interval}",
        f"--eval_steps={a.eval_steps}",
        "--log_interval=0",
        "--save_interval=0",
        "--keep_last=1",
        "--hellaswag_interval=0",
        "--sample_interval=0",
    ]


def seed_runs(corpus, a, out_root, commons, best, seeds):
    """{(recipe, lr, seed): run} of the recipes in `commons` (their shared args): the sweeps on seeds[0] (or
    `best`'s rates), then each winner on the other seeds; fills best."""
    lrs = {r: [best[r]] if r in best else [float(x) for x in getattr(a, f"{r}_sweep").split(",")] for r in commons}
    runs = recipe_runs([(r, lr, seeds[0]) for r in commons for lr in lrs[r]], corpus, a, out_root, commons)
    for r in commons:
        best[r] = min(lrs[r], key=lambda lr: runs[(r, lr, seeds[0])]["val"][a.steps])
    runs.update(recipe_runs([(r, best[r], s) for r in commons for s in seeds[1:]], corpus, a, out_root, commons))
    return runs


def recipe_runs(specs, corpus, a, out_root, commons):
    """{(recipe, lr, seed): run} of each spec, --jobs at a time."""
    t0 = time.time()
    runs = train_runs(
        [
            (out_root / corpus / f"{r}_{lr:g}_seed{seed}", recipe_args(r, lr, commons[r], a.steps, seed))
            for r, lr, seed in specs
        ],
        a.threads,
        a.jobs,
    )
    runs = [summarize(m) for m in runs]
    for (r, lr, seed), run in zip(specs, runs):
        print(
            f"{corpus} {r} {'lr' if r == 'gpt2' else 'scale'} {lr:g} seed {seed}: final val "
            f"{run['val'][a.steps]:.4f}, {median_ms(run):.0f} ms/step",
            flush=True,
        )
    if specs:
        print(f"({len(specs)} runs, {time.time() - t0:.0f} s)", flush=True)
    return dict(zip(specs, runs))


def compare(corpus, a, out_root, best, seeds):
    """Sweep (or reuse `best`), the winners on every seed, then the comparison at the GPT-2 winner's final val
    loss (mean over the seeds); fills `best`. Returns (result, the modern winner's runs, the target, the args
    each recipe's runs share)."""
    data = prepare_corpus(corpus, a.data_root)
    common = common_args(data, a)
    gpt2_common = [*common, f"--warmup_steps={a.gpt2_warmup}"]
    modern_common = [*common, f"--eval_interval={a.modern_eval_interval}"]
    runs = seed_runs(corpus, a, out_root, {"gpt2": gpt2_common, "modern": modern_common}, best, seeds)
    g = [runs[("gpt2", best["gpt2"], s)] for s in seeds]
    m = [runs[("modern", best["modern"], s)] for s in seeds]
    target = statistics.mean(r["val"][a.steps] for r in g)
    steps = {  # the GPT-2 recipe's: its whole runs, which define the target
        "gpt2": [(a.steps, sum(r["step_ms"].values()) / 1000) for r in g],
        "modern": [to_target(r, target) for r in m],
    }
    result = {
        "seeds": seeds,
        "sweep": {f"{r} {lr:g}": run["val"][a.steps] for (r, lr, seed), run in runs.items() if seed == seeds[0]},
        "best": dict(best),
        "target": target,
        "val_at_equal_steps": {
            s: {"gpt2": statistics.mean(r["val"][s] for r in g), "modern": mean_at(m, s)} for s in sorted(g[0]["val"])
        },
    }
    for name, runs in (("gpt2", g), ("modern", m)):
        result[name] = {
            "final_val": spread([r["val"][a.steps] for r in runs]),
            "steps_to_target": spread([st for st, _ in steps[name]]),
            "seconds_to_target": spread([sec for _, sec in steps[name]]),
            "ms_per_step": statistics.mean(median_ms(r) for r in runs),
        }
    gs, ms = result["gpt2"]["steps_to_target"]["mean"], result["modern"]["steps_to_target"]["mean"]
    gt, mt = result["gpt2"]["seconds_to_target"]["mean"], result["modern"]["seconds_to_target"]["mean"]
    result["step_ratio"] = ms / gs if ms and gs else None
    result["time_ratio"] = mt / gt if mt and gt else None
    return result, m, target, gpt2_common, modern_common


def mean_at(runs, step):
    """Mean val loss of runs at an evaluation step, or None where a run did not evaluate there."""
    vals = [r["val"].get(step) for r in runs]
    return None if None in vals else statistics.mean(vals)


def ablations(corpus, a, out_root, best, seeds, modern_runs, target, common):
    """{name: {steps_to_target, val}}: the modern recipe without each ingredient, every seed, the first
    --ablation_steps steps of the --steps schedule; 'modern recipe' is the full runs' own first steps."""
    n = a.ablation_steps
    first = [{k: {s: v for s, v in r[k].items() if s <= n} for k in ("val", "step_ms")} for r in modern_runs]
    specs = [(i, name, seed) for i, name in enumerate(ABLATIONS) for seed in seeds]
    runs = train_runs(
        [
            (
                out_root / corpus / f"ablation{i}_seed{seed}",
                [
                    *recipe_args("modern", best["modern"], common, n, seed, ABLATIONS[name]),
                    f"--lr_decay_steps={a.steps}",
                ],
            )
            for i, name, seed in specs
        ],
        a.threads,
        a.jobs,
    )
    rows = {"modern recipe": first, **{name: [] for name in ABLATIONS}}
    for (i, name, seed), metrics in zip(specs, runs):
        rows[name].append(summarize(metrics))
        print(f"ablation {name} seed {seed}: val at step {n} {rows[name][-1]['val'][n]:.4f}", flush=True)
    return {
        name: {
            "steps_to_target": spread([to_target(r, target)[0] for r in runs]),
            "val": spread([r["val"][n] for r in runs]),
        }
        for name, runs in rows.items()
    }


def knob_costs(corpus, a, out_root, best, gpt2_common, modern_common):
    """{name: ms/step}: the GPT-2 recipe, it with each knob alone, the modern recipe, and the GPT-2 recipe again,
    run back to back so they share the machine's load (the two GPT-2 runs show its drift), --knob_rounds times;
    each the lowest of its rounds' medians (the least disturbed by other processes)."""
    seed = int(a.seeds.split(",")[0])
    base = [*recipe_args("gpt2", best["gpt2"], gpt2_common, a.knob_steps, seed), "--eval_interval=0"]
    modern = [*recipe_args("modern", best["modern"], modern_common, a.knob_steps, seed), "--eval_interval=0"]
    runs = [
        ("gpt2", base),
        *((k, [*base, *flags]) for k, flags in KNOBS.items()),
        ("modern recipe", modern),
        ("gpt2 again", base),
    ]
    cost = {}
    for r in range(a.knob_rounds):
        for name, args in runs:
            out = out_root / corpus / (f"knob_{name.replace(' ', '_')}" + (f"_r{r}" if r else ""))
            ms = median_ms(summarize(train_runs([(out, args)], a.threads)[0]))  # one at a time: a timing
            cost[name] = min(cost.get(name, ms), ms)
            print(f"round {r}: {name}: {ms:.0f} ms/step", flush=True)
    return cost


def main(argv=None):
    a = parse_args(argv)
    out_root = Path(a.out_dir)
    out_root.mkdir(parents=True, exist_ok=True)
    device = next((f.split("=", 1)[1] for f in a.model.split() if f.startswith("--device=")), "cpu")
    report = {
        "machine": machine_line(device),
        "python": sys.version.split()[0],
        "threads": a.threads,
        "jobs": a.jobs,
        "steps": a.steps,
        "model": a.model,
        "corpora": {},
        "ablations": None,
        "ms_per_step": None,
    }
    print(
        f"bench.recipes on {report['machine']}, OMP_NUM_THREADS={a.threads or 'default'}, --jobs {a.jobs}", flush=True
    )
    best, seeds = {}, [int(x) for x in a.seeds.split(",")]
    for i, corpus in enumerate(a.corpora.split(",")):
        if a.sweep_every_corpus:
            best = {}
        check = seeds if i == 0 else seeds[: a.check_seeds]
        result, modern_runs, target, gpt2_common, modern_common = compare(corpus, a, out_root, best, check)
        if i == 0 and a.ablation_steps:
            report["ablations"] = ablations(corpus, a, out_root, best, seeds, modern_runs, target, modern_common)
        if i == 0 and a.knob_steps:
            report["ms_per_step"] = knob_costs(corpus, a, out_root, best, gpt2_common, modern_common)
        report["corpora"][corpus] = result
    cost = report["ms_per_step"]
    for corpus, r in report["corpora"].items():
        if cost and r["step_ratio"]:  # time to target at the back-to-back per-step costs
            gpt2_ms = (cost["gpt2"] + cost["gpt2 again"]) / 2
            r["time_ratio_back_to_back"] = r["step_ratio"] * cost["modern recipe"] / gpt2_ms
        print_corpus(corpus, r, a.steps)
    if report["ablations"]:
        print_ablations(report["ablations"], a.ablation_steps)
    if cost:
        print_costs(cost)
    (out_root / "recipes.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out_root / 'recipes.json'}")


def pm(x, spec):
    """'mean [min-max]' of a spread(), or the values where some run never got there."""
    if x["mean"] is None:
        return ", ".join(fmt(v, spec) for v in x["values"])
    return f"{format(x['mean'], spec)} [{format(x['min'], spec)}-{format(x['max'], spec)}]"


def print_corpus(corpus, r, steps):
    print(
        f"\n### {corpus}: GPT-2 recipe (lr {r['best']['gpt2']:g}) vs modern recipe (rates x{r['best']['modern']:g}),"
        f" seeds {', '.join(map(str, r['seeds']))}"
    )
    print("sweep (final val loss, first seed): " + ", ".join(f"{k}: {v:.4f}" for k, v in r["sweep"].items()))
    print("\n| step | GPT-2 recipe val (mean) | modern recipe val (mean) |\n|---|---|---|")
    for s, v in r["val_at_equal_steps"].items():
        print(f"| {s} | {v['gpt2']:.4f} | {fmt(v['modern'], '.4f')} |")
    g, m = r["gpt2"], r["modern"]
    print(f"\ntarget (GPT-2 recipe's val loss at step {steps}, mean of the seeds): {r['target']:.4f}")
    print("mean [min-max] over the seeds:")
    print("| recipe | final val | steps to target | training time to target (in its run) | ms/step (in its run) |")
    print("|---|---|---|---|---|")
    for name, x in (("GPT-2", g), ("modern", m)):
        print(
            f"| {name} | {pm(x['final_val'], '.4f')} | {pm(x['steps_to_target'], '.0f')} | "
            f"{pm(x['seconds_to_target'], '.0f')} s | {x['ms_per_step']:.0f} |"
        )
    print(
        f"steps ratio {fmt(r['step_ratio'], '.2f')}, time ratio {fmt(r['time_ratio'], '.2f')} (runs at different "
        f"times), {fmt(r.get('time_ratio_back_to_back'), '.2f')} (at the back-to-back per-step costs)"
    )


def print_ablations(rows, n):
    print(f"\n| modern recipe, first {n} steps | steps to target | val at step {n} |\n|---|---|---|")
    for name, x in rows.items():
        print(f"| {name} | {pm(x['steps_to_target'], '.0f')} | {pm(x['val'], '.4f')} |")


def print_costs(cost):
    base = (cost["gpt2"] + cost["gpt2 again"]) / 2
    print("\n| per-step cost | ms/step | vs GPT-2 recipe |\n|---|---|---|")
    for k, ms in cost.items():
        print(f"| {k} | {ms:.0f} | {ms / base:.2f}x |")


if __name__ == "__main__":
    main()
