"""What a job needs of each node, worked out once for everyone: the API (shown at submission, and the refusals of
jobs that cannot fit), the backends (what they request and check) and the trainer (how big its tiers' caches are).

- **Memory per rank** (`memory_per_rank`): what grows with the config (tables, optimizer state, dense model, a
  step's batch, an eval's gathered scores, what the data source keeps: never the data's own size, as it is
  streamed), plus the interpreter and libraries every rank loads (`MemoryEstimate.baseline`). What depends on a
  kind is the kind's to say (kembed_contract.kinds): its tables' bytes, its model's layers and what its evaluation
  holds, its data's ids per sample and what the source keeps.
- **Tier caches sized from the job** (`with_cache_sizes`): a tiered table that gives no `cache_rows`/`cache_mb`
  caches what the rank's memory leaves after the rest of this estimate. The API sizes it from
  `resources.memory_per_node`, the trainer from the same number its launcher hands it (`runtime.ENV_MEMORY_PER_RANK`),
  with this one function: both see the same cache.
- **Local disk per node** (`local_disk_bytes_per_node`): each rank's tier files, and headroom (below). It is what a
  job requests (`resources.local_disk_per_node`, filled in from this when not given), what the tenant's quota
  counts, the size of the volume a pod gets and what the embedded backend checks against its free disk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kembed_contract import kinds
from kembed_contract.kinds.base import BYTES_PER_FLOAT, BYTES_PER_ID
from kembed_contract.trainer_config import TableConfig, TrainerConfig

__all__ = [
    "AUTO_CACHE_SHARE", "LOCAL_DISK_HEADROOM_BYTES", "CacheTooSmall", "MemoryEstimate", "auto_tiered", "in_units",
    "local_disk_bytes_per_node", "local_disk_bytes_per_rank", "memory_per_rank", "rows_per_step",
    "table_memory_bytes_per_rank", "two_steps_words", "with_cache_sizes",
]

# Dense parameters are held as weights, gradients and Adam's two moments: 4 floats each.
_FLOATS_PER_DENSE_PARAMETER = 4
# A step holds each activation about three times: the forward value kept for the backward, its gradient, and a
# temporary of the kernels.
_ACTIVATION_COPIES = 3
_BASELINE_BYTES = 256 * 2**20  # Python, torch and the trainer's code in each rank (about 250 MiB measured)
# Auto-sized caches take this share of what the estimate leaves of a rank's memory. The rest is the estimate's
# margin: what it does not count grows with the cache (the prefetch's records in flight, up to a step's missing
# rows and its dirty victims, and the allocator's fragmentation around them), and a rank past its limit is killed.
AUTO_CACHE_SHARE = 0.9
# Disk a node needs besides its tier files. On Kubernetes the pod's ephemeral-storage limit covers its container's
# writable layer and logs as well as the tier's volume: the kubelet's log rotation keeps up to 5 x 10 MiB per
# container, and the trainer writes numba's compiled loops and Python's temporary files there (a few MiB). The
# tier files themselves are exact (fixed-width records; one file-system block of slack each).
LOCAL_DISK_HEADROOM_BYTES = 256 * 2**20
_BLOCK_BYTES = 4096


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank needs, by what needs them."""

    tables: int  # embedding weights and sparse-optimizer state (a tiered table: its cache and bookkeeping)
    dense: int  # the dense model with its gradients and optimizer state
    batch: int  # one training step's ids, pooled embeddings and activations
    eval: int  # an eval's scores and labels, gathered on every rank, and one eval batch
    data: int  # what the data source keeps (its kind says)
    baseline: int = _BASELINE_BYTES

    @property
    def total(self) -> int:
        return self.tables + self.dense + self.batch + self.eval + self.data + self.baseline

    def describe(self) -> str:
        parts = ", ".join(f"{name} {in_units(getattr(self, name))}"
                          for name in ("tables", "dense", "batch", "eval", "data", "baseline"))
        return f"{in_units(self.total)} per rank ({parts})"


def in_units(num_bytes: float) -> str:
    """`1.50 GiB`, `12.0 MiB`, `180 KiB`: the unit that reads best."""
    if num_bytes >= 2**30:
        return f"{num_bytes / 2**30:.2f} GiB"
    if num_bytes >= 2**20:
        return f"{num_bytes / 2**20:.1f} MiB"
    return f"{num_bytes / 2**10:.0f} KiB"


# ------------------------------------------------------------------------------------------- memory per rank
def table_memory_bytes_per_rank(trainer: TrainerConfig, *, world_size: int = 1) -> int:
    """Weights plus sparse-optimizer state one rank holds, each table as its table kind stores it."""
    total = sum(kinds.table_kind(table).memory_bytes(table, trainer, world_size=world_size)
                for table in trainer.embeddings.tables)
    return int(total)


def _parameters(layers: list[int]) -> int:
    return sum(n_in * n_out + n_out for n_in, n_out in zip(layers, layers[1:], strict=False))


def _eval_bytes(trainer: TrainerConfig, *, width: int, hot: int) -> int:
    """What an evaluation holds at its peak: what is gathered of the held-out set (where its size is known), one
    eval batch, and what the model kind's own metrics hold."""
    total = 0
    rows = trainer.data.eval_rows
    if rows is not None:
        # Scores and labels of the whole held-out set end up on every rank (all-gather), with the list they
        # came from.
        total += rows * 2 * BYTES_PER_FLOAT * 2
    total += trainer.data.eval_bytes(trainer, width=width, ids_per_feature=hot)
    total += trainer.model.eval_bytes(trainer, width=width, eval_rows=rows)
    return total


def memory_per_rank(trainer: TrainerConfig, *, world_size: int = 1) -> MemoryEstimate:
    """The estimate of one rank. A config with auto-sized tier caches is sized first (`with_cache_sizes`)."""
    batch_size = trainer.training.batch_size
    num_features = len(trainer.embeddings.features)
    width = max(t.embedding_dim for t in trainer.embeddings.tables)
    hot = trainer.data.ids_per_feature(trainer)
    layers = trainer.model.dense_layers(trainer)

    ids = batch_size * num_features * hot * BYTES_PER_ID * 2  # the ids, and their exchange or dedup copy
    pooled = batch_size * num_features * width * BYTES_PER_FLOAT * _ACTIVATION_COPIES
    # The sparse gradient: a row for each id the batch touched (at most one per id looked up).
    sparse_grad = batch_size * num_features * hot * width * BYTES_PER_FLOAT * 2
    activations = batch_size * (sum(layers) + trainer.data.num_dense) * BYTES_PER_FLOAT * _ACTIVATION_COPIES
    batch = ids + pooled + sparse_grad + activations

    return MemoryEstimate(
        tables=table_memory_bytes_per_rank(trainer, world_size=world_size),
        dense=_parameters(layers) * _FLOATS_PER_DENSE_PARAMETER * BYTES_PER_FLOAT,
        batch=int(batch), eval=int(_eval_bytes(trainer, width=width, hot=hot)),
        data=int(trainer.data.memory_bytes(trainer, ids_per_feature=hot)),
    )


# ------------------------------------------------------------------------------------------- tier caches
def two_steps_words(capacity: int, rows: int) -> str:
    """The one sentence for a cache too small for the two steps a tiered table holds at once (the one training
    and the next, fetched meanwhile): the trainer's, when a step needs more, and the API's, before it starts."""
    return f"a tiered table's cache of {capacity} rows cannot hold two steps' rows ({rows} this step)"


class CacheTooSmall(ValueError):
    """What the job's memory leaves for an auto-sized cache cannot hold two steps' rows."""


def auto_tiered(trainer: TrainerConfig) -> list[TableConfig]:
    """The tiered tables whose cache is sized from the job's memory (their tier gives no size)."""
    return [t for t in trainer.embeddings.tables if t.tier is not None and t.tier.sized_by_job]


def rows_per_step(table: TableConfig, trainer: TrainerConfig, *, world_size: int) -> int:
    """The most distinct rows of `table` one rank's cache may need in a step: every id every rank looks up in it,
    at most the rank's rows (the owner of a row answers for every rank)."""
    looked_up = world_size * trainer.training.batch_size * len(table.features) * trainer.data.ids_per_feature(trainer)
    return min(_rows_per_rank(table, world_size), looked_up)


def with_cache_sizes(trainer: TrainerConfig, *, world_size: int, memory_bytes_per_rank: int) -> TrainerConfig:
    """`trainer` with every auto-sized tier cache given in rows: what `memory_bytes_per_rank` leaves after the rest
    of the estimate (AUTO_CACHE_SHARE of it), shared so that each such table caches the same share of its rows (at
    most all of them). Raises CacheTooSmall when a cache could not hold two steps' rows (`rows_per_step` twice)."""
    auto = auto_tiered(trainer)
    if not auto:
        return trainer
    optimizer = trainer.optimizer.sparse.name
    # The estimate with each auto cache at one row: everything but those caches, less the one row each.
    floor = _resized(trainer, {t.name: 1 for t in auto})
    rest = memory_per_rank(floor, world_size=world_size).total - sum(_row_bytes(t, optimizer) for t in auto)
    left = max(0.0, (memory_bytes_per_rank - rest) * AUTO_CACHE_SHARE)
    whole = sum(_rows_per_rank(t, world_size) * _row_bytes(t, optimizer) for t in auto)
    share = min(1.0, left / whole)
    sizes = {t.name: max(1, math.floor(share * _rows_per_rank(t, world_size))) for t in auto}
    for t in auto:
        step = rows_per_step(t, trainer, world_size=world_size)
        if sizes[t.name] < min(2 * step, _rows_per_rank(t, world_size)):  # all of its rows always do
            raise CacheTooSmall(
                f"resources.memory_per_node: {two_steps_words(sizes[t.name], step)}: table {t.name}'s tier "
                f"gives no cache size, and what {in_units(memory_bytes_per_rank)} per rank leaves after the rest "
                f"of the job ({in_units(rest)}) holds {sizes[t.name]} of its rows; give the job more "
                f"memory_per_node (or a smaller training.batch_size)")
    return _resized(trainer, sizes)


def _rows_per_rank(table: TableConfig, world_size: int) -> int:
    return -(-table.num_embeddings // world_size)  # the trainer's split (sharding.RowLayout): rank 0 holds most


def _row_bytes(table: TableConfig, optimizer: str) -> int:
    """A row's weight and optimizer state, as the cache and the tier's records hold it."""
    assert table.tier is not None
    return table.tier.row_bytes(table, optimizer)


def _resized(trainer: TrainerConfig, cache_rows: dict[str, int]) -> TrainerConfig:
    tables = [t.model_copy(update={"tier": t.tier.model_copy(update={"cache_rows": cache_rows[t.name]})})
              if t.name in cache_rows else t for t in trainer.embeddings.tables]
    embeddings = trainer.embeddings.model_copy(update={"tables": tables})
    return trainer.model_copy(update={"embeddings": embeddings})


# ------------------------------------------------------------------------------------------- local disk
def local_disk_bytes_per_rank(trainer: TrainerConfig, *, world_size: int) -> int:
    """The tier files one rank writes: each tiered table's share of rows, in records of its weight and optimizer
    state, each file rounded up to a block. 0 without tiered tables."""
    optimizer = trainer.optimizer.sparse.name
    total = 0
    for t in trainer.embeddings.tables:
        if t.tier is not None:
            size = _rows_per_rank(t, world_size) * _row_bytes(t, optimizer)
            total += -(-size // _BLOCK_BYTES) * _BLOCK_BYTES
    return total


def local_disk_bytes_per_node(trainer: TrainerConfig, *, procs_per_node: int, world_size: int) -> int:
    """What one node's local disk must hold for the job: its ranks' tier files and LOCAL_DISK_HEADROOM_BYTES; 0
    for a job without tiered tables (it asks for no local disk)."""
    tiers = local_disk_bytes_per_rank(trainer, world_size=world_size) * procs_per_node
    return tiers + LOCAL_DISK_HEADROOM_BYTES if tiers else 0
