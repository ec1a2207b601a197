"""model.py specification: Hugging Face parity, chunked loss, KV-cache generation, rotary, optimizer, presets."""

import math
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import GPT2Config, GPT2LMHeadModel

import model as M
from gpt2train import generation, optim
from gpt2train import hf as hf_io
from gpt2train.generation import Sampling, generate, generate_stream
from gpt2train.hf import from_pretrained
from model import GPT, PRESETS, GPTConfig
from tiny import torch_threads

CONV1D = hf_io.CONV1D_WEIGHTS


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """These tensors are tiny: extra intra-op threads only add spin-wait overhead (large on a busy 2-core box)."""
    with torch_threads(1):
        yield


def small_gpt(seed=0, **overrides) -> GPT:
    torch.manual_seed(seed)
    cfg = dict(block_size=32, vocab_size=96, n_layer=2, n_head=2, n_embd=32)
    return GPT(GPTConfig(**{**cfg, **overrides})).eval()


def perturb_(module, seed=1, scale=0.05):
    """Add noise to every parameter so biases and LayerNorms are not at their trivial init values."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return module


def hf_gpt(seed=0, vocab_size=50257) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    cfg = GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=32,
        n_positions=32,
        vocab_size=vocab_size,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        attn_implementation="eager",
    )
    return perturb_(GPT2LMHeadModel(cfg)).eval()


def shifted_targets(idx):
    """Targets for our model matching HF's labels=idx: predict idx[t+1]; the last position is ignored."""
    y = torch.full_like(idx, -1)
    y[:, :-1] = idx[:, 1:]
    return y


def max_param_diff(ours: GPT, hf: GPT2LMHeadModel) -> float:
    hf_sd = hf.state_dict()
    diff = 0.0
    for k, v in ours.state_dict().items():
        ref = hf_sd[k]  # same names: our state_dict uses the HF layout (transformer.*)
        ref = ref.t() if k.endswith(CONV1D) else ref
        diff = max(diff, (v - ref).abs().max().item())
    return diff


def max_grad_diff(ours: GPT, hf: GPT2LMHeadModel) -> float:
    hf_params = dict(hf.named_parameters())
    diff = 0.0
    for k, p in ours.named_parameters():
        ref = hf_params[k].grad
        ref = ref.t() if k.endswith(CONV1D) else ref
        diff = max(diff, (p.grad - ref).abs().max().item())
    return diff


# ----------------------------------------------------------------------------- Hugging Face import / export


def test_a_hub_name_that_cannot_be_fetched_says_what_it_fetched_and_the_offline_way(monkeypatch, capsys):
    """No network (here: huggingface_hub's own offline error) is one line naming the repository and files, and
    what to do instead: a local Hugging Face directory."""
    import huggingface_hub

    import sample

    def no_network(repo_id, allow_patterns):
        raise huggingface_hub.errors.LocalEntryNotFoundError(
            "Got: ConnectError: [Errno -2] Name or service not known\nAn error happened while trying to locate the "
            "files on the Hub, and we cannot find the appropriate snapshot folder"
        )

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_network)
    with pytest.raises(OSError) as err:
        from_pretrained("gpt2-medium")
    message = str(err.value)
    assert "cannot fetch 'gpt2-medium' (openai-community/gpt2-medium: config.json and model.safetensors)" in message
    assert "ConnectError" in message and "local Hugging Face directory" in message and "\n" not in message
    assert "hf download openai-community/gpt2-medium config.json model.safetensors --local-dir" in message
    with pytest.raises(SystemExit) as exit_:
        sample.main(["--init_from", "gpt2", "--device", "cpu", "--prompt", "x"])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and ": error: cannot fetch" in err and "\n" not in err
    assert "cannot fetch 'gpt2' (openai-community/gpt2" in err


def test_adamw_step_matches_hf_plus_torch_adamw(tmp_path):
    hf = hf_gpt()
    hf.save_pretrained(tmp_path)
    ours = from_pretrained(str(tmp_path))
    hf.train(), ours.train()
    lr, wd, betas = 1e-3, 0.1, (0.9, 0.95)  # decaying a LayerNorm weight by mistake moves it ~1e-4
    params = list(hf.parameters())  # tied wte/lm_head appears once
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
    for _ in range(2):  # two steps so the moment estimates matter too
        idx = torch.randint(0, 50257, (2, 16), generator=gen)
        hf(idx, labels=idx).loss.backward()
        ours(idx, shifted_targets(idx), return_logits=False)[1].backward()
        grad_diff = max(max_grad_diff(ours, hf), grad_diff)
        # The key bias gets no gradient in exact arithmetic (softmax ignores a constant added to every score
        # of a row); its float noise (~1e-10) would be blown up to +-lr by Adam's 1/(|g| + eps) in both.
        for m in (hf, ours):
            for block in m.transformer.h:
                block.attn.c_attn.bias.grad[32:64] = 0.0
        hf_opt.step(), opt.step()
        hf_opt.zero_grad(), opt.zero_grad()
    diff = max_param_diff(ours, hf)
    print(f"AdamW 2-step parameter diff vs transformers + torch AdamW: {diff:.2e}; max grad diff {grad_diff:.2e}")
    assert grad_diff <= 1e-6
    assert diff <= 1e-5


# ----------------------------------------------------------------------------- forward and loss


def test_initial_loss_is_close_to_log_vocab():
    model = small_gpt(vocab_size=1024, n_embd=64)
    gen = torch.Generator().manual_seed(0)
    idx, targets = torch.randint(0, 1024, (4, 32), generator=gen), torch.randint(0, 1024, (4, 32), generator=gen)
    with torch.no_grad():
        _, loss = model(idx, targets)
    assert abs(loss.item() - math.log(1024)) < 0.05


def test_init_scales_residual_projections_and_zeroes_biases():
    model = small_gpt(n_embd=64, n_layer=4)
    std = model.transformer.h[0].mlp.c_proj.weight.std().item()
    assert abs(std - 0.02 / math.sqrt(2 * 4)) < 0.1 * 0.02 / math.sqrt(8)
    assert abs(model.transformer.h[0].mlp.c_fc.weight.std().item() - 0.02) < 0.002
    assert model.transformer.h[0].attn.c_attn.bias.abs().max() == 0
    assert model.lm_head.weight is model.transformer.wte.weight


def test_inference_returns_last_position_logits_only():
    model = small_gpt()
    idx = torch.randint(0, 96, (3, 10))
    with torch.no_grad():
        last, loss = model(idx)
        full, _ = model(idx, idx)
    assert loss is None and last.shape == (3, 1, 96)
    assert torch.allclose(last, full[:, -1:], atol=1e-6)


def test_chunked_loss_matches_full_logits_loss_and_grads(monkeypatch):
    monkeypatch.setattr(M, "LOSS_CHUNK_ROWS", 7)  # 32 rows -> 5 chunks, the last one partial
    model = perturb_(small_gpt())
    idx = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    targets = shifted_targets(idx)
    targets[0, 3] = -1  # an ignored position inside a chunk

    def loss_and_grads(return_logits):
        model.zero_grad()
        logits, loss = model(idx, targets, return_logits=return_logits)
        (0.5 * loss).backward()  # the incoming gradient must be applied, not assumed to be 1
        return logits, loss, {n: p.grad.clone() for n, p in model.named_parameters()}

    logits_full, loss_full, grads_full = loss_and_grads(True)
    logits_chunk, loss_chunk, grads_chunk = loss_and_grads(False)
    assert logits_full.shape == (2, 16, 96) and logits_chunk is None
    grad_diff = max((grads_full[n] - grads_chunk[n]).abs().max().item() for n in grads_full)
    print(f"chunked loss: loss diff {abs(loss_full - loss_chunk).item():.2e}, max grad diff {grad_diff:.2e}")
    assert abs(loss_full.item() - loss_chunk.item()) <= 1e-6
    assert grad_diff <= 1e-6
    with torch.no_grad():  # evaluation: the loss alone, no gradient work
        assert abs(model(idx, targets, return_logits=False)[1].item() - loss_full.item()) <= 1e-6


def test_chunked_loss_under_bf16_autocast_tracks_the_plain_path(monkeypatch):
    monkeypatch.setattr(M, "LOSS_CHUNK_ROWS", 5)
    model = perturb_(small_gpt())
    idx = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    results = []
    for return_logits in (True, False):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(idx, shifted_targets(idx), return_logits=return_logits)
        loss.backward()
        assert loss.dtype == torch.float32 and model.lm_head.weight.grad.dtype == torch.float32
        results.append((loss.item(), model.lm_head.weight.grad.clone()))
    (loss_a, grad_a), (loss_b, grad_b) = results
    assert abs(loss_a - loss_b) < 1e-2
    assert (grad_a - grad_b).abs().max() < 2e-2 * grad_a.abs().max()


def test_chunked_loss_accumulates_a_bf16_weights_gradient_in_fp32(monkeypatch):
    """FSDP's bf16 parameters hand the chunked loss a bf16 lm_head weight: its gradient, summed over 32 chunks, must
    be the fp32 sum rounded once to bf16, exactly what an fp32 weight holding the same values gets, not a bf16
    running sum (4-10x the error)."""
    monkeypatch.setattr(M, "LOSS_CHUNK_ROWS", 4)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(128, 32, generator=g).bfloat16()  # 32 chunks of 4 rows
    w = (torch.randn(96, 32, generator=g) * 0.5).bfloat16()
    targets = torch.randint(0, 96, (128,), generator=g)
    grads = []
    for weight in (w.float(), w):  # the fp32 path, then FSDP's bf16 parameter with the same values
        weight = weight.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            M.ChunkedLMHeadLoss.apply(h, weight, targets, True).backward()
        grads.append(weight.grad)
    fp32_path, bf16_weight = grads
    assert bf16_weight.dtype == torch.bfloat16 and torch.equal(bf16_weight, fp32_path.bfloat16())


@pytest.mark.slow
def test_compiled_chunked_loss_is_one_op_whatever_the_chunks_with_the_reference_gradients(monkeypatch):
    """torch.compile must not unroll the chunk loop: traced whole, every chunk's (V, C) weight-gradient product
    stayed alive until one fused sum, and the compiled forward's peak grew with the number of chunks. Compiled,
    the forward graph holds the blocks' matmuls and one loss op at one chunk and at five, and the gradients (the
    per-chunk kernel compiled too) and the evaluation loss equal the full-logits reference."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    model = perturb_(small_gpt())
    idx = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    targets = shifted_targets(idx)
    targets[0, 3] = -1  # an ignored position inside a chunk

    def loss_and_grads(fn, return_logits):
        model.zero_grad()
        loss = fn(idx, targets, return_logits=return_logits)[1]
        (0.5 * loss).backward()  # the incoming gradient must be applied, not assumed to be 1
        return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}

    ref_loss, ref_grads = loss_and_grads(model, True)
    for rows in (32, 7):  # one chunk; five, the last one partial
        monkeypatch.setattr(M, "LOSS_CHUNK_ROWS", rows)
        forward_ops = []

        def forward_compiler(gm, example_inputs):
            forward_ops.append(Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function"))
            return make_boxed_func(gm.forward)

        torch._dynamo.reset()
        backend = aot_autograd(fw_compiler=forward_compiler, bw_compiler=lambda gm, _: make_boxed_func(gm.forward))
        compiled = torch.compile(model, backend=backend)
        loss, grads = loss_and_grads(compiled, False)
        assert abs(loss - ref_loss) <= 1e-6
        assert max((grads[n] - ref_grads[n]).abs().max().item() for n in grads) <= 1e-6
        (ops,) = forward_ops
        assert ops["gpt.chunked_lm_head_loss.default"] == 1
        assert ops["aten.mm.default"] + ops["aten.addmm.default"] == 2 * 4  # 2 blocks x 4 linears, no head
        with torch.no_grad():  # evaluation, compiled: the loss alone
            assert abs(compiled(idx, targets, return_logits=False)[1].item() - ref_loss) <= 1e-6


def test_compiled_chunk_kernel_writes_softmax_minus_onehot_in_bf16():
    """The per-chunk kernel as torch.compile builds it (the one-hot a comparison, the gradient written over the
    bf16 logits in one pass) gives the summed cross entropy and softmax - onehot(target), zero on ignored rows."""
    logits = (torch.randn(6, 96, generator=torch.Generator().manual_seed(0)) * 3).bfloat16()
    targets = torch.tensor([5, -1, 0, 95, 17, 17])
    valid = (targets != -1).double().unsqueeze(1)
    logp = logits.double().log_softmax(dim=1)
    expected_loss = -(logp.gather(1, targets.clamp(min=0).unsqueeze(1)) * valid).sum()
    expected_grad = (logp.exp() - F.one_hot(targets.clamp(min=0), 96)) * valid
    g = logits.clone()
    loss = M._compiled_chunk_loss()(g, targets, True)
    assert loss.dtype == torch.float32 and abs(loss.item() - expected_loss.item()) <= 1e-4
    assert g.dtype == torch.bfloat16 and (g.double() - expected_grad).abs().max() <= 2**-8
    assert torch.equal(g[1], torch.zeros(96, dtype=torch.bfloat16))


def test_activation_checkpointing_gives_identical_gradients(monkeypatch):
    model = small_gpt(dropout=0.1).train()  # dropout: the recompute must replay the same random masks
    idx = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    calls, block_forward = [], M.Block.forward

    def counting_forward(self, *args, **kwargs):
        calls.append(1)
        return block_forward(self, *args, **kwargs)

    monkeypatch.setattr(M.Block, "forward", counting_forward)

    def grads(checkpointing):
        model.config.activation_checkpointing = checkpointing
        model.zero_grad()
        calls.clear()
        torch.manual_seed(123)
        model(idx, idx)[1].backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}, len(calls)

    plain, plain_calls = grads(False)
    ckpt, ckpt_calls = grads(True)
    assert (plain_calls, ckpt_calls) == (2, 4)  # 2 blocks; each really was recomputed in backward
    for name in plain:
        assert torch.allclose(plain[name], ckpt[name], atol=1e-7, rtol=0), name


# ----------------------------------------------------------------------------- rotary


def test_rotary_scores_depend_only_on_offset_and_leave_other_dims_untouched():
    rot_dim, hs = 8, 16
    cos, sin = M.rotary_cos_sin(rot_dim, 64)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 1, hs, generator=gen), torch.randn(1, 1, 1, hs, generator=gen)

    def rot(x, pos):
        return M.apply_rotary(x, cos[pos : pos + 1], sin[pos : pos + 1])

    def score(m, n):
        return (rot(q, m)[..., :rot_dim] * rot(k, n)[..., :rot_dim]).sum().item()

    for shift in (1, 7, 40):
        assert abs(score(5, 2) - score(5 + shift, 2 + shift)) < 1e-4
    assert abs(score(5, 2) - score(5, 4)) > 1e-3  # and it does depend on the offset
    assert torch.equal(rot(q, 9)[..., rot_dim:], q[..., rot_dim:])
    assert torch.equal(rot(q, 0), q)  # position 0 is the identity


def test_rotary_matches_complex_rotation_of_neox_pairs():
    # GPT-NeoX pairs dim i with dim i + rot_dim/2 and turns the pair by pos * 10000^(-2i/rot_dim)
    rot_dim, pos = 8, 13
    cos, sin = M.rotary_cos_sin(rot_dim, 32)
    x = torch.randn(1, 1, 1, 12, dtype=torch.float64).float()
    out = M.apply_rotary(x, cos[pos : pos + 1], sin[pos : pos + 1])[0, 0, 0]
    half = rot_dim // 2
    z = torch.complex(x[0, 0, 0, :half].double(), x[0, 0, 0, half:rot_dim].double())
    theta = 10000.0 ** (-torch.arange(half, dtype=torch.float64) * 2 / rot_dim)
    expected = z * torch.exp(1j * pos * theta)
    assert torch.allclose(out[:half].double(), expected.real, atol=1e-5)
    assert torch.allclose(out[half:rot_dim].double(), expected.imag, atol=1e-5)


def test_rotary_model_has_no_learned_positions_and_validates_rot_dim():
    model = small_gpt(rotary_pct=0.25)  # head_dim 16 -> 4 rotary dims
    assert "transformer.wpe.weight" not in model.state_dict()
    assert model.rope_cos.shape == (32, 4)
    with pytest.raises(ValueError, match="even"):
        GPTConfig(n_embd=32, n_head=2, rotary_pct=0.2)  # 3 dims
    with pytest.raises(ValueError, match="rotary_pct"):
        GPTConfig(rotary_pct=1.5)


# ----------------------------------------------------------------------------- generation


@pytest.mark.parametrize("rotary_pct", [None, 0.5])
def test_kv_cache_hidden_states_match_full_recompute(rotary_pct):
    model = perturb_(small_gpt(rotary_pct=rotary_pct))
    idx = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        full = model.hidden_states(idx)
        caches = [M.KVCache(32) for _ in model.transformer.h]
        parts = [model.hidden_states(idx[:, :5], caches, 0), model.hidden_states(idx[:, 5:8], caches, 5)]
        parts += [model.hidden_states(idx[:, t : t + 1], caches, t) for t in range(8, 12)]
    assert caches[0].k.shape == (2, 2, 32, 16)  # preallocated to block_size
    assert (torch.cat(parts, dim=1) - full).abs().max() <= 1e-5


@pytest.mark.parametrize("rotary_pct", [None, 0.5])
@pytest.mark.parametrize("prompt_len", [1, 4, 17, 32])
def test_kv_cache_greedy_equals_recompute_greedy(prompt_len, rotary_pct):
    model = perturb_(small_gpt(rotary_pct=rotary_pct), scale=0.2)  # larger weights: decisive argmaxes
    idx = torch.randint(0, 96, (2, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
    n_new = 40 - prompt_len  # always runs past block_size 32, exercising the full-window fallback
    cached = generate(model, idx, n_new, Sampling(temperature=0.0), use_kv_cache=True)
    plain = generate(model, idx, n_new, Sampling(temperature=0.0), use_kv_cache=False)
    assert cached.shape == (2, 40)
    assert torch.equal(cached, plain)
    assert torch.equal(cached[:, :prompt_len], idx)


@pytest.mark.parametrize("use_kv_cache", [True, False])
def test_model_generate_is_nanogpts_call_on_generation_generate(use_kv_cache):
    """model.generate(idx, max_new_tokens, temperature, top_k) (nanoGPT's signature, today's options as keywords)
    gives generation.generate's ids: greedy with the cache on and off, and the same seeded top-k sample."""
    model = perturb_(small_gpt(value_embeds=True, smear=True, bigram_embeds=37, rotary_pct=1.0), scale=0.2)
    idx = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(3))
    greedy = model.generate(idx, 20, temperature=0.0, use_kv_cache=use_kv_cache)
    assert greedy.shape == (2, 25) and torch.equal(greedy[:, :5], idx)
    assert torch.equal(greedy, generate(model, idx, 20, Sampling(temperature=0.0), use_kv_cache=use_kv_cache))
    assert torch.equal(greedy, generate(model, idx, 20, Sampling(temperature=0.0), use_kv_cache=not use_kv_cache))
    seeded = model.generate(idx, 20, 0.8, 5, top_p=0.9, generator=torch.Generator().manual_seed(0))
    ours = generate(model, idx, 20, Sampling(0.8, 5, 0.9), generator=torch.Generator().manual_seed(0))
    assert torch.equal(seeded, ours)


def test_greedy_generate_equals_argmax_of_full_forward():
    """The decode path's own lm_head (row blocks in one bmm on CPU) picks what model(idx) logits pick."""
    model = perturb_(small_gpt(), scale=0.2)
    idx = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(3))
    ref = idx
    with torch.no_grad():
        for _ in range(10):
            logits, _ = model(ref)  # (B, 1, V): last position
            ref = torch.cat((ref, logits[:, -1].argmax(-1, keepdim=True)), dim=1)
    assert torch.equal(generate(model, idx, 10, Sampling(temperature=0.0)), ref)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("vocab, rows", [(96, 1), (97, 3), (2, 1)])  # 97 and 2: a remainder past the blocks
def test_head_rows_is_the_head_product_over_any_thread_count(threads, vocab, rows):
    w, x = torch.randn(vocab, 16), torch.randn(rows, 16)
    with torch_threads(threads):
        y = generation.head_rows(x, w)
    assert y.shape == (rows, vocab)
    torch.testing.assert_close(y, x @ w.t())


def test_fp32_cpu_decoding_reads_the_head_on_every_thread_and_in_out_contiguous_block_weights():
    """A decode step reads every weight once. At batch 1 in fp32 a CPU's BLAS reads nn.Linear's (out, in) rows on
    one core, and the blocks' matrices faster (in, out)-contiguous (docs/speed.md; reading the head's rows on one
    core was last round's 1.5x decode regression): the head is one bmm over a block of its rows per thread, the
    blocks' products read (in, out)-contiguous weights, and a stream closed early leaves the weights as they were."""
    model = perturb_(small_gpt(), scale=0.2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    products = []

    class RecordProducts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
                products.append(("mm", args[-1].is_contiguous()))  # the weight, (in, out)
            elif func == torch.ops.aten.bmm.default:
                products.append(("bmm", args[0].size(0)))  # the head's row blocks
            return func(*args, **(kwargs or {}))

    stream = generate_stream(model, torch.zeros(1, 3, dtype=torch.long), 5, Sampling(temperature=0.0))
    with torch_threads(2), RecordProducts():  # 2 threads: the vocabulary, 96, splits evenly: no remainder product
        next(stream)  # the prompt
        next(stream)  # one token from the cache
    assert products == 2 * ([("mm", True)] * (2 * 4) + [("bmm", 2)])  # 2 blocks x 4 linears, then the head
    stream.close()
    assert all(p.is_contiguous() for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_stream_yields_one_token_per_row_per_step():
    model = small_gpt()
    steps = list(generate_stream(model, torch.zeros(3, 2, dtype=torch.long), 5, Sampling(temperature=0.0)))
    assert len(steps) == 5 and all(s.shape == (3,) and s.dtype == torch.long for s in steps)
    out = generate(model, torch.zeros(3, 2, dtype=torch.long), 5, Sampling(temperature=0.0))
    assert torch.equal(out[:, 2:], torch.stack(steps, dim=1))


def test_eos_finishes_rows_and_stops_when_all_are_done():
    model = perturb_(small_gpt(), scale=0.2)
    idx = torch.randint(0, 96, (2, 3), generator=torch.Generator().manual_seed(0))

    def sample(**kw):  # same seed: the same random draws step by step, with or without eos
        return generate(model, idx, 12, Sampling(**kw), generator=torch.Generator().manual_seed(0))[:, 3:]

    ref = sample()  # (2, 12) without eos
    eos = ref[0, 2].item()
    first = [(row == eos).nonzero()[0].item() if (row == eos).any() else None for row in ref]
    assert (ref[0, first[0] :] != eos).any()  # precondition: row 0 would go on with other tokens
    out = sample(eos_token=eos)
    expected_len = 12 if None in first else max(first) + 1
    assert out.shape == (2, expected_len)
    for row, f in enumerate(first):
        if f is None:
            assert torch.equal(out[row], ref[row, :expected_len])
        else:  # identical up to eos, then eos forever
            assert torch.equal(out[row, : f + 1], ref[row, : f + 1]) and (out[row, f:] == eos).all()
    greedy = generate(model, idx[:1], 12, Sampling(temperature=0.0))[0, 3:]
    stop = (greedy == greedy[1]).nonzero()[0].item()  # first time the greedy row emits its 2nd token
    assert generate(model, idx[:1], 12, Sampling(temperature=0.0, eos_token=greedy[1].item())).shape == (
        1,
        3 + stop + 1,
    )


def test_sampling_is_reproducible_and_top_k_1_is_greedy():
    model = perturb_(small_gpt())
    idx = torch.randint(0, 96, (2, 4))

    def sample(seed, **kw):
        return generate(model, idx, 10, Sampling(**kw), generator=torch.Generator().manual_seed(seed))

    assert torch.equal(sample(1, temperature=1.0), sample(1, temperature=1.0))
    assert not torch.equal(sample(1, temperature=1.0), sample(2, temperature=1.0))
    greedy = generate(model, idx, 10, Sampling(temperature=0.0))
    assert torch.equal(sample(3, top_k=1), greedy)
    assert torch.equal(sample(3, top_p=1e-6), greedy)


def test_top_k_and_top_p_restrict_the_candidates():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    gen = torch.Generator().manual_seed(0)

    def draws(top_k=None, top_p=None):  # the set of ids seen in 2000 draws
        return set(generation.next_token(probs.log().repeat(2000, 1), Sampling(1.0, top_k, top_p), gen).tolist())

    assert draws() == {0, 1, 2, 3}
    assert draws(top_k=2) == {0, 1}
    assert draws(top_p=0.7) == {0, 1}  # 0.5 < 0.7, 0.5 + 0.3 >= 0.7
    assert draws(top_p=0.5) == {0}
    assert draws(top_p=0.81) == {0, 1, 2}


def test_padded_vocab_ids_are_never_generated():
    model = small_gpt(vocab_size=50304)
    with torch.no_grad():  # make every padding id the most likely next token
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.fill_(1.0)
        model.lm_head.weight[M.GPT2_VOCAB :] = 1.0
    idx = torch.zeros(2, 3, dtype=torch.long)
    gen = torch.Generator().manual_seed(0)
    for kw, cached in (
        (dict(temperature=0.0), True),
        (dict(temperature=1.0), True),
        (dict(top_k=60), True),
        (dict(top_p=0.9), True),
        (dict(temperature=0.0), False),
    ):
        out = generate(model, idx, 8, Sampling(**kw), generator=gen, use_kv_cache=cached)
        assert out.max().item() < M.GPT2_VOCAB, kw


def test_long_prompt_is_cropped_with_a_warning():
    model = perturb_(small_gpt(), scale=0.2)
    idx = torch.randint(0, 96, (2, 40))
    with pytest.warns(UserWarning, match="40 tokens.*block_size 32"):
        out = generate(model, idx, 3, Sampling(temperature=0.0))
    assert out.shape == (2, 43) and torch.equal(out[:, :40], idx)
    assert torch.equal(out[:, 40:], generate(model, idx[:, -32:], 3, Sampling(temperature=0.0))[:, 32:])


def test_generate_rejects_bad_sampling_arguments():
    model = small_gpt()
    idx = torch.zeros(1, 1, dtype=torch.long)
    for kw in (dict(temperature=-1.0), dict(top_k=0), dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(ValueError, match="generate"):
            generate(model, idx, 2, Sampling(**kw))


# ----------------------------------------------------------------------------- presets, FLOPs, MFU


@pytest.mark.parametrize(
    "name,expected",
    [("gpt2", 124_439_808), ("gpt2-medium", 354_823_168), ("gpt2-large", 774_030_080), ("gpt2-xl", 1_557_611_200)],
)
def test_gpt2_presets_have_the_published_parameter_counts(name, expected):
    with torch.device("meta"):  # shapes only, no memory
        model = GPT(GPTConfig(**{**PRESETS[name], **dict(vocab_size=50257)}))
    assert model.num_params() == expected  # GPT2LMHeadModel's counts for the OpenAI checkpoints


@pytest.mark.parametrize(
    "name,size", [("gpt3-125m", 125e6), ("gpt3-350m", 350e6), ("gpt3-760m", 760e6), ("gpt3-1.3b", 1.3e9)]
)
def test_gpt3_presets_match_their_names(name, size):
    cfg = GPTConfig(**PRESETS[name])
    with torch.device("meta"):
        model = GPT(cfg)
    assert cfg.block_size == 2048 and cfg.vocab_size == 50304
    assert abs(model.num_params() - size) / size < 0.06


def test_preset_errors_and_overrides():
    from gpt2train.config import ConfigError, make_config

    cfg = make_config({"preset": "gpt2", "dropout": 0.1, "rotary_pct": 0.25})  # config.py resolves presets
    assert (cfg.n_layer, cfg.n_embd, cfg.dropout, cfg.rotary_pct) == (12, 768, 0.1, 0.25)
    with pytest.raises(ConfigError, match="config key 'preset' must be one of"):
        make_config({"preset": "gpt5"})
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(n_embd=30, n_head=4)


def test_flops_per_token():
    model = small_gpt()
    cfg = model.config
    # the attention term grows linearly with the context: 12 * L * n_embd per token per context position
    assert model.flops_per_token(seq_len=20) - model.flops_per_token(seq_len=10) == 12 * cfg.n_layer * cfg.n_embd * 10
    assert model.flops_per_token(seq_len=1) > 6 * model.num_params(non_embedding=True)
    assert model.flops_per_token() == model.flops_per_token(seq_len=cfg.block_size)
