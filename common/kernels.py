"""The CPU math library in its reproducible mode: the same command gives the same bits.

oneMKL's default branch on an AVX-512 CPU (seen on a Sapphire Rapids VM, 2 threads) gave another
step-1 gradient in about one run in seven of the same command; with `MKL_CBWR=AVX2,STRICT` every run
gave the same bits, on 1 thread and on 2 alike, which the exactness across world sizes needs (a
resume on another number of processes runs another number of threads per process). Its price: the
AVX2 code path, about 1.6x the default's time for a large fp32 matmul on that CPU (docs/performance.md).
MKL reads the variable at its first call, so setting it before any matmul is enough. A user's own
MKL_CBWR is kept (MKL_CBWR=AUTO: faster, and exact only where MKL is deterministic on that machine)."""
from __future__ import annotations

import os

MKL_REPRODUCIBLE = "AVX2,STRICT"


def _has_avx2() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx2" in line for line in f)
    except OSError:  # not Linux: MKL's branch is left as it is
        return False


def reproducible_kernels() -> None:
    """Set MKL_CBWR for this process (and what it starts) unless the user set it; on an x86 CPU with
    AVX2 only (elsewhere there is no such branch, or no MKL)."""
    if "MKL_CBWR" not in os.environ and _has_avx2():
        os.environ["MKL_CBWR"] = MKL_REPRODUCIBLE
