"""What the jobs API accepts and returns (never ORM objects)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, create_model

from kembed_contract import job_seconds, runtime
from kembed_contract.lifecycle import JobState
from kembed_contract.spec import JobSpec
from kembed_contract.trainer_config import NumbersOnly

__all__ = ["JobCreate", "JobEstimates", "JobEventRead", "JobList", "JobMetricRead", "JobRead", "Neighbour",
           "NeighboursRead", "Progress", "ReportRecord", "ReportRecords"]

JobCreate = JobSpec


class Progress(BaseModel):
    step: int = Field(description="Last optimizer step the trainer reported.")
    total_steps: int = Field(description="Steps the job runs in all (0 until the trainer starts).")
    fraction: float = Field(description="step / total_steps, 0..1.")


class JobEventRead(BaseModel):
    time: datetime
    state: JobState
    reason: str
    message: str


class JobEstimates(BaseModel):
    table_memory_bytes_per_rank: int = Field(
        description="Embedding weights plus sparse-optimizer state one rank holds (row-wise sharded tables split "
        "across all ranks, the others whole)."
    )
    memory_bytes_per_rank: int = Field(
        description="Everything one rank is estimated to need (tables, optimizer state, dense model, a step's "
        "batch, an eval, the data source, the runtime): what `resources.memory_per_node` must hold per rank."
    )
    tier_cache_rows_per_rank: dict[str, int] = Field(
        default_factory=dict, description="Each tiered table's cache, in rows per rank: its tier's cache_rows or "
        "cache_mb, or what memory_per_node leaves for it when the tier gives neither.")
    local_disk_bytes_per_node: int = Field(
        0, description="Local disk one node needs for the tiered tables' rows of its ranks, with a headroom (what "
        "`resources.local_disk_per_node` must hold); 0 without tiered tables.")


# Seconds by phase, one field per phase of kembed_contract.job_seconds (the docs there say what each counts).
JobSeconds = create_model(
    "JobSeconds",
    __doc__="The job's wall time from submission to its end (or to now) split by phase; the phases sum to `wall`.",
    wall=(float, Field(description="Seconds from submission to the job's end, or to now while it has not ended.")),
    **{phase: (float, Field(description=f"Seconds of {label}.")) for phase, label in job_seconds.PHASE_LABELS.items()},
)


class JobRead(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "id": "ctr-clicks-x7k2p",
                    "name": "ctr-clicks",
                    "tenant": "default",
                    "state": "RUNNING",
                    "reason": "Started",
                    "message": "2 trainer processes on 1 node",
                    "progress": {"step": 120, "total_steps": 400, "fraction": 0.3},
                    "metrics": {"loss": 0.52, "samples_per_sec": 41000.0},
                }
            ]
        }
    )

    id: str
    name: str
    tenant: str
    state: JobState
    reason: str = Field(description="CamelCase reason of the last state change.")
    message: str = Field(description="Human-readable detail of the last state change.")
    priority: int
    restart_count: int
    created_at: datetime
    admitted_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    progress: Progress
    metrics: dict[str, Any] = Field(description="The latest progress and eval values the trainer reported.")
    result: dict[str, Any] | None = Field(description="Final eval metrics, once the job succeeded.")
    dataset: dict[str, int] | None = Field(
        None,
        description="The training data's size as the trainer read it (null until it started): `train_rows`, "
        "`eval_rows` (table data); `train_sentences`, `train_tokens`, `eval_sentences`, `vocab_size` (text).",
    )
    seconds: JobSeconds = Field(  # type: ignore[valid-type]  # a model made from the contract's phases
        description="Where the job's wall time went: queued, process start, imports and compilation, data, "
        "training, evaluation, saving and the rest (`other`).")
    latest_checkpoint_uri: str | None = Field(
        description="URI of the latest complete checkpoint (a `step-N` folder inside spec.trainer.checkpoint.uri).")
    checkpoint_step: int | None = Field(description="Its step.")
    queue_position: int | None = Field(None, description="1 = next to be admitted (QUEUED jobs only).")
    estimated_start_at: datetime | None = Field(
        None, description="When a QUEUED job is expected to start; null when it cannot be estimated yet."
    )
    estimates: JobEstimates
    spec: JobSpec
    events: list[JobEventRead] = Field(default_factory=list)


class JobList(BaseModel):
    items: list[JobRead]
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page; null on the last page.")


class JobMetricRead(BaseModel):
    time: datetime
    event: str
    step: int
    values: dict[str, Any]


class ReportRecord(BaseModel):
    """One JSON line of the trainer (see docs/trainer.md); unknown keys are kept as metric values."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    event: str = Field(min_length=1, max_length=32, pattern=r"^[A-Za-z0-9_.-]+$")
    step: Annotated[int, NumbersOnly] = Field(ge=0, le=2**31 - 1)
    time: float | None = Field(None, allow_inf_nan=False)
    run: str | None = Field(None, min_length=1, max_length=32, pattern=r"^[A-Za-z0-9_-]+$",
                            description="The reporting trainer process (random, one per process).")
    seq: Annotated[int, NumbersOnly] | None = Field(None, ge=1, le=2**62,
                            description="The record's number within its run, from 1: a record of a run is applied "
                            "once, and never after a later one of the same run.")



ReportRecords = ReportRecord | Annotated[list[ReportRecord],
                                         Field(min_length=1, max_length=runtime.MAX_RECORDS_PER_REPORT)]
"""A report's body: one record, or several queued behind one another (applied in their order)."""

class Neighbour(BaseModel):
    key: str = Field(description="The word, or the id (as text).")
    similarity: float = Field(description="Cosine similarity to the query, -1..1.")


class NeighboursRead(BaseModel):
    job: str
    checkpoint_step: int = Field(description="The complete checkpoint the vectors come from (the latest).")
    table: str
    word: str
    neighbours: list[Neighbour] = Field(description="Nearest first; the query itself left out.")
