"""hellaswag.py: HellaSwag as llm.c scores it, the suite's task hellaswag_llmc: rendered and predicted exactly as
hellaswag.py did before it became a task of the suite; scores equal a plain Hugging Face reference; batching and
DDP change nothing."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gpt2train.assets import get_tokenizer
from gpt2train.bpe import HFTokenizer, load_tokenizer
from gpt2train.hf import from_pretrained, save_pretrained
from gpt2train.scoring import Forwards, Suite, score_requests, score_rows
from gpt2train.tasks import HELLASWAG_LLMC, load_hellaswag
from hellaswag import main
from model import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 64  # small enough that one example below is cropped from the left

# Hand-written examples in the HellaSwag format, of varied lengths (one longer than BLOCK_SIZE).
EXAMPLES = [
    {
        "ind": 4,
        "ctx": "A man is sitting on a roof. He",
        "label": 3,
        "endings": [
            "is using wrap to wrap a pair of skis.",
            "is ripping level tiles off.",
            "is holding a rubik's cube.",
            "starts pulling up roofing on a roof.",
        ],
    },
    {
        "ind": 7,
        "ctx": "The chef cracks two eggs into a bowl and",
        "label": 0,
        "endings": [
            "whisks them with a fork.",
            "throws the bowl out of the window into the garden below.",
            "sings.",
            "paints the ceiling blue while the soup boils over.",
        ],
    },
    {
        "ind": 12,
        "ctx": "Kids",
        "label": 2,
        "endings": [
            "are.",
            "run around the playground, laughing loudly as the bell rings for lunch.",
            "play tag in the park.",
            "eat.",
        ],
    },
    {
        "ind": 15,
        "ctx": "A woman walks her dog along the beach at sunset. The dog chases a seagull and then",
        "label": 1,
        "endings": [
            "flies away.",
            "comes back wagging its tail.",
            "reads a newspaper.",
            "the sun explodes in a shower of confetti over the quiet water.",
        ],
    },
    {
        "ind": 21,
        "ctx": "[header] How to tie a tie [title] Drape the tie around your neck. [step] Make sure "
        "the wide end hangs lower than the narrow end, about twelve inches, and cross the "
        "wide end over the narrow end near your collar. [title] Loop the wide end",
        "label": 0,
        "endings": [
            "up through the neck loop from underneath.",
            "into the washing machine.",
            "around your left ankle twice.",
            "and then call a friend for advice.",
        ],
    },
    {
        "ind": 30,
        "ctx": "Naïve café owners — “déjà vu” 😀 — greet",
        "label": 3,
        "endings": [
            "the customers.",
            "nobody at all, ever, under any circumstances whatsoever.",
            "cats.",
            "each guest with a smile and a warm croissant.",
        ],
    },
    {
        "ind": 33,
        "ctx": "He lifts the barbell over his head, holds it for a second, and",
        "label": 1,
        "endings": ["eats it.", "drops it onto the mat.", "flies to the moon.", "sleeps."],
    },
    {
        "ind": 41,
        "ctx": "A group of people are rafting down a river. They",
        "label": 2,
        "endings": [
            "are in a kitchen.",
            "stop.",
            "paddle hard through the rapids as water splashes them.",
            "knit sweaters.",
        ],
    },
]


@pytest.fixture(scope="module")
def enc():
    return get_tokenizer()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A small random transformers GPT2LMHeadModel saved with save_pretrained."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    # a larger init than GPT-2's 0.02 makes the distributions far from uniform, so endings differ clearly
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=BLOCK_SIZE, vocab_size=50257, initializer_range=0.2)
    path = tmp_path_factory.mktemp("hf_gpt2")
    GPT2LMHeadModel(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model(hf_dir):
    return from_pretrained(str(hf_dir)).eval()


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("hellaswag") / "small.jsonl"
    path.write_text("".join(json.dumps(ex) + "\n" for ex in EXAMPLES))
    return path


def evaluate(model, examples, enc, batch_size=16, stop=None):
    """The suite's result on the examples, scored as hellaswag.py scores them: batch_size examples (4 rows each) per
    forward."""
    return Suite({HELLASWAG_LLMC.name: examples}, enc).score(model, "cpu", 4 * batch_size, stop=stop)


def render_before(example, enc):
    """(rows, masks): hellaswag.py's rendering before it became the suite's task hellaswag_llmc (the oracle the task is
    checked against): row i is the tokens of ctx, then those of " " + endings[i]; the mask is 1 on the ending's."""
    ctx = enc.encode_ordinary(example["ctx"])
    rows, masks = [], []
    for ending in example["endings"]:
        end = enc.encode_ordinary(" " + ending)
        rows.append(ctx + end)
        masks.append([0] * len(ctx) + [1] * len(end))
    return rows, masks


def predictions_before(model, examples, enc, batch_size):
    """[(pred, pred_norm)] and (acc, acc_norm) as hellaswag.py computed them before: argmin of each ending's summed
    loss, and of its mean loss per ending token, in float32 (torch.argmin: the first of equal minima)."""
    requests = []
    for ex in examples:
        for row, mask in zip(*render_before(ex, enc)):
            requests.append((row[: mask.index(1)], row[mask.index(1) :]))
    log_likelihood, count = score_requests(model, requests, Forwards("cpu", 4 * batch_size), n_vocab=enc.n_vocab)
    sum_loss, mean_loss = (-log_likelihood).view(-1, 4), (-log_likelihood / count.clamp(min=1)).view(-1, 4)
    preds = [(int(s.argmin()), int(m.argmin())) for s, m in zip(sum_loss, mean_loss)]
    n = len(examples)
    accuracies = (
        sum(p == ex["label"] for (p, _), ex in zip(preds, examples)) / n,
        sum(p == ex["label"] for (_, p), ex in zip(preds, examples)) / n,
    )
    return preds, accuracies


def reference_losses(hf, enc, example, block_size):
    """One row at a time through transformers: CE of the ending tokens, as (sums, means) over 4 endings."""
    ctx = enc.encode(example["ctx"])
    sums, means = [], []
    for ending in example["endings"]:
        end = enc.encode(" " + ending)
        row = (ctx + end)[-(block_size + 1) :]  # too long: the harness's window, the last block_size + 1 tokens
        with torch.no_grad():
            logits = hf(torch.tensor([row[:-1]])).logits[0]  # (T, V): the model reads all but the last token
        token_loss = F.cross_entropy(logits, torch.tensor(row[1:]), reduction="none")
        ending_loss = token_loss[-len(end) :]  # predictions of the ending tokens
        sums.append(ending_loss.sum().item())
        means.append(ending_loss.mean().item())
    return sums, means


def test_the_task_renders_each_example_as_hellaswag_py_did(enc):
    # and two that the harness's way of encoding would change: a context's trailing space (the harness moves it into
    # the continuation) and special-token text (the harness encodes it as the special token)
    examples = EXAMPLES + [
        dict(EXAMPLES[0], ctx="A man is sitting on a roof. He "),
        dict(EXAMPLES[1], ctx="<|endoftext|>The chef", endings=["<|endoftext|>", "a", "b", "c"]),
    ]
    suite = Suite({HELLASWAG_LLMC.name: examples}, enc)
    rendered = suite.examples[HELLASWAG_LLMC.name]
    assert [index for index, *_ in rendered] == list(range(len(examples)))
    for ex, (_, pairs, label, _, _) in zip(examples, rendered):
        rows, masks = render_before(ex, enc)
        assert [ctx + cont for ctx, cont in pairs] == rows
        assert [[0] * len(ctx) + [1] * len(cont) for ctx, cont in pairs] == masks
        assert label == ex["label"]
    rows, masks = render_before(EXAMPLES[0], enc)  # the oracle itself: the leading space belongs to the ending
    assert rows[0] == enc.encode(EXAMPLES[0]["ctx"]) + enc.encode(" " + EXAMPLES[0]["endings"][0])
    assert masks[0].count(1) == len(enc.encode(" " + EXAMPLES[0]["endings"][0]))


@pytest.mark.parametrize("batch_size", [1, 3, 16])
def test_predictions_and_accuracies_equal_hellaswag_py_before_the_suite(model, enc, batch_size):
    preds, (acc, acc_norm) = predictions_before(model, EXAMPLES, enc, batch_size)
    result = evaluate(model, EXAMPLES, enc, batch_size)
    assert [(p["pred"], p["pred_norm"]) for p in result["preds"]] == preds
    r = result["tasks"][HELLASWAG_LLMC.name]
    assert (r["n"], r["acc"], r["acc_norm"]) == (len(EXAMPLES), acc, acc_norm)
    assert any(p != q for p, q in preds)  # sum and mean disagree somewhere: acc_norm is really per token


def test_scores_and_predictions_equal_hf_reference(hf_dir, model, enc, data_file):
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    examples = load_hellaswag(data_file)
    assert any(len(r) > BLOCK_SIZE for ex in examples for r in render_before(ex, enc)[0])  # cropping is exercised
    result = evaluate(model, examples, enc, batch_size=3)

    correct = correct_norm = 0
    assert [p["index"] for p in result["preds"]] == list(range(len(EXAMPLES)))
    for ex, p in zip(examples, result["preds"]):
        sums, means = reference_losses(hf, enc, ex, BLOCK_SIZE)
        assert p["log_likelihoods"] == pytest.approx([-s for s in sums], abs=1e-4)
        assert p["pred"] == min(range(4), key=sums.__getitem__)
        assert p["pred_norm"] == min(range(4), key=means.__getitem__)
        assert p["label"] == ex["label"]
        correct += p["pred"] == ex["label"]
        correct_norm += p["pred_norm"] == ex["label"]
    r = result["tasks"][HELLASWAG_LLMC.name]
    assert r["n"] == len(EXAMPLES)
    assert r["acc"] == correct / len(EXAMPLES)
    assert r["acc_norm"] == correct_norm / len(EXAMPLES)


def test_batched_predictions_equal_one_example_per_forward(model, enc, data_file):
    examples = load_hellaswag(data_file)
    single = []  # the plain way: each example's 4 rows alone in one forward
    for ex in examples:
        rows, masks = render_before(ex, enc)
        single.append(score_rows(model, rows, masks, Forwards("cpu")))
    for batch_size in (1, 3, 8):
        batched = evaluate(model, examples, enc, batch_size=batch_size)
        for p, (sum_loss, mean_loss) in zip(batched["preds"], single):
            assert (p["pred"], p["pred_norm"]) == (int(sum_loss.argmin()), int(mean_loss.argmin()))
            assert p["log_likelihoods"] == pytest.approx((-sum_loss).tolist(), abs=1e-4)


def test_evaluate_restores_training_mode(model, enc):
    model.train()
    evaluate(model, EXAMPLES[:2], enc)
    assert model.training
    model.eval()
    evaluate(model, EXAMPLES[:2], enc)
    assert not model.training


DDP_SCRIPT = """
import json, sys
import torch.distributed as dist
from gpt2train.assets import get_tokenizer
from gpt2train.hf import from_pretrained
from gpt2train.scoring import Suite
from gpt2train.tasks import load_hellaswag
dist.init_process_group("gloo")
model = from_pretrained(sys.argv[1])  # every rank its bare GPT, as train.py's gathered model
docs = {"hellaswag_llmc": load_hellaswag(sys.argv[2], limit=7)}
suite = Suite(docs, get_tokenizer(), dist.get_rank(), dist.get_world_size())  # as train.py keeps it
with open(sys.argv[3] + str(dist.get_rank()), "w") as f:
    json.dump(suite.score(model, "cpu", 12), f)
dist.destroy_process_group()
"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_ranks(script, args, timeout):
    """Run `python -c script *args` as ranks 0 and 1 of a 2-process gloo group; fails on a non-zero exit."""
    env = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        WORLD_SIZE="2",
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, *map(str, args)],
            cwd=ROOT,
            env=dict(env, RANK=str(rank)),
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    for p in procs:
        _, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, err


@pytest.mark.slow
def test_two_processes_total_the_single_process_counts(model, enc, hf_dir, data_file, tmp_path):
    # 7 examples: the ranks get 4 and 3, so 2 and 1 batches -- uneven work must not hang
    single = evaluate(model, load_hellaswag(data_file, limit=7), enc, batch_size=3)
    run_two_ranks(DDP_SCRIPT, [hf_dir, data_file, tmp_path / "rank"], timeout=120)
    ranks = [json.loads((tmp_path / f"rank{r}").read_text()) for r in range(2)]
    for r in ranks:  # every rank holds the all-reduced totals
        assert r["tasks"] == single["tasks"]
    # each rank scored its own share, and together they scored every example once, the same way
    assert [len(r["preds"]) for r in ranks] == [4, 3]
    by_index = {p["index"]: (p["pred"], p["pred_norm"]) for r in ranks for p in r["preds"]}
    assert by_index == {p["index"]: (p["pred"], p["pred_norm"]) for p in single["preds"]}


@pytest.mark.parametrize(
    "line, problem",
    [
        ('{"ctx": "a", "endings": ["a", "b", "c", "d"], "label": 0', "JSONDecodeError"),
        ('{"endings": ["a", "b", "c", "d"], "label": 0}', "ctx"),
        ('{"ctx": "a", "endings": ["a", "b", "c"], "label": 0}', "endings"),
        ('{"ctx": "a", "endings": ["a", "b", "c", 4], "label": 0}', "endings"),
        ('{"ctx": "a", "endings": ["a", "b", "c", "d"], "label": 4}', "label"),
        ("[1, 2]", "TypeError"),
    ],
)
def test_malformed_line_is_an_error_naming_the_line(tmp_path, line, problem):
    good = json.dumps(EXAMPLES[0])
    path = tmp_path / "bad.jsonl"
    path.write_text(f"{good}\n{good}\n{line}\n{good}\n")
    with pytest.raises(ValueError, match=rf"bad\.jsonl:3: .*{problem}"):
        load_hellaswag(path)


def test_load_hellaswag_limit_and_string_labels(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(dict(ex, label=str(ex["label"]))) + "\n" for ex in EXAMPLES))
    examples = load_hellaswag(path, limit=5)
    assert [ex["label"] for ex in examples] == [ex["label"] for ex in EXAMPLES[:5]]
    assert [ex["ind"] for ex in examples] == [ex["ind"] for ex in EXAMPLES[:5]]


def test_cli_prints_and_writes_what_hellaswag_py_did(hf_dir, model, enc, data_file, tmp_path, capsys):
    per_example = tmp_path / "preds.jsonl"
    rc = main(
        [
            "--init_from",
            str(hf_dir),
            "--data",
            str(data_file),
            "--device",
            "cpu",
            "--batch_size",
            "4",
            "--json",
            "--per_example",
            str(per_example),
        ]
    )
    assert rc == 0
    preds, (acc, acc_norm) = predictions_before(model, EXAMPLES, enc, batch_size=4)
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith(f"hellaswag: n={len(EXAMPLES)} acc={acc:.4f} acc_norm={acc_norm:.4f} (")
    assert json.loads(out[-1]) == {"n": len(EXAMPLES), "acc": acc, "acc_norm": acc_norm}
    lines = [json.loads(line) for line in per_example.read_text().splitlines()]
    assert lines == [
        {"ind": ex["ind"], "label": ex["label"], "pred": pred, "pred_norm": pred_norm}
        for ex, (pred, pred_norm) in zip(EXAMPLES, preds)
    ]


@pytest.mark.slow
def test_cli_malformed_data_is_a_one_line_error(hf_dir, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(EXAMPLES[0]) + "\nnot json\n")
    proc = subprocess.run(
        [sys.executable, "hellaswag.py", "--init_from", str(hf_dir), "--data", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    assert f"{path}:2" in proc.stderr


def test_cli_scores_with_the_model_dirs_tokenizer_json(byte_level_tokenizer_json, data_file, tmp_path, capsys):
    enc = load_tokenizer(byte_level_tokenizer_json.parent)
    assert isinstance(enc, HFTokenizer)
    torch.manual_seed(0)
    # vocab of the tokenizer's size: GPT-2 ids would not even fit this model
    save_pretrained(
        GPT(GPTConfig(block_size=BLOCK_SIZE, vocab_size=enc.n_vocab, n_layer=2, n_head=2, n_embd=32)), tmp_path
    )
    shutil.copy(byte_level_tokenizer_json, tmp_path / "tokenizer.json")
    assert main(["--init_from", str(tmp_path), "--data", str(data_file), "--device", "cpu", "--json"]) == 0
    expected = evaluate(from_pretrained(str(tmp_path)), load_hellaswag(data_file), enc)["tasks"][HELLASWAG_LLMC.name]
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last == {"n": expected["n"], "acc": expected["acc"], "acc_norm": expected["acc_norm"]}


@pytest.mark.parametrize("case", ["empty file", "blank lines only"])
def test_no_examples_is_an_error_not_an_accuracy(hf_dir, model, enc, tmp_path, capsys, case):
    path = tmp_path / "empty.jsonl"
    path.write_text("" if case == "empty file" else "\n\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["--init_from", str(hf_dir), "--data", str(path), "--device", "cpu"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.endswith(f"error: {path}: no hellaswag_llmc examples\n") and err.count("\n") == 1, err
    with pytest.raises(ValueError, match="no examples to evaluate"):  # the function too: 0/0 is no accuracy
        evaluate(model, [], enc)


def test_bad_per_example_path_fails_before_evaluating(hf_dir, data_file, tmp_path, monkeypatch, capsys):
    import hellaswag

    monkeypatch.setattr(hellaswag, "Suite", lambda *a, **k: pytest.fail("evaluated before checking --per_example"))
    bad = tmp_path / "no" / "such" / "dir" / "preds.jsonl"
    with pytest.raises(SystemExit) as exit_info:
        main(["--init_from", str(hf_dir), "--data", str(data_file), "--device", "cpu", "--per_example", str(bad)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.endswith(f"error: {bad}: No such file or directory\n") and err.count("\n") == 1, err


def test_per_example_keeps_an_earlier_file_until_the_new_one_is_written(hf_dir, data_file, tmp_path, capsys):
    """Issue 38 (O): the file was opened for writing (emptied) before the model loaded."""
    out = tmp_path / "preds.jsonl"
    out.write_text("earlier results\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["--ckpt", str(tmp_path / "nope"), "--data", str(data_file), "--per_example", str(out)])
    assert exit_info.value.code == 2 and out.read_text() == "earlier results\n"
    assert (
        main(["--init_from", str(hf_dir), "--data", str(data_file), "--device", "cpu", "--per_example", str(out)]) == 0
    )
    assert [json.loads(line)["ind"] for line in out.read_text().splitlines()] == [ex["ind"] for ex in EXAMPLES]


def test_a_stop_request_abandons_the_evaluation_between_batches(model, enc, monkeypatch):
    """train.py's SIGTERM: once stop() is True no further batch is scored and the result is None."""
    from gpt2train import scoring

    scored, asked = [], []
    real = scoring.score_rows
    monkeypatch.setattr(scoring, "score_rows", lambda *a, **k: scored.append(1) or real(*a, **k))
    stop = lambda: asked.append(1) or len(asked) > 2  # noqa: E731  (a signal arrives during the second batch)
    assert evaluate(model, EXAMPLES, enc, batch_size=1, stop=stop) is None
    assert len(scored) == 2 and len(EXAMPLES) > 2
