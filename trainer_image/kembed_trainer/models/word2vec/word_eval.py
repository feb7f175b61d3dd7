"""word2vec's intrinsic checks: the nearest neighbours of chosen words, and analogy accuracy (a : b :: c : d)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kembed_trainer import metrics
from kembed_trainer.storage import Guard

__all__ = ["WordEval"]


class WordEval:
    def __init__(self, vocab: list[str], *, neighbours_of: list[str], k: int, analogies_uri: str | None,
                 guard: Guard) -> None:
        """`guard`: the storage policy's door, through which the analogies file is opened like every other file."""
        self.vocab, self.k = vocab, k
        index = {w: i for i, w in enumerate(vocab)}
        self.queries = [(w, index[w]) for w in neighbours_of if w in index]
        self.questions = torch.empty(0, 4, dtype=torch.int64)
        self.num_questions = 0
        if analogies_uri:
            rows = []
            with guard.open(analogies_uri, "r", where="evaluation.analogies_uri", encoding="utf-8") as f:
                for line in f:
                    words = line.split()
                    if len(words) != 4 or line.startswith(":"):
                        continue
                    self.num_questions += 1
                    if all(w in index for w in words):
                        rows.append([index[w] for w in words])
            self.questions = torch.tensor(rows, dtype=torch.int64).view(-1, 4)

    def __call__(self, vectors: torch.Tensor) -> dict:
        """Metrics from the input (center) vectors, row i being word i."""
        unit = F.normalize(vectors[: len(self.vocab)].float(), dim=1)
        out: dict = {}
        if self.queries:
            near = {}
            for word, row in self.queries:
                scores = unit @ unit[row]
                scores[row] = -float("inf")
                top = torch.topk(scores, min(self.k, len(self.vocab) - 1)).indices.tolist()
                near[word] = [self.vocab[i] for i in top]
            out["neighbours"] = near
        if self.num_questions:
            correct = 0
            # Questions x vocabulary scores, a chunk of questions at a time (runtime.EVAL_SCORE_CHUNK_BYTES).
            for chunk in torch.split(self.questions, metrics.rows_per_chunk(len(unit))):
                a, b, c, d = chunk.unbind(1)
                scores = (unit[b] - unit[a] + unit[c]) @ unit.T
                for col in (a, b, c):  # the question's own words are never the answer
                    scores.scatter_(1, col[:, None], -float("inf"))
                correct += int((scores.argmax(1) == d).sum())
            out["analogy_accuracy"] = correct / max(1, len(self.questions))
            out["analogy_questions"] = len(self.questions)  # of num_questions, those with all four words known
        return out
