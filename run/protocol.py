"""The failure protocol: how every rank learns how the run ends, whichever rank failed and wherever
(docs/design.md I9; docs/run_folder.md, "When a rank fails").

One rule, that no rank waits in a collective another rank has left, kept by three pieces:

- Agreement points. Set-up, the resume, and every step boundary end in one collective over every
  rank's outcome (`agree`, `boundary`). A rank whose rank-local work failed (the packing, the
  metrics line, config.yaml, a background save) brings its error there instead of raising, and
  every rank raises the same RankFailed, naming the failing rank and its error.
- The board: keys on the launch's c10d store, which every rank already holds. A rank that fails
  where it cannot reach the next agreement point (inside a forward pass, a collective, a set-up
  step its peers are not at) posts its failure there (`post`) before it leaves; a peer whose
  collective then breaks (gloo: the connection closes at once), or whom torchrun stops, reads it
  (`posted`) and names that rank and its error instead of "connection closed" or "stopped".
- Waits that must be long (a node's packer) read a heartbeat on the board with a stall limit
  (runtime/board.py: `wait_for`), never a collective with a timeout.
"""
from __future__ import annotations

import logging
import os
import socket
import traceback

from common.outcome import BadInput, Failed, RankFailed, Stopped, describe_os_error, known, outcome_of

log = logging.getLogger("minimind")


def describe(e: BaseException) -> str:
    """One line for an error: the message of the errors this repository raises, the file and cause
    of an I/O error, the type and message of anything else (a bug)."""
    if isinstance(e, RankFailed):
        return e.message
    if isinstance(e, OSError) and not isinstance(e, BadInput):
        return describe_os_error(e)
    if isinstance(e, (BadInput, Failed)):
        return from_worker(str(e))
    return f"{type(e).__name__}: {e}"


def from_worker(message: str) -> str:
    """An error a DataLoader worker raised comes back with the worker's traceback as its message ("Caught
    StoreError in DataLoader worker process 0. Original Traceback ..."): its last line, without the type."""
    if message.startswith("Caught ") and " in DataLoader worker process " in message:
        last = message.rstrip().rsplit("\n", 1)[-1]
        return last.split(": ", 1)[1] if ": " in last else last
    return message


def cause_rank(e: BaseException, rank: int) -> int:
    """The rank whose failure `e` is: its own, or the one a collective failure names (DCP gathers
    every rank's failures and raises them on every rank: `failed_rank`)."""
    failed = getattr(e, "failed_rank", None)
    return failed if isinstance(failed, int) else rank


class Protocol:
    """The agreement points and the board of one launch; `comm` is the run's runtime (rank,
    world_size, sum, all_gather, and its board: runtime/board.py)."""

    def __init__(self, comm) -> None:
        self.comm, self.board = comm, comm.board
        self.phase = "set-up"
        """Where the run is (set-up, resume, training): what a failure posted on the board says."""

    # ------------------------------------------------------------------ agreement points
    def agree(self, phase: str, error: BaseException | None) -> None:
        """Collective: every rank brings its outcome of `phase` (its error, or None); if any failed,
        every rank raises the same RankFailed naming the first failing rank and its error."""
        mine = None if error is None else (outcome_of(error, self.comm.rank), describe(error), cause_rank(error, self.comm.rank))
        outcomes = self.comm.all_gather(mine)
        for rank, outcome in enumerate(outcomes):
            if outcome is not None:
                kind = "bad_input" if outcome[0] == "bad_input" else "failed"
                raise RankFailed(outcome[2], kind, outcome[1], phase) from (error if rank == self.comm.rank else None)

    def boundary(self, stop: bool, error: BaseException | None) -> bool:
        """The one collective of a step boundary: did any rank get a stop signal (returned), did any
        rank fail since the last boundary (then every rank raises RankFailed, after a second
        collective that tells them who and why)."""
        stops, failures = self.comm.sum([float(stop), float(error is not None)])
        if failures:
            self.agree("training", error)
        return stops > 0

    # ------------------------------------------------------------------ the board
    def post(self, phase: str, error: BaseException) -> None:
        """Leave this rank's failure on the board for the others (the first posted is the cause).
        Never raises: a rank on its way out must not fail again here."""
        if isinstance(error, RankFailed):  # an agreed failure: its cause, for a rank torchrun stops before it read it
            record = {"rank": error.rank, "outcome": error.outcome, "message": error.message, "phase": error.phase or phase}
        else:
            record = {"rank": cause_rank(error, self.comm.rank), "outcome": outcome_of(error, self.comm.rank),
                      "message": describe(error), "phase": phase}
        try:
            self.board.post_failure({**record, "host": socket.gethostname(), "pid": os.getpid()})
        except Exception:  # noqa: BLE001 - the store is gone too: the log has this rank's error
            pass

    def posted(self) -> RankFailed | None:
        """A failure of another rank from the board, or None (only this rank's own, none, or no store)."""
        return self.board.failure_of_another(self.comm.rank)

    # ------------------------------------------------------------------ how a rank ends
    def conclude(self, e: BaseException, signal: str | None) -> tuple[str, str]:
        """The outcome of this rank, which ended with `e`, and its one line (docs/design.md I16). A
        failure every rank agreed on is what it says (posted too, for a rank torchrun stops before
        it has read it); another rank's failure on the board is the cause of what this rank saw (a
        broken collective, torchrun's stop); a stop signal (`signal`) is a stop; anything else is this
        rank's own failure, posted on the board for the others before it leaves."""
        me = self.comm.rank
        if cause_rank(e, me) != me:  # a collective failure every rank raised alike (DCP's), naming the rank it was
            e = RankFailed(cause_rank(e, me), outcome_of(e, me), describe(e), self.phase)
        if isinstance(e, RankFailed):
            self.post(self.phase, e)
            return outcome_of(e, me), e.describe(me)
        peer = self.posted()
        if peer is not None:
            return outcome_of(peer, me), peer.describe(me)
        if isinstance(e, Stopped):  # a signal, or a stop with its own message (live recovery's lost quorum: runtime/ft.py)
            return "stopped", str(e) if signal is None and str(e) else \
                f"stopped on {signal} during {self.phase}: nothing to save; the previous checkpoint (if any) stands"
        self.post(self.phase, e)
        if not known(e):  # a bug: the traceback goes to the log
            log.error("%s", "".join(traceback.format_exception(e)).rstrip())
        return outcome_of(e, me), f"error: {describe(e)}"


