"""`word2vec`'s trainer half: skip-gram with negative sampling. Its contract half:
`kembed_contract.kinds.models.word2vec`.

It does not go through the batch/autograd loop: its step is word2vec.c's and gensim's algorithm in compiled code
(`sgns_kernel`, numba), driven by `sgd` on the tables in place. The dense model (`model.SkipGram`) only scores
eval pairs. Each eval adds the neighbours of chosen words and analogy accuracy (`word_eval`); exports add the
word2vec tool's formats (`formats`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kembed_contract import trainer_config as config
from kembed_contract.kinds.models.word2vec import CENTER
from kembed_trainer.models.base import CompiledStep, Evaluator, ModelTraining
from kembed_trainer.models.word2vec import formats, word_eval
from kembed_trainer.models.word2vec.model import SkipGram

__all__ = ["KIND", "Word2VecTraining"]


class Word2VecTraining(ModelTraining):
    writers = {"word2vec-text": formats.write_text, "word2vec-binary": formats.write_binary}
    kernel_modules = ("kembed_trainer.models.word2vec.sgns_kernel",)

    def dense_model(self, cfg: config.TrainerConfig) -> nn.Module:
        return SkipGram(features=cfg.embeddings.features)

    def compiled_step(self, cfg: config.TrainerConfig, *, data: Any, embeddings: Any, model: nn.Module,
                      total_steps: int, rank: int, world_size: int) -> CompiledStep:
        """Compiled code straight on the tables: no batches, no autograd, no optimizer."""
        # numba only where it is used: other models start faster.
        from kembed_trainer.models.word2vec import sgd

        return sgd.SkipGramSGD(cfg, data, embeddings, total_steps=total_steps, threads=torch.get_num_threads(),
                               rank=rank, world_size=world_size)

    def evaluator(self, cfg: config.TrainerConfig, *, model: nn.Module, embeddings: Any, data: Any, guard: Any,
                  device: torch.device) -> Evaluator:
        evaluation = cfg.evaluation
        checks = word_eval.WordEval(data.vocab, neighbours_of=evaluation.neighbours_of, k=evaluation.neighbours_k,
                                    analogies_uri=evaluation.analogies_uri, guard=guard)
        center = next(t.name for t in cfg.embeddings.tables if CENTER in t.features)
        return _WordChecks(checks, embeddings, center)


class _WordChecks:
    """Neighbours and analogies from the input (center) vectors, after the eval pairs."""

    def __init__(self, checks: word_eval.WordEval, embeddings: Any, center: str) -> None:
        self.checks, self.embeddings, self.center = checks, embeddings, center

    def on_batch(self, pooled: list[torch.Tensor]) -> None:
        pass

    def finish(self, labels: torch.Tensor) -> dict[str, Any]:
        return self.checks(self.embeddings.full_weight(self.center))


KIND = Word2VecTraining()
