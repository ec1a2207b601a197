"""The chat format, declared once: special tokens, the template, and conversations -> (tokens, loss mask).

A conversation is rendered as
    <|endoftext|><|user|>Hi<|end|><|assistant|>Hello!<|end|>
(<|endoftext|> first, as every document of the pretraining data; then each message as <|role|> content <|end|>).
The four chat tokens take ids 50257..50260 of GPT-2's padded vocabulary (the embedding has 50304 rows; the
tokenizer stops at 50256), so a pretrained GPT-2 needs no resizing. The loss mask covers each assistant
message's content and its <|end|> (the model learns to answer and to stop), nothing else.
prepare_data.py --format sft, train.py (via the mask shards), sample.py --chat and the export's
tokenizer_config.json (CHAT_TEMPLATE) all use this module.
"""

import json

import tiktoken

from gpt2train.assets import EOT, get_tokenizer

ROLES = ("system", "user", "assistant")
SPECIAL = {"<|system|>": 50257, "<|user|>": 50258, "<|assistant|>": 50259, "<|end|>": 50260}
END = SPECIAL["<|end|>"]
CHAT_VOCAB = END + 1  # rows a model needs for the chat tokens (a pretrained GPT-2 is padded to 50304 for SFT)

# The same rendering for transformers' apply_chat_template (the export writes it as `chat_template`).
CHAT_TEMPLATE = (
    "{{ '<|endoftext|>' }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def tokenizer(enc=None):
    """GPT-2's tiktoken encoding plus the chat tokens (encode them with allowed_special='all'; decode shows them),
    or a tokenizer.json tokenizer (bpe.HFTokenizer) that has the chat tokens as special tokens itself (as
    tokenizer.py's do): ValueError naming the ones it lacks. A chat export's tokenizer.json (GPT-2's BPE plus
    these tokens at these ids) is GPT-2's encoding, so `sample.py --chat --init_from <chat export>` works."""
    enc = enc or get_tokenizer()
    if not isinstance(enc, tiktoken.Encoding) and _is_gpt2_with_chat_tokens(enc):
        enc = get_tokenizer()
    if hasattr(enc, "special_id"):
        missing = [t for t in ("<|endoftext|>", *SPECIAL) if enc.special_id(t) is None]
        if missing:
            raise ValueError(
                f"the chat format needs the special tokens {', '.join(missing)}, which the tokenizer "
                f"{enc.name} lacks (tokenizer.py --chat_tokens reserves them)"
            )
        return enc
    if not isinstance(enc, tiktoken.Encoding) or enc.n_vocab != EOT + 1:
        raise ValueError(
            f"the chat format needs GPT-2's tokenizer (50257 ids, or a chat export's 50261), not "
            f"{getattr(enc, 'name', enc)} ({enc.n_vocab} ids)"
        )
    return tiktoken.Encoding(
        name="gpt2-chat",
        pat_str=enc._pat_str,
        mergeable_ranks=enc._mergeable_ranks,
        special_tokens={**enc._special_tokens, **SPECIAL},
    )


def special_ids(enc):
    """{text: id} of <|endoftext|> and the chat tokens in a chat tokenizer (tokenizer()): GPT-2's fixed ids, or
    the tokenizer.json's own."""
    if hasattr(enc, "special_id"):
        return {t: enc.special_id(t) for t in ("<|endoftext|>", *SPECIAL)}
    return {"<|endoftext|>": EOT, **SPECIAL}


def _is_gpt2_with_chat_tokens(enc):
    """Is `enc` (a bpe.HFTokenizer) GPT-2's tokens, byte for byte, plus SPECIAL at their ids?"""
    gpt2 = get_tokenizer()
    return (
        enc.n_vocab == CHAT_VOCAB
        and enc.eot_token == EOT
        and all(enc.encode(t, allowed_special="all") == [i] for t, i in SPECIAL.items())
        and all(enc.decode_single_token_bytes(i) == gpt2.decode_single_token_bytes(i) for i in range(EOT))
    )


def encode(enc, messages, add_generation_prompt=False):
    """(token ids, mask) of the conversation as CHAT_TEMPLATE renders it: mask[i] is 1 where token i is trained on
    (assistant content and its <|end|>). Message contents are ordinary text: a '<|user|>' typed inside one is not
    the special token."""
    ids = special_ids(enc)
    tokens, mask = [ids["<|endoftext|>"]], [0]
    for m in messages:
        content = enc.encode_ordinary(m["content"])
        trained = int(m["role"] == "assistant")
        tokens += [ids[f"<|{m['role']}|>"], *content, ids["<|end|>"]]
        mask += [0] + [trained] * (len(content) + 1)
    if add_generation_prompt:
        tokens.append(ids["<|assistant|>"])
        mask.append(0)
    return tokens, mask


def parse(row):
    """The messages of one jsonl row, {"prompt", "completion"} or {"messages": [...]}; ValueError says what is
    wrong: a missing field, a non-string or empty content, an unknown role, no final assistant message."""
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError("'messages' must be a non-empty list")
    elif "prompt" in row or "completion" in row:
        missing = [k for k in ("prompt", "completion") if k not in row]
        if missing:
            raise ValueError(f"no {missing[0]!r} field")
        messages = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["completion"]}]
    else:
        raise ValueError('expected {"prompt": ..., "completion": ...} or {"messages": [...]}')
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"message {i} needs 'role' and 'content'")
        if m["role"] not in ROLES:
            raise ValueError(f"message {i} has unknown role {m['role']!r} (expected one of {', '.join(ROLES)})")
        if not isinstance(m["content"], str):
            raise ValueError(f"message {i} content is a {type(m['content']).__name__}, not a string")
        if m["role"] == "assistant" and not m["content"]:
            raise ValueError(f"message {i}: empty assistant content (completion)")
    if messages[-1]["role"] != "assistant":
        raise ValueError(f"the conversation ends with a {messages[-1]['role']!r} message, not an 'assistant' one")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def loads(text):
    """json.loads, with JSON nested too deeply for Python's recursion limit a ValueError that says so (json raises
    RecursionError)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("the JSON is nested too deeply") from None


def read_conversations(path):
    """(line number, messages) of every non-blank line of a jsonl file; a bad line raises ValueError
    '<path>:<line>: <what is wrong>'."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, parse(loads(line))
            except ValueError as e:  # json.JSONDecodeError is a ValueError too
                raise ValueError(f"{path}:{lineno}: {e}") from None


def conversation(text):
    """A --chat prompt: a conversation file's JSON ({"messages": [...]}, a list of messages or a prompt/completion
    object without the completion) or plain text, which is one user message. The reply to it comes next."""
    try:
        data = loads(text)
    except json.JSONDecodeError:
        data = None
    if isinstance(data, dict) and "prompt" in data and "completion" not in data:
        data = [{"role": "user", "content": data["prompt"]}]
    if isinstance(data, list):
        data = {"messages": data}
    if not isinstance(data, dict):
        return [{"role": "user", "content": text.strip()}]
    messages = parse({"messages": [*data.get("messages", []), {"role": "assistant", "content": "-"}]})
    return messages[:-1]
