"""The sizes of elastic jobs: at what size one is admitted, and which running ones grow into idle capacity (pure).

An elastic job (`resources.nodes` given as a range) may hold any whole number of nodes between its minimum and
its maximum; what it holds at each size is its demand per node times its nodes (`Demand.resized`). The rules are
documented in kembed_api.quota.preemption, whose `decide` calls these; docs/api.md says them for users.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kembed_api.quota.admission import Demand, Quota
from kembed_api.quota.books import Books

if TYPE_CHECKING:
    from kembed_api.quota.preemption import Pending, Running

__all__ = ["Elastic", "demand_at", "fair_growth", "grows_by", "largest_size", "least_demand"]


@dataclass(frozen=True)
class Elastic:
    """What makes a job elastic: the size its `demand` is given at, and the range it may be resized within."""

    nodes: int  # the size the job's `demand` is given at (a running job's: its size now)
    min_nodes: int
    max_nodes: int

    def __post_init__(self) -> None:
        assert 1 <= self.min_nodes <= self.max_nodes, "a size range runs from at least one node up"


def demand_at(job: Pending | Running, nodes: int) -> Demand:
    """What `job` holds at `nodes` nodes (a rigid job has one size: its demand)."""
    return job.demand if job.elastic is None else job.demand.resized(job.elastic.nodes, nodes)


def least_demand(job: Pending) -> Demand:
    """What a queued job needs to start: all of it when rigid, its minimum when elastic."""
    return job.demand if job.elastic is None else demand_at(job, job.elastic.min_nodes)


def grows_by(job: Pending | Running, nodes: int) -> Demand:
    """What `job` holds more at `nodes + 1` nodes than at `nodes` (a count of jobs does not grow)."""
    return demand_at(job, nodes + 1) - demand_at(job, nodes)


def _leaves_owed(books: Books, tenant: Hashable, more: Demand, owed: Sequence[Pending]) -> bool:
    """Whether `tenant` may take `more` without taking what any of the waiting jobs `owed` needs to start."""
    return all(books.leaves_room(tenant, more, for_tenant=w.tenant, needs=least_demand(w)) for w in owed)


def largest_size(books: Books, job: Pending, *, start: int, may_borrow: bool, owed: Sequence[Pending]) -> int:
    """The size a queued elastic job starts at, from `start` (which fits; the job is not in `books`): one node
    more at a time while the node fits as a job would (`may_borrow` as the sweep's) and takes nothing the waiting
    jobs of higher or equal standing (`owed`) need to start."""
    assert job.elastic is not None
    nodes, held = start, demand_at(job, start)
    while nodes < job.elastic.max_nodes:
        step = grows_by(job, nodes)
        if (books.why_not(job.tenant, held + step, may_borrow=may_borrow) is not None
                or not _leaves_owed(books, job.tenant, held + step, owed)):
            break
        nodes, held = nodes + 1, held + step
    return nodes


def _share_used(books: Books, tenant: Hashable) -> float:
    """How much of its fair share a tenant holds: the largest fraction of its nominal quota (or, where that is
    unlimited, of the capacity) it holds in any dimension (its dominant share, as in DRF)."""
    nominal, used = books.shares[tenant].nominal, books.by_tenant[tenant]
    fractions = [0.0]
    for field, value in zip(Demand._fields, used, strict=True):
        limit = _limit(nominal, field)
        if limit is None:
            limit = _limit(books.capacity, field)
        if limit:
            fractions.append(value / limit)
    return max(fractions)


def _limit(quota: Quota, demand_field: str) -> float | None:
    return next((limit for field, limit, *_ in quota.limits if field == demand_field), None)


def fair_growth(books: Books, candidates: Iterable[Running]) -> dict[Hashable, int]:
    """Grows running elastic jobs into what the pass left, one node at a time, and returns the new sizes.

    Each node goes to the tenant holding the smallest fraction of its fair share (its nominal quota); within a
    tenant to its highest-priority job, then its smallest, then its oldest. A node is taken only where it fits as
    a job admitted would (capacity, nominal quota, borrowing limit, cohort). The queue has had its turn: what is
    left, no waiting job can start with; a node grown into is lent, and goes back to a waiting job that needs it
    (kembed_api.quota.preemption: `QueueFirst`)."""
    sizes = {job.key: job.elastic.nodes for job in candidates if job.elastic is not None}
    growing = {job.key: job for job in candidates if job.key in sizes}
    while True:
        choice = None
        for job in growing.values():
            nodes = sizes[job.key]
            if nodes >= job.elastic.max_nodes:
                continue
            rank = (_share_used(books, job.tenant), -job.priority, nodes, _order(job))
            if choice is not None and rank >= choice[0]:
                continue
            step = grows_by(job, nodes)
            if books.why_not(job.tenant, step, may_borrow=True) is None:
                choice = (rank, job, step)
        if choice is None:
            break
        _, job, step = choice
        books.add(job.tenant, step)
        sizes[job.key] += 1
    return {key: nodes for key, nodes in sizes.items() if nodes != growing[key].elastic.nodes}


def _order(job: Running) -> tuple[int, str]:
    """Older jobs first among equals (their keys sort earlier when they are sequence numbers)."""
    return (job.key, "") if isinstance(job.key, int) else (0, str(job.key))
