"""GPT-2 in one file: config, modules, Hugging Face import/export, optimizer, MFU, KV-cache generation.

Parameter names follow OpenAI / Hugging Face GPT-2 (transformer.wte, transformer.h.N.attn.c_attn, ...),
so moving weights to and from `GPT2LMHeadModel` is a key-by-key copy plus a transpose of the four
Conv1D weights (HF stores them (in, out); nn.Linear stores (out, in)).
"""
import json
import math
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

GPT2_VOCAB = 50257  # real GPT-2 vocabulary; ids >= this in a padded vocab are never generated
EOT = 50256
LOSS_CHUNK_ROWS = 2048  # rows of (B*T) per lm_head+CE chunk when the full logits are not needed
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
HUB_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")

# GPT-2 sizes (Radford et al. 2019) and the GPT-3 family sizes of the MosaicML GPT-3 recipes (context 2048;
# 760m/1.3b/2.7b use head_dim 128 as MosaicML does, rather than the GPT-3 paper's head counts).
PRESETS = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, block_size=1024),
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280, block_size=1024),
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600, block_size=1024),
    "gpt3-125m": dict(n_layer=12, n_head=12, n_embd=768, block_size=2048),
    "gpt3-350m": dict(n_layer=24, n_head=16, n_embd=1024, block_size=2048),
    "gpt3-760m": dict(n_layer=24, n_head=12, n_embd=1536, block_size=2048),
    "gpt3-1.3b": dict(n_layer=24, n_head=16, n_embd=2048, block_size=2048),
    "gpt3-2.7b": dict(n_layer=32, n_head=20, n_embd=2560, block_size=2048),
    "gpt3-6.7b": dict(n_layer=32, n_head=32, n_embd=4096, block_size=2048),
}


@dataclass
class GPTConfig:
    block_size: int = 1024  # context length in tokens
    vocab_size: int = 50304  # GPT-2's 50257 tokens padded up to a multiple of 64 for faster matmuls
    n_layer: int = 12  # transformer blocks
    n_head: int = 12  # attention heads per block
    n_embd: int = 768  # residual stream width
    dropout: float = 0.0  # dropout probability; 0 for pretraining
    bias: bool = True  # biases in Linear layers and LayerNorms, as GPT-2
    rotary_pct: float | None = None  # None: learned wpe; else fraction of head dims rotated (GPT-NeoX)
    activation_checkpointing: bool = False  # recompute activations in backward: much less memory, ~1/3 slower

    def __post_init__(self):
        for key in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            if not getattr(self, key) >= 1:
                raise ValueError(f"GPTConfig: {key} must be >= 1; got {getattr(self, key)!r}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"GPTConfig: dropout must be in [0, 1); got {self.dropout!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig: n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if self.rotary_pct is not None:
            if not 0 < self.rotary_pct <= 1:
                raise ValueError(f"GPTConfig: rotary_pct={self.rotary_pct}, expected None or a value in (0, 1]")
            if self.rot_dim == 0 or self.rot_dim % 2:
                raise ValueError(f"GPTConfig: rotary_pct={self.rotary_pct} gives {self.rot_dim} rotary dims of "
                                 f"head_dim {self.n_embd // self.n_head}; expected an even number > 0")

    @property
    def rot_dim(self) -> int:
        return int(self.n_embd // self.n_head * self.rotary_pct) if self.rotary_pct else 0

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "GPTConfig":
        if name not in PRESETS:
            raise ValueError(f"GPTConfig.from_preset: unknown preset {name!r}, expected one of {sorted(PRESETS)}")
        known = {f.name for f in fields(cls)}
        if unknown := set(overrides) - known:
            raise ValueError(f"GPTConfig.from_preset: unknown field(s) {sorted(unknown)}, expected {sorted(known)}")
        return cls(**{**PRESETS[name], **overrides})


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
        self.k[:, :, pos:pos + T] = k
        self.v[:, :, pos:pos + T] = v
        return self.k[:, :, :pos + T], self.v[:, :, :pos + T]  # the filled prefix only


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head, self.dropout = config.n_head, config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v for all heads
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.use_sdpa = True  # False: explicit softmax(QK^T/sqrt(d)) attention, same math (for benchmarks)

    def forward(self, x, rope=None, cache: KVCache | None = None, pos: int = 0):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        if cache is not None:
            k, v = cache.update(k, v, pos)  # (B, nh, pos+T, hs)
        S = k.size(2)
        # query t sits at absolute position S-T+t and may see keys 0..S-T+t; a single query sees everything.
        # sdpa's is_causal covers S == T without building a mask; an explicit one is only needed otherwise
        mask = None
        if T > 1 and (S != T or not self.use_sdpa):
            mask = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(S - T)  # (T, S)
        if self.use_sdpa:
            # a plain Python bool (not an expression torch.compile traces symbolically): no graph break
            causal = True if (mask is None and T > 1) else False
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                               dropout_p=self.dropout if self.training else 0.0)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, T, S)
            if mask is not None:
                att = att.masked_fill(~mask, float("-inf"))
            y = self.attn_dropout(F.softmax(att, dim=-1)) @ v  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))  # GPT-2's "gelu_new"


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=1e-5, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=1e-5, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, rope=None, cache=None, pos=0):
        x = x + self.attn(self.ln_1(x), rope, cache, pos)
        return x + self.mlp(self.ln_2(x))


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
        with torch.autocast(dev, enabled=False):  # dtypes are explicit below
            wc = w.to(dtype)
            grad_h, grad_w = (torch.empty_like(h), torch.zeros_like(w)) if need_grad else (None, None)
            loss_sum = torch.zeros((), device=h.device, dtype=torch.float32)
            for i in range(0, h.size(0), LOSS_CHUNK_ROWS):
                hc, tc = h[i:i + LOSS_CHUNK_ROWS].to(dtype), targets[i:i + LOSS_CHUNK_ROWS]
                logits = (hc @ wc.t()).float()  # (n, V)
                lse = logits.logsumexp(dim=-1)  # (n,)
                valid = tc != -1
                tgt = tc.clamp(min=0).unsqueeze(1)  # (n, 1)
                loss_sum += ((lse - logits.gather(1, tgt).squeeze(1)) * valid).sum()
                if not need_grad:
                    continue
                # d(sum CE)/d logits = softmax - onehot(target), zero on ignored rows; reuse the logits buffer
                g = logits.sub_(lse.unsqueeze(1)).exp_()
                g.scatter_add_(1, tgt, -torch.ones_like(tgt, dtype=g.dtype))
                g = g.mul_(valid.unsqueeze(1)).to(dtype)
                grad_h[i:i + LOSS_CHUNK_ROWS] = g @ wc
                if grad_w.dtype == dtype:
                    grad_w.addmm_(g.t(), hc)  # accumulate in place, no (V, C) temporary
                else:
                    grad_w += g.t() @ hc  # low-precision chunk product, fp32 accumulation
            n_valid = (targets != -1).sum()  # 0 gives nan, as F.cross_entropy does
            if need_grad:
                ctx.save_for_backward(grad_h.div_(n_valid), grad_w.div_(n_valid))
        return loss_sum / n_valid

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_loss, grad_w * grad_loss, None, None


# ----------------------------------------------------------------------------- the model

class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, eps=1e-5, bias=config.bias),
        ))
        if config.rotary_pct is None:
            self.transformer.wpe = nn.Embedding(config.block_size, config.n_embd)
        else:  # not persistent: state_dict stays a plain GPT-2 layout; tables are rebuilt from the config
            cos, sin = rotary_cos_sin(config.rot_dim, config.block_size)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: residual projections scaled by 1/sqrt(2 * n_layer)
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count, tied wte/lm_head counted once; non_embedding drops wpe (a lookup, no FLOPs)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and "wpe" in self.transformer:
            n -= self.transformer.wpe.weight.numel()
        return n

    def hidden_states(self, idx, caches: list[KVCache] | None = None, pos: int = 0):
        """Final (ln_f) hidden states (B, T, C) for tokens idx (B, T) at positions pos..pos+T-1."""
        B, T = idx.shape
        if pos + T > self.config.block_size:
            raise ValueError(f"GPT: positions up to {pos + T} exceed block_size {self.config.block_size}")
        x = self.transformer.wte(idx)  # (B, T, C)
        rope = None
        if self.config.rotary_pct is None:
            x = x + self.transformer.wpe(torch.arange(pos, pos + T, device=idx.device))
        else:
            rope = (self.rope_cos[pos:pos + T], self.rope_sin[pos:pos + T])  # (T, rot_dim) each
        x = self.transformer.drop(x)
        for i, block in enumerate(self.transformer.h):
            if self.config.activation_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, rope, use_reentrant=False)
            else:
                x = block(x, rope, caches[i] if caches is not None else None, pos)
        return self.transformer.ln_f(x)

    def forward(self, idx, targets=None, return_logits: bool = True):
        """idx, targets (B, T). Returns (logits, loss):
        targets given: logits (B, T, V) and mean CE (ignore_index=-1); with return_logits=False the loss is
        computed in chunks without the full logits and (None, loss) is returned.
        targets None: logits of the last position only (B, 1, V), loss None."""
        x = self.hidden_states(idx)  # (B, T, C)
        if targets is None:
            return self.lm_head(x[:, -1:, :]), None  # (B, 1, V)
        if not return_logits:
            need_grad = torch.is_grad_enabled() and (x.requires_grad or self.lm_head.weight.requires_grad)
            h = x.reshape(-1, x.size(-1))  # (B*T, C)
            loss = ChunkedLMHeadLoss.apply(h, self.lm_head.weight, targets.reshape(-1), need_grad)
            return None, loss
        logits = self.lm_head(x)  # (B, T, V)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    # ------------------------------------------------------------------------- training helpers

    def configure_optimizer(self, weight_decay: float, lr: float, betas, fused: bool = False) -> torch.optim.AdamW:
        """AdamW with weight decay on 2D+ parameters only (matmul weights, embeddings), not biases/LayerNorms.
        fused: the one-kernel implementation (devices.fused_adamw_supported says where it exists)."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        impl = {"fused": True} if fused else {"foreach": True}
        return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), **impl)

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token: 6N for the matmuls (fwd + bwd) + 12*L*H*Q*T for attention (PaLM appendix B)."""
        cfg, T = self.config, seq_len or self.config.block_size
        return 6 * self.num_params(non_embedding=True) + 12 * cfg.n_layer * cfg.n_embd * T  # H*Q = n_embd

    def estimate_mfu(self, tokens_per_s: float, peak_flops: float | None) -> float | None:
        """Model FLOPs utilisation: achieved training FLOP/s over the device peak (None if peak unknown)."""
        return None if not peak_flops else tokens_per_s * self.flops_per_token() / peak_flops

    # ------------------------------------------------------------------------- Hugging Face import / export

    @classmethod
    def from_pretrained(cls, name_or_dir: str, **overrides) -> "GPT":
        """GPT-2 weights in Hugging Face format: a local dir (config.json + model.safetensors or pytorch_model.bin)
        or a hub name (gpt2, gpt2-medium, gpt2-large, gpt2-xl; needs internet). overrides: dropout,
        activation_checkpointing."""
        if bad := set(overrides) - {"dropout", "activation_checkpointing"}:
            raise ValueError(f"GPT.from_pretrained: cannot override {sorted(bad)}; "
                             "only dropout and activation_checkpointing")
        path = Path(name_or_dir)
        if not path.is_dir():
            if name_or_dir not in HUB_NAMES:
                raise ValueError(f"GPT.from_pretrained: {name_or_dir!r} is neither a directory nor one of {HUB_NAMES}")
            path = _download_from_hub(name_or_dir)
        hf = _read_hf_config(path)
        model = cls(GPTConfig(block_size=hf["n_positions"], vocab_size=hf["vocab_size"], n_layer=hf["n_layer"],
                              n_head=hf["n_head"], n_embd=hf["n_embd"], bias=True, **overrides))
        sd = _read_hf_weights(path)  # name -> tensor
        sd = {(k if k.startswith(("transformer.", "lm_head.")) else "transformer." + k): v for k, v in sd.items()
              if not k.endswith((".attn.bias", ".attn.masked_bias"))}  # HF causal-mask buffers
        lm_head = sd.pop("lm_head.weight", None)
        if lm_head is not None and not torch.equal(lm_head, sd.get("transformer.wte.weight", lm_head)):
            raise ValueError(f"GPT.from_pretrained: {path}: lm_head.weight differs from wte; GPT-2 ties them")
        ours = model.state_dict()
        ours.pop("lm_head.weight")  # tied to wte
        missing, unexpected = sorted(set(ours) - set(sd)), sorted(set(sd) - set(ours))
        if missing or unexpected:
            raise ValueError(f"GPT.from_pretrained: {path}: missing keys {missing[:5]}, "
                             f"unexpected keys {unexpected[:5]}")
        with torch.no_grad():
            for k, v in sd.items():
                v = v.t() if k.endswith(CONV1D_WEIGHTS) else v
                if v.shape != ours[k].shape:
                    raise ValueError(f"GPT.from_pretrained: {path}: {k} has shape {tuple(v.shape)}, "
                                     f"expected {tuple(ours[k].shape)}")
                ours[k].copy_(v)
        return model

    def save_pretrained(self, out_dir: str) -> None:
        """Write config.json + model.safetensors that transformers' GPT2LMHeadModel.from_pretrained loads."""
        cfg = self.config
        if cfg.rotary_pct is not None:
            raise ValueError(f"GPT.save_pretrained: rotary_pct={cfg.rotary_pct} has no GPT-2 equivalent "
                             "(GPT-2 uses learned positions); export needs rotary_pct=None")
        try:
            from safetensors.torch import save_file
        except ImportError as e:
            raise ImportError("GPT.save_pretrained needs the safetensors package: pip install safetensors") from e
        vocab = GPT2_VOCAB if cfg.vocab_size > GPT2_VOCAB else cfg.vocab_size  # drop padding rows
        tensors = {}
        for k, v in self.state_dict().items():
            if k == "lm_head.weight":
                continue  # tied; HF re-ties it to wte
            v = v.detach().cpu()
            v = v.t() if k.endswith(CONV1D_WEIGHTS) else v[:vocab] if k == "transformer.wte.weight" else v
            # safetensors needs contiguous tensors that share no memory
            tensors[k] = v.clone(memory_format=torch.contiguous_format)
        if not cfg.bias:  # GPT-2 has biases everywhere: bias=False is the same model with zero biases
            for k, v in list(tensors.items()):
                if k.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")) or k.endswith(CONV1D_WEIGHTS):
                    tensors[k[:-len("weight")] + "bias"] = torch.zeros(v.shape[-1], dtype=v.dtype)
        eos = EOT if vocab > EOT else vocab - 1
        hf_config = {
            "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": vocab,
            "n_positions": cfg.block_size, "n_ctx": cfg.block_size, "n_embd": cfg.n_embd, "n_layer": cfg.n_layer,
            "n_head": cfg.n_head, "n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
            "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
            "initializer_range": 0.02, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False, "tie_word_embeddings": True, "use_cache": True,
            "bos_token_id": eos, "eos_token_id": eos,
        }
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})

    # ------------------------------------------------------------------------- generation

    @contextmanager
    def _column_major_linears(self, enabled: bool):
        """While decoding in fp32 on a CPU, store the blocks' Linear weights column-major: same values and
        shapes, but x @ W.t() then reads an (in, out)-contiguous matrix. Restored to nn.Linear's layout after."""
        linears = [m for m in self.transformer.h.modules() if isinstance(m, nn.Linear)] if enabled else []
        for m in linears:
            m.weight.data = m.weight.data.t().contiguous().t()
        try:
            yield
        finally:
            for m in linears:
                m.weight.data = m.weight.data.contiguous()

    @torch.no_grad()
    def generate_stream(self, idx, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                        top_p: float | None = None, eos_token: int | None = None, generator=None,
                        use_kv_cache: bool = True):
        """Yield the next token of every row, (B,) LongTensor, for up to max_new_tokens steps.

        temperature 0 = greedy. Rows that produced eos_token keep emitting it; stops once all rows have.
        The KV cache is filled by one forward over the prompt, then each step feeds only the new token;
        once the context exceeds block_size every step recomputes on the last block_size tokens."""
        if temperature < 0 or (top_k is not None and top_k < 1) or (top_p is not None and not 0 < top_p <= 1):
            raise ValueError(f"generate: need temperature >= 0, top_k >= 1, 0 < top_p <= 1; "
                             f"got temperature={temperature}, top_k={top_k}, top_p={top_p}")
        bs = self.config.block_size
        if idx.size(1) > bs:
            warnings.warn(f"generate: prompt of {idx.size(1)} tokens is longer than block_size {bs}; "
                          f"using its last {bs} tokens")
        ctx = idx[:, -bs:]  # (B, <=bs) the model's view of the sequence
        caches = [KVCache(bs) for _ in self.transformer.h] if use_kv_cache else None
        done = torch.zeros(idx.size(0), dtype=torch.bool, device=idx.device)
        # each step multiplies one row per sequence by every weight matrix, a memory-bound read. On a CPU in
        # fp32 MKL streams an (in, out)-contiguous matrix up to 2.1x faster than nn.Linear's (out, in) rows, so
        # decoding reads a (C, V) copy of the embedding and column-major block weights; in bf16 the (out, in)
        # layout is the fast one, so it stays
        w = self.lm_head.weight
        fp32_cpu = w.device.type == "cpu" and w.dtype == torch.float32 and not torch.is_autocast_enabled("cpu")
        w_out = w.t().contiguous() if fp32_cpu else w.t()  # (C, V)
        pos, feed = 0, ctx  # tokens already in the cache, tokens to run next
        with self._column_major_linears(fp32_cpu):
            for _ in range(max_new_tokens):
                if caches is not None and pos + feed.size(1) <= bs:
                    h = self.hidden_states(feed, caches, pos)
                    pos += feed.size(1)
                else:  # no cache, or the window is full: recompute on the last block_size tokens
                    h = self.hidden_states(ctx)
                logits = (h[:, -1, :] @ w_out).float()  # (B, V), last position only
                nxt = _sample(logits, temperature, top_k, top_p, generator)  # (B,)
                if eos_token is not None:
                    nxt = torch.where(done, torch.full_like(nxt, eos_token), nxt)
                    done |= nxt == eos_token
                yield nxt
                if eos_token is not None and bool(done.all()):
                    return
                feed = nxt.unsqueeze(1)  # (B, 1)
                ctx = torch.cat((ctx, feed), dim=1)[:, -bs:]

    @torch.no_grad()
    def generate(self, idx, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, eos_token: int | None = None, generator=None,
                 use_kv_cache: bool = True) -> torch.Tensor:
        """Continue idx (B, T); returns (B, T + n_new) with the full original prompt in front."""
        new = list(self.generate_stream(idx, max_new_tokens, temperature, top_k, top_p, eos_token, generator,
                                        use_kv_cache))
        return torch.cat([idx] + [t.unsqueeze(1) for t in new], dim=1)


def _sample(logits, temperature, top_k, top_p, generator):
    """Pick one id per row from logits (B, V) fp32."""
    if logits.size(-1) > GPT2_VOCAB:
        logits[:, GPT2_VOCAB:] = float("-inf")  # padding rows of the vocabulary are not real tokens
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
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


# ----------------------------------------------------------------------------- helpers: HF files, optimizer, peak FLOPs

def _download_from_hub(name: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:
        raise ImportError(f"GPT.from_pretrained({name!r}) needs huggingface_hub (pip install huggingface_hub) "
                          "or a local directory with config.json + model.safetensors") from e
    return Path(snapshot_download(f"openai-community/{name}", allow_patterns=["config.json", "model.safetensors"]))


def _read_hf_config(path: Path) -> dict:
    file = path / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"GPT.from_pretrained: {file} not found; expected a Hugging Face GPT-2 directory")
    hf = json.loads(file.read_text())
    expected = {"model_type": "gpt2", "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "n_inner": None,
                "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False}
    for key, want in expected.items():
        got = hf.get(key, want)
        ok = got in ("gelu_new", "gelu_pytorch_tanh") if key == "activation_function" else (
            got in (None, 4 * hf.get("n_embd", 0)) if key == "n_inner" else got == want)
        if not ok:
            raise ValueError(f"GPT.from_pretrained: {file}: {key}={got!r}, expected {want!r}")
    return hf


def _read_hf_weights(path: Path) -> dict:
    if (path / "model.safetensors").is_file():
        try:
            from safetensors.torch import load_file
        except ImportError as e:
            raise ImportError(f"GPT.from_pretrained: {path}/model.safetensors needs the safetensors package "
                              "(pip install safetensors)") from e
        return load_file(str(path / "model.safetensors"))
    if (path / "pytorch_model.bin").is_file():
        return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"GPT.from_pretrained: {path} has neither model.safetensors nor pytorch_model.bin")
