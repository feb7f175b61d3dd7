"""Matrix factorisation of ratings: one pass of per-rating SGD over a batch, compiled by numba.

This is Funk SVD's inner loop as Surprise's `SVD` runs it: for each rating, predict
mu + b_user + b_item + p_user . q_item, take the error e = rating - prediction, and move both vectors (and both
biases) along it at once, from the values they had before the rating: p += step * e * q - decay * p, and
q += step * e * p - decay * q. A tower may sum several features' rows (multi-hot bags too); each row of a tower
then moves along the other tower's summed vector. Rows are updated in place with no locks, so two calls on the
same tables at once would race on shared rows as hogwild threads do (Recht et al. 2011).

How the batch path's settings map onto this step (`sgd.py` passes them so):

- the batch path minimises the batch's mean squared error, whose gradient for one rating is 2 e / batch_size, and
  moves each row by `lr * lr_scale` times it: the step on the error here is 2 lr lr_scale / batch_size per
  rating (the ratings defaults: 2 x 1.28 / 256 = 0.01, where Surprise's `lr_all` is 0.005 on the error; Surprise
  drops the 2 of the derivative, so this is Surprise's SVD at lr_all 0.01);
- the batch path adds `weight_decay x row` to the gradient of each row a step touches, once per step however
  many of the step's ratings name it: here each of a row's k ratings in the batch decays it by
  lr lr_scale weight_decay / k, so a step decays each row it touches by the batch path's amount (the ratings
  defaults: 1.28 x 0.02 / 256 = 1e-4 per step, Surprise's lr_all x reg_all = 0.005 x 0.02 = 1e-4 per rating);
- the global bias (a dense parameter the batch path moves with the dense optimizer, Adam) moves here by SGD on
  the same gradient at the dense lr, 2 dense_lr / batch_size per rating: both settle at the mean rating within
  about an epoch (Surprise fixes it at the mean).

The function is compiled at first use (cached on disk after) and releases the GIL.
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["train_ratings", "warm"]


@numba.njit(nogil=True, fastmath=True, cache=True, boundscheck=False)
def train_ratings(
    rows: np.ndarray,  # int64 [num_ids]: the batch's ids as table rows, feature-major (as Batch.values)
    offsets: np.ndarray,  # int64 [num_features * B + 1]: sample b's ids of feature f are rows[offsets[f*B+b]:...+1]]
    user_features: np.ndarray,  # int64: the features summed into the user tower
    item_features: np.ndarray,  # int64: those summed into the item tower
    labels: np.ndarray,  # float32 [B]: the ratings
    weight: np.ndarray,  # float32 [num_rows, dim]: every table's rows, updated in place
    global_bias: np.ndarray,  # float32 [1]: mu, updated in place (unused without biases)
    biases: bool,  # the last coordinate of each row is its bias
    row_step: np.ndarray,  # float32 [num_rows]: each row's step on the error per unit of `lr`
    row_decay: np.ndarray,  # float32 [num_rows]: each row's decay per step per unit of `lr`
    lr: float,  # the step's learning rate (the sparse optimizer's schedule)
    bias_step: float,  # the global bias's step on the error
    in_batch: np.ndarray,  # int32 [num_rows]: scratch, all zero (and left so)
    changed: np.ndarray,  # bool [num_rows]: set for every row moved (incremental checkpoints save those)
) -> float:
    """Trains on the batch's ratings in order; returns their summed squared error (each before its update)."""
    batch = labels.shape[0]
    dim = weight.shape[1]
    factors = dim - 1 if biases else dim
    user = np.empty(dim, dtype=np.float32)
    item = np.empty(dim, dtype=np.float32)
    num_features = (offsets.shape[0] - 1) // max(batch, 1)
    for f in range(num_features):  # how many of the batch's ratings name each row
        for k in range(offsets[f * batch], offsets[(f + 1) * batch]):
            in_batch[rows[k]] += 1
            changed[rows[k]] = True
    squared_error = 0.0
    for b in range(batch):
        _tower_sum(rows, offsets, user_features, batch, b, weight, user)
        _tower_sum(rows, offsets, item_features, batch, b, weight, item)
        predicted = np.float32(0.0)
        for d in range(factors):
            predicted += user[d] * item[d]
        if biases:
            predicted += user[dim - 1] + item[dim - 1] + global_bias[0]
        error = labels[b] - predicted
        squared_error += error * error
        _move_tower(rows, offsets, user_features, batch, b, weight, item, error, factors, biases, row_step,
                    row_decay, lr, in_batch)
        _move_tower(rows, offsets, item_features, batch, b, weight, user, error, factors, biases, row_step,
                    row_decay, lr, in_batch)
        if biases:
            global_bias[0] += np.float32(bias_step * error)
    for k in range(offsets[0], offsets[num_features * batch]):
        in_batch[rows[k]] = 0
    return squared_error


@numba.njit(nogil=True, inline="always")
def _tower_sum(rows, offsets, features, batch, b, weight, out) -> None:
    """Sample b's tower: the sum of its features' rows."""
    out[:] = 0.0
    for f in features:
        for k in range(offsets[f * batch + b], offsets[f * batch + b + 1]):
            r = rows[k]
            for d in range(weight.shape[1]):
                out[d] += weight[r, d]


@numba.njit(nogil=True, inline="always")
def _move_tower(rows, offsets, features, batch, b, weight, other, error, factors, biases, row_step, row_decay, lr,
                in_batch) -> None:
    """Each row of sample b's tower one SGD step along the other tower's vector, with its share of the decay."""
    for f in features:
        for k in range(offsets[f * batch + b], offsets[f * batch + b + 1]):
            r = rows[k]
            step = np.float32(lr * row_step[r] * error)
            keep = np.float32(1.0 - lr * row_decay[r] / in_batch[r])
            for d in range(factors):
                weight[r, d] = weight[r, d] * keep + step * other[d]
            if biases:
                last = weight.shape[1] - 1
                weight[r, last] = weight[r, last] * keep + step


def warm() -> None:
    """Compile `train_ratings` for the argument types `sgd.py` passes it, on an empty batch
    (kembed_trainer.kernel_cache builds the platform's cache with this)."""
    weight = np.zeros((1, 2), dtype=np.float32)
    features = np.zeros(1, dtype=np.int64)
    step = np.zeros(1, dtype=np.float32)
    train_ratings(np.zeros(0, np.int64), np.zeros(1, np.int64), features, features, np.zeros(0, np.float32), weight,
                  np.zeros(1, np.float32), True, step, step.copy(), 0.01, 0.01, np.zeros(1, np.int32),
                  np.zeros(1, np.bool_))
