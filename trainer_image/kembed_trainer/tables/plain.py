"""`plain` tables' trainer half: every row and its optimizer state in memory, replicated on every rank or sharded
row-wise (`embedding.Group`). Its contract half: `kembed_contract.kinds.tables.plain`."""

from __future__ import annotations

import torch

from kembed_contract import trainer_config as config
from kembed_trainer import embedding
from kembed_trainer.tables.base import TableStorage

__all__ = ["KIND", "InMemory"]


class InMemory(TableStorage):
    def group(self, tables: list[config.TableConfig], sharded: list[bool], *, device: torch.device,
              gen: torch.Generator, seed: int, first_table: int, rank: int, world_size: int) -> embedding.Group:
        return embedding.Group(tables, sharded, device=device, gen=gen, seed=seed, first_table=first_table,
                               rank=rank, world_size=world_size)


KIND = InMemory()
