"""Tools for agentic reinforcement learning (docs/rl.md, train.agent): MiniMind's six mock tools as
pure functions of their arguments (trainer/train_agent.py MOCK_RESULTS, the same outputs; its calculator's
`eval` replaced by a bounded arithmetic evaluator), a user's
`module:function` per tool pinned by its file's sha256 as the rewards are, tool-call parsing and
MiniMind's agent reward.

A tool is called with its arguments (a dict) and returns what MiniMind's tools return (a JSON-able
value); the model reads `json.dumps(value, ensure_ascii=False)[:2048]`, or MiniMind's
`{"error": "tool not found"}` when the tool is unknown, raises or returns nothing. A user's tool runs in
this rank's worker process (objectives/worker.py); a call that does not return within
train.agent.tool_timeout_s is killed there and fails the run naming the tool (exit 1): a result that
depends on the clock could not be reproduced on resume.
"""
from __future__ import annotations

import ast
import functools
import json
import math
import operator
import re
from typing import Callable

from common.outcome import BadInput, Failed

from . import rewards as reward_fns
from .worker import Changed, Late, Remote

ERROR = '{"error": "tool not found"}'
"""What the model reads when a tool is unknown, raises or returns nothing (MiniMind's string)."""
RESULT_CHARS = 2048
"""A tool's result is cut to this many characters (MiniMind's bound)."""

# ---------------------------------------------------------------- MiniMind's mock tools and their data
WEATHER_DATA = {"北京": ("28°C", "晴"), "上海": ("15°C", "多云"), "广州": ("32°C", "闷热"), "深圳": ("30°C", "晴"), "杭州": ("22°C", "阴"), "成都": ("18°C", "小雨"), "武汉": ("25°C", "多云"), "南京": ("20°C", "晴"), "西安": ("16°C", "大风"), "重庆": ("26°C", "阴"), "Tokyo": ("12°C", "晴"), "New York": ("8°C", "多云"), "London": ("5°C", "小雨"), "Paris": ("10°C", "阴"), "Sydney": ("25°C", "晴朗")}
TIME_DATA = {"Asia/Shanghai": "2025-03-07 14:30:00", "America/New_York": "2025-03-07 01:30:00", "Europe/London": "2025-03-07 06:30:00", "Asia/Tokyo": "2025-03-07 15:30:00", "Europe/Paris": "2025-03-07 07:30:00", "Australia/Sydney": "2025-03-07 17:30:00"}
EXCHANGE_DATA = {("USD", "CNY"): 7.21, ("EUR", "CNY"): 7.85, ("GBP", "CNY"): 9.12, ("JPY", "CNY"): 0.048, ("USD", "EUR"): 0.92, ("USD", "GBP"): 0.79, ("CNY", "JPY"): 20.83, ("AUD", "CNY"): 4.72}
TRANSLATE_DATA = {("你好世界", "english"): "Hello World", ("Good morning", "chinese"): "早上好", ("今天天气真好", "english"): "The weather is nice today", ("I love programming", "chinese"): "我喜欢编程", ("机器学习很有趣", "english"): "Machine learning is interesting", ("Happy birthday", "chinese"): "生日快乐"}
UNIT_DATA = {"km_miles": 0.621371, "miles_km": 1.60934, "kg_pounds": 2.20462, "pounds_kg": 0.453592, "meters_feet": 3.28084, "feet_meters": 0.3048, "celsius_fahrenheit": 1.8, "fahrenheit_celsius": 0.5556}


MAX_INT_BITS = 14_286
"""The largest integer calculate_math computes, in bits: 4,300 decimal digits, the most Python prints (its int max str digits)."""
MAX_FACTORIAL = 1_000
"""The largest argument of math.factorial, math.comb and math.perm calculate_math takes (1000! has 2,568 digits)."""
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_SIGNS = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MATH = {name: getattr(math, name) for name in dir(math) if not name.startswith("_")}


def arithmetic(expr: str):
    """The value of `expr`, an arithmetic expression: int and float numbers, `+ - * / // % **`, unary signs,
    parentheses, `math`'s functions (positional arguments) and constants (`math.sqrt(2)`, `math.pi`), as
    Python computes them. Anything else (a name, an attribute of anything but `math`, a string, a subscript,
    a comparison...) raises ValueError; so does a power, a factorial or any result past MAX_INT_BITS, before
    it is computed: every step is bounded, whatever the text."""
    return _value(ast.parse(expr.strip(), mode="eval").body)


def _value(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _number(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _SIGNS:
        return _SIGNS[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1 \
                and right * (abs(left).bit_length() - 1) > MAX_INT_BITS:
            raise ValueError("the power's result is too large")
        return _number(_OPERATORS[type(node.op)](left, right))
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "math" and node.attr in _MATH \
            and isinstance(_MATH[node.attr], (int, float)):
        return _MATH[node.attr]
    if isinstance(node, ast.Call) and not node.keywords and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name) \
            and node.func.value.id == "math" and callable(_MATH.get(node.func.attr)):
        args = [_value(a) for a in node.args]
        if node.func.attr in ("factorial", "comb", "perm") and any(isinstance(a, int) and abs(a) > MAX_FACTORIAL for a in args):
            raise ValueError(f"math.{node.func.attr}'s argument is too large")
        if node.func.attr == "lcm" and len(args) > 2:  # its result grows with each argument: bounded at each one
            return functools.reduce(lambda a, b: _number(math.lcm(a, b)), args)
        return _number(_MATH[node.func.attr](*args))
    raise ValueError(f"not arithmetic: {type(node).__name__}")


def _number(value):
    if type(value) not in (int, float):
        raise ValueError(f"not a number: {type(value).__name__}")
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise ValueError("the result is too large")
    return value


def calculate_math(args: dict):
    """MiniMind's calculator (its `eval` with `math`, ^ as **, full-width signs as ASCII) through `arithmetic`:
    the same result for arithmetic, MiniMind's error (it raises) for anything else or too large."""
    expr = str(args.get("expression", "0")).replace("^", "**").replace("×", "*").replace("÷", "/").replace("−", "-")
    return {"result": str(arithmetic(expr.replace("（", "(").replace("）", ")")))}


def unit_converter(args: dict):
    factor = UNIT_DATA.get(f"{args.get('from_unit', '').lower()}_{args.get('to_unit', '').lower()}", 1)
    return {"result": round(float(args.get("value", 0)) * factor, 4)}


def get_current_weather(args: dict):
    w = WEATHER_DATA.get(args.get("location"), ("22°C", "晴"))
    return {"city": args.get("location"), "temperature": w[0], "humidity": "65%", "condition": w[1]}


def get_current_time(args: dict):
    return {"datetime": TIME_DATA.get(args.get("timezone", "Asia/Shanghai"), "2025-03-07 14:30:00"), "timezone": args.get("timezone", "Asia/Shanghai")}


def get_exchange_rate(args: dict):
    return {"from": args.get("from_currency"), "to": args.get("to_currency"),
            "rate": EXCHANGE_DATA.get((args.get("from_currency"), args.get("to_currency")), 1.0)}


def translate_text(args: dict):
    return {"translated_text": TRANSLATE_DATA.get((args.get("text"), args.get("target_language")), args.get("text", ""))}


BUILTIN: dict[str, Callable] = {f.__name__: f for f in (calculate_math, unit_converter, get_current_weather, get_current_time,
                                                        get_exchange_rate, translate_text)}
CHECK_ARGS = {  # MiniMind's argument checks: a call counts as valid for the reward when its tool's check passes
    "calculate_math": lambda a: bool(a.get("expression")),
    "unit_converter": lambda a: a.get("value") is not None and a.get("from_unit") and a.get("to_unit"),
    "get_current_weather": lambda a: bool(a.get("location")),
    "get_current_time": lambda a: True,
    "get_exchange_rate": lambda a: bool(a.get("from_currency")) and bool(a.get("to_currency")),
    "translate_text": lambda a: bool(a.get("text")) and bool(a.get("target_language")),
}


# ---------------------------------------------------------------- calls
def parse_tool_calls(text: str) -> list:
    """The JSON objects between `<tool_call>` and `</tool_call>` (MiniMind's parse: the ones that are not JSON skipped)."""
    calls = []
    for m in re.findall(r"<tool_call>(.*?)</tool_call>", text, re.DOTALL):
        try:
            calls.append(json.loads(m.strip()))
        except (ValueError, RecursionError):  # MiniMind's bare except: JSON nested past the recursion limit too
            pass
    return calls


def name_and_args(call) -> tuple[str, object]:
    """A parsed call's tool name and arguments (a JSON string of them decoded; one that is not JSON: {})."""
    if not isinstance(call, dict):
        return "", {}
    name, raw = call.get("name", ""), call.get("arguments", {})
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except (ValueError, RecursionError):
            raw = {}
    return name, raw


class Toolbox:
    """train.agent.tools loaded: each entry a built-in name or `module:function` (`path/file.py:function`),
    the tool's name its function's; `records` what a checkpoint pins (spec, file, sha256)."""

    def __init__(self, specs: list[str], timeout_s: float) -> None:
        self.tools: dict[str, Callable] = {}
        self.records: list[dict] = []
        self.timeout_s = timeout_s
        for spec in specs:
            fn, record = reward_fns.load(spec, "train.agent.tools", BUILTIN)
            name = spec if spec in BUILTIN else spec.rpartition(":")[2]
            if name in self.tools:
                raise BadInput(f"train.agent.tools: two tools named {name!r}")
            self.tools[name] = fn
            self.records.append({**record, "name": name})

    def check(self, tools: list[dict], where: str) -> None:
        """Every tool a line offers has an implementation; BadInput naming the tool and the line."""
        for tool in tools:
            name = tool["function"]["name"]
            if name not in self.tools:
                raise BadInput(f"{where}: the tool {name!r} has no implementation in train.agent.tools "
                               f"({', '.join(self.tools) or 'none'}; built-ins: {', '.join(BUILTIN)})")

    def run(self, call) -> tuple[str, bool]:
        """What the model reads for one parsed call, and whether the call succeeded (a known tool that returned a value)."""
        name, args = name_and_args(call)
        fn = self.tools.get(name) if isinstance(name, str) else None
        if fn is None:
            return ERROR, False
        try:
            if isinstance(fn, Remote):  # a user's tool: in the worker process, killed at the timeout
                result = fn.call((args,), {}, self.timeout_s, RESULT_CHARS)
            else:  # a built-in: ours, bounded
                result = fn(args)
                result = ("empty",) if not result else ("json", json.dumps(result, ensure_ascii=False)[:RESULT_CHARS])
        except Changed as e:  # not the tool's error: the code the run pinned is gone
            raise Failed(e.text) from None
        except Late:
            raise Failed(f"train.agent.tools: {name} did not return within train.agent.tool_timeout_s={self.timeout_s:g} s "
                         f"(arguments {json.dumps(args, ensure_ascii=False)[:200]})") from None
        except Exception:  # noqa: BLE001 - MiniMind's rule: a tool that raises answers with the error message
            return ERROR, False
        if result[0] == "notjson":
            raise Failed(f"train.agent.tools: {name} returned {result[1]}, which is not JSON")
        return (ERROR, False) if result[0] == "empty" else (result[1], True)


# ---------------------------------------------------------------- MiniMind's agent reward
def validate_gt_in_text(text: str, gt_list) -> set:
    """The ground truths found in the text: as a substring (case-insensitive), or a number equal to one in the text."""
    text, text_num = str(text), str(text).replace(",", "")
    nums = [float(x) for x in re.findall(r"(?<![\w.])[-+]?\d+(?:\.\d+)?(?![\w.])", text_num)]
    found = set()
    for g in gt_list:
        s = str(g).strip()
        if s and s.lower() in text.lower():
            found.add(g)
        elif re.fullmatch(r"[-+]?\d+(?:\.\d+)?", s.replace(",", "")) and any(abs(float(s.replace(",", "")) - n) < 1e-6 for n in nums):
            found.add(g)
    return found


def minimind_agent(prompt: str, completion: str, gt=None, tools=None, turns=None, unfinished: bool = False, **fields) -> float:
    """MiniMind's agent reward (trainer/train_agent.py calculate_rewards, without its reward model), in [-3, 3]:
    -0.5 per unbalanced <tool_call> tag; with no tool call, MiniMind's length and thinking rules; with calls,
    +0.5 when the valid calls match len(gt) (else -0.5 per call off), +2.5 times the share of gt found in
    the final answer, -0.5 when unfinished; minus the trigram repetition penalty."""
    turns = [completion] if turns is None else turns
    answers = [t.split("</think>", 1)[-1].strip() if "</think>" in t else t.strip() for t in turns]
    answer = answers[-1] if answers else completion.strip()
    valid_names = {t["function"]["name"] for t in tools} if tools else set()
    calls = [c for a in answers for c in parse_tool_calls(a)]
    reward = -0.5 * sum(abs(a.count("<tool_call>") - a.count("</tool_call>")) for a in answers)
    if not calls:
        reward += 0.5 if 5 <= len(completion.strip()) <= 800 else -0.5
        if "</think>" in completion:
            think, answer = completion.split("</think>", 1)
            reward += 1.0 if 20 <= len(think.strip()) <= 300 else -0.5
            reward += 0.25 if completion.count("</think>") == 1 else -0.25
            answer = answer.strip()
        reward -= reward_fns.rep_penalty(answer)
        return max(min(reward, 3.0), -3.0)
    gt = gt or []
    valid = 0
    for call in calls:
        name, args = name_and_args(call)
        check = CHECK_ARGS.get(name) if isinstance(name, str) else None
        valid += int(bool(name in valid_names and check and isinstance(args, dict) and check(args)))
    gap = abs(valid - len(gt)) + max(0, len(calls) - valid)
    reward += 0.5 if gap == 0 else -0.5 * gap
    final = "" if unfinished else (answer.split("</tool_call>")[-1] if "</tool_call>" in answer else answer)
    if gt:
        reward += 2.5 * len(validate_gt_in_text(final, gt)) / len(gt)
    if unfinished:
        reward -= 0.5
    reward -= reward_fns.rep_penalty(final if final else answer)
    return max(min(reward, 3.0), -3.0)


REWARDS = {"minimind_agent": minimind_agent}
"""The agent's built-in rewards, beside objectives/rewards.py's (train.grpo.reward)."""
