"""`synthetic` data: Zipf ids and a planted signal, generated on the fly (docs/trainer.md#synthetic). Its trainer
half: `kembed_trainer.data.synthetic`."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field, model_validator

from kembed_contract.fields import MAX_EVAL_SAMPLES, MAX_HOTNESS, bounded_float, bounded_int
from kembed_contract.kinds.base import BYTES_PER_FLOAT, BYTES_PER_ID, DataKind

if TYPE_CHECKING:
    from kembed_contract.trainer_config import TrainerConfig

__all__ = ["EVAL_CHUNK", "KIND", "SyntheticDataConfig"]

# The generator's per-id tables for each feature: a float64 CDF, an int64 scramble, a float32 score and a
# float32 factor of 4 (kembed_trainer.data.synthetic).
_BYTES_PER_ID = 8 + 8 + 4 + 4 * 4
EVAL_CHUNK = 2048  # held-out samples per eval batch: a fixed size, so the eval set is the same at any world size


class SyntheticDataConfig(DataKind):
    """Zipf-distributed ids with a planted signal: a label a model can learn, for demos and tests."""

    kind: Literal["synthetic"] = "synthetic"
    num_dense: bounded_int(0, 4096) = Field(13, description="Dense (float) features per sample.")
    zipf_alpha: bounded_float(gt=0, le=16) = Field(1.1, description="Id frequency ~ 1 / rank**alpha.")
    min_hotness: bounded_int(1, MAX_HOTNESS) = Field(1, description="Fewest ids per feature per sample (multi-hot).")
    max_hotness: bounded_int(1, MAX_HOTNESS) = Field(1, description="Most ids per feature per sample.")
    signal: bounded_float(ge=0, le=100) = Field(
        1.0, description="Strength of the planted signal; 0 makes labels pure noise (AUC 0.5)."
    )
    num_ids: bounded_int(1, 2**28) | None = Field(
        None, description="Distinct ids of each feature whose table takes raw ids (hash_ids or dynamic), so that "
        "they can outnumber its rows; null = its table's rows.")
    eval_samples: bounded_int(1, MAX_EVAL_SAMPLES) = Field(
        8192, description="Held-out samples (a separate seed stream), generated and scored at every eval.")

    default: ClassVar[bool] = True
    endless: ClassVar[bool] = True
    docs: ClassVar[str] = "trainer.md#synthetic"

    @model_validator(mode="after")
    def _hotness_order(self) -> SyntheticDataConfig:
        if self.max_hotness < self.min_hotness:
            raise ValueError("max_hotness must be >= min_hotness")
        return self

    @property
    def eval_rows(self) -> int:
        return self.eval_samples

    def ids_per_feature(self, cfg: TrainerConfig) -> int:
        return self.max_hotness

    def memory_bytes(self, cfg: TrainerConfig, *, ids_per_feature: int) -> int:
        return sum(self.ids_of(t) * len(t.features) for t in cfg.embeddings.tables) * _BYTES_PER_ID

    def ids_of(self, table) -> int:
        """Distinct ids each feature of `table` draws from."""
        return self.num_ids if self.num_ids is not None and table.raw_ids else table.num_embeddings

    def eval_bytes(self, cfg: TrainerConfig, *, width: int, ids_per_feature: int) -> int:
        """One chunk of held-out samples' ids and their pooled vectors."""
        num_features = len(cfg.embeddings.features)
        return EVAL_CHUNK * num_features * ids_per_feature * (BYTES_PER_ID + width * BYTES_PER_FLOAT)


KIND = SyntheticDataConfig
