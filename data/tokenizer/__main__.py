"""`python -m data.tokenizer train --vocab-size N --out DIR CORPUS.jsonl [CORPUS.jsonl ...]`: train a
byte-level BPE (MiniMind's recipe and special tokens) on the "text" of MiniMind-format JSONL files and
write DIR/tokenizer.json and DIR/tokenizer_config.json; then `data.tokenizer=DIR/tokenizer.json`.
The same corpora and arguments give the same files, byte for byte. CORPUS may be 'stdlib' (the
built-in corpus). Exit 2 on bad input (a file and line named), 1 when the output cannot be written.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from common.outcome import command

from . import CONFIG_FILE, TOKENIZER_FILE, TokenizerError, train_bpe
from ..prepare import BUILTIN, resolve_source


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m data.tokenizer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="verb", required=True)
    t = sub.add_parser("train", help="train a byte-level BPE on JSONL corpora")
    t.add_argument("corpora", nargs="+", help=f"MiniMind pretrain JSONL files, or '{BUILTIN}'")
    t.add_argument("--vocab-size", type=int, required=True, help="ids in the tokenizer, special tokens included (MiniMind: 6400)")
    t.add_argument("--out", type=Path, required=True, help="folder to write tokenizer.json and tokenizer_config.json to")
    t.add_argument("--min-frequency", type=int, default=2, help="a merge must occur at least this often (default %(default)s)")
    t.add_argument("--cache-dir", type=Path, default=Path("data/cache"), help=f"where '{BUILTIN}' is built (default %(default)s)")
    t.add_argument("--force", action="store_true", help="replace the tokenizer files already in --out")
    args = parser.parse_args(argv)
    existing = [args.out / name for name in (TOKENIZER_FILE, CONFIG_FILE) if (args.out / name).exists()]
    if existing and not args.force:
        raise TokenizerError(f"--out {args.out} already holds {', '.join(p.name for p in existing)}: a run that uses it would see "
                             f"another tokenizer; choose another folder, or --force to replace them (nothing was written)")
    sources = [resolve_source(c, args.cache_dir) for c in args.corpora]
    t0 = time.time()
    path = train_bpe(sources, args.vocab_size, args.out, args.min_frequency)
    print(f"wrote {path} ({args.vocab_size} ids) in {time.time() - t0:.1f}s; use it with data.tokenizer={path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return command(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
