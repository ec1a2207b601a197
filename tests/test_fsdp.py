"""parallel='fsdp'/'hsdp': sharded training equals DDP and one process, sharded checkpoints resume exactly at any
world size and survive a kill -9, a sharded model evaluates and samples, and one process reads the shards.

Multi-rank runs are 2 CPU processes under torchrun (gloo) on tests/tiny.py's tiny model and Markov-chain data.
"""

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

import checkpoint as checkpoint_command
import hellaswag
import sample
import train
from gpt2train import checkpoint, loading, optim, parallel, start
from gpt2train.checkpoint import load_checkpoint, load_latest_checkpoint
from gpt2train.config import make_config
from gpt2train.hf import from_pretrained
from gpt2train.sharded import save_sharded_checkpoint
from model import GPT, GPTConfig
from test_hellaswag import EXAMPLES
from tiny import TINY, free_port, metrics, subprocess_env, train_losses
from worlds import Scenario, world

ROOT = Path(__file__).resolve().parent.parent
# 2 ranks x 1 micro-batch of 4 x 16 tokens, or 1 process x 2; a clip of 0.5 is below every step's norm here
COMMON = [
    *TINY,
    "--total_batch_size=128",
    "--max_steps=20",
    "--lr_decay_steps=20",
    "--grad_clip=0.5",
    "--eval_interval=10",
    "--save_interval=10",
    "--keep_last=0",
]


@pytest.fixture(scope="module")
def fsdp_world(data_dir, tmp_path_factory):
    """One world of 2 ranks (tests/worlds.py) for the file's 2-rank runs, in order: "fsdp", the reference (20 steps
    on 2 FSDP ranks, sharded checkpoints at steps 10 and 20); "ddp", the same under DDP; "two", its step-10
    checkpoint resumed at its config; "hsdp", a one-rank FSDP run's step-10 checkpoint (made here, in-process, its
    stdout kept as "one_rank_stdout") resumed as hsdp with shard groups of one rank; "damaged", both fsdp
    checkpoints with a flipped byte in the newest's first shard, resumed; "eval", SHARDED_EVAL; "hashed",
    COUNTING_HASHES resuming a one-process run whose newest checkpoint is damaged (made here: its losses kept as
    "hashed_losses"; last, as its script patches train's modules)."""
    root = tmp_path_factory.mktemp("fsdp_world")
    args = lambda name, *more: [*COMMON, f"--data_dir={data_dir}", f"--out_dir={root / name}", *more]  # noqa: E731
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as m, contextlib.redirect_stdout(printed):
        for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1").items():
            m.setenv(key, value)  # as conftest's one_rank_torchrun
        m.setenv("MASTER_ADDR", "127.0.0.1")
        m.setenv("MASTER_PORT", str(free_port()))
        assert train.main(args("hsdp", "--parallel=fsdp", "--max_steps=10")) == 0
    assert train.main(args("hashed", "--max_steps=4", "--save_interval=2")) == 0
    hashed_losses = train_losses(root / "hashed")
    damage(root / "hashed" / "ckpt_000004.pt")
    (root / "eval.py").write_text(SHARDED_EVAL)
    (root / "hellaswag.jsonl").write_text("".join(json.dumps(ex) + "\n" for ex in EXAMPLES[:7]))
    (root / "count.py").write_text(COUNTING_HASHES)
    (root / "damage.py").write_text(DAMAGE)
    fsdp, resume = root / "fsdp", ["--init_from=resume"]
    runs = {
        "fsdp": Scenario(args("fsdp", "--parallel=fsdp")),
        "ddp": Scenario(args("ddp", "--parallel=ddp")),
        "two": Scenario([*resume, f"--out_dir={root / 'two'}"], [(fsdp / "ckpt_000010", root / "two" / "ckpt_000010")]),
        "hsdp": Scenario(
            [*resume, f"--out_dir={root / 'hsdp'}", "--max_steps=20", "--parallel=hsdp", "--shard_size=1"]
        ),
        "damage": Scenario(
            [root / "damaged" / "ckpt_000020"],
            [(fsdp / f"ckpt_{step:06d}", root / "damaged" / f"ckpt_{step:06d}") for step in (10, 20)],
            script=root / "damage.py",
        ),
        "damaged": Scenario([*resume, f"--out_dir={root / 'damaged'}"]),
        "eval": Scenario([root / "hellaswag.jsonl", root / "rank"], script=root / "eval.py"),
        "hashed": Scenario(
            [root / "hashed_", *resume, f"--out_dir={root / 'hashed'}", "--max_steps=4"], script=root / "count.py"
        ),
    }
    world(list(runs.values()), root / "logs")
    for name, run in runs.items():
        assert run.codes == [0, 0], (name, run.stderr[-3000:])
    return {**runs, "one_rank_stdout": printed.getvalue(), "hashed_losses": hashed_losses}


def damage(path):
    """Flip one bit in the middle of the file at PATH."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))


DAMAGE = """
import os, sys
from pathlib import Path

from test_fsdp import damage

if os.environ["RANK"] == "0":  # a sharded checkpoint's first shard
    damage(next(p for p in sorted(Path(sys.argv[1]).iterdir()) if p.suffix == ".distcp"))
"""


@pytest.fixture(scope="module")
def fsdp_run(fsdp_world):
    """The reference: 20 steps on 2 FSDP ranks, sharded checkpoints at steps 10 and 20."""
    return fsdp_world["fsdp"].out_dir


def close(a, b, tol=1e-5):
    return set(a) == set(b) and all(abs(a[k] - b[k]) < tol for k in a)


def steps(losses, first, last):
    return {s: losses[s] for s in range(first, last + 1)}


# ----------------------------------------------------------------------------- equal to DDP and to one process


@pytest.mark.slow
def test_fsdp_equals_ddp_and_one_process_with_accumulation(data_dir, fsdp_run, fsdp_world, tmp_path):
    ddp_run = fsdp_world["ddp"].out_dir  # the same 20 steps under DDP
    # one process x 2 accumulation steps; eval_steps counts micro-batches per process: 2 x 2 ranks = 4
    assert train.main([*COMMON, f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'single'}", "--eval_steps=4"]) == 0

    fsdp, ddp, single = (metrics(out) for out in (fsdp_run, ddp_run, tmp_path / "single"))
    by_step = lambda lines, key: {m["step"]: m[key] for m in lines if key in m}  # noqa: E731
    assert list(by_step(fsdp, "train_loss")) == list(range(1, 21))
    for key in ("train_loss", "grad_norm", "val_loss"):  # val_loss at step 0: the same initial weights
        assert close(by_step(fsdp, key), by_step(ddp, key)), key
        assert close(by_step(fsdp, key), by_step(single, key)), key
    assert all(norm > 0.5 for norm in by_step(fsdp, "grad_norm").values())  # clipping was active at every step
    assert sorted(p.name for p in fsdp_run.glob("ckpt_*")) == ["ckpt_000010", "ckpt_000020"]  # directories
    a, b = load_checkpoint(fsdp_run)["model"], load_checkpoint(ddp_run)["model"]
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)


# ----------------------------------------------------------------------------- resume at any world size


@pytest.mark.slow
def test_sharded_resume_is_bit_exact_on_two_ranks_and_within_1e5_on_one(fsdp_run, fsdp_world, tmp_path):
    shutil.copytree(fsdp_run / "ckpt_000010", tmp_path / "one" / "ckpt_000010")
    two = fsdp_world["two"].out_dir  # the step-10 checkpoint resumed at its config: fsdp, 20 steps
    assert train.main(["--init_from=resume", f"--out_dir={tmp_path / 'one'}"]) == 0  # no torchrun: one process

    reference = steps(train_losses(fsdp_run), 11, 20)
    assert train_losses(two) == reference
    assert close(train_losses(tmp_path / "one"), reference)
    a, b = load_checkpoint(fsdp_run)["model"], load_checkpoint(two)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "one" / "ckpt_000020.pt").is_file()  # one process writes the single-file form


@pytest.mark.slow
def test_one_rank_sharded_checkpoint_resumes_on_two_ranks_as_hsdp(fsdp_run, fsdp_world):
    # fsdp_world's in-process run: 10 steps under torchrun's environment for one rank
    result = fsdp_world["hsdp"]
    assert "world size 1 (fsdp)" in fsdp_world["one_rank_stdout"]
    assert (result.out_dir / "ckpt_000010" / ".metadata").is_file()
    # hsdp with shard groups of one rank: a 2 x 1 mesh, gradients all-reduced across the two replicas
    assert "world size 2 (hsdp)" in result.stdout
    assert close(train_losses(result.out_dir), train_losses(fsdp_run))


@pytest.mark.slow
def test_single_file_checkpoint_resumes_sharded(data_dir, fsdp_run, tmp_path, one_rank_torchrun):
    """A plain one-process run's ckpt_000010.pt continues as an FSDP run: the weights are sharded as the model
    is, and the optimizer state (whole tensors keyed by index) is split the same way."""
    out = tmp_path / "out"
    with pytest.MonkeyPatch.context() as m:
        m.delenv("RANK")
        assert train.main([*COMMON, f"--data_dir={data_dir}", f"--out_dir={out}", "--max_steps=10"]) == 0
    assert (out / "ckpt_000010.pt").is_file()
    assert train.main(["--init_from=resume", f"--out_dir={out}", "--max_steps=20", "--parallel=fsdp"]) == 0
    assert (out / "ckpt_000020").is_dir()
    assert close(train_losses(out), train_losses(fsdp_run))


@pytest.mark.slow
def test_sharded_checkpoint_resumes_under_ddp(fsdp_run, tmp_path, one_rank_torchrun):
    """parallel may change on resume: DDP loads the shards of a 2-rank FSDP run into whole tensors on every rank."""
    shutil.copytree(fsdp_run / "ckpt_000010", tmp_path / "ckpt_000010")
    assert train.main(["--init_from=resume", f"--out_dir={tmp_path}", "--parallel=ddp", "--max_steps=12"]) == 0
    assert close(train_losses(tmp_path), steps(train_losses(fsdp_run), 11, 12))
    assert (tmp_path / "ckpt_000012.pt").is_file()


@pytest.mark.parametrize("compile_fails", [False, True])
def test_compiled_blocks_train_as_eager_ones(data_dir, tmp_path, one_rank_torchrun, monkeypatch, capsys, compile_fails):
    """torch.compile of each block's forward, faked: the same function, or one failing as a broken compiler does.
    Either way (trial passed: compiled; trial failed: back to eager) the run trains exactly as an eager one: the
    trial leaves no trace, and the optimizer holds every shard (the trial's eval forward leaves the root unit
    gathered, and an optimizer built over those gathered tensors would never update wte, wpe and ln_f)."""
    from torch._dynamo.exc import BackendCompilerFailed
    from torch._inductor.exc import CppCompileError

    def fake_compile(forward):
        def compiled(*args, **kwargs):
            if compile_fails:
                raise BackendCompilerFailed("inductor", CppCompileError(["g++"], "no working C++ compiler"), None)
            return forward(*args, **kwargs)

        return compiled

    args = [*COMMON, f"--data_dir={data_dir}", "--parallel=fsdp", "--max_steps=6", "--dropout=0.1"]
    assert train.main([*args, f"--out_dir={tmp_path / 'eager'}"]) == 0
    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    assert train.main([*args, f"--out_dir={tmp_path / 'compiled'}", "--compile=True"]) == 0
    out = capsys.readouterr().out
    assert ("torch.compile failed (BackendCompilerFailed" in out) == compile_fails
    assert f"compile {not compile_fails} | world size 1 (fsdp)" in out
    assert train_losses(tmp_path / "compiled") == train_losses(tmp_path / "eager")


# ----------------------------------------------------------------------------- a rank killed while saving

KILLED_WHILE_SAVING = """
import os, sys, time
from pathlib import Path
from torch.distributed.checkpoint import FileSystemWriter
import train

marker, argv = Path(sys.argv[1]), sys.argv[2:]
real_write = FileSystemWriter.write_data

def write_data(self, *args, **kwargs):  # rank 1 stalls in the middle of step 3's save, to be killed there
    if os.environ["RANK"] == "1" and ".ckpt_000003.tmp" in str(self.path):
        marker.write_text(str(os.getpid()))
        time.sleep(600)
    return real_write(self, *args, **kwargs)

FileSystemWriter.write_data = write_data
sys.exit(train.main(argv))
"""


@pytest.mark.slow
def test_kill_9_of_one_rank_during_a_sharded_save_keeps_the_previous_checkpoint(data_dir, fsdp_run, tmp_path):
    script, marker, out = tmp_path / "killed.py", tmp_path / "rank1.pid", tmp_path / "out"
    script.write_text(KILLED_WHILE_SAVING)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(script),
        str(marker),
        *COMMON,
        f"--data_dir={data_dir}",
        f"--out_dir={out}",
        "--parallel=fsdp",
        "--save_interval=1",
    ]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    deadline = time.time() + 240
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert marker.exists(), proc.communicate(timeout=60)[1][-3000:]
    time.sleep(0.2)  # the pid is written first
    os.kill(int(marker.read_text()), signal.SIGKILL)
    _, stderr = proc.communicate(timeout=180)
    assert proc.returncode != 0  # torchrun saw a worker die

    assert (out / ".ckpt_000003.tmp").is_dir() and not (out / "ckpt_000003").exists()
    assert load_latest_checkpoint(out, consolidate=False)[1] == out / "ckpt_000002"
    assert train.main(["--init_from=resume", f"--out_dir={out}", "--max_steps=4"]) == 0  # in one process
    assert close(train_losses(out), steps(train_losses(fsdp_run), 1, 4))
    assert not (out / ".ckpt_000003.tmp").exists()  # the next save cleared what the killed one left


COUNTING_HASHES = """
import json, os, sys
import train
from gpt2train import checkpoint, files

out, argv = sys.argv[1], sys.argv[2:]
hashed, real = [], files.file_sha256

def file_sha256(path, **kw):  # what each rank hashes before its first step
    if not hashed or hashed[-1] != "started":
        hashed.append(os.path.basename(str(path)))
    return real(path, **kw)

checkpoint.file_sha256 = file_sha256
real_restore = train.restore
train.restore = lambda *a, **k: hashed.append("started") or real_restore(*a, **k)
try:
    sys.exit(train.main(argv))
finally:
    with open(out + os.environ["RANK"], "w") as f:
        json.dump(hashed, f)
"""


@pytest.mark.slow
def test_only_rank_0_hashes_the_checkpoint_and_every_rank_takes_its_choice(fsdp_world):
    """A damaged newest checkpoint: rank 0 hashes it, skips it and hashes the one before; rank 1 hashes nothing,
    picks the newest complete one and then resumes from rank 0's choice (issue 24: 18.7 GB x 64 ranks)."""
    result = fsdp_world["hashed"]  # COUNTING_HASHES resuming a 4-step one-process run, its step 4 damaged
    out = result.out_dir
    newest = out / "ckpt_000004.pt"
    assert f"note: skipping {newest}: damaged" in result.stderr and "resumed from step 2" in result.stdout
    hashed = [json.loads(Path(f"{result.args[0]}{r}").read_text()) for r in range(2)]
    assert hashed == [["ckpt_000004.pt", "ckpt_000002.pt", "started"], ["started"]]
    assert close(train_losses(out), fsdp_world["hashed_losses"])  # steps 3 and 4 again, as the single process did them
    assert load_checkpoint(newest)["step"] == 4  # rewritten, and verifies


def test_under_torchrun_a_rank_other_than_0_hashes_nothing(data_dir, tmp_path, monkeypatch):
    assert (
        train.main([*COMMON, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_steps=2", "--save_interval=1"])
        == 0
    )
    hashed, real = [], checkpoint.file_sha256
    monkeypatch.setattr(checkpoint, "file_sha256", lambda path, **kw: hashed.append(path) or real(path, **kw))
    user = train.parse_args(["--init_from=resume", f"--out_dir={tmp_path}"])
    for rank, expected in (("1", []), ("0", [tmp_path / "ckpt_000002.pt"])):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", "2")
        hashed.clear()
        cfg, source, problem = start.resolve_config_or_defer(user)
        assert hashed == expected, rank
        assert source.state["path"] == str(tmp_path / "ckpt_000002.pt") and problem is None


def test_a_sharded_resume_hashes_the_metadata_first_and_then_each_rank_its_share_of_the_shards(
    data_dir, tmp_path, monkeypatch
):
    """Under torchrun rank 0 hashes only a sharded checkpoint's metadata before the process group starts (not
    80 GB of shards alone against the rendezvous timeout); once the group is up every rank hashes every
    world_size-th shard file, and a damaged one is the same verdict on every rank."""
    tiny_sharded_checkpoint(tmp_path / "ckpt_000005")
    hashed, real = [], checkpoint.file_sha256
    monkeypatch.setattr(
        checkpoint, "file_sha256", lambda path, **kw: hashed.append(Path(path).name) or real(path, **kw)
    )
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg, source, problem = start.resolve_config_or_defer(
        train.parse_args(["--init_from=resume", f"--out_dir={tmp_path}", f"--data_dir={data_dir}"])
    )
    ckpt = source.resumed
    assert sorted(set(hashed)) == [".metadata", "meta.pt"] and problem is None and ckpt["step"] == 5
    sums = tmp_path / "ckpt_000005" / checkpoint.SUMS
    shards = sorted(set(checkpoint.read_checksums(sums)) - {".metadata", "meta.pt"})
    assert shards  # DCP's __0_0.distcp
    gathered = []  # the ranks' results, as all_gather_object hands them to each rank (here: this rank's, twice)
    monkeypatch.setattr(
        start.dist,
        "all_gather_object",
        lambda out, mine: (gathered.append(mine), out.__setitem__(slice(None), [mine] * 2)),
    )
    for rank in (0, 1):
        hashed.clear()
        start.verify_shards(ckpt, parallel.Env(rank, rank, 2, True, "cpu", "float32", "fsdp", (2,)))
        assert hashed == shards[rank::2]
    damaged = tmp_path / "ckpt_000005" / shards[0]
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 1
    damaged.write_bytes(bytes(data))
    reason = start.verify_shards(ckpt, parallel.Env(0, 0, 2, True, "cpu", "float32", "fsdp", (2,)))
    assert reason.startswith(f"{tmp_path / 'ckpt_000005'}: damaged: its sha256 is ")


@pytest.mark.slow
def test_a_damaged_newest_sharded_checkpoint_is_skipped_on_every_rank_as_one_process_skips_it(fsdp_run, fsdp_world):
    """Issue 38: torchrun resumes from the newest intact checkpoint, with the note one process gives, rather than
    stopping (an automatic restart, torchrun --max-restarts or a SLURM requeue, would fail every time)."""
    result = fsdp_world["damaged"]  # fsdp_run's checkpoints, a bit flipped in the newest's first shard (DAMAGE)
    newest = result.out_dir / "ckpt_000020"
    assert result.stderr.count(f"note: skipping {newest}: damaged: its sha256 is ") == 1, result.stderr
    assert "resumed from step 10" in result.stdout
    assert train_losses(result.out_dir) == steps(train_losses(fsdp_run), 11, 20)  # both ranks loaded step 10
    assert load_checkpoint(newest)["step"] == 20  # written again, and it verifies


# ----------------------------------------------------------------------------- evaluation of a sharded model

SHARDED_EVAL = """
import json, sys
import torch
import train
from gpt2train import assets, parallel, start
from gpt2train.config import make_config, model_config
from gpt2train.evaluation import Evaluator, sample_preview
from model import GPT
from gpt2train.scoring import Suite
from gpt2train.tasks import load_hellaswag
from gpt2train.tracking import NoTracker

examples, out = load_hellaswag(sys.argv[1]), sys.argv[2]
enc = assets.get_tokenizer()
cfg = make_config(dict(n_layer=2, n_head=2, n_embd=32, block_size=64, device="cpu", dtype="float32", compile=False,
                       parallel="fsdp", sample_tokens=12, sample_prompt="The", seed=7))
env = parallel.setup(cfg)
evaluator = Evaluator(None, None, NoTracker(), cfg, env, None)
evaluator.enc = enc
evaluator.suites["hellaswag"] = Suite({"hellaswag_llmc": examples}, enc, env.rank, env.world_size)  # as it keeps them
raw, cfg = train.build_model(cfg, start.Source("scratch"), env)  # as train.py builds a sharded run: on meta
model = train.parallelize(raw, cfg, env)
torch.manual_seed(cfg.seed)
alone = GPT(model_config(cfg))  # what one process starts from with the same seed
with parallel.gathered(raw, env) as whole:  # before any forward: FSDP's lazy initialisation happens here
    same_init = [n for n, t in whole.state_dict().items() if not torch.equal(t, alone.state_dict()[n])] == []
result = {"same_init": same_init, "sharded_after": type(raw.lm_head.weight).__name__,
          "hellaswag": evaluator.score("hellaswag", raw, train.StopRequest()),
          "hellaswag_alone": Suite({"hellaswag_llmc": examples}, enc).score(alone, "cpu"),
          "sample": sample_preview(raw, cfg, env, enc),
          "sample_alone": sample_preview(alone, cfg, env, enc)}
x = torch.randint(0, 100, (2, 64))
model(x, x, return_logits=False)[1].backward()  # training goes on after the gathered evaluations
result["trains_after"] = all(p.grad is not None for p in raw.parameters())
with open(out + str(env.rank), "w") as f:
    json.dump(result, f)
"""


@pytest.mark.slow
def test_sharded_model_starts_from_the_same_weights_evaluates_and_samples(fsdp_world):
    prefix = fsdp_world["eval"].args[1]  # SHARDED_EVAL on 7 HellaSwag examples: each rank's results in PREFIX{rank}
    ranks = [json.loads(Path(f"{prefix}{r}").read_text()) for r in range(2)]
    for r in ranks:
        assert r["same_init"] and r["sharded_after"] == "DTensor" and r["trains_after"]
        assert r["hellaswag"]["tasks"] == r["hellaswag_alone"]["tasks"]
    assert [len(r["hellaswag"]["preds"]) for r in ranks] == [4, 3]  # examples split over the ranks
    alone = {p["index"]: p["log_likelihoods"] for p in ranks[0]["hellaswag_alone"]["preds"]}
    for p in ranks[0]["hellaswag"]["preds"] + ranks[1]["hellaswag"]["preds"]:
        assert p["log_likelihoods"] == pytest.approx(alone[p["index"]], abs=1e-5)
    assert ranks[0]["sample"] == ranks[0]["sample_alone"] and len(ranks[0]["sample"]) > len("The")
    assert ranks[1]["sample"] is None  # rank 0 samples; the others only take part in the gather


# ----------------------------------------------------------------------------- one process reads the shards


def tiny_sharded_checkpoint(path, vocab_size=32):
    """A sharded checkpoint written by one process (the format does not depend on the world size)."""
    torch.manual_seed(0)
    cfg = make_config(dict(n_layer=1, n_head=2, n_embd=16, block_size=32, vocab_size=vocab_size))
    model = GPT(GPTConfig(**{k: getattr(cfg, k) for k in asdict(GPTConfig())}))
    optimizer = optim.adamw(model.parameters(), cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2))
    x = torch.randint(0, vocab_size, (2, 32))
    model(x, x, return_logits=False)[1].backward()
    optimizer.step()
    meta = {
        "model_args": asdict(model.config),
        "config": asdict(cfg),
        "step": 5,
        "val_loss": 3.5,
        "rng": [],
        "scaler": None,
        "loader": {},
        "best_step": None,
        "best_val_loss": None,
        "format": checkpoint.FORMAT,
    }
    save_sharded_checkpoint(path, meta, model, optimizer)
    return model, optimizer


def test_consolidate_and_export_a_sharded_checkpoint(tmp_path, capsys):
    model, optimizer = tiny_sharded_checkpoint(tmp_path / "ckpt_000005")
    assert checkpoint_command.main(["consolidate", str(tmp_path / "ckpt_000005"), str(tmp_path / "one.pt")]) == 0
    single = load_checkpoint(tmp_path / "one.pt")
    assert single["step"] == 5 and "shards" not in single
    assert all(torch.equal(t, single["model"][k]) for k, t in model.state_dict().items())
    saved, now = single["optimizer"], optimizer.state_dict()
    assert saved["param_groups"] == now["param_groups"]
    for i, state in now["state"].items():  # AdamW's moments, keyed by parameter index as optimizer.state_dict()
        assert all(torch.equal(v, saved["state"][i][k]) for k, v in state.items())

    loaded, info = loading.load_model(ckpt=str(tmp_path / "ckpt_000005"))  # straight from the shards
    assert info["step"] == 5 and all(torch.equal(t, loaded.state_dict()[k]) for k, t in model.state_dict().items())
    assert checkpoint_command.main(["export", str(tmp_path / "ckpt_000005"), str(tmp_path / "hf")]) == 0
    hf = from_pretrained(str(tmp_path / "hf"))
    assert all(torch.equal(t, hf.state_dict()[k]) for k, t in model.state_dict().items())
    assert checkpoint_command.main(["consolidate", str(tmp_path / "one.pt"), str(tmp_path / "x.pt")]) == 2
    assert "not a sharded checkpoint directory" in capsys.readouterr().err


def test_sample_and_hellaswag_read_a_sharded_checkpoint(tmp_path, capsys):
    tiny_sharded_checkpoint(tmp_path / "run" / "ckpt_000005", vocab_size=50304)
    checkpoint.consolidate(tmp_path / "run" / "ckpt_000005", tmp_path / "single" / "ckpt_000005.pt")
    (tmp_path / "hs.jsonl").write_text("".join(json.dumps(ex) + "\n" for ex in EXAMPLES))
    out = {}
    for name in ("run", "single"):  # an out_dir holding the sharded directory, and the single file
        args = ["--ckpt", str(tmp_path / name), "--device", "cpu", "--dtype", "float32"]
        assert sample.main([*args, "--prompt", "Hello", "--max_new_tokens", "8", "--seed", "3"]) == 0
        assert hellaswag.main([*args, "--data", str(tmp_path / "hs.jsonl"), "--json"]) == 0
        text = capsys.readouterr().out
        out[name] = (text.split("hellaswag:")[0], json.loads(text.splitlines()[-1]))
    assert out["run"] == out["single"] and out["run"][0].startswith("Hello")


def test_sharded_directories_are_listed_pruned_and_skipped_while_incomplete(tmp_path):
    for step in (1, 2, 3):
        tiny_sharded_checkpoint(tmp_path / f"ckpt_{step:06d}")
    (tmp_path / "ckpt_000003" / ".metadata").unlink()  # as if copied half-way
    shutil.copytree(tmp_path / "ckpt_000001", tmp_path / ".ckpt_000004.tmp")  # an interrupted save
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [1, 2, 3]
    assert load_latest_checkpoint(tmp_path, consolidate=False)[1] == tmp_path / "ckpt_000002"
    meta = load_checkpoint(tmp_path, consolidate=False)
    assert meta["shards"] == str(tmp_path / "ckpt_000002") and "model" not in meta
    with pytest.raises(checkpoint.CheckpointError, match="incomplete sharded checkpoint"):
        load_checkpoint(tmp_path / "ckpt_000003")
    checkpoint.prune_checkpoints(tmp_path, keep_last=1, keep_steps={1})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt_000001", "ckpt_000003"]


# ----------------------------------------------------------------------------- configuration


def test_parallel_is_ignored_without_torchrun(data_dir, tmp_path, capsys):
    assert (
        train.main([*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_steps=2", "--parallel=fsdp"]) == 0
    )
    err = capsys.readouterr().err
    assert "note: parallel='fsdp' ignored: not launched by torchrun" in err and err.count("note:") == 1
    assert (tmp_path / "ckpt_000002.pt").is_file()
