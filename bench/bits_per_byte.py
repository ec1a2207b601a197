"""Held-out loss at equal bytes (not a test): checkpoints trained with different tokenizers scored on the same
whole documents, each with its own tokenizer, in bits per byte of UTF-8 text. Run from the repository root:

    python -m bench.bits_per_byte out/shakespeare out/shakespeare_own          # the first 500 speeches

Documents: Tiny Shakespeare's speeches (prepare_data.py's shakespeare preset), the first --docs of them, which its
validation split holds whatever the tokenizer (the split takes the start of the input; the script checks each run's
data manifest and says so if not). Each document is scored alone as <|endoftext|> + its tokens + <|endoftext|>: every
token after the first is predicted (a document longer than block_size continues in windows that restart the context),
so both models predict exactly the same text and one end-of-text per document. bits/byte = total NLL (nats) / ln 2 /
UTF-8 bytes of the documents.
"""

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from bench import machine_line
from gpt2train.assets import fetch_shakespeare
from gpt2train.documents import split_speeches
from gpt2train.loading import load_model, model_tokenizer


def documents_held_out(config):
    """How many leading documents the run's validation split holds (from its data manifest), or None."""
    for manifest in sorted(Path(config["data_dir"]).glob("*_manifest.json")):
        val = [r for r in json.loads(manifest.read_text())["shards"] if r["split"] == "val"]
        if val:
            return val[0]["end"][0]
    return None


@torch.no_grad()
def score(model, enc, docs, batch_size=32):
    """(total NLL in nats, predicted tokens) of the documents, each alone (module docstring)."""
    T = model.config.block_size
    rows = []
    for doc in docs:
        ids = [enc.eot_token, *enc.encode_ordinary(doc), enc.eot_token]
        rows += [ids[i : i + T + 1] for i in range(0, len(ids) - 1, T)]  # windows of T targets, context restarts
    total, count = 0.0, 0
    rows.sort(key=len)
    for i in range(0, len(rows), batch_size):
        batch = rows[i : i + batch_size]
        width = max(map(len, batch))
        x = torch.tensor([r[:-1] + [0] * (width - len(r)) for r in batch])
        y = torch.tensor([r[1:] + [-1] * (width - len(r)) for r in batch])
        logits, _ = model(x, y)
        total += F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-1, reduction="sum").item()
        count += int((y >= 0).sum())
    return total, count


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("ckpts", nargs="+", help="checkpoint files or out_dirs")
    p.add_argument("--docs", type=int, default=500, help="score the first N speeches")
    p.add_argument("--json", action="store_true", help="one JSON line per checkpoint")
    args = p.parse_args()
    docs = split_speeches(Path(fetch_shakespeare()).read_text(encoding="utf-8"))[: args.docs]
    size = sum(len(d.encode()) for d in docs)
    if not args.json:
        print(f"machine: {machine_line('cpu')}; {len(docs)} documents, {size:,} bytes")
    for ckpt in args.ckpts:
        model, info = load_model(ckpt=ckpt)
        enc = model_tokenizer(info)
        held = documents_held_out(info["config"])
        nll, tokens = score(model, enc, docs)
        result = {
            "ckpt": ckpt,
            "step": info["step"],
            "tokenizer": getattr(enc, "id", "gpt2"),
            "n_vocab": enc.n_vocab,
            "tokens": tokens,
            "bytes": size,
            "loss_per_token": nll / tokens,
            "bits_per_byte": nll / math.log(2) / size,
            "held_out": held is None or held >= len(docs),
        }
        if args.json:
            print(json.dumps(result))
        else:
            print(
                f"{ckpt}: step {result['step']}, tokenizer {result['tokenizer']} ({enc.n_vocab:,} ids): {tokens:,} "
                f"tokens ({size / tokens:.3f} bytes/token), loss {result['loss_per_token']:.4f} nats/token = "
                f"{result['bits_per_byte']:.4f} bits/byte"
                + ("" if result["held_out"] else f" (WARNING: its val split holds only the first {held} documents)")
            )


if __name__ == "__main__":
    main()
