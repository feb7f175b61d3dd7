"""Back-of-the-envelope sizes of a job, shown at submission and used to refuse jobs that cannot fit.

One estimate, one place: the answer's `estimates`, the check at submission against `resources.memory_per_node`
and the local backend's check against this machine all read `memory_per_rank`. It counts what grows with the
config (tables, optimizer state, dense model, a step's batch, an eval's gathered scores, what the data source
keeps: never the data's own size, as it is streamed), not the interpreter and libraries every rank also loads
(`_BASELINE_BYTES`). What depends on a kind is the kind's to say (kembed_contract.kinds): its tables' bytes, its
model's layers and what its evaluation holds, its data's ids per sample and what the source keeps.
"""

from __future__ import annotations

from dataclasses import dataclass

from kembed_contract import kinds
from kembed_contract.kinds.base import BYTES_PER_FLOAT, BYTES_PER_ID
from kembed_contract.trainer_config import TrainerConfig

__all__ = ["MemoryEstimate", "memory_per_rank", "table_memory_bytes_per_rank"]

# Dense parameters are held as weights, gradients and Adam's two moments: 4 floats each.
_FLOATS_PER_DENSE_PARAMETER = 4
# A step holds each activation about three times: the forward value kept for the backward, its gradient, and a
# temporary of the kernels.
_ACTIVATION_COPIES = 3
_BASELINE_BYTES = 256 * 2**20  # Python, torch and the trainer's code in each rank (about 250 MiB measured)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank needs, by what needs them."""

    tables: int  # embedding weights and sparse-optimizer state
    dense: int  # the dense model with its gradients and optimizer state
    batch: int  # one training step's ids, pooled embeddings and activations
    eval: int  # an eval's scores and labels, gathered on every rank, and one eval batch
    data: int  # what the data source keeps (its kind says)
    baseline: int = _BASELINE_BYTES

    @property
    def total(self) -> int:
        return self.tables + self.dense + self.batch + self.eval + self.data + self.baseline

    def describe(self) -> str:
        parts = ", ".join(f"{name} {_gib(getattr(self, name))}"
                          for name in ("tables", "dense", "batch", "eval", "data", "baseline"))
        return f"{_gib(self.total)} per rank ({parts})"


def _gib(num_bytes: float) -> str:
    """`1.50 GiB`, `12.0 MiB`, `180 KiB`: the unit that reads best."""
    if num_bytes >= 2**30:
        return f"{num_bytes / 2**30:.2f} GiB"
    if num_bytes >= 2**20:
        return f"{num_bytes / 2**20:.1f} MiB"
    return f"{num_bytes / 2**10:.0f} KiB"


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
