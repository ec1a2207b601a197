"""Meta-device initialisation of sharded runs (meta_init.build_on_meta + materialise in shard()): every rank ends up
holding exactly its slice of the weights one process draws from the same seed, at any world size, FSDP or HSDP.

The ranks are simulated one after another in this process with torch's fake process group (collectives are
no-ops; initialisation needs none): fast enough for any world size."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from gpt2train import meta_init, parallel, step
from gpt2train.config import make_config, model_config
from model import GPT

ARCHS = {  # sizes that do not divide by 4: uneven shards
    "gpt2 (tied, learned positions)": dict(n_layer=2, n_head=2, n_embd=12, block_size=8, vocab_size=30),
    "neox (untied, rotary)": dict(
        n_layer=2,
        n_head=3,
        n_embd=12,
        block_size=8,
        vocab_size=30,
        rotary_pct=0.5,
        parallel_residual=True,
        tie_embeddings=False,
        activation="gelu",
    ),
    "modern (value embeddings, smear, bigram table)": dict(
        n_layer=2,
        n_head=2,
        n_embd=16,
        block_size=8,
        vocab_size=30,
        rotary_pct=1.0,
        tie_embeddings=False,
        zero_init_proj=True,
        value_embeds=True,
        smear=True,
        bigram_embeds=37,
    ),
}


def rank_shards(cfg, mode, mesh, rank):
    """One rank of a world of prod(mesh): build on meta, shard and materialise as train.py does; returns the model
    and the RNG state it leaves."""
    world = 1
    for size in mesh:
        world *= size
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        torch.manual_seed(cfg.seed)
        model = meta_init.build_on_meta(model_config(cfg))
        env = parallel.Env(rank, rank, world, True, "cpu", "float32", mode, mesh)
        parallel.shard(model, cfg, env)
        return model, torch.get_rng_state()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode, mesh", [("fsdp", (2,)), ("fsdp", (4,)), ("hsdp", (2, 2))])
def test_every_rank_holds_its_slice_of_the_one_process_init(arch, mode, mesh):
    cfg = make_config(
        {**ARCHS[arch], "seed": 1234, "device": "cpu", "dtype": "float32", "compile": False, "parallel": mode}
    )
    torch.manual_seed(cfg.seed)
    reference = GPT(model_config(cfg))  # one process, the same seed
    rng_after = torch.get_rng_state()
    ranks = [rank_shards(cfg, mode, mesh, r) for r in range(mesh[0] * (mesh[1] if len(mesh) > 1 else 1))]
    shard_size = mesh[-1]
    for name, whole in reference.named_parameters():
        for group in range(len(ranks) // shard_size):  # HSDP: each group of shard_size ranks holds one copy
            members = ranks[group * shard_size : (group + 1) * shard_size]
            pieces = [model.get_parameter(name).to_local() for model, _ in members]
            assert torch.equal(torch.cat(pieces), whole.detach()), name
    for model, rng in ranks:
        assert torch.equal(rng, rng_after)  # dropout masks then draw what one process draws
        assert (model.lm_head.weight is model.transformer.wte.weight) == cfg.tie_embeddings
        assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
        for name, buffer in reference.named_buffers():  # the rotary tables, recomputed
            assert torch.equal(model.get_buffer(name), buffer), name


def test_a_model_that_a_sharded_checkpoint_will_fill_is_allocated_without_replaying_the_init(monkeypatch):
    """Resuming a sharded checkpoint: the shards are allocated and the rotary tables computed, but the random
    initialisation the load overwrites is not replayed (it draws every whole parameter once: minutes at 6.7B)."""
    import train
    from gpt2train import start
    from model import rotary_cos_sin

    cfg = make_config({**ARCHS["neox (untied, rotary)"], "compile": False})
    env = parallel.Env(0, 0, 2, True, "cpu", "float32", "fsdp", (2,))
    resumed = start.Source("resume", {"model_args": model_config(cfg).__dict__, "shards": "unused"})
    model, _ = train.build_model(cfg, resumed, env)
    assert meta_init.DEFERRED[model] == (None, [])  # nothing recorded to replay
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        torch.manual_seed(cfg.seed)
        before = torch.get_rng_state()
        parallel.shard(model, cfg, env)
        assert torch.equal(torch.get_rng_state(), before)  # no draw happened
        cos, sin = rotary_cos_sin(model.config.rot_dim, model.config.block_size, model.config.rotary_base)
        assert torch.equal(model.rope_cos, cos) and torch.equal(model.rope_sin, sin)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("compile_fails", [False, True])
def test_under_fsdp_the_blocks_and_the_head_with_its_loss_are_compiled(monkeypatch, compile_fails):
    """torch.compile, faked (records what it compiles; or fails as a broken compiler does when called): each
    block's forward and GPT.head_loss (ln_f, output head, chunked loss; under DDP the whole model is compiled),
    not only the blocks; a failed trial puts every one of them back to eager."""
    from torch._dynamo.exc import BackendCompilerFailed

    compiled = []

    def fake_compile(fn):
        compiled.append(fn.__qualname__)

        def run(*args, **kwargs):
            if compile_fails:
                raise BackendCompilerFailed("inductor", RuntimeError("no working C++ compiler"), None)
            return fn(*args, **kwargs)

        return run

    monkeypatch.setattr(torch, "compile", fake_compile)
    cfg = make_config({**ARCHS["gpt2 (tied, learned positions)"], "compile": True, "batch_size": 2})
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model = meta_init.build_on_meta(model_config(cfg))
        env = parallel.Env(0, 0, 2, True, "cpu", "float32", "fsdp", (2,))
        parallel.shard(model, cfg, env)  # as run() calls them: parallelize, then the compile trial
        env = env.with_batch(cfg)
        parallel.after_compile_trial(model, step.compile_works(model, cfg, env, SimpleNamespace(B=2)), env)
    finally:
        dist.destroy_process_group()
    assert compiled == ["Block.forward", "Block.forward", "GPT.head_loss"]
    assert ("head_loss" in vars(model)) == (not compile_fails) == parallel.is_compiled(model)
