"""Held-out loss at equal bytes (not a test): checkpoints trained with different tokenizers scored on the same
whole documents, each with its own tokenizer, in bits per byte of UTF-8 text. Run from the repository root:

    python -m bench.bits_per_byte out/shakespeare out/shakespeare_own          # the first 500 speeches

Documents: Tiny Shakespeare's speeches (prepare_data.py's shakespeare preset), the first --docs of them, which its
validation split holds whatever the tokenizer (the split takes the start of the input; the script checks each run's
data manifest and says so if not). Scored as `evaluate.py --bpb` scores any text (scoring.bits_per_byte: each
document alone after an <|endoftext|>, in windows of at most block_size predicted tokens), so both models predict
exactly the same bytes. This is that, on the speeches, with the held-out check.
"""

import argparse
import json
from pathlib import Path

from bench import machine_line
from gpt2train.assets import fetch_shakespeare
from gpt2train.documents import split_speeches
from gpt2train.loading import load_model, model_tokenizer
from gpt2train.scoring import Forwards, bits_per_byte


def documents_held_out(config):
    """How many leading documents the run's validation split holds (from its data manifest), or None."""
    for manifest in sorted(Path(config["data_dir"]).glob("*_manifest.json")):
        val = [r for r in json.loads(manifest.read_text())["shards"] if r["split"] == "val"]
        if val:
            return val[0]["end"][0]
    return None


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("ckpts", nargs="+", help="checkpoint files or out_dirs")
    p.add_argument("--docs", type=int, default=500, help="score the first N speeches")
    p.add_argument("--json", action="store_true", help="one JSON line per checkpoint")
    args = p.parse_args()
    docs = split_speeches(Path(fetch_shakespeare()).read_text(encoding="utf-8"))[: args.docs]
    if not args.json:
        print(f"machine: {machine_line('cpu')}; {len(docs)} documents")
    for ckpt in args.ckpts:
        model, info = load_model(ckpt=ckpt)
        enc = model_tokenizer(info)
        held = documents_held_out(info["config"])
        scored = bits_per_byte(model, enc, docs, Forwards("cpu"))
        result = {
            "ckpt": ckpt,
            "step": info["step"],
            "tokenizer": getattr(enc, "id", "gpt2"),
            "n_vocab": enc.n_vocab,
            "tokens": scored["tokens"],
            "bytes": scored["bytes"],
            "loss_per_token": scored["nats"] / scored["tokens"],
            "bits_per_byte": scored["bpb"],
            "held_out": held is None or held >= len(docs),
        }
        if args.json:
            print(json.dumps(result))
        else:
            print(
                f"{ckpt}: step {result['step']}, tokenizer {result['tokenizer']} ({enc.n_vocab:,} ids): "
                f"{result['tokens']:,} tokens ({result['bytes'] / result['tokens']:.3f} bytes/token), loss "
                f"{result['loss_per_token']:.4f} nats/token = {result['bits_per_byte']:.4f} bits/byte"
                + ("" if result["held_out"] else f" (WARNING: its val split holds only the first {held} documents)")
            )


if __name__ == "__main__":
    main()
