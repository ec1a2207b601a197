"""A gpt2-train model for transformers' remote code (AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)):
the network of model.py, written again with transformers' KV cache, so that generate(), pipelines and the
lm-evaluation-harness run a model that neither GPT-2 nor GPT-NeoX can hold. `checkpoint.py export` copies this file
verbatim; it imports torch and transformers only. Parameter names are model.py's (transformer.wte,
transformer.h.N.attn.c_attn, lm_head, ...), so the weights are the checkpoint's tensors as they are.

Each option is model.py's and sits behind its config key: learned positions or rotary (partial or full), a
sequential or parallel residual, a tied or untied head, the activation, QK-norm, value embeddings, smear and the
bigram table. The arithmetic is model.py's, op for op: in float32 the logits equal the library's.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_gpt2train import GPT2TrainConfig

SMEAR_CHANNELS = 16  # smear: the gate reads this many leading channels of each token's embedding
# where a model output carries its cache: `cache` from transformers 5.2x on, `past_key_values` before
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def rotary_cos_sin(rot_dim: int, positions: torch.Tensor, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (B, 1, T, rot_dim) of positions (B, T): dims i and i + rot_dim/2 form a pair turned by
    position * base^(-2i/rot_dim), computed in float64 as model.py's tables are."""
    inv_freq = 1.0 / base ** (torch.arange(0, rot_dim, 2, dtype=torch.float64, device=positions.device) / rot_dim)
    angles = positions.double()[..., None] * inv_freq  # (B, T, rot_dim/2)
    angles = torch.cat((angles, angles), dim=-1)[:, None]  # (B, 1, T, rot_dim): broadcast over the heads
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first rot_dim dims of x (B, nh, T, hs) by position (GPT-NeoX's layout); other dims untouched."""
    rot_dim = cos.size(-1)
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)  # "rotate_half"
    x_rot = x_rot * cos.to(x.dtype) + rotated * sin.to(x.dtype)
    return torch.cat((x_rot, x_pass), dim=-1)


def previous_tokens(input_ids, prev_ids, attention_mask):
    """Each position's previous token (B, T), -1 where there is none: the first token of a sequence, and a token
    after left padding. prev_ids (B, 1): the token before input_ids[:, 0] when they continue a cached sequence."""
    first = prev_ids if prev_ids is not None else torch.full_like(input_ids[:, :1], -1)
    before = torch.cat((first, input_ids[:, :-1]), dim=1).long()
    if attention_mask is not None:  # (B, S): the cached tokens' and these; position S-T+t's previous is S-T+t-1
        S, T = attention_mask.size(1), input_ids.size(1)
        real = torch.cat((attention_mask.new_zeros(attention_mask.size(0), 1), attention_mask), dim=1)[:, S - T : S]
        before = torch.where(real.bool(), before, -1)
    return before


def bigram_rows(before, now, rows: int):
    """The bigram table's row of each (previous, current) pair (B, T): hashed into the first rows - 1 rows, the last
    row where there is no previous token (model.py's bigram_rows)."""
    pair = torch.bitwise_xor(before * 1_000_003, now.long() * 19_260_817) % (rows - 1)
    return torch.where(before < 0, rows - 1, pair)


def padding_mask(attention_mask, T: int):
    """(B, 1, T, S) bool for attention_mask (B, S) with zeros (padding): query t (at S-T+t) sees the keys up to it
    that are not padding, and always itself (a padding query would otherwise see nothing: NaN)."""
    S = attention_mask.size(1)
    q = torch.arange(S - T, S, device=attention_mask.device)[:, None]  # (T, 1)
    k = torch.arange(S, device=attention_mask.device)[None, :]  # (1, S)
    return ((k <= q) & attention_mask.bool()[:, None, None, :]) | (k == q)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPT2TrainConfig, layer_idx: int):
        super().__init__()
        self.n_head, self.dropout, self.qk_norm, self.layer_idx = (
            config.n_head,
            config.dropout,
            config.qk_norm,
            layer_idx,
        )
        self.mup = config.parametrization == "mup"  # muP: scores times 8 / hs, where sdpa scales by 1 / sqrt(hs)
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v for all heads
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        if config.value_embeds:  # how much of the value embedding each head mixes into its values
            self.ve_gate = nn.Parameter(torch.ones(config.n_head))

    def forward(self, x, rope=None, cache=None, mask=None, ve=None):
        B, T, C = x.shape
        hs = C // self.n_head
        q, k, v = self.c_attn(x).chunk(3, dim=2)
        if ve is not None:  # (B, T, C): the value embedding of each token
            v = v + (ve * self.ve_gate.repeat_interleave(hs)).to(v.dtype)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)
        if self.qk_norm:  # unit RMS per head, no learned scale
            q, k = F.rms_norm(q, (hs,)), F.rms_norm(k, (hs,))
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        if self.mup:
            q = q * (8.0 / math.sqrt(hs))
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)  # (B, nh, S, hs): the cached positions and these
        S = k.size(2)
        if mask is None and T > 1 and S != T:  # query t sits at S-T+t and sees keys 0..S-T+t
            mask = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(S - T)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None and T > 1, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPT2TrainConfig):
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
            h = F.relu(h).square()  # relu2 (Primer)
        return self.dropout(self.c_proj(h))


class Block(nn.Module):
    def __init__(self, config: GPT2TrainConfig, layer_idx: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps, bias=config.bias)
        self.attn = CausalSelfAttention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps, bias=config.bias)
        self.mlp = MLP(config)
        self.parallel_residual = config.parallel_residual

    def forward(self, x, rope=None, cache=None, mask=None, ve=None):
        if self.parallel_residual:  # GPT-NeoX: both branches read the block's input
            return x + self.attn(self.ln_1(x), rope, cache, mask, ve) + self.mlp(self.ln_2(x))
        x = x + self.attn(self.ln_1(x), rope, cache, mask, ve)
        return x + self.mlp(self.ln_2(x))


class GPT2TrainForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = GPT2TrainConfig
    _no_split_modules = ["Block"]  # device_map="auto" keeps each block on one device
    _tied_weights_keys = {"lm_head.weight": "transformer.wte.weight"}  # when config.tie_word_embeddings

    def __init__(self, config: GPT2TrainConfig):
        super().__init__(config)
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps, bias=config.bias),
            )
        )
        if config.rotary_pct is None:  # learned positions; rotary tables are computed per call from the positions
            self.transformer.wpe = nn.Embedding(config.block_size, config.n_embd)
        if config.value_embeds:  # value embeddings: each token's own vector, straight into attention
            self.transformer.vte = nn.Embedding(config.vocab_size, config.n_embd)
        if config.smear:  # the previous token's share: smear_lambda * sigmoid(smear_gate(the token's first channels))
            self.smear_gate = nn.Linear(SMEAR_CHANNELS, 1, bias=False)
            self.smear_lambda = nn.Parameter(torch.ones(1))
        if config.bigram_embeds:  # hashed (previous, current) token pairs, a table added before every block
            self.transformer.bte = nn.Embedding(config.bigram_embeds, config.n_embd)
            self.bigram_lambdas = nn.Parameter(torch.full((config.n_layer,), 0.1))  # each block's share of it
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.rot_dim = int(config.n_embd // config.n_head * config.rotary_pct) if config.rotary_pct else 0
        self.post_init()

    def _init_weights(self, module):
        """A fresh model's weights (model.py's initialisation); from_pretrained loads every one of them."""
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, (CausalSelfAttention, MLP)):  # residual projections: 1/sqrt(2 * n_layer), or zero
            proj_std = 0.0 if self.config.zero_init_proj else std / (2 * self.config.n_layer) ** 0.5
            nn.init.normal_(module.c_proj.weight, mean=0.0, std=proj_std)
        if isinstance(module, CausalSelfAttention) and hasattr(module, "ve_gate"):
            nn.init.ones_(module.ve_gate)
        if module is self and self.config.smear:
            nn.init.ones_(self.smear_lambda)
        if module is self and self.config.bigram_embeds:
            nn.init.zeros_(self.transformer.bte.weight)
            nn.init.constant_(self.bigram_lambdas, 0.1)

    def get_input_embeddings(self):
        return self.transformer.wte

    def set_input_embeddings(self, value):
        self.transformer.wte = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def prepare_inputs_for_generation(self, input_ids, **kwargs):
        """transformers' inputs for the next step, plus prev_ids: the token before the new ones, which smear and the
        bigram table read once the earlier tokens are in the cache."""
        inputs = super().prepare_inputs_for_generation(input_ids, **kwargs)
        new = inputs.get("input_ids")
        if new is not None and new.size(1) < input_ids.size(1):
            inputs["prev_ids"] = input_ids[:, -new.size(1) - 1 : -new.size(1)]
        return inputs

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        cache=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        prev_ids=None,
        **kwargs,
    ):
        """logits (B, T, V) of input_ids (B, T) (the last logits_to_keep positions when > 0); with labels (B, T), the
        mean cross entropy of each position's next label (-100: ignored); the KV cache (transformers' cache, or
        past_key_values in transformers < 5.2x) holds the earlier positions, prev_ids (B, 1) the token before
        input_ids (prepare_inputs_for_generation passes it)."""
        cfg = self.config
        cache = cache if cache is not None else past_key_values
        if use_cache if use_cache is not None else (cfg.use_cache and not self.training):
            cache = cache if cache is not None else DynamicCache()
        B, T = input_ids.shape
        past = cache.get_seq_length() if cache is not None else 0
        if past + T > cfg.block_size:
            raise ValueError(f"gpt2train: positions up to {past + T} exceed block_size {cfg.block_size}")
        if past and prev_ids is None and (cfg.smear or cfg.bigram_embeds):
            raise ValueError("gpt2train: smear and the bigram table need prev_ids, the token before input_ids")
        if attention_mask is not None and bool(attention_mask.all()):
            attention_mask = None  # no padding: the causal path of model.py
        if position_ids is None:  # a left-padded row's first real token is at position 0
            pos = torch.arange(past, past + T, device=input_ids.device).expand(B, T)
            position_ids = (
                pos if attention_mask is None else (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -T:]
            )
        before = previous_tokens(input_ids, prev_ids, attention_mask) if cfg.smear or cfg.bigram_embeds else None

        x = self.transformer.wte(input_ids)  # (B, T, C)
        if cfg.smear:  # a cheap path to the previous token before any attention
            prev = torch.where((before >= 0)[..., None], self.transformer.wte(before.clamp(min=0)), 0.0)
            x = x + self.smear_lambda * torch.sigmoid(self.smear_gate(x[..., :SMEAR_CHANNELS])) * prev
        if cfg.rotary_pct is None:
            x = x + self.transformer.wpe(position_ids)
        x = self.transformer.drop(x)
        rope = rotary_cos_sin(self.rot_dim, position_ids, cfg.rotary_base) if cfg.rotary_pct else None
        ve = self.transformer.vte(input_ids) if cfg.value_embeds else None  # (B, T, C)
        rows = cfg.bigram_embeds
        bigram = self.transformer.bte(bigram_rows(before, input_ids, rows)) if rows else None  # (B, T, C)
        mask = padding_mask(attention_mask, T) if attention_mask is not None else None
        for i, block in enumerate(self.transformer.h):
            if bigram is not None:
                x = x + self.bigram_lambdas[i] * bigram
            x = block(x, rope, cache, mask, ve)
        x = self.transformer.ln_f(x)
        if self.config.parametrization == "mup":  # muP's readout multiplier: the logits over n_embd / base width
            x = x * (1.0 / (self.config.n_embd / (self.config.mup_base_width or self.config.n_embd)))
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        logits = self.lm_head(x)  # (B, T, V)
        loss = None
        if labels is not None:  # transformers' convention: labels are the inputs, shifted here
            shifted = logits[:, :-1].float().reshape(-1, logits.size(-1))
            loss = F.cross_entropy(shifted, labels[:, 1:].reshape(-1).to(logits.device), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: cache})
