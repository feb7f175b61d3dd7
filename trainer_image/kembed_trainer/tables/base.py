"""What `EmbeddingCollection` asks of a table kind: a group holding the tables of one width and kind.

A kind's trainer half is `kembed_trainer.tables.<kind>`, ending in `KIND = <its TableStorage>`. Its group is
looked up, updated and checkpointed by `embedding.EmbeddingCollection` through the interface of
`embedding.Group` (the plain kind's): `weight` and `shard` with their optimizer state, `rows_of`, `admit`,
`storage_rows`, `gather`, the change flags deltas read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from kembed_contract import trainer_config as config

if TYPE_CHECKING:
    from kembed_trainer.embedding import Group

__all__ = ["TableStorage"]


class TableStorage:
    kernel_modules: ClassVar[tuple[str, ...]] = ()
    """Modules of the kind's numba kernels compiled with `cache=True`, each with a `warm()` that compiles them for
    the argument types training passes, as a model kind's (`models.base.ModelTraining.kernel_modules`): the
    platform compiles them once for every job (kembed_trainer.kernel_cache)."""

    def group_key(self, table: config.TableConfig) -> object:
        """What, besides its kind and width, puts a table in a group of its own (tables of one kind that are
        held two ways)."""
        return None

    def group(self, tables: list[config.TableConfig], sharded: list[bool], *, device: torch.device,
              gen: torch.Generator, seed: int, table_ids: list[int], optimizer: str, rank: int,
              world_size: int) -> Group:
        """The group of `tables` (one width, this kind; `sharded[i]`: table i is split row-wise across ranks).
        `gen` draws replicated tables' initial rows in table order; `seed` and `table_ids` (each table's index
        over all tables) seed sharded ones, so they start the same at any world size and in any group.
        `optimizer`: the sparse optimizer's name (what state a row carries)."""
        raise NotImplementedError
