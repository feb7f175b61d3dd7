"""Row-sparse optimizers for embedding tables: only the rows a batch touched (and their state) move.

Each optimizer updates `weight[rows]` in place from `grad` (one row of gradient per entry of `rows`, rows
unique), with a per-row learning rate so tables can scale theirs. The state is plain tensors with one entry
per table row, so it is checkpointed, and sharded, exactly like the weights.

State rows are read with `index_select` and written back with `index_copy_` (rows are unique, so a plain
copy is right), and weights move by `index_add_`: on CPU these copy or add whole rows, where `t[rows]` and
`t[rows] = x` go element by element and took several times longer on the benchmark's 50k-row updates.
"""

from __future__ import annotations

import torch

from kembed_contract import trainer_config as config
from kembed_trainer import hugepages

__all__ = ["SparseOptimizer", "build_sparse_optimizer", "learning_rate"]


class SparseOptimizer:
    """Base: `state_shapes` says which per-row state tensors an optimizer keeps."""

    def __init__(self, cfg: config.SparseOptimizerConfig) -> None:
        self.cfg = cfg

    def init_state(self, num_rows: int, dim: int, device: torch.device) -> dict[str, torch.Tensor]:
        return {}

    def update(
        self,
        weight: torch.Tensor,
        state: dict[str, torch.Tensor],
        rows: torch.Tensor,
        grad: torch.Tensor,
        lr: torch.Tensor,
        step: int,
    ) -> None:
        raise NotImplementedError


class SGD(SparseOptimizer):
    def update(self, weight, state, rows, grad, lr, step):
        _add_rows(weight, rows, grad * -lr[:, None])


class Adagrad(SparseOptimizer):
    def init_state(self, num_rows, dim, device):
        return {"sum_sq": hugepages.zeros(num_rows, dim, device=device)}

    def update(self, weight, state, rows, grad, lr, step):
        sum_sq = state["sum_sq"].index_select(0, rows).add_(grad * grad)
        state["sum_sq"].index_copy_(0, rows, sum_sq)
        _add_rows(weight, rows, -lr[:, None] * grad / (sum_sq.sqrt() + self.cfg.eps))


class RowwiseAdagrad(SparseOptimizer):
    """Adagrad with one accumulator per row (mean of squared gradients): 1/dim of Adagrad's memory."""

    def init_state(self, num_rows, dim, device):
        return {"sum_sq": hugepages.zeros(num_rows, device=device)}

    def update(self, weight, state, rows, grad, lr, step):
        sum_sq = state["sum_sq"].index_select(0, rows).add_(grad.pow(2).mean(1))
        state["sum_sq"].index_copy_(0, rows, sum_sq)
        _add_rows(weight, rows, grad * (-lr / (sum_sq.sqrt() + self.cfg.eps))[:, None])


class LazyAdam(SparseOptimizer):
    """Adam whose moments move only for touched rows (as torch.optim.SparseAdam); bias correction by step."""

    def init_state(self, num_rows, dim, device):
        return {
            "exp_avg": hugepages.zeros(num_rows, dim, device=device),
            "exp_avg_sq": hugepages.zeros(num_rows, dim, device=device),
        }

    def update(self, weight, state, rows, grad, lr, step):
        b1, b2 = self.cfg.beta1, self.cfg.beta2
        t = step + 1
        m = state["exp_avg"].index_select(0, rows).mul_(b1).add_(grad, alpha=1 - b1)
        v = state["exp_avg_sq"].index_select(0, rows).mul_(b2).addcmul_(grad, grad, value=1 - b2)
        state["exp_avg"].index_copy_(0, rows, m)
        state["exp_avg_sq"].index_copy_(0, rows, v)
        step_size = lr * ((1 - b2**t) ** 0.5 / (1 - b1**t))
        _add_rows(weight, rows, -step_size[:, None] * m / (v.sqrt() + self.cfg.eps))


def _add_rows(weight: torch.Tensor, rows: torch.Tensor, change: torch.Tensor) -> None:
    """`weight[rows] += change` for unique rows, without reading them out first.

    Callers negate the (small, per-row) learning rate rather than pass `alpha=-1`, which took index_add_
    off its fast path; negation is exact, so this is bit for bit `weight[rows] -= lr * ...`.
    """
    weight.index_add_(0, rows, change)


def learning_rate(cfg: config.SparseOptimizerConfig, step: float, total_steps: int) -> float:
    """The rate at `step`: `lr`, or with `min_lr` falling linearly to it at the last step (gensim's alpha
    to min_alpha)."""
    if cfg.min_lr is None:
        return cfg.lr
    return cfg.lr - (cfg.lr - cfg.min_lr) * min(step / max(total_steps, 1), 1.0)


_OPTIMIZERS = {"sgd": SGD, "adagrad": Adagrad, "rowwise_adagrad": RowwiseAdagrad, "adam": LazyAdam}


def build_sparse_optimizer(cfg: config.SparseOptimizerConfig) -> SparseOptimizer:
    return _OPTIMIZERS[cfg.name](cfg)
