"""What an objective is made of, as one registered record: the loop, `make_objective`, the config checks,
`python -m configs --help`, the matrix and docs/design.md's combinations table read the registry, so an
objective is one module that calls `register(ObjectiveSpec(...))` and nothing else names it.

    name        its name in the registry; `objective` train.objective's value (default: the name; GRPO's agent
                variant is train.objective=grpo over data.format=agent); `summary` its line in --help, `docs` its page
    formats     the data.format values it reads
    sections    the config dataclasses it adds under train.<section> (train.dpo, train.grpo, ...)
    reads       per train.<section>, the keys it honours (ALL: every key); by_format adds a format's own
                (GRPO reads train.agent under data.format=agent). A key of a registered section it does not
                read, set away from its default, is refused naming it: a run does what its config says.
    build       the factory: a Context (the config, dataset, model, ...) -> the object the loop calls (Objective)
    classes     the classes `build` may return (the protocol test checks each)
    plan        (config) -> (global batch, micro-batch, steps a batch serves) in dataset samples; None: the
                configured batch in samples, one step each
    supports    the features it works with (FEATURES: mix, repack, eval, fsdp, lora, ft); another one set is refused,
                with `why` (feature -> the reason) when the objective has one of its own
    refusals    the other combinations it refuses, as rows: (the keys and values, why, the way on)
    check       its own checks of the train.* tree beyond one key's range (a teacher given, batch multiples)
    pins        what it adds to a checkpoint: states and pinned identities (reference, teacher, critic, reward)
    headline    the figures a person watches, as (label, logged key)
    matrix      its values of the matrix's objective dimension: (value, the matrix corpus it trains on,
                its overrides)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, runtime_checkable

ALL = ("*",)
"""`reads` for a section whose every key the objective honours."""
SET = object()
"""In a refusal's `when`: the key set away from its default (a non-empty list, a non-zero rank)."""


@runtime_checkable
class Objective(Protocol):
    """What the loop (train.py) calls on an objective, in this order: `start` once after the resume's load;
    per step `begin_step`, `prepare` (before any forward: a rollout; "stopped" when a signal abandoned it),
    `loss` per micro-batch, `step_metrics` (after the backward passes: may be a collective), then
    `skip_update` read (True: this step steps no optimizer); `states` whenever a checkpoint is taken."""

    skip_update: bool

    def start(self, cfg, rt, meta, resumed, agree, tok_files: dict[str, bytes]) -> None: ...

    def begin_step(self, indices: list[int], step: int = 0) -> None: ...

    def prepare(self, model, micro_batches: list, rt, agree, stop=None) -> str | None: ...

    def loss(self, net, batch, device, i: int = 0): ...

    def step_metrics(self, rt) -> dict: ...

    def states(self) -> dict: ...


@dataclass(frozen=True)
class Context:
    """What a factory builds an objective from: the run's config, its training dataset, the micro-batches
    a step has over every rank, the model being trained (not a wrapper), the tokenizer and the runtime."""

    cfg: Any
    dataset: Any
    micro_batches: int
    model: Any
    tok: Any
    rt: Any


@dataclass(frozen=True)
class Refusal:
    """A combination refused with this objective: every key of `when` at its value (SET: away from its
    default; a tuple: any of its values), with why and what to do instead."""

    when: Mapping[str, Any]
    reason: str
    way_on: str = ""


@dataclass(frozen=True)
class Feature:
    """A feature an objective may not support: the key that turns it on (`value`, or SET) and its name in a message."""

    key: str
    value: Any
    words: str


FEATURES: dict[str, Feature] = {
    "mix": Feature("data.mix", SET, "data.mix (a weighted mixture of corpora)"),
    "repack": Feature("data.resume_seq_len", "repack", "data.resume_seq_len=repack (a text corpus's token stream repacked)"),
    "eval": Feature("eval.interval", SET, "eval.interval (a validation loss and benchmark tasks)"),
    "fsdp": Feature("dist.strategy", "fsdp", "dist.strategy=fsdp"),
    "lora": Feature("train.lora.rank", SET, "train.lora.rank (adapters over a frozen base)"),
    "ft": Feature("ft.lighthouse", SET, "ft.lighthouse (live recovery: replica groups whose objective agrees every figure, pin and "
                  "rollout across the groups)"),
}


@dataclass(frozen=True)
class MatrixValue:
    """A value of the matrix's objective dimension (tests/matrix.py): its name, the corpus of the matrix's
    inputs it trains on, and its overrides."""

    name: str
    data: str
    overrides: tuple[str, ...] = ()


@dataclass(frozen=True)
class ObjectiveSpec:
    """One objective (the module docstring says each field)."""

    name: str
    summary: str
    docs: str
    formats: tuple[str, ...]
    build: Callable[[Context], Objective]
    classes: tuple[type, ...]
    sections: Mapping[str, type] = field(default_factory=dict)
    reads: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    by_format: Mapping[str, Mapping[str, tuple[str, ...]]] = field(default_factory=dict)
    plan: Callable[[Any], tuple[int, int, int]] | None = None
    supports: frozenset[str] = frozenset()
    why: Mapping[str, str] = field(default_factory=dict)
    refusals: tuple[Refusal, ...] = ()
    check: Callable[[Any], None] | None = None
    pins: tuple[str, ...] = ()
    headline: tuple[tuple[str, str], ...] = (("loss", "loss"),)
    matrix: tuple[MatrixValue, ...] = ()
    order: int = 100
    objective: str = ""

    def __post_init__(self) -> None:
        if not self.objective:
            object.__setattr__(self, "objective", self.name)

    def read_by(self, data_format: str) -> dict[str, tuple[str, ...]]:
        """The keys it honours under `data_format`, per train.<section>."""
        return {**self.reads, **self.by_format.get(data_format, {})}


_REGISTRY: dict[str, ObjectiveSpec] = {}


def register(spec: ObjectiveSpec) -> ObjectiveSpec:
    """Add an objective; a name or a config section taken twice is a mistake."""
    taken = {s for other in _REGISTRY.values() for s in other.sections}
    if spec.name in _REGISTRY or taken & set(spec.sections):
        raise ValueError(f"objective {spec.name!r}: the name or a section ({', '.join(spec.sections)}) is registered already")
    unknown = set(spec.supports) - set(FEATURES)
    if unknown:
        raise ValueError(f"objective {spec.name!r}: unknown features {sorted(unknown)} (known: {', '.join(FEATURES)})")
    _REGISTRY[spec.name] = spec
    return spec


def specs() -> list[ObjectiveSpec]:
    """Every registered objective, in its order (next_token first)."""
    return sorted(_REGISTRY.values(), key=lambda s: (s.order, s.name))


def spec_of(name: str) -> ObjectiveSpec:
    return _REGISTRY[name]


def objectives() -> dict[str, list[ObjectiveSpec]]:
    """train.objective's values, each with its specs (one per data format family), in order."""
    out: dict[str, list[ObjectiveSpec]] = {}
    for s in specs():
        out.setdefault(s.objective, []).append(s)
    return out


def spec_for(objective: str, data_format: str) -> ObjectiveSpec | None:
    """The spec that trains train.objective=`objective` on data.format=`data_format` (None: no such pair)."""
    return next((s for s in objectives().get(objective, []) if data_format in s.formats), None)


def sections() -> dict[str, type]:
    """Every train.<section> an objective adds, in the objectives' order."""
    return {name: cls for s in specs() for name, cls in s.sections.items()}


def value_of(cfg, key: str):
    """A dotted key's value in the config tree."""
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def default_of(cfg_type: type, key: str):
    """A dotted key's default, from the dataclasses' defaults (`cfg_type`: the root)."""
    node: Any = cfg_type
    for part in key.split("."):
        f = next(f for f in dataclasses.fields(node) if f.name == part)
        if dataclasses.is_dataclass(f.type if isinstance(f.type, type) else None):
            node = f.type
            continue
        value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if dataclasses.is_dataclass(value):
            node = type(value)
            continue
        return value
    return node


def matches(cfg, key: str, wanted, root: type) -> bool:
    value = value_of(cfg, key)
    if wanted is SET:
        return bool(value) and value != default_of(root, key)
    if isinstance(wanted, tuple):
        return value in wanted
    return value == wanted


def leaf_keys(obj, prefix: str) -> list[tuple[str, Any, Any]]:
    """(dotted key, value, default) of every leaf key of a section's dataclass instance, nested ones too."""
    out = []
    defaults = type(obj)()
    for f in dataclasses.fields(obj):
        value, default = getattr(obj, f.name), getattr(defaults, f.name)
        if dataclasses.is_dataclass(value):
            out += [(k, v, d) for k, v, d in leaf_keys(value, f"{prefix}{f.name}.")]
        else:
            out.append((f"{prefix}{f.name}", value, default))
    return out


def unread(train_cfg, spec: ObjectiveSpec, data_format: str) -> list[tuple[str, Any]]:
    """The keys of every registered train.<section> that `spec` does not honour under `data_format` and that
    are set away from their defaults: (dotted key, value)."""
    reads, out = spec.read_by(data_format), []
    for section in sections():
        honoured = reads.get(section, ())
        if honoured == ALL:
            continue
        for key, value, default in leaf_keys(getattr(train_cfg, section), f"train.{section}."):
            if key.split(".")[2] not in honoured and value != default:
                out.append((key, value))
    return out


def refusal_rows() -> list[tuple[str, str, str]]:
    """docs/design.md's refused combinations the registry holds: (combination, verdict, why), a row per
    unsupported feature (the objectives without it in one row) and per refusal."""
    rows = []
    for name, feature in FEATURES.items():
        without = [s for s in specs() if name not in s.supports]
        for why in dict.fromkeys(s.why.get(name, "") for s in without):
            names = ", ".join(s.name for s in without if s.why.get(name, "") == why)
            rows.append((f"{names} x `{feature_words(name)}`", "refused",
                         why or f"{feature.words} works with {', '.join(s.name for s in specs() if name in s.supports) or 'no objective'}"))
    for s in specs():
        for r in s.refusals:
            when = " x ".join(f"`{k}={_words(v)}`" for k, v in r.when.items())
            name = s.name if s.name == s.objective else f"{s.name} (`train.objective={s.objective}`)"
            rows.append((f"{name} x {when}", "refused", r.reason))
    return rows


def refusal_table() -> str:
    """refusal_rows as docs/design.md's table rows (`python -m objectives` prints them)."""
    return "\n".join(f"| {a} | {b} | {c} |" for a, b, c in refusal_rows())


def feature_words(name: str) -> str:
    feature = FEATURES[name]
    return feature.key if feature.value is SET else f"{feature.key}={feature.value}"


def _words(value) -> str:
    if value is SET:
        return "(set)"
    return " or ".join(map(str, value)) if isinstance(value, tuple) else str(value)

