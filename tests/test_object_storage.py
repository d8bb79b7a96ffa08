"""A run folder in object storage (docs/object_storage.md), every test against a real S3 server the
session starts (SeaweedFS on 127.0.0.1: tests/seaweed.py, the `s3_server` fixture): the store's own
guarantees first, then the publish protocol, the lease, the commands that read the store, bad
input, and two nodes without a shared filesystem (the faults: tests/test_object_storage_faults.py)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

import launch
from checkpoint import CheckpointConfig, CheckpointManager, storage
from checkpoint.remote import POINTER, RemoteStore
from common.store import Conflict, Lease, RemotePath, StoreRefused, store_of
from test_checkpoint_manager import OneProcess, meta, states

BUCKET = "runs"


@pytest.fixture
def url(s3_server, request) -> str:
    """A run folder of this test's own in the store."""
    return f"s3://{BUCKET}/{request.node.name[:60]}-{uuid.uuid4().hex[:6]}"


def manager(url: str, **cfg) -> CheckpointManager:
    return CheckpointManager(CheckpointConfig(**cfg), url, OneProcess(), meta())


def keys(url: str) -> dict[str, int]:
    run = RemotePath(url)
    return store_of(run.bucket).list(f"{run.key}/")


def save(mgr: CheckpointManager, step: int, value: int | None = None) -> None:
    st = states(step, value if value is not None else step * 10)
    mgr.save(step, st, background=False)


# ---------------------------------------------------------------------------------------- the referee
@pytest.mark.unit
def test_the_server_refuses_a_second_create_a_stale_compare_and_swap_and_bytes_whose_sha256_is_not_the_one_sent(s3_server):
    store = store_of(BUCKET)
    key = f"referee-{uuid.uuid4().hex[:6]}"
    etag = store.put(key, b"one", create=True)
    with pytest.raises(Conflict):
        store.put(key, b"two", create=True)
    newer = store.put(key, b"three", if_match=etag)
    with pytest.raises(Conflict):
        store.put(key, b"four", if_match=etag)
    assert store.get(key) == (b"three", newer)
    from common.store import StoreError

    with pytest.raises(StoreError, match="BadDigest"):
        store.put(f"{key}-sum", b"bytes", sha256="00" * 32)
    store.probe_conditional_writes(key)  # what a launch checks before it trusts the store


# ---------------------------------------------------------------------------------------- the protocol
@pytest.mark.unit
def test_two_writers_publishing_one_step_one_wins_and_the_other_is_refused_naming_it_nothing_overwritten(url):
    a, b = manager(url), manager(url)
    assert a.load(states()) is None and b.load(states()) is None
    save(a, 1, 10)
    before = store_of(BUCKET).get(f"{RemotePath(url).key}/checkpoints/step_00000001/manifest.json")
    with pytest.raises(storage.CheckpointError, match="step 1 was published by another writer first"):
        save(b, 1, 99)
    assert store_of(BUCKET).get(f"{RemotePath(url).key}/checkpoints/step_00000001/manifest.json") == before
    st = states()
    assert manager(url).load(st).step == 1 and st["counter"].value == 10  # the winner's step, whole
    # the loser's files were removed with its failed save: only the winner's prefix is under the step
    assert {k.split("/")[3] for k in keys(url) if "/step_00000001/" in k and not k.endswith("manifest.json")} \
        == {json.loads(before[0])["objects"]}


@pytest.mark.unit
def test_a_writer_whose_pointer_moved_since_it_looked_is_refused_and_prunes_nothing(url):
    a, b = manager(url, keep=2), manager(url, keep=2)
    a.load(states())
    save(a, 1)
    assert b.load(states()).step == 1  # b saw the pointer at step 1
    for step in (2, 3):
        save(a, step)
    pointer = json.loads(store_of(BUCKET).get(f"{RemotePath(url).key}/checkpoints/{POINTER}")[0])
    assert pointer["step"] == 3
    with pytest.raises(storage.CheckpointError, match="moved by another writer to step 3"):
        save(b, 5)
    assert json.loads(store_of(BUCKET).get(f"{RemotePath(url).key}/checkpoints/{POINTER}")[0])["step"] == 3
    assert [s for s, _ in RemoteStore(RemotePath(url)).list_steps()] == [5, 3, 2]  # a pruned step 1, nothing of a's lost to b


@pytest.mark.unit
def test_a_step_whose_cut_short_prune_the_start_finished_is_not_found_again_by_its_name(url):
    """The start finishes a prune cut short (the step's files, then its manifest, deleted): a
    checkpoint.resume naming that step finds no manifest there (a step exists only if its manifest
    exists), not the one the start read to delete its files nor those files in the start's listing."""
    mgr = manager(url, keep=10)
    assert mgr.load(states()) is None
    for step in (1, 2):
        save(mgr, step)
    mgr.close()
    step1 = RemotePath(url) / storage.CHECKPOINTS / "step_00000001"
    store_of(BUCKET).put((step1 / "pruning").key, b"")  # a prune cut short before it deleted anything
    again = manager(url, resume=step1.url)
    with pytest.raises(storage.CheckpointError, match=r"step_00000001/manifest.json: missing"):
        again.load(states())
    again.close()
    assert not [k for k in keys(url) if "/step_00000001/" in k]  # the prune was finished


@pytest.mark.unit
def test_pruning_never_takes_the_pointers_target_nor_a_step_the_pointer_has_not_passed(url, monkeypatch):
    a = manager(url, keep=2)
    a.load(states())
    save(a, 1)
    save(a, 2)
    # step 3's manifest is created, then the save dies before the pointer moves (a kill between the two)
    monkeypatch.setattr(RemoteStore, "advance", lambda self, *args: (_ for _ in ()).throw(RuntimeError("killed here")))
    with pytest.raises(storage.CheckpointError, match="killed here"):
        save(a, 3)
    monkeypatch.undo()
    remote = RemoteStore(RemotePath(url))
    remote.read_pointer()
    owned = {f for _, f in remote.list_steps()}
    assert remote.prune(1, owned) == [remote.root / "step_00000001"]  # 2 is the pointer's target: kept
    assert [s for s, _ in remote.list_steps()] == [3, 2]
    st = states()
    assert manager(url).load(st).step == 3  # a step exists once its manifest does and its files verify


@pytest.mark.unit
def test_a_listed_file_whose_bytes_are_not_the_manifests_is_never_trusted_the_previous_step_is_loaded(url, caplog):
    a = manager(url)
    a.load(states())
    save(a, 1, 10)
    save(a, 2, 20)
    remote = RemoteStore(RemotePath(url))
    body = remote.read_manifest(remote.root / "step_00000002")
    weights = remote.files(remote.root / "step_00000002", body) / storage.WEIGHTS_FILE
    data = bytearray(store_of(BUCKET).get(weights.key)[0])
    data[-1] ^= 1  # the same size, another byte: only a hash sees it
    store_of(BUCKET).put(weights.key, bytes(data))
    st = states()
    assert manager(url).load(st).step == 1 and st["counter"].value == 10
    assert "does not match the manifest" in caplog.text
    store_of(BUCKET).delete(weights.key)
    with pytest.raises(storage.CheckpointError, match="missing"):
        remote.listed(remote.root / "step_00000002")


@pytest.mark.unit
def test_what_a_killed_save_left_is_invisible_and_removed_at_the_next_start(url):
    a = manager(url)
    a.load(states())
    save(a, 1)
    run = RemotePath(url)
    store = store_of(BUCKET)
    orphan = f"{run.key}/checkpoints/step_00000002/deadbeef/state/__0_0.distcp"
    store.put(orphan, b"x" * 100)
    upload = store.begin(f"{run.key}/checkpoints/step_00000002/deadbeef/state/__0_1.distcp")
    store.part(f"{run.key}/checkpoints/step_00000002/deadbeef/state/__0_1.distcp", upload, 1, memoryview(b"y" * 100))
    assert [s for s, _ in RemoteStore(run).list_steps()] == [1]  # no manifest: no step
    assert manager(url).load(states()).step == 1
    assert orphan not in keys(url) and store.uploads(f"{run.key}/") == []


# ---------------------------------------------------------------------------------------- the lease
@pytest.mark.unit
def test_a_live_lease_is_waited_for_then_refused_naming_its_holder_and_taken_over_only_once_expired(url, caplog):
    store = store_of(BUCKET)
    key = f"{RemotePath(url).key}/.lock"
    first = Lease(store, key, ttl_s=2).acquire(0)
    t0 = time.monotonic()
    with pytest.raises(StoreRefused, match=f"held by pid {os.getpid()}"):
        Lease(store, key, ttl_s=2).acquire(3)  # renewed every 2/3 s: alive throughout
    assert time.monotonic() - t0 >= 3
    first._stop.set()  # its holder dies without releasing it
    first._thread.join()
    second = Lease(store, key, ttl_s=2).acquire(20)
    assert "took over the lease" in caplog.text and f"pid {os.getpid()}" in caplog.text
    second.release()
    assert store.head(key) is None


# ---------------------------------------------------------------------------------------- runs
def s3_env(server, staging: Path) -> dict:
    return {**server.env, "MINIMIND_STAGING_DIR": str(staging)}


@pytest.mark.e2e
def test_the_commands_read_a_run_folder_in_the_store_from_a_verified_copy(s3_server, url, tiny, tmp_path, monkeypatch, capsys):
    launch.run(0, *tiny, "train.steps=4", "checkpoint.interval=2", f"out_dir={url}", env=s3_env(s3_server, tmp_path / "node"))
    monkeypatch.setenv("MINIMIND_STAGING_DIR", str(tmp_path / "tools"))
    from cli import main

    def cli(*args):  # the command's main() in this process: the same code path, without importing torch again
        code = main(list(args))
        out = capsys.readouterr()
        assert code == 0, out.err
        return out.out

    assert json.loads(cli("inspect", url))["step"] == 4
    assert json.loads(cli("status", url))["state"] == "finished"
    assert json.loads(cli("inspect", f"{url}/checkpoints/step_00000002"))["step"] == 2
    cli("export", url, "--format", "hf", "--out", str(tmp_path / "hf"))
    assert (tmp_path / "hf" / "config.json").exists()
    assert cli("generate", url, "--prompt", "The", "--tokens", "4", "--temperature", "0").strip()
    # a byte changed in the store: a fresh copy refuses it as it comes down, the previous step is used instead
    copy = tmp_path / "tools" / ".fetched" / BUCKET / RemotePath(url).key / "checkpoints"
    assert sorted(p.name for p in copy.iterdir()) == ["step_00000004"]  # the copy holds the one checkpoint read last
    # a byte changed in the store: the copy is refused as it comes down, the previous step is used instead
    remote = RemoteStore(RemotePath(url))
    body = remote.read_manifest(remote.root / "step_00000004")
    state = remote.files(remote.root / "step_00000004", body) / "state/__0_0.distcp"
    data = bytearray(store_of(BUCKET).get(state.key)[0])
    data[-1] ^= 1
    store_of(BUCKET).put(state.key, bytes(data))
    assert json.loads(cli("inspect", url))["step"] == 4  # the copy already here is the verified bytes: reused
    monkeypatch.setenv("MINIMIND_STAGING_DIR", str(tmp_path / "another-machine"))
    assert json.loads(cli("inspect", url))["step"] == 2


@pytest.mark.e2e
def test_a_run_in_the_store_is_a_model_init_from_source_for_a_fresh_node_and_has_nothing_to_convert(
        s3_server, url, tiny, tmp_path, monkeypatch, capsys):
    """model.init_from=s3://... (a run folder or one of its checkpoints) reads a verified copy on a node that never
    saw the run: the same first weights, figures and bits as from the same checkpoint on a disk; the run's record
    names the step's URL. `convert` of a run folder in the store has nothing to convert (exit 0); a URL holding no
    run is bad input naming model.init_from."""
    from cli import main

    short = [*tiny, "train.steps=2"]
    monkeypatch.setenv("MINIMIND_STAGING_DIR", str(tmp_path / "node-a"))
    assert launch.in_process(*short, "checkpoint.interval=1", f"out_dir={url}")[0] == 0
    monkeypatch.setenv("MINIMIND_STAGING_DIR", str(tmp_path / "node-b"))  # another machine: nothing of the run on its disk
    code, err = launch.in_process(*short, f"model.init_from={url}/checkpoints/step_00000001", f"out_dir={tmp_path / 'from-store'}")
    assert code == 0, err
    assert f"# model.init_from: {url}/checkpoints/step_00000001 " in (tmp_path / "from-store" / "config.yaml").read_text()
    assert main(["export", f"{url}/checkpoints/step_00000001", "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    assert main(["inspect", f"{url}/checkpoints/step_00000001"]) == 0
    local = next((tmp_path / "node-b" / ".fetched").rglob("step_00000001"))  # the commands' verified copy, on a disk
    code, err = launch.in_process(*short, f"model.init_from={local}", f"out_dir={tmp_path / 'from-disk'}")
    assert code == 0, err
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "from-store"), str(tmp_path / "from-disk")]) == 0, capsys.readouterr()
    assert main(["convert", url]) == 0 and "nothing to convert" in capsys.readouterr().out
    code, err = launch.in_process(*short, f"model.init_from={url}-nothing-here", f"out_dir={tmp_path / 'bad'}")
    assert code == 2 and f"model.init_from: {url}-nothing-here: nothing there" in err and "Traceback" not in err, err
    store_of(BUCKET).put(f"{RemotePath(url).key}-other/readme.txt", b"not a run")  # a prefix holding another kind of object
    code, err = launch.in_process(*short, f"model.init_from={url}-other", f"out_dir={tmp_path / 'bad2'}")
    assert code == 2 and f"model.init_from: {url}-other: holds no checkpoint of ours" in err and "Traceback" not in err, err
    # one copy per step: reading the newest (step 2) leaves step 1's copy whole for whoever reads it
    from weights.sources import local

    newest, named = local(url, "model.init_from")
    assert named == f"{url}/checkpoints/step_00000002" and newest.name == "step_00000002"
    first, _ = local(f"{url}/checkpoints/step_00000001", "model.init_from")
    assert (first / storage.MANIFEST).is_file() and (newest / storage.MANIFEST).is_file() and first != newest
    assert main(["convert", f"{url}-nothing-here"]) == 2 and main(["convert", f"{url}/checkpoints/step_00000099"]) == 2


# ---------------------------------------------------------------------------------------- bad input
@pytest.mark.unit
@pytest.mark.parametrize("out_dir, says", [
    ("s3://", "no bucket"), ("s3:///prefix", "no bucket"), ("gs://bucket/run", "unknown scheme 'gs://'"),
])
def test_an_s3_url_without_a_bucket_or_an_unknown_scheme_is_bad_input_naming_it(out_dir, says, tiny, tmp_path):
    code, err = launch.in_process(*tiny, f"out_dir={out_dir}")
    assert code == 2 and says in err and out_dir in err and "Traceback" not in err


@pytest.mark.unit
def test_a_prefix_that_holds_another_kind_of_object_is_refused_naming_it(url, tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("MINIMIND_STAGING_DIR", str(tmp_path))
    store_of(BUCKET).put(f"{RemotePath(url).key}/photos/cat.jpg", b"meow")
    code, err = launch.in_process(*tiny, f"out_dir={url}")
    assert code == 2 and "photos" in err and "another kind of data" in err
    store_of(BUCKET).put(RemotePath(url).key + "-obj", b"a file")
    code, err = launch.in_process(*tiny, f"out_dir={url}-obj")
    assert code == 2 and "is an object, not a run folder" in err


@pytest.mark.e2e
def test_two_nodes_without_a_shared_filesystem_save_fsdp_shards_each_to_the_store_and_one_node_alone_resumes_bit_exactly(
        s3_server, url, tiny, corpus, tmp_path):
    """Two torchrun "nodes" (one process each, a c10d rendezvous on 127.0.0.1), each with its own
    folders standing for its disk (staging, data cache): under FSDP each rank uploads its own shards;
    then one node alone (world size 1) resumes the run to the end, equal to the uninterrupted run."""
    from test_preempt_e2e import free_port, start_node

    args = [*tiny, "dist.reduce=canonical", "train.steps=8", "checkpoint.interval=4"]
    launch.run(0, *args, f"out_dir={tmp_path / 'ref'}")
    port = free_port()
    nodes = [start_node(tmp_path, node, port, url, "train.py", *args, "dist.strategy=fsdp", "train.halt_at=4",
                        f"data.cache_dir={tmp_path / f'disk{node}' / 'cache'}",
                        env=s3_env(s3_server, tmp_path / f"disk{node}" / "staging")) for node in (0, 1)]
    assert [p.wait(timeout=300) for p in nodes] == [0, 0], "".join(p.read_text()[-2000:] for p in tmp_path.glob("node*.log"))
    remote = RemoteStore(RemotePath(url))
    body = remote.listed(remote.root / "step_00000004")
    assert {f"state/__{r}_{k}.distcp" for r in (0, 1) for k in (0, 1)} <= set(body["files"])  # each rank's shards, in one manifest
    assert not (tmp_path / "disk1" / "staging").exists() or not any((tmp_path / "disk1" / "staging").rglob("*.distcp"))
    alone = launch.run(0, *args, f"data.cache_dir={tmp_path / 'disk2' / 'cache'}", f"out_dir={url}",
                       env=s3_env(s3_server, tmp_path / "disk2" / "staging"))
    assert "loaded s3://" in alone.stderr
    got = subprocess.run([sys.executable, "-m", "checkpoint", "compare", url, str(tmp_path / "ref")], cwd=launch.ROOT,
                         capture_output=True, text=True, env={**os.environ, "MINIMIND_STAGING_DIR": str(tmp_path / "tools")})
    assert got.returncode == 0, got.stdout + got.stderr


@pytest.mark.unit
def test_checkpoint_resume_names_a_step_folder_in_the_store_or_on_a_disk_whatever_out_dir_is(url, tmp_path):
    a = manager(url)
    a.load(states())
    save(a, 1, 10)
    st = states()
    b = CheckpointManager(CheckpointConfig(resume=f"{url}/checkpoints/step_00000001"), tmp_path / "local", OneProcess(), meta())
    assert b.load(st).step == 1 and st["counter"].value == 10
    local = CheckpointManager(CheckpointConfig(), tmp_path / "disk", OneProcess(), meta())
    local.load(states())
    local.save(2, states(2, 20), background=False)
    st = states()
    c = CheckpointManager(CheckpointConfig(resume=str(tmp_path / "disk" / "checkpoints" / "step_00000002")), f"{url}-other", OneProcess(), meta())
    assert c.load(st).step == 2 and st["counter"].value == 20


@pytest.mark.unit
def test_with_a_checkpoint_key_a_manifest_in_the_store_edited_without_it_is_refused_naming_it_and_the_previous_step_loads(
        url, caplog, monkeypatch):
    monkeypatch.setenv(storage.KEY_VARIABLE, "a key for the store")
    a = manager(url)
    a.load(states())
    save(a, 1, 10)
    save(a, 2, 20)
    key = f"{RemotePath(url).key}/checkpoints/step_00000002/{storage.MANIFEST}"
    body = json.loads(store_of(BUCKET).get(key)[0])
    assert body[storage.MAC].startswith("hmac-sha256:")
    body["world_size"] = 2  # whoever can write the bucket, without the key
    store_of(BUCKET).delete(key)
    store_of(BUCKET).put(key, (json.dumps(body, indent=1, sort_keys=True) + "\n").encode())
    st = states()
    assert manager(url).load(st).step == 1 and st["counter"].value == 10
    assert f"{url}/checkpoints/step_00000002/{storage.MANIFEST}: has a MAC that is not its content's" in caplog.text
    monkeypatch.delenv(storage.KEY_VARIABLE)
    assert manager(url).load(states()).step == 2  # without a key nothing is checked
