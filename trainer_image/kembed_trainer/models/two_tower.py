"""Two towers (user, item) over pooled embeddings: matrix factorisation when the towers have no MLP."""

from __future__ import annotations

import torch
from torch import nn

from kembed_contract import trainer_config as config
from kembed_trainer.models.dlrm import mlp

__all__ = ["TwoTower"]


class TwoTower(nn.Module):
    def __init__(self, cfg: config.TwoTowerConfig, *, features: list[str], embedding_dim: int) -> None:
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
        (sparse,) = pooled  # [B, F, dim]; two_tower validates a single embedding width
        user = sparse[:, self.user_idx].sum(1)
        item = sparse[:, self.item_idx].sum(1)
        if not self.biases:
            zeros = user.new_zeros(user.shape[0])
            return self.user_tower(user), self.item_tower(item), zeros, zeros
        return self.user_tower(user[:, :-1]), self.item_tower(item[:, :-1]), item[:, -1], user[:, -1]
