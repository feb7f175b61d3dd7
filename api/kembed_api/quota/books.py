"""What each tenant and cohort holds during one admission pass, and what fits beside it (pure).

The admission core (kembed_api.quota.preemption) keeps these books while it admits, preempts, shrinks and grows
jobs within one pass; every rule of borrowing is here once, so that a node an elastic job grows by is checked
exactly as a job admitted would be.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from kembed_api.quota.admission import Demand, Quota, shortfall

__all__ = ["Books", "Share", "exceeds"]


@dataclass(frozen=True)
class Share:
    """A tenant's place in admission."""

    nominal: Quota  # guaranteed: what it may always use (None fields: unlimited)
    cohort: str | None = None  # tenants of one cohort lend each other what they leave idle
    borrowing_limit: Quota = dataclasses.field(default_factory=Quota)  # at most this much above nominal


def exceeds(quota: Quota, used: Demand) -> bool:
    """Whether `used` is over `quota` in any dimension."""
    return shortfall(quota, used=used, demand=Demand()) is not None


class Books:
    """What each tenant and cohort holds during one pass."""

    def __init__(self, shares: dict[Hashable, Share], capacity: Quota,
                 held: Iterable[tuple[Hashable, Demand]]) -> None:
        self.shares, self.capacity = shares, capacity
        self.by_tenant: dict[Hashable, Demand] = defaultdict(Demand)
        self.by_cohort: dict[str, Demand] = defaultdict(Demand)
        self.everywhere = Demand()
        self.pool: dict[str, Quota] = {}
        for share in shares.values():
            if share.cohort is not None:
                self.pool[share.cohort] = self.pool.get(share.cohort, Quota.nothing()).plus(share.nominal)
        for tenant, demand in held:
            self.add(tenant, demand)

    def add(self, tenant: Hashable, demand: Demand, sign: int = 1) -> None:
        change = demand if sign > 0 else Demand() - demand
        self.by_tenant[tenant] += change
        self.everywhere += change
        cohort = self.shares[tenant].cohort
        if cohort is not None:
            self.by_cohort[cohort] += change

    def borrowing(self, tenant: Hashable) -> bool:
        return exceeds(self.shares[tenant].nominal, self.by_tenant[tenant])

    def would_borrow(self, tenant: Hashable, demand: Demand) -> bool:
        """Whether holding `demand` more takes `tenant` beyond its nominal quota (into its cohort's idle quota)."""
        share = self.shares[tenant]
        return share.cohort is not None and exceeds(share.nominal, self.by_tenant[tenant] + demand)

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

    def leaves_room(self, tenant: Hashable, more: Demand, *, for_tenant: Hashable, needs: Demand) -> bool:
        """Whether `tenant` may take `more` and still leave `needs` for a job of `for_tenant` that waits, in every
        limit the two share: the capacity always, their cohort's pool if they share one, the tenant's own quota
        and borrowing limit if it is the same tenant. (A limit they do not share is the waiting job's own affair:
        taking `more` cannot make it wait longer for that one.)"""
        if shortfall(self.capacity, used=self.everywhere + more, demand=needs):
            return False
        share, theirs = self.shares[tenant], self.shares[for_tenant]
        if (share.cohort is not None and share.cohort == theirs.cohort
                and shortfall(self.pool[share.cohort], used=self.by_cohort[share.cohort] + more, demand=needs)):
            return False
        if tenant == for_tenant:
            ceiling = share.nominal if share.cohort is None else share.nominal.plus(share.borrowing_limit)
            if shortfall(ceiling, used=self.by_tenant[tenant] + more, demand=needs):
                return False
        return True
