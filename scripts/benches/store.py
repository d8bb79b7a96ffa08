"""Checkpoints in an S3 store against raw multipart puts and gets, and a fresh node's resume from the store."""
from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from checkpoint import CheckpointConfig, CheckpointManager, ModelState, OptimizerState, storage
from configs import load_config
from model import MiniMindLM
from objectives import make_optimizer
from run import folder as runfolder
from run.state import TrainState
from runtime import Runtime

from . import section
from .helpers import ROOT, SMALL, bench_meta, log_quiet, shape_104m, small_model, timed_save, trained_states, vocab_6400


AIMS = {
    "store save / raw multipart put": ("<=", 1.15),
    "store resume / raw get + sha256": ("<=", 1.1),
    "async stall, store / local": ("<=", 1.2),
}


def store_rows(work: Path, repeat: int, megabytes: int) -> list[dict]:
    """A run folder in object storage (docs/object_storage.md), against SeaweedFS on loopback (the
    tests' server, tests/seaweed.py: `weed mini` on 127.0.0.1, its data on this disk), the 26M and
    104M shapes, interleaved round by round with their floors: a sync save to the store against a raw
    multipart put of the same bytes (boto3's own upload_fileobj, 8 MiB parts, the files at once, 4
    parts of each in flight: our part size and concurrency); a verified resume from the store against
    a raw get (download_fileobj, the same parts and concurrency) + sha256 of the same objects; the
    async stall with an s3 out_dir against the local one. Then a fresh node's seconds from launch to
    its first step against a warm node's, and the bytes it fetched (counted by a proxy in front of the
    server) against the step folder's; and, with a corpus of `megabytes` MB and its packed cache in the
    store, the bytes of the cache a fresh node's resume fetched against the cache's."""
    import concurrent.futures
    import io

    sys.path.insert(0, str(ROOT / "tests"))
    import seaweed
    from boto3.s3.transfer import TransferConfig

    from checkpoint.remote import RemoteStore
    from common.store import RemotePath, store_of

    server = seaweed.Seaweed(work / "seaweed").start()
    saved_env = {k: os.environ.get(k) for k in server.env}
    os.environ.update(server.env)
    rows: list[dict] = []
    try:
        client = server.client()
        transfer = TransferConfig(multipart_threshold=8 << 20, multipart_chunksize=8 << 20, max_concurrency=4, use_threads=True)
        log_quiet()
        for label, mcfg in (("26M", small_model()), ("104M", shape_104m())):
            model, opt = trained_states(mcfg)
            cfg = load_config(None, SMALL)
            cfg.model = mcfg
            meta = bench_meta(cfg)
            states = {"model": ModelState(model), "optimizer": OptimizerState(model, opt), "train": TrainState(step=1)}
            step = iter(range(1, 10_000))
            url = f"s3://{seaweed.BUCKET}/bench-{label}"
            mgr = CheckpointManager(CheckpointConfig(interval=1, keep=2), url, Runtime(), meta)
            s3_async = CheckpointManager(CheckpointConfig(interval=1, keep=2, async_=True), f"{url}-async", Runtime(), meta)
            local_async = CheckpointManager(CheckpointConfig(interval=1, keep=2, async_=True), work / f"store-local-async-{label}", Runtime(), meta)
            mgr.load({})
            s3_async.load({})
            times: dict[str, list[float]] = {k: [] for k in ("save", "put", "load", "get", "s3_stall", "local_stall")}
            nbytes = 0
            for r in range(repeat):
                s, seconds = timed_save(mgr, states, step)
                times["save"].append(seconds)
                remote = RemoteStore(RemotePath(url))
                folder = remote.root / storage.step_dir_name(s)
                body = remote.read_manifest(folder)
                where = remote.files(folder, body)
                contents = {name: store_of(seaweed.BUCKET).get((where / name).key)[0] for name in body["files"]}
                nbytes = sum(len(v) for v in contents.values())
                with concurrent.futures.ThreadPoolExecutor(len(contents)) as pool:
                    t0 = time.perf_counter()
                    list(pool.map(lambda kv: client.upload_fileobj(io.BytesIO(kv[1]), seaweed.BUCKET, f"bench-raw-{label}/{kv[0]}",
                                                                    Config=transfer), contents.items()))
                    times["put"].append(time.perf_counter() - t0)
                del contents
                fresh_model = MiniMindLM(mcfg)
                fresh = {"model": ModelState(fresh_model), "optimizer": OptimizerState(fresh_model, make_optimizer(fresh_model, cfg.train)),
                         "train": TrainState()}
                loader = CheckpointManager(CheckpointConfig(interval=1, keep=2), url, Runtime(), meta)
                t0 = time.perf_counter()
                assert loader.load(fresh).step == s
                times["load"].append(time.perf_counter() - t0)
                loader.close()

                def get_and_hash(name: str) -> str:
                    buf = io.BytesIO()
                    client.download_fileobj(seaweed.BUCKET, f"bench-raw-{label}/{name}", buf, Config=transfer)
                    return hashlib.sha256(buf.getbuffer()).hexdigest()

                with concurrent.futures.ThreadPoolExecutor(len(body["files"])) as pool:
                    t0 = time.perf_counter()
                    list(pool.map(get_and_hash, body["files"]))
                    times["get"].append(time.perf_counter() - t0)
                times["s3_stall"].append(timed_save(s3_async, states, step)[1])
                s3_async.wait()
                times["local_stall"].append(timed_save(local_async, states, step)[1])
                local_async.wait()
            for m in (mgr, s3_async, local_async):
                m.close()
            t = {k: statistics.median(v) for k, v in times.items()}
            rows += [
                {"row": f"sync save to the store, {label}, SeaweedFS on loopback", "what": "store save / raw multipart put of the same bytes",
                 "value": t["save"] / t["put"], "aim": "store save / raw multipart put",
                 "detail": f"{t['save']:.2f} s / {t['put']:.2f} s for {nbytes / 2**20:.0f} MiB (boto3 upload_fileobj, 8 MiB parts, "
                           f"the files at once, 4 parts each in flight); median of {repeat}"},
                {"row": f"verified resume from the store, {label}, SeaweedFS on loopback", "what": "store resume / raw get + sha256",
                 "value": t["load"] / t["get"], "aim": "store resume / raw get + sha256",
                 "detail": f"{t['load']:.2f} s (discovery, every byte read and hashed, DCP's load, the identity) / {t['get']:.2f} s "
                           f"(boto3 download_fileobj, the same parts and concurrency, then sha256); median of {repeat}"},
                {"row": f"async stall, {label}, s3 out_dir vs local", "what": "async stall, store / local",
                 "value": t["s3_stall"] / t["local_stall"], "aim": "async stall, store / local",
                 "detail": f"{t['s3_stall'] * 1e3:.0f} ms / {t['local_stall'] * 1e3:.0f} ms until save() returned; median of {repeat}"},
            ]
            del model, opt, states
        rows += fresh_node_rows(work, server)
        rows += fresh_node_cache_rows(work, server, megabytes)
    finally:
        server.stop()
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return rows


def fresh_node_rows(work: Path, server) -> list[dict]:
    """A resume on a node that never saw the run (an empty staging folder and data cache) against
    one on the node that ran it, through a proxy that counts the bytes the store sent: seconds from
    the launch to the first step's metrics line, and the bytes fetched against the step folder's."""
    import seaweed

    from checkpoint.remote import RemoteStore
    from common.store import RemotePath

    tok = vocab_6400(work)
    args = [sys.executable, "train.py", *SMALL, f"data.tokenizer={tok}", "model.seq_len=64", "train.global_batch=2",
            "train.micro_batch=1", "log.progress=false", "checkpoint.interval=0"]
    url = f"s3://{seaweed.BUCKET}/bench-fresh"
    first = subprocess.run([*args, "train.steps=2", f"data.cache_dir={work / 'warm-cache'}", f"out_dir={url}"], cwd=ROOT,
                           capture_output=True, text=True, env={**os.environ, "MINIMIND_STAGING_DIR": str(work / "warm-staging")})
    assert first.returncode == 0, first.stderr[-2000:]
    got: dict[str, tuple[float, int]] = {}
    proxy = seaweed.FaultProxy(server, lambda method, path, n: None)  # forwards everything, counting the bytes sent back
    try:
        # the warm node resumes step 2 on its own disk's cache and staging; the fresh one then resumes step 3 with neither
        for name, cache, staging, steps in (("warm", "warm-cache", "warm-staging", 3), ("fresh", "fresh-cache", "fresh-staging", 4)):
            before, out = proxy.sent, work / f"{name}.log"
            t0 = time.perf_counter()
            proc = subprocess.Popen([*args, f"train.steps={steps}", f"data.cache_dir={work / cache}", f"out_dir={url}"], cwd=ROOT,
                                    stdout=open(out, "w"), stderr=subprocess.STDOUT,
                                    env={**os.environ, "MINIMIND_STAGING_DIR": str(work / staging), "AWS_ENDPOINT_URL": proxy.endpoint})
            metrics = work / staging / seaweed.BUCKET / "bench-fresh" / runfolder.METRICS
            while (not metrics.exists() or len(metrics.read_text().splitlines()) < steps) and proc.poll() is None:
                time.sleep(0.02)  # the staged log holds the steps before (from the store), then the first step's line
            got[name] = (time.perf_counter() - t0, proxy.sent - before)
            proc.wait(timeout=600)
            assert proc.returncode == 0, out.read_text()[-2000:]
    finally:
        proxy.close()
    remote = RemoteStore(RemotePath(url))
    steps = remote.list_steps()
    body = remote.read_manifest(steps[-1][1]) if steps else {"files": {}}
    step_bytes = sum(e["bytes"] for e in body["files"].values())
    (tw, bw), (tf, bf) = got["warm"], got["fresh"]
    return [{"row": "a fresh node's launch to its first step, 26M, 1 process, SeaweedFS on loopback", "what": "fresh node / warm node, seconds",
             "value": tf / tw, "detail": f"{tf:.1f} s / {tw:.1f} s from the launch to the first step's line (both read the checkpoint "
                                         f"from the store; the fresh one packs its corpus again: data.cache_dir is local)"},
            {"row": "a fresh node's bytes from the store, 26M", "what": "bytes fetched / the step folder's bytes", "value": bf / step_bytes,
             "detail": f"{bf / 2**20:.1f} MiB / {step_bytes / 2**20:.1f} MiB (the warm node fetched {bw / 2**20:.1f} MiB)"}]


def fresh_node_cache_rows(work: Path, server, megabytes: int) -> list[dict]:
    """The corpus (`megabytes` MB of JSONL, the byte tokenizer: two bytes of packed rows per byte) and
    its packed cache in the store (data.cache_dir=s3://..., the default chunk of 1 MiB): node 1 packs
    it, puts the cache and trains 2 steps of 8 rows of 512 tokens; a fresh node (empty staging) resumes
    and trains 2 more through a proxy that counts the bytes the store sent per object: the bytes of the
    cache's objects it fetched (the record, the side files, the chunks of the 16 rows it trained:
    data/chunked.py) against the packed cache's bytes (what it fetched whole before the rows were read
    lazily)."""
    import json
    import random

    import seaweed

    from common.store import store_of

    words = [f"{w}{i}" for i, w in enumerate("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split() * 40)]
    rnd, corpus = random.Random(0), work / "lazy-corpus.jsonl"
    with open(corpus, "w") as f:
        while f.tell() < megabytes * 1_000_000:
            f.write("".join(json.dumps({"text": " ".join(rnd.choices(words, k=rnd.randint(50, 400)))}) + "\n" for _ in range(1000)))
    store = store_of(seaweed.BUCKET)
    store.upload("bench-lazy/corpus.jsonl", corpus, hashlib.sha256(corpus.read_bytes()).hexdigest())
    args = [sys.executable, "train.py", "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.seq_len=512",
            "train.global_batch=8", "train.micro_batch=4", "log.progress=false", "checkpoint.interval=0", "runtime.threads=1",
            f"data.path=s3://{seaweed.BUCKET}/bench-lazy/corpus.jsonl", f"data.cache_dir=s3://{seaweed.BUCKET}/bench-lazy/cache",
            f"out_dir=s3://{seaweed.BUCKET}/bench-lazy/run"]
    first = subprocess.run([*args, "train.steps=2"], cwd=ROOT, capture_output=True, text=True,
                           env={**os.environ, "MINIMIND_STAGING_DIR": str(work / "lazy-node1")})
    assert first.returncode == 0, first.stderr[-2000:]
    proxy = seaweed.FaultProxy(server, lambda method, path, n: None)  # forwards everything, counting the bytes per object
    try:
        fresh = subprocess.run([*args, "train.steps=4"], cwd=ROOT, capture_output=True, text=True,
                               env={**os.environ, "MINIMIND_STAGING_DIR": str(work / "lazy-node2"), "AWS_ENDPOINT_URL": proxy.endpoint})
        assert fresh.returncode == 0 and "read a chunk at a time" in fresh.stderr, fresh.stderr[-2000:]
    finally:
        proxy.close()
    cache = f"/{seaweed.BUCKET}/bench-lazy/cache/"
    (record_key,) = [k for k in store.list("bench-lazy/cache/") if k.endswith(".json")]
    record = json.loads(store.get(record_key)[0])
    packed = sum(e["bytes"] for e in record["cache_files"].values())
    rows_name = next(n for n, e in record["cache_files"].items() if "chunks" in e)
    got = {path: n for path, n in proxy.sent_for.items() if path.startswith(cache)}
    fetched, rows = sum(got.values()), got.get(cache + rows_name, 0)
    of_corpus = proxy.sent_for.get(f"/{seaweed.BUCKET}/bench-lazy/corpus.jsonl", 0)
    chunk = record["cache_files"][rows_name]["chunk_bytes"]
    return [{"row": f"a fresh node's bytes of the packed cache in the store, {packed / 2**20:.0f} MiB packed, a resume of 2 steps x 8 rows",
             "what": "bytes fetched / the corpus's packed bytes", "value": fetched / packed,
             "detail": f"{fetched / 2**20:.1f} MiB / {packed / 2**20:.1f} MiB: the packed rows {rows / 2**20:.1f} MiB ({rows // chunk + bool(rows % chunk)} "
                       f"chunks of {chunk // 2**20} MiB for the 16 rows trained), the record ({len(record['cache_files'][rows_name]['chunks'])} "
                       f"chunk hashes) and side files {(fetched - rows) / 2**10:.0f} KiB; of the corpus ({megabytes} MB) {of_corpus} bytes; "
                       f"before the rows were read lazily a fresh node fetched the whole cache (1.0)"}]


@section("store", order=210, aims=AIMS)
def run(work: Path, a: argparse.Namespace) -> list[dict]:
    q = a.quick
    return store_rows(work, 2 if q else 3, 64 if q else 128)
