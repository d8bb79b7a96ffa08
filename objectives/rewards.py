"""Rewards for reinforcement learning, as pure functions of (prompt, completion, the line's fields)
(docs/rl.md): the built-in verifiable and rule rewards, and a user's own `module:function`, whose
file's sha256 a checkpoint records (a changed one is refused on resume). Every call is bounded by
train.grpo.reward_timeout_s; a reward that gives another value for the same completion is refused."""
from __future__ import annotations

import math
import re
from typing import Callable

from common.outcome import BadInput, Failed

from .worker import Late, Remote, described

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def final_answer(completion: str) -> str:
    """The answer part of a completion: after its last `</think>`, stripped."""
    return completion.rsplit("</think>", 1)[-1].strip()


def answer(prompt: str, completion: str, answer: str | None = None, **fields) -> float:
    """Exact-answer match: 1.0 when the completion's answer (after `</think>`, stripped, a trailing
    period dropped) is the line's `answer`, else 0."""
    if answer is None:
        raise ValueError("the reward 'answer' needs an \"answer\" field on every prompt line")
    return 1.0 if final_answer(completion).rstrip(".").strip() == str(answer).strip() else 0.0


def answer_partial(prompt: str, completion: str, answer: str | None = None, **fields) -> float:
    """`answer` with partial credit, for a small model that does not write numbers yet (the
    built-in task's recipe): 1.0 for the exact answer, 0.5 when the answer is among the numbers in
    the completion, 0.1 when the completion holds a digit at all, else 0."""
    exact = globals()["answer"](prompt, completion, answer, **fields)
    if exact:
        return exact
    if str(answer).strip() in _NUMBER.findall(completion):
        return 0.5
    return 0.1 if any(c.isdigit() for c in completion) else 0.0


def rep_penalty(text: str, n: int = 3, cap: float = 0.5) -> float:
    """MiniMind's trigram repetition penalty: the share of repeated word trigrams, scaled, capped."""
    toks = re.findall(r"\w+|[^\w\s]", text.lower())
    grams = [tuple(toks[i:i + n]) for i in range(len(toks) - n + 1)]
    return min(cap, (len(grams) - len(set(grams))) * cap * 2 / len(grams)) if grams else 0.0


def minimind_rules(prompt: str, completion: str, **fields) -> float:
    """MiniMind's rule rewards (trainer/train_grpo.py, without its reward model): +0.5 for a
    completion of 20 to 800 characters (else -0.5); with a `</think>`, +1.0 for 20 to 300
    characters of thinking (else -0.5) and +0.25 for exactly one closing tag (else -0.25); minus
    the answer's trigram repetition penalty."""
    reward = 0.5 if 20 <= len(completion.strip()) <= 800 else -0.5
    final = completion
    if "</think>" in completion:
        thinking, final = completion.split("</think>", 1)
        reward += 1.0 if 20 <= len(thinking.strip()) <= 300 else -0.5
        reward += 0.25 if completion.count("</think>") == 1 else -0.25
        final = final.strip()
    return reward - rep_penalty(final)


BUILTIN = {"answer": answer, "answer_partial": answer_partial, "minimind_rules": minimind_rules}


def load(spec: str, key: str = "train.grpo.reward", builtin: dict | None = None) -> tuple[Callable, dict]:
    """train.grpo.reward: a built-in name, or `module:function` / `path/to/file.py:function` (a
    user's, imported once). Returns (the function, its record: spec and, for a user's, its file's
    sha256; its function runs in this rank's worker process, objectives/worker.py). BadInput naming the key when
    it cannot be imported or is not a function. `key` and `builtin`:
    another setting's name and built-ins (train.agent.tools: objectives/tools.py)."""
    builtin = BUILTIN if builtin is None else builtin
    if spec in builtin:
        return builtin[spec], {"spec": spec}
    if ":" not in spec:
        what = "reward" if key == "train.grpo.reward" else "one"
        raise BadInput(f"{key}: {spec!r} is neither a built-in {what} ({', '.join(builtin)}) nor module:function")
    from .worker import WORKER

    return WORKER.load(spec, key)  # the user's code runs in this rank's worker process, every call bounded


def score(fn: Callable, prompt: str, completion: str, fields: dict, index: int, where: str, timeout_s: float = 30.0) -> float:
    """`fn`'s reward for one completion, a finite float; Failed naming the prompt when it raises, returns
    another, or does not return within `timeout_s` seconds (train.grpo.reward_timeout_s: a user's reward runs
    in the worker process, killed then, objectives/worker.py; a built-in is ours, bounded)."""
    kwargs = {k: v for k, v in fields.items() if k not in ("prompt", "line")}
    try:
        value = fn.call((prompt, completion), kwargs, timeout_s) if isinstance(fn, Remote) else fn(prompt, completion, **kwargs)
    except Late:
        raise Failed(f"train.grpo.reward did not return within train.grpo.reward_timeout_s={timeout_s:g} s on prompt {index} "
                     f"({where})") from None
    except Exception as e:  # noqa: BLE001 - the user's code: its failure ends the run, named
        raise Failed(f"train.grpo.reward raised on prompt {index} ({where}): {described(e)}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise Failed(f"train.grpo.reward returned {value!r} for prompt {index} ({where}): expected a finite number")
    return float(value)


def check_pure(spec: str, first: float, again: float, index: int, where: str) -> None:
    """The same completion scored twice (one a rollout on each rank): BadInput naming the reward when the
    two values differ (it draws from a generator, reads the clock or keeps state), which a resume could
    not reproduce."""
    if first != again:
        raise BadInput(f"train.grpo.reward={spec} gave {first!r}, then {again!r} for the same completion of prompt {index} "
                       f"({where}): a reward must be a pure function of (prompt, completion, fields), or a resumed run "
                       f"scores otherwise than the uninterrupted one (docs/rl.md)")
