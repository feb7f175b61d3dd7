"""A job's embeddings as a file, and nearest neighbours, from one of its complete checkpoints.

The checkpoint is found under the folder the job's stored spec names (never a URI a trainer reported), so a tenant reads
only its own job's checkpoints. Reading DCP needs torch: the embedded default has it; a platform image without
it answers that export needs the trainer's dependencies (`ExportUnavailable`).
"""

from __future__ import annotations

import functools
import os
import tempfile
import threading
from dataclasses import dataclass

from kembed_api import checkpoints
from kembed_contract import runtime
from kembed_contract.storage_policy import StorageDenied, StoragePolicy, UriError
from kembed_trainer.storage import Guard

__all__ = ["Export", "ExportUnavailable", "NoCheckpoint", "export_file", "find_checkpoint", "nearest"]

FORMATS = tuple(runtime.EXPORT_FORMATS)


class NoCheckpoint(LookupError):
    """The job has no complete checkpoint (yet), or not the step asked for."""


class ExportUnavailable(RuntimeError):
    """This server lacks torch, which reading a checkpoint needs."""


@dataclass(frozen=True)
class Export:
    path: str  # a temporary file: the caller deletes it once sent
    filename: str
    step: int
    table: str


def find_checkpoint(uri: str | None, step: int | None = None, *, preferred: int | None = None,
                    policy: StoragePolicy | None = None) -> checkpoints.CheckpointRead:
    """The complete checkpoint at `step`; without one, `preferred` (the job's result: its best eval's) while it
    exists, else the latest.

    Every file in it is checked against the tenant's `policy` where it really is: the folder is the tenant's, but
    its trainer wrote it, and a shard that is a symlink to the server's database would otherwise be read (with
    the server's rights, outside any sandbox) and handed back as embeddings. A delta is read through its chain,
    so every folder of the chain is checked."""
    listed = checkpoints.list_checkpoints(uri) if uri else []
    found = listed
    if step is None and preferred is not None and any(c.step == preferred for c in found):
        step = preferred
    if step is not None:
        found = [c for c in found if c.step == step]
    if not found:
        raise NoCheckpoint("the job has no complete checkpoint yet" if step is None
                           else f"step: the job has no complete checkpoint at step {step}")
    chosen = found[-1]
    chain = [c for c in listed if c.base_step == chosen.base_step and c.step <= chosen.step]
    try:
        for link in chain:
            Guard(policy).check_tree(link.uri, where=f"checkpoint step {link.step}")
    except (StorageDenied, UriError) as error:
        raise NoCheckpoint(str(error)) from None
    return chosen


def _exporter():
    try:
        from kembed_trainer import export
    except ImportError as error:  # the platform image ships the trainer's config, not torch
        raise ExportUnavailable("export reads checkpoints with torch, which this server does not have; "
                                "run `kembed export` where kembed[trainer] is installed") from error
    return export


def export_file(uri: str | None, *, job_id: str, fmt: str, table: str | None, step: int | None,
                preferred: int | None = None, policy: StoragePolicy | None = None) -> Export:
    """Write the export to a temporary file (so its size is known before the first byte is sent)."""
    export = _exporter()
    checkpoint = find_checkpoint(uri, step, preferred=preferred, policy=policy)
    rows = export.read_table(checkpoint.uri, table)
    fd, path = tempfile.mkstemp(prefix="kembed-export-", suffix=export.SUFFIXES[fmt])
    try:
        with os.fdopen(fd, "wb") as out:
            export.write(rows, fmt, out)
    except BaseException:
        os.unlink(path)
        raise
    filename = f"{job_id}-{rows.name}-step-{checkpoint.step}{export.SUFFIXES[fmt]}"
    return Export(path=path, filename=filename, step=checkpoint.step, table=rows.name)


# A few tables kept in memory, so a user asking for several words reads the checkpoint once.
_tables_lock = threading.Lock()


@functools.lru_cache(maxsize=4)
def _cached_table(step_uri: str, table: str | None):
    return _exporter().read_table(step_uri, table)


def nearest(uri: str | None, *, word: str, k: int, table: str | None, preferred: int | None = None,
            policy: StoragePolicy | None = None) -> tuple[int, str, list[tuple[str, float]]]:
    """(checkpoint step, table, [(key, cosine similarity)]) from the job's result checkpoint, else the latest."""
    export = _exporter()
    checkpoint = find_checkpoint(uri, preferred=preferred, policy=policy)
    with _tables_lock:
        rows = _cached_table(checkpoint.uri, table)
    return checkpoint.step, rows.name, export.neighbours(rows, word, k)
