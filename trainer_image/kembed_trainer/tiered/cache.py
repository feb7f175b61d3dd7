"""Which rows of a tiered table sit in memory: a fully associative cache of `capacity` slots with an LFU policy.

Policy (chosen by measurement, docs/benchmarks.md "Tiered tables"): every row (cached or not) has a two-byte use
count, +16 for each step that looks it up (saturating), and every `halve_every` steps all counts halve, so a row
that was hot an hour ago fades while the 4 low bits keep the order among rarely used rows. When a step needs more
free slots than there are, the cached rows with the lowest counts go, `capacity / 64` at a time at least: one
pass over the slots builds a histogram of their counts, which gives the count below which enough rows lie, and a
second pass (starting where the last one stopped, so ties go round-robin as in CLOCK) takes them. No sort, no
per-access list to keep: a lookup touches one count and one slot number per row. Keeping the counts of rows that
are not cached is what makes it beat LRU and CLOCK on Zipf ids: a row evicted and fetched again comes back with
its history, so a one-off row from the tail never displaces a warm one.

Rows that a step in flight uses are pinned (`pin` holds the generation of the last lookup that used each slot)
and never evicted: the batch being trained and the next one being fetched. Everything here is index bookkeeping
on NumPy arrays in compiled loops (GIL released); moving the rows' data is the caller's (`tiered.table`).

The row -> slot map is a dense int32 array over the rank's rows, beside the counts: 6 bytes a row, 2 % of a dim-64
row with row-wise Adagrad's state. A dynamic table's id -> row index (`kembed_trainer.dynamic`) sits in front of it, not in its place, and uses
the same policy for its own rows (`least_used`, `aged`: counts kept per row and aged lazily).
"""

from __future__ import annotations

import numba
import numpy as np

from kembed_contract import sizing

__all__ = ["EVICT_SHARE", "HALVE_EVERY", "MAX_COUNT", "USE", "Plan", "SlotCache", "aged", "least_used", "simulate", "warm"]

MAX_COUNT = 65535
USE = 16  # a use adds this: halving keeps 4 bits of the order among rarely used rows
EVICT_SHARE = 64  # evict at least capacity / EVICT_SHARE slots at a time: one pass over the slots per chunk
HALVE_EVERY = 50  # steps (lookups) between halvings of every count


class Plan:
    """What one lookup's rows need: their slots, and the I/O that makes them resident (all sorted by row)."""

    __slots__ = ("slots", "fetch_rows", "fetch_slots", "evict_rows", "evict_slots", "num_hits")

    def __init__(self, slots, fetch_rows, fetch_slots, evict_rows, evict_slots, num_hits) -> None:
        self.slots = slots  # per looked-up row: its slot
        self.fetch_rows, self.fetch_slots = fetch_rows, fetch_slots  # rows to read from the store, into slots
        self.evict_rows, self.evict_slots = evict_rows, evict_slots  # dirty rows to write back, from slots
        self.num_hits = num_hits


class SlotCache:
    def __init__(self, num_rows: int, capacity: int, *, halve_every: int = HALVE_EVERY) -> None:
        if capacity < 1:
            raise ValueError("a tiered table's cache needs at least one row")
        self.num_rows, self.capacity, self.halve_every = num_rows, capacity, halve_every
        if capacity >= 2**31:
            raise ValueError("a tiered table's cache holds fewer than 2**31 rows")
        self.slot_of_row = np.full(num_rows, -1, np.int32)  # 4 bytes a row: slots fit
        self.row_of_slot = np.full(capacity, -1, np.int64)
        self.count = np.zeros(num_rows, np.uint16)
        self.pin = np.full(capacity, -1, np.int64)
        self.dirty = np.zeros(capacity, np.bool_)  # changed since fetched: written back when evicted
        self.free = np.arange(capacity - 1, -1, -1, dtype=np.int64)  # a stack; top at num_free - 1
        self.state = np.zeros(3, np.int64)  # num_free, the eviction hand, lookups since the counts halved
        self.state[0] = capacity
        self.generation = 0

    @property
    def num_cached(self) -> int:
        return self.capacity - int(self.state[0])

    def plan(self, rows: np.ndarray, *, count: bool = True) -> Plan:
        """Make room for sorted, distinct `rows` (a new generation, pinned with the one before it): their slots,
        the rows to fetch and the dirty rows evicted. Raises when the rows cannot all be cached at once."""
        self.generation += 1
        out = _plan(rows, self.slot_of_row, self.row_of_slot, self.count, self.pin, self.dirty, self.free,
                    self.state, self.generation, self.generation - 1, count, self.halve_every)
        if not out[0]:
            raise RuntimeError(f"{sizing.two_steps_words(self.capacity, rows.shape[0])}: give its tier more cache "
                               "rows (or the job more memory, when the tier gives no size)")
        return Plan(*out[1:])

    def resident(self, rows: np.ndarray) -> np.ndarray:
        """Slots of `rows` (-1 where not cached)."""
        return self.slot_of_row[rows].astype(np.int64)

    def dirty_slots(self) -> np.ndarray:
        return np.flatnonzero(self.dirty[: self.capacity]).astype(np.int64)


@numba.njit(nogil=True, cache=True)
def least_used(slot_count: np.ndarray, need: int, hand: int) -> tuple[np.ndarray, int]:
    """The policy's victims: `need` slots (fewer if fewer are evictable) with the lowest counts among the slots
    whose `slot_count` is not negative (negative: not evictable), found by a histogram of the counts and one
    sweep from `hand` (ties go round-robin, as in CLOCK). Returns them in sweep order, and the hand after."""
    capacity = slot_count.shape[0]
    hist = np.zeros(MAX_COUNT + 2, np.int64)
    evictable = 0
    for s in range(capacity):
        if slot_count[s] >= 0:
            hist[slot_count[s]] += 1
            evictable += 1
    need = min(need, evictable)
    victims = np.empty(need, np.int64)
    if need == 0:
        return victims, hand
    below = 0
    threshold = 0
    while below + hist[threshold] < need:
        below += hist[threshold]
        threshold += 1
    take_at_threshold = need - below
    taken = 0
    for _ in range(capacity):  # one sweep from the hand: slots below the threshold, then enough at it
        s = hand
        hand = hand + 1 if hand + 1 < capacity else 0
        c = slot_count[s]
        if c < 0:
            continue
        if c < threshold or (c == threshold and take_at_threshold > 0):
            if c == threshold:
                take_at_threshold -= 1
            victims[taken] = s
            taken += 1
            if taken == need:
                break
    return victims, hand


@numba.njit(nogil=True, cache=True)
def aged(count: int, last_used: int, now: int, halve_every: int) -> int:
    """A count kept lazily (a dynamic table's rows): `count` as of step `last_used`, halved once for every
    multiple of `halve_every` passed since, as the cache halves all its counts at once."""
    halvings = now // halve_every - last_used // halve_every
    return count >> halvings if halvings < 16 else 0


@numba.njit(nogil=True, cache=True)
def _plan(rows, slot_of_row, row_of_slot, count, pin, dirty, free, state, gen, floor, do_count, halve_every):
    n = rows.shape[0]
    capacity = row_of_slot.shape[0]
    slots = np.empty(n, np.int64)
    num_miss = 0
    for i in range(n):
        r = rows[i]
        s = slot_of_row[r]
        slots[i] = s
        if s >= 0:
            pin[s] = gen
        else:
            num_miss += 1
        if do_count:
            count[r] = min(count[r] + USE, MAX_COUNT)
    evict_rows = np.empty(0, np.int64)
    evict_slots = np.empty(0, np.int64)
    num_free = state[0]
    if num_free < num_miss:
        slot_count = np.full(capacity, -1, np.int64)  # evictable slots (occupied, not pinned): their counts
        evictable = 0
        for s in range(capacity):
            if row_of_slot[s] >= 0 and pin[s] < floor:
                slot_count[s] = count[row_of_slot[s]]
                evictable += 1
        if evictable < num_miss - num_free:
            return False, slots, evict_rows, evict_rows, evict_rows, evict_rows, 0
        victims, hand = least_used(slot_count, max(num_miss - num_free, capacity // EVICT_SHARE), state[1])
        state[1] = hand
        victims_row = np.empty(victims.shape[0], np.int64)
        victims_slot = np.empty(victims.shape[0], np.int64)
        num_dirty = 0
        for s in victims:
            r = row_of_slot[s]
            slot_of_row[r] = -1
            row_of_slot[s] = -1
            free[num_free] = s
            num_free += 1
            if dirty[s]:
                victims_row[num_dirty] = r
                victims_slot[num_dirty] = s
                num_dirty += 1
                dirty[s] = False
        order = np.argsort(victims_row[:num_dirty])
        evict_rows = victims_row[:num_dirty][order]
        evict_slots = victims_slot[:num_dirty][order]
    fetch_rows = np.empty(num_miss, np.int64)
    fetch_slots = np.empty(num_miss, np.int64)
    j = 0
    for i in range(n):
        if slots[i] < 0:
            num_free -= 1
            s = free[num_free]
            r = rows[i]
            slot_of_row[r] = s
            row_of_slot[s] = r
            pin[s] = gen
            slots[i] = s
            fetch_rows[j] = r
            fetch_slots[j] = s
            j += 1
    state[0] = num_free
    if do_count:
        state[2] += 1
        if state[2] >= halve_every:
            state[2] = 0
            for r in range(count.shape[0]):
                count[r] >>= 1
    return True, slots, fetch_rows, fetch_slots, evict_rows, evict_slots, n - num_miss


def simulate(num_rows: int, capacity: int, offsets: np.ndarray, rows: np.ndarray, *, halve_every: int = HALVE_EVERY
             ) -> np.ndarray:
    """Hits per step of this cache on a stream of steps (`rows[offsets[s]:offsets[s + 1]]`, sorted and distinct
    within a step), each step pinned with the one before, as training pins them (benchmarks/tiered_store.py)."""
    cache = SlotCache(num_rows, capacity, halve_every=halve_every)
    hits = np.zeros(offsets.shape[0] - 1, np.int64)
    for s in range(offsets.shape[0] - 1):
        plan = cache.plan(rows[offsets[s]:offsets[s + 1]])
        cache.dirty[plan.fetch_slots] = True  # as if every row were updated: write-backs are counted, not done
        hits[s] = plan.num_hits
    return hits


def warm() -> None:
    """Compile `_plan` (and with it `least_used`, which it calls) for the argument types `SlotCache.plan` passes,
    on no rows (kembed_trainer.kernel_cache builds the platform's cache with this). `aged` and `least_used` are
    also compiled into the dynamic index's kernels, which `dynamic.index.warm` compiles."""
    SlotCache(1, 1).plan(np.empty(0, np.int64), count=False)
