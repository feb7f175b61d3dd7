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
              gen: torch.Generator, seed: int, table_ids: list[int], optimizer: str, rank: int,
              world_size: int) -> embedding.Group:
        return embedding.Group(tables, sharded, device=device, gen=gen, seed=seed, table_ids=table_ids,
                               rank=rank, world_size=world_size)


KIND = InMemory()
