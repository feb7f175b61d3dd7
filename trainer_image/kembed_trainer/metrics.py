"""Evaluation metrics and resource readings."""

from __future__ import annotations

import resource

import torch

__all__ = ["auc", "peak_memory_mb"]


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """ROC AUC by the rank-sum (Mann-Whitney) statistic, ties counted half; 0.5 when one class is absent."""
    scores, labels = scores.double().flatten(), labels.double().flatten()
    num_pos = labels.sum().item()
    num_neg = labels.numel() - num_pos
    if num_pos == 0 or num_neg == 0:
        return 0.5
    order = torch.argsort(scores)
    sorted_scores = scores[order]
    ranks = torch.empty_like(scores)
    ranks[order] = torch.arange(1, scores.numel() + 1, dtype=torch.float64)
    # Tied scores share the mean of their ranks.
    _, inverse, counts = torch.unique_consecutive(sorted_scores, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    mean_rank = ends - (counts.double() - 1) / 2
    ranks[order] = mean_rank[inverse]
    rank_sum = ranks[labels > 0.5].sum().item()
    return (rank_sum - num_pos * (num_pos + 1) / 2) / (num_pos * num_neg)


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
