"""The quota model, defined once: `QuotaSpec` is what a tenant may hold, with its bounds, and each of its fields
says, beside it, everything the rest of kembed needs to know of that dimension (`Dimension`).

Everything else follows from it, generated rather than restated:
- the API's schema is this model (kembed_api.tenants.schemas re-exports it);
- the database's columns are `quota_<amount>` for each field (`memory` is stored as `quota_memory_bytes`), typed
  by the field's `Dimension.stored` (kembed_api.tenants.models builds them from `QuotaSpec.dimensions()`);
- the Tenant resource's `spec.quota` and its `spec.sharing.borrowing_limit` are this model (kembed_contract.crds
  generates the CRD schema from it), and the operator writes its ResourceQuota from each dimension's
  `kubernetes` names;
- a dimension running jobs hold (`Dimension.held`) is one of admission's numbers (kembed_api.quota.admission's Demand
  and Quota are generated from these), a column of each job with what it holds, a field of `UsageAmounts` (the
  usage endpoint, the Tenant's status, the dashboard) and a sum in every usage query;
- `Dimension.metric` names it in Prometheus' kembed_quota_used / kembed_quota_limit; the dashboard and the CLI
  show each dimension by its `label` and `unit`, the dashboard from the list served with its pages.
A new dimension (say licences per running job) is a field here with its `Dimension`, and a migration adding its
columns. Not every dimension is held by running jobs: `storage` is the bytes a tenant keeps (checkpoints, logs;
enforced by the trainer at save time and at submission, kembed_api.jobs.storage_use), `max_run_seconds` the longest any
one of its jobs may run (enforced by the API's dispatcher), `max_queued_jobs` its queue (enforced at submission);
such a dimension also needs the code that enforces it, and names in `used` the counter the tenant keeps of it.

A patch of a quota (`merged`) changes only the fields it sets; an explicit null clears one (unlimited).

Omitted or null means unlimited. The bounds are far above any real cluster, and counts fit the database's
32-bit integers.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any

import annotated_types
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, create_model, field_validator

from kembed_contract import sizing
from kembed_contract.spec import MAX_RUN_SECONDS, QUANTITY_PATTERN, Resources, parse_quantity
from kembed_contract.trainer_config import NumbersOnly

__all__ = [
    "MAX_CPU", "MAX_GPUS", "MAX_JOBS", "MAX_MEMORY_BYTES", "MAX_RUN_SECONDS", "Dimension", "Held", "QuotaSpec",
    "SharingSpec", "Stored", "UsageAmounts", "add_limits", "cpu_quantity",
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


@dataclass(frozen=True)
class Held:
    """A dimension that running jobs hold: admission counts it, each job keeps what it holds in a column named
    like the dimension's usage, and a tenant's usage is the sum over its active jobs."""

    # How much of it one job holds, from its resources; None: one per job (the dimension counts running jobs).
    per_job: Callable[[Resources], float] | None = None


@dataclass(frozen=True)
class Dimension:
    """One dimension of the quota, as the rest of kembed needs to know it: said once, beside its field."""

    stored: Stored  # how its limit is kept (the column's type; a form's input: a number or a quantity)
    unit: str  # what follows a number of it, in words ("needs 8 GPUs"): the plural
    label: str  # its name for people: a dashboard's bar, column and form field
    # What is measured against it, by name: for a dimension running jobs hold, the field of UsageAmounts (and the
    # job's column); otherwise the counter the tenant keeps of it (a column of tenants, a field of the usage
    # endpoint). None: nothing is (a bound on each job).
    used: str | None = None
    held: Held | None = None  # held by running jobs (admission's); None: enforced elsewhere
    metric: str | None = None  # its `resource` in kembed_quota_used / kembed_quota_limit; None: not exported
    kubernetes: tuple[str, ...] = ()  # the namespace ResourceQuota's names for it; (): not enforced there
    # Filled in by QuotaSpec.dimensions(): the field's name and the largest amount its bounds allow.
    field: str = ""
    maximum: float = 0

    @property
    def amount(self) -> str:
        """Its name as a number: its column is `quota_<amount>` (a quantity's amount is in bytes)."""
        return f"{self.field}_bytes" if self.stored is Stored.BYTES else self.field

    @property
    def counts_jobs(self) -> bool:
        """Held one per running job (what a job holds is then no column: it is the job itself)."""
        return self.held is not None and self.held.per_job is None

    @property
    def whole(self) -> bool:
        """Usage of it is a whole number (bytes, jobs); GPUs and cores may be lent in fractions."""
        return self.stored is Stored.BYTES or self.counts_jobs

    def quantity(self, value: Any) -> str:
        """A limit of it as a Kubernetes quantity (a field's value: bytes are a quantity already)."""
        return cpu_quantity(value) if self.stored is Stored.CORES else str(value)

    def in_words(self, value: float) -> str:
        """An amount of it for people: `8 GPUs`, `1.50 GiB of memory` (bytes shown in GiB)."""
        if self.stored is Stored.BYTES:
            return f"{value / 2**30:.2f} GiB{self.unit.removeprefix('bytes')}"
        return f"{value:g} {self.unit}"

    def number(self, value: float) -> str:
        """An amount of it without its unit's words, where they were said nearby: `8`, `1.50 GiB`."""
        return sizing.in_units(value) if self.stored is Stored.BYTES else f"{value:g}"


_Jobs = Annotated[int, Field(ge=0, le=MAX_JOBS), NumbersOnly]


class QuotaSpec(BaseModel):
    """Limits of a tenant. Omitted or null means unlimited."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, json_schema_extra={
        "examples": [{"gpus": 16, "cpu": 64, "memory": "256Gi", "local_disk": "2Ti", "max_running_jobs": 4, "max_queued_jobs": 100,
                      "storage": "2Ti", "max_run_seconds": 86400}]})

    gpus: Annotated[Annotated[int, Field(ge=0, le=MAX_GPUS), NumbersOnly] | None, Dimension(
        Stored.COUNT, unit="GPUs", label="GPUs", used="gpus", metric="gpus",
        held=Held(lambda r: r.nodes * r.gpus_per_node), kubernetes=("requests.nvidia.com/gpu",),
    )] = Field(None, description="GPUs all running jobs may hold together (nvidia.com/gpu).")
    cpu: Annotated[Annotated[float, Field(strict=True, ge=0, le=MAX_CPU)] | None, Dimension(
        Stored.CORES, unit="CPU cores", label="CPU cores", used="cpu", metric="cpu",
        held=Held(lambda r: r.nodes * r.cpu_per_node), kubernetes=("requests.cpu", "limits.cpu"),
    )] = Field(None, description="CPU cores all running jobs may hold.")
    memory: Annotated[Annotated[str, Field(max_length=32, pattern=QUANTITY_PATTERN)] | None, Dimension(
        Stored.BYTES, unit="bytes of memory", label="Memory", used="memory_bytes", metric="memory_bytes",
        held=Held(lambda r: r.nodes * r.memory_bytes_per_node), kubernetes=("requests.memory", "limits.memory"),
    )] = Field(None, description="Memory all running jobs may hold (a quantity, e.g. 256Gi).")
    local_disk: Annotated[Annotated[str, Field(max_length=32, pattern=QUANTITY_PATTERN)] | None, Dimension(
        Stored.BYTES, unit="bytes of local disk", label="Local disk", used="local_disk_bytes",
        metric="local_disk_bytes", held=Held(lambda r: r.nodes * r.local_disk_bytes_per_node),
        kubernetes=("requests.ephemeral-storage",),
    )] = Field(None, description="Nodes' local disk all running jobs may hold (a quantity, e.g. 2Ti): what their "
               "tiered tables keep on the nodes (resources.local_disk_per_node).")
    max_running_jobs: Annotated[_Jobs | None, Dimension(
        Stored.COUNT, unit="running jobs", label="Running jobs", used="running_jobs", metric="running_jobs",
        held=Held(),
    )] = Field(None, description="Jobs admitted at once (enforced by the API's admission).")
    max_queued_jobs: Annotated[_Jobs | None, Dimension(
        Stored.COUNT, unit="queued jobs", label="Queued jobs", used="queued_jobs",
    )] = Field(None, description="Jobs waiting at once; a submission beyond it is refused with 429.")
    storage: Annotated[Annotated[str, Field(max_length=32, pattern=QUANTITY_PATTERN)] | None, Dimension(
        Stored.BYTES, unit="bytes stored", label="Storage", used="stored_bytes", metric="storage_bytes",
    )] = Field(
        None, description="Bytes the tenant may keep stored (a quantity, e.g. 2Ti): its jobs' checkpoints and, on "
        "the local backend, their logs. A save that would pass it fails the job (StorageQuotaExceeded); a tenant "
        "over it cannot submit.")
    max_run_seconds: Annotated[Annotated[int, Field(ge=1, le=MAX_RUN_SECONDS), NumbersOnly] | None, Dimension(
        Stored.COUNT, unit="seconds per job", label="Run time per job (s)",
    )] = Field(
        None, description="The longest one job may run, in seconds spent running (its default and its ceiling: a "
        "job's own max_run_seconds may only be shorter); past it the job is stopped and fails (DeadlineExceeded).")

    @field_validator("*")
    @classmethod
    def _as_stored(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None:
            return value
        kind = cls.dimension(info.field_name).stored
        # Kubernetes keeps CPU in millicores: a limit between 0 and 1m would be written "0" into the ResourceQuota.
        if kind is Stored.CORES and 0 < value < 0.001:
            raise ValueError("must be 0 or at least 0.001 (1m)")
        if kind is Stored.BYTES and not 0 <= parse_quantity(value) <= MAX_MEMORY_BYTES:
            raise ValueError("must be between 0 and 4Ei")
        return value

    # ------------------------------------------------------------------------------------ derived forms
    @classmethod
    def dimensions(cls) -> tuple[Dimension, ...]:
        """Every dimension, in the fields' order, with its field's name and bound filled in."""
        return _dimensions(cls)

    @classmethod
    def dimension(cls, field: str) -> Dimension:
        return next(d for d in cls.dimensions() if d.field == field)

    @classmethod
    def held(cls) -> tuple[Dimension, ...]:
        """The dimensions running jobs hold: admission's, and UsageAmounts' fields."""
        return tuple(d for d in cls.dimensions() if d.held is not None)

    @classmethod
    def stored(cls) -> dict[str, Stored]:
        """Each dimension's amount name (its column is `quota_<amount name>`) and how it is stored."""
        return {d.amount: d.stored for d in cls.dimensions()}

    def amounts(self) -> dict[str, float | int | None]:
        """The limits as numbers, by amount name (memory in bytes); None: unlimited."""
        values: dict[str, Any] = {}
        for d in self.dimensions():
            value = getattr(self, d.field)
            values[d.amount] = int(parse_quantity(value)) if d.stored is Stored.BYTES and value is not None else value
        return values

    @classmethod
    def from_amounts(cls, amounts: Mapping[str, Any]) -> QuotaSpec:
        """The quota of numbers as `amounts` gives them (missing names: unlimited); bytes shown in Gi when whole."""
        values: dict[str, Any] = {}
        for d in cls.dimensions():
            value = amounts.get(d.amount)
            values[d.field] = _bytes_quantity(int(value)) if d.stored is Stored.BYTES and value is not None else value
        return cls.model_validate(values)

    def merged(self, patch: QuotaSpec) -> QuotaSpec:
        """This quota with the fields `patch` sets (explicit nulls included: unlimited) replaced; the rest kept."""
        return self.model_copy(update={name: getattr(patch, name) for name in patch.model_fields_set})

    def plus(self, other: QuotaSpec) -> QuotaSpec:
        """Limits added dimension by dimension (unlimited stays unlimited): nominal plus a borrowing limit is the
        most a tenant of a cohort may ever hold, what the cluster's ResourceQuota enforces for it."""
        maxima = {d.amount: d.maximum for d in self.dimensions()}
        return type(self).from_amounts(add_limits(self.amounts(), other.amounts(), maxima=maxima))


def add_limits(mine: Mapping[str, Any], theirs: Mapping[str, Any], *,
               maxima: Mapping[str, float] | None = None) -> dict[str, Any]:
    """Limits added name by name: unlimited (None) stays unlimited; a sum is capped at its name's maximum."""
    added = {}
    for name, value in mine.items():
        other = theirs[name]
        total = None if value is None or other is None else value + other
        added[name] = total if total is None or maxima is None else min(total, maxima[name])
    return added


@functools.cache
def _dimensions(model: type[QuotaSpec]) -> tuple[Dimension, ...]:
    found = []
    for name, field in model.model_fields.items():
        marker = next((m for m in field.metadata if isinstance(m, Dimension)), None)
        if marker is None:
            raise TypeError(f"QuotaSpec.{name}: every field is a dimension and says so (Dimension)")
        # A quantity's bound is its validator's (4Ei); a number's, its field's `le`.
        maximum = MAX_MEMORY_BYTES if marker.stored is Stored.BYTES else _upper_bound(field.annotation)
        if maximum is None:
            raise TypeError(f"QuotaSpec.{name}: every dimension has a bound (sums are capped at it)")
        found.append(dataclasses.replace(marker, field=name, maximum=maximum))
    return tuple(found)


def _upper_bound(annotation: Any) -> float | None:
    """The `le` of a field's type (`Annotated[int, Field(le=...)] | None`), if it has one."""
    for arg in typing.get_args(annotation):
        for meta in getattr(arg, "__metadata__", ()):
            for constraint in getattr(meta, "metadata", ()):
                if isinstance(constraint, annotated_types.Le):
                    return constraint.le
    return None


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


def _usage_amounts(model: type[QuotaSpec]) -> type[BaseModel]:
    return create_model(
        "UsageAmounts", __module__=__name__,
        __doc__="What a tenant's running jobs hold (or, in a cohort, borrow or lend), in each dimension of its "
                "quota that running jobs hold.",
        **{d.used: (int if d.whole else float, ...) for d in model.held()},
    )


UsageAmounts = _usage_amounts(QuotaSpec)


def _bytes_quantity(value: int) -> str:
    return f"{value // 2**30}Gi" if value % 2**30 == 0 else str(value)


def cpu_quantity(cores: float) -> str:
    """Cores as a Kubernetes quantity, never in exponent notation (which a quantity cannot be): 96, 0.5, 100000000."""
    return f"{cores:.3f}".rstrip("0").rstrip(".")
