"""The run's configuration: one typed tree of dataclasses, read from YAML, overridden from the CLI.

Precedence: dataclass defaults < the YAML file < `key=value` arguments (dotted keys, values parsed
as YAML scalars). An unknown key or a value of the wrong type is a `ConfigError` that names the key
and what was expected. `python train.py --help` lists every key with its default.
"""
from __future__ import annotations

import dataclasses
import math
import os
import shlex
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from common.outcome import BadInput
from common.store import StoreRefused, is_url, parse

from checkpoint.config import CheckpointConfig
from data import tokenizer as tokenizers
from data.mix import parse_mix
from data.prepare import VERIFY
from data.sampler import ORDERS
from model.config import ModelConfig
from model.lora import LoRAConfig, target_names
from objectives import spec as registry
from runtime.ft import FTConfig
from runtime.setup import DistConfig, RuntimeConfig, choice


class ConfigError(BadInput, ValueError):
    """A config key with a value it cannot have; the message names the file or the command line and the key."""


def _positive(key: str, value: float, zero_ok: bool = False) -> None:
    if value < 0 or (value == 0 and not zero_ok):
        raise ConfigError(f"{key}: expected a {'non-negative' if zero_ok else 'positive'} number, got {value}")


@dataclass
class TrainKeys:
    """train.*: the keys of every objective; each objective's own section (train.dpo, train.grpo, ...) is added from
    the registry below (TrainConfig)."""

    steps: int = 200
    """Optimizer steps of the whole run (the LR schedule spans them)."""
    global_batch: int = 32
    """Samples per optimizer step over all ranks: fixed for a run, checked on resume."""
    micro_batch: int = 8
    """Samples per forward/backward; accumulation = global_batch / (micro_batch * world size)."""
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """The cosine ends at lr * min_lr_ratio (MiniMind: 10%)."""
    warmup_steps: int = 10
    """Linear warm-up steps."""
    weight_decay: float = 0.1
    """AdamW's decoupled weight decay, on the matrices only (not on the norms)."""
    beta1: float = 0.9
    """AdamW's first-moment decay."""
    beta2: float = 0.95
    """AdamW's second-moment decay."""
    grad_clip: float = 1.0
    """Max global gradient norm; 0 disables clipping."""
    halt_at: int = 0
    """Save and exit 0 after this optimizer step, as a planned stop (0: off)."""
    dtype: str = "float32"
    """float32 | bfloat16 | float16 (autocast; float16 also uses a GradScaler, on the CPU and on CUDA)."""
    compile: bool = False
    """torch.compile each transformer block and the loss (docs/performance.md): bit-identical between compiled runs
    on any world size under dist.reduce=canonical, not to eager runs."""
    activation_checkpointing: str = "none"
    """none | full | every_K: recompute the blocks' activations in the backward (the same bits, less memory)."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """Low-rank adapters over a frozen base (docs/lora.md)."""
    objective: str = "next_token"
    """What training optimizes: one of the registered objectives (objectives/spec.py), listed in --help."""

    def __post_init__(self) -> None:
        for key in ("steps", "global_batch", "micro_batch"):
            _positive(f"train.{key}", getattr(self, key))
        for key in ("lr", "grad_clip", "weight_decay", "warmup_steps", "halt_at"):
            _positive(f"train.{key}", getattr(self, key), zero_ok=True)
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"train.min_lr_ratio: expected a number in [0, 1], got {self.min_lr_ratio}")
        choice("train.dtype", self.dtype, ("float32", "bfloat16", "float16"))
        choice("train.objective", self.objective, tuple(registry.objectives()))
        for check in dict.fromkeys(s.check for s in registry.objectives()[self.objective] if s.check):  # e.g. a teacher given
            try:
                check(self)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        from runtime.speed import checkpointed_blocks

        checkpointed_blocks(self.activation_checkpointing, 1)  # a ValueError naming the key


TrainConfig = dataclasses.make_dataclass(
    "TrainConfig", [(name, cls, field(default_factory=cls)) for name, cls in registry.sections().items()], bases=(TrainKeys,))
TrainConfig.__module__ = __name__
"""train.*: TrainKeys and each registered objective's section (train.dpo, train.grpo, ..., objectives/spec.py)."""


@dataclass
class DataConfig:
    path: str = "stdlib"
    """A MiniMind pretrain JSONL file ({"text": ...} per line, .gz or not), a directory or a glob of .jsonl /
    .jsonl.gz files (their documents in name order), the same in an object store (s3://BUCKET/KEY, a prefix or
    a glob of keys), or 'stdlib' for the built-in corpus."""
    tokenizer: str = "bytes"
    """bytes (UTF-8 bytes + BOS/EOS/PAD: 259 ids) or the path of a Hugging Face tokenizer.json (e.g. MiniMind's),
    with its tokenizer_config.json beside it naming bos/eos/pad; model.vocab_size follows it."""
    cache_dir: str = "data/cache"
    """Where packed token files (and the built-in corpus) are kept: a folder, or s3://BUCKET/PREFIX (fetched
    into the staging folder and verified by hash; a fresh node neither reads the corpus nor packs it again)."""
    num_samples: int = 0
    """Use only the first N packed samples (0: all)."""
    num_workers: int = 0
    """DataLoader worker processes per rank."""
    val_path: str = ""
    """A held-out JSONL file for the validation loss, packed like the training data ('' : none)."""
    val_samples: int = 0
    """Hold out the last N packed samples (of the first data.num_samples, when set) for validation;
    training never sees them. The same rule on every world size."""
    format: str = "text"
    """text: pretraining ({"text": ...} lines) | chat: conversations ({"conversations": [...]}, MiniMind's SFT files)
    rendered with the tokenizer's chat template (docs/sft.md) | preference: pairs ({"chosen": [...], "rejected":
    [...]}, MiniMind's dpo.jsonl) for train.objective=dpo (docs/dpo.md) | prompts: MiniMind's rlaif.jsonl or
    {"prompt", "answer", ...} lines for train.objective=grpo (docs/rl.md) | agent: MiniMind's agent lines (messages,
    tools, gt) for train.objective=grpo with tools (train.agent, docs/rl.md)."""
    loss_on: str = "assistant"
    """chat: assistant (only the assistant turns teach: MiniMind's rule) | all (every token of the conversation)."""
    pack: bool = True
    """chat: pack whole conversations into rows of model.seq_len without cross-attention | false: one padded conversation per row."""
    drop_long: bool = False
    """chat: drop a conversation longer than model.seq_len instead of truncating it (both are counted in the log)."""
    system_prompt_ratio: float = 0.0
    """chat: give this fraction of the conversations without a system turn a system prompt, a pure function of
    (seed, conversation index) (MiniMind uses 0.2)."""
    order: str = "randperm"
    """randperm (torch's DistributedSampler order, 8 bytes a sample per rank) | bijective (a keyed permutation
    computed per micro-batch: constant memory for any corpus). Fixed for a run."""
    verify_source: str = "stat"
    """stat: a packed corpus is reused when its files keep their size, mtime and inode | full: hash them again."""
    shared_cache: bool = False
    """false: each node's first rank packs into its data.cache_dir | true: data.cache_dir is one shared file
    system and rank 0 packs for every node."""
    mix: list = field(default_factory=list)
    """A weighted mixture instead of data.path: a list of {path, weight, name, format} (each path as data.path takes
    it), interleaved by weight; the weights may change on a resume, a new phase (docs/data.md)."""
    mix_drop: str = ""
    """Comma-separated names of sources a resume may drop from data.mix (a removal is refused otherwise)."""
    resume_seq_len: str = "refuse"
    """refuse: a resume keeps model.seq_len | repack: a resume may change it, a new phase: the rest of the epoch's tokens
    repacked at the new length, the corpus at it from the next epoch on (text, next_token, no mix: docs/data.md)."""

    def __post_init__(self) -> None:
        _positive("data.num_samples", self.num_samples, zero_ok=True)
        _positive("data.num_workers", self.num_workers, zero_ok=True)
        _positive("data.val_samples", self.val_samples, zero_ok=True)
        choice("data.order", self.order, ORDERS)
        choice("data.format", self.format, tuple(dict.fromkeys(f for s in registry.specs() for f in s.formats)))
        choice("data.loss_on", self.loss_on, ("assistant", "all"))
        if not 0.0 <= self.system_prompt_ratio <= 1.0:
            raise ConfigError(f"data.system_prompt_ratio: expected a fraction between 0 and 1, got {self.system_prompt_ratio}")
        choice("data.verify_source", self.verify_source, VERIFY)
        choice("data.resume_seq_len", self.resume_seq_len, ("refuse", "repack"))
        for what, value in (("data.path", self.path), ("data.val_path", self.val_path), ("data.cache_dir", self.cache_dir)):
            if is_url(value):  # in an object store (data/remote.py): the URL's form, here
                try:
                    parse(value, what)
                except StoreRefused as e:
                    raise ConfigError(str(e)) from None
        if is_url(self.cache_dir) and self.shared_cache:
            raise ConfigError(f"data.shared_cache=true with data.cache_dir={self.cache_dir}: a cache in a store is shared already; "
                              f"each node fetches it into its own staging folder (leave data.shared_cache out)")
        for parent in () if is_url(self.cache_dir) else (Path(self.cache_dir), *Path(self.cache_dir).parents):
            if parent.exists() or parent.is_symlink():
                if not parent.is_dir():
                    raise ConfigError(f"data.cache_dir: {self.cache_dir} cannot be a folder: {parent} is a file "
                                      f"(expected a folder, or a path where one can be made)")
                break
        if self.val_path and self.val_samples:
            raise ConfigError("data.val_path and data.val_samples: give one validation set, not both")
        if self.mix:
            try:
                sources = parse_mix(self.mix, self.format)
            except ValueError as e:
                raise ConfigError(str(e)) from None
            both = sorted({n.strip() for n in self.mix_drop.split(",")} & {src.name for src in sources})
            if both:
                raise ConfigError(f"data.mix_drop: {both[0]!r} is also a source of data.mix; drop a source by leaving it out of "
                                  f"data.mix and naming it here")
            if self.path != "stdlib":
                raise ConfigError(f"data.path={self.path} with data.mix: give the corpus as one of data.mix's sources")
            if self.num_samples:
                raise ConfigError(f"data.num_samples={self.num_samples} with data.mix: not supported (a mix reads each source "
                                  f"whole; data.val_samples holds out the tail of each)")


@dataclass
class LogConfig:
    sample_ids: bool = False
    """Record each step's global sample indices in metrics.jsonl."""
    every: int = 10
    """Print a line every N steps on rank 0 (metrics.jsonl gets every step; on a GPU the lines are written at these
    steps and at checkpoints, when the device is read: no step in between waits for it)."""
    progress: bool = True
    """true: a tqdm bar on rank 0 with the objective's figures, when stderr is a terminal (a log file gets the step
    lines only) | false: never."""
    tracker: str = "none"
    """none | tensorboard (OUT/tensorboard/) | wandb (the run id is the checkpoint's run_id; WANDB_MODE=offline works)."""
    project: str = "minimind-resume"
    """The W&B project."""
    sample_prompt: str = "auto"
    """The prompt whose greedy reply the launch scripts print when a run ends (auto: a question for a chat, preference or
    prompts run, "The " for text; "": none), so a recipe's log shows what its model now says."""

    def __post_init__(self) -> None:
        _positive("log.every", self.every)
        choice("log.tracker", self.tracker, ("none", "tensorboard", "wandb"))


@dataclass
class EvalConfig:
    interval: int = 0
    """Validation loss every N optimizer steps and at the last step (0: off). Needs data.val_path or data.val_samples."""
    samples: int = 0
    """Validation samples per evaluation, the first N of the set (0: all)."""
    tasks: str = ""
    """Benchmark tasks scored every eval.interval steps, comma-separated: task files or arith, as `eval --tasks` (docs/eval.md)."""

    def __post_init__(self) -> None:
        _positive("eval.interval", self.interval, zero_ok=True)
        _positive("eval.samples", self.samples, zero_ok=True)


@dataclass
class Config:
    out_dir: str = "runs/tiny"
    """Run folder: config.yaml, metrics.jsonl, checkpoints/."""
    seed: int = 1337
    """Seeds the model's init, the data order (seed + epoch) and every in-step draw."""
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    log: LogConfig = field(default_factory=LogConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    ft: FTConfig = field(default_factory=FTConfig)
    """Live recovery: replica groups in a per-step quorum (docs/fault_tolerance.md)."""

    def __post_init__(self) -> None:
        if self.ft.lighthouse:
            self._live_recovery()
        if self.eval.interval and not (self.data.val_path or self.data.val_samples or self.eval.tasks):
            raise ConfigError("eval.interval: needs a validation set (data.val_path=FILE or data.val_samples=N) or eval.tasks")
        if self.eval.tasks and not self.eval.interval:
            raise ConfigError("eval.tasks: scored every eval.interval steps; set eval.interval=N")
        if self.checkpoint.lock_timeout_s >= self.dist.timeout_s:
            raise ConfigError(f"checkpoint.lock_timeout_s={self.checkpoint.lock_timeout_s:g} must be below dist.timeout_s="
                              f"{self.dist.timeout_s} (the other ranks wait in a collective while rank 0 waits for the lock)")
        if self.dist.strategy == "fsdp" and self.train.dtype == "float16":
            raise ConfigError("dist.strategy=fsdp with train.dtype=float16: use bfloat16 (sharded runs take their precision from "
                              "FSDP's mixed-precision policy, and float16 would need a sharded gradient scaler)")
        objective_checks(self)
        if self.data.resume_seq_len == "repack" and (self.data.mix or self.data.format != "text"):
            raise ConfigError(f"data.resume_seq_len=repack with {'data.mix' if self.data.mix else f'data.format={self.data.format}'}: "
                              "not supported (it repacks one text corpus's token stream; a chat row or a mix's counts are no stream "
                              "of tokens): train the new length from model.init_from instead")
        if self.train.lora.rank:
            try:
                target_names(self.train.lora, self.model)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if is_url(self.out_dir):  # a run folder in object storage (docs/object_storage.md): the URL's form, here
            try:
                parse(self.out_dir)
            except BadInput as e:
                raise ConfigError(str(e)) from None
        elif Path(self.out_dir).exists() and not Path(self.out_dir).is_dir():
            raise ConfigError(f"out_dir: {self.out_dir} is a regular file (expected a run folder, or a path to create one at)")


    def _live_recovery(self) -> None:
        """ft.lighthouse: the combinations live recovery keeps exact, the others refused by name (docs/design.md)."""
        refused = [
            (self.dist.reduce != "canonical", f"dist.reduce={self.dist.reduce}", "the groups' gradients are summed in the canonical "
             "order, which is what makes who computed what change no bit: set dist.reduce=canonical"),
            (self.dist.strategy != "ddp", f"dist.strategy={self.dist.strategy}", "FSDP inside a group (HSDP) is not built: use "
             "dist.strategy=ddp"),
            (bool(self.model.moe.experts), "model.moe.experts", "the experts' load figures are gathered within one group only"),
            (bool(self.data.mix), "data.mix", "the sources' figures are gathered within one group only"),
            (self.log.tracker != "none", f"log.tracker={self.log.tracker}", "a tracker's run would change hands with the writer group"),
            (self.checkpoint.async_, "checkpoint.async", "a writer that leaves mid-write would leave its save to nobody"),
            (is_url(self.out_dir), "out_dir=s3://...", "the groups' shared lock is an OS lock on a folder"),
        ]
        for bad, what, why in refused:
            if bad:
                raise ConfigError(f"ft.lighthouse with {what}: not supported ({why})")


def objective_checks(cfg: Config) -> None:
    """train.objective against the registry: the data format it reads, the features it supports, the combinations it
    refuses, and every key of an objective's section it does not read set away from its default (refused naming it:
    a run does what its config says)."""
    name, fmt = cfg.train.objective, cfg.data.format
    spec = registry.spec_for(name, fmt)
    if spec is None:
        reads = "; ".join(f"{o} reads data.format={'|'.join(f for s in ss for f in s.formats)}" for o, ss in registry.objectives().items())
        raise ConfigError(f"train.objective={name} with data.format={fmt}: not supported ({reads})")
    for feature, f in registry.FEATURES.items():
        if feature not in spec.supports and registry.matches(cfg, f.key, f.value, Config):
            works = ", ".join(s.name for s in registry.specs() if feature in s.supports) or "no objective"
            why = spec.why.get(feature) or f"{f.words} works with {works}"
            raise ConfigError(f"train.objective={name} with {registry.feature_words(feature)}: not supported ({why})")
    for r in spec.refusals:
        if all(registry.matches(cfg, key, value, Config) for key, value in r.when.items()):
            combination = " with ".join(f"{key}={registry.value_of(cfg, key)}" for key in r.when)
            raise ConfigError(f"train.objective={name}: {combination}: not supported ({r.reason}{': ' + r.way_on if r.way_on else ''})")
    unread = registry.unread(cfg.train, spec, fmt)
    if unread:
        key, value = unread[0]
        reads = "; ".join(f"train.{sec}.{'*' if keys == registry.ALL else '{' + ','.join(keys) + '}'}" for sec, keys in
                          spec.read_by(fmt).items()) or "none of train.<objective>.*"
        raise ConfigError(f"{key}={value}: train.objective={name} with data.format={fmt} does not read it (it reads {reads}); "
                          f"remove the key{' and ' + ', '.join(k for k, _ in unread[1:]) if unread[1:] else ''} or train the objective "
                          f"that reads it")


FLOAT32_MAX = 3.4028234663852886e38
"""The largest float32: every float key reaches fp32 arithmetic (the optimizer, the model's buffers)."""


def _key(f: dataclasses.Field) -> str:
    return f.metadata.get("key", f.name)


def _coerce(key: str, value: Any, typ: Any) -> Any:
    if typ is bool:
        if isinstance(value, bool):
            return value
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if not -(1 << 63) <= value < (1 << 63):  # every int key ends in a C integer (a seed, a count, a timeout)
                raise ConfigError(f"{key}: expected an integer that fits in 64 bits, got {value}")
            return value
    elif typ is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads 3e-4 as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            if not math.isfinite(number):  # no key takes nan or inf: training on one is NaN weights, or a crash deep inside
                raise ConfigError(f"{key}: expected a finite number, got {value!r}")
            if abs(number) > FLOAT32_MAX:  # a learning rate of 1e300 is inf in the fp32 optimizer: a crash deep inside
                raise ConfigError(f"{key}: expected a number within float32's range (at most {FLOAT32_MAX:.4g} in size), got {value!r}")
            return number
    elif typ is list:
        if isinstance(value, list):
            return value
    elif typ is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        if isinstance(value, bool):  # YAML 1.1 reads false/no/off as a boolean: the word, so a choice's check lists the values
            return str(value).lower()
    raise ConfigError(f"{key}: expected {typ.__name__}, got {value!r} ({type(value).__name__})")


def _build(cls: type, data: dict, prefix: str, source: str, construct: bool = True) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {_key(f): f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in fields:
            raise ConfigError(f"{source}: unknown key '{full}' (known keys{' in ' + prefix[:-1] if prefix else ''}: {', '.join(fields)})")
        f = fields[key]
        typ = hints[f.name]
        if dataclasses.is_dataclass(typ):
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: '{full}' must be a mapping of {typ.__name__} keys, got {value!r}")
            kwargs[f.name] = _build(typ, value, f"{full}.", source, construct)
        else:
            kwargs[f.name] = _coerce(f"{source}: {full}", value, typ)
    if not construct:  # keys and types only: cross-field checks wait for the merged tree
        return kwargs
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:  # the validation of ModelConfig, CheckpointConfig, RuntimeConfig, DistConfig
        raise ConfigError(f"{source}: {e}") from None


def to_dict(obj: Any) -> Any:
    """Plain dict of a config (YAML/JSON-ready, with the YAML key names)."""
    if dataclasses.is_dataclass(obj):
        return {_key(f): to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    return obj


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


ENV_OVERRIDES = "MINIMIND_OVERRIDES"
"""An environment variable of key=value overrides between the YAML and the command line (docs/tests.md
"The docs test": the documented commands run as written, on a tiny model)."""


def parse_overrides(overrides: list[str], where: str = "command line") -> dict:
    """`["train.lr=3e-4", "seed=1"]` -> nested dict; values are parsed as YAML scalars."""
    tree: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"{where}: expected key=value, got {item!r}")
        key, raw = item.split("=", 1)
        try:
            value = yaml.load(raw, Loader=_UniqueKeys) if raw.strip() else ""
        except _Duplicate as e:
            raise ConfigError(f"{where}: {key.strip()}: {str(e).replace('line 1: ', '')}") from None
        except yaml.YAMLError:
            value = raw
        except RecursionError:
            raise ConfigError(f"{where}: {key.strip()}: the value is nested too deeply to be a config value") from None
        node = tree
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{where}: {key} conflicts with another override")
        node[parts[-1]] = value
    return tree


class _Duplicate(yaml.YAMLError):
    """A key given twice in one mapping of a config file."""


class _UniqueKeys(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (YAML would keep the last one
    silently: a config that says two things does one of them)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, typing.Hashable) and key in seen:
                raise _Duplicate(f"line {key_node.start_mark.line + 1}: key '{key}' is given twice (first at line {seen[key]}); "
                                 f"say it once")
            if isinstance(key, typing.Hashable):
                seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults < YAML file at `path` < $MINIMIND_OVERRIDES < `overrides` ("a.b=value")."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if path.is_dir():
            raise ConfigError(f"config file {path} is a directory (expected a YAML file, e.g. configs/tiny.yaml)")
        if not path.is_file():
            raise ConfigError(f"config file {path} {'is not a regular file' if path.exists() else 'does not exist'} (expected a YAML file)")
        try:
            loaded = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeys) or {}
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not UTF-8 text (byte {e.start} is {e.object[e.start]:#04x}); a config is a YAML file") from None
        except _Duplicate as e:
            raise ConfigError(f"{path}: {e}") from None
        except RecursionError:
            raise ConfigError(f"{path}: nested too deeply to be a config") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML ({e})") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: expected a mapping of config keys at the top level")
        _build(Config, loaded, "", str(path), construct=False)  # key and type errors name the file
        data = loaded
    try:
        env = parse_overrides(shlex.split(os.environ.get(ENV_OVERRIDES, "")), ENV_OVERRIDES)
    except ValueError as e:  # shlex: an unclosed quote
        raise ConfigError(f"{ENV_OVERRIDES}: {e} (it is split as a shell would: key=value key=value ...)") from None
    _build(Config, env, "", ENV_OVERRIDES, construct=False)
    cli = parse_overrides(overrides or [])
    _build(Config, cli, "", "command line", construct=False)
    merged = _merge(_merge(data, env), cli)
    cfg = _build(Config, merged, "", "config")
    # The model's vocabulary follows the tokenizer; a model.vocab_size that was given must agree.
    tok = load_tokenizer(cfg)
    given = (merged.get("model") or {}).get("vocab_size")
    if given is not None and given != tok.vocab_size:
        raise ConfigError(f"model.vocab_size={given}, but data.tokenizer={cfg.data.tokenizer} has {tok.vocab_size} ids: "
                          f"remove model.vocab_size (it follows the tokenizer) or make them equal")
    cfg.model.vocab_size = tok.vocab_size
    if cfg.eval.tasks:  # a bad task file is said before anything starts
        from objectives.benchmark import TaskError, read_tasks

        try:
            read_tasks(cfg.eval.tasks)
        except TaskError as e:
            raise ConfigError(f"eval.tasks: {e}") from None
    return cfg


def load_tokenizer(cfg: Config):
    """The tokenizer data.tokenizer names (a ConfigError naming the key when it cannot be used)."""
    try:
        return tokenizers.load(cfg.data.tokenizer)
    except tokenizers.TokenizerError as e:
        raise ConfigError(str(e) if str(e).startswith("data.tokenizer") else f"data.tokenizer: {e}") from None


def describe() -> str:
    """Every key with its default and its one-line description, grouped by section with the page of docs/ that
    explains it: the key list of `python train.py --help` and `python -m configs --help`."""
    import ast
    import inspect

    def docs(cls: type) -> dict[str, str]:
        out = {}
        for base in [c for c in cls.__mro__ if dataclasses.is_dataclass(c) and c is not TrainConfig]:  # TrainConfig: TrainKeys'
            body = ast.parse(inspect.getsource(base)).body[0].body
            for a, b in zip(body, body[1:]):
                if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
                    out[a.target.id] = " ".join(str(b.value.value).split())
        if cls is TrainConfig:  # the objectives, from the registry
            out["objective"] = " | ".join(f"{o} ({'; '.join(f'{s.summary}, data.format={chr(124).join(s.formats)}' for s in ss)}: "
                                          f"{ss[0].docs})" for o, ss in registry.objectives().items())
        return out

    groups: dict[str, list[str]] = {}

    def walk(cls: type, obj: Any, prefix: str) -> None:
        d = docs(cls)
        for f in dataclasses.fields(cls):
            v = getattr(obj, f.name)
            if dataclasses.is_dataclass(v):
                walk(type(v), v, f"{prefix}{_key(f)}.")
            else:
                line = f"  {prefix}{_key(f)} = {v!r}" + (f"  # {d[f.name]}" if f.name in d else "")
                groups.setdefault(prefix.rstrip(".") or "run", []).append(line)

    walk(Config, Config(), "")
    return "\n".join(f"{name} ({GROUP_DOCS[name]}):\n" + "\n".join(lines) if name in GROUP_DOCS else f"{name}:\n" + "\n".join(lines)
                     for name, lines in groups.items())


GROUP_DOCS = {"run": "docs/run_folder.md", "model": "docs/models.md", "model.moe": "docs/models.md",
              "train": "docs/resuming.md, docs/performance.md", "train.lora": "docs/lora.md",
              **{f"train.{section}": s.docs for s in registry.specs() for section in s.sections}, "train.distill.teacher_model": "docs/distill.md",
              "train.distill.teacher_model.moe": "docs/distill.md", "data": "docs/data.md, docs/sft.md", "checkpoint": "docs/resuming.md, docs/run_folder.md",
              "dist": "docs/resuming.md, docs/sharding.md", "runtime": "docs/resuming.md", "log": "docs/watching.md",
              "eval": "docs/watching.md"}
"""Where docs/ explains each group of keys (`describe`, the --help of train.py and python -m configs)."""
