"""Listing a job's checkpoints: `<checkpoint uri>/step-N/`, each counting only once its COMPLETE marker exists.

The layout is the trainer's (kembed_trainer.checkpoint, docs/trainer.md); this reads it with fsspec alone, so
the API needs no torch.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime

import fsspec
from pydantic import BaseModel, Field

__all__ = ["CheckpointRead", "list_checkpoints"]

_STEP_DIR = re.compile(r"^step-(\d+)$")
_MARKER = "COMPLETE"


class CheckpointRead(BaseModel):
    step: int
    uri: str
    time: datetime | None = Field(description="When it was completed (its marker was written).")
    num_bytes: int = Field(description="Total size of its files.")


def _modified(info: dict) -> datetime | None:
    for key in ("mtime", "LastModified", "last_modified"):
        value = info.get(key)
        if isinstance(value, int | float):
            return datetime.fromtimestamp(value, UTC)
        if isinstance(value, datetime):
            return value if value.tzinfo else value.replace(tzinfo=UTC)
    return None


def list_checkpoints(uri: str) -> list[CheckpointRead]:
    """Complete checkpoints under `uri`, oldest first; an absent folder has none."""
    fs, root = fsspec.core.url_to_fs(uri)
    try:
        entries = fs.ls(root, detail=True)
    except FileNotFoundError:
        return []
    found = []
    scheme = uri.split("://", 1)[0] if "://" in uri else "file"
    for entry in entries:
        name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
        match = _STEP_DIR.match(name)
        if not match or entry.get("type") != "directory":
            continue
        path = entry["name"].rstrip("/")
        try:
            marker = fs.info(f"{path}/{_MARKER}")
        except FileNotFoundError:
            continue  # half-written: never loaded, never listed
        files = fs.find(path, detail=True)
        found.append(CheckpointRead(
            step=int(match.group(1)), uri=f"{scheme}://{path}" if scheme != "file" else f"file://{path}",
            time=_modified(marker), num_bytes=sum(int(f.get("size") or 0) for f in files.values()),
        ))
    return sorted(found, key=lambda c: c.step)
