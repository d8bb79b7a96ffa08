"""Agentic RL with tools (data/agent.py, objectives/tools.py, objectives/agent.py, docs/rl.md): MiniMind's
agent lines rendered as transformers renders them, its mock tools, tool-call parsing and agent reward
against MiniMind's own code, tools pinned and bounded, multi-turn rollouts resumed exactly on any
world size, bad input named."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

import launch
from conftest import needs_referee
from test_tokenizers import MINIMIND, needs_minimind

UPSTREAM = MINIMIND.parent / "upstream" / "trainer" / "train_agent.py"
needs_upstream = needs_referee(UPSTREAM, "MiniMind's train_agent.py")


def minimind_agent_module(scratch: Path):
    """MiniMind's tools and rewards (train_agent.py from its first line of code to the end of its
    "工具与 Reward" section) copied into `scratch` and imported there: the referee, never in the repository.
    Its heavy imports (datasets, transformers, its model and trainer) are left out: the section uses none."""
    import importlib.util

    source = UPSTREAM.read_text(encoding="utf-8")
    start, end = source.index("# ================================ 工具与 Reward = Start"), source.index("# ================================ 工具与 Reward = End")
    head = "import re, json, math, random, signal\nimport torch\n"
    path = scratch / "minimind_train_agent_tools.py"
    path.write_text(head + source[start:end], encoding="utf-8")
    spec = importlib.util.spec_from_file_location("minimind_train_agent_tools", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def agent_lines() -> list[dict]:
    """Agent lines in both forms: MiniMind's (conversations, the system turn's tools as a JSON string, an empty
    last assistant turn) and messages/tools/gt, one tool or several, Chinese and English."""
    from data.agent import TOOLS

    out = []
    for k, (q, gt, tools) in enumerate([("What is 12 * 7?", ["84"], TOOLS[:1]), ("北京天气怎么样？", ["28°C"], TOOLS[2:3]),
                                        ("Convert 10 km to miles, then the time in Tokyo.", ["6.2137", "15:30"], TOOLS),
                                        ("100 USD in CNY?", ["721"], TOOLS[4:5] + TOOLS[:1])]):
        if k % 2:
            out.append({"conversations": [{"role": "system", "content": "你是助手。", "tools": json.dumps(tools, ensure_ascii=False)},
                                          {"role": "user", "content": q}, {"role": "assistant", "content": ""}], "gt": gt})
        else:
            out.append({"messages": [{"role": "user", "content": q}], "tools": tools, "gt": gt})
    return out


@needs_minimind
@pytest.mark.unit
def test_agent_lines_render_as_transformers_apply_chat_template_with_their_tools_and_the_generation_prompt(tmp_path):
    from transformers import PreTrainedTokenizerFast

    from data import tokenizer
    from data.agent import parse_agent
    from data.chat import template_of

    tok = tokenizer.load(str(MINIMIND))
    hf = PreTrainedTokenizerFast.from_pretrained(str(MINIMIND.parent))
    template = template_of(tok)
    for k, line in enumerate(agent_lines()):
        messages, tools, fields = parse_agent(tmp_path / "a.jsonl", k + 1, json.dumps(line, ensure_ascii=False).encode())
        want = hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        assert "<tools>" in want and template.render(messages, tools, add_generation_prompt=True) == want
        assert tok.encode_rendered(want) == hf(want, add_special_tokens=False)["input_ids"]
        assert fields["gt"] == line["gt"] and fields["tools"] == tools and fields["messages"] == messages


# Transcripts (each a list of the model's turns, whether it ran out of turns, the ground truth, the line's tools)
# on which MiniMind's reward and ours are compared: every branch of calculate_rewards.
def transcripts() -> list[tuple[list[str], bool, list, list]]:
    from data.agent import TOOLS

    call = lambda name, **a: f'<tool_call>\n{json.dumps({"name": name, "arguments": a}, ensure_ascii=False)}\n</tool_call>'  # noqa: E731
    return [
        ([call("calculate_math", expression="12*7"), "The answer is 84."], False, ["84"], TOOLS[:1]),
        ([call("calculate_math", expression="12*7"), "It is 85."], False, ["84"], TOOLS[:1]),
        ([call("calculate_math", expression="12*7") + call("calculate_math", expression="1+1"), "84 and 2"], False, ["84"], TOOLS[:1]),
        (['<tool_call>{"name": "calculate_math", "arguments": "{\\"expression\\": \\"3+4\\"}"}</tool_call>', "7"], False, ["7"], TOOLS),
        (['<tool_call>{"name": "calculate_math", "arguments": "not json"}</tool_call>', "7"], False, ["7"], TOOLS),
        (["<tool_call>{broken json</tool_call> and <tool_call>", "done"], False, ["1"], TOOLS),
        ([call("get_current_weather", location="北京")] * 3, True, ["28°C"], TOOLS),
        ([call("get_current_weather", location="北京"), "北京 28°C，晴。"], False, ["28°C"], TOOLS[2:3]),
        ([call("no_such_tool", x=1), "ok ok ok ok ok ok ok ok"], False, ["ok"], TOOLS),
        ([call("unit_converter", value=10, from_unit="km", to_unit="miles"), call("get_current_time", timezone="Asia/Tokyo"),
          "6.2137 miles, 2025-03-07 15:30:00"], False, ["6.2137", "15:30"], TOOLS),
        (["<think>\nI should just answer this one directly.\n</think>\n\nIt is 84."], False, ["84"], TOOLS[:1]),
        (["<think>short</think>84</think>"], False, ["84"], TOOLS[:1]),
        (["84"], False, ["84"], TOOLS[:1]),
        (["the the the the the the the the the the the the"], False, [], None),
        (["<think>\nLet me call the calculator for this.\n</think>\n\n" + call("calculate_math", expression="2^10"), "1,024"], False,
         ["1024"], TOOLS[:1]),
        ([call("get_exchange_rate", from_currency="USD", to_currency="CNY"), "100 USD = 721 CNY"], False, [721], TOOLS),
        ([""], False, ["84"], TOOLS[:1]),
    ]


@needs_upstream
@pytest.mark.unit
def test_parsed_calls_and_rewards_equal_minimind_train_agent_on_the_same_transcripts(tmp_path):
    from objectives import tools

    theirs = minimind_agent_module(tmp_path)
    cases = transcripts()
    for turns, unfinished, gt, line_tools in cases:
        for turn in turns:
            assert tools.parse_tool_calls(turn) == theirs.parse_tool_calls(turn)
        want = theirs.calculate_rewards(["p"], [turns[-1]], [gt], [line_tools], 1, None, "cpu", [turns], [unfinished])
        got = tools.minimind_agent("p", turns[-1], gt=gt, tools=line_tools, turns=turns, unfinished=unfinished)
        assert torch.tensor([got], dtype=torch.float32).item() == want[0].item(), (turns, got, want)
    assert len({tools.minimind_agent("p", t[-1], gt=g, tools=x, turns=t, unfinished=u) for t, u, g, x in cases}) >= 8  # branches


@needs_upstream
@pytest.mark.unit
def test_the_six_mock_tools_answer_as_minimind_s_and_a_raising_or_unknown_tool_reads_its_error_message(tmp_path):
    from objectives.tools import BUILTIN, ERROR, Toolbox

    theirs = minimind_agent_module(tmp_path)
    assert set(BUILTIN) == set(theirs.MOCK_RESULTS) == {t["function"]["name"] for t in theirs.TOOLS}
    from data.agent import TOOLS

    assert TOOLS == theirs.TOOLS
    box = Toolbox(list(BUILTIN), 5.0)
    calls = [("calculate_math", {"expression": "2^10 + (3×4) − 1"}), ("calculate_math", {"expression": "math.sqrt(16)"}),
             ("calculate_math", {"expression": "1/0"}), ("calculate_math", {"expression": "__import__('os')"}),
             ("calculate_math", {}), ("unit_converter", {"value": 10, "from_unit": "KM", "to_unit": "miles"}),
             ("unit_converter", {"value": "x", "from_unit": "km", "to_unit": "miles"}), ("unit_converter", {"value": 3, "from_unit": "a", "to_unit": "b"}),
             ("get_current_weather", {"location": "北京"}), ("get_current_weather", {"location": "Mars"}),
             ("get_current_time", {}), ("get_current_time", {"timezone": "Europe/Paris"}),
             ("get_exchange_rate", {"from_currency": "USD", "to_currency": "CNY"}), ("get_exchange_rate", {"from_currency": "X"}),
             ("translate_text", {"text": "你好世界", "target_language": "english"}), ("translate_text", {"text": ""}),
             ("no_such_tool", {"a": 1}), ("calculate_math", ["not", "a", "dict"])]
    errors = 0
    for name, args in calls:
        want = theirs.execute_tool(name, args)
        want = (json.dumps(want, ensure_ascii=False) if want else ERROR)[:2048]
        got, ok = box.run({"name": name, "arguments": args})
        assert got == want and ok == (got != ERROR), (name, args, got, want)
        errors += got == ERROR
    assert 3 <= errors < len(calls) - 8


@pytest.mark.unit
def test_calculate_math_evaluates_arithmetic_as_python_does_and_gives_minimind_s_error_for_anything_else_or_too_large():
    """Its text is the model's: `eval` with empty builtins reached every class in the process and
    `7^10^7` ran past the tool's timeout on every relaunch (issue 59). Bounded arithmetic answers at once."""
    import math

    from objectives.tools import ERROR, Toolbox

    box = Toolbox(["calculate_math"], 5.0)  # an unbounded evaluation fails the test at this timeout (Failed)
    for expr in ("27 + 82", "2^10 + (3×4) − 1", "-2**2", "2**-1", "7 // 2 % 3", "1e308 * 10", "math.sqrt(16) + math.pi",
                 "math.factorial(20)", "math.log(8, 2)", "0.1 + 0.2", "(2**100) * -3", "（1+2）÷4"):
        python = expr.replace("^", "**").replace("×", "*").replace("÷", "/").replace("−", "-").replace("（", "(").replace("）", ")")
        want = json.dumps({"result": str(eval(python, {"__builtins__": {}, "math": math}))})  # noqa: S307 - trusted text
        assert box.run({"name": "calculate_math", "arguments": {"expression": expr}}) == (want, True), expr
    for expr in ("().__class__.__base__.__subclasses__()", "7^10^7", "10**10**10", "2**(10**100)", "math.factorial(10**6)",
                 "(2**14000) * (2**14000)", "__import__('os').system('true')", "math.__dict__", "[1] * 3", "'a' * 3", "1 < 2",
                 "abc", "1j", "True", "math.sqrt(x=1)", "lambda: 1", "1/0", "(" * 300 + "1" + ")" * 300, "-" * 100000 + "1"):
        assert box.run({"name": "calculate_math", "arguments": {"expression": expr}}) == (ERROR, False), expr[:60]


TOOL_MODULE = '''
def double(args):
    return {"value": 2 * args["x"]}


def raises(args):
    raise RuntimeError("broken")


def sleeps(args):
    import time

    end = time.monotonic() + 5
    while time.monotonic() < end:  # a tool that swallows what it can: the timeout still ends it at 0.5 s
        try:
            time.sleep(0.1)
        except Exception:
            pass
    return {"late": True}
'''


@pytest.mark.e2e  # a user's tool runs in the worker process (objectives/worker.py)
def test_a_users_tool_is_pinned_by_its_file_hash_a_raising_one_reads_the_error_and_a_slow_one_fails_at_its_timeout(tmp_path):
    import hashlib

    from common.outcome import BadInput, Failed
    from objectives.tools import ERROR, Toolbox

    module = tmp_path / "my_tools.py"
    module.write_text(TOOL_MODULE)
    box = Toolbox([f"{module}:double", f"{module}:raises", f"{module}:sleeps", "calculate_math"], 0.5)
    assert [r["name"] for r in box.records] == ["double", "raises", "sleeps", "calculate_math"]
    assert box.records[0]["sha256"] == hashlib.sha256(module.read_bytes()).hexdigest() and "sha256" not in box.records[3]
    assert box.run({"name": "double", "arguments": {"x": 21}}) == ('{"value": 42}', True)
    assert box.run({"name": "raises", "arguments": {}}) == (ERROR, False)
    assert box.run({"name": "double", "arguments": '{"x": 1}'}) == ('{"value": 2}', True)  # arguments as a JSON string
    with pytest.raises(Failed, match=r"train.agent.tools: sleeps did not return within train.agent.tool_timeout_s=0.5 s"):
        box.run({"name": "sleeps", "arguments": {}})
    with pytest.raises(BadInput, match=r"train.agent.tools: no_such_module_xyz does not import"):
        Toolbox(["no_such_module_xyz:f"], 1.0)
    with pytest.raises(BadInput, match=r"train.agent.tools: 'calculator' is neither a built-in one"):
        Toolbox(["calculator"], 1.0)
    with pytest.raises(BadInput, match=r"x.jsonl:3: the tool 'get_current_weather' has no implementation in train.agent.tools"):
        box.check([{"type": "function", "function": {"name": "get_current_weather"}}], "x.jsonl:3")


@pytest.mark.unit
def test_calculate_math_bounds_math_lcm_at_each_argument_and_a_call_nested_past_the_recursion_limit_is_not_a_call():
    """Found by review: the bound was checked on math.lcm's result only, so 200 coprime 14,000-bit arguments
    took 24 s inside the trainer (a built-in has no timeout) and 1,000 minutes; JSON nested past the recursion
    limit raised RecursionError out of the parse (MiniMind's bare except skips it), a traceback in the trainer
    and in the server. The alarm below only stops a hang (CPython checks signals inside a long division): it is
    not a timing."""
    import signal

    from objectives.tools import ERROR, Toolbox, name_and_args, parse_tool_calls

    class Hung(BaseException):  # not an Exception: the tool's `except Exception` would answer with the error
        pass

    def hung(*_):
        raise Hung("math.lcm ran unbounded")

    box = Toolbox(["calculate_math"], 5.0)
    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    try:
        many = "math.lcm(" + ",".join(f"2**14000+{i}" for i in range(1, 2000, 2)) + ")"
        assert box.run({"name": "calculate_math", "arguments": {"expression": many}}) == (ERROR, False)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert box.run({"name": "calculate_math", "arguments": {"expression": "math.lcm(4, 6, 10)"}}) == ('{"result": "60"}', True)
    deep = "[" * 100_000
    assert parse_tool_calls(f"<tool_call>{deep}</tool_call><tool_call>{{\"name\": \"a\"}}</tool_call>") == [{"name": "a"}]
    assert name_and_args({"name": "calculate_math", "arguments": deep}) == ("calculate_math", {})
    assert box.run({"name": "calculate_math", "arguments": deep}) == ('{"result": "0"}', True)  # MiniMind's default expression


SOCKET_TOOLS = '''
import os
import subprocess
import sys
import time


def double(args):
    return {"value": 2 * args["x"]}


def garbles(args):
    """Writes a length that promises more bytes than ever come to the worker's socket (its descriptor: argv[1])."""
    os.write(int(sys.argv[1]), b"\\x00\\x00\\x00\\x7fgarbage!")
    return {"ok": True}


def forges(args):
    """Writes a well-formed reply of its own, numbered as no call is, before the worker's."""
    import pickle
    import struct

    data = pickle.dumps((0, "value", ("json", '{"forged": true}')))
    os.write(int(sys.argv[1]), struct.pack("!Q", len(data)) + data)
    return {"ok": True}


def forks(args):
    """A child that returns into the worker's loop: only one of the two may reply."""
    return {"child": os.fork() == 0}


def starts_a_child(args):
    """A child that would outlive the kill at the timeout (it inherits the ignored SIGTERM)."""
    child = subprocess.Popen(["sleep", "300"])
    with open(args["pid_file"], "w") as f:
        f.write(str(child.pid))
    time.sleep(300)


def closes(args):
    os.close(int(sys.argv[1]))
    return {"ok": True}
'''


@pytest.mark.e2e  # a user's tool runs in the worker process (objectives/worker.py)
def test_a_tool_that_writes_to_the_workers_socket_forks_or_starts_a_child_is_bounded_answers_its_own_call_and_leaves_nothing(
        tmp_path, capfd):
    """Found by review: bytes a tool wrote to the socket hung the trainer forever past the timeout (a length
    read as 2 GB, waited for); a fork that returned into the worker's loop replied twice and every later call
    read the call before's result (so did a reply a tool wrote itself); a child the tool started survived the
    kill; a tool that closed the socket
    left the worker's traceback on the run's stderr."""
    import os
    import signal
    import time

    from common.outcome import Failed
    from objectives.tools import ERROR, Toolbox

    class Hung(BaseException):  # not an Exception: the tool's `except Exception` would answer with the error
        pass

    def hung(*_):
        raise Hung("the call was not bounded by its timeout")

    module = tmp_path / "socket_tools.py"
    module.write_text(SOCKET_TOOLS)
    box = Toolbox([f"{module}:{n}" for n in ("double", "garbles", "forges", "forks", "starts_a_child", "closes")], 1.0)
    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    try:
        with pytest.raises(Failed, match=r"garbles did not return within train.agent.tool_timeout_s=1 s"):
            box.run({"name": "garbles", "arguments": {}})
        assert box.run({"name": "forges", "arguments": {}}) == (ERROR, False)  # the process killed, as one that died
        assert box.run({"name": "forks", "arguments": {}}) == ('{"child": false}', True)
        assert [box.run({"name": "double", "arguments": {"x": x}}) for x in (1, 2, 3)] == [
            ('{"value": 2}', True), ('{"value": 4}', True), ('{"value": 6}', True)]
        pid_file = tmp_path / "child.pid"
        with pytest.raises(Failed, match=r"starts_a_child did not return"):
            box.run({"name": "starts_a_child", "arguments": {"pid_file": str(pid_file)}})
        child = int(pid_file.read_text())
        for _ in range(100):  # killed with the worker's group; reaped by init
            if not Path(f"/proc/{child}").exists():
                break
            time.sleep(0.05)
        else:
            os.kill(child, signal.SIGKILL)
            raise AssertionError("the tool's child outlived the kill at the timeout")
        assert box.run({"name": "closes", "arguments": {}}) == (ERROR, False)
        assert box.run({"name": "double", "arguments": {"x": 5}}) == ('{"value": 10}', True)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert "Traceback" not in capfd.readouterr().err


PICKLING_TOOLS = '''
import os
import pickle
import struct
import sys


class Touch:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):  # unpickling this runs Path(path).touch() wherever it is loaded
        from pathlib import Path
        return (Path.touch, (Path(self.path),))


def smuggles(args):
    """Writes a reply whose unpickling would run code in the trainer, before the worker's own reply."""
    data = pickle.dumps((1, "value", Touch(args["marker"])))
    os.write(int(sys.argv[1]), struct.pack("!Q", len(data)) + data)
    return {"ok": True}


def environment(args):
    return {name: os.environ.get(name) for name in ("MINIMIND_CHECKPOINT_KEY", "MINIMIND_SERVE_API_KEY", "HOME")}
'''


@pytest.mark.e2e  # a user's tool runs in the worker process (objectives/worker.py)
def test_a_reply_that_would_run_code_in_the_trainer_does_not_and_the_worker_never_sees_the_keys(tmp_path, monkeypatch):
    """Found by review: the trainer unpickled whatever came back on the socket, so bytes a tool wrote there ran
    code in the trainer (outside the worker's timeout and kill); and the worker inherited the checkpoint and
    server keys. A reply crosses as plain values only (numpy's too), and the worker starts without the keys."""
    from objectives.tools import ERROR, Toolbox
    from objectives.worker import WORKER

    monkeypatch.setenv("MINIMIND_CHECKPOINT_KEY", "sekret-checkpoint-key")
    monkeypatch.setenv("MINIMIND_SERVE_API_KEY", "sekret-api-key")
    WORKER.kill()  # started again, with this environment
    module = tmp_path / "pickling_tools.py"
    module.write_text(PICKLING_TOOLS)
    marker = tmp_path / "ran-in-the-trainer"
    box = Toolbox([f"{module}:{n}" for n in ("smuggles", "environment")], 5.0)
    assert box.run({"name": "smuggles", "arguments": {"marker": str(marker)}}) == (ERROR, False)
    assert not marker.exists()
    text, ok = box.run({"name": "environment", "arguments": {}})
    assert ok and json.loads(text) == {"MINIMIND_CHECKPOINT_KEY": None, "MINIMIND_SERVE_API_KEY": None,
                                       "HOME": os.environ.get("HOME")}


@pytest.mark.e2e  # a user's tool runs in the worker process (objectives/worker.py)
def test_a_tool_file_changed_under_the_run_fails_it_at_the_workers_restart_naming_it_instead_of_running_other_code(tmp_path):
    """Found by review: the process started again after a kill imported the file as it was then, so a tool
    edited mid-run answered with its new code under the run's pin (a resume refuses that very file), and a file
    that no longer imported made every later call read the error message, the worker's traceback on stderr."""
    from common.outcome import Failed
    from objectives.tools import Toolbox

    module = tmp_path / "changing.py"
    module.write_text("import time\n\ndef v(args):\n    return {'v': 1}\n\ndef slow(args):\n    time.sleep(30)\n")
    box = Toolbox([f"{module}:v", f"{module}:slow"], 0.5)
    assert box.run({"name": "v", "arguments": {}}) == ('{"v": 1}', True)
    for text, why in (("def v(args):\n    return {'v': 2}\n\ndef slow(args):\n    pass\n", r"its sha256 is now [0-9a-f]{16}\.\.\., not"),
                      ("raise SystemExit('gone')\n", r"does not import \(SystemExit: gone\)")):
        with pytest.raises(Failed, match="slow did not return"):
            box.run({"name": "slow", "arguments": {}})  # its process killed: the next call starts another
        module.write_text(text)
        with pytest.raises(Failed, match=rf"train.agent.tools: {module}:v changed under the run \(.*{why}"):
            box.run({"name": "v", "arguments": {}})
        module.write_text("import time\n\ndef v(args):\n    return {'v': 1}\n\ndef slow(args):\n    time.sleep(30)\n")
        assert box.run({"name": "v", "arguments": {}}) == ('{"v": 1}', True)  # the pinned bytes back: it answers again


@pytest.mark.unit
def test_a_malformed_tool_schema_or_gt_is_refused_naming_the_line(tmp_path):
    from data.agent import parse_agent
    from data.sources import DataError

    path = tmp_path / "a.jsonl"
    user = [{"role": "user", "content": "hi"}]
    cases = [({"messages": user, "tools": [{"type": "function", "function": {"description": "no name"}}], "gt": ["1"]},
              "a.jsonl:1: tools[0] is a malformed tool schema: function.name"),
             ({"messages": user, "tools": [{"name": "f"}], "gt": ["1"]}, 'tools[0] is a malformed tool schema: expected {"type": "function"'),
             ({"messages": user, "tools": [{"type": "function", "function": {"name": "f", "parameters": []}}], "gt": []},
              "function.parameters must be a JSON schema"),
             ({"messages": user, "tools": [], "gt": []}, "tools must be a non-empty list"),
             ({"messages": user, "tools": "{not json", "gt": []}, '"tools" is a string that is not JSON'),
             ({"messages": user, "tools": [{"type": "function", "function": {"name": "f"}}], "gt": {"a": 1}}, '"gt" must be a list'),
             ({"messages": user}, 'and "gt"')]
    for line, expected in cases:
        with pytest.raises(DataError, match=re.escape(expected)):
            parse_agent(path, 1, json.dumps(line).encode())


# The e2e task's tools, parser and reward: a tiny model from its seeded init never writes MiniMind's
# <tool_call> JSON, so the parser calls a tool on a pure function of the turn's text (2 turns in 3 call one,
# one of them a tool that raises), and the reward reads the whole transcript: episodes of 1 to 3 turns.
AGENT_MODULE = '''
def double(args):
    return {"value": 2 * int(args["x"])}


def broken(args):
    raise RuntimeError("broken")


def calls(text):
    k = sum(map(ord, text)) % 3
    return [] if k == 0 else [{"name": "double" if k == 1 else "broken", "arguments": {"x": len(text)}}]


def episode(prompt, completion, turns=(), unfinished=False, transcript=(), gt=(), **fields):
    letters = [c for c in completion.lower() if c.isalpha()]
    tools = [m for m in transcript if m["role"] == "tool"]
    return len(turns) - unfinished + sum("value" in m["content"] for m in tools) / 2 + (sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0)
'''


@pytest.fixture(scope="module")
def agent_task(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("agent")
    lines = [{"messages": [{"role": "user", "content": f"What is {a} + {b}?"}], "tools": TOOL_SCHEMAS, "gt": [str(a + b)]}
             for a, b in [(3, 4), (12, 7), (5, 5), (40, 2), (9, 9), (1, 30)]]
    lines.append({"conversations": [{"role": "system", "content": "Be brief.", "tools": json.dumps(TOOL_SCHEMAS)},
                                    {"role": "user", "content": "Double 21."}, {"role": "assistant", "content": ""}], "gt": ["42"]})
    data = root / "agent.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in lines * 2))
    (root / "agent_tools.py").write_text(AGENT_MODULE)
    return data, root / "agent_tools.py"


TOOL_SCHEMAS = [{"type": "function", "function": {"name": n, "description": n, "parameters": {"type": "object", "properties": {
    "x": {"type": "integer"}}}}} for n in ("double", "broken")]


def agent_base(task, cache: Path) -> list[str]:
    data, module = task
    # 6 prompts a step (12 episodes), one prompt a micro-batch: M = 6 splits over 1, 2 and 3 processes
    return [f"data.path={data}", "data.format=agent", "train.objective=grpo", f"data.cache_dir={cache}",
            "model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.seq_len=112",
            "train.global_batch=12", "train.micro_batch=2", "train.steps=6", "train.warmup_steps=1", "train.lr=3e-3",
            "train.grpo.generations=2", "train.grpo.max_new_tokens=6", "train.grpo.updates_per_rollout=2",
            f"train.grpo.reward={module}:episode", "train.grpo.loss=grpo", f"train.agent.tools={module}:double,{module}:broken",
            f"train.agent.parser={module}:calls", "train.agent.max_turns=3", "dist.reduce=canonical", "checkpoint.interval=0",
            "checkpoint.keep=10", "log.progress=false", "runtime.threads=1"]


AGENT_FIGURES = ("reward/mean", "reward/std", "kl", "completion_length", "clip_fraction", "zero_advantage_groups", "agent/turns",
                 "agent/tool_calls", "agent/tool_success", "agent/unfinished", "loss")


@pytest.fixture(scope="module")
def agent_uninterrupted(tmp_path_factory, agent_task):
    root = tmp_path_factory.mktemp("agent-runs")
    code, err = launch.in_process(*agent_base(agent_task, root / "cache"), f"out_dir={root / 'one'}")
    assert code == 0, err
    return root


@pytest.mark.e2e
def test_agent_halted_inside_a_rollouts_updates_on_2_resumed_on_3_then_on_1_equals_the_uninterrupted_run(agent_uninterrupted,
                                                                                                          agent_task, tmp_path):
    """Episodes of 1 to 3 turns with tool results in their ids: halted after step 3 (its rollout under update, in the
    checkpoint) on 2 processes, resumed on 3 to step 5, then on 1: the same weights and every logged figure."""
    args = [*agent_base(agent_task, tmp_path / "cache"), f"out_dir={tmp_path / 'moved'}"]
    launch.run(2, *args, "train.halt_at=3")
    launch.run(3, *args, "train.halt_at=5")
    assert launch.in_process(*args)[0] == 0
    launch.assert_identical(tmp_path / "moved", agent_uninterrupted / "one")
    got, want = launch.metrics(tmp_path / "moved"), launch.metrics(agent_uninterrupted / "one")
    for key in AGENT_FIGURES:
        assert [r[key] for r in got] == [r[key] for r in want], key
    turns = [r["agent/turns"] for r in want]
    assert 1 < min(turns) and max(turns) < 3 and all(0 < r["agent/tool_success"] < 1 for r in want), want  # multi-turn, both tools
    assert any(r["agent/unfinished"] > 0 for r in want) and len({r["reward/mean"] for r in want}) > 1
    assert [r["reward/mean"] for r in want][0::2] == [r["reward/mean"] for r in want][1::2]  # two updates, one rollout
    manifest = launch.storage_manifest(agent_uninterrupted / "one", 6)
    assert [t["name"] for t in manifest["reward"]["tools"]] == ["double", "broken"] and len(manifest["reward"]["parser"]["sha256"]) == 64


HOSTILE_TOOLS = '''

def hangs_in_c(args):
    """Minutes inside one call into C: no signal handler runs in its process until it returns."""
    return {"n": sum(range(10 ** 12))}


def writes(args):
    """A side effect the trainer cannot see (docs/rl.md: outside the guarantee), then a value."""
    import os

    with open(os.environ["TOOL_LOG"], "a") as f:
        f.write("called\\n")
    return {"ok": True}


def call_it(text):
    import os

    return [{"name": os.environ["TOOL_TO_CALL"], "arguments": {}}]
'''


@pytest.mark.e2e
def test_a_tool_that_hangs_inside_c_is_killed_at_its_timeout_and_the_run_exits_1_naming_it(agent_task, tmp_path):
    """The old in-process bound (SIGALRM) could not stop a call that never returns to the interpreter: the run
    hung. In the worker process it is killed at train.agent.tool_timeout_s, the run fails as documented (exit 1,
    naming the tool), and nothing is left running (a live worker would hold the launch's output open)."""
    data, module = agent_task
    tools = tmp_path / "hostile.py"
    tools.write_text(AGENT_MODULE + HOSTILE_TOOLS)
    args = [a for a in agent_base(agent_task, tmp_path / "cache") if not a.startswith(("train.agent.", "train.grpo.reward="))]
    args += [f"train.agent.tools={tools}:double,{tools}:broken,{tools}:hangs_in_c,{tools}:writes", f"train.agent.parser={tools}:call_it",
             f"train.grpo.reward={tools}:episode", "train.agent.tool_timeout_s=1", "train.steps=1", f"out_dir={tmp_path / 'run'}"]
    proc = launch.run(0, *args, expect=1, timeout=120, env={"TOOL_TO_CALL": "hangs_in_c"})
    assert "train.agent.tools: hangs_in_c did not return within train.agent.tool_timeout_s=1 s" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    log = tmp_path / "tool.log"  # the same run with a tool that writes: it runs with the user's permissions, as documented
    launch.run(0, *args[:-1], f"out_dir={tmp_path / 'writes'}", env={"TOOL_TO_CALL": "writes", "TOOL_LOG": str(log)})
    assert log.read_text().count("called") > 0


@pytest.mark.e2e
def test_a_changed_tool_file_is_refused_on_resume_naming_both_hashes(agent_task, tmp_path):
    import hashlib
    import shutil

    module = tmp_path / "agent_tools.py"
    shutil.copy(agent_task[1], module)
    args = [*agent_base((agent_task[0], module), tmp_path / "cache"), f"out_dir={tmp_path / 'run'}"]
    assert launch.in_process(*args, "train.halt_at=2", "train.steps=3")[0] == 0
    was = hashlib.sha256(module.read_bytes()).hexdigest()
    module.write_text(module.read_text().replace("2 * int", "3 * int"))
    code, err = launch.in_process(*args, "train.steps=3")
    now = hashlib.sha256(module.read_bytes()).hexdigest()
    assert code == 2 and "train.agent.tools:" in err and was in err and now in err and "Traceback" not in err, err
    code, err = launch.in_process(*args, "train.steps=3", f"train.agent.tools={module}:double")
    assert code == 2 and f"train.agent.tools: double, but the steps of" in err and "offered double,broken" in err, err


class _Lines:
    """A dataset stand-in: the fields of one agent line."""

    def __init__(self, fields: dict) -> None:
        self.f = fields

    def fields(self, index: int) -> dict:
        return self.f


def tiny_agent(tmp_path, seq_len: int = 112, max_turns: int = 3):
    from configs import load_config
    from data import tokenizer
    from model.model import MiniMindLM
    from objectives.agent import Agent

    module = tmp_path / "agent_tools.py"
    module.write_text(AGENT_MODULE)
    cfg = load_config(None, [*agent_base((tmp_path / "unused.jsonl", module), tmp_path / "cache")[1:4], f"model.seq_len={seq_len}",
                             "model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "train.global_batch=2",
                             "train.micro_batch=2", "train.grpo.generations=2", "train.grpo.max_new_tokens=6",
                             f"train.grpo.reward={module}:episode", f"train.agent.tools={module}:double,{module}:broken",
                             f"train.agent.parser={module}:calls", f"train.agent.max_turns={max_turns}"])
    torch.manual_seed(0)
    model = MiniMindLM(cfg.model).eval()
    fields = {"messages": [{"role": "user", "content": "What is 3 + 4?"}], "tools": TOOL_SCHEMAS, "gt": ["7"], "prompt": "What is 3 + 4?",
              "line": "x:1"}
    tok = tokenizer.load("bytes")
    agent = Agent(_Lines(fields), 1, 2, cfg.train.grpo, cfg.train.agent, 1337, tok, None, model)
    from data.chat import template_of

    prompt = tok.encode_rendered(template_of(tok).render(fields["messages"], TOOL_SCHEMAS, add_generation_prompt=True))
    return agent, model, prompt, fields, tok


@pytest.mark.e2e  # its user tools, parser and reward run in the worker process (objectives/worker.py)
def test_an_episodes_ids_are_the_models_turns_and_the_templates_tool_messages_and_only_the_models_ids_are_in_the_mask(tmp_path):
    agent, model, prompt, fields, tok = tiny_agent(tmp_path)
    seen_turns = set()
    for r in range(8):
        ep = agent.episode(model, prompt, fields, 0, r, 112)
        assert ep == agent.episode(model, prompt, fields, 0, r, 112)  # a pure function of (seed, step, prompt, r)
        ids, mine = ep["ids"], ep["mine"]
        assert ids[:len(prompt)] == prompt and len(ids) <= 112 and min(mine) == len(prompt)
        results = iter(m["content"] for m in ep["transcript"] if m["role"] == "tool")
        pos, turns = len(prompt), 0
        while pos < len(ids):  # a model turn, then the tool messages the template renders after it
            end = pos
            while end < len(ids) and end in set(mine):
                end += 1
            turns += 1
            ended = ids[end - 1] == tok.eos
            if end == len(ids):
                break
            text = ("" if ended else "<|im_end|>") + f"\n<|im_start|>tool\n{next(results)}<|im_end|>\n<|im_start|>assistant\n"
            want = tok.encode_rendered(text)
            assert ids[end:end + len(want)] == want, (r, tok.decode_rendered(ids[end:]))
            pos = end + len(want)
        assert turns == ep["counts"][0] == len(ep["turns"])
        seen_turns.add(turns)
        agent.step, agent.buffer = 0, {}
    assert seen_turns >= {1, 2}
    agent._rollout(model, (torch.tensor([prompt + [tok.pad] * (112 - len(prompt))]), torch.tensor([len(prompt)]), torch.tensor([0])), 0)
    ro = agent.buffer[0]
    for k in range(2):
        ep = agent.episode(model, prompt, fields, 0, k, 112)
        assert ro["tokens"][k, :len(ep["ids"])].tolist() == ep["ids"]
        assert ro["mask"][k].nonzero().view(-1).tolist() == [p - 1 for p in ep["mine"]]  # the targets that are the model's ids


@pytest.mark.e2e  # its user tools, parser and reward run in the worker process (objectives/worker.py)
def test_an_episode_whose_tool_message_would_fill_model_seq_len_is_cut_at_the_turn_boundary_and_counted_unfinished(tmp_path):
    agent, model, prompt, fields, tok = tiny_agent(tmp_path, seq_len=64, max_turns=5)
    cut = 0
    for r in range(8):
        ep = agent.episode(model, prompt, fields, 0, r, 64)
        assert len(ep["ids"]) < 64 and max(ep["mine"]) == len(ep["ids"]) - 1  # ends with the model's turn, room to spare
        called = bool(agent.parse(ep["turns"][-1]))
        assert ep["unfinished"] == called and ep["counts"][3] == int(called)  # cut (fewer than 5 turns) or out of turns
        cut += called and ep["counts"][0] < 5
    assert cut


@pytest.mark.e2e
def test_bad_agent_input_exits_2_naming_it(agent_task, tmp_path):
    from data.agent import TOOLS

    weather = tmp_path / "weather.jsonl"
    weather.write_text((json.dumps({"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS[2:3], "gt": ["10"]}) + "\n") * 6)
    malformed = tmp_path / "malformed.jsonl"
    malformed.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}], "tools": TOOL_SCHEMAS, "gt": ["1"]}) + "\n"
                         + json.dumps({"messages": [{"role": "user", "content": "Hi"}], "tools": [{"type": "function"}], "gt": ["1"]}) + "\n")
    (tmp_path / "broken_tools.py").write_text("import no_such_dependency_xyz\n")
    module = agent_task[1]
    cases = [((weather, module), [], f"{weather}:1: the tool 'get_current_weather' has no implementation in train.agent.tools"),
             ((malformed, module), [], f"{malformed}:2: tools[0] is a malformed tool schema"),
             (agent_task, [f"train.agent.tools={tmp_path / 'broken_tools.py'}:f"],
              f"train.agent.tools: {tmp_path / 'broken_tools.py'} does not import (ModuleNotFoundError"),
             (agent_task, ["train.agent.tools=calculator"], "train.agent.tools: 'calculator' is neither a built-in one"),
             (agent_task, ["train.agent.parser=no_such_parser_module:f"], "train.agent.parser: no_such_parser_module does not import"),
             (agent_task, ["train.agent.max_turns=0"], "train.agent.max_turns must be >= 1"),
             (agent_task, ["train.objective=next_token"], "train.objective=next_token with data.format=agent"),
             (agent_task, ["train.grpo.reward=answer"], "train.grpo.reward=answer with data.format=agent")]
    for task, extra, expected in cases:
        code, err = launch.in_process(*agent_base(task, tmp_path / "cache"), *extra, f"out_dir={tmp_path / 'bad'}")
        assert code == 2 and expected in err and "Traceback" not in err, (extra, expected, err[-2000:])


@pytest.mark.e2e
def test_the_agent_recipes_run_the_tool_use_fine_tune_then_agent_rl_over_it_at_a_tiny_size(tmp_path):
    """configs/agent_sft_tiny.yaml then configs/agent_tiny.yaml as docs/rl.md runs them, at a tiny size and 3 steps each
    (the docs test lists them in NOT_RUN, naming this test): the fine-tune's conversations teach the call format, the
    RL run's episodes call the calculator and log every agent figure."""
    tiny = ["model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", f"data.cache_dir={tmp_path / 'cache'}",
            "train.steps=3", "log.every=1", "log.progress=false", "runtime.threads=1", "checkpoint.interval=0"]
    sft, rl = tmp_path / "agent_sft_tiny", tmp_path / "agent_tiny"
    launch.run(1, "--config", "configs/agent_sft_tiny.yaml", *tiny, "model.init_from=", f"out_dir={sft}")
    launch.run(1, "--config", "configs/agent_tiny.yaml", *tiny, f"model.init_from={sft}", "train.grpo.max_new_tokens=24",
               "train.global_batch=12", f"out_dir={rl}")
    figures = launch.metrics(rl)
    assert len(figures) == 3 and all(0 <= r["agent/unfinished"] <= 1 and 1 <= r["agent/turns"] <= 3 for r in figures), figures
    assert all(abs(r["reward/mean"]) <= 3 for r in figures) and "tool_calls" in json.dumps(figures)
