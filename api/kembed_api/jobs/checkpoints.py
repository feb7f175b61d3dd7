"""Listing a job's checkpoints: `<checkpoint uri>/step-N/`, each counting only once its COMPLETE marker exists.

The layout is the trainer's (kembed_contract.runtime, docs/trainer.md); this reads it with fsspec alone, so
the API needs no torch. An incremental checkpoint (a delta) is listed only while its whole chain is complete,
with the chain's full checkpoint and the bytes a restore reads.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Literal

import fsspec
from pydantic import BaseModel, Field

from kembed_contract import runtime

__all__ = ["CheckpointRead", "list_checkpoints"]



class CheckpointRead(BaseModel):
    step: int
    uri: str
    time: datetime | None = Field(description="When it was completed (its marker was written).")
    num_bytes: int = Field(description="Total size of its files.")
    kind: Literal["full", "delta"] = Field(
        description="full: everything; delta: the dense part and the table rows changed since `parent_step`.")
    parent_step: int | None = Field(description="A delta's parent checkpoint (the save before it); null if full.")
    base_step: int = Field(description="The full checkpoint its chain starts from (itself if full).")
    chain_num_bytes: int = Field(description="Bytes a restore of this step reads: its chain's folders together.")


def _modified(info: dict) -> datetime | None:
    for key in ("mtime", "LastModified", "last_modified"):
        value = info.get(key)
        if isinstance(value, int | float):
            return datetime.fromtimestamp(value, UTC)
        if isinstance(value, datetime):
            return value if value.tzinfo else value.replace(tzinfo=UTC)
    return None


def list_checkpoints(uri: str) -> list[CheckpointRead]:
    """Checkpoints under `uri` that restore (complete, and their chains too), oldest first; an absent folder
    has none."""
    fs, root = fsspec.core.url_to_fs(uri)
    try:
        entries = fs.ls(root, detail=True)
    except FileNotFoundError:
        return []
    scheme = uri.split("://", 1)[0] if "://" in uri else "file"
    markers, folders = {}, {}
    for entry in entries:
        name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
        step = runtime.step_of_dir(name)
        # The trainer never writes links: a step folder, marker or file that is one was planted, and following
        # it would list (times, sizes) what lies elsewhere, another tenant's checkpoints or the server's files.
        if step is None or entry.get("type") != "directory" or entry.get("islink"):
            continue
        path = entry["name"].rstrip("/")
        try:
            marker = fs.info(f"{path}/{runtime.CHECKPOINT_MARKER}")
            if marker.get("islink"):
                continue
            content = fs.cat_file(f"{path}/{runtime.CHECKPOINT_MARKER}")
        except FileNotFoundError:
            continue  # half-written: never loaded, never listed
        markers[step] = runtime.CheckpointMarker.parse(step, content)
        files = fs.find(path, detail=True)
        folders[step] = (path, _modified(marker),
                         sum(int(f.get("size") or 0) for f in files.values() if not f.get("islink")))
    found = []
    for step in runtime.restorable_steps(markers):
        path, time, num_bytes = folders[step]
        chain = runtime.chain_of(step, markers) or [step]
        found.append(CheckpointRead(
            step=step, uri=f"{scheme}://{path}" if scheme != "file" else f"file://{path}",
            time=time, num_bytes=num_bytes, kind=markers[step].kind, parent_step=markers[step].parent,
            base_step=chain[0], chain_num_bytes=sum(folders[s][2] for s in chain),
        ))
    return sorted(found, key=lambda c: c.step)
