"""Listing a job's checkpoints: `<checkpoint uri>/step-N/`, each counting only once its COMPLETE marker exists.

The layout is the trainer's (kembed_trainer.runtime, docs/trainer.md); this reads it with fsspec alone, so
the API needs no torch.
"""

from __future__ import annotations

from datetime import UTC, datetime

import fsspec
from pydantic import BaseModel, Field

from kembed_trainer import runtime

__all__ = ["CheckpointRead", "list_checkpoints"]



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
        step = runtime.step_of_dir(name)
        if step is None or entry.get("type") != "directory":
            continue
        path = entry["name"].rstrip("/")
        try:
            marker = fs.info(f"{path}/{runtime.CHECKPOINT_MARKER}")
        except FileNotFoundError:
            continue  # half-written: never loaded, never listed
        files = fs.find(path, detail=True)
        found.append(CheckpointRead(
            step=step, uri=f"{scheme}://{path}" if scheme != "file" else f"file://{path}",
            time=_modified(marker), num_bytes=sum(int(f.get("size") or 0) for f in files.values()),
        ))
    return sorted(found, key=lambda c: c.step)
