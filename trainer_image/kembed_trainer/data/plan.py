"""Which training rows each rank reads at each step: exact epochs, a shuffle window, a position worth a few integers.

An epoch numbers its N training rows in a shuffled order, a pure function of (seed, epoch, the data's units):
the units (Parquet row groups, CSV blocks) in an order drawn per epoch, their rows in file order, cut into
windows of `window` rows, each window permuted by its own draw. A *position* p in 0..N-1 is the p-th row of that
order. Every rank can compute the order; none needs the rows to do it.

A *segment* is a stretch of an epoch trained at one world size: the positions it still has to visit (a few
intervals), split among the ranks in equal contiguous shares. Each step a rank takes the next `batch_size`
positions of its share, the segment's last step the rest of it, so a segment visits each of its positions once.
An epoch is one segment unless the world size changes mid-epoch: a resume at another world size ends the
segment where the checkpoint was and starts a new one on the positions no rank had taken yet. So, whatever the
resumes, an epoch visits every training row once (the one exception: fewer rows left than ranks; they are
left to the next epoch's pass). The reader's state is the current segment: four integers and its intervals.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

__all__ = ["Intervals", "Segment", "first_segment", "permutation", "segment_at", "slice_of", "total_length"]

Intervals = list[tuple[int, int]]  # [start, end) position ranges, sorted and disjoint
MAX_INTERVALS = 4096  # a checkpoint's fixed-size slot; each resize adds at most one interval per old rank


def total_length(intervals: Intervals) -> int:
    return sum(b - a for a, b in intervals)


def slice_of(intervals: Intervals, lo: int, hi: int) -> Intervals:
    """The positions at offsets [lo, hi) of the intervals' concatenation."""
    out, offset = [], 0
    for a, b in intervals:
        n = b - a
        start, end = max(lo - offset, 0), min(hi - offset, n)
        if start < end:
            out.append((a + start, a + end))
        offset += n
        if offset >= hi:
            break
    return out


def _merged(intervals: Intervals) -> Intervals:
    out: Intervals = []
    for a, b in sorted(intervals):
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        elif a < b:
            out.append((a, b))
    return out


def permutation(*key: int, n: int) -> np.ndarray:
    """A permutation of range(n) drawn from `key` alone (the same on every rank, run and platform)."""
    return np.random.default_rng(np.random.SeedSequence([k & 0xFFFFFFFF for k in key])).permutation(n)


@dataclasses.dataclass(frozen=True)
class Segment:
    epoch: int
    start_step: int  # the global step of its first batch
    world_size: int
    remaining: Intervals  # the epoch's positions left to visit when it started
    batch_size: int

    @property
    def num_rows(self) -> int:
        return total_length(self.remaining)

    @property
    def num_steps(self) -> int:
        """Every rank takes as many steps; the last takes what is left of its share (batch_size to 2x-1 rows)."""
        return max(1, self.num_rows // self.world_size // self.batch_size)

    @property
    def end_step(self) -> int:
        return self.start_step + self.num_steps

    def share(self, rank: int) -> Intervals:
        n, w = self.num_rows, self.world_size
        return slice_of(self.remaining, rank * n // w, (rank + 1) * n // w)

    def step_offsets(self, rank: int, step: int) -> tuple[int, int]:
        """Offsets [lo, hi) into `share(rank)` of the rows of global `step`."""
        k = step - self.start_step
        assert 0 <= k < self.num_steps, (step, self)
        n, w = self.num_rows, self.world_size
        size = (rank + 1) * n // w - rank * n // w
        return k * self.batch_size, size if k == self.num_steps - 1 else (k + 1) * self.batch_size

    def left_at(self, step: int) -> Intervals:
        """The positions no rank has taken before global `step`."""
        k = step - self.start_step
        return _merged(
            [iv for r in range(self.world_size) for iv in slice_of(self.share(r), k * self.batch_size, 1 << 62)]
        )

    def next_epoch(self, num_rows: int) -> Segment:
        return Segment(self.epoch + 1, self.end_step, self.world_size, [(0, num_rows)], self.batch_size)

    # ---------------------------------------------------------------------------------------- checkpoint
    def to_state(self) -> dict[str, torch.Tensor]:
        if len(self.remaining) > MAX_INTERVALS:
            raise RuntimeError(f"the data position has {len(self.remaining)} intervals, more than {MAX_INTERVALS}")
        intervals = torch.full((MAX_INTERVALS, 2), -1, dtype=torch.int64)
        if self.remaining:
            intervals[: len(self.remaining)] = torch.tensor(self.remaining, dtype=torch.int64)
        return {
            "segment": torch.tensor([self.epoch, self.start_step, self.world_size, len(self.remaining)]),
            "intervals": intervals,
        }

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor], batch_size: int) -> Segment:
        epoch, start, world_size, count = (int(x) for x in state["segment"].tolist())
        remaining = [(int(a), int(b)) for a, b in state["intervals"][:count].tolist()]
        return cls(epoch, start, world_size, remaining, batch_size)


def first_segment(num_rows: int, world_size: int, batch_size: int) -> Segment:
    return Segment(0, 0, world_size, [(0, num_rows)], batch_size)


def segment_at(segment: Segment, step: int, *, world_size: int, num_rows: int) -> Segment:
    """The segment that global `step` trains in, from `segment` (the checkpoint's, or the first) on `world_size`
    ranks: later epochs roll on, and a changed world size starts a new segment on the positions left at `step`."""
    assert step >= segment.start_step, (step, segment)
    while step >= segment.end_step:
        segment = segment.next_epoch(num_rows)
    if segment.world_size != world_size:
        left = segment.left_at(step)
        segment = Segment(segment.epoch, step, world_size, left, segment.batch_size)
        if segment.num_rows < world_size:  # too few rows left to give each rank one: the next epoch begins
            segment = Segment(segment.epoch + 1, step, world_size, [(0, num_rows)], segment.batch_size)
    return segment
