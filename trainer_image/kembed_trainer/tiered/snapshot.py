"""One rank's tiered stores as they were when a save began, kept while training goes on writing to them.

A save streams the stores (the whole tables for a full checkpoint, the changed rows for a delta) for as long as
the disk takes; a tiered table's training keeps writing rows back into the same files (evicted dirty rows). So
the save reads a snapshot, copy-on-write: the first write-back of a row during the save copies the row's record
as it was into a side file first, and the save reads such rows from there and every other row from the store,
which still holds it as it was. Only the rows written back during the save are copied, once each.

The side file is as the store (`store.RowFile`: a record at the row's own offset), sparse: the disk holds only
the pages of the rows copied into it. A flag a row says which rows were copied (1 byte a row, allocated zeroed,
so the memory is only that of the pages of rows touched). The file is unlinked as soon as it is open, as the
stores are.

A copy and a read of the same rows exclude each other (a lock a file): a row the save reads from the store is
never overwritten between the check and the read, and a row copied aside is never copied again, so the side
file's records do not change while the save reads them.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

import numpy as np

from kembed_trainer.tiered import store as tier_store

__all__ = ["Snapshot"]


class Snapshot:
    """The records of `files` (one rank's stores) as they are now, for as long as it is open."""

    def __init__(self, files: Sequence[tier_store.RowFile], folder: str, name: str) -> None:
        self._files = list(files)
        self._kept = [np.zeros(f.num_rows, np.bool_) for f in self._files]
        self._aside: list[tier_store.RowFile] = []
        for i, f in enumerate(self._files):
            path = os.path.join(folder, f"{name}.{i}.snapshot")
            aside = tier_store.RowFile(path, f.num_rows, f.record_floats, io_threads=1)
            os.unlink(path)  # the open file keeps it: nothing is left behind, however the process ends
            self._aside.append(aside)
        self._locks = [threading.Lock() for _ in self._files]
        self._open = True
        self.rows_copied = 0

    def before_write(self, i: int, rows: np.ndarray) -> None:
        """Store `i`'s sorted rows `rows` are about to be overwritten: copy aside those not copied yet."""
        with self._locks[i]:
            if not self._open:
                return
            fresh = rows[~self._kept[i][rows]]
            if not fresh.shape[0]:
                return
            records = np.empty((fresh.shape[0], self._files[i].record_floats), np.float32)
            self._files[i].read(fresh, records)
            self._aside[i].write(fresh, records)
            self._kept[i][fresh] = True
            self.rows_copied += fresh.shape[0]

    def read(self, i: int, rows: np.ndarray, out: np.ndarray) -> None:
        """Store `i`'s sorted rows `rows` as they were when the snapshot was taken, into `out`."""
        with self._locks[i]:
            assert self._open, "a snapshot read after it was closed"
            kept = self._kept[i][rows]
            if not kept.any():
                self._files[i].read(rows, out)
                return
            in_store = np.ascontiguousarray(rows[~kept])
            part = np.empty((in_store.shape[0], out.shape[1]), np.float32)
            self._files[i].read(in_store, part)
            out[~kept] = part
        aside = np.ascontiguousarray(rows[kept])  # copied once, never again: read outside the lock
        part = np.empty((aside.shape[0], out.shape[1]), np.float32)
        self._aside[i].read(aside, part)
        out[kept] = part

    def close(self) -> None:
        """Give the side files and the flags back; write-backs copy nothing from here on."""
        for lock in self._locks:
            lock.acquire()
        try:
            if self._open:
                self._open = False
                for aside in self._aside:
                    aside.close()
                self._kept = []
        finally:
            for lock in self._locks:
                lock.release()
