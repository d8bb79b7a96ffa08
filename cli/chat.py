"""`python -m checkpoint chat PATH [--prompt ...]`: a fine-tuned run's reply with the tokenizer's chat template
(generate's sampling defaults), one turn or a conversation on the terminal."""
from __future__ import annotations

import argparse
import sys

from .arguments import CommandError, place, sampling, sampling_arguments

HELP = "talk to a fine-tuned run: the tokenizer's chat template, generation until <|im_end|>"


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", type=place, help="a checkpoint folder or a run folder")
    p.add_argument("--prompt", help="one user turn: print the reply and exit (default: interactive, the history kept)")
    p.add_argument("--system", help="a system turn in front of the conversation")
    p.add_argument("--tokens", type=int, default=None, help="new tokens per reply at most (default: up to model.seq_len positions)")
    sampling_arguments(p)


def chat_reply(model, tok, messages: list[dict], max_new_tokens: int | None = None, temperature: float | None = None, seed: int = 0,
               top_k: int | None = None, top_p: float | None = None, repetition_penalty: float | None = None) -> tuple[str, list[int]]:
    """The assistant's next turn after `messages`: the conversation rendered with the tokenizer's chat
    template and its generation prompt (data/chat.py), then ids generated with the KV cache until the
    tokenizer's EOS (`<|im_end|>`). Returns the reply's text (special tokens dropped) and its ids. A
    setting left None is model.generate.DEFAULTS' (generate's too)."""
    from data.chat import template_of
    from model.generate import generate_ids

    temperature, top_k, top_p, repetition_penalty = sampling(temperature, top_k, top_p, repetition_penalty)

    prompt = tok.encode_rendered(template_of(tok).render(messages, add_generation_prompt=True))
    ids = generate_ids(model, prompt, max_new_tokens, temperature, top_k, top_p, repetition_penalty, tok.eos, True, seed)
    reply = ids[len(prompt):]
    return tok.decode(reply), reply


def run(args: argparse.Namespace) -> int:
    """`chat RUN [--prompt TEXT]`: one turn, or a conversation on the terminal."""
    from weights import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(args.path)
    messages = [{"role": "system", "content": args.system}] if args.system else []

    def reply(text: str) -> str:
        messages.append({"role": "user", "content": text})
        try:
            answer, _ = chat_reply(model, tok, messages, args.tokens, args.temperature, args.seed, args.top_k, args.top_p,
                                   args.repetition_penalty)
        except ValueError as err:  # the conversation no longer fits the model's positions
            raise CommandError(f"chat: {err} (start a new conversation)") from None
        messages.append({"role": "assistant", "content": answer})
        return answer

    if args.prompt is not None:
        print(reply(args.prompt))
        return 0
    print("(an empty line or end of input ends the conversation)", file=sys.stderr)
    while True:
        try:
            text = input("you> ")
        except EOFError:
            return 0
        if not text.strip():
            return 0
        print(f"model> {reply(text)}", flush=True)
