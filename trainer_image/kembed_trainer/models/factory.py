"""Builds the dense part of the model a config names, and the task (loss and eval metrics) it trains for."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kembed_contract import trainer_config as config
from kembed_trainer import metrics
from kembed_trainer.models import dlrm, two_tower, word2vec

__all__ = ["Task", "build_dense_model", "build_task"]


@dataclasses.dataclass(frozen=True)
class Task:
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    ratings: bool  # labels are real-valued ratings, not 0/1

    def evaluate(self, scores: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        loss = self.loss(scores, labels).item()
        if self.ratings:
            return {"rmse": loss**0.5, "mae": (scores - labels).abs().mean().item(), "loss": loss}
        return {"auc": metrics.auc(scores, labels), "log_loss": loss, "loss": loss}


def build_task(cfg: config.TrainerConfig) -> Task:
    if cfg.model.kind == "two_tower" and cfg.model.loss == "mse":
        return Task(loss=F.mse_loss, ratings=True)
    return Task(loss=F.binary_cross_entropy_with_logits, ratings=False)


def build_dense_model(cfg: config.TrainerConfig) -> nn.Module:
    features = cfg.embeddings.features
    dim = cfg.embeddings.tables[0].embedding_dim
    match cfg.model.kind:
        case "dlrm":
            return dlrm.DLRM(
                cfg.model, num_dense=cfg.data.num_dense, num_sparse=len(features), embedding_dim=dim
            )
        case "two_tower":
            return two_tower.TwoTower(cfg.model, features=features, embedding_dim=dim)
        case "word2vec":
            return word2vec.SkipGram(features=features)
    raise ValueError(f"model.kind: unsupported {cfg.model.kind!r}")
