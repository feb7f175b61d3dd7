"""A group of dynamic tables: row-wise sharded tables of `capacity + 1` rows whose rows are handed to raw ids as
they come (`index.DynamicIndex`, one per table and rank), the last row shared by ids without a row of their own.
The rows are held in memory (`DynamicGroup`) or in a tiered table's store behind its cache (`DynamicTieredGroup`:
the index maps ids to the store's rows, which it reuses after evictions); the index is in memory either way.

To `embedding.EmbeddingCollection` the group is a group of row-wise sharded in-memory tables; only `rows_of`
differs: instead of an id being its row (or its hash bucket), each id is sent to the rank that owns it
(`index.owner_of`), which finds, admits or evicts and answers with the id's row in the table. From there the
lookup, the gradients and every sparse optimizer run as for any sharded table. A row given to a new id starts
afresh: its vector drawn from the id itself (`initial_vectors`: the same at any world size and whichever row it
lands in) and its optimizer state zero.

Checkpoints hold the index as per-row fields beside the table's own (`<table>.ids`, `.use_count`, `.last_used`)
and, where admission counts, two side tables of their own row spaces (`<table>-pending.*`: ids waiting for
admission; `<table>-bloom.counters`: the filter, by bucket), all sharded `Shard(0)` so DCP reshards them and
deltas carry their changed rows. A restore at another world size leaves some ids on a rank that no longer owns
them: `after_restore` moves them (rows with their vectors and state) to their owners.
"""

from __future__ import annotations

import functools

import numba
import numpy as np
import torch
import torch.distributed as dist

from kembed_contract import trainer_config as config
from kembed_trainer import embedding, hugepages
from kembed_trainer.data import rows as data_rows
from kembed_trainer.dynamic import index as dyn_index
from kembed_trainer.tiered import table as tiered_table

__all__ = ["DynamicGroup", "DynamicTieredGroup", "initial_vectors", "warm"]


def initial_vectors(ids: np.ndarray, dim: int, bound: float, *, seed: int, table: int) -> torch.Tensor:
    """Each id's starting vector, U(-bound, bound) drawn from (seed, table, id) alone: an id starts the same
    whichever rank and row it gets, at any world size, and again after an eviction."""
    out = np.empty((ids.shape[0], dim), np.float32)
    _uniform_rows(np.ascontiguousarray(ids, dtype=np.int64), _salt(seed, table), bound, out)
    return torch.from_numpy(out)


@functools.cache
def _salt(seed: int, table: int) -> int:
    return data_rows.hash_string(f"dynamic:{seed}:{table}")


@numba.njit(nogil=True, cache=True)
def _uniform_rows(ids, salt, bound, out):
    """out[i, j] = U(-bound, bound) from splitmix64 of (ids[i], j) and the salt: a counter-based generator."""
    dim = out.shape[1]
    for i in range(ids.shape[0]):
        for j in range(dim):
            x = (np.uint64(ids[i]) * np.uint64(dim) + np.uint64(j)) ^ np.uint64(salt)
            x = (x + np.uint64(0x9E3779B97F4A7C15)) * np.uint64(0xBF58476D1CE4E5B9)
            x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            x = x ^ (x >> np.uint64(31))
            out[i, j] = ((x >> np.uint64(11)) * (2.0 / 9007199254740992.0) - 1.0) * bound


class _Indexed:
    """What a dynamic group adds to the group that holds its rows (in memory or tiered): the indexes, lookups
    through them, their checkpointed fields and metrics. The holder gives `_read_rows` and `_write_rows` (rows with
    their optimizer state, as one float matrix: the weight, then each state's columns) and `_index_changed`."""

    def _start_indexes(self, tables: list[config.TableConfig], *, seed: int, table_ids: list[int], rank: int,
                       world_size: int) -> None:
        if self.shard.device.type != "cpu":
            raise ValueError("dynamic tables train on CPU for now (their index is host memory)")
        self.seed, self.table_ids, self.rank, self.world_size = seed, table_ids, rank, world_size
        self.num_buckets_here = max(0, min(dyn_index.buckets_per_rank(world_size),
                                           dyn_index.NUM_BUCKETS - rank * dyn_index.buckets_per_rank(world_size)))
        self.fields_of: list[dict[str, torch.Tensor]] = []  # per table: the index's per-row tensors
        self.shared_rows: list[int | None] = []  # per table: the shared row among this rank's rows, if here
        self.sides: list[dict[str, embedding.SideTable]] = []
        self.indexes: list[dyn_index.DynamicIndex] = []
        for i, t in enumerate(tables):
            self._add_index(i, t)

    def _add_index(self, i: int, t: config.TableConfig) -> None:
        assert t.dynamic is not None
        piece = self.layout.local_slice(i)
        n = piece.stop - piece.start
        lo = self.layout.table_lo(i)
        row_ids = torch.full((n,), dyn_index.EMPTY, dtype=torch.int64)
        shared = t.num_embeddings - 1 - lo  # the table's last row: ids without a row of their own
        self.shared_rows.append(shared if 0 <= shared < n else None)
        if 0 <= shared < n:
            row_ids[shared] = dyn_index.SHARED
        fields = {"ids": row_ids, "use_count": torch.zeros(n, dtype=torch.int32),
                  "last_used": torch.zeros(n, dtype=torch.int32)}
        arrays = {"row_ids": row_ids.numpy(), "use_count": fields["use_count"].numpy(),
                  "last_used": fields["last_used"].numpy(), "changed": self._index_changed(i)}
        sides: dict[str, embedding.SideTable] = {}
        if t.admit_after and t.dynamic.admission == "counter":
            pending = {"ids": torch.full((n,), dyn_index.EMPTY, dtype=torch.int64),
                       "count": torch.zeros(n, dtype=torch.int32), "last": torch.zeros(n, dtype=torch.int32)}
            changed = torch.zeros(n, dtype=torch.bool)
            sides["pending"] = embedding.SideTable(pending, t.num_embeddings, lo, changed)
            arrays |= {"pending_ids": pending["ids"].numpy(), "pending_count": pending["count"].numpy(),
                       "pending_last": pending["last"].numpy(), "pending_changed": changed.numpy()}
        elif t.admit_after:
            block = -(-t.dynamic.bloom_counters // dyn_index.NUM_BUCKETS)
            counters = torch.zeros(self.num_buckets_here, block, dtype=torch.uint8)
            changed = torch.zeros(self.num_buckets_here, dtype=torch.bool)
            first = self.rank * dyn_index.buckets_per_rank(self.world_size)
            sides["bloom"] = embedding.SideTable({"counters": counters}, dyn_index.NUM_BUCKETS, first, changed)
            arrays |= {"bloom": counters.numpy(), "bloom_changed": changed.numpy()}
        self.fields_of.append(fields)
        self.sides.append(sides)
        self.indexes.append(dyn_index.DynamicIndex(t, arrays=arrays, rank=self.rank, world_size=self.world_size))

    # ------------------------------------------------------------------------------------------- lookups
    def _start_shared_rows(self) -> None:
        """The shared rows' starting vectors (once the rows are held)."""
        for i, shared in enumerate(self.shared_rows):
            if shared is not None:
                self._start_afresh(i, np.array([shared]), ids=np.array([dyn_index.SHARED]))

    def _quiet(self) -> None:
        """Wait until nothing else touches the rows (a tiered group's prefetch thread)."""

    def rows_of(self, ids: list[torch.Tensor], step: int | None = None) -> torch.Tensor:
        """Group rows of each feature's raw ids, from their owners' indexes. In training (gradients on and a
        `step`), owners count, admit and evict; otherwise (evaluation, a prefetch) they only look up."""
        training = step is not None and torch.is_grad_enabled()
        if training:
            self._quiet()
        table = torch.cat([torch.full((v.numel(),), self.feature_table[f], dtype=torch.int64)
                           for f, v in enumerate(ids)]) if ids else torch.empty(0, dtype=torch.int64)
        flat = torch.cat(ids) if ids else torch.empty(0, dtype=torch.int64)
        if self.world_size == 1:
            rows = self._answer(table.numpy(), flat.numpy(), step if training else None)
        else:
            rows = self._ask_owners(table, flat, step if training else None)
        return torch.from_numpy(rows) + self.table_starts[table]

    def _ask_owners(self, table: torch.Tensor, ids: torch.Tensor, step: int | None) -> np.ndarray:
        owner = dyn_index.owner_of(ids.numpy(), self.world_size)
        order = np.argsort(owner, kind="stable")
        send = torch.from_numpy(np.bincount(owner, minlength=self.world_size))
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        send_counts, recv_counts = send.tolist(), recv.tolist()
        asked = torch.empty(sum(recv_counts), 2, dtype=torch.int64)
        question = torch.stack([table, ids], 1)[torch.from_numpy(order)]
        dist.all_to_all_single(asked, question, recv_counts, send_counts)
        answer = torch.from_numpy(self._answer(asked[:, 0].numpy(), asked[:, 1].numpy(), step))
        back = torch.empty(ids.numel(), dtype=torch.int64)
        dist.all_to_all_single(back, answer, send_counts, recv_counts)
        rows = np.empty(ids.numel(), np.int64)
        rows[order] = back.numpy()
        return rows

    def _answer(self, table: np.ndarray, ids: np.ndarray, step: int | None) -> np.ndarray:
        """Rows (of their tables) for ids this rank owns; `step`: a training step's lookup (else read only)."""
        out = np.empty(ids.shape[0], np.int64)
        for i, t in enumerate(self.tables):
            chosen = table == i
            if not chosen.any():
                if step is not None:  # no id of it this step: its time to live still runs
                    self.indexes[i].resolve(np.empty(0, np.int64), step)
                continue
            distinct, where = np.unique(ids[chosen], return_inverse=True)
            if (distinct[:1] <= dyn_index.SHARED).any():
                raise ValueError(f"table {t.name!r}: ids -2**63 and -2**63 + 1 are reserved by dynamic tables")
            if step is None:
                local = self.indexes[i].find(distinct)
            else:
                local, new_rows = self.indexes[i].resolve(distinct, step)
                self._start_afresh(i, new_rows)
            rows = np.where(local >= 0, local + self.layout.table_lo(i), t.num_embeddings - 1)
            out[chosen] = rows[where.reshape(-1)]
        return out

    def _start_afresh(self, i: int, local_rows: np.ndarray, ids: np.ndarray | None = None) -> None:
        """New ids' rows (this rank's rows of table i): their starting vectors and zero optimizer state."""
        if not local_rows.shape[0]:
            return
        ids = self.indexes[i].row_ids[local_rows] if ids is None else ids
        vectors = initial_vectors(ids, self.dim, embedding._bound(self.tables[i]), seed=self.seed,
                                  table=self.table_ids[i])
        floats = torch.zeros(local_rows.shape[0], self._row_floats())
        floats[:, : self.dim] = vectors
        self._write_rows(i, local_rows, floats)

    def _row_floats(self) -> int:
        return self.dim + sum(int(np.prod(s.shape[1:])) for s in self.shard_state.values())

    # ------------------------------------------------------------------------------------------- checkpoints
    def extra_fields(self, i: int) -> dict[str, torch.Tensor]:
        return self.fields_of[i]

    def side_tables(self, i: int) -> dict[str, embedding.SideTable]:
        return self.sides[i]

    def after_restore(self) -> None:
        """The maps from the loaded per-row fields; at another world size than the checkpoint's, ids this rank
        no longer owns go to their owners, with their vectors and optimizer state (a collective)."""
        for index in self.indexes:
            index.rebuild()
        if self.world_size == 1:
            return
        for i, index in enumerate(self.indexes):
            self._send_strays(i, index)

    def _send_strays(self, i: int, index: dyn_index.DynamicIndex) -> None:
        rows, slots = index.strays()
        floats = self._read_rows(i, rows)
        ints = torch.from_numpy(np.stack([index.row_ids[rows], index.use_count[rows].astype(np.int64),
                                          index.last_used[rows].astype(np.int64)], 1))
        waiting = torch.from_numpy(np.stack([index.pending_ids[slots], index.pending_count[slots].astype(np.int64),
                                             index.pending_last[slots].astype(np.int64)], 1))
        index.release(rows, slots)
        index.rebuild()
        got_ints, got_floats = _to_owners(ints, floats, self.world_size)
        got_waiting, _ = _to_owners(waiting, torch.empty(waiting.shape[0], 0), self.world_size)
        # The most used first (ties by id): where rows run out, the least used of those moved here are dropped.
        order = torch.from_numpy(np.lexsort((got_ints[:, 0].numpy(), -got_ints[:, 1].numpy())))
        got_ints, got_floats = got_ints[order], got_floats[order]
        placed = index.take_in(got_ints[:, 0].numpy().copy(), got_ints[:, 1].numpy().astype(np.int32),
                               got_ints[:, 2].numpy().astype(np.int32))
        kept = placed >= 0
        self._write_rows(i, placed[kept], got_floats[torch.from_numpy(kept)])
        if got_waiting.shape[0]:
            order = torch.from_numpy(np.argsort(got_waiting[:, 0].numpy(), kind="stable"))
            got_waiting = got_waiting[order].numpy()
            index.take_in_waiting(got_waiting[:, 0].copy(), got_waiting[:, 1].astype(np.int32),
                                  got_waiting[:, 2].astype(np.int32))

    # ------------------------------------------------------------------------------------------- metrics
    def take_dynamic_stats(self) -> dyn_index.Stats:
        total = dyn_index.Stats()
        for index in self.indexes:
            total.add(index.take_stats())
        return total

    @property
    def rows_in_use(self) -> int:
        return sum(index.rows_in_use for index in self.indexes)

    @property
    def index_bytes(self) -> int:
        """The index's memory: per-row fields, the maps, the admission's counters."""
        return sum(index.nbytes for index in self.indexes)


class DynamicGroup(_Indexed, embedding.Group):
    """Dynamic tables whose rows are in memory (this rank's in `shard`, their state in `shard_state`)."""

    def __init__(self, tables: list[config.TableConfig], *, device: torch.device, seed: int, table_ids: list[int],
                 rank: int, world_size: int) -> None:
        super().__init__(tables, [True] * len(tables), device=device, gen=None, seed=seed, table_ids=table_ids,
                         rank=rank, world_size=world_size, hold_shard=False, counts_admission=False)
        self.shard = hugepages.zeros(self.layout.num_local_rows, self.dim, device=device)
        self.shard_changed = torch.zeros(self.shard.shape[0], dtype=torch.bool)
        self._start_indexes(tables, seed=seed, table_ids=table_ids, rank=rank, world_size=world_size)
        self._start_shared_rows()  # (the optimizer's state, allocated next, starts at zero)

    @property
    def extra_bytes(self) -> int:
        return self.index_bytes

    def _index_changed(self, i: int) -> np.ndarray:
        return self.shard_changed[self.layout.local_slice(i)].numpy()  # deltas save the rows the index moved too

    def _read_rows(self, i: int, rows: np.ndarray) -> torch.Tensor:
        at = torch.from_numpy(rows + self.layout.local_slice(i).start)
        return torch.cat([self.shard.index_select(0, at),
                          *[_as_columns(s.index_select(0, at)) for s in self.shard_state.values()]], 1)

    def _write_rows(self, i: int, rows: np.ndarray, floats: torch.Tensor) -> None:
        at = torch.from_numpy(rows + self.layout.local_slice(i).start)
        self.shard.index_copy_(0, at, floats[:, : self.dim].contiguous())
        first = self.dim
        for s in self.shard_state.values():
            width = int(np.prod(s.shape[1:]))
            s.index_copy_(0, at, floats[:, first:first + width].reshape(-1, *s.shape[1:]).contiguous())
            first += width


class DynamicTieredGroup(_Indexed, tiered_table.TieredGroup):
    """Dynamic tables whose rows are a tiered table's: in the rank's store on local disk, the hot ones cached.
    A row given to a new id is written with its starting vector where it is (its cache slot, marked changed, or
    its record in the store)."""

    def __init__(self, tables: list[config.TableConfig], *, optimizer: str, device: torch.device, seed: int,
                 table_ids: list[int], rank: int, world_size: int) -> None:
        super().__init__(tables, optimizer=optimizer, device=device, seed=seed, table_ids=table_ids, rank=rank,
                         world_size=world_size, counts_admission=False)
        self.index_changed = [np.zeros(int(self.layout.rows_on[rank, i]), np.bool_) for i in range(len(tables))]
        self._start_indexes(tables, seed=seed, table_ids=table_ids, rank=rank, world_size=world_size)

    def _index_changed(self, i: int) -> np.ndarray:
        return self.index_changed[i]

    def open(self, folder: str | None = None) -> None:
        super().open(folder)
        self._start_shared_rows()

    def _quiet(self) -> None:
        self._wait()

    def _read_rows(self, i: int, rows: np.ndarray) -> torch.Tensor:
        """Records of this rank's rows of table i: cached ones from the cache (newer than the store), the rest
        from the store."""
        group_rows = rows + self._file_starts[i]
        slots = self.cache.resident(group_rows)
        out = np.empty((rows.shape[0], self.record_floats), np.float32)
        cached = slots >= 0
        out[cached] = self._records_of(slots[cached])
        if not cached.all():
            order = np.argsort(rows[~cached])
            out[np.flatnonzero(~cached)[order]] = self.read_records(i, rows[~cached][order])
        return torch.from_numpy(out)

    def _write_rows(self, i: int, rows: np.ndarray, floats: torch.Tensor) -> None:
        """Records into this rank's rows of table i: a cached row's slot (written back when evicted or saved),
        else the store (a change the next delta saves)."""
        group_rows = rows + self._file_starts[i]
        records = np.ascontiguousarray(floats.numpy(), dtype=np.float32)
        slots = self.cache.resident(group_rows)
        cached = slots >= 0
        if cached.any():
            self._into_slots(slots[cached], records[cached])
            self.cache.dirty[slots[cached]] = True
        if not cached.all():
            order = np.argsort(rows[~cached])
            self.files[i].write(np.ascontiguousarray(rows[~cached][order], dtype=np.int64),
                                np.ascontiguousarray(records[~cached][order]))
            self.changed_rows[group_rows[~cached]] = True

    def changed_local_rows(self, i: int) -> np.ndarray:
        """Rows whose record or index fields changed since the last checkpoint (`flush` first)."""
        lo, hi = int(self._file_starts[i]), int(self._file_starts[i + 1])
        return np.flatnonzero(self.changed_rows[lo:hi] | self.index_changed[i])

    def forget_changes(self) -> None:
        super().forget_changes()
        for changed in self.index_changed:
            changed[:] = False

    @property
    def memory_bytes(self) -> int:
        """The cache, its bookkeeping and the index (`EmbeddingCollection.num_bytes` counts a tiered group so)."""
        return super().memory_bytes + self.index_bytes


def _as_columns(rows: torch.Tensor) -> torch.Tensor:
    """Rows of a field as a matrix (a 1-d field's: one column)."""
    return rows if rows.dim() == 2 else rows.unsqueeze(1)


def _to_owners(ints: torch.Tensor, floats: torch.Tensor, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Send each entry (its id first in `ints`) to the rank that owns the id: the entries this rank got."""
    owner = dyn_index.owner_of(ints[:, 0].numpy(), world_size) if ints.shape[0] else np.empty(0, np.int64)
    order = torch.from_numpy(np.argsort(owner, kind="stable"))
    send = torch.from_numpy(np.bincount(owner, minlength=world_size).astype(np.int64))
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    send_counts, recv_counts = send.tolist(), recv.tolist()
    out_ints = torch.empty(sum(recv_counts), ints.shape[1], dtype=ints.dtype)
    dist.all_to_all_single(out_ints, ints[order].contiguous(), recv_counts, send_counts)
    out_floats = torch.empty(sum(recv_counts), floats.shape[1], dtype=floats.dtype)
    if floats.shape[1]:
        dist.all_to_all_single(out_floats, floats[order].contiguous(), recv_counts, send_counts)
    return out_ints, out_floats


def warm() -> None:
    """Compile `_uniform_rows` for the argument types `initial_vectors` passes, on no ids
    (kembed_trainer.kernel_cache builds the platform's cache with this)."""
    initial_vectors(np.empty(0, np.int64), 1, 0.5, seed=0, table=0)
