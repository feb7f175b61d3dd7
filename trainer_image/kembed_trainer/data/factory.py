"""Builds the data source a config names."""

from __future__ import annotations

from kembed_trainer import config
from kembed_trainer.data import synthetic

__all__ = ["build_data"]


def build_data(cfg: config.TrainerConfig, *, rank: int, world_size: int) -> synthetic.SyntheticData:
    if cfg.data.kind == "synthetic":
        return synthetic.SyntheticData(
            cfg.data,
            tables=cfg.embeddings.tables,
            seed=cfg.training.seed,
            batch_size=cfg.training.batch_size,
            rank=rank,
            world_size=world_size,
        )
    raise ValueError(f"data.kind: unsupported {cfg.data.kind!r}")
