"""`python -m checkpoint generate PATH --prompt ...`: continue a prompt with the fp16 weights (KV cache;
temperature, top-k, top-p, repetition penalty)."""
from __future__ import annotations

import argparse

from .arguments import CommandError, place, sampling, sampling_arguments

HELP = "load the fp16 weights (verified, weights_only) and continue a prompt"


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", type=place, help="a checkpoint folder or a run folder")
    p.add_argument("--prompt", default="Return the ")
    p.add_argument("--tokens", type=int, default=None, help="new tokens at most (default: up to model.seq_len positions)")
    sampling_arguments(p)
    p.add_argument("--no-cache", action="store_true", help="recompute the whole sequence for every token (slow; for checks)")


def generate_text(model, prompt: str, max_new_tokens: int | None = None, temperature: float | None = None, seed: int = 0, tok=None,
                  top_k: int | None = None, top_p: float | None = None, repetition_penalty: float | None = None,
                  use_cache: bool = True) -> str:
    """Continue the text `prompt` with `tok` (default: bytes): BOS + prompt, then sampled ids until
    EOS or `max_new_tokens`; the decoded text, prompt included. A setting left None is
    model.generate.DEFAULTS' (chat's too)."""
    from data.tokenizer import ByteTokenizer
    from model.generate import generate_ids

    temperature, top_k, top_p, repetition_penalty = sampling(temperature, top_k, top_p, repetition_penalty)

    tok = tok or ByteTokenizer()
    ids = generate_ids(model, tok.encode(prompt, bos=True), max_new_tokens, temperature, top_k, top_p, repetition_penalty,
                       tok.eos, use_cache, seed)
    return tok.decode(ids[1:])


def run(args: argparse.Namespace) -> int:
    from weights import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(args.path)
    try:
        print(generate_text(model, args.prompt, args.tokens, args.temperature, args.seed, tok,
                            args.top_k, args.top_p, args.repetition_penalty, not args.no_cache))
    except ValueError as err:  # a request the model cannot serve (past its positions)
        raise CommandError(f"generate: {err}") from None
    return 0
