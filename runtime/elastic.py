"""A workaround for torch 2.13's torchrun: each restart attempt agrees on a store key space of its own.

torchrun (2.13) keeps one shared TCPStore for all of a job's restart attempts and, unlike older
releases, no longer gives each attempt a key prefix of its own (docs/preemption.md, "Several nodes").
"""
from __future__ import annotations

import datetime
import time
import uuid

import torch.distributed as dist


def attempt_store(env, rank: int, world_size: int, timeout: datetime.timedelta) -> dist.Store | None:
    """The store for this restart attempt when torchrun shares its own TCPStore with the workers.

    torchrun (2.13) keeps one shared store for all of a job's restart attempts and, unlike older
    releases, no longer gives each attempt a key prefix of its own: after `--max-restarts` restarts
    the workers, the new process group can read the previous attempt's keys (the dead workers'
    addresses) and hang in its first connect. TORCHELASTIC_RESTART_COUNT, the prefix torch once
    used, is counted per node and differs between nodes when one node restarts for a failure and
    another for the membership change, so the workers agree on a fresh prefix instead
    (`agree_on_attempt`). None: the default env:// set-up is safe (torchrun without a shared
    store, or no torchrun).
    """
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    client = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size, is_master=False, timeout=timeout)
    return dist.PrefixStore(f"attempt/{agree_on_attempt(client, rank, world_size, timeout)}", client)


def agree_on_attempt(store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta) -> str:
    """A name that every rank of this launch gets and no earlier launch on `store` had.

    Rank 0 draws it; each other rank asks with a nonce of its own and waits for the answer under a
    key named after that nonce, which no earlier launch can have written. Whatever an earlier
    launch left in the store (its requests, its answers) is never read as this launch's.
    """
    if rank != 0:
        nonce = uuid.uuid4().hex
        store.set(f"attempt-ask/{rank}", nonce)
        store.wait([f"attempt-answer/{nonce}"], timeout)
        name = store.get(f"attempt-answer/{nonce}").decode()
        store.set(f"attempt-joined/{name}/{rank}", "1")
        return name
    name, answered, pending = uuid.uuid4().hex, set(), set(range(1, world_size))
    end = time.monotonic() + timeout.total_seconds()
    while pending:
        for r in sorted(pending):
            if store.check([f"attempt-ask/{r}"]):
                nonce = store.get(f"attempt-ask/{r}").decode()  # maybe a dead process's: answered in vain
                if nonce not in answered:
                    store.set(f"attempt-answer/{nonce}", name)
                    answered.add(nonce)
            if store.check([f"attempt-joined/{name}/{r}"]):
                pending.discard(r)
        if pending:
            if time.monotonic() > end:
                raise RuntimeError(f"ranks {sorted(pending)} did not join the process group within {timeout}")
            time.sleep(0.01)
    return name


