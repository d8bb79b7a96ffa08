"""The server's streamed tokens per second against generate_ids', concurrent clients, and eval's items per second."""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from . import section
from .helpers import ROOT, launch


AIMS = {
    "served stream / generate_ids tokens per second": (">=", 0.9),
    "8 concurrent streams' total / one stream's tokens per second": (">=", 3.0),
}


def ensure_serve_requirements() -> None:
    """`serve` needs FastAPI and uvicorn (requirements-serve.txt): installed here when missing."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        subprocess.run([sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q", "-r",
                        str(ROOT / "requirements-serve.txt")], check=True)


def serve_rows(work: Path, new_tokens: int, clients: int = 8) -> list[dict]:
    """`python -m checkpoint serve` over a 2-step tiny run at seq_len 512 (its weights barely trained, so
    replies run long), one thread in the server and in this process: one streamed request's tokens per
    second against generate_ids' on the same prompt and seed (the same ids); `clients` concurrent streamed
    requests: total tokens per second and the time to the first token; and eval's items per second on
    the built-in task (objectives/benchmark.py)."""
    import threading

    import httpx

    from model.decode import ROW_BLOCK
    from model.generate import generate_ids
    from objectives.benchmark import evaluate_tasks, read_tasks
    from weights import load_model, load_tokenizer

    ensure_serve_requirements()
    out = work / "serve-run"
    launch(["--config", "configs/tiny.yaml", "data.path=stdlib-chat", "data.format=chat", "model.seq_len=512", "train.steps=2",
            "checkpoint.interval=0", "log.progress=false", f"data.cache_dir={work / 'serve-cache'}", f"out_dir={out}"],
           work / "serve.log")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "checkpoint", "serve", str(out), "--port", "0", "--slots", str(clients)],
                            cwd=ROOT, stderr=subprocess.PIPE, text=True, env=env)
    threads = torch.get_num_threads()
    try:
        said = ""
        while not (found := re.search(r":(\d+)/v1", said)):
            line = proc.stderr.readline()
            if not line:
                raise SystemExit(f"bench: serve ended (exit {proc.wait()}) before it listened:\n{said[-3000:]}")
            said += line
        port = int(found.group(1))
        threading.Thread(target=proc.stderr.read, daemon=True).start()
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        for _ in range(600):
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        messages = [{"role": "user", "content": "What does os.path.join do?"}]

        def stream(seed: int, http: httpx.Client) -> tuple[float, float, int, str]:
            """(seconds to the first token, seconds in all, completion tokens, text) of one streamed request."""
            body = {"messages": messages, "temperature": 0.9, "seed": seed, "max_tokens": new_tokens, "stream": True,
                    "stream_options": {"include_usage": True}}
            t0, first, tokens, text = time.perf_counter(), None, 0, []
            with http.stream("POST", url, json=body) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                        first = time.perf_counter() - t0
                    if chunk["choices"]:
                        text.append(chunk["choices"][0]["delta"].get("content") or "")
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
            return first or float("nan"), time.perf_counter() - t0, tokens, "".join(text)

        model, tok = load_model(out), load_tokenizer(out)
        from data.chat import template_of

        prompt = tok.encode_rendered(template_of(tok).render(messages, add_generation_prompt=True))
        torch.set_num_threads(1)
        # the seed whose reply is longest among the first 10 (the same ids in both, so the longer the fairer)
        seed = max(range(10), key=lambda k: (len(generate_ids(model, prompt, new_tokens, 0.9, 0, 0.9, 1.1, tok.eos, True, k)), -k))
        gen = []
        for _ in range(3):
            t0 = time.perf_counter()
            ids = generate_ids(model, prompt, new_tokens, 0.9, 0, 0.9, 1.1, tok.eos, True, seed)
            gen.append(time.perf_counter() - t0)
        n = len(ids) - len(prompt)
        with httpx.Client(timeout=600) as http:
            stream(seed, http)  # warm-up
            single = [stream(seed, http) for _ in range(3)]
        assert n == single[0][2], f"the server generated {single[0][2]} tokens, generate_ids {n}: not the same reply"
        served_s, gen_s = statistics.median(s[1] for s in single), statistics.median(gen)
        results: list = [None] * clients
        # Each client made and connected before the clock starts (an httpx.Client takes 20-40 ms of this
        # process's CPU to make: eight made inside the timing measured the bench, not the server), then all
        # eight requests go at once.
        https = [httpx.Client(timeout=600) for _ in range(clients)]
        for http in https:
            http.get(f"http://127.0.0.1:{port}/health")
        ready, went = threading.Barrier(clients + 1), [0.0] * clients

        def client(i: int) -> None:
            ready.wait()
            results[i] = stream(100 + i, https[i])
            went[i] = time.perf_counter()

        workers = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        for w in workers:
            w.start()
        t0 = time.perf_counter()
        ready.wait()
        for w in workers:
            w.join()
        wall = max(went) - t0
        for http in https:
            http.close()
        firsts = sorted(r[0] for r in results)
        total = sum(r[2] for r in results)
        with httpx.Client(timeout=600) as http:  # each reply again alone: batched decoding changed none
            alone = [stream(100 + i, http) for i in range(clients)]
        same = sum(a[3] == r[3] for a, r in zip(alone, results))
        one_s = statistics.median(a[2] / a[1] for a in alone)
        invariant_s, plain_s, rows = decode_price(model, prompt, clients, new_tokens)
        p95 = firsts[min(len(firsts) - 1, math.ceil(0.95 * len(firsts)) - 1)]
        tasks = read_tasks("arith")
        t0 = time.perf_counter()
        evaluate_tasks(load_model(out, fp32=True), tok, tasks)
        eval_s, eval_threads = time.perf_counter() - t0, torch.get_num_threads()
    finally:
        torch.set_num_threads(threads)
        proc.terminate()
        proc.wait(timeout=60)
    items = len(tasks[0].items)
    return [
        {"row": f"serve, tiny shape at seq_len 512, one streamed request of {n} tokens, 1 thread", "what":
         "served stream / generate_ids tokens per second", "value": gen_s / served_s, "aim": "served stream / generate_ids tokens per second",
         "detail": f"{n / served_s:.0f} tok/s through HTTP (SSE, the openai chunk format) / {n / gen_s:.0f} tok/s in process "
                   f"(medians of 3; the same ids)"},
        {"row": f"serve, {clients} concurrent streamed requests of up to {new_tokens} tokens, --slots {clients}, 1 thread",
         "what": "8 concurrent streams' total / one stream's tokens per second", "value": total / wall / one_s,
         "aim": "8 concurrent streams' total / one stream's tokens per second",
         "detail": f"{total} tokens in {wall:.2f} s ({total / wall:.0f} tok/s) against {one_s:.0f} tok/s for one stream alone "
                   f"(median of the {clients} replies run again alone); {same} of {clients} replies identical to their solo run; "
                   f"time to the first token p50 {statistics.median(firsts) * 1e3:.0f} ms, p95 {p95 * 1e3:.0f} ms; the machine's load "
                   f"average {os.getloadavg()[0]:.1f} at the end (other work shares these cores: ratios, not speeds)"},
        {"row": f"batched decoding, {clients} sequences, tiny shape, 1 thread", "what": "batch-invariant / plain batched decode, "
         "tokens per second", "value": plain_s / invariant_s,
         "detail": f"{rows} decode steps of {clients} rows: every linear through the fixed {ROW_BLOCK}-row block "
                   f"{rows * clients / invariant_s:.0f} tok/s, the same forward with plain matmuls {rows * clients / plain_s:.0f} tok/s "
                   f"(the price of the invariance)"},
        {"row": f"eval, the built-in arith task ({items} items x 4 choices), tiny shape", "what": "items per second",
         "value": items / eval_s, "detail": f"{items} items in {eval_s:.2f} s ({eval_threads} thread{'s' if eval_threads > 1 else ''}; one forward "
                                                     f"of the 4 choices per item)"},
    ]


def decode_price(model, prompt: list[int], rows: int, steps: int) -> tuple[float, float, int]:
    """Seconds for `steps` decode steps of `rows` sequences through model.decode (each linear on the fixed row
    block) and through the same forward with plain matmuls (the block off): (invariant, plain, steps)."""
    from model import decode as dec

    def timed() -> float:
        pool = dec.KVPool(model, rows)
        caches = [pool.take() for _ in range(rows)]
        with torch.inference_mode():
            for c in caches:
                model(torch.tensor([prompt]), cache=c)
            t0 = time.perf_counter()
            for _ in range(steps):
                dec.decode(model, [5] * rows, caches)
        return time.perf_counter() - t0

    invariant = min(timed() for _ in range(2))
    block = dec.blocked
    dec.blocked = lambda module, x: module(x)
    try:
        plain = min(timed() for _ in range(2))
    finally:
        dec.blocked = block
    return invariant, plain, steps


@section("serve", order=150, aims=AIMS)
def run(work: Path, a: argparse.Namespace) -> list[dict]:
    q = a.quick
    return serve_rows(work, 128 if q else 256)
