"""Quota arithmetic and queue forecasts: pure functions, no I/O, cheap to test.

Admission is all-or-nothing (a gang): a job is admitted only when everything it asks for fits in what its
tenant has left, in every dimension at once.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import cached_property
from typing import Any

from kembed_contract.spec import JobSpec

__all__ = ["Demand", "Quota", "RunningJob", "estimate_start_times", "never_fits", "shortfall"]


@dataclass(frozen=True)
class Demand:
    """What a job (or a set of jobs) holds while admitted."""

    gpus: int = 0
    cpu: float = 0.0
    memory_bytes: int = 0
    jobs: int = 0
    processes: int = 0

    @classmethod
    def of(cls, spec: JobSpec) -> Demand:
        r = spec.resources
        return cls(gpus=r.nodes * r.gpus_per_node, cpu=r.nodes * r.cpu_per_node,
                   memory_bytes=r.nodes * r.memory_bytes_per_node, jobs=1, processes=r.num_processes)

    # Spelled out (not dataclasses.astuple, which deep-copies): queue forecasts add thousands of these per read.
    def __add__(self, other: Demand) -> Demand:
        return Demand(self.gpus + other.gpus, self.cpu + other.cpu, self.memory_bytes + other.memory_bytes,
                      self.jobs + other.jobs, self.processes + other.processes)

    def __sub__(self, other: Demand) -> Demand:
        return Demand(self.gpus - other.gpus, self.cpu - other.cpu, self.memory_bytes - other.memory_bytes,
                      self.jobs - other.jobs, self.processes - other.processes)


@dataclass(frozen=True)
class Quota:
    """Limits of a tenant (or, with `max_processes`, of a backend); None is unlimited."""

    gpus: int | None = None
    cpu: float | None = None
    memory_bytes: int | None = None
    max_running_jobs: int | None = None
    max_processes: int | None = None

    @classmethod
    def of(cls, amounts: Mapping[str, Any]) -> Quota:
        """The limits admission enforces of a tenant's quota (kembed_contract.quota.QuotaSpec.amounts(), or its
        columns): the dimensions running jobs hold; the others (max_queued_jobs) are checked at submission."""
        return cls(**{name: amounts[name] for name in ("gpus", "cpu", "memory_bytes", "max_running_jobs")})

    @cached_property
    def limits(self) -> tuple[tuple[str, float, str], ...]:
        """(Demand field, limit, unit) of each limit that is set; computed once (forecasts check thousands)."""
        every = (("gpus", self.gpus, "GPUs"), ("cpu", self.cpu, "CPU cores"),
                 ("memory_bytes", self.memory_bytes, "bytes of memory"),
                 ("jobs", self.max_running_jobs, "running jobs"), ("processes", self.max_processes, "trainer processes"))
        return tuple((field, limit, unit) for field, limit, unit in every if limit is not None)


_QUOTA_FIELD = {"gpus": "gpus", "cpu": "cpu", "memory_bytes": "memory_bytes", "jobs": "max_running_jobs",
                "processes": "max_processes"}


def shortfall(quota: Quota, *, used: Demand, demand: Demand) -> str | None:
    """None if `demand` fits beside `used`; else which limit it would break, in words."""
    for field, limit, unit in quota.limits:
        if getattr(used, field) + getattr(demand, field) > limit + 1e-9:
            return (f"quota.{_QUOTA_FIELD[field]}: needs {getattr(demand, field):g} {unit}, "
                    f"{max(0, limit - getattr(used, field)):g} of {limit:g} free")
    return None


def never_fits(quota: Quota, demand: Demand, *, ceiling: str = "the tenant's quota") -> str | None:
    """Why a job could not run even on an idle tenant (then it must be refused, not queued forever); `ceiling`
    names what `quota` is in the answer."""
    for field, limit, unit in quota.limits:
        if field not in ("jobs", "processes") and getattr(demand, field) > limit + 1e-9:
            return (f"the job needs {getattr(demand, field):g} {unit} but {ceiling} "
                    f"(quota.{_QUOTA_FIELD[field]}) is {limit:g}")
    if quota.max_running_jobs == 0:
        return "the tenant's quota allows no running jobs (quota.max_running_jobs is 0)"
    return None


@dataclass(frozen=True)
class RunningJob:
    demand: Demand
    ends_at: datetime | None  # None: cannot be estimated yet
    own: bool = True  # the tenant's own job (counts against its quota), or another tenant's (only capacity)


def estimate_start_times(
    *,
    quota: Quota,
    capacity: Quota,
    running: list[RunningJob],
    queued: Iterable[tuple[Demand, timedelta | None]],
    now: datetime,
) -> list[datetime]:
    """When the head of a tenant's queue (in admission order) is expected to start, by replaying the queue.

    Running jobs free their share when they are expected to end; a queued job starts when it fits both the
    tenant's quota and the backend's capacity, and is then expected to run for its estimated duration. Where an
    estimate depends on a duration nobody can know yet, the replay stops: that job and every job behind it get
    no estimate (an honest "unknown" beats a made-up time), so the list returned may be shorter than the queue,
    and `queued` is read no further than needed. Other tenants' queued jobs are not replayed (they may take
    capacity first). O(n log n) in the number of jobs: totals are kept as jobs come and go, ends are a heap.
    """
    tiebreak = itertools.count()
    ends: list[tuple[datetime, int, Demand, bool]] = []  # (end, tie-breaker, demand, own) of jobs whose end is known
    own, everyone = Demand(), Demand()
    for job in running:
        own, everyone = (own + job.demand if job.own else own), everyone + job.demand
        if job.ends_at is not None:
            heapq.heappush(ends, (job.ends_at, next(tiebreak), job.demand, job.own))

    clock, starts = now, []
    for demand, duration in queued:
        while shortfall(quota, used=own, demand=demand) or shortfall(capacity, used=everyone, demand=demand):
            if not ends:  # only jobs of unknown duration hold what this one needs
                return starts
            ended_at, _, ended, ended_own = heapq.heappop(ends)
            clock = max(clock, ended_at)
            own, everyone = (own - ended if ended_own else own), everyone - ended
        starts.append(clock)
        own, everyone = own + demand, everyone + demand
        if duration is not None:
            heapq.heappush(ends, (clock + duration, next(tiebreak), demand, True))
    return starts
