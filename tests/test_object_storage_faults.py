"""Faults of a run folder in object storage (docs/object_storage.md, "Faults"), each against the real
S3 server the session starts (tests/seaweed.py): the server killed and restarted, throttling and 5xx
answers (through a proxy that injects them), a whole tree SIGKILLed in the middle of an upload, a
SIGTERM on a spot VM and its replacement, credentials and buckets the store refuses."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid

import pytest

import launch
from checkpoint.remote import RemoteStore
from common.store import RemotePath, store_of
from test_object_storage import BUCKET, keys, s3_env, url  # noqa: F401 - url is a fixture

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


@pytest.mark.e2e
def test_throttling_and_5xx_answers_are_retried_logged_and_change_nothing_and_past_the_retries_exit_1_naming_the_object(
        s3_server, url, tiny, tmp_path):
    import seaweed

    args = [*tiny, "train.steps=6", "checkpoint.interval=2"]
    launch.run(0, *args, f"out_dir={tmp_path / 'ref'}")
    every_fifth = seaweed.FaultProxy(s3_server, lambda method, path, n: (503 if n % 10 == 0 else 500) if n % 5 == 0 else None)
    try:
        # the lease's own ttl (30 s), not the tests' 4 s: with one request in five refused and retried, a renewal
        # waits behind the rows' chunk fetches and its own retries for more than 4 s on a loaded machine (seen in CI)
        env = {**s3_env(s3_server, tmp_path / "node"), "AWS_ENDPOINT_URL": every_fifth.endpoint, "MINIMIND_S3_ATTEMPTS": "3",
               "MINIMIND_LEASE_TTL_S": "30"}
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


@pytest.mark.unit
def test_bytes_damaged_on_their_way_are_refused_by_the_store_sent_again_and_the_step_verifies(s3_server, url, monkeypatch, caplog):
    """Every body we upload carries its SHA-256 (a part of a multipart upload, a whole object): the store
    refuses one damaged on its way (BadDigest), the request is sent again from our intact bytes (logged), and
    the step published is the one saved. The signature does not hash the bodies (common/store.py): this
    checksum is what binds the bytes to the request."""
    import seaweed
    import torch

    import common.store
    from checkpoint import CheckpointConfig, CheckpointManager, ModelState
    from test_checkpoint_manager import Counter, OneProcess, Train, meta

    damaged = []

    def damage(method, path, body):  # one byte of the first part and of the fp16 weights' object (one PUT), once each
        what = "part" if "partNumber=" in path else "weights" if "weights_fp16" in path else None
        if method != "PUT" or what is None or what in damaged:
            return body
        damaged.append(what)
        return body[:1000] + bytes([body[1000] ^ 1]) + body[1001:]

    proxy = seaweed.FaultProxy(s3_server, lambda method, path, n: None, damage=damage)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        monkeypatch.setattr(common.store, "_stores", {})  # this process's clients made again, through the proxy
        torch.manual_seed(0)
        model = torch.nn.Linear(1600, 1600)  # 10 MB of fp32 state: its state file is a multipart upload of two parts
        mgr = CheckpointManager(CheckpointConfig(keep=2), url, OneProcess(), meta())
        assert mgr.load({}) is None
        mgr.save(1, {"model": ModelState(model), "counter": Counter(7), "train": Train(1)}, background=False)
        mgr.close()
    finally:
        proxy.close()
    assert sorted(damaged) == ["part", "weights"]
    retried = [r.getMessage() for r in caplog.records if "BadDigest" in r.getMessage()]
    assert len(retried) == 2 and all("retry 1 of" in m for m in retried), retried
    fresh = torch.nn.Linear(1600, 1600)
    loaded = {"model": ModelState(fresh), "counter": Counter(), "train": Train()}
    assert CheckpointManager(CheckpointConfig(), url, OneProcess(), meta()).load(loaded).step == 1
    assert torch.equal(fresh.weight, model.weight) and loaded["counter"].value == 7


@pytest.mark.unit
def test_every_body_sent_to_the_store_is_bound_to_its_request_by_the_sha256_of_its_bytes(s3_server, url, monkeypatch, tmp_path):
    """The signature hashes no upload's body (payload signing off, common/store.py), so each request with a
    body carries the SHA-256 of its bytes in a signed header: x-amz-checksum-sha256 (an object, a part: the
    store checks it), or the signed payload hash itself (x-amz-content-sha256: CompleteMultipartUpload's list
    of parts, which has no checksum of its own). Checked on the bytes as they came through a proxy, for every
    request of the paths a run sends: the lease, a save's parts and small objects, the multipart completions,
    the manifest, the pointer created then swapped, a cache file's upload (one put, one multipart)."""
    import base64
    import hashlib

    import seaweed
    import torch

    import common.store
    from checkpoint import CheckpointConfig, CheckpointManager, ModelState
    from test_checkpoint_manager import Counter, OneProcess, Train, meta

    proxy = seaweed.FaultProxy(s3_server, lambda method, path, n: None)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        monkeypatch.setattr(common.store, "_stores", {})  # this process's clients made again, through the proxy
        run = RemotePath(url)
        lease = common.store.Lease(run.store, (run / "lease.json").key).acquire(10)
        torch.manual_seed(0)
        model = torch.nn.Linear(1600, 1600)  # 10 MB of fp32 state: a multipart upload of two parts
        mgr = CheckpointManager(CheckpointConfig(keep=2), url, OneProcess(), meta())
        assert mgr.load({}) is None
        for step in (1, 2, 3):  # the pointer created, then moved by compare-and-swap
            mgr.save(step, {"model": ModelState(model), "counter": Counter(step), "train": Train(step)}, background=False)
        mgr.close()
        lease.release()
        for name, size in (("small.bin", 1000), ("big.bin", 9 << 20)):  # a packed cache's file (data/prepare.py)
            data = os.urandom(size)
            (tmp_path / name).write_bytes(data)
            run.store.upload((run / name).key, tmp_path / name, hashlib.sha256(data).hexdigest())
    finally:
        proxy.close()
    kinds, unbound = set(), []
    for method, path, headers, sha in proxy.bodies:
        signed = headers.get("authorization", "").split("SignedHeaders=")[1].split(",")[0].split(";")
        by_checksum = headers.get("x-amz-checksum-sha256") == base64.b64encode(bytes.fromhex(sha)).decode() \
            and "x-amz-checksum-sha256" in signed
        by_signature = headers.get("x-amz-content-sha256") == sha and "x-amz-content-sha256" in signed
        if not (by_checksum or by_signature):
            unbound.append((method, path, headers.get("x-amz-content-sha256"), headers.get("x-amz-checksum-sha256")))
        kinds.add("part" if "partNumber=" in path else "complete" if "uploadId=" in path else
                  path.split("?")[0].rsplit("/", 1)[1] if method == "PUT" else method)
    assert not unbound, unbound
    assert {"part", "complete", "lease.json", "manifest.json", "latest.json", "small.bin"} <= kinds, kinds


@pytest.mark.unit
def test_a_file_changed_on_disk_since_it_was_hashed_is_never_uploaded_as_its_record(s3_server, url, tmp_path):
    """Store.upload (a packed cache's files, data/prepare.py) sends a local file under the sha256 recorded
    for it: bytes that no longer hash to it (one byte changed since) are refused before the object is made,
    one PUT or a multipart upload alike (whose parts carry only their own checksums), naming the file; no
    object and no unfinished upload is left. The unchanged file goes up and comes back the same."""
    import hashlib

    from common.store import StoreError

    run = RemotePath(url)
    for name, size in (("small.bin", 1000), ("big.bin", 9 << 20)):  # one PUT; two parts
        data = bytearray(os.urandom(size))
        path = tmp_path / name
        path.write_bytes(data)
        recorded = hashlib.sha256(data).hexdigest()
        data[size // 2] ^= 1
        path.write_bytes(data)  # changed after it was hashed
        with pytest.raises(StoreError, match=f"{name}: its bytes hash to .* not the {recorded[:16]}"):
            run.store.upload((run / name).key, path, recorded)
        assert run.store.head((run / name).key) is None and run.store.uploads(f"{run.key}/") == []
        data[size // 2] ^= 1
        path.write_bytes(data)
        run.store.upload((run / name).key, path, recorded)
        assert run.store.get((run / name).key)[0] == bytes(data)


BIG = ["model.dim=256", "model.n_layers=4", "model.n_heads=8", "model.n_kv_heads=4"]
"""A model whose state files are several multipart parts each (tens of MB): an upload is under way long enough to be killed in."""


@pytest.mark.e2e
def test_sigkill_of_the_whole_tree_in_the_middle_of_an_upload_publishes_nothing_half_and_the_rerun_is_exact(s3_server, url, tiny, tmp_path):
    args = [*tiny, *BIG, "train.steps=6", "checkpoint.interval=1"]
    launch.run(0, *args, f"out_dir={tmp_path / 'ref'}")
    env = s3_env(s3_server, tmp_path / "node")
    store, run = store_of(BUCKET), RemotePath(url)
    proc = launch.start(launch.command(0, *args, f"out_dir={url}"), tmp_path / "a.log", env=env)
    launch.wait_for(lambda: any("/step_00000002/" in k for k, _ in store.uploads(f"{run.key}/")), proc=proc, every=0.01)
    launch.kill_tree(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert store.uploads(f"{run.key}/")  # the cut upload is there, invisible: no listing shows it as an object
    for _, folder in RemoteStore(run).list_steps():  # whatever is published verifies (step 1, maybe 2)
        RemoteStore(run).verify(folder)
    launch.run(0, *args, f"out_dir={url}", env=env)
    assert store.uploads(f"{run.key}/") == []  # aborted at the start
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


