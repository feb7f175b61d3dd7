"""One rank's id -> row index of one dynamic table: which raw id each of its rows holds, admission of new ids,
eviction when full and by time to live. Index bookkeeping only (NumPy arrays, compiled loops); the rows' vectors
are the group's (`dynamic.group`).

Ids are owned by rank through a fixed number of buckets (`NUM_BUCKETS`, cut among the ranks as `torch.chunk`
cuts rows), so a rank can tell any id's owner, and the Bloom filter's counters, laid out by bucket, stay with
their ids at any world size when DCP reshards them. An id's row is one of its owner's rows.

Everything a checkpoint needs is per-row arrays that the group exposes as tensors (`row_ids`, `use_count`,
`last_used`; of the waiting ids `pending_*`; the filter): the hash map from id to row is rebuilt from them on a
restore (`rebuild`). Every choice (which free row a new id takes, which rows go when full) is a function of those
arrays and the step alone, so a resumed run chooses as the uninterrupted one did, bit for bit.

Policy (one, `tiered.cache`'s): a row's use count gains `USE` at each step that looks it up and halves every
`HALVE_EVERY` steps (kept lazily: the count as of its last use, aged on read); when admitted ids need rows and
none is free, the rows with the lowest counts go, at least 1/64 of the rank's rows at a time, never a row this
step uses.
"""

from __future__ import annotations

import numba
import numpy as np

from kembed_contract import trainer_config as config
from kembed_trainer import dynamic
from kembed_trainer.tiered import cache as policy

__all__ = ["EMPTY", "NUM_BUCKETS", "SHARED", "DynamicIndex", "bucket_of", "owner_of", "warm"]

EMPTY, SHARED = dynamic.EMPTY, dynamic.SHARED
NUM_BUCKETS = 1 << 12  # ids' owners are ranges of buckets: at most this many ranks own ids
BLOOM_HASHES = 3  # counters per id in its bucket's block of the filter
_NOT_FOUND = np.iinfo(np.int64).min


@numba.njit(nogil=True, inline="always", cache=True)
def _mix(x):
    """splitmix64's finaliser on an int64's bits (uint64 arithmetic)."""
    z = np.uint64(x) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@numba.njit(nogil=True, cache=True)
def _buckets(ids: np.ndarray) -> np.ndarray:
    out = np.empty(ids.shape[0], np.int64)
    for i in range(ids.shape[0]):
        out[i] = np.int64(_mix(ids[i]) >> np.uint64(52))  # the top 12 bits: NUM_BUCKETS
    return out


def bucket_of(ids: np.ndarray) -> np.ndarray:
    return _buckets(np.ascontiguousarray(ids, dtype=np.int64))


def buckets_per_rank(world_size: int) -> int:
    return -(-NUM_BUCKETS // world_size)


def owner_of(ids: np.ndarray, world_size: int) -> np.ndarray:
    """The rank that owns each id (its bucket's)."""
    return bucket_of(ids) // buckets_per_rank(world_size)


# ----------------------------------------------------------------------------------------------- the hash map
# Open addressing with linear probing; deletions shift the probe run back (no tombstones). Values: a row (>= 0)
# or a waiting id's slot p as -(p + 1).
@numba.njit(nogil=True, cache=True)
def _slot(keys, key):
    mask = keys.shape[0] - 1
    h = np.int64(_mix(key ^ 0x5851F42D4C957F2D) & np.uint64(mask))
    while keys[h] != EMPTY and keys[h] != key:
        h = (h + 1) & mask
    return h


@numba.njit(nogil=True, cache=True)
def _get(keys, values, key):
    h = _slot(keys, key)
    return values[h] if keys[h] == key else _NOT_FOUND


@numba.njit(nogil=True, cache=True)
def _put(keys, values, key, value):
    h = _slot(keys, key)
    keys[h] = key
    values[h] = value


@numba.njit(nogil=True, cache=True)
def _delete(keys, values, key):
    mask = keys.shape[0] - 1
    i = _slot(keys, key)
    if keys[i] != key:
        return
    j = i
    while True:
        j = (j + 1) & mask
        if keys[j] == EMPTY:
            break
        home = np.int64(_mix(keys[j] ^ 0x5851F42D4C957F2D) & np.uint64(mask))
        # Leave keys[j] where it is if its home lies cyclically in (i, j]: its probe never passed i.
        stays = (i < home and home <= j) if i <= j else (home > i or home <= j)
        if stays:
            continue
        keys[i] = keys[j]
        values[i] = values[j]
        i = j
    keys[i] = EMPTY


@numba.njit(nogil=True, cache=True)
def _lookup(keys, values, ids, out):
    for i in range(ids.shape[0]):
        out[i] = _get(keys, values, ids[i])


@numba.njit(nogil=True, cache=True)
def _rebuild(keys, values, row_ids, pending_ids):
    keys[:] = EMPTY
    for r in range(row_ids.shape[0]):
        if row_ids[r] != EMPTY and row_ids[r] != SHARED:
            _put(keys, values, row_ids[r], r)
    for p in range(pending_ids.shape[0]):
        if pending_ids[p] != EMPTY:
            _put(keys, values, pending_ids[p], -(p + 1))


# ----------------------------------------------------------------------------------------------- one step
@numba.njit(nogil=True, cache=True)
def _expire(keys, values, ids, last, changed, free, p_ids, p_last, p_changed, step, ttl):
    """Free the rows (and forget the waiting ids) not looked up in more than `ttl` steps; rows freed."""
    freed = 0
    for r in range(ids.shape[0]):
        if ids[r] != EMPTY and ids[r] != SHARED and step - last[r] > ttl:
            _delete(keys, values, ids[r])
            ids[r] = EMPTY
            changed[r] = True
            freed += 1
            free[1] = min(free[1], r)
    free[0] += freed
    for p in range(p_ids.shape[0]):
        if p_ids[p] != EMPTY and step - p_last[p] > ttl:
            _delete(keys, values, p_ids[p])
            p_ids[p] = EMPTY
            p_changed[p] = True
    return freed


@numba.njit(nogil=True, cache=True)
def _use(found, count, last, changed, step, halve_every):
    """Count a use of every row found (>= 0)."""
    for v in found:
        if v >= 0:
            c = policy.aged(np.int64(count[v]), np.int64(last[v]), step, halve_every) + policy.USE
            count[v] = min(c, policy.MAX_COUNT)
            last[v] = step
            changed[v] = True


@numba.njit(nogil=True, cache=True)
def _count_waiting(keys, values, ids, found, admit, p_ids, p_count, p_last, p_changed, admit_after, step):
    """Counter admission: ids seen in `admit_after` earlier batches are admitted (`admit`); the others' counts
    rise (a new one takes the lowest free slot; with none free, the least seen waiting ids not seen this step
    are forgotten first). Returns the waiting ids forgotten."""
    forgotten = 0
    num = p_ids.shape[0]
    for i in range(ids.shape[0]):  # waiting ids first: all of them pinned before any newcomer needs a slot
        v = found[i]
        if v >= 0 or v == _NOT_FOUND:
            continue
        p = -v - 1
        p_last[p] = step  # seen this step: never forgotten for a newcomer of it (its slot is read in _place)
        p_changed[p] = True
        if p_count[p] >= admit_after:
            admit[i] = True
        else:
            p_count[p] += 1
    lowest = 0  # every slot below it is taken: the search for the lowest free slot resumes there
    for i in range(ids.shape[0]):
        if found[i] != _NOT_FOUND or num == 0:
            continue
        while lowest < num and p_ids[lowest] != EMPTY:
            lowest += 1
        p = lowest if lowest < num else -1
        if p < 0:
            counts = np.full(num, -1, np.int64)
            for q in range(num):
                if p_last[q] != step:
                    counts[q] = min(p_count[q], policy.MAX_COUNT)
            victims, _ = policy.least_used(counts, max(1, num // policy.EVICT_SHARE), 0)
            if victims.shape[0] == 0:
                continue  # every waiting id was seen this step: this one is not counted
            for q in victims:
                _delete(keys, values, p_ids[q])
                p_ids[q] = EMPTY
                p_changed[q] = True
                forgotten += 1
            p = lowest = victims.min()
        p_ids[p] = ids[i]
        p_count[p] = 1
        p_last[p] = step
        p_changed[p] = True
        _put(keys, values, ids[i], -(p + 1))
    return forgotten


@numba.njit(nogil=True, cache=True)
def _bloom_positions(key, block):
    h = _mix(key ^ 0x2545F4914F6CDD1D)
    a = np.int64(h % np.uint64(block))
    b = np.int64((h >> np.uint64(32)) % np.uint64(block)) | 1
    out = np.empty(BLOOM_HASHES, np.int64)
    for j in range(BLOOM_HASHES):
        out[j] = (a + j * b) % block
    return out


@numba.njit(nogil=True, cache=True)
def _count_in_filter(ids, found, admit, filt, filt_changed, first_bucket, admit_after):
    """Bloom admission (a counting Bloom filter read as a count-min sketch, updated conservatively): an id whose
    smallest counter reached `admit_after` is admitted; otherwise its smallest counters rise by one."""
    block = filt.shape[1]
    for i in range(ids.shape[0]):
        if found[i] >= 0:
            continue
        b = np.int64(_mix(ids[i]) >> np.uint64(52)) - first_bucket
        pos = _bloom_positions(ids[i], block)
        least = 255
        for j in range(BLOOM_HASHES):
            least = min(least, np.int64(filt[b, pos[j]]))
        if least >= admit_after:
            admit[i] = True
            continue
        for j in range(BLOOM_HASHES):
            if filt[b, pos[j]] == least:
                filt[b, pos[j]] = least + 1
        filt_changed[b] = True


@numba.njit(nogil=True, cache=True)
def _place(keys, values, ids, admit, found, rows_ids, count, last, changed, free, p_ids, p_changed, step,
           halve_every, reserve):
    """Give the admitted ids rows, lowest free rows first; when too few are free, evict the least used rows not
    used this step (at least `reserve` of them). Ids left without a row keep the shared one (found stays
    negative). Returns (rows evicted, new rows in order of `ids`)."""
    need = 0
    for i in range(ids.shape[0]):
        if admit[i]:
            need += 1
    new_rows = np.empty(need, np.int64)
    if need == 0:
        return 0, new_rows
    num_rows = rows_ids.shape[0]
    evicted = 0
    if free[0] < need:
        counts = np.full(num_rows, -1, np.int64)
        for r in range(num_rows):
            if rows_ids[r] != EMPTY and rows_ids[r] != SHARED and last[r] != step:
                counts[r] = policy.aged(np.int64(count[r]), np.int64(last[r]), step, halve_every)
        victims, _ = policy.least_used(counts, max(need - free[0], reserve), 0)
        for r in victims:
            _delete(keys, values, rows_ids[r])
            rows_ids[r] = EMPTY
            changed[r] = True
            free[1] = min(free[1], r)
        evicted = victims.shape[0]
        free[0] += evicted
    r = free[1]
    placed = 0
    for i in range(ids.shape[0]):
        if not admit[i]:
            continue
        while r < num_rows and rows_ids[r] != EMPTY:
            r += 1
        if r == num_rows:
            break
        if found[i] != _NOT_FOUND:  # a waiting id: its slot is free again
            p = -found[i] - 1
            p_ids[p] = EMPTY
            p_changed[p] = True
        rows_ids[r] = ids[i]
        count[r] = policy.USE
        last[r] = step
        changed[r] = True
        _put(keys, values, ids[i], r)
        found[i] = r
        new_rows[placed] = r
        placed += 1
    free[0] -= placed
    free[1] = r
    return evicted, new_rows[:placed]


@numba.njit(nogil=True, cache=True)
def _take_in(keys, values, rows_ids, count, last, changed, free, ids, counts, lasts):
    """Place rows moved here from another rank (a restore at another world size), lowest free rows first: the
    rows they took (-1 where none was free)."""
    out = np.full(ids.shape[0], -1, np.int64)
    r = free[1]
    for i in range(ids.shape[0]):
        while r < rows_ids.shape[0] and rows_ids[r] != EMPTY:
            r += 1
        if r == rows_ids.shape[0]:
            break
        rows_ids[r] = ids[i]
        count[r] = counts[i]
        last[r] = lasts[i]
        changed[r] = True
        _put(keys, values, ids[i], r)
        out[i] = r
        free[0] -= 1
    free[1] = r
    return out


class Stats:
    """Counts since the last `take`: ids given rows, rows freed because the table was full or their time to
    live passed."""

    def __init__(self) -> None:
        self.admitted = self.evicted_capacity = self.evicted_ttl = 0

    def add(self, other: Stats) -> None:
        for name, value in vars(other).items():
            setattr(self, name, getattr(self, name) + value)


class DynamicIndex:
    """The index of the rows one rank holds of one dynamic table (`num_rows` of them), over arrays the caller
    owns (views of the checkpointed tensors): `row_ids`, `use_count`, `last_used` and `changed` per row; for
    counter admission `pending_ids`, `pending_count`, `pending_last` and `pending_changed` per waiting slot;
    for Bloom admission `bloom` ([this rank's buckets, counters a bucket]) and `bloom_changed` per bucket."""

    def __init__(self, cfg: config.TableConfig, *, arrays: dict[str, np.ndarray], rank: int,
                 world_size: int) -> None:
        assert cfg.dynamic is not None
        self.dynamic = cfg.dynamic
        self.admit_after = cfg.admit_after
        self.rank, self.world_size = rank, world_size
        self.first_bucket = rank * buckets_per_rank(world_size)
        for name in ("row_ids", "use_count", "last_used", "changed"):
            setattr(self, name, arrays[name])
        empty_i64, empty_i32, empty_b = np.empty(0, np.int64), np.empty(0, np.int32), np.empty(0, np.bool_)
        self.pending_ids = arrays.get("pending_ids", empty_i64)
        self.pending_count = arrays.get("pending_count", empty_i32)
        self.pending_last = arrays.get("pending_last", empty_i32)
        self.pending_changed = arrays.get("pending_changed", empty_b)
        self.bloom = arrays.get("bloom", np.empty((0, 1), np.uint8))
        self.bloom_changed = arrays.get("bloom_changed", empty_b)
        size = config.dynamic_map_slots(self.row_ids.shape[0] + self.pending_ids.shape[0])
        self.keys = np.full(size, EMPTY, np.int64)
        self.values = np.zeros(size, np.int32 if self.row_ids.shape[0] < 2**31 else np.int64)
        self.stats = Stats()
        self.reserve = max(1, self.row_ids.shape[0] // policy.EVICT_SHARE)
        # Free rows: how many, and a row below which none is (where the search for the lowest starts). Both
        # follow from `row_ids` (`rebuild` recounts them), kept up to date so a step need not scan the rows.
        self.free = np.zeros(2, np.int64)
        self._count_free()

    def _count_free(self) -> None:
        empty = self.row_ids == EMPTY
        self.free[0] = int(np.count_nonzero(empty))
        self.free[1] = int(np.argmax(empty)) if self.free[0] else self.row_ids.shape[0]

    @property
    def nbytes(self) -> int:
        arrays = (self.row_ids, self.use_count, self.last_used, self.changed, self.pending_ids, self.pending_count,
                  self.pending_last, self.pending_changed, self.bloom, self.bloom_changed, self.keys, self.values)
        return sum(a.nbytes for a in arrays)

    @property
    def rows_in_use(self) -> int:
        return self.row_ids.shape[0] - int(self.free[0]) - int(np.count_nonzero(self.row_ids[-1:] == SHARED))

    def rebuild(self) -> None:
        """The id -> row map from the per-row arrays (after they were loaded)."""
        _rebuild(self.keys, self.values, self.row_ids, self.pending_ids)
        self._count_free()

    def find(self, ids: np.ndarray) -> np.ndarray:
        """Each id's row, or -1 (no row of its own): a lookup that changes nothing (evaluation)."""
        found = np.empty(ids.shape[0], np.int64)
        _lookup(self.keys, self.values, ids, found)
        return np.where(found >= 0, found, -1)

    def resolve(self, ids: np.ndarray, step: int) -> tuple[np.ndarray, np.ndarray]:
        """A training step's lookup of sorted distinct `ids` (all owned here): each one's row (-1: the shared
        row), after expiring, counting, admitting and evicting; and the rows newly given to ids, whose vectors
        the caller starts afresh."""
        dyn = self.dynamic
        if dyn.ttl_steps and step % max(1, dyn.ttl_steps // 16) == 0:
            self.stats.evicted_ttl += _expire(self.keys, self.values, self.row_ids, self.last_used, self.changed,
                                              self.free, self.pending_ids, self.pending_last, self.pending_changed, step,
                                              dyn.ttl_steps)
        found = np.empty(ids.shape[0], np.int64)
        _lookup(self.keys, self.values, ids, found)
        _use(found, self.use_count, self.last_used, self.changed, step, policy.HALVE_EVERY)
        if self.admit_after == 0:
            admit = found < 0
        else:
            admit = np.zeros(ids.shape[0], np.bool_)
            if dyn.admission == "counter":
                _count_waiting(self.keys, self.values, ids, found, admit, self.pending_ids, self.pending_count,
                               self.pending_last, self.pending_changed, self.admit_after, step)
            else:
                _count_in_filter(ids, found, admit, self.bloom, self.bloom_changed, self.first_bucket,
                                 self.admit_after)
        evicted, new_rows = _place(self.keys, self.values, ids, admit, found, self.row_ids, self.use_count,
                                   self.last_used, self.changed, self.free, self.pending_ids, self.pending_changed, step,
                                   policy.HALVE_EVERY, self.reserve)
        self.stats.evicted_capacity += evicted
        self.stats.admitted += new_rows.shape[0]
        return np.where(found >= 0, found, -1), new_rows

    def take_stats(self) -> Stats:
        stats, self.stats = self.stats, Stats()
        return stats

    # ------------------------------------------------------------------------------------------- resharding
    def strays(self) -> tuple[np.ndarray, np.ndarray]:
        """(rows, waiting slots) holding ids another rank owns (after a restore at another world size)."""
        rows = np.flatnonzero((self.row_ids != EMPTY) & (self.row_ids != SHARED))
        rows = rows[owner_of(self.row_ids[rows], self.world_size) != self.rank]
        slots = np.flatnonzero(self.pending_ids != EMPTY)
        slots = slots[owner_of(self.pending_ids[slots], self.world_size) != self.rank]
        return rows, slots

    def release(self, rows: np.ndarray, slots: np.ndarray) -> None:
        """Forget rows and waiting slots (moved to their owners); call `rebuild` after."""
        self.row_ids[rows] = EMPTY
        self.changed[rows] = True
        self.pending_ids[slots] = EMPTY
        self.pending_changed[slots] = True

    def take_in(self, ids: np.ndarray, counts: np.ndarray, lasts: np.ndarray) -> np.ndarray:
        """Rows for moved-in ids, lowest free first, in the order given; -1 where the rank is full (those are
        dropped, counted as evicted for capacity)."""
        rows = _take_in(self.keys, self.values, self.row_ids, self.use_count, self.last_used, self.changed,
                        self.free, ids, counts, lasts)
        self.stats.evicted_capacity += int(np.count_nonzero(rows < 0))
        return rows

    def take_in_waiting(self, ids: np.ndarray, counts: np.ndarray, lasts: np.ndarray) -> None:
        """Waiting ids moved here, into the lowest free slots (those that find none are forgotten)."""
        free = np.flatnonzero(self.pending_ids == EMPTY)[: ids.shape[0]]
        n = free.shape[0]
        self.pending_ids[free], self.pending_count[free], self.pending_last[free] = ids[:n], counts[:n], lasts[:n]
        self.pending_changed[free] = True
        for p, key in zip(free.tolist(), ids[:n].tolist(), strict=True):
            _put(self.keys, self.values, key, -(p + 1))


def warm() -> None:
    """Compile every kernel here for the argument types training passes them, through `DynamicIndex` itself on a
    table of two rows: arrays of the dtypes `dynamic.group` gives the index, ids and steps as a step's lookup, a
    restore and a resharding pass them (kembed_trainer.kernel_cache builds the platform's cache with this).
    Counter admission with a time to live, then Bloom admission: between them every kernel runs once."""
    n = 2
    rows = {"row_ids": np.full(n, EMPTY, np.int64), "use_count": np.zeros(n, np.int32),
            "last_used": np.zeros(n, np.int32), "changed": np.zeros(n, np.bool_)}
    counter = config.TableConfig(name="t", features=["f"], admit_after=1, dynamic={"capacity": 1, "ttl_steps": 1})
    index = DynamicIndex(counter, rank=0, world_size=1, arrays=rows | {
        "pending_ids": np.full(n, EMPTY, np.int64), "pending_count": np.zeros(n, np.int32),
        "pending_last": np.zeros(n, np.int32), "pending_changed": np.zeros(n, np.bool_)})
    none, one = np.empty(0, np.int64), np.zeros(1, np.int32)
    index.resolve(none, 0)  # _expire, _lookup, _use, _count_waiting, _place
    index.find(none)
    index.rebuild()
    index.take_in(none, one[:0], one[:0])
    index.take_in_waiting(np.array([7], np.int64), one, one)  # _put
    index.strays()  # _buckets
    bloom = config.TableConfig(name="t", features=["f"], admit_after=1,
                               dynamic={"capacity": 1, "admission": "bloom", "bloom_counters": NUM_BUCKETS})
    DynamicIndex(bloom, rank=0, world_size=1, arrays=rows | {
        "bloom": np.zeros((NUM_BUCKETS, 1), np.uint8), "bloom_changed": np.zeros(NUM_BUCKETS, np.bool_),
    }).resolve(none, 0)  # _count_in_filter
