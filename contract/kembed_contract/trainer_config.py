"""The trainer's one configuration object, validated once at the edge.

Every section forbids unknown keys so that a typo is an error naming the field, not a silently ignored setting.
The API (`kembed_contract.spec`) embeds `TrainerConfig` in its job spec, so this module imports nothing heavy:
no torch, no numpy.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from kembed_contract import kinds, runtime
from kembed_contract.fields import (
    MAX_BATCH,
    MAX_EPOCHS,
    MAX_FEATURES,
    MAX_NAME,
    MAX_ROWS,
    MAX_TABLES,
    MAX_WIDTH,
    Count,
    Fraction,
    LearningRate,
    Name,
    NumbersOnly,
    OptionalReadUri,
    OptionalWriteUri,
    PositiveInt,
    TableFeatures,
)
from kembed_contract.fields import Strict as _Strict
from kembed_contract.fields import bounded_float as _float
from kembed_contract.fields import bounded_int as _int

__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "NumbersOnly",
    "DenseOptimizerConfig",
    "KIND_DEFAULTS",
    "DistributedConfig",
    "EvaluationConfig",
    "EmbeddingsConfig",
    "ModelConfig",
    "OptimizerConfig",
    "SparseOptimizerConfig",
    "SparsityConfig",
    "DynamicConfig",
    "dynamic_map_slots",
    "TableConfig",
    "TierConfig",
    "TrainerConfig",
    "TrainingConfig",
    "ValidationError",
    "format_validation_error",
    "load_config",
]



# ----------------------------------------------------------------------------------------------- embeddings
TIER_BYTES_PER_ROW = 7  # a tiered table's bookkeeping per row: slot (int32), use count (uint16), changed flag


class TierConfig(_Strict):
    """A tiered table: all its rows and their optimizer state on the node's local disk, the hot ones cached in
    memory (docs/trainer.md, tiered tables). Give the cache as rows or as MB, or neither: then it gets what the
    job's memory leaves (`kembed_contract.sizing.with_cache_sizes`).

    This section makes a table of the `tiered` table kind (`kembed_contract.kinds.tables.tiered`).
    """

    cache_rows: _int(1, MAX_ROWS) | None = Field(
        None, description="Rows of this table each rank's cache holds (each with its optimizer state). It must "
        "hold every distinct row of two steps at once: the one training and the next, fetched meanwhile. Neither "
        "this nor cache_mb: the cache gets what resources.memory_per_node leaves per rank after the rest of the "
        "job's memory estimate.")
    cache_mb: _float(gt=0, le=2**30) | None = Field(
        None, description="Each rank's cache as MB of rows and their optimizer state, instead of cache_rows.")
    io_threads: _int(1, 64) = Field(
        4, description="Threads reading and writing the table's rows on disk, so that the disk's latencies overlap.")

    @model_validator(mode="after")
    def _one_size(self) -> TierConfig:
        if self.cache_rows is not None and self.cache_mb is not None:
            raise ValueError("give the cache's size as cache_rows or cache_mb, not both (neither: sized from "
                             "the job's memory)")
        return self

    @property
    def sized_by_job(self) -> bool:
        """The cache's size is not given: it is what the job's memory leaves (kembed_contract.sizing)."""
        return self.cache_rows is None and self.cache_mb is None

    @staticmethod
    def row_bytes(table: TableConfig, optimizer: str) -> int:
        """Bytes of one row in the cache and in the tier's records: its weight and its optimizer state (float32)."""
        dim = table.embedding_dim
        return 4 * (dim + round(dim * runtime.OPTIMIZER_STATE_FLOATS[optimizer](dim)))

    def cache_rows_for(self, table: TableConfig, optimizer: str, *, world_size: int = 1) -> int:
        """Rows of `table` each rank caches: `cache_rows`, or `cache_mb` over a row's weight and optimizer state;
        at most the rank's rows. A cache sized by the job is sized first (`kembed_contract.sizing.with_cache_sizes`,
        which gives it in rows)."""
        rows = -(-table.num_embeddings // world_size)
        if self.cache_rows is not None:
            return min(self.cache_rows, rows)
        if self.cache_mb is None:
            raise ValueError(f"table {table.name}: its tier's cache is sized from the job's memory, which is not "
                             "known here (kembed_contract.sizing.with_cache_sizes sizes it)")
        return max(1, min(int(self.cache_mb * 2**20 / self.row_bytes(table, optimizer)), rows))

    def memory_bytes(self, table: TableConfig, optimizer: str, *, world_size: int = 1) -> float:
        """Memory one rank holds for a tiered `table`: its cache of rows with their optimizer state, and per row
        of the rank's (cached or not) a slot number, a use count and a changed flag (7 bytes)."""
        rows = -(-table.num_embeddings // world_size)
        cached = self.cache_rows_for(table, optimizer, world_size=world_size)
        return cached * self.row_bytes(table, optimizer) + rows * TIER_BYTES_PER_ROW


# A dynamic table's id index per row (kembed_trainer.dynamic): the row's raw id (int64), its use count and the step
# it was last used (int32 each); the same for each slot of ids waiting for admission (counter admission); and the
# id -> row hash map over both, of an int64 key and an int32 row a slot (`dynamic_map_slots`).
DYNAMIC_ROW_BYTES = 8 + 4 + 4
DYNAMIC_PENDING_BYTES = 8 + 4 + 4
DYNAMIC_MAP_SLOT_BYTES = 8 + 4
BLOOM_BYTES_PER_COUNTER = 1


def dynamic_map_slots(entries: int) -> int:
    """Slots of a dynamic table's id -> row map for `entries` rows and waiting slots: the power of two at least
    1.5 times as many (at most two thirds full, so probes stay short)."""
    return 1 << max(4, (3 * entries // 2 - 1).bit_length())
MAX_BLOOM_COUNT = 255  # the Bloom filter's counters are bytes: admit_after is at most this with admission: bloom


class DynamicConfig(_Strict):
    """A dynamic table: raw ids (any int64, or strings from files) get rows of their own, without collisions,
    while there is room; `capacity` rows instead of an id range (docs/trainer.md, dynamic tables).

    This section makes a table of the `dynamic` table kind (`kembed_contract.kinds.tables.dynamic`). The table's
    `admit_after` is the admission threshold (sightings, in batches, before an id gets a row); `admission` says
    how those sightings are counted.
    """

    capacity: _int(1, MAX_ROWS) = Field(
        description="Rows for ids over all ranks (each rank owns the ids that hash to it and holds "
        "capacity / ranks rows). One more row, shared, serves ids without a row of their own (not admitted "
        "yet, or no room).")
    admission: Literal["counter", "bloom"] = Field(
        "counter",
        description="How sightings of ids without a row are counted for admit_after: counter: exactly, one "
        "counter per waiting id (at most capacity waiting ids; past that the least seen are forgotten); bloom: "
        "a counting Bloom filter of bloom_counters bytes, so rare ids cost no memory of their own (it may "
        "over-count an id that shares counters with frequent ones, never under-count). Unused when "
        "admit_after is 0.")
    bloom_counters: _int(64, 2**36) = Field(
        1 << 20, description="admission: bloom only: counters (one byte each) of the filter, over all ranks. "
        "About 10 per distinct id seen between admissions keeps false admissions rare.")
    ttl_steps: Count = Field(
        0, description="Rows whose id was not looked up in this many steps are freed (their id must be "
        "admitted again); checked every max(1, ttl_steps // 16) steps. 0 = never; rows are then freed only "
        "when the table is full, least used first.")

    def rows_per_rank(self, world_size: int) -> int:
        return -(-(self.capacity + 1) // world_size)

    def index_bytes(self, table: TableConfig, *, world_size: int = 1) -> float:
        """Memory one rank holds for the index of a dynamic `table`: per row its id, count and last use, the id
        -> row map, and the admission's counters (waiting ids or the Bloom filter's share)."""
        rows = self.rows_per_rank(world_size)
        waiting = rows if table.admit_after and self.admission == "counter" else 0
        out = rows * DYNAMIC_ROW_BYTES + waiting * DYNAMIC_PENDING_BYTES
        out += dynamic_map_slots(rows + waiting) * DYNAMIC_MAP_SLOT_BYTES
        if table.admit_after and self.admission == "bloom":
            out += -(-self.bloom_counters // world_size) * BLOOM_BYTES_PER_COUNTER
        return out


class TableConfig(_Strict):
    """One embedding table; several features may share it (e.g. `user_id` and `friend_id`)."""

    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=MAX_NAME,
                      description="Unique table name (checkpoint key).")
    num_embeddings: _int(1, MAX_ROWS) = Field(
        description="Rows. With `hash_ids`, the number of hash buckets. A dynamic table leaves it out: its rows "
        "are dynamic.capacity and the shared row.")
    embedding_dim: _int(1, MAX_WIDTH) = Field(
        16, description="Width of each row. Unset: the model kind's default (docs/trainer.md, defaults per kind), else 16."
    )
    features: TableFeatures = Field(description="Sparse features looked up in this table.")
    lr_scale: _float(gt=0, le=1000) = Field(1.0, description="Multiplies the sparse optimizer's lr for this table.")
    weight_decay: _float(ge=0, le=1000) = Field(
        0.0,
        description="L2 regularisation: weight_decay x row is added to the gradient of each row a step touches "
        "(lazily: untouched rows do not decay), before the sparse optimizer sees it, so row-wise Adagrad's "
        "accumulator counts it per row. 0 = none. Unset: the model kind's default (docs/trainer.md, defaults per kind), else 0.",
    )
    hash_ids: bool = Field(
        False,
        description="Hash raw ids (any int64, or strings from files) into num_embeddings buckets; "
        "without it ids must lie in [0, num_embeddings).",
    )
    admit_after: Count = Field(
        0,
        description="An id gets its own row only after it was seen in this many batches; until then it "
        "shares the table's last row (the fallback). 0 = every id has its row from the start.",
    )
    sharding: Literal["auto", "replicated", "row_wise"] = Field(
        "auto",
        description="replicated: every rank holds the whole table; row_wise: each rank holds 1/world_size of "
        "its rows (ids and vectors are exchanged all-to-all); auto: row_wise when num_embeddings >= "
        "embeddings.shard_threshold_rows.",
    )
    tier: TierConfig | None = Field(
        None, description="Keep the table's rows on the node's local disk and only the hot ones in memory "
        "(tables larger than the job's memory); null = all rows in memory. A tiered table is sharded row-wise "
        "(each rank's disk holds its rows).")
    dynamic: DynamicConfig | None = Field(
        None, description="Give raw ids (any int64, or strings) rows of their own as they come, up to a capacity, "
        "instead of an id range or hash buckets; null = a fixed id range (or hash_ids). A dynamic table is "
        "sharded row-wise (each rank owns the ids that hash to it) and may be tiered.")

    @model_validator(mode="before")
    @classmethod
    def _dynamic_rows(cls, raw: object) -> object:
        """A dynamic table's rows follow from its capacity (one more: the shared row); a dumped config names
        both, which must agree."""
        if not isinstance(raw, dict) or not isinstance(raw.get("dynamic"), dict):
            return raw
        capacity = raw["dynamic"].get("capacity")
        if not isinstance(capacity, int) or isinstance(capacity, bool):
            return raw  # DynamicConfig names the fault
        given = raw.get("num_embeddings")
        if given is None:
            return {**raw, "num_embeddings": capacity + 1}
        if given != capacity + 1:
            raise ValueError("num_embeddings: a dynamic table's rows are dynamic.capacity and one shared row; "
                             "leave num_embeddings out")
        return raw

    @model_validator(mode="after")
    def _tier_is_sharded(self) -> TableConfig:
        if self.tier is not None and self.sharding == "replicated":
            raise ValueError("tier: a tiered table is sharded row-wise (each rank's disk holds its rows), "
                             "not replicated")
        if self.dynamic is not None:
            if self.sharding == "replicated":
                raise ValueError("dynamic: a dynamic table is sharded row-wise (each rank owns the ids that hash "
                                 "to it), not replicated")
            if self.hash_ids:
                raise ValueError("hash_ids: a dynamic table gives raw ids rows of their own; hash_ids is for "
                                 "fixed tables")
            if self.dynamic.admission == "bloom" and self.admit_after > MAX_BLOOM_COUNT:
                raise ValueError(f"admit_after: at most {MAX_BLOOM_COUNT} with dynamic.admission: bloom (the "
                                 "filter's counters are bytes)")
        return self

    @property
    def raw_ids(self) -> bool:
        """Whether its ids are raw (any int64, or strings mapped to int64 by the data readers), not rows."""
        return self.hash_ids or self.dynamic is not None


class EmbeddingsConfig(_Strict):
    tables: list[TableConfig] = Field(min_length=1, max_length=MAX_TABLES)
    shard_threshold_rows: _int(1, MAX_ROWS) = Field(
        1_000_000,
        description="Tables with `sharding: auto` and at least this many rows are sharded row-wise across "
        "ranks; smaller ones are replicated (every rank all-gathers their gradients and updates them). Where a "
        "width already has a sharded table, sharding its small tables too is usually faster and saves memory.",
    )

    def is_sharded(self, table: TableConfig) -> bool:
        """Whether `table` is split row-wise across ranks (decided by the config alone, not the world size)."""
        if table.tier is not None or table.dynamic is not None:
            return True
        if table.sharding == "auto":
            return table.num_embeddings >= self.shard_threshold_rows
        return table.sharding == "row_wise"

    @model_validator(mode="before")
    @classmethod
    def _features_bounded(cls, raw: object) -> object:
        """At most MAX_FEATURES features over all tables, counted before any table is validated (the cost)."""
        tables = raw.get("tables") if isinstance(raw, dict) else None
        if isinstance(tables, list) and sum(
                len(t["features"]) for t in tables if isinstance(t, dict) and isinstance(t.get("features"), list)
        ) > MAX_FEATURES:
            raise ValueError(f"tables: at most {MAX_FEATURES} features over all tables")
        return raw

    @model_validator(mode="after")
    def _unique_names(self) -> EmbeddingsConfig:
        names = [t.name for t in self.tables]
        if len(set(names)) != len(names):
            raise ValueError("table names must be unique")
        features = [f for t in self.tables for f in t.features]
        if len(set(features)) != len(features):
            raise ValueError("a feature may be looked up in only one table")
        return self

    @property
    def ordered_tables(self) -> list[TableConfig]:
        """Tables grouped by width (stable), so the tables of one width are looked up in one call."""
        return sorted(self.tables, key=lambda t: t.embedding_dim)

    @property
    def features(self) -> list[str]:
        """All sparse features in `ordered_tables` order: the feature order of every sparse batch."""
        return [f for t in self.ordered_tables for f in t.features]


# ----------------------------------------------------------------------------------------------- kinds
# The model and data sections are each one of the kinds registered in kembed_contract.kinds (one module per kind,
# which owns its section's fields), told apart by `kind`.
ModelConfig = kinds.model_union()
DataConfig = kinds.data_union()


# ----------------------------------------------------------------------------------------------- optimizers
class SparseOptimizerConfig(_Strict):
    """Updates only the embedding rows a batch touched (lazy: untouched rows and their moments stay put)."""

    name: Literal["sgd", "adagrad", "rowwise_adagrad", "adam"] = "rowwise_adagrad"
    lr: LearningRate = 0.05
    min_lr: LearningRate | None = Field(
        None,
        description="The lr falls linearly from `lr` to this at the last step (gensim's alpha to min_alpha); "
        "null = constant lr.",
    )
    eps: _float(gt=0, le=1) = 1e-8
    beta1: Fraction = Field(0.9, description="adam only.")
    beta2: Fraction = Field(0.999, description="adam only.")


class DenseOptimizerConfig(_Strict):
    name: Literal["adam", "adamw"] = "adam"
    lr: LearningRate = 1e-3
    weight_decay: _float(ge=0, le=1000) = 0.0
    beta1: Fraction = 0.9
    beta2: Fraction = 0.999


class OptimizerConfig(_Strict):
    sparse: SparseOptimizerConfig = SparseOptimizerConfig()
    dense: DenseOptimizerConfig = DenseOptimizerConfig()


# ----------------------------------------------------------------------------------------------- run
class TrainingConfig(_Strict):
    mixed_precision: Literal["none", "bf16", "auto"] = Field(
        "none",
        description="bf16: the dense model runs under autocast in bfloat16 (weights, optimizer and embedding "
        "tables stay float32); faster on GPUs and CPUs with bf16 units, slightly less precise. auto: bf16 where "
        "the device has bf16 units, else none. Unset: the model kind's default (docs/trainer.md).",
    )
    steps: PositiveInt | None = Field(
        None,
        description="Total optimizer steps (a resumed run continues up to this); at most one of steps, epochs; "
        "neither: the model kind's default epochs (docs/trainer.md), and synthetic data needs steps.",
    )
    epochs: _int(1, MAX_EPOCHS) | None = Field(
        None,
        description="Passes over the training data (table or text data), turned into steps once the data is "
        "read (see docs/trainer.md); at most one of steps, epochs.",
    )
    batch_size: _int(1, MAX_BATCH) = Field(
        256,
        description="Samples per rank per step (for sentence data: corpus words). Unset: the model kind's default "
        "(docs/trainer.md, defaults per kind), else 256.",
    )
    seed: _int(-(2**63), 2**63 - 1) = 0
    log_every: PositiveInt = Field(10, description="Steps between `progress` records.")
    eval_every: Count = Field(
        0, description="Steps between `eval` records; 0 = evaluate only at the end."
    )
    threads: _int(0, 1024) = Field(
        0, description="threads per rank (torch's intra-op and inter-op pools); 0 = the rank's share of the job's "
        "cores (resources.cpu_per_node / procs_per_node), or of the machine's when run by hand; never more than "
        "that share under a launcher."
    )

    @model_validator(mode="after")
    def _steps_or_epochs(self) -> TrainingConfig:
        if self.steps is not None and self.epochs is not None:
            raise ValueError("set one of steps and epochs, not both")
        return self


class CheckpointConfig(_Strict):
    uri: OptionalWriteUri = Field(
        None, description="Folder URI (`file://...` or `s3://...`, or a plain path); `step-N/` go under it."
    )
    every_steps: Count = Field(
        0, description="Steps between checkpoints; 0 = only the final (and on SIGTERM)."
    )
    keep: _int(1, 10_000) = Field(
        3,
        description="Complete checkpoints kept (each still restorable: with `incremental`, the whole chain it "
        "needs is kept too); older ones are deleted.",
    )
    incremental: bool = Field(
        False,
        description="Between full checkpoints save deltas: the dense part whole, and of the tables only the rows "
        "(with their optimizer state) changed since the previous save. Off by default: it pays for big tables "
        "a save touches a few percent of, and makes `keep` keep whole chains.",
    )
    full_every: _int(1, 10_000) = Field(
        8,
        description="With `incremental`: saves per chain, a full checkpoint then up to full_every - 1 deltas. "
        "8 bounds a resume to one full load and 7 small ones.",
    )
    max_chain_share: _float(gt=0, le=100) = Field(
        0.5,
        description="With `incremental`: the next save is full once the chain's deltas add up to more than this "
        "share of its full checkpoint's bytes. 0.5: a chain never costs more than 1.5 full checkpoints of storage.",
    )


# Metrics an evaluation reports, and which way is better (the best checkpoint and early stopping use it).
LOWER_IS_BETTER = frozenset({"loss", "rmse", "mae", "log_loss"})
HIGHER_IS_BETTER = frozenset({"auc", "recall_at_k", "analogy_accuracy"})


class EvaluationConfig(_Strict):
    """What an evaluation measures, and what the job keeps of it.

    Every eval (each `training.eval_every` steps and at the end) reports the metrics of its model kind: `rmse`,
    `mae` and `loss` for ratings; `auc`, `log_loss` and `loss` for clicks, with `recall_at_k` for retrieval; a
    kind with a vocabulary the `auc` and `log_loss` of true against noise pairs, plus the neighbours of
    `neighbours_of` and, with `analogies_uri`, `analogy_accuracy` (docs/trainer.md, each kind's section).
    """

    metric: Literal["auto", "loss", "rmse", "mae", "auc", "log_loss", "recall_at_k", "analogy_accuracy"] = Field(
        "auto",
        description="The metric that picks the best checkpoint and drives early stopping; lower is better for "
        "loss, rmse, mae, log_loss, higher for the others. auto: rmse for ratings, analogy_accuracy with "
        "analogies, else auc.",
    )
    keep_best: bool = Field(
        True,
        description="Save a checkpoint at each eval that improves `metric` and keep it whatever `checkpoint.keep` "
        "says; the job's result is then the best eval and its checkpoint (the last is kept too).",
    )
    patience: Count = Field(
        0, description="Evals in a row without improvement after which training stops early; 0 = never."
    )
    recall_k: _int(1, 10_000) = Field(
        10, description="Retrieval (a model reporting recall_at_k): recall@k ranks each held-out positive's item among the held-out items."
    )
    neighbours_of: Annotated[list[Name], Field(max_length=100)] = Field(
        [], description="A model with a vocabulary: words whose nearest neighbours (cosine) each eval reports."
    )
    neighbours_k: _int(1, 100) = 5
    analogies_uri: OptionalReadUri = Field(
        None,
        description="A model with a vocabulary: analogy questions, one `a b c d` per line (a is to b as c is to "
        "d; `:` lines are section titles, as in the questions-words.txt of Mikolov et al.); analogy_accuracy is the share answered right "
        "among those whose four words are in the vocabulary.",
    )


class SparsityConfig(_Strict):
    """Dynamic sparse training of the dense weights (every weight matrix; biases stay dense).

    Dense until `dense_until`, then the masked fraction rises by `increase` every `increase_every` steps up to
    `target`; masks are chosen again at each rise and every `every_steps`. Masked weights are zero and get no
    updates (their gradients are masked and the mask is applied again after each optimizer step); a weight the
    mask lets back in restarts from zero.
    """

    method: Literal["topk", "random", "score"] = Field(
        "topk",
        description="topk: keep the largest |w|; random: a random subset (seeded by training.seed and the step); "
        "score: keep the largest |w| / mean|w| + grad_weight * |grad| / mean|grad|, so weights with large "
        "gradients can grow back.",
    )
    target: _float(gt=0, lt=1) = Field(
        description="Final fraction of each weight matrix masked."
    )
    dense_until: Count = Field(
        0, description="Steps trained dense before masking starts."
    )
    increase: _float(gt=0, le=1) = Field(
        1.0,
        description="Masked fraction added at each rise (0.1 = +10% of the weights); 1 = all of `target` at once.",
    )
    increase_every: PositiveInt = Field(100, description="Steps between rises.")
    every_steps: Count = Field(
        0, description="Steps between re-selections at a constant fraction; 0 = only when the fraction rises."
    )
    block_size: _int(1, MAX_WIDTH) = Field(
        1,
        description="Mask square blocks of this many rows and columns (1 = element-wise); edge blocks may be smaller.",
    )
    grad_weight: _float(ge=0, le=1e6) = Field(
        1.0, description="score only: weight of the gradient term."
    )


class DistributedConfig(_Strict):
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="auto = nccl when CUDA is available, else gloo."
    )
    grad_compression: Literal["none", "bf16", "fp16"] = Field(
        "none",
        description="Cast dense gradients for DDP's all-reduce: half the bytes, slightly less precision.",
    )


# ----------------------------------------------------------------------------------------------- defaults per kind
KIND_DEFAULTS: dict[str, dict[str, object]] = {
    task: dict(defaults) for kind in kinds.MODELS.values() for task, defaults in kind.defaults_by_task.items()
}
"""Per task (TrainerConfig.task), `section.field` -> the value a field not given takes (or a function of the
config whose earlier entries are already applied); a field not named here takes its own default. Each model kind
owns its tasks' defaults (`defaults_by_task` in its module); this gathers them. docs/trainer.md#defaults-per-kind
shows them (a test checks it agrees)."""


def _set_unless_given(model: BaseModel, sections: list[str], name: str, value: object) -> None:
    """Set `name` on the model at `sections` below `model` (on each one of a list) unless the input gave it.
    Sections are replaced by updated copies, never changed in place: an unset section is a shared default."""
    if not sections:
        if name not in model.model_fields_set:
            setattr(model, name, value)
        return
    head, *rest = sections
    child = getattr(model, head)
    children = child if isinstance(child, list) else [child]
    copies = [c.model_copy(deep=True) for c in children]
    for c in copies:
        _set_unless_given(c, rest, name, value)
    setattr(model, head, copies if isinstance(child, list) else copies[0])


class TrainerConfig(_Strict):
    model: ModelConfig = kinds.default_model()
    embeddings: EmbeddingsConfig
    data: DataConfig = kinds.default_data()
    optimizer: OptimizerConfig = OptimizerConfig()
    training: TrainingConfig = TrainingConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    distributed: DistributedConfig = DistributedConfig()
    evaluation: EvaluationConfig = EvaluationConfig()
    sparsity: SparsityConfig | None = Field(
        None, description="Dynamic sparse masks over the dense weights; null = dense."
    )

    @model_validator(mode="after")
    def _kind_defaults(self) -> TrainerConfig:
        """Every field of the model kind's defaults for its task not given takes the kind's value. Runs before
        the checks below (pydantic runs a model's after-validators in order), so they and every reader see the
        effective values; a dumped config names every field, so it validates again to itself."""
        if self.training.steps is None and self.training.epochs is None and self.data.endless:
            raise ValueError(f"training.steps: {self.data.kind} data is endless, set training.steps")
        for path, value in self.model.defaults().items():
            *sections, name = path.split(".")
            if (sections, name) == (["training"], "epochs") and self.training.steps is not None:
                continue  # steps given: no epochs
            _set_unless_given(self, sections, name, value(self) if callable(value) else value)
        if self.training.steps is None and self.training.epochs is None:  # both given as null
            raise ValueError("training: set one of steps and epochs")
        return self

    @model_validator(mode="after")
    def _model_fits_tables(self) -> TrainerConfig:
        """The kinds' own checks (each kind's module), and what holds between the sections."""
        self.data.check(self)
        if self.model.trains_on != self.data.yields:
            raise ValueError(_mismatch(self.model, self.data))
        self.model.check(self)
        evaluation = self.evaluation
        if evaluation.metric not in ("auto", *self.eval_metrics):
            raise ValueError(f"evaluation.metric: {self.model.kind} reports {sorted(self.eval_metrics)}, "
                             f"not {evaluation.metric!r}")
        if not self.model.has_vocabulary and (evaluation.neighbours_of or evaluation.analogies_uri):
            raise ValueError(f"evaluation.neighbours_of and analogies_uri are for {kinds.in_words(kinds.with_vocabulary())}")
        if not self.model.incremental_checkpoints and self.checkpoint.incremental:
            raise ValueError(f"checkpoint.incremental: {self.model.kind} saves full checkpoints only")
        return self

    @property
    def task(self) -> str:
        """What the model learns from: "ratings", "clicks" or a kind's own (the model kind says). Defaults
        (KIND_DEFAULTS) and eval metrics follow it."""
        return self.model.task

    @property
    def ratings(self) -> bool:
        """Whether labels are real-valued ratings, not 0/1."""
        return self.task == kinds.base.RATINGS

    @property
    def eval_metrics(self) -> frozenset[str]:
        """The metrics every eval of this model reports."""
        return self.model.eval_metrics(self)

    @property
    def best_metric(self) -> tuple[str, bool]:
        """(the metric that decides the best checkpoint, whether higher is better)."""
        metric = self.evaluation.metric
        if metric == "auto":
            metric = self.model.auto_metric(self)
        return metric, metric in HIGHER_IS_BETTER


def _mismatch(model: kinds.base.ModelKind, data: kinds.base.DataKind) -> str:
    """Why this model cannot train on this data, naming the pair that goes together (the one that is not rows)."""
    if model.trains_on != kinds.base.ROWS:
        needs = model.trains_on
        model_kinds = [model.kind]
        data_kinds = [name for name, kind in kinds.DATA.items() if kind.yields == needs]
    else:
        model_kinds = [name for name, kind in kinds.MODELS.items() if kind.trains_on == data.yields]
        data_kinds = [data.kind]
    data_names = " or ".join(repr(d) for d in data_kinds)
    return (f"{kinds.in_words(model_kinds)} trains on data.kind {data_names}, and {kinds.in_words(data_kinds)} data is only "
            f"for {kinds.in_words(model_kinds)}")


def format_validation_error(err: ValidationError) -> str:
    """One line naming the first field at fault: `training.steps: Input should be greater than 0`."""
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"])
    msg = first["msg"].removeprefix("Value error, ")
    more = f" (and {err.error_count() - 1} more)" if err.error_count() > 1 else ""
    return f"{loc}: {msg}{more}" if loc else f"{msg}{more}"


def load_config(path_or_uri: str) -> TrainerConfig:
    """Read YAML or JSON from a path, `file://` or `s3://` URI; raises ValidationError or ValueError."""
    import fsspec  # only here: the API validates specs without fsspec installed

    with fsspec.open(path_or_uri, "r", encoding="utf-8") as f:
        text = f.read()
    # YAML is a superset of JSON, so yaml reads either; json is only faster.
    raw = json.loads(text) if path_or_uri.endswith(".json") else yaml.safe_load(text)
    if not isinstance(raw, dict):
        raise ValueError(f"{path_or_uri}: expected a mapping at the top level")  # noqa: TRY004 - bad config
    return TrainerConfig.model_validate(raw)


def __getattr__(name: str) -> type:
    """Each kind's section by its class name (`config.TableDataConfig`), for readers that know it: the class
    lives in its kind's module (kembed_contract.kinds)."""
    for kind in (*kinds.MODELS.values(), *kinds.DATA.values()):
        if kind.__name__ == name:
            return kind
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

