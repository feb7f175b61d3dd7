"""What a job holds while it runs, as stored columns and as the admission core's Demand; what a tenant's jobs
hold together, as the sums one statement computes and as UsageAmounts. Every list of dimensions here is the
quota model's (kembed_contract.quota.QuotaSpec.held()), through admission.DIMENSIONS and Job's HELD_COLUMNS."""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter
from typing import Any

from sqlalchemy import func

from kembed_api.jobs.models import HELD_COLUMNS, Job
from kembed_api.quota.admission import DIMENSIONS, Demand
from kembed_contract.quota import QuotaSpec, UsageAmounts

__all__ = ["DEMAND_COLUMNS", "HELD_SUMS", "demand_columns", "demand_of_row", "describe", "no_usage",
           "usage_amounts"]

# What one job holds, as columns (in admission.DIMENSIONS' order, without those that count jobs): queries that sum
# or replay the queue read only these.
_STORED = tuple(d.demand for d in DIMENSIONS if d.per_job is not None)
DEMAND_COLUMNS = tuple(getattr(Job, name) for name in _STORED)
_read_stored = attrgetter(*_STORED)
_ONE_JOB = tuple(d.per_job is None for d in DIMENSIONS)
assert set(HELD_COLUMNS) <= set(_STORED), "every held column is one of admission's dimensions"


def demand_columns(demand: Demand) -> dict[str, Any]:
    """A job's Demand as the values of its columns (a new job's row)."""
    return {name: getattr(demand, name) for name in _STORED}


def demand_of_row(row: Any) -> Demand:
    """The Demand of a Job, or of a row that selected DEMAND_COLUMNS (by name)."""
    stored = iter(_read_stored(row))
    return Demand._make(1 if one else next(stored) for one in _ONE_JOB)


def describe(demand: Demand) -> str:
    """What a job holds, in words (its count of jobs left out: it is one)."""
    shown = {d.used: d.in_words(getattr(demand, d.used)) for d in QuotaSpec.held()
             if not d.counts_jobs and getattr(demand, d.used)}
    return ", ".join([*shown.values(), f"{demand.processes} trainer processes"])


# What a tenant's active jobs hold together, in QuotaSpec.held()'s order: a count of jobs or a sum of a column
# (an outer join's missing job counts nothing).
HELD_SUMS = tuple(func.count(Job.seq) if d.counts_jobs else func.coalesce(func.sum(getattr(Job, d.used)), 0)
                  for d in QuotaSpec.held())


def usage_amounts(sums: Sequence[Any]) -> UsageAmounts:
    """UsageAmounts of the values HELD_SUMS selected (or any numbers in that order)."""
    return UsageAmounts(**{d.used: (int if d.whole else float)(value or 0)
                           for d, value in zip(QuotaSpec.held(), sums, strict=True)})


def no_usage() -> UsageAmounts:
    return usage_amounts([0] * len(HELD_SUMS))
