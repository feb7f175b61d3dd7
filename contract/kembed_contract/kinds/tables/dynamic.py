"""`dynamic` tables: raw ids get rows of their own as they come, up to a capacity, with admission and eviction
(docs/trainer.md#dynamic-tables). A table is of this kind when it has a `dynamic` section
(`trainer_config.DynamicConfig`), tiered or not. Its trainer half: `kembed_trainer.tables.dynamic`."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from kembed_contract.kinds.base import TableKind
from kembed_contract.kinds.tables import plain, tiered

if TYPE_CHECKING:
    from kembed_contract.trainer_config import TableConfig, TrainerConfig

__all__ = ["DynamicTables", "KIND"]


class DynamicTables(TableKind):
    """Each rank holds its rows (capacity / ranks, with their optimizer state; of a tiered one its cache) and the
    index of the ids it owns: each row's id, use count and last use, the id -> row map, the admission's counters."""

    name: ClassVar[str] = "dynamic"
    docs: ClassVar[str] = "trainer.md#dynamic-tables"

    @classmethod
    def selects(cls, table: TableConfig) -> bool:
        return table.dynamic is not None

    @classmethod
    def memory_bytes(cls, table: TableConfig, cfg: TrainerConfig, *, world_size: int) -> float:
        assert table.dynamic is not None
        rows = (tiered.TieredTables if table.tier is not None else plain.PlainTables).memory_bytes(
            table, cfg, world_size=world_size)
        return rows + table.dynamic.index_bytes(table, world_size=world_size)


KIND = DynamicTables
