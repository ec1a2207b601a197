"""chat.py: the chat format, declared once: the template as transformers renders it, and a conversation's tokens."""

from gpt2train import chat

ROWS = [
    {"prompt": "What is 2+2?", "completion": " 4"},
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi, naïve café 😀"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": ""},
            {"role": "assistant", "content": "Bye <|user|> now."},
        ]
    },
    {"prompt": "", "completion": "empty prompt, fine"},
    {"prompt": "Count", "completion": " one two three"},
] + [{"prompt": f"Reverse {i} {i + 1}", "completion": f" {i + 1} {i}"} for i in range(40)]


def render(messages, add_generation_prompt=False):
    """The text of a conversation, exactly as CHAT_TEMPLATE renders it (the oracle the template is checked against)."""
    text = "<|endoftext|>" + "".join(f"<|{m['role']}|>{m['content']}<|end|>" for m in messages)
    return text + ("<|assistant|>" if add_generation_prompt else "")


def test_template_renders_as_transformers_apply_chat_template():
    from transformers.utils.chat_template_utils import render_jinja_template

    enc = chat.tokenizer()
    for row in ROWS[:3]:
        messages = chat.parse(row)
        for gen in (False, True):
            text = render_jinja_template([messages], chat_template=chat.CHAT_TEMPLATE, add_generation_prompt=gen)[0][0]
            assert text == render(messages, add_generation_prompt=gen)
            assert enc.decode(chat.encode(enc, messages, gen)[0]) == text
    plain = chat.parse(ROWS[0])  # contents without special-token text tokenize alike either way
    assert enc.encode(render(plain), allowed_special="all") == chat.encode(enc, plain)[0]


def test_json_nested_too_deeply_is_a_one_line_error_not_a_recursion_error(tmp_path):
    """json raises RecursionError, which the ValueError handlers of sample.py --chat and prepare_data.py let through."""
    import pytest

    import prepare_data

    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(ValueError, match="^the JSON is nested too deeply$"):
        chat.conversation(deep)
    (tmp_path / "deep.jsonl").write_text('{"prompt": "a", "completion": "b"}\n' + deep + "\n")
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'deep.jsonl'}:2: the JSON is nested too deeply$"):
        list(chat.read_conversations(tmp_path / "deep.jsonl"))
    with pytest.raises(SystemExit) as e:
        prepare_data.main(
            ["--format", "sft", "--input", str(tmp_path / "deep.jsonl"), "--out_dir", str(tmp_path / "d")]
        )
    assert str(e.value.code) == f"prepare_data.py: error: {tmp_path / 'deep.jsonl'}:2: the JSON is nested too deeply"
    assert chat.conversation("[not json") == [{"role": "user", "content": "[not json"}]  # plain text, as before
