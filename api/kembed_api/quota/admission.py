"""Quota arithmetic and queue forecasts: pure functions, no I/O, cheap to test.

Admission is all-or-nothing (a gang): a job is admitted only when everything it asks for fits in what its
tenant has left, in every dimension at once.

Its dimensions are the quota model's that running jobs hold (kembed_contract.quota.QuotaSpec.held(): a `Demand`
field named like the dimension's usage, a `Quota` field named like its amount), plus one of the backend's own,
trainer processes (the local backend's slots). Both types are generated from that list, never restated here.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
import operator
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import cached_property
from typing import Any, NamedTuple

from kembed_contract.quota import QuotaSpec, add_limits
from kembed_contract.spec import JobSpec, Resources

__all__ = ["DIMENSIONS", "Demand", "Quota", "RunningJob", "estimate_start_times", "never_fits", "shortfall"]


class _Dimension(NamedTuple):
    demand: str  # its Demand field (the quota model's usage name)
    limit: str  # its Quota field (the quota model's amount name)
    name: str  # the field people set (QuotaSpec's), as messages name it: `quota.memory`
    unit: str  # what follows a number of it, in words
    in_words: Callable[[float], str]  # an amount of it with its unit: `8 GPUs`, `1.50 GiB of memory`
    number: Callable[[float], str]  # an amount of it alone: `8`, `1.50 GiB`
    per_job: Callable[[Resources], float] | None  # what one job holds; None: one (it counts jobs)
    of_quota: bool  # a dimension of the tenant's quota (else the backend's)
    whole: bool  # amounts of it are whole numbers


# Admission's dimensions, in order: the quota model's held ones, then the backend's trainer processes.
DIMENSIONS: tuple[_Dimension, ...] = (
    *(_Dimension(d.used, d.amount, d.field, d.unit, d.in_words, d.number, d.held.per_job, True, d.whole)
      for d in QuotaSpec.held()),
    _Dimension("processes", "max_processes", "max_processes", "trainer processes",
               lambda v: f"{v:g} trainer processes", "{:g}".format, lambda r: r.num_processes, False, True),
)
_ADD, _SUB = operator.add, operator.sub
_PER_NODE = tuple(d.per_job is not None for d in DIMENSIONS)


def _scaled(value: float, nodes: int, to: int) -> float:
    """`value` held at `nodes` nodes, at `to` nodes; whole numbers stay whole where they divide."""
    if isinstance(value, int) and value * to % nodes == 0:
        return value * to // nodes
    return value * to / nodes


class Demand(collections.namedtuple("_Amounts", [d.demand for d in DIMENSIONS], defaults=(0,) * len(DIMENSIONS))):
    """What a job (or a set of jobs) holds while admitted: a number per dimension (a tuple, cheap to add: queue
    forecasts add thousands of these per read)."""

    __slots__ = ()

    @classmethod
    def of(cls, spec: JobSpec) -> Demand:
        r = spec.resources
        return cls._make(1 if d.per_job is None else d.per_job(r) for d in DIMENSIONS)

    def __add__(self, other: Demand) -> Demand:  # type: ignore[override]
        return self._make(map(_ADD, self, other))

    def __sub__(self, other: Demand) -> Demand:
        return self._make(map(_SUB, self, other))

    def resized(self, nodes: int, to: int) -> Demand:
        """What the same job holds at `to` nodes instead of `nodes` (an elastic job's other sizes): every amount
        is per node times nodes (the quota model's `per_job`), a count of jobs stays one."""
        return self._make(value if not per_node or to == nodes else _scaled(value, nodes, to)
                          for value, per_node in zip(self, _PER_NODE, strict=True))


class _Limits:
    """What a Quota can do, whatever its dimensions (its fields are generated below)."""

    @cached_property
    def limits(self) -> tuple[tuple[str, float, _Dimension, str], ...]:
        """(Demand field, limit, dimension, the field people set) of each limit that is set; computed once (forecasts check
        thousands)."""
        return tuple((d.demand, limit, d, d.name) for d in DIMENSIONS
                     if (limit := getattr(self, d.limit)) is not None)

    @classmethod
    def of(cls, amounts: Mapping[str, Any]) -> Quota:
        """The limits admission enforces of a tenant's quota (kembed_contract.quota.QuotaSpec.amounts(), or its
        columns): the dimensions running jobs hold; the others (max_queued_jobs, ...) are checked elsewhere."""
        return cls(**{d.limit: amounts[d.limit] for d in DIMENSIONS if d.of_quota})

    @classmethod
    def nothing(cls) -> Quota:
        """Limits of zero in every dimension (where a sum of quotas starts)."""
        return cls(**{d.limit: 0 for d in DIMENSIONS})

    def plus(self, other: Quota) -> Quota:
        """Limits added field by field (unlimited stays unlimited)."""
        return type(self)(**add_limits(dataclasses.asdict(self), dataclasses.asdict(other)))


Quota = dataclasses.make_dataclass(
    "Quota", [(d.limit, float | None, dataclasses.field(default=None)) for d in DIMENSIONS], bases=(_Limits,),
    frozen=True, namespace={"__module__": __name__,
                            "__doc__": "Limits of a tenant (or, with `max_processes`, of a backend); None is unlimited."},
)


def shortfall(quota: Quota, *, used: Demand, demand: Demand) -> str | None:
    """None if `demand` fits beside `used`; else which limit it would break, in words."""
    for field, limit, d, name in quota.limits:
        if getattr(used, field) + getattr(demand, field) > limit + 1e-9:
            return (f"quota.{name}: needs {d.in_words(getattr(demand, field))}, "
                    f"{d.number(max(0, limit - getattr(used, field)))} of {d.number(limit)} free")
    return None


# What no idle tenant can lack: a job's own size in each dimension of the tenant's quota that is an amount (a
# count of jobs is never exceeded by one job, unless it is zero).
_SIZED = {d.demand for d in DIMENSIONS if d.of_quota and d.per_job is not None}
_COUNTED = tuple(d for d in DIMENSIONS if d.of_quota and d.per_job is None)


def never_fits(quota: Quota, demand: Demand, *, ceiling: str = "the tenant's quota") -> str | None:
    """Why a job could not run even on an idle tenant (then it must be refused, not queued forever); `ceiling`
    names what `quota` is in the answer."""
    for field, limit, d, name in quota.limits:
        if field in _SIZED and getattr(demand, field) > limit + 1e-9:
            return f"the job needs {d.in_words(getattr(demand, field))} but {ceiling} (quota.{name}) is {d.number(limit)}"
    for d in _COUNTED:
        if getattr(quota, d.limit) == 0:
            return f"the tenant's quota allows no {d.unit} (quota.{d.limit} is 0)"
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
