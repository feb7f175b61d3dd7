"""Back-of-the-envelope sizes of a job, shown at submission and used to refuse jobs that cannot fit."""

from __future__ import annotations

from kembed_trainer.config import TrainerConfig

__all__ = ["table_memory_bytes_per_rank"]

_BYTES_PER_FLOAT = 4
# Optimizer state per embedding element, in floats: adagrad keeps one accumulator per element, row-wise adagrad
# one per row, adam two moments per element.
_STATE_PER_ELEMENT = {"sgd": lambda dim: 0.0, "adagrad": lambda dim: 1.0, "rowwise_adagrad": lambda dim: 1.0 / dim,
                      "adam": lambda dim: 2.0}


def table_memory_bytes_per_rank(trainer: TrainerConfig, *, world_size: int = 1) -> int:
    """Weights plus sparse-optimizer state one rank holds: replicated tables whole, row-wise sharded ones
    1/world_size of their rows (rounded up, as the trainer splits them)."""
    state = _STATE_PER_ELEMENT[trainer.optimizer.sparse.name]
    total = 0.0
    for table in trainer.embeddings.tables:
        rows = table.num_embeddings
        if trainer.embeddings.is_sharded(table):
            rows = -(-rows // world_size)
        total += rows * table.embedding_dim * (1.0 + state(table.embedding_dim)) * _BYTES_PER_FLOAT
    return int(total)
