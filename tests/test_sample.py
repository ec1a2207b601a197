"""sample.py: seeded sampling is reproducible, greedy equals model.generate, bad checkpoints are one-line errors."""

import io
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from gpt2train.assets import get_tokenizer
from gpt2train.bpe import HFTokenizer, load_tokenizer
from gpt2train.checkpoint import save_checkpoint
from gpt2train.generation import Sampling, generate
from gpt2train.hf import from_pretrained, save_pretrained
from model import GPT, GPTConfig
from sample import SEPARATOR, main, read_prompt, stream_samples

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def enc():
    return get_tokenizer()


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    # vocab 50257: every id the model can emit is a real token, so decoded texts compare exactly
    return GPT(GPTConfig(block_size=64, vocab_size=50257, n_layer=2, n_head=2, n_embd=32)).eval()


def write_checkpoint(path, model, state, step):
    """A training checkpoint in the project's format (CONTRACTS: checkpoint dict keys) of `state`, model's weights or
    others, with its sha256 sidecar."""
    record = {"model": state, "model_args": asdict(model.config), "config": {}, "step": step, "optimizer": None}
    record.update(scaler=None, loader={}, rng={}, val_loss=None, format="gpt2-train-ckpt-v1")
    save_checkpoint(path, record)
    return path


@pytest.fixture(scope="module")
def ckpt(model, tmp_path_factory):
    """A training checkpoint of `model`."""
    return write_checkpoint(tmp_path_factory.mktemp("run") / "ckpt_000010.pt", model, model.state_dict(), 10)


def run_main(capsys, *argv):
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def test_same_seed_same_text_and_another_seed_differs(ckpt, capsys):
    args = [
        "--ckpt",
        str(ckpt),
        "--prompt",
        "Hello",
        "--max_new_tokens",
        "12",
        "--num_samples",
        "2",
        "--temperature",
        "1.0",
        "--device",
        "cpu",
    ]
    first = run_main(capsys, *args, "--seed", "3")
    assert first == run_main(capsys, *args, "--seed", "3")
    assert first != run_main(capsys, *args, "--seed", "4")
    samples = first.split(SEPARATOR + "\n")
    assert len(samples) == 3 and samples[-1] == ""  # two samples, each closed by the separator
    assert all(s.startswith("Hello") for s in samples[:2])
    assert samples[0] != samples[1]  # the samples of one run are drawn one after another, not repeated


def test_out_dir_means_its_latest_checkpoint(ckpt, capsys):
    args = ["--prompt", "Hi", "--max_new_tokens", "8", "--device", "cpu", "--seed", "1"]
    assert run_main(capsys, "--ckpt", str(ckpt.parent), *args) == run_main(capsys, "--ckpt", str(ckpt), *args)


def test_greedy_equals_model_generate(model, enc, ckpt, capsys):
    prompt = "The meaning of life is"
    idx = torch.tensor([enc.encode(prompt)])
    expected = prompt + enc.decode(generate(model, idx, 20, Sampling(temperature=0))[0, idx.shape[1] :].tolist())
    assert stream_samples(model, enc, prompt, Sampling(temperature=0), torch.Generator(), 20, io.StringIO()) == expected
    out = run_main(
        capsys,
        "--ckpt",
        str(ckpt),
        "--prompt",
        prompt,
        "--max_new_tokens",
        "20",
        "--temperature",
        "0",
        "--device",
        "cpu",
    )
    assert out == expected + "\n" + SEPARATOR + "\n"


class ScriptedModel:
    """Stands in for GPT: generate_stream yields the tokens of a fixed text, one per step."""

    def __init__(self, tokens):
        self.tokens = tokens

    def eval(self):
        return self

    def generate_stream(self, idx, max_new_tokens, **kwargs):
        for t in self.tokens[:max_new_tokens]:
            yield torch.tensor([t])


@pytest.fixture(autouse=True)
def scripted_models_stream_their_own_tokens(monkeypatch):
    """sample.py decodes with generation.generate_stream(model, ...); a ScriptedModel yields its tokens instead."""
    import sample

    real = sample.generate_stream

    def stream(model, idx, max_new_tokens, *args):
        if isinstance(model, ScriptedModel):
            return model.generate_stream(idx, max_new_tokens)
        return real(model, idx, max_new_tokens, *args)

    monkeypatch.setattr(sample, "generate_stream", stream)


def test_streams_token_by_token_and_joins_split_utf8(enc):
    text = " naïve café 😀 — 日本語"
    tokens = enc.encode(text)
    # at least one token is a fragment of a multi-byte character that can't be decoded alone
    assert any(not _decodes(enc.decode_single_token_bytes(t)) for t in tokens)
    writes = []

    class Out(io.StringIO):
        def write(self, s):
            writes.append(s)
            return super().write(s)

    out = Out()
    assert stream_samples(ScriptedModel(tokens), enc, "Prompt:", Sampling(), torch.Generator(), len(tokens), out) == (
        "Prompt:" + text
    )
    assert out.getvalue() == "Prompt:" + text
    assert len(writes) > len(tokens)  # written as generated, not once at the end


def _decodes(b):
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_prompt_from_file_stdin_or_default(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("from a file")
    assert read_prompt(f"FILE:{path}") == "from a file"
    assert read_prompt("plain text") == "plain text"
    assert read_prompt(None, stdin=io.StringIO("piped in")) == "piped in"  # StringIO is not a tty

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    assert read_prompt(None, stdin=Terminal("ignored")) == ""  # then generation starts at <|endoftext|>


def test_empty_prompt_starts_a_new_document(model, enc):
    class Recording(ScriptedModel):
        def generate_stream(self, idx, max_new_tokens, **kwargs):
            self.idx = idx
            yield from super().generate_stream(idx, max_new_tokens, **kwargs)

    m = Recording(enc.encode(" x"))
    stream_samples(m, enc, "", Sampling(), torch.Generator(), 1, io.StringIO())
    assert m.idx.tolist() == [[enc.eot_token]]


@pytest.mark.slow
def test_stdin_prompt_via_subprocess(ckpt):
    proc = subprocess.run(
        [sys.executable, "sample.py", "--ckpt", str(ckpt), "--max_new_tokens", "5", "--device", "cpu"],
        cwd=ROOT,
        input="Once upon a time",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Once upon a time") and proc.stdout.endswith(SEPARATOR + "\n")


def _bad_checkpoints(tmp_path, ckpt):
    truncated = tmp_path / "truncated.pt"
    data = ckpt.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    foreign = tmp_path / "notes.pt"
    foreign.write_text("this is not a checkpoint\n")
    return {"missing": tmp_path / "nope" / "ckpt.pt", "truncated": truncated, "foreign": foreign}


@pytest.mark.parametrize("kind", ["missing", "truncated", "foreign"])
def test_bad_checkpoint_is_a_one_line_error(tmp_path, ckpt, kind, capsys):
    path = _bad_checkpoints(tmp_path, ckpt)[kind]
    with pytest.raises(SystemExit) as exit_info:  # as argparse exits on a bad flag
        main(["--ckpt", str(path), "--prompt", "Hi", "--device", "cpu"])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert len(captured.err.strip().splitlines()) == 1, captured.err
    assert str(path) in captured.err
    assert captured.out == ""


@pytest.mark.slow
def test_bad_checkpoint_from_the_shell_has_no_traceback(tmp_path, ckpt):
    path = _bad_checkpoints(tmp_path, ckpt)["truncated"]
    proc = subprocess.run(
        [sys.executable, "sample.py", "--ckpt", str(path), "--device", "cpu"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("sample.py: error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert str(path) in proc.stderr
    assert proc.stdout == ""


@pytest.fixture(scope="module")
def hf_dir_with_tokenizer(byte_level_tokenizer_json, tmp_path_factory):
    """A Hugging Face model directory carrying its own tokenizer.json (as an imported Pythia does)."""
    enc = load_tokenizer(byte_level_tokenizer_json.parent)
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=enc.n_vocab, n_layer=2, n_head=2, n_embd=32))
    path = tmp_path_factory.mktemp("hf_with_tokenizer")
    save_pretrained(model, path)
    shutil.copy(byte_level_tokenizer_json, path / "tokenizer.json")
    return path


def test_model_dir_with_tokenizer_json_samples_with_that_tokenizer(hf_dir_with_tokenizer, tmp_path, capsys):
    enc = load_tokenizer(hf_dir_with_tokenizer)
    assert isinstance(enc, HFTokenizer)
    model = from_pretrained(str(hf_dir_with_tokenizer)).eval()
    prompt = "Once upon a time, naïve 😀"
    idx = torch.tensor([enc.encode(prompt)])
    expected = prompt + enc.decode(generate(model, idx, 20, Sampling(temperature=0))[0, idx.shape[1] :].tolist())
    args = ["--prompt", prompt, "--max_new_tokens", "20", "--temperature", "0", "--device", "cpu"]
    assert run_main(capsys, "--init_from", str(hf_dir_with_tokenizer), *args) == expected + "\n" + SEPARATOR + "\n"
    # a checkpoint fine-tuned from that directory samples with the same tokenizer
    ckpt = tmp_path / "ckpt_000001.pt"
    save_checkpoint(
        ckpt,
        {
            "model": model.state_dict(),
            "model_args": asdict(model.config),
            "step": 1,
            "val_loss": None,
            "config": {"init_from": str(hf_dir_with_tokenizer)},
            "format": "gpt2-train-ckpt-v1",
        },
    )
    assert run_main(capsys, "--ckpt", str(ckpt), *args) == expected + "\n" + SEPARATOR + "\n"


def test_empty_prompt_starts_at_the_model_tokenizers_endoftext(hf_dir_with_tokenizer):
    enc = load_tokenizer(hf_dir_with_tokenizer)

    class Recording(ScriptedModel):
        def generate_stream(self, idx, max_new_tokens, **kwargs):
            self.idx = idx
            yield from super().generate_stream(idx, max_new_tokens, **kwargs)

    m = Recording(enc.encode(" x"))
    stream_samples(m, enc, "", Sampling(), torch.Generator(), 1, io.StringIO())
    assert m.idx.tolist() == [[0]]  # GPT-NeoX's <|endoftext|>, not GPT-2's 50256


def test_zeroed_bytes_in_the_embedding_are_a_one_line_error(tmp_path, ckpt, model, capsys):
    """Damage that torch.load cannot see (the weights are just other numbers) fails the sha256 check."""
    shutil.copy(ckpt, tmp_path / ckpt.name)
    shutil.copy(ckpt.with_name(ckpt.name + ".sha256"), tmp_path)
    damaged = tmp_path / ckpt.name
    wte = model.transformer.wte.weight.detach().numpy().tobytes()
    offset = damaged.read_bytes().find(wte)
    with open(damaged, "r+b") as f:
        f.seek(offset + 4096)
        f.write(bytes(256))
    with pytest.raises(SystemExit) as exit_info:
        main(["--ckpt", str(damaged), "--prompt", "Hi", "--device", "cpu"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f": error: {damaged}: damaged: its sha256 is " in err and err.count("\n") == 1, err


@pytest.mark.parametrize("flag, value", [("--temperature", "nan"), ("--temperature", "inf"), ("--top_p", "nan")])
def test_nan_sampling_settings_are_one_line_errors(ckpt, capsys, flag, value):
    with pytest.raises(SystemExit) as exit_info:
        main(["--ckpt", str(ckpt), "--prompt", "Hi", "--device", "cpu", flag, value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    # argparse's way, as for any bad flag: the usage, then one error line
    assert err.startswith("usage: ") and f": error: {flag} must be" in err.splitlines()[-1] and "Traceback" not in err


# ----------------------------------------------------------------------------- start-up errors are one line


def error_of(capsys, *argv):
    """sample.main's exit status 2 and its one error line (no traceback)."""
    with pytest.raises(SystemExit) as e:
        main([*argv, "--device", "cpu", "--max_new_tokens", "2", "--prompt", "x"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_integer_weights_in_a_model_directory_are_refused(hf_dir_with_tokenizer, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    shutil.copytree(hf_dir_with_tokenizer, tmp_path / "hf")
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    weights["transformer.h.0.mlp.c_fc.weight"] = (weights["transformer.h.0.mlp.c_fc.weight"] * 100).to(torch.int8)
    save_file(weights, tmp_path / "hf" / "model.safetensors")
    assert "transformer.h.0.mlp.c_fc.weight holds torch.int8 values, expected floating-point weights" in error_of(
        capsys, "--init_from", str(tmp_path / "hf")
    )


class Opaque:
    """A class torch's weights-only unpickler does not know."""


def test_a_pickled_object_in_pytorch_model_bin_is_one_line_that_does_not_suggest_weights_only_false(
    hf_dir_with_tokenizer, tmp_path, capsys
):
    shutil.copytree(hf_dir_with_tokenizer, tmp_path / "hf")
    (tmp_path / "hf" / "model.safetensors").unlink()
    torch.save({"x": Opaque()}, tmp_path / "hf" / "pytorch_model.bin")  # not a tensor: never unpickled
    err = error_of(capsys, "--init_from", str(tmp_path / "hf"))
    assert f"{tmp_path / 'hf' / 'pytorch_model.bin'}: not a readable weights file (UnpicklingError" in err
    assert "weights_only=False" not in err


def test_a_broken_tokenizer_json_is_one_line_naming_it(hf_dir_with_tokenizer, tmp_path, capsys):
    shutil.copytree(hf_dir_with_tokenizer, tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE"')
    assert f"{tmp_path / 'hf' / 'tokenizer.json'}: not a readable tokenizer.json (" in error_of(
        capsys, "--init_from", str(tmp_path / "hf")
    )


def test_a_checkpoint_without_model_args_is_one_line(model, tmp_path, capsys):
    save_checkpoint(
        tmp_path / "ckpt_000001.pt",
        {"model": model.state_dict(), "config": {}, "step": 1, "format": "gpt2-train-ckpt-v1"},
    )
    assert "ckpt_000001.pt: incomplete gpt2-train checkpoint: no 'model_args'" in error_of(
        capsys, "--ckpt", str(tmp_path / "ckpt_000001.pt")
    )


def test_a_sample_runs_on_past_endoftext_unless_stop_at_eot(enc, ckpt, capsys, monkeypatch):
    """nanoGPT's default: the next document follows <|endoftext|>; --stop_at_eot ends the sample there, as
    transformers' generate() stops at its eos token."""
    tokens = enc.encode(" Hello.") + [enc.eot_token] + enc.encode(" The next document")
    text = stream_samples(ScriptedModel(tokens), enc, "P:", Sampling(), torch.Generator(), 20, io.StringIO())
    assert text == "P: Hello.<|endoftext|> The next document"
    out = io.StringIO()
    assert (
        stream_samples(ScriptedModel(tokens), enc, "P:", Sampling(eos_token=enc.eot_token), torch.Generator(), 20, out)
        == "P: Hello."
    )
    assert out.getvalue() == "P: Hello."
    import sample

    seen = []
    monkeypatch.setattr(
        sample, "stream_samples", lambda model, enc, prompt, sampling, *a: seen.append(sampling.eos_token)
    )
    for flags in ([], ["--stop_at_eot"]):
        run_main(capsys, "--ckpt", str(ckpt), "--prompt", "Hi", "--device", "cpu", *flags)
    assert seen == [None, enc.eot_token]


def test_a_model_with_non_finite_weights_is_a_one_line_error(model, tmp_path, capsys):
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["transformer.h.1.mlp.c_fc.weight"][0, 0] = float("nan")  # a diverged run's checkpoint
    write_checkpoint(tmp_path / "ckpt_000020.pt", model, state, 20)
    err = error_of(capsys, "--ckpt", str(tmp_path))
    assert "error: the model's weights are not finite (transformer.h.1.mlp.c_fc.weight holds NaN or inf)" in err


@pytest.mark.parametrize("temperature", ["1.0", "0"])
def test_finite_weights_whose_logits_overflow_are_a_one_line_error(model, tmp_path, capsys, temperature):
    """A diverged run's weights can be finite yet so large that the forward overflows (audit 6 NANB3: lr 1e30):
    torch.multinomial's traceback on NaN probabilities; greedy, an argmax of NaNs, garbage text."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["transformer.ln_f.weight"].fill_(1e38)  # finite (fp32 holds 3.4e38), but ln_f's output overflows to inf
    state["transformer.ln_f.bias"].fill_(3e38)  # and the head's dot products to inf - inf
    write_checkpoint(tmp_path / "ckpt_000020.pt", model, state, 20)
    err = error_of(capsys, "--ckpt", str(tmp_path), "--temperature", temperature)
    assert "error: the model's logits are not finite" in err
