"""A run folder in object storage (docs/object_storage.md), every test against a real S3 server the
session starts (SeaweedFS on 127.0.0.1: tests/seaweed.py, the `s3_server` fixture): the store's own
guarantees first, then the publish protocol, the lease, runs halted and resumed through the store,
the commands that read it, the faults and the bad input."""
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
def test_a_run_halted_in_the_store_resumed_on_another_node_on_two_processes_equals_the_uninterrupted_local_run(
        s3_server, url, tiny, tmp_path):
    args = [*tiny, "dist.reduce=canonical", "train.steps=8", "checkpoint.interval=2"]
    launch.run(0, *args, f"out_dir={tmp_path / 'ref'}")
    launch.run(0, *args, "train.halt_at=4", f"out_dir={url}", env=s3_env(s3_server, tmp_path / "node-a"))
    assert not (tmp_path / "node-b").exists()
    proc = launch.run(2, *args, "dist.strategy=fsdp", f"out_dir={url}", env=s3_env(s3_server, tmp_path / "node-b"))
    assert "loaded s3://" in proc.stderr
    got = subprocess.run([sys.executable, "-m", "checkpoint", "compare", url, str(tmp_path / "ref")], cwd=launch.ROOT,
                         capture_output=True, text=True, env={**os.environ, "MINIMIND_STAGING_DIR": str(tmp_path / "node-c")})
    assert got.returncode == 0, got.stdout + got.stderr


@pytest.mark.e2e
def test_the_commands_read_a_run_folder_in_the_store_from_a_verified_copy(s3_server, url, tiny, tmp_path):
    launch.run(0, *tiny, "train.steps=4", "checkpoint.interval=2", f"out_dir={url}", env=s3_env(s3_server, tmp_path / "node"))
    env = {**os.environ, "MINIMIND_STAGING_DIR": str(tmp_path / "tools")}

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "checkpoint", *args], cwd=launch.ROOT, capture_output=True, text=True, env=env)

    inspected = cli("inspect", url)
    assert inspected.returncode == 0, inspected.stderr
    assert json.loads(inspected.stdout)["step"] == 4
    status = cli("status", url)
    assert status.returncode == 0 and json.loads(status.stdout)["state"] == "finished", status.stdout + status.stderr
    step2 = cli("inspect", f"{url}/checkpoints/step_00000002")
    assert step2.returncode == 0 and json.loads(step2.stdout)["step"] == 2, step2.stderr
    exported = cli("export", url, "--format", "hf", "--out", str(tmp_path / "hf"))
    assert exported.returncode == 0 and (tmp_path / "hf" / "config.json").exists(), exported.stderr
    generated = cli("generate", url, "--prompt", "The", "--tokens", "4", "--temperature", "0")
    assert generated.returncode == 0, generated.stderr


# ---------------------------------------------------------------------------------------- faults
@pytest.mark.e2e
def test_the_server_killed_during_a_save_exits_1_naming_endpoint_and_object_and_after_its_restart_the_resume_is_exact(
        s3_server, url, tiny, tmp_path):
    args = [*tiny, "train.steps=60", "checkpoint.interval=4"]
    launch.run(0, *args, f"out_dir={tmp_path / 'ref'}")
    env = s3_env(s3_server, tmp_path / "node")
    proc = launch.start(launch.command(0, *args, "checkpoint.interval=4", f"out_dir={url}"), tmp_path / "a.log",
                        env={**env, "MINIMIND_S3_ATTEMPTS": "3"})
    launch.wait_for(lambda: any("/step_00000004/manifest.json" in k for k in keys(url)), proc=proc, timeout=120)
    s3_server.stop(kill=True)
    try:
        assert proc.wait(timeout=120) == 1
        log = (tmp_path / "a.log").read_text()
        assert s3_server.endpoint in log and "s3://runs/" in log and "failed after 3 attempts" in log, log[-3000:]
    finally:
        s3_server.start()
    launch.run(0, *args, f"out_dir={url}", env=env)
    got = subprocess.run([sys.executable, "-m", "checkpoint", "compare", url, str(tmp_path / "ref")], cwd=launch.ROOT,
                         capture_output=True, text=True, env={**os.environ, "MINIMIND_STAGING_DIR": str(tmp_path / "tools")})
    assert got.returncode == 0, got.stdout + got.stderr


@pytest.mark.e2e
def test_wrong_credentials_or_a_missing_bucket_exit_2_naming_the_endpoint_and_the_variable_before_any_training(
        s3_server, url, tiny, tmp_path):
    secret = "not-the-secret-" + uuid.uuid4().hex
    env = {**s3_env(s3_server, tmp_path / "node"), "AWS_SECRET_ACCESS_KEY": secret}
    proc = launch.run(0, *tiny, f"out_dir={url}", expect=2, env=env)
    assert s3_server.endpoint in proc.stderr and "AWS_SECRET_ACCESS_KEY" in proc.stderr and secret not in proc.stderr + proc.stdout
    assert "packed" not in proc.stderr and keys(url) == {}
    proc = launch.run(0, *tiny, "out_dir=s3://no-such-bucket/run", expect=2, env=s3_env(s3_server, tmp_path / "node"))
    assert "bucket 'no-such-bucket' does not exist" in proc.stderr and s3_server.endpoint in proc.stderr


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
def test_throttling_and_5xx_answers_are_retried_logged_and_change_nothing_and_past_the_retries_exit_1_naming_the_object(
        s3_server, url, tiny, tmp_path):
    import seaweed

    args = [*tiny, "train.steps=6", "checkpoint.interval=2"]
    launch.run(0, *args, f"out_dir={tmp_path / 'ref'}")
    every_fifth = seaweed.FaultProxy(s3_server, lambda method, path, n: (503 if n % 10 == 0 else 500) if n % 5 == 0 else None)
    try:
        env = {**s3_env(s3_server, tmp_path / "node"), "AWS_ENDPOINT_URL": every_fifth.endpoint, "MINIMIND_S3_ATTEMPTS": "3"}
        proc = launch.run(0, *args, f"out_dir={url}", env=env)
        assert {s for _, _, s in every_fifth.injected} == {500, 503}
        assert "SlowDown injected by the test; retry 1 of 2" in proc.stderr and "InternalError" in proc.stderr
    finally:
        every_fifth.close()
    got = subprocess.run([sys.executable, "-m", "checkpoint", "compare", url, str(tmp_path / "ref")], cwd=launch.ROOT,
                         capture_output=True, text=True, env={**os.environ, "MINIMIND_STAGING_DIR": str(tmp_path / "tools")})
    assert got.returncode == 0, got.stdout + got.stderr
    manifests = seaweed.FaultProxy(s3_server, lambda method, path, n: 503 if method == "PUT" and path.endswith("/manifest.json") else None)
    try:
        env = {**s3_env(s3_server, tmp_path / "node"), "AWS_ENDPOINT_URL": manifests.endpoint, "MINIMIND_S3_ATTEMPTS": "3"}
        proc = launch.run(0, *args, "train.steps=8", f"out_dir={url}", expect=1, env=env)
        assert f"{manifests.endpoint}: PUT {url}/checkpoints/step_00000008/manifest.json failed after 3 attempts" in proc.stderr
    finally:
        manifests.close()
    assert [s for s, _ in RemoteStore(RemotePath(url)).list_steps()][0] == 6  # the previous step stands


BIG = ["model.dim=256", "model.n_layers=4", "model.n_heads=8", "model.n_kv_heads=4"]
"""A model whose state files are several multipart parts each (tens of MB): an upload is under way long enough to be killed in."""


@pytest.mark.e2e
def test_sigkill_in_the_middle_of_an_upload_publishes_nothing_half_a_sigterm_exits_75_after_the_publish_and_the_rerun_is_exact(
        s3_server, url, tiny, tmp_path):
    args = [*tiny, *BIG, "train.steps=8", "checkpoint.interval=1"]
    launch.run(0, *args, f"out_dir={tmp_path / 'ref'}")
    env = s3_env(s3_server, tmp_path / "node")
    store, run = store_of(BUCKET), RemotePath(url)
    proc = launch.start(launch.command(0, *args, f"out_dir={url}"), tmp_path / "a.log", env=env)
    launch.wait_for(lambda: any("/step_00000002/" in k for k, _ in store.uploads(f"{run.key}/")), proc=proc, every=0.01)
    launch.kill_tree(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    steps = [s for s, _ in RemoteStore(run).list_steps()]
    assert steps in ([], [1], [2], [2, 1]) and store.uploads(f"{run.key}/")  # whatever is listed verifies; the cut upload is invisible
    for _, folder in RemoteStore(run).list_steps():
        RemoteStore(run).verify(folder)
    proc = launch.start(launch.command(0, *args, "checkpoint.interval=0", f"out_dir={url}"), tmp_path / "b.log", env=env)
    staged = tmp_path / "node" / BUCKET / run.key / "metrics.jsonl"
    launch.wait_for(lambda: launch.lines(staged) >= 5, proc=proc)
    launch.kill_tree(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=120) == 75, (tmp_path / "b.log").read_text()[-3000:]
    stopped = json.loads(store.get(f"{run.key}/status.json")[0])
    assert stopped["state"] == "stopped" and [s for s, _ in RemoteStore(run).list_steps()][0] == stopped["step"]
    assert store.uploads(f"{run.key}/") == []  # the killed launch's upload was aborted at the next start
    launch.run(0, *args, f"out_dir={url}", env=env)
    got = subprocess.run([sys.executable, "-m", "checkpoint", "compare", url, str(tmp_path / "ref")], cwd=launch.ROOT,
                         capture_output=True, text=True, env={**os.environ, "MINIMIND_STAGING_DIR": str(tmp_path / "tools")})
    assert got.returncode == 0, got.stdout + got.stderr


@pytest.mark.e2e
def test_the_spot_recipe_a_stopped_vms_replacement_runs_the_same_command_and_the_commands_read_the_store(s3_server, url, tiny, tmp_path):
    """docs/object_storage.md's commands, as written, but with the test's tiny run and its store."""
    args = [*tiny, "train.steps=40"]
    launch.run(0, *args, f"out_dir={tmp_path / 'ref'}")
    vm = launch.start(["bash", "scripts/train.sh", "--nproc", "1", *args, f"out_dir={url}"], tmp_path / "vm1.log",
                      env=s3_env(s3_server, tmp_path / "vm1"))
    staged = tmp_path / "vm1" / BUCKET / RemotePath(url).key / "metrics.jsonl"
    launch.wait_for(lambda: launch.lines(staged) >= 3, proc=vm)
    vm.send_signal(signal.SIGTERM)  # the preemption notice
    assert vm.wait(timeout=120) == 75, (tmp_path / "vm1.log").read_text()[-3000:]
    assert "stopped" in (tmp_path / "vm1.log").read_text().splitlines()[-1]
    replacement = subprocess.run(["bash", "scripts/train.sh", "--nproc", "1", *args, f"out_dir={url}"], cwd=launch.ROOT,
                                 capture_output=True, text=True, env={**os.environ, **s3_env(s3_server, tmp_path / "vm2")}, timeout=300)
    assert replacement.returncode == 0, replacement.stderr[-3000:]
    assert "loaded s3://" in replacement.stderr and "finished at step 40" in replacement.stderr.splitlines()[-1]
    env = {**os.environ, "MINIMIND_STAGING_DIR": str(tmp_path / "laptop")}
    status = subprocess.run([sys.executable, "-m", "checkpoint", "status", url], cwd=launch.ROOT, capture_output=True, text=True, env=env)
    assert status.returncode == 0 and json.loads(status.stdout)["published_step"] == 40, status.stderr
    got = subprocess.run([sys.executable, "-m", "checkpoint", "compare", url, str(tmp_path / "ref")], cwd=launch.ROOT,
                         capture_output=True, text=True, env=env)
    assert got.returncode == 0, got.stdout + got.stderr
