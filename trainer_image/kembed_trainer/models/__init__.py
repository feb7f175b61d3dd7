"""Models: each is a dense `nn.Module` on top of the shared `EmbeddingCollection` (sparse part)."""

from kembed_trainer.models.factory import build_dense_model

__all__ = ["build_dense_model"]
