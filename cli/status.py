"""`python -m checkpoint status RUN [--exit-code]`: where a run is, read from its folder: the
status record, who holds the lock, the last metrics line and the checkpoints.

    {"state": "running", "step": 90, "steps": 200, "loss": 2.31, "tokens_per_s": 12345.6,
     "published_step": 50, "since_checkpoint_s": 14.2, "eta_s": 81.0, ..., "summary": "running: step 90 of 200, ..."}

The state is the record's, except that a run recorded as running whose lock nobody holds (its
processes were SIGKILLed, or the machine went away) is "stopped (no process holds the lock)": the
kernel drops the lock with its holder (run/folder.py). The step is the last logged one while the
run is held, else the recorded one or, when the record has none (a relaunch refused before its
first step), the last published checkpoint's. With --exit-code it is what the launch scripts ask
at the end: wait for the folder's holder, exit with the run's code, and print the outcome's one
line last on stderr (docs/run_folder.md, "Exit codes").
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from checkpoint import storage
from common.outcome import EXIT_CODES, BadInput, exit_code
from run import folder
from run.metrics import headline

LOST = "stopped (no process holds the lock)"
"""The state of a run recorded as running whose lock holder is gone."""
WINDOW = 10
"""Steps the rate and the ETA are measured over."""


def _rows(run: Path) -> list[dict]:
    """metrics.jsonl's lines; a half-written last line (the run is writing it) is skipped."""
    try:
        text = (run / folder.METRICS).read_text(errors="replace")
    except FileNotFoundError:
        return []
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows


def _target(run: Path) -> int | None:
    """The step the run trains to (train.halt_at when it comes first), from its config.yaml."""
    import yaml

    try:
        train = (yaml.safe_load((run / folder.CONFIG).read_text()) or {}).get("train") or {}
    except (OSError, ValueError, AttributeError, yaml.YAMLError):
        return None
    steps, halt = train.get("steps"), train.get("halt_at") or 0
    if not isinstance(steps, int):
        return None
    return halt if isinstance(halt, int) and 0 < halt < steps else steps


def _seconds_per_step(rows: list[dict]) -> float | None:
    """Wall time per step over the last WINDOW steps of the current launch (saves included), from
    elapsed_s; the step's own step_s when only one line is there."""
    tail = rows[-(WINDOW + 1):]
    start = len(tail) - 1
    while start > 0 and tail[start - 1].get("elapsed_s", math.inf) < tail[start].get("elapsed_s", -math.inf):
        start -= 1  # elapsed_s restarts with each launch: measure within the last one
    if len(tail) - 1 - start >= 1:
        return (tail[-1]["elapsed_s"] - tail[start]["elapsed_s"]) / (len(tail) - 1 - start)
    return tail[-1].get("step_s") if tail else None


def duration(seconds: float | None) -> str:
    """`45 s`, `3 min 20 s`, `2 h 05 min`."""
    if seconds is None:
        return "?"
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def report(run: Path, now: float | None = None) -> dict:
    """Where the run in folder `run` is (the JSON that `status` prints)."""
    now = time.time() if now is None else now
    record = folder.read_status(run) or {}
    held = not folder.wait_until_free(run, 0)
    recorded = record.get("state")
    state = LOST if recorded == "running" and not held else recorded
    rows = _rows(run)
    last = rows[-1] if rows else None
    published = storage.list_checkpoints(run / storage.CHECKPOINTS)
    published_step = published[0][0] if published else None
    manifest = published[0][1] / storage.MANIFEST if published else None
    since = now - manifest.stat().st_mtime if manifest is not None and manifest.exists() else None
    if recorded == "running" and held:
        step = last["step"] if last else record.get("step")
    elif state == LOST or record.get("step") is None:
        step = published_step
    else:
        step = record["step"]
    target = _target(run)
    rate = _seconds_per_step(rows) if rows else None
    figures = headline(last) if last and "loss" in last else {}
    tokens = [r["tokens_per_s"] for r in rows[-WINDOW:] if isinstance(r.get("tokens_per_s"), (int, float))]
    eta = (target - last["step"]) * rate if held and recorded == "running" and last and target and rate is not None else None
    out = {**record, "state": state, "recorded_state": recorded, "step": step, "steps": target, "logged_step": last["step"] if last else None,
           **{k: round(v, 6) for k, v in figures.items()},
           "tokens_per_s": round(sum(tokens) / len(tokens), 1) if tokens else None,
           "published_step": published_step, "since_checkpoint_s": round(since, 1) if since is not None else None,
           "eta_s": round(max(eta, 0.0), 1) if eta is not None else None,
           "held_by": folder.read_holder(run) if held else None}
    out["summary"] = summary(out)
    return out


def summary(r: dict) -> str:
    """The report in one line for a person."""
    state, parts = r["state"] or "no status recorded", []
    if r["state"] == LOST:
        logged = r["logged_step"] not in (None, r["published_step"])
        parts.append(f"last published step {r['published_step']}" + (f" (logged to step {r['logged_step']})" if logged else ""))
    elif r["step"] is not None:
        parts.append(f"step {r['step']}" + (f" of {r['steps']}" if r.get("steps") else ""))
    parts += [f"{k} {r[k]:.4f}" for k in ("reward", "loss", "accuracy", "agreement", "val_loss") if isinstance(r.get(k), float)]
    if r["tokens_per_s"] is not None:
        parts.append(f"{r['tokens_per_s']:,.0f} tokens/s")
    if r["published_step"] is not None:
        parts.append(f"last checkpoint step {r['published_step']}, {duration(r['since_checkpoint_s'])} ago")
    if r["eta_s"] is not None:
        parts.append(f"ETA {duration(r['eta_s'])}")
    if r.get("cause"):
        parts.append(r["cause"])
    return f"{state}: {', '.join(parts)}" if parts else state


def outcome_line(run: Path, record: dict) -> str:
    """The recorded outcome in one line: what the launch scripts print last."""
    state, code, step = record["state"], exit_code(record.get("outcome") or record["state"]), record.get("step")
    at = f" at step {step}" if step is not None else ""
    if step is None:  # ended before a step of its own (a refused relaunch): the step that stands
        published = storage.list_checkpoints(run / storage.CHECKPOINTS)
        at = f" (its last checkpoint: step {published[0][0]})" if published else ""
    cause = f": {record['cause']}" if record.get("cause") else ""
    again = " (resume me: run the same command again)" if state == "stopped" else ""
    return f"[status] {run}: {state}{at}{cause}; exit {code}{again}"

HELP = ("where the run is (JSON): state, step, the loss or the objective's figure, tokens/s, the last checkpoint, an ETA, "
        "who holds the folder")


def arguments(p: argparse.ArgumentParser) -> None:
    from .arguments import number, place

    p.add_argument("run", type=place)
    p.add_argument("--exit-code", action="store_true",
                   help="wait until no process holds the folder, then exit with the run's exit code (75: stopped, resume me)")
    p.add_argument("--launch-id", help="with --exit-code: use the status only if this launch wrote it")
    p.add_argument("--fallback", type=int, default=1,
                   help="with --exit-code: the launcher's own exit code, used when the status is not this launch's (default 1)")
    p.add_argument("--wait-s", type=number(float, 0), default=300.0, help="with --exit-code: how long to wait for the folder's holder")
    p.add_argument("--sample", action="store_true",
                   help="with --exit-code: a run that ended with 0 first prints its model's greedy reply to log.sample_prompt")
    p.add_argument("--stopped", type=int, choices=(0, 1), default=0,
                   help="with --exit-code: 1 when the launcher passed a stop signal on; an outcome this launch never recorded is then 75")


def fetch_checkpoint(args: argparse.Namespace) -> bool:
    """A run in the store comes down without its checkpoints, unless --sample reads the model."""
    return args.sample


def run(args: argparse.Namespace) -> int:
    """Print the run's report; with --exit-code, the exit code a scheduler should see: the run's
    recorded outcome when this launch recorded one (its one line last on stderr), else what the
    launcher's own code says (a launcher stopped by a signal: stopped; a code of the table: that
    one, e.g. 2 for a launch refused before it kept a folder; anything else: failed)."""
    # A stop the launch script passed on, or a launcher that a signal ended (runtime/launch.py: 128 + signal).
    stopped = bool(args.stopped) or args.fallback > 128
    fallback = exit_code("stopped") if stopped else args.fallback if args.fallback in set(EXIT_CODES.values()) else exit_code("failed")
    marks = (folder.LOCK, folder.STATUS, folder.CONFIG, folder.METRICS, storage.CHECKPOINTS)
    if not args.exit_code and args.run.is_dir() and not any((args.run / name).exists() for name in marks):
        raise BadInput(f"{args.run}: not a run folder (none of {', '.join(marks)} in it); give a run's out_dir")
    if not args.run.is_dir():
        if not args.exit_code:
            raise BadInput(f"{args.run}: not a run folder")
        # the run never got as far as its folder, or was refused before it trained and took its folder back
        print(f"[status] no run folder at {args.run} (the launch ended before it kept one; its own line above says why); "
              f"exit {fallback}", file=sys.stderr)
        return fallback
    # Wait for this launch's workers that outlived their torchrun (finishing a save); another run
    # that holds the folder (this launch waited for it and was stopped) is not waited for.
    holder = folder.read_holder(args.run)
    ours = not args.launch_id or not holder or holder.get("launch_id") == args.launch_id
    if args.exit_code and ours and not folder.wait_until_free(args.run, args.wait_s):
        print(f"status: {args.run} is still held by {folder.describe_holder(folder.read_holder(args.run))} after {args.wait_s:g} s",
              file=sys.stderr)
        return fallback
    print(json.dumps(report(args.run), indent=1))
    if not args.exit_code:
        return 0
    record = folder.read_status(args.run)
    if record is None or (args.launch_id and record.get("launch_id") != args.launch_id):
        print(f"status: {args.run} has no status from this launch; exit {fallback} from the launcher's code {args.fallback}", file=sys.stderr)
        return fallback
    if record["state"] == "running":  # the holder is gone without a word: killed
        print(f"status: the run in {args.run} died without recording an outcome (killed?)", file=sys.stderr)
        return fallback
    code = exit_code(record.get("outcome") or record["state"])
    if args.sample and code == 0 and record.get("step"):
        print(sample_line(args.run), file=sys.stderr)
    print(outcome_line(args.run, record), file=sys.stderr)
    return code


AUTO_PROMPTS = {"text": "The ", "chat": "What does os.path.join do?"}
"""log.sample_prompt=auto: a continuation for a pretraining run, a question for every other (they chat)."""


def sample_line(run: Path) -> str:
    """What the run's model now says (log.sample_prompt: one greedy reply, the default repetition
    penalty), in one line; a failure to say it is said instead and changes no exit code."""
    try:
        import yaml

        from data.chat import template_of
        from model.generate import DEFAULTS, generate_ids
        from weights import load_model_and_tokenizer

        config = yaml.safe_load((run / folder.CONFIG).read_text())
        prompt = (config.get("log") or {}).get("sample_prompt", "auto")
        text = (config.get("data") or {}).get("format", "text") == "text"
        if prompt == "auto":
            prompt = AUTO_PROMPTS["text" if text else "chat"]
        if not prompt:
            return "[sample] (log.sample_prompt is empty: none)"
        model, tok = load_model_and_tokenizer(run)
        ids = tok.encode(prompt, bos=True) if text else \
            tok.encode_rendered(template_of(tok).render([{"role": "user", "content": prompt}], add_generation_prompt=True))
        room = min(40, model.cfg.seq_len - len(ids))  # what the model's positions leave
        if room <= 0:
            return f"[sample] none: the prompt takes {len(ids)} of the model's {model.cfg.seq_len} positions"
        out = generate_ids(model, ids, room, 0.0, 0, 1.0, DEFAULTS.repetition_penalty, tok.eos, True, 0)
        return f"[sample] {prompt!r} -> {tok.decode(out[len(ids):])!r} (greedy; log.sample_prompt)"
    except Exception as e:  # noqa: BLE001 - the run's outcome stands whatever its sample does
        return f"[sample] none: {type(e).__name__}: {e}"
