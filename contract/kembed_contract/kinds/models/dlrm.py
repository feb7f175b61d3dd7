"""`dlrm`: a DLRM-style CTR model (docs/trainer.md#dlrm). Its trainer half: `kembed_trainer.models.dlrm`."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field

from kembed_contract.fields import Layers
from kembed_contract.kinds.base import ModelKind

if TYPE_CHECKING:
    from kembed_contract.trainer_config import TrainerConfig

__all__ = ["KIND", "DLRMConfig"]


class DLRMConfig(ModelKind):
    """DLRM-style CTR model: bottom MLP over dense features, dot interaction with the pooled embeddings, top MLP."""

    kind: Literal["dlrm"] = "dlrm"
    bottom_mlp: Layers = Field(
        [64, 16], min_length=1, description="Hidden sizes; the last must equal the tables' embedding_dim."
    )
    top_mlp: Layers = Field(
        [64, 32], description="Hidden sizes before the final 1-unit logit layer (added automatically)."
    )

    default: ClassVar[bool] = True
    docs: ClassVar[str] = "trainer.md#dlrm"

    def check(self, cfg: TrainerConfig) -> None:
        dims = {t.embedding_dim for t in cfg.embeddings.tables}
        if len(dims) != 1:
            raise ValueError(f"dlrm: all tables need the same embedding_dim, got {sorted(dims)}")
        (dim,) = dims
        if cfg.data.num_dense > 0 and self.bottom_mlp[-1] != dim:
            raise ValueError(f"dlrm: bottom_mlp must end in the embedding_dim ({dim})")

    def dense_layers(self, cfg: TrainerConfig) -> list[int]:
        """The bottom MLP (with dense features), then the top MLP over the pairwise dots."""
        num_dense = cfg.data.num_dense
        dim = min(t.embedding_dim for t in cfg.embeddings.tables)
        vectors = len(cfg.embeddings.features) + (1 if num_dense else 0)
        top_in = vectors * (vectors - 1) // 2 + (dim if num_dense else 0)
        bottom = [num_dense, *self.bottom_mlp] if num_dense else []
        return [*bottom, top_in, *self.top_mlp, 1]


KIND = DLRMConfig
