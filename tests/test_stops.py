"""A stop at every point of a rollout's life, for GRPO, CISPO, PPO and agents, resumed from the checkpoint it
published, equals the uninterrupted run (sha256 of the final weights and every logged figure): inside the
rollout (a reward call; a tool call, between two turns of an episode), between the rollout and its first
update, between two updates; in the first rollout (which publishes step 0, its optimizer never stepped:
issue 59) and in a later one; on 1 process, and on 2 resumed on 3. The stop is a SIGTERM at a named point
(tests/stop_train.py). One case per objective runs in the e2e tier; the whole grid is the matrix tier's."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import launch
import stop_train
from run.metrics import TIMING

OBJECTIVES = ("grpo", "cispo", "ppo", "agent")
INSIDE = {"grpo": ("reward",), "cispo": ("reward",), "ppo": ("reward",), "agent": ("tool", "turn")}
"""The points inside an objective's rollout (the rollout is abandoned: the checkpoint is the step before it)."""
STEPS = 4
"""Two updates a rollout: rollouts at steps 1 and 3."""

SLOW_TOOL = '''

def slow(tool):
    """The agent tests' tool; under STOP_AT=tool it takes 0.5 s first, so that the stop's signal (0.1 s into the
    call) comes while it runs."""
    def run(args):
        import os
        import time

        if os.environ.get("STOP_AT") == "tool":
            time.sleep(0.5)
        return tool(args)
    return run


double, broken = slow(double), slow(broken)
'''


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> dict:
    import test_agent
    import test_grpo

    root = tmp_path_factory.mktemp("stops")
    prompts = root / "prompts.jsonl"
    lines = [{"prompt": f"Say {w}.", "answer": w} for w in "red blue green cat dog sun moon tree river stone bird fish".split()]
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines * 3))
    (root / "rewards.py").write_text(test_grpo.REWARD)
    data = root / "agent.jsonl"
    agent_lines = [{"messages": [{"role": "user", "content": f"What is {a} + {b}?"}], "tools": test_agent.TOOL_SCHEMAS, "gt": [str(a + b)]}
                   for a, b in [(3, 4), (12, 7), (5, 5), (40, 2), (9, 9), (1, 30)]]
    data.write_text("".join(json.dumps(x) + "\n" for x in agent_lines * 2))
    (root / "agent_tools.py").write_text(test_agent.AGENT_MODULE + SLOW_TOOL)
    return {"root": root, "prompts": (prompts, root / "rewards.py"), "agent": (data, root / "agent_tools.py")}


def arguments(tasks: dict, objective: str, cache: Path) -> list[str]:
    import test_agent
    import test_grpo
    import test_ppo

    if objective == "agent":
        args = test_agent.agent_base(tasks["agent"], cache)
    elif objective == "ppo":
        args = [a for a in test_ppo.ppo_args(tasks["prompts"], cache, Path("unused")) if not a.startswith("out_dir=")]
    else:
        args = [a for a in test_grpo.base(tasks["prompts"], cache) if not a.startswith("train.grpo.loss=")] + [f"train.grpo.loss={objective}"]
    return [a for a in args if not a.startswith("train.steps=")] + [f"train.steps={STEPS}"]


REFERENCES: dict[str, Path] = {}


def reference(tasks: dict, objective: str) -> Path:
    """The uninterrupted 1-process run of `objective`, made once per module."""
    if objective not in REFERENCES:
        out = tasks["root"] / f"uninterrupted-{objective}"
        code, err = launch.in_process(*arguments(tasks, objective, tasks["root"] / "cache"), f"out_dir={out}")
        assert code == 0, err
        REFERENCES[objective] = out
    return REFERENCES[objective]


def figures(out: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in launch.metrics(out)]


def stop_and_resume(tasks: dict, objective: str, point: str, step: int, procs: tuple[int, int], tmp_path: Path, monkeypatch) -> None:
    """Stopped at `point` of step `step` on procs[0] processes (0: in this process), resumed on procs[1] to the end:
    the published step is the one before the rollout (a point inside it) or `step`, and the run ends as the reference."""
    from checkpoint.storage import list_checkpoints

    want = reference(tasks, objective)
    out, fired = tmp_path / "run", tmp_path / "fired"
    args = [*arguments(tasks, objective, tmp_path / "cache"), f"out_dir={out}"]
    env = {"STOP_AT": point, "STOP_STEP": str(step), "STOP_FIRED": str(fired)}
    for k, v in env.items():
        monkeypatch.setenv(k, v)  # the slow tool reads STOP_AT; a launch inherits them
    from objectives.worker import WORKER

    WORKER.kill()  # this process's worker for user code starts again, with them
    if procs[0] == 0:
        with stop_train.armed(point, step):
            code, err = launch.in_process(*args)
        assert code == 75, err
    else:
        launch.run(procs[0], *args, script="tests/stop_train.py", expect=None)
    assert fired.read_text() == point  # for `tool`: the call was still running when the signal came
    status = json.loads((out / "status.json").read_text())
    published = step - 1 if point in INSIDE[objective] else step
    assert status["exit_code"] == 75 and status["step"] == published, status
    assert list_checkpoints(out / "checkpoints")[0][0] == published and launch.lines(out / "metrics.jsonl") == published
    for k in env:
        monkeypatch.delenv(k)
    if procs[1] == 0:
        code, err = launch.in_process(*args)
        assert code == 0, err
    else:
        launch.run(procs[1], *args)
    launch.assert_identical(out, want)
    assert figures(out) == figures(want)


def grid() -> list:
    cases = []
    for objective in OBJECTIVES:
        for point in (*INSIDE[objective], "rollout", "update"):
            for step in (1, 3):
                for procs in ((0, 0), (2, 3)):
                    representative = procs == (0, 0) and step == 1 and point == INSIDE[objective][0]
                    marks = [pytest.mark.e2e] if representative else [pytest.mark.matrix]
                    cases.append(pytest.param(objective, point, step, procs, marks=marks,
                                              id=f"{objective}-{point}-step{step}-{'in-process' if procs == (0, 0) else '2-then-3'}"))
    return cases


HOSTILE = '''
import json
import time


def calls(text):
    """Three calls a turn whatever the text says (issue 59's recipe): a declared tool with an argument from the
    text's characters, an undeclared tool, and one whose arguments are malformed JSON."""
    return [{"name": "double", "arguments": {"x": sum(map(ord, text)) % 4}}, {"name": "nowhere", "arguments": {}},
            {"name": "double", "arguments": "{not json"}]


def double(args):
    """By its argument: raises, returns 10 MiB, sleeps 0.7 s, or returns a string."""
    x = args.get("x", 3)
    if x == 0:
        raise RuntimeError("no")
    if x == 1:
        return {"big": "x" * (10 << 20)}
    if x == 2:
        time.sleep(0.7)
    return "a string"


def episode(prompt, completion, turns=(), transcript=(), **fields):
    return sum(map(ord, "".join(turns))) % 97 / 97 + len(json.dumps(transcript)) % 13 / 13
'''


@pytest.mark.e2e
def test_issue_59s_agent_stopped_inside_a_tool_call_of_its_first_rollout_resumes_from_step_0_to_the_uninterrupted_run(
        tasks, tmp_path, monkeypatch):
    """The issue's recipe: a parser that calls three tools a turn (one declared, with a result that raises, is 10 MiB,
    takes 0.7 s or is a string; one undeclared; one with malformed arguments), max_turns 2, SIGTERM inside a tool call of
    step 1's rollout: step 0 published, exit 75, and the resumed run is the uninterrupted one (it differed from step 2)."""
    from objectives.worker import WORKER

    module = tmp_path / "hostile.py"
    module.write_text(HOSTILE)
    args = [a for a in arguments(tasks, "agent", tmp_path / "cache") if not a.startswith(("train.agent.", "train.grpo.reward="))]
    args += [f"train.agent.tools={module}:double", f"train.agent.parser={module}:calls", f"train.grpo.reward={module}:episode",
             "train.agent.max_turns=2"]
    data = tmp_path / "agent.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Double {k}."}], "gt": [str(2 * k)], "tools": [
        {"type": "function", "function": {"name": "double", "description": "double", "parameters": {"type": "object", "properties": {
            "x": {"type": "integer"}}}}}]}) + "\n" for k in range(12)))
    args = [f"data.path={data}" if a.startswith("data.path=") else a for a in args]
    assert launch.in_process(*args, f"out_dir={tmp_path / 'one'}")[0] == 0
    WORKER.kill()
    with stop_train.armed("tool", 1):
        code, err = launch.in_process(*args, f"out_dir={tmp_path / 'run'}")
    assert code == 75 and stop_train.FIRED[-1] in ("tool", "tool (the call had returned)"), err
    assert json.loads((tmp_path / "run" / "status.json").read_text())["step"] == 0
    assert launch.in_process(*args, f"out_dir={tmp_path / 'run'}")[0] == 0
    launch.assert_identical(tmp_path / "run", tmp_path / "one")
    assert figures(tmp_path / "run") == figures(tmp_path / "one")
    assert any(r["agent/tool_calls"] == 3 * r["agent/turns"] for r in figures(tmp_path / "one"))


@pytest.mark.parametrize("objective, point, step, procs", grid())
def test_a_stop_at_any_point_of_a_rollouts_life_resumes_to_the_uninterrupted_run(tasks, objective, point, step, procs, tmp_path,
                                                                                   monkeypatch):
    stop_and_resume(tasks, objective, point, step, procs, tmp_path, monkeypatch)
