"""What a run tells: OUT/metrics.jsonl (one line per optimizer step), the tracker's curves, the
progress bar and the human lines, on global rank 0; resumed like the weights (docs/design.md I11,
I15); and the closing line."""
from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path

from checkpoint.storage import CheckpointError

from . import tracking

log = logging.getLogger("minimind")
TIMING = ("tokens_per_s", "step_s", "elapsed_s", "rollout_s")
"""The only fields of a metrics line that differ between an interrupted run and the one that was not."""


def truncate(path: Path, step: int, shared: bool = False) -> int:
    """Drop metrics lines past `step` (and any half-written line) so that a resumed log equals an
    uninterrupted one (docs/design.md I11); the kept lines must be exactly steps 1..step, else
    CheckpointError (a log with a gap, e.g. after a power loss, is not silently continued). Returns
    the number of lines kept. `shared`: live recovery's groups share the log, which the writer group
    keeps (run/live.py: Lines): nothing is dropped here."""
    from common.files import atomic_write

    if shared or not path.exists():
        return 0
    kept, steps, lines = [], [], path.read_text().splitlines()
    for line in lines:
        s = _step_of(line)
        if s is not None and s <= step:
            kept.append(line)
            steps.append(s)
    torn = sum(1 for line in lines if _step_of(line) is None)
    dropped = len(lines) - torn - len(kept)
    if steps != list(range(1, step + 1)):
        missing = sorted(set(range(1, step + 1)) - set(steps))
        raise CheckpointError(
            f"{path}: the log up to the resumed step {step} should hold steps 1..{step} once each, but "
            f"{f'lacks steps {missing[:10]}' if missing else 'repeats or misorders steps'}{' ...' if len(missing) > 10 else ''}; "
            f"a resumed log would not equal the uninterrupted one. Move the file aside to resume (the new log then "
            f"starts at step {step + 1})")
    atomic_write(path, "".join(k + "\n" for k in kept))
    if dropped or torn:  # said, so that a shorter log is never a surprise
        log.info("%s: dropped %s past the resumed step %d (logged after the last checkpoint, they are logged again as "
                 "the run repeats those steps)%s", path, f"{dropped} line{'s' * (dropped != 1)}", step,
                 f" and {torn} half-written or unreadable line{'s' * (torn != 1)}" if torn else "")
    return len(kept)


def _step_of(line: str) -> int | None:
    """The step of a metrics line, None for a half-written or foreign one."""
    try:
        s = json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return None
    return s if isinstance(s, int) else None


def on_device(value) -> bool:
    """A figure that is a tensor on an accelerator (reading it waits for the device)."""
    return getattr(getattr(value, "device", None), "type", "cpu") != "cpu"


def host_values(records: list[dict]) -> list[dict]:
    """Each record's figures that are tensors (0-dim, on any device), as Python floats, read from each
    device in one copy: the same floats `float(tensor)` gives one by one."""
    import torch

    found = [(n, k, v) for n, r in enumerate(records) for k, v in r.items() if isinstance(v, torch.Tensor)]
    out: list[dict] = [{} for _ in records]
    for device in {v.device for _, _, v in found}:
        mine = [(n, k, v) for n, k, v in found if v.device == device]
        for (n, k, _), x in zip(mine, torch.stack([v.detach().reshape(()).double() for _, _, v in mine]).tolist()):
            out[n][k] = x
    return out


def headline(record: dict) -> dict[str, float]:
    """The figures a person watches, by objective (the bar's postfix, the closing line, `python -m
    checkpoint status`): GRPO's mean reward, DPO's loss and pair accuracy, else the loss (with a
    distillation's top-1 agreement with its teacher, and the validation loss when the line has one).
    The first is the headline."""
    if "reward/mean" in record:
        return {"reward": record["reward/mean"], "loss": record["loss"]}
    if "rewards/accuracies" in record:
        return {"loss": record["loss"], "accuracy": record["rewards/accuracies"]}
    return {"loss": record["loss"], **({"agreement": record["top1_agreement"]} if "top1_agreement" in record else {}),
            **({"val_loss": record["val_loss"]} if "val_loss" in record else {})}


class Metrics:
    """One line per optimizer step on rank 0 (`file`: OUT/metrics.jsonl, opened for appending after
    the resume truncated it), the tracker's curves, the bar and a human line every `every` steps."""

    def __init__(self, path: Path | None, tracker: tracking.Tracker, steps: int, start: int, every: int, tokens_per_step: int,
                 progress: bool) -> None:
        from tqdm import tqdm

        self.file = open(path, "a") if path is not None else None
        self.tracker, self.steps, self.every, self.tokens_per_step = tracker, steps, every, tokens_per_step
        # The bar starts at the resumed step; on a terminal only (a log file gets the step lines).
        self.bar = tqdm(total=steps, initial=start, dynamic_ncols=True, mininterval=1.0, disable=not (progress and sys.stderr.isatty()))
        self.t0 = time.perf_counter()
        self.heads: list[dict[str, float]] = []
        self.val_loss: tuple[int, float] | None = None
        self.pending: list[tuple[dict, float, float]] = []
        """Lines not yet written: (record, step seconds, elapsed seconds), their device figures unread."""

    def step(self, record: dict, seconds: float, durable: bool = False) -> None:
        """Log optimizer step `record["step"]`: its loss, LR, data position and whatever the objective
        measured (`record`), and how long it took. A figure may still be a tensor (the step's loss:
        runtime/reduce.py); one on an accelerator makes the line wait, unread, until a log step, a
        step whose checkpoint is due (`durable`) or `flush()`, so that no step but those waits for
        the device (docs/performance.md); on the CPU every line is written at its step. Raises what writing the lines raises (the loop votes on it at the
        boundary: run/protocol.py)."""
        self.pending.append((record, seconds, time.perf_counter() - self.t0))
        self.bar.update(1)
        step = record["step"]
        if durable or step % self.every == 0 or step == self.steps or not any(on_device(v) for v in record.values()):
            self.flush()

    def flush(self) -> None:
        """Write the lines that wait: their device figures read in one copy, then each line as it was."""
        pending, self.pending = self.pending, []
        if not pending:
            return
        for (record, seconds, elapsed), values in zip(pending, host_values([r for r, _, _ in pending])):
            self._write({**record, **values}, seconds, elapsed, pending)

    def _write(self, record: dict, seconds: float, elapsed: float, batch: list) -> None:
        step, loss = record["step"], record["loss"]
        self.heads.append(headline(record))
        if "val_loss" in record:
            self.val_loss = (step, record["val_loss"])
        if not self.bar.disable:
            self.bar.set_postfix({k: f"{v:.4f}" for k, v in self.heads[-1].items()}, refresh=False)
        if self.file is None:
            return
        rec = {**record, "tokens_per_s": round(self.tokens_per_step / seconds, 1), "step_s": round(seconds, 5),
               "elapsed_s": round(elapsed, 4)}
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()
        scalars = {k: v for k, v in rec.items() if (k in tracking.TAGS or "/" in k) and not isinstance(v, list)}
        scalars.update({f"{k}/{i}": x for k, v in rec.items() if "/" in k and isinstance(v, list) for i, x in enumerate(v)})
        self.tracker.log(step, scalars)
        if step % self.every == 0 or step == self.steps:
            # The rate over the lines written together: a step's own time on the host is not its time on a GPU
            # that runs behind it; the lines between two reads of the device are.
            rate = self.tokens_per_step * len(batch) / max(sum(b[1] for b in batch), 1e-9)
            extra = "".join(f" | {k.replace('_', ' ')} {v:.4f}" if not isinstance(v, list) else
                            f" | {k} {' '.join(f'{x:.2f}' for x in v)}" for k, v in rec.items() if k == "val_loss" or "/" in k)
            log.info("step %d/%d | epoch %d | loss %.4f | lr %.2e | %s tok/s%s", step, self.steps, rec["epoch"], loss, rec["lr"],
                     f"{rate:,.0f}", extra)

    def close(self) -> None:
        self.flush()
        self.bar.close()
        self.tracker.close()
        if self.file is not None:
            self.file.close()

    def report(self, end: str, step: int, yardstick: float) -> None:
        """The closing line on rank 0: how the run ended and its headline figure (`headline`: the loss,
        against `yardstick`, the corpus's unigram entropy, NaN for none, e.g. a chat run's taught
        tokens; GRPO's reward), the last step's and the mean of the last 10."""
        if not self.heads:
            log.info("nothing to do: the run is at step %d of %d", step, self.steps)
            return
        tail = self.heads[-min(10, len(self.heads)):]
        name = next(iter(tail[-1]))  # the headline: the loss, or GRPO's reward
        values = [h[name] for h in tail]
        against = "" if name != "loss" else f" (the corpus's unigram entropy: {yardstick:.4f})" if not math.isnan(yardstick) else \
            " (chat or preference rows: no unigram yardstick)"
        others = "".join(f", {k} {v:.4f}" for k, v in tail[-1].items() if k not in (name, "val_loss"))
        val = f"; validation loss {self.val_loss[1]:.4f} at step {self.val_loss[0]}" if self.val_loss else ""
        log.info("%s at step %d: %s %.4f, mean of the last %d steps %.4f%s%s%s", end, step, name, values[-1], len(tail),
                 sum(values) / len(values), others, against, val)
