"""`synthetic` data's trainer half (its contract half: `kembed_contract.kinds.data.synthetic`). Synthetic CTR
data: Zipf-distributed ids and a planted signal a model can learn.

Each id of each feature has a hidden score, and the ids of the first two features (user and item, say) also a
hidden factor vector. A sample's latent value is the sum of its ids' scores, the dot product of the first two
features' factors, and a linear function of its dense features. Binary labels (clicks) are drawn from
sigmoid(latent); ratings are the latent value plus noise. Frequent ids are seen often enough to learn, rare
ones are not, as in real logs, so the learnable AUC sits well above 0.5 and below the Bayes AUC.

Every batch is a pure function of (seed, stream, rank, step): resuming at step N needs no data state, and a
resumed run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from kembed_contract import trainer_config as config
from kembed_contract.kinds.data.synthetic import EVAL_CHUNK as _EVAL_CHUNK
from kembed_trainer.data.batch import Batch
from kembed_trainer.storage import Guard

__all__ = ["SyntheticData", "build"]

_TRAIN, _EVAL, _WORLD = 0, 1, 2
_FACTOR_DIM = 4
_RATING_MEAN, _RATING_NOISE = 3.0, 0.3


def _generator(*key: int) -> torch.Generator:
    seed = int(np.random.SeedSequence([k & 0xFFFFFFFF for k in key]).generate_state(1, dtype=np.uint64)[0])
    return torch.Generator().manual_seed(seed)


class _Feature:
    """One sparse feature: its id distribution and the hidden per-id score."""

    def __init__(self, num_ids: int, alpha: float, gen: torch.Generator) -> None:
        ranks = torch.arange(1, num_ids + 1, dtype=torch.float64)
        pmf = ranks.pow(-alpha)
        self.cdf = torch.cumsum(pmf / pmf.sum(), 0)
        self.cdf[-1] = 1.0
        # Spread popular ids over the table instead of packing them into the first rows.
        self.scramble = torch.randperm(num_ids, generator=gen)
        self.score = torch.randn(num_ids, 1, generator=gen)
        self.factor = torch.randn(num_ids, _FACTOR_DIM, generator=gen) / _FACTOR_DIM**0.25
        self.num_ids = num_ids

    def sample(self, n: int, gen: torch.Generator) -> torch.Tensor:
        u = torch.rand(n, generator=gen, dtype=torch.float64)
        rank = torch.searchsorted(self.cdf, u).clamp_(max=self.num_ids - 1)
        return self.scramble[rank]


class SyntheticData:
    def __init__(
        self,
        cfg: config.SyntheticDataConfig,
        *,
        tables: list[config.TableConfig],
        seed: int,
        batch_size: int,
        rank: int,
        world_size: int,
        ratings: bool = False,
    ) -> None:
        self.cfg = cfg
        self.ratings = ratings
        self.seed = seed
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        gen = _generator(seed, _WORLD)
        by_feature = {f: t for t in tables for f in t.features}
        ordered = [f for t in sorted(tables, key=lambda t: t.embedding_dim) for f in t.features]
        self.features = [_Feature(cfg.ids_of(by_feature[f]), cfg.zipf_alpha, gen) for f in ordered]
        self.feature_weight = torch.randn(len(self.features), generator=gen).abs_() + 0.5
        self.dense_weight = torch.randn(cfg.num_dense, generator=gen)
        # Scale so that the noiseless logit has unit variance times `signal`.
        total_var = self.feature_weight.pow(2).sum() + self.dense_weight.pow(2).sum() + 1.0
        self.scale = cfg.signal * 2.0 / total_var.sqrt().item()

    def counts(self) -> dict[str, int]:
        """Synthetic data is endless; its eval set (every rank generates its share) has a size."""
        return {"eval_rows": sum(min(_EVAL_CHUNK, self.cfg.eval_samples - i * _EVAL_CHUNK)
                                 for i in range(self.rank, -(-self.cfg.eval_samples // _EVAL_CHUNK), self.world_size))}

    def train_batch(self, step: int) -> Batch:
        return self._batch(self.batch_size, _generator(self.seed, _TRAIN, self.rank, step))

    def eval_batches(self):
        """This rank's share of the held-out set (same generator, its own seed stream)."""
        num_chunks = -(-self.cfg.eval_samples // _EVAL_CHUNK)
        for i in range(self.rank, num_chunks, self.world_size):
            n = min(_EVAL_CHUNK, self.cfg.eval_samples - i * _EVAL_CHUNK)
            yield self._batch(n, _generator(self.seed, _EVAL, i))

    def _batch(self, n: int, gen: torch.Generator) -> Batch:
        cfg = self.cfg
        dense = torch.randn(n, cfg.num_dense, generator=gen)
        logit = dense @ self.dense_weight
        values, lengths, factors = [], [], []
        for weight, feat in zip(self.feature_weight.tolist(), self.features, strict=True):
            hot = torch.randint(cfg.min_hotness, cfg.max_hotness + 1, (n,), generator=gen)
            ids = feat.sample(int(hot.sum()), gen)
            offsets = torch.cumsum(hot, 0) - hot
            logit += weight * F.embedding_bag(ids, feat.score, offsets, mode="mean").squeeze(1)
            if len(factors) < 2:
                factors.append(F.embedding_bag(ids, feat.factor, offsets, mode="mean"))
            values.append(ids)
            lengths.append(hot)
        if len(factors) == 2:
            logit += (factors[0] * factors[1]).sum(1)
        latent = self.scale * logit
        if self.ratings:
            labels = _RATING_MEAN + latent + _RATING_NOISE * torch.randn(n, generator=gen)
        else:
            labels = (torch.rand(n, generator=gen) < torch.sigmoid(latent)).float()
        return Batch(dense=dense, values=torch.cat(values), lengths=torch.cat(lengths), labels=labels)


def build(cfg: config.TrainerConfig, *, rank: int, world_size: int, guard: Guard) -> SyntheticData:
    """The source of `cfg.data` (the data registry's entry, kembed_trainer.kinds): reads no file. Its labels are
    ratings where the model learns ratings, else clicks."""
    return SyntheticData(cfg.data, ratings=cfg.ratings, tables=cfg.embeddings.tables, seed=cfg.training.seed,
                         batch_size=cfg.training.batch_size, rank=rank, world_size=world_size)
