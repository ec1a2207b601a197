"""The CUDA paths a CPU can reach, on a CPU-only torch that sees fake GPUs (conftest.fake_gpus: the device
queries are mocked, torch's own argument parsing runs): setup() for device 'auto', 'cuda' and 'cuda:1', under
torchrun and without, then the calls a run makes with the device it picked; bench.gpu's start. And the APIs
newer than the torch floor (devices.MIN_TORCH), each gated: tested by deleting the attribute."""

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from bench import gpu
from gpt2train import devices, headroom, memory, parallel, step
from gpt2train.checkpoint import load_checkpoint
from gpt2train.config import ConfigError, make_config, model_config, parse_args
from gpt2train.devices import peak_flops
from model import GPT
from tiny import run, train_losses


@pytest.fixture
def no_tf32_leak():  # setup() turns TF32 on for CUDA runs: keep it from the other tests
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.mark.parametrize("torchrun", [False, True])
@pytest.mark.parametrize("device", ["auto", "cuda", "cuda:1"])
def test_setup_makes_an_indexed_gpu_current_and_the_run_can_query_it(
    fake_gpus, monkeypatch, no_tf32_leak, device, torchrun
):
    gpus = fake_gpus(2)
    groups = []
    monkeypatch.setattr(parallel.dist, "init_process_group", lambda **kwargs: groups.append(kwargs["backend"]))
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    if torchrun:  # the second process on this node: its GPU is LOCAL_RANK's, whatever the config says
        for key, value in dict(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2").items():
            monkeypatch.setenv(key, value)
    env = parallel.setup(make_config({"device": device}))
    expected = 1 if torchrun or device == "cuda:1" else 0
    assert env.device == f"cuda:{expected}" and gpus.set_to == [expected] and gpus.current == expected
    assert groups == (["nccl"] if torchrun else []) and env.dtype == "bfloat16"
    # what run() and the memory plan then ask of that device
    assert peak_flops(torch.cuda.get_device_name(env.device), env.dtype) == 989e12
    assert headroom.available_memory(env.device) == (70 << 30, f"cuda:{expected}: 70.0 GiB free of 80.0 GiB")
    assert devices.peak_memory(env.kind)[0] == 0


@pytest.mark.parametrize("device, expected", [("auto", 0), ("cuda", 0), ("cuda:1", 1)])
def test_bench_gpu_starts_on_the_gpu_it_names(fake_gpus, monkeypatch, capsys, device, expected):
    gpus = fake_gpus(2)
    monkeypatch.setattr(gpu, "write_random_shards", lambda *a, **k: None)
    monkeypatch.setattr(gpu, "check_train", lambda report, opts, *a: report.add("train", opts.device, "-", "SKIP"))
    checks = ("sigterm_resume", "host_syncs", "sync_debug", "oom", "fsdp_bf16_resume", "ddp_scaling", "1558m_memory")
    for check in checks:
        monkeypatch.setattr(gpu, f"check_{check}", lambda *a: None)  # each runs train.py: not on fake GPUs
    assert gpu.main([f"--device={device}", "--nproc=0"]) == 0
    assert gpus.set_to == [expected]
    out = capsys.readouterr().out
    assert f"train  cuda:{expected}" in out and "on NVIDIA H100 80GB HBM3 x 2" in out


def test_muon_on_a_torch_without_it_is_a_one_line_config_error(monkeypatch):
    monkeypatch.delattr(torch.optim, "Muon")
    with pytest.raises(
        ConfigError,
        match=r"^optimizer='muon' needs torch.optim.Muon \(torch >= 2.9\), which torch "
        r"\S+ lacks: upgrade torch, or use optimizer='adamw'$",
    ):
        make_config({"optimizer": "muon"})
    make_config({"optimizer": "adamw"})  # the default needs nothing new


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_fsdp_compile_failure_on_a_torch_without_reset_iter_state_is_a_one_line_error(monkeypatch, one_rank_group):
    """The failed compile trial leaves FSDP mid-iteration; FSDPModule.reset_iter_state (newer than torch 2.6)
    recovers it. Without it: a one-line error naming the way out, not a failure in the first step."""
    from torch._dynamo.exc import BackendCompilerFailed
    from torch.distributed.fsdp import FSDPModule

    def broken_compile(forward):
        def compiled(*args, **kwargs):
            raise BackendCompilerFailed("inductor", RuntimeError("no working C++ compiler"), None)

        return compiled

    monkeypatch.setattr(torch, "compile", broken_compile)
    monkeypatch.delattr(FSDPModule, "reset_iter_state")
    cfg = make_config(
        {
            "n_layer": 1,
            "n_head": 2,
            "n_embd": 16,
            "block_size": 8,
            "vocab_size": 32,
            "batch_size": 1,
            "compile": True,
            "device": "cpu",
            "dtype": "float32",
            "parallel": "fsdp",
        }
    )
    env = parallel.Env(0, 0, 1, True, "cpu", "float32", "fsdp", (1,))
    model = parallel.shard(GPT(model_config(cfg)), cfg, env)
    loader = SimpleNamespace(B=1)
    with pytest.raises(ConfigError) as error:
        env = env.with_batch(cfg)
        parallel.after_compile_trial(model, step.compile_works(model, cfg, env, loader), env)
    assert str(error.value) == (
        f"torch {torch.__version__} cannot recover FSDP from the failed torch.compile trial "
        "(no FSDPModule.reset_iter_state): set compile=False, or upgrade torch"
    )


def test_a_run_on_apple_mps_puts_no_float64_tensor_on_the_device(fake_device, data_dir, tmp_path, monkeypatch):
    """MPS has no float64: a float64 tensor headed there (the step's token counts, the step's numbers on their way
    to the host) failed every step. A run on MPS (mocked: its availability and memory queries; tensors 'on' it
    live on the CPU, and a float64 one raises MPS's TypeError) trains, evaluates and saves."""
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: 16 << 30)
    with fake_device("mps") as mps:
        assert run(data_dir, tmp_path, "--max_steps=4", "--device=mps", "--dtype=auto") == 0
    assert mps.syncs  # the run read its numbers from the (fake) device
    assert sorted(train_losses(tmp_path)) == [1, 2, 3, 4] and load_checkpoint(tmp_path)["step"] == 4


def test_validation_under_torchrun_waits_for_the_gpu_once_per_micro_batch(fake_device, one_rank_group):
    """Under torchrun the ranks agree before each validation micro-batch whether any got a signal (so a SIGTERM
    abandons the evaluation at once): one collective and one read of its result. Copying the flag to the GPU from
    pageable memory was a second wait per micro-batch. The batches come from pinned memory: no wait."""
    from gpt2train import evaluation
    from model import GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=8, vocab_size=32, n_layer=1, n_head=2, n_embd=16))
    env = parallel.Env(0, 0, 1, True, "cuda:0", "float32")

    class Val:  # 4 batches of 2 rows
        def reset(self):
            self.rng = torch.Generator().manual_seed(0)

        def next_batch(self):
            return tuple(torch.randint(0, 32, (2, 8), generator=self.rng) for _ in range(2))

    with fake_device("cuda:0") as cuda:
        rows = evaluation.read_val_rows(Val(), 4)
        loss = evaluation.val_loss(model, rows, 2, env, lambda: parallel.any_rank(False, env)).loss
    assert math.isfinite(loss)
    assert cuda.syncs == 4 + 1  # each micro-batch's agreement, then the mean's read


def test_the_slot_on_a_gpu_runs_its_rows_in_order_and_writes_one_table_and_one_json(
    fake_gpus, fake_device, monkeypatch, tmp_path, capsys, no_tf32_leak
):
    """python -m bench.gpu --slot on a (fake) H100: what each row runs and how it is judged. The train.py runs and
    the sync debug script are stood in for (they need the GPU): each train row is compared with the plan at the
    micro-batch its run ended at (the 1558m run halved to 8 here), step 1 apart. memory_phases runs, on the CPU
    for the GPU (fake_device) with the allocator's statistics mocked, on a small model standing in for
    gpt2_124m's config."""
    fake_gpus(1)
    small = tmp_path / "small.py"  # gpt2_124m's role, small enough to run here
    small.write_text("n_layer = 1\nn_head = 2\nn_embd = 16\nblock_size = 16\nvocab_size = 50304\ndtype = 'float32'\n")
    monkeypatch.setattr(gpu, "GPT2_124M", small)
    for name, value in (("memory_allocated", 1 << 30), ("max_memory_allocated", 3 << 30)):
        monkeypatch.setattr(torch.cuda, name, lambda device=None, v=value: v)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch, "compile", lambda model, backend=None: model)
    phases = gpu.memory_phases

    def on_the_gpu(*args, **kwargs):
        with fake_device("cuda:0"):
            return phases(*args, **kwargs)

    monkeypatch.setattr(gpu, "memory_phases", on_the_gpu)
    runs = {}

    def run_train(args, out_dir, env, nproc=0, timeout=3600, log=None, script=None):
        assert "train.Checkpointer.save = " in Path(script).read_text()  # train.py without its final checkpoint
        cfg = make_config(parse_args(args))
        micro = 8 if "gpt2_1558m" in args[0] else cfg.batch_size  # an out-of-memory halved 16
        plan = memory.estimate_memory(model_config(cfg), micro, dtype=cfg.dtype).total / 2**20
        runs[Path(out_dir).name] = args
        records = [
            {"step": i + 1, "train_loss": 3.0, "tokens_per_s": 4.5e5, "mfu": 0.39, "micro_batch": micro}
            | {"peak_mem_mb": (1.5 if i == 0 else 0.9) * plan, "peak_reserved_mb": 1.6 * plan}
            for i in range(cfg.max_steps)
        ]
        Path(out_dir).mkdir(parents=True)
        (Path(out_dir) / "summary.json").write_text(json.dumps({"tokens": 1000, "wall_s": 1.0}))
        Path(log).write_text(f"... | compile {'--compile=False' not in args} | world size 1 ...\n")  # train.py's line
        return 0, "", records

    monkeypatch.setattr(gpu, "run_train", run_train)
    found = {"per_step": 1.0, "first": [], "steps": 10, "code": 0}
    issued = {"plain": 0, "masked": 10}
    monkeypatch.setattr(
        gpu, "run_sync_debug", lambda opts, tmp, data, name, *a: (None, {**found, "async_all_reduces": issued[name]})
    )
    import bench.muon

    measured = {"muon_ms": 9.0, "whole_ms": 11.0, "ops": 1520, "aten_events": 6380, "kernels": 1100}
    optimizers = {"torch.optim.Muon": measured, "batched": {**measured, "muon_ms": 2.5, "kernels": 100}}
    monkeypatch.setattr(bench.muon, "compare", lambda device, tiny, reps: {**optimizers, "max_rel_diff": 2e-6})
    assert gpu.main(["--slot", "--device=cuda", f"--out={tmp_path / 'out'}"]) == 0
    out = capsys.readouterr().out
    rows = [line.split("  ")[0] for line in out[out.index("check ") :].splitlines()[2:]]
    assert rows == [
        "environment",
        "124m compiled",
        "124m modern compiled",
        "optimizer step",
        "124m eager",
        "memory by phase",
        "sync debug plain",
        "sync debug masked (torchrun)",
        "1558m eager",
    ]
    assert "NVIDIA H100 80GB HBM3 x 1" in out and "70.0 of 80.0 GiB free" in out
    quiet = {"--eval_interval=0", "--hellaswag_interval=0", "--sample_interval=0", "--save_interval=0"}
    compiled, eager, xl = runs["124m_compiled"], runs["124m_eager"], runs["1558m_eager"]
    assert all(quiet <= set(args) and "--device=cuda:0" in args for args in runs.values())
    assert {"--batch_size=64", "--total_batch_size=65536", "--max_steps=40"} <= set(compiled)
    assert "--compile=False" not in compiled and {"--max_steps=6", "--compile=False"} <= set(eager)
    modern = runs["124m_modern_compiled"]
    assert modern[0].endswith("gpt2_124m_modern.py") and "--compile=False" not in modern
    assert {"--batch_size=64", "--total_batch_size=65536", "--max_steps=20"} <= set(modern)
    assert xl[0].endswith("gpt2_1558m.py") and "--memory_check=False" in xl
    assert {"--batch_size=16", "--total_batch_size=32768", "--max_steps=3", "--compile=False"} <= set(xl)
    result = json.loads((tmp_path / "out" / "slot.json").read_text())
    statuses = {row["check"]: row["status"] for row in result["rows"]}
    assert statuses == {
        "environment": "INFO",
        "124m compiled": "PASS",
        "124m modern compiled": "PASS",
        "optimizer step": "PASS",
        "124m eager": "PASS",
        "memory by phase": "INFO",
        "sync debug plain": "PASS",
        "sync debug masked (torchrun)": "PASS",
        "1558m eager": "PASS",
    }
    rows = {row["check"]: row["result"] for row in result["rows"]}
    assert "compile True" in rows["124m compiled"] and "compile False" in rows["124m eager"]
    assert "torch.optim.Muon 9.00 ms (whole step 11.00), 1100 kernels; batched 2.50 ms" in rows["optimizer step"]
    assert "planned 30.57 GiB at micro-batch 64" in rows["124m modern compiled"]  # Muon+AdamW's plan, not AdamW's
    assert "at micro-batch 8; measured step 1 " in rows["1558m eager"] and "(1.50x), steps >= 3 " in rows["1558m eager"]
    assert set(result["memory by phase"]) == {"eager first", "eager", "compiled first", "compiled"}
    assert {k: v for k, v in result["memory by phase"]["compiled"].items() if not k.endswith("_s")} == {
        "held": 0.0,  # the mocked statistics: 1 GiB allocated, a 3 GiB peak
        "fwd_peak": 2.0,
        "bwd_peak": 2.0,
    }
    assert "micro-batch 64, GiB held for backward/forward peak/backward peak: eager first 0.00/2.00/2.00" in out
