"""A tiered table's rows on the node's local disk: one flat file per table and rank, of fixed-width records.

Record r of a file is row r of the rank's rows of that table: the row's weight (`dim` float32), then its
sparse-optimizer state (as `sparse_optim` keeps it: nothing for SGD, `dim` floats for Adagrad, one for row-wise
Adagrad, `2 * dim` for Adam). Rows are read and written at their offsets, in sorted batches: a run of consecutive
rows is one `pread`/`pwrite`, and a batch is cut among a few threads, each a compiled loop calling libc directly
(no Python per row, the GIL released), so a disk read's latency overlaps the others'. Chosen over a memory-mapped
file, LMDB and RocksDB by measurement (docs/benchmarks.md, "Tiered tables"): with dense row numbers a key-value
engine only adds a key lookup per row, and a map's touched pages count in the process's RSS.

The files are scratch: they hold the training state between checkpoints and are never read after the process
ends (a resume rebuilds them from the checkpoint), so nothing is fsync'ed. `drop_cache` asks the kernel to forget
the file's pages, for benchmarks that must read from the disk.
"""

from __future__ import annotations

import ctypes
import os
import pathlib
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
from numba import types

__all__ = ["RowFile", "warm"]

# libc's calls, named by symbol (resolved when the kernel is linked): a kernel holding ctypes' function pointers
# would embed their addresses, which differ in each process, so numba would not cache it. Buffers are passed as
# integer addresses (size_t), as the x86-64 and AArch64 calling conventions pass pointers.
_pread = types.ExternalFunction("pread", types.int64(types.intc, types.uintp, types.uintp, types.int64))
_pwrite = types.ExternalFunction("pwrite", types.int64(types.intc, types.uintp, types.uintp, types.int64))
_fadvise = types.ExternalFunction("posix_fadvise", types.intc(types.intc, types.int64, types.int64, types.intc))
_WILLNEED = 3  # POSIX_FADV_WILLNEED (Linux)

_MIN_ROWS_PER_THREAD = 2048  # below this a thread's hand-off costs more than its share of the calls


@numba.njit(nogil=True, cache=True)
def _ask_ahead(fd: int, rows: np.ndarray, record_bytes: int) -> None:
    """Tell the kernel every run of `rows` will be read (posix_fadvise WILLNEED): it starts reading the pages not
    in the page cache at once, all of them together, so the reads (or a write's read of its page) that follow
    wait for one disk latency instead of one per row."""
    n = rows.shape[0]
    i = 0
    while i < n:
        j = i + 1
        while j < n and rows[j] == rows[j - 1] + 1:
            j += 1
        _fadvise(fd, rows[i] * record_bytes, (j - i) * record_bytes, _WILLNEED)
        i = j


@numba.njit(nogil=True, cache=True)
def _move_runs(fd: int, rows: np.ndarray, buf: np.ndarray, record_bytes: int, ahead: bool, write: bool) -> int:
    """pread (or pwrite) each run of consecutive `rows` (sorted) from (or to) the matching rows of `buf`: one call a
    run; 0, or -1 on a failed or short transfer. A write asks ahead too: a record that does not fill its pages
    makes the kernel read them first."""
    if ahead:
        _ask_ahead(fd, rows, record_bytes)
    n = rows.shape[0]
    base = buf.ctypes.data
    i = 0
    while i < n:
        j = i + 1
        while j < n and rows[j] == rows[j - 1] + 1:
            j += 1
        want = (j - i) * record_bytes
        done = 0
        while done < want:  # a transfer may move less than asked (signals, very large runs)
            address, offset = base + i * record_bytes + done, rows[i] * record_bytes + done
            got = _pwrite(fd, address, want - done, offset) if write else _pread(fd, address, want - done, offset)
            if got <= 0:
                return -1
            done += got
        i = j
    return 0


class RowFile:
    """`num_rows` records of `record_floats` float32 in the file at `path` (created, or truncated, to that size)."""

    def __init__(self, path: str | os.PathLike, num_rows: int, record_floats: int, *, io_threads: int = 4,
                 executor: ThreadPoolExecutor | None = None, ask_ahead: bool = True) -> None:
        self.path = pathlib.Path(path)
        self.num_rows, self.record_floats = num_rows, record_floats
        self.record_bytes = 4 * record_floats
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o600)
        os.ftruncate(self.fd, num_rows * self.record_bytes)
        self.io_threads = max(1, io_threads)
        self.ask_ahead = ask_ahead
        self._executor = executor
        self._own_executor = False
        self.bytes_read = self.bytes_written = 0

    @property
    def num_bytes(self) -> int:
        return self.num_rows * self.record_bytes

    def read(self, rows: np.ndarray, out: np.ndarray) -> None:
        """Records of sorted, distinct `rows` into `out` ([len(rows), record_floats] float32, C-contiguous)."""
        self._check(rows, out)
        self._run(rows, out, write=False)
        self.bytes_read += rows.shape[0] * self.record_bytes

    def write(self, rows: np.ndarray, values: np.ndarray) -> None:
        """`values` ([len(rows), record_floats] float32) as the records of sorted, distinct `rows`."""
        self._check(rows, values)
        self._run(rows, values, write=True)
        self.bytes_written += rows.shape[0] * self.record_bytes

    def write_range(self, first_row: int, values: np.ndarray) -> None:
        """Consecutive records from `first_row` (initialisation and restore: sequential writes)."""
        rows = np.arange(first_row, first_row + values.shape[0], dtype=np.int64)
        self.write(rows, values)

    def read_range(self, first_row: int, out: np.ndarray) -> None:
        rows = np.arange(first_row, first_row + out.shape[0], dtype=np.int64)
        self.read(rows, out)

    def drop_cache(self) -> None:
        """Write the file's dirty pages and ask the kernel to drop all its pages from the page cache."""
        os.fdatasync(self.fd)
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self._own_executor and self._executor is not None:
            self._executor.shutdown()
            self._executor = None

    def remove(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)

    def _check(self, rows: np.ndarray, buf: np.ndarray) -> None:
        if rows.dtype != np.int64 or buf.dtype != np.float32 or not buf.flags.c_contiguous:
            raise TypeError("rows must be int64 and the buffer C-contiguous float32")
        if buf.shape[0] != rows.shape[0] or (rows.shape[0] and buf.size // rows.shape[0] != self.record_floats):
            raise ValueError(f"buffer of shape {buf.shape} for {rows.shape[0]} records of {self.record_floats}")
        if rows.shape[0] and (rows[0] < 0 or rows[-1] >= self.num_rows):
            raise IndexError(f"rows {rows[0]}..{rows[-1]} outside [0, {self.num_rows})")

    def _run(self, rows: np.ndarray, buf: np.ndarray, *, write: bool) -> None:
        n = rows.shape[0]
        if not n:
            return
        flat = buf.reshape(n, self.record_floats)
        parts = min(self.io_threads, max(1, n // _MIN_ROWS_PER_THREAD))
        if parts == 1:
            failed = _move_runs(self.fd, rows, flat, self.record_bytes, self.ask_ahead, write) != 0
        else:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.io_threads, thread_name_prefix="tier-io")
                self._own_executor = True
            bounds = np.linspace(0, n, parts + 1).astype(np.int64)
            futures = [
                self._executor.submit(_move_runs, self.fd, rows[lo:hi], flat[lo:hi], self.record_bytes, self.ask_ahead,
                                      write)
                for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)
            ]
            failed = any(f.result() != 0 for f in futures)
        if failed:
            raise OSError(ctypes.get_errno(), f"{'write' if write else 'read'} of {n} rows of {self.path} failed")


def warm() -> None:
    """Compile `_move_runs` (with `_ask_ahead`) for the argument types `RowFile._run` passes, moving no rows
    (kembed_trainer.kernel_cache builds the platform's cache with this)."""
    _move_runs(-1, np.empty(0, np.int64), np.empty((0, 1), np.float32), 4, True, False)
