"""The one batch layout every data source produces and every model consumes."""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["Batch"]


@dataclasses.dataclass
class Batch:
    """Sparse ids in a jagged, feature-major layout (as TorchRec's KeyedJaggedTensor).

    `values` holds the ids of feature 0 for samples 0..B-1, then feature 1, ...; `lengths[f * B + b]` is how
    many ids sample b has for feature f (multi-hot). Ids are raw, per feature, in `[0, num_embeddings)`.
    """

    dense: torch.Tensor  # [B, num_dense] float32
    values: torch.Tensor  # [sum(lengths)] int64
    lengths: torch.Tensor  # [num_features * B] int64
    labels: torch.Tensor  # [B] float32

    @property
    def batch_size(self) -> int:
        return self.labels.shape[0]

    def to(self, device: torch.device) -> Batch:
        return Batch(*(t.to(device, non_blocking=True) for t in dataclasses.astuple(self)))
