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
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from kembed_api.quota.admission import Demand, Quota, shortfall

__all__ = ["Admit", "Pending", "Plan", "Preempt", "Running", "Share", "Wait", "decide"]


@dataclass(frozen=True)
class Share:
    """A tenant's place in admission."""

    nominal: Quota  # guaranteed: what it may always use (None fields: unlimited)
    cohort: str | None = None  # tenants of one cohort lend each other what they leave idle
    borrowing_limit: Quota = dataclasses.field(default_factory=Quota)  # at most this much above nominal


@dataclass(frozen=True)
class Running:
    """A job that holds resources: admitted, running, restarting, or preempted and still saving (`stopping`)."""

    key: Hashable
    tenant: Hashable
    demand: Demand
    priority: int  # its priority class's value
    work_at_risk: float = 0.0  # e.g. GPU-seconds since its last complete checkpoint (lost if it were killed)
    stopping: bool = False  # asked to save and stop: what it holds is on its way back
    protected: bool = False  # preempted too often lately: never a victim


@dataclass(frozen=True)
class Pending:
    key: Hashable
    tenant: Hashable
    demand: Demand
    priority: int


@dataclass(frozen=True)
class Admit:
    key: Hashable
    borrowed: bool  # it holds some of its cohort's idle quota beyond its tenant's nominal


@dataclass(frozen=True)
class Preempt:
    victim: Hashable
    preemptor: Hashable
    reason: str  # ReclaimedByLender (its tenant's lender takes back what it lent) | HigherPriority


@dataclass(frozen=True)
class Wait:
    key: Hashable
    reason: str  # in words, naming the limit


@dataclass
class Plan:
    admit: list[Admit] = dataclasses.field(default_factory=list)
    preempt: list[Preempt] = dataclasses.field(default_factory=list)
    wait: list[Wait] = dataclasses.field(default_factory=list)


def _exceeds(quota: Quota, used: Demand) -> bool:
    """Whether `used` is over `quota` in any dimension."""
    return shortfall(quota, used=used, demand=Demand()) is not None


class _Books:
    """What each tenant and cohort holds during one pass."""

    def __init__(self, shares: dict[Hashable, Share], capacity: Quota, running: Sequence[Running]) -> None:
        self.shares, self.capacity = shares, capacity
        self.by_tenant: dict[Hashable, Demand] = defaultdict(Demand)
        self.by_cohort: dict[str, Demand] = defaultdict(Demand)
        self.everywhere = Demand()
        self.pool: dict[str, Quota] = {}
        for share in shares.values():
            if share.cohort is not None:
                self.pool[share.cohort] = self.pool.get(share.cohort, Quota.nothing()).plus(share.nominal)
        for job in running:
            self.add(job.tenant, job.demand)

    def add(self, tenant: Hashable, demand: Demand, sign: int = 1) -> None:
        change = demand if sign > 0 else Demand() - demand
        self.by_tenant[tenant] += change
        self.everywhere += change
        cohort = self.shares[tenant].cohort
        if cohort is not None:
            self.by_cohort[cohort] += change

    def borrowing(self, tenant: Hashable) -> bool:
        return _exceeds(self.shares[tenant].nominal, self.by_tenant[tenant])

    def why_not(self, tenant: Hashable, demand: Demand, *, may_borrow: bool) -> str | None:
        """None if `demand` fits now (within nominal, or borrowing when allowed); else why not, in words."""
        why = shortfall(self.capacity, used=self.everywhere, demand=demand)
        if why:
            return why
        share, used = self.shares[tenant], self.by_tenant[tenant]
        within = shortfall(share.nominal, used=used, demand=demand)
        if share.cohort is None or (within is not None and not may_borrow):
            return within
        if within is not None:
            beyond = shortfall(share.nominal.plus(share.borrowing_limit), used=used, demand=demand)
            if beyond:
                return f"borrowing limit: {beyond}"
        # The cohort never holds more than its members' nominal quotas together: what one member is owed may be
        # lent out now, and is then reclaimed first.
        pooled = shortfall(self.pool[share.cohort], used=self.by_cohort[share.cohort], demand=demand)
        return f"cohort {share.cohort}: {pooled}" if pooled else None


def decide(
    *,
    shares: dict[Hashable, Share],
    capacity: Quota,
    running: Sequence[Running],
    queue: Iterable[Pending],
    waiting_tenants: set[Hashable] | None = None,
    preemption: bool = True,
) -> Plan:
    """One admission pass. `queue` in admission order (priority, then submission); within a tenant the head is
    never overtaken. Jobs that fit within their tenant's nominal quota go first (a sweep that may reclaim lent
    quota), then the rest may borrow (a second sweep). `queue` is read lazily, and a sweep stops reading once
    every tenant of `waiting_tenants` (those with jobs queued) has its head blocked: a long queue that cannot
    move costs a pass its first few pages, not the whole queue."""
    books = _Books(shares, capacity, running)
    plan = Plan()
    queue = _Lazy(queue)
    victims_of: dict[Hashable, Running] = {job.key: job for job in running}
    freeing: dict[Hashable, Demand] = defaultdict(Demand)  # by tenant: what stopping jobs will give back
    for job in running:
        if job.stopping:
            freeing[job.tenant] += job.demand
    waiting: dict[Hashable, str] = {}
    decided: set[Hashable] = set()
    held: set[Hashable] = set()  # tenants whose head waits for its victims: nothing of theirs overtakes it
    for may_borrow in (False, True):
        blocked = set(held)
        for pending in queue:
            if pending.key in decided or pending.tenant in blocked:
                continue
            why = books.why_not(pending.tenant, pending.demand, may_borrow=may_borrow)
            if why is None:
                borrowed = (shares[pending.tenant].cohort is not None
                            and _exceeds(shares[pending.tenant].nominal,
                                         books.by_tenant[pending.tenant] + pending.demand))
                books.add(pending.tenant, pending.demand)
                plan.admit.append(Admit(pending.key, borrowed))
                decided.add(pending.key)
                waiting.pop(pending.key, None)
                continue
            blocked.add(pending.tenant)
            chosen = None
            if not _fits_once_freed(books, freeing, pending, may_borrow=may_borrow) and preemption:
                chosen = _victims(books, victims_of, freeing, pending, may_borrow=may_borrow)
                for victim, reason in chosen or ():
                    plan.preempt.append(Preempt(victim.key, pending.key, reason))
                    victims_of[victim.key] = dataclasses.replace(victim, stopping=True)
                    freeing[victim.tenant] += victim.demand
            if chosen or (chosen is None and _fits_once_freed(books, freeing, pending, may_borrow=may_borrow)):
                # Its victims (or others') are still saving: what they free is reserved for it, nobody else
                # is chosen, and nothing of its tenant's queue overtakes it.
                books.add(pending.tenant, pending.demand)
                decided.add(pending.key)
                held.add(pending.tenant)
                waiting[pending.key] = "preempted jobs to save their checkpoint and stop"
            else:
                waiting[pending.key] = why
            if waiting_tenants is not None and waiting_tenants <= blocked:
                break  # every tenant with jobs queued waits: reading further admits nothing
    plan.wait = [Wait(key, reason) for key, reason in waiting.items()]
    return plan


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


def _fits_once_freed(books: _Books, freeing: dict[Hashable, Demand], pending: Pending, *, may_borrow: bool) -> bool:
    if not any(d != Demand() for d in freeing.values()):
        return False
    for tenant, demand in freeing.items():
        books.add(tenant, demand, -1)
    try:
        return books.why_not(pending.tenant, pending.demand, may_borrow=may_borrow) is None
    finally:
        for tenant, demand in freeing.items():
            books.add(tenant, demand)


def _victims(books: _Books, running: dict[Hashable, Running], freeing: dict[Hashable, Demand], pending: Pending,
             *, may_borrow: bool) -> list[tuple[Running, str]] | None:
    """The fewest jobs whose preemption lets `pending` start (with what is already being freed), or None."""
    share = books.shares[pending.tenant]
    # Does it have a right to reclaim: would it fit within its tenant's nominal quota with its own usage?
    reclaims = shortfall(share.nominal, used=books.by_tenant[pending.tenant], demand=pending.demand) is None
    candidates: list[tuple[Running, str]] = []
    for job in running.values():
        if job.stopping:
            continue
        if job.tenant == pending.tenant:
            if job.priority < pending.priority and not job.protected:
                candidates.append((job, "HigherPriority"))
        elif share.cohort is not None and books.shares[job.tenant].cohort == share.cohort:
            if reclaims:  # a guarantee is kept even against a protected borrower: no cycle can follow
                candidates.append((job, "ReclaimedByLender"))
            elif may_borrow and job.priority < pending.priority and not job.protected:
                candidates.append((job, "HigherPriority"))
    if not candidates:
        return None
    candidates.sort(key=lambda c: (c[0].priority, c[0].work_at_risk, -_order(c[0])))
    for tenant, demand in freeing.items():
        books.add(tenant, demand, -1)
    chosen: list[tuple[Running, str]] = []
    try:
        for job, reason in candidates:
            if books.why_not(pending.tenant, pending.demand, may_borrow=may_borrow) is None:
                break
            if job.tenant != pending.tenant and not books.borrowing(job.tenant):
                continue  # what its tenant holds now is within its own nominal quota: never another's to take
            books.add(job.tenant, job.demand, -1)
            chosen.append((job, reason))
        if books.why_not(pending.tenant, pending.demand, may_borrow=may_borrow) is not None:
            return None  # even all of them would not make room: preempt nobody
        for job, reason in reversed(list(chosen)):  # spare every victim not needed after all
            books.add(job.tenant, job.demand)
            if books.why_not(pending.tenant, pending.demand, may_borrow=may_borrow) is None:
                chosen.remove((job, reason))
            else:
                books.add(job.tenant, job.demand, -1)
        return chosen
    finally:
        for job, _ in chosen:
            books.add(job.tenant, job.demand)
        for tenant, demand in freeing.items():
            books.add(tenant, demand)


def _order(job: Running) -> int:
    """Newer jobs first among equals (their keys sort later when they are sequence numbers)."""
    return job.key if isinstance(job.key, int) else 0
