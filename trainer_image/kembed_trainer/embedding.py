"""Embedding tables: batched lookups, row-sparse gradients, and a fused sparse optimizer step.

All tables of one width live in one matrix, so a batch's features are looked up in one `embedding_bag` call.
The lookup first deduplicates the batch's rows and gathers them into a small leaf tensor; autograd then yields
a dense gradient for just those rows, which the sparse optimizer applies in place. No [num_rows, dim] gradient
is ever built, and rows a batch did not touch (and their optimizer state) are not read or written.

With several ranks the tables are replicated: each rank sends its touched rows and their gradients to all
others, so every rank applies the same averaged update and the replicas stay identical.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kembed_trainer import config, sparse_optim
from kembed_trainer.data.batch import Batch

__all__ = ["EmbeddingCollection"]


class _Group:
    """The tables of one width, stacked row-wise in one matrix."""

    def __init__(self, tables: list[config.TableConfig], device: torch.device, gen: torch.Generator) -> None:
        self.tables = tables
        self.dim = tables[0].embedding_dim
        self.features = [f for t in tables for f in t.features]
        sizes = [t.num_embeddings for t in tables]
        starts = [0, *torch.tensor(sizes).cumsum(0).tolist()]
        self.table_starts = torch.tensor(starts[:-1], device=device)
        per_feature = [(i, t) for i, t in enumerate(tables) for _ in t.features]
        self.feature_starts = torch.tensor([starts[i] for i, _ in per_feature], device=device)
        self.feature_sizes = torch.tensor([t.num_embeddings for _, t in per_feature], device=device)
        self.feature_hashed = [t.hash_ids for _, t in per_feature]
        self.feature_names = [f for t in tables for f in t.features]
        # Frequency admission: rows seen in fewer batches than their table's admit_after use its last row.
        self.admit_after = torch.tensor([t.admit_after for t in tables], device=device)
        self.fallback_row = self.table_starts + torch.tensor(
            [t.num_embeddings - 1 for t in tables], device=device
        )
        self.seen = (
            torch.zeros(starts[-1], dtype=torch.int64, device=device)
            if any(t.admit_after for t in tables)
            else None
        )
        self.lr_scale = torch.tensor([t.lr_scale for t in tables], device=device)
        self.weight = torch.empty(starts[-1], self.dim, device=device)
        for t, lo in zip(tables, starts):
            # DLRM's init: small enough that the dot interaction starts near zero for big tables.
            bound = math.sqrt(1.0 / t.num_embeddings)
            self.weight[lo : lo + t.num_embeddings].uniform_(-bound, bound, generator=gen)
        self.state: dict[str, torch.Tensor] = {}

    def table_of(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.searchsorted(self.table_starts, rows, right=True) - 1

    def row_lr(self, rows: torch.Tensor, lr: float) -> torch.Tensor:
        return lr * self.lr_scale[self.table_of(rows)]

    def rows_of(self, ids: list[torch.Tensor]) -> torch.Tensor:
        """Group rows of each feature's raw ids: hashed or range-checked, then offset to the table's rows."""
        out = []
        for f, feature_ids in enumerate(ids):
            size = int(self.feature_sizes[f])
            if self.feature_hashed[f]:
                feature_ids = torch.remainder(_mix(feature_ids), size)
            elif feature_ids.numel() and (int(feature_ids.min()) < 0 or int(feature_ids.max()) >= size):
                raise ValueError(
                    f"feature {self.feature_names[f]!r}: ids {int(feature_ids.min())}..{int(feature_ids.max())} outside [0, {size}); "
                    "set hash_ids on its table for unbounded ids"
                )
            out.append(feature_ids + self.feature_starts[f])
        return torch.cat(out)

    def admit(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows not yet admitted replaced by their table's fallback (last) row."""
        if self.seen is None:
            return rows
        table = self.table_of(rows)
        return torch.where(self.seen[rows] >= self.admit_after[table], rows, self.fallback_row[table])

    def table_slices(self, t: int) -> slice:
        lo = int(self.table_starts[t])
        return slice(lo, lo + self.tables[t].num_embeddings)


class EmbeddingCollection:
    def __init__(
        self,
        emb_cfg: config.EmbeddingsConfig,
        opt_cfg: config.SparseOptimizerConfig,
        *,
        device: torch.device,
        seed: int,
        world_size: int,
    ) -> None:
        gen = torch.Generator(device=device).manual_seed(seed)
        by_dim: dict[int, list[config.TableConfig]] = {}
        for t in emb_cfg.ordered_tables:
            by_dim.setdefault(t.embedding_dim, []).append(t)
        self.groups = [_Group(tables, device, gen) for tables in by_dim.values()]
        self.optimizer = sparse_optim.build_sparse_optimizer(opt_cfg)
        for g in self.groups:
            g.state = self.optimizer.init_state(g.weight.shape[0], g.dim, device)
        self.lr = opt_cfg.lr
        self.world_size = world_size
        self.num_features = sum(len(g.features) for g in self.groups)
        self._pending: list[tuple[_Group, torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        self.last_unique_rows = 0

    def __call__(self, batch: Batch) -> list[torch.Tensor]:
        """Pooled (summed) embeddings, one [B, num_features_of_group, dim] tensor per width group."""
        b = batch.batch_size
        lengths = batch.lengths.view(self.num_features, b)
        per_feature = lengths.sum(1)
        values = torch.split(batch.values, per_feature.tolist())
        out, first = [], 0
        self._pending = []
        self.last_unique_rows = 0
        for g in self.groups:
            nf = len(g.features)
            raw_rows = g.rows_of(values[first : first + nf])
            uniq, inverse = torch.unique(g.admit(raw_rows), return_inverse=True)
            # A leaf holding only the touched rows: its .grad is the row-sparse gradient.
            touched = g.weight[uniq].requires_grad_(True)
            flat_lengths = lengths[first : first + nf].reshape(-1)
            offsets = torch.cumsum(flat_lengths, 0) - flat_lengths
            pooled = F.embedding_bag(inverse, touched, offsets, mode="sum")
            out.append(pooled.view(nf, b, g.dim).transpose(0, 1))
            self._pending.append((g, uniq, touched, raw_rows if g.seen is not None else None))
            self.last_unique_rows += uniq.numel()
            first += nf
        return out

    @torch.no_grad()
    def step(self, step: int) -> None:
        """Apply the sparse optimizer to the rows of the last lookup (after `loss.backward()`)."""
        for g, rows, touched, raw_rows in self._pending:
            if raw_rows is not None:
                _count_seen(g.seen, raw_rows, self.world_size)
            grad = touched.grad
            if grad is None:  # the loss did not depend on this group
                continue
            if self.world_size > 1:
                rows, grad = _average_across_ranks(rows, grad, self.world_size)
            self.optimizer.update(g.weight, g.state, rows, grad, g.row_lr(rows, self.lr), step)
        self._pending = []

    def discard_lookup(self) -> None:
        """Forget the last lookup (after evaluation, which has no gradients to apply)."""
        self._pending = []

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Per-table views into the group matrices (weights and optimizer state), keyed `<table>.<name>`."""
        sd = {}
        for g in self.groups:
            for i, t in enumerate(g.tables):
                rows = g.table_slices(i)
                sd[f"{t.name}.weight"] = g.weight[rows]
                for name, s in g.state.items():
                    sd[f"{t.name}.{name}"] = s[rows]
                if g.seen is not None:
                    sd[f"{t.name}.seen"] = g.seen[rows]
        return sd


def _mix(ids: torch.Tensor) -> torch.Tensor:
    """A fixed integer hash (multiply-xorshift), so nearby raw ids land in unrelated buckets."""
    h = ids * -7046029254386353131  # 0x9E3779B97F4A7C15 as int64; products wrap like uint64
    h = h ^ (h >> 29)
    h = h * -4658895280553007687  # 0xBF58476D1CE4E5B9
    return h ^ (h >> 32)


def _count_seen(seen: torch.Tensor, raw_rows: torch.Tensor, world_size: int) -> None:
    """Count one sighting per batch and rank for each row, the same on every rank."""
    uniq = torch.unique(raw_rows)
    if world_size > 1:
        uniq, ones = _average_across_ranks(uniq, torch.ones(uniq.numel(), 1, device=uniq.device), world_size)
        seen.index_add_(0, uniq, (ones[:, 0] * world_size).round().long())
    else:
        seen[uniq] += 1


def _average_across_ranks(
    rows: torch.Tensor, grad: torch.Tensor, world_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """All ranks' (rows, grad) summed per row and divided by world size, as DDP averages dense gradients."""
    n = torch.tensor([rows.numel()], device=rows.device)
    sizes = [torch.empty_like(n) for _ in range(world_size)]
    dist.all_gather(sizes, n)
    width = int(max(s.item() for s in sizes))
    # all_gather needs equal shapes: pad with row -1, dropped below.
    padded_rows = torch.full((width,), -1, dtype=rows.dtype, device=rows.device)
    padded_rows[: rows.numel()] = rows
    padded_grad = torch.zeros(width, grad.shape[1], dtype=grad.dtype, device=grad.device)
    padded_grad[: rows.numel()] = grad
    all_rows = [torch.empty_like(padded_rows) for _ in range(world_size)]
    all_grad = [torch.empty_like(padded_grad) for _ in range(world_size)]
    dist.all_gather(all_rows, padded_rows)
    dist.all_gather(all_grad, padded_grad)
    cat_rows, cat_grad = torch.cat(all_rows), torch.cat(all_grad)
    keep = cat_rows >= 0
    uniq, inverse = torch.unique(cat_rows[keep], return_inverse=True)
    summed = torch.zeros(uniq.numel(), grad.shape[1], dtype=grad.dtype, device=grad.device)
    summed.index_add_(0, inverse, cat_grad[keep])
    return uniq, summed / world_size
