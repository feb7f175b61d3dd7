"""A text corpus (one sentence per line, UTF-8) for word vectors, streamed: memory does not grow with the corpus.

Units are blocks of about `TEXT_BLOCK_BYTES` of whole lines of each file (`units.line_blocks`). One pass at start,
the same on every rank, reads each block once: it counts the block's sentences and the words of its training
sentences (the vocabulary), keeps a bounded sample of held-out sentences for eval, and fails on text that is not
UTF-8, naming the file and line (never the bytes). Every rank counts the whole corpus rather than a share whose
counts are then combined: the vocabulary is the same everywhere by construction, with no collective and nothing
serialised between ranks, and the sentence counts the epoch plan needs come from the same pass (as table data's
CSV listing, every rank reads the data once at start).

Training streams the training sentences through `stream.Stream`, the code table data streams rows with: each
epoch orders the blocks anew and permutes the sentences of each window of about `shuffle_buffer` words; each
rank reads, in a background thread, only the windows its share touches; the position is part of every
checkpoint, so a resume mid-epoch continues the epoch at any world size. A step is about `batch_size` words of
whole sentences: `batch_size` times the corpus's sentences per word, rounded (at least one sentence), so an
epoch visits each training sentence once. The model kind's compiled step asks each step's
sentences as token ids and offsets (`train_sentences`) and draws windows, subsamples frequent words and draws
noise words with the tables made here.

A sentence is a line of two or more tokens (one token holds no pair); a line of more than `MAX_SENTENCE_WORDS`
tokens is trained as sentences of at most that many (gensim's limit), and a line longer than a block is first cut
at a space. Held out for eval: the lines whose number among the corpus's lines with a token (files in sorted
order) hashes below `eval_fraction`, the same lines on every run, at any world size, as the in-memory reader held
out before.

Vocabulary: the counts of the training sentences' words, at most `max_vocab_size` distinct words after each block
(a block adds at most its own distinct words): past it, the words seen at most once are dropped, then (at the next overflow) at most twice, and so
on, as gensim's max_vocab_size does; a dropped word counts again from 0. Below the bound the counts are exact.
Words seen at least `min_count` times, by count then code points, the first `num_embeddings` of them.

Eval batches are (center, context) pairs of held-out sentences, each followed by `negatives` noise pairs drawn
from the unigram distribution to the power 3/4: the eval AUC tells true context from noise. The held-out
sentences are a sample of at most `_EVAL_SAMPLE_CHARS` characters: those whose hash is smallest (all of them in
a smaller corpus).
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
import math

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from kembed_contract import trainer_config as config
from kembed_trainer.data import prefetch, rows, stream, units
from kembed_trainer.data.batch import Batch
from kembed_trainer.data.rows import unit_hash
from kembed_trainer.data.synthetic import _generator
from kembed_trainer.storage import Guard

__all__ = ["MAX_SENTENCE_WORDS", "TEXT_BLOCK_BYTES", "TextData", "build", "tokenize"]

TEXT_BLOCK_BYTES = 4 << 20
MAX_SENTENCE_WORDS = 10_000
_NEWLINE = b"\n"
_EVAL_SAMPLE_CHARS = 4 << 20
_EVAL_CHUNKS, _EVAL_PAIRS = 4, 1024
_WHERE = "data.uri"


def tokenize(line: str, tokenizer: str) -> list[str]:
    """A line's tokens, in Python: what the blocks' Arrow kernels (`_sentences`) give, one line at a time."""
    if tokenizer == "chars":  # scripts written without spaces: each character is a token
        return list("".join(line.split()))
    return line.split()


@dataclasses.dataclass(frozen=True)
class Block:
    """A unit of text: whole lines of one file."""

    uri: str
    byte_range: tuple[int, int]
    first_line: int  # the file's line number of its first line, for messages
    first_sentence: int  # the corpus's number of its first non-empty line: the held-out hash's key
    num_sentences: int  # its non-empty lines

    def where(self, num_lines: int) -> str:
        return f"{self.uri} lines {self.first_line}..{self.first_line + max(num_lines, 1) - 1}"


@dataclasses.dataclass
class _Sentences:
    """A block's sentences (its lines with a token): their text, their tokens laid end to end, and how many each."""

    lines: pa.StringArray
    tokens: pa.StringArray
    lengths: np.ndarray  # int64, tokens per sentence

    def select(self, mask: np.ndarray) -> _Sentences:
        return _Sentences(self.lines.filter(pa.array(mask)), self.tokens.filter(pa.array(np.repeat(mask, self.lengths))),
                          self.lengths[mask])


def _sentences(data: bytes, uri: str, first_line: int, tokenizer: str) -> _Sentences:
    """A block's sentences, split into lines as Python's text files split them (`\\n`, `\\r\\n` or `\\r`) and into
    tokens as `tokenize` does, by Arrow's kernels (their whitespace is Python's), which hold no GIL and touch each
    token in C++, not in Python, while training runs."""
    try:
        text = pa.array([data], pa.binary()).cast(pa.string())  # checks the UTF-8
    except pa.ArrowInvalid:
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as error:  # its message quotes the bytes: name the file and the line only
            line = first_line + data.count(b"\n", 0, error.start)
            raise ValueError(f"{_WHERE}: {uri} line {line} is not UTF-8 text") from None
        raise
    if b"\r" in data:
        text = pc.replace_substring(pc.replace_substring(text, "\r\n", "\n"), "\r", "\n")
    lines = pc.split_pattern(text, "\n").flatten()
    words = pc.utf8_split_whitespace(lines)  # one split per whitespace character: runs leave empty tokens
    flat = words.flatten()
    real = pc.greater(pc.binary_length(flat), 0).to_numpy(zero_copy_only=False)
    known = np.concatenate([[0], np.cumsum(real)])
    bounds = words.offsets.to_numpy()
    per_line = known[bounds[1:]] - known[bounds[:-1]]
    has_token = per_line > 0
    tokens, lengths = flat.filter(pa.array(real)), per_line[has_token]
    if tokenizer == "chars":  # scripts written without spaces: each character is a token
        tokens, lengths = _characters(tokens, lengths)
    return _Sentences(lines.filter(pa.array(has_token)), tokens, lengths.astype(np.int64))


def _characters(tokens: pa.StringArray, lengths: np.ndarray) -> tuple[pa.StringArray, np.ndarray]:
    """The tokens' characters as tokens (a UTF-8 character starts at every byte that is not 10xxxxxx), and how
    many each sentence has."""
    if len(tokens) == 0:
        return tokens, lengths
    offsets = np.frombuffer(tokens.buffers()[1], np.int32)[tokens.offset : tokens.offset + len(tokens) + 1]
    data = tokens.buffers()[2]
    body = np.frombuffer(data, np.uint8)[offsets[0] : offsets[-1]]
    starts = (offsets[0] + np.flatnonzero((body & 0xC0) != 0x80)).astype(np.int32)
    chars = pa.StringArray.from_buffers(len(starts), pa.py_buffer(np.append(starts, offsets[-1])), data)
    per_token = np.searchsorted(starts, offsets)  # characters before each token's start
    sentence_ends = per_token[np.cumsum(lengths)]
    return chars, np.diff(np.concatenate([[0], sentence_ends]))


def _pieces(lengths: np.ndarray) -> np.ndarray:
    """How many sentences lines of these many tokens train as: MAX_SENTENCE_WORDS tokens each, the last the rest,
    those of fewer than two tokens left out (they hold no pair)."""
    return lengths // MAX_SENTENCE_WORDS + (lengths % MAX_SENTENCE_WORDS >= 2)


class _WordCounts:
    """The training sentences' word counts, at most `limit` distinct words after each block."""

    def __init__(self, limit: int) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.limit, self.floor = limit, 0

    def add(self, tokens: pa.StringArray) -> None:
        found = pc.value_counts(tokens)  # in C++: Python touches each distinct word once, not each token
        self.counts.update(dict(zip(found.field(0).to_pylist(), found.field(1).to_pylist(), strict=True)))
        while len(self.counts) > self.limit:
            self.floor += 1
            for word in [w for w, c in self.counts.items() if c <= self.floor]:
                del self.counts[word]


class _HeldOutSample:
    """The held-out lines of smallest hash whose characters fit `budget`: a uniform sample, whatever the order
    lines come in (every one of them when they fit)."""

    def __init__(self, budget: int) -> None:
        self.budget, self.size, self.limit = budget, 0, math.inf
        self.heap: list[tuple[float, int, str]] = []  # (-hash, line number, line): the largest hash on top

    def add(self, key: float, number: int, line: str) -> None:
        if key >= self.limit:
            return
        heapq.heappush(self.heap, (-key, number, line))
        self.size += len(line)
        while self.size > self.budget:
            negative, _, dropped = heapq.heappop(self.heap)
            self.size -= len(dropped)
            self.limit = -negative  # what was dropped for lack of room: nothing at or above it is kept

    def lines(self) -> list[str]:
        """In corpus order."""
        return [line for _, _, line in sorted(self.heap, key=lambda entry: entry[1])]


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


class TextData(stream.StreamedData):
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
        self.cfg, self.seed, self.rank, self.world_size, self.guard = cfg, seed, rank, world_size, guard
        self.features = [f for t in sorted(tables, key=lambda t: t.embedding_dim) for f in t.features]
        counts, held_out = self._scan(guard.list_files(cfg.uri, where=_WHERE))
        self.vocab, freq = _vocabulary(counts.counts, cfg.min_count, min(t.num_embeddings for t in tables))
        del counts  # the vocabulary's words only from here
        if len(self.vocab) < 2:
            raise ValueError(f"{_WHERE}: fewer than 2 words in the vocabulary of {cfg.uri}")
        self.index = {w: i for i, w in enumerate(self.vocab)}
        self.num_tokens = int(freq.sum())  # in-vocabulary words of the training sentences
        noise = freq.pow(0.75)
        self.noise_cdf = torch.cumsum(noise / noise.sum(), 0)
        f = freq / freq.sum()
        t = cfg.subsample
        self.keep_prob = (torch.sqrt(t / f) + t / f).clamp(max=1.0) if t > 0 else torch.ones_like(f)
        self.eval = self._eval_corpus(held_out)
        if self.num_sentences < world_size:
            raise ValueError(f"{_WHERE}: {self.num_sentences} training sentences in {cfg.uri}, fewer than the "
                             f"{world_size} ranks")
        per_word = self.num_sentences / self.num_tokens
        self.stream = stream.Stream(
            self.train_counts, self._open_units, seed=seed, rank=rank, world_size=world_size,
            batch_size=max(1, round(batch_size * per_word)), window=max(1, round(cfg.shuffle_buffer * per_word)))

    # ------------------------------------------------------------------------------------------- the pass
    def _scan(self, files: list[str]) -> tuple[_WordCounts, _HeldOutSample]:
        """One pass over the corpus: the blocks and their training sentences, the word counts, held-out lines."""
        counts = _WordCounts(self.cfg.max_vocab_size)
        held_out = _HeldOutSample(_EVAL_SAMPLE_CHARS)
        self.blocks: list[Block] = []
        train_counts, number, self.num_eval_sentences = [], 0, 0
        for uri in files:
            with self.guard.open(uri, "rb", where=_WHERE) as f:
                blocks = prefetch.Prefetcher(units.line_blocks(f, TEXT_BLOCK_BYTES, cut_long_lines=True), depth=2,
                                             name="vocabulary-reader")
                try:
                    line = 1
                    for offset, data in blocks:
                        sentences = _sentences(data, uri, line, self.cfg.tokenizer)
                        n = len(sentences.lengths)
                        keys = unit_hash(np.arange(number, number + n, dtype=np.uint64))
                        held = keys < self.cfg.eval_fraction
                        trained = sentences.select(~held) if held.any() else sentences
                        counts.add(trained.tokens)
                        train_counts.append(int(_pieces(trained.lengths).sum()))
                        for i in np.flatnonzero(held).tolist():
                            held_out.add(float(keys[i]), number + i, sentences.lines[i].as_py())
                        self.num_eval_sentences += int(held.sum())
                        self.blocks.append(Block(uri, (offset, offset + len(data)), line, number, n))
                        number += n
                        line += data.count(b"\n")
                finally:
                    blocks.close()
        self.train_counts = np.array(train_counts, dtype=np.int64)
        self.num_sentences = int(self.train_counts.sum())
        return counts, held_out

    def _eval_corpus(self, held_out: _HeldOutSample) -> _Corpus:
        """The held-out sample, subsampled once as training subsamples its sentences: eval pairs are drawn like
        the pairs the model was trained to tell from noise."""
        lines = held_out.lines()
        sample = self._sentence_rows(_sentences("\n".join(lines).encode(), "", 1, self.cfg.tokenizer)
                                     if lines else None)
        tokens, offsets = torch.from_numpy(sample.values[0]), sample.offsets[0]
        gen = _generator(self.seed, 7)
        kept = []
        for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True):
            if a < b:
                s = tokens[a:b]
                kept.append(s[torch.rand(b - a, generator=gen, dtype=torch.float64) < self.keep_prob[s]].tolist())
        return _Corpus(kept)

    # ------------------------------------------------------------------------------------------- sizes
    def counts(self) -> dict[str, int]:
        """This rank's share of the corpus's size (summed over ranks for the report)."""
        w, r = self.world_size, self.rank
        share = lambda n: (r + 1) * n // w - r * n // w  # noqa: E731
        return {"train_sentences": share(self.num_sentences), "train_tokens": share(self.num_tokens),
                "eval_sentences": share(self.num_eval_sentences)}

    # ------------------------------------------------------------------------------------------- training
    def train_sentences(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """This rank's sentences of global `step`: their word ids (vocabulary rows, int64) and offsets (sentence i
        is ids[offsets[i]:offsets[i + 1]]). Steps are taken in order (a jump, as a resume, restarts the reader)."""
        taken = self.stream.take(step)
        return taken.values[0], taken.offsets[0]

    def _open_units(self) -> _TrainingSentences:
        return _TrainingSentences(self)

    def _sentence_rows(self, sentences: _Sentences | None) -> rows.Rows:
        """Sentences (`_pieces` of them) as rows of one jagged feature: their in-vocabulary word ids."""
        if sentences is None or len(sentences.tokens) == 0:
            return rows.Rows(np.zeros((0, 0), np.float32), np.zeros(0, np.float32), [np.zeros(1, np.int64)],
                             [np.zeros(0, np.int64)])
        # Each distinct word of the block looked up once, in Python; the tokens get their ids in NumPy.
        encoded = pc.dictionary_encode(sentences.tokens)
        distinct = encoded.dictionary.to_pylist()
        rows_of = np.fromiter(map(self.index.get, distinct, itertools.repeat(-1)), np.int64, len(distinct))
        ids = rows_of[encoded.indices.to_numpy(zero_copy_only=False)]
        lengths = sentences.lengths
        if lengths.max() > MAX_SENTENCE_WORDS:
            lengths = np.concatenate([_cut(int(n)) for n in lengths])
        trained = lengths >= 2
        keep = (ids >= 0) & np.repeat(trained, lengths)
        known = np.concatenate([[0], np.cumsum(keep)])
        ends = np.cumsum(lengths)[trained]
        kept = known[ends] - known[ends - lengths[trained]]
        n = len(kept)
        return rows.Rows(np.zeros((n, 0), np.float32), np.zeros(n, np.float32),
                         [np.concatenate([[0], np.cumsum(kept)]).astype(np.int64)], [ids[keep]])

    # ------------------------------------------------------------------------------------------- eval
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


def _vocabulary(counts: collections.Counter[str], min_count: int, size: int) -> tuple[list[str], torch.Tensor]:
    """Words seen at least `min_count` times, by count then code points, at most `size`; and their counts."""
    words = sorted((w for w, c in counts.items() if c >= min_count), key=lambda w: (-counts[w], w))[:size]
    return words, torch.tensor([counts[w] for w in words], dtype=torch.float64)


def _cut(num_tokens: int) -> np.ndarray:
    """A long line's pieces' lengths: MAX_SENTENCE_WORDS tokens each, the last the rest."""
    whole, rest = divmod(num_tokens, MAX_SENTENCE_WORDS)
    return np.array([MAX_SENTENCE_WORDS] * whole + ([rest] if rest else []), dtype=np.int64)


class _TrainingSentences:
    """A block's training sentences, for the stream's reader thread: read again, checked against the pass."""

    def __init__(self, data: TextData) -> None:
        self.data = data

    def read(self, index: int) -> rows.Rows:
        data, block = self.data, self.data.blocks[index]
        start, end = block.byte_range
        with data.guard.open(block.uri, "rb", where=_WHERE) as f:  # checked again: the file may have changed
            f.seek(start)
            raw = f.read(end - start)
        sentences = _sentences(raw, block.uri, block.first_line, data.cfg.tokenizer)
        where = f"{_WHERE}: {block.where(raw.count(_NEWLINE))} changed while the job ran"
        if len(sentences.lengths) != block.num_sentences:
            raise ValueError(where)
        if data.cfg.eval_fraction > 0:
            number = np.arange(block.first_sentence, block.first_sentence + block.num_sentences, dtype=np.uint64)
            sentences = sentences.select(unit_hash(number) >= data.cfg.eval_fraction)
        converted = data._sentence_rows(sentences)
        if converted.num_rows != data.train_counts[index]:
            raise ValueError(where)
        return converted

    def close(self) -> None:
        pass


def build(cfg: config.TrainerConfig, *, rank: int, world_size: int, guard: Guard) -> TextData:
    """The source of `cfg.data` (the data registry's entry, kembed_trainer.kinds)."""
    return TextData(cfg.data, tables=cfg.embeddings.tables, seed=cfg.training.seed,
                   batch_size=cfg.training.batch_size, rank=rank, world_size=world_size, guard=guard)
