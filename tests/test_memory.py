"""memory.py: the plan's arithmetic, its printed line, the fit check, and batch_size='auto' (plan and probe)."""

import os
import re

import pytest
import torch

import model as M
from bench.memory import peak_of_live_tensors
from gpt2train import devices, headroom, memory, parallel, step
from gpt2train.memory import GiB, MemoryPlanError, estimate_memory
from model import GPT, PRESETS, GPTConfig

TINY = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64)
CPU = parallel.Env(0, 0, 1, False, "cpu", "float32")  # one process: the probe's halving never halts for torchrun
LINE = re.compile(
    r"^estimated peak memory per rank: (\d+\.\d+) GiB \(params (\d+\.\d+) \+ grads (\d+\.\d+) \+ "
    r"AdamW (\d+\.\d+) \+ activations (\d+\.\d+) at micro-batch (\d+) \+ logits (\d+\.\d+)\)$"
)


@pytest.mark.parametrize("extra", [{}, {"bias": False}, {"rotary_pct": 0.5}])
def test_param_grad_and_adamw_bytes_are_those_of_the_real_model(extra):
    cfg = GPTConfig(**TINY, **extra)
    model = GPT(cfg)
    n = sum(p.numel() for p in model.parameters())  # tied wte/lm_head counted once
    plan = estimate_memory(cfg, batch_size=4)
    assert plan.params == plan.grads == 4 * n
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.step()
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for k, t in s.items() if k != "step")
    assert plan.optimizer == state == 8 * n


def test_autocast_keeps_parameters_grads_and_adamw_in_fp32():
    cfg = GPTConfig(**TINY)
    fp32, bf16 = estimate_memory(cfg, 4), estimate_memory(cfg, 4, dtype="bfloat16")
    assert (bf16.params, bf16.grads, bf16.optimizer) == (fp32.params, fp32.grads, fp32.optimizer)
    big = GPTConfig(**PRESETS["gpt2"])
    assert estimate_memory(big, 8, dtype="bfloat16").activations < 0.7 * estimate_memory(big, 8).activations


def test_sharded_plan_holds_the_full_model_states_divided_by_the_shard_size():
    cfg = GPTConfig(**PRESETS["gpt2"])
    full = estimate_memory(cfg, 8)
    fsdp = estimate_memory(cfg, 8, parallel="fsdp", world_size=4)
    hsdp = estimate_memory(cfg, 8, parallel="hsdp", world_size=8, shard_size=2)
    for part in ("params", "grads", "optimizer"):
        assert getattr(fsdp, part) == -(-getattr(full, part) // 4)
        assert getattr(hsdp, part) == -(-getattr(full, part) // 2)
    assert fsdp.activations == full.activations  # (logits: the loss phase's excess over the backward's peak)
    assert 0 < fsdp.gathered < full.params  # only the units in use are gathered, never the whole model
    ddp2 = estimate_memory(cfg, 8, world_size=2)
    assert ddp2.total == full.total  # DDP's gradients are views of its buckets (parallel.keeps_grads): one copy
    assert estimate_memory(cfg, 8, optimizer="muon").optimizer < full.optimizer  # one buffer for matrices


def test_plan_line_starts_with_the_total_in_gib_and_sums_its_parts():
    plan = estimate_memory(GPTConfig(**PRESETS["gpt2"]), 16)
    m = LINE.match(plan.line())
    assert m, plan.line()
    total, *parts = map(float, m.group(1, 2, 3, 4, 5, 7))
    assert int(m.group(6)) == 16 and total == round(plan.total / GiB, 1)
    assert abs(sum(parts) - total) <= 0.15  # one-decimal rounding of five parts
    tiny = estimate_memory(GPTConfig(**TINY), 2).line()
    assert re.match(r"^estimated peak memory per rank: 0\.\d{3} GiB \(", tiny), tiny


def saved_tensor_bytes(cfg, batch_size, dtype):
    """Bytes of the distinct non-parameter storages autograd saves in one training forward."""
    model = GPT(cfg)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    idx = torch.randint(0, cfg.vocab_size, (batch_size, cfg.block_size))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), devices.autocast("cpu", dtype):
        model(idx, idx, return_logits=False)
    return sum(seen.values())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"rotary_pct": 1.0},
        {"qk_norm": True, "rotary_pct": 1.0},
        {"value_embeds": True},
        {"value_embeds": True, "rotary_pct": 1.0},
        {"value_embeds": True, "smear": True, "qk_norm": True, "rotary_pct": 1.0},
    ],
    ids=str,
)
def test_activation_model_matches_what_autograd_saves(dtype, extra):
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=24, vocab_size=96, **extra)
    B, T = 3, cfg.block_size
    block, outside = memory.saved_bytes_per_token(cfg, dtype)
    weights = 2 * memory.param_stats(cfg)["block_matmul"] if dtype == "bfloat16" else 0
    loss = B * T * cfg.n_embd * 4 + cfg.vocab_size * cfg.n_embd * 4  # the chunked loss saves dh and dW
    predicted = B * T * (cfg.n_layer * block + outside) + cfg.n_layer * weights + loss
    measured = saved_tensor_bytes(cfg, B, dtype)
    assert abs(predicted - measured) <= 0.02 * measured, (predicted, measured)


def test_activation_checkpointing_keeps_one_input_per_block():
    cfg = GPTConfig(**PRESETS["gpt2"])
    plain, ckpt = estimate_memory(cfg, 16), estimate_memory(cfg, 16, activation_checkpointing=True)
    assert ckpt.activations < plain.activations / 4
    assert estimate_memory(GPTConfig(**{**PRESETS["gpt2"], **dict(activation_checkpointing=True)}), 16) == ckpt


def test_selective_checkpointing_recomputes_every_other_block_and_changes_no_gradient():
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=4, n_head=2, n_embd=32, block_size=16, vocab_size=64)
    idx = torch.randint(0, 64, (2, 16))
    grads, runs = {}, {}
    for mode in (False, "selective", True):
        torch.manual_seed(1)
        model = GPT(GPTConfig(**{**vars(cfg), "activation_checkpointing": mode}))
        calls = [0] * 4
        for i, block in enumerate(model.transformer.h):
            block.register_forward_pre_hook(lambda m, a, i=i: calls.__setitem__(i, calls[i] + 1))
        model(idx, idx, return_logits=False)[1].backward()
        grads[mode], runs[mode] = [p.grad for p in model.parameters()], calls
    assert runs == {False: [1, 1, 1, 1], "selective": [1, 2, 1, 2], True: [2, 2, 2, 2]}
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads[False], grads["selective"]))
    with pytest.raises(ValueError, match="activation_checkpointing"):
        GPTConfig(activation_checkpointing="every")


def test_the_plan_of_selective_checkpointing_lies_between_none_and_every_block():
    cfg = GPTConfig(**PRESETS["gpt2"])
    plain, half, every = (estimate_memory(cfg, 16, activation_checkpointing=m) for m in (False, "selective", True))
    assert every.activations < half.activations < plain.activations
    assert half.activations == pytest.approx((plain.activations + every.activations) / 2, rel=0.1)


def test_auto_checkpointing_is_the_least_recomputation_whose_plan_fits():
    cfg = GPTConfig(**PRESETS["gpt2"])
    plans = {m: estimate_memory(cfg, 16, activation_checkpointing=m).total for m in (False, "selective", True)}
    for budget, expected in (
        (plans[False], False),
        (plans[False] - 1, "selective"),
        (plans["selective"] - 1, True),
        (1, True),
    ):  # nothing fits: every block, and the memory check says what would
        assert memory.choose_checkpointing(cfg, 16, budget)[0] == expected
    assert "every other block" in memory.choose_checkpointing(cfg, 16, plans["selective"])[1]


def test_a_config_that_cannot_fit_is_refused_in_one_line_with_settings_that_fit_before_allocating():
    cfg = GPTConfig(**PRESETS["gpt2-xl"])  # 1.56B parameters: 6 GB just to build in fp32
    rss = lambda: int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) * 1024
    before = rss()
    plan = estimate_memory(cfg, 16, world_size=4)
    available = estimate_memory(cfg, 16, parallel="fsdp", world_size=4).total  # sharding alone would fit
    assert available < plan.total
    msg = memory.check_fits(cfg, 16, available, "cuda:0: test", rows=64, world_size=4)
    assert rss() - before < 200 * 2**20  # planned on the meta device: nothing of the model's size allocated
    assert "\n" not in msg and msg.startswith(f"estimated peak memory per rank {memory.gib(plan.total)} GiB exceeds")
    assert "(cuda:0: test)" in msg
    for setting in ("batch_size=", "accumulation steps", "activation_checkpointing=True", "parallel='fsdp'"):
        assert setting in msg, msg
    b = int(re.search(r"batch_size=(\d+) with (\d+) accumulation", msg).group(1))
    assert 64 % b == 0 and estimate_memory(cfg, b, world_size=4).total <= available
    assert estimate_memory(cfg, b * 2, world_size=4).total > available  # the largest that fits
    assert memory.check_fits(cfg, 16, plan.total, world_size=4) is None
    nothing = memory.check_fits(cfg, 16, 2**30)
    assert "nothing fits" in nothing and "\n" not in nothing


def test_plan_micro_batch_picks_the_largest_divisor_that_fits_with_margin():
    cfg = GPTConfig(**PRESETS["gpt2"])
    rows = 24  # divisors 24, 12, 8, 6, ...
    p8, p12 = estimate_memory(cfg, 8), estimate_memory(cfg, 12)
    available = int((p8.total + p12.total) / 2 / memory.AUTO_FIT_FRACTION)
    b, why = memory.plan_micro_batch(cfg, rows, available, description="cpu: test")
    assert b == 8 and "x 3 accumulation steps" in why and "micro-batch 12 would need" in why
    with pytest.raises(MemoryPlanError, match="nothing fits"):
        memory.plan_micro_batch(cfg, rows, 2**28)


def test_probe_halves_on_simulated_oom_and_ends_at_the_right_size():
    cfg = GPTConfig(**TINY)
    model = GPT(cfg)
    ran = []

    def try_step(b):  # a real forward+backward at micro-batch b; above `limit` the out-of-memory CUDA raises
        if b > limit:
            raise torch.OutOfMemoryError(f"simulated: micro-batch {b} > {limit}")
        x = torch.randint(0, cfg.vocab_size, (b, cfg.block_size))
        model(x, x, return_logits=False)[1].backward()
        model.zero_grad(set_to_none=True)
        ran.append(b)

    limit = 4
    b, why = step.probe_micro_batch(try_step, 12, CPU)
    assert (b, ran) == (3, [3]) and "out of memory at 12, 6" in why  # 12 -> 6 -> 3: halving, largest divisor
    ran.clear()
    assert step.probe_micro_batch(try_step, 16, CPU)[0] == 4 and ran == [4]
    limit = 0
    with pytest.raises(MemoryPlanError, match="even at micro-batch 1"):
        step.probe_micro_batch(try_step, 4, CPU)
    with pytest.raises(ValueError, match="not an oom"):  # other errors are not swallowed
        step.probe_micro_batch(lambda b: (_ for _ in ()).throw(ValueError("not an oom")), 2, CPU)


def test_is_oom_tells_out_of_memory_from_other_errors():
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert devices.is_oom(oom) and devices.is_oom(MemoryError())
    assert devices.is_oom(RuntimeError("MPS backend out of memory (MPS allocated: 1 GB)"))
    assert devices.is_oom(
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate "
            "memory: you tried to allocate 4096 bytes"
        )
    )
    try:  # wrapped, as torch.compile's backend errors wrap the original
        try:
            raise oom
        except RuntimeError as e:
            raise RuntimeError("backend compiler failed") from e
    except RuntimeError as wrapped:
        assert devices.is_oom(wrapped)
    assert not devices.is_oom(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not devices.is_oom(ValueError("out of memory"))  # a config error that mentions memory


def test_smaller_micro_batch_halves_to_a_divisor():
    assert [memory.smaller_micro_batch(12, b) for b in (12, 6, 3, 1)] == [6, 3, 1, None]
    assert memory.rows_per_rank(2**19, 1024, 8) == 64
    with pytest.raises(ValueError, match="not a multiple"):
        memory.rows_per_rank(1000, 1024)


def test_available_memory_on_cpu_is_at_most_the_machine_ram():
    avail, what = headroom.available_memory("cpu")
    assert 0 < avail <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert what.startswith("cpu: ") and "GiB" in what


@pytest.mark.parametrize(  # bf16 GEMMs are emulated on a CPU without AVX512-BF16: seconds each
    "dtype, low_params",
    [
        ("float32", False),
        pytest.param("bfloat16", False, marks=pytest.mark.slow),
        pytest.param("bfloat16", True, marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize("chunk_rows", [16, 1000])  # 2 chunks (the buffer reused) and one
def test_loss_bytes_is_the_chunked_loss_peak_of_live_tensors(monkeypatch, dtype, low_params, chunk_rows):
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setattr(M, "LOSS_CHUNK_ROWS", chunk_rows)
    monkeypatch.setattr(memory, "LOSS_CHUNK_ROWS", chunk_rows)
    # (V, C) large beside the GEMMs' own scratch, which the plan does not count: a few hundred KB on an AMD EPYC, 1.2 MB
    # of bf16 on an Intel Xeon with AMX (3.5% of the peak at V=16,000; 1.2% here). One row of 32 tokens: the GEMMs'
    # time (emulated bf16 on a CPU without AVX512-BF16) is per row, the peak mostly (V, C) buffers
    cfg, B = GPTConfig(n_layer=1, n_head=2, n_embd=256, block_size=32, vocab_size=64000), 1
    N = B * cfg.block_size
    h, w = torch.randn(N, cfg.n_embd), torch.randn(cfg.vocab_size, cfg.n_embd)
    if low_params:  # FSDP's bf16 parameters: a bf16 weight, and a bf16 residual stream into the loss
        h, w = h.bfloat16(), w.bfloat16()
    targets = torch.randint(0, cfg.vocab_size, (N,))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, devices.autocast("cpu", dtype):
        M.ChunkedLMHeadLoss.apply(h, w, targets, True)
    peak = peak_of_live_tensors(prof)
    predicted = memory.loss_bytes(cfg, B, dtype, low_params=low_params)
    assert abs(predicted - peak) <= 0.03 * peak, (predicted, peak)
