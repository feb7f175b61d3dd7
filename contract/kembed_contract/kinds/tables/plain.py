"""`plain` tables: every row and its sparse-optimizer state in memory, replicated on every rank or sharded
row-wise across them (docs/trainer.md#plain). Its trainer half: `kembed_trainer.tables.plain`."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from kembed_contract import runtime
from kembed_contract.kinds.base import BYTES_PER_FLOAT, TableKind

if TYPE_CHECKING:
    from kembed_contract.trainer_config import TableConfig, TrainerConfig

__all__ = ["KIND", "PlainTables"]


class PlainTables(TableKind):
    """Tables held whole in memory: a replicated one on every rank, a row-wise sharded one 1/world_size of its
    rows (rounded up, as the trainer splits them) on each."""

    name: ClassVar[str] = "plain"
    default: ClassVar[bool] = True
    docs: ClassVar[str] = "trainer.md#plain"

    @classmethod
    def memory_bytes(cls, table: TableConfig, cfg: TrainerConfig, *, world_size: int) -> float:
        state = runtime.OPTIMIZER_STATE_FLOATS[cfg.optimizer.sparse.name]
        rows = table.num_embeddings
        if cfg.embeddings.is_sharded(table):
            rows = -(-rows // world_size)
        return rows * table.embedding_dim * (1.0 + state(table.embedding_dim)) * BYTES_PER_FLOAT


KIND = PlainTables
