"""A group of tiered tables: every row and its optimizer state on local disk, the hot rows in memory.

The group looks to `embedding.EmbeddingCollection` like a group of row-wise sharded in-memory tables whose
`shard` (the rows this rank owns) happens to have only `capacity` rows: the cache. A lookup turns the rows it
needs into cache slots (`cache.SlotCache`), and from there the vectors, their gradients and the sparse
optimizer's update run unchanged on the cache's weight and state tensors, the slots standing in for rows. So a
tiered table trains with the same arithmetic as an in-memory one, whatever the optimizer (the tests hold it to
that, to float tolerance).

The rows a step needs are made resident before it looks them up: the trainer hands the next batch to `prefetch`
while the current step runs, and a background thread works out the next batch's rows, evicts what the policy
says (writing back the rows that changed since they were fetched) and reads the missing rows from the store
into the freed slots. The step in flight and the next one are pinned, so neither is evicted under the other.
The lookup then only waits for that job (the `fetch wait` of the metrics); anything the prefetch could not know
(a batch without a prefetch: the first, an eval) is fetched there and then.

Slot bookkeeping happens only on the prefetch thread or while it is idle; the training thread reads the slots
of its own step and writes the dirty flags of those slots only, so the two never touch the same entry.

Several ranks: each rank's store holds its rows of the group's tables (as `sharding.RowLayout` cuts them); the
owner of a row turns the rows other ranks ask for into slots in `gather`. Prefetch across ranks (asking the
owners a step ahead) is not there yet: at more than one rank the owner fetches its misses when asked.

The `tiered` table kind's group: `kembed_trainer.tables.tiered` builds it for tables with a `tier` (its contract
half: `kembed_contract.kinds.tables.tiered`).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numba
import numpy as np
import torch

from kembed_contract import runtime
from kembed_contract import trainer_config as config
from kembed_trainer import embedding, hugepages, sharding, step_writer
from kembed_trainer.tiered import cache as tier_cache
from kembed_trainer.tiered import snapshot as tier_snapshot
from kembed_trainer.tiered import store as tier_store

__all__ = ["TierStats", "TieredGroup", "cache_rows_of", "warm"]

_INIT_CHUNK = 1 << 16  # rows initialised per write: the in-memory tables' seeding block (`embedding._INIT_BLOCK`)


def record_floats(dim: int, state_widths: list[int]) -> int:
    return dim + sum(state_widths)


def cache_rows_of(table: config.TableConfig, optimizer: str, world_size: int) -> int:
    """The cache rows a table's tier asks each rank for (`TierConfig.cache_rows_for`)."""
    assert table.tier is not None
    return table.tier.cache_rows_for(table, optimizer, world_size=world_size)


# Rows between the cache's tensors and records, in compiled loops on the prefetch thread: one core, the GIL
# released (torch's indexing there ran on the training threads' cores as well).
@numba.njit(nogil=True, cache=True)
def _gather(field: np.ndarray, slots: np.ndarray, out: np.ndarray, first: int) -> None:
    for i in range(slots.shape[0]):
        out[i, first:first + field.shape[1]] = field[slots[i]]


@numba.njit(nogil=True, cache=True)
def _scatter(records: np.ndarray, first: int, slots: np.ndarray, field: np.ndarray) -> None:
    for i in range(slots.shape[0]):
        field[slots[i]] = records[i, first:first + field.shape[1]]


class TierStats:
    """Counters since the last `take_stats`: lookups, the distinct rows they needed, rows fetched from the store
    (a prefetch that guessed wrong included) and written back, their bytes, the seconds lookups waited for rows
    (`wait_seconds`, on the training thread) and the seconds spent moving rows (`io_seconds`, mostly on the
    prefetch thread, overlapping the steps)."""

    def __init__(self) -> None:
        self.lookups = self.rows = self.fetched = self.written = 0
        self.fetched_bytes = self.written_bytes = 0
        self.wait_seconds = self.io_seconds = 0.0

    def add(self, other: TierStats) -> None:
        for name, value in vars(other).items():
            setattr(self, name, getattr(self, name) + value)


class TieredGroup(embedding.Group):
    tiered = True

    def __init__(
        self,
        tables: list[config.TableConfig],
        *,
        optimizer: str,
        device: torch.device,
        seed: int,
        table_ids: list[int],
        rank: int,
        world_size: int,
        counts_admission: bool = True,
    ) -> None:
        """`counts_admission=False`: a dynamic table's index counts `admit_after` (embedding.Group)."""
        if device.type != "cpu":
            raise ValueError("tiered tables train on CPU for now (the GPU's level, device over host, comes next)")
        super().__init__(tables, [True] * len(tables), device=device, gen=None, seed=seed, table_ids=table_ids,
                         rank=rank, world_size=world_size, hold_shard=False, counts_admission=counts_admission)
        self.optimizer_name = optimizer
        self.seed, self.table_ids, self.rank = seed, table_ids, rank
        local_rows = self.layout.num_local_rows
        self.capacity = min(local_rows, sum(cache_rows_of(t, optimizer, world_size) for t in tables))
        self.cache = tier_cache.SlotCache(local_rows, max(1, self.capacity))
        self.shard = hugepages.empty(self.cache.capacity, self.dim, device=device)
        self.shard.zero_()
        self.shard_changed = torch.from_numpy(self.cache.dirty)  # the optimizer marks the slots it updates
        self.io_threads = max(t.tier.io_threads for t in tables)
        self.files: list[tier_store.RowFile] = []
        self._fields: list[tuple[torch.Tensor, int, int]] = []  # (tensor, first float, floats) of a record
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="tier-prefetch")
        self._io = ThreadPoolExecutor(self.io_threads, thread_name_prefix="tier-io")
        self._job: Future | None = None
        self._prefetched: tuple[np.ndarray, np.ndarray] | None = None  # (rows, slots) the last prefetch made ready
        self.stats = TierStats()
        # Rows written back since the last checkpoint (their changes are in the store): with the dirty cached
        # rows, what an incremental checkpoint saves. One byte a row.
        self.changed_rows = np.zeros(local_rows, np.bool_)
        self._snapshot: tier_snapshot.Snapshot | None = None  # the stores as the save in flight began with them
        bounds = [int(x) for x in self.layout.starts_on[rank]] + [local_rows]
        self._file_starts = np.array(bounds, dtype=np.int64)

    # ------------------------------------------------------------------------------------------- set-up
    def open(self, folder: str | None = None) -> None:
        """Create this rank's row files (initialised as the in-memory tables would be) once `shard_state` is set."""
        widths = []
        first = self.dim
        self._fields = [(self.shard, 0, self.dim)]
        for tensor in self.shard_state.values():
            width = tensor[0].numel() if tensor.dim() > 1 else 1
            self._fields.append((tensor, first, width))
            first += width
            widths.append(width)
        self.record_floats = record_floats(self.dim, widths)
        base = folder or os.environ.get(runtime.ENV_LOCAL_DIR) or tempfile.gettempdir()
        self._folder = base
        for i, t in enumerate(self.tables):
            path = os.path.join(base, f"kembed-tier-{os.getpid()}-{t.name}.rank{self.rank}.rows")
            rows = int(self.layout.rows_on[self.rank, i])
            f = tier_store.RowFile(path, rows, self.record_floats, io_threads=self.io_threads, executor=self._io)
            os.unlink(path)  # the open file keeps it: nothing is left behind, however the process ends
            self.files.append(f)
            self._initialise(i, f)
        # Compile the cache's and the reads' loops now, not in the first step.
        self.cache.plan(np.empty(0, np.int64), count=False)
        self._into_slots(np.empty(0, np.int64), self._records_of(np.empty(0, np.int64)))
        if self.files and self.files[0].num_rows:
            self.files[0].read_range(0, np.empty((1, self.record_floats), np.float32))

    def _initialise(self, i: int, f: tier_store.RowFile) -> None:
        lo = self.layout.table_lo(i)
        bound = embedding._bound(self.tables[i])
        buf = torch.zeros(_INIT_CHUNK, self.record_floats)
        row = 0
        while row < f.num_rows:
            # Cut at the seeding blocks, so each block of initial values is drawn once.
            n = min(f.num_rows - row, _INIT_CHUNK - (lo + row) % _INIT_CHUNK)
            chunk = buf[:n]
            chunk.zero_()
            weight = torch.empty(n, self.dim)
            embedding._seeded_uniform(weight, lo + row, bound, seed=self.seed, table=self.table_ids[i])
            chunk[:, : self.dim] = weight
            f.write_range(row, chunk.numpy())
            row += n

    # ------------------------------------------------------------------------------------------- lookups
    def gather(self, rows: torch.Tensor) -> tuple[torch.Tensor, embedding._Touched]:
        """The vectors of sorted unique storage `rows`, as the in-memory group gives them, read from the cache.
        The owner's rows (its `requested`) become cache slots, so gradients and updates land in the cache."""
        local, counts = self.layout.split_by_owner(rows)
        exchange = sharding.Exchange.plan(local, counts)
        vectors = torch.empty(rows.numel(), self.dim, device=rows.device)
        if not torch.is_grad_enabled():  # evaluation: read through, the cache left as training needs it
            answer = self._read_through(exchange.requested)
            exchange.requested = torch.arange(answer.shape[0])
            exchange.fetch(answer, out=vectors)
        else:
            exchange.requested = self._slots_of(exchange.requested, alone=exchange.alone)
            exchange.fetch(self.shard, out=vectors)
        return vectors, embedding._Touched(rows[:0], 0, exchange)

    def _read_through(self, requested: torch.Tensor) -> torch.Tensor:
        """The weights of local rows `requested`: cached ones from the cache (they may be newer than the
        store), the others read from the store and not cached (an eval batch may be larger than the cache)."""
        self._wait()
        req = requested.numpy()
        slots = self.cache.resident(req)
        out = torch.empty(req.shape[0], self.dim)
        hit = torch.from_numpy(slots >= 0)
        out[hit] = self.shard.index_select(0, torch.from_numpy(slots[slots >= 0]))
        if not bool(hit.all()):
            missing, where = np.unique(req[slots < 0], return_inverse=True)
            records = np.empty((missing.shape[0], self.record_floats), np.float32)
            self._read(missing, records, self.stats)
            out[~hit] = torch.from_numpy(records[:, : self.dim])[torch.from_numpy(where.reshape(-1))]
        return out

    def shard_table(self, slots: torch.Tensor) -> torch.Tensor:
        rows = torch.from_numpy(self.cache.row_of_slot).index_select(0, slots)
        return self.layout.local_table_of(rows)

    def _slots_of(self, requested: torch.Tensor, *, alone: bool) -> torch.Tensor:
        """Cache slots of this rank's local rows `requested`, fetching what is not resident."""
        waited = time.perf_counter()
        self._wait()
        req = requested.numpy()
        rows = req if alone else np.unique(req)
        self.stats.lookups += 1
        self.stats.rows += rows.shape[0]
        ready = self._prefetched
        self._prefetched = None
        if ready is not None and np.array_equal(ready[0], rows):
            slots = ready[1]
        else:
            plan = self.cache.plan(rows, count=ready is None)  # a wrong guess already counted its rows
            self._move(plan, self.stats)
            slots = plan.slots
        self.stats.wait_seconds += time.perf_counter() - waited
        if not alone:
            slots = self.cache.resident(req)
        return torch.from_numpy(np.ascontiguousarray(slots))

    def prefetch(self, rows: Callable[[], torch.Tensor] | torch.Tensor) -> None:
        """Make the local rows `rows` (sorted, unique; or a function that works them out) resident on the
        background thread, while the step in flight trains."""
        self._wait()
        self._job = self._executor.submit(self._prefetch, rows)

    def _prefetch(self, rows) -> TierStats:
        stats = TierStats()
        if callable(rows):
            rows = rows()
        rows = rows.numpy() if isinstance(rows, torch.Tensor) else rows
        plan = self.cache.plan(rows, count=True)
        self._move(plan, stats)
        self._prefetched = (rows, plan.slots)
        return stats

    def _wait(self) -> None:
        if self._job is not None:
            job, self._job = self._job, None
            self.stats.add(job.result())  # an error on the prefetch thread surfaces here, in the training thread

    # ------------------------------------------------------------------------------------------- moving rows
    def _move(self, plan: tier_cache.Plan, stats: TierStats) -> None:
        """Write back the plan's dirty victims, then read its missing rows into their slots."""
        started = time.perf_counter()
        if plan.evict_rows.shape[0]:
            self._write(plan.evict_rows, self._records_of(plan.evict_slots), stats)
        if plan.fetch_rows.shape[0]:
            buf = np.empty((plan.fetch_rows.shape[0], self.record_floats), np.float32)
            self._read(plan.fetch_rows, buf, stats)
            self._into_slots(plan.fetch_slots, buf)
        stats.io_seconds += time.perf_counter() - started

    def _records_of(self, slots: np.ndarray) -> np.ndarray:
        out = np.empty((slots.shape[0], self.record_floats), np.float32)
        for tensor, first, width in self._fields:
            _gather(tensor.numpy().reshape(-1, width), slots, out, first)
        return out

    def _into_slots(self, slots: np.ndarray, records: np.ndarray) -> None:
        for tensor, first, width in self._fields:
            _scatter(records, first, slots, tensor.numpy().reshape(-1, width))

    def _by_file(self, rows: np.ndarray):
        """(table, its file, its rows, the slice of `rows`) for each table file `rows` (sorted local rows) fall
        in."""
        cuts = np.searchsorted(rows, self._file_starts)
        for i, f in enumerate(self.files):
            lo, hi = int(cuts[i]), int(cuts[i + 1])
            if hi > lo:
                yield i, f, rows[lo:hi] - self._file_starts[i], slice(lo, hi)

    def _read(self, rows: np.ndarray, out: np.ndarray, stats: TierStats) -> None:
        for _, f, file_rows, part in self._by_file(rows):
            f.read(file_rows, out[part])
        stats.fetched += rows.shape[0]
        stats.fetched_bytes += out.nbytes

    def _write(self, rows: np.ndarray, values: np.ndarray, stats: TierStats) -> None:
        self.changed_rows[rows] = True
        snapshot = self._snapshot
        for i, f, file_rows, part in self._by_file(rows):
            if snapshot is not None:  # a save is reading the stores: keep what it began with
                snapshot.before_write(i, file_rows)
            f.write(file_rows, np.ascontiguousarray(values[part]))
        stats.written += rows.shape[0]
        stats.written_bytes += values.nbytes

    # ------------------------------------------------------------------------------------------- saves
    def begin_snapshot(self) -> None:
        """From here until `end_snapshot`, `saved_records` reads the stores as they are now (`flush` first),
        while training goes on writing to them (tiered.snapshot: copy-on-write)."""
        assert self._snapshot is None, "one save at a time"
        self._snapshot = tier_snapshot.Snapshot(
            self.files, self._folder, f"kembed-tier-{os.getpid()}-group{self.table_ids[0]}.rank{self.rank}")

    def end_snapshot(self) -> int:
        """Close the snapshot (its save landed); the rows it copied aside."""
        snapshot, self._snapshot = self._snapshot, None
        if snapshot is None:
            return 0
        snapshot.close()
        return snapshot.rows_copied

    def saved_records(self, i: int, rows: np.ndarray) -> np.ndarray:
        """Records of this rank's sorted rows `rows` of table `i`, as the save in flight began with them (as the
        store holds them when there is none)."""
        snapshot = self._snapshot
        if snapshot is None:
            return self.read_records(i, rows)
        out = np.empty((rows.shape[0], self.record_floats), np.float32)
        snapshot.read(i, np.ascontiguousarray(rows, dtype=np.int64), out)
        return out

    def flush(self) -> None:
        """Write every changed cached row back to the store (they stay cached, now clean)."""
        self._wait()
        slots = self.cache.dirty_slots()
        if slots.shape[0]:
            rows = self.cache.row_of_slot[slots]
            order = np.argsort(rows)
            self._write(rows[order], self._records_of(slots[order]), self.stats)
            self.cache.dirty[slots] = False

    def read_rows(self, i: int, first: int, num_rows: int) -> dict[str, torch.Tensor]:
        """Rows `first`.. of this rank's rows of table `i`, as `weight` and the optimizer's state (`flush`
        first: the store alone is read)."""
        buf = np.empty((num_rows, self.record_floats), np.float32)
        self.files[i].read_range(first, buf)
        records = torch.from_numpy(buf)
        names = ["weight", *self.shard_state]
        out = {}
        for name, (tensor, lo, width) in zip(names, self._fields, strict=True):
            part = records[:, lo:lo + width]
            out[name] = part if tensor.dim() > 1 else part[:, 0]
        return out

    def fields(self, i: int) -> dict[str, TableField]:
        """Table `i`'s weight and optimizer state on this rank, as the store holds them (`flush` first)."""
        names = ["weight", *self.shard_state]
        return {name: TableField(self, i, k) for k, name in enumerate(names)}

    def changed_local_rows(self, i: int) -> np.ndarray:
        """This rank's rows of table `i` (its own row numbers) changed since `forget_changes` (`flush` first)."""
        lo, hi = int(self._file_starts[i]), int(self._file_starts[i + 1])
        return np.flatnonzero(self.changed_rows[lo:hi])

    def forget_changes(self) -> None:
        self.changed_rows[:] = False

    def drop_cache(self) -> None:
        """Forget every cached row without writing it back (the store was just loaded from a checkpoint)."""
        self._wait()
        self._prefetched = None
        self.cache = tier_cache.SlotCache(self.cache.num_rows, self.cache.capacity)
        self.shard_changed = torch.from_numpy(self.cache.dirty)

    def read_table(self, i: int) -> dict[str, torch.Tensor]:
        """Every row this rank holds of table `i` (tests; whole tables do not fit in memory by design)."""
        self.flush()
        return self.read_rows(i, 0, self.files[i].num_rows)

    def read_records(self, i: int, rows: np.ndarray) -> np.ndarray:
        """Records of this rank's sorted rows `rows` of table `i` (its own numbering)."""
        out = np.empty((rows.shape[0], self.record_floats), np.float32)
        self.files[i].read(np.ascontiguousarray(rows, dtype=np.int64), out)
        return out

    def write_field(self, i: int, field: int, rows: np.ndarray, values: torch.Tensor) -> None:
        """Set one field of the records of sorted rows `rows` of table `i` (read, changed, written back)."""
        _, first, width = self._fields[field]
        records = self.read_records(i, rows)
        records[:, first:first + width] = values.reshape(rows.shape[0], width).numpy()
        self.files[i].write(np.ascontiguousarray(rows, dtype=np.int64), records)

    def take_stats(self) -> TierStats:
        stats, self.stats = self.stats, TierStats()
        return stats

    @property
    def memory_bytes(self) -> int:
        """Memory this group holds: the cache's rows and state, and its per-row bookkeeping."""
        tensors = [self.shard, *self.shard_state.values()]
        c = self.cache
        maps = (c.slot_of_row, c.row_of_slot, c.count, c.pin, c.dirty, c.free, self.changed_rows)
        return sum(t.numel() * t.element_size() for t in tensors) + sum(a.nbytes for a in maps)

    def close(self) -> None:
        try:
            self._wait()
        finally:
            self.end_snapshot()
            self._executor.shutdown()
            for f in self.files:
                f.close()
            self._io.shutdown()


class TableField:
    """One field (the weight or an optimizer state) of one tiered table on this rank, in the store: what a
    checkpoint streams, a chunk of rows at a time, instead of a tensor in memory. Rows are the table's own
    numbers (this rank holds `lo`.. `lo + num_rows`)."""

    def __init__(self, group: TieredGroup, i: int, field: int) -> None:
        self.group, self.i, self.field = group, i, field
        tensor, _, self.width = group._fields[field]
        self.lo = group.layout.table_lo(i)
        self.num_rows = group.files[i].num_rows
        self.shape = (self.num_rows, self.width) if tensor.dim() > 1 else (self.num_rows,)

    def placeholder(self) -> torch.Tensor:
        """A tensor of this field's shape that holds nothing (`step_writer.placeholder`): DCP plans with it."""
        return step_writer.placeholder(self.shape)

    def read(self, first_row: int, num_rows: int, rows: np.ndarray | None = None) -> torch.Tensor:
        """Rows `first_row`.. (table rows), or the table rows `rows` (sorted) when given, as the save in flight
        began with them (`TieredGroup.saved_records`)."""
        local = (np.arange(num_rows, dtype=np.int64) + first_row if rows is None else rows) - self.lo
        records = self.group.saved_records(self.i, local)
        _, first, width = self.group._fields[self.field]
        part = torch.from_numpy(np.ascontiguousarray(records[:, first:first + width]))
        return part if len(self.shape) > 1 else part[:, 0]

    def write(self, rows: np.ndarray, values: torch.Tensor) -> None:
        """Set the table rows `rows` (any order; this rank's only) to `values`."""
        order = np.argsort(rows, kind="stable")
        self.group.write_field(self.i, self.field, rows[order] - self.lo, values[torch.from_numpy(order)])

    def write_held(self, rows: np.ndarray, values: torch.Tensor) -> None:
        """Set those of the table rows `rows` that this rank holds (a delta written at another world size)."""
        held = (rows >= self.lo) & (rows < self.lo + self.num_rows)
        if held.any():
            self.write(rows[held], values[torch.from_numpy(held)])

    def write_local(self, first: int, values: torch.Tensor) -> None:
        """Set this rank's rows `first`.. (its own numbering) to `values` (a chunk DCP loaded)."""
        self.write(np.arange(first, first + values.shape[0], dtype=np.int64) + self.lo, values)

    def reader(self, rows: np.ndarray | None = None):
        """A function (first, count) -> tensor over this field's rows: table rows `first`.. (DCP's chunk of a
        whole field), or entries `first`.. of the table rows `rows` (a delta's changed rows)."""
        if rows is None:
            return lambda first, count: self.read(first, count)
        return lambda first, count: self.read(0, count, rows=rows[first:first + count])


def warm() -> None:
    """Compile `_gather` and `_scatter` for the argument types `TieredGroup._records_of` and `_into_slots` pass
    (a field of the cache as a float32 matrix, int64 slots, float32 records), on no slots
    (kembed_trainer.kernel_cache builds the platform's cache with this)."""
    field = np.zeros((1, 1), np.float32)
    records = np.empty((0, 1), np.float32)
    _gather(field, np.empty(0, np.int64), records, 0)
    _scatter(records, 0, np.empty(0, np.int64), field)
