"""The best evaluation so far by one metric: which step had it, and how many evals since brought nothing better.

Its state is checkpointed (tensors, so DCP saves and loads it like the rest), so a resumed run keeps its best
checkpoint and its patience count.
"""

from __future__ import annotations

import math

import torch

__all__ = ["Best"]


class Best:
    def __init__(self, metric: str, *, higher_is_better: bool, patience: int, metrics: list[str]) -> None:
        self.metric, self.higher, self.patience = metric, higher_is_better, patience
        self.metrics = sorted(metrics)  # the numbers kept of the best eval, in a fixed order
        self.step = torch.tensor(-1)
        self.bad_evals = torch.tensor(0)
        self.values = torch.full((len(self.metrics),), math.nan, dtype=torch.float64)

    def update(self, step: int, result: dict[str, float]) -> bool:
        """Record one eval; whether it is the new best."""
        value = result[self.metric]
        best = self.values[self.metrics.index(self.metric)].item()
        improved = math.isnan(best) or (value > best if self.higher else value < best)
        if improved:
            self.step.fill_(step)
            self.bad_evals.zero_()
            self.values.copy_(torch.tensor([float(result[m]) for m in self.metrics], dtype=torch.float64))
        else:
            self.bad_evals += 1
        return improved

    @property
    def should_stop(self) -> bool:
        return self.patience > 0 and int(self.bad_evals) >= self.patience

    @property
    def best_step(self) -> int | None:
        return int(self.step) if int(self.step) >= 0 else None

    def result(self) -> dict[str, float]:
        """The best eval's metrics (numbers only)."""
        return {m: float(v) for m, v in zip(self.metrics, self.values.tolist(), strict=True)}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"step": self.step, "bad_evals": self.bad_evals, "values": self.values}
