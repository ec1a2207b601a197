"""The configuration of a gpt2-train model that neither GPT-2 nor GPT-NeoX can hold (QK-norm, value embeddings,
smear, the bigram table, ...), for transformers' remote code: `checkpoint.py export` copies this file verbatim
beside modeling_gpt2train.py, and config.json's auto_map names both. Each key is model.py's GPTConfig key of the
same name (tie_word_embeddings is its tie_embeddings), so the export holds the model exactly as it was trained.
"""

from transformers import PretrainedConfig


class GPT2TrainConfig(PretrainedConfig):
    model_type = "gpt2train"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]
    # the names transformers' generic code (caches, the harness, pipelines) asks for
    attribute_map = {
        "hidden_size": "n_embd",
        "num_hidden_layers": "n_layer",
        "num_attention_heads": "n_head",
        "max_position_embeddings": "block_size",
    }

    def __init__(
        self,
        block_size: int = 1024,  # context length in tokens
        vocab_size: int = 50304,  # rows of the embedding and the head (a padded vocabulary keeps its padding)
        n_layer: int = 12,  # transformer blocks
        n_head: int = 12,  # attention heads per block
        n_embd: int = 768,  # residual stream width
        dropout: float = 0.0,  # dropout probability (training only)
        bias: bool = True,  # biases in Linear layers and LayerNorms
        rotary_pct: float | None = None,  # None: learned position embeddings; else fraction of head dims rotated
        rotary_base: float = 10000.0,  # rotary: dim pair i turns by position * rotary_base^(-2i/rotary dims)
        parallel_residual: bool = False,  # GPT-NeoX: x + attn(ln_1(x)) + mlp(ln_2(x)) in one step
        activation: str = "gelu_tanh",  # MLP nonlinearity: 'gelu_tanh', 'gelu' (exact) or 'relu2'
        qk_norm: bool = False,  # RMS-normalise each head's queries and keys before attention
        zero_init_proj: bool = False,  # a fresh model's output projections start at zero (initialisation only)
        value_embeds: bool = False,  # a second token embedding added to the attention values, gated per head
        smear: bool = False,  # each token's embedding gets a gated share of the previous token's
        bigram_embeds: int = 0,  # rows of the hashed (previous, current) token-pair table; 0: none
        layer_norm_eps: float = 1e-5,  # LayerNorm epsilon
        tie_word_embeddings: bool = True,  # the output head is the token embedding (GPT-2)
        initializer_range: float = 0.02,  # std of a fresh model's weights
        use_cache: bool = True,  # forward() returns the KV cache (generate() reuses it)
        parametrization: str = "standard",  # 'mup': attention scores times 8/head_dim, logits over width_mult
        mup_base_width: int | None = None,  # 'mup': the width the rates were tuned at (None: n_embd)
        **kwargs,
    ):
        self.block_size, self.vocab_size = block_size, vocab_size
        self.n_layer, self.n_head, self.n_embd = n_layer, n_head, n_embd
        self.dropout, self.bias = dropout, bias
        self.rotary_pct, self.rotary_base = rotary_pct, rotary_base
        self.parallel_residual, self.activation = parallel_residual, activation
        self.qk_norm, self.zero_init_proj = qk_norm, zero_init_proj
        self.value_embeds, self.smear, self.bigram_embeds = value_embeds, smear, bigram_embeds
        self.layer_norm_eps, self.initializer_range, self.use_cache = layer_norm_eps, initializer_range, use_cache
        self.parametrization, self.mup_base_width = parametrization, mup_base_width
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
