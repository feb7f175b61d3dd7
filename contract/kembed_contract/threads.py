"""How many threads a trainer's rank runs, and how they wait: the one thread policy, set by both backends (the local
backend in each node's environment, the operator in each pod's) and read by the trainer. Stdlib only.

A job is admitted with `resources.cpu_per_node` cores per node, shared by its `procs_per_node` ranks: each rank
runs that share of threads, whole (at least one), never as many as the node has cores. Threads beyond the share
would only wait for a core another job was promised, and a thread that spins while it waits burns a core that
another thread (its job's own, or a neighbour's) is waiting for: so OpenMP's idle threads sleep (WAIT_POLICY).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

__all__ = ["ENV_THREADS_PER_RANK", "THREAD_COUNT_VARIABLES", "WAIT_POLICY", "thread_environ", "threads_per_rank",
           "threads_per_rank_for"]

# Threads each rank runs (torch's intra-op and inter-op pools, the trainer's own worker threads), set by the
# launcher from the job's resources; unset: a trainer run by hand, which shares the cores it may run on.
ENV_THREADS_PER_RANK = "KEMBED_THREADS_PER_RANK"
# The libraries that size their own pools from the environment (OpenMP, which torch's CPU kernels run on; MKL;
# OpenBLAS; numba's threading layer) read these at their import: they must be set before the process starts.
THREAD_COUNT_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS")
# How OpenMP's idle threads wait (torch's CPU kernels run on libgomp). By default they spin before sleeping: with
# the cores busy (another job's threads, the machine's other work) a job's steps then wait for threads that burn
# the cores they need. Sleeping at once (PASSIVE) held its speed under load where no spin count did, at a price on
# a quiet machine for models of many small ops; docs/benchmarks.md ("Idle threads that spin") has the figures.
WAIT_POLICY = {"OMP_WAIT_POLICY": "PASSIVE"}


def threads_per_rank_for(cpu_per_node: float, procs_per_node: int) -> int:
    """A rank's threads: its whole share of the node's cores (`cpu_per_node / procs_per_node`, rounded down, so
    the ranks together never run more threads than the cores they were given), at least one. A fractional share
    below one core still runs one thread, which the node's CPU limit (a cgroup's quota) then slows down."""
    if not (math.isfinite(cpu_per_node) and cpu_per_node > 0):
        raise ValueError(f"resources.cpu_per_node: must be a positive number of cores, not {cpu_per_node!r}")
    if procs_per_node < 1:
        raise ValueError(f"resources.procs_per_node: must be at least 1, not {procs_per_node!r}")
    # A small epsilon: 0.3 * 10 / 10 cores are 3 whole ones, not 2.9999.
    return max(1, math.floor(cpu_per_node / procs_per_node + 1e-9))


def thread_environ(cpu_per_node: float, procs_per_node: int) -> dict[str, str]:
    """The environment of a node's processes that holds each of its ranks to its share of the cores."""
    threads = str(threads_per_rank_for(cpu_per_node, procs_per_node))
    return {ENV_THREADS_PER_RANK: threads, **dict.fromkeys(THREAD_COUNT_VARIABLES, threads), **WAIT_POLICY}


def threads_per_rank(environ: Mapping[str, str] | None = None) -> int | None:
    """The rank's threads as the launcher set them (`ENV_THREADS_PER_RANK`); None when unset. A value that is not
    a positive whole number is an error naming the variable (the launcher wrote it; nothing can be guessed)."""
    value = (os.environ if environ is None else environ).get(ENV_THREADS_PER_RANK)
    if value in (None, ""):
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{ENV_THREADS_PER_RANK}: must be a whole number of threads >= 1, not {value!r}")
    return int(value)
