"""memory.py: the plan's arithmetic, its contract line, the fit check and the micro-batch search."""
import re

import pytest
import torch

import memory
from model import GPT, GPTConfig

SMALL = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64)


def test_parameter_gradient_and_optimizer_bytes_are_exact():
    n = GPT(SMALL).num_params()  # tied wte/lm_head counted once, as the model holds them
    plan = memory.estimate_memory(SMALL, batch_size=4)
    assert plan.params == plan.grads == 4 * n  # fp32 master weights and gradients, also under autocast
    assert plan.optimizer == 2 * 4 * n  # AdamW: exp_avg and exp_avg_sq
    assert memory.estimate_memory(SMALL, 4, dtype="bfloat16").params == 4 * n
    untied = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, tie_embeddings=False)
    assert memory.estimate_memory(untied, 4).params == 4 * GPT(untied).num_params()


def test_sharding_divides_the_model_state_by_the_shard_count():
    full = memory.estimate_memory(SMALL, 4)
    ddp = memory.estimate_memory(SMALL, 4, world_size=2)
    fsdp = memory.estimate_memory(SMALL, 4, parallel="fsdp", world_size=2)
    assert (ddp.params, ddp.grads, ddp.optimizer) == (full.params, full.grads, full.optimizer)
    assert ddp.ddp_buckets == full.grads  # DDP's flat gradient buckets: a second copy of the gradients
    assert fsdp.params == -(-full.params // 2) and fsdp.optimizer == -(-full.optimizer // 2)
    hsdp = memory.estimate_memory(SMALL, 4, parallel="hsdp", world_size=8, shard_size=4)
    assert hsdp.params == -(-full.params // 4)


def test_activations_grow_with_the_micro_batch_and_shrink_with_checkpointing():
    one, four = (memory.estimate_memory(SMALL, b).activations for b in (1, 4))
    assert four == pytest.approx(4 * one, rel=0.05)
    assert memory.estimate_memory(SMALL, 4, activation_checkpointing=True).activations < four


def test_the_plan_line_is_the_contract():
    plan = memory.estimate_memory(GPTConfig(), batch_size=16)  # GPT-2 124M
    line = plan.line()
    m = re.match(r"estimated peak memory per rank: (\d+\.\d+) GiB \(params ", line)
    assert m and float(m.group(1)) == pytest.approx(plan.total / 2**30, abs=0.05)
    assert "at micro-batch 16" in line and "AdamW" in line


def test_a_plan_that_cannot_fit_names_settings_that_would():
    need = memory.estimate_memory(GPTConfig(), 16).total
    assert memory.check_fits(GPTConfig(), 16, available=2 * need) is None
    message = memory.check_fits(GPTConfig(), 16, available=need // 2, rows=16)
    assert message.startswith("estimated peak memory per rank") and "\n" not in message
    assert "settings that fit" in message or "nothing fits" in message


def test_auto_micro_batch_from_the_plan_is_the_largest_divisor_that_fits():
    rows = 12
    budget = memory.estimate_memory(SMALL, 4).total
    b, why = memory.plan_micro_batch(SMALL, rows, available=budget, fraction=1.0)
    assert b == 4 and rows % b == 0 and "micro-batch 4" in why
    with pytest.raises(memory.MemoryPlanError):
        memory.plan_micro_batch(SMALL, rows, available=1)


def test_probe_halves_on_out_of_memory_until_a_size_runs():
    tried = []

    def try_step(b):
        tried.append(b)
        if b > 3:
            raise torch.OutOfMemoryError(f"CUDA out of memory at {b}")

    b, why = memory.probe_micro_batch(try_step, memory.divisors(16))
    assert b == 2 and tried == [16, 8, 4, 2] and "out of memory at 16, 8, 4" in why
    with pytest.raises(ValueError, match="not out of memory"):  # anything else propagates
        memory.probe_micro_batch(lambda b: (_ for _ in ()).throw(ValueError("not out of memory")), [4, 2, 1])
