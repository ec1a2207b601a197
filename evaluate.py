"""A multiple-choice evaluation suite, rendered and scored as lm-evaluation-harness 0.4.13 scores its defaults.

    python evaluate.py --ckpt out/gpt2_124m --tasks default --json          # the default suite
    python evaluate.py --init_from hf_dir --tasks arc_easy,mmlu --limit 200 --per_example preds.jsonl
    python evaluate.py --export_harness harness_tasks --tasks default       # the same tasks for `lm_eval`
    python evaluate.py --ckpt out/a --bpb held_out.txt docs.jsonl --json    # bits per byte of any text
    python evaluate.py --ckpt out/a --split test --json                     # loss and bpb on the data's test split

Tasks (tasks.py): hellaswag, arc_easy, arc_challenge, piqa, winogrande, copa, openbookqa, commonsense_qa, sciq,
social_iqa, boolq, mmlu; `default` is the suite a 124M run can afford at every evaluation, `all` every task.
Each example's choices are scored by their summed log-likelihood after the context (`acc`) and, where the harness
reports it, by that divided by the choice's length in characters (`acc_norm`), through the one batched scorer
hellaswag.py and train.py use (scoring.py). The summary `mc_centered` is the mean over tasks of centered accuracy,
(acc - chance) / (1 - chance), chance being the mean of 1/choices over the examples scored: 0 for guessing,
1 for perfect. Scored on the validation splits (the harness's default is `test` for ARC, OpenBookQA, SciQ, MMLU).

--bpb scores text files instead, in bits per UTF-8 byte (BPB_PROTOCOL below; scoring.bits_per_byte), so models with
different tokenizers compare on the same text. --split val|test scores the checkpoint on its data's whole val or test
split (prepare_data.py --test_input's shards, which no training run reads) as train.py validates with
eval_steps='all' (evaluation.Evaluator): the last stdout line with --json holds <split>_loss and <split>_bpb.
"""

import argparse
import importlib.util
import json
import math
import sys
import time
from pathlib import Path

import torch

from gpt2train import tasks
from gpt2train.bpe import replace_surrogates, tokenizer_record
from gpt2train.console import log
from gpt2train.documents import PrepError, expand_inputs, file_documents
from gpt2train.files import atomic_write, check_writable, report_error
from gpt2train.scoring import Forwards, Suite, bits_per_byte
from gpt2train.tracking import json_safe

BPB_PROTOCOL = (
    "a .jsonl file's `text` fields are documents, any other UTF-8 file (.txt, .py, ...) is one, a directory its files"
    "; each document is scored alone as "
    "the end-of-text token followed by its tokens, cut into consecutive non-overlapping windows of at most "
    "block_size predicted tokens, each window conditioned only on its own tokens (softmax over the tokenizer's "
    "ids); bits per byte = the summed negative log-likelihood / ln 2 / the documents' UTF-8 bytes"
)

# ----------------------------------------------------------------------------- the harness's own task files

HARNESS_YAML = {  # the harness's default config of each task, under lm_eval/tasks/
    "hellaswag": "hellaswag/hellaswag.yaml",
    "arc_easy": "arc/arc_easy.yaml",
    "arc_challenge": "arc/arc_challenge.yaml",
    "piqa": "piqa/piqa.yaml",
    "winogrande": "winogrande/default.yaml",
    "copa": "super_glue/copa/default.yaml",
    "openbookqa": "openbookqa/openbookqa.yaml",
    "commonsense_qa": "commonsense_qa/default.yaml",
    "sciq": "sciq/sciq.yaml",
    "social_iqa": "siqa/siqa.yaml",
    "boolq": "super_glue/boolq/default.yaml",
}


def export_harness(out_dir, names, docs):
    """Write a task folder for `lm_eval --include_path out_dir`: each task's data (the validation rows scored
    here) and a config that includes the installed harness's own default config of that task, changing only
    where the data comes from. Returns the task names to pass to `lm_eval --tasks`."""
    spec = importlib.util.find_spec("lm_eval")
    if spec is None:
        raise ImportError("--export_harness includes the harness's own task configs: pip install lm_eval==0.4.13")
    harness = Path(spec.submodule_search_locations[0]) / "tasks"
    out = Path(out_dir).resolve()
    (out / "data").mkdir(parents=True, exist_ok=True)

    def write(task, include, rows):
        data = out / "data" / f"{task}.jsonl"
        data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        config = {
            "include": str(harness / include),
            "task": task,
            "tag": [],
            "dataset_path": "json",
            "dataset_name": None,
            "dataset_kwargs": {"data_files": {"validation": str(data)}},
            "training_split": None,
            "validation_split": "validation",
            "test_split": None,
            "fewshot_split": "validation",
        }
        (out / f"{task}.yaml").write_text(json.dumps(config, indent=2) + "\n")  # JSON is YAML

    run = []
    for name in names:
        if name != "mmlu":
            write(f"gpt2train_{name}", HARNESS_YAML[name], docs[name])
            run.append(f"gpt2train_{name}")
            continue
        subjects = [s for s in tasks.MMLU_SUBJECTS if any(d["subject"] == s for d in docs[name])]
        for s in subjects:
            write(f"gpt2train_mmlu_{s}", f"mmlu/default/mmlu_{s}.yaml", [d for d in docs[name] if d["subject"] == s])
        group = {
            "group": "gpt2train_mmlu",
            "task": [f"gpt2train_mmlu_{s}" for s in subjects],
            "aggregate_metric_list": [{"metric": "acc", "weight_by_size": True}],
            "metadata": {"version": 2},
        }
        (out / "gpt2train_mmlu.yaml").write_text(json.dumps(group, indent=2) + "\n")
        run.append("gpt2train_mmlu")
    return run


# ----------------------------------------------------------------------------- command line


def _parser(export):
    parser = argparse.ArgumentParser(prog="evaluate.py", description=__doc__.split("\n\n")[0])
    if export:
        parser.add_argument(
            "--export_harness",
            required=True,
            metavar="DIR",
            help="write these tasks' data and harness configs into DIR, for lm_eval --include_path",
        )
        parser.add_argument(
            "--cache_dir", help="cache of downloaded data (default $GPT2_CACHE_DIR, else ~/.cache/gpt2-train)"
        )
    else:
        from gpt2train.loading import (
            add_model_args,  # imports torch's model stack: only when a model is scored
        )

        add_model_args(parser)
        parser.add_argument("--batch_size", type=int, default=64, help="rows (choices) per forward pass")
        parser.add_argument("--json", action="store_true", help="last stdout line: one JSON object of the results")
        parser.add_argument("--per_example", help="write one JSON line per example: task, index, pred, label, acc")
        parser.add_argument("--export_harness", metavar="DIR", help="write the lm_eval task folder instead (no model)")
        parser.add_argument(
            "--bpb", nargs="+", metavar="FILE", help=f"score these text files in bits per byte instead: {BPB_PROTOCOL}"
        )
        parser.add_argument(
            "--split",
            choices=["val", "test"],
            help="score the loss and bits per byte on the data's whole val or test split instead (as train.py's "
            "validation with eval_steps='all'); --json's last line: <split>_loss, <split>_bpb",
        )
        parser.add_argument("--data_dir", help="--split: the prepared data (default: the checkpoint's data_dir)")
    parser.add_argument(
        "--tasks",
        default="default",
        help=f"comma-separated: {', '.join(tasks.TASKS)}; default ({','.join(tasks.DEFAULT_TASKS)}), all",
    )
    parser.add_argument(
        "--limit", type=int, default=None, help="score only the first N examples of each task (--bpb: documents)"
    )
    parser.add_argument(
        "--data",
        metavar="FILE",
        help="one task's rows (jsonl, the dataset's columns) to score "
        "instead of its validation split; needs exactly one task",
    )
    return parser


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    export = any(a == "--export_harness" or a.startswith("--export_harness=") for a in argv)
    parser = _parser(export)
    args = parser.parse_args(argv)
    if not export and args.batch_size < 1:
        parser.error(f"--batch_size must be >= 1, got {args.batch_size}")
    if args.limit is not None and args.limit < 1:
        parser.error(f"--limit must be >= 1, got {args.limit}")

    if not export and args.split:
        result, line = score_split(parser, args)
        print(line)
        if args.json:
            print(json.dumps(strict(result)))
        return 0
    if not export and args.bpb:
        result, device, dtype = score_bpb(parser, args)
        print(
            f"bpb={result['bpb']:.4f} over {result['documents']:,} document(s) of {', '.join(args.bpb)}: "
            f"{result['bytes']:,} bytes, {result['tokens']:,} tokens ({result['bytes'] / result['tokens']:.3f} "
            f"bytes/token), {result['nats'] / result['tokens']:.4f} nats/token ({device}, {dtype})"
        )
        if not math.isfinite(result["nats"]):
            log("the model's log-likelihoods are not finite (NaN or inf): its weights are not, or overflow", note=True)
        if args.json:
            print(json.dumps(strict({**result, "files": args.bpb})))
        return 0
    try:  # bad input is one line on stderr and exit status 2, all checked before a model is loaded
        names = tasks.parse_tasks(args.tasks)
        if not export and args.per_example:  # written at the end: an earlier file stays until then
            check_writable(args.per_example)
        if args.data is not None and len(names) != 1:
            raise ValueError(f"--data is one task's rows, but --tasks names {len(names)}: {','.join(names)}")
        limit = None if export else args.limit
        docs = {name: tasks.load_docs(name, limit, args.cache_dir, path=args.data) for name in names}
        if export:
            run = export_harness(args.export_harness, names, docs)
            print(
                f"wrote {len(run)} task(s) to {args.export_harness}; run:\nlm_eval --model hf --model_args "
                f"pretrained=HF_DIR --include_path {args.export_harness} --tasks {','.join(run)} --batch_size 16"
            )
            return 0
    except (OSError, ValueError, RuntimeError, ImportError) as e:
        report_error(parser.prog, e)
        parser.exit(2)

    from gpt2train.devices import tune_cpu_allocator
    from gpt2train.loading import load_model_from_args

    model, enc, device, dtype = load_model_from_args(parser, args)
    tune_cpu_allocator(device)
    t0 = time.time()
    result = Suite(docs, enc).score(model, device, args.batch_size, dtype, progress=sys.stderr.isatty())
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    elapsed = time.time() - t0
    if args.per_example:
        keys = ("task", "index", "pred", "label", "acc")
        try:
            atomic_write(args.per_example, "".join(json.dumps({k: p[k] for k in keys}) + "\n" for p in result["preds"]))
        except OSError as e:
            report_error(parser.prog, e)
            parser.exit(2)
    n = sum(r["n"] for r in result["tasks"].values())
    for name, r in result["tasks"].items():
        norm = f" acc_norm={r['acc_norm']:.4f}" if "acc_norm" in r else ""
        print(
            f"{name:>15}: n={r['n']:<6} acc={r['acc']:.4f}{norm} (chance {r['chance']:.3f}; harness default: "
            f"{tasks.TASKS[name].harness})"
        )
    print(
        f"mc_centered={result['mc_centered']:.4f} over {len(result['tasks'])} task(s), validation splits "
        f"({n / elapsed:.1f} examples/s, {device}, {dtype})"
    )
    if args.json:
        print(json.dumps(strict({k: v for k, v in result.items() if k != "preds"})))
    return 0


def strict(value):
    """value with each non-finite float as None, for --json: JSON has no NaN (train.py's result line does alike)."""
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, list):
        return [strict(v) for v in value]
    return json_safe(value)


def read_documents(paths, limit=None):
    """The documents of --bpb's files (BPB_PROTOCOL; a directory: its text files, as prepare_data.py --input reads
    one), the first `limit` of them (a null `text` is an empty one, lone surrogates U+FFFD, as prepare_data.py reads
    them); ValueError (one line naming the file, and the line of a jsonl) for a binary file, a `text` that is not a
    string, or a file that cannot be read."""
    docs = []
    for path in map(Path, paths):
        if not path.is_file() and not path.is_dir():
            kind = "not a regular file (a FIFO, device or socket)" if path.exists() else "no such file"
            raise ValueError(f"{path}: {kind}")
        try:
            docs += (replace_surrogates(doc or "") for doc in file_documents(expand_inputs([str(path)]), "text"))
        except PrepError as e:
            raise ValueError(str(e)) from None
    return docs[:limit]


def score_bpb(parser, args):
    """evaluate.py --bpb: (scoring.bits_per_byte's result for the model and files the flags name, device, dtype);
    bad input is one line on stderr and exit status 2."""
    if args.per_example or args.data:
        parser.error("--bpb scores text files: --per_example and --data belong to the tasks")
    try:
        docs = read_documents(args.bpb, args.limit)
    except (OSError, ValueError) as e:
        report_error(parser.prog, e)
        parser.exit(2)
    from gpt2train.devices import tune_cpu_allocator
    from gpt2train.loading import load_model_from_args

    model, enc, device, dtype = load_model_from_args(parser, args)
    tune_cpu_allocator(device)
    try:
        forwards = Forwards(device, args.batch_size, dtype)
        result = bits_per_byte(model, enc, docs, forwards, progress=sys.stderr.isatty())
    except ValueError as e:  # no text, a tokenizer without <|endoftext|> or with more ids than the model
        report_error(parser.prog, e)
        parser.exit(2)
    return result, device, dtype


def score_split(parser, args):
    """evaluate.py --split: (the result: <split>_loss, <split>_bpb, <split>_bytes, ...; its line) of the checkpoint on
    its data's whole val or test split, scored by the training run's own validation (evaluation.Evaluator.validate,
    eval_steps='all'). Data without that split, or tokenized with another tokenizer, is one line on stderr and exit
    status 2."""
    from types import SimpleNamespace

    from gpt2train.config import ConfigError, TrainConfig
    from gpt2train.data import open_loader
    from gpt2train.evaluation import Evaluator
    from gpt2train.layout import Env
    from gpt2train.loading import load_model_from_args
    from gpt2train.manifests import data_tokenizer, read_manifests
    from gpt2train.shards import ShardError
    from gpt2train.start import check_tokenizer

    if args.bpb or args.per_example or args.data:
        parser.error("--split scores a data split: --bpb, --per_example and --data are other evaluations")
    if args.init_from and not args.data_dir:
        parser.error("--split with --init_from needs --data_dir (a checkpoint knows its own)")
    model, enc, device, dtype = load_model_from_args(parser, args)
    config = args.model_info["config"] or {}
    try:
        cfg = TrainConfig(  # the run's config as its loader and its validation read it, on the whole split
            data_dir=args.data_dir or config.get("data_dir"),
            batch_size=args.batch_size,
            block_size=model.config.block_size,
            vocab_size=model.config.vocab_size,
            seed=config.get("seed", 0),
            packing=config.get("packing", "window"),
            eval_steps="all",
            hellaswag_interval=0,
            eval_tasks_interval=0,
            sample_interval=0,
        )
        manifests = read_manifests(cfg.data_dir)
        check_tokenizer(tokenizer_record(enc), data_tokenizer(manifests), cfg.data_dir, args.ckpt or args.init_from)
        loader = open_loader(cfg, args.split, manifests=manifests)
    except (ShardError, ConfigError, ValueError) as e:  # NoShardsError: no test shards there
        hint = "; prepare them with prepare_data.py --test_input FILES" if "no test shards" in str(e) else ""
        report_error(parser.prog, ValueError(f"{e}{hint}"))
        parser.exit(2)
    env = Env(rank=0, local_rank=0, world_size=1, distributed=False, device=device, dtype=dtype)
    evaluator = Evaluator(SimpleNamespace(B=args.batch_size), loader, None, cfg, env, None)
    evaluator.enc = enc  # val_bpb's byte lengths: the model's tokenizer, which the data's matches
    record = evaluator.validate(model, args.model_info["step"] or 0, SimpleNamespace(signal=None))
    split = args.split
    result = {f"{split}_{k[4:]}": v for k, v in record.items() if k.startswith("val_")}
    line = (
        f"{split}_loss={result[f'{split}_loss']:.4f} {split}_bpb={result.get(f'{split}_bpb', math.nan):.4f} over the "
        f"{split} split of {cfg.data_dir} ({result.get(f'{split}_bytes', 0):,} bytes; {device}, {dtype})"
    )
    return {"split": split, **result, "data_dir": str(cfg.data_dir), "step": record["step"]}, line


if __name__ == "__main__":
    sys.exit(main())
