"""How a run ended and the exit code that says it, decided here and nowhere else
(docs/design.md I16; docs/run_folder.md, "Exit codes").

    python3 -m common.outcome stopped      # prints 75: the shell scripts read the table this way

train.py maps the exception that ended a rank (or none) to an outcome with `outcome_of` and the
outcome to its code with `exit_code`; `python -m checkpoint status --exit-code`, scripts/train.sh
and scripts/slurm/train.sbatch read the same table. This module imports nothing, so the shell can
ask it before the virtual environment exists.
"""
from __future__ import annotations

import sys

EXIT_CODES = {
    "finished": 0,     # every step done
    "halted": 0,       # train.halt_at reached: a planned stop
    "stopped": 75,     # a signal stopped it: its checkpoint is published, or nothing was under way (EX_TEMPFAIL: resume me)
    "bad_input": 2,    # bad config or data, or settings a checkpoint refuses: a rerun changes nothing
    "failed": 1,       # I/O, a damaged checkpoint, a stalled disk, a bug
    "peer_failed": 1,  # another rank failed, for a cause that is not bad input (named in the log)
}
OUTCOMES = tuple(EXIT_CODES)


class BadInput(Exception):
    """An error whose cause is the user's input (config, corpus, weights, checkpoint settings): exit 2.
    The rooms' own error classes derive from it (ConfigError, DataError, CheckpointMismatch, ...)."""


class Failed(RuntimeError):
    """A failure with a message for the user and no traceback (a damaged checkpoint, a stalled
    disk): exit 1. I/O errors (OSError) are failures too; anything else is a bug (traceback)."""


def known(exc: BaseException) -> bool:
    """An error with a message for the user (its message is the whole story: no traceback)."""
    return isinstance(exc, (BadInput, Failed, OSError, RankFailed, Stopped))


class Stopped(BaseException):
    """A stop signal ended the run before it was under way (a BaseException, as KeyboardInterrupt,
    so that no `except Exception` on the way swallows it): exit 75."""


class RankFailed(Exception):
    """A failure every rank agreed on: the failing rank, its outcome ("bad_input" or "failed") and
    its message, raised on every rank alike (run/protocol.py)."""

    def __init__(self, rank: int, outcome: str, message: str, phase: str = "") -> None:
        self.rank, self.outcome, self.message, self.phase = rank, outcome, message, phase
        super().__init__(message)

    def describe(self, my_rank: int) -> str:
        """The one line a rank logs: its own error, or the failing rank's named."""
        where = f" during {self.phase}" if self.phase else ""
        return self.message if my_rank == self.rank else f"rank {self.rank} failed{where}: {self.message}"


def describe_os_error(e: OSError) -> str:
    """An I/O error in one line naming its path (and the second path of a rename): "PATH: Read-only
    file system". Every OSError that is not a BadInput is a failure, exit 1, whatever its errno
    (read-only, permission denied, EIO, a full disk): the path the input named is checked for what
    makes it bad input (a file where a folder goes) before the I/O that could fail."""
    name = f"{e.filename}{f' -> {e.filename2}' if getattr(e, 'filename2', None) else ''}: " if e.filename else ""
    return f"{name}{e.strerror or e}"


def outcome_of(exc: BaseException | None, my_rank: int = 0) -> str:
    """The outcome of a rank that ended with `exc` (None: it ran to its end, "finished")."""
    if exc is None:
        return "finished"
    if isinstance(exc, Stopped):
        return "stopped"
    if isinstance(exc, RankFailed):
        if exc.outcome == "bad_input":
            return "bad_input"
        return "failed" if exc.rank == my_rank else "peer_failed"
    if isinstance(exc, BadInput):
        return "bad_input"
    return "failed"


def exit_code(outcome: str) -> int:
    """The exit code of an outcome; an unknown name is a failure (1)."""
    return EXIT_CODES.get(outcome, 1)



def command(main, argv: list[str] | None = None) -> int:
    """Run a command's `main(argv)` as every command of this repository ends: its own code, or 2 for
    bad input and 1 for a failure (a damaged checkpoint, I/O) with one line on stderr and no traceback; a reader that goes
    away (`| head`) ends it quietly with 0, never blaming an input file."""
    import os

    try:
        code = main(argv)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        pass
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return exit_code("bad_input")
    except Failed as e:  # a damaged checkpoint, a stalled disk: said in one line, exit 1
        print(f"error: {e}", file=sys.stderr)
        return exit_code("failed")
    except OSError as e:
        print(f"error: {describe_os_error(e)}", file=sys.stderr)
        return exit_code("failed")
    # stdout's reader is gone: point stdout at /dev/null so that the interpreter's last flush is quiet
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def attempt(fn, *args, **kwargs) -> BaseException | None:
    """Run rank-local work whose failure is brought to the next agreement point instead of raised
    (run/protocol.py): the exception, or None."""
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - voted on at the next agreement point, then raised on every rank
        return e
    return None


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in EXIT_CODES:
        print(f"usage: python3 -m common.outcome {{{','.join(OUTCOMES)}}}", file=sys.stderr)
        sys.exit(2)
    print(exit_code(sys.argv[1]))

