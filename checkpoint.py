"""Convert checkpoints: a sharded checkpoint directory into one file, or any checkpoint into a Hugging Face directory
that transformers and the lm-evaluation-harness load: a GPT-2 or GPT-NeoX one where the model is one of those (llama.cpp
converts these too), else one with its own modeling code (trust_remote_code=True; docs/export.md).

    python checkpoint.py consolidate out/run/ckpt_000100 out/run/ckpt_000100.pt
    python checkpoint.py export out/run hf_out            # an out_dir means its newest good checkpoint
    python checkpoint.py export out/chat hf_chat --chat   # a chat model: its chat tokens and template too

The checkpoint format itself is gpt2train/checkpoint.py's (a sharded run's DCP save and load: sharded.py's).
"""

import argparse
from pathlib import Path

from gpt2train.chat import CHAT_TEMPLATE
from gpt2train.checkpoint import CheckpointError, consolidate
from gpt2train.files import report_error
from gpt2train.hf import save_pretrained
from gpt2train.loading import model_from_checkpoint


def arg_parser():
    """checkpoint.py's flags: the consolidate and export subcommands."""
    parser = argparse.ArgumentParser(prog="checkpoint.py", description="Convert gpt2-train checkpoints.")
    commands = parser.add_subparsers(dest="command", required=True)
    c = commands.add_parser("consolidate", help="sharded checkpoint directory -> single-file checkpoint")
    c.add_argument("src", help="a sharded checkpoint, e.g. out/run/ckpt_000100")
    c.add_argument("dst", help="the file to write, e.g. out/run/ckpt_000100.pt")
    e = commands.add_parser(
        "export", help="checkpoint (file, sharded directory or out_dir) -> Hugging Face directory (docs/export.md)"
    )
    e.add_argument("src")
    e.add_argument("dst", help="directory for config.json, model.safetensors and the tokenizer files")
    e.add_argument(
        "--chat",
        action="store_true",
        help="a chat model (fine-tuned with prepare_data.py --format sft): "
        "export the chat tokens and the chat template (docs/sft.md)",
    )
    e.add_argument("--force", action="store_true", help="write into DST even if it is a directory that is not empty")
    return parser


def main(argv=None):
    """python checkpoint.py consolidate SRC DST | export SRC HF_DIR"""
    args = arg_parser().parse_args(argv)
    try:
        if args.command == "consolidate":
            step = consolidate(args.src, args.dst)
        else:
            dst = Path(args.dst)
            if dst.exists() and (not dst.is_dir() or any(dst.iterdir())) and not args.force:
                raise ValueError(
                    f"{dst} exists and is not an empty directory: give another DST, or --force to write into it"
                )
            model, info = model_from_checkpoint(args.src)
            save_pretrained(
                model,
                args.dst,
                tokenizer_dir=info["hf_dir"],
                tokenizer_json=(info["tokenizer"] or {}).get("json"),
                chat_template=CHAT_TEMPLATE if args.chat else None,
            )
            step = info["step"]
    except (CheckpointError, OSError, ValueError, ImportError, RuntimeError) as err:
        report_error("checkpoint.py", err)
        return 2
    print(f"wrote {args.dst}: step {step} of {args.src}")  # an out_dir means its newest good checkpoint: which one
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
