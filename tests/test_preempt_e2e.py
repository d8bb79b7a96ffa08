"""Preemption and crashes with real signals: SIGTERM, SIGKILL (mid-step and mid-save), a signal to one
rank only, torchrun's elastic restarts, and a two-"node" launch. Every resumed run is compared with
the uninterrupted reference, bit for bit."""
import json
import random
import signal
import socket
import time

import pytest

import launch
from common.outcome import exit_code

EXIT_STOPPED = exit_code("stopped")
from checkpoint.storage import list_checkpoints, verify

pytestmark = pytest.mark.e2e


def test_sigterm_mid_run_saves_at_the_step_the_ranks_agreed_on_and_the_resume_is_bit_identical(tmp_path, epochs, reference):
    out = tmp_path / "run"
    # A slow disk (every step saved, each file 0.1 s longer) keeps the run going long after the signal.
    args = [*epochs, "checkpoint.interval=1", "checkpoint.keep=2", f"out_dir={out}"]
    proc = launch.start(launch.command(2, *args, script=launch.SLOW_SAVE), tmp_path / "log", env={"SLOW_SAVE_S": "0.1"})
    launch.wait_for(lambda: launch.lines(out / "metrics.jsonl") >= 2, proc=proc)
    launch.kill_tree(proc.pid, signal.SIGTERM)  # the spot reclaim: every process gets it
    proc.wait(timeout=120)
    log = (tmp_path / "log").read_text()
    stopped = launch.lines(out / "metrics.jsonl")
    assert 2 <= stopped < 20
    assert log.count(f"stopped on SIGTERM at step {stopped}: checkpoint published") == 2  # rank 0 and rank 1
    assert list_checkpoints(out / "checkpoints")[0][0] == stopped
    launch.assert_same_as_reference_at(out, reference(2), stopped)
    launch.run(2, *args)
    launch.assert_identical(out, reference(2))


def test_sigkill_at_a_random_step_resumes_from_the_last_interval_checkpoint_bit_identically(tmp_path, epochs, reference):
    out = tmp_path / "run"
    k = random.Random(2026).randint(4, 12)
    args = [*epochs, "checkpoint.interval=3", f"out_dir={out}"]
    # A slow disk (each checkpoint file 0.3 s longer) stretches the run: the kill lands long before its end.
    proc = launch.start(launch.command(2, *args, script=launch.SLOW_SAVE), tmp_path / "log", env={"SLOW_SAVE_S": "0.3"})
    launch.wait_for(lambda: launch.lines(out / "metrics.jsonl") >= k, proc=proc)
    launch.kill_tree(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    newest = list_checkpoints(out / "checkpoints")[0][0]
    assert newest % 3 == 0 and newest < 20
    resumed = launch.run(2, *args)
    assert f"step {newest} resumes at sample" in resumed.stderr
    launch.assert_identical(out, reference(2))


def test_a_kill_while_a_checkpoint_is_being_written_leaves_the_previous_one_intact(tmp_path, epochs, reference):
    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    proc = launch.start(launch.command(0, *epochs, "checkpoint.interval=4", f"out_dir={out}", script=launch.SLOW_SAVE),
                        tmp_path / "log", env={"SLOW_SAVE_S": "1"})  # a slow disk: each file takes a second more
    launch.wait_for(lambda: (ckpts / "step_00000004").exists() and any(ckpts.glob(".tmp-step_00000008-*")), proc=proc)
    launch.kill_tree(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert [s for s, _ in list_checkpoints(ckpts)] == [4]
    verify(ckpts / "step_00000004")
    resumed = launch.run(0, *epochs, "checkpoint.interval=4", f"out_dir={out}")
    assert "left by an interrupted save" in resumed.stderr
    assert not any(ckpts.glob(".tmp-*"))
    launch.assert_identical(out, reference(0))


def test_a_signal_to_one_rank_only_stops_every_rank_at_the_same_step(tmp_path, epochs):
    out = tmp_path / "run"
    proc = launch.start(launch.command(2, *epochs, "train.steps=400", f"out_dir={out}"), tmp_path / "log")
    launch.wait_for(lambda: launch.lines(out / "metrics.jsonl") >= 2, proc=proc)
    rank1 = launch.workers(proc.pid)[1]
    launch.os.kill(rank1, signal.SIGUSR1)
    proc.wait(timeout=120)  # the bound: a rank left waiting in a collective would hang here
    log = (tmp_path / "log").read_text()
    stopped = launch.lines(out / "metrics.jsonl")
    assert stopped < 400
    assert f"stopped on a signal to another rank at step {stopped}: checkpoint published" in log  # rank 0
    assert f"[rank 1] stopped on SIGUSR1 at step {stopped}: checkpoint published" in log
    assert log.count(f"exitcode  : {EXIT_STOPPED}") == 2  # torchrun's summary: both ranks left with "resume me"
    assert [s for s, _ in list_checkpoints(out / "checkpoints")] == [stopped]


def test_workers_whose_torchrun_agent_dies_stop_together_and_publish_their_checkpoint(tmp_path, epochs):
    """An agent SIGKILLed (OOM killer, a lost node daemon) leaves its workers running in sessions of
    their own: they must not train on unsupervised and race the next launch for out_dir."""
    out = tmp_path / "run"
    proc = launch.start(launch.command(2, *epochs, "train.steps=400", f"out_dir={out}"), tmp_path / "log")
    launch.wait_for(lambda: launch.lines(out / "metrics.jsonl") >= 2, proc=proc)
    ranks = launch.workers(proc.pid)
    launch.os.kill(proc.pid, signal.SIGKILL)  # the agent only
    proc.wait(timeout=30)
    launch.wait_for(lambda: not any(launch.alive(p) for p in ranks), timeout=120)
    stopped = launch.lines(out / "metrics.jsonl")
    assert stopped < 400
    log = (tmp_path / "log").read_text()
    assert log.count(f"stopped on the exit of the torchrun agent at step {stopped}: checkpoint published") == 2
    assert list_checkpoints(out / "checkpoints")[0][0] == stopped
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "stopped" and status["step"] == stopped and status["exit_code"] == EXIT_STOPPED


@pytest.mark.unit
def test_each_torchrun_restart_attempt_agrees_on_a_key_space_of_its_own_in_the_shared_store():
    """torch 2.13 shares one store across restart attempts; a restarted worker must not read the keys
    (peer addresses) the previous attempt's dead workers left there, and every rank of an attempt,
    on whichever node, must use the same fresh prefix."""
    import datetime
    import threading

    import torch.distributed as dist

    from runtime import agree_on_attempt, attempt_store

    timeout = datetime.timedelta(seconds=20)
    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timeout)
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(server.port)}

    def launch_ranks(world, late=(), when=lambda: True):
        """Every rank of one attempt in a thread of its own, each with its own store client; the
        ranks in `late` start once `when()` holds (a state of the store, not a sleep)."""
        names = [None] * world

        def rank(r):
            if r in late:
                launch.wait_for(when, timeout=20, every=0.01)
            client = dist.TCPStore("127.0.0.1", server.port, world, is_master=False, timeout=timeout)
            names[r] = agree_on_attempt(client, r, world, timeout)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        return names

    def asked(r, other_than):
        return server.check([f"attempt-ask/{r}"]) and server.get(f"attempt-ask/{r}").decode() != other_than

    first = launch_ranks(3)
    assert first[0] and first == [first[0]] * 3
    dead = "a nonce of a rank SIGKILLed before it got its answer"
    server.set("attempt-ask/2", dead)
    # rank 0 first: the others start once it has answered what the dead rank left
    again = launch_ranks(3, late=(1, 2), when=lambda: server.check([f"attempt-answer/{dead}"]))
    assert again[0] and again == [again[0]] * 3 and again[0] != first[0]
    # ranks 1 and 2 first: rank 0 starts once both have asked anew, next to the earlier answers
    before = {r: server.get(f"attempt-ask/{r}").decode() for r in (1, 2)}
    third = launch_ranks(3, late=(0,), when=lambda: asked(1, before[1]) and asked(2, before[2]))
    assert third[0] and third == [third[0]] * 3 and third[0] not in (first[0], again[0])

    # through attempt_store, as train.py uses it: one attempt's keys are invisible to the next
    attempt_store(env, 0, 1, timeout).set("default_pg/0//cpu/rank_1", "address of a worker since SIGKILLed")
    assert not attempt_store(env, 0, 1, timeout).check(["default_pg/0//cpu/rank_1"])
    # torchrun without a shared store (or plain python): the default env:// set-up is left alone
    assert attempt_store({**env, "TORCHELASTIC_USE_AGENT_STORE": "False"}, 0, 1, timeout) is None
    assert attempt_store({}, 0, 1, timeout) is None


@pytest.mark.elastic
def test_torchrun_restarts_sigkilled_workers_and_they_resume_by_themselves(tmp_path, epochs, reference):
    out = tmp_path / "run"
    # A slow disk (each checkpoint file 0.2 s longer): the kill lands long before the run's end.
    cmd = launch.command(2, *epochs, "checkpoint.interval=4", f"out_dir={out}", script=launch.SLOW_SAVE)
    # One restart and no spare: the first restart must connect (runtime.attempt_store; without it torch
    # 2.13's restarted workers could read the dead workers' addresses and hang or fail to connect).
    cmd.insert(cmd.index("--standalone"), "--max-restarts=1")
    proc = launch.start(cmd, tmp_path / "log", env={"SLOW_SAVE_S": "0.2"})
    launch.wait_for(lambda: (out / "checkpoints" / "step_00000008").exists(), proc=proc)
    launch.os.kill(launch.workers(proc.pid)[1], signal.SIGKILL)
    assert proc.wait(timeout=120) == 0
    log = (tmp_path / "log").read_text()
    assert log.count("loaded ") == 1 and "step_00000008: step 8" in log  # the restarted workers found it themselves
    launch.assert_identical(out, reference(2))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def start_node(tmp_path, node: int, port: int, out, *args: str, env: dict | None = None, tag: str = ""):
    """One torchrun "node" of a two-node job (one process each) with a c10d rendezvous on 127.0.0.1:port."""
    cmd = [launch.PY, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", f"--node-rank={node}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=two-nodes-{port}", *args]
    return launch.start([*cmd, f"out_dir={out}"], tmp_path / f"node{node}{tag}-{port}.log", env=env)


@pytest.mark.elastic
def test_two_torchrun_nodes_restart_a_killed_worker_and_resume_with_only_global_rank_0_writing(tmp_path, epochs, reference):
    """Two "nodes" with torchrun's shared store (the default): a worker SIGKILLed on node 1 makes
    node 1 restart for the failure and, as a rule, node 0 for the membership change without counting
    it (every such run here), so their restart counts differ; the restarted workers must still agree
    on one store prefix (runtime.attempt_store).
    Then a fresh two-node launch resumes the halted run to the end."""
    shared, node1_dir = tmp_path / "shared", tmp_path / "node1"

    def two_nodes(*extra):
        port = free_port()
        # node 1 is told another folder: it must write nothing there
        return [start_node(tmp_path, node, port, out, "--max-restarts=1", launch.SLOW_SAVE, *epochs, *extra,
                           env={"SLOW_SAVE_S": "0.2"})  # a slow disk: the kill lands long before the end
                for node, out in ((0, shared), (1, node1_dir))]

    procs = two_nodes("checkpoint.interval=4", "train.halt_at=14")
    launch.wait_for(lambda: (shared / "checkpoints" / "step_00000008").exists(), proc=procs[0])
    launch.os.kill(launch.workers(procs[1].pid)[0], signal.SIGKILL)
    assert [p.wait(timeout=180) for p in procs] == [0, 0]
    assert max(s for s, _ in list_checkpoints(shared / "checkpoints")) == 14
    assert "".join(p.read_text() for p in tmp_path.glob("node*.log")).count("loaded ") == 1  # the restart's
    assert [p.wait(timeout=180) for p in two_nodes()] == [0, 0]
    assert not node1_dir.exists() or not any(node1_dir.rglob("*"))
    launch.assert_identical(shared, reference(2))


@pytest.mark.elastic
def test_a_node_that_dies_is_replaced_and_the_job_resumes_by_itself(tmp_path, epochs, reference):
    """A spot node taken away with its agent: the surviving node's torchrun restarts its worker, a
    replacement node joins the rendezvous, and both resume from the newest checkpoint. torch 2.13 does
    not announce its shared worker store to a node that joins later, so elastic jobs that replace
    nodes run with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (docs/preemption.md, "A node that is replaced")."""
    shared, port, env = tmp_path / "shared", free_port(), {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    args = ["--max-restarts=1", launch.SLOW_SAVE, *epochs, "checkpoint.interval=4"]  # slow saves: the kill lands early
    env["SLOW_SAVE_S"] = "0.2"
    # One out_dir for every node, as on a cluster: whichever node holds global rank 0 after the
    # new rendezvous writes there.
    survivor = start_node(tmp_path, 0, port, shared, *args, env=env)
    # The first torchrun to bind the rendezvous endpoint hosts the rendezvous store, and the job
    # cannot outlive its host: let the survivor be it, as the node at --rdzv-endpoint is on a cluster.
    launch.wait_for(lambda: listening(port), proc=survivor)
    doomed = start_node(tmp_path, 1, port, shared, *args, env=env)
    launch.wait_for(lambda: (shared / "checkpoints" / "step_00000008").exists(), proc=survivor)
    launch.kill_tree(doomed.pid, signal.SIGKILL)  # the node goes away: its agent and its worker
    doomed.wait(timeout=30)
    replacement = start_node(tmp_path, 1, port, shared, *args, env=env, tag="b")
    assert [survivor.wait(timeout=180), replacement.wait(timeout=60)] == [0, 0]
    logs = "".join(p.read_text() for p in tmp_path.glob("node*.log"))
    assert logs.count("loaded ") == 1  # rank 0 of the new rendezvous found the checkpoint by itself
    launch.assert_identical(shared, reference(2))


@pytest.mark.elastic
def test_a_node_with_a_warm_cache_waits_for_a_node_still_packing_longer_than_the_collective_timeout(tmp_path, tiny):
    """Two nodes, data.shared_cache=false (the default): node 0's cache is warm (packed ahead), node 1's
    cold, as for a replaced node, and its pack (a slow file system: tests/slow_pack_train.py) outlasts
    dist.timeout_s. Node 0, which packs nothing, waits on the board's heartbeat, not in a collective
    with a timeout, and both nodes train."""
    import contextlib
    import io

    from data import prepare

    corpus = next(a.split("=", 1)[1] for a in tiny if a.startswith("data.path="))
    warm, cold = tmp_path / "cache0", tmp_path / "cache1"
    with contextlib.redirect_stdout(io.StringIO()):
        assert prepare.main([corpus, "--seq-len", "32", "--cache-dir", str(warm)]) == 0
    stamp = {p.name: p.stat().st_mtime_ns for p in warm.glob("*.bin")}
    port, out = free_port(), tmp_path / "run"
    procs = [start_node(tmp_path, node, port, out, "tests/slow_pack_train.py", *tiny, f"data.cache_dir={cache}", "train.steps=2",
                        "dist.timeout_s=4", "checkpoint.lock_timeout_s=1", env={"SLOW_PACK_S": "8"})
             for node, cache in ((0, warm), (1, cold))]
    assert [p.wait(timeout=180) for p in procs] == [0, 0], "".join(p.read_text() for p in tmp_path.glob("node*.log"))
    # node 1 packed (each batch its packer read took 8 s longer: longer than dist.timeout_s), node 0 did not
    assert list(cold.glob("*.bin"))  # the slowed packer ran: it sleeps 8 s per batch before the batch is packed
    assert {p.name: p.stat().st_mtime_ns for p in warm.glob("*.bin")} == stamp  # its rows were not packed again
    assert len(launch.metrics(out)) == 2
