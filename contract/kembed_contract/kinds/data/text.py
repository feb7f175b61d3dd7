"""`text` data: a tokenised corpus, one sentence per line (docs/trainer.md#text). Its trainer half:
`kembed_trainer.data.text`."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field

from kembed_contract.fields import MAX_INT32, Fraction, PositiveInt, ReadUri, bounded_float, bounded_int
from kembed_contract.kinds.base import BYTES_PER_ID, SENTENCES, STREAM_WINDOWS, DataKind

if TYPE_CHECKING:
    from kembed_contract.trainer_config import TrainerConfig

__all__ = ["KIND", "TextDataConfig"]

# A word counted by the vocabulary pass: its string, the counter's entry and count (about 100 bytes measured for
# short words), with room for the dict's growth.
_BYTES_PER_COUNTED_WORD = 128


class TextDataConfig(DataKind):
    """A tokenised corpus for word vectors: one sentence per line, tokens separated by whitespace.

    Text without spaces between words (Chinese, Japanese) can be split per character with `tokenizer: chars`.
    The vocabulary is built from the corpus in one streaming pass: words seen at least `min_count` times, the most
    frequent first, at most the tables' num_embeddings. Training streams the sentences (never held whole).
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
    shuffle_buffer: bounded_int(1, 1 << 30) = Field(
        1 << 20, description="Words shuffled together: each epoch orders the corpus's blocks of lines anew, then "
        "permutes the sentences of each window of about this many words. Memory: about three windows of words.")
    max_vocab_size: bounded_int(2, MAX_INT32) = Field(
        4_000_000, description="Distinct words the vocabulary pass counts at most (gensim's max_vocab_size): past "
        "it the rarest are dropped, those seen once first, and counting goes on. Memory: about 100 bytes a word.")

    yields: ClassVar[str] = SENTENCES
    docs: ClassVar[str] = "trainer.md#text"

    @property
    def num_dense(self) -> int:
        return 0

    def ids_per_feature(self, cfg: TrainerConfig) -> int:
        """(center, context) pairs and noise words per token."""
        return 2 * self.window * (1 + self.negatives)

    def memory_bytes(self, cfg: TrainerConfig, *, ids_per_feature: int) -> int:
        """Streamed too: three shuffle windows of word ids (each with its permuted copy), and while the vocabulary
        pass runs, its counts of at most max_vocab_size words."""
        return STREAM_WINDOWS * self.shuffle_buffer * BYTES_PER_ID * 2 + self.max_vocab_size * _BYTES_PER_COUNTED_WORD


KIND = TextDataConfig
