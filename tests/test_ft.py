"""Live recovery (docs/fault_tolerance.md): replica groups on torchft's Lighthouse, each a launch of
train.py, sharing one run folder. Whatever the membership does (a group lost for good, lost and
healed from a peer, a new one joining), the run ends bit-identical to the uninterrupted one-process
run: the sha256 of the final weights and every logged figure. The faults are injected by
tests/ft_train.py at a chosen step; the Lighthouse is started by the tests themselves (the fixture).
Without torchft these tests skip, except under CI=true, where they fail."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import launch

ROOT = Path(__file__).resolve().parents[1]
CI = os.environ.get("CI") == "true"
TIMING = ("tokens_per_s", "step_s", "elapsed_s")
pytestmark = pytest.mark.e2e


def torchft_here() -> bool:
    try:
        import torchft  # noqa: F401
    except ImportError:
        if CI:
            pytest.fail("torchft is not installed (requirements.txt: torchft==0.2.0): the live-recovery tests need it")
        return False
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lighthouse:
    """`python -m runtime.lighthouse` on a free port, as a user starts it; stop() and start() again on the same port."""

    def __init__(self, log: Path) -> None:
        self.port, self.log, self.proc = free_port(), log, None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "Lighthouse":
        self.proc = launch.start([sys.executable, "-m", "runtime.lighthouse", "--port", str(self.port), "--heartbeat-timeout-ms", "1000",
                                  "--join-timeout-ms", "3000"],
                                 self.log)
        launch.wait_for(lambda: "listening" in self.log.read_text(), timeout=60, proc=self.proc)
        return self

    def stop(self, sig: int = signal.SIGKILL) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)


@pytest.fixture
def lighthouse(tmp_path):
    if not torchft_here():
        pytest.skip("torchft is not installed (pip install torchft==0.2.0)")
    house = Lighthouse(tmp_path / "lighthouse.log").start()
    yield house
    house.stop()


@pytest.fixture(scope="module")
def ft_args(tiny):
    """The tiny run under dist.reduce=canonical, two epochs, a checkpoint every 4 steps."""
    return [*tiny, "dist.reduce=canonical", "data.num_samples=70", "log.sample_ids=true", "train.steps=16", "checkpoint.interval=4"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, ft_args) -> Path:
    """The uninterrupted one-process run without live recovery: what every case must equal."""
    out = tmp_path_factory.mktemp("ft-reference") / "run"
    launch.run(0, *ft_args, f"out_dir={out}")
    return out


def group(house: Lighthouse, out: Path, g: int, args: list[str], groups: int = 3, nproc: int = 0, env: dict | None = None,
          tag: str = "") -> subprocess.Popen:
    """Launch group g of the run in `out` (train.py through tests/ft_train.py), output to out.g<g><tag>.log."""
    cmd = launch.command(nproc, "ft.timeout_s=10", "ft.quorum_timeout_s=60", *args, f"out_dir={out}", f"ft.lighthouse={house.address}",
                         f"ft.group={g}", f"ft.groups={groups}", script="tests/ft_train.py")
    return launch.start(cmd, out.parent / f"{out.name}.g{g}{tag}.log", env={"FT_STEP_S": "0.15", **(env or {})})


def log_of(out: Path, g: int, tag: str = "") -> str:
    return (out.parent / f"{out.name}.g{g}{tag}.log").read_text()


def finish(procs: dict, timeout: float = 240) -> dict:
    """Wait for every launch; their exit codes by name."""
    end, codes = time.monotonic() + timeout, {}
    for name, proc in procs.items():
        try:
            codes[name] = proc.wait(timeout=max(1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            launch.kill_tree(proc.pid, signal.SIGKILL)
            codes[name] = "timeout"
    return codes


def assert_equals_one_process(out: Path, ref: Path) -> None:
    """Every logged figure (timing aside) and the final weights' sha256 equal the one-process run's."""
    got, want = launch.metrics(out), launch.metrics(ref)
    strip = lambda rows: [{k: v for k, v in m.items() if k not in TIMING} for m in rows]  # noqa: E731
    assert [m["step"] for m in got] == [m["step"] for m in want]
    assert strip(got) == strip(want)
    assert launch.inspect(out)["model_sha256"] == launch.inspect(ref)["model_sha256"]
    assert launch.inspect(out)["step"] == launch.inspect(ref)["step"]


def in_the_run(out: Path, g: int, tag: str = "", timeout: float = 180) -> None:
    """Until group g's Manager is up (tests/ft_train.py says so): from then on every quorum waits for it."""
    launch.wait_for(lambda: "ft_train: in the run" in log_of(out, g, tag), timeout=timeout, every=0.05)


def together(house: Lighthouse, out: Path, args: list[str], envs: dict, **kw) -> dict:
    """Launch the groups `envs` names (group -> its env or None), each held before its first quorum until every
    one is in the run: under load a group's start-up can lag by seconds, and a group that joins late heals into
    a later step instead of taking part from the first (the scene a test sets would not happen: seen in CI)."""
    start = out.parent / f"{out.name}{kw.get('tag', '')}.start"
    procs = {}
    for g, env in envs.items():
        env = dict(env or {})
        env["FT_GATE"] = ",".join(x for x in (f"0:{start}", env.get("FT_GATE", "")) if x)
        procs[g] = group(house, out, g, args, env=env, **kw)
    for g in envs:
        in_the_run(out, g, kw.get("tag", ""))
    start.touch()
    return procs


def wait_step(out: Path, step: int, procs=(), timeout: float = 180) -> None:
    """Until metrics.jsonl (the writer group's) holds `step`."""
    def reached() -> bool:
        path = out / "metrics.jsonl"
        return path.exists() and any(f'"step": {step},' in line for line in path.read_text().splitlines())

    launch.wait_for(reached, timeout=timeout, every=0.05)


# ---------------------------------------------------------------- the keys
@pytest.mark.unit
@pytest.mark.parametrize("args, says", [
    (["ft.lighthouse=nohost"], "ft.lighthouse: expected host:port"),
    (["ft.lighthouse=127.0.0.1:29510", "dist.reduce=canonical", "ft.group=3", "ft.groups=3"], "ft.group: expected 0 .. ft.groups - 1 = 2"),
    (["ft.lighthouse=127.0.0.1:29510", "dist.reduce=canonical", "ft.groups=2", "ft.min_groups=3"], "ft.min_groups: expected 1 .. ft.groups = 2"),
    (["ft.lighthouse=127.0.0.1:29510"], "ft.lighthouse with dist.reduce=ddp"),
    (["ft.lighthouse=127.0.0.1:29510", "dist.reduce=canonical", "dist.strategy=fsdp"], "ft.lighthouse with dist.strategy=fsdp"),
    (["ft.lighthouse=127.0.0.1:29510", "dist.reduce=canonical", "checkpoint.async=true"], "ft.lighthouse with checkpoint.async"),
])
def test_the_ft_keys_are_checked_and_what_live_recovery_cannot_keep_exact_is_refused_by_name(args, says):
    from configs import ConfigError, load_config

    with pytest.raises(ConfigError, match=says.replace(".", r"\.").replace("(", r"\(")):
        load_config(ROOT / "configs" / "tiny.yaml", args)


@pytest.mark.unit
def test_each_objective_is_exact_under_live_recovery_or_refused_by_name():
    from configs import ConfigError, load_config

    base = ["ft.lighthouse=127.0.0.1:29510", "dist.reduce=canonical"]
    load_config(ROOT / "configs" / "tiny.yaml", base)  # pretraining
    load_config(ROOT / "configs" / "sft_tiny.yaml", base)  # SFT
    for recipe in ("dpo_tiny.yaml", "grpo_tiny.yaml", "ppo_tiny.yaml", "distill_tiny.yaml"):
        with pytest.raises(ConfigError, match=r"train.objective=\w+ with ft.lighthouse: not supported \(ft.lighthouse \(live recovery"):
            load_config(ROOT / "configs" / recipe, base)


@pytest.mark.unit
def test_micro_batch_i_of_step_s_goes_to_a_participant_by_a_pure_function_of_s_i_and_the_participants():
    from runtime.ft import assign, shares

    for participants in [(0,), (0, 2), (1, 2), (0, 1, 2)]:
        for s in range(5):
            dealt = shares(s, 8, participants)
            assert sorted(i for v in dealt.values() for i in v) == list(range(8))  # each once
            assert all(assign(s, i, participants) == g for g, v in dealt.items() for i in v)
            assert max(map(len, dealt.values())) - min(map(len, dealt.values())) <= 1  # balanced
    assert shares(3, 4, (0, 1, 2)) == shares(3, 4, (0, 1, 2))


def test_the_lighthouse_module_listens_where_it_is_told_and_stops_on_sigterm(tmp_path):
    if not torchft_here():
        pytest.skip("torchft is not installed")
    house = Lighthouse(tmp_path / "lh.log").start()
    with socket.create_connection(("127.0.0.1", house.port), timeout=10):
        pass
    house.stop(signal.SIGTERM)
    assert house.proc.returncode == 0


# ---------------------------------------------------------------- membership changes, each exact
def test_shrink_the_writer_group_sigkilled_for_good_the_two_others_end_bit_identical_to_one_process(tmp_path, lighthouse, ft_args,
                                                                                                  one_process):
    """Group 0 (the writer) dies mid-step (after computing its share, before the gather) and never
    comes back: the step is not committed anywhere, done again by groups 1 and 2, and group 1 takes
    over the log and the checkpoints."""
    out = tmp_path / "run"
    procs = together(lighthouse, out, ft_args, {g: {"FT_KILL": "gather:6"} if g == 0 else None for g in range(3)})
    codes = finish(procs)
    assert codes == {0: -signal.SIGKILL, 1: 0, 2: 0}, {g: log_of(out, g)[-3000:] for g in range(3)}
    assert "(left: [0])" in log_of(out, 1)
    assert_equals_one_process(out, one_process)


def test_heal_a_group_sigkilled_and_relaunched_heals_from_a_live_peer_and_ends_bit_identical(tmp_path, lighthouse, ft_args, one_process):
    out = tmp_path / "run"
    args = [*ft_args, "checkpoint.interval=0"]  # no checkpoint to start from: the relaunched group can only heal
    gate = {"FT_GATE": f"8:{tmp_path / 'gate'}"}  # the two others wait at step 8 until group 1 is back in the run
    procs = together(lighthouse, out, args, {g: {"FT_KILL": "quorum:4"} if g == 1 else gate for g in range(3)})
    assert procs[1].wait(timeout=180) == -signal.SIGKILL
    procs["1b"] = group(lighthouse, out, 1, args, tag="b")
    in_the_run(out, 1, "b")
    (tmp_path / "gate").touch()
    codes = finish(procs)
    assert codes == {0: 0, 1: -signal.SIGKILL, 2: 0, "1b": 0}, log_of(out, 1, "b")[-3000:]
    healed = log_of(out, 1, "b")
    assert "ft: group 1 healed from group" in healed and "verified" in healed
    assert_equals_one_process(out, one_process)


def test_grow_a_group_launched_mid_run_joins_and_the_run_ends_bit_identical(tmp_path, lighthouse, ft_args, one_process):
    out = tmp_path / "run"
    args = [*ft_args, "checkpoint.interval=0"]  # no checkpoint to start from: the new group can only heal
    procs = together(lighthouse, out, args, {g: {"FT_GATE": f"6:{tmp_path / 'gate'}"} for g in range(2)})
    wait_step(out, 3)
    procs[2] = group(lighthouse, out, 2, args)
    in_the_run(out, 2)
    (tmp_path / "gate").touch()
    codes = finish(procs)
    assert codes == {0: 0, 1: 0, 2: 0}, log_of(out, 2)[-3000:]
    assert "(joined: [2])" in log_of(out, 0)
    assert "ft: group 2 healed from group" in log_of(out, 2)
    assert_equals_one_process(out, one_process)


def test_the_docs_two_group_recipe_runs_as_written_and_ends_on_the_one_process_bits(tmp_path, ft_args, one_process):
    """docs/fault_tolerance.md's three lines (the Lighthouse, two groups), on a free port and with the
    tests' tiny run appended, ending on the bits of the one-process run."""
    import re
    import shlex

    if not torchft_here():
        pytest.skip("torchft is not installed")
    text = (ROOT / "docs" / "fault_tolerance.md").read_text()
    block = re.search(r"## Two groups on one machine\n\n```bash\n(.*?)```", text, re.S).group(1).strip().splitlines()
    assert len(block) == 3 and block[0].startswith(".venv/bin/python -m runtime.lighthouse --port 29510")
    port, out = free_port(), tmp_path / "live"
    procs = []
    for line in block:
        argv = shlex.split(line.rstrip(" &").replace("29510", str(port)).replace("runs/live", str(out)))
        argv[0] = sys.executable
        if "train.py" in argv:
            argv += [a for a in ft_args if not a.startswith("dist.reduce=")]
        procs.append(launch.start(argv, tmp_path / f"{len(procs)}.log"))
        if len(procs) == 1:
            launch.wait_for(lambda: "listening" in (tmp_path / "0.log").read_text(), timeout=60, proc=procs[0])
    try:
        assert finish({1: procs[1], 2: procs[2]}) == {1: 0, 2: 0}, (tmp_path / "2.log").read_text()[-3000:]
    finally:
        procs[0].send_signal(signal.SIGTERM)
        procs[0].wait(timeout=30)
    assert_equals_one_process(out, one_process)


# ---------------------------------------------------------------- the disk is still the floor
def test_every_group_lost_the_same_commands_resume_from_the_newest_checkpoint_and_end_bit_identical(tmp_path, lighthouse, ft_args,
                                                                                                   one_process):
    out = tmp_path / "run"
    held = {"FT_GATE": f"10:{tmp_path / 'never'}"}  # every group waits before step 10: then all of them are SIGKILLed
    procs = {g: group(lighthouse, out, g, ft_args, env=held) for g in range(3)}
    wait_step(out, 9)
    launch.wait_for(lambda: (out / "checkpoints" / "step_00000008" / "manifest.json").exists(), timeout=60)
    for proc in procs.values():
        launch.kill_tree(proc.pid, signal.SIGKILL)
    assert finish(procs) == {g: -signal.SIGKILL for g in range(3)}
    procs = {g: group(lighthouse, out, g, ft_args, tag="b") for g in range(3)}
    assert finish(procs) == {0: 0, 1: 0, 2: 0}, log_of(out, 0, "b")[-3000:]
    assert "resumes at sample" in log_of(out, 0, "b")
    assert_equals_one_process(out, one_process)


def test_a_run_with_ft_resumes_without_it_on_two_processes_and_back_with_it_bit_identical(tmp_path, lighthouse, ft_args, one_process):
    out = tmp_path / "run"
    assert finish({0: group(lighthouse, out, 0, [*ft_args, "train.halt_at=5"], groups=1)}) == {0: 0}
    launch.run(2, *ft_args, "train.halt_at=10", f"out_dir={out}")  # plain torchrun, no ft.*
    procs = {g: group(lighthouse, out, g, ft_args, groups=2, tag="c") for g in range(2)}
    assert finish(procs) == {0: 0, 1: 0}, log_of(out, 1, "c")[-3000:]
    assert_equals_one_process(out, one_process)


# ---------------------------------------------------------------- faults
def test_a_group_sigkilled_three_times_at_random_steps_and_relaunched_each_time_ends_bit_identical(tmp_path, lighthouse, ft_args,
                                                                                                 one_process):
    import random

    seed = random.randrange(10**6)
    rnd = random.Random(seed)
    a = rnd.randint(2, 3)
    b = a + 2 + rnd.randint(0, 1)
    c = b + 2 + rnd.randint(0, 1)
    gates = ",".join(f"{k + 1}:{tmp_path / f'gate{n}'}" for n, k in enumerate((a, b, c)))  # the others wait for each relaunch
    out, kills, start = tmp_path / "run", [f"gather:{a}", f"quorum:{b}", f"gather:{c}"], f"0:{tmp_path / 'start'}"
    procs = {g: group(lighthouse, out, g, ft_args, env={"FT_GATE": f"{start},{gates}"}) for g in range(2)}
    procs["2"] = group(lighthouse, out, 2, ft_args, env={"FT_KILL": kills[0], "FT_GATE": start})
    for g in range(3):  # the three start together: the first kill is then the only change of membership before it
        in_the_run(out, g)
    (tmp_path / "start").touch()
    for n in range(3):
        assert procs[str(2) + "b" * n].wait(timeout=180) == -signal.SIGKILL, (seed, log_of(out, 2, "b" * n)[-3000:])
        tag = "b" * (n + 1)
        procs[str(2) + tag] = group(lighthouse, out, 2, ft_args, env={"FT_KILL": kills[n + 1]} if n < 2 else None, tag=tag)
        in_the_run(out, 2, tag)
        (tmp_path / f"gate{n}").touch()
    codes = finish(procs)
    assert codes == {0: 0, 1: 0, "2": -9, "2b": -9, "2bb": -9, "2bbb": 0}, (seed, codes)
    assert_equals_one_process(out, one_process)


def test_sigkill_of_the_healing_group_while_it_receives_then_relaunched_ends_bit_identical(tmp_path, lighthouse, ft_args, one_process):
    out, args = tmp_path / "run", [*ft_args, "checkpoint.interval=0"]
    gates = f"6:{tmp_path / 'gate'},10:{tmp_path / 'gate_b'}"  # each opened once the next launch is in the run
    procs = {g: group(lighthouse, out, g, args, env={"FT_GATE": gates}) for g in range(2)}
    wait_step(out, 3)
    procs[2] = group(lighthouse, out, 2, args, env={"FT_KILL": "recv:0"})
    in_the_run(out, 2)
    (tmp_path / "gate").touch()
    assert procs[2].wait(timeout=180) == -signal.SIGKILL
    assert "SIGKILL while receiving a heal" in log_of(out, 2)
    procs["2b"] = group(lighthouse, out, 2, args, tag="b")
    in_the_run(out, 2, "b")
    (tmp_path / "gate_b").touch()
    assert finish(procs) == {0: 0, 1: 0, 2: -signal.SIGKILL, "2b": 0}, log_of(out, 2, "b")[-3000:]
    assert "ft: group 2 healed from group" in log_of(out, 2, "b")
    assert_equals_one_process(out, one_process)


def test_sigkill_of_the_sending_group_during_a_heal_the_healer_heals_from_another_and_the_run_ends_bit_identical(tmp_path, lighthouse,
                                                                                                             ft_args, one_process):
    """Groups 0 and 1 are both armed to die when asked for a heal, the first one asked dies (FT_ONCE);
    group 2's heal fails, the step is done again, and it heals from the one left."""
    out, args = tmp_path / "run", [*ft_args, "checkpoint.interval=0"]
    armed = {"FT_KILL": "send:1", "FT_ONCE": str(tmp_path / "fired"), "FT_GATE": f"8:{tmp_path / 'gate'}"}
    procs = together(lighthouse, out, args, {g: armed for g in range(2)})
    wait_step(out, 3)
    procs[2] = group(lighthouse, out, 2, args)
    in_the_run(out, 2)
    (tmp_path / "gate").touch()
    codes = finish(procs)
    assert sorted(map(str, codes.values())) == sorted(["0", "0", str(-signal.SIGKILL)]), codes
    sender = next(g for g, code in codes.items() if code == -signal.SIGKILL)
    assert "SIGKILL while sending a heal" in log_of(out, sender)
    assert f"ft: group 2 healed from group {1 - sender}" in log_of(out, 2)
    assert_equals_one_process(out, one_process)


def test_a_hung_group_is_left_out_after_the_timeout_named_and_the_run_ends_bit_identical(tmp_path, lighthouse, ft_args, one_process):
    out = tmp_path / "run"
    args = [*ft_args, "ft.timeout_s=4"]
    procs = together(lighthouse, out, args, {g: {"FT_HANG": "5"} if g == 2 else None for g in range(3)})
    try:
        assert finish({0: procs[0], 1: procs[1]}) == {0: 0, 1: 0}, log_of(out, 0)[-3000:]
    finally:
        launch.kill_tree(procs[2].pid, signal.SIGKILL)
    assert "SIGSTOP before the gather of step 5" in log_of(out, 2)
    said = log_of(out, 0) + log_of(out, 1)
    assert "(left: [2])" in said and "the gather of step 5 failed" in said
    assert_equals_one_process(out, one_process)


def test_the_lighthouse_killed_and_restarted_the_groups_wait_for_it_and_end_bit_identical(tmp_path, lighthouse, ft_args, one_process):
    out = tmp_path / "run"
    gate = tmp_path / "gate"  # both groups ask for step 5's quorum only once the Lighthouse is down (a slow step
    procs = together(lighthouse, out, ft_args, {g: {"FT_GATE": f"5:{gate}"} for g in range(2)})  # could miss it)
    wait_step(out, 4)
    lighthouse.stop()
    gate.touch()
    time.sleep(3)
    lighthouse.start()
    assert finish(procs) == {0: 0, 1: 0}, log_of(out, 0)[-3000:]
    assert "waits for a quorum" in log_of(out, 0) and "has a quorum again" in log_of(out, 0)
    assert_equals_one_process(out, one_process)


def test_the_lighthouse_gone_for_good_the_groups_stop_with_75_named_and_the_same_commands_resume_exactly(tmp_path, lighthouse, ft_args,
                                                                                                      one_process):
    out, args = tmp_path / "run", [*ft_args, "ft.quorum_timeout_s=4"]
    procs = together(lighthouse, out, args, {g: None for g in range(2)})
    for g in range(2):
        in_the_run(out, g)
    wait_step(out, 5)
    lighthouse.stop()
    assert finish(procs) == {0: 75, 1: 75}, log_of(out, 0)[-3000:]
    assert "ft: no quorum for 4 s (ft.quorum_timeout_s)" in log_of(out, 0)
    lighthouse.start()
    assert finish({g: group(lighthouse, out, g, args, tag="b") for g in range(2)}) == {0: 0, 1: 0}, log_of(out, 0, "b")[-3000:]
    assert_equals_one_process(out, one_process)


def test_a_group_launched_with_another_config_is_refused_at_the_heal_exit_2_naming_the_key(tmp_path, lighthouse, ft_args, one_process):
    out, args = tmp_path / "run", [*ft_args, "checkpoint.interval=0"]
    procs = together(lighthouse, out, args, {g: {"FT_GATE": f"8:{tmp_path / 'gate'}"} for g in range(2)})
    wait_step(out, 3)
    odd = group(lighthouse, out, 2, [*args, "train.lr=0.001"])
    in_the_run(out, 2)
    (tmp_path / "gate").touch()
    assert odd.wait(timeout=180) == 2, log_of(out, 2)[-3000:]
    said = log_of(out, 2)
    assert "ft: group 2 cannot heal from group" in said and "train.lr=0.001 here, 0.003 there" in said and "Traceback" not in said
    assert finish(procs) == {0: 0, 1: 0}
    assert_equals_one_process(out, one_process)


def test_a_heal_whose_weights_do_not_arrive_as_sent_is_refused_naming_the_identity(tmp_path, lighthouse, ft_args, one_process):
    out, args = tmp_path / "run", [*ft_args, "checkpoint.interval=0"]
    procs = together(lighthouse, out, args, {g: {"FT_GATE": f"8:{tmp_path / 'gate'}"} for g in range(2)})
    wait_step(out, 3)
    bad = group(lighthouse, out, 2, args, env={"FT_CORRUPT_HEAL": "1"})
    in_the_run(out, 2)
    (tmp_path / "gate").touch()
    assert bad.wait(timeout=180) == 2, log_of(out, 2)[-3000:]
    assert "its model identity is" in log_of(out, 2) and "refused" in log_of(out, 2)
    assert finish(procs) == {0: 0, 1: 0}
    assert_equals_one_process(out, one_process)


def test_groups_of_two_processes_one_lost_and_relaunched_heal_and_end_bit_identical(tmp_path, lighthouse, ft_args, one_process):
    """Two groups, each a torchrun job of 2 processes (DDP inside): group 1's node dies (its whole
    tree SIGKILLed), is relaunched and heals, rank by rank, from group 0."""
    out, args = tmp_path / "run", [*ft_args, "checkpoint.interval=0"]
    procs = {0: group(lighthouse, out, 0, args, groups=2, nproc=2, env={"FT_GATE": f"9:{tmp_path / 'gate'}"}),
             1: group(lighthouse, out, 1, args, groups=2, nproc=2)}
    wait_step(out, 4)
    launch.kill_tree(procs[1].pid, signal.SIGKILL)
    procs[1].wait(timeout=60)
    procs["1b"] = group(lighthouse, out, 1, args, groups=2, nproc=2, tag="b")
    launch.wait_for(lambda: log_of(out, 1, "b").count("ft_train: in the run") == 2, timeout=180, every=0.05)
    (tmp_path / "gate").touch()
    codes = finish(procs)
    assert codes[0] == 0 and codes["1b"] == 0, log_of(out, 1, "b")[-3000:]
    assert "ft: group 1 healed from group 0" in log_of(out, 1, "b")
    assert_equals_one_process(out, one_process)


# ---------------------------------------------------------------- objectives
def test_sft_under_live_recovery_a_group_lost_and_healed_ends_on_the_one_process_bits(tmp_path, lighthouse, tiny):
    import json
    import random

    rnd, words = random.Random(1), "the a model data step epoch resume checkpoint rank world size batch order seed".split()
    chats = tmp_path / "chat.jsonl"
    chats.write_text("".join(json.dumps({"conversations": [
        {"role": "user", "content": " ".join(rnd.choice(words) for _ in range(rnd.randint(3, 10)))},
        {"role": "assistant", "content": " ".join(rnd.choice(words) for _ in range(rnd.randint(3, 20)))}]}) + "\n" for _ in range(300)))
    args = [*tiny, "dist.reduce=canonical", f"data.path={chats}", "data.format=chat", "model.seq_len=64", "train.steps=12",
            "checkpoint.interval=0", "log.sample_ids=true"]
    ref = tmp_path / "ref"
    launch.run(0, *args, f"out_dir={ref}")
    out = tmp_path / "run"
    procs = together(lighthouse, out, args, {g: {"FT_KILL": "gather:3"} if g == 1 else {"FT_GATE": f"6:{tmp_path / 'g'}"}
                                             for g in range(2)}, groups=2)
    assert procs[1].wait(timeout=180) == -signal.SIGKILL
    procs["1b"] = group(lighthouse, out, 1, args, groups=2, tag="b")
    in_the_run(out, 1, "b")
    (tmp_path / "g").touch()
    assert finish(procs) == {0: 0, 1: -signal.SIGKILL, "1b": 0}
    assert_equals_one_process(out, ref)


def test_the_groups_locks_admit_the_groups_of_one_run_and_refuse_a_run_without_ft_and_the_other_way(tmp_path):
    """Each group holds `.lock.group<N>`; a second launch of the same group waits then refuses, and a
    run without ft.* is refused while any group holds the folder (and the other way round)."""
    from run import folder

    out = tmp_path / "run"
    hold = [sys.executable, "-c", "import sys, time; sys.path.insert(0, '.'); from run import folder; "
            "lock = folder.acquire(sys.argv[1], 5, name=sys.argv[2]); print('held', flush=True); time.sleep(60)"]
    holder = launch.start([*hold, str(out), folder.group_lock(0)], tmp_path / "hold.log")
    try:
        launch.wait_for(lambda: "held" in (tmp_path / "hold.log").read_text(), timeout=60, proc=holder)
        other = folder.acquire(out, 1, name=folder.group_lock(1))  # group 1 of the same run: admitted
        other.release()
        with pytest.raises(folder.RunFolderError, match=r"is held by pid"):
            folder.acquire(out, 0.5, name=folder.group_lock(0))  # group 0 twice
        with pytest.raises(folder.RunFolderError, match=r"is used by the live-recovery groups holding .lock.group0"):
            folder.acquire(out, 0.5)  # a run without ft.*
    finally:
        holder.kill()
        holder.wait(timeout=30)
    plain = launch.start([*hold, str(out), folder.LOCK], tmp_path / "hold2.log")
    try:
        launch.wait_for(lambda: "held" in (tmp_path / "hold2.log").read_text(), timeout=60, proc=plain)
        with pytest.raises(folder.RunFolderError, match=r"is used by a run without ft.lighthouse"):
            folder.acquire(out, 0.5, name=folder.group_lock(2))
    finally:
        plain.kill()
        plain.wait(timeout=30)


def test_a_group_that_cannot_reach_the_lighthouse_at_its_start_stops_with_75_naming_it(tmp_path, ft_args):
    if not torchft_here():
        pytest.skip("torchft is not installed")
    port = free_port()
    proc = launch.run(0, *ft_args, f"out_dir={tmp_path / 'run'}", f"ft.lighthouse=127.0.0.1:{port}", "ft.timeout_s=2", expect=75)
    said = proc.stdout + proc.stderr
    assert f"ft: group 0 cannot reach the Lighthouse at 127.0.0.1:{port}" in said and "Traceback" not in said
