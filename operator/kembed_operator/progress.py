"""Progress and checkpoints from rank 0's JSON-line records (the trainer prints one per event on stdout)."""

from __future__ import annotations

import json
from typing import Any

from kembed_contract import runtime

__all__ = ["read_records"]


def read_records(log_text: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(progress, latestCheckpoint) as status fields, from the newest records in a log tail; None where absent."""
    progress = checkpoint = None
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
    return progress, checkpoint
