"""Benchmark: evaluate.py against lm-evaluation-harness's `hf` backend on the same export and the same examples.
Run from the repository root, where lm_eval is installed (`pip install "lm_eval[hf]==0.4.13"`):

    python -m bench.eval_vs_harness --ckpt out/shakespeare --tasks default --limit 200 [--batch_size 64]

Exports the checkpoint to a temporary Hugging Face directory, writes the harness task folder for the first
--limit examples of each task (evaluate.export_harness: the harness's own configs, these rows), then, one after
the other in this process and on the same threads: evaluate.py's suite on the checkpoint, and
`lm_eval.simple_evaluate` on the export (the model loaded before the clock starts). Prints each one's examples/s,
their ratio, every task's acc side by side, and how many predictions differ (the goal: none). fp32 on the CPU.
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

import evaluate
from bench import machine_line, require
from gpt2train import tasks
from gpt2train.bpe import load_tokenizer
from gpt2train.hf import save_pretrained
from gpt2train.loading import load_model
from gpt2train.scoring import Suite


def run_ours(model, docs, enc, batch_size):
    t0 = time.perf_counter()
    result = Suite(docs, enc).score(model, "cpu", batch_size, dtype="float32")
    return result, time.perf_counter() - t0


def run_harness(hf_dir, task_dir, names, batch_size):
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm = HFLM(pretrained=str(hf_dir), device="cpu", batch_size=batch_size, dtype="float32")
    manager = TaskManager(include_path=str(task_dir), include_defaults=False)
    t0 = time.perf_counter()
    out = lm_eval.simple_evaluate(model=lm, tasks=names, log_samples=True, task_manager=manager)
    return out, time.perf_counter() - t0


def harness_preds(out, name):
    """[pred] per example in dataset order, from the harness's logged log-likelihoods (argmax, first of ties)."""
    keys = sorted(k for k in out["samples"] if k == f"gpt2train_{name}" or k.startswith(f"gpt2train_{name}_"))
    samples = [s for k in keys for s in sorted(out["samples"][k], key=lambda s: s["doc_id"])]
    return [max(range(len(s["filtered_resps"])), key=lambda i: (s["filtered_resps"][i][0], -i)) for s in samples]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", required=True, help="a checkpoint or out_dir of this library")
    parser.add_argument("--tasks", default="default")
    parser.add_argument("--limit", type=int, default=200, help="first N examples of each task")
    parser.add_argument("--batch_size", type=int, default=64, help="evaluate.py: rows per forward")
    parser.add_argument("--harness_batch_size", type=int, default=16, help="lm_eval --batch_size")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    require("bench.eval_vs_harness", "lm_eval", "accelerate")
    names = tasks.parse_tasks(args.tasks)
    docs = {name: tasks.load_docs(name, args.limit) for name in names}
    if "mmlu" in docs:  # the harness runs MMLU subject by subject: give it the same first N in subject order
        docs["mmlu"] = sorted(docs["mmlu"], key=lambda d: tasks.MMLU_SUBJECTS.index(d["subject"]))
    model, info = load_model(ckpt=args.ckpt)
    model = model.float().eval()
    enc = load_tokenizer(info["hf_dir"])
    print(f"machine: {machine_line('cpu')}")
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(model, Path(tmp) / "hf", tokenizer_dir=info["hf_dir"])
        run = evaluate.export_harness(Path(tmp) / "tasks", names, docs)
        ours, t_ours = run_ours(model, docs, enc, args.batch_size)
        theirs, t_theirs = run_harness(Path(tmp) / "hf", Path(tmp) / "tasks", run, args.harness_batch_size)
    n = sum(r["n"] for r in ours["tasks"].values())
    rows, differ = {}, 0
    for name in names:
        mine = [p["pred"] for p in ours["preds"] if p["task"] == name]
        other = harness_preds(theirs, name)
        differ += sum(a != b for a, b in zip(mine, other)) + abs(len(mine) - len(other))
        key = f"gpt2train_{name}"
        rows[name] = {
            "ours": ours["tasks"][name]["acc"],
            "harness": theirs["results"][key]["acc,none"],
            "n": ours["tasks"][name]["n"],
        }
        if "acc_norm" in ours["tasks"][name]:
            rows[name].update(
                ours_norm=ours["tasks"][name]["acc_norm"], harness_norm=theirs["results"][key]["acc_norm,none"]
            )
    for name, r in rows.items():
        norm = f"  acc_norm {r['ours_norm']:.4f} vs {r['harness_norm']:.4f}" if "ours_norm" in r else ""
        print(f"{name:>15} n={r['n']:<5} acc {r['ours']:.4f} vs {r['harness']:.4f}{norm}")
    result = {
        "examples": n,
        "ours_s": t_ours,
        "harness_s": t_theirs,
        "ours_ex_per_s": n / t_ours,
        "harness_ex_per_s": n / t_theirs,
        "speedup": t_theirs / t_ours,
        "predictions_differing": differ,
        "mc_centered": ours["mc_centered"],
        "tasks": rows,
        "threads": torch.get_num_threads(),
    }
    print(
        f"evaluate.py {n / t_ours:.1f} examples/s ({t_ours:.1f} s), lm_eval hf {n / t_theirs:.1f} examples/s "
        f"({t_theirs:.1f} s): {t_theirs / t_ours:.2f}x; predictions differing: {differ} of {n}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
