"""pipeline_parallel: 2 stages on 2 CPU ranks (torchrun, gloo) train a NeoX-shaped model (untied head, parallel
residual, partial rotary) to one process's losses, validate to its val loss, checkpoint so that one process resumes;
the splits and the layouts it cannot run are refused in one line.
"""

import json
import shutil

import pytest
import torch

import checkpoint as checkpoint_command
import dryrun
import train
from gpt2train import layout, memory, pipeline
from gpt2train.checkpoint import load_checkpoint
from gpt2train.config import ConfigError, make_config, model_config
from model import GPT, GPTConfig
from tiny import TINY, metrics, train_losses
from worlds import Scenario, world

# a tiny NeoX: 4 blocks (2 per stage), 2 ranks x 8 rows of 16 tokens per step, or one process x 2 micro-batches;
# the 2 micro-batches of 4 rows are the pipeline's 2 pieces
NEOX = [
    *TINY,
    "--n_layer=4",
    "--rotary_pct=0.25",
    "--parallel_residual=True",
    "--tie_embeddings=False",
    "--activation=gelu",
    "--total_batch_size=128",
    "--max_steps=8",
    "--lr_decay_steps=8",
    "--eval_interval=4",
    "--save_interval=4",
    "--keep_last=0",
]


@pytest.fixture(scope="module")
def one_process_run(data_dir, tmp_path_factory):
    """The reference of every layout here: the same 8 steps in one process (2 micro-batches a step)."""
    out = tmp_path_factory.mktemp("one")
    assert train.main([*NEOX, f"--data_dir={data_dir}", f"--out_dir={out}"]) == 0
    return out


@pytest.fixture(scope="module")
def layout_world(data_dir, one_process_run, tmp_path_factory):
    """Every multi-rank run of this file in one world of 8 ranks (tests/worlds.py), by name: "eight", 2 stages x 2
    replicas x 2 tensor-parallel ranks on all 8 (eval_steps=1 per data-parallel rank: the 2 micro-batches one
    process validates). Then on ranks 0-3: "tp_pp", 8 steps of 2 stages, each split over a tensor-parallel group of
    2 (the NeoX paper's layout, small; one data-parallel rank, so the rows and validation are one process's),
    checkpoints at steps 4 and 8; "four", its step-4 checkpoint resumed at its layout. At the same time on ranks 4-7:
    "replicas", 2 stages x 2 data-parallel replicas, each 4 rows per step in 2 micro-batches of 2 (eval_steps=1);
    then on ranks 4-5: "pp", 8 steps of 2 pipeline stages (1F1B), checkpoints at steps 4 and 8; "two", its step-4
    checkpoint resumed at its config (2 stages); "refused", one process's single-file checkpoint resumed on two
    stages (refused on every rank, so last)."""
    root = tmp_path_factory.mktemp("pp_world")
    run = lambda name, *more: [*NEOX, f"--data_dir={data_dir}", f"--out_dir={root / name}", *more]  # noqa: E731
    resume = lambda name, *more: ["--init_from=resume", f"--out_dir={root / name}", *more]  # noqa: E731
    copy = lambda source, target: [(root / source / "ckpt_000004", root / target / "ckpt_000004")]  # noqa: E731
    single = [(one_process_run / n, root / "refused" / n) for n in ("ckpt_000004.pt", "ckpt_000004.pt.sha256")]
    runs = {
        "eight": Scenario(run("eight", "--pipeline_parallel=2", "--tensor_parallel=2", "--eval_steps=1")),
        "tp_pp": Scenario(run("tp_pp", "--pipeline_parallel=2", "--tensor_parallel=2"), ranks=range(4)),
        "replicas": Scenario(run("replicas", "--pipeline_parallel=2", "--eval_steps=1"), ranks=range(4, 8)),
        "four": Scenario(resume("four"), copy("tp_pp", "four"), ranks=range(4)),
        "pp": Scenario(run("pp", "--pipeline_parallel=2"), ranks=(4, 5)),
        "two": Scenario(resume("two"), copy("pp", "two"), ranks=(4, 5)),
        "refused": Scenario(resume("refused", "--pipeline_parallel=2"), single, ranks=(4, 5)),
    }
    world(list(runs.values()), root / "logs", nproc=8)
    return runs


@pytest.fixture(scope="module")
def two_rank_world(layout_world):
    """The 2-rank runs: 2 pipeline stages, its step-4 checkpoint resumed, a single file refused."""
    return [layout_world[name] for name in ("pp", "two", "refused")]


@pytest.fixture(scope="module")
def pipeline_run(two_rank_world):
    """8 steps of 2 pipeline stages on 2 ranks (1F1B), checkpoints at steps 4 and 8."""
    assert two_rank_world[0].codes == [0, 0]
    return two_rank_world[0].out_dir


def by_step(out, key):
    return {m["step"]: m[key] for m in metrics(out) if key in m}


def max_diff(a, b):
    assert set(a) == set(b)
    return max(abs(a[k] - b[k]) for k in a)


@pytest.mark.slow
def test_two_stages_train_neox_to_one_process_losses(pipeline_run, one_process_run):
    assert list(by_step(pipeline_run, "train_loss")) == list(range(1, 9))
    for key in ("train_loss", "grad_norm", "val_loss"):  # val_loss at step 0 too: the same initial weights
        assert max_diff(by_step(pipeline_run, key), by_step(one_process_run, key)) <= 1e-4, key
    results = [json.loads((out / "summary.json").read_text())["result"] for out in (pipeline_run, one_process_run)]
    sizes = [{k: r[k] for k in ("params", "params_lookup", "flops")} for r in results]
    assert sizes[0] == sizes[1]  # a stage's rank reports the whole model's size, as one process does


@pytest.fixture(scope="module")
def four_rank_world(layout_world):
    """The 4-rank runs: tensor x pipeline, its step-4 checkpoint resumed at its layout, 2 stages x 2 replicas."""
    return [layout_world[name] for name in ("tp_pp", "four", "replicas")]


@pytest.mark.slow
def test_two_stages_times_two_replicas_train_to_one_process_losses(four_rank_world, pipeline_run):
    replicas = four_rank_world[2]
    assert replicas.codes == [0] * 4
    for key in ("train_loss", "grad_norm", "val_loss"):
        assert max_diff(by_step(replicas.out_dir, key), by_step(pipeline_run, key)) <= 1e-4, key


# ----------------------------------------------------------------------------- checkpoints at any layout


@pytest.fixture(scope="module")
def tp_pipeline_run(four_rank_world):
    """8 steps on 4 ranks: 2 stages, each split over a tensor-parallel group of 2. Checkpoints at steps 4 and 8."""
    assert four_rank_world[0].codes == [0] * 4
    return four_rank_world[0].out_dir


@pytest.mark.slow
def test_two_stages_times_tensor_parallel_two_train_to_one_process_losses(tp_pipeline_run, one_process_run):
    assert list(by_step(tp_pipeline_run, "train_loss")) == list(range(1, 9))
    for key in ("train_loss", "grad_norm", "val_loss"):
        assert max_diff(by_step(tp_pipeline_run, key), by_step(one_process_run, key)) <= 1e-4, key


@pytest.mark.slow
def test_tensor_times_pipeline_times_two_replicas_train_to_one_process_losses(layout_world, one_process_run):
    # 8 ranks: 2 stages x 2 replicas x 2 tensor-parallel ranks; the replicas average DTensor gradients' local parts
    eight = layout_world["eight"]
    assert eight.codes == [0] * 8
    for key in ("train_loss", "grad_norm", "val_loss"):
        assert max_diff(by_step(eight.out_dir, key), by_step(one_process_run, key)) <= 1e-4, key


@pytest.mark.slow
def test_a_tensor_times_pipeline_checkpoint_resumes_at_its_layout_and_in_one_process(
    tp_pipeline_run, four_rank_world, tmp_path
):
    shutil.copytree(tp_pipeline_run / "ckpt_000004", tmp_path / "one" / "ckpt_000004")
    four = four_rank_world[1]  # the step-4 checkpoint resumed at its layout
    assert four.codes == [0] * 4
    assert train.main(["--init_from=resume", f"--out_dir={tmp_path / 'one'}"]) == 0
    reference = {s: loss for s, loss in train_losses(tp_pipeline_run).items() if s > 4}
    assert train_losses(four.out_dir) == reference
    assert max_diff(train_losses(tmp_path / "one"), reference) <= 1e-5
    a, b = load_checkpoint(tp_pipeline_run)["model"], load_checkpoint(tmp_path / "one")["model"]
    assert set(a) == set(b) and all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)  # c_attn in GPT-2's order


@pytest.mark.slow
def test_a_two_stage_checkpoint_resumes_on_two_ranks_and_in_one_process(pipeline_run, two_rank_world, tmp_path):
    shutil.copytree(pipeline_run / "ckpt_000004", tmp_path / "one" / "ckpt_000004")
    two, refused = two_rank_world[1:]  # resumed at the checkpoint's config (2 stages); a single file on 2 stages
    assert two.codes == [0, 0]
    assert train.main(["--init_from=resume", f"--out_dir={tmp_path / 'one'}"]) == 0  # no torchrun: one process

    reference = {s: loss for s, loss in train_losses(pipeline_run).items() if s > 4}
    assert train_losses(two.out_dir) == reference
    assert max_diff(train_losses(tmp_path / "one"), reference) <= 1e-5
    a, b = load_checkpoint(pipeline_run)["model"], load_checkpoint(tmp_path / "one")["model"]
    assert set(a) == set(b) and "lm_head.weight" in a  # every stage's tensors, the untied head among them
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)
    # one process's single-file checkpoint on two stages: a stage's optimizer cannot take the whole model's state
    assert refused.codes != [0, 0] and refused.stderr.count("which pipeline stages cannot resume yet") == 1


@pytest.mark.slow
def test_consolidate_and_export_read_a_two_stage_checkpoint(pipeline_run, tmp_path):
    assert checkpoint_command.main(["consolidate", str(pipeline_run / "ckpt_000008"), str(tmp_path / "c.pt")]) == 0
    assert checkpoint_command.main(["export", str(pipeline_run / "ckpt_000008"), str(tmp_path / "hf")]) == 0
    whole = torch.load(tmp_path / "c.pt", weights_only=True)
    model = GPT(GPTConfig(**whole["model_args"]))
    model.load_state_dict(whole["model"])  # strict: every tensor of both stages
    assert len(whole["optimizer"]["state"]) == len(list(model.parameters()))
    assert (tmp_path / "hf" / "config.json").is_file()


# ----------------------------------------------------------------------------- the split

SMALL = GPTConfig(n_layer=5, n_head=2, n_embd=32, block_size=16, vocab_size=64, tie_embeddings=False, rotary_pct=0.25)


@pytest.mark.parametrize("stages", [2, 3, 5])
def test_stages_hold_every_parameter_once_under_its_global_name(stages):
    names = [n for n, _ in GPT(SMALL).named_parameters()]
    held = []
    for stage in range(stages):
        part = pipeline.keep_stage(GPT(SMALL), stage, stages)
        mine = [n for n, _ in part.named_parameters()]
        assert all(layout.stage_of(n, SMALL.n_layer, stages) == stage for n in mine)  # whole_pipeline's owners
        held += mine
    assert sorted(held) == sorted(names)
    assert [list(layout.stage_blocks(5, 3, s)) for s in range(3)] == [[0, 1], [2, 3], [4]]


def test_a_stage_runs_its_part_of_the_forward():
    torch.manual_seed(0)
    whole = GPT(SMALL)
    idx = torch.randint(0, 64, (2, 16))
    stages = [pipeline.keep_stage(GPT(SMALL), s, 2) for s in range(2)]  # GPT.forward runs what a stage holds
    for stage in stages:
        stage.load_state_dict({k: v for k, v in whole.state_dict().items() if k in stage.state_dict()})
    loss = stages[1](stages[0](idx), idx, return_logits=False)[1]
    assert torch.allclose(loss, whole(idx, idx, return_logits=False)[1], atol=1e-6)


# ----------------------------------------------------------------------------- layouts it cannot run: one line each

NEOX_KEYS = dict(n_layer=4, n_head=2, n_embd=32, block_size=16, vocab_size=64, tie_embeddings=False, batch_size=4)


@pytest.mark.parametrize(
    "keys,world_size,says",
    [
        ({}, 3, "pipeline_parallel=2 does not divide the world size 3"),
        ({"tensor_parallel": 2}, 6, "pipeline_parallel=2 x tensor_parallel=2 does not divide the world size 6"),
        ({"pipeline_parallel": 8}, 8, "more stages than the model's 4 blocks: set pipeline_parallel <= n_layer"),
        ({"tie_embeddings": True}, 2, "set tie_embeddings=False"),
        ({"value_embeds": True}, 2, "set value_embeds=False"),
        ({"bigram_embeds": 64}, 2, "set bigram_embeds=0"),
        ({"parallel": "fsdp"}, 2, "set parallel='ddp'"),
        ({"optimizer": "muon"}, 2, "set optimizer='adamw'"),
        ({"pipeline_microbatches": 1}, 2, "fewer than the 2 stages: set pipeline_microbatches >= pipeline_parallel"),
        ({"pipeline_microbatches": 3}, 2, "pipeline_microbatches=3 does not divide the step's 4 rows"),
    ],
)
def test_a_layout_it_cannot_run_is_refused_in_one_line(keys, world_size, says):
    cfg = make_config({**NEOX_KEYS, "pipeline_parallel": 2, **keys})
    with pytest.raises(ConfigError) as e:
        layout.check_pipeline(cfg, world_size)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_train_refuses_a_bad_layout_in_one_line_before_it_starts(data_dir, tmp_path, one_rank_torchrun, capsys):
    with pytest.raises(SystemExit) as exit_:
        train.main([*NEOX, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--pipeline_parallel=2"])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and err.count("\n") == 0 and "does not divide the world size 1" in err


def test_pipeline_parallel_is_ignored_without_torchrun(data_dir, tmp_path, capsys):
    assert (
        train.main([*NEOX, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--pipeline_parallel=2", "--max_steps=1"])
        == 0
    )
    assert "note: pipeline_parallel=2 ignored: not launched by torchrun" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the memory plan of a stage


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
def test_each_stages_plan_is_within_15_percent_of_its_dry_run(schedule):
    cfg = make_config(
        {
            **NEOX_KEYS,
            "n_embd": 64,
            "block_size": 64,
            "vocab_size": 256,
            "total_batch_size": 64 * 64 * 2,
            "pipeline_parallel": 2,
            "pipeline_schedule": schedule,
            "dtype": "bfloat16",
        }
    )
    pieces, rows = layout.microbatches(cfg, 2)  # 4 ranks: 2 replicas of 2 stages; 32 rows each, 8 pieces of 4
    kwargs = {"dtype": "bfloat16", "activation_checkpointing": None, "seq_len": None}
    for stage in range(2):
        plan = memory.stage_plan(model_config(cfg), rows, stage, (2, schedule, pieces), kwargs)
        sim = dryrun.dry_run_stage(cfg, 4, stage)
        assert 0.85 <= plan.total / sim.total <= 1.15, (stage, plan.total, sim.total)


@pytest.mark.slow
def test_tensor_times_pipeline_dry_run_splits_each_stage_and_its_plan_is_within_15_percent():
    """tensor 2 x pipeline 2 x data 2: a rank of each stage holds its half of the blocks' split weights (the plan's
    parameters are the simulation's) and the plan is within 15% of the simulated step, stage by stage."""
    keys = {**NEOX_KEYS, "n_embd": 64, "block_size": 64, "vocab_size": 256, "rotary_pct": 0.25}
    keys.update(parallel_residual=True, total_batch_size=64 * 64 * 2, pipeline_parallel=2, dtype="bfloat16")
    cfg = make_config({**keys, "tensor_parallel": 2})
    plan, sim, text = dryrun.report(cfg, 8)
    assert "x tensor_parallel 2 = 8 ranks" in text and 0.85 <= plan.total / sim.total <= 1.15
    whole = dryrun.dry_run_stage(make_config(keys), 4, 0)
    pieces, rows = layout.microbatches(cfg, 2)
    kwargs = {"dtype": "bfloat16", "activation_checkpointing": None, "seq_len": None, "tensor_parallel": 2}
    for stage in range(2):
        plan = memory.stage_plan(model_config(cfg), rows, stage, (2, "1F1B", pieces), kwargs)
        sim = dryrun.dry_run_stage(cfg, 8, stage)
        assert abs(plan.params - sim.parts["params"]) <= 0.02 * sim.parts["params"], stage
        assert 0.85 <= plan.total / sim.total <= 1.15, (stage, plan.total, sim.total)
    assert dryrun.dry_run_stage(cfg, 8, 0).parts["params"] < 0.7 * whole.parts["params"]  # split, not replicated
