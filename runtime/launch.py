"""`python -m runtime.launch ARGS`: torchrun ARGS, whose exit code says when a signal stopped it.

torchrun's own code after a SIGTERM is 1 once its handlers are set up (it stopped its workers) and
death by the signal (143) before that: neither tells a script that the launch was stopped rather
than failed. Here a stop signal (SIGTERM, SIGINT, SIGUSR1) at any moment, from the first line of
this file on, ends the launch as torchrun ends it (its workers get the signal and save: docs/
preemption.md) and the exit code is 128 + the signal's number; scripts/train.sh and
scripts/slurm/train.sbatch hand it to `python -m checkpoint status --exit-code --fallback CODE`,
which reads it as a stop (docs/design.md I16). When workers fail, torchrun's block of about 25
lines (ChildFailedError) is one line here, below the run's own line, and the code is the first
failing worker's when it is one of common/outcome.py's (2 for bad input), else 1. Any other code is
torchrun's.
`--nproc_per_node=gpus-or-2`: one process per GPU, or 2 without CUDA.
"""
import os
import signal
import sys

STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")
_received: list[int] = []
_raise = None  # torchrun's way to stop, once it is imported: raise its SignalException in the main thread


def _noted(signum, frame) -> None:
    # Before torchrun is imported a signal is only noted (nothing is running yet); after, it stops the
    # launch as torchrun's own handler does. torchrun replaces this handler when its workers start.
    if not _received:
        _received.append(signum)
    if _raise is not None:
        _raise(signum)


def main(argv: list[str]) -> int:
    global _raise
    for name in STOP_SIGNALS:
        signal.signal(getattr(signal, name), _noted)
    if "--nproc_per_node=gpus-or-2" in argv:  # one process per GPU, or 2 on a CPU machine (scripts/train.sh)
        import torch

        argv[argv.index("--nproc_per_node=gpus-or-2")] = f"--nproc_per_node={torch.cuda.device_count() if torch.cuda.is_available() else 2}"
    if not any(a.startswith(("--signals-to-handle", "--signals_to_handle")) for a in argv):
        # torchrun passes these to its workers (SIGUSR1: Slurm's time-limit warning)
        argv = ["--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", *argv]
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    def stop(signum: int) -> None:
        raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))

    if _received:  # stopped before anything was started: nothing to stop
        return 128 + _received[0]
    _raise = stop
    try:
        torchrun(argv)
        code = 0
    except SignalException as e:
        _received[:] = _received or [int(e.sigval)]
        code = 1
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except ChildFailedError as e:  # a worker failed: its own line is above, and the run's status has it
        print(failure_line(e), file=sys.stderr)
        code = worker_code(e)
    except Exception as e:  # noqa: BLE001 - torchrun itself failed (a rendezvous, a bad argument)
        print(f"torchrun: {type(e).__name__}: {e}", file=sys.stderr)
        code = 1
    return 128 + _received[0] if _received else code


def worker_code(e) -> int:
    """The launch's code when workers failed: the first failing worker's, when it is one of the
    table's (train.py exits 2 for bad input on every rank alike), else 1 (a death by a signal, a crash)."""
    from common.outcome import EXIT_CODES

    code = e.get_first_failure()[1].exitcode
    return code if code in set(EXIT_CODES.values()) - {0} else 1


def failure_line(e) -> str:
    """torchrun's summary of failed workers (a block of about 25 lines) in one line: which rank
    failed first and how, then the others."""
    def how(f) -> str:
        return f"died of {f.signal_name()}" if f.exitcode < 0 else f"exited with {f.exitcode}"

    first, failure = e.get_first_failure()
    others = [f"rank {r} {how(f)}" for r, f in sorted(e.failures.items()) if r != first]
    error_file = f"; error file {failure.error_file}" if failure.error_file and failure.error_file != "<N/A>" else ""
    return (f"torchrun: {e.name} failed: rank {first} {how(failure)} first (pid {failure.pid}){error_file}"
            f"{'; ' + ', '.join(others) if others else ''}")


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
