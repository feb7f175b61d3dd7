"""One table's weight as a checkpoint holds it, read a range of rows at a time, never whole.

A table may be larger than the memory of the process that reads it (a tiered table is larger than its own
trainers'), so the export reads it in row ranges of about `CHUNK_BYTES`:

- from a full checkpoint alone, each range straight from its DCP files (`dcp_read.RowRanges`), the ranges cut
  where the saved chunks are cut (`step_writer` saves a tensor in chunks of at most `step_writer.ITEM_BYTES`), so
  no saved chunk is loaded twice;
- from a chain whose deltas changed the table, or for a reader that asks for rows out of order (a hashed table's
  raw ids sorted by name), from a scratch copy of the table on local disk: the full checkpoint's rows, range by
  range, then each delta's changed rows in order, written into a file of fixed-width rows (`tiered.store.RowFile`,
  the tier's own store, unlinked as soon as it is open) and read back at offsets. It costs the table's weights
  in the temporary folder, and no memory.

Peak memory is a range and the saved chunks it is read from, whatever the table's size.
"""

from __future__ import annotations

import bisect
import os
import tempfile
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from kembed_trainer import dcp_read, delta

if TYPE_CHECKING:
    from kembed_trainer.tiered import store as tier_store

__all__ = ["CHUNK_BYTES", "SavedTable", "weight_key"]

CHUNK_BYTES = 8 * 2**20  # a range's vectors: as large as a saved chunk (step_writer.ITEM_BYTES)


def weight_key(table: str) -> str:
    """The key of `table`'s weight in a full checkpoint."""
    return f"{delta.TABLES_KEY}.{table}.weight"


def _cut(starts: Sequence[int], first: int, stop: int, most: int) -> Iterator[tuple[int, int]]:
    """[first, stop) in ranges of at most `most` rows, cut also at each of `starts` (sorted)."""
    at = first
    while at < stop:
        next_start = bisect.bisect_right(starts, at)
        end = min(stop, at + most, starts[next_start] if next_start < len(starts) else stop)
        yield at, end
        at = end


class SavedTable:
    """The weight of table `table` in `chain` (its full checkpoint, then its deltas, oldest first), float32.

    `num_rows`: read only the first rows (a vocabulary's; the table may have spare rows)."""

    def __init__(self, chain: Sequence[dcp_read.RowRanges], table: str, num_rows: int | None = None) -> None:
        self._full, self._key = chain[0], weight_key(table)
        shape = self._full.shape(self._key)
        assert shape is not None and len(shape) == 2, f"{self._key}: no table's weight"
        self._table_rows, self.dim = shape
        self.num_rows = self._table_rows if num_rows is None else min(num_rows, self._table_rows)
        self.chunk_rows = max(1, CHUNK_BYTES // (4 * self.dim))
        self._starts = self._full.chunk_starts(self._key)
        self._changes = [(reader, rows_key, weight) for reader in chain[1:]
                         for rows_key, weight in delta.changed_rows_keys(reader.saved, table, "weight")]
        self._scratch: tier_store.RowFile | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.num_rows, self.dim

    def ranges(self) -> Iterator[tuple[int, int]]:
        """The table's rows, [start, stop) at a time, each at most `chunk_rows`, cut where the saved chunks are."""
        return _cut(self._starts, 0, self.num_rows, self.chunk_rows)

    def read(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows `start`.. `stop` ([stop - start, dim]); without bounds, the whole table (small tables, tests)."""
        stop = self.num_rows if stop is None else stop
        if not 0 <= start <= stop <= self.num_rows:
            raise IndexError(f"rows {start}..{stop} of a table of {self.num_rows}")
        out = np.empty((stop - start, self.dim), np.float32)
        if self._changes:
            self._assembled().read_range(start, out)
            return out
        for first, end in _cut(self._starts, start, stop, self.chunk_rows):
            self._full.read(self._key, first, end - first, out=torch.from_numpy(out[first - start:end - start]))
        return out

    def take(self, rows: np.ndarray | Sequence[int]) -> np.ndarray:
        """The vectors of `rows` (any order, repeats allowed), [len(rows), dim]."""
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size and rows[-1] - rows[0] == rows.size - 1 and bool((np.diff(rows) == 1).all()):
            return self.read(int(rows[0]), int(rows[-1]) + 1)  # consecutive: a range
        if rows.size and not (rows.min() >= 0 and rows.max() < self.num_rows):
            raise IndexError(f"rows outside [0, {self.num_rows})")
        distinct, where = np.unique(rows, return_inverse=True)
        out = np.empty((distinct.size, self.dim), np.float32)
        self._assembled().read(distinct, out)
        return out[where.reshape(-1)]

    def close(self) -> None:
        if self._scratch is not None:
            self._scratch.close()
            self._scratch = None

    def _assembled(self) -> tier_store.RowFile:
        """The table after the chain's deltas, on local disk (made at the first call)."""
        if self._scratch is not None:
            return self._scratch
        # Imported here: the store's compiled loops bring numba (~60 MB of RSS), which a table read straight
        # from its full checkpoint does without.
        from kembed_trainer.tiered import store as tier_store

        fd, path = tempfile.mkstemp(prefix="kembed-export-", suffix=".rows")
        os.close(fd)
        scratch = tier_store.RowFile(path, self._table_rows, self.dim)
        os.unlink(path)  # the open file keeps it: nothing is left behind, however the process ends
        try:
            for first, end in _cut(self._starts, 0, self._table_rows, self.chunk_rows):
                scratch.write_range(first, self._float32(self._full.read(self._key, first, end - first)))
            for reader, rows_key, weight in self._changes:  # oldest delta first: later changes win
                starts = sorted({*reader.chunk_starts(rows_key), *reader.chunk_starts(weight)})
                for first, end in _cut(starts, 0, reader.shape(rows_key)[0], self.chunk_rows):
                    rows = reader.read(rows_key, first, end - first).numpy()
                    order = np.argsort(rows, kind="stable")
                    scratch.write(np.ascontiguousarray(rows[order], dtype=np.int64),
                                  self._float32(reader.read(weight, first, end - first))[order])
        except BaseException:
            scratch.close()
            raise
        self._scratch = scratch
        return scratch

    @staticmethod
    def _float32(tensor: torch.Tensor) -> np.ndarray:
        return np.ascontiguousarray(tensor.to(torch.float32).numpy())
