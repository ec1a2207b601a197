"""`checkpoint.py export` writes a directory that transformers uses offline: weights, tokenizer, generation config."""

import json
import shutil
from dataclasses import asdict

import pytest
import torch

import checkpoint as checkpoint_command
import sample
from gpt2train import checkpoint_file
from gpt2train.assets import EOT, get_tokenizer
from gpt2train.bpe import load_tokenizer
from gpt2train.hf import save_pretrained
from model import GPT, GPTConfig

transformers = pytest.importorskip("transformers")

VARIED = (
    "Hello  world!\n\n\n   indented\tand  tabbed\r\n naïve café, 日本語, 😀🎉, ünïcödé;  "
    "1234567890 3.14159 2024-11-24<|endoftext|>Next doc: it's, we'll, they've; trailing spaces   \n"
)


@pytest.fixture(autouse=True)
def network_off(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def write_checkpoint(path, model, config=None, step=3):
    """`model`'s weights as a checkpoint of this library (no optimizer state), written by save_checkpoint."""
    checkpoint_file.save_checkpoint(
        path,
        {
            "model": model.state_dict(),
            "model_args": asdict(model.config),
            "config": config or {},
            "step": step,
            "optimizer": None,
            "scaler": None,
            "loader": {},
            "rng": {},
            "val_loss": None,
            "format": checkpoint_file.FORMAT,
        },
    )
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny GPT-2 BPE checkpoint (padded vocabulary 50304) and its export by `checkpoint.py export`."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=128, vocab_size=50304, n_layer=2, n_head=2, n_embd=32))
    out = tmp_path_factory.mktemp("run")
    write_checkpoint(out / "ckpt_000003.pt", model)
    assert checkpoint_command.main(["export", str(out), str(out / "hf")]) == 0
    return out


def test_export_says_which_step_it_wrote_and_its_files_are_readable_by_all(tmp_path, capsys):
    """An out_dir means its newest good checkpoint: the line says which step that was. model.safetensors gets the
    mode its siblings get (safetensors itself creates it 0600)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=50304, n_layer=1, n_head=2, n_embd=16))
    write_checkpoint(tmp_path / "run" / "ckpt_000003.pt", model)
    assert checkpoint_command.main(["export", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    assert capsys.readouterr().out == f"wrote {tmp_path / 'hf'}: step 3 of {tmp_path / 'run'}\n"
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "hf").iterdir()}
    assert "model.safetensors" in modes and len(set(modes.values())) == 1, modes


def test_a_full_disk_during_export_names_the_file(tmp_path, monkeypatch, capsys):
    import errno
    import os

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=50304, n_layer=1, n_head=2, n_embd=16))
    write_checkpoint(tmp_path / "run" / "ckpt_000003.pt", model)
    capsys.readouterr()

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    assert checkpoint_command.main(["export", str(tmp_path / "run"), str(tmp_path / "hf")]) == 2
    monkeypatch.undo()
    assert capsys.readouterr().err == (
        f"checkpoint.py: error: {tmp_path / 'hf' / 'tokenizer.json'}: no space left on the device; "
        f"free some disk space\n"
    )


def test_exported_tokenizer_encodes_and_decodes_as_tiktoken(run):
    tok = transformers.AutoTokenizer.from_pretrained(run / "hf")
    enc = get_tokenizer()
    ids = tok(VARIED)["input_ids"]
    assert ids == enc.encode(VARIED, allowed_special={"<|endoftext|>"})
    assert tok.decode(ids) == VARIED
    assert tok.eos_token_id == tok.bos_token_id == EOT
    assert json.loads((run / "hf" / "generation_config.json").read_text())["eos_token_id"] == EOT


def test_transformers_greedy_generation_equals_sample_py(run, capsys):
    prompt = "ROMEO: naïve 😀"
    argv = [
        "--ckpt",
        str(run),
        "--prompt",
        prompt,
        "--temperature",
        "0",
        "--max_new_tokens",
        "50",
        "--device",
        "cpu",
        "--dtype",
        "float32",
    ]
    assert sample.main(argv) == 0
    ours = capsys.readouterr().out.removesuffix("\n" + sample.SEPARATOR + "\n")
    tok = transformers.AutoTokenizer.from_pretrained(run / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(run / "hf").eval()
    with torch.no_grad():
        ids = hf.generate(**tok(prompt, return_tensors="pt"), max_new_tokens=50, do_sample=False)
    assert ids.shape[1] == len(tok(prompt)["input_ids"]) + 50  # no early stop at <|endoftext|>
    assert tok.decode(ids[0]) == ours


def test_a_model_imported_with_its_own_tokenizer_exports_that_tokenizer(byte_level_tokenizer_json, tmp_path):
    """A Pythia-style directory's tokenizer.json (<|endoftext|> = 0) travels through a fine-tuning checkpoint."""
    hf_in = tmp_path / "pythia"
    hf_in.mkdir()
    shutil.copy(byte_level_tokenizer_json, hf_in / "tokenizer.json")
    own = load_tokenizer(hf_in)
    model = GPT(
        GPTConfig(
            block_size=32,
            vocab_size=own.n_vocab,
            n_layer=1,
            n_head=2,
            n_embd=16,
            rotary_pct=0.25,
            parallel_residual=True,
            tie_embeddings=False,
            activation="gelu",
        )
    )
    write_checkpoint(tmp_path / "run" / "ckpt_000003.pt", model, config={"init_from": str(hf_in)})
    assert checkpoint_command.main(["export", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == byte_level_tokenizer_json.read_bytes()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "Once upon a time, naïve 😀"
    assert tok(text)["input_ids"] == own.encode(text) and tok.eos_token_id == own.eot_token == 0
    for name in ("config.json", "generation_config.json"):
        assert json.loads((tmp_path / "hf" / name).read_text())["eos_token_id"] == 0, name


LM_EVAL_TASK = """task: hellaswag_as_hellaswag_py
dataset_path: json
dataset_kwargs:
  data_files:
    validation: {data}
output_type: multiple_choice
validation_split: validation
doc_to_text: "{{{{ctx}}}}"
doc_to_choice: endings
doc_to_target: label
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def test_lm_eval_harness_scores_an_export_as_hellaswag_py(tmp_path, monkeypatch):
    """The task of docs/evaluation-harness.md (context, then " " + ending): lm-eval's acc and log-likelihoods on
    the export equal hellaswag.py's on the model, example for example. Runs only where lm-eval is installed."""
    lm_eval = pytest.importorskip("lm_eval")
    pytest.importorskip("lm_eval.models.huggingface")  # needs accelerate too: pip install "lm_eval[hf]"
    from lm_eval.tasks import TaskManager

    from gpt2train.scoring import Suite
    from gpt2train.tasks import load_hellaswag

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    torch.manual_seed(0)
    # vocab 50257: no padded ids, so both softmaxes run over the same logits
    model = GPT(GPTConfig(block_size=64, vocab_size=50257, n_layer=1, n_head=2, n_embd=16)).eval()
    save_pretrained(model, tmp_path / "hf")
    endings = ["starts pulling up roofing.", "is  jumping, 3 times.", "falls; café naïve 😀", "leaves\n\nthe roof."]
    examples = [
        {
            "ind": i,
            "ctx": f"A man (number {i}) is sitting on a roof. He",
            "label": i % 4,
            "endings": endings[i % 4 :] + endings[: i % 4],
        }
        for i in range(6)
    ]
    (tmp_path / "val.jsonl").write_text("".join(json.dumps(ex) + "\n" for ex in examples))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "task.yaml").write_text(LM_EVAL_TASK.format(data=tmp_path / "val.jsonl"))

    suite = Suite({"hellaswag_llmc": load_hellaswag(tmp_path / "val.jsonl")}, get_tokenizer())  # hellaswag.py's
    ours = suite.score(model, "cpu")["preds"]
    tasks = TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False)  # no index of lm-eval's own
    out = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={tmp_path / 'hf'}",
        device="cpu",
        tasks=["hellaswag_as_hellaswag_py"],
        log_samples=True,
        batch_size=8,
        task_manager=tasks,
    )
    theirs = sorted(out["samples"]["hellaswag_as_hellaswag_py"], key=lambda s: s["doc_id"])
    assert len(theirs) == len(ours) == 6
    for mine, their in zip(ours, theirs):
        assert their["acc"] == float(mine["pred"] == mine["label"])
        log_likelihoods = [resp[0] for resp in their["filtered_resps"]]
        assert log_likelihoods == pytest.approx(mine["log_likelihoods"], rel=1e-4)
