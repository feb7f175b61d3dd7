"""`tiered` tables' trainer half: rows on the rank's local disk, the hot ones cached (`kembed_trainer.tiered`).
Its contract half: `kembed_contract.kinds.tables.tiered`."""

from __future__ import annotations

import torch

from kembed_contract import trainer_config as config
from kembed_trainer.tables.base import TableStorage

__all__ = ["KIND", "Tiered"]


class Tiered(TableStorage):
    kernel_modules = ("kembed_trainer.tiered.cache", "kembed_trainer.tiered.store", "kembed_trainer.tiered.table")

    def group(self, tables: list[config.TableConfig], sharded: list[bool], *, device: torch.device,
              gen: torch.Generator, seed: int, table_ids: list[int], optimizer: str, rank: int, world_size: int):
        from kembed_trainer.tiered import table  # numba only where it is used: other jobs start faster

        return table.TieredGroup(tables, optimizer=optimizer, device=device, seed=seed, table_ids=table_ids,
                                 rank=rank, world_size=world_size)


KIND = Tiered()
