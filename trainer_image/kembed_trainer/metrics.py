"""Evaluation metrics and resource readings."""

from __future__ import annotations

import resource

import torch

from kembed_contract import runtime

__all__ = ["auc", "peak_memory_mb", "recall_at_k", "rows_per_chunk"]


def rows_per_chunk(num_columns: int, *, chunk_bytes: int = runtime.EVAL_SCORE_CHUNK_BYTES) -> int:
    """Rows of float32 scores over `num_columns` candidates that fit in one chunk (at least one)."""
    return max(1, chunk_bytes // (4 * max(1, num_columns)))


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


def recall_at_k(user: torch.Tensor, item: torch.Tensor, item_bias: torch.Tensor, labels: torch.Tensor,
                k: int, *, chunk_bytes: int = runtime.EVAL_SCORE_CHUNK_BYTES) -> float:
    """Retrieval recall@k over held-out pairs: each positive pair's item ranked among all distinct held-out items
    by the model's score for that user; the share ranked in the top k (ties counted in the item's favour).

    Positives are scored a chunk at a time (`chunk_bytes` of scores), each against every candidate, so memory
    stays one chunk whatever the number of items; a positive's rank needs only its own row."""
    candidates, which = torch.unique(torch.cat([item, item_bias[:, None]], 1), dim=0, return_inverse=True)
    positive = labels > 0.5
    if not positive.any() or not item.numel():
        return 0.0
    users, targets = user[positive], which[positive]
    vectors, biases = candidates[:, :-1].T, candidates[:, -1]
    hits, rows = 0, rows_per_chunk(len(candidates), chunk_bytes=chunk_bytes)
    for first in range(0, len(users), rows):
        scores = users[first:first + rows] @ vectors + biases
        true = scores.gather(1, targets[first:first + rows, None])
        hits += int(((scores > true).sum(1) < k).sum())
    return hits / len(users)


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
