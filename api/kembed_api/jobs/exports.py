"""A job's embeddings as a file, and nearest neighbours, from one of its complete checkpoints.

The checkpoint is found under the folder the job's stored spec names (never a URI a trainer reported), so a tenant
reads only its own job's checkpoints, and every file of its chain is checked against the tenant's policy where it
really is. Its trainer wrote it, so the API never reads it itself (a crafted `.metadata` is a pickle that runs
code): `kembed_trainer.export_worker` reads it in a confined process (`checkpoint_reader`), from the chain's own
folders (file://) or from a copy of their bytes (s3://: fetched with the server's credentials, which the worker
never gets). Reading DCP needs torch: a server without it answers that export needs the trainer's dependencies
(`ExportUnavailable`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from kembed_api.jobs import checkpoint_reader, checkpoints
from kembed_contract import kinds, runtime
from kembed_contract.storage_policy import StorageDenied, StoragePolicy, UriError
from kembed_trainer.storage import Guard

__all__ = ["CheckpointRefused", "Export", "ExportBusy", "ExportUnavailable", "NoCheckpoint", "export_file", "find_checkpoint",
           "nearest"]

FORMATS = tuple(kinds.EXPORT_FORMATS)
_COPY_BYTES = 64 << 30  # an s3:// chain is copied for the worker: at most this much
_MESSAGE_CHARS = 500  # of a worker's error message (its own words; bounded all the same)


class NoCheckpoint(LookupError):
    """The job has no complete checkpoint (yet), or not the step asked for."""


class ExportUnavailable(RuntimeError):
    """This server lacks torch, which reading a checkpoint needs."""


class ExportBusy(RuntimeError):
    """The server is reading as many checkpoints as it may at once."""


class CheckpointRefused(ValueError):
    """The checkpoint cannot be read safely: it holds what no checkpoint does, a file of it leads elsewhere, or
    its reader broke a limit."""


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
    its trainer wrote it, and a shard that is a symlink to the server's database must not come back as
    embeddings (the reader's sandbox refuses it too, where the kernel has Landlock). A delta is read through its
    chain, so every folder of the chain is checked."""
    return _find(uri, step, preferred=preferred, policy=policy)[0]


def _find(uri: str | None, step: int | None = None, *, preferred: int | None = None,
          policy: StoragePolicy | None = None) -> tuple[checkpoints.CheckpointRead, list[checkpoints.CheckpointRead]]:
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
    return chosen, chain


def _require_torch() -> None:
    # The worker needs torch; this process never imports it.
    if importlib.util.find_spec("torch") is None:  # the platform image ships the trainer's config, not torch
        raise ExportUnavailable("export reads checkpoints with torch, which this server does not have; "
                                "run `kembed export` where kembed[trainer] is installed")


def _limits(chain: list[checkpoints.CheckpointRead]) -> checkpoint_reader.Limits:
    """What reading `chain` may take: the tables it holds, a few times over; all readers at once, at most half
    the machine."""
    num_bytes = sum(c.num_bytes for c in chain)
    base = checkpoint_reader.Limits()
    share = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (2 * checkpoint_reader.MAX_READERS)
    return checkpoint_reader.Limits(
        memory_bytes=max(base.memory_bytes, min(share, base.memory_bytes + 4 * num_bytes)),
        output_bytes=(256 << 20) + 8 * num_bytes,  # a text format: ~16 characters for each 4-byte float
    )


def _copy(chain: list[checkpoints.CheckpointRead], root: Path) -> dict[str, str]:
    """Copy the chain's files (bytes only: nothing here parses them) under `root/step-N/`; {local URI: its URI}."""
    budget = _COPY_BYTES
    names = {}
    for link in chain:
        fs, path = Guard.fs(link.uri)
        folder = root / runtime.step_dir(link.step)
        for found in fs.find(path):
            parts = found[len(path.rstrip("/")) + 1:].split("/")
            if any(part in ("", ".", "..") for part in parts):
                raise CheckpointRefused(f"checkpoint step {link.step}: a file of it has a name no checkpoint has")
            target = folder.joinpath(*parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            with fs.open(found, "rb") as source, open(target, "wb") as out:
                while chunk := source.read(1 << 20):
                    budget -= len(chunk)
                    if budget < 0:
                        raise CheckpointRefused(f"checkpoint step {link.step}: larger than an export reads "
                                                f"({_COPY_BYTES >> 30} GiB)")
                    out.write(chunk)
        names[f"file://{folder}"] = link.uri
    return names


def _read(chosen: checkpoints.CheckpointRead, chain: list[checkpoints.CheckpointRead], wanted: list[str], *,
          table: str | None, policy: StoragePolicy | None, sandbox: str, sink: IO[bytes]) -> dict[str, Any]:
    """Run the worker on the chain; its answer (the first line it printed), what followed it in `sink`."""
    denied = [d.removeprefix("file://") for d in (policy or StoragePolicy()).deny if d.startswith("file://")]
    with tempfile.TemporaryDirectory(prefix="kembed-read-") as tmp:
        scratch = Path(tmp) / "work"
        scratch.mkdir()
        if chosen.uri.startswith("file://"):  # read in place: Landlock judges every file where it really is
            step_uri, folders, names = chosen.uri, [c.uri.removeprefix("file://") for c in chain], {}
        else:
            copy = Path(tmp) / "checkpoint"
            names = _copy(chain, copy)
            step_uri, folders = f"file://{copy / runtime.step_dir(chosen.step)}", [str(copy)]
        command = [sys.executable, "-m", "kembed_trainer.export_worker", *wanted,
                   *([f"--table={table}"] if table else []), "--", step_uri]
        try:
            output = checkpoint_reader.run(command, read=folders, scratch=scratch, denied=denied, sandbox=sandbox,
                                           limits=_limits(chain), sink=sink)
        except checkpoint_reader.ReaderUnavailable as error:
            raise ExportUnavailable(str(error)) from None
        except checkpoint_reader.ReaderBusy as error:
            raise ExportBusy(str(error)) from None
        except checkpoint_reader.ReaderFailed as error:
            raise CheckpointRefused(f"checkpoint step {chosen.step}: {error}") from None
    return _answer(output, chosen.step, names)


def _answer(output: checkpoint_reader.Output, step: int, names: dict[str, str]) -> dict[str, Any]:
    """The worker's answer, checked: it ran on a tenant's files, so what it says is not trusted either."""
    try:
        answer = json.loads(output.header)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        raise CheckpointRefused(f"checkpoint step {step}: its reader ended without an answer "
                                f"(exit code {output.returncode})")
    if output.returncode != 0 or "error" in answer:
        message = str(answer.get("message", ""))[:_MESSAGE_CHARS]
        for local, real in names.items():
            message = message.replace(local, real)
        kind = answer.get("error")
        if kind == "invalid":
            raise ValueError(message)  # a wrong table or word, said by export itself
        if kind in ("unsafe", "denied"):
            raise CheckpointRefused(f"checkpoint step {step} refused: {message}")
        raise CheckpointRefused(f"checkpoint step {step} could not be read ({message or 'no reason given'})")
    name = answer.get("table")
    if not (isinstance(name, str) and name.isascii() and name.isidentifier()):  # a table name, as config allows
        raise CheckpointRefused(f"checkpoint step {step}: its reader answered no table name")
    return answer


def export_file(uri: str | None, *, job_id: str, fmt: str, table: str | None, step: int | None,
                preferred: int | None = None, policy: StoragePolicy | None = None, sandbox: str = "auto") -> Export:
    """Write the export to a temporary file (so its size is known before the first byte is sent). `sandbox`:
    KEMBED_TRAINER_SANDBOX (auto, landlock, off)."""
    _require_torch()
    chosen, chain = _find(uri, step, preferred=preferred, policy=policy)
    suffix = kinds.EXPORT_FORMATS[fmt]
    fd, path = tempfile.mkstemp(prefix="kembed-export-", suffix=suffix)
    try:
        with os.fdopen(fd, "wb") as sink:
            answer = _read(chosen, chain, [f"--format={fmt}"], table=table, policy=policy, sandbox=sandbox,
                           sink=sink)
            if answer.get("num_bytes") != sink.tell():
                raise CheckpointRefused(f"checkpoint step {chosen.step}: its reader's output was cut short")
    except BaseException:
        os.unlink(path)
        raise
    name = answer["table"]
    return Export(path=path, filename=f"{job_id}-{name}-step-{chosen.step}{suffix}", step=chosen.step, table=name)


def nearest(uri: str | None, *, word: str, k: int, table: str | None, preferred: int | None = None,
            policy: StoragePolicy | None = None, sandbox: str = "auto") -> tuple[int, str, list[tuple[str, float]]]:
    """(checkpoint step, table, [(key, cosine similarity)]) from the job's result checkpoint, else the latest."""
    _require_torch()
    chosen, chain = _find(uri, preferred=preferred, policy=policy)
    with open(os.devnull, "wb") as nothing_follows:
        answer = _read(chosen, chain, [f"--neighbours={word}", "-k", str(k)], table=table, policy=policy,
                       sandbox=sandbox, sink=nothing_follows)
    found = answer.get("neighbours")
    if not (isinstance(found, list) and len(found) <= k and all(
            isinstance(n, list) and len(n) == 2 and isinstance(n[0], str) and isinstance(n[1], int | float)
            for n in found)):
        raise CheckpointRefused(f"checkpoint step {chosen.step}: its reader answered no neighbours")
    return chosen.step, answer["table"], [(key, float(similarity)) for key, similarity in found]
