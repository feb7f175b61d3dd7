"""Builds the data source a config names."""

from __future__ import annotations

from kembed_contract import trainer_config as config
from kembed_trainer.data import synthetic, table, text
from kembed_trainer.storage import Guard

__all__ = ["build_data"]


def build_data(cfg: config.TrainerConfig, *, rank: int, world_size: int, guard: Guard, ratings: bool = False):
    """A source with `train_batch(step) -> Batch` and `eval_batches() -> Iterator[Batch]`; files are read
    through `guard` (the storage policy)."""
    common = dict(  # noqa: C408 - keyword arguments shared by every source
        tables=cfg.embeddings.tables,
        seed=cfg.training.seed,
        batch_size=cfg.training.batch_size,
        rank=rank,
        world_size=world_size,
    )
    match cfg.data.kind:
        case "synthetic":
            return synthetic.SyntheticData(cfg.data, ratings=ratings, **common)
        case "table":
            return table.TableData(cfg.data, guard=guard, **common)
        case "text":
            return text.TextData(cfg.data, guard=guard, **common)
    raise ValueError(f"data.kind: unsupported {cfg.data.kind!r}")
