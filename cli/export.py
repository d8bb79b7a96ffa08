"""`python -m checkpoint export PATH --format minimind|hf|peft --out OUT`: MiniMind's state dict (fp16 .pth), a
Hugging Face folder with the tokenizer, or a LoRA run's PEFT adapter (weights/export.py does the writing)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .arguments import place

HELP = ("write the weights for MiniMind (--format minimind) or Hugging Face (--format hf; a LoRA run's "
        "merged), or a LoRA run's adapters for PEFT (--format peft)")


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", type=place, help="a checkpoint folder or a run folder (its newest valid checkpoint)")
    p.add_argument("--format", required=True, choices=("minimind", "hf", "peft"))
    p.add_argument("--out", type=Path, required=True, help="the .pth file (minimind) or folder (hf, peft) to create")
    p.add_argument("--base", metavar="NAME", help="peft: the adapter_config.json's base_model_name_or_path, as PEFT should load "
                                                  "the base (a Hub name, a path); default: --with-base's folder, else the base "
                                                  "run's path relative to the adapter folder")
    p.add_argument("--with-base", action="store_true", help="peft: write the base's Hugging Face export inside the adapter "
                                                             "folder (OUT/base), named by a relative base_model_name_or_path")


def run(args: argparse.Namespace) -> int:
    from weights import export

    try:
        print(f"wrote {export(args.path, args.format, args.out, args.base, args.with_base)}")
        if args.format == "peft" and args.base is None and not args.with_base:
            print("export: base_model_name_or_path names the base run's checkpoint, which PEFT does not read; give "
                  "--with-base (its Hugging Face export inside the folder) or --base NAME (docs/lora.md)", file=sys.stderr)
    except OSError as err:
        raise OSError(err.errno, f"{err.strerror}; nothing was written", err.filename or str(args.out)) from None
    return 0
