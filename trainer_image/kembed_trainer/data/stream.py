"""A rank's training rows, streamed epoch after epoch in the plan's order: memory does not grow with the data.

Every streamed data kind is a list of units (pieces read whole: a Parquet row group, a block of CSV or text lines)
with a known number of training rows each; the kind supplies those counts and a reader of one unit's training
rows (`rows.Rows`, in the unit's order). The rest is one piece of code for every kind: each epoch orders the
units and permutes windows of `window` rows (`plan.py`); each rank reads only the windows its share of that
order touches, in a background thread a bounded number of windows ahead of training (`prefetch.py`); each step
takes the next rows of the rank's share; the reader's position is the current `plan.Segment`, saved in every
checkpoint (`state_dict`), so a resume mid-epoch continues the epoch: the same batches at the same world size,
and at another the rows no rank had taken yet.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

import numpy as np
import torch

from kembed_trainer.data import plan, prefetch, rows

__all__ = ["Stream", "StreamedData", "UnitRows"]

_PREFETCH_WINDOWS = 1  # windows queued ahead, besides the one being read and the one being trained on
_ORDER, _WINDOW = 12, 13  # seed streams of the unit order and the window permutations


class UnitRows(Protocol):
    """Reads units for one reader thread (it may keep a file open between calls)."""

    def read(self, index: int) -> rows.Rows:
        """The training rows of unit `index`, in the unit's order (as many as its count said)."""

    def close(self) -> None: ...


class Stream:
    def __init__(self, train_counts: np.ndarray, open_units: Callable[[], UnitRows], *, seed: int, batch_size: int,
                 window: int, rank: int, world_size: int) -> None:
        """`train_counts[i]`: unit i's training rows; `open_units()`: a reader for the background thread;
        `batch_size` and `window` in rows, the same at every world size (a resume at another one replans the
        epoch's rest with them)."""
        self.train_counts = np.asarray(train_counts, dtype=np.int64)
        self.open_units, self.seed, self.window = open_units, seed, window
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.num_rows = int(self.train_counts.sum())
        self.segment = plan.first_segment(self.num_rows, world_size, batch_size)
        self._stream: Iterator[rows.Rows] | None = None
        self._pending: list[rows.Rows] = []  # rows read and not yet trained on, in order
        self._next_step: int | None = None

    # ------------------------------------------------------------------------------------------- sizes
    @property
    def steps_per_epoch(self) -> int:
        """Steps of one epoch at this world size: every rank's equal share in whole batches, the last step of the
        epoch taking the rest (so each row trains once per epoch)."""
        return plan.first_segment(self.num_rows, self.world_size, self.batch_size).num_steps

    def total_steps(self, epochs: int, step: int) -> int:
        """The step at which `epochs` epochs end, seen from `step` (a resume at another world size changes it)."""
        segment = plan.segment_at(self.segment, step, world_size=self.world_size, num_rows=self.num_rows)
        if segment.epoch >= epochs:
            return step
        return segment.end_step + (epochs - 1 - segment.epoch) * self.steps_per_epoch

    def epoch_at(self, step: int) -> int:
        """The epoch global `step` trains in, from the current position."""
        return plan.segment_at(self.segment, step, world_size=self.world_size, num_rows=self.num_rows).epoch

    # ------------------------------------------------------------------------------------------- training
    def take(self, step: int) -> rows.Rows:
        """This rank's rows of global `step`; steps are taken in order (a jump, as a resume, restarts the reader)."""
        if self._next_step != step:
            self._start(step)
        segment = self.segment
        lo, hi = segment.step_offsets(self.rank, step)
        taken = self._take(hi - lo)
        self._next_step = step + 1
        if step + 1 == segment.end_step:
            self.segment = segment.next_epoch(self.num_rows)
        return taken

    def _take(self, n: int) -> rows.Rows:
        parts, have = [], 0
        while have < n:
            if not self._pending:
                self._pending.append(next(self._stream))
            chunk = self._pending[0]
            need = n - have
            if chunk.num_rows <= need:
                parts.append(self._pending.pop(0))
                have += chunk.num_rows
            else:
                parts.append(chunk.slice(0, need))
                self._pending[0] = chunk.slice(need, chunk.num_rows)
                have = n
        return rows.Rows.cat(parts)

    def _start(self, step: int) -> None:
        self.close()
        self.segment = plan.segment_at(self.segment, step, world_size=self.world_size, num_rows=self.num_rows)
        offset = self.segment.step_offsets(self.rank, step)[0]
        self._stream = prefetch.Prefetcher(self._chunks(self.segment, offset), depth=_PREFETCH_WINDOWS)

    def _chunks(self, segment: plan.Segment, offset: int) -> Iterator[rows.Rows]:
        """This rank's rows from `offset` of its share of `segment`, then of every later epoch's share."""
        units = self.open_units()
        windows = _Windows(self, units)
        try:
            while True:
                share = plan.slice_of(segment.share(self.rank), offset, 1 << 62)
                for a, b in share:
                    s = self.window
                    for j in range(a // s, (b - 1) // s + 1):
                        window = windows.get(segment.epoch, j)
                        yield window.slice(max(a, j * s) - j * s, min(b, (j + 1) * s) - j * s)
                segment, offset = segment.next_epoch(self.num_rows), 0
        finally:
            units.close()

    # ------------------------------------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.segment.to_state()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """The position a checkpoint saved; the next `take(step)` continues from it."""
        self.close()
        self.segment = plan.Segment.from_state(state, self.batch_size)
        self._next_step = None

    def close(self) -> None:
        if isinstance(self._stream, prefetch.Prefetcher):
            self._stream.close()
        self._stream, self._pending = None, []


class _Windows:
    """Builds an epoch's shuffle windows: the units' training rows in the epoch's order, `window` at a time, each
    permuted. Keeps the last window and the last unit read, as consecutive windows share them."""

    def __init__(self, stream: Stream, units: UnitRows) -> None:
        self.stream, self.units = stream, units
        self._order: tuple[int, np.ndarray, np.ndarray] | None = None  # epoch, unit order, sequence starts
        self._window: tuple[tuple[int, int], rows.Rows] | None = None
        self._unit: tuple[int, rows.Rows] | None = None

    def get(self, epoch: int, j: int) -> rows.Rows:
        if self._window is None or self._window[0] != (epoch, j):
            self._window = None  # let the last one go before the next is built
            self._window = ((epoch, j), self._build(epoch, j))
        return self._window[1]

    def _build(self, epoch: int, j: int) -> rows.Rows:
        stream, size = self.stream, self.stream.window
        if self._order is None or self._order[0] != epoch:
            order = plan.permutation(stream.seed, _ORDER, epoch, n=len(stream.train_counts))
            self._order = (epoch, order, np.concatenate([[0], np.cumsum(stream.train_counts[order])]))
            self._unit = None
        _, order, starts = self._order
        lo, hi = j * size, min((j + 1) * size, stream.num_rows)
        parts = []
        first = int(np.searchsorted(starts, lo, side="right")) - 1
        for k in range(first, len(order)):
            if starts[k] >= hi:
                break
            if starts[k + 1] == starts[k]:
                continue  # every row held out
            unit_rows = self._unit_rows(int(order[k]))
            parts.append(unit_rows.slice(max(lo, starts[k]) - starts[k], min(hi, starts[k + 1]) - starts[k]))
        window = rows.Rows.cat(parts)
        return window.take(plan.permutation(stream.seed, _WINDOW, epoch, j, n=hi - lo))

    def _unit_rows(self, index: int) -> rows.Rows:
        if self._unit is None or self._unit[0] != index:
            self._unit = None
            self._unit = (index, self.units.read(index))
        return self._unit[1]


class StreamedData:
    """What every streamed data kind answers through its `stream`: its sizes, its checkpointed position, and the
    closing of its reader thread. A kind sets `self.stream` and adds how it turns taken rows into batches."""

    stream: Stream

    @property
    def steps_per_epoch(self) -> int:
        """Steps of one epoch at this world size (`Stream.steps_per_epoch`)."""
        return self.stream.steps_per_epoch

    def total_steps(self, epochs: int, step: int) -> int:
        """The step at which `epochs` epochs end, seen from `step` (a resume at another world size changes it)."""
        return self.stream.total_steps(epochs, step)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """The position a checkpoint saved; the next step's rows continue from it."""
        self.stream.load_state_dict(state)

    def close(self) -> None:
        self.stream.close()
