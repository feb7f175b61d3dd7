"""`text` data: a tokenised corpus, one sentence per line (docs/trainer.md#text). Its trainer half:
`kembed_trainer.data.text`."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field

from kembed_contract.fields import Fraction, PositiveInt, ReadUri, bounded_float, bounded_int
from kembed_contract.kinds.base import SENTENCES, DataKind

if TYPE_CHECKING:
    from kembed_contract.trainer_config import TrainerConfig

__all__ = ["KIND", "TextDataConfig"]


class TextDataConfig(DataKind):
    """A tokenised corpus for word vectors: one sentence per line, tokens separated by whitespace.

    Text without spaces between words (Chinese, Japanese) can be split per character with `tokenizer: chars`.
    The vocabulary is built from the corpus: words seen at least `min_count` times, the most frequent first,
    at most the tables' num_embeddings.
    """

    kind: Literal["text"] = "text"
    uri: ReadUri
    tokenizer: Literal["whitespace", "chars"] = "whitespace"
    min_count: PositiveInt = Field(5, description="Words seen fewer times are left out (gensim's default).")
    window: bounded_int(1, 1000) = Field(5, description="Context words on each side of the center word.")
    negatives: bounded_int(1, 1000) = Field(5, description="Noise words per (center, context) pair.")
    subsample: bounded_float(ge=0, le=1) = Field(
        1e-3, description="Frequent-word subsampling threshold t (Mikolov et al.); 0 = off."
    )
    eval_fraction: Fraction = Field(
        0.01, description="Sentences held out for the eval loss/AUC of true vs noise pairs."
    )

    yields: ClassVar[str] = SENTENCES
    docs: ClassVar[str] = "trainer.md#text"

    @property
    def num_dense(self) -> int:
        return 0

    def ids_per_feature(self, cfg: TrainerConfig) -> int:
        """(center, context) pairs and noise words per token."""
        return 2 * self.window * (1 + self.negatives)


KIND = TextDataConfig
