"""`dynamic` tables' trainer half: raw ids get rows of their own as they come (`kembed_trainer.dynamic`). Its
contract half: `kembed_contract.kinds.tables.dynamic`."""

from __future__ import annotations

import torch

from kembed_contract import trainer_config as config
from kembed_trainer.tables import tiered
from kembed_trainer.tables.base import TableStorage

__all__ = ["KIND", "Dynamic"]


class Dynamic(TableStorage):
    # A dynamic table with a tier keeps its rows in the tiered kind's group (`DynamicTieredGroup`): its kernels too.
    kernel_modules = ("kembed_trainer.dynamic.group", "kembed_trainer.dynamic.index", *tiered.KIND.kernel_modules)

    def group_key(self, table: config.TableConfig) -> object:
        return table.tier is not None  # tiered dynamic tables and in-memory ones: two groups

    def group(self, tables: list[config.TableConfig], sharded: list[bool], *, device: torch.device,
              gen: torch.Generator, seed: int, table_ids: list[int], optimizer: str, rank: int, world_size: int):
        from kembed_trainer.dynamic import group  # numba only where it is used: other jobs start faster

        if tables[0].tier is not None:  # a width's tiered dynamic tables: a group of their own (`group_key`)
            return group.DynamicTieredGroup(tables, optimizer=optimizer, device=device, seed=seed,
                                            table_ids=table_ids, rank=rank, world_size=world_size)
        return group.DynamicGroup(tables, device=device, seed=seed, table_ids=table_ids, rank=rank,
                                  world_size=world_size)


KIND = Dynamic()
