"""Which of this machine's cores each local trainer node runs on: running jobs get disjoint cores while they fit.

A node asking for `cpu_per_node` cores gets that many whole cores, rounded up (0.5 gets one, 1.5 two: a process
runs on whole cores; its cgroup's CPU quota, where the server has cgroups, still holds it to the fraction). Each
core goes to the nodes that hold the fewest: while free cores remain, jobs never share one; once every core is
taken (admission counts trainer processes, not cores, so a job may be admitted beside others that hold all the
cores), a node shares the least-held cores, lowest first, rather than waiting. A node never gets more cores than
the machine has.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

__all__ = ["CoreAllocator", "cores_for"]


def cores_for(cpu_per_node: float) -> int:
    """Whole cores for a node that asks for `cpu_per_node` (resources.cpu_per_node): rounded up, at least one."""
    return max(1, math.ceil(cpu_per_node - 1e-9))  # 3.0000000001 from a float's arithmetic is still 3


class CoreAllocator:
    def __init__(self, cores: Sequence[int]) -> None:
        """`cores`: the cores trainers may run on (the server's own affinity)."""
        if not cores:
            raise ValueError("no cores to place trainers on")
        self._cores = sorted(set(cores))
        self._held: dict[str, list[list[int]]] = {}  # job id -> each of its nodes' cores
        self._lock = threading.Lock()

    @property
    def cores(self) -> list[int]:
        return list(self._cores)

    def take(self, job_id: str, *, nodes: int, cpu_per_node: float) -> list[list[int]]:
        """Cores for each of the job's `nodes` nodes (what it held before is given back first)."""
        with self._lock:
            self._held.pop(job_id, None)
            holders = {core: 0 for core in self._cores}
            for placement in self._held.values():
                for node_cores in placement:
                    for core in node_cores:
                        holders[core] += 1
            count = min(cores_for(cpu_per_node), len(self._cores))
            placement = []
            for _ in range(nodes):
                chosen = sorted(sorted(self._cores, key=lambda c: (holders[c], c))[:count])
                for core in chosen:
                    holders[core] += 1
                placement.append(chosen)
            self._held[job_id] = placement
            return [list(p) for p in placement]

    def release(self, job_id: str) -> None:
        with self._lock:
            self._held.pop(job_id, None)

    def held(self) -> dict[str, list[list[int]]]:
        """Each running job's nodes' cores (a copy)."""
        with self._lock:
            return {job: [list(p) for p in placement] for job, placement in self._held.items()}
