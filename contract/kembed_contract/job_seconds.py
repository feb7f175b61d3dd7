"""Where a job's seconds go: its wall time from submission to result, split into phases. Defined once here; the
trainer measures its phases under these names, the API stores what it reports and adds what only the platform
knows (the queue, the job's start and end), and the API's read, the CLI and the docs show the split. Stdlib only.

The phases, in the order a job meets them:

- `queued`: from submission to the job's latest admission (a preempted job's earlier runs count here too);
- `process_start`: from the launcher's start (`kembed_trainer.launch`, on the embedded backend and in pods) to the
  trainer's first line, plus joining the process group (torchrun's rendezvous, gloo's or NCCL's set-up);
- `imports`: the trainer's imports (torch and its own) and the numba kernels it compiles or loads from its cache;
- `data`: opening and sizing the data, its vocabulary included, and building the tables;
- `training`: the training loop's steps (its eval and checkpoint saves excluded);
- `evaluation`: the evals;
- `saving`: checkpoint saves, as long as training waited for them (the final save entirely);
- `exit`: from the API receiving the trainer's `done` record (its result) to the job's end: the trainer delivering
  its last records and leaving its process group, torchrun and the launcher ending, the platform noticing;
- `other`: the rest of the wall time: between admission and the launcher's start (a pod's scheduling and image
  pull on Kubernetes), restoring a checkpoint, earlier attempts of a restarted job.

A finished job's phases sum to its wall time; a running job's to the time so far (its trainer reports the phases
with every `progress` record, so the last few seconds stay in `other` until the next one).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = [
    "ENV_LAUNCHED_AT",
    "MAX_PHASE_SECONDS",
    "PHASES",
    "PHASE_LABELS",
    "TRAINER_PHASES",
    "TrainerSeconds",
    "parse_trainer_seconds",
    "split",
]

PHASE_LABELS = {
    "queued": "queued",
    "process_start": "process start",
    "imports": "imports and compilation",
    "data": "data and vocabulary",
    "training": "training",
    "evaluation": "evaluation",
    "saving": "saving",
    "exit": "exit",
    "other": "other",
}
PHASES = tuple(PHASE_LABELS)
# What the trainer measures itself (its report's `seconds`); `process_start` is partly its own (the rendezvous).
TRAINER_PHASES = ("process_start", "imports", "data", "training", "evaluation", "saving")
# Unix time (seconds, a float) at which the node's launcher started, set by the launcher in its workers' environment:
# the trainer's `process_start` counts from it.
ENV_LAUNCHED_AT = "KEMBED_LAUNCHED_AT"
# A reported phase longer than a year is not a measurement (a trainer's report is the tenant's, never trusted).
MAX_PHASE_SECONDS = 366 * 86400.0

TrainerSeconds = dict[str, float]


def _seconds(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) and 0.0 <= value <= MAX_PHASE_SECONDS else None


def parse_trainer_seconds(reported: Any) -> TrainerSeconds | None:
    """A trainer's reported `seconds` (`{phase: seconds}`) kept to what it may say: the trainer's phases, each a
    finite number of seconds in [0, MAX_PHASE_SECONDS]; None when it is not a mapping or says nothing usable."""
    if not isinstance(reported, Mapping):
        return None
    kept = {phase: s for phase in TRAINER_PHASES if (s := _seconds(reported.get(phase))) is not None}
    return kept or None


def split(*, wall_seconds: float, queued_seconds: float, trainer: Mapping[str, float] | None,
          exit_seconds: float = 0.0) -> dict[str, float]:
    """The job's wall time by phase (every phase of PHASES, in order, rounded to milliseconds): what the platform
    measured (`queued_seconds`, `exit_seconds`), the trainer's phases (`trainer`, from parse_trainer_seconds; None
    before it reported any), and `other`, what is left. Phases are never negative; should they add up to more than
    the wall time (the trainer's launcher started before the server admitted the job, by the clocks of two
    machines), the trainer's are scaled down to fit, so the split always sums to `wall_seconds`."""
    wall = max(0.0, wall_seconds)
    out = dict.fromkeys(PHASES, 0.0)
    out["queued"] = min(wall, max(0.0, queued_seconds))
    out["exit"] = min(wall - out["queued"], max(0.0, exit_seconds))
    measured = {phase: max(0.0, float((trainer or {}).get(phase, 0.0))) for phase in TRAINER_PHASES}
    room = wall - out["queued"] - out["exit"]
    total = sum(measured.values())
    scale = room / total if total > room and total > 0 else 1.0
    for phase, seconds in measured.items():
        out[phase] = seconds * scale
    out["other"] = max(0.0, wall - sum(out.values()))
    return {phase: round(seconds, 3) for phase, seconds in out.items()}
