"""data.format=prompts and data.format=agent: prompts for reinforcement learning, one padded row each (data/prompts.py, data/agent.py)."""
from __future__ import annotations

from pathlib import Path

from .. import agent, prompts
from ..dataset import PromptDataset, lengths_path
from . import DataFormat, register


def _arith(cache_dir: Path) -> Path:
    return prompts.build_stdlib_arith(cache_dir / "stdlib_arith.jsonl")


def _agent(cache_dir: Path) -> Path:
    return agent.build_stdlib_agent(cache_dir / "stdlib_agent.jsonl")


register(DataFormat(name="prompts", chat=True, planes=1, parse=prompts.parse_prompt, build=prompts.build, side=lengths_path,
                    dataset=PromptDataset, builtins={"stdlib-arith": _arith}, unit="prompts"))
register(DataFormat(name="agent", chat=True, planes=1, parse=agent.parse_agent, build=prompts.build, side=lengths_path,
                    dataset=PromptDataset, builtins={"stdlib-agent": _agent}, unit="prompts"))
