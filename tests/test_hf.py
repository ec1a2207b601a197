"""hf.py: Hugging Face GPT-2 weights in and out (from_pretrained, save_pretrained) against transformers itself;
GPT-NeoX / Pythia in test_neox.py, a checkpoint's export with its tokenizer in test_export.py."""

import pytest
import torch
from transformers import GPT2LMHeadModel

from gpt2train.hf import from_pretrained, save_pretrained
from test_model import hf_gpt, max_param_diff, perturb_, shifted_targets, single_thread, small_gpt  # noqa: F401


@pytest.mark.parametrize("layout", ["prefixed-safetensors", "unprefixed-bin"])
def test_import_matches_hf_logits_and_loss(tmp_path, layout):
    hf = hf_gpt()
    if layout == "prefixed-safetensors":  # what transformers' save_pretrained writes
        hf.save_pretrained(tmp_path)
        assert (tmp_path / "model.safetensors").is_file()
    else:  # the original OpenAI hub layout: no prefix, no lm_head.weight, causal-mask buffers present
        hf.config.save_pretrained(tmp_path)
        sd = {k.removeprefix("transformer."): v.clone() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
        for i in range(hf.config.n_layer):
            sd[f"h.{i}.attn.bias"] = torch.ones(1, 1, 32, 32).tril()
            sd[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
        torch.save(sd, tmp_path / "pytorch_model.bin")
    ours = from_pretrained(str(tmp_path)).eval()
    assert ours.config.vocab_size == 50257 and ours.config.block_size == 32 and ours.config.n_layer == 2

    idx = torch.randint(0, 50257, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(idx, labels=idx)
        logits, loss = ours(idx, shifted_targets(idx))
    logit_diff = (logits - ref.logits).abs().max().item()
    print(f"import parity ({layout}): max abs logit diff {logit_diff:.2e}, loss diff {abs(loss - ref.loss):.2e}")
    assert logit_diff <= 1e-5
    assert abs(loss.item() - ref.loss.item()) <= 1e-5


@pytest.mark.parametrize("bias", [True, False])
def test_export_matches_hf_and_drops_vocab_padding(tmp_path, bias):
    ours = perturb_(small_gpt(vocab_size=50304, bias=bias))
    save_pretrained(ours, str(tmp_path))
    hf = GPT2LMHeadModel.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert hf.config.vocab_size == 50257 and hf.config.n_positions == 32

    idx = torch.randint(0, 50257, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, _ = ours(idx, shifted_targets(idx))
        ref = hf(idx).logits
        back, _ = from_pretrained(str(tmp_path)).eval()(idx, shifted_targets(idx))
    logit_diff = (logits[..., :50257] - ref).abs().max().item()
    print(f"export parity (bias={bias}): max abs logit diff {logit_diff:.2e}")
    assert logit_diff <= 1e-5
    assert torch.equal(back, logits[..., :50257])  # round trip through our own loader is exact


def test_from_pretrained_errors_are_clear(tmp_path):
    with pytest.raises(ValueError, match="neither a directory"):
        from_pretrained(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        from_pretrained(str(tmp_path))
    hf_gpt().config.save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        from_pretrained(str(tmp_path))
