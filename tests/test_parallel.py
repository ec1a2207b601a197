"""parallel.py: how the processes are arranged (setup, the mesh, the rank spans in messages) and the batches copied
to the device. Sharded and DDP training end to end are in test_fsdp.py and test_train.py."""

from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from gpt2train import layout, parallel, step
from gpt2train.config import ConfigError, TrainConfig, make_config


def test_cuda_batches_are_copied_from_pinned_memory_without_waiting():
    """From pageable memory a host->GPU copy waits for the GPU's queued work: one host sync per micro-batch."""
    calls = []

    class HostTensor:
        def pin_memory(self):
            calls.append("pin")
            return self

        def to(self, device, non_blocking=False):
            calls.append((device, non_blocking))
            return device

    assert step.to_device((HostTensor(), HostTensor()), "cuda:3") == ("cuda:3", "cuda:3")
    assert calls == ["pin", ("cuda:3", True)] * 2
    x = torch.zeros(2, 3, dtype=torch.long)
    assert step.to_device((x,), "cpu")[0] is x  # the CPU path is untouched


def test_process_group_timeout_is_the_config_key(monkeypatch):
    """A slow rank-0 save must not outlast the collective timeout the other ranks wait under."""
    calls = []
    monkeypatch.setattr(parallel.dist, "init_process_group", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    env = parallel.setup(make_config({"device": "cpu", "dtype": "float32", "dist_timeout_minutes": 45}))
    assert env.distributed and calls == [{"backend": "gloo", "timeout": timedelta(minutes=45)}]
    assert TrainConfig().dist_timeout_minutes == 30
    with pytest.raises(ConfigError, match="'dist_timeout_minutes' must be > 0; got 0"):
        make_config({"dist_timeout_minutes": 0})


def test_span_of_ranks():
    assert parallel.rank_ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8" and parallel.rank_ranges([3]) == "3"


def test_mesh_shapes_and_bad_shard_size():
    assert layout.mesh_shape("fsdp", None, 16, 8) == (16,)
    assert layout.mesh_shape("hsdp", None, 16, 8) == (2, 8)  # default: shard within a node, replicate across
    assert layout.mesh_shape("hsdp", 4, 16, 8) == (4, 4)
    with pytest.raises(ConfigError, match=r"shard_size=3 does not divide the world size 16"):
        layout.mesh_shape("hsdp", 3, 16, 8)


def test_sharded_float16_is_a_config_error(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="parallel='fsdp' trains in bfloat16 or float32, not float16"):
        parallel.setup(make_config(dict(parallel="fsdp", dtype="float16", device="cpu")))
    assert not dist.is_initialized()


def test_out_of_memory_in_the_compile_trial_under_torchrun_is_a_one_line_halt(monkeypatch):
    """Ranks cannot change micro-batch together (the others may wait in DDP's all-reduce): an out-of-memory in
    the compile trial under torchrun stops the run with one line naming settings that fit."""
    from gpt2train.config import model_config
    from gpt2train.files import Halt
    from model import GPT

    class OutOfMemory(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self._orig_mod = model

        def forward(self, *args, **kwargs):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(torch, "compile", OutOfMemory)
    keys = dict(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=32, device="cpu", dtype="float32")
    cfg = make_config({**keys, "batch_size": 4, "total_batch_size": 64, "compile": True})  # 4 x 2 accumulation
    env = parallel.Env(0, 0, 1, True, "cpu", "float32")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(Halt) as halt:
            compiled_by_trial(GPT(model_config(cfg)), cfg, env)
    finally:
        dist.destroy_process_group()
    assert str(halt.value) == (
        "the torch.compile trial: out of memory at micro-batch 4 under torchrun (ranks cannot change micro-batch "
        "together mid-run); try batch_size=2 with 4 accumulation steps, activation_checkpointing=True, "
        "parallel='fsdp' or a smaller block_size"
    )


def compiled_by_trial(model, cfg, env):
    """What run() makes of the bare model: parallelize(), then the compile trial at micro-batch cfg.batch_size."""
    compiled = parallel.parallelize(model, cfg, env)
    loader = SimpleNamespace(B=cfg.batch_size, set_batch_size=None)  # a trial that must halve it fails
    env = env.with_batch(cfg)
    return parallel.after_compile_trial(compiled, step.compile_works(compiled, cfg, env, loader), env)


@pytest.fixture
def process_modes():
    """Restores torch's deterministic mode, which make_compile_deterministic sets for the rest of a process."""
    mode, fill = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    yield
    torch.use_deterministic_algorithms(mode)
    torch.utils.deterministic.fill_uninitialized_memory = fill


@pytest.mark.slow
def test_a_compiled_cpu_run_adds_no_gradient_with_atomic_adds(process_modes):
    """Issue 38: two identical bf16 + compile runs on a CPU drifted apart from a few steps on: Inductor's kernel for
    the token embedding's gradient added repeated ids' rows with atomic adds from several threads, in whatever
    order the threads ran. The code Inductor generates for the trial step (the graphs the loop runs) has none."""
    from torch._inductor.utils import run_and_get_code  # what torch's own tests read generated code with

    from gpt2train.config import model_config
    from model import GPT

    cfg = make_config(
        dict(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=64, batch_size=2, compile=True, eval_interval=0)
    )
    env = parallel.Env(0, 0, 1, False, "cpu", "bfloat16")
    # generate, not load, the code; Inductor's own patch (monkeypatch's undo deletes a config it did not find in the
    # module's __dict__, which hides it from every later compile in this process: pytest >= 9.2)
    with torch._inductor.config.patch(fx_graph_cache=False):
        model, code = run_and_get_code(compiled_by_trial, GPT(model_config(cfg)), cfg, env)
    assert parallel.is_compiled(model) and code
    assert not [c for c in code if "atomic_add" in c]


@pytest.mark.slow
@pytest.mark.parametrize("torchrun", [False, True])
def test_under_torchrun_a_command_ends_without_the_interpreters_finalization(torchrun):
    """Issue 58: DDP keeps the gloo process group's worker threads alive past destroy_process_group, and one that
    drops a collective's tensor while the interpreter finalizes takes the GIL there, which aborts the rank after a
    finished run (`terminate called without an active exception`, under load). Under torchrun exit_process ends
    a finished run with os._exit, its output flushed: no finalization (no atexit handler runs). A failed rank, and
    a plain process, exit as before (an instant exit of a failed rank let torchrun stop rank 0 before its line)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env.update({"PYTHONPATH": str(root), **({"RANK": "0", "WORLD_SIZE": "1"} if torchrun else {})})
    program = (
        "import atexit, sys; from gpt2train.parallel import exit_process; "
        "atexit.register(lambda: print('finalized')); "
        "arg = sys.argv[1]; "
        "exit_process(lambda: print('ran', end='') or int(arg) if arg.isdigit() else sys.exit(arg))"
    )
    for arg, status in (("0", 0), ("3", 3), ("bad input", 1)):
        done = subprocess.run([sys.executable, "-c", program, arg], env=env, capture_output=True, text=True)
        assert done.returncode == status and done.stdout.startswith("ran") == arg.isdigit(), done
        assert ("finalized" in done.stdout) != (torchrun and status == 0), done.stdout
        assert arg.isdigit() or done.stderr.strip() == "bad input"
