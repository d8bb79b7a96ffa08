"""`python -m checkpoint serve RUN`: an OpenAI-compatible HTTP server over a checkpoint (docs/serving.md).

    POST /v1/chat/completions   messages, temperature, top_p, max_tokens (max_completion_tokens), stop, seed,
                                stream (server-sent events, `data: [DONE]` last), stream_options.include_usage, n, logprobs
                                (top_logprobs), tools (tool_calls and reasoning_content read as MiniMind's server reads them);
                                top_k, repetition_penalty, open_thinking, chat_template_kwargs as extensions; a field
                                left out is `chat`'s default
    POST /v1/completions        prompt (a string, strings, ids or lists of ids), the same settings, echo, logprobs
                                (each id's log-probability and the k likeliest: what lm-evaluation-harness scores by)
    GET  /v1/models             the one model served (/v1/models/{id}: it, or 404)
    GET  /health                {"status": "ok", "active": n, "waiting": m, ..., "free_slots": the KV pool's} (no key needed)

A reply is what `python -m checkpoint chat` gives for the same messages and settings: the conversation
rendered with the run's own chat template, ids generated with the KV cache under inference mode
(model.generate.Generation), decoded with the run's tokenizer. One worker thread owns the model:
requests are queued, and up to `--slots` of them are decoded together, every slot's next id from one
batch-invariant forward (model/decode.py: each reply the bits it gets alone, its own cache and
generator); past `--queue` waiting requests a request gets 429. A client that goes away frees its
slot at the next turn. The run's tool-call parser (a user's: in a worker process) reads replies on a thread of
its own, off the event loop, each call bounded (ToolParser). Bad input is HTTP 400 with OpenAI's error body
(a body past --max-request-bytes 413), and the server goes on.
FastAPI and uvicorn (requirements-serve.txt), as MiniMind's own scripts/serve_openai_api.py.
"""

import asyncio
import collections
import json
import logging
import math
import re
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field

log = logging.getLogger("minimind")

REQUIREMENTS = "requirements-serve.txt"
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_REQUEST_BYTES = 1 << 20
"""A request body past this many bytes (`--max-request-bytes`) is answered 413 before the rest is read."""
MAX_DEPTH = 32
"""JSON nested deeper than this (objects and lists) is a 400 naming the field, before it is parsed."""
API_KEY_ENV = "MINIMIND_SERVE_API_KEY"
MAX_N = 8
"""`n`, the choices of one request (each a job of its own), at most this many."""
MAX_TOP_LOGPROBS = 20
"""`top_logprobs` (chat) and `logprobs` (completions): at most this many likeliest ids per position, as OpenAI."""
MAX_PROMPTS = 64
"""A completions request's prompts, at most this many (each `n` jobs)."""
MAX_TOOLS = 128
"""A request's `tools`, at most this many."""
"""A completions request's prompts, at most this many (each `n` jobs)."""
NEUTRAL = {"frequency_penalty": 0, "presence_penalty": 0}
"""OpenAI's fields this server does not implement, accepted at the value that asks for nothing."""


class ApiError(Exception):
    """A request answered with an HTTP error and OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class ChatRequest:
    """A chat-completions or completions request, checked (parse_request, parse_completion): its
    settings, and per prompt `n` choices (`prompts`: a completions request's ids)."""

    messages: list[dict]
    temperature: float
    top_p: float
    top_k: int
    repetition_penalty: float
    max_tokens: int | None
    stop: list[str]
    seed: int
    stream: bool
    include_usage: bool
    n: int = 1
    logprobs: int | None = None  # None: none; k: each id's log-probability and the k likeliest at its position
    echo: bool = False
    prompts: list[list[int]] = field(default_factory=list)
    tools: list[dict] | None = None  # rendered by the chat template as training renders them
    tool_choice: str = "auto"  # "none": the reply is not read for tool calls
    template_kwargs: dict = field(default_factory=dict)  # more variables for the template (open_thinking)


def _number(body: dict, key: str, default, low: float, high: float = math.inf, low_open: bool = False, integer: bool = False):
    """body[key] (default when absent or null), a number (an integer) in its range; ApiError (400) naming it."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)) or (not integer and math.isnan(value)):
        raise ApiError(400, f"{key} must be {'an integer' if integer else 'a number'}, got {json.dumps(value)[:40]}", key)
    if value < low or value > high or (low_open and value == low):
        bounds = f"> {low:g}" if low_open else f">= {low:g}"
        raise ApiError(400, f"{key} must be {bounds}{f' and <= {high:g}' if high != math.inf else ''}, got {value}", key)
    return value


def _content(message: dict, i: int) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                         for p in content):
        return "".join(p["text"] for p in content)  # OpenAI's content parts, text only
    raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")


def _path(parts: list) -> str | None:
    """`messages[0].content` from ["messages", 0, "content"] (None for the body itself)."""
    text = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts).lstrip(".")
    return text or None


def _too_deep(raw: bytes) -> str | None:
    """None when `raw`'s objects and lists nest at most MAX_DEPTH deep, else the path of the field where
    they go deeper. The depth is counted on the bytes with the strings taken out (numpy, no recursion);
    only past the bound is the path found, token by token up to that point."""
    import re

    import numpy as np

    strings = re.compile(rb'"(?:[^"\\]|\\.)*"')
    b = np.frombuffer(strings.sub(b'""', raw), dtype=np.uint8)
    step = (b == ord("{")).astype(np.int32) + (b == ord("[")) - (b == ord("}")) - (b == ord("]"))
    if not len(step) or int(step.cumsum().max()) <= MAX_DEPTH:
        return None
    stack, key_next = [], False  # each open container: [key or index]; key_next: the next string is a key
    for m in re.finditer(rb'"(?:[^"\\]|\\.)*"|[\[\]{},]', raw):
        t = m.group()
        if t in (b"{", b"["):
            if len(stack) == MAX_DEPTH:
                return _path([p for p in stack if p is not None]) or "body"
            stack.append(None if t == b"{" else 0)
            key_next = t == b"{"
        elif t in (b"}", b"]"):
            stack.pop() if stack else None
            key_next = False
        elif t == b",":
            if stack and isinstance(stack[-1], int):
                stack[-1] += 1
            else:
                key_next = True
        elif key_next and stack:
            try:
                stack[-1] = json.loads(t)
            except ValueError:
                stack[-1] = "?"
            key_next = False
    return "body"


FINITE = "must be a finite number (Infinity, NaN and numbers past a double's range are not)"
UTF8 = "must be text that UTF-8 can encode (a lone surrogate such as \\ud800 is not)"


def _unfit(value, parts: list) -> tuple[str, str] | None:
    """The path of the first value in `value` that no reply could use, and what it must be: a number that is
    not finite (Infinity, NaN, 1e999) or a string (a key too) holding a lone surrogate; None when all fit."""
    if isinstance(value, float) and not math.isfinite(value):
        return _path(parts) or "body", FINITE
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return _path(parts) or "body", UTF8
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        if isinstance(k, str) and _unfit(k, parts):  # the key cannot be named either: its object is
            return _path(parts) or "body", "must have keys " + UTF8.removeprefix("must be ")
        found = _unfit(v, [*parts, k])
        if found:
            return found
    return None


def read_json(raw: bytes) -> dict:
    """A request body as a JSON object: nested at most MAX_DEPTH deep, every number finite and every string
    UTF-8's, else ApiError (400) naming the field."""
    deep = _too_deep(raw)
    if deep:
        raise ApiError(400, f"{deep} nests objects or lists deeper than {MAX_DEPTH} levels", deep)
    try:
        body = json.loads(raw)
    except ValueError as e:  # not JSON, not UTF-8, or an integer past Python's digit limit for conversion
        raise ApiError(400, f"the body is not JSON this server reads: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    bad = _unfit(body, [])
    if bad:
        raise ApiError(400, f"{bad[0]} {bad[1]}", bad[0])
    return body


async def read_body(request, limit: int) -> bytes:
    """The request's body, at most `limit` bytes: past it (its Content-Length says so, or the bytes that
    came do) ApiError 413, before the rest is read."""
    def too_large(size: str) -> ApiError:
        return ApiError(413, f"the request body is {size} bytes; this server takes at most {limit} (serve --max-request-bytes)",
                        code="request_too_large")

    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large(length)
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise too_large(f"more than {size}")
        parts.append(part)
    return b"".join(parts)


def _settings(body: dict, max_default: int | None) -> dict:
    """The fields chat completions and completions share, checked; ApiError (400) naming the field."""
    from model.generate import DEFAULTS, SMALLEST

    if not isinstance(body.get("model", ""), str):
        raise ApiError(400, "model must be a string", "model")
    for key, neutral in NEUTRAL.items():
        if body.get(key) not in (None, neutral):
            raise ApiError(400, f"{key}={json.dumps(body[key])[:40]} is not supported by this server (only {json.dumps(neutral)})", key)
    if "max_tokens" in body and body["max_tokens"] is not None:
        max_key = "max_tokens"
    else:
        max_key = "max_completion_tokens"
    max_tokens = _number(body, max_key, max_default, 1, integer=True)
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "stop must be a string or a list of at most 4 non-empty strings", "stop")
    seed = _number(body, "seed", None, -(2 ** 63), 2 ** 64 - 1, integer=True)
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise ApiError(400, "stream_options must be an object {include_usage: true|false}", "stream_options")
    temperature = float(_number(body, "temperature", DEFAULTS.temperature, 0, 2))
    if 0 < temperature < SMALLEST:  # its logits could overflow to inf: a NaN draw (model/generate.py)
        raise ApiError(400, f"temperature must be 0 (greedy) or at least {SMALLEST:g}, got {temperature}", "temperature")
    return dict(
        temperature=temperature,
        top_p=float(_number(body, "top_p", DEFAULTS.top_p, 0, 1, low_open=True)),
        top_k=_number(body, "top_k", DEFAULTS.top_k, 0, integer=True),
        repetition_penalty=float(_number(body, "repetition_penalty", DEFAULTS.repetition_penalty, SMALLEST, 1 / SMALLEST)),
        max_tokens=max_tokens, stop=stop, seed=seed if seed is not None else secrets.randbits(63),
        stream=stream, include_usage=options.get("include_usage", False), n=_number(body, "n", 1, 1, MAX_N, integer=True))


def _top(body: dict, key: str, vocab: int) -> int:
    """How many likeliest ids to give per position: at most MAX_TOP_LOGPROBS and the vocabulary."""
    return _number(body, key, 0, 0, min(MAX_TOP_LOGPROBS, vocab), integer=True)


def _tools(tools) -> list[dict] | None:
    """The request's `tools`, OpenAI's function tools, checked (ApiError 400 naming the field); None for none."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ApiError(400, f"tools must be a list of at most {MAX_TOOLS} {{type: \"function\", function: {{name, description, "
                            f"parameters}}}}", "tools")
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(tool.get("function"), dict):
            raise ApiError(400, f"{where} must be {{type: \"function\", function: {{name, description, parameters}}}}", where)
        fn = tool["function"]
        if not isinstance(fn.get("name"), str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", fn["name"]):
            raise ApiError(400, f"{where}.function.name must be 1 to 64 letters, digits, _ or -", f"{where}.function.name")
        if not isinstance(fn.get("description", ""), str):
            raise ApiError(400, f"{where}.function.description must be a string", f"{where}.function.description")
        params = fn.get("parameters", {})
        if not isinstance(params, dict) or ("type" in params and params["type"] != "object") or \
                not isinstance(params.get("properties", {}), dict) or not isinstance(params.get("required", []), list):
            raise ApiError(400, f"{where}.function.parameters must be a JSON Schema object ({{type: \"object\", properties: "
                                f"{{...}}, required: [...]}})", f"{where}.function.parameters")
    return tools


def _tool_calls(calls, i: int) -> list[dict]:
    """An assistant message's `tool_calls` (as a reply gives them), checked: each {function: {name, arguments}}."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise ApiError(400, f"{where} must be a list of {{id, type, function: {{name, arguments}}}}", where)
    for k, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments", ""), str | dict):
            raise ApiError(400, f"{where}[{k}] must be {{id, type: \"function\", function: {{name, arguments}}}}", f"{where}[{k}]")
    return calls


def parse_request(raw: bytes, vocab: int = 1 << 30) -> ChatRequest:
    """A chat-completions body checked against what the server implements; ApiError (400) naming the field."""
    body = read_json(raw)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of {role, content}", "messages")
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ApiError(400, f"messages[{i}] must be an object whose role is one of {', '.join(ROLES)}", f"messages[{i}].role")
        role = "system" if m["role"] == "developer" else m["role"]
        turn = {"role": role, "content": _content(m, i)}
        if role == "assistant" and m.get("tool_calls") is not None:
            turn["tool_calls"] = _tool_calls(m["tool_calls"], i)
        if role == "assistant" and m.get("reasoning_content") is not None:
            if not isinstance(m["reasoning_content"], str):
                raise ApiError(400, f"messages[{i}].reasoning_content must be a string", f"messages[{i}].reasoning_content")
            turn["reasoning_content"] = m["reasoning_content"]
        turns.append(turn)
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise ApiError(400, "logprobs must be true or false", "logprobs")
    top = _top(body, "top_logprobs", vocab)
    if top and not logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    tool_choice = body.get("tool_choice")
    if tool_choice not in (None, "auto", "none"):
        raise ApiError(400, f"tool_choice={json.dumps(tool_choice)[:60]} is not supported by this server (only \"auto\" or "
                            f"\"none\": the model decides)", "tool_choice")
    response_format = body.get("response_format")
    if response_format not in (None, {"type": "text"}):
        raise ApiError(400, "response_format: only {\"type\": \"text\"} (this server does not constrain its output)", "response_format")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict) or any(k in ("messages", "tools", "add_generation_prompt") for k in kwargs):
        raise ApiError(400, "chat_template_kwargs must be an object of the template's own variables (not messages, tools or "
                            "add_generation_prompt)", "chat_template_kwargs")
    thinking = body.get("open_thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise ApiError(400, "open_thinking must be true or false", "open_thinking")
    # MiniMind's server: open_thinking, or chat_template_kwargs' open_thinking or enable_thinking
    thinking = bool(thinking or kwargs.get("open_thinking") or kwargs.get("enable_thinking"))
    return ChatRequest(messages=turns, **_settings(body, None), logprobs=top if logprobs else None, tools=_tools(body.get("tools")),
                       tool_choice=tool_choice or "auto", template_kwargs={**kwargs, "open_thinking": thinking})


def parse_completion(raw: bytes, tok, vocab: int) -> ChatRequest:
    """A completions body: `prompt` a string, a list of strings, a list of ids or a list of lists of ids
    (a string is BOS + its ids, as `generate` encodes it); ApiError (400) naming the field."""
    body = read_json(raw)
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(p, int) and not isinstance(p, bool)
                                                                                 for p in prompt)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt or len(prompt) > MAX_PROMPTS:
        raise ApiError(400, f"prompt must be a string, a list of strings, a list of token ids or a list of such lists "
                            f"(1 to {MAX_PROMPTS} prompts)", "prompt")
    prompts = []
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            prompts.append(tok.encode(p, bos=True))
            continue
        if not isinstance(p, list) or not p or not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            raise ApiError(400, f"prompt[{i}] must be a string or a non-empty list of token ids", f"prompt[{i}]")
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"prompt[{i}] holds token id {bad[0]}, outside the vocabulary (0 to {vocab - 1})", f"prompt[{i}]")
        prompts.append(list(p))
    echo = body.get("echo", False)
    if not isinstance(echo, bool | None):
        raise ApiError(400, "echo must be true or false", "echo")
    logprobs = body.get("logprobs")
    settings = _settings({k: v for k, v in body.items() if k != "logprobs"}, 16)
    return ChatRequest(messages=[], **settings, logprobs=None if logprobs is None else _top(body, "logprobs", vocab),
                       echo=bool(echo), prompts=prompts)


def check_fits(prompt: list[int], max_tokens: int | None, seq_len: int, field: str) -> None:
    """ApiError (400, context_length_exceeded) when a prompt, or it and the tokens asked for, do not fit the context."""
    if len(prompt) >= seq_len:
        raise ApiError(400, f"This model's maximum context length is {seq_len} tokens, and the {field} are {len(prompt)}: shorten "
                            f"them to at most {seq_len - 1}", field, code="context_length_exceeded")
    if max_tokens is not None and len(prompt) + max_tokens > seq_len:
        raise ApiError(400, f"This model's maximum context length is {seq_len} tokens. However, you requested "
                            f"{len(prompt) + max_tokens} tokens ({len(prompt)} in the {field}, {max_tokens} in the completion): "
                            f"ask for at most {seq_len - len(prompt)}", "max_tokens", code="context_length_exceeded")


def prompt_ids(tok, template, req: ChatRequest, seq_len: int) -> list[int]:
    """The conversation's ids with the generation prompt, as `chat` renders it; ApiError (400) when it
    or the tokens asked for do not fit the model's context."""
    from data.chat import TemplateError

    try:
        ids = tok.encode_rendered(template.render(req.messages, req.tools, add_generation_prompt=True, **req.template_kwargs))
    except TemplateError as e:
        raise ApiError(400, f"the chat template refused the messages: {e}", "messages") from None
    check_fits(ids, req.max_tokens, seq_len, "messages")
    return ids


THINK_END, CALL_START = "</think>", "<tool_call>"


def read_reply(text: str, parse_calls=None) -> tuple[str, str | None, list[dict] | None]:
    """A reply's (content, reasoning_content, tool_calls) as MiniMind's server reads it
    (scripts/serve_openai_api.py: parse_response): the part before `</think>` is the reasoning, each
    call `parse_calls` (the run's tool-call parser, training's train.agent.parser; None: no calls read)
    finds becomes an OpenAI tool call whose arguments are its JSON, and its `<tool_call>` text leaves
    the content; the content is stripped when anything was taken out of it, else the text as it came."""
    reasoning, taken = None, False
    found = re.search(r"<think>(.*?)</think>", text, re.DOTALL)
    if found:
        reasoning, text, taken = found.group(1).strip(), re.sub(r"<think>.*?</think>\s*", "", text, flags=re.DOTALL), True
    elif THINK_END in text:
        head, _, text = text.partition(THINK_END)
        reasoning, taken = head.strip(), True
    calls = []
    for i, call in enumerate(parse_calls(text) if parse_calls else []):
        if isinstance(call, dict):  # MiniMind's: a call that is not an object is skipped
            calls.append({"id": f"call_{uuid.uuid4().hex[:16]}_{i}", "type": "function",
                          "function": {"name": call.get("name", ""), "arguments": json.dumps(call.get("arguments", {}), ensure_ascii=False)}})
    if calls:
        text, taken = re.sub(r"<tool_call>.*?</tool_call>", "", text, flags=re.DOTALL), True
    return (text.strip() if taken else text), reasoning, calls or None


def _held(text: str, start: int, tag: str) -> int:
    """Where the sure part of text[start:] ends: before an end of it that `tag` starts with."""
    for n in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if text.endswith(tag[:n]):
            return len(text) - n
    return len(text)


class ReplyDeltas:
    """A streamed reply's text as OpenAI's chat deltas, as MiniMind's server streams them: while the
    template opened thinking (open_thinking), `reasoning_content` up to `</think>` (the newlines after it
    dropped), then `content`; with a tool-call parser, the text from the first `<tool_call>` on is held
    back and read at the end (read_reply) into one `tool_calls` delta."""

    def __init__(self, thinking: bool, parse_calls) -> None:
        self.text, self.sent, self.thinking, self.parse_calls = "", 0, thinking, parse_calls

    def add(self, piece: str) -> list[dict]:
        self.text += piece
        out = []
        if self.thinking:
            pos = self.text.find(THINK_END, self.sent)
            if pos < 0:
                end = _held(self.text, self.sent, THINK_END)
                if end > self.sent:
                    out.append({"reasoning_content": self.text[self.sent:end]})
                    self.sent = end
                return out
            if pos > self.sent:
                out.append({"reasoning_content": self.text[self.sent:pos]})
            self.thinking, self.sent = False, pos + len(THINK_END)
            while self.sent < len(self.text) and self.text[self.sent] == "\n":
                self.sent += 1
        end = len(self.text)
        if self.parse_calls:
            cut = self.text.find(CALL_START, self.sent)  # `sent` never passes a call's start: from it on, all is held
            end = cut if cut >= 0 else _held(self.text, self.sent, CALL_START)
        if end > self.sent:
            out.append({"content": self.text[self.sent:end]})
            self.sent = end
        return out

    def finish(self) -> tuple[list[dict], list[dict] | None]:
        """The deltas left at the end (the rest of the content, the tool calls) and the calls read."""
        out = []
        if self.thinking and len(self.text) > self.sent:
            out.append({"reasoning_content": self.text[self.sent:]})
            return out, None
        rest, calls = self.text[self.sent:], None
        if self.parse_calls:  # the calls in the whole reply, as read unstreamed (a parser of any format sees all of it)
            calls = read_reply(self.text, self.parse_calls)[2]
            if calls:
                rest = re.sub(r"<tool_call>.*?</tool_call>", "", rest, flags=re.DOTALL).strip()
        if rest:
            out.append({"content": rest})
        if calls:
            out.append({"tool_calls": [{"index": k, **call} for k, call in enumerate(calls)]})
        return out, calls


class TextStream:
    """A reply's text as its ids come: each new piece once it is sure (not the start of a stop string,
    not an unfinished UTF-8 character), the text cut before the first stop string, which ends it."""

    def __init__(self, tok, stop: list[str]) -> None:
        self.tok, self.stop, self.ids, self.sent = tok, stop, [], ""

    def add(self, nxt: int) -> tuple[str, bool]:
        """(the new sure text, whether a stop string came)."""
        self.ids.append(nxt)
        text = self.tok.decode(self.ids)
        cut = min((p for p in (text.find(s) for s in self.stop) if p >= 0), default=-1)
        if cut >= 0:
            return self._send(text[:cut]), True
        sure = len(text.rstrip("\ufffd"))
        for s in self.stop:  # the longest end of the text that a stop string starts with is held back
            for n in range(min(len(s) - 1, sure), 0, -1):
                if text[sure - n: sure] == s[:n]:
                    sure -= n
                    break
        return self._send(text[:sure]), False

    def finish(self) -> str:
        """What is left to send at the end (no stop string came)."""
        return self._send(self.tok.decode(self.ids))

    def _send(self, text: str) -> str:
        if not text.startswith(self.sent) or len(text) <= len(self.sent):
            return ""  # an earlier piece decodes otherwise now: wait (the end sends what follows it)
        new, self.sent = text[len(self.sent):], text
        return new


@dataclass
class Job:
    """One choice of one request in the engine: its prompt and settings, where its events go, whether its
    client left; `entries`: each drawn id's (id, log-probability, [(id, log-probability)] of the likeliest)
    when the request asks for logprobs, `prompt_entries` the prompt's own with echo."""

    req: ChatRequest
    prompt: list[int]
    emit: object  # emit(event): called from the worker thread
    seed: int | None = None  # this choice's seed (None: the request's)
    cancelled: bool = False
    gen: object = None
    text: object = None
    pending: str = ""
    sent_at: float | None = None
    entries: list = field(default_factory=list)
    prompt_entries: list | None = None
    queued_at: float = field(default_factory=time.perf_counter)

    def send(self, piece: str, now: float, every: float) -> None:
        """Hand `piece` on with what is pending: the first at once, then at most one piece per `every`
        seconds (each hand-off wakes the server's event loop, whose work the generation thread waits for)."""
        self.pending += piece
        if self.pending and (self.sent_at is None or now - self.sent_at >= every):
            self.emit(("delta", self.pending))
            self.pending, self.sent_at = "", now

    def flush(self) -> None:
        if self.pending:
            self.emit(("delta", self.pending))
            self.pending = ""

    def score(self) -> None:
        """Record the log-probabilities of the id the last step drew (and, the first time, the prompt's)."""
        k, gen = self.req.logprobs, self.gen
        if self.req.echo and self.prompt_entries is None and gen.prompt_logits is not None:
            self.prompt_entries = [(self.prompt[0], None, None), *log_probabilities(gen.prompt_logits, self.prompt[1:], k)]
        if gen.last_id is not None:
            self.entries += log_probabilities(gen.last_logits[None], [gen.last_id], k)


def log_probabilities(logits, ids: list[int], k: int) -> list[tuple]:
    """Per row of `logits` (positions, vocab): (ids[i], its log-softmax in fp32, the k likeliest as (id, log-prob))."""
    import torch

    lp = torch.log_softmax(logits.float(), -1)
    chosen = lp.gather(1, torch.tensor(ids, dtype=torch.long, device=lp.device)[:, None])[:, 0].tolist()
    if not k:
        return [(i, c, []) for i, c in zip(ids, chosen)]
    values, indices = lp.topk(k, -1)
    return [(i, c, list(zip(ix, v))) for i, c, ix, v in zip(ids, chosen, indices.tolist(), values.tolist())]


def choice_seed(seed: int, i: int) -> int:
    """Choice i's seed: the request's for choice 0 (so n=1 is the reply alone), else one drawn from (seed, i)."""
    import hashlib

    return seed if i == 0 else int.from_bytes(hashlib.sha256(f"{seed}:{i}".encode()).digest()[:8], "little") >> 1


STREAM_EVERY_S = 0.02
"""A reply's text is handed to its stream at most this often (its first piece at once): fewer, longer
chunks than one per token cost the generation thread less (docs/serving.md, "Several clients")."""


def kv_pool(model, slots: int):
    """model/decode.py's KVPool of `slots` slots of model.seq_len positions; one the device cannot hold is a
    CommandError naming --slots and the bytes it needs (found by review: made by the worker thread, its failure
    killed that thread and every request then waited forever)."""
    import torch

    from model.decode import KVPool

    from .arguments import CommandError

    cfg = model.cfg
    need = 2 * cfg.n_layers * slots * cfg.n_kv_heads * cfg.seq_len * cfg.head_size * model.tok_embeddings.weight.element_size()
    try:
        with torch.inference_mode():
            return KVPool(model, slots)
    except (RuntimeError, MemoryError) as e:  # torch's out-of-memory errors are RuntimeErrors
        raise CommandError(f"--slots {slots}: the KV pool of {slots} slots x model.seq_len={cfg.seq_len} positions needs "
                           f"{need / 2**30:.2f} GiB on {model.tok_embeddings.weight.device}, which could not be allocated "
                           f"({str(e).splitlines()[0][:200]}): ask for fewer slots") from None


class Engine:
    """The model's one worker thread: jobs wait in a queue (at most `queue`), `slots` of them are
    generated together, one id each per turn from one batch-invariant forward (a new one's prefill
    alone); a cancelled job is dropped at its next turn."""

    def __init__(self, model, tok, slots: int, queue: int, every: float = STREAM_EVERY_S) -> None:
        self.model, self.tok, self.slots, self.queue, self.every = model, tok, slots, queue, every
        self.waiting: collections.deque[Job] = collections.deque()
        self.active: list[Job] = []
        self.cond = threading.Condition()
        self.closed = False
        self.served = self.cancelled = 0
        self.thread = threading.Thread(target=self._run, name="generation", daemon=True)
        self.pool = kv_pool(model, slots)  # the slots' keys and values, made here: a pool that cannot be is said at the start

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify()
        self.thread.join(timeout=30)

    def submit(self, *jobs: Job) -> None:
        """Queue a request's jobs (its choices), all or none."""
        with self.cond:
            free = max(0, self.slots - len(self.active))  # slots the worker is about to fill from the queue
            room = self.queue + free
            if free and not self.waiting:  # a request of more choices than that still goes when nothing waits
                room = max(room, len(jobs))
            if len(self.waiting) + len(jobs) > room:
                raise ApiError(429, f"the server is busy: {len(self.active)} replies being generated and {len(self.waiting)} "
                                    f"waiting (--queue {self.queue}); retry later", type="rate_limit_exceeded",
                               code="rate_limit_exceeded")
            self.waiting.extend(jobs)
            self.cond.notify()

    def counts(self) -> dict:
        with self.cond:
            return {"active": len(self.active), "waiting": len(self.waiting), "slots": self.slots, "queue": self.queue,
                    "served": self.served, "cancelled": self.cancelled, "free_slots": len(self.pool.free)}  # the KV pool's

    def _run(self) -> None:
        from model.generate import Generation, step_together

        while True:
            with self.cond:
                while not self.closed and not self.waiting and not self.active:
                    self.cond.wait()
                if self.closed:
                    return
                while self.waiting and len(self.active) < self.slots:
                    self.active.append(self.waiting.popleft())
                turn = list(self.active)
            live = []
            for job in turn:
                r = job.req
                try:
                    if job.cancelled:
                        self._end(job, None)
                        continue
                    if job.gen is None:  # the prefill happens in its first step, below
                        job.gen = Generation(self.model, job.prompt, r.max_tokens, r.temperature, r.top_k, r.top_p,
                                             r.repetition_penalty, self.tok.eos, True, r.seed if job.seed is None else job.seed,
                                             keep_prompt_logits=r.echo and r.logprobs is not None, pool=self.pool)
                        job.text = TextStream(self.tok, r.stop)
                    live.append(job)
                except Exception as e:  # noqa: BLE001 - one request's failure ends it, not the server
                    self._fail(job, e)
            try:  # every slot's next id from one forward (model/decode.py: each row the bits it gets alone)
                drawn = step_together([job.gen for job in live])
            except Exception as e:  # noqa: BLE001
                for job in live:
                    self._fail(job, e)
                continue
            for job, nxt in zip(live, drawn):
                try:
                    if job.req.logprobs is not None:
                        job.score()
                    if nxt is not None:
                        piece, stopped = job.text.add(nxt)
                        job.send(piece, time.perf_counter(), self.every)
                        if stopped:
                            self._end(job, "stop")
                            continue
                    if job.gen.done:
                        job.send(job.text.finish(), time.perf_counter(), self.every)
                        self._end(job, job.gen.finish)
                except Exception as e:  # noqa: BLE001
                    self._fail(job, e)

    def _fail(self, job: Job, e: Exception) -> None:
        log.error("serve: a request failed: %s: %s", type(e).__name__, e)
        job.emit(("error", f"{type(e).__name__}: {e}"))
        if job in self.active:
            self._end(job, None)

    def _end(self, job: Job, finish: str | None) -> None:
        if job.gen is not None:
            job.gen.close()  # its slot of the pool, for the next
        with self.cond:
            self.active.remove(job)
            self.served += finish is not None
            self.cancelled += job.cancelled
        if finish is not None:
            job.flush()
            done = len(job.gen.ids) - len(job.prompt)
            job.emit(("end", finish, {"prompt_tokens": len(job.prompt), "completion_tokens": done,
                                      "total_tokens": len(job.prompt) + done}))


class ToolParser:
    """The run's tool-call parser as the server calls it: text -> the calls in it, always on one thread of its own,
    off the event loop (`run`), so a slow parser delays only the replies it reads; a user's (`module:function`) runs
    in this process's worker (objectives/worker.py, not thread-safe: that thread makes its calls one at a time),
    each call bounded by `timeout_s`: past it the worker is killed and the request gets 504, a parser that raises or
    returns no list 500, both naming it (docs/serving.md, "Tools and reasoning")."""

    def __init__(self, fn=None, spec: str = "minimind", timeout_s: float | None = None) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from objectives.tools import parse_tool_calls

        self.fn, self.spec, self.timeout_s = fn or parse_tool_calls, spec, timeout_s
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="parser")

    def __call__(self, text: str) -> list:
        """The calls in `text` (on the parser's thread: through `run`); ApiError 504 / 500 naming the parser."""
        from objectives.worker import Late, Raised, Remote, described

        if not isinstance(self.fn, Remote):
            return self.fn(text)
        try:
            calls = self.fn.call((text,), {}, self.timeout_s)
        except Late:
            raise ApiError(504, f"the run's tool-call parser train.agent.parser={self.spec} did not return within "
                                f"{self.timeout_s:g} s (the run's train.agent.tool_timeout_s): its process was killed",
                           type="server_error", code="parser_timeout") from None
        except Raised as e:
            raise ApiError(500, f"the run's tool-call parser train.agent.parser={self.spec} raised: {described(e)}",
                           type="server_error", code="parser_failed") from None
        if not isinstance(calls, list):
            raise ApiError(500, f"the run's tool-call parser train.agent.parser={self.spec} returned {type(calls).__name__}: "
                                f"expected a list of calls", type="server_error", code="parser_failed")
        for k, call in enumerate(calls):  # what a reply cannot carry is the parser's failure, named (found by review)
            if not isinstance(call, dict):
                continue  # skipped, as MiniMind's server skips a call that is not an object
            try:
                if not isinstance(call.get("name", ""), str):
                    raise TypeError(f"its name is {type(call['name']).__name__}, not a string")
                json.dumps(call.get("arguments", {}), ensure_ascii=False, allow_nan=False)
            except (TypeError, ValueError) as e:
                raise ApiError(500, f"the run's tool-call parser train.agent.parser={self.spec} returned call {k}, which a reply "
                                    f"cannot carry ({e}): expected {{name: a string, arguments: JSON}}", type="server_error",
                               code="parser_failed") from None
        return calls

    async def run(self, fn, *args):
        """fn(*args) - read_reply or a ReplyDeltas' finish, which call this parser - on the parser's thread, awaited."""
        return await asyncio.get_running_loop().run_in_executor(self.thread, fn, *args)

    def close(self) -> None:
        self.thread.shutdown(wait=False, cancel_futures=True)


def make_app(model, tok, name: str, api_key: str | None = None, slots: int = 4, queue: int = 16,
             max_request_bytes: int = MAX_REQUEST_BYTES, parser: ToolParser | None = None):
    """The FastAPI application over a loaded model and its tokenizer (`name`: the model id it reports;
    `parser`: the run's tool-call parser, train.agent.parser, tool_parser; default MiniMind's)."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException

    from data.chat import template_of

    parser = parser or ToolParser()
    template, seq_len, vocab = template_of(tok), model.cfg.seq_len, model.cfg.vocab_size
    engine = Engine(model, tok, slots, queue)
    created = int(time.time())
    card = {"id": name, "object": "model", "created": created, "owned_by": "minimind-resume"}

    @asynccontextmanager
    async def lifespan(_app):
        engine.start()
        yield
        engine.close()
        parser.close()

    app = FastAPI(title="minimind-resume", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine

    @app.exception_handler(ApiError)
    async def api_error(_request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(_request, e: HTTPException):
        return JSONResponse(ApiError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def server_error(_request, e: Exception):
        log.exception("serve: an error answering a request")
        return JSONResponse(ApiError(500, f"{type(e).__name__}: {e}", type="server_error").body(), status_code=500)

    @app.middleware("http")
    async def authorize(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return JSONResponse(ApiError(401, "Incorrect or missing API key: send the header 'Authorization: Bearer KEY' "
                                                  "with the server's key", code="invalid_api_key").body(), status_code=401)
        return await call_next(request)

    @app.get("/health")
    async def health():
        return {"status": "ok", **engine.counts()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def one_model(model_id: str):
        if model_id != name:
            raise ApiError(404, f"The model '{model_id}' does not exist: this server serves '{name}'", "model", code="model_not_found")
        return card

    def token_text(i: int) -> str:
        return tok.decode([i])

    def legacy_logprobs(entries: list) -> dict:
        """Completions' logprobs: tokens, token_logprobs, top_logprobs (the k likeliest and the drawn id, as vLLM), text_offset."""
        tokens = [token_text(i) for i, _, _ in entries]
        tops = []
        for (i, lp, top), text in zip(entries, tokens):
            tops.append(None if lp is None else {**{token_text(j): v for j, v in top}, **({} if any(j == i for j, _ in top)
                                                                                           else {text: lp})})
        offsets = [0]
        for t in tokens[:-1]:
            offsets.append(offsets[-1] + len(t))
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries], "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(entries: list) -> dict:
        def one(i: int, lp: float) -> dict:
            text = token_text(i)
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
        return {"content": [{**one(i, lp), "top_logprobs": [one(j, v) for j, v in top]} for i, lp, top in entries]}

    def start(req: ChatRequest, prompts: list[list[int]]) -> tuple[list[Job], asyncio.Queue]:
        """Queue each prompt's n choices (choice c seeded from the request's seed and c); events come as (index, event)."""
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        jobs = [Job(req, prompt, lambda event, index=p * req.n + c: loop.call_soon_threadsafe(events.put_nowait, (index, event)),
                    seed=choice_seed(req.seed, c)) for p, prompt in enumerate(prompts) for c in range(req.n)]
        engine.submit(*jobs)
        return jobs, events

    def usage(req: ChatRequest, jobs: list[Job], ends: list[dict]) -> dict:
        prompt = sum(len(j.prompt) for j in jobs[::req.n])
        done = sum(e["completion_tokens"] for e in ends)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

    async def results(request: Request, jobs: list[Job], events: asyncio.Queue) -> list[tuple[str, str, dict]] | None:
        """Each job's (text, finish_reason, usage) once all have ended; None when the client left first."""
        texts, ends = [[] for _ in jobs], [None] * len(jobs)
        try:
            while any(e is None for e in ends):
                try:
                    index, event = await asyncio.wait_for(events.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return None
                    continue
                if event[0] == "delta":
                    texts[index].append(event[1])
                elif event[0] == "error":
                    raise ApiError(500, event[1], type="server_error")
                else:
                    ends[index] = ("".join(texts[index]), event[1], event[2])
            return ends
        finally:
            for job in jobs:
                job.cancelled = True  # a reply that ended is out of the engine already; one whose client left is dropped

    def streaming(chunks) -> StreamingResponse:
        return StreamingResponse(chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse_request(await read_body(request, max_request_bytes), vocab)
        prompt = prompt_ids(tok, template, req, seq_len)
        jobs, events = start(req, [prompt])
        head = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": name}
        calls = parser if req.tool_choice != "none" else None
        if req.stream:
            splitters = [ReplyDeltas(req.template_kwargs.get("open_thinking", False), calls) for _ in jobs]

            def chunk(index: int, delta: dict, finish: str | None = None, entries: list | None = None) -> dict:
                return {**head, "object": "chat.completion.chunk", "choices": [
                    {"index": index, "delta": delta, "finish_reason": finish,
                     "logprobs": None if entries is None else chat_logprobs(entries)}]}

            def piece(index: int, text: str | None, entries: list | None, first: bool = False) -> list[dict]:
                if first:
                    return [chunk(index, {"role": "assistant", "content": ""})]
                deltas = splitters[index].add(text or "")
                if entries and not deltas:
                    deltas = [{}]
                return [chunk(index, d, None, entries if k == 0 else None) for k, d in enumerate(deltas)]

            async def last(index: int, finish: str) -> list[dict]:  # the calls read on the parser's thread
                deltas, found = await parser.run(splitters[index].finish) if calls else splitters[index].finish()
                return [*(chunk(index, d) for d in deltas), chunk(index, {}, "tool_calls" if found else finish)]
            return streaming(stream(req, jobs, events, head, piece, last))
        ends = await results(request, jobs, events)
        if ends is None:
            return JSONResponse({}, status_code=499)
        choices = []
        for i, (job, (text, finish, _)) in enumerate(zip(jobs, ends)):
            content, reasoning, found = await parser.run(read_reply, text, calls) if calls else read_reply(text)
            message = {"role": "assistant", "content": content}
            if reasoning is not None:
                message["reasoning_content"] = reasoning
            if found:
                message["tool_calls"], finish = found, "tool_calls"
            choices.append({"index": i, "message": message, "finish_reason": finish,
                            "logprobs": None if req.logprobs is None else chat_logprobs(job.entries)})
        return {**head, "object": "chat.completion", "usage": usage(req, jobs, [e[2] for e in ends]), "choices": choices}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse_completion(await read_body(request, max_request_bytes), tok, vocab)
        for i, prompt in enumerate(req.prompts):
            check_fits(prompt, req.max_tokens, seq_len, "prompt" if len(req.prompts) == 1 else f"prompt[{i}]")
        jobs, events = start(req, req.prompts)
        head = {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": name}
        if req.stream:
            def piece(index: int, text: str | None, entries: list | None, first: bool = False, finish: str | None = None) -> list[dict]:
                if first:
                    return []
                return [{**head, "object": "text_completion", "choices": [
                    {"index": index, "text": text or "", "finish_reason": finish,
                     "logprobs": None if entries is None else legacy_logprobs(entries)}]}]

            async def last(index: int, finish: str) -> list[dict]:
                return piece(index, None, None, finish=finish)
            return streaming(stream(req, jobs, events, head, piece, last))
        ends = await results(request, jobs, events)
        if ends is None:
            return JSONResponse({}, status_code=499)
        choices = []
        for i, (job, (text, finish, _)) in enumerate(zip(jobs, ends)):
            entries = ((job.prompt_entries or []) if req.echo else []) + job.entries
            choices.append({"index": i, "text": (tok.decode(job.prompt) if req.echo else "") + text, "finish_reason": finish,
                            "logprobs": None if req.logprobs is None else legacy_logprobs(entries)})
        return {**head, "object": "text_completion", "usage": usage(req, jobs, [e[2] for e in ends]), "choices": choices}

    async def stream(req: ChatRequest, jobs: list[Job], events: asyncio.Queue, head: dict, piece, last):
        """Server-sent events: each choice's pieces as they come (`piece` makes the chunks), its end (`last`, awaited:
        a chat reply's tool calls are read then), the usage when asked, `data: [DONE]` last; an error (the
        generation's, the parser's) as OpenAI's error body, then `data: [DONE]`."""
        def sse(body: dict) -> str:
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        try:
            for index in range(len(jobs)):
                for body in piece(index, None, None, first=True):
                    yield sse(body)
            sent, echoed, ends, pending = [0] * len(jobs), [not req.echo] * len(jobs), [None] * len(jobs), None
            while any(e is None for e in ends):
                (index, event), pending = pending or await events.get(), None
                if event[0] == "error":
                    yield sse(ApiError(500, event[1], type="server_error").body())
                    break
                job, text = jobs[index], None
                if event[0] == "delta":  # the pieces that came while the last chunk was written go out as one
                    text = event[1]
                    while pending is None and not events.empty():
                        nxt = events.get_nowait()
                        text, pending = (text + nxt[1][1], None) if nxt[0] == index and nxt[1][0] == "delta" else (text, nxt)
                entries = None
                if req.logprobs is not None:
                    entries, sent[index] = job.entries[sent[index]:], len(job.entries)
                if not echoed[index]:
                    echoed[index] = True
                    text = tok.decode(job.prompt) + (text or "")
                    entries = None if entries is None else (job.prompt_entries or []) + entries
                if text is not None or entries:
                    for body in piece(index, text, entries):
                        yield sse(body)
                if event[0] == "end":
                    try:
                        bodies = await last(index, event[1])
                    except ApiError as e:  # the parser's 504 or 500: the status went out with the first chunk
                        yield sse(e.body())
                        break
                    for body in bodies:
                        yield sse(body)
                    ends[index] = event[2]
            else:
                if req.include_usage:
                    yield sse({**head, "object": "chat.completion.chunk" if req.messages else "text_completion", "choices": [],
                               "usage": usage(req, jobs, ends)})
            yield "data: [DONE]\n\n"
        finally:
            for job in jobs:
                job.cancelled = True  # a client that went away mid-stream: its slot is freed at its next turn

    return app


HELP = "an OpenAI-compatible HTTP server over the checkpoint: POST /v1/chat/completions, GET /v1/models (docs/serving.md)"


def arguments(p) -> None:
    from pathlib import Path

    from .arguments import number, place

    p.add_argument("path", type=place, help="a checkpoint folder or a run folder")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: this machine only)")
    p.add_argument("--port", type=number(int, 0, 65535), default=8000, help="the port (0: any free one, said on stderr; default 8000)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/ (401 without it); visible in `ps`: "
                                     "prefer --api-key-file or the environment variable MINIMIND_SERVE_API_KEY")
    p.add_argument("--api-key-file", type=Path, help="the key, read from this file (its first line)")
    p.add_argument("--max-request-bytes", type=number(int, 1), default=MAX_REQUEST_BYTES,
                   help="a request body past this many bytes is answered 413 before the rest is read (default 1 MiB)")
    p.add_argument("--model-name", help="the model id the server reports (default: the run folder's name)")
    p.add_argument("--fp32", action="store_true", help="serve the fp32 weights as trained (those `eval` scores) instead of the "
                                                       "fp16 weights file (`chat`'s)")
    p.add_argument("--slots", type=number(int, 1), default=4, help="replies generated in turn, one token each per turn (default 4)")
    p.add_argument("--queue", type=number(int, 0), default=16, help="requests waiting for a slot before more get 429 (default 16)")


def model_name(path) -> str:
    """The id a run is served under: its run folder's name (a step folder's run's)."""
    from pathlib import Path

    p = Path(path).resolve()
    return p.parents[1].name if p.name.startswith("step_") and p.parent.name == "checkpoints" else p.name


def api_key_of(args) -> str | None:
    """The key every /v1/ request must send: `--api-key-file`'s first line, `--api-key`, or the
    environment's MINIMIND_SERVE_API_KEY (one of them; none: no key). CommandError (exit 2) for two at
    once, an empty key or a file that cannot be read."""
    import os

    from .arguments import CommandError

    if args.api_key is not None and args.api_key_file is not None:
        raise CommandError("give the key once: --api-key or --api-key-file, not both")
    if args.api_key_file is not None:
        try:
            lines = args.api_key_file.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise CommandError(f"--api-key-file {args.api_key_file}: cannot read it ({e})") from None
        key, where = (lines[0].strip() if lines else ""), f"--api-key-file {args.api_key_file} (its first line)"
    elif args.api_key is not None:
        key, where = args.api_key, "--api-key"
    elif API_KEY_ENV in os.environ:
        key, where = os.environ[API_KEY_ENV], API_KEY_ENV
    else:
        return None
    if not key.strip():
        raise CommandError(f"the API key from {where} is empty")
    return key


def tool_parser(path) -> ToolParser:
    """The run's tool-call parser: its train.agent.parser (objectives/agent.py), loaded as training loads it
    (MiniMind's `<tool_call>{json}</tool_call>` for `minimind`, every run that is not an agent's included), bounded
    by the run's train.agent.tool_timeout_s as training bounds it."""
    from checkpoint import storage
    from objectives import rewards
    from objectives.tools import parse_tool_calls

    from objectives.agent import AgentConfig

    manifest = storage.find_checkpoint(path)[1]
    agent = ((manifest.get("config") or {}).get("train") or {}).get("agent", {})
    spec = agent.get("parser", "minimind")
    fn, _ = rewards.load(spec, "train.agent.parser", {"minimind": parse_tool_calls})
    return ToolParser(fn, spec, float(agent.get("tool_timeout_s", AgentConfig.tool_timeout_s)))


def run(args) -> int:
    """`serve RUN [--host --port --api-key(-file) --slots --queue --max-request-bytes]`: load the run's model, then
    serve until SIGINT/SIGTERM."""
    import socket
    import sys

    from .arguments import CommandError

    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise CommandError(f"serve needs FastAPI and uvicorn ({e.name} is missing): {sys.executable} -m pip install -r "
                           f"{REQUIREMENTS}") from None
    if args.slots < 1 or args.queue < 0:
        raise CommandError(f"--slots must be >= 1 and --queue >= 0, got {args.slots} and {args.queue}")
    api_key = api_key_of(args)
    from checkpoint import storage
    from weights import load_model_and_tokenizer

    folder = storage.find_checkpoint(args.path)[0]  # found (and named) once: the model, tokenizer and parser of one step
    model, tok = load_model_and_tokenizer(folder, fp32=args.fp32)
    from data.chat import template_of

    template_of(tok)  # a tokenizer without a chat template: said now, not at the first request
    name = args.model_name or model_name(args.path)
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot listen on {args.host}:{args.port}: {e.strerror}") from None
    port = sock.getsockname()[1]
    app = make_app(model, tok, name, api_key, args.slots, args.queue, args.max_request_bytes, tool_parser(folder))  # its KV pool: one too big is said here
    where = f"[{args.host}]" if family == socket.AF_INET6 else args.host
    print(f"serve: {name} ({model.num_parameters():,} parameters, context {model.cfg.seq_len}) at http://{where}:{port}/v1 "
          f"({args.slots} slots, queue {args.queue}{', API key required' if api_key else ''}); Ctrl-C stops",
          file=sys.stderr, flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5)).run(sockets=[sock])
    return 0
