"""`tiered` tables: every row and its sparse-optimizer state on the node's local disk, the hot rows cached in memory
(docs/trainer.md#tiered-tables, docs/tiered-tables.md). A table is of this kind when it has a `tier` section
(`trainer_config.TierConfig`). Its trainer half: `kembed_trainer.tables.tiered`."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from kembed_contract.kinds.base import TableKind

if TYPE_CHECKING:
    from kembed_contract.trainer_config import TableConfig, TrainerConfig

__all__ = ["KIND", "TieredTables"]


class TieredTables(TableKind):
    """Each rank holds its cache of the table's rows (with their optimizer state) and 7 bytes of bookkeeping per
    row of its share; the rows themselves are on its local disk."""

    name: ClassVar[str] = "tiered"
    docs: ClassVar[str] = "trainer.md#tiered-tables"

    @classmethod
    def selects(cls, table: TableConfig) -> bool:
        return table.tier is not None

    @classmethod
    def memory_bytes(cls, table: TableConfig, cfg: TrainerConfig, *, world_size: int) -> float:
        assert table.tier is not None
        return table.tier.memory_bytes(table, cfg.optimizer.sparse.name, world_size=world_size)


KIND = TieredTables
