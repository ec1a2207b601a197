"""Checkpoint files: atomic writes, finding the newest complete one, safe loading; and the model flags
(--ckpt/--init_from/--device/--dtype/--cache_dir) that sample.py and hellaswag.py share.

A checkpoint is out_dir/ckpt_{step:06d}.pt, a torch.save'd dict of tensors and plain Python
containers only, so it loads with torch.load(weights_only=True) (no pickled code runs):

    model       state_dict of the bare GPT (no 'module.' / '_orig_mod.' prefixes)
    model_args  dict of GPTConfig fields        config     dict of TrainConfig fields
    step        optimizer steps done             optimizer  AdamW state_dict
    scaler      GradScaler state_dict or None    loader     train DataLoader.state_dict()
    rng         list, one dict per rank: python / numpy / torch / cuda generator states
    val_loss    val loss measured at this step, or None
    best_step, best_val_loss   the best checkpoint so far (never pruned)
    format      'gpt2-train-ckpt-v1'

Writes go through files.atomic_write (a hidden temporary file in the same directory, fsync'ed, renamed
over the final name, the directory fsync'ed): a crash (even kill -9) at any moment leaves either the old
set of checkpoints or the new one, never a truncated ckpt_*.pt.
"""
import re
import zipfile
from pathlib import Path

import torch

import assets
from devices import DTYPES, resolve_device, resolve_dtype
from files import atomic_write

FORMAT = "gpt2-train-ckpt-v1"
CKPT_NAME = re.compile(r"^ckpt_(\d{6,})\.pt$")


class CheckpointError(Exception):
    """A missing, truncated or foreign checkpoint; the message is one line naming the file."""


def checkpoint_path(out_dir, step):
    return Path(out_dir) / f"ckpt_{step:06d}.pt"


def save_checkpoint(path, obj):
    """torch.save(obj) to `path` atomically (files.atomic_write: temporary file, fsync, rename, fsync dir)."""
    atomic_write(path, lambda f: torch.save(obj, f))


def _is_complete(path):
    """Cheap integrity check: torch.save writes a zip whose central directory comes last, so a
    truncated file has no readable directory (reading the whole file is too slow for 18 GB)."""
    try:
        with zipfile.ZipFile(path) as z:
            return any(name.endswith("data.pkl") for name in z.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


def list_checkpoints(out_dir):
    """[(step, path)] of the ckpt_XXXXXX.pt files in out_dir, oldest first (no integrity check)."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in out_dir.iterdir() if (m := CKPT_NAME.match(p.name))]
    return sorted(found)


def latest_checkpoint(out_dir):
    """Path of the newest complete checkpoint in out_dir, or None."""
    for _, path in reversed(list_checkpoints(out_dir)):
        if _is_complete(path):
            return path
    return None


def load_checkpoint(path, map_location="cpu"):
    """The checkpoint dict at `path` (a file, or a directory meaning its latest checkpoint)."""
    path = Path(path)
    if path.is_dir():
        latest = latest_checkpoint(path)
        if latest is None:
            raise CheckpointError(f"{path}: no complete ckpt_XXXXXX.pt checkpoint in this directory")
        path = latest
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    try:
        # mmap: tensors are read from the file as they are touched, and ranks on one node share the page
        # cache instead of each reading the whole checkpoint into its own memory (8 x 18 GB at 1.5B)
        ckpt = torch.load(path, map_location=map_location, weights_only=True, mmap=True)
    except Exception as e:  # truncated zip, foreign pickle, not a torch file at all...
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: not a readable checkpoint ({type(e).__name__}: {reason[:200]})") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        found = ckpt.get("format") if isinstance(ckpt, dict) else type(ckpt).__name__
        raise CheckpointError(f"{path}: not a gpt2-train checkpoint (format {found!r}, expected {FORMAT!r})")
    return ckpt


def clean_state_dict(state_dict):
    """Drop the prefixes DDP ('module.') and torch.compile ('_orig_mod.') add to parameter names."""
    out = {}
    for key, value in state_dict.items():
        for prefix in ("module.", "_orig_mod."):
            while key.startswith(prefix):
                key = key[len(prefix):]
        out[key] = value
    return out


def prune_checkpoints(out_dir, keep_last, keep_steps=()):
    """Delete all but the newest `keep_last` checkpoints (keep_last <= 0 keeps all), never those at
    `keep_steps` (the best one), plus temporary files left behind by an interrupted save."""
    out_dir = Path(out_dir)
    for tmp in out_dir.glob(".ckpt_*.tmp"):
        tmp.unlink(missing_ok=True)
    if keep_last <= 0:
        return
    found = list_checkpoints(out_dir)
    for step, path in found[:-keep_last]:
        if step not in keep_steps:
            path.unlink(missing_ok=True)


def load_model(ckpt=None, init_from=None, device="cpu"):
    """(GPT in eval mode on `device`, info dict) from a training checkpoint (file or out_dir) or
    from pretrained weights (init_from: 'gpt2', 'gpt2-medium', ... or a Hugging Face directory).
    info: source, step, val_loss, config (the training config, or None) and hf_dir: the Hugging Face
    directory the weights come from (init_from, or the run's own init_from), or None."""
    from model import GPT, GPTConfig

    if (ckpt is None) == (init_from is None):
        raise ValueError("give exactly one of ckpt (a checkpoint file or out_dir) or init_from (a pretrained name)")
    if init_from is not None:
        model = GPT.from_pretrained(init_from)
        info = {"source": str(init_from), "step": None, "val_loss": None, "config": None, "hf_dir": init_from}
    else:
        state = load_checkpoint(ckpt)
        model = GPT(GPTConfig(**state["model_args"]))
        model.load_state_dict(clean_state_dict(state["model"]))
        info = {"source": str(ckpt), "step": state["step"], "val_loss": state.get("val_loss"),
                "config": state["config"], "hf_dir": (state["config"] or {}).get("init_from")}
    if info["hf_dir"] is not None and not Path(info["hf_dir"]).is_dir():
        info["hf_dir"] = None  # 'scratch', 'resume' or a hub name: GPT-2's tokenizer
    return model.to(device).eval(), info


# ----------------------------------------------------------------------------- the scripts' model flags

DTYPE_HELP = ("autocast dtype (default auto: bfloat16 on CUDA GPUs with native bf16 and on CPUs with "
              "AVX512-BF16 or AMX, float16 on older CUDA GPUs, else float32)")


def add_model_args(parser):
    """The model flags sample.py and hellaswag.py share: --ckpt or --init_from (one is required),
    --device, --dtype, --cache_dir. load_model_from_args() turns them into a model."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--ckpt", help="training checkpoint file, or an out_dir (its latest checkpoint)")
    source.add_argument("--init_from", help="gpt2, gpt2-medium, gpt2-large, gpt2-xl, or a Hugging Face model dir "
                                            "(its tokenizer.json, if any, is the tokenizer)")
    parser.add_argument("--device", default="auto", help="auto (cuda > mps > cpu), cpu, cuda, cuda:N or mps")
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help=DTYPE_HELP)
    parser.add_argument("--cache_dir", help="cache of downloaded assets: the GPT-2 tokenizer, the HellaSwag data "
                                            "(default $GPT2_CACHE_DIR, else ~/.cache/gpt2-train)")


def load_model_from_args(parser, args):
    """(model, tokenizer, device, dtype) for the flags of add_model_args. The tokenizer is the model
    directory's tokenizer.json when there is one (assets.load_tokenizer), else GPT-2's. A bad checkpoint,
    model directory or tokenizer is one line `<prog>: error: ...` on stderr and exit status 2, never a
    traceback (as argparse does for bad flags)."""
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    source = args.ckpt or args.init_from
    try:
        model, info = load_model(ckpt=args.ckpt, init_from=args.init_from, device=device)
        enc = assets.load_tokenizer(info["hf_dir"], cache_dir=args.cache_dir)
    except (CheckpointError, OSError, ValueError, ImportError, RuntimeError) as e:
        message = " ".join(str(e).split())
        if source not in message:  # e.g. a hub download error that doesn't say what was being loaded
            message = f"{source}: {message}"
        parser.exit(2, f"{parser.prog}: error: {message}\n")
    return model, enc, device, dtype
