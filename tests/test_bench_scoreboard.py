"""bench.scoreboard: peak-memory probe, tables, and a tiny end-to-end run (no timing assertions)."""

import json
import sys

import pytest
import torch

from bench import scoreboard


def test_md_table_has_header_separator_and_rows():
    text = scoreboard.md_table(("a", "b"), [(1, "x"), (2, "y")])
    assert text.splitlines() == ["| a | b |", "|---|---|", "| 1 | x |", "| 2 | y |"]


def test_peak_memory_sees_a_temporary_allocation():
    with scoreboard.PeakMemory("cpu") as mem:
        x = torch.ones(64 << 18)  # 64 MiB, touched
        del x
        peak = mem.peak_mb()
    assert peak >= 60 or mem.lifetime


def test_explicit_attention_of_the_baseline_rows_equals_sdpa(monkeypatch):
    """The scoreboard's pre-SDPA rows swap model.py's F.scaled_dot_product_attention for the written-out softmax;
    same model, same logits, in training (causal) and in KV-cache decoding (an explicit mask)."""
    from gpt2train.generation import Sampling, generate
    from model import GPT, GPTConfig

    calls, explicit = [], scoreboard.explicit_attention
    monkeypatch.setattr(scoreboard, "explicit_attention", lambda *a, **k: calls.append(1) or explicit(*a, **k))
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=96)).eval()
    idx = torch.randint(0, 96, (2, 16))
    with torch.no_grad():
        ref = model(idx, idx)[0]
        sampled = generate(model, idx[:, :4], 6, Sampling(temperature=0.0))
        with scoreboard.attention(False):
            assert (model(idx, idx)[0] - ref).abs().max() <= 1e-5
            assert torch.equal(generate(model, idx[:, :4], 6, Sampling(temperature=0.0)), sampled)
    assert len(calls) >= 2 * (1 + 6)  # 2 blocks, every forward: the swap really took effect
    assert torch.nn.functional.scaled_dot_product_attention is not scoreboard.explicit_attention  # restored


def _tiny(tmp_path, *extra):
    out = tmp_path / "bench.json"
    args = [
        "--n_layer",
        "1",
        "--n_head",
        "2",
        "--n_embd",
        "32",
        "--block_size",
        "256",
        "--vocab_size",
        "512",
        "--batch_size",
        "2",
        "--json",
        str(out),
        *extra,
    ]
    assert scoreboard.main(args) == 0
    return json.loads(out.read_text())


@pytest.mark.slow
def test_scoreboard_rows_are_cumulative_and_reported(tmp_path, capsys):
    result = _tiny(tmp_path, "--steps", "1", "--rows", "baseline,sdpa,fused,malloc,train")
    rows = {r["key"]: r for r in result["scoreboard"]}
    assert list(rows) == ["baseline", "sdpa", "fused", "malloc", "train"]
    assert rows["baseline"]["setup"]["sdpa"] is False and rows["sdpa"]["setup"]["sdpa"] is True
    assert rows["fused"]["setup"]["sdpa"] is True and rows["fused"]["setup"]["optimizer"] == "fused"
    assert rows["fused"]["setup"]["compile"] is True  # the compile row sits between sdpa and fused
    assert rows["baseline"]["speedup"] == 1.0
    for r in rows.values():
        assert r["tokens_per_s"] > 0 and len(r["tok_s"]) == 1 and r["peak_mem_mb"] is not None
    assert rows["train"]["setup"]["chunked"] is True
    assert result["gemm_flops"]["float32"]["all"] > 0
    printed = capsys.readouterr().out
    assert "| baseline: fp32, manual attention" in printed
    scoreboard.report(result)  # the tables come from the measured data alone: --json holds all of it
    assert capsys.readouterr().out == printed


@pytest.mark.slow
def test_compare_reports_ratios_and_generation(tmp_path):
    result = _tiny(tmp_path, "--rows", "none", "--compare", "--rounds", "1", "--gen_rounds", "1")
    ratios = result["compare_training"]["ratios"]
    assert [r["target"] for r in ratios[:3]] == [0.95, 2.5, 1.0]
    assert all(len(r["per_round"]) == 1 and r["per_round"][0] > 0 for r in ratios)
    gen = {g["variant"]: g for g in result["compare_generation"] if g["dtype"] == "float32"}
    assert set(gen) == {"ours, KV cache", "ours, no cache", "transformers generate"}
    assert all(g["n_tokens"] == scoreboard.GEN_NEW for g in gen.values())
    assert gen["ours, KV cache"]["same_tokens"] == scoreboard.GEN_NEW  # compared with itself
    assert result["hellaswag"]["note"].startswith("skipped")  # vocab 512 cannot read GPT-2 tokens
    bf16 = {g["variant"] for g in result["compare_generation"] if g["dtype"] == "bfloat16"}
    assert {"ours, KV cache", "transformers generate"} <= bf16  # bf16 decoding is always reported
    assert result["compare_training"]["ceiling_tok_s"]["float32"] > 0


def test_compare_without_transformers_stops_before_measuring(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed: `import transformers` fails
    monkeypatch.setattr(scoreboard, "measure_all", lambda *a: pytest.fail("measured without transformers"))
    with pytest.raises(SystemExit) as stop:
        scoreboard.main(["--compare"])
    assert str(stop.value) == (
        "bench.scoreboard --compare needs transformers (optional, not installed): "
        "pip install transformers   (or: pip install -r requirements-dev.txt)"
    )
