"""The trainer's one configuration object, validated once at the edge.

Every section forbids unknown keys so that a typo is an error naming the field, not a silently ignored setting.
The API (`kembed_contract.spec`) embeds `TrainerConfig` in its job spec, so this module imports nothing heavy:
no torch, no numpy.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)
from pydantic_core import PydanticCustomError

from kembed_contract.storage_policy import Access, check_uri_syntax

__all__ = [
    "CheckpointConfig",
    "DLRMConfig",
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
    "SyntheticDataConfig",
    "TableConfig",
    "TableDataConfig",
    "TextDataConfig",
    "TrainerConfig",
    "TrainingConfig",
    "TwoTowerConfig",
    "ValidationError",
    "Word2VecConfig",
    "format_validation_error",
    "load_config",
]

# Every number is finite, strictly typed (`true` is not 1, "5" is not 5) and bounded, and every string has a
# length limit: a value past these bounds could only fail, hang or exhaust a machine later, never train. The
# bounds sit far past any real job; memory is checked against the job's resources separately
# (kembed_api.estimates). 2**31 - 1: steps and counts are stored as 32-bit integers.
MAX_INT32 = 2**31 - 1
MAX_ROWS = 2**40  # rows of one table (hash buckets): a trillion, beyond any single table in production
MAX_WIDTH = 65_536  # an embedding's width or an MLP layer's
MAX_URI = 4096
MAX_NAME = 256  # a column, feature or table name
# How many tables and sparse features one job may have. Validation's cost grows with them (a 1,024-table spec of
# 56,000 features took 0.1 s of the API's CPU to refuse), so they are bounded, and counted before the rest is
# validated. Far past real models: DLRM on Criteo has 26 features; production CTR models have hundreds.
MAX_TABLES = 512
MAX_FEATURES_PER_TABLE = 256
MAX_FEATURES = 1024  # over all tables (and so over data.sparse and the two towers)


def _numbers_only(value: object) -> object:
    """JSON's numbers only: `true` is not 1 and "5" is not 5 (JSON Schema agrees). An integral 5.0 is the integer
    5, as JSON Schema says too; 5.5 is not."""
    if isinstance(value, bool | str | bytes):
        raise PydanticCustomError("number_type", "Input should be a number, not {kind}",
                                  {"kind": "true/false" if isinstance(value, bool) else "text"})
    return value


NumbersOnly = BeforeValidator(_numbers_only)


def _int(ge: int, le: int) -> type[int]:
    if ge == 1:  # said as "greater than 0", as the errors of positive counts always were
        return Annotated[int, NumbersOnly, Field(gt=0, le=le)]  # type: ignore[return-value]
    return Annotated[int, NumbersOnly, Field(ge=ge, le=le)]  # type: ignore[return-value]


PositiveInt = _int(1, MAX_INT32)
Count = _int(0, MAX_INT32)
Fraction = Annotated[float, Field(strict=True, ge=0, lt=1, allow_inf_nan=False)]
Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME, pattern=r"^[^\x00-\x1f\x7f]*$")]
Uri = Annotated[str, Field(min_length=1, max_length=MAX_URI, pattern=r"^[^\x00-\x1f\x7f]*$")]
Layers = Annotated[list[_int(1, MAX_WIDTH)], Field(max_length=32)]
Features = Annotated[list[Name], Field(min_length=1, max_length=MAX_FEATURES)]
TableFeatures = Annotated[list[Name], Field(min_length=1, max_length=MAX_FEATURES_PER_TABLE)]


def _float(*, gt: float | None = None, ge: float | None = None, le: float | None = None,
           lt: float | None = None) -> type[float]:
    return Annotated[float, Field(strict=True, gt=gt, ge=ge, le=le, lt=lt, allow_inf_nan=False)]  # type: ignore


MAX_LR = 1000
LearningRate = _float(gt=0, le=MAX_LR)
MAX_HOTNESS = 4096  # ids per feature per sample
MAX_EVAL_SAMPLES = 100_000_000  # an eval's scores and labels are gathered on every rank
MAX_BATCH = 2**22  # samples per rank per step (4M); memory is checked separately
MAX_EPOCHS = 100_000  # passes over the training data
# Every storage URI of the config is one of these: the Access marks it for the storage policy's checks
# (kembed_contract.storage_policy.uri_fields finds them), the validator refuses what has no canonical form.
ReadUri = Annotated[Uri, AfterValidator(check_uri_syntax), Access.READ]
OptionalReadUri = Annotated[Uri | None, AfterValidator(lambda u: u if u is None else check_uri_syntax(u)), Access.READ]
OptionalWriteUri = Annotated[
    Uri | None, AfterValidator(lambda u: u if u is None else check_uri_syntax(u)), Access.WRITE
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# ----------------------------------------------------------------------------------------------- embeddings
class TableConfig(_Strict):
    """One embedding table; several features may share it (e.g. `user_id` and `friend_id`)."""

    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=MAX_NAME,
                      description="Unique table name (checkpoint key).")
    num_embeddings: _int(1, MAX_ROWS) = Field(description="Rows. With `hash_ids`, the number of hash buckets.")
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


# ----------------------------------------------------------------------------------------------- models
class DLRMConfig(_Strict):
    """DLRM-style CTR model: bottom MLP over dense features, dot interaction with the pooled embeddings, top MLP."""

    kind: Literal["dlrm"] = "dlrm"
    bottom_mlp: Layers = Field(
        [64, 16], min_length=1, description="Hidden sizes; the last must equal the tables' embedding_dim."
    )
    top_mlp: Layers = Field(
        [64, 32], description="Hidden sizes before the final 1-unit logit layer (added automatically)."
    )


class TwoTowerConfig(_Strict):
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


class Word2VecConfig(_Strict):
    """Skip-gram with negative sampling: logit = dot(input vector of the center word, output vector of a
    context or noise word). Needs `data.kind: text` and two tables, for the features `center` and `context`."""

    kind: Literal["word2vec"] = "word2vec"


ModelConfig = Annotated[DLRMConfig | TwoTowerConfig | Word2VecConfig, Field(discriminator="kind")]


# ----------------------------------------------------------------------------------------------- data
class SyntheticDataConfig(_Strict):
    """Zipf-distributed ids with a planted signal: a label a model can learn, for demos and tests."""

    kind: Literal["synthetic"] = "synthetic"
    num_dense: _int(0, 4096) = Field(13, description="Dense (float) features per sample.")
    zipf_alpha: _float(gt=0, le=16) = Field(1.1, description="Id frequency ~ 1 / rank**alpha.")
    min_hotness: _int(1, MAX_HOTNESS) = Field(1, description="Fewest ids per feature per sample (multi-hot).")
    max_hotness: _int(1, MAX_HOTNESS) = Field(1, description="Most ids per feature per sample.")
    signal: _float(ge=0, le=100) = Field(
        1.0, description="Strength of the planted signal; 0 makes labels pure noise (AUC 0.5)."
    )
    eval_samples: _int(1, MAX_EVAL_SAMPLES) = Field(
        8192, description="Held-out samples (a separate seed stream), generated and scored at every eval.")

    @model_validator(mode="after")
    def _hotness_order(self) -> SyntheticDataConfig:
        if self.max_hotness < self.min_hotness:
            raise ValueError("max_hotness must be >= min_hotness")
        return self


class TableDataConfig(_Strict):
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
    shuffle_buffer: _int(1, 1 << 24) = Field(
        1 << 18, description="Rows shuffled together: each epoch orders the row groups (CSV blocks) anew, then "
        "permutes each window of this many rows. Memory: about three windows of rows.")
    missing: Literal["fill", "error"] = Field(
        "fill", description="A null in a dense or sparse column: fill = a dense 0, and for a hashed feature its own "
        "missing id (an empty bag for plain integer ids); error = the job fails naming the file, row and column.")

    @property
    def num_dense(self) -> int:
        return len(self.dense)


class TextDataConfig(_Strict):
    """A tokenised corpus for word2vec: one sentence per line, tokens separated by whitespace.

    Text without spaces between words (Chinese, Japanese) can be split per character with `tokenizer: chars`.
    The vocabulary is built from the corpus in one streaming pass: words seen at least `min_count` times, the most
    frequent first, at most the tables' num_embeddings. Training streams the sentences (never held whole).
    """

    kind: Literal["text"] = "text"
    uri: ReadUri
    tokenizer: Literal["whitespace", "chars"] = "whitespace"
    min_count: PositiveInt = Field(5, description="Words seen fewer times are left out (gensim's default).")
    window: _int(1, 1000) = Field(5, description="Context words on each side of the center word.")
    negatives: _int(1, 1000) = Field(5, description="Noise words per (center, context) pair.")
    subsample: _float(ge=0, le=1) = Field(
        1e-3, description="Frequent-word subsampling threshold t (Mikolov et al.); 0 = off."
    )
    eval_fraction: Fraction = Field(
        0.01, description="Sentences held out for the eval loss/AUC of true vs noise pairs."
    )
    shuffle_buffer: _int(1, 1 << 30) = Field(
        1 << 20, description="Words shuffled together: each epoch orders the corpus's blocks of lines anew, then "
        "permutes the sentences of each window of about this many words. Memory: about three windows of words.")
    max_vocab_size: _int(2, MAX_INT32) = Field(
        4_000_000, description="Distinct words the vocabulary pass counts at most (gensim's max_vocab_size): past "
        "it the rarest are dropped, those seen once first, and counting goes on. Memory: about 100 bytes a word.")

    @property
    def num_dense(self) -> int:
        return 0


DataConfig = Annotated[SyntheticDataConfig | TableDataConfig | TextDataConfig, Field(discriminator="kind")]


# ----------------------------------------------------------------------------------------------- optimizers
class SparseOptimizerConfig(_Strict):
    """Updates only the embedding rows a batch touched (lazy: untouched rows and their moments stay put)."""

    name: Literal["sgd", "adagrad", "rowwise_adagrad", "adam"] = "rowwise_adagrad"
    lr: LearningRate = 0.05
    min_lr: LearningRate | None = Field(
        None,
        description="The lr falls linearly from `lr` to this at the last step (word2vec's alpha to min_alpha); "
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
    mixed_precision: Literal["none", "bf16"] = Field(
        "none",
        description="bf16: the dense model runs under autocast in bfloat16 (weights, optimizer and embedding "
        "tables stay float32); faster on GPUs and CPUs with bf16 units, slightly less precise.",
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
        description="Samples per rank per step (word2vec: corpus words). Unset: the model kind's default "
        "(docs/trainer.md, defaults per kind), else 256.",
    )
    seed: _int(-(2**63), 2**63 - 1) = 0
    log_every: PositiveInt = Field(10, description="Steps between `progress` records.")
    eval_every: Count = Field(
        0, description="Steps between `eval` records; 0 = evaluate only at the end."
    )
    threads: _int(0, 1024) = Field(
        0, description="torch intra-op threads per rank; 0 = CPU cores / local ranks."
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
    `mae` and `loss` for ratings (two_tower with mse); `auc`, `log_loss` and `loss` for clicks (dlrm, two_tower
    with bce, which adds `recall_at_k`); word2vec the `auc` and `log_loss` of true against noise pairs, plus the
    neighbours of `neighbours_of` and, with `analogies_uri`, `analogy_accuracy`.
    """

    metric: Literal["auto", "loss", "rmse", "mae", "auc", "log_loss", "recall_at_k", "analogy_accuracy"] = Field(
        "auto",
        description="The metric that picks the best checkpoint and drives early stopping; lower is better for "
        "loss, rmse, mae, log_loss, higher for the others. auto: rmse for ratings, analogy_accuracy for word2vec "
        "with analogies, else auc.",
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
        10, description="two_tower with bce: recall@k ranks each held-out positive's item among the held-out items."
    )
    neighbours_of: Annotated[list[Name], Field(max_length=100)] = Field(
        [], description="word2vec: words whose nearest neighbours (cosine) each eval reports."
    )
    neighbours_k: _int(1, 100) = 5
    analogies_uri: OptionalReadUri = Field(
        None,
        description="word2vec: analogy questions, one `a b c d` per line (a is to b as c is to d; `:` lines are "
        "section titles, as in word2vec's questions-words.txt); analogy_accuracy is the share answered right "
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
Task = Literal["ratings", "clicks", "text"]

FUNK_SVD_STEP, FUNK_SVD_REG = 0.005, 0.02
"""Funk SVD's SGD step and L2 weight per rating (Surprise's SVD defaults), which ratings' defaults carry into
batches: the loss is the batch's mean, so each row's gradient is divided by batch_size and these are multiplied
(lr) and divided (weight decay) by it."""


def _ratings_lr(cfg: TrainerConfig) -> float:
    return float(min(FUNK_SVD_STEP * cfg.training.batch_size, MAX_LR))


def _ratings_weight_decay(cfg: TrainerConfig) -> float:
    return FUNK_SVD_REG / cfg.training.batch_size


KIND_DEFAULTS: dict[str, dict[str, object]] = {
    # Funk SVD as Surprise's SVD runs it (100 factors, 20 epochs, step 0.005, reg 0.02): per-row SGD, 100 factors
    # plus the bias coordinate, and a dense lr at which the global bias nears the mean rating within about an epoch.
    "ratings": {
        "training.batch_size": 256,
        "training.epochs": 20,
        "embeddings.tables.embedding_dim": 101,
        "embeddings.tables.weight_decay": _ratings_weight_decay,
        "optimizer.sparse.name": "sgd",
        "optimizer.sparse.lr": _ratings_lr,
        "optimizer.dense.lr": 0.01,
    },
    # The fields' own defaults (row-wise Adagrad at 0.05, Adam at 1e-3, dim 16, batch 256) and one pass over the
    # log, as DLRM trains on Criteo's.
    "clicks": {"training.epochs": 1},
    # gensim's Word2Vec defaults (vector_size 100, 5 epochs, alpha 0.025 falling to min_alpha 0.0001); the text
    # data's own defaults are gensim's too (window 5, negative 5, min_count 5, sample 1e-3).
    "text": {
        "training.batch_size": 10_000,
        "training.epochs": 5,
        "embeddings.tables.embedding_dim": 100,
        "optimizer.sparse.name": "sgd",
        "optimizer.sparse.lr": 0.025,
        "optimizer.sparse.min_lr": 0.0001,
    },
}
"""Per task (TrainerConfig.task), `section.field` -> the value a field not given takes (or a function of the
config whose earlier entries are already applied); a field not named here takes its own default. The one place
these live: docs/trainer.md#defaults-per-kind shows them (a test checks it agrees)."""


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
    model: ModelConfig = DLRMConfig()
    embeddings: EmbeddingsConfig
    data: DataConfig = SyntheticDataConfig()
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
        """Every field of KIND_DEFAULTS[self.task] not given takes the kind's value. Runs before the checks below
        (pydantic runs a model's after-validators in order), so they and every reader see the effective values;
        a dumped config names every field, so it validates again to itself."""
        if self.training.steps is None and self.training.epochs is None and self.data.kind == "synthetic":
            raise ValueError("training.steps: synthetic data is endless, set training.steps")
        for path, value in KIND_DEFAULTS[self.task].items():
            *sections, name = path.split(".")
            if (sections, name) == (["training"], "epochs") and self.training.steps is not None:
                continue  # steps given: no epochs
            _set_unless_given(self, sections, name, value(self) if callable(value) else value)
        if self.training.steps is None and self.training.epochs is None:  # both given as null
            raise ValueError("training: set one of steps and epochs")
        return self

    @model_validator(mode="after")
    def _model_fits_tables(self) -> TrainerConfig:
        features = set(self.embeddings.features)
        if self.data.kind == "table" and set(self.data.sparse) != features:
            missing, unknown = len(features - set(self.data.sparse)), len(set(self.data.sparse) - features)
            raise ValueError(f"data.sparse must map exactly the tables' features: {missing} missing, {unknown} not "
                             "a feature of any table")
        if self.model.kind == "two_tower":
            towers = self.model.user_features + self.model.item_features
            if set(towers) != features or len(towers) != len(features):
                raise ValueError("two_tower: user_features + item_features must name each table feature once")
            if len({t.embedding_dim for t in self.embeddings.tables}) != 1:
                raise ValueError("two_tower: all tables need the same embedding_dim")
        if self.training.epochs is not None and self.data.kind == "synthetic":
            raise ValueError("training.epochs: synthetic data is endless, set training.steps instead")
        if (self.model.kind == "word2vec") != (self.data.kind == "text"):
            raise ValueError("word2vec trains on data.kind 'text', and text data is only for word2vec")
        if self.model.kind == "word2vec":
            by_feature = {f: t for t in self.embeddings.tables for f in t.features}
            if features != {"center", "context"} or by_feature["center"] is by_feature["context"]:
                raise ValueError("word2vec: needs two tables, one with feature 'center', one with 'context'")
            if by_feature["center"].embedding_dim != by_feature["context"].embedding_dim:
                raise ValueError("word2vec: the center and context tables need the same embedding_dim")
            self._check_word2vec_fits_its_trainer()
        if self.model.kind == "dlrm":
            dims = {t.embedding_dim for t in self.embeddings.tables}
            if len(dims) != 1:
                raise ValueError(f"dlrm: all tables need the same embedding_dim, got {sorted(dims)}")
            (dim,) = dims
            if self.data.num_dense > 0 and self.model.bottom_mlp[-1] != dim:
                raise ValueError(f"dlrm: bottom_mlp must end in the embedding_dim ({dim})")
        evaluation = self.evaluation
        if evaluation.metric not in ("auto", *self.eval_metrics):
            raise ValueError(f"evaluation.metric: {self.model.kind} reports {sorted(self.eval_metrics)}, "
                             f"not {evaluation.metric!r}")
        if self.model.kind != "word2vec" and (evaluation.neighbours_of or evaluation.analogies_uri):
            raise ValueError("evaluation.neighbours_of and analogies_uri are for word2vec")
        if self.model.kind == "word2vec" and self.checkpoint.incremental:
            # Its compiled trainer writes the tables directly, past the changed-row tracking deltas rely on.
            raise ValueError("checkpoint.incremental: word2vec saves full checkpoints only")
        return self

    def _check_word2vec_fits_its_trainer(self) -> None:
        """word2vec trains in compiled code on CPU (`kembed_trainer.word2vec_sgd`): per-sample SGD straight on
        whole replicated tables, whose rows are the vocabulary's indices."""
        if self.optimizer.sparse.name != "sgd":
            raise ValueError(
                f"optimizer.sparse.name: word2vec trains with 'sgd' (hogwild, as word2vec and gensim), "
                f"got {self.optimizer.sparse.name!r}"
            )
        if self.distributed.backend == "nccl":
            raise ValueError("distributed.backend: word2vec trains on CPU cores; use 'auto' or 'gloo'")
        for i, t in enumerate(self.embeddings.tables):
            if self.embeddings.is_sharded(t):
                raise ValueError(
                    f"embeddings.tables.{i}: word2vec tables are replicated; set sharding: replicated")
            if t.hash_ids or t.admit_after:
                raise ValueError(
                    f"embeddings.tables.{i}: word2vec rows are vocabulary indices; set hash_ids: false and "
                    "admit_after: 0")

    @property
    def task(self) -> Task:
        """What the model learns from: "ratings" (two_tower with mse), "clicks" (dlrm, two_tower with bce) or
        "text" (word2vec). Defaults (KIND_DEFAULTS) and eval metrics follow it."""
        if self.model.kind == "word2vec":
            return "text"
        return "ratings" if self.ratings else "clicks"

    @property
    def ratings(self) -> bool:
        """Whether labels are real-valued ratings (two_tower with mse), not 0/1."""
        return self.model.kind == "two_tower" and self.model.loss == "mse"

    @property
    def eval_metrics(self) -> frozenset[str]:
        """The metrics every eval of this model reports."""
        if self.ratings:
            return frozenset({"rmse", "mae", "loss"})
        metrics = {"auc", "log_loss", "loss"}
        if self.model.kind == "two_tower":
            metrics.add("recall_at_k")
        if self.model.kind == "word2vec" and self.evaluation.analogies_uri:
            metrics.add("analogy_accuracy")
        return frozenset(metrics)

    @property
    def best_metric(self) -> tuple[str, bool]:
        """(the metric that decides the best checkpoint, whether higher is better)."""
        metric = self.evaluation.metric
        if metric == "auto":
            metric = "rmse" if self.ratings else "analogy_accuracy" if self.evaluation.analogies_uri else "auc"
        return metric, metric in HIGHER_IS_BETTER


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
