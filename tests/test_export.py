"""`checkpoint.py export` writes a directory that transformers uses offline: weights, tokenizer, generation config."""

import hashlib
import json
import runpy
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

import checkpoint as checkpoint_command
import sample
import tiny
import train
from gpt2train import checkpoint, generation, hf
from gpt2train.assets import EOT, get_tokenizer
from gpt2train.bpe import load_tokenizer
from gpt2train.config import MODEL_KEYS
from gpt2train.hf import save_pretrained
from model import GPT, GPTConfig
from test_model import perturb_
from tiny import train_losses

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
    checkpoint.save_checkpoint(
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
            "format": checkpoint.FORMAT,
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


@pytest.mark.parametrize("arch", ["gpt2", "modern"])
def test_lm_eval_harness_scores_an_export_as_hellaswag_py(tmp_path, monkeypatch, arch):
    """The task of docs/evaluation-harness.md (context, then " " + ending): lm-eval's acc and log-likelihoods on
    the export (a GPT2LMHeadModel, or the modern recipe's own code with trust_remote_code) equal hellaswag.py's on
    the model, example for example. Runs only where lm-eval is installed."""
    lm_eval = pytest.importorskip("lm_eval")
    pytest.importorskip("lm_eval.models.huggingface")  # needs accelerate too: pip install "lm_eval[hf]"
    from lm_eval.tasks import TaskManager

    from gpt2train.scoring import Suite
    from gpt2train.tasks import load_hellaswag

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    torch.manual_seed(0)
    # vocab 50257: no padded ids, so both softmaxes run over the same logits
    options = MODERN if arch == "modern" else {}
    model = GPT(GPTConfig(block_size=64, vocab_size=50257, n_layer=1, n_head=2, n_embd=16, **options))
    model = perturb_(model).eval() if options else model.eval()  # the modern recipe's zero-initialised parts matter
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
        model_args=f"pretrained={tmp_path / 'hf'}" + (",trust_remote_code=True" if options else ""),
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


# ----------------------------------------------------------------------------- every architecture: the gpt2train route

MODERN = {  # configs/modern.py's model keys
    k: v
    for k, v in runpy.run_path(str(Path(__file__).parent.parent / "configs" / "modern.py")).items()
    if k in MODEL_KEYS
}
NEOX = dict(rotary_pct=0.25, parallel_residual=True, tie_embeddings=False, activation="gelu")
CUSTOM = {
    "modern": MODERN,
    "modern_bigram": {**MODERN, "bigram_embeds": 97},
    "neox_qk_norm": {**NEOX, "qk_norm": True},
    # a tied head, learned positions with a parallel residual (GPT-2 has no such model), GPT-2's activation, smear
    "tied_parallel_learned": dict(parallel_residual=True, smear=True),
    # muP (width_mult 2, head_dim 16: attention's 8/16 is not sdpa's 1/4) on both recipes: the multipliers travel
    "modern_mup": {**MODERN, "parametrization": "mup", "mup_base_width": 16},
    "gpt2_mup": dict(parametrization="mup", mup_base_width=16),
}


@pytest.fixture(scope="module", params=list(CUSTOM))
def custom(request, tmp_path_factory):
    """(model, export dir) of a tiny checkpoint with one CUSTOM architecture, exported by `checkpoint.py export`."""
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=128, vocab_size=50304, n_layer=2, n_head=2, n_embd=32, **CUSTOM[request.param])
    model = perturb_(GPT(cfg)).eval()
    out = tmp_path_factory.mktemp(request.param)
    write_checkpoint(out / "ckpt_000003.pt", model)
    assert checkpoint_command.main(["export", str(out), str(out / "hf")]) == 0
    return model, out / "hf"


def load_custom(path, **kwargs):
    return transformers.AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, **kwargs).eval()


def test_a_model_neither_gpt2_nor_neox_holds_exports_with_its_own_modeling_code(custom):
    """config.json names the remote code (auto_map), the two files are the package's own, verbatim, and the model
    loads offline as the library's network: logits within 1e-5 in float32, every row of the vocabulary."""
    model, hf_dir = custom
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["model_type"] == "gpt2train" and set(config["auto_map"]) == {"AutoConfig", "AutoModelForCausalLM"}
    for name in hf.REMOTE_CODE:
        assert (hf_dir / name).read_bytes() == (hf.HF_MODELING / name).read_bytes()
    theirs = load_custom(hf_dir)
    assert type(theirs).__name__ == "GPT2TrainForCausalLM"
    idx = torch.randint(0, 50257, (2, 128), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, _ = model(idx, idx)
        logits = theirs(idx).logits
    assert logits.shape == ours.shape == (2, 128, 50304)
    assert (logits - ours).abs().max().item() <= 1e-5


def test_the_custom_export_generates_the_librarys_greedy_ids_with_and_without_its_cache(custom):
    """transformers' generate (its KV cache, and without one) gives generation.generate's 50 greedy ids, as
    sample.py at temperature 0 (never a padding row: generation_config.json suppresses them)."""
    model, hf_dir = custom
    enc = get_tokenizer()
    prompt = torch.tensor([enc.encode("ROMEO: naïve 😀")])
    ours = generation.generate(model, prompt, 50, generation.Sampling(temperature=0.0, n_vocab=enc.n_vocab))
    theirs = load_custom(hf_dir)
    assert theirs.generation_config.suppress_tokens == list(range(enc.n_vocab, 50304))
    theirs.generation_config.eos_token_id = None  # sample.py runs on past <|endoftext|>
    for use_cache in (True, False):
        with torch.no_grad():
            ids = theirs.generate(prompt, max_new_tokens=50, do_sample=False, use_cache=use_cache)
        assert ids.tolist() == ours.tolist(), use_cache


def test_the_custom_export_imports_back_to_the_same_weights(custom):
    """hf.from_pretrained (train.py, sample.py --init_from) rebuilds the GPTConfig and every tensor exactly."""
    model, hf_dir = custom
    back = hf.from_pretrained(hf_dir)
    assert back.config == model.config
    mine, theirs = model.state_dict(), back.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


@pytest.fixture(scope="module")
def modern(tmp_path_factory):
    """(model, export dir) of the tiny modern-recipe checkpoint, written by save_pretrained."""
    torch.manual_seed(0)
    model = perturb_(GPT(GPTConfig(block_size=64, vocab_size=50304, n_layer=2, n_head=2, n_embd=32, **MODERN)))
    model.eval()
    out = tmp_path_factory.mktemp("modern") / "hf"
    save_pretrained(model, out)
    return model, out


def test_left_padded_rows_generate_as_each_row_alone(modern):
    """A batch of prompts of different lengths, left-padded (what pipelines and the harness's generation do): each row's
    greedy ids are its own alone; the padding moves no position, and a token after it has no previous token."""
    _, hf_dir = modern
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir, padding_side="left")
    tok.pad_token = tok.eos_token
    theirs = load_custom(hf_dir)
    prompts = ["To be, or not to be: that is the question", "Hello"]
    with torch.no_grad():
        batch = theirs.generate(**tok(prompts, return_tensors="pt", padding=True), max_new_tokens=12, do_sample=False)
        for row, prompt in zip(batch, prompts):
            alone = theirs.generate(**tok(prompt, return_tensors="pt"), max_new_tokens=12, do_sample=False)
            assert row[-12:].tolist() == alone[0, -12:].tolist(), prompt


def test_the_custom_export_loads_in_bfloat16(modern):
    model, hf_dir = modern
    theirs = load_custom(hf_dir, dtype=torch.bfloat16)
    assert {p.dtype for p in theirs.parameters()} == {torch.bfloat16}
    idx = torch.randint(0, 50257, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, _ = model(idx, idx)
        logits = theirs(idx).logits.float()
    assert (logits - ours).abs().max().item() < 0.05 * ours.abs().max().item()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_custom_export_loads_on_a_gpu_with_device_map(modern):
    model, hf_dir = modern
    theirs = load_custom(hf_dir, device_map="cuda")
    assert {p.device.type for p in theirs.parameters()} == {"cuda"}
    prompt = torch.tensor([get_tokenizer().encode("ROMEO:")])
    ours = generation.generate(model, prompt, 20, generation.Sampling(temperature=0.0))
    with torch.no_grad():
        ids = theirs.generate(prompt.cuda(), max_new_tokens=20, do_sample=False)
    assert ids.cpu().tolist() == ours.tolist()


def test_an_unknown_architecture_key_is_refused_on_import_in_one_line(modern, tmp_path, capsys):
    """A gpt2train config.json with a key this version does not know (e.g. a newer version's) is a model it cannot
    build: sample.py --init_from says so in one line, exit 2."""
    _, hf_dir = modern
    shutil.copytree(hf_dir, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "sliding_window": 128}))
    with pytest.raises(SystemExit) as exit_info:
        sample.main(["--init_from", str(tmp_path / "hf"), "--max_new_tokens", "1", "--device", "cpu"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "unknown architecture key sliding_window" in err and str(tmp_path / "hf" / "config.json") in err


def test_export_refuses_a_directory_that_is_not_empty_unless_forced(tmp_path, capsys):
    torch.manual_seed(0)
    write_checkpoint(tmp_path / "run" / "ckpt_000003.pt", GPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=16)))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert checkpoint_command.main(["export", str(tmp_path / "run"), str(tmp_path / "hf")]) == 2
    assert capsys.readouterr().err == (
        f"checkpoint.py: error: {tmp_path / 'hf'} exists and is not an empty directory: give another DST, "
        f"or --force to write into it\n"
    )
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["notes.txt"]
    assert checkpoint_command.main(["export", str(tmp_path / "run"), str(tmp_path / "hf"), "--force"]) == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file() and (tmp_path / "hf" / "notes.txt").read_text() == "mine"


def test_export_refuses_a_checkpoint_that_does_not_verify(tmp_path, capsys):
    torch.manual_seed(0)
    path = write_checkpoint(tmp_path / "ckpt_000003.pt", GPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=16)))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte in the weights
    path.write_bytes(bytes(data))
    assert checkpoint_command.main(["export", str(path), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"checkpoint.py: error: {path}") and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "hf").exists()


def deterministic(model):
    """Weights from no random generator: the same bytes under any torch version and machine."""
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.linspace(-1, 1, p.numel()).view_as(p) * 0.02 * (i + 1) ** 0.5)
    return model


# sha256 of each file save_pretrained wrote for deterministic() models before the gpt2train route existed (commit
# 0d33df9): the GPT-2 and GPT-NeoX exports stay byte for byte what they were
STANDARD_EXPORTS = {
    "gpt2": {
        "config.json": "b8c158a291ab4cd38875a955c11d8c191153fecd0431ea9caa7deecc932321c3",
        "generation_config.json": "5cc1a3df40c30643bab00cbfd18610f15970484335d372290da821cb480c5bd6",
        "model.safetensors": "eac543a664062a6f5644f69240ada571a84382248a3ea2268bf468eb2316107e",
        "special_tokens_map.json": "6f50ab5a5a509a1c309d6171f339b196a900dc9c99ad0408ff23bb615fdae7ad",
        "tokenizer.json": "b902d3cf8ac72962d8fd33ec7834d40abf5c3100f3dfd52d8aa8ebeb797c6553",
        "tokenizer_config.json": "65d06bc031a1430185b37a492a1f79dc754470b48cf3ed8e9f43f32ddd78f2ad",
    },
    "gpt_neox": {
        "config.json": "8022a1501c8ed7d6c7085259d5115980d3629df68c42d91f11c9ef2b94c18225",
        "generation_config.json": "5cc1a3df40c30643bab00cbfd18610f15970484335d372290da821cb480c5bd6",
        "model.safetensors": "5f43349128b8161984929372ce505b2867ad9defd9d052faf011ce61a0dd87f7",
        "special_tokens_map.json": "6f50ab5a5a509a1c309d6171f339b196a900dc9c99ad0408ff23bb615fdae7ad",
        "tokenizer.json": "b902d3cf8ac72962d8fd33ec7834d40abf5c3100f3dfd52d8aa8ebeb797c6553",
        "tokenizer_config.json": "65d06bc031a1430185b37a492a1f79dc754470b48cf3ed8e9f43f32ddd78f2ad",
    },
}


@pytest.mark.parametrize("route", list(STANDARD_EXPORTS))
def test_gpt2_and_neox_exports_are_byte_for_byte_what_they_were(route, tmp_path):
    cfg = GPTConfig(
        block_size=32, vocab_size=50304, n_layer=2, n_head=2, n_embd=16, **(NEOX if route != "gpt2" else {})
    )
    assert hf.export_route(cfg) == route
    save_pretrained(deterministic(GPT(cfg)), tmp_path)
    written = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in tmp_path.iterdir()}
    assert written == STANDARD_EXPORTS[route]


def test_train_init_from_a_custom_export_starts_where_the_checkpoint_does(data_dir, tmp_path):
    """train.py --init_from=DIR (a gpt2train export) fine-tunes the checkpoint's weights: the same first loss as
    --init_from=CHECKPOINT on the same batches, and the same second (the same model, the same optimizer groups)."""
    modern = (f"--{k}={v}" for k, v in MODERN.items())
    assert tiny.run(data_dir, tmp_path / "run", "--max_steps=4", *modern) == 0
    assert checkpoint_command.main(["export", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "gpt2train"
    losses = {}
    for name in ("run", "hf"):
        argv = [f"--init_from={tmp_path / name}", f"--data_dir={data_dir}", f"--out_dir={tmp_path / ('ft_' + name)}"]
        # block_size too: a Hugging Face directory's is read only when the model is built, after the data is opened
        fixed = ["--batch_size=4", "--block_size=16", "--max_steps=2", "--eval_interval=0", "--save_interval=0"]
        assert (
            train.main([*argv, *fixed, "--log_interval=0", "--device=cpu", "--dtype=float32", "--compile=False"]) == 0
        )
        losses[name] = train_losses(tmp_path / f"ft_{name}")
    assert list(losses["hf"]) == [1, 2] and losses["hf"] == losses["run"]


def test_the_remote_config_takes_exactly_the_keys_the_export_writes():
    """configuration_gpt2train.py's GPT2TrainConfig has a parameter for each key of GPT2TRAIN_KEYS (and transformers'
    own three), each a GPTConfig key: the two files and hf.py cannot drift apart."""
    import inspect

    from gpt2train.hf_modeling.configuration_gpt2train import GPT2TrainConfig

    params = set(inspect.signature(GPT2TrainConfig.__init__).parameters) - {"self", "kwargs"}
    assert params == {*hf.GPT2TRAIN_KEYS, "tie_word_embeddings", "initializer_range", "use_cache"}
    assert set(hf.GPT2TRAIN_KEYS) <= set(MODEL_KEYS)


def test_a_model_option_the_modeling_code_lacks_is_refused_not_exported_wrong(monkeypatch, tmp_path):
    """A GPTConfig key off its default that GPT2TRAIN_KEYS does not name (here smear, as if model.py had just gained
    it) is refused in one line: no export that loads as another model."""
    monkeypatch.setattr(hf, "GPT2TRAIN_KEYS", tuple(k for k in hf.GPT2TRAIN_KEYS if k != "smear"))
    with pytest.raises(ValueError) as err:
        save_pretrained(GPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=16, smear=True)), tmp_path)
    assert str(err.value) == (
        "save_pretrained: smear=True: not in the exported modeling code yet "
        "(gpt2train/hf_modeling/modeling_gpt2train.py; hf.GPT2TRAIN_KEYS names what it implements)"
    )
    assert list(tmp_path.iterdir()) == []
