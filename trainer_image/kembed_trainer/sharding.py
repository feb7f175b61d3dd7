"""Row-wise sharding: which rank owns which row of a big table, and the all-to-all exchanges that move ids,
rows and gradients between the ranks that look rows up and the ranks that own them.

A table of `n` rows is cut like `torch.chunk` (and DTensor's `Shard(0)`): `chunk = ceil(n / world_size)` rows
per rank, rank r owning rows `[r * chunk, (r + 1) * chunk)`, the last ranks possibly fewer or none. Each rank
stacks its pieces of all sharded tables of one width into one local matrix.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

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

    def table_lo(self, t: int) -> int:
        """First global row of table t that this rank owns."""
        return int(self.chunk[t]) * self.rank

    def local_slice(self, t: int) -> slice:
        lo = int(self.starts_on[self.rank, t])
        return slice(lo, lo + int(self.rows_on[self.rank, t]))

    def locate(self, table: torch.Tensor, row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(owner rank, row in the owner's local matrix) of `row` of `table` (tensors of equal length)."""
        chunk = self.chunk[table]
        owner = torch.div(row, chunk, rounding_mode="floor")
        return owner, row - owner * chunk + self.starts_on[owner, table]

    def local_table_of(self, local_rows: torch.Tensor) -> torch.Tensor:
        """The table of each of this rank's local rows (tables with no local rows are never returned)."""
        return torch.searchsorted(self.starts_on[self.rank], local_rows, right=True) - 1


@dataclasses.dataclass
class Exchange:
    """One lookup's all-to-all plan: this rank asked `send_counts[r]` rows of rank r and was asked for
    `requested` (its own local rows, `recv_counts[r]` of them by rank r)."""

    order: torch.Tensor | None  # sorts this rank's wanted rows by owner (None: one rank, nothing to sort)
    send_counts: list[int]
    recv_counts: list[int]
    requested: torch.Tensor

    @classmethod
    def plan(cls, owner: torch.Tensor, local_row: torch.Tensor, world_size: int) -> Exchange:
        if world_size == 1:  # every row is here, and unique: no exchange, no sorting, no summing
            return cls(None, [owner.numel()], [owner.numel()], local_row)
        order = torch.argsort(owner, stable=True)
        send = torch.bincount(owner, minlength=world_size)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        send_counts, recv_counts = send.tolist(), recv.tolist()
        requested = local_row.new_empty(sum(recv_counts))
        dist.all_to_all_single(requested, local_row[order], recv_counts, send_counts)
        return cls(order, send_counts, recv_counts, requested)

    def fetch(self, local_matrix: torch.Tensor, out: torch.Tensor) -> None:
        """Write the wanted rows into `out`, in the order they were asked for, from their owners'
        `local_matrix`."""
        if self.order is None:
            torch.index_select(local_matrix, 0, self.requested, out=out)
            return
        answer = local_matrix.index_select(0, self.requested)
        got = answer.new_empty(sum(self.send_counts), local_matrix.shape[1])
        dist.all_to_all_single(got, answer, self.send_counts, self.recv_counts)
        out.index_copy_(0, self.order, got)

    def return_grads(self, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Send each wanted row's gradient to its owner: (unique local rows, their summed gradients)."""
        if self.order is None:
            return self.requested, grad
        got = grad.new_empty(sum(self.recv_counts), grad.shape[1])
        dist.all_to_all_single(got, grad.index_select(0, self.order), self.recv_counts, self.send_counts)
        rows, inverse = torch.unique(self.requested, return_inverse=True)
        summed = torch.zeros(rows.numel(), grad.shape[1], dtype=grad.dtype, device=grad.device)
        summed.index_add_(0, inverse, got)
        return rows, summed
