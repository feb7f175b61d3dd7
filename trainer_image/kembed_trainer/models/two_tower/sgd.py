"""two_tower's compiled step: per-rating SGD over the step's batch (`mf_kernel`), on the tables in place.

A step takes the rank's next batch from the data (the same batches, in the same order, as the batch path reads,
so the data's position in a checkpoint is right either way), turns its ids into table rows as a lookup does,
and hands the batch to `mf_kernel.train_ratings`. There is no autograd, no batch of gradients and no optimizer
pass: each rating is two dot products' worth of work on rows that stay in cache. One thread per rank: a step's
few hundred ratings take tens of microseconds, about what handing half of them to another thread would cost.

With several ranks each trains its own shard of the data on its replica of the tables, then the ranks add up
what their step changed (an all-reduce of the change, as word2vec's `sgd`), so every replica holds every rank's
updates, as if the ranks were hogwild threads of one process that see each other's writes one step late. Every
rating thus moves the rows by its own full step, as with one rank; the batch path instead averages the ranks'
gradients, so there a rating's step shrinks as ranks are added.

Determinism: a step is a pure function of (tables, batch), so runs and resumes at a fixed world size are the
same bit for bit.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from kembed_contract import trainer_config as config
from kembed_trainer import embedding, sparse_optim
from kembed_trainer.models.two_tower import mf_kernel

__all__ = ["RatingsSGD"]


class RatingsSGD:
    def __init__(
        self,
        cfg: config.TrainerConfig,
        data: Any,  # any data source of rows: `train_batch(step) -> Batch`
        embeddings: embedding.EmbeddingCollection,
        *,
        global_bias: torch.Tensor | None,
        total_steps: int,
        world_size: int,
    ) -> None:
        """`global_bias`: the model's (a [1] tensor), moved in place; None for a model without biases."""
        self.data, self.embeddings, self.opt, self.total_steps = data, embeddings, cfg.optimizer.sparse, total_steps
        (self.group,) = embeddings.groups  # two_tower's check makes every table one width; the kind one in memory
        group = self.group
        assert group.num_replicated_rows == group.num_rows, "compiled_unfit refuses sharded tables"
        self.weight = group.weight
        position = {f: i for i, f in enumerate(group.features)}  # a feature's place in the group's lookups
        self.user_features = np.array([position[f] for f in cfg.model.user_features], dtype=np.int64)
        self.item_features = np.array([position[f] for f in cfg.model.item_features], dtype=np.int64)
        batch_size = cfg.training.batch_size
        table_of_row = group.repl_table(torch.arange(group.num_rows))
        # The batch path's per-row lr and weight decay as the kernel's per-rating step and per-step decay
        # (mf_kernel's docstring says how they map).
        self.row_step = (2.0 * group.lr_scale[table_of_row] / batch_size).float().numpy()
        self.row_decay = (group.lr_scale[table_of_row] * group.weight_decay[table_of_row]).float().numpy()
        self.biases = global_bias is not None
        self.bias = global_bias if global_bias is not None else torch.zeros(1)
        self.bias_step = 2.0 * cfg.optimizer.dense.lr / batch_size
        self.in_batch = np.zeros(group.num_rows, dtype=np.int32)
        # NumPy views of what the kernel moves (a checkpoint's restore loads into these tensors in place).
        self._arrays = (self.weight.numpy(), self.bias.detach().numpy(), group.changed.numpy())
        self.world_size = world_size
        self._before = (torch.empty_like(self.weight), torch.empty_like(self.bias)) if world_size > 1 else None
        self._train(np.zeros(0, np.int64), np.zeros(1, np.int64), np.zeros(0, np.float32), 0.0)  # compile or load

    def _train(self, rows: np.ndarray, offsets: np.ndarray, labels: np.ndarray, lr: float) -> float:
        weight, bias, changed = self._arrays
        return mf_kernel.train_ratings(rows, offsets, self.user_features, self.item_features, labels, weight, bias,
                                       self.biases, self.row_step, self.row_decay, lr, self.bias_step,
                                       self.in_batch, changed)

    def step(self, step: int) -> torch.Tensor:
        """Train on the step's batch; its mean squared error (each rating's before its update)."""
        batch = self.data.train_batch(step)
        ((values, _, lengths),) = self.embeddings.inputs(batch)
        rows = self.group.rows_of(values, step).numpy()
        offsets = np.zeros(lengths.numel() + 1, dtype=np.int64)
        np.cumsum(lengths.reshape(-1).numpy(), out=offsets[1:])
        labels = batch.labels.numpy()
        lr = sparse_optim.learning_rate(self.opt, step, self.total_steps)
        if self._before is not None:
            self._before[0].copy_(self.weight)
            self._before[1].copy_(self.bias.detach())
        squared_error = self._train(rows, offsets, labels, lr)
        if self._before is not None:
            # Every rank adds every rank's change: weight = before + sum over ranks of (weight_r - before).
            for tensor, before in zip((self.weight, self.bias.detach()), self._before, strict=True):
                tensor.sub_(before)
                dist.all_reduce(tensor)
                if tensor is self.weight:  # rows other ranks moved are changed here too
                    self.group.changed.logical_or_(tensor.ne(0).any(1))
                tensor.add_(before)
        return torch.tensor(squared_error / max(len(labels), 1))

    def close(self) -> None:
        pass
