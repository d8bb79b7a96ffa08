"""A fresh node needs nothing local (issue 55, item 5): a corpus in the store (`data.path=s3://...`: an
object, a prefix, a glob, `.gz`) packs with the fingerprint of the same files on a disk, and the packed
cache in the store (`data.cache_dir=s3://...`) is fetched verified, so a relaunch on a new machine
neither reads the corpus nor packs it again; the bytes it reads are the store client's own count
(common/store.py: Store.bytes_read). Every test against the SeaweedFS the session starts
(tests/seaweed.py); docs/object_storage.md, "Corpora and the packed cache"."""
from __future__ import annotations

import gzip
import json
import random
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

import launch
from common.store import store_of
from conftest import WORDS
from test_distill import made  # noqa: F401  (the teacher and the chats: a module fixture)

BUCKET = "runs"


def corpus_files(rnd: random.Random, n_files: int = 3) -> dict[str, bytes]:
    """A few JSONL files, the last gzip-compressed: name -> bytes."""
    out = {}
    for i in range(n_files):
        lines = "".join(json.dumps({"text": " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(5, 30))).capitalize() + "."}) + "\n"
                        for _ in range(400))
        name = f"part{i}.jsonl" + (".gz" if i == n_files - 1 else "")
        out[name] = gzip.compress(lines.encode(), mtime=0) if name.endswith(".gz") else lines.encode()
    return out


@pytest.fixture
def both(s3_server, tmp_path, monkeypatch):
    """The same corpus files on a disk (tmp_path/web) and in the store (s3://runs/<unique>/web), with a
    staging folder of this test's own: (local folder, URL)."""
    monkeypatch.setenv("MINIMIND_STAGING_DIR", str(tmp_path / "staging"))
    prefix = f"corpora-{uuid.uuid4().hex[:8]}"
    (tmp_path / "web").mkdir()
    for name, data in corpus_files(random.Random(0)).items():
        (tmp_path / "web" / name).write_bytes(data)
        store_of(BUCKET).put(f"{prefix}/web/{name}", data)
    return tmp_path / "web", f"s3://{BUCKET}/{prefix}/web"


@pytest.mark.unit
@pytest.mark.parametrize("tail", ["", "/*.jsonl*", "/part2.jsonl.gz", "/**/part[01].jsonl"], ids=["prefix", "glob", "gz-object", "glob-2"])
def test_a_corpus_in_the_store_packs_the_bytes_and_the_fingerprint_of_the_same_files_on_a_disk(both, tmp_path, tail):
    from data.prepare import pack, resolve_source

    local, url = both
    bin_a, a = pack(resolve_source(f"{local}{tail}", tmp_path / "c1"), 32, tmp_path / "c1")
    bin_b, b = pack(resolve_source(f"{url}{tail}", tmp_path / "c2"), 32, tmp_path / "c2")
    assert a["source_sha256"] == b["source_sha256"] and a.get("files") == b.get("files") and a["num_samples"] == b["num_samples"]
    assert bin_a.read_bytes() == bin_b.read_bytes()
    assert b["source"] == f"{url}{tail}" and all(r["identity"].keys() == {"size", "etag"} for r in b["sources"])
    # a second launch compares the listing's sizes and ETags: it reads none of the corpus's bytes
    store = store_of(BUCKET)
    store.bytes_read.clear()
    pack(resolve_source(f"{url}{tail}", tmp_path / "c2"), 32, tmp_path / "c2")
    assert store.bytes_read == {}


@pytest.mark.unit
def test_a_corpus_object_replaced_in_the_store_is_packed_again(both, tmp_path):
    from data.prepare import pack, resolve_source

    _, url = both
    _, first = pack(resolve_source(url, tmp_path / "c"), 32, tmp_path / "c")
    key = url.removeprefix(f"s3://{BUCKET}/") + "/part0.jsonl"
    store_of(BUCKET).put(key, b'{"text": "another text, long enough to fill a sample of thirty-three tokens or more."}\n')
    _, second = pack(resolve_source(url, tmp_path / "c"), 32, tmp_path / "c")
    assert second["source_sha256"] != first["source_sha256"] and second["num_samples"] < first["num_samples"]


@pytest.mark.unit
@pytest.mark.parametrize("path, says", [
    ("s3://runs/no-such-prefix/corpus.jsonl", "data.path: corpus s3://runs/no-such-prefix/corpus.jsonl does not exist in the store"),
    ("s3://runs/no-such-prefix/*.jsonl", "data.path=s3://runs/no-such-prefix/*.jsonl: the pattern matches no object in the store"),
    ("s3:///corpus.jsonl", "data.path=s3:///corpus.jsonl: no bucket"),
    ("s3://no-such-bucket/corpus.jsonl", "bucket 'no-such-bucket' does not exist"),
])
def test_an_s3_data_path_that_names_nothing_is_exit_2_naming_it(s3_server, tiny, tmp_path, monkeypatch, path, says):
    monkeypatch.setenv("MINIMIND_STAGING_DIR", str(tmp_path / "staging"))
    code, err = launch.in_process(*tiny, f"data.path={path}", f"out_dir={tmp_path / 'run'}")
    assert code == 2 and says in err and "Traceback" not in err, err


@pytest.mark.e2e
def test_a_store_that_does_not_answer_is_exit_1_naming_the_endpoint_and_the_object(s3_server, tiny, tmp_path):
    from test_preempt_e2e import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    proc = launch.run(0, *tiny, f"data.path=s3://{BUCKET}/corpora/web", f"data.cache_dir={tmp_path / 'cache'}", f"out_dir={tmp_path / 'run'}",
                      expect=1, env={**s3_server.env, "AWS_ENDPOINT_URL": dead, "MINIMIND_S3_ATTEMPTS": "2",
                                     "MINIMIND_STAGING_DIR": str(tmp_path / "staging")})
    assert f"{dead}: HEAD s3://{BUCKET}/corpora/web failed after 2 attempts" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.e2e
def test_a_fresh_node_with_the_corpus_and_its_packed_cache_in_the_store_neither_reads_the_corpus_nor_packs_and_ends_on_the_same_bits(
        both, tiny, tmp_path, monkeypatch):
    """The spot story for the data: node 1 packs the corpus from the store into the cache in the store and
    trains to step 4 (out_dir in the store too); node 2, whose disk never saw the run, runs the same
    command: it reads the cache's fingerprint, fetches the packed files verified, reads no byte of the
    corpus, packs nothing, and ends equal to the run on a disk. A second relaunch on node 2 reads the
    fingerprint alone."""
    from common.store import RemotePath

    local, url = both
    cache, out = f"{url.rsplit('/', 1)[0]}/cache", f"s3://{BUCKET}/run-{uuid.uuid4().hex[:8]}"
    args = [*[a for a in tiny if not a.startswith(("data.path=", "data.cache_dir="))], "train.steps=8", "checkpoint.interval=4"]
    code, _ = launch.in_process(*args, f"data.path={local}", f"data.cache_dir={tmp_path / 'disk-cache'}", f"out_dir={tmp_path / 'ref'}")
    assert code == 0
    store = store_of(BUCKET)
    corpus_keys = set(store.list(url.removeprefix(f"s3://{BUCKET}/") + "/"))
    corpus_bytes = sum(store.list(url.removeprefix(f"s3://{BUCKET}/") + "/").values())
    run = [*args, f"data.path={url}", f"data.cache_dir={cache}", f"out_dir={out}"]

    monkeypatch.setenv("MINIMIND_STAGING_DIR", str(tmp_path / "node1"))
    code, err = launch.in_process(*run, "train.halt_at=4")
    assert code == 0 and "packed s3://" in err and "put in the store" in err, err[-3000:]

    monkeypatch.setenv("MINIMIND_STAGING_DIR", str(tmp_path / "node2"))  # a new machine: nothing of the run on its disk
    store.bytes_read.clear()
    code, err = launch.in_process(*run)
    assert code == 0 and "packed s3://" not in err and "fetched from the store" in err and "not packed again" in err, err[-3000:]
    read = dict(store.bytes_read)
    cache_prefix = cache.removeprefix(f"s3://{BUCKET}/") + "/"
    cache_read = {k: n for k, n in read.items() if k.startswith(cache_prefix)}
    record = json.loads(store.get(next(k for k in cache_read if k.endswith(".json")))[0])
    assert not corpus_keys & set(read), "the fresh node read the corpus"
    assert cache_read == {**{cache_prefix + n: e["bytes"] for n, e in record["cache_files"].items()},
                          next(k for k in cache_read if k.endswith(".json")): len(json.dumps(record, indent=1).encode())}
    print(f"fresh node: the corpus {corpus_bytes} bytes, read 0 of it; the packed cache fetched {sum(cache_read.values())} bytes")

    # the run: every logged loss and the weights equal the run on a disk
    metrics = [json.loads(line) for line in (tmp_path / "node2" / BUCKET / RemotePath(out).key / "metrics.jsonl").read_text().splitlines()]
    assert [m["loss"] for m in metrics] == launch.losses(tmp_path / "ref") and len(metrics) == 8
    compare = subprocess.run([sys.executable, "-m", "checkpoint", "compare", out, str(tmp_path / "ref")], cwd=launch.ROOT,
                             capture_output=True, text=True, env={**launch.os.environ, "MINIMIND_STAGING_DIR": str(tmp_path / "tools")})
    assert compare.returncode == 0, compare.stdout + compare.stderr

    store.bytes_read.clear()  # the same node again: its verified copy stands; the fingerprint is all it reads of the cache
    code, err = launch.in_process(*run)
    assert code == 0, err[-3000:]
    cache_read = {k: n for k, n in store.bytes_read.items() if k.startswith(cache_prefix)}
    assert list(cache_read) == [k for k in cache_read if k.endswith(".json")] and sum(cache_read.values()) < 0.05 * corpus_bytes
    assert not corpus_keys & set(store.bytes_read)


@pytest.mark.e2e
def test_dpos_table_lives_beside_the_packed_rows_in_the_store_a_fresh_node_recomputes_nothing_and_a_damaged_chunk_is_computed_again(
        s3_server, tmp_path, monkeypatch):
    """With data.cache_dir=s3://... the precomputed table (objectives/tables.py: StoreTableFiles) is
    objects beside the packed rows: a fresh node reads it verified and computes no row; a chunk whose
    bytes changed in the store is named and computed again; every run ends on the same bits."""
    from objectives import tables
    from test_dpo import base, pairs, write

    cache = f"s3://{BUCKET}/dpo-{uuid.uuid4().hex[:8]}/cache"
    args = [*base(write(tmp_path / "dpo.jsonl", pairs()), cache), "train.steps=2"]
    monkeypatch.setenv("MINIMIND_STAGING_DIR", str(tmp_path / "node1"))
    code, err = launch.in_process(*args, f"out_dir={tmp_path / 'a'}")
    assert code == 0 and "rows computed" in err, err[-3000:]
    store, prefix = store_of(BUCKET), cache.removeprefix(f"s3://{BUCKET}/") + "/"
    (table,) = {k[len(prefix):].split("/")[0] for k in store.list(prefix) if ".ref-" in k}
    chunks = sorted(k for k in store.list(f"{prefix}{table}/") if k.endswith(".safetensors"))
    assert chunks and f"{prefix}{table}/{tables.MANIFEST}" in store.list(f"{prefix}{table}/")
    assert not list((tmp_path / "node1").rglob("*.safetensors"))  # the table is in the store, not on the node's disk

    monkeypatch.setenv("MINIMIND_STAGING_DIR", str(tmp_path / "node2"))
    code, err = launch.in_process(*args, f"out_dir={tmp_path / 'b'}")
    assert code == 0 and "rows computed" not in err and "rows the run reads verified" in err, err[-3000:]
    launch.assert_identical(tmp_path / "b", tmp_path / "a")

    data = bytearray(store.get(chunks[0])[0])
    data[-3] ^= 0x10
    store.put(chunks[0], bytes(data))
    monkeypatch.setenv("MINIMIND_STAGING_DIR", str(tmp_path / "node3"))
    code, err = launch.in_process(*args, f"out_dir={tmp_path / 'c'}")
    assert code == 0 and f"{chunks[0].rpartition('/')[2]} is damaged (its sha256" in err and "rows computed" in err, err[-3000:]
    launch.assert_identical(tmp_path / "c", tmp_path / "a")


@pytest.mark.unit
def test_a_packed_side_file_whose_bytes_changed_in_the_store_is_refused_as_it_comes_down_packed_again_and_put_back(both, tmp_path,
                                                                                                                monkeypatch, caplog):
    from data.dataset import counts_path
    from data.prepare import pack, resolve_source

    local, url = both
    cache = f"{url.rsplit('/', 1)[0]}/cache"
    want, _ = pack(resolve_source(str(local), tmp_path), 32, tmp_path / "disk")
    pack(resolve_source(url, tmp_path), 32, cache)
    store, prefix = store_of(BUCKET), cache.removeprefix(f"s3://{BUCKET}/") + "/"
    (key,) = [k for k in store.list(prefix) if k.endswith(".counts.npy")]
    data = bytearray(store.get(key)[0])
    data[-5] ^= 1
    store.put(key, bytes(data))
    monkeypatch.setenv("MINIMIND_STAGING_DIR", str(tmp_path / "fresh"))
    with caplog.at_level("INFO", logger="minimind"):
        got, _ = pack(resolve_source(url, tmp_path), 32, cache)
    assert f"s3://{BUCKET}/{key}: its bytes hash to" in caplog.text and "packed again" in caplog.text and "packed s3://" in caplog.text
    assert counts_path(got).read_bytes() == counts_path(want).read_bytes() == store.get(key)[0]  # the corpus's own packing, put back
    assert got.read_bytes() == want.read_bytes() and not chunked_record(got).exists()  # a whole file, packed here


def chunked_record(bin_path: Path) -> Path:
    from data.chunked import record_path

    return record_path(bin_path)


@pytest.fixture
def small_chunks(monkeypatch):
    """Packed files put in the store in chunks of 4 KiB (MINIMIND_CACHE_CHUNK_BYTES, for a launch): the
    test corpus's 255 KB make 63 of them."""
    from data import chunked

    monkeypatch.setattr(chunked, "CHUNK_BYTES", 4096)
    monkeypatch.setenv("MINIMIND_CACHE_CHUNK_BYTES", "4096")
    return 4096


@pytest.mark.unit
def test_a_fresh_nodes_packed_rows_come_from_the_store_a_chunk_at_a_time_as_they_are_read_and_equal_a_local_caches(both, tmp_path,
                                                                                                                small_chunks, monkeypatch):
    """The staging copy of a packed file in the store is a sparse file: a row read fetches the chunks
    it touches (ranged GETs, each verified against the record), nothing else; the same rows as the
    packing on a disk gives; a second reader on the node finds the chunks there and fetches nothing."""
    from data.dataset import PackedDataset
    from data.prepare import pack, resolve_source

    local, url = both
    cache = f"{url.rsplit('/', 1)[0]}/cache"
    want, _ = pack(resolve_source(str(local), tmp_path), 32, tmp_path / "disk")
    pack(resolve_source(url, tmp_path), 32, cache)
    store = store_of(BUCKET)
    (key,) = [k for k in store.list(cache.removeprefix(f"s3://{BUCKET}/") + "/") if k.endswith(".bin")]
    size = store.head(key).size
    monkeypatch.setenv("MINIMIND_STAGING_DIR", str(tmp_path / "fresh"))
    store.bytes_read.clear()
    got, meta = pack(resolve_source(url, tmp_path), 32, cache)
    assert key not in store.bytes_read and got.stat().st_size == size and chunked_record(got).exists()
    rows, theirs = PackedDataset(got, 32, dtype=meta["dtype"]), PackedDataset(want, 32, dtype=meta["dtype"])
    picked = [5, 6, 1000, len(rows) - 1]
    assert all(torch_equal(rows[i], theirs[i]) for i in picked)
    touched = {(i * 66) // small_chunks for i in picked} | {(i * 66 + 65) // small_chunks for i in picked}
    assert store.bytes_read[key] == sum(min(small_chunks, size - c * small_chunks) for c in touched) < size / 10
    assert [len(x) for x in rows.__getitems__([7, 2000, 3000])] == [2, 2, 2]  # a micro-batch's chunks, fetched at once
    fetched = store.bytes_read[key]
    again = PackedDataset(got, 32, dtype=meta["dtype"])  # another process on this node: its chunks are on the disk, verified
    assert all(torch_equal(again[i], theirs[i]) for i in [*picked, 7, 2000, 3000]) and store.bytes_read[key] == fetched


@pytest.mark.unit
def test_a_staging_copy_packed_over_by_another_run_of_the_node_leaves_this_readers_rows_the_stores_bytes(both, tmp_path, small_chunks,
                                                                                                     monkeypatch):
    """A reader checks and fills the file it opened, not whatever the path names later: another run of the node
    packing the corpus over the staging copy (a new file at the path) leaves this reader's unread rows to come
    from the store, verified, never the holes of the file it maps (found by review: rows of zeros trained on)."""
    import os

    from data.dataset import PackedDataset
    from data.prepare import pack, resolve_source

    local, url = both
    cache = f"{url.rsplit('/', 1)[0]}/cache"
    want, _ = pack(resolve_source(str(local), tmp_path), 32, tmp_path / "disk")
    pack(resolve_source(url, tmp_path), 32, cache)
    monkeypatch.setenv("MINIMIND_STAGING_DIR", str(tmp_path / "fresh"))
    got, meta = pack(resolve_source(url, tmp_path), 32, cache)
    rows, theirs = PackedDataset(got, 32, dtype=meta["dtype"]), PackedDataset(want, 32, dtype=meta["dtype"])
    assert torch_equal(rows[5], theirs[5])
    other = got.with_name("packed-over")
    other.write_bytes(want.read_bytes())
    os.replace(other, got)  # what an atomic repack of the same corpus does to the path
    assert all(torch_equal(rows[i], theirs[i]) for i in (1000, 2000, len(rows) - 1))


def torch_equal(a, b) -> bool:
    import torch

    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.unit
def test_a_chunk_whose_bytes_changed_in_the_store_is_named_when_a_row_of_it_is_read_and_never_used(both, tmp_path, small_chunks,
                                                                                                  monkeypatch):
    from data.chunked import ChunkDamaged
    from data.dataset import PackedDataset
    from data.prepare import pack, resolve_source

    _, url = both
    cache = f"{url.rsplit('/', 1)[0]}/cache"
    pack(resolve_source(url, tmp_path), 32, cache)
    store = store_of(BUCKET)
    (key,) = [k for k in store.list(cache.removeprefix(f"s3://{BUCKET}/") + "/") if k.endswith(".bin")]
    data = bytearray(store.get(key)[0])
    data[10 * small_chunks + 100] ^= 1  # chunk 10: row 622's bytes
    store.put(key, bytes(data))
    monkeypatch.setenv("MINIMIND_STAGING_DIR", str(tmp_path / "fresh"))
    got, meta = pack(resolve_source(url, tmp_path), 32, cache)
    rows = PackedDataset(got, 32, dtype=meta["dtype"])
    rows[0], rows[3000]  # other chunks: read
    with pytest.raises(ChunkDamaged) as e:
        rows[(10 * small_chunks + 100) // 66]
    assert str(e.value).startswith(f"s3://{BUCKET}/{key}: bytes {10 * small_chunks}-{11 * small_chunks - 1} (chunk 10 of ")
    assert "the packed cache in the store is damaged" in str(e.value)
    with open(got, "rb") as f:  # nothing of it written into the staging copy
        f.seek(10 * small_chunks)
        assert f.read(small_chunks) == bytes(small_chunks)


@pytest.mark.e2e
def test_distillations_teacher_table_in_the_store_is_read_verified_by_a_fresh_node_that_computes_no_row(s3_server, made, tmp_path,
                                                                                                          monkeypatch):
    """The teacher's top-k table beside the packed rows in the store, as DPO's: a fresh node reads it
    and ends on the bits of the run that computed it."""
    from test_distill import base, figures

    cache = f"s3://{BUCKET}/distill-{uuid.uuid4().hex[:8]}/cache"
    args = [*[a for a in base(made) if not a.startswith("data.cache_dir=")], f"data.cache_dir={cache}", "train.distill.top_k=8"]
    monkeypatch.setenv("MINIMIND_STAGING_DIR", str(tmp_path / "node1"))
    code, err = launch.in_process(*args, f"out_dir={tmp_path / 'a'}")
    assert code == 0 and "rows computed" in err, err[-3000:]
    prefix = cache.removeprefix(f"s3://{BUCKET}/") + "/"
    assert any(".teacher-" in k and k.endswith(".safetensors") for k in store_of(BUCKET).list(prefix))
    monkeypatch.setenv("MINIMIND_STAGING_DIR", str(tmp_path / "node2"))
    code, err = launch.in_process(*args, f"out_dir={tmp_path / 'b'}")
    assert code == 0 and "rows computed" not in err and "rows the run reads verified" in err, err[-3000:]
    assert figures(tmp_path / "b") == figures(tmp_path / "a")
    assert launch.inspect(tmp_path / "b")["model_sha256"] == launch.inspect(tmp_path / "a")["model_sha256"]


@pytest.mark.e2e
def test_dataloader_workers_fetch_chunks_with_clients_of_their_own_and_a_damaged_one_is_named_in_one_line(both, tmp_path, small_chunks,
                                                                                                         monkeypatch):
    """data.num_workers > 0: each forked worker fetches the chunks of its rows through a store client
    of its own (never the parent's connections, common/store.py), the rows a local cache's; a damaged
    chunk met in a worker reaches the trainer as one line naming the object, not the worker's traceback."""
    import torch
    from torch.utils.data import DataLoader

    from data.chunked import ChunkDamaged
    from data.dataset import PackedDataset
    from data.prepare import pack, resolve_source

    local, url = both
    cache = f"{url.rsplit('/', 1)[0]}/cache"
    want, _ = pack(resolve_source(str(local), tmp_path), 32, tmp_path / "disk")
    pack(resolve_source(url, tmp_path), 32, cache)
    store = store_of(BUCKET)
    (key,) = [k for k in store.list(cache.removeprefix(f"s3://{BUCKET}/") + "/") if k.endswith(".bin")]
    data = bytearray(store.get(key)[0])
    data[20 * small_chunks + 7] ^= 1
    store.put(key, bytes(data))
    monkeypatch.setenv("MINIMIND_STAGING_DIR", str(tmp_path / "fresh"))
    got, meta = pack(resolve_source(url, tmp_path), 32, cache)
    rows, theirs = PackedDataset(got, 32, dtype=meta["dtype"]), PackedDataset(want, 32, dtype=meta["dtype"])
    rows[0]  # the parent's client has been used (its connections open) before the workers fork
    batches = [[5, 900], [1500, 3100], [(20 * small_chunks + 7) // 66, 1]]
    def fresh_client(worker: int) -> None:  # in the forked worker: the parent's Store (its client made) is not inherited
        (tmp_path / f"worker{worker}").write_text(str(store_of(BUCKET)._client is None and store_of(BUCKET) is not store))

    loader = iter(DataLoader(rows, batch_sampler=batches, num_workers=2, multiprocessing_context="fork", worker_init_fn=fresh_client))
    for indices in batches[:2]:
        x, y = next(loader)
        assert torch.equal(x, torch.stack([theirs[i][0] for i in indices])) and torch.equal(y, torch.stack([theirs[i][1] for i in indices]))
    with pytest.raises(ChunkDamaged) as e:
        next(loader)
    from run.protocol import describe

    said = describe(e.value)  # what the run says of it (torch wraps a worker's error in the worker's traceback)
    assert said.startswith(f"s3://{BUCKET}/{key}: bytes {20 * small_chunks}-") and "\n" not in said, said
    assert [(tmp_path / f"worker{w}").read_text() for w in (0, 1)] == ["True", "True"]


@pytest.mark.e2e
def test_a_fresh_node_resuming_from_the_store_reads_the_chunks_of_the_rows_it_trains_not_the_packed_corpus_and_ends_on_the_same_bits(
        s3_server, tmp_path, monkeypatch, small_chunks):
    """Issue 55, item 5's last clause: node 1 packs a corpus of 1.6 MB of packed rows into the cache in the
    store and halts at step 4 (out_dir in the store); a fresh node (a new HOME, its staging folder
    empty) resumes and trains steps 5 and 6: of the packed cache it reads the record, the side file
    and the chunks of the 16 rows it trains, under a tenth of the cache's bytes (the store client's own
    count), and ends on the bits of the uninterrupted run on a disk. Before it, another fresh node
    whose first row's chunk was changed in the store exits 1 naming the object and the chunk, having
    trained nothing on it."""
    from common.store import RemotePath, staging_root

    prefix = f"lazy-{uuid.uuid4().hex[:8]}"
    (tmp_path / "web").mkdir()
    for name, data in corpus_files(random.Random(1), n_files=24).items():
        (tmp_path / "web" / name).write_bytes(data)
        store_of(BUCKET).put(f"{prefix}/web/{name}", data)
    tiny = ["model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.seq_len=32", "train.global_batch=8",
            "train.micro_batch=2", "train.steps=6", "train.warmup_steps=3", "train.lr=3e-3", "checkpoint.interval=2", "log.progress=false",
            "runtime.threads=1", "log.sample_ids=true"]
    code, err = launch.in_process(*tiny, f"data.path={tmp_path / 'web'}", f"data.cache_dir={tmp_path / 'disk-cache'}",
                                  f"out_dir={tmp_path / 'ref'}")
    assert code == 0, err[-3000:]
    cache, out = f"s3://{BUCKET}/{prefix}/cache", f"s3://{BUCKET}/{prefix}/run"
    run = [*tiny, f"data.path=s3://{BUCKET}/{prefix}/web", f"data.cache_dir={cache}", f"out_dir={out}"]
    monkeypatch.setenv("MINIMIND_STAGING_DIR", str(tmp_path / "node1"))
    code, err = launch.in_process(*run, "train.halt_at=4")
    assert code == 0 and "put in the store" in err, err[-3000:]
    store = store_of(BUCKET)
    (record_key,) = [k for k in store.list(f"{prefix}/cache/") if k.endswith(".json")]
    record = json.loads(store.get(record_key)[0])
    (bin_name,) = [n for n, e in record["cache_files"].items() if "chunks" in e]
    bin_key, packed = f"{prefix}/cache/{bin_name}", sum(e["bytes"] for e in record["cache_files"].values())
    assert record["cache_files"][bin_name]["chunk_bytes"] == small_chunks and packed > 1_500_000

    # a damaged chunk: the one holding step 5's first row; a fresh node names it and trains nothing on it
    row = launch.metrics(tmp_path / "ref")[4]["sample_ids"][0]
    original = store.get(bin_key)[0]
    damaged = bytearray(original)
    damaged[row * 66 + 10] ^= 1
    store.put(bin_key, bytes(damaged))
    monkeypatch.delenv("MINIMIND_STAGING_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home3"))
    code, err = launch.in_process(*run)
    chunk = (row * 66 + 10) // small_chunks
    assert code == 1 and f"s3://{BUCKET}/{bin_key}: bytes {chunk * small_chunks}-{(chunk + 1) * small_chunks - 1} (chunk {chunk} of " in err
    assert "the packed cache in the store is damaged" in err and "Traceback" not in err, err[-3000:]
    staged = staging_root() / BUCKET / RemotePath(out).key / "metrics.jsonl"
    assert [m["step"] for m in map(json.loads, staged.read_text().splitlines())] == [1, 2, 3, 4]  # step 5 never trained
    store.put(bin_key, original)

    monkeypatch.setenv("HOME", str(tmp_path / "home2"))  # a new machine: nothing of the run or the cache on its disk
    assert not staging_root().exists()
    store.bytes_read.clear()
    code, err = launch.in_process(*run)
    assert code == 0 and "resum" in err and "packed s3://" not in err and "read a chunk at a time" in err, err[-3000:]
    read = {k: n for k, n in store.bytes_read.items() if k.startswith(f"{prefix}/cache/")}
    assert not any(k.startswith(f"{prefix}/web/") for k in store.bytes_read), "the fresh node read the corpus"
    assert read[bin_key] <= 32 * small_chunks  # 16 rows, each in one chunk or across two
    assert sum(read.values()) < 0.1 * packed, (read, packed)
    local_bin = staging_root() / ".data" / BUCKET / prefix / "cache" / bin_name
    assert local_bin.stat().st_size == record["cache_files"][bin_name]["bytes"]
    assert local_bin.stat().st_blocks * 512 <= read[bin_key] + small_chunks  # the staging copy holds the chunks fetched
    print(f"fresh node: read {sum(read.values())} of the packed cache's {packed} bytes ({sum(read.values()) / packed:.3f}): "
          f"the packed rows {read[bin_key]}, the record and side files {sum(read.values()) - read[bin_key]}")

    metrics = [json.loads(line) for line in (staging_root() / BUCKET / RemotePath(out).key / "metrics.jsonl").read_text().splitlines()]
    assert [(m["loss"], m["sample_ids"]) for m in metrics] == [(m["loss"], m["sample_ids"]) for m in launch.metrics(tmp_path / "ref")]
    assert len(metrics) == 6
    compare = subprocess.run([sys.executable, "-m", "checkpoint", "compare", out, str(tmp_path / "ref")], cwd=launch.ROOT,
                             capture_output=True, text=True, env={**launch.os.environ, "MINIMIND_STAGING_DIR": str(tmp_path / "tools")})
    assert compare.returncode == 0, compare.stdout + compare.stderr


@pytest.mark.e2e
def test_two_ranks_on_one_node_read_their_rows_chunks_into_one_staging_copy_and_end_equal_to_the_two_process_run_on_a_disk(
        s3_server, tmp_path):
    """torchrun with 2 processes, the corpus and its packed cache in the store: each rank fetches the
    chunks of the rows it computes into the node's one sparse staging copy (the same verified bytes
    where two meet); halted at step 2 on node 1, resumed on a fresh node 2, the run ends equal to the
    2-process run on a disk (weights and every logged loss: `checkpoint compare`)."""
    prefix = f"w2-{uuid.uuid4().hex[:8]}"
    (tmp_path / "web").mkdir()
    for name, data in corpus_files(random.Random(1), n_files=6).items():
        (tmp_path / "web" / name).write_bytes(data)
        store_of(BUCKET).put(f"{prefix}/web/{name}", data)
    tiny = ["model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.seq_len=32", "train.global_batch=8",
            "train.micro_batch=2", "train.steps=6", "train.warmup_steps=3", "checkpoint.interval=2", "log.progress=false", "runtime.threads=1"]
    env = {**s3_server.env, "MINIMIND_CACHE_CHUNK_BYTES": "4096"}
    launch.run(2, *tiny, f"data.path={tmp_path / 'web'}", f"data.cache_dir={tmp_path / 'disk-cache'}", f"out_dir={tmp_path / 'ref'}",
               env={**env, "MINIMIND_STAGING_DIR": str(tmp_path / "node0")})
    run = [*tiny, f"data.path=s3://{BUCKET}/{prefix}/web", f"data.cache_dir=s3://{BUCKET}/{prefix}/cache", f"out_dir=s3://{BUCKET}/{prefix}/out"]
    launch.run(2, *run, "train.halt_at=2", env={**env, "MINIMIND_STAGING_DIR": str(tmp_path / "node1")})
    proc = launch.run(2, *run, env={**env, "MINIMIND_STAGING_DIR": str(tmp_path / "node2")})
    assert "read a chunk at a time" in proc.stderr and "packed s3://" not in proc.stderr, proc.stderr[-3000:]
    (staged,) = (tmp_path / "node2" / ".data" / BUCKET / prefix / "cache").glob("*.bin")
    assert staged.stat().st_blocks * 512 < staged.stat().st_size / 2  # the chunks of 32 rows, not the file
    compare = subprocess.run([sys.executable, "-m", "checkpoint", "compare", f"s3://{BUCKET}/{prefix}/out", str(tmp_path / "ref")],
                             cwd=launch.ROOT, capture_output=True, text=True,
                             env={**launch.os.environ, "MINIMIND_STAGING_DIR": str(tmp_path / "tools")})
    assert compare.returncode == 0, compare.stdout + compare.stderr
