"""A model for the commands that use one (sample.py, hellaswag.py, evaluate.py): from a training checkpoint or
pretrained weights, with its tokenizer, and the flags that choose it (--ckpt/--init_from, --device, --dtype,
--cache_dir). The checkpoint files themselves are checkpoint.py's and sharded.py's, the Hugging Face files hf.py's."""

from pathlib import Path

from gpt2train import bpe
from gpt2train.checkpoint import CheckpointError, load_checkpoint
from gpt2train.devices import DTYPES, resolve_device, resolve_dtype
from gpt2train.files import report_error
from gpt2train.hf import from_pretrained
from gpt2train.sharded import load_sharded_checkpoint
from model import GPT, GPTConfig

DTYPE_HELP = (
    "autocast dtype (default auto: bfloat16 on CUDA GPUs with native bf16 and on CPUs with "
    "AVX512-BF16 or AMX, float16 on older CUDA GPUs, else float32)"
)


def load_model(ckpt=None, init_from=None, device="cpu"):
    """(GPT in eval mode on `device`, info dict) from a training checkpoint (file, sharded directory or
    out_dir) or from pretrained weights (init_from: 'gpt2', 'gpt2-medium', ... or a Hugging Face directory).
    info: source, step, val_loss, config (the training config, or None), tokenizer (a checkpoint's own, or None)
    and hf_dir: the Hugging Face directory the weights come from (init_from, or the run's own init_from), or
    None (model_from_checkpoint)."""
    if (ckpt is None) == (init_from is None):
        raise ValueError("give exactly one of ckpt (a checkpoint file or out_dir) or init_from (a pretrained name)")
    if ckpt is not None:
        model, info = model_from_checkpoint(ckpt)
    else:
        model = from_pretrained(init_from)
        info = {
            "source": str(init_from),
            "step": None,
            "val_loss": None,
            "config": None,
            "hf_dir": init_from if Path(init_from).is_dir() else None,  # a hub name: GPT-2's tokenizer
            "tokenizer": None,
        }
    return model.to(device).eval(), info


def model_from_checkpoint(path):
    """(GPT on the CPU, info) from the checkpoint at `path`: a file, a sharded directory (read straight into the
    model: no second copy of the weights) or an out_dir (its newest good checkpoint). info: source, step, val_loss,
    config (the training config), tokenizer (the run's bpe.tokenizer_record, or None) and hf_dir: the Hugging Face
    directory the run started from (its init_from, when that is a directory), or None."""
    state = load_checkpoint(path, consolidate=False)
    model = GPT(GPTConfig(**state["model_args"]))
    if "shards" in state:
        load_sharded_checkpoint(state["shards"], model, collective=False)
    else:
        model.load_state_dict(state["model"])
    hf_dir = (state["config"] or {}).get("init_from")
    info = {
        "source": str(path),
        "step": state["step"],
        "val_loss": state.get("val_loss"),
        "config": state["config"],
        "hf_dir": hf_dir if hf_dir is not None and Path(hf_dir).is_dir() else None,  # else GPT-2's tokenizer
        "tokenizer": state.get("tokenizer"),
    }
    return model, info


def model_tokenizer(info, cache_dir=None):
    """The tokenizer of a model load_model loaded: the checkpoint's own (its tokenizer.json text), else the model
    directory's tokenizer.json when there is one (bpe.load_tokenizer), else GPT-2's."""
    record = info.get("tokenizer")
    if record is not None and record.get("json") is not None:
        return bpe.tokenizer_from_record(record, cache_dir=cache_dir)
    return bpe.load_tokenizer(info["hf_dir"], cache_dir=cache_dir)


def add_model_args(parser):
    """The model flags sample.py, hellaswag.py and evaluate.py share: --ckpt or --init_from (one is required),
    --device, --dtype, --cache_dir. load_model_from_args() turns them into a model."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--ckpt", help="training checkpoint file, or an out_dir (its latest checkpoint)")
    source.add_argument(
        "--init_from",
        help="gpt2, gpt2-medium, gpt2-large, gpt2-xl, or a Hugging Face model dir "
        "(its tokenizer.json, if any, is the tokenizer)",
    )
    parser.add_argument("--device", default="auto", help="auto (cuda > mps > cpu), cpu, cuda, cuda:N or mps")
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help=DTYPE_HELP)
    parser.add_argument(
        "--cache_dir",
        help="cache of downloaded assets: the GPT-2 tokenizer, the HellaSwag data "
        "(default $GPT2_CACHE_DIR, else ~/.cache/gpt2-train)",
    )


def load_model_from_args(parser, args):
    """(model, tokenizer, device, dtype) for the flags of add_model_args; the tokenizer is model_tokenizer's
    (the checkpoint's, the model directory's, else GPT-2's). A bad checkpoint, model directory or tokenizer (one
    with more ids than the model's vocabulary included) is one line `<prog>: error: ...` on stderr and exit
    status 2, never a traceback (as argparse does for bad flags)."""
    source = args.ckpt or args.init_from
    try:
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
    except ValueError as e:
        parser.exit(2, f"{parser.prog}: error: --device: {e}\n")
    try:
        model, info = load_model(ckpt=args.ckpt, init_from=args.init_from, device=device)
        enc = model_tokenizer(info, cache_dir=args.cache_dir)
        if enc.n_vocab > model.config.vocab_size:  # its ids past the embedding would be an IndexError
            raise ValueError(
                f"its tokenizer has {enc.n_vocab} ids, the model's vocabulary {model.config.vocab_size}: "
                f"not the tokenizer this model was trained with"
            )
    except (CheckpointError, OSError, ValueError, ImportError, RuntimeError) as e:
        report_error(parser.prog, e, about=source)  # e.g. a hub download error that doesn't say what was loaded
        parser.exit(2)
    args.model_info = info  # load_model's: the checkpoint's training config and step, for a command that needs them
    return model, enc, device, dtype
