"""two_tower's compiled step: per-rating SGD over the step's batch (`mf_kernel`), on the tables in place.

A step takes the rank's next batch from the data (the same batches, in the same order, as the batch path reads,
so the data's position in a checkpoint is right either way), turns its ids into table rows as a lookup does,
and hands the batch to `mf_kernel.train_ratings`. There is no autograd, no batch of gradients and no optimizer
pass: each rating is two dot products' worth of work on rows that stay in cache. One thread per rank: a step's
few hundred ratings take tens of microseconds, about what handing half of them to another thread would cost.

With several ranks each trains its own shard of the data on its replica of the tables, then the ranks add up
what their step changed (as the skip-gram kind's step does), so every replica holds every rank's
updates, as if the ranks were hogwild threads of one process that see each other's writes one step late. Only
the rows some rank's step touched travel (their changes all-gathered, as the batch path's gradients). Every
rating thus moves the rows by its own full step, as with one rank; the batch path instead averages the ranks'
gradients, so there a rating's step shrinks as ranks are added.

Determinism: a step is a pure function of (tables, batch), so runs and resumes at a fixed world size are the
same bit for bit.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

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
        if self.world_size == 1:
            squared_error = self._train(rows, offsets, labels, lr)
        else:
            touched = torch.from_numpy(np.unique(rows))
            before = self.weight.index_select(0, touched), self.bias.detach().clone()
            squared_error = self._train(rows, offsets, labels, lr)
            self._add_up_ranks(touched, *before)
        return torch.tensor(squared_error / max(len(labels), 1))

    def _add_up_ranks(self, touched: torch.Tensor, rows_before: torch.Tensor, bias_before: torch.Tensor) -> None:
        """Every rank's change of the step on every replica: each row (and the global bias) ends at its value
        before the step plus what each rank's step changed in it. Only rows some rank touched travel, and the
        global bias with them as one more row (index num_rows, its change in the first column): one exchange."""
        bias = self.bias.detach()
        change = torch.zeros(touched.numel() + 1, self.weight.shape[1])
        torch.sub(self.weight.index_select(0, touched), rows_before, out=change[:-1])
        change[-1, 0] = bias[0] - bias_before[0]
        bias_row = self.group.num_rows
        rows, summed = embedding.sum_across_ranks(torch.cat([touched, touched.new_tensor([bias_row])]), change,
                                                  self.world_size)
        rows, summed, bias_change = rows[:-1], summed[:-1], summed[-1, 0]  # sorted: the bias's row comes last
        self.weight.index_copy_(0, touched, rows_before)
        self.weight.index_add_(0, rows, summed)
        self.group.changed[rows] = True  # rows other ranks moved are changed here too (incremental checkpoints)
        bias.copy_(bias_before + bias_change)

    def close(self) -> None:
        pass
