"""Builds the dense part of the model a config names, and its loss."""

from __future__ import annotations

from torch import nn

from kembed_trainer import config
from kembed_trainer.models import dlrm

__all__ = ["build_dense_model"]


def build_dense_model(cfg: config.TrainerConfig) -> nn.Module:
    if cfg.model.kind == "dlrm":
        return dlrm.DLRM(
            cfg.model,
            num_dense=cfg.data.num_dense,
            num_sparse=len(cfg.embeddings.features),
            embedding_dim=cfg.embeddings.tables[0].embedding_dim,
        )
    raise ValueError(f"model.kind: unsupported {cfg.model.kind!r}")
