"""Progress, checkpoints and the trainer's seconds by phase from rank 0's JSON-line records (the trainer prints one
per event on stdout)."""

from __future__ import annotations

import json
from typing import Any

from kembed_contract import job_seconds, runtime

__all__ = ["read_records"]


def read_records(log_text: str) -> dict[str, Any]:
    """The status fields the newest records in a log tail say: `progress`, `latestCheckpoint` and
    `trainerSeconds` (the trainer's seconds by phase, kembed_contract.job_seconds), each only where a record
    says it."""
    progress = checkpoint = seconds = None
    for line in log_text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            continue
        event, step = record.get("event"), record["step"]
        total = record.get("total_steps") or (progress or {}).get("totalSteps")
        if event in (runtime.EVENT_STARTED, runtime.EVENT_PROGRESS, runtime.EVENT_DONE):
            total = record.get("total_steps") or total
            if event == runtime.EVENT_DONE:
                total = total or step
            progress = {"step": step, "totalSteps": total,
                        "percent": min(100, int(100 * step / total)) if total else None}
        latest = runtime.latest_checkpoint_reported(event, record)
        if latest is not None:
            checkpoint = {"step": step, "uri": latest}
        seconds = job_seconds.parse_trainer_seconds(record.get("seconds")) or seconds
    fields = {"progress": progress, "latestCheckpoint": checkpoint, "trainerSeconds": seconds}
    return {name: value for name, value in fields.items() if value is not None}
