"""Models: each is a dense `nn.Module` on top of the shared `EmbeddingCollection` (sparse part)."""

from kembed_trainer.models.factory import Task, build_dense_model, build_task

__all__ = ["Task", "build_dense_model", "build_task"]
