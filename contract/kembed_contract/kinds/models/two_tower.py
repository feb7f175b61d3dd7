"""`two_tower`: two towers or matrix factorisation, for ratings or retrieval (docs/trainer.md#two_tower). Its
trainer half: `kembed_trainer.models.two_tower`."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field

from kembed_contract import runtime
from kembed_contract.fields import MAX_LR, Features, Layers
from kembed_contract.kinds.base import BYTES_PER_FLOAT, CLICKS, CLICKS_DEFAULTS, RATINGS, ModelKind

if TYPE_CHECKING:
    from kembed_contract.trainer_config import TrainerConfig

__all__ = ["FUNK_SVD_REG", "FUNK_SVD_STEP", "KIND", "TwoTowerConfig"]

FUNK_SVD_STEP, FUNK_SVD_REG = 0.005, 0.02
"""Funk SVD's SGD step and L2 weight per rating (Surprise's SVD defaults), which ratings' defaults carry into
batches: the loss is the batch's mean, so each row's gradient is divided by batch_size and these are multiplied
(lr) and divided (weight decay) by it."""


def _ratings_lr(cfg: TrainerConfig) -> float:
    return float(min(FUNK_SVD_STEP * cfg.training.batch_size, MAX_LR))


def _ratings_weight_decay(cfg: TrainerConfig) -> float:
    return FUNK_SVD_REG / cfg.training.batch_size


class TwoTowerConfig(ModelKind):
    """Two-tower / matrix factorisation: score = dot(user tower, item tower) (+ biases).

    With `tower_mlp: []` each tower is the sum of its pooled features (plain matrix factorisation). With
    `biases`, the last coordinate of each pooled vector is a per-id bias instead of a factor, and a global bias
    is learned: score = mu + b_user + b_item + dot(p_user, q_item).
    """

    kind: Literal["two_tower"] = "two_tower"
    user_features: Features
    item_features: Features
    tower_mlp: Layers = Field([], description="Hidden sizes of each tower's MLP; [] = none (MF).")
    biases: bool = True
    loss: Literal["mse", "bce"] = Field(
        "mse", description="mse: explicit ratings (eval RMSE); bce: implicit 0/1 feedback (eval AUC)."
    )
    step: Literal["auto", "compiled", "autograd"] = Field(
        "auto",
        description="How a step trains. compiled: per-rating SGD in compiled code on the tables in place, as "
        "Surprise's SVD (plain matrix factorisation with mse, sgd, in-memory tables; refused otherwise); "
        "autograd: batches through autograd and the optimizers (any two_tower model); auto: compiled where it "
        "can train the config on CPU tables, else autograd.",
    )

    docs: ClassVar[str] = "trainer.md#two_tower"
    defaults_by_task: ClassVar = {
        # Funk SVD as Surprise's SVD runs it (100 factors, 20 epochs, step 0.005, reg 0.02): per-row SGD, 100
        # factors plus the bias coordinate, and a dense lr at which the global bias nears the mean rating within
        # about an epoch.
        RATINGS: {
            "training.batch_size": 256,
            "training.epochs": 20,
            "embeddings.tables.embedding_dim": 101,
            "embeddings.tables.weight_decay": _ratings_weight_decay,
            "optimizer.sparse.name": "sgd",
            "optimizer.sparse.lr": _ratings_lr,
            "optimizer.dense.lr": 0.01,
        },
        CLICKS: CLICKS_DEFAULTS,
    }

    def compiled_unfit(self, cfg: TrainerConfig) -> str | None:
        """Why the compiled step cannot train `cfg` (None: it can). It implements one model and one optimizer
        exactly: the dot product of summed rows (and their biases) under squared error, moved by plain SGD with
        weight decay, on tables held whole in every rank's memory."""
        if self.tower_mlp:
            return "the towers have an MLP"
        if self.loss != "mse":
            return f"loss {self.loss!r} (it trains mse)"
        if cfg.optimizer.sparse.name != "sgd":
            return f"optimizer.sparse.name {cfg.optimizer.sparse.name!r} (it runs sgd)"
        if cfg.sparsity is not None:
            return "sparsity masks the dense weights"
        for t in cfg.embeddings.tables:
            if cfg.embeddings.is_sharded(t) or t.admit_after:
                return f"table {t.name!r} is sharded, tiered, dynamic or admits ids late"
        return None

    @property
    def task(self) -> str:
        """Ratings with mse (real-valued labels), clicks with bce (implicit 0/1 feedback)."""
        return RATINGS if self.loss == "mse" else CLICKS

    @property
    def bias_column(self) -> bool:
        return self.biases

    def check(self, cfg: TrainerConfig) -> None:
        towers = self.user_features + self.item_features
        features = set(cfg.embeddings.features)
        if set(towers) != set(features) or len(towers) != len(features):
            raise ValueError("two_tower: user_features + item_features must name each table feature once")
        if len({t.embedding_dim for t in cfg.embeddings.tables}) != 1:
            raise ValueError("two_tower: all tables need the same embedding_dim")
        if self.step == "compiled" and (unfit := self.compiled_unfit(cfg)):
            raise ValueError(f"model.step: compiled cannot train this config: {unfit}; use auto or autograd")

    def eval_metrics(self, cfg: TrainerConfig) -> frozenset[str]:
        """Clicks add recall@k: each held-out positive's item ranked among the held-out items."""
        metrics = super().eval_metrics(cfg)
        return metrics if self.task == RATINGS else metrics | {"recall_at_k"}

    def dense_layers(self, cfg: TrainerConfig) -> list[int]:
        if not self.tower_mlp:
            return []
        tower = [min(t.embedding_dim for t in cfg.embeddings.tables), *self.tower_mlp]
        return tower + tower

    def eval_bytes(self, cfg: TrainerConfig, *, width: int, eval_rows: int | None) -> int:
        """Recall@k scores one chunk of positives x items at a time (runtime.EVAL_SCORE_CHUNK_BYTES, with its
        comparison's booleans), over every held-out row's user and item encodings and item bias, gathered on
        every rank (with the padded copies all_gather makes), and the distinct items taken from them."""
        if "recall_at_k" not in cfg.eval_metrics:
            return 0
        total = runtime.EVAL_SCORE_CHUNK_BYTES + runtime.EVAL_SCORE_CHUNK_BYTES // BYTES_PER_FLOAT
        if eval_rows is not None:
            total += eval_rows * (2 * width + 1) * BYTES_PER_FLOAT * 2 + eval_rows * (width + 1) * BYTES_PER_FLOAT * 2
        return total


KIND = TwoTowerConfig
