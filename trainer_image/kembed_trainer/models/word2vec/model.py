"""Skip-gram with negative sampling: the logit of a (center, context) pair is the dot of their vectors."""

from __future__ import annotations

import torch
from torch import nn

from kembed_contract.kinds.models.word2vec import CENTER, CONTEXT

__all__ = ["SkipGram"]


class SkipGram(nn.Module):
    """No dense parameters: all learning happens in the `center` (input) and `context` (output) tables."""

    def __init__(self, *, features: list[str]) -> None:
        super().__init__()
        self.center_idx = features.index(CENTER)
        self.context_idx = features.index(CONTEXT)

    def forward(self, dense: torch.Tensor, pooled: list[torch.Tensor]) -> torch.Tensor:
        (sparse,) = pooled
        return (sparse[:, self.center_idx] * sparse[:, self.context_idx]).sum(1)
