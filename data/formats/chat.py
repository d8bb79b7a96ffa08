"""data.format=chat: conversations ({"conversations": [...]}) rendered with the chat template and packed whole (data/chat.py)."""
from __future__ import annotations

from pathlib import Path

from .. import chat as chats
from ..dataset import ChatDataset, taught_path
from ..sources import DataError
from . import DataFormat, register


def _build(reader, tok, template, opts, seq_len: int, dtype, out, progress, batch_bytes: int):
    stats, side = chats.build(reader, tok, template, opts, seq_len, dtype, out, progress, batch_bytes)
    if stats["num_samples"] == 0:
        raise DataError(f"{reader.corpus.label}: no conversation teaches anything ({stats['untaught']} without an "
                        f"assistant token, {stats['dropped_long']} dropped as longer than seq_len)")
    return stats, side, None


def _stdlib_chat(cache_dir: Path) -> Path:
    from ..prepare import build_stdlib_chat

    return build_stdlib_chat(cache_dir / "stdlib_chat.jsonl")


def _stdlib_agent_chat(cache_dir: Path) -> Path:
    from ..agent import build_stdlib_agent_chat

    return build_stdlib_agent_chat(cache_dir / "stdlib_agent_chat.jsonl")


register(DataFormat(name="chat", chat=True, planes=3, parse=chats.parse_conversation, build=_build, side=taught_path,
                    dataset=ChatDataset, builtins={"stdlib-chat": _stdlib_chat, "stdlib-agent-chat": _stdlib_agent_chat},
                    unit="conversations"))
