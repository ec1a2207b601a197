"""config.py: config files, --key=value overrides, validation as one-line errors, the documented keys and the
shipped configs."""

from pathlib import Path

import pytest
import torch

from gpt2train import config
from gpt2train.config import ConfigError, TrainConfig, make_config, parse_args
from tiny import expect_exit, one_line_error, run

ROOT = Path(__file__).resolve().parent.parent


def test_config_file_then_command_line(tmp_path):
    cfg_file = tmp_path / "my.py"
    cfg_file.write_text(
        "import math\n_private = 3\nn_layer = 4\nlearning_rate = 1e-3\nout_dir = 'out/a'\n"
        "min_lr = 0  # an int is fine for a float key\n"
    )
    user = parse_args([str(cfg_file), "--n_layer=6", "--out_dir=out/b", "--compile=auto", "--lr_decay_steps=None"])
    assert user == {
        "n_layer": 6,
        "learning_rate": 1e-3,
        "out_dir": "out/b",
        "min_lr": 0.0,
        "compile": "auto",
        "lr_decay_steps": None,
    }
    cfg = make_config(user)
    assert cfg.n_layer == 6 and isinstance(cfg.min_lr, float) and cfg.batch_size == TrainConfig().batch_size
    assert parse_args(["--out_dir=123"]) == {"out_dir": "123"}  # a str key keeps the text as written


def test_the_config_table_marks_keys_from_the_config_file_and_the_command_line(tmp_path):
    cfg_file = tmp_path / "my.py"
    cfg_file.write_text("n_layer = 4\n")
    user = parse_args([str(cfg_file), "--max_steps=7"])
    table = config.config_table(make_config(user), user).splitlines()
    assert table[0] == "config ('*' = set in a config file or by --key=value):"
    marked = {line.split()[1] for line in table[1:] if line.lstrip().startswith("*")}
    assert marked == {"n_layer", "max_steps"}


def test_max_steps_and_max_seconds_set_later_replace_each_other_and_together_are_refused(tmp_path):
    steps_file, budget_file, both_file = tmp_path / "steps.py", tmp_path / "budget.py", tmp_path / "both.py"
    steps_file.write_text("max_steps = 300\nn_layer = 4\n")
    budget_file.write_text("max_seconds = 60\n")
    both_file.write_text("max_steps = 300\nmax_seconds = 60\n")
    # a budget on the command line replaces a config file's max_steps, and max_steps a file's budget
    assert parse_args([str(steps_file), "--max_seconds=30"]) == {"n_layer": 4, "max_seconds": 30.0}
    assert parse_args([str(budget_file), "--max_steps=5"]) == {"max_steps": 5}
    assert parse_args([str(steps_file), str(budget_file)]) == {"n_layer": 4, "max_seconds": 60.0}
    assert parse_args(["--max_seconds=None", "--max_steps=5"]) == {"max_steps": 5}  # no budget: not ambiguous
    for args, where, steps in (
        ([str(both_file)], str(both_file), 300),
        (["--max_steps=5", "--max_seconds=60"], "the command line", 5),
    ):
        with pytest.raises(ConfigError) as err:
            parse_args(args)
        assert str(err.value) == (
            f"{where} sets both max_steps={steps} and max_seconds=60: set one (a budget fixes max_steps from the "
            "first steps' timing)"
        )
    # a resume's max_steps replaces the checkpoint's budget; its budget alone keeps the checkpoint's fixed max_steps
    base = vars(TrainConfig(max_seconds=60.0, max_steps=412))
    assert make_config({"max_steps": 800}, base=base).max_seconds is None
    assert make_config({"max_seconds": 60.0}, base=base).max_steps == 412


def test_a_horizon_from_compute_replaces_a_length_set_earlier_and_beside_another_is_refused(tmp_path):
    steps_file = tmp_path / "steps.py"
    steps_file.write_text("max_steps = 300\nn_layer = 4\n")
    # a config file's max_steps gives way to target_flops on the command line (ladder.py's rungs), and back
    assert parse_args([str(steps_file), "--target_flops=1e12"]) == {"n_layer": 4, "target_flops": 1e12}
    assert parse_args(["--tokens_per_param=20", str(steps_file)]) == {"max_steps": 300, "n_layer": 4}
    with pytest.raises(ConfigError) as err:
        parse_args(["--target_flops=1e12", "--max_steps=5"])
    assert str(err.value) == (
        "the command line sets both max_steps=5 and target_flops=1e+12: set one (each fixes how long the run trains)"
    )
    # a resume's max_steps replaces the checkpoint's horizon; a new horizon the checkpoint's budget
    base = vars(TrainConfig(target_flops=1e12))
    assert make_config({"max_steps": 800}, base=base).target_flops is None
    budget = make_config({"target_flops": 1e13}, base=vars(TrainConfig(max_seconds=60.0)))
    assert budget.max_seconds is None and budget.target_flops == 1e13
    with pytest.raises(ConfigError, match="the config sets both target_flops=1e\\+12 and tokens_per_param=20"):
        TrainConfig(target_flops=1e12, tokens_per_param=20.0)


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--lerning_rate=1e-3"], "unknown config key 'lerning_rate' (did you mean 'learning_rate'?)"),
        (["--max_steps=1.5"], "config key 'max_steps' expects int, got float 1.5"),
        (["--learning_rate=fast"], "config key 'learning_rate' expects float, got str 'fast'"),
        (["--bias=1"], "config key 'bias' expects bool, got int 1"),
        (["--lr_schedule=linear"], "config key 'lr_schedule' must be one of 'cosine', 'wsd'"),
        (["--compile=yes"], "config key 'compile' must be one of True, False, 'auto'"),
        (["--n_embd=100", "--n_head=3"], "n_embd=100 must be divisible by n_head=3"),
        (["--head_lr=1e-3"], "config key 'head_lr' needs tie_embeddings=False: a tied head is the token embedding"),
        (["--embedding_lr=0.0"], "config key 'embedding_lr' must be > 0; got 0.0"),
        (["--smear=True", "--n_embd=8", "--n_head=2"], "smear=True reads 16 channels; n_embd=8 has fewer"),
        (["--bigram_embeds=1"], "GPTConfig: bigram_embeds=1, expected 0 or >= 2"),
        (["--max_steps"], "write overrides as --key=value"),
        (["--max_seconds=0"], "config key 'max_seconds' must be > 0; got 0.0"),
        (["no/such/config.py"], "config file 'no/such/config.py' not found"),
    ],
)
def test_bad_config_is_a_one_line_error(args, expected):
    with pytest.raises(ConfigError) as err:
        make_config(parse_args(args))
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_unknown_key_in_config_file_names_the_file(tmp_path):
    cfg_file = tmp_path / "c.py"
    cfg_file.write_text("batch_sise = 8\n")
    with pytest.raises(ConfigError, match=r"c\.py: unknown config key 'batch_sise' \(did you mean 'batch_size'\?\)"):
        parse_args([str(cfg_file)])


def test_every_key_is_documented():
    docs = config.config_docs()
    assert set(docs) == {f for f in config.FIELD_TYPES}
    assert all(comment for _, comment in docs.values())


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.py")), ids=lambda p: p.name)
def test_shipped_configs_are_valid(path):
    # chat_demo fine-tunes out/shakespeare (make demo's run, absent here): its model is that run's shape
    demo_model = ["--init_from=scratch", "--block_size=128"] if path.name == "chat_demo.py" else []
    cfg = make_config(parse_args([str(path), *demo_model]))
    if cfg.total_batch_size:  # divisible on the intended 8 GPUs (the demos: on 1 CPU process)
        ranks = 1 if path.name in ("shakespeare_cpu.py", "chat_demo.py") else 8
        assert cfg.total_batch_size % (cfg.batch_size * cfg.block_size * ranks) == 0


def test_gpt2_124m_config_is_the_recipe():
    cfg = make_config(parse_args([str(ROOT / "configs" / "gpt2_124m.py")]))
    recipe = dict(
        n_layer=12,
        n_head=12,
        n_embd=768,
        block_size=1024,
        batch_size=64,
        total_batch_size=524288,
        learning_rate=6e-4,
        min_lr=6e-5,
        warmup_steps=715,
        max_steps=19073,
        weight_decay=0.1,
        grad_clip=1.0,
        dtype="bfloat16",
        compile=True,
        hellaswag_interval=250,
        lr_schedule="cosine",
    )
    assert {k: getattr(cfg, k) for k in recipe} == recipe


# ----------------------------------------------------------------------------- a run refuses a bad config


def test_total_batch_size_must_divide(data_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        run(data_dir, tmp_path, "--total_batch_size=100")  # micro-batch is 4 x 16 = 64 tokens
    assert exit_.value.code == 2
    assert (
        "total_batch_size=100 is not a multiple of batch_size*block_size*world_size = 4*16*1 = 64"
        in capsys.readouterr().err
    )


@pytest.mark.parametrize(
    "args, config_file, expected",
    [
        (["--learning_rate=1e999"], None, "config key 'learning_rate' must be a finite number; got inf"),
        ([], "grad_clip = float('nan')\n", "config key 'grad_clip' must be a finite number; got nan"),
        (["--beta2=1.5"], None, "config key 'beta2' must be in [0, 1); got 1.5"),
        ([], "learning_rate = float('nan')\n", "config key 'learning_rate' must be a finite number; got nan"),
        (["--weight_decay=-1"], None, "config key 'weight_decay' must be >= 0; got -1.0"),
        (["--min_lr=0.01"], None, "config key 'min_lr' must be <= learning_rate=0.003; got 0.01"),
        (["--dropout=1.0"], None, "dropout"),
    ],
)
def test_bad_float_settings_are_one_line_errors_before_any_step(
    data_dir, tmp_path, capsys, args, config_file, expected
):
    files = []
    if config_file:
        (tmp_path / "cfg.py").write_text(config_file)
        files = [str(tmp_path / "cfg.py")]
    expect_exit(2, run, data_dir, tmp_path / "out", *files, *args)
    line = one_line_error(capsys)
    assert expected in line
    assert not (tmp_path / "out" / "metrics.jsonl").exists()  # refused before any work


@pytest.mark.parametrize(
    "arg, expected",
    [
        ("--device=gpu", "config key 'device': 'gpu' is not a device ('auto', 'cpu', 'cuda', 'cuda:N' or 'mps')"),
        ("--device=cuda", "config key 'device': 'cuda': "),
        (
            "--init_from=gpt3",
            "config key 'init_from' must be 'scratch', 'resume', one of gpt2, gpt2-medium, gpt2-large, "
            "gpt2-xl, a Hugging Face model directory or a checkpoint of this library (a ckpt_XXXXXX.pt "
            "file, a ckpt_XXXXXX/ directory or a run's out_dir); got 'gpt3' (no such file or directory)",
        ),
    ],
)
def test_bad_device_or_init_from_is_one_line(data_dir, tmp_path, capsys, arg, expected):
    if arg == "--device=cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    expect_exit(2, run, data_dir, tmp_path, "--max_steps=4", arg)
    assert expected in one_line_error(capsys)
