"""Who starts, who waits and who is preempted: the admission core over cohorts and priority classes (pure).

One pass looks at every tenant's share, the jobs holding resources and the queue in admission order, and
decides; the dispatcher carries the decisions out, and benchmarks/preemption_sim.py replays a week of jobs
through the very same function with a simulated clock.

The model (Kueue's ClusterQueue and cohort, in kembed's words):
- Each tenant has a nominal quota: its guaranteed share. A tenant in a cohort may also borrow what the other
  members of its cohort leave idle, up to its borrowing limit; what it borrows, they lend. A cohort never holds
  more than the sum of its members' nominal quotas; a tenant in no cohort has its nominal quota and no more.
- Priority classes (the platform admin's, each tenant may use classes up to its limit) rank jobs for
  preemption; within a tenant's queue, higher priority is also admitted first.
- A queued job with a right to resources that cannot start may preempt (never more than needed):
    * its own tenant's jobs of a lower priority class;
    * other cohort members' jobs while they borrow: any of them when the job fits within its own tenant's
      nominal quota (the lender reclaims), only those of a lower priority class when it would borrow itself.
  A member never loses what it holds within its own nominal quota to another tenant.
- Victims are chosen lowest priority first, then least work at risk (since their last complete checkpoint),
  then newest; then every victim not needed after all is spared again.
- Never thrashing: a job preempted `protect_after` times within the window is protected from preemption for a
  higher priority class. A lender reclaiming what it lent still takes it back (the guarantee holds): a lender
  within its nominal quota is never preempted by another tenant, so reclaims cannot go round in a cycle.
  Never stuck: a job whose victims are still saving waits for them (and no further victims are chosen);
  what they free is reserved for it; every waiting job gets its reason.

Elastic jobs (a size range in nodes, `Elastic`; a rigid gang is decided exactly as above):
- Admission: an elastic job starts when its minimum fits (as a gang of that size would), at the largest size of
  its range that fits and leaves the head of every queue ahead of it (higher or equal standing) what it needs to
  start. A queued elastic job takes from others only for its minimum.
- Growth: the queue has its turn first; what the pass leaves (no waiting job can start with it) goes to running
  elastic jobs below their maximum, a node at a time, each where it fits as an admitted job would (capacity,
  nominal quota, borrowing limit, cohort): to the tenant holding the smallest fraction of its nominal quota
  (its dominant share), within it to the highest-priority, then smallest, then oldest job. A job grows only
  `RESIZE_COOLDOWN_S` after its last start or resize, so that nothing thrashes.
- What a job grew by is lent by the queue: a waiting job of no lower priority that needs it takes it back
  (`QueueFirst`), before anyone is shrunk or preempted for it, and only what it needs, under the rules of
  borrowing (what a tenant holds within its nominal quota stays its own).
- Shrink before preempting: victims are chosen in the same order as preemption's, but first every candidate
  above its minimum gives back nodes, one at a time, only while they are needed; only then are jobs preempted
  whole (an elastic one's minimum too); then every node and job not needed after all is given back. A shrunk
  job saves at a step boundary and restarts smaller (`Resize`); what it gives back is reserved for the job it
  makes room for. A resize spends no restart, and a job is never below its minimum nor above its maximum.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from kembed_api.quota import elastic
from kembed_api.quota.admission import Demand, Quota, shortfall
from kembed_api.quota.books import Books, Share
from kembed_api.quota.elastic import Elastic, demand_at, least_demand

__all__ = ["RESIZE_COOLDOWN_S", "Admit", "Elastic", "Pending", "Plan", "Preempt", "Resize", "Running", "Share",
           "Wait", "decide"]

# How long a job runs at a size before it may grow again: a resize costs its save, restart and load
# (docs/benchmarks.md, "Elastic jobs over the same week"), and a job grown at every pass would train little.
RESIZE_COOLDOWN_S = 1800.0


@dataclass(frozen=True)
class Running:
    """A job that holds resources: admitted, running, restarting, or preempted and still saving (`stopping`)."""

    key: Hashable
    tenant: Hashable
    demand: Demand  # what it holds now (an elastic job: at its size now, `elastic.nodes`)
    priority: int  # its priority class's value
    work_at_risk: float = 0.0  # e.g. GPU-seconds since its last complete checkpoint (lost if it were killed)
    stopping: bool = False  # asked to save and stop: what it holds is on its way back
    protected: bool = False  # preempted too often lately: never a victim
    elastic: Elastic | None = None  # its size range; None: a rigid gang
    shrinking_to: int | None = None  # asked to save and restart at this many nodes: the rest is on its way back
    # When it last started at its size now (admitted or resized), on `now`'s clock; None: it may grow at once.
    resized_at: float | None = None
    # The size it was admitted at, or shrunk to since: the nodes it grew by beyond it are lent by the queue and go
    # back to any waiting job that needs them (None: its size now, nothing lent).
    base_nodes: int | None = None


@dataclass(frozen=True)
class Pending:
    key: Hashable
    tenant: Hashable
    demand: Demand  # what it asks for (an elastic job: at `elastic.nodes`, any size of its range)
    priority: int
    elastic: Elastic | None = None  # its size range; None: a rigid gang


@dataclass(frozen=True)
class Admit:
    key: Hashable
    borrowed: bool  # it holds some of its cohort's idle quota beyond its tenant's nominal
    nodes: int | None = None  # an elastic job: the size it starts at


@dataclass(frozen=True)
class Preempt:
    victim: Hashable
    preemptor: Hashable
    reason: str  # ReclaimedByLender (its tenant's lender takes back what it lent) | HigherPriority


@dataclass(frozen=True)
class Resize:
    """A running elastic job saves at a step boundary, restarts at `nodes` and resumes (no restart is spent)."""

    key: Hashable
    nodes: int  # its new size
    # Grown: IdleCapacity. Shrunk to make room for `preemptor`: ReclaimedByLender | HigherPriority, as a
    # preemption, or QueueFirst (it gives back nodes it grew by).
    reason: str
    preemptor: Hashable | None = None


@dataclass(frozen=True)
class Wait:
    key: Hashable
    reason: str  # in words, naming the limit


@dataclass
class Plan:
    admit: list[Admit] = dataclasses.field(default_factory=list)
    preempt: list[Preempt] = dataclasses.field(default_factory=list)
    resize: list[Resize] = dataclasses.field(default_factory=list)
    wait: list[Wait] = dataclasses.field(default_factory=list)


def decide(
    *,
    shares: dict[Hashable, Share],
    capacity: Quota,
    running: Sequence[Running],
    queue: Iterable[Pending],
    waiting_tenants: set[Hashable] | None = None,
    preemption: bool = True,
    now: float = 0.0,
    resize_cooldown_s: float = RESIZE_COOLDOWN_S,
) -> Plan:
    """One admission pass. `queue` in admission order (priority, then submission); within a tenant the head is
    never overtaken. Jobs that fit within their tenant's nominal quota go first (a sweep that may reclaim lent
    quota), then the rest may borrow (a second sweep); then running elastic jobs grow into what is left. `queue`
    is read lazily, and a sweep stops reading once every tenant of `waiting_tenants` (those with jobs queued) has
    its head blocked: a long queue that cannot move costs a pass its first few pages, not the whole queue.
    An elastic job sized in the first sweep may borrow more nodes once the second is done. `now` (seconds, on
    the clock of `Running.resized_at`) and `resize_cooldown_s` say which running elastic jobs may grow; without
    `preemption` nothing grows (nothing lent could be taken back)."""
    books = Books(shares, capacity, ((job.tenant, job.demand) for job in running))
    plan = Plan()
    queue = _Lazy(queue)
    victims_of: dict[Hashable, Running] = {job.key: job for job in running}
    freeing: dict[Hashable, Demand] = defaultdict(Demand)  # by tenant: what stopping or shrinking jobs give back
    for job in running:
        if job.stopping:
            freeing[job.tenant] += job.demand
        elif job.shrinking_to is not None:
            freeing[job.tenant] += job.demand - demand_at(job, job.shrinking_to)
    waiting: dict[Hashable, str] = {}
    unserved: dict[Hashable, tuple[int, Pending]] = {}  # waiting with nothing reserved: (place in the queue, job)
    decided: set[Hashable] = set()
    held: set[Hashable] = set()  # tenants whose head waits for its victims: nothing of theirs overtakes it
    within_nominal: list[tuple[int, int, Pending]] = []  # elastic jobs the first sweep sized: (admit, place, job)
    for may_borrow in (False, True):
        blocked = set(held)
        for place, pending in enumerate(queue):
            if pending.key in decided or pending.tenant in blocked:
                continue
            needs = least_demand(pending)
            why = books.why_not(pending.tenant, needs, may_borrow=may_borrow)
            if why is None:
                nodes = None
                if pending.elastic is not None:
                    nodes = _starting_size(books, pending, place, unserved, start=pending.elastic.min_nodes,
                                           may_borrow=may_borrow)
                    needs = demand_at(pending, nodes)
                    if not may_borrow:
                        within_nominal.append((len(plan.admit), place, pending))
                borrowed = books.would_borrow(pending.tenant, needs)
                books.add(pending.tenant, needs)
                plan.admit.append(Admit(pending.key, borrowed, nodes))
                decided.add(pending.key)
                waiting.pop(pending.key, None)
                unserved.pop(pending.key, None)
                continue
            blocked.add(pending.tenant)
            chosen = None
            if not _fits_once_freed(books, freeing, pending, may_borrow=may_borrow) and preemption:
                chosen = _victims(books, victims_of, freeing, pending, may_borrow=may_borrow)
                for victim, reason, nodes in chosen or ():
                    if nodes == 0:
                        plan.preempt.append(Preempt(victim.key, pending.key, reason))
                        victims_of[victim.key] = dataclasses.replace(victim, stopping=True)
                        freeing[victim.tenant] += victim.demand
                    else:
                        plan.resize.append(Resize(victim.key, nodes, reason, pending.key))
                        victims_of[victim.key] = dataclasses.replace(victim, shrinking_to=nodes)
                        freeing[victim.tenant] += victim.demand - demand_at(victim, nodes)
            if chosen or (chosen is None and _fits_once_freed(books, freeing, pending, may_borrow=may_borrow)):
                # Its victims (or others') are still saving: what they free is reserved for it, nobody else
                # is chosen, and nothing of its tenant's queue overtakes it. An elastic job waits for its minimum.
                books.add(pending.tenant, needs)
                decided.add(pending.key)
                held.add(pending.tenant)
                waiting[pending.key] = "preempted jobs to save their checkpoint and stop"
                unserved.pop(pending.key, None)
            else:
                waiting[pending.key] = why
                unserved[pending.key] = (place, pending)
            if waiting_tenants is not None and waiting_tenants <= blocked:
                break  # every tenant with jobs queued waits: reading further admits nothing
    for index, place, pending in within_nominal:  # now that borrowers had their turn, they may borrow too
        books.add(pending.tenant, demand_at(pending, plan.admit[index].nodes), -1)
        nodes = _starting_size(books, pending, place, unserved, start=plan.admit[index].nodes, may_borrow=True)
        plan.admit[index] = Admit(pending.key, books.would_borrow(pending.tenant, demand_at(pending, nodes)), nodes)
        books.add(pending.tenant, demand_at(pending, nodes))
    if preemption:  # what a job grows by is lent: it goes back by the same means as preemption
        plan.resize += _grown(books, victims_of, now=now, cooldown_s=resize_cooldown_s)
    plan.wait = [Wait(key, reason) for key, reason in waiting.items()]
    return plan


def _starting_size(books: Books, pending: Pending, place: int, unserved: dict[Hashable, tuple[int, Pending]], *,
                   start: int, may_borrow: bool) -> int:
    """The size an elastic job at `place` in the queue starts at (from `start`, which fits): what the heads of the
    queues ahead of it, of no lower priority, need to start is left to them."""
    owed = [w for w in _heads(unserved.values(), before=place) if w.priority >= pending.priority]
    return elastic.largest_size(books, pending, start=start, may_borrow=may_borrow, owed=owed)


def _grown(books: Books, running: dict[Hashable, Running], *, now: float, cooldown_s: float) -> list[Resize]:
    """What the pass left goes to running elastic jobs below their maximum whose last start or resize is at least
    `cooldown_s` old; `elastic.fair_growth` says who first. (A job admitted in this pass already starts at the
    largest size it may have.)"""
    candidates = [job for job in running.values()
                  if job.elastic is not None and not job.stopping and job.shrinking_to is None
                  and (job.resized_at is None or now - job.resized_at >= cooldown_s)]
    return [Resize(key, nodes, "IdleCapacity") for key, nodes in elastic.fair_growth(books, candidates).items()]


def _heads(unserved: Iterable[tuple[int, Pending]], *, before: int) -> list[Pending]:
    """The first job of each tenant's queue among those waiting with nothing reserved, placed before `before`:
    what an elastic job admitted at `before` leaves room for (a tenant's later jobs start after its head)."""
    heads: dict[Hashable, tuple[int, Pending]] = {}
    for place, job in unserved:
        if place < before and (job.tenant not in heads or place < heads[job.tenant][0]):
            heads[job.tenant] = (place, job)
    return [job for _, job in heads.values()]


class _Lazy:
    """An iterable read once, on demand, and remembered: each sweep starts from the beginning."""

    def __init__(self, items: Iterable[Pending]) -> None:
        self._items, self._seen = iter(items), []

    def __iter__(self):
        index = 0
        while True:
            if index == len(self._seen):
                try:
                    self._seen.append(next(self._items))
                except StopIteration:
                    return
            yield self._seen[index]
            index += 1


def _fits_once_freed(books: Books, freeing: dict[Hashable, Demand], pending: Pending, *, may_borrow: bool) -> bool:
    if not any(d != Demand() for d in freeing.values()):
        return False
    for tenant, demand in freeing.items():
        books.add(tenant, demand, -1)
    try:
        return books.why_not(pending.tenant, least_demand(pending), may_borrow=may_borrow) is None
    finally:
        for tenant, demand in freeing.items():
            books.add(tenant, demand)


def _victims(books: Books, running: dict[Hashable, Running], freeing: dict[Hashable, Demand], pending: Pending,
             *, may_borrow: bool) -> list[tuple[Running, str, int]] | None:
    """The least taken from running jobs that lets `pending` start (with what is already being freed), as
    (victim, reason, its size after: 0 when preempted entirely), or None. First the nodes elastic jobs of no
    higher priority grew by (the queue's loan, `QueueFirst`), then elastic victims above their minimum shrink, a
    node at a time; only then are jobs preempted whole; then every node and job not needed after all is given
    back."""
    share = books.shares[pending.tenant]
    needs = least_demand(pending)
    # Does it have a right to reclaim: would it fit within its tenant's nominal quota with its own usage?
    reclaims = shortfall(share.nominal, used=books.by_tenant[pending.tenant], demand=needs) is None
    candidates: list[tuple[Running, str]] = []
    loans: list[Running] = []
    for job in running.values():
        if job.stopping or job.shrinking_to is not None:
            continue
        shares_limits = job.tenant == pending.tenant or (
            share.cohort is not None and books.shares[job.tenant].cohort == share.cohort)
        if shares_limits and _base(job) < _size(job) and job.priority <= pending.priority:
            loans.append(job)
        if job.tenant == pending.tenant:
            if job.priority < pending.priority and not job.protected:
                candidates.append((job, "HigherPriority"))
        elif share.cohort is not None and books.shares[job.tenant].cohort == share.cohort:
            if reclaims:  # a guarantee is kept even against a protected borrower: no cycle can follow
                candidates.append((job, "ReclaimedByLender"))
            elif may_borrow and job.priority < pending.priority and not job.protected:
                candidates.append((job, "HigherPriority"))
    if not candidates and not loans:
        return None
    candidates.sort(key=lambda c: (c[0].priority, c[0].work_at_risk, -_order(c[0])))
    loans.sort(key=lambda job: (job.priority, job.work_at_risk, -_order(job)))

    def fits() -> bool:
        return books.why_not(pending.tenant, needs, may_borrow=may_borrow) is None

    def may_take(job: Running) -> bool:  # what its tenant holds within its own nominal quota is never another's
        return job.tenant == pending.tenant or books.borrowing(job.tenant)

    def resize(job: Running, nodes: int, to: int) -> None:  # moves what `job` holds in the books
        books.add(job.tenant, _held_at(job, nodes), -1)
        books.add(job.tenant, _held_at(job, to))

    def take(job: Running, reason: str) -> None:  # the latest taken from goes last (given back first)
        taken.pop(job.key, None)
        taken[job.key] = (job, reason)

    for tenant, demand in freeing.items():
        books.add(tenant, demand, -1)
    size = {job.key: _size(job) for job in [*loans, *(job for job, _ in candidates)]}
    taken: dict[Hashable, tuple[Running, str]] = {}
    try:
        shrinks = [*((job, "QueueFirst", _base(job)) for job in loans),
                   *((job, reason, job.elastic.min_nodes) for job, reason in candidates if job.elastic is not None)]
        for job, reason, floor in shrinks:  # loans first, then shrinks to the minimum
            while size[job.key] > floor and not fits() and may_take(job):
                resize(job, size[job.key], size[job.key] - 1)
                size[job.key] -= 1
                take(job, reason)
        for job, reason in candidates:  # then whole jobs
            if fits():
                break
            if may_take(job):
                resize(job, size[job.key], 0)
                size[job.key] = 0
                take(job, reason)
        if not fits():
            return None  # even all of them would not make room: take from nobody
        for job, _ in reversed(list(taken.values())):  # give back every node and job not needed after all
            while size[job.key] < _size(job):
                bigger = _grown_size(job, size[job.key])
                resize(job, size[job.key], bigger)
                if not fits():
                    resize(job, bigger, size[job.key])
                    break
                size[job.key] = bigger
        return [(job, reason, size[job.key]) for job, reason in taken.values() if size[job.key] != _size(job)]
    finally:
        for key, nodes in size.items():
            job = running[key]
            resize(job, nodes, _size(job))
        for tenant, demand in freeing.items():
            books.add(tenant, demand)


def _base(job: Running) -> int:
    """The size below which a job's nodes are its own, not lent by the queue."""
    if job.elastic is None:
        return 1
    return job.elastic.nodes if job.base_nodes is None else job.base_nodes


def _size(job: Running) -> int:
    """A job's size now in nodes (a rigid job's one size counts as 1: all of it)."""
    return 1 if job.elastic is None else job.elastic.nodes


def _held_at(job: Running, nodes: int) -> Demand:
    """What `job` holds at `nodes` (0: nothing, preempted)."""
    if nodes == 0:
        return Demand()
    return job.demand if job.elastic is None else demand_at(job, nodes)


def _grown_size(job: Running, nodes: int) -> int:
    """The next size up from `nodes` when giving back: from nothing to its minimum, then a node at a time."""
    if nodes == 0:
        return 1 if job.elastic is None else job.elastic.min_nodes
    return nodes + 1


def _order(job: Running) -> int:
    """Newer jobs first among equals (their keys sort later when they are sequence numbers)."""
    return job.key if isinstance(job.key, int) else 0
