"""GPT-NeoX / Pythia and the other architecture options of GPTConfig: parallel residual, untied head, exact
GELU, ReLU², QK-norm, zero-initialised projections. Parity with transformers' GPTNeoXForCausalLM both ways,
KV-cache decoding, presets' parameter counts, config validation, a tiny end-to-end run through train.py."""

import json
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from transformers import GPT2LMHeadModel, GPTNeoXConfig, GPTNeoXForCausalLM

import model as M
from gpt2train import hf as hf_io
from gpt2train import optim
from gpt2train.generation import Sampling, generate
from gpt2train.hf import from_pretrained, save_pretrained
from model import GPT, PRESETS, GPTConfig
from test_model import perturb_, shifted_targets, single_thread, small_gpt  # noqa: F401  (autouse fixture)

ROOT = Path(__file__).resolve().parent.parent
PYTHIA_LIKE = dict(rotary_pct=0.25, parallel_residual=True, tie_embeddings=False, activation="gelu")


def hf_neox(rotary_pct=0.25, parallel=True, tied=False, base=10000.0, seed=0) -> GPTNeoXForCausalLM:
    torch.manual_seed(seed)
    cfg = GPTNeoXConfig(
        vocab_size=96,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=32,
        rotary_pct=rotary_pct,
        rotary_emb_base=base,
        use_parallel_residual=parallel,
        tie_word_embeddings=tied,
        hidden_act="gelu",
        attn_implementation="eager",
    )
    return perturb_(GPTNeoXForCausalLM(cfg)).eval()


def ours_vs_hf_params(ours: GPT, hf: GPTNeoXForCausalLM, grads=False) -> float:
    """Max abs difference of every parameter (or its gradient) against the HF model, names and QKV layout mapped."""
    hf_params, diff = dict(hf.named_parameters()), 0.0
    for k, p in ours.named_parameters():
        name = hf_io._hf_name(k, neox=True)
        ref = hf_params["lm_head.weight" if name == "embed_out.weight" else name]
        ref = ref.grad if grads else ref
        ref = hf_io._qkv_from_neox(ref, ours.config.n_head) if ".c_attn." in k else ref
        diff = max(diff, ((p.grad if grads else p) - ref).abs().max().item())
    return diff


CASES = [(0.25, True), (0.25, False), (1.0, True), (1.0, False)]  # rotary_pct, parallel residual


# ----------------------------------------------------------------------------- Hugging Face GPT-NeoX


@pytest.mark.parametrize("rotary_pct,parallel", CASES)
def test_neox_import_matches_hf_logits_and_loss(tmp_path, rotary_pct, parallel):
    hf = hf_neox(rotary_pct, parallel)
    hf.save_pretrained(tmp_path)  # transformers 5 writes rope_parameters, not rotary_pct
    ours = from_pretrained(str(tmp_path)).eval()
    cfg = ours.config
    assert (cfg.rotary_pct, cfg.parallel_residual, cfg.tie_embeddings, cfg.activation) == (
        rotary_pct,
        parallel,
        False,
        "gelu",
    )

    idx = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(idx, labels=idx)
        logits, loss = ours(idx, shifted_targets(idx))
    diff = (logits - ref.logits).abs().max().item()
    print(f"GPT-NeoX import parity (rotary_pct={rotary_pct}, parallel={parallel}): max abs logit diff {diff:.2e}")
    assert diff <= 1e-4
    assert abs(loss.item() - ref.loss.item()) <= 1e-5


@pytest.mark.parametrize("rotary_pct,parallel", CASES)
def test_neox_export_matches_hf_and_round_trips(tmp_path, rotary_pct, parallel):
    ours = perturb_(small_gpt(**{**PYTHIA_LIKE, "rotary_pct": rotary_pct, "parallel_residual": parallel}))
    save_pretrained(ours, str(tmp_path))
    hf = GPTNeoXForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert hf.config.use_parallel_residual is parallel and not hf.config.tie_word_embeddings

    idx = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, _ = ours(idx, shifted_targets(idx))
        ref = hf(idx).logits
        back, _ = from_pretrained(str(tmp_path)).eval()(idx, shifted_targets(idx))
    diff = (logits - ref).abs().max().item()
    print(f"GPT-NeoX export parity (rotary_pct={rotary_pct}, parallel={parallel}): max abs logit diff {diff:.2e}")
    assert diff <= 1e-4
    assert torch.equal(back, logits)  # through our own loader: exact


@pytest.mark.parametrize("direction", ["import", "export"])
def test_neox_tied_head_both_ways(tmp_path, direction):
    if direction == "import":
        hf_neox(tied=True).save_pretrained(tmp_path)
        ours = from_pretrained(str(tmp_path)).eval()
        assert ours.config.tie_embeddings and ours.lm_head.weight is ours.transformer.wte.weight
    else:
        ours = perturb_(small_gpt(**{**PYTHIA_LIKE, "tie_embeddings": True}))
        save_pretrained(ours, str(tmp_path))
    hf = GPTNeoXForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert hf.config.tie_word_embeddings
    idx = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(idx, idx)[0] - hf(idx).logits).abs().max() <= 1e-4


def test_neox_import_reads_pythia_hub_files(tmp_path):
    """The layout of the Pythia checkpoints: transformers-4 config keys (rotary_pct, rotary_emb_base), a
    pytorch_model.bin with embed_out and old buffers (rotary inv_freq, causal mask), sharded with an index."""
    hf = hf_neox(rotary_pct=0.5, parallel=True, base=500.0)
    config = {k: v for k, v in json.loads(hf.config.to_json_string()).items() if k != "rope_parameters"}
    config.update(rotary_pct=0.5, rotary_emb_base=500, rope_scaling=None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    sd = {("embed_out.weight" if k == "lm_head.weight" else k): v.clone() for k, v in hf.state_dict().items()}
    for i in range(2):
        sd[f"gpt_neox.layers.{i}.attention.rotary_emb.inv_freq"] = torch.ones(4)
        sd[f"gpt_neox.layers.{i}.attention.bias"] = torch.ones(1, 1, 32, 32).tril().bool()
        sd[f"gpt_neox.layers.{i}.attention.masked_bias"] = torch.tensor(-1e9)
    names = sorted(sd)
    shards = {"pytorch_model-00001-of-00002.bin": names[:10], "pytorch_model-00002-of-00002.bin": names[10:]}
    for file, keys in shards.items():
        torch.save({k: sd[k] for k in keys}, tmp_path / file)
    index = {"weight_map": {k: file for file, keys in shards.items() for k in keys}}
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps(index))

    ours = from_pretrained(str(tmp_path)).eval()
    assert ours.config.rotary_base == 500.0 and ours.config.rot_dim == 8
    idx = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(idx, idx)[0] - hf(idx).logits).abs().max() <= 1e-4


def test_neox_import_errors_are_clear(tmp_path):
    hf_neox().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for key, value, match in (
        ("intermediate_size", 100, "intermediate_size=100"),
        ("hidden_act", "silu", "hidden_act='silu'"),
        ("rope_parameters", {"rope_type": "linear", "factor": 2.0}, "rope_type='linear'"),
        ("model_type", "llama", "model_type='llama'"),
    ):
        (tmp_path / "config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(ValueError, match=match):
            from_pretrained(str(tmp_path))


def test_neox_adamw_step_matches_hf_plus_torch_adamw(tmp_path):
    hf = hf_neox(rotary_pct=0.25, parallel=True)
    hf.save_pretrained(tmp_path)
    ours = from_pretrained(str(tmp_path))
    hf.train(), ours.train()
    lr, wd, betas = 1e-3, 0.1, (0.9, 0.95)
    params = list(hf.parameters())
    hf_opt = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": wd},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=lr,
        betas=betas,
    )
    opt = optim.adamw(ours.parameters(), wd, lr, betas)
    gen, grad_diff = torch.Generator().manual_seed(0), 0.0
    for _ in range(2):
        idx = torch.randint(0, 96, (2, 32), generator=gen)
        hf(idx, labels=idx).loss.backward()
        ours(idx, shifted_targets(idx), return_logits=False)[1].backward()  # the chunked loss: the untied head
        grad_diff = max(ours_vs_hf_params(ours, hf, grads=True), grad_diff)
        # as for GPT-2: the key biases get no gradient in exact arithmetic, only float noise that Adam would
        # blow up to +-lr; in NeoX's interleaved layout they are rows hs..2hs of each head's 3*hs block
        for block in ours.transformer.h:
            block.attn.c_attn.bias.grad[32:64] = 0.0
        for layer in hf.gpt_neox.layers:
            layer.attention.query_key_value.bias.grad.view(2, 3, 16)[:, 1] = 0.0
        hf_opt.step(), opt.step()
        hf_opt.zero_grad(), opt.zero_grad()
    diff = ours_vs_hf_params(ours, hf)
    print(f"GPT-NeoX AdamW 2-step parameter diff vs transformers + torch AdamW: {diff:.2e}; grad diff {grad_diff:.2e}")
    assert grad_diff <= 1e-6
    assert diff <= 1e-5


# ----------------------------------------------------------------------------- Hugging Face GPT-2 with the options


@pytest.mark.parametrize(
    "options",
    [
        dict(tie_embeddings=False),
        dict(activation="gelu"),
        dict(activation="relu2"),
        dict(layer_norm_eps=1e-6, zero_init_proj=True),
    ],
    ids=str,
)
def test_gpt2_export_of_options_matches_hf(tmp_path, options):
    ours = perturb_(small_gpt(vocab_size=50304, **options))
    save_pretrained(ours, str(tmp_path))
    hf = GPT2LMHeadModel.from_pretrained(tmp_path, attn_implementation="eager").eval()
    idx = torch.randint(0, 50257, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, _ = ours(idx, shifted_targets(idx))
        back = from_pretrained(str(tmp_path)).eval()
        back_logits, _ = back(idx, shifted_targets(idx))
        assert (logits[..., :50257] - hf(idx).logits).abs().max() <= 1e-5
    assert torch.equal(back_logits, logits[..., :50257])
    assert all(getattr(back.config, k) == v for k, v in options.items() if k != "zero_init_proj")


@pytest.mark.parametrize(
    "options",
    [dict(qk_norm=True), dict(qk_norm=True, rotary_pct=0.5), dict(parallel_residual=True)],
    ids=str,
)
def test_a_model_neither_gpt2_nor_neox_holds_exports_as_its_own_code(tmp_path, options):
    """QK-norm, or a parallel residual with learned positions: the gpt2train route (tests/test_export.py loads it)."""
    save_pretrained(small_gpt(**options), str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "gpt2train" and all(config[k] == v for k, v in options.items())


# ----------------------------------------------------------------------------- the options themselves


def test_parallel_residual_block_is_one_step():
    model = perturb_(small_gpt(parallel_residual=True))
    block, x = model.transformer.h[0], torch.randn(2, 8, 32)
    with torch.no_grad():
        expected = x + block.attn(block.ln_1(x)) + block.mlp(block.ln_2(x))
        assert torch.equal(block(x), expected)
        sequential = x + block.attn(block.ln_1(x))
        assert (block(x) - (sequential + block.mlp(block.ln_2(sequential)))).abs().max() > 1e-3


@pytest.mark.parametrize(
    "activation,reference",
    [
        ("gelu_tanh", lambda h: 0.5 * h * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (h + 0.044715 * h**3)))),
        ("gelu", lambda h: 0.5 * h * (1 + torch.erf(h / 2**0.5))),
        ("relu2", lambda h: torch.clamp(h, min=0) ** 2),
    ],
)
def test_mlp_activations(activation, reference):
    mlp = perturb_(small_gpt(activation=activation)).transformer.h[0].mlp
    x = torch.randn(2, 8, 32, dtype=torch.float64)
    mlp = mlp.double()
    with torch.no_grad():
        expected = mlp.c_proj(reference(mlp.c_fc(x)))
        assert (mlp(x) - expected).abs().max() <= 1e-12


def test_qk_norm_makes_attention_blind_to_query_and_key_scale():
    attn = perturb_(small_gpt(qk_norm=True, rotary_pct=0.5)).transformer.h[0].attn
    x = torch.randn(2, 8, 32)
    with torch.no_grad():
        ref = attn(x)
        attn.c_attn.weight[:64] *= 7.0  # query and key rows (and biases): a per-head rescaling
        attn.c_attn.bias[:64] *= 7.0
        assert (attn(x) - ref).abs().max() <= 1e-5
        attn.qk_norm = False
        assert (attn(x) - ref).abs().max() > 1e-2  # without the norm the scores do change


def test_zero_init_proj_starts_each_block_as_the_identity_and_still_learns():
    model = small_gpt(zero_init_proj=True)
    for block in model.transformer.h:
        assert block.attn.c_proj.weight.abs().max() == 0 and block.mlp.c_proj.weight.abs().max() == 0
    idx = torch.randint(0, 96, (2, 16))
    pos = torch.arange(16)
    with torch.no_grad():
        embedded = model.transformer.wte(idx) + model.transformer.wpe(pos)
        assert torch.equal(model.hidden_states(idx), model.transformer.ln_f(embedded))
    model(idx, idx)[1].backward()
    assert model.transformer.h[0].mlp.c_proj.weight.grad.abs().max() > 0


def test_untied_head_is_its_own_parameter_and_counts():
    tied, untied = small_gpt(), small_gpt(tie_embeddings=False)
    assert untied.lm_head.weight is not untied.transformer.wte.weight
    assert set(untied.state_dict()) == set(tied.state_dict())  # same checkpoint keys either way
    head = untied.lm_head.weight.numel()
    assert untied.num_params() == tied.num_params() + head
    # the untied wte is a lookup (no FLOPs), the head a matmul: flops_per_token counts the head once
    assert untied.num_params(non_embedding=True) == tied.num_params(non_embedding=True)
    assert untied.flops_per_token() == tied.flops_per_token()
    opt = optim.adamw(untied.parameters(), 0.1, 1e-3, (0.9, 0.95))
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == untied.num_params()


def test_untied_head_gets_the_chunked_loss_gradient(monkeypatch):
    monkeypatch.setattr(M, "LOSS_CHUNK_ROWS", 7)
    model = perturb_(small_gpt(tie_embeddings=False))
    idx = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))

    def grads(return_logits):
        model.zero_grad()
        model(idx, shifted_targets(idx), return_logits=return_logits)[1].backward()
        return model.lm_head.weight.grad.clone(), model.transformer.wte.weight.grad.clone()

    (head_full, wte_full), (head_chunk, wte_chunk) = grads(True), grads(False)
    assert (head_full - head_chunk).abs().max() <= 1e-6 and (wte_full - wte_chunk).abs().max() <= 1e-6
    assert (head_full - wte_full).abs().max() > 1e-3  # two different gradients: really untied


def test_untied_model_state_dict_round_trips_and_resumes_exactly():
    """Train 3 steps, save model + optimizer, train 3 more; a fresh model loaded from the save matches exactly."""

    def step(model, opt, seed):
        idx = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(seed))
        model(idx, shifted_targets(idx), return_logits=False)[1].backward()
        opt.step(), opt.zero_grad()

    model = small_gpt(**PYTHIA_LIKE).train()
    opt = optim.adamw(model.parameters(), 0.1, 1e-2, (0.9, 0.95))
    for s in range(3):
        step(model, opt, s)
    saved = {k: v.clone() for k, v in model.state_dict().items()}, opt.state_dict()
    saved = (
        saved[0],
        {
            "state": {k: {n: t.clone() for n, t in v.items()} for k, v in saved[1]["state"].items()},
            "param_groups": saved[1]["param_groups"],
        },
    )
    for s in range(3, 6):
        step(model, opt, s)

    resumed = small_gpt(seed=99, **PYTHIA_LIKE).train()
    resumed.load_state_dict(saved[0])
    assert resumed.lm_head.weight is not resumed.transformer.wte.weight
    assert not torch.equal(resumed.lm_head.weight, resumed.transformer.wte.weight)
    opt2 = optim.adamw(resumed.parameters(), 0.1, 1e-2, (0.9, 0.95))
    opt2.load_state_dict(saved[1])
    for s in range(3, 6):
        step(resumed, opt2, s)
    for k, v in model.state_dict().items():
        assert torch.equal(v, resumed.state_dict()[k]), k


@pytest.mark.parametrize(
    "options",
    [
        PYTHIA_LIKE,
        dict(PYTHIA_LIKE, rotary_pct=1.0),
        dict(qk_norm=True, activation="relu2", tie_embeddings=False, rotary_pct=1.0),
        dict(qk_norm=True, zero_init_proj=True),
    ],
    ids=str,
)
@pytest.mark.parametrize("prompt_len", [1, 17])
def test_kv_cache_greedy_equals_recompute_for_the_options(options, prompt_len):
    model = perturb_(small_gpt(**options), scale=0.2)
    idx = torch.randint(0, 96, (2, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
    cached = generate(model, idx, 40 - prompt_len, Sampling(temperature=0.0), use_kv_cache=True)
    plain = generate(model, idx, 40 - prompt_len, Sampling(temperature=0.0), use_kv_cache=False)
    assert torch.equal(cached, plain)
    seq = cached[:, :12]
    with torch.no_grad():  # and the cached hidden states equal the full forward's
        full = model.hidden_states(seq)
        caches = [M.KVCache(32) for _ in model.transformer.h]
        parts = [model.hidden_states(seq[:, :5], caches, 0)]
        parts += [model.hidden_states(seq[:, t : t + 1], caches, t) for t in range(5, 12)]
    assert (torch.cat(parts, dim=1) - full).abs().max() <= 1e-5


# ----------------------------------------------------------------------------- partial rotary, two formulations


def load_bench_rotary():
    from bench import rotary

    return rotary


@pytest.mark.parametrize("rot_dim", [2, 4, 10, 16])  # of head_dim 16: from one pair to the full head
def test_zero_frequency_rotary_gives_the_same_bits_as_slicing(rot_dim):
    R = load_bench_rotary()
    x = torch.randn(2, 3, 32, 16, generator=torch.Generator().manual_seed(rot_dim))
    cos, sin = R.slice_tables(rot_dim, 16, 32)
    zcos, zsin = R.zero_freq_tables(rot_dim, 16, 32)
    assert zcos.shape == (32, 16) and torch.equal(zsin[:, rot_dim:], torch.zeros(32, 16 - rot_dim))
    sliced = M.apply_rotary(x, cos, sin)
    assert torch.equal(R.apply_slice(x, cos, sin), sliced)
    assert torch.equal(R.make_zero_freq(rot_dim)(x, zcos, zsin), sliced)
    assert not torch.equal(sliced[..., :rot_dim], x[..., :rot_dim])  # something was rotated


def test_zero_frequency_rotary_model_gives_the_same_loss_and_grads(monkeypatch):
    R = load_bench_rotary()
    model = perturb_(small_gpt(**PYTHIA_LIKE))
    idx = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(0))

    def loss_and_grads():
        model.zero_grad()
        loss = model(idx, shifted_targets(idx))[1]
        loss.backward()
        return loss, [p.grad.clone() for p in model.parameters()]

    loss, grads = loss_and_grads()
    monkeypatch.setattr(M, "apply_rotary", M.apply_rotary)  # restored after the test
    R.use_variant(model, "zero-freq")
    assert model.rope_cos.shape == (32, 16)
    zloss, zgrads = loss_and_grads()
    assert torch.equal(loss, zloss) and all(torch.equal(a, b) for a, b in zip(grads, zgrads))


# ----------------------------------------------------------------------------- presets and config

PUBLISHED = {  # total parameters of the released checkpoints (Pythia model card; GPT-NeoX-20B paper)
    "pythia-70m": 70_426_624,
    "pythia-160m": 162_322_944,
    "pythia-410m": 405_334_016,
    "pythia-1b": 1_011_781_632,
    "pythia-1.4b": 1_414_647_808,
    "pythia-2.8b": 2_775_208_960,
    "pythia-6.9b": 6_857_302_016,
    "pythia-12b": 11_846_072_320,
    "neox-20b": 20_554_567_680,
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_neox_presets_have_the_published_parameter_counts(name):
    cfg = GPTConfig(**PRESETS[name])
    assert (cfg.block_size, cfg.rotary_pct, cfg.parallel_residual, cfg.tie_embeddings, cfg.activation) == (
        2048,
        0.25,
        True,
        False,
        "gelu",
    )
    with torch.device("meta"):
        model = GPT(cfg)
    assert model.num_params() == PUBLISHED[name]  # the checkpoints' padded vocabularies: exact


@pytest.mark.parametrize(
    "key,value,match",
    [
        ("activation", "swish", "activation='swish', expected one of 'gelu_tanh', 'gelu', 'relu2'"),
        ("parallel_residual", 1, "parallel_residual=1, expected True or False"),
        ("tie_embeddings", "no", "tie_embeddings='no'"),
        ("qk_norm", None, "qk_norm=None"),
        ("n_layer", 0, "n_layer=0, expected a positive integer"),
        ("vocab_size", 50304.0, "vocab_size=50304.0"),
        ("block_size", True, "block_size=True"),
        ("dropout", 1.0, r"dropout=1.0, expected a number in \[0, 1\)"),
        ("rotary_base", 0.0, "rotary_base=0.0"),
        ("layer_norm_eps", -1e-5, "layer_norm_eps=-1e-05"),
        ("rotary_pct", "0.25", "rotary_pct='0.25'"),
    ],
)
def test_config_validates_every_field_in_one_line(key, value, match):
    with pytest.raises(ValueError, match=match) as err:
        GPTConfig(**{key: value})
    assert "\n" not in str(err.value) and str(err.value).startswith("GPTConfig: ")


def test_every_preset_is_a_valid_full_config():
    known = {f.name for f in fields(GPTConfig)}
    for name, preset in M.PRESETS.items():
        assert {"n_layer", "n_head", "n_embd", "block_size", "vocab_size"} <= set(preset) <= known, name
        GPTConfig(**preset)


# ----------------------------------------------------------------------------- end to end through train.py


@pytest.mark.slow
def test_neox_hf_dir_fine_tunes_resumes_exactly_and_samples(tmp_path):
    """init_from=<a GPT-NeoX HF dir> trains (parallel residual, untied head), resumes bit-exactly, and its
    checkpoint loads in sample.py's loader and generates."""
    import train
    from gpt2train import loading
    from gpt2train.shards import write_shard
    from tiny import markov_tokens

    data = tmp_path / "data"
    write_shard(data / "tiny_train_000000.bin", markov_tokens(30_000, seed=1))
    write_shard(data / "tiny_val_000000.bin", markov_tokens(3_000, seed=2))
    hf_neox(rotary_pct=0.25, parallel=True).save_pretrained(tmp_path / "hf")
    args = [
        f"--init_from={tmp_path / 'hf'}",
        f"--data_dir={data}",
        "--batch_size=4",
        "--block_size=32",
        "--warmup_steps=2",
        "--learning_rate=3e-3",
        "--min_lr=3e-4",
        "--eval_interval=4",
        "--eval_steps=2",
        "--log_interval=0",
        "--save_interval=4",
        "--device=cpu",
        "--dtype=float32",
        "--compile=False",
        "--lr_decay_steps=8",
        "--dropout=0.1",
    ]
    assert train.main([*args, f"--out_dir={tmp_path / 'full'}", "--max_steps=8"]) == 0
    assert train.main([*args, f"--out_dir={tmp_path / 'split'}", "--max_steps=4"]) == 0
    assert train.main(["--init_from=resume", f"--out_dir={tmp_path / 'split'}", "--max_steps=8"]) == 0

    def losses(out):
        lines = (out / "metrics.jsonl").read_text().splitlines()
        return {m["step"]: m["train_loss"] for m in map(json.loads, lines) if "train_loss" in m}

    full = losses(tmp_path / "full")
    assert list(full) == list(range(1, 9)) and full[8] < full[1]
    assert losses(tmp_path / "split") == full
    model, _ = loading.load_model(ckpt=tmp_path / "split")
    assert model.config.parallel_residual and not model.config.tie_embeddings and model.config.activation == "gelu"
    out = generate(model, torch.zeros(1, 1, dtype=torch.long), 8, Sampling(temperature=0.0))
    assert out.shape == (1, 9)
