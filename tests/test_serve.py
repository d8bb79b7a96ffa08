"""The OpenAI-compatible server (cli/serve.py, docs/serving.md): the official `openai` client gets `chat`'s
reply, streamed or not; bad input is 400 with OpenAI's error body and the server goes on (413 past the
size limit); completions with echo and logprobs score as `eval` does through lm-evaluation-harness;
tools and reasoning as MiniMind's own server gives them; replies decoded together are each the bits
of the reply alone; a full queue is 429; a client that leaves frees its slot."""
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import launch

DOCS = launch.ROOT / "docs" / "serving.md"
ASK = [{"role": "user", "content": "What does os.path.join do?"}]


def tiny_model(seq_len: int = 96):
    from model import MiniMindLM, ModelConfig

    torch.manual_seed(0)
    return MiniMindLM(ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=seq_len, vocab_size=259)).eval()


@pytest.fixture
def client():
    """A server over a random tiny model with the byte tokenizer, in this process (FastAPI's TestClient)."""
    from fastapi.testclient import TestClient

    from cli.serve import make_app
    from data.tokenizer import ByteTokenizer

    with TestClient(make_app(tiny_model(), ByteTokenizer(), "tiny", slots=2, queue=2)) as c:
        yield c


def events(lines) -> list[dict]:
    """The JSON chunks of a server-sent event stream; asserts it ends with `data: [DONE]` and nothing after."""
    lines = [line for line in lines if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    return [json.loads(line[6:]) for line in lines[:-1]]


def streamed_text(chunks: list[dict]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


# ---------------------------------------------------------------------------------------------- in this process

@pytest.mark.unit
def test_a_streamed_reply_is_the_non_streamed_one_in_openai_chunks_ending_with_done_and_greedy_is_chats(client):
    from cli.chat import chat_reply
    from data.tokenizer import ByteTokenizer

    body = {"model": "tiny", "messages": ASK, "temperature": 0, "max_tokens": 40}
    whole = client.post("/v1/chat/completions", json=body).json()
    choice = whole["choices"][0]
    assert whole["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
    text, ids = chat_reply(tiny_model(), ByteTokenizer(), ASK, 40, 0.0)
    assert choice["message"]["content"] == text and whole["usage"]["completion_tokens"] == len(ids)
    assert choice["finish_reason"] == ("length" if len(ids) == 40 else "stop")
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        chunks = events(r.iter_lines())
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert streamed_text(chunks) == text and chunks[-2]["choices"][0]["finish_reason"] == choice["finish_reason"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"


@pytest.mark.unit
def test_a_seed_gives_the_same_sampled_reply_twice_and_another_seed_another(client):
    body = {"messages": ASK, "temperature": 1.0, "top_p": 0.95, "max_tokens": 30}
    replies = [client.post("/v1/chat/completions", json={**body, "seed": s}).json()["choices"][0]["message"]["content"]
               for s in (7, 7, 8)]
    assert replies[0] == replies[1] != replies[2]


@pytest.mark.unit
@pytest.mark.parametrize("body, param", [
    (b'{"messages": [', None),
    (b'["not", "an", "object"]', None),
    ({"messages": []}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": ASK, "temperature": "hot"}, "temperature"),
    ({"messages": ASK, "temperature": 3}, "temperature"),
    ({"messages": ASK, "temperature": 1e-40}, "temperature"),  # found by review: its NaN draw failed every reply batched with it
    ({"messages": ASK, "repetition_penalty": 1e-40}, "repetition_penalty"),
    ({"messages": ASK, "top_p": 0}, "top_p"),
    ({"messages": ASK, "max_tokens": 1.5}, "max_tokens"),
    ({"messages": ASK, "max_tokens": 10_000}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x" * 200}]}, "messages"),
    ({"messages": ASK, "stop": ["a", ""]}, "stop"),
    ({"messages": ASK, "seed": "seven"}, "seed"),
    ({"messages": ASK, "stream": "yes"}, "stream"),
    ({"messages": ASK, "n": 9}, "n"),
    ({"messages": ASK, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": ASK, "top_logprobs": 2}, "top_logprobs"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "repetition_penalty": Infinity}', "repetition_penalty"),
    (b'{"messages": [{"role": "user", "content": "hi", "weight": NaN}]}', "messages[0].weight"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "top_p": -1e999}', "top_p"),
    # found by review (500 with a traceback): an integer past Python's 4,300-digit conversion limit, lone surrogates
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": ' + b"9" * 5000 + b"}", None),
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "metadata": {"\\udfff": 1}}', "metadata"),
    (b'{"messages": [{"role": "user", "content": "[{"}], "metadata": {"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}",
     "metadata.a" + "[0]" * 30),
])
def test_bad_input_is_400_with_openais_error_body_naming_the_field_and_the_server_keeps_serving(client, body, param):
    r = client.post("/v1/chat/completions", **({"content": body} if isinstance(body, bytes) else {"json": body}))
    assert r.status_code == 400
    error = r.json()["error"]
    assert set(error) >= {"message", "type", "param"} and error["type"] == "invalid_request_error" and error["param"] == param
    assert error["message"]
    r = client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.fixture
def live():
    """A server over a random tiny model in a uvicorn thread on a free port, as `serve` runs it (its real
    HTTP parsing, which TestClient skips); yields its port."""
    import socket

    import uvicorn

    from cli.serve import make_app
    from data.tokenizer import ByteTokenizer

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(make_app(tiny_model(), ByteTokenizer(), "tiny", max_request_bytes=4096),
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    launch.wait_for(lambda: server.started, timeout=60)
    yield sock.getsockname()[1]
    server.should_exit = True
    thread.join(timeout=30)


def answer(port: int, head: bytes, parts: list[bytes], wait: float) -> tuple[bytes, int]:
    """Send a request's head, then its body's parts one by one while the server has not answered (up to
    `wait` seconds after each): (the server's answer, how many parts were sent before it came)."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head)
        got, sent = b"", 0
        for part in parts:
            s.sendall(part)
            sent += 1
            s.settimeout(wait)
            try:
                got = s.recv(65536)
            except TimeoutError:
                continue
            break
        s.settimeout(30)
        while got and (b"\r\n\r\n" not in got or not got.rstrip().endswith(b"}")):
            more = s.recv(65536)
            if not more:
                break
            got += more
    return got, sent


@pytest.mark.unit
def test_a_body_past_max_request_bytes_is_413_before_the_rest_is_read_whether_its_length_is_said_or_chunked(live):
    body = json.dumps({"messages": ASK, "max_tokens": 2}).encode()
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    ok, _ = answer(live, head + b"Content-Length: %d\r\n\r\n" % len(body), [body], 30)
    assert ok.startswith(b"HTTP/1.1 200"), ok[:200]
    # 50 MiB announced: the answer comes after the first KiB, the rest never sent (a server that read on would wait for it)
    big, _ = answer(live, head + b"Content-Length: %d\r\n\r\n" % (50 << 20), [b" " * 1024], 10)
    assert big.startswith(b"HTTP/1.1 413"), big[:200]
    error = json.loads(big.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["code"] == "request_too_large" and "4096" in error["message"]
    # chunked, no length said: the answer comes once the bytes that came pass the limit
    chunk = b" " * 1024
    chunked, sent = answer(live, head + b"Transfer-Encoding: chunked\r\n\r\n", [b"%x\r\n%s\r\n" % (len(chunk), chunk)] * 16, 1)
    assert chunked.startswith(b"HTTP/1.1 413") and sent <= 8, (chunked[:200], sent)


@pytest.mark.unit
def test_the_api_key_comes_from_a_file_or_the_environment_and_given_twice_or_empty_is_a_command_error(tmp_path, monkeypatch):
    from cli import _parser
    from cli.arguments import CommandError
    from cli.serve import API_KEY_ENV, api_key_of

    def key(*flags: str):
        return api_key_of(_parser().parse_args(["serve", str(tmp_path), *flags]))

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert key() is None
    (tmp_path / "key").write_text("sesame\n")
    assert key("--api-key-file", str(tmp_path / "key")) == "sesame" and key("--api-key", "open") == "open"
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert key() == "from-env" and key("--api-key-file", str(tmp_path / "key")) == "sesame"
    (tmp_path / "empty").write_text("\n")
    for flags, said in ((["--api-key", "a", "--api-key-file", str(tmp_path / "key")], "not both"),
                        (["--api-key-file", str(tmp_path / "empty")], "empty"),
                        (["--api-key-file", str(tmp_path / "missing")], "missing")):
        with pytest.raises(CommandError, match=said):
            key(*flags)


@pytest.mark.unit
def test_with_an_api_key_a_request_without_it_gets_401_and_with_it_is_served():
    from fastapi.testclient import TestClient

    from cli.serve import make_app
    from data.tokenizer import ByteTokenizer

    with TestClient(make_app(tiny_model(), ByteTokenizer(), "tiny", api_key="sesame")) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = c.get("/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert c.get("/v1/models", headers={"Authorization": "Bearer sesame"}).status_code == 200
        assert c.get("/health").status_code == 200


@pytest.mark.unit
def test_a_stop_string_ends_the_reply_before_it_and_no_piece_of_it_or_of_a_broken_character_is_sent():
    from cli.serve import TextStream
    from data.tokenizer import ByteTokenizer

    stream = TextStream(ByteTokenizer(), ["STOP", "xyz"])
    pieces = []
    for b in "héllo wor STO".encode() + b"P and more":
        piece, stopped = stream.add(b)
        pieces.append(piece)
        if stopped:
            break
    assert stopped and "".join(pieces) == "héllo wor " and all("\ufffd" not in p for p in pieces)
    assert "S" not in "".join(pieces[:-1])  # "STO" was held back until it became the stop string
    stream = TextStream(ByteTokenizer(), ["xyz"])
    text = "".join(stream.add(b)[0] for b in "naïve xy".encode()) + stream.finish()
    assert text == "naïve xy"


def job(req_overrides: dict, prompt: list[int], seen: list):
    from cli.serve import ChatRequest, Job

    req = ChatRequest(messages=[], temperature=0.9, top_p=0.9, top_k=0, repetition_penalty=1.1, max_tokens=20, stop=[], seed=1,
                      stream=True, include_usage=False)
    for k, v in req_overrides.items():
        setattr(req, k, v)
    return Job(req, prompt, seen.append)


@pytest.mark.unit
def test_replies_generated_in_turn_are_each_the_reply_generated_alone():
    from cli.serve import Engine
    from data.tokenizer import ByteTokenizer
    from model.generate import generate_ids

    model, tok = tiny_model(), ByteTokenizer()
    prompts = [[tok.bos, *b"first"], [tok.bos, *b"a second prompt"], [tok.bos, *b"3"]]
    seen = [[] for _ in prompts]
    jobs = [job({"seed": 10 + i, "max_tokens": 15 + 5 * i}, p, seen[i]) for i, p in enumerate(prompts)]
    engine = Engine(model, tok, slots=2, queue=4)
    for j in jobs:
        engine.submit(j)
    engine.start()
    try:
        while any(not s or s[-1][0] != "end" for s in seen):
            time.sleep(0.01)
    finally:
        engine.close()
    for i, (p, s) in enumerate(zip(prompts, seen)):
        alone = generate_ids(model, p, 15 + 5 * i, 0.9, 0, 0.9, 1.1, tok.eos, True, 10 + i)
        assert "".join(e[1] for e in s if e[0] == "delta") == tok.decode(alone[len(p):])
        assert s[-1][2]["completion_tokens"] == len(alone) - len(p)
    assert engine.counts()["served"] == 3


@pytest.mark.unit
def test_past_the_queue_limit_a_request_gets_429_and_a_cancelled_one_frees_its_slot_at_its_next_turn():
    from cli.serve import ApiError, Engine
    from data.tokenizer import ByteTokenizer

    model, tok = tiny_model(), ByteTokenizer()
    engine = Engine(model, tok, slots=1, queue=1)  # not started: nothing leaves the queue
    first, second, third = ([] for _ in range(3))
    engine.submit(job({"max_tokens": 60}, [tok.bos, *b"one"], first))
    engine.submit(job({"max_tokens": 5}, [tok.bos, *b"two"], second))  # one free slot and one place in the queue
    with pytest.raises(ApiError) as busy:
        engine.submit(job({}, [tok.bos], third))
    assert busy.value.status == 429 and busy.value.body()["error"]["code"] == "rate_limit_exceeded"
    leaving = engine.waiting[0]
    leaving.emit = lambda event: (first.append(event), setattr(leaving, "cancelled", True))  # gone after its first piece
    engine.start()
    try:
        while not second or second[-1][0] != "end":
            time.sleep(0.01)
    finally:
        engine.close()
    assert engine.counts() | {"active": 0} == {"active": 0, "waiting": 0, "slots": 1, "queue": 1, "served": 1, "cancelled": 1, "free_slots": 1}
    assert len(first) == 1 and first[0][0] == "delta"


# ---------------------------------------------------------------------------------------------- as users run it

@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny):
    """A tiny chat run on the built-in conversations (byte tokenizer), with a context long enough for a long stream."""
    out = tmp_path_factory.mktemp("serve") / "sft_tiny"
    code, err = launch.in_process(*tiny, "data.path=stdlib-chat", "data.format=chat", "model.seq_len=1024", "train.steps=6",
                                  "train.micro_batch=4", f"out_dir={out}")
    assert code == 0, err
    return out


ENV = {**launch.os.environ, "OMP_NUM_THREADS": "1"}


class Server:
    """`python -m checkpoint serve ...` in a child process, on a free port."""

    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen(args, cwd=launch.ROOT, stderr=subprocess.PIPE, text=True, env=ENV)
        launch.STARTED.append(self.proc)
        said = ""
        while not (found := re.search(r"at http://127\.0\.0\.1:(\d+)/v1", said)):
            line = self.proc.stderr.readline()
            assert line, f"serve ended (exit {self.proc.wait()}) before it listened:\n{said[-3000:]}"
            said += line
        self.port = int(found.group(1))
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.proc.stderr.read, daemon=True).start()  # drain
        launch.wait_for(lambda: self.health() is not None, timeout=60, proc=self.proc)

    def health(self):
        import httpx

        try:
            return httpx.get(f"{self.url}/health", timeout=20).json()  # a server on two loaded cores answers late, not never
        except httpx.HTTPError:
            return None

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def chat_cli(run, prompt: str, tokens: int) -> str:
    proc = subprocess.run([launch.PY, "-m", "checkpoint", "chat", str(run), "--prompt", prompt, "--temperature", "0",
                           "--tokens", str(tokens)], cwd=launch.ROOT, capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.endswith("\n")
    return proc.stdout[:-1]


@pytest.mark.e2e
def test_the_docs_commands_and_the_openai_client_get_chats_greedy_reply_streamed_or_not_and_a_seeded_reply_twice(run):
    from openai import OpenAI

    block = re.search(r"```bash\n(.*?)```", DOCS.read_text(), re.S).group(1)
    serve_line, *curls = [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]
    server = Server([*serve_line.replace(".venv/bin/python", launch.PY).replace("runs/sft_tiny", str(run)).split(), "--port", "0"])
    try:
        greedy = chat_cli(run, ASK[0]["content"], 48)
        outputs = []
        for line in curls:
            proc = subprocess.run(["bash", "-c", line.replace("8000", str(server.port))], capture_output=True, text=True, timeout=120)
            assert proc.returncode == 0, line + proc.stderr
            outputs.append(proc.stdout)
        assert json.loads(outputs[0])["data"][0]["id"] == "sft_tiny"
        assert json.loads(outputs[1])["choices"][0]["message"]["content"] == greedy
        hi = events(outputs[2].splitlines())
        python = re.search(r"```python\n(.*?)```", DOCS.read_text(), re.S).group(1).replace("8000", str(server.port))
        proc = subprocess.run([launch.PY, "-c", python], capture_output=True, text=True, timeout=120, env=ENV)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout == greedy + "\n" + streamed_text(hi)  # the same seed, the same streamed reply

        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list()] == ["sft_tiny"]
        reply = client.chat.completions.create(model="sft_tiny", messages=ASK, temperature=0, max_tokens=48)
        assert reply.choices[0].message.content == greedy and reply.usage.completion_tokens <= 48
        stream = client.chat.completions.create(model="sft_tiny", messages=ASK, temperature=0, max_tokens=48, stream=True)
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == greedy
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        sampled = [client.chat.completions.create(model="sft_tiny", messages=ASK, temperature=0.9, max_tokens=32, seed=11)
                   .choices[0].message.content for _ in range(2)]
        assert sampled[0] == sampled[1]
    finally:
        server.stop()


@pytest.mark.e2e
def test_a_client_that_leaves_mid_stream_frees_its_slot_and_past_the_queue_a_request_gets_429(run):
    import httpx

    server = Server([launch.PY, "-m", "checkpoint", "serve", str(run), "--port", "0", "--slots", "1", "--queue", "1"])
    long = {"messages": ASK, "temperature": 0.9, "seed": 1, "max_tokens": 900, "stream": True}
    try:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            with http.stream("POST", "/v1/chat/completions", json=long) as first:
                assert first.status_code == 200
                next(first.iter_lines())  # the first chunk arrived; then this client goes away
            launch.wait_for(lambda: server.health()["active"] == 0, timeout=60)
            assert server.health() | {"active": 0} == {"status": "ok", "active": 0, "waiting": 0, "slots": 1, "queue": 1, "served": 0,
                                                         "cancelled": 1, "free_slots": 1}
            # a slot held by a long stream that is not read, one request waiting: the next gets 429
            with http.stream("POST", "/v1/chat/completions", json=long) as holder:
                waiting = []
                thread = threading.Thread(target=lambda: waiting.append(http.post("/v1/chat/completions", json={
                    "messages": ASK, "max_tokens": 8})))
                thread.start()
                launch.wait_for(lambda: (server.health() or {}).get("waiting") == 1, timeout=120)
                busy = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 8})
                assert busy.status_code == 429 and busy.json()["error"]["code"] == "rate_limit_exceeded"
                assert holder.status_code == 200
            thread.join(timeout=120)
            assert waiting and waiting[0].status_code == 200
            launch.wait_for(lambda: server.health()["active"] == 0, timeout=60)
            assert server.health()["free_slots"] == 1  # every reply's KV slot back in the pool
    finally:
        server.stop()


@pytest.mark.e2e
def test_a_lora_run_and_a_minimind3_shaped_moe_run_are_served_with_chats_reply_and_scored_by_eval(tiny, tmp_path):
    """Any model family here: a LoRA run (its adapters over its pinned base) and a MiniMind-3 shape (q/k
    norm, an MoE), each loaded as `chat` loads it."""
    from fastapi.testclient import TestClient

    from cli.chat import chat_reply
    from cli.serve import make_app
    from objectives.benchmark import evaluate_tasks, read_tasks
    from weights import load_model, load_tokenizer

    chat = ["data.path=stdlib-chat", "data.format=chat", "model.seq_len=96", "train.steps=2"]
    for name, extra in (("base", []), ("lora", ["train.lora.rank=4", f"model.init_from={tmp_path / 'base'}"]),
                        ("moe", ["model.qk_norm=true", "model.moe.experts=4", "model.moe.top_k=2"])):
        code, err = launch.in_process(*tiny, *chat, *extra, f"out_dir={tmp_path / name}")
        assert code == 0, err
    for name in ("lora", "moe"):
        model, tok = load_model(tmp_path / name), load_tokenizer(tmp_path / name)
        with TestClient(make_app(model, tok, name)) as c:
            got = c.post("/v1/chat/completions", json={"messages": ASK, "temperature": 0, "max_tokens": 16}).json()
        assert got["choices"][0]["message"]["content"] == chat_reply(model, tok, ASK, 16, 0.0)[0]
        scores = evaluate_tasks(load_model(tmp_path / name, fp32=True), tok, [read_tasks("arith")[0]])
        assert scores["overall"]["items"] == 100 and 0 <= scores["overall"]["acc"] <= 1


# ---------------------------------------------------------------------------------------------- completions, logprobs, n

@pytest.mark.unit
def test_completions_echo_gives_each_prompt_ids_log_softmax_and_a_string_prompt_is_generates_continuation(client):
    from cli.generate import generate_text
    from data.tokenizer import ByteTokenizer

    tok, model = ByteTokenizer(), tiny_model()
    prompt = [tok.bos, *b"The sum of 3 and 4 is"]
    got = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": 2, "temperature": 0}).json()
    (choice,) = got["choices"]
    lp = choice["logprobs"]
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([prompt]))[0][0].float(), -1)
    wanted = reference[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None and len(lp["tokens"]) == len(prompt) + 1
    assert torch.allclose(torch.tensor(lp["token_logprobs"][1:len(prompt)]), wanted, rtol=1e-5, atol=1e-6)
    drawn = int(reference[-1].argmax())  # greedy: the id drawn after the prompt is the likeliest, and is the likeliest listed
    assert lp["token_logprobs"][-1] == pytest.approx(float(reference[-1, drawn]), abs=1e-5) == max(lp["top_logprobs"][-1].values())
    assert choice["text"] == tok.decode(prompt) + tok.decode([drawn]) and got["usage"]["prompt_tokens"] == len(prompt)
    assert all(len(top) in (2, 3) for top in lp["top_logprobs"][1:]) and lp["text_offset"][:2] == [0, len(lp["tokens"][0])]
    text = client.post("/v1/completions", json={"prompt": "Once upon", "max_tokens": 12, "temperature": 0}).json()["choices"][0]["text"]
    assert "Once upon" + text == generate_text(model, "Once upon", 12, 0.0, tok=tok)


@pytest.mark.unit
def test_n_choices_are_each_the_reply_alone_seeded_from_the_seed_and_their_index_streamed_or_not(client):
    from cli.serve import choice_seed

    body = {"prompt": ["Hello", "A second prompt"], "max_tokens": 10, "temperature": 1.0, "top_p": 1.0, "seed": 5, "n": 3}
    got = client.post("/v1/completions", json=body).json()
    assert [c["index"] for c in got["choices"]] == list(range(6))
    for p, prompt in enumerate(body["prompt"]):
        for c in range(3):
            alone = client.post("/v1/completions", json={**body, "prompt": prompt, "n": 1, "seed": choice_seed(5, c)}).json()
            assert got["choices"][p * 3 + c]["text"] == alone["choices"][0]["text"]
    assert len({c["text"] for c in got["choices"][:3]}) > 1  # the choices differ
    with client.stream("POST", "/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        chunks = events(r.iter_lines())
    for i, choice in enumerate(got["choices"]):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == choice["text"] and mine[-1]["finish_reason"] == choice["finish_reason"]
    assert chunks[-1]["usage"] == got["usage"]
    chat = {"messages": ASK, "max_tokens": 8, "temperature": 1.0, "seed": 9, "n": 2}
    both = client.post("/v1/chat/completions", json=chat).json()["choices"]
    for c in range(2):
        alone = client.post("/v1/chat/completions", json={**chat, "n": 1, "seed": choice_seed(9, c)}).json()["choices"][0]
        assert both[c]["message"]["content"] == alone["message"]["content"]


@pytest.mark.unit
def test_chat_logprobs_list_each_drawn_token_with_its_likeliest_and_models_by_id(client):
    got = client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 6, "temperature": 0, "logprobs": True,
                                                    "top_logprobs": 3}).json()
    content = got["choices"][0]["logprobs"]["content"]
    assert len(content) >= got["usage"]["completion_tokens"] and all(len(e["top_logprobs"]) == 3 for e in content)
    for e in content:  # greedy: each drawn token is the likeliest
        values = [t["logprob"] for t in e["top_logprobs"]]
        assert values == sorted(values, reverse=True) and e["logprob"] == values[0] and e["bytes"] == list(e["token"].encode())
    assert client.get("/v1/models/tiny").json()["id"] == "tiny"
    missing = client.get("/v1/models/gpt-4")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


@pytest.mark.unit
@pytest.mark.parametrize("body, param", [
    ({"prompt": [5, 300]}, "prompt[0]"),
    ({"prompt": [[1, 2], [-1]]}, "prompt[1]"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [["a"]]}, "prompt[0]"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"prompt": "hi", "logprobs": -1}, "logprobs"),
    ({"prompt": "hi", "echo": "yes"}, "echo"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "max_tokens": 200}, "max_tokens"),
    ({"prompt": "x" * 100}, "prompt"),
])
def test_a_bad_completions_request_is_400_naming_the_field(client, body, param):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.json()


MIXED = [  # choices whose lengths in characters, bytes and byte tokens disagree, so acc_norm is tested (as tests/test_eval.py)
    {"question": "猫的英文是什么？", "A": "cat", "B": "狗", "C": "a small bird", "D": "鱼类", "answer": "A"},
    {"question": "Which is a fruit?", "A": "苹果", "B": "stone", "C": "桌子和椅子", "D": "river bank", "answer": "A"},
    {"question": "1 + 1 = ?", "A": "二", "B": "two", "C": "3", "D": "eleven", "answer": "B"},
]


@pytest.mark.e2e
def test_lm_evals_local_completions_through_the_server_scores_as_eval_does_item_by_item(run, tmp_path):
    """docs/serving.md's lm-eval commands: the harness's `local-completions` model, driving our server,
    gives `python -m checkpoint eval`'s acc and acc_norm per task, its picks item by item, and its
    perplexity (documents within one window), on docs/eval.md's local tasks."""
    import shlex

    from objectives import benchmark

    items = [*({"question": i.question, **dict(zip("ABCD", i.choices)), "answer": "ABCD"[i.answer]}
               for i in benchmark.builtin_arith()[:20]), *MIXED]
    (tmp_path / "my_task.jsonl").write_text("".join(json.dumps(i, ensure_ascii=False) + "\n" for i in items), encoding="utf-8")
    (tmp_path / "held_out.jsonl").write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in (
        "os.path.join joins one or more path components intelligently. " * 3, "天空是蓝色的。Short line.")), encoding="utf-8")
    (tmp_path / "tasks").mkdir()
    for block in re.findall(r"```yaml\n(.*?)```", (launch.ROOT / "docs" / "eval.md").read_text(), re.S):
        task = re.match(r"task: (\w+)", block).group(1)
        (tmp_path / "tasks" / f"{task}.yaml").write_text(block, encoding="utf-8")
    env = {**ENV, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(launch.ROOT)}
    proc = subprocess.run([launch.PY, "-m", "checkpoint", "eval", str(run), "--tasks", "my_task.jsonl", "text:my_task.jsonl",
                           "--perplexity", "held_out.jsonl", "--out", "results.json"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours = json.loads((tmp_path / "results.json").read_text())

    block = re.findall(r"```bash\n(.*?)```", DOCS.read_text(), re.S)[1]
    serve_line, *commands = [line.strip() for line in block.splitlines() if line.strip()]
    assert serve_line.endswith(" &") and len(commands) == 1
    args = shlex.split(serve_line[:-2].replace(".venv/bin/python", launch.PY).replace("runs/sft_tiny", str(run)))
    server = Server([*args[:args.index("--port")], "--port", "0"])
    try:
        proc = subprocess.run([launch.PY, "-m", "checkpoint", "export", str(run), "--format", "hf", "--out", str(tmp_path / "hf")],
                              capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        for line in commands:
            line = line.replace(".venv/bin/python", launch.PY).replace(".venv/bin/lm_eval", str(Path(launch.PY).parent / "lm_eval"))
            line = line.replace("runs/sft_tiny_hf", str(tmp_path / "hf")).replace("runs/sft_tiny", str(run))
            line = line.replace("127.0.0.1:8000", f"127.0.0.1:{server.port}")
            proc = subprocess.run(shlex.split(line), cwd=tmp_path, capture_output=True, text=True, timeout=1200, env=env)
            assert proc.returncode == 0, f"{line}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    finally:
        server.stop()
    (results,) = (tmp_path / "lm_eval_served").rglob("results_*.json")
    theirs = json.loads(results.read_text())["results"]
    for name in ("my_task", "my_task_text"):
        mine = ours["tasks"][name]
        assert mine["items"] == len(items)
        assert (mine["acc"], mine["acc_norm"]) == (theirs[name]["acc,none"], theirs[name]["acc_norm,none"])
        (samples,) = [p for p in (tmp_path / "lm_eval_served").rglob("samples_*.jsonl") if re.fullmatch(rf"samples_{name}_\d.*", p.name)]
        rows = sorted((json.loads(line) for line in samples.read_text().splitlines()), key=lambda r: r["doc_id"])
        assert len(rows) == len(items)
        for pick, row, item in zip(mine["picks"], rows, items):
            lls = [float(r[0][0]) for r in row["resps"]]
            texts = list("ABCD") if name == "my_task" else [item[k] for k in "ABCD"]
            assert {k: pick[k] for k in ("pred", "pred_norm")} == {k: v for k, v in benchmark.choose(lls, texts).items()
                                                                   if k != "pred_bytes"}, (name, row["doc_id"])
    mine = ours["perplexity"]["held_out.jsonl"]
    assert mine["byte_perplexity"] == pytest.approx(theirs["held_out"]["byte_perplexity,none"], rel=1e-5)
    assert mine["bits_per_byte"] == pytest.approx(theirs["held_out"]["bits_per_byte,none"], rel=1e-5)


# ---------------------------------------------------------------------------------------------- tools and reasoning

from conftest import MINIMIND_SHARED, needs_referee  # noqa: E402

MINIMIND_TOKENIZER = MINIMIND_SHARED / "tokenizer.json"
MINIMIND_SERVER = MINIMIND_SHARED / "upstream" / "scripts" / "serve_openai_api.py"
TOOLS = [{"type": "function", "function": {"name": "calculate_math", "description": "Evaluate arithmetic",
                                           "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                                                          "required": ["expression"]}}}]
REPLIES = [  # replies as a model writes them: calls over lines, two calls, a broken one, reasoning, both, a call not an object
    '<tool_call>\n{"name": "calculate_math", "arguments": {"expression": "27 + 82"}}\n</tool_call>',
    'Let me compute.\n<tool_call>{"name": "get_weather", "arguments": {"city": "北京"}}</tool_call>\n'
    '<tool_call>not json</tool_call>\n<tool_call>\n{"name": "calculate_math", "arguments": "{\\"expression\\": \\"1+1\\"}"}\n</tool_call>',
    "I should add them.\n</think>\n\nThe answer is 109.",
    '<think>\nhmm\n</think>\n\nanswer <tool_call>{"name": "a", "arguments": {"x": [1, 2]}}</tool_call> done',
    "<tool_call>[1, 2]</tool_call> plain",
    "nothing special",
]


def minimind_parse_response(scratch: Path):
    """MiniMind's server's parse_response, its source taken from a scratch copy of scripts/serve_openai_api.py
    (the module loads a model when imported as a script; the function is what is compared)."""
    import ast
    import shutil

    copy = scratch / "serve_openai_api.py"
    shutil.copy(MINIMIND_SERVER, copy)
    tree = ast.parse(copy.read_text())
    (fn,) = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "parse_response"]
    space = {}
    exec("import json, re, time\n" + ast.get_source_segment(copy.read_text(), fn), space)
    return space["parse_response"]


def calls_of(calls) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls or []]


@needs_referee(MINIMIND_SERVER, "MiniMind's scripts/serve_openai_api.py")
@pytest.mark.unit
def test_a_reply_is_read_into_content_reasoning_and_tool_calls_as_minimind_s_server_reads_it_with_trainings_parser(tmp_path, tiny):
    """read_reply with the parser `serve` loads for a run (tool_parser: its train.agent.parser, training's code)
    gives MiniMind's parse_response's content, reasoning_content and tool calls on each reply."""
    from cli.serve import read_reply, tool_parser
    from objectives.tools import parse_tool_calls

    code, err = launch.in_process(*tiny, "train.steps=1", f"out_dir={tmp_path / 'run'}")
    assert code == 0, err
    parse = tool_parser(tmp_path / "run")
    theirs = minimind_parse_response(tmp_path)
    for text in REPLIES:
        content, reasoning, calls = read_reply(text, parse)
        m_content, m_reasoning, m_calls = theirs(text)
        assert (content, reasoning, calls_of(calls)) == (m_content, m_reasoning, calls_of(m_calls)), text
        assert calls_of(calls) == [(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in parse_tool_calls(text)
                                   if isinstance(c, dict)]
    assert read_reply(" as it came ", parse) == (" as it came ", None, None)  # nothing taken out: chat's text as it is


@pytest.mark.unit
@pytest.mark.parametrize("thinking", [False, True])
def test_streamed_deltas_hold_back_a_calls_text_and_add_up_to_the_reply_read_whole(thinking):
    from cli.serve import ReplyDeltas, read_reply
    from objectives.tools import parse_tool_calls

    for text in REPLIES:  # thinking: the template opened it, the reply closes it (as MiniMind's server, one way or the other)
        if thinking != ("</think>" in text and "<think>" not in text) or (not thinking and "</think>" in text):
            continue
        for size in (1, 2, 5):
            split = ReplyDeltas(thinking, parse_tool_calls)
            deltas = [d for k in range(0, len(text), size) for d in split.add(text[k:k + size])]
            rest, found = split.finish()
            deltas += rest
            content, reasoning, calls = read_reply(text, parse_tool_calls)
            streamed = "".join(d.get("content", "") for d in deltas)
            assert ("<tool_call>" not in streamed or not calls) and streamed.strip() == content.strip(), (text, size)
            if thinking:
                assert "".join(d.get("reasoning_content", "") for d in deltas).strip() == reasoning
            assert calls_of(found) == calls_of(calls) and [d for d in deltas if "tool_calls" in d] == (
                [{"tool_calls": [{"index": k, **c} for k, c in enumerate(found)]}] if found else [])


@needs_referee(MINIMIND_TOKENIZER, "MiniMind's tokenizer")
@pytest.mark.unit
def test_tools_a_tool_turn_and_open_thinking_render_as_transformers_apply_chat_template_renders_them():
    from transformers import PreTrainedTokenizerFast

    from cli.serve import parse_request, prompt_ids
    from data import tokenizer
    from data.chat import template_of

    tok = tokenizer.load(str(MINIMIND_TOKENIZER))
    hf = PreTrainedTokenizerFast.from_pretrained(str(MINIMIND_TOKENIZER.parent))
    messages = [{"role": "system", "content": "You help."}, {"role": "user", "content": "What is 27 + 82?"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
                    "name": "calculate_math", "arguments": "{\"expression\": \"27 + 82\"}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "109"}]
    for extra, kwargs in (({}, {}), ({"open_thinking": True}, {"open_thinking": True}),
                          ({"chat_template_kwargs": {"enable_thinking": True}}, {"open_thinking": True})):
        req = parse_request(json.dumps({"messages": messages, "tools": TOOLS, **extra}).encode())
        want = hf.apply_chat_template([{k: v for k, v in m.items() if k != "tool_call_id"} for m in messages], tools=TOOLS,
                                      tokenize=False, add_generation_prompt=True, **kwargs)
        assert "<tools>" in want and "<tool_response>\n109" in want and want.endswith("<think>\n" if kwargs else "</think>\n\n")
        assert prompt_ids(tok, template_of(tok), req, 4096) == hf(want, add_special_tokens=False)["input_ids"]


@pytest.mark.unit
@pytest.mark.parametrize("extra, param", [
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": []}}}]}, "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"open_thinking": "yes"}, "open_thinking"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{}"}}]}]},
     "messages[0].tool_calls[0]"),
])
def test_a_malformed_tool_schema_or_tool_field_is_400_naming_it(client, extra, param):
    r = client.post("/v1/chat/completions", json={"messages": ASK, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.json()


# ---------------------------------------------------------------------------------------------- batched decoding

INVARIANCE = r'''
import json, sys, threading, time
import torch
from cli.serve import ChatRequest, Engine, Job
from data.tokenizer import ByteTokenizer
from model import MiniMindLM, ModelConfig
from model.decode import ROW_BLOCK, blocked
from model.generate import generate_ids

torch.manual_seed(0)
model = MiniMindLM(ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=256, vocab_size=259)).eval()
tok = ByteTokenizer()

# the linear layers through the fixed block: each row's bits whatever the rows beside it and its place, on a
# thread count (the widest, the FFN's down projection: across thread counts its sums may split otherwise)
w = model.layers[0].feed_forward.w2
x = torch.randn(1, w.in_features)
plain, block = set(), {1: set(), 2: set()}
for threads in (1, 2):
    torch.set_num_threads(threads)
    for n in range(1, 2 * ROW_BLOCK + 2):
        for at in range(n):
            rows = torch.randn(n, w.in_features)
            rows[at] = x[0]
            with torch.no_grad():
                plain.add(w(rows)[at].numpy().tobytes())
                block[threads].add(blocked(w, rows)[at].numpy().tobytes())
torch.set_num_threads(2)

def request(seed, temperature, tokens):
    return ChatRequest(messages=[], temperature=temperature, top_p=0.95, top_k=0, repetition_penalty=1.1, max_tokens=tokens,
                       stop=[], seed=seed, stream=True, include_usage=False, logprobs=0)

def serve(target, others, join_after):
    """The target's ids and log-probabilities, generated among `others` (it joins once they have drawn join_after ids)."""
    engine = Engine(model, tok, slots=8, queue=16, every=0)
    seen = [[] for _ in range(len(others) + 1)]
    jobs = [Job(request(*o[1:]), o[0], seen[k + 1].append) for k, o in enumerate(others)]
    mine = Job(request(*target[1:]), target[0], seen[0].append)
    engine.submit(*jobs) if jobs else None
    engine.start()
    over = ("end", "error")  # a failed reply (NaN logits, an exception) ends too: the comparison below fails it
    while jobs and not all(j.gen is not None and len(j.gen.ids) - len(j.prompt) >= join_after for j in jobs
                           if not (seen[jobs.index(j) + 1] and seen[jobs.index(j) + 1][-1][0] in over)):
        time.sleep(0.001)
    engine.submit(mine)
    while any(not s or s[-1][0] not in over for s in seen):
        time.sleep(0.005)
    engine.close()
    if seen[0][-1][0] == "error":
        return {"error": seen[0][-1][1]}
    return {"ids": mine.gen.ids[len(mine.prompt):], "entries": [[i, lp] for i, lp, _ in mine.entries]}

prompts = [[tok.bos, *t.encode()] for t in ("a", "the second prompt, longer", "3 + 4 =", "Once upon a time there was",
                                                 "x" * 60, "def f(x):", "日本語のテキスト", "zz")]
out = {"plain_variants": len(plain), "block_variants": max(map(len, block.values())), "across_threads": len(block[1] | block[2]),
       "cases": []}
for target in ((prompts[1], 5, 0.0, 40), (prompts[2], 7, 0.9, 40)):
    alone = serve(target, [], 0)
    case = {"alone": alone, "generate": generate_ids(model, target[0], 40, target[2], 0, 0.95, 1.1, tok.eos, True, target[1])[len(target[0]):],
            "among": []}
    for n, join in ((1, 3), (3, 0), (7, 9)):
        others = [(prompts[(k + 3) % len(prompts)], 100 + k, 0.8, 20 + 9 * k) for k in range(n)]
        case["among"].append(serve(target, others, join))
    out["cases"].append(case)
print(json.dumps(out))
'''


@pytest.mark.e2e
def test_a_reply_is_the_same_bits_alone_and_among_1_3_and_7_others_of_other_lengths_joining_mid_way():
    """Batched decoding under MKL's fast default branch (MKL_CBWR=AUTO, where a plain matmul's row changes
    with the rows beside it): every linear through the fixed row block gives each row the same bits at every
    batch size and place on 1 thread and on 2 (not the same on both: printed), and a greedy and a seeded reply - ids and log-probabilities - are the
    same alone, beside 1, 3 and 7 others of other lengths, joining mid-way, and from `generate`'s loop."""
    env = {**ENV, "MKL_CBWR": "AUTO", "OMP_NUM_THREADS": "2", "PYTHONPATH": str(launch.ROOT)}
    proc = subprocess.run([launch.PY, "-c", INVARIANCE], cwd=launch.ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout)
    assert out["block_variants"] == 1, out["block_variants"]
    print("rows' bit patterns of a plain matmul beside other rows:", out["plain_variants"])
    print("a blocked row's bit patterns over 1 and 2 threads together:", out["across_threads"])
    for case in out["cases"]:
        assert case["alone"]["ids"] == case["generate"] and len(case["alone"]["ids"]) > 10
        for among in case["among"]:
            assert among == case["alone"]  # ids and every log-probability, bit for bit


@pytest.mark.unit
def test_a_finished_replys_kv_slot_serves_the_next_and_the_replies_are_generate_ids_own():
    """The engine's KV pool (model/decode.py's KVPool) has --slots slots: a reply that ends, is cancelled or fails
    gives its slot back, so 7 requests through 2 slots all end, each with the ids generate_ids gives it alone,
    and every slot is free again after."""
    from cli.serve import ChatRequest, Engine, Job
    from data.tokenizer import ByteTokenizer
    from model import MiniMindLM, ModelConfig
    from model.generate import generate_ids

    torch.manual_seed(0)
    model = MiniMindLM(ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=64, vocab_size=259)).eval()
    tok, engine = ByteTokenizer(), None
    prompts = [[tok.bos, *f"prompt {k}".encode()] for k in range(7)]
    seen = [[] for _ in prompts]
    jobs = [Job(ChatRequest(messages=[], temperature=0.9, top_p=0.95, top_k=0, repetition_penalty=1.1, max_tokens=5 + 3 * k,
                            stop=[], seed=k, stream=False, include_usage=False, logprobs=None), p, seen[k].append)
            for k, p in enumerate(prompts)]
    try:
        engine = Engine(model, tok, slots=2, queue=16, every=0)
        engine.start()
        engine.submit(*jobs[:5])
        deadline = time.monotonic() + 30
        while not all(s and s[-1][0] == "end" for s in seen[:5]) and time.monotonic() < deadline:
            time.sleep(0.005)
        engine.submit(*jobs[5:])
        while not all(s and s[-1][0] == "end" for s in seen) and time.monotonic() < deadline:
            time.sleep(0.005)
    finally:
        engine.close()
    assert [s[-1][0] for s in seen] == ["end"] * 7
    for k, job in enumerate(jobs):
        assert job.gen.ids == generate_ids(model, prompts[k], 5 + 3 * k, 0.9, 0, 0.95, 1.1, tok.eos, True, k)
    assert sorted(engine.pool.free) == [0, 1]


@pytest.mark.unit
def test_a_kv_pool_the_machine_cannot_hold_is_a_command_error_naming_slots_before_serving_not_a_dead_worker():
    """The pool (--slots x model.seq_len positions per layer) is made when the app is, so one too big is said
    at the start (found by review: the worker made it, its failure killed the worker and every request then
    waited forever while /health said ok)."""
    from cli.arguments import CommandError
    from cli.serve import make_app
    from data.tokenizer import ByteTokenizer
    from model import MiniMindLM, ModelConfig

    model = MiniMindLM(ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=64, vocab_size=259)).eval()
    slots = 10**11  # 4e14 bytes a layer's keys: past any machine's memory and x86-64's 2**47 bytes of address space
    with pytest.raises(CommandError, match=r"--slots 100000000000: the KV pool of 100000000000 slots x model.seq_len=64 "
                                           r"positions needs .* GiB on cpu, which could not be allocated"):
        make_app(model, ByteTokenizer(), "m", slots=slots)
    app = make_app(model, ByteTokenizer(), "m", slots=3)
    assert sorted(app.state.engine.pool.free) == [0, 1, 2]  # made with the app, before its worker starts


@pytest.mark.unit
def test_a_closed_generation_cannot_step_into_the_slot_another_sequence_took_alone_or_together():
    """close() gives the slot back; a step after it is refused (its prefill would write into the keys of the
    sequence that took the slot next), alone or in step_together, before any sequence of the turn steps: the
    other sequence's ids stay generate_ids' own (found by review)."""
    from model import MiniMindLM, ModelConfig
    from model.decode import KVPool
    from model.generate import Generation, generate_ids, step_together

    torch.manual_seed(0)
    model = MiniMindLM(ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=64, vocab_size=259)).eval()
    pool = KVPool(model, 1)
    old = Generation(model, [1, 5, 6, 7], 10, 0.9, 0, 0.95, 1.0, None, True, 3, pool=pool)
    old.close()
    new = Generation(model, [1, 9, 8], 10, 0.9, 0, 0.95, 1.0, None, True, 4, pool=pool)  # the slot old gave back
    assert new.cache.slot == 0 and old.cache.pool is None
    new.step()
    for step in (old.step, lambda: step_together([new, old])):
        with pytest.raises(RuntimeError, match="this generation was closed"):
            step()
    assert len(new.ids) == 4  # step_together refused before new stepped
    while new.step() is not None:
        pass
    assert new.ids == generate_ids(model, [1, 9, 8], 10, 0.9, 0, 0.95, 1.0, None, True, 4)


@pytest.mark.unit
def test_a_lone_generations_cache_holds_its_own_positions_not_the_models_context_and_gives_the_pools_bits():
    """generate and chat decode in a pool of their own, sized to the prompt and its new tokens (model.seq_len
    each time was a long-context model's whole context per call; found by review), with the bits a slot of the
    server's pool (model.seq_len positions, another slot) gives the same request."""
    from model import MiniMindLM, ModelConfig
    from model.decode import KVPool
    from model.generate import Generation

    torch.manual_seed(0)
    model = MiniMindLM(ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=512, vocab_size=259)).eval()
    alone = Generation(model, [1, 5, 6, 7], 12, 0.9, 0, 0.95, 1.1, None, True, 3)
    assert [tuple(layer.k.shape) for layer in alone.cache.layers] == [(1, 2, 4 + 12, 8)] * 2
    pool = KVPool(model, 3)
    pool.take()
    served = Generation(model, [1, 5, 6, 7], 12, 0.9, 0, 0.95, 1.1, None, True, 3, pool=pool)
    assert served.cache.slot == 1 and served.cache.layers[0].k.shape[2] == 512
    while alone.step() is not None:
        served.step()
        assert torch.equal(alone.last_logits, served.last_logits)
    assert alone.ids == served.ids and len(alone.ids) == 16


def _one_row(logits, seen, temperature=0.8, top_k=0, top_p=1.0, repetition_penalty=1.0, generator=None):
    """The referee: the one-row rule every reply was drawn by before the slots' rows were filtered together (verbatim)."""
    logits = logits.clone()
    if repetition_penalty != 1.0 and seen:
        idx = torch.tensor(sorted(set(seen)), dtype=torch.long, device=logits.device)
        picked = logits[idx]
        logits[idx] = torch.where(picked > 0, picked / repetition_penalty, picked * repetition_penalty)
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits / temperature
    if 0 < top_k < logits.numel():
        logits[logits < torch.topk(logits, top_k).values[-1]] = float("-inf")
    if top_p < 1.0:
        order = torch.sort(logits, descending=True, stable=True).indices
        probs = torch.softmax(logits[order], -1)
        drop = probs.cumsum(-1) - probs > top_p
        logits[order[drop]] = float("-inf")
    return int(torch.multinomial(torch.softmax(logits, -1).cpu(), 1, generator=generator))


def _twin(g: torch.Generator) -> torch.Generator:
    t = torch.Generator()
    t.set_state(g.get_state())
    return t


@pytest.mark.unit
@pytest.mark.parametrize("threads", [1, 2])
def test_rows_sampled_together_draw_each_the_id_the_one_row_rule_draws_alone(threads):
    """The slots' next ids are filtered together (model.generate.sample_rows: the penalty, temperature, top-k and
    top-p over all rows at once, a multinomial per row from its own generator): each row's id, and its generator's
    state after the draw, are the one-row rule's (the per-row sampler every reply was drawn by before, kept here as
    the referee), for 1 to 8 rows of mixed settings - greedy, seeded, tied logits - on 1 and 2 threads; and
    generations stepped together draw at every step what that rule draws from their logits and ids so far."""
    import random

    from model import MiniMindLM, ModelConfig
    from model.generate import DEFAULTS, Generation, Sampling, sample, sample_rows, step_together

    settings_pool = [Sampling(0.0, 0, 1.0, 1.0), Sampling(0.0, 0, 0.9, 1.1), DEFAULTS, Sampling(0.9, 0, 0.9, 1.1),
                     Sampling(1.3, 20, 0.5, 1.3), Sampling(0.5, 5, 1.0, 1.0), Sampling(1.0, 0, 0.95, 0.8), Sampling(2.0, 0, 0.3, 1.1),
                     Sampling(0.7, 0, 1.0, 1.0), Sampling(1.0, 3, 0.999, 1.0), Sampling(0.9000001, 0, 0.90000001, 1.0000001)]
    rnd, before = random.Random(threads), torch.get_num_threads()
    torch.manual_seed(threads)
    torch.set_num_threads(threads)
    try:
        rows = 0
        for vocab, trials in ((259, 40), (6400, 4)):
            for trial in range(trials):
                n = rnd.randint(1, 8)
                # every other trial on a coarse grid: tied logits at the nucleus's edge and at the greedy maximum
                logits = torch.randn(n, vocab) * 3 if trial % 2 else torch.randint(-4, 5, (n, vocab)).float()
                logits[:, rnd.randrange(vocab)] = float("-inf")
                settings = [rnd.choice(settings_pool) for _ in range(n)]
                seen = [[rnd.randrange(vocab) for _ in range(rnd.randint(0, 60))] for _ in range(n)]
                masks = [torch.zeros(vocab, dtype=torch.bool).index_fill_(0, torch.tensor(ids, dtype=torch.long), True)
                         for ids in seen]
                gens = [torch.Generator().manual_seed(rnd.randrange(2 ** 63)) for _ in range(n)]
                refs, solo = [_twin(g) for g in gens], [_twin(g) for g in gens]
                got = sample_rows(logits, settings, masks, gens)
                want = [_one_row(logits[r], seen[r], *vars(s).values(), generator=refs[r]) for r, s in enumerate(settings)]
                alone = [sample(logits[r], seen[r], *vars(s).values(), generator=solo[r]) for r, s in enumerate(settings)]
                assert got == want == alone, (vocab, settings)
                assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(gens, refs))
                rows += n
        assert rows > 100

        model = MiniMindLM(ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=128, vocab_size=259)).eval()
        gens = [Generation(model, [256, *range(40 + 5 * k, 50 + 9 * k)], 30, *vars(s).values(), eos=None, seed=7 + k)
                for k, s in enumerate(settings_pool[:8])]
        steps = 0
        while not all(g.done for g in gens):
            ids_before = [(list(g.ids), _twin(g.generator)) for g in gens]
            step_together(gens)
            for g, (ids, gen) in zip(gens, ids_before):
                if g.last_id is not None:
                    s = g.sampling
                    assert g.last_id == _one_row(g.last_logits, ids, s.temperature, s.top_k, s.top_p, s.repetition_penalty, gen)
                    steps += 1
        assert steps == 8 * 30
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------------------------------------- a model that calls tools

CALLS = {"conversations": [  # one tool-use conversation, as the agent recipe's fine-tune teaches them (data/chat.py's fields)
    {"role": "system", "content": "You help.", "tools": json.dumps(TOOLS)},
    {"role": "user", "content": "What is 27 + 82?"},
    {"role": "assistant", "content": "", "tool_calls": json.dumps([{"name": "calculate_math", "arguments": {"expression": "27 + 82"}}])},
    {"role": "tool", "content": '{"result": "109"}'},  # what calculate_math answers (objectives/tools.py, MiniMind's)
    {"role": "assistant", "content": "The answer is 109."}]}
MINIMIND_SHAPE = ["model.dim=64", "model.n_layers=2", "model.n_heads=8", "model.n_kv_heads=4", "model.qk_norm=true",
                  "model.hidden_dim=256", "model.norm_eps=1e-6", "model.seq_len=384"]
"""MiniMind-3's shape as its server builds it from --hidden_size 64 --num_hidden_layers 2 (8 heads, 4 KV heads,
FFN ceil(64 pi / 64) * 64, eps 1e-6, q/k norms, MiniMind's tokenizer)."""


@pytest.fixture(scope="module")
def caller(tmp_path_factory):
    """A MiniMind-shaped run on MiniMind's tokenizer fine-tuned on one tool-use conversation until it calls
    the calculator for it (150 steps: measured to be enough), and then answers from the tool's result."""
    out = tmp_path_factory.mktemp("caller")
    (out / "calls.jsonl").write_text((json.dumps(CALLS, ensure_ascii=False) + "\n") * 64, encoding="utf-8")
    code, err = launch.in_process(f"data.path={out / 'calls.jsonl'}", "data.format=chat", f"data.tokenizer={MINIMIND_TOKENIZER}",
                                  f"data.cache_dir={out / 'cache'}", *MINIMIND_SHAPE, "train.steps=150", "train.global_batch=4",
                                  "train.micro_batch=4", "train.lr=1e-2", "train.warmup_steps=5", "checkpoint.interval=0",
                                  "log.progress=false", "runtime.threads=2", f"out_dir={out / 'run'}")
    assert code == 0, err
    return out / "run"


@needs_referee(MINIMIND_TOKENIZER, "MiniMind's tokenizer")
@pytest.mark.e2e
def test_the_openai_clients_tool_loop_gets_the_call_runs_the_tool_and_gets_the_answer_streamed_or_not(caller):
    from openai import OpenAI

    from objectives.tools import Toolbox, name_and_args

    server = Server([launch.PY, "-m", "checkpoint", "serve", str(caller), "--port", "0"])
    try:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        messages = [{"role": "system", "content": "You help."}, {"role": "user", "content": "What is 27 + 82?"}]
        ask = dict(model="run", tools=TOOLS, temperature=0, extra_body={"repetition_penalty": 1.0}, max_tokens=60)
        reply = client.chat.completions.create(messages=messages, **ask)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == ""
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "calculate_math"
        assert json.loads(call.function.arguments) == {"expression": "27 + 82"}
        chunks = list(client.chat.completions.create(messages=messages, stream=True, **ask))
        deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
        assert [(d.index, d.id, d.function.name, d.function.arguments) for d in deltas] == [(0, deltas[0].id, "calculate_math",
                                                                                            call.function.arguments)]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        result, ok = Toolbox(["calculate_math"], 10.0).run({"name": call.function.name,
                                                             "arguments": name_and_args({"arguments": call.function.arguments})[1]})
        assert ok and json.loads(result) == {"result": "109"}
        messages += [choice.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": result}]
        answer = client.chat.completions.create(messages=messages, **ask).choices[0]
        assert answer.finish_reason == "stop" and answer.message.content == "The answer is 109." and not answer.message.tool_calls
    finally:
        server.stop()


@needs_referee(MINIMIND_SERVER, "MiniMind's scripts/serve_openai_api.py")
@needs_referee(MINIMIND_TOKENIZER, "MiniMind's tokenizer")
@pytest.mark.e2e
def test_minimind_s_own_server_on_our_export_answers_the_same_greedy_requests_with_the_same_content_reasoning_and_calls(
        caller, tmp_path):
    """MiniMind's scripts/serve_openai_api.py, run unmodified from a scratch copy on our MiniMind export (its
    fp16 model; greedy as its sampler allows: temperature 0.01 under its top_p 0.92 keeps the likeliest id),
    and ours at temperature 0: the same message (content, reasoning_content, tool calls) and finish reason,
    for the call and for the answer after the tool's result."""
    import shutil

    import httpx

    scratch = tmp_path / "minimind"
    shutil.copytree(MINIMIND_SERVER.parents[1], scratch)
    (scratch / "out").mkdir()
    proc = subprocess.run([launch.PY, "-m", "checkpoint", "export", str(caller), "--format", "minimind", "--out",
                           str(scratch / "out" / "full_sft_64.pth")], cwd=launch.ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    theirs = subprocess.Popen([launch.PY, "serve_openai_api.py", "--hidden_size", "64", "--num_hidden_layers", "2", "--max_seq_len",
                               "384", "--device", "cpu"], cwd=scratch / "scripts", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True, env={**ENV, "PYTHONPATH": ""})
    launch.STARTED.append(theirs)
    ours = Server([launch.PY, "-m", "checkpoint", "serve", str(caller), "--port", "0"])
    try:
        said = ""
        while "Uvicorn running" not in said:
            line = theirs.stderr.readline()
            assert line, f"MiniMind's server ended (exit {theirs.wait()}):\n{said[-3000:]}"
            said += line
        threading.Thread(target=theirs.stderr.read, daemon=True).start()
        messages = [{"role": "system", "content": "You help."}, {"role": "user", "content": "What is 27 + 82?"}]
        for turn in range(2):
            body = {"model": "minimind", "messages": messages, "tools": TOOLS, "max_tokens": 60, "stream": False}
            a = httpx.post("http://127.0.0.1:8998/v1/chat/completions", json={**body, "temperature": 0.01}, timeout=300).json()
            b = httpx.post(f"{ours.url}/v1/chat/completions", json={**body, "temperature": 0, "repetition_penalty": 1.0},
                           timeout=300).json()
            (x,), (y,) = a["choices"], b["choices"]
            mx, my = x["message"], y["message"]
            assert (mx["content"], mx.get("reasoning_content"), calls_of(mx.get("tool_calls")), x["finish_reason"]) == \
                   (my["content"], my.get("reasoning_content"), calls_of(my.get("tool_calls")), y["finish_reason"]), (a, b)
            assert (turn == 0) == bool(my.get("tool_calls"))
            messages = messages + [my, {"role": "tool", "content": '{"result": "109"}'}]
    finally:
        ours.stop()
        theirs.terminate()
        theirs.wait(timeout=30)


# ---------------------------------------------------------------------------------------------- a user's tool-call parser

PARSER_MODULE = '''
import os, pathlib, time

HERE = pathlib.Path(__file__).parent


def said(text):
    """One call from any reply: the reply's text and this process's id. The file `mode` beside this one makes it
    sleep 5 s (`slow`, saying when it starts and ends), hang (`hang`), or return a call no reply can carry."""
    mode = (HERE / "mode").read_text() if (HERE / "mode").exists() else ""
    if mode == "slow":
        (HERE / "slow-started").touch()
        time.sleep(5)
        (HERE / "slow-ended").touch()
    elif mode == "hang":
        (HERE / "hang-started").touch()
        time.sleep(3600)
    elif mode == "set":
        return [{"name": "said", "arguments": {1, 2}}]
    elif mode == "nan":
        return [{"name": "said", "arguments": {"x": float("nan")}}]
    elif mode == "number":
        return [{"name": 5, "arguments": {}}]
    return [{"name": "said", "arguments": {"text": text, "pid": os.getpid()}}]


def reward(prompt, completion, **fields):
    return float(len(completion))
'''


@pytest.fixture(scope="module")
def parser_run(tmp_path_factory):
    """An agent run (GRPO, data.format=agent, one step) whose train.agent.parser is a user's module (calls.py in
    the folder returned, beside the run)."""
    root = tmp_path_factory.mktemp("parser")
    (root / "calls.py").write_text(PARSER_MODULE)
    data = root / "agent.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"What is {a} + {b}?"}], "tools": TOOLS, "gt": [str(a + b)]}) + "\n"
                            for a, b in [(3, 4), (12, 7)]))
    code, err = launch.in_process(f"data.path={data}", "data.format=agent", "train.objective=grpo", f"data.cache_dir={root / 'cache'}",
                                  "model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.seq_len=512",
                                  "train.global_batch=2", "train.micro_batch=2", "train.steps=1", "train.warmup_steps=0",
                                  "train.grpo.generations=2", "train.grpo.max_new_tokens=4", f"train.grpo.reward={root / 'calls.py'}:reward",
                                  f"train.agent.parser={root / 'calls.py'}:said", "train.agent.tools=calculate_math",
                                  "train.agent.max_turns=1", "checkpoint.interval=0", "log.progress=false", "runtime.threads=1",
                                  f"out_dir={root / 'run'}")
    assert code == 0, err
    return root


@pytest.fixture
def user_parser(parser_run):
    """The agent run served by `python -m checkpoint serve`: (the server, the parser module's folder)."""
    (parser_run / "mode").write_text("")
    server = Server([launch.PY, "-m", "checkpoint", "serve", str(parser_run / "run"), "--port", "0"])
    try:
        yield server, parser_run
    finally:
        server.stop()


def asked(tools: bool = True, **extra) -> dict:
    """A greedy chat request: with TOOLS (read by the parser), or tool_choice none (no parser call)."""
    return {"model": "run", "messages": ASK, "temperature": 0, "max_tokens": 24, **({"tools": TOOLS} if tools else {"tool_choice": "none"}),
            **extra}


@pytest.mark.e2e
def test_a_runs_own_parser_reads_the_tool_calls_in_its_worker_process_streamed_or_not(user_parser):
    """The run's train.agent.parser (a user's module:function) reads the reply in a process of its own: its call
    comes back as the tool call, streamed (one delta) or not, from the whole reply's text."""
    from openai import OpenAI

    server, root = user_parser
    (root / "mode").write_text("")
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    plain = client.chat.completions.create(**asked(False))
    text = plain.choices[0].message.content
    assert plain.choices[0].finish_reason in ("stop", "length") and text and not plain.choices[0].message.tool_calls
    reply = client.chat.completions.create(**asked()).choices[0]
    (call,) = reply.message.tool_calls
    args = json.loads(call.function.arguments)
    assert reply.finish_reason == "tool_calls" and call.function.name == "said" and args["text"] == text
    assert args["pid"] not in (server.proc.pid, launch.os.getpid())  # the worker process's, not the server's
    chunks = list(client.chat.completions.create(**asked(), stream=True))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == [(0, "said", args)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.e2e
def test_a_parser_sleeping_5_s_on_one_request_holds_no_other_clients_reply(user_parser):
    """The parser runs off the server's event loop: while it sleeps on one reply, another client's request (no
    parser: tool_choice none) is answered, before the parser wakes; then the first gets its calls."""
    import httpx

    server, root = user_parser
    (root / "mode").write_text("slow")
    for marker in ("slow-started", "slow-ended"):
        (root / marker).unlink(missing_ok=True)
    order = []

    def slow():
        order.append(("slow", httpx.post(f"{server.url}/v1/chat/completions", json=asked(), timeout=300)))

    thread = threading.Thread(target=slow)
    thread.start()
    try:
        launch.wait_for(lambda: (root / "slow-started").exists(), timeout=120)
        for body in (asked(False), asked(False, stream=True)):
            other = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=300)
            assert other.status_code == 200 and not (root / "slow-ended").exists()  # answered while the parser sleeps
            order.append(("other", other))
    finally:
        thread.join(timeout=300)
    assert [who for who, _ in order] == ["other", "other", "slow"]
    slow_reply = order[-1][1].json()["choices"][0]
    assert slow_reply["finish_reason"] == "tool_calls" and slow_reply["message"]["tool_calls"][0]["function"]["name"] == "said"
    (root / "mode").write_text("")


@pytest.mark.e2e
def test_a_parser_that_hangs_past_its_timeout_gets_that_request_a_504_naming_it_and_the_server_goes_on(user_parser):
    """A parser that never returns: killed at the run's train.agent.tool_timeout_s (10 s); that request gets 504
    (streamed: the error chunk, then [DONE]) naming the parser, other clients are served meanwhile, and the next
    reply is read by a new worker process."""
    import httpx

    server, root = user_parser
    (root / "mode").write_text("hang")
    (root / "hang-started").unlink(missing_ok=True)
    got = []
    thread = threading.Thread(target=lambda: got.append(httpx.post(f"{server.url}/v1/chat/completions", json=asked(), timeout=300)))
    thread.start()
    try:
        launch.wait_for(lambda: (root / "hang-started").exists(), timeout=120)
        other = httpx.post(f"{server.url}/v1/completions", json={"model": "run", "prompt": "Hello", "max_tokens": 8}, timeout=300)
        assert other.status_code == 200 and not got  # served while the parser hangs
    finally:
        thread.join(timeout=300)
    (hung,) = got
    error = hung.json()["error"]
    assert hung.status_code == 504 and error["code"] == "parser_timeout" and error["type"] == "server_error"
    assert f"train.agent.parser={root / 'calls.py'}:said" in error["message"] and "10 s" in error["message"]
    streamed = httpx.post(f"{server.url}/v1/chat/completions", json=asked(stream=True), timeout=300)
    chunks = events(streamed.text.splitlines())
    assert streamed.status_code == 200 and chunks[-1]["error"]["code"] == "parser_timeout"
    (root / "mode").write_text("")
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=asked(), timeout=300).json()["choices"][0]
    assert reply["finish_reason"] == "tool_calls" and reply["message"]["tool_calls"][0]["function"]["name"] == "said"


@pytest.mark.e2e
def test_a_parser_returning_a_call_no_reply_can_carry_gets_that_request_a_500_naming_it_streamed_or_not(user_parser):
    """Arguments that are not JSON (a set, NaN) or a name that is not a string: 500 parser_failed naming the parser,
    streamed as the error chunk then [DONE] (found by review: a TypeError without a code, a stream cut short)."""
    import httpx

    server, root = user_parser
    for mode in ("set", "nan", "number"):
        (root / "mode").write_text(mode)
        got = httpx.post(f"{server.url}/v1/chat/completions", json=asked(), timeout=300)
        error = got.json()["error"]
        assert got.status_code == 500 and error["code"] == "parser_failed", (mode, got.text)
        assert f"train.agent.parser={root / 'calls.py'}:said returned call 0" in error["message"], error
        streamed = httpx.post(f"{server.url}/v1/chat/completions", json=asked(stream=True), timeout=300)
        lines = [line for line in streamed.text.splitlines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and events(streamed.text.splitlines())[-1]["error"]["code"] == "parser_failed", streamed.text
    (root / "mode").write_text("")
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=asked(), timeout=300).json()["choices"][0]
    assert reply["finish_reason"] == "tool_calls"

