"""The quota model, defined once: `QuotaSpec` is what a tenant may hold, with its bounds.

Everything else follows from it, generated rather than restated:
- the API's schema is this model (kembed_api.tenants.schemas re-exports it);
- the database's columns are `quota_<name>` for each field (`memory` is stored as `quota_memory_bytes`), typed
  by the `Stored` marker of the field (kembed_api.tenants.models builds them from `QuotaSpec.stored()`);
- the Tenant resource's `spec.quota` and its `spec.sharing.borrowing_limit` are this model (kembed_contract.crds
  generates the CRD schema from it), and the operator writes its ResourceQuota from it;
- the admission core's numbers are `QuotaSpec.amounts()`.
A new dimension (say GPU-hours per week) is a field here, with its `Stored` marker, a migration adding its
column, and the code that enforces it. Not every dimension is held by running jobs: `storage` is the bytes a
tenant keeps (checkpoints, logs; enforced by the trainer at save time and at submission, kembed_api.jobs.storage_use),
`max_run_seconds` the longest any one of its jobs may run (enforced by the API's dispatcher), `max_queued_jobs`
its queue (enforced at submission); admission's numbers (`kembed_api.quota.admission.Quota.of`) are the others.

A patch of a quota (`merged`) changes only the fields it sets; an explicit null clears one (unlimited).

Omitted or null means unlimited. The bounds are far above any real cluster, and counts fit the database's
32-bit integers.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kembed_contract.spec import MAX_RUN_SECONDS, QUANTITY_PATTERN, parse_quantity
from kembed_contract.trainer_config import NumbersOnly

__all__ = [
    "MAX_CPU", "MAX_GPUS", "MAX_JOBS", "MAX_MEMORY_BYTES", "MAX_RUN_SECONDS", "QuotaSpec", "SharingSpec", "Stored", "UsageAmounts",
    "cpu_quantity",
]

MAX_GPUS = 1_000_000
MAX_CPU = 100_000_000  # cores
MAX_MEMORY_BYTES = 2**62  # 4Ei
MAX_JOBS = 1_000_000  # running or queued at once


class Stored(enum.Enum):
    """How a dimension is kept in the database (the column's type follows from it)."""

    COUNT = "count"  # a whole number (32-bit)
    CORES = "cores"  # a real number of CPU cores
    BYTES = "bytes"  # a quantity ("256Gi") kept as a number of bytes (64-bit), in `quota_<name>_bytes`


_Jobs = Annotated[int, Field(ge=0, le=MAX_JOBS), NumbersOnly]


class QuotaSpec(BaseModel):
    """Limits of a tenant. Omitted or null means unlimited."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, json_schema_extra={
        "examples": [{"gpus": 16, "cpu": 64, "memory": "256Gi", "max_running_jobs": 4, "max_queued_jobs": 100,
                      "storage": "2Ti", "max_run_seconds": 86400}]})

    gpus: Annotated[Annotated[int, Field(ge=0, le=MAX_GPUS), NumbersOnly] | None, Stored.COUNT] = Field(
        None, description="GPUs all running jobs may hold together (nvidia.com/gpu).")
    cpu: Annotated[Annotated[float, Field(strict=True, ge=0, le=MAX_CPU)] | None, Stored.CORES] = Field(
        None, description="CPU cores all running jobs may hold.")
    memory: Annotated[Annotated[str, Field(max_length=32, pattern=QUANTITY_PATTERN)] | None, Stored.BYTES] = Field(
        None, description="Memory all running jobs may hold (a quantity, e.g. 256Gi).")
    max_running_jobs: Annotated[_Jobs | None, Stored.COUNT] = Field(
        None, description="Jobs admitted at once (enforced by the API's admission).")
    max_queued_jobs: Annotated[_Jobs | None, Stored.COUNT] = Field(
        None, description="Jobs waiting at once; a submission beyond it is refused with 429.")
    storage: Annotated[Annotated[str, Field(max_length=32, pattern=QUANTITY_PATTERN)] | None, Stored.BYTES] = Field(
        None, description="Bytes the tenant may keep stored (a quantity, e.g. 2Ti): its jobs' checkpoints and, on "
        "the local backend, their logs. A save that would pass it fails the job (StorageQuotaExceeded); a tenant "
        "over it cannot submit.")
    max_run_seconds: Annotated[Annotated[int, Field(ge=1, le=MAX_RUN_SECONDS), NumbersOnly] | None,
                               Stored.COUNT] = Field(
        None, description="The longest one job may run, in seconds spent running (its default and its ceiling: a "
        "job's own max_run_seconds may only be shorter); past it the job is stopped and fails (DeadlineExceeded).")

    @field_validator("cpu")
    @classmethod
    def _cpu_in_millicores(cls, value: float | None) -> float | None:
        # Kubernetes keeps CPU in millicores: a limit between 0 and 1m would be written "0" into the ResourceQuota.
        if value is not None and 0 < value < 0.001:
            raise ValueError("must be 0 or at least 0.001 (1m)")
        return value

    @field_validator("memory", "storage")
    @classmethod
    def _bytes_are_quantity(cls, value: str | None) -> str | None:
        if value is not None and not 0 <= parse_quantity(value) <= MAX_MEMORY_BYTES:
            raise ValueError("must be between 0 and 4Ei")
        return value

    # ------------------------------------------------------------------------------------ derived forms
    @classmethod
    def stored(cls) -> dict[str, Stored]:
        """Each dimension's amount name (its column is `quota_<amount name>`) and how it is stored."""
        found = {}
        for name, field in cls.model_fields.items():
            kind = next(m for m in field.metadata if isinstance(m, Stored))
            found[f"{name}_bytes" if kind is Stored.BYTES else name] = kind
        return found

    def amounts(self) -> dict[str, float | int | None]:
        """The limits as numbers, by amount name (memory in bytes); None: unlimited."""
        values: dict[str, Any] = {}
        for name, kind in self.stored().items():
            if kind is Stored.BYTES:
                quantity = getattr(self, name.removesuffix("_bytes"))
                values[name] = None if quantity is None else int(parse_quantity(quantity))
            else:
                values[name] = getattr(self, name)
        return values

    @classmethod
    def from_amounts(cls, amounts: dict[str, Any]) -> QuotaSpec:
        """The quota of numbers as `amounts` gives them (missing names: unlimited); bytes shown in Gi when whole."""
        values: dict[str, Any] = {}
        for name, kind in cls.stored().items():
            value = amounts.get(name)
            if kind is Stored.BYTES:
                values[name.removesuffix("_bytes")] = None if value is None else _bytes_quantity(int(value))
            else:
                values[name] = value
        return cls.model_validate(values)

    def merged(self, patch: QuotaSpec) -> QuotaSpec:
        """This quota with the fields `patch` sets (explicit nulls included: unlimited) replaced; the rest kept."""
        return self.model_copy(update={name: getattr(patch, name) for name in patch.model_fields_set})

    def plus(self, other: QuotaSpec) -> QuotaSpec:
        """Limits added dimension by dimension (unlimited stays unlimited): nominal plus a borrowing limit is the
        most a tenant of a cohort may ever hold, what the cluster's ResourceQuota enforces for it."""
        mine, theirs = self.amounts(), other.amounts()
        return QuotaSpec.from_amounts({name: None if mine[name] is None or theirs[name] is None
                                       else min(mine[name] + theirs[name], _MAXIMA[name]) for name in mine})


# A cohort's name is a DNS label, as a tenant's is.
_COHORT = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"


class SharingSpec(BaseModel):
    """How a tenant shares: its quota is its nominal (guaranteed) share; in a cohort it lends what it leaves
    idle and may borrow what the others leave idle, up to its borrowing limit (Kueue's cohorts)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={
        "examples": [{"cohort": "research", "borrowing_limit": {"gpus": 16}, "max_priority_class": "normal"}]})

    cohort: Annotated[str, Field(min_length=1, max_length=48, pattern=_COHORT)] | None = Field(
        None, description="Tenants of one cohort lend each other idle quota; null: no cohort (rigid quota).")
    borrowing_limit: QuotaSpec = Field(
        default_factory=QuotaSpec, description="At most this much beyond the tenant's quota may be borrowed "
        "from the cohort (omitted or null fields: as much as the cohort has idle).")
    max_priority_class: Annotated[str, Field(min_length=1, max_length=32)] | None = Field(
        None, description="The highest of the platform's priority classes its jobs may use; null: any.")

    def ceiling(self, nominal: QuotaSpec) -> QuotaSpec:
        """The most a tenant with this nominal quota may ever hold: what the cluster enforces for it (its
        namespace's ResourceQuota), so that borrowed pods can start."""
        return nominal if self.cohort is None else nominal.plus(self.borrowing_limit)


class UsageAmounts(BaseModel):
    """What a tenant's running jobs hold (or, in a cohort, borrow or lend), in each dimension of its quota that
    running jobs hold."""

    gpus: float
    cpu: float
    memory_bytes: int
    running_jobs: int


_MAXIMA = {"gpus": MAX_GPUS, "cpu": MAX_CPU, "memory_bytes": MAX_MEMORY_BYTES, "max_running_jobs": MAX_JOBS,
           "max_queued_jobs": MAX_JOBS, "storage_bytes": MAX_MEMORY_BYTES, "max_run_seconds": MAX_RUN_SECONDS}


def _bytes_quantity(value: int) -> str:
    return f"{value // 2**30}Gi" if value % 2**30 == 0 else str(value)


def cpu_quantity(cores: float) -> str:
    """Cores as a Kubernetes quantity, never in exponent notation (which a quantity cannot be): 96, 0.5, 100000000."""
    return f"{cores:.3f}".rstrip("0").rstrip(".")
