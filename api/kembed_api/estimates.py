"""Back-of-the-envelope sizes of a job, shown at submission and used to refuse jobs that cannot fit.

One estimate, one place: the answer's `estimates`, the check at submission against `resources.memory_per_node`
and the local backend's check against this machine all read `memory_per_rank`. It counts what grows with the
config (tables, optimizer state, dense model, a step's batch, an eval's gathered scores, synthetic data's per-id
tables, table and text data's shuffle windows, text data's vocabulary counts: never the data's own size, as it is
streamed), not the interpreter and libraries every rank also loads (`_BASELINE_BYTES`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kembed_contract import runtime
from kembed_contract.trainer_config import TrainerConfig

__all__ = ["MemoryEstimate", "memory_per_rank", "table_memory_bytes_per_rank"]

_BYTES_PER_FLOAT = 4
_BYTES_PER_ID = 8  # ids are int64
# Dense parameters are held as weights, gradients and Adam's two moments: 4 floats each.
_FLOATS_PER_DENSE_PARAMETER = 4
# A step holds each activation about three times: the forward value kept for the backward, its gradient, and a
# temporary of the kernels.
_ACTIVATION_COPIES = 3
# The synthetic generator's per-id tables for each feature: a float64 CDF, an int64 scramble, a float32 score
# and a float32 factor of 4 (kembed_trainer.data.synthetic).
_SYNTHETIC_BYTES_PER_ID = 8 + 8 + 4 + 4 * 4
_SYNTHETIC_EVAL_CHUNK = 2048
_BASELINE_BYTES = 256 * 2**20  # Python, torch and the trainer's code in each rank (about 250 MiB measured)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank needs, by what needs them."""

    tables: int  # embedding weights and sparse-optimizer state
    dense: int  # the dense model with its gradients and optimizer state
    batch: int  # one training step's ids, pooled embeddings and activations
    eval: int  # an eval's scores and labels, gathered on every rank, and one eval batch
    data: int  # what the data source keeps per id (synthetic data only)
    baseline: int = _BASELINE_BYTES

    @property
    def total(self) -> int:
        return self.tables + self.dense + self.batch + self.eval + self.data + self.baseline

    def describe(self) -> str:
        parts = ", ".join(f"{name} {_gib(getattr(self, name))}"
                          for name in ("tables", "dense", "batch", "eval", "data", "baseline"))
        return f"{_gib(self.total)} per rank ({parts})"


_TABLE_WINDOWS = 3
# A word counted by text data's vocabulary pass: its string, the counter's entry and count (about 100 bytes
# measured for short words), with room for the dict's growth.
_BYTES_PER_COUNTED_WORD = 128


def _gib(num_bytes: float) -> str:
    """`1.50 GiB`, `12.0 MiB`, `180 KiB`: the unit that reads best."""
    if num_bytes >= 2**30:
        return f"{num_bytes / 2**30:.2f} GiB"
    if num_bytes >= 2**20:
        return f"{num_bytes / 2**20:.1f} MiB"
    return f"{num_bytes / 2**10:.0f} KiB"


def table_memory_bytes_per_rank(trainer: TrainerConfig, *, world_size: int = 1) -> int:
    """Weights plus sparse-optimizer state one rank holds: replicated tables whole, row-wise sharded ones
    1/world_size of their rows (rounded up, as the trainer splits them)."""
    state = runtime.OPTIMIZER_STATE_FLOATS[trainer.optimizer.sparse.name]
    total = 0.0
    for table in trainer.embeddings.tables:
        rows = table.num_embeddings
        if trainer.embeddings.is_sharded(table):
            rows = -(-rows // world_size)
        total += rows * table.embedding_dim * (1.0 + state(table.embedding_dim)) * _BYTES_PER_FLOAT
    return int(total)


def _dense_layers(trainer: TrainerConfig) -> list[int]:
    """The widths the dense model's layers go through, input first (one list per tower laid end to end)."""
    model, data = trainer.model, trainer.data
    dims = sorted({t.embedding_dim for t in trainer.embeddings.tables})
    num_features = len(trainer.embeddings.features)
    if model.kind == "dlrm":
        vectors = num_features + (1 if data.num_dense else 0)
        top_in = vectors * (vectors - 1) // 2 + (dims[0] if data.num_dense else 0)
        bottom = [data.num_dense, *model.bottom_mlp] if data.num_dense else []
        return [*bottom, top_in, *model.top_mlp, 1]
    if model.kind == "two_tower" and model.tower_mlp:
        tower = [dims[0], *model.tower_mlp]
        return tower + tower
    return []


def _parameters(layers: list[int]) -> int:
    return sum(n_in * n_out + n_out for n_in, n_out in zip(layers, layers[1:], strict=False))


def _hotness(trainer: TrainerConfig) -> int:
    data = trainer.data
    if data.kind == "synthetic":
        return data.max_hotness
    if data.kind == "text":
        return 2 * data.window * (1 + data.negatives)  # (center, context) pairs and noise words per token
    return 1  # table data: one id per column unless multi-hot, which the config cannot tell


def _eval_bytes(trainer: TrainerConfig, *, width: int, hot: int) -> int:
    """What an evaluation holds at its peak: what is gathered of the held-out set (where its size is known:
    synthetic data), one eval batch, and one chunk of a score matrix (runtime.EVAL_SCORE_CHUNK_BYTES, with its
    comparison's booleans) where a metric ranks against every candidate."""
    total = 0
    num_features = len(trainer.embeddings.features)
    ranks_candidates = "recall_at_k" in trainer.eval_metrics or trainer.model.kind == "word2vec"
    if ranks_candidates:
        total += runtime.EVAL_SCORE_CHUNK_BYTES + runtime.EVAL_SCORE_CHUNK_BYTES // _BYTES_PER_FLOAT
    if trainer.data.kind == "synthetic":
        rows = trainer.data.eval_samples
        # Scores and labels of the whole held-out set end up on every rank (all-gather), with the list they
        # came from; one chunk of inputs.
        total += rows * 2 * _BYTES_PER_FLOAT * 2
        total += _SYNTHETIC_EVAL_CHUNK * num_features * hot * (_BYTES_PER_ID + width * _BYTES_PER_FLOAT)
        if "recall_at_k" in trainer.eval_metrics:
            # Each row's user and item encodings and item bias, gathered (with the padded copies all_gather
            # makes), and the distinct items taken from them.
            total += rows * (2 * width + 1) * _BYTES_PER_FLOAT * 2 + rows * (width + 1) * _BYTES_PER_FLOAT * 2
    if trainer.model.kind == "word2vec":
        # The unit-length copy of the input vectors that neighbours and analogies are scored against.
        total += max(t.num_embeddings * t.embedding_dim for t in trainer.embeddings.tables) * _BYTES_PER_FLOAT
    return total


def memory_per_rank(trainer: TrainerConfig, *, world_size: int = 1) -> MemoryEstimate:
    batch_size = trainer.training.batch_size
    num_features = len(trainer.embeddings.features)
    width = max(t.embedding_dim for t in trainer.embeddings.tables)
    hot = _hotness(trainer)
    layers = _dense_layers(trainer)

    ids = batch_size * num_features * hot * _BYTES_PER_ID * 2  # the ids, and their exchange or dedup copy
    pooled = batch_size * num_features * width * _BYTES_PER_FLOAT * _ACTIVATION_COPIES
    # The sparse gradient: a row for each id the batch touched (at most one per id looked up).
    sparse_grad = batch_size * num_features * hot * width * _BYTES_PER_FLOAT * 2
    activations = batch_size * (sum(layers) + trainer.data.num_dense) * _BYTES_PER_FLOAT * _ACTIVATION_COPIES
    batch = ids + pooled + sparse_grad + activations

    eval_bytes, data_bytes = _eval_bytes(trainer, width=width, hot=hot), 0
    if trainer.data.kind == "synthetic":
        data_bytes = sum(t.num_embeddings * len(t.features) for t in trainer.embeddings.tables)
        data_bytes *= _SYNTHETIC_BYTES_PER_ID
    elif trainer.data.kind == "table":
        # Table data is streamed, whatever its size: the reader holds shuffle windows (one being read, one queued,
        # one being trained on; kembed_trainer.data.table) of float32 label and dense values, and per id its
        # int64 value and offset.
        row = (trainer.data.num_dense + 1) * _BYTES_PER_FLOAT + num_features * hot * _BYTES_PER_ID * 2
        data_bytes = _TABLE_WINDOWS * trainer.data.shuffle_buffer * row
    elif trainer.data.kind == "text":
        # Text data is streamed too: three shuffle windows of word ids (each with its permuted copy), and while
        # the vocabulary pass runs, its counts of at most max_vocab_size words.
        data_bytes = _TABLE_WINDOWS * trainer.data.shuffle_buffer * _BYTES_PER_ID * 2
        data_bytes += trainer.data.max_vocab_size * _BYTES_PER_COUNTED_WORD

    return MemoryEstimate(
        tables=table_memory_bytes_per_rank(trainer, world_size=world_size),
        dense=_parameters(layers) * _FLOATS_PER_DENSE_PARAMETER * _BYTES_PER_FLOAT,
        batch=int(batch), eval=int(eval_bytes), data=int(data_bytes),
    )
