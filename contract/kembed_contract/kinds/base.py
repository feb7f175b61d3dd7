"""What every kind answers: the contract half of a model kind, a data kind and a table kind.

A kind is one module in `kembed_contract/kinds/{models,data,tables}/` (this half: its config section, defaults,
checks, memory estimate and capabilities, torch-free) and one in the trainer (`kembed_trainer.models.<kind>`,
`kembed_trainer.data.<kind>`, `kembed_trainer.tables.<kind>`: how it trains). The platform asks the kind what it
needs to know through the attributes and methods below, never `kind == "..."`; docs/architecture.md, "Adding a
kind", says what to write. Methods take the whole config (`cfg`, a `TrainerConfig`) where the answer depends on
other sections.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from kembed_contract.fields import Strict

if TYPE_CHECKING:
    from kembed_contract.trainer_config import TableConfig, TrainerConfig

__all__ = [
    "BYTES_PER_FLOAT", "BYTES_PER_ID", "CLICKS", "CLICKS_DEFAULTS", "RATINGS", "ROWS", "SENTENCES", "STREAM_WINDOWS",
    "DataKind", "ModelKind", "TableKind",
]

# What data yields and a model trains on (DataKind.yields, ModelKind.trains_on): they must agree.
ROWS = "rows"  # samples of dense values, sparse ids and a label
SENTENCES = "sentences"  # tokenised sentences, from which the model's trainer draws its own samples

# What a model learns from (ModelKind.task): its defaults and its eval metrics follow it. A kind may name its own.
CLICKS = "clicks"  # 0/1 labels: auc, log_loss
RATINGS = "ratings"  # real-valued labels: rmse, mae

BYTES_PER_FLOAT = 4
BYTES_PER_ID = 8  # ids are int64
# Streamed data holds about three of its shuffle windows at once: the one trained on, the next being read and its
# permuted copy (kembed_trainer.data.stream).
STREAM_WINDOWS = 3

CLICKS_DEFAULTS: Mapping[str, object] = {"training.epochs": 1, "training.mixed_precision": "auto"}
"""The fields' own defaults (row-wise Adagrad at 0.05, Adam at 1e-3, dim 16, batch 256) and one pass over the
log, as CTR models train on Criteo's; the dense part in bf16 where the device has bf16 units (a click model's
dense part is faster so, at the same AUC over seeds: docs/benchmarks.md, the trainer against TorchRec)."""


class ModelKind(Strict):
    """A model kind's section of the config (`model`) and what the platform asks of it.

    A kind subclasses this with a field `kind: Literal["<its name>"] = "<its name>"` (the union's tag, and the
    name of its modules) and its own fields, and ends its module with `KIND = <the class>`.
    """

    default: ClassVar[bool] = False
    """The model a config without a `model` section trains (exactly one kind says so)."""
    trains_on: ClassVar[str] = ROWS
    """What its data must yield: a data kind whose `yields` differs is refused."""
    has_vocabulary: ClassVar[bool] = False
    """Its tables' rows are a vocabulary's words (kept with every checkpoint): exports are keyed by word, the
    neighbours route takes words, and `evaluation.neighbours_of` / `analogies_uri` apply."""
    cpu_only: ClassVar[bool] = False
    """It trains on CPU cores whatever the node has (its ranks get no GPU)."""
    incremental_checkpoints: ClassVar[bool] = True
    """Whether `checkpoint.incremental` (deltas of the changed rows) works for it."""
    export_formats: ClassVar[Mapping[str, str]] = {}
    """Export formats it adds, name -> file suffix: offered for every job's tables beside parquet and numpy."""
    defaults_by_task: ClassVar[Mapping[str, Mapping[str, object]]] = {CLICKS: CLICKS_DEFAULTS}
    """Per task it can have, `section.field` -> the value a field not given takes (or a function of the config
    whose earlier entries are already applied); docs/trainer.md#defaults-per-kind shows them."""
    docs: ClassVar[str] = ""
    """Its section of the docs, `file.md#anchor` under docs/."""

    @classmethod
    def kind_name(cls) -> str:
        return cls.model_fields["kind"].default

    @property
    def task(self) -> str:
        """What it learns from (CLICKS, RATINGS or a kind's own): picks its defaults and eval metrics."""
        return CLICKS

    @property
    def bias_column(self) -> bool:
        """Whether the last coordinate of every row is a per-id bias rather than a factor (exports and neighbours
        leave it out)."""
        return False

    def defaults(self) -> Mapping[str, object]:
        return self.defaults_by_task[self.task]

    def check(self, cfg: TrainerConfig) -> None:
        """Refuse, with a ValueError naming the field, what this kind cannot train (the effective config)."""

    def eval_metrics(self, cfg: TrainerConfig) -> frozenset[str]:
        """The metrics every eval of it reports."""
        if self.task == RATINGS:
            return frozenset({"rmse", "mae", "loss"})
        return frozenset({"auc", "log_loss", "loss"})

    def auto_metric(self, cfg: TrainerConfig) -> str:
        """The metric `evaluation.metric: auto` means."""
        return "rmse" if self.task == RATINGS else "auc"

    def dense_layers(self, cfg: TrainerConfig) -> list[int]:
        """The widths its dense model's layers go through, input first (towers laid end to end): the memory
        estimate's parameters and activations."""
        return []

    def eval_bytes(self, cfg: TrainerConfig, *, width: int, eval_rows: int | None) -> int:
        """What its evaluation holds beyond the gathered scores and labels (an estimate, in bytes); `eval_rows`:
        the held-out rows where the data says how many."""
        return 0

    @classmethod
    def default_table(cls, tables: Sequence[Mapping[str, Any]]) -> str:
        """The table an export or neighbours query reads when none is named, from a checkpoint's `tables.json`
        entries (`name`, `features`, ...)."""
        return tables[0]["name"]


class DataKind(Strict):
    """A data kind's section of the config (`data`) and what the platform asks of it.

    A kind subclasses this with a field `kind: Literal["<its name>"] = "<its name>"` and its own fields, gives
    `num_dense` (a field or a property: the dense features each sample has), and ends its module with
    `KIND = <the class>`.
    """

    default: ClassVar[bool] = False
    """The data a config without a `data` section trains on (exactly one kind says so)."""
    yields: ClassVar[str] = ROWS
    """What it yields (a model kind's `trains_on` must agree)."""
    endless: ClassVar[bool] = False
    """It has no end, so a job on it needs `training.steps` (epochs mean nothing)."""
    docs: ClassVar[str] = ""

    @classmethod
    def kind_name(cls) -> str:
        return cls.model_fields["kind"].default

    @property
    def eval_rows(self) -> int | None:
        """The held-out rows, where the config alone says how many (every rank gathers their scores)."""
        return None

    def check(self, cfg: TrainerConfig) -> None:
        """Refuse, with a ValueError naming the field, what this data cannot feed (the effective config)."""
        if self.endless and cfg.training.epochs is not None:
            raise ValueError(f"training.epochs: {self.kind_name()} data is endless, set training.steps instead")

    def ids_per_feature(self, cfg: TrainerConfig) -> int:
        """Ids each feature of a sample looks up, at most (what the config can tell)."""
        return 1

    def memory_bytes(self, cfg: TrainerConfig, *, ids_per_feature: int) -> int:
        """What the source holds in memory on each rank (an estimate, in bytes)."""
        return 0

    def eval_bytes(self, cfg: TrainerConfig, *, width: int, ids_per_feature: int) -> int:
        """What the source holds while it feeds an evaluation (an estimate, in bytes)."""
        return 0


class TableKind:
    """How a table's rows are stored, and what the platform asks of it. A kind with a config of its own adds a
    field to `TableConfig` and says which tables it takes (`selects`); a table no other kind selects is of the
    default kind (`kinds.table_kind`).

    A kind subclasses this, names itself (`name`, also its modules' name) and ends its module with `KIND = <the
    class>`.
    """

    name: ClassVar[str]
    default: ClassVar[bool] = False
    """The kind of a table that names none (exactly one kind says so)."""
    docs: ClassVar[str] = ""

    @classmethod
    def kind_name(cls) -> str:
        return cls.name

    @classmethod
    def selects(cls, table: TableConfig) -> bool:
        """Whether `table` is of this kind (its config names it); the default kind takes the rest."""
        return False

    @classmethod
    def memory_bytes(cls, table: TableConfig, cfg: TrainerConfig, *, world_size: int) -> float:
        """Bytes of memory one rank holds for `table` (weights and sparse-optimizer state)."""
        raise NotImplementedError
