"""word2vec's training step: hogwild SGD over the step's sentences, in compiled code, on the tables in place.

A step hands the rank's next `batch_size` words of sentences to `sgns_kernel.train_sentences`, split among
`threads` threads that update the center and context tables at once (hogwild, as gensim's workers). There is
no autograd, no batch of pairs in memory and no optimizer pass: each (center, target) sample is one dot
product and two axpys on rows that stay in cache.

With several ranks each trains its own shard of the sentences on its replica of the tables, then the ranks
add up what their step changed (an all-reduce of the change) so every replica holds every rank's updates, as
if the ranks were hogwild threads of one process that see each other's writes one step late.

Determinism: with one thread per rank, a step is a pure function of (tables, seed, rank, step), so runs and
resumes are bit for bit the same at a fixed world size. With more threads per rank the threads race on
frequent rows by design, and runs differ in the last bits (as gensim's with several workers).
"""

from __future__ import annotations

import concurrent.futures

import numpy as np
import torch
import torch.distributed as dist

from kembed_contract import trainer_config as config
from kembed_contract.kinds.models.word2vec import CENTER, CONTEXT
from kembed_trainer import embedding, sparse_optim
from kembed_trainer.data import text
from kembed_trainer.data.synthetic import _generator
from kembed_trainer.models.word2vec import sgns_kernel

__all__ = ["SkipGramSGD"]


class SkipGramSGD:
    def __init__(
        self,
        cfg: config.TrainerConfig,
        data: text.TextData,
        embeddings: embedding.EmbeddingCollection,
        *,
        total_steps: int,
        threads: int,
        rank: int,
        world_size: int,
    ) -> None:
        self.data, self.opt, self.total_steps = data, cfg.optimizer.sparse, total_steps
        self.seed, self.rank, self.world_size = cfg.training.seed, rank, world_size
        (group,) = embeddings.groups  # both tables have one width (config checks it)
        self.weight = group.weight  # the two tables stacked: what ranks reconcile
        by_feature = {f: i for i, t in enumerate(group.tables) for f in t.features}
        tables = {f: group.tables[i] for f, i in by_feature.items()}
        self.center = self.weight[group.table_slices(by_feature[CENTER])].numpy()
        self.context = self.weight[group.table_slices(by_feature[CONTEXT])].numpy()
        self.lr_scale = (tables[CENTER].lr_scale, tables[CONTEXT].lr_scale)
        # The step's sentences (data.train_sentences): word ids, and where each sentence starts.
        self.tokens, self.offsets = np.zeros(0, np.int64), np.zeros(1, np.int64)
        # Kernel forms of the data's distributions: keep when keep >= a uniform uint32; noise by the alias method.
        self.keep = np.minimum(data.keep_prob.numpy() * 2.0**32, 2.0**32 - 1).astype(np.uint32)
        self.noise_accept, self.noise_alias = sgns_kernel.noise_tables(np.diff(data.noise_cdf.numpy(), prepend=0.0))
        self.window, self.negatives = data.cfg.window, data.cfg.negatives
        self.threads = threads
        self.pool = concurrent.futures.ThreadPoolExecutor(threads) if threads > 1 else None
        self._before = torch.empty_like(self.weight) if world_size > 1 else None
        self._train(0, 0, 0.0, 0.0, seed=0)  # compile (or load from numba's cache) before the first step

    def _train(self, first: int, last: int, lr_first: float, lr_last: float, *, seed: int):
        return sgns_kernel.train_sentences(
            self.tokens,
            self.offsets,
            first,
            last,
            self.center,
            self.context,
            self.keep,
            self.noise_accept,
            self.noise_alias,
            self.window,
            self.negatives,
            lr_first,
            lr_last,
            *self.lr_scale,
            seed,
        )

    def step(self, step: int) -> torch.Tensor:
        """Train on the step's sentences; the mean loss per (center, target) sample of this rank."""
        self.tokens, self.offsets = self.data.train_sentences(step)
        first, last = 0, len(self.offsets) - 1
        lr_first = sparse_optim.learning_rate(self.opt, step, self.total_steps)
        lr_last = sparse_optim.learning_rate(self.opt, step + 1, self.total_steps)
        if self._before is not None:
            self._before.copy_(self.weight)
        parts = self._split(first, last)
        seeds = _generator(self.seed, 6, self.rank, step).initial_seed()
        span = max(1, self.offsets[last] - self.offsets[first])
        jobs = []
        for i, (lo, hi) in enumerate(parts):
            # Each part's rate is its share of the step's linear decay, from where it starts to where it ends.
            a = (self.offsets[lo] - self.offsets[first]) / span
            b = (self.offsets[hi] - self.offsets[first]) / span
            lr_lo, lr_hi = lr_first + (lr_last - lr_first) * a, lr_first + (lr_last - lr_first) * b
            jobs.append((lo, hi, lr_lo, lr_hi, (seeds + i * 0x9E3779B97F4A7C15) & 0xFFFF_FFFF_FFFF))
        if self.pool is None or len(jobs) == 1:
            results = [self._train(*job[:4], seed=job[4]) for job in jobs]
        else:
            results = list(self.pool.map(lambda job: self._train(*job[:4], seed=job[4]), jobs))
        loss = sum(r[0] for r in results)
        samples = sum(r[1] for r in results)
        if self._before is not None:
            # Every rank adds every rank's change: weight = before + sum over ranks of (weight_r - before).
            self.weight.sub_(self._before)
            dist.all_reduce(self.weight)
            self.weight.add_(self._before)
        return torch.tensor(loss / max(samples, 1))

    def _split(self, first: int, last: int) -> list[tuple[int, int]]:
        """`threads` runs of whole sentences with about as many words each."""
        if self.threads == 1 or last - first < 2:
            return [(first, last)]
        lo, hi = self.offsets[first], self.offsets[last]
        cuts = np.searchsorted(self.offsets[first:last], np.linspace(lo, hi, self.threads + 1)[1:-1]) + first
        bounds = [first, *sorted(set(int(c) for c in cuts)), last]
        return [(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()
