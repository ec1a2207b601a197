"""dryrun.py: the dry run (fake tensors + the fake process group) and the memory fixes it proves: FSDP reduce-scatters
every micro-step, DDP's gradients stay bucket views, the plan follows the configured optimizer; every shipped
config is dry-run at its intended world size."""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import dryrun
from dryrun import dry_run
from gpt2train import headroom, memory, optim, parallel, step
from gpt2train.config import ConfigError, make_config, model_config, parse_args
from gpt2train.memory import GiB, estimate_memory
from model import GPT

ROOT = Path(__file__).resolve().parent.parent
# a model whose units are small next to the whole: a no-sync accumulation would hold every unit's fp32 gradient
DEEP = dict(
    n_layer=8,
    n_head=2,
    n_embd=64,
    block_size=32,
    vocab_size=128,
    batch_size=2,
    compile=False,
    dtype="bfloat16",
    data_dir=".",
    out_dir="unused",
)
# each shipped config's intended world size (its header's torchrun / sbatch line)
WORLD = {
    "shakespeare_cpu": 1,
    "gpt2_124m": 8,
    "gpt2_124m_modern": 8,
    "gpt2_1558m": 8,
    "gpt3_125m": 8,
    "gpt3_350m": 8,
    "gpt3_760m": 8,
    "gpt3_1p3b": 8,
    "gpt3_2p7b": 8,
    "gpt3_6p7b": 8,
    "pythia_160m": 8,
    "pythia_6p9b": 8,
    "neox_20b": 64,
    "sft_gpt2": 1,
}  # sft_gpt2: GPT-2 124M's shape, as the config's keys give it


def test_every_shipped_config_has_an_intended_world_size():
    # modern: recipe knobs only, dry-run as gpt2_124m_modern; chat_demo: the shape of out/shakespeare, a CPU run
    overlays = {"modern", "chat_demo"}
    assert {p.stem for p in (ROOT / "configs").glob("*.py")} - overlays == set(WORLD)


@pytest.mark.slow  # ~30 s each here: a dry run of 8 layers
@pytest.mark.parametrize("parallel_mode,world_size", [("fsdp", 4), ("hsdp", 8)])
def test_sharded_accumulation_never_holds_whole_model_fp32_gradients(parallel_mode, world_size):
    """set_requires_gradient_sync(False) kept every unit's unsharded fp32 gradient until the last micro-step."""
    cfg = make_config({**DEEP, "parallel": parallel_mode, "total_batch_size": 2 * 32 * world_size * 3, "shard_size": 4})
    whole_grads = sum(p.numel() for p in GPT(model_config(cfg)).parameters()) * 4
    sim = dry_run(cfg, world_size)  # shards of 4 ranks: a quarter of the gradients, plus a unit or two gathered
    # measured: 1.1x whole_grads here; the whole unsharded fp32 gradients that no-sync keeps made it 2.1x
    assert sim.total - sim.parts["params"] - sim.parts["optimizer"] < 1.5 * whole_grads


@pytest.mark.slow
def test_dry_run_of_ddp_says_its_buckets_are_modelled_and_matches_the_plan():
    cfg = make_config({**DEEP, "total_batch_size": 2 * 32 * 2 * 2, "dtype": "float32"})
    plan, sim, text = dryrun.report(cfg, world_size=2)
    assert "DDP modelled" in text and dryrun.NOT_SIMULATED in text
    whole = sum(p.numel() for p in GPT(model_config(cfg)).parameters()) * 4
    assert sim.parts["params"] == sim.parts["grads"] == plan.params == plan.grads == whole  # one gradient copy
    assert sim.parts["optimizer"] == pytest.approx(plan.optimizer, rel=1e-3)  # + AdamW's step counters


def test_ddp_gradients_stay_bucket_views_through_no_sync_micro_steps(tmp_path):
    """zero_grad(set_to_none=True) freed them: each no-sync micro-step then allocated a second copy beside DDP's
    buckets."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        cfg = make_config({**DEEP, "dtype": "float32", "total_batch_size": 2 * 32 * 2})
        env = parallel.Env(0, 0, 1, True, "cpu", "float32")
        raw = GPT(model_config(cfg))
        model = parallel.parallelize(raw, cfg, env)
        optimizer = optim.build_optimizer(raw, cfg)
        x = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))

        class Batches:
            def next_batch(self):
                return x, x

        def grad_storages():
            return {p.grad.untyped_storage().data_ptr() for p in raw.parameters() if p.grad is not None}

        few = len(list(raw.parameters())) // 4  # DDP's buckets (it rebuilds them once, after the first backward)
        assert 0 < len(grad_storages()) < few  # views of a few flat buckets from the start
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        for _ in range(2):
            step.micro_batches(model, Batches(), 2, scaler, env, micro_steps=[0])  # no sync
            assert len(grad_storages()) < few
            step.micro_batches(model, Batches(), 2, scaler, env, micro_steps=[1])
            optimizer.step()
            optimizer.zero_grad(set_to_none=not parallel.keeps_grads(env))
            assert len(grad_storages()) < few
    finally:
        dist.destroy_process_group()


def test_plan_uses_the_configured_optimizer():
    cfg = make_config({**DEEP, "optimizer": "muon"})
    kwargs = memory.plan_kwargs(cfg, parallel.Env(0, 0, 1, False, "cpu", "bfloat16"))
    plan = estimate_memory(model_config(cfg), cfg.batch_size, **kwargs)
    assert plan.optimizer_name == "Muon+AdamW"
    assert plan.optimizer == estimate_memory(model_config(cfg), 2, optimizer="muon").optimizer


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(WORLD))
def test_shipped_config_dry_runs_at_its_world_size_within_15_percent_of_the_plan(name):
    """At the config's width, micro-batch, accumulation and world size, 2 of its layers (the time is per layer;
    docs/dry-run.md has the whole models): the plan agrees with the simulation, and the whole model's plan fits
    80 GiB."""
    cfg = make_config(parse_args([str(ROOT / "configs" / f"{name}.py")]))
    cfg, _ = dryrun.resolve_checkpointing(cfg, WORLD[name])  # 'auto': as the whole model's plan chooses on 80 GiB
    assert headroom.with_margin(dryrun.dry_run_plan(cfg, WORLD[name]).total) < 80 * GiB
    short = make_config({**vars(cfg), "n_layer": max(2, cfg.pipeline_parallel)})  # a block per pipeline stage
    plan, sim, _ = dryrun.report(short, WORLD[name])
    assert plan.total == pytest.approx(sim.total, rel=0.15)


def test_memory_check_on_a_gpu_keeps_the_margin(monkeypatch):
    """On CUDA a plan fits when plan x 1.05 + 1.5 GiB <= free memory (what neither plan nor dry run sees: CUDA
    context, NCCL, fragmentation); one byte less is refused, naming the margin."""
    cfg = make_config({**DEEP, "batch_size": 2})
    env = parallel.Env(0, 0, 1, False, "cuda:0", "bfloat16")
    plan = estimate_memory(model_config(cfg), 2, **memory.plan_kwargs(cfg, env)).total
    need = headroom.with_margin(plan)
    assert need == int(plan * 1.05) + 3 * GiB // 2
    monkeypatch.setattr(headroom, "available_memory", lambda device: (need, f"{device}: free"))
    assert memory.resolve_batch_size(cfg, env, model_config(cfg)).batch_size == 2
    monkeypatch.setattr(headroom, "available_memory", lambda device: (need - 1, f"{device}: free"))
    with pytest.raises(ConfigError, match=r"a plan may use .* GiB: plan x 1.05 \+ 1.5 GiB <= free"):
        memory.resolve_batch_size(cfg, env, model_config(cfg))


@pytest.mark.parametrize("name", ["gpt3_6p7b", "pythia_6p9b"])
def test_the_6b_presets_recompute_nothing_where_the_plan_with_its_margin_fits(name):
    """Their plan without activation checkpointing (micro-batch 4, FSDP over 8) fits 80 GiB with the margin: full
    recomputation would cost ~25% of their throughput for nothing. (pythia_6p9b ships tensor parallel 8: its
    FSDP-only layout is --tensor_parallel=1.)"""
    cfg = make_config(parse_args([str(ROOT / "configs" / f"{name}.py"), "--tensor_parallel=1"]))
    assert cfg.activation_checkpointing == "auto"
    chosen, why = dryrun.resolve_checkpointing(cfg, 8)
    assert chosen.activation_checkpointing is False and "'auto': none" in why
    assert headroom.with_margin(dryrun.dry_run_plan(chosen, 8).total) < 80 * GiB
    on_40, _ = dryrun.resolve_checkpointing(cfg, 8, device_memory_gib=40)  # an A100 40GB: every other block
    on_24, _ = dryrun.resolve_checkpointing(cfg, 8, device_memory_gib=24)
    assert (on_40.activation_checkpointing, on_24.activation_checkpointing) == ("selective", True)


@pytest.mark.slow
def test_dry_run_of_selective_checkpointing_matches_the_plan():
    """Every other block recomputed, at a 6.7B block's width (4 of its layers, FSDP over 8): plan within 15% of the
    simulated step, and between none and every block."""
    cfg = make_config(
        {
            **vars(make_config(parse_args([str(ROOT / "configs" / "gpt3_6p7b.py")]))),
            "n_layer": 4,
            "activation_checkpointing": "selective",
        }
    )
    plan, sim, text = dryrun.report(cfg, 8)
    assert "activation checkpointing of every other block" in text
    assert plan.total == pytest.approx(sim.total, rel=0.15)
    every = dryrun.dry_run_plan(make_config({**vars(cfg), "activation_checkpointing": True}), 8)
    none = dryrun.dry_run_plan(make_config({**vars(cfg), "activation_checkpointing": False}), 8)
    assert every.total < plan.total < none.total


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("torchrun", [True, False])
def test_probe_reserves_optimizer_state_resident_gradients_nccl_buffers_and_compile(monkeypatch, torchrun, compiled):
    """batch_size='auto' probes the bare model's forward+backward holding aside what a real step has beside it:
    AdamW's state always; the fp32 gradients (4 bytes/param) under DDP (bucket views, resident across steps) and
    at any micro-batch that needs accumulation; NCCL's buffers under torchrun; with compile, what the compiled
    graph saves beyond eager (COMPILE_RESERVE_FRACTION of the activations). Then the peak stats are reset."""
    seen = {}

    def probe(try_step, rows, env, reserve_bytes=0):
        seen["reserve"] = {b: reserve_bytes(b) for b in memory.divisors(rows)}
        return 2, "probed"

    monkeypatch.setattr(step, "probe_micro_batch", probe)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: seen.update(reset=device))
    world = 2 if torchrun else 1
    cfg = make_config({**DEEP, "batch_size": "auto", "total_batch_size": 4 * 32 * world, "compile": compiled})
    env = parallel.Env(0, 0, world, torchrun, "cuda:0", "bfloat16")
    out = step.probe_batch_size(GPT(model_config(cfg)), cfg, env, [])
    plan = estimate_memory(model_config(cfg), 1, **memory.plan_kwargs(cfg, env))
    assert plan.grads == 4 * GPT(model_config(cfg)).num_params()
    nccl = memory.NCCL_RESERVE if torchrun else 0

    def margin(b):  # item 4's margin, held aside too: plan x 1.05 + 1.5 GiB; and compile's share
        planned = estimate_memory(model_config(cfg), b, **memory.plan_kwargs(cfg, env))
        extra = int(planned.activations * memory.COMPILE_RESERVE_FRACTION) if compiled else 0
        return headroom.with_margin(planned.total) - planned.total + extra

    alone = plan.optimizer + (plan.grads if torchrun else 0) + nccl  # micro-batch 4: no accumulation
    assert out.batch_size == 2 and seen["reset"] == "cuda:0"
    assert seen["reserve"] == {
        4: alone + margin(4),
        2: plan.optimizer + plan.grads + nccl + margin(2),
        1: plan.optimizer + plan.grads + nccl + margin(1),
    }


def test_probe_holds_each_candidates_reservation_while_it_runs():
    held = []
    b, _ = step.probe_micro_batch(
        lambda b: None if b <= 2 else (_ for _ in ()).throw(torch.OutOfMemoryError()),
        8,
        parallel.Env(0, 0, 1, False, "cpu", "float32"),
        reserve_bytes=lambda b: held.append(b) or 1024,
    )
    assert b == 2 and held == [8, 4, 2]


def test_cli_exits_1_above_device_memory_and_2_on_a_bad_flag(monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(
        dryrun,
        "report",
        lambda cfg, world_size, gpus_per_node, memory_gib: (
            seen.append((cfg.n_layer, world_size, gpus_per_node))
            or (None, dryrun.DryRun({"params": 2 * GiB}, []), "the table")
        ),
    )
    config = str(ROOT / "configs" / "gpt3_125m.py")
    assert dryrun.main([config, "--world_size=16", "--n_layer=3", "--device_memory_gib=3.5"]) == 1
    assert (
        "does NOT fit: simulated peak 2.0 GiB, with the margin (plan x 1.05 + 1.5 GiB) 3.6 GiB > 3.5 GiB"
        in capsys.readouterr().out
    )
    assert dryrun.main([config, "--world_size=16", "--gpus_per_node=4"]) == 0 and seen == [(3, 16, 8), (12, 16, 4)]
    assert dryrun.main([config]) == 2 and "--world_size=N" in capsys.readouterr().err
    assert dryrun.main([config, "--world_size=eight"]) == 2 and "expected int" in capsys.readouterr().err


def test_cli_refuses_a_device_memory_that_is_not_a_size_and_a_config_its_plan_rules_out(monkeypatch, capsys):
    """--device_memory_gib nan, -1, 0 or inf is a usage error; a config whose plan is far over the device memory
    is refused from the plan in a moment, not simulated for minutes."""
    monkeypatch.setattr(dryrun, "dry_run", lambda *a, **k: pytest.fail("simulated"))
    config = str(ROOT / "configs" / "gpt3_125m.py")
    for bad in ["nan", "-1", "0", "inf"]:
        assert dryrun.main([config, "--world_size=8", f"--device_memory_gib={bad}"]) == 2
        assert "expected a number of GiB > 0" in capsys.readouterr().err
    assert dryrun.main([config, "--world_size=8", "--n_layer=2000"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("estimated peak memory per rank: ") and "does NOT fit: the plan alone is" in out
    assert "not simulated" in out
    assert dryrun.main([config, "--world_size=8", "--batch_size='auto'"]) == 2
    assert "needs batch_size set" in capsys.readouterr().err


# every layout the library trains, each with the default parallel ('ddp') unless the layout is FSDP's: a tiny model
# (untied, so that a pipeline can split it), one step; tensor parallelism alone (world_size == tensor_parallel) was
# a "Cannot copy out of meta tensor" traceback: shard() moved the dry run's meta model to the device
LAYOUTS = [
    "--world_size=1",
    "--world_size=2",
    "--world_size=2 --tensor_parallel=2",
    "--world_size=4 --tensor_parallel=2",
    "--world_size=2 --pipeline_parallel=2",
    "--world_size=4 --pipeline_parallel=2 --tensor_parallel=2",
    "--world_size=2 --parallel=fsdp",
    "--world_size=4 --parallel=fsdp --tensor_parallel=2",
    "--world_size=4 --parallel=hsdp --shard_size=2",
]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cli_dry_runs_every_layout_with_the_default_parallel(layout, capsys):
    tiny = "--n_layer=2 --n_head=2 --n_embd=64 --block_size=32 --batch_size=4 --vocab_size=128 --tie_embeddings=False"
    assert dryrun.main([*tiny.split(), *layout.split()]) == 0, capsys.readouterr().err
    assert "fits: simulated peak" in capsys.readouterr().out
