"""`word2vec`: skip-gram with negative sampling, trained on sentences (docs/trainer.md#word2vec). Its trainer half:
`kembed_trainer.models.word2vec`, which trains in compiled code on CPU, straight on the tables."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from kembed_contract import runtime
from kembed_contract.kinds.base import BYTES_PER_FLOAT, SENTENCES, ModelKind

if TYPE_CHECKING:
    from kembed_contract.trainer_config import TrainerConfig

__all__ = ["CENTER", "CONTEXT", "KIND", "TEXT", "Word2VecConfig"]

CENTER, CONTEXT = "center", "context"  # the features of its two tables: input and output vectors
TEXT = "text"  # its task: it learns from sentences, not labels


class Word2VecConfig(ModelKind):
    """Skip-gram with negative sampling: logit = dot(input vector of the center word, output vector of a
    context or noise word). Needs `data.kind: text` and two tables, for the features `center` and `context`."""

    kind: Literal["word2vec"] = "word2vec"

    trains_on: ClassVar[str] = SENTENCES
    has_vocabulary: ClassVar[bool] = True
    cpu_only: ClassVar[bool] = True
    # Its compiled trainer writes the tables directly, past the changed-row tracking deltas rely on.
    incremental_checkpoints: ClassVar[bool] = False
    # The original word2vec tool's formats, which gensim's `KeyedVectors.load_word2vec_format` reads.
    export_formats: ClassVar[Mapping[str, str]] = {"word2vec-text": ".txt", "word2vec-binary": ".bin"}
    docs: ClassVar[str] = "trainer.md#word2vec"
    defaults_by_task: ClassVar = {
        # gensim's Word2Vec defaults (vector_size 100, 5 epochs, alpha 0.025 falling to min_alpha 0.0001); the
        # text data's own defaults are gensim's too (window 5, negative 5, min_count 5, sample 1e-3).
        TEXT: {
            "training.batch_size": 10_000,
            "training.epochs": 5,
            "embeddings.tables.embedding_dim": 100,
            "optimizer.sparse.name": "sgd",
            "optimizer.sparse.lr": 0.025,
            "optimizer.sparse.min_lr": 0.0001,
        },
    }

    @property
    def task(self) -> str:
        return TEXT

    def check(self, cfg: TrainerConfig) -> None:
        """Two tables, `center` and `context`, of one width; and what its compiled trainer needs: per-sample SGD
        straight on whole replicated tables, whose rows are the vocabulary's indices, on CPU."""
        by_feature = {f: t for t in cfg.embeddings.tables for f in t.features}
        if set(by_feature) != {CENTER, CONTEXT} or by_feature[CENTER] is by_feature[CONTEXT]:
            raise ValueError("word2vec: needs two tables, one with feature 'center', one with 'context'")
        if by_feature[CENTER].embedding_dim != by_feature[CONTEXT].embedding_dim:
            raise ValueError("word2vec: the center and context tables need the same embedding_dim")
        if cfg.optimizer.sparse.name != "sgd":
            raise ValueError(
                f"optimizer.sparse.name: word2vec trains with 'sgd' (hogwild, as word2vec and gensim), "
                f"got {cfg.optimizer.sparse.name!r}"
            )
        if cfg.distributed.backend == "nccl":
            raise ValueError("distributed.backend: word2vec trains on CPU cores; use 'auto' or 'gloo'")
        for i, t in enumerate(cfg.embeddings.tables):
            if cfg.embeddings.is_sharded(t):
                raise ValueError(
                    f"embeddings.tables.{i}: word2vec tables are replicated; set sharding: replicated")
            if t.raw_ids or t.admit_after:
                raise ValueError(
                    f"embeddings.tables.{i}: word2vec rows are vocabulary indices; set hash_ids: false, "
                    "admit_after: 0 and no dynamic section")

    def eval_metrics(self, cfg: TrainerConfig) -> frozenset[str]:
        """True against noise pairs (auc, log_loss), and with analogies their accuracy."""
        metrics = super().eval_metrics(cfg)
        return metrics | {"analogy_accuracy"} if cfg.evaluation.analogies_uri else metrics

    def auto_metric(self, cfg: TrainerConfig) -> str:
        return "analogy_accuracy" if cfg.evaluation.analogies_uri else "auc"

    def eval_bytes(self, cfg: TrainerConfig, *, width: int, eval_rows: int | None) -> int:
        """Neighbours and analogies score one chunk of questions x vocabulary at a time
        (runtime.EVAL_SCORE_CHUNK_BYTES, with its comparison's booleans), against a unit-length copy of the input
        vectors."""
        chunk = runtime.EVAL_SCORE_CHUNK_BYTES + runtime.EVAL_SCORE_CHUNK_BYTES // BYTES_PER_FLOAT
        return chunk + max(t.num_embeddings * t.embedding_dim for t in cfg.embeddings.tables) * BYTES_PER_FLOAT

    @classmethod
    def default_table(cls, tables: Sequence[Mapping[str, Any]]) -> str:
        """The input (center) vectors: the word vectors users mean."""
        return next(t["name"] for t in tables if CENTER in t["features"])


KIND = Word2VecConfig
