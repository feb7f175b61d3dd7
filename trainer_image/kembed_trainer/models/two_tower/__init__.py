"""`two_tower`'s trainer half: two towers (user, item) over pooled embeddings, matrix factorisation when the
towers have no MLP; recall@k at each eval for implicit feedback. Its contract half:
`kembed_contract.kinds.models.two_tower`.

Matrix factorisation of ratings trains by default in compiled code (`sgd`, `mf_kernel`: per-rating SGD as
Surprise's SVD runs it) rather than through the batch/autograd loop, whose per-step overhead dwarfs a batch of
ratings' arithmetic; `model.step` chooses, and the contract half says which configs the kernel can train.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kembed_contract import trainer_config as config
from kembed_contract.kinds.models.two_tower import TwoTowerConfig
from kembed_trainer import dist, metrics
from kembed_trainer.models.base import CompiledStep, Evaluator, ModelTraining
from kembed_trainer.models.layers import mlp

__all__ = ["KIND", "TwoTower", "TwoTowerTraining"]


class TwoTower(nn.Module):
    def __init__(self, cfg: TwoTowerConfig, *, features: list[str], embedding_dim: int) -> None:
        super().__init__()
        self.user_idx = [features.index(f) for f in cfg.user_features]
        self.item_idx = [features.index(f) for f in cfg.item_features]
        self.biases = cfg.biases
        width = embedding_dim - 1 if cfg.biases else embedding_dim
        self.user_tower = mlp([width, *cfg.tower_mlp], last_relu=False) if cfg.tower_mlp else nn.Identity()
        self.item_tower = mlp([width, *cfg.tower_mlp], last_relu=False) if cfg.tower_mlp else nn.Identity()
        # The global bias starts at zero; for ratings the optimizer moves it to the mean within a few steps.
        self.global_bias = nn.Parameter(torch.zeros(1)) if cfg.biases else None

    def forward(self, dense: torch.Tensor, pooled: list[torch.Tensor]) -> torch.Tensor:
        user, item, item_bias, user_bias = self.encode(pooled)
        if not self.biases:
            return (user * item).sum(1)
        return (user * item).sum(1) + user_bias + item_bias + self.global_bias

    def encode(self, pooled: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """(user vectors, item vectors, item biases, user biases): score = u . v (+ both biases + the global one)."""
        (sparse,) = pooled  # [B, F, dim]; the kind's check makes every table one width
        user = sparse[:, self.user_idx].sum(1)
        item = sparse[:, self.item_idx].sum(1)
        if not self.biases:
            zeros = user.new_zeros(user.shape[0])
            return self.user_tower(user), self.item_tower(item), zeros, zeros
        return self.user_tower(user[:, :-1]), self.item_tower(item[:, :-1]), item[:, -1], user[:, -1]


class TwoTowerTraining(ModelTraining):
    kernel_modules = ("kembed_trainer.models.two_tower.mf_kernel",)

    def dense_model(self, cfg: config.TrainerConfig) -> nn.Module:
        return TwoTower(cfg.model, features=cfg.embeddings.features,
                        embedding_dim=cfg.embeddings.tables[0].embedding_dim)

    def compiled_step(self, cfg: config.TrainerConfig, *, data: Any, embeddings: Any, model: nn.Module,
                      total_steps: int, rank: int, world_size: int) -> CompiledStep | None:
        """Per-rating SGD in compiled code where `model.step` and the config allow it (tables in CPU memory)."""
        step, unfit = cfg.model.step, cfg.model.compiled_unfit(cfg)
        on_cpu = embeddings.device.type == "cpu"
        if step == "compiled" and not on_cpu:
            raise ValueError("model.step: compiled trains tables in CPU memory; use auto or autograd on a GPU")
        if step == "autograd" or unfit or not on_cpu:
            return None
        # numba only where it is used: other models start faster.
        from kembed_trainer.models.two_tower import sgd

        return sgd.RatingsSGD(cfg, data, embeddings, global_bias=model.global_bias, total_steps=total_steps,
                              world_size=world_size)

    def evaluator(self, cfg: config.TrainerConfig, *, model: nn.Module, embeddings: Any, data: Any, guard: Any,
                  device: torch.device) -> Evaluator | None:
        return _Recall(cfg, model, device) if "recall_at_k" in cfg.eval_metrics else None


class _Recall:
    """recall@k: each held-out positive's item ranked among the held-out items, from every rank's encodings."""

    def __init__(self, cfg: config.TrainerConfig, model: TwoTower, device: torch.device) -> None:
        self.model, self.k, self.device = model, cfg.evaluation.recall_k, device
        dim = cfg.embeddings.tables[0].embedding_dim
        self.width = cfg.model.tower_mlp[-1] if cfg.model.tower_mlp else dim - int(cfg.model.biases)
        self.encoded: list[tuple[torch.Tensor, ...]] = []  # (user, item, item bias) of each eval batch

    def on_batch(self, pooled: list[torch.Tensor]) -> None:
        self.encoded.append(tuple(t.float() for t in self.model.encode(pooled)[:3]))

    def finish(self, labels: torch.Tensor) -> dict[str, Any]:
        encoded, self.encoded = self.encoded, []
        empty = torch.empty(0, device=self.device)
        # Every rank gathers, with or without eval rows of its own (all_gather is collective).
        user, item = (dist.gather(torch.cat([e[j] for e in encoded]).reshape(-1) if encoded else empty)
                      .view(-1, self.width) for j in (0, 1))
        item_bias = dist.gather(torch.cat([e[2] for e in encoded]) if encoded else empty)
        return {"recall_at_k": metrics.recall_at_k(user, item, item_bias, labels, self.k)}


KIND = TwoTowerTraining()
