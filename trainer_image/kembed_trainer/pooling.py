"""Sum-pooling of a batch's bags over its deduplicated rows, with a backward that is a lookup too.

`F.embedding_bag`'s own backward on CPU sorts the ids again and scatter-adds every id's gradient row, which
took longer than the rest of the lookup together. The rows are sorted once here anyway (to deduplicate
them), and that order gives the backward for free: the gradient of unique row u is the sum of the pooled
gradients of the bags its ids fell in, which is itself an `embedding_bag` over the pooled gradients with
the ids grouped by row. Both directions are then the same fast gather-and-sum.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = ["Bags", "by_sample", "plan_bags", "pool"]


class Bags(NamedTuple):
    """One lookup's ids, indexed both ways: by bag (forward) and by unique row (backward)."""

    unique_rows: torch.Tensor  # sorted distinct rows
    inverse: torch.Tensor  # per id (in bag order): its position in unique_rows
    offsets: torch.Tensor  # per bag: its first id
    bag_by_row: torch.Tensor  # the bag of each id, ids ordered by row (stable, so by bag within a row)
    row_offsets: torch.Tensor  # per unique row: its first entry in bag_by_row


def by_sample(rows: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's ids and bag lengths reordered from feature-major (`lengths` [features, batch]: every sample's
    bag of the first feature, then of the next) to sample-major (each sample's bags of every feature in turn).
    Pooled so, the bags are [batch, features, dim] as the dense model takes them: no transposed copy of them
    forward (the model's concatenation) or of their gradient backward (`embedding_bag` wants it contiguous)."""
    lengths_by_sample = lengths.t().reshape(-1)
    # Each bag's first id where it is now, minus where it goes: the shift of every id of that bag.
    shift = _starts(lengths.reshape(-1)).view(lengths.shape).t().reshape(-1) - _starts(lengths_by_sample)
    positions = torch.repeat_interleave(shift, lengths_by_sample, output_size=rows.numel())
    positions += torch.arange(rows.numel(), device=rows.device)
    return rows.index_select(0, positions), lengths_by_sample


def plan_bags(rows: torch.Tensor, lengths: torch.Tensor, num_rows: int) -> Bags:
    """Bags of `rows` (ids concatenated bag after bag, `lengths[i]` ids in bag i), rows in [0, num_rows)."""
    # Sorting 32-bit keys took half the time of 64-bit ones on the benchmark's CPU.
    keys = rows.to(torch.int32) if num_rows <= torch.iinfo(torch.int32).max else rows
    sorted_keys, order = torch.sort(keys, stable=True)
    unique_keys, sorted_inverse, counts = torch.unique_consecutive(
        sorted_keys, return_inverse=True, return_counts=True
    )
    unique_rows = unique_keys.to(rows.dtype)
    inverse = torch.empty_like(sorted_inverse).index_copy_(0, order, sorted_inverse)
    bags = torch.arange(lengths.numel(), device=rows.device)
    bag_by_row = torch.repeat_interleave(bags, lengths, output_size=rows.numel()).index_select(0, order)
    return Bags(unique_rows, inverse, _starts(lengths), bag_by_row, _starts(counts))


def pool(vectors: torch.Tensor, bags: Bags) -> torch.Tensor:
    """[num_bags, dim]: each bag's sum of `vectors[inverse]` (vectors: one per unique row)."""
    return _Pool.apply(vectors, bags)


class _Pool(torch.autograd.Function):
    @staticmethod
    def forward(ctx, vectors: torch.Tensor, bags: Bags) -> torch.Tensor:
        ctx.bags = bags
        return F.embedding_bag(bags.inverse, vectors, bags.offsets, mode="sum")

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        bags = ctx.bags
        return F.embedding_bag(bags.bag_by_row, grad.contiguous(), bags.row_offsets, mode="sum"), None


def _starts(counts: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(counts, 0) - counts
