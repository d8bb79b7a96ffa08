"""The combinations matrix (docs/tests.md "The matrix"): a pairwise (all-pairs) set of cases over
every dimension a user combines, generated from a seed, each case named by its values.

    python tests/matrix.py [--seed N] [--list | --markdown]

A dimension is a key of DIMENSIONS with its values; a value's overrides come from `overrides()`. The
objective dimension and its refusal cases are the objective registry's (objectives/spec.py: each
objective's `matrix` values, and a refusal case per objective that does not support dist.strategy=fsdp).
Every full combination is classified by `verdict()`: "run" (it must be exact: the halted and
resumed run equals the uninterrupted one), a refusal (it must exit 2 naming the keys), or "n/a"
(the combination names nothing a user could run, e.g. a PEFT adapter folder as the start of a
full fine-tune). The generator then picks, greedily and seeded, "run" cases until every pair of
values that some "run" combination holds is covered, and adds one case per refusal rule. A new
key or value joins DIMENSIONS (and `overrides`/`verdict`), never a hand-written test.
"""
from __future__ import annotations

import argparse
import itertools
import random
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python tests/matrix.py`: the repository's rooms

from objectives import specs  # noqa: E402

VALUES = {value.name: (spec, value) for spec in specs() for value in spec.matrix}
"""The objective dimension's values: each objective's matrix values, with the objective."""

DIMENSIONS: dict[str, tuple[str, ...]] = {
    "objective": tuple(VALUES),
    "source": ("seeded", "run", "hf", "pth", "peft"),
    "model": ("minimind2", "minimind3", "moe"),
    "strategy": ("ddp", "fsdp"),
    "compile": ("eager", "compiled"),
    "checkpointing": ("none", "full"),
    "save": ("sync", "async"),
    "resume": ("same", "2to3", "switch"),
    "storage": ("local", "s3"),
}
SEED = 0
COST = {"eager": 0, "compiled": 1}
"""What the generator minimizes among equally covering cases: compiles (minutes each on two cores)."""

# Refusal rules: (name, predicate, the keys the refusal must name): each objective without dist.strategy=fsdp
# among its supported features, under fsdp (or switching to it).
REFUSALS = tuple(
    (f"{spec.name}-under-fsdp",
     lambda c, spec=spec: VALUES[c["objective"]][0].objective == spec.objective and (c["strategy"] == "fsdp" or c["resume"] == "switch"),
     (f"train.objective={spec.objective}", "dist.strategy=fsdp"))
    for spec in specs() if spec.matrix and "fsdp" not in spec.supports and spec.name == spec.objective)


def verdict(case: dict) -> tuple[str, tuple[str, ...]]:
    """("run", ()) | ("refused:<rule>", keys) | ("n/a", ())."""
    if case["source"] == "peft" and case["objective"] != "lora":
        return "n/a", ()  # a PEFT folder holds adapters: only train.lora.init_from takes one
    for name, applies, keys in REFUSALS:
        if applies(case):
            return f"refused:{name}", keys
    return "run", ()


@dataclass(frozen=True)
class Case:
    values: tuple[tuple[str, str], ...]
    verdict: str
    keys: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return "-".join(v for _, v in self.values)

    def __getitem__(self, key: str) -> str:
        return dict(self.values)[key]


def _pairs(case: dict) -> set[tuple[str, str, str, str]]:
    items = sorted(case.items())
    return {(a, va, b, vb) for (a, va), (b, vb) in itertools.combinations(items, 2)}


def cases(seed: int = SEED) -> list[Case]:
    """The seeded pairwise cases, then one case per refusal rule; the same list for the same seed."""
    rnd = random.Random(seed)
    names = list(DIMENSIONS)
    every = [dict(zip(names, values)) for values in itertools.product(*DIMENSIONS.values())]
    runnable = [c for c in every if verdict(c)[0] == "run"]
    uncovered = set().union(*(_pairs(c) for c in runnable))
    chosen: list[dict] = []
    while uncovered:
        rnd.shuffle(runnable)
        # The most covering; among those the cheapest (a compiled case costs a compile in every process), then the seed's order.
        best = max(runnable, key=lambda c: (len(_pairs(c) & uncovered), -COST[c["compile"]]))
        chosen.append(best)
        uncovered -= _pairs(best)
    out = [Case(tuple(c.items()), "run") for c in chosen]
    rest = [c for c in every if verdict(c)[0].startswith("refused:")]
    rnd.shuffle(rest)
    for name, _, _ in REFUSALS:
        c = next(c for c in rest if verdict(c)[0] == f"refused:{name}")
        out.append(Case(tuple(c.items()), *verdict(c)))
    return out


# ---------------------------------------------------------------- what a case runs

MODELS = {
    "minimind2": [],
    "minimind3": ["model.qk_norm=true", "model.head_dim=16", "model.norm_eps=1e-6"],
    "moe": ["model.qk_norm=true", "model.norm_eps=1e-6", "model.moe.experts=4", "model.moe.top_k=2"],
}
COMMON = ["model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.seq_len=96",
          "train.steps=4", "train.warmup_steps=1", "train.lr=3e-3", "checkpoint.interval=1", "checkpoint.keep=10",
          "log.progress=false", "runtime.threads=1"]
HALT = 2


def geometry(case: Case) -> list[tuple[int, str]]:
    """(world size, strategy) of the halted launch and of the resumed one."""
    s = case["strategy"]
    other = "fsdp" if s == "ddp" else "ddp"
    return {"same": [(1, s), (1, s)], "2to3": [(2, s), (3, s)], "switch": [(2, s), (2, other)]}[case["resume"]]


def overrides(case: Case, data: dict[str, list[str]], sources: dict[str, str]) -> list[str]:
    """The case's config overrides, but the strategy (from `geometry`). `data`: the overrides of each
    objective's corpus; `sources`: "run", "hf", "pth", "peft" -> the path of that source for this model."""
    _, value = VALUES[case["objective"]]
    out = [*COMMON, *MODELS[case["model"]], *data[value.data]]
    if case["resume"] != "same":
        out.append("dist.reduce=canonical")  # another world size or strategy: the bits of one process (docs/design.md)
    out += value.overrides
    src = case["source"]
    if src == "peft":
        out += [f"model.init_from={sources['run']}", f"train.lora.init_from={sources['peft']}"]
    elif src != "seeded":
        out.append(f"model.init_from={sources[src]}")
    if case["compile"] == "compiled":
        out.append("train.compile=true")
    out.append(f"train.activation_checkpointing={case['checkpointing']}")
    if case["save"] == "async":
        out.append("checkpoint.async=true")
    return out


def _markdown(cs: list[Case]) -> str:
    head = "| case | " + " | ".join(DIMENSIONS) + " | expected |\n|---|" + "---|" * len(DIMENSIONS) + "---|\n"
    return head + "".join(f"| {i} | " + " | ".join(c[d] for d in DIMENSIONS) + f" | {c.verdict}{' ' + ', '.join(c.keys) if c.keys else ''} |\n"
                          for i, c in enumerate(cs))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--markdown", action="store_true", help="the cases as a markdown table")
    args = p.parse_args(argv)
    cs = cases(args.seed)
    print(_markdown(cs) if args.markdown else "\n".join(f"{c.name}  {c.verdict}" for c in cs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
