"""Text from a trained checkpoint or a pretrained GPT-2, streamed to stdout as it is generated.

    python sample.py --ckpt out/                      # latest checkpoint of a training run
    python sample.py --init_from gpt2 --prompt "Hello, I'm a language model,"
    python sample.py --ckpt out/ckpt_000500.pt --prompt FILE:prompt.txt --temperature 0
    echo "Once upon a time" | python sample.py --ckpt out/ --num_samples 3 --seed 7
    python sample.py --ckpt out/sft --chat                        # chat with a fine-tuned model (docs/sft.md)
    python sample.py --ckpt out/sft --chat --prompt FILE:conversation.json --temperature 0

Without --prompt, the prompt is read from stdin when stdin is not a terminal; an empty prompt
starts from <|endoftext|>, i.e. the beginning of a new document. The same --seed gives the same text.
A sample runs on for --max_new_tokens, past an <|endoftext|> the model writes (as nanoGPT's does: the next
document follows); --stop_at_eot ends it there, as transformers' generate() does at the eos token.
--chat renders the prompt with the chat template (chat.py): a conversation ({"messages": [...]} or a list of
messages, e.g. from a file) or plain text (one user message), and streams the assistant's reply up to its
<|end|>; with no prompt on a terminal it is an interactive chat.
A Hugging Face model directory with a tokenizer.json (e.g. an imported Pythia) is sampled with that
tokenizer (needs the `tokenizers` package); everything else with GPT-2's.
"""

import argparse
import codecs
import math
import sys

import torch

from gpt2train import chat
from gpt2train.devices import autocast
from gpt2train.generation import LogitsNotFinite, Sampling, generate_stream
from gpt2train.loading import add_model_args, load_model_from_args

SEPARATOR = "-" * 40
REPLACEMENT = "\ufffd".encode()  # printed for ids the tokenizer lacks (the padded vocab 50257..50303)


def read_prompt(prompt_arg, stdin=None):
    """Prompt text from --prompt TEXT, --prompt FILE:path, or stdin when it is not a terminal ('' if none)."""
    if prompt_arg is not None:
        if prompt_arg.startswith("FILE:"):
            with open(prompt_arg[len("FILE:") :], encoding="utf-8") as f:
                return f.read()
        return prompt_arg
    stdin = sys.stdin if stdin is None else stdin
    if stdin is not None and not stdin.isatty():
        return stdin.read()
    return ""


def token_bytes(enc, token):
    """The bytes of one token id; multi-byte UTF-8 characters may be split across tokens."""
    try:
        return enc.decode_single_token_bytes(token)
    except KeyError:
        return REPLACEMENT


@torch.no_grad()
def stream_samples(model, enc, prompt, sampling, generator, max_new_tokens=200, out=None):
    """Generate one continuation of `prompt`, writing it to `out` (stdout) token by token; returns it.

    prompt: text, written first and returned in front of the continuation, which ends before sampling.eos_token
    (--stop_at_eot; else it runs on past <|endoftext|>). Or a conversation (--chat, a list of messages; enc:
    chat.tokenizer()): its rendering with the assistant's turn opened is the model's prompt, and only the reply is
    written and returned, ending before <|end|> (or <|endoftext|>). The sample is drawn with `generator`, on its
    device; the caller sets the autocast.
    """
    out = sys.stdout if out is None else out
    if isinstance(prompt, list):
        tokens, prompt = chat.encode(enc, prompt, add_generation_prompt=True)[0], ""
        stop = (chat.special_ids(enc)["<|end|>"], enc.eot_token)
    else:
        tokens = enc.encode(prompt, allowed_special={"<|endoftext|>"}) or [enc.eot_token]
        stop = (sampling.eos_token,)  # None: no stop
    idx = torch.tensor([tokens], dtype=torch.long, device=generator.device)  # (1, T)
    # tokens may end mid-character: an incremental decoder holds partial UTF-8 sequences back
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pieces = [prompt]
    out.write(prompt)
    out.flush()
    for new in generate_stream(model.eval(), idx, max_new_tokens, sampling, generator):  # new: (1,)
        if int(new[0]) in stop:
            break
        pieces.append(decoder.decode(token_bytes(enc, int(new[0]))))
        out.write(pieces[-1])
        out.flush()
    pieces.append(decoder.decode(b"", final=True))
    out.write(pieces[-1])
    out.flush()
    return "".join(pieces)


def arg_parser():
    """sample.py's flags: the model flags (add_model_args) and the sampling ones."""
    parser = argparse.ArgumentParser(description="Sample text from a checkpoint or a pretrained GPT-2.")
    add_model_args(parser)
    parser.add_argument("--prompt", help="prompt text, or FILE:path to read it from a file (default: stdin if piped)")
    parser.add_argument(
        "--num_samples",
        type=int,
        default=1,
        help="continuations of the prompt, one after another (default %(default)s)",
    )
    parser.add_argument(
        "--max_new_tokens", type=int, default=200, help="tokens to generate per sample, at most (default %(default)s)"
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.8,
        help="sampling temperature; 0 is greedy, the argmax (default %(default)s)",
    )
    parser.add_argument("--top_k", type=int, default=None, help="sample only among the k most likely tokens")
    parser.add_argument("--top_p", type=float, default=None, help="nucleus sampling: smallest set with this much mass")
    parser.add_argument(
        "--seed",
        type=int,
        default=1337,
        help="random seed: the same seed, prompt and model give the same text (default %(default)s)",
    )
    parser.add_argument(
        "--stop_at_eot",
        action="store_true",
        help="end a sample at <|endoftext|> (as transformers' "
        "generate does at eos); by default it runs on into the next document for --max_new_tokens",
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="reply as the assistant of a fine-tuned chat model: the "
        "prompt is a conversation (JSON) or one user message; none on a terminal: chat interactively",
    )
    return parser


def main(argv=None):
    parser = arg_parser()
    args = parser.parse_args(argv)
    if args.num_samples < 1 or args.max_new_tokens < 0:
        parser.error("--num_samples must be >= 1 and --max_new_tokens >= 0")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        parser.error(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if args.top_k is not None and args.top_k < 1:
        parser.error(f"--top_k must be >= 1, got {args.top_k}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        parser.error(f"--top_p must be in (0, 1], got {args.top_p}")

    model, enc, device, dtype = load_model_from_args(parser, args)  # fails fast, before reading stdin
    nonfinite = next((name for name, p in model.named_parameters() if not torch.isfinite(p).all()), None)
    if nonfinite is not None:  # its logits would be too, and torch.multinomial a traceback
        parser.exit(2, f"{parser.prog}: error: the model's weights are not finite ({nonfinite} holds NaN or inf)\n")
    try:
        prompt = read_prompt(args.prompt)
    except (OSError, UnicodeDecodeError) as e:
        parser.exit(2, f"{parser.prog}: error: prompt: {' '.join(str(e).split())}\n")
    if args.chat:
        try:
            enc = chat.tokenizer(enc)
            messages = chat.conversation(prompt) if prompt else None
        except ValueError as e:
            parser.exit(2, f"{parser.prog}: error: --chat: {e}\n")
    elif not prompt and enc.eot_token is None:
        parser.exit(
            2, f"{parser.prog}: error: an empty prompt starts at <|endoftext|>, which {enc.name} lacks; give --prompt\n"
        )
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace")  # a terminal that can't show a character gets '?', not a crash
    eos = enc.eot_token if args.stop_at_eot else None
    sampling = Sampling(args.temperature, args.top_k, args.top_p, eos, n_vocab=enc.n_vocab)
    seeded = lambda: torch.Generator(device=device).manual_seed(args.seed)  # one seed fixes the whole output
    try:
        with autocast(device, dtype):
            if args.chat and messages is None:  # interactive: each reply joins the conversation
                messages = []
                while True:
                    try:
                        messages.append({"role": "user", "content": input("user> ")})
                    except EOFError:
                        return 0
                    print("assistant> ", end="", flush=True)
                    reply = stream_samples(model, enc, messages, sampling, seeded(), args.max_new_tokens)
                    messages.append({"role": "assistant", "content": reply})
                    print()
            generator = seeded()  # drives the samples one after another
            for _ in range(args.num_samples):
                stream_samples(model, enc, messages if args.chat else prompt, sampling, generator, args.max_new_tokens)
                print("\n" + SEPARATOR, flush=True)
    except LogitsNotFinite as e:  # finite weights whose forward overflows (non-finite ones are refused above)
        print(flush=True)  # ends the prompt's line
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    except KeyboardInterrupt:  # Ctrl-C while streaming: stop quietly
        print(file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
