"""tensor_parallel=N: ranks that split each block's heads and MLP width train as one process does, alone and under
FSDP (2-D FSDP x TP); their checkpoints keep GPT-2's layout (c_attn's q; k; v rows), resume in one process and
consolidate; layouts that cannot split are one line.

Multi-rank runs are CPU processes under torchrun (gloo) on tests/tiny.py's Markov-chain data, with the GPT-2
architecture at 4 heads so that 2 ranks hold 2 heads each.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch

import checkpoint as checkpoint_command
import dryrun
import train
from gpt2train.checkpoint import load_checkpoint
from gpt2train.config import ConfigError, make_config, parse_args
from gpt2train.tensor_parallel import gpt2_rows, qkv_order
from tiny import TINY, metrics, train_losses
from worlds import Scenario, world

ROOT = Path(__file__).resolve().parent.parent
# 8 steps of 128 tokens: one process x 2 accumulation steps of 4 x 16, or each data-parallel rank its share;
# a clip of 0.5 is below every step's norm here, so clipping (and the norm over split gradients) is exercised
COMMON = [
    *TINY,
    "--n_head=4",
    "--total_batch_size=128",
    "--max_steps=8",
    "--grad_clip=0.5",
    "--eval_interval=4",
    "--save_interval=4",
    "--keep_last=0",
]


@pytest.fixture(scope="module")
def single_run(data_dir, tmp_path_factory):
    """The reference: one process, the whole model."""
    out = tmp_path_factory.mktemp("single")
    assert train.main([*COMMON, f"--data_dir={data_dir}", f"--out_dir={out}"]) == 0
    return out


@pytest.fixture(scope="module")
def tp_world(data_dir, single_run, tmp_path_factory):
    """Every multi-rank run of this file in one world of 4 ranks (tests/worlds.py), by name: "fsdp" and "ddp",
    8 steps at tensor_parallel=2 under parallel='fsdp' and 'ddp'; "init_fsdp", TP_INIT under 'fsdp'. Then on ranks
    0-1: "tp", 8 steps at tensor_parallel=2 (one data-parallel rank), sharded checkpoints at steps 4 and 8;
    "tp_resumed", its step-4 checkpoint resumed at its layout; "one_resumed", the one process's step-4 single file
    resumed at tensor_parallel=2. At the same time on ranks 2-3: "init_ddp", TP_INIT under 'ddp'."""
    root = tmp_path_factory.mktemp("tp_world")
    (root / "init.py").write_text(TP_INIT)
    run = lambda name, *more: [*COMMON, f"--data_dir={data_dir}", f"--out_dir={root / name}", *more]  # noqa: E731
    resume = lambda name, *more: ["--init_from=resume", f"--out_dir={root / name}", *more]  # noqa: E731
    single = [(single_run / n, root / "one_resumed" / n) for n in ("ckpt_000004.pt", "ckpt_000004.pt.sha256")]
    init = lambda parallel, **kw: Scenario([root / f"init_{parallel}_rank", parallel], script=root / "init.py", **kw)  # noqa: E731
    runs = {
        **{p: Scenario(run(p, f"--parallel={p}", "--tensor_parallel=2")) for p in ("fsdp", "ddp")},
        "init_fsdp": init("fsdp"),
        "tp": Scenario(run("tp", "--tensor_parallel=2"), ranks=(0, 1)),
        "init_ddp": init("ddp", ranks=(2, 3)),
        "tp_resumed": Scenario(
            resume("tp_resumed"), [(root / "tp" / "ckpt_000004", root / "tp_resumed" / "ckpt_000004")], ranks=(0, 1)
        ),
        "one_resumed": Scenario(resume("one_resumed", "--tensor_parallel=2"), single, ranks=(0, 1)),
    }
    world(list(runs.values()), root / "logs", nproc=4)
    return runs


@pytest.fixture(scope="module")
def two_rank_world(tp_world):
    """The 2-rank runs: tensor_parallel 2, both resumes, TP_INIT under 'ddp'."""
    return [tp_world[name] for name in ("tp", "tp_resumed", "one_resumed", "init_ddp")]


@pytest.fixture(scope="module")
def four_rank_world(tp_world):
    """The 4-rank runs: fsdp x tp, ddp x tp, TP_INIT under 'fsdp'."""
    return [tp_world[name] for name in ("fsdp", "ddp", "init_fsdp")]


@pytest.fixture(scope="module")
def tp_run(two_rank_world):
    """2 ranks at tensor_parallel=2 (one data-parallel rank): sharded checkpoints at steps 4 and 8."""
    result = two_rank_world[0]
    assert result.codes == [0, 0]
    assert "world size 2 (ddp, tensor_parallel 2) | 128 tokens/step = 1 data-parallel ranks" in result.stdout
    return result.out_dir


def by_step(out_dir, key):
    return {m["step"]: m[key] for m in metrics(out_dir) if key in m}


def close(a, b, tol=1e-4):
    return set(a) == set(b) and all(abs(a[k] - b[k]) <= tol for k in a)


@pytest.mark.slow
def test_two_tensor_parallel_ranks_train_as_one_process(tp_run, single_run):
    assert list(by_step(tp_run, "train_loss")) == list(range(1, 9))
    for key in ("train_loss", "grad_norm", "val_loss"):
        assert close(by_step(tp_run, key), by_step(single_run, key)), key
    assert all(norm > 0.5 for norm in by_step(tp_run, "grad_norm").values())  # clipping was active at every step
    assert sorted(p.name for p in tp_run.glob("ckpt_*")) == ["ckpt_000004", "ckpt_000008"]  # sharded: directories
    # the checkpoint holds GPT-2's layout (c_attn's rows q; k; v), whatever order the ranks held them in
    a, b = load_checkpoint(tp_run)["model"], load_checkpoint(single_run)["model"]
    assert set(a) == set(b) and all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)


@pytest.mark.slow
def test_a_tensor_parallel_checkpoint_resumes_in_one_process_and_consolidates(tp_run, single_run, tmp_path):
    shutil.copytree(tp_run / "ckpt_000004", tmp_path / "ckpt_000004")
    assert train.main(["--init_from=resume", f"--out_dir={tmp_path}"]) == 0  # the checkpoint's tensor_parallel=2
    reference = {s: loss for s, loss in train_losses(single_run).items() if s > 4}
    assert close(train_losses(tmp_path), reference)
    consolidated = tmp_path / "tp4.pt"
    assert checkpoint_command.main(["consolidate", str(tp_run / "ckpt_000004"), str(consolidated)]) == 0
    single = load_checkpoint(single_run / "ckpt_000004.pt")
    for part in ("model", "optimizer"):  # AdamW's moments of c_attn in GPT-2's layout too
        tp, one = load_checkpoint(consolidated)[part], single[part]
        tensors = lambda s: s if part == "model" else {(i, k): t for i, v in s["state"].items() for k, t in v.items()}  # noqa: E731
        assert all(torch.allclose(t, tensors(one)[k], atol=1e-5) for k, t in tensors(tp).items()), part


@pytest.mark.slow
def test_a_tensor_parallel_checkpoint_resumes_bit_exactly_at_its_layout(tp_run, two_rank_world):
    """Read back into split weights (c_attn's rows put in rank order again) and split AdamW moments."""
    resumed = two_rank_world[1]  # the step-4 checkpoint resumed at its tensor_parallel=2
    assert resumed.codes == [0, 0]
    assert train_losses(resumed.out_dir) == {s: loss for s, loss in train_losses(tp_run).items() if s > 4}


@pytest.mark.slow
def test_a_one_process_checkpoint_resumes_at_tensor_parallel_2(single_run, two_rank_world):
    """A fused-AdamW single file: the weights and the AdamW moments split as the ranks hold them (c_attn's rows in
    rank order), and the optimizer steps with the kernel this layout can run."""
    resumed = two_rank_world[2]  # the step-4 single file resumed at tensor_parallel=2
    assert resumed.codes == [0, 0]
    assert close(train_losses(resumed.out_dir), {s: loss for s, loss in train_losses(single_run).items() if s > 4})


TP_INIT = """
import json, sys
import torch
import train
from gpt2train import parallel, start
from gpt2train.config import make_config, model_config
from gpt2train.generation import Sampling, generate
from model import GPT

cfg = make_config(dict(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=64, device="cpu", dtype="float32",
                       compile=False, tensor_parallel=2, parallel=sys.argv[2], seed=7))
env = parallel.setup(cfg)
raw, cfg = train.build_model(cfg, start.Source("scratch"), env)  # on meta, as train.py builds a sharded run
model = train.parallelize(raw, cfg, env)
torch.manual_seed(cfg.seed)
alone = GPT(model_config(cfg))  # what one process starts from with the same seed
x = torch.randint(0, 64, (2, 16))
with torch.no_grad():
    loss = model(x, x, return_logits=False)[1].item()
with parallel.gathered(raw, env) as whole:  # the split weights gathered, in GPT-2's layout
    same_init = [n for n, t in whole.state_dict().items() if not torch.equal(t, alone.state_dict()[n])] == []
    tokens = generate(whole, x[:1, :4], 6, Sampling(temperature=0)).tolist()
with open(sys.argv[1] + str(env.rank), "w") as f:
    json.dump({"same_init": same_init, "loss": loss, "alone_loss": alone(x, x, return_logits=False)[1].item(),
               "tokens": tokens, "alone_tokens": generate(alone, x[:1, :4], 6, Sampling(temperature=0)).tolist()}, f)
"""


@pytest.mark.slow
@pytest.mark.parametrize("parallel, nproc", [("ddp", 2), ("fsdp", 4)])
def test_split_ranks_start_from_one_process_weights_and_gather_them_for_generation(request, parallel, nproc):
    """Built on meta and initialised rank by rank (c_attn's rows drawn whole, then put in rank order), the model
    is the seed's: its forward gives one process's loss, and gathered() gives back GPT-2's layout to generate."""
    init = request.getfixturevalue("two_rank_world" if nproc == 2 else "four_rank_world")[-1]  # TP_INIT's run
    assert init.codes == [0] * nproc
    for r in range(nproc):
        result = json.loads(Path(f"{init.args[0]}{r}").read_text())
        assert result["same_init"] and result["tokens"] == result["alone_tokens"]
        assert result["loss"] == pytest.approx(result["alone_loss"], abs=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["fsdp", "ddp"])
def test_tensor_parallel_under_data_parallel_on_four_ranks_trains_as_one_process(four_rank_world, single_run, parallel):
    """2 data-parallel ranks of 2 tensor-parallel ones: FSDP shards each rank's part (2-D FSDP x TP), 'ddp'
    replicates it (FSDP with shards of one rank, gradients all-reduced)."""
    result = four_rank_world[["fsdp", "ddp"].index(parallel)]
    assert result.codes == [0] * 4
    assert f"world size 4 ({parallel}, tensor_parallel 2) | 128 tokens/step = 2 data-parallel ranks" in result.stdout
    for key in ("train_loss", "grad_norm"):
        assert close(by_step(result.out_dir, key), by_step(single_run, key)), key
    a, b = load_checkpoint(result.out_dir)["model"], load_checkpoint(single_run)["model"]
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)


def test_c_attn_rows_are_held_rank_by_rank_and_put_back_in_gpt2_order():
    """Held rows: rank 0's rows of q, k and v (n_embd / tp each), then rank 1's: a plain Shard(0) gives each its own."""
    assert qkv_order(12, 2).tolist() == [0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11]
    whole = torch.arange(12.0)
    held = whole[qkv_order(12, 2)]
    assert torch.equal(gpt2_rows("attn.c_attn.weight", held, held), held)  # a plain tensor: not split, as it is
    assert torch.equal(held[qkv_order(12, 2).argsort()], whole)


@pytest.mark.parametrize(
    "keys, message",
    [
        (
            {"n_head": 4, "tensor_parallel": 3},
            "tensor_parallel=3 must divide n_head=4 (each rank computes whole heads)",
        ),
        (
            {"value_embeds": True, "tensor_parallel": 2},
            "tensor_parallel=2 does not support value_embeds=True yet: set value_embeds=False or tensor_parallel=1",
        ),
    ],
)
def test_a_model_tensor_parallel_cannot_split_is_one_line(keys, message):
    with pytest.raises(ConfigError) as e:
        make_config({"n_layer": 2, "n_head": 4, "n_embd": 32, **keys})
    assert str(e.value) == message


def test_tensor_parallel_not_dividing_the_world_size_is_one_line(data_dir, tmp_path, one_rank_torchrun, capsys):  # noqa: F811
    args = [*COMMON, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--tensor_parallel=2"]
    with pytest.raises(SystemExit) as e:
        train.main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [
        "train.py: error: tensor_parallel=2 must divide the world size 1 (groups of tensor_parallel ranks split each "
        "block; the groups are the data-parallel ranks)"
    ]


@pytest.mark.slow
def test_a_rank_of_pythia_6p9b_at_tensor_parallel_8_dry_runs_within_15_percent_of_its_plan():
    """GPT-NeoX/Pythia's layout, one 8-GPU node split 8 ways, 2 of its 32 layers (the time is per layer;
    docs/multi-gpu.md has the whole model's table beside the FSDP-only layout)."""
    cfg = make_config(parse_args([str(ROOT / "configs" / "pythia_6p9b.py"), "--tensor_parallel=8", "--n_layer=2"]))
    plan, sim, text = dryrun.report(cfg, 8)
    assert "rank 0 of 8, fsdp x tensor_parallel 8" in text
    assert sim.parts["params"] == pytest.approx(plan.params, rel=1e-3)  # 1/8 of the blocks' matrices, the rest whole
    assert plan.total == pytest.approx(sim.total, rel=0.15)
