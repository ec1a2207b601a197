"""Hugging Face import and export: the one place that knows transformers' file layout and key names (as
torchtitan's state-dict adapters). from_pretrained() reads a local GPT-2 (`GPT2LMHeadModel`) or GPT-NeoX
(`GPTNeoXForCausalLM`, the Pythia checkpoints) directory, a gpt2train directory (below), or a GPT-2 hub name;
save_pretrained() writes one that transformers loads.

Our parameter names are GPT-2's (transformer.wte, transformer.h.N.attn.c_attn, ...), so GPT-2 is a key-by-key
copy plus a transpose of the four Conv1D weights (HF stores them (in, out); nn.Linear stores (out, in)).
GPT-NeoX is the same network with other names, an interleaved per-head QKV layout, rotary positions, a parallel
residual and an untied output head: all options of GPTConfig.

Every other model (QK-norm, value embeddings, smear, the bigram table, a parallel residual with learned positions)
is written as a gpt2train directory: transformers' remote code, hf_modeling/'s configuration_gpt2train.py and
modeling_gpt2train.py copied beside config.json (its auto_map names them), the weights under our own names, every
GPTConfig key in config.json under its own name (tie_embeddings as tie_word_embeddings).
"""

import dataclasses
import json
import os
from pathlib import Path

import torch

from gpt2train import bpe
from gpt2train.assets import EOT
from gpt2train.console import log
from gpt2train.files import atomic_write, first_line
from model import GPT, GPT2_VOCAB, HUB_NAMES, TRAINING_ONLY_MODEL_KEYS, GPTConfig

CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# the modern recipe's options neither GPT2LMHeadModel nor GPTNeoXForCausalLM has: such a model is a gpt2train one
NO_HF_EQUIVALENT = {  # the model's options that neither loads, each with what it is
    "qk_norm": "neither normalises queries and keys",
    "value_embeds": "a second token embedding added to the attention values",
    "smear": "the previous token's embedding mixed into each token's",
    "bigram_embeds": "a table of hashed token pairs added before every block",
    # foldable, not folded yet: logits * 1/width_mult into ln_f's weight and bias, attention's MUP_ATTN_MULT/head_dim
    # (1/sqrt(head_dim) at head_dim 64) into c_attn's query rows
    "parametrization": "muP's logit multiplier 1/width_mult and attention scale 8/head_dim",  # gpt2train's route
}
HF_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu2": "relu2"}
HF_MODELING = Path(__file__).parent / "hf_modeling"  # the remote code a gpt2train directory carries
REMOTE_CODE = ("configuration_gpt2train.py", "modeling_gpt2train.py")
# the GPTConfig keys modeling_gpt2train.py implements (tie_embeddings too, as tie_word_embeddings): a model with any
# other key off its default (a new option of model.py) exports nowhere until the modeling
# code has it and this tuple names it
GPT2TRAIN_KEYS = (
    "block_size",
    "vocab_size",
    "n_layer",
    "n_head",
    "n_embd",
    "dropout",
    "bias",
    "rotary_pct",
    "rotary_base",
    "parallel_residual",
    "activation",
    "qk_norm",
    "zero_init_proj",
    "value_embeds",
    "smear",
    "bigram_embeds",
    "layer_norm_eps",
    "parametrization",
    "mup_base_width",
)
# config.json keys of a gpt2train directory that are transformers' bookkeeping, not the architecture; any other key
# that is not a GPTConfig key is an architecture this version cannot build (e.g. one a newer version wrote)
HF_BOOKKEEPING_KEYS = {
    "architectures",
    "auto_map",
    "model_type",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "tie_word_embeddings",
    "use_cache",
    "initializer_range",
    "_name_or_path",
}
NEOX_LAYER_NAMES = {
    "ln_1": "input_layernorm",
    "ln_2": "post_attention_layernorm",
    "attn.c_attn": "attention.query_key_value",
    "attn.c_proj": "attention.dense",
    "mlp.c_fc": "mlp.dense_h_to_4h",
    "mlp.c_proj": "mlp.dense_4h_to_h",
}


def from_pretrained(name_or_dir: str, **overrides) -> GPT:
    """Weights in Hugging Face format: a local dir (config.json + model.safetensors or pytorch_model.bin, or
    their sharded *.index.json) holding a GPT-2 (model_type 'gpt2'), GPT-NeoX / Pythia ('gpt_neox') or gpt2train
    (save_pretrained's remote-code export) model, or a GPT-2 hub name (gpt2, gpt2-medium, gpt2-large, gpt2-xl;
    needs internet). overrides: dropout, activation_checkpointing."""
    if bad := set(overrides) - set(TRAINING_ONLY_MODEL_KEYS):
        raise ValueError(
            f"from_pretrained: cannot override {sorted(bad)}; only {' and '.join(TRAINING_ONLY_MODEL_KEYS)}"
        )
    path = Path(name_or_dir)
    if not path.is_dir():
        if name_or_dir not in HUB_NAMES:
            raise ValueError(f"from_pretrained: {name_or_dir!r} is neither a directory nor one of {HUB_NAMES}")
        path = _download_from_hub(name_or_dir)
    hf, file = _read_hf_config(path), path / "config.json"
    kind = hf["model_type"]
    neox = kind == "gpt_neox"
    keywords = {"gpt2": _gpt2_config, "gpt_neox": _neox_config, "gpt2train": _gpt2train_config}[kind](hf, file)
    model = GPT(GPTConfig(**keywords, **overrides))
    theirs = _read_hf_weights(path)
    head = "embed_out.weight" if neox else "lm_head.weight"
    if neox:  # transformers >= 5 names the head lm_head; the Pythia checkpoints call it embed_out
        theirs = {
            ("embed_out.weight" if k == "lm_head.weight" else k): v
            for k, v in theirs.items()
            if not k.endswith(("attention.bias", "attention.masked_bias", "rotary_emb.inv_freq"))
        }
    elif kind == "gpt2":  # the OpenAI hub files have no "transformer." prefix, no lm_head and causal-mask buffers
        theirs = {
            (k if k.startswith(("transformer.", "lm_head.")) else "transformer." + k): v
            for k, v in theirs.items()
            if not k.endswith((".attn.bias", ".attn.masked_bias"))
        }
    ours = model.state_dict()
    if model.config.tie_embeddings:
        ours.pop("lm_head.weight")  # it is wte
        embed, lm_head = theirs.get(_hf_name("transformer.wte.weight", neox)), theirs.pop(head, None)
        if lm_head is not None and embed is not None and not torch.equal(lm_head, embed):
            raise ValueError(
                f"from_pretrained: {path}: {head} differs from the input embedding, "
                f"but {file} says tie_word_embeddings=true"
            )
    names = {_hf_name(k, neox): k for k in ours}  # theirs -> ours
    missing, unexpected = sorted(set(names) - set(theirs)), sorted(set(theirs) - set(names))
    if missing or unexpected:
        raise ValueError(f"from_pretrained: {path}: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}")
    with torch.no_grad():
        for name, v in theirs.items():
            k = names[name]
            v = (
                _qkv_from_neox(v, model.config.n_head)
                if neox and ".c_attn." in k
                else (v.t() if kind == "gpt2" and k.endswith(CONV1D_WEIGHTS) else v)
            )
            if v.shape != ours[k].shape:
                raise ValueError(
                    f"from_pretrained: {path}: {name} has shape {tuple(v.shape)}, expected {tuple(ours[k].shape)}"
                )
            if not v.is_floating_point():  # copy_ would cast quantized or damaged integers silently
                raise ValueError(
                    f"from_pretrained: {path}: {name} holds {v.dtype} values, expected floating-point weights"
                )
            ours[k].copy_(v)
    return model


def save_pretrained(
    model: GPT,
    out_dir: str,
    tokenizer_dir: str | None = None,
    chat_template: str | None = None,
    tokenizer_json: str | None = None,
) -> None:
    """Write config.json + model.safetensors that transformers loads (export_route): a GPT2LMHeadModel for learned
    positions (rotary_pct=None), a GPTNeoXForCausalLM (Pythia layout) for rotary ones; bias=False is written as zero
    biases, zero_init_proj and dropout need nothing. A model with qk_norm, value_embeds, smear, bigram_embeds, or a
    parallel residual with learned positions, exists in neither: it is written as a gpt2train directory (its remote
    code, every row of its vocabulary, generation_config.json's suppress_tokens keeping generate() off the padding
    rows as sample.py does). With them the tokenizer (bpe.save_tokenizer:
    tokenizer_dir's own tokenizer.json if it has one, else GPT-2's; skipped, with a note, for a vocabulary too
    small for GPT-2's; `tokenizer_json`, a checkpoint's own tokenizer.json text, wins over both) and
    generation_config.json with its <|endoftext|> id as eos."""
    cfg = model.config
    route = export_route(cfg)
    from safetensors.torch import save_file  # a runtime dependency (requirements.txt)

    neox = route == "gpt_neox"
    # GPT-2 files hold the real vocabulary only; GPT-NeoX checkpoints keep their padded one (as Pythia's do)
    own = tokenizer_json is not None  # a tokenizer of the run's own: every row goes, as GPT-NeoX does
    vocab = GPT2_VOCAB if route == "gpt2" and not own and cfg.vocab_size > GPT2_VOCAB else cfg.vocab_size
    chat_tokens = {}
    if chat_template is not None and not own:  # GPT-2's chat tokens (chat.py) are rows of the padded vocabulary
        from gpt2train import chat

        chat_tokens = chat.SPECIAL
        vocab = max(vocab, max(chat_tokens.values()) + 1)
    tensors = _gpt2train_tensors(model) if route == "gpt2train" else _hf_tensors(model, vocab, neox)
    out = Path(out_dir)
    dir_json = Path(tokenizer_dir) / "tokenizer.json" if tokenizer_dir is not None else None
    if not own and dir_json is not None and dir_json.is_file():  # a model imported with its own (e.g. Pythia's)
        tokenizer_json = dir_json.read_text(encoding="utf-8")
    if tokenizer_json is not None or vocab > EOT:
        # a chat model's generation ends at <|end|>: the eos token of its tokenizer_config.json too, where
        # llama.cpp's converter looks (generation_config.json below lists both stops for transformers)
        eos = bpe.save_tokenizer(
            out,
            tokenizer_json,
            chat_template,
            model_max_length=cfg.block_size,
            special_tokens=chat_tokens,
            eos_token="<|end|>" if chat_tokens else None,
        )
    else:
        eos = None
        log(f"{out}: no tokenizer written: vocab_size {vocab} is smaller than GPT-2's {GPT2_VOCAB}", note=True)
    eos = vocab - 1 if eos is None else eos
    hf_config = _gpt2train_json(cfg, eos) if route == "gpt2train" else _hf_config(cfg, vocab, eos, neox)
    atomic_write(out / "config.json", json.dumps(hf_config, indent=2) + "\n")  # a full disk's error names the file
    stop = [eos, chat_tokens["<|end|>"]] if chat_tokens else eos  # a chat model's reply ends at <|end|>
    generation = {"bos_token_id": eos, "eos_token_id": stop}
    if route == "gpt2train":
        generation.update(_write_remote_code(out, cfg))
    atomic_write(out / "generation_config.json", json.dumps(generation) + "\n")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    umask = os.umask(0o022)  # safetensors creates the file 0600: give it the mode its siblings have
    os.umask(umask)
    os.chmod(out / "model.safetensors", 0o666 & ~umask)


def nonstandard_options(cfg) -> list[str]:
    """The options of this GPTConfig that neither GPT-2 nor GPT-NeoX has (NO_HF_EQUIVALENT, and a parallel residual
    with learned positions), each as 'key=value'; empty for a model one of them holds."""
    off = {key: GPTConfig.__dataclass_fields__[key].default for key in NO_HF_EQUIVALENT}  # False, or 0 rows
    found = [f"{key}={getattr(cfg, key)!r}" for key in NO_HF_EQUIVALENT if getattr(cfg, key) != off[key]]
    if cfg.rotary_pct is None and cfg.parallel_residual:  # GPT-2's residual is sequential, GPT-NeoX's is rotary
        found.append("parallel_residual=True with rotary_pct=None")
    return found


def export_route(cfg) -> str:
    """How save_pretrained writes a model of this GPTConfig: 'gpt2' (GPT2LMHeadModel: learned positions), 'gpt_neox'
    (GPTNeoXForCausalLM: rotary), or 'gpt2train' (its own remote code) when neither holds it. ValueError for a key
    off its default that no route holds yet (not in GPT2TRAIN_KEYS)."""
    unmodeled = [
        f"{f.name}={getattr(cfg, f.name)!r}"
        for f in dataclasses.fields(cfg)
        if f.name not in (*GPT2TRAIN_KEYS, "tie_embeddings", *TRAINING_ONLY_MODEL_KEYS)
        and getattr(cfg, f.name) != f.default
    ]
    if unmodeled:
        raise ValueError(
            f"save_pretrained: {', '.join(unmodeled)}: not in the exported modeling code yet "
            f"(gpt2train/hf_modeling/modeling_gpt2train.py; hf.GPT2TRAIN_KEYS names what it implements)"
        )
    if nonstandard_options(cfg):
        return "gpt2train"
    return "gpt2" if cfg.rotary_pct is None else "gpt_neox"


def _gpt2train_tensors(model: GPT) -> dict:
    """{our name: contiguous CPU tensor} of a gpt2train export: every weight as it is, every row of the vocabulary,
    a tied head left to transformers to re-tie."""
    sd = model.state_dict()
    if model.config.tie_embeddings:
        sd.pop("lm_head.weight")
    return {k: v.detach().cpu().clone(memory_format=torch.contiguous_format) for k, v in sd.items()}


def _gpt2train_json(cfg, eos: int) -> dict:
    """config.json of a gpt2train export: the remote code's classes (auto_map) and the GPTConfig keys it implements
    (GPT2TRAIN_KEYS: every one but the training-only activation_checkpointing)."""
    keys = {k: getattr(cfg, k) for k in GPT2TRAIN_KEYS}
    return {
        "architectures": ["GPT2TrainForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_gpt2train.GPT2TrainConfig",
            "AutoModelForCausalLM": "modeling_gpt2train.GPT2TrainForCausalLM",
        },
        "model_type": "gpt2train",
        **keys,
        **_config_tail(cfg, eos),
    }


def _write_remote_code(out: Path, cfg) -> dict:
    """Copy hf_modeling/'s two files into the export; say which options sent it there (a note). Returns the
    generation settings it needs: suppress_tokens, the padding rows past the written tokenizer's ids."""
    for name in REMOTE_CODE:
        atomic_write(out / name, (HF_MODELING / name).read_text())
    log(
        f"{out}: {', '.join(nonstandard_options(cfg))}: no GPT-2 or GPT-NeoX equivalent, so a gpt2train model "
        "(its own modeling code: load it with trust_remote_code=True)",
        note=True,
    )
    tokenizer = out / "tokenizer.json"
    if not tokenizer.is_file():
        return {}
    tok = json.loads(tokenizer.read_text(encoding="utf-8"))
    ids = [*tok["model"]["vocab"].values(), *(t["id"] for t in tok.get("added_tokens", []))]
    return {"suppress_tokens": list(range(max(ids) + 1, cfg.vocab_size))} if max(ids) + 1 < cfg.vocab_size else {}


def _hf_tensors(model: GPT, vocab: int, neox: bool) -> dict:
    """{Hugging Face name: contiguous CPU tensor} of the model's weights: GPT-2's Conv1D weights transposed or
    GPT-NeoX's fused qkv reordered, the embedding and head cut to `vocab` rows, zero biases for bias=False, a
    tied head left to transformers to re-tie."""
    cfg = model.config
    sd = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    if cfg.tie_embeddings:
        sd.pop("lm_head.weight")  # transformers re-ties it to the input embedding
    if not cfg.bias:  # both have biases everywhere: bias=False is the same model with zero biases
        for k, v in list(sd.items()):
            if k.startswith("transformer.h.") or k.startswith("transformer.ln_f."):
                sd[k[: -len("weight")] + "bias"] = torch.zeros(v.shape[0], dtype=v.dtype)
    tensors = {}
    for k, v in sd.items():
        if neox and ".c_attn." in k:
            v = _qkv_to_neox(v, cfg.n_head)
        elif not neox and k.endswith(CONV1D_WEIGHTS):
            v = v.t()
        elif k in ("transformer.wte.weight", "lm_head.weight"):
            v = v[:vocab]
        # safetensors needs contiguous tensors that share no memory
        tensors[_hf_name(k, neox)] = v.clone(memory_format=torch.contiguous_format)
    return tensors


def _hf_config(cfg, vocab: int, eos: int, neox: bool) -> dict:
    """config.json of the GPTNeoXForCausalLM (neox) or GPT2LMHeadModel that is this GPTConfig."""
    act = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu2": "relu2"}[cfg.activation]
    if neox:
        return {
            "architectures": ["GPTNeoXForCausalLM"],
            "model_type": "gpt_neox",
            "vocab_size": vocab,
            "max_position_embeddings": cfg.block_size,
            "hidden_size": cfg.n_embd,
            "num_hidden_layers": cfg.n_layer,
            "num_attention_heads": cfg.n_head,
            "intermediate_size": 4 * cfg.n_embd,
            "hidden_act": act,
            "rotary_pct": cfg.rotary_pct,
            "rotary_emb_base": cfg.rotary_base,
            "use_parallel_residual": cfg.parallel_residual,
            "layer_norm_eps": cfg.layer_norm_eps,
            "attention_dropout": cfg.dropout,
            "hidden_dropout": cfg.dropout,
            "attention_bias": True,
            "initializer_range": 0.02,
            **_config_tail(cfg, eos),
        }
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": vocab,
        "n_positions": cfg.block_size,
        "n_ctx": cfg.block_size,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": None,
        "activation_function": act,
        "layer_norm_epsilon": cfg.layer_norm_eps,
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        **_config_tail(cfg, eos),
    }


def _config_tail(cfg, eos: int) -> dict:
    """The last keys of every route's config.json: the head's tie, the KV cache, the bos and eos ids."""
    return {"tie_word_embeddings": cfg.tie_embeddings, "use_cache": True, "bos_token_id": eos, "eos_token_id": eos}


def pad_vocab(model: GPT, vocab_size: int) -> GPT:
    """The model with its embedding (and an untied head) grown to vocab_size rows, e.g. GPT-2's 50257 to the padded
    50304 that holds the chat tokens (chat.py). The new rows start as the mean of the old ones: an average token,
    neither favoured nor ruled out by the head."""
    old = model.config.vocab_size
    bigger = GPT(dataclasses.replace(model.config, vocab_size=vocab_size))
    sd = model.state_dict()  # a tied head is the same tensor as wte: both get the same rows
    for k in ("transformer.wte.weight", "lm_head.weight"):
        sd[k] = torch.cat([sd[k], sd[k].mean(0, keepdim=True).expand(vocab_size - old, -1)])
    bigger.load_state_dict(sd)
    return bigger


def _hf_name(name: str, neox: bool) -> str:
    """Our parameter name -> its Hugging Face name: GPT-2's is the same; GPT-NeoX's as in the Pythia checkpoints."""
    if not neox:
        return name
    if name == "lm_head.weight":
        return "embed_out.weight"
    part = name.split(".")  # transformer.wte.weight | transformer.ln_f.bias | transformer.h.3.attn.c_attn.weight
    if part[1] == "h":
        return f"gpt_neox.layers.{part[2]}.{NEOX_LAYER_NAMES['.'.join(part[3:-1])]}.{part[-1]}"
    return f"gpt_neox.{ {'wte': 'embed_in', 'ln_f': 'final_layer_norm'}[part[1]] }.{part[-1]}"


def _qkv_from_neox(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """GPT-NeoX's fused QKV rows (3C, ...) are interleaved per head [q_0 k_0 v_0 q_1 ...]; ours are [q | k | v]."""
    return t.unflatten(0, (n_head, 3, -1)).transpose(0, 1).flatten(0, 2)


def _qkv_to_neox(t: torch.Tensor, n_head: int) -> torch.Tensor:
    return t.unflatten(0, (3, n_head, -1)).transpose(0, 1).flatten(0, 2)


def _download_from_hub(name: str) -> Path:
    """The hub's files of GPT-2 `name` (config.json + model.safetensors), from the local Hugging Face cache if they
    are there, else downloaded into it. OSError saying what it fetched and the offline alternative otherwise."""
    repo, files = f"openai-community/{name}", ["config.json", "model.safetensors"]
    offline = (
        f"without network access, give a local Hugging Face directory instead: fetch it where the network is "
        f"reachable (`hf download {repo} {' '.join(files)} --local-dir {name}-hf`), copy it here and use "
        f"init_from='{name}-hf' (or --init_from {name}-hf)"
    )
    from huggingface_hub import snapshot_download  # a dependency of datasets (requirements.txt)

    try:
        return Path(snapshot_download(repo, allow_patterns=files))
    except Exception as e:  # noqa: BLE001 -- the hub's and its HTTP client's errors: no route, DNS, proxy, 404...
        raise OSError(
            f"cannot fetch {name!r} ({repo}: {' and '.join(files)}) from the Hugging Face hub and it is not "
            f"in the local cache ({first_line(e)}); {offline}"
        ) from None


def _read_hf_config(path: Path) -> dict:
    file = path / "config.json"
    if not file.is_file():
        raise FileNotFoundError(
            f"from_pretrained: {file} not found; expected a Hugging Face GPT-2 or GPT-NeoX directory"
        )
    hf = json.loads(file.read_text())
    if hf.setdefault("model_type", "gpt2") not in ("gpt2", "gpt_neox", "gpt2train"):
        raise ValueError(
            f"from_pretrained: {file}: model_type={hf['model_type']!r}, expected 'gpt2', 'gpt_neox' or 'gpt2train'"
        )
    return hf


_REQUIRED = object()


def _hf_get(hf: dict, file: Path, key: str, default=_REQUIRED, allowed=None):
    """hf[key] (default when absent, ValueError when absent without one), checked against allowed values."""
    if key not in hf and default is _REQUIRED:
        raise ValueError(f"from_pretrained: {file} has no {key!r}")
    value = hf.get(key, default)
    if allowed is not None and value not in allowed:
        raise ValueError(f"from_pretrained: {file}: {key}={value!r}, expected one of {list(allowed)}")
    return value


def _gpt2_config(hf: dict, file: Path) -> dict:
    """GPTConfig keywords of a GPT2LMHeadModel config.json."""
    n_embd = _hf_get(hf, file, "n_embd")
    _hf_get(hf, file, "n_inner", None, (None, 4 * n_embd))
    for key, want in (
        ("scale_attn_weights", True),
        ("scale_attn_by_inverse_layer_idx", False),
        ("reorder_and_upcast_attn", False),
    ):
        _hf_get(hf, file, key, want, (want,))
    return {
        "block_size": _hf_get(hf, file, "n_positions"),
        "vocab_size": _hf_get(hf, file, "vocab_size"),
        "n_layer": _hf_get(hf, file, "n_layer"),
        "n_head": _hf_get(hf, file, "n_head"),
        "n_embd": n_embd,
        "bias": True,
        "activation": HF_ACTIVATIONS[_hf_get(hf, file, "activation_function", "gelu_new", HF_ACTIVATIONS)],
        "layer_norm_eps": float(_hf_get(hf, file, "layer_norm_epsilon", 1e-5)),
        "tie_embeddings": _hf_get(hf, file, "tie_word_embeddings", True, (True, False)),
    }


def _neox_config(hf: dict, file: Path) -> dict:
    """GPTConfig keywords of a GPTNeoXForCausalLM config.json (transformers 4 or 5 spelling of the rotary keys)."""
    n_embd = _hf_get(hf, file, "hidden_size")
    _hf_get(hf, file, "intermediate_size", 4 * n_embd, (4 * n_embd,))
    _hf_get(hf, file, "attention_bias", True, (True,))
    # transformers 5 writes rope_parameters; 4.x wrote rotary_pct / rotary_emb_base (later also rope_theta,
    # partial_rotary_factor, rope_scaling). Only plain rotary (no scaling) is this model's.
    rope = {**hf, **(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    _hf_get(rope, file, "rope_type", rope.get("type", "default"), ("default",))
    pct = rope.get("partial_rotary_factor", hf.get("rotary_pct", 0.25))
    base = rope.get("rope_theta", hf.get("rotary_emb_base", 10000.0))
    return {
        "block_size": _hf_get(hf, file, "max_position_embeddings"),
        "vocab_size": _hf_get(hf, file, "vocab_size"),
        "n_layer": _hf_get(hf, file, "num_hidden_layers"),
        "n_head": _hf_get(hf, file, "num_attention_heads"),
        "n_embd": n_embd,
        "bias": True,
        "rotary_pct": float(pct),
        "rotary_base": float(base),
        "parallel_residual": _hf_get(hf, file, "use_parallel_residual", True, (True, False)),
        "tie_embeddings": _hf_get(hf, file, "tie_word_embeddings", False, (True, False)),
        "activation": HF_ACTIVATIONS[_hf_get(hf, file, "hidden_act", "gelu", HF_ACTIVATIONS)],
        "layer_norm_eps": float(_hf_get(hf, file, "layer_norm_eps", 1e-5)),
    }


def _gpt2train_config(hf: dict, file: Path) -> dict:
    """GPTConfig keywords of a gpt2train config.json (save_pretrained's remote-code export): every key under its own
    name. A key that is neither GPTConfig's nor transformers' bookkeeping is an architecture this version cannot
    build: refused, never dropped."""
    keys = set(GPT2TRAIN_KEYS) - set(TRAINING_ONLY_MODEL_KEYS)
    unknown = sorted(set(hf) - keys - HF_BOOKKEEPING_KEYS - set(TRAINING_ONLY_MODEL_KEYS))
    if unknown:
        raise ValueError(
            f"from_pretrained: {file}: unknown architecture key{'s' * (len(unknown) > 1)} {', '.join(unknown)} "
            f"(this version of gpt2-train knows {', '.join(sorted(keys))}): a newer version's export?"
        )
    return {**{k: hf[k] for k in keys if k in hf}, "tie_embeddings": hf.get("tie_word_embeddings", True)}


def _read_hf_weights(path: Path) -> dict:
    """{name: tensor} from model.safetensors or pytorch_model.bin, whole or sharded (with its .index.json)."""
    for single in ("model.safetensors", "pytorch_model.bin"):
        index = path / f"{single}.index.json"
        if (path / single).is_file():
            files = [path / single]
            break
        if index.is_file():
            files = [path / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
            break
    else:
        raise FileNotFoundError(
            f"from_pretrained: {path} has neither model.safetensors nor pytorch_model.bin "
            "(nor a sharded *.index.json of either)"
        )
    from safetensors.torch import load_file

    sd = {}
    for file in files:
        try:
            sd.update(
                load_file(str(file))
                if file.name.endswith(".safetensors")
                else torch.load(file, map_location="cpu", weights_only=True)
            )
        except OSError:
            raise
        except Exception as e:  # noqa: BLE001 -- a pickle that is not plain tensors (nothing ran), a damaged file
            raise ValueError(f"from_pretrained: {file}: not a readable weights file ({first_line(e)})") from None
    return sd
