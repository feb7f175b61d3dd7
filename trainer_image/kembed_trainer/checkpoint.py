"""Checkpoints with torch.distributed.checkpoint (DCP) through fsspec: `<uri>/step-N/`, complete or ignored.

Every rank writes its part of a step folder; once DCP has written its metadata, rank 0 adds a `COMPLETE`
marker. Only folders with the marker are ever loaded, so a save cut short (SIGKILL, node loss) costs only that
save. DCP keys tensors by name, so a checkpoint written by N ranks loads on M.

With `incremental`, saves between full checkpoints are deltas (delta.py: the dense part whole, the tables' changed
rows only), each on the save before it (runtime.CheckpointMarker). Resume loads the newest step whose chain is
complete: its full checkpoint, then its deltas in order. Rank 0 picks full or delta for every save (every
`full_every` saves, or once the chain's deltas pass `max_chain_share` of its full one) and tells the others.
Pruning keeps the newest `keep` restorable steps and every folder their chains need, deleting newest first, so
a prune cut short never leaves a delta without its base.

A save asks the storage for little besides its data: DCP's files (laid out for object storage by
`step_writer`), its metadata (written once, under its own name), the marker, and one listing to prune; the size
comes from what was written, and each marker is read once. On S3 every request is a round trip a small delta
would otherwise wait on.

Every folder is checked against the storage policy (kembed_trainer.storage) just before it is listed, written,
loaded or deleted, as its real path: a step folder that is a symlink to somewhere else is refused, not followed.
Loads read through `dcp_read`, which unpickles nothing but DCP's own metadata classes and plain values:
whoever can write the folder cannot make a resume run code.

Storage quota: with a budget (runtime.ENV_STORAGE_BUDGET), rank 0 counts, before it writes a save's marker, the
bytes the folder will hold once that save counts and pruning is done (the steps keep-latest-K, the pinned best and
their chains keep, sizes from their markers). Past the budget the save is not marked, its files are removed, and
`StorageQuotaExceeded` is raised: the earlier checkpoints stay as they were. That count is also what a checkpoint
record reports as the job's stored bytes (`SavedCheckpoint.stored_bytes`), which the API sums per tenant.

Saves are asynchronous: `save` copies the state (training goes on changing the originals) and hands the copy
to a background thread, which writes it over a process group of its own (so its collectives never interleave
with training's). Training waits only for the copy, and for a previous save still in flight. Rows kept elsewhere
(a tiered table's, on local disk: `sources`) are not copied but read as they are written, from a snapshot the
caller takes (`snapshot`) and releases when the save no longer reads it.
"""

from __future__ import annotations

import sys
import time
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

from kembed_contract import runtime
from kembed_trainer import dcp_read, delta
from kembed_trainer.step_writer import RowRangePlanner, StepWriter, is_placeholder
from kembed_trainer.storage import Guard

__all__ = ["Checkpointer", "SavedCheckpoint", "StepWriter", "StorageQuotaExceeded"]

_WHERE = "checkpoint.uri"


class StorageQuotaExceeded(Exception):
    """A save would have taken the job's folder past its storage budget; it was dropped (exit EXIT_STORAGE_QUOTA)."""


@dataclass(frozen=True)
class SavedCheckpoint:
    step: int
    uri: str
    num_bytes: int
    seconds: float  # from the start of the save until its COMPLETE marker landed
    blocked_seconds: float = 0.0  # how long training waited (for the copy, and for an earlier save)
    kind: str = runtime.CHECKPOINT_FULL
    parent: int | None = None  # a delta's parent step
    waited_seconds: float = 0.0  # of blocked_seconds, the wait for an earlier save still in flight
    stored_bytes: int | None = None  # what the job's folder holds after it and its pruning (rank 0)


class Checkpointer:
    def __init__(self, uri: str, *, keep: int, is_main: bool, guard: Guard, incremental: bool = False,
                 full_every: int = 8, max_chain_share: float = 0.5, budget_bytes: int | None = None) -> None:
        """`budget_bytes`: the most the folder may hold after a save and its pruning (None: no limit)."""
        self.guard = guard
        self.budget_bytes = budget_bytes
        self.uri = guard.writable(uri, where=_WHERE)  # canonical: records always carry a full URI
        self.keep = keep
        self.incremental, self.full_every, self.max_chain_share = incremental, full_every, max_chain_share
        self._chain: list[runtime.CheckpointMarker] = []  # the chain the next delta extends (sizes on rank 0)
        self._waited = 0.0  # how long next_kind waited for a save in flight (part of the next save's stall)
        self.is_main = is_main
        self.fs, self.root = guard.fs(self.uri)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
        self._inflight: Future[SavedCheckpoint] | None = None
        self._landed: list[SavedCheckpoint] = []
        self.pinned_step: int | None = None  # a step never pruned (the best eval's checkpoint)
        self._read_markers: dict[int, runtime.CheckpointMarker] = {}  # a marker never changes once written
        # Saves talk over a group of their own, so their collectives never interleave with training's.
        self._group = dist.new_group(backend="gloo") if dist.is_initialized() else None

    def step_uri(self, step: int) -> str:
        return f"{self.uri}/{runtime.step_dir(step)}"

    def _checked_step(self, step: int, *, write: bool) -> str:
        """The step folder's path, once the policy allows it where it really is (it may have become a symlink)."""
        uri = self.step_uri(step)
        where = f"{_WHERE} ({runtime.step_dir(step)})"
        canonical = self.guard.writable(uri, where=where) if write else self.guard.readable(uri, where=where)
        return self.guard.fs(canonical)[1]

    def markers(self) -> dict[int, runtime.CheckpointMarker]:
        """The complete checkpoints' markers, by step."""
        return self._scan()[1]

    def _scan(self) -> tuple[list[int], dict[int, runtime.CheckpointMarker]]:
        """The step folders there are now (newest first), and the markers of the complete ones. A marker never
        changes once written, so each is read once (or known from writing it): a save costs one listing."""
        listed = self._listed_steps()
        self._read_markers = {step: m for step, m in self._read_markers.items() if step in listed}
        for step in listed:
            if step in self._read_markers:
                continue
            try:
                content = self.fs.cat_file(f"{self._checked_step(step, write=False)}/{runtime.CHECKPOINT_MARKER}")
            except FileNotFoundError:
                continue
            self._read_markers[step] = runtime.CheckpointMarker.parse(step, content)
        return listed, dict(self._read_markers)

    def complete_steps(self) -> list[int]:
        """Steps that restore (complete, with every link of their chain complete), newest first."""
        return runtime.restorable_steps(self.markers())

    def next_kind(self) -> str:
        """Whether the next save is full or a delta: rank 0 decides for all. Collective; waits for a save in
        flight (its size counts)."""
        waiting = time.perf_counter()
        self._landed += self._finish()
        self._waited = time.perf_counter() - waiting
        kind = runtime.CHECKPOINT_FULL
        if self.is_main and self.incremental and self._chain:
            full, deltas = self._chain[0], self._chain[1:]
            chain_bytes = sum(d.num_bytes or 0 for d in deltas)
            if (len(self._chain) < self.full_every and full.num_bytes is not None
                    and chain_bytes <= self.max_chain_share * full.num_bytes):
                kind = runtime.CHECKPOINT_DELTA
        if dist.is_initialized():
            decided = [kind]
            dist.broadcast_object_list(decided, src=0)
            kind = decided[0]
        return kind

    def save(self, step: int, state: dict[str, Any], files: dict[str, bytes] | None = None, *,
             kind: str = runtime.CHECKPOINT_FULL, started: float | None = None,
             sources: dict[str, Any] | None = None,
             snapshot: Callable[[], Callable[[], None]] | None = None) -> None:
        """Start saving `state` as step `step`; `poll` or `wait` tell when it landed. Collective.

        `files` (name in the step folder -> bytes) are this rank's small side files, such as what each table
        row stands for (`row_index`); they land before the COMPLETE marker, so a complete checkpoint has them.
        `kind`: as `next_kind` said (a delta's `state` holds delta.DELTA_KEY instead of the tables). `started`:
        when training stopped for this save (before it built `state`), so the stall reported counts that too.
        `sources`: placeholders of `state` (`step_writer.placeholder`) whose rows are read from elsewhere as they
        are written, by flattened key (step_writer.RowRangePlanner), in the save's thread: what they read must not
        change until it landed. `snapshot` makes it so: called once no earlier save is in flight, it takes a
        snapshot of what `sources` read and returns its release, which the save's thread calls once it no longer
        reads them (landed or failed).
        """
        start = time.perf_counter() if started is None else started
        waiting = time.perf_counter()
        self._landed += self._finish()  # one save at a time
        waited, self._waited = self._waited + time.perf_counter() - waiting, 0.0
        parent = None
        if kind == runtime.CHECKPOINT_DELTA:
            assert self._chain, "a delta needs a checkpoint before it"
            parent = self._chain[-1].step
        self._checked_step(step, write=True)  # refused here, in the training thread, if outside the policy
        staged = _copy(state)
        release = snapshot() if snapshot is not None else None
        blocked = time.perf_counter() - start
        self._inflight = self._executor.submit(
            self._write, step, staged, dict(files or {}), start, (blocked, waited), kind, parent, dict(sources or {}),
            release,
        )

    def poll(self) -> list[SavedCheckpoint]:
        """The saves that landed since the last call (never blocks)."""
        if self._inflight is not None and self._inflight.done():
            self._landed += self._finish()
        landed, self._landed = self._landed, []
        return landed

    def wait(self) -> list[SavedCheckpoint]:
        """Block until no save is in flight; then as `poll`."""
        self._landed += self._finish()
        return self.poll()

    def close(self) -> None:
        self._finish()
        self._executor.shutdown()

    def _finish(self) -> list[SavedCheckpoint]:
        if self._inflight is None:
            return []
        inflight, self._inflight = self._inflight, None
        return [inflight.result()]  # a failed save raises here, in the training thread

    def _write(
        self, step: int, staged: dict[str, Any], files: dict[str, bytes], start: float,
        stalled: tuple[float, float], kind: str, parent: int | None, sources: dict[str, Any],
        release: Callable[[], None] | None = None,
    ) -> SavedCheckpoint:
        try:
            return self._write_step(step, staged, files, start, stalled, kind, parent, sources)
        finally:
            if release is not None:  # landed or failed: the snapshot is read no more
                release()

    def _write_step(
        self, step: int, staged: dict[str, Any], files: dict[str, bytes], start: float,
        stalled: tuple[float, float], kind: str, parent: int | None, sources: dict[str, Any],
    ) -> SavedCheckpoint:
        path = self._checked_step(step, write=True)
        # A partial save of this step from an earlier attempt goes first; here, not in save(), so training does
        # not wait for the storage's round trips.
        if self.is_main and self.fs.exists(path):
            self._read_markers.pop(step, None)
            self.fs.rm(path, recursive=True)
        if self._group is not None:
            dist.barrier(group=self._group)  # no rank writes before it is gone
        side_bytes = 0
        for name, content in files.items():  # before DCP's collective save, so before rank 0's marker
            self.fs.makedirs(f"{path}/{name}".rsplit("/", 1)[0], exist_ok=True)
            self.fs.pipe_file(f"{path}/{name}", content)
            side_bytes += len(content)
        if self._group is not None:  # every rank's side files count in the folder's size
            total = torch.tensor([side_bytes], dtype=torch.int64)
            dist.all_reduce(total, group=self._group)
            side_bytes = int(total.item())
        writer = StepWriter(self.step_uri(step), sync_files=False)
        with warnings.catch_warnings():  # a single process without a process group is intended
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(staged, storage_writer=writer, planner=RowRangePlanner(sources=sources),
                     process_group=self._group)
        # dcp.save returns on rank 0 only after every rank's files are written and the metadata with them.
        num_bytes, stored_bytes = 0, None
        if self.is_main:
            num_bytes = writer.num_bytes + side_bytes
            marker = runtime.CheckpointMarker(step, kind, parent, num_bytes)
            listed, markers = self._scan()  # the one listing of a save: to count, then to prune
            markers[step] = marker
            stored_bytes = self._stored_bytes(markers)
            if self.budget_bytes is not None and stored_bytes > self.budget_bytes:
                self.fs.rm(path, recursive=True)  # never marked, so never loaded: an unfinished save's cost
                raise StorageQuotaExceeded(
                    f"checkpoint step {step} not saved: the job's checkpoints would take {stored_bytes} bytes, "
                    f"over the {self.budget_bytes} bytes the tenant's storage quota leaves it (quota.storage); "
                    f"the earlier checkpoints are kept")
            self.fs.pipe_file(f"{path}/{runtime.CHECKPOINT_MARKER}", marker.to_bytes())
            self._read_markers[step] = marker
        else:
            marker = runtime.CheckpointMarker(step, kind, parent)
        landed = time.perf_counter() - start  # the save is complete; pruning is housekeeping after it
        self._chain = [*self._chain, marker] if kind == runtime.CHECKPOINT_DELTA else [marker]
        if self.is_main:
            self._prune((listed, markers))
        blocked, waited = stalled
        return SavedCheckpoint(step, self.step_uri(step), num_bytes, landed, blocked, kind, parent, waited,
                               stored_bytes)

    def load_latest(self, state: dict[str, Any], *, optional: tuple[str, ...] = (),
                    sinks: dict[str, Any] | None = None) -> int | None:
        """Load the newest step that restores into `state`; its step, or None if none exists.

        A full checkpoint loads as it is; a delta's chain loads its full checkpoint, then each delta in order.
        A chain that fails to load (a file lost or corrupted later) is skipped for the step before it. DCP
        raises on every rank when any rank fails, so all ranks skip together. `optional`: dotted paths of parts
        of `state` that checkpoints written before those parts existed lack (`trainer.best`); such a checkpoint
        loads without them, and they keep what `state` holds. `sinks`: fields of the tables kept elsewhere (a
        tiered table's, by `<table>.<field>`), given their rows as they are read (dcp_read.SafeLoadPlanner).
        """
        markers = self.markers()
        steps = runtime.restorable_steps(markers)
        for step in steps:
            chain = runtime.chain_of(step, markers) or []
            try:
                for link in chain:
                    self._load(link, state, whole=link == chain[0], optional=optional, sinks=sinks or {})
                self._chain = [markers[link] for link in chain]
                return step
            except (Exception, CheckpointException) as exc:  # noqa: BLE001 - any unreadable one is skipped
                # The error's type only (its message may quote the bytes it could not read), except for refusals
                # of dcp_read, whose messages are written never to.
                why = str(exc) if isinstance(exc, dcp_read.UnsafeCheckpoint) else type(exc).__name__
                print(f"checkpoint {self.step_uri(step)} unreadable ({why}), trying an older one", file=sys.stderr)
        if steps:
            raise RuntimeError(f"none of the complete checkpoints under {self.uri} could be loaded")
        return None

    def _load(self, step: int, state: dict[str, Any], *, whole: bool, optional: tuple[str, ...],
              sinks: dict[str, Any]) -> None:
        """Load a full checkpoint into `state`, or apply a delta on it (its dense part whole, its rows)."""
        path = self._checked_step(step, write=False)
        for file in self.fs.find(path):  # a file of the folder may be a symlink too
            self.guard.readable(self.guard.uri_of(self.fs, file), where=f"{_WHERE} ({runtime.step_dir(step)})")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            saved = dcp_read.SafeReader(self.step_uri(step)).read_metadata().state_dict_metadata
            if whole:
                dcp_read.load(_without_absent(state, saved, optional), self.step_uri(step),
                              sinks={f"{delta.TABLES_KEY}.{key}": sink for key, sink in sinks.items()})
                return
            entries = delta.entries_of(saved)
            dense = {k: v for k, v in state.items() if k != delta.TABLES_KEY}
            dcp_read.load({**_without_absent(dense, saved, optional), delta.DELTA_KEY: entries}, self.step_uri(step))
        delta.apply(state[delta.TABLES_KEY], entries, sinks)

    def _listed_steps(self) -> list[int]:
        root = self.guard.fs(self.guard.writable(self.uri, where=_WHERE))[1]  # again: it may have become a symlink
        self.fs.invalidate_cache(root)
        try:
            names = [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(root, detail=False)]
        except FileNotFoundError:
            return []
        return sorted((s for n in names if (s := runtime.step_of_dir(n)) is not None), reverse=True)

    def _kept(self, markers: Mapping[int, runtime.CheckpointMarker]) -> tuple[list[int], set[int]]:
        """The newest `keep` restorable steps, and every folder pruning keeps for them and the pinned one."""
        kept = runtime.restorable_steps(markers)[: self.keep]
        pinned = [self.pinned_step] if self.pinned_step is not None else []
        return kept, runtime.steps_needed([*kept, *pinned], markers)

    def _stored_bytes(self, markers: Mapping[int, runtime.CheckpointMarker]) -> int:
        """The bytes of the folders pruning keeps of these complete ones (a marker without a size, from an older
        trainer, is measured)."""
        _, needed = self._kept(markers)
        total = 0
        for step in needed:
            size = markers[step].num_bytes
            total += size if size is not None else self.fs.du(self._checked_step(step, write=False))
        return total

    def _prune(self, scanned: tuple[list[int], Mapping[int, runtime.CheckpointMarker]] | None = None) -> None:
        """Keep the newest `keep` restorable steps, the pinned one (the best) and the chains they need; drop
        every older folder, complete or partial, and any complete delta whose chain is broken, newest first (a
        delta before its base). A partial folder newer than them all is left: it may be a save to come.
        `scanned`: the folders and complete ones, as `_scan` found them and the save just marked (None: scan)."""
        listed, markers = scanned or self._scan()
        kept, needed = self._kept(markers)
        if not kept:
            return
        for step in listed:
            if step not in needed and (step < kept[0] or step in markers):
                path = self._checked_step(step, write=True)
                if step in markers:  # unmarked first: a folder half deleted is never taken for complete
                    self.fs.rm(f"{path}/{runtime.CHECKPOINT_MARKER}")
                self.fs.rm(path, recursive=True)


def _copy(state: Any) -> Any:
    """A copy of every tensor in a (nested) state dict, on the CPU where it is plain, so training can go on."""
    if isinstance(state, dict):
        return {k: _copy(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_copy(v) for v in state]
    if isinstance(state, torch.Tensor):
        if is_placeholder(state):  # stands for rows read from elsewhere as they are written (`sources`)
            return state
        if type(state) is torch.Tensor:
            return state.detach().to("cpu", copy=True)
        return state.detach().clone()  # a DTensor keeps its placement; its local rows are copied
    return state


def _without_absent(state: dict[str, Any], saved: Mapping[str, Any], optional: tuple[str, ...]) -> dict[str, Any]:
    """`state` less each `optional` part that no key of the checkpoint (`saved`, DCP's dotted keys) lies under.
    Only the dicts on the way to a dropped part are copied: every tensor is still the caller's, loaded in place."""
    for path in optional:
        if any(key == path or key.startswith(f"{path}.") for key in saved):
            continue
        *parents, last = path.split(".")
        state = dict(state)
        node = state
        for name in parents:
            node[name] = dict(node[name])
            node = node[name]
        node.pop(last, None)
    return state
