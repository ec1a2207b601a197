"""GPT-2 in one file, with the GPT-NeoX / Pythia family and a few modern options: config, modules, the
chunked loss, MFU and the KV cache (gpt2train/generation.py decodes with it). Parameter names follow OpenAI /
Hugging Face GPT-2 (transformer.wte, transformer.h.N.attn.c_attn, ...); hf.py moves weights to and from Hugging
Face's GPT-2 and GPT-NeoX.
"""

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake
from torch.utils.checkpoint import checkpoint

GPT2_VOCAB = 50257  # real GPT-2 vocabulary; ids >= this in a padded vocab are never generated
LOSS_CHUNK_ROWS = 2048  # rows of (B*T) per lm_head+CE chunk when the full logits are not needed
GRAD_W_SLICE_ROWS = 1024  # rows of the lm_head's fp32 gradient per add of a chunk's low-precision product
HUB_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
ACTIVATIONS = ("gelu_tanh", "gelu", "relu2")
CHECKPOINTING = ("selective", "auto")  # activation_checkpointing besides True/False
SMEAR_CHANNELS = 16  # smear: the gate reads this many leading channels of each token's embedding
PARAMETRIZATIONS = ("standard", "mup")
# muP's attention scores are q.k * MUP_ATTN_MULT / head_dim (Tensor Programs V: 1/d, not 1/sqrt(d)); 8 = sqrt(64)
# matches the standard 1/sqrt(d) at GPT-2's head dim of 64, the width-independent head dim muP models here use
MUP_ATTN_MULT = 8.0

# GPT-2 sizes (Radford et al. 2019) and the GPT-3 family sizes of the MosaicML GPT-3 recipes (context 2048;
# 760m/1.3b/2.7b use head_dim 128 as MosaicML does, rather than the GPT-3 paper's head counts).
# Pythia (Biderman et al. 2023, "Pythia: A Suite for Analyzing Large Language Models Across Training and
# Scaling", arXiv:2304.01373) and GPT-NeoX-20B (Black et al. 2022, arXiv:2204.06745): rotary on 25% of each
# head, parallel residual, untied head, exact GELU, context 2048. Their vocabularies are the tokenizer's
# 50277 ids padded for tensor parallelism, as in the published checkpoints: 50304, 50432 (6.9B, 20B), 50688 (12B).
_NEOX = dict(block_size=2048, rotary_pct=0.25, parallel_residual=True, tie_embeddings=False, activation="gelu")
PRESETS = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, block_size=1024, vocab_size=50304),
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280, block_size=1024, vocab_size=50304),
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600, block_size=1024, vocab_size=50304),
    "gpt3-125m": dict(n_layer=12, n_head=12, n_embd=768, block_size=2048, vocab_size=50304),
    "gpt3-350m": dict(n_layer=24, n_head=16, n_embd=1024, block_size=2048, vocab_size=50304),
    "gpt3-760m": dict(n_layer=24, n_head=12, n_embd=1536, block_size=2048, vocab_size=50304),
    "gpt3-1.3b": dict(n_layer=24, n_head=16, n_embd=2048, block_size=2048, vocab_size=50304),
    "gpt3-2.7b": dict(n_layer=32, n_head=20, n_embd=2560, block_size=2048, vocab_size=50304),
    "gpt3-6.7b": dict(n_layer=32, n_head=32, n_embd=4096, block_size=2048, vocab_size=50304),
    "pythia-70m": dict(n_layer=6, n_head=8, n_embd=512, vocab_size=50304, **_NEOX),
    "pythia-160m": dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50304, **_NEOX),
    "pythia-410m": dict(n_layer=24, n_head=16, n_embd=1024, vocab_size=50304, **_NEOX),
    "pythia-1b": dict(n_layer=16, n_head=8, n_embd=2048, vocab_size=50304, **_NEOX),
    "pythia-1.4b": dict(n_layer=24, n_head=16, n_embd=2048, vocab_size=50304, **_NEOX),
    "pythia-2.8b": dict(n_layer=32, n_head=32, n_embd=2560, vocab_size=50304, **_NEOX),
    "pythia-6.9b": dict(n_layer=32, n_head=32, n_embd=4096, vocab_size=50432, **_NEOX),
    "pythia-12b": dict(n_layer=36, n_head=40, n_embd=5120, vocab_size=50688, **_NEOX),
    "neox-20b": dict(n_layer=44, n_head=64, n_embd=6144, vocab_size=50432, **_NEOX),
}


TRAINING_ONLY_MODEL_KEYS = ("dropout", "activation_checkpointing")  # GPTConfig keys not in the weights


@dataclass
class GPTConfig:
    block_size: int = 1024  # context length in tokens
    vocab_size: int = 50304  # from scratch: the data's tokenizer, padded to a multiple of 64 (GPT-2's 50257 -> 50304)
    n_layer: int = 12  # transformer blocks
    n_head: int = 12  # attention heads per block
    n_embd: int = 768  # residual stream width
    dropout: float = 0.0  # dropout probability; 0 for pretraining
    bias: bool = True  # biases in Linear layers and LayerNorms, as GPT-2
    rotary_pct: float | None = None  # None: learned position embeddings; else fraction of head dims rotated (RoPE)
    rotary_base: float = 10000.0  # rotary: dim pair i turns by position * rotary_base^(-2i/rotary dims)
    parallel_residual: bool = False  # GPT-NeoX: x + attn(ln_1(x)) + mlp(ln_2(x)) in one step
    tie_embeddings: bool = True  # the output head shares wte's weight (GPT-2); False: its own matrix
    activation: str = "gelu_tanh"  # MLP nonlinearity: 'gelu_tanh' (GPT-2), 'gelu' (exact, GPT-NeoX), 'relu2'
    qk_norm: bool = False  # RMS-normalise each head's queries and keys before attention (no learned scale)
    zero_init_proj: bool = False  # the attention and MLP output projections start at zero
    value_embeds: bool = False  # a second token embedding added to every layer's attention values, gated per head
    smear: bool = False  # each token's embedding also gets a learned, gated share of the previous token's
    bigram_embeds: int = 0  # rows of a table of hashed (previous, current) token pairs added before each block; 0: none
    layer_norm_eps: float = 1e-5  # LayerNorm epsilon
    activation_checkpointing: bool | str = False  # recompute in backward: True, 'selective', False or 'auto'
    parametrization: str = "standard"  # 'standard' (GPT-2's) or 'mup': rates that transfer across width
    mup_base_width: int | None = None  # 'mup': the n_embd the rates were tuned at (None: n_embd)

    def __post_init__(self):
        def need(ok: bool, name: str, expected: str):
            if not ok:
                raise ValueError(f"GPTConfig: {name}={getattr(self, name)!r}, expected {expected}")

        def number(v):  # bools are ints in Python, never a valid size or rate here
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0, name, "a positive integer")
        for name in (
            "bias",
            "parallel_residual",
            "tie_embeddings",
            "qk_norm",
            "zero_init_proj",
            "value_embeds",
            "smear",
        ):
            need(isinstance(getattr(self, name), bool), name, "True or False")
        need(
            isinstance(self.activation_checkpointing, bool) or self.activation_checkpointing in CHECKPOINTING,
            "activation_checkpointing",
            f"True, False, {' or '.join(map(repr, CHECKPOINTING))}",
        )
        rows = self.bigram_embeds
        need(
            isinstance(rows, int) and not isinstance(rows, bool) and rows >= 0 and rows != 1,
            "bigram_embeds",
            "0 or >= 2",
        )
        need(number(self.dropout) and 0 <= self.dropout < 1, "dropout", "a number in [0, 1)")
        need(number(self.rotary_base) and self.rotary_base > 0, "rotary_base", "a number > 0")
        need(number(self.layer_norm_eps) and self.layer_norm_eps > 0, "layer_norm_eps", "a number > 0")
        need(self.activation in ACTIVATIONS, "activation", f"one of {', '.join(map(repr, ACTIVATIONS))}")
        need(self.parametrization in PARAMETRIZATIONS, "parametrization", " or ".join(map(repr, PARAMETRIZATIONS)))
        base, head_dim = self.mup_base_width, self.n_embd // max(1, self.n_head)
        need(
            base is None or isinstance(base, int) and not isinstance(base, bool) and base > 0 and base % head_dim == 0,
            "mup_base_width",
            f"None or a positive multiple of head_dim {head_dim} (n_embd / n_head)",
        )
        if self.smear and self.n_embd < SMEAR_CHANNELS:
            raise ValueError(f"GPTConfig: smear=True reads {SMEAR_CHANNELS} channels; n_embd={self.n_embd} has fewer")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig: n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if self.rotary_pct is not None:
            need(number(self.rotary_pct) and 0 < self.rotary_pct <= 1, "rotary_pct", "None or a value in (0, 1]")
            if self.rot_dim == 0 or self.rot_dim % 2:
                raise ValueError(
                    f"GPTConfig: rotary_pct={self.rotary_pct} gives {self.rot_dim} rotary dims of "
                    f"head_dim {self.n_embd // self.n_head}; expected an even number > 0"
                )

    def recomputes(self, block: int) -> bool:
        """Whether activation checkpointing recomputes block `block` in backward ('auto' not yet resolved by the
        memory plan: every block, the safe side)."""
        mode = self.activation_checkpointing
        return mode is True or mode == "auto" or mode == "selective" and block % 2 == 1

    @property
    def width_mult(self) -> float:
        """muP's n_embd / mup_base_width: hidden AdamW rates and the logits are divided by it (1.0 under standard)."""
        return self.n_embd / (self.mup_base_width or self.n_embd) if self.parametrization == "mup" else 1.0

    @property
    def rot_dim(self) -> int:
        return int(self.n_embd // self.n_head * self.rotary_pct) if self.rotary_pct else 0


# ----------------------------------------------------------------------------- rotary (GPT-NeoX style)


def rotary_cos_sin(rot_dim: int, n_pos: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables (n_pos, rot_dim). Dims i and i + rot_dim/2 form a pair turned by pos * base^(-2i/rot_dim)."""
    inv_freq = 1.0 / base ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)  # (rot_dim/2,)
    angles = torch.outer(torch.arange(n_pos, dtype=torch.float64), inv_freq)  # (n_pos, rot_dim/2)
    angles = torch.cat((angles, angles), dim=-1)  # (n_pos, rot_dim)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first rot_dim dims of x (B, nh, T, hs) by position; cos/sin (T, rot_dim). Other dims untouched."""
    rot_dim = cos.size(-1)
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)  # "rotate_half"
    x_rot = x_rot * cos.to(x.dtype) + rotated * sin.to(x.dtype)
    return torch.cat((x_rot, x_pass), dim=-1)


# ----------------------------------------------------------------------------- modules


def bigram_rows(idx, prev, rows: int):
    """The bigram table's row for each position of idx (B, T): its (previous token, token) pair hashed into the
    first rows - 1 rows (odd multipliers spread the pairs; distinct pairs may share a row), and the last row for a
    first token with no previous one (prev None; prev (B, 1): the token before idx[:, 0] in a cached sequence)."""
    first = prev if prev is not None else torch.full_like(idx[:, :1], -1)
    before, now = torch.cat((first, idx[:, :-1]), dim=1).long(), idx.long()
    pair = torch.bitwise_xor(before * 1_000_003, now * 19_260_817) % (rows - 1)
    return torch.where(before < 0, rows - 1, pair)


class KVCache:
    """Keys/values of one layer, preallocated (B, n_head, block_size, head_dim) on first use."""

    def __init__(self, block_size: int):
        self.block_size, self.k, self.v = block_size, None, None

    def update(self, k, v, pos: int):  # k, v (B, nh, T, hs) for positions pos..pos+T-1
        if self.k is None:  # allocate lazily so dtype/device follow the model (and autocast)
            B, nh, _, hs = k.shape
            self.k = k.new_empty(B, nh, self.block_size, hs)
            self.v = v.new_empty(B, nh, self.block_size, hs)
        T = k.size(2)
        self.k[:, :, pos : pos + T] = k
        self.v[:, :, pos : pos + T] = v
        return self.k[:, :, : pos + T], self.v[:, :, : pos + T]  # the filled prefix only


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head, self.dropout, self.qk_norm = config.n_head, config.dropout, config.qk_norm
        self.attn_mult = MUP_ATTN_MULT if config.parametrization == "mup" else None  # None: sdpa's 1/sqrt(hs)
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v for all heads
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        if config.value_embeds:  # how much of the value embedding each head mixes into its values
            self.ve_gate = nn.Parameter(torch.empty(config.n_head))

    def forward(self, x, rope=None, cache: KVCache | None = None, pos: int = 0, ve=None):
        B, T, C = x.shape
        hs = C // self.n_head
        q, k, v = self.c_attn(x).chunk(3, dim=2)  # of every head; on a tensor-parallel rank, of its share of them
        if ve is not None:  # (B, T, C): the value embedding of each token, in v's dtype (autocast's, not fp32)
            v = v + (ve * self.ve_gate.repeat_interleave(hs)).to(v.dtype)
        q = q.view(B, T, -1, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, -1, hs).transpose(1, 2)
        v = v.view(B, T, -1, hs).transpose(1, 2)
        if self.qk_norm:  # unit RMS per head: attention logits stay bounded whatever the weights grow to
            q, k = F.rms_norm(q, (q.size(-1),)), F.rms_norm(k, (k.size(-1),))
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        if self.attn_mult is not None:  # muP: scores times attn_mult / hs, where sdpa scales by 1 / sqrt(hs)
            q = q * (self.attn_mult / math.sqrt(hs))
        if cache is not None:
            k, v = cache.update(k, v, pos)  # (B, nh, pos+T, hs)
        S = k.size(2)
        # query t sits at absolute position S-T+t and may see keys 0..S-T+t; a single query sees everything.
        # sdpa's is_causal covers S == T without building a mask; an explicit one is only needed otherwise
        mask = None
        if T > 1 and S != T:
            mask = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(S - T)  # (T, S)
        # a plain Python bool (not an expression torch.compile traces symbolically): no graph break
        causal = True if (mask is None and T > 1) else False
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(B, T, -1)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)
        self.activation = config.activation

    def forward(self, x):
        h = self.c_fc(x)  # (B, T, 4C)
        if self.activation == "gelu_tanh":
            h = F.gelu(h, approximate="tanh")  # GPT-2's "gelu_new"
        elif self.activation == "gelu":
            h = F.gelu(h)  # exact (erf), GPT-NeoX
        else:
            h = F.relu(h).square()  # relu2 (So et al. 2021, "Primer")
        return self.dropout(self.c_proj(h))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps, bias=config.bias)
        self.mlp = MLP(config)
        self.parallel_residual = config.parallel_residual

    def forward(self, x, rope=None, cache=None, pos=0, ve=None):
        if self.parallel_residual:  # GPT-NeoX / GPT-J: both branches read the block's input
            return x + self.attn(self.ln_1(x), rope, cache, pos, ve) + self.mlp(self.ln_2(x))
        x = x + self.attn(self.ln_1(x), rope, cache, pos, ve)
        return x + self.mlp(self.ln_2(x))


def _chunk_loss(logits, targets, need_grad: bool):
    """Summed cross entropy of one chunk's logits (n, V) against targets (n,) (-1 = ignored), in fp32. With
    need_grad the logits are overwritten, in their dtype, by its gradient: softmax - onehot(target), zero on
    ignored rows."""
    x = logits.float()  # logits itself when fp32
    valid = targets != -1
    tgt = targets.clamp(min=0).unsqueeze(1)  # (n, 1)
    target_logit = x.gather(1, tgt).squeeze(1)
    top = x.amax(dim=1, keepdim=True)
    if torch.compiler.is_compiling():
        # pure expressions: Inductor sums each row in one pass and writes g in a second, exp recomputed and the
        # one-hot a comparison, with no (n, V) intermediate in memory
        lse = (x - top).exp().sum(dim=1, keepdim=True).log() + top
        g = (x - lse).exp() - (torch.arange(x.size(1), device=x.device) == tgt).to(x.dtype)
    else:  # eager: in place in the fp32 logits, the one-hot one element per row
        e = x.sub_(top).exp_()  # exp(logits - max)
        total = e.sum(dim=1, keepdim=True)
        lse = total.log() + top
        g = e.div_(total).scatter_add_(1, tgt, -torch.ones_like(tgt, dtype=x.dtype)) if need_grad else None
    if need_grad:
        logits.copy_(g.mul_(valid.unsqueeze(1)))
    return ((lse.squeeze(1) - target_logit) * valid).sum()


@functools.cache
def _compiled_chunk_loss():
    """_chunk_loss compiled on first use: one graph that every chunk of every step reuses."""
    return torch.compile(_chunk_loss)


def _chunked_loss(
    h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype, need_grad: bool, compiled: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ChunkedLMHeadLoss's work: (loss, grad_h, grad_w), the gradients of the mean (empty without need_grad).
    Under torch.compile it runs as one opaque op (_chunked_lm_head_loss), so compile neither unrolls the chunk
    loop nor keeps each chunk's (V, C) weight-gradient product alive until a fused sum; compiled, only the
    per-chunk softmax and gradient (_chunk_loss) is."""
    with torch.autocast(h.device.type, enabled=False):  # dtypes are explicit below
        wc = w.to(dtype)
        # the weight gradient sums over every chunk: in fp32 even for low-precision weights (FSDP's bf16
        # all-gathered parameters), as the fp32 path does, then rounded once (autograd casts it to w's dtype)
        grad_h = torch.empty_like(h) if need_grad else h.new_empty(0)
        grad_w = torch.zeros_like(w, dtype=torch.float32) if need_grad else w.new_empty(0, dtype=torch.float32)
        loss_sum = torch.zeros((), device=h.device, dtype=torch.float32)
        # one chunk's logits in dtype, turned in place into their gradient; eager under autocast also their fp32
        # copy. Buffers reused by every chunk: freeing and reallocating per chunk leaves holes in a CPU heap
        # that later requests cannot reuse
        rows = min(h.size(0), LOSS_CHUNK_ROWS)
        low = torch.empty((rows, w.size(0)), device=h.device, dtype=dtype)
        buf = low if compiled or dtype == torch.float32 else torch.empty_like(low, dtype=torch.float32)
        step = _compiled_chunk_loss() if compiled else _chunk_loss
        prod = torch.empty_like(w, dtype=dtype) if need_grad and dtype != torch.float32 else None  # reused too
        # slices on a real CPU only: fake tensors (dryrun.py) simulate a GPU's step, and no fake kernel makes the
        # temporary the slices avoid (the same peak, and 50x fewer ops to simulate at GPT-2's vocab)
        slice_rows = GRAD_W_SLICE_ROWS if h.device.type == "cpu" and not is_fake(h) else w.size(0)
        for i in range(0, h.size(0), LOSS_CHUNK_ROWS):
            hc, tc = h[i : i + LOSS_CHUNK_ROWS].to(dtype), targets[i : i + LOSS_CHUNK_ROWS]
            logits = torch.matmul(hc, wc.t(), out=low[: hc.size(0)])  # (n, V)
            x = logits if buf is low else buf[: hc.size(0)].copy_(logits)  # eager under autocast: fp32
            loss_sum += step(x, tc, need_grad)
            if not need_grad:
                continue
            g = logits if x is logits else logits.copy_(x)  # d(sum CE)/d logits, in dtype
            grad_h[i : i + LOSS_CHUNK_ROWS] = g @ wc
            if prod is None:
                grad_w.addmm_(g.t(), hc)  # accumulate in place, no (V, C) temporary
            else:  # the chunk's low-precision product, added in fp32: on a CPU a slice at a time, as a mixed-dtype
                torch.mm(g.t(), hc, out=prod)  # add there first casts its whole input to a fp32 temporary
                for j in range(0, prod.size(0), slice_rows):
                    grad_w[j : j + slice_rows] += prod[j : j + slice_rows]
        # at least 1: a micro-batch with no trained target (SFT's loss masks) has loss 0 and zero gradients,
        # not F.cross_entropy's 0/0 = nan, which no weight of 0 in the step's mean could cancel
        n_valid = (targets != -1).sum().clamp(min=1)
        if need_grad:
            grad_h.div_(n_valid)
            grad_w.div_(n_valid)
    return loss_sum / n_valid, grad_h, grad_w


_chunked_lm_head_loss = torch.library.custom_op("gpt::chunked_lm_head_loss", _chunked_loss, mutates_args=())


@_chunked_lm_head_loss.register_fake
def _(h, w, targets, dtype, need_grad, compiled):
    if not need_grad:
        return h.new_empty((), dtype=torch.float32), h.new_empty(0), w.new_empty(0, dtype=torch.float32)
    return h.new_empty((), dtype=torch.float32), torch.empty_like(h), torch.empty_like(w, dtype=torch.float32)


class ChunkedLMHeadLoss(torch.autograd.Function):
    """Mean cross entropy of logits = h @ w.T, computed LOSS_CHUNK_ROWS rows at a time.

    The gradients wrt h and w are computed chunk by chunk during forward and replayed in backward,
    so the (N, V) logits and their gradient never exist in full: memory is O(chunk * V).
    need_grad=False (evaluation under no_grad) computes the loss only.
    """

    @staticmethod
    def forward(ctx, h, w, targets, need_grad: bool):  # h (N, C), w (V, C), targets (N,) with -1 = ignore
        dev = h.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else h.dtype
        if torch.compiler.is_compiling():  # one opaque op to the graph; its per-chunk kernel compiled on its own
            loss, grad_h, grad_w = _chunked_lm_head_loss(h, w, targets, dtype, need_grad, True)
        else:  # the op's body: what a memory tracker on fake tensors (dryrun.py) sees op by op
            loss, grad_h, grad_w = _chunked_loss(h, w, targets, dtype, need_grad, False)
        ctx.save_for_backward(grad_h, grad_w)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_loss, grad_w * grad_loss, None, None


# ----------------------------------------------------------------------------- the model


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps, bias=config.bias),
            )
        )
        if config.rotary_pct is None:
            self.transformer.wpe = nn.Embedding(config.block_size, config.n_embd)
        else:  # not persistent: state_dict stays a plain GPT-2 layout; tables are rebuilt from the config
            cos, sin = rotary_cos_sin(config.rot_dim, config.block_size, config.rotary_base)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        if config.value_embeds:  # value embeddings (nanochat): each token's own vector, straight into attention
            self.transformer.vte = nn.Embedding(config.vocab_size, config.n_embd)
        if config.smear:  # the previous token's share: smear_lambda * sigmoid(smear_gate(the token's first channels))
            self.smear_gate = nn.Linear(SMEAR_CHANNELS, 1, bias=False)
            self.smear_lambda = nn.Parameter(torch.empty(1))  # 1-D: fully_shard refuses scalars
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.transformer.wte.weight = self.lm_head.weight  # weight tying (GPT-2)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: residual projections scaled by 1/sqrt(2 * n_layer)
            if name.endswith("c_proj.weight"):
                if config.zero_init_proj:  # each block starts as the identity (modded-nanogpt)
                    nn.init.zeros_(p)
                else:
                    nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
            elif name.endswith(("ve_gate", "smear_lambda")):  # in place, so a meta-device build records it
                nn.init.ones_(p)
        if config.parametrization == "mup":
            self.mup_init()
        if config.bigram_embeds:  # hashed token pairs (modded-nanogpt), a zero table added before every block
            self.transformer.bte = nn.Embedding(config.bigram_embeds, config.n_embd)
            self.bigram_lambdas = nn.Parameter(torch.empty(config.n_layer))  # each block's share of it
            nn.init.zeros_(self.transformer.bte.weight)
            nn.init.constant_(self.bigram_lambdas, 0.1)

    @torch.no_grad()
    def mup_init(self):
        """muP's initialisation (Tensor Programs V, Table 3; the mup package's conventions), from the standard one:
        the blocks' matrices (hidden: both dims grow with width) by fan-in, their std divided by sqrt(width_mult), so
        the model at its base width starts from the standard weights; an untied output head at zero (the mup
        package's readout_zero_init). Embeddings, norms and biases keep their width-independent init."""
        for name, p in self.named_parameters():
            if name.startswith("transformer.h.") and p.dim() == 2:
                p.div_(math.sqrt(self.config.width_mult))
        if not self.config.tie_embeddings:  # tied, the head is the embedding table: muP's 1/width_mult logits suffice
            nn.init.zeros_(self.lm_head.weight)

    def final_norm(self, x):
        """ln_f of the last block's output; under muP times 1 / width_mult, the readout's multiplier (the mup package's
        MuReadout with output_mult 1): the logits stay O(1) as the width grows."""
        x = self.transformer.ln_f(x)
        return x if self.config.parametrization == "standard" else x * (1.0 / self.config.width_mult)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count, tied wte/lm_head counted once. non_embedding drops the lookup tables, which cost
        no matmul FLOPs: wpe, vte, bte, and wte when it is untied (tied, it is also the output head's matmul)."""
        n = sum(p.numel() for p in self.parameters())
        for table in ("wpe", "vte", "bte"):
            if non_embedding and table in self.transformer:
                n -= self.transformer[table].weight.numel()
        if non_embedding and not self.config.tie_embeddings:
            n -= self.transformer.wte.weight.numel()
        return n

    def embed(self, idx, pos: int = 0, prev=None):
        """The first block's input (B, T, C) for tokens idx (B, T) at positions pos..pos+T-1: token embeddings (smear
        adds a gated share of the previous token's; prev as hidden_states'), learned positions (rotary: none, the
        blocks take rope()), dropout."""
        T = idx.size(1)
        if pos + T > self.config.block_size:
            raise ValueError(f"GPT: positions up to {pos + T} exceed block_size {self.config.block_size}")
        x = self.transformer.wte(idx)  # (B, T, C)
        if self.config.smear:  # modded-nanogpt's smear: a cheap path to the previous token before any attention
            first = self.transformer.wte(prev) if prev is not None else torch.zeros_like(x[:, :1])
            before = torch.cat((first, x[:, :-1]), dim=1)  # (B, T, C): each position's previous embedding
            x = x + self.smear_lambda * torch.sigmoid(self.smear_gate(x[..., :SMEAR_CHANNELS])) * before
        if self.config.rotary_pct is None:
            x = x + self.transformer.wpe(torch.arange(pos, pos + T, device=idx.device))
        return self.transformer.drop(x)

    def rope(self, pos: int, T: int):
        """The rotary tables (cos, sin) of positions pos..pos+T-1, (T, rot_dim) each; None with learned positions."""
        return None if self.config.rotary_pct is None else (self.rope_cos[pos : pos + T], self.rope_sin[pos : pos + T])

    def hidden_states(self, idx, caches: list[KVCache] | None = None, pos: int = 0, final_norm: bool = True, prev=None):
        """Final (ln_f) hidden states (B, T, C) for tokens idx (B, T) at positions pos..pos+T-1 (final_norm=False:
        the last block's output, before ln_f). prev (B, 1): the token before idx[:, 0] where idx continues a
        cached sequence (smear and the bigram table read it; None: idx starts the sequence). A pipeline stage
        (gpt2train/pipeline.py) holds some of the blocks, under their own indices; without wte (a later stage) idx is
        the previous stage's output (B, T, C)."""
        x = idx if self.transformer.wte is None else self.embed(idx, pos, prev)
        rope = self.rope(pos, idx.size(1))
        ve = self.transformer.vte(idx) if self.config.value_embeds else None  # (B, T, C)
        rows = self.config.bigram_embeds
        bigram = self.transformer.bte(bigram_rows(idx, prev, rows)) if rows else None  # (B, T, C)
        for name, block in self.transformer.h.named_children():
            i = int(name)
            if bigram is not None:
                x = x + self.bigram_lambdas[i] * bigram
            if self.config.recomputes(i) and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, rope, ve=ve, use_reentrant=False)
            else:
                x = block(x, rope, caches[i] if caches is not None else None, pos, ve)
        return self.final_norm(x) if final_norm else x

    def forward(self, idx, targets=None, return_logits: bool = True):
        """idx, targets (B, T). Returns (logits, loss):
        targets given: logits (B, T, V) and mean CE (ignore_index=-1); with return_logits=False the loss is
        computed in chunks without the full logits and (None, loss) is returned.
        targets None: logits of the last position only (B, 1, V), loss None.
        A pipeline stage before the last (no output head) returns its last block's output (B, T, C) alone."""
        if self.lm_head is None:
            return self.hidden_states(idx, final_norm=False)
        if targets is not None and not return_logits:
            return None, self.head_loss(self.hidden_states(idx, final_norm=False), targets)
        x = self.hidden_states(idx)  # (B, T, C)
        if targets is None:
            return self.lm_head(x[:, -1:, :]), None  # (B, 1, V)
        logits = self.lm_head(x)  # (B, T, V)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def head_loss(self, x, targets):
        """Mean cross entropy over targets != -1 (B, T) of the last block's output x (B, T, C): ln_f, the output
        head and the loss a chunk of rows at a time (ChunkedLMHeadLoss). One method so that parallel.shard can
        compile it under FSDP, as the whole model is compiled under DDP."""
        x = self.final_norm(x)
        need_grad = torch.is_grad_enabled() and (x.requires_grad or self.lm_head.weight.requires_grad)
        h = x.reshape(-1, x.size(-1))  # (B*T, C)
        return ChunkedLMHeadLoss.apply(h, self.lm_head.weight, targets.reshape(-1), need_grad)

    def generate(self, idx, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None, **options):
        """nanoGPT's call: idx (B, T) continued by max_new_tokens sampled tokens, (B, T + n). temperature 0 is greedy;
        options are gpt2train/generation.py's (top_p, eos_token, n_vocab; generator, use_kv_cache), which this
        delegates to, imported here so that model.py imports nothing of the library's to be built."""
        from gpt2train import generation  # the decoding loop and its KV cache; it imports this module

        generator, use_kv_cache = options.pop("generator", None), options.pop("use_kv_cache", True)
        sampling = generation.Sampling(temperature=temperature, top_k=top_k, **options)
        return generation.generate(self, idx, max_new_tokens, sampling, generator, use_kv_cache)

    # ------------------------------------------------------------------------- training helpers

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token: 6N for the matmuls (fwd + bwd) + 12*L*H*Q*T for attention (PaLM appendix B)."""
        cfg, T = self.config, seq_len or self.config.block_size
        return 6 * self.num_params(non_embedding=True) + 12 * cfg.n_layer * cfg.n_embd * T  # H*Q = n_embd
