"""The job spec: the one vocabulary the API, the operator and the CLI share (job states: kembed_contract.lifecycle).

The spec is defined once here (pydantic); the trainer section is the trainer's own config model, so a job that
validates here is a job the trainer accepts.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import types
import typing
from collections.abc import Iterator
from typing import Annotated, Any

from annotated_types import MaxLen
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kembed_contract import sizing
from kembed_contract.trainer_config import NumbersOnly, TrainerConfig

__all__ = [
    "MAX_LOCAL_DISK_BYTES",
    "MAX_RUN_SECONDS",
    "MIN_CPU_PER_NODE",
    "MIN_MEMORY_PER_NODE",
    "JobSpec",
    "oversized",
    "read_stored",
    "QUANTITY_PATTERN",
    "Resources",
    "parse_quantity",
]

_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
QUANTITY_PATTERN = r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|m)?$"
_QUANTITY = re.compile(QUANTITY_PATTERN)
_QUANTITY_FACTORS = {
    None: 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}


def parse_quantity(value: str | int | float) -> float:
    """A Kubernetes resource quantity ("4Gi", "500m", 2) as a plain number."""
    if isinstance(value, int | float):
        return float(value)
    match = _QUANTITY.match(value.strip())
    if not match:
        raise ValueError("not a Kubernetes quantity such as 512Mi, 4Gi or 500m")
    return float(match.group(1)) * _QUANTITY_FACTORS[match.group(2)]


# Free text of a spec (labels, the image): bounded, and without control characters (PostgreSQL cannot store NUL,
# and a newline in a label would forge lines of a log).
_TEXT = r"^[^\x00-\x1f\x7f]*$"
_MAX_LABELS = 64
LabelKey = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9]([-A-Za-z0-9_./]*[A-Za-z0-9])?$")]
LabelValue = Annotated[str, Field(max_length=256, pattern=_TEXT)]


# The least a node may ask for. Kubernetes keeps CPU in millicores, so less than 0.001 core is rendered "0m" (no
# request at all, unbounded by the namespace's quota); 10m is the least a trainer can start on without timing out.
# No trainer process starts in less than 64Mi either: below it, a request only fails later and less clearly.
MIN_CPU_PER_NODE = 0.01
MIN_MEMORY_PER_NODE = "64Mi"
MAX_LOCAL_DISK_BYTES = 2**50  # 1Pi, as memory_per_node: 256 nodes of it stay within the quota's 4Ei
# A job's own time limit: a year at most (a tenant's quota.max_run_seconds may bound it further).
MAX_RUN_SECONDS = 366 * 24 * 3600


class Resources(BaseModel):
    """What one job asks for; admission is all-or-nothing over nodes x these."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    nodes: Annotated[int, NumbersOnly] = Field(1, ge=1, le=256, description="Pods (machines) in the gang.")
    procs_per_node: Annotated[int, NumbersOnly] | None = Field(
        None,
        ge=1,
        le=64,
        description="Trainer processes (ranks) per node. Defaults to gpus_per_node, or 1 without GPUs.",
    )
    gpus_per_node: Annotated[int, NumbersOnly] = Field(0, ge=0, le=16, description="nvidia.com/gpu per node.")
    cpu_per_node: float = Field(1.0, strict=True, ge=MIN_CPU_PER_NODE, le=512, allow_inf_nan=False,
                                description=f"CPU cores requested per node ({MIN_CPU_PER_NODE} = 10m at least).")
    memory_per_node: str = Field("2Gi", max_length=32, pattern=QUANTITY_PATTERN,
                                 description="Memory per node as a Kubernetes quantity, e.g. 16Gi.")
    local_disk_per_node: str | None = Field(
        None, max_length=32, pattern=QUANTITY_PATTERN,
        description="Local disk per node as a Kubernetes quantity, e.g. 200Gi: where the trainers keep their tiered "
        "tables' rows (a volume of this size on Kubernetes, requested as ephemeral-storage; under the job's folder "
        "on the embedded backend). Unset: what the job's tiered tables need (their rows and a headroom), none "
        "without them; set: at least that.")

    @field_validator("memory_per_node")
    @classmethod
    def _memory_is_quantity(cls, value: str) -> str:
        if not parse_quantity(MIN_MEMORY_PER_NODE) <= parse_quantity(value) <= 2**50:
            raise ValueError(f"must be at least {MIN_MEMORY_PER_NODE} and at most 1Pi")
        return value

    @field_validator("local_disk_per_node")
    @classmethod
    def _disk_is_quantity(cls, value: str | None) -> str | None:
        if value is not None and not 0 <= parse_quantity(value) <= MAX_LOCAL_DISK_BYTES:
            raise ValueError("must be at most 1Pi")
        return value

    @model_validator(mode="after")
    def _default_procs(self) -> Resources:
        if self.procs_per_node is None:
            self.procs_per_node = self.gpus_per_node or 1
        if self.gpus_per_node and self.procs_per_node > self.gpus_per_node:
            raise ValueError(
                f"procs_per_node ({self.procs_per_node}) cannot exceed gpus_per_node ({self.gpus_per_node}): "
                "each GPU rank needs its own GPU"
            )
        return self

    @property
    def num_processes(self) -> int:
        return self.nodes * (self.procs_per_node or 1)

    @property
    def memory_bytes_per_node(self) -> int:
        return int(parse_quantity(self.memory_per_node))

    @property
    def memory_bytes_per_rank(self) -> int:
        """A rank's share of its node's memory: what the estimate of one rank must fit, and what its launcher
        tells the trainer (runtime.ENV_MEMORY_PER_RANK) to size tier caches from."""
        return self.memory_bytes_per_node // (self.procs_per_node or 1)

    @property
    def local_disk_bytes_per_node(self) -> int:
        """Local disk one node holds (0: none asked for)."""
        return 0 if self.local_disk_per_node is None else int(parse_quantity(self.local_disk_per_node))


class JobSpec(BaseModel):
    """An embedding-training job as a user submits it (JSON over HTTP, YAML to the CLI)."""

    model_config = ConfigDict(
        extra="forbid",
        allow_inf_nan=False,
        json_schema_extra={
            "examples": [
                {
                    "name": "ctr-clicks",
                    "resources": {"nodes": 1, "procs_per_node": 2},
                    "trainer": {"training": {"steps": 100}},
                }
            ]
        },
    )

    # 46: the job id (name + "-" + 5 characters) names Kubernetes objects and pod host names (at most 52).
    name: Annotated[str, Field(min_length=1, max_length=46)] = Field(
        description="DNS label (lowercase letters, digits, '-'); the job id is the name plus a random suffix.",
        json_schema_extra={"pattern": _DNS_LABEL.pattern},  # checked by _name_is_dns_label, in friendlier words
    )
    priority: Annotated[int, NumbersOnly] = Field(0, ge=-1000, le=1000,
                          description="Higher runs first within a tenant's queue; a job of a higher priority class "
                          "may preempt lower ones (docs/api.md).")
    priority_class: str | None = Field(
        None, min_length=1, max_length=32, pattern=r"^[A-Za-z0-9][-A-Za-z0-9_.]*$",
        description="One of the platform's priority classes (KEMBED_PRIORITY_CLASSES): the job's priority becomes "
        "the class's; a tenant may use classes up to its max_priority_class.")
    resources: Resources = Field(default_factory=Resources)
    max_restarts: Annotated[int, NumbersOnly] = Field(
        2, ge=0, le=100, description="Gang restarts from the last checkpoint after a retryable failure."
    )
    max_run_seconds: Annotated[int, NumbersOnly] | None = Field(
        None, ge=1, le=MAX_RUN_SECONDS,
        description="Stop the job after this many seconds of running (time queued does not count; a preempted "
        "job's earlier runs do), and fail it with reason DeadlineExceeded; it saves a checkpoint first, as on "
        "cancel. Unset: the tenant's quota.max_run_seconds, if any; set: at most that.")
    image: str | None = Field(
        None, min_length=1, max_length=512, pattern=r"^[A-Za-z0-9][A-Za-z0-9._/:@+-]*$",
        description="Trainer image reference, e.g. registry.example.com/kembed-trainer:1.2 (Kubernetes backend); "
        "the platform default if unset.")
    labels: dict[LabelKey, LabelValue] = Field(
        default_factory=dict, max_length=_MAX_LABELS,
        description=f"Free-form labels shown with the job: at most {_MAX_LABELS}, keys up to 128 characters "
        "(letters, digits, '-', '_', '.', '/'), values up to 256.")
    trainer: TrainerConfig = Field(description="The trainer's configuration (see docs/job-spec.md).")

    @model_validator(mode="after")
    def _local_disk_for_tiers(self) -> JobSpec:
        """`resources.local_disk_per_node` is at least what the job's tiered tables need (sizing); unset, it becomes
        that, so that what a job requests, what the quota counts and what a node provides are one number."""
        r = self.resources
        if not isinstance(r, Resources) or not isinstance(self.trainer, TrainerConfig):
            return self  # a spec as stored, read unchecked (read_stored), handed to another model
        needed = sizing.local_disk_bytes_per_node(self.trainer, procs_per_node=r.procs_per_node or 1,
                                                  world_size=r.num_processes)
        if needed == 0:
            return self
        if r.local_disk_per_node is None:
            r.local_disk_per_node = f"{-(-needed // 2**20)}Mi"
        elif r.local_disk_bytes_per_node < needed:
            raise ValueError(
                f"resources.local_disk_per_node: the job's tiered tables need {sizing.in_units(needed)} of local "
                f"disk per node (their rows on {r.procs_per_node} rank(s) and "
                f"{sizing.in_units(sizing.LOCAL_DISK_HEADROOM_BYTES)} of headroom), more than "
                f"{r.local_disk_per_node}; give at least {-(-needed // 2**20)}Mi, or leave it unset")
        return self

    def canonical_hash(self) -> str:
        """SHA-256 of the spec as validated: the same request whatever its key order, spacing or spelled-out
        defaults (`{"priority": 0}` or nothing) hashes the same."""
        text = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(text.encode()).hexdigest()

    @field_validator("name")
    @classmethod
    def _name_is_dns_label(cls, value: str) -> str:
        if not _DNS_LABEL.match(value):
            raise ValueError(
                "must be a DNS label: lowercase letters, digits and '-', starting with a letter, "
                "not ending with '-'"
            )
        return value


def read_stored(raw: dict[str, Any]) -> JobSpec:
    """A spec as the database holds it. One stored before a bound or a type rule of today existed (a 10 MB label,
    `eval_samples` of 10**12) no longer validates: it is read as stored, unchecked, so that the job stays readable
    and cancellable instead of failing every read of it. Code about to run a job validates it (the dispatcher
    fails one that no longer validates)."""
    try:
        return JobSpec.model_validate(raw)
    except ValidationError:
        return JobSpec.model_construct(**raw)



def oversized(raw: Any) -> list[dict[str, Any]]:
    """Every list, map and string of a raw spec (parsed JSON) longer than its field allows, as validation errors
    (`loc`, `msg`, `type`); [] when none is. A cheap look at lengths alone, for before `JobSpec.model_validate`:
    pydantic checks a list's `max_length` only after validating every item (a million-entry map took seconds to
    refuse), so an oversized body is refused here in microseconds. The bounds are the models' own `max_length`s:
    defined once, in the models."""
    return list(_oversized(JobSpec, raw, ()))


def _oversized(model: type[BaseModel], raw: Any, loc: tuple[str | int, ...]) -> Iterator[dict[str, Any]]:
    if not isinstance(raw, dict):
        return
    for name, limit, inner in _bounds_of(model):
        value = raw.get(name)
        if value is None:
            continue
        if limit is not None and isinstance(value, list | dict | str) and len(value) > limit:
            unit = "characters" if isinstance(value, str) else "items"
            yield {"loc": (*loc, name), "msg": f"should have at most {limit} {unit}", "type": "too_long"}
            continue
        if not inner:
            continue
        for index, item in enumerate(value) if isinstance(value, list) else [(None, value)]:
            if not isinstance(item, dict):
                continue
            where = (*loc, name) if index is None else (*loc, name, index)
            tagged = len(inner) > 1  # a union told apart by `kind`: pydantic names the member in `loc` too
            for sub, kind in inner:
                if not tagged:
                    yield from _oversized(sub, item, where)
                elif item.get("kind") == kind:  # no kind, or an unknown one: pydantic says so, without the cost
                    yield from _oversized(sub, item, (*where, kind))


@functools.cache
def _bounds_of(model: type[BaseModel]) -> tuple[tuple[str, int | None, tuple[tuple[type[BaseModel], Any], ...]], ...]:
    """(field, its max_length or None, the models inside it with the `kind` each answers to) of each field of
    `model` that has a bound or models inside: worked out once per model."""
    bounds = []
    for name, field in model.model_fields.items():
        limit = min((m.max_length for m in field.metadata if isinstance(m, MaxLen)), default=None)
        inner = tuple((sub, sub.model_fields["kind"].default if "kind" in sub.model_fields else None)
                      for sub in _models_in(field.annotation))
        if limit is not None or inner:
            bounds.append((name, limit, inner))
    return tuple(bounds)


def _models_in(annotation: Any) -> Iterator[type[BaseModel]]:
    """The models a field's type holds: itself, the members of a union, the items of a list."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
        return
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, list, typing.Annotated):
        for arg in typing.get_args(annotation):
            yield from _models_in(arg)
