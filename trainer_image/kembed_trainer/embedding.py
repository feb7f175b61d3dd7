"""Embedding tables: batched lookups, row-sparse gradients, and a fused sparse optimizer step.

All tables of one width live in one matrix, so a batch's features are looked up in one `embedding_bag` call.
The lookup first deduplicates the batch's rows and gathers them into a small leaf tensor; autograd then yields
a dense gradient for just those rows, which the sparse optimizer applies in place. No [num_rows, dim] gradient
is ever built, and rows a batch did not touch (and their optimizer state) are not read or written.

With several ranks, small tables are replicated: each rank sends its touched rows and their gradients to all
others, so every rank applies the same averaged update and the replicas stay identical. Big tables are sharded
row-wise (`sharding.py`): each rank holds 1/world_size of their rows, sends the ids it needs to their owners
and gets the rows back (all-to-all); after backward the gradients go back the same way and each owner updates
only its own rows.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from kembed_contract import kinds
from kembed_contract import trainer_config as config
from kembed_trainer import delta, hugepages, pooling, sharding, sparse_optim
from kembed_trainer import kinds as trainer_kinds
from kembed_trainer.data.batch import Batch

__all__ = ["EmbeddingCollection", "Group", "SideTable", "hash_rows", "sum_across_ranks"]


class SideTable(NamedTuple):
    """Rows a table's kind keeps beside the table's own, in a row space of their own (a dynamic table's ids
    waiting for admission, its Bloom filter): checkpointed as the table `<table>-<name>`, sharded Shard(0), its
    changed rows in deltas."""

    fields: dict[str, torch.Tensor]  # this rank's rows of each field
    num_rows: int  # rows over all ranks
    first: int  # the first of them this rank holds
    changed: torch.Tensor  # per row this rank holds: changed since the last checkpoint


class Group:
    tiered = False  # whether its rows live on disk behind a cache (kembed_trainer.tiered.table)

    """The tables of one width held in memory (the plain table kind's group, `kembed_trainer.tables.plain`): replicated ones stacked in `weight`, this rank's rows of sharded ones in `shard`.

    Rows are addressed by a virtual index over all tables of the group stacked whole (`table_starts`), which is
    what ids map to, what admission counts, and the same at any world size. Replicated tables come first in
    it, in the order of `weight`, then the sharded ones. A lookup renumbers the sharded rows by their storage
    index (`sharding.RowLayout`: rank 0's rows, then rank 1's, ...), so its sorted rows split into runs: rows
    of `weight` as they are, then the rows of each owner in turn; neither the vectors nor their gradients need
    shuffling on their way to and from `weight` or the all-to-all.
    """

    def __init__(
        self,
        tables: list[config.TableConfig],
        sharded: list[bool],
        *,
        device: torch.device,
        gen: torch.Generator,
        seed: int,
        table_ids: list[int],
        rank: int,
        world_size: int,
        hold_shard: bool = True,
        counts_admission: bool = True,
    ) -> None:
        """`table_ids`: each table's index over all tables (seeds its sharded rows, the same in any group).
        `hold_shard=False`: this rank's rows of sharded tables are not allocated here (a tiered group holds them
        on disk and sets `shard` to its cache). `counts_admission=False`: `admit_after` is the kind's own
        business (a dynamic group's index counts it), not `seen`'s."""
        self.tables = tables
        self.dim = tables[0].embedding_dim
        self.features = [f for t in tables for f in t.features]
        sizes = [t.num_embeddings for t in tables]
        stacking = sorted(range(len(tables)), key=lambda i: sharded[i])  # replicated first, stable
        starts = [0] * len(tables)
        for prev, i in itertools.pairwise(stacking):
            starts[i] = starts[prev] + sizes[prev]
        self.num_rows = sum(sizes)
        self.num_replicated_rows = sum(n for n, sh in zip(sizes, sharded, strict=True) if not sh)
        self.table_starts = torch.tensor(starts, device=device)
        # For `table_of`: the starts in ascending order, and whose they are.
        self._sorted_starts = torch.tensor([starts[i] for i in stacking], device=device)
        self._table_at = torch.tensor(stacking, device=device)
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
            hugepages.zeros(self.num_rows, dtype=torch.int64, device=device)
            if counts_admission and any(t.admit_after for t in tables)
            else None
        )
        self.lr_scale = torch.tensor([t.lr_scale for t in tables], device=device)
        self.weight_decay = torch.tensor([t.weight_decay for t in tables], device=device)
        self.any_decay = any(t.weight_decay > 0 for t in tables)
        self.sharded = torch.tensor(sharded, dtype=torch.bool, device=device)
        self.is_sharded = list(sharded)
        self.virtual_starts = starts
        self.feature_table = [i for i, _ in per_feature]
        self.any_sharded = any(sharded)
        # Replicated tables, stacked in table order.
        repl_sizes = [0 if sh else n for n, sh in zip(sizes, sharded, strict=True)]
        self.repl_starts = torch.tensor(repl_sizes, device=device).cumsum(0) - torch.tensor(
            repl_sizes, device=device
        )
        self.weight = hugepages.empty(sum(repl_sizes), self.dim, device=device)
        for i, t in enumerate(tables):
            if not sharded[i]:
                # Naumov et al.'s init (2019): small enough that a dot interaction starts near zero for big tables.
                lo = int(self.repl_starts[i])
                self.weight[lo : lo + t.num_embeddings].uniform_(-_bound(t), _bound(t), generator=gen)
        # Sharded tables: this rank's rows, initialised the same whatever the world size.
        self.layout = sharding.RowLayout(
            [n if sh else 0 for n, sh in zip(sizes, sharded, strict=True)], world_size, rank, device
        )
        self.shard = hugepages.empty(self.layout.num_local_rows if hold_shard else 0, self.dim, device=device)
        for i, t in enumerate(tables):
            if sharded[i] and hold_shard:
                piece = self.layout.local_slice(i)
                lo = self.layout.table_lo(i)
                _seeded_uniform(self.shard[piece], lo, _bound(t), seed=seed, table=table_ids[i])
        self.state: dict[str, torch.Tensor] = {}
        self.shard_state: dict[str, torch.Tensor] = {}
        # Rows changed since the last checkpoint (weights and optimizer state; admission counts apart), so an
        # incremental checkpoint saves only those (delta.py). One byte per row: a small share of the tables.
        self.changed = torch.zeros(self.weight.shape[0], dtype=torch.bool, device=device)
        self.shard_changed = torch.zeros(self.shard.shape[0], dtype=torch.bool, device=device)
        self.seen_changed = (
            torch.zeros(self.num_rows, dtype=torch.bool, device=device) if self.seen is not None else None
        )

    def table_of(self, rows: torch.Tensor) -> torch.Tensor:
        return self._table_at[torch.searchsorted(self._sorted_starts, rows, right=True) - 1]

    def rows_of(self, ids: list[torch.Tensor], step: int | None = None) -> torch.Tensor:
        """Group rows of each feature's raw ids: hashed or range-checked, then offset to the table's rows.
        `step`: the training step looking them up (None: evaluation), for kinds whose rows move with it."""
        out = []
        for f, feature_ids in enumerate(ids):
            size = int(self.feature_sizes[f])
            if self.feature_hashed[f]:
                feature_ids = hash_rows(feature_ids, size)
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

    def storage_rows(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Virtual `rows` (`counts[f]` of feature f, in feature order) as storage rows: replicated ones as they
        are (rows of `weight`), sharded ones after them in the ranks' order (`sharding.RowLayout`)."""
        if not self.any_sharded:
            return rows
        out = []
        for f, feature_rows in enumerate(torch.split(rows, counts)):
            t = self.feature_table[f]
            if self.is_sharded[t]:
                rows_in_table = feature_rows - self.virtual_starts[t]
                feature_rows = self.layout.storage_rows(t, rows_in_table) + self.num_replicated_rows
            out.append(feature_rows)
        return torch.cat(out)

    def gather(self, rows: torch.Tensor) -> tuple[torch.Tensor, _Touched]:
        """The vectors of sorted unique storage `rows`: replicated ones read here, sharded ones fetched from
        their owners; the replicated ones first (they are the smaller rows) and numbered as in `weight`."""
        if not self.any_sharded:
            return self.weight.index_select(0, rows), _Touched(rows, rows.numel(), None)
        num_repl = int(torch.searchsorted(rows, rows.new_tensor([self.num_replicated_rows])))
        repl_rows = rows[:num_repl]
        local, counts = self.layout.split_by_owner(rows[num_repl:] - self.num_replicated_rows)
        exchange = sharding.Exchange.plan(local, counts)
        vectors = torch.empty(rows.numel(), self.dim, device=rows.device)
        torch.index_select(self.weight, 0, repl_rows, out=vectors[:num_repl])
        exchange.fetch(self.shard, out=vectors[num_repl:])
        return vectors, _Touched(repl_rows, num_repl, exchange)

    def repl_table(self, rows: torch.Tensor) -> torch.Tensor:
        """Each `weight` row's table."""
        return torch.searchsorted(self.repl_starts, rows, right=True) - 1

    def shard_table(self, local_rows: torch.Tensor) -> torch.Tensor:
        return self.layout.local_table_of(local_rows)

    def table_slices(self, t: int) -> slice:
        lo = int(self.repl_starts[t])
        return slice(lo, lo + self.tables[t].num_embeddings)

    def virtual_slice(self, t: int) -> slice:
        lo = int(self.table_starts[t])
        return slice(lo, lo + self.tables[t].num_embeddings)

    # What a table kind keeps beside the rows (a dynamic table's index), checkpointed with them.
    def extra_fields(self, t: int) -> dict[str, torch.Tensor]:
        """Per-row fields of sharded table t beyond its weight and optimizer state (this rank's rows):
        checkpointed as `<table>.<name>`, in deltas with the table's changed rows."""
        return {}

    def side_tables(self, t: int) -> dict[str, SideTable]:
        return {}

    def after_restore(self) -> None:
        """Called on every rank once a checkpoint is loaded into the group's tensors (may be a collective)."""

    @property
    def extra_bytes(self) -> int:
        """Memory the kind holds beyond `weight`, `shard` and their optimizer state."""
        return 0


class _Touched(NamedTuple):
    """Where a lookup's unique rows came from, so their gradients go back there."""

    repl_rows: torch.Tensor  # rows of `weight`: the lookup's first rows
    num_repl: int  # how many; the rest are rows of sharded tables
    exchange: sharding.Exchange | None  # where those came from (None: no sharded tables)


class EmbeddingCollection:
    def __init__(
        self,
        emb_cfg: config.EmbeddingsConfig,
        opt_cfg: config.SparseOptimizerConfig,
        *,
        device: torch.device,
        seed: int,
        world_size: int,
        rank: int = 0,
    ) -> None:
        gen = torch.Generator(device=device).manual_seed(seed)
        # One group per width and table kind, each held as its kind holds tables (kembed_trainer.tables).
        by_group: dict[tuple, list[config.TableConfig]] = {}
        for t in emb_cfg.ordered_tables:
            key = (kinds.table_kind(t).kind_name(), trainer_kinds.table(t).group_key(t), t.embedding_dim)
            by_group.setdefault(key, []).append(t)
        table_id = {t.name: i for i, t in enumerate(emb_cfg.ordered_tables)}  # seeds a table the same in any group
        self.groups = []
        for tables in by_group.values():
            sharded = [emb_cfg.is_sharded(t) for t in tables]
            self.groups.append(
                trainer_kinds.table(tables[0]).group(
                    tables,
                    sharded,
                    device=device,
                    gen=gen,
                    seed=seed,
                    table_ids=[table_id[t.name] for t in tables],
                    optimizer=opt_cfg.name,
                    rank=rank,
                    world_size=world_size,
                )
            )
        self.optimizer = sparse_optim.build_sparse_optimizer(opt_cfg)
        for g in self.groups:
            g.state = self.optimizer.init_state(g.weight.shape[0], g.dim, device)
            g.shard_state = self.optimizer.init_state(g.shard.shape[0], g.dim, device)
        # Where each group's features are in a batch (by width, in table order): a width's tables of two kinds
        # are two groups, so a group's features need not be one run of the batch's.
        position = {f: i for i, f in enumerate(emb_cfg.features)}
        self._positions = [[position[f] for f in g.features] for g in self.groups]
        self._in_order = [p for ps in self._positions for p in ps] == list(range(len(position)))
        self.tiered = [g for g in self.groups if g.tiered]
        for g in self.tiered:
            g.open()
        self.lr = opt_cfg.lr
        self.world_size = world_size
        self.device = device
        self.num_features = sum(len(g.features) for g in self.groups)
        self._pending: list[tuple[Group, _Touched, torch.Tensor, torch.Tensor | None]] = []
        self.last_unique_rows = 0

    @property
    def exchanges(self) -> bool:
        """Whether lookups talk to other ranks, so every rank must make the same number of them."""
        return self.world_size > 1 and any(g.any_sharded for g in self.groups)

    @property
    def num_bytes(self) -> int:
        """This rank's table weights and sparse-optimizer state in memory (of tiered tables: their caches)."""
        tensors = [
            t for g in self.groups if not g.tiered
            for t in (g.weight, g.shard, *g.state.values(), *g.shard_state.values())
        ]
        return (sum(t.numel() * t.element_size() for t in tensors) + sum(g.memory_bytes for g in self.tiered)
                + sum(g.extra_bytes for g in self.groups))

    def __call__(self, batch: Batch, step: int | None = None) -> list[torch.Tensor]:
        """Pooled (summed) embeddings, one [B, num_features_of_width, dim] tensor per width (in feature order).
        `step`: the training step (dynamic tables admit and evict by it); None for evaluation."""
        b = batch.batch_size
        out = []
        self._pending = []
        self.last_unique_rows = 0
        for g, (values, counts, lengths) in zip(self.groups, self.inputs(batch), strict=True):
            nf = len(g.features)
            raw_rows = g.rows_of(values, step)
            rows = g.storage_rows(g.admit(raw_rows), counts)
            bags = pooling.plan_bags(*pooling.by_sample(rows, lengths), g.num_rows)
            vectors, where = g.gather(bags.unique_rows)
            # A leaf holding only the touched rows: its .grad is the row-sparse gradient.
            touched = vectors.requires_grad_(True)
            pooled = pooling.pool(touched, bags)
            out.append(pooled.view(b, nf, g.dim))
            self._pending.append((g, where, touched, raw_rows if g.seen is not None else None))
            self.last_unique_rows += bags.unique_rows.numel()
        if len(out) == len({g.dim for g in self.groups}):
            return out
        # A width's tiered and in-memory groups: one tensor, its features in the batch's order.
        merged = []
        for run in _runs_of_width(list(range(len(out))), [g.dim for g in self.groups]):
            whole = torch.cat([out[i] for i in run], 1) if len(run) > 1 else out[run[0]]
            if not self._in_order:
                whole = whole.index_select(1, torch.tensor([p for i in run for p in self._positions[i]]).argsort())
            merged.append(whole)
        return merged

    def inputs(self, batch: Batch) -> list[tuple[list[torch.Tensor], list[int], torch.Tensor]]:
        """Per group: its features' ids, how many each, and their bags' lengths ([features, batch])."""
        lengths = batch.lengths.view(self.num_features, batch.batch_size)
        counts = lengths.sum(1).tolist()
        values = torch.split(batch.values, counts)
        out, first = [], 0
        for positions in self._positions:
            nf = len(positions)
            if self._in_order:
                out.append((list(values[first:first + nf]), counts[first:first + nf], lengths[first:first + nf]))
            else:
                out.append(([values[p] for p in positions], [counts[p] for p in positions],
                            lengths[torch.tensor(positions)]))
            first += nf
        return out

    @property
    def prefetches(self) -> bool:
        """Whether `prefetch` helps: some tables are tiered (their rows on disk) and lookups stay on this rank."""
        return bool(self.tiered) and self.world_size == 1

    def prefetch(self, batch: Batch) -> None:
        """Start making the rows `batch` will look up in tiered tables resident (on a background thread): the
        trainer hands over the next step's batch while this step trains."""
        if not self.prefetches:
            return
        for g, (values, counts, _) in zip(self.groups, self.inputs(batch), strict=True):
            if g.tiered:
                g.prefetch(functools.partial(_unique_storage_rows, g, values, counts))

    def tier_stats(self) -> dict[str, float]:
        """The tiered tables' counters since the last call, summed over their groups (see docs/trainer.md)."""
        if not self.tiered:
            return {}
        from kembed_trainer.tiered import table as tiered

        total = tiered.TierStats()
        for g in self.tiered:
            total.add(g.take_stats())
        return vars(total)

    def close(self) -> None:
        """Stop the tiered tables' threads and close their files."""
        for g in self.tiered:
            g.close()

    def lookup_nothing(self) -> None:
        """Take part in other ranks' lookups without looking anything up (a rank out of eval batches)."""
        empty = Batch(
            dense=torch.empty(0, 0, device=self.device),
            values=torch.empty(0, dtype=torch.int64, device=self.device),
            lengths=torch.empty(0, dtype=torch.int64, device=self.device),
            labels=torch.empty(0, device=self.device),
        )
        self(empty)
        self._pending = []

    @torch.no_grad()
    def step(self, step: int) -> None:
        """Apply the sparse optimizer to the rows of the last lookup (after `loss.backward()`)."""
        for g, where, touched, raw_rows in self._pending:
            if raw_rows is not None:
                g.seen_changed[_count_seen(g.seen, raw_rows, self.world_size)] = True
            grad = touched.grad
            if grad is None:  # the loss did not depend on this group (the same on every rank)
                continue
            if g.weight.shape[0]:
                repl_grad = grad[: where.num_repl]
                self._update(g, g.weight, g.state, g.changed, where.repl_rows, repl_grad, g.repl_table, step,
                             average=True)
            if where.exchange is not None:
                rows, summed = where.exchange.return_grads(grad[where.num_repl :])
                if self.world_size > 1:
                    summed = summed / self.world_size
                self._update(g, g.shard, g.shard_state, g.shard_changed, rows, summed, g.shard_table, step,
                             average=False)
        self._pending = []

    def _update(self, g: Group, weight, state, changed, rows, grad, table_of, step: int, *, average: bool) -> None:
        if average and self.world_size > 1:
            rows, grad = _average_across_ranks(rows, grad, self.world_size)
        if rows.numel():
            changed[rows] = True
            table = table_of(rows)
            if g.any_decay:  # L2 on the rows this step touched (after averaging: replicas hold the same rows)
                grad = grad + weight.index_select(0, rows) * g.weight_decay[table][:, None]
            self.optimizer.update(weight, state, rows, grad, g.lr_scale[table] * self.lr, step)

    def discard_lookup(self) -> None:
        """Forget the last lookup (after evaluation, which has no gradients to apply)."""
        self._pending = []

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Per-table views into the group matrices (weights and optimizer state), keyed `<table>.<name>`.

        A sharded table is a DTensor placed `Shard(0)` over the ranks, so DCP writes each rank's rows and
        reads back whichever rows a rank owns at another world size.
        """
        sd = {}
        for g in self.groups:
            for i, t in enumerate(g.tables):
                if g.tiered:  # rows on disk: placeholders, streamed from the store (`tier_fields`)
                    for name, field in g.fields(i).items():
                        sd[f"{t.name}.{name}"] = self._sharded(field.placeholder(), t.num_embeddings)
                elif g.sharded[i]:
                    piece = g.layout.local_slice(i)
                    sd[f"{t.name}.weight"] = self._sharded(g.shard[piece], t.num_embeddings)
                    for name, s in g.shard_state.items():
                        sd[f"{t.name}.{name}"] = self._sharded(s[piece], t.num_embeddings)
                else:
                    rows = g.table_slices(i)
                    sd[f"{t.name}.weight"] = g.weight[rows]
                    for name, s in g.state.items():
                        sd[f"{t.name}.{name}"] = s[rows]
                if g.seen is not None:
                    sd[f"{t.name}.seen"] = g.seen[g.virtual_slice(i)]
                for name, local in g.extra_fields(i).items():
                    sd[f"{t.name}.{name}"] = self._sharded(local, t.num_embeddings)
                for side, rows in g.side_tables(i).items():
                    for name, local in rows.fields.items():
                        sd[f"{t.name}-{side}.{name}"] = self._sharded(local, rows.num_rows)
        return sd

    def changes(self, rank: int) -> dict[str, delta.TableChanges]:
        """The rows changed since `forget_changes`, as the table rows this rank writes into a delta (delta.py):
        its own rows of sharded tables, and on rank 0 those of replicated tables and the admission counts."""
        out = {}
        for g in self.groups:
            for i, t in enumerate(g.tables):
                if g.tiered:  # after `flush`: every change is in the store
                    rows = torch.from_numpy(g.changed_local_rows(i)) + g.layout.table_lo(i)
                elif g.sharded[i]:
                    rows = g.shard_changed[g.layout.local_slice(i)].nonzero()[:, 0] + g.layout.table_lo(i)
                elif rank == 0:
                    rows = g.changed[g.table_slices(i)].nonzero()[:, 0]
                else:
                    rows = g.changed.new_empty(0, dtype=torch.int64)
                seen_rows = None
                if g.seen_changed is not None and rank == 0:
                    seen_rows = g.seen_changed[g.virtual_slice(i)].nonzero()[:, 0]
                out[t.name] = delta.TableChanges(rows, seen_rows)
                for side, side_rows in g.side_tables(i).items():
                    out[f"{t.name}-{side}"] = delta.TableChanges(side_rows.changed.nonzero()[:, 0] + side_rows.first,
                                                                 None)
        return out

    def forget_changes(self) -> None:
        """Start counting changed rows afresh (a checkpoint now holds every change so far)."""
        for g in self.groups:
            for mask in (g.changed, g.shard_changed, g.seen_changed):
                if mask is not None and not (g.tiered and mask is g.shard_changed):  # a tiered group's: to write back
                    mask.zero_()
            if g.tiered:
                g.forget_changes()
            for i in range(len(g.tables)):
                for side in g.side_tables(i).values():
                    side.changed.zero_()

    def flush(self) -> None:
        """Write the tiered tables' changed cached rows to their stores (before a checkpoint reads them)."""
        for g in self.tiered:
            g.flush()

    def snapshot(self) -> Callable[[], None]:
        """Take a snapshot of the tiered tables' stores (`flush` first) that their fields (`tier_fields`) read
        while training goes on writing to the stores (copy-on-write: tiered.snapshot); returns its release."""
        for g in self.tiered:
            g.begin_snapshot()

        def release() -> None:
            for g in self.tiered:
                g.end_snapshot()

        return release

    def tier_fields(self) -> dict[str, object]:
        """Every tiered table's fields (`tiered.table.TableField`) by state-dict key (`<table>.<field>`): what a
        checkpoint streams from the stores instead of reading tensors."""
        return {f"{t.name}.{name}": field for g in self.tiered for i, t in enumerate(g.tables)
                for name, field in g.fields(i).items()}

    def after_restore(self) -> None:
        """Let each group settle what a checkpoint loaded (a collective: every rank calls it)."""
        for g in self.groups:
            g.after_restore()

    def dynamic_stats(self) -> dict[str, int]:
        """Dynamic tables' rows in use now, and ids admitted and rows evicted (the table full, or unseen past
        their time to live) since the last call: this rank's, summed over its dynamic groups."""
        out = {"rows_in_use": 0, "admitted": 0, "evicted_capacity": 0, "evicted_ttl": 0}
        found = False
        for g in self.groups:
            if hasattr(g, "take_dynamic_stats"):
                found = True
                out["rows_in_use"] += g.rows_in_use
                for name, value in vars(g.take_dynamic_stats()).items():
                    out[name] += value
        return out if found else {}

    def drop_caches(self) -> None:
        """Forget the tiered tables' cached rows (their stores were just loaded from a checkpoint)."""
        for g in self.tiered:
            g.drop_cache()

    def full_weight(self, name: str) -> torch.Tensor:
        """Every row of table `name` on this rank (a sharded table is all-gathered: a collective)."""
        for g in self.groups:
            for i, t in enumerate(g.tables):
                if t.name != name:
                    continue
                if g.tiered:
                    raise ValueError(f"table {name!r} is tiered: it is not read whole into memory")
                if not g.sharded[i]:
                    return g.weight[g.table_slices(i)]
                local = g.shard[g.layout.local_slice(i)]
                return local if self.world_size == 1 else self._sharded(local, t.num_embeddings).full_tensor()
        raise KeyError(name)

    def _sharded(self, local: torch.Tensor, num_rows: int) -> torch.Tensor:
        if self.world_size == 1:
            return local
        if self._mesh is None:
            self._mesh = init_device_mesh(self.device.type, (self.world_size,))
        shape = (num_rows, *local.shape[1:])
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(local, self._mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)

    _mesh = None


def _runs_of_width(items: list, dims: list[int]) -> list[list]:
    """`items` (one per group) cut into runs of consecutive groups of one width (a width's groups are)."""
    runs: list[list] = []
    for i, t in enumerate(items):
        if i and dims[i] == dims[i - 1]:
            runs[-1].append(t)
        else:
            runs.append([t])
    return runs


def _unique_storage_rows(g: Group, values: list[torch.Tensor], counts: list[int]) -> torch.Tensor:
    """The sorted distinct storage rows a lookup of these features' ids will need (as `__call__` finds them)."""
    return torch.unique(g.storage_rows(g.admit(g.rows_of(values)), counts))  # no step: nothing admitted


def _bound(t: config.TableConfig) -> float:
    return math.sqrt(1.0 / t.num_embeddings)


_INIT_BLOCK = 1 << 16


def _seeded_uniform(out: torch.Tensor, first_row: int, bound: float, *, seed: int, table: int) -> None:
    """Fill `out` (rows first_row.. of a table) with U(-bound, bound) drawn in fixed blocks of rows, each from
    its own seed, so that any rank can draw any rows and they are the same at every world size."""
    row, end = first_row, first_row + out.shape[0]
    while row < end:
        block = row // _INIT_BLOCK
        gen = torch.Generator(device=out.device).manual_seed(
            (seed * 1_000_003 + table) * 1_000_003 + block & 0x7FFF_FFFF_FFFF_FFFF
        )
        values = torch.empty(_INIT_BLOCK, out.shape[1], device=out.device).uniform_(
            -bound, bound, generator=gen
        )
        hi = min(end, (block + 1) * _INIT_BLOCK)
        out[row - first_row : hi - first_row] = values[row - block * _INIT_BLOCK : hi - block * _INIT_BLOCK]
        row = hi


def hash_rows(ids: torch.Tensor, num_embeddings: int) -> torch.Tensor:
    """The rows of a hashed table that int64 ids land in."""
    return torch.remainder(_mix(ids), num_embeddings)


def _mix(ids: torch.Tensor) -> torch.Tensor:
    """A fixed integer hash (multiply-xorshift), so nearby raw ids land in unrelated buckets."""
    h = ids * -7046029254386353131  # 0x9E3779B97F4A7C15 as int64; products wrap like uint64
    h = h ^ (h >> 29)
    h = h * -4658895280553007687  # 0xBF58476D1CE4E5B9
    return h ^ (h >> 32)


def _count_seen(seen: torch.Tensor, raw_rows: torch.Tensor, world_size: int) -> torch.Tensor:
    """Count one sighting per batch and rank for each row, the same on every rank; the rows counted."""
    uniq = torch.unique(raw_rows)
    if world_size > 1:
        uniq, ones = _average_across_ranks(uniq, torch.ones(uniq.numel(), 1, device=uniq.device), world_size)
        seen.index_add_(0, uniq, (ones[:, 0] * world_size).round().long())
    else:
        seen[uniq] += 1
    return uniq


def _average_across_ranks(
    rows: torch.Tensor, grad: torch.Tensor, world_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """All ranks' (rows, grad) summed per row and divided by world size, as DDP averages dense gradients."""
    uniq, summed = sum_across_ranks(rows, grad, world_size)
    return uniq, summed / world_size


def sum_across_ranks(rows: torch.Tensor, values: torch.Tensor, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's (rows, values), one value row per row: the sorted distinct rows of all ranks and each one's
    values summed over the ranks (the same on every rank)."""
    n = torch.tensor([rows.numel()], device=rows.device)
    sizes = [torch.empty_like(n) for _ in range(world_size)]
    dist.all_gather(sizes, n)
    width = int(max(s.item() for s in sizes))
    # all_gather needs equal shapes: pad with row -1, dropped below.
    padded_rows = torch.full((width,), -1, dtype=rows.dtype, device=rows.device)
    padded_rows[: rows.numel()] = rows
    padded_values = torch.zeros(width, values.shape[1], dtype=values.dtype, device=values.device)
    padded_values[: rows.numel()] = values
    all_rows = [torch.empty_like(padded_rows) for _ in range(world_size)]
    all_values = [torch.empty_like(padded_values) for _ in range(world_size)]
    dist.all_gather(all_rows, padded_rows)
    dist.all_gather(all_values, padded_values)
    cat_rows, cat_values = torch.cat(all_rows), torch.cat(all_values)
    keep = cat_rows >= 0
    uniq, inverse = torch.unique(cat_rows[keep], return_inverse=True)
    summed = torch.zeros(uniq.numel(), values.shape[1], dtype=values.dtype, device=values.device)
    summed.index_add_(0, inverse, cat_values[keep])
    return uniq, summed
