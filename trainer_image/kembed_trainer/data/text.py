"""A text corpus (one sentence per line) for word vectors.

The vocabulary is built from the training sentences on every rank alike (most frequent first), so rows mean the
same word everywhere. Training reads the rank's sentences in order, `batch_size` words per step (whole
sentences: a sentence belongs to the step its first word falls in), one epoch after another; the compiled
trainer (the model kind's compiled step) draws windows, subsamples frequent words and draws noise words with
the tables made here. A step's sentences are a function of the step alone, so a resume needs no data state.

Eval batches are (center, context) pairs of held-out sentences, each followed by `negatives` noise pairs
drawn from the unigram distribution to the power 3/4: the eval AUC tells true context from noise.
"""

from __future__ import annotations

import collections

import numpy as np
import torch

from kembed_contract import trainer_config as config
from kembed_trainer.data.batch import Batch
from kembed_trainer.data.rows import unit_hash
from kembed_trainer.data.synthetic import _generator
from kembed_trainer.storage import Guard

__all__ = ["TextData", "tokenize"]

_EVAL_CHUNKS, _EVAL_PAIRS = 4, 1024


def tokenize(line: str, tokenizer: str) -> list[str]:
    if tokenizer == "chars":  # scripts written without spaces: each character is a token
        return [c for c in line if not c.isspace()]
    return line.split()


class _Corpus:
    """Token ids of the sentences kept (at least two in-vocabulary tokens), concatenated."""

    def __init__(self, sentences: list[list[int]]) -> None:
        kept = [s for s in sentences if len(s) >= 2]
        self.tokens = torch.tensor([t for s in kept for t in s], dtype=torch.int64)
        lengths = torch.tensor([len(s) for s in kept], dtype=torch.int64)
        ends = torch.cumsum(lengths, 0)
        self.offsets = torch.cat([torch.zeros(1, dtype=torch.int64), ends])  # sentence i: offsets[i]..[i+1]
        self.start = torch.repeat_interleave(ends - lengths, lengths)  # sentence start of each token
        self.end = torch.repeat_interleave(ends, lengths)


class TextData:
    def __init__(
        self,
        cfg: config.TextDataConfig,
        *,
        tables: list[config.TableConfig],
        seed: int,
        batch_size: int,
        rank: int,
        world_size: int,
        guard: Guard,
    ) -> None:
        self.cfg, self.seed, self.rank, self.world_size = cfg, seed, rank, world_size
        self.features = [f for t in sorted(tables, key=lambda t: t.embedding_dim) for f in t.features]
        max_vocab = min(t.num_embeddings for t in tables)
        sentences = []
        for uri in guard.list_files(cfg.uri, where="data.uri"):
            with guard.open(uri, "r", where="data.uri", encoding="utf-8") as f:
                try:
                    sentences.extend(tokens for line in f if (tokens := tokenize(line, cfg.tokenizer)))
                except UnicodeDecodeError:  # its message quotes the bytes: name the file only
                    raise ValueError(f"data.uri: {uri} is not UTF-8 text") from None
        is_eval = unit_hash(np.arange(len(sentences), dtype=np.uint64)) < cfg.eval_fraction
        counts = collections.Counter(t for s, e in zip(sentences, is_eval, strict=True) if not e for t in s)
        words = sorted((w for w, c in counts.items() if c >= cfg.min_count), key=lambda w: (-counts[w], w))
        self.vocab = words[:max_vocab]
        if len(self.vocab) < 2:
            raise ValueError(f"data.uri: fewer than 2 words in the vocabulary of {cfg.uri}")
        index = {w: i for i, w in enumerate(self.vocab)}
        ids = [[index[t] for t in s if t in index] for s in sentences]
        train = [s for s, e in zip(ids, is_eval, strict=True) if not e]
        self.train = _Corpus(train[rank::world_size] if len(train) >= world_size else train)
        if self.train.tokens.numel() == 0:
            raise ValueError(f"data.uri: no sentence of two or more known words for rank {rank}")
        freq = torch.tensor([counts[w] for w in self.vocab], dtype=torch.float64)
        noise = freq.pow(0.75)
        self.noise_cdf = torch.cumsum(noise / noise.sum(), 0)
        f = freq / freq.sum()
        t = cfg.subsample
        self.keep_prob = (torch.sqrt(t / f) + t / f).clamp(max=1.0) if t > 0 else torch.ones_like(f)
        # Held-out sentences subsampled once, as training subsamples its sentences: eval pairs are drawn
        # like the pairs the model was trained to tell from noise.
        gen = _generator(seed, 7)
        held_out = [torch.tensor(s, dtype=torch.int64) for s, e in zip(ids, is_eval, strict=True) if e and s]
        self.eval = _Corpus(
            [
                s[torch.rand(len(s), generator=gen, dtype=torch.float64) < self.keep_prob[s]].tolist()
                for s in held_out
            ]
        )
        self.words_per_step = batch_size
        self.sentence_starts = self.train.offsets[:-1].numpy()

    @property
    def steps_per_epoch(self) -> int:
        """Steps that read this rank's sentences once."""
        return -(-self.train.tokens.numel() // self.words_per_step)

    def train_sentences(self, step: int) -> tuple[int, int]:
        """The sentences (first, last + 1) of this rank's shard that `step` trains on."""
        chunk = step % self.steps_per_epoch
        lo, hi = chunk * self.words_per_step, (chunk + 1) * self.words_per_step
        first, last = np.searchsorted(self.sentence_starts, [lo, hi])
        return int(first), int(last)

    def counts(self) -> dict[str, int]:
        """This rank's share of the corpus's size (summed over ranks for the report; every rank holds the
        whole eval set, rank 0 counts it)."""
        return {
            "train_sentences": len(self.train.offsets) - 1,
            "train_tokens": int(self.train.tokens.numel()),
            "eval_sentences": len(self.eval.offsets) - 1 if self.rank == 0 else 0,
        }

    def eval_batches(self):
        if self.eval.tokens.numel() == 0:
            return
        for i in range(self.rank, _EVAL_CHUNKS, self.world_size):
            yield self._pairs(self.eval, _EVAL_PAIRS, _generator(self.seed, 5, i))

    def _pairs(self, corpus: _Corpus, num_pairs: int, gen: torch.Generator) -> Batch:
        pos = torch.randint(corpus.tokens.numel(), (num_pairs,), generator=gen)
        # A context word within a random window of 1..window on either side, reflected to stay in the sentence.
        reach = torch.randint(1, self.cfg.window + 1, (num_pairs,), generator=gen)
        offset = torch.randint(1, self.cfg.window + 1, (num_pairs,), generator=gen).minimum(reach)
        offset = torch.where(torch.rand(num_pairs, generator=gen) < 0.5, -offset, offset)
        ctx = pos + offset
        ctx = torch.where((ctx < corpus.start[pos]) | (ctx >= corpus.end[pos]), pos - offset, ctx)
        ctx = ctx.clamp(corpus.start[pos], corpus.end[pos] - 1)
        ctx = torch.where(ctx == pos, torch.where(pos > corpus.start[pos], pos - 1, pos + 1), ctx)
        k = self.cfg.negatives
        u = torch.rand(num_pairs * k, generator=gen, dtype=torch.float64)
        noise = torch.searchsorted(self.noise_cdf, u).clamp_(max=len(self.vocab) - 1)
        center_ids = corpus.tokens[pos].repeat_interleave(1 + k)
        context_ids = torch.cat([corpus.tokens[ctx].unsqueeze(1), noise.view(num_pairs, k)], 1).flatten()
        labels = torch.zeros(num_pairs, 1 + k)
        labels[:, 0] = 1
        n = center_ids.numel()
        by_feature = {"center": center_ids, "context": context_ids}
        return Batch(
            dense=torch.zeros(n, 0),
            values=torch.cat([by_feature[f] for f in self.features]),
            lengths=torch.ones(2 * n, dtype=torch.int64),
            labels=labels.flatten(),
        )


def build(cfg: config.TrainerConfig, *, rank: int, world_size: int, guard: Guard) -> TextData:
    """The source of `cfg.data` (the data registry's entry, kembed_trainer.kinds)."""
    return TextData(cfg.data, tables=cfg.embeddings.tables, seed=cfg.training.seed,
                    batch_size=cfg.training.batch_size, rank=rank, world_size=world_size, guard=guard)
