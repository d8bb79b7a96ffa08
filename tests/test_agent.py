"""Agentic RL with tools (data/agent.py, objectives/tools.py, objectives/agent.py, docs/rl.md): MiniMind's
agent lines rendered as transformers renders them, its mock tools, tool-call parsing and agent reward
against MiniMind's own code, tools pinned and bounded, multi-turn rollouts resumed exactly on any
world size, bad input named."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import launch
from test_tokenizers import MINIMIND, needs_minimind

UPSTREAM = MINIMIND.parent / "upstream" / "trainer" / "train_agent.py"
needs_upstream = pytest.mark.skipif(not UPSTREAM.is_file(), reason=f"MiniMind's train_agent.py is not at {UPSTREAM}")


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


TOOL_MODULE = '''
def double(args):
    return {"value": 2 * args["x"]}


def raises(args):
    raise RuntimeError("broken")


def sleeps(args):
    import time

    while True:
        try:
            time.sleep(60)
        except Exception:
            pass
'''


@pytest.mark.unit
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
