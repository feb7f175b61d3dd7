"""Row-wise sharding: which rank owns which row of a big table, and the all-to-all exchanges that move ids,
rows and gradients between the ranks that look rows up and the ranks that own them.

A table of `n` rows is cut like `torch.chunk` (and DTensor's `Shard(0)`): `chunk = ceil(n / world_size)` rows
per rank, rank r owning rows `[r * chunk, (r + 1) * chunk)`, the last ranks possibly fewer or none. Each rank
stacks its pieces of all sharded tables of one width into one local matrix.

Lookups address sharded rows by their *storage index*: the ranks' local matrices one after another (rank 0's
first). Sorting a batch's rows (which the lookup does anyway, to deduplicate them) then also sorts them by
owner, so the rows each rank asks for, the vectors it gets back and the gradients it returns are contiguous
runs of the lookup's own tensors: no permutation, gather or scatter around the all-to-alls.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["Exchange", "RowLayout"]


class RowLayout:
    """Where the rows of the sharded tables of one group live: per table, per rank."""

    def __init__(self, sizes: list[int], world_size: int, rank: int, device: torch.device) -> None:
        self.world_size, self.rank = world_size, rank
        self.chunk = torch.tensor([-(-n // world_size) for n in sizes], device=device)
        # rows_on[r, t]: how many rows of table t rank r holds.
        lo = torch.arange(world_size, device=device)[:, None] * self.chunk[None, :]
        self.rows_on = (torch.tensor(sizes, device=device)[None, :] - lo).clamp(min=0).minimum(self.chunk)
        self.starts_on = torch.cumsum(self.rows_on, 1) - self.rows_on  # local start of table t on rank r
        self.num_local_rows = int(self.rows_on[rank].sum())
        per_rank = self.rows_on.sum(1)
        self.rank_ends = torch.cumsum(per_rank, 0)  # storage index one past each rank's last row
        self.rank_starts = self.rank_ends - per_rank
        # Row j of table t, owned by rank r = j // chunk[t], has storage index j + shift[r, t].
        self.shift = self.rank_starts[:, None] + self.starts_on - lo

    def table_lo(self, t: int) -> int:
        """First global row of table t that this rank owns."""
        return int(self.chunk[t]) * self.rank

    def local_slice(self, t: int) -> slice:
        lo = int(self.starts_on[self.rank, t])
        return slice(lo, lo + int(self.rows_on[self.rank, t]))

    def storage_rows(self, t: int, rows: torch.Tensor) -> torch.Tensor:
        """Storage indices of `rows` (rows of table t)."""
        if self.world_size == 1:
            return rows + int(self.shift[0, t])
        owner = torch.div(rows, int(self.chunk[t]), rounding_mode="floor")
        return rows + self.shift[:, t].index_select(0, owner)

    def split_by_owner(self, storage_rows: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """For sorted storage indices: (each one's row in its owner's local matrix, how many each rank owns)."""
        ends = torch.searchsorted(storage_rows, self.rank_ends)
        counts = torch.diff(ends, prepend=ends.new_zeros(1))
        return storage_rows - torch.repeat_interleave(self.rank_starts, counts), counts.tolist()

    def local_table_of(self, local_rows: torch.Tensor) -> torch.Tensor:
        """The table of each of this rank's local rows (tables with no local rows are never returned)."""
        return torch.searchsorted(self.starts_on[self.rank], local_rows, right=True) - 1


@dataclasses.dataclass
class Exchange:
    """One lookup's all-to-all plan: this rank asked `send_counts[r]` rows of rank r (a run of its sorted
    rows) and was asked for `requested` (its own local rows, `recv_counts[r]` of them by rank r)."""

    send_counts: list[int]
    recv_counts: list[int]
    requested: torch.Tensor
    alone: bool  # one rank: every row is here, and unique; nothing to exchange or sum

    @classmethod
    def plan(cls, local_rows: torch.Tensor, send_counts: list[int]) -> Exchange:
        """`local_rows`: the wanted rows, grouped by owner (`send_counts[r]` of rank r), as owners' rows."""
        if len(send_counts) == 1:
            return cls(send_counts, send_counts, local_rows, True)
        send = torch.tensor(send_counts, device=local_rows.device)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        recv_counts = recv.tolist()
        requested = local_rows.new_empty(sum(recv_counts))
        dist.all_to_all_single(requested, local_rows, recv_counts, send_counts)
        return cls(send_counts, recv_counts, requested, False)

    def fetch(self, local_matrix: torch.Tensor, out: torch.Tensor) -> None:
        """Write the wanted rows into `out` (contiguous), in the order they were asked for, from their
        owners' `local_matrix`."""
        if self.alone:
            torch.index_select(local_matrix, 0, self.requested, out=out)
            return
        answer = local_matrix.index_select(0, self.requested)
        dist.all_to_all_single(out, answer, self.send_counts, self.recv_counts)

    def return_grads(self, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Send each wanted row's gradient to its owner: (unique local rows, their summed gradients)."""
        if self.alone:
            return self.requested, grad
        got = grad.new_empty(sum(self.recv_counts), grad.shape[1])
        dist.all_to_all_single(got, grad.contiguous(), self.recv_counts, self.send_counts)
        return _sum_by_row(self.requested, got)


def _sum_by_row(rows: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(unique rows, summed values per row). One sort of 32-bit keys and an `embedding_bag` over the rows'
    runs: took less than half the time of `torch.unique` plus `index_add_` on the benchmark's CPU."""
    if not rows.numel():
        return rows, values
    keys = rows.to(torch.int32) if int(rows.max()) <= torch.iinfo(torch.int32).max else rows
    sorted_keys, order = torch.sort(keys, stable=True)
    unique_keys, counts = torch.unique_consecutive(sorted_keys, return_counts=True)
    summed = F.embedding_bag(order, values, torch.cumsum(counts, 0) - counts, mode="sum")
    return unique_keys.to(rows.dtype), summed
