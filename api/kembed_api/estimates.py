"""Back-of-the-envelope sizes of a job, shown at submission and used to refuse jobs that cannot fit."""

from __future__ import annotations

from kembed_trainer.config import TrainerConfig

__all__ = ["table_memory_bytes_per_rank"]

_BYTES_PER_FLOAT = 4
# Optimizer state per embedding element, in floats: adagrad keeps one accumulator per element, row-wise adagrad
# one per row, adam two moments per element.
_STATE_PER_ELEMENT = {"sgd": lambda dim: 0.0, "adagrad": lambda dim: 1.0, "rowwise_adagrad": lambda dim: 1.0 / dim,
                      "adam": lambda dim: 2.0}


def table_memory_bytes_per_rank(trainer: TrainerConfig) -> int:
    """Weights plus sparse-optimizer state of all tables, as if every rank held every table (an upper bound)."""
    state = _STATE_PER_ELEMENT[trainer.optimizer.sparse.name]
    total = 0.0
    for table in trainer.embeddings.tables:
        elements = table.num_embeddings * table.embedding_dim
        total += elements * (1.0 + state(table.embedding_dim)) * _BYTES_PER_FLOAT
    return int(total)
