"""step.py: the torch.compile trial before the first step (a failure falls back to eager and leaves no trace, the
loop's call shape, out of memory halves the micro-batch and is never called a compile failure).

Runs use tests/tiny.py's tiny model on the Markov-chain data of conftest's data_dir.
"""

import torch

from tiny import expect_exit, run, train_losses


def fake_compile(monkeypatch, error):
    """torch.compile returns a model that raises `error` on its first call, as a compile problem does."""

    class BrokenCompiled(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self._orig_mod = model

        def forward(self, *args, **kwargs):
            raise error

    monkeypatch.setattr(torch, "compile", BrokenCompiled)


def test_compile_failure_falls_back_to_eager(data_dir, tmp_path, monkeypatch, capsys):
    from torch._dynamo.exc import BackendCompilerFailed
    from torch._inductor.exc import CppCompileError

    fake_compile(
        monkeypatch, BackendCompilerFailed("inductor", CppCompileError(["g++"], "no working C++ compiler"), None)
    )
    assert run(data_dir, tmp_path / "compiled", "--max_steps=4", "--compile=True", "--dropout=0.1") == 0
    out = capsys.readouterr().out
    assert "torch.compile failed (BackendCompilerFailed: " in out and "training eagerly" in out
    assert run(data_dir, tmp_path / "eager", "--max_steps=4", "--dropout=0.1") == 0
    assert train_losses(tmp_path / "compiled") == train_losses(tmp_path / "eager")  # the trial left no trace


def test_the_compile_trial_says_so_and_calls_the_model_as_the_loop_does(data_dir, tmp_path, monkeypatch, capsys):
    """The trial compile is the silent wait before the first step, so a line says it. Its inputs and targets are
    distinct tensors as in the loop: dynamo guards on `idx is targets`, and a trial passing one tensor as both
    compiled graphs the loop never ran, then the first evaluation and step compiled again."""
    same = []

    class RecordingCompiled(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self._orig_mod = model

        def forward(self, idx, targets=None, **kwargs):
            same.append(idx is targets)
            return self._orig_mod(idx, targets, **kwargs)

    monkeypatch.setattr(torch, "compile", RecordingCompiled)
    assert run(data_dir, tmp_path, "--max_steps=2", "--compile=True") == 0
    assert "compiling the model (torch.compile)" in capsys.readouterr().out
    assert same and not any(same)


def test_out_of_memory_under_compile_is_not_called_a_compile_failure(data_dir, tmp_path, monkeypatch, capsys):
    """Out of memory in the compile trial at every micro-batch: halved down to 1 (as a step does), then one line."""
    fake_compile(monkeypatch, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"))
    expect_exit(4, run, data_dir, tmp_path, "--max_steps=4", "--compile=True")
    out, err = capsys.readouterr()
    assert "torch.compile failed" not in out and "Traceback" not in err
    assert "the torch.compile trial: out of memory at micro-batch 2: trying micro-batch 1" in out
    assert err.endswith(
        "train.py: error: the torch.compile trial: out of memory at micro-batch 1; try activation_checkpointing=True, "
        "parallel='fsdp' or a smaller block_size\n"
    )
