"""What the training loop asks of a model kind: its trainer half's interface, and the task (loss and metrics).

A kind's trainer half is `kembed_trainer.models.<kind>` (a module, or a package for a kind with several),
ending in `KIND = <its ModelTraining>`; `kembed_trainer.kinds` finds it by the name the contract registers.
Every hook below has the plain answer; a kind overrides what differs (docs/architecture.md, "Adding a kind").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import IO, TYPE_CHECKING, Any, ClassVar, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kembed_contract import trainer_config as config
from kembed_trainer import metrics

if TYPE_CHECKING:
    from kembed_trainer.embedding import EmbeddingCollection
    from kembed_trainer.export import TableRows
    from kembed_trainer.storage import Guard

__all__ = ["CompiledStep", "Evaluator", "ModelTraining", "Task", "Writer", "build_task"]

Writer = Callable[["TableRows", IO[bytes]], None]
"""An export format's writer: one table's rows to a binary stream."""


@dataclasses.dataclass(frozen=True)
class Task:
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    ratings: bool  # labels are real-valued ratings, not 0/1

    def evaluate(self, scores: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        loss = self.loss(scores, labels).item()
        if self.ratings:
            return {"rmse": loss**0.5, "mae": (scores - labels).abs().mean().item(), "loss": loss}
        return {"auc": metrics.auc(scores, labels), "log_loss": loss, "loss": loss}


def build_task(cfg: config.TrainerConfig) -> Task:
    """Ratings: mean squared error; anything else: 0/1 labels and binary cross-entropy on the logits."""
    if cfg.ratings:
        return Task(loss=F.mse_loss, ratings=True)
    return Task(loss=F.binary_cross_entropy_with_logits, ratings=False)


class Evaluator(Protocol):
    """A kind's own metrics at each eval, beside its task's: fed every eval batch's pooled embeddings (under the
    step's autocast), then asked once for its metrics with every rank's labels gathered."""

    def on_batch(self, pooled: list[torch.Tensor]) -> None: ...

    def finish(self, labels: torch.Tensor) -> dict[str, Any]: ...


class CompiledStep(Protocol):
    """A kind that trains outside the batch/autograd loop: one step, its mean loss."""

    total_steps: int
    """Where its learning rate schedule ends: set again when streamed data's resume moves the end."""

    def step(self, step: int) -> torch.Tensor: ...

    def close(self) -> None: ...


class ModelTraining:
    """The trainer half of a model kind."""

    writers: ClassVar[Mapping[str, Writer]] = {}
    """A writer for each export format the kind adds (its contract half's `export_formats`)."""

    kernel_modules: ClassVar[tuple[str, ...]] = ()
    """Modules of the kind's numba kernels compiled with `cache=True`, each with a `warm()` that compiles them for
    the argument types training passes: the platform compiles them once for every job (kembed_trainer.kernel_cache)."""

    def dense_model(self, cfg: config.TrainerConfig) -> nn.Module:
        """The dense part: `forward(dense [B, num_dense], pooled: one [B, features, dim] per width) -> [B]`
        scores, on top of the shared `EmbeddingCollection` (the sparse part)."""
        raise NotImplementedError

    def task(self, cfg: config.TrainerConfig) -> Task:
        return build_task(cfg)

    def compiled_step(self, cfg: config.TrainerConfig, *, data: Any, embeddings: EmbeddingCollection,
                      model: nn.Module, total_steps: int, rank: int, world_size: int) -> CompiledStep | None:
        """A step of its own instead of the batch/autograd loop's (no dense optimizer, no sparse one); `model`
        is the dense model, unwrapped, whose parameters the step may move in place (they are checkpointed)."""
        return None

    def evaluator(self, cfg: config.TrainerConfig, *, model: nn.Module, embeddings: EmbeddingCollection,
                  data: Any, guard: Guard, device: torch.device) -> Evaluator | None:
        """Metrics of its own at each eval (`model` unwrapped, so its own methods can be called)."""
        return None
