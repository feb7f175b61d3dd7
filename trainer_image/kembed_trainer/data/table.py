"""Rows of Parquet, CSV or TSV files (`file://`, `s3://` or a path), streamed: memory does not grow with the data.

The data set is a list of units (`units.py`: Parquet row groups, CSV/TSV blocks), streamed by `stream.py`: each
epoch orders the units and shuffles their rows in windows of `data.shuffle_buffer` rows; each rank reads only the
windows its share of that order touches, in a background thread a bounded number of windows ahead of training.
Ranks' shares are equal to a row, so no rank idles at the end of an epoch. The reader's position is saved in
every checkpoint (`state_dict`), so a resume mid-epoch continues the epoch: the same batches at the same world
size, and at another the rows no rank had taken yet.

Held-out rows (`eval_fraction`, without `eval_uri`) are chosen by a hash of (file, unit, row), the same at any
world size; an eval reads the units again for them (give `eval_uri` for a large data set).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np

from kembed_contract import trainer_config as config
from kembed_trainer.data import prefetch, rows, stream, units
from kembed_trainer.data.batch import Batch
from kembed_trainer.data.rows import hash_string
from kembed_trainer.storage import Guard

__all__ = ["TableData", "build", "hash_string"]

_EVAL_CHUNK = 2048


class TableData(stream.StreamedData):
    def __init__(
        self,
        cfg: config.TableDataConfig,
        *,
        tables: list[config.TableConfig],
        seed: int,
        batch_size: int,
        rank: int,
        world_size: int,
        guard: Guard,
    ) -> None:
        self.cfg, self.seed, self.batch_size, self.rank, self.world_size = cfg, seed, batch_size, rank, world_size
        self.guard = guard
        self.columns = rows.Columns(cfg, tables)
        listing = dict(fmt=cfg.format, columns=cfg.columns, needed=self.columns.names,  # noqa: C408
                       csv_types=self.columns.csv_types)
        self.units = units.list_units(guard, cfg.uri, where="data.uri", **listing)
        self.eval_units = units.list_units(guard, cfg.eval_uri, where="data.eval_uri", **listing) if cfg.eval_uri else []
        self._holdout = 0.0 if cfg.eval_uri else cfg.eval_fraction
        self.train_counts = np.array([int(self._train_mask(u).sum()) for u in self.units], dtype=np.int64)
        self.num_rows = int(self.train_counts.sum())
        self.num_eval_rows = (sum(u.num_rows for u in self.eval_units) if cfg.eval_uri
                              else sum(u.num_rows for u in self.units) - self.num_rows)
        if self.num_rows < world_size:
            raise ValueError(f"data.uri: {self.num_rows} training rows in {cfg.uri}, fewer than the {world_size} ranks")
        self.stream = stream.Stream(self.train_counts, self._open_units, seed=seed, batch_size=batch_size,
                                    window=cfg.shuffle_buffer, rank=rank, world_size=world_size)
        self._raw_lock = threading.Lock()
        self._raw_ids: dict[str, dict[int, str]] = {}

    # ------------------------------------------------------------------------------------------- sizes
    def counts(self) -> dict[str, int]:
        """This rank's share of the data set's size (summed over ranks for the report)."""
        w, r = self.world_size, self.rank
        share = lambda n: (r + 1) * n // w - r * n // w  # noqa: E731
        return {"train_rows": share(self.num_rows), "eval_rows": share(self.num_eval_rows)}

    def raw_ids(self) -> dict[str, tuple[list[str], np.ndarray]]:
        """Per hashed feature: the distinct raw ids this rank read so far (as text) and the int64s they hash from."""
        with self._raw_lock:
            return {f: (list(ids.values()), np.fromiter(ids.keys(), np.int64, len(ids)))
                    for f, ids in self._raw_ids.items()}

    def add_raw_ids(self, raw: dict[str, tuple[list[str], np.ndarray]]) -> None:
        """Ids read before a resume (the checkpoint's index), so the index keeps them."""
        with self._raw_lock:
            for feature, (texts, hashes) in raw.items():
                self._raw_ids.setdefault(feature, {}).update(zip(hashes.tolist(), texts, strict=True))

    # ------------------------------------------------------------------------------------------- training
    def train_batch(self, step: int) -> Batch:
        """The batch of global `step`; steps are taken in order (a jump, as a resume, restarts the reader)."""
        return self.stream.take(step).batch()

    def _open_units(self) -> _TrainingUnits:
        reader = units.UnitReader(self.guard, columns=self.columns.names, csv_types=self.columns.csv_types,
                                  where="data.uri")
        return _TrainingUnits(self, reader)

    def _train_mask(self, unit: units.Unit) -> np.ndarray:
        """Which rows of `unit` train (the others are held out for eval)."""
        if self._holdout == 0:
            return np.ones(unit.num_rows, dtype=bool)
        base = np.uint64(hash_string(f"{unit.uri}#{unit.part}"))
        return rows.unit_hash(np.arange(unit.num_rows, dtype=np.uint64) + base) >= self._holdout

    def _read(self, reader: units.UnitReader, unit: units.Unit, *, trained: bool) -> rows.Rows:
        """A unit's rows, checked (errors name the unit); with `trained`, its raw ids join the id index."""
        converted, raw = self.columns.rows(reader.read(unit), unit.where)
        if trained and raw:
            with self._raw_lock:
                for feature, (texts, hashes) in raw.items():
                    self._raw_ids.setdefault(feature, {}).update(zip(hashes.tolist(), texts, strict=True))
        return converted

    # ------------------------------------------------------------------------------------------- eval
    def eval_batches(self) -> Iterator[Batch]:
        """This rank's equal share of the held-out rows, in file order, read a unit ahead."""
        held_out = self.eval_units or self.units
        counts = ([u.num_rows for u in held_out] if self.eval_units
                  else [u.num_rows - int(c) for u, c in zip(self.units, self.train_counts, strict=True)])
        total = sum(counts)
        lo, hi = self.rank * total // self.world_size, (self.rank + 1) * total // self.world_size
        where = "data.eval_uri" if self.eval_units else "data.uri"
        reader = units.UnitReader(self.guard, columns=self.columns.names, csv_types=self.columns.csv_types,
                                  where=where)

        def read() -> Iterator[rows.Rows]:
            offset = 0
            try:
                for unit, count in zip(held_out, counts, strict=True):
                    first, last = max(lo - offset, 0), min(hi - offset, count)
                    offset += count
                    if first >= last:
                        continue
                    part = self._read(reader, unit, trained=False)
                    if not self.eval_units:
                        part = part.take(np.flatnonzero(~self._train_mask(unit)))
                    yield part.slice(first, last)
            finally:
                reader.close()

        stream = prefetch.Prefetcher(read(), depth=1, name="eval-reader")
        try:
            for part in stream:
                for i in range(0, part.num_rows, _EVAL_CHUNK):
                    yield part.slice(i, min(i + _EVAL_CHUNK, part.num_rows)).batch()
        finally:
            stream.close()


class _TrainingUnits:
    """A unit's training rows, for the stream's reader thread: read, checked, its held-out rows left out."""

    def __init__(self, data: TableData, reader: units.UnitReader) -> None:
        self.data, self.reader = data, reader

    def read(self, index: int) -> rows.Rows:
        unit = self.data.units[index]
        converted = self.data._read(self.reader, unit, trained=True)
        if self.data._holdout:
            converted = converted.take(np.flatnonzero(self.data._train_mask(unit)))
        return converted

    def close(self) -> None:
        self.reader.close()


def build(cfg: config.TrainerConfig, *, rank: int, world_size: int, guard: Guard) -> TableData:
    """The source of `cfg.data` (the data registry's entry, kembed_trainer.kinds)."""
    return TableData(cfg.data, tables=cfg.embeddings.tables, seed=cfg.training.seed,
                    batch_size=cfg.training.batch_size, rank=rank, world_size=world_size, guard=guard)
