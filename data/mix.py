"""A weighted mixture of corpora: each source packed once, their samples interleaved by weight over
each source's own order, and the run's position the count consumed from each (docs/data.md).

The rule (Megatron-LM's blended datasets): within a phase that began with counts `base`, the next
sample comes from the source furthest behind its share, `argmax_k w_k * (t + 1) - d_k`, where
`d_k = count_k - base_k`, `t = sum(d)` and the weights are normalized; a tie goes to the first name
in sorted order. Source k's j-th sample is position `j % n_k` of its epoch `j // n_k` order
(`make_order(data.order, n_k, seed, epoch)`: randperm(seed + epoch), or the bijection), so a small
source starts its next epoch when it runs out while the others go on. The interleave is a pure
function of (weights, base, counts): the counts after each step are the position a checkpoint
holds, and a resume continues from them on any world size. A resume that changes the weights (or
adds a source, or drops one named in data.mix_drop) starts a new phase at the counts reached.

    weights a=0.75 b=0.25, G = 4:   step 0: a a b a   step 1: a a b a ...   counts after step 1: a=6 b=2
"""
from __future__ import annotations

import bisect
import json
import logging
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass

from torch.utils.data import Dataset, Sampler

from .sampler import BatchPlan, make_order
from .sources import DataError

log = logging.getLogger("minimind")

KEYS = ("path", "weight", "name", "format")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*\Z")
# A name becomes loss/<name> and tokens/<name>; it may not be a figure's own name either.
RESERVED = frozenset({"step", "epoch", "loss", "lr", "samples_seen", "sample_ids", "val_loss", "tokens", "moe", "eval", "reward",
                      "rewards", "kl", "time", "seconds"})


@dataclass(frozen=True)
class Source:
    """One corpus of a mix: any `data.path` (file, folder, glob, built-in), its weight and its name."""

    name: str
    path: str
    weight: float
    format: str = "text"


def parse_mix(entries: list, fmt: str = "text") -> list[Source]:
    """`data.mix` as sources, sorted by name; a ValueError naming the key for anything else."""
    if not isinstance(entries, list):
        raise ValueError(f"data.mix: expected a list of {{path, weight, name, format}}, got {entries!r}")
    out: dict[str, Source] = {}
    for i, e in enumerate(entries):
        key = f"data.mix[{i}]"
        if not isinstance(e, dict) or "path" not in e:
            raise ValueError(f"{key}: expected a mapping with a path (and weight, name, format), got {e!r}")
        unknown = sorted(set(e) - set(KEYS))
        if unknown:
            raise ValueError(f"{key}: unknown key {unknown[0]!r} (known: {', '.join(KEYS)})")
        name = str(e.get("name") or str(e["path"]).rstrip("/").split("/")[-1].split(".")[0])
        weight = e.get("weight", 1.0)
        if isinstance(weight, str):  # YAML 1.1 reads 1e-3 (no dot) as a string; train.lr=1e-3 is a number too
            try:
                weight = float(weight)
            except ValueError:
                pass
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0 or weight == float("inf"):
            raise ValueError(f"{key}.weight: expected a number > 0, got {weight!r}")
        if not NAME.match(name) or name in RESERVED:
            raise ValueError(f"{key}.name: {name!r} cannot name a source (it becomes the figures loss/{name} and tokens/{name}): "
                             f"expected letters, digits, '_', '-' or '.', and none of {', '.join(sorted(RESERVED))}")
        if name in out:
            raise ValueError(f"{key}.name: {name!r} names two sources (each source needs its own name)")
        form = e.get("format", fmt)
        if form != fmt or fmt not in ("text", "chat"):
            raise ValueError(f"{key}.format: {form!r} with data.format={fmt}: a mix's sources are all text (data.format=text) "
                             f"or all chat (data.format=chat)")
        out[name] = Source(name, str(e["path"]), float(weight), form)
    if not out:
        raise ValueError("data.mix: an empty list (leave it out to read data.path)")
    names = list(out)  # in the list's order: data.mix[i]
    largest = max(src.weight for src in out.values())
    for i, share in enumerate(normalize([src.weight for src in out.values()])):
        if not share > 0:
            raise ValueError(f"data.mix[{i}].weight: {out[names[i]].weight!r} beside the largest weight {largest!r}: its share of "
                             f"the sum underflows to 0, so source {names[i]!r} would never be drawn; expected weights within a "
                             f"factor of 1e300 of each other")
    return [out[k] for k in sorted(out)]


def normalize(weights: list[float]) -> list[float]:
    """The weights divided by their sum, for any finite weights > 0: scaled first by the power of two
    that brings the largest into [0.5, 1) (exact: no bit of any weight changes), so the sum cannot
    overflow (1e308 + 9e307 is 1.9e308, past a float's 1.8e308) and the shares are the bits `w / sum(w)`
    gives wherever that sum is finite."""
    scale = 2.0 ** -math.frexp(max(weights))[1]
    scaled = [w * scale for w in weights]
    total = sum(scaled)
    return [w / total for w in scaled]


def dropped(spec: str) -> set[str]:
    """`data.mix_drop`: comma-separated names."""
    return {n.strip() for n in spec.split(",") if n.strip()}


class MixOrder:
    """The interleave: which source's which sample each global-batch slot of each step takes, from
    the phase (base step, base counts, weights) and counts cached at step boundaries."""

    def __init__(self, names: list[str], sizes: list[int], weights: list[float], seed: int, kind: str, global_batch: int) -> None:
        self.names, self.sizes, self.seed, self.kind, self.g = names, sizes, seed, kind, global_batch
        self.weights = normalize(weights)
        self.offsets = [sum(sizes[:k]) for k in range(len(sizes))]
        self.base_step, self.base = 0, [0] * len(names)
        self.dropped: dict[str, int] = {}  # sources an earlier phase dropped, with their counts (named again: they go on from there)
        self.counts: dict[int, list[int]] = {0: [0] * len(names)}
        self._orders: dict[int, tuple[int, object]] = {}
        self._steps: dict[int, list[int]] = {}

    def _next(self, counts: list[int]) -> int:
        d = [c - b for c, b in zip(counts, self.base)]
        t = sum(d)
        errors = [w * (t + 1) - x for w, x in zip(self.weights, d)]
        return errors.index(max(errors))

    def _samples(self, k: int, first: int, end: int) -> list[int]:
        """Source k's samples first..end-1 (of its stream over epochs), as global indices: one take per epoch."""
        out = []
        while first < end:
            epoch, p = divmod(first, self.sizes[k])
            held = self._orders.get(k)
            if held is None or held[0] != epoch:
                held = self._orders[k] = (epoch, make_order(self.kind, self.sizes[k], self.seed, epoch))
            n = min(end - first, self.sizes[k] - p)
            out += [self.offsets[k] + i for i in held[1].take(p, n)]
            first += n
        return out

    def counts_at(self, step: int) -> list[int]:
        """The samples consumed from each source after `step` optimizer steps."""
        if step in self.counts:
            return self.counts[step]
        known = max((s for s in self.counts if s <= step), default=None)
        if known is None or step < self.base_step:
            raise ValueError(f"the mix's position at step {step} is before its phase began (step {self.base_step})")
        for s in range(known, step):
            self.step_samples(s)
        return self.counts[step]

    def step_samples(self, step: int) -> list[int]:
        """The global batch of optimizer step `step` (0-based): G indices into the concatenated sources."""
        if step not in self._steps:
            start = self.counts_at(step)
            counts, picks = list(start), []
            for _ in range(self.g):
                k = self._next(counts)
                picks.append(k)
                counts[k] += 1
            # Each source's samples of the step are consecutive in its stream: read them at once, then interleave.
            taken = {k: iter(self._samples(k, start[k], counts[k])) for k in set(picks)}
            out = [next(taken[k]) for k in picks]
            self.counts[step + 1] = counts
            self.counts = {s: c for s, c in self.counts.items() if s > step - 64}  # the loop saves at most a few steps behind
            # Kept as far back as the counts: the loop asks for a step the loader may have passed (workers prefetch).
            self._steps = {step: out, **{s: v for s, v in self._steps.items() if s > step - 64}}
        return self._steps[step]

    def source_of(self, index: int) -> int:
        return bisect.bisect_right(self.offsets, index) - 1

    def state(self, step: int) -> dict:
        counts = self.counts_at(step)
        return {"step": step, "counts": dict(zip(self.names, counts)), "base_step": self.base_step,
                "base": dict(zip(self.names, self.base)), "weights": dict(zip(self.names, self.weights)), "dropped": self.dropped}

    def resume(self, saved: dict, drop: set[str], identities: dict[str, str], saved_identities: dict[str, str]) -> str | None:
        """Continue from a checkpoint's position; a new phase when the sources or weights changed.
        Returns the line that says so (None: the same phase). A DataError for a refused change."""
        gone = sorted(set(saved["counts"]) - set(self.names))
        earlier = {n: int(c) for n, c in dict(saved.get("dropped") or {}).items()}  # the same command run again names them still
        unknown = sorted(drop - set(saved["counts"]) - set(earlier))
        if unknown:
            raise DataError(f"data.mix_drop: {unknown[0]!r} is no source of the checkpoint's mix ({', '.join(sorted(saved['counts']))}): "
                            f"name one that was in it")
        dropped = {**earlier, **{n: int(saved["counts"][n]) for n in gone}}
        self.dropped = {n: c for n, c in sorted(dropped.items()) if n not in self.names}
        refused = [n for n in gone if n not in drop]
        if refused:
            raise DataError(f"data.mix: source {refused[0]!r} was in the mix at step {saved['step']} and is not now: removing a "
                            f"source changes what the run has promised to read; name it in data.mix_drop to drop it (a new phase)")
        for n in self.names:
            if n in saved_identities and saved_identities[n] != identities[n]:
                raise DataError(f"data.mix: source {n!r} changed since the checkpoint ({saved_identities[n]} -> {identities[n]}): "
                                f"its order would not continue; give a changed corpus another name")
        # A source dropped before and named again goes on from its count, not from its first sample again.
        step, counts = int(saved["step"]), [int(saved["counts"].get(n, dropped.get(n, 0))) for n in self.names]
        same = not gone and set(saved["counts"]) == set(self.names) and all(
            abs(saved["weights"][n] - w) == 0 for n, w in zip(self.names, self.weights))
        self._steps, self.counts = {}, {step: counts}
        if same:
            self.base_step, self.base = int(saved["base_step"]), [int(saved["base"][n]) for n in self.names]
            return None
        self.base_step, self.base = step, list(counts)
        before = ", ".join(f"{n}={w:.4g}" for n, w in sorted(saved["weights"].items()))
        now = ", ".join(f"{n}={w:.4g}" for n, w in zip(self.names, self.weights))
        return (f"data.mix: a new phase from step {step}: weights {before} -> {now}"
                f"{'; dropped ' + ', '.join(gone) if gone else ''}; counts kept: "
                f"{', '.join(f'{n}={c}' for n, c in zip(self.names, counts))}")


class MixDataset(Dataset):
    """The sources' packed datasets end to end (sorted by name): global index = offset + local index."""

    def __init__(self, parts: list[tuple[str, Dataset]], weights: list[float], identities: dict[str, str], seed: int, kind: str,
                 drop: set[str]) -> None:
        self.names = [n for n, _ in parts]
        self.parts = [d for _, d in parts]
        self.identities, self.drop = identities, drop
        self.order = MixOrder(self.names, [len(d) for d in self.parts], weights, seed, kind, 0)  # G: set by the sampler
        self.bin_path, self.dtype = self.parts[0].bin_path, self.parts[0].dtype  # the unigram yardstick: the first source's
        self.seq_len = self.parts[0].seq_len
        self.loaded: dict | None = None

    def __getstate__(self) -> dict:
        # A DataLoader worker reads samples only: the orders (8 bytes a sample under randperm) stay in the trainer.
        order = MixOrder.__new__(MixOrder)
        order.__dict__.update({**self.order.__dict__, "_orders": {}, "_steps": {}, "counts": {}})
        return {**self.__dict__, "order": order}

    def __len__(self) -> int:
        return sum(len(d) for d in self.parts)

    def __getitem__(self, index: int):
        k = self.order.source_of(index)
        return self.parts[k][index - self.order.offsets[k]]

    def source_of(self, indices: list[int]) -> list[int]:
        return [self.order.source_of(i) for i in indices]

    def taught(self, indices: list[int]) -> int:
        """Chat sources: the taught tokens of those rows, from each source's counts (data/dataset.py ChatDataset)."""
        return sum(self.parts[k].taught([i - self.order.offsets[k]]) for k, i in zip(self.source_of(indices), indices))

    def states(self, train_state) -> dict:
        return {"mix": MixPosition(self, train_state)}

    def start(self, step: int) -> str | None:
        """Where the mix continues: a fresh run at zero counts; a resumed one at its checkpoint's (the line saying so)."""
        if self.loaded is None:
            return None
        saved = self.loaded
        if int(saved["step"]) != step:
            raise DataError(f"data.mix: the checkpoint's mix position is of step {saved['step']}, its step is {step}")
        return self.order.resume(saved, self.drop, self.identities, saved.get("identities", {}))


class MixValidation(Dataset):
    """Each source's held-out tail (data.val_samples of each), end to end in the sources' sorted order; `named_parts` for
    the per-source figures (objectives/next_token.py validation)."""

    def __init__(self, parts: list[tuple[str, Dataset]]) -> None:
        self.named_parts = parts
        self.offsets = [sum(len(d) for _, d in parts[:k]) for k in range(len(parts))]

    def __len__(self) -> int:
        return sum(len(d) for _, d in self.named_parts)

    def __getitem__(self, index: int):
        k = bisect.bisect_right(self.offsets, index) - 1
        return self.named_parts[k][1][index - self.offsets[k]]


class MixPosition:
    """The mix's resume state: the counts after the checkpoint's step, the phase and each source's identity (one JSON string,
    so that a checkpoint holds it whatever sources the run has now)."""

    def __init__(self, mix: MixDataset, train_state) -> None:
        self.mix, self.train_state = mix, train_state

    def state_dict(self) -> dict:
        return {"position": json.dumps({**self.mix.order.state(self.train_state.step), "identities": self.mix.identities},
                                       sort_keys=True)}

    def load_state_dict(self, state: dict) -> None:
        self.mix.loaded = json.loads(state["position"])


class MixSampler(Sampler[list[int]]):
    """Rank `rank`'s micro-batches of the mix (BlockDistributedSampler's interface and sharding:
    micro-batch i of a step is slots [i*micro, (i+1)*micro) of its global batch, computed by rank
    i mod W). The loop's (epoch, step in epoch) are mapped back to the run's optimizer step from
    where the run resumed: the mix has no epoch of its own, each source has its own."""

    def __init__(self, mix: MixDataset, plan: BatchPlan, rank: int, step: int, epoch: int, first: int) -> None:
        self.mix, self.plan, self.rank = mix, plan, rank
        mix.order.g = plan.global_batch
        self.anchor = step - epoch * self.steps_per_epoch() - first  # global step = anchor + epoch * spe + s
        self.epoch = epoch

    def steps_per_epoch(self) -> int:
        return self.plan.steps_per_epoch(len(self.mix))

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.steps_per_epoch() * self.plan.accum

    def _step(self, s: int) -> int:
        return self.anchor + self.epoch * self.steps_per_epoch() + s

    def iter_from(self, skip: int) -> Iterator[list[int]]:
        micro, w = self.plan.micro_batch, self.plan.world_size
        for k in range(skip, len(self)):
            s, j = divmod(k, self.plan.accum)
            i = j * w + self.rank
            yield self.mix.order.step_samples(self._step(s))[i * micro:(i + 1) * micro]

    def __iter__(self) -> Iterator[list[int]]:
        return self.iter_from(0)

    def step_indices(self, step_in_epoch: int) -> list[int]:
        return list(self.mix.order.step_samples(self._step(step_in_epoch)))
