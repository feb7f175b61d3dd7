"""DLRM (Naumov et al., 2019): bottom MLP over dense features, pairwise dot interaction, top MLP."""

from __future__ import annotations

import itertools

import torch
from torch import nn

from kembed_trainer import config

__all__ = ["DLRM"]


def mlp(sizes: list[int], *, last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(n_in, n_out))
        if last_relu or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """The dense part; the pooled embeddings come from the `EmbeddingCollection`."""

    def __init__(
        self, cfg: config.DLRMConfig, *, num_dense: int, num_sparse: int, embedding_dim: int
    ) -> None:
        super().__init__()
        self.bottom = mlp([num_dense, *cfg.bottom_mlp], last_relu=True) if num_dense > 0 else None
        num_vectors = num_sparse + (1 if num_dense > 0 else 0)
        num_pairs = num_vectors * (num_vectors - 1) // 2
        top_in = num_pairs + (embedding_dim if num_dense > 0 else 0)
        self.top = mlp([top_in, *cfg.top_mlp, 1], last_relu=False)
        rows, cols = torch.tril_indices(num_vectors, num_vectors, offset=-1)
        self.register_buffer("pair_rows", rows, persistent=False)
        self.register_buffer("pair_cols", cols, persistent=False)

    def forward(self, dense: torch.Tensor, pooled: list[torch.Tensor]) -> torch.Tensor:
        """Logits [B] from dense features [B, num_dense] and pooled embeddings [B, num_sparse, dim]."""
        (sparse,) = pooled  # dlrm validates a single embedding width
        vectors, first = [sparse], []
        if self.bottom is not None:
            x = self.bottom(dense)
            vectors.insert(0, x.unsqueeze(1))
            first = [x]
        z = torch.cat(vectors, 1)
        dots = torch.bmm(z, z.transpose(1, 2))[:, self.pair_rows, self.pair_cols]
        return self.top(torch.cat([*first, dots], 1)).squeeze(1)
