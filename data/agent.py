"""Prompts for agentic reinforcement learning with tools (docs/rl.md, data.format=agent): MiniMind's
agent lines, their tools in OpenAI's function schema, rendered with the chat template and its tools.

A line is MiniMind's agent_rl.jsonl `{"conversations": [turns], "gt": [...]}` (the system turn
carries `tools`, a list or a JSON string; a last assistant turn is the one to generate, dropped) or
`{"messages": [turns], "tools": [...], "gt": [...]}`. `gt` (a list, or one string) is what the final
answer must contain. Each tool is `{"type": "function", "function": {"name", "description",
"parameters": {"type": "object", ...}}}`. Packed as data.format=prompts packs (data/prompts.py: one
row of model.seq_len ids with the generation prompt per line), the line's messages, tools and gt
among its fields: the rollout renders each next turn from them (objectives/agent.py).
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from common.files import atomic_file

from .chat import messages_of
from .sources import DataError, parse_json

# MiniMind's six tools (trainer/train_agent.py TOOLS): their schemas, as its agent data names them.
TOOLS = [
    {"type": "function", "function": {"name": "calculate_math", "description": "计算数学表达式", "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}},
    {"type": "function", "function": {"name": "unit_converter", "description": "单位换算", "parameters": {"type": "object", "properties": {"value": {"type": "number"}, "from_unit": {"type": "string"}, "to_unit": {"type": "string"}}, "required": ["value", "from_unit", "to_unit"]}}},
    {"type": "function", "function": {"name": "get_current_weather", "description": "获取天气", "parameters": {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}}},
    {"type": "function", "function": {"name": "get_current_time", "description": "获取时间", "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "default": "Asia/Shanghai"}}, "required": []}}},
    {"type": "function", "function": {"name": "get_exchange_rate", "description": "查询汇率", "parameters": {"type": "object", "properties": {"from_currency": {"type": "string"}, "to_currency": {"type": "string"}}, "required": ["from_currency", "to_currency"]}}},
    {"type": "function", "function": {"name": "translate_text", "description": "翻译文本", "parameters": {"type": "object", "properties": {"text": {"type": "string"}, "target_language": {"type": "string"}}, "required": ["text", "target_language"]}}},
]


def check_tools(tools, where: str) -> list[dict]:
    """A line's tools, each in OpenAI's function schema; DataError naming `where` and the tool at fault."""
    if not isinstance(tools, list) or not tools:
        raise DataError(f"{where}: tools must be a non-empty list of function schemas")
    for k, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        problem = None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            problem = 'expected {"type": "function", "function": {...}}'
        elif not isinstance(fn.get("name"), str) or not fn["name"].strip():
            problem = "function.name must be a non-empty string"
        elif "parameters" in fn and not (isinstance(fn["parameters"], dict) and fn["parameters"].get("type") == "object"):
            problem = 'function.parameters must be a JSON schema {"type": "object", ...}'
        if problem:
            raise DataError(f"{where}: tools[{k}] is a malformed tool schema: {problem}, got {json.dumps(tool, ensure_ascii=False)[:120]}")
    return tools


def parse_agent(path: Path, lineno: int, raw: bytes):
    """One JSONL line as (messages, tools, fields); DataError naming file:line."""
    obj = parse_json(path, lineno, raw)
    if obj is None:
        return None
    where = f"{path}:{lineno}"
    if not isinstance(obj, dict) or not ("conversations" in obj or "messages" in obj) or "gt" not in obj:
        raise DataError(f'{where}: expected an object with "conversations" (MiniMind\'s agent_rl.jsonl) or "messages", '
                        f'and "gt", got {raw[:80]!r}')
    key = "conversations" if "conversations" in obj else "messages"
    turns = obj[key]
    if not isinstance(turns, list) or not turns:
        raise DataError(f'{where}: "{key}" must be a non-empty list of turns')
    if isinstance(turns[-1], dict) and turns[-1].get("role") == "assistant":
        turns = turns[:-1]  # MiniMind's agent lines: the last turn is the one to generate
    messages, tools = messages_of(turns, path, lineno, key)
    if "tools" in obj:
        tools = obj["tools"]
        if isinstance(tools, str):
            try:
                tools = json.loads(tools)
            except json.JSONDecodeError as e:
                raise DataError(f'{where}: "tools" is a string that is not JSON ({e})') from None
    tools = check_tools(tools, where)
    gt = obj["gt"]
    gt = [gt] if isinstance(gt, str) else gt
    if not isinstance(gt, list) or not all(isinstance(g, (str, int, float)) and not isinstance(g, bool) for g in gt):
        raise DataError(f'{where}: "gt" must be a list of strings or numbers (what the final answer must contain)')
    users = [m for m in messages if m["role"] == "user"]
    if not users:
        raise DataError(f"{where}: the prompt has no user turn (roles: {', '.join(m['role'] for m in messages)})")
    extra = {k: v for k, v in obj.items() if k not in ("conversations", "messages", "tools", "gt")}
    return messages, tools, {**extra, "gt": gt, "messages": messages, "tools": tools, "prompt": users[-1]["content"], "line": where}


def calculator_sums(n: int, seed: int) -> list[tuple[str, int]]:
    """The built-in agent task's questions: "a op b" with two-digit operands and + - *, a fixed draw, and their values."""
    rnd = random.Random(seed)
    out = []
    for _ in range(n):
        a, b, op = rnd.randint(10, 99), rnd.randint(10, 99), rnd.choice("+-*")
        out.append((f"{a} {op} {b}", a + b if op == "+" else a - b if op == "-" else a * b))
    return out


SYSTEM = "Use the calculator."


def build_stdlib_agent(dest: Path, n: int = 2000, seed: int = 0) -> Path:
    """The built-in agent task: arithmetic a calculator answers ("What is 37 * 12?", gt ["444"]), with
    MiniMind's calculate_math tool (calculator_sums). Written once."""
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(dest, "w", encoding="utf-8") as out:
        for expr, value in calculator_sums(n, seed):
            line = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {expr}?"}],
                    "tools": TOOLS[:1], "gt": [str(value)]}
            out.write(json.dumps(line, ensure_ascii=False) + "\n")
    return dest


def build_stdlib_agent_chat(dest: Path, n: int = 2000, seed: int = 1) -> Path:
    """The built-in agent task's fine-tuning conversations (data.format=chat), another draw: the question, a
    `<tool_call>` of calculate_math in the assistant's text, the tool's result as MiniMind's tool returns it,
    the answer. Written once."""
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(dest, "w", encoding="utf-8") as out:
        for expr, value in calculator_sums(n, seed):
            call = json.dumps({"name": "calculate_math", "arguments": {"expression": expr}})
            turns = [{"role": "system", "content": SYSTEM, "tools": TOOLS[:1]}, {"role": "user", "content": f"What is {expr}?"},
                     {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
                     {"role": "tool", "content": json.dumps({"result": str(value)})},
                     {"role": "assistant", "content": f"{expr} = {value}."}]
            out.write(json.dumps({"conversations": turns}, ensure_ascii=False) + "\n")
    return dest
