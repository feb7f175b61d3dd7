"""Tiered tables: which store holds the rows on local disk, and which cache policy keeps the hot ones in memory.

    nice .venv/bin/python benchmarks/tiered_store.py store            # flat file (pread/pwrite), memmap
    nice .venv/bin/python benchmarks/tiered_store.py store --kv /tmp/tiered-bench-site   # + LMDB, RocksDB
    nice .venv/bin/python benchmarks/tiered_store.py policy           # hit rates on Zipf(1.1) id streams

`store`: a file of `--gb` GB of fixed-width records (a row's weight and its optimizer state: dim 16 + Adagrad,
dim 64 + row-wise Adagrad, dim 128 + Adam), and batches of 10k and 100k distinct random rows (what a cache's
misses and write-backs look like: the cold tail, spread over the file) read and written sorted. "warm": the file
is in the page cache; "cold": before every batch the file's pages are written and dropped
(`posix_fadvise(DONTNEED)`; a map is opened afresh), so every row comes from the disk. The key-value engines
need `--kv DIR`, a folder where `lmdb` and `rocksdict` are installed (`uv pip install --target DIR lmdb rocksdict`):
they are measured, not dependencies.

`policy`: one table of `--rows` rows, ids drawn Zipf(1.1) over a fixed random permutation of the rows (hot rows
spread over the table, as hashed ids are), `--ids-per-step` draws per step (their distinct rows are the step's
batch, which must all be in the cache at once). Each policy sees the same stream; hit rate = the share of a
step's distinct rows already cached, over the steps after the first half (the cache filled and settled).
"""

from __future__ import annotations

import argparse
import mmap
import os
import pathlib
import statistics
import struct
import sys
import tempfile
import time

import numba
import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "trainer_image"))

from kembed_trainer.tiered import store  # noqa: E402 - after the path insert

RECORDS = {  # name: floats per record
    "dim16+adagrad": 16 * 2,
    "dim64+rowwise": 64 + 1,
    "dim128+adam": 128 * 3,
}


def rss_file_mb() -> float:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1]) / 1024
    return 0.0


# ------------------------------------------------------------------------------------------------ stores
class FlatFile:
    def __init__(self, folder: pathlib.Path, rows: int, floats: int, threads: int, ahead: bool = False) -> None:
        self.name = (f"flat file, pread/pwrite, {threads} thread{'s' if threads > 1 else ''}"
                     + (", WILLNEED first" if ahead else ""))
        self.file = store.RowFile(folder / "flat.bin", rows, floats, io_threads=threads, ask_ahead=ahead)
        fill(self.file.fd, rows * floats * 4)

    def read(self, rows):
        out = np.empty((rows.shape[0], self.file.record_floats), np.float32)
        self.file.read(rows, out)
        return out

    def write(self, rows, values):
        self.file.write(rows, values)

    def drop(self):
        self.file.drop_cache()

    def close(self):
        self.file.remove()


class MemMap:
    name = "numpy memmap"

    def __init__(self, folder: pathlib.Path, rows: int, floats: int) -> None:
        self.path, self.shape = folder / "memmap.bin", (rows, floats)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        fill(fd, rows * floats * 4)
        os.close(fd)
        self.map = np.memmap(self.path, np.float32, "r+", shape=self.shape)

    def read(self, rows):
        return self.map[rows]

    def write(self, rows, values):
        self.map[rows] = values

    def drop(self):
        self.map.flush()
        del self.map
        fd = os.open(self.path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        self.map = np.memmap(self.path, np.float32, "r+", shape=self.shape)

    def close(self):
        del self.map
        self.path.unlink()


class MemMapUnmapped:
    """A shared map of the file whose pages are unmapped after every batch (madvise(DONTNEED)): they stay in the
    page cache, dirty ones included, but leave the process's RSS."""

    name = "mmap, pages unmapped after each batch"

    def __init__(self, folder: pathlib.Path, rows: int, floats: int) -> None:
        self.path, self.shape = folder / "mmap.bin", (rows, floats)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        fill(self.fd, rows * floats * 4)
        self.mm = mmap.mmap(self.fd, rows * floats * 4)
        self.map = np.frombuffer(self.mm, np.float32).reshape(self.shape)

    def read(self, rows):
        out = self.map[rows]
        self.mm.madvise(mmap.MADV_DONTNEED)
        return out

    def write(self, rows, values):
        self.map[rows] = values
        self.mm.madvise(mmap.MADV_DONTNEED)

    def drop(self):
        self.mm.flush()
        self.mm.madvise(mmap.MADV_DONTNEED)
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self):
        del self.map
        self.mm.close()
        os.close(self.fd)
        self.path.unlink()


def _keys(rows: np.ndarray) -> list[bytes]:
    return [struct.pack(">q", r) for r in rows.tolist()]  # big-endian: byte order is row order


class Lmdb:
    name = "LMDB (py-lmdb), getmulti/putmulti"

    def __init__(self, folder: pathlib.Path, rows: int, floats: int) -> None:
        import lmdb

        self.lmdb, self.folder, self.floats = lmdb, folder / "lmdb", floats
        self.map_size = int(rows * (floats * 4 + 64) * 4)  # copy-on-write pages: room to rewrite
        self.env = self._open()
        chunk = 1 << 16
        value = np.random.default_rng(0).random((chunk, floats), dtype=np.float32)
        values = [value[i].tobytes() for i in range(chunk)]
        for lo in range(0, rows, chunk):
            hi = min(rows, lo + chunk)
            with self.env.begin(write=True) as txn:
                txn.cursor().putmulti(zip(_keys(np.arange(lo, hi)), values[: hi - lo], strict=True), append=True)
        self.env.sync(True)

    def _open(self):
        return self.lmdb.open(str(self.folder), map_size=self.map_size, sync=False, metasync=False,
                              readahead=False, lock=False)

    def read(self, rows):
        with self.env.begin(buffers=True) as txn:
            got = txn.cursor().getmulti(_keys(rows))
            return np.frombuffer(b"".join(v for _, v in got), np.float32).reshape(-1, self.floats)

    def write(self, rows, values):
        with self.env.begin(write=True) as txn:
            txn.cursor().putmulti(zip(_keys(rows), (values[i].tobytes() for i in range(len(rows))), strict=True))

    def drop(self):
        self.env.sync(True)
        self.env.close()
        for f in self.folder.iterdir():
            fd = os.open(f, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        self.env = self._open()

    def close(self):
        self.env.close()
        for f in self.folder.iterdir():
            f.unlink()
        self.folder.rmdir()


class RocksDb:
    name = "RocksDB (rocksdict), multi-get/write batch, no WAL"

    def __init__(self, folder: pathlib.Path, rows: int, floats: int) -> None:
        import rocksdict

        self.r, self.folder, self.floats = rocksdict, folder / "rocks", floats
        self.db = self._open()
        chunk = 1 << 16
        value = np.random.default_rng(0).random((chunk, floats), dtype=np.float32)
        for lo in range(0, rows, chunk):
            hi = min(rows, lo + chunk)
            batch = rocksdict.WriteBatch(raw_mode=True)
            for k, i in zip(_keys(np.arange(lo, hi)), range(hi - lo), strict=True):
                batch.put(k, value[i].tobytes())
            self.db.write(batch)
        self.db.flush()
        self.db.compact_range(None, None)

    def _open(self):
        opts = self.r.Options(raw_mode=True)
        opts.create_if_missing(True)
        opts.set_row_cache(self.r.Cache(0)) if hasattr(self.r, "Cache") else None
        db = self.r.Rdict(str(self.folder), opts)
        wo = self.r.WriteOptions()
        wo.disable_wal = True
        db.set_write_options(wo)
        return db

    def read(self, rows):
        got = self.db[_keys(rows)]
        return np.frombuffer(b"".join(got), np.float32).reshape(-1, self.floats)

    def write(self, rows, values):
        batch = self.r.WriteBatch(raw_mode=True)
        for k, i in zip(_keys(rows), range(len(rows)), strict=True):
            batch.put(k, values[i].tobytes())
        self.db.write(batch)

    def drop(self):
        self.db.flush()
        self.db.close()
        for f in self.folder.iterdir():
            if f.is_file():
                fd = os.open(f, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
        self.db = self._open()

    def close(self):
        self.db.close()
        self.r.Rdict.destroy(str(self.folder))


def fill(fd: int, num_bytes: int) -> None:
    """Write `num_bytes` of random floats (real blocks on disk, not a sparse file's holes)."""
    chunk = np.random.default_rng(0).random(1 << 24, dtype=np.float32).tobytes()  # 64 MiB
    done = 0
    while done < num_bytes:
        done += os.pwrite(fd, chunk[: min(len(chunk), num_bytes - done)], done)
    os.fdatasync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def bench_store(args) -> None:
    rng = np.random.default_rng(1)
    folder = pathlib.Path(tempfile.mkdtemp(prefix="tiered-store-", dir=args.dir))
    print(f"file {args.gb} GB per store, folder {folder}, load average {os.getloadavg()}", flush=True)
    print("| store | record | batch | read warm ms | read cold ms | write warm ms | write cold ms | "
          "cold read us/row | RssFile MB after warm reads |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for record, floats in RECORDS.items():
        if args.records and record not in args.records:
            continue
        rows = int(args.gb * 2**30) // (floats * 4)
        makers = [(FlatFile, 1), (FlatFile, 4), (FlatFile, 1, True), (FlatFile, 4, True), (MemMap,),
                  (MemMapUnmapped,)]
        if args.flat_only:
            makers = makers[:4]
        if args.kv:
            sys.path.insert(0, args.kv)
            makers += [(Lmdb,), (RocksDb,)]
        for make, *extra in makers:
            built = time.perf_counter()
            s = make(folder, rows, floats, *extra)
            built = time.perf_counter() - built
            s.read(np.arange(10, dtype=np.int64))  # compile
            s.drop()
            for batch in args.batches:
                times = {k: [] for k in ("rw", "rc", "ww", "wc")}
                for _ in range(args.repeats):
                    batch_rows = np.sort(rng.choice(rows, batch, replace=False)).astype(np.int64)
                    values = rng.random((batch, floats), dtype=np.float32)
                    s.drop()
                    t = time.perf_counter()
                    got = s.read(batch_rows)
                    times["rc"].append(time.perf_counter() - t)
                    t = time.perf_counter()
                    got = s.read(batch_rows)
                    times["rw"].append(time.perf_counter() - t)
                    t = time.perf_counter()
                    s.write(batch_rows, values)
                    times["ww"].append(time.perf_counter() - t)
                    assert np.array_equal(s.read(batch_rows[:100]), values[:100]), s.name
                    other = np.sort(rng.choice(rows, batch, replace=False)).astype(np.int64)
                    s.drop()
                    t = time.perf_counter()
                    s.write(other, values)
                    times["wc"].append(time.perf_counter() - t)
                    del got
                rss = rss_file_mb()
                ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
                print(f"| {s.name} | {record} ({floats * 4} B) | {batch:,} | {ms['rw']:.1f} | {ms['rc']:.1f} | "
                      f"{ms['ww']:.1f} | {ms['wc']:.1f} | {ms['rc'] * 1e3 / batch:.2f} | {rss:.0f} |", flush=True)
            print(f"<!-- {s.name}, {record}: {rows:,} rows, built in {built:.1f} s -->", flush=True)
            s.close()
    folder.rmdir()
    print(f"load average after: {os.getloadavg()}")


# ------------------------------------------------------------------------------------------------ policies
def zipf_stream(num_rows: int, alpha: float, num_steps: int, ids_per_step: int, seed: int) -> list[np.ndarray]:
    """Each step's distinct rows: Zipf(alpha) ranks drawn by inverse CDF, mapped through a fixed permutation."""
    rng = np.random.default_rng(seed)
    weights = np.arange(1, num_rows + 1, dtype=np.float64) ** -alpha
    cdf = np.cumsum(weights)
    cdf /= cdf[-1]
    scramble = rng.permutation(num_rows).astype(np.int64)
    steps = []
    for _ in range(num_steps):
        ranks = np.searchsorted(cdf, rng.random(ids_per_step))
        steps.append(np.unique(scramble[np.minimum(ranks, num_rows - 1)]))
    return steps


# Each simulation: (rows of each step, cache slots) -> hits per step. Rows of the step being served are never
# evicted; victims are chosen among the other cached rows. All run in compiled loops over the same stream.

@numba.njit
def sim_lru(num_rows, capacity, offsets, rows):
    """Exact LRU at step granularity: a FIFO of (row, step) entries, stale entries skipped (lazy deletion)."""
    last = np.full(num_rows, -1, np.int64)
    cached = np.zeros(num_rows, np.bool_)
    queue_row = np.empty(rows.shape[0] + 1, np.int64)
    queue_step = np.empty(rows.shape[0] + 1, np.int64)
    head = tail = 0
    size = 0
    hits = np.zeros(offsets.shape[0] - 1, np.int64)
    for s in range(offsets.shape[0] - 1):
        lo, hi = offsets[s], offsets[s + 1]
        misses = 0
        for i in range(lo, hi):
            if cached[rows[i]]:
                hits[s] += 1
            else:
                misses += 1
        while size + misses > capacity:
            r, t = queue_row[head], queue_step[head]
            head += 1
            if cached[r] and last[r] == t:
                cached[r] = False
                size -= 1
        for i in range(lo, hi):
            r = rows[i]
            if not cached[r]:
                cached[r] = True
                size += 1
            last[r] = s
            queue_row[tail], queue_step[tail] = r, s
            tail += 1
    return hits


@numba.njit
def sim_clock(num_rows, capacity, offsets, rows, max_count):
    """CLOCK (max_count 1: a reference bit) or GCLOCK (a counter up to max_count, +1 per step a row is used):
    the hand sweeps the slots, taking a slot whose counter is 0 and decrementing the others."""
    slot_of = np.full(num_rows, -1, np.int64)
    row_of = np.full(capacity, -1, np.int64)
    count = np.zeros(capacity, np.int64)
    pinned_step = np.full(capacity, -1, np.int64)
    hand = 0
    used = 0
    hits = np.zeros(offsets.shape[0] - 1, np.int64)
    for s in range(offsets.shape[0] - 1):
        lo, hi = offsets[s], offsets[s + 1]
        for i in range(lo, hi):
            slot = slot_of[rows[i]]
            if slot >= 0:
                hits[s] += 1
                count[slot] = min(count[slot] + 1, max_count)
                pinned_step[slot] = s
        for i in range(lo, hi):
            r = rows[i]
            if slot_of[r] >= 0:
                continue
            if used < capacity:
                slot = used
                used += 1
            else:
                while True:
                    if pinned_step[hand] != s:
                        if count[hand] == 0:
                            break
                        count[hand] -= 1
                    hand = (hand + 1) % capacity
                slot = hand
                hand = (hand + 1) % capacity
                slot_of[row_of[slot]] = -1
            slot_of[r], row_of[slot] = slot, r
            count[slot] = 0
            pinned_step[slot] = s
    return hits


@numba.njit
def sim_slru(num_rows, capacity, offsets, rows, protected_share):
    """Segmented LRU: new rows enter a probationary LRU segment; a row used again moves to the protected one
    (`protected_share` of the slots), whose LRU rows fall back to probation. Victims: probation's LRU."""
    where = np.zeros(num_rows, np.int8)  # 0 not cached, 1 probation, 2 protected
    last = np.full(num_rows, -1, np.int64)
    n = rows.shape[0] + 1
    pq_row, pq_step = np.empty(2 * n, np.int64), np.empty(2 * n, np.int64)  # a row enters at most twice per use
    tq_row, tq_step = np.empty(n, np.int64), np.empty(n, np.int64)
    ph = pt = th = tt = 0
    num_prob = num_prot = 0
    max_prot = int(capacity * protected_share)
    hits = np.zeros(offsets.shape[0] - 1, np.int64)
    for s in range(offsets.shape[0] - 1):
        lo, hi = offsets[s], offsets[s + 1]
        misses = 0
        for i in range(lo, hi):
            r = rows[i]
            if where[r] > 0:
                hits[s] += 1
                if where[r] == 1:
                    where[r] = 2
                    num_prob -= 1
                    num_prot += 1
                last[r] = s
                tq_row[tt], tq_step[tt] = r, s
                tt += 1
            else:
                misses += 1
        while num_prot > max_prot and th < tt:  # demote protected LRU rows (not of this step) to probation
            r, t = tq_row[th], tq_step[th]
            if t == s:
                break
            th += 1
            if where[r] == 2 and last[r] == t:
                where[r] = 1
                num_prot -= 1
                num_prob += 1
                pq_row[pt], pq_step[pt] = r, t
                pt += 1
        while num_prob + num_prot + misses > capacity:
            if ph < pt:
                r, t = pq_row[ph], pq_step[ph]
                ph += 1
                if where[r] == 1 and last[r] == t:
                    where[r] = 0
                    num_prob -= 1
            elif th < tt and tq_step[th] != s:  # probation is empty: the protected LRU row goes
                r, t = tq_row[th], tq_step[th]
                th += 1
                if where[r] == 2 and last[r] == t:
                    where[r] = 0
                    num_prot -= 1
            else:
                break
        for i in range(lo, hi):
            r = rows[i]
            if where[r] == 0:
                where[r] = 1
                num_prob += 1
                last[r] = s
                pq_row[pt], pq_step[pt] = r, s
                pt += 1
    return hits


@numba.njit
def _lfu_keys(count, row_of, pinned_step, s):
    keys = np.empty(row_of.shape[0], np.float64)
    for slot in range(row_of.shape[0]):
        keys[slot] = np.inf if pinned_step[slot] == s else count[row_of[slot]]
    return keys


def sim_lfu(num_rows, capacity, offsets, rows, *, halve_every, chunk_share, global_counts):
    """LFU with aging: every step a row is used adds 1 to its count; every `halve_every` steps all counts halve.
    `global_counts`: every row's count is kept (a byte each would do), so a row evicted and fetched again keeps
    its history; else a row's count starts afresh when it is cached. Victims: the lowest counts, chosen
    `chunk_share` of the slots at a time (one partial sort per chunk, as the trainer's cache does)."""
    count = np.zeros(num_rows, np.float64)
    slot_of = np.full(num_rows, -1, np.int64)
    row_of = np.full(capacity, -1, np.int64)
    pinned_step = np.full(capacity, -1, np.int64)
    free = list(range(capacity - 1, -1, -1))
    chunk = max(1, int(capacity * chunk_share))
    hits = np.zeros(offsets.shape[0] - 1, np.int64)
    for s in range(offsets.shape[0] - 1):
        step_rows = rows[offsets[s]:offsets[s + 1]]
        slots = slot_of[step_rows]
        present = slots >= 0
        hits[s] = int(present.sum())
        pinned_step[slots[present]] = s
        count[step_rows] += 1
        missing = step_rows[~present]
        if len(free) < missing.shape[0]:
            need = max(chunk, missing.shape[0] - len(free))
            keys = _lfu_keys(count, row_of, pinned_step, s)
            victims = np.argpartition(keys, need)[:need]
            for slot in victims:
                slot_of[row_of[slot]] = -1
                if not global_counts:
                    count[row_of[slot]] = 0
                row_of[slot] = -1
                free.append(slot)
        for r in missing:
            slot = free.pop()
            slot_of[r], row_of[slot] = slot, r
            pinned_step[slot] = s
        if (s + 1) % halve_every == 0:
            count *= 0.5
    return hits


def oracle_top(num_rows, capacity, alpha):
    """The best any policy can do on a stationary stream: the `capacity` most probable rows always cached
    (per draw; a step's distinct rows weigh the tail more, so this is a guide, not a bound per distinct row)."""
    w = np.arange(1, num_rows + 1, dtype=np.float64) ** -alpha
    return w[:capacity].sum() / w.sum()


def bench_policy(args) -> None:
    print(f"rows {args.rows:,}, Zipf({args.alpha}), {args.ids_per_step:,} ids per step, {args.steps} steps; "
          f"load average {os.getloadavg()}", flush=True)
    t = time.perf_counter()
    steps = zipf_stream(args.rows, args.alpha, args.steps, args.ids_per_step, seed=0)
    offsets = np.cumsum([0] + [len(s) for s in steps]).astype(np.int64)
    rows = np.concatenate(steps)
    unique = statistics.mean(len(s) for s in steps)
    print(f"stream: {unique:,.0f} distinct rows per step ({time.perf_counter() - t:.1f} s)", flush=True)
    policies = {
        "LRU": lambda c: sim_lru(args.rows, c, offsets, rows),
        "CLOCK": lambda c: sim_clock(args.rows, c, offsets, rows, 1),
        "GCLOCK (counter <= 15)": lambda c: sim_clock(args.rows, c, offsets, rows, 15),
        "SLRU (80 % protected)": lambda c: sim_slru(args.rows, c, offsets, rows, 0.8),
        "LFU, aging, counts of cached rows": lambda c: sim_lfu(args.rows, c, offsets, rows, halve_every=args.halve_every,
                                                              chunk_share=1 / 64, global_counts=False),
        "LFU, aging, counts of every row": lambda c: sim_lfu(args.rows, c, offsets, rows, halve_every=args.halve_every,
                                                            chunk_share=1 / 64, global_counts=True),
    }
    if args.shipped:
        from kembed_trainer.tiered import cache as tier_cache

        policies["shipped (tiered/cache.py)"] = lambda c: tier_cache.simulate(args.rows, c, offsets, rows)
    shares = args.cache_shares
    print("| policy | " + " | ".join(f"cache {s:g} % of rows" for s in shares) + " | seconds |")
    print("| --- | " + " | ".join("---:" for _ in shares) + " | ---: |")
    print("| best static set (the most probable rows, per draw) | "
          + " | ".join(f"{oracle_top(args.rows, int(args.rows * s / 100), args.alpha):.3f}" for s in shares)
          + " | |")
    first = args.steps // 2
    for name, run in policies.items():
        t = time.perf_counter()
        cells = []
        for s in shares:
            capacity = int(args.rows * s / 100)
            if capacity < 2 * unique:
                cells.append("(smaller than 2 steps)")
                continue
            hits = run(capacity)
            cells.append(f"{hits[first:].sum() / (offsets[-1] - offsets[first]):.3f}")
        print(f"| {name} | " + " | ".join(cells) + f" | {time.perf_counter() - t:.1f} |", flush=True)
    print(f"load average after: {os.getloadavg()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    s = sub.add_parser("store")
    s.add_argument("--gb", type=float, default=2.0)
    s.add_argument("--batches", type=int, nargs="+", default=[10_000, 100_000])
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument("--records", nargs="*", default=None, help=f"some of {list(RECORDS)}")
    s.add_argument("--kv", default=None, help="a folder with lmdb and rocksdict installed (pip --target)")
    s.add_argument("--dir", default=None, help="where the files go (default: the system's temp folder)")
    s.add_argument("--flat-only", action="store_true", help="only the flat file's variants")
    p = sub.add_parser("policy")
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--alpha", type=float, default=1.1)
    p.add_argument("--ids-per-step", type=int, default=8192 * 3)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--halve-every", type=int, default=50)
    p.add_argument("--cache-shares", type=float, nargs="+", default=[1, 2, 5, 10, 25])
    p.add_argument("--shipped", action="store_true", help="also the trainer's own cache (tiered/cache.py)")
    args = parser.parse_args()
    bench_store(args) if args.what == "store" else bench_policy(args)


if __name__ == "__main__":
    main()
