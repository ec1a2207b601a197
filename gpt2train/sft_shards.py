"""prepare_data.py --format sft: supervised fine-tuning data (jsonl conversations, chat.parse: {"prompt",
"completion"} or {"messages"}) rendered with the chat template (chat.py) and written in input order as token shards
plus aligned loss-mask shards (shards.write_mask) of whole conversations, and their manifest.

<name>_val_000000.bin/.mask holds the first conversations (at least val_tokens tokens), or exactly --val_input's;
<name>_train_NNNNNN.bin/.mask up to shard_tokens tokens of whole conversations each. The tokenizer is GPT-2's with the
chat tokens at 50257..50260, or a --tokenizer that has them itself (tokenizer.py --chat_tokens), recorded in the
manifest and kept beside the shards as a text prep's is. Rows are built at load time for
the run's block_size (data.DocumentRows), so the data trains at any block_size. A re-run with the same input and
settings verifies the shards and stops; anything else rewrites them all (one pass, no resume mid-way: SFT sets are
small). docs/sft.md is the guide.
"""

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gpt2train import chat
from gpt2train.bpe import open_tokenizer
from gpt2train.documents import PrepError, describe_files, expand_inputs, val_files
from gpt2train.files import file_sha256, first_line
from gpt2train.manifests import (
    fingerprint,
    keep_tokenizer,
    locked,
    remove_stale_temp_files,
    shard_is_complete,
    write_manifest,
)
from gpt2train.shards import DEFAULT_SHARD_TOKENS, MASK_SUFFIX, SHARD_SUFFIXES, as_uint16, write_mask, write_shard


@dataclass(frozen=True)
class SftPrep:
    """What prepare_sft writes, resolved from the flags once."""

    files: list  # --input's .jsonl files
    val: list  # --val_input's, whose conversations are the val shard ([]: the first val_tokens tokens' worth)
    out_dir: Path
    name: str  # the shards' name prefix
    tokenizer: str  # 'gpt2' or a tokenizer.json path (prepare_data.resolve_tokenizer)
    record: dict  # bpe.tokenizer_record of it
    shard_tokens: int
    val_tokens: int
    settings: dict  # what the manifest records: a re-run with the same fingerprint reuses the shards


def plan_sft(args, tokenizer="gpt2", record=None):
    """The SftPrep of prepare_data.py's flags (input, val_input, out_dir, name, shard_tokens, val_tokens,
    block_size) and tokenizer (prepare_data.resolve_tokenizer's); PrepError for a tokenizer without the chat tokens,
    files that are not .jsonl or flags out of range."""
    try:
        chat.tokenizer(open_tokenizer(tokenizer))
    except ValueError as e:
        raise PrepError(f"--tokenizer: {e}") from None
    files = expand_inputs(args.input)
    val = val_files(args.val_input, [[str(p.resolve())] for p in files]) if args.val_input else []
    if any(f.suffix != ".jsonl" for f in files + val):
        raise PrepError(f"{next(f for f in files + val if f.suffix != '.jsonl')}: --format sft reads .jsonl files")
    if val and args.val_tokens is not None:
        raise PrepError("give --val_input or --val_tokens, not both: the validation split is --val_input's")
    shard_tokens = args.shard_tokens or DEFAULT_SHARD_TOKENS
    val_tokens = 1024 if args.val_tokens is None else args.val_tokens  # default: about a row of GPT-2's block_size
    if min(val_tokens, shard_tokens, args.block_size or 1) < 1:
        raise PrepError(
            f"--val_tokens, --shard_tokens and --block_size must be >= 1, got "
            f"{val_tokens}, {shard_tokens}, {args.block_size}"
        )
    name = args.name or (files[0].stem if len(files) == 1 else "sft")
    name = re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_") or "sft"
    settings = {
        "format": "llm.c uint16 shards v1 + uint8 loss masks, whole conversations (rows at load time)",
        "tokenizer": "gpt2+chat" if tokenizer == "gpt2" else record["id"],
        "template": chat.CHAT_TEMPLATE,
        "shard_tokens": shard_tokens,
        "val_tokens": val_tokens,
        "input": describe_files(files, None)["files"],
    }
    if val:  # recorded only then: the settings (fingerprint) of a run without it are unchanged
        settings.update(val_tokens="--val_input", val_input=describe_files(val, None)["files"])
    out_dir = Path(args.out_dir or Path("data") / name)
    return SftPrep(files, val, out_dir, name, tokenizer, record, shard_tokens, val_tokens, settings)


def prepare_sft(args, tokenizer="gpt2", record=None):
    """Write (or verify and reuse) the SFT shards of prepare_data.py's flags and tokenizer (plan_sft); returns a
    summary dict, with the conversations a run at --block_size would leave out (rows of block_size + 1 tokens)."""
    job = plan_sft(args, tokenizer, record)
    manifest_path = job.out_dir / f"{job.name}_manifest.json"
    with locked(job.out_dir):
        remove_stale_temp_files(job.out_dir, job.name)
        old = json.loads(manifest_path.read_text()) if manifest_path.exists() else None
        t0 = time.time()
        reused = is_reusable(job, old)
        manifest = old if reused else write_sft_shards(job, old)
        summary = dict(manifest["summary"])
        longest = summary.pop("longest")  # [where, tokens] of the longest conversations, longest first
        block_size = args.block_size
        too_long = [f"{where} ({n} tokens)" for where, n in longest if block_size and n > block_size + 1]
        return {
            **summary,
            "too_long": len(too_long),
            "too_long_lines": too_long[:10],
            "too_long_at_least": len(too_long) == len(longest) < summary["conversations"],
            "longest": longest[0][1],
            "block_size": block_size,
            "out_dir": str(job.out_dir),
            "name": job.name,
            "seconds": time.time() - t0,
            "reused": reused,
        }


def is_reusable(job, old):
    """Whether the manifest found (old, or None) is a finished run of this job whose shards and masks verify."""
    return bool(
        old
        and old.get("fingerprint") == fingerprint(job.settings)
        and old.get("complete")
        and all(
            shard_is_complete(job.out_dir, r) and file_sha256(job.out_dir / r["mask"]) == r["mask_sha256"]
            for r in old["shards"]
        )
    )


def write_sft_shards(job, old):
    """The shards of `job`, then its complete manifest (returned), in place of any earlier run's shards (`old`: its
    manifest, or None); PrepError where out_dir holds token files of another run or tool."""
    ours = re.compile(rf"{re.escape(job.name)}_(train|val)_\d{{6}}\.(bin|mask)")
    found = list(job.out_dir.iterdir())
    others = sorted(p.name for p in found if p.suffix in SHARD_SUFFIXES and not ours.fullmatch(p.name))
    if others or (old is None and any(ours.fullmatch(p.name) for p in found)):
        raise PrepError(
            f"{job.out_dir} holds token files ({(others or ['<name> shards without a manifest'])[0]}, ...) "
            f"from another run or tool; use another --out_dir or --name, or delete them"
        )
    for stale in (p for p in found if ours.fullmatch(p.name)):
        stale.unlink()  # ours from other settings or an interrupted run: rewritten below
    conversations, lengths, n_val = encode_conversations(job)
    parts, part, size = [("val", conversations[:n_val])], [], 0
    for c in conversations[n_val:]:
        if part and size + len(c[0]) > job.shard_tokens:
            parts.append(("train", part))
            part, size = [], 0
        part.append(c)
        size += len(c[0])
    parts.append(("train", part))
    records = [
        write_sft_shard(job.out_dir / f"{job.name}_{split}_{max(0, i - 1):06d}.bin", split, part)
        for i, (split, part) in enumerate(parts)
    ]
    summary = {
        "conversations": len(conversations),
        "val_conversations": n_val,
        "tokens": sum(r["tokens"] for r in records),
        "trained_tokens": sum(r["trained_tokens"] for r in records),
        "shards": len(records),
        "longest": sorted(lengths, key=lambda c: -c[1])[:1000],
    }
    manifest = {
        "fingerprint": fingerprint(job.settings),
        "settings": job.settings,
        "complete": True,
        "shards": records,
        "summary": summary,
    }
    if job.tokenizer != "gpt2":  # GPT-2's chat ids lie past its 50257: its data records none, as before
        manifest["tokenizer"] = keep_tokenizer(job.out_dir, job.name, job.record)
    write_manifest(job.out_dir / f"{job.name}_manifest.json", manifest)
    return manifest


def encode_conversations(job):
    """(conversations as chat.encode's (tokens, mask), [(file:line, tokens)] of each, how many go to val): --val_input's
    first, then --input's. PrepError naming file:line for a bad line, or where val or train would be empty."""
    enc, conversations, lengths, given = chat.tokenizer(open_tokenizer(job.tokenizer)), [], [], 0
    for i, path in enumerate([*job.val, *job.files]):
        given = len(conversations) if i == len(job.val) else given  # --val_input's conversations (val: its files)
        try:
            for lineno, messages in chat.read_conversations(path):
                conversations.append(chat.encode(enc, messages))
                lengths.append((f"{path}:{lineno}", len(conversations[-1][0])))
        except (ValueError, OSError) as e:
            raise PrepError(str(e) if isinstance(e, ValueError) else f"{path}: cannot read ({first_line(e)})") from None
    if len(conversations) < 2:
        raise PrepError(f"{len(conversations)} conversation(s) in the input: need 2 or more (one for validation)")
    ends = np.cumsum([n for _, n in lengths])
    n_val = min(int(np.searchsorted(ends, job.val_tokens)) + 1, len(conversations) - 1)  # whole conversations
    if job.val and not 0 < (n_val := given) < len(conversations):
        raise PrepError(
            f"--val_input holds {given} of the {len(conversations)} conversations: val and train need 1 or more"
        )
    return conversations, lengths, n_val


def write_sft_shard(path, split, conversations):
    """One shard of whole (tokens, mask) conversations, back to back, and its loss-mask file; returns its manifest
    record."""
    tokens = as_uint16(np.array([t for c, _ in conversations for t in c], dtype=np.int64), path)
    mask = np.array([m for _, k in conversations for m in k], dtype=np.uint8)
    write_shard(path, tokens)
    write_mask(path.with_suffix(MASK_SUFFIX), mask)
    return {
        "file": path.name,
        "split": split,
        "tokens": len(tokens),
        "conversations": len(conversations),
        "max_token": int(tokens.max()),
        "sha256": file_sha256(path),
        "mask": path.with_suffix(MASK_SUFFIX).name,
        "trained_tokens": int(mask.sum()),
        "mask_sha256": file_sha256(path.with_suffix(MASK_SUFFIX)),
    }
