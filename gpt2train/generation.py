"""Text from a GPT, one token at a time: the sampling settings, the KV-cache decoding loop, and the CPU layouts that
let each step read the weights at the speed of memory. sample.py streams with generate_stream; the training run's
sample preview, the tests and the benchmarks call generate. model.py keeps the model and its KV cache.

Each step multiplies one row per sequence by every weight matrix, a memory-bound read. On a CPU in fp32 BLAS reads
the head's (V, C) rows on one core (head_rows spreads them over every thread) and the blocks' matrices faster
column-major (column_major_linears, for the length of a call); in bf16 BLAS reads the (out, in) rows as fast, and
they stay (docs/speed.md has the measurements; `python -m bench.decode --rev HEAD` before changing this path).
"""

import warnings
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn as nn

from model import GPT2_VOCAB, KVCache


@dataclass(frozen=True)
class Sampling:
    """How each step picks the next token of every row, and when a row is done.

    temperature 0 is greedy (the argmax); top_k keeps the k most likely ids, top_p the smallest set holding that much
    probability. Rows that produced eos_token keep emitting it; generation stops once all rows have. Ids >= n_vocab
    (the tokenizer's size; the rest of a padded vocabulary) are never produced."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    eos_token: int | None = None
    n_vocab: int = GPT2_VOCAB

    def __post_init__(self):
        t, k, p = self.temperature, self.top_k, self.top_p
        if t < 0 or (k is not None and k < 1) or (p is not None and not 0 < p <= 1):
            raise ValueError(
                f"generate: need temperature >= 0, top_k >= 1, 0 < top_p <= 1; "
                f"got temperature={t}, top_k={k}, top_p={p}"
            )


class LogitsNotFinite(ValueError):
    """The model's logits hold NaN or inf: its weights are (a diverged checkpoint), or are finite but so large that the
    forward overflows. Sampling them would be torch.multinomial's error, greedy decoding an argmax of NaNs."""


@torch.no_grad()
def generate_stream(
    model, idx, max_new_tokens: int, sampling: Sampling = Sampling(), generator=None, use_kv_cache=True
):
    """Yield the next token of every row of idx (B, T), a (B,) LongTensor, for up to max_new_tokens steps.

    The KV cache is filled by one forward over the prompt, then each step feeds only the new token; once the context
    exceeds block_size every step recomputes on the last block_size tokens (as use_kv_cache=False does throughout)."""
    bs = model.config.block_size
    if idx.size(1) > bs:
        warnings.warn(
            f"generate: prompt of {idx.size(1)} tokens is longer than block_size {bs}; using its last {bs} tokens"
        )
    ctx = idx[:, -bs:]  # (B, <=bs) the model's view of the sequence
    caches = [KVCache(bs) for _ in model.transformer.h] if use_kv_cache else None
    eos = sampling.eos_token
    done = torch.zeros(idx.size(0), dtype=torch.bool, device=idx.device)  # (B,) rows that produced eos
    w = model.lm_head.weight
    fp32_cpu = w.device.type == "cpu" and w.dtype == torch.float32 and not torch.is_autocast_enabled("cpu")
    pos, feed = 0, ctx  # tokens already in the cache, tokens to run next
    with column_major_linears(model, fp32_cpu):
        for _ in range(max_new_tokens):
            if caches is not None and pos + feed.size(1) <= bs:
                h = model.hidden_states(feed, caches, pos, prev=ctx[:, pos - 1 : pos] if pos else None)
                pos += feed.size(1)
            else:  # no cache, or the window is full: recompute on the last block_size tokens
                h = model.hidden_states(ctx)
            x = h[:, -1, :]  # (B, C): the logits of the last position only
            logits = (head_rows(x, w) if fp32_cpu else x @ w.t()).float()  # (B, V)
            if not bool(torch.isfinite(logits).all()):
                raise LogitsNotFinite("the model's logits are not finite (NaN or inf: a diverged checkpoint?)")
            nxt = next_token(logits, sampling, generator)  # (B,)
            if eos is not None:
                nxt = torch.where(done, torch.full_like(nxt, eos), nxt)
                done |= nxt == eos
            yield nxt
            if eos is not None and bool(done.all()):
                return
            feed = nxt.unsqueeze(1)  # (B, 1)
            ctx = torch.cat((ctx, feed), dim=1)[:, -bs:]


@torch.no_grad()
def generate(model, idx, max_new_tokens: int, sampling: Sampling = Sampling(), generator=None, use_kv_cache=True):
    """Continue idx (B, T); returns (B, T + n_new) with the full original prompt in front (generate_stream's tokens)."""
    new = list(generate_stream(model, idx, max_new_tokens, sampling, generator, use_kv_cache))
    return torch.cat([idx] + [t.unsqueeze(1) for t in new], dim=1)


def next_token(logits, sampling: Sampling, generator=None):
    """Pick one id per row from logits (B, V) fp32 (written into), never an id >= sampling.n_vocab."""
    if logits.size(-1) > sampling.n_vocab:
        logits[:, sampling.n_vocab :] = float("-inf")  # padding rows of the vocabulary are not real tokens
    if sampling.temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = logits / sampling.temperature
    top_k, top_p = sampling.top_k, sampling.top_p
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token once the mass of the tokens ranked above it already reaches top_p (the top one stays)
        drop = probs.cumsum(dim=-1) - probs >= top_p
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)


# ----------------------------------------------------------------------------- fp32 decoding on a CPU


def head_rows(x, w):
    """x (B, C) @ w.T for the head's w (V, C), as one bmm over torch.get_num_threads() blocks of w's rows: in fp32
    on a CPU, BLAS's product with nn.Linear's (out, in) rows reads them on one core, the blocks on every core, at
    the speed of memory (docs/speed.md)."""
    k = torch.get_num_threads()
    n = w.size(0) // k * k
    y = torch.bmm(w[:n].view(k, n // k, w.size(1)), x.t().expand(k, -1, -1)).view(n, x.size(0)).t()
    return y if n == w.size(0) else torch.cat((y, x @ w[n:].t()), dim=1)


@contextmanager
def column_major_linears(model, enabled: bool):
    """While decoding in fp32 on a CPU, store the blocks' Linear weights column-major: same values and shapes, but
    x @ W.t() then reads an (in, out)-contiguous matrix. Restored to nn.Linear's layout after."""
    linears = [m for m in model.transformer.h.modules() if isinstance(m, nn.Linear)] if enabled else []
    for m in linears:
        m.weight.data = m.weight.data.t().contiguous().t()
    try:
        yield
    finally:
        for m in linears:
            m.weight.data = m.weight.data.contiguous()
