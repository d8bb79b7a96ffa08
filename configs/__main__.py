"""`python -m configs [--config FILE] [key=value ...] [--get KEY]`: the resolved config, as train.py
would run it (YAML), or one key's value. Exit 2 with the key named when the config is invalid.
The launch scripts use `--get out_dir` to find the run folder whose status they report. `--help` lists
every key with its default and description, grouped (the list `python train.py --help` prints)."""
from __future__ import annotations

import argparse
import sys

import yaml

from common.outcome import command

from . import ConfigError, describe, load_config, to_dict


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m configs", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="keys (key=value overrides the YAML):\n" + describe())
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--get", metavar="KEY", help="print one dotted key, e.g. out_dir or train.steps")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    tree = to_dict(load_config(args.config, args.overrides))
    if args.get:
        node = tree
        for part in args.get.split("."):
            if not isinstance(node, dict) or part not in node:
                raise ConfigError(f"--get {args.get}: no such key")
            node = node[part]
        print(node)
    else:
        print(yaml.safe_dump(tree, sort_keys=False), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    return command(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
