"""`table` data: rows of Parquet, CSV or TSV files, streamed (docs/trainer.md#table). Its trainer half:
`kembed_trainer.data.table`."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field

from kembed_contract.fields import MAX_FEATURES, Fraction, Name, OptionalReadUri, ReadUri, bounded_int
from kembed_contract.kinds.base import BYTES_PER_FLOAT, BYTES_PER_ID, STREAM_WINDOWS, DataKind

if TYPE_CHECKING:
    from kembed_contract.trainer_config import TrainerConfig

__all__ = ["KIND", "TableDataConfig"]

# The reader holds shuffle windows: one being read, one queued, one being trained on (kembed_trainer.data.table).


class TableDataConfig(DataKind):
    """Rows of Parquet, CSV or TSV files (`file://`, `s3://` or a path; a glob or a folder reads every file).

    Each sparse feature is read from a column: integer ids, or any value when its table has `hash_ids`.
    A multi-hot column holds a list (Parquet) or a `multi_hot_separator`-joined string (CSV/TSV).
    """

    kind: Literal["table"] = "table"
    uri: ReadUri = Field(description="Training rows.")
    format: Literal["auto", "parquet", "csv", "tsv"] = Field("auto", description="auto = from the extension.")
    label: Name = Field(description="Label column: 0/1 clicks, or ratings.")
    dense: list[Name] = Field([], max_length=4096, description="Float feature columns, in the model's order.")
    sparse: dict[Name, Name] = Field(max_length=MAX_FEATURES, description="Sparse feature name -> column.")
    multi_hot_separator: str = Field("|", min_length=1, max_length=8)
    eval_uri: OptionalReadUri = Field(None, description="Held-out rows; without it `eval_fraction` of the rows.")
    eval_fraction: Fraction = 0.1
    columns: list[Name] | None = Field(
        None, max_length=4096,
        description="CSV/TSV without a header row: the columns' names, in order (e.g. Criteo's label, i1..i13, "
        "c1..c26). Null: the first line of each file names them.")
    shuffle_buffer: bounded_int(1, 1 << 24) = Field(
        1 << 18, description="Rows shuffled together: each epoch orders the row groups (CSV blocks) anew, then "
        "permutes each window of this many rows. Memory: about three windows of rows.")
    missing: Literal["fill", "error"] = Field(
        "fill", description="A null in a dense or sparse column: fill = a dense 0, and for a hashed feature its own "
        "missing id (an empty bag for plain integer ids); error = the job fails naming the file, row and column.")

    docs: ClassVar[str] = "trainer.md#table"

    @property
    def num_dense(self) -> int:
        return len(self.dense)

    def check(self, cfg: TrainerConfig) -> None:
        features = set(cfg.embeddings.features)
        if set(self.sparse) != features:
            missing, unknown = len(features - set(self.sparse)), len(set(self.sparse) - features)
            raise ValueError(f"data.sparse must map exactly the tables' features: {missing} missing, {unknown} not "
                             "a feature of any table")
        super().check(cfg)

    def memory_bytes(self, cfg: TrainerConfig, *, ids_per_feature: int) -> int:
        """Streamed, whatever the files' size: the reader's shuffle windows of float32 label and dense values,
        and per id its int64 value and offset (one id per column unless multi-hot, which the config cannot
        tell)."""
        num_features = len(cfg.embeddings.features)
        row = (self.num_dense + 1) * BYTES_PER_FLOAT + num_features * ids_per_feature * BYTES_PER_ID * 2
        return STREAM_WINDOWS * self.shuffle_buffer * row


KIND = TableDataConfig
